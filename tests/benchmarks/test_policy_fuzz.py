"""The random trace families behind docs/kvaware-evaluation.md's "Random trace families" figures."""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from policy_fuzz import FAMILIES, _seeds, chat, documents, draw, loop


def test_a_seed_draws_the_same_trace_and_seeds_differ() -> None:
    first, params = draw(5)
    assert draw(5) == (first, params)
    assert draw(6)[0] != first
    assert params["family"] in (*FAMILIES, "phases")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_reaches_its_access_count_and_reuses_blocks(family: str) -> None:
    requests, _ = FAMILIES[family](random.Random(1), 5_000)
    accesses = sum(map(len, requests))
    assert 5_000 <= accesses < 5_000 + max(map(len, requests)) + 1
    uses = Counter(b for r in requests for b in r)
    assert len(uses) < accesses  # something repeats, or no policy could differ
    assert all(len(set(r)) == len(r) for r in requests)  # chained ids: no block twice in one


def test_chat_turns_resend_the_session_context() -> None:
    requests, params = chat(random.Random(3), 8_000)
    seen = {tuple(r) for r in requests}
    # A session's later turn starts with its previous request, whole.
    extends = sum(1 for r in requests if any(tuple(r[:n]) in seen for n in range(1, len(r))))
    assert extends > len(requests) // 3
    assert params["system_blocks"] > 0  # seed 3 draws a shared system prompt
    assert len({tuple(r[: params["system_blocks"]]) for r in requests}) == 1


def test_agents_add_at_most_four_blocks_a_turn() -> None:
    requests, params = FAMILIES["agent"](random.Random(2), 8_000)
    assert params["live"] <= 60 and params["turn_blocks"] == 4
    seen: set[tuple[int, ...]] = set()
    growth = []
    for r in requests:
        previous = max((n for n in range(1, len(r)) if tuple(r[:n]) in seen), default=0)
        if previous:
            growth.append(len(r) - previous)
        seen.add(tuple(r))
    assert len(growth) > len(requests) // 2
    assert set(growth) <= {1, 2, 3, 4}


def test_documents_are_asked_about_within_their_bounds() -> None:
    requests, params = documents(random.Random(4), 20_000)
    lo, hi = params["blocks"]
    docs = Counter(tuple(r[2:-1]) for r in requests)
    assert all(lo <= len(d) <= hi for d in docs)
    assert max(docs.values()) <= params["questions"][1]
    assert len({r[-1] for r in requests}) == len(requests)  # questions are one-off


def test_a_loop_cycles_through_the_same_requests() -> None:
    requests, params = loop(random.Random(7), 30_000)
    counts = Counter(tuple(r) for r in requests)
    repeated = [r for r, n in counts.items() if n > 1]
    assert 0 < len(repeated) <= params["loop_requests"]
    assert all(len(r) == params["request_blocks"] for r in requests)


def test_phases_share_no_blocks() -> None:
    seed = next(s for s in range(100) if draw(s)[1]["family"] == "phases")
    requests, params = draw(seed)
    phase_of = {b >> 40 for r in requests for b in r}
    assert len(phase_of) == len(params["phases"]) >= 2
    assert all(len({b >> 40 for b in r}) == 1 for r in requests)


@pytest.mark.parametrize("text", ["5:5", "9:3", "a:b", "x"])
def test_bad_seed_ranges_are_rejected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
        _seeds(text)


def test_seed_ranges() -> None:
    assert _seeds("3:7") == range(3, 7)
    assert _seeds("4") == range(4, 5)


def test_progress_goes_to_stderr_and_stdout_keeps_the_results(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The seed counter was printed on stdout, between the cells below LRU.
    from concurrent.futures import ThreadPoolExecutor

    import policy_fuzz

    def tiny(seed: int) -> policy_fuzz.Draw:
        requests, params = loop(random.Random(seed), 300)
        return requests, {"family": "loop", **params}

    monkeypatch.setattr(policy_fuzz, "draw", tiny)
    monkeypatch.setattr(policy_fuzz, "worker_pool", ThreadPoolExecutor)
    argv = ["policy_fuzz.py", "--seeds", "0:6", "--policies", "lru,sieve", "--jobs", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    policy_fuzz.main()
    out, err = capsys.readouterr()
    assert "seeds]" not in out
    assert err.splitlines() == ["[5/6 seeds]", "[6/6 seeds]"]
    assert "seeds 0:6, 24 cells, flat mode" in out
