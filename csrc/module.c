/* fastkern._C: the CPython face of csrc/fastkern.h. Argument parsing and error translation only.
 *
 * Every op takes data pointers as Python ints, sizes, a dtype code, a device index (-1 = CPU) and a
 * CUDA stream handle (an int), which on the CPU is instead the number of threads the kernel may use
 * (torch.get_num_threads() from the Python layer). The Python layer (python/fastkern/ops) validates
 * tensors and allocates outputs; this layer forwards to the CPU or CUDA entry point and maps a
 * failed status to ValueError / TypeError / RuntimeError with the C message. CPU kernels run with
 * the GIL released. Arguments arrive as METH_FASTCALL arrays (stable ABI from CPython 3.10): no
 * argument tuple and no format-string walk per call: ~0.1 us of a tiny call's host time (D-104).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdarg.h>
#include <string.h>

#include "fastkern.h"

#ifdef FASTKERN_WITH_CUDA
#define FK_HAS_CUDA 1
#else
#define FK_HAS_CUDA 0
#endif

static PyObject *raise_status(fk_status status) {
    PyObject *type = status == FK_ERR_VALUE  ? PyExc_ValueError
                     : status == FK_ERR_TYPE ? PyExc_TypeError
                                             : PyExc_RuntimeError;
    PyErr_SetString(type, fk_error_message());
    return NULL;
}

static PyObject *finish(fk_status status) {
    if (status != FK_OK) return raise_status(status);
    Py_RETURN_NONE;
}

#if !FK_HAS_CUDA
static PyObject *no_cuda(const char *op) {
    PyErr_Format(PyExc_RuntimeError,
                 "fastkern.%s: this build of fastkern has no CUDA support (rebuild with nvcc on the "
                 "PATH, or FASTKERN_CUDA=1)", op);
    return NULL;
}
#endif

#define PTR(v) ((void *)(uintptr_t)(v))

/* Converts the positional arguments of `op` one format character each, into the pointers that
 * follow (the conversions of PyArg_ParseTuple's codes of the same letters): K an int's low 64 bits
 * (a pointer or stream handle), L a 64-bit int, i an int, d a float, p a truth value. 0 with a
 * TypeError / OverflowError set on a wrong count or a bad argument. */
static int parse(const char *op, PyObject *const *args, Py_ssize_t nargs, const char *format, ...) {
    Py_ssize_t expected = (Py_ssize_t)strlen(format);
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "fastkern._C.%s takes %zd arguments (%zd given)", op, expected, nargs);
        return 0;
    }
    va_list out;
    va_start(out, format);
    int ok = 1;
    for (Py_ssize_t i = 0; ok && i < nargs; i++) {
        PyObject *arg = args[i];
        switch (format[i]) {
        case 'K': {
            unsigned long long v = PyLong_AsUnsignedLongLongMask(arg);
            ok = v != (unsigned long long)-1 || !PyErr_Occurred();
            *va_arg(out, unsigned long long *) = v;
            break;
        }
        case 'L': {
            long long v = PyLong_AsLongLong(arg);
            ok = v != -1 || !PyErr_Occurred();
            *va_arg(out, long long *) = v;
            break;
        }
        case 'i': {
            long v = PyLong_AsLong(arg);
            ok = v != -1 || !PyErr_Occurred();
            if (ok && (v < INT_MIN || v > INT_MAX)) {
                PyErr_Format(PyExc_OverflowError, "fastkern._C.%s: argument %zd does not fit an int", op, i + 1);
                ok = 0;
            }
            *va_arg(out, int *) = (int)v;
            break;
        }
        case 'd': {
            double v = PyFloat_AsDouble(arg);
            ok = v != -1.0 || !PyErr_Occurred();
            *va_arg(out, double *) = v;
            break;
        }
        default: { /* 'p' */
            int v = PyObject_IsTrue(arg);
            ok = v >= 0;
            *va_arg(out, int *) = v;
        }
        }
    }
    va_end(out);
    return ok;
}

