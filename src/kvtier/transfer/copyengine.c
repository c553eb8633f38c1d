/* The CPU backend's copy thread, in C (see native_worker.py).
 *
 * A Python copy thread needs the GIL between jobs, and a submitting thread that holds it
 * (an engine's step loop, a burst of submits) stalls every job behind it: no copy starts
 * until the burst ends. This thread never takes the GIL: it pops jobs from two FIFO lanes
 * (urgent first), copies them with kvtier_copy_indexed, and appends results that Python
 * polls. Only the optional `before` hook (tests' fault injection) calls back into Python.
 *
 * Ownership: the caller keeps the segment tables alive as long as the engine, and, for jobs
 * queued with kvt_engine_submit, the row arrays until the job's result has been polled.
 * kvt_engine_submit_ids copies what it needs: its arrays are free when it returns.
 */
#define _GNU_SOURCE /* pthread_attr_setaffinity_np */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvtier.h"

/* Called on the copy thread just before a job's copy; nonzero fails the job. */
typedef int (*kvt_before_fn)(int64_t job_id);

typedef struct kvt_job {
    struct kvt_job *next;
    int64_t id;
    uint64_t seq;
    const kvtier_segment *segs;
    size_t nseg;
    const int64_t *dst, *src;
    size_t n;
} kvt_job;

/* The CPUs `copy_cpus` confines the threads to, if it does. */
typedef struct {
    int confined;
#ifdef __linux__
    cpu_set_t set;
#endif
} kvt_cpus;

/* Helpers that copy slices of one large job alongside the engine's thread. Slices are
 * claimed, not assigned: the engine's thread claims them too, so a helper that is slow to
 * wake (an idle vCPU can take milliseconds) costs its slice's time, never a wait for it. */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t fin;
    int parts, claimed, finished, stopping; /* of the current job, under mu */
    const kvtier_segment *segs;
    size_t nseg, n;
    const int64_t *dst, *src;
    /* Or, when njobs > 0, a batch of whole jobs (share_batch()): slices are ranges of jobs,
     * and a job whose `ok` is 0 is skipped. */
    kvt_job *const *jobs;
    const int *ok;
    size_t njobs;
} kvt_team;

/* Each helper has its own wake-up, so that a job split in k slices wakes k - 1 helpers, not
 * every helper of a wide machine. */
typedef struct {
    kvt_team *team;
    pthread_cond_t go;
    unsigned long gen; /* bumped under team->mu to wake this helper */
    int avoided;       /* the CPU this helper is kept off now (-1: none); engine's thread only */
} kvt_helper_arg;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    kvt_job *head[2], *tail[2];
    uint64_t done_seq[2]; /* per lane: seq of the last finished job; a lane finishes in order */
    uint64_t accepted[2]; /* per lane: seq of the last job queued (kvt_engine_accepted) */
    /* Per lane: the lowest seq a waiter needs (UINT64_MAX: none). The engine's thread wakes
     * waiters only when it gets there: waking them after every job cost the copy thread a
     * futex call and, on a VM, an IPI to a halted vCPU per job, and a waiter that takes the
     * mutex back makes the next job's pop contend for it. */
    uint64_t wake_at[2];
    kvt_result *res;
    size_t res_head, res_len, res_cap; /* results not yet polled: res[res_head, res_len) */
    size_t outstanding;                /* submitted, result not yet appended */
    int stopping, joined, ended; /* ended: the engine's thread reported the queued jobs */
    kvt_before_fn before;
    pthread_t thread;
    kvt_team team;
    size_t min_split_bytes; /* smaller jobs are copied by the engine's thread alone */
    int nhelpers;
    int ncond; /* helper wake-ups initialised */
    pthread_t *helpers;
    kvt_helper_arg *helper_args;
    /* Keeping the engine's thread off the submitting thread's CPU (`avoid`, see place()), and
     * the helpers off the engine's thread's (`spread`, place_helpers()). */
    int avoid, spread;
    int share; /* copy a waiter's backlog of small jobs with the helpers (share_batch()) */
    uint64_t shared_jobs; /* jobs copied so, under mu */
    int submit_cpu; /* where the latest submit ran, under mu (-1: not known) */
    int avoided;    /* the CPU the engine's thread is kept off now (-1: none), under mu */
    int place_off;  /* the system refused an affinity: placing stopped, under mu */
    int helpers_off; /* the same for the helpers (engine's thread only) */
#ifdef __linux__
    cpu_set_t allowed; /* the CPUs the engine's threads may use at all */
#endif
} kvt_engine;

/* A large job is split by rows into slices of at least this many bytes, one per thread up
 * to the helpers available: a smaller slice costs more to hand off than it saves. */
#define KVT_SLICE_BYTES ((size_t)256 << 10)

