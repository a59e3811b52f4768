/* The Gated DeltaNet's state update for one value head and row, on AVX2 + FMA: eight value dimensions a
 * vector, each lane's sums taken over the key dimensions in order, four key rows a pass so a sum is loaded
 * and stored once for four. The decayed state is recomputed in the second pass instead of stored by the
 * first: S is written once. The same steps as op_delta.c's loops, each multiply-add fused. */
#if defined(KILN_X86)
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "ops.h"
#include "vecmath.h"

#define ALWAYS static inline __attribute__((always_inline))

/* sum[j] += (decay S[i][j]) k[i] over rows [i0, i0 + n), n <= 4, in row order. */
ALWAYS void recall_rows(const float *S, int dv, int i0, int n, const float *k, __m256 dec, float *sum) {
    const float *row[4];
    __m256 kb[4];
    for (int r = 0; r < n; r++) row[r] = S + (size_t)(i0 + r) * dv, kb[r] = _mm256_set1_ps(k[i0 + r]);
    for (int j = 0; j < dv; j += 8) {
        __m256 acc = _mm256_loadu_ps(sum + j);
        for (int r = 0; r < n; r++) acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(row[r] + j), dec), kb[r], acc);
        _mm256_storeu_ps(sum + j, acc);
    }
}

/* S[i][j] = decay S[i][j] + k[i] delta[j], and out[j] += S[i][j] q[i], over rows [i0, i0 + n) in order. */
ALWAYS void update_rows(float *S, int dv, int i0, int n, const float *k, const float *q, __m256 dec, const float *delta,
                        float *out) {
    float *row[4];
    __m256 kb[4], qb[4];
    for (int r = 0; r < n; r++)
        row[r] = S + (size_t)(i0 + r) * dv, kb[r] = _mm256_set1_ps(k[i0 + r]), qb[r] = _mm256_set1_ps(q[i0 + r]);
    for (int j = 0; j < dv; j += 8) {
        __m256 d = _mm256_loadu_ps(delta + j), o = _mm256_loadu_ps(out + j);
        for (int r = 0; r < n; r++) {
            __m256 s = _mm256_fmadd_ps(kb[r], d, _mm256_mul_ps(_mm256_loadu_ps(row[r] + j), dec));
            _mm256_storeu_ps(row[r] + j, s);
            o = _mm256_fmadd_ps(s, qb[r], o);
        }
        _mm256_storeu_ps(out + j, o);
    }
}

void kiln_delta_head_avx2(float *S, const float *q, const float *k, const float *v, float decay, float rate, int dk,
                          int dv, float *delta, float *out) {
    const __m256 dec = _mm256_set1_ps(decay), rt = _mm256_set1_ps(rate);
    for (int j = 0; j < dv; j += 8) _mm256_storeu_ps(delta + j, _mm256_setzero_ps());
    int i = 0;
    for (; i + 4 <= dk; i += 4) recall_rows(S, dv, i, 4, k, dec, delta);
    if (i < dk) recall_rows(S, dv, i, dk - i, k, dec, delta);
    for (int j = 0; j < dv; j += 8) /* now the update's delta */
        _mm256_storeu_ps(delta + j, _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + j), _mm256_loadu_ps(delta + j)), rt));
    for (int j = 0; j < dv; j += 8) _mm256_storeu_ps(out + j, _mm256_setzero_ps());
    for (i = 0; i + 4 <= dk; i += 4) update_rows(S, dv, i, 4, k, q, dec, delta, out);
    if (i < dk) update_rows(S, dv, i, dk - i, k, q, dec, delta, out);
}

/* GATE's y = x sigmoid(z), eight values a vector with vecmath.h's exp (n a multiple of 8). */
void kiln_sigmoid_gate_avx2(float *y, const float *x, const float *z, int n) {
    for (int i = 0; i < n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(z + i)));
        _mm256_storeu_ps(y + i, _mm256_div_ps(_mm256_loadu_ps(x + i), _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    }
}
#endif
