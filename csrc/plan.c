/* The plan executor: walks the op list once per step. Small ops run on the calling thread; the
 * matrix and attention ops are split into chunks for the pool, each computed into the thread's
 * scratch and then committed, which is what lets the pool take over a chunk whose worker was
 * preempted (see pool.h). */
#include "plan.h"

#include <errno.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

#include "act.h"
#include "attn.h"
#include "dequant.h"
#include "vecmath.h"

#if defined(KILN_X86)
/* The tail goes through the same vector math (padded), so a value never depends on where a chunk
 * boundary falls — results stay identical for any thread count. */
AVX2 static __m256 glu8(int kind, __m256 g, __m256 u) {
    return _mm256_mul_ps(kind == ACT_SILU ? silu256(g) : gelu_tanh256(g), u);
}

AVX2 static void glu_row_avx2(int kind, const float *g, const float *u, float *out, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, glu8(kind, _mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < n) {
        float gt[8] = {0}, ut[8] = {0}, ot[8];
        memcpy(gt, g + i, sizeof(float) * (n - i));
        memcpy(ut, u + i, sizeof(float) * (n - i));
        _mm256_storeu_ps(ot, glu8(kind, _mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
        memcpy(out + i, ot, sizeof(float) * (n - i));
    }
}
#endif

/* A chunk function's context lives in the plan, not on the stack: a late worker may still read it
 * (and throw its result away) after the op that launched it has returned. */
typedef kiln_job job;

static float *scratch(const kiln_plan *p, int thread) { return p->scratch + (size_t)thread * p->scratch_floats; }

/* The sum of squares runs in 8 lanes, added in a fixed tree: the compiler vectorizes it, where one running
 * sum is a chain of dependent adds (576 of them per SmolLM2 row), and every ISA gets the same bits. */
static void rmsnorm(const float *x, const float *w, float eps, int n, float *out) {
    float lane[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) lane[k] += x[i + k] * x[i + k];
    for (; i < n; i++) lane[i & 7] += x[i] * x[i];
    float ss = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    float inv = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = (x[i] * inv) * w[i];
}

static void rope(float *x, const kiln_rope *r, int pos) {
    int half = r->dim / 2;
    const float *c = r->cos + (size_t)pos * half, *s = r->sin + (size_t)pos * half;
    for (int i = 0; i < half; i++) {
        int ia = r->neox ? i : 2 * i, ib = r->neox ? i + half : 2 * i + 1;
        float a = x[ia], b = x[ib];
        x[ia] = a * c[i] - b * s[i];
        x[ib] = b * c[i] + a * s[i];
    }
}

static float activate(int kind, float x) {
    if (kind == ACT_SILU) return x / (1.0f + expf(-x));
    return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}

/* out[i] = act(g[i]) * u[i]; the activation's exp is the only transcendental on the prefill path */
static void glu_row(int kind, const float *g, const float *u, float *out, int n) {
#if defined(KILN_X86)
    if (kiln_active_isa() >= ISA_AVX2) {
        glu_row_avx2(kind, g, u, out, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++) out[i] = activate(kind, g[i]) * u[i];
}

/* A precise activation is two int8 rows per token, x ≈ q1·d1 + q2·d2 with the second row quantizing
 * what the first missed: about 15 bits instead of 8, for the matrices whose inputs int8 hurts most.
 * The n tokens' first rows come first, then their n second rows, so a matmul takes them as 2n tokens
 * and reads the weights once, and the output head can take the first rows alone (see refine_compute).
 * kiln_quantize_act_pair forms both rows. */

static int precise_kind(const kiln_op *op, int k) { return op->precise && kiln_act_kind(op->act_fmt[k]) == KILN_ACT_Q8; }

/* Rows a quantize op writes: the final norm only the rows whose logits are wanted (gathered). */
static int quant_rows(const kiln_op *op, int n_rows, int n_out) { return op->select_rows ? n_out : n_rows; }

static const float *quant_input(const kiln_plan *p, const kiln_op *op, int i) {
    int t = op->select_rows ? p->row_sel[i] : i;
    return op->in + (size_t)t * op->cols;
}

/* Row i of a quantize op (n rows) into its destinations: the normalized row `norm_out` (NORM_QUANT),
 * then per activation kind the quantized row, and a precise kind's second row. */
static void quantize_row(const kiln_plan *p, const kiln_op *op, int i, float *norm_out, uint8_t *const *dst,
                         uint8_t *const *dst2, float *residual) {
    const float *x = quant_input(p, op, i);
    if (op->kind == OP_NORM_QUANT) {
        rmsnorm(x, op->norm_w, op->eps, op->cols, norm_out);
        x = norm_out;
    }
    for (int k = 0; k < op->n_act; k++) {
        if (precise_kind(op, k))
            kiln_quantize_act_pair(op->act_fmt[k], x, op->cols, dst[k], dst2[k], residual);
        else
            kiln_quantize_act(op->act_fmt[k], x, op->cols, op->cols, 1, dst[k]);
    }
}

/* Where row i of n goes in the shared buffers. */
static void quant_targets(const kiln_op *op, int i, int n, uint8_t **dst, uint8_t **dst2) {
    for (int k = 0; k < op->n_act; k++) {
        size_t stride = kiln_act_stride(op->act_fmt[k], op->cols);
        dst[k] = (uint8_t *)op->act[k] + (size_t)i * stride;
        dst2[k] = (uint8_t *)op->act[k] + (size_t)(n + i) * stride;
    }
}

/* On the pool, a row per chunk: compute quantizes into the thread's scratch (the normalized row, a
 * residual row, then each kind's row(s)), commit copies the bytes out. */
static void quant_scratch_targets(const kiln_op *op, float *s, float **norm_out, float **residual, uint8_t **dst,
                                  uint8_t **dst2) {
    *norm_out = s, *residual = s + op->cols;
    uint8_t *b = (uint8_t *)(s + 2 * (size_t)op->cols);
    for (int k = 0; k < op->n_act; k++) {
        size_t stride = kiln_act_stride(op->act_fmt[k], op->cols);
        dst[k] = b, b += stride;
        dst2[k] = b;
        if (precise_kind(op, k)) b += stride;
    }
}

static void quant_compute(void *ctx, int i, int thread) {
    const job *j = ctx;
    float *norm_out, *residual;
    uint8_t *dst[MAX_ACTS], *dst2[MAX_ACTS];
    quant_scratch_targets(j->op, scratch(j->plan, thread), &norm_out, &residual, dst, dst2);
    quantize_row(j->plan, j->op, i, norm_out, dst, dst2, residual);
}

static void quant_commit(void *ctx, int i, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    float *norm_out, *residual;
    uint8_t *src[MAX_ACTS], *src2[MAX_ACTS], *dst[MAX_ACTS], *dst2[MAX_ACTS];
    quant_scratch_targets(op, scratch(j->plan, thread), &norm_out, &residual, src, src2);
    quant_targets(op, i, quant_rows(op, j->n_rows, j->n_out), dst, dst2);
    if (op->kind == OP_NORM_QUANT) memcpy(op->out + (size_t)i * op->cols, norm_out, sizeof(float) * op->cols);
    for (int k = 0; k < op->n_act; k++) {
        size_t stride = kiln_act_stride(op->act_fmt[k], op->cols);
        memcpy(dst[k], src[k], stride);
        if (precise_kind(op, k)) memcpy(dst2[k], src2[k], stride);
    }
}

/* A row costs ~1.5 µs (3 µs precise, 576 wide): from this many rows the pool's start-up pays off. */
#define POOL_QUANT_ROWS 4

static int64_t quantize_op(const kiln_plan *p, const kiln_op *op, job *j) {
    int n = quant_rows(op, j->n_rows, j->n_out);
    if (n >= POOL_QUANT_ROWS) return kiln_pool_run(p->pool, quant_compute, quant_commit, j, n);
    uint8_t *dst[MAX_ACTS], *dst2[MAX_ACTS];
    for (int i = 0; i < n; i++) {
        quant_targets(op, i, n, dst, dst2);
        quantize_row(p, op, i, op->kind == OP_NORM_QUANT ? op->out + (size_t)i * op->cols : NULL, dst, dst2,
                     scratch(p, 0));
    }
    return 0;
}

/* Float formats take fp32 activations, which need no second row. */
static int paired(const kiln_op *op, const kiln_wmat *w) { return op->precise && kiln_act_kind(w->fmt) == KILN_ACT_Q8; }

/* Rows of a matmul's activation: two per token when they are precise. */
static int act_rows(const kiln_op *op, const kiln_wmat *w, int n) { return paired(op, w) ? 2 * n : n; }

/* Fold the results of precise activations: y[t] += y[n_tok + t], n values of rows ld apart. */
static void fold_pairs(const kiln_op *op, const kiln_wmat *w, float *y, int n_tok, int n, int ld) {
    if (!paired(op, w)) return;
    for (int t = 0; t < n_tok; t++)
        for (int i = 0; i < n; i++) y[(size_t)t * ld + i] += y[(size_t)(n_tok + t) * ld + i];
}

static int n_tiles(const kiln_wmat *w) { return w->rows_padded / 4; }

/* Rows [r0, r1) of one matrix for every token, into `y` (n_rows × (r1 - r0)). */
static void matmul_rows(const kiln_wmat *w, const void *act, int n_rows, float *y, int r0, int r1) {
    kiln_matmul(w, act, n_rows, y - r0, r1 - r0, r0 / 4, (r1 + 3) / 4);
}

/* The KV cache is head-major, [slot][kv head][n_ctx × head_dim], so attention streams each head's keys
 * and values contiguously (keys in the transposed groups attn.h describes). */
static size_t head_offset(const kiln_plan *p, const kiln_op *op, int slot, int head) {
    return ((size_t)slot * op->n_kv_heads + head) * p->n_ctx * op->head_dim;
}

/* Each parallel op is a compute phase, which writes only the thread's scratch (its result first),
 * and a commit phase, which copies that result to the shared buffers (see pool.h). */

/* The q, k and v heads form one list (q heads, then k, then v); a chunk is `chunk_heads` consecutive
 * heads of it, and its heads of one matrix are one run of rows, multiplied in one streaming pass. */
static int qkv_heads(const kiln_op *op) { return op->n_heads + 2 * op->n_kv_heads; }

static void qkv_head(const kiln_op *op, int h, int *which, int *head) {
    int H = op->n_heads, KV = op->n_kv_heads;
    *which = h < H ? 0 : h < H + KV ? 1 : 2;
    *head = *which == 0 ? h : *which == 1 ? h - H : h - H - KV;
}

/* Several heads a chunk stream longer runs of a matrix, which pays while a step reads memory (one or two
 * rows); with more rows it computes, and a chunk a head leaves the threads less to wait for at the end. */
static int qkv_chunk_heads(const job *j) { return j->n_rows > 2 ? 1 : j->op->chunk_heads; }

/* Chunks shrink towards the end of the list (`per` heads while more than 2 * per remain, then half of
 * what remains), so the thread that finishes first waits for a small chunk, not a long one: with four
 * chunks of 8 heads, the Qwen3-0.6B shape's decode waited 22 us a layer at this op's end. */
static int qkv_next_size(int remaining, int per) {
    if (remaining > 2 * per) return per;
    return remaining > 1 ? remaining / 2 : remaining;
}

int kiln_qkv_chunks(int heads, int per) {
    int c = 0;
    for (int h = 0; h < heads; c++) h += qkv_next_size(heads - h, per);
    return c;
}

static int qkv_chunks(const job *j) { return kiln_qkv_chunks(qkv_heads(j->op), qkv_chunk_heads(j)); }

/* Heads [h0, h1) of chunk c, of the list above (empty for a late worker's chunk past a newer run's). */
static void qkv_chunk(const job *j, int c, int *h0, int *h1) {
    int n = qkv_heads(j->op), per = qkv_chunk_heads(j), h = 0;
    for (int i = 0; i < c && h < n; i++) h += qkv_next_size(n - h, per);
    *h0 = h;
    *h1 = h < n ? h + qkv_next_size(n - h, per) : n;
}

/* A chunk's result in scratch: row t's heads side by side, y[t * width + (h - h0) * hd + i]. */
static void qkv_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const kiln_plan *p = j->plan;
    int hd = op->head_dim, h0, h1, n = j->n_rows;
    qkv_chunk(j, c, &h0, &h1);
    int width = (h1 - h0) * hd;
    float *y = scratch(p, thread), *tmp = y + (size_t)2 * n * width;
    for (int h = h0; h < h1;) {
        int which, head, which_end, head_end, e = h + 1;
        qkv_head(op, h, &which, &head);
        while (e < h1 && (qkv_head(op, e, &which_end, &head_end), which_end == which)) e++;
        const kiln_wmat *w = which == 0 ? op->wq : which == 1 ? op->wk : op->wv;
        const void *act = op->act[which == 0 ? op->q_act : which == 1 ? op->k_act : op->v_act];
        int r0 = head * hd, r1 = r0 + (e - h) * hd, off = (h - h0) * hd;
        kiln_matmul(w, act, act_rows(op, w, n), y + off - r0, width, r0 / 4, (r1 + 3) / 4);
        fold_pairs(op, w, y + off, n, r1 - r0, width);
        const float *bias = which == 0 ? op->bq : which == 1 ? op->bk : op->bv;
        const kiln_norm *norm = which == 0 ? &op->qnorm : &op->knorm;
        for (int t = 0; t < n; t++)
            for (int k = 0; k < e - h; k++) {
                float *row = y + (size_t)t * width + off + k * hd;
                if (bias)
                    for (int i = 0; i < hd; i++) row[i] += bias[r0 + k * hd + i];
                if (which == 2) continue;
                if (norm->weight) {
                    rmsnorm(row, norm->weight, norm->eps, hd, tmp);
                    memcpy(row, tmp, sizeof(float) * hd);
                }
                rope(row, &op->rope, p->positions[t]);
            }
        h = e;
    }
}

static void qkv_commit(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const kiln_plan *p = j->plan;
    int hd = op->head_dim, h0, h1;
    qkv_chunk(j, c, &h0, &h1);
    int width = (h1 - h0) * hd;
    const float *y = scratch(p, thread);
    for (int h = h0; h < h1; h++) {
        int which, head;
        qkv_head(op, h, &which, &head);
        for (int t = 0; t < j->n_rows; t++) {
            const float *row = y + (size_t)t * width + (h - h0) * hd;
            size_t base = head_offset(p, op, p->slots[t], head);
            if (which == 0)
                memcpy(op->q + (size_t)t * op->n_heads * hd + (size_t)head * hd, row, sizeof(float) * hd);
            else if (which == 1)
                kiln_store_key(row, op->k_cache + base, p->positions[t], hd);
            else
                kiln_store_half(row, op->v_cache + base + (size_t)p->positions[t] * hd, hd);
        }
    }
}

/* Attention is split three ways for the pool: a block of rows (one sequence's consecutive positions),
 * a KV head, and a part of the context: keys [k*ATTN_SPAN, (k+1)*ATTN_SPAN). The parts let both threads
 * share a long context when there are fewer KV heads than chunks would balance (SmolLM2: 3 KV heads on
 * 2 threads). Where a part ends depends on positions alone, never on the batch or the threads, so a
 * row's result does not either. A chunk computes its part's unnormalized output, running max and sum
 * (kiln_attend_part) and commits them to plan->attn_partial; the caller merges the parts in order. */

/* A block's keys: from its first visible key to its last row's position. */
static void block_keys(const kiln_plan *p, const kiln_op *op, int b, int *first, int *last) {
    int t0 = p->blocks[2 * b], pos0 = p->positions[t0];
    *first = op->window > 0 && pos0 - op->window + 1 > 0 ? pos0 - op->window + 1 : 0;
    *last = pos0 + p->blocks[2 * b + 1] - 1;
}

static int block_parts(const kiln_plan *p, const kiln_op *op, int b) {
    int first, last;
    block_keys(p, op, b, &first, &last);
    return last / ATTN_SPAN - first / ATTN_SPAN + 1;
}

/* Lay out this op's chunks (block, head, part) and their partial results; returns the chunk count. */
static int attention_units(kiln_plan *p, const kiln_op *op) {
    int units = 0;
    size_t floats = 0, per_query = (size_t)op->head_dim + 2;
    for (int b = 0; b < p->n_blocks; b++) {
        int parts = block_parts(p, op, b), rows = p->blocks[2 * b + 1];
        p->attn_unit0[b] = units, p->attn_floats0[b] = floats;
        units += op->n_kv_heads * parts;
        floats += (size_t)op->n_heads * parts * rows * per_query;
    }
    p->attn_unit0[p->n_blocks] = units;
    return units;
}

/* Where part k of KV head g of block b (parts parts, nq queries) keeps its (o, m, l). */
static float *attn_partial_of(const kiln_plan *p, const kiln_op *op, int b, int g, int k, int parts, int nq) {
    return p->attn_partial + p->attn_floats0[b] + ((size_t)g * parts + k) * nq * (op->head_dim + 2);
}

typedef struct {
    int b, g, part, t0, rows, key_lo, key_hi, first, pos0;
    float *partial; /* o (rows*group*hd), then m and l (rows*group each) */
} attn_chunk;

/* Chunk c of this op. A late worker may read a newer op's layout: every field is clamped to the step's
 * blocks, so it computes garbage into its own scratch, never outside (pool.h). */
static int attn_chunk_of(const kiln_plan *p, const kiln_op *op, int c, attn_chunk *a) {
    int b = 0;
    while (b + 1 < p->n_blocks && p->attn_unit0[b + 1] <= c) b++;
    int parts = block_parts(p, op, b), within = c - p->attn_unit0[b];
    if (within < 0 || within >= op->n_kv_heads * parts) return 0;
    int last, group = op->n_heads / op->n_kv_heads, nq;
    a->b = b, a->g = within / parts, a->part = within % parts;
    a->t0 = p->blocks[2 * b], a->rows = p->blocks[2 * b + 1], a->pos0 = p->positions[a->t0];
    block_keys(p, op, b, &a->first, &last);
    a->key_lo = (a->first / ATTN_SPAN + a->part) * ATTN_SPAN, a->key_hi = a->key_lo + ATTN_SPAN;
    nq = a->rows * group;
    a->partial = attn_partial_of(p, op, b, a->g, a->part, parts, nq);
    return 1;
}

/* The first keys chunk c reads (NULL past the op's chunks). The chunk before it prefetches them with its
 * last tile, in place of that tile's prefetch past the context's end: the pool hands chunks out in order,
 * so the next chunk starts on this core or the other, not from memory. A short context is one tile, so
 * this is most of what a decode step's attention prefetches for its keys (SmolLM2, 8 sequences at
 * positions 20-68: attention 1.98 -> 1.45 ms a step, medians of 4 alternating runs). A late worker's
 * pointer may belong to a newer op: it only feeds a prefetch. */
static const uint16_t *chunk_first_keys(const kiln_plan *p, const kiln_op *op, int c) {
    attn_chunk a;
    if (c >= p->attn_unit0[p->n_blocks] || !attn_chunk_of(p, op, c, &a)) return NULL;
    int first = a.first > a.key_lo ? a.first : a.key_lo;
    return op->k_cache + head_offset(p, op, p->slots[a.t0], a.g) + (size_t)(first / KEY_GROUP) * KEY_GROUP * op->head_dim;
}

static void attn_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const kiln_plan *p = j->plan;
    attn_chunk a;
    if (!attn_chunk_of(p, op, c, &a)) return;
    int hd = op->head_dim, group = op->n_heads / op->n_kv_heads, q_dim = op->n_heads * hd, nq = a.rows * group;
    size_t base = head_offset(p, op, p->slots[a.t0], a.g);
    float *o = scratch(p, thread), *m = o + (size_t)nq * hd, *l = m + nq, *work = l + nq;
    kiln_attend_part(op->q + (size_t)a.t0 * q_dim + (size_t)a.g * group * hd, a.rows, group, hd, q_dim,
                     op->k_cache + base, op->v_cache + base, a.first, a.pos0, op->window, a.key_lo, a.key_hi,
                     op->scale, chunk_first_keys(p, op, c + 1), work, o, m, l);
}

static void attn_commit(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const kiln_plan *p = j->plan;
    attn_chunk a;
    if (!attn_chunk_of(p, op, c, &a)) return;
    int nq = a.rows * (op->n_heads / op->n_kv_heads);
    memcpy(a.partial, scratch(p, thread), sizeof(float) * (size_t)nq * (op->head_dim + 2));
}

/* Every query's parts, merged in order into op->out. */
static void attention_merge(const kiln_plan *p, const kiln_op *op) {
    int hd = op->head_dim, group = op->n_heads / op->n_kv_heads, q_dim = op->n_heads * hd;
    for (int b = 0; b < p->n_blocks; b++) {
        int parts = block_parts(p, op, b), t0 = p->blocks[2 * b], rows = p->blocks[2 * b + 1], nq = rows * group;
        const float *o[parts], *m[parts], *l[parts];
        for (int g = 0; g < op->n_kv_heads; g++)
            for (int r = 0; r < nq; r++) {
                for (int k = 0; k < parts; k++) {
                    const float *part = attn_partial_of(p, op, b, g, k, parts, nq);
                    o[k] = part + (size_t)r * hd, m[k] = part + (size_t)nq * hd + r, l[k] = part + (size_t)nq * (hd + 1) + r;
                }
                int i = r / group, h = g * group + r % group;
                kiln_attend_merge(parts, o, m, l, hd, op->negate, op->out + (size_t)(t0 + i) * q_dim + (size_t)h * hd);
            }
    }
}

/* Split rows into blocks of one slot at consecutive positions, at most ATTN_BLOCK long. */
static int attention_blocks(kiln_plan *p, int n_rows) {
    int n = 0;
    for (int t = 0; t < n_rows;) {
        int len = 1;
        while (t + len < n_rows && len < ATTN_BLOCK && p->slots[t + len] == p->slots[t] &&
               p->positions[t + len] == p->positions[t] + len)
            len++;
        p->blocks[2 * n] = t, p->blocks[2 * n + 1] = len;
        n++;
        t += len;
    }
    return n;
}

/* Rows [r0, r1) of the op's output that chunk c produces. */
static void chunk_rows(const kiln_op *op, int c, int *r0, int *r1) {
    *r0 = c * op->chunk_tiles * 4;
    *r1 = *r0 + op->chunk_tiles * 4 < op->rows ? *r0 + op->chunk_tiles * 4 : op->rows;
}

/* Copy a chunk's result (n_rows × (r1 - r0), in scratch) into rows [r0, r1) of `out`. */
static void commit_rows(const job *j, float *out, int ld, int n_rows, int c, int thread) {
    int r0, r1;
    chunk_rows(j->op, c, &r0, &r1);
    const float *y = scratch(j->plan, thread);
    for (int t = 0; t < n_rows; t++)
        memcpy(out + (size_t)t * ld + r0, y + (size_t)t * (r1 - r0), sizeof(float) * (r1 - r0));
}

static void matmul_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    int r0, r1;
    chunk_rows(op, c, &r0, &r1);
    int n = r1 - r0;
    float *y = scratch(j->plan, thread);
    matmul_rows(op->w, op->act[op->w_act], act_rows(op, op->w, j->n_rows), y, r0, r1);
    fold_pairs(op, op->w, y, j->n_rows, n, n);
    if (op->res)
        for (int t = 0; t < j->n_rows; t++) {
            const float *res = op->res + (size_t)t * op->rows + r0;
            float *yt = y + (size_t)t * n;
            for (int i = 0; i < n; i++) yt[i] += res[i];
        }
}

