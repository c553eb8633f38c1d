"""The stress workloads behind docs/kvaware-evaluation.md's "Where it loses to LRU" figures."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from policy_stress import bursty_documents, few_sessions_chat


def test_documents_are_reused_within_their_bounds_behind_one_system_prompt() -> None:
    requests = bursty_documents(3, 400, live=4, doc_blocks=(5, 9), reuses=(2, 3))
    assert requests == bursty_documents(3, 400, live=4, doc_blocks=(5, 9), reuses=(2, 3))
    assert len({tuple(r[:2]) for r in requests}) == 1
    uses = Counter(tuple(r[2:-1]) for r in requests)
    assert all(5 <= len(doc) <= 9 for doc in uses)
    # Every document but those still live at the end was asked 2 or 3 times.
    assert sum(1 for n in uses.values() if n not in (2, 3)) <= 4
    assert len({r[-1] for r in requests}) == len(requests)  # questions are one-off


def test_chat_turns_extend_their_session_context() -> None:
    requests = few_sessions_chat(1, 300, live=4, max_turns=30)
    full = {tuple(r[:-1]) for r in requests}
    # Most turns after a session's first start with the full blocks of an earlier turn.
    extends = sum(
        1 for r in requests if any(r[: len(p)] == list(p) for p in full if 4 < len(p) < len(r) - 1)
    )
    assert extends > len(requests) // 2
    assert max(len(r) for r in requests) > 40
