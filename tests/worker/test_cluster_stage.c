/* A stage under attack or misconfigured, with real processes and keys
 * (tests/router/cluster_harness.h):
 *  - 10,000 malformed frames on stage 1's link from a process holding the
 *    predecessor's own key, while requests run: every request completes
 *    with llm-run's output, and the stage counts each frame it dropped
 *    (llm_stage_link_frames_dropped_total{reason="malformed"}); issue 29,
 *    defect 5.
 *  - a worker whose key the router does not admit says so in its log,
 *    naming its key file, its public key and the router's endpoint, keeps
 *    trying with back-off, and registers once the router admits the key. */
#include "tests/router/cluster_harness.h"

#include "common/log.h"

#include <stdint.h>

#define MODEL "stories260K-f32.gguf"
#define N_GARBAGE 10000
#define GARBAGE_ENV "LLM_TEST_GARBAGE_TO"

static const char *const prompts[] = {"Once upon a time", "The little dog", "Lily and Tom went to the park",
                                      "One day, a big bird"};
#define N_PROMPTS 4
#define N_TOKENS 24
#define N_WAVE 8

static struct h_ref refs[N_PROMPTS];

/* ---- the garbage sender: this program again, as a process of its own ---- */

static uint32_t g_rand(uint32_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

/* Message i of the garbage: every shape a link message must not have.
 * Fills up to 3 frames; returns how many. */
static int garbage_frames(int i, uint32_t *seed, uint8_t bufs[3][128], size_t lens[3]) {
    for (int k = 0; k < 3; k++)
        for (int b = 0; b < 128; b++) bufs[k][b] = (uint8_t)g_rand(seed);
    /* "LLK1" in the low half of the first header word, little-endian */
    static const uint8_t magic[4] = {0x4c, 0x4c, 0x4b, 0x31};
    switch (i % 7) {
    case 0: lens[0] = 1 + g_rand(seed) % 100; return 1;            /* one frame */
    case 1: lens[0] = 0; return 1;                                /* one empty frame */
    case 2: lens[0] = 32; lens[1] = g_rand(seed) % 128;           /* header with a bad magic */
        bufs[0][0] = 0xff;
        return 2;
    case 3: lens[0] = 31; lens[1] = 16; return 2;                 /* a short header */
    case 4: lens[0] = 32; lens[1] = 8; lens[2] = 8; return 3;     /* three frames */
    case 5:                                                       /* header and body disagree */
        lens[0] = 32;
        lens[1] = 40;
        memcpy(bufs[0], magic, 4);
        memset(bufs[0] + 4, 0, 4);
        memset(bufs[0] + 24, 0, 8);
        bufs[0][24] = 41;
        return 2;
    default:                                                      /* a skip marker with a body */
        lens[0] = 32;
        lens[1] = 12;
        memcpy(bufs[0], magic, 4);
        bufs[0][4] = 1;
        memset(bufs[0] + 5, 0, 3);
        return 2;
    }
}

/* GARBAGE_ENV="ENDPOINT KEYFILE SERVERPUB": connects to the stage link as a
 * CURVE client with KEYFILE's pair, sends N_GARBAGE malformed messages,
 * waits for them to leave, exits 0 (1 on a setup error). */
__attribute__((constructor)) static void garbage_sender_main(void) {
    const char *spec = getenv(GARBAGE_ENV);
    if (!spec) return;
    char ep[256], keyfile[512], server[64], err[512];
    if (sscanf(spec, "%255s %511s %63s", ep, keyfile, server) != 3) _exit(1);
    struct keys_pair kp;
    if (keys_pair_load(keyfile, &kp, err, sizeof err) < 0) {
        fprintf(stderr, "garbage sender: %s\n", err);
        _exit(1);
    }
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_PUSH);
    int hwm = N_GARBAGE + 16, linger = 120000;
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, server, strlen(server));
    zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, kp.pub, strlen(kp.pub));
    zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, kp.sec, strlen(kp.sec));
    if (zmq_connect(s, ep) != 0) {
        fprintf(stderr, "garbage sender: connect %s: %s\n", ep, zmq_strerror(errno));
        _exit(1);
    }
    uint32_t seed = 0x9e3779b9u;
    static uint8_t bufs[3][128];
    size_t lens[3];
    for (int i = 0; i < N_GARBAGE; i++) {
        int n = garbage_frames(i, &seed, bufs, lens);
        for (int k = 0; k < n; k++)
            if (zmq_send(s, bufs[k], lens[k], k + 1 < n ? ZMQ_SNDMORE : 0) < 0) {
                fprintf(stderr, "garbage sender: message %d: %s\n", i, zmq_strerror(errno));
                _exit(1);
            }
    }
    fprintf(stderr, "garbage sender: %d malformed messages queued to %s\n", N_GARBAGE, ep);
    zmq_close(s);
    zmq_ctx_term(ctx); /* returns once the linger let everything go out */
    _exit(0);
}

