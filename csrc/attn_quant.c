/* Attention over a quantized KV cache (attn_quant.h): q8_0 and q4_0 share every kernel, which differ
 * only in how a block's codes become fp32 (an inlined step on the type, a constant in each kernel). The
 * codes are converted in registers and the block scale applied once per block, so no dequantized copy
 * of the cache is ever made. The tile loop and softmax are kiln_attend_part's (attn.c). */
#include "attn_quant.h"

#include <math.h>
#include <string.h>

#include "attn.h"
#include "dequant.h"
#include "kernels.h"
#include "vecmath.h"

#define TILE ATTN_TILE

const char *const KV_NAMES[KV_COUNT] = {[KV_F16] = "f16", [KV_Q8_0] = "q8_0", [KV_Q4_0] = "q4_0"};

/* Bytes of codes of one block of 32 values. */
static inline int code_bytes(int t) { return t == KV_Q4_0 ? KV_BLOCK / 2 : KV_BLOCK; }
static inline size_t scales_bytes(int hd) { return (size_t)(hd / KV_BLOCK) * KEY_GROUP * 2; }
static inline size_t value_block_bytes(int t) { return 2 + (size_t)code_bytes(t); }

size_t kiln_kv_key_group_bytes(int t, int hd) {
    if (t == KV_F16) return (size_t)hd * KEY_GROUP * 2;
    return scales_bytes(hd) + (size_t)(hd / KV_BLOCK) * code_bytes(t) * KEY_GROUP;
}

size_t kiln_kv_value_row_bytes(int t, int hd) {
    if (t == KV_F16) return (size_t)hd * 2;
    return (size_t)(hd / KV_BLOCK) * value_block_bytes(t);
}

size_t kiln_kv_head_bytes(int t, int n_ctx, int hd) { return (size_t)(n_ctx / KEY_GROUP) * kiln_kv_key_group_bytes(t, hd); }

/* One block of 32 as type t stores it, ggml's reference rounding: returns the fp16 scale and writes
 * byte i of the codes at codes[i * stride]. */
static uint16_t quantize_block(int t, const float *x, uint8_t *codes, size_t stride) {
    float amax = 0.0f, max = 0.0f;
    for (int i = 0; i < KV_BLOCK; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    if (t == KV_Q8_0) {
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < KV_BLOCK; i++) codes[i * stride] = (uint8_t)(int8_t)roundf(x[i] * id);
        return kiln_float_to_half(d);
    }
    float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < KV_BLOCK / 2; i++) {
        int lo = (int8_t)(x[i] * id + 8.5f), hi = (int8_t)(x[i + KV_BLOCK / 2] * id + 8.5f);
        codes[i * stride] = (uint8_t)((lo < 15 ? lo : 15) | (hi < 15 ? hi : 15) << 4);
    }
    return kiln_float_to_half(d);
}

/* ---- the rotated basis: an orthonormal Walsh-Hadamard transform of each block of 32 ---- */

/* 1 / sqrt(32): the normalization that makes the transform orthonormal and its own inverse. */
#define WHT_NORM 0.17677669529663688f

/* Five butterfly stages (strides 16, 8, 4, 2, 1), each a[i] + a[i + s] and a[i] - a[i + s], then the
 * normalization: the vector version does the same operations in the same order, so both give the same bits. */
static void rotate_generic(const float *x, float *y, int n) {
    for (int b = 0; b < n; b += KV_BLOCK) {
        float a[KV_BLOCK];
        memcpy(a, x + b, sizeof a);
        for (int s = KV_BLOCK / 2; s >= 1; s /= 2)
            for (int i = 0; i < KV_BLOCK; i++)
                if (!(i & s)) {
                    float u = a[i], v = a[i + s];
                    a[i] = u + v, a[i + s] = u - v;
                }
        for (int i = 0; i < KV_BLOCK; i++) y[b + i] = a[i] * WHT_NORM;
    }
}

