/* OP_MOE: a mixture-of-experts feed-forward block in one op, so that a step stays one native call.
 *
 *   route    (calling thread) router logits W_r·act (+ its bias) for every row, each row's top n_used
 *            experts and weights (moe_gating: a softmax over every expert, then the top n_used; or the
 *            top n_used logits, then a softmax over those alone); the rows' (row, expert) pairs are then
 *            grouped by expert (a counting sort, rows in order within an expert) and their activations
 *            gathered, one contiguous run of rows per expert
 *   up       (pool) per chunk: one expert, whole activation groups of its gate and up rows, for every
 *            row that chose it: both projections (+ the expert's biases), the GLU (glu_act), and the
 *            result quantized for the down projection (precise pairs, as the dense down projection's input)
 *   down     (pool) per chunk: one expert, a run of its down rows (+ the expert's bias), for every row
 *            that chose it
 *   combine  (calling thread) out = residual + scale · (Σ weight · down output, in each row's top-k order,
 *            plus the shared expert's output times sigmoid(its scale)); scale: Granite's residual multiplier
 *
 * So each chosen expert's weights are read once per step for all the rows that chose it, and experts
 * no row chose are not read at all. A shared expert is one more "expert" that every row chose, reading
 * the block's input directly. Results do not depend on the batch or the threads: a row's dot products
 * are the kernels' (the same for any number of tokens) and its sum runs in a fixed order.
 *
 * The routing buffer (moe_route, int32) for a plan of R rows, k = n_used, E = n_experts, U units:
 *   expert_of[R*k]  expert of pair (row t, choice j) at t*k + j
 *   slot_of[R*k]    where that pair sits in the grouped order
 *   row_of[R*k]     the row of each grouped pair
 *   count[E], start[E]   each expert's run of grouped pairs
 *   units_up[2U], units_down[2U]   (expert, part) of each chunk of the two pool phases (E: shared)
 * A late worker (pool.h) may read these while the next phase or step rewrites them: every index read
 * in a chunk is clamped to the buffers' extent, so such a read stays in bounds (its result is thrown
 * away). */
#include "ops.h"

typedef struct {
    int32_t *expert_of, *slot_of, *row_of, *count, *start, *units_up, *units_down;
} route_view;

static int parts_of(int width, int tiles) { return width < 1 ? 0 : (width + 4 * tiles - 1) / (4 * tiles); }

static int max_parts(const kiln_op *op) {
    int a = parts_of(op->ff, op->chunk_tiles), s = parts_of(op->shared_ff, op->chunk_tiles);
    int d = parts_of(op->rows, op->down_tiles);
    a = s > a ? s : a;
    return d > a ? d : a;
}

static size_t units_cap(const kiln_op *op) { return (size_t)(op->n_experts + 1) * max_parts(op); }

size_t kiln_moe_route_ints(const kiln_op *op, int rows) {
    return 3 * (size_t)rows * op->n_used + 2 * (size_t)op->n_experts + 4 * units_cap(op);
}

static route_view route_of(const kiln_op *op, int rows) {
    size_t pairs = (size_t)rows * op->n_used, u = units_cap(op);
    int32_t *at = op->moe_route;
    route_view r;
    r.expert_of = at, at += pairs;
    r.slot_of = at, at += pairs;
    r.row_of = at, at += pairs;
    r.count = at, at += op->n_experts;
    r.start = at, at += op->n_experts;
    r.units_up = at, at += 2 * u;
    r.units_down = at;
    return r;
}

/* where the router's weights, the chosen weights and the shared expert's scale logits sit in moe_gates */
static float *logits_of(const kiln_op *op) { return op->moe_gates; }
static float *weights_of(const kiln_op *op, int rows) { return op->moe_gates + (size_t)rows * op->n_experts; }
static float *shared_logits_of(const kiln_op *op, int rows) {
    return weights_of(op, rows) + (size_t)rows * op->n_used;
}

static int has_shared(const kiln_op *op) { return op->sh_gate != NULL; }

/* Bytes of a quantized GLU output of `cols` columns, the most either activation kind takes. */
static size_t glu_act_stride(int cols) {
    size_t q = kiln_act_stride(KF_Q8_0, cols), f = kiln_act_stride(KF_F32, cols);
    return q > f ? q : f;
}

/* Where column `col` (a group boundary) starts in a row of activations of format `fmt`. */
static size_t act_col_offset(kiln_wfmt fmt, int col) {
    return kiln_act_kind(fmt) == KILN_ACT_F32 ? sizeof(float) * col : (size_t)(col / KILN_GROUP) * KILN_AG_BYTES;
}

