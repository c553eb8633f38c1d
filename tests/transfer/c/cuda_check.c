/* cudaengine.c against fake_cuda.c (a driver on host memory), built and run by
 * test_native_c.py: the CUDA submit path's logic where there is no GPU. Each check prints what
 * differs and the program exits 1; it prints "ok: ..." and exits 0 when all pass. The shared
 * checks run twice: jobs launched by the submitter, then by coalescing launch threads.
 *
 * "Device" blocks are host buffers of two segments (K and V, as two registered tensors);
 * the pool holds chunks of two blocks per slot. Lanes: 0 stores, 1 loads, 2 urgent loads.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_engine_api.h"

/* fake_cuda.c's controls */
int fake_run(void);
int fake_launches(void);
int fake_batches(void);
int fake_live_events(void);
int fake_sticky(void);
void fake_fail_launch(int n);
void *fake_other_context(void);
void fake_other_context_off(void);
int cuCtxGetCurrent(void **ctx);
int cuCtxSetCurrent(void *ctx);
void fake_hold(uintptr_t stream, int held);
void fake_host(uintptr_t stream, void (*fn)(void *), void *arg);
int fake_memcpy_batch(uint64_t *, uint64_t *, size_t *, size_t, void *, size_t *, size_t,
                      void *);

#define FAIL(...)                                                                               \
    do {                                                                                        \
        printf(__VA_ARGS__);                                                                    \
        printf("\n");                                                                           \
        exit(1);                                                                                \
    } while (0)

enum { NB = 1400, NS = 700, BPC = 2, COMPUTE = 9 };
static const uint64_t STREAMS[3] = {1, 2, 3};

typedef struct {
    size_t wk, wv, row; /* segment widths, host row bytes */
    unsigned char *k, *v, *host;
    kvtier_segment store[2], load[2];
    kvt_submit_ctx sx, lx;
    kvt_cuda *c;
    uint64_t seq[3];
} rig;

static size_t depth; /* 0: the submitter launches; else the launch threads' depth */

static uint64_t rnd_state = 88172645463325252ull;
static uint64_t rnd(void) {
    rnd_state ^= rnd_state << 13, rnd_state ^= rnd_state >> 7, rnd_state ^= rnd_state << 17;
    return rnd_state;
}

/* The first `n` of a random permutation of 0..m-1. */
static void pick(int64_t *out, size_t n, size_t m) {
    int64_t *all = malloc(m * sizeof *all);
    for (size_t i = 0; i < m; i++)
        all[i] = (int64_t)i;
    for (size_t i = 0; i < n; i++) {
        size_t j = i + rnd() % (m - i);
        int64_t t = all[i];
        all[i] = all[j], all[j] = t;
        out[i] = all[i];
    }
    free(all);
}

/* An engine over fresh buffers; `batch`: give it the batched copy; `wk`/`wv` decide the
 * access width of its kernels. */
static void rig_up(rig *r, size_t wk, size_t wv, int batch, uint64_t dma_min) {
    memset(r, 0, sizeof *r);
    r->wk = wk, r->wv = wv, r->row = wk + wv;
    r->k = malloc(NB * wk), r->v = malloc(NB * wv), r->host = calloc(NS * BPC, r->row);
    for (size_t i = 0; i < NB * wk; i++)
        r->k[i] = (unsigned char)rnd();
    for (size_t i = 0; i < NB * wv; i++)
        r->v[i] = (unsigned char)rnd();
    uint64_t h = (uint64_t)(uintptr_t)r->host, k = (uint64_t)(uintptr_t)r->k,
             v = (uint64_t)(uintptr_t)r->v;
    r->store[0] = (kvtier_segment){h, r->row, k, wk, wk};
    r->store[1] = (kvtier_segment){h + wk, r->row, v, wv, wv};
    r->load[0] = (kvtier_segment){k, wk, h, r->row, wk};
    r->load[1] = (kvtier_segment){v, wv, h + wk, r->row, wv};
    char err[256] = "";
    r->c = kvt_cuda_new("image", STREAMS, batch ? (void *)fake_memcpy_batch : NULL, 1, dma_min,
                        2, err, sizeof err);
    if (!r->c)
        FAIL("kvt_cuda_new: %s", err);
    /* The kernel reads the table where dev_segs points: here, host memory. */
    int st = kvt_cuda_add_table(r->c, r->store, 2, (uint64_t)(uintptr_t)r->store, 1, 0);
    int ld = kvt_cuda_add_table(r->c, r->load, 2, (uint64_t)(uintptr_t)r->load, 0, 0);
    if (st != 0 || ld != 1)
        FAIL("tables %d %d", st, ld);
    if (depth && kvt_cuda_coalesce(r->c, depth))
        FAIL("kvt_cuda_coalesce(%zu) refused", depth);
    r->sx = (kvt_submit_ctx){r->store, 2, 1, BPC, NB, NS, 0, r->row};
    r->lx = (kvt_submit_ctx){r->load, 2, 0, BPC, NB, NS, 1, r->row};
}

