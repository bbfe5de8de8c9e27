/* CURVE key files (docs/security.md): a process's key pair, a peer's public
 * key, and allowlists of admitted public keys.  Keys are Z85 text, 40
 * characters for 32 bytes.
 *
 *   NAME.key (mode 0600):  public <z85>      NAME.pub:  <z85>
 *                          secret <z85>
 *   allowlist:             <z85> [name]      (one per line; or a directory
 *                                             whose *.pub files are the keys)
 *
 * '#' at the start of a word starts a comment (a key never starts with it);
 * blank lines are ignored.  Errors
 * name the file and the line ("keys/w.key:2: secret key 'abc' is not 40
 * Z85 characters").
 *
 *   struct keys_pair kp;
 *   if (keys_pair_load("router.key", &kp, err, sizeof err) < 0) die(err);
 *   struct keys_list *l;
 *   if (keys_list_load("clients/", &l, err, sizeof err) < 0) die(err);
 *   int i = keys_list_find(l, peer_z85);    // -1: not admitted
 *   keys_list_free(l); */
#ifndef COMMON_KEYS_H
#define COMMON_KEYS_H

#include <stdbool.h>
#include <stddef.h>

#define KEYS_Z85_LEN 40
#define KEYS_NAME_MAX 64

struct keys_pair {
    char pub[KEYS_Z85_LEN + 1];
    char sec[KEYS_Z85_LEN + 1];
};

struct keys_entry {
    char pub[KEYS_Z85_LEN + 1];
    char name[KEYS_NAME_MAX + 1]; /* "" when the list gave none */
};

/* An allowlist: plain data, n entries in file (or directory name) order. */
struct keys_list {
    size_t n;
    struct keys_entry *e;
};

/* true when s is exactly 40 Z85 characters that decode to 32 bytes. */
bool keys_z85_valid(const char *s);

/* Reads a NAME.key file: both lines required, the public key must belong to
 * the secret one.  A file every user may read is logged as a warning (not
 * refused: mounted Secrets often are).  0, or STATUS_NOT_FOUND / STATUS_IO / STATUS_BAD_INPUT with err
 * naming the file (and line). */
int keys_pair_load(const char *path, struct keys_pair *out, char *err, size_t errlen);

/* Reads a NAME.pub file (one key; comments and blank lines allowed). */
int keys_pub_load(const char *path, char out[KEYS_Z85_LEN + 1], char *err, size_t errlen);

/* Reads an allowlist file, or every *.pub in a directory (the name of each
 * entry is the file name without .pub).  An empty list is an error: it
 * would admit nobody, which is never what was meant.  On success *out is
 * the caller's (keys_list_free); on failure NULL. */
int keys_list_load(const char *path, struct keys_list **out, char *err, size_t errlen);
void keys_list_free(struct keys_list *l);
/* Index of the entry with this public key, or -1. */
int keys_list_find(const struct keys_list *l, const char *pub);

/* A fresh key pair (zmq_curve_keypair).  STATUS_UNSUPPORTED when libzmq
 * was built without CURVE. */
int keys_pair_generate(struct keys_pair *out, char *err, size_t errlen);

/* Writes DIR/NAME.key (mode 0600) and DIR/NAME.pub, creating DIR (0700) if
 * it is missing.  Refuses (STATUS_BAD_INPUT) to overwrite either file and a
 * NAME with '/' or that starts with '.'. */
int keys_pair_write(const char *dir, const char *name, const struct keys_pair *kp, char *err,
                    size_t errlen);

#endif
