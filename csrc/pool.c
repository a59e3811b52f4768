#define _GNU_SOURCE
#include "pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 64
#define SPIN_NS 200000 /* a worker spins this long for the next job before sleeping */

/* Chunk states carry the job number, so a late worker can never touch a later job's bookkeeping.
 * CLAIMED: someone computes it; TAKEN: one thread won the right to commit it; DONE: committed. */
#define CLAIMED(job) (((uint64_t)(job) << 2) | 1)
#define TAKEN(job) (((uint64_t)(job) << 2) | 3)
#define DONE(job) (((uint64_t)(job) << 2) | 2)

/* Jobs are described in a ring: a worker that lags behind still reads its own job's description,
 * never a half-written newer one (its claims then fail, since the claim word names the newer job). */
#define RING 8
typedef struct {
    kiln_chunk_fn compute, commit;
    void *ctx;
    int n_chunks;
} job_desc;

struct kiln_pool {
    int n_threads;
    pthread_t threads[MAX_THREADS];
    job_desc ring[RING];    /* written before `job` is bumped */
    _Atomic uint32_t job;   /* job number; workers wait for it to change */
    _Atomic uint64_t claim; /* job << 32 | next unclaimed chunk */
    _Atomic int done;       /* chunks of the current job committed */
    _Atomic uint64_t state[KILN_POOL_MAX_CHUNKS];
    _Atomic int sleepers;
    _Atomic int stop;
    _Atomic uint64_t steals;
    _Atomic int busy[MAX_THREADS]; /* a worker is inside a job (possibly late, about to discard) */
};

int64_t kiln_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
}

/* Claim the next chunk of `job`, or -1 when none is left (or a newer job has started). */
static int claim_chunk(kiln_pool *p, uint32_t job, int n_chunks) {
    uint64_t cur = atomic_load_explicit(&p->claim, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(cur >> 32) != job || (int)(uint32_t)cur >= n_chunks) return -1;
        if (atomic_compare_exchange_weak_explicit(&p->claim, &cur, cur + 1, memory_order_acq_rel,
                                                  memory_order_acquire))
            return (int)(uint32_t)cur;
    }
}

/* Commit a computed chunk if nobody took it over meanwhile. */
static void try_commit(kiln_pool *p, uint32_t job, const job_desc *d, int c, int thread) {
    uint64_t expected = CLAIMED(job);
    if (!atomic_compare_exchange_strong_explicit(&p->state[c], &expected, TAKEN(job), memory_order_acq_rel,
                                                 memory_order_acquire))
        return; /* the caller took it over: this result is thrown away */
    d->commit(d->ctx, c, thread);
    atomic_store_explicit(&p->state[c], DONE(job), memory_order_release);
    atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
}

static void work(kiln_pool *p, uint32_t job, const job_desc *d, int thread) {
    int c;
    while ((c = claim_chunk(p, job, d->n_chunks)) >= 0) {
        atomic_store_explicit(&p->state[c], CLAIMED(job), memory_order_release);
        d->compute(d->ctx, c, thread);
        try_commit(p, job, d, c, thread);
    }
}

typedef struct {
    kiln_pool *pool;
    int index;
} worker_arg;

static void *worker_main(void *arg_) {
    worker_arg arg = *(worker_arg *)arg_;
    free(arg_);
    kiln_pool *p = arg.pool;
    uint32_t seen = atomic_load(&p->job);
    while (!atomic_load_explicit(&p->stop, memory_order_acquire)) {
        uint32_t job = atomic_load_explicit(&p->job, memory_order_acquire);
        if (job == seen) {
            int64_t t0 = kiln_now_ns();
            while ((job = atomic_load_explicit(&p->job, memory_order_acquire)) == seen &&
                   !atomic_load_explicit(&p->stop, memory_order_relaxed)) {
                if (kiln_now_ns() - t0 > SPIN_NS) {
                    atomic_fetch_add(&p->sleepers, 1);
                    if (atomic_load(&p->job) == seen && !atomic_load(&p->stop)) futex_wait(&p->job, seen);
                    atomic_fetch_sub(&p->sleepers, 1);
                    t0 = kiln_now_ns();
                }
                cpu_relax();
            }
            continue;
        }
        seen = job;
        atomic_store_explicit(&p->busy[arg.index], 1, memory_order_seq_cst);
        job_desc d = p->ring[job % RING];
        work(p, job, &d, arg.index);
        atomic_store_explicit(&p->busy[arg.index], 0, memory_order_release);
    }
    return NULL;
}