static void rig_down(rig *r, const char *what) {
    if (fake_sticky())
        FAIL("%s: the context was poisoned (CUresult %d): a misaligned or bad launch", what,
             fake_sticky());
    kvt_cuda_free(r->c);
    if (fake_live_events())
        FAIL("%s: %d events outlived the engine", what, fake_live_events());
    free(r->k), free(r->v), free(r->host);
}

static void store(rig *r, int64_t id, const int64_t *blocks, size_t nb, const int64_t *slots) {
    int rc = kvt_cuda_submit_ids(r->c, &r->sx, 0, COMPUTE, id, blocks, nb, slots, nb / BPC, 0);
    if (rc)
        FAIL("store %lld refused: %d", (long long)id, rc);
    r->seq[0]++;
}

static void load(rig *r, int lane, int64_t id, const int64_t *slots, size_t ns,
                 const int64_t *blocks, size_t nb, size_t skip) {
    int rc =
        kvt_cuda_submit_ids(r->c, &r->lx, lane, COMPUTE, id, blocks, nb, slots, ns, skip);
    if (rc)
        FAIL("load %lld refused: %d", (long long)id, rc);
    r->seq[lane]++;
}

/* Poll until `want` results, after running everything queued; checks each lane's order. */
static size_t collect(rig *r, kvt_result *out, size_t want, const char *what) {
    if (kvt_cuda_sync(r->c))
        FAIL("%s: sync failed", what);
    size_t got = kvt_cuda_poll(r->c, out, want + 1);
    if (got != want)
        FAIL("%s: %zu results, want %zu", what, got, want);
    int64_t last[3] = {-1, -1, -1};
    for (size_t i = 0; i < got; i++) {
        if (out[i].id <= last[out[i].lane])
            FAIL("%s: lane %d reported job %lld after %lld", what, out[i].lane,
                 (long long)out[i].id, (long long)last[out[i].lane]);
        last[out[i].lane] = out[i].id;
    }
    return got;
}

/* Device block `b` (both segments) equals host row `row`. */
static int same(const rig *r, int64_t b, int64_t row) {
    const unsigned char *h = r->host + (size_t)row * r->row;
    return !memcmp(h, r->k + (size_t)b * r->wk, r->wk) &&
           !memcmp(h + r->wk, r->v + (size_t)b * r->wv, r->wv);
}

/* Stores of 600 (three launches of up to 480 rows, or one batched copy), 30 and 2 blocks,
 * then loads of them back into other blocks starting mid-chunk, one urgent: every byte where
 * it belongs. Returns the launches and batched copies it took. */
static void round_trip(size_t wk, size_t wv, int batch, uint64_t dma_min, int *launches,
                       int *batches, const char *what) {
    rig r;
    rig_up(&r, wk, wv, batch, dma_min);
    int l0 = fake_launches(), b0 = fake_batches();
    static const size_t sizes[3] = {600, 30, 2};
    int64_t blocks[632], slots[316], *bp = blocks, *sp = slots;
    pick(blocks, 632, NB / 2); /* the lower half: loads go to the upper */
    pick(slots, 316, NS);
    for (int j = 0; j < 3; j++) {
        store(&r, j, bp, sizes[j], sp);
        bp += sizes[j], sp += sizes[j] / BPC;
    }
    kvt_result res[8];
    collect(&r, res, 3, what);
    for (int j = 0; j < 632; j++)
        if (!same(&r, blocks[j], slots[j / BPC] * BPC + j % BPC))
            FAIL("%s: store of block %lld differs", what, (long long)blocks[j]);
    /* Back: each job from its slots' second block on (skip 1), into the upper half. */
    int64_t dst[632];
    pick(dst, 632, NB / 2);
    for (int j = 0; j < 632; j++)
        dst[j] += NB / 2;
    bp = dst, sp = slots;
    for (int j = 0; j < 3; j++) {
        size_t ns = sizes[j] / BPC, nb = ns * BPC - 1;
        load(&r, j == 2 ? 2 : 1, 10 + j, sp, ns, bp, nb, 1);
        bp += nb, sp += ns;
    }
    collect(&r, res, 3, what);
    bp = dst, sp = slots;
    for (int j = 0; j < 3; j++) {
        size_t ns = sizes[j] / BPC, nb = ns * BPC - 1;
        for (size_t i = 0; i < nb; i++)
            if (!same(&r, bp[i], sp[(1 + i) / BPC] * BPC + (int64_t)((1 + i) % BPC)))
                FAIL("%s: load %d block %zu differs", what, j, i);
        bp += nb, sp += ns;
    }
    *launches = fake_launches() - l0, *batches = fake_batches() - b0;
    rig_down(&r, what);
}

