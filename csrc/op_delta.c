/* DELTANET: Qwen3.5's Gated DeltaNet over each row's slot, and GATE, the gated attention's output gate.
 *
 * A row's input is its fused q, k, v projection; a causal depthwise convolution of conv_len taps runs over
 * it and the slot's ring of past inputs (position p at p % state_len, positions before 0 read as zeros),
 * then SiLU. q and k heads are L2-normalized (q also scaled by 1/sqrt(k_dim)); value head h reads key
 * head h % k_heads. Each value head's state S, a [k_dim][v_dim] matrix per slot, decays by
 * exp(decay * softplus(alpha + dt_bias)), then moves toward v along k at rate sigmoid(beta) (the delta
 * rule), and the row's output is Sᵀq, RMS-normalized (norm_w, eps) and gated by silu(z).
 *
 * S holds no history: it is the slot's state after the last row it took (kiln/engine/kv.py,
 * StateWindow, says where a slot may continue). The rows run in order, so a chunk of one sequence reads
 * what its earlier rows stored; the convolution's channels, and then the value heads, are independent and go
 * to the pool, each chunk taking its share of every row in order. */
#include "ops.h"

void kiln_delta_net_bounds(const kiln_op *op, kiln_bounds *b) {
    const kiln_plan *p = b->plan;
    const int nk = op->dn_k_heads, nv = op->dn_v_heads, dk = op->dn_k_dim, dv = op->dn_v_dim;
    if (nk < 1 || nv < 1 || nv % nk || dk < 1 || dv < 1 || op->cols != 2 * nk * dk + nv * dv) {
        kiln_bounds_fail(b, "%d key heads of %d and %d value heads of %d over %d channels", nk, dk, nv, dv, op->cols);
        return;
    }
    if (op->conv_len < 1 || op->state_len < 1 || op->state_len < op->conv_len - 1) {
        kiln_bounds_fail(b, "a convolution of %d taps over rings of %d positions", op->conv_len, op->state_len);
        return;
    }
    const size_t rows = p->max_rows, width = op->cols, value = (size_t)nv * dv;
    kiln_need(b, "in", op->in, sizeof(float) * rows * width);
    kiln_need(b, "mixed", op->dn_mixed, sizeof(float) * rows * width);
    kiln_need(b, "z", op->dn_z, sizeof(float) * rows * value);
    kiln_need(b, "alpha", op->dn_alpha, sizeof(float) * rows * nv);
    kiln_need(b, "beta", op->dn_beta, sizeof(float) * rows * nv);
    kiln_need(b, "out", op->out, sizeof(float) * rows * value);
    kiln_need(b, "conv_w", op->conv_w, sizeof(float) * op->conv_len * width);
    kiln_need(b, "decay", op->dn_decay, sizeof(float) * nv);
    kiln_need(b, "dt_bias", op->dn_dt_bias, sizeof(float) * nv);
    kiln_need(b, "norm_w", op->norm_w, sizeof(float) * dv);
    kiln_need(b, "state", op->state, sizeof(float) * p->n_slots * (size_t)op->state_len * width);
    kiln_need(b, "matrices", op->dn_matrices, sizeof(float) * p->n_slots * (size_t)nv * dk * dv);
}

/* Whether delta_avx2.c's update and GATE take n values, eight at a time. */
static int vector_path(int n) {
#if KILN_X86
    return kiln_active_isa() >= ISA_AVX2 && n % 8 == 0;
#else
    (void)n;
    return 0;
#endif
}

/* The q, k and v heads of a row's input, in order, are its units: a chunk of the convolution is a run of
 * whole units, so the heads it normalizes are its own. */
static int n_units(const kiln_op *op) { return 2 * op->dn_k_heads + op->dn_v_heads; }
static int unit_start(const kiln_op *op, int u) {
    const int qk = 2 * op->dn_k_heads;
    return u < qk ? u * op->dn_k_dim : qk * op->dn_k_dim + (u - qk) * op->dn_v_dim;
}

/* Units [u0, u1) of a row: its convolution (stored into `mixed`, after SiLU), its input then stored in
 * the ring, and its q and k heads normalized. Each channel's taps read only that channel. */
static void mix_units(const kiln_op *op, const float *in, float *ring, int pos, float *mixed, int u0, int u1) {
    const int n = op->cols, L = op->conv_len, R = op->state_len, i0 = unit_start(op, u0), i1 = unit_start(op, u1);
    const float *w = op->conv_w;
    for (int i = i0; i < i1; i++) mixed[i] = 0.0f;
    for (int k = 0; k < L; k++) { /* tap k reads position pos - (L - 1) + k: the last, the row's own input */
        int at = pos - (L - 1) + k;
        if (at < 0) continue;
        const float *past = k == L - 1 ? in : ring + (size_t)(at % R) * n;
        for (int i = i0; i < i1; i++) mixed[i] += w[(size_t)i * L + k] * past[i];
    }
    /* after the taps: it may be the oldest's row */
    memcpy(ring + (size_t)(pos % R) * n + i0, in + i0, sizeof(float) * (size_t)(i1 - i0));
    kiln_act_row(ACT_SILU, mixed + i0, i1 - i0);
    const int dk = op->dn_k_dim, qk = 2 * op->dn_k_heads;
    const float q_scale = 1.0f / sqrtf((float)dk);
    for (int h = u0; h < u1 && h < qk; h++) {
        float *x = mixed + (size_t)h * dk, ss = 0.0f;
        for (int i = 0; i < dk; i++) ss += x[i] * x[i];
        float inv = 1.0f / sqrtf(ss + 1e-6f) * (h < op->dn_k_heads ? q_scale : 1.0f);
        for (int i = 0; i < dk; i++) x[i] *= inv;
    }
}

