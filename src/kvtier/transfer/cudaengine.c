/* The CUDA backend's submit path in C (cuda_worker.py): validate a job, compute its rows,
 * make its lane wait for the compute queued so far, and queue its copies and two timing
 * events, in one call from Python. The copies are gather.cu's kernel (row numbers in the
 * launch parameters) or, for large jobs, one cuMemcpyBatchAsync on the copy engines.
 *
 * Through the torch ops this replaces, a 4 MiB job cost 130-225 µs of host time against
 * 76 µs of copying on an H100 (docs/bench/transfer.md): an index upload, a staging buffer,
 * per-op dispatch, two torch events and a stream switch per job.
 *
 * The driver is reached with dlopen: building needs no CUDA headers, and on a machine without
 * CUDA nothing here runs. Not thread-safe: the caller serialises calls, except
 * kvt_cuda_event_sync, which may run alongside the others.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvtier.h"

typedef int CUresult;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream, *CUevent;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600

#define KVT_MAX_ROWS 480   /* gather.cu's larger kernels */
#define KVT_FEW_ROWS 32    /* and its smaller ones */
#define KVT_THREADS 256    /* gather.cu */
#define KVT_CHUNK_MAX 32768 /* bytes of a row's segment per thread block, at most */
#define KVT_CHUNK_MIN 4096  /* one pass of a block's threads at 16 bytes each */
#define KVT_LANES 3        /* stores, loads, urgent loads */
/* With dma_min above zero ("auto"), jobs whose copies average this much also go to the copy
 * engines: measured on an H100, the batched call beat the kernel from 256 KiB per copy (256 KiB
 * pages in 4 MiB jobs: 90-92% of a contiguous copy against 83-87%; single 1-2 MiB blocks:
 * 76-87% against 66-81%), and lost below it (64 KiB pages in 1 MiB jobs: 54-56% against
 * 67-72%). */
#define KVT_DMA_MIN_COPY (256u << 10)

typedef struct { /* gather.cu's Rows<480> */
    uint64_t segments;
    uint32_t n, chunk;
    uint32_t dst[KVT_MAX_ROWS], src[KVT_MAX_ROWS];
} kvt_rows;

typedef struct { /* gather.cu's Rows<32> */
    uint64_t segments;
    uint32_t n, chunk;
    uint32_t dst[KVT_FEW_ROWS], src[KVT_FEW_ROWS];
} kvt_few_rows;

typedef struct { /* CUmemcpyAttributes */
    int src_access_order, src_type, src_id, dst_type, dst_id;
    unsigned flags;
} kvt_memcpy_attrs;

typedef CUresult (*batch13_fn)(uint64_t *, uint64_t *, size_t *, size_t, kvt_memcpy_attrs *,
                               size_t *, size_t, CUstream);
typedef CUresult (*batch12_fn)(uint64_t *, uint64_t *, size_t *, size_t, kvt_memcpy_attrs *,
                               size_t *, size_t, size_t *, CUstream);

typedef struct {
    CUresult (*ctx_get)(CUcontext *);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*module_load)(CUmodule *, const void *);
    CUresult (*module_function)(CUfunction *, CUmodule, const char *);
    CUresult (*module_unload)(CUmodule);
    CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       unsigned, CUstream, void **, void **);
    CUresult (*event_create)(CUevent *, unsigned);
    CUresult (*event_destroy)(CUevent);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_query)(CUevent);
    CUresult (*event_sync)(CUevent);
    CUresult (*event_elapsed)(float *, CUevent, CUevent);
    CUresult (*stream_wait)(CUstream, CUevent, unsigned);
    CUresult (*stream_sync)(CUstream);
} kvt_driver;

typedef struct {
    kvtier_segment *segs;
    size_t nseg;
    uint64_t dev_segs; /* the same table in device memory, for the kernel */
    uint64_t max_width;
    CUfunction fn, fn_few; /* the kernels of the widest access every address allows */
    kvt_memcpy_attrs attrs;
} kvt_table;

typedef struct {
    int64_t id;
    int32_t ok;
    int32_t borrowed; /* started when the lane's previous job ended: its end is our start */
    CUevent start, end; /* created on the slot's first use, reused after */
} kvt_record;

typedef struct { /* a ring of the lane's jobs in submission order */
    CUstream stream;
    kvt_record *r;
    size_t cap, head, len;
    uint64_t first_seq; /* sequence number of r[head] */
} kvt_lane;

