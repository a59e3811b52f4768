/* The quantized KV cache: keys and values as ggml's q8_0 blocks (32 values, one fp16 scale) per head
 * row, stored as the QKV op writes them and read by attention directly, a tile at a time. */
#pragma once
#include <stddef.h>
#include <stdint.h>

/* kiln_op.kv_type */
enum { KV_F16, KV_Q8_0, KV_COUNT };

#define KV_BLOCK 32 /* values per quantization block; a quantized cache needs head_dim a multiple of it */

/* Bytes of one KV head's keys (or values) for n_ctx positions (a whole number of key groups). */
size_t kiln_kv_head_bytes(int kv_type, int n_ctx, int hd);

/* q8_0 keys keep attn.h's groups of KEY_GROUP positions: a group is the fp16 scales
 * [hd / 32][KEY_GROUP], then the int8 values [hd][KEY_GROUP]. Values are by position, each row hd / 32
 * ggml block_q8_0s (fp16 scale, 32 int8). Rounding is ggml's quantize_row_q8_0_ref: d = amax / 127,
 * q = roundf(x / d), the scale stored as fp16. */
void kiln_store_key_q8(const float *x, uint8_t *head_keys, int pos, int hd);
void kiln_store_value_q8(const float *x, uint8_t *head_values, int pos, int hd);

/* kiln_attend_part (attn.h) over a q8_0 head: K and V this head's keys and values, next_k the bytes the
 * last tile prefetches. */
void kiln_attend_part_q8(const float *q, int rows, int group, int hd, int q_stride, const uint8_t *K, const uint8_t *V,
                         int first, int pos0, int window, int key_lo, int key_hi, float scale, float softcap,
                         const uint8_t *next_k,
                         float *scratch, float *o, float *m, float *l);
