/* AVX-512 scores and weighted values over the fp16 KV cache. For blocks of many queries (prefill) a tile's
 * keys and values are converted to fp32 once, on the stack, and every query of the block streams them: 32
 * keys (or dimensions) by up to 8 queries a pass, 16 accumulators, so the FMAs are the bound and no
 * conversion repeats per query. A few queries (a decode step's GQA group) convert in registers instead, 64
 * keys (or dimensions) by up to ATTN_FEW_QUERIES a pass: the conversion is shared by the group, and 4 to 16
 * independent accumulators hide the FMA latency that bounds the AVX2 kernels' 6. Each output is the same
 * chain of FMAs as in the AVX2 kernels (a lane per key or dimension, taken in dimension or key order), so
 * the results are the same bits. */
#if defined(KILN_X86)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#include <immintrin.h>
#include <string.h>

#include "attn.h"
#include "attn_quant.h"

#define ALWAYS static inline __attribute__((always_inline))
#define QUERIES 8 /* queries a pass */

/* Keys [0, nk) of a tile (groups of KEY_GROUP, [dim][8] each) as fp32 [32-key chunk][dim][32], the
 * missing keys of the last chunk zero. */
static void keys_to_f32(const uint16_t *kg, int nk, int hd, float *kf) {
    const size_t group = (size_t)hd * KEY_GROUP;
    int groups = nk / KEY_GROUP;
    for (int c = 0; c * 32 < nk; c++)
        for (int half = 0; half < 2; half++) {
            int g = 4 * c + 2 * half; /* groups g, g + 1 fill 16 lanes */
            const uint16_t *k0 = kg + g * group, *k1 = k0 + group;
            float *out = kf + (size_t)c * hd * 32 + 16 * half;
            for (int d = 0; d < hd; d++) {
                __m128i lo = g < groups ? _mm_loadu_si128((const __m128i *)(k0 + d * KEY_GROUP)) : _mm_setzero_si128();
                __m128i hi = g + 1 < groups ? _mm_loadu_si128((const __m128i *)(k1 + d * KEY_GROUP)) : _mm_setzero_si128();
                _mm512_storeu_ps(out + (size_t)d * 32, _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1)));
            }
        }
}

/* nq (1..QUERIES, a constant once inlined) queries x 32 keys of one chunk kc ([dim][32]). */
ALWAYS void scores_32(const float *q, int nq, int hd, const float *kc, float *s) {
    __m512 a[QUERIES], b[QUERIES];
    for (int r = 0; r < nq; r++) a[r] = b[r] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d++) {
        __m512 x0 = _mm512_loadu_ps(kc + (size_t)d * 32), x1 = _mm512_loadu_ps(kc + (size_t)d * 32 + 16);
        for (int r = 0; r < nq; r++) {
            __m512 c = _mm512_set1_ps(q[r * hd + d]);
            a[r] = _mm512_fmadd_ps(c, x0, a[r]), b[r] = _mm512_fmadd_ps(c, x1, b[r]);
        }
    }
    for (int r = 0; r < nq; r++) _mm512_storeu_ps(s + r * ATTN_TILE, a[r]), _mm512_storeu_ps(s + r * ATTN_TILE + 16, b[r]);
}

/* kiln_kv_kernels.scores. A chunk past nk writes scores of zero keys up to 32 lanes, inside the tile's row. */
void kiln_scores_avx512(const float *q, int nq, int hd, const uint8_t *kg, int nk, const uint8_t *v, const uint8_t *next,
                        float *s) {
    (void)v, (void)next;
    float kf[(ATTN_TILE / 32) * 32 * hd];
    keys_to_f32((const uint16_t *)kg, nk, hd, kf);
    for (int c = 0; c * 32 < nk; c++) {
        const float *kc = kf + (size_t)c * hd * 32;
        float *sc = s + 32 * c;
        int r = 0;
        for (; r + QUERIES <= nq; r += QUERIES) scores_32(q + (size_t)r * hd, QUERIES, hd, kc, sc + (size_t)r * ATTN_TILE);
        const float *qr = q + (size_t)r * hd;
        float *sr = sc + (size_t)r * ATTN_TILE;
        switch (nq - r) {
        case 7: scores_32(qr, 7, hd, kc, sr); break;
        case 6: scores_32(qr, 6, hd, kc, sr); break;
        case 5: scores_32(qr, 5, hd, kc, sr); break;
        case 4: scores_32(qr, 4, hd, kc, sr); break;
        case 3: scores_32(qr, 3, hd, kc, sr); break;
        case 2: scores_32(qr, 2, hd, kc, sr); break;
        case 1: scores_32(qr, 1, hd, kc, sr); break;
        }
    }
}

