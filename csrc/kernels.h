/* Weight repacking and quantized matrix-vector / matrix-matrix kernels.

   GGUF stores each row's blocks one after another. kiln repacks them once into kernel formats where
   4 rows are interleaved ("a tile"), each block's scales sit next to its quants, and one worker reads
   one sequential stream of memory. Kernels exist per instruction set (generic C, AVX2, AVX-512 VNNI, AMX);
   all read the same packed bytes, so a repack cache does not depend on the CPU, and all produce
   bit-identical results: integer dot products are exact, and the float steps (one fused multiply-add
   per block into 8 lanes, then a fixed reduction tree) are the same sequence in every variant. A
   token's result does not depend on how many tokens share the call either.

   ---- Tiles --------------------------------------------------------------------------------------
   rows_padded = rows rounded up to 4; padding rows are zero. Tile i (rows 4i..4i+3) is tile_bytes
   long at data + i*tile_bytes. kiln_pack_size() is the tiles plus KILN_PACK_SLACK bytes that the
   kernels may read past the last tile (never use): keep it when placing packed data elsewhere.

   ---- Integer formats: groups of 8 blocks of 32 weights (256 weights) -------------------------------
   A tile is cols/256 full groups, then (cols%256 != 0) one short group of nb = (cols%256)/32 blocks.
   A group is [H_0 H_1 H_2 H_3][Q_0 Q_1 Q_2 Q_3]: the 4 rows' headers, then the 4 rows' quants.
   Shared tail: a short group of nb = 2 (576 = 2*256 + 64 columns, SmolLM2's width) is instead laid out
   as one row's full group of 8 blocks, block 2r+j being block j of row r, so one full-width dot serves
   all 4 rows (8 lanes busy instead of 2 of 8 for each row); the activation group of such a tail repeats
   blocks 0 and 1 in every lane pair (see below). Row r adds lanes 2r and 2r+1 after its 8-lane sum:
   out_r = reduce(acc_r) + (tail[2r] + tail[2r+1]), tail accumulated from zero. Same bytes per tile.

   Lane order. Inside a group, weights are stored "lane per block": chunk k (k = 0..7) holds weights
   4k..4k+3 of every block, block j at bytes 4j..4j+3. So weight i of block j sits at chunk i/4,
   byte 4j + i%4, and a 32-bit SIMD lane j sees only block j: maddubs / madd (or vpdpbusd) leave one
   block sum per lane, and one convert + one FMA per 8 blocks applies a vector of scales. A chunk is
   4*nb bytes (32 in a full group). Chunks 0..3 hold weights 0..15 of each block and chunks 4..7
   weights 16..31, which is what Q6_K's 16-weight sub-blocks need.

   Nibbles (4-bit fields): "slot" L (L = 0..3) is 4*nb bytes; its low nibbles are chunk L and its
   high nibbles chunk L+4. One 32-byte load gives two chunks with one shift; a 64-byte load (AVX-512)
   gives chunks L, L+1 (low) and L+4, L+5 (high), matching two consecutive activation chunks.
   High bits (Q5_0, Q5_K): 4*nb bytes; bit k of byte b is the 5th bit of byte b of chunk k.
   Two high bits (Q6_K): 2 x 32 bytes; in half h (chunks 4h..4h+3) bits 2m..2m+1 of byte b are the
   high bits of byte b of chunk 4h+m.

   Per row, in a group of nb blocks (all d/m fp16, one per block, in block order):
     KF_Q4_0 (Q4_0)  H: d[nb]            Q: nibbles 16nb            w = d*(q-8)        18 B/block
     KF_Q4_1 (Q4_1)  H: d[nb] m[nb]      Q: nibbles 16nb            w = d*q + m        20 B/block
     KF_Q5_0 (Q5_0)  H: d[nb]            Q: nibbles 16nb, high 4nb  w = d*(q-16)       22 B/block
     KF_Q8_0 (Q8_0)  H: d[nb]            Q: int8 32nb (chunks)      w = d*q            34 B/block
   K-quants (cols % 256 == 0; a group is one super-block of 256):
     KF_Q4_K (Q4_K)  H: d, dmin, sc[8] u8, m[8] u8 (20 B)    Q: nibbles 128            148 B/256
                     w = d*sc_j*q - dmin*m_j for 32-weight sub-block j (6-bit fields decoded at pack)
     KF_Q5_K (Q5_K)  H: as Q4_K                              Q: nibbles 128, high 32   180 B/256
     KF_Q6_K (Q6_K)  H: d, sc[16] int8 (18 B)                Q: nibbles 128, high 64   210 B/256
                     w = d*sc_s*(q-32), q 6-bit, s = 16-weight sub-block (2j: chunks 0-3, 2j+1: 4-7)
   Microscaling FP4 (blocks of 32, grouped as above):
     KF_MXFP4 (MXFP4) H: e[nb] u8 (the e8m0 exponent)  Q: nibbles 16nb   w = 2^(e-128) * kv[q]   17 B/block
                     kv = e2m1 values doubled (0, 1, 2, 3, 4, 6, 8, 12, then the same negated); the kernels read
                     kv[q] + 12 (0..24, unsigned as vpmaddubsw / vpdpbusd want it) through a byte shuffle and
                     subtract 12 * sum32, as Q4_0 subtracts 8 * sum32; the 5-bit formats' i16 budget holds it.

   ---- Float formats ---------------------------------------------------------------------------------
   KF_F32 / KF_F16 / KF_BF16: columns padded with zeros to a multiple of 16; the tile is chunks of 16
   columns, each chunk 4 rows x 16 values. Activations are fp32.

   ---- Activations ---------------------------------------------------------------------------------------
   kiln_act_kind(fmt) names the layout a format consumes; formats of one kind share an activation
   buffer (quantize once, reuse it for q, k and v). kiln_act_size(fmt, cols, n) = n * stride.
     KILN_ACT_F32: per token, cols fp32 padded with zeros to a multiple of 16.
     KILN_ACT_Q8 (every integer format): per token, ceil(cols/256) groups of 384 bytes:
        qs[256] int8 in the lane order above | d[8] f32 | s[8] f32 = d*sum32 | sum32[8] i32 |
        sum16[16] i16 (sums of each block's two 16-halves, so 32-bit lane j = block j's pair).
        q = round-to-nearest-even(x * (1/d)) with d = max|x|/127 over each block of 32. A short last
        group is padded with zero blocks; when it has nb = 1, 3 or 4 blocks its quants are stored in
        "pair" order instead: bytes 32L..32L+15 hold chunk L and bytes 32L+16..32L+31 chunk L+4 (L = 0..3,
        4 lanes each), so one 32-byte load meets one nibble slot and short tails cost half a group.
        With nb = 2 (a shared tail) lanes 2..7 repeat lanes 0 and 1 (quants, d, s and sums alike): lane
        l holds block l%2, in the order of a full group.
   Activation sums let affine and offset formats fold their minimum in once per block: Q4_1 adds
   m * s, Q4_0/Q5_0 subtract 8/16 * sum32 in the integer sum, Q6_K subtracts 32 * sc . sum16.
*/
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* ISA_AMX is AVX-512 with the AMX-INT8 tiles for many-token integer matmuls (kern_amx.c). */
typedef enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AMX = 3 } kiln_isa;
/* Repack caches store these values: a new format takes the next one. */
typedef enum { KF_F32, KF_F16, KF_BF16, KF_Q4_1, KF_Q4_K, KF_Q5_0, KF_Q5_K, KF_Q8_0, KF_Q6_K, KF_Q4_0, KF_MXFP4, KF_COUNT } kiln_wfmt;
typedef enum { KILN_ACT_F32 = 0, KILN_ACT_Q8 = 1 } kiln_act_kind_t;
typedef struct {
    kiln_wfmt fmt;
    int rows, cols, rows_padded;
    size_t tile_bytes;
    const uint8_t *data;
} kiln_wmat;

