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

/* Tiles [ti, ti + 4) of w (those below tile1; the rest are zero rows) into B tiles b (nblk * 512 bytes)
   and scales s (nblk). `work`: 16 * 256 bytes. */
static void unpack_slab(kiln_wfmt f, const kiln_wmat *w, int ti, int tile1, uint8_t *b, wscale *s, int nblk, uint8_t *work) {
    const int HB = kiln_fmt_head_bytes(f, 8), QB = kiln_fmt_quant_bytes(f, 8), GB = 4 * (HB + QB);
    int G = w->cols / KILN_GROUP, nt = w->cols % KILN_GROUP / 32;
    int il[4][16], ih[4][16];
    __m512i vil[4], vih[4];
    for (int st = 0; st < 4; st++) {
        int m = 1 << st;
        for (int j = 0; j < 16; j++) {
            il[st][j] = j & m ? 16 + (j ^ m) : j;
            ih[st][j] = j & m ? 16 + j : j | m;
        }
        vil[st] = idx16(il[st]);
        vih[st] = idx16(ih[st]);
    }
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
   the values are laid out: activations as bf16(q * d), weights as bf16(q * mul + add) for each 16-row
   slab, and tdpbf16ps accumulates the whole row in fp32 inside the tile unit. Each product rounds both
   factors to 8 significant bits, so the result is no longer the other variants' bits: it is tested
   against the oracle by tolerance and KLD. */

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

/* One 32-value row of int8 q (and q2 when paired) times its scales, as bf16 into `out`. */
ALWAYS void bf16_row(const int8_t *q, float d, const int8_t *q2, float d2, uint16_t *out) {
    __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), _mm512_set1_ps(d));
    __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))), _mm512_set1_ps(d));
    if (q2) {
        lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q2))), _mm512_set1_ps(d2), lo);
        hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q2 + 16)))), _mm512_set1_ps(d2), hi);
    }
    _mm512_storeu_si512(out, to_bf16(hi, lo));
}

static float act_scale(const uint8_t *a, int blk) {
    float d;
    memcpy(&d, a + (size_t)(blk / 8) * KILN_AG_BYTES + KILN_AG_D + 4 * (blk % 8), 4);
    return d;
}

/* Q8 activations (kernels.h) of n tokens as bf16 A tiles, [token tile][block][16 tokens][32]: token
   tiles in pairs, the missing tokens zero. Paired (ops.h): rows n..2n-1 hold the second rows, summed in. */
int kiln_bf16_tiles(kiln_wfmt f, const void *act, int cols, int n, int paired, uint16_t *dst) {
    size_t stride = kiln_act_stride(f, cols);
    int nblk = cols / 32, ntt = (n + 2 * TOK_BLOCK - 1) / (2 * TOK_BLOCK) * 2;
    size_t stage = (size_t)nblk * 512;
    uint8_t *x = thread_scratch(2 * stage);
    if (!x) return -1;
    const uint8_t *a = act;
    for (int tt = 0; tt < ntt; tt++) {
        uint16_t *out = dst + (size_t)tt * nblk * BF16_TILE;
        int t0 = tt * TOK_BLOCK, cnt = n - t0 < TOK_BLOCK ? n - t0 : TOK_BLOCK;
        if (cnt <= 0) {
            memset(out, 0, (size_t)nblk * BF16_TILE * 2);
            continue;
        }
        layout_act(a + (size_t)t0 * stride, stride, cols, cnt, x, nblk, -1, NULL);
        if (paired) layout_act(a + (size_t)(n + t0) * stride, stride, cols, cnt, x + stage, nblk, -1, NULL);
        for (int r = 0; r < TOK_BLOCK; r++) {
            if (r >= cnt) {
                for (int blk = 0; blk < nblk; blk++) memset(out + ((size_t)blk * TOK_BLOCK + r) * 32, 0, 64);
                continue;
            }
            const uint8_t *ar = a + (size_t)(t0 + r) * stride, *ar2 = a + (size_t)(n + t0 + r) * stride;
            for (int blk = 0; blk < nblk; blk++) {
                const int8_t *q = (const int8_t *)x + (size_t)blk * 512 + r * 32;
                bf16_row(q, act_scale(ar, blk), paired ? q + stage : NULL, paired ? act_scale(ar2, blk) : 0.0f,
                         out + ((size_t)blk * TOK_BLOCK + r) * 32);
            }
        }
    }
    return 0;
}

/* The int8 B tiles and scales of a slab (unpack_slab) as bf16 B tiles, [block][16 pairs of k][16 rows][2]:
   value = q * mul + add per row, mul for Q6_K's second 16 weights of a block its second sub-block's. */
