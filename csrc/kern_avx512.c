/* AVX-512 (F, BW, VL) + VNNI kernels on the same packed layout as AVX2, bit for bit the same results.

   A 64-byte load covers two chunks (2i, 2i+1) of a group; vpdpbusd multiplies unsigned weight bytes
   by signed activation bytes and adds each group of 4 into an i32 lane without saturation, so the
   16 lanes hold two half-sums per block, folded to 8 lanes (one per block) before the same float
   steps as the AVX2 kernels. Q8 weights are offset to unsigned (w ^ 0x80 = w + 128) and
   128 * sum32 is subtracted, which needs no sign trick. Activations are quantized by the AVX2 code. */
#if KILN_X86
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#include <immintrin.h>
#include <string.h>

#include "act.h"
#include "kernels.h"

#define ALWAYS static inline __attribute__((always_inline))
#define TB 32 /* most tokens per block */
#define TC 8  /* tiles per block */

typedef struct {
    __m512i w[4];    /* chunk pairs (0,1), (2,3), (4,5), (6,7): unsigned bytes */
    __m256i h[4];    /* short group of nb <= 4 blocks: chunk L (low 128 bits) and chunk L+4 (high) */
    __m256i sc, sc2; /* Q6K: sc_2j and sc_2j+1 (i32 per lane) */
    __m256i sc16;    /* Q6K: (sc_2j, sc_2j+1) i16 pairs, for the offset correction */
    __m256 d, m;
    __m256 scf;      /* Q4K/Q5K: sc_j as float (a block sum times sc_j stays below 2^24: exact either way) */
} wrow;

ALWAYS __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS __m256 f16x1(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return _mm256_set1_ps(_cvtsh_ss(v)); }
/* A K-quant header's d and dmin (two f16 at p) in lanes 0 and 1. */
ALWAYS __m128 d_dmin(const uint8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm_cvtph_ps(_mm_cvtsi32_si128(v)); }
ALWAYS __m256i ld256(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ALWAYS __m512i ld512(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
ALWAYS __m512i halves(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
/* Chunks c and c+1 of a region with chunk stride cs (contiguous in a full group). */
ALWAYS __m512i pair(const uint8_t *q, int c, int cs) {
    return cs == 32 ? ld512(q + 32 * c) : halves(ld256(q + c * cs), ld256(q + (c + 1) * cs));
}
#include "mxfp4_avx2.h"
ALWAYS __m256i fold(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

/* As prep() in kern_avx2.c, including the reads past a short group's data. */
ALWAYS void prep(kiln_wfmt f, const uint8_t *h, const uint8_t *q, int nb, wrow *p) {
    const __m512i lo4 = _mm512_set1_epi8(15);
    int cs = 4 * nb;
    if (f == KF_Q8_0)
        for (int i = 0; i < 4; i++) p->w[i] = _mm512_xor_si512(pair(q, 2 * i, cs), _mm512_set1_epi8((char)0x80));
    else
        for (int i = 0; i < 2; i++) { /* slots 2i, 2i+1: low nibbles chunks 2i, 2i+1; high 2i+4, 2i+5 */
            __m512i v = pair(q, 2 * i, cs);
            p->w[i] = _mm512_and_si512(v, lo4);
            p->w[i + 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
        }
    if (f == KF_MXFP4)
        for (int i = 0; i < 4; i++) p->w[i] = _mm512_shuffle_epi8(halves(mxfp4_table(), mxfp4_table()), p->w[i]);
    if (f == KF_Q5_0 || f == KF_Q5_K) { /* bit k of the high-bit byte -> +16 in chunk k */
        __m512i hb = _mm512_broadcast_i64x4(ld256(q + 16 * nb));
        for (int i = 0; i < 4; i++) {
            __m512i sel = halves(_mm256_set1_epi8((char)(1 << 2 * i)), _mm256_set1_epi8((char)(1 << (2 * i + 1))));
            p->w[i] = _mm512_mask_add_epi8(p->w[i], _mm512_test_epi8_mask(hb, sel), p->w[i], _mm512_set1_epi8(16));
        }
    }
    if (f == KF_Q6_K) { /* half h, bits 2m..2m+1 -> bits 4-5 of chunk 4h+m */
        const __m512i bits45 = _mm512_set1_epi8(0x30);
        const __m512i up = halves(_mm256_set1_epi16(4), _mm256_set1_epi16(2)), down = halves(_mm256_set1_epi16(0), _mm256_set1_epi16(2));
        for (int hf = 0; hf < 2; hf++) {
            __m512i hb = _mm512_broadcast_i64x4(ld256(q + 128 + 32 * hf));
            p->w[2 * hf] = _mm512_or_si512(p->w[2 * hf], _mm512_and_si512(_mm512_sllv_epi16(hb, up), bits45));
            p->w[2 * hf + 1] = _mm512_or_si512(p->w[2 * hf + 1], _mm512_and_si512(_mm512_srlv_epi16(hb, down), bits45));
        }
    }
    switch (f) {
    case KF_Q4_K: case KF_Q5_K:
    {   /* one conversion for d and dmin */
        p->scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(h + 4))));
        __m256 dm = _mm256_castps128_ps256(d_dmin(h));
        p->d = _mm256_broadcastss_ps(_mm256_castps256_ps128(dm));
        p->m = _mm256_mul_ps(_mm256_permutevar8x32_ps(dm, _mm256_set1_epi32(1)),
                             _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(h + 12)))));
        break;
    }
    case KF_Q6_K:
        p->sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(h + 2)));
        p->sc = _mm256_srai_epi32(_mm256_slli_epi32(p->sc16, 16), 16);
        p->sc2 = _mm256_srai_epi32(p->sc16, 16);
        p->d = f16x1(h);
        break;
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

