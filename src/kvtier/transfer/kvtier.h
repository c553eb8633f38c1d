/* Types and functions the compiled library's sources share (see native.py, which mirrors the
 * structures with ctypes: `EngineResult`, `SubmitContext`). */
#ifndef KVTIER_H
#define KVTIER_H

#include <stddef.h>
#include <stdint.h>

/* A column range of the registered KV rows, and where it lies in the host rows. */
typedef struct {
    uint64_t dst_base, dst_stride, src_base, src_stride, width;
} kvtier_segment;

/* One finished job, as the engines' poll functions write it. */
typedef struct {
    int64_t id;
    int32_t ok;
    int32_t lane;
    double seconds;
} kvt_result;

/* What every submit of one KV-cache group in one direction shares, built once by the caller. */
typedef struct {
    const kvtier_segment *segs;
    uint64_t nseg, store, bpc;
    int64_t num_blocks, num_slots;
    uint64_t table, page_bytes; /* cudaengine.c's table number; bytes per block */
} kvt_submit_ctx;

/* rowcopy.c */
void kvtier_copy_indexed(const kvtier_segment *segs, size_t nseg, const int64_t *dst_idx,
                         const int64_t *src_idx, size_t n);

/* copyengine.c */
int kvt_plan_rows(int store, const int64_t *blocks, size_t nblocks, const int64_t *slots,
                  size_t nslots, size_t bpc, size_t skip, int64_t num_blocks, int64_t num_slots,
                  int64_t *host, int64_t *dev);

#endif