typedef struct {
    kvt_driver cu;
    void *lib;
    CUcontext ctx;
    CUmodule module;
    CUfunction fns[2][5]; /* 480 or 32 rows; 16, 8, 4, 2, 1 bytes per access */
    unsigned blocks_wanted; /* thread blocks that keep the GPU's SMs busy */
    CUevent compute; /* recorded on the caller's compute stream at each submit */
    kvt_lane lanes[KVT_LANES];
    kvt_table *tables;
    size_t ntables;
    void *batch; /* cuMemcpyBatchAsync, or NULL */
    int batch13; /* its CUDA 13 signature (12.8 has a failIdx argument) */
    uint64_t dma_min; /* jobs of this many bytes or more go to the copy engines */
    int64_t *rows;
    size_t rows_cap;
    uint64_t *dma;
    size_t dma_cap;
    kvt_rows params;
    kvt_few_rows few;
} kvt_cuda;

static int load_driver(kvt_cuda *c, char *err, size_t errlen) {
    c->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!c->lib) {
        snprintf(err, errlen, "cannot open libcuda.so.1: %s", dlerror());
        return 1;
    }
    struct {
        void **slot;
        const char *name;
    } want[] = {
        {(void **)&c->cu.ctx_get, "cuCtxGetCurrent"},
        {(void **)&c->cu.ctx_set, "cuCtxSetCurrent"},
        {(void **)&c->cu.module_load, "cuModuleLoadData"},
        {(void **)&c->cu.module_function, "cuModuleGetFunction"},
        {(void **)&c->cu.module_unload, "cuModuleUnload"},
        {(void **)&c->cu.launch, "cuLaunchKernel"},
        {(void **)&c->cu.event_create, "cuEventCreate"},
        {(void **)&c->cu.event_destroy, "cuEventDestroy_v2"},
        {(void **)&c->cu.event_record, "cuEventRecord"},
        {(void **)&c->cu.event_query, "cuEventQuery"},
        {(void **)&c->cu.event_sync, "cuEventSynchronize"},
        {(void **)&c->cu.event_elapsed, "cuEventElapsedTime"},
        {(void **)&c->cu.stream_wait, "cuStreamWaitEvent"},
        {(void **)&c->cu.stream_sync, "cuStreamSynchronize"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        *want[i].slot = dlsym(c->lib, want[i].name);
        if (!*want[i].slot) {
            snprintf(err, errlen, "libcuda.so.1 has no %s", want[i].name);
            return 1;
        }
    }
    return 0;
}

/* Make the engine's context current on the calling thread (a thread torch has not used yet
 * has none). */
static CUresult enter(kvt_cuda *c) {
    CUcontext cur = NULL;
    CUresult r = c->cu.ctx_get(&cur);
    if (r == CUDA_SUCCESS && cur != c->ctx)
        r = c->cu.ctx_set(c->ctx);
    return r;
}

void kvt_cuda_free(kvt_cuda *c);

/* An engine for the context current on the calling thread, with `image` (a cubin of
 * gather.cu) and the lanes' streams. `batch` is cuMemcpyBatchAsync (NULL: kernels only).
 * Returns NULL with a message in `err` on failure. */
kvt_cuda *kvt_cuda_new(const void *image, const uint64_t *streams, void *batch, int batch13,
                       uint64_t dma_min, unsigned sm_count, char *err, size_t errlen) {
    kvt_cuda *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (load_driver(c, err, errlen))
        goto fail;
    CUresult r = c->cu.ctx_get(&c->ctx);
    if (r != CUDA_SUCCESS || !c->ctx) {
        snprintf(err, errlen, "no current CUDA context (CUresult %d)", r);
        goto fail;
    }
    r = c->cu.module_load(&c->module, image);
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen, "cuModuleLoadData failed with CUresult %d", r);
        goto fail;
    }
    static const char *names[2][5] = {
        {"kvt_copy16", "kvt_copy8", "kvt_copy4", "kvt_copy2", "kvt_copy1"},
        {"kvt_copy16_32", "kvt_copy8_32", "kvt_copy4_32", "kvt_copy2_32", "kvt_copy1_32"}};
    for (int k = 0; k < 2; k++)
        for (int i = 0; i < 5; i++) {
            r = c->cu.module_function(&c->fns[k][i], c->module, names[k][i]);
            if (r != CUDA_SUCCESS) {
                snprintf(err, errlen, "the kernel image has no %s (CUresult %d)", names[k][i],
                         r);
                goto fail;
            }
        }
    c->blocks_wanted = 4 * (sm_count ? sm_count : 1);
    r = c->cu.event_create(&c->compute, 2 /* CU_EVENT_DISABLE_TIMING */);
    if (r != CUDA_SUCCESS) {
        snprintf(err, errlen, "cuEventCreate failed with CUresult %d", r);
        goto fail;
    }
    for (int i = 0; i < KVT_LANES; i++) {
        c->lanes[i].stream = (CUstream)(uintptr_t)streams[i];
        c->lanes[i].first_seq = 1;
    }
    c->batch = batch;
    c->batch13 = batch13;
    c->dma_min = dma_min;
    return c;
