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


TEST(ngram_pred_follows_prediction) {
    int32_t d[8];
    int32_t off = 0;
    const int32_t prompt[] = {1, 2, 3};
    const int32_t pred[] = {10, 11, 12, 13, 14, 15};
    /* the output so far is the prediction's first token: the prompt's end
     * and it are found right before pred[1] */
    const int32_t o1[] = {10};
    bool from_pred = false;
    ASSERT_EQ(4, ngram_propose_pred(prompt, 3, pred, 6, o1, 1, 3, 1, 4, &off, d, &from_pred));
    ASSERT_TRUE(from_pred);
    ASSERT_EQ(11, d[0]);
    ASSERT_EQ(14, d[3]);
    ASSERT_EQ(0, off);
    /* near the end: only what is left of the prediction */
    const int32_t o2[] = {10, 11, 12, 13, 14};
    ASSERT_EQ(1, ngram_propose_pred(prompt, 3, pred, 6, o2, 5, 3, 1, 4, &off, d, NULL));
    ASSERT_EQ(15, d[0]);
}

TEST(ngram_pred_nearest_occurrence_and_offset) {
    int32_t d[8];
    int32_t off = 0;
    const int32_t prompt[] = {1};
    /* "7 8 9" twice in the prediction: the occurrence aligned with the
     * output (next index 7 after 7 tokens) wins over the first (3) */
    const int32_t pred[] = {7, 8, 9, 20, 7, 8, 9, 30, 31};
    const int32_t o[] = {7, 8, 9, 20, 7, 8, 9};
    ASSERT_EQ(2, ngram_propose_pred(prompt, 1, pred, 9, o, 7, 3, 1, 4, &off, d, NULL));
    ASSERT_EQ(30, d[0]);
    ASSERT_EQ(31, d[1]);
    ASSERT_EQ(0, off);
    /* an output with two tokens inserted: the match moves the offset */
    const int32_t ins[] = {7, 99, 98, 8, 9, 20};
    ASSERT_EQ(4, ngram_propose_pred(prompt, 1, pred, 9, ins, 6, 3, 1, 4, &off, d, NULL));
    ASSERT_EQ(7, d[0]);
    ASSERT_EQ(30, d[3]);
    ASSERT_EQ(-2, off);
}

TEST(ngram_pred_falls_back_to_sequence) {
    int32_t d[8];
    int32_t off = 0;
    const int32_t prompt[] = {4, 5, 6, 9};
    const int32_t pred[] = {40, 41};
    /* no match in the prediction: "4 5" of the prompt is followed by 6 9 */
    const int32_t o[] = {4, 5};
    bool from_pred = true;
    ASSERT_EQ(3, ngram_propose_pred(prompt, 4, pred, 2, o, 2, 3, 1, 3, &off, d, &from_pred));
    ASSERT_TRUE(!from_pred); /* the sequence's own tokens: not the prediction's usage */
    ASSERT_EQ(6, d[0]);
    ASSERT_EQ(9, d[1]);
    ASSERT_EQ(4, d[2]);
    /* no prediction at all works like ngram_propose */
    ASSERT_EQ(3, ngram_propose_pred(prompt, 4, NULL, 0, o, 2, 3, 1, 3, &off, d, NULL));
    ASSERT_EQ(0, ngram_propose_pred(prompt, 4, pred, 2, o, 0, 3, 1, 3, &off, d, NULL));
}

TEST_MAIN(ngram_longest_latest_match, ngram_no_match_and_limits, ngram_pred_follows_prediction,
          ngram_pred_nearest_occurrence_and_offset, ngram_pred_falls_back_to_sequence)
