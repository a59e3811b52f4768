/* Python bindings of the executor: huge-page arenas, packed matrices, the thread pool and plans.
 *
 * Python builds each op as bytes laid out like `kiln_op`, using the field table `op_fields()` returns,
 * so the struct is defined once, here in C. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "attn.h"
#include "attn_quant.h"
#include "bindings.h"
#include "checksum.h"
#include "dequant.h"
#include "plan.h"
#include "pool.h"

#define HUGE_PAGE (2u << 20)

/* ---- Arena: one zeroed mapping, on huge pages unless asked otherwise (weights, KV cache, activations) -- */

typedef struct {
    PyObject_HEAD
    uint8_t *data;
    size_t nbytes, mapped;
    Py_ssize_t exports;
} Arena;

static void arena_dealloc(Arena *a) {
    if (a->data) munmap(a->data, a->mapped);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

static PyObject *arena_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Py_ssize_t nbytes;
    int huge = 1;
    static char *names[] = {"nbytes", "huge", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "n|p", names, &nbytes, &huge)) return NULL;
    if (nbytes < 0) return PyErr_Format(PyExc_ValueError, "arena size %zd is negative", nbytes);
    Arena *a = (Arena *)type->tp_alloc(type, 0);
    if (!a) return NULL;
    size_t page = huge ? HUGE_PAGE : 4096;
    a->nbytes = (size_t)nbytes;
    a->mapped = ((size_t)nbytes + page - 1) / page * page;
    if (a->mapped == 0) a->mapped = page;
    void *p = mmap(NULL, a->mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        Py_DECREF(a);
        return PyErr_Format(PyExc_MemoryError, "cannot map %zd bytes for a kiln arena", nbytes);
    }
    /* Huge pages for what is streamed, where the kernel grants them (docs/PERF.md, "Figures that were
       code comments"). Small pages for what a step touches only in part (activations, logits rows), so
       the rest never becomes resident. */
    madvise(p, a->mapped, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    a->data = p;
    return (PyObject *)a;
}

static int arena_getbuffer(Arena *a, Py_buffer *view, int flags) {
    int rc = PyBuffer_FillInfo(view, (PyObject *)a, a->data, (Py_ssize_t)a->nbytes, 0, flags);
    if (rc == 0) a->exports++;
    return rc;
}
static void arena_releasebuffer(Arena *a, Py_buffer *view) { (void)view; a->exports--; }
static PyBufferProcs arena_buffer = {(getbufferproc)arena_getbuffer, (releasebufferproc)arena_releasebuffer};

static PyObject *arena_address(Arena *a, void *c) { (void)c; return PyLong_FromVoidPtr(a->data); }
static PyObject *arena_size(Arena *a, void *c) { (void)c; return PyLong_FromSize_t(a->nbytes); }
static PyGetSetDef arena_getset[] = {
    {"address", (getter)arena_address, NULL, "address of the first byte", NULL},
    {"nbytes", (getter)arena_size, NULL, "size in bytes", NULL},
    {NULL}};

/* What a summed read (checksum.h) returns to Python: the checksum in hex, or the OSError that stopped it. */
static PyObject *summed(int rc, const kiln_sum *sum, const char *path, size_t nbytes) {
    if (rc > 0) {
        errno = rc;
        return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    }
    if (rc < 0) return PyErr_Format(PyExc_OSError, "%s: shorter than %zu bytes", path, nbytes);
    char hex[33];
    kiln_sum_hex(sum, hex);
    return PyUnicode_FromString(hex);
}

/* Fill the arena from a file (the repack cache) without holding the GIL, summing each chunk while it is
   still in cache; returns the checksum. */
static PyObject *arena_read_file(Arena *a, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    kiln_sum sum;
    kiln_sum_init(&sum);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kiln_read_summed(fd, a->data, a->nbytes, 1, &sum);
    close(fd);
    Py_END_ALLOW_THREADS
    return summed(rc, &sum, path, a->nbytes);
}

static PyMethodDef arena_methods[] = {{"read_file", (PyCFunction)arena_read_file, METH_VARARGS, NULL}, {NULL}};

static PyTypeObject ArenaType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kiln._native.Arena",
    .tp_basicsize = sizeof(Arena),
    .tp_dealloc = (destructor)arena_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = arena_new,
    .tp_as_buffer = &arena_buffer,
    .tp_getset = arena_getset,
    .tp_methods = arena_methods,
    .tp_doc = "Zeroed memory on huge pages, exposed as a writable buffer.",
};

static Arena *as_arena(PyObject *o) {
    if (!PyObject_TypeCheck(o, &ArenaType)) {
        PyErr_SetString(PyExc_TypeError, "expected a kiln._native.Arena");
        return NULL;
    }
    return (Arena *)o;
}

