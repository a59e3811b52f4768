/* AMX-INT8 matmul for the integer formats, bit for bit the results of the other variants.

   A tile product C[16][16] += A[16][K] * B[K][16] in int32 with K = 32 is exactly one block's integer
   sum for 16 tokens (A: activations, natural order) by 16 output rows (B: weights, 4-byte column
   groups), so each block's sum is the same integer as in kern_generic.c, and the float steps after it
   are the same: per token and row, block j of each group adds into lane j's fp32 accumulator one FMA
   of its sum times (weight scale * activation scale), one for the affine minimum, and the 8 lanes are
   summed in the same tree. Only which values share a vector differs: a zmm holds 16 rows of one
   token and one lane instead of 8 lanes of one row.

   A call unpacks each run of 4 tiles (16 rows) to int8 B tiles and fp32 scales once and multiplies
   every token by it; the activations are laid out in natural order once per call. Q6_K's 16-weight
   sub-blocks take two K = 16 products per block, combined with their scales in int32 as the other
   variants do. Tile state is per thread: each call loads the tile configuration and releases it. */
#if KILN_X86
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,amx-tile,amx-int8,amx-bf16")
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "act.h"
#include "kernels.h"

#define ALWAYS static inline __attribute__((always_inline))
#define SLAB_TILES 4   /* kiln tiles per B tile: 16 output rows */
#define TOK_BLOCK 16   /* tokens per A tile */
#define TOK_RUN 128    /* tokens laid out at a time */

/* One block's scales for the slab's 16 rows: d (FMA with the activation scale), m (the affine term,
   negated for K-quants as kern_generic.c writes it), and the integer sub-block scales. */
typedef struct {
    float d[16], m[16];
    int32_t sa[16], sb[16];
} wscale;

typedef struct {
    uint8_t *buf;
    size_t size;
} scratch_t;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p) {
    scratch_t *s = p;
    free(s->buf);
    free(s);
}
static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

/* The calling thread's work buffer, grown to `size` bytes (64-byte aligned); NULL if out of memory.
   Kept for the thread's life: a call allocates only the first time its shapes grow. */
static uint8_t *thread_scratch(size_t size) {
    pthread_once(&scratch_once, scratch_init);
    scratch_t *s = pthread_getspecific(scratch_key);
    if (!s) {
        if (!(s = calloc(1, sizeof *s))) return NULL;
        pthread_setspecific(scratch_key, s);
    }
    if (s->size < size) {
        void *p = NULL;
        if (posix_memalign(&p, 64, size)) return NULL;
        free(s->buf);
        s->buf = p;
        s->size = size;
    }
    return s->buf;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* tmm0-3: C, 16 x 16 int32. tmm4, 5: A, 16 tokens x K bytes; tmm6, 7: B, K / 4 x 64 bytes. K = 32 (one
   block), or 16 for Q6_K's sub-blocks. */
static void load_config(int k) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = (uint8_t)(i < 6 ? 16 : k / 4);
        c.colsb[i] = (uint16_t)(i < 4 || i >= 6 ? 64 : k);
    }
    /* Not _tile_loadconfig: gcc 12's declares an 8-byte operand, and the stores past it were dropped. */
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

ALWAYS __m512i ld512(const void *p) { return _mm512_loadu_si512(p); }
ALWAYS __m512i idx16(const int *v) { return _mm512_loadu_si512((const void *)v); }

/* ---- activations: lane order -> natural order, [token][block][32] ---- */

ALWAYS void store_blocks(uint8_t *out, __m512i v) { /* blocks 2p and 2p+1, one A tile apart */
    _mm256_storeu_si256((__m256i *)out, _mm512_castsi512_si256(v));
    _mm256_storeu_si256((__m256i *)(out + 512), _mm512_extracti64x4_epi64(v, 1));
}

/* 8 x 8 dword transpose of one full group's quants (chunk k, block j -> block j, chunk k); block j's 32
   bytes to out + j * 512. */
ALWAYS void group_natural(const uint8_t *ag, uint8_t *out, __m512i lo, __m512i hi, __m512i even, __m512i odd) {
    __m512i w0 = ld512(ag), w1 = ld512(ag + 64), w2 = ld512(ag + 128), w3 = ld512(ag + 192);
    __m512i plo = _mm512_permutex2var_epi32(w0, lo, w1), phi = _mm512_permutex2var_epi32(w0, hi, w1);
    __m512i qlo = _mm512_permutex2var_epi32(w2, lo, w3), qhi = _mm512_permutex2var_epi32(w2, hi, w3);
    store_blocks(out, _mm512_permutex2var_epi32(plo, even, qlo));
    store_blocks(out + 1024, _mm512_permutex2var_epi32(plo, odd, qlo));
    store_blocks(out + 2048, _mm512_permutex2var_epi32(phi, even, qhi));
    store_blocks(out + 3072, _mm512_permutex2var_epi32(phi, odd, qhi));
}

/* The first n tokens of `act` into x as A tiles, x[token / 16][block][token % 16][32] (natural order; the
   last tile's missing tokens zero); and when shift >= 0 each block's offset sum32 << shift into
   xo[token][block]. */
