"""The CUDA engine driven from Python as CUDATransferWorker drives it, over c/fake_cuda.c:
run by test_native_c.py with the fake as the `libcuda.so.1` on LD_LIBRARY_PATH. It checks
the glue no GPU-less test reached: the submit extension calling `kvt_cuda_submit_ext` (whose
`seq` argument carries the compute stream), the ctypes signatures of `kvt_cuda_coalesce`,
`kvt_cuda_wait`, `kvt_cuda_poll` and `kvt_cuda_last_error`, and the contexts that
`native.submit_contexts` builds with the engine's table numbers.

"Device" blocks are CPU tensors (the fake copies host memory). Argument: the launch threads'
depth (0: none). Prints "ok" when every check passes.
"""

from __future__ import annotations

import ctypes
import sys

import numpy as np
import torch

from kvtier.transfer import HostPool, KVCacheRegistration
from kvtier.transfer.native import (
    EngineResult,
    library,
    segment_tables,
    submit_contexts,
    submit_extension,
)
from kvtier.transfer.plan import JobPlanner
from kvtier.transfer.testing import NUM_BLOCKS, assert_block_equals, make_layout, snapshot

COMPUTE = 9  # the fake's stream handle for "compute"
REFUSED = -2  # submitext.c


def poll(lib: ctypes.CDLL, handle: int) -> list[tuple[int, int, int]]:
    out = (EngineResult * 64)()
    k = lib.kvt_cuda_poll(handle, out, 64)
    return [(r.job_id, r.ok, r.lane) for r in out[:k]]


def main(depth: int) -> None:
    lib, ext = library(), submit_extension()
    assert lib is not None and ext is not None, "the library or the extension did not build"
    kvs = make_layout("flash", torch.float16, "cpu", seed=3)
    reg = KVCacheRegistration(kvs)
    pool = HostPool(reg, 2, num_slots=8, pin=False)
    before = snapshot(kvs)
    err = ctypes.create_string_buffer(256)
    streams = (ctypes.c_uint64 * 3)(1, 2, 3)
    image = ctypes.create_string_buffer(b"image")
    handle = lib.kvt_cuda_new(image, streams, None, 0, 0, 2, err, len(err))
    assert handle, err.value.decode()
    tables = segment_tables(reg, pool.address, pool.row_bytes)
    numbers: dict[int, tuple[int, int]] = {}
    for g, (st, ld) in tables.items():
        # The fake's kernel reads the segment table where the device copy would be.
        a = lib.kvt_cuda_add_table(handle, st.ctypes.data, st.shape[0], st.ctypes.data, 1, 0)
        b = lib.kvt_cuda_add_table(handle, ld.ctypes.data, ld.shape[0], ld.ctypes.data, 0, 0)
        numbers[g] = (a, b)
    assert lib.kvt_cuda_coalesce(handle, depth) == (0 if depth else 1)  # 0 is out of range
    page_bytes = {g: reg.page_bytes(g) for g in reg.groups}
    planner = JobPlanner(reg.num_blocks, pool.num_slots, pool.blocks_per_chunk, page_bytes)
    keep, contexts = submit_contexts(tables, planner, numbers)
    store_ctx, load_ctx = contexts[0]
    fn = ctypes.cast(lib.kvt_cuda_submit_ext, ctypes.c_void_p).value

    for j in range(4):  # blocks 4j..4j+3 into slots 2j, 2j+1 (two blocks a slot)
        blocks, slots = [4 * j + k for k in range(4)], [2 * j, 2 * j + 1]
        assert ext.submit(fn, handle, store_ctx, j, 0, COMPUTE, blocks, slots, 0) == 4
    assert lib.kvt_cuda_wait(handle, 0, 4) == 0  # the fourth job of lane 0
    assert poll(lib, handle) == [(j, 1, 0) for j in range(4)]

    # Back from each job's second block on, into blocks 24.., as numpy arrays; one urgent.
    for j in range(4):
        dst, slots_np = np.arange(3) + 24 + 3 * j, np.array([2 * j, 2 * j + 1])
        lane = 2 if j == 3 else 1
        assert ext.submit(fn, handle, load_ctx, 10 + j, lane, COMPUTE, dst, slots_np, 1) == 3
    bad = ext.submit(fn, handle, load_ctx, 20, 1, COMPUTE, [NUM_BLOCKS], [0], 0)
    assert bad == REFUSED, bad
    assert lib.kvt_cuda_sync(handle) == 0
    assert sorted(poll(lib, handle)) == [(10, 1, 1), (11, 1, 1), (12, 1, 1), (13, 1, 2)]
    for j in range(4):
        for i in range(3):
            assert_block_equals(kvs, 24 + 3 * j + i, before[4 * j + 1 + i])
    assert lib.kvt_cuda_last_error(handle) == 0  # nothing failed
    lib.kvt_cuda_free(handle)
    del keep
    pool.close()
    print("ok")


if __name__ == "__main__":
    main(int(sys.argv[1]))
