/* Attention of a group of query heads sharing one KV head, over the KV cache (fp16, or a quantized type
 * attn_quant.h lays out). */
#pragma once
#include <stddef.h>
#include <stdint.h>

/* Attention of `rows` consecutive positions pos0.. of one sequence, for the `group` query heads that
 * share one KV head, over the keys in [key_lo, key_hi) only: one part of a context split for the
 * threads. q: row i, head g at q[i*q_stride + g*hd]; K: this head's keys (layout below, or kv_type's in
 * attn_quant.h), V: this head's
 * values, hd per position; keys first..pos are visible to position pos (and within `window` when it is
 * > 0). Scores are scale * q·k, soft-capped to softcap * tanh(s / softcap) when softcap > 0. Query r = i*group + g gets its running max m[r], its sum of exponentials l[r] and its
 * unnormalized output o[r*hd ..] (zero and -inf when it sees no key of the part). next_k (or NULL): the
 * first keys of the part computed after this one, which the last tile prefetches. */
void kiln_attend_part(int kv_type, const float *q, int rows, int group, int hd, int q_stride, const uint8_t *K,
                      const uint8_t *V, int first, int pos0, int window, int key_lo, int key_hi, float scale,
                      float softcap, const uint8_t *next_k, float *scratch, float *o, float *m, float *l);

/* One query's output from its parts' (o, m, l), in part order: out = sum_p o_p e^(m_p - m) / (sum_p
 * l_p e^(m_p - m) [+ e^(sink - m)]) with m the largest m_p (and *sink), negated when `negate` (a debug
 * switch). `sink` (NULL: none) is the head's learned logit that joins the denominator only (gpt-oss's
 * attention sinks): every kernel and cache type merges through here, so none of them knows it. A single
 * part without a sink is exactly o / l. */
void kiln_attend_merge(int n_parts, const float *const *o, const float *const *m, const float *const *l, int hd,
                       int negate, const float *sink, float *out);

/* Floats of scratch kiln_attend_part needs for rows * group queries. */
size_t kiln_attend_scratch(int n_queries, int hd);

/* x[i] = cap * tanh(x[i] / cap): soft-capped scores and logits (vectorized from AVX2 on, ~2e-7 of cap). */
void kiln_softcap(float *x, int n, float cap);

/* fp32 → fp16 with round-to-nearest-even (the KV cache's storage format). */
void kiln_store_half(const float *x, uint16_t *dst, int n);

/* Keys are stored transposed in groups of KEY_GROUP positions: [position / 8][dim][8]. A head's cache
 * holds a whole number of groups (the context is rounded up to a multiple of KEY_GROUP). */
#define KEY_GROUP 8
static inline size_t kiln_key_index(int pos, int d, int hd) {
    return (size_t)(pos / KEY_GROUP) * hd * KEY_GROUP + (size_t)d * KEY_GROUP + pos % KEY_GROUP;
}
void kiln_store_key(const float *x, uint16_t *head_keys, int pos, int hd);
