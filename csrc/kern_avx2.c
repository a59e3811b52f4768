/* AVX2 + FMA + F16C kernels. Same algorithm as kern_generic.c, bit for bit (see kernels.h).

   Integer formats: a row's group is unpacked once into 8 chunk registers of unsigned bytes, then
   applied to each token: vpmaddubsw (u8 x s8 pairs -> i16), i16 adds while no sum can pass 32767,
   vpmaddwd -> one i32 block sum per lane, one convert, one FMA with (weight scale x activation scale).
   n_tok = 1 keeps accumulators in registers; more tokens run in blocks of TB tokens over TC tiles,
   so each weight tile is read from memory once per call and unpacked once per token block. */
#if KILN_X86
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <string.h>

#include "act.h"
#include "kernels.h"

#define ALWAYS static inline __attribute__((always_inline))
#define TB 16 /* tokens per block */
#define TC 8  /* tiles per block */

/* One row's group, unpacked. */
typedef struct {
    __m256i w[8];   /* chunk k: unsigned bytes (Q8: signed; |w| is taken per token, which beats spilling) */
    __m256i sc, sc2; /* Q4K/Q5K: sc_j in both i16 halves of lane j; Q6K: sc_2j pairs, sc_2j+1 pairs */
    __m256i sc16;   /* Q6K: (sc_2j, sc_2j+1), for the offset correction */
    __m256 d;       /* per-lane weight scale */
    __m256 m;       /* Q4: m_j; Q4K/Q5K: dmin*m_j */
} wrow;

ALWAYS __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS __m256 f16x1(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return _mm256_set1_ps(_cvtsh_ss(v)); }
/* A K-quant header's d and dmin (two f16 at p) in lanes 0 and 1. */
ALWAYS __m128 d_dmin(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm_cvtph_ps(_mm_cvtsi32_si128(v)); }
ALWAYS __m256i ld(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

#include "mxfp4_avx2.h"

/* Unpack one row's group: header h, quants q, nb blocks (chunk stride 4*nb). For a short group
   (nb < 8) the loads run past the row's data into bytes of other rows or the pack slack: lanes
   j >= nb hold garbage that meets zero activations, and their scales are masked to zero. */
ALWAYS void prep(kiln_wfmt f, const uint8_t *h, const uint8_t *q, int nb, wrow *p) {
    const __m256i lo4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16), bits45 = _mm256_set1_epi8(0x30);
    int cs = 4 * nb;
    if (f == KF_Q8_0) {
        for (int k = 0; k < 8; k++) p->w[k] = ld(q + k * cs);
    } else
        for (int L = 0; L < 4; L++) {
            __m256i v = ld(q + L * cs);
            p->w[L] = _mm256_and_si256(v, lo4);
            p->w[L + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
        }
    if (f == KF_MXFP4)
        for (int k = 0; k < 8; k++) p->w[k] = _mm256_shuffle_epi8(mxfp4_table(), p->w[k]);
    if (f == KF_Q5_0 || f == KF_Q5_K) { /* bit k of the high-bit byte -> bit 4 of chunk k */
        __m256i hb = ld(q + 16 * nb);
        p->w[0] = _mm256_or_si256(p->w[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bit4));
        p->w[1] = _mm256_or_si256(p->w[1], _mm256_and_si256(_mm256_slli_epi16(hb, 3), bit4));
        p->w[2] = _mm256_or_si256(p->w[2], _mm256_and_si256(_mm256_slli_epi16(hb, 2), bit4));
        p->w[3] = _mm256_or_si256(p->w[3], _mm256_and_si256(_mm256_slli_epi16(hb, 1), bit4));
        p->w[4] = _mm256_or_si256(p->w[4], _mm256_and_si256(hb, bit4));
        p->w[5] = _mm256_or_si256(p->w[5], _mm256_and_si256(_mm256_srli_epi16(hb, 1), bit4));
        p->w[6] = _mm256_or_si256(p->w[6], _mm256_and_si256(_mm256_srli_epi16(hb, 2), bit4));
        p->w[7] = _mm256_or_si256(p->w[7], _mm256_and_si256(_mm256_srli_epi16(hb, 3), bit4));
    }
    if (f == KF_Q6_K) { /* bits 2m..2m+1 of half h -> bits 4-5 of chunk 4h+m */
        for (int hf = 0; hf < 2; hf++) {
            __m256i hb = ld(q + 128 + 32 * hf);
            __m256i *w = p->w + 4 * hf;
            w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bits45));
            w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), bits45));
            w[2] = _mm256_or_si256(w[2], _mm256_and_si256(hb, bits45));
            w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), bits45));
        }
    }
    switch (f) {
    case KF_Q4_K: case KF_Q5_K: { /* header d, dmin, sc[8], m[8]: one conversion for d and dmin, sc_j
                                     spread to lane j's two i16 halves by one shuffle */
        const __m256i sc_pairs = _mm256_setr_epi8(0, -1, 0, -1, 1, -1, 1, -1, 2, -1, 2, -1, 3, -1, 3, -1,
                                                  4, -1, 4, -1, 5, -1, 5, -1, 6, -1, 6, -1, 7, -1, 7, -1);
        p->sc = _mm256_shuffle_epi8(_mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(h + 4))), sc_pairs);
        __m256 dm = _mm256_castps128_ps256(d_dmin(h));
        p->d = _mm256_broadcastss_ps(_mm256_castps256_ps128(dm));
        p->m = _mm256_mul_ps(_mm256_permutevar8x32_ps(dm, _mm256_set1_epi32(1)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(h + 12)))));
        break;
    }
    case KF_Q6_K: {
        const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
        const __m256i odd = _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
        p->sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(h + 2)));
        p->sc = _mm256_shuffle_epi8(p->sc16, even);
        p->sc2 = _mm256_shuffle_epi8(p->sc16, odd);
        p->d = f16x1(h);
        break;
    }
    default:
        p->d = f == KF_MXFP4 ? e8m0x8(h) : f16x8(h);
        if (f == KF_Q4_1) p->m = f16x8(h + 2 * nb);
        if (nb < 8) {
            __m256 mask = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nb), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
            p->d = _mm256_and_ps(p->d, mask);
            if (f == KF_Q4_1) p->m = _mm256_and_ps(p->m, mask);
        }
    }
}

