/* Fuzz target: the streaming tagger on random template specs and random token streams.
 *
 * Build with libFuzzer:  clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -I. \
 *                            tests/fuzz_tags.c -o build/fuzz_tags -lm
 * or with the plain driver (any C compiler): add tests/fuzz_driver.c.
 *
 * Input: bytes 0-3 seed a generator that builds the spec: every marker gets 0-4 alternative
 * sequences of 1-3 ids (sometimes up to KVMIX_TAG_MAX_IDS + 1), roles and channels 0-17 names of
 * 1-4 ids with random roles (sometimes invalid), half the specs role starts (then message_start
 * and header_end are each dropped half the time), ids from a small alphabet (0-39) so that
 * markers overlap and repeat; a few specs are made invalid on purpose. The rest of the input is the
 * stream: each byte an id of the same alphabet, or (byte >= 0xF0) an id far outside it.
 *
 * Invariants (abort on violation): a refused spec leaves the tagger untouched; every tag has a
 * role < KVMIX_TAG_N_ROLES, a modality TEXT or IMAGE, only KVMIX_TAG_FLAG_FALLBACK, reserved 0,
 * 0 <= turn <= the tagger's turn, turns nondecreasing; feeding whole, one id at a time and in random runs gives the same tags and the same
 * final state; the hot path gives the tags of the step function alone (a copy of the tagger with
 * every filter bit set and no fast image pads); nothing is written past the tags (exact-size heap buffers, AddressSanitizer). */
#define KVMIX_IMPLEMENTATION
#include "kvmix.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_TARGET_NAME "fuzz_tags"
#include "fuzz_invariants.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define ALPHABET 40

static void random_seq(kvmix_tag_seq *q, int32_t min_len) {
    int32_t n = min_len + (int32_t)(next_random() % 3), i;
    if (next_random() % 64 == 0) n = (int32_t)(next_random() % (KVMIX_TAG_MAX_IDS + 2));
    memset(q, 0, sizeof *q);
    q->n_ids = n;
    for (i = 0; i < n && i < KVMIX_TAG_MAX_IDS; i++)
        q->ids[i] = (int32_t)(next_random() % ALPHABET);
    if (next_random() % 128 == 0 && n > 0) q->ids[0] = -1 - (int32_t)(next_random() % 5);
}

/* Role starts (DeepSeek V3's User and Assistant tokens): 1-4 names, at times up to 8, 0 or one
   past the maximum. They make message_start optional (dropped half the time, and then the
   header end too, half the time), so streams start messages by role starts alone or by both; a
   message start without a header end, dropped as often, is a spec the check refuses. */
static void random_role_starts(kvmix_tag_spec *s) {
    int32_t i;
    s->n_role_starts =
        1 + (int32_t)(next_random() % (next_random() % 4 ? 4 : KVMIX_TAG_MAX_STARTS));
    if (next_random() % 32 == 0)
        s->n_role_starts = (next_random() % 2) * (KVMIX_TAG_MAX_STARTS + 1);
    for (i = 0; i < KVMIX_TAG_MAX_STARTS; i++) {
        random_seq(&s->role_starts[i].seq, 1);
        if (next_random() % 2) s->role_starts[i].seq.n_ids = 1;
        s->role_starts[i].role = (int32_t)(next_random() % (next_random() % 32 ? 6 : 9));
    }
    if (next_random() % 2) memset(&s->message_start, 0, sizeof s->message_start);
    if (next_random() % 2) memset(&s->header_end, 0, sizeof s->header_end);
}

static void random_spec(kvmix_tag_spec *s) {
    kvmix_tag_marker *markers[14];
    int m, a, i;
    memset(s, 0, sizeof *s);
    markers[0] = &s->message_start, markers[1] = &s->message_end, markers[2] = &s->header_end;
    markers[3] = &s->channel, markers[4] = &s->reasoning_open, markers[5] = &s->reasoning_close;
    markers[6] = &s->tool_call_open, markers[7] = &s->tool_call_close;
    markers[8] = &s->tool_response_open, markers[9] = &s->tool_response_close;
    markers[10] = &s->vision_open, markers[11] = &s->vision_close, markers[12] = &s->image_pad;
    markers[13] = &s->recipient;
    for (m = 0; m < 14; m++) {
        int n_alts = (int)(next_random() % 3) + (m < 3);
        for (a = 0; a < n_alts && a < KVMIX_TAG_MAX_ALTS; a++) {
            random_seq(&markers[m]->alts[a], 1);
            if (m == 12 && next_random() % 16)
                markers[m]->alts[a].n_ids = 1;
            else if (next_random() % 2)
                markers[m]->alts[a].n_ids = 1;
        }
    }
    s->n_roles = (int32_t)(next_random() % (KVMIX_TAG_MAX_NAMES + 2));
    s->n_channels = (int32_t)(next_random() % 5);
    if (next_random() % 32 == 0) s->n_channels = KVMIX_TAG_MAX_NAMES + 1;
    for (i = 0; i < KVMIX_TAG_MAX_NAMES; i++) {
        random_seq(&s->roles[i].seq, 1);
        random_seq(&s->channels[i].seq, 1);
        s->roles[i].role = (int32_t)(next_random() % (next_random() % 32 ? 6 : 9));
        s->channels[i].role = (int32_t)(next_random() % 6);
        if (next_random() % 2) s->roles[i].seq.n_ids = 1;
    }
    if (next_random() % 2) random_role_starts(s);
}

