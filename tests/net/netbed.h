/* The multi-host test bed of the tests/net/ files: each "host" is a network
 * namespace with its own address on one subnet (10.77.0.0/24), joined to a
 * bridge that lives in a namespace of its own ("sw"), so that nothing of the
 * bed touches the machine's own namespace: the test process itself enters
 * the "cli" host (before any thread or ZeroMQ context exists) and its
 * clients reach the router across the bridge.  Redis runs on "db", the
 * router on "ctl", the workers of stage k (every pipeline's) on "s<k>";
 * Redis has a host of its own so that the router can be cut from it
 * (nb->worker_host puts every worker on one host instead).
 * Processes are started with `ip netns exec` (real redis-server, llm-router
 * and llm-worker with CURVE keys, through tests/router/cluster_harness.h).
 *
 * Faults, all undone by nb_heal (docs/testing.md, "The multi-host test bed"):
 *   nb_link_set(nb, h, 0)      the host's cable pulled (its switch port down)
 *   nb_cap(nb, h, "1mbit")     tc tbf on both directions of its link
 *   nb_drop_from(nb, h, from)  h silently drops what comes from `from`
 *                              (an `ip rule ... blackhole` on input: this
 *                              kernel has neither netem nor tc drop actions
 *                              nor iptables); from -1: everything
 * Latency: nb_relay_add puts a user-space relay (a thread of the test, in
 * the "wan" host) in front of a listener; it holds every chunk for a delay.
 *
 * When namespaces cannot be made (not root, no `ip`, no veth or bridge
 * support) nb_init skips the test with the reason.  Every process dies with
 * the test (PR_SET_PDEATHSIG) and the namespaces are deleted by nb_free or,
 * after a failed test, by the next nb_init and at exit. */
#ifndef TESTS_NET_NETBED_H
#define TESTS_NET_NETBED_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* setns, accept4 */
#endif
#include "tests/router/cluster_harness.h"

#include <dirent.h>
#include <poll.h>
#include <sched.h>

#define NB_HOSTS_MAX 12
#define NB_RELAYS_MAX 8
#define NB_SUBNET "10.77.0."
#define NB_IP "/usr/sbin/ip"

struct nb_host {
    char name[16];  /* "db", "ctl", "s0", ... */
    char ns[48];    /* the namespace */
    char addr[20];  /* its address */
    char port[16];  /* its port on the bridge (in the "sw" namespace) */
};

struct nb_relay {
    int lfd;
    struct sockaddr_in to;
    int delay_ms;
    volatile int stop;
    pthread_t th;
    int64_t bytes; /* relayed, both directions */
};

struct netbed {
    char prefix[32]; /* namespaces are prefix + name */
    char sw[48];
    struct nb_host hosts[NB_HOSTS_MAX];
    int n_hosts;
    int self_ns; /* fd of the namespace the test started in */
    struct nb_relay relays[NB_RELAYS_MAX];
    int n_relays;
    struct h_proc redis;
    char redis_url[64];
    struct cluster *cl;
    /* "": stage k's workers on host "s<k>".  A host name: every worker
     * there, each stage on a port of its own, so that the stage links run
     * over that host's loopback (bench/bench_net.c's baseline). */
    char worker_host[16];
};

static struct netbed *nb_current;

/* Runs a shell command quietly; its output goes to /tmp/llmnet-last.log
 * (printed when wanted by the caller).  Returns the exit status. */