/* The stage link endpoint a worker logged ("stage link endpoint EP (bound"). */
static void logged_link(struct cluster *cl, struct h_proc *p, char *ep, size_t size) {
    char *log = test_read_file(p->log, NULL);
    const char *at = log ? strstr(log, "stage link endpoint ") : NULL;
    if (!at || sscanf(at + strlen("stage link endpoint "), "%255s", ep) != 1) {
        free(log);
        H_FAIL(cl, "%s logged no stage link endpoint", p->name);
    }
    free(log);
    (void)size;
}

static struct h_gen wave_gs[N_WAVE];

static void wave_make(struct cluster *cl, int wave) {
    memset(wave_gs, 0, sizeof wave_gs);
    for (int i = 0; i < N_WAVE; i++) {
        wave_gs[i].cl = cl;
        wave_gs[i].prompt = prompts[i % N_PROMPTS];
        wave_gs[i].max_tokens = N_TOKENS;
        wave_gs[i].ignore_eos = 1;
        wave_gs[i].wait_ms = 120000;
        snprintf(wave_gs[i].request_id, sizeof wave_gs[i].request_id, "w%d-%d", wave, i);
    }
}

static void wave_check(struct cluster *cl) {
    for (int i = 0; i < N_WAVE; i++) {
        h_check(cl, &wave_gs[i], &refs[i % N_PROMPTS]);
        llm_generate_result_free(&wave_gs[i].res);
    }
}

static void run_wave(struct cluster *cl, int wave) {
    wave_make(cl, wave);
    h_generate_all(wave_gs, N_WAVE);
    wave_check(cl);
}

TEST(cluster_stage_link_garbage_keeps_serving) {
    const char *model = test_model_path(MODEL);
    log_set_level(LL_WARN);
    for (int p = 0; p < N_PROMPTS; p++) h_reference(model, prompts[p], N_TOKENS, 0, &refs[p]);
    struct cluster *cl = h_cluster_start(model, 1, 2, "", "--metrics-listen 127.0.0.1:0");
    if (cl->insecure) TEST_SKIP("the stage link has keys only in a secure cluster");
    char ep[256], spec[1200], server[KEYS_Z85_LEN + 1], path[512], err[512];
    struct h_proc *stage1 = &cl->workers[h_worker_slot(cl, 0, 1)];
    logged_link(cl, stage1, ep, sizeof ep);
    int port = h_logged_port(stage1);
    H_ASSERT(cl, port > 0, "%s logged no metrics port", stage1->name);
    /* Stage 0 is slot 0: the key the router names as stage 1's predecessor. */
    snprintf(path, sizeof path, "%s/workers/worker-%d.pub", cl->keys, h_worker_slot(cl, 0, 1));
    H_ASSERT(cl, keys_pub_load(path, server, err, sizeof err) == 0, "%s", err);
    snprintf(spec, sizeof spec, "%s %s/workers/worker-%d.key %s", ep, cl->keys, h_worker_slot(cl, 0, 0), server);

    /* Requests are running when the garbage starts. */
    wave_make(cl, 0);
    struct h_batch b;
    h_batch_start(&b, wave_gs, N_WAVE);
    int64_t end = h_now_ms() + 60000;
    while (h_tokens_seen(wave_gs, N_WAVE) < N_WAVE) {
        if (h_now_ms() > end) H_FAIL(cl, "no tokens within 60 s");
        h_sleep_ms(2);
    }
    struct h_proc sender = {0};
    snprintf(sender.name, sizeof sender.name, "garbage");
    snprintf(sender.log, sizeof sender.log, "%s/garbage.log", cl->dir);
    const char *argv[] = {"/proc/self/exe", NULL};
    char self[512];
    ssize_t l = readlink("/proc/self/exe", self, sizeof self - 1);
    H_ASSERT(cl, l > 0, "readlink /proc/self/exe: %s", strerror(errno));
    self[l] = 0;
    argv[0] = self;
    h_proc_setargs(&sender, argv);
    setenv(GARBAGE_ENV, spec, 1);
    h_proc_start(cl, &sender);
    unsetenv(GARBAGE_ENV);
    printf("  sending %d malformed messages to %s with stage 0's key\n", N_GARBAGE, ep);

    /* Requests run while the garbage arrives: every one completes, right. */
    h_batch_join(&b);
    wave_check(cl);
    end = h_now_ms() + 240000;
    int wave = 1, st = 0;
    while (!h_proc_exited(&sender, &st)) {
        H_ASSERT(cl, h_now_ms() < end, "the garbage sender still runs after 240 s (%d waves served)", wave - 1);
        run_wave(cl, wave++);
    }
    H_ASSERT(cl, WIFEXITED(st) && WEXITSTATUS(st) == 0, "the garbage sender failed (status 0x%x); see %s", st,
             sender.log);
    printf("  %d waves of %d requests served while it sent\n", wave, N_WAVE);
    /* After the sender: still serving, and every frame counted once read. */
    char *body = malloc(1 << 20);
    double dropped = -1;
    end = h_now_ms() + 60000;
    for (;;) {
        run_wave(cl, wave++);
        H_ASSERT(cl, h_http_get(port, "/metrics", body, 1 << 20) == 200, "stage 1's /metrics did not answer");
        dropped = h_sample(body, "llm_stage_link_frames_dropped_total{reason=\"malformed\"}");
        if (dropped >= N_GARBAGE || h_now_ms() > end) break;
    }
    free(body);
    printf("  stage 1 dropped %.0f malformed messages\n", dropped);
    H_ASSERT(cl, dropped == N_GARBAGE, "stage 1 counts %.0f malformed messages dropped, %d were sent", dropped,
             N_GARBAGE);
    h_cluster_stop(cl);
}

