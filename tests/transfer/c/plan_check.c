/* kvt_plan_rows's edge cases and the CPU engine driven from several threads, built by
 * test_native_c.py (also under the sanitizers by hand: -fsanitize=address,undefined or
 * thread). Plans: no blocks or slots, skip at the chunk's end, ids out of range, repeats
 * (short and long lists), and counts whose products wrap: 2 slots of 2^63 blocks once
 * planned a store of no blocks, and rows past INT64_MAX wrapped negative. Row copies of every
 * width to 200 bytes at odd addresses, byte-exact and within their rows. The engine: three
 * submitting threads, one polling, waits; stopped with jobs queued; results polled late or
 * never: every job reported once. Prints "ok" and exits 0, or says what differs and exits 1. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvtier.h"

/* copyengine.c's entry points (Python reaches them through ctypes, so no header has them). */
typedef struct kvt_engine kvt_engine;
kvt_engine *kvt_engine_new(void *before, int threads, size_t min_split_bytes,
                           const int32_t *cpus, size_t ncpus, int avoid_submitter);
int kvt_engine_submit_ids(kvt_engine *e, const kvt_submit_ctx *x, int64_t id, int lane,
                          uint64_t seq, const int64_t *blocks, size_t nblocks,
                          const int64_t *slots, size_t nslots, size_t skip);
size_t kvt_engine_poll(kvt_engine *e, kvt_result *out, size_t max);
void kvt_engine_wait(kvt_engine *e, int lane, uint64_t seq);
void kvt_engine_stop(kvt_engine *e);
void kvt_engine_free(kvt_engine *e);

static int fails;
#define CHECK(c, what)                                                                        \
    do {                                                                                      \
        if (!(c)) {                                                                           \
            printf("line %d: %s\n", __LINE__, what);                                          \
            fails++;                                                                          \
        }                                                                                     \
    } while (0)

/* kvt_plan_rows with `nb` blocks `b` and `ns` slots `s`, 10 device blocks and `slots` slots. */
static int plan(int store, const int64_t *b, size_t nb, const int64_t *s, size_t ns, size_t bpc,
                size_t skip, int64_t slots, int64_t *h) {
    int64_t d[256];
    return kvt_plan_rows(store, b, nb, s, ns, bpc, skip, 10, slots, h, d);
}

