/* Attention over the KV cache, flash-attention style: keys and values are taken in tiles shared by
 * every query of a block (the heads of a GQA group times consecutive rows of one sequence in prefill),
 * with a running max and sum per query so a whole context's scores are never stored. The tile loop and
 * its softmax serve every cache type; a type supplies the scores and the weighted sum of values
 * (kiln_kv_kernels: fp16 here, the quantized types in attn_quant.c).
 *
 * Keys are stored transposed in groups of 8 positions ([position/8][dim][8]), so 8 keys' values of one
 * dimension are one 16-byte load: scores are broadcast-FMAs with no horizontal sums and no staging.
 * Values are stored by position ([position][dim]) for the probability-weighted sum. */
#include "attn.h"
#include "attn_quant.h"

#include <math.h>
#include <string.h>

#include "dequant.h"
#include "kernels.h"
#include "vecmath.h"

#define TILE ATTN_TILE

/* The steps of the tile loop that depend on no cache type. */
typedef struct {
    void (*exp_row)(float *x, int n, float shift); /* x[i] = exp(x[i] - shift) */
    void (*cap_row)(float *x, int n, float cap);   /* x[i] = cap * tanh(x[i] / cap) */
} softmax_kernels;

/* ---- portable reference ---- */

static void scores_generic(const float *q, int nq, int hd, const uint8_t *kg_bytes, int nk, const uint8_t *v,
                           const uint8_t *next, float *s) {
    (void)v, (void)next;
    const uint16_t *kg = (const uint16_t *)kg_bytes;
    for (int r = 0; r < nq; r++)
        for (int j = 0; j < nk; j++) {
            float acc = 0.0f;
            for (int d = 0; d < hd; d++) acc += q[r * hd + d] * kiln_half_to_float(kg[kiln_key_index(j, d, hd)]);
            s[r * TILE + j] = acc;
        }
}

static void accumulate_generic(const float *p, int nq, int nk, const uint8_t *v_bytes, int hd, float *o) {
    const uint16_t *v = (const uint16_t *)v_bytes;
    for (int j = 0; j < nk; j++)
        for (int d = 0; d < hd; d++) {
            float x = kiln_half_to_float(v[(size_t)j * hd + d]);
            for (int r = 0; r < nq; r++) o[r * hd + d] += p[r * TILE + j] * x;
        }
}

static void exp_generic(float *x, int n, float shift) {
    for (int i = 0; i < n; i++) x[i] = expf(x[i] - shift);
}

static void cap_generic(float *x, int n, float cap) {
    for (int i = 0; i < n; i++) x[i] = cap * tanhf(x[i] * (1.0f / cap));
}

static const kiln_kv_kernels F16_GENERIC = {scores_generic, accumulate_generic};
static const softmax_kernels SOFTMAX_GENERIC = {exp_generic, cap_generic};

/* ---- AVX2 ---- */
#if defined(KILN_X86)

static inline __attribute__((target("avx2,fma,f16c"))) __m256 load8h(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* nq (1..4, a constant once inlined) queries × 16 keys: per dimension, 2 key loads feed 2·nq FMAs, so
 * the keys of a GQA group's 3 query heads are converted once, not once per head. Unless pa is NULL, one
 * cache line is prefetched into L2 per dimension, alternately from pa and pb (hd/2 lines of each: 16 keys'
 * worth); fetches into L1 stall on its few miss buffers. */
static inline __attribute__((always_inline, target("avx2,fma,f16c"))) void scores_16(const float *q, int nq, int hd,
                                                                                  const uint16_t *k0, const uint16_t *k1,
                                                                                  const char *pa, const char *pb,
                                                                                  float *s) {
    __m256 a[4], b[4];
    for (int r = 0; r < nq; r++) a[r] = b[r] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d++) {
        if (pa) _mm_prefetch((d & 1 ? pb : pa) + (d >> 1) * 64, _MM_HINT_T1);
        __m256 x0 = load8h(k0 + d * KEY_GROUP), x1 = load8h(k1 + d * KEY_GROUP);
        for (int r = 0; r < nq; r++) {
            __m256 c = _mm256_broadcast_ss(q + r * hd + d);
            a[r] = _mm256_fmadd_ps(c, x0, a[r]), b[r] = _mm256_fmadd_ps(c, x1, b[r]);
        }
    }
    for (int r = 0; r < nq; r++) _mm256_storeu_ps(s + r * TILE, a[r]), _mm256_storeu_ps(s + r * TILE + 8, b[r]);
}

