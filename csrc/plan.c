/* The plan executor: walks the op list once per step, each op run by its family's file (ops.h). Small
 * ops run on the calling thread; the matrix and attention ops are split into chunks for the pool, each
 * computed into the thread's scratch and then committed, which is what lets the pool take over a chunk
 * whose worker was preempted (see pool.h). */
#include "plan.h"

#include <string.h>

#include "ops.h"

size_t kiln_op_scratch(const kiln_op *op, int rows, int out_rows) {
    switch (op->kind) {
    case OP_EMBED: return kiln_embed_scratch(op, rows, out_rows);
    case OP_NORM_QUANT: case OP_QUANT: return kiln_quant_scratch(op, rows, out_rows);
    case OP_QKV: return kiln_qkv_scratch(op, rows, out_rows);
    case OP_ATTN: return kiln_attn_scratch(op, rows, out_rows);
    case OP_MATMUL: return kiln_matmul_scratch(op, rows, out_rows);
    case OP_GLU: return kiln_glu_scratch(op, rows, out_rows);
    case OP_LOGITS: return kiln_logits_scratch(op, rows, out_rows);
    case OP_MOE: return kiln_moe_scratch(op, rows, out_rows);
    case OP_DELTANET: return kiln_delta_net_scratch(op, rows, out_rows);
    default: return 0;
    }
}

void kiln_job_tiles(kiln_plan *p, job *j, int k, const kiln_wmat *a, const kiln_wmat *b, const kiln_wmat *c) {
    j->tiles = NULL;
#if KILN_X86
    const kiln_wmat *ws[3] = {a, b, c};
    if (!p->amx_tiles || j->n_rows < KILN_AMX_MIN_TOKENS || kiln_active_isa() != ISA_AMX) return;
    for (int i = 0; i < 3; i++)
        if (ws[i] && (kiln_act_kind(ws[i]->fmt) != KILN_ACT_Q8 || ws[i]->cols != a->cols)) return;
    if (kiln_bf16_tiles_bytes(a->cols, j->n_rows) > p->amx_tiles_bytes) return;
    if (kiln_bf16_tiles(a->fmt, j->op->act[k], a->cols, j->n_rows, paired(j->op, a), p->amx_tiles) == 0) {
        j->tiles = p->amx_tiles;
        j->tiles_act = k;
    }
#else
    (void)p, (void)k, (void)a, (void)b, (void)c;
#endif
}

static int64_t run_op(kiln_plan *p, int i, int n_rows, int n_out) {
    job *j = &p->jobs[i];
    j->plan = p;
    j->op = &p->ops[i];
    j->n_rows = n_rows;
    j->n_out = n_out;
    j->tiles = NULL;
    switch (j->op->kind) {
    case OP_EMBED: return kiln_embed_run(p, j);
    case OP_NORM_QUANT: case OP_QUANT: return kiln_quant_run(p, j);
    case OP_QKV: return kiln_qkv_run(p, j);
    case OP_ATTN: return kiln_attn_run(p, j);
    case OP_MATMUL: return kiln_matmul_run(p, j);
    case OP_GLU: return kiln_glu_run(p, j);
    case OP_LOGITS: return kiln_logits_run(p, j);
    case OP_NORM_ADD: return kiln_norm_add_run(p, j);
    case OP_SHORTCONV: return kiln_shortconv_run(p, j);
    case OP_MOE: return kiln_moe_run(p, j);
    case OP_DELTANET: return kiln_delta_net_run(p, j);
    case OP_GATE: return kiln_gate_run(p, j);
    }
    return 0;
}

/* ---- guarded scratch ---- */

#define GUARD_WORD 0x7fa5a5a5u /* a NaN no arithmetic produces */
#define GUARD_BYTE 0xa5

static uint32_t *guard_at(const kiln_plan *p, int thread, int after) {
    float *s = p->scratch + (size_t)thread * p->scratch_stride;
    return (uint32_t *)(after ? s + KILN_GUARD_FLOATS + p->scratch_floats : s);
}

void kiln_plan_guard_fill(kiln_plan *p) {
    for (int t = 0; t < kiln_pool_threads(p->pool); t++)
        for (int side = 0; side < 2; side++) {
            uint32_t *g = guard_at(p, t, side);
            for (int i = 0; i < KILN_GUARD_FLOATS; i++) g[i] = GUARD_WORD;
        }
}

/* The gaps between activation buffers: written at each run, since a plan sharing the arena lays its
 * own buffers over them. */
static void fill_gaps(kiln_plan *p) {
    for (int g = 0; g < p->n_gaps; g++) memset(p->gaps[g].data, GUARD_BYTE, p->gaps[g].nbytes);
}

/* After op i: whether some thread's scratch was written past either end, or some gap; the first is noted. */
static int guard_broken(kiln_plan *p, int i) {
    for (int g = 0; g < p->n_gaps; g++)
        for (size_t k = 0; k < p->gaps[g].nbytes; k++)
            if (p->gaps[g].data[k] != GUARD_BYTE) {
                p->overrun_op = i, p->overrun_gap = g;
                return 1;
            }
    for (int t = 0; t < kiln_pool_threads(p->pool); t++)
        for (int side = 0; side < 2; side++) {
            const uint32_t *g = guard_at(p, t, side);
            for (int k = 0; k < KILN_GUARD_FLOATS; k++)
                if (g[k] != GUARD_WORD) {
                    p->overrun_op = i, p->overrun_thread = t, p->overrun_after = side;
                    return 1;
                }
        }
    return 0;
}

int64_t kiln_plan_run(kiln_plan *p, int n_rows, int n_out) {
    int64_t wait_total = 0;
    p->error = 0;
    p->overrun_op = p->overrun_gap = -1;
    if (p->guard) fill_gaps(p);
    kiln_attention_blocks(p, n_rows);
    for (int i = 0; i < p->n_ops; i++) {
        if (!p->trace) {
            wait_total += run_op(p, i, n_rows, n_out);
        } else {
            int64_t t0 = kiln_now_ns();
            int64_t wait = run_op(p, i, n_rows, n_out);
            int64_t t1 = kiln_now_ns();
            p->op_t0_ns[i] = t0, p->op_t1_ns[i] = t1;
            p->op_ns[i] += t1 - t0;
            p->op_wait_ns[i] += wait;
            wait_total += wait;
        }
        if (p->guard) {
            kiln_pool_quiesce(p->pool); /* a late worker's chunk lands before the guards are read */
            if (guard_broken(p, i)) break;
        }
    }
    p->runs++;
    return wait_total;
}
