/* Attention of a group of query heads sharing one KV head, over an fp16 KV cache. */
#pragma once
#include <stdint.h>

/* q: group × hd floats; K, V: n positions of hd fp16 values, `stride` values apart; out: group × hd
 * (negated when `negate`, a debug switch). scratch: at least group * (n + hd) + hd floats. */
void kiln_attend(const float *q, int group, int hd, const uint16_t *K, const uint16_t *V, int stride, int n,
                 float scale, float *scratch, float *out, int negate);

/* fp32 → fp16 with round-to-nearest-even (the KV cache's storage format). */
void kiln_store_half(const float *x, uint16_t *dst, int n);
void kiln_load_half(const uint16_t *src, float *x, int n);