static H_UNUSED int nb_sh(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static H_UNUSED int nb_sh(const char *fmt, ...) {
    char cmd[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    char full[1200];
    snprintf(full, sizeof full, "(%s) >/tmp/llmnet-last.log 2>&1", cmd);
    int st = system(full);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* The same, failing the test with the command's output when it fails. */
#define NB_SH(...)                                                                                 \
    do {                                                                                           \
        if (nb_sh(__VA_ARGS__) != 0) {                                                             \
            char out_[600];                                                                        \
            h_tail("/tmp/llmnet-last.log", out_, sizeof out_, 6);                                  \
            TEST_FAIL("netbed: command failed: %s", out_);                                         \
        }                                                                                          \
    } while (0)

static H_UNUSED struct nb_host *nb_host(struct netbed *nb, const char *name) {
    for (int i = 0; i < nb->n_hosts; i++)
        if (strcmp(nb->hosts[i].name, name) == 0) return &nb->hosts[i];
    TEST_FAIL("netbed: no host %s", name);
    return NULL;
}

/* Enters a namespace for the calling thread (and threads it starts later). */
static H_UNUSED int nb_enter_ns(const char *ns) {
    char path[128];
    snprintf(path, sizeof path, "/var/run/netns/%s", ns);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int rc = setns(fd, CLONE_NEWNET);
    close(fd);
    return rc;
}

/* Deletes the namespaces of test processes that are gone (a crashed run). */
static void nb_sweep_stale(void) {
    DIR *d = opendir("/var/run/netns");
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        int pid;
        if (sscanf(e->d_name, "llmnet%d-", &pid) != 1) continue;
        if (pid == getpid() || kill(pid, 0) == 0) continue;
        nb_sh(NB_IP " netns del %s", e->d_name);
    }
    closedir(d);
}

static void nb_relays_stop(struct netbed *nb) {
    for (int i = 0; i < nb->n_relays; i++) {
        nb->relays[i].stop = 1;
        pthread_join(nb->relays[i].th, NULL);
        close(nb->relays[i].lfd);
    }
    nb->n_relays = 0;
}

/* Stops the processes and the relays, deletes every namespace and returns
 * the test process to the namespace it started in. */
static void nb_free_keep(struct netbed *nb, int keep_logs) {
    if (!nb) return;
    if (nb->cl) h_cluster_cleanup(nb->cl, keep_logs);
    nb->cl = NULL;
    h_proc_kill(&nb->redis, SIGKILL);
    nb_relays_stop(nb);
    if (nb->self_ns >= 0) {
        setns(nb->self_ns, CLONE_NEWNET);
        close(nb->self_ns);
        nb->self_ns = -1;
    }
    for (int i = 0; i < nb->n_hosts; i++) nb_sh(NB_IP " netns del %s", nb->hosts[i].ns);
    if (nb->sw[0]) nb_sh(NB_IP " netns del %s", nb->sw);
    if (nb_current == nb) nb_current = NULL;
    free(nb);
}

/* The end of a test that passed: the logs go too. */
static H_UNUSED void nb_free(struct netbed *nb) { nb_free_keep(nb, 0); }

static void nb_atexit(void) {
    if (!nb_current) return;
    nb_free_keep(nb_current, 1);
}

/* Makes the bed: the switch and one namespace per name in hosts (a
 * NULL-terminated list), each with its address, and enters "cli" if it is
 * among them.  Skips the test when namespaces cannot be made. */
static H_UNUSED struct netbed *nb_init(const char *const *hosts) {
    static int registered, seq;
    if (!registered) {
        atexit(nb_atexit);
        registered = 1;
    }
    if (nb_current) nb_free_keep(nb_current, 1); /* what a failed test left: its logs stay */
    nb_sweep_stale();
    if (geteuid() != 0) TEST_SKIP("netbed: needs root for network namespaces (euid %d)", (int)geteuid());
    if (access(NB_IP, X_OK) != 0) TEST_SKIP("netbed: %s (iproute2) is not installed", NB_IP);
    struct netbed *nb = calloc(1, sizeof *nb);
    nb->self_ns = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    snprintf(nb->prefix, sizeof nb->prefix, "llmnet%d-%d-", (int)getpid(), seq++);
    snprintf(nb->sw, sizeof nb->sw, "%ssw", nb->prefix);
    nb_current = nb;
    if (nb_sh(NB_IP " netns add %s", nb->sw) != 0) {
        char out[400];
        h_tail("/tmp/llmnet-last.log", out, sizeof out, 3);
        nb->sw[0] = 0;
        nb_free(nb);
        TEST_SKIP("netbed: cannot make a network namespace (ip netns add: %s)", out);
    }
    if (nb_sh(NB_IP " -n %s link add br0 type bridge && " NB_IP " -n %s link set br0 up", nb->sw, nb->sw) != 0) {
        char out[400];
        h_tail("/tmp/llmnet-last.log", out, sizeof out, 3);
        nb_free(nb);
        TEST_SKIP("netbed: cannot make a bridge in a namespace: %s", out);
    }
    for (int i = 0; hosts[i]; i++) {
        if (i >= NB_HOSTS_MAX) TEST_FAIL("netbed: at most %d hosts", NB_HOSTS_MAX);
        struct nb_host *h = &nb->hosts[nb->n_hosts++];
        snprintf(h->name, sizeof h->name, "%s", hosts[i]);
        char prefix[32];
        memcpy(prefix, nb->prefix, sizeof prefix);
        snprintf(h->ns, sizeof h->ns, "%s%s", prefix, hosts[i]);
        snprintf(h->addr, sizeof h->addr, NB_SUBNET "%d", 10 + i);
        snprintf(h->port, sizeof h->port, "p%d", i);
        if (nb_sh(NB_IP " netns add %s && " NB_IP " -n %s link set lo up && " NB_IP
                  " -n %s link add %s type veth peer name eth0 netns %s",
                  h->ns, h->ns, nb->sw, h->port, h->ns) != 0) {
            char out[400];
            h_tail("/tmp/llmnet-last.log", out, sizeof out, 3);
            nb_free(nb);
            TEST_SKIP("netbed: cannot make host %s (veth pair): %s", hosts[i], out);
        }
        NB_SH(NB_IP " -n %s link set %s master br0 && " NB_IP " -n %s link set %s up && " NB_IP
              " -n %s addr add %s/24 dev eth0 && " NB_IP " -n %s link set eth0 up",
              nb->sw, h->port, nb->sw, h->port, h->ns, h->addr, h->ns);
        /* The local table after pref 10, so that nb_drop_from's input
         * blackhole rules come before local delivery. */
        NB_SH(NB_IP " -n %s rule add pref 32765 table local && " NB_IP " -n %s rule del pref 0", h->ns, h->ns);
    }
    for (int i = 0; i < nb->n_hosts; i++)
        if (strcmp(nb->hosts[i].name, "cli") == 0 && nb_enter_ns(nb->hosts[i].ns) != 0)
            TEST_FAIL("netbed: setns into %s: %s", nb->hosts[i].ns, strerror(errno));
    return nb;
}

/* ---- faults ------------------------------------------------------------------ */

/* The host's switch port down (0) or up (1): its cable pulled and put back. */
static H_UNUSED void nb_link_set(struct netbed *nb, const char *host, int up) {
    NB_SH(NB_IP " -n %s link set %s %s", nb->sw, nb_host(nb, host)->port, up ? "up" : "down");
}

/* Caps both directions of the host's link with a token bucket ("1mbit",
 * "1gbit"); NULL removes the caps. */
static H_UNUSED void nb_cap(struct netbed *nb, const char *host, const char *rate) {
    struct nb_host *h = nb_host(nb, host);
    if (!rate) {
        nb_sh(NB_IP " netns exec %s tc qdisc del dev eth0 root", h->ns);
        nb_sh(NB_IP " netns exec %s tc qdisc del dev %s root", nb->sw, h->port);
        return;
    }
    /* burst: at least a rate's 10 ms and a few full frames; the queue holds
     * 100 ms of it before tbf drops. */
    NB_SH(NB_IP " netns exec %s tc qdisc replace dev eth0 root tbf rate %s burst 32kb latency 100ms && " NB_IP
          " netns exec %s tc qdisc replace dev %s root tbf rate %s burst 32kb latency 100ms",
          h->ns, rate, nb->sw, h->port, rate);
}

/* host silently drops every packet that comes from `from` (NULL: from anyone):
 * an input rule with a blackhole action, no ICMP, no reset. */
static H_UNUSED void nb_drop_from(struct netbed *nb, const char *host, const char *from) {
    struct nb_host *h = nb_host(nb, host);
    if (from) NB_SH(NB_IP " -n %s rule add pref 10 from %s iif eth0 blackhole", h->ns, nb_host(nb, from)->addr);
    else NB_SH(NB_IP " -n %s rule add pref 10 iif eth0 blackhole", h->ns);
}

/* Undoes every fault: ports up, caps and drop rules gone. */
static H_UNUSED void nb_heal(struct netbed *nb) {
    for (int i = 0; i < nb->n_hosts; i++) {
        struct nb_host *h = &nb->hosts[i];
        nb_sh(NB_IP " -n %s link set %s up", nb->sw, h->port);
        while (nb_sh(NB_IP " -n %s rule del pref 10", h->ns) == 0) {}
        nb_cap(nb, h->name, NULL);
    }
}

/* Bytes the host's interface sent and received so far. */
static H_UNUSED void nb_bytes(struct netbed *nb, const char *host, uint64_t *tx, uint64_t *rx) {
    struct nb_host *h = nb_host(nb, host);
    char cmd[256];
    snprintf(cmd, sizeof cmd, NB_IP " -n %s -s link show eth0", h->ns);
    FILE *f = popen(cmd, "r");
    *tx = *rx = 0;
    if (!f) return;
    char line[256];
    int want = 0; /* 1: next line is RX numbers, 2: TX numbers */
    while (fgets(line, sizeof line, f)) {
        unsigned long long v;
        if (want && sscanf(line, " %llu", &v) == 1) {
            if (want == 1) *rx = v;
            else *tx = v;
            want = 0;
        } else if (strstr(line, "RX:")) {
            want = 1;
        } else if (strstr(line, "TX:")) {
            want = 2;
        }
    }
    pclose(f);
}

/* ---- the latency relay ------------------------------------------------------- */

struct nb_chunk {
    struct nb_chunk *next;
    int64_t due;
    size_t len, off;
    char data[];
};

struct nb_dir {
    struct nb_chunk *head, *tail;
    size_t queued;
};

struct nb_pair {
    int fd[2];          /* accepted, connected */
    struct nb_dir q[2]; /* q[i]: read from fd[i], to write to fd[1 - i] */
    int eof[2];
};

static void nb_dir_free(struct nb_dir *d) {
    while (d->head) {
        struct nb_chunk *c = d->head;
        d->head = c->next;
        free(c);
    }
    d->tail = NULL;
    d->queued = 0;
}

static void *nb_relay_thread(void *arg) {
    struct nb_relay *r = arg;
    enum { PAIRS = 32 };
    struct nb_pair pairs[PAIRS];
    int n = 0;
    char buf[65536];
    while (!r->stop) {
        struct pollfd pf[1 + 2 * PAIRS];
        pf[0] = (struct pollfd){r->lfd, POLLIN, 0};
        int64_t now = h_now_ms(), wait = 20;
        for (int i = 0; i < n; i++)
            for (int d = 0; d < 2; d++) {
                struct nb_dir *q = &pairs[i].q[d];
                short ev = q->queued < (64u << 20) && !pairs[i].eof[d] ? POLLIN : 0;
                if (q->head && q->head->due <= now) ev |= 0; /* written below */
                pf[1 + 2 * i + d] = (struct pollfd){pairs[i].fd[d], ev, 0};
                if (pairs[i].q[1 - d].head) {
                    int64_t w = pairs[i].q[1 - d].head->due - now;
                    if (w <= 0) pf[1 + 2 * i + d].events |= POLLOUT;
                    else if (w < wait) wait = w;
                }
            }
        if (poll(pf, (nfds_t)(1 + 2 * n), (int)wait) < 0 && errno != EINTR) break;
        if ((pf[0].revents & POLLIN) && n < PAIRS) {
            int a = accept4(r->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (a >= 0) {
                int b = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                struct timeval tv = {2, 0};
                setsockopt(b, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
                if (connect(b, (struct sockaddr *)&r->to, sizeof r->to) != 0) {
                    close(a);
                    close(b);
                } else {
                    fcntl(b, F_SETFL, fcntl(b, F_GETFL) | O_NONBLOCK);
                    int one = 1;
                    setsockopt(a, IPPROTO_TCP, 1 /* TCP_NODELAY */, &one, sizeof one);
                    setsockopt(b, IPPROTO_TCP, 1, &one, sizeof one);
                    pairs[n] = (struct nb_pair){{a, b}, {{0}, {0}}, {0, 0}};
                    n++;
                }
            }
        }
        now = h_now_ms();
        for (int i = 0; i < n; i++) {
            struct nb_pair *p = &pairs[i];
            int dead = 0;
            for (int d = 0; d < 2 && !dead; d++) {
                if (pf[1 + 2 * i + d].revents & (POLLIN | POLLHUP | POLLERR)) {
                    ssize_t got = read(p->fd[d], buf, sizeof buf);
                    if (got > 0) {
                        struct nb_chunk *c = malloc(sizeof *c + (size_t)got);
                        c->next = NULL;
                        c->due = now + r->delay_ms;
                        c->len = (size_t)got;
                        c->off = 0;
                        memcpy(c->data, buf, (size_t)got);
                        if (p->q[d].tail) p->q[d].tail->next = c;
                        else p->q[d].head = c;
                        p->q[d].tail = c;
                        p->q[d].queued += (size_t)got;
                        __atomic_add_fetch(&r->bytes, got, __ATOMIC_RELAXED);
                    } else if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
                        p->eof[d] = 1;
                    }
                }
            }
            for (int d = 0; d < 2; d++) {
                struct nb_dir *q = &p->q[d];
                while (q->head && q->head->due <= now) {
                    struct nb_chunk *c = q->head;
                    ssize_t w = write(p->fd[1 - d], c->data + c->off, c->len - c->off);
                    if (w < 0) {
                        if (errno != EAGAIN && errno != EINTR) dead = 1;
                        break;
                    }
                    c->off += (size_t)w;
                    q->queued -= (size_t)w;
                    if (c->off < c->len) break;
                    q->head = c->next;
                    if (!q->head) q->tail = NULL;
                    free(c);
                }
            }
            /* One side closed and what it sent is delivered: close both. */
            if (dead || ((p->eof[0] && !p->q[0].head) || (p->eof[1] && !p->q[1].head))) {
                close(p->fd[0]);
                close(p->fd[1]);
                nb_dir_free(&p->q[0]);
                nb_dir_free(&p->q[1]);
                pairs[i--] = pairs[--n];
            }
        }
    }
    for (int i = 0; i < n; i++) {
        close(pairs[i].fd[0]);
        close(pairs[i].fd[1]);
        nb_dir_free(&pairs[i].q[0]);
        nb_dir_free(&pairs[i].q[1]);
    }
    return NULL;
}

struct nb_relay_start {
    struct nb_relay *r;
    const char *ns;
    struct sockaddr_in at;
    int rc;
    char err[200];
};

/* Runs in a short thread of its own: setns changes only the calling thread,
 * and the relay's listening socket must be made inside the "wan" host. */
static void *nb_relay_listen(void *arg) {
    struct nb_relay_start *s = arg;
    if (nb_enter_ns(s->ns) != 0) {
        snprintf(s->err, sizeof s->err, "setns %s: %s", s->ns, strerror(errno));
        s->rc = -1;
        return NULL;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&s->at, sizeof s->at) != 0 || listen(fd, 64) != 0) {
        snprintf(s->err, sizeof s->err, "bind/listen: %s", strerror(errno));
        close(fd);
        s->rc = -1;
        return NULL;
    }
    s->r->lfd = fd;
    s->rc = 0;
    /* The relay thread starts from here, so it runs in this namespace too. */
    pthread_create(&s->r->th, NULL, nb_relay_thread, s->r);
    return NULL;
}

/* A relay on the "wan" host at its address number `alias` (an extra address
 * NB_SUBNET alias, made here) and port, forwarding to host:port after
 * delay_ms each way.  Returns the relay's address ("10.77.0.N"). */
static H_UNUSED const char *nb_relay_add(struct netbed *nb, int alias, int port, const char *host, int to_port,
                                         int delay_ms) {
    static char addr[NB_RELAYS_MAX][20];
    if (nb->n_relays >= NB_RELAYS_MAX) TEST_FAIL("netbed: at most %d relays", NB_RELAYS_MAX);
    struct nb_host *wan = nb_host(nb, "wan");
    char *a = addr[nb->n_relays];
    snprintf(a, 20, NB_SUBNET "%d", alias);
    nb_sh(NB_IP " -n %s addr add %s/24 dev eth0", wan->ns, a); /* may exist already */
    struct nb_relay *r = &nb->relays[nb->n_relays];
    memset(r, 0, sizeof *r);
    r->delay_ms = delay_ms;
    r->to = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = htons((uint16_t)to_port)};
    inet_pton(AF_INET, nb_host(nb, host)->addr, &r->to.sin_addr);
    struct nb_relay_start s = {r, wan->ns, {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)}, -1, ""};
    inet_pton(AF_INET, a, &s.at.sin_addr);
    pthread_t t;
    pthread_create(&t, NULL, nb_relay_listen, &s);
    pthread_join(t, NULL);
    if (s.rc != 0) TEST_FAIL("netbed: relay %s:%d -> %s:%d: %s", a, port, host, to_port, s.err);
    nb->n_relays++;
    return a;
}