static void matmul_commit(void *ctx, int c, int thread) {
    const job *j = ctx;
    commit_rows(j, j->op->out, j->op->rows, j->n_rows, c, thread);
}

static void glu_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    int r0, r1;
    chunk_rows(op, c, &r0, &r1);
    int n = r1 - r0;
    float *g = scratch(j->plan, thread), *u = g + (size_t)j->n_rows * n;
    matmul_rows(op->w, op->act[op->w_act], j->n_rows, g, r0, r1);
    matmul_rows(op->w2, op->act[op->w2_act], j->n_rows, u, r0, r1);
    for (int t = 0; t < j->n_rows; t++) glu_row(op->glu_act, g + (size_t)t * n, u + (size_t)t * n, g + (size_t)t * n, n);
}

/* The split output head. An int8 head (Q8_0, w = d*q: SmolLM2's tied table is a third of a decode step's
 * bytes, Gemma3's two thirds) is packed as two plain kernel matrices: hi = q >> 3, the top 5 bits (Q5_0 with
 * scale 8d), and lo = q & 7, the low 3 (Q4_0 with scale d, stored as lo + 8). Every logit is first computed
 * from hi alone, 22 of the 34 bytes a block, taking each weight's missing low bits at their midpoint 3.5;
 * the logits within SPLIT_MARGIN of their row's best then add lo's share, which makes them exact.
 * Neither kernel changes: Q5_0 and Q4_0 subtract their offsets (16, 8) through the activation's block sums
 * (kernels.h), so the midpoint and the correction are folded into copies of the activation rows with
 * shifted sums (act[1]): the first pass reads sum' = round(sum * 249/256), an offset of 16 - 7/16 (+3.5d a
 * weight); lo reads sum'' = 17 sum - 16 sum', which also returns what sum' took from hi's result.
 * The first pass errs by 0.37 (std of a SmolLM2 logit). `kiln eval kld` (Moby-Dick, 16 windows) against
 * the whole head: SmolLM2 0.00114 -> 0.00184, Gemma3 0.00093 -> 0.00133, top-1 agreement within its error
 * (docs/PERF.md). Which logits are refined depends on the row alone, as below. */