/* ---- ISA (cpu.c) ---- */
kiln_isa kiln_detect_isa(void); /* best the CPU supports */
/* Detected, or forced by env KILN_ISA=generic|avx2|avx512|amx or kiln_force_isa(). An unusable KILN_ISA
   leaves the detected ISA active and kiln_isa_error() says why. */
kiln_isa kiln_active_isa(void);
int kiln_force_isa(kiln_isa isa);          /* 0, or -1 if the CPU lacks it */
const char *kiln_isa_missing(kiln_isa isa); /* NULL if supported, else the first missing feature */
const char *kiln_isa_error(void);           /* NULL, or why KILN_ISA could not be honoured */
const char *kiln_isa_name(kiln_isa isa);

/* ---- Packing (pack.c) ---- */
#define KILN_TILE_ROWS 4
#define KILN_PACK_SLACK 64
int kiln_wfmt_for_ggml(int ggml_type); /* -1 if unsupported */
size_t kiln_pack_size(int ggml_type, int rows, int cols); /* 0 if the type or shape is unsupported */
size_t kiln_ggml_row_bytes(int ggml_type, int cols);      /* GGUF bytes of one row; 0 if unsupported */
size_t kiln_tile_bytes(kiln_wfmt fmt, int cols);          /* bytes of one tile; 0 if the shape is invalid */
/* src: GGUF bytes, row-major. dst: kiln_pack_size bytes. Returns 0, or -1 for a bad type/shape. */
int kiln_pack(int ggml_type, const uint8_t *src, int rows, int cols, uint8_t *dst, kiln_wmat *out);

