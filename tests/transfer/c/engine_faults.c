/* The CPU engine's failure paths (copyengine.c, included so that its allocations can be made
 * to fail), built by test_native_engine_faults.py, plainly and, where the compiler has them,
 * under AddressSanitizer and ThreadSanitizer.
 *
 * - A stop from the `before` hook, on the engine's own thread (NativeCPUTransferWorker's
 *   shutdown() called from a fault injector): the running job is reported before the queued
 *   ones, which are failed, each lane in order; a waiter for a queued job returns only once
 *   that is done, and freeing the engine then joins its thread. The thread once tried to join
 *   itself, reported the queued jobs ahead of the running one, and was never joined: a free
 *   after the wait released the engine under the still running thread.
 * - Every allocation the engine makes, failed in turn: starting it, a submit (its job, a long
 *   job's repeat check, the result buffer's growth) and a shared batch's disjointness check.
 *   A failed start returns NULL and leaks nothing; a failed submit queues nothing and the
 *   next one works; a batch whose check failed is copied one job after the other; every job
 *   is reported once, in order, with its bytes in place.
 *
 * Prints "ok: ..." and exits 0, or says what went wrong and exits 1. */
#define _GNU_SOURCE /* copyengine.c's affinity calls; it is included below */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Allocations in copyengine.c fail from the `fail_at`-th on (0: none fail). */
static long allocs, fail_at;
static int fail_now(void) {
    long n = __atomic_add_fetch(&allocs, 1, __ATOMIC_RELAXED);
    long at = __atomic_load_n(&fail_at, __ATOMIC_RELAXED);
    return at > 0 && n >= at;
}
static void *fault_malloc(size_t n) { return fail_now() ? NULL : malloc(n); }
static void *fault_calloc(size_t k, size_t n) { return fail_now() ? NULL : calloc(k, n); }
static void *fault_realloc(void *p, size_t n) { return fail_now() ? NULL : realloc(p, n); }
#define malloc fault_malloc
#define calloc fault_calloc
#define realloc fault_realloc
#undef _GNU_SOURCE /* defined again there */
#include "copyengine.c"
#undef malloc
#undef calloc
#undef realloc

static int fails;
#define CHECK(c, ...)                                                                         \
    do {                                                                                      \
        if (!(c)) {                                                                           \
            printf("line %d: ", __LINE__);                                                    \
            printf(__VA_ARGS__);                                                              \
            printf("\n");                                                                     \
            fails++;                                                                          \
        }                                                                                     \
    } while (0)

enum { ROWS = 128, W = 65536 };
static unsigned char dev[ROWS * (size_t)W], host[ROWS * (size_t)W];
static kvtier_segment seg;
static kvt_submit_ctx store_ctx;

static void sleep_ms(int ms) {
    struct timespec t = {0, (long)ms * 1000 * 1000};
    nanosleep(&t, NULL);
}

/* ---- A stop from the hook ---- */

static kvt_engine *self_eng;
static int64_t stop_at; /* the job whose hook stops the engine */
static int reached, all_queued; /* job 0 is in its hook; it waits there for the rest */

static int stop_in_hook(int64_t id) {
    if (id == 0)
        __atomic_store_n(&reached, 1, __ATOMIC_RELEASE);
    while (id == 0 && !__atomic_load_n(&all_queued, __ATOMIC_ACQUIRE))
        sleep_ms(1);
    if (id == stop_at) {
        kvt_engine_stop(self_eng);
        kvt_engine_stop(self_eng); /* a second call changes nothing */
        sleep_ms(20);              /* still running when the main thread's wait returns? */
    }
    return 0;
}

/* Jobs 0..n-1, job i of lane i % 2 (lane 1: urgent) with one block, i into slot i; the hook of
 * job `at` stops the engine. `split`: that job is 16 blocks long, split over the helpers. */