ALWAYS __m256 fstep(kiln_wfmt f, const wrow *p, const uint8_t *ag, __m256i i32, __m256 acc) {
    __m256 dx = _mm256_loadu_ps((const float *)(ag + KILN_AG_D)), sum = _mm256_cvtepi32_ps(i32);
    if (f == KF_Q4_K || f == KF_Q5_K) sum = _mm256_mul_ps(sum, p->scf);
    acc = _mm256_fmadd_ps(sum, _mm256_mul_ps(p->d, dx), acc);
    if (f == KF_Q4_1) acc = _mm256_fmadd_ps(p->m, _mm256_loadu_ps((const float *)(ag + KILN_AG_S)), acc);
    if (f == KF_Q4_K || f == KF_Q5_K) acc = _mm256_fnmadd_ps(p->m, _mm256_loadu_ps((const float *)(ag + KILN_AG_S)), acc);
    return acc;
}

/* Offset corrections of the integer sum, from the activation block sums. */
ALWAYS __m256i offset(kiln_wfmt f, __m256i i32, const uint8_t *ag) {
    __m256i sum32 = ld256(ag + KILN_AG_SUM32);
    if (f == KF_Q4_0) return _mm256_sub_epi32(i32, _mm256_slli_epi32(sum32, 3));
    if (f == KF_Q5_0) return _mm256_sub_epi32(i32, _mm256_slli_epi32(sum32, 4));
    if (f == KF_Q8_0) return _mm256_sub_epi32(i32, _mm256_slli_epi32(sum32, 7));
    if (f == KF_MXFP4) return _mm256_sub_epi32(i32, times12(sum32));
    return i32;
}

