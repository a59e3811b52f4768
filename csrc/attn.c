/* Attention over the fp16 KV cache, flash-attention style: keys and values are taken in tiles,
 * converted to fp32 once per tile and shared by every query of the block (the heads of a GQA group
 * times consecutive rows of one sequence in prefill), with a running max and sum per query so the
 * scores of a whole context never need to be stored. */
#include "attn.h"

#include <math.h>
#include <string.h>

#include "dequant.h"
#include "kernels.h"
#include "vecmath.h"

#if defined(KILN_X86)
#include <immintrin.h>
#endif

#define TILE 64 /* keys per tile */

typedef struct {
    void (*load)(const uint16_t *src, float *x, int n);
    /* s[r * TILE + j] = dot(q[r], k[j]) for r < nq, j < nk; kt is hd × TILE (transposed keys) */
    void (*scores)(const float *q, int nq, int hd, const float *kt, int nk, float *s);
    /* o[r] += sum_j p[r * TILE + j] * v[j], for r < nq; v is nk × hd */
    void (*accumulate)(const float *p, int nq, int nk, const float *v, int hd, float *o);
    void (*exp_row)(float *x, int n, float shift); /* x[i] = exp(x[i] - shift) */
} attn_kernels;

/* ---- portable reference ---- */

static void load_generic(const uint16_t *src, float *x, int n) {
    for (int i = 0; i < n; i++) x[i] = kiln_half_to_float(src[i]);
}

static void scores_generic(const float *q, int nq, int hd, const float *kt, int nk, float *s) {
    for (int r = 0; r < nq; r++)
        for (int j = 0; j < nk; j++) {
            float acc = 0.0f;
            for (int d = 0; d < hd; d++) acc += q[r * hd + d] * kt[d * TILE + j];
            s[r * TILE + j] = acc;
        }
}

static void accumulate_generic(const float *p, int nq, int nk, const float *v, int hd, float *o) {
    for (int r = 0; r < nq; r++)
        for (int j = 0; j < nk; j++) {
            float w = p[r * TILE + j];
            if (w != 0.0f)
                for (int d = 0; d < hd; d++) o[r * hd + d] += w * v[j * hd + d];
        }
}

static void exp_generic(float *x, int n, float shift) {
    for (int i = 0; i < n; i++) x[i] = expf(x[i] - shift);
}

static const attn_kernels GENERIC = {load_generic, scores_generic, accumulate_generic, exp_generic};

/* ---- AVX2 ---- */
#if defined(KILN_X86)
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static void load_avx2(const uint16_t *src, float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) x[i] = kiln_half_to_float(src[i]);
}

/* 4 queries × 16 keys per inner step: per dimension, 2 key loads and 4 broadcasts feed 8 FMAs. */
AVX2 static void scores_avx2(const float *q, int nq, int hd, const float *kt, int nk, float *s) {
    int r = 0;
    for (; r + 4 <= nq; r += 4) {
        for (int j = 0; j < nk; j += 16) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int d = 0; d < hd; d++) {
                __m256 k0 = _mm256_loadu_ps(kt + d * TILE + j), k1 = _mm256_loadu_ps(kt + d * TILE + j + 8);
                __m256 q0 = _mm256_broadcast_ss(q + (r + 0) * hd + d), q1 = _mm256_broadcast_ss(q + (r + 1) * hd + d);
                __m256 q2 = _mm256_broadcast_ss(q + (r + 2) * hd + d), q3 = _mm256_broadcast_ss(q + (r + 3) * hd + d);
                a0 = _mm256_fmadd_ps(q0, k0, a0), b0 = _mm256_fmadd_ps(q0, k1, b0);
                a1 = _mm256_fmadd_ps(q1, k0, a1), b1 = _mm256_fmadd_ps(q1, k1, b1);
                a2 = _mm256_fmadd_ps(q2, k0, a2), b2 = _mm256_fmadd_ps(q2, k1, b2);
                a3 = _mm256_fmadd_ps(q3, k0, a3), b3 = _mm256_fmadd_ps(q3, k1, b3);
            }
            _mm256_storeu_ps(s + (r + 0) * TILE + j, a0), _mm256_storeu_ps(s + (r + 0) * TILE + j + 8, b0);
            _mm256_storeu_ps(s + (r + 1) * TILE + j, a1), _mm256_storeu_ps(s + (r + 1) * TILE + j + 8, b1);
            _mm256_storeu_ps(s + (r + 2) * TILE + j, a2), _mm256_storeu_ps(s + (r + 2) * TILE + j + 8, b2);
            _mm256_storeu_ps(s + (r + 3) * TILE + j, a3), _mm256_storeu_ps(s + (r + 3) * TILE + j + 8, b3);
        }
    }
    for (; r < nq; r++)
        for (int j = 0; j < nk; j += 8) {
            __m256 a = _mm256_setzero_ps();
            for (int d = 0; d < hd; d++)
                a = _mm256_fmadd_ps(_mm256_broadcast_ss(q + r * hd + d), _mm256_loadu_ps(kt + d * TILE + j), a);
            _mm256_storeu_ps(s + r * TILE + j, a);
        }
}