#define SPLIT_MARGIN 10.0f

static int split(const kiln_op *op) { return op->kind == OP_LOGITS && op->w2 != NULL; }

/* Whether the logits op has a second pass: a split head's remainder, or precise activations' second rows. */
static int refines(const kiln_op *op) { return split(op) || paired(op, op->w); }

static void set_block_sums(uint8_t *act_row, int cols, int32_t (*shift)(int32_t)) {
    for (int g = 0; g * KILN_GROUP < cols; g++) {
        int32_t sums[8];
        uint8_t *at = act_row + (size_t)g * KILN_AG_BYTES + KILN_AG_SUM32;
        memcpy(sums, at, sizeof sums);
        for (int l = 0; l < 8; l++) sums[l] = shift(sums[l]); /* every lane: repeated and zero blocks stay so */
        memcpy(at, sums, sizeof sums);
    }
}
static int32_t midpoint_sum(int32_t s) { return (249 * s + 128) >> 8; }
static int32_t remainder_sum(int32_t s) { return 17 * s - 16 * midpoint_sum(s); }

/* act[1]: the n_out first rows with midpoint sums, then again with remainder sums. */
static void split_activations(const kiln_op *op, int n_out) {
    size_t stride = kiln_act_stride(op->w->fmt, op->cols);
    for (int t = 0; t < n_out; t++) {
        const uint8_t *first = (const uint8_t *)op->act[0] + (size_t)t * stride;
        uint8_t *mid = (uint8_t *)op->act[1] + (size_t)t * stride, *rem = mid + (size_t)n_out * stride;
        memcpy(mid, first, stride);
        memcpy(rem, first, stride);
        set_block_sums(mid, op->cols, midpoint_sum);
        set_block_sums(rem, op->cols, remainder_sum);
    }
}

