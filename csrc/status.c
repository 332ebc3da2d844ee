/* Failure messages for the waist: each thread keeps the text of its last failure, which module.c
 * turns into the Python exception that matches the status. */
#include <stdarg.h>
#include <stdio.h>

#include "fastkern.h"

static _Thread_local char last_message[512];

fk_status fk_fail(fk_status status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_message, sizeof last_message, fmt, args);
    va_end(args);
    return status;
}

const char *fk_error_message(void) { return last_message; }

int fk_dtype_size(fk_dtype dtype) {
    switch (dtype) {
    case FK_FLOAT32: return 4;
    case FK_FLOAT16: return 2;
    case FK_BFLOAT16: return 2;
    case FK_FLOAT64: return 8;
    }
    return 0;
}
