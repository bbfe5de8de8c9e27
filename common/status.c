/* Text for the shared status codes. */
#include "status.h"

const char *status_str(int code) {
    static const char *const text[STATUS_COUNT] = {
        "ok",          "bad input", "not found",   "unsupported",
        "i/o error",   "out of memory", "protocol error", "unavailable",
        "timed out",   "cancelled", "resource exhausted", "internal error",
    };
    if (code > 0 || -code >= STATUS_COUNT) return "unknown status";
    return text[-code];
}
