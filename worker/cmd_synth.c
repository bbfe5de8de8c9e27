/* llm-synth: writes a synthetic Llama model (GGUF) of a preset or custom
 * shape, in any of the usual weight mixes, with deterministic weights from
 * a seed; for benchmarks at real sizes without downloading a model.
 *
 *   llm-synth --out /tmp/7b-q4.gguf --shape llama2-7b --type q4_k_m
 *   llm-synth --out tiny.gguf --shape tiny --layers 4 --type f16 --seed 7 */
#include "synth.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "common/options.h"
#include "common/status.h"

int main(int argc, char **argv) {
    const char *out = NULL, *name = NULL, *log_level = NULL;
    int shape = 0, type = 0, layers = 0, dim = 0, heads = 0, kv_heads = 0, head_dim = 0, ffn = 0, vocab = 0, ctx = 0, threads = 0;
    int64_t seed = 0;
    double theta = 0;
    bool tied = false;
    const struct option_def defs[] = {
        {"out", "LLM_SYNTH_OUT", OPTION_STRING, NULL, "path of the GGUF file to write (required)", &out, 0, 0, NULL},
        {"shape", "LLM_SYNTH_SHAPE", OPTION_CHOICE, "tiny", "preset shape", &shape, 0, 0, synth_shape_names},
        {"type", "LLM_SYNTH_TYPE", OPTION_CHOICE, "f16", "weight types (llama.cpp mixes of the same names)", &type, 0, 0, synth_type_names},
        {"layers", NULL, OPTION_INT, "0", "blocks (0: the preset's)", &layers, 0, 10000, NULL},
        {"dim", NULL, OPTION_INT, "0", "hidden size (0: the preset's)", &dim, 0, 1 << 20, NULL},
        {"heads", NULL, OPTION_INT, "0", "attention heads (0: the preset's)", &heads, 0, 1 << 16, NULL},
        {"kv-heads", NULL, OPTION_INT, "0", "key/value heads (0: the preset's; must divide heads)", &kv_heads, 0, 1 << 16, NULL},
        {"head-dim", NULL, OPTION_INT, "0", "width of each attention head (0: dim / heads; another value makes the "
         "attention n_heads x head-dim wide whatever dim is)", &head_dim, 0, 1 << 16, NULL},
        {"ffn", NULL, OPTION_INT, "0", "feed-forward size (0: the preset's)", &ffn, 0, 1 << 22, NULL},
        {"vocab", NULL, OPTION_INT, "0", "vocabulary size, at least 260 (0: the preset's)", &vocab, 0, 1 << 24, NULL},
        {"context", NULL, OPTION_INT, "0", "context length (0: the preset's)", &ctx, 0, 1 << 24, NULL},
        {"rope-theta", NULL, OPTION_FLOAT, "0", "rope base (0: the preset's)", &theta, 0, 1e12, NULL},
        {"tied", NULL, OPTION_BOOL, "false", "no output.weight: the lm_head is the embedding", &tied, 0, 0, NULL},
        {"seed", "LLM_SYNTH_SEED", OPTION_SIZE, "0", "weights are a function of the seed alone", &seed, 0, 0, NULL},
        {"threads", "LLM_SYNTH_THREADS", OPTION_INT, "0", "generation threads (0: one per CPU)", &threads, 0, 1024, NULL},
        {"name", NULL, OPTION_STRING, NULL, "general.name (default: the shape and type)", &name, 0, 0, NULL},
        {"log-level", "LLM_LOG_LEVEL", OPTION_STRING, "info", "debug, info, warn, error", &log_level, 0, 0, NULL},
    };
    struct options o = {"llm-synth", "[options]", "Writes a synthetic Llama model with a complete SentencePiece vocabulary.",
                        defs, (int)(sizeof defs / sizeof defs[0]), false};
    char err[512];
    int rc = options_parse(&o, &argc, argv, err, sizeof err);
    if (rc == STATUS_CANCELLED) return 0;
    if (rc < 0) {
        fprintf(stderr, "llm-synth: %s\n", err);
        return 2;
    }
    if (argc > 1) {
        fprintf(stderr, "llm-synth: unexpected argument \"%s\" (see --help)\n", argv[1]);
        return 2;
    }
    int level;
    if (log_level_parse(log_level, &level) != 0) {
        fprintf(stderr, "llm-synth: --log-level %s: expected debug, info, warn or error\n", log_level);
        return 2;
    }
    log_set_level(level);
    log_set_process("llm-synth");
    if (!out || !*out) {
        fprintf(stderr, "llm-synth: --out PATH is required\n");
        return 2;
    }
    struct synth_config cfg;
    memset(&cfg, 0, sizeof cfg);
    if (synth_shape_preset(synth_shape_names[shape], &cfg.shape) != 0) {
        fprintf(stderr, "llm-synth: --shape %s: no such preset\n", synth_shape_names[shape]);
        return 2;
    }
    if (layers) cfg.shape.n_layers = layers;
    if (dim) cfg.shape.dim = dim;
    if (heads) cfg.shape.n_heads = heads;
    if (kv_heads) cfg.shape.n_kv_heads = kv_heads;
    else if (heads && cfg.shape.n_heads % cfg.shape.n_kv_heads != 0) cfg.shape.n_kv_heads = heads;
    if (ffn) cfg.shape.ffn_dim = ffn;
    cfg.shape.head_dim = head_dim;
    if (vocab) cfg.shape.n_vocab = vocab;
    if (ctx) cfg.shape.ctx_len = ctx;
    if (theta > 0) cfg.shape.rope_theta = (float)theta;
    cfg.type = (enum synth_type)type;
    cfg.seed = (uint64_t)seed;
    cfg.tied = tied;
    cfg.n_threads = threads;
    char default_name[96];
    snprintf(default_name, sizeof default_name, "synth-%s-%s", synth_shape_names[shape], synth_type_names[type]);
    cfg.name = name ? name : default_name;
    const struct synth_shape *s = &cfg.shape;
    LOG(LL_INFO, "writing %s: %d layers, dim %d, heads %d/%d of %d, ffn %d, vocab %d, context %d, type %s, seed %llu",
        out, s->n_layers, s->dim, s->n_heads, s->n_kv_heads, s->head_dim ? s->head_dim : s->dim / s->n_heads, s->ffn_dim,
        s->n_vocab, s->ctx_len, synth_type_names[type], (unsigned long long)cfg.seed);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    rc = synth_write(&cfg, out, err, sizeof err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (rc != 0) {
        fprintf(stderr, "llm-synth: %s: %s\n", out, err);
        return 1;
    }
    FILE *fp = fopen(out, "rb");
    long long bytes = -1;
    if (fp) {
        fseek(fp, 0, SEEK_END);
        bytes = ftell(fp);
        fclose(fp);
    }
    LOG(LL_INFO, "wrote %s: %lld bytes in %.1f s", out, bytes, (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9);
    return 0;
}
