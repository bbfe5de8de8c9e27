/* Authentication of a real cluster (docs/security.md): clients, workers and
 * link peers without an admitted key get no service and change nothing; a
 * second worker with a live worker's id and another key is refused while
 * the real pipeline serves on, and also when the router restarted and the
 * second worker names the id before the real one is back; a 1 GB frame is
 * refused at its header and
 * leaves the router small; --insecure still runs a whole cluster. */
#include "tests/router/cluster_harness.h"

#include <sys/mman.h>

#include "common/rconn.h"

#define MODEL "stories260K-f32.gguf"

/* 1 when the file holds needle. */
static int file_has(const char *path, const char *needle) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    return strstr(buf, needle) != NULL;
}

/* Waits up to ms for needle in the router's log. */
static int router_log_has(struct cluster *cl, const char *needle, int ms) {
    int64_t end = h_now_ms() + ms;
    while (!file_has(cl->router.log, needle)) {
        if (h_now_ms() > end) return 0;
        h_sleep_ms(50);
    }
    return 1;
}

static void generate_ok(struct cluster *cl, const struct h_ref *ref, const char *id) {
    struct h_gen g = {0};
    g.cl = cl;
    g.prompt = "Once upon a time";
    g.max_tokens = 20;
    snprintf(g.request_id, sizeof g.request_id, "%s", id);
    h_generate(&g);
    h_check(cl, &g, ref);
    llm_generate_result_free(&g.res);
}

/* A key pair nobody admitted, in the cluster's folder. */
static void stranger_key(struct cluster *cl, const char *name, char *path, size_t size) {
    char err[512], dir[300];
    struct keys_pair kp;
    snprintf(dir, sizeof dir, "%s/strangers", cl->dir);
    if (keys_pair_generate(&kp, err, sizeof err) < 0 || keys_pair_write(dir, name, &kp, err, sizeof err) < 0)
        H_FAIL(cl, "stranger key: %s", err);
    snprintf(path, size, "%s/%s.key", dir, name);
}

/* Starts an extra llm-worker outside the harness's slots. */
static void extra_worker(struct cluster *cl, struct h_proc *p, const char *name, const char *id,
                         const char *key, int pipeline) {
    char pl[16], router_key[400];
    snprintf(pl, sizeof pl, "%d", pipeline);
    snprintf(router_key, sizeof router_key, "%s/router.pub", cl->keys);
    snprintf(p->name, sizeof p->name, "%s", name);
    snprintf(p->log, sizeof p->log, "%s/%s.log", cl->dir, name);
    const char *argv[] = {H_WORKER, "--model", cl->model, "--router", cl->worker_ep, "--redis", cl->redis.url,
                          "--pipeline", pl, "--stage", "0", "--stages", "1", "--worker-id", id,
                          "--listen", "tcp://127.0.0.1:*", "--device", "cpu", "--threads", "1",
                          "--metrics-listen", "", "--curve-key-file", key, "--router-key", router_key,
                          "--log-level", "info", NULL};
    h_proc_setargs(p, argv);
    h_proc_start(cl, p);
}

