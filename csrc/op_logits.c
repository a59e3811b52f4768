/* The output head (LOGITS): every logit of the rows that want them, in chunks of the vocabulary, then a
 * second pass over the chunks holding each row's best logits: the second rows of precise activations,
 * and for a split int8 head the low bits. */
#include "attn.h"
#include "ops.h"

/* The split output head. An int8 head (Q8_0, w = d*q: SmolLM2's tied table is a third of a decode step's
 * bytes, Gemma3's two thirds) is packed as two plain kernel matrices: hi = q >> 3, the top 5 bits (Q5_0 with
 * scale 8d), and lo = q & 7, the low 3 (Q4_0 with scale d, stored as lo + 8). Every logit is first computed
 * from hi alone, 22 of the 34 bytes a block, taking each weight's missing low bits at their midpoint 3.5;
 * the logits within SPLIT_MARGIN of their row's best then add lo's share, which makes them exact.
 * Neither kernel changes: Q5_0 and Q4_0 subtract their offsets (16, 8) through the activation's block sums
 * (kernels.h), so the midpoint and the correction are folded into copies of the activation rows with
 * shifted sums (act[1]): the first pass reads sum' = round(sum * 249/256), an offset of 16 - 7/16 (+3.5d a
 * weight); lo reads sum'' = 17 sum - 16 sum', which also returns what sum' took from hi's result.
 * What the first pass errs by and what the split costs in KLD: docs/PERF.md, "The split output head".
 * Which logits are refined depends on the row alone, as below. */
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
    float *y = scratch(j, thread), *best = y + (size_t)j->n_out * n;
    matmul_rows(op->w, split(op) ? op->act[1] : op->act[op->w_act], j->n_out, y, r0, r1);
    if (op->bias) /* before each row's best is taken: the refinement's margins are of the biased logits */
        for (int t = 0; t < j->n_out; t++)
            for (int i = 0; i < n; i++) y[(size_t)t * n + i] += op->bias[r0 + i];
    if (op->scale != 1.0f) /* of the biased product, as the refinement's share is scaled too */
        for (size_t i = 0; i < (size_t)j->n_out * n; i++) y[i] *= op->scale;
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
 * row's best: the ones sampling notices most (the rest are below e^-4 of the best token's probability at
 * temperature 1; what other margins cost: docs/PERF.md, "Accuracy").
 * Refined logits come out exactly as a two-row matmul gives them, and which ones are refined depends on
 * the row alone, not on the batch or the threads. The second rows' work drops from the whole
 * vocabulary to the tiles holding a few hundred candidates. */
#define LOGIT_MARGIN 4.0f

/* The logit below which a row's logits are not refined: `margin` below its best, measured on the logits
 * as they leave the op, soft-capped ones included (then further below the uncapped best). */
static float floor_below(float best, float margin, float cap) {
    if (cap <= 0.0f) return best - margin;
    float t = tanhf(best / cap) - margin / cap;
    return t <= -1.0f ? -INFINITY : cap * atanhf(t);
}