size_t kiln_moe_scratch(const kiln_op *op, int rows, int out_rows) {
    (void)out_rows;
    size_t cr = 4 * (size_t)op->chunk_tiles, dr = 4 * (size_t)op->down_tiles;
    size_t up = 2 * rows * cr + cr + (2 * rows * glu_act_stride((int)cr) + 3) / 4;
    size_t down = 2 * rows * dr;
    return up > down ? up : down;
}

void kiln_moe_bounds(const kiln_op *op, kiln_bounds *b) {
    const int R = b->plan->max_rows, E = op->n_experts, k = op->n_used;
    if (E < 1 || k < 1 || k > E) {
        kiln_bounds_fail(b, "%d of %d experts per row", k, E);
        return;
    }
    if (op->moe_gating != MOE_SOFTMAX && op->moe_gating != MOE_SOFTMAX_SELECTED) {
        kiln_bounds_fail(b, "gating %d is not one op_moe.c computes", op->moe_gating);
        return;
    }
    if (op->glu_act != ACT_SILU && op->glu_act != ACT_SWIGLU_OAI) {
        kiln_bounds_fail(b, "glu_act %d is not an experts' activation", op->glu_act);
        return;
    }
    if (op->ff < 1 || op->rows < 1 || op->chunk_tiles < 1 || op->down_tiles < 1 || op->shared_ff < 0) {
        kiln_bounds_fail(b, "experts %d wide into %d rows in chunks of %d and %d tiles", op->ff, op->rows,
                         op->chunk_tiles, op->down_tiles);
        return;
    }
    /* a chunk quantizes its own columns of the GLU output: whole activation groups, or all of them */
    int cr = 4 * op->chunk_tiles, widest = op->ff > op->shared_ff ? op->ff : op->shared_ff;
    if (cr % KILN_GROUP && cr < widest) {
        kiln_bounds_fail(b, "gate and up chunks of %d rows cut an activation group", cr);
        return;
    }
    kiln_need_scale(b, op->scale);
    kiln_need_wmat(b, "w (router)", op->w, E, op->cols);
    if (b->failed) return;
    kiln_need_act(b, op->w_act, op->w, R);
    const kiln_wmat *const *tables[3] = {op->exp_gate, op->exp_up, op->exp_down};
    static const char *const table_names[3] = {"exp_gate", "exp_up", "exp_down"};
    for (int m = 0; m < 3; m++) kiln_need(b, table_names[m], tables[m], sizeof(kiln_wmat *) * E);
    if (b->failed) return;
    for (int e = 0; e < E && !b->failed; e++) {
        kiln_need_wmat(b, "an exp_gate matrix", op->exp_gate[e], op->ff, op->cols);
        kiln_need_wmat(b, "an exp_up matrix", op->exp_up[e], op->ff, op->cols);
        kiln_need_wmat(b, "an exp_down matrix", op->exp_down[e], op->rows, op->ff);
        if (b->failed) return;
        for (int m = 0; m < 3; m++)
            if (tables[m][e]->fmt != tables[m][0]->fmt)
                kiln_bounds_fail(b, "%s's experts are packed in different formats", table_names[m]);
    }
    if (b->failed) return;
    if (kiln_act_kind(op->exp_gate[0]->fmt) != kiln_act_kind(op->exp_up[0]->fmt))
        kiln_bounds_fail(b, "the experts' gate and up matrices read different activation kinds");
    kiln_need_act(b, op->exp_act, op->exp_gate[0], R);
    size_t sh_bytes = 0;
    if (has_shared(op)) {
        kiln_need_wmat(b, "sh_gate", op->sh_gate, op->shared_ff, op->cols);
        kiln_need_wmat(b, "sh_up", op->sh_up, op->shared_ff, op->cols);
        kiln_need_wmat(b, "sh_down", op->sh_down, op->rows, op->shared_ff);
        if (b->failed) return;
        if (kiln_act_kind(op->sh_gate->fmt) != kiln_act_kind(op->sh_up->fmt))
            kiln_bounds_fail(b, "the shared expert's gate and up matrices read different activation kinds");
        kiln_need_act(b, op->sh_act, op->sh_gate, R);
        sh_bytes = 2 * (size_t)R * kiln_act_stride(op->sh_down->fmt, op->shared_ff);
    } else if (op->sh_up || op->sh_down || op->shared_ff) {
        kiln_bounds_fail(b, "a shared expert without its gate matrix");
    }
    if (op->sh_scale) {
        kiln_need_wmat(b, "sh_scale", op->sh_scale, 1, op->cols);
        if (b->failed) return;
        kiln_need_act(b, op->sh_scale_act, op->sh_scale, R);
    }
    size_t pairs = (size_t)R * k;
    kiln_need(b, "moe_route", op->moe_route, sizeof(int32_t) * kiln_moe_route_ints(op, R));
    kiln_need(b, "moe_gates", op->moe_gates, sizeof(float) * ((size_t)R * E + pairs + R));
    kiln_need(b, "moe_x", op->moe_x, pairs * kiln_act_stride(op->exp_gate[0]->fmt, op->cols));
    kiln_need(b, "moe_h", op->moe_h, 2 * pairs * kiln_act_stride(op->exp_down[0]->fmt, op->ff));
    kiln_need(b, "moe_hs", op->moe_hs, sh_bytes);
    kiln_need(b, "moe_y", op->moe_y, sizeof(float) * (pairs + R) * op->rows);
    kiln_need(b, "out", op->out, sizeof(float) * R * op->rows);
    if (op->res) kiln_need(b, "res", op->res, sizeof(float) * R * op->rows);
    if (op->bias) kiln_need(b, "bias (router)", op->bias, sizeof(float) * E);
    if (op->exp_gate_b) kiln_need(b, "exp_gate_b", op->exp_gate_b, sizeof(float) * E * op->ff);
    if (op->exp_up_b) kiln_need(b, "exp_up_b", op->exp_up_b, sizeof(float) * E * op->ff);
    if (op->exp_down_b) kiln_need(b, "exp_down_b", op->exp_down_b, sizeof(float) * E * op->rows);
}