/* Claim and copy slices of the current job until none is left; called with t->mu held,
 * returns with it held. The job cannot change meanwhile: the engine's thread waits for every
 * claimed slice to finish before it moves on. */
static void copy_slices(kvt_team *t) {
    while (t->claimed < t->parts) {
        int part = t->claimed++;
        size_t n = t->njobs ? t->njobs : t->n;
        size_t a = n * (size_t)part / (size_t)t->parts;
        size_t b = n * (size_t)(part + 1) / (size_t)t->parts;
        pthread_mutex_unlock(&t->mu);
        if (t->njobs) {
            for (size_t k = a; k < b; k++)
                if (t->ok[k])
                    kvtier_copy_indexed(t->jobs[k]->segs, t->jobs[k]->nseg, t->jobs[k]->dst,
                                        t->jobs[k]->src, t->jobs[k]->n);
        } else {
            kvtier_copy_indexed(t->segs, t->nseg, t->dst + a, t->src + a, b - a);
        }
        pthread_mutex_lock(&t->mu);
        if (++t->finished == t->parts)
            pthread_cond_signal(&t->fin);
    }
}

static void *help(void *arg) {
    kvt_helper_arg *h = arg;
    kvt_team *t = h->team;
    unsigned long seen = 0;
    for (;;) {
        pthread_mutex_lock(&t->mu);
        while (!t->stopping && h->gen == seen)
            pthread_cond_wait(&h->go, &t->mu);
        if (t->stopping) {
            pthread_mutex_unlock(&t->mu);
            return NULL;
        }
        seen = h->gen;
        copy_slices(t);
        pthread_mutex_unlock(&t->mu);
    }
}

static size_t job_bytes(const kvt_job *j) {
    size_t row = 0;
    for (size_t k = 0; k < j->nseg; k++)
        row += (size_t)j->segs[k].width;
    return row * j->n;
}

/* How many slices `j` is copied in: 1 (the engine's thread alone) below `min_split_bytes`,
 * else one per 256 KiB up to the threads there are, never more than its rows. */
static size_t job_parts(const kvt_engine *e, const kvt_job *j) {
    size_t bytes = job_bytes(j);
    size_t parts = bytes < e->min_split_bytes ? 1 : bytes / KVT_SLICE_BYTES;
    if (parts > (size_t)e->nhelpers + 1)
        parts = (size_t)e->nhelpers + 1;
    if (parts > j->n)
        parts = j->n;
    return parts < 1 ? 1 : parts;
}

/* Keep `thread` off CPU `want` (-1: let it anywhere it may run); `avoided` is its state, and
 * `off` is set if the system refuses (a cpuset changed under us: stop asking at every job). */
static void keep_off(const kvt_engine *e, pthread_t thread, int *avoided, int want, int *off) {
#ifdef __linux__
    if (want == *avoided)
        return;
    cpu_set_t set = e->allowed;
    if (want >= 0 && want < CPU_SETSIZE)
        CPU_CLR(want, &set);
    if (CPU_COUNT(&set) == 0)
        return;
    if (pthread_setaffinity_np(thread, sizeof set, &set) == 0)
        *avoided = want;
    else
        *off = 1;
#else
    (void)e, (void)thread, (void)avoided, (void)want, (void)off;
#endif
}

/* Before a job: keep the engine's thread off `cpu`, the submitter's, if it copies the job
 * alone; let it anywhere for a job split over the helpers, which share out every CPU. Woken
 * by a submit, the kernel tends to run the thread on the submitter's CPU, where the two then
 * take turns: a burst of small jobs costs submit + copy per job instead of the longer of the
 * two. The affinity changes only when the submitter's CPU or the kind of job does. */
static void place(kvt_engine *e, int split, int cpu) {
    keep_off(e, e->thread, &e->avoided, split ? -1 : cpu, &e->place_off);
}

/* Keep the first `n` helpers off the CPU the engine's thread runs on, before they are woken
 * for a split job or a shared batch. The kernel tends to wake them there (as it does the
 * engine's thread on the submitter's CPU), and there the threads took turns: a 256-job batch
 * copied by two threads took as long as by one, and a 2 MiB job of 16 KiB rows 226 µs instead
 * of 151 (docs/bench/transfer.md). Changed only when that CPU does. */
static void place_helpers(kvt_engine *e, size_t n) {
#ifdef __linux__
    int want = sched_getcpu();
    for (size_t i = 0; i < n && i < (size_t)e->nhelpers && !e->helpers_off; i++)
        keep_off(e, e->helpers[i], &e->helper_args[i].avoided, want, &e->helpers_off);
#else
    (void)e, (void)n;
#endif
}