static void check_paths(void) {
    int launches, batches;
    /* Kernels only: 600 rows take two launches of up to 480 rows; 30 and 2 the small kernel. */
    round_trip(4096, 4096, 0, 0, &launches, &batches, "kernel");
    if (depth) { /* how jobs merge depends on the threads' timing: only bytes are checked */
        round_trip(4098, 2054, 0, 0, &launches, &batches, "narrow");
        round_trip(4096, 4096, 1, 0, &launches, &batches, "dma");
        round_trip(32768, 32768, 1, 4 << 20, &launches, &batches, "auto");
        return;
    }
    if (launches != 8 || batches != 0) /* stores 2 + 1 + 1, loads 2 + 1 + 1 */
        FAIL("kernel: %d launches and %d batched copies, want 8 and 0", launches, batches);
    /* Widths of 2 mod 4 and 6 mod 8: the kernels must move 2 bytes at a time (16 would be
     * misaligned, which the fake reports). */
    round_trip(4098, 2054, 0, 0, &launches, &batches, "narrow");
    /* Every job batched (dma_min 0). */
    round_trip(4096, 4096, 1, 0, &launches, &batches, "dma");
    if (launches != 0 || batches != 6)
        FAIL("dma: %d launches and %d batched copies, want 0 and 6", launches, batches);
    /* "auto" (4 MiB jobs and up): 600 blocks of two 32 KiB copies (about 39 MB) batched, the
     * jobs of 30 and 2 blocks on kernels. */
    round_trip(32768, 32768, 1, 4 << 20, &launches, &batches, "auto");
    if (launches != 4 || batches != 2)
        FAIL("auto: %d launches and %d batched copies, want 4 and 2", launches, batches);
    /* "auto" with copies under 32 KiB: kernels for every job, however large (4.9 MB here). */
    round_trip(4096, 4096, 1, 1 << 20, &launches, &batches, "auto, small copies");
    if (launches != 8 || batches != 0)
        FAIL("auto, small copies: %d launches and %d batched copies, want 8 and 0", launches,
             batches);
}

static unsigned char *compute_block;
static unsigned char compute_seen[4096];
static void compute_writes(void *arg) { memset(compute_block, *(int *)arg, 4096); }
static void compute_reads(void *arg) {
    (void)arg;
    memcpy(compute_seen, compute_block, 4096);
}

/* A store reads what the compute queued before it writes; a load overwrites a block only after
 * the compute queued before it has read it. */
static void check_compute_order(void) {
    rig r;
    rig_up(&r, 4096, 4096, 0, 0);
    kvt_result res[4];
    int value = 0x5a;
    compute_block = r.k + 7 * 4096;
    fake_hold(COMPUTE, 1);
    fake_host(COMPUTE, compute_writes, &value);
    int64_t blocks[2] = {7, 8}, slot = 3;
    store(&r, 1, blocks, 2, &slot);
    fake_run();
    if (kvt_cuda_poll(r.c, res, 4) != 0 || r.host[3 * BPC * r.row] != 0)
        FAIL("compute order: the store ran before the compute queued ahead of it");
    fake_hold(COMPUTE, 0);
    collect(&r, res, 1, "compute order");
    if (r.host[3 * BPC * r.row] != 0x5a || !same(&r, 7, 3 * BPC))
        FAIL("compute order: the store did not copy what the compute wrote");

    /* Block 20 is read by compute (held), then loaded over: compute must see the old bytes. */
    unsigned char old[4096];
    compute_block = r.k + 20 * 4096;
    memcpy(old, compute_block, sizeof old);
    fake_hold(COMPUTE, 1);
    fake_host(COMPUTE, compute_reads, NULL);
    int64_t dst = 20;
    load(&r, 1, 2, &slot, 1, &dst, 1, 0);
    fake_run();
    if (memcmp(compute_block, old, sizeof old))
        FAIL("compute order: a load overwrote a block the compute had not read yet");
    fake_hold(COMPUTE, 0);
    collect(&r, res, 1, "compute order");
    if (memcmp(compute_seen, old, sizeof old) || !same(&r, 20, 3 * BPC))
        FAIL("compute order: the compute or the load saw the wrong bytes");
    rig_down(&r, "compute order");
}

/* Each job's seconds must be its own copy time on the fake clock (1 ms per MB). */
static void check_seconds(const kvt_result *res, size_t n, double bytes, const char *what) {
    double want = bytes / 1e9;
    for (size_t i = 0; i < n; i++)
        if (!res[i].ok || res[i].seconds < want * 0.999 || res[i].seconds > want * 1.001)
            FAIL("%s: job %lld took %g s on the fake clock, want %g", what, (long long)res[i].id,
                 res[i].seconds, want);
}

static void submit_pairs(rig *r, int64_t *id, int n) {
    for (int j = 0; j < n; j++, (*id)++) {
        int64_t b[2] = {(2 * *id) % NB, (2 * *id + 1) % NB}, s = *id % NS;
        store(r, *id, b, 2, &s);
    }
}

/* Jobs queued behind an unfinished one borrow its end event as their start, across the ring's
 * growth and wrap: each job's seconds are its own copy time, not its predecessor's too. */