/* ---- WMat: a packed matrix living in an arena --------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    kiln_wmat m;
    PyObject *arena;
} WMat;

static void wmat_dealloc(WMat *w) {
    Py_XDECREF(w->arena);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *wmat_address(WMat *w, void *c) { (void)c; return PyLong_FromVoidPtr(&w->m); }
static PyObject *wmat_layout(WMat *w, void *c) {
    (void)c;
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:n}", "fmt", (int)w->m.fmt, "rows", w->m.rows, "cols", w->m.cols,
                         "rows_padded", w->m.rows_padded, "tile_bytes", (Py_ssize_t)w->m.tile_bytes);
}
static PyGetSetDef wmat_getset[] = {
    {"address", (getter)wmat_address, NULL, "address of the kiln_wmat struct", NULL},
    {"layout", (getter)wmat_layout, NULL, "fmt, rows, cols, rows_padded, tile_bytes", NULL},
    {NULL}};

static PyTypeObject WMatType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kiln._native.WMat",
    .tp_basicsize = sizeof(WMat),
    .tp_dealloc = (destructor)wmat_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_getset = wmat_getset,
    .tp_doc = "A packed weight matrix inside an Arena.",
};

static PyObject *make_wmat(PyObject *arena, kiln_wmat m) {
    WMat *w = PyObject_New(WMat, &WMatType);
    if (!w) return NULL;
    w->m = m;
    Py_INCREF(arena);
    w->arena = arena;
    return (PyObject *)w;
}

/* pack_into(arena, offset, ggml_type, src, rows, cols) -> WMat */
static PyObject *py_pack_into(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arena_obj;
    Py_ssize_t offset;
    int type, rows, cols;
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "Oniy*ii", &arena_obj, &offset, &type, &src, &rows, &cols)) return NULL;
    Arena *a = as_arena(arena_obj);
    size_t need = kiln_pack_size(type, rows, cols);
    if (!a || need == 0 || offset < 0 || (size_t)offset + need > a->nbytes) {
        PyBuffer_Release(&src);
        if (a) PyErr_Format(PyExc_ValueError, "cannot pack type %d (%d x %d) at offset %zd of a %zu-byte arena",
                            type, rows, cols, offset, a->nbytes);
        return NULL;
    }
    kiln_wmat m;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = kiln_pack(type, src.buf, rows, cols, a->data + offset, &m);
    Py_END_ALLOW_THREADS PyBuffer_Release(&src);
    if (rc != 0) return PyErr_Format(PyExc_ValueError, "kiln_pack failed for type %d (%d x %d)", type, rows, cols);
    return make_wmat(arena_obj, m);
}

/* wmat(arena, offset, fmt, rows, cols, rows_padded, tile_bytes) -> WMat over already packed bytes */
static PyObject *py_wmat(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arena_obj;
    Py_ssize_t offset, tile_bytes;
    int fmt, rows, cols, rows_padded;
    if (!PyArg_ParseTuple(args, "Oniiiin", &arena_obj, &offset, &fmt, &rows, &cols, &rows_padded, &tile_bytes))
        return NULL;
    Arena *a = as_arena(arena_obj);
    if (!a) return NULL;
    size_t nbytes = (size_t)tile_bytes * (size_t)(rows_padded / 4);
    if (fmt < 0 || fmt >= KF_COUNT || offset < 0 || (size_t)offset + nbytes > a->nbytes || rows_padded % 4)
        return PyErr_Format(PyExc_ValueError, "packed matrix (fmt %d, %d x %d) does not fit its arena", fmt, rows, cols);
    kiln_wmat m = {(kiln_wfmt)fmt, rows, cols, rows_padded, (size_t)tile_bytes, a->data + offset};
    return make_wmat(arena_obj, m);
}

/* dequant_rows(ggml_type, src, n_values) -> bytes of float32: the embedding path, for tests */
static PyObject *py_dequant_rows(PyObject *self, PyObject *args) {
    (void)self;
    int type;
    Py_ssize_t n;
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "iy*n", &type, &src, &n)) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out && kiln_dequant_row(type, src.buf, (int)n, (float *)PyBytes_AS_STRING(out)) != 0) {
        Py_CLEAR(out);
        PyErr_Format(PyExc_ValueError, "no row dequantization for type %d", type);
    }
    PyBuffer_Release(&src);
    return out;
}

/* ---- Pool ------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    kiln_pool *pool;
} Pool;

static void pool_dealloc(Pool *p) {
    if (p->pool) kiln_pool_destroy(p->pool);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    int n;
    static char *names[] = {"threads", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i", names, &n)) return NULL;
    Pool *p = (Pool *)type->tp_alloc(type, 0);
    if (p && !(p->pool = kiln_pool_create(n))) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    return (PyObject *)p;
}

static PyObject *pool_threads(Pool *p, void *c) { (void)c; return PyLong_FromLong(kiln_pool_threads(p->pool)); }
static PyObject *pool_steals(Pool *p, void *c) { (void)c; return PyLong_FromUnsignedLongLong(kiln_pool_steals(p->pool)); }
static PyGetSetDef pool_getset[] = {
    {"threads", (getter)pool_threads, NULL, "threads including the caller", NULL},
    {"steals", (getter)pool_steals, NULL, "chunks the caller took over because their worker stalled", NULL},
    {NULL}};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kiln._native.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = pool_new,
    .tp_getset = pool_getset,
    .tp_doc = "Worker threads that claim chunks of work; the caller works too.",
};

kiln_pool *kiln_pool_of(PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &PoolType)) {
        PyErr_Format(PyExc_TypeError, "expected a kiln._native.Pool, not %.80s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return ((Pool *)obj)->pool;
}

/* ---- Plan ------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    kiln_plan plan;
    PyObject *pool;
    PyObject *keep; /* arenas and matrices the ops point into */
} Plan;