TEST(cluster_security_admits_listed_keys_only) {
    const char *model = test_model_path(MODEL);
    struct h_ref ref;
    h_reference(model, "Once upon a time", 20, 1, &ref);
    struct cluster *cl = h_cluster_start(model, 1, 2, "", "");
    generate_ok(cl, &ref, "sec-before");

    /* A client with a key the router does not list: no answer, a clear
     * reason, and the router counts the refusal. */
    char key[400], router_key[400], err[512];
    stranger_key(cl, "mallory", key, sizeof key);
    snprintf(router_key, sizeof router_key, "%s/router.pub", cl->keys);
    const char *eps[1] = {cl->client_ep};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.zmq_ctx = cl->zctx;
    cfg.curve_key_file = key;
    cfg.router_key_file = router_key;
    llm_client *c = NULL;
    H_ASSERT(cl, llm_client_open(&c, &cfg, err, sizeof err) == 0, "open: %s", err);
    ASSERT_EQ(STATUS_UNAVAILABLE, llm_client_probe(c, 1500));
    printf("  stranger client: %s\n", llm_client_errstr(c));
    H_ASSERT(cl, strstr(llm_client_errstr(c), "refused this client's key") != NULL, "error: %s",
             llm_client_errstr(c));
    llm_client_close(c);
    H_ASSERT(cl, router_log_has(cl, "in domain 'clients'", 3000), "the router did not log the refused client");
    /* A plain client gets nothing either. */
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.zmq_ctx = cl->zctx;
    cfg.insecure = true;
    H_ASSERT(cl, llm_client_open(&c, &cfg, err, sizeof err) == 0, "open: %s", err);
    ASSERT_EQ(STATUS_UNAVAILABLE, llm_client_probe(c, 1000));
    llm_client_close(c);

    /* A worker with an unlisted key cannot register: no pipeline 7 appears
     * and the router logs the refused handshake. */
    struct h_proc stranger = {0}, fake = {0};
    stranger_key(cl, "eve", key, sizeof key);
    extra_worker(cl, &stranger, "stranger", "w-stranger", key, 7);
    H_ASSERT(cl, router_log_has(cl, "in domain 'workers'", 20000), "the router did not log the refused worker");
    llm_client *sc = h_client(cl, 2000, 5000, 5000);
    Llm__ClientEnvelope *env = NULL;
    ASSERT_OK(llm_client_status(sc, &env));
    for (size_t i = 0; i < env->status_reply->n_workers; i++)
        H_ASSERT(cl, strcmp(env->status_reply->workers[i]->worker_id, "w-stranger") != 0,
                 "a worker with an unlisted key registered");
    proto_client_free(env);
    h_proc_kill(&stranger, SIGKILL);

    /* A second worker with the live stage 1's id and another admitted key
     * (an unused slot's) is refused with a clear error and exits; the real
     * pipeline keeps serving. */
    char fake_key[400];
    snprintf(fake_key, sizeof fake_key, "%s/workers/worker-%d.key", cl->keys, H_WORKERS_MAX - 1);
    int slot = h_worker_slot(cl, 0, 1);
    H_ASSERT(cl, slot >= 0, "no stage 1 worker");
    extra_worker(cl, &fake, "fake", cl->workers[slot].name, fake_key, 0);
    int st = 0;
    int64_t end = h_now_ms() + 30000;
    while (!h_proc_exited(&fake, &st) && h_now_ms() < end) h_sleep_ms(50);
    H_ASSERT(cl, fake.pid == 0, "the fake worker is still running after 30 s");
    H_ASSERT(cl, WIFEXITED(st) && WEXITSTATUS(st) != 0, "the fake worker ended with status 0x%x", st);
    H_ASSERT(cl, file_has(fake.log, "registered from another key"), "the fake worker's log does not say why");
    H_ASSERT(cl, router_log_has(cl, "registered from another key", 1000), "the router did not log the refusal");
    h_wait_ready(cl, 1, 1, 10000);
    generate_ok(cl, &ref, "sec-after");
    ASSERT_OK(llm_client_status(sc, &env));
    ASSERT_EQ((size_t)2, env->status_reply->n_workers);
    proto_client_free(env);
    llm_client_close(sc);
    h_cluster_stop(cl);
}

/* A client of the cluster with the key pair at key (NULL: the harness's
 * client key, from the environment). */
static llm_client *keyed_client(struct cluster *cl, const char *key) {
    char router_key[400], err[512];
    snprintf(router_key, sizeof router_key, "%s/router.pub", cl->keys);
    const char *eps[1] = {cl->client_ep};
    struct llm_client_config cfg;
    llm_client_config_default(&cfg);
    cfg.endpoints = eps;
    cfg.n_endpoints = 1;
    cfg.zmq_ctx = cl->zctx;
    cfg.retry_ms = 5000;
    if (key) {
        cfg.curve_key_file = key;
        cfg.router_key_file = router_key;
    }
    llm_client *c = NULL;
    H_ASSERT(cl, llm_client_open(&c, &cfg, err, sizeof err) == 0, "open: %s", err);
    return c;
}

/* One greedy request of 20 tokens on c; the result must match ref. */
static void keyed_generate(struct cluster *cl, llm_client *c, const char *id, const char *prompt,
                           const struct h_ref *ref, bool reattached) {
    struct llm_generate_params p;
    llm_generate_params_default(&p);
    p.request_id = id;
    p.prompt = prompt;
    p.max_tokens = 20;
    struct llm_generate_result res;
    int rc = llm_client_generate(c, &p, NULL, NULL, &res);
    H_ASSERT(cl, rc == 0, "request %s (\"%s\"): %d (%s)", id, prompt, rc, llm_client_errstr(c));
    H_ASSERT(cl, res.reattached == reattached, "request %s (\"%s\"): reattached %d, expected %d", id, prompt,
             res.reattached, reattached);
    H_ASSERT(cl, res.n_prompt_ids > 0 && res.completion_tokens == (uint32_t)ref->n &&
                     res.tokens_received == (uint32_t)ref->n,
             "request %s (\"%s\"): %u tokens, %u received, expected %d", id, prompt, res.completion_tokens,
             res.tokens_received, ref->n);
    llm_generate_result_free(&res);
}