/* The stream argument of a CPU call: its thread count, at least 1. */
static int cpu_threads(unsigned long long stream) {
    return stream < 1 ? 1 : stream > 1024 ? 1024 : (int)stream;
}

/* gelu_fwd(x, bias, y, rows, cols, approximate, dtype, device, stream) */
static PyObject *py_gelu_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned long long x, bias, y, stream;
    long long rows, cols;
    int approximate, dtype, device;
    if (!parse("gelu_fwd", args, nargs, "KKKLLiiiK", &x, &bias, &y, &rows, &cols, &approximate,
               &dtype, &device, &stream))
        return NULL;
    fk_status status;
    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        status = fk_cpu_gelu_fwd(PTR(x), PTR(bias), PTR(y), rows, cols, approximate, (fk_dtype)dtype,
                                 cpu_threads(stream));
        Py_END_ALLOW_THREADS
    } else {
#if FK_HAS_CUDA
        status = fk_cuda_gelu_fwd(PTR(x), PTR(bias), PTR(y), rows, cols, approximate,
                                  (fk_dtype)dtype, device, PTR(stream));
#else
        return no_cuda("gelu");
#endif
    }
    return finish(status);
}

/* gelu_bwd(dy, x, bias, dx, dbias, y, workspace, rows, cols, approximate, dtype, device, stream);
 * y: 0, or where gelu(x + bias) goes in the same pass */
static PyObject *py_gelu_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned long long dy, x, bias, dx, dbias, y, workspace, stream;
    long long rows, cols;
    int approximate, dtype, device;
    if (!parse("gelu_bwd", args, nargs, "KKKKKKKLLiiiK", &dy, &x, &bias, &dx, &dbias, &y, &workspace,
               &rows, &cols, &approximate, &dtype, &device, &stream))
        return NULL;
    fk_status status;
    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        status = fk_cpu_gelu_bwd(PTR(dy), PTR(x), PTR(bias), PTR(dx), PTR(dbias), PTR(y), rows, cols,
                                 approximate, (fk_dtype)dtype, cpu_threads(stream));
        Py_END_ALLOW_THREADS
    } else {
#if FK_HAS_CUDA
        status = fk_cuda_gelu_bwd(PTR(dy), PTR(x), PTR(bias), PTR(dx), PTR(dbias), PTR(y), PTR(workspace),
                                  rows, cols, approximate, (fk_dtype)dtype, device, PTR(stream));
#else
        return no_cuda("gelu");
#endif
    }
    return finish(status);
}

/* gelu_bwd_workspace(dy, x, bias, dx, y, rows, cols, approximate, dtype, device) -> fp32 elements
 * the CUDA bias gradient needs for that call (0 on CPU) */
static PyObject *py_gelu_bwd_workspace(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned long long dy, x, bias, dx, y;
    long long rows, cols;
    int approximate, dtype, device;
    if (!parse("gelu_bwd_workspace", args, nargs, "KKKKKLLiii", &dy, &x, &bias, &dx, &y, &rows, &cols,
               &approximate, &dtype, &device))
        return NULL;
#if FK_HAS_CUDA
    if (device >= 0)
        return PyLong_FromLongLong(fk_cuda_gelu_bwd_workspace(PTR(dy), PTR(x), PTR(bias), PTR(dx),
                                                              PTR(y), rows, cols, approximate,
                                                              (fk_dtype)dtype, device));
#else
    (void)dy, (void)x, (void)bias, (void)dx, (void)y, (void)rows, (void)cols, (void)approximate, (void)dtype;
#endif
    return PyLong_FromLong(0);
}

