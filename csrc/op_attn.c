/* QKV and attention. QKV projects q, k and v (one list of heads, chunks of consecutive heads), adds
 * the bias, applies the per-head norm and rope, and stores k and v into the KV cache; a norm over the
 * whole q and k projections (OLMo2) needs every head of a row first, so those rows are normalized,
 * roped and stored in a second pass, a row per chunk. ATTN attends over
 * each row's slot in parts the threads take separately, then merges each query's parts in order. */
#include "attn.h"
#include "attn_quant.h"
#include "ops.h"

/* A layer without rope (SmolLM3's every fourth) has dim 0. */
static void rope(float *x, const kiln_rope *r, int pos) {
    if (r->dim == 0) return;
    int half = r->dim / 2;
    const float *c = r->cos + (size_t)pos * half, *s = r->sin + (size_t)pos * half;
    for (int i = 0; i < half; i++) {
        int ia = r->neox ? i : 2 * i, ib = r->neox ? i + half : 2 * i + 1;
        float a = x[ia], b = x[ib];
        x[ia] = a * c[i] - b * s[i];
        x[ib] = b * c[i] + a * s[i];
    }
}

/* The KV cache is head-major, [slot][kv head][n_ctx × head_dim], so attention streams each head's keys
 * and values contiguously (keys in the transposed groups attn.h describes). */
static uint8_t *head_at(const kiln_plan *p, const kiln_op *op, uint16_t *cache, int slot, int head) {
    return (uint8_t *)cache + ((size_t)slot * op->n_kv_heads + head) * kiln_kv_head_bytes(op->kv_type, p->n_ctx, op->head_dim);
}

/* Row t's key (which 1) or value (which 2) of KV head `head`, into the cache in its type's layout. */
static void store_kv(const kiln_plan *p, const kiln_op *op, int t, int head, int which, const float *row) {
    int slot = p->slots[t], pos = p->positions[t], hd = op->head_dim;
    uint8_t *at = head_at(p, op, which == 1 ? op->k_cache : op->v_cache, slot, head);
    if (op->kv_type != KV_F16)
        which == 1 ? kiln_store_key_quant(op->kv_type, row, at, pos, hd)
                   : kiln_store_value_quant(op->kv_type, row, at, pos, hd);
    else if (which == 1)
        kiln_store_key(row, (uint16_t *)at, pos, hd);
    else
        kiln_store_half(row, (uint16_t *)at + (size_t)pos * hd, hd);
}

/* Row t's query heads from `row` (`heads` of them side by side) into op->q: rotated over a quantized
 * cache, whose keys are (attn_quant.h), so each query is rotated once, not once per part it scores. */
static void store_q(const kiln_op *op, int t, int head, int heads, const float *row) {
    float *q = op->q + (size_t)t * op->n_heads * op->head_dim + (size_t)head * op->head_dim;
    size_t n = (size_t)heads * op->head_dim;
    if (op->kv_type != KV_F16)
        kiln_kv_rotate(row, q, (int)n);
    else
        memcpy(q, row, sizeof(float) * n);
}

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
 * what remains), so the thread that finishes first waits for a small chunk, not a long one
 * (docs/PERF.md, "QKV chunks shrink towards the end"). */
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

/* Whether some projection takes precise pairs: then its chunk's result holds both rows' outputs. */
static int qkv_paired(const kiln_op *op) { return paired(op, op->wq) || paired(op, op->wk) || paired(op, op->wv); }

