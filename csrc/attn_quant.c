/* Attention over a q8_0 KV cache (attn_quant.h). The tile loop is kiln_attend_part's; the kernels
 * convert each key's and value's int8 blocks to fp32 in registers and apply the block scale once per
 * block, so no dequantized copy of the cache is ever made. */
#include "attn_quant.h"

#include <math.h>
#include <string.h>

#include "attn.h"
#include "dequant.h"
#include "kernels.h"
#include "vecmath.h"

#define TILE 64 /* keys per tile, a multiple of KEY_GROUP */
#define VALUE_BLOCK_BYTES (2 + KV_BLOCK)

static size_t key_group_bytes(int hd) { return (size_t)hd * KEY_GROUP + (size_t)(hd / KV_BLOCK) * KEY_GROUP * 2; }
static size_t value_row_bytes(int hd) { return (size_t)(hd / KV_BLOCK) * VALUE_BLOCK_BYTES; }

size_t kiln_kv_head_bytes(int kv_type, int n_ctx, int hd) {
    if (kv_type == KV_Q8_0) return (size_t)(n_ctx / KEY_GROUP) * key_group_bytes(hd);
    return (size_t)n_ctx * hd * sizeof(uint16_t);
}

/* One block of 32: its fp16 scale and int8 values, ggml's reference rounding. */
static uint16_t quantize_block_q8(const float *x, int8_t *q, int stride) {
    float amax = 0.0f;
    for (int i = 0; i < KV_BLOCK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < KV_BLOCK; i++) q[i * stride] = (int8_t)roundf(x[i] * id);
    return kiln_float_to_half(d);
}

void kiln_store_key_q8(const float *x, uint8_t *head_keys, int pos, int hd) {
    uint8_t *g = head_keys + (size_t)(pos / KEY_GROUP) * key_group_bytes(hd);
    uint16_t *scales = (uint16_t *)g;
    int8_t *values = (int8_t *)(g + (size_t)(hd / KV_BLOCK) * KEY_GROUP * 2);
    int at = pos % KEY_GROUP;
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        uint16_t d = quantize_block_q8(x + b * KV_BLOCK, values + (size_t)b * KV_BLOCK * KEY_GROUP + at, KEY_GROUP);
        memcpy(scales + b * KEY_GROUP + at, &d, 2);
    }
}

void kiln_store_value_q8(const float *x, uint8_t *head_values, int pos, int hd) {
    uint8_t *row = head_values + (size_t)pos * value_row_bytes(hd);
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        uint8_t *blk = row + (size_t)b * VALUE_BLOCK_BYTES;
        uint16_t d = quantize_block_q8(x + b * KV_BLOCK, (int8_t *)blk + 2, 1);
        memcpy(blk, &d, 2);
    }
}

static inline float scale_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return kiln_half_to_float(h);
}

typedef struct {
    /* s[r * TILE + j] = dot(q[r], key j) for r < nq, j < nk (a multiple of KEY_GROUP); kg: the first
     * key's group, v: the first key's values and next: the keys after this tile, for prefetching */
    void (*scores)(const float *q, int nq, int hd, const uint8_t *kg, int nk, const uint8_t *v, const uint8_t *next,
                   float *s);
    /* o[r] += sum_j p[r * TILE + j] * v[j] for r < nq */
    void (*accumulate)(const float *p, int nq, int nk, const uint8_t *v, int hd, float *o);
    void (*exp_row)(float *x, int n, float shift);
} quant_kernels;

/* ---- portable reference: per block, the sum of q * int8, then times the block's scale ---- */

