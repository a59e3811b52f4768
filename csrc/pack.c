/* GGUF blocks -> kiln's kernel layouts (see kernels.h for the byte maps).

   Each row's group is first decoded into plain per-weight integers and per-block fields, then
   written in lane order; decoding and layout stay separate, so each is simple to check. */
#include <string.h>

#include "kernels.h"

enum { GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q8_0 = 8,
       GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_BF16 = 30, GGML_MXFP4 = 39 };

/* GGUF types and the kernel formats they pack into, one to one. */
static const struct { int ggml; kiln_wfmt fmt; } FORMATS[] = {
    {GGML_F32, KF_F32},   {GGML_F16, KF_F16},   {GGML_BF16, KF_BF16}, {GGML_Q4_0, KF_Q4_0}, {GGML_Q4_1, KF_Q4_1},
    {GGML_Q5_0, KF_Q5_0},   {GGML_Q8_0, KF_Q8_0},   {GGML_Q4_K, KF_Q4_K},  {GGML_Q5_K, KF_Q5_K}, {GGML_Q6_K, KF_Q6_K},
    {GGML_MXFP4, KF_MXFP4},
};

int kiln_wfmt_for_ggml(int t) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
        if (FORMATS[i].ggml == t) return FORMATS[i].fmt;
    return -1;
}

static int ggml_for_wfmt(kiln_wfmt f) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
        if (FORMATS[i].fmt == f) return FORMATS[i].ggml;
    return -1;
}

/* GGUF bytes of one block and weights per block. */
static int ggml_block_bytes(int t) {
    switch (t) {
    case GGML_F32: return 4;
    case GGML_F16: case GGML_BF16: return 2;
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q5_0: return 22;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    case GGML_MXFP4: return 17;
    default: return 0;
    }
}
static int ggml_block_weights(int t) {
    if (t == GGML_F32 || t == GGML_F16 || t == GGML_BF16) return 1;
    return t == GGML_Q4_K || t == GGML_Q5_K || t == GGML_Q6_K ? 256 : 32;
}

size_t kiln_ggml_row_bytes(int t, int cols) {
    int bw = ggml_block_weights(t);
    if (kiln_wfmt_for_ggml(t) < 0 || cols <= 0 || cols % bw) return 0;
    return (size_t)cols / bw * ggml_block_bytes(t);
}

size_t kiln_tile_bytes(kiln_wfmt f, int cols) {
    if (f < 0 || f >= KF_COUNT || cols <= 0) return 0;
    if ((f == KF_Q4_K || f == KF_Q5_K || f == KF_Q6_K) && cols % KILN_GROUP) return 0;
    if (!kiln_fmt_is_float(f) && cols % 32) return 0;
    if (kiln_fmt_is_float(f))
        return (size_t)4 * ((cols + KILN_FCHUNK - 1) / KILN_FCHUNK * KILN_FCHUNK) * kiln_fmt_elem_bytes(f);
    int G = cols / KILN_GROUP, nt = cols % KILN_GROUP / 32;
    return (size_t)4 * (G * (kiln_fmt_head_bytes(f, 8) + kiln_fmt_quant_bytes(f, 8)) +
                        (nt ? kiln_fmt_head_bytes(f, nt) + kiln_fmt_quant_bytes(f, nt) : 0));
}

size_t kiln_pack_size(int t, int rows, int cols) {
    int f = kiln_wfmt_for_ggml(t);
    if (f < 0 || rows <= 0 || cols <= 0 || cols % ggml_block_weights(t)) return 0;
    return (size_t)((rows + 3) / 4) * kiln_tile_bytes(f, cols) + KILN_PACK_SLACK;
}

/* ---- lane order ---- */

/* Byte of weight i of block j in a chunked region of nb blocks (chunk stride 4*nb). */
static inline int lane_byte(int nb, int j, int i) { return (i >> 2) * 4 * nb + 4 * j + (i & 3); }

/* q[j*32 + i]: 4-bit values -> nibble slots (low nibble: chunk L, high: chunk L+4). */
static void put_nibbles(uint8_t *dst, int nb, const uint8_t *q) {
    memset(dst, 0, (size_t)(unsigned)nb * 16);
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < 32; i++) {
            int k = i >> 2, at = (k & 3) * 4 * nb + 4 * j + (i & 3);
            dst[at] |= (q[j * 32 + i] & 15) << (k >= 4 ? 4 : 0);
        }
}

