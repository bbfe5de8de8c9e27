/* Chat templates: turn a list of chat messages into the prompt text an
 * instruct model was trained on.  Models ship their template as a Jinja
 * program (GGUF tokenizer.chat_template, Hugging Face tokenizer_config.json);
 * rather than run Jinja, the template is recognised among the common
 * families by its distinctive markers and each family is rendered by C code.
 * A template that matches no family is reported as such: the caller refuses
 * chat requests rather than guess a prompt the model was never trained on.
 *
 *   enum chat_family f = chat_template_detect(tmpl);   // CHAT_FAMILY_NONE: unknown
 *   struct chat_message m[] = {{"system", "Be brief."}, {"user", "Hi"}};
 *   char *text;  size_t *spans, n_spans;
 *   if (chat_template_render(f, m, 2, 1, &text, &spans, &n_spans, err, sizeof err) < 0) ...;
 *   // encode text with tokenizer_encode_plain(tok, text, strlen(text), -1,
 *   // spans, n_spans, ...): the template's markers become their special
 *   // tokens, the messages' texts stay text; stop at
 *   // chat_template_end_of_turn(f)
 *   free(text), free(spans);
 *
 * The rendered text never starts with the BOS token: the tokenizer adds it
 * as the model's metadata says.  The template's markers ("<|im_start|>",
 * later "<s>" of Llama-2) are special tokens; the same text inside a
 * message is not. */
#ifndef COMMON_CHAT_TEMPLATE_H
#define COMMON_CHAT_TEMPLATE_H

#include <stddef.h>

enum chat_family {
    CHAT_FAMILY_NONE = 0, /* not recognised */
    CHAT_FAMILY_LLAMA2,   /* [INST] <<SYS>> ... <</SYS>> ... [/INST] */
    CHAT_FAMILY_LLAMA3,   /* <|start_header_id|>role<|end_header_id|> ... <|eot_id|> */
    CHAT_FAMILY_CHATML,   /* <|im_start|>role ... <|im_end|> (Qwen, Yi, Hermes, ...) */
    CHAT_FAMILY_MISTRAL,  /* [INST] ... [/INST] without <<SYS>> */
    CHAT_FAMILY_ZEPHYR,   /* <|user|>\n ... </s> */
    CHAT_FAMILY_GEMMA,    /* <start_of_turn>user ... <end_of_turn> */
    CHAT_FAMILY_PHI3,     /* <|user|>\n ... <|end|> */
    CHAT_FAMILY_DEEPSEEK, /* <｜User｜> ... <｜Assistant｜> ... <｜end▁of▁sentence｜> (V3, R1) */
    CHAT_FAMILY_COUNT
};

/* "llama2", "llama3", "chatml", "mistral", "zephyr", "gemma", "phi3",
 * "deepseek"; "none" for CHAT_FAMILY_NONE.  Static. */
const char *chat_family_name(enum chat_family f);
/* The family called name (as chat_family_name writes it; "qwen" is also
 * chatml), or CHAT_FAMILY_NONE for an unknown name. */
enum chat_family chat_family_from_name(const char *name);
/* The names accepted by chat_family_from_name, comma-separated; static. */
const char *chat_family_names(void);

/* The family whose markers the template text shows, or CHAT_FAMILY_NONE
 * (also for NULL). */
enum chat_family chat_template_detect(const char *tmpl);

/* The model's template text: the GGUF key tokenizer.chat_template of a
 * .gguf file, or of a Hugging Face directory its tokenizer_config.json
 * "chat_template" (a string, or the entry named "default" of a list of
 * {name, template}) or else its chat_template.jinja.  On success *out is
 * malloc'ed (the caller frees it) or NULL when the model has no template
 * (returns 0 either way).  A file that cannot be read: a negative status and
 * err says why, *out NULL. */
int chat_template_from_model(const char *path, char **out, char *err, size_t errlen);

struct chat_message {
    const char *role;    /* "system", "developer" (as system), "user", "assistant" */
    const char *content; /* UTF-8 text */
};

/* Renders messages in family f; add_generation_prompt appends the opening of
 * the assistant's turn.  Messages: at most one system message, first; then
 * user and assistant turns (families that require it: alternating, starting
 * with user).  Families without a system role (Mistral, Gemma) put the
 * system text before the first user message's text, separated by a blank
 * line.  On success *out is malloc'ed (the caller frees it).  Bad messages
 * (an unknown role, a system message not first, turns that do not
 * alternate where the family needs it, no messages): STATUS_BAD_INPUT, err
 * names the message index and why, *out NULL.  With spans and n_spans,
 * *spans (malloc'ed, *n_spans pairs [start, end) in order) says where the
 * messages' texts lie in *out: the caller encodes *out with
 * tokenizer_encode_plain on them, so that a message's text never becomes a
 * marker of the template. */
int chat_template_render(enum chat_family f, const struct chat_message *msgs, size_t n,
                         int add_generation_prompt, char **out, size_t **spans, size_t *n_spans, char *err,
                         size_t errlen);

/* The text of the token that ends an assistant turn in family f
 * ("<|eot_id|>", "<|im_end|>", "</s>", ...); static; "" for NONE. */
const char *chat_template_end_of_turn(enum chat_family f);

#endif