static void check_ring_and_timing(void) {
    rig r;
    rig_up(&r, 4096, 4096, 0, 0);
    kvt_result res[200];
    int64_t id = 0;
    /* 60 jobs, half polled: the oldest unpolled one borrowed its start from a polled one's
     * end. 34 more reach that event's slot in the 64-slot ring, which must not be reused. */
    submit_pairs(&r, &id, 60);
    if (kvt_cuda_sync(r.c) || kvt_cuda_poll(r.c, res, 30) != 30)
        FAIL("ring: 30 of 60 jobs not reported");
    check_seconds(res, 30, 2.0 * 8192, "ring");
    submit_pairs(&r, &id, 34);
    check_seconds(res, collect(&r, res, 64, "ring"), 2.0 * 8192, "ring");
    submit_pairs(&r, &id, 150); /* past 128 slots */
    check_seconds(res, collect(&r, res, 150, "ring"), 2.0 * 8192, "ring");
    /* A waiter returns once the job is done (and at once after it is polled). */
    int64_t b[2] = {0, 1}, s = 0;
    store(&r, id, b, 2, &s);
    if (kvt_cuda_wait(r.c, 0, r.seq[0]) != 0)
        FAIL("ring: the wait failed");
    if (kvt_cuda_poll(r.c, res, 4) != 1 || kvt_cuda_wait(r.c, 0, r.seq[0]) != 0)
        FAIL("ring: the waited-for job was not reported once, or a second wait failed");
    rig_down(&r, "ring");
}

/* A refused launch fails its job (nothing written) and not the next; invalid ids queue
 * nothing; a job submitted failed (the fault hook) copies nothing. */
static void check_failures(void) {
    rig r;
    rig_up(&r, 4096, 4096, 0, 0);
    kvt_result res[4];
    int64_t b1[2] = {4, 5}, b2[2] = {6, 7}, s1 = 1, s2 = 2;
    fake_fail_launch(0);
    store(&r, 1, b1, 2, &s1);
    if (kvt_cuda_sync(r.c)) /* launched alone, not merged with the next */
        FAIL("failures: sync failed");
    store(&r, 2, b2, 2, &s2);
    collect(&r, res, 2, "failures");
    if (res[0].ok || !res[1].ok)
        FAIL("failures: refused launch reported %d, the next job %d", res[0].ok, res[1].ok);
    static const unsigned char zero[8192];
    if (memcmp(r.host + 1 * BPC * r.row, zero, r.row) || !same(&r, 6, 2 * BPC))
        FAIL("failures: the refused job wrote, or the next did not");

    int64_t bad[2] = {4, NB}; /* NB is out of range */
    if (kvt_cuda_submit_ids(r.c, &r.sx, 0, COMPUTE, 3, bad, 2, &s1, 1, 0) != 1)
        FAIL("failures: an out-of-range block was not refused");
    int64_t dup[2] = {4, 4};
    if (kvt_cuda_submit_ids(r.c, &r.lx, 1, COMPUTE, 3, dup, 2, &s1, 1, 0) != 1 ||
        kvt_cuda_submit_ids(r.c, &r.lx, 1, COMPUTE, 3, b1, 1, &s2, 1, 2) != 1)
        FAIL("failures: a repeated block or a skip past the chunk was not refused");
    if (kvt_cuda_submit_ext(r.c, &r.sx, 3, 0, COMPUTE, bad, 2, &s1, 1, 0) != 1)
        FAIL("failures: the extension's entry did not refuse an out-of-range block");

    int64_t rows_d[2] = {2 * BPC, 2 * BPC + 1}, rows_s[2] = {8, 9};
    /* A lane or table that does not exist is refused before anything is queued. */
    static const int bad_lane[] = {-1, 3, 1 << 30}, bad_table[] = {-1, 2, 1 << 30};
    for (int i = 0; i < 3; i++)
        if (kvt_cuda_submit(r.c, bad_lane[i], COMPUTE, 5, 0, 0, 2 * r.row, rows_d, rows_s,
                            2) != 1 ||
            kvt_cuda_submit(r.c, 0, COMPUTE, 5, 0, bad_table[i], 2 * r.row, rows_d, rows_s,
                            2) != 1 ||
            kvt_cuda_submit(r.c, 0, COMPUTE, 5, 1, bad_table[i], 2 * r.row, rows_d, rows_s,
                            2) != 1 ||
            kvt_cuda_wait(r.c, bad_lane[i], 1) != 1)
            FAIL("failures: lane %d or table %d was not refused", bad_lane[i], bad_table[i]);
    kvt_submit_ctx odd = r.sx, wraps = r.sx;
    odd.table = 2, wraps.table = 1ull << 32; /* (int) of it would be table 0 */
    if (kvt_cuda_submit_ids(r.c, &odd, 0, COMPUTE, 5, b1, 2, &s1, 1, 0) != 1 ||
        kvt_cuda_submit_ids(r.c, &wraps, 0, COMPUTE, 5, b1, 2, &s1, 1, 0) != 1 ||
        kvt_cuda_submit_ids(r.c, &r.sx, 3, COMPUTE, 5, b1, 2, &s1, 1, 0) != 1)
        FAIL("failures: a planned job with a bad table or lane was not refused");
    if (kvt_cuda_submit(r.c, 0, COMPUTE, 4, 1, 0, 2 * r.row, rows_d, rows_s, 2) != 0)
        FAIL("failures: a job submitted failed was not queued");
    collect(&r, res, 1, "failures");
    if (res[0].id != 4 || res[0].ok || !same(&r, 6, 2 * BPC))
        FAIL("failures: the failed job was reported good, or copied");
    rig_down(&r, "failures");
}

