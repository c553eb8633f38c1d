/* The CPU engine's result buffer (copyengine.c, included to see its fields): built by
 * test_native_c.py. A caller that always leaves a result unpolled when it submits once grew
 * the buffer by a result per job, for ever; it must stay bounded by what is in flight, and
 * every job must still be reported once, in order. Prints "ok: ..." and exits 0, or says what
 * went wrong and exits 1. */
#include "copyengine.c"

#include <stdio.h>

enum { ROWS = 64, WIDTH = 64 };

static unsigned char dev[ROWS * WIDTH], host[ROWS * WIDTH];

int main(void) {
    kvtier_segment seg = {(uint64_t)(uintptr_t)host, WIDTH, (uint64_t)(uintptr_t)dev, WIDTH,
                          WIDTH};
    kvt_submit_ctx store = {&seg, 1, 1, 1, ROWS, ROWS, 0, WIDTH};
    kvt_engine *e = kvt_engine_new(NULL, 1, (size_t)1 << 40, NULL, 0, 0);
    if (!e)
        return 1;
    kvt_result out[64];
    int64_t next = 1; /* the next id expected from a poll */
    uint64_t seq = 0;
    unsigned rng = 12345;
    for (int round = 0; round < 50000; round++) {
        /* One to four submits, a wait for the last, then a poll that leaves the newest
         * results unpolled (as a caller does when a job finishes between its poll and its
         * next submit). */
        int k = 1 + (int)((rng = rng * 1103515245u + 12345u) >> 16) % 4;
        for (int i = 0; i < k; i++) {
            int64_t b = (int64_t)(seq % ROWS), s = (int64_t)((seq * 7) % ROWS);
            seq++;
            if (kvt_engine_submit_ids(e, &store, (int64_t)seq, 0, seq, &b, 1, &s, 1, 0)) {
                printf("submit %llu refused\n", (unsigned long long)seq);
                return 1;
            }
        }
        kvt_engine_wait(e, 0, seq);
        size_t leave = 1 + (size_t)(rng >> 20) % 3;
        size_t pending = (size_t)((int64_t)seq - next + 1);
        size_t want = pending > leave ? pending - leave : 0;
        while (want) {
            size_t got = kvt_engine_poll(e, out, want < 64 ? want : 64);
            for (size_t i = 0; i < got; i++)
                if (out[i].id != next++ || !out[i].ok) {
                    printf("result %lld out of order or failed\n", (long long)out[i].id);
                    return 1;
                }
            want -= got;
        }
    }
    size_t cap = e->res_cap;
    while (next <= (int64_t)seq) {
        size_t got = kvt_engine_poll(e, out, 64);
        for (size_t i = 0; i < got; i++)
            if (out[i].id != next++) {
                printf("result %lld out of order\n", (long long)out[i].id);
                return 1;
            }
        if (!got) {
            printf("job %lld never reported\n", (long long)next);
            return 1;
        }
    }
    kvt_engine_free(e);
    if (cap > 256) {
        printf("the result buffer grew to %zu results for %llu jobs, at most 7 in flight\n", cap,
               (unsigned long long)seq);
        return 1;
    }
    printf("ok: %llu jobs reported once, in order; buffer of %zu results\n",
           (unsigned long long)seq, cap);
    return 0;
}