/* softmax_fwd(x, y, row_max, outer, n, inner, scale, causal_sq, log, dtype, device, stream) */
static PyObject *py_softmax_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned long long x, y, row_max, stream;
    long long outer, n, inner, causal_sq;
    double scale;
    int log, dtype, device;
    if (!parse("softmax_fwd", args, nargs, "KKKLLLdLiiiK", &x, &y, &row_max, &outer, &n, &inner,
               &scale, &causal_sq, &log, &dtype, &device, &stream))
        return NULL;
    fk_status status;
    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        status = fk_cpu_softmax_fwd(PTR(x), PTR(y), PTR(row_max), outer, n, inner, scale, causal_sq, log,
                                    (fk_dtype)dtype, cpu_threads(stream));
        Py_END_ALLOW_THREADS
    } else {
#if FK_HAS_CUDA
        status = fk_cuda_softmax_fwd(PTR(x), PTR(y), PTR(row_max), outer, n, inner, scale, causal_sq,
                                     log, (fk_dtype)dtype, device, PTR(stream));
#else
        return no_cuda("softmax");
#endif
    }
    return finish(status);
}

/* softmax_bwd(dy, x, row_max, dx, outer, n, inner, scale, causal_sq, log, dtype, device, stream): the
 * CUDA backward, which recomputes y from x and the row max (the CPU's reads y: below) */
static PyObject *py_softmax_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned long long dy, x, row_max, dx, stream;
    long long outer, n, inner, causal_sq;
    double scale;
    int log, dtype, device;
    if (!parse("softmax_bwd", args, nargs, "KKKKLLLdLiiiK", &dy, &x, &row_max, &dx, &outer, &n,
               &inner, &scale, &causal_sq, &log, &dtype, &device, &stream))
        return NULL;
    if (device < 0) {
        PyErr_SetString(PyExc_ValueError, "fastkern.softmax: the CPU backward reads the forward's "
                                          "output (softmax_bwd_from_output), not x");
        return NULL;
    }
#if FK_HAS_CUDA
    return finish(fk_cuda_softmax_bwd(PTR(dy), PTR(x), PTR(row_max), PTR(dx), outer, n, inner, scale,
                                      causal_sq, log, (fk_dtype)dtype, device, PTR(stream)));
#else
    return no_cuda("softmax");
#endif
}

/* softmax_bwd_from_output(dy, y, dx, outer, n, inner, scale, causal_sq, log, dtype, threads): the CPU
 * backward, from the forward's output y */
static PyObject *py_softmax_bwd_from_output(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned long long dy, y, dx, threads;
    long long outer, n, inner, causal_sq;
    double scale;
    int log, dtype;
    if (!parse("softmax_bwd_from_output", args, nargs, "KKKLLLdLiiK", &dy, &y, &dx, &outer, &n,
               &inner, &scale, &causal_sq, &log, &dtype, &threads))
        return NULL;
    fk_status status;
    Py_BEGIN_ALLOW_THREADS
    status = fk_cpu_softmax_bwd_from_output(PTR(dy), PTR(y), PTR(dx), outer, n, inner, scale, causal_sq,
                                            log, (fk_dtype)dtype, cpu_threads(threads));
    Py_END_ALLOW_THREADS
    return finish(status);
}

/* ---- cross-entropy ---------------------------------------------------------------------------- */

/* cross_entropy_fwd(x, target, loss, lse, valid, workspace, rows, classes, x_ld, ignore_index,
 *                   label_smoothing, reduction, dtype, loss_dtype, device, stream) */