/* A chunk's logits (n_out rows of r1 - r0), then each row's largest of them. */
static void logits_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    int r0, r1;
    chunk_rows(op, c, &r0, &r1);
    int n = r1 - r0;
    float *y = scratch(j->plan, thread), *best = y + (size_t)j->n_out * n;
    matmul_rows(op->w, split(op) ? op->act[1] : op->act[op->w_act], j->n_out, y, r0, r1);
    if (!refines(op)) return;
    for (int t = 0; t < j->n_out; t++) {
        const float *yt = y + (size_t)t * n;
        float m[8]; /* 8 running maxima: no chain of dependent compares (a NaN never wins either way) */
        for (int k = 0; k < 8; k++) m[k] = -INFINITY;
        int i = 0;
        for (; i + 8 <= n; i += 8)
            for (int k = 0; k < 8; k++) m[k] = yt[i + k] > m[k] ? yt[i + k] : m[k];
        for (; i < n; i++) m[0] = yt[i] > m[0] ? yt[i] : m[0];
        for (int k = 1; k < 8; k++) m[0] = m[k] > m[0] ? m[k] : m[0];
        best[t] = m[0];
    }
}

/* The output head with precise activations: every logit from the first rows (above), then, in a second
 * pass over the same chunks, the second rows' share added to the logits within LOGIT_MARGIN of their
 * row's best: the ones sampling notices most (the rest are below e^-4, 1.8%, of the best token's
 * probability at temperature 1). On SmolLM2 this costs 0.0002 of KLD against refining every logit
 * (margins 4 / 6 / 8 / all: 0.00111 / 0.00097 / 0.00091 / 0.00088, same top-1).
 * Refined logits come out exactly as a two-row matmul gives them, and which ones are refined depends on
 * the row alone, not on the batch or the threads. The second rows' work drops from the whole
 * vocabulary to the tiles holding a few hundred candidates. */