static void plan_dealloc(Plan *p) {
    if (p->plan.pool) {
        Py_BEGIN_ALLOW_THREADS
        kiln_pool_quiesce(p->plan.pool);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(p->plan.ops);
    PyMem_Free(p->plan.jobs);
    PyMem_Free(p->plan.blocks);
    PyMem_Free(p->plan.attn_unit0);
    PyMem_Free(p->plan.attn_floats0);
    if (p->plan.attn_partial) munmap(p->plan.attn_partial, p->plan.attn_partial_bytes);
    if (p->plan.amx_tiles) munmap(p->plan.amx_tiles, p->plan.amx_tiles_bytes);
    PyMem_Free(p->plan.logit_floor);
    PyMem_Free(p->plan.remainder_floor);
    PyMem_Free(p->plan.chunk_best);
    PyMem_Free(p->plan.refine_chunks);
    PyMem_Free(p->plan.scratch);
    PyMem_Free(p->plan.op_scratch);
    PyMem_Free(p->plan.gaps);
    PyMem_Free(p->plan.op_ns);
    PyMem_Free(p->plan.op_wait_ns);
    PyMem_Free(p->plan.op_t0_ns);
    PyMem_Free(p->plan.op_t1_ns);
    Py_XDECREF(p->pool);
    Py_XDECREF(p->keep);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* The plan's checks over `buffers` ({name: WMat, or any object with a buffer: arenas, arrays}): each
 * buffer's extent and each matrix, so kiln_plan_check can hold every op's addresses against them. */
static int check_plan(kiln_plan *k, PyObject *buffers) {
    Py_ssize_t n = PyDict_Size(buffers), pos = 0, n_regions = 0, n_mats = 0;
    kiln_region *regions = PyMem_Calloc((size_t)n + 1, sizeof *regions);
    const kiln_wmat **mats = PyMem_Calloc((size_t)n + 1, sizeof *mats);
    PyObject *key, *value;
    int rc = -1;
    if (!regions || !mats) {
        PyErr_NoMemory();
        goto done;
    }
    while (PyDict_Next(buffers, &pos, &key, &value)) {
        const char *name = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
        if (!name) {
            PyErr_SetString(PyExc_TypeError, "plan buffers are named by strings");
            goto done;
        }
        if (PyObject_TypeCheck(value, &WMatType)) {
            mats[n_mats++] = &((WMat *)value)->m;
            continue;
        }
        Py_buffer view;
        if (PyObject_GetBuffer(value, &view, PyBUF_SIMPLE) < 0) {
            PyErr_Format(PyExc_TypeError, "plan buffer '%s' is neither a matrix nor a buffer", name);
            goto done;
        }
        regions[n_regions++] = (kiln_region){name, view.buf, (size_t)view.len};
        PyBuffer_Release(&view); /* `keep` holds the owner, and kiln's buffers never move */
    }
    char err[512];
    if (kiln_plan_check(k, regions, (int)n_regions, mats, (int)n_mats, err, sizeof err) < 0) {
        PyErr_SetString(PyExc_ValueError, err);
        goto done;
    }
    rc = 0;
done:
    PyMem_Free(regions);
    PyMem_Free(mats);
    return rc;
}

/* Plan(ops, pool, buffers, rows, out_rows, n_ctx, n_slots, tokens, slots, positions, row_sel, guard=False,
 *      guard_gaps=b""): `buffers` names every buffer and matrix the ops point into (checked here, and kept
 * alive). Each op's scratch is what its family asks for (kiln_op_scratch); guarded, each thread's scratch
 * has guard words either side and each op's region ends at them, and guard_gaps (uint64 pairs: address,
 * bytes) lists the bytes past each activation buffer, so a run that writes past either fails. */
static PyObject *plan_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Py_buffer ops, gaps = {0};
    PyObject *pool, *buffers;
    int rows, out_rows, n_ctx, n_slots, guard = 0;
    unsigned long long tokens, slots, positions, row_sel;
    static char *names[] = {"ops", "pool", "buffers", "rows", "out_rows", "n_ctx", "n_slots", "tokens", "slots",
                            "positions", "row_sel", "guard", "guard_gaps", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*O!O!iiiiKKKK|py*", names, &ops, &PoolType, &pool, &PyDict_Type,
                                     &buffers, &rows, &out_rows, &n_ctx, &n_slots, &tokens, &slots, &positions,
                                     &row_sel, &guard, &gaps))
        return NULL;
    size_t n_gaps = gaps.buf ? (size_t)gaps.len / 16 : 0;
    kiln_region *gap_list = PyMem_Calloc(n_gaps + 1, sizeof *gap_list);
    for (size_t g = 0; gap_list && g < n_gaps; g++) {
        uint64_t pair[2];
        memcpy(pair, (const uint8_t *)gaps.buf + 16 * g, sizeof pair);
        gap_list[g] = (kiln_region){"gap", (uint8_t *)(uintptr_t)pair[0], (size_t)pair[1]};
    }
    int bad_gaps = gaps.buf && (gaps.len % 16 || (n_gaps && !guard));
    if (gaps.buf) PyBuffer_Release(&gaps);
    if (!gap_list || bad_gaps || ops.len % sizeof(kiln_op)) {
        PyMem_Free(gap_list);
        PyBuffer_Release(&ops);
        if (!gap_list) return PyErr_NoMemory();
        if (bad_gaps) return PyErr_Format(PyExc_ValueError, "guard_gaps: (address, bytes) pairs of a guarded plan");
        return PyErr_Format(PyExc_ValueError, "ops buffer of %zd bytes is not a whole number of %zu-byte ops", ops.len,
                            sizeof(kiln_op));
    }
    Plan *p = (Plan *)type->tp_alloc(type, 0);
    if (!p) {
        PyMem_Free(gap_list);
        PyBuffer_Release(&ops);
        return NULL;
    }
    kiln_plan *k = &p->plan;
    k->gaps = gap_list, k->n_gaps = (int)n_gaps;
    k->n_ops = (int)(ops.len / sizeof(kiln_op));
    k->ops = PyMem_Malloc(ops.len ? ops.len : 1);
    if (!k->ops) {
        PyBuffer_Release(&ops);
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    memcpy(k->ops, ops.buf, ops.len);
    PyBuffer_Release(&ops);
    k->max_rows = rows;
    k->max_out = out_rows;
    k->n_ctx = n_ctx;
    k->n_slots = n_slots;
    k->tokens = (int32_t *)(uintptr_t)tokens;
    k->slots = (int32_t *)(uintptr_t)slots;
    k->positions = (int32_t *)(uintptr_t)positions;
    k->row_sel = (int32_t *)(uintptr_t)row_sel;
    p->keep = PyDict_Copy(buffers); /* a copy: what the ops point into stays alive whatever the caller's dict does */
    if (!p->keep || check_plan(k, p->keep) < 0) {
        Py_DECREF(p);
        return NULL;
    }
    k->jobs = PyMem_Calloc((size_t)k->n_ops + 1, sizeof(kiln_job));
    k->blocks = PyMem_Calloc(2 * (size_t)rows + 2, sizeof(int32_t));
    k->attn_unit0 = PyMem_Calloc((size_t)rows + 2, sizeof(int32_t));
    k->attn_floats0 = PyMem_Calloc((size_t)rows + 2, sizeof(size_t));
    k->op_scratch = PyMem_Calloc((size_t)k->n_ops, sizeof(size_t));
    /* per_row: every query of a row, (o, m, l) per attention part; head_chunks: the output head's chunks */
    size_t per_row = 0, head_chunks = 1;
    k->scratch_floats = 1;
    for (int i = 0; i < k->n_ops && k->op_scratch; i++) {
        const kiln_op *op = &k->ops[i];
        if (op->kind == OP_ATTN && (size_t)op->n_heads * (op->head_dim + 2) > per_row)
            per_row = (size_t)op->n_heads * (op->head_dim + 2);
        if (op->kind == OP_LOGITS) {
            size_t tiles = (size_t)op->w->rows_padded / 4, c = (tiles + op->chunk_tiles - 1) / op->chunk_tiles;
            head_chunks = c > head_chunks ? c : head_chunks;
        }
        k->op_scratch[i] = kiln_op_scratch(op, rows, out_rows);
        if (k->op_scratch[i] > k->scratch_floats) k->scratch_floats = k->op_scratch[i];
    }
    /* at most n_ctx / ATTN_SPAN + 1 parts: sized for the longest context, used as far as the step's
     * positions reach; mapped, not allocated, so pages a step never touches are never resident (a heap
     * calloc may zero all of it) */
    k->attn_partial_bytes = sizeof(float) * ((size_t)rows * per_row * ((size_t)n_ctx / ATTN_SPAN + 1) + 1);
    k->attn_partial = mmap(NULL, k->attn_partial_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (k->attn_partial == MAP_FAILED) k->attn_partial = NULL;
#ifdef MADV_NOHUGEPAGE
    else madvise(k->attn_partial, k->attn_partial_bytes, MADV_NOHUGEPAGE);
#endif
#if KILN_X86
    /* the AMX prefill's bf16 tiles (kern_amx.c), mapped as attn_partial is; a failed map leaves the int8 path */
    if (rows >= KILN_AMX_MIN_TOKENS && !kiln_isa_missing(ISA_AMX)) {
        size_t bytes = 0;
        for (int i = 0; i < k->n_ops; i++) {
            const kiln_op *op = &k->ops[i];
            const kiln_wmat *w = op->kind == OP_QKV ? op->wq : op->kind == OP_MATMUL || op->kind == OP_GLU ? op->w : NULL;
            size_t need = w ? kiln_bf16_tiles_bytes(w->cols, rows) : 0;
            bytes = need > bytes ? need : bytes;
        }
        if (bytes) {
            k->amx_tiles = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (k->amx_tiles == MAP_FAILED) k->amx_tiles = NULL;
            else k->amx_tiles_bytes = bytes;
        }
    }
#endif
    k->logit_floor = PyMem_Calloc((size_t)rows + 1, sizeof(float));
    k->remainder_floor = PyMem_Calloc((size_t)rows + 1, sizeof(float));
    k->chunk_best = PyMem_Calloc(head_chunks * (size_t)rows + 1, sizeof(float));
    k->refine_chunks = PyMem_Calloc(head_chunks + 1, sizeof(int32_t));
    k->pool = ((Pool *)pool)->pool;
    int threads = kiln_pool_threads(k->pool);
    k->guard = guard;
    k->scratch_stride = k->scratch_floats + (guard ? 2 * KILN_GUARD_FLOATS : 0);
    k->scratch = PyMem_Calloc((size_t)threads * k->scratch_stride + 1, sizeof(float));
    k->op_ns = PyMem_Calloc((size_t)k->n_ops + 1, sizeof(int64_t));
    k->op_wait_ns = PyMem_Calloc((size_t)k->n_ops + 1, sizeof(int64_t));
    k->op_t0_ns = PyMem_Calloc((size_t)k->n_ops + 1, sizeof(int64_t));
    k->op_t1_ns = PyMem_Calloc((size_t)k->n_ops + 1, sizeof(int64_t));
    if (!k->jobs || !k->blocks || !k->attn_unit0 || !k->attn_floats0 || !k->op_scratch || !k->attn_partial ||
        !k->logit_floor || !k->remainder_floor || !k->chunk_best || !k->refine_chunks || !k->scratch || !k->op_ns ||
        !k->op_wait_ns || !k->op_t0_ns || !k->op_t1_ns) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    if (guard) kiln_plan_guard_fill(k);
    Py_INCREF(pool);
    p->pool = pool;
    return (PyObject *)p;
}

/* run(n_rows, n_out) -> (ns inside the native call, ns of it the caller spent waiting at barriers).
 * The caller has validated the per-row inputs; kiln_plan_check_step checks them again, since a bad token
 * id, slot or position would read or write outside the buffers. */
static PyObject *plan_run(Plan *p, PyObject *args) {
    int n_rows, n_out;
    if (!PyArg_ParseTuple(args, "ii", &n_rows, &n_out)) return NULL;
    kiln_plan *k = &p->plan;
    char err[256];
    if (kiln_plan_check_step(k, n_rows, n_out, err, sizeof err) < 0) {
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    int64_t waited, t0, t1;
    Py_BEGIN_ALLOW_THREADS
    t0 = kiln_now_ns();
    waited = kiln_plan_run(k, n_rows, n_out);
    t1 = kiln_now_ns();
    Py_END_ALLOW_THREADS
    if (k->overrun_op >= 0) {
        const kiln_op *op = &k->ops[k->overrun_op];
        if (k->overrun_gap >= 0)
            PyErr_Format(PyExc_RuntimeError, "plan op %d (%s, layer %d) wrote past the end of an activation buffer, "
                         "into the %zu guard bytes at %p", k->overrun_op, kiln_op_name(op->kind), op->layer,
                         k->gaps[k->overrun_gap].nbytes, (void *)k->gaps[k->overrun_gap].data);
        else
            PyErr_Format(PyExc_RuntimeError, "plan op %d (%s, layer %d) wrote %s its %zu floats of scratch (thread %d)",
                         k->overrun_op, kiln_op_name(op->kind), op->layer, k->overrun_after ? "past" : "before",
                         k->op_scratch[k->overrun_op], k->overrun_thread);
        kiln_plan_guard_fill(k);
        return NULL;
    }
    if (k->error) {
        errno = k->error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(LL)", (long long)(t1 - t0), (long long)waited);
}

/* undersize_scratch(op, floats): a guarded plan's op `op` gets `floats` fewer floats of scratch than its
 * family asked for, so tests can show that the guard catches an op writing past its scratch. */
static PyObject *plan_undersize_scratch(Plan *p, PyObject *args) {
    int i;
    Py_ssize_t floats;
    if (!PyArg_ParseTuple(args, "in", &i, &floats)) return NULL;
    kiln_plan *k = &p->plan;
    if (!k->guard || i < 0 || i >= k->n_ops || floats < 0 || (size_t)floats > k->op_scratch[i])
        return PyErr_Format(PyExc_ValueError, "undersize_scratch(%d, %zd): needs a guarded plan, an op and at most "
                            "its scratch", i, floats);
    k->op_scratch[i] -= (size_t)floats;
    Py_RETURN_NONE;
}

static PyObject *plan_set_trace(Plan *p, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    p->plan.trace = on;
    memset(p->plan.op_ns, 0, sizeof(int64_t) * (size_t)p->plan.n_ops);
    memset(p->plan.op_wait_ns, 0, sizeof(int64_t) * (size_t)p->plan.n_ops);
    p->plan.runs = 0;
    Py_RETURN_NONE;
}

/* trace() -> (op_ns bytes, op_wait_ns bytes, runs): per-op totals since tracing was switched on */
static PyObject *plan_trace(Plan *p, PyObject *noargs) {
    (void)noargs;
    size_t n = sizeof(int64_t) * (size_t)p->plan.n_ops;
    return Py_BuildValue("(y#y#L)", (char *)p->plan.op_ns, (Py_ssize_t)n, (char *)p->plan.op_wait_ns, (Py_ssize_t)n,
                         (long long)p->plan.runs);
}

/* timeline() -> (op start ns bytes, op end ns bytes) of the last traced run, on kiln_now_ns's clock
 * (CLOCK_MONOTONIC, which is Python's time.monotonic_ns) */
static PyObject *plan_timeline(Plan *p, PyObject *noargs) {
    (void)noargs;
    size_t n = sizeof(int64_t) * (size_t)p->plan.n_ops;
    return Py_BuildValue("(y#y#)", (char *)p->plan.op_t0_ns, (Py_ssize_t)n, (char *)p->plan.op_t1_ns, (Py_ssize_t)n);
}

static PyMethodDef plan_methods[] = {
    {"run", (PyCFunction)plan_run, METH_VARARGS, "run(n_rows, n_out) -> (ns, ns waited)"},
    {"set_trace", (PyCFunction)plan_set_trace, METH_VARARGS, "switch per-op timing on or off (and reset it)"},
    {"trace", (PyCFunction)plan_trace, METH_NOARGS, "per-op (ns, wait ns) totals and the run count"},
    {"timeline", (PyCFunction)plan_timeline, METH_NOARGS, "per-op (start ns, end ns) of the last traced run"},
    {"undersize_scratch", (PyCFunction)plan_undersize_scratch, METH_VARARGS,
     "undersize_scratch(op, floats): debug, a guarded plan's op gets less scratch than it needs"},
    {NULL}};

static PyObject *plan_n_ops(Plan *p, void *c) { (void)c; return PyLong_FromLong(p->plan.n_ops); }
static PyObject *plan_scratch(Plan *p, void *c) {
    (void)c;
    PyObject *t = PyTuple_New(p->plan.n_ops);
    for (int i = 0; t && i < p->plan.n_ops; i++) PyTuple_SET_ITEM(t, i, PyLong_FromSize_t(p->plan.op_scratch[i]));
    return t;
}
static PyGetSetDef plan_getset[] = {
    {"n_ops", (getter)plan_n_ops, NULL, "ops per run", NULL},
    {"scratch", (getter)plan_scratch, NULL, "per op, the floats of per-thread scratch it asked for", NULL},
    {NULL}};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kiln._native.Plan",
    .tp_basicsize = sizeof(Plan),
    .tp_dealloc = (destructor)plan_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = plan_new,
    .tp_methods = plan_methods,
    .tp_getset = plan_getset,
    .tp_doc = "A compiled forward pass: one native call per step.",
};

/* ---- the op layout ---------------------------------------------------------------------------- */

#define FIELD(name, t) {#name, offsetof(kiln_op, name), t}
static const struct {
    const char *name;
    size_t offset;
    char type; /* i int32, f float, p pointer, z size_t */
} OP_FIELDS[] = {
    FIELD(kind, 'i'), FIELD(op_class, 'i'), FIELD(layer, 'i'), FIELD(cols, 'i'), FIELD(rows, 'i'),
    FIELD(in, 'p'), FIELD(res, 'p'), FIELD(out, 'p'), FIELD(norm_w, 'p'), FIELD(eps, 'f'), FIELD(scale, 'f'),
    FIELD(select_rows, 'i'), FIELD(n_act, 'i'), FIELD(act_fmt[0], 'i'), FIELD(act_fmt[1], 'i'),
    FIELD(act_fmt[2], 'i'), FIELD(act[0], 'p'), FIELD(act[1], 'p'), FIELD(act[2], 'p'),
    FIELD(w, 'p'), FIELD(w2, 'p'), FIELD(w_act, 'i'),
    FIELD(w2_act, 'i'), FIELD(bias, 'p'), FIELD(glu_act, 'i'), FIELD(table_w, 'p'), FIELD(table_w2, 'p'), FIELD(table_fd, 'i'), FIELD(table_offset, 'z'), FIELD(table_type, 'i'),
    FIELD(table_row_bytes, 'z'), FIELD(table_rows, 'i'), FIELD(n_heads, 'i'), FIELD(n_kv_heads, 'i'), FIELD(head_dim, 'i'),
    FIELD(window, 'i'), FIELD(wq, 'p'), FIELD(wk, 'p'), FIELD(wv, 'p'), FIELD(q_act, 'i'), FIELD(k_act, 'i'),
    FIELD(v_act, 'i'), FIELD(bq, 'p'), FIELD(bk, 'p'), FIELD(bv, 'p'), FIELD(qnorm.weight, 'p'),
    FIELD(qnorm.eps, 'f'), FIELD(knorm.weight, 'p'), FIELD(knorm.eps, 'f'), FIELD(rope.cos, 'p'),
    FIELD(rope.sin, 'p'), FIELD(rope.dim, 'i'), FIELD(rope.neox, 'i'), FIELD(q, 'p'), FIELD(k_cache, 'p'),
    FIELD(v_cache, 'p'), FIELD(chunk_tiles, 'i'), FIELD(chunk_heads, 'i'), FIELD(negate, 'i'), FIELD(precise, 'i'),
    FIELD(qk_norm_whole, 'i'), FIELD(qk_raw, 'p'), FIELD(bias2, 'p'), FIELD(norm_b, 'p'), FIELD(layer_norm, 'i'),
    FIELD(activate, 'i'),
    FIELD(conv_w, 'p'), FIELD(state, 'p'), FIELD(conv_len, 'i'), FIELD(state_len, 'i'),
    FIELD(kv_type, 'i'),
    FIELD(softcap, 'f'),
    FIELD(n_experts, 'i'), FIELD(n_used, 'i'), FIELD(moe_gating, 'i'), FIELD(moe_normalize, 'i'), FIELD(ff, 'i'),
    FIELD(shared_ff, 'i'), FIELD(exp_gate, 'p'), FIELD(exp_up, 'p'), FIELD(exp_down, 'p'), FIELD(exp_act, 'i'),
    FIELD(sh_act, 'i'), FIELD(sh_scale_act, 'i'), FIELD(sh_gate, 'p'), FIELD(sh_up, 'p'), FIELD(sh_down, 'p'),
    FIELD(sh_scale, 'p'), FIELD(down_tiles, 'i'), FIELD(moe_route, 'p'), FIELD(moe_gates, 'p'), FIELD(moe_x, 'p'),
    FIELD(moe_h, 'p'), FIELD(moe_hs, 'p'), FIELD(moe_y, 'p'),
    FIELD(sinks, 'p'), FIELD(exp_gate_b, 'p'), FIELD(exp_up_b, 'p'), FIELD(exp_down_b, 'p'),
    FIELD(dn_z, 'p'), FIELD(dn_alpha, 'p'), FIELD(dn_beta, 'p'), FIELD(dn_decay, 'p'), FIELD(dn_dt_bias, 'p'),
    FIELD(dn_mixed, 'p'), FIELD(dn_matrices, 'p'), FIELD(dn_k_heads, 'i'), FIELD(dn_v_heads, 'i'),
    FIELD(dn_k_dim, 'i'), FIELD(dn_v_dim, 'i'),
};

static PyObject *py_op_layout(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    PyObject *fields = PyDict_New();
    if (!fields) return NULL;
    for (size_t i = 0; i < sizeof OP_FIELDS / sizeof *OP_FIELDS; i++) {
        PyObject *v = Py_BuildValue("(nC)", (Py_ssize_t)OP_FIELDS[i].offset, OP_FIELDS[i].type);
        if (!v || PyDict_SetItemString(fields, OP_FIELDS[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(fields);
            return NULL;
        }
        Py_DECREF(v);
    }
    return Py_BuildValue("(Nn)", fields, (Py_ssize_t)sizeof(kiln_op));
}

static PyObject *py_store_half(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*", &src)) return NULL;
    int n = (int)(src.len / 4);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n * 2);
    if (out) kiln_store_half(src.buf, (uint16_t *)PyBytes_AS_STRING(out), n);
    PyBuffer_Release(&src);
    return out;
}

/* kv_cache_types() -> the KV cache types' names, in the order of KV_* (kiln_op.kv_type) */
static PyObject *py_kv_cache_types(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    PyObject *names = PyTuple_New(KV_COUNT);
    for (int t = 0; names && t < KV_COUNT; t++) {
        PyObject *name = PyUnicode_FromString(KV_NAMES[t]);
        if (!name) Py_CLEAR(names);
        else PyTuple_SET_ITEM(names, t, name);
    }
    return names;
}

/* kv_row_bytes(kv_type, head_dim) -> bytes one position of one KV head's keys (or values) takes */
static PyObject *py_kv_row_bytes(PyObject *self, PyObject *args) {
    (void)self;
    int t, hd;
    if (!PyArg_ParseTuple(args, "ii", &t, &hd)) return NULL;
    if (t < 0 || t >= KV_COUNT) return PyErr_Format(PyExc_ValueError, "KV cache type %d", t);
    if (hd < 1 || (t != KV_F16 && hd % KV_BLOCK))
        return PyErr_Format(PyExc_ValueError, "a %s KV cache has no head dim %d", KV_NAMES[t], hd);
    return PyLong_FromSize_t(kiln_kv_value_row_bytes(t, hd));
}

static PyObject *py_qkv_chunks(PyObject *self, PyObject *args) {
    (void)self;
    int heads, per;
    if (!PyArg_ParseTuple(args, "ii", &heads, &per)) return NULL;
    if (heads < 0 || per < 1) {
        PyErr_SetString(PyExc_ValueError, "qkv_chunks: heads must be >= 0 and per >= 1");
        return NULL;
    }
    return PyLong_FromLong(kiln_qkv_chunks(heads, per));
}

/* checksum(buffer) -> the repack cache's checksum of its bytes (checksum.h) */
static PyObject *py_checksum(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b)) return NULL;
    kiln_sum sum;
    kiln_sum_init(&sum);
    Py_BEGIN_ALLOW_THREADS
    for (size_t at = 0; at < (size_t)b.len; at += KILN_SUM_CHUNK) {
        size_t left = (size_t)b.len - at;
        kiln_sum_chunk(&sum, (const uint8_t *)b.buf + at, left < KILN_SUM_CHUNK ? left : KILN_SUM_CHUNK);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return summed(0, &sum, NULL, 0);
}

/* file_checksum(path, nbytes) -> the checksum of a file's first nbytes, read through one chunk of memory */
static PyObject *py_file_checksum(PyObject *self, PyObject *args) {
    (void)self;
    const char *path;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "sn", &path, &nbytes)) return NULL;
    if (nbytes < 0) return PyErr_Format(PyExc_ValueError, "nbytes %zd is negative", nbytes);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return PyErr_SetFromErrnoWithFilename(PyExc_OSError, path);
    uint8_t *scratch = PyMem_RawMalloc(KILN_SUM_CHUNK);
    if (!scratch) {
        close(fd);
        return PyErr_NoMemory();
    }
    kiln_sum sum;
    kiln_sum_init(&sum);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kiln_read_summed(fd, scratch, (size_t)nbytes, 0, &sum);
    close(fd);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(scratch);
    return summed(rc, &sum, path, (size_t)nbytes);
}

static PyObject *py_pool_alone(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    int was = kiln_pool_is_alone();
    kiln_pool_alone(on);
    return PyBool_FromLong(was);
}

PyMethodDef plan_module_methods[] = {
    {"pool_alone", py_pool_alone, METH_VARARGS,
     "pool_alone(on) -> was: this thread runs every pool job on itself (True) or on the pool's threads"},
    {"qkv_chunks", py_qkv_chunks, METH_VARARGS, "qkv_chunks(heads, per) -> chunks a QKV op runs in"},
    {"pack_into", py_pack_into, METH_VARARGS, "pack_into(arena, offset, ggml_type, src, rows, cols) -> WMat"},
    {"wmat", py_wmat, METH_VARARGS, "wmat(arena, offset, fmt, rows, cols, rows_padded, tile_bytes) -> WMat"},
    {"dequant_rows", py_dequant_rows, METH_VARARGS, "dequant_rows(ggml_type, src, n) -> float32 bytes"},
    {"kv_cache_types", py_kv_cache_types, METH_NOARGS, "kv_cache_types() -> KV cache type names, by KV_* value"},
    {"kv_row_bytes", py_kv_row_bytes, METH_VARARGS, "kv_row_bytes(kv_type, head_dim) -> bytes a KV head's position takes"},
    {"store_half", py_store_half, METH_VARARGS, "store_half(float32 bytes) -> fp16 bytes (KV cache rounding)"},
    {"op_layout", py_op_layout, METH_NOARGS, "op_layout() -> ({field: (offset, type)}, sizeof(kiln_op))"},
    {"checksum", py_checksum, METH_VARARGS, "checksum(buffer) -> the repack cache's checksum (hex)"},
    {"file_checksum", py_file_checksum, METH_VARARGS, "file_checksum(path, nbytes) -> checksum of its first nbytes"},
    {NULL}};

int kiln_plan_add_types(PyObject *module) {
    PyTypeObject *types[] = {&ArenaType, &WMatType, &PoolType, &PlanType};
    const char *names[] = {"Arena", "WMat", "Pool", "Plan"};
    for (int i = 0; i < 4; i++) {
        if (PyType_Ready(types[i]) < 0) return -1;
        Py_INCREF(types[i]);
        if (PyModule_AddObject(module, names[i], (PyObject *)types[i]) < 0) return -1;
    }
    static const struct { const char *name; int value; } constants[] = {
        {"OP_EMBED", OP_EMBED}, {"OP_NORM_QUANT", OP_NORM_QUANT}, {"OP_QUANT", OP_QUANT}, {"OP_QKV", OP_QKV},
        {"OP_ATTN", OP_ATTN}, {"OP_MATMUL", OP_MATMUL}, {"OP_GLU", OP_GLU}, {"OP_NORM_ADD", OP_NORM_ADD},
        {"OP_LOGITS", OP_LOGITS}, {"OPC_MATMUL", OPC_MATMUL}, {"OPC_ATTENTION", OPC_ATTENTION},
        {"OPC_NORM", OPC_NORM}, {"OPC_HEAD", OPC_HEAD}, {"OPC_EMBED", OPC_EMBED}, {"ACT_SILU", ACT_SILU}, {"ACT_GELU_TANH", ACT_GELU_TANH}, {"ACT_SWIGLU_OAI", ACT_SWIGLU_OAI},
        {"ATTN_BLOCK", ATTN_BLOCK}, {"ATTN_SPAN", ATTN_SPAN}, {"ACT_KIND_Q8", KILN_ACT_Q8},
        {"POOL_MAX_CHUNKS", KILN_POOL_MAX_CHUNKS}, {"SAMPLE_MAX_WINDOW", KILN_SAMPLE_MAX_WINDOW},
        {"OP_SHORTCONV", OP_SHORTCONV}, {"OP_DELTANET", OP_DELTANET}, {"OP_GATE", OP_GATE},
        {"OP_MOE", OP_MOE}, {"MOE_SOFTMAX", MOE_SOFTMAX}, {"MOE_SOFTMAX_SELECTED", MOE_SOFTMAX_SELECTED},
    };
    for (size_t i = 0; i < sizeof constants / sizeof *constants; i++)
        if (PyModule_AddIntConstant(module, constants[i].name, constants[i].value) < 0) return -1;
    return 0;
}
