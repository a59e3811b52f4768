/* The plan executor: a model's whole forward pass as a flat list of ops over preallocated buffers,
 * run by one native call per step (a decode step of several sequences, or a chunk of prefill).
 *
 * Rows are tokens. Each row carries its own token id, KV slot and position, so the same plan serves
 * prefill (one slot, consecutive positions), batched decode (one row per sequence) and mixtures. */
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "pool.h"

enum {
    OP_EMBED,      /* x[t] = dequant(table row tok[t]) * scale */
    OP_NORM_QUANT, /* act = quantize(rmsnorm(x) * w, or layernorm(x) * w + b) for each activation kind needed */
    OP_QUANT,      /* act = quantize(x) */
    OP_QKV,        /* q, k, v projections; per head: bias, q/k norm, rope (or a q/k norm over the whole
                    * projection, then rope); k, v stored into the cache */
    OP_ATTN,       /* out = softmax(q·K / sqrt [, sink]) · V over each row's slot, causal (+ sliding window) */
    OP_MATMUL,     /* out = scale * [activation](W·act + bias) (+ residual) */
    OP_GLU,        /* out = act(Wg·a + bg) * (Wu·a + bu) */
    OP_NORM_ADD,   /* out = residual + rmsnorm(x) * w */
    OP_LOGITS,     /* logits[i] = scale * (W·act[row_sel[i]] (+ bias)) */
    OP_SHORTCONV,  /* out = c * conv(b * x) over each row's slot, b, c, x the thirds of in (op_conv.c) */
    OP_MOE,        /* out = residual + Σ top-k router weights · expert GLUs (+ a shared expert) */
    OP_DELTANET,   /* out = Gated DeltaNet of in (q, k, v) over each row's slot, gated by z (op_delta.c) */
    OP_GATE,       /* out = in * sigmoid(gate) */
    OP_COUNT
};

/* What the tracer files an op's time under (kiln_op.op_class). */
enum {
    OPC_MATMUL,    /* matrix products: QKV, MATMUL, GLU */
    OPC_ATTENTION, /* the sequence mixers: ATTN, SHORTCONV, DELTANET */
    OPC_NORM,      /* norms, rope, activations, quantization */
    OPC_HEAD,      /* the final norm and the output head */
    OPC_EMBED,     /* the embedding lookup */
    OPC_COUNT
};

/* GLU activations; ACT_SWIGLU_OAI (gpt-oss's experts, a GLU only): g clamped above at 7, u to [-7, 7],
 * out = (u + 1) * g * sigmoid(1.702 g) */
enum { ACT_SILU, ACT_GELU_TANH, ACT_SWIGLU_OAI };

/* OP_MOE: how router logits become the chosen experts' weights */
enum {
    MOE_SOFTMAX,         /* softmax over every expert, then the top n_used */
    MOE_SOFTMAX_SELECTED /* the top n_used logits, then a softmax over those alone (gpt-oss) */
};

#define MAX_ACTS 3 /* activation layouts one input may be quantized into */
#define ATTN_BLOCK 16 /* rows of one sequence at consecutive positions share each key and value tile */
#define ATTN_SPAN 512 /* keys per part of a context that attention splits for the threads */
#define KILN_GUARD_FLOATS 16 /* a guarded plan's guard words either side of each thread's scratch */

typedef struct {
    const float *weight; /* NULL: no norm */
    float eps;
} kiln_norm;

typedef struct {
    const float *cos, *sin; /* [n_ctx][dim/2]; NULL with dim 0: a layer without rope */
    int dim, neox;
} kiln_rope;

