/* The plan's own bounds checks: Python hands C raw addresses inside buffers whose sizes come with them,
 * and C checks, at plan build, that every byte each op will touch lies inside one of them (each family
 * says what its ops touch, ops.h), and at each run, that the rows' tokens, slots and positions are in
 * range. So a mistake on the Python side is an exception naming the op and the buffer, never a write
 * outside one. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

#include "ops.h"

static const char *const OP_NAMES[OP_COUNT] = {"EMBED", "NORM_QUANT", "QUANT", "QKV", "ATTN",
                                               "MATMUL", "GLU", "NORM_ADD", "LOGITS", "SHORTCONV", "MOE",
                                               "DELTANET", "GATE"};

const char *kiln_op_name(int kind) { return kind >= 0 && kind < OP_COUNT ? OP_NAMES[kind] : "unknown"; }

static void vfail(kiln_bounds *b, const char *fmt, va_list ap) {
    if (b->failed) return; /* the first problem is the one reported */
    b->failed = 1;
    int n = 0;
    if (b->op >= 0) {
        const kiln_op *op = &b->plan->ops[b->op];
        n = snprintf(b->err, b->err_len, "plan op %d (%s, layer %d): ", b->op, kiln_op_name(op->kind), op->layer);
    }
    if (n >= 0 && (size_t)n < b->err_len) vsnprintf(b->err + n, b->err_len - n, fmt, ap);
}

int kiln_bounds_fail(kiln_bounds *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(b, fmt, ap);
    va_end(ap);
    return 0;
}

void kiln_need(kiln_bounds *b, const char *field, const void *ptr, size_t bytes) {
    if (b->failed || bytes == 0) return;
    const uint8_t *at = ptr;
    if (!at) {
        kiln_bounds_fail(b, "%s is NULL, and the op reads or writes %zu bytes there", field, bytes);
        return;
    }
    for (int i = 0; i < b->n_regions; i++) {
        const kiln_region *r = &b->regions[i];
        if (at < r->data || at >= r->data + r->nbytes) continue;
        size_t offset = (size_t)(at - r->data);
        if (bytes > r->nbytes - offset)
            kiln_bounds_fail(b, "%s needs %zu bytes at byte %zu of buffer '%s', which holds %zu", field, bytes, offset,
                             r->name, r->nbytes);
        return;
    }
    kiln_bounds_fail(b, "%s (%zu bytes) is inside none of the buffers handed to the plan", field, bytes);
}

void kiln_need_wmat(kiln_bounds *b, const char *field, const kiln_wmat *w, int rows, int cols) {
    if (b->failed) return;
    int known = 0;
    for (int i = 0; i < b->n_mats && !known; i++) known = b->mats[i] == w;
    if (!known) {
        kiln_bounds_fail(b, "%s is not one of the matrices handed to the plan", field);
        return;
    }
    if (w->rows != rows || w->cols != cols) {
        kiln_bounds_fail(b, "%s is %d x %d where the op multiplies by %d x %d", field, w->rows, w->cols, rows, cols);
        return;
    }
    /* the kernels read whole tiles and up to KILN_PACK_SLACK bytes past the last */
    kiln_need(b, field, w->data, w->tile_bytes * (size_t)n_tiles(w) + KILN_PACK_SLACK);
}

void kiln_need_act(kiln_bounds *b, int k, const kiln_wmat *w, int n_tok) {
    if (b->failed) return;
    const kiln_op *op = &b->plan->ops[b->op];
    if (k < 0 || k >= op->n_act || k >= MAX_ACTS) {
        kiln_bounds_fail(b, "activation index %d of %d layouts", k, op->n_act);
        return;
    }
    if ((unsigned)op->act_fmt[k] >= KF_COUNT || kiln_act_kind(op->act_fmt[k]) != kiln_act_kind(w->fmt)) {
        kiln_bounds_fail(b, "act[%d] is laid out for format %d, its matrix takes format %d's", k, (int)op->act_fmt[k],
                         (int)w->fmt);
        return;
    }
    static const char *const names[MAX_ACTS] = {"act[0]", "act[1]", "act[2]"};
    kiln_need(b, names[k], op->act[k], kiln_act_size(w->fmt, op->cols, n_tok));
}

void kiln_need_scale(kiln_bounds *b, float scale) {
    if (!isfinite(scale) || scale == 0.0f) kiln_bounds_fail(b, "scale is %g", (double)scale);
}