/* 2 queries × 16 dimensions per inner step; hd is a multiple of 16 on this path. */
AVX2 static void accumulate_avx2(const float *p, int nq, int nk, const float *v, int hd, float *o) {
    int r = 0;
    for (; r + 2 <= nq; r += 2)
        for (int d = 0; d < hd; d += 16) {
            float *o0 = o + r * hd + d, *o1 = o0 + hd;
            __m256 a0 = _mm256_loadu_ps(o0), a1 = _mm256_loadu_ps(o0 + 8);
            __m256 b0 = _mm256_loadu_ps(o1), b1 = _mm256_loadu_ps(o1 + 8);
            for (int j = 0; j < nk; j++) {
                __m256 v0 = _mm256_loadu_ps(v + j * hd + d), v1 = _mm256_loadu_ps(v + j * hd + d + 8);
                __m256 p0 = _mm256_broadcast_ss(p + r * TILE + j), p1 = _mm256_broadcast_ss(p + (r + 1) * TILE + j);
                a0 = _mm256_fmadd_ps(p0, v0, a0), a1 = _mm256_fmadd_ps(p0, v1, a1);
                b0 = _mm256_fmadd_ps(p1, v0, b0), b1 = _mm256_fmadd_ps(p1, v1, b1);
            }
            _mm256_storeu_ps(o0, a0), _mm256_storeu_ps(o0 + 8, a1);
            _mm256_storeu_ps(o1, b0), _mm256_storeu_ps(o1 + 8, b1);
        }
    for (; r < nq; r++)
        for (int d = 0; d < hd; d += 16) {
            float *o0 = o + r * hd + d;
            __m256 a0 = _mm256_loadu_ps(o0), a1 = _mm256_loadu_ps(o0 + 8);
            for (int j = 0; j < nk; j++) {
                __m256 p0 = _mm256_broadcast_ss(p + r * TILE + j);
                a0 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + j * hd + d), a0);
                a1 = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + j * hd + d + 8), a1);
            }
            _mm256_storeu_ps(o0, a0), _mm256_storeu_ps(o0 + 8, a1);
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

static const attn_kernels AVX2_KERNELS = {load_avx2, scores_avx2, accumulate_avx2, exp_avx2};
#endif

static const attn_kernels *kernels_for(int hd) {
#if defined(KILN_X86)
    if (kiln_active_isa() >= ISA_AVX2 && hd % 16 == 0) return &AVX2_KERNELS;
#endif
    (void)hd;
    return &GENERIC;
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

size_t kiln_attend_scratch(int n_queries, int hd) {
    return (size_t)hd * (2 * TILE + 1) + (size_t)n_queries * (TILE + 2 * hd + 2);
}

void kiln_attend(const float *q, int rows, int group, int hd, int q_stride, const uint16_t *K, const uint16_t *V,
                 int first, int pos0, int window, float scale, float *scratch, float *out, int out_stride, int negate) {
    const attn_kernels *k = kernels_for(hd);
    int nq = rows * group, last = pos0 + rows - 1;
    /* scratch: transposed key tile, value tile, one key row, scores, outputs, running max and sum,
     * scaled queries */
    float *kt = scratch, *vf = kt + hd * TILE, *krow = vf + hd * TILE, *s = krow + hd;
    float *o = s + (size_t)nq * TILE, *m = o + (size_t)nq * hd, *l = m + nq, *qscaled = l + nq;
    memset(o, 0, sizeof(float) * (size_t)nq * hd);
    for (int r = 0; r < nq; r++) m[r] = -INFINITY, l[r] = 0.0f;
    for (int i = 0; i < rows; i++)
        for (int g = 0; g < group; g++)
            for (int d = 0; d < hd; d++)
                qscaled[(i * group + g) * hd + d] = q[(size_t)i * q_stride + g * hd + d] * scale;
    for (int j0 = first; j0 <= last; j0 += TILE) {
        int nk = last - j0 + 1 < TILE ? last - j0 + 1 : TILE;
        for (int j = 0; j < nk; j++) {
            k->load(K + (size_t)(j0 + j) * hd, krow, hd);
            for (int d = 0; d < hd; d++) kt[d * TILE + j] = krow[d];
            k->load(V + (size_t)(j0 + j) * hd, vf + (size_t)j * hd, hd);
        }
        int nk_pad = (nk + 15) & ~15; /* the SIMD score kernel works on whole groups of 16 keys */
        for (int j = nk; j < nk_pad; j++)
            for (int d = 0; d < hd; d++) kt[d * TILE + j] = 0.0f;
        k->scores(qscaled, nq, hd, kt, nk_pad, s);
        for (int i = 0; i < rows; i++) {
            int pos = pos0 + i, lo = window > 0 && pos - window + 1 > first ? pos - window + 1 : first;
            for (int g = 0; g < group; g++) {
                int r = i * group + g;
                float *sr = s + (size_t)r * TILE;
                int a = lo - j0 > 0 ? lo - j0 : 0, b = pos - j0 + 1 < nk ? pos - j0 + 1 : nk; /* visible [a, b) */
                for (int j = 0; j < a; j++) sr[j] = 0.0f;
                for (int j = b > a ? b : a; j < TILE; j++) sr[j] = 0.0f;
                if (b <= a) continue;
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
        k->accumulate(s, nq, nk, vf, hd, o);
    }
    float sign = negate ? -1.0f : 1.0f;
    for (int i = 0; i < rows; i++)
        for (int g = 0; g < group; g++) {
            int r = i * group + g;
            float inv = l[r] > 0.0f ? sign / l[r] : 0.0f;
            for (int d = 0; d < hd; d++) out[(size_t)i * out_stride + g * hd + d] = o[(size_t)r * hd + d] * inv;
        }
}