#define LOGIT_MARGIN 4.0f

/* Each row's floors from its chunks' maxima, and the chunks holding a logit above some row's lowest floor. */
static int set_logit_floors(kiln_plan *p, const kiln_op *op, int n_out, int n_chunks) {
    for (int t = 0; t < n_out; t++) {
        float m = -INFINITY;
        for (int c = 0; c < n_chunks; c++) m = p->chunk_best[(size_t)c * n_out + t] > m ? p->chunk_best[(size_t)c * n_out + t] : m;
        p->logit_floor[t] = m - LOGIT_MARGIN;
        p->remainder_floor[t] = m - SPLIT_MARGIN;
    }
    const float *lowest = split(op) ? p->remainder_floor : p->logit_floor;
    int n = 0;
    for (int c = 0; c < n_chunks; c++)
        for (int t = 0; t < n_out; t++)
            if (p->chunk_best[(size_t)c * n_out + t] >= lowest[t]) {
                p->refine_chunks[n++] = c;
                break;
            }
    return n;
}

/* Whether output row t has a logit at or above `floor` in rows [a, b) of the vocabulary (one tile). */
static int tile_refined(const kiln_op *op, int t, int a, int b, float floor) {
    const float *y = op->out + (size_t)t * op->rows;
    int hit = 0;
    for (int r = a; r < b; r++) hit |= y[r] >= floor;
    return hit;
}