/* ---- the cluster across the hosts ------------------------------------------- */

/* Starts redis-server on "db" (plain: the bed's network is private to the
 * test) and waits until it answers PING. */
static H_UNUSED void nb_redis_start(struct netbed *nb, struct cluster *cl) {
    char server[512] = "";
    const char *env = getenv("LLM_REDIS_SERVER");
    if (env && *env) snprintf(server, sizeof server, "%s", env);
    else {
        const char *path = getenv("PATH");
        for (const char *p = path; p && *p;) {
            const char *end = strchr(p, ':');
            size_t len = end ? (size_t)(end - p) : strlen(p);
            snprintf(server, sizeof server, "%.*s/redis-server", (int)len, p);
            if (access(server, X_OK) == 0) break;
            server[0] = 0;
            p = end ? end + 1 : NULL;
        }
    }
    if (!server[0] || access(server, X_OK) != 0) TEST_SKIP("redis-server is not installed (not in PATH)");
    struct nb_host *db = nb_host(nb, "db");
    struct h_proc *p = &nb->redis;
    snprintf(p->name, sizeof p->name, "redis");
    snprintf(p->log, sizeof p->log, "%s/redis.log", cl->dir);
    const char *argv[] = {NB_IP, "netns", "exec", db->ns, server, "--bind", db->addr, "--port", "6379",
                          "--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", cl->dir,
                          "--logfile", "", NULL};
    h_proc_setargs(p, argv);
    h_proc_start(cl, p);
    snprintf(nb->redis_url, sizeof nb->redis_url, "redis://%s:6379", db->addr);
    snprintf(cl->redis.url, sizeof cl->redis.url, "%s", nb->redis_url);
    int64_t end = h_now_ms() + 10000;
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(6379)};
        inet_pton(AF_INET, db->addr, &sa.sin_addr);
        struct timeval tv = {1, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        char rep[16] = "";
        if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0 && write(fd, "PING\r\n", 6) == 6 &&
            read(fd, rep, sizeof rep - 1) > 0 && strncmp(rep, "+PONG", 5) == 0) {
            close(fd);
            return;
        }
        close(fd);
        if (h_now_ms() > end) H_FAIL(cl, "redis-server on %s did not answer PING within 10 s", db->addr);
        h_sleep_ms(50);
    }
}