static void scores_generic(const float *q, int nq, int hd, const uint8_t *kg, int nk, const uint8_t *v,
                           const uint8_t *next, float *s) {
    (void)v, (void)next;
    const size_t gb = key_group_bytes(hd), sb = (size_t)(hd / KV_BLOCK) * KEY_GROUP * 2;
    for (int r = 0; r < nq; r++)
        for (int j = 0; j < nk; j++) {
            const uint8_t *g = kg + (size_t)(j / KEY_GROUP) * gb;
            const int8_t *x = (const int8_t *)(g + sb);
            float acc = 0.0f;
            for (int b = 0; b < hd / KV_BLOCK; b++) {
                float blk = 0.0f;
                for (int d = b * KV_BLOCK; d < (b + 1) * KV_BLOCK; d++) blk += q[r * hd + d] * x[d * KEY_GROUP + j % KEY_GROUP];
                acc += blk * scale_at(g + (size_t)(b * KEY_GROUP + j % KEY_GROUP) * 2);
            }
            s[r * TILE + j] = acc;
        }
}

static void accumulate_generic(const float *p, int nq, int nk, const uint8_t *v, int hd, float *o) {
    const size_t rb = value_row_bytes(hd);
    for (int j = 0; j < nk; j++)
        for (int b = 0; b < hd / KV_BLOCK; b++) {
            const uint8_t *blk = v + (size_t)j * rb + (size_t)b * VALUE_BLOCK_BYTES;
            const int8_t *x = (const int8_t *)blk + 2;
            float d = scale_at(blk);
            for (int r = 0; r < nq; r++) {
                float c = p[r * TILE + j] * d;
                for (int i = 0; i < KV_BLOCK; i++) o[r * hd + b * KV_BLOCK + i] += c * x[i];
            }
        }
}

static void exp_generic(float *x, int n, float shift) {
    for (int i = 0; i < n; i++) x[i] = expf(x[i] - shift);
}

static const quant_kernels GENERIC = {scores_generic, accumulate_generic, exp_generic};

/* ---- AVX2 (also what the AVX-512 and AMX variants run) ---- */
#if defined(KILN_X86)

static inline __attribute__((target("avx2,fma,f16c"))) __m256 load8q(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* nq (1..4, a constant once inlined) queries × one group of 8 keys: per dimension one 8-byte load feeds
 * nq FMAs into the block's sums, which the block's 8 scales multiply into the totals. */
static inline __attribute__((always_inline, target("avx2,fma,f16c"))) void scores_8(const float *q, int nq, int hd,
                                                                                 const uint8_t *g, float *s) {
    const int8_t *x = (const int8_t *)(g + (size_t)(hd / KV_BLOCK) * KEY_GROUP * 2);
    __m256 tot[4], blk[4];
    for (int r = 0; r < nq; r++) tot[r] = _mm256_setzero_ps();
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        for (int r = 0; r < nq; r++) blk[r] = _mm256_setzero_ps();
        for (int d = b * KV_BLOCK; d < (b + 1) * KV_BLOCK; d++) {
            __m256 k = load8q(x + d * KEY_GROUP);
            for (int r = 0; r < nq; r++) blk[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + r * hd + d), k, blk[r]);
        }
        __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + (size_t)b * KEY_GROUP * 2)));
        for (int r = 0; r < nq; r++) tot[r] = _mm256_fmadd_ps(blk[r], sc, tot[r]);
    }
    for (int r = 0; r < nq; r++) _mm256_storeu_ps(s + r * TILE, tot[r]);
}

static inline __attribute__((target("avx2"))) void prefetch_span(const uint8_t *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T0);
}

AVX2 static void scores_avx2(const float *q, int nq, int hd, const uint8_t *kg, int nk, const uint8_t *v,
                             const uint8_t *next, float *s) {
    const size_t gb = key_group_bytes(hd), rb = value_row_bytes(hd);
    for (int j = 0; j < nk; j += KEY_GROUP) {
        const uint8_t *g = kg + (size_t)(j / KEY_GROUP) * gb;
        /* as in attn.c: the matrix ops between attention ops evict the cache, so fetch these keys'
         * values (accumulated next) and the same group of the next tile while scoring */
        prefetch_span(v + (size_t)j * rb, rb * KEY_GROUP);
        prefetch_span(next + (size_t)(j / KEY_GROUP) * gb, gb);
        int r = 0;
        for (; r + 4 <= nq; r += 4) scores_8(q + r * hd, 4, hd, g, s + r * TILE + j);
        switch (nq - r) {
        case 3: scores_8(q + r * hd, 3, hd, g, s + r * TILE + j); break;
        case 2: scores_8(q + r * hd, 2, hd, g, s + r * TILE + j); break;
        case 1: scores_8(q + r * hd, 1, hd, g, s + r * TILE + j); break;
        }
    }
}