/* Request ids are per client key (docs/security.md, "Request ownership"):
 * another admitted key that names an id gets a request of its own, never
 * the owner's (no cancel, no re-attach, no tokens), and cannot take an id
 * before its owner's request is accepted (issue 29's squatting: the
 * owner's retry then found NOT_FOUND).  The owner is kept in Redis, so a
 * restarted router keeps both apart. */
TEST(cluster_security_request_belongs_to_its_client) {
    const char *model = test_model_path(MODEL);
    struct h_ref ref, ref_bob;
    h_reference(model, "Once upon a time", 20, 1, &ref);
    h_reference(model, "The little dog", 20, 1, &ref_bob);
    struct cluster *cl = h_cluster_start(model, 1, 1, "", "");
    generate_ok(cl, &ref, "owned-by-a");
    /* A second admitted client, bob; the router reads its allowlist at
     * start, so it restarts, which also shows that the owner is kept with
     * the request in Redis rather than only in the router's memory. */
    char err[512], dir[400], bob[450];
    struct keys_pair kp;
    snprintf(dir, sizeof dir, "%s/clients", cl->keys);
    if (keys_pair_generate(&kp, err, sizeof err) < 0 || keys_pair_write(dir, "bob", &kp, err, sizeof err) < 0)
        H_FAIL(cl, "bob's key: %s", err);
    snprintf(bob, sizeof bob, "%s/bob.key", dir);
    h_proc_kill(&cl->router, SIGTERM);
    h_start_router(cl);
    h_wait_ready(cl, 1, 1, 20000);

    /* Bob cannot cancel alice's request: he hears what an unknown id gets. */
    llm_client *b = keyed_client(cl, bob);
    struct llm_generate_result res = {0};
    ASSERT_EQ(STATUS_NOT_FOUND, llm_client_cancel(b, "never-used-id", &res));
    char unknown[512];
    snprintf(unknown, sizeof unknown, "%s", llm_client_errstr(b));
    llm_generate_result_free(&res);
    ASSERT_EQ(STATUS_NOT_FOUND, llm_client_cancel(b, "owned-by-a", &res));
    printf("  bob cancels: %s\n  (an unknown id: %s)\n", llm_client_errstr(b), unknown);
    H_ASSERT(cl, strstr(llm_client_errstr(b), "no request with id") != NULL, "bob's cancel: %s",
             llm_client_errstr(b));
    llm_generate_result_free(&res);
    /* Bob naming alice's id gets a request of his own: his prompt's tokens,
     * not a replay of hers. */
    keyed_generate(cl, b, "owned-by-a", "The little dog", &ref_bob, false);
    /* Squatting: bob names an id first, before alice's request with it is
     * accepted; alice still gets her own request of that id. */
    keyed_generate(cl, b, "squat", "The little dog", &ref_bob, false);

    llm_client *a = keyed_client(cl, NULL);
    keyed_generate(cl, a, "squat", "Once upon a time", &ref, false);
    H_ASSERT(cl, router_log_has(cl, "another client's key has a request of that id", 3000),
             "the router did not log alice naming an id bob's key has");
    /* Each re-attaches to its own, also after a router restart. */
    keyed_generate(cl, a, "owned-by-a", "Once upon a time", &ref, true);
    llm_client_close(a);
    llm_client_close(b);
    h_proc_kill(&cl->router, SIGTERM);
    h_start_router(cl);
    h_wait_ready(cl, 1, 1, 20000);
    a = keyed_client(cl, NULL);
    b = keyed_client(cl, bob);
    keyed_generate(cl, a, "squat", "Once upon a time", &ref, true);
    keyed_generate(cl, b, "squat", "The little dog", &ref_bob, true);
    keyed_generate(cl, b, "owned-by-a", "The little dog", &ref_bob, true);
    /* A cancel of a finished request answers with its real end, each key
     * its own. */
    ASSERT_OK(llm_client_cancel(a, "squat", &res));
    ASSERT_TRUE(res.finish_reason == LLM__GENERATE_DONE__FINISH_REASON__LENGTH);
    ASSERT_EQ((uint32_t)ref.n, res.completion_tokens);
    llm_generate_result_free(&res);
    /* And a new request of bob's is his alone. */
    keyed_generate(cl, b, "owned-by-bob", "The little dog", &ref_bob, false);
    ASSERT_EQ(STATUS_NOT_FOUND, llm_client_cancel(a, "owned-by-bob", &res));
    llm_generate_result_free(&res);
    llm_client_close(b);
    llm_client_close(a);
    h_cluster_stop(cl);
}

