/* redis:// URLs for rconn.h: parsing "redis://[user[:password]@]host[:port][/db]"
 * with %-escapes, opening a connection from one, showing one with its
 * password as "***", and putting the password of a file (a Kubernetes
 * Secret) into one for --redis-password-file. */
#include "rconn.h"
#include "rconn-impl.h"

#include "status.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void rconn_url_redact(const char *url, char *out, size_t size) {
    if (!url) url = "(null)";
    const char *scheme = strstr(url, "://");
    const char *auth = scheme ? scheme + 3 : url;
    const char *at = strrchr(auth, '@');
    const char *colon = at ? memchr(auth, ':', (size_t)(at - auth)) : NULL;
    if (!colon) {
        snprintf(out, size, "%s", url);
        return;
    }
    snprintf(out, size, "%.*s***%s", (int)(colon + 1 - url), url, at);
}

/* Percent-decodes n bytes of s into a malloc'd string; NULL on a bad
 * escape, on a NUL byte, or out of memory (*bad says which). */
static char *rconn_pct_decode(const char *s, size_t n, int *bad) {
    *bad = 0;
    char *d = malloc(n + 1);
    if (!d) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '%') {
            d[k++] = s[i];
            continue;
        }
        unsigned v = 0;
        for (size_t j = i + 1; j <= i + 2 && !*bad; j++) {
            int h = j < n ? tolower((unsigned char)s[j]) : -1;
            if (h >= '0' && h <= '9') v = v * 16 + (unsigned)(h - '0');
            else if (h >= 'a' && h <= 'f') v = v * 16 + (unsigned)(h - 'a' + 10);
            else *bad = 1;
        }
        if (*bad || v == 0) {
            *bad = 1;
            break;
        }
        d[k++] = (char)v;
        i += 2;
    }
    if (*bad) {
        for (size_t i = 0; i < k; i++) d[i] = 0;
        free(d);
        return NULL;
    }
    d[k] = '\0';
    return d;
}

/* The parts of "redis://[user[:password]@]host[:port][/db]". */
struct rconn_url {
    char host[256];
    long port, db;
    char *user, *password; /* malloc'd, NULL when absent */
    const char *hostpart;  /* into the URL: what follows the '@' */
};

static void rconn_url_free(struct rconn_url *u) {
    free(u->user);
    rconn_wipe_free(u->password);
    u->user = u->password = NULL;
}

/* Error messages name the URL with its password replaced by "***". */
static int rconn_url_parse(const char *url, struct rconn_url *u, char *err, size_t err_size) {
    memset(u, 0, sizeof *u);
    char shown[512];
    rconn_url_redact(url, shown, sizeof shown);
    const char *p = url && strncmp(url, "redis://", 8) == 0 ? url + 8 : NULL;
    if (!p) {
        snprintf(err, err_size, "redis URL '%s': does not start with redis://", shown);
        return STATUS_BAD_INPUT;
    }
    const char *at = strrchr(p, '@');
    if (at) {
        const char *colon = memchr(p, ':', (size_t)(at - p));
        size_t ul = colon ? (size_t)(colon - p) : (size_t)(at - p);
        int bad = 0;
        if (ul > 0 && !(u->user = rconn_pct_decode(p, ul, &bad))) {
            snprintf(err, err_size, "redis URL '%s': %s", shown,
                     bad ? "the user name has a bad %-escape" : "out of memory");
            return bad ? STATUS_BAD_INPUT : STATUS_NO_MEMORY;
        }
        if (colon && colon + 1 < at &&
            !(u->password = rconn_pct_decode(colon + 1, (size_t)(at - colon - 1), &bad))) {
            rconn_url_free(u);
            snprintf(err, err_size, "redis URL '%s': %s", shown,
                     bad ? "the password has a bad %-escape (write '%' as %25)" : "out of memory");
            return bad ? STATUS_BAD_INPUT : STATUS_NO_MEMORY;
        }
        p = at + 1;
    }
    u->hostpart = p;
    size_t hl = strcspn(p, ":/");
    if (hl == 0 || hl >= sizeof u->host) {
        rconn_url_free(u);
        snprintf(err, err_size, "redis URL '%s': no host", shown);
        return STATUS_BAD_INPUT;
    }
    memcpy(u->host, p, hl);
    u->host[hl] = '\0';
    p += hl;
    u->port = 6379;
    u->db = 0;
    char *end;
    if (*p == ':') {
        errno = 0;
        u->port = strtol(p + 1, &end, 10);
        if (end == p + 1 || errno || u->port <= 0 || u->port > 65535 || (*end && *end != '/')) {
            rconn_url_free(u);
            snprintf(err, err_size, "redis URL '%s': port is not a number from 1 to 65535", shown);
            return STATUS_BAD_INPUT;
        }
        p = end;
    }
    if (*p == '/' && p[1]) {
        errno = 0;
        u->db = strtol(p + 1, &end, 10);
        if (end == p + 1 || errno || u->db < 0 || u->db > 100000 || *end) {
            rconn_url_free(u);
            snprintf(err, err_size, "redis URL '%s': database '%s' is not a number", shown, p + 1);
            return STATUS_BAD_INPUT;
        }
    } else if (*p && strcmp(p, "/") != 0) {
        rconn_url_free(u);
        snprintf(err, err_size, "redis URL '%s': unexpected '%s' after the host", shown, p);
        return STATUS_BAD_INPUT;
    }
    return 0;
}

