/* pd_nccl_plan.c - roles, the sender's schedule and frames of examples/pd_nccl.cu
 * (pd_nccl_plan.h). */
#include "pd_nccl_plan.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PD_FRAME_MAGIC 0x464e4450u /* "PDNF" little-endian */

kvmix_result pd_layout_check(const pd_layout *l, char *err, size_t err_bytes) {
    if (l && l->n_prefill >= 1 && l->n_ranks - l->n_prefill >= 1) return KVMIX_SUCCESS;
    if (err && err_bytes > 0)
        snprintf(err, err_bytes,
                 "%d ranks with %d prefilling: at least one prefill and one "
                 "decode rank are needed",
                 l ? l->n_ranks : 0, l ? l->n_prefill : 0);
    return KVMIX_ERR_INVALID_ARGUMENT;
}

pd_role pd_rank_role(const pd_layout *l, int32_t rank) {
    return rank < l->n_prefill ? PD_PREFILL : PD_DECODE;
}

int32_t pd_text_prefill_rank(const pd_layout *l, int32_t text) { return text % l->n_prefill; }

int32_t pd_text_decode_rank(const pd_layout *l, int32_t text) {
    return l->n_prefill + text % (l->n_ranks - l->n_prefill);
}

int32_t pd_rank_texts(const pd_layout *l, int32_t rank, int32_t n_texts, int32_t *out) {
    int32_t n = 0;
    for (int32_t t = 0; t < n_texts; t++) {
        int32_t owner = pd_rank_role(l, rank) == PD_PREFILL ? pd_text_prefill_rank(l, t)
                                                            : pd_text_decode_rank(l, t);
        if (owner == rank) out[n++] = t;
    }
    return n;
}

static void put_op(pd_op *out, int32_t cap, int32_t *n, int32_t kind, int32_t layer, int32_t slot) {
    if (*n < cap) out[*n] = (pd_op){kind, layer, slot};
    (*n)++;
}

int32_t pd_schedule(int32_t n_layers, int32_t n_slots, bool overlap, pd_op *out, int32_t cap) {
    int32_t n = 0;
    if (n_layers < 0 || n_slots < 1 || cap < 0 || (cap > 0 && !out)) return -1;
    for (int32_t k = 0; k < n_layers; k++) {
        int32_t slot = k % n_slots;
        if (!overlap) {
            put_op(out, cap, &n, PD_OP_PACK, k, slot);
            put_op(out, cap, &n, PD_OP_HOST_WAIT_PACK, k, slot);
            put_op(out, cap, &n, PD_OP_SEND, k, slot);
            put_op(out, cap, &n, PD_OP_HOST_WAIT_SEND, k, slot);
            continue;
        }
        /* a slot is packed again only once the payload it held has gone */
        if (k >= n_slots) put_op(out, cap, &n, PD_OP_WAIT_SENT, k - n_slots, slot);
        put_op(out, cap, &n, PD_OP_PACK, k, slot);
        put_op(out, cap, &n, PD_OP_PACKED, k, slot);
        put_op(out, cap, &n, PD_OP_WAIT_PACKED, k, slot);
        put_op(out, cap, &n, PD_OP_SEND, k, slot);
        put_op(out, cap, &n, PD_OP_SENT, k, slot);
    }
    return n;
}

static void store32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t load32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}

static uint32_t fnv1a(const uint8_t *p, size_t n) {
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h;
}

/* Layout: 0 magic, 4 version, 8 kind, 12 text, 16 layer, 20 n_layers, 24 n_tokens,
   28 first_token, 32 payload_bytes (u64), 40..59 reserved (0), 60 FNV-1a of bytes 0..59. */
void pd_frame_encode(const pd_frame *f, uint8_t out[PD_FRAME_BYTES]) {
    memset(out, 0, PD_FRAME_BYTES);
    store32(out, PD_FRAME_MAGIC);
    store32(out + 4, PD_FRAME_VERSION);
    store32(out + 8, (uint32_t)f->kind);
    store32(out + 12, (uint32_t)f->text);
    store32(out + 16, (uint32_t)f->layer);
    store32(out + 20, (uint32_t)f->n_layers);
    store32(out + 24, (uint32_t)f->n_tokens);
    store32(out + 28, (uint32_t)f->first_token);
    store32(out + 32, (uint32_t)f->payload_bytes);
    store32(out + 36, (uint32_t)(f->payload_bytes >> 32));
    store32(out + 60, fnv1a(out, 60));
}

kvmix_result pd_frame_decode(const uint8_t *b, size_t n_bytes, uint64_t max_payload_bytes,
                             pd_frame *out) {
    pd_frame f;
    if (!b || !out) return KVMIX_ERR_NULL_POINTER;
    if (n_bytes != PD_FRAME_BYTES || load32(b) != PD_FRAME_MAGIC) return KVMIX_ERR_MALFORMED;
    if (load32(b + 4) != PD_FRAME_VERSION) return KVMIX_ERR_VERSION;
    if (load32(b + 60) != fnv1a(b, 60)) return KVMIX_ERR_CORRUPT_DATA;
    for (int i = 40; i < 60; i++)
        if (b[i] != 0) return KVMIX_ERR_MALFORMED;
    f.kind = (int32_t)load32(b + 8);
    f.text = (int32_t)load32(b + 12);
    f.layer = (int32_t)load32(b + 16);
    f.n_layers = (int32_t)load32(b + 20);
    f.n_tokens = (int32_t)load32(b + 24);
    f.first_token = (int32_t)load32(b + 28);
    f.payload_bytes = (uint64_t)load32(b + 32) | (uint64_t)load32(b + 36) << 32;
    if (f.kind < PD_FRAME_SEQUENCE || f.kind > PD_FRAME_RESIDUAL) return KVMIX_ERR_MALFORMED;
    if (f.text < 0 || f.layer < 0 || f.n_layers < 0 || f.n_tokens < 0 || f.first_token < 0 ||
        f.payload_bytes > max_payload_bytes)
        return KVMIX_ERR_INVALID_ARGUMENT;
    *out = f;
    return KVMIX_SUCCESS;
}

int32_t pd_tokens_same(const int32_t *a, const int32_t *b, int32_t n, int32_t *out_first) {
    int32_t same = 0;
    *out_first = -1;
    for (int32_t i = 0; i < n; i++) {
        same += a[i] == b[i];
        if (*out_first < 0 && a[i] != b[i]) *out_first = i;
    }
    return same;
}

kvmix_result pd_tokens_parse(const char *line, int32_t *out_text, int32_t *tokens, int32_t cap,
                             int32_t *out_n) {
    char *end = NULL;
    if (!line || !out_text || !out_n || (cap > 0 && !tokens)) return KVMIX_ERR_NULL_POINTER;
    long text = strtol(line, &end, 10);
    if (end == line || *end != ':' || text < 0 || text > INT32_MAX)
        return KVMIX_ERR_INVALID_ARGUMENT;
    int32_t n = 0;
    for (const char *p = end + 1;;) {
        while (*p == ' ') p++;
        if (*p == '\0' || *p == '\n') break;
        long t = strtol(p, &end, 10);
        if (end == p || t < 0 || t > INT32_MAX || n >= cap) return KVMIX_ERR_INVALID_ARGUMENT;
        tokens[n++] = (int32_t)t;
        p = end;
    }
    *out_text = (int32_t)text, *out_n = n;
    return KVMIX_SUCCESS;
}