#if defined(KILN_X86)
/* Within one register, the butterfly of stride 4, 2 or 1: the partner lanes come from a permutation p; the
 * sums stay in the lower lane of each pair, the differences (partner - x there: u - v) go to the upper ones. */
#define BUTTERFLY_IN(x, p, upper) _mm256_blend_ps(_mm256_add_ps(x, p), _mm256_sub_ps(p, x), upper)

static __attribute__((target("avx2"))) void rotate_avx2(const float *x, float *y, int n) {
    for (int b = 0; b < n; b += KV_BLOCK) {
        __m256 r[4];
        for (int k = 0; k < 4; k++) r[k] = _mm256_loadu_ps(x + b + 8 * k);
        for (int s = 2; s >= 1; s /= 2) /* strides 16 and 8: between registers */
            for (int k = 0; k < 4; k++)
                if (!(k & s)) {
                    __m256 u = r[k], v = r[k + s];
                    r[k] = _mm256_add_ps(u, v), r[k + s] = _mm256_sub_ps(u, v);
                }
        for (int k = 0; k < 4; k++) {
            r[k] = BUTTERFLY_IN(r[k], _mm256_permute2f128_ps(r[k], r[k], 1), 0xF0);
            r[k] = BUTTERFLY_IN(r[k], _mm256_permute_ps(r[k], 0x4E), 0xCC);
            r[k] = BUTTERFLY_IN(r[k], _mm256_permute_ps(r[k], 0xB1), 0xAA);
            _mm256_storeu_ps(y + b + 8 * k, _mm256_mul_ps(r[k], _mm256_set1_ps(WHT_NORM)));
        }
    }
}
#endif

void kiln_kv_rotate(const float *x, float *y, int n) {
#if defined(KILN_X86)
    if (kiln_active_isa() >= ISA_AVX2) {
        rotate_avx2(x, y, n);
        return;
    }
#endif
    rotate_generic(x, y, n);
}

void kiln_store_key_quant(int t, const float *row, uint8_t *head_keys, int pos, int hd) {
    float x[hd];
    kiln_kv_rotate(row, x, hd);
    uint8_t *g = head_keys + (size_t)(pos / KEY_GROUP) * kiln_kv_key_group_bytes(t, hd), *codes = g + scales_bytes(hd);
    int at = pos % KEY_GROUP;
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        uint16_t d = quantize_block(t, x + b * KV_BLOCK, codes + (size_t)b * code_bytes(t) * KEY_GROUP + at, KEY_GROUP);
        memcpy(g + (size_t)(b * KEY_GROUP + at) * 2, &d, 2);
    }
}

void kiln_store_value_quant(int t, const float *row, uint8_t *head_values, int pos, int hd) {
    float x[hd];
    kiln_kv_rotate(row, x, hd);
    uint8_t *at = head_values + (size_t)pos * kiln_kv_value_row_bytes(t, hd);
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        uint8_t *blk = at + (size_t)b * value_block_bytes(t);
        uint16_t d = quantize_block(t, x + b * KV_BLOCK, blk + 2, 1);
        memcpy(blk, &d, 2);
    }
}

static inline float scale_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return kiln_half_to_float(h);
}

/* Dimension i (< 32) of a block whose code byte k is at codes[k * stride]. */
static inline float code_at(int t, const uint8_t *codes, int i, size_t stride) {
    if (t == KV_Q8_0) return (float)(int8_t)codes[i * stride];
    uint8_t byte = codes[(i % (KV_BLOCK / 2)) * stride];
    return (float)((i < KV_BLOCK / 2 ? byte & 15 : byte >> 4) - 8);
}

/* ---- portable reference: per block, the sum of q * code (dimensions i and i + 16 in turn, as the
 * vector kernels take them), then times the block's scale ---- */

