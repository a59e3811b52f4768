/* The activation layouts (kernels.h, "Activations"): which one a weight format consumes and its bytes
 * per token. The kernels of every ISA, their dispatcher (cpu.c) and the plan read them; none owns them. */
#pragma once
#include <stddef.h>

#include "kernels.h"

static inline int kiln_act_kind(kiln_wfmt f) { return kiln_fmt_is_float(f) ? KILN_ACT_F32 : KILN_ACT_Q8; }

/* bytes per token */
static inline size_t kiln_act_stride(kiln_wfmt f, int cols) {
    if (kiln_act_kind(f) == KILN_ACT_F32) return (size_t)(cols + KILN_FCHUNK - 1) / KILN_FCHUNK * KILN_FCHUNK * 4;
    return (size_t)(cols + KILN_GROUP - 1) / KILN_GROUP * KILN_AG_BYTES;
}

static inline size_t kiln_act_size(kiln_wfmt f, int cols, int n_tok) { return kiln_act_stride(f, cols) * n_tok; }