/* Copy a job in `parts` slices (job_parts), split over the helpers when more than one. */
static void copy_job(kvt_engine *e, const kvt_job *j, size_t parts) {
    kvt_team *t = &e->team;
    if (parts < 2) {
        kvtier_copy_indexed(j->segs, j->nseg, j->dst, j->src, j->n);
        return;
    }
    if (e->spread && !e->helpers_off)
        place_helpers(e, parts - 1);
    pthread_mutex_lock(&t->mu);
    t->segs = j->segs;
    t->nseg = j->nseg;
    t->dst = j->dst;
    t->src = j->src;
    t->n = j->n;
    t->parts = (int)parts;
    t->claimed = t->finished = 0;
    t->njobs = 0;
    for (size_t i = 0; i + 1 < parts; i++) {
        e->helper_args[i].gen++;
        pthread_cond_signal(&e->helper_args[i].go);
    }
    copy_slices(t);
    while (t->finished < t->parts)
        pthread_cond_wait(&t->fin, &t->mu);
    pthread_mutex_unlock(&t->mu);
}

/* A waiter's backlog (share_batch()) is taken at most this many jobs and bytes at a time:
 * its results are reported together, when the last of them is copied. */
#define KVT_BATCH_JOBS 256
#define KVT_BATCH_BYTES ((size_t)16 << 20)

/* Pop, under e->mu, the jobs behind `j` in `lane` that may be copied alongside it into
 * `batch` (j first); returns how many. Only while a thread waits for a later job of the lane:
 * that thread sleeps, and its CPU is free for a helper. (While the submitter runs, a second
 * copy thread competes with it for the cores, which cost more than it saved on two vCPUs:
 * docs/bench/transfer.md.) Taken: jobs up to the waiter's, each copied alone (below
 * `min_split_bytes`), of the same group and direction (segment table) as `j`. */
static size_t gather(kvt_engine *e, int lane, kvt_job *j, kvt_job **batch) {
    batch[0] = j;
    size_t nb = 1, bytes = job_bytes(j);
    if (!e->share || e->nhelpers == 0 || e->wake_at[lane] == UINT64_MAX ||
        bytes >= e->min_split_bytes)
        return 1;
    for (kvt_job *k = e->head[lane]; k && nb < KVT_BATCH_JOBS; k = e->head[lane]) {
        size_t b = job_bytes(k);
        if (k->seq > e->wake_at[lane] || k->segs != j->segs || k->nseg != j->nseg ||
            b >= e->min_split_bytes || bytes + b > KVT_BATCH_BYTES)
            break;
        bytes += b;
        batch[nb++] = k;
        e->head[lane] = k->next;
        if (!k->next)
            e->tail[lane] = NULL;
    }
    return nb;
}

/* 1 if no two jobs of `batch` (one segment table) write the same row, else 0 (also when out
 * of memory): only then may they be copied in parallel. A hash set of the destination rows,
 * linear in their number: a batch may hold thousands. */
static int writes_disjoint(kvt_job *const *batch, size_t nb) {
    size_t rows = 0;
    for (size_t k = 0; k < nb; k++)
        rows += batch[k]->n;
    size_t cap = 16;
    while (cap < 2 * rows)
        cap *= 2;
    int64_t *set = malloc(cap * sizeof *set);
    if (!set)
        return 0;
    for (size_t i = 0; i < cap; i++)
        set[i] = -1; /* rows are never negative (kvt_plan_rows, plan.py) */
    int ok = 1;
    for (size_t k = 0; k < nb && ok; k++) {
        for (size_t i = 0; i < batch[k]->n && ok; i++) {
            int64_t r = batch[k]->dst[i];
            size_t h = (size_t)((uint64_t)r * 0x9E3779B97F4A7C15ull >> 17) & (cap - 1);
            while (set[h] != -1 && set[h] != r)
                h = (h + 1) & (cap - 1);
            ok = set[h] != r;
            set[h] = r;
        }
    }
    free(set);
    return ok;
}

static void push_result(kvt_engine *e, int64_t id, int ok, int lane, double seconds) {
    /* Capacity was reserved at submit, so this never allocates. */
    kvt_result *r = &e->res[e->res_len++];
    r->id = id;
    r->ok = ok;
    r->lane = lane;
    r->seconds = seconds;
    e->outstanding--;
}

static double since(const struct timespec *t0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0->tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0->tv_nsec);
}

/* Copy a batch from gather() (more than one job) with the helpers, in slices of whole jobs,
 * where no two jobs write the same row; report every job when all are done, in order, each
 * with its share of the time by bytes. */