/* 5th bits: bit k of byte 4j+i%4 is the 5th bit of weight i of block j, chunk k = i/4. */
static void put_high1(uint8_t *dst, int nb, const uint8_t *q) {
    memset(dst, 0, (size_t)(unsigned)nb * 4);
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < 32; i++) dst[4 * j + (i & 3)] |= ((q[j * 32 + i] >> 4) & 1) << (i >> 2);
}

/* Bits 4-5 (Q6_K, nb = 8): chunk k goes to half k/4, bits 2*(k%4). */
static void put_high2(uint8_t *dst, const uint8_t *q) {
    memset(dst, 0, 64);
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 32; i++) {
            int k = i >> 2;
            dst[(k >> 2) * 32 + 4 * j + (i & 3)] |= ((q[j * 32 + i] >> 4) & 3) << (2 * (k & 3));
        }
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline void wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

/* ---- GGUF blocks of 32 (Q4_0 / Q4_1 / Q5_0 / Q8_0 / MXFP4): their stored values ---- */

/* Bytes before a block of 32's quants: its scale fields (MXFP4: one e8m0 byte). */
static int block32_head(kiln_wfmt f) { return f == KF_Q4_1 ? 4 : f == KF_Q5_0 ? 6 : f == KF_MXFP4 ? 1 : 2; }

/* The 32 values block b stores: nibbles with Q5_0's 5th bits added, or Q8_0's bytes. */
static void block32_values(kiln_wfmt f, const uint8_t *b, uint8_t *q) {
    if (f == KF_Q8_0) {
        memcpy(q, b + 2, 32);
        return;
    }
    const uint8_t *qs = b + block32_head(f);
    uint32_t qh = f == KF_Q5_0 ? (uint32_t)b[2] | b[3] << 8 | b[4] << 16 | (uint32_t)b[5] << 24 : 0;
    for (int i = 0; i < 16; i++) {
        q[i] = (qs[i] & 15) | ((qh >> i & 1) << 4);
        q[16 + i] = (qs[i] >> 4) | ((qh >> (16 + i) & 1) << 4);
    }
}

/* block32_values undone: the 32 values v into block b (its scale fields are left as they are). */
static void block32_put_values(kiln_wfmt f, const uint8_t *v, uint8_t *b) {
    if (f == KF_Q8_0) {
        memcpy(b + 2, v, 32);
        return;
    }
    uint8_t *qs = b + block32_head(f);
    uint32_t qh = 0;
    for (int i = 0; i < 16; i++) {
        qs[i] = (uint8_t)((v[i] & 15) | (v[16 + i] & 15) << 4);
        qh |= (uint32_t)(v[i] >> 4 & 1) << i | (uint32_t)(v[16 + i] >> 4 & 1) << (16 + i);
    }
    if (f == KF_Q5_0)
        for (int i = 0; i < 4; i++) b[2 + i] = (uint8_t)(qh >> (8 * i));
}

/* ---- one row's group: GGUF blocks -> header h and quants q ---- */

/* Q4_0 / Q4_1 / Q5_0 / Q8_0 / MXFP4: nb blocks of 32 starting at src. */
static void pack_group32(kiln_wfmt f, const uint8_t *src, int nb, uint8_t *h, uint8_t *qd) {
    uint8_t q[256];
    int bb = ggml_block_bytes(ggml_for_wfmt(f));
    for (int j = 0; j < nb; j++) {
        const uint8_t *b = src + j * bb;
        if (f == KF_MXFP4)
            h[j] = b[0];
        else
            wr16(h + 2 * j, rd16(b));
        if (f == KF_Q4_1) wr16(h + 2 * nb + 2 * j, rd16(b + 2));
        block32_values(f, b, q + 32 * j);
    }
    if (f == KF_Q8_0) {
        for (int j = 0; j < nb; j++)
            for (int i = 0; i < 32; i++) qd[lane_byte(nb, j, i)] = q[32 * j + i];
        return;
    }
    put_nibbles(qd, nb, q);
    if (f == KF_Q5_0) put_high1(qd + 16 * nb, nb, q);
}

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block. */
static void k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

