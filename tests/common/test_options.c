/* Tests for common/options: defaults, environment, flags and their
 * precedence, positionals and subcommands, and the messages for bad input. */
#include "common/options.h"
#include "common/log.h"
#include "common/status.h"
#include "tests/test.h"

#include <stdbool.h>

static int t_port;
static const char *t_url;
static bool t_verbose;
static double t_temp;
static int64_t t_mem;
static int t_dtype;
static const char *const t_dtypes[] = {"f32", "f16", "bf16", NULL};

static const struct option_def t_defs[] = {
    {"port", "TEST_OPT_PORT", OPTION_INT, "5555", "port to listen on", &t_port, 1, 65535, NULL},
    {"redis-url", "TEST_OPT_URL", OPTION_STRING, "redis://127.0.0.1:6379", "Redis", &t_url, 0, 0, NULL},
    {"verbose", "TEST_OPT_VERBOSE", OPTION_BOOL, "false", "debug lines", &t_verbose, 0, 0, NULL},
    {"temp", "TEST_OPT_TEMP", OPTION_FLOAT, "0.8", "temperature", &t_temp, 0, 2, NULL},
    {"kv-mem", "TEST_OPT_KV_MEM", OPTION_SIZE, "1G", "KV cache bytes", &t_mem, 0, 0, NULL},
    {"dtype", "TEST_OPT_DTYPE", OPTION_CHOICE, "f16", "activation type", &t_dtype, 0, 0, t_dtypes},
};
static const struct options t_opts = {"llm-test", "[options] <file>...", "Tests the options table.",
                                      t_defs, (int)(sizeof t_defs / sizeof t_defs[0]), false};

static void t_clear_env(void) {
    for (size_t i = 0; i < sizeof t_defs / sizeof t_defs[0]; i++) unsetenv(t_defs[i].env);
}

/* Parses a NULL-terminated list of arguments (argv[0] included). */
static int t_parse(const struct options *o, char **argv, int *argc, char *err, size_t n) {
    *argc = 0;
    while (argv[*argc]) (*argc)++;
    return options_parse(o, argc, argv, err, n);
}

TEST(options_defaults) {
    t_clear_env();
    char *argv[] = {"prog", NULL};
    char err[256];
    int argc;
    ASSERT_OK(t_parse(&t_opts, argv, &argc, err, sizeof err));
    ASSERT_EQ(1, argc);
    ASSERT_EQ(5555, t_port);
    ASSERT_STREQ("redis://127.0.0.1:6379", t_url);
    ASSERT_TRUE(!t_verbose);
    ASSERT_NEAR(0.8, t_temp, 0);
    ASSERT_EQ((int64_t)1 << 30, t_mem);
    ASSERT_EQ(1, t_dtype);
}

TEST(options_flag_forms) {
    t_clear_env();
    char *argv[] = {"prog", "--port", "7000", "--redis-url=redis://h:1/2", "--verbose",
                    "--temp=1.5", "--kv-mem", "512M", "--dtype", "bf16", NULL};
    char err[256];
    int argc;
    ASSERT_OK(t_parse(&t_opts, argv, &argc, err, sizeof err));
    ASSERT_EQ(7000, t_port);
    ASSERT_STREQ("redis://h:1/2", t_url);
    ASSERT_TRUE(t_verbose);
    ASSERT_NEAR(1.5, t_temp, 0);
    ASSERT_EQ((int64_t)512 << 20, t_mem);
    ASSERT_EQ(2, t_dtype);
    char *argv2[] = {"prog", "--verbose=false", "--kv-mem=4GiB", NULL};
    ASSERT_OK(t_parse(&t_opts, argv2, &argc, err, sizeof err));
    ASSERT_TRUE(!t_verbose);
    ASSERT_EQ((int64_t)4 << 30, t_mem);
    char *argv3[] = {"prog", "--verbose", "--no-verbose", NULL};
    ASSERT_OK(t_parse(&t_opts, argv3, &argc, err, sizeof err));
    ASSERT_TRUE(!t_verbose);
}

TEST(options_env_precedence) {
    t_clear_env();
    setenv("TEST_OPT_PORT", "6000", 1);
    setenv("TEST_OPT_URL", "redis://env:7", 1);
    setenv("TEST_OPT_VERBOSE", "yes", 1);
    setenv("TEST_OPT_DTYPE", "", 1); /* empty counts as unset */
    char *argv[] = {"prog", "--port=6001", NULL};
    char err[256];
    int argc;
    ASSERT_OK(t_parse(&t_opts, argv, &argc, err, sizeof err));
    ASSERT_EQ(6001, t_port);                 /* flag over environment */
    ASSERT_STREQ("redis://env:7", t_url);    /* environment over default */
    ASSERT_TRUE(t_verbose);
    ASSERT_EQ(1, t_dtype);                   /* default */
    char *argv2[] = {"prog", NULL};
    ASSERT_OK(t_parse(&t_opts, argv2, &argc, err, sizeof err));
    ASSERT_EQ(6000, t_port);
    t_clear_env();
}