static void stop_from_hook(int threads, int64_t at, int split) {
    self_eng = kvt_engine_new((void *)stop_in_hook, threads, 8 * W, NULL, 0, 0);
    if (!self_eng)
        exit(1);
    stop_at = at;
    __atomic_store_n(&all_queued, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&reached, 0, __ATOMIC_RELEASE);
    enum { N = 12 };
    uint64_t seq[2] = {0, 0}, job_seq[N];
    int job_lane[N];
    memset(host, 0, sizeof host);
    for (int64_t i = 0; i < N; i++) {
        int lane = (int)(i % 2);
        int64_t b[16], s[16];
        size_t n = split && i == at ? 16 : 1;
        for (size_t k = 0; k < n; k++)
            b[k] = s[k] = i == at && split ? 32 + (int64_t)k : i;
        job_seq[i] = seq[lane] + 1;
        job_lane[i] = lane;
        int rc = kvt_engine_submit_ids(self_eng, &store_ctx, i, lane, job_seq[i], b, n, s, n, 0);
        CHECK(rc == 0, "job %lld refused", (long long)i);
        if (rc == 0)
            seq[lane]++;
        while (i == 0 && !__atomic_load_n(&reached, __ATOMIC_ACQUIRE))
            sleep_ms(1);
    }
    __atomic_store_n(&all_queued, 1, __ATOMIC_RELEASE);
    /* Returns once every job is reported: the queued ones failed by the stop. */
    kvt_engine_wait(self_eng, 0, seq[0]);
    kvt_engine_wait(self_eng, 1, seq[1]);
    kvt_result r[N + 1];
    size_t got = kvt_engine_poll(self_eng, r, N + 1);
    int before = fails;
    CHECK(got == N, "%zu results for %d jobs (threads %d, stop at %lld)", got, N, threads,
          (long long)at);
    int reported[N] = {0};
    uint64_t last[2] = {0, 0};
    for (size_t k = 0; k < got; k++) {
        int64_t id = r[k].id;
        if (id < 0 || id >= N || reported[id]++) {
            CHECK(0, "result for job %lld: none such, or twice", (long long)id);
            continue;
        }
        int lane = job_lane[id];
        CHECK(r[k].lane == lane, "job %lld reported in lane %d", (long long)id, r[k].lane);
        CHECK(job_seq[id] > last[lane],
              "job %lld (lane %d) reported after a later job of its lane (threads %d, stop at "
              "%lld)", (long long)id, lane, threads, (long long)at);
        last[lane] = job_seq[id];
        /* The job that stopped the engine ran, and so did the jobs of its lane before it
         * (an urgent one may have overtaken queued jobs of the other lane). */
        if (id == 0 || (lane == job_lane[at] && id <= at))
            CHECK(r[k].ok, "job %lld failed, but it had started", (long long)id);
        if (r[k].ok) {
            size_t b = split && id == at ? 32 : (size_t)id, n = split && id == at ? 16 : 1;
            CHECK(!memcmp(host + b * W, dev + b * W, n * W), "job %lld's rows differ",
                  (long long)id);
        }
    }
    if (fails > before) { /* the thread may still run: freeing the engine would be unsafe */
        printf("stopped from the hook of job %lld, %d threads: %d checks failed\n",
               (long long)at, threads, fails - before);
        exit(1);
    }
    kvt_engine_free(self_eng); /* joins the thread, even though the hook stopped it */
}

/* ---- Allocations that fail ---- */

static kvt_engine *oom_eng;

/* Holds job 0 (id 1000) until the main thread waits: the jobs behind it are then its backlog. */
static int hold_first(int64_t id) {
    for (int waiting = 0; id == 1000 && !waiting; sleep_ms(1)) {
        pthread_mutex_lock(&oom_eng->mu);
        waiting = oom_eng->wake_at[0] != UINT64_MAX;
        pthread_mutex_unlock(&oom_eng->mu);
    }
    return 0;
}

/* One round with the `at`-th allocation from now on failing (0: none): start an engine of 2
 * threads, submit job 0 (held in its hook), then jobs 1-34 into rows no other of them writes,
 * job 4 of 60 blocks (a repeat check that sorts a copy), the rest of one, and wait for them:
 * behind job 0 they are a waiter's backlog, copied in a shared batch once checked for writes
 * to one row. Then 100 more (the result buffer grows). Whatever fails must fail cleanly: a
 * refused submit queues nothing, every job queued is reported once, in order, with its rows
 * in place. */