int rconn_open_url(const char *url, int timeout_ms, struct rconn **out, char *err,
                   size_t err_size) {
    *out = NULL;
    struct rconn_url u;
    int rc = rconn_url_parse(url, &u, err, err_size);
    if (rc < 0) return rc;
    rc = rconn_open_auth(u.host, (int)u.port, (int)u.db, u.user, u.password, timeout_ms, out, err,
                         err_size);
    if (rc < 0 && u.password) {
        /* Which URL the refused password came from, without the password. */
        char shown[512], why[512];
        rconn_url_redact(url, shown, sizeof shown);
        snprintf(why, sizeof why, "%s", err);
        snprintf(err, err_size, "%s (URL %s)", why, shown);
    }
    rconn_url_free(&u);
    return rc;
}

int rconn_url_password_file(const char *url, const char *path, char **out, char *err,
                            size_t err_size) {
    *out = NULL;
    struct rconn_url u;
    int rc = rconn_url_parse(url, &u, err, err_size);
    if (rc < 0) return rc;
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, err_size, "redis password file %s: %s", path, strerror(errno));
        rconn_url_free(&u);
        return STATUS_IO;
    }
    char pw[1025];
    size_t n = fread(pw, 1, sizeof pw, f);
    int read_err = ferror(f);
    fclose(f);
    rc = STATUS_BAD_INPUT;
    if (read_err) {
        snprintf(err, err_size, "redis password file %s: cannot be read", path);
        rc = STATUS_IO;
        goto done;
    }
    if (n == sizeof pw) {
        snprintf(err, err_size, "redis password file %s: longer than %zu bytes", path, sizeof pw - 1);
        goto done;
    }
    /* A Secret or `echo` leaves a final newline; it is not part of the password. */
    while (n > 0 && (pw[n - 1] == '\n' || pw[n - 1] == '\r')) n--;
    pw[n] = '\0';
    if (n == 0) {
        snprintf(err, err_size, "redis password file %s: is empty", path);
        goto done;
    }
    if (memchr(pw, '\n', n) || memchr(pw, '\r', n) || strlen(pw) != n) {
        snprintf(err, err_size, "redis password file %s: the password must be one line of text", path);
        goto done;
    }
    /* redis:// [user] : password (every byte outside the unreserved set
     * escaped) @ host... */
    size_t ulen = u.user ? strlen(u.user) : 0;
    size_t cap = 8 + 3 * ulen + 1 + 3 * n + 1 + strlen(u.hostpart) + 1;
    char *s = malloc(cap);
    if (!s) {
        snprintf(err, err_size, "redis password file %s: out of memory", path);
        rc = STATUS_NO_MEMORY;
        goto done;
    }
    size_t k = (size_t)snprintf(s, cap, "redis://");
    for (int part = 0; part < 2; part++) {
        const char *src = part == 0 ? (u.user ? u.user : "") : pw;
        for (const unsigned char *c = (const unsigned char *)src; *c; c++) {
            if (isalnum(*c) || *c == '-' || *c == '.' || *c == '_' || *c == '~')
                s[k++] = (char)*c;
            else
                k += (size_t)snprintf(s + k, cap - k, "%%%02X", *c);
        }
        s[k++] = part == 0 ? ':' : '@';
    }
    snprintf(s + k, cap - k, "%s", u.hostpart);
    *out = s;
    rc = 0;
done:
    for (volatile char *v = pw; v < pw + sizeof pw; v++) *v = 0;
    rconn_url_free(&u);
    return rc;
}

int rconn_url_password_file_checked(const char *url, const char *path, char **out, char *err,
                                    size_t err_size) {
    char e[512];
    int rc = rconn_url_password_file(url, path, out, e, sizeof e);
    if (rc < 0) return status_fail(err, err_size, rc, "--redis-password-file: %s", e);
    struct rconn *r = NULL;
    rc = rconn_open_url(*out, 2000, &r, e, sizeof e);
    rconn_close(r);
    if (rc == STATUS_BAD_INPUT) {
        free(*out);
        *out = NULL;
        return status_fail(err, err_size, rc,
                           "--redis-password-file %s: Redis refused the password in this file: %s", path, e);
    }
    return STATUS_OK;
}
