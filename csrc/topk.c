/* The k largest logits, for sampling. Every block of 16 logits gets its maximum (one vector pass);
 * the k-th largest of those maxima is a floor the k-th largest logit cannot be below, so only the
 * blocks reaching it — k of them, give or take ties — go through a k-entry min-heap. The cost is one
 * pass plus a few hundred heap offers whatever the order of the logits (an earlier single pass with a
 * rising floor took 1.5 ms on an ascending vocabulary). */
#include "bindings.h"

#include <math.h>
#include <stdint.h>

#include "kernels.h"

typedef struct {
    float v;
    int32_t i;
} entry;

/* a is "smaller" (closer to eviction) than b: lower value, or the same value at a later index */
static int below(entry a, entry b) { return a.v < b.v || (a.v == b.v && a.i > b.i); }

static void sift_down(entry *h, int k, int at) {
    for (;;) {
        int l = 2 * at + 1, r = l + 1, m = at;
        if (l < k && below(h[l], h[m])) m = l;
        if (r < k && below(h[r], h[m])) m = r;
        if (m == at) return;
        entry t = h[at];
        h[at] = h[m], h[m] = t, at = m;
    }
}

#define BLOCK 16

/* Offer x[i]; the heap holds `*size` of k entries until it is full. NaN never enters. */
static inline void offer(entry *h, int k, int *size, const float *x, int i) {
    entry e = {x[i] == x[i] ? x[i] : -INFINITY, i};
    if (*size < k) {
        int at = (*size)++;
        h[at] = e;
        while (at && below(h[at], h[(at - 1) / 2])) { /* sift up */
            entry t = h[at];
            h[at] = h[(at - 1) / 2], h[(at - 1) / 2] = t, at = (at - 1) / 2;
        }
    } else if (below(h[0], e)) {
        h[0] = e;
        sift_down(h, k, 0);
    }
}

/* Largest of each block of 16 (NaN never wins). */
static void block_maxima(const float *x, int blocks, float *best) {
#if defined(KILN_X86)
    if (kiln_active_isa() >= ISA_AVX2) {
        kiln_block_maxima_avx2(x, blocks, best);
        return;
    }
#endif
    for (int b = 0; b < blocks; b++) {
        float m = -INFINITY;
        for (int j = 0; j < BLOCK; j++) m = x[b * BLOCK + j] > m ? x[b * BLOCK + j] : m;
        best[b] = m;
    }
}

/* The value of rank k (1 = largest) among v[0..n), by quickselect; v is reordered. */
static float kth_largest(float *v, int n, int k) {
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float pivot = v[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                float t = v[i];
                v[i++] = v[j], v[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return v[want];
    }
    return v[want];
}

/* Indices of the k largest of x[0..n), largest first (ties: lower index first); NaN never wins.
 * work: 2 * (n / 16) + 1 floats (the block maxima and a copy to select from). */
static void topk(const float *x, int n, int k, int32_t *out, entry *h, float *work) {
    int blocks = n / BLOCK, size = 0;
    float floor = -INFINITY;
    if (blocks >= k) {
        block_maxima(x, blocks, work);
        float *copy = work + blocks;
        memcpy(copy, work, sizeof(float) * blocks);
        floor = kth_largest(copy, blocks, k);
    }
    for (int b = 0; b < blocks; b++)
        if (blocks < k || work[b] >= floor)
            for (int j = 0; j < BLOCK; j++) offer(h, k, &size, x, b * BLOCK + j);
    for (int i = blocks * BLOCK; i < n; i++) offer(h, k, &size, x, i);
    for (int end = size - 1; end >= 0; end--) { /* heap-sort: pop the smallest to the back */
        out[end] = h[0].i;
        h[0] = h[end];
        sift_down(h, end, 0);
    }
}

/* topk(float32 buffer, k) -> bytes of int32 indices */
static PyObject *py_topk(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf;
    int k;
    if (!PyArg_ParseTuple(args, "y*i", &buf, &k)) return NULL;
    int n = (int)(buf.len / (Py_ssize_t)sizeof(float));
    if (k < 1 || k > n) {
        PyBuffer_Release(&buf);
        return PyErr_Format(PyExc_ValueError, "topk: k=%d outside 1..%d", k, n);
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)k * 4);
    entry *heap = PyMem_Malloc(sizeof(entry) * (size_t)k);
    float *work = PyMem_Malloc(sizeof(float) * (2 * (size_t)(n / BLOCK) + 1));
    if (out && heap && work) /* tens of microseconds: keeping the GIL beats waiting up to a switch interval to get it back */
        topk(buf.buf, n, k, (int32_t *)PyBytes_AS_STRING(out), heap, work);
    else {
        Py_CLEAR(out);
        PyErr_NoMemory();
    }
    PyMem_Free(work);
    PyMem_Free(heap);
    PyBuffer_Release(&buf);
    return out;
}

PyMethodDef sample_methods[] = {
    {"topk", py_topk, METH_VARARGS, "topk(float32 buffer, k) -> int32 indices of the k largest, largest first"},
    {NULL}};
