/* MXFP4's AVX2 pieces, shared by kern_avx2.c and kern_avx512.c (each includes it under its own target
   pragma, after defining ALWAYS): nibbles -> kv + 12 (kernels.h) by one byte shuffle per register, and 8
   e8m0 block scales. */
#ifndef KILN_MXFP4_AVX2_H
#define KILN_MXFP4_AVX2_H

ALWAYS __m256i mxfp4_table(void) {
    return _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
}
/* 2^(e-128) as (2^(e-127), from the exponent bits) / 2, exact down to e = 1 (2^-127, subnormal); e = 0 reads
   as zero and the maximum makes it 2^-128. */
ALWAYS __m256 e8m0x8(const uint8_t *h) {
    __m256 twice = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)h)), 23));
    return _mm256_max_ps(_mm256_mul_ps(twice, _mm256_set1_ps(0.5f)), _mm256_castsi256_ps(_mm256_set1_epi32(0x00200000)));
}
/* 12 * sum32 (KILN_MXFP4_OFFSET) in two shifts and an add, cheaper than a 32-bit multiply. */
ALWAYS __m256i times12(__m256i v) { return _mm256_add_epi32(_mm256_slli_epi32(v, 3), _mm256_slli_epi32(v, 2)); }

#endif