static void pack_groupk(kiln_wfmt f, const uint8_t *b, uint8_t *h, uint8_t *qd) {
    uint8_t q[256];
    if (f == KF_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128, *sc = b + 192;
        wr16(h, rd16(b + 208));
        memcpy(h + 2, sc, 16);
        for (int e = 0; e < 256; e++) {
            int half = e >> 7, r = e & 127;
            int lo = (ql[64 * half + (r & 63)] >> (r >= 64 ? 4 : 0)) & 15;
            int hi = (qh[32 * half + (r & 31)] >> (2 * (r >> 5))) & 3;
            q[e] = (uint8_t)(lo | hi << 4);
        }
        put_nibbles(qd, 8, q);
        put_high2(qd + 128, q);
        return;
    }
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (f == KF_Q5_K ? 48 : 16);
    wr16(h, rd16(b));
    wr16(h + 2, rd16(b + 2));
    for (int j = 0; j < 8; j++) k_scale_min(scales, j, h + 4 + j, h + 12 + j);
    for (int e = 0; e < 256; e++) {
        int c = e >> 6, l = e & 63;
        int lo = (qs[32 * c + (l & 31)] >> (l >= 32 ? 4 : 0)) & 15;
        int hi = f == KF_Q5_K ? (qh[e & 31] >> (e >> 5)) & 1 : 0;
        q[e] = (uint8_t)(lo | hi << 4);
    }
    put_nibbles(qd, 8, q);
    if (f == KF_Q5_K) put_high1(qd + 128, 8, q);
}

/* Float formats: chunks of 16 columns, 4 rows each, zero padded. */
static void pack_float(kiln_wfmt f, const uint8_t *src, int rows, int cols, uint8_t *dst, size_t tb) {
    int es = kiln_fmt_elem_bytes(f), nchunk = (cols + KILN_FCHUNK - 1) / KILN_FCHUNK;
    size_t row_bytes = (size_t)cols * es;
    for (int t = 0; t < (rows + 3) / 4; t++)
        for (int c = 0; c < nchunk; c++)
            for (int r = 0; r < 4; r++) {
                uint8_t *d = dst + t * tb + ((size_t)c * 4 + r) * KILN_FCHUNK * es;
                int row = 4 * t + r, n = cols - c * KILN_FCHUNK < KILN_FCHUNK ? cols - c * KILN_FCHUNK : KILN_FCHUNK;
                memset(d, 0, KILN_FCHUNK * es);
                if (row < rows) memcpy(d, src + (size_t)row * row_bytes + (size_t)c * KILN_FCHUNK * es, (size_t)n * es);
            }
}

int kiln_pack(int t, const uint8_t *src, int rows, int cols, uint8_t *dst, kiln_wmat *out) {
    size_t total = kiln_pack_size(t, rows, cols);
    if (!total) return -1;
    kiln_wfmt f = (kiln_wfmt)kiln_wfmt_for_ggml(t);
    size_t tb = kiln_tile_bytes(f, cols);
    int tiles = (rows + 3) / 4;
    memset(dst + tiles * tb, 0, KILN_PACK_SLACK);
    if (kiln_fmt_is_float(f))
        pack_float(f, src, rows, cols, dst, tb);
    else {
        size_t row_bytes = kiln_ggml_row_bytes(t, cols);
        int G = cols / KILN_GROUP, nt = cols % KILN_GROUP / 32, bw = ggml_block_weights(t);
        int bb = ggml_block_bytes(t);
        for (int ti = 0; ti < tiles; ti++) {
            uint8_t *p = dst + ti * tb;
            for (int g = 0; g <= G; g++) {
                int nb = g < G ? 8 : nt;
                if (!nb) break;
                if (g == G && kiln_shared_tail(nb)) { /* the 4 rows' 2 blocks as one row of 8 */
                    uint8_t blocks[8 * 34] = {0}; /* padding rows stay zero, so d = 0 */
                    for (int r = 0; r < 4 && 4 * ti + r < rows; r++)
                        memcpy(blocks + 2 * r * bb, src + (size_t)(4 * ti + r) * row_bytes + (size_t)G * 8 * bb, 2 * (size_t)bb);
                    pack_group32(f, blocks, 8, p, p + kiln_fmt_head_bytes(f, 8));
                    break;
                }
                int hb = kiln_fmt_head_bytes(f, nb), qb = kiln_fmt_quant_bytes(f, nb);
                for (int r = 0; r < 4; r++) {
                    int row = 4 * ti + r;
                    uint8_t *h = p + r * hb, *q = p + 4 * hb + r * qb;
                    if (row >= rows) { /* padding row: all zero, so d = 0 */
                        memset(h, 0, hb);
                        memset(q, 0, qb);
                        continue;
                    }
                    const uint8_t *s = src + (size_t)row * row_bytes + (size_t)g * KILN_GROUP / bw * ggml_block_bytes(t);
                    if (bw == 256)
                        pack_groupk(f, s, h, q);
                    else
                        pack_group32(f, s, nb, h, q);
                }
                p += 4 * (hb + qb);
            }
        }
    }
    *out = (kiln_wmat){f, rows, cols, tiles * 4, tb, dst};
    return 0;
}

