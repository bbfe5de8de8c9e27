/* The paged KV memory of one pipeline stage: for each layer it holds, K and
 * V pools of n_blocks blocks of block_size positions on the stage's backend.
 * Which block belongs to which sequence is decided elsewhere (common/
 * kvblocks.h, owned by the router or by llm-run); this module only stores
 * the blocks and executes the copy-on-write copies it is told to. */
#ifndef WORKER_KVCACHE_H
#define WORKER_KVCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/kvblocks.h"
#include "kernels/backend.h"

typedef struct kvcache kvcache;

/* n_layers layers, each K and V [n_blocks][n_kv_heads][block_size][head_dim]
 * of type (F32, F16, or Q8_0: 8-bit values with one F16 scale per group
 * along the head dimension, backend_kv_q8_group in kernels/backend.h).  Returns 0 and *out, or a negative status with a
 * message in err (*out NULL).  The backend must outlive the cache. */
int kvcache_init(kvcache **out, backend *b, int32_t n_layers, enum dtype type, int32_t n_blocks,
                 int32_t block_size, int32_t n_kv_heads, int32_t head_dim, char *err,
                 size_t errlen);
void kvcache_free(kvcache *kc);
/* Bytes of one block of positions in one layer, K and V together: what
 * sizing a cache from a memory budget divides by (Q8_0 takes 132 bytes per
 * 128-wide row against F16's 256: 1.94x the positions in the same memory). */
size_t kvcache_block_bytes(enum dtype type, int32_t block_size, int32_t n_kv_heads, int32_t head_dim);

/* The values of --kv-type (llm-worker, llm-run), NULL-terminated:
 * "auto" (F32 on the CPU, F16 on a GPU), "f32", "f16", "q8_0". */
extern const char *const kvcache_type_names[];
/* The stage_config.kv_type of kvcache_type_names[i]: -1 for "auto". */
int32_t kvcache_type_of_name(int i);

/* The cache of local layer i (0 <= i < n_layers), for backend ops. */
struct backend_kv *kvcache_layer(kvcache *kc, int32_t i);
int32_t kvcache_n_layers(const kvcache *kc);
int32_t kvcache_n_blocks(const kvcache *kc);
int32_t kvcache_block_size(const kvcache *kc);
enum dtype kvcache_type(const kvcache *kc);
/* Backend bytes held (K and V of every layer). */
size_t kvcache_bytes(const kvcache *kc);

/* Copies block src to block dst in every layer, K and V, for each of the n
 * instructions, queued on the backend stream.  Block ids out of range or
 * src == dst give STATUS_BAD_INPUT naming the instruction, before anything
 * is queued. */
int kvcache_copy_blocks(kvcache *kc, const struct kvblocks_copy *copies, int32_t n, char *err,
                        size_t errlen);

#endif