AVX2 static void scores_avx2(const float *q, int nq, int hd, const uint8_t *kg_bytes, int nk, const uint8_t *v_bytes,
                             const uint8_t *next_bytes, float *s) {
    const uint16_t *kg = (const uint16_t *)kg_bytes, *v = (const uint16_t *)v_bytes, *next = (const uint16_t *)next_bytes;
    const size_t group = (size_t)hd * KEY_GROUP;
    int j = 0;
    for (; j + 16 <= nk; j += 16) {
        const uint16_t *k0 = kg + (j / KEY_GROUP) * group, *k1 = k0 + group;
        /* The matrix ops between two attention ops stream far more than the caches hold, so the KV cache
         * comes from memory: while these 16 keys are scored, fetch their values (accumulated next) and
         * the same 16 keys of the next tile, or after the last tile the next chunk's first (once:
         * prefill's further query blocks find them fetched). Prefetching past the context's end is
         * harmless. */
        const char *pv = (const char *)(v + (size_t)j * hd), *pk = (const char *)(next + (j / KEY_GROUP) * group);
        int r = 0;
        for (; r + 4 <= nq; r += 4, pv = pk = NULL) scores_16(q + r * hd, 4, hd, k0, k1, pv, pk, s + r * TILE + j);
        switch (nq - r) {
        case 3: scores_16(q + r * hd, 3, hd, k0, k1, pv, pk, s + r * TILE + j); break;
        case 2: scores_16(q + r * hd, 2, hd, k0, k1, pv, pk, s + r * TILE + j); break;
        case 1: scores_16(q + r * hd, 1, hd, k0, k1, pv, pk, s + r * TILE + j); break;
        }
    }
    for (; j < nk; j += KEY_GROUP) {
        const uint16_t *k0 = kg + (j / KEY_GROUP) * group;
        for (int r = 0; r < nq; r++) {
            __m256 a = _mm256_setzero_ps();
            for (int d = 0; d < hd; d++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(q + r * hd + d), load8h(k0 + d * KEY_GROUP), a);
            _mm256_storeu_ps(s + r * TILE + j, a);
        }
    }
}

/* nq (1..4) queries × 16 dimensions: each value is converted once and used by every query. */
static inline __attribute__((always_inline, target("avx2,fma,f16c"))) void accumulate_16(const float *p, int nq, int nk,
                                                                                      const uint16_t *v, int hd,
                                                                                      float *o) {
    __m256 a[4], b[4];
    for (int r = 0; r < nq; r++) a[r] = _mm256_loadu_ps(o + r * hd), b[r] = _mm256_loadu_ps(o + r * hd + 8);
    for (int j = 0; j < nk; j++) {
        __m256 v0 = load8h(v + (size_t)j * hd), v1 = load8h(v + (size_t)j * hd + 8);
        for (int r = 0; r < nq; r++) {
            __m256 pr = _mm256_broadcast_ss(p + r * TILE + j);
            a[r] = _mm256_fmadd_ps(pr, v0, a[r]), b[r] = _mm256_fmadd_ps(pr, v1, b[r]);
        }
    }
    for (int r = 0; r < nq; r++) _mm256_storeu_ps(o + r * hd, a[r]), _mm256_storeu_ps(o + r * hd + 8, b[r]);
}

/* hd is a multiple of 16 on this path. */
AVX2 static void accumulate_avx2(const float *p, int nq, int nk, const uint8_t *v_bytes, int hd, float *o) {
    const uint16_t *v = (const uint16_t *)v_bytes;
    for (int d = 0; d < hd; d += 16) {
        int r = 0;
        for (; r + 4 <= nq; r += 4) accumulate_16(p + r * TILE, 4, nk, v + d, hd, o + r * hd + d);
        switch (nq - r) {
        case 3: accumulate_16(p + r * TILE, 3, nk, v + d, hd, o + r * hd + d); break;
        case 2: accumulate_16(p + r * TILE, 2, nk, v + d, hd, o + r * hd + d); break;
        case 1: accumulate_16(p + r * TILE, 1, nk, v + d, hd, o + r * hd + d); break;
        }
    }
}

AVX2 static void exp_avx2(float *x, int n, float shift) {
    __m256 s = _mm256_set1_ps(shift);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
    for (; i < n; i++) x[i] = expf(x[i] - shift);
}

AVX2 static void store_avx2(const float *x, uint16_t *dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = kiln_float_to_half(x[i]);
}

/* The tail takes the vector path too, so a value's bits do not depend on where a chunk or tile ends. */
AVX2 static void cap_avx2(float *x, int n, float cap) {
    __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.0f / cap);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(c, tanh256(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv))));
    if (i < n) {
        float tail[8] = {0};
        memcpy(tail, x + i, sizeof(float) * (n - i));
        _mm256_storeu_ps(tail, _mm256_mul_ps(c, tanh256(_mm256_mul_ps(_mm256_loadu_ps(tail), inv))));
        memcpy(x + i, tail, sizeof(float) * (n - i));
    }
}