/* acc (8 lanes, lane j = block j) += block sums i32 times weight and activation scales, plus the
   affine minimum: one FMA per 8 blocks (two for affine formats). */
ALWAYS __m256 fstep(kiln_wfmt f, const wrow *p, const uint8_t *ag, __m256i i32, __m256 acc) {
    __m256 dx = _mm256_loadu_ps((const float *)(ag + KILN_AG_D));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_mul_ps(p->d, dx), acc);
    if (f == KF_Q4_1) acc = _mm256_fmadd_ps(p->m, _mm256_loadu_ps((const float *)(ag + KILN_AG_S)), acc);
    if (f == KF_Q4_K || f == KF_Q5_K) acc = _mm256_fnmadd_ps(p->m, _mm256_loadu_ps((const float *)(ag + KILN_AG_S)), acc);
    return acc;
}

/* acc (8 lanes, lane j = block j) += this row's group . activation group ag. */
ALWAYS __m256 dot(kiln_wfmt f, const wrow *p, const uint8_t *ag, __m256 acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a[8], i32;
    for (int k = 0; k < 8; k++) a[k] = ld(ag + 32 * k);
    __m256i sum32 = ld(ag + KILN_AG_SUM32);
#define MUB(k) _mm256_maddubs_epi16(p->w[k], a[k])
    switch (f) {
    case KF_Q8_0: { /* signed x signed: vpmaddubsw wants one unsigned side, so |w| meets x with w's sign */
        __m256i s[8];
        for (int k = 0; k < 8; k++) s[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(p->w[k]), _mm256_sign_epi8(a[k], p->w[k])), ones);
        i32 = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3])),
                               _mm256_add_epi32(_mm256_add_epi32(s[4], s[5]), _mm256_add_epi32(s[6], s[7])));
        break;
    }
    case KF_Q4_1: case KF_Q4_0: case KF_Q4_K: { /* 4-bit: 8 pair sums of <= 2*15*127 fit in i16 */
        __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(MUB(0), MUB(1)), _mm256_add_epi16(MUB(2), MUB(3))),
                                     _mm256_add_epi16(_mm256_add_epi16(MUB(4), MUB(5)), _mm256_add_epi16(MUB(6), MUB(7))));
        i32 = _mm256_madd_epi16(s, f == KF_Q4_K ? p->sc : ones);
        if (f == KF_Q4_0) i32 = _mm256_sub_epi32(i32, _mm256_slli_epi32(sum32, 3));
        break;
    }
    case KF_Q5_0: case KF_Q5_K: case KF_MXFP4: { /* 5-bit (MXFP4: kv + 12 <= 24): 4 pair sums per i16 */
        __m256i s0 = _mm256_add_epi16(_mm256_add_epi16(MUB(0), MUB(1)), _mm256_add_epi16(MUB(2), MUB(3)));
        __m256i s1 = _mm256_add_epi16(_mm256_add_epi16(MUB(4), MUB(5)), _mm256_add_epi16(MUB(6), MUB(7)));
        __m256i sc = f == KF_Q5_K ? p->sc : ones;
        i32 = _mm256_add_epi32(_mm256_madd_epi16(s0, sc), _mm256_madd_epi16(s1, sc));
        if (f == KF_Q5_0) i32 = _mm256_sub_epi32(i32, _mm256_slli_epi32(sum32, 4));
        if (f == KF_MXFP4) i32 = _mm256_sub_epi32(i32, times12(sum32));
        break;
    }
    default: { /* Q6K, 6-bit: 2 pair sums per i16; chunks 0-3 are sub-block 2j, 4-7 sub-block 2j+1 */
        __m256i s01 = _mm256_add_epi16(MUB(0), MUB(1)), s23 = _mm256_add_epi16(MUB(2), MUB(3));
        __m256i s45 = _mm256_add_epi16(MUB(4), MUB(5)), s67 = _mm256_add_epi16(MUB(6), MUB(7));
        i32 = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(s01, p->sc), _mm256_madd_epi16(s23, p->sc)),
                               _mm256_add_epi32(_mm256_madd_epi16(s45, p->sc2), _mm256_madd_epi16(s67, p->sc2)));
        __m256i corr = _mm256_madd_epi16(p->sc16, ld(ag + KILN_AG_SUM16));
        i32 = _mm256_sub_epi32(i32, _mm256_slli_epi32(corr, 5));
    }
    }