static void bf16_slab(kiln_wfmt f, const uint8_t *b, const wscale *s, int nblk, uint16_t *out) {
    int rep[4][16], pick[2][16];
    for (int z = 0; z < 4; z++)
        for (int e = 0; e < 16; e++) rep[z][e] = 4 * z + e / 4;
    for (int kp = 0; kp < 2; kp++)
        for (int n = 0; n < 16; n++) pick[kp][n] = n < 8 ? 2 * n + kp : 16 + 2 * (n - 8) + kp;
    __m512i vrep[4], vpick[2];
    for (int z = 0; z < 4; z++) vrep[z] = idx16(rep[z]);
    for (int kp = 0; kp < 2; kp++) vpick[kp] = idx16(pick[kp]);
    for (int blk = 0; blk < nblk; blk++) {
        const wscale *sc = s + blk;
        __m512 d = _mm512_loadu_ps(sc->d), mul = d, mul2 = d, add = _mm512_setzero_ps();
        if (f == KF_Q4_0) add = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        if (f == KF_Q5_0) add = _mm512_mul_ps(d, _mm512_set1_ps(-16.0f));
        if (f == KF_Q4_1 || f == KF_Q4_K || f == KF_Q5_K) add = _mm512_loadu_ps(sc->m);
        if (f == KF_Q4_K || f == KF_Q5_K || f == KF_Q6_K) mul = mul2 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_loadu_si512(sc->sa)));
        if (f == KF_Q6_K) mul2 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_loadu_si512(sc->sb)));
        __m512 m[2][4], ad[4];
        for (int z = 0; z < 4; z++) {
            m[0][z] = _mm512_permutexvar_ps(vrep[z], mul);
            m[1][z] = _mm512_permutexvar_ps(vrep[z], mul2);
            ad[z] = _mm512_permutexvar_ps(vrep[z], add);
        }
        const uint8_t *bb = b + (size_t)blk * 512;
        uint16_t *ob = out + (size_t)blk * BF16_TILE;
        for (int k4 = 0; k4 < 8; k4++) {
            __m512 v[4];
            const __m512 *mz = m[k4 >= 4];
            for (int z = 0; z < 4; z++)
                v[z] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(bb + 64 * k4 + 16 * z)))), mz[z], ad[z]);
            __m512i p = to_bf16(v[1], v[0]), q = to_bf16(v[3], v[2]);
            for (int kp = 0; kp < 2; kp++) _mm512_storeu_si512(ob + (2 * k4 + kp) * 32, _mm512_permutex2var_epi32(p, vpick[kp], q));
        }
    }
}

/* tmm0-3: C, 16 tokens x 16 rows fp32; tmm4, 5: A, 16 tokens x 32 bf16; tmm6, 7: B, 16 pairs x 16 rows x 2. */
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

/* C tile `c` into y at (token t, column col): in place when all 16 x 16 are wanted, else through `tmp`. */
#define STORE_C(c, y, ldy, t, col, nt, nc, tmp) do { \
        if ((nt) >= 16 && (nc) >= 16) _tile_stored(c, (y) + (size_t)(t) * (ldy) + (col), (ldy) * 4); \
        else if ((nt) > 0 && (nc) > 0) { \
            _tile_stored(c, tmp, 64); \
            for (int r_ = 0; r_ < (nt); r_++) memcpy((y) + (size_t)((t) + r_) * (ldy) + (col), (tmp) + 16 * r_, sizeof(float) * (nc)); \
        } \
    } while (0)

static int run_bf16(kiln_wfmt f, const kiln_wmat *w, const uint16_t *a, int n_tok, float *y, int ldy, int tile0, int tile1) {
    int nblk = w->cols / 32, pairs = (n_tok + 2 * TOK_BLOCK - 1) / (2 * TOK_BLOCK);
    size_t bbytes = (size_t)nblk * 512, sbytes = sizeof(wscale) * nblk, hbytes = (size_t)nblk * BF16_TILE * 2;
    uint8_t *mem = thread_scratch(bbytes + sbytes + 16 * 256 + 2 * hbytes + 1024);
    if (!mem) return -1;
    uint8_t *b = mem, *wk = b + bbytes + sbytes;
    wscale *s = (wscale *)(b + bbytes);
    uint16_t *h0 = (uint16_t *)(wk + 16 * 256), *h1 = h0 + (size_t)nblk * BF16_TILE;
    float *tmp = (float *)(h1 + (size_t)nblk * BF16_TILE);
    int end = 4 * tile1 < w->rows ? 4 * tile1 : w->rows;
    load_config_bf16();
    for (int ti = tile0; ti < tile1; ti += 2 * SLAB_TILES) {
        unpack_slab(f, w, ti, tile1, b, s, nblk, wk);
        bf16_slab(f, b, s, nblk, h0);
        int second = ti + SLAB_TILES < tile1;
        if (second) {
            unpack_slab(f, w, ti + SLAB_TILES, tile1, b, s, nblk, wk);
            bf16_slab(f, b, s, nblk, h1);
        } else
            memset(h1, 0, hbytes);
        int col0 = 4 * ti, col1 = col0 + 16, nc0 = end - col0 < 16 ? end - col0 : 16, nc1 = end - col1 < 16 ? end - col1 : 16;
        for (int p = 0; p < pairs; p++) {
            const uint16_t *a0 = a + (size_t)(2 * p) * nblk * BF16_TILE, *a1 = a0 + (size_t)nblk * BF16_TILE;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int blk = 0; blk < nblk; blk++) {
                _tile_loadd(4, a0 + (size_t)blk * BF16_TILE, 64);
                _tile_loadd(6, h0 + (size_t)blk * BF16_TILE, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_loadd(7, h1 + (size_t)blk * BF16_TILE, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_loadd(5, a1 + (size_t)blk * BF16_TILE, 64);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            int t = 2 * p * TOK_BLOCK, nt0 = n_tok - t < 16 ? n_tok - t : 16, nt1 = n_tok - t - 16 < 16 ? n_tok - t - 16 : 16;
            STORE_C(0, y, ldy, t, col0, nt0, nc0, tmp);
            STORE_C(1, y, ldy, t, col1, nt0, nc1, tmp);
            STORE_C(2, y, ldy, t + 16, col0, nt1, nc0, tmp);
            STORE_C(3, y, ldy, t + 16, col1, nt1, nc1, tmp);
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