static inline void scores_generic(int t, const float *q, int nq, int hd, const uint8_t *kg, int nk, const uint8_t *v,
                                  const uint8_t *next, float *s) {
    (void)v, (void)next;
    const size_t gb = kiln_kv_key_group_bytes(t, hd);
    for (int r = 0; r < nq; r++)
        for (int j = 0; j < nk; j++) {
            const uint8_t *g = kg + (size_t)(j / KEY_GROUP) * gb, *codes = g + scales_bytes(hd) + j % KEY_GROUP;
            float acc = 0.0f;
            for (int b = 0; b < hd / KV_BLOCK; b++) {
                const uint8_t *c = codes + (size_t)b * code_bytes(t) * KEY_GROUP;
                const float *qb = q + r * hd + b * KV_BLOCK;
                float blk = 0.0f;
                for (int i = 0; i < KV_BLOCK / 2; i++) {
                    blk += qb[i] * code_at(t, c, i, KEY_GROUP);
                    blk += qb[i + KV_BLOCK / 2] * code_at(t, c, i + KV_BLOCK / 2, KEY_GROUP);
                }
                acc += blk * scale_at(g + (size_t)(b * KEY_GROUP + j % KEY_GROUP) * 2);
            }
            s[r * TILE + j] = acc;
        }
}

static inline void accumulate_generic(int t, const float *p, int nq, int nk, const uint8_t *v, int hd, float *o) {
    const size_t rb = kiln_kv_value_row_bytes(t, hd);
    for (int j = 0; j < nk; j++)
        for (int b = 0; b < hd / KV_BLOCK; b++) {
            const uint8_t *blk = v + (size_t)j * rb + (size_t)b * value_block_bytes(t);
            float d = scale_at(blk);
            for (int r = 0; r < nq; r++) {
                float c = p[r * TILE + j] * d;
                for (int i = 0; i < KV_BLOCK; i++) o[r * hd + b * KV_BLOCK + i] += c * code_at(t, blk + 2, i, 1);
            }
        }
}

/* ---- AVX2 ---- */
#if defined(KILN_X86)
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

AVX2_INLINE __m256 nibbles_ps(__m256i bytes, int high) {
    __m256i n = high ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(n, _mm256_set1_epi32(8)));
}

/* 8 keys' dimensions i and i + 16 of one block, whose codes start at c ([code byte][KEY_GROUP]). */
AVX2_INLINE void key_pair_8(int t, const uint8_t *c, int i, __m256 *lo, __m256 *hi) {
    if (t == KV_Q8_0) {
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + i * KEY_GROUP))));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + (i + 16) * KEY_GROUP))));
    } else {
        __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + i * KEY_GROUP)));
        *lo = nibbles_ps(bytes, 0), *hi = nibbles_ps(bytes, 1);
    }
}

/* nq (1..4, a constant once inlined) queries × one group of 8 keys: per pair of dimensions one load
 * feeds 2·nq FMAs into the block's sums, which the block's 8 scales multiply into the totals. */
AVX2_INLINE void scores_8(int t, const float *q, int nq, int hd, const uint8_t *g, float *s) {
    const uint8_t *codes = g + scales_bytes(hd);
    __m256 tot[4], blk[4];
    for (int r = 0; r < nq; r++) tot[r] = _mm256_setzero_ps();
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        const uint8_t *c = codes + (size_t)b * code_bytes(t) * KEY_GROUP;
        for (int r = 0; r < nq; r++) blk[r] = _mm256_setzero_ps();
        for (int i = 0; i < KV_BLOCK / 2; i++) {
            __m256 lo, hi;
            key_pair_8(t, c, i, &lo, &hi);
            for (int r = 0; r < nq; r++) {
                const float *qb = q + r * hd + b * KV_BLOCK;
                blk[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(qb + i), lo, blk[r]);
                blk[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(qb + i + 16), hi, blk[r]);
            }
        }
        __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + (size_t)b * KEY_GROUP * 2)));
        for (int r = 0; r < nq; r++) tot[r] = _mm256_fmadd_ps(blk[r], sc, tot[r]);
    }
    for (int r = 0; r < nq; r++) _mm256_storeu_ps(s + r * TILE, tot[r]);
}

/* Into L2, as in attn.c: fetches into L1 stall on its few miss buffers. */
static inline __attribute__((target("avx2"))) void prefetch_span(const uint8_t *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T1);
}

