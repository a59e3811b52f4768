/* Sampling in one native call per row: repetition penalties, top-k, temperature, top-p, min-p and the
 * draw, the same steps and arithmetic as kiln/engine/sampler.py (the reference, and the path for
 * grammars and whole-vocabulary candidates). A step's rows can run on the engine's pool.
 *
 * The k largest logits: every block of 16 logits gets its maximum (one vector pass); the k-th largest of
 * those maxima is a floor the k-th largest logit cannot be below, so only the blocks reaching it — k of
 * them, give or take ties — go through a k-entry min-heap. The cost is one pass plus a few hundred heap
 * offers whatever the order of the logits (a single pass with a rising floor is slow on an ascending
 * vocabulary: docs/PERF.md, "Sampling, the QKV op's end, the embedding table"). */
#include "bindings.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "pool.h"

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

/* Offer value v of index i; the heap holds `*size` of k entries until it is full. NaN never enters. */
static inline void offer(entry *h, int k, int *size, float v, int i) {
    entry e = {v == v ? v : -INFINITY, i};
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

/* Values that replace a few of the row's (the penalized ones): ids ascending, distinct, < n. */
typedef struct {
    const int32_t *ids;
    const float *vals;
    int n;
} overrides;

/* The values of indices [i0, i0 + len) with the overrides from cursor *at applied, into v. */
static void apply_overrides(const float *x, int i0, int len, const overrides *o, int *at, float *v) {
    memcpy(v, x + i0, sizeof(float) * (size_t)len);
    for (; *at < o->n && o->ids[*at] < i0 + len; ++*at) v[o->ids[*at] - i0] = o->vals[*at];
}

/* The k largest of x[0..n) with `o` applied (x itself is only read), largest first (ties: lower index
 * first) with their values; NaN never wins. work: 2 * (n / 16) + 1 floats. */
static void topk(const float *x, int n, int k, const overrides *o, entry *out, entry *h, float *work) {
    int blocks = n / BLOCK, size = 0, at = 0;
    float floor = -INFINITY, v[BLOCK];
    if (blocks >= k) {
        block_maxima(x, blocks, work);
        while (at < o->n && o->ids[at] < blocks * BLOCK) { /* blocks holding an override: their maximum again */
            int b = o->ids[at] / BLOCK;
            float m = -INFINITY;
            apply_overrides(x, b * BLOCK, BLOCK, o, &at, v);
            for (int j = 0; j < BLOCK; j++) m = v[j] > m ? v[j] : m;
            work[b] = m;
        }
        float *copy = work + blocks;
        memcpy(copy, work, sizeof(float) * blocks);
        floor = kth_largest(copy, blocks, k);
    }
    at = 0;
    for (int b = 0; b < blocks; b++) {
        int hit = at < o->n && o->ids[at] < (b + 1) * BLOCK;
        const float *src = x + b * BLOCK;
        if (hit) apply_overrides(x, b * BLOCK, BLOCK, o, &at, v), src = v;
        if (blocks < k || work[b] >= floor)
            for (int j = 0; j < BLOCK; j++) offer(h, k, &size, src[j], b * BLOCK + j);
    }
    for (int i = blocks * BLOCK; i < n; i++) {
        float t;
        apply_overrides(x, i, 1, o, &at, &t);
        offer(h, k, &size, t, i);
    }
    for (int end = size - 1; end >= 0; end--) { /* heap-sort: pop the smallest to the back */
        out[end] = h[0];
        h[0] = h[end];
        sift_down(h, end, 0);
    }
}

/* ---- one row --------------------------------------------------------------------------------- */

/* Rows whose window is longer sample in Python. */
#define MAX_WINDOW KILN_SAMPLE_MAX_WINDOW

typedef struct {
    const int32_t *window; /* the tokens the penalties count (the last repeat_last_n), <= MAX_WINDOW */
    int n_window;
    int top_k;                                             /* > 0, or any when greedy */
    double temperature, top_p, min_p, presence, frequency; /* doubles where sampler.py computes in double */
    float repeat_penalty;                                  /* applied to float32 logits, as numpy does */
    double u; /* uniform in [0, 1), from the sequence's own generator */
} sample_spec;

/* A row's scratch: the candidates and their probabilities, topk's heap and block maxima, the window's
 * ids sorted, the penalized ids and values. */
typedef struct {
    entry *heap, *cand;
    double *p;
    int32_t *seen, *pen_ids;
    float *pen_vals, *work;
} sample_scratch;

/* Lays the scratch out from `mem` (or only measures it, for mem NULL); returns its bytes. */
static size_t carve(uint8_t *mem, int n, int k, sample_scratch *w) {
    size_t at = 0;
#define TAKE(field, type, count) (w->field = (type *)(mem ? mem + at : NULL), at += sizeof(type) * (size_t)(count))
    TAKE(p, double, k);
    TAKE(heap, entry, k);
    TAKE(cand, entry, k);
    TAKE(seen, int32_t, MAX_WINDOW);
    TAKE(pen_ids, int32_t, MAX_WINDOW);
    TAKE(pen_vals, float, MAX_WINDOW);
    TAKE(work, float, 2 * (n / BLOCK) + 1);
#undef TAKE
    return at;
}

static int by_id(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static int penalizes(const sample_spec *s) {
    return s->n_window > 0 && (s->repeat_penalty != 1.0f || s->presence != 0.0 || s->frequency != 0.0);
}

/* The window's distinct ids with their values after the penalties: llama.cpp's repetition penalty
 * (divide a positive logit, multiply a negative one), then OpenAI's presence and frequency penalties
 * by the id's count. */
static overrides penalties(const float *x, int n, const sample_spec *s, sample_scratch *w) {
    overrides o = {w->pen_ids, w->pen_vals, 0};
    if (!penalizes(s)) return o;
    memcpy(w->seen, s->window, sizeof(int32_t) * (size_t)s->n_window);
    qsort(w->seen, (size_t)s->n_window, sizeof(int32_t), by_id);
    for (int j = 0; j < s->n_window;) {
        int id = w->seen[j], count = 0;
        while (j < s->n_window && w->seen[j] == id) j++, count++;
        if (id < 0 || id >= n) continue;
        float v = x[id], r = v > 0 ? v / s->repeat_penalty : v * s->repeat_penalty;
        w->pen_ids[o.n] = id;
        w->pen_vals[o.n++] = (float)((double)r - (s->presence + s->frequency * count));
    }
    return o;
}

/* The row is only read: a stalled worker may sample it again (see pool.h). */
static int sample_row(const float *x, int n, const sample_spec *s, sample_scratch *w) {
    int k = s->temperature == 0.0 ? 1 : s->top_k;
    overrides o = penalties(x, n, s, w);
    topk(x, n, k, &o, w->cand, w->heap, w->work);
    if (s->temperature == 0.0) return w->cand[0].i;
    double top = (double)w->cand[0].v / s->temperature, sum = 0.0; /* softmax at the temperature */
    for (int i = 0; i < k; i++) sum += w->p[i] = exp((double)w->cand[i].v / s->temperature - top);
    for (int i = 0; i < k; i++) w->p[i] /= sum;
    int keep = k;
    if (s->top_p < 1.0) { /* the shortest prefix whose cumulative probability reaches top_p */
        double c = 0.0;
        for (keep = 0; keep < k;)
            if ((c += w->p[keep++]) >= s->top_p) break;
    }
    if (s->min_p > 0.0) { /* probabilities fall along the list, so those kept are a prefix */
        double floor = s->min_p * w->p[0];
        while (keep > 1 && w->p[keep - 1] < floor) keep--;
    }
    double total = 0.0, last = 0.0, c = 0.0;
    for (int i = 0; i < keep; i++) total += w->p[i];
    for (int i = 0; i < keep; i++) last += w->p[i] /= total; /* the draw scales by the cumulative sum's end */
    double target = s->u * last;
    for (int i = 0; i < keep; i++)
        if ((c += w->p[i]) > target) return w->cand[i].i;
    return w->cand[keep - 1].i;
}

/* ---- Python ---------------------------------------------------------------------------------- */

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
    entry *heap = PyMem_Malloc(2 * sizeof(entry) * (size_t)k), *best = heap ? heap + k : NULL;
    float *work = PyMem_Malloc(sizeof(float) * (2 * (size_t)(n / BLOCK) + 1));
    if (out && heap && work) { /* tens of microseconds: keeping the GIL beats waiting up to a switch interval to get it back */
        overrides none = {NULL, NULL, 0};
        topk(buf.buf, n, k, &none, best, heap, work);
        for (int i = 0; i < k; i++) ((int32_t *)PyBytes_AS_STRING(out))[i] = best[i].i;
    } else {
        Py_CLEAR(out);
        PyErr_NoMemory();
    }
    PyMem_Free(work);
    PyMem_Free(heap);
    PyBuffer_Release(&buf);
    return out;
}

/* A call's rows for the pool: a chunk is a row; compute leaves its token in the thread's slot. */
typedef struct {
    const float *logits;
    int n_vocab, k_max;
    const int *rows;
    const sample_spec *specs;
    uint8_t *scratch; /* per thread */
    size_t scratch_bytes;
    int *thread_token;
    int *tokens;
} sample_job;

static void sample_compute(void *ctx, int c, int thread) {
    const sample_job *j = ctx;
    sample_scratch w;
    carve(j->scratch + (size_t)thread * j->scratch_bytes, j->n_vocab, j->k_max, &w);
    j->thread_token[thread] = sample_row(j->logits + (size_t)j->rows[c] * j->n_vocab, j->n_vocab, &j->specs[c], &w);
}

static void sample_commit(void *ctx, int c, int thread) {
    const sample_job *j = ctx;
    j->tokens[c] = j->thread_token[thread];
}

/* sample_rows(pool or None, float32 logits buffer, n_vocab, specs) -> [token, ...]; a spec is
 * (row, int32 window buffer, top_k, temperature, top_p, min_p, repeat_penalty, presence, frequency, u). */
static PyObject *py_sample_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *pool_obj, *spec_list, *result = NULL;
    Py_buffer logits;
    int n_vocab;
    if (!PyArg_ParseTuple(args, "Oy*iO!", &pool_obj, &logits, &n_vocab, &PyList_Type, &spec_list)) return NULL;
    kiln_pool *pool = pool_obj == Py_None ? NULL : kiln_pool_of(pool_obj);
    Py_ssize_t n = PyList_GET_SIZE(spec_list), n_rows = n_vocab > 0 ? logits.len / ((Py_ssize_t)sizeof(float) * n_vocab) : 0;
    int threads = pool ? kiln_pool_threads(pool) : 1;
    sample_spec *specs = PyMem_Calloc((size_t)n + 1, sizeof *specs);
    int *ints = PyMem_Calloc(2 * (size_t)n + (size_t)threads + 1, sizeof(int));
    Py_buffer *windows = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    Py_ssize_t got = 0;
    uint8_t *scratch = NULL;
    if ((pool_obj != Py_None && !pool) || !specs || !ints || !windows) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    if (n_vocab < 1) {
        PyErr_Format(PyExc_ValueError, "sample_rows: n_vocab is %d", n_vocab);
        goto done;
    }
    int *rows = ints, *tokens = ints + n, *thread_token = ints + 2 * n, k_max = 1;
    for (; got < n; got++) {
        sample_spec *s = &specs[got];
        if (!PyArg_ParseTuple(PyList_GET_ITEM(spec_list, got), "iy*idddfddd;sample_rows: a spec is (row, window, top_k, "
                              "temperature, top_p, min_p, repeat_penalty, presence, frequency, u)", &rows[got],
                              &windows[got], &s->top_k, &s->temperature, &s->top_p, &s->min_p, &s->repeat_penalty,
                              &s->presence, &s->frequency, &s->u))
            goto done;
        s->window = windows[got].buf;
        s->n_window = (int)(windows[got].len / (Py_ssize_t)sizeof(int32_t));
        int k = s->temperature == 0.0 ? 1 : s->top_k;
        if (rows[got] < 0 || rows[got] >= n_rows || s->n_window > MAX_WINDOW || k < 1 || k >= n_vocab ||
            !(s->temperature >= 0.0) || !(s->top_p > 0.0 && s->top_p <= 1.0)) {
            PyErr_Format(PyExc_ValueError, "sample_rows: spec %zd (row %d of %zd, window %d of at most %d, top_k %d, "
                         "temperature %g, top_p %g) is outside what the native sampler takes", got, rows[got], n_rows,
                         s->n_window, MAX_WINDOW, s->top_k, s->temperature, s->top_p);
            got++;
            goto done;
        }
        if (k > k_max) k_max = k;
    }
    sample_scratch sizing;
    size_t per_thread = (carve(NULL, n_vocab, k_max, &sizing) + 63) & ~(size_t)63;
    if (!(scratch = PyMem_Malloc(per_thread * (size_t)threads))) {
        PyErr_NoMemory();
        goto done;
    }
    sample_job job = {logits.buf, n_vocab, k_max, rows, specs, scratch, per_thread, thread_token, tokens};
    /* tens of microseconds a row: the GIL is kept, as for topk */
    if (pool && n > 1) {
        kiln_pool_run(pool, sample_compute, sample_commit, &job, (int)n);
        kiln_pool_quiesce(pool); /* a stalled worker may still read the job before it is freed */
    } else
        for (int c = 0; c < n; c++) sample_compute(&job, c, 0), sample_commit(&job, c, 0);
    if (!(result = PyList_New(n))) goto done;
    for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(result, i, PyLong_FromLong(tokens[i]));
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&windows[i]);
    PyMem_Free(scratch);
    PyMem_Free(windows);
    PyMem_Free(ints);
    PyMem_Free(specs);
    PyBuffer_Release(&logits);
    return result;
}

PyMethodDef sample_methods[] = {
    {"topk", py_topk, METH_VARARGS, "topk(float32 buffer, k) -> int32 indices of the k largest, largest first"},
    {"sample_rows", py_sample_rows, METH_VARARGS,
     "sample_rows(pool or None, float32 logits, n_vocab, [(row, int32 window, top_k, temperature, top_p, min_p, "
     "repeat_penalty, presence, frequency, u), ...]) -> [token, ...]"},
    {NULL}};