TEST(options_positionals) {
    t_clear_env();
    char *argv[] = {"prog", "a.gguf", "--port", "9", "b.gguf", "-", "--", "--port", NULL};
    char err[256];
    int argc;
    ASSERT_OK(t_parse(&t_opts, argv, &argc, err, sizeof err));
    ASSERT_EQ(9, t_port);
    ASSERT_EQ(5, argc);
    ASSERT_STREQ("prog", argv[0]);
    ASSERT_STREQ("a.gguf", argv[1]);
    ASSERT_STREQ("b.gguf", argv[2]);
    ASSERT_STREQ("-", argv[3]);
    ASSERT_STREQ("--port", argv[4]); /* after "--" everything is positional */
    ASSERT_TRUE(argv[5] == NULL);
}

TEST(options_subcommand) {
    t_clear_env();
    static int sub_n;
    static const struct option_def sub_defs[] = {
        {"n", NULL, OPTION_INT, "3", "tokens", &sub_n, 1, 100, NULL},
    };
    const struct options global = {"llm", "[options] <command> ...", NULL, t_defs, 6, true};
    const struct options sub = {"llm generate", "[options] <prompt>", NULL, sub_defs, 1, false};
    char *argv[] = {"llm", "--port", "80", "generate", "--n", "7", "hello", "--verbose", NULL};
    char err[256];
    int argc;
    ASSERT_OK(t_parse(&global, argv, &argc, err, sizeof err));
    ASSERT_EQ(80, t_port);
    ASSERT_TRUE(!t_verbose); /* "--verbose" belongs to the subcommand's words */
    ASSERT_EQ(6, argc);
    ASSERT_STREQ("generate", argv[1]);
    ASSERT_STREQ("--verbose", argv[5]);
    int n = argc - 1;
    int rc = options_parse(&sub, &n, argv + 1, err, sizeof err);
    ASSERT_EQ(STATUS_BAD_INPUT, rc); /* the subcommand has no --verbose */
    ASSERT_STREQ("unknown flag --verbose (see --help)", err);
    char *argv2[] = {"llm", "generate", "--n=7", "hello", "world", NULL};
    ASSERT_OK(t_parse(&global, argv2, &argc, err, sizeof err));
    n = argc - 1;
    ASSERT_OK(options_parse(&sub, &n, argv2 + 1, err, sizeof err));
    ASSERT_EQ(7, sub_n);
    ASSERT_EQ(3, n);
    ASSERT_STREQ("hello", argv2[2]);
    ASSERT_STREQ("world", argv2[3]);
}

/* Parses one bad argument list and checks the status and the message. */
static void t_bad(const char *a1, const char *a2, const char *want) {
    char *argv[] = {"prog", (char *)a1, (char *)a2, NULL};
    char err[256];
    int argc;
    int rc = t_parse(&t_opts, argv, &argc, err, sizeof err);
    ASSERT_EQ(STATUS_BAD_INPUT, rc);
    ASSERT_STREQ(want, err);
}

TEST(options_rejects_bad_flags) {
    t_clear_env();
    t_bad("--bogus", NULL, "unknown flag --bogus (see --help)");
    t_bad("--bogus=1", NULL, "unknown flag --bogus (see --help)");
    t_bad("-p", NULL, "unknown flag '-p' (flags are written --name)");
    t_bad("--port", NULL, "--port: missing value");
    t_bad("--port", "12x", "--port: '12x' is not an integer");
    t_bad("--port=", NULL, "--port: '' is not an integer");
    t_bad("--port", "70000", "--port: 70000 is out of range [1, 65535]");
    t_bad("--port", "99999999999999999999", "--port: 99999999999999999999 is out of range [1, 65535]");
    t_bad("--temp", "hot", "--temp: 'hot' is not a finite number");
    t_bad("--temp", "2.5", "--temp: 2.5 is out of range [0, 2]");
    t_bad("--temp=nan", NULL, "--temp: 'nan' is not a finite number");
    t_bad("--verbose=maybe", NULL, "--verbose: 'maybe' is not a boolean (true/false, 1/0, yes/no, on/off)");
    t_bad("--no-verbose=1", NULL, "--no-verbose takes no value, got '1'");
    t_bad("--dtype", "f8", "--dtype: 'f8' is not one of f32, f16, bf16");
    t_bad("--kv-mem", "4X", "--kv-mem: '4X' is not a size in bytes (a whole number with an optional K, M, G or T suffix)");
    t_bad("--kv-mem", "-1", "--kv-mem: '-1' is not a size in bytes (a whole number with an optional K, M, G or T suffix)");
}