/* Each row's floors from its chunks' maxima, and the chunks holding a logit above some row's lowest floor. */
static int set_logit_floors(kiln_plan *p, const kiln_op *op, int n_out, int n_chunks) {
    for (int t = 0; t < n_out; t++) {
        float m = -INFINITY;
        for (int c = 0; c < n_chunks; c++) m = p->chunk_best[(size_t)c * n_out + t] > m ? p->chunk_best[(size_t)c * n_out + t] : m;
        p->logit_floor[t] = floor_below(m, LOGIT_MARGIN, op->softcap);
        p->remainder_floor[t] = floor_below(m, SPLIT_MARGIN, op->softcap);
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

/* part[a - r0 .. b - r0) += tile `tile` of w times one activation row. */
static void add_tile(const kiln_wmat *w, const uint8_t *act, int tile, float *part, int r0) {
    float v[KILN_TILE_ROWS];
    int a = tile * KILN_TILE_ROWS, b = a + KILN_TILE_ROWS < w->rows ? a + KILN_TILE_ROWS : w->rows;
    kiln_matmul(w, act, 1, v - a, KILN_TILE_ROWS, tile, tile + 1);
    for (int r = a; r < b; r++) part[r - r0] += v[r - a];
}

/* flags[k] of tile k of the chunk y[0, n): bit 0 whether a logit of it is at or above floor, bit 1 at or
 * above floor2. */
static void tile_flags(const float *y, int n, float floor, float floor2, uint8_t *flags) {
    int full = n / 4;
    for (int k = 0; k < full; k++) {
        const float *v = y + 4 * k;
        int at = (v[0] >= floor) | (v[1] >= floor) | (v[2] >= floor) | (v[3] >= floor);
        int at2 = (v[0] >= floor2) | (v[1] >= floor2) | (v[2] >= floor2) | (v[3] >= floor2);
        flags[k] = (uint8_t)(at | at2 << 1);
    }
    if (full * 4 < n) {
        int at = 0, at2 = 0;
        for (int r = 4 * full; r < n; r++) {
            at |= y[r] >= floor;
            at2 |= y[r] >= floor2;
        }
        flags[full] = (uint8_t)(at | at2 << 1);
    }
}

typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

/* y[0, n) = 0 + y where tile k's flag has bit 0, else 0: the sum a part zeroed and then added to gives. */
static void keep_flagged(float *y, int n, const uint8_t *flags) {
    int full = n / 4;
    for (int k = 0; k < full; k++) {
        f32x4 v;
        memcpy(&v, y + 4 * k, sizeof v);
        i32x4 keep = (i32x4){0, 0, 0, 0} - (int32_t)(flags[k] & 1);
        v = (f32x4)((i32x4)(v + 0.0f) & keep);
        memcpy(y + 4 * k, &v, sizeof v);
    }
    for (int r = 4 * full; r < n; r++) y[r] = flags[full] & 1 ? 0.0f + y[r] : 0.0f;
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
    float *part = scratch(j, thread);
    int tiles = (n + 3) / 4, pairs = 0; /* r0 is a tile's first row; pairs: (row, tile) refined */
    int *hits = (int *)(part + (size_t)n_out * n) + 1; /* the chunk's tiles some row refines, their count before */
    /* flags[t * tiles + k]: whether row t refines tile k, bit 0 at `lowest`, bit 1 (a split head with
     * second rows) at the second rows' margin, a subset of it as LOGIT_MARGIN < SPLIT_MARGIN */
    uint8_t *flags = (uint8_t *)(hits + tiles);
    for (int t = 0; t < n_out; t++)
        tile_flags(op->out + (size_t)t * op->rows + r0, n, lowest[t], p->logit_floor[t], flags + (size_t)t * tiles);
    int second_bit = split(op) ? 2 : 1;
    memset(hits, 0, sizeof(int) * (size_t)tiles);
    for (int t = 0; t < n_out; t++)
        for (int k = 0; k < tiles; k++) hits[k] += flags[(size_t)t * tiles + k] & 1;
    for (int k = 0; k < tiles; k++) pairs += hits[k];
    for (int k = 0; k < tiles; k++) /* then the flagged tiles' numbers, in place */
        if (hits[k]) hits[n_hits++] = r0 / 4 + k;
    hits[-1] = n_hits;
    /* A flat distribution (random tokens, llama-bench's method) puts most of the vocabulary within the
     * margin: then lo is streamed over the whole chunk for every row at once, and kept where refined.
     * Against one row's dot of a tile fetched on its own (~4x a streamed tile's), a chunk's dots for n rows
     * cost about (n + 2) / 3 streamed tiles each, so streaming pays from (n + 2) / 12 refined (row, tile)
     * pairs per tile (docs/PERF.md, "The split output head"). */
    int dense = split(op) && 12 * pairs > tiles * (n_out + 2);
    if (dense) {
        kiln_matmul(op->w2, remainder, n_out, part - r0, n, r0 / 4, (r1 + 3) / 4);
        for (int t = 0; t < n_out; t++) keep_flagged(part + (size_t)t * n, n, flags + (size_t)t * tiles);
    } else
        for (int t = 0; t < n_out; t++) /* only the hit tiles' part is used (and committed) */
            for (int i = 0; i < n_hits; i++) {
                int a = hits[i] * 4;
                memset(part + (size_t)t * n + a - r0, 0, sizeof(float) * (size_t)(a + 4 < r1 ? 4 : r1 - a));
            }
    if (dense && !paired(op, w)) return;
    for (int i = 0; i < n_hits; i++) {
        if (i + 1 < n_hits && !dense) {
            const char *next = (const char *)streamed->data + (size_t)hits[i + 1] * streamed->tile_bytes;
            for (size_t o = 0; o < streamed->tile_bytes; o += 64) __builtin_prefetch(next + o);
        }
        int k = hits[i] - r0 / 4;
        for (int t = 0; t < n_out; t++) {
            float *pt = part + (size_t)t * n;
            if (split(op) && !dense && flags[(size_t)t * tiles + k] & 1)
                add_tile(op->w2, remainder + (size_t)t * stride, hits[i], pt, r0);
            if (paired(op, w) && flags[(size_t)t * tiles + k] & second_bit) {
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
    const float *part = scratch(j, thread);
    const int *hits = (const int *)(part + (size_t)j->n_out * n) + 1;
    float scale = op->scale;
    for (int t = 0; t < j->n_out; t++) {
        float *y = op->out + (size_t)t * op->rows;
        const float *pt = part + (size_t)t * n - r0;
        for (int i = 0; i < hits[-1]; i++) {
            int a = hits[i] * 4;
            if (a + 4 <= r1)
                for (int r = a; r < a + 4; r++) y[r] += scale * pt[r];
            else
                for (int r = a; r < r1; r++) y[r] += scale * pt[r];
        }
    }
}

static void logits_commit(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    commit_rows(j, op->out, op->rows, j->n_out, c, thread);
    if (refines(op)) {
        int r0, r1;
        chunk_rows(op, c, &r0, &r1);
        memcpy(j->plan->chunk_best + (size_t)c * j->n_out, scratch(j, thread) + (size_t)j->n_out * (r1 - r0),
               sizeof(float) * j->n_out);
    }
}

/* First pass: a chunk's logits for every row, then each row's best. Refining: the chunk's part for every
 * row, its tile count and flagged tiles (ints), then a byte a (row, tile): whether that row refines it. */
size_t kiln_logits_scratch(const kiln_op *op, int rows, int out_rows) {
    (void)rows;
    size_t n = (size_t)op->chunk_tiles * 4, first = (size_t)out_rows * n, more = 0;
    if (refines(op)) {
        size_t refine = 1 + (size_t)op->chunk_tiles + ((size_t)out_rows * op->chunk_tiles + 3) / 4;
        more = refine > (size_t)out_rows ? refine : (size_t)out_rows;
    }
    return first + more;
}

void kiln_logits_bounds(const kiln_op *op, kiln_bounds *b) {
    int O = b->plan->max_out;
    if (!(op->softcap >= 0.0f && op->softcap < INFINITY)) kiln_bounds_fail(b, "softcap is %g", op->softcap);
    kiln_need_scale(b, op->scale);
    if (op->chunk_tiles < 1) kiln_bounds_fail(b, "chunk_tiles is %d", op->chunk_tiles);
    kiln_need_wmat(b, "w", op->w, op->rows, op->cols);
    if (op->w2) kiln_need_wmat(b, "w2", op->w2, op->rows, op->cols);
    if (b->failed) return;
    if (op->w_act != 0 || (op->w2 && (op->w->fmt != KF_Q5_0 || op->w2->fmt != KF_Q4_0))) {
        kiln_bounds_fail(b, "the head reads act[0]; a split head is a Q5_0 and a Q4_0 matrix");
        return;
    }
    kiln_need_act(b, 0, op->w, act_rows(op, op->w, O));
    if (op->w2) kiln_need(b, "act[1]", op->act[1], kiln_act_size(op->w->fmt, op->cols, 2 * O)); /* shifted sums */
    kiln_need(b, "out", op->out, sizeof(float) * O * op->rows);
    if (op->bias) kiln_need(b, "bias", op->bias, sizeof(float) * op->rows);
}

/* Soft-capping (Gemma 2's final logits) comes last, once the refined logits are exact: a chunk's capped
 * logits in scratch, committed as the first pass's are. */
static void cap_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    int r0, r1;
    chunk_rows(op, c, &r0, &r1);
    float *y = scratch(j, thread);
    for (int t = 0; t < j->n_out; t++) {
        memcpy(y + (size_t)t * (r1 - r0), op->out + (size_t)t * op->rows + r0, sizeof(float) * (r1 - r0));
        kiln_softcap(y + (size_t)t * (r1 - r0), r1 - r0, op->softcap);
    }
}

static void cap_commit(void *ctx, int c, int thread) {
    const job *j = ctx;
    commit_rows(j, j->op->out, j->op->rows, j->n_out, c, thread);
}

int64_t kiln_logits_run(kiln_plan *p, job *j) {
    const kiln_op *op = j->op;
    if (split(op)) split_activations(op, j->n_out);
    int64_t wait = kiln_pool_run(p->pool, logits_compute, logits_commit, j, chunks_of(op));
    if (refines(op)) {
        int n_refine = set_logit_floors(p, op, j->n_out, chunks_of(op));
        wait += kiln_pool_run(p->pool, refine_compute, refine_commit, j, n_refine);
    }
    if (op->softcap > 0.0f) wait += kiln_pool_run(p->pool, cap_compute, cap_commit, j, chunks_of(op));
    return wait;
}
