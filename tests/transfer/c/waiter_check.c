/* kvt_cuda_wait_for and its waiter thread under load, over fake_cuda.c: built (with or without
 * a sanitizer) and run by test_cuda_sanitize_1131.py. Argument: the launch threads' depth (0:
 * the submitter launches). Prints "ok" and exits 0 when every check passes; prints what
 * differs and exits 1 otherwise.
 *
 * Rounds of stores (lane 0) and loads (lane 1), each job two rows of its own, submitted while
 * four threads wait for random jobs with timeouts of 0, 1 us, 1 ms and 20 ms, polls (in one
 * step or as peek and drop) and syncs go between the submits, and a "GPU" thread runs the
 * fake's queues, holding a lane now and then. A wait that answers 0 must find its job's rows
 * copied. Then a wait for a lane's earlier job while a later one's is held, and one on a lane
 * while another lane is held: each must end when its job does, not at its timeout. Last, the
 * engine is freed while its waiter thread is blocked on a held lane.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_engine_api.h"

int fake_run(void);
int fake_launches(void);
int fake_live_events(void);
int fake_sticky(void);
void fake_hold(uintptr_t stream, int held);

#define FAIL(...)                                                                               \
    do {                                                                                        \
        printf(__VA_ARGS__);                                                                    \
        printf("\n");                                                                           \
        fflush(stdout);                                                                         \
        exit(1);                                                                                \
    } while (0)

enum { W = 64, ROWS = 2, JOBS = 240, ROUNDS = 6, WAITERS = 4, COMPUTE = 9 };
static const uint64_t STREAMS[3] = {1, 2, 3};

/* Stores copy device rows [0, ROWS*JOBS) to host rows [0, ROWS*JOBS); loads copy host rows
 * [ROWS*JOBS, 2*ROWS*JOBS) to the device rows there. Job i (from 0) of a round has rows
 * ROWS*i.. of its half. */
static unsigned char host[2 * ROWS * JOBS][W], dev[2 * ROWS * JOBS][W];
static kvtier_segment store_seg, load_seg;
static kvt_cuda *engine;
static uint64_t base[2];      /* each lane's last seq before the round */
static uint64_t accepted[2];  /* each lane's last seq queued (atomic) */
static int stop_waiting, stop_gpu; /* atomic */
static unsigned long waits, pending; /* atomic: wait_for calls, and those that answered -1 */
static size_t depth;

