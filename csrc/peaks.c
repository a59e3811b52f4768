/* The int8 dot-product peak of each unit the CPU has, for `kiln validate` and `kiln bench`: a loop of
   independent accumulators with nothing but the unit's instructions (no loads), so its rate is what the
   unit does at best on one core. Written in assembly: the compiler would fold a loop of identical
   products on constant inputs. Nothing here is on the inference path. */
#include <string.h>
#include <time.h>

#include "kernels.h"

#if KILN_X86
#include <cpuid.h>

static const char *const UNIT_NAMES[] = {"avx2", "avx512_vnni", "avx_vnni", "amx"};

/* One pass of `iters` iterations; returns the multiply-accumulates it did. */
static void run_avx2(long iters) { /* vpmaddubsw (32 byte products) + vpmaddwd + vpaddd, 6 chains */
    __asm__ volatile("vpcmpeqw %%ymm15, %%ymm15, %%ymm15\n\t"
                     "vpsrlw $15, %%ymm15, %%ymm15\n\t"
                     "1:\n\t"
#define A2(t, a) "vpmaddubsw %%ymm12, %%ymm13, %%ymm" #t "\n\tvpmaddwd %%ymm15, %%ymm" #t ", %%ymm" #t "\n\tvpaddd %%ymm" #t ", %%ymm" #a ", %%ymm" #a "\n\t"
                     A2(6, 0) A2(7, 1) A2(8, 2) A2(9, 3) A2(10, 4) A2(11, 5)
#undef A2
                     "dec %0\n\tjnz 1b"
                     : "+r"(iters)
                     :
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
                       "xmm15", "cc");
}

#define V12(op, r) op r "12, " r "13, " r "0\n\t" op r "12, " r "13, " r "1\n\t" op r "12, " r "13, " r "2\n\t" \
    op r "12, " r "13, " r "3\n\t" op r "12, " r "13, " r "4\n\t" op r "12, " r "13, " r "5\n\t" \
    op r "12, " r "13, " r "6\n\t" op r "12, " r "13, " r "7\n\t" op r "12, " r "13, " r "8\n\t" \
    op r "12, " r "13, " r "9\n\t" op r "12, " r "13, " r "10\n\t" op r "12, " r "13, " r "11\n\t"

static void run_vnni512(long iters) {
    __asm__ volatile("1:\n\t" V12("vpdpbusd ", "%%zmm") "dec %0\n\tjnz 1b"
                     : "+r"(iters)
                     :
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "cc");
}

static void run_avxvnni(long iters) {
    __asm__ volatile("1:\n\t" V12("%{vex%} vpdpbusd ", "%%ymm") "dec %0\n\tjnz 1b"
                     : "+r"(iters)
                     :
                     : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "cc");
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void run_amx(long iters) { /* 4 C tiles of 16 x 16 int32, K = 64: 16384 products a tdpbssd */
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.rows[i] = 16, c.colsb[i] = 64;
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
    __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3\n\t"
                     "tilezero %%tmm4\n\ttilezero %%tmm5\n\ttilezero %%tmm6\n\ttilezero %%tmm7\n\t"
                     "1:\n\t"
                     "tdpbssd %%tmm6, %%tmm4, %%tmm0\n\ttdpbssd %%tmm7, %%tmm4, %%tmm1\n\t"
                     "tdpbssd %%tmm6, %%tmm5, %%tmm2\n\ttdpbssd %%tmm7, %%tmm5, %%tmm3\n\t"
                     "dec %0\n\tjnz 1b\n\t"
                     "tilerelease"
                     : "+r"(iters)
                     :
                     : "cc");
}

static int has_avxvnni(void) {
    unsigned a = 0, b, c, d;
    if (kiln_isa_missing(ISA_AVX2) || __get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 1, a, b, c, d);
    return (a >> 4) & 1;
}

const char *kiln_peak_missing(kiln_peak_unit unit) {
    switch (unit) {
    case PEAK_AVX2: return kiln_isa_missing(ISA_AVX2);
    case PEAK_AVX512_VNNI: return kiln_isa_missing(ISA_AVX512);
    case PEAK_AVX_VNNI: return has_avxvnni() ? NULL : "avx-vnni";
    case PEAK_AMX: return kiln_isa_missing(ISA_AMX);
    default: return "an unknown unit";
    }
}

const char *kiln_peak_name(kiln_peak_unit unit) { return unit >= 0 && unit < PEAK_UNITS ? UNIT_NAMES[unit] : "unknown"; }

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

double kiln_peak_gmacs(kiln_peak_unit unit, int passes, long iters) {
    if (kiln_peak_missing(unit) || passes < 1 || iters < 1) return 0;
    /* multiply-accumulates an iteration: 12 accumulators of 16 or 8 lanes x 4 bytes; AVX2's 6 vpmaddubsw of
       32 byte products; AMX's 4 tile products of 16 x 16 x 64 */
    const double per_iter[] = {6 * 32, 12 * 64, 12 * 32, 4 * 16384};
    double best = 0;
    for (int p = 0; p < passes; p++) { /* the best pass: a peak, not the time other tenants left over */
        double t0 = seconds_now();
        switch (unit) {
        case PEAK_AVX2: run_avx2(iters); break;
        case PEAK_AVX512_VNNI: run_vnni512(iters); break;
        case PEAK_AVX_VNNI: run_avxvnni(iters); break;
        default: run_amx(iters / 64 + 1); /* a tile product does 64-256x a vector one's work */
        }
        double dt = seconds_now() - t0, done = per_iter[unit] * (unit == PEAK_AMX ? iters / 64 + 1 : iters);
        if (dt > 0 && done / dt / 1e9 > best) best = done / dt / 1e9;
    }
    return best;
}
#else
const char *kiln_peak_missing(kiln_peak_unit unit) { (void)unit; return "not an x86 CPU"; }
const char *kiln_peak_name(kiln_peak_unit unit) { (void)unit; return "unknown"; }
double kiln_peak_gmacs(kiln_peak_unit unit, int passes, long iters) { (void)unit, (void)passes, (void)iters; return 0; }
#endif