static void layout_act(const uint8_t *act, size_t stride, int cols, int n, uint8_t *x, int nblk, int shift, int32_t *xo) {
    int lo[16], hi[16], even[16], odd[16];
    for (int e = 0; e < 16; e++) {
        int jj = e / 4, kk = e % 4; /* stage 1: e = jj * 4 + kk, chunk kk of the pair of zmm, block jj */
        lo[e] = kk / 2 * 16 + kk % 2 * 8 + jj;
        hi[e] = lo[e] + 4;
        int j = e / 8, k = e % 8; /* stage 2: block j of the pair, chunk k */
        even[e] = (k < 4 ? 0 : 16) + j * 4 + k % 4;
        odd[e] = even[e] + 8;
    }
    __m512i vlo = idx16(lo), vhi = idx16(hi), veven = idx16(even), vodd = idx16(odd);
    int G = cols / KILN_GROUP, nt = cols % KILN_GROUP / 32;
    int padded = (n + TOK_BLOCK - 1) / TOK_BLOCK * TOK_BLOCK;
    if (padded > n) memset(x + (size_t)(n / TOK_BLOCK) * nblk * 512, 0, (size_t)nblk * 512);
    for (int t = 0; t < n; t++) {
        const uint8_t *a = act + (size_t)t * stride;
        uint8_t *xt = x + (size_t)(t / TOK_BLOCK) * nblk * 512 + (t % TOK_BLOCK) * 32; /* block blk at xt + blk * 512 */
        if (shift >= 0)
            for (int blk = 0; blk < nblk; blk++) {
                int32_t sum;
                memcpy(&sum, a + (size_t)(blk / 8) * KILN_AG_BYTES + KILN_AG_SUM32 + 4 * (blk % 8), 4);
                xo[(size_t)t * nblk + blk] = (int32_t)((uint32_t)sum << shift);
            }
        for (int g = 0; g < G; g++) group_natural(a + (size_t)g * KILN_AG_BYTES, xt + (size_t)g * 8 * 512, vlo, vhi, veven, vodd);
        if (nt) { /* a short group (a shared tail's blocks 0 and 1 are in full-group order) */
            const uint8_t *ag = a + (size_t)G * KILN_AG_BYTES;
            for (int j = 0; j < nt; j++)
                for (int i = 0; i < 32; i++) xt[(size_t)(8 * G + j) * 512 + i] = ag[kiln_act_byte(nt, j, i)];
        }
    }
}

/* ---- weights: 16 rows -> B tiles [block][k4][row][4] and scales ---- */

/* kiln_mxfp4_values in both 128-bit lanes of a shuffle's table. */
static const int8_t MXFP4_TWICE[32] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                       0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* Signed values of one row's full group in chunk order: v[c] holds chunks 2c, 2c+1 (the lane order). */
ALWAYS void group_values(kiln_wfmt f, const uint8_t *q, __m512i v[4]) {
    const __m512i lo4 = _mm512_set1_epi8(15);
    if (f == KF_Q8_0) {
        for (int i = 0; i < 4; i++) v[i] = ld512(q + 64 * i);
        return;
    }
    for (int i = 0; i < 2; i++) { /* slots 2i, 2i+1: low nibbles chunks 2i, 2i+1; high 2i+4, 2i+5 */
        __m512i s = ld512(q + 64 * i);
        v[i] = _mm512_and_si512(s, lo4);
        v[i + 2] = _mm512_and_si512(_mm512_srli_epi16(s, 4), lo4);
    }
    if (f == KF_MXFP4) { /* nibbles -> the signed values kv (kernels.h): tdpbssd needs no offset */
        const __m256i kv = _mm256_loadu_si256((const __m256i *)MXFP4_TWICE);
        for (int i = 0; i < 4; i++) v[i] = _mm512_shuffle_epi8(_mm512_inserti64x4(_mm512_castsi256_si512(kv), kv, 1), v[i]);
    }
    if (f == KF_Q5_0 || f == KF_Q5_K) { /* bit k of the high-bit byte -> +16 in chunk k */
        __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(q + 128)));
        for (int i = 0; i < 4; i++) {
            __m512i sel = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi8((char)(1 << 2 * i))), _mm256_set1_epi8((char)(1 << (2 * i + 1))), 1);
            v[i] = _mm512_mask_add_epi8(v[i], _mm512_test_epi8_mask(hb, sel), v[i], _mm512_set1_epi8(16));
        }
    }
    if (f == KF_Q6_K) { /* half h, bits 2m..2m+1 -> bits 4-5 of chunk 4h+m; then q - 32 */
        const __m512i bits45 = _mm512_set1_epi8(0x30);
        const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        for (int h = 0; h < 2; h++) {
            __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(q + 128 + 32 * h)));
            v[2 * h] = _mm512_or_si512(v[2 * h], _mm512_and_si512(_mm512_sllv_epi16(hb, up), bits45));
            v[2 * h + 1] = _mm512_or_si512(v[2 * h + 1], _mm512_and_si512(_mm512_srlv_epi16(hb, down), bits45));
        }
        for (int i = 0; i < 4; i++) v[i] = _mm512_sub_epi8(v[i], _mm512_set1_epi8(32));
    }
}

/* Stored value of weight i of block j of a row's short group of nb blocks (as kern_generic.c reads it). */
static int short_value(kiln_wfmt f, const uint8_t *q, int nb, int j, int i) {
    int k = i >> 2, b = 4 * j + (i & 3);
    if (f == KF_Q8_0) return (int8_t)q[k * 4 * nb + b];
    int v = (q[(k & 3) * 4 * nb + b] >> (k >= 4 ? 4 : 0)) & 15;
    if (f == KF_Q5_0) v |= ((q[16 * nb + b] >> k) & 1) << 4;
    return f == KF_MXFP4 ? kiln_mxfp4_values[v] : v;
}