static PyObject *py_cross_entropy_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned long long x, target, loss, lse, valid, workspace, stream;
    long long rows, classes, x_ld, ignore_index;
    double label_smoothing;
    int reduction, dtype, loss_dtype, device;
    if (!parse("cross_entropy_fwd", args, nargs, "KKKKKKLLLLdiiiiK", &x, &target, &loss, &lse,
               &valid, &workspace, &rows, &classes, &x_ld, &ignore_index, &label_smoothing,
               &reduction, &dtype, &loss_dtype, &device, &stream))
        return NULL;
    fk_status status;
    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        status = fk_cpu_cross_entropy_fwd(PTR(x), PTR(target), PTR(loss), PTR(lse), PTR(valid),
                                          PTR(workspace), rows, classes, x_ld, ignore_index, label_smoothing,
                                          reduction, (fk_dtype)dtype, (fk_dtype)loss_dtype, cpu_threads(stream));
        Py_END_ALLOW_THREADS
    } else {
#if FK_HAS_CUDA
        status = fk_cuda_cross_entropy_fwd(PTR(x), PTR(target), PTR(loss), PTR(lse), PTR(valid),
                                           PTR(workspace), rows, classes, x_ld, ignore_index, label_smoothing,
                                           reduction, (fk_dtype)dtype, (fk_dtype)loss_dtype, device, PTR(stream));
#else
        return no_cuda("cross_entropy");
#endif
    }
    return finish(status);
}

/* cross_entropy_bwd(grad, x, target, lse, valid, dx, rows, classes, x_ld, dx_ld, ignore_index,
 *                   label_smoothing, reduction, dtype, loss_dtype, device, stream) */
static PyObject *py_cross_entropy_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned long long grad, x, target, lse, valid, dx, stream;
    long long rows, classes, x_ld, dx_ld, ignore_index;
    double label_smoothing;
    int reduction, dtype, loss_dtype, device;
    if (!parse("cross_entropy_bwd", args, nargs, "KKKKKKLLLLLdiiiiK", &grad, &x, &target, &lse,
               &valid, &dx, &rows, &classes, &x_ld, &dx_ld, &ignore_index, &label_smoothing,
               &reduction, &dtype, &loss_dtype, &device, &stream))
        return NULL;
    fk_status status;
    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        status = fk_cpu_cross_entropy_bwd(PTR(grad), PTR(x), PTR(target), PTR(lse), PTR(valid), PTR(dx),
                                          rows, classes, x_ld, dx_ld, ignore_index, label_smoothing, reduction,
                                          (fk_dtype)dtype, (fk_dtype)loss_dtype, cpu_threads(stream));
        Py_END_ALLOW_THREADS
    } else {
#if FK_HAS_CUDA
        status = fk_cuda_cross_entropy_bwd(PTR(grad), PTR(x), PTR(target), PTR(lse), PTR(valid), PTR(dx),
                                           rows, classes, x_ld, dx_ld, ignore_index, label_smoothing, reduction,
                                           (fk_dtype)dtype, (fk_dtype)loss_dtype, device, PTR(stream));
#else
        return no_cuda("cross_entropy");
#endif
    }
    return finish(status);
}

/* ---- matmul ----------------------------------------------------------------------------------- */

/* Parses the fk_matmul_args fields shared by matmul and matmul_plan (in fastkern.h's order); the
 * stream is parsed too when `stream` is not NULL. */
static int parse_matmul(const char *op, PyObject *const *args, Py_ssize_t nargs, fk_matmul_args *g,
                        int *device, unsigned long long *stream) {
    unsigned long long a, b, bias, c, pre;
    long long batch, m, n, k, a_batch, a_row, a_col, b_batch, b_row, b_col, c_batch, c_row;
    int dtype, activation, flags;
    int ok = parse(op, args, nargs, stream ? "KKKKKLLLLLLLLLLLLiiiiK" : "KKKKKLLLLLLLLLLLLiiii", &a, &b,
                   &bias, &c, &pre, &batch, &m, &n, &k, &a_batch, &a_row, &a_col, &b_batch, &b_row,
                   &b_col, &c_batch, &c_row, &dtype, &activation, &flags, device, stream);
    if (!ok) return 0;
    *g = (fk_matmul_args){PTR(a), PTR(b), PTR(bias), PTR(c), PTR(pre), batch, m, n, k, a_batch,
                          a_row, a_col, b_batch, b_row, b_col, c_batch, c_row, (fk_dtype)dtype,
                          activation, flags};
    return 1;
}

