/* The kiln._native module: method tables from each binding file, merged at import. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bindings.h"

static PyMethodDef *const TABLES[] = {kernel_methods, plan_module_methods, validate_methods, sample_methods, NULL};

static PyMethodDef methods[128];

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kiln._native", "kiln's native core.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    int n = 0;
    for (int t = 0; TABLES[t]; t++)
        for (PyMethodDef *m = TABLES[t]; m->ml_name; m++) {
            if (n >= (int)(sizeof methods / sizeof *methods) - 1) {
                PyErr_SetString(PyExc_RuntimeError, "kiln._native: too many methods");
                return NULL;
            }
            methods[n++] = *m;
        }
    PyObject *m = PyModule_Create(&module);
    if (m && kiln_plan_add_types(m) < 0) Py_CLEAR(m);
    return m;
}