/* nq (1..4) queries × one block of 32 dimensions: each value block is converted once for every query,
 * its scale folded into the probability. */
static inline __attribute__((always_inline, target("avx2,fma,f16c"))) void accumulate_32(const float *p, int nq, int nk,
                                                                                      const uint8_t *v, size_t rb,
                                                                                      int hd, float *o) {
    __m256 a[4][4];
    for (int r = 0; r < nq; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm256_loadu_ps(o + r * hd + c * 8);
    for (int j = 0; j < nk; j++) {
        const uint8_t *blk = v + (size_t)j * rb;
        const int8_t *x = (const int8_t *)blk + 2;
        uint16_t h;
        memcpy(&h, blk, 2);
        float d = _cvtsh_ss(h);
        __m256 x0 = load8q(x), x1 = load8q(x + 8), x2 = load8q(x + 16), x3 = load8q(x + 24);
        for (int r = 0; r < nq; r++) {
            __m256 c = _mm256_set1_ps(p[r * TILE + j] * d);
            a[r][0] = _mm256_fmadd_ps(c, x0, a[r][0]), a[r][1] = _mm256_fmadd_ps(c, x1, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(c, x2, a[r][2]), a[r][3] = _mm256_fmadd_ps(c, x3, a[r][3]);
        }
    }
    for (int r = 0; r < nq; r++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + r * hd + c * 8, a[r][c]);
}

AVX2 static void accumulate_avx2(const float *p, int nq, int nk, const uint8_t *v, int hd, float *o) {
    const size_t rb = value_row_bytes(hd);
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        const uint8_t *vb = v + (size_t)b * VALUE_BLOCK_BYTES;
        int r = 0;
        /* two queries at a time: 8 accumulators, 4 values and a coefficient fit the 16 registers */
        for (; r + 2 <= nq; r += 2) accumulate_32(p + r * TILE, 2, nk, vb, rb, hd, o + r * hd + b * KV_BLOCK);
        if (r < nq) accumulate_32(p + r * TILE, 1, nk, vb, rb, hd, o + r * hd + b * KV_BLOCK);
    }
}

AVX2 static void exp_avx2(float *x, int n, float shift) {
    __m256 s = _mm256_set1_ps(shift);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
    for (; i < n; i++) x[i] = expf(x[i] - shift);
}

static const quant_kernels AVX2_KERNELS = {scores_avx2, accumulate_avx2, exp_avx2};

/* ---- AVX-512: the AVX2 kernels' arithmetic lane for lane (the same bits), 16 lanes per instruction ---- */
#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

/* Two groups of 8 keys (16 keys) × nq (1..4) queries: the int8 conversion is what a q8_0 cache pays over
 * fp16, and here one sign-extend and one convert serve 16 keys. */
static inline __attribute__((always_inline, target("avx2,fma,f16c,avx512f,avx512bw,avx512vl"))) void
scores_16_512(const float *q, int nq, int hd, const uint8_t *g0, const uint8_t *g1, float *s) {
    const size_t sb = (size_t)(hd / KV_BLOCK) * KEY_GROUP * 2;
    const int8_t *x0 = (const int8_t *)(g0 + sb), *x1 = (const int8_t *)(g1 + sb);
    __m512 tot[4], blk[4];
    for (int r = 0; r < nq; r++) tot[r] = _mm512_setzero_ps();
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        for (int r = 0; r < nq; r++) blk[r] = _mm512_setzero_ps();
        for (int d = b * KV_BLOCK; d < (b + 1) * KV_BLOCK; d++) {
            __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(x0 + d * KEY_GROUP)),
                                              _mm_loadl_epi64((const __m128i *)(x1 + d * KEY_GROUP)));
            __m512 k = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(both));
            for (int r = 0; r < nq; r++) blk[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * hd + d]), k, blk[r]);
        }
        __m256i sc16 = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(g1 + (size_t)b * KEY_GROUP * 2)),
                                        _mm_loadu_si128((const __m128i *)(g0 + (size_t)b * KEY_GROUP * 2)));
        __m512 sc = _mm512_cvtph_ps(sc16);
        for (int r = 0; r < nq; r++) tot[r] = _mm512_fmadd_ps(blk[r], sc, tot[r]);
    }
    for (int r = 0; r < nq; r++) _mm512_storeu_ps(s + r * TILE, tot[r]);
}

