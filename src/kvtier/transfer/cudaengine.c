/* The CUDA backend's submit path in C (cuda_worker.py): validate a job, compute its rows,
 * make its lane wait for the compute queued so far, and queue its copies and two timing
 * events, in one call from Python. The copies are gather.cu's kernel (row numbers in the
 * launch parameters) or, for large jobs, one cuMemcpyBatchAsync on the copy engines.
 *
 * Through the torch ops this replaces, a 4 MiB job cost 130-225 µs of host time against
 * 76 µs of copying on an H100 (docs/bench/transfer.md): an index upload, a staging buffer,
 * per-op dispatch, two torch events and a stream switch per job.
 *
 * A submit records an event on the caller's compute stream and queues the job in its lane.
 * Without coalescing, the submitting thread then launches it at once. With coalescing
 * (kvt_cuda_coalesce), each lane has a launch thread that keeps at most `depth` batches
 * queued on the GPU; jobs submitted while the lane is that far ahead wait on the host and go
 * out together, as one batch: one wait for compute, one kernel per 480 rows (or one batched
 * copy), one end event. A burst of single-block jobs then costs the GPU one launch per batch
 * instead of one per job, and the submitter neither launches nor records timing events.
 *
 * The driver is reached with dlopen: building needs no CUDA headers, and on a machine without
 * CUDA nothing here runs. Submits and polls are serialised by the caller; kvt_cuda_wait,
 * kvt_cuda_wait_for (and its lanes' waiter threads) and the launch threads may run alongside
 * them (the lanes are guarded by the engine's mutex).
 */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvtier.h"

typedef int CUresult;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream, *CUevent;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED 900

#define KVT_MAX_ROWS 480   /* gather.cu's larger kernels */
#define KVT_FEW_ROWS 32    /* and its smaller ones */
#define KVT_THREADS 256    /* gather.cu */
#define KVT_CHUNK_MAX 32768 /* bytes of a row's segment per thread block, at most */
#define KVT_CHUNK_MIN 4096  /* one pass of a block's threads at 16 bytes each */
#define KVT_GRID_Z_MAX 65535u /* a launch's grid z: segments per launch, at most */
#define KVT_LANES 3        /* stores, loads, urgent loads */
#define KVT_DEPTH_MAX 8    /* batches a coalescing lane may keep queued on the GPU */
#define KVT_BATCH_ROWS 3840 /* rows a coalesced batch takes, at most (eight launches) */
/* With dma_min above zero ("auto"), jobs whose copies average this much also go to the copy
 * engines: measured on an H100, the batched call beat the kernel from 256 KiB per copy (256 KiB
 * pages in 4 MiB jobs: 90-92% of a contiguous copy against 83-87%; single 1-2 MiB blocks:
 * 76-87% against 66-81%), and lost below it (64 KiB pages in 1 MiB jobs: 54-56% against
 * 67-72%). */
#define KVT_DMA_MIN_COPY (256u << 10)
/* Jobs of dma_min bytes or more go to the copy engines only when their copies average this
 * much (cuda_worker.py's DMA_MIN_COPY_BYTES). Measured on an H200: 16 KiB copies in 8-16 MiB
 * jobs moved at 24-48% of a contiguous copy through the engines against 85-89% by the kernel;
 * a transformers paged cache's 2 KiB pieces loaded at 1.6 GB/s through them. vLLM-shaped
 * 32 KiB copies in 32 MiB jobs: 96-97% through the engines, 92-95% by the kernel. */
#define KVT_DMA_SMALL_COPY (32u << 10)

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
    CUresult (*stream_capturing)(CUstream, int *); /* optional (CUDA 10+): NULL, no check */
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
    int32_t ok, fail;
    int32_t borrowed; /* first of a batch that started when the lane's previous batch ended */
    int32_t table;
    uint64_t nbytes;
    uint64_t first, last;  /* seqs of its batch's first and last jobs; 0 until launched */
    uint64_t batch_bytes;  /* on a batch's first job: the batch's bytes */
    uint64_t batch_jobs;   /* and its jobs */
    double batch_ms;       /* and its GPU time, once a peek has timed it */
    uint64_t compute_stream;
    CUevent compute;       /* recorded on the caller's compute stream at submit */
    CUevent start, end;    /* created on the slot's first use, reused after */
    int64_t *rows;         /* dst[0..n) then src[0..n) */
    size_t n, rows_cap;
} kvt_record;

typedef struct { /* what a launch needs of a job, taken under the engine's mutex */
    uint64_t seq, nbytes, compute_stream;
    const int64_t *rows;
    size_t n;
    int table, fail;
    CUevent compute;
} kvt_job;

typedef struct { /* a ring of the lane's jobs in submission order */
    CUstream stream;
    kvt_record *r;
    size_t cap, head, len;
    size_t launched;    /* jobs from head on that are launched (the rest wait on the host) */
    uint64_t first_seq; /* sequence number of r[head] */
    uint64_t prev_last; /* the last job of the latest batch launched (0: none yet) */
    uint64_t flight[KVT_DEPTH_MAX]; /* last jobs of the batches the launcher saw queued */
    size_t nflight;
    double batch_ms;        /* the batch being polled (its first job dropped): its GPU time */
    uint64_t batch_bytes, batch_jobs;
    /* launching: the lane's thread's, or the submitter's without coalescing */
    pthread_t thread;
    int idle; /* its thread waits for work */
    pthread_cond_t work;
    kvt_rows params;
    kvt_few_rows few;
    uint64_t *dma;
    size_t dma_cap;
    int64_t *merged; /* the rows of a batch's jobs side by side: dst then src */
    size_t merged_cap;
    kvt_job *jobs;
    int *oks;
    size_t jobs_cap;
    /* kvt_cuda_wait_for's waiter thread: the highest seq a caller waits for, the highest whose
     * copies it has seen end, and the CUresult of a failed wait with the seq it covered. One
     * thread a lane: one for all blocked on a lane's job while another lane's ended. */
    uint64_t want, reached, failed_upto;
    int failed_rc;
    pthread_t waiter;
    int waiter_on;
} kvt_lane;

