/* What the op families (op_rows.c, op_matmul.c, op_attn.c, op_logits.c, op_conv.c, op_moe.c, op_delta.c) share with the executor
 * (plan.c) and the plan checks (plan_check.c): each family's entry points, a chunk's context, the
 * thread's scratch and the helpers several families use.
 *
 * Each family exports, per op kind it runs:
 *   kiln_<family>_scratch(op, rows, out_rows)  floats of per-thread scratch the op needs for a plan of
 *                                              `rows` rows, `out_rows` of them with logits
 *   kiln_<family>_bounds(op, b)                the bytes the op touches, checked against the buffers
 *                                              the plan was handed (plan_check.c)
 *   kiln_<family>_run(p, j)                    the op over the step's rows */
#pragma once
#include <math.h>
#include <string.h>

#include "act.h"
#include "plan.h"

/* A chunk function's context lives in the plan, not on the stack: a late worker may still read it
 * (and throw its result away) after the op that launched it has returned. */
typedef kiln_job job;

/* The thread's scratch for the job's op. Guarded, it is exactly the floats the op's family asked for,
 * ending where the thread's guard bytes begin, so any write past them is caught (plan.c). */
static inline float *scratch(const job *j, int thread) {
    const kiln_plan *p = j->plan;
    float *s = p->scratch + (size_t)thread * p->scratch_stride;
    if (!p->guard) return s;
    return s + KILN_GUARD_FLOATS + (p->scratch_floats - p->op_scratch[j->op - p->ops]);
}

/* ---- the checks each family's bounds call (plan_check.c) ---- */
struct kiln_bounds {
    const kiln_plan *plan; /* max_rows, max_out, n_ctx, n_slots */
    const kiln_region *regions;
    int n_regions;
    const kiln_wmat *const *mats;
    int n_mats;
    int op;
    char *err;
    size_t err_len;
    int failed;
};
/* `bytes` at `ptr` (field `field` of the op) lie inside one buffer the plan was handed */
void kiln_need(kiln_bounds *b, const char *field, const void *ptr, size_t bytes);
/* `w` is a matrix the plan was handed, of rows x cols */
void kiln_need_wmat(kiln_bounds *b, const char *field, const kiln_wmat *w, int rows, int cols);
/* act[k] holds n_tok rows of the layout `w` consumes */
void kiln_need_act(kiln_bounds *b, int k, const kiln_wmat *w, int n_tok);
/* a product's scale is finite and not 0 (an op laid out without one) */
void kiln_need_scale(kiln_bounds *b, float scale);
/* a shape the op cannot run (printf-style reason); returns 0 so a family can stop there */
int kiln_bounds_fail(kiln_bounds *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- the families ---- */
size_t kiln_embed_scratch(const kiln_op *op, int rows, int out_rows);
void kiln_embed_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_embed_run(kiln_plan *p, job *j);
size_t kiln_quant_scratch(const kiln_op *op, int rows, int out_rows);
void kiln_quant_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_quant_run(kiln_plan *p, job *j);
void kiln_norm_add_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_norm_add_run(kiln_plan *p, job *j);

size_t kiln_matmul_scratch(const kiln_op *op, int rows, int out_rows);
void kiln_matmul_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_matmul_run(kiln_plan *p, job *j);
size_t kiln_glu_scratch(const kiln_op *op, int rows, int out_rows);
void kiln_glu_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_glu_run(kiln_plan *p, job *j);
/* out[i] = act(g[i]) * u[i] (ACT_*), the same bits wherever a row is cut */
void kiln_glu_row(int kind, const float *g, const float *u, float *out, int n);
/* x[i] = act(x[i]) in place (ACT_SILU or ACT_GELU_TANH), the same bits wherever a row is cut */
void kiln_act_row(int kind, float *x, int n);

size_t kiln_qkv_scratch(const kiln_op *op, int rows, int out_rows);
void kiln_qkv_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_qkv_run(kiln_plan *p, job *j);
size_t kiln_attn_scratch(const kiln_op *op, int rows, int out_rows);
void kiln_attn_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_attn_run(kiln_plan *p, job *j);
void kiln_attention_blocks(kiln_plan *p, int n_rows);

size_t kiln_logits_scratch(const kiln_op *op, int rows, int out_rows);
void kiln_logits_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_logits_run(kiln_plan *p, job *j);

void kiln_shortconv_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_shortconv_run(kiln_plan *p, job *j);

size_t kiln_delta_net_scratch(const kiln_op *op, int rows, int out_rows);
void kiln_delta_net_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_delta_net_run(kiln_plan *p, job *j);
/* One value head's state update and read for one row (op_delta.c's head_row, delta_avx2.c): S [dk][dv]
 * decays and moves toward v along k; delta takes the update's dv values, out the read Sᵀq. */
void kiln_delta_head_avx2(float *S, const float *q, const float *k, const float *v, float decay, float rate, int dk,
                          int dv, float *delta, float *out);
void kiln_sigmoid_gate_avx2(float *y, const float *x, const float *z, int n);
void kiln_gate_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_gate_run(kiln_plan *p, job *j);

/* ---- helpers several families use ---- */

/* The sum of squares runs in 8 lanes, added in a fixed tree: the compiler vectorizes it, where one running
 * sum is a chain of dependent adds, and every ISA gets the same bits. */
static inline void rmsnorm(const float *x, const float *w, float eps, int n, float *out) {
    float lane[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) lane[k] += x[i + k] * x[i + k];
    for (; i < n; i++) lane[i & 7] += x[i] * x[i];
    float ss = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    float inv = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = (x[i] * inv) * w[i];
}

/* LayerNorm: the mean subtracted, then RMSNorm's arithmetic on what is left, and the bias added. */
static inline void layernorm(const float *x, const float *w, const float *b, float eps, int n, float *out) {
    float lane[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) lane[k] += x[i + k];
    for (; i < n; i++) lane[i & 7] += x[i];
    float mean = (((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]))) / n;
    for (int i = 0; i < n; i++) out[i] = x[i] - mean;
    rmsnorm(out, w, eps, n, out);
    for (int i = 0; i < n; i++) out[i] += b[i];
}

