/* fk_parallel_for: the CPU kernels' one way to use several cores, through a persistent pool.
 *
 * The pool's workers start once, lazily, on the first call that wants more than one thread, and
 * sleep on a condition variable between calls (waking one costs a few us; starting a POSIX thread
 * per call cost ~10-50 us and a page-faulted stack). Pool size: FASTKERN_CPU_THREADS when set, else
 * the cores this process may run on (sched_getaffinity), at most FK_MAX_THREADS. A call uses
 * min(threads, pool size) threads (threads = torch.get_num_threads() from Python;
 * FASTKERN_CPU_THREADS, when set, replaces it), the caller being one of them, and none gets fewer
 * than min_items items: small calls stay on the calling thread.
 * Ranges (shares) are contiguous and fixed by (items, thread count) alone, so each item is computed
 * the same way on any thread; the caller and the workers claim them from a counter, so a worker that
 * wakes late leaves its share to the caller. Workers are kept off the caller's CPU (D-99). One call
 * at a time owns the pool; a call that finds it busy (another Python thread with the GIL released)
 * runs all its items itself rather than wait.
 * fork: the child has none of the workers, so pthread_atfork takes the pool's lock around fork
 * (no call is then in flight) and the child forgets the pool; it starts a new one when needed.
 * A worker that cannot be started leaves its share to the caller: C never fails a kernel for want
 * of threads.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "common.h"

#define FK_MAX_THREADS 256

static struct {
    pthread_mutex_t call;          /* held by the call that owns the pool */
    pthread_mutex_t lock;          /* guards the fields below */
    pthread_cond_t work, done;
    pthread_once_t once;
    int size;                      /* threads a call may use, the caller's included */
    int forced;                    /* FASTKERN_CPU_THREADS was set */
    int workers;                   /* workers started */
    int64_t generation;            /* bumped per job */
    int64_t spawned_at;            /* the generation before the job that started the newest workers */
    int pending;                   /* workers still running the current job */
    int job_threads;               /* threads of the current job (workers 1 .. job_threads - 1) */
    int64_t items;
    fk_range_fn fn;
    void *ctx;
    atomic_int next_share;         /* the current job's next unclaimed share */
    cpu_set_t cpus;                /* the CPUs the process could run on at the pool's start */
    int avoided_cpu;               /* the CPU the workers' affinity leaves out, -1: none */
    pthread_t ids[FK_MAX_THREADS]; /* worker w's thread: ids[w - 1] */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, PTHREAD_ONCE_INIT, .avoided_cpu = -1};

static void run_share(fk_range_fn fn, void *ctx, int64_t items, int share, int shares) {
    int64_t begin = items * share / shares, end = items * (share + 1) / shares;
    if (begin < end) fn(ctx, begin, end);
}

/* Claims the job's shares one at a time until none is left: a worker that wakes late (or never
 * gets a CPU) leaves its share to whoever is free, so a call is never slower than one thread. */
static void run_shares(fk_range_fn fn, void *ctx, int64_t items, int shares) {
    for (int s; (s = atomic_fetch_add(&pool.next_share, 1)) < shares;) run_share(fn, ctx, items, s, shares);
}

static void *worker_main(void *arg) {
    int me = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    int64_t seen = pool.spawned_at; /* the job that started us may already be posted: run it */
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.work, &pool.lock);
        seen = pool.generation;
        if (me >= pool.job_threads) continue;
        fk_range_fn fn = pool.fn;
        void *ctx = pool.ctx;
        int64_t items = pool.items;
        int shares = pool.job_threads;
        pthread_mutex_unlock(&pool.lock);
        run_shares(fn, ctx, items, shares);
        pthread_mutex_lock(&pool.lock);
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

static void before_fork(void) { pthread_mutex_lock(&pool.call); }
static void after_fork_parent(void) { pthread_mutex_unlock(&pool.call); }
static void after_fork_child(void) {
    /* the workers did not come along: forget them (their stacks are lost, a one-off leak) */
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.workers = 0, pool.generation = 0, pool.spawned_at = 0, pool.pending = 0, pool.avoided_cpu = -1;
    pthread_mutex_init(&pool.call, NULL);
}

static void pool_init(void) {
    const char *env = getenv("FASTKERN_CPU_THREADS");
    int size = 0;
    if (env && *env) {
        size = atoi(env);
        pool.forced = size > 0;
    }
    if (sched_getaffinity(0, sizeof pool.cpus, &pool.cpus) != 0) CPU_ZERO(&pool.cpus);
    if (!pool.forced) size = CPU_COUNT(&pool.cpus) > 0 ? CPU_COUNT(&pool.cpus) : 1;
    pool.size = size < 1 ? 1 : size > FK_MAX_THREADS ? FK_MAX_THREADS : size;
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

/* Starts workers up to `want` - 1 (lock held); returns the threads a job can use. */
static int start_workers(int want) {
    pool.spawned_at = pool.generation;
    while (pool.workers < want - 1) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&id, &attr, worker_main, (void *)(intptr_t)(pool.workers + 1));
        pthread_attr_destroy(&attr);
        if (failed) break;
        pool.ids[pool.workers++] = id;
        pool.avoided_cpu = -1; /* the new worker may run anywhere: set every worker's mask again */
    }
    return pool.workers + 1 < want ? pool.workers + 1 : want;
}

/* Keeps the workers off the caller's CPU (lock held). The kernel places a woken worker where it
 * likes, and this VM's scheduler queued it on the caller's own CPU, behind the caller: the two
 * shares then ran one after the other (D-99). Set again only when the caller has moved. */
static void avoid_callers_cpu(void) {
    int cpu = sched_getcpu();
    if (cpu < 0 || cpu == pool.avoided_cpu || CPU_COUNT(&pool.cpus) < 2 || !CPU_ISSET(cpu, &pool.cpus)) return;
    cpu_set_t others = pool.cpus;
    CPU_CLR(cpu, &others);
    for (int w = 0; w < pool.workers; w++) pthread_setaffinity_np(pool.ids[w], sizeof others, &others);
    pool.avoided_cpu = cpu;
}

int fk_parallel_threads(int threads) {
    pthread_once(&pool.once, pool_init);
    return pool.forced ? pool.size : threads < 1 ? 1 : threads < pool.size ? threads : pool.size;
}

void fk_parallel_for(int threads, int64_t items, int64_t min_items, fk_range_fn fn, void *ctx) {
    if (items <= 0) return;
    int t = fk_parallel_threads(threads);
    int64_t most = min_items > 1 ? items / min_items : items;
    if (most < t) t = most < 1 ? 1 : (int)most;
    if (t <= 1 || pthread_mutex_trylock(&pool.call) != 0) {
        for (int s = 0; s < t; s++) run_share(fn, ctx, items, s, t);  /* the same ranges as with threads */
        return;
    }
    pthread_mutex_lock(&pool.lock);
    int got = start_workers(t);
    avoid_callers_cpu();
    pool.fn = fn, pool.ctx = ctx, pool.items = items, pool.job_threads = t;
    atomic_store(&pool.next_share, 0);
    pool.pending = got - 1;
    pool.generation++;
    pthread_cond_broadcast(&pool.work);
    pthread_mutex_unlock(&pool.lock);
    run_shares(fn, ctx, items, t); /* the workers' shares too, where they did not start or come late */
    pthread_mutex_lock(&pool.lock);
    while (pool.pending > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.call);
}
