/* The liveness watchdog (see watchdog.h): one timestamp per loop, stored by
 * the loop and read by the metrics port's thread. */
#include "watchdog.h"
#include "log.h"
#include "status.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct watchdog {
    int64_t max_ms;
    int n_loops;
    char names[WATCHDOG_LOOPS_MAX][32];
    _Atomic int64_t last_ms[WATCHDOG_LOOPS_MAX]; /* monotonic; 0: never turned */
    char *stall_file;                            /* LLM_TEST_STALL_FILE, or NULL */
};

static int64_t watchdog_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    /* + 1: a beat in the clock's first millisecond is still not "never". */
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + 1;
}

int watchdog_init(watchdog **out, int64_t max_ms, const char *const *loops, int n_loops, char *err,
                  size_t errlen) {
    *out = NULL;
    if (max_ms <= 0 || n_loops < 1 || n_loops > WATCHDOG_LOOPS_MAX)
        return status_fail(err, errlen, STATUS_BAD_INPUT, "watchdog: bound %lld ms with %d loops",
                           (long long)max_ms, n_loops);
    watchdog *w = calloc(1, sizeof *w);
    if (!w) return status_fail(err, errlen, STATUS_NO_MEMORY, "watchdog: out of memory");
    w->max_ms = max_ms;
    w->n_loops = n_loops;
    for (int i = 0; i < n_loops; i++) {
        snprintf(w->names[i], sizeof w->names[i], "%s", loops[i]);
        atomic_init(&w->last_ms[i], 0);
    }
    const char *stall = getenv("LLM_TEST_STALL_FILE");
    if (stall && stall[0]) {
        if (!(w->stall_file = strdup(stall))) {
            free(w);
            return status_fail(err, errlen, STATUS_NO_MEMORY, "watchdog: out of memory");
        }
        LOG(LL_WARN, "watchdog: test hook LLM_TEST_STALL_FILE=%s: a loop stops while that file exists",
            w->stall_file);
    }
    *out = w;
    return STATUS_OK;
}

void watchdog_free(watchdog *w) {
    if (!w) return;
    free(w->stall_file);
    free(w);
}

void watchdog_beat(watchdog *w, int loop) {
    if (!w || loop < 0 || loop >= w->n_loops) return;
    if (w->stall_file && access(w->stall_file, F_OK) == 0) {
        LOG(LL_WARN, "watchdog: loop %s stalls while %s exists (test hook)", w->names[loop], w->stall_file);
        while (access(w->stall_file, F_OK) == 0) usleep(20000);
        LOG(LL_WARN, "watchdog: loop %s turns again", w->names[loop]);
    }
    atomic_store_explicit(&w->last_ms[loop], watchdog_now_ms(), memory_order_relaxed);
}

const char *watchdog_health(void *ud, char *buf, size_t size) {
    watchdog *w = ud;
    if (!w) return NULL;
    int64_t now = watchdog_now_ms();
    for (int i = 0; i < w->n_loops; i++) {
        int64_t last = atomic_load_explicit(&w->last_ms[i], memory_order_relaxed);
        if (last == 0) {
            snprintf(buf, size, "starting: loop %s has not turned yet", w->names[i]);
            return buf;
        }
        if (now - last > w->max_ms) {
            snprintf(buf, size, "loop %s has not turned for %lld ms (bound %lld ms)", w->names[i],
                     (long long)(now - last), (long long)w->max_ms);
            return buf;
        }
    }
    return NULL;
}
