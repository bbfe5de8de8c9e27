/* Tests for common/keys: key pair, public key and allowlist files (and
 * directories), errors naming the file and line, writing new pairs and
 * refusing to overwrite them. */
#include "common/keys.h"
#include "common/status.h"
#include "tests/test.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[64];

static void tmpdir_make(void) {
    snprintf(dir, sizeof dir, "/tmp/test_keys.XXXXXX");
    ASSERT_TRUE(mkdtemp(dir) != NULL);
}

static void tmpdir_remove(void) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

static void write_file(const char *name, int mode, const char *text) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    ASSERT_TRUE(f != NULL);
    fputs(text, f);
    fclose(f);
    ASSERT_EQ(0, chmod(path, (mode_t)mode));
}

static const char *path_of(const char *name) {
    static char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return path;
}

TEST(keys_generate_write_load) {
    char err[512];
    tmpdir_make();
    struct keys_pair kp, back;
    ASSERT_OK(keys_pair_generate(&kp, err, sizeof err));
    ASSERT_TRUE(keys_z85_valid(kp.pub));
    ASSERT_TRUE(keys_z85_valid(kp.sec));
    char sub[256];
    snprintf(sub, sizeof sub, "%s/keys", dir); /* made by the call */
    ASSERT_OK(keys_pair_write(sub, "router", &kp, err, sizeof err));
    snprintf(sub, sizeof sub, "%s/keys/router.key", dir);
    struct stat st;
    ASSERT_EQ(0, stat(sub, &st));
    ASSERT_EQ(0600u, (unsigned)(st.st_mode & 0777));
    ASSERT_OK(keys_pair_load(sub, &back, err, sizeof err));
    ASSERT_STREQ(kp.pub, back.pub);
    ASSERT_STREQ(kp.sec, back.sec);
    char pub[KEYS_Z85_LEN + 1];
    snprintf(sub, sizeof sub, "%s/keys/router.pub", dir);
    ASSERT_OK(keys_pub_load(sub, pub, err, sizeof err));
    ASSERT_STREQ(kp.pub, pub);
    /* Never overwritten: a second pair under the same name is refused and
     * the first one stays. */
    struct keys_pair other;
    ASSERT_OK(keys_pair_generate(&other, err, sizeof err));
    snprintf(sub, sizeof sub, "%s/keys", dir);
    ASSERT_EQ(STATUS_BAD_INPUT, keys_pair_write(sub, "router", &other, err, sizeof err));
    ASSERT_TRUE(strstr(err, "router.key exists") != NULL);
    snprintf(sub, sizeof sub, "%s/keys/router.key", dir);
    ASSERT_OK(keys_pair_load(sub, &back, err, sizeof err));
    ASSERT_STREQ(kp.sec, back.sec);
    ASSERT_EQ(STATUS_BAD_INPUT, keys_pair_write(dir, "../x", &other, err, sizeof err));
    ASSERT_EQ(STATUS_BAD_INPUT, keys_pair_write(dir, "", &other, err, sizeof err));
    tmpdir_remove();
}

TEST(keys_pair_errors_name_file_and_line) {
    char err[512], text[512];
    tmpdir_make();
    struct keys_pair kp, kp2, out;
    ASSERT_OK(keys_pair_generate(&kp, err, sizeof err));
    ASSERT_OK(keys_pair_generate(&kp2, err, sizeof err));
    /* Comments and blank lines are fine; a trailing comment too. */
    snprintf(text, sizeof text, "# mine\n\npublic %s  # the public half\nsecret %s\n", kp.pub, kp.sec);
    write_file("ok.key", 0600, text);
    ASSERT_OK(keys_pair_load(path_of("ok.key"), &out, err, sizeof err));
    ASSERT_STREQ(kp.pub, out.pub);
    /* Readable by others, as mounted Secrets are: loaded (with a warning). */
    write_file("open.key", 0644, text);
    ASSERT_OK(keys_pair_load(path_of("open.key"), &out, err, sizeof err));
    ASSERT_STREQ(kp.sec, out.sec);
    /* A short secret on line 2. */
    snprintf(text, sizeof text, "public %s\nsecret abc\n", kp.pub);
    write_file("short.key", 0600, text);
    ASSERT_EQ(STATUS_BAD_INPUT, keys_pair_load(path_of("short.key"), &out, err, sizeof err));
    ASSERT_TRUE(strstr(err, "short.key:2: secret key 'abc'") != NULL);
    /* An unknown word on line 1. */
    snprintf(text, sizeof text, "private %s\n", kp.sec);
    write_file("word.key", 0600, text);
    ASSERT_EQ(STATUS_BAD_INPUT, keys_pair_load(path_of("word.key"), &out, err, sizeof err));
    ASSERT_TRUE(strstr(err, "word.key:1: expected 'public <key>'") != NULL);
    /* Halves of two different pairs. */
    snprintf(text, sizeof text, "public %s\nsecret %s\n", kp.pub, kp2.sec);
    write_file("mixed.key", 0600, text);
    ASSERT_EQ(STATUS_BAD_INPUT, keys_pair_load(path_of("mixed.key"), &out, err, sizeof err));
    ASSERT_TRUE(strstr(err, "does not belong") != NULL);
    /* The secret line missing. */
    snprintf(text, sizeof text, "public %s\n", kp.pub);
    write_file("half.key", 0600, text);
    ASSERT_EQ(STATUS_BAD_INPUT, keys_pair_load(path_of("half.key"), &out, err, sizeof err));
    ASSERT_TRUE(strstr(err, "no 'secret <key>' line") != NULL);
    ASSERT_EQ(STATUS_NOT_FOUND, keys_pair_load(path_of("none.key"), &out, err, sizeof err));
    ASSERT_TRUE(strstr(err, "none.key") != NULL);
    tmpdir_remove();
}

