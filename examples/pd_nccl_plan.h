/* pd_nccl_plan.h - the host-side rules of examples/pd_nccl.cu (prefill on some GPUs, decode on
 * others, tiered payloads over NCCL), kept apart from CUDA and NCCL so that they are tested on
 * the CPU (tests/unit_pd_nccl.c):
 *   - roles: ranks [0, n_prefill) prefill, the rest decode; text t goes from prefill rank
 *     t % n_prefill to decode rank n_prefill + t % n_decode, and every rank handles its texts in
 *     increasing order, so each pair of ranks issues its NCCL calls in the same order;
 *   - the per-layer schedule of a sender: layer k's payload packed on one stream and sent on
 *     another, the send of layer k overlapping the packing of layer k + 1, payload slots reused
 *     only after their send;
 *   - frames: the 64 bytes that precede each payload on the wire and say what follows.
 * Pure functions; thread-safe.
 */
#ifndef KVMIX_PD_NCCL_PLAN_H
#define KVMIX_PD_NCCL_PLAN_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kvmix.h"

/* ---- roles ----------------------------------------------------------------------------------- */

typedef struct pd_layout {
    int32_t n_ranks, n_prefill; /* n_decode = n_ranks - n_prefill */
} pd_layout;

typedef enum pd_role { PD_PREFILL = 1, PD_DECODE = 2 } pd_role;

/* KVMIX_SUCCESS when there is at least one prefill and one decode rank, else INVALID_ARGUMENT
   with err saying why. */
kvmix_result pd_layout_check(const pd_layout *layout, char *err, size_t err_bytes);
pd_role pd_rank_role(const pd_layout *layout, int32_t rank);
int32_t pd_text_prefill_rank(const pd_layout *layout, int32_t text);
int32_t pd_text_decode_rank(const pd_layout *layout, int32_t text);
/* The texts of [0, n_texts) that `rank` prefills or decodes, in increasing order, into out
   (room for n_texts); returns how many. */
int32_t pd_rank_texts(const pd_layout *layout, int32_t rank, int32_t n_texts, int32_t *out);

/* ---- the sender's per-layer schedule ------------------------------------------------------- */

typedef enum pd_op_kind {
    PD_OP_WAIT_SENT = 1,  /* the pack stream waits until the slot's previous payload was sent */
    PD_OP_PACK,           /* head copied and body packed into the slot (pack stream) */
    PD_OP_PACKED,         /* event recorded on the pack stream */
    PD_OP_WAIT_PACKED,    /* the send stream waits for it */
    PD_OP_SEND,           /* frame and payload sent (send stream) */
    PD_OP_SENT,           /* event recorded on the send stream */
    PD_OP_HOST_WAIT_PACK, /* without overlap: the host waits for the pack stream */
    PD_OP_HOST_WAIT_SEND  /* without overlap: the host waits for the send stream */
} pd_op_kind;

typedef struct pd_op {
    int32_t kind, layer, slot; /* slot: which payload buffer (and event) the layer uses */
} pd_op;

/* The ops that send n_layers payloads through n_slots buffers (>= 1), with overlap (two streams
   and events) or without (each pack, then its send, the host waiting for each). Writes at most
   cap ops; returns how many there are (cap may be 0 to count), or -1 for bad counts. */
int32_t pd_schedule(int32_t n_layers, int32_t n_slots, bool overlap, pd_op *out, int32_t cap);

/* ---- frames ---------------------------------------------------------------------------------- */

enum { PD_FRAME_BYTES = 64, PD_FRAME_VERSION = 1 };

typedef enum pd_frame_kind {
    PD_FRAME_SEQUENCE = 1, /* prefill -> decode: a text's n_tokens positions and n_layers follow */
    PD_FRAME_LAYER,        /* a ROWS payload of `layer`, payload_bytes long, follows */
    PD_FRAME_ASK,     /* decode -> prefill: n_tokens positions (int32) whose residuals it wants */
    PD_FRAME_RESIDUAL /* a RESIDUAL payload of `layer`, payload_bytes long, follows */
} pd_frame_kind;

typedef struct pd_frame {
    int32_t kind;           /* pd_frame_kind */
    int32_t text;           /* the text's index in the run */
    int32_t layer;          /* LAYER, RESIDUAL */
    int32_t n_layers;       /* SEQUENCE */
    int32_t n_tokens;       /* SEQUENCE: positions; ASK: positions asked */
    int32_t first_token;    /* SEQUENCE: the prefill's greedy next token */
    uint64_t payload_bytes; /* LAYER, RESIDUAL: bytes of the payload that follows */
} pd_frame;

/* The frame's bytes: magic "PDNF", version, the fields little-endian, an FNV-1a check word. */
void pd_frame_encode(const pd_frame *frame, uint8_t out[PD_FRAME_BYTES]);
/* Reads a frame; MALFORMED (size, magic, reserved bytes, a kind out of range), VERSION,
   CORRUPT_DATA (check word), INVALID_ARGUMENT (a negative field, payload_bytes above
   max_payload_bytes). *out is written only on success. */
kvmix_result pd_frame_decode(const uint8_t *bytes, size_t n_bytes, uint64_t max_payload_bytes,
                             pd_frame *out);

/* ---- checks ---------------------------------------------------------------------------------- */

/* Tokens equal at the same index over n, *out_first_difference the first that differs (-1). */
int32_t pd_tokens_same(const int32_t *a, const int32_t *b, int32_t n,
                       int32_t *out_first_difference);

/* A line "TEXT: t0 t1 ..." of the reference tokens file: the text's index and up to cap tokens
   into tokens, *out_n of them. INVALID_ARGUMENT for anything else. */
kvmix_result pd_tokens_parse(const char *line, int32_t *out_text, int32_t *tokens, int32_t cap,
                             int32_t *out_n);

#endif /* KVMIX_PD_NCCL_PLAN_H */
