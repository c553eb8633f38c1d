/* A stand-in for the CUDA driver (libcuda.so.1) on host memory, for cuda_check.c: it lets
 * cudaengine.c's logic (row planning, launch parameters, the choice of kernel or batched
 * copy, the lanes' rings and borrowed start events, the wait for the compute stream, failed
 * launches) run where there is no GPU. Only the functions cudaengine.c resolves exist.
 *
 * Streams are queues of operations that run only when the harness calls fake_run() (or a
 * synchronize call), so that work can be seen queued and not yet done, as on a GPU. Kernels
 * are gather.cu's, emulated block by block: each block copies its piece of a row's segment,
 * and an access that gather.cu's vector width would make misaligned poisons the context, as
 * a misaligned address does on a GPU. Event times count bytes copied: 1 ms per MB.
 *
 * Thread-safe, as the driver is (the engine's launch threads call it beside the harness):
 * one mutex guards everything. A synchronize call runs what can run and then blocks until
 * another thread lets more run (releases a held stream, queues work); after 10 s without
 * progress it gives up with ERR_WOULD_HANG, so that a harness bug fails instead of hanging.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
#define OK 0
#define ERR_INVALID 1
#define ERR_NOT_FOUND 500
#define ERR_NOT_READY 600
#define ERR_MISALIGNED 716
#define ERR_WOULD_HANG 999 /* a synchronize on work that can never run (a held stream) */

enum { ROWS_MANY = 480, ROWS_FEW = 32, THREADS = 256, MAX_STREAMS = 16 };

typedef struct { /* gather.cu's Segment */
    uint64_t dst_base, dst_stride, src_base, src_stride, width;
} segment;

typedef struct { /* gather.cu's kernels: their row capacity and access width */
    const char *name;
    int rows, width;
} kernel;

static const kernel kernels[] = {
    {"kvt_copy16", ROWS_MANY, 16}, {"kvt_copy8", ROWS_MANY, 8},    {"kvt_copy4", ROWS_MANY, 4},
    {"kvt_copy2", ROWS_MANY, 2},   {"kvt_copy1", ROWS_MANY, 1},    {"kvt_copy16_32", ROWS_FEW, 16},
    {"kvt_copy8_32", ROWS_FEW, 8}, {"kvt_copy4_32", ROWS_FEW, 4},  {"kvt_copy2_32", ROWS_FEW, 2},
    {"kvt_copy1_32", ROWS_FEW, 1},
};

typedef struct {
    int live;
    uint64_t recorded, done; /* record generations queued and reached */
    double ms;               /* the clock when the latest generation was reached */
} event;

enum { OP_KERNEL, OP_BATCH, OP_RECORD, OP_WAIT, OP_HOST };

typedef struct op {
    struct op *next;
    int kind;
    const kernel *k;
    unsigned grid[3];
    unsigned char *params; /* a copy, as the driver takes at launch */
    uint64_t *dsts, *srcs, *sizes;
    size_t count;
    event *ev;
    uint64_t gen;
    void (*fn)(void *);
    void *arg;
} op;

typedef struct {
    uintptr_t handle;
    op *head, *tail;
    int held;
} queue;

static queue queues[MAX_STREAMS];
static double clock_ms;
static CUresult sticky; /* a poisoned context reports this from then on */
static int fail_launch_at = -1, launches, batches, live_events, context_set = 1;
static int ctx_token;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t progress = PTHREAD_COND_INITIALIZER;
static unsigned long changes; /* bumped, with a broadcast, whenever more may be able to run */

static void changed(void) {
    changes++;
    pthread_cond_broadcast(&progress);
}

/* Wait for another thread's change; 0 after 10 s without one. Called with `mu` held. */
static int await_change(void) {
    unsigned long seen = changes;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    while (changes == seen)
        if (pthread_cond_timedwait(&progress, &mu, &until) == ETIMEDOUT)
            return 0;
    return 1;
}

#define LOCKED(type, body)                                                                      \
    do {                                                                                        \
        pthread_mutex_lock(&mu);                                                                \
        type result_ = (body);                                                                  \
        pthread_mutex_unlock(&mu);                                                              \
        return result_;                                                                         \
    } while (0)

/* ---- the harness's controls ---- */

int fake_launches(void) { LOCKED(int, launches); }
int fake_batches(void) { LOCKED(int, batches); }
int fake_live_events(void) { LOCKED(int, live_events); }
CUresult fake_sticky(void) { LOCKED(CUresult, sticky); }
/* The `n`th launch from now (0: the next) is refused. */
void fake_fail_launch(int n) {
    pthread_mutex_lock(&mu);
    fail_launch_at = launches + n;
    pthread_mutex_unlock(&mu);
}

static queue *find(uintptr_t h) {
    for (int i = 0; i < MAX_STREAMS; i++)
        if (queues[i].handle == h)
            return &queues[i];
    for (int i = 0; i < MAX_STREAMS; i++)
        if (!queues[i].handle) {
            queues[i].handle = h;
            return &queues[i];
        }
    abort(); /* more streams than a harness uses */
}