#undef MUB
    return fstep(f, p, ag, i32, acc);
}

/* Short group of nb <= 4 blocks: register L holds chunk L in its low 128 bits and chunk L+4 in its
   high 128 bits (4 lanes each), matching the "pair" order of the activation group. */
ALWAYS void prep4(kiln_wfmt f, const uint8_t *h, const uint8_t *q, int nb, wrow *p) {
    const __m256i lo4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    int cs = 4 * nb;
    for (int L = 0; L < 4; L++) {
        if (f == KF_Q8_0) {
            p->w[L] = _mm256_loadu2_m128i((const __m128i *)(q + (L + 4) * cs), (const __m128i *)(q + L * cs));
            continue;
        }
        __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + L * cs)));
        p->w[L] = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), lo4);
        if (f == KF_MXFP4) p->w[L] = _mm256_shuffle_epi8(mxfp4_table(), p->w[L]);
        if (f == KF_Q5_0) { /* bit L -> bit 4 in the low half, bit L+4 -> bit 4 in the high half */
            __m256i hb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + 16 * nb)));
            hb = _mm256_sllv_epi32(hb, _mm256_setr_epi32(4 - L, 4 - L, 4 - L, 4 - L, 0, 0, 0, 0));
            hb = _mm256_srlv_epi32(hb, _mm256_setr_epi32(0, 0, 0, 0, L, L, L, L));
            p->w[L] = _mm256_or_si256(p->w[L], _mm256_and_si256(hb, bit4));
        }
    }
    __m256 mask = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nb), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    p->d = _mm256_and_ps(f == KF_MXFP4 ? e8m0x8(h) : f16x8(h), mask);
    if (f == KF_Q4_1) p->m = _mm256_and_ps(f16x8(h + 2 * nb), mask);
}