/* Row `r` (0..15) of the slab, block `blk`: scales from header h, whose block j it is (nb blocks). */
static void block_scales(kiln_wfmt f, const uint8_t *h, int nb, int j, wscale *s, int r) {
    switch (f) {
    case KF_Q4_K: case KF_Q5_K:
        s->d[r] = kiln_f16_to_f32((uint16_t)(h[0] | h[1] << 8));
        s->m[r] = -(kiln_f16_to_f32((uint16_t)(h[2] | h[3] << 8)) * (float)h[12 + j]);
        s->sa[r] = h[4 + j];
        break;
    case KF_Q6_K:
        s->d[r] = kiln_f16_to_f32((uint16_t)(h[0] | h[1] << 8));
        s->sa[r] = (int8_t)h[2 + 2 * j];
        s->sb[r] = (int8_t)h[3 + 2 * j];
        break;
    case KF_MXFP4:
        s->d[r] = kiln_e8m0_half(h[j]);
        break;
    default:
        s->d[r] = kiln_f16_to_f32((uint16_t)(h[2 * j] | h[2 * j + 1] << 8));
        if (f == KF_Q4_1) s->m[r] = kiln_f16_to_f32((uint16_t)(h[2 * nb + 2 * j] | h[2 * nb + 2 * j + 1] << 8));
    }
}

/* In-register transpose of 16 x 16 dwords: after it r[i][j] is the old r[j][i]. Each stage swaps bit m
   of the register number with bit m of the element number. */
ALWAYS void transpose16(__m512i r[16], const __m512i il[4], const __m512i ih[4]) {
    for (int s = 0; s < 4; s++) {
        int m = 1 << s;
        for (int a = 0; a < 16; a++) {
            if (a & m) continue;
            __m512i x = r[a], y = r[a | m];
            r[a] = _mm512_permutex2var_epi32(x, il[s], y);
            r[a | m] = _mm512_permutex2var_epi32(x, ih[s], y);
        }
    }
}

/* The index vectors of transpose16. */
ALWAYS void transpose_index(__m512i il[4], __m512i ih[4]) {
    for (int st = 0; st < 4; st++) {
        int m = 1 << st, lo[16], hi[16];
        for (int j = 0; j < 16; j++) {
            lo[j] = j & m ? 16 + (j ^ m) : j;
            hi[j] = j & m ? 16 + j : j | m;
        }
        il[st] = idx16(lo);
        ih[st] = idx16(hi);
    }
}

/* Tiles [ti, ti + 4) of w (those below tile1; the rest are zero rows) into B tiles b (nblk * 512 bytes)
   and scales s (nblk). `work`: 16 * 256 bytes. */
static void unpack_slab(kiln_wfmt f, const kiln_wmat *w, int ti, int tile1, uint8_t *b, wscale *s, int nblk, uint8_t *work) {
    const int HB = kiln_fmt_head_bytes(f, 8), QB = kiln_fmt_quant_bytes(f, 8), GB = 4 * (HB + QB);
    int G = w->cols / KILN_GROUP, nt = w->cols % KILN_GROUP / 32;
    __m512i vil[4], vih[4];
    transpose_index(vil, vih);
    int tiles = tile1 - ti < SLAB_TILES ? tile1 - ti : SLAB_TILES;
    memset(s, 0, sizeof(wscale) * nblk);
    for (int g = 0; g < G; g++) {
        for (int r = 0; r < 16; r++) {
            __m512i v[4];
            if (r / 4 < tiles) {
                const uint8_t *p = w->data + (size_t)(ti + r / 4) * w->tile_bytes + (size_t)g * GB;
                group_values(f, p + 4 * HB + (r % 4) * QB, v);
                for (int j = 0; j < 8; j++) block_scales(f, p + (r % 4) * HB, 8, j, &s[8 * g + j], r);
            } else
                for (int i = 0; i < 4; i++) v[i] = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) _mm512_storeu_si512(work + r * 256 + 64 * i, v[i]);
        }
        for (int i = 0; i < 4; i++) { /* chunks 2i, 2i+1: element c * 8 + j is chunk 2i + c of block j */
            __m512i rr[16];
            for (int r = 0; r < 16; r++) rr[r] = ld512(work + r * 256 + 64 * i);
            transpose16(rr, vil, vih);
            for (int e = 0; e < 16; e++) _mm512_storeu_si512(b + (size_t)(8 * g + e % 8) * 512 + (2 * i + e / 8) * 64, rr[e]);
        }
    }
    if (!nt) return;
    /* The last, short group: per weight, into the B tile's [k4][row][4] order. */
    uint8_t *bt = b + (size_t)8 * G * 512;
    memset(bt, 0, (size_t)nt * 512);
    for (int r = 0; r < 4 * tiles; r++) {
        const uint8_t *p = w->data + (size_t)(ti + r / 4) * w->tile_bytes + (size_t)G * GB;
        if (kiln_shared_tail(nt)) { /* one row's full group: block 2 * (r % 4) + j is block j of row r */
            __m512i v[4];
            group_values(f, p + HB, v);
            uint8_t vals[256];
            for (int i = 0; i < 4; i++) _mm512_storeu_si512(vals + 64 * i, v[i]);
            for (int j = 0; j < 2; j++) {
                int src = 2 * (r % 4) + j;
                block_scales(f, p, 8, src, &s[8 * G + j], r);
                for (int i = 0; i < 32; i++) bt[j * 512 + (i / 4) * 64 + r * 4 + i % 4] = vals[32 * (i / 4) + 4 * src + i % 4];
            }
            continue;
        }
        int hb = kiln_fmt_head_bytes(f, nt), qb = kiln_fmt_quant_bytes(f, nt);
        const uint8_t *h = p + (r % 4) * hb, *q = p + 4 * hb + (r % 4) * qb;
        for (int j = 0; j < nt; j++) {
            block_scales(f, h, nt, j, &s[8 * G + j], r);
            for (int i = 0; i < 32; i++) bt[j * 512 + (i / 4) * 64 + r * 4 + i % 4] = (uint8_t)short_value(f, q, nt, j, i);
        }
    }
}

/* ---- the product ---- */

ALWAYS __m512 reduce8(const __m512 *a) {
    return _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])),
                         _mm512_add_ps(_mm512_add_ps(a[4], a[5]), _mm512_add_ps(a[6], a[7])));
}