static void share_batch(kvt_engine *e, int lane, kvt_job **batch, size_t nb) {
    int ok[KVT_BATCH_JOBS];
    size_t bytes = 0;
    for (size_t k = 0; k < nb; k++)
        bytes += job_bytes(batch[k]);
    size_t parts = bytes / KVT_SLICE_BYTES;
    if (parts > nb)
        parts = nb;
    if (parts >= 2 && !writes_disjoint(batch, nb))
        parts = 1;
    if (e->spread && !e->helpers_off && parts > 1)
        place_helpers(e, parts - 1);

    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (size_t k = 0; k < nb; k++)
        ok[k] = e->before ? e->before(batch[k]->id) == 0 : 1;
    kvt_team *t = &e->team;
    if (parts < 2) {
        for (size_t k = 0; k < nb; k++)
            if (ok[k])
                kvtier_copy_indexed(batch[k]->segs, batch[k]->nseg, batch[k]->dst,
                                    batch[k]->src, batch[k]->n);
    } else {
        /* More slices than threads: one that wakes late still takes a share. */
        pthread_mutex_lock(&t->mu);
        t->jobs = batch;
        t->ok = ok;
        t->njobs = nb;
        t->parts = (int)parts;
        t->claimed = t->finished = 0;
        for (size_t i = 0; i + 1 < parts && i < (size_t)e->nhelpers; i++) {
            e->helper_args[i].gen++;
            pthread_cond_signal(&e->helper_args[i].go);
        }
        copy_slices(t);
        while (t->finished < t->parts)
            pthread_cond_wait(&t->fin, &t->mu);
        t->njobs = 0;
        pthread_mutex_unlock(&t->mu);
    }
    double seconds = since(&t0);

    pthread_mutex_lock(&e->mu);
    for (size_t k = 0; k < nb; k++)
        push_result(e, batch[k]->id, ok[k], lane,
                    bytes ? seconds * (double)job_bytes(batch[k]) / (double)bytes : 0.0);
    if (parts > 1)
        e->shared_jobs += nb;
    uint64_t last = batch[nb - 1]->seq;
    e->done_seq[lane] = last;
    if (last >= e->wake_at[lane]) {
        e->wake_at[lane] = UINT64_MAX;
        pthread_cond_broadcast(&e->done);
    }
    pthread_mutex_unlock(&e->mu);
    for (size_t k = 0; k < nb; k++)
        free(batch[k]);
}

/* Report the queued jobs failed, under e->mu, once stopping: after the running job's result,
 * so that each lane's results stay in submission order, and each lane's done_seq only grows
 * (a waiter for a cancelled job returns). */
static void fail_queued(kvt_engine *e) {
    for (int lane = 1; lane >= 0; lane--) {
        for (kvt_job *j = e->head[lane], *next; j; j = next) {
            next = j->next;
            push_result(e, j->id, 0, lane, 0.0);
            e->done_seq[lane] = j->seq;
            free(j);
        }
        e->head[lane] = e->tail[lane] = NULL;
    }
    e->ended = 1;
    pthread_cond_broadcast(&e->done);
}

static void *serve(void *arg) {
    kvt_engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stopping && !e->head[0] && !e->head[1])
            pthread_cond_wait(&e->work, &e->mu);
        if (e->stopping) {
            /* Here, not in kvt_engine_stop: a stop from the `before` hook runs on this thread,
             * which reports the job it is in before the queued ones. */
            fail_queued(e);
            pthread_mutex_unlock(&e->mu);
            return NULL;
        }
        int lane = e->head[1] ? 1 : 0;
        kvt_job *j = e->head[lane];
        e->head[lane] = j->next;
        if (!j->next)
            e->tail[lane] = NULL;
        kvt_job *batch[KVT_BATCH_JOBS];
        size_t parts = job_parts(e, j);
        size_t nb = parts == 1 ? gather(e, lane, j, batch) : 1;
        /* Under mu: a submit may move this thread too (enqueue()). A shared batch keeps off
         * the waiting submitter's CPU, which is the helper's. */
        if (e->avoid && !e->place_off)
            place(e, parts > 1 && nb == 1, e->submit_cpu);
        pthread_mutex_unlock(&e->mu);
        if (nb > 1) {
            share_batch(e, lane, batch, nb);
            continue;
        }

        struct timespec t0;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int ok = e->before ? e->before(j->id) == 0 : 1;
        if (ok)
            copy_job(e, j, parts);
        double seconds = since(&t0);

        pthread_mutex_lock(&e->mu);
        push_result(e, j->id, ok, lane, seconds);
        e->done_seq[lane] = j->seq;
        if (j->seq >= e->wake_at[lane]) {
            e->wake_at[lane] = UINT64_MAX; /* waiters still short of theirs set it again */
            pthread_cond_broadcast(&e->done);
        }
        pthread_mutex_unlock(&e->mu);
        free(j);
    }
}

