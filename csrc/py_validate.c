/* Self-tests for `kiln validate`: what one native call and one parallel region of the pool cost, and
 * how this extension was built. Nothing here is on the inference path. */
#include <stdatomic.h>
#include <time.h>

#include "bindings.h"
#include "kernels.h"
#include "plan.h"
#include "pool.h"

#define RENDEZVOUS_TIMEOUT_NS 10000000 /* a preempted thread must not hang the test */

/* noop() -> None: the floor of any call from Python into this extension */
static PyObject *py_noop(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    Py_RETURN_NONE;
}

typedef struct {
    _Atomic int arrived, on_workers, timeouts;
    int n;
} rendezvous;

/* Each chunk waits until every thread holds one, so a region is only over once all threads have
 * joined it: the time measures waking the workers, handing them work and the closing barrier. */
static void rendezvous_chunk(void *ctx, int chunk, int thread) {
    (void)chunk;
    rendezvous *r = ctx;
    atomic_fetch_add(&r->arrived, 1);
    if (thread) atomic_fetch_add(&r->on_workers, 1);
    int64_t t0 = kiln_now_ns();
    while (atomic_load(&r->arrived) < r->n)
        if (kiln_now_ns() - t0 > RENDEZVOUS_TIMEOUT_NS) {
            atomic_fetch_add(&r->timeouts, 1);
            return;
        }
}

static void empty_chunk(void *ctx, int chunk, int thread) {
    rendezvous *r = ctx;
    (void)chunk;
    if (thread) atomic_fetch_add(&r->on_workers, 1);
}

static void no_commit(void *ctx, int chunk, int thread) { (void)ctx, (void)chunk, (void)thread; }

/* pool_region_ns(threads, regions, idle_us, all_threads) -> (ns per region, chunks run by workers,
 * timeouts). A pool of its own runs `regions` regions; `idle_us` of sleep between regions lets the
 * workers go from spinning to sleeping (0: back to back, as within one decode step).
 * all_threads: `threads` chunks that each wait for every thread to join (fork-join latency);
 * otherwise 4 empty chunks per thread, as the executor splits its ops (dispatch cost, which the
 * caller may finish alone). */
static PyObject *py_pool_region_ns(PyObject *self, PyObject *args) {
    (void)self;
    int threads, regions, idle_us, all_threads;
    if (!PyArg_ParseTuple(args, "iiip", &threads, &regions, &idle_us, &all_threads)) return NULL;
    if (threads < 1 || regions < 1 || idle_us < 0)
        return PyErr_Format(PyExc_ValueError,
                            "pool_region_ns(threads=%d, regions=%d, idle_us=%d): need >= 1, >= 1, >= 0", threads,
                            regions, idle_us);
    kiln_pool *pool = kiln_pool_create(threads);
    int64_t *ns = PyMem_Calloc((size_t)regions, sizeof(int64_t));
    if (!pool || !ns) {
        kiln_pool_destroy(pool);
        PyMem_Free(ns);
        return PyErr_NoMemory();
    }
    int n = kiln_pool_threads(pool), on_workers = 0, timeouts = 0;
    rendezvous r = {.n = n};
    struct timespec idle = {0, (long)idle_us * 1000};
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < regions; i++) {
        if (idle_us) nanosleep(&idle, NULL);
        atomic_store(&r.arrived, 0);
        atomic_store(&r.on_workers, 0);
        int64_t t0 = kiln_now_ns();
        if (all_threads)
            kiln_pool_run(pool, rendezvous_chunk, no_commit, &r, n);
        else
            kiln_pool_run(pool, empty_chunk, no_commit, &r, 4 * n);
        ns[i] = kiln_now_ns() - t0;
        on_workers += atomic_load(&r.on_workers);
    }
    timeouts = atomic_load(&r.timeouts);
    Py_END_ALLOW_THREADS
    kiln_pool_destroy(pool);
    PyObject *list = PyList_New(regions);
    for (int i = 0; list && i < regions; i++) PyList_SET_ITEM(list, i, PyLong_FromLongLong(ns[i]));
    PyMem_Free(ns);
    if (!list) return NULL;
    return Py_BuildValue("(Nii)", list, on_workers, timeouts);
}

/* build_info() -> {compiler, op_struct_bytes, pointer_bytes, x86}: what the Python side assumes of
 * this build is read from here, not hard-coded */
static PyObject *py_build_info(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
#ifdef KILN_X86
    int x86 = 1;
#else
    int x86 = 0;
#endif
    return Py_BuildValue("{s:s,s:n,s:n,s:O}", "compiler", __VERSION__, "op_struct_bytes", (Py_ssize_t)sizeof(kiln_op),
                         "pointer_bytes", (Py_ssize_t)sizeof(void *), "x86", x86 ? Py_True : Py_False);
}

/* int8_peaks(passes, iters) -> {unit: GMAC/s of one core, or the missing feature's name}; the GIL is
 * released, so threads can run it on every core at once */
static PyObject *py_int8_peaks(PyObject *self, PyObject *args) {
    (void)self;
    int passes;
    long iters;
    if (!PyArg_ParseTuple(args, "il", &passes, &iters)) return NULL;
    if (passes < 1 || iters < 1) return PyErr_Format(PyExc_ValueError, "int8_peaks(passes=%d, iters=%ld): need >= 1", passes, iters);
    PyObject *out = PyDict_New();
    for (int u = 0; out && u < PEAK_UNITS; u++) {
        const char *missing = kiln_peak_missing((kiln_peak_unit)u);
        double g = 0;
        if (!missing) {
            Py_BEGIN_ALLOW_THREADS
            g = kiln_peak_gmacs((kiln_peak_unit)u, passes, iters);
            Py_END_ALLOW_THREADS
        }
        PyObject *v = missing ? PyUnicode_FromString(missing) : PyFloat_FromDouble(g);
        if (!v || PyDict_SetItemString(out, kiln_peak_name((kiln_peak_unit)u), v)) {
            Py_XDECREF(v);
            Py_CLEAR(out);
        } else
            Py_DECREF(v);
    }
    return out;
}

PyMethodDef validate_methods[] = {
    {"int8_peaks", py_int8_peaks, METH_VARARGS,
     "int8_peaks(passes, iters) -> {unit: GMAC/s of one core, or the missing feature}"},
    {"noop", py_noop, METH_NOARGS, "noop() -> None: an empty native call"},
    {"pool_region_ns", py_pool_region_ns, METH_VARARGS,
     "pool_region_ns(threads, regions, idle_us, all_threads) -> (ns per region, chunks on workers, timeouts)"},
    {"build_info", py_build_info, METH_NOARGS, "build_info() -> {compiler, op_struct_bytes, pointer_bytes, x86}"},
    {NULL, NULL, 0, NULL},
};