AVX2_INLINE void scores_avx2(int t, const float *q, int nq, int hd, const uint8_t *kg, int nk, const uint8_t *v,
                             const uint8_t *next, float *s) {
    const size_t gb = kiln_kv_key_group_bytes(t, hd), rb = kiln_kv_value_row_bytes(t, hd);
    for (int j = 0; j < nk; j += KEY_GROUP) {
        const uint8_t *g = kg + (size_t)(j / KEY_GROUP) * gb;
        /* as in attn.c: the matrix ops between attention ops evict the cache, so fetch these keys'
         * values (accumulated next) and the same group of the next tile while scoring */
        prefetch_span(v + (size_t)j * rb, rb * KEY_GROUP);
        prefetch_span(next + (size_t)(j / KEY_GROUP) * gb, gb);
        int r = 0;
        for (; r + 4 <= nq; r += 4) scores_8(t, q + r * hd, 4, hd, g, s + r * TILE + j);
        switch (nq - r) {
        case 3: scores_8(t, q + r * hd, 3, hd, g, s + r * TILE + j); break;
        case 2: scores_8(t, q + r * hd, 2, hd, g, s + r * TILE + j); break;
        case 1: scores_8(t, q + r * hd, 1, hd, g, s + r * TILE + j); break;
        }
    }
}

/* One key's block of 32 values as 4 × 8 fp32, dimensions in order. */
AVX2_INLINE void value_block_8x4(int t, const uint8_t *c, __m256 x[4]) {
    if (t == KV_Q8_0) {
        for (int k = 0; k < 4; k++)
            x[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * k))));
    } else {
        __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
        __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8)));
        x[0] = nibbles_ps(b0, 0), x[1] = nibbles_ps(b1, 0), x[2] = nibbles_ps(b0, 1), x[3] = nibbles_ps(b1, 1);
    }
}

/* nq (1..2) queries × one block of 32 dimensions: each value block is converted once for every query,
 * its scale folded into the probability. */
AVX2_INLINE void accumulate_32(int t, const float *p, int nq, int nk, const uint8_t *v, size_t rb, int hd, float *o) {
    __m256 a[2][4];
    for (int r = 0; r < nq; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm256_loadu_ps(o + r * hd + c * 8);
    for (int j = 0; j < nk; j++) {
        const uint8_t *blk = v + (size_t)j * rb;
        uint16_t h;
        memcpy(&h, blk, 2);
        float d = _cvtsh_ss(h);
        __m256 x[4];
        value_block_8x4(t, blk + 2, x);
        for (int r = 0; r < nq; r++) {
            __m256 c = _mm256_set1_ps(p[r * TILE + j] * d);
            for (int k = 0; k < 4; k++) a[r][k] = _mm256_fmadd_ps(c, x[k], a[r][k]);
        }
    }
    for (int r = 0; r < nq; r++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(o + r * hd + c * 8, a[r][c]);
}

AVX2_INLINE void accumulate_avx2(int t, const float *p, int nq, int nk, const uint8_t *v, int hd, float *o) {
    const size_t rb = kiln_kv_value_row_bytes(t, hd);
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        const uint8_t *vb = v + (size_t)b * value_block_bytes(t);
        int r = 0;
        /* two queries at a time: 8 accumulators, 4 values and a coefficient fit the 16 registers */
        for (; r + 2 <= nq; r += 2) accumulate_32(t, p + r * TILE, 2, nk, vb, rb, hd, o + r * hd + b * KV_BLOCK);
        if (r < nq) accumulate_32(t, p + r * TILE, 1, nk, vb, rb, hd, o + r * hd + b * KV_BLOCK);
    }
}

/* ---- AVX-512: the AVX2 kernels' arithmetic lane for lane (the same bits), 16 lanes per instruction ---- */
#define AVX512_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")))

AVX512_INLINE __m512 nibbles_512(__m512i bytes, int high) {
    __m512i n = high ? _mm512_srli_epi32(bytes, 4) : _mm512_and_si512(bytes, _mm512_set1_epi32(15));
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(n, _mm512_set1_epi32(8)));
}