/* Waits up to ms for needle in the part of the file past offset (a log
 * that a restarted process appends to). */
static int file_has_after(const char *path, long offset, const char *needle, int ms) {
    static char buf[1 << 20];
    int64_t end = h_now_ms() + ms;
    for (;;) {
        FILE *f = fopen(path, "r");
        size_t n = 0;
        if (f) {
            if (fseek(f, offset, SEEK_SET) == 0) n = fread(buf, 1, sizeof buf - 1, f);
            fclose(f);
        }
        buf[n] = 0;
        if (strstr(buf, needle)) return 1;
        if (h_now_ms() > end) return 0;
        h_sleep_ms(50);
    }
}

static long file_size(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? (long)st.st_size : 0;
}

/* The owner record of worker id in the cluster's Redis: its value into
 * owner ("" when absent) and its remaining time in ms (-2 when absent). */
static int64_t owner_record(struct cluster *cl, const char *id, char *owner, size_t size) {
    struct rconn *c = NULL;
    char err[512], key[256];
    H_ASSERT(cl, rconn_open_url(cl->redis.url, 2000, &c, err, sizeof err) == 0, "redis: %s", err);
    snprintf(key, sizeof key, "llm:worker-owner:%s", id);
    void *val = NULL;
    size_t len = 0;
    owner[0] = 0;
    if (rconn_get(c, key, &val, &len) == 0) snprintf(owner, size, "%.*s", (int)len, (char *)val);
    free(val);
    int64_t ttl = -2;
    if (rconn_ttl(c, key, &ttl) < 0) ttl = -2;
    rconn_close(c);
    return ttl;
}

/* A worker id stays its key's across a router restart: the restarted
 * router knows no worker, and the id's owner record in Redis, which the
 * router renews from the real worker's heartbeats, refuses another admitted
 * key that names the id first.  The real worker then gets its id back. */
TEST(cluster_security_worker_id_survives_router_restart) {
    const char *model = test_model_path(MODEL);
    struct h_ref ref;
    h_reference(model, "Once upon a time", 20, 1, &ref);
    struct cluster *cl = h_cluster_start(model, 1, 1, "", "");
    generate_ok(cl, &ref, "owner-before");
    int slot = h_worker_slot(cl, 0, 0);
    H_ASSERT(cl, slot >= 0, "no stage 0 worker");
    struct h_proc *real = &cl->workers[slot];
    char real_key[KEYS_Z85_LEN + 1], path[400], err[512], owner[64];
    snprintf(path, sizeof path, "%s/workers/worker-%d.pub", cl->keys, slot);
    H_ASSERT(cl, keys_pub_load(path, real_key, err, sizeof err) == 0, "%s", err);
    /* Its record names its key, and a heartbeat gave it more than one worker
     * timeout (the default 5 s) to live. */
    int64_t ttl = -2, end = h_now_ms() + 10000;
    while ((ttl = owner_record(cl, real->name, owner, sizeof owner)) <= 5000 && h_now_ms() < end) h_sleep_ms(100);
    H_ASSERT(cl, strcmp(owner, real_key) == 0, "owner record of %s: \"%s\", its key is %s", real->name, owner,
             real_key);
    H_ASSERT(cl, ttl > 5000, "owner record of %s lives %lld ms, not renewed past one worker timeout", real->name,
             (long long)ttl);

    /* The real worker is held still, so that the fake names its id to the
     * new router first. */
    H_ASSERT(cl, kill(real->pid, SIGSTOP) == 0, "SIGSTOP: %s", strerror(errno));
    h_proc_kill(&cl->router, SIGKILL);
    long off = file_size(cl->router.log);
    h_start_router(cl);
    H_ASSERT(cl, file_has_after(cl->router.log, off, "redis: connected", 20000), "the new router has no Redis");
    struct h_proc fake = {0};
    char fake_key[400];
    snprintf(fake_key, sizeof fake_key, "%s/workers/worker-%d.key", cl->keys, H_WORKERS_MAX - 1);
    extra_worker(cl, &fake, "fake-after-restart", real->name, fake_key, 0);
    int st = 0;
    end = h_now_ms() + 30000;
    while (!h_proc_exited(&fake, &st) && h_now_ms() < end) h_sleep_ms(50);
    if (fake.pid) {
        kill(real->pid, SIGCONT);
        h_proc_kill(&fake, SIGKILL);
        H_FAIL(cl, "the fake worker with %s's id still runs 30 s after the router restarted", real->name);
    }
    H_ASSERT(cl, WIFEXITED(st) && WEXITSTATUS(st) != 0, "the fake worker ended with status 0x%x", st);
    H_ASSERT(cl, file_has(fake.log, "worker-owner:"), "the fake worker's log does not say why");
    H_ASSERT(cl, file_has_after(cl->router.log, off, "registered from another key", 1000),
             "the router did not log the refusal");

    /* The real worker comes back under its id and serves. */
    H_ASSERT(cl, kill(real->pid, SIGCONT) == 0, "SIGCONT: %s", strerror(errno));
    h_wait_ready(cl, 1, 1, 30000);
    generate_ok(cl, &ref, "owner-after");
    llm_client *sc = h_client(cl, 2000, 5000, 5000);
    Llm__ClientEnvelope *env = NULL;
    ASSERT_OK(llm_client_status(sc, &env));
    ASSERT_EQ((size_t)1, env->status_reply->n_workers);
    H_ASSERT(cl, strcmp(env->status_reply->workers[0]->worker_id, real->name) == 0, "worker %s serves",
             env->status_reply->workers[0]->worker_id);
    proto_client_free(env);
    llm_client_close(sc);
    owner_record(cl, real->name, owner, sizeof owner);
    H_ASSERT(cl, strcmp(owner, real_key) == 0, "owner record of %s after the restart: \"%s\"", real->name, owner);
    h_cluster_stop(cl);
}