static void stop_helpers(kvt_engine *e, int started) {
    kvt_team *t = &e->team;
    pthread_mutex_lock(&t->mu);
    t->stopping = 1;
    for (int i = 0; i < started; i++)
        pthread_cond_signal(&e->helper_args[i].go);
    pthread_mutex_unlock(&t->mu);
    for (int i = 0; i < started; i++)
        pthread_join(e->helpers[i], NULL);
}

static void destroy(kvt_engine *e) {
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->work);
    pthread_cond_destroy(&e->done);
    pthread_mutex_destroy(&e->team.mu);
    pthread_cond_destroy(&e->team.fin);
    for (int i = 0; e->helper_args && i < e->ncond; i++)
        pthread_cond_destroy(&e->helper_args[i].go);
    free(e->helpers);
    free(e->helper_args);
    free(e->res);
    free(e);
}

/* Start an engine whose threads are created with `attr`, confined to `cpus` if it has any
 * (Linux); NULL on failure. */
static kvt_engine *start(kvt_before_fn before, int threads, size_t min_split_bytes,
                         const pthread_attr_t *attr, int avoid, const kvt_cpus *cpus) {
    kvt_engine *e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    e->before = before;
    e->wake_at[0] = e->wake_at[1] = UINT64_MAX;
    e->min_split_bytes = min_split_bytes;
    e->share = 1;
    e->submit_cpu = e->avoided = -1;
#ifdef __linux__
    /* Only where the threads may run on two CPUs or more: elsewhere there is nowhere to go. */
    int known = 1;
    if (cpus->confined)
        e->allowed = cpus->set;
    else
        known = sched_getaffinity(0, sizeof e->allowed, &e->allowed) == 0;
    e->spread = known && CPU_COUNT(&e->allowed) >= 2;
    e->avoid = avoid && !cpus->confined && e->spread;
#else
    (void)avoid, (void)cpus;
#endif
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work, NULL);
    /* kvt_engine_wait_for's deadlines are on KVT_WAIT_CLOCK: a wall-clock step cannot
     * stretch one where the monotonic clock is available. */
    pthread_condattr_t done_attr;
    pthread_condattr_init(&done_attr);
#ifdef __linux__
    pthread_condattr_setclock(&done_attr, CLOCK_MONOTONIC);
#endif
    pthread_cond_init(&e->done, &done_attr);
    pthread_condattr_destroy(&done_attr);
    pthread_mutex_init(&e->team.mu, NULL);
    pthread_cond_init(&e->team.fin, NULL);
    int want = threads > 1 ? threads - 1 : 0;
    e->helpers = calloc((size_t)want + 1, sizeof *e->helpers);
    e->helper_args = calloc((size_t)want + 1, sizeof *e->helper_args);
    if (!e->helpers || !e->helper_args) {
        destroy(e);
        return NULL;
    }
    for (int i = 0; i < want; i++) {
        e->helper_args[i].team = &e->team;
        e->helper_args[i].avoided = -1;
        pthread_cond_init(&e->helper_args[i].go, NULL);
        e->ncond = i + 1;
    }
    for (int i = 0; i < want; i++) {
        if (pthread_create(&e->helpers[i], attr, help, &e->helper_args[i]) != 0) {
            stop_helpers(e, i);
            destroy(e);
            return NULL;
        }
    }
    e->nhelpers = want;
    if (pthread_create(&e->thread, attr, serve, e) != 0) {
        stop_helpers(e, want);
        destroy(e);
        return NULL;
    }
    return e;
}

/* Confine threads created with `attr` to `cpus` (kept in `out`); 0, or -1 where the system
 * refuses. */
static int confine(pthread_attr_t *attr, const int32_t *cpus, size_t ncpus, kvt_cpus *out) {
#ifdef __linux__
    CPU_ZERO(&out->set);
    for (size_t i = 0; i < ncpus; i++)
        if (cpus[i] >= 0 && cpus[i] < CPU_SETSIZE)
            CPU_SET(cpus[i], &out->set);
    out->confined = 1;
    return pthread_attr_setaffinity_np(attr, sizeof out->set, &out->set) == 0 ? 0 : -1;
#else
    (void)attr, (void)cpus, (void)ncpus, (void)out;
    return -1; /* no thread affinity here */
#endif
}

/* Whether a waiter's backlog of small jobs is copied with the helpers (gather()); on from
 * the start. `share_backlog=False` (native_worker.py) turns it off, as does
 * benchmarks/cpu_submit.py for one of the two workers it compares. */
void kvt_engine_share_backlog(kvt_engine *e, int on) {
    pthread_mutex_lock(&e->mu);
    e->share = on != 0;
    pthread_mutex_unlock(&e->mu);
}

/* How many jobs were copied in shared batches so far. */
uint64_t kvt_engine_shared_jobs(kvt_engine *e) {
    pthread_mutex_lock(&e->mu);
    uint64_t n = e->shared_jobs;
    pthread_mutex_unlock(&e->mu);
    return n;
}

