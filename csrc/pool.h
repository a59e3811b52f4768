/* A thread pool for machines whose other cores may be busy.
 *
 * Work is split into chunks that workers claim from a shared counter; the calling thread claims chunks
 * too, so a job finishes on one core when the others are away. With `stealable` jobs, chunks must be
 * idempotent (they store only final values, never read what they write): when every chunk is claimed
 * but one stays unfinished — its worker was preempted — the caller runs that chunk itself instead of
 * waiting out the worker's time slice. A late worker then stores the same bits again, which is harmless
 * as long as the buffers it writes are not reused until `kiln_pool_fence` says it has left. */
#pragma once
#include <stdint.h>

typedef void (*kiln_chunk_fn)(void *ctx, int chunk, int thread);

typedef struct kiln_pool kiln_pool;

kiln_pool *kiln_pool_create(int n_threads);
void kiln_pool_destroy(kiln_pool *pool);
int kiln_pool_threads(const kiln_pool *pool);

/* Run fn(ctx, c, thread) for c in [0, n_chunks). Returns nanoseconds the caller spent waiting for
 * other threads (the barrier cost the tracer reports). */
int64_t kiln_pool_run(kiln_pool *pool, kiln_chunk_fn fn, void *ctx, int n_chunks, int stealable);

/* Begin a new epoch (one engine step). Returns nanoseconds spent waiting until no worker is still
 * inside a chunk of an epoch older than `min_epoch`. */
int64_t kiln_pool_fence(kiln_pool *pool, uint64_t min_epoch);
uint64_t kiln_pool_epoch(const kiln_pool *pool);
void kiln_pool_next_epoch(kiln_pool *pool);

/* Counters for diagnosis: chunks the caller re-ran because their worker stalled. */
uint64_t kiln_pool_steals(const kiln_pool *pool);

int64_t kiln_now_ns(void);