/* matmul(a, b, bias, c, pre, batch, m, n, k, a_batch, a_row, a_col, b_batch, b_row, b_col,
 *        c_batch, c_row, dtype, activation, flags, device, stream) */
static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    fk_matmul_args g;
    int device;
    unsigned long long stream;
    if (!parse_matmul("matmul", args, nargs, &g, &device, &stream)) return NULL;
    fk_status status;
    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        status = fk_cpu_matmul(&g, cpu_threads(stream));
        Py_END_ALLOW_THREADS
    } else {
#if FK_HAS_CUDA
        status = fk_cuda_matmul(&g, device, PTR(stream));
#else
        return no_cuda("matmul");
#endif
    }
    return finish(status);
}

/* matmul_plan(... matmul's arguments without the stream) -> the CUDA strategy name ("cpu" for
 * device < 0) */
static PyObject *py_matmul_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    fk_matmul_args g;
    int device;
    if (!parse_matmul("matmul_plan", args, nargs, &g, &device, NULL)) return NULL;
    if (device < 0) return PyUnicode_FromString("cpu");
#if FK_HAS_CUDA
    const char *plan = fk_cuda_matmul_plan(&g, device);
    if (!plan) return raise_status(FK_ERR_RUNTIME);
    return PyUnicode_FromString(plan);
#else
    return no_cuda("matmul");
#endif
}

/* softmax_plan(backward, outer, n, inner, causal_sq, log, dtype, aligned, device) -> (strategy, shape):
 * the CUDA strategy and launch shape a softmax call of these sizes takes (tests, benchmark tables) */
static PyObject *py_softmax_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long long outer, n, inner, causal_sq;
    int backward, log, dtype, aligned, device;
    if (!parse("softmax_plan", args, nargs, "pLLLLpiii", &backward, &outer, &n, &inner, &causal_sq,
               &log, &dtype, &aligned, &device))
        return NULL;
#if FK_HAS_CUDA
    char shape[256];
    const char *strategy = fk_cuda_softmax_plan(backward, outer, n, inner, causal_sq, log, (fk_dtype)dtype, aligned,
                                                device, shape, (int)sizeof shape);
    if (!strategy) return finish(FK_ERR_RUNTIME);  /* bad sizes are refused in Python first */
    return Py_BuildValue("(ss)", strategy, shape);
#else
    (void)backward, (void)outer, (void)n, (void)inner, (void)causal_sq, (void)log, (void)dtype, (void)aligned,
        (void)device;
    return no_cuda("softmax");
#endif
}

/* ---- attention ---------------------------------------------------------------------------------- */

/* Parses fk_attention_args (fastkern.h's field order: 12 pointers as ints, workspace_bytes, batch,
 * sq, sk, heads, kv_heads, d, the five (batch, row, head) stride triples, scale, window_left,
 * window_right, dtype, flags), then the device and, when `stream` is not NULL, the stream. */