TEST(options_rejects_bad_env) {
    t_clear_env();
    setenv("TEST_OPT_PORT", "eighty", 1);
    char *argv[] = {"prog", "--port", "80", NULL};
    char err[256];
    int argc;
    /* A bad environment value is an error even when a flag would override it:
     * a typo in a manifest should not hide until the flag is removed. */
    ASSERT_EQ(STATUS_BAD_INPUT, t_parse(&t_opts, argv, &argc, err, sizeof err));
    ASSERT_STREQ("environment variable TEST_OPT_PORT (for --port): 'eighty' is not an integer", err);
    t_clear_env();
    setenv("TEST_OPT_DTYPE", "int4", 1);
    ASSERT_EQ(STATUS_BAD_INPUT, t_parse(&t_opts, argv, &argc, err, sizeof err));
    ASSERT_STREQ("environment variable TEST_OPT_DTYPE (for --dtype): 'int4' is not one of f32, f16, bf16", err);
    t_clear_env();
}

TEST(options_bad_table) {
    static int x;
    static const struct option_def defs[] = {
        {"threads", NULL, OPTION_INT, "many", "threads", &x, 0, 0, NULL},
    };
    const struct options o = {"prog", NULL, NULL, defs, 1, false};
    char *argv[] = {"prog", NULL};
    char err[256];
    int argc;
    ASSERT_EQ(STATUS_INTERNAL, t_parse(&o, argv, &argc, err, sizeof err));
    ASSERT_STREQ("default of --threads in the options table: 'many' is not an integer", err);
}

TEST(options_help_text) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    ASSERT_TRUE(f != NULL);
    options_help(&t_opts, f);
    fclose(f);
    ASSERT_TRUE(strstr(buf, "usage: llm-test [options] <file>...") != NULL);
    ASSERT_TRUE(strstr(buf, "--port INT") != NULL);
    ASSERT_TRUE(strstr(buf, "env: TEST_OPT_PORT, default: 5555") != NULL);
    ASSERT_TRUE(strstr(buf, "--verbose, --no-verbose") != NULL);
    ASSERT_TRUE(strstr(buf, "--dtype f32|f16|bf16") != NULL);
    ASSERT_TRUE(strstr(buf, "range: 1 to 65535") != NULL);
    free(buf);
}

/* Integer ranges print as integers, however large: "0 to 16777216", not
 * %g's "0 to 1.67772e+07"; a float range keeps its fraction. */
TEST(options_help_prints_integer_ranges_in_full) {
    static int n_blocks, n_port;
    static int64_t n_bytes;
    static double frac;
    static const struct option_def defs[] = {
        {"kv-blocks", NULL, OPTION_INT, "0", "KV blocks", &n_blocks, 0, 1 << 24, NULL},
        {"retry-ms", NULL, OPTION_INT, "5000", "retry", &n_port, 1, 1 << 30, NULL},
        {"max-body", NULL, OPTION_SIZE, "1M", "body", &n_bytes, 1024, (double)(1LL << 40), NULL},
        {"top-p", NULL, OPTION_FLOAT, "0.95", "nucleus", &frac, 0.05, 1, NULL},
    };
    const struct options o = {"llm-test", "[options]", "Ranges.", defs, (int)(sizeof defs / sizeof defs[0]), false};
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    ASSERT_TRUE(f != NULL);
    options_help(&o, f);
    fclose(f);
    if (!strstr(buf, "range: 0 to 16777216")) printf("%s", buf);
    ASSERT_TRUE(strstr(buf, "range: 0 to 16777216") != NULL);
    ASSERT_TRUE(strstr(buf, "range: 1 to 1073741824") != NULL);
    ASSERT_TRUE(strstr(buf, "range: 1024 to 1099511627776") != NULL);
    ASSERT_TRUE(strstr(buf, "range: 0.05 to 1") != NULL);
    ASSERT_TRUE(strstr(buf, "e+") == NULL);
    free(buf);
}

TEST(options_help_flag) {
    t_clear_env();
    char *argv[] = {"prog", "--port", "1", "--help", "--bogus", NULL};
    char err[256];
    int argc;
    fflush(stdout);
    ASSERT_EQ(STATUS_CANCELLED, t_parse(&t_opts, argv, &argc, err, sizeof err));
}

