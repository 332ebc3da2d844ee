/* fk_parallel_for: the CPU kernels' one way to use several cores: the process's OpenMP team where
 * torch has loaded libgomp, else a persistent pool of our own.
 *
 * OpenMP (D-111): torch's CPU ops run on libgomp's team, whose threads poll for ~4-8 ms after each
 * op. On 2 cores a worker of ours then fought one of them for a CPU, and a call after any torch op
 * ran at one thread's speed; on the team they are hot instead. libgomp is found at run time
 * (dlopen with RTLD_NOLOAD): nothing is linked. FASTKERN_CPU_POOL=own keeps our pool, and so does a
 * process forked after this library loaded (libgomp's team does not survive fork: torch's own next
 * parallel op in such a child hangs).
 * Our pool: its workers start once, lazily, on the first call that wants more than one thread (a
 * POSIX thread started per call cost ~10-50 us and a page-faulted stack). After a job a worker polls
 * for the next one for FK_POLL_NS, then sleeps on a condition variable; the caller polls for the
 * job's end as long. An idle vCPU here takes ~20 us to wake: once for the worker, once more for the
 * caller at the end, ~45 us of each 2-thread call before (D-108).
 * Pool size: FASTKERN_CPU_THREADS when set, else the cores this process may run on
 * (sched_getaffinity), at most FK_MAX_THREADS. A call uses min(threads, pool size) threads
 * (threads = torch.get_num_threads() from Python; FASTKERN_CPU_THREADS, when set, replaces it), the
 * caller being one of them, and none gets fewer than min_items items: small calls stay on the
 * calling thread.
 * Ranges (shares) are contiguous and fixed by (items, thread count) alone, so each item is computed
 * the same way on any thread, on either path. The caller and the workers claim shares from a
 * counter tagged with the job, and the caller waits for the shares, not for the workers: a worker
 * that wakes late, or is kept off its CPU, leaves its share to the caller and holds nothing up.
 * Workers are kept off the caller's CPU (D-99). One call at a time owns the pool; a call that finds
 * it busy (another Python thread with the GIL released) runs all its items itself rather than wait.
 * fork: the child has none of the workers, so pthread_atfork (registered when the library loads)
 * takes the pool's lock around fork (no call is then in flight) and the child forgets the pool; it
 * starts a new one when needed.
 * A worker that cannot be started leaves its share to the caller: C never fails a kernel for want
 * of threads.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common.h"

#define FK_MAX_THREADS 256 /* below 2^kShareBits */
#define FK_POLL_NS 200000  /* how long a worker polls for the next job, the caller for the end (D-108) */

enum { kShareBits = 16 }; /* a claim: job << kShareBits | the next unclaimed share */

static struct {
    pthread_mutex_t call;          /* held by the call that owns the pool */
    pthread_mutex_t lock;          /* guards the fields below, but for the atomics' polling */
    pthread_cond_t work, done;
    pthread_once_t once;
    int size;                      /* threads a call may use, the caller's included */
    int forced;                    /* FASTKERN_CPU_THREADS was set */
    int workers;                   /* workers started */
    atomic_llong job;              /* bumped per job */
    long long spawned_at;          /* the job before the one that started the newest workers */
    int job_threads;               /* threads of the current job (workers 1 .. job_threads - 1) */
    int64_t items;
    fk_range_fn fn;
    void *ctx;
    atomic_llong claim;            /* the current job's claims */
    atomic_llong shares_done;      /* shares run to the end, all jobs */
    long long shares_target;       /* shares_done once the current job is done */
    cpu_set_t cpus;                /* the CPUs the process could run on at the pool's start */
    int avoided_cpu;               /* the CPU the workers' affinity leaves out, -1: none */
    pthread_t ids[FK_MAX_THREADS]; /* worker w's thread: ids[w - 1] */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, PTHREAD_ONCE_INIT, .avoided_cpu = -1};

/* The process's OpenMP runtime: libgomp's GOMP_parallel (what `#pragma omp parallel` compiles to)
 * and the team queries; parallel stays NULL where libgomp is not loaded. */
typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned threads, unsigned flags);
static struct {
    pthread_once_t once;
    gomp_parallel_fn parallel;
    int (*thread_num)(void), (*num_threads)(void);
    int forked; /* this process was forked after the library loaded: our pool only */
} omp = {PTHREAD_ONCE_INIT, NULL, NULL, NULL, 0};

static void run_share(fk_range_fn fn, void *ctx, int64_t items, int share, int shares) {
    int64_t begin = items * share / shares, end = items * (share + 1) / shares;
    if (begin < end) fn(ctx, begin, end);
}

/* Runs shares of job `job` as long as some are unclaimed (none once a later job has begun); the one
 * who ends the job's last share wakes the caller, should it sleep. Returns the shares it ran. */