/* Row `row` of a packed matrix back to its GGUF bytes (kiln_ggml_row_bytes of them), exactly as packed;
   -1 for a bad row. Lets a table the output head shares be looked up without a second copy. */
int kiln_unpack_row(const kiln_wmat *w, int row, uint8_t *dst);

/* A Q8_0 matrix split in two (the output head, see op_logits.c): each weight q = 8*(q >> 3) + (q & 7), its top
   5 bits a Q5_0 block with scale 8d (`hi`, 22 bytes a block) and its low 3 bits a Q4_0 block with scale d
   (`lo`, 18 bytes, stored as (q & 7) + 8). Both are GGUF bytes, for kiln_pack. -1 if some 8d overflows fp16. */
int kiln_split_q8_0(const uint8_t *src, size_t n_blocks, uint8_t *hi, uint8_t *lo);
/* Row `row` of such a pair, packed, back to its Q8_0 bytes; `work` holds cols/32 * 40 bytes. -1 if the pair
   is not one. */
int kiln_unpack_split_row(const kiln_wmat *hi, const kiln_wmat *lo, int row, uint8_t *dst, uint8_t *work);

/* ---- Activations and matmul (dispatch in cpu.c; the activation layouts are act.h's) ---- */
void kiln_quantize_act(kiln_wfmt fmt, const float *x, int ldx, int cols, int n_tok, void *act);
/* A precise pair for one token of an integer format: `first` = x quantized (as kiln_quantize_act), and
   `second` = the residual x - value(first) quantized, with value = (float)q * d rounded, then subtracted
   and rounded (two roundings in every ISA). `residual` is scratch of cols floats. */
void kiln_quantize_act_pair(kiln_wfmt fmt, const float *x, int cols, void *first, void *second, float *residual);
/* y[t*ldy + r] = dot(row r of w, activation t) for rows r in [tile0*4, min(tile1*4, rows)), t < n_tok.
   Safe from several threads on disjoint tile ranges, allocates nothing, deterministic. */
void kiln_matmul(const kiln_wmat *w, const void *act, int n_tok, float *y, int ldy, int tile0, int tile1);

/* ---- Int8 dot-product peaks (peaks.c, for validate and bench) ---- */
typedef enum { PEAK_AVX2, PEAK_AVX512_VNNI, PEAK_AVX_VNNI, PEAK_AMX, PEAK_UNITS } kiln_peak_unit;
const char *kiln_peak_missing(kiln_peak_unit unit); /* NULL if the CPU (and OS) has the unit */
const char *kiln_peak_name(kiln_peak_unit unit);
/* Multiply-accumulates per second (1e9) of one core, the best of `passes` runs of `iters` iterations; 0 if
   the unit is missing. */
double kiln_peak_gmacs(kiln_peak_unit unit, int passes, long iters);