/* ---- coalescing only (depth 1: one batch queued on the GPU per lane) ---- */

static void store_on(rig *r, uint64_t compute, int64_t id, const int64_t *blocks, size_t nb,
                     const int64_t *slots) {
    if (kvt_cuda_submit_ids(r->c, &r->sx, 0, compute, id, blocks, nb, slots, nb / BPC, 0))
        FAIL("store %lld refused", (long long)id);
    r->seq[0]++;
}

/* Until the fake has seen `n` launches (the launch thread works on its own). */
static void await_launches(int n, const char *what) {
    for (int i = 0; i < 100000 && fake_launches() < n; i++) {
        struct timespec t = {0, 100000};
        nanosleep(&t, NULL);
    }
    if (fake_launches() < n)
        FAIL("%s: %d launches after 10 s, want %d", what, fake_launches(), n);
}

/* A store launched and held on the GPU (its lane's stream held), as the first job of a rig. */
static void first_job_held(rig *r, int64_t *id, const char *what) {
    int l0 = fake_launches();
    fake_hold(STREAMS[0], 1);
    submit_pairs(r, id, 1);
    await_launches(l0 + 1, what);
}

/* Jobs submitted while the lane has its batch queued wait on the host and leave together:
 * ten stores, one launch, each job timed by its share of the batch. */
static void check_merge(void) {
    rig r;
    rig_up(&r, 4096, 4096, 0, 0);
    kvt_result res[16];
    int64_t id = 0;
    int l0 = fake_launches();
    first_job_held(&r, &id, "merge");
    submit_pairs(&r, &id, 10);
    fake_hold(STREAMS[0], 0);
    check_seconds(res, collect(&r, res, 11, "merge"), 2.0 * 8192, "merge");
    if (fake_launches() != l0 + 2)
        FAIL("merge: %d launches for a held job and ten behind it, want 2",
             fake_launches() - l0);
    for (int64_t j = 0; j < 11; j++)
        if (!same(&r, 2 * j, (j % NS) * BPC) || !same(&r, 2 * j + 1, (j % NS) * BPC + 1))
            FAIL("merge: job %lld's blocks differ", (long long)j);
    rig_down(&r, "merge");
}

/* A's first `n` results equal B's (ids, lanes, outcomes and times). */
static int same_results(const kvt_result *a, const kvt_result *b, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (a[i].id != b[i].id || a[i].ok != b[i].ok || a[i].lane != b[i].lane ||
            a[i].seconds != b[i].seconds)
            return 0;
    return 1;
}

/* kvt_cuda_peek leaves results in the engine until kvt_cuda_drop (the worker drops them once
 * it holds them: an interrupt between the two must lose none). Eleven jobs, ten of them one
 * batch, taken a few at a time: a second peek returns the same, a drop of part of a peek
 * leaves the rest for the next, and each job is still timed by its own share of its batch
 * (the batch's time kept once its first job is dropped). */
static void check_peek_drop(void) {
    rig r;
    rig_up(&r, 4096, 4096, 0, 0);
    kvt_result res[4], again[4], all[16];
    int64_t id = 0;
    first_job_held(&r, &id, "peek");
    submit_pairs(&r, &id, 10);
    fake_hold(STREAMS[0], 0);
    if (kvt_cuda_sync(r.c))
        FAIL("peek: sync failed");
    size_t got = 0;
    for (size_t round = 0; got < 11 && round < 40; round++) {
        size_t k = kvt_cuda_peek(r.c, res, 1 + round % 3);
        if (kvt_cuda_peek(r.c, again, 4) < k || !same_results(res, again, k))
            FAIL("peek: a second peek did not return the first one's results (round %zu)",
                 round);
        size_t keep = round % 2 ? k : (k + 1) / 2; /* a part: the rest stays in the engine */
        kvt_cuda_drop(r.c, res, keep);
        if (got + keep > 11)
            FAIL("peek: more than 11 results");
        memcpy(all + got, res, keep * sizeof *res);
        got += keep;
    }
    if (got != 11 || kvt_cuda_peek(r.c, res, 4) != 0 || kvt_cuda_poll(r.c, res, 4) != 0)
        FAIL("peek: %zu of 11 results, or results left after every drop", got);
    for (size_t i = 0; i < got; i++)
        if (all[i].id != (int64_t)i)
            FAIL("peek: result %zu is job %lld", i, (long long)all[i].id);
    check_seconds(all, got, 2.0 * 8192, "peek");
    kvt_cuda_drop(r.c, all, got); /* nothing left: drops nothing */
    int64_t b[2] = {0, 1}, s = 0;
    store(&r, id, b, 2, &s);
    if (kvt_cuda_sync(r.c) || kvt_cuda_poll(r.c, res, 4) != 1 || res[0].id != id)
        FAIL("peek: a later job was not reported after the drops");
    rig_down(&r, "peek");
}

