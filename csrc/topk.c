/* The k largest logits, for sampling: one pass with a k-entry min-heap. Blocks of 16 logits that
 * hold nothing above the heap's smallest entry are skipped with one vectorizable test, so most of a
 * 10^5-token vocabulary costs a fraction of a comparison each. */
#include "bindings.h"

#include <math.h>
#include <stdint.h>

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

static inline void offer(entry *h, int k, const float *x, int i) {
    entry e = {x[i], i};
    if (below(h[0], e)) h[0] = e, sift_down(h, k, 0);
}

/* Indices of the k largest of x[0..n), largest first (ties: lower index first); NaN never wins. */
static void topk(const float *x, int n, int k, int32_t *out, entry *h) {
    for (int i = 0; i < k; i++) h[i] = (entry){x[i] == x[i] ? x[i] : -INFINITY, i};
    for (int i = k / 2 - 1; i >= 0; i--) sift_down(h, k, i);
    int i = k;
    for (; i < n && i % BLOCK; i++) offer(h, k, x, i);
    for (; i + BLOCK <= n; i += BLOCK) {
        /* a later index loses ties, so only values above the smallest entry can enter */
        float floor = h[0].v;
        int any = 0;
        for (int j = 0; j < BLOCK; j++) any |= x[i + j] > floor;
        if (any)
            for (int j = 0; j < BLOCK; j++) offer(h, k, x, i + j);
    }
    for (; i < n; i++) offer(h, k, x, i);
    for (int end = k - 1; end >= 0; end--) { /* heap-sort: pop the smallest to the back */
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
    if (out && heap) /* tens of microseconds: keeping the GIL beats waiting up to a switch interval to get it back */
        topk(buf.buf, n, k, (int32_t *)PyBytes_AS_STRING(out), heap);
    else {
        Py_CLEAR(out);
        PyErr_NoMemory();
    }
    PyMem_Free(heap);
    PyBuffer_Release(&buf);
    return out;
}

PyMethodDef sample_methods[] = {
    {"topk", py_topk, METH_VARARGS, "topk(float32 buffer, k) -> int32 indices of the k largest, largest first"},
    {NULL}};
