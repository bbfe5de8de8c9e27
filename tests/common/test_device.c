/* Tests of common/device: the forms --device accepts, the canonical text of
 * each, and the message for a value it refuses. */
#include "common/device.h"

#include "common/status.h"
#include "tests/test.h"

static struct device_spec parse_ok(const char *text) {
    struct device_spec d;
    char err[256] = "";
    int rc = device_parse("--device", text, &d, err, sizeof err);
    if (rc != STATUS_OK) TEST_FAIL("device_parse(\"%s\"): %s", text ? text : "(null)", err);
    return d;
}

TEST(device_parse_accepts_every_form) {
    struct device_spec d = parse_ok("auto");
    ASSERT_EQ((int)DEVICE_AUTO, (int)d.kind);
    d = parse_ok(NULL);
    ASSERT_EQ((int)DEVICE_AUTO, (int)d.kind);
    d = parse_ok("cpu");
    ASSERT_EQ((int)DEVICE_CPU, (int)d.kind);
    d = parse_ok("cuda");
    ASSERT_EQ((int)DEVICE_CUDA, (int)d.kind);
    ASSERT_EQ(0, d.index);
    d = parse_ok("cuda:0");
    ASSERT_EQ((int)DEVICE_CUDA, (int)d.kind);
    ASSERT_EQ(0, d.index);
    d = parse_ok("cuda:7");
    ASSERT_EQ(7, d.index);
    d = parse_ok("cuda:1023");
    ASSERT_EQ(DEVICE_CUDA_INDEX_MAX, d.index);
}

TEST(device_format_round_trips) {
    const char *forms[] = {"auto", "cpu", "cuda:0", "cuda:12"};
    char buf[32];
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        struct device_spec d = parse_ok(forms[i]);
        ASSERT_STREQ(forms[i], device_format(&d, buf, sizeof buf));
    }
    struct device_spec d = parse_ok("cuda");
    ASSERT_STREQ("cuda:0", device_format(&d, buf, sizeof buf));
}

TEST(device_parse_refuses_other_text_naming_flag_and_value) {
    const char *bad[] = {"", "gpu", "CPU", "cuda:", "cuda:x", "cuda:-1", "cuda:+1", "cuda: 1", "cuda:1x",
                         "cuda:0x1", "cuda0", "cudas", "cuda:1:2", "auto ", "cuda:1024",
                         "cuda:99999999999999999999"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct device_spec d = {DEVICE_CUDA, 5};
        char err[256] = "";
        int rc = device_parse("--device", bad[i], &d, err, sizeof err);
        if (rc != STATUS_BAD_INPUT) TEST_FAIL("\"%s\" was accepted (rc %d)", bad[i], rc);
        ASSERT_EQ((int)DEVICE_AUTO, (int)d.kind);
        if (!strstr(err, "--device") || !strstr(err, bad[i]))
            TEST_FAIL("message for \"%s\" names neither flag nor value: %s", bad[i], err);
    }
    /* The message says which forms are accepted, and without a flag name
     * it still reads as a sentence. */
    struct device_spec d;
    char err[256] = "";
    ASSERT_EQ(STATUS_BAD_INPUT, device_parse(NULL, "tpu", &d, err, sizeof err));
    ASSERT_TRUE(strstr(err, "device \"tpu\"") != NULL);
    ASSERT_TRUE(strstr(err, "cuda:N") != NULL);
    ASSERT_EQ(STATUS_BAD_INPUT, device_parse("--device", "cuda:5000", &d, err, sizeof err));
    ASSERT_TRUE(strstr(err, "1023") != NULL);
}

TEST_MAIN(device_parse_accepts_every_form, device_format_round_trips,
          device_parse_refuses_other_text_naming_flag_and_value)