/* ---- route ---- */

/* A softmax of n values, in place. */
static void softmax(float *x, int n) {
    float top = x[0], sum = 0.0f;
    for (int i = 1; i < n; i++) top = x[i] > top ? x[i] : top;
    for (int i = 0; i < n; i++) sum += x[i] = expf(x[i] - top);
    for (int i = 0; i < n; i++) x[i] /= sum;
}

/* Row t's chosen experts, best first (ties to the lower index), and their weights. */
static void route_row(const kiln_op *op, float *logits, int32_t *chosen, float *weights) {
    const int E = op->n_experts, k = op->n_used;
    if (op->bias)
        for (int e = 0; e < E; e++) logits[e] += op->bias[e];
    if (op->moe_gating == MOE_SOFTMAX) softmax(logits, E);
    float kept = 0.0f;
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j && !taken; i++) taken = chosen[i] == e;
            if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
        }
        chosen[j] = best;
        kept += weights[j] = logits[best];
    }
    if (op->moe_gating == MOE_SOFTMAX_SELECTED) {
        softmax(weights, k);
        kept = 1.0f;
    }
    if (op->moe_normalize)
        for (int j = 0; j < k; j++) weights[j] /= kept;
}

static void route(const kiln_op *op, const route_view *r, int n, int R) {
    const int E = op->n_experts, k = op->n_used;
    float *logits = logits_of(op), *weights = weights_of(op, R);
    memset(r->count, 0, sizeof(int32_t) * E);
    for (int t = 0; t < n; t++) {
        route_row(op, logits + (size_t)t * E, r->expert_of + (size_t)t * k, weights + (size_t)t * k);
        for (int j = 0; j < k; j++) r->count[r->expert_of[(size_t)t * k + j]]++;
    }
    int32_t *filled = r->units_down; /* free until the down phase: E <= its 2U entries */
    for (int e = 0, at = 0; e < E; e++) r->start[e] = at, filled[e] = 0, at += r->count[e];
    for (int t = 0; t < n; t++)
        for (int j = 0; j < k; j++) {
            int e = r->expert_of[(size_t)t * k + j], slot = r->start[e] + filled[e]++;
            r->slot_of[(size_t)t * k + j] = slot;
            r->row_of[slot] = t;
        }
}

/* The (expert, part) chunks of a phase: each chosen expert's parts, then the shared expert's. */
static int list_units(const kiln_op *op, const route_view *r, int32_t *units, int expert_width, int shared_width,
                      int tiles) {
    int n = 0;
    for (int e = 0; e < op->n_experts; e++)
        if (r->count[e] > 0)
            for (int part = 0; part < parts_of(expert_width, tiles); part++) units[2 * n] = e, units[2 * n + 1] = part, n++;
    if (has_shared(op))
        for (int part = 0; part < parts_of(shared_width, tiles); part++)
            units[2 * n] = op->n_experts, units[2 * n + 1] = part, n++;
    return n;
}

/* ---- a chunk's expert: its matrices, rows and where they sit, every index clamped (see the top) ---- */