/* nq (1..QUERIES) queries x 32 dimensions from d of values vf ([key][hd]). */
ALWAYS void accumulate_32(const float *p, int nq, int nk, const float *vf, int hd, float *o) {
    __m512 a[QUERIES], b[QUERIES];
    for (int r = 0; r < nq; r++) a[r] = _mm512_loadu_ps(o + r * hd), b[r] = _mm512_loadu_ps(o + r * hd + 16);
    for (int j = 0; j < nk; j++) {
        __m512 v0 = _mm512_loadu_ps(vf + (size_t)j * hd), v1 = _mm512_loadu_ps(vf + (size_t)j * hd + 16);
        for (int r = 0; r < nq; r++) {
            __m512 pr = _mm512_set1_ps(p[r * ATTN_TILE + j]);
            a[r] = _mm512_fmadd_ps(pr, v0, a[r]), b[r] = _mm512_fmadd_ps(pr, v1, b[r]);
        }
    }
    for (int r = 0; r < nq; r++) _mm512_storeu_ps(o + r * hd, a[r]), _mm512_storeu_ps(o + r * hd + 16, b[r]);
}

/* nq queries x 16 dimensions from d, for a head dim that is an odd number of 16s. */
ALWAYS void accumulate_16(const float *p, int nq, int nk, const float *vf, int hd, float *o) {
    __m512 a[QUERIES];
    for (int r = 0; r < nq; r++) a[r] = _mm512_loadu_ps(o + r * hd);
    for (int j = 0; j < nk; j++) {
        __m512 v0 = _mm512_loadu_ps(vf + (size_t)j * hd);
        for (int r = 0; r < nq; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * ATTN_TILE + j]), v0, a[r]);
    }
    for (int r = 0; r < nq; r++) _mm512_storeu_ps(o + r * hd, a[r]);
}

#define BY_QUERIES(fn, p, nq, nk, vf, hd, o) do { \
        switch (nq) { \
        case 8: fn(p, 8, nk, vf, hd, o); break; \
        case 7: fn(p, 7, nk, vf, hd, o); break; \
        case 6: fn(p, 6, nk, vf, hd, o); break; \
        case 5: fn(p, 5, nk, vf, hd, o); break; \
        case 4: fn(p, 4, nk, vf, hd, o); break; \
        case 3: fn(p, 3, nk, vf, hd, o); break; \
        case 2: fn(p, 2, nk, vf, hd, o); break; \
        case 1: fn(p, 1, nk, vf, hd, o); break; \
        } \
    } while (0)

/* kiln_kv_kernels.accumulate; hd a multiple of 16. */
void kiln_accumulate_avx512(const float *p, int nq, int nk, const uint8_t *v_bytes, int hd, float *o) {
    const uint16_t *v = (const uint16_t *)v_bytes;
    float vf[ATTN_TILE * hd];
    for (size_t i = 0; i < (size_t)nk * hd; i += 16)
        _mm512_storeu_ps(vf + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + i))));
    for (int r = 0; r < nq; r += QUERIES) {
        int n = nq - r < QUERIES ? nq - r : QUERIES;
        const float *pr = p + (size_t)r * ATTN_TILE;
        float *orow = o + (size_t)r * hd;
        int d = 0;
        for (; d + 32 <= hd; d += 32) BY_QUERIES(accumulate_32, pr, n, nk, vf + d, hd, orow + d);
        if (d < hd) BY_QUERIES(accumulate_16, pr, n, nk, vf + d, hd, orow + d);
    }
}
/* ---- a few queries: 64 keys or dimensions a pass, converted in registers ---- */

/* Dimension d of the 16 keys of groups g and g + 1 (the second zero when absent: a tile's last 8 keys). */
ALWAYS __m512 keys16(const uint16_t *kg, size_t group, int g, int pair, int d) {
    const uint16_t *k0 = kg + (size_t)g * group + d * KEY_GROUP;
    __m128i lo = _mm_loadu_si128((const __m128i *)k0);
    __m128i hi = pair ? _mm_loadu_si128((const __m128i *)(k0 + group)) : _mm_setzero_si128();
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

/* nq (1..ATTN_FEW_QUERIES) queries x nz (1..4) pieces of 16 keys from group g, the last piece a single
 * group when `half`; both constants once inlined. While the keys are scored, two lines a dimension of pk
 * (the next tile's keys: 2·hd lines for 64 keys) are fetched into L2: a decode step's cache comes from
 * memory, and fetches into L1 stall on its few miss buffers (docs/PERF.md, "Decode attention's prefetches
 * into L2"). */
ALWAYS void scores_few(const float *q, int nq, int hd, const uint16_t *kg, int g, int nz, int half, const char *pk,
                       float *s) {
    const size_t group = (size_t)hd * KEY_GROUP;
    __m512 a[ATTN_FEW_QUERIES][4];
    for (int r = 0; r < nq; r++)
        for (int z = 0; z < nz; z++) a[r][z] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d++) {
        _mm_prefetch(pk + (size_t)d * 128, _MM_HINT_T1), _mm_prefetch(pk + (size_t)d * 128 + 64, _MM_HINT_T1);
        __m512 x[4];
        for (int z = 0; z < nz; z++) x[z] = keys16(kg, group, g + 2 * z, !(half && z == nz - 1), d);
        for (int r = 0; r < nq; r++) {
            __m512 c = _mm512_set1_ps(q[r * hd + d]);
            for (int z = 0; z < nz; z++) a[r][z] = _mm512_fmadd_ps(c, x[z], a[r][z]);
        }
    }
    for (int r = 0; r < nq; r++)
        for (int z = 0; z < nz; z++) _mm512_storeu_ps(s + r * ATTN_TILE + 16 * z, a[r][z]);
}