static void plan_cases(void) {
    int64_t h[256], b[200], s[200];
    b[0] = 1, s[0] = 2;
    CHECK(plan(1, NULL, 0, NULL, 0, 4, 0, 10, h) == 0, "store of nothing refused");
    CHECK(plan(0, NULL, 0, NULL, 0, 4, 3, 10, h) == 0, "load of nothing refused");
    CHECK(plan(0, b, 1, NULL, 0, 4, 0, 10, h) == 1, "load of a block into no slot");
    CHECK(plan(0, b, 1, NULL, 0, 4, 2, 10, h) == 1, "load of a block into no slot, skip 2");
    CHECK(plan(1, b, 1, NULL, 0, 4, 0, 10, h) == 1, "store of a block into no slot");
    CHECK(plan(0, NULL, 0, s, 1, 4, 0, 10, h) == 1, "load of no block from a slot");
    CHECK(plan(1, NULL, 0, s, 1, 4, 0, 10, h) == 1, "store of no block into a slot");
    CHECK(plan(1, b, 1, s, 1, 0, 0, 10, h) == 1, "0 blocks per chunk");
    CHECK(plan(0, b, 1, s, 1, 4, 3, 10, h) == 0 && h[0] == 11, "skip 3 of 4");
    CHECK(plan(0, b, 1, s, 1, 4, 4, 10, h) == 1, "skip 4 of 4");
    CHECK(plan(0, b, 1, s, 1, 4, SIZE_MAX, 10, h) == 1, "skip SIZE_MAX");
    CHECK(plan(1, b, 1, s, 1, 1, 1, 10, h) == 1, "store with a skip");
    int64_t bb[6] = {0, 1, 2, 3, 4, 5}, ss[2] = {7, 3}, want[5] = {31, 12, 13, 14, 15};
    for (size_t n = 0; n <= 6; n++) /* 2 slots of 4, skip 3: 2 to 5 blocks */
        CHECK(plan(0, bb, n, ss, 2, 4, 3, 10, h) == (n >= 2 && n <= 5 ? 0 : 1), "load counts");
    CHECK(plan(0, bb, 5, ss, 2, 4, 3, 10, h) == 0 && !memcmp(h, want, sizeof want), "load rows");
    b[0] = 10;
    CHECK(plan(0, b, 1, s, 1, 1, 0, 10, h) == 1, "block 10 of 10");
    b[0] = -1;
    CHECK(plan(0, b, 1, s, 1, 1, 0, 10, h) == 1, "block -1");
    b[0] = 0, s[0] = 10;
    CHECK(plan(0, b, 1, s, 1, 1, 0, 10, h) == 1, "slot 10 of 10");
    s[0] = INT64_MIN;
    CHECK(plan(0, b, 1, s, 1, 1, 0, 10, h) == 1, "slot INT64_MIN");
    int64_t d[256];
    for (int i = 0; i < 200; i++)
        b[i] = i, s[i] = 199 - i;
    CHECK(kvt_plan_rows(1, b, 200, s, 200, 1, 0, 200, 200, h, d) == 0, "store of 200");
    s[199] = s[0];
    CHECK(kvt_plan_rows(1, b, 200, s, 200, 1, 0, 200, 200, h, d) == 1, "store repeats a slot");
    CHECK(kvt_plan_rows(0, b, 200, s, 200, 1, 0, 200, 200, h, d) == 0, "load repeats a slot");
    b[199] = b[0];
    CHECK(kvt_plan_rows(0, b, 200, s, 200, 1, 0, 200, 200, h, d) == 1, "load repeats a block");
    b[1] = b[0];
    CHECK(plan(0, b, 3, s, 3, 1, 0, 200, h) == 1, "load of 3 repeats a block");
    /* Products that wrap: nslots * bpc, and host rows slot * bpc + j past INT64_MAX. */
    size_t big = (size_t)1 << 63;
    s[0] = 0, s[1] = 1, b[0] = 0, b[1] = 1;
    CHECK(plan(1, NULL, 0, s, 2, big, 0, 2, h) == 1, "store of no block into 2 x 2^63");
    CHECK(plan(0, b, 2, s, 2, big + 1, 0, 2, h) == 1, "load of 2 blocks from 2 x (2^63 + 1)");
    s[0] = ((int64_t)1 << 32) - 1;
    CHECK(plan(1, b, 1, s, 1, 1, 0, INT64_MAX, h) == 0 && h[0] == s[0], "slot 2^32 - 1");
    CHECK(plan(0, b, 1, s, 1, (size_t)1 << 32, ((size_t)1 << 32) - 1, (int64_t)1 << 32, h) == 1,
          "host row past INT64_MAX");
}

/* Rows of every width to 200 bytes at odd addresses, into buffers of exactly their size. */
static void copy_cases(void) {
    for (size_t width = 0; width <= 200; width += width < 70 ? 1 : 17)
        for (size_t off = 0; off < 16; off += 3) {
            size_t stride = width + off, size = 5 * stride + off;
            unsigned char *src = malloc(size + 1), *dst = malloc(size), *ref = malloc(size);
            if (!src || !dst || !ref)
                exit(1);
            for (size_t i = 0; i < size; i++)
                src[i + 1] = (unsigned char)(i * 131 + 7), dst[i] = ref[i] = (unsigned char)i;
            int64_t di[5] = {4, 0, 3, 1, 2}, si[5] = {0, 1, 2, 3, 4};
            kvtier_segment g = {(uint64_t)(uintptr_t)(dst + off), stride,
                                (uint64_t)(uintptr_t)(src + 1), stride, width};
            kvtier_copy_indexed(&g, 1, di, si, 5);
            for (int i = 0; i < 5; i++)
                memcpy(ref + off + di[i] * stride, src + 1 + si[i] * stride, width);
            CHECK(!memcmp(dst, ref, size), "an unaligned row copy differs");
            free(src), free(dst), free(ref);
        }
}

enum { ROWS = 256, W = 1000 };
static kvt_submit_ctx ctx;
static kvt_engine *eng;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* the submits, and `seen` */
static uint64_t seqs[2];
static int64_t next_id, *seen;
static size_t nseen;
static int slow, polling;

static int before(int64_t id) {
    (void)id;
    struct timespec pause = {0, 200 * 1000};
    if (__atomic_load_n(&slow, __ATOMIC_RELAXED))
        nanosleep(&pause, NULL);
    return 0;
}