/* As prep4() in kern_avx2.c: short group of nb <= 4 blocks in "pair" order, 256-bit VNNI. */
ALWAYS void prep4(kiln_wfmt f, const uint8_t *h, const uint8_t *q, int nb, wrow *p) {
    const __m256i lo4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    int cs = 4 * nb;
    for (int L = 0; L < 4; L++) {
        if (f == KF_Q8_0) {
            p->h[L] = _mm256_xor_si256(_mm256_loadu2_m128i((const __m128i *)(q + (L + 4) * cs), (const __m128i *)(q + L * cs)),
                                       _mm256_set1_epi8((char)0x80));
            continue;
        }
        __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + L * cs)));
        p->h[L] = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), lo4);
        if (f == KF_MXFP4) p->h[L] = _mm256_shuffle_epi8(mxfp4_table(), p->h[L]);
        if (f == KF_Q5_0) {
            __m256i hb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + 16 * nb)));
            hb = _mm256_sllv_epi32(hb, _mm256_setr_epi32(4 - L, 4 - L, 4 - L, 4 - L, 0, 0, 0, 0));
            hb = _mm256_srlv_epi32(hb, _mm256_setr_epi32(0, 0, 0, 0, L, L, L, L));
            p->h[L] = _mm256_or_si256(p->h[L], _mm256_and_si256(hb, bit4));
        }
    }
    __m256 mask = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nb), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    p->d = _mm256_and_ps(f == KF_MXFP4 ? e8m0x8(h) : f16x8(h), mask);
    if (f == KF_Q4_1) p->m = _mm256_and_ps(f16x8(h + 2 * nb), mask);
}

ALWAYS __m256 dot4(kiln_wfmt f, const wrow *p, const uint8_t *ag, __m256 acc) {
    __m256i s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), p->h[0], ld256(ag));
    for (int L = 1; L < 4; L++) s = _mm256_dpbusd_epi32(s, p->h[L], ld256(ag + 32 * L));
    __m256i i32 = _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
    return fstep(f, p, ag, offset(f, i32, ag), acc);
}

ALWAYS __m256 dot(kiln_wfmt f, const wrow *p, const uint8_t *ag, __m256 acc) {
    __m512i a[4];
    for (int i = 0; i < 4; i++) a[i] = ld512(ag + 64 * i);
    __m256i i32;
    if (f == KF_Q6_K) { /* chunks 0-3: sub-block 2j; chunks 4-7: sub-block 2j+1 */
        __m256i A = fold(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), p->w[0], a[0]), p->w[1], a[1]));
        __m256i B = fold(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), p->w[2], a[2]), p->w[3], a[3]));
        i32 = _mm256_add_epi32(_mm256_mullo_epi32(A, p->sc), _mm256_mullo_epi32(B, p->sc2));
        i32 = _mm256_sub_epi32(i32, _mm256_slli_epi32(_mm256_madd_epi16(p->sc16, ld256(ag + KILN_AG_SUM16)), 5));
    } else {
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), p->w[0], a[0]);
        for (int i = 1; i < 4; i++) s = _mm512_dpbusd_epi32(s, p->w[i], a[i]);
        i32 = fold(s);
        i32 = offset(f, i32, ag);
    }
    return fstep(f, p, ag, i32, acc);
}

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

/* ---- Several tokens: rows in pairs ----
   A pair's unpacked weights are regrouped once per group into 8 vectors, row r in the low half and row r+1
   in the high: for chunks c, c+1 (c even) one holds (r: c, r+1: c+1) and the other (r: c+1, r+1: c). A
   token's chunks c and c+1 loaded as one vector meet the first, and with its halves swapped the second, so
   16 lanes gather both rows' block sums: no fold per token, and the offset, convert, scale and FMA that
   dot() spends per row and token run once per pair. A 256-bit broadcast load of each chunk instead costs
   Zen 4 more than the load and one swap (docs/PERF.md). Each lane's integer sum is dot()'s and the float
   steps are in dot()'s order: the same bits. The regrouping serves every token. Q6_K keeps dot(). */
ALWAYS __m512 both(__m256 lo, __m256 hi) { return _mm512_castsi512_ps(halves(_mm256_castps_si256(lo), _mm256_castps_si256(hi))); }
ALWAYS __m512 bcast8(const uint8_t *p) { return _mm512_castsi512_ps(_mm512_broadcast_i64x4(ld256(p))); }

/* Chunks 2i, 2i+1 of rows r, r+1 as (r: 2i, r+1: 2i+1) and (r: 2i+1, r+1: 2i); prep() holds chunks 2i, 2i+1
   of a row in w[i]. */