/* part[a - r0 .. b - r0) += tile `tile` of w times one activation row. */
static void add_tile(const kiln_wmat *w, const uint8_t *act, int tile, float *part, int r0) {
    float v[KILN_TILE_ROWS];
    int a = tile * KILN_TILE_ROWS, b = a + KILN_TILE_ROWS < w->rows ? a + KILN_TILE_ROWS : w->rows;
    kiln_matmul(w, act, 1, v - a, KILN_TILE_ROWS, tile, tile + 1);
    for (int r = a; r < b; r++) part[r - r0] += v[r - a];
}

/* What refining adds to chunk c's logits (zero where nothing is refined), into scratch: a split head's
 * remainder, and the second rows' share. The tiles some row needs are scattered over the vocabulary:
 * each is prefetched while the one before is computed, and a tile several rows need is read once for all
 * of them. */
static void refine_compute(void *ctx, int i, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const kiln_plan *p = j->plan;
    int c = p->refine_chunks[i];
    const kiln_wmat *w = op->w, *streamed = split(op) ? op->w2 : op->w;
    const float *lowest = split(op) ? p->remainder_floor : p->logit_floor;
    int r0, r1;
    chunk_rows(op, c, &r0, &r1);
    int n = r1 - r0, n_out = j->n_out, n_hits = 0;
    size_t stride = kiln_act_stride(w->fmt, w->cols);
    const uint8_t *second = (const uint8_t *)op->act[op->w_act] + (size_t)n_out * stride;
    const uint8_t *remainder = split(op) ? (const uint8_t *)op->act[1] + (size_t)n_out * stride : NULL;
    float *part = scratch(p, thread);
    int *hits = (int *)(part + (size_t)n_out * n) + 1; /* the chunk's tiles some row refines, their count before */
    int full = n / 4, tiles = (n + 3) / 4, pairs = 0; /* r0 is a tile's first row; pairs: (row, tile) refined */
    memset(hits, 0, sizeof(int) * (size_t)tiles);
    for (int t = 0; t < n_out; t++) { /* first a count per tile, row by row without branches */
        const float *y = op->out + (size_t)t * op->rows + r0;
        float floor = lowest[t];
        for (int k = 0; k < full; k++)
            hits[k] += (y[4 * k] >= floor) | (y[4 * k + 1] >= floor) | (y[4 * k + 2] >= floor) | (y[4 * k + 3] >= floor);
        int tail = 0;
        for (int r = 4 * full; r < n; r++) tail |= y[r] >= floor;
        if (full < tiles) hits[full] += tail;
    }
    for (int k = 0; k < tiles; k++) pairs += hits[k];
    for (int k = 0; k < tiles; k++) /* then the flagged tiles' numbers, in place */
        if (hits[k]) hits[n_hits++] = r0 / 4 + k;
    hits[-1] = n_hits;
    for (int t = 0; t < n_out; t++) /* only the hit tiles' part is used (and committed) */
        for (int i = 0; i < n_hits; i++) {
            int a = hits[i] * 4;
            memset(part + (size_t)t * n + a - r0, 0, sizeof(float) * (size_t)(a + 4 < r1 ? 4 : r1 - a));
        }
    /* A flat distribution (random tokens, llama-bench's method) puts most of the vocabulary within the
     * margin: then lo is streamed over the whole chunk for every row at once, and added where refined.
     * Against one row's dot of a tile fetched on its own (~4x a streamed tile's), a chunk's dots for n rows
     * cost about (n + 2) / 3 streamed tiles each (Q4_0 over 49k x 576, one thread: 1 row 1.3 ms, 8 rows
     * 4.6 ms), so streaming pays from (n + 2) / 12 refined (row, tile) pairs per tile. */
    int dense = split(op) && 12 * pairs > tiles * (n_out + 2);
    if (dense) {
        float *all = (float *)(hits + (n + 3) / 4);
        kiln_matmul(op->w2, remainder, n_out, all - r0, n, r0 / 4, (r1 + 3) / 4);
        for (int t = 0; t < n_out; t++)
            for (int a = r0; a < r1; a += 4) {
                int b = a + 4 < r1 ? a + 4 : r1;
                if (tile_refined(op, t, a, b, p->remainder_floor[t]))
                    for (int r = a; r < b; r++) part[(size_t)t * n + r - r0] += all[(size_t)t * n + r - r0];
            }
    }
    for (int i = 0; i < n_hits; i++) {
        if (i + 1 < n_hits && !dense) {
            const char *next = (const char *)streamed->data + (size_t)hits[i + 1] * streamed->tile_bytes;
            for (size_t o = 0; o < streamed->tile_bytes; o += 64) __builtin_prefetch(next + o);
        }
        int a = hits[i] * 4, b = a + 4 < r1 ? a + 4 : r1;
        for (int t = 0; t < n_out; t++) {
            float *pt = part + (size_t)t * n;
            if (split(op) && !dense && tile_refined(op, t, a, b, p->remainder_floor[t]))
                add_tile(op->w2, remainder + (size_t)t * stride, hits[i], pt, r0);
            if (paired(op, w) && tile_refined(op, t, a, b, p->logit_floor[t])) {
                add_tile(w, second + (size_t)t * stride, hits[i], pt, r0);
                if (split(op)) add_tile(op->w2, second + (size_t)t * stride, hits[i], pt, r0);
            }
        }
    }
}