typedef struct {
    const kiln_wmat *gate, *up, *down;
    int shared, expert, width, n, slot0, part; /* rows that chose it: grouped pairs [slot0, slot0 + n), or all rows */
} unit;

static int clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static unit unit_of(const job *j, const int32_t *units, int c) {
    const kiln_op *op = j->op;
    const int R = j->plan->max_rows, E = op->n_experts;
    route_view r = route_of(op, R);
    unit u;
    int e = clamp(units[2 * c], 0, E);
    u.part = clamp(units[2 * c + 1], 0, max_parts(op));
    u.shared = e == E && has_shared(op);
    if (e == E && !u.shared) e = 0;
    u.expert = e;
    if (u.shared) {
        u.gate = op->sh_gate, u.up = op->sh_up, u.down = op->sh_down;
        u.width = op->shared_ff, u.n = j->n_rows, u.slot0 = 0;
    } else {
        u.gate = op->exp_gate[e], u.up = op->exp_up[e], u.down = op->exp_down[e];
        u.width = op->ff;
        u.n = clamp(r.count[e], 0, R);
        u.slot0 = clamp(r.start[e], 0, R * op->n_used - u.n);
    }
    return u;
}

/* Its GLU outputs: a run of rows (2 per row when precise: first rows, then second rows) */
static uint8_t *glu_rows(const kiln_op *op, const unit *u) {
    if (u->shared) return op->moe_hs;
    return op->moe_h + 2 * (size_t)u->slot0 * kiln_act_stride(u->down->fmt, u->width);
}

/* y[i][c] += bias[c] for n rows of w values: an expert's biases on its rows' outputs (none: NULL) */
static void add_expert_bias(const float *bias, float *y, int n, int w) {
    if (!bias) return;
    for (int i = 0; i < n; i++)
        for (int c = 0; c < w; c++) y[(size_t)i * w + c] += bias[c];
}

/* The expert's row of a [n_experts][width] bias table, from column r0 (the shared expert has none). */
static const float *expert_bias(const float *table, const unit *u, int width, int r0) {
    return table && !u->shared ? table + (size_t)u->expert * width + r0 : NULL;
}

/* ---- up: gate, up, GLU, quantized ---- */

typedef struct {
    float *g, *u, *residual;
    uint8_t *q;
} up_scratch;

/* The gate's results come last: a shared expert's full chunk (every row) ends where the scratch ends, so a
 * guarded plan sees an undersized scratch. */
static up_scratch up_scratch_of(const job *j, int thread) {
    const int R = j->plan->max_rows;
    size_t cr = 4 * (size_t)j->op->chunk_tiles;
    up_scratch s;
    s.q = (uint8_t *)scratch(j, thread);
    s.residual = (float *)s.q + (2 * R * glu_act_stride((int)cr) + 3) / 4;
    s.u = s.residual + cr;
    s.g = s.u + R * cr;
    return s;
}

static void up_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const int R = j->plan->max_rows;
    route_view r = route_of(op, R);
    unit u = unit_of(j, r.units_up, c);
    int r0 = u.part * 4 * op->chunk_tiles, r1 = r0 + 4 * op->chunk_tiles < u.width ? r0 + 4 * op->chunk_tiles : u.width;
    if (r0 >= r1) return;
    int w = r1 - r0;
    const uint8_t *x = u.shared ? op->act[op->sh_act]
                                : op->moe_x + (size_t)u.slot0 * kiln_act_stride(op->exp_gate[0]->fmt, op->cols);
    up_scratch s = up_scratch_of(j, thread);
    matmul_rows(u.gate, x, u.n, s.g, r0, r1);
    matmul_rows(u.up, x, u.n, s.u, r0, r1);
    add_expert_bias(expert_bias(op->exp_gate_b, &u, op->ff, r0), s.g, u.n, w);
    add_expert_bias(expert_bias(op->exp_up_b, &u, op->ff, r0), s.u, u.n, w);
    size_t qs = glu_act_stride(4 * op->chunk_tiles);
    for (int i = 0; i < u.n; i++) {
        float *g = s.g + (size_t)i * w;
        kiln_glu_row(op->glu_act, g, s.u + (size_t)i * w, g, w);
        if (paired(op, u.down))
            kiln_quantize_act_pair(u.down->fmt, g, w, s.q + i * qs, s.q + (u.n + i) * qs, s.residual);
        else
            kiln_quantize_act(u.down->fmt, g, w, w, 1, s.q + i * qs);
    }
}

