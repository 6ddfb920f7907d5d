/* unit_pd_nccl: the host-side rules of examples/pd_nccl.cu (examples/pd_nccl_plan.c): every text
   has one prefill and one decode rank of the right roles and each rank lists its texts in order;
   the sender's schedule packs and sends every layer once, a send waits for its own pack, a slot
   is packed again only after its send, and with overlap the pack of layer k + 1 is issued before
   the host ever waits; frames round-trip and any changed byte, short frame or out-of-range field
   is refused; reference token lines parse and bad ones are refused. */
#include "harness.h"
#include "pd_nccl_plan.h"

#include <stdlib.h>
#include <string.h>

static void test_roles(void) {
    char err[128];
    CHECK_RESULT(pd_layout_check(&(pd_layout){2, 1}, err, sizeof err), KVMIX_SUCCESS);
    CHECK_RESULT(pd_layout_check(&(pd_layout){2, 2}, err, sizeof err), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(pd_layout_check(&(pd_layout){3, 0}, err, sizeof err), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(pd_layout_check(NULL, err, sizeof err), KVMIX_ERR_INVALID_ARGUMENT);
    test_rng rng;
    test_rng_init(&rng, "pd_roles");
    for (int trial = 0; trial < 50; trial++) {
        int32_t n_ranks = test_rng_range(&rng, 2, 8);
        pd_layout l = {n_ranks, test_rng_range(&rng, 1, n_ranks - 1)};
        int32_t n_texts = test_rng_range(&rng, 0, 39), seen_prefill[40] = {0},
                seen_decode[40] = {0}, texts[40];
        CHECK_RESULT(pd_layout_check(&l, err, sizeof err), KVMIX_SUCCESS);
        for (int32_t t = 0; t < n_texts; t++) {
            CHECK(pd_rank_role(&l, pd_text_prefill_rank(&l, t)) == PD_PREFILL);
            CHECK(pd_rank_role(&l, pd_text_decode_rank(&l, t)) == PD_DECODE);
        }
        for (int32_t r = 0; r < n_ranks; r++) {
            int32_t n = pd_rank_texts(&l, r, n_texts, texts);
            for (int32_t i = 0; i < n; i++) {
                CHECK(i == 0 || texts[i] > texts[i - 1]);
                (pd_rank_role(&l, r) == PD_PREFILL ? seen_prefill : seen_decode)[texts[i]]++;
            }
        }
        for (int32_t t = 0; t < n_texts; t++) CHECK(seen_prefill[t] == 1 && seen_decode[t] == 1);
    }
}

/* The checks on a schedule: each layer packed and sent once, in order; a send after the pack it
   sends (and, with overlap, after its WAIT_PACKED on the send stream); a slot's pack after the
   send of the slot's previous layer (with overlap: after a WAIT_SENT of that layer). */
static void check_schedule(int32_t n_layers, int32_t n_slots, bool overlap) {
    int32_t n = pd_schedule(n_layers, n_slots, overlap, NULL, 0);
    CHECK(n > 0);
    pd_op *ops = malloc((size_t)n * sizeof *ops);
    int32_t *packed_at = malloc((size_t)n_layers * sizeof(int32_t));
    int32_t *sent_at = malloc((size_t)n_layers * sizeof(int32_t));
    int32_t *waited_at = malloc((size_t)n_layers * sizeof(int32_t));
    if (!ops || !packed_at || !sent_at || !waited_at) {
        CHECK_MSG(0, "out of memory");
        free(ops), free(packed_at), free(sent_at), free(waited_at);
        return;
    }
    CHECK(pd_schedule(n_layers, n_slots, overlap, ops, n) == n);
    for (int32_t k = 0; k < n_layers; k++) packed_at[k] = sent_at[k] = waited_at[k] = -1;
    int32_t first_host_wait = -1, next_pack = 0, next_send = 0;
    for (int32_t i = 0; i < n; i++) {
        pd_op o = ops[i];
        CHECK(o.layer >= 0 && o.layer < n_layers && o.slot == o.layer % n_slots);
        if (o.kind == PD_OP_PACK) {
            CHECK_EQ_INT(o.layer, next_pack++);
            int32_t before = o.layer - n_slots;
            if (before >= 0) CHECK(sent_at[before] >= 0);
            if (before >= 0 && overlap) CHECK(waited_at[before] >= 0);
            packed_at[o.layer] = i;
        } else if (o.kind == PD_OP_SEND) {
            CHECK_EQ_INT(o.layer, next_send++);
            CHECK(packed_at[o.layer] >= 0);
            sent_at[o.layer] = i;
        } else if (o.kind == PD_OP_WAIT_SENT) {
            CHECK(sent_at[o.layer] >= 0 && o.slot == (o.layer + n_slots) % n_slots);
            waited_at[o.layer] = i;
        } else if (o.kind == PD_OP_HOST_WAIT_PACK || o.kind == PD_OP_HOST_WAIT_SEND) {
            CHECK(!overlap);
            if (first_host_wait < 0) first_host_wait = i;
        } else if (o.kind == PD_OP_WAIT_PACKED)
            CHECK(packed_at[o.layer] >= 0 && i > packed_at[o.layer]);
    }
    CHECK(next_pack == n_layers && next_send == n_layers);
    /* with overlap nothing makes layer 1's pack wait for layer 0's send: they run together */
    if (overlap && n_layers > 1 && n_slots > 1)
        CHECK(first_host_wait < 0 && (waited_at[0] < 0 || waited_at[0] > packed_at[1]));
    free(ops), free(packed_at), free(sent_at), free(waited_at);
}

static void test_schedule(void) {
    for (int32_t layers = 1; layers <= 9; layers += 4)
        for (int32_t slots = 1; slots <= 3; slots++) {
            check_schedule(layers, slots, true);
            check_schedule(layers, slots, false);
        }
    CHECK(pd_schedule(0, 2, true, NULL, 0) == 0);
    CHECK(pd_schedule(4, 0, true, NULL, 0) == -1);
    CHECK(pd_schedule(-1, 2, false, NULL, 0) == -1);
    pd_op few[3];
    CHECK(pd_schedule(4, 2, true, few, 3) > 3); /* counts past cap, writes cap */
}

static void test_frames(void) {
    pd_frame f = {PD_FRAME_LAYER, 7, 3, 12, 300, 42, (uint64_t)5 << 32 | 123u}, g;
    uint8_t b[PD_FRAME_BYTES];
    pd_frame_encode(&f, b);
    CHECK_RESULT(pd_frame_decode(b, sizeof b, UINT64_MAX, &g), KVMIX_SUCCESS);
    CHECK(memcmp(&f, &g, sizeof f) == 0);
    test_rng rng;
    test_rng_init(&rng, "pd_frames");
    for (int trial = 0; trial < 200; trial++) {
        uint8_t bad[PD_FRAME_BYTES];
        memcpy(bad, b, sizeof b);
        size_t at = (size_t)test_rng_range(&rng, 0, PD_FRAME_BYTES - 1);
        bad[at] ^= (uint8_t)test_rng_range(&rng, 1, 255);
        pd_frame out = {0};
        CHECK_MSG(pd_frame_decode(bad, sizeof bad, UINT64_MAX, &out) != KVMIX_SUCCESS,
                  "byte %zu changed, frame accepted", at);
        CHECK(out.kind == 0); /* nothing written */
    }
    CHECK_RESULT(pd_frame_decode(b, sizeof b - 1, UINT64_MAX, &g), KVMIX_ERR_MALFORMED);
    CHECK_RESULT(pd_frame_decode(b, sizeof b, f.payload_bytes - 1, &g), KVMIX_ERR_INVALID_ARGUMENT);
    f.kind = 9;
    pd_frame_encode(&f, b);
    CHECK_RESULT(pd_frame_decode(b, sizeof b, UINT64_MAX, &g), KVMIX_ERR_MALFORMED);
    f.kind = PD_FRAME_ASK, f.n_tokens = -1;
    pd_frame_encode(&f, b);
    CHECK_RESULT(pd_frame_decode(b, sizeof b, UINT64_MAX, &g), KVMIX_ERR_INVALID_ARGUMENT);
    CHECK_RESULT(pd_frame_decode(NULL, sizeof b, UINT64_MAX, &g), KVMIX_ERR_NULL_POINTER);
}

static void test_tokens(void) {
    int32_t text = -1, tokens[4], n = -1, first = 0;
    CHECK_RESULT(pd_tokens_parse("12: 5 6 7\n", &text, tokens, 4, &n), KVMIX_SUCCESS);
    CHECK(text == 12 && n == 3 && tokens[0] == 5 && tokens[2] == 7);
    CHECK_RESULT(pd_tokens_parse("3:", &text, tokens, 4, &n), KVMIX_SUCCESS);
    CHECK(text == 3 && n == 0);
    const char *bad[] = {"x: 1", "1 2 3", "-1: 2", "1: 2 x", "1: 1 2 3 4 5", "1: -4", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_MSG(pd_tokens_parse(bad[i], &text, tokens, 4, &n) == KVMIX_ERR_INVALID_ARGUMENT,
                  "\"%s\" accepted", bad[i]);
    int32_t a[5] = {1, 2, 3, 4, 5}, b[5] = {1, 2, 9, 4, 0};
    CHECK(pd_tokens_same(a, b, 5, &first) == 3 && first == 2);
    CHECK(pd_tokens_same(a, a, 5, &first) == 5 && first == -1);
}

void unit_pd_nccl(void) {
    test_roles();
    test_schedule();
    test_frames();
    test_tokens();
}