ALWAYS __m256 dot4(kiln_wfmt f, const wrow *p, const uint8_t *ag, __m256 acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i i32, sum32 = ld(ag + KILN_AG_SUM32);
    if (f == KF_Q8_0) {
        __m256i s[4];
        for (int L = 0; L < 4; L++) {
            __m256i a = ld(ag + 32 * L);
            s[L] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(p->w[L]), _mm256_sign_epi8(a, p->w[L])), ones);
        }
        i32 = _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3]));
    } else { /* up to 5 bits (or MXFP4's 0..24): 4 pair sums fit in i16 */
        __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(p->w[0], ld(ag)), _mm256_maddubs_epi16(p->w[1], ld(ag + 32))),
                                     _mm256_add_epi16(_mm256_maddubs_epi16(p->w[2], ld(ag + 64)), _mm256_maddubs_epi16(p->w[3], ld(ag + 96))));
        i32 = _mm256_madd_epi16(s, ones);
    }
    i32 = _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1)));
    if (f == KF_Q4_0) i32 = _mm256_sub_epi32(i32, _mm256_slli_epi32(sum32, 3));
    if (f == KF_Q5_0) i32 = _mm256_sub_epi32(i32, _mm256_slli_epi32(sum32, 4));
    if (f == KF_MXFP4) i32 = _mm256_sub_epi32(i32, times12(sum32));
    return fstep(f, p, ag, i32, acc);
}

/* Lanes summed as ((a0+a1)+(a2+a3)) + ((a4+a5)+(a6+a7)) for 4 rows at once. */
ALWAYS __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* A shared tail's lane pairs: (t0+t1, t2+t3, t4+t5, t6+t7), one per row. */
ALWAYS __m128 pair_sums(__m256 tail) {
    __m256 h = _mm256_hadd_ps(tail, tail);
    return _mm_shuffle_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1), _MM_SHUFFLE(1, 0, 1, 0));
}

ALWAYS void store_rows(float *y, __m128 v, int n) {
    if (n >= 4) {
        _mm_storeu_ps(y, v);
        return;
    }
    float t[4];
    _mm_storeu_ps(t, v);
    for (int i = 0; i < n; i++) y[i] = t[i];
}

/* acc[r][t], t < n, is set by the first group or zeroed when there is none; GCC cannot tell. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
/* One tile against n (<= TB) tokens: activations act + t*stride, results y + t*ldy. n == 1 keeps the
   4 accumulators in registers. `far`: also fetch the weights KILN_PREFETCH_FAR ahead into L2. */
ALWAYS void qtile(kiln_wfmt f, const uint8_t *tile, int cols, const uint8_t *act, size_t stride, int n, int far, float *y, int ldy, int nrows) {
    const int HB = kiln_fmt_head_bytes(f, 8), QB = kiln_fmt_quant_bytes(f, 8), GB = 4 * (HB + QB);
    int G = cols / KILN_GROUP, nt = cols % KILN_GROUP / 32;
    __m256 acc[4][TB];
    if (G == 0) /* else the first group sets them: zeroing the array in memory (rep stos) cost 20% at 8 tokens */
        for (int r = 0; r < 4; r++)
            for (int t = 0; t < n; t++) acc[r][t] = _mm256_setzero_ps();
    const int ahead = KILN_PREFETCH_AHEAD(n);
    for (int g = 0; g < G; g++) {
        const uint8_t *p = tile + g * GB, *ag = act + g * KILN_AG_BYTES;
        KILN_PREFETCH_GROUP(p, GB, ahead, far);
        for (int r = 0; r < 4; r++) {
            wrow w;
            prep(f, p + r * HB, p + 4 * HB + r * QB, 8, &w);
            for (int t = 0; t < n; t++) acc[r][t] = dot(f, &w, ag + t * stride, g ? acc[r][t] : _mm256_setzero_ps());
        }
    }
    if (nt && kiln_shared_tail(nt)) { /* one full-width dot for the 4 rows' 2 blocks each */
        const uint8_t *p = tile + G * GB, *ag = act + G * KILN_AG_BYTES;
        wrow w;
        prep(f, p, p + HB, 8, &w);
        for (int t = 0; t < n; t++) {
            __m256 tail = dot(f, &w, ag + t * stride, _mm256_setzero_ps());
            store_rows(y + t * ldy, _mm_add_ps(reduce4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]), pair_sums(tail)), nrows);
        }
        return;
    }
    if (nt && f != KF_Q4_K && f != KF_Q5_K && f != KF_Q6_K) { /* short group: chunk stride 4*nt, paired if nt <= 4 */
        const uint8_t *p = tile + G * GB, *ag = act + G * KILN_AG_BYTES;
        int hb = kiln_fmt_head_bytes(f, nt), qb = kiln_fmt_quant_bytes(f, nt);
        for (int r = 0; r < 4; r++) {
            wrow w;
            if (nt <= 4) {
                prep4(f, p + r * hb, p + 4 * hb + r * qb, nt, &w);
                for (int t = 0; t < n; t++) acc[r][t] = dot4(f, &w, ag + t * stride, acc[r][t]);
            } else {
                prep(f, p + r * hb, p + 4 * hb + r * qb, nt, &w);
                for (int t = 0; t < n; t++) acc[r][t] = dot(f, &w, ag + t * stride, acc[r][t]);
            }
        }
    }
    for (int t = 0; t < n; t++) store_rows(y + t * ldy, reduce4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]), nrows);
}
#pragma GCC diagnostic pop

