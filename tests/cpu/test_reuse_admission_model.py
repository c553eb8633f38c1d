"""Reuse admission against a plain model: threshold semantics and the tracker's size bound.

A key is admitted on the offer of its `store_threshold`-th distinct request; the tracker holds
at most `max_tracker_size` keys, the most recently offered ones, and never drops a key of the
offer in progress to make room for another of the same offer (it keeps the offer's first keys).
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from helpers import key
from kvtier.admission import ReuseAdmission
from kvtier.base import OffloadKey, ReqContext
from kvtier.cpu import CPUOffloadingManager


class Model:
    def __init__(self, threshold: int, size: int) -> None:
        self.threshold, self.size = threshold, size
        self.seen: OrderedDict[OffloadKey, list[str]] = OrderedDict()

    def offer(self, keys: list[OffloadKey], req: str) -> list[OffloadKey]:
        admitted = []
        for k in keys:
            ids = set(self.seen.get(k, ())) | {req}
            if k in self.seen and len(ids) >= self.threshold:
                admitted.append(k)
        offered = list(dict.fromkeys(keys))
        fresh = [k for k in offered if k not in self.seen]
        for k in keys:  # a key offered twice is the more recent at its later place
            if k in self.seen:
                ids_k = self.seen[k]
                if req not in ids_k and len(ids_k) < self.threshold:
                    ids_k.append(req)
                self.seen.move_to_end(k)
        older = [k for k in self.seen if k not in offered]
        while older and len(self.seen) + len(fresh) > self.size:
            del self.seen[older.pop(0)]
        for k in fresh:
            if len(self.seen) < self.size:
                self.seen[k] = [req]
        return admitted


@pytest.mark.parametrize("threshold", [2, 3, 4])
@pytest.mark.parametrize("size", [1, 2, 5, 40])
def test_reuse_admission_matches_the_model(threshold: int, size: int) -> None:
    for seed in range(20):
        rng = random.Random(seed)
        adm, model = ReuseAdmission(threshold, size), Model(threshold, size)
        universe = [key(i) for i in range(12)]
        for _ in range(300):
            keys = rng.choices(universe, k=rng.randint(0, 7))
            ctx = ReqContext(req_id=rng.choice("abcdef"))
            want = model.offer(keys, ctx.req_id)
            assert adm.preview(keys, ctx) == want
            assert adm.admit(keys, ctx) == want
            assert adm.table_sizes()["tracker"] <= size
            assert list(adm._seen) == list(model.seen)
            assert {k: set(v) for k, v in adm._seen.items()} == {
                k: set(v) for k, v in model.seen.items()
            }


def test_manager_stores_a_key_on_its_thresholdth_distinct_request() -> None:
    mgr = CPUOffloadingManager(4, store_threshold=3, max_tracker_size=8)
    k = key(1)
    for req, stored in (("a", False), ("a", False), ("b", False), ("b", False), ("c", True)):
        out = mgr.prepare_store([k], ReqContext(req_id=req))
        assert out is not None
        assert out.keys_to_store == ([k] if stored else [])
    stats = mgr.get_stats()
    assert stats.stores_skipped == 4