typedef struct kiln_op {
    int kind;
    int op_class; /* OPC_*, for the tracer */
    int layer;
    /* generic shapes */
    int cols;           /* input width */
    int rows;           /* output width */
    float *in, *res, *out;
    /* norms */
    const float *norm_w;
    float eps;
    float scale; /* EMBED: of the rows; ATTN: of the scores; MATMUL, LOGITS: of the product */
    int select_rows; /* OP_NORM_QUANT: only the rows listed in row_sel (the final norm before logits) */
    /* activation buffers by kind: act[k] is quantized with act_fmt[k] */
    int n_act;
    kiln_wfmt act_fmt[MAX_ACTS];
    void *act[MAX_ACTS];
    /* weights */
    const kiln_wmat *w, *w2; /* matmul: w; glu: gate w, up w2; logits: w, or a split head's hi w and lo w2 */
    int w_act, w2_act;       /* index into act[] each weight consumes */
    const float *bias;
    int glu_act;
    /* embedding table: a packed matrix the output head shares (table_w, its rows unpacked to GGUF bytes),
     * else read in place from the GGUF file one row per token (GGUF layout); table_w2: a split head's lo */
    const kiln_wmat *table_w, *table_w2;
    int table_fd;
    size_t table_offset;
    int table_type;
    size_t table_row_bytes;
    int table_rows; /* token ids are below it */
    /* attention and qkv */
    int n_heads, n_kv_heads, head_dim, window;
    const kiln_wmat *wq, *wk, *wv;
    int q_act, k_act, v_act;
    const float *bq, *bk, *bv;
    kiln_norm qnorm, knorm;
    kiln_rope rope;
    float *q;                       /* [rows][n_heads*head_dim] */
    uint16_t *k_cache, *v_cache;    /* this layer's [slots][kv heads][n_ctx][head_dim], fp16 or kv_type's blocks */
    /* chunking */
    int chunk_tiles; /* matrix ops: tiles per chunk */
    int chunk_heads; /* OP_QKV: heads per chunk */
    int negate; /* debug: OP_ATTN stores -out, so tests can show the accuracy gates catch a broken layer */
    int precise; /* quantize ops: two int8 rows per token (see ops.h); matmul ops: consume such pairs */
    /* OP_QKV: qnorm and knorm span each row's whole q and k projections (OLMo2), not a head: the chunks
     * leave the raw q and k rows in qk_raw ([rows][(n_heads + n_kv_heads) * head_dim]), then each row is
     * normalized, roped and stored */
    int qk_norm_whole;
    float *qk_raw;
    /* bias (above): MATMUL's, GLU's gate's; bias2: GLU's up's. [rows] each, NULL: none */
    const float *bias2;
    const float *norm_b; /* NORM_QUANT with layer_norm: the LayerNorm's bias [cols] */
    int layer_norm;      /* NORM_QUANT: LayerNorm (the mean subtracted, norm_b added) instead of RMSNorm */
    int activate;        /* MATMUL: glu_act applied to W·act + bias before the scale and residual (a GELU MLP's up) */
    /* OP_SHORTCONV: taps [cols][conv_len]; this layer's rings [slots][state_len][cols] of past b * x,
     * position p at p % state_len */
    const float *conv_w;
    float *state;
    int conv_len, state_len;
    int kv_type; /* KV_* (attn_quant.h): the layout of k_cache and v_cache, fp16 or quantized */
    float softcap; /* ATTN: each score, LOGITS: each logit becomes softcap * tanh(x / softcap) (Gemma 2); 0: none */
    /* OP_MOE (op_moe.c): the router is w (reading act[w_act]); each expert tensor is a table of n_experts
     * matrices; a shared expert's are single matrices (NULL: none), its scale a 1-row matrix (NULL: 1) */
    int n_experts, n_used, moe_gating, moe_normalize;
    int ff, shared_ff;                               /* an expert's and the shared expert's widths */
    const kiln_wmat *const *exp_gate, *const *exp_up, *const *exp_down;
    int exp_act, sh_act, sh_scale_act;               /* act[] the experts, the shared expert, its scale read */
    const kiln_wmat *sh_gate, *sh_up, *sh_down, *sh_scale;
    int down_tiles;                                  /* down projections' tiles per chunk */
    int32_t *moe_route;                              /* routing (op_moe.c), kiln_moe_route_ints */
    float *moe_gates;                                /* [rows][n_experts] logits, [rows][n_used] weights, [rows] */
    uint8_t *moe_x, *moe_h, *moe_hs;                 /* rows gathered by expert; GLU outputs (experts, shared) */
    float *moe_y;                                    /* down projections: [rows*n_used + rows][rows] */
    /* OP_ATTN: a learned logit per query head [n_heads] that joins each query's softmax denominator
     * only (gpt-oss's attention sinks); NULL: none */
    const float *sinks;
    /* OP_MOE: the experts' biases, [n_experts][ff] for gate and up and [n_experts][rows] for down (NULL:
     * none); the router's bias is `bias`, the experts' and shared expert's GLU activation `glu_act` */
    const float *exp_gate_b, *exp_up_b, *exp_down_b;
    /* OP_DELTANET (op_delta.c): in is [rows][cols] of q, k, v; the convolution is conv_w over the rings in
     * state (as SHORTCONV's); dn_mixed [rows][cols] its output, normalized; dn_z [rows][v_heads*v_dim] the
     * output gate (OP_GATE's gate, [rows][cols]); dn_alpha and dn_beta [rows][v_heads]; dn_decay and
     * dn_dt_bias [v_heads]; norm_w [v_dim] and eps the output norm; dn_matrices this layer's
     * [slots][v_heads][k_dim][v_dim]; chunk_heads value heads a chunk */
    const float *dn_z, *dn_alpha, *dn_beta, *dn_decay, *dn_dt_bias;
    float *dn_mixed, *dn_matrices;
    int dn_k_heads, dn_v_heads, dn_k_dim, dn_v_dim;
} kiln_op;