/* Float formats: 16-column chunks as two 8-lane halves (lo, hi), as one 16-lane AVX-512 register. */
ALWAYS __m256 fload(kiln_wfmt f, const uint8_t *p) {
    if (f == KF_F32) return _mm256_loadu_ps((const float *)p);
    if (f == KF_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* Rows r0, r0+1 of a tile against tokens t0, t0+1 (nt tokens, 1 or 2): dot products for 2x2 outputs. */
ALWAYS void ftile2x2(kiln_wfmt f, const uint8_t *tile, int nchunk, const float *x, size_t xs, int ntk, __m256 out[2][2]) {
    const int es = kiln_fmt_elem_bytes(f), CB = 4 * KILN_FCHUNK * es, RB = KILN_FCHUNK * es;
    __m256 acc[2][2][2];
    for (int r = 0; r < 2; r++)
        for (int t = 0; t < 2; t++) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    for (int c = 0; c < nchunk; c++) {
        const uint8_t *p = tile + c * CB;
        for (int r = 0; r < 2; r++) {
            __m256 lo = fload(f, p + r * RB), hi = fload(f, p + r * RB + 8 * es);
            for (int t = 0; t < ntk; t++) {
                const float *xp = x + t * xs + c * KILN_FCHUNK;
                acc[r][t][0] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xp), acc[r][t][0]);
                acc[r][t][1] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xp + 8), acc[r][t][1]);
            }
        }
    }
    for (int r = 0; r < 2; r++)
        for (int t = 0; t < 2; t++) out[r][t] = _mm256_add_ps(acc[r][t][0], acc[r][t][1]);
}

ALWAYS void ftile(kiln_wfmt f, const uint8_t *tile, int cols, const uint8_t *act, size_t stride, int n, float *y, int ldy, int nrows) {
    const int es = kiln_fmt_elem_bytes(f), RB = KILN_FCHUNK * es;
    int nchunk = (cols + KILN_FCHUNK - 1) / KILN_FCHUNK;
    size_t xs = stride / 4;
    const float *x = (const float *)act;
    if (n == 1) { /* 4 rows x 1 token: 8 accumulators */
        const int CB = 4 * RB;
        __m256 acc[4][2];
        for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int c = 0; c < nchunk; c++) {
            const uint8_t *p = tile + c * CB;
            __m256 xlo = _mm256_loadu_ps(x + c * KILN_FCHUNK), xhi = _mm256_loadu_ps(x + c * KILN_FCHUNK + 8);
            for (int r = 0; r < 4; r++) {
                acc[r][0] = _mm256_fmadd_ps(fload(f, p + r * RB), xlo, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(fload(f, p + r * RB + 8 * es), xhi, acc[r][1]);
            }
        }
        store_rows(y, reduce4(_mm256_add_ps(acc[0][0], acc[0][1]), _mm256_add_ps(acc[1][0], acc[1][1]),
                              _mm256_add_ps(acc[2][0], acc[2][1]), _mm256_add_ps(acc[3][0], acc[3][1])), nrows);
        return;
    }
    for (int t = 0; t < n; t += 2) {
        int ntk = n - t < 2 ? n - t : 2;
        __m256 o01[2][2], o23[2][2];
        ftile2x2(f, tile, nchunk, x + t * xs, xs, ntk, o01);
        ftile2x2(f, tile + 2 * RB, nchunk, x + t * xs, xs, ntk, o23);
        for (int k = 0; k < ntk; k++) store_rows(y + (t + k) * ldy, reduce4(o01[0][k], o01[1][k], o23[0][k], o23[1][k]), nrows);
    }
}