#define BY_FEW_QUERIES(fn, nq, ...) do { \
        switch (nq) { \
        case 4: fn(4, __VA_ARGS__); break; \
        case 3: fn(3, __VA_ARGS__); break; \
        case 2: fn(2, __VA_ARGS__); break; \
        default: fn(1, __VA_ARGS__); \
        } \
    } while (0)
#define SCORES_FEW(nq, q, hd, kg, g, nz, half, pk, s) scores_few(q, nq, hd, kg, g, nz, half, pk, s)
#define ACCUMULATE_FEW(nq, p, nk, v, hd, nz, pf, o) accumulate_few(p, nq, nk, v, hd, nz, pf, o)

/* kiln_kv_kernels.scores for nq <= ATTN_FEW_QUERIES. Lanes past nk (up to the tile's 64) get scores of
 * zero keys. */
void kiln_scores_few_avx512(const float *q, int nq, int hd, const uint8_t *kg_bytes, int nk, const uint8_t *v,
                            const uint8_t *next, float *s) {
    (void)v;
    const uint16_t *kg = (const uint16_t *)kg_bytes;
    const char *pk = (const char *)next;
    if (nk == ATTN_TILE) {
        BY_FEW_QUERIES(SCORES_FEW, nq, q, hd, kg, 0, 4, 0, pk, s);
        return;
    }
    /* a context's last tile; prefetching past a cache's end is harmless */
    int groups = nk / KEY_GROUP, nz = (groups + 1) / 2, half = groups % 2;
    switch (nz) {
    case 4: BY_FEW_QUERIES(SCORES_FEW, nq, q, hd, kg, 0, 4, half, pk, s); break;
    case 3: BY_FEW_QUERIES(SCORES_FEW, nq, q, hd, kg, 0, 3, half, pk, s); break;
    case 2: BY_FEW_QUERIES(SCORES_FEW, nq, q, hd, kg, 0, 2, half, pk, s); break;
    default: BY_FEW_QUERIES(SCORES_FEW, nq, q, hd, kg, 0, 1, half, pk, s);
    }
}

/* nq (1..ATTN_FEW_QUERIES) queries x nz (1..4) pieces of 16 dimensions of values v ([key][hd], from the
 * first dimension wanted), fetching two lines a key from pf into L2. */
ALWAYS void accumulate_few(const float *p, int nq, int nk, const uint16_t *v, int hd, int nz, const char *pf, float *o) {
    __m512 a[ATTN_FEW_QUERIES][4];
    for (int r = 0; r < nq; r++)
        for (int z = 0; z < nz; z++) a[r][z] = _mm512_loadu_ps(o + r * hd + 16 * z);
    for (int j = 0; j < nk; j++) {
        _mm_prefetch(pf + (size_t)j * 128, _MM_HINT_T1), _mm_prefetch(pf + (size_t)j * 128 + 64, _MM_HINT_T1);
        __m512 x[4];
        for (int z = 0; z < nz; z++) x[z] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(v + (size_t)j * hd + 16 * z)));
        for (int r = 0; r < nq; r++) {
            __m512 c = _mm512_set1_ps(p[r * ATTN_TILE + j]);
            for (int z = 0; z < nz; z++) a[r][z] = _mm512_fmadd_ps(c, x[z], a[r][z]);
        }
    }
    for (int r = 0; r < nq; r++)
        for (int z = 0; z < nz; z++) _mm512_storeu_ps(o + r * hd + 16 * z, a[r][z]);
}

/* kiln_kv_kernels.accumulate for nq <= ATTN_FEW_QUERIES; hd a multiple of 16. */
void kiln_accumulate_few_avx512(const float *p, int nq, int nk, const uint8_t *v_bytes, int hd, float *o) {
    const uint16_t *v = (const uint16_t *)v_bytes;
    /* The next tile's values (the next part's past a part's end, harmless past the cache's), 128 lines a
     * pass: the passes fetch the hd * 128 bytes of 64 keys' values, and when hd is not a multiple of 64 the
     * last pass runs on into the tile after (fetched early, not wasted). */
    const char *next = (const char *)(v + (size_t)ATTN_TILE * hd);
    for (int d = 0; d < hd; d += 64) {
        const char *pf = next + (size_t)(d / 64) * ATTN_TILE * 128;
        switch ((hd - d) / 16 < 4 ? (hd - d) / 16 : 4) {
        case 4: BY_FEW_QUERIES(ACCUMULATE_FEW, nq, p, nk, v + d, hd, 4, pf, o + d); break;
        case 3: BY_FEW_QUERIES(ACCUMULATE_FEW, nq, p, nk, v + d, hd, 3, pf, o + d); break;
        case 2: BY_FEW_QUERIES(ACCUMULATE_FEW, nq, p, nk, v + d, hd, 2, pf, o + d); break;
        default: BY_FEW_QUERIES(ACCUMULATE_FEW, nq, p, nk, v + d, hd, 1, pf, o + d);
        }
    }
}
#endif
