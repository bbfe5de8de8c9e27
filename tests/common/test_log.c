/* Tests for common/log: the level check comes before the arguments are
 * evaluated, lines reach the installed callback with process, pid and level,
 * and level names parse. */
#include "common/log.h"
#include "common/status.h"
#include "tests/test.h"

#include <unistd.h>

static int t_evaluated;
static int t_costly(void) {
    t_evaluated++;
    return 7;
}

struct t_lines {
    int n;
    int level[8];
    char line[8][256];
};

static void t_collect(int level, const char *line, void *ud) {
    struct t_lines *l = ud;
    if (l->n < 8) {
        l->level[l->n] = level;
        snprintf(l->line[l->n], sizeof l->line[0], "%s", line);
    }
    l->n++;
}

TEST(log_level_skips_arguments) {
    struct t_lines lines = {0};
    log_set_callback(t_collect, &lines);
    log_set_level(LL_WARN);
    t_evaluated = 0;
    LOG(LL_DEBUG, "value %d", t_costly());
    LOG(LL_INFO, "value %d", t_costly());
    int skipped = t_evaluated;
    int skipped_lines = lines.n;
    LOG(LL_WARN, "value %d", t_costly());
    LOG(LL_ERROR, "value %d", t_costly());
    log_set_level(LL_NONE);
    LOG(LL_ERROR, "value %d", t_costly());
    log_set_callback(NULL, NULL);
    log_set_level(LL_INFO);
    ASSERT_EQ(0, skipped);
    ASSERT_EQ(0, skipped_lines);
    ASSERT_EQ(2, t_evaluated);
    ASSERT_EQ(2, lines.n);
}

TEST(log_callback_gets_lines) {
    struct t_lines lines = {0};
    log_set_process("router");
    log_set_callback(t_collect, &lines);
    log_set_level(LL_DEBUG);
    LOG(LL_INFO, "request %s stage %d port %d", "req-42", 3, 5555);
    LOG(LL_DEBUG, "debug %s", "line");
    LOG(LL_WARN, "w");
    LOG(LL_ERROR, "e");
    log_set_callback(NULL, NULL);
    log_set_level(LL_INFO);
    log_set_process("llm");
    ASSERT_EQ(4, lines.n);
    ASSERT_EQ(LL_INFO, lines.level[0]);
    ASSERT_EQ(LL_DEBUG, lines.level[1]);
    char want[128];
    snprintf(want, sizeof want, "router[%d] I request req-42 stage 3 port 5555", (int)getpid());
    /* "HH:MM:SS.mmm " comes first: the rest is exact. */
    ASSERT_EQ((int)' ', (int)lines.line[0][12]);
    ASSERT_STREQ(want, lines.line[0] + 13);
    snprintf(want, sizeof want, "router[%d] D debug line", (int)getpid());
    ASSERT_STREQ(want, lines.line[1] + 13);
    ASSERT_TRUE(strstr(lines.line[2], "] W w") != NULL);
    ASSERT_TRUE(strstr(lines.line[3], "] E e") != NULL);
    ASSERT_TRUE(strchr(lines.line[0], '\n') == NULL);
}

TEST(log_long_line_truncated) {
    struct t_lines lines = {0};
    log_set_callback(t_collect, &lines);
    char big[5000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    LOG(LL_ERROR, "%s", big);
    log_set_callback(NULL, NULL);
    ASSERT_EQ(1, lines.n);
    ASSERT_TRUE(strstr(lines.line[0], "] E xxx") != NULL);
}

TEST(log_level_names) {
    int level = -1;
    ASSERT_OK(log_level_parse("debug", &level));
    ASSERT_EQ(LL_DEBUG, level);
    ASSERT_OK(log_level_parse("warn", &level));
    ASSERT_EQ(LL_WARN, level);
    ASSERT_OK(log_level_parse("none", &level));
    ASSERT_EQ(LL_NONE, level);
    ASSERT_EQ(STATUS_BAD_INPUT, log_level_parse("loud", &level));
    ASSERT_EQ(LL_NONE, level); /* unchanged on failure */
}

TEST_MAIN(log_level_skips_arguments, log_callback_gets_lines, log_long_line_truncated,
          log_level_names)