static uint64_t rnd_state = 88172645463325252ull;
static uint64_t rnd_locked(uint64_t *s) {
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return *s;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Whether lane `lane`'s job `seq` of this round has all its rows copied. */
static int copied(int lane, uint64_t seq) {
    size_t i = (size_t)(seq - base[lane] - 1), at = (size_t)lane * ROWS * JOBS + ROWS * i;
    return !memcmp(host[at], dev[at], ROWS * W);
}

static void *gpu(void *arg) {
    uint64_t s = (uint64_t)(uintptr_t)arg;
    while (!__atomic_load_n(&stop_gpu, __ATOMIC_ACQUIRE)) {
        /* A long kernel on a lane for up to 3 ms: its later jobs pend past the callers' 1 ms
         * of asking, and their waits go to the waiter thread. */
        uintptr_t lane = STREAMS[rnd_locked(&s) % 2];
        fake_hold(lane, 1);
        usleep((useconds_t)(rnd_locked(&s) % 3000));
        fake_hold(lane, 0);
        fake_run();
        usleep(100);
    }
    return NULL;
}

static void *waiter_caller(void *arg) {
    uint64_t s = (uint64_t)(uintptr_t)arg;
    static const uint64_t timeouts[4] = {0, 1000, 1000000, 20000000};
    while (!__atomic_load_n(&stop_waiting, __ATOMIC_ACQUIRE)) {
        int lane = (int)(rnd_locked(&s) % 2);
        uint64_t hi = __atomic_load_n(&accepted[lane], __ATOMIC_ACQUIRE), lo = base[lane] + 1;
        if (hi < lo) {
            usleep(10);
            continue;
        }
        uint64_t r = rnd_locked(&s) % 16, seq;
        if (r == 0)
            seq = lo - 1; /* polled in an earlier round (or 0: never queued) */
        else if (r < 8)
            seq = hi;
        else if (r < 12)
            seq = hi - rnd_locked(&s) % (hi - lo + 1 < 8 ? hi - lo + 1 : 8); /* a recent job */
        else
            seq = lo + rnd_locked(&s) % (hi - lo + 1);
        int rc = kvt_cuda_wait_for(engine, lane, seq, timeouts[rnd_locked(&s) % 4]);
        __atomic_add_fetch(&waits, 1, __ATOMIC_RELAXED);
        if (rc == -1)
            __atomic_add_fetch(&pending, 1, __ATOMIC_RELAXED);
        if (rc != 0 && rc != -1)
            FAIL("depth %zu: wait_for(lane %d, seq %llu) answered %d", depth, lane,
                 (unsigned long long)seq, rc);
        if (rc == 0 && seq >= lo && !copied(lane, seq))
            FAIL("depth %zu: wait_for(lane %d, seq %llu) answered 0 before its copies ended",
                 depth, lane, (unsigned long long)seq);
        if (rnd_locked(&s) % 2)
            usleep((useconds_t)(rnd_locked(&s) % 100));
    }
    return NULL;
}

static size_t take(kvt_result *out, size_t max, uint64_t *s) {
    if (rnd_locked(s) % 2)
        return kvt_cuda_poll(engine, out, max);
    size_t k = kvt_cuda_peek(engine, out, max);
    size_t keep = k ? (size_t)(rnd_locked(s) % (k + 1)) : 0; /* drop the first few only */
    kvt_cuda_drop(engine, out, keep);
    return keep;
}

static void round_of_jobs(int round) {
    uint64_t s = 0x9e3779b97f4a7c15ull + (uint64_t)round;
    for (size_t r = 0; r < 2 * ROWS * JOBS; r++)
        for (size_t b = 0; b < W; b++) {
            int stored = r < ROWS * JOBS;
            (stored ? dev : host)[r][b] = (unsigned char)(rnd_locked(&s) | 1);
            (stored ? host : dev)[r][b] = 0;
        }
    for (int lane = 0; lane < 2; lane++)
        base[lane] = accepted[lane] = kvt_cuda_accepted(engine, lane);
    __atomic_store_n(&stop_waiting, 0, __ATOMIC_RELEASE);
    pthread_t callers[WAITERS];
    for (uintptr_t i = 0; i < WAITERS; i++)
        if (pthread_create(&callers[i], NULL, waiter_caller, (void *)(i * 7919 + 17 + round)))
            FAIL("pthread_create");
    kvt_result out[16];
    size_t results[2] = {0, 0};
    for (size_t i = 0; i < JOBS; i++)
        for (int lane = 0; lane < 2; lane++) {
            int64_t h[ROWS], d[ROWS];
            for (int k = 0; k < ROWS; k++)
                h[k] = d[k] = (int64_t)((size_t)lane * ROWS * JOBS + ROWS * i + (size_t)k);
            int rc = lane == 0 ? kvt_cuda_submit(engine, 0, COMPUTE, (int64_t)i, 0, 0, ROWS * W, h,
                                                 d, ROWS)
                               : kvt_cuda_submit(engine, 1, COMPUTE, (int64_t)i, 0, 1, ROWS * W, d,
                                                 h, ROWS);
            if (rc)
                FAIL("depth %zu: submit refused: %d", depth, rc);
            __atomic_store_n(&accepted[lane], base[lane] + i + 1, __ATOMIC_RELEASE);
            if (rnd_locked(&s) % 5 == 0) {
                size_t k = take(out, 1 + rnd_locked(&s) % 16, &s);
                for (size_t j = 0; j < k; j++)
                    results[out[j].lane]++;
            }
            if (rnd_locked(&s) % 97 == 0 && kvt_cuda_sync(engine))
                FAIL("depth %zu: sync failed", depth);
            usleep((useconds_t)(rnd_locked(&s) % 200)); /* the callers catch up with the submits */
        }
    __atomic_store_n(&stop_waiting, 1, __ATOMIC_RELEASE);
    for (int i = 0; i < WAITERS; i++)
        pthread_join(callers[i], NULL);
    if (kvt_cuda_sync(engine))
        FAIL("depth %zu: final sync failed", depth);
    for (size_t k; (k = kvt_cuda_poll(engine, out, 16));)
        for (size_t j = 0; j < k; j++) {
            if (!out[j].ok)
                FAIL("depth %zu: job %lld failed", depth, (long long)out[j].id);
            results[out[j].lane]++;
        }
    if (results[0] != JOBS || results[1] != JOBS)
        FAIL("depth %zu round %d: %zu and %zu results, want %d each", depth, round, results[0],
             results[1], JOBS);
    for (int lane = 0; lane < 2; lane++)
        for (uint64_t q = base[lane] + 1; q <= base[lane] + JOBS; q++)
            if (!copied(lane, q))
                FAIL("depth %zu: lane %d job %llu not copied after sync", depth, lane,
                     (unsigned long long)q);
}

static kvt_cuda *new_engine(void) {
    char err[256] = "";
    kvt_cuda *c = kvt_cuda_new("image", STREAMS, NULL, 1, 0, 2, err, sizeof err);
    if (!c)
        FAIL("kvt_cuda_new: %s", err);
    if (kvt_cuda_add_table(c, &store_seg, 1, (uint64_t)(uintptr_t)&store_seg, 1, 0) != 0 ||
        kvt_cuda_add_table(c, &load_seg, 1, (uint64_t)(uintptr_t)&load_seg, 0, 0) != 1)
        FAIL("tables refused");
    if (depth && kvt_cuda_coalesce(c, depth))
        FAIL("kvt_cuda_coalesce(%zu) refused", depth);
    return c;
}

typedef struct {
    kvt_cuda *c;
    int lane;
    uint64_t seq, timeout_ns;
    int rc;
    double took;
} timed;

static void *timed_wait(void *arg) {
    timed *t = arg;
    double t0 = now_s();
    t->rc = kvt_cuda_wait_for(t->c, t->lane, t->seq, t->timeout_ns);
    t->took = now_s() - t0;
    return NULL;
}

static void start_wait(pthread_t *th, timed *t) {
    if (pthread_create(th, NULL, timed_wait, t))
        FAIL("pthread_create");
}

static void submit_row(kvt_cuda *c, int lane, int64_t row) {
    if (kvt_cuda_submit(c, lane, COMPUTE, row, 0, 0, W, &row, &row, 1))
        FAIL("submit refused");
}

/* Job 1 held on its lane, job 2 behind held compute: a wait for job 1 ends once its copies
 * do, although a wait for job 2 came first (the waiter thread once blocked on job 2). */
static void earlier_job(void) {
    kvt_cuda *c = new_engine();
    fake_hold(STREAMS[0], 1);
    int launches = fake_launches();
    submit_row(c, 0, 0);
    while (fake_launches() == launches)
        usleep(100);
    fake_run(); /* job 1's compute event */
    fake_hold(COMPUTE, 1);
    submit_row(c, 0, 1);
    timed later = {c, 0, 2, 4000000000u, 0, 0}, earlier = {c, 0, 1, 3000000000u, 0, 0};
    pthread_t tl, te;
    start_wait(&tl, &later);
    usleep(100000);
    start_wait(&te, &earlier);
    usleep(100000);
    fake_hold(STREAMS[0], 0);
    fake_run();
    pthread_join(te, NULL);
    fake_hold(COMPUTE, 0);
    fake_run();
    pthread_join(tl, NULL);
    if (earlier.rc || earlier.took > 1.5 || later.rc)
        FAIL("depth %zu: job 1's wait answered %d after %.2f s (job 2's: %d)", depth, earlier.rc,
             earlier.took, later.rc);
    if (kvt_cuda_sync(c))
        FAIL("depth %zu: sync failed", depth);
    kvt_cuda_free(c);
}

/* The waiter thread blocked on lane 0's held job: a wait on lane 1 still ends with its job. */
static void other_lane(void) {
    kvt_cuda *c = new_engine();
    fake_hold(STREAMS[0], 1);
    submit_row(c, 0, 0);
    if (kvt_cuda_wait_for(c, 0, 1, 2000000) != -1)
        FAIL("depth %zu: a held job's wait did not answer -1", depth);
    fake_hold(STREAMS[1], 1);
    submit_row(c, 1, 1);
    timed other = {c, 1, 1, 3000000000u, 0, 0};
    pthread_t t;
    start_wait(&t, &other);
    usleep(100000);
    fake_hold(STREAMS[1], 0);
    fake_run();
    pthread_join(t, NULL);
    fake_hold(STREAMS[0], 0);
    if (other.rc || other.took > 1.5)
        FAIL("depth %zu: lane 1's wait answered %d after %.2f s", depth, other.rc, other.took);
    if (kvt_cuda_sync(c))
        FAIL("depth %zu: sync failed", depth);
    kvt_cuda_free(c);
}

static void *release_later(void *arg) {
    usleep(300000);
    fake_hold((uintptr_t)arg, 0);
    return NULL;
}

/* Freed while the waiter thread blocks on a held lane: free waits for the copies to end (it
 * joins the waiter; it would wait as long as they never end), then frees every event. */
static void free_while_blocked(void) {
    kvt_cuda *c = new_engine();
    fake_hold(STREAMS[0], 1);
    int64_t h[ROWS] = {0, 1}, d[ROWS] = {0, 1};
    if (kvt_cuda_submit(c, 0, COMPUTE, 1, 0, 0, ROWS * W, h, d, ROWS))
        FAIL("free: submit refused");
    fake_run();
    uint64_t seq = kvt_cuda_accepted(c, 0);
    int rc = kvt_cuda_wait_for(c, 0, seq, 2000000); /* hands the wait to the waiter thread */
    if (rc != -1)
        FAIL("depth %zu: a held job's wait answered %d, want -1", depth, rc);
    usleep(100000); /* the waiter thread, on a busy machine, gets to its cuEventSynchronize */
    pthread_t t;
    if (pthread_create(&t, NULL, release_later, (void *)STREAMS[0]))
        FAIL("pthread_create");
    double t0 = now_s();
    kvt_cuda_free(c);
    double took = now_s() - t0;
    pthread_join(t, NULL);
    /* Not bounded below: on a busy machine the waiter may not have blocked yet, and then
     * free need not wait. */
    if (took > 5)
        FAIL("depth %zu: free took %.3f s with the waiter blocked on a lane held 0.3 s", depth,
             took);
    if (fake_live_events())
        FAIL("depth %zu: %d events outlived the engine", depth, fake_live_events());
}

int main(int argc, char **argv) {
    depth = argc > 1 ? (size_t)atoi(argv[1]) : 0;
    store_seg = (kvtier_segment){(uint64_t)(uintptr_t)host, W, (uint64_t)(uintptr_t)dev, W, W};
    load_seg = (kvtier_segment){(uint64_t)(uintptr_t)dev, W, (uint64_t)(uintptr_t)host, W, W};
    engine = new_engine();
    pthread_t g;
    if (pthread_create(&g, NULL, gpu, (void *)(uintptr_t)rnd_state))
        FAIL("pthread_create");
    for (int round = 0; round < ROUNDS; round++)
        round_of_jobs(round);
    __atomic_store_n(&stop_gpu, 1, __ATOMIC_RELEASE);
    pthread_join(g, NULL);
    kvt_cuda_free(engine);
    if (fake_sticky())
        FAIL("depth %zu: the context was poisoned (CUresult %d)", depth, fake_sticky());
    if (fake_live_events())
        FAIL("depth %zu: %d events outlived the engine", depth, fake_live_events());
    earlier_job();
    other_lane();
    free_while_blocked();
    printf("ok: %lu waits, %lu answered pending\n", waits, pending);
    return 0;
}
