/* CURVE key files: parsing of key pairs, public keys and allowlists with
 * errors that name the file and line, and writing new pairs. */
#include "keys.h"

#include "log.h"
#include "status.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

bool keys_z85_valid(const char *s) {
    if (!s || strlen(s) != KEYS_Z85_LEN) return false;
    uint8_t raw[32];
    return zmq_z85_decode(raw, s) != NULL;
}

/* Splits a line into at most two whitespace-separated words and returns
 * how many there were (3 means "more than two").  '#' is itself a Z85
 * character, so it starts a comment only where a word starts; a key never
 * starts with it (the first character of a 5-character Z85 group stands
 * for at most 2^32 / 85^4, below the last two characters '$' and '#'). */
static int keys_words(char *line, char **w0, char **w1) {
    *w0 = *w1 = NULL;
    int n = 0;
    char *save = NULL;
    for (char *t = strtok_r(line, " \t\r\n", &save); t; t = strtok_r(NULL, " \t\r\n", &save)) {
        if (t[0] == '#') break;
        if (n == 0) *w0 = t;
        else if (n == 1) *w1 = t;
        if (++n == 3) break;
    }
    return n;
}

static FILE *keys_open(const char *path, char *err, size_t errlen, int *rc) {
    FILE *f = fopen(path, "r");
    if (!f) {
        int e = errno;
        *rc = status_fail(err, errlen, e == ENOENT ? STATUS_NOT_FOUND : STATUS_IO, "%s: %s", path,
                          strerror(e));
    }
    return f;
}

/* Copies a word that must be a key, or fails naming the file, line and what. */
static int keys_take(const char *path, int line, const char *what, const char *word,
                     char out[KEYS_Z85_LEN + 1], char *err, size_t errlen) {
    if (!keys_z85_valid(word))
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "%s:%d: %s '%.60s' is not a key (40 Z85 characters)", path, line, what,
                           word);
    memcpy(out, word, KEYS_Z85_LEN + 1);
    return 0;
}

int keys_pair_load(const char *path, struct keys_pair *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    int rc = 0;
    FILE *f = keys_open(path, err, errlen, &rc);
    if (!f) return rc;
    /* Said, not refused: Kubernetes mounts Secrets group-readable
     * (defaultMode 0440 with an fsGroup) and Docker Compose mounts secret
     * files with their host mode for a container user that is not their
     * owner; their folder or volume is what keeps them private there. */
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && (st.st_mode & 004))
        LOG(LL_WARN, "%s: holds a secret key and is readable by every user (mode %03o): keep its "
            "folder private, or chmod 600 it", path, (unsigned)(st.st_mode & 0777));
    char buf[512];
    int line = 0;
    while (rc == 0 && fgets(buf, sizeof buf, f)) {
        line++;
        char *w0, *w1;
        int n = keys_words(buf, &w0, &w1);
        if (n == 0) continue;
        if (n != 2 || (strcmp(w0, "public") != 0 && strcmp(w0, "secret") != 0)) {
            rc = status_fail(err, errlen, STATUS_BAD_INPUT,
                             "%s:%d: expected 'public <key>' or 'secret <key>', got '%.60s%s'",
                             path, line, w0, n > 1 ? " ..." : "");
            break;
        }
        bool pub = w0[0] == 'p';
        rc = keys_take(path, line, pub ? "public key" : "secret key", w1, pub ? out->pub : out->sec,
                       err, errlen);
    }
    if (rc == 0 && ferror(f)) rc = status_fail(err, errlen, STATUS_IO, "%s: read error", path);
    fclose(f);
    if (rc < 0) return rc;
    if (!out->pub[0] || !out->sec[0])
        return status_fail(err, errlen, STATUS_BAD_INPUT, "%s: no '%s <key>' line (a key pair file "
                           "has 'public' and 'secret'; write one with llm keygen)", path,
                           out->pub[0] ? "secret" : "public");
    char derived[KEYS_Z85_LEN + 1];
    if (zmq_curve_public(derived, out->sec) != 0 || strcmp(derived, out->pub) != 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "%s: the public key %s does not belong to the secret key", path,
                           out->pub);
    return 0;
}

