/* A thread pool for machines whose other cores may be busy.
 *
 * Work is split into chunks that workers claim from a shared counter; the calling thread claims
 * chunks too, so a job finishes on one core when the others are away. A chunk runs in two phases:
 * `compute` writes only the thread's private scratch, `commit` copies the result to shared buffers.
 * Only the thread that wins the chunk's state (by compare-and-swap) commits. When every chunk is
 * claimed but one stays unfinished — its worker was preempted — the caller takes that chunk over and
 * runs both phases itself instead of waiting out the worker's time slice; the worker, when it
 * resumes, finds the chunk taken and throws its result away. So a late worker never stores into a
 * buffer, whatever the caller has moved on to. */
#pragma once
#include <stdint.h>

#define KILN_POOL_MAX_CHUNKS 16384 /* a job with more chunks runs on the calling thread alone */

typedef void (*kiln_chunk_fn)(void *ctx, int chunk, int thread);

typedef struct kiln_pool kiln_pool;

kiln_pool *kiln_pool_create(int n_threads);
void kiln_pool_destroy(kiln_pool *pool);
int kiln_pool_threads(const kiln_pool *pool);

/* Run compute then commit for every chunk in [0, n_chunks). Returns the nanoseconds the caller spent
 * waiting for other threads (the barrier cost the tracer reports). */
int64_t kiln_pool_run(kiln_pool *pool, kiln_chunk_fn compute, kiln_chunk_fn commit, void *ctx, int n_chunks);

/* Wait until no worker is inside a job: before the memory a job's context points into is freed, since a
 * late worker may still be computing (into its scratch) a chunk it will throw away. */
void kiln_pool_quiesce(kiln_pool *pool);

/* While on, every job this thread runs stays on it, touching no pool's shared state: so engines that share
 * a pool can step at once, a thread each, while no caller uses the pool's workers (scheduler.Turns). */
void kiln_pool_alone(int on);
int kiln_pool_is_alone(void);

/* Chunks the caller took over because their worker stalled. */
uint64_t kiln_pool_steals(const kiln_pool *pool);

int64_t kiln_now_ns(void);