static void push(uintptr_t h, op *o) {
    queue *s = find(h);
    o->next = NULL;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    changed();
}

/* Hold or release stream `h`: a held stream runs nothing (a long kernel on it, say). */
void fake_hold(uintptr_t h, int held) {
    pthread_mutex_lock(&mu);
    find(h)->held = held;
    changed();
    pthread_mutex_unlock(&mu);
}

/* Queue a host function on stream `h`: the harness's stand-in for compute. */
void fake_host(uintptr_t h, void (*fn)(void *), void *arg) {
    op *o = calloc(1, sizeof *o);
    o->kind = OP_HOST, o->fn = fn, o->arg = arg;
    pthread_mutex_lock(&mu);
    push(h, o);
    pthread_mutex_unlock(&mu);
}

static void copy_block(const kernel *k, const unsigned char *p, unsigned x, unsigned y,
                       unsigned z) {
    uint64_t segments;
    uint32_t n, chunk;
    memcpy(&segments, p, 8);
    memcpy(&n, p + 8, 4);
    memcpy(&chunk, p + 12, 4);
    const uint32_t *dst = (const uint32_t *)(p + 16), *src = dst + k->rows;
    if (y >= n) { /* gather.cu trusts gridDim.y == n */
        sticky = ERR_INVALID;
        return;
    }
    const segment *s = (const segment *)(uintptr_t)segments + z;
    uint64_t off = (uint64_t)x * chunk;
    if (off >= s->width)
        return;
    uint64_t len = s->width - off < chunk ? s->width - off : chunk;
    uint64_t from = s->src_base + src[y] * s->src_stride + off;
    uint64_t to = s->dst_base + dst[y] * s->dst_stride + off;
    if ((from | to | len) % (uint64_t)k->width) {
        sticky = ERR_MISALIGNED;
        return;
    }
    memcpy((void *)(uintptr_t)to, (const void *)(uintptr_t)from, len);
    clock_ms += (double)len / 1e6;
}

static void execute(op *o) {
    switch (o->kind) {
    case OP_KERNEL:
        for (unsigned z = 0; z < o->grid[2]; z++)
            for (unsigned y = 0; y < o->grid[1]; y++)
                for (unsigned x = 0; x < o->grid[0]; x++)
                    copy_block(o->k, o->params, x, y, z);
        break;
    case OP_BATCH:
        for (size_t i = 0; i < o->count; i++) {
            memcpy((void *)(uintptr_t)o->dsts[i], (const void *)(uintptr_t)o->srcs[i],
                   o->sizes[i]);
            clock_ms += (double)o->sizes[i] / 1e6;
        }
        break;
    case OP_RECORD:
        o->ev->done = o->gen;
        o->ev->ms = clock_ms;
        break;
    case OP_HOST:
        o->fn(o->arg);
        break;
    }
    free(o->params);
    free(o->dsts);
    free(o);
}

/* Run every operation that can run, in each stream's order; returns how many ran. */
static int run(void) {
    int ran = 0, progress = 1;
    while (progress) {
        progress = 0;
        for (int i = 0; i < MAX_STREAMS; i++) {
            queue *s = &queues[i];
            while (s->head && !s->held) {
                op *o = s->head;
                if (o->kind == OP_WAIT && o->ev->done < o->gen)
                    break;
                s->head = o->next;
                if (!s->head)
                    s->tail = NULL;
                if (o->kind == OP_WAIT)
                    free(o);
                else
                    execute(o);
                ran++, progress = 1;
            }
        }
    }
    if (ran)
        changed();
    return ran;
}

int fake_run(void) { LOCKED(int, run()); }

/* ---- the driver functions cudaengine.c resolves ---- */

/* A thread may make another device's context current (fake_other_context), as a caller whose
 * current torch device is not the engine's has; the engine must leave it so. */
static int other_token;
static __thread int other_current;

void *fake_other_context(void) { return &other_token; }
void fake_other_context_off(void) { other_current = 0; }

CUresult cuCtxGetCurrent(void **ctx) {
    *ctx = other_current ? (void *)&other_token : context_set ? &ctx_token : NULL;
    return OK;
}

CUresult cuCtxSetCurrent(void *ctx) {
    if (ctx != &ctx_token && ctx != &other_token)
        return ERR_INVALID;
    other_current = ctx == &other_token;
    return OK;
}

CUresult cuModuleLoadData(void **module, const void *image) {
    *module = (void *)image;
    return image ? OK : ERR_INVALID;
}

CUresult cuModuleGetFunction(void **fn, void *module, const char *name) {
    (void)module;
    for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++)
        if (!strcmp(kernels[i].name, name)) {
            *fn = (void *)&kernels[i];
            return OK;
        }
    return ERR_NOT_FOUND;
}

CUresult cuModuleUnload(void *module) { return module ? OK : ERR_INVALID; }

