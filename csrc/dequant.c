/* Rows of GGUF tensors in their stored layout, to float: embedding lookups read one row per token
 * straight from the memory-mapped file, so the table is never copied. Portable C; a row is small. */
#include "dequant.h"
#include "kernels.h"

#include <string.h>

float kiln_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: renormalize */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t kiln_float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, exp = (x >> 23) & 0xff, mant = x & 0x7fffff;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    int e = (int)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) { /* subnormal or zero, round to nearest even */
        if (e < -10) return (uint16_t)sign;
        mant |= 0x800000;
        int shift = 14 - e;
        uint32_t half = mant >> shift, rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (mant >> 13), rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++; /* may carry into the exponent: correct */
    return (uint16_t)(sign | half);
}

static float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Q4_K / Q5_K pack eight 6-bit scales and mins into 12 bytes. */
static void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

int kiln_dequant_row(int type, const uint8_t *src, int n, float *y) {
    switch (type) {
    case GGML_F32: memcpy(y, src, (size_t)n * 4); return 0;
    case GGML_F16: for (int i = 0; i < n; i++) y[i] = kiln_half_to_float(rd16(src + 2 * i)); return 0;
    case GGML_BF16: for (int i = 0; i < n; i++) y[i] = bf16_to_float(rd16(src + 2 * i)); return 0;
    case GGML_Q4_0:
        for (int b = 0; b < n / 32; b++, src += 18, y += 32) {
            float d = kiln_half_to_float(rd16(src));
            for (int j = 0; j < 16; j++) {
                y[j] = ((src[2 + j] & 0xF) - 8) * d;
                y[j + 16] = ((src[2 + j] >> 4) - 8) * d;
            }
        }
        return 0;
    case GGML_Q4_1:
        for (int b = 0; b < n / 32; b++, src += 20, y += 32) {
            float d = kiln_half_to_float(rd16(src)), m = kiln_half_to_float(rd16(src + 2));
            for (int j = 0; j < 16; j++) {
                y[j] = (src[4 + j] & 0xF) * d + m;
                y[j + 16] = (src[4 + j] >> 4) * d + m;
            }
        }
        return 0;
    case GGML_Q5_0:
        for (int b = 0; b < n / 32; b++, src += 22, y += 32) {
            float d = kiln_half_to_float(rd16(src));
            uint32_t qh = src[2] | (src[3] << 8) | (src[4] << 16) | ((uint32_t)src[5] << 24);
            for (int j = 0; j < 16; j++) {
                int lo = (src[6 + j] & 0xF) | (((qh >> j) & 1) << 4);
                int hi = (src[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
                y[j] = (lo - 16) * d;
                y[j + 16] = (hi - 16) * d;
            }
        }
        return 0;
    case GGML_Q8_0:
        for (int b = 0; b < n / 32; b++, src += 34, y += 32) {
            float d = kiln_half_to_float(rd16(src));
            for (int j = 0; j < 32; j++) y[j] = (int8_t)src[2 + j] * d;
        }
        return 0;
    case GGML_Q4_K:
        for (int b = 0; b < n / 256; b++, src += 144) {
            float d = kiln_half_to_float(rd16(src)), dmin = kiln_half_to_float(rd16(src + 2));
            const uint8_t *scales = src + 4, *q = src + 16;
            for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
                int sc, m;
                scale_min_k4(is, scales, &sc, &m);
                float d1 = d * sc, m1 = dmin * m;
                scale_min_k4(is + 1, scales, &sc, &m);
                float d2 = d * sc, m2 = dmin * m;
                for (int l = 0; l < 32; l++) *y++ = d1 * (q[l] & 0xF) - m1;
                for (int l = 0; l < 32; l++) *y++ = d2 * (q[l] >> 4) - m2;
            }
        }
        return 0;
    case GGML_Q5_K:
        for (int b = 0; b < n / 256; b++, src += 176) {
            float d = kiln_half_to_float(rd16(src)), dmin = kiln_half_to_float(rd16(src + 2));
            const uint8_t *scales = src + 4, *qh = src + 16, *ql = src + 48;
            uint8_t u1 = 1, u2 = 2;
            for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
                int sc, m;
                scale_min_k4(is, scales, &sc, &m);
                float d1 = d * sc, m1 = dmin * m;
                scale_min_k4(is + 1, scales, &sc, &m);
                float d2 = d * sc, m2 = dmin * m;
                for (int l = 0; l < 32; l++) *y++ = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
                for (int l = 0; l < 32; l++) *y++ = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
            }
        }
        return 0;
    case GGML_Q6_K:
        for (int b = 0; b < n / 256; b++, src += 210) {
            const uint8_t *ql = src, *qh = src + 128;
            const int8_t *sc = (const int8_t *)(src + 192);
            float d = kiln_half_to_float(rd16(src + 208));
            for (int half = 0; half < 2; half++, y += 128, ql += 64, qh += 32, sc += 8) {
                for (int l = 0; l < 32; l++) {
                    int is = l / 16;
                    int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    y[l] = d * sc[is] * q1;
                    y[l + 32] = d * sc[is + 2] * q2;
                    y[l + 64] = d * sc[is + 4] * q3;
                    y[l + 96] = d * sc[is + 6] * q4;
                }
            }
        }
        return 0;
    case GGML_MXFP4:
        for (int b = 0; b < n / 32; b++, src += 17, y += 32) {
            float d = kiln_e8m0_half(src[0]);
            for (int j = 0; j < 16; j++) {
                y[j] = kiln_mxfp4_values[src[1 + j] & 0xF] * d;
                y[j + 16] = kiln_mxfp4_values[src[1 + j] >> 4] * d;
            }
        }
        return 0;
    default: return -1;
    }
}