/* Two groups' (16 keys') dimensions i and i + 16 of one block: one widening serves 16 keys. c1 NULL: the
 * second group is absent (a tile's last 8 keys), its lanes zero. */
AVX512_INLINE void key_pair_16(int t, const uint8_t *c0, const uint8_t *c1, int i, __m512 *lo, __m512 *hi) {
#define ONE(c, k) ((c) ? _mm_loadl_epi64((const __m128i *)((c) + (k) * KEY_GROUP)) : _mm_setzero_si128())
#define BOTH(k) _mm_unpacklo_epi64(ONE(c0, k), ONE(c1, k))
    if (t == KV_Q8_0) {
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(BOTH(i)));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(BOTH(i + 16)));
    } else {
        __m512i bytes = _mm512_cvtepu8_epi32(BOTH(i));
        *lo = nibbles_512(bytes, 0), *hi = nibbles_512(bytes, 1);
    }
#undef BOTH
#undef ONE
}

/* A span's cache lines fetched a few at a time, spread over a pass's iterations. */
typedef struct {
    const char *at, *end;
    size_t step;
} prefetch_run;

AVX512_INLINE prefetch_run prefetch_over(const uint8_t *p, size_t bytes, int iterations) {
    size_t lines = (bytes + 63) / 64;
    prefetch_run f = {(const char *)p, (const char *)p + bytes, (lines + iterations - 1) / iterations * 64};
    return f;
}

AVX512_INLINE void prefetch_next(prefetch_run *f) {
    for (size_t i = 0; i < f->step && f->at < f->end; i += 64, f->at += 64) _mm_prefetch(f->at, _MM_HINT_T1);
}

/* nq (1..4) queries x nz (1..4) pieces of 16 keys (`groups` groups of 8 present), both constants once
 * inlined: each block's nq·nz sums (up to 16 FMA chains) are multiplied by the keys' scales into the
 * totals, which s holds between blocks. */
AVX512_INLINE void scores_pass_512(int t, const float *q, int nq, int hd, const uint8_t *kg, size_t gb, int nz,
                                   int groups, prefetch_run *fv, prefetch_run *fk, float *s) {
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        size_t at = scales_bytes(hd) + (size_t)b * code_bytes(t) * KEY_GROUP;
        __m512 blk[4][4];
        for (int r = 0; r < nq; r++)
            for (int z = 0; z < nz; z++) blk[r][z] = _mm512_setzero_ps();
        for (int i = 0; i < KV_BLOCK / 2; i++) {
            prefetch_next(fv), prefetch_next(fk);
            __m512 lo[4], hi[4];
            for (int z = 0; z < nz; z++) {
                const uint8_t *g0 = kg + (size_t)(2 * z) * gb;
                key_pair_16(t, g0 + at, 2 * z + 1 < groups ? g0 + gb + at : NULL, i, &lo[z], &hi[z]);
            }
            for (int r = 0; r < nq; r++) {
                const float *qb = q + r * hd + b * KV_BLOCK;
                __m512 ql = _mm512_set1_ps(qb[i]), qh = _mm512_set1_ps(qb[i + 16]);
                for (int z = 0; z < nz; z++) {
                    blk[r][z] = _mm512_fmadd_ps(ql, lo[z], blk[r][z]);
                    blk[r][z] = _mm512_fmadd_ps(qh, hi[z], blk[r][z]);
                }
            }
        }
        for (int z = 0; z < nz; z++) {
            const uint8_t *g0 = kg + (size_t)(2 * z) * gb + (size_t)b * KEY_GROUP * 2;
            __m128i s0 = _mm_loadu_si128((const __m128i *)g0);
            __m128i s1 = 2 * z + 1 < groups ? _mm_loadu_si128((const __m128i *)(g0 + gb)) : _mm_setzero_si128();
            __m512 sc = _mm512_cvtph_ps(_mm256_set_m128i(s1, s0));
            for (int r = 0; r < nq; r++) {
                float *sr = s + r * TILE + 16 * z;
                __m512 tot = b == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(sr);
                _mm512_storeu_ps(sr, _mm512_fmadd_ps(blk[r][z], sc, tot));
            }
        }
    }
}