static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* One value head of one row: S decays, takes the delta-rule update, and is read by q; the output is
 * normalized and gated. `recalled` holds v_dim floats. With AVX2 the update is delta_avx2.c's. */
static void head_row(const kiln_op *op, const float *mixed, float *S, int t, int h, float *recalled) {
    const int nk = op->dn_k_heads, nv = op->dn_v_heads, dk = op->dn_k_dim, dv = op->dn_v_dim;
    const float *q = mixed + (size_t)(h % nk) * dk, *k = mixed + (size_t)(nk + h % nk) * dk;
    const float *v = mixed + (size_t)2 * nk * dk + (size_t)h * dv;
    const float decay = expf(op->dn_decay[h] * softplus(op->dn_alpha[(size_t)t * nv + h] + op->dn_dt_bias[h]));
    const float rate = 1.0f / (1.0f + expf(-op->dn_beta[(size_t)t * nv + h]));
    float *out = op->out + (size_t)t * nv * dv + (size_t)h * dv;
#if KILN_X86
    if (vector_path(dv))
        kiln_delta_head_avx2(S, q, k, v, decay, rate, dk, dv, recalled, out);
    else
#endif
    {
        for (int j = 0; j < dv; j++) recalled[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *row = S + (size_t)i * dv;
            for (int j = 0; j < dv; j++) {
                row[j] *= decay;
                recalled[j] += row[j] * k[i];
            }
        }
        for (int j = 0; j < dv; j++) recalled[j] = (v[j] - recalled[j]) * rate; /* now the update's delta */
        for (int j = 0; j < dv; j++) out[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *row = S + (size_t)i * dv;
            for (int j = 0; j < dv; j++) {
                row[j] += k[i] * recalled[j];
                out[j] += row[j] * q[i];
            }
        }
    }
    rmsnorm(out, op->norm_w, op->eps, dv, out);
    const float *z = op->dn_z + (size_t)t * nv * dv + (size_t)h * dv;
    kiln_glu_row(ACT_SILU, z, out, out, dv);
}

size_t kiln_delta_net_scratch(const kiln_op *op, int rows, int out_rows) {
    (void)rows, (void)out_rows;
    return (size_t)op->dn_v_dim; /* head_row's recalled values */
}

/* A chunk is a run of value heads for every row of the step, rows in order: each head's rows depend only
 * on that head's earlier rows, whatever slots the rows belong to. The update is in place, so it runs as
 * the chunk's commit, which one thread alone runs (pool.h); the compute phase has nothing to do. */
static int heads_per_chunk(const kiln_op *op) { return op->chunk_heads > 0 ? op->chunk_heads : op->dn_v_heads; }

static void commit_heads(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    const kiln_plan *p = j->plan;
    const int per = heads_per_chunk(op), h1 = (c + 1) * per < op->dn_v_heads ? (c + 1) * per : op->dn_v_heads;
    const size_t matrix = (size_t)op->dn_k_dim * op->dn_v_dim;
    float *recalled = scratch(j, thread);
    for (int t = 0; t < j->n_rows; t++) {
        const float *mixed = op->dn_mixed + (size_t)t * op->cols;
        float *slot = op->dn_matrices + (size_t)p->slots[t] * op->dn_v_heads * matrix;
        for (int h = c * per; h < h1; h++) head_row(op, mixed, slot + (size_t)h * matrix, t, h, recalled);
    }
}

/* The convolution's chunks: runs of heads_per_chunk units, for every row in order (a row's taps read what
 * the rows before it stored in the ring), committed in place as the heads are. */
static void commit_mix(void *ctx, int c, int thread) {
    (void)thread;
    const job *j = ctx;
    const kiln_op *op = j->op;
    const kiln_plan *p = j->plan;
    const int per = heads_per_chunk(op), u1 = (c + 1) * per < n_units(op) ? (c + 1) * per : n_units(op);
    for (int t = 0; t < j->n_rows; t++) {
        float *ring = op->state + (size_t)p->slots[t] * op->state_len * op->cols;
        mix_units(op, op->in + (size_t)t * op->cols, ring, p->positions[t], op->dn_mixed + (size_t)t * op->cols, c * per, u1);
    }
}

static void compute_nothing(void *ctx, int c, int thread) { (void)ctx, (void)c, (void)thread; }

int64_t kiln_delta_net_run(kiln_plan *p, job *j) {
    const kiln_op *op = j->op;
    const int per = heads_per_chunk(op);
    int64_t wait = kiln_pool_run(p->pool, compute_nothing, commit_mix, j, (n_units(op) + per - 1) / per);
    return wait + kiln_pool_run(p->pool, compute_nothing, commit_heads, j, (op->dn_v_heads + per - 1) / per);
}

void kiln_gate_bounds(const kiln_op *op, kiln_bounds *b) {
    const size_t bytes = sizeof(float) * b->plan->max_rows * (size_t)op->cols;
    kiln_need(b, "in", op->in, bytes);
    kiln_need(b, "gate", op->dn_z, bytes);
    kiln_need(b, "out", op->out, bytes);
}

int64_t kiln_gate_run(kiln_plan *p, job *j) {
    (void)p;
    const kiln_op *op = j->op;
    const size_t n = (size_t)j->n_rows * op->cols;
#if KILN_X86
    if (vector_path(op->cols)) { /* the rows are contiguous, so n is a multiple of 8 too */
        kiln_sigmoid_gate_avx2(op->out, op->in, op->dn_z, (int)n);
        return 0;
    }
#endif
    for (size_t i = 0; i < n; i++) op->out[i] = op->in[i] / (1.0f + expf(-op->dn_z[i]));
    return 0;
}