ALWAYS void run(kiln_wfmt f, const kiln_wmat *w, const uint8_t *act, int n_tok, float *y, int ldy, int tile0, int tile1) {
    size_t stride = kiln_act_stride(f, w->cols);
    if (n_tok <= 2) { /* decode: a constant token count keeps the accumulators in registers */
        for (int ti = tile0; ti < tile1; ti++) {
            const uint8_t *tile = w->data + ti * w->tile_bytes;
            int nrows = w->rows - 4 * ti;
            if (kiln_fmt_is_float(f))
                ftile(f, tile, w->cols, act, stride, n_tok, y + 4 * ti, ldy, nrows);
            else if (n_tok == 1)
                qtile(f, tile, w->cols, act, stride, 1, 0, y + 4 * ti, ldy, nrows);
            else /* a precise activation's pair of rows (see plan.c) */
                qtile(f, tile, w->cols, act, stride, 2, 0, y + 4 * ti, ldy, nrows);
        }
        return;
    }
    for (int tc = tile0; tc < tile1; tc += TC) /* weights of TC tiles stay in cache across token blocks */
        for (int t0 = 0; t0 < n_tok; t0 += TB) {
            int n = n_tok - t0 < TB ? n_tok - t0 : TB;
            for (int ti = tc; ti < tile1 && ti < tc + TC; ti++) {
                const uint8_t *tile = w->data + ti * w->tile_bytes;
                int nrows = w->rows - 4 * ti;
                float *yt = y + (size_t)t0 * ldy + 4 * ti;
                if (kiln_fmt_is_float(f))
                    ftile(f, tile, w->cols, act + t0 * stride, stride, n, yt, ldy, nrows);
                else
                    qtile(f, tile, w->cols, act + t0 * stride, stride, n, KILN_PREFETCH_FAR_FOR(t0, n), yt, ldy, nrows);
            }
        }
}