/* Start the engine's thread and `threads - 1` helpers for jobs of `min_split_bytes` or more;
 * with `ncpus` > 0 every thread runs only on `cpus` (see native_worker.py: `copy_cpus`), else,
 * with `avoid_submitter`, the engine's thread keeps off the submitting thread's CPU for jobs
 * it copies alone (place()). Either way, where the threads may use two CPUs or more, helpers
 * are kept off the engine's thread's CPU (place_helpers()). NULL on failure, an affinity the
 * system refuses included. */
kvt_engine *kvt_engine_new(kvt_before_fn before, int threads, size_t min_split_bytes,
                           const int32_t *cpus, size_t ncpus, int avoid_submitter) {
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0)
        return NULL;
    kvt_engine *e = NULL;
    kvt_cpus set = {0};
    if (ncpus == 0 || confine(&attr, cpus, ncpus, &set) == 0)
        e = start(before, threads, min_split_bytes, &attr, ncpus == 0 && avoid_submitter, &set);
    pthread_attr_destroy(&attr);
    return e;
}

/* Queue `j` in `lane` (0 normal, 1 urgent). Returns 0, or -1 if stopping or out of memory,
 * in which case `j` is freed and nothing is queued. */
static int enqueue(kvt_engine *e, kvt_job *j, int lane) {
#ifdef __linux__
    int cpu = e->avoid ? sched_getcpu() : -1;
#else
    int cpu = -1;
#endif
    pthread_mutex_lock(&e->mu);
    size_t need = e->res_len + e->outstanding + 1;
    if (e->stopping) { /* checked first: after it the engine's thread may be gone */
        pthread_mutex_unlock(&e->mu);
        free(j);
        return -1;
    }
    e->submit_cpu = cpu;
    /* The submitter moved onto a CPU the engine's thread is kept on: move that thread now.
     * Left to the thread itself, the move waited for its next job, and a thread woken on the
     * submitter's CPU (its only one, on two) got none until the submitter slept: whole
     * bursts of single 64 KiB blocks queued up uncopied until wait(). */
    if (e->avoid && !e->place_off && cpu >= 0 && e->avoided >= 0 && cpu != e->avoided)
        place(e, 0, cpu);
    if (e->res_head == e->res_len) { /* everything polled: reuse the buffer from the start */
        e->res_head = e->res_len = 0;
        need = e->outstanding + 1;
    }
    if (need > e->res_cap) {
        if (e->res_head > 0) {
            /* Polled results at the front: move the rest down. A caller that always leaves a
             * result unpolled when it submits (one finished since its last poll) never gets
             * the reset above, and the buffer grew by a result per job for as long as the
             * engine ran. */
            size_t live = e->res_len - e->res_head;
            memmove(e->res, e->res + e->res_head, live * sizeof *e->res);
            e->res_head = 0;
            e->res_len = live;
            need = live + e->outstanding + 1;
        }
        /* Twice what is needed: the next move is then half a buffer of submits away, so
         * moving costs O(1) a job. */
        if (2 * need > e->res_cap) {
            size_t cap = e->res_cap ? 2 * e->res_cap : 64;
            while (cap < 2 * need)
                cap *= 2;
            kvt_result *r = realloc(e->res, cap * sizeof *r);
            if (!r) {
                pthread_mutex_unlock(&e->mu);
                free(j);
                return -1;
            }
            e->res = r;
            e->res_cap = cap;
        }
    }
    lane = lane ? 1 : 0;
    if (e->tail[lane])
        e->tail[lane]->next = j;
    else
        e->head[lane] = j;
    e->tail[lane] = j;
    e->accepted[lane] = j->seq;
    e->outstanding++;
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->mu);
    return 0;
}

/* Queue a job in `lane` (0 normal, 1 urgent) with the caller's sequence number, which must
 * grow with every job of the lane, never repeat; gaps are harmless (done_seq, wake_at and the
 * waits only compare seqs). The caller keeps `dst` and `src` alive until the job's result is
 * polled. Returns 0, or -1 if stopping or out of memory (nothing queued). */
int kvt_engine_submit(kvt_engine *e, int64_t id, int lane, uint64_t seq,
                      const kvtier_segment *segs, size_t nseg, const int64_t *dst,
                      const int64_t *src, size_t n) {
    kvt_job *j = malloc(sizeof *j);
    if (!j)
        return -1;
    *j = (kvt_job){NULL, id, seq, segs, nseg, dst, src, n};
    return enqueue(e, j, lane);
}

static int out_of_range(const int64_t *a, size_t n, int64_t limit) {
    for (size_t i = 0; i < n; i++)
        if (a[i] < 0 || a[i] >= limit)
            return 1;
    return 0;
}