static void up_commit(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const int R = j->plan->max_rows;
    route_view r = route_of(op, R);
    unit u = unit_of(j, r.units_up, c);
    int r0 = u.part * 4 * op->chunk_tiles, r1 = r0 + 4 * op->chunk_tiles < u.width ? r0 + 4 * op->chunk_tiles : u.width;
    if (r0 >= r1) return;
    up_scratch s = up_scratch_of(j, thread);
    size_t qs = glu_act_stride(4 * op->chunk_tiles), stride = kiln_act_stride(u.down->fmt, u.width);
    size_t bytes = kiln_act_stride(u.down->fmt, r1 - r0), at = act_col_offset(u.down->fmt, r0);
    uint8_t *dst = glu_rows(op, &u);
    int rows = paired(op, u.down) ? 2 * u.n : u.n;
    for (int i = 0; i < rows; i++) memcpy(dst + (size_t)i * stride + at, s.q + i * qs, bytes);
}

/* ---- down ---- */

static void down_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const int R = j->plan->max_rows;
    route_view r = route_of(op, R);
    unit u = unit_of(j, r.units_down, c);
    int r0 = u.part * 4 * op->down_tiles, r1 = r0 + 4 * op->down_tiles < op->rows ? r0 + 4 * op->down_tiles : op->rows;
    if (r0 >= r1) return;
    float *y = scratch(j, thread);
    matmul_rows(u.down, glu_rows(op, &u), act_rows(op, u.down, u.n), y, r0, r1);
    fold_pairs(op, u.down, y, u.n, r1 - r0, r1 - r0);
    add_expert_bias(expert_bias(op->exp_down_b, &u, op->rows, r0), y, u.n, r1 - r0);
}

static void down_commit(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const int R = j->plan->max_rows;
    route_view r = route_of(op, R);
    unit u = unit_of(j, r.units_down, c);
    int r0 = u.part * 4 * op->down_tiles, r1 = r0 + 4 * op->down_tiles < op->rows ? r0 + 4 * op->down_tiles : op->rows;
    if (r0 >= r1) return;
    const float *y = scratch(j, thread);
    size_t base = u.shared ? (size_t)R * op->n_used : (size_t)u.slot0;
    for (int i = 0; i < u.n; i++)
        memcpy(op->moe_y + (base + i) * op->rows + r0, y + (size_t)i * (r1 - r0), sizeof(float) * (r1 - r0));
}

/* ---- the op ---- */

int64_t kiln_moe_run(kiln_plan *p, job *j) {
    const kiln_op *op = j->op;
    const int n = j->n_rows, R = p->max_rows, E = op->n_experts, k = op->n_used, dim = op->rows;
    route_view r = route_of(op, R);
    kiln_matmul(op->w, op->act[op->w_act], n, logits_of(op), E, 0, n_tiles(op->w));
    if (op->sh_scale) kiln_matmul(op->sh_scale, op->act[op->sh_scale_act], n, shared_logits_of(op, R), 1, 0, 1);
    route(op, &r, n, R);
    size_t xs = kiln_act_stride(op->exp_gate[0]->fmt, op->cols);
    const uint8_t *x = op->act[op->exp_act];
    for (int s = 0; s < n * k; s++) memcpy(op->moe_x + (size_t)s * xs, x + (size_t)r.row_of[s] * xs, xs);

    int n_up = list_units(op, &r, r.units_up, op->ff, op->shared_ff, op->chunk_tiles);
    int64_t wait = kiln_pool_run(p->pool, up_compute, up_commit, j, n_up);
    int n_down = list_units(op, &r, r.units_down, dim, dim, op->down_tiles);
    wait += kiln_pool_run(p->pool, down_compute, down_commit, j, n_down);

    const float *weights = weights_of(op, R), *shared_logits = shared_logits_of(op, R);
    for (int t = 0; t < n; t++) {
        float *out = op->out + (size_t)t * dim;
        memset(out, 0, sizeof(float) * dim);
        for (int c = 0; c < k; c++) {
            const float w = weights[(size_t)t * k + c], *y = op->moe_y + (size_t)r.slot_of[(size_t)t * k + c] * dim;
            for (int i = 0; i < dim; i++) out[i] += w * y[i];
        }
        if (has_shared(op)) {
            const float g = op->sh_scale ? 1.0f / (1.0f + expf(-shared_logits[t])) : 1.0f;
            const float *y = op->moe_y + ((size_t)R * k + t) * dim;
            for (int i = 0; i < dim; i++) out[i] += g * y[i];
        }
        if (op->scale != 1.0f)
            for (int i = 0; i < dim; i++) out[i] *= op->scale;
        if (op->res)
            for (int i = 0; i < dim; i++) out[i] += op->res[(size_t)t * dim + i];
    }
    return wait;
}
