/* A liveness watchdog: the loops a process must keep turning (the router's
 * event loop, a worker's io and compute threads, the gateway's supervisor)
 * each beat their watch every turn, and the metrics port's /health
 * (common/httpd.h) fails once a loop has not turned for longer than the
 * bound, or has not turned yet (the process is still starting: loading its
 * model).  Kubernetes' liveness probe then restarts a hung process, and its
 * startup probe bounds the load.
 *
 *   static const char *const loops[] = {"io", "compute"};
 *   watchdog *w;
 *   if (watchdog_init(&w, 60000, loops, 2, err, sizeof err) < 0) ...
 *   struct httpd_config c = {..., .health = watchdog_health, .health_ud = w};
 *   for (;;) { watchdog_beat(w, 0); ...wait at most a fraction of the bound... }
 *   watchdog_free(w);   after the port has stopped
 *
 * Test hook (not an operator setting, so in no --help): when the
 * environment has LLM_TEST_STALL_FILE=PATH, a loop that beats while PATH
 * exists sleeps until it is removed, without beating: tests block a loop
 * from outside the process and watch /health fail (tests/deploy/
 * test_health.c). */
#ifndef COMMON_WATCHDOG_H
#define COMMON_WATCHDOG_H

#include <stddef.h>
#include <stdint.h>

#define WATCHDOG_LOOPS_MAX 4

typedef struct watchdog watchdog;

/* A watchdog for n_loops loops (1..WATCHDOG_LOOPS_MAX, names copied), each
 * allowed max_ms (> 0) between beats.  Returns 0 and *out, or
 * STATUS_BAD_INPUT / STATUS_NO_MEMORY with err filled. */
int watchdog_init(watchdog **out, int64_t max_ms, const char *const *loops, int n_loops, char *err,
                  size_t errlen);
void watchdog_free(watchdog *w); /* NULL is fine */

/* Loop number loop has turned.  Any thread; w NULL is a no-op (no watchdog). */
void watchdog_beat(watchdog *w, int loop);

/* An httpd_health_fn (ud: the watchdog): NULL while every loop has turned
 * within the bound, else the reason ("starting: loop io has not turned
 * yet", "loop compute has not turned for 61234 ms (bound 60000 ms)"),
 * written into buf. */
const char *watchdog_health(void *ud, char *buf, size_t size);

#endif
