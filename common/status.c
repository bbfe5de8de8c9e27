/* Text for the shared status codes, and the one helper that writes an
 * error message into a caller's buffer. */
#include "status.h"

#include <stdio.h>

const char *status_str(int code) {
    static const char *const text[STATUS_COUNT] = {
        "ok",          "bad input", "not found",   "unsupported",
        "i/o error",   "out of memory", "protocol error", "unavailable",
        "timed out",   "cancelled", "resource exhausted", "internal error",
    };
    if (code > 0 || -code >= STATUS_COUNT) return "unknown status";
    return text[-code];
}

int status_vfail(char *err, size_t errlen, int status, const char *fmt, va_list ap) {
    if (err && errlen > 0) vsnprintf(err, errlen, fmt, ap);
    return status;
}

int status_fail(char *err, size_t errlen, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    status_vfail(err, errlen, status, fmt, ap);
    va_end(ap);
    return status;
}
