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
    /* the 3-gram 7 8 9 last occurred at 7: 2 0 7 8 9 follows, of which a
     * match of 3 drafts 4 */
    ASSERT_EQ(4, ngram_propose(u, 15, 3, 1, 8, out));
    ASSERT_EQ(2, out[0]);
    ASSERT_EQ(8, out[3]);
    /* a match of 1 ("3" at 0) drafts 2 of the 5 tokens after it, whatever k */
    const int32_t v[] = {3, 4, 5, 6, 7, 8, 3};
    ASSERT_EQ(2, ngram_propose(v, 7, 3, 1, 8, out));
    ASSERT_EQ(4, out[0]);
    ASSERT_EQ(5, out[1]);
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

/* The prediction match nearest to where the output stands (n_out +
 * offset), the earlier of two as near, for the longest suffix that has
 * one: the definition, as a scan over every position, against
 * ngram_propose_pred on random texts over a 3-token alphabet (many
 * matches, ties on both sides), random offsets included. */
static int32_t pred_ref(const int32_t *prompt, int32_t n_prompt, const int32_t *pred, int32_t n_pred,
                        const int32_t *out, int32_t n_out, int32_t n_max, int32_t offset) {
    const int32_t n = n_prompt + n_out, want = n_out + offset;
    for (int32_t g = n_max < n ? n_max : n; g >= 1; g--) {
        int32_t best = -1, best_d = 0;
        for (int32_t j = 0; j < n_pred; j++) {
            if (n_prompt + j < g) continue;
            bool ok = true;
            for (int32_t t = 1; t <= g && ok; t++) {
                int32_t i = n_prompt + j - t, s = n - t;
                int32_t have = i < n_prompt ? prompt[i] : pred[i - n_prompt];
                ok = have == (s < n_prompt ? prompt[s] : out[s - n_prompt]);
            }
            int32_t d = j > want ? j - want : want - j;
            if (ok && (best < 0 || d < best_d)) {
                best = j;
                best_d = d;
            }
        }
        if (best >= 0) return best;
    }
    return -1;
}

TEST(ngram_pred_nearest_matches_definition) {
    uint64_t r = 0x9e3779b97f4a7c15ull;
    for (int iter = 0; iter < 20000; iter++) {
        int32_t prompt[8], pred[40], out[20], d[4];
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        const int32_t n_prompt = (int32_t)(r >> 60) % 8, n_pred = (int32_t)(r >> 50) % 41,
                      n_out = 1 + (int32_t)(r >> 40) % 20, offset = (int32_t)((r >> 30) % 21) - 10;
        for (int32_t i = 0; i < 8; i++) prompt[i] = (int32_t)((r >> (2 * i)) % 3);
        for (int32_t i = 0; i < 40; i++) pred[i] = (int32_t)(((r >> 7) + 7 * (uint64_t)i * i + (uint64_t)iter) % 3);
        for (int32_t i = 0; i < 20; i++) out[i] = (int32_t)(((r >> 13) + 5 * (uint64_t)i + (uint64_t)i * i * i) % 3);
        int32_t off = offset;
        bool from_pred = false;
        int32_t m = ngram_propose_pred(prompt, n_prompt, pred, n_pred, out, n_out, 3, 1, 4, &off, d, &from_pred);
        int32_t want = pred_ref(prompt, n_prompt, pred, n_pred, out, n_out, 3, offset);
        if (want < 0) {
            ASSERT_TRUE(!from_pred);
            continue;
        }
        ASSERT_TRUE(from_pred);
        if (off != want - n_out)
            TEST_FAIL("case %d (prompt %d, prediction %d, output %d, offset %d): found at %d, want %d", iter,
                      n_prompt, n_pred, n_out, offset, off + n_out, want);
        ASSERT_EQ(n_pred - want < 4 ? n_pred - want : 4, m);
        ASSERT_EQ(pred[want], d[0]);
    }
}

TEST_MAIN(ngram_longest_latest_match, ngram_no_match_and_limits, ngram_pred_follows_prediction,
          ngram_pred_nearest_occurrence_and_offset, ngram_pred_falls_back_to_sequence,
          ngram_pred_nearest_matches_definition)