struct nb_cluster_opts {
    int pipelines, stages;
    const char *router_extra, *worker_extra;
    int delay_ms; /* > 0: relays with this one-way delay on every link to the router and between stages */
};

/* Starts the worker of (pipeline, stage) in slot idx on host "s<stage>",
 * listening on port 7000 + pipeline there (through a relay when delayed). */
static H_UNUSED void nb_start_worker(struct netbed *nb, int idx, int pipeline, int stage, const char *router_ep,
                                     const char *advertise) {
    struct cluster *cl = nb->cl;
    if (idx > cl->n_workers || idx >= H_WORKERS_MAX) TEST_FAIL("worker slot %d out of range", idx);
    static int generation;
    struct h_proc *p = &cl->workers[idx];
    if (idx == cl->n_workers) cl->n_workers++;
    generation++;
    char name[48];
    snprintf(name, sizeof name, "w-p%d-s%d-%d", pipeline, stage, generation);
    memcpy(p->name, name, sizeof name);
    snprintf(p->log, sizeof p->log, "%s/%s.log", cl->dir, name);
    char host[16], pl[16], st[16], sts[16], listen[64], extra[512], key[400], router_key[400];
    snprintf(host, sizeof host, "s%d", stage);
    if (nb->worker_host[0]) memcpy(host, nb->worker_host, sizeof host);
    struct nb_host *h = nb_host(nb, host);
    snprintf(pl, sizeof pl, "%d", pipeline);
    snprintf(st, sizeof st, "%d", stage);
    snprintf(sts, sizeof sts, "%d", cl->stages);
    snprintf(listen, sizeof listen, "tcp://%s:%d", advertise ? "*" : h->addr,
             7000 + pipeline + (nb->worker_host[0] ? 100 * stage : 0));
    snprintf(extra, sizeof extra, "%s", cl->worker_extra);
    snprintf(key, sizeof key, "%s/workers/worker-%d.key", cl->keys, idx);
    snprintf(router_key, sizeof router_key, "%s/router.pub", cl->keys);
    const char *argv[48] = {NB_IP, "netns", "exec", h->ns, H_WORKER, "--model", cl->model, "--router",
                            router_ep, "--redis", nb->redis_url, "--pipeline", pl, "--stage", st, "--stages",
                            sts, "--worker-id", p->name, "--listen", listen, "--device", "cpu", "--threads",
                            "1", "--log-level", "info", "--curve-key-file", key, "--router-key", router_key,
                            "--metrics-listen", "127.0.0.1:0"};
    int n = 33;
    if (advertise) {
        argv[n++] = "--advertise-host";
        argv[n++] = advertise;
    }
    n = h_add_words(argv, n, extra);
    argv[n] = NULL;
    h_proc_setargs(p, argv);
    h_proc_start(cl, p);
}