/* One block's products for a token block into C tile `c` (tmm0..3), stored as rows of cb (ld bytes apart). */
#define BLOCK_PRODUCT(c, a, bt, xa, wb, cb, ld) do { \
        _tile_zero(c); \
        _tile_loadd(a, xa, ld_x); \
        _tile_loadd(bt, wb, 64); \
        _tile_dpbssd(c, a, bt); \
        _tile_stored(c, cb, ld); \
    } while (0)

/* Blocks [blk0, blk1)'s tile products for tokens [t, t + 16), into cb[token][block][16 rows] (Q6_K: its two
   halves, the second in cb2). Consecutive blocks use different tiles, so the products overlap. */
ALWAYS void block_products(kiln_wfmt f, const uint8_t *x, int nblk, const uint8_t *b, int t, int32_t *cb, int32_t *cb2, int blk0, int blk1) {
    const size_t ld_x = 32, ld_c = 64;
    const uint8_t *xt = x + (size_t)(t / TOK_BLOCK) * nblk * 512;
    for (int blk = blk0; blk < blk1; blk++) {
        const uint8_t *xa = xt + (size_t)blk * 512, *wb = b + (size_t)blk * 512;
        int32_t *c = cb + blk * 256, *c2 = cb2 + blk * 256;
        if (f == KF_Q6_K) {
            if (blk & 1) {
                BLOCK_PRODUCT(2, 4, 6, xa, wb, c, ld_c);
                BLOCK_PRODUCT(3, 5, 7, xa + 16, wb + 256, c2, ld_c);
            } else {
                BLOCK_PRODUCT(0, 4, 6, xa, wb, c, ld_c);
                BLOCK_PRODUCT(1, 5, 7, xa + 16, wb + 256, c2, ld_c);
            }
            continue;
        }
        switch (blk & 3) {
        case 0: BLOCK_PRODUCT(0, 4, 6, xa, wb, c, ld_c); break;
        case 1: BLOCK_PRODUCT(1, 5, 7, xa, wb, c, ld_c); break;
        case 2: BLOCK_PRODUCT(2, 4, 6, xa, wb, c, ld_c); break;
        default: BLOCK_PRODUCT(3, 5, 7, xa, wb, c, ld_c);
        }
    }
}

/* One block's step for one token: the integer sum (offsets and sub-block scales as kern_generic.c), then
   the FMA of the scales into lane accumulator `a`. */
ALWAYS __m512 block_step(kiln_wfmt f, const int32_t *c, const int32_t *c2, const wscale *sc, const uint8_t *ag, int j,
                         int32_t off, __m512 a) {
    __m512i i32 = _mm512_load_si512(c);
    if (f == KF_Q4_0 || f == KF_Q5_0) i32 = _mm512_sub_epi32(i32, _mm512_set1_epi32(off));
    if (f == KF_Q4_K || f == KF_Q5_K) i32 = _mm512_mullo_epi32(i32, _mm512_load_si512(sc->sa));
    if (f == KF_Q6_K)
        i32 = _mm512_add_epi32(_mm512_mullo_epi32(i32, _mm512_load_si512(sc->sa)), _mm512_mullo_epi32(_mm512_load_si512(c2), _mm512_load_si512(sc->sb)));
    float dx, sx;
    memcpy(&dx, ag + KILN_AG_D + 4 * j, 4);
    a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), _mm512_mul_ps(_mm512_load_ps(sc->d), _mm512_set1_ps(dx)), a);
    if (f == KF_Q4_1 || f == KF_Q4_K || f == KF_Q5_K) {
        memcpy(&sx, ag + KILN_AG_S + 4 * j, 4);
        a = _mm512_fmadd_ps(_mm512_load_ps(sc->m), _mm512_set1_ps(sx), a);
    }
    return a;
}

/* Phase 2: token u's 16 outputs from its block sums, the 8 lane accumulators in registers. xo: the token's
   offsets (sum32 << 3 or << 4 a block). */
ALWAYS void token_outputs(kiln_wfmt f, const int32_t *cu, const int32_t *cu2, const wscale *s, const uint8_t *a,
                          const int32_t *xo, int cols, float *y, __mmask16 keep) {
    int G = cols / KILN_GROUP, nt = cols % KILN_GROUP / 32;
    __m512 acc[8];
    for (int l = 0; l < 8; l++) acc[l] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *ag = a + (size_t)g * KILN_AG_BYTES;
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            int blk = 8 * g + j;
            acc[j] = block_step(f, cu + blk * 256, cu2 + blk * 256, s + blk, ag, j, xo[blk], acc[j]);
        }
    }
    __m512 out;
    const uint8_t *ag = a + (size_t)G * KILN_AG_BYTES;
    if (nt && kiln_shared_tail(nt)) { /* lanes 2r, 2r+1 of the tiles' shared group, from zero */
        __m512 t0 = block_step(f, cu + 8 * G * 256, cu2, s + 8 * G, ag, 0, xo[8 * G], _mm512_setzero_ps());
        __m512 t1 = block_step(f, cu + (8 * G + 1) * 256, cu2, s + 8 * G + 1, ag, 1, xo[8 * G + 1], _mm512_setzero_ps());
        out = _mm512_add_ps(reduce8(acc), _mm512_add_ps(t0, t1));
    } else {
        if (nt) {
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                if (j < nt) acc[j] = block_step(f, cu + (8 * G + j) * 256, cu2 + (8 * G + j) * 256, s + 8 * G + j, ag, j, xo[8 * G + j], acc[j]);
        }
        out = reduce8(acc);
    }
    _mm512_mask_storeu_ps(y, keep, out);
}