static int cmp_i64(const void *x, const void *y) {
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

/* 1 if `a` repeats a value, 0 if not, -1 if out of memory. */
static int repeats(const int64_t *a, size_t n) {
    if (n <= 48) { /* a job's few chunks: cheaper than a sorted copy */
        for (size_t i = 1; i < n; i++)
            for (size_t k = 0; k < i; k++)
                if (a[i] == a[k])
                    return 1;
        return 0;
    }
    int64_t *s = malloc(n * sizeof *s);
    if (!s)
        return -1;
    for (size_t i = 0; i < n; i++)
        s[i] = a[i];
    qsort(s, n, sizeof *s, cmp_i64);
    int dup = 0;
    for (size_t i = 1; i < n && !dup; i++)
        dup = s[i] == s[i - 1];
    free(s);
    return dup;
}

/* Validate a job's device block ids and slots the way plan.py does and compute its rows
 * (host row = slot * bpc + offset) into `host` and `dev` (room for `nblocks` each). `store`
 * writes whole chunks (skip must be 0); a load takes the blocks of the slots' chunks from
 * `skip` on, every slot contributing one at least. Returns 0; 1 if the arguments are
 * invalid; -1 if out of memory. Shared with cudaengine.c. */
int kvt_plan_rows(int store, const int64_t *blocks, size_t nblocks, const int64_t *slots,
                  size_t nslots, size_t bpc, size_t skip, int64_t num_blocks, int64_t num_slots,
                  int64_t *host, int64_t *dev) {
    /* Every host row (below num_slots * bpc) must fit an int64_t, and nslots * bpc a size_t:
     * wrapped, a store of 2 slots of 2^63 blocks took no blocks, and a load wrote to rows far
     * outside the pool. */
    if (bpc == 0 || bpc > (uint64_t)INT64_MAX || nslots > SIZE_MAX / bpc ||
        (num_slots > 0 && (uint64_t)num_slots > (uint64_t)INT64_MAX / bpc) ||
        out_of_range(blocks, nblocks, num_blocks) || out_of_range(slots, nslots, num_slots))
        return 1;
    size_t n = nblocks, cap = nslots * bpc;
    if (store) {
        if (skip != 0 || n != cap)
            return 1;
    } else {
        if (skip >= bpc)
            return 1;
        /* No slots take no blocks, whatever the skip (cap - skip would wrap); else n > 0 too:
         * one slot with skip > 0 has cap < bpc (plan.py says the same) */
        if (nslots == 0 ? n != 0 : !(n > 0 && n <= cap - skip && cap - skip - n < bpc))
            return 1;
    }
    int dup = store ? repeats(slots, nslots) : repeats(blocks, nblocks);
    if (dup)
        return dup < 0 ? -1 : 1;
    for (size_t i = 0; i < n; i++) {
        size_t r = skip + i; /* block r of the job's chunks, in order */
        host[i] = slots[r / bpc] * (int64_t)bpc + (int64_t)(r % bpc);
        dev[i] = blocks[i];
    }
    return 0;
}

/* The submit path with its planning in C (kvt_plan_rows), into memory the engine owns;
 * what every submit of a group and direction shares comes in `x`, built once (each argument
 * of a ctypes call costs about 0.13 µs on the 2-core machine).
 * Returns 0; -1 if stopping or out of memory; 1 if the arguments are invalid (nothing is
 * queued: the caller reports the error, with plan.py's message). */
int kvt_engine_submit_ids(kvt_engine *e, const kvt_submit_ctx *x, int64_t id, int lane,
                          uint64_t seq, const int64_t *blocks, size_t nblocks,
                          const int64_t *slots, size_t nslots, size_t skip) {
    size_t n = nblocks;
    kvt_job *j = malloc(sizeof *j + 2 * n * sizeof(int64_t));
    if (!j)
        return -1;
    int64_t *host = (int64_t *)(j + 1), *dev = host + n;
    int store = x->store != 0;
    int rc = kvt_plan_rows(store, blocks, nblocks, slots, nslots, x->bpc, skip, x->num_blocks,
                           x->num_slots, host, dev);
    if (rc) {
        free(j);
        return rc;
    }
    *j = (kvt_job){NULL, id, seq, x->segs, x->nseg, store ? host : dev, store ? dev : host, n};
    return enqueue(e, j, lane);
}

/* Copy up to `max` finished results, in finishing order, into `out`, leaving them in the
 * engine; returns how many (under e->mu). */
static size_t peek(kvt_engine *e, kvt_result *out, size_t max) {
    size_t k = e->res_len - e->res_head;
    if (k > max)
        k = max;
    for (size_t i = 0; i < k; i++)
        out[i] = e->res[e->res_head + i];
    return k;
}

/* Move up to `max` finished results, in finishing order, into `out`; returns how many. */
size_t kvt_engine_poll(kvt_engine *e, kvt_result *out, size_t max) {
    pthread_mutex_lock(&e->mu);
    size_t k = peek(e, out, max);
    e->res_head += k;
    pthread_mutex_unlock(&e->mu);
    return k;
}

/* kvt_engine_poll in two steps: copy the results (kvt_engine_peek), then drop the first `k`
 * of them (kvt_engine_drop) once the caller has them for good. Python can raise an interrupt
 * as any call returns: results taken in one step were lost with it (native_worker.py). A
 * caller that serialises its polls drops what it peeked; results finished since then stay. */
size_t kvt_engine_peek(kvt_engine *e, kvt_result *out, size_t max) {
    pthread_mutex_lock(&e->mu);
    size_t k = peek(e, out, max);
    pthread_mutex_unlock(&e->mu);
    return k;
}

void kvt_engine_drop(kvt_engine *e, size_t k) {
    pthread_mutex_lock(&e->mu);
    size_t left = e->res_len - e->res_head;
    e->res_head += k < left ? k : left;
    pthread_mutex_unlock(&e->mu);
}

/* The seq of the last job queued in `lane` (0: none yet). A caller that serialises its
 * submits learns from it whether one that was cut short queued its job (Python can raise
 * KeyboardInterrupt as the submit call returns): it did if this is at least the job's seq. */
uint64_t kvt_engine_accepted(kvt_engine *e, int lane) {
    pthread_mutex_lock(&e->mu);
    uint64_t seq = e->accepted[lane ? 1 : 0];
    pthread_mutex_unlock(&e->mu);
    return seq;
}

/* Block until the job with sequence number `seq` of `lane` has finished. */
void kvt_engine_wait(kvt_engine *e, int lane, uint64_t seq) {
    lane = lane ? 1 : 0;
    pthread_mutex_lock(&e->mu);
    while (e->done_seq[lane] < seq) {
        if (seq < e->wake_at[lane])
            e->wake_at[lane] = seq;
        pthread_cond_wait(&e->done, &e->mu);
    }
    pthread_mutex_unlock(&e->mu);
}

#ifdef __linux__
#define KVT_WAIT_CLOCK CLOCK_MONOTONIC
#else
#define KVT_WAIT_CLOCK CLOCK_REALTIME
#endif

/* kvt_engine_wait for at most `timeout_ns`: 1 once the job with sequence number `seq` of
 * `lane` has finished, 0 if it has not by then. A Python caller waits in slices, returning
 * to Python between them: a Ctrl-C is raised only there, and a wait of one call held it off
 * until the job ended (native_worker.py). */
int kvt_engine_wait_for(kvt_engine *e, int lane, uint64_t seq, uint64_t timeout_ns) {
    lane = lane ? 1 : 0;
    struct timespec until;
    clock_gettime(KVT_WAIT_CLOCK, &until);
    until.tv_sec += (time_t)(timeout_ns / 1000000000u);
    until.tv_nsec += (long)(timeout_ns % 1000000000u);
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&e->mu);
    int timed_out = 0;
    while (e->done_seq[lane] < seq && !timed_out) {
        if (seq < e->wake_at[lane])
            e->wake_at[lane] = seq;
        timed_out = pthread_cond_timedwait(&e->done, &e->mu, &until) == ETIMEDOUT;
    }
    int done = e->done_seq[lane] >= seq;
    pthread_mutex_unlock(&e->mu);
    return done;
}

