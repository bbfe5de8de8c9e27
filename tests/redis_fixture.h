/* A private redis-server for one test: started on a free loopback port in its
 * own temporary folder (no persistence unless asked), answered PING before
 * the start returns, and stopped by the test.  A server left running by a
 * failed test is killed at exit, and dies with the test process if that
 * crashes (PR_SET_PDEATHSIG).
 *
 *   TEST(router_requeues) {
 *       struct redis_fixture r;
 *       fixture_redis_start(&r, 0);        // TEST_SKIPs without redis-server
 *       ... connect to r.url or r.host:r.port ...
 *       ASSERT_OK(fixture_redis_stop(&r));
 *   }
 *
 * fixture_redis_start and _restart end the test (TEST_FAIL or TEST_SKIP)
 * when they cannot do their job, so they must be called from a test. */
#ifndef TESTS_REDIS_FIXTURE_H
#define TESTS_REDIS_FIXTURE_H

#include <stddef.h>
#include <sys/types.h>

enum {
    /* Keep data across fixture_redis_restart: append-only file, fsync always. */
    FIXTURE_REDIS_PERSIST = 1,
    /* Require a password (requirepass f->password, one with characters a URL
     * must escape); f->url_auth carries it, f->url does not. */
    FIXTURE_REDIS_AUTH = 2,
};

struct redis_fixture {
    char host[32];  /* "127.0.0.1" */
    int port;
    char url[64];   /* "redis://127.0.0.1:PORT" (no password, even with FIXTURE_REDIS_AUTH) */
    char url_auth[200]; /* with FIXTURE_REDIS_AUTH "redis://:ESCAPED-PASSWORD@127.0.0.1:PORT", else url */
    char password[40];  /* with FIXTURE_REDIS_AUTH, else "" */
    char dir[256];  /* the server's working folder (log, data) */
    pid_t pid;      /* 0 while no server runs */
    int flags;
};

/* Starts a server; f is overwritten.  redis-server is found through
 * $LLM_REDIS_SERVER or PATH; when it is missing the test is skipped. */
void fixture_redis_start(struct redis_fixture *f, int flags);

/* Stops the server (SIGTERM, then SIGKILL after 5 s), waits for it, removes
 * its folder.  Safe on a fixture that was never started or already stopped.
 * Returns 0, or a negative status if the process or folder could not be
 * removed (the test should assert on it: it owns its fixture). */
int fixture_redis_stop(struct redis_fixture *f);

/* Kills the server with SIGKILL and waits for it, keeping port and folder:
 * clients now see a server that is gone. */
void fixture_redis_kill(struct redis_fixture *f);

/* Stops the server if it runs (SIGTERM: with FIXTURE_REDIS_PERSIST it writes
 * its data) and starts it again on the same port and folder. */
void fixture_redis_restart(struct redis_fixture *f);

/* Last lines of the server's log file into buf (for failure messages). */
void fixture_redis_log_tail(const struct redis_fixture *f, char *buf, size_t size);

#endif