typedef struct {
    kvt_driver cu;
    void *lib;
    CUcontext ctx;
    CUmodule module;
    CUfunction fns[2][5]; /* 480 or 32 rows; 16, 8, 4, 2, 1 bytes per access */
    unsigned blocks_wanted; /* thread blocks that keep the GPU's SMs busy */
    kvt_lane lanes[KVT_LANES];
    kvt_table *tables;
    size_t ntables;
    void *batch; /* cuMemcpyBatchAsync, or NULL */
    int batch13; /* its CUDA 13 signature (12.8 has a failIdx argument) */
    uint64_t dma_min; /* jobs of this many bytes or more go to the copy engines */
    int64_t *rows; /* the submitter's planning scratch */
    size_t rows_cap;
    pthread_mutex_t mu;
    pthread_cond_t launched; /* a batch was launched */
    int sync_made;           /* mu, launched and the lanes' work conditions exist */
    int coalesce, stopping;
    int started; /* launch threads that have tried to enter (kvt_cuda_coalesce waits for all) */
    size_t depth;
    int last_error; /* the CUresult behind a submit's -1 through kvt_cuda_submit_ext */
    pthread_cond_t waited;   /* a waiter thread saw a job's copies end */
    int waiter_quit;
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
    c->cu.stream_capturing = dlsym(c->lib, "cuStreamIsCapturing");
    return 0;
}

/* Make the engine's context current on the calling thread (a thread torch has not used yet
 * has none); `*prev` gets the caller's, for leave(). */
static CUresult enter(kvt_cuda *c, CUcontext *prev) {
    CUcontext cur = NULL;
    CUresult r = c->cu.ctx_get(&cur);
    *prev = cur;
    if (r == CUDA_SUCCESS && cur != c->ctx)
        r = c->cu.ctx_set(c->ctx);
    return r;
}

/* Give the caller its own context back after a successful enter(). Left current, the engine's
 * context would also become the runtime's (torch's) current device on the caller's thread,
 * where that is another device: its later work and allocations would go to this one. */
