/* kvtier's C library without Python, built by test_native_c.py for this machine and for
 * aarch64 (run under qemu), which the tests cannot otherwise reach. Checks one row-copy call,
 * then a copy engine with a helper thread (store jobs of one to three 64 KiB rows, those over
 * 128 KiB split), then single-row loads queued behind a waiter (copied in a shared batch):
 * rows byte-exact, results in order. Prints "ok: ..." and exits 0, or says what differs and
 * exits 1. */
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
void kvt_engine_free(kvt_engine *e);
uint64_t kvt_engine_shared_jobs(kvt_engine *e);

/* Holds the first load (id 1000) until the main thread has queued the rest and waits. */
static int hold_first(int64_t id) {
    if (id == 1000) {
        struct timespec pause = {0, 200 * 1000 * 1000};
        nanosleep(&pause, NULL);
    }
    return 0;
}

enum { ROWS = 64, WIDTH = 65536 + 64 };

/* Host row ROWS - 1 - i must hold device row i. */
static int check(const unsigned char *host, const unsigned char *dev, const char *what) {
    for (int i = 0; i < ROWS; i++)
        if (memcmp(host + (size_t)(ROWS - 1 - i) * WIDTH, dev + (size_t)i * WIDTH, WIDTH)) {
            printf("%s: row %d differs\n", what, i);
            return 1;
        }
    return 0;
}

int main(void) {
    unsigned char *dev = malloc((size_t)ROWS * WIDTH), *host = calloc(ROWS, WIDTH);
    if (!dev || !host)
        return 1;
    for (size_t i = 0; i < (size_t)ROWS * WIDTH; i++)
        dev[i] = (unsigned char)(i * 2654435761u >> 13);
    kvtier_segment seg = {(uint64_t)(uintptr_t)host, WIDTH, (uint64_t)(uintptr_t)dev, WIDTH,
                          WIDTH};

    int64_t d[ROWS], s[ROWS];
    for (int i = 0; i < ROWS; i++) {
        d[i] = ROWS - 1 - i;
        s[i] = i;
    }
    kvtier_copy_indexed(&seg, 1, d, s, ROWS);
    if (check(host, dev, "row copy"))
        return 1;

    memset(host, 0, (size_t)ROWS * WIDTH);
    kvt_engine *e = kvt_engine_new(NULL, 2, 128 << 10, NULL, 0, 1);
    if (!e) {
        printf("the engine did not start\n");
        return 1;
    }
    kvt_submit_ctx x = {&seg, 1, 1, 1, ROWS, ROWS, 0, WIDTH};
    int64_t next = 0;
    uint64_t seq = 0;
    for (int j = 0; next < ROWS; j++) {
        int64_t n = 1 + j % 3, blocks[3], slots[3];
        if (next + n > ROWS)
            n = ROWS - next;
        for (int k = 0; k < n; k++) {
            blocks[k] = next + k;
            slots[k] = ROWS - 1 - (next + k);
        }
        if (kvt_engine_submit_ids(e, &x, j, 0, ++seq, blocks, (size_t)n, slots, (size_t)n, 0)) {
            printf("job %d refused\n", j);
            return 1;
        }
        next += n;
    }
    kvt_engine_wait(e, 0, seq);
    kvt_result res[ROWS];
    size_t got = kvt_engine_poll(e, res, ROWS);
    if (got != seq) {
        printf("%zu results for %llu jobs\n", got, (unsigned long long)seq);
        return 1;
    }
    for (size_t i = 0; i < got; i++)
        if (!res[i].ok || res[i].id != (int64_t)i) {
            printf("result %zu: job %lld, ok %d\n", i, (long long)res[i].id, res[i].ok);
            return 1;
        }
    if (check(host, dev, "engine"))
        return 1;
    kvt_engine_free(e);

    /* Back, one row a job: host row ROWS - 1 - i into row i of `back`. */
    unsigned char *back = calloc(ROWS, WIDTH);
    if (!back)
        return 1;
    e = kvt_engine_new((void *)hold_first, 2, 128 << 10, NULL, 0, 1);
    if (!e) {
        printf("the second engine did not start\n");
        return 1;
    }
    kvtier_segment load = {(uint64_t)(uintptr_t)back, WIDTH, (uint64_t)(uintptr_t)host, WIDTH,
                           WIDTH};
    kvt_submit_ctx y = {&load, 1, 0, 1, ROWS, ROWS, 1, WIDTH};
    for (int64_t i = 0; i < ROWS; i++) {
        int64_t block = i, slot = ROWS - 1 - i;
        if (kvt_engine_submit_ids(e, &y, 1000 + i, 0, (uint64_t)i + 1, &block, 1, &slot, 1, 0)) {
            printf("load %lld refused\n", (long long)i);
            return 1;
        }
    }
    kvt_engine_wait(e, 0, ROWS);
    got = kvt_engine_poll(e, res, ROWS);
    for (size_t i = 0; i < got; i++)
        if (!res[i].ok || res[i].id != 1000 + (int64_t)i) {
            printf("load result %zu: job %lld, ok %d\n", i, (long long)res[i].id, res[i].ok);
            return 1;
        }
    uint64_t shared = kvt_engine_shared_jobs(e);
    kvt_engine_free(e);
    if (got != ROWS || memcmp(back, dev, (size_t)ROWS * WIDTH)) {
        printf("loads: %zu results, rows %s\n", got,
               memcmp(back, dev, (size_t)ROWS * WIDTH) ? "differ" : "match");
        return 1;
    }
    if (shared < ROWS - 1) { /* the first as well, where the wait came before it was taken */
        printf("%llu of %d queued loads copied in a shared batch\n", (unsigned long long)shared,
               ROWS - 1);
        return 1;
    }
    printf("ok: %zu jobs, %d rows of %d bytes; %d loads, %llu shared\n", got, ROWS, WIDTH, ROWS,
           (unsigned long long)shared);
    return 0;
}
