/* The KV cache's types and layouts: fp16 (attn.h) or ggml's q8_0 and q4_0 blocks (32 values, one fp16
 * scale) per head row, stored as the QKV op writes them and read by attention directly, a tile at a
 * time. */
#pragma once
#include <stddef.h>
#include <stdint.h>

/* kiln_op.kv_type; KV_NAMES (attn_quant.c) names them for Python, which takes the list from here */
enum { KV_F16, KV_Q8_0, KV_Q4_0, KV_COUNT };
extern const char *const KV_NAMES[KV_COUNT];

#define KV_BLOCK 32 /* values per quantization block; a quantized cache needs head_dim a multiple of it */

/* Bytes of one KV head's keys (or values) for n_ctx positions (a whole number of key groups). */
size_t kiln_kv_head_bytes(int kv_type, int n_ctx, int hd);
/* Bytes of one group of KEY_GROUP keys, and of one position's values. */
size_t kiln_kv_key_group_bytes(int kv_type, int hd);
size_t kiln_kv_value_row_bytes(int kv_type, int hd);

/* A quantized cache holds its rows in a rotated basis: y = H x per block of 32, H the orthonormal
 * Walsh-Hadamard matrix (H = H^T = H^-1), which spreads an outlier channel over its block so that it no
 * longer sets a coarse step for the other 31 values. Scores are unchanged when the queries are rotated
 * too (Hq . Hk = q . k), and H applied to the attention output undoes it (sum p Hv = H sum p v). The
 * stores rotate the rows they are given; the QKV op rotates the queries it hands attention over such a
 * cache, and attention rotates each output back after merging its parts. n: a multiple of 32; y may be x. */
void kiln_kv_rotate(const float *x, float *y, int n);

/* Quantized keys keep attn.h's groups of KEY_GROUP positions: a group is the fp16 scales
 * [hd / 32][KEY_GROUP], then per block of 32 dimensions its codes [code bytes][KEY_GROUP] (q8_0: one
 * int8 a dimension; q4_0: byte i holds dimension i in its low nibble and i + 16 in its high one, as
 * block_q4_0 pairs them). Values are by position, each row hd / 32 ggml blocks (block_q8_0 or
 * block_q4_0: fp16 scale, then the codes). Rounding is ggml's reference quantizers': q8_0 d = amax / 127,
 * q = roundf(x / d); q4_0 d = max / -8 (max the value of largest magnitude), q = min(15, (int)(x / d +
 * 8.5)), read back as d * (q - 8); the scale stored as fp16. Each row is rotated (kiln_kv_rotate) before
 * it is rounded. */
void kiln_store_key_quant(int kv_type, const float *x, uint8_t *head_keys, int pos, int hd);
void kiln_store_value_quant(int kv_type, const float *x, uint8_t *head_values, int pos, int hd);

/* A cache type's share of kiln_attend_part's tile loop (attn.c): kg points at the first key's group, v
 * at the first key's values, next at the keys wanted after this tile (for prefetching). */
typedef struct {
    /* s[r * ATTN_TILE + j] = dot(q[r], key j) for r < nq, j < nk (a multiple of KEY_GROUP) */
    void (*scores)(const float *q, int nq, int hd, const uint8_t *kg, int nk, const uint8_t *v, const uint8_t *next,
                   float *s);
    /* o[r] += sum_j p[r * ATTN_TILE + j] * v[j] for r < nq */
    void (*accumulate)(const float *p, int nq, int nk, const uint8_t *v, int hd, float *o);
} kiln_kv_kernels;

#define ATTN_TILE 64 /* keys per tile, a multiple of KEY_GROUP */

/* The fp16 cache's kernels for an ISA (kiln_isa), a block of nq queries and head dim hd: up to
 * ATTN_FEW_QUERIES (a decode step's GQA group) convert in registers (AVX2, and AVX-512's "few" kernels);
 * more, from AVX-512 on, convert each tile once into fp32 on the stack (attn_avx512.c), for head dims up to
 * ATTN_WIDE_MAX_HD (a tile's keys and values then take 128 KB). The same bits either way. */
#define ATTN_FEW_QUERIES 4
#define ATTN_WIDE_MAX_HD 256
const kiln_kv_kernels *kiln_f16_kernels(int isa, int nq, int hd);
void kiln_scores_avx512(const float *q, int nq, int hd, const uint8_t *kg, int nk, const uint8_t *v, const uint8_t *next,
                        float *s);
void kiln_accumulate_avx512(const float *p, int nq, int nk, const uint8_t *v, int hd, float *o);
void kiln_scores_few_avx512(const float *q, int nq, int hd, const uint8_t *kg, int nk, const uint8_t *v,
                            const uint8_t *next, float *s);
void kiln_accumulate_few_avx512(const float *p, int nq, int nk, const uint8_t *v, int hd, float *o);

/* The kernels of a quantized cache type for the active ISA. */
const kiln_kv_kernels *kiln_kv_quant_kernels(int kv_type);
