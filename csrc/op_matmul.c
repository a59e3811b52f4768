/* The matrix ops: MATMUL (scale * act(W·act + bias), plus a residual as it is stored: Granite scales its
 * branches) and GLU (act(Wg·a + bg) * (Wu·a + bu), both projections in one pass over the rows). A chunk is
 * chunk_tiles tiles of the output rows for every
 * token, computed into the thread's scratch and committed (pool.h). */
#include "ops.h"
#include "vecmath.h"

#if defined(KILN_X86)
/* The tail goes through the same vector math (padded), so a value never depends on where a chunk
 * boundary falls — results stay identical for any thread count. */
AVX2 static __m256 glu8(int kind, __m256 g, __m256 u) {
    if (kind == ACT_SWIGLU_OAI) return swiglu_oai256(g, u);
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

static float activate(int kind, float x) {
    if (kind == ACT_SILU) return x / (1.0f + expf(-x));
    return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}

#if defined(KILN_X86)
AVX2 static void act_row_avx2(int kind, float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(x + i, kind == ACT_SILU ? silu256(v) : gelu_tanh256(v));
    }
    if (i < n) {
        float t[8] = {0};
        memcpy(t, x + i, sizeof(float) * (n - i));
        __m256 v = _mm256_loadu_ps(t);
        _mm256_storeu_ps(t, kind == ACT_SILU ? silu256(v) : gelu_tanh256(v));
        memcpy(x + i, t, sizeof(float) * (n - i));
    }
}
#endif