/* ---- a worker whose key the router does not admit ---- */

static int log_has(struct h_proc *p, const char *a, const char *b, const char *c, const char *d) {
    char *log = test_read_file(p->log, NULL);
    int found = 0;
    for (const char *line = log; line && *line && !found;) {
        const char *nl = strchr(line, '\n');
        size_t n = nl ? (size_t)(nl - line) : strlen(line);
        char *one = strndup(line, n);
        found = strstr(one, a) && (!b || strstr(one, b)) && (!c || strstr(one, c)) && (!d || strstr(one, d));
        free(one);
        line = nl ? nl + 1 : NULL;
    }
    free(log);
    return found;
}

TEST(cluster_stage_refused_key_logged_and_retried) {
    const char *model = test_model_path(MODEL);
    log_set_level(LL_WARN);
    struct cluster *cl = h_cluster_start(model, 1, 1, "", "");
    if (cl->insecure) TEST_SKIP("keys are needed");
    char dir[400], key[512], pubfile[512], err[512];
    struct keys_pair kp;
    snprintf(dir, sizeof dir, "%s/strangers", cl->dir);
    H_ASSERT(cl, keys_pair_generate(&kp, err, sizeof err) == 0 && keys_pair_write(dir, "eve", &kp, err, sizeof err) == 0,
             "key: %s", err);
    snprintf(key, sizeof key, "%s/eve.key", dir);
    snprintf(pubfile, sizeof pubfile, "%s/eve.pub", dir);
    char router_key[400];
    snprintf(router_key, sizeof router_key, "%s/router.pub", cl->keys);
    struct h_proc eve = {0};
    snprintf(eve.name, sizeof eve.name, "eve");
    snprintf(eve.log, sizeof eve.log, "%s/eve.log", cl->dir);
    const char *argv[] = {H_WORKER, "--model", cl->model, "--router", cl->worker_ep, "--redis", cl->redis.url,
                          "--pipeline", "7", "--stage", "0", "--stages", "1", "--worker-id", "w-eve",
                          "--listen", "tcp://127.0.0.1:*", "--device", "cpu", "--threads", "1",
                          "--metrics-listen", "127.0.0.1:0", "--curve-key-file", key, "--router-key", router_key,
                          "--log-level", "info", NULL};
    h_proc_setargs(&eve, argv);
    h_proc_start(cl, &eve);

    /* The refusal is said, with what the operator needs to fix it. */
    int64_t end = h_now_ms() + 30000;
    while (!log_has(&eve, "refused this worker's key", kp.pub, key, cl->worker_ep)) {
        int st;
        H_ASSERT(cl, !h_proc_exited(&eve, &st), "the refused worker exited (status 0x%x)", st);
        if (h_now_ms() > end) {
            char tail[4000];
            h_tail(eve.log, tail, sizeof tail, 10);
            H_FAIL(cl, "no line naming the refused key %s, %s and %s within 30 s; the worker's log ends:\n%s",
                   kp.pub, key, cl->worker_ep, tail);
        }
        h_sleep_ms(100);
    }
    printf("  the worker says its key %s was refused by %s\n", kp.pub, cl->worker_ep);
    /* It keeps trying (ZeroMQ itself never reconnects after a refusal). */
    end = h_now_ms() + 30000;
    while (!log_has(&eve, "refused this worker's key", "refused 2 times", NULL, NULL)) {
        H_ASSERT(cl, h_now_ms() < end, "no second attempt within 30 s");
        h_sleep_ms(100);
    }
    int port = h_logged_port(&eve);
    char body[2048];
    H_ASSERT(cl, port > 0, "the refused worker logged no metrics port");
    int code = h_http_get(port, "/ready", body, sizeof body);
    H_ASSERT(cl, code == 503 && strstr(body, "refused this worker's key"), "/ready answered %d: %s", code, body);

    /* The operator admits the key (and restarts the router, which reads its
     * list at start): the worker gets in by itself. */
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "cp '%s' '%s/workers/eve.pub'", pubfile, cl->keys);
    H_ASSERT(cl, system(cmd) == 0, "%s failed", cmd);
    h_proc_kill(&cl->router, SIGKILL);
    h_start_router(cl);
    h_wait_ready(cl, 2, 1, 90000);
    H_ASSERT(cl, log_has(&eve, "admitted this worker's key", NULL, NULL, NULL), "the worker did not log its admission");
    printf("  admitted after the router's list took its key: pipeline 7 ready\n");
    h_proc_kill(&eve, SIGTERM);
    h_cluster_stop(cl);
}

TEST_MAIN(cluster_stage_link_garbage_keeps_serving, cluster_stage_refused_key_logged_and_retried)
