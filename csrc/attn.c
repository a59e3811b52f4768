#include "attn.h"

#include <math.h>
#include <string.h>

#include "dequant.h"
#include "kernels.h"

#if defined(KILN_X86)
#include <immintrin.h>
#endif

/* Softmax over each head's scores in place, then out = probabilities · V. */
typedef void (*row_fn)(const uint16_t *src, float *dst, int n);
typedef float (*dot_fn)(const float *a, const float *b, int n);
typedef void (*axpy_fn)(float a, const float *x, float *y, int n);

static void load_generic(const uint16_t *src, float *x, int n) {
    for (int i = 0; i < n; i++) x[i] = kiln_half_to_float(src[i]);
}
static float dot_generic(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
static void axpy_generic(float a, const float *x, float *y, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

#if defined(KILN_X86)
__attribute__((target("avx2,fma,f16c"))) static void load_avx2(const uint16_t *src, float *x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) x[i] = kiln_half_to_float(src[i]);
}
__attribute__((target("avx2,fma,f16c"))) static float dot_avx2(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    float r = _mm_cvtss_f32(s);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}
__attribute__((target("avx2,fma,f16c"))) static void axpy_avx2(float a, const float *x, float *y, int n) {
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}
__attribute__((target("avx2,f16c"))) static void store_avx2(const float *x, uint16_t *dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = kiln_float_to_half(x[i]);
}
#endif

static int use_avx2(void) {
#if defined(KILN_X86)
    return kiln_active_isa() >= ISA_AVX2;
#else
    return 0;
#endif
}

void kiln_store_half(const float *x, uint16_t *dst, int n) {
#if defined(KILN_X86)
    if (use_avx2()) { store_avx2(x, dst, n); return; }
#endif
    for (int i = 0; i < n; i++) dst[i] = kiln_float_to_half(x[i]);
}

void kiln_load_half(const uint16_t *src, float *x, int n) {
#if defined(KILN_X86)
    if (use_avx2()) { load_avx2(src, x, n); return; }
#endif
    load_generic(src, x, n);
}

void kiln_attend(const float *q, int group, int hd, const uint16_t *K, const uint16_t *V, int stride, int n,
                 float scale, float *scratch, float *out, int negate) {
    row_fn load = load_generic;
    dot_fn dot = dot_generic;
    axpy_fn axpy = axpy_generic;
#if defined(KILN_X86)
    if (use_avx2()) { load = load_avx2; dot = dot_avx2; axpy = axpy_avx2; }
#endif
    float *scores = scratch, *row = scratch + (size_t)group * n, *acc = row + hd;
    for (int i = 0; i < n; i++) {
        load(K + (size_t)i * stride, row, hd);
        for (int g = 0; g < group; g++) scores[(size_t)g * n + i] = dot(q + (size_t)g * hd, row, hd) * scale;
    }
    float sums[group];
    for (int g = 0; g < group; g++) {
        float *s = scores + (size_t)g * n, m = s[0], sum = 0.0f;
        for (int i = 1; i < n; i++) m = s[i] > m ? s[i] : m;
        for (int i = 0; i < n; i++) sum += (s[i] = expf(s[i] - m));
        sums[g] = sum;
    }
    memset(acc, 0, sizeof(float) * group * hd);
    for (int i = 0; i < n; i++) {
        load(V + (size_t)i * stride, row, hd);
        for (int g = 0; g < group; g++) axpy(scores[(size_t)g * n + i], row, acc + (size_t)g * hd, hd);
    }
    for (int g = 0; g < group; g++) {
        float inv = (negate ? -1.0f : 1.0f) / sums[g];
        for (int d = 0; d < hd; d++) out[(size_t)g * hd + d] = acc[(size_t)g * hd + d] * inv;
    }
}
