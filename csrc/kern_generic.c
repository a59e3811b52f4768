/* Scalar reference kernels: the definition every SIMD variant must reproduce bit for bit.

   Per row and token, 8 float lanes (lane j = block j of each group) accumulate one fused multiply-add
   per block of the exact integer block sum, plus one for the affine minimum; the lanes are then
   summed as ((a0+a1)+(a2+a3)) + ((a4+a5)+(a6+a7)). Float formats use 16 lanes (a column chunk),
   folded as lane l + lane l+8 first. */
#include <math.h>
#include <string.h>

#include "act.h"
#include "kernels.h"

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline float rdf16(const uint8_t *p) { return kiln_f16_to_f32(rd16(p)); }
static inline float rdf32(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }

/* Byte of weight i of block j in a chunked region of nb blocks. */
static inline int lane_byte(int nb, int j, int i) { return (i >> 2) * 4 * nb + 4 * j + (i & 3); }

/* Stored unsigned value of weight i of block j (4, 5 or 6 bits) of one row's quants q. */
static int stored_q(kiln_wfmt f, const uint8_t *q, int nb, int j, int i) {
    int k = i >> 2, b = 4 * j + (i & 3);
    int v = (q[(k & 3) * 4 * nb + b] >> (k >= 4 ? 4 : 0)) & 15;
    if (f == KF_Q5_0 || f == KF_Q5_K) v |= ((q[16 * nb + b] >> k) & 1) << 4;
    if (f == KF_Q6_K) v |= ((q[128 + (k >> 2) * 32 + b] >> (2 * (k & 3))) & 3) << 4;
    return v;
}

/* Accumulate one row's group (header h, quants q, nb blocks) against activation group ag. */
static void group_dot(kiln_wfmt f, const uint8_t *h, const uint8_t *q, int nb, const uint8_t *ag, float acc[8]) {
    for (int j = 0; j < nb; j++) {
        int32_t isum = 0;
        for (int i = 0; i < 32; i++) {
            int x = (int8_t)ag[kiln_act_byte(nb, j, i)], w;
            switch (f) {
            case KF_Q8_0: w = (int8_t)q[lane_byte(nb, j, i)]; break;
            case KF_Q6_K: w = ((int8_t)h[2 + 2 * j + i / 16]) * (stored_q(f, q, nb, j, i) - 32); break;
            case KF_MXFP4: w = kiln_mxfp4_values[stored_q(f, q, nb, j, i)] + KILN_MXFP4_OFFSET; break;
            default: w = stored_q(f, q, nb, j, i); /* Q4, Q4K, Q5K: unsigned, scale / min below; Q4S, Q5: offset below */
            }
            isum += w * x;
        }
        /* Q4S / Q5 subtract their offset through the activation's block sum, as the SIMD kernels do: the
           same integer while the sum is the block's, and the same result when a caller shifts it (plan.c's
           split output head) */
        int32_t sum32;
        memcpy(&sum32, ag + KILN_AG_SUM32 + 4 * j, 4);
        if (f == KF_Q4_0) isum -= 8 * sum32;
        if (f == KF_Q5_0) isum -= 16 * sum32;
        if (f == KF_MXFP4) isum -= KILN_MXFP4_OFFSET * sum32;
        float dx = rdf32(ag + KILN_AG_D + 4 * j), sx = rdf32(ag + KILN_AG_S + 4 * j);
        switch (f) {
        case KF_Q4_1:
            acc[j] = fmaf((float)isum, rdf16(h + 2 * j) * dx, acc[j]);
            acc[j] = fmaf(rdf16(h + 2 * nb + 2 * j), sx, acc[j]);
            break;
        case KF_Q4_K: case KF_Q5_K:
            acc[j] = fmaf((float)(isum * h[4 + j]), rdf16(h) * dx, acc[j]);
            acc[j] = fmaf(-(rdf16(h + 2) * (float)h[12 + j]), sx, acc[j]);
            break;
        case KF_Q6_K:
            acc[j] = fmaf((float)isum, rdf16(h) * dx, acc[j]);
            break;
        case KF_MXFP4:
            acc[j] = fmaf((float)isum, kiln_e8m0_half(h[j]) * dx, acc[j]);
            break;
        default:
            acc[j] = fmaf((float)isum, rdf16(h + 2 * j) * dx, acc[j]);
        }
    }
}

static float reduce8(const float a[8]) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