typedef struct kiln_plan kiln_plan;

/* A buffer the plan was handed: what its ops may touch (plan_check.c). */
typedef struct {
    const char *name;
    uint8_t *data;
    size_t nbytes;
} kiln_region;

typedef struct {
    kiln_plan *plan;
    const kiln_op *op;
    int n_rows, n_out;
    /* the op's activation tiles_act as bf16 tiles for this run (ops.h, job_tiles), or NULL */
    const uint16_t *tiles;
    int tiles_act;
} kiln_job;

struct kiln_plan {
    kiln_op *ops;
    kiln_job *jobs; /* one per op */
    int n_ops, cap;
    int max_rows, max_out; /* rows a run may have, and of them with logits */
    int n_ctx, n_slots;
    /* per-row inputs, written by the caller before each run */
    int32_t *tokens, *slots, *positions, *row_sel;
    int32_t *blocks; /* attention: (first row, rows) of each run of one sequence, set at each run */
    int32_t *attn_unit0;   /* attention: each block's first chunk (and the total after the last block) */
    size_t *attn_floats0;  /* attention: where each block's partial results start in attn_partial */
    float *attn_partial;   /* attention: every chunk's (o, m, l) for the merge */
    size_t attn_partial_bytes;
    float *logit_floor; /* output head: per logits row, the floor above which the second rows refine */
    float *remainder_floor; /* split output head: per logits row, the floor above which lo's share is added */
    float *chunk_best;  /* output head: per chunk and logits row, the chunk's largest logit */
    int32_t *refine_chunks; /* output head: the chunks the refinement pass visits */
    int n_blocks;
    int vocab; /* rows of the embedding table (kiln_plan_check) */
    kiln_pool *pool;
    /* per thread scratch_stride floats: scratch_floats, the most any op needs (op_scratch[i] for op i,
     * kiln_op_scratch), between KILN_GUARD_FLOATS guard words either side when guarded */
    float *scratch;
    size_t scratch_floats, scratch_stride, *op_scratch;
    int guard;
    kiln_region *gaps; /* guarded: the bytes past each activation buffer, which no op writes */
    int n_gaps;
    /* the op whose guard broke in the last run, and where: a thread's scratch (before or after it) or gap */
    int overrun_op, overrun_thread, overrun_after, overrun_gap;
    /* tracing: per op, accumulated over runs */
    int trace;
    int64_t *op_ns, *op_wait_ns;
    int64_t runs;
    int64_t *op_t0_ns, *op_t1_ns; /* start and end of each op in the last traced run (kiln_now_ns) */
    int error; /* errno of a failed read of the embedding table during the last run, else 0 */
    /* AMX prefill: one op's activation as bf16 tiles (kiln_bf16_tiles), sized for the widest matrix op at
     * max_rows; NULL where the CPU lacks AMX or max_rows is below KILN_AMX_MIN_TOKENS */
    uint16_t *amx_tiles;
    size_t amx_tiles_bytes;
};

/* Chunks of a QKV op over `heads` heads (q, k and v together) at most `per` a chunk. */
int kiln_qkv_chunks(int heads, int per);

/* Floats of per-thread scratch `op` needs in a plan of `rows` rows, `out_rows` of them with logits. */
size_t kiln_op_scratch(const kiln_op *op, int rows, int out_rows);

typedef struct kiln_bounds kiln_bounds;

/* At plan build (max_rows, max_out, n_ctx, n_slots and the row inputs set): every byte each op will touch
 * lies inside one of `regions`, every matrix is one of `mats` and of the op's shape, and the row inputs
 * hold max_rows rows. Sets plan->vocab. 0, or -1 with `err` naming the op, the field and the buffer. */
int kiln_plan_check(kiln_plan *plan, const kiln_region *regions, int n_regions, const kiln_wmat *const *mats,
                    int n_mats, char *err, size_t err_len);

/* At each run: the row counts, and each row's token, slot, position and logits row in range. */
int kiln_plan_check_step(const kiln_plan *plan, int n_rows, int n_out, char *err, size_t err_len);

/* Guarded plans: write the scratch's guard words (once the scratch is allocated; runs write the gaps'). */
void kiln_plan_guard_fill(kiln_plan *plan);

/* Run the plan over rows [0, n_rows); `n_out` rows listed in row_sel get logits. A guarded plan stops
 * at the first op whose scratch guard broke (overrun_op, else -1). */
int64_t kiln_plan_run(kiln_plan *plan, int n_rows, int n_out);

/* The op kind's name, for messages. */
const char *kiln_op_name(int kind);