/* ---- Memory (cpu.c) ---- */
void *kiln_alloc_huge(size_t size); /* 2 MiB-aligned, transparent huge pages advised; NULL on failure */
void kiln_free_huge(void *p);
uint64_t kiln_mem_read(const void *p, size_t size); /* reads every byte once (bandwidth reference) */

/* ---- Internal: shared by the kernel files ---- */
#define KILN_GROUP 256           /* weights per group / super-block */
/* Bytes ahead of the group being computed that the SIMD kernels prefetch: the hardware prefetcher alone
   leaves a streaming GEMV short of a plain read of the same memory (docs/PERF.md, "Prefetch"). A hint:
   it never faults. */
#define KILN_PREFETCH 1024
/* A precise activation's pair of rows spends twice the arithmetic on each byte: the weights are then
   fetched further ahead (docs/PERF.md, "Prefetch"). */
#define KILN_PREFETCH_PAIR 4096
/* How far ahead a kernel called for n_tok tokens fetches its weights. */
#define KILN_PREFETCH_AHEAD(n_tok) ((n_tok) == 2 ? KILN_PREFETCH_PAIR : KILN_PREFETCH)
/* Bytes ahead that a kernel called for more than two tokens also fetches into L2, on its first pass over a
   chunk's weights (token block t0 == 0): fetched into L1 from close by only, weights streamed from DRAM arrive
   too late for a step that spends that much longer on each group (docs/PERF.md, "Prefetch"). */
#define KILN_PREFETCH_FAR 16384
#define KILN_PREFETCH_FAR_FOR(t0, n_tok) ((t0) == 0 && (n_tok) > 2)
/* The SIMD kernels' fetches for the weight group of `bytes` at p: `ahead` bytes ahead into L1, and with `far`
   KILN_PREFETCH_FAR ahead into L2. A macro, so each fetch is an _mm_prefetch in the kernel's own code. */
#define KILN_PREFETCH_GROUP(p, bytes, ahead, far)                                                             \
    do {                                                                                                     \
        for (int o_ = 0; o_ < (bytes); o_ += 64) _mm_prefetch((const char *)(p) + (ahead) + o_, _MM_HINT_T0); \
        if (far)                                                                                             \
            for (int o_ = 0; o_ < (bytes); o_ += 64) _mm_prefetch((const char *)(p) + KILN_PREFETCH_FAR + o_, _MM_HINT_T1); \
    } while (0)
#define KILN_FCHUNK 16           /* columns per chunk of the float formats */
#define KILN_AG_BYTES 384        /* one activation group */
#define KILN_AG_D 256            /* offsets inside an activation group */
#define KILN_AG_S 288
#define KILN_AG_SUM32 320
#define KILN_AG_SUM16 352

static inline int kiln_fmt_is_float(kiln_wfmt f) { return f == KF_F32 || f == KF_F16 || f == KF_BF16; }
static inline int kiln_fmt_elem_bytes(kiln_wfmt f) { return f == KF_F32 ? 4 : 2; } /* float formats */

/* Blocks of 32 in group g of a row of `cols` (8, or fewer in a short last group). */
static inline int kiln_group_blocks(int cols, int g) {
    int left = (cols - g * KILN_GROUP) / 32;
    return left < 8 ? left : 8;
}

/* A short group of 2 blocks is packed as a shared tail (see "Shared tail"). */
static inline int kiln_shared_tail(int nb) { return nb == 2; }

/* Byte of activation i of block j in an activation group holding nb blocks (see "pair" order). */
static inline int kiln_act_byte(int nb, int j, int i) {
    int k = i >> 2;
    return nb > 4 || kiln_shared_tail(nb) ? 32 * k + 4 * j + (i & 3) : 32 * (k & 3) + 16 * (k >> 2) + 4 * j + (i & 3);
}

/* Fill lanes 2..7 of a shared tail's activation group with copies of lanes 0 and 1. */
static inline void kiln_repeat_tail_lanes(uint8_t *ag) {
    for (int k = 0; k < 8; k++)
        for (int l = 2; l < 8; l++) memcpy(ag + 32 * k + 4 * l, ag + 32 * k + 4 * (l & 1), 4);
    for (int off = KILN_AG_D; off < KILN_AG_BYTES; off += 32) /* d, s, sum32, sum16: 4 bytes per lane */
        for (int l = 2; l < 8; l++) memcpy(ag + off + 4 * l, ag + off + 4 * (l & 1), 4);
}