static float load_weight(kiln_wfmt f, const uint8_t *p) {
    if (f == KF_F32) return rdf32(p);
    if (f == KF_F16) return rdf16(p);
    uint32_t bits = (uint32_t)rd16(p) << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

void kiln_matmul_generic(const kiln_wmat *w, const void *act, int n_tok, float *y, int ldy, int tile0, int tile1) {
    kiln_wfmt f = w->fmt;
    size_t stride = kiln_act_stride(f, w->cols);
    for (int ti = tile0; ti < tile1; ti++) {
        const uint8_t *tile = w->data + ti * w->tile_bytes;
        for (int r = 0; r < 4 && 4 * ti + r < w->rows; r++)
            for (int t = 0; t < n_tok; t++) {
                const uint8_t *a = (const uint8_t *)act + t * stride;
                float out;
                if (kiln_fmt_is_float(f)) {
                    int es = kiln_fmt_elem_bytes(f), nchunk = (w->cols + KILN_FCHUNK - 1) / KILN_FCHUNK;
                    float acc[16] = {0}, a8[8];
                    for (int c = 0; c < nchunk; c++)
                        for (int l = 0; l < 16; l++) {
                            const uint8_t *wp = tile + (((size_t)c * 4 + r) * KILN_FCHUNK + l) * es;
                            acc[l] = fmaf(load_weight(f, wp), rdf32(a + ((size_t)c * KILN_FCHUNK + l) * 4), acc[l]);
                        }
                    for (int l = 0; l < 8; l++) a8[l] = acc[l] + acc[l + 8];
                    out = reduce8(a8);
                } else {
                    float acc[8] = {0}, tail[8] = {0};
                    int shared = 0;
                    const uint8_t *p = tile;
                    int G = w->cols / KILN_GROUP, nt = w->cols % KILN_GROUP / 32;
                    for (int g = 0; g <= G; g++) {
                        int nb = g < G ? 8 : nt;
                        if (!nb) break;
                        const uint8_t *ag = a + (size_t)g * KILN_AG_BYTES;
                        if (g == G && kiln_shared_tail(nb)) { /* lanes 2r, 2r+1 of the tiles' shared group */
                            group_dot(f, p, p + kiln_fmt_head_bytes(f, 8), 8, ag, tail);
                            shared = 1;
                            break;
                        }
                        int hb = kiln_fmt_head_bytes(f, nb), qb = kiln_fmt_quant_bytes(f, nb);
                        group_dot(f, p + r * hb, p + 4 * hb + r * qb, nb, ag, acc);
                        p += 4 * (hb + qb);
                    }
                    out = reduce8(acc);
                    if (shared) out += tail[2 * r] + tail[2 * r + 1];
                }
                y[(size_t)t * ldy + 4 * ti + r] = out;
            }
    }
}

/* One block of 32 activations -> quants of block j in group ag, which holds nb blocks. */
static void quantize_block(const float *x, uint8_t *ag, int nb, int j) {
    float amax = 0;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
    int32_t sum[2] = {0, 0};
    for (int i = 0; i < 32; i++) {
        int q = (int)rintf(x[i] * id);
        ag[kiln_act_byte(nb, j, i)] = (uint8_t)(int8_t)q;
        sum[i >> 4] += q;
    }
    int32_t s32 = sum[0] + sum[1];
    int16_t s16[2] = {(int16_t)sum[0], (int16_t)sum[1]};
    float s = d * (float)s32;
    memcpy(ag + KILN_AG_D + 4 * j, &d, 4);
    memcpy(ag + KILN_AG_S + 4 * j, &s, 4);
    memcpy(ag + KILN_AG_SUM32 + 4 * j, &s32, 4);
    memcpy(ag + KILN_AG_SUM16 + 4 * j, s16, 4);
}

void kiln_quantize_act_generic(kiln_wfmt f, const float *x, int ldx, int cols, int n_tok, void *act) {
    size_t stride = kiln_act_stride(f, cols);
    for (int t = 0; t < n_tok; t++) {
        const float *xr = x + (size_t)t * ldx;
        uint8_t *a = (uint8_t *)act + t * stride;
        if (kiln_act_kind(f) == KILN_ACT_F32) {
            memset(a, 0, stride);
            memcpy(a, xr, (size_t)cols * 4);
            continue;
        }
        for (int g = 0; g * KILN_GROUP < cols; g++) {
            uint8_t *ag = a + (size_t)g * KILN_AG_BYTES;
            int nb = kiln_group_blocks(cols, g);
            if (nb < 8) memset(ag, 0, KILN_AG_BYTES);
            for (int j = 0; j < nb; j++) quantize_block(xr + g * KILN_GROUP + 32 * j, ag, nb, j);
            if (kiln_shared_tail(nb)) kiln_repeat_tail_lanes(ag);
        }
    }
}

/* The values an int8 activation row stands for (per group of 256: the quants in lane order, then a scale
   per block of 32), as (float)q * d. */
static void act_row_values(const uint8_t *act, int cols, float *x) {
    for (int g = 0; g * KILN_GROUP < cols; g++) {
        const uint8_t *ag = act + (size_t)g * KILN_AG_BYTES;
        int nb = kiln_group_blocks(cols, g);
        float d[8], *xg = x + g * KILN_GROUP;
        memcpy(d, ag + KILN_AG_D, sizeof(float) * nb);
        for (int j = 0; j < nb; j++)
            for (int i = 0; i < 32; i++) xg[32 * j + i] = (float)(int8_t)ag[kiln_act_byte(nb, j, i)] * d[j];
    }
}

void kiln_quantize_act_pair_generic(kiln_wfmt f, const float *x, int cols, void *first, void *second, float *residual) {
    kiln_quantize_act_generic(f, x, cols, cols, 1, first);
    act_row_values(first, cols, residual);
    for (int c = 0; c < cols; c++) residual[c] = x[c] - residual[c];
    kiln_quantize_act_generic(f, residual, cols, cols, 1, second);
}