static void refine_commit(void *ctx, int i, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    int c = j->plan->refine_chunks[i];
    int r0, r1;
    chunk_rows(op, c, &r0, &r1);
    int n = r1 - r0;
    const float *part = scratch(j->plan, thread);
    const int *hits = (const int *)(part + (size_t)j->n_out * n) + 1;
    for (int t = 0; t < j->n_out; t++) {
        float *y = op->out + (size_t)t * op->rows;
        const float *pt = part + (size_t)t * n - r0;
        for (int i = 0; i < hits[-1]; i++)
            for (int r = hits[i] * 4; r < hits[i] * 4 + 4 && r < r1; r++) y[r] += pt[r];
    }
}

static void logits_commit(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    commit_rows(j, op->out, op->rows, j->n_out, c, thread);
    if (refines(op)) {
        int r0, r1;
        chunk_rows(op, c, &r0, &r1);
        memcpy(j->plan->chunk_best + (size_t)c * j->n_out, scratch(j->plan, thread) + (size_t)j->n_out * (r1 - r0),
               sizeof(float) * j->n_out);
    }
}

static int chunks_of(const kiln_op *op) { return (n_tiles(op->w) + op->chunk_tiles - 1) / op->chunk_tiles; }

static int64_t run_op(kiln_plan *p, int i, int n_rows, int n_out) {
    const kiln_op *op = &p->ops[i];
    job *j = &p->jobs[i];
    j->plan = p;
    j->op = op;
    j->n_rows = n_rows;
    j->n_out = n_out;
    switch (op->kind) {
    case OP_EMBED:
        for (int t = 0; t < n_rows; t++) {
            float *x = op->out + (size_t)t * op->cols;
            uint8_t *row = (uint8_t *)scratch(p, 0); /* a row is at most cols floats */
            off_t at = (off_t)(op->table_offset + (size_t)p->tokens[t] * op->table_row_bytes);
            /* a split head's two rows unpack through the scratch past the row (cols floats hold 128 bytes a
             * block of 32: the Q8_0 row's 34, then hi's 22 and lo's 18) */
            int failed = op->table_w2 ? kiln_unpack_split_row(op->table_w, op->table_w2, p->tokens[t], row,
                                                              row + op->table_row_bytes) < 0
                         : op->table_w ? kiln_unpack_row(op->table_w, p->tokens[t], row) < 0
                                       : pread(op->table_fd, row, op->table_row_bytes, at) != (ssize_t)op->table_row_bytes;
            if (failed) {
                p->error = op->table_w ? EINVAL : errno ? errno : EIO;
                memset(x, 0, sizeof(float) * op->cols);
                continue;
            }
            kiln_dequant_row(op->table_type, row, op->cols, x);
            if (op->scale != 1.0f)
                for (int i = 0; i < op->cols; i++) x[i] *= op->scale;
        }
        return 0;
    case OP_NORM_QUANT: case OP_QUANT: return quantize_op(p, op, j);
    case OP_QKV: return kiln_pool_run(p->pool, qkv_compute, qkv_commit, j, qkv_chunks(j));
    case OP_ATTN: {
        int64_t wait = kiln_pool_run(p->pool, attn_compute, attn_commit, j, attention_units(p, op));
        attention_merge(p, op);
        return wait;
    }
    case OP_MATMUL: return kiln_pool_run(p->pool, matmul_compute, matmul_commit, j, chunks_of(op));
    case OP_GLU: return kiln_pool_run(p->pool, glu_compute, matmul_commit, j, chunks_of(op));
    case OP_LOGITS: {
        if (split(op)) split_activations(op, n_out);
        int64_t wait = kiln_pool_run(p->pool, logits_compute, logits_commit, j, chunks_of(op));
        if (!refines(op)) return wait;
        int n_refine = set_logit_floors(p, op, n_out, chunks_of(op));
        return wait + kiln_pool_run(p->pool, refine_compute, refine_commit, j, n_refine);
    }
    case OP_NORM_ADD:
        for (int t = 0; t < n_rows; t++) {
            const float *res = op->res + (size_t)t * op->cols;
            float *out = op->out + (size_t)t * op->cols;
            rmsnorm(op->in + (size_t)t * op->cols, op->norm_w, op->eps, op->cols, out);
            for (int i = 0; i < op->cols; i++) out[i] += res[i];
        }
        return 0;
    }
    return 0;
}

int64_t kiln_plan_run(kiln_plan *p, int n_rows, int n_out) {
    int64_t wait_total = 0;
    p->error = 0;
    p->n_blocks = attention_blocks(p, n_rows);
    for (int i = 0; i < p->n_ops; i++) {
        if (!p->trace) {
            wait_total += run_op(p, i, n_rows, n_out);
            continue;
        }
        int64_t t0 = kiln_now_ns();
        int64_t wait = run_op(p, i, n_rows, n_out);
        int64_t t1 = kiln_now_ns();
        p->op_t0_ns[i] = t0, p->op_t1_ns[i] = t1;
        p->op_ns[i] += t1 - t0;
        p->op_wait_ns[i] += wait;
        wait_total += wait;
    }
    p->runs++;
    return wait_total;
}
