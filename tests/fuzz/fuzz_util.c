#include "fuzz_util.h"

#include "common/grammar.h"
#include "common/status.h"

#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char scratch[512];

static void scratch_remove(void) {
    DIR *d = opendir(scratch);
    if (!d) return;
    struct dirent *e;
    char p[1024];
    while ((e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        snprintf(p, sizeof p, "%s/%s", scratch, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(scratch);
}

const char *fuzz_scratch_dir(void) {
    if (scratch[0]) return scratch;
    struct stat sb;
    const char *base = stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) && access("/dev/shm", W_OK) == 0
                           ? "/dev/shm"
                           : getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(scratch, sizeof scratch, "%s/llm-fuzz-XXXXXX", base);
    if (!mkdtemp(scratch)) fuzz_fail("cannot make a scratch folder under %s", base);
    atexit(scratch_remove);
    return scratch;
}

const char *fuzz_write(int slot, const char *name, const void *data, size_t n) {
    static char paths[4][1024];
    if (slot < 0 || slot >= 4) fuzz_fail("fuzz_write: slot %d", slot);
    snprintf(paths[slot], sizeof paths[slot], "%s/%s", fuzz_scratch_dir(), name);
    FILE *fp = fopen(paths[slot], "wb");
    if (!fp) fuzz_fail("cannot write %s", paths[slot]);
    if ((n && fwrite(data, 1, n, fp) != n) | (fclose(fp) != 0)) fuzz_fail("cannot write %s", paths[slot]);
    return paths[slot];
}

void fuzz_remove(const char *name) {
    char p[1024];
    snprintf(p, sizeof p, "%s/%s", fuzz_scratch_dir(), name);
    unlink(p);
}

int fuzz_split(const uint8_t *data, size_t n, const uint8_t **part, size_t *len, int max) {
    int k = 0;
    size_t start = 0;
    for (size_t i = 0; i < n && k < max - 1; i++) {
        if (data[i] != 0) continue;
        part[k] = data + start;
        len[k++] = i - start;
        start = i + 1;
    }
    part[k] = data + start;
    len[k++] = n - start;
    return k;
}

const char *fuzz_models_dir(void) {
    static char dir[1024];
    const char *env = getenv("LLM_MODELS_DIR");
    snprintf(dir, sizeof dir, "%s", env && *env ? env : LLM_SOURCE_DIR "/../shared/models");
    struct stat sb;
    return stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode) ? dir : NULL;
}

void fuzz_fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("fuzz: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

const char fuzz_tiny_tokenizer_json[] =
    "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"ab\":3,\"\xc4\xa0\":4,"
    "\"\xc4\xa0" "a\":5},\"merges\":[\"a b\",\"\xc4\xa0 a\"]},"
    "\"added_tokens\":[{\"id\":6,\"content\":\"<s>\",\"special\":true},"
    "{\"id\":7,\"content\":\"</s>\",\"special\":true}],"
    "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false},"
    "\"decoder\":{\"type\":\"ByteLevel\"}}";

size_t fuzz_tiny_safetensors(uint8_t **out) {
    enum { V = 16, D = 8, Q = 8, KV = 4, F = 16 };
    /* rows 0: a vector of cols elements */
    static const struct { const char *name; int rows, cols; } t[] = {
        {"model.embed_tokens.weight", V, D}, {"model.norm.weight", 0, D}, {"lm_head.weight", V, D},
        {"model.layers.0.input_layernorm.weight", 0, D},
        {"model.layers.0.post_attention_layernorm.weight", 0, D},
        {"model.layers.0.self_attn.q_proj.weight", Q, D}, {"model.layers.0.self_attn.k_proj.weight", KV, D},
        {"model.layers.0.self_attn.v_proj.weight", KV, D}, {"model.layers.0.self_attn.o_proj.weight", D, Q},
        {"model.layers.0.self_attn.q_proj.bias", 0, Q}, {"model.layers.0.self_attn.k_proj.bias", 0, KV},
        {"model.layers.0.self_attn.v_proj.bias", 0, KV}, {"model.layers.0.mlp.gate_proj.weight", F, D},
        {"model.layers.0.mlp.up_proj.weight", F, D}, {"model.layers.0.mlp.down_proj.weight", D, F}};
    char hdr[4096];
    size_t h = 0, off = 0;
    h += (size_t)snprintf(hdr + h, sizeof hdr - h, "{");
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        size_t n = (size_t)(t[i].rows ? t[i].rows : 1) * (size_t)t[i].cols * 4;
        char shape[32];
        if (t[i].rows) snprintf(shape, sizeof shape, "%d,%d", t[i].rows, t[i].cols);
        else snprintf(shape, sizeof shape, "%d", t[i].cols);
        h += (size_t)snprintf(hdr + h, sizeof hdr - h, "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[%s],"
                              "\"data_offsets\":[%zu,%zu]}", i ? "," : "", t[i].name, shape, off, off + n);
        off += n;
    }
    h += (size_t)snprintf(hdr + h, sizeof hdr - h, "}");
    while (h % 8) hdr[h++] = ' '; /* the F32 data aligned in the file */
    if (h >= sizeof hdr) fuzz_fail("safetensors header too long");
    size_t total = 8 + h + off;
    uint8_t *buf = calloc(1, total);
    if (!buf) fuzz_fail("no memory");
    uint64_t hl = h;
    memcpy(buf, &hl, 8);
    memcpy(buf + 8, hdr, h);
    float v = 0.25f;
    for (size_t i = 8 + h; i + 4 <= total; i += 4) memcpy(buf + i, &v, 4);
    *out = buf;
    return total;
}

/* The walk's vocabulary: bytes 0..255 as tokens 0..255, then these, then
 * the end token. */
static const char *const walk_multi[] = {"{\"", "\":", "\",\"", "true", "false", "null", "  ", "\n", "\\u00",
                                         "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80", "ab", "[1,"};
#define WALK_N_MULTI (int32_t)(sizeof walk_multi / sizeof walk_multi[0])
#define WALK_EOG (256 + WALK_N_MULTI)
#define WALK_VOCAB (WALK_EOG + 1)

static char walk_bytes[256];

static grammar_vocab *walk_vocab(void) {
    static grammar_vocab *v;
    if (v) return v;
    const char *tok[WALK_VOCAB];
    int32_t len[WALK_VOCAB];
    for (int i = 0; i < 256; i++) {
        walk_bytes[i] = (char)i;
        tok[i] = &walk_bytes[i];
        len[i] = 1;
    }
    for (int i = 0; i < WALK_N_MULTI; i++) {
        tok[256 + i] = walk_multi[i];
        len[256 + i] = (int32_t)strlen(walk_multi[i]);
    }
    tok[WALK_EOG] = "";
    len[WALK_EOG] = 0;
    int32_t eog = WALK_EOG;
    char err[256];
    if (grammar_vocab_from_bytes(&v, WALK_VOCAB, tok, len, &eog, 1, err, sizeof err) < 0)
        fuzz_fail("the walk's vocabulary: %s", err);
    return v;
}

int fuzz_grammar_walk(grammar *g, const uint8_t *choice, size_t n, char *out, size_t cap, size_t *out_len) {
    grammar_vocab *v = walk_vocab();
    uint64_t mask[(WALK_VOCAB + 63) / 64];
    int32_t allowed[WALK_VOCAB];
    size_t len = 0;
    out[0] = 0;
    *out_len = 0;
    grammar_set_limits(g, &(struct grammar_limits){.n_nodes_max = 1 << 16, .n_states_max = 1 << 12,
                                                   .mask_cache_bytes = 1 << 20});
    int32_t st;
    if (grammar_state_start(g, &st) < 0) return 0;
    for (size_t k = 0; k < n; k++) {
        if (grammar_mask(g, v, st, mask) < 0) return 0;
        int complete = grammar_state_is_complete(g, st), n_allowed = 0;
        for (int32_t t = 0; t < WALK_VOCAB; t++) {
            int in = (int)(mask[t / 64] >> (t % 64) & 1);
            int32_t next;
            if (grammar_state_accept_token(g, v, st, t, &next) < 0) return 0;
            if (in != (next != GRAMMAR_STATE_DEAD))
                fuzz_fail("after \"%s\": token %d is %s by the mask but the matcher %s it", out, t,
                          in ? "allowed" : "refused", next != GRAMMAR_STATE_DEAD ? "accepts" : "refuses");
            if (t == WALK_EOG && in != complete)
                fuzz_fail("after \"%s\": the end token is %s, yet the state is %scomplete", out,
                          in ? "allowed" : "refused", complete ? "" : "not ");
            if (in) allowed[n_allowed++] = t;
        }
        if (n_allowed == 0) fuzz_fail("after \"%s\": a live state that allows no token", out);
        int32_t t = allowed[choice[k] % n_allowed];
        if (t == WALK_EOG) return 1;
        const char *b = t < 256 ? &walk_bytes[t] : walk_multi[t - 256];
        size_t bl = t < 256 ? 1 : strlen(walk_multi[t - 256]);
        if (len + bl >= cap) return 0;
        memcpy(out + len, b, bl);
        len += bl;
        out[len] = 0;
        *out_len = len;
        if (grammar_state_accept_token(g, v, st, t, &st) < 0) return 0;
    }
    return 0;
}