int keys_pub_load(const char *path, char out[KEYS_Z85_LEN + 1], char *err, size_t errlen) {
    out[0] = '\0';
    int rc = 0;
    FILE *f = keys_open(path, err, errlen, &rc);
    if (!f) return rc;
    char buf[512];
    int line = 0;
    while (rc == 0 && fgets(buf, sizeof buf, f)) {
        line++;
        char *w0, *w1;
        int n = keys_words(buf, &w0, &w1);
        if (n == 0) continue;
        if (out[0] || n != 1) {
            rc = status_fail(err, errlen, STATUS_BAD_INPUT,
                             "%s:%d: a public key file holds one key on one line", path, line);
            break;
        }
        rc = keys_take(path, line, "public key", w0, out, err, errlen);
    }
    fclose(f);
    if (rc == 0 && !out[0])
        rc = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: no key in the file", path);
    return rc;
}

void keys_list_free(struct keys_list *l) {
    if (!l) return;
    free(l->e);
    free(l);
}

static int keys_list_add(struct keys_list *l, size_t *cap, const char *pub, const char *name) {
    if (l->n == *cap) {
        size_t c = *cap ? *cap * 2 : 16;
        struct keys_entry *e = realloc(l->e, c * sizeof *e);
        if (!e) return STATUS_NO_MEMORY;
        l->e = e;
        *cap = c;
    }
    struct keys_entry *e = &l->e[l->n++];
    memcpy(e->pub, pub, KEYS_Z85_LEN + 1);
    snprintf(e->name, sizeof e->name, "%s", name ? name : "");
    return 0;
}

static int keys_list_file(const char *path, struct keys_list *l, size_t *cap, char *err,
                          size_t errlen) {
    int rc = 0;
    FILE *f = keys_open(path, err, errlen, &rc);
    if (!f) return rc;
    char buf[512];
    int line = 0;
    while (rc == 0 && fgets(buf, sizeof buf, f)) {
        line++;
        char *w0, *w1;
        int n = keys_words(buf, &w0, &w1);
        if (n == 0) continue;
        if (n > 2) {
            rc = status_fail(err, errlen, STATUS_BAD_INPUT,
                             "%s:%d: expected '<key> [name]', got more than two words", path, line);
            break;
        }
        char pub[KEYS_Z85_LEN + 1];
        if ((rc = keys_take(path, line, "key", w0, pub, err, errlen)) < 0) break;
        if (w1 && strlen(w1) > KEYS_NAME_MAX) {
            rc = status_fail(err, errlen, STATUS_BAD_INPUT, "%s:%d: name '%.20s...' is longer "
                             "than %d bytes", path, line, w1, KEYS_NAME_MAX);
            break;
        }
        if (keys_list_add(l, cap, pub, w1) < 0)
            rc = status_fail(err, errlen, STATUS_NO_MEMORY, "%s: out of memory", path);
    }
    fclose(f);
    return rc;
}