AVX512 static void scores_avx512(const float *q, int nq, int hd, const uint8_t *kg, int nk, const uint8_t *v,
                                 const uint8_t *next, float *s) {
    const size_t gb = key_group_bytes(hd), rb = value_row_bytes(hd);
    int j = 0;
    for (; j + 16 <= nk; j += 16) {
        const uint8_t *g = kg + (size_t)(j / KEY_GROUP) * gb;
        prefetch_span(v + (size_t)j * rb, rb * 16); /* as scores_avx2 does */
        prefetch_span(next + (size_t)(j / KEY_GROUP) * gb, 2 * gb);
        int r = 0;
        for (; r + 4 <= nq; r += 4) scores_16_512(q + r * hd, 4, hd, g, g + gb, s + r * TILE + j);
        switch (nq - r) {
        case 3: scores_16_512(q + r * hd, 3, hd, g, g + gb, s + r * TILE + j); break;
        case 2: scores_16_512(q + r * hd, 2, hd, g, g + gb, s + r * TILE + j); break;
        case 1: scores_16_512(q + r * hd, 1, hd, g, g + gb, s + r * TILE + j); break;
        }
    }
    if (j < nk) scores_avx2(q, nq, hd, kg + (size_t)(j / KEY_GROUP) * gb, nk - j, v + (size_t)j * rb,
                            next + (size_t)(j / KEY_GROUP) * gb, s + j);
}

/* nq (1..4) queries × one block of 32 dimensions, two zmm of values per key. */
static inline __attribute__((always_inline, target("avx2,fma,f16c,avx512f,avx512bw,avx512vl"))) void
accumulate_32_512(const float *p, int nq, int nk, const uint8_t *v, size_t rb, int hd, float *o) {
    __m512 a[4][2];
    for (int r = 0; r < nq; r++) a[r][0] = _mm512_loadu_ps(o + r * hd), a[r][1] = _mm512_loadu_ps(o + r * hd + 16);
    for (int j = 0; j < nk; j++) {
        const uint8_t *blk = v + (size_t)j * rb;
        const int8_t *x = (const int8_t *)blk + 2;
        uint16_t h;
        memcpy(&h, blk, 2);
        float d = _cvtsh_ss(h);
        __m512 x0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x)));
        __m512 x1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x + 16))));
        for (int r = 0; r < nq; r++) {
            __m512 c = _mm512_set1_ps(p[r * TILE + j] * d);
            a[r][0] = _mm512_fmadd_ps(c, x0, a[r][0]), a[r][1] = _mm512_fmadd_ps(c, x1, a[r][1]);
        }
    }
    for (int r = 0; r < nq; r++) _mm512_storeu_ps(o + r * hd, a[r][0]), _mm512_storeu_ps(o + r * hd + 16, a[r][1]);
}

