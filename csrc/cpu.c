/* Instruction-set detection and forcing, kernel dispatch, huge-page buffers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels.h"

#if KILN_X86
#include <cpuid.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (uint64_t)hi << 32 | lo;
}

/* Linux keeps the AMX tile data (8 KiB a thread) out of a process's signal frames until it asks:
   permission is process-wide and requested once; every thread then loads its own tile configuration. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static int amx_granted;
static void amx_request(void) { amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }
#endif

const char *kiln_isa_missing(kiln_isa isa) {
    if (isa == ISA_GENERIC) return NULL;
#if KILN_X86
    unsigned a, b, c, d, b7 = 0, c7 = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return "cpuid";
    unsigned d7 = 0;
    if (__get_cpuid_max(0, NULL) >= 7) __cpuid_count(7, 0, a, b7, c7, d7);
    if (!(c & bit_AVX)) return "avx";
    if (!(b7 & bit_AVX2)) return "avx2";
    if (!(c & bit_FMA)) return "fma";
    if (!(c & bit_F16C)) return "f16c";
    if (!(c & bit_OSXSAVE) || (xgetbv0() & 6) != 6) return "OS support for avx (xsave of ymm state)";
    if (isa == ISA_AVX2) return NULL;
    if (!(b7 & bit_AVX512F)) return "avx512f";
    if (!(b7 & bit_AVX512BW)) return "avx512bw";
    if (!(b7 & bit_AVX512VL)) return "avx512vl";
    if (!(b7 & bit_AVX512DQ)) return "avx512dq";
    if (!(c7 & bit_AVX512VNNI)) return "avx512vnni";
    if ((xgetbv0() & 0xe6) != 0xe6) return "OS support for avx512 (xsave of zmm state)";
    if (isa == ISA_AVX512) return NULL;
    if (!(d7 & (1u << 24))) return "amx-tile";
    if (!(d7 & (1u << 25))) return "amx-int8";
    if (!(d7 & (1u << 22))) return "amx-bf16";
    unsigned a71 = 0, b71, c71, d71;
    __cpuid_count(7, 1, a71, b71, c71, d71);
    if (!(a71 & (1u << 5))) return "avx512bf16";
    if ((xgetbv0() & 0x60000) != 0x60000) return "OS support for amx (xsave of tile state)";
    pthread_once(&amx_once, amx_request);
    if (!amx_granted) return "OS permission for amx tile data (arch_prctl ARCH_REQ_XCOMP_PERM denied)";
    return NULL;
#else
    return isa == ISA_AVX2 ? "avx2 (not an x86 CPU)" : isa == ISA_AVX512 ? "avx512 (not an x86 CPU)" : "amx (not an x86 CPU)";
#endif
}

kiln_isa kiln_detect_isa(void) {
    for (int isa = ISA_AMX; isa > ISA_GENERIC; isa--)
        if (!kiln_isa_missing((kiln_isa)isa)) return (kiln_isa)isa;
    return ISA_GENERIC;
}

static const char *const ISA_NAMES[] = {"generic", "avx2", "avx512", "amx"};

const char *kiln_isa_name(kiln_isa isa) { return ISA_NAMES[isa]; }

/* -1 until first use; every thread that races the first use computes the same value. */
static int active = -1;
static char env_error[128];

kiln_isa kiln_active_isa(void) {
    if (active >= 0) return (kiln_isa)active;
    kiln_isa isa = kiln_detect_isa();
    const char *env = getenv("KILN_ISA");
    if (env && *env) {
        int want = -1;
        for (int i = ISA_GENERIC; i <= ISA_AMX; i++)
            if (!strcmp(env, ISA_NAMES[i])) want = i;
        const char *missing = want >= 0 ? kiln_isa_missing((kiln_isa)want) : NULL;
        if (want < 0)
            snprintf(env_error, sizeof env_error, "KILN_ISA=%.40s: expected generic, avx2, avx512 or amx", env);
        else if (missing)
            snprintf(env_error, sizeof env_error, "KILN_ISA=%s: CPU lacks %s", env, missing);
        else
            isa = (kiln_isa)want;
    }
    active = isa;
    return isa;
}

const char *kiln_isa_error(void) {
    kiln_active_isa();
    return env_error[0] ? env_error : NULL;
}

int kiln_force_isa(kiln_isa isa) {
    if (kiln_isa_missing(isa)) return -1;
    active = isa;
    env_error[0] = 0; /* an explicit choice supersedes KILN_ISA */
    return 0;
}

/* ---- activations ---- */

void kiln_quantize_act(kiln_wfmt f, const float *x, int ldx, int cols, int n_tok, void *act) {
#if KILN_X86
    if (kiln_active_isa() != ISA_GENERIC) {
        kiln_quantize_act_avx2(f, x, ldx, cols, n_tok, act);
        return;
    }
#endif
    kiln_quantize_act_generic(f, x, ldx, cols, n_tok, act);
}

void kiln_quantize_act_pair(kiln_wfmt f, const float *x, int cols, void *first, void *second, float *residual) {
#if KILN_X86
    if (kiln_active_isa() != ISA_GENERIC) {
        kiln_quantize_act_pair_avx2(f, x, cols, first, second, residual);
        return;
    }
#endif
    kiln_quantize_act_pair_generic(f, x, cols, first, second, residual);
}

void kiln_matmul(const kiln_wmat *w, const void *act, int n_tok, float *y, int ldy, int tile0, int tile1) {
    switch (kiln_active_isa()) {
#if KILN_X86
    case ISA_AMX:
        if (n_tok >= KILN_AMX_MIN_TOKENS && !kiln_fmt_is_float(w->fmt)) {
            kiln_matmul_amx(w, act, n_tok, y, ldy, tile0, tile1);
            return;
        }
        kiln_matmul_avx512(w, act, n_tok, y, ldy, tile0, tile1);
        return;
    case ISA_AVX512: kiln_matmul_avx512(w, act, n_tok, y, ldy, tile0, tile1); return;
    case ISA_AVX2: kiln_matmul_avx2(w, act, n_tok, y, ldy, tile0, tile1); return;
#endif
    default: kiln_matmul_generic(w, act, n_tok, y, ldy, tile0, tile1);
    }
}

/* ---- memory ---- */

#define HUGE_PAGE ((size_t)2 << 20)

void *kiln_alloc_huge(size_t size) {
    void *p = NULL;
    size_t n = (size + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    if (!n || posix_memalign(&p, HUGE_PAGE, n)) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, n, MADV_HUGEPAGE); /* advice only: without THP the buffer still works */
#endif
    return p;
}

void kiln_free_huge(void *p) { free(p); }

uint64_t kiln_mem_read(const void *p, size_t size) {
#if KILN_X86
    /* The widest loads the CPU has: compiled for baseline x86-64 (16-byte loads), the same loop read
       ~10% slower than 32-byte loads on an AVX2 machine, which would flatter every ratio against it. */
    if (kiln_active_isa() >= ISA_AVX2) return kiln_mem_read_avx2(p, size);
#endif
    /* Four independent xor chains over 8-byte words: the compiler vectorises this into wide loads. */
    const uint64_t *w = (const uint64_t *)p;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    size_t n = size / 32;
    for (size_t i = 0; i < n; i++) {
        a ^= w[4 * i];
        b ^= w[4 * i + 1];
        c ^= w[4 * i + 2];
        d ^= w[4 * i + 3];
    }
    for (size_t i = 4 * n; i < size / 8; i++) a ^= w[i];
    return a ^ b ^ c ^ d;
}