/* A refused merged launch fails every job in it (they wrote nothing), and not the next. */
static void check_merged_failure(void) {
    rig r;
    rig_up(&r, 4096, 4096, 0, 0);
    kvt_result res[8];
    int64_t id = 0;
    first_job_held(&r, &id, "merged failure");
    fake_fail_launch(0);
    submit_pairs(&r, &id, 2);
    fake_hold(STREAMS[0], 0);
    collect(&r, res, 3, "merged failure");
    if (!res[0].ok || res[1].ok || res[2].ok)
        FAIL("merged failure: jobs reported %d %d %d, want 1 0 0", res[0].ok, res[1].ok,
             res[2].ok);
    static const unsigned char zero[8192];
    if (memcmp(r.host + 1 * BPC * r.row, zero, r.row) ||
        memcmp(r.host + 2 * BPC * r.row, zero, r.row))
        FAIL("merged failure: a job of the refused launch wrote");
    submit_pairs(&r, &id, 1);
    collect(&r, res, 1, "merged failure");
    if (!res[0].ok || !same(&r, 6, 3 * BPC))
        FAIL("merged failure: the job after the refused launch failed");
    rig_down(&r, "merged failure");
}

/* A batch whose jobs came from two compute streams waits for both. */
static void check_two_computes(void) {
    enum { OTHER = 10 };
    rig r;
    rig_up(&r, 4096, 4096, 0, 0);
    kvt_result res[4];
    int64_t id = 0;
    int l0 = fake_launches(), value = 0x3c;
    first_job_held(&r, &id, "two computes");
    compute_block = r.k + 100 * 4096;
    fake_hold(OTHER, 1);
    fake_host(OTHER, compute_writes, &value);
    int64_t b1[2] = {100, 101}, b2[2] = {102, 103}, s1 = 40, s2 = 41;
    store_on(&r, OTHER, 1, b1, 2, &s1);
    store_on(&r, COMPUTE, 2, b2, 2, &s2);
    fake_hold(STREAMS[0], 0);
    await_launches(l0 + 2, "two computes");
    fake_run();
    if (kvt_cuda_poll(r.c, res, 4) != 1 || r.host[40 * BPC * r.row] || r.host[41 * BPC * r.row])
        FAIL("two computes: the batch ran before one of its compute streams got there");
    fake_hold(OTHER, 0);
    collect(&r, res, 2, "two computes");
    if (r.host[40 * BPC * r.row] != 0x3c || !same(&r, 100, 40 * BPC) || !same(&r, 102, 41 * BPC))
        FAIL("two computes: the batch did not copy what the compute wrote");
    rig_down(&r, "two computes");
}

typedef struct {
    rig *r;
    uint64_t seq;
    volatile int done, rc;
} waiter;

static void *wait_job(void *arg) {
    waiter *w = arg;
    w->rc = kvt_cuda_wait(w->r->c, 0, w->seq);
    w->done = 1;
    return NULL;
}

/* A waiter on a job still on the host returns once it is launched and done. */
static void check_wait_unlaunched(void) {
    rig r;
    rig_up(&r, 4096, 4096, 0, 0);
    kvt_result res[4];
    int64_t id = 0;
    first_job_held(&r, &id, "wait");
    submit_pairs(&r, &id, 1);
    waiter w = {&r, r.seq[0], 0, -1};
    pthread_t t;
    pthread_create(&t, NULL, wait_job, &w);
    struct timespec pause = {0, 50000000};
    nanosleep(&pause, NULL);
    if (w.done)
        FAIL("wait: returned while its job could not have run");
    fake_hold(STREAMS[0], 0);
    pthread_join(t, NULL);
    if (w.rc || !same(&r, 2, 1 * BPC))
        FAIL("wait: returned %d before its job's copy (or it failed)", w.rc);
    collect(&r, res, 2, "wait");
    rig_down(&r, "wait");
}

/* Freeing the engine launches the jobs still on the host before the threads stop. */
static void check_free_launches(void) {
    rig r;
    rig_up(&r, 4096, 4096, 0, 0);
    int64_t id = 0;
    first_job_held(&r, &id, "free");
    submit_pairs(&r, &id, 3);
    fake_hold(STREAMS[0], 0);
    kvt_cuda_free(r.c);
    fake_run();
    for (int64_t j = 0; j < 4; j++)
        if (!same(&r, 2 * j, j * BPC))
            FAIL("free: job %lld was not launched before the engine stopped", (long long)j);
    if (fake_live_events())
        FAIL("free: %d events outlived the engine", fake_live_events());
    free(r.k), free(r.v), free(r.host);
}

/* ---- random interleavings ---- */

enum { X = NB / 2, MAXJOBS = 4000 }; /* stores read blocks [0, X); loads write [X, NB) */

typedef struct {
    int lane, store, done;
    uint64_t seq;
    int64_t slots[8], blocks[16];
    size_t ns, nb, skip;
} job_t;

typedef struct {
    job_t jobs[MAXJOBS];
    int njobs;
    int64_t slot_src[NS][BPC]; /* the X block a slot row holds once its store is reported */
    int slot_store[NS], slot_loads[NS];
    int64_t y_src[NB];         /* the X block a Y block holds once its load is reported */
    int y_busy[NB];
    int64_t last[3];
    int held[3];
} world;