/* A precise activation is two int8 rows per token, x ≈ q1·d1 + q2·d2 with the second row quantizing
 * what the first missed: about 15 bits instead of 8, for the matrices whose inputs int8 hurts most.
 * The n tokens' first rows come first, then their n second rows, so a matmul takes them as 2n tokens
 * and reads the weights once, and the output head can take the first rows alone (op_logits.c).
 * Float formats take fp32 activations, which need no second row. */
static inline int paired(const kiln_op *op, const kiln_wmat *w) { return op->precise && kiln_act_kind(w->fmt) == KILN_ACT_Q8; }

/* Rows of a matmul's activation: two per token when they are precise. */
static inline int act_rows(const kiln_op *op, const kiln_wmat *w, int n) { return paired(op, w) ? 2 * n : n; }

/* Fold the results of precise activations: y[t] += y[n_tok + t], n values of rows ld apart. */
static inline void fold_pairs(const kiln_op *op, const kiln_wmat *w, float *y, int n_tok, int n, int ld) {
    if (!paired(op, w)) return;
    for (int t = 0; t < n_tok; t++)
        for (int i = 0; i < n; i++) y[(size_t)t * ld + i] += y[(size_t)(n_tok + t) * ld + i];
}

static inline int n_tiles(const kiln_wmat *w) { return w->rows_padded / 4; }

/* Chunks of a matrix op: chunk_tiles tiles each. */
static inline int chunks_of(const kiln_op *op) { return (n_tiles(op->w) + op->chunk_tiles - 1) / op->chunk_tiles; }

/* Rows [r0, r1) of one matrix for every token, into `y` (n_rows × (r1 - r0)). */
static inline void matmul_rows(const kiln_wmat *w, const void *act, int n_rows, float *y, int r0, int r1) {
    kiln_matmul(w, act, n_rows, y - r0, r1 - r0, r0 / 4, (r1 + 3) / 4);
}

/* Before an op's chunks run: on AMX with enough rows, its activation k as bf16 tiles for the integer
 * matrices a, b and c (NULL: none) in the plan's amx_tiles, else j->tiles = NULL (plan.c). */
void kiln_job_tiles(kiln_plan *p, job *j, int k, const kiln_wmat *a, const kiln_wmat *b, const kiln_wmat *c);

/* Rows [r0, r1) of w times the op's activation k for the job's n rows, into y[t * ldy + r - r0]: on the
 * job's bf16 tiles when it has them for k, else kiln_matmul (precise pairs folded). */
static inline void job_matmul(const job *j, const kiln_wmat *w, int k, int n, float *y, int ldy, int r0, int r1) {
#if KILN_X86
    if (j->tiles && j->tiles_act == k && kiln_matmul_bf16(w, j->tiles, n, y - r0, ldy, r0 / 4, (r1 + 3) / 4) == 0) return;
#endif
    kiln_matmul(w, j->op->act[k], act_rows(j->op, w, n), y - r0, ldy, r0 / 4, (r1 + 3) / 4);
    fold_pairs(j->op, w, y, n, r1 - r0, ldy);
}

/* Rows [r0, r1) of the op's output that chunk c produces. */
static inline void chunk_rows(const kiln_op *op, int c, int *r0, int *r1) {
    *r0 = c * op->chunk_tiles * 4;
    *r1 = *r0 + op->chunk_tiles * 4 < op->rows ? *r0 + op->chunk_tiles * 4 : op->rows;
}

/* Copy a chunk's result (n_rows × (r1 - r0), in scratch) into rows [r0, r1) of `out`. */
static inline void commit_rows(const job *j, float *out, int ld, int n_rows, int c, int thread) {
    int r0, r1;
    chunk_rows(j->op, c, &r0, &r1);
    const float *y = scratch(j, thread);
    for (int t = 0; t < n_rows; t++)
        memcpy(out + (size_t)t * ld + r0, y + (size_t)t * (r1 - r0), sizeof(float) * (r1 - r0));
}

size_t kiln_moe_scratch(const kiln_op *op, int rows, int out_rows);
void kiln_moe_bounds(const kiln_op *op, kiln_bounds *b);
int64_t kiln_moe_run(kiln_plan *p, job *j);
/* The int32s of an OP_MOE's routing buffer (moe_route) for a plan of `rows` rows (op_moe.c lays it out). */
size_t kiln_moe_route_ints(const kiln_op *op, int rows);
