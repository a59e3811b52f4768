/* Python bindings of the kernel interface: plain ints and buffers, checked so that a wrong size
   raises instead of reading or writing out of bounds. kiln/native/kernels.py wraps them for numpy. */
#include "bindings.h"
#include "act.h"
#include "attn_quant.h"
#include "kernels.h"

static int get_buf(PyObject *o, Py_buffer *v, int writable, Py_ssize_t need, const char *what) {
    if (PyObject_GetBuffer(o, v, writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (v->len < need) {
        PyErr_Format(PyExc_ValueError, "%s: buffer of %zd bytes, need %zd", what, v->len, need);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static PyObject *py_isa_detect(PyObject *self, PyObject *args) { return PyLong_FromLong(kiln_detect_isa()); }
static PyObject *py_isa_active(PyObject *self, PyObject *args) { return PyLong_FromLong(kiln_active_isa()); }
static PyObject *py_amx_min_tokens(PyObject *self, PyObject *args) {
#if KILN_X86
    return PyLong_FromLong(KILN_AMX_MIN_TOKENS);
#else
    Py_RETURN_NONE;
#endif
}

static PyObject *py_isa_error(PyObject *self, PyObject *args) {
    const char *e = kiln_isa_error();
    if (!e) Py_RETURN_NONE;
    return PyUnicode_FromString(e);
}

static int isa_arg(PyObject *args, int *isa) {
    if (!PyArg_ParseTuple(args, "i", isa)) return -1;
    if (*isa < ISA_GENERIC || *isa > ISA_AMX) {
        PyErr_Format(PyExc_ValueError, "unknown ISA %d", *isa);
        return -1;
    }
    return 0;
}

static PyObject *py_isa_missing(PyObject *self, PyObject *args) {
    int isa;
    if (isa_arg(args, &isa)) return NULL;
    const char *m = kiln_isa_missing((kiln_isa)isa);
    if (!m) Py_RETURN_NONE;
    return PyUnicode_FromString(m);
}

static PyObject *py_isa_force(PyObject *self, PyObject *args) {
    int isa;
    if (isa_arg(args, &isa)) return NULL;
    if (kiln_force_isa((kiln_isa)isa)) {
        PyErr_Format(PyExc_RuntimeError, "cannot use ISA %s: CPU lacks %s", kiln_isa_name((kiln_isa)isa), kiln_isa_missing((kiln_isa)isa));
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_wfmt_for_ggml(PyObject *self, PyObject *args) {
    int t;
    if (!PyArg_ParseTuple(args, "i", &t)) return NULL;
    return PyLong_FromLong(kiln_wfmt_for_ggml(t));
}

static PyObject *py_pack_size(PyObject *self, PyObject *args) {
    int t, rows, cols;
    if (!PyArg_ParseTuple(args, "iii", &t, &rows, &cols)) return NULL;
    return PyLong_FromSize_t(kiln_pack_size(t, rows, cols));
}

/* pack(ggml_type, src, rows, cols, dst) -> (fmt, rows_padded, tile_bytes) */
static PyObject *py_pack(PyObject *self, PyObject *args) {
    int t, rows, cols;
    PyObject *so, *dobj;
    if (!PyArg_ParseTuple(args, "iOiiO", &t, &so, &rows, &cols, &dobj)) return NULL;
    size_t need = kiln_pack_size(t, rows, cols), row_bytes = kiln_ggml_row_bytes(t, cols);
    if (!need || !row_bytes) return PyErr_Format(PyExc_ValueError, "cannot pack GGML type %d with shape (%d, %d)", t, rows, cols);
    Py_buffer src, dst;
    if (get_buf(so, &src, 0, (Py_ssize_t)(row_bytes * rows), "pack source")) return NULL;
    if (get_buf(dobj, &dst, 1, (Py_ssize_t)need, "pack destination")) {
        PyBuffer_Release(&src);
        return NULL;
    }
    kiln_wmat w;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kiln_pack(t, src.buf, rows, cols, dst.buf, &w);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (rc) return PyErr_Format(PyExc_ValueError, "kiln_pack failed for GGML type %d", t);
    return Py_BuildValue("iin", (int)w.fmt, w.rows_padded, (Py_ssize_t)w.tile_bytes);
}

/* kernel_formats() -> ({name: kiln_wfmt}, {name: activation kind}): Python's Format and ActKind enums,
 * named as kernels.h names them (less the prefix), so the two sides cannot drift apart. */
#define NAMED(value, prefix) {#value + sizeof(prefix) - 1, value}
typedef struct {
    const char *name;
    int value;
} named;
static const named KERNEL_FORMATS[] = {
    NAMED(KF_F32, "KF_"), NAMED(KF_F16, "KF_"), NAMED(KF_BF16, "KF_"), NAMED(KF_Q4_1, "KF_"), NAMED(KF_Q4_K, "KF_"),
    NAMED(KF_Q5_0, "KF_"), NAMED(KF_Q5_K, "KF_"), NAMED(KF_Q8_0, "KF_"), NAMED(KF_Q6_K, "KF_"), NAMED(KF_Q4_0, "KF_"),
    NAMED(KF_MXFP4, "KF_"),
}, ACT_KINDS[] = {NAMED(KILN_ACT_F32, "KILN_ACT_"), NAMED(KILN_ACT_Q8, "KILN_ACT_")};
_Static_assert(sizeof KERNEL_FORMATS / sizeof *KERNEL_FORMATS == KF_COUNT, "every kernel format is named");

static PyObject *named_dict(const named *values, size_t n) {
    PyObject *d = PyDict_New();
    for (size_t i = 0; d && i < n; i++) {
        PyObject *v = PyLong_FromLong(values[i].value);
        if (!v || PyDict_SetItemString(d, values[i].name, v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject *py_kernel_formats(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    return Py_BuildValue("(NN)", named_dict(KERNEL_FORMATS, KF_COUNT), named_dict(ACT_KINDS, 2));
}

static int fmt_arg(int fmt) {
    if (fmt < 0 || fmt >= KF_COUNT) {
        PyErr_Format(PyExc_ValueError, "unknown weight format %d", fmt);
        return -1;
    }
    return 0;
}

static PyObject *py_act_kind(PyObject *self, PyObject *args) {
    int fmt;
    if (!PyArg_ParseTuple(args, "i", &fmt) || fmt_arg(fmt)) return NULL;
    return PyLong_FromLong(kiln_act_kind((kiln_wfmt)fmt));
}

static PyObject *py_act_size(PyObject *self, PyObject *args) {
    int fmt, cols, n;
    if (!PyArg_ParseTuple(args, "iii", &fmt, &cols, &n) || fmt_arg(fmt)) return NULL;
    return PyLong_FromSize_t(kiln_act_size((kiln_wfmt)fmt, cols, n));
}

/* quantize_act(fmt, x, ldx, cols, n_tok, act) */
static PyObject *py_quantize_act(PyObject *self, PyObject *args) {
    int fmt, ldx, cols, n;
    PyObject *xo, *ao;
    if (!PyArg_ParseTuple(args, "iOiiiO", &fmt, &xo, &ldx, &cols, &n, &ao) || fmt_arg(fmt)) return NULL;
    if (cols <= 0 || n <= 0 || ldx < cols || (!kiln_fmt_is_float((kiln_wfmt)fmt) && cols % 32))
        return PyErr_Format(PyExc_ValueError, "bad activation shape: cols %d, n_tok %d, ldx %d", cols, n, ldx);
    Py_buffer x, a;
    if (get_buf(xo, &x, 0, (Py_ssize_t)(((size_t)(n - 1) * ldx + cols) * 4), "activations")) return NULL;
    if (get_buf(ao, &a, 1, (Py_ssize_t)kiln_act_size((kiln_wfmt)fmt, cols, n), "activation buffer")) {
        PyBuffer_Release(&x);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    kiln_quantize_act((kiln_wfmt)fmt, x.buf, ldx, cols, n, a.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    PyBuffer_Release(&a);
    Py_RETURN_NONE;
}

/* quantize_act_pair(fmt, x, cols, first, second): one token's precise pair */
static PyObject *py_quantize_act_pair(PyObject *self, PyObject *args) {
    int fmt, cols;
    PyObject *xo, *fo, *so;
    if (!PyArg_ParseTuple(args, "iOiOO", &fmt, &xo, &cols, &fo, &so) || fmt_arg(fmt)) return NULL;
    if (kiln_act_kind((kiln_wfmt)fmt) != KILN_ACT_Q8 || cols <= 0 || cols % 32)
        return PyErr_Format(PyExc_ValueError, "a precise pair needs an integer format and cols a multiple of 32, got cols %d", cols);
    size_t stride = kiln_act_stride((kiln_wfmt)fmt, cols);
    Py_buffer x, first, second;
    if (get_buf(xo, &x, 0, (Py_ssize_t)cols * 4, "activations")) return NULL;
    if (get_buf(fo, &first, 1, (Py_ssize_t)stride, "first row buffer")) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (get_buf(so, &second, 1, (Py_ssize_t)stride, "second row buffer")) {
        PyBuffer_Release(&x);
        PyBuffer_Release(&first);
        return NULL;
    }
    float *residual = PyMem_RawMalloc(sizeof(float) * (size_t)cols);
    if (residual) {
        Py_BEGIN_ALLOW_THREADS
        kiln_quantize_act_pair((kiln_wfmt)fmt, x.buf, cols, first.buf, second.buf, residual);
        Py_END_ALLOW_THREADS
        PyMem_RawFree(residual);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&first);
    PyBuffer_Release(&second);
    if (!residual) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* unpack_row(ggml_type, rows, cols, tile_bytes, data, row, out): a packed row back to its GGUF bytes */
static PyObject *py_unpack_row(PyObject *self, PyObject *args) {
    int ggml, rows, cols, row;
    Py_ssize_t tile_bytes;
    PyObject *wo, *oo;
    if (!PyArg_ParseTuple(args, "iiinOiO", &ggml, &rows, &cols, &tile_bytes, &wo, &row, &oo)) return NULL;
    int fmt = kiln_wfmt_for_ggml(ggml), tiles = (rows + 3) / 4;
    if (fmt < 0 || rows <= 0 || cols <= 0 || (size_t)tile_bytes != kiln_tile_bytes((kiln_wfmt)fmt, cols))
        return PyErr_Format(PyExc_ValueError, "bad packed matrix: type %d, %d x %d, tile_bytes %zd", ggml, rows, cols, tile_bytes);
    if (row < 0 || row >= rows) return PyErr_Format(PyExc_IndexError, "row %d of a matrix of %d rows", row, rows);
    Py_buffer wb, ob;
    if (get_buf(wo, &wb, 0, tiles * tile_bytes + KILN_PACK_SLACK, "packed weights")) return NULL;
    if (get_buf(oo, &ob, 1, (Py_ssize_t)kiln_ggml_row_bytes(ggml, cols), "row buffer")) {
        PyBuffer_Release(&wb);
        return NULL;
    }
    kiln_wmat w = {(kiln_wfmt)fmt, rows, cols, tiles * 4, (size_t)tile_bytes, wb.buf};
    kiln_unpack_row(&w, row, ob.buf);
    PyBuffer_Release(&wb);
    PyBuffer_Release(&ob);
    Py_RETURN_NONE;
}

/* kv_rotate(x, out): out = the quantized KV cache's rotation of float32 x (attn_quant.h), whole blocks of 32 */
static PyObject *py_kv_rotate(PyObject *self, PyObject *args) {
    Py_buffer xb, ob;
    if (!PyArg_ParseTuple(args, "y*w*", &xb, &ob)) return NULL;
    PyObject *ret = NULL;
    if (xb.len != ob.len || xb.len % (4 * KV_BLOCK))
        PyErr_Format(PyExc_ValueError, "kv_rotate: %zd and %zd bytes are not equal whole blocks of %d floats", xb.len,
                     ob.len, KV_BLOCK);
    else {
        kiln_kv_rotate(xb.buf, ob.buf, (int)(xb.len / 4));
        ret = Py_None;
        Py_INCREF(ret);
    }
    PyBuffer_Release(&xb);
    PyBuffer_Release(&ob);
    return ret;
}

/* split_q8_0(src) -> (hi, lo) GGUF bytes of a Q8_0 tensor split in two (kernels.h), or None if it cannot be */
static PyObject *py_split_q8_0(PyObject *self, PyObject *args) {
    Py_buffer src;
    if (!PyArg_ParseTuple(args, "y*", &src)) return NULL;
    if (src.len % 34) {
        PyBuffer_Release(&src);
        return PyErr_Format(PyExc_ValueError, "Q8_0 data of %zd bytes is not whole 34-byte blocks", src.len);
    }
    size_t n = (size_t)src.len / 34;
    PyObject *hi = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(22 * n)), *lo = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(18 * n));
    if (!hi || !lo) {
        Py_XDECREF(hi);
        Py_XDECREF(lo);
        PyBuffer_Release(&src);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = kiln_split_q8_0(src.buf, n, (uint8_t *)PyBytes_AS_STRING(hi), (uint8_t *)PyBytes_AS_STRING(lo));
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    if (rc < 0) {
        Py_DECREF(hi);
        Py_DECREF(lo);
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(NN)", hi, lo);
}

/* unpack_split_row(rows, cols, hi_tile_bytes, hi_data, lo_tile_bytes, lo_data, row, out): a row of a split
   pair back to its Q8_0 bytes */
static PyObject *py_unpack_split_row(PyObject *self, PyObject *args) {
    int rows, cols, row;
    Py_ssize_t hi_tb, lo_tb;
    PyObject *ho, *lo_o, *oo;
    if (!PyArg_ParseTuple(args, "iinOnOiO", &rows, &cols, &hi_tb, &ho, &lo_tb, &lo_o, &row, &oo)) return NULL;
    int tiles = (rows + 3) / 4;
    if (rows <= 0 || cols <= 0 || cols % 32 || (size_t)hi_tb != kiln_tile_bytes(KF_Q5_0, cols) ||
        (size_t)lo_tb != kiln_tile_bytes(KF_Q4_0, cols))
        return PyErr_Format(PyExc_ValueError, "bad split matrix: %d x %d, tile_bytes %zd and %zd", rows, cols, hi_tb, lo_tb);
    if (row < 0 || row >= rows) return PyErr_Format(PyExc_IndexError, "row %d of a matrix of %d rows", row, rows);
    Py_buffer hb, lb, ob;
    if (get_buf(ho, &hb, 0, tiles * hi_tb + KILN_PACK_SLACK, "packed high bits")) return NULL;
    if (get_buf(lo_o, &lb, 0, tiles * lo_tb + KILN_PACK_SLACK, "packed low bits")) {
        PyBuffer_Release(&hb);
        return NULL;
    }
    if (get_buf(oo, &ob, 1, (Py_ssize_t)cols / 32 * 34, "row buffer")) {
        PyBuffer_Release(&hb);
        PyBuffer_Release(&lb);
        return NULL;
    }
    kiln_wmat hi = {KF_Q5_0, rows, cols, tiles * 4, (size_t)hi_tb, hb.buf}, lo = {KF_Q4_0, rows, cols, tiles * 4, (size_t)lo_tb, lb.buf};
    uint8_t *work = PyMem_RawMalloc((size_t)cols / 32 * 40);
    if (work) kiln_unpack_split_row(&hi, &lo, row, ob.buf, work);
    PyMem_RawFree(work);
    PyBuffer_Release(&hb);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&ob);
    if (!work) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* matmul(fmt, rows, cols, tile_bytes, data, act, n_tok, y, ldy, tile0, tile1) */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    int fmt, rows, cols, n, ldy, tile0, tile1;
    Py_ssize_t tile_bytes;
    PyObject *wo, *ao, *yo;
    if (!PyArg_ParseTuple(args, "iiinOOiOiii", &fmt, &rows, &cols, &tile_bytes, &wo, &ao, &n, &yo, &ldy, &tile0, &tile1) || fmt_arg(fmt))
        return NULL;
    int tiles = (rows + 3) / 4;
    if (rows <= 0 || cols <= 0 || n <= 0 || ldy < rows || tile0 < 0 || tile1 > tiles || tile0 > tile1)
        return PyErr_Format(PyExc_ValueError, "bad matmul arguments: rows %d, cols %d, n_tok %d, ldy %d, tiles [%d, %d)", rows, cols, n, ldy, tile0, tile1);
    if ((size_t)tile_bytes != kiln_tile_bytes((kiln_wfmt)fmt, cols))
        return PyErr_Format(PyExc_ValueError, "tile_bytes %zd does not match format %d with %d columns", tile_bytes, fmt, cols);
    Py_buffer wb, ab, yb;
    if (get_buf(wo, &wb, 0, tiles * tile_bytes + KILN_PACK_SLACK, "packed weights")) return NULL;
    if (get_buf(ao, &ab, 0, (Py_ssize_t)kiln_act_size((kiln_wfmt)fmt, cols, n), "activation buffer")) {
        PyBuffer_Release(&wb);
        return NULL;
    }
    if (get_buf(yo, &yb, 1, (Py_ssize_t)(((size_t)(n - 1) * ldy + rows) * 4), "output")) {
        PyBuffer_Release(&wb);
        PyBuffer_Release(&ab);
        return NULL;
    }
    kiln_wmat w = {(kiln_wfmt)fmt, rows, cols, tiles * 4, (size_t)tile_bytes, wb.buf};
    Py_BEGIN_ALLOW_THREADS
    kiln_matmul(&w, ab.buf, n, yb.buf, ldy, tile0, tile1);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&wb);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&yb);
    Py_RETURN_NONE;
}

/* ---- huge-page buffers: a minimal object exposing kiln_alloc_huge memory as a writable buffer ---- */

typedef struct {
    PyObject_HEAD
    void *p;
    Py_ssize_t size;
} HugeBuffer;

static void huge_dealloc(HugeBuffer *self) {
    kiln_free_huge(self->p);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int huge_getbuffer(HugeBuffer *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->p, self->size, 0, flags);
}

static PyBufferProcs huge_as_buffer = {(getbufferproc)huge_getbuffer, NULL};

static PyTypeObject HugeBufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kiln._native.HugeBuffer",
    .tp_basicsize = sizeof(HugeBuffer),
    .tp_dealloc = (destructor)huge_dealloc,
    .tp_as_buffer = &huge_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Memory from kiln_alloc_huge: 2 MiB aligned, huge pages advised.",
};

static PyObject *py_huge_buffer(PyObject *self, PyObject *args) {
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "n", &size)) return NULL;
    if (size <= 0) return PyErr_Format(PyExc_ValueError, "huge_buffer: size %zd", size);
    if (PyType_Ready(&HugeBufferType) < 0) return NULL;
    HugeBuffer *b = PyObject_New(HugeBuffer, &HugeBufferType);
    if (!b) return NULL;
    b->size = size;
    b->p = kiln_alloc_huge((size_t)size);
    if (!b->p) {
        Py_DECREF(b);
        return PyErr_NoMemory();
    }
    return (PyObject *)b;
}

static PyObject *py_mem_read(PyObject *self, PyObject *args) {
    PyObject *o;
    if (!PyArg_ParseTuple(args, "O", &o)) return NULL;
    Py_buffer b;
    if (get_buf(o, &b, 0, 0, "mem_read")) return NULL;
    uint64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = kiln_mem_read(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(r);
}

PyMethodDef kernel_methods[] = {
    {"isa_detect", py_isa_detect, METH_NOARGS, "Best ISA the CPU supports (0 generic, 1 avx2, 2 avx512, 3 amx)."},
    {"isa_active", py_isa_active, METH_NOARGS, "ISA the kernels dispatch to."},
    {"isa_error", py_isa_error, METH_NOARGS, "Why KILN_ISA could not be honoured, or None."},
    {"amx_min_tokens", py_amx_min_tokens, METH_NOARGS, "Tokens from which an integer matmul runs on AMX tiles (None off x86)."},
    {"isa_missing", py_isa_missing, METH_VARARGS, "First CPU feature an ISA needs that is missing, or None."},
    {"isa_force", py_isa_force, METH_VARARGS, "Use this ISA from now on; RuntimeError if the CPU lacks it."},
    {"wfmt_for_ggml", py_wfmt_for_ggml, METH_VARARGS, "Kernel format of a GGML type, or -1."},
    {"kernel_formats", py_kernel_formats, METH_NOARGS, "({format name: kiln_wfmt}, {activation kind name: value})."},
    {"pack_size", py_pack_size, METH_VARARGS, "Bytes kiln_pack writes (0: unsupported)."},
    {"pack", py_pack, METH_VARARGS, "pack(ggml_type, src, rows, cols, dst) -> (fmt, rows_padded, tile_bytes)."},
    {"act_kind", py_act_kind, METH_VARARGS, "Activation layout a format consumes."},
    {"act_size", py_act_size, METH_VARARGS, "act_size(fmt, cols, n_tok) -> bytes."},
    {"quantize_act", py_quantize_act, METH_VARARGS, "quantize_act(fmt, x, ldx, cols, n_tok, act)."},
    {"unpack_row", py_unpack_row, METH_VARARGS, "unpack_row(ggml_type, rows, cols, tile_bytes, data, row, out)."},
    {"kv_rotate", py_kv_rotate, METH_VARARGS, "kv_rotate(x, out): a quantized KV cache's rotation of float32 x."},
    {"split_q8_0", py_split_q8_0, METH_VARARGS, "split_q8_0(src) -> (hi, lo) GGUF bytes (Q5_0, Q4_0), or None."},
    {"unpack_split_row", py_unpack_split_row, METH_VARARGS,
     "unpack_split_row(rows, cols, hi_tile_bytes, hi_data, lo_tile_bytes, lo_data, row, out)."},
    {"quantize_act_pair", py_quantize_act_pair, METH_VARARGS, "quantize_act_pair(fmt, x, cols, first, second)."},
    {"matmul", py_matmul, METH_VARARGS, "matmul(fmt, rows, cols, tile_bytes, data, act, n_tok, y, ldy, tile0, tile1)."},
    {"huge_buffer", py_huge_buffer, METH_VARARGS, "huge_buffer(size) -> writable buffer on huge pages."},
    {"mem_read", py_mem_read, METH_VARARGS, "Read every byte of a buffer once (bandwidth reference)."},
    {NULL, NULL, 0, NULL},
};
