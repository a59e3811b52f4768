/* GGUF tensor rows to float, and the half-precision conversions the core uses. */
#pragma once
#include <stdint.h>

enum {
    GGML_F32 = 0, GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q8_0 = 8,
    GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_BF16 = 30, GGML_MXFP4 = 39,
};

float kiln_half_to_float(uint16_t h);
uint16_t kiln_float_to_half(float f); /* round to nearest even, like F16C's vcvtps2ph */

/* Dequantize n values (a whole number of the type's blocks) stored in GGUF layout; -1 if unsupported. */
int kiln_dequant_row(int ggml_type, const uint8_t *src, int n, float *y);