TEST(keys_allowlist_file_and_dir) {
    char err[512], text[1024];
    tmpdir_make();
    struct keys_pair a, b, c;
    ASSERT_OK(keys_pair_generate(&a, err, sizeof err));
    ASSERT_OK(keys_pair_generate(&b, err, sizeof err));
    ASSERT_OK(keys_pair_generate(&c, err, sizeof err));
    snprintf(text, sizeof text, "# admitted workers\n%s worker-p0-s0\n\n%s\n   %s worker-p0-s1 # spare\n",
             a.pub, b.pub, c.pub);
    write_file("workers.list", 0644, text);
    struct keys_list *l = NULL;
    ASSERT_OK(keys_list_load(path_of("workers.list"), &l, err, sizeof err));
    ASSERT_EQ((size_t)3, l->n);
    ASSERT_STREQ("worker-p0-s0", l->e[0].name);
    ASSERT_STREQ("", l->e[1].name);
    ASSERT_STREQ("worker-p0-s1", l->e[2].name);
    ASSERT_EQ(1, keys_list_find(l, b.pub));
    ASSERT_EQ(-1, keys_list_find(l, "not a key"));
    keys_list_free(l);
    /* A bad line: file and line named, nothing returned. */
    snprintf(text, sizeof text, "%s\n%s extra words\n", a.pub, b.pub);
    write_file("bad.list", 0644, text);
    ASSERT_EQ(STATUS_BAD_INPUT, keys_list_load(path_of("bad.list"), &l, err, sizeof err));
    ASSERT_TRUE(l == NULL);
    ASSERT_TRUE(strstr(err, "bad.list:2:") != NULL);
    write_file("bad2.list", 0644, "# only\nnot-a-key name\n");
    ASSERT_EQ(STATUS_BAD_INPUT, keys_list_load(path_of("bad2.list"), &l, err, sizeof err));
    ASSERT_TRUE(strstr(err, "bad2.list:2: key 'not-a-key'") != NULL);
    /* Empty: it would admit nobody. */
    write_file("empty.list", 0644, "# nobody\n\n");
    ASSERT_EQ(STATUS_BAD_INPUT, keys_list_load(path_of("empty.list"), &l, err, sizeof err));
    ASSERT_TRUE(strstr(err, "admit nobody") != NULL);
    /* A directory: its *.pub files, named after the file; other files are
     * not keys. */
    char sub[256];
    snprintf(sub, sizeof sub, "%s/clients", dir);
    ASSERT_OK(keys_pair_write(sub, "bob", &b, err, sizeof err));
    ASSERT_OK(keys_pair_write(sub, "alice", &a, err, sizeof err));
    ASSERT_OK(keys_list_load(sub, &l, err, sizeof err));
    ASSERT_EQ((size_t)2, l->n);
    ASSERT_STREQ("alice", l->e[0].name);
    ASSERT_STREQ(a.pub, l->e[0].pub);
    ASSERT_STREQ("bob", l->e[1].name);
    keys_list_free(l);
    /* A bad .pub in the directory names that file. */
    write_file("clients/eve.pub", 0644, "garbage\n");
    ASSERT_EQ(STATUS_BAD_INPUT, keys_list_load(sub, &l, err, sizeof err));
    ASSERT_TRUE(strstr(err, "eve.pub:1:") != NULL);
    ASSERT_EQ(STATUS_NOT_FOUND, keys_list_load(path_of("missing"), &l, err, sizeof err));
    tmpdir_remove();
}

TEST(keys_hash_in_a_key_is_not_a_comment) {
    /* '#' is a Z85 character: inside a key it is not a comment. */
    char err[512], text[256];
    tmpdir_make();
    struct keys_pair kp;
    int tries = 0;
    do {
        ASSERT_OK(keys_pair_generate(&kp, err, sizeof err));
    } while (!strchr(kp.pub, '#') && ++tries < 100000);
    ASSERT_TRUE(strchr(kp.pub, '#') != NULL);
    snprintf(text, sizeof text, "%s hashy # a comment\n#%s\n", kp.pub, kp.pub);
    write_file("hash.list", 0644, text);
    struct keys_list *l = NULL;
    ASSERT_OK(keys_list_load(path_of("hash.list"), &l, err, sizeof err));
    ASSERT_EQ((size_t)1, l->n);
    ASSERT_STREQ(kp.pub, l->e[0].pub);
    ASSERT_STREQ("hashy", l->e[0].name);
    keys_list_free(l);
    tmpdir_remove();
}

TEST_MAIN(keys_generate_write_load, keys_pair_errors_name_file_and_line, keys_allowlist_file_and_dir,
          keys_hash_in_a_key_is_not_a_comment)