fail:
    kvt_cuda_free(c);
    return NULL;
}

/* Register a segment table (copied) whose rows' device copy is at `dev_segs`; `store` says
 * which side is the device (its source). Returns its index, or -1 if out of memory. */
int kvt_cuda_add_table(kvt_cuda *c, const kvtier_segment *segs, size_t nseg, uint64_t dev_segs,
                       int store, int device) {
    kvt_table *t = realloc(c->tables, (c->ntables + 1) * sizeof *t);
    if (!t)
        return -1;
    c->tables = t;
    t = &c->tables[c->ntables];
    memset(t, 0, sizeof *t);
    t->segs = malloc((nseg ? nseg : 1) * sizeof *segs);
    if (!t->segs)
        return -1;
    memcpy(t->segs, segs, nseg * sizeof *segs);
    t->nseg = nseg;
    t->dev_segs = dev_segs;
    uint64_t g = KVT_CHUNK_MIN;
    for (size_t i = 0; i < nseg; i++) {
        g |= segs[i].dst_base | segs[i].dst_stride | segs[i].src_base | segs[i].src_stride |
             segs[i].width;
        if (segs[i].width > t->max_width)
            t->max_width = segs[i].width;
    }
    int k = 0; /* the widest power of two dividing every value: 16 >> k */
    while (k < 4 && (g & ((16u >> k) - 1)))
        k++;
    t->fn = c->fns[0][k];
    t->fn_few = c->fns[1][k];
    const int device_loc = 1, host_loc = 2; /* CUmemLocationType */
    t->attrs = (kvt_memcpy_attrs){1 /* stream order */, store ? device_loc : host_loc,
                                  store ? device : 0, store ? host_loc : device_loc,
                                  store ? 0 : device, 0};
    return (int)c->ntables++;
}

/* The piece of a row's segment per thread block: the largest (up to KVT_CHUNK_MAX) that still
 * gives blocks_wanted blocks, so that a job of a few rows spreads over the SMs (each block's
 * reads of host memory wait on PCIe, and one SM alone moves a fraction of the link's rate). */
static unsigned chunk_for(const kvt_cuda *c, const kvt_table *t, size_t rows) {
    unsigned chunk = KVT_CHUNK_MAX;
    while (chunk > KVT_CHUNK_MIN &&
           (t->max_width + chunk - 1) / chunk * rows * t->nseg < c->blocks_wanted)
        chunk /= 2;
    return chunk;
}

static CUresult launch_rows(kvt_cuda *c, const kvt_table *t, CUstream s, const int64_t *dst,
                            const int64_t *src, size_t n) {
    for (size_t a = 0; a < n; a += KVT_MAX_ROWS) {
        size_t k = n - a < KVT_MAX_ROWS ? n - a : KVT_MAX_ROWS;
        unsigned chunk = chunk_for(c, t, k);
        unsigned gx = (unsigned)((t->max_width + chunk - 1) / chunk);
        uint32_t *d, *sr;
        void *params;
        CUfunction fn;
        if (k <= KVT_FEW_ROWS) {
            c->few = (kvt_few_rows){t->dev_segs, (uint32_t)k, chunk, {0}, {0}};
            d = c->few.dst, sr = c->few.src, params = &c->few, fn = t->fn_few;
        } else {
            c->params.segments = t->dev_segs, c->params.n = (uint32_t)k;
            c->params.chunk = chunk;
            d = c->params.dst, sr = c->params.src, params = &c->params, fn = t->fn;
        }
        for (size_t i = 0; i < k; i++) {
            d[i] = (uint32_t)dst[a + i];
            sr[i] = (uint32_t)src[a + i];
        }
        void *args[] = {params}; /* the driver copies the parameters at the call */
        CUresult r = c->cu.launch(fn, gx, (unsigned)k, (unsigned)t->nseg, KVT_THREADS, 1, 1, 0, s,
                                  args, NULL);
        if (r != CUDA_SUCCESS)
            return r;
    }
    return CUDA_SUCCESS;
}