ALWAYS void run(kiln_wfmt f, const kiln_wmat *w, const uint8_t *act, int n_tok, float *y, int ldy, int tile0, int tile1) {
    size_t stride = kiln_act_stride(f, w->cols);
    int nblk = w->cols / 32, run_tok = n_tok < TOK_RUN ? n_tok : TOK_RUN;
    size_t xbytes = (size_t)(run_tok + TOK_BLOCK - 1) / TOK_BLOCK * TOK_BLOCK * nblk * 32, obytes = ((size_t)run_tok * nblk * 4 + 63) / 64 * 64;
    size_t bbytes = (size_t)nblk * 512, sbytes = sizeof(wscale) * nblk, work = 16 * 256, cbytes = (size_t)TOK_BLOCK * nblk * 64;
    uint8_t *mem = thread_scratch(xbytes + obytes + bbytes + sbytes + work + 4 * cbytes);
    if (!mem) { /* no memory for the tile layouts: the same results from the AVX-512 kernel */
        kiln_matmul_avx512(w, act, n_tok, y, ldy, tile0, tile1);
        return;
    }
    uint8_t *x = mem, *b = x + xbytes + obytes, *wk = b + bbytes + sbytes;
    int32_t *xo = (int32_t *)(x + xbytes), *cb = (int32_t *)(wk + work); /* 2 x (block sums, Q6_K's second halves) */
    size_t cwords = cbytes / 4;
    wscale *s = (wscale *)(b + bbytes);
    load_config(f == KF_Q6_K ? 16 : 32);
    for (int t0 = 0; t0 < n_tok; t0 += TOK_RUN) {
        int n = n_tok - t0 < TOK_RUN ? n_tok - t0 : TOK_RUN;
        const uint8_t *a0 = act + (size_t)t0 * stride;
        layout_act(a0, stride, w->cols, n, x, nblk, f == KF_Q4_0 ? 3 : f == KF_Q5_0 ? 4 : -1, xo);
        for (int ti = tile0; ti < tile1; ti += SLAB_TILES) {
            unpack_slab(f, w, ti, tile1, b, s, nblk, wk);
            int nrows = w->rows - 4 * ti, last = 4 * (tile1 - ti); /* rows of this call's tiles in the slab */
            if (nrows > last) nrows = last;
            __mmask16 keep = nrows >= 16 ? 0xffff : (__mmask16)((1u << nrows) - 1);
            /* The next token block's products are issued between this one's outputs: the tile unit and the
               vector units then work at once (alternate buffers). */
            block_products(f, x, nblk, b, 0, cb, cb + cwords, 0, nblk);
            for (int t = 0; t < n; t += TOK_BLOCK) {
                int cur = t / TOK_BLOCK & 1, next = t + TOK_BLOCK < n;
                int32_t *c = cb + cur * 2 * cwords, *c2 = c + cwords, *nc = cb + (cur ^ 1) * 2 * cwords;
                for (int u = 0; u < TOK_BLOCK; u++) {
                    if (next) block_products(f, x, nblk, b, t + TOK_BLOCK, nc, nc + cwords, u * nblk / TOK_BLOCK, (u + 1) * nblk / TOK_BLOCK);
                    if (t + u < n)
                        token_outputs(f, c + (size_t)u * 16, c2 + (size_t)u * 16, s, a0 + (size_t)(t + u) * stride,
                                      xo + (size_t)(t + u) * nblk, w->cols, y + (size_t)(t0 + t + u) * ldy + 4 * ti, keep);
                }
            }
        }
    }
    _tile_release();
}