/* A chunk's result in scratch: row t's heads side by side, y[t * width + (h - h0) * hd + i]. */
static void qkv_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const kiln_plan *p = j->plan;
    int hd = op->head_dim, h0, h1, n = j->n_rows;
    qkv_chunk(j, c, &h0, &h1);
    int width = (h1 - h0) * hd;
    float *y = scratch(j, thread), *tmp = y + (size_t)(qkv_paired(op) ? 2 : 1) * n * width;
    for (int h = h0; h < h1;) {
        int which, head, which_end, head_end, e = h + 1;
        qkv_head(op, h, &which, &head);
        while (e < h1 && (qkv_head(op, e, &which_end, &head_end), which_end == which)) e++;
        const kiln_wmat *w = which == 0 ? op->wq : which == 1 ? op->wk : op->wv;
        int k = which == 0 ? op->q_act : which == 1 ? op->k_act : op->v_act;
        int r0 = head * hd, r1 = r0 + (e - h) * hd, off = (h - h0) * hd;
        job_matmul(j, w, k, n, y + off, width, r0, r1);
        const float *bias = which == 0 ? op->bq : which == 1 ? op->bk : op->bv;
        const kiln_norm *norm = which == 0 ? &op->qnorm : &op->knorm;
        for (int t = 0; t < n; t++)
            for (int k = 0; k < e - h; k++) {
                float *row = y + (size_t)t * width + off + k * hd;
                if (bias)
                    for (int i = 0; i < hd; i++) row[i] += bias[r0 + k * hd + i];
                if (which == 2 || op->qk_norm_whole) continue;
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
    const float *y = scratch(j, thread);
    for (int h = h0; h < h1; h++) {
        int which, head;
        qkv_head(op, h, &which, &head);
        for (int t = 0; t < j->n_rows; t++) {
            const float *row = y + (size_t)t * width + (h - h0) * hd;
            if (op->qk_norm_whole && which < 2)
                memcpy(op->qk_raw + ((size_t)t * (op->n_heads + op->n_kv_heads) + h) * hd, row, sizeof(float) * hd);
            else if (which == 0)
                store_q(op, t, head, 1, row);
            else
                store_kv(p, op, t, head, which, row);
        }
    }
}

/* The second pass of a whole-projection norm: row t's q and k heads (qk_raw's row), normalized and
 * roped into scratch, then stored. */
static void qk_row_compute(void *ctx, int t, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    int hd = op->head_dim, q_dim = op->n_heads * hd, kv_dim = op->n_kv_heads * hd;
    const float *raw = op->qk_raw + (size_t)t * (q_dim + kv_dim);
    float *y = scratch(j, thread);
    rmsnorm(raw, op->qnorm.weight, op->qnorm.eps, q_dim, y);
    rmsnorm(raw + q_dim, op->knorm.weight, op->knorm.eps, kv_dim, y + q_dim);
    for (int h = 0; h < op->n_heads + op->n_kv_heads; h++) rope(y + (size_t)h * hd, &op->rope, j->plan->positions[t]);
}

static void qk_row_commit(void *ctx, int t, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const kiln_plan *p = j->plan;
    int hd = op->head_dim, q_dim = op->n_heads * hd;
    const float *y = scratch(j, thread);
    store_q(op, t, 0, op->n_heads, y);
    for (int g = 0; g < op->n_kv_heads; g++)
        store_kv(p, op, t, g, 1, y + q_dim + (size_t)g * hd);
}

/* A chunk's heads for every row (both rows of a precise pair), then a head's normalized row. The
 * largest chunk is chunk_heads heads for one or two rows, a head for more (qkv_chunk_heads). A
 * whole-projection norm's second pass takes a row's q and k. */
size_t kiln_qkv_scratch(const kiln_op *op, int rows, int out_rows) {
    (void)out_rows;
    size_t few = (size_t)(rows < 2 ? rows : 2) * op->chunk_heads, many = rows > 2 ? (size_t)rows : 0;
    size_t heads = (qkv_paired(op) ? 2 : 1) * (few > many ? few : many) * op->head_dim + op->head_dim;
    size_t row = op->qk_norm_whole ? (size_t)(op->n_heads + op->n_kv_heads) * op->head_dim : 0;
    return heads > row ? heads : row;
}

static int need_heads(const kiln_op *op, kiln_bounds *b) {
    /* a run of heads is whole tiles of its matrix: head_dim a multiple of 4 */
    if (op->n_heads < 1 || op->n_kv_heads < 1 || op->n_heads % op->n_kv_heads || op->head_dim < 4 || op->head_dim % 4)
        return kiln_bounds_fail(b, "%d heads over %d KV heads of dim %d", op->n_heads, op->n_kv_heads, op->head_dim);
    if (b->plan->n_ctx % KEY_GROUP) return kiln_bounds_fail(b, "a context of %d is not whole key groups", b->plan->n_ctx);
    if (op->kv_type < 0 || op->kv_type >= KV_COUNT) return kiln_bounds_fail(b, "KV cache type %d", op->kv_type);
    if (op->kv_type != KV_F16 && op->head_dim % KV_BLOCK)
        return kiln_bounds_fail(b, "a quantized KV cache needs a head dim that is whole blocks of %d, not %d", KV_BLOCK,
                                op->head_dim);
    const kiln_plan *p = b->plan;
    size_t cache = (size_t)p->n_slots * op->n_kv_heads * kiln_kv_head_bytes(op->kv_type, p->n_ctx, op->head_dim);
    kiln_need(b, "q", op->q, sizeof(float) * p->max_rows * op->n_heads * op->head_dim);
    kiln_need(b, "k_cache", op->k_cache, cache);
    kiln_need(b, "v_cache", op->v_cache, cache);
    return !b->failed;
}

void kiln_qkv_bounds(const kiln_op *op, kiln_bounds *b) {
    if (!need_heads(op, b)) return;
    int hd = op->head_dim, q_rows = op->n_heads * hd, kv_rows = op->n_kv_heads * hd, R = b->plan->max_rows;
    if (op->chunk_heads < 1) kiln_bounds_fail(b, "chunk_heads is %d", op->chunk_heads);
    kiln_need_wmat(b, "wq", op->wq, q_rows, op->cols);
    kiln_need_wmat(b, "wk", op->wk, kv_rows, op->cols);
    kiln_need_wmat(b, "wv", op->wv, kv_rows, op->cols);
    if (b->failed) return;
    kiln_need_act(b, op->q_act, op->wq, act_rows(op, op->wq, R));
    kiln_need_act(b, op->k_act, op->wk, act_rows(op, op->wk, R));
    kiln_need_act(b, op->v_act, op->wv, act_rows(op, op->wv, R));
    if (op->bq) kiln_need(b, "bq", op->bq, sizeof(float) * q_rows);
    if (op->bk) kiln_need(b, "bk", op->bk, sizeof(float) * kv_rows);
    if (op->bv) kiln_need(b, "bv", op->bv, sizeof(float) * kv_rows);
    int q_norm = op->qk_norm_whole ? q_rows : hd, k_norm = op->qk_norm_whole ? kv_rows : hd;
    if (op->qnorm.weight) kiln_need(b, "qnorm.weight", op->qnorm.weight, sizeof(float) * q_norm);
    if (op->knorm.weight) kiln_need(b, "knorm.weight", op->knorm.weight, sizeof(float) * k_norm);
    if (op->qk_norm_whole) {
        if (!op->qnorm.weight || !op->knorm.weight) kiln_bounds_fail(b, "a whole-projection norm of q and k lacks a weight");
        kiln_need(b, "qk_raw", op->qk_raw, sizeof(float) * R * (q_rows + kv_rows));
    }
    if (op->rope.dim == 0 && !op->rope.cos && !op->rope.sin) return; /* a layer without rope */
    if (op->rope.dim < 2 || op->rope.dim % 2 || op->rope.dim > hd) {
        kiln_bounds_fail(b, "rope over %d of a head's %d dims", op->rope.dim, hd);
        return;
    }
    size_t table = sizeof(float) * b->plan->n_ctx * (op->rope.dim / 2);
    kiln_need(b, "rope.cos", op->rope.cos, table);
    kiln_need(b, "rope.sin", op->rope.sin, table);
}

int64_t kiln_qkv_run(kiln_plan *p, job *j) {
    const kiln_op *op = j->op;
    if (op->q_act == op->k_act && op->k_act == op->v_act) kiln_job_tiles(p, j, op->q_act, op->wq, op->wk, op->wv);
    int64_t wait = kiln_pool_run(p->pool, qkv_compute, qkv_commit, j, qkv_chunks(j));
    if (j->op->qk_norm_whole) wait += kiln_pool_run(p->pool, qk_row_compute, qk_row_commit, j, j->n_rows);
    return wait;
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
 * this is most of what a decode step's attention prefetches for its keys (docs/PERF.md, "The
 * batched step against its instruction mix"). A late worker's pointer may belong to a newer op: it only feeds a prefetch. */
static const uint8_t *chunk_first_keys(const kiln_plan *p, const kiln_op *op, int c) {
    attn_chunk a;
    if (c >= p->attn_unit0[p->n_blocks] || !attn_chunk_of(p, op, c, &a)) return NULL;
    int first = a.first > a.key_lo ? a.first : a.key_lo;
    return head_at(p, op, op->k_cache, p->slots[a.t0], a.g) +
           kiln_kv_head_bytes(op->kv_type, first / KEY_GROUP * KEY_GROUP, op->head_dim);
}

static void attn_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const kiln_plan *p = j->plan;
    attn_chunk a;
    if (!attn_chunk_of(p, op, c, &a)) return;
    int hd = op->head_dim, group = op->n_heads / op->n_kv_heads, q_dim = op->n_heads * hd, nq = a.rows * group;
    const uint8_t *K = head_at(p, op, op->k_cache, p->slots[a.t0], a.g), *V = head_at(p, op, op->v_cache, p->slots[a.t0], a.g);
    float *o = scratch(j, thread), *m = o + (size_t)nq * hd, *l = m + nq, *work = l + nq;
    const float *q = op->q + (size_t)a.t0 * q_dim + (size_t)a.g * group * hd;
    kiln_attend_part(op->kv_type, q, a.rows, group, hd, q_dim, K, V, a.first, a.pos0, op->window, a.key_lo, a.key_hi,
                     op->scale, op->softcap, chunk_first_keys(p, op, c + 1), work, o, m, l);
}

static void attn_commit(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const kiln_plan *p = j->plan;
    attn_chunk a;
    if (!attn_chunk_of(p, op, c, &a)) return;
    int nq = a.rows * (op->n_heads / op->n_kv_heads);
    memcpy(a.partial, scratch(j, thread), sizeof(float) * (size_t)nq * (op->head_dim + 2));
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
                float *out = op->out + (size_t)(t0 + i) * q_dim + (size_t)h * hd;
                kiln_attend_merge(parts, o, m, l, hd, op->negate, op->sinks ? op->sinks + h : NULL, out);
                /* the merge is linear in the parts' outputs, so one rotation after it undoes the cache's */
                if (op->kv_type != KV_F16) kiln_kv_rotate(out, out, hd);
            }
    }
}