static void check_tags(const kvmix_tag *tags, int32_t n, const kvmix_tagger *t) {
    int32_t i, last = 0;
    for (i = 0; i < n; i++) {
        require(tags[i].role < KVMIX_TAG_N_ROLES, "role in range");
        require(tags[i].modality <= KVMIX_MODALITY_IMAGE, "modality in range");
        require((tags[i].flags & ~KVMIX_TAG_FLAG_FALLBACK) == 0, "only the fallback flag");
        require(tags[i].reserved == 0, "reserved byte zero");
        require(tags[i].turn >= last && tags[i].turn <= t->turn, "turns nondecreasing");
        last = tags[i].turn;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static kvmix_tagger whole, single, runs, slow, untouched;
    kvmix_tag_spec spec;
    int32_t *ids, n, i;
    kvmix_tag *a, *b, *c, *d;
    if (size < 4) return 0;
    fuzz_rng = (uint32_t)data[0] | (uint32_t)data[1] << 8 | (uint32_t)data[2] << 16 |
               (uint32_t)data[3] << 24;
    random_spec(&spec);
    memset(&whole, 0, sizeof whole);
    memset(&single, 0, sizeof single);
    memset(&runs, 0, sizeof runs);
    if (kvmix_tag_spec_check(&spec, NULL) != KVMIX_SUCCESS) {
        memset(&untouched, POISON, sizeof untouched);
        require(kvmix_tagger_init(&untouched, &spec, NULL) != KVMIX_SUCCESS,
                "refused spec refused");
        require(all_poisoned(&untouched, sizeof untouched), "refused init writes nothing");
        return 0;
    }
    require(kvmix_tagger_init(&whole, &spec, NULL) == KVMIX_SUCCESS, "init");
    single = whole;
    runs = whole;
    n = (int32_t)(size - 4);
    ids = (int32_t *)malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    a = (kvmix_tag *)malloc(sizeof(kvmix_tag) * (size_t)(n ? n : 1));
    b = (kvmix_tag *)malloc(sizeof(kvmix_tag) * (size_t)(n ? n : 1));
    c = (kvmix_tag *)malloc(sizeof(kvmix_tag) * (size_t)(n ? n : 1));
    d = (kvmix_tag *)malloc(sizeof(kvmix_tag) * (size_t)(n ? n : 1));
    if (!ids || !a || !b || !c || !d) abort();
    for (i = 0; i < n; i++) {
        uint8_t v = data[4 + i];
        ids[i] = v < 0xF0 ? (int32_t)(v % ALPHABET)
                          : (int32_t)(v == 0xFF ? -1 - (int32_t)(next_random() % 1000)
                                                : (int32_t)(next_random() & 0x7fffffff));
    }
    /* the reference path: every id through the step function (no filter, no fast image pads) */
    slow = whole;
    memset(slow.filter, 0xff, sizeof slow.filter);
    slow.pad_mode = -1;
    require(kvmix_tagger_feed(&slow, ids, n, d) == KVMIX_SUCCESS, "feed slow");
    require(kvmix_tagger_feed(&whole, ids, n, a) == KVMIX_SUCCESS, "feed whole");
    require(memcmp(a, d, sizeof(kvmix_tag) * (size_t)n) == 0, "hot path == step function");
    require(slow.turn == whole.turn && slow.n_breaks == whole.n_breaks, "same turn and breaks");
    for (i = 0; i < n; i++)
        require(kvmix_tagger_feed(&single, ids + i, 1, b + i) == KVMIX_SUCCESS, "feed one");
    for (i = 0; i < n;) {
        int32_t k = (int32_t)(next_random() % 9);
        if (k > n - i) k = n - i;
        require(kvmix_tagger_feed(&runs, ids + i, k, c + i) == KVMIX_SUCCESS, "feed run");
        i += k;
    }
    check_tags(a, n, &whole);
    require(memcmp(a, b, sizeof(kvmix_tag) * (size_t)n) == 0, "one at a time == whole");
    require(memcmp(a, c, sizeof(kvmix_tag) * (size_t)n) == 0, "runs == whole");
    require(memcmp(&whole, &single, sizeof whole) == 0, "same final state (one at a time)");
    require(memcmp(&whole, &runs, sizeof whole) == 0, "same final state (runs)");
    require(whole.n_fed == n, "n_fed counts the ids");
    free(ids);
    free(a);
    free(b);
    free(c);
    free(d);
    return 0;
}