void kiln_matmul_amx(const kiln_wmat *w, const void *act, int n_tok, float *y, int ldy, int tile0, int tile1) {
    switch (w->fmt) {
    case KF_Q4_1: run(KF_Q4_1, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q4_0: run(KF_Q4_0, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q5_0: run(KF_Q5_0, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q8_0: run(KF_Q8_0, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q4_K: run(KF_Q4_K, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q5_K: run(KF_Q5_K, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_Q6_K: run(KF_Q6_K, w, act, n_tok, y, ldy, tile0, tile1); break;
    case KF_MXFP4: run(KF_MXFP4, w, act, n_tok, y, ldy, tile0, tile1); break;
    default: kiln_matmul_avx512(w, act, n_tok, y, ldy, tile0, tile1);
    }
}
/* ---- BF16 tiles: the prefill path (kiln_matmul_bf16) ----

   A block scale per 32 weights leaves an int8 tile product 32 deep, each result stored and scaled by
   vector code (docs/PERF.md, "AMX tiles and the int8 peaks"). Here the scales are applied once, where
   the values are laid out: activations as bf16(q * d), weights as bf16(q * mul + add), and tdpbf16ps
   accumulates the whole row in fp32 inside the tile unit. Each product rounds both factors to 8
   significant bits, so the result is no longer the other variants' bits: it is tested against the
   oracle by tolerance and KLD.

   The weights are the row operand (A: 16 rows x 32 values of one K-tile), so a row unpacks in its packed
   order with no transpose; the activations are the column operand (B: 16 pairs x 16 tokens x 2),
   transposed once per op, and each 16 x 16 result is transposed on its way out. A full group's K-tile c
   is its chunk c in the lane order (weights 4c..4c+3 of each of the 8 blocks), the order the packed
   weights and the Q8 activations already share; a short group's K-tile j is its block j in natural
   order. */

#define BF16_TILE 512 /* bf16 values of one tile: 16 rows x 32 */

size_t kiln_bf16_tiles_bytes(int cols, int n_tok) {
    return (size_t)(n_tok + 2 * TOK_BLOCK - 1) / (2 * TOK_BLOCK) * 2 * (size_t)(cols / 32) * BF16_TILE * 2;
}

/* 32 floats as bf16, rounded to nearest even: lo's 16 first. */
ALWAYS __m512i to_bf16(__m512 hi, __m512 lo) {
    __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
    __m512i r;
    memcpy(&r, &v, 64);
    return r;
}

ALWAYS __m512 int8x16(const void *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }

/* Lane e of 16 values from bytes 16h..16h+15 of a chunk belongs to block 4h + e / 4. */
static const int QUARTER_BLOCK[2][16] = {{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
                                         {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7}};

/* 16 rows of 16 dwords (64 bytes apart from `src`) transposed into dst, row i of dst 64 bytes apart. */
ALWAYS void transpose_rows(const void *src, void *dst, const __m512i il[4], const __m512i ih[4]) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = ld512((const uint8_t *)src + 64 * i);
    transpose16(r, il, ih);
    for (int i = 0; i < 16; i++) _mm512_storeu_si512((uint8_t *)dst + 64 * i, r[i]);
}

/* One token's Q8 activation (a2: its precise pair's second row, or NULL) as bf16 K-tile rows, K-tile kt's
   32 values at out + kt * BF16_TILE. */
static void act_row(const uint8_t *a, const uint8_t *a2, int cols, uint16_t *out) {
    int G = cols / KILN_GROUP, nt = cols % KILN_GROUP / 32;
    const __m512i q0 = idx16(QUARTER_BLOCK[0]), q1 = idx16(QUARTER_BLOCK[1]);
    for (int g = 0; g < G; g++) {
        const uint8_t *ag = a + (size_t)g * KILN_AG_BYTES, *ag2 = a2 ? a2 + (size_t)g * KILN_AG_BYTES : NULL;
        __m512 d = _mm512_loadu_ps((const float *)(ag + KILN_AG_D)); /* lanes 0..7: the blocks' d */
        __m512 dlo = _mm512_permutexvar_ps(q0, d), dhi = _mm512_permutexvar_ps(q1, d), d2lo = dlo, d2hi = dhi;
        if (ag2) {
            __m512 d2 = _mm512_loadu_ps((const float *)(ag2 + KILN_AG_D));
            d2lo = _mm512_permutexvar_ps(q0, d2);
            d2hi = _mm512_permutexvar_ps(q1, d2);
        }
        for (int c = 0; c < 8; c++) {
            __m512 lo = _mm512_mul_ps(int8x16(ag + 32 * c), dlo), hi = _mm512_mul_ps(int8x16(ag + 32 * c + 16), dhi);
            if (ag2) {
                lo = _mm512_fmadd_ps(int8x16(ag2 + 32 * c), d2lo, lo);
                hi = _mm512_fmadd_ps(int8x16(ag2 + 32 * c + 16), d2hi, hi);
            }
            _mm512_storeu_si512(out + (size_t)(8 * g + c) * BF16_TILE, to_bf16(hi, lo));
        }
    }
    if (!nt) return;
    const uint8_t *ag = a + (size_t)G * KILN_AG_BYTES, *ag2 = a2 ? a2 + (size_t)G * KILN_AG_BYTES : NULL;
    for (int j = 0; j < nt; j++) {
        float v[32], d, d2 = 0.0f;
        memcpy(&d, ag + KILN_AG_D + 4 * j, 4);
        if (ag2) memcpy(&d2, ag2 + KILN_AG_D + 4 * j, 4);
        for (int i = 0; i < 32; i++) {
            int at = kiln_act_byte(nt, j, i);
            v[i] = (float)(int8_t)ag[at] * d;
            if (ag2) v[i] = fmaf((float)(int8_t)ag2[at], d2, v[i]);
        }
        _mm512_storeu_si512(out + (size_t)(8 * G + j) * BF16_TILE, to_bf16(_mm512_loadu_ps(v + 16), _mm512_loadu_ps(v)));
    }
}

/* Q8 activations (kernels.h) of n tokens as bf16 B tiles, [token tile][K-tile][16 pairs][16 tokens][2]: token
   tiles in pairs, the missing tokens zero. Paired (ops.h): rows n..2n-1 hold the second rows, summed in. */
int kiln_bf16_tiles(kiln_wfmt f, const void *act, int cols, int n, int paired, uint16_t *dst) {
    size_t stride = kiln_act_stride(f, cols);
    int nblk = cols / 32, ntt = (n + 2 * TOK_BLOCK - 1) / (2 * TOK_BLOCK) * 2;
    uint16_t *rows = (uint16_t *)thread_scratch((size_t)nblk * BF16_TILE * 2); /* [K-tile][token][32] */
    if (!rows) return -1;
    __m512i il[4], ih[4];
    transpose_index(il, ih);
    const uint8_t *a = act;
    for (int tt = 0; tt < ntt; tt++) {
        uint16_t *out = dst + (size_t)tt * nblk * BF16_TILE;
        int t0 = tt * TOK_BLOCK, cnt = n - t0 < TOK_BLOCK ? n - t0 : TOK_BLOCK;
        if (cnt <= 0) {
            memset(out, 0, (size_t)nblk * BF16_TILE * 2);
            continue;
        }
        for (int r = 0; r < TOK_BLOCK; r++) {
            if (r < cnt)
                act_row(a + (size_t)(t0 + r) * stride, paired ? a + (size_t)(n + t0 + r) * stride : NULL, cols, rows + 32 * r);
            else
                for (int kt = 0; kt < nblk; kt++) memset(rows + (size_t)kt * BF16_TILE + 32 * r, 0, 64);
        }
        for (int kt = 0; kt < nblk; kt++) transpose_rows(rows + (size_t)kt * BF16_TILE, out + (size_t)kt * BF16_TILE, il, ih);
    }
    return 0;
}

/* A full group's scales for one row from its header h: mul[half][q] and add[q] for the 16 values of quarter q
   (bytes 16q..16q+15 of a chunk) of chunks 0..3 (half 0) and 4..7 (half 1); value = stored * mul + add. */
ALWAYS void group_scales(kiln_wfmt f, const uint8_t *h, __m512 mul[2][2], __m512 add[2]) {
    __m512i q[2] = {idx16(QUARTER_BLOCK[0]), idx16(QUARTER_BLOCK[1])};
    __m512 src, asrc = _mm512_setzero_ps();
    const __m512i eight = _mm512_set1_epi32(8), one = _mm512_set1_epi32(1);
    switch (f) {
    case KF_Q4_K: case KF_Q5_K: { /* d, dmin, sc[8], m[8]: lanes 0..7 sc * d, lanes 8..15 -(dmin * m) */
        __m512 v = int8x16(h + 4);
        src = _mm512_mul_ps(v, _mm512_set1_ps(kiln_f16_to_f32((uint16_t)(h[0] | h[1] << 8))));
        asrc = _mm512_mul_ps(v, _mm512_set1_ps(-kiln_f16_to_f32((uint16_t)(h[2] | h[3] << 8))));
        break;
    }
    case KF_Q6_K: /* d, sc[16]: lane 2j block j's first 16 weights, 2j + 1 its second */
        src = _mm512_mul_ps(int8x16(h + 2), _mm512_set1_ps(kiln_f16_to_f32((uint16_t)(h[0] | h[1] << 8))));
        break;
    case KF_MXFP4: {
        float s[16] = {0};
        for (int j = 0; j < 8; j++) s[j] = kiln_e8m0_half(h[j]);
        src = _mm512_loadu_ps(s);
        break;
    }
    default: /* d[8] fp16 (Q4_1: then m[8]) */
        src = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
    }
    for (int z = 0; z < 2; z++) {
        if (f == KF_Q6_K) {
            __m512i even = _mm512_add_epi32(q[z], q[z]);
            mul[0][z] = _mm512_permutexvar_ps(even, src);
            mul[1][z] = _mm512_permutexvar_ps(_mm512_add_epi32(even, one), src);
        } else
            mul[0][z] = mul[1][z] = _mm512_permutexvar_ps(q[z], src);
        if (f == KF_Q4_0) add[z] = _mm512_mul_ps(mul[0][z], _mm512_set1_ps(-8.0f));
        else if (f == KF_Q5_0) add[z] = _mm512_mul_ps(mul[0][z], _mm512_set1_ps(-16.0f));
        else if (f == KF_Q4_1) add[z] = _mm512_permutexvar_ps(_mm512_add_epi32(q[z], eight), src);
        else if (f == KF_Q4_K || f == KF_Q5_K) add[z] = _mm512_permutexvar_ps(_mm512_add_epi32(q[z], eight), asrc);
        else add[z] = _mm512_setzero_ps();
    }
}

/* Row r of a short group of nb blocks (or the shared tail, p its group) as bf16 K-tile rows, block j natural. */
static void short_row(kiln_wfmt f, const uint8_t *p, int nb, int r, uint16_t *out) {
    const int HB = kiln_fmt_head_bytes(f, 8);
    int hb = kiln_fmt_head_bytes(f, nb), qb = kiln_fmt_quant_bytes(f, nb);
    uint8_t vals[256];
    if (kiln_shared_tail(nb)) { /* one row's full group: block 2 * (r % 4) + j is block j of row r */
        __m512i v[4];
        group_values(f, p + HB, v);
        for (int i = 0; i < 4; i++) _mm512_storeu_si512(vals + 64 * i, v[i]);
    }
    for (int j = 0; j < nb; j++) {
        wscale s;
        float v[32];
        int src = 2 * (r % 4) + j;
        if (kiln_shared_tail(nb)) block_scales(f, p, 8, src, &s, 0);
        else block_scales(f, p + (r % 4) * hb, nb, j, &s, 0);
        float add = f == KF_Q4_0 ? -8.0f * s.d[0] : f == KF_Q5_0 ? -16.0f * s.d[0] : f == KF_Q4_1 ? s.m[0] : 0.0f;
        for (int i = 0; i < 32; i++) {
            int q = kiln_shared_tail(nb) ? (int8_t)vals[32 * (i / 4) + 4 * src + i % 4]
                                         : short_value(f, p + 4 * hb + (r % 4) * qb, nb, j, i);
            v[i] = fmaf((float)q, s.d[0], add);
        }
        _mm512_storeu_si512(out + (size_t)j * BF16_TILE, to_bf16(_mm512_loadu_ps(v + 16), _mm512_loadu_ps(v)));
    }
}

/* Tiles [ti, ti + 4) of w (those below tile1; the other rows zero) as bf16 A tiles, [K-tile][16 rows][32]. */
static void bf16_slab(kiln_wfmt f, const kiln_wmat *w, int ti, int tile1, uint16_t *out) {
    const int HB = kiln_fmt_head_bytes(f, 8), QB = kiln_fmt_quant_bytes(f, 8), GB = 4 * (HB + QB);
    int G = w->cols / KILN_GROUP, nt = w->cols % KILN_GROUP / 32, nblk = w->cols / 32;
    int tiles = tile1 - ti < SLAB_TILES ? tile1 - ti : SLAB_TILES;
    for (int r = 0; r < 16; r++) {
        uint16_t *o = out + 32 * r;
        if (r / 4 >= tiles) {
            for (int kt = 0; kt < nblk; kt++) memset(o + (size_t)kt * BF16_TILE, 0, 64);
            continue;
        }
        const uint8_t *tile = w->data + (size_t)(ti + r / 4) * w->tile_bytes;
        for (int g = 0; g < G; g++) {
            const uint8_t *p = tile + (size_t)g * GB;
            __m512 mul[2][2], add[2];
            group_scales(f, p + (r % 4) * HB, mul, add);
            __m512i v[4];
            uint8_t vals[256];
            group_values(f, p + 4 * HB + (r % 4) * QB, v);
            for (int i = 0; i < 4; i++) _mm512_storeu_si512(vals + 64 * i, v[i]);
            for (int c = 0; c < 8; c++) {
                const __m512 *m = mul[c >= 4];
                __m512 lo = _mm512_fmadd_ps(int8x16(vals + 32 * c), m[0], add[0]);
                __m512 hi = _mm512_fmadd_ps(int8x16(vals + 32 * c + 16), m[1], add[1]);
                _mm512_storeu_si512(o + (size_t)(8 * g + c) * BF16_TILE, to_bf16(hi, lo));
            }
        }
        if (nt) short_row(f, tile + (size_t)G * GB, nt, r, o + (size_t)8 * G * BF16_TILE);
    }
}

/* tmm0-3: C, 16 rows x 16 tokens fp32; tmm4, 5: A, 16 rows x 32 bf16; tmm6, 7: B, 16 pairs x 16 tokens x 2. */
static void load_config_bf16(void) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

/* A C tile stored as 16 rows x 16 tokens in tmp, into y[token][row] for nt tokens from t and nr rows from row. */
static void store_transposed(const float *tmp, float *y, int ldy, int t, int row, int nt, int nr, const __m512i il[4], const __m512i ih[4]) {
    __m512i r[16];
    for (int i = 0; i < 16; i++) r[i] = ld512(tmp + 16 * i);
    transpose16(r, il, ih);
    __mmask16 keep = (__mmask16)((1u << nr) - 1);
    for (int i = 0; i < nt; i++) _mm512_mask_storeu_ps(y + (size_t)(t + i) * ldy + row, keep, _mm512_castsi512_ps(r[i]));
}

#define STORE_C(c, nt, nr, t, row) do { \
        if ((nt) > 0 && (nr) > 0) { \
            _tile_stored(c, tmp, 64); \
            store_transposed(tmp, y, ldy, t, row, (nt) < 16 ? (nt) : 16, (nr) < 16 ? (nr) : 16, il, ih); \
        } \
    } while (0)

static int run_bf16(kiln_wfmt f, const kiln_wmat *w, const uint16_t *a, int n_tok, float *y, int ldy, int tile0, int tile1) {
    int nblk = w->cols / 32, pairs = (n_tok + 2 * TOK_BLOCK - 1) / (2 * TOK_BLOCK);
    size_t hbytes = (size_t)nblk * BF16_TILE * 2;
    uint8_t *mem = thread_scratch(2 * hbytes + 1024);
    if (!mem) return -1;
    uint16_t *h0 = (uint16_t *)mem, *h1 = h0 + (size_t)nblk * BF16_TILE;
    float *tmp = (float *)(mem + 2 * hbytes);
    __m512i il[4], ih[4];
    transpose_index(il, ih);
    int end = 4 * tile1 < w->rows ? 4 * tile1 : w->rows;
    load_config_bf16();
    for (int ti = tile0; ti < tile1; ti += 2 * SLAB_TILES) {
        bf16_slab(f, w, ti, tile1, h0);
        int second = ti + SLAB_TILES < tile1;
        if (second) bf16_slab(f, w, ti + SLAB_TILES, tile1, h1);
        else memset(h1, 0, hbytes);
        int row0 = 4 * ti, row1 = row0 + 16;
        for (int p = 0; p < pairs; p++) {
            const uint16_t *b0 = a + (size_t)(2 * p) * nblk * BF16_TILE, *b1 = b0 + (size_t)nblk * BF16_TILE;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int kt = 0; kt < nblk; kt++) {
                _tile_loadd(4, h0 + (size_t)kt * BF16_TILE, 64);
                _tile_loadd(6, b0 + (size_t)kt * BF16_TILE, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, b1 + (size_t)kt * BF16_TILE, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(5, h1 + (size_t)kt * BF16_TILE, 64);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            int t = 2 * p * TOK_BLOCK;
            STORE_C(0, n_tok - t, end - row0, t, row0);
            STORE_C(1, n_tok - t - 16, end - row0, t + 16, row0);
            STORE_C(2, n_tok - t, end - row1, t, row1);
            STORE_C(3, n_tok - t - 16, end - row1, t + 16, row1);
        }
    }
    _tile_release();
    return 0;
}

/* A constant format per case lets the compiler specialize the slab unpacking (measured: 7-15% of a Qwen-shape
   pp512 on the AMX Xeon, docs/PERF.md). */
int kiln_matmul_bf16(const kiln_wmat *w, const uint16_t *a, int n_tok, float *y, int ldy, int tile0, int tile1) {
    switch (w->fmt) {
    case KF_Q4_1: return run_bf16(KF_Q4_1, w, a, n_tok, y, ldy, tile0, tile1);
    case KF_Q4_0: return run_bf16(KF_Q4_0, w, a, n_tok, y, ldy, tile0, tile1);
    case KF_Q5_0: return run_bf16(KF_Q5_0, w, a, n_tok, y, ldy, tile0, tile1);
    case KF_Q8_0: return run_bf16(KF_Q8_0, w, a, n_tok, y, ldy, tile0, tile1);
    case KF_Q4_K: return run_bf16(KF_Q4_K, w, a, n_tok, y, ldy, tile0, tile1);
    case KF_Q5_K: return run_bf16(KF_Q5_K, w, a, n_tok, y, ldy, tile0, tile1);
    case KF_Q6_K: return run_bf16(KF_Q6_K, w, a, n_tok, y, ldy, tile0, tile1);
    case KF_MXFP4: return run_bf16(KF_MXFP4, w, a, n_tok, y, ldy, tile0, tile1);
    default: return -1;
    }
}
#endif