static void apply(world *w, const kvt_result *res, size_t n, const char *what) {
    for (size_t i = 0; i < n; i++) {
        if (res[i].id < 0 || res[i].id >= w->njobs)
            FAIL("%s: unknown job %lld reported", what, (long long)res[i].id);
        job_t *j = &w->jobs[res[i].id];
        if (j->done || !res[i].ok || res[i].lane != j->lane || res[i].id <= w->last[j->lane])
            FAIL("%s: job %lld reported twice, failed, on the wrong lane or out of order", what,
                 (long long)res[i].id);
        j->done = 1;
        w->last[j->lane] = res[i].id;
        if (j->store) {
            for (size_t k = 0; k < j->ns; k++) {
                w->slot_store[j->slots[k]] = 0;
                for (int b = 0; b < BPC; b++)
                    w->slot_src[j->slots[k]][b] = j->blocks[k * BPC + (size_t)b];
            }
        } else {
            for (size_t k = 0; k < j->ns; k++)
                w->slot_loads[j->slots[k]]--;
            for (size_t k = 0; k < j->nb; k++) {
                size_t at = j->skip + k;
                w->y_src[j->blocks[k]] = w->slot_src[j->slots[at / BPC]][at % BPC];
                w->y_busy[j->blocks[k]] = 0;
            }
        }
    }
}

/* Up to `want` distinct random slots for job `j`: for a store, slots with no job in flight;
 * for a load, stored slots no store is rewriting. Returns how many. */
static size_t pick_slots(const world *w, job_t *j, size_t want, int store) {
    j->ns = 0;
    for (int t = 0; t < 40 && j->ns < want; t++) {
        int64_t s = (int64_t)(rnd() % NS);
        int ok = !w->slot_store[s] && (store ? !w->slot_loads[s] : w->slot_src[s][0] >= 0);
        for (size_t k = 0; k < j->ns && ok; k++)
            ok = j->slots[k] != s;
        if (ok)
            j->slots[j->ns++] = s;
    }
    return j->ns;
}

/* Random stores, loads (mid-chunk, some urgent), polls, waits, streams held and released, in
 * any order the contract allows; every job reported once, in its lane's order, and every byte
 * where the jobs put it. With launch threads, they race the main thread throughout. */
static void check_random(size_t d, uint64_t seed) {
    static world w;
    memset(&w, 0, sizeof w);
    for (int s = 0; s < NS; s++)
        w.slot_src[s][0] = w.slot_src[s][1] = -1;
    for (int b = 0; b < NB; b++)
        w.y_src[b] = -1;
    w.last[0] = w.last[1] = w.last[2] = -1;
    rnd_state = seed;
    depth = d;
    rig r;
    rig_up(&r, 4096, 2048, 0, 0);
    kvt_result res[64], again[64];
    for (int op = 0; op < 3000 && w.njobs < MAXJOBS; op++) {
        unsigned c = (unsigned)(rnd() % 100);
        job_t *j = &w.jobs[w.njobs];
        if (c < 40) { /* a store of 1-8 free slots */
            if (!pick_slots(&w, j, 1 + rnd() % 8, 1))
                continue;
            j->nb = j->ns * BPC;
            pick(j->blocks, j->nb, X);
            j->store = 1, j->lane = 0, j->seq = ++r.seq[0];
            if (kvt_cuda_submit_ids(r.c, &r.sx, 0, COMPUTE, w.njobs, j->blocks, j->nb, j->slots,
                                    j->ns, 0))
                FAIL("random: store %d refused", w.njobs);
            for (size_t k = 0; k < j->ns; k++)
                w.slot_store[j->slots[k]] = 1;
            w.njobs++;
        } else if (c < 80) { /* a load of 1-4 stored slots, from mid-chunk, into free Y blocks */
            if (!pick_slots(&w, j, 1 + rnd() % 4, 0))
                continue;
            j->skip = rnd() % BPC;
            j->nb = j->ns * BPC - j->skip;
            size_t got = 0;
            for (int t = 0; t < 200 && got < j->nb; t++) {
                int64_t b = X + (int64_t)(rnd() % (NB - X));
                int dup = 0;
                for (size_t k = 0; k < got; k++)
                    dup |= j->blocks[k] == b;
                if (!dup && !w.y_busy[b])
                    j->blocks[got++] = b;
            }
            if (got < j->nb)
                continue;
            j->lane = rnd() % 5 ? 1 : 2;
            j->seq = ++r.seq[j->lane];
            if (kvt_cuda_submit_ids(r.c, &r.lx, j->lane, COMPUTE, w.njobs, j->blocks, j->nb,
                                    j->slots, j->ns, j->skip))
                FAIL("random: load %d refused", w.njobs);
            for (size_t k = 0; k < j->ns; k++)
                w.slot_loads[j->slots[k]]++;
            for (size_t k = 0; k < j->nb; k++)
                w.y_busy[j->blocks[k]] = 1;
            w.njobs++;
        } else if (c < 84) {
            apply(&w, res, kvt_cuda_poll(r.c, res, 1 + rnd() % 64), "random");
        } else if (c < 88) { /* a peek, then a drop of part of it, as an interrupted worker */
            size_t k = kvt_cuda_peek(r.c, res, 1 + rnd() % 64);
            size_t k2 = kvt_cuda_peek(r.c, again, 64);
            /* Each lane's results come again first (others may have finished since). */
            for (int l = 0; l < 3; l++) {
                size_t a = 0, b = 0;
                for (size_t i = 0; i < k; i++) {
                    if (res[i].lane != l)
                        continue;
                    while (b < k2 && again[b].lane != l)
                        b++;
                    if (b >= k2) { /* the second peek ran out: only a full one may */
                        if (k2 < 64)
                            FAIL("random: peek %zu of lane %d is missing the second time", a, l);
                        break;
                    }
                    if (!same_results(res + i, again + b, 1))
                        FAIL("random: peek %zu of lane %d differs the second time", a, l);
                    a++, b++;
                }
            }
            size_t keep = rnd() % (k + 1);
            kvt_cuda_drop(r.c, res, keep);
            apply(&w, res, keep, "random peek");
        } else if (c < 92 && w.njobs) { /* wait for a job (held streams released first) */
            job_t *t = &w.jobs[rnd() % (uint64_t)w.njobs];
            for (int l = 0; l < 3; l++)
                if (w.held[l])
                    fake_hold(STREAMS[l], w.held[l] = 0);
            if (kvt_cuda_wait(r.c, t->lane, t->seq))
                FAIL("random: a wait failed");
        } else if (c < 97) {
            int l = (int)(rnd() % 3);
            w.held[l] = !w.held[l];
            fake_hold(STREAMS[l], w.held[l]);
        } else {
            fake_run();
        }
    }
    for (int l = 0; l < 3; l++)
        fake_hold(STREAMS[l], 0);
    if (kvt_cuda_sync(r.c))
        FAIL("random: sync failed");
    size_t n;
    while ((n = kvt_cuda_poll(r.c, res, 64)))
        apply(&w, res, n, "random");
    for (int i = 0; i < w.njobs; i++)
        if (!w.jobs[i].done)
            FAIL("random (depth %zu): job %d never reported", d, i);
    for (int s = 0; s < NS; s++)
        for (int b = 0; b < BPC; b++)
            if (w.slot_src[s][b] >= 0 && !same(&r, w.slot_src[s][b], s * BPC + b))
                FAIL("random (depth %zu): slot %d row %d differs", d, s, b);
    for (int b = X; b < NB; b++) {
        if (w.y_src[b] < 0)
            continue;
        if (memcmp(r.k + (size_t)b * r.wk, r.k + (size_t)w.y_src[b] * r.wk, r.wk) ||
            memcmp(r.v + (size_t)b * r.wv, r.v + (size_t)w.y_src[b] * r.wv, r.wv))
            FAIL("random (depth %zu): block %d differs from block %lld", d, b,
                 (long long)w.y_src[b]);
    }
    rig_down(&r, "random");
}