static CUresult launch(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz, unsigned shmem, void *stream, void **params,
                       void **extra) {
    const kernel *k = fn;
    if (launches++ == fail_launch_at)
        return ERR_INVALID;
    if (sticky)
        return sticky;
    if (!k || !params || extra || bx != THREADS || by != 1 || bz != 1 || shmem ||
        !gx || !gy || !gz || gy > (unsigned)k->rows)
        return ERR_INVALID;
    op *o = calloc(1, sizeof *o);
    size_t size = 16 + 8 * (size_t)k->rows;
    o->params = malloc(size);
    memcpy(o->params, params[0], size);
    o->kind = OP_KERNEL, o->k = k;
    o->grid[0] = gx, o->grid[1] = gy, o->grid[2] = gz;
    push((uintptr_t)stream, o);
    return OK;
}

CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shmem, void *stream, void **params,
                        void **extra) {
    LOCKED(CUresult, launch(fn, gx, gy, gz, bx, by, bz, shmem, stream, params, extra));
}

static CUresult memcpy_batch(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count,
                             void *attrs, size_t *attr_idxs, size_t nattrs, void *stream) {
    if (sticky)
        return sticky;
    if (!count || !attrs || !attr_idxs || nattrs != 1 || attr_idxs[0] != 0)
        return ERR_INVALID;
    op *o = calloc(1, sizeof *o);
    o->kind = OP_BATCH, o->count = count;
    o->dsts = malloc(3 * count * sizeof(uint64_t));
    o->srcs = o->dsts + count, o->sizes = o->srcs + count;
    memcpy(o->dsts, dsts, count * sizeof *dsts);
    memcpy(o->srcs, srcs, count * sizeof *srcs);
    for (size_t i = 0; i < count; i++)
        o->sizes[i] = sizes[i];
    push((uintptr_t)stream, o);
    batches++;
    return OK;
}

/* cuMemcpyBatchAsync's CUDA 13 signature; not resolved by cudaengine.c but handed to it, as
 * cuda_engine.py does with the real one. */
CUresult fake_memcpy_batch(uint64_t *dsts, uint64_t *srcs, size_t *sizes, size_t count,
                           void *attrs, size_t *attr_idxs, size_t nattrs, void *stream) {
    LOCKED(CUresult, memcpy_batch(dsts, srcs, sizes, count, attrs, attr_idxs, nattrs, stream));
}

CUresult cuEventCreate(void **ev, unsigned flags) {
    (void)flags;
    event *e = calloc(1, sizeof *e);
    e->live = 1;
    *ev = e;
    pthread_mutex_lock(&mu);
    live_events++;
    pthread_mutex_unlock(&mu);
    return OK;
}

static CUresult destroy(event *e) {
    if (!e || !e->live)
        return ERR_INVALID;
    e->live = 0; /* kept, so that a use after destroy is caught rather than undefined */
    live_events--;
    return OK;
}

CUresult cuEventDestroy_v2(void *ev) { LOCKED(CUresult, destroy(ev)); }

static CUresult record(event *e, void *stream) {
    if (!e || !e->live)
        return ERR_INVALID;
    op *o = calloc(1, sizeof *o);
    o->kind = OP_RECORD, o->ev = e, o->gen = ++e->recorded;
    push((uintptr_t)stream, o);
    return OK;
}

CUresult cuEventRecord(void *ev, void *stream) { LOCKED(CUresult, record(ev, stream)); }

static CUresult query(const event *e) {
    if (!e || !e->live)
        return ERR_INVALID;
    if (sticky)
        return sticky;
    return e->done >= e->recorded ? OK : ERR_NOT_READY;
}

CUresult cuEventQuery(void *ev) { LOCKED(CUresult, query(ev)); }

/* Run what can run until `e` (or, with `e` NULL, stream `s`) is done, waiting for other
 * threads' changes in between. */
static CUresult synchronize(const event *e, queue *s) {
    if (e && !e->live)
        return ERR_INVALID;
    for (;;) {
        run();
        if (sticky)
            return sticky;
        if (e ? e->done >= e->recorded : !s->head)
            return OK;
        if (!await_change())
            return ERR_WOULD_HANG;
    }
}

CUresult cuEventSynchronize(void *ev) {
    if (!ev)
        return ERR_INVALID;
    LOCKED(CUresult, synchronize(ev, NULL));
}

static CUresult elapsed(float *ms, const event *a, const event *b) {
    if (!a || !b || !a->live || !b->live || a->done < a->recorded || b->done < b->recorded)
        return ERR_INVALID;
    *ms = (float)(b->ms - a->ms);
    return OK;
}

CUresult cuEventElapsedTime(float *ms, void *start, void *end) {
    LOCKED(CUresult, elapsed(ms, start, end));
}

static CUresult stream_wait(void *stream, event *e, unsigned flags) {
    if (!e || !e->live || flags)
        return ERR_INVALID;
    op *o = calloc(1, sizeof *o);
    o->kind = OP_WAIT, o->ev = e, o->gen = e->recorded; /* the latest record, as CUDA */
    push((uintptr_t)stream, o);
    return OK;
}

CUresult cuStreamWaitEvent(void *stream, void *ev, unsigned flags) {
    LOCKED(CUresult, stream_wait(stream, ev, flags));
}

CUresult cuStreamSynchronize(void *stream) {
    LOCKED(CUresult, synchronize(NULL, find((uintptr_t)stream)));
}