static const kiln_kv_kernels F16_AVX2 = {scores_avx2, accumulate_avx2};
static const softmax_kernels SOFTMAX_AVX2 = {exp_avx2, cap_avx2};
#endif

/* The vector kernels take 16 dimensions at a time (a quantized cache's 32 always are). */
static int vector_path(int hd) {
#if defined(KILN_X86)
    return kiln_active_isa() >= ISA_AVX2 && hd % 16 == 0;
#else
    (void)hd;
    return 0;
#endif
}

#if defined(KILN_X86)
static const kiln_kv_kernels F16_AVX512 = {kiln_scores_avx512, kiln_accumulate_avx512};
static const kiln_kv_kernels F16_FEW_AVX512 = {kiln_scores_few_avx512, kiln_accumulate_few_avx512};
#endif

const kiln_kv_kernels *kiln_f16_kernels(int isa, int nq, int hd) {
#if defined(KILN_X86)
    if (isa >= ISA_AVX512 && nq <= ATTN_FEW_QUERIES) return &F16_FEW_AVX512;
    if (isa >= ISA_AVX512 && hd <= ATTN_WIDE_MAX_HD) return &F16_AVX512;
    if (isa >= ISA_AVX2) return &F16_AVX2;
#else
    (void)isa, (void)nq, (void)hd;
#endif
    return &F16_GENERIC;
}

static const kiln_kv_kernels *kv_kernels_for(int kv_type, int hd, int nq) {
    if (kv_type != KV_F16) return kiln_kv_quant_kernels(kv_type);
    return kiln_f16_kernels(vector_path(hd) ? kiln_active_isa() : ISA_GENERIC, nq, hd);
}

static const softmax_kernels *softmax_for(int hd) {
#if defined(KILN_X86)
    if (vector_path(hd)) return &SOFTMAX_AVX2;
#endif
    return &SOFTMAX_GENERIC;
}

void kiln_softcap(float *x, int n, float cap) {
#if defined(KILN_X86)
    if (kiln_active_isa() >= ISA_AVX2) {
        cap_avx2(x, n, cap);
        return;
    }
#endif
    cap_generic(x, n, cap);
}

