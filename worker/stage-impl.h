/* The body of a stage, shared by stage.c (loading, allocation) and
 * forward.c (the step).  Nothing outside worker/ includes this. */
#ifndef WORKER_STAGE_IMPL_H
#define WORKER_STAGE_IMPL_H

#include "stage.h"

struct stage_layer {
    float *attn_norm; /* (dim) F32, backend */
    float *ffn_norm;  /* (dim) F32, backend */
    struct backend_weight wq;     /* (n_heads*head_dim, dim) */
    struct backend_weight wk, wv; /* (n_kv_heads*head_dim, dim) */
    struct backend_weight wo;     /* (dim, n_heads*head_dim) */
    struct backend_weight w_gate, w_up; /* (ffn_dim, dim) */
    struct backend_weight w_down;       /* (dim, ffn_dim) */
    float *bq, *bk, *bv; /* qwen2 biases (q_dim) / (kv_dim), F32 backend; NULL if none */
};

/* Offsets (in int32 entries) of the metadata sections of one step
 * (forward.c). */
struct forward_meta {
    int32_t ids, pos, slots, seq_tok0, seq_pos0, tables, rows, used;
    int32_t max_blocks, max_ctx, n_rows;
    int32_t rows_min, rows_max; /* the fewest and the most rows a sequence has */
};

struct stage {
    backend *b;
    const model_file *m;
    struct model_hparams hp;
    struct stage_config cfg;
    int first, last;
    int32_t q_dim, kv_dim;       /* n_heads*head_dim, n_kv_heads*head_dim */
    int32_t max_blocks_per_seq;  /* ceil(n_ctx_max / block_size) */

    struct backend_weight tok_embd; /* (n_vocab, dim): first stage, or last with tied lm_head */
    struct backend_weight output;   /* (n_vocab, dim): last stage, unless tied */
    const struct backend_weight *lm_head; /* &output or &tok_embd */
    float *output_norm;             /* (dim) F32: last stage */
    struct stage_layer *layers;     /* (n_local) */
    int32_t n_local;
    kvcache *kv;
    float *inv_freq;                /* (head_dim/2) rope inverse frequencies */
    size_t weight_bytes;
    void **conv;                    /* (n_conv) host rows of the matrices converted to cfg.weight_type */
    int32_t n_conv;

    /* Scratch, backend memory, T = n_tokens_max rows, L = n_logits_max. */
    float *x;          /* (T, dim) residual stream */
    float *xn;         /* (T, dim) normed input of a sub-layer */
    float *q;          /* (T, q_dim) */
    float *k, *v;      /* (T, kv_dim) */
    float *att;        /* (T, q_dim) attention output */
    float *proj;       /* (T, dim) attention / FFN output before the residual add */
    float *gate, *up;  /* (T, ffn_dim) */
    float *ffn_h;      /* (T, ffn_dim) swiglu(gate, up) */
    float *xl, *xln;   /* (L, dim) rows picked for logits, then normed */
    float *logits;     /* (L, n_vocab) */
    int32_t *meta;     /* step metadata (ids, positions, slots, seqs, tables, rows) */
    int32_t *meta_host;/* host mirror (backend_host_alloc: page-locked on a GPU), uploaded once per step */
    size_t meta_cap;   /* int32 entries of meta and meta_host */
    int unsynced;      /* the last step ended without waiting for the backend */
    /* forward_begin's part of the step forward_step finishes: its graph
     * key (-1: op by op), rows, sequences and metadata layout. */
    struct {
        int on, key;
        int32_t T, n_seqs;
        struct forward_meta mt;
    } pend;
    /* forward_set_before_sample: host work before the rows are sampled */
    void (*before_sample)(void *arg);
    void *before_sample_arg;

    /* Steps replayed as backend graphs (forward.c), one per key
     * (stage_graph_keys of them; NULL until recorded). */
    int graphs_on;             /* the backend has graphs and LLM_CUDA_GRAPHS is not 0 */
    backend_graph **graphs;    /* (stage_graph_keys) */
    unsigned char *graph_dead; /* (stage_graph_keys) 1: recording failed, that key runs ops */
};

/* Graph keys: decode steps (one row a sequence) of 1 .. n_seqs_max
 * sequences, key (n_seqs - 1) * 2 + logits wanted or not; then verifying
 * steps (speculation: every sequence R rows, 2 <= R <= STAGE_GRAPH_ROWS,
 * each row's logits wanted) of 1 .. STAGE_GRAPH_SEQS sequences. */
#define STAGE_GRAPH_ROWS 17 /* one accepted token and up to 16 drafts */
#define STAGE_GRAPH_SEQS 8
static inline int32_t stage_graph_keys(const stage *s) {
    return 2 * s->cfg.n_seqs_max + 2 * (STAGE_GRAPH_ROWS - 1) * STAGE_GRAPH_SEQS;
}

#endif