TEST(options_value_text) {
    t_clear_env();
    char *argv[] = {"prog", "--dtype", "f32", "--verbose", NULL};
    char err[256], v[64];
    int argc;
    ASSERT_OK(t_parse(&t_opts, argv, &argc, err, sizeof err));
    options_value_str(&t_defs[5], v, sizeof v);
    ASSERT_STREQ("f32", v);
    options_value_str(&t_defs[2], v, sizeof v);
    ASSERT_STREQ("true", v);
    options_value_str(&t_defs[0], v, sizeof v);
    ASSERT_STREQ("5555", v);
}

/* A table read from the environment only (a library's knobs): defaults,
 * then the variables, and a bad value named by its variable alone. */
TEST(options_parse_env_only) {
    t_clear_env();
    ASSERT_OK(options_parse_env(&t_opts, NULL, 0));
    ASSERT_EQ(5555, t_port);
    ASSERT_EQ(1, t_dtype);
    setenv("TEST_OPT_PORT", "6001", 1);
    setenv("TEST_OPT_VERBOSE", "on", 1);
    setenv("TEST_OPT_URL", "", 1); /* empty: unset, as with flags */
    char err[256];
    ASSERT_OK(options_parse_env(&t_opts, err, sizeof err));
    ASSERT_STREQ("", err);
    ASSERT_EQ(6001, t_port);
    ASSERT_TRUE(t_verbose);
    ASSERT_STREQ("redis://127.0.0.1:6379", t_url);
    setenv("TEST_OPT_PORT", "0", 1);
    ASSERT_EQ(STATUS_BAD_INPUT, options_parse_env(&t_opts, err, sizeof err));
    ASSERT_STREQ("environment variable TEST_OPT_PORT: 0 is out of range [1, 65535]", err);
    t_clear_env();
    setenv("TEST_OPT_DTYPE", "int4", 1);
    ASSERT_EQ(STATUS_BAD_INPUT, options_parse_env(&t_opts, err, sizeof err));
    ASSERT_STREQ("environment variable TEST_OPT_DTYPE: 'int4' is not one of f32, f16, bf16", err);
    t_clear_env();
    setenv("TEST_OPT_VERBOSE", "maybe", 1);
    ASSERT_EQ(STATUS_BAD_INPUT, options_parse_env(&t_opts, err, sizeof err));
    ASSERT_STREQ("environment variable TEST_OPT_VERBOSE: 'maybe' is not a boolean (true/false, 1/0, yes/no, on/off)",
                 err);
    t_clear_env();
    static int x;
    static const struct option_def bad[] = {
        {"threads", "TEST_OPT_THREADS", OPTION_INT, "many", "threads", &x, 0, 0, NULL},
    };
    const struct options o = {"prog", NULL, NULL, bad, 1, false};
    ASSERT_EQ(STATUS_INTERNAL, options_parse_env(&o, err, sizeof err));
    ASSERT_STREQ("default of --threads in the options table: 'many' is not an integer", err);
}

static char t_logged[2048];

static void t_log_line(int level, const char *line, void *ud) {
    (void)level;
    (void)ud;
    size_t n = strlen(t_logged);
    snprintf(t_logged + n, sizeof t_logged - n, "%s\n", line);
}

/* The start-up log shows every option, but a URL's password as "***". */
TEST(options_log_hides_url_passwords) {
    t_clear_env();
    char *argv[] = {"llm-test", "--redis-url", "redis://app:s3cret@h:6379/2", "in.gguf", NULL};
    int argc;
    char err[256];
    ASSERT_OK(t_parse(&t_opts, argv, &argc, err, sizeof err));
    t_logged[0] = '\0';
    log_set_callback(t_log_line, NULL);
    options_log(&t_opts);
    log_set_callback(NULL, NULL);
    ASSERT_TRUE(strstr(t_logged, "option redis-url=redis://app:***@h:6379/2") != NULL);
    ASSERT_TRUE(strstr(t_logged, "s3cret") == NULL);
    char *argv2[] = {"llm-test", "--redis-url", "redis://:x@h", "in.gguf", NULL};
    ASSERT_OK(t_parse(&t_opts, argv2, &argc, err, sizeof err));
    t_logged[0] = '\0';
    log_set_callback(t_log_line, NULL);
    options_log(&t_opts);
    log_set_callback(NULL, NULL);
    ASSERT_TRUE(strstr(t_logged, "option redis-url=redis://:***@h") != NULL);
}

TEST_MAIN(options_defaults, options_flag_forms, options_env_precedence, options_positionals,
          options_subcommand, options_rejects_bad_flags, options_rejects_bad_env,
          options_bad_table, options_help_text, options_help_prints_integer_ranges_in_full,
          options_help_flag, options_value_text, options_parse_env_only, options_log_hides_url_passwords)
