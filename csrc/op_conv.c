/* SHORTCONV: LFM2's double-gated short convolution. Each row's input is three thirds b, c, x of one
 * projection; b * x enters a causal depthwise convolution of conv_len taps over the row's slot, and c
 * gates its output. A slot's state is a ring of its last state_len inputs b * x by position (p at
 * p % state_len), so a slot resumes from any position the ring still reaches behind the furthest it
 * wrote (kiln/engine/kv.py, StateWindow); positions before 0 read as zeros, so a slot needs no reset.
 *
 * Rows run in order, so a chunk of one sequence reads what its earlier rows stored. The op is a few
 * multiply-adds per channel and row, next to the projections' thousands: it runs on the calling thread. */
#include "ops.h"

void kiln_shortconv_bounds(const kiln_op *op, kiln_bounds *b) {
    const kiln_plan *p = b->plan;
    if (op->conv_len < 1 || op->state_len < op->conv_len) {
        kiln_bounds_fail(b, "a convolution of %d taps over rings of %d positions", op->conv_len, op->state_len);
        return;
    }
    kiln_need(b, "in", op->in, sizeof(float) * p->max_rows * 3 * (size_t)op->cols);
    kiln_need(b, "out", op->out, sizeof(float) * p->max_rows * (size_t)op->cols);
    kiln_need(b, "conv_w", op->conv_w, sizeof(float) * op->conv_len * (size_t)op->cols);
    kiln_need(b, "state", op->state, sizeof(float) * p->n_slots * (size_t)op->state_len * op->cols);
}

int64_t kiln_shortconv_run(kiln_plan *p, job *j) {
    const kiln_op *op = j->op;
    const int n = op->cols, L = op->conv_len, R = op->state_len;
    for (int t = 0; t < j->n_rows; t++) {
        const float *bg = op->in + (size_t)t * 3 * n, *cg = bg + n, *x = bg + 2 * n;
        float *ring = op->state + (size_t)p->slots[t] * R * n, *out = op->out + (size_t)t * n;
        int pos = p->positions[t];
        float *now = ring + (size_t)(pos % R) * n;
        for (int i = 0; i < n; i++) now[i] = bg[i] * x[i];
        for (int i = 0; i < n; i++) out[i] = 0.0f;
        for (int k = 0; k < L; k++) { /* tap k reads position pos - (L - 1) + k */
            int at = pos - (L - 1) + k;
            if (at < 0) continue;
            const float *past = ring + (size_t)(at % R) * n;
            for (int i = 0; i < n; i++) out[i] += op->conv_w[(size_t)i * L + k] * past[i];
        }
        for (int i = 0; i < n; i++) out[i] *= cg[i];
    }
    return 0;
}