static int parse_attention(const char *op, PyObject *const *args, Py_ssize_t nargs, fk_attention_args *g,
                           int *device, unsigned long long *stream) {
    unsigned long long q, k, v, out, lse, dout, dq, dk, dv, cu_q, cu_k, ws;
    long long n[7], st[15], wl, wr;
    double scale;
    int dtype, flags;
    int ok = parse(op, args, nargs, stream ? "KKKKKKKKKKKKLLLLLLLLLLLLLLLLLLLLLLdLLiiiK"
                                           : "KKKKKKKKKKKKLLLLLLLLLLLLLLLLLLLLLLdLLiii",
                   &q, &k, &v, &out, &lse, &dout, &dq, &dk, &dv, &cu_q, &cu_k, &ws, &n[0], &n[1], &n[2],
                   &n[3], &n[4], &n[5], &n[6], &st[0], &st[1], &st[2], &st[3], &st[4], &st[5], &st[6],
                   &st[7], &st[8], &st[9], &st[10], &st[11], &st[12], &st[13], &st[14], &scale, &wl, &wr,
                   &dtype, &flags, device, stream);
    if (!ok) return 0;
    *g = (fk_attention_args){PTR(q), PTR(k), PTR(v), PTR(out), PTR(lse), PTR(dout), PTR(dq), PTR(dk),
                             PTR(dv), (const int32_t *)PTR(cu_q), (const int32_t *)PTR(cu_k), PTR(ws),
                             n[0], n[1], n[2], n[3], n[4], n[5], n[6],
                             st[0], st[1], st[2], st[3], st[4], st[5], st[6], st[7], st[8], st[9],
                             st[10], st[11], st[12], st[13], st[14], scale, wl, wr, (fk_dtype)dtype, flags};
    return 1;
}

/* attention_fwd / attention_bwd(... fk_attention_args ..., device, stream) */
static PyObject *attention_call(PyObject *const *args, Py_ssize_t nargs, int backward) {
    fk_attention_args g;
    int device;
    unsigned long long stream;
    if (!parse_attention(backward ? "attention_bwd" : "attention_fwd", args, nargs, &g, &device, &stream))
        return NULL;
    fk_status status;
    if (device < 0) {
        Py_BEGIN_ALLOW_THREADS
        status = backward ? fk_cpu_attention_bwd(&g, cpu_threads(stream))
                          : fk_cpu_attention_fwd(&g, cpu_threads(stream));
        Py_END_ALLOW_THREADS
    } else {
#if FK_HAS_CUDA
        status = backward ? fk_cuda_attention_bwd(&g, device, PTR(stream))
                          : fk_cuda_attention_fwd(&g, device, PTR(stream));
#else
        return no_cuda("attention");
#endif
    }
    return finish(status);
}

static PyObject *py_attention_fwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return attention_call(args, nargs, 0);
}

static PyObject *py_attention_bwd(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return attention_call(args, nargs, 1);
}

/* Splits (backward, ... fk_attention_args ..., device) into the flag and the rest. */
static int parse_attention_query(const char *op, PyObject *const *args, Py_ssize_t nargs, fk_attention_args *g,
                                 int *backward, int *device) {
    if (nargs < 1) {
        PyErr_Format(PyExc_TypeError, "fastkern._C.%s: expected (backward, attention args..., device)", op);
        return 0;
    }
    *backward = PyObject_IsTrue(args[0]);
    return *backward >= 0 && parse_attention(op, args + 1, nargs - 1, g, device, NULL);
}

/* attention_workspace(backward, ... fk_attention_args ..., device) -> bytes of workspace */
static PyObject *py_attention_workspace(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    fk_attention_args g;
    int backward, device;
    if (!parse_attention_query("attention_workspace", args, nargs, &g, &backward, &device)) return NULL;
    if (device < 0) return PyLong_FromLongLong(fk_cpu_attention_workspace(&g, backward));
#if FK_HAS_CUDA
    return PyLong_FromLongLong(fk_cuda_attention_workspace(&g, backward, device));
#else
    return no_cuda("attention");
#endif
}

/* attention_plan(backward, ... fk_attention_args ..., device) -> the CUDA strategy ("cpu" on CPU) */
static PyObject *py_attention_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    fk_attention_args g;
    int backward, device;
    if (!parse_attention_query("attention_plan", args, nargs, &g, &backward, &device)) return NULL;
    if (device < 0) return PyUnicode_FromString("cpu");
#if FK_HAS_CUDA
    const char *plan = fk_cuda_attention_plan(&g, backward, device);
    if (!plan) return raise_status(FK_ERR_RUNTIME);
    return PyUnicode_FromString(plan);
#else
    return no_cuda("attention");
#endif
}

