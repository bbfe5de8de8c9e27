/* Tests of prompt-lookup drafting (router/ngram.c). */
#include "router/ngram.h"

#include "tests/test.h"

TEST(ngram_longest_latest_match) {
    int32_t out[8];
    /* suffix 7 8 9 occurs at 1 (followed by 5 6) and 7 8 9 ... the latest
     * earlier occurrence of the longest suffix wins. */
    const int32_t t[] = {0, 7, 8, 9, 5, 6, 1, 7, 8, 9, 2, 3, 4, 8, 9};
    /* the 3-gram "4 8 9" never occurred; the 2-gram "8 9" last occurred at
     * 8 (followed by 2 3 4 8 9) */
    ASSERT_EQ(3, ngram_propose(t, 15, 3, 1, 3, out));
    ASSERT_EQ(2, out[0]);
    ASSERT_EQ(3, out[1]);
    ASSERT_EQ(4, out[2]);
    const int32_t u[] = {0, 7, 8, 9, 5, 6, 1, 7, 8, 9, 2, 0, 7, 8, 9};
    /* the 3-gram 7 8 9 last occurred at 7: 2 0 7 8 9 follows */
    ASSERT_EQ(5, ngram_propose(u, 15, 3, 1, 8, out));
    ASSERT_EQ(2, out[0]);
    ASSERT_EQ(9, out[4]);
}

TEST(ngram_no_match_and_limits) {
    int32_t out[4];
    const int32_t t[] = {1, 2, 3, 4};
    ASSERT_EQ(0, ngram_propose(t, 4, 3, 1, 4, out));
    ASSERT_EQ(0, ngram_propose(t, 1, 3, 1, 4, out));
    ASSERT_EQ(0, ngram_propose(t, 4, 3, 1, 0, out));
    const int32_t r[] = {5, 5};
    /* 5 at 0 is followed by the 5 of the suffix itself */
    ASSERT_EQ(1, ngram_propose(r, 2, 3, 1, 4, out));
    ASSERT_EQ(5, out[0]);
    const int32_t m[] = {1, 2, 9, 2};
    /* min 2: the 1-gram "2" would match, the 2-gram "9 2" does not */
    ASSERT_EQ(0, ngram_propose(m, 4, 3, 2, 4, out));
    ASSERT_EQ(2, ngram_propose(m, 4, 3, 1, 4, out));
    ASSERT_EQ(9, out[0]);
    ASSERT_EQ(2, out[1]);
}

TEST_MAIN(ngram_longest_latest_match, ngram_no_match_and_limits)
