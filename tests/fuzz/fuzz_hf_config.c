/* A Hugging Face model folder as model_file_open reads it: config.json
 * (model_type, the sizes, rope settings) and, when given,
 * model.safetensors.index.json, next to a small valid model.safetensors and
 * tokenizer.json that the harness writes once.  The input is config.json,
 * then optionally a NUL byte and the index; a well-formed config that
 * matches the fixed tensors opens the whole model, so the fuzzer reaches
 * the tensor and tokenizer checks as well as the parsing. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static int ready;
    if (!ready) {
        uint8_t *st;
        size_t n = fuzz_tiny_safetensors(&st);
        fuzz_write(0, "model.safetensors", st, n);
        free(st);
        fuzz_write(0, "tokenizer.json", fuzz_tiny_tokenizer_json, strlen(fuzz_tiny_tokenizer_json));
        ready = 1;
    }
    const uint8_t *part[2];
    size_t len[2];
    int n = fuzz_split(data, size, part, len, 2);
    fuzz_write(0, "config.json", part[0], len[0]);
    if (n > 1) fuzz_write(0, "model.safetensors.index.json", part[1], len[1]);
    else fuzz_remove("model.safetensors.index.json");
    model_file *m = NULL;
    char err[1024] = "";
    if (model_file_open(&m, fuzz_scratch_dir(), err, sizeof err) < 0) {
        if (m || !err[0]) fuzz_fail("refused model: m %p, message \"%s\"", (void *)m, err);
        return 0;
    }
    const struct model_hparams *hp = model_file_hparams(m);
    if (hp->n_vocab <= 0 || hp->head_dim <= 0 || hp->head_dim % 2 || hp->n_heads % hp->n_kv_heads)
        fuzz_fail("opened with n_vocab %d, head_dim %d, heads %d/%d", hp->n_vocab, hp->head_dim,
                  hp->n_heads, hp->n_kv_heads);
    /* What the engine computes from the hyper-parameters at start. */
    float inv[64];
    if (hp->head_dim / 2 <= 64) model_rope_inv_freq(hp, inv);
    struct model_tensor t;
    if (model_file_tensor(m, "token_embd.weight", &t) != 0) fuzz_fail("opened without token_embd.weight");
    model_file_close(m);
    return 0;
}
