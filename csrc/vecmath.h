/* Vectorized exp and the GLU activations, shared by attention and the plan executor. */
#pragma once
#include <math.h>

#include "kernels.h"

/* gpt-oss's clamped SwiGLU (plan.h, ACT_SWIGLU_OAI): its sigmoid's slope and the clamp */
#define SWIGLU_OAI_ALPHA 1.702f
#define SWIGLU_OAI_LIMIT 7.0f

#if defined(KILN_X86)
#include <immintrin.h>
#ifndef AVX2
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

/* exp(x), 0 below -87 and clamped at 88: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-6
 * polynomial (relative error ~2e-7, like expf), 2^n built in the exponent bits; below -87 it is 0. */
AVX2 static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.3981999507e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* silu(g) * u and gelu_tanh(g) * u, with tanh(y) = 1 - 2 / (exp(2y) + 1). */
AVX2 static inline __m256 silu256(__m256 g) {
    __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

/* tanh(y) = sign(y) (1 - 2 / (exp(2|y|) + 1)): off by at most ~2e-7 (absolute) everywhere. */
AVX2 static inline __m256 tanh256(__m256 y) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 a = _mm256_min_ps(_mm256_andnot_ps(sign, y), _mm256_set1_ps(40.0f)); /* tanh is 1 there */
    __m256 e = exp256(_mm256_add_ps(a, a));
    __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    return _mm256_or_ps(t, _mm256_and_ps(sign, y));
}

/* gpt-oss's clamped SwiGLU: (clamp(u, -7, 7) + 1) * g * sigmoid(1.702 g), g clamped above at 7 */
AVX2 static inline __m256 swiglu_oai256(__m256 g, __m256 u) {
    const __m256 limit = _mm256_set1_ps(SWIGLU_OAI_LIMIT);
    g = _mm256_min_ps(g, limit);
    u = _mm256_min_ps(_mm256_max_ps(u, _mm256_sub_ps(_mm256_setzero_ps(), limit)), limit);
    __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-SWIGLU_OAI_ALPHA), g));
    __m256 glu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    return _mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(1.0f)), glu);
}

AVX2 static inline __m256 gelu_tanh256(__m256 g) {
    __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f),
                             _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
    y = _mm256_min_ps(y, _mm256_set1_ps(40.0f)); /* tanh is 1 there; keeps exp finite */
    __m256 e = exp256(_mm256_add_ps(y, y));
    __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(_mm256_set1_ps(1.0f), t));
}
#endif
