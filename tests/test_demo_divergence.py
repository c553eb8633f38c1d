"""`kvtier demo` when kvtier's tokens differ from recomputation's: where, and by how much.

Before, the logit difference was measured only over requests whose tokens matched (a run whose
tokens differed reported "max logit difference 0.0e+00"), nothing said which request differed,
and each run continued its conversations with its own replies, so every later turn of a
differing conversation compared two different prompts. Also the p90 TTFT, one rank high."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from kvtier.cli import main

TINY = ["--conversations", "2", "--turns", "2", "--system-tokens", "16", "--user-tokens", "8",
        "--new-tokens", "4"]  # fmt: skip


def _break_second_request(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[torch.Tensor]]:
    """Make kvtier's reply to its second request (conversation 1, turn 0) differ at token 1,
    with a logit error of 100 there and 1000 at token 3 (after the divergence, whose inputs
    already differ); record every prompt each run sees."""
    import kvtier.integrations.hf.prefix as prefix
    from kvtier.integrations.hf.generator import KVTierGenerator

    prompts: dict[str, list[torch.Tensor]] = {"kvtier": [], "recompute": []}
    real_one = KVTierGenerator.generate_one
    real_greedy = prefix.generate_greedy

    def generate_one(self: KVTierGenerator, prompt: torch.Tensor, n: int) -> Any:
        prompts["kvtier"].append(prompt.clone())
        res = real_one(self, prompt, n)
        if len(prompts["kvtier"]) != 2:
            return res
        tokens, logits = res.tokens.clone(), res.logits.clone()
        tokens[1] = (tokens[1] + 1) % logits.shape[-1]
        logits[1, 0] += 100.0
        logits[3, 0] += 1000.0
        return dataclasses.replace(res, tokens=tokens, logits=logits)

    def generate_greedy(model: Any, input_ids: torch.Tensor, *args: Any, **kw: Any) -> Any:
        prompts["recompute"].append(input_ids[0].clone())
        return real_greedy(model, input_ids, *args, **kw)

    monkeypatch.setattr(KVTierGenerator, "generate_one", generate_one)
    monkeypatch.setattr(prefix, "generate_greedy", generate_greedy)
    return prompts


def test_a_differing_reply_is_located_and_its_logit_error_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _break_second_request(monkeypatch)
    out = tmp_path / "demo.json"
    assert main(["demo", *TINY, "--json", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["identical_outputs"] is False
    # Token 1's error counts; token 3's, after the divergence, does not.
    assert 99 < report["max_logit_diff"] < 101
    assert report["differing_requests"] == 1
    assert report["first_divergence"] == {"request": 1, "conversation": 1, "turn": 0, "token": 1}
    printed = " ".join(capsys.readouterr().out.split())
    assert "DIFFERENT with and without kvtier in 1 of 4 requests" in printed
    assert "first at request 1 (conversation 1, turn 0), reply token 1" in printed
    assert "max logit difference 1.0e+02" in printed


def test_both_runs_see_the_same_prompts_after_a_divergence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompts = _break_second_request(monkeypatch)
    assert main(["demo", *TINY, "--quiet"]) == 1
    assert len(prompts["kvtier"]) == len(prompts["recompute"]) == 4
    for k, r in zip(prompts["kvtier"], prompts["recompute"], strict=True):
        assert torch.equal(k, r)


def test_identical_runs_report_no_divergence(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    assert main(["demo", *TINY[:4], "--turns", "1", "--quiet", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["differing_requests"], report["first_divergence"]) == (0, None)


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        (range(1, 11), 0.9, 9),
        (range(1, 21), 0.9, 18),
        (range(1, 11), 0.7, 7),  # 0.7 * 10 is 7.000000000000001 in floating point
        (range(1, 11), 0.5, 5),
        ([3.0], 0.9, 3),
        (range(1, 33), 0.9, 29),  # the default workload's 32 requests: ceil(28.8)
    ],
)
def test_p90_is_the_nearest_rank(values: Any, q: float, expected: float) -> None:
    from kvtier.demo import _percentile

    assert _percentile([float(v) for v in values], q) == expected
