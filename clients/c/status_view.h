/* How `llm status` shows a router's Status reply: as text or JSON, and
 * which stages of an idle pipeline hold other KV blocks than the router's
 * pipeline (docs/client.md, "llm status").  Used by the llm command; the
 * reply stays the caller's. */
#ifndef CLIENTS_C_STATUS_VIEW_H
#define CLIENTS_C_STATUS_VIEW_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>

#include "proto/wire.h"

/* One status reply with what is needed to judge its stages' views: when it
 * was asked for, and when the router was first seen idle (idle_ms, local
 * monotonic ms; the reply of that moment came back then).  compare_all:
 * --settle-ms 0, every view is taken as it is. */
struct status_kv_read {
    const Llm__StatusReply *s;
    int64_t sent_ms, idle_ms;
    bool compare_all;
};

/* Stages of idle pipelines whose view differs from their pipeline's: the
 * fresh ones when fresh, else those whose view is not yet fresh. */
int status_kv_count(const struct status_kv_read *kv, bool fresh);
/* The reply as JSON (idle, kv_differs, stages_kv_differ included); the
 * caller frees it with cJSON_Delete. */
cJSON *status_view_json(const struct status_kv_read *kv);
/* The reply as text on stdout, from the router at endpoint. */
void status_view_print(const char *endpoint, const struct status_kv_read *kv);

#endif