static void op_bounds(const kiln_op *op, kiln_bounds *b) {
    if (op->kind != OP_ATTN && op->cols < 1) { /* attention's widths are its heads' */
        kiln_bounds_fail(b, "%d columns", op->cols);
        return;
    }
    switch (op->kind) {
    case OP_EMBED: kiln_embed_bounds(op, b); return;
    case OP_NORM_QUANT: case OP_QUANT: kiln_quant_bounds(op, b); return;
    case OP_QKV: kiln_qkv_bounds(op, b); return;
    case OP_ATTN: kiln_attn_bounds(op, b); return;
    case OP_MATMUL: kiln_matmul_bounds(op, b); return;
    case OP_GLU: kiln_glu_bounds(op, b); return;
    case OP_NORM_ADD: kiln_norm_add_bounds(op, b); return;
    case OP_LOGITS: kiln_logits_bounds(op, b); return;
    case OP_SHORTCONV: kiln_shortconv_bounds(op, b); return;
    case OP_MOE: kiln_moe_bounds(op, b); return;
    case OP_DELTANET: kiln_delta_net_bounds(op, b); return;
    case OP_GATE: kiln_gate_bounds(op, b); return;
    default: kiln_bounds_fail(b, "kind %d is no op", op->kind);
    }
}

int kiln_plan_check(kiln_plan *p, const kiln_region *regions, int n_regions, const kiln_wmat *const *mats,
                    int n_mats, char *err, size_t err_len) {
    kiln_bounds b = {p, regions, n_regions, mats, n_mats, -1, err, err_len, 0};
    if (p->max_rows < 1 || p->max_out < 1 || p->max_out > p->max_rows || p->n_ctx < 1 || p->n_slots < 1)
        kiln_bounds_fail(&b, "a plan of %d rows (%d with logits) over %d slots of %d positions", p->max_rows,
                         p->max_out, p->n_slots, p->n_ctx);
    const int32_t *inputs[] = {p->tokens, p->slots, p->positions, p->row_sel};
    static const char *const input_names[] = {"tokens", "slots", "positions", "row_sel"};
    for (int i = 0; i < 4; i++) kiln_need(&b, input_names[i], inputs[i], sizeof(int32_t) * p->max_rows);
    for (int g = 0; g < p->n_gaps; g++) kiln_need(&b, "a guard gap", p->gaps[g].data, p->gaps[g].nbytes);
    p->vocab = 0;
    for (int i = 0; i < p->n_ops && !b.failed; i++) {
        b.op = i;
        op_bounds(&p->ops[i], &b);
        if (p->ops[i].kind == OP_EMBED && (p->vocab == 0 || p->ops[i].table_rows < p->vocab)) p->vocab = p->ops[i].table_rows;
    }
    b.op = -1;
    if (p->vocab == 0) p->vocab = INT32_MAX; /* no op reads a token's row */
    return b.failed ? -1 : 0;
}

int kiln_plan_check_step(const kiln_plan *p, int n_rows, int n_out, char *err, size_t err_len) {
    if (n_rows < 1 || n_rows > p->max_rows || n_out < 0 || n_out > n_rows || n_out > p->max_out) {
        snprintf(err, err_len, "a step of %d rows (%d with logits) exceeds the plan's %d rows (%d with logits)", n_rows,
                 n_out, p->max_rows, p->max_out);
        return -1;
    }
    for (int t = 0; t < n_rows; t++) {
        if (p->tokens[t] < 0 || p->tokens[t] >= p->vocab) {
            snprintf(err, err_len, "row %d: token id %d is outside the vocabulary of %d", t, p->tokens[t], p->vocab);
            return -1;
        }
        if (p->slots[t] < 0 || p->slots[t] >= p->n_slots || p->positions[t] < 0 || p->positions[t] >= p->n_ctx) {
            snprintf(err, err_len, "row %d: slot %d position %d outside %d slots x %d positions", t, p->slots[t],
                     p->positions[t], p->n_slots, p->n_ctx);
            return -1;
        }
    }
    for (int i = 0; i < n_out; i++)
        if (p->row_sel[i] < 0 || p->row_sel[i] >= n_rows) {
            snprintf(err, err_len, "logits row %d selects row %d of %d", i, p->row_sel[i], n_rows);
            return -1;
        }
    return 0;
}