static CUresult dma_rows(kvt_cuda *c, kvt_table *t, CUstream s, const int64_t *dst,
                         const int64_t *src, size_t n) {
    size_t m = n * t->nseg;
    if (3 * m > c->dma_cap) {
        uint64_t *d = realloc(c->dma, 3 * m * sizeof *d);
        if (!d)
            return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
        c->dma = d;
        c->dma_cap = 3 * m;
    }
    uint64_t *dd = c->dma, *ss = dd + m, *sz = ss + m;
    size_t k = 0;
    for (size_t g = 0; g < t->nseg; g++) {
        const kvtier_segment *sg = &t->segs[g];
        for (size_t i = 0; i < n; i++, k++) {
            dd[k] = sg->dst_base + (uint64_t)dst[i] * sg->dst_stride;
            ss[k] = sg->src_base + (uint64_t)src[i] * sg->src_stride;
            sz[k] = sg->width;
        }
    }
    size_t zero = 0, fail_idx = 0;
    if (c->batch13)
        return ((batch13_fn)c->batch)(dd, ss, (size_t *)sz, m, &t->attrs, &zero, 1, s);
    return ((batch12_fn)c->batch)(dd, ss, (size_t *)sz, m, &t->attrs, &zero, 1, &fail_idx, s);
}

/* Queue job `id` in `lane` with its rows given: `dst[i]` and `src[i]` are rows of the table's
 * destination and source. It waits for the work queued so far on `compute`. `fail` records
 * the job as failed without copying. Returns 0 (queued; a refused launch makes the job
 * failed), -1 out of memory, or a CUresult if its events could not be queued (nothing queued
 * then). */
int kvt_cuda_submit(kvt_cuda *c, int lane, uint64_t compute, int64_t id, int fail, int table,
                    uint64_t nbytes, const int64_t *dst, const int64_t *src, size_t n) {
    kvt_lane *l = &c->lanes[lane];
    kvt_table *t = &c->tables[table];
    CUresult r = enter(c);
    if (r != CUDA_SUCCESS)
        return r;
    /* Grow the ring when it is full, or when the next slot is the one whose end event the
     * oldest job borrowed as its start. Every slot moves, in order (from the one before the
     * oldest job where there is one), so that no event is lost or parted from its borrower. */
    if (l->len == l->cap || (l->len + 1 == l->cap && l->r[l->head].borrowed)) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        kvt_record *nr = calloc(cap, sizeof *nr);
        if (!nr)
            return -1;
        size_t from = l->len == l->cap ? 0 : 1; /* a full ring has no slot before its oldest */
        for (size_t i = 0; i < l->cap; i++)
            nr[i] = l->r[(l->head + l->cap - from + i) % l->cap];
        free(l->r);
        l->r = nr;
        l->head = from;
        l->cap = cap;
    }
    size_t slot = (l->head + l->len) % l->cap;
    kvt_record *rec = &l->r[slot];
    /* While the lane's previous job is still queued or running, this one starts when it ends:
     * that job's end event is this one's start, and the job records one event instead of two.
     * On an H100, single 1 MiB blocks went from 77 to 81-82% of a contiguous copy, 256 KiB
     * ones from 26-36 to 40-45% (docs/bench/transfer.md). */
    int borrow = 0;
    if (l->len) {
        kvt_record *prev = &l->r[(slot + l->cap - 1) % l->cap];
        borrow = c->cu.event_query(prev->end) == CUDA_ERROR_NOT_READY;
    }
    if (!borrow && !rec->start && (r = c->cu.event_create(&rec->start, 0)) != CUDA_SUCCESS)
        return r;
    if (!rec->end && (r = c->cu.event_create(&rec->end, 0)) != CUDA_SUCCESS)
        return r;
    CUstream s = l->stream;
    /* Stores read KV that the compute stream is producing; loads overwrite blocks it may still
     * be reading. Both wait for the compute queued so far. */
    if ((r = c->cu.event_record(c->compute, (CUstream)(uintptr_t)compute)) != CUDA_SUCCESS ||
        (r = c->cu.stream_wait(s, c->compute, 0)) != CUDA_SUCCESS ||
        (!borrow && (r = c->cu.event_record(rec->start, s)) != CUDA_SUCCESS))
        return r;
    int ok = !fail;
    if (ok && n) {
        if (c->batch && (nbytes >= c->dma_min ||
                         (c->dma_min && nbytes / (n * t->nseg) >= KVT_DMA_MIN_COPY)))
            ok = dma_rows(c, t, s, dst, src, n) == CUDA_SUCCESS;
        else
            ok = launch_rows(c, t, s, dst, src, n) == CUDA_SUCCESS;
    }
    /* Recorded after a refused launch too: copies already queued must finish before the
     * job is reported and its blocks reused. */
    if ((r = c->cu.event_record(rec->end, s)) != CUDA_SUCCESS)
        return r;
    rec->id = id;
    rec->ok = ok;
    rec->borrowed = borrow;
    l->len++;
    return 0;
}

