"""`OffloadingScheduler(proof_chunks=N)`, for EAGLE/MTP drafter groups whose KV at a position
depends on the tokens after it: a chunk is loaded only if the next N chunks hit too, and a
decoding request's last N computed chunks are not stored yet. The vLLM side is
tests/integrations/vllm/test_eagle_proof.py."""

from __future__ import annotations

import pytest

from engine_sim import block_hashes
from kvtier.base import TransferResult
from kvtier.connector import OffloadingScheduler, StepProgress
from kvtier.cpu import CPUOffloadingManager

TPB = 4


def stored(s: OffloadingScheduler, rid: str, progress: list[tuple[int, int]]) -> list[int]:
    """Run steps reaching each (computed tokens, prompt tokens) in turn; the chunks stored."""
    chunks = []
    for computed, prompt in progress:
        s.extend_prompt(rid, prompt)
        meta = s.build_step_metadata([StepProgress(rid, [list(range(64))], computed)])
        for job in meta.stores:
            chunks.append(len(job.device_blocks))
            s.on_worker_results([TransferResult(job.job_id, True)])
    return chunks


@pytest.mark.parametrize("proof", [0, 1, 2])
def test_a_load_stops_proof_chunks_before_the_end_of_the_hit_run(proof: int) -> None:
    s = OffloadingScheduler(CPUOffloadingManager(64), tokens_per_block=TPB, proof_chunks=proof)
    hashes = block_hashes("a", 6)
    s.add_request("a", hashes, 6 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    s.update_state_after_alloc("a", [list(range(7))], 0)
    assert stored(s, "a", [(6 * TPB, 6 * TPB + 1)]) == [6]
    # b shares 4 chunks and goes on; c shares all 6 and ends inside the sixth's successor.
    b = [*hashes[:4], *block_hashes("b", 3, hashes[:4])[4:]]
    for rid, hs, prompt, run in (("b", b, 7 * TPB + 1, 4), ("c", hashes, 6 * TPB + 1, 6)):
        s.add_request(rid, hs, prompt)
        # The device holds the first chunk already: the load starts after it.
        assert s.get_num_new_matched_tokens(rid, TPB) == (run - proof - 1) * TPB
    # A request whose hit run is no longer than the proof gets nothing.
    s.add_request("d", hashes[:2], 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("d", 0) == (2 - proof if proof < 2 else 0) * TPB


def test_a_decoding_request_keeps_its_last_chunk_until_a_later_one_is_computed() -> None:
    s = OffloadingScheduler(CPUOffloadingManager(64), tokens_per_block=TPB, proof_chunks=1)
    hashes = block_hashes("a", 8)
    s.add_request("a", hashes, 2 * TPB + 1)
    assert s.get_num_new_matched_tokens("a", 0) == 0
    s.update_state_after_alloc("a", [list(range(9))], 0)
    prompt = 2 * TPB + 1
    # The prefill's chunks are final (a drafter's next token there is a prompt token).
    assert stored(s, "a", [(2 * TPB, prompt)]) == [2]
    # Decoding: the last computed chunk waits for the next one, as drafts may still change it.
    assert stored(s, "a", [(4 * TPB, prompt), (4 * TPB + 3, prompt)]) == [1]
    assert stored(s, "a", [(5 * TPB, prompt)]) == [1]
    # Without the proof, every computed chunk is stored at once.
    s2 = OffloadingScheduler(CPUOffloadingManager(64), tokens_per_block=TPB)
    s2.add_request("a", hashes, prompt)
    assert s2.get_num_new_matched_tokens("a", 0) == 0
    s2.update_state_after_alloc("a", [list(range(9))], 0)
    assert stored(s2, "a", [(2 * TPB, prompt), (4 * TPB, prompt), (5 * TPB, prompt)]) == [2, 2, 1]


@pytest.mark.parametrize("bad", [-1, True, 1.0, "1", None])
def test_a_bad_proof_chunks_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"proof_chunks=.* is invalid; expected an integer >= 0"):
        OffloadingScheduler(
            CPUOffloadingManager(4),
            tokens_per_block=TPB,
            proof_chunks=bad,  # type: ignore[arg-type]
        )
