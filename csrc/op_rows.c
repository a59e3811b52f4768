/* The row ops: the embedding lookup, RMSNorm or LayerNorm and activation quantization (QUANT, NORM_QUANT), and a
 * norm added to the residual stream (NORM_ADD). Each works a row at a time. */
#include <errno.h>
#include <unistd.h>

#include "dequant.h"
#include "ops.h"

/* ---- OP_EMBED ---- */

/* A table row is read into the calling thread's scratch; a split head's two rows unpack through the
 * scratch past it (hi's and lo's blocks, 40 bytes a block of 32). */
static size_t embed_row_bytes(const kiln_op *op) {
    return op->table_row_bytes + (op->table_w2 ? (size_t)op->cols / 32 * 40 : 0);
}

size_t kiln_embed_scratch(const kiln_op *op, int rows, int out_rows) {
    (void)rows, (void)out_rows;
    return (embed_row_bytes(op) + 3) / 4;
}

void kiln_embed_bounds(const kiln_op *op, kiln_bounds *b) {
    const kiln_plan *p = b->plan;
    kiln_need(b, "out", op->out, sizeof(float) * p->max_rows * op->cols);
    if (kiln_ggml_row_bytes(op->table_type, op->cols) != op->table_row_bytes || op->table_row_bytes == 0) {
        kiln_bounds_fail(b, "table rows of %zu bytes are not rows of GGML type %d and width %d", op->table_row_bytes,
                         op->table_type, op->cols);
        return;
    }
    if (!op->table_w) {
        if (op->table_rows < 1) kiln_bounds_fail(b, "the embedding table has %d rows", op->table_rows);
        return;
    }
    kiln_need_wmat(b, "table_w", op->table_w, op->table_w->rows, op->cols);
    if (b->failed) return;
    if (op->table_w2) {
        kiln_need_wmat(b, "table_w2", op->table_w2, op->table_w->rows, op->cols);
        if (op->table_type != GGML_Q8_0 || op->table_w->fmt != KF_Q5_0 || op->table_w2->fmt != KF_Q4_0)
            kiln_bounds_fail(b, "a split table unpacks Q5_0 and Q4_0 halves to Q8_0 rows");
    } else if (kiln_wfmt_for_ggml(op->table_type) != (int)op->table_w->fmt) {
        kiln_bounds_fail(b, "table rows of GGML type %d do not unpack from kernel format %d", op->table_type,
                         (int)op->table_w->fmt);
    }
    if (op->table_rows != op->table_w->rows)
        kiln_bounds_fail(b, "the table has %d rows, its matrix %d", op->table_rows, op->table_w->rows);
}