static H_UNUSED void nb_start_router(struct netbed *nb) {
    struct cluster *cl = nb->cl;
    struct nb_host *ctl = nb_host(nb, "ctl");
    struct h_proc *p = &cl->router;
    snprintf(p->name, sizeof p->name, "router");
    snprintf(p->log, sizeof p->log, "%s/router.log", cl->dir);
    char stages[16], extra[512], key[400], clients[400], workers[400], cep[64], wep[64];
    snprintf(stages, sizeof stages, "%d", cl->stages);
    snprintf(extra, sizeof extra, "%s", cl->router_extra);
    snprintf(key, sizeof key, "%s/router.key", cl->keys);
    snprintf(clients, sizeof clients, "%s/clients", cl->keys);
    snprintf(workers, sizeof workers, "%s/workers", cl->keys);
    snprintf(cep, sizeof cep, "tcp://%s:5555", ctl->addr);
    snprintf(wep, sizeof wep, "tcp://%s:5556", ctl->addr);
    const char *argv[48] = {NB_IP, "netns", "exec", ctl->ns, H_ROUTER, "--model", cl->model, "--listen", cep,
                            "--worker-listen", wep, "--redis", nb->redis_url, "--stages", stages,
                            "--router-id", "net-router", "--log-level", "info", "--curve-key-file", key,
                            "--client-keys", clients, "--worker-keys", workers, "--metrics-listen",
                            "127.0.0.1:0"};
    int n = 27;
    n = h_add_words(argv, n, extra);
    argv[n] = NULL;
    h_proc_setargs(p, argv);
    h_proc_start(cl, p);
}