ALWAYS void chunks_by_pair(const wrow *w0, const wrow *w1, __m512i pw[8]) {
    for (int i = 0; i < 4; i++) {
        pw[2 * i] = _mm512_shuffle_i64x2(w0->w[i], w1->w[i], 0xE4);
        pw[2 * i + 1] = _mm512_shuffle_i64x2(w0->w[i], w1->w[i], 0x4E);
    }
}

/* Minus offset()'s correction of a token's block sums, in both halves: the even chain starts from it, so the
   integer sum comes out corrected at no cost per pair. */
ALWAYS __m512i neg_offset(kiln_wfmt f, const uint8_t *ag) {
    return _mm512_broadcast_i64x4(offset(f, _mm256_setzero_si256(), ag));
}

/* Both pairs' block sums for one token, corrected: each of the token's chunk pairs, as loaded and swapped,
   serves the two pairs; the two orders in separate chains (half the dependent latency). */
ALWAYS void dpsum_pairs(__m512i pw[2][8], const uint8_t *ag, __m512i init, __m512i out[2]) {
    __m512i e[2] = {init, init}, o[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int c = 0; c < 8; c += 2) {
        __m512i xe = ld512(ag + 32 * c), xo = _mm512_shuffle_i64x2(xe, xe, 0x4E);
        for (int pr = 0; pr < 2; pr++) {
            e[pr] = _mm512_dpbusd_epi32(e[pr], pw[pr][c], xe);
            o[pr] = _mm512_dpbusd_epi32(o[pr], pw[pr][c + 1], xo);
        }
    }
    for (int pr = 0; pr < 2; pr++) out[pr] = _mm512_add_epi32(e[pr], o[pr]);
}

/* A K-quant pair's 20-byte headers decoded together: d, dmin x mins and the scales of both rows. */
ALWAYS void kquant_pair_header(const uint8_t *h0, const uint8_t *h1, __m512 *d, __m512 *m, __m512 *sc) {
    int32_t v0, v1;
    memcpy(&v0, h0, 4), memcpy(&v1, h1, 4);
    __m128i dm = _mm_insert_epi32(_mm_cvtsi32_si128(v0), v1, 1);
    __m512 dmf = _mm512_castps128_ps512(_mm_cvtph_ps(dm)); /* d0 dmin0 d1 dmin1 */
    const __m512i row_of_lane = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    *d = _mm512_permutexvar_ps(row_of_lane, dmf);
    __m512 dmin = _mm512_permutexvar_ps(_mm512_add_epi32(row_of_lane, _mm512_set1_epi32(1)), dmf);
    __m128i x0 = _mm_loadu_si128((const __m128i *)(h0 + 4)), x1 = _mm_loadu_si128((const __m128i *)(h1 + 4)); /* scales | mins */
    *sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(x0, x1)));
    *m = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(x0, x1))));
}

/* A pair's factors, 16 lanes (row r low, row r+1 high); the values prep() gives each row. */
ALWAYS void pair_scales(kiln_wfmt f, const uint8_t *h0, const uint8_t *h1, const wrow *w0, const wrow *w1, __m512 *d, __m512 *m,
                        __m512 *sc) {
    *m = *sc = _mm512_setzero_ps();
    if (f == KF_Q4_K || f == KF_Q5_K) {
        kquant_pair_header(h0, h1, d, m, sc);
        return;
    }
    *d = both(w0->d, w1->d);
    if (f == KF_Q4_1) *m = both(w0->m, w1->m);
}

/* fstep() for a pair's 16 lanes of corrected block sums. */
ALWAYS __m512 fstep_pair(kiln_wfmt f, __m512i i32, __m512 d, __m512 m, __m512 sc, __m512 dx, __m512 sx, __m512 acc) {
    __m512 sum = _mm512_cvtepi32_ps(i32);
    if (f == KF_Q4_K || f == KF_Q5_K) sum = _mm512_mul_ps(sum, sc);
    acc = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, dx), acc);
    if (f == KF_Q4_1) acc = _mm512_fmadd_ps(m, sx, acc);
    if (f == KF_Q4_K || f == KF_Q5_K) acc = _mm512_fnmadd_ps(m, sx, acc);
    return acc;
}