void kiln_matmul_avx2(const kiln_wmat *w, const void *act, int n_tok, float *y, int ldy, int tile0, int tile1) {
    switch (w->fmt) {
    case KF_F32: run(KF_F32, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_F16: run(KF_F16, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_BF16: run(KF_BF16, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q4_1: run(KF_Q4_1, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q4_0: run(KF_Q4_0, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q5_0: run(KF_Q5_0, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q8_0: run(KF_Q8_0, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q4_K: run(KF_Q4_K, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q5_K: run(KF_Q5_K, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q6_K: run(KF_Q6_K, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_MXFP4: run(KF_MXFP4, w, act, n_tok, y, ldy, tile0, tile1); break;
    default: break;
    }
}

/* ---- the bandwidth reference: every byte once, 32-byte loads in two xor chains (a 32-byte tail and
   anything shorter are read by 8-byte words) ---- */
uint64_t kiln_mem_read_avx2(const void *p, size_t size) {
    const uint8_t *q = p;
    __m256i a = _mm256_setzero_si256(), b = a;
    size_t i = 0;
    for (; i + 64 <= size; i += 64) {
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)(q + i)));
        b = _mm256_xor_si256(b, _mm256_loadu_si256((const __m256i *)(q + i + 32)));
    }
    a = _mm256_xor_si256(a, b);
    uint64_t lanes[4], r;
    _mm256_storeu_si256((__m256i *)lanes, a);
    r = lanes[0] ^ lanes[1] ^ lanes[2] ^ lanes[3];
    for (; i + 8 <= size; i += 8) {
        uint64_t w;
        memcpy(&w, q + i, 8);
        r ^= w;
    }
    return r;
}

/* ---- top-k's first pass: the largest of each block of 16 floats; a NaN never wins (vmaxps returns its
   second operand when either is NaN, and the running maximum never is one) ---- */
void kiln_block_maxima_avx2(const float *x, int blocks, float *best) {
    const __m256 lowest = _mm256_set1_ps(-__builtin_inff());
    for (int b = 0; b < blocks; b++) {
        __m256 m = _mm256_max_ps(_mm256_loadu_ps(x + 16 * b), lowest);
        m = _mm256_max_ps(_mm256_loadu_ps(x + 16 * b + 8), m);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        best[b] = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
}

/* ---- activations ---- */

/* 8x8 transpose of 32-bit units: row j (block j, natural order) -> column j of chunk k. */
ALWAYS void transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x20);
        r[k + 4] = _mm256_permute2x128_si256(u[k], u[k + 4], 0x31);
    }
}

ALWAYS int hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

ALWAYS float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* Unless resid is NULL, it gets x - (float)q * d for the group's nb blocks: the product rounded, then the
   difference (kern_generic.c's order; an empty asm keeps the compiler from fusing them into an FMA). */
static void quantize_group(const float *x, int nb, uint8_t *ag, float *resid) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i rows[8];
    float d[8] = {0}, s[8] = {0};
    int32_t s32[8] = {0};
    int16_t s16[16] = {0};
    for (int j = 0; j < 8; j++) {
        if (j >= nb && kiln_shared_tail(nb)) { /* lanes 2..7 repeat blocks 0 and 1 */
            rows[j] = rows[j & 1];
            d[j] = d[j & 1], s[j] = s[j & 1], s32[j] = s32[j & 1];
            s16[2 * j] = s16[2 * (j & 1)], s16[2 * j + 1] = s16[2 * (j & 1) + 1];
            continue;
        }
        if (j >= nb) {
            rows[j] = _mm256_setzero_si256();
            continue;
        }
        const float *xb = x + 32 * j;
        __m256 v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
        float amax = hmax(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], absmask), _mm256_and_ps(v[1], absmask)),
                                        _mm256_max_ps(_mm256_and_ps(v[2], absmask), _mm256_and_ps(v[3], absmask))));
        float dj = amax / 127.0f, id = dj != 0 ? 1.0f / dj : 0.0f;
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
        if (resid) /* |q| <= 127 (d = max|x|/127), so q is also the stored byte */
            for (int i = 0; i < 4; i++) {
                __m256 value = _mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), _mm256_set1_ps(dj));
                __asm__("" : "+x"(value));
                _mm256_storeu_ps(resid + 32 * j + 8 * i, _mm256_sub_ps(v[i], value));
            }
        int lo = hsum_i32(_mm256_add_epi32(q[0], q[1])), hi = hsum_i32(_mm256_add_epi32(q[2], q[3]));
        /* packs leave 4-byte units in chunk order 0,2,4,6,1,3,5,7 */
        __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        rows[j] = _mm256_permutevar8x32_epi32(b, order);
        d[j] = dj;
        s32[j] = lo + hi;
        s[j] = dj * (float)(lo + hi);
        s16[2 * j] = (int16_t)lo;
        s16[2 * j + 1] = (int16_t)hi;
    }
    transpose8(rows);
    int natural = nb > 4 || kiln_shared_tail(nb);
    for (int k = 0; k < 8; k++) /* nb = 1, 3, 4: pair order, chunk L beside chunk L+4 */
        _mm256_storeu_si256((__m256i *)(ag + 32 * k), natural ? rows[k] : k < 4 ? _mm256_permute2x128_si256(rows[k], rows[k + 4], 0x20) : _mm256_setzero_si256());
    memcpy(ag + KILN_AG_D, d, 32);
    memcpy(ag + KILN_AG_S, s, 32);
    memcpy(ag + KILN_AG_SUM32, s32, 32);
    memcpy(ag + KILN_AG_SUM16, s16, 32);
}

void kiln_quantize_act_avx2(kiln_wfmt f, const float *x, int ldx, int cols, int n_tok, void *act) {
    if (kiln_act_kind(f) == KILN_ACT_F32) {
        kiln_quantize_act_generic(f, x, ldx, cols, n_tok, act);
        return;
    }
    size_t stride = kiln_act_stride(f, cols);
    for (int t = 0; t < n_tok; t++)
        for (int g = 0; g * KILN_GROUP < cols; g++) {
            int nb = kiln_group_blocks(cols, g);
            quantize_group(x + (size_t)t * ldx + g * KILN_GROUP, nb, (uint8_t *)act + t * stride + (size_t)g * KILN_AG_BYTES, NULL);
        }
}

void kiln_quantize_act_pair_avx2(kiln_wfmt f, const float *x, int cols, void *first, void *second, float *residual) {
    (void)f; /* every integer format shares one activation layout */
    for (int g = 0; g * KILN_GROUP < cols; g++) {
        int nb = kiln_group_blocks(cols, g);
        size_t at = (size_t)g * KILN_AG_BYTES;
        quantize_group(x + g * KILN_GROUP, nb, (uint8_t *)first + at, residual + g * KILN_GROUP);
        quantize_group(residual + g * KILN_GROUP, nb, (uint8_t *)second + at, NULL);
    }
}
#endif