kiln_pool *kiln_pool_create(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    kiln_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = n_threads;
    for (int i = 1; i < n_threads; i++) {
        worker_arg *arg = malloc(sizeof *arg);
        if (!arg) { p->n_threads = i; break; }
        arg->pool = p;
        arg->index = i;
        if (pthread_create(&p->threads[i], NULL, worker_main, arg) != 0) {
            free(arg);
            p->n_threads = i;
            break;
        }
    }
    return p;
}

void kiln_pool_destroy(kiln_pool *p) {
    if (!p) return;
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->job, 1);
    futex_wake_all(&p->job);
    for (int i = 1; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    free(p);
}

int kiln_pool_threads(const kiln_pool *p) { return p->n_threads; }

void kiln_pool_quiesce(kiln_pool *p) {
    for (int i = 1; i < p->n_threads; i++)
        while (atomic_load_explicit(&p->busy[i], memory_order_acquire)) cpu_relax();
}
uint64_t kiln_pool_steals(const kiln_pool *p) { return atomic_load(&p->steals); }

static _Thread_local int alone;
void kiln_pool_alone(int on) { alone = on; }
int kiln_pool_is_alone(void) { return alone; }

int64_t kiln_pool_run(kiln_pool *p, kiln_chunk_fn compute, kiln_chunk_fn commit, void *ctx, int n_chunks) {
    if (n_chunks <= 0) return 0;
    if (p->n_threads == 1 || alone || n_chunks == 1 || n_chunks > KILN_POOL_MAX_CHUNKS) {
        for (int c = 0; c < n_chunks; c++) compute(ctx, c, 0), commit(ctx, c, 0);
        return 0;
    }
    uint32_t job = atomic_load_explicit(&p->job, memory_order_relaxed) + 1;
    job_desc d = {compute, commit, ctx, n_chunks};
    p->ring[job % RING] = d;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->claim, (uint64_t)job << 32, memory_order_release);
    atomic_store_explicit(&p->job, job, memory_order_release);
    if (atomic_load(&p->sleepers) > 0) futex_wake_all(&p->job);

    /* The caller works like any worker, timing its own chunks to know when a missing one is late. */
    int64_t t0 = kiln_now_ns();
    int mine = 0, c;
    while ((c = claim_chunk(p, job, n_chunks)) >= 0) {
        atomic_store_explicit(&p->state[c], CLAIMED(job), memory_order_release);
        compute(ctx, c, 0);
        try_commit(p, job, &d, c, 0);
        mine++;
    }
    int64_t t_wait = kiln_now_ns();
    int64_t patience = 2 * (mine ? (t_wait - t0) / mine : 20000) + 20000;
    while (atomic_load_explicit(&p->done, memory_order_acquire) < n_chunks) {
        if (kiln_now_ns() - t_wait > patience) {
            for (c = 0; c < n_chunks; c++) {
                uint64_t expected = CLAIMED(job);
                if (!atomic_compare_exchange_strong(&p->state[c], &expected, TAKEN(job))) continue;
                compute(ctx, c, 0);
                commit(ctx, c, 0);
                atomic_store(&p->state[c], DONE(job));
                atomic_fetch_add(&p->done, 1);
                atomic_fetch_add(&p->steals, 1);
            }
        }
        cpu_relax();
    }
    return kiln_now_ns() - t_wait;
}