static void leave(kvt_cuda *c, CUcontext prev) {
    if (prev != c->ctx)
        c->cu.ctx_set(prev);
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
    if (pthread_mutex_init(&c->mu, NULL))
        goto no_sync;
    if (pthread_cond_init(&c->launched, NULL)) {
        pthread_mutex_destroy(&c->mu);
        goto no_sync;
    }
    /* kvt_cuda_wait_for's deadlines are monotonic: a wall-clock step cannot stretch one. */
    pthread_condattr_t mono;
    int waited_made = !pthread_condattr_init(&mono);
    if (waited_made) {
#ifdef __linux__
        pthread_condattr_setclock(&mono, CLOCK_MONOTONIC);
#endif
        waited_made = !pthread_cond_init(&c->waited, &mono);
        pthread_condattr_destroy(&mono);
    }
    int made = 0;
    while (waited_made && made < KVT_LANES && !pthread_cond_init(&c->lanes[made].work, NULL))
        made++;
    if (made < KVT_LANES) {
        while (made--)
            pthread_cond_destroy(&c->lanes[made].work);
        if (waited_made)
            pthread_cond_destroy(&c->waited);
        pthread_cond_destroy(&c->launched);
        pthread_mutex_destroy(&c->mu);
        goto no_sync;
    }
    c->sync_made = 1;
    for (int i = 0; i < KVT_LANES; i++) {
        c->lanes[i].stream = (CUstream)(uintptr_t)streams[i];
        c->lanes[i].first_seq = 1;
    }
    c->batch = batch;
    c->batch13 = batch13;
    c->dma_min = dma_min;
    return c;
no_sync:
    snprintf(err, errlen, "could not create a mutex or condition variable");
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


static CUresult launch_segments(kvt_cuda *c, kvt_lane *l, const kvt_table *t,
                                const int64_t *dst, const int64_t *src, size_t n);

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

static CUresult launch_rows(kvt_cuda *c, kvt_lane *l, const kvt_table *t, const int64_t *dst,
                            const int64_t *src, size_t n) {
    /* A grid's z (the segment) is at most 65,535: a group of more segments (a generic layout
     * with many dims before the block's) goes out in launches of that many, each reading its
     * part of the table. One launch of them all was refused, failing every job. */
    for (size_t z = 0; z < t->nseg; z += KVT_GRID_Z_MAX) {
        kvt_table part = *t;
        part.nseg = t->nseg - z < KVT_GRID_Z_MAX ? t->nseg - z : KVT_GRID_Z_MAX;
        part.dev_segs = t->dev_segs + z * sizeof(kvtier_segment);
        CUresult r = launch_segments(c, l, &part, dst, src, n);
        if (r != CUDA_SUCCESS)
            return r;
    }
    return CUDA_SUCCESS;
}

static CUresult launch_segments(kvt_cuda *c, kvt_lane *l, const kvt_table *t,
                                const int64_t *dst, const int64_t *src, size_t n) {
    for (size_t a = 0; a < n; a += KVT_MAX_ROWS) {
        size_t k = n - a < KVT_MAX_ROWS ? n - a : KVT_MAX_ROWS;
        unsigned chunk = chunk_for(c, t, k);
        unsigned gx = (unsigned)((t->max_width + chunk - 1) / chunk);
        uint32_t *d, *sr;
        void *params;
        CUfunction fn;
        if (k <= KVT_FEW_ROWS) {
            l->few = (kvt_few_rows){t->dev_segs, (uint32_t)k, chunk, {0}, {0}};
            d = l->few.dst, sr = l->few.src, params = &l->few, fn = t->fn_few;
        } else {
            l->params.segments = t->dev_segs, l->params.n = (uint32_t)k;
            l->params.chunk = chunk;
            d = l->params.dst, sr = l->params.src, params = &l->params, fn = t->fn;
        }
        for (size_t i = 0; i < k; i++) {
            d[i] = (uint32_t)dst[a + i];
            sr[i] = (uint32_t)src[a + i];
        }
        void *args[] = {params}; /* the driver copies the parameters at the call */
        CUresult r = c->cu.launch(fn, gx, (unsigned)k, (unsigned)t->nseg, KVT_THREADS, 1, 1, 0,
                                  l->stream, args, NULL);
        if (r != CUDA_SUCCESS)
            return r;
    }
    return CUDA_SUCCESS;
}

static CUresult dma_rows(kvt_cuda *c, kvt_lane *l, kvt_table *t, const int64_t *dst,
                         const int64_t *src, size_t n) {
    size_t m = n * t->nseg;
    if (3 * m > l->dma_cap) {
        uint64_t *d = realloc(l->dma, 3 * m * sizeof *d);
        if (!d)
            return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
        l->dma = d;
        l->dma_cap = 3 * m;
    }
    uint64_t *dd = l->dma, *ss = dd + m, *sz = ss + m;
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
        return ((batch13_fn)c->batch)(dd, ss, (size_t *)sz, m, &t->attrs, &zero, 1, l->stream);
    return ((batch12_fn)c->batch)(dd, ss, (size_t *)sz, m, &t->attrs, &zero, 1, &fail_idx,
                                  l->stream);
}

static kvt_record *at_seq(kvt_lane *l, uint64_t seq) {
    return &l->r[(l->head + (seq - l->first_seq)) % l->cap];
}

/* Queue the copies of jobs `j[0..k)`, taken in order from lane `l`, as one batch: the lane
 * waits for each compute stream's latest event among them, then the jobs of one table that
 * follow each other go out together (their rows side by side: one kernel per 480 rows, or
 * one batched copy), and `end` is recorded after them. `start` is recorded first unless the
 * batch borrows the previous one's end. `ok[i]` says whether job i's copies were queued. Runs
 * without the engine's mutex: only the lane's launcher touches its scratch and streams. */
static void launch_batch(kvt_cuda *c, kvt_lane *l, const kvt_job *j, size_t k, int borrow,
                         CUevent start, CUevent end, int *ok) {
    CUresult r = CUDA_SUCCESS;
    for (size_t i = k; i-- > 0 && r == CUDA_SUCCESS;) {
        int later = 0; /* a later job's event on the same stream covers this one */
        for (size_t m = i + 1; m < k && !later; m++)
            later = j[m].compute_stream == j[i].compute_stream;
        if (!later)
            r = c->cu.stream_wait(l->stream, j[i].compute, 0);
    }
    if (r == CUDA_SUCCESS && !borrow)
        r = c->cu.event_record(start, l->stream);
    for (size_t i = 0; i < k;) {
        if (r != CUDA_SUCCESS || j[i].fail) {
            ok[i++] = 0;
            continue;
        }
        size_t e = i, rows = 0;
        uint64_t bytes = 0;
        for (; e < k && !j[e].fail && j[e].table == j[i].table; e++)
            rows += j[e].n, bytes += j[e].nbytes;
        const int64_t *dst = j[i].rows, *src = j[i].rows + j[i].n;
        CUresult g = CUDA_SUCCESS;
        if (e - i > 1 && rows) {
            if (2 * rows > l->merged_cap) {
                int64_t *m = realloc(l->merged, 2 * rows * sizeof *m);
                if (m)
                    l->merged = m, l->merged_cap = 2 * rows;
            }
            if (2 * rows > l->merged_cap) {
                g = 2; /* CUDA_ERROR_OUT_OF_MEMORY */
            } else {
                size_t at = 0;
                for (size_t m = i; m < e; m++) {
                    memcpy(l->merged + at, j[m].rows, j[m].n * sizeof *l->merged);
                    memcpy(l->merged + rows + at, j[m].rows + j[m].n,
                           j[m].n * sizeof *l->merged);
                    at += j[m].n;
                }
                dst = l->merged, src = l->merged + rows;
            }
        }
        kvt_table *t = &c->tables[j[i].table];
        if (g == CUDA_SUCCESS && rows) {
            uint64_t copy = bytes / (rows * t->nseg); /* bytes of an average copy */
            if (c->batch && (!c->dma_min || copy >= KVT_DMA_MIN_COPY ||
                             (bytes >= c->dma_min && copy >= KVT_DMA_SMALL_COPY)))
                g = dma_rows(c, l, t, dst, src, rows);
            else
                g = launch_rows(c, l, t, dst, src, rows);
        }
        for (; i < e; i++)
            ok[i] = g == CUDA_SUCCESS;
    }
    /* Recorded after a refused launch too: copies already queued must finish before the
     * jobs are reported and their blocks reused. Without it the end event keeps an older
     * state, which poll and wait would take for the end of these copies: the jobs are failed
     * and the lane's queue drained here, before they count as launched. */
    if (c->cu.event_record(end, l->stream) != CUDA_SUCCESS) {
        for (size_t i = 0; i < k; i++)
            ok[i] = 0;
        c->cu.stream_sync(l->stream);
    }
}

/* Take the lane's jobs not yet launched, up to KVT_BATCH_ROWS rows (at least one job; only
 * one without coalescing), into the lane's job scratch; under the mutex. Returns how many,
 * 0 if out of memory. Sets `*prev` to the previous batch's end event if it is not yet polled. */
static size_t take_batch(kvt_cuda *c, kvt_lane *l, CUevent *prev) {
    size_t pending = l->len - l->launched, k = 0, rows = 0;
    size_t most = c->coalesce ? pending : 1;
    if (most > l->jobs_cap) {
        size_t cap = most < 64 ? 64 : most;
        kvt_job *jobs = realloc(l->jobs, cap * sizeof *jobs);
        if (jobs)
            l->jobs = jobs;
        int *oks = jobs ? realloc(l->oks, cap * sizeof *oks) : NULL;
        if (oks)
            l->oks = oks;
        if (!jobs || !oks)
            return 0;
        l->jobs_cap = cap;
    }
    for (; k < most && (k == 0 || rows < KVT_BATCH_ROWS); k++) {
        uint64_t seq = l->first_seq + l->launched + k;
        kvt_record *rec = at_seq(l, seq);
        l->jobs[k] = (kvt_job){seq, rec->nbytes, rec->compute_stream, rec->rows, rec->n,
                               rec->table, rec->fail, rec->compute};
        rows += rec->n;
    }
    *prev = l->prev_last >= l->first_seq ? at_seq(l, l->prev_last)->end : NULL;
    return k;
}

/* Mark jobs `j[0..k)` launched as one batch; under the mutex. */
static void launched(kvt_cuda *c, kvt_lane *l, const kvt_job *j, size_t k, const int *ok,
                     int borrow) {
    uint64_t first = j[0].seq, last = j[k - 1].seq, bytes = 0;
    for (size_t i = 0; i < k; i++) {
        kvt_record *rec = at_seq(l, j[i].seq);
        rec->ok = ok[i];
        rec->first = first, rec->last = last;
        rec->borrowed = i == 0 && borrow;
        bytes += j[i].nbytes;
    }
    kvt_record *head = at_seq(l, first);
    head->batch_bytes = bytes, head->batch_jobs = k;
    l->launched += k;
    l->prev_last = last;
    if (l->nflight == KVT_DEPTH_MAX) { /* only a throttle: forget the oldest */
        memmove(l->flight, l->flight + 1, (KVT_DEPTH_MAX - 1) * sizeof *l->flight);
        l->nflight--;
    }
    l->flight[l->nflight++] = last;
    pthread_cond_broadcast(&c->launched);
    if (l->want >= first) /* the lane's waiter thread waits for this launch */
        pthread_cond_broadcast(&c->waited);
}

/* Launch one batch of lane `l`'s waiting jobs: take them under the mutex, queue them without
 * it, mark them under it. Called with the mutex held; returns with it held. */
static void launch_next(kvt_cuda *c, kvt_lane *l, int entered) {
    CUevent prev = NULL;
    size_t k = take_batch(c, l, &prev);
    if (!k) { /* out of memory for the job list: fail the oldest job alone */
        static const int no = 0;
        kvt_job one = {l->first_seq + l->launched, 0, 0, NULL, 0, 0, 1, NULL};
        launched(c, l, &one, 1, &no, 0);
        return;
    }
    kvt_record *first = at_seq(l, l->jobs[0].seq), *last = at_seq(l, l->jobs[k - 1].seq);
    CUevent start = first->start, end = last->end;
    /* It may borrow `prev`: marked now, not once launched, so that a submit meanwhile (a
     * poll may take the previous batch and make this job the oldest) grows the ring rather
     * than reuse the slot before it, whose end event would be this batch's start. Reused, its
     * event was recorded again by a later job and the batch's time came out wrong. */
    first->borrowed = prev != NULL;
    pthread_mutex_unlock(&c->mu);
    int borrow = 0;
    if (entered) {
        /* While the lane's previous batch is still queued or running, this one starts when
         * it ends: that batch's end event is this one's start, one event fewer a batch. On an
         * H100, single 1 MiB blocks went from 77 to 81-82% of a contiguous copy, 256 KiB
         * ones from 26-36 to 40-45% (docs/bench/transfer.md). */
        borrow = prev && c->cu.event_query(prev) == CUDA_ERROR_NOT_READY;
        launch_batch(c, l, l->jobs, k, borrow, start, end, l->oks);
    } else {
        for (size_t i = 0; i < k; i++)
            l->oks[i] = 0;
    }
    pthread_mutex_lock(&c->mu);
    launched(c, l, l->jobs, k, l->oks, borrow);
}

typedef struct {
    kvt_cuda *c;
    kvt_lane *l;
} kvt_launcher_arg;

/* A coalescing lane's thread: launch what waits, holding it back while `depth` batches are
 * queued on the GPU, so that it leaves as one batch when the oldest ends. */
static void *launcher(void *arg) {
    kvt_cuda *c = ((kvt_launcher_arg *)arg)->c;
    kvt_lane *l = ((kvt_launcher_arg *)arg)->l;
    free(arg);
    CUcontext none;
    int entered = enter(c, &none) == CUDA_SUCCESS; /* if not, its batches are failed */
    pthread_mutex_lock(&c->mu);
    c->started++;
    pthread_cond_broadcast(&c->launched); /* kvt_cuda_coalesce waits on it */
    for (;;) {
        while (l->nflight) { /* drop the batches that have ended (or were polled) */
            uint64_t s = l->flight[0];
            if (entered && s >= l->first_seq &&
                c->cu.event_query(at_seq(l, s)->end) == CUDA_ERROR_NOT_READY)
                break;
            memmove(l->flight, l->flight + 1, (l->nflight - 1) * sizeof *l->flight);
            l->nflight--;
        }
        if (l->launched == l->len) {
            if (c->stopping)
                break;
            l->idle = 1;
            pthread_cond_wait(&l->work, &c->mu);
            l->idle = 0;
            continue;
        }
        if (l->nflight >= c->depth && !c->stopping) {
            /* Only this thread records the lane's end events, so the event cannot be
             * recorded again while it waits (if its job is polled meanwhile, it has ended).
             * The loop's first step then drops the batch: its event is no longer pending. */
            CUevent e = at_seq(l, l->flight[0])->end;
            pthread_mutex_unlock(&c->mu);
            c->cu.event_sync(e);
            pthread_mutex_lock(&c->mu);
            continue;
        }
        if (!entered) {
            /* Asked again before each batch: a thread that could not enter once (it may start
             * late, while the context was briefly not current-able) must not fail every later
             * job of its lane too. */
            pthread_mutex_unlock(&c->mu);
            entered = enter(c, &none) == CUDA_SUCCESS;
            pthread_mutex_lock(&c->mu);
        }
        launch_next(c, l, entered);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Stop the engine: launch threads of lanes [0, n) launch what waits, then end and are joined. */
static void stop_launchers(kvt_cuda *c, int n) {
    pthread_mutex_lock(&c->mu);
    c->stopping = 1;
    for (int k = 0; k < n; k++)
        pthread_cond_signal(&c->lanes[k].work);
    pthread_mutex_unlock(&c->mu);
    for (int k = 0; k < n; k++)
        pthread_join(c->lanes[k].thread, NULL);
}

/* Start a launch thread per lane that coalesces queued jobs, keeping at most `depth` (1 to
 * KVT_DEPTH_MAX) batches queued on the GPU per lane. Call once, before the first submit; it
 * returns once every thread has tried to make the engine's context current. Returns 0, or 1
 * if `depth` is out of range, a thread could not start or jobs were already submitted
 * (nothing changed then). */
int kvt_cuda_coalesce(kvt_cuda *c, size_t depth) {
    if (depth < 1 || depth > KVT_DEPTH_MAX || c->coalesce)
        return 1;
    for (int i = 0; i < KVT_LANES; i++)
        if (c->lanes[i].first_seq != 1 || c->lanes[i].len)
            return 1;
    c->depth = depth;
    c->coalesce = 1;
    for (int i = 0; i < KVT_LANES; i++) {
        kvt_launcher_arg *a = malloc(sizeof *a);
        if (a)
            *a = (kvt_launcher_arg){c, &c->lanes[i]};
        if (!a || pthread_create(&c->lanes[i].thread, NULL, launcher, a)) {
            free(a);
            stop_launchers(c, i);
            c->stopping = 0;
            c->coalesce = 0;
            c->started = 0;
            return 1;
        }
    }
    /* Return once each thread has tried to enter: a thread that started after the first
     * submits would ask again for its first batch at once, and whether a refusal failed that
     * batch or only the thread's start then depended on thread timing. */
    pthread_mutex_lock(&c->mu);
    while (c->started < KVT_LANES)
        pthread_cond_wait(&c->launched, &c->mu);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* Queue job `id` in `lane` with its rows given: `dst[i]` and `src[i]` are rows of the table's
 * destination and source. It waits for the work queued so far on `compute`. `fail` records
 * the job as failed without copying. Returns 0 (queued; a refused launch makes the job
 * failed), -1 out of memory or engine stopping, CUDA_ERROR_INVALID_VALUE (1) for a lane or
 * table that does not exist, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (900) while `compute` is
 * being captured into a CUDA graph, or a CUresult if the wait for compute could not be queued
 * (nothing queued in any of these cases). The rows are copied. */
static int submit(kvt_cuda *c, int lane, uint64_t compute, int64_t id, int fail, int table,
                  uint64_t nbytes, const int64_t *dst, const int64_t *src, size_t n);

int kvt_cuda_submit(kvt_cuda *c, int lane, uint64_t compute, int64_t id, int fail, int table,
                    uint64_t nbytes, const int64_t *dst, const int64_t *src, size_t n) {
    /* The tables are all added before the first submit, so ntables is read without the
     * mutex. A job submitted failed copies nothing, but a bad index is the caller's bug. */
    if (lane < 0 || lane >= KVT_LANES || table < 0 || (size_t)table >= c->ntables)
        return CUDA_ERROR_INVALID_VALUE;
    CUcontext prev;
    CUresult r = enter(c, &prev);
    if (r != CUDA_SUCCESS)
        return r;
    /* On a stream being captured into a CUDA graph, the event recorded below would join the
     * graph and the lane's wait on it would pull the lane into the capture: the job would be
     * part of the graph instead of copying now. Refused, nothing queued, for one driver call a
     * submit. A capture invalidated by an error (status 2) is still open: refused too. */
    int capturing = 0;
    if (c->cu.stream_capturing &&
        (r = c->cu.stream_capturing((CUstream)(uintptr_t)compute, &capturing)) ==
            CUDA_SUCCESS &&
        capturing)
        r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (r == CUDA_SUCCESS)
        r = submit(c, lane, compute, id, fail, table, nbytes, dst, src, n);
    leave(c, prev);
    return r;
}

/* kvt_cuda_submit in the engine's context. */
static int submit(kvt_cuda *c, int lane, uint64_t compute, int64_t id, int fail, int table,
                  uint64_t nbytes, const int64_t *dst, const int64_t *src, size_t n) {
    kvt_lane *l = &c->lanes[lane];
    CUresult r;
    pthread_mutex_lock(&c->mu);
    if (c->stopping) {
        pthread_mutex_unlock(&c->mu);
        return -1;
    }
    /* Grow the ring when it is full, or when the next slot is the one whose end event the
     * oldest job borrowed as its start. Every slot moves, in order (from the one before the
     * oldest job where there is one), so that no event is lost or parted from its borrower.
     * (A job borrows only from a batch still in the ring when it is taken for launch; it
     * is marked then, since that batch may be polled before the launch is done.) */
    if (l->len == l->cap || (l->len + 1 == l->cap && l->r[l->head].borrowed)) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        kvt_record *nr = calloc(cap, sizeof *nr);
        if (!nr) {
            pthread_mutex_unlock(&c->mu);
            return -1;
        }
        size_t from = l->len == l->cap ? 0 : 1; /* a full ring has no slot before its oldest */
        for (size_t i = 0; i < l->cap; i++)
            nr[i] = l->r[(l->head + l->cap - from + i) % l->cap];
        free(l->r);
        l->r = nr;
        l->head = from;
        l->cap = cap;
    }
    kvt_record *rec = &l->r[(l->head + l->len) % l->cap];
    if (2 * n > rec->rows_cap) {
        int64_t *rows = realloc(rec->rows, 2 * n * sizeof *rows);
        if (!rows) {
            pthread_mutex_unlock(&c->mu);
            return -1;
        }
        rec->rows = rows;
        rec->rows_cap = 2 * n;
    }
    if ((!rec->compute &&
         (r = c->cu.event_create(&rec->compute, 2 /* CU_EVENT_DISABLE_TIMING */))) ||
        (!rec->start && (r = c->cu.event_create(&rec->start, 0))) ||
        (!rec->end && (r = c->cu.event_create(&rec->end, 0))) ||
        /* Stores read KV that the compute stream is producing; loads overwrite blocks it may
         * still be reading. Both wait for the compute queued so far. */
        (r = c->cu.event_record(rec->compute, (CUstream)(uintptr_t)compute))) {
        pthread_mutex_unlock(&c->mu);
        return r;
    }
    if (n) {
        memcpy(rec->rows, dst, n * sizeof *dst);
        memcpy(rec->rows + n, src, n * sizeof *src);
    }
    rec->id = id, rec->ok = 0, rec->fail = fail != 0, rec->borrowed = 0;
    rec->table = table, rec->nbytes = nbytes, rec->n = n;
    rec->first = rec->last = 0;
    rec->compute_stream = compute;
    l->len++;
    if (!c->coalesce)
        launch_next(c, l, 1);
    else if (l->idle)
        pthread_cond_signal(&l->work);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

/* kvt_cuda_submit with the job planned here, as kvt_engine_submit_ids does, with what the
 * group and direction share in `x`; 1 if the arguments are invalid (nothing queued). */
int kvt_cuda_submit_ids(kvt_cuda *c, const kvt_submit_ctx *x, int lane, uint64_t compute,
                        int64_t id, const int64_t *blocks, size_t nblocks, const int64_t *slots,
                        size_t nslots, size_t skip) {
    if (x->table >= c->ntables) /* before the cast to int could wrap it into range */
        return 1;
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

/* kvt_cuda_submit_ids in the shape submitext.c calls (its `seq` carries the compute stream):
 * 0 queued, 1 arguments refused, -1 anything else, with the CUresult (or -1, out of memory or
 * stopping) kept for kvt_cuda_last_error. */
int kvt_cuda_submit_ext(void *engine, const kvt_submit_ctx *x, int64_t id, int lane,
                        uint64_t compute, const int64_t *blocks, size_t nblocks,
                        const int64_t *slots, size_t nslots, size_t skip) {
    kvt_cuda *c = engine;
    int rc = kvt_cuda_submit_ids(c, x, lane, compute, id, blocks, nblocks, slots, nslots, skip);
    if (rc == 0 || rc == 1)
        return rc;
    c->last_error = rc;
    return -1;
}

int kvt_cuda_last_error(const kvt_cuda *c) { return c->last_error; }

/* The sequence number (counted from 1 per lane, in submission order, as kvt_cuda_wait takes
 * them) of the last job queued in `lane`: 0 for none yet or a lane that does not exist. The
 * caller, whose submits are serialised, numbers its jobs the same way; after a submit cut short
 * (Python can raise KeyboardInterrupt as the call returns) it learns from this whether the
 * job was queued, and where its count resumes. */
uint64_t kvt_cuda_accepted(kvt_cuda *c, int lane) {
    if (lane < 0 || lane >= KVT_LANES)
        return 0;
    pthread_mutex_lock(&c->mu);
    uint64_t seq = c->lanes[lane].first_seq + c->lanes[lane].len - 1;
    pthread_mutex_unlock(&c->mu);
    return seq;
}

/* Copy up to `max` finished jobs' results into `out`, each lane's in submission order, leaving
 * them in the engine (under the mutex; `entry`: enter()'s result). A job whose event reports
 * an error (a failed copy poisons the context) is reported failed. So is every launched job
 * when the engine's context cannot be made current: its event cannot be asked, and a poll
 * that returned nothing then left those jobs unreported for good (as a launch thread that
 * cannot enter fails its jobs unlaunched). A batch's GPU time is shared among its jobs by
 * their bytes; its first job keeps it for drop(), since a later peek may report the rest. */
static size_t peek(kvt_cuda *c, CUresult entry, kvt_result *out, size_t max) {
    size_t k = 0;
    for (int i = 0; i < KVT_LANES; i++) {
        kvt_lane *l = &c->lanes[i];
        double batch_ms = l->batch_ms;
        uint64_t batch_bytes = l->batch_bytes, batch_jobs = l->batch_jobs;
        for (size_t j = 0; j < l->launched && k < max; j++) {
            uint64_t seq = l->first_seq + j;
            kvt_record *rec = at_seq(l, seq);
            CUevent end = at_seq(l, rec->last)->end;
            CUresult r = entry == CUDA_SUCCESS ? c->cu.event_query(end) : entry;
            if (r == CUDA_ERROR_NOT_READY)
                break;
            if (rec->first == seq) { /* the batch's first job: time the batch */
                float ms = 0;
                /* A borrowed start is the end event of the slot before: the previous batch's
                 * last job, in the ring or (for the oldest job) kept by submit's growth. */
                CUevent start =
                    rec->borrowed ? l->r[(l->head + j + l->cap - 1) % l->cap].end : rec->start;
                /* No time rather than a wrong one: an event that cannot be timed, or a
                 * stale start that makes the time negative. */
                if (r == CUDA_SUCCESS && (c->cu.event_elapsed(&ms, start, end) != CUDA_SUCCESS ||
                                          !(ms >= 0)))
                    ms = 0;
                rec->batch_ms = batch_ms = ms;
                batch_bytes = rec->batch_bytes, batch_jobs = rec->batch_jobs;
            }
            double share = batch_bytes ? (double)rec->nbytes / (double)batch_bytes
                                       : 1.0 / (double)(batch_jobs ? batch_jobs : 1);
            int ok = rec->ok && r == CUDA_SUCCESS;
            out[k++] = (kvt_result){rec->id, ok, i, ok ? batch_ms * share / 1e3 : 0};
        }
    }
    return k;
}

/* Remove the results `seen[0..k)`, which the latest peek returned, from the engine: per lane,
 * as many of its oldest jobs as `seen` holds of that lane (under the mutex). Jobs that
 * finished since that peek stay, for the next one. */
static void drop(kvt_cuda *c, const kvt_result *seen, size_t k) {
    size_t n[KVT_LANES] = {0};
    for (size_t i = 0; i < k; i++)
        if (seen[i].lane >= 0 && seen[i].lane < KVT_LANES)
            n[seen[i].lane]++;
    for (int i = 0; i < KVT_LANES; i++) {
        kvt_lane *l = &c->lanes[i];
        for (size_t m = n[i] < l->launched ? n[i] : l->launched; m > 0; m--) {
            kvt_record *rec = &l->r[l->head];
            if (rec->first == l->first_seq) { /* the batch's later jobs are timed by it */
                l->batch_ms = rec->batch_ms;
                l->batch_bytes = rec->batch_bytes, l->batch_jobs = rec->batch_jobs;
            }
            l->head = (l->head + 1) % l->cap;
            l->len--;
            l->launched--;
            l->first_seq++;
        }
    }
}

/* Move up to `max` finished jobs into `out`, each lane's in submission order (see peek). */
size_t kvt_cuda_poll(kvt_cuda *c, kvt_result *out, size_t max) {
    CUcontext prev;
    CUresult entry = enter(c, &prev);
    pthread_mutex_lock(&c->mu);
    size_t k = peek(c, entry, out, max);
    drop(c, out, k);
    pthread_mutex_unlock(&c->mu);
    if (entry == CUDA_SUCCESS)
        leave(c, prev);
    return k;
}

/* kvt_cuda_poll in two steps: copy the results (kvt_cuda_peek), then remove them
 * (kvt_cuda_drop, given what that peek returned) once the caller holds them for good. Python
 * can raise an interrupt (Ctrl-C) as any call returns: results taken in one step were lost
 * with it, and their jobs never reported (cuda_worker.py). Peeks and drops are serialised by
 * the caller, with its submits; a peek repeated before the drop returns the same results
 * first. */
size_t kvt_cuda_peek(kvt_cuda *c, kvt_result *out, size_t max) {
    CUcontext prev;
    CUresult entry = enter(c, &prev);
    pthread_mutex_lock(&c->mu);
    size_t k = peek(c, entry, out, max);
    pthread_mutex_unlock(&c->mu);
    if (entry == CUDA_SUCCESS)
        leave(c, prev);
    return k;
}

void kvt_cuda_drop(kvt_cuda *c, const kvt_result *seen, size_t k) {
    pthread_mutex_lock(&c->mu);
    drop(c, seen, k);
    pthread_mutex_unlock(&c->mu);
}

/* Block until `lane`'s job `seq` has finished, or return at once if it has been polled:
 * first until it is launched, then on its batch's end event, outside the mutex. The event's
 * slot may be reused meanwhile by a later job, which only makes the wait longer. Returns 0
 * or the CUresult of the wait. */
int kvt_cuda_wait(kvt_cuda *c, int lane, uint64_t seq) {
    if (lane < 0 || lane >= KVT_LANES)
        return CUDA_ERROR_INVALID_VALUE;
    kvt_lane *l = &c->lanes[lane];
    CUcontext prev;
    CUresult r = enter(c, &prev);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&c->mu);
    while (seq >= l->first_seq && seq < l->first_seq + l->len &&
           seq >= l->first_seq + l->launched)
        pthread_cond_wait(&c->launched, &c->mu);
    CUevent end = NULL;
    if (seq >= l->first_seq && seq < l->first_seq + l->len)
        end = at_seq(l, at_seq(l, seq)->last)->end;
    pthread_mutex_unlock(&c->mu);
    r = end ? c->cu.event_sync(end) : CUDA_SUCCESS;
    leave(c, prev);
    return r;
}

#ifdef __linux__
#define KVT_WAIT_CLOCK CLOCK_MONOTONIC
#else
#define KVT_WAIT_CLOCK CLOCK_REALTIME
#endif
/* kvt_cuda_wait_for asks the event itself this long before it hands the wait over: on an H200
 * a handed-over wait cost 9-20 us more, and one asked here no more than kvt_cuda_wait. */
#define KVT_WAIT_SPIN_NS 1000000u

/* A lane's waiter thread of kvt_cuda_wait_for: while a caller waits for a job not yet seen
 * to end, block on the end event of the lane's oldest such batch, once launched, outside the
 * mutex, then tell the callers. Batch by batch, in order: blocked on the latest wanted job
 * alone, it left a caller of an earlier one waiting after that job had ended (until its
 * timeout). Only these threads block without a bound; callers wait for them in slices. The
 * engine's context stays current on it, as on a launch thread: the thread is the engine's. */
static void *waiter(void *arg) {
    kvt_cuda *c = ((kvt_launcher_arg *)arg)->c;
    kvt_lane *l = ((kvt_launcher_arg *)arg)->l;
    free(arg);
    CUcontext none;
    CUresult entered = enter(c, &none);
    pthread_mutex_lock(&c->mu);
    while (!c->waiter_quit) {
        if (l->want > l->reached && l->want < l->first_seq) { /* polled: it has ended */
            l->reached = l->want;
            pthread_cond_broadcast(&c->waited);
            continue;
        }
        uint64_t next = l->reached < l->first_seq ? l->first_seq : l->reached + 1;
        if (l->want < next || next >= l->first_seq + l->launched) {
            /* Not on `launched`, which every launch broadcasts: woken there, it took the
             * mutex from the submitter once a job. A launch wakes it here only for a job a
             * caller waits for (`launched`). */
            pthread_cond_wait(&c->waited, &c->mu);
            continue;
        }
        uint64_t last = at_seq(l, next)->last;
        CUevent end = at_seq(l, last)->end;
        pthread_mutex_unlock(&c->mu);
        if (entered != CUDA_SUCCESS) /* asked again: it may have started too early */
            entered = enter(c, &none);
        CUresult r = entered != CUDA_SUCCESS ? entered : c->cu.event_sync(end);
        pthread_mutex_lock(&c->mu);
        if (r != CUDA_SUCCESS)
            l->failed_rc = r, l->failed_upto = last;
        if (last > l->reached)
            l->reached = last;
        pthread_cond_broadcast(&c->waited);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Start lane `l`'s waiter thread if it has none; under the mutex. */
static void start_waiter(kvt_cuda *c, kvt_lane *l) {
    if (l->waiter_on || c->waiter_quit)
        return;
    kvt_launcher_arg *a = malloc(sizeof *a);
    if (a)
        *a = (kvt_launcher_arg){c, l};
    l->waiter_on = a && !pthread_create(&l->waiter, NULL, waiter, a);
    if (!l->waiter_on)
        free(a);
}

/* End the waiter threads, each after the wait it is in: a job whose copies never end holds
 * kvt_cuda_free up here, as it does kvt_cuda_sync (which Python's engine calls first). */
static void stop_waiter(kvt_cuda *c) {
    pthread_mutex_lock(&c->mu);
    c->waiter_quit = 1;
    pthread_cond_broadcast(&c->waited);
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < KVT_LANES; i++)
        if (c->lanes[i].waiter_on)
            pthread_join(c->lanes[i].waiter, NULL);
}

/* kvt_cuda_wait for at most `timeout_ns`: 0 once `lane`'s job `seq` has finished (or at once
 * if it is polled or was never queued), -1 if it has not by then, or the CUresult of a wait
 * that failed (the job may then still be copying). A Python caller waits in slices and
 * returns to Python between them, where a Ctrl-C is raised: in one call (kvt_cuda_wait) it
 * was not seen until the copies ended, or ever where they never did. A job already done costs
 * one event query; otherwise a waiter thread blocks on the event and wakes the callers. */
int kvt_cuda_wait_for(kvt_cuda *c, int lane, uint64_t seq, uint64_t timeout_ns) {
    if (lane < 0 || lane >= KVT_LANES)
        return CUDA_ERROR_INVALID_VALUE;
    kvt_lane *l = &c->lanes[lane];
    CUcontext prev;
    CUresult r = enter(c, &prev);
    if (r != CUDA_SUCCESS)
        return r;
    struct timespec until;
    clock_gettime(KVT_WAIT_CLOCK, &until);
    uint64_t now_ns = (uint64_t)until.tv_sec * 1000000000u + (uint64_t)until.tv_nsec;
    until.tv_sec += (time_t)(timeout_ns / 1000000000u);
    until.tv_nsec += (long)(timeout_ns % 1000000000u);
    if (until.tv_nsec >= 1000000000L)
        until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&c->mu);
    CUevent end = NULL;
    /* Asked again where a failed wait covered it: that failure must not outlive the copies. */
    if (seq >= l->first_seq && seq < l->first_seq + l->launched &&
        (seq > l->reached || seq <= l->failed_upto))
        end = at_seq(l, at_seq(l, seq)->last)->end;
    pthread_mutex_unlock(&c->mu);
    /* Most copies end within a millisecond: asked here first (as cuEventSynchronize spins),
     * since handing the wait to the waiter thread costs a wake-up. A slot reused meanwhile by
     * a later job only makes this longer. */
    uint64_t spin_ns = timeout_ns < KVT_WAIT_SPIN_NS ? timeout_ns : KVT_WAIT_SPIN_NS;
    for (CUresult q = end ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS; q == CUDA_ERROR_NOT_READY;) {
        q = c->cu.event_query(end);
        if (q == CUDA_SUCCESS) {
            leave(c, prev);
            return 0;
        }
        struct timespec t;
        clock_gettime(KVT_WAIT_CLOCK, &t);
        if ((uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec - now_ns >= spin_ns)
            break;
    }
    pthread_mutex_lock(&c->mu);
    int rc = 0;
    if (seq >= l->first_seq && seq < l->first_seq + l->len && seq > l->reached) {
        if (seq > l->want)
            l->want = seq;
        start_waiter(c, l);
        pthread_cond_broadcast(&c->waited); /* the waiter waits on it for work */
        while (l->waiter_on && !c->waiter_quit && seq >= l->first_seq && seq > l->reached)
            if (pthread_cond_timedwait(&c->waited, &c->mu, &until) == ETIMEDOUT)
                break;
        if (seq < l->first_seq) /* polled: ended, and reported by the poll */
            rc = 0;
        else if (seq <= l->reached)
            rc = seq <= l->failed_upto ? l->failed_rc : 0;
        else /* no waiter (it could not start): wait here without a bound, as kvt_cuda_wait */
            rc = l->waiter_on ? -1 : CUDA_ERROR_NOT_READY;
    } else if (seq >= l->first_seq && seq < l->first_seq + l->len) {
        rc = seq <= l->failed_upto ? l->failed_rc : 0; /* the waiter saw it end */
    }
    pthread_mutex_unlock(&c->mu);
    leave(c, prev);
    if (rc == CUDA_ERROR_NOT_READY)
        return kvt_cuda_wait(c, lane, seq);
    return rc;
}

/* Block until every job submitted so far is launched and its copies have finished. Returns 0,
 * or the CUresult of a failed enter or synchronize: copies may then still be running (or never
 * launched, where enter failed), and their jobs stay queued for kvt_cuda_poll. */
int kvt_cuda_sync(kvt_cuda *c) {
    CUcontext prev;
    CUresult r = enter(c, &prev);
    if (r != CUDA_SUCCESS)
        return r;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < KVT_LANES; i++)
        while (c->lanes[i].launched < c->lanes[i].len)
            pthread_cond_wait(&c->launched, &c->mu);
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < KVT_LANES && r == CUDA_SUCCESS; i++)
        r = c->cu.stream_sync(c->lanes[i].stream);
    leave(c, prev);
    return r;
}

/* Stop the launch threads (each launches what waits first) and the waiter threads (each ends
 * the wait it is in: copies that never end hold this up) and free everything. */
void kvt_cuda_free(kvt_cuda *c) {
    if (!c)
        return;
    if (c->sync_made) { /* with coalescing, every lane has its thread */
        stop_launchers(c, c->coalesce ? KVT_LANES : 0);
        stop_waiter(c);
    }
    CUcontext prev;
    if (c->ctx && enter(c, &prev) == CUDA_SUCCESS) {
        for (int i = 0; i < KVT_LANES; i++) {
            kvt_lane *l = &c->lanes[i];
            for (size_t k = 0; k < l->cap; k++) {
                CUevent evs[3] = {l->r[k].compute, l->r[k].start, l->r[k].end};
                for (int e = 0; e < 3; e++)
                    if (evs[e])
                        c->cu.event_destroy(evs[e]);
            }
        }
        if (c->module)
            c->cu.module_unload(c->module);
        leave(c, prev);
    }
    for (int i = 0; i < KVT_LANES; i++) {
        kvt_lane *l = &c->lanes[i];
        for (size_t k = 0; k < l->cap; k++)
            free(l->r[k].rows);
        free(l->r);
        free(l->dma);
        free(l->merged);
        free(l->jobs);
        free(l->oks);
    }
    if (c->sync_made) {
        for (int i = 0; i < KVT_LANES; i++)
            pthread_cond_destroy(&c->lanes[i].work);
        pthread_cond_destroy(&c->waited);
        pthread_cond_destroy(&c->launched);
        pthread_mutex_destroy(&c->mu);
    }
    for (size_t i = 0; i < c->ntables; i++)
        free(c->tables[i].segs);
    free(c->tables);
    free(c->rows);
    if (c->lib)
        dlclose(c->lib);
    free(c);
}