/* kvt_cuda_submit with the job planned here, as kvt_engine_submit_ids does, with what the
 * group and direction share in `x`; 1 if the arguments are invalid (nothing queued). */
int kvt_cuda_submit_ids(kvt_cuda *c, const kvt_submit_ctx *x, int lane, uint64_t compute,
                        int64_t id, const int64_t *blocks, size_t nblocks, const int64_t *slots,
                        size_t nslots, size_t skip) {
    if (2 * nblocks > c->rows_cap) {
        int64_t *rows = realloc(c->rows, 2 * nblocks * sizeof *rows);
        if (!rows)
            return -1;
        c->rows = rows;
        c->rows_cap = 2 * nblocks;
    }
    int64_t *host = c->rows, *dev = c->rows + nblocks;
    int store = x->store != 0;
    int rc = kvt_plan_rows(store, blocks, nblocks, slots, nslots, x->bpc, skip, x->num_blocks,
                           x->num_slots, host, dev);
    if (rc)
        return rc;
    return kvt_cuda_submit(c, lane, compute, id, 0, (int)x->table, nblocks * x->page_bytes,
                           store ? host : dev, store ? dev : host, nblocks);
}

/* Move up to `max` finished jobs into `out`, each lane's in submission order. A job whose
 * event reports an error (a failed copy poisons the context) is reported failed. */
size_t kvt_cuda_poll(kvt_cuda *c, kvt_result *out, size_t max) {
    size_t k = 0;
    if (enter(c) != CUDA_SUCCESS)
        return 0;
    for (int i = 0; i < KVT_LANES; i++) {
        kvt_lane *l = &c->lanes[i];
        while (l->len && k < max) {
            kvt_record *rec = &l->r[l->head];
            CUresult r = c->cu.event_query(rec->end);
            if (r == CUDA_ERROR_NOT_READY)
                break;
            float ms = 0;
            CUevent start =
                rec->borrowed ? l->r[(l->head + l->cap - 1) % l->cap].end : rec->start;
            if (r == CUDA_SUCCESS)
                c->cu.event_elapsed(&ms, start, rec->end);
            out[k++] = (kvt_result){rec->id, rec->ok && r == CUDA_SUCCESS, i, ms / 1e3};
            l->head = (l->head + 1) % l->cap;
            l->len--;
            l->first_seq++;
        }
    }
    return k;
}

/* The end event of `lane`'s job `seq` if it is not yet polled, else 0: for a waiter, which
 * synchronises it with kvt_cuda_event_sync outside the caller's lock. */
uint64_t kvt_cuda_end_event(kvt_cuda *c, int lane, uint64_t seq) {
    kvt_lane *l = &c->lanes[lane];
    if (seq < l->first_seq || seq >= l->first_seq + l->len)
        return 0;
    return (uint64_t)(uintptr_t)l->r[(l->head + (seq - l->first_seq)) % l->cap].end;
}

/* Block until `event` has happened. The slot may be reused meanwhile by a later job, which
 * only makes the wait longer. Events live until kvt_cuda_free. */
int kvt_cuda_event_sync(kvt_cuda *c, uint64_t event) {
    CUresult r = enter(c);
    return r != CUDA_SUCCESS ? r : c->cu.event_sync((CUevent)(uintptr_t)event);
}

/* Block until every queued copy has finished. */
int kvt_cuda_sync(kvt_cuda *c) {
    CUresult r = enter(c);
    for (int i = 0; i < KVT_LANES && r == CUDA_SUCCESS; i++)
        r = c->cu.stream_sync(c->lanes[i].stream);
    return r;
}

void kvt_cuda_free(kvt_cuda *c) {
    if (!c)
        return;
    if (c->ctx && enter(c) == CUDA_SUCCESS) {
        for (int i = 0; i < KVT_LANES; i++) {
            kvt_lane *l = &c->lanes[i];
            for (size_t k = 0; k < l->cap; k++) {
                if (l->r[k].start)
                    c->cu.event_destroy(l->r[k].start);
                if (l->r[k].end)
                    c->cu.event_destroy(l->r[k].end);
            }
        }
        if (c->compute)
            c->cu.event_destroy(c->compute);
        if (c->module)
            c->cu.module_unload(c->module);
    }
    for (int i = 0; i < KVT_LANES; i++)
        free(c->lanes[i].r);
    for (size_t i = 0; i < c->ntables; i++)
        free(c->tables[i].segs);
    free(c->tables);
    free(c->rows);
    free(c->dma);
    if (c->lib)
        dlclose(c->lib);
    free(c);
}
