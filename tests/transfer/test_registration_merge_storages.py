"""Parts of a group whose bytes follow each other in every block are merged into one wider
segment, which views the first part's storage. Two storages can start at one address with
different sizes (`torch.frombuffer` over one buffer twice): merged past the end of the first,
the segment's view raised ("out of bounds for storage") as soon as a worker was built."""

from __future__ import annotations

import torch

from kvtier.transfer import CPUTransferWorker, HostPool, KVCacheRegistration, KVTensor


def test_parts_in_storages_of_different_sizes_at_one_address_round_trip() -> None:
    nb, w, stride = 4, 64, 256
    buf = bytearray(range(256)) * nb
    short = torch.frombuffer(buf, dtype=torch.uint8, count=(nb - 1) * stride + w)
    whole = torch.frombuffer(buf, dtype=torch.uint8)
    a = short.as_strided((nb, w), (stride, 1))  # bytes 0..63 of each block
    b = whole.as_strided((nb, w), (stride, 1), w)  # bytes 64..127: they follow a's
    reg = KVCacheRegistration([KVTensor(a, 0), KVTensor(b, 0)])
    assert reg.page_bytes(0) == 2 * w
    expected = [bytes(buf[i * stride : i * stride + 2 * w]) for i in range(nb)]
    with CPUTransferWorker(reg, HostPool(reg, 1, num_slots=nb)) as worker:
        worker.submit_store(1, [2, 0], [0, 1])
        worker.wait([1])
        for i in range(nb):
            buf[i * stride : i * stride + 2 * w] = bytes(2 * w)
        worker.submit_load(2, [0, 1], [3, 1])
        worker.wait([2])
        assert [r.success for r in worker.get_finished()] == [True, True]
    assert bytes(buf[3 * stride : 3 * stride + 2 * w]) == expected[2]
    assert bytes(buf[1 * stride : 1 * stride + 2 * w]) == expected[0]