/* ---- the inverse: one row of a packed matrix back to its GGUF bytes ---- */

/* q[j*32 + i], the plain values of nb blocks, from quants in lane order (put_nibbles etc. undone). */
static void get_values(kiln_wfmt f, const uint8_t *qd, int nb, uint8_t *q) {
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < 32; i++) {
            int k = i >> 2, e = 32 * j + i;
            if (f == KF_Q8_0) {
                q[e] = qd[lane_byte(nb, j, i)];
                continue;
            }
            q[e] = (qd[(k & 3) * 4 * nb + 4 * j + (i & 3)] >> (k >= 4 ? 4 : 0)) & 15;
            if (f == KF_Q5_0 || f == KF_Q5_K) q[e] |= ((qd[16 * nb + 4 * j + (i & 3)] >> k) & 1) << 4;
            if (f == KF_Q6_K) q[e] |= ((qd[128 + (k >> 2) * 32 + 4 * j + (i & 3)] >> (2 * (k & 3))) & 3) << 4;
        }
}

/* Blocks of 32: header h and quants qd of nb blocks -> GGUF blocks at dst (pack_group32 undone). */
static void unpack_group32(kiln_wfmt f, const uint8_t *h, const uint8_t *qd, int nb, uint8_t *dst) {
    uint8_t q[256];
    int bb = ggml_block_bytes(ggml_for_wfmt(f));
    get_values(f, qd, nb, q);
    for (int j = 0; j < nb; j++) {
        uint8_t *b = dst + j * bb;
        if (f == KF_MXFP4)
            b[0] = h[j];
        else
            wr16(b, rd16(h + 2 * j));
        if (f == KF_Q4_1) wr16(b + 2, rd16(h + 2 * nb + 2 * j));
        block32_put_values(f, q + 32 * j, b);
    }
}

/* A super-block of 256 (pack_groupk undone). */
static void unpack_groupk(kiln_wfmt f, const uint8_t *h, const uint8_t *qd, uint8_t *b) {
    uint8_t q[256];
    get_values(f, qd, 8, q);
    if (f == KF_Q6_K) {
        uint8_t *ql = b, *qh = b + 128;
        memset(b, 0, 192);
        memcpy(b + 192, h + 2, 16);
        wr16(b + 208, rd16(h));
        for (int e = 0; e < 256; e++) {
            int half = e >> 7, r = e & 127;
            ql[64 * half + (r & 63)] |= (uint8_t)((q[e] & 15) << (r >= 64 ? 4 : 0));
            qh[32 * half + (r & 31)] |= (uint8_t)((q[e] >> 4 & 3) << (2 * (r >> 5)));
        }
        return;
    }
    const uint8_t *sc = h + 4, *m = h + 12;
    uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (f == KF_Q5_K ? 48 : 16);
    wr16(b, rd16(h));
    wr16(b + 2, rd16(h + 2));
    for (int j = 0; j < 4; j++) { /* k_scale_min undone: 8 six-bit scales and mins in 12 bytes */
        scales[j] = (uint8_t)((sc[j] & 63) | (sc[j + 4] >> 4) << 6);
        scales[j + 4] = (uint8_t)((m[j] & 63) | (m[j + 4] >> 4) << 6);
        scales[j + 8] = (uint8_t)((sc[j + 4] & 15) | (m[j + 4] & 15) << 4);
    }
    memset(qs, 0, 128);
    if (f == KF_Q5_K) memset(qh, 0, 32);
    for (int e = 0; e < 256; e++) {
        int c = e >> 6, l = e & 63;
        qs[32 * c + (l & 31)] |= (uint8_t)((q[e] & 15) << (l >= 32 ? 4 : 0));
        if (f == KF_Q5_K) qh[e & 31] |= (uint8_t)((q[e] >> 4 & 1) << (e >> 5));
    }
}