/* Submits (under mu, as the Python worker does), waiting for some of its jobs. */
static void *submitter(void *arg) {
    unsigned rng = (unsigned)(uintptr_t)arg;
    for (int i = 0; i < 3000; i++) {
        rng = rng * 1103515245u + 12345u;
        int lane = (rng >> 16) & 1;
        int64_t blk = (int64_t)((rng >> 8) % ROWS), slot = (int64_t)((rng >> 4) % ROWS);
        pthread_mutex_lock(&mu);
        uint64_t seq = seqs[lane] + 1;
        int rc = kvt_engine_submit_ids(eng, &ctx, next_id, lane, seq, &blk, 1, &slot, 1, 0);
        if (rc == 0)
            seqs[lane] = seq, next_id++;
        pthread_mutex_unlock(&mu);
        if (rc)
            break; /* stopped */
        if ((rng >> 24) % 8 == 0)
            kvt_engine_wait(eng, lane, seq);
    }
    return NULL;
}

static void collect(kvt_result *r, size_t k) {
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < k; i++)
        seen[nseen++] = r[i].id;
    pthread_mutex_unlock(&mu);
}

static void *poller(void *arg) {
    (void)arg;
    kvt_result r[7];
    while (__atomic_load_n(&polling, __ATOMIC_RELAXED))
        collect(r, kvt_engine_poll(eng, r, 7));
    return NULL;
}

/* `poll`: 0 polled only after the stop, 1 by a thread as well, 2 never (freed unpolled). */
static void engine_round(int threads, int stop_early, int poll) {
    eng = kvt_engine_new((void *)before, threads, 2000, NULL, 0, 1);
    if (!eng)
        exit(1);
    seqs[0] = seqs[1] = 0, next_id = 0, nseen = 0;
    __atomic_store_n(&slow, stop_early, __ATOMIC_RELAXED);
    __atomic_store_n(&polling, 1, __ATOMIC_RELAXED);
    pthread_t sub[3], pol;
    if (poll == 1)
        pthread_create(&pol, NULL, poller, NULL);
    for (int i = 0; i < 3; i++)
        pthread_create(&sub[i], NULL, submitter, (void *)(uintptr_t)(i * 77 + 1));
    if (stop_early) { /* with jobs queued behind the slow hook */
        struct timespec pause = {0, 20 * 1000 * 1000};
        nanosleep(&pause, NULL);
        kvt_engine_stop(eng);
    }
    for (int i = 0; i < 3; i++)
        pthread_join(sub[i], NULL);
    kvt_engine_stop(eng);
    if (poll == 1) {
        __atomic_store_n(&polling, 0, __ATOMIC_RELAXED);
        pthread_join(pol, NULL);
    }
    if (poll != 2) {
        kvt_result r[64];
        size_t k;
        while ((k = kvt_engine_poll(eng, r, 64)))
            collect(r, k);
        CHECK((int64_t)nseen == next_id, "results missing or repeated");
        char *got = calloc((size_t)next_id + 1, 1);
        for (size_t i = 0; got && i < nseen; i++) {
            int fine = seen[i] >= 0 && seen[i] < next_id && !got[seen[i]];
            CHECK(fine, "a result for no job, or twice");
            if (fine)
                got[seen[i]] = 1;
        }
        free(got);
    }
    kvt_engine_free(eng);
}

int main(void) {
    plan_cases();
    copy_cases();
    unsigned char *dev = calloc(ROWS, W), *host = calloc(ROWS, W);
    seen = malloc(sizeof *seen * 9000);
    if (!dev || !host || !seen)
        return 1;
    kvtier_segment seg = {(uint64_t)(uintptr_t)host, W, (uint64_t)(uintptr_t)dev, W, W};
    ctx = (kvt_submit_ctx){&seg, 1, 1, 1, ROWS, ROWS, 0, W};
    for (int threads = 1; threads <= 3; threads++)
        for (int stop = 0; stop <= 1; stop++)
            for (int poll = 0; poll <= 2; poll++)
                engine_round(threads, stop, poll);
    free(dev), free(host), free(seen);
    if (fails) {
        printf("%d checks failed\n", fails);
        return 1;
    }
    printf("ok\n");
    return 0;
}