/* build_info() -> dict: version, cuda (compiled in), archs, devices [(name, major, minor)] */
static PyObject *py_build_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    PyObject *devices = PyList_New(0);
    if (!devices) return NULL;
#if FK_HAS_CUDA
    int count = fk_cuda_device_count();
    for (int i = 0; i < count; i++) {
        char name[256];
        int major = 0, minor = 0;
        if (fk_cuda_device_name(i, name, (int)sizeof name, &major, &minor) != FK_OK) continue;
        PyObject *entry = Py_BuildValue("(sii)", name, major, minor);
        if (!entry || PyList_Append(devices, entry) < 0) {
            Py_XDECREF(entry);
            Py_DECREF(devices);
            return NULL;
        }
        Py_DECREF(entry);
    }
    const char *archs = fk_cuda_archs();
#else
    const char *archs = "";
#endif
    PyObject *info = Py_BuildValue("{s:s,s:O,s:s,s:N}", "version", FK_VERSION, "cuda",
                                   FK_HAS_CUDA ? Py_True : Py_False, "archs", archs, "devices",
                                   devices);
    return info;
}

#define FASTCALL(fn) ((PyCFunction)(void (*)(void))(fn))

static PyMethodDef methods[] = {
    {"gelu_fwd", FASTCALL(py_gelu_fwd), METH_FASTCALL, "GELU forward on raw pointers."},
    {"gelu_bwd", FASTCALL(py_gelu_bwd), METH_FASTCALL, "GELU backward (and bias gradient) on raw pointers."},
    {"gelu_bwd_workspace", FASTCALL(py_gelu_bwd_workspace), METH_FASTCALL,
     "fp32 workspace elements the CUDA GELU bias gradient needs."},
    {"softmax_fwd", FASTCALL(py_softmax_fwd), METH_FASTCALL, "Softmax / log-softmax forward on raw pointers."},
    {"softmax_bwd", FASTCALL(py_softmax_bwd), METH_FASTCALL, "Softmax / log-softmax backward (CUDA) on raw pointers."},
    {"softmax_bwd_from_output", FASTCALL(py_softmax_bwd_from_output), METH_FASTCALL,
     "Softmax / log-softmax backward (CPU) from the output, on raw pointers."},
    {"cross_entropy_fwd", FASTCALL(py_cross_entropy_fwd), METH_FASTCALL,
     "Cross-entropy forward (loss, row log-sum-exp, valid count) on raw pointers."},
    {"cross_entropy_bwd", FASTCALL(py_cross_entropy_bwd), METH_FASTCALL, "Cross-entropy backward on raw pointers."},
    {"matmul", FASTCALL(py_matmul), METH_FASTCALL, "C = act(A @ B + bias) (and its pre-activation) on raw pointers."},
    {"matmul_plan", FASTCALL(py_matmul_plan), METH_FASTCALL, "The CUDA strategy matmul would take ('cpu' on CPU)."},
    {"softmax_plan", FASTCALL(py_softmax_plan), METH_FASTCALL, "The CUDA softmax strategy and launch shape for a call."},
    {"attention_fwd", FASTCALL(py_attention_fwd), METH_FASTCALL, "Flash attention forward (out, lse) on raw pointers."},
    {"attention_bwd", FASTCALL(py_attention_bwd), METH_FASTCALL, "Flash attention backward (dq, dk, dv) on raw pointers."},
    {"attention_workspace", FASTCALL(py_attention_workspace), METH_FASTCALL,
     "Workspace bytes an attention call needs (backward flag first, then its arguments and device)."},
    {"attention_plan", FASTCALL(py_attention_plan), METH_FASTCALL, "The CUDA attention strategy for a call ('cpu' on CPU)."},
    {"build_info", py_build_info, METH_NOARGS, "Version, CUDA support, archs and visible devices."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "fastkern._C", "fastkern kernels on raw pointers (CPython C API).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddStringConstant(m, "__version__", FK_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