int kiln_unpack_row(const kiln_wmat *w, int row, uint8_t *dst) {
    kiln_wfmt f = w->fmt;
    int t = ggml_for_wfmt(f);
    if (t < 0 || row < 0 || row >= w->rows) return -1;
    const uint8_t *tile = w->data + (size_t)(row / 4) * w->tile_bytes;
    int r = row % 4;
    if (kiln_fmt_is_float(f)) {
        int es = kiln_fmt_elem_bytes(f), nchunk = (w->cols + KILN_FCHUNK - 1) / KILN_FCHUNK;
        for (int c = 0; c < nchunk; c++) {
            int n = w->cols - c * KILN_FCHUNK < KILN_FCHUNK ? w->cols - c * KILN_FCHUNK : KILN_FCHUNK;
            memcpy(dst + (size_t)c * KILN_FCHUNK * es, tile + ((size_t)c * 4 + r) * KILN_FCHUNK * es, (size_t)n * es);
        }
        return 0;
    }
    int G = w->cols / KILN_GROUP, nt = w->cols % KILN_GROUP / 32, bb = ggml_block_bytes(t);
    const uint8_t *p = tile;
    for (int g = 0; g <= G; g++) {
        int nb = g < G ? 8 : nt;
        if (!nb) break;
        uint8_t *out = dst + (size_t)g * (KILN_GROUP / ggml_block_weights(t)) * bb; /* a group's GGUF blocks */
        if (g == G && kiln_shared_tail(nb)) { /* block 2r+j of one 8-block group is block j of row r */
            uint8_t blocks[8 * 34];
            unpack_group32(f, p, p + kiln_fmt_head_bytes(f, 8), 8, blocks);
            memcpy(out, blocks + 2 * r * bb, 2 * (size_t)bb);
            break;
        }
        int hb = kiln_fmt_head_bytes(f, nb), qb = kiln_fmt_quant_bytes(f, nb);
        if (ggml_block_weights(t) == 256)
            unpack_groupk(f, p + r * hb, p + 4 * hb + r * qb, out);
        else
            unpack_group32(f, p + r * hb, p + 4 * hb + r * qb, nb, out);
        p += 4 * (hb + qb);
    }
    return 0;
}

/* ---- A split int8 matrix (the output head; op_logits.c says why) ---------------------------------------- */

/* fp16 bits of 8 times fp16 `h` (exact: only the exponent moves), or -1 when that overflows. */
static int f16_times8(uint16_t h) {
    int sign = h & 0x8000, exp = h >> 10 & 31, man = h & 0x3ff;
    if (exp == 31) return -1;
    if (exp) return exp + 3 >= 31 ? -1 : sign | (exp + 3) << 10 | man;
    man <<= 3; /* a subnormal is man * 2^-24 */
    if (man < 0x400) return sign | man;
    for (exp = 1; man >= 0x800; exp++) man >>= 1; /* the low bits shifted out are the three zeros */
    return sign | exp << 10 | (man & 0x3ff);
}

int kiln_split_q8_0(const uint8_t *src, size_t n_blocks, uint8_t *hi, uint8_t *lo) {
    int b8 = ggml_block_bytes(GGML_Q8_0), b5 = ggml_block_bytes(GGML_Q5_0), b4 = ggml_block_bytes(GGML_Q4_0);
    for (size_t b = 0; b < n_blocks; b++) {
        const uint8_t *s = src + b8 * b;
        uint8_t *h = hi + b5 * b, *l = lo + b4 * b, q[32], u[32], n[32];
        int d8 = f16_times8(rd16(s));
        if (d8 < 0) return -1;
        block32_values(KF_Q8_0, s, q);
        for (int i = 0; i < 32; i++) { /* q = 8 * (u - 16) + (n - 8) */
            u[i] = (uint8_t)(((int8_t)q[i] >> 3) + 16);
            n[i] = (uint8_t)(((int8_t)q[i] & 7) + 8);
        }
        wr16(h, (uint16_t)d8);
        block32_put_values(KF_Q5_0, u, h);
        wr16(l, rd16(s));
        block32_put_values(KF_Q4_0, n, l);
    }
    return 0;
}

int kiln_unpack_split_row(const kiln_wmat *hi, const kiln_wmat *lo, int row, uint8_t *dst, uint8_t *work) {
    if (hi->fmt != KF_Q5_0 || lo->fmt != KF_Q4_0 || hi->rows != lo->rows || hi->cols != lo->cols) return -1;
    int nb = hi->cols / 32, b8 = ggml_block_bytes(GGML_Q8_0), b5 = ggml_block_bytes(GGML_Q5_0),
        b4 = ggml_block_bytes(GGML_Q4_0);
    uint8_t *h = work, *l = work + (size_t)nb * b5;
    if (kiln_unpack_row(hi, row, h) < 0 || kiln_unpack_row(lo, row, l) < 0) return -1;
    for (int b = 0; b < nb; b++, h += b5, l += b4, dst += b8) {
        uint8_t u[32], n[32], q[32];
        block32_values(KF_Q5_0, h, u);
        block32_values(KF_Q4_0, l, n);
        for (int i = 0; i < 32; i++) q[i] = (uint8_t)(int8_t)(8 * (u[i] - 16) + (n[i] - 8));
        wr16(dst, rd16(l));
        block32_put_values(KF_Q8_0, q, dst);
    }
    return 0;
}