/* A pair's accumulator back to its rows' 8-lane ones. */
ALWAYS void unpair(__m512 v, __m256 *lo, __m256 *hi) {
    *lo = _mm512_castps512_ps256(v);
    *hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* Full groups 0..G-1 of a tile for n tokens into pacc[pr][t], pair pr's 16 lanes (G >= 1): per group both
   pairs are regrouped once, then every token meets both. */
ALWAYS void groups_by_pairs(kiln_wfmt f, const uint8_t *tile, int G, const uint8_t *act, size_t stride, int n, int far, __m512 pacc[2][TB]) {
    const int HB = kiln_fmt_head_bytes(f, 8), QB = kiln_fmt_quant_bytes(f, 8), GB = 4 * (HB + QB);
    for (int g = 0; g < G; g++) {
        const uint8_t *p = tile + g * GB, *ag = act + g * KILN_AG_BYTES;
        KILN_PREFETCH_GROUP(p, GB, KILN_PREFETCH_AHEAD(n), far);
        __m512i pw[2][8];
        __m512 d[2], m[2], sc[2];
        for (int pr = 0; pr < 2; pr++) {
            wrow w0, w1;
            prep(f, p + 2 * pr * HB, p + 4 * HB + 2 * pr * QB, 8, &w0);
            prep(f, p + (2 * pr + 1) * HB, p + 4 * HB + (2 * pr + 1) * QB, 8, &w1);
            chunks_by_pair(&w0, &w1, pw[pr]);
            pair_scales(f, p + 2 * pr * HB, p + (2 * pr + 1) * HB, &w0, &w1, &d[pr], &m[pr], &sc[pr]);
        }
        for (int t = 0; t < n; t++) {
            const uint8_t *at = ag + t * stride;
            __m512i i32[2];
            dpsum_pairs(pw, at, neg_offset(f, at), i32);
            __m512 dx = bcast8(at + KILN_AG_D), sx = bcast8(at + KILN_AG_S);
            for (int pr = 0; pr < 2; pr++)
                pacc[pr][t] = fstep_pair(f, i32[pr], d[pr], m[pr], sc[pr], dx, sx, g ? pacc[pr][t] : _mm512_setzero_ps());
        }
    }
}

/* One token: per pair of rows, each row's 16 lanes of half-sums are folded into one vector of both rows' 8
   block sums (two lane shuffles and an add for two rows), so the float steps run once per pair, 16 lanes
   wide. Each lane sees dot()'s integer sum and float steps: the same bits. */
ALWAYS void groups_one_token(kiln_wfmt f, const uint8_t *tile, int G, const uint8_t *act, __m256 acc[4][TB]) {
    const int HB = kiln_fmt_head_bytes(f, 8), QB = kiln_fmt_quant_bytes(f, 8), GB = 4 * (HB + QB);
    __m512 pacc[2];
    for (int g = 0; g < G; g++) {
        const uint8_t *p = tile + g * GB, *ag = act + g * KILN_AG_BYTES;
        KILN_PREFETCH_GROUP(p, GB, KILN_PREFETCH, 0);
        __m512i a[4];
        for (int i = 0; i < 4; i++) a[i] = ld512(ag + 64 * i);
        /* the offset in the low half only: folding adds it once to each row's block sums */
        __m512i init = _mm512_zextsi256_si512(offset(f, _mm256_setzero_si256(), ag));
        __m512 dx = bcast8(ag + KILN_AG_D), sx = bcast8(ag + KILN_AG_S);
        for (int pr = 0; pr < 2; pr++) {
            wrow w0, w1;
            prep(f, p + 2 * pr * HB, p + 4 * HB + 2 * pr * QB, 8, &w0);
            prep(f, p + (2 * pr + 1) * HB, p + 4 * HB + (2 * pr + 1) * QB, 8, &w1);
            __m512i s0 = init, s1 = init;
            for (int i = 0; i < 4; i++) s0 = _mm512_dpbusd_epi32(s0, w0.w[i], a[i]), s1 = _mm512_dpbusd_epi32(s1, w1.w[i], a[i]);
            __m512i i32 = _mm512_add_epi32(_mm512_shuffle_i64x2(s0, s1, 0x44), _mm512_shuffle_i64x2(s0, s1, 0xEE));
            __m512 d, m, sc;
            pair_scales(f, p + 2 * pr * HB, p + (2 * pr + 1) * HB, &w0, &w1, &d, &m, &sc);
            pacc[pr] = fstep_pair(f, i32, d, m, sc, dx, sx, g ? pacc[pr] : _mm512_setzero_ps());
        }
    }
    for (int pr = 0; pr < 2; pr++) unpair(pacc[pr], &acc[2 * pr][0], &acc[2 * pr + 1][0]);
}

/* Even lanes plus odd lanes of a, then of b: each result lane adds two neighbours, as hadd does. */
ALWAYS __m512 fold_lanes(__m512 a, __m512 b) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b));
}