#define SCORES_PASS(nq, nz, groups) scores_pass_512(t, qr, nq, hd, kg + (size_t)(j / KEY_GROUP) * gb, gb, nz, groups, &fv, &fk, sr)
#define PASS_BY_QUERIES(nz, groups) do { \
        switch (n) { \
        case 4: SCORES_PASS(4, nz, groups); break; \
        case 3: SCORES_PASS(3, nz, groups); break; \
        case 2: SCORES_PASS(2, nz, groups); break; \
        default: SCORES_PASS(1, nz, groups); \
        } \
    } while (0)

/* 64 keys a pass (4 to 16 chains per block hide the FMA latency), queries 4 at a time; the first query
 * chunk of a pass fetches its keys' values and the same keys of the next tile (as scores_avx2 does). */
AVX512_INLINE void scores_avx512(int t, const float *q, int nq, int hd, const uint8_t *kg, int nk, const uint8_t *v,
                                 const uint8_t *next, float *s) {
    const size_t gb = kiln_kv_key_group_bytes(t, hd), rb = kiln_kv_value_row_bytes(t, hd);
    for (int j = 0; j < nk; j += 64) {
        int keys = nk - j < 64 ? nk - j : 64, groups = keys / KEY_GROUP, nz = (groups + 1) / 2;
        prefetch_run fv = prefetch_over(v + (size_t)j * rb, rb * keys, hd / 2);
        prefetch_run fk = prefetch_over(next + (size_t)(j / KEY_GROUP) * gb, gb * groups, hd / 2);
        for (int r = 0; r < nq; r += 4) {
            int n = nq - r < 4 ? nq - r : 4;
            const float *qr = q + r * hd;
            float *sr = s + r * TILE + j;
            /* a whole tile with constant groups, so its loads test nothing */
            switch (groups == 8 ? 5 : nz) {
            case 5: PASS_BY_QUERIES(4, 8); break;
            case 4: PASS_BY_QUERIES(4, groups); break;
            case 3: PASS_BY_QUERIES(3, groups); break;
            case 2: PASS_BY_QUERIES(2, groups); break;
            default: PASS_BY_QUERIES(1, groups);
            }
            fv.at = fv.end, fk.at = fk.end;
        }
    }
}

/* One key's block of 32 values as 2 × 16 fp32, dimensions in order. */
AVX512_INLINE void value_block_16x2(int t, const uint8_t *c, __m512 x[2]) {
    if (t == KV_Q8_0) {
        x[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
        x[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16))));
    } else {
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
        x[0] = nibbles_512(bytes, 0), x[1] = nibbles_512(bytes, 1);
    }
}

/* nq (1..4) queries × one block of 32 dimensions, two zmm of values per key; pd[r * TILE + j] is query r's
 * probability of key j times the key's scale for this block. */
AVX512_INLINE void accumulate_32_512(int t, const float *pd, int nq, int nk, const uint8_t *v, size_t rb, int hd,
                                     float *o) {
    __m512 a[4][2];
    for (int r = 0; r < nq; r++) a[r][0] = _mm512_loadu_ps(o + r * hd), a[r][1] = _mm512_loadu_ps(o + r * hd + 16);
    for (int j = 0; j < nk; j++) {
        __m512 x[2];
        value_block_16x2(t, v + (size_t)j * rb + 2, x);
        for (int r = 0; r < nq; r++) {
            __m512 c = _mm512_set1_ps(pd[r * TILE + j]);
            a[r][0] = _mm512_fmadd_ps(c, x[0], a[r][0]), a[r][1] = _mm512_fmadd_ps(c, x[1], a[r][1]);
        }
    }
    for (int r = 0; r < nq; r++) _mm512_storeu_ps(o + r * hd, a[r][0]), _mm512_storeu_ps(o + r * hd + 16, a[r][1]);
}

