/* The entry points of cudaengine.c that the C harnesses call (cuda_check.c, waiter_check.c):
 * the library declares them only for ctypes, on the Python side. */
#ifndef KVT_CUDA_ENGINE_API_H
#define KVT_CUDA_ENGINE_API_H

#include <stddef.h>
#include <stdint.h>

#include "kvtier.h"

typedef struct kvt_cuda kvt_cuda;
kvt_cuda *kvt_cuda_new(const void *image, const uint64_t *streams, void *batch, int batch13,
                       uint64_t dma_min, unsigned sm_count, char *err, size_t errlen);
int kvt_cuda_add_table(kvt_cuda *c, const kvtier_segment *segs, size_t nseg, uint64_t dev_segs,
                       int store, int device);
int kvt_cuda_submit(kvt_cuda *c, int lane, uint64_t compute, int64_t id, int fail, int table,
                    uint64_t nbytes, const int64_t *dst, const int64_t *src, size_t n);
int kvt_cuda_submit_ids(kvt_cuda *c, const kvt_submit_ctx *x, int lane, uint64_t compute,
                        int64_t id, const int64_t *blocks, size_t nblocks, const int64_t *slots,
                        size_t nslots, size_t skip);
size_t kvt_cuda_poll(kvt_cuda *c, kvt_result *out, size_t max);
size_t kvt_cuda_peek(kvt_cuda *c, kvt_result *out, size_t max);
void kvt_cuda_drop(kvt_cuda *c, const kvt_result *seen, size_t k);
int kvt_cuda_submit_ext(void *c, const kvt_submit_ctx *x, int64_t id, int lane,
                        uint64_t compute, const int64_t *blocks, size_t nblocks,
                        const int64_t *slots, size_t nslots, size_t skip);
int kvt_cuda_last_error(const kvt_cuda *c);
int kvt_cuda_coalesce(kvt_cuda *c, size_t depth);
int kvt_cuda_wait(kvt_cuda *c, int lane, uint64_t seq);
int kvt_cuda_wait_for(kvt_cuda *c, int lane, uint64_t seq, uint64_t timeout_ns);
uint64_t kvt_cuda_accepted(kvt_cuda *c, int lane);
int kvt_cuda_sync(kvt_cuda *c);
void kvt_cuda_free(kvt_cuda *c);

#endif