/* VmHWM (peak resident set) of a process, in KiB; -1 when unreadable. */
static long vm_hwm_kb(pid_t pid) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %ld kB", &kb) == 1) break;
    fclose(f);
    return kb;
}

static void no_free(void *data, void *hint) {
    (void)data;
    (void)hint;
}

TEST(cluster_insecure_serves_and_bounds_frames) {
    /* Plain sockets, so that the 1 GB frame costs the sender no encryption
     * copy; the bound (ZMQ_MAXMSGSIZE) is the same with keys. */
    const char *model = test_model_path(MODEL);
    struct h_ref ref;
    h_reference(model, "Once upon a time", 20, 1, &ref);
    struct cluster *cl = h_cluster_start(model, 1, 1, "--insecure", "");
    generate_ok(cl, &ref, "insecure-1");
    H_ASSERT(cl, router_log_has(cl, "--insecure", 1000), "no warning about --insecure in the router's log");
    long before = vm_hwm_kb(cl->router.pid);
    H_ASSERT(cl, before > 0, "cannot read the router's VmHWM");
    /* Untouched anonymous pages read as zeros without becoming resident. */
    size_t size = (size_t)1 << 30;
    void *big = mmap(NULL, size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    H_ASSERT(cl, big != MAP_FAILED, "mmap 1 GB: %s", strerror(errno));
    struct zio_sock *s = h_raw_socket(cl, ZMQ_DEALER, "", cl->client_ep);
    struct zio_frame f = {big, size, no_free, NULL};
    ASSERT_OK(zio_send(s, &f, 1, 0));
    /* The router drops the connection at the frame's header. */
    struct zio_parts in = {0};
    ASSERT_EQ(STATUS_TIMEOUT, zio_recv(s, &in, 1500));
    zio_parts_free(&in);
    zio_sock_close(s);
    long after = vm_hwm_kb(cl->router.pid);
    printf("  router VmHWM %ld kB before, %ld kB after a 1 GB frame\n", before, after);
    H_ASSERT(cl, after > 0 && after < 200 * 1024, "router VmHWM %ld kB after a 1 GB frame", after);
    generate_ok(cl, &ref, "insecure-2");
    h_cluster_stop(cl); /* ends the context: ZeroMQ no longer reads the buffer */
    munmap(big, size);
}

TEST_MAIN(cluster_security_admits_listed_keys_only, cluster_security_request_belongs_to_its_client,
          cluster_security_worker_id_survives_router_restart, cluster_insecure_serves_and_bounds_frames)