static int run_shares(long long job, fk_range_fn fn, void *ctx, int64_t items, int shares, long long target) {
    int ran = 0;
    long long c = atomic_load(&pool.claim);
    while (c >> kShareBits == job && (c & ((1 << kShareBits) - 1)) < shares) {
        if (!atomic_compare_exchange_weak(&pool.claim, &c, c + 1)) continue; /* c reloaded */
        run_share(fn, ctx, items, (int)(c & ((1 << kShareBits) - 1)), shares);
        ran++;
        if (atomic_fetch_add(&pool.shares_done, 1) + 1 == target) {
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.done);
            pthread_mutex_unlock(&pool.lock);
        }
        c = atomic_load(&pool.claim);
    }
    return ran;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Polls up to FK_POLL_NS until *count >= target; returns whether it got there. */
static int poll_until(atomic_llong *count, long long target) {
    for (int64_t start = now_ns();;) {
        for (int i = 0; i < 256; i++) {
            if (atomic_load_explicit(count, memory_order_acquire) >= target) return 1;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
        if (now_ns() - start > FK_POLL_NS) return 0;
    }
}

static void *worker_main(void *arg) {
    int me = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    long long seen = pool.spawned_at; /* the job that started us may already be posted: run it */
    for (;;) {
        while (atomic_load(&pool.job) == seen) pthread_cond_wait(&pool.work, &pool.lock);
        seen = atomic_load(&pool.job);
        if (me >= pool.job_threads) continue;
        fk_range_fn fn = pool.fn;
        void *ctx = pool.ctx;
        int64_t items = pool.items;
        int shares = pool.job_threads;
        long long target = pool.shares_target;
        pthread_mutex_unlock(&pool.lock);
        /* poll for the next job only if this one found us on time: a worker kept off its CPU (by
         * torch's OpenMP threads, which poll for ms after each op) gets it back sooner when woken */
        if (run_shares(seen, fn, ctx, items, shares, target) > 0) poll_until(&pool.job, seen + 1);
        pthread_mutex_lock(&pool.lock);
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
    pool.workers = 0, pool.avoided_cpu = -1;
    pthread_mutex_init(&pool.call, NULL);
    omp.forked = 1;
}

__attribute__((constructor)) static void register_fork_handlers(void) {
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

static void find_omp(void) {
    void *lib = dlopen("libgomp.so.1", RTLD_NOLOAD | RTLD_LAZY);
    if (!lib) return;
    omp.thread_num = (int (*)(void))dlsym(lib, "omp_get_thread_num");
    omp.num_threads = (int (*)(void))dlsym(lib, "omp_get_num_threads");
    gomp_parallel_fn parallel = (gomp_parallel_fn)dlsym(lib, "GOMP_parallel");
    if (omp.thread_num && omp.num_threads) omp.parallel = parallel;
}

/* Shall this call run on the OpenMP team? */
static int use_omp(void) {
    pthread_once(&omp.once, find_omp);
    const char *want = getenv("FASTKERN_CPU_POOL");
    return omp.parallel && !omp.forked && !(want && !strcmp(want, "own"));
}

typedef struct {
    fk_range_fn fn;
    void *ctx;
    int64_t items;
    int shares;
} omp_job;

/* One team thread's shares (the team may have fewer threads than shares). */
static void run_omp_shares(void *arg) {
    const omp_job *j = (const omp_job *)arg;
    for (int s = omp.thread_num(), step = omp.num_threads(); s < j->shares; s += step)
        run_share(j->fn, j->ctx, j->items, s, j->shares);
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
}

/* Starts workers up to `want` - 1 (lock held). */
static void start_workers(int want) {
    pool.spawned_at = atomic_load(&pool.job);
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
    if (t > 1 && use_omp()) {
        omp_job j = {fn, ctx, items, t};
        omp.parallel(run_omp_shares, &j, (unsigned)t, 0);
        return;
    }
    if (t <= 1 || pthread_mutex_trylock(&pool.call) != 0) {
        for (int s = 0; s < t; s++) run_share(fn, ctx, items, s, t);  /* the same ranges as with threads */
        return;
    }
    pthread_mutex_lock(&pool.lock);
    start_workers(t);
    avoid_callers_cpu();
    long long job = atomic_load(&pool.job) + 1, target = atomic_load(&pool.shares_done) + t;
    pool.fn = fn, pool.ctx = ctx, pool.items = items, pool.job_threads = t, pool.shares_target = target;
    atomic_store(&pool.claim, job << kShareBits);
    atomic_store(&pool.job, job);
    pthread_cond_broadcast(&pool.work);
    pthread_mutex_unlock(&pool.lock);
    run_shares(job, fn, ctx, items, t, target); /* the workers' shares too, where they come late */
    if (!poll_until(&pool.shares_done, target)) {
        pthread_mutex_lock(&pool.lock);
        while (atomic_load(&pool.shares_done) < target) pthread_cond_wait(&pool.done, &pool.lock);
        pthread_mutex_unlock(&pool.lock);
    }
    pthread_mutex_unlock(&pool.call);
}