AVX512 static void accumulate_avx512(const float *p, int nq, int nk, const uint8_t *v, int hd, float *o) {
    const size_t rb = value_row_bytes(hd);
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        const uint8_t *vb = v + (size_t)b * VALUE_BLOCK_BYTES;
        int r = 0;
        for (; r + 4 <= nq; r += 4) accumulate_32_512(p + r * TILE, 4, nk, vb, rb, hd, o + r * hd + b * KV_BLOCK);
        switch (nq - r) {
        case 3: accumulate_32_512(p + r * TILE, 3, nk, vb, rb, hd, o + r * hd + b * KV_BLOCK); break;
        case 2: accumulate_32_512(p + r * TILE, 2, nk, vb, rb, hd, o + r * hd + b * KV_BLOCK); break;
        case 1: accumulate_32_512(p + r * TILE, 1, nk, vb, rb, hd, o + r * hd + b * KV_BLOCK); break;
        }
    }
}

static const quant_kernels AVX512_KERNELS = {scores_avx512, accumulate_avx512, exp_avx2};
#endif

static const quant_kernels *kernels(void) {
#if defined(KILN_X86)
    if (kiln_active_isa() >= ISA_AVX512) return &AVX512_KERNELS;
    if (kiln_active_isa() >= ISA_AVX2) return &AVX2_KERNELS;
#endif
    return &GENERIC;
}

void kiln_attend_part_q8(const float *q, int rows, int group, int hd, int q_stride, const uint8_t *K, const uint8_t *V,
                         int first, int pos0, int window, int key_lo, int key_hi, float scale, float softcap,
                         const uint8_t *next_k,
                         float *scratch, float *o, float *m, float *l) {
    const quant_kernels *k = kernels();
    const size_t gb = key_group_bytes(hd), rb = value_row_bytes(hd);
    int nq = rows * group, last = pos0 + rows - 1 < key_hi - 1 ? pos0 + rows - 1 : key_hi - 1;
    if (first < key_lo) first = key_lo;
    float *s = scratch, *qs = s + (size_t)nq * TILE; /* kiln_attend_scratch's layout */
    memset(o, 0, sizeof(float) * (size_t)nq * hd);
    for (int r = 0; r < nq; r++) m[r] = -INFINITY, l[r] = 0.0f;
    for (int i = 0; i < rows; i++)
        for (int g = 0; g < group; g++)
            for (int d = 0; d < hd; d++) qs[(i * group + g) * hd + d] = q[(size_t)i * q_stride + g * hd + d] * scale;
    for (int j0 = first - first % KEY_GROUP; j0 <= last; j0 += TILE) {
        int nk = last - j0 + 1 < TILE ? last - j0 + 1 : TILE;
        int nk_groups = (nk + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
        const uint8_t *kg = K + (size_t)(j0 / KEY_GROUP) * gb, *after = kg + (size_t)(TILE / KEY_GROUP) * gb;
        k->scores(qs, nq, hd, kg, nk_groups, V + (size_t)j0 * rb, j0 + TILE <= last || !next_k ? after : next_k, s);
        for (int i = 0; i < rows; i++) {
            int pos = pos0 + i, lo = window > 0 && pos - window + 1 > first ? pos - window + 1 : first;
            int hi = pos < last ? pos : last;
            int a = lo - j0 > 0 ? lo - j0 : 0, b = hi - j0 + 1 < nk ? hi - j0 + 1 : nk; /* visible [a, b) */
            for (int g = 0; g < group; g++) {
                int r = i * group + g;
                float *sr = s + (size_t)r * TILE;
                if (b <= a) {
                    memset(sr, 0, sizeof(float) * nk);
                    continue;
                }
                memset(sr, 0, sizeof(float) * a);
                memset(sr + b, 0, sizeof(float) * (nk - b));
                if (softcap > 0.0f) kiln_softcap(sr + a, b - a, softcap);
                float mx = m[r];
                for (int j = a; j < b; j++) mx = sr[j] > mx ? sr[j] : mx;
                float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
                k->exp_row(sr + a, b - a, mx);
                float sum = 0.0f;
                for (int j = a; j < b; j++) sum += sr[j];
                l[r] = l[r] * corr + sum;
                m[r] = mx;
                if (corr != 1.0f)
                    for (int d = 0; d < hd; d++) o[(size_t)r * hd + d] *= corr;
            }
        }
        k->accumulate(s, nq, nk, V + (size_t)j0 * rb, hd, o);
    }
}