/* x[i] = act(x[i]), in place: a GELU MLP's up projection as it is stored */
void kiln_act_row(int kind, float *x, int n) {
#if defined(KILN_X86)
    if (kiln_active_isa() >= ISA_AVX2) {
        act_row_avx2(kind, x, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++) x[i] = activate(kind, x[i]);
}

/* y[t][i] += bias[i] for rows [r0, r0 + n) of every token's n outputs */
static void add_bias(const float *bias, float *y, int n_rows, int r0, int n) {
    if (!bias) return;
    for (int t = 0; t < n_rows; t++)
        for (int i = 0; i < n; i++) y[(size_t)t * n + i] += bias[r0 + i];
}

/* gpt-oss's clamped SwiGLU (plan.h, ACT_SWIGLU_OAI) */
static float swiglu_oai(float g, float u) {
    g = g < SWIGLU_OAI_LIMIT ? g : SWIGLU_OAI_LIMIT;
    u = u < -SWIGLU_OAI_LIMIT ? -SWIGLU_OAI_LIMIT : u > SWIGLU_OAI_LIMIT ? SWIGLU_OAI_LIMIT : u;
    return (u + 1.0f) * (g / (1.0f + expf(-SWIGLU_OAI_ALPHA * g)));
}

/* out[i] = act(g[i]) * u[i]; the activation's exp is the only transcendental on the prefill path */
void kiln_glu_row(int kind, const float *g, const float *u, float *out, int n) {
#if defined(KILN_X86)
    if (kiln_active_isa() >= ISA_AVX2) {
        glu_row_avx2(kind, g, u, out, n);
        return;
    }
#endif
    if (kind == ACT_SWIGLU_OAI) {
        for (int i = 0; i < n; i++) out[i] = swiglu_oai(g[i], u[i]);
        return;
    }
    for (int i = 0; i < n; i++) out[i] = activate(kind, g[i]) * u[i];
}

/* ---- OP_MATMUL ---- */

/* A chunk's result: every token's (paired: both rows') chunk_tiles * 4 outputs. */
size_t kiln_matmul_scratch(const kiln_op *op, int rows, int out_rows) {
    (void)out_rows;
    return (size_t)act_rows(op, op->w, rows) * op->chunk_tiles * 4;
}

static void need_rows_out(const kiln_op *op, kiln_bounds *b) {
    if (op->chunk_tiles < 1) kiln_bounds_fail(b, "chunk_tiles is %d", op->chunk_tiles);
    kiln_need(b, "out", op->out, sizeof(float) * b->plan->max_rows * op->rows);
}

void kiln_matmul_bounds(const kiln_op *op, kiln_bounds *b) {
    kiln_need_scale(b, op->scale);
    kiln_need_wmat(b, "w", op->w, op->rows, op->cols);
    if (b->failed) return;
    kiln_need_act(b, op->w_act, op->w, act_rows(op, op->w, b->plan->max_rows));
    need_rows_out(op, b);
    if (op->res) kiln_need(b, "res", op->res, sizeof(float) * b->plan->max_rows * op->rows);
    if (op->bias) kiln_need(b, "bias", op->bias, sizeof(float) * op->rows);
    if (op->activate && op->glu_act != ACT_SILU && op->glu_act != ACT_GELU_TANH)
        kiln_bounds_fail(b, "glu_act %d is not an activation", op->glu_act);
}

static void matmul_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    int r0, r1;
    chunk_rows(op, c, &r0, &r1);
    int n = r1 - r0;
    float *y = scratch(j, thread);
    job_matmul(j, op->w, op->w_act, j->n_rows, y, n, r0, r1);
    add_bias(op->bias, y, j->n_rows, r0, n);
    if (op->activate)
        for (int t = 0; t < j->n_rows; t++) kiln_act_row(op->glu_act, y + (size_t)t * n, n);
    if (op->scale != 1.0f)
        for (size_t i = 0; i < (size_t)j->n_rows * n; i++) y[i] *= op->scale;
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

int64_t kiln_matmul_run(kiln_plan *p, job *j) {
    kiln_job_tiles(p, j, j->op->w_act, j->op->w, NULL, NULL);
    return kiln_pool_run(p->pool, matmul_compute, matmul_commit, j, chunks_of(j->op));
}

/* ---- OP_GLU ---- */

/* A chunk's gate and up results, every token's chunk_tiles * 4 outputs of each. */
size_t kiln_glu_scratch(const kiln_op *op, int rows, int out_rows) {
    (void)out_rows;
    return 2 * (size_t)rows * op->chunk_tiles * 4;
}

void kiln_glu_bounds(const kiln_op *op, kiln_bounds *b) {
    kiln_need_wmat(b, "w", op->w, op->rows, op->cols);
    kiln_need_wmat(b, "w2", op->w2, op->rows, op->cols);
    if (b->failed) return;
    kiln_need_act(b, op->w_act, op->w, b->plan->max_rows);
    kiln_need_act(b, op->w2_act, op->w2, b->plan->max_rows);
    need_rows_out(op, b);
    if (op->bias) kiln_need(b, "bias", op->bias, sizeof(float) * op->rows);
    if (op->bias2) kiln_need(b, "bias2", op->bias2, sizeof(float) * op->rows);
}

static void glu_compute(void *ctx, int c, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    int r0, r1;
    chunk_rows(op, c, &r0, &r1);
    int n = r1 - r0;
    float *g = scratch(j, thread), *u = g + (size_t)j->n_rows * n;
    job_matmul(j, op->w, op->w_act, j->n_rows, g, n, r0, r1);
    job_matmul(j, op->w2, op->w2_act, j->n_rows, u, n, r0, r1);
    add_bias(op->bias, g, j->n_rows, r0, n);
    add_bias(op->bias2, u, j->n_rows, r0, n);
    for (int t = 0; t < j->n_rows; t++) kiln_glu_row(op->glu_act, g + (size_t)t * n, u + (size_t)t * n, g + (size_t)t * n, n);
}

int64_t kiln_glu_run(kiln_plan *p, job *j) {
    const kiln_op *op = j->op;
    if (op->w_act == op->w2_act) kiln_job_tiles(p, j, op->w_act, op->w, op->w2, NULL);
    return kiln_pool_run(p->pool, glu_compute, matmul_commit, j, chunks_of(op));
}