static int keys_name_cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int keys_list_dir(const char *path, struct keys_list *l, size_t *cap, char *err,
                         size_t errlen) {
    DIR *d = opendir(path);
    if (!d) return status_fail(err, errlen, STATUS_IO, "%s: %s", path, strerror(errno));
    /* Sorted, so that the order (and a refusal's message) does not depend
     * on the file system. */
    char **names = NULL;
    size_t n = 0, ncap = 0;
    int rc = 0;
    for (struct dirent *de; rc == 0 && (de = readdir(d));) {
        size_t len = strlen(de->d_name);
        if (de->d_name[0] == '.' || len <= 4 || strcmp(de->d_name + len - 4, ".pub") != 0) continue;
        if (n == ncap) {
            ncap = ncap ? ncap * 2 : 16;
            char **p = realloc(names, ncap * sizeof *p);
            if (!p) { rc = STATUS_NO_MEMORY; break; }
            names = p;
        }
        if (!(names[n] = strdup(de->d_name))) rc = STATUS_NO_MEMORY;
        else n++;
    }
    closedir(d);
    if (rc == 0) qsort(names, n, sizeof *names, keys_name_cmp);
    else status_fail(err, errlen, rc, "%s: out of memory", path);
    for (size_t i = 0; i < n && rc == 0; i++) {
        char file[4096], pub[KEYS_Z85_LEN + 1], name[KEYS_NAME_MAX + 1];
        snprintf(file, sizeof file, "%s/%s", path, names[i]);
        snprintf(name, sizeof name, "%.*s", (int)(strlen(names[i]) - 4), names[i]);
        if ((rc = keys_pub_load(file, pub, err, errlen)) < 0) break;
        if (keys_list_add(l, cap, pub, name) < 0)
            rc = status_fail(err, errlen, STATUS_NO_MEMORY, "%s: out of memory", path);
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    return rc;
}

int keys_list_load(const char *path, struct keys_list **out, char *err, size_t errlen) {
    *out = NULL;
    struct stat st;
    if (stat(path, &st) != 0)
        return status_fail(err, errlen, errno == ENOENT ? STATUS_NOT_FOUND : STATUS_IO, "%s: %s",
                           path, strerror(errno));
    struct keys_list *l = calloc(1, sizeof *l);
    if (!l) return status_fail(err, errlen, STATUS_NO_MEMORY, "%s: out of memory", path);
    size_t cap = 0;
    int rc = S_ISDIR(st.st_mode) ? keys_list_dir(path, l, &cap, err, errlen)
                                 : keys_list_file(path, l, &cap, err, errlen);
    if (rc == 0 && l->n == 0)
        rc = status_fail(err, errlen, STATUS_BAD_INPUT, "%s: no keys (%s); it would admit nobody",
                         path, S_ISDIR(st.st_mode) ? "no *.pub file in the directory"
                                                   : "every line blank or a comment");
    if (rc < 0) {
        keys_list_free(l);
        return rc;
    }
    *out = l;
    return 0;
}

int keys_list_find(const struct keys_list *l, const char *pub) {
    if (!l || !pub) return -1;
    for (size_t i = 0; i < l->n; i++)
        if (strcmp(l->e[i].pub, pub) == 0) return (int)i;
    return -1;
}

int keys_pair_generate(struct keys_pair *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    if (!zmq_has("curve"))
        return status_fail(err, errlen, STATUS_UNSUPPORTED,
                           "this libzmq was built without CURVE security (zmq_has(\"curve\") is 0)");
    if (zmq_curve_keypair(out->pub, out->sec) != 0)
        return status_fail(err, errlen, STATUS_INTERNAL, "zmq_curve_keypair: %s",
                           zmq_strerror(errno));
    return 0;
}

/* Creates path exclusively with mode and writes text; the file is removed
 * again if the write fails. */
static int keys_write_new(const char *path, int mode, const char *text, char *err, size_t errlen) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, mode);
    if (fd < 0) {
        int e = errno;
        if (e == EEXIST)
            return status_fail(err, errlen, STATUS_BAD_INPUT,
                               "%s exists: not overwriting a key (remove it first)", path);
        return status_fail(err, errlen, STATUS_IO, "%s: %s", path, strerror(e));
    }
    size_t len = strlen(text);
    ssize_t w = write(fd, text, len);
    int e = errno;
    if (close(fd) != 0 && w == (ssize_t)len) { w = -1; e = errno; }
    if (w != (ssize_t)len) {
        unlink(path);
        return status_fail(err, errlen, STATUS_IO, "%s: write: %s", path, strerror(e));
    }
    return 0;
}

int keys_pair_write(const char *dir, const char *name, const struct keys_pair *kp, char *err,
                    size_t errlen) {
    if (!name || !name[0] || name[0] == '.' || strchr(name, '/') || strlen(name) > KEYS_NAME_MAX)
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "key name '%s': use 1 to %d characters without '/' and not starting "
                           "with '.'", name ? name : "", KEYS_NAME_MAX);
    if (!keys_z85_valid(kp->pub) || !keys_z85_valid(kp->sec))
        return status_fail(err, errlen, STATUS_BAD_INPUT, "key pair for '%s' is not valid Z85",
                           name);
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return status_fail(err, errlen, STATUS_IO, "%s: %s", dir, strerror(errno));
    char key_path[4096], pub_path[4096], text[256];
    snprintf(key_path, sizeof key_path, "%s/%s.key", dir, name);
    snprintf(pub_path, sizeof pub_path, "%s/%s.pub", dir, name);
    /* Check both first, so that a refusal leaves no half-written pair. */
    if (access(key_path, F_OK) == 0 || access(pub_path, F_OK) == 0)
        return status_fail(err, errlen, STATUS_BAD_INPUT,
                           "%s exists: not overwriting a key (remove it first)",
                           access(key_path, F_OK) == 0 ? key_path : pub_path);
    snprintf(text, sizeof text, "# CURVE key pair '%s' (keep secret)\npublic %s\nsecret %s\n",
             name, kp->pub, kp->sec);
    int rc = keys_write_new(key_path, 0600, text, err, errlen);
    if (rc < 0) return rc;
    snprintf(text, sizeof text, "%s\n", kp->pub);
    rc = keys_write_new(pub_path, 0644, text, err, errlen);
    if (rc < 0) unlink(key_path);
    return rc;
}