void kiln_store_half(const float *x, uint16_t *dst, int n) {
#if defined(KILN_X86)
    if (kiln_active_isa() >= ISA_AVX2) {
        store_avx2(x, dst, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++) dst[i] = kiln_float_to_half(x[i]);
}

void kiln_store_key(const float *x, uint16_t *head_keys, int pos, int hd) {
    uint16_t half[hd];
    kiln_store_half(x, half, hd);
    for (int d = 0; d < hd; d++) head_keys[kiln_key_index(pos, d, hd)] = half[d];
}

size_t kiln_attend_scratch(int n_queries, int hd) { return (size_t)n_queries * (TILE + hd + 1); }

/* One tile's scores of a query, visible in [a, b) of its nk, into exponentials against its running max m
 * (updated); the rest of the row zero. Returns the factor its sum and output so far take (1: no key seen,
 * nothing changes). The online softmax, for every cache type. */
static float softmax_exp(const softmax_kernels *k, float *sr, int nk, int a, int b, float softcap, float *m) {
    if (b <= a) {
        memset(sr, 0, sizeof(float) * nk);
        return 1.0f;
    }
    memset(sr, 0, sizeof(float) * a);
    memset(sr + b, 0, sizeof(float) * (nk - b));
    if (softcap > 0.0f) k->cap_row(sr + a, b - a, softcap);
    float mx[4] = {*m, *m, *m, *m}; /* four chains: the largest value does not depend on the order */
    int j = a;
    for (; j + 4 <= b; j += 4)
        for (int u = 0; u < 4; u++) mx[u] = sr[j + u] > mx[u] ? sr[j + u] : mx[u];
    for (; j < b; j++) mx[0] = sr[j] > mx[0] ? sr[j] : mx[0];
    float top = mx[0];
    for (int u = 1; u < 4; u++) top = mx[u] > top ? mx[u] : top;
    float corr = *m == -INFINITY ? 0.0f : expf(*m - top);
    k->exp_row(sr + a, b - a, top);
    *m = top;
    return corr;
}

/* Sums of n (a constant once inlined) rows of nk exponentials, each added in key order: the zeros outside
 * a row's visible keys leave its sum's bits as they are, and n rows at once are n independent chains. */
static inline __attribute__((always_inline)) void row_sums(const float *s, int n, int nk, float *sum) {
    float acc[8] = {0};
    for (int j = 0; j < nk; j++)
        for (int u = 0; u < n; u++) acc[u] += s[u * TILE + j];
    for (int u = 0; u < n; u++) sum[u] = acc[u];
}

/* The tile's sums into the queries' l, rescaling l and the outputs so far by each one's corr. */
static void softmax_sums(const float *s, int nq, int nk, const float *corr, float *l, float *o, int hd) {
    for (int r0 = 0; r0 < nq; r0 += 8) {
        float sum[8];
        const float *s0 = s + (size_t)r0 * TILE;
        switch (nq - r0 < 8 ? nq - r0 : 8) {
        case 8: row_sums(s0, 8, nk, sum); break;
        case 7: row_sums(s0, 7, nk, sum); break;
        case 6: row_sums(s0, 6, nk, sum); break;
        case 5: row_sums(s0, 5, nk, sum); break;
        case 4: row_sums(s0, 4, nk, sum); break;
        case 3: row_sums(s0, 3, nk, sum); break;
        case 2: row_sums(s0, 2, nk, sum); break;
        default: row_sums(s0, 1, nk, sum);
        }
        for (int r = r0; r < r0 + 8 && r < nq; r++) {
            l[r] = l[r] * corr[r] + sum[r - r0];
            if (corr[r] != 1.0f)
                for (int d = 0; d < hd; d++) o[(size_t)r * hd + d] *= corr[r];
        }
    }
}

void kiln_attend_part(int kv_type, const float *q, int rows, int group, int hd, int q_stride, const uint8_t *K,
                      const uint8_t *V, int first, int pos0, int window, int key_lo, int key_hi, float scale,
                      float softcap, const uint8_t *next_k, float *scratch, float *o, float *m, float *l) {
    const softmax_kernels *sm = softmax_for(hd);
    const size_t gb = kiln_kv_key_group_bytes(kv_type, hd), rb = kiln_kv_value_row_bytes(kv_type, hd);
    int nq = rows * group, last = pos0 + rows - 1 < key_hi - 1 ? pos0 + rows - 1 : key_hi - 1;
    const kiln_kv_kernels *kv = kv_kernels_for(kv_type, hd, nq);
    if (first < key_lo) first = key_lo;
    /* scratch: scores, scaled queries, each query's rescaling factor for the tile */
    float *s = scratch, *qs = s + (size_t)nq * TILE, *corr = qs + (size_t)nq * hd;
    memset(o, 0, sizeof(float) * (size_t)nq * hd);
    for (int r = 0; r < nq; r++) m[r] = -INFINITY, l[r] = 0.0f;
    for (int i = 0; i < rows; i++)
        for (int g = 0; g < group; g++)
            for (int d = 0; d < hd; d++)
                qs[(i * group + g) * hd + d] = q[(size_t)i * q_stride + g * hd + d] * scale;
    /* tiles start on key-group boundaries; keys before `first` are masked like future ones */
    for (int j0 = first - first % KEY_GROUP; j0 <= last; j0 += TILE) {
        int nk = last - j0 + 1 < TILE ? last - j0 + 1 : TILE;
        int nk_groups = (nk + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
        const uint8_t *kg = K + (size_t)(j0 / KEY_GROUP) * gb, *after = kg + (size_t)(TILE / KEY_GROUP) * gb;
        kv->scores(qs, nq, hd, kg, nk_groups, V + (size_t)j0 * rb, j0 + TILE <= last || !next_k ? after : next_k, s);
        for (int i = 0; i < rows; i++) {
            int pos = pos0 + i, lo = window > 0 && pos - window + 1 > first ? pos - window + 1 : first;
            int hi = pos < last ? pos : last;
            int a = lo - j0 > 0 ? lo - j0 : 0, b = hi - j0 + 1 < nk ? hi - j0 + 1 : nk; /* visible [a, b) */
            for (int g = 0; g < group; g++) {
                int r = i * group + g;
                corr[r] = softmax_exp(sm, s + (size_t)r * TILE, nk, a, b, softcap, m + r);
            }
        }
        softmax_sums(s, nq, nk, corr, l, o, hd);
        kv->accumulate(s, nq, nk, V + (size_t)j0 * rb, hd, o);
    }
}

void kiln_attend_merge(int n_parts, const float *const *o, const float *const *m, const float *const *l, int hd,
                       int negate, const float *sink, float *out) {
    float mx = sink ? *sink : -INFINITY;
    for (int p = 0; p < n_parts; p++) mx = m[p][0] > mx ? m[p][0] : mx;
    float sum = 0.0f, w[n_parts > 0 ? n_parts : 1];
    for (int p = 0; p < n_parts; p++) {
        w[p] = m[p][0] == -INFINITY ? 0.0f : expf(m[p][0] - mx);
        sum += l[p][0] * w[p];
    }
    if (sink) sum += expf(*sink - mx);
    float inv = sum > 0.0f ? (negate ? -1.0f : 1.0f) / sum : 0.0f;
    for (int d = 0; d < hd; d++) {
        float acc = o[0][d] * w[0];
        for (int p = 1; p < n_parts; p++) acc += o[p][d] * w[p];
        out[d] = acc * inv;
    }
}