/* Redis on "db", the router on "ctl", every pipeline's stage k on "s<k>",
 * and waits (60 s at most) for every pipeline to be ready. */
static H_UNUSED struct cluster *nb_cluster_start(struct netbed *nb, const char *model,
                                                 const struct nb_cluster_opts *o) {
    struct cluster *cl = calloc(1, sizeof *cl);
    if (!cl) TEST_FAIL("out of memory");
    nb->cl = cl;
    snprintf(cl->dir, sizeof cl->dir, "/tmp/llm-net-test-XXXXXX");
    if (!mkdtemp(cl->dir)) TEST_FAIL("mkdtemp: %s", strerror(errno));
    snprintf(cl->model, sizeof cl->model, "%s", model);
    cl->pipelines = o->pipelines;
    cl->stages = o->stages;
    cl->n_routers = 1;
    snprintf(cl->router_extra, sizeof cl->router_extra, "%s", o->router_extra ? o->router_extra : "");
    snprintf(cl->worker_extra, sizeof cl->worker_extra, "%s", o->worker_extra ? o->worker_extra : "");
    h_keys_make(cl);
    nb_redis_start(nb, cl);
    struct nb_host *ctl = nb_host(nb, "ctl");
    snprintf(cl->client_ep, sizeof cl->client_ep, "tcp://%s:5555", ctl->addr);
    char router_ep[64];
    snprintf(router_ep, sizeof router_ep, "tcp://%s:5556", ctl->addr);
    if (o->delay_ms > 0) {
        const char *a = nb_relay_add(nb, 200, 5555, "ctl", 5555, o->delay_ms);
        snprintf(cl->client_ep, sizeof cl->client_ep, "tcp://%s:5555", a);
        nb_relay_add(nb, 200, 5556, "ctl", 5556, o->delay_ms);
        snprintf(router_ep, sizeof router_ep, "tcp://%s:5556", a);
    }
    cl->zctx = zmq_ctx_new();
    zmq_ctx_set(cl->zctx, ZMQ_MAX_SOCKETS, 8192);
    nb_start_router(nb);
    for (int p = 0; p < o->pipelines; p++)
        for (int s = 0; s < o->stages; s++) {
            const char *adv = NULL;
            if (o->delay_ms > 0 && s > 0) {
                char host[16];
                snprintf(host, sizeof host, "s%d", s);
                adv = nb_relay_add(nb, 201 + s, 7000 + p, host, 7000 + p, o->delay_ms);
            }
            nb_start_worker(nb, cl->n_workers, p, s, router_ep, adv);
        }
    h_wait_ready(cl, o->pipelines, 0, 60000);
    return cl;
}

#endif