/* Let the running job (or shared batch) finish, then report the queued jobs failed (serve():
 * after the running job's result) and join the threads. The first call does it all; later
 * calls return once it is done. Called from the `before` hook, on the engine's own thread
 * (a worker shut down by its fault injector), it returns at once: the thread reports the
 * queued jobs when the job it is in ends, and a later call (kvt_engine_free) joins it. */
void kvt_engine_stop(kvt_engine *e) {
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    pthread_cond_broadcast(&e->work);
    if (pthread_equal(pthread_self(), e->thread)) {
        /* It cannot join itself: it tried, failed (EDEADLK), reported the queued jobs ahead
         * of the running one, and was never joined, so that kvt_engine_free released the
         * engine under it. */
        pthread_mutex_unlock(&e->mu);
        return;
    }
    int join = !e->joined;
    e->joined = 1;
    while (!join && !e->ended)
        pthread_cond_wait(&e->done, &e->mu);
    pthread_mutex_unlock(&e->mu);
    if (!join)
        return;
    pthread_join(e->thread, NULL); /* no job is forked to the helpers after this */
    stop_helpers(e, e->nhelpers);
}

/* Stop (if not yet) and release the engine; unpolled results are lost. */
void kvt_engine_free(kvt_engine *e) {
    kvt_engine_stop(e);
    destroy(e);
}
