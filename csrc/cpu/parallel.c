/* fk_parallel_for: the CPU kernels' one way to use several cores. Each call starts up to
 * threads - 1 POSIX threads and runs the first range itself; ranges are contiguous and sized so no
 * thread gets less than min_items items (starting a thread costs ~10-50 us, so a thread must have
 * at least tens of microseconds of work). A thread that cannot be started has its range run on
 * the calling thread: C never fails a kernel for want of threads. */
#include <pthread.h>

#include "common.h"

#define FK_MAX_THREADS 256

typedef struct {
    fk_range_fn fn;
    void *ctx;
    int64_t begin, end;
} fk_range;

static void *run_range(void *arg) {
    const fk_range *r = (const fk_range *)arg;
    r->fn(r->ctx, r->begin, r->end);
    return NULL;
}

void fk_parallel_for(int threads, int64_t items, int64_t min_items, fk_range_fn fn, void *ctx) {
    int64_t most = min_items > 1 ? items / min_items : items;
    int t = threads < 1 ? 1 : threads > FK_MAX_THREADS ? FK_MAX_THREADS : threads;
    if (most < t) t = most < 1 ? 1 : (int)most;
    fk_range ranges[FK_MAX_THREADS];
    pthread_t ids[FK_MAX_THREADS];
    int started[FK_MAX_THREADS];
    for (int i = 0; i < t; i++) {
        ranges[i] = (fk_range){fn, ctx, items * i / t, items * (i + 1) / t};
        started[i] = i > 0 && pthread_create(&ids[i], NULL, run_range, &ranges[i]) == 0;
    }
    run_range(&ranges[0]);
    for (int i = 1; i < t; i++) {
        if (started[i]) pthread_join(ids[i], NULL);
        else run_range(&ranges[i]);
    }
}