/* A caller whose current context is another device's (torch's current device is not the
 * engine's) keeps it across every call into the engine: the engine's context is made current
 * only for the call. Left current, it would move the caller's later torch work (and cudart's
 * current device) to the engine's device. */
static void check_caller_context(void) {
    rig r;
    rig_up(&r, 64, 64, 0, 0);
    void *other = fake_other_context(), *cur = NULL;
    if (cuCtxSetCurrent(other))
        FAIL("caller context: the fake refused its other context");
    const char *step = "";
#define STILL_OTHER(what)                                                                       \
    do {                                                                                        \
        step = what;                                                                            \
        cuCtxGetCurrent(&cur);                                                                  \
        if (cur != other)                                                                       \
            FAIL("caller context: %s left the engine's context current", step);                \
    } while (0)
    int64_t blocks[BPC], slots[1] = {1};
    for (int i = 0; i < BPC; i++)
        blocks[i] = i;
    store(&r, 1, blocks, BPC, slots);
    STILL_OTHER("kvt_cuda_submit_ids");
    kvt_cuda_wait(r.c, 0, 1);
    STILL_OTHER("kvt_cuda_wait");
    kvt_cuda_sync(r.c);
    STILL_OTHER("kvt_cuda_sync");
    kvt_result res[4];
    if (kvt_cuda_poll(r.c, res, 4) != 1 || !res[0].ok)
        FAIL("caller context: the store did not finish ok");
    STILL_OTHER("kvt_cuda_poll");
    rig_down(&r, "caller context");
    STILL_OTHER("kvt_cuda_free");
#undef STILL_OTHER
    fake_other_context_off();
}

static void shared_checks(void) {
    check_paths();
    check_compute_order();
    check_ring_and_timing();
    check_failures();
}

int main(void) {
    shared_checks();
    depth = 2;
    shared_checks();
    depth = 1;
    check_merge();
    check_peek_drop();
    check_merged_failure();
    check_two_computes();
    check_wait_unlaunched();
    check_free_launches();
    check_caller_context();
    for (size_t d = 0; d <= 3; d++)
        for (uint64_t seed = 1; seed <= 3; seed++)
            check_random(d, 0x9e3779b97f4a7c15ull * seed);
    printf("ok: %d launches, %d batched copies\n", fake_launches(), fake_batches());
    return 0;
}