/* Per block, the probabilities times the keys' scales first (the same products the AVX2 kernel forms
 * one at a time), so the key loop broadcasts from memory. */
AVX512_INLINE void accumulate_avx512(int t, const float *p, int nq, int nk, const uint8_t *v, int hd, float *o) {
    const size_t rb = kiln_kv_value_row_bytes(t, hd);
    float d[TILE] __attribute__((aligned(64))), pd[4 * TILE] __attribute__((aligned(64)));
    /* 16 keys' scales by one gather of 4 bytes each (the scale and two codes, inside the row) */
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)rb));
    for (int b = 0; b < hd / KV_BLOCK; b++) {
        const uint8_t *vb = v + (size_t)b * value_block_bytes(t);
        for (int j = 0; j < nk; j += 16) {
            __mmask16 in = nk - j >= 16 ? 0xffff : (__mmask16)((1u << (nk - j)) - 1);
            __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), in, rows, vb + (size_t)j * rb, 1);
            _mm512_store_ps(d + j, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(w)));
        }
        for (int r = 0; r < nq; r += 4) {
            int n = nq - r < 4 ? nq - r : 4;
            for (int u = 0; u < n; u++)
                for (int j = 0; j < nk; j += 16)
                    _mm512_storeu_ps(pd + u * TILE + j, _mm512_mul_ps(_mm512_loadu_ps(p + (size_t)(r + u) * TILE + j), _mm512_load_ps(d + j)));
            float *orow = o + (size_t)r * hd + b * KV_BLOCK;
            switch (n) {
            case 4: accumulate_32_512(t, pd, 4, nk, vb, rb, hd, orow); break;
            case 3: accumulate_32_512(t, pd, 3, nk, vb, rb, hd, orow); break;
            case 2: accumulate_32_512(t, pd, 2, nk, vb, rb, hd, orow); break;
            default: accumulate_32_512(t, pd, 1, nk, vb, rb, hd, orow);
            }
        }
    }
}
#endif

/* Each kernel above instantiated for one type (its type argument a constant, so its steps inline). */
#define KV_KERNELS_FOR(isa, attr, T, name)                                                                            \
    attr static void scores_##isa##_##name(const float *q, int nq, int hd, const uint8_t *kg, int nk,                 \
                                           const uint8_t *v, const uint8_t *next, float *s) {                         \
        scores_##isa(T, q, nq, hd, kg, nk, v, next, s);                                                               \
    }                                                                                                                 \
    attr static void accumulate_##isa##_##name(const float *p, int nq, int nk, const uint8_t *v, int hd, float *o) {  \
        accumulate_##isa(T, p, nq, nk, v, hd, o);                                                                     \
    }                                                                                                                 \
    static const kiln_kv_kernels isa##_##name = {scores_##isa##_##name, accumulate_##isa##_##name};

KV_KERNELS_FOR(generic, , KV_Q8_0, q8_0)
KV_KERNELS_FOR(generic, , KV_Q4_0, q4_0)
#if defined(KILN_X86)
KV_KERNELS_FOR(avx2, AVX2, KV_Q8_0, q8_0)
KV_KERNELS_FOR(avx2, AVX2, KV_Q4_0, q4_0)
KV_KERNELS_FOR(avx512, __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl"))), KV_Q8_0, q8_0)
KV_KERNELS_FOR(avx512, __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl"))), KV_Q4_0, q4_0)
#endif

const kiln_kv_kernels *kiln_kv_quant_kernels(int t) {
    int q4 = t == KV_Q4_0;
#if defined(KILN_X86)
    if (kiln_active_isa() >= ISA_AVX512) return q4 ? &avx512_q4_0 : &avx512_q8_0;
    if (kiln_active_isa() >= ISA_AVX2) return q4 ? &avx2_q4_0 : &avx2_q8_0;
#endif
    return q4 ? &generic_q4_0 : &generic_q8_0;
}