int64_t kiln_embed_run(kiln_plan *p, job *j) {
    const kiln_op *op = j->op;
    uint8_t *row = (uint8_t *)scratch(j, 0);
    for (int t = 0; t < j->n_rows; t++) {
        float *x = op->out + (size_t)t * op->cols;
        off_t at = (off_t)(op->table_offset + (size_t)p->tokens[t] * op->table_row_bytes);
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
}

/* ---- OP_QUANT, OP_NORM_QUANT ---- */

/* kiln_quantize_act_pair forms a precise kind's two rows. */
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
        if (op->layer_norm)
            layernorm(x, op->norm_w, op->norm_b, op->eps, op->cols, norm_out);
        else
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

size_t kiln_quant_scratch(const kiln_op *op, int rows, int out_rows) {
    (void)rows, (void)out_rows;
    size_t bytes = 0;
    for (int k = 0; k < op->n_act && k < MAX_ACTS; k++)
        bytes += kiln_act_stride(op->act_fmt[k], op->cols) * (precise_kind(op, k) ? 2 : 1);
    return 2 * (size_t)op->cols + (bytes + 3) / 4;
}

void kiln_quant_bounds(const kiln_op *op, kiln_bounds *b) {
    const kiln_plan *p = b->plan;
    int n = quant_rows(op, p->max_rows, p->max_out);
    if (op->n_act < 1 || op->n_act > MAX_ACTS) {
        kiln_bounds_fail(b, "n_act %d is not 1 to %d", op->n_act, MAX_ACTS);
        return;
    }
    kiln_need(b, "in", op->in, sizeof(float) * p->max_rows * op->cols);
    if (op->kind == OP_NORM_QUANT) {
        kiln_need(b, "out", op->out, sizeof(float) * n * op->cols);
        kiln_need(b, "norm_w", op->norm_w, sizeof(float) * op->cols);
        if (op->layer_norm) kiln_need(b, "norm_b", op->norm_b, sizeof(float) * op->cols);
    }
    static const char *const names[MAX_ACTS] = {"act[0]", "act[1]", "act[2]"};
    for (int k = 0; k < op->n_act && !b->failed; k++) {
        if ((unsigned)op->act_fmt[k] >= KF_COUNT) {
            kiln_bounds_fail(b, "act_fmt[%d] %d is not a kernel format", k, (int)op->act_fmt[k]);
            return;
        }
        kiln_need(b, names[k], op->act[k], kiln_act_size(op->act_fmt[k], op->cols, (precise_kind(op, k) ? 2 : 1) * n));
    }
}

static void quant_compute(void *ctx, int i, int thread) {
    const job *j = ctx;
    float *norm_out, *residual;
    uint8_t *dst[MAX_ACTS], *dst2[MAX_ACTS];
    quant_scratch_targets(j->op, scratch(j, thread), &norm_out, &residual, dst, dst2);
    quantize_row(j->plan, j->op, i, norm_out, dst, dst2, residual);
}

static void quant_commit(void *ctx, int i, int thread) {
    const job *j = ctx;
    const kiln_op *op = j->op;
    float *norm_out, *residual;
    uint8_t *src[MAX_ACTS], *src2[MAX_ACTS], *dst[MAX_ACTS], *dst2[MAX_ACTS];
    quant_scratch_targets(op, scratch(j, thread), &norm_out, &residual, src, src2);
    quant_targets(op, i, quant_rows(op, j->n_rows, j->n_out), dst, dst2);
    if (op->kind == OP_NORM_QUANT) memcpy(op->out + (size_t)i * op->cols, norm_out, sizeof(float) * op->cols);
    for (int k = 0; k < op->n_act; k++) {
        size_t stride = kiln_act_stride(op->act_fmt[k], op->cols);
        memcpy(dst[k], src[k], stride);
        if (precise_kind(op, k)) memcpy(dst2[k], src2[k], stride);
    }
}

/* From this many rows the pool's start-up pays off (docs/PERF.md, "Quantizing several rows on the pool"). */
#define POOL_QUANT_ROWS 4

int64_t kiln_quant_run(kiln_plan *p, job *j) {
    const kiln_op *op = j->op;
    int n = quant_rows(op, j->n_rows, j->n_out);
    if (n >= POOL_QUANT_ROWS) return kiln_pool_run(p->pool, quant_compute, quant_commit, j, n);
    uint8_t *dst[MAX_ACTS], *dst2[MAX_ACTS];
    for (int i = 0; i < n; i++) {
        quant_targets(op, i, n, dst, dst2);
        quantize_row(p, op, i, op->kind == OP_NORM_QUANT ? op->out + (size_t)i * op->cols : NULL, dst, dst2,
                     scratch(j, 0) + op->cols);
    }
    return 0;
}

/* ---- OP_NORM_ADD ---- */

void kiln_norm_add_bounds(const kiln_op *op, kiln_bounds *b) {
    size_t bytes = sizeof(float) * b->plan->max_rows * op->cols;
    kiln_need(b, "in", op->in, bytes);
    kiln_need(b, "res", op->res, bytes);
    kiln_need(b, "out", op->out, bytes);
    kiln_need(b, "norm_w", op->norm_w, sizeof(float) * op->cols);
}

int64_t kiln_norm_add_run(kiln_plan *p, job *j) {
    (void)p;
    const kiln_op *op = j->op;
    for (int t = 0; t < j->n_rows; t++) {
        const float *res = op->res + (size_t)t * op->cols;
        float *out = op->out + (size_t)t * op->cols;
        rmsnorm(op->in + (size_t)t * op->cols, op->norm_w, op->eps, op->cols, out);
        for (int i = 0; i < op->cols; i++) out[i] += res[i];
    }
    return 0;
}
