/* The body of a link_conn and the table each transport fills (link_zmq.c,
 * link_nccl.c).  Only worker/link*.c include this. */
#ifndef WORKER_LINK_IMPL_H
#define WORKER_LINK_IMPL_H

#include "link.h"

struct link_ops {
    const char *kind;
    int on_device;
    int (*send)(link_conn *l, uint64_t step_id, const void *buf, size_t bytes);
    int (*recv)(link_conn *l, uint64_t step_id, void *buf, size_t bytes);
    void (*free)(link_conn *l);
    /* NULL: F32 only. */
    int (*set_dtype)(link_conn *l, enum link_dtype t, size_t row_elems);
};

/* Every transport's struct starts with this. */
struct link_conn {
    const struct link_ops *ops;
    enum link_dir dir;
    uint64_t epoch;
    uint64_t dropped[LINK_DROP_N]; /* messages a receiver dropped, by enum link_drop */
    uint64_t wire_sent;            /* bytes a sender put on the wire */
    const _Atomic uint64_t *abort_gen; /* link_set_abort's, or NULL */
    char endpoint[256];
    char errstr[320];
};

/* Records a failure in l->errstr and returns code. */
int link_fail(link_conn *l, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