/* Bytes per row of one group of nb blocks (K-quants: nb = 8), split into header and quants. */
static inline int kiln_fmt_head_bytes(kiln_wfmt f, int nb) {
    switch (f) {
    case KF_Q4_1: return 4 * nb;
    case KF_Q4_0: case KF_Q5_0: case KF_Q8_0: return 2 * nb;
    case KF_Q4_K: case KF_Q5_K: return 20;
    case KF_Q6_K: return 18;
    case KF_MXFP4: return nb;
    default: return 0;
    }
}
static inline int kiln_fmt_quant_bytes(kiln_wfmt f, int nb) {
    switch (f) {
    case KF_Q4_1: case KF_Q4_0: case KF_Q4_K: case KF_MXFP4: return 16 * nb;
    case KF_Q5_0: case KF_Q5_K: return 20 * nb;
    case KF_Q8_0: return 32 * nb;
    case KF_Q6_K: return 24 * nb;
    default: return 0;
    }
}

static inline float kiln_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f)
        bits = sign | 0x7f800000u | (man << 13); /* inf / nan */
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man)
        bits = sign;
    else { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    union { uint32_t u; float f; } v = {bits};
    return v.f;
}

/* MXFP4: the e2m1 values doubled (ggml's kvalues_mxfp4), plus the offset that makes them unsigned, and the
   block scale 2^(e-128) that halves them back (ggml's e8m0_to_fp32_half: e < 2 is subnormal). */
#define KILN_MXFP4_OFFSET 12 /* the SIMD kernels subtract it as 8x + 4x (times12) */
static const int8_t kiln_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline float kiln_e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

void kiln_matmul_generic(const kiln_wmat *w, const void *act, int n_tok, float *y, int ldy, int tile0, int tile1);
void kiln_quantize_act_generic(kiln_wfmt fmt, const float *x, int ldx, int cols, int n_tok, void *act);
void kiln_quantize_act_pair_generic(kiln_wfmt fmt, const float *x, int cols, void *first, void *second, float *residual);
#if KILN_X86
void kiln_matmul_avx2(const kiln_wmat *w, const void *act, int n_tok, float *y, int ldy, int tile0, int tile1);
void kiln_quantize_act_avx2(kiln_wfmt fmt, const float *x, int ldx, int cols, int n_tok, void *act);
void kiln_quantize_act_pair_avx2(kiln_wfmt fmt, const float *x, int cols, void *first, void *second, float *residual);
uint64_t kiln_mem_read_avx2(const void *p, size_t size);
void kiln_block_maxima_avx2(const float *x, int blocks, float *best); /* top-k's pass over blocks of 16 */
void kiln_matmul_avx512(const kiln_wmat *w, const void *act, int n_tok, float *y, int ldy, int tile0, int tile1);
/* From this many tokens an integer matmul runs on AMX tiles (a call unpacks its weights once for all
   of them); fewer go to the AVX-512 kernel. Either gives the same bits. */
#define KILN_AMX_MIN_TOKENS 64
void kiln_matmul_amx(const kiln_wmat *w, const void *act, int n_tok, float *y, int ldy, int tile0, int tile1);
/* Prefill on AMX (kern_amx.c, "BF16 tiles"): an op's Q8 activations of n_tok tokens as bf16 tiles, laid out
   once for all its chunks (`paired`: precise pairs, see ops.h, summed into one row a token), in
   kiln_bf16_tiles_bytes; then kiln_matmul's contract for the integer formats on those tiles, a precise
   pair's outputs already folded. Not the other variants' bits (bf16 products). -1: no memory or a format
   without the path, nothing written. */
size_t kiln_bf16_tiles_bytes(int cols, int n_tok);
int kiln_bf16_tiles(kiln_wfmt fmt, const void *act, int cols, int n_tok, int paired, uint16_t *dst);
int kiln_matmul_bf16(const kiln_wmat *w, const uint16_t *tiles, int n_tok, float *y, int ldy, int tile0, int tile1);
#endif
