/* Python method tables, one per binding file, merged by module.c. */
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>

extern PyMethodDef kernel_methods[];      /* py_kernels.c: packing and matmul kernels */
extern PyMethodDef plan_module_methods[]; /* py_plan.c: arenas, pools, plans */
extern PyMethodDef validate_methods[];    /* py_validate.c: self-tests of `kiln validate` */
extern PyMethodDef sample_methods[];      /* sample.c: top-k and the sampler */
int kiln_plan_add_types(PyObject *module);

/* The engine's pool behind a kiln._native.Pool object (NULL and a TypeError for anything else). */
struct kiln_pool *kiln_pool_of(PyObject *obj);

#define KILN_SAMPLE_MAX_WINDOW 256 /* penalty windows the native sampler takes */