static void oom_round(long at) {
    __atomic_store_n(&allocs, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&fail_at, at, __ATOMIC_RELAXED);
    memset(host, 0, sizeof host);
    kvt_engine *e = oom_eng = kvt_engine_new((void *)hold_first, 2, (size_t)1 << 30, NULL, 0, 0);
    if (!e) {
        CHECK(at > 0, "the engine did not start with memory to spare");
        return;
    }
    enum { JOBS = 135 };
    int64_t want[JOBS], blk[JOBS], slot[JOBS], next = 0;
    uint64_t seq = 0;
    for (int64_t i = 0; i < JOBS; i++) {
        int64_t b[60], s[60];
        size_t n = i == 4 ? 60 : 1;
        for (size_t k = 0; k < n; k++)
            b[k] = s[k] = (int64_t)k;
        if (n == 1) { /* jobs 1-34, the backlog, write rows no other of them does */
            b[0] = i < 35 ? i : i % 30;
            s[0] = i < 35 ? ROWS - 1 - i : i % 30;
        }
        int rc = kvt_engine_submit_ids(e, &store_ctx, 1000 + i, 0, seq + 1, b, n, s, n, 0);
        CHECK(rc == 0 || (rc == -1 && at > 0), "submit %lld: %d", (long long)i, rc);
        if (rc == 0) {
            seq++;
            blk[next] = n == 1 ? b[0] : -1;
            slot[next] = s[0];
            want[next++] = 1000 + i;
        }
        if (i == 34) /* the backlog is queued behind job 0 (if that was not refused) */
            kvt_engine_wait(e, 0, seq);
    }
    kvt_engine_wait(e, 0, seq);
    kvt_result r[JOBS];
    size_t got = kvt_engine_poll(e, r, JOBS);
    uint64_t shared = kvt_engine_shared_jobs(e);
    kvt_engine_free(e);
    CHECK(at > 0 || shared >= 34, "%llu jobs shared, not the 34 of the backlog",
          (unsigned long long)shared);
    __atomic_store_n(&fail_at, 0, __ATOMIC_RELAXED);
    CHECK(got == (size_t)next, "%zu results for %lld jobs (allocation %ld failing)", got,
          (long long)next, at);
    for (size_t k = 0; k < got && k < (size_t)next; k++) {
        CHECK(r[k].id == want[k] && r[k].ok, "result %zu: job %lld, ok %d (allocation %ld)", k,
              (long long)r[k].id, r[k].ok, at);
        if (blk[k] < 0) /* the long job: rows 0-59 */
            CHECK(!memcmp(host, dev, 60 * (size_t)W), "the long job's rows differ");
        else
            CHECK(!memcmp(host + slot[k] * W, dev + blk[k] * W, W),
                  "job %lld's row differs (allocation %ld)", (long long)want[k], at);
    }
}

/* argv[1], if given: fail every n-th allocation of the sweep only (a quicker run under
 * ThreadSanitizer). */
int main(int argc, char **argv) {
    long stride = argc > 1 ? atol(argv[1]) : 1;
    if (stride < 1)
        stride = 1;
    for (size_t i = 0; i < sizeof dev; i++)
        dev[i] = (unsigned char)(i * 2654435761u >> 11);
    seg = (kvtier_segment){(uint64_t)(uintptr_t)host, W, (uint64_t)(uintptr_t)dev, W, W};
    store_ctx = (kvt_submit_ctx){&seg, 1, 1, 1, ROWS, ROWS, 0, W};

    for (int threads = 1; threads <= 3; threads++)
        for (int64_t at = 1; at <= 4; at++)
            stop_from_hook(threads, at, threads > 1 && at == 2);

    oom_round(0);
    long rounds = 0, total = allocs; /* the allocations of a round where none fails */
    for (long at = 1; at <= total; at += stride, rounds++)
        oom_round(at);
    if (fails) {
        printf("%d checks failed\n", fails);
        return 1;
    }
    printf("ok: stops from the hook; %ld rounds of failing allocations\n", rounds);
    return 0;
}