/* reduce4() of every row and token straight from the pairs' accumulators, four tokens a pass: lane pairs, then
   quads, then the halves, in reduce4()'s order of additions (the same bits) with a fraction of its shuffles. */
ALWAYS void store_pairs(__m512 pacc[2][TB], int n, float *y, int ldy, int nrows) {
    const __m512i by_token = _mm512_setr_epi32(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    for (int t = 0; t < n; t += 4) {
        __m512 q[2];
        for (int pr = 0; pr < 2; pr++) {
            __m512 v[4];
            for (int k = 0; k < 4; k++) v[k] = t + k < n ? pacc[pr][t + k] : _mm512_setzero_ps();
            q[pr] = fold_lanes(fold_lanes(v[0], v[1]), fold_lanes(v[2], v[3]));
        }
        __m512 r = _mm512_permutexvar_ps(by_token, fold_lanes(q[0], q[1])); /* token k: rows 0-3 in lanes 4k..4k+3 */
        __m128 o[4] = {_mm512_castps512_ps128(r), _mm512_extractf32x4_ps(r, 1), _mm512_extractf32x4_ps(r, 2), _mm512_extractf32x4_ps(r, 3)};
        for (int k = 0; k < 4 && t + k < n; k++) store_rows(y + (t + k) * ldy, o[k], nrows);
    }
}

/* acc[r][t], t < n, is set by the first group or zeroed when there is none; GCC cannot tell. `far`: also fetch
   the weights KILN_PREFETCH_FAR ahead into L2. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
ALWAYS void qtile(kiln_wfmt f, const uint8_t *tile, int cols, const uint8_t *act, size_t stride, int n, int far, float *y, int ldy, int nrows) {
    const int HB = kiln_fmt_head_bytes(f, 8), QB = kiln_fmt_quant_bytes(f, 8), GB = 4 * (HB + QB);
    int G = cols / KILN_GROUP, nt = cols % KILN_GROUP / 32;
    __m256 acc[4][TB];
    if (G == 0) /* else the first group sets them: zeroing the array in memory (rep stos) cost 20% at 8 tokens */
        for (int r = 0; r < 4; r++)
            for (int t = 0; t < n; t++) acc[r][t] = _mm256_setzero_ps();
    int G_by_row = G; /* full groups left to the row-by-row loop */
    if (f != KF_Q6_K && G) {
        if (n > 1) {
            __m512 pacc[2][TB];
            groups_by_pairs(f, tile, G, act, stride, n, far, pacc);
            if (!nt) {
                store_pairs(pacc, n, y, ldy, nrows);
                return;
            }
            for (int pr = 0; pr < 2; pr++) /* the tail below adds into each row's own accumulators */
                for (int t = 0; t < n; t++) unpair(pacc[pr][t], &acc[2 * pr][t], &acc[2 * pr + 1][t]);
        } else {
            groups_one_token(f, tile, G, act, acc);
        }
        G_by_row = 0;
    }
    for (int g = 0; g < G_by_row; g++) {
        const uint8_t *p = tile + g * GB, *ag = act + g * KILN_AG_BYTES;
        KILN_PREFETCH_GROUP(p, GB, KILN_PREFETCH_AHEAD(n), far);
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
    if (nt && f != KF_Q4_K && f != KF_Q5_K && f != KF_Q6_K) { /* short group, as in kern_avx2.c */
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

/* Float formats: one 16-lane accumulator per row and token (= the AVX2 lo/hi pair). */
ALWAYS __m512 fload(kiln_wfmt f, const uint8_t *p) {
    if (f == KF_F32) return _mm512_loadu_ps((const float *)p);
    if (f == KF_F16) return _mm512_cvtph_ps(ld256(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(ld256(p)), 16));
}

ALWAYS __m256 fold_ps(__m512 v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))); }

