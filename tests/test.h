/* A small test harness: typed assertions that print both values (expected
 * first) and a runner.  A test file defines its tests with TEST(name) and
 * ends with TEST_MAIN(list of names); the executable runs all of them or the
 * ones named on its command line, and exits non-zero if any failed.
 *
 *   TEST(kvcache_alloc_free) { ASSERT_EQ(4, kvcache_blocks_free(kc)); }
 *   TEST_MAIN(kvcache_alloc_free)
 *
 * A failed assertion ends the current test (the test owns its cleanup through
 * the TEST_DEFER label pattern: jump with ASSERT, clean up after `done:`).
 * Tests that need something missing call TEST_SKIP("why").  When every test
 * that ran was skipped the executable exits with TEST_EXIT_SKIPPED, which
 * tests/CMakeLists.txt declares as ctest's SKIP_RETURN_CODE, so that a
 * program that checked nothing shows as skipped rather than passed; one that
 * passed some tests and skipped others passes. */
#ifndef TESTS_TEST_H
#define TESTS_TEST_H

#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Exit code of a test program whose tests were all skipped (the automake
 * convention, which ctest's SKIP_RETURN_CODE is set to). */
#define TEST_EXIT_SKIPPED 77

extern jmp_buf test_jmp;
void test_fail_at(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void test_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

#define TEST_FAIL(...) test_fail_at(__FILE__, __LINE__, __VA_ARGS__)
#define TEST_SKIP(...) test_skip(__VA_ARGS__)

#define TEST_FMT_(x)                                                             \
    _Generic((x), _Bool: "%d", char: "%d", signed char: "%d", short: "%d",            \
             unsigned short: "%u", char *: "%s", const char *: "%s", float: "%.9g", double: "%.17g", \
             long double: "%Lg", unsigned char: "%u", int: "%d", unsigned: "%u",  \
             long: "%ld", unsigned long: "%lu", long long: "%lld",               \
             unsigned long long: "%llu", default: "%lld")

/* Integers and floats compare with ==; strings with strcmp (use ASSERT_STREQ). */
#define ASSERT_EQ(expected, actual)                                                     \
    do {                                                                                \
        __typeof__(expected) e_ = (expected);                                           \
        __typeof__(actual) a_ = (actual);                                               \
        if (!(e_ == a_)) {                                                              \
            char fe_[64], fa_[64];                                                      \
            snprintf(fe_, sizeof fe_, TEST_FMT_(e_), e_);                               \
            snprintf(fa_, sizeof fa_, TEST_FMT_(a_), a_);                               \
            TEST_FAIL("ASSERT_EQ(%s, %s): expected %s, got %s", #expected, #actual, fe_, fa_); \
        }                                                                               \
    } while (0)
#define ASSERT_NE(unexpected, actual)                                                   \
    do {                                                                                \
        __typeof__(unexpected) e_ = (unexpected);                                       \
        __typeof__(actual) a_ = (actual);                                               \
        if (e_ == a_) {                                                                 \
            char fa_[64];                                                               \
            snprintf(fa_, sizeof fa_, TEST_FMT_(a_), a_);                               \
            TEST_FAIL("ASSERT_NE(%s, %s): both are %s", #unexpected, #actual, fa_);    \
        }                                                                               \
    } while (0)
#define ASSERT_STREQ(expected, actual)                                                  \
    do {                                                                                \
        const char *e_ = (expected), *a_ = (actual);                                    \
        if (!e_ || !a_ || strcmp(e_, a_) != 0)                                          \
            TEST_FAIL("ASSERT_STREQ(%s, %s): expected \"%s\", got \"%s\"", #expected, #actual, \
                      e_ ? e_ : "(null)", a_ ? a_ : "(null)");                         \
    } while (0)
#define ASSERT_NEAR(expected, actual, tol)                                              \
    do {                                                                                \
        double e_ = (expected), a_ = (actual), t_ = (tol);                              \
        if (!(fabs(e_ - a_) <= t_))                                                     \
            TEST_FAIL("ASSERT_NEAR(%s, %s, %g): expected %.9g, got %.9g (diff %.3g)",  \
                      #expected, #actual, t_, e_, a_, fabs(e_ - a_));                   \
    } while (0)
#define ASSERT_TRUE(cond)                                                               \
    do {                                                                                \
        if (!(cond)) TEST_FAIL("ASSERT_TRUE(%s) failed", #cond);                        \
    } while (0)
/* For status returns: expected 0, prints the status text otherwise. */
#define ASSERT_OK(expr)                                                                 \
    do {                                                                                \
        int s_ = (expr);                                                                \
        if (s_ != 0) TEST_FAIL("ASSERT_OK(%s): got status %d", #expr, s_);             \
    } while (0)

typedef void (*test_fn)(void);
struct test_case { const char *name; test_fn fn; };
int test_run_all(const struct test_case *cases, int n, int argc, char **argv);

#define TEST(name) static void test_##name(void)
#define TEST_ENTRY_(name) {#name, test_##name},
/* TEST_MAIN(a, b, c): up to 64 tests per file. */
#define TEST_MAIN(...)                                                                  \
    int main(int argc, char **argv) {                                                   \
        static const struct test_case cases[] = {TEST_FOREACH_(TEST_ENTRY_, __VA_ARGS__)}; \
        return test_run_all(cases, (int)(sizeof cases / sizeof cases[0]), argc, argv); \
    }

#define TEST_N_(_1,_2,_3,_4,_5,_6,_7,_8,_9,_10,_11,_12,_13,_14,_15,_16,_17,_18,_19,_20,_21,_22,_23,_24,_25,_26,_27,_28,_29,_30,_31,_32,_33,_34,_35,_36,_37,_38,_39,_40,_41,_42,_43,_44,_45,_46,_47,_48,_49,_50,_51,_52,_53,_54,_55,_56,_57,_58,_59,_60,_61,_62,_63,_64,N,...) N
#define TEST_COUNT_(...) TEST_N_(__VA_ARGS__,64,63,62,61,60,59,58,57,56,55,54,53,52,51,50,49,48,47,46,45,44,43,42,41,40,39,38,37,36,35,34,33,32,31,30,29,28,27,26,25,24,23,22,21,20,19,18,17,16,15,14,13,12,11,10,9,8,7,6,5,4,3,2,1)
#define TEST_CAT_(a, b) TEST_CAT2_(a, b)
#define TEST_CAT2_(a, b) a##b
#define TEST_FOREACH_(m, ...) TEST_CAT_(TEST_FE_, TEST_COUNT_(__VA_ARGS__))(m, __VA_ARGS__)
#define TEST_FE_1(m, x) m(x)
#define TEST_FE_2(m, x, ...) m(x) TEST_FE_1(m, __VA_ARGS__)
#define TEST_FE_3(m, x, ...) m(x) TEST_FE_2(m, __VA_ARGS__)
#define TEST_FE_4(m, x, ...) m(x) TEST_FE_3(m, __VA_ARGS__)
#define TEST_FE_5(m, x, ...) m(x) TEST_FE_4(m, __VA_ARGS__)
#define TEST_FE_6(m, x, ...) m(x) TEST_FE_5(m, __VA_ARGS__)
#define TEST_FE_7(m, x, ...) m(x) TEST_FE_6(m, __VA_ARGS__)
#define TEST_FE_8(m, x, ...) m(x) TEST_FE_7(m, __VA_ARGS__)
#define TEST_FE_9(m, x, ...) m(x) TEST_FE_8(m, __VA_ARGS__)
#define TEST_FE_10(m, x, ...) m(x) TEST_FE_9(m, __VA_ARGS__)
#define TEST_FE_11(m, x, ...) m(x) TEST_FE_10(m, __VA_ARGS__)
#define TEST_FE_12(m, x, ...) m(x) TEST_FE_11(m, __VA_ARGS__)
#define TEST_FE_13(m, x, ...) m(x) TEST_FE_12(m, __VA_ARGS__)
#define TEST_FE_14(m, x, ...) m(x) TEST_FE_13(m, __VA_ARGS__)
#define TEST_FE_15(m, x, ...) m(x) TEST_FE_14(m, __VA_ARGS__)
#define TEST_FE_16(m, x, ...) m(x) TEST_FE_15(m, __VA_ARGS__)
#define TEST_FE_17(m, x, ...) m(x) TEST_FE_16(m, __VA_ARGS__)
#define TEST_FE_18(m, x, ...) m(x) TEST_FE_17(m, __VA_ARGS__)
#define TEST_FE_19(m, x, ...) m(x) TEST_FE_18(m, __VA_ARGS__)
#define TEST_FE_20(m, x, ...) m(x) TEST_FE_19(m, __VA_ARGS__)
#define TEST_FE_21(m, x, ...) m(x) TEST_FE_20(m, __VA_ARGS__)
#define TEST_FE_22(m, x, ...) m(x) TEST_FE_21(m, __VA_ARGS__)
#define TEST_FE_23(m, x, ...) m(x) TEST_FE_22(m, __VA_ARGS__)
#define TEST_FE_24(m, x, ...) m(x) TEST_FE_23(m, __VA_ARGS__)
#define TEST_FE_25(m, x, ...) m(x) TEST_FE_24(m, __VA_ARGS__)
#define TEST_FE_26(m, x, ...) m(x) TEST_FE_25(m, __VA_ARGS__)
#define TEST_FE_27(m, x, ...) m(x) TEST_FE_26(m, __VA_ARGS__)
#define TEST_FE_28(m, x, ...) m(x) TEST_FE_27(m, __VA_ARGS__)
#define TEST_FE_29(m, x, ...) m(x) TEST_FE_28(m, __VA_ARGS__)
#define TEST_FE_30(m, x, ...) m(x) TEST_FE_29(m, __VA_ARGS__)
#define TEST_FE_31(m, x, ...) m(x) TEST_FE_30(m, __VA_ARGS__)
#define TEST_FE_32(m, x, ...) m(x) TEST_FE_31(m, __VA_ARGS__)
#define TEST_FE_33(m, x, ...) m(x) TEST_FE_32(m, __VA_ARGS__)
#define TEST_FE_34(m, x, ...) m(x) TEST_FE_33(m, __VA_ARGS__)
#define TEST_FE_35(m, x, ...) m(x) TEST_FE_34(m, __VA_ARGS__)
#define TEST_FE_36(m, x, ...) m(x) TEST_FE_35(m, __VA_ARGS__)
#define TEST_FE_37(m, x, ...) m(x) TEST_FE_36(m, __VA_ARGS__)
#define TEST_FE_38(m, x, ...) m(x) TEST_FE_37(m, __VA_ARGS__)
#define TEST_FE_39(m, x, ...) m(x) TEST_FE_38(m, __VA_ARGS__)
#define TEST_FE_40(m, x, ...) m(x) TEST_FE_39(m, __VA_ARGS__)
#define TEST_FE_41(m, x, ...) m(x) TEST_FE_40(m, __VA_ARGS__)
#define TEST_FE_42(m, x, ...) m(x) TEST_FE_41(m, __VA_ARGS__)
#define TEST_FE_43(m, x, ...) m(x) TEST_FE_42(m, __VA_ARGS__)
#define TEST_FE_44(m, x, ...) m(x) TEST_FE_43(m, __VA_ARGS__)
#define TEST_FE_45(m, x, ...) m(x) TEST_FE_44(m, __VA_ARGS__)
#define TEST_FE_46(m, x, ...) m(x) TEST_FE_45(m, __VA_ARGS__)
#define TEST_FE_47(m, x, ...) m(x) TEST_FE_46(m, __VA_ARGS__)
#define TEST_FE_48(m, x, ...) m(x) TEST_FE_47(m, __VA_ARGS__)
#define TEST_FE_49(m, x, ...) m(x) TEST_FE_48(m, __VA_ARGS__)
#define TEST_FE_50(m, x, ...) m(x) TEST_FE_49(m, __VA_ARGS__)
#define TEST_FE_51(m, x, ...) m(x) TEST_FE_50(m, __VA_ARGS__)
#define TEST_FE_52(m, x, ...) m(x) TEST_FE_51(m, __VA_ARGS__)
#define TEST_FE_53(m, x, ...) m(x) TEST_FE_52(m, __VA_ARGS__)
#define TEST_FE_54(m, x, ...) m(x) TEST_FE_53(m, __VA_ARGS__)
#define TEST_FE_55(m, x, ...) m(x) TEST_FE_54(m, __VA_ARGS__)
#define TEST_FE_56(m, x, ...) m(x) TEST_FE_55(m, __VA_ARGS__)
#define TEST_FE_57(m, x, ...) m(x) TEST_FE_56(m, __VA_ARGS__)
#define TEST_FE_58(m, x, ...) m(x) TEST_FE_57(m, __VA_ARGS__)
#define TEST_FE_59(m, x, ...) m(x) TEST_FE_58(m, __VA_ARGS__)
#define TEST_FE_60(m, x, ...) m(x) TEST_FE_59(m, __VA_ARGS__)
#define TEST_FE_61(m, x, ...) m(x) TEST_FE_60(m, __VA_ARGS__)
#define TEST_FE_62(m, x, ...) m(x) TEST_FE_61(m, __VA_ARGS__)
#define TEST_FE_63(m, x, ...) m(x) TEST_FE_62(m, __VA_ARGS__)
#define TEST_FE_64(m, x, ...) m(x) TEST_FE_63(m, __VA_ARGS__)

/* The whole file at path, NUL-terminated (the caller frees it), its length
 * in *len (may be NULL); NULL when it cannot be opened or read. */
char *test_read_file(const char *path, size_t *len);

/* Path of ../shared/models (LLM_MODELS_DIR overrides), or NULL if missing. */
const char *test_models_dir(void);
/* TEST_SKIPs unless the models folder exists; returns a path buffer "dir/name". */
const char *test_model_path(const char *name);

#endif