/* Split rows into blocks of one slot at consecutive positions, at most ATTN_BLOCK long. */
void kiln_attention_blocks(kiln_plan *p, int n_rows) {
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
    p->n_blocks = n;
}

/* A block's (o, m, l) for its queries, then the kernel's scratch: a block is at most ATTN_BLOCK rows. */
size_t kiln_attn_scratch(const kiln_op *op, int rows, int out_rows) {
    (void)out_rows;
    int group = op->n_kv_heads > 0 ? op->n_heads / op->n_kv_heads : 0;
    int nq = (rows < ATTN_BLOCK ? rows : ATTN_BLOCK) * group;
    return (size_t)nq * (op->head_dim + 2) + kiln_attend_scratch(nq, op->head_dim);
}

void kiln_attn_bounds(const kiln_op *op, kiln_bounds *b) {
    if (!need_heads(op, b)) return;
    if (!(op->softcap >= 0.0f && op->softcap < INFINITY)) kiln_bounds_fail(b, "softcap is %g", op->softcap);
    if (op->sinks) kiln_need(b, "sinks", op->sinks, sizeof(float) * op->n_heads);
    kiln_need(b, "out", op->out, sizeof(float) * b->plan->max_rows * op->n_heads * op->head_dim);
}

int64_t kiln_attn_run(kiln_plan *p, job *j) {
    int64_t wait = kiln_pool_run(p->pool, attn_compute, attn_commit, j, attention_units(p, j->op));
    attention_merge(p, j->op);
    return wait;
}