ALWAYS void ftile(kiln_wfmt f, const uint8_t *tile, int cols, const uint8_t *act, size_t stride, int n, float *y, int ldy, int nrows) {
    const int es = kiln_fmt_elem_bytes(f), RB = KILN_FCHUNK * es, CB = 4 * RB;
    int nchunk = (cols + KILN_FCHUNK - 1) / KILN_FCHUNK;
    size_t xs = stride / 4;
    const float *x = (const float *)act;
    for (int t = 0; t < n; t += 2) { /* 4 rows x 2 tokens */
        int ntk = n - t < 2 ? n - t : 2;
        __m512 acc[4][2];
        for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int c = 0; c < nchunk; c++) {
            const uint8_t *p = tile + c * CB;
            for (int r = 0; r < 4; r++) {
                __m512 wv = fload(f, p + r * RB);
                for (int k = 0; k < ntk; k++) acc[r][k] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + (t + k) * xs + c * KILN_FCHUNK), acc[r][k]);
            }
        }
        for (int k = 0; k < ntk; k++)
            store_rows(y + (t + k) * ldy, reduce4(fold_ps(acc[0][k]), fold_ps(acc[1][k]), fold_ps(acc[2][k]), fold_ps(acc[3][k])), nrows);
    }
}

ALWAYS void run(kiln_wfmt f, const kiln_wmat *w, const uint8_t *act, int n_tok, float *y, int ldy, int tile0, int tile1) {
    size_t stride = kiln_act_stride(f, w->cols);
    if (n_tok == 1) {
        for (int ti = tile0; ti < tile1; ti++) {
            const uint8_t *tile = w->data + ti * w->tile_bytes;
            if (kiln_fmt_is_float(f))
                ftile(f, tile, w->cols, act, stride, 1, y + 4 * ti, ldy, w->rows - 4 * ti);
            else
                qtile(f, tile, w->cols, act, stride, 1, 0, y + 4 * ti, ldy, w->rows - 4 * ti);
        }
        return;
    }
    /* rows of 4 groups or more unpack each group once per 32 tokens; shorter rows ran slower so (docs/PERF.md) */
    int tb = w->cols >= 4 * KILN_GROUP ? TB : TB / 2;
    for (int tc = tile0; tc < tile1; tc += TC)
        for (int t0 = 0; t0 < n_tok; t0 += tb) {
            int n = n_tok - t0 < tb ? n_tok - t0 : tb;
            for (int ti = tc; ti < tile1 && ti < tc + TC; ti++) {
                const uint8_t *tile = w->data + ti * w->tile_bytes;
                float *yt = y + (size_t)t0 * ldy + 4 * ti;
                if (kiln_fmt_is_float(f))
                    ftile(f, tile, w->cols, act + t0 * stride, stride, n, yt, ldy, w->rows - 4 * ti);
                else
                    qtile(f, tile, w->cols, act + t0 * stride, stride, n, KILN_PREFETCH_FAR_FOR(t0, n), yt, ldy, w->rows - 4 * ti);
            }
        }
}

void kiln_matmul_avx512(const kiln_wmat *w, const void *act, int n_tok, float *y, int ldy, int tile0, int tile1) {
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
#endif
