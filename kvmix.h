/* kvmix.h - mixed-precision, prunable KV cache for LLM inference. MIT licensed (see LICENSE).

   Single-file library. In exactly one C or C++ file write

       #define KVMIX_IMPLEMENTATION
       #include "kvmix.h"

   Other files include it without the define. Define KVMIX_STATIC as well to make every function
   static to that file. The header compiles as C99, C11 and C++.

   Options (define before the implementing include):
     KVMIX_MALLOC(bytes) / KVMIX_FREE(ptr)  the default allocator (all or none; malloc/free)
     KVMIX_ASSERT(cond)                     internal invariants only (default: assert)

   Conventions: every function that can fail returns a kvmix_result and writes its outputs only on
   success, so a failed call leaves everything as it was. Sizes in bytes are size_t; counts are
   int32_t. There is no mutable global state: calls on distinct objects may run on any threads.

   Rooms of the implementation (search for the marker):
     // >>core      results, allocator, fp16/bf16
     // >>formats   packed byte formats and their CPU reference (the spec of every GPU kernel)
     // >>ref       reference decode attention and the partial-result merge
     // >>view      cache views: many sequences' spans in one region, for CPU or GPU attention
*/
#ifndef KVMIX_H
#define KVMIX_H

#include <stddef.h>
#include <stdint.h>

#define KVMIX_VERSION_MAJOR 0
#define KVMIX_VERSION_MINOR 1
#define KVMIX_VERSION_PATCH 0
#define KVMIX_VERSION_STRING "0.1.0"

#ifndef KVMIXDEF
#ifdef KVMIX_STATIC
#if defined(__GNUC__) || defined(__clang__)
#define KVMIXDEF static __attribute__((unused))
#else
#define KVMIXDEF static
#endif
#else
#ifdef __cplusplus
#define KVMIXDEF extern "C"
#else
#define KVMIXDEF extern
#endif
#endif
#endif

/* ------------------------------------------------------------------------------------------- */
/* Results                                                                                      */

typedef enum kvmix_result {
    KVMIX_SUCCESS = 0,
    KVMIX_ERR_NULL_POINTER = -1,     /* a required pointer argument is NULL */
    KVMIX_ERR_INVALID_ARGUMENT = -2, /* a count, index or option is out of range */
    KVMIX_ERR_BAD_SHAPE = -3,        /* head_dim, group size or boost count not supported */
    KVMIX_ERR_UNKNOWN_FORMAT = -4,   /* a kvmix_format value that does not exist */
    KVMIX_ERR_BUFFER_TOO_SMALL = -5, /* a caller buffer is smaller than the size query says */
    KVMIX_ERR_BAD_VALUE = -6,        /* an input is NaN, infinite or beyond the FP16 range */
    KVMIX_ERR_OUT_OF_MEMORY = -7,    /* an allocator or arena has no room left */
    KVMIX_ERR_UNSUPPORTED = -8,      /* valid, but not supported by this backend or build */
    KVMIX_ERR_CORRUPT_DATA = -9,     /* packed bytes that no quantize call could have written */
    KVMIX_ERR_VERSION = -10,         /* a serialized document of an unknown version */
    KVMIX_ERR_PARSE = -11,           /* malformed JSON or payload */
    KVMIX_ERR_NOT_FOUND = -12,       /* a named item does not exist */
    KVMIX_ERR_CUDA = -13             /* the CUDA runtime reported an error */
} kvmix_result;

/* A static English description of a result; never NULL, also for unknown values. */
KVMIXDEF const char *kvmix_result_string(kvmix_result result);

/* Library version as "MAJOR.MINOR.PATCH" of the implementation that was compiled. */
KVMIXDEF const char *kvmix_version_string(void);

/* ------------------------------------------------------------------------------------------- */
/* Allocator hooks: every object that needs memory has an init into caller memory and an init    */
/* with an allocator. A NULL allocator, or NULL functions in it, mean KVMIX_MALLOC/KVMIX_FREE.     */

typedef struct kvmix_allocator {
    void *(*alloc_fn)(size_t bytes, void *user); /* must return 64-byte aligned memory or NULL */
    void (*free_fn)(void *ptr, void *user);
    void *user;
} kvmix_allocator;

/* ------------------------------------------------------------------------------------------- */
/* FP16 and BF16 conversion. Float to half/bfloat16 rounds to nearest, ties to even, and matches   */
/* CUDA's __float2half_rn / __float2bfloat16_rn bit for bit; every NaN becomes 0x7FFF.             */

KVMIXDEF uint16_t kvmix_fp32_to_fp16(float value);
KVMIXDEF float kvmix_fp16_to_fp32(uint16_t half);
KVMIXDEF uint16_t kvmix_fp32_to_bf16(float value);
KVMIXDEF float kvmix_bf16_to_fp32(uint16_t bf16);

/* ------------------------------------------------------------------------------------------- */
/* Packed formats. A block is n_tokens rows of head_dim channels for one kv head (keys or         */
/* values). The exact byte layout of each format is documented at its CPU reference in the        */
/* >>formats room; summary (D = head_dim, n = n_tokens, G = group_size, k = n_boost):              */
/*                                                                                               */
/*   format                 bytes                               bits/element (D=128, n=P=128)     */
/*   FP16                   2nD                                 16                                */
/*   INT8   per token       nD + 4n(D/G)                        9    (G=32)                       */
/*   INT4   per token       nD/2 + 4n(D/G)                      5    (G=32)                       */
/*   INT2   per token       nD/4 + 4n(D/G)                      3    (G=32)                       */
/*   INT2   per channel     nD/4 + 4D                           2.25                              */
/*   BOOSTED per channel    nD/4 + nk/4 + 5D                    2.5625 (k=16), 2.8125 (k=32)      */

typedef enum kvmix_format {
    KVMIX_FORMAT_FP16 = 1,
    KVMIX_FORMAT_INT8 = 2,         /* per token, asymmetric, groups of G channels */
    KVMIX_FORMAT_INT4 = 3,         /* per token, asymmetric, groups of G channels */
    KVMIX_FORMAT_INT2 = 4,         /* per token, asymmetric, groups of G channels (values) */
    KVMIX_FORMAT_INT2_CHANNEL = 5, /* per channel over the block's tokens (keys) */
    KVMIX_FORMAT_BOOSTED = 6       /* per channel, top-k channels by mean |x| keep 4 bits (keys) */
} kvmix_format;

#define KVMIX_GROUP_SIZE_DEFAULT 32
#define KVMIX_MAX_HEAD_DIM 512
#define KVMIX_BOOST_NONE 0xFF /* channel-to-slot index entry of a channel that is not boosted */

/* The shape of one block. Zero fields take defaults: group_size 0 means 32 (per-token formats).
   Constraints: head_dim a positive multiple of 32, at most KVMIX_MAX_HEAD_DIM; n_tokens >= 0;
   group_size (per-token integer formats) a multiple of 8 that divides head_dim;
   n_boost (BOOSTED only, else 0) a multiple of 4, at most head_dim and at most 252. */
typedef struct kvmix_layout {
    kvmix_format format;
    int32_t n_tokens;
    int32_t head_dim;
    int32_t group_size;
    int32_t n_boost;
} kvmix_layout;

/* Checks a layout and writes it back with defaults resolved.
   Returns KVMIX_ERR_NULL_POINTER, KVMIX_ERR_UNKNOWN_FORMAT, KVMIX_ERR_INVALID_ARGUMENT
   (negative n_tokens) or KVMIX_ERR_BAD_SHAPE. */
KVMIXDEF kvmix_result kvmix_layout_resolve(kvmix_layout *layout);

/* Size in bytes of one block of this layout (0 for 0 tokens). */
KVMIXDEF kvmix_result kvmix_layout_bytes(const kvmix_layout *layout, size_t *out_bytes);

/* Effective bits per element of the layout, all metadata included: bytes * 8 / (n_tokens *
   head_dim). n_tokens must be positive. Use a full page's n_tokens for budget accounting. */
KVMIXDEF kvmix_result kvmix_layout_bits(const kvmix_layout *layout, double *out_bits);

/* Quantizes src [n_tokens][row_stride floats, head_dim used] into dst (dst_bytes at least
   kvmix_layout_bytes). row_stride 0 means head_dim. Every input must be finite with |x| <= 65504,
   otherwise KVMIX_ERR_BAD_VALUE and nothing is written. Also returns NULL_POINTER (when
   n_tokens > 0), BUFFER_TOO_SMALL, INVALID_ARGUMENT (row_stride < head_dim) and layout errors. */
KVMIXDEF kvmix_result kvmix_ref_quantize(const kvmix_layout *layout, const float *src,
                                         int32_t row_stride, void *dst, size_t dst_bytes);

/* Dequantizes a whole block into dst [n_tokens][row_stride floats]. Packed bytes are validated
   first (FP16 rows, scales and minima finite, scales >= 0, boost index a permutation of its
   slots): on
   KVMIX_ERR_CORRUPT_DATA nothing is written. */
KVMIXDEF kvmix_result kvmix_ref_dequantize(const kvmix_layout *layout, const void *src,
                                           size_t src_bytes, float *dst, int32_t row_stride);

/* Dequantizes one row (token) of a block into dst [head_dim]; same checks as above. */
KVMIXDEF kvmix_result kvmix_ref_dequantize_row(const kvmix_layout *layout, const void *src,
                                               size_t src_bytes, int32_t row, float *dst);

/* ------------------------------------------------------------------------------------------- */
/* Reference decode attention. A sequence is a list of spans: consecutive tokens whose keys and    */
/* values are each one block per kv head, in any format (pages of INT2 keys, FP16 sink rows, the   */
/* local window, a not-yet-full page ...). The result over disjoint span lists can be merged.      */

typedef struct kvmix_span {
    kvmix_layout key_layout;   /* n_tokens and head_dim must equal value_layout's */
    kvmix_layout value_layout;
    const void *keys;          /* kv head h's block starts at keys + h * key_head_bytes */
    const void *values;        /* kv head h's block starts at values + h * value_head_bytes */
    size_t key_head_bytes;     /* 0 = the key block's size (heads packed back to back) */
    size_t value_head_bytes;   /* 0 = the value block's size */
    size_t keys_bytes;         /* readable bytes at keys, checked against the heads' extent */
    size_t values_bytes;
    const uint8_t *dead;       /* [n_tokens], nonzero = the token is evicted and skipped; or NULL */
} kvmix_span;

typedef struct kvmix_attention_desc {
    int32_t n_q_heads;  /* a multiple of n_kv_heads; q head i reads kv head i / (n_q / n_kv) */
    int32_t n_kv_heads;
    int32_t head_dim;
    float scale;        /* softmax scale; 0 = 1 / sqrt(head_dim) */
} kvmix_attention_desc;

/* One decode step: out[h] = softmax(scale * q[h] . K^T) V over every live token of every span,
   lse[h] = log(sum over live tokens of exp(scale * q[h] . k)) (natural log). With no live token,
   out[h] is zero and lse[h] is -INFINITY. q, out: [n_q_heads][head_dim] floats; lse: [n_q_heads].
   Validates everything (including the packed bytes) before writing. Thread-safe. */
KVMIXDEF kvmix_result kvmix_ref_attention_decode(const kvmix_attention_desc *desc, const float *q,
                                                 const kvmix_span *spans, int32_t n_spans,
                                                 float *out, float *lse);

/* Merges two partial results over disjoint token sets into the result over their union.
   out_*: [n_heads][head_dim], lse_*: [n_heads]. out/lse may alias a or b. */
KVMIXDEF kvmix_result kvmix_ref_attention_merge(int32_t n_heads, int32_t head_dim,
                                                const float *out_a, const float *lse_a,
                                                const float *out_b, const float *lse_b,
                                                float *out, float *lse);

/* ------------------------------------------------------------------------------------------- */
/* Cache views: the read-only description of many cached sequences that decode attention reads,   */
/* on the CPU (kvmix_ref_view_decode) or the GPU (kvmix_cuda.h). All blocks live in one memory     */
/* region (the cache's arena) and are addressed by byte offsets, so the same view describes a      */
/* host arena or its device copy. A sequence is an ordered list of spans.                        */

typedef struct kvmix_view_span {
    uint64_t key_offset;       /* bytes from view base to kv head 0's key block */
    uint64_t value_offset;     /* bytes from view base to kv head 0's value block */
    uint32_t key_head_bytes;   /* bytes between consecutive kv heads' key blocks */
    uint32_t value_head_bytes; /* bytes between consecutive kv heads' value blocks */
    int32_t n_tokens;          /* tokens in the span, >= 1 */
    int32_t dead_index;        /* the span's first flag in view dead[], or -1 when none is dead */
    uint8_t key_format;        /* a kvmix_format */
    uint8_t value_format;      /* a kvmix_format */
    uint8_t reserved[6];       /* zero */
} kvmix_view_span;

typedef struct kvmix_view {
    int32_t n_seqs;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t group_size;             /* of every per-token integer block; 0 = 32 */
    int32_t n_boost;                /* of every BOOSTED block */
    int32_t n_spans;
    int32_t n_dead_flags;
    const uint8_t *base;            /* blocks lie in [base, base + base_bytes) */
    size_t base_bytes;
    const kvmix_view_span *spans;   /* [n_spans], sequence after sequence */
    const int32_t *seq_first_span;  /* [n_seqs + 1]: sequence s owns spans [first[s], first[s+1]) */
    const uint8_t *dead;            /* [n_dead_flags], nonzero = evicted token */
} kvmix_view;

/* Checks a host view's structure: counts, formats, sequence boundaries, block extents inside
   base_bytes, dead flag ranges. It reads spans, seq_first_span (not the blocks), so it needs
   host pointers. Returns KVMIX_ERR_NULL_POINTER, INVALID_ARGUMENT, BAD_SHAPE, UNKNOWN_FORMAT or
   BUFFER_TOO_SMALL (a block outside the base region). */
KVMIXDEF kvmix_result kvmix_view_check(const kvmix_view *view);

/* Decode attention for every sequence of a host view: q, out [n_seqs][n_q_heads][head_dim],
   lse [n_seqs][n_q_heads], as kvmix_ref_attention_decode per sequence; scale 0 = 1/sqrt(D).
   Validates the view and every packed block before writing. */
KVMIXDEF kvmix_result kvmix_ref_view_decode(const kvmix_view *view, int32_t n_q_heads,
                                            float scale, const float *q, float *out, float *lse);

/* QueryMemory scores of sequence `seq` of a host view, for eviction: for each token t of the
   sequence (all spans in order, dead ones included), scores[t] = sum over q heads h of
   dot(memory[h], key_t of kv head h / (n_q_heads / n_kv_heads)), summed in float over heads,
   then channels; dead tokens score -INFINITY. memory: [n_q_heads][head_dim]; scores:
   [capacity_tokens]; tokens past capacity_tokens are not scored (as on the GPU, which cannot
   know a sequence's length ahead). Validates the view and the sequence's blocks first. */
KVMIXDEF kvmix_result kvmix_ref_view_score(const kvmix_view *view, int32_t seq,
                                           int32_t n_q_heads, const float *memory,
                                           float *scores, int32_t capacity_tokens);

#endif /* KVMIX_H */

/* =========================================================================================== */
/* Implementation                                                                               */
/* =========================================================================================== */
#ifdef KVMIX_IMPLEMENTATION
#ifndef KVMIX_IMPLEMENTATION_DONE
#define KVMIX_IMPLEMENTATION_DONE

#include <math.h>
#include <string.h>

#if defined(KVMIX_MALLOC) != defined(KVMIX_FREE)
#error "define both KVMIX_MALLOC and KVMIX_FREE, or neither"
#endif
#ifndef KVMIX_MALLOC
#include <stdlib.h>
#define KVMIX_MALLOC(bytes) malloc(bytes)
#define KVMIX_FREE(ptr) free(ptr)
#endif
#ifndef KVMIX_ASSERT
#include <assert.h>
#define KVMIX_ASSERT(cond) assert(cond)
#endif

// >>core

KVMIXDEF const char *kvmix_result_string(kvmix_result result) {
    switch (result) {
    case KVMIX_SUCCESS: return "success";
    case KVMIX_ERR_NULL_POINTER: return "a required pointer argument is NULL";
    case KVMIX_ERR_INVALID_ARGUMENT: return "an argument is out of range";
    case KVMIX_ERR_BAD_SHAPE: return "head_dim, group size or boost count not supported";
    case KVMIX_ERR_UNKNOWN_FORMAT: return "unknown format";
    case KVMIX_ERR_BUFFER_TOO_SMALL: return "buffer too small";
    case KVMIX_ERR_BAD_VALUE: return "input is NaN, infinite or beyond the FP16 range";
    case KVMIX_ERR_OUT_OF_MEMORY: return "out of memory";
    case KVMIX_ERR_UNSUPPORTED: return "not supported by this backend or build";
    case KVMIX_ERR_CORRUPT_DATA: return "packed data is corrupt";
    case KVMIX_ERR_VERSION: return "unsupported format version";
    case KVMIX_ERR_PARSE: return "malformed document";
    case KVMIX_ERR_NOT_FOUND: return "not found";
    case KVMIX_ERR_CUDA: return "CUDA runtime error";
    }
    return "unknown kvmix_result";
}

KVMIXDEF const char *kvmix_version_string(void) { return KVMIX_VERSION_STRING; }

static uint32_t kvmix__float_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

static float kvmix__bits_float(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

KVMIXDEF uint16_t kvmix_fp32_to_fp16(float value) {
    uint32_t bits = kvmix__float_bits(value);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return 0x7fff;                /* NaN */
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (magnitude >= 0x38800000u) {                            /* normal half: >= 2^-14 */
        uint32_t odd = (magnitude >> 13) & 1u;
        magnitude += 0xfffu + odd;
        return (uint16_t)(sign | ((magnitude - 0x38000000u) >> 13));
    }
    if (magnitude < 0x33000000u) return sign;                  /* below 2^-25: rounds to zero */
    {
        /* subnormal half: count units of 2^-24, rounding the dropped bits to even */
        int32_t shift = 126 - (int32_t)(magnitude >> 23);
        uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
        uint32_t units = mantissa >> shift;
        uint32_t rest = mantissa & ((1u << shift) - 1u);
        uint32_t halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (units & 1u))) units++;
        return (uint16_t)(sign | units);
    }
}

KVMIXDEF float kvmix_fp16_to_fp32(uint16_t half) {
    uint32_t sign = (uint32_t)(half & 0x8000u) << 16;
    uint32_t exponent = (half >> 10) & 0x1fu;
    uint32_t mantissa = half & 0x3ffu;
    if (exponent == 0x1f) return kvmix__bits_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        float magnitude = (float)mantissa * (1.0f / 16777216.0f); /* exact: mantissa * 2^-24 */
        return sign ? -magnitude : magnitude;
    }
    return kvmix__bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

KVMIXDEF uint16_t kvmix_fp32_to_bf16(float value) {
    uint32_t bits = kvmix__float_bits(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

KVMIXDEF float kvmix_bf16_to_fp32(uint16_t bf16) { return kvmix__bits_float((uint32_t)bf16 << 16); }

/* Little-endian 16-bit loads and stores, so packed bytes mean the same on every host. */
static uint16_t kvmix__load_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

static void kvmix__store_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v & 0xffu);
    p[1] = (uint8_t)(v >> 8);
}

// >>formats
/*
   Byte layouts. Every block is little-endian and has no padding; sections follow each other in
   the order given. Codes q are unsigned; element c of a packed row of b-bit codes lives in byte
   c*b/8 at bit offset (c % (8/b)) * b (low bits first). A (scale, min) pair is two FP16 values,
   scale first, 4 bytes.

   FP16:         [n][D] fp16.
   INT8/4/2:     data [n][D*b/8] packed codes, then meta [n][D/G] (scale, min): token t's group g
                 covers channels g*G .. g*G+G-1.
   INT2_CHANNEL: data [n][D/4] packed 2-bit codes (token-major), then meta [D] (scale, min) per
                 channel over the block's n tokens.
   BOOSTED:      dense [n][D/4] the low 2 bits of every channel's code (token-major),
                 high  [n][k/4] the high 2 bits of the boosted channels' 4-bit codes, slot s at
                       position s of the token's packed row,
                 meta  [D] (scale, min) per channel,
                 index [D] uint8 slot of the channel, or KVMIX_BOOST_NONE.
                 The boosted channels are the k with the largest sum over tokens of |x| (summed
                 in float, token order; ties go to the lower channel); slots number them in
                 increasing channel order. They use 4-bit codes (levels 15), the others 2-bit.

   Quantizing a group (or channel) of values with L = 2^bits - 1 levels:
     min   = fp16 of the smallest value, rounded toward -infinity;
     scale = fp16 of (largest - min) / L (float division), raised by one FP16 step while
             min + L * scale < largest (evaluated exactly, in double), so every value lies in
             [min, min + L * scale];
     q     = 0 if scale == 0, else rint((x - min) / scale) in float (round half to even),
             clamped to [0, L].
   Dequantizing: x' = (float)q * scale + min, each operation rounded to float (no fused
   multiply-add), so |x' - x| <= scale / 2 up to float rounding.
*/

typedef struct kvmix__qparams {
    uint16_t scale_h;
    uint16_t min_h;
    float scale;
    float min;
} kvmix__qparams;

static int kvmix__format_bits(kvmix_format format) {
    switch (format) {
    case KVMIX_FORMAT_FP16: return 16;
    case KVMIX_FORMAT_INT8: return 8;
    case KVMIX_FORMAT_INT4: return 4;
    case KVMIX_FORMAT_INT2:
    case KVMIX_FORMAT_INT2_CHANNEL:
    case KVMIX_FORMAT_BOOSTED: return 2;
    }
    return 0;
}

static int kvmix__is_per_token_int(kvmix_format format) {
    return format == KVMIX_FORMAT_INT8 || format == KVMIX_FORMAT_INT4 ||
           format == KVMIX_FORMAT_INT2;
}

KVMIXDEF kvmix_result kvmix_layout_resolve(kvmix_layout *layout) {
    kvmix_layout resolved;
    if (!layout) return KVMIX_ERR_NULL_POINTER;
    resolved = *layout;
    if (kvmix__format_bits(resolved.format) == 0) return KVMIX_ERR_UNKNOWN_FORMAT;
    if (resolved.n_tokens < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    if (resolved.head_dim <= 0 || resolved.head_dim % 32 != 0 ||
        resolved.head_dim > KVMIX_MAX_HEAD_DIM)
        return KVMIX_ERR_BAD_SHAPE;
    if (kvmix__is_per_token_int(resolved.format)) {
        if (resolved.group_size == 0) resolved.group_size = KVMIX_GROUP_SIZE_DEFAULT;
        if (resolved.group_size < 0 || resolved.group_size % 8 != 0 ||
            resolved.head_dim % resolved.group_size != 0)
            return KVMIX_ERR_BAD_SHAPE;
    } else if (resolved.group_size != 0) {
        return KVMIX_ERR_BAD_SHAPE;
    }
    if (resolved.format == KVMIX_FORMAT_BOOSTED) {
        if (resolved.n_boost < 0 || resolved.n_boost % 4 != 0 ||
            resolved.n_boost > resolved.head_dim || resolved.n_boost > 252)
            return KVMIX_ERR_BAD_SHAPE;
    } else if (resolved.n_boost != 0) {
        return KVMIX_ERR_BAD_SHAPE;
    }
    *layout = resolved;
    return KVMIX_SUCCESS;
}

/* Section sizes of a resolved layout; `offset` fields are from the block start. */
typedef struct kvmix__sections {
    size_t data_bytes;  /* codes (dense codes for BOOSTED); FP16 rows for FP16 */
    size_t row_bytes;   /* one token's share of the data section */
    size_t high_offset; /* BOOSTED: high bits */
    size_t high_row_bytes;
    size_t meta_offset;
    size_t index_offset; /* BOOSTED: channel-to-slot index */
    size_t total_bytes;
} kvmix__sections;

static kvmix__sections kvmix__layout_sections(const kvmix_layout *layout) {
    kvmix__sections s;
    size_t n = (size_t)layout->n_tokens, d = (size_t)layout->head_dim;
    memset(&s, 0, sizeof s);
    s.row_bytes = d * (size_t)kvmix__format_bits(layout->format) / 8;
    s.data_bytes = n * s.row_bytes;
    s.high_row_bytes = (size_t)layout->n_boost / 4;
    s.high_offset = s.data_bytes;
    s.meta_offset = s.high_offset + n * s.high_row_bytes;
    if (layout->format == KVMIX_FORMAT_FP16)
        s.index_offset = s.meta_offset;
    else if (kvmix__is_per_token_int(layout->format))
        s.index_offset = s.meta_offset + n * (d / (size_t)layout->group_size) * 4;
    else
        s.index_offset = s.meta_offset + d * 4;
    s.total_bytes = s.index_offset + (layout->format == KVMIX_FORMAT_BOOSTED ? d : 0);
    if (n == 0) s.total_bytes = 0;
    return s;
}

KVMIXDEF kvmix_result kvmix_layout_bytes(const kvmix_layout *layout, size_t *out_bytes) {
    kvmix_layout resolved;
    kvmix_result r;
    if (!layout || !out_bytes) return KVMIX_ERR_NULL_POINTER;
    resolved = *layout;
    if ((r = kvmix_layout_resolve(&resolved)) != KVMIX_SUCCESS) return r;
    *out_bytes = kvmix__layout_sections(&resolved).total_bytes;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_layout_bits(const kvmix_layout *layout, double *out_bits) {
    kvmix_layout resolved;
    kvmix_result r;
    if (!layout || !out_bits) return KVMIX_ERR_NULL_POINTER;
    resolved = *layout;
    if ((r = kvmix_layout_resolve(&resolved)) != KVMIX_SUCCESS) return r;
    if (resolved.n_tokens == 0) return KVMIX_ERR_INVALID_ARGUMENT;
    *out_bits = (double)kvmix__layout_sections(&resolved).total_bytes * 8.0 /
                ((double)resolved.n_tokens * (double)resolved.head_dim);
    return KVMIX_SUCCESS;
}

static int kvmix__representable(float x) { return x >= -65504.0f && x <= 65504.0f; } /* NaN: no */

static uint16_t kvmix__fp16_step_down(uint16_t h) {
    if (h == 0x0000u || h == 0x8000u) return 0x8001u;
    return (h & 0x8000u) ? (uint16_t)(h + 1u) : (uint16_t)(h - 1u);
}

/* Parameters for values in [lo, hi] with `levels` steps; see the layout comment above. */
static kvmix__qparams kvmix__choose_qparams(float lo, float hi, int levels) {
    kvmix__qparams p;
    float step;
    p.min_h = kvmix_fp32_to_fp16(lo);
    if (kvmix_fp16_to_fp32(p.min_h) > lo) p.min_h = kvmix__fp16_step_down(p.min_h);
    p.min = kvmix_fp16_to_fp32(p.min_h);
    step = (hi - p.min) / (float)levels;
    p.scale_h = kvmix_fp32_to_fp16(step);
    while ((double)kvmix_fp16_to_fp32(p.scale_h) * levels + (double)p.min < (double)hi)
        p.scale_h = (uint16_t)(p.scale_h + 1u); /* non-negative: the next FP16 up */
    p.scale = kvmix_fp16_to_fp32(p.scale_h);
    return p;
}

static uint32_t kvmix__quantize_value(float x, const kvmix__qparams *p, int levels) {
    float q;
    if (p->scale_h == 0) return 0;
    q = rintf((x - p->min) / p->scale);
    if (q < 0.0f) q = 0.0f;
    if (q > (float)levels) q = (float)levels;
    return (uint32_t)q;
}

static float kvmix__dequantize_value(uint32_t q, float scale, float min) {
    float scaled = (float)q * scale;
    return scaled + min;
}

static void kvmix__store_qparams(uint8_t *meta, const kvmix__qparams *p) {
    kvmix__store_u16(meta, p->scale_h);
    kvmix__store_u16(meta + 2, p->min_h);
}

static void kvmix__put_code(uint8_t *row, int32_t c, int bits, uint32_t q) {
    int per_byte = 8 / bits;
    int shift = (c % per_byte) * bits;
    row[c / per_byte] = (uint8_t)(row[c / per_byte] | (q << shift));
}

static uint32_t kvmix__get_code(const uint8_t *row, int32_t c, int bits) {
    int per_byte = 8 / bits;
    int shift = (c % per_byte) * bits;
    return (row[c / per_byte] >> shift) & ((1u << bits) - 1u);
}

static void kvmix__quantize_fp16(const kvmix_layout *l, const float *src, int32_t stride,
                                 uint8_t *dst) {
    int32_t t, c;
    for (t = 0; t < l->n_tokens; t++)
        for (c = 0; c < l->head_dim; c++)
            kvmix__store_u16(dst + ((size_t)t * l->head_dim + c) * 2,
                             kvmix_fp32_to_fp16(src[(size_t)t * stride + c]));
}

static void kvmix__quantize_per_token(const kvmix_layout *l, const float *src, int32_t stride,
                                      uint8_t *dst) {
    kvmix__sections s = kvmix__layout_sections(l);
    int bits = kvmix__format_bits(l->format), levels = (1 << bits) - 1;
    int32_t groups = l->head_dim / l->group_size, t, g, c;
    for (t = 0; t < l->n_tokens; t++) {
        const float *x = src + (size_t)t * stride;
        uint8_t *row = dst + (size_t)t * s.row_bytes;
        for (g = 0; g < groups; g++) {
            int32_t c0 = g * l->group_size, c1 = c0 + l->group_size;
            float lo = x[c0], hi = x[c0];
            kvmix__qparams p;
            for (c = c0; c < c1; c++) {
                if (x[c] < lo) lo = x[c];
                if (x[c] > hi) hi = x[c];
            }
            p = kvmix__choose_qparams(lo, hi, levels);
            for (c = c0; c < c1; c++) kvmix__put_code(row, c, bits, kvmix__quantize_value(x[c], &p, levels));
            kvmix__store_qparams(dst + s.meta_offset + ((size_t)t * groups + g) * 4, &p);
        }
    }
}

/* Marks the n_boost channels with the largest sum of |x| over the block's tokens. */
static void kvmix__rank_channels(const kvmix_layout *l, const float *src, int32_t stride,
                                 uint8_t *is_boosted) {
    float score[KVMIX_MAX_HEAD_DIM];
    int32_t t, c, chosen;
    for (c = 0; c < l->head_dim; c++) {
        score[c] = 0.0f;
        for (t = 0; t < l->n_tokens; t++) score[c] += fabsf(src[(size_t)t * stride + c]);
        is_boosted[c] = 0;
    }
    for (chosen = 0; chosen < l->n_boost; chosen++) {
        int32_t best = -1;
        for (c = 0; c < l->head_dim; c++)
            if (!is_boosted[c] && (best < 0 || score[c] > score[best])) best = c;
        is_boosted[best] = 1;
    }
}

static void kvmix__quantize_per_channel(const kvmix_layout *l, const float *src, int32_t stride,
                                        uint8_t *dst) {
    kvmix__sections s = kvmix__layout_sections(l);
    uint8_t is_boosted[KVMIX_MAX_HEAD_DIM];
    int32_t t, c, slot = 0;
    memset(is_boosted, 0, sizeof is_boosted);
    if (l->format == KVMIX_FORMAT_BOOSTED) kvmix__rank_channels(l, src, stride, is_boosted);
    for (c = 0; c < l->head_dim; c++) {
        int levels = is_boosted[c] ? 15 : 3;
        float lo = src[c], hi = src[c];
        kvmix__qparams p;
        for (t = 0; t < l->n_tokens; t++) {
            float x = src[(size_t)t * stride + c];
            if (x < lo) lo = x;
            if (x > hi) hi = x;
        }
        p = kvmix__choose_qparams(lo, hi, levels);
        for (t = 0; t < l->n_tokens; t++) {
            uint32_t q = kvmix__quantize_value(src[(size_t)t * stride + c], &p, levels);
            kvmix__put_code(dst + (size_t)t * s.row_bytes, c, 2, q & 3u);
            if (is_boosted[c])
                kvmix__put_code(dst + s.high_offset + (size_t)t * s.high_row_bytes, slot, 2, q >> 2);
        }
        kvmix__store_qparams(dst + s.meta_offset + (size_t)c * 4, &p);
        if (l->format == KVMIX_FORMAT_BOOSTED)
            dst[s.index_offset + c] = is_boosted[c] ? (uint8_t)slot++ : (uint8_t)KVMIX_BOOST_NONE;
    }
}

KVMIXDEF kvmix_result kvmix_ref_quantize(const kvmix_layout *layout, const float *src,
                                         int32_t row_stride, void *dst, size_t dst_bytes) {
    kvmix_layout l;
    kvmix__sections s;
    kvmix_result r;
    int32_t t, c;
    if (!layout) return KVMIX_ERR_NULL_POINTER;
    l = *layout;
    if ((r = kvmix_layout_resolve(&l)) != KVMIX_SUCCESS) return r;
    if (row_stride == 0) row_stride = l.head_dim;
    if (row_stride < l.head_dim) return KVMIX_ERR_INVALID_ARGUMENT;
    if (l.n_tokens == 0) return KVMIX_SUCCESS;
    if (!src || !dst) return KVMIX_ERR_NULL_POINTER;
    s = kvmix__layout_sections(&l);
    if (dst_bytes < s.total_bytes) return KVMIX_ERR_BUFFER_TOO_SMALL;
    for (t = 0; t < l.n_tokens; t++)
        for (c = 0; c < l.head_dim; c++)
            if (!kvmix__representable(src[(size_t)t * row_stride + c])) return KVMIX_ERR_BAD_VALUE;
    memset(dst, 0, s.total_bytes);
    if (l.format == KVMIX_FORMAT_FP16)
        kvmix__quantize_fp16(&l, src, row_stride, (uint8_t *)dst);
    else if (kvmix__is_per_token_int(l.format))
        kvmix__quantize_per_token(&l, src, row_stride, (uint8_t *)dst);
    else
        kvmix__quantize_per_channel(&l, src, row_stride, (uint8_t *)dst);
    return KVMIX_SUCCESS;
}

static int kvmix__qparams_valid(const uint8_t *meta) {
    float scale = kvmix_fp16_to_fp32(kvmix__load_u16(meta));
    float min = kvmix_fp16_to_fp32(kvmix__load_u16(meta + 2));
    return scale >= 0.0f && kvmix__representable(scale) && kvmix__representable(min);
}

/* Checks what a quantize call guarantees about packed bytes: finite FP16 rows and parameters,
   non-negative scales, and a boost index that gives each of the n_boost slots to exactly one
   channel. */
static kvmix_result kvmix__check_block(const kvmix_layout *l, const uint8_t *block) {
    kvmix__sections s = kvmix__layout_sections(l);
    size_t meta_end = s.index_offset, i;
    if (l->format == KVMIX_FORMAT_FP16) {
        for (i = 0; i < s.total_bytes; i += 2)
            if ((kvmix__load_u16(block + i) & 0x7c00u) == 0x7c00u) return KVMIX_ERR_CORRUPT_DATA;
        return KVMIX_SUCCESS;
    }
    for (i = s.meta_offset; i < meta_end; i += 4)
        if (!kvmix__qparams_valid(block + i)) return KVMIX_ERR_CORRUPT_DATA;
    if (l->format == KVMIX_FORMAT_BOOSTED) {
        uint8_t slot_used[256];
        int32_t c, n_used = 0;
        memset(slot_used, 0, sizeof slot_used);
        for (c = 0; c < l->head_dim; c++) {
            uint8_t slot = block[s.index_offset + c];
            if (slot == KVMIX_BOOST_NONE) continue;
            if (slot >= l->n_boost || slot_used[slot]) return KVMIX_ERR_CORRUPT_DATA;
            slot_used[slot] = 1;
            n_used++;
        }
        if (n_used != l->n_boost) return KVMIX_ERR_CORRUPT_DATA;
    }
    return KVMIX_SUCCESS;
}

static void kvmix__meta_at(const uint8_t *meta, float *scale, float *min) {
    *scale = kvmix_fp16_to_fp32(kvmix__load_u16(meta));
    *min = kvmix_fp16_to_fp32(kvmix__load_u16(meta + 2));
}

/* Row t of a checked block; the one decoder that attention and dequantize share. */
static void kvmix__decode_row(const kvmix_layout *l, const kvmix__sections *s, const uint8_t *block,
                              int32_t t, float *out) {
    const uint8_t *row = block + (size_t)t * s->row_bytes;
    int bits = kvmix__format_bits(l->format);
    int32_t c;
    float scale, min;
    if (l->format == KVMIX_FORMAT_FP16) {
        for (c = 0; c < l->head_dim; c++) out[c] = kvmix_fp16_to_fp32(kvmix__load_u16(row + 2 * c));
    } else if (kvmix__is_per_token_int(l->format)) {
        int32_t groups = l->head_dim / l->group_size;
        const uint8_t *meta = block + s->meta_offset + (size_t)t * groups * 4;
        for (c = 0; c < l->head_dim; c++) {
            kvmix__meta_at(meta + (size_t)(c / l->group_size) * 4, &scale, &min);
            out[c] = kvmix__dequantize_value(kvmix__get_code(row, c, bits), scale, min);
        }
    } else {
        const uint8_t *high = block + s->high_offset + (size_t)t * s->high_row_bytes;
        for (c = 0; c < l->head_dim; c++) {
            uint32_t q = kvmix__get_code(row, c, 2);
            if (l->format == KVMIX_FORMAT_BOOSTED) {
                uint8_t slot = block[s->index_offset + c];
                if (slot != KVMIX_BOOST_NONE) q |= kvmix__get_code(high, slot, 2) << 2;
            }
            kvmix__meta_at(block + s->meta_offset + (size_t)c * 4, &scale, &min);
            out[c] = kvmix__dequantize_value(q, scale, min);
        }
    }
}

/* Resolves the layout and checks the packed block `src` of `src_bytes`. */
static kvmix_result kvmix__open_block(const kvmix_layout *layout, const void *src,
                                      size_t src_bytes, kvmix_layout *l, kvmix__sections *s) {
    kvmix_result r;
    if (!layout) return KVMIX_ERR_NULL_POINTER;
    *l = *layout;
    if ((r = kvmix_layout_resolve(l)) != KVMIX_SUCCESS) return r;
    *s = kvmix__layout_sections(l);
    if (l->n_tokens == 0) return KVMIX_SUCCESS;
    if (!src) return KVMIX_ERR_NULL_POINTER;
    if (src_bytes < s->total_bytes) return KVMIX_ERR_BUFFER_TOO_SMALL;
    return kvmix__check_block(l, (const uint8_t *)src);
}

KVMIXDEF kvmix_result kvmix_ref_dequantize(const kvmix_layout *layout, const void *src,
                                           size_t src_bytes, float *dst, int32_t row_stride) {
    kvmix_layout l;
    kvmix__sections s;
    kvmix_result r = kvmix__open_block(layout, src, src_bytes, &l, &s);
    int32_t t;
    if (r != KVMIX_SUCCESS) return r;
    if (row_stride == 0) row_stride = l.head_dim;
    if (row_stride < l.head_dim) return KVMIX_ERR_INVALID_ARGUMENT;
    if (l.n_tokens == 0) return KVMIX_SUCCESS;
    if (!dst) return KVMIX_ERR_NULL_POINTER;
    for (t = 0; t < l.n_tokens; t++)
        kvmix__decode_row(&l, &s, (const uint8_t *)src, t, dst + (size_t)t * row_stride);
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_ref_dequantize_row(const kvmix_layout *layout, const void *src,
                                               size_t src_bytes, int32_t row, float *dst) {
    kvmix_layout l;
    kvmix__sections s;
    kvmix_result r = kvmix__open_block(layout, src, src_bytes, &l, &s);
    if (r != KVMIX_SUCCESS) return r;
    if (row < 0 || row >= l.n_tokens) return KVMIX_ERR_INVALID_ARGUMENT;
    if (!dst) return KVMIX_ERR_NULL_POINTER;
    kvmix__decode_row(&l, &s, (const uint8_t *)src, row, dst);
    return KVMIX_SUCCESS;
}

// >>ref

/* Validates one span of a decode step, packed bytes of every kv head included. */
static kvmix_result kvmix__check_span(const kvmix_attention_desc *d, const kvmix_span *span) {
    const kvmix_layout *layouts[2];
    const void *blocks[2];
    size_t head_bytes[2], extent_bytes[2];
    int i;
    layouts[0] = &span->key_layout;
    layouts[1] = &span->value_layout;
    blocks[0] = span->keys;
    blocks[1] = span->values;
    head_bytes[0] = span->key_head_bytes;
    head_bytes[1] = span->value_head_bytes;
    extent_bytes[0] = span->keys_bytes;
    extent_bytes[1] = span->values_bytes;
    if (span->key_layout.n_tokens != span->value_layout.n_tokens) return KVMIX_ERR_INVALID_ARGUMENT;
    if (span->key_layout.head_dim != d->head_dim || span->value_layout.head_dim != d->head_dim)
        return KVMIX_ERR_BAD_SHAPE;
    for (i = 0; i < 2; i++) {
        kvmix_layout l;
        kvmix__sections s;
        kvmix_result r;
        int32_t h;
        l = *layouts[i];
        if ((r = kvmix_layout_resolve(&l)) != KVMIX_SUCCESS) return r;
        s = kvmix__layout_sections(&l);
        if (l.n_tokens == 0) continue;
        if (!blocks[i]) return KVMIX_ERR_NULL_POINTER;
        if (head_bytes[i] == 0) head_bytes[i] = s.total_bytes;
        if (head_bytes[i] < s.total_bytes) return KVMIX_ERR_INVALID_ARGUMENT;
        if (extent_bytes[i] < s.total_bytes ||
            (d->n_kv_heads > 1 &&
             head_bytes[i] > (extent_bytes[i] - s.total_bytes) / (size_t)(d->n_kv_heads - 1)))
            return KVMIX_ERR_BUFFER_TOO_SMALL;
        for (h = 0; h < d->n_kv_heads; h++) {
            r = kvmix__check_block(&l, (const uint8_t *)blocks[i] + head_bytes[i] * (size_t)h);
            if (r != KVMIX_SUCCESS) return r;
        }
    }
    return KVMIX_SUCCESS;
}

/* Online-softmax state of one query head: running max, running sum, unnormalized output. */
typedef struct kvmix__softmax_state {
    float max;
    float sum;
} kvmix__softmax_state;

static void kvmix__softmax_add(kvmix__softmax_state *st, float *acc, int32_t dim, float logit,
                               const float *value) {
    int32_t c;
    if (logit > st->max) {
        float rescale = expf(st->max - logit); /* exp(-inf) = 0 on the first token */
        for (c = 0; c < dim; c++) acc[c] *= rescale;
        st->sum *= rescale;
        st->max = logit;
    }
    {
        float weight = expf(logit - st->max);
        st->sum += weight;
        for (c = 0; c < dim; c++) acc[c] += weight * value[c];
    }
}

/* A block of kv head h within a span's key or value storage. */
static const uint8_t *kvmix__head_block(const void *base, size_t head_bytes,
                                        const kvmix__sections *s, int32_t h) {
    return (const uint8_t *)base + (head_bytes ? head_bytes : s->total_bytes) * (size_t)h;
}

#define KVMIX__HEADS_PER_PASS 64

/* Adds a span's live tokens of kv head h to n_q query heads (q, acc: [n_q][head_dim]). Each K/V
   row is decoded once and shared by all query heads of the kv head. */
static void kvmix__attend_span(const kvmix_span *span, int32_t h, const float *q, int32_t n_q,
                               float scale, kvmix__softmax_state *states, float *acc) {
    kvmix_layout kl = span->key_layout, vl = span->value_layout;
    kvmix__sections ks, vs;
    const uint8_t *kblock, *vblock;
    float key[KVMIX_MAX_HEAD_DIM], value[KVMIX_MAX_HEAD_DIM];
    int32_t dim, t, g, c;
    kvmix_layout_resolve(&kl);
    kvmix_layout_resolve(&vl);
    dim = kl.head_dim;
    ks = kvmix__layout_sections(&kl);
    vs = kvmix__layout_sections(&vl);
    kblock = kvmix__head_block(span->keys, span->key_head_bytes, &ks, h);
    vblock = kvmix__head_block(span->values, span->value_head_bytes, &vs, h);
    for (t = 0; t < kl.n_tokens; t++) {
        if (span->dead && span->dead[t]) continue;
        kvmix__decode_row(&kl, &ks, kblock, t, key);
        kvmix__decode_row(&vl, &vs, vblock, t, value);
        for (g = 0; g < n_q; g++) {
            const float *qrow = q + (size_t)g * dim;
            float dot = 0.0f;
            for (c = 0; c < dim; c++) dot += qrow[c] * key[c];
            kvmix__softmax_add(&states[g], acc + (size_t)g * dim, dim, dot * scale, value);
        }
    }
}

static void kvmix__heads_begin(kvmix__softmax_state *states, float *acc, int32_t n_q,
                               int32_t dim) {
    int32_t g, c;
    for (g = 0; g < n_q; g++) {
        states[g].max = -INFINITY;
        states[g].sum = 0.0f;
        for (c = 0; c < dim; c++) acc[(size_t)g * dim + c] = 0.0f;
    }
}

/* Normalizes the accumulated outputs and writes the log-sum-exp; no live token gives 0, -inf. */
static void kvmix__heads_finish(const kvmix__softmax_state *states, float *out, float *lse,
                                int32_t n_q, int32_t dim) {
    int32_t g, c;
    for (g = 0; g < n_q; g++) {
        float inv = states[g].sum > 0.0f ? 1.0f / states[g].sum : 0.0f;
        for (c = 0; c < dim; c++) out[(size_t)g * dim + c] *= inv;
        lse[g] = states[g].sum > 0.0f ? states[g].max + logf(states[g].sum) : -INFINITY;
    }
}

/* The spans of one sequence: a caller's array, or a range of a view's spans. */
typedef struct kvmix__span_list {
    const kvmix_span *spans; /* the array, or NULL for a view range */
    const kvmix_view *view;
    int32_t first;
    int32_t count;
} kvmix__span_list;

static int kvmix__format_known(int32_t format) {
    return format >= KVMIX_FORMAT_FP16 && format <= KVMIX_FORMAT_BOOSTED;
}

/* The block layout of a view's keys or values; the format must be known. */
static kvmix_layout kvmix__view_layout(const kvmix_view *view, uint8_t format, int32_t n_tokens) {
    kvmix_layout l;
    l.format = (kvmix_format)format;
    l.n_tokens = n_tokens;
    l.head_dim = view->head_dim;
    l.group_size = kvmix__is_per_token_int(l.format) ? view->group_size : 0;
    l.n_boost = l.format == KVMIX_FORMAT_BOOSTED ? view->n_boost : 0;
    return l;
}

/* A view span as a kvmix_span whose extents run to the end of the base region. */
static kvmix_span kvmix__span_of_view(const kvmix_view *view, const kvmix_view_span *vs) {
    kvmix_span s;
    s.key_layout = kvmix__view_layout(view, vs->key_format, vs->n_tokens);
    s.value_layout = kvmix__view_layout(view, vs->value_format, vs->n_tokens);
    s.keys = view->base + vs->key_offset;
    s.values = view->base + vs->value_offset;
    s.key_head_bytes = vs->key_head_bytes;
    s.value_head_bytes = vs->value_head_bytes;
    s.keys_bytes = (size_t)(view->base_bytes - vs->key_offset);
    s.values_bytes = (size_t)(view->base_bytes - vs->value_offset);
    s.dead = vs->dead_index >= 0 ? view->dead + vs->dead_index : NULL;
    return s;
}

static kvmix_span kvmix__span_at(const kvmix__span_list *list, int32_t i) {
    if (list->spans) return list->spans[list->first + i];
    return kvmix__span_of_view(list->view, &list->view->spans[list->first + i]);
}

/* Attention of n_q query heads that all read kv head h; at most KVMIX__HEADS_PER_PASS. */
static void kvmix__attend_heads(const kvmix__span_list *list, int32_t h, const float *q,
                                int32_t n_q, int32_t dim, float scale, float *out, float *lse) {
    kvmix__softmax_state states[KVMIX__HEADS_PER_PASS];
    int32_t i;
    kvmix__heads_begin(states, out, n_q, dim);
    for (i = 0; i < list->count; i++) {
        kvmix_span span = kvmix__span_at(list, i);
        if (span.key_layout.n_tokens > 0) kvmix__attend_span(&span, h, q, n_q, scale, states, out);
    }
    kvmix__heads_finish(states, out, lse, n_q, dim);
}

static float kvmix__softmax_scale(float scale, int32_t dim) {
    return scale > 0.0f ? scale : 1.0f / sqrtf((float)dim);
}

/* One sequence's decode step over validated spans; q, out [n_q_heads][D], lse [n_q_heads]. */
static void kvmix__attend_sequence(const kvmix_attention_desc *d, const kvmix__span_list *list,
                                   const float *q, float *out, float *lse) {
    int32_t group = d->n_q_heads / d->n_kv_heads, dim = d->head_dim, h, g0;
    float scale = kvmix__softmax_scale(d->scale, dim);
    for (h = 0; h < d->n_kv_heads; h++)
        for (g0 = 0; g0 < group; g0 += KVMIX__HEADS_PER_PASS) {
            int32_t first = h * group + g0;
            int32_t n_q = group - g0 < KVMIX__HEADS_PER_PASS ? group - g0 : KVMIX__HEADS_PER_PASS;
            kvmix__attend_heads(list, h, q + (size_t)first * dim, n_q, dim, scale,
                                out + (size_t)first * dim, lse + first);
        }
}

static kvmix_result kvmix__check_desc(const kvmix_attention_desc *d) {
    if (d->n_kv_heads <= 0 || d->n_q_heads <= 0 || d->n_q_heads % d->n_kv_heads != 0 ||
        !(d->scale >= 0.0f) || isinf(d->scale))
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (d->head_dim <= 0 || d->head_dim % 32 != 0 || d->head_dim > KVMIX_MAX_HEAD_DIM)
        return KVMIX_ERR_BAD_SHAPE;
    return KVMIX_SUCCESS;
}

static kvmix_result kvmix__check_span_list(const kvmix_attention_desc *d,
                                           const kvmix__span_list *list) {
    int32_t i;
    for (i = 0; i < list->count; i++) {
        kvmix_span span = kvmix__span_at(list, i);
        kvmix_result r = kvmix__check_span(d, &span);
        if (r != KVMIX_SUCCESS) return r;
    }
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_ref_attention_decode(const kvmix_attention_desc *desc, const float *q,
                                                 const kvmix_span *spans, int32_t n_spans,
                                                 float *out, float *lse) {
    kvmix__span_list list;
    kvmix_result r;
    if (!desc || !q || !out || !lse) return KVMIX_ERR_NULL_POINTER;
    if (n_spans < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    if (n_spans > 0 && !spans) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__check_desc(desc)) != KVMIX_SUCCESS) return r;
    list.spans = spans;
    list.view = NULL;
    list.first = 0;
    list.count = n_spans;
    if ((r = kvmix__check_span_list(desc, &list)) != KVMIX_SUCCESS) return r;
    kvmix__attend_sequence(desc, &list, q, out, lse);
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_ref_attention_merge(int32_t n_heads, int32_t head_dim,
                                                const float *out_a, const float *lse_a,
                                                const float *out_b, const float *lse_b,
                                                float *out, float *lse) {
    int32_t h, c;
    if (!out_a || !lse_a || !out_b || !lse_b || !out || !lse) return KVMIX_ERR_NULL_POINTER;
    if (n_heads < 0 || head_dim < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    for (h = 0; h < n_heads; h++) {
        float la = lse_a[h], lb = lse_b[h], m = la > lb ? la : lb, wa, wb, total;
        if (m == -INFINITY) { /* both empty */
            for (c = 0; c < head_dim; c++) out[(size_t)h * head_dim + c] = 0.0f;
            lse[h] = -INFINITY;
            continue;
        }
        wa = expf(la - m);
        wb = expf(lb - m);
        total = wa + wb;
        for (c = 0; c < head_dim; c++) {
            size_t i = (size_t)h * head_dim + c;
            out[i] = (wa * out_a[i] + wb * out_b[i]) / total;
        }
        lse[h] = m + logf(total);
    }
    return KVMIX_SUCCESS;
}

// >>view

/* A view block (one of keys or values) of n_kv_heads heads: known format, valid layout, extent
   inside the base region. */
static kvmix_result kvmix__check_view_block(const kvmix_view *view, uint8_t format,
                                            int32_t n_tokens, uint64_t offset,
                                            uint32_t head_bytes) {
    kvmix_layout l;
    kvmix_result r;
    uint64_t block_bytes, extent;
    if (!kvmix__format_known(format)) return KVMIX_ERR_UNKNOWN_FORMAT;
    l = kvmix__view_layout(view, format, n_tokens);
    if ((r = kvmix_layout_resolve(&l)) != KVMIX_SUCCESS) return r;
    block_bytes = kvmix__layout_sections(&l).total_bytes;
    if (head_bytes < block_bytes) return KVMIX_ERR_INVALID_ARGUMENT;
    extent = (uint64_t)head_bytes * (uint64_t)(view->n_kv_heads - 1) + block_bytes;
    if (offset > view->base_bytes || extent > view->base_bytes - offset)
        return KVMIX_ERR_BUFFER_TOO_SMALL;
    return KVMIX_SUCCESS;
}

static kvmix_result kvmix__check_view_span(const kvmix_view *view, const kvmix_view_span *vs) {
    kvmix_result r;
    if (vs->n_tokens <= 0) return KVMIX_ERR_INVALID_ARGUMENT;
    if (vs->dead_index < -1 ||
        (vs->dead_index >= 0 && vs->n_tokens > view->n_dead_flags - vs->dead_index))
        return KVMIX_ERR_INVALID_ARGUMENT;
    r = kvmix__check_view_block(view, vs->key_format, vs->n_tokens, vs->key_offset,
                                vs->key_head_bytes);
    if (r != KVMIX_SUCCESS) return r;
    return kvmix__check_view_block(view, vs->value_format, vs->n_tokens, vs->value_offset,
                                   vs->value_head_bytes);
}

KVMIXDEF kvmix_result kvmix_view_check(const kvmix_view *view) {
    int32_t s, i;
    if (!view) return KVMIX_ERR_NULL_POINTER;
    if (view->n_seqs < 0 || view->n_kv_heads <= 0 || view->n_spans < 0 || view->n_dead_flags < 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (view->head_dim <= 0 || view->head_dim % 32 != 0 || view->head_dim > KVMIX_MAX_HEAD_DIM)
        return KVMIX_ERR_BAD_SHAPE;
    if (!view->seq_first_span || (view->n_spans > 0 && (!view->spans || !view->base)) ||
        (view->n_dead_flags > 0 && !view->dead))
        return KVMIX_ERR_NULL_POINTER;
    if (view->seq_first_span[0] != 0 || view->seq_first_span[view->n_seqs] != view->n_spans)
        return KVMIX_ERR_INVALID_ARGUMENT;
    for (s = 0; s < view->n_seqs; s++)
        if (view->seq_first_span[s + 1] < view->seq_first_span[s]) return KVMIX_ERR_INVALID_ARGUMENT;
    for (i = 0; i < view->n_spans; i++) {
        kvmix_result r = kvmix__check_view_span(view, &view->spans[i]);
        if (r != KVMIX_SUCCESS) return r;
    }
    return KVMIX_SUCCESS;
}

static kvmix__span_list kvmix__view_sequence(const kvmix_view *view, int32_t s) {
    kvmix__span_list list;
    list.spans = NULL;
    list.view = view;
    list.first = view->seq_first_span[s];
    list.count = view->seq_first_span[s + 1] - list.first;
    return list;
}

KVMIXDEF kvmix_result kvmix_ref_view_decode(const kvmix_view *view, int32_t n_q_heads,
                                            float scale, const float *q, float *out, float *lse) {
    kvmix_attention_desc desc;
    kvmix_result r;
    int32_t s;
    if (!q || !out || !lse) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix_view_check(view)) != KVMIX_SUCCESS) return r;
    desc.n_q_heads = n_q_heads;
    desc.n_kv_heads = view->n_kv_heads;
    desc.head_dim = view->head_dim;
    desc.scale = scale;
    if ((r = kvmix__check_desc(&desc)) != KVMIX_SUCCESS) return r;
    for (s = 0; s < view->n_seqs; s++) {
        kvmix__span_list list = kvmix__view_sequence(view, s);
        if ((r = kvmix__check_span_list(&desc, &list)) != KVMIX_SUCCESS) return r;
    }
    for (s = 0; s < view->n_seqs; s++) {
        kvmix__span_list list = kvmix__view_sequence(view, s);
        size_t first = (size_t)s * (size_t)n_q_heads;
        kvmix__attend_sequence(&desc, &list, q + first * view->head_dim,
                               out + first * view->head_dim, lse + first);
    }
    return KVMIX_SUCCESS;
}

/* Score of token t of a checked span: see kvmix_ref_view_score. */
static float kvmix__score_token(const kvmix_span *span, const kvmix_layout *kl,
                                const kvmix__sections *ks, int32_t t, int32_t n_kv_heads,
                                int32_t group, const float *memory) {
    float key[KVMIX_MAX_HEAD_DIM], sum = 0.0f;
    int32_t h, g, c, dim = kl->head_dim;
    for (h = 0; h < n_kv_heads; h++) {
        kvmix__decode_row(kl, ks, kvmix__head_block(span->keys, span->key_head_bytes, ks, h), t, key);
        for (g = 0; g < group; g++)
            for (c = 0; c < dim; c++) sum += memory[(size_t)(h * group + g) * dim + c] * key[c];
    }
    return sum;
}

KVMIXDEF kvmix_result kvmix_ref_view_score(const kvmix_view *view, int32_t seq,
                                           int32_t n_q_heads, const float *memory,
                                           float *scores, int32_t capacity_tokens) {
    kvmix_attention_desc desc;
    kvmix__span_list list;
    kvmix_result r;
    int32_t pos = 0, i, t;
    if (!memory || !scores) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix_view_check(view)) != KVMIX_SUCCESS) return r;
    if (seq < 0 || seq >= view->n_seqs || capacity_tokens < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    desc.n_q_heads = n_q_heads;
    desc.n_kv_heads = view->n_kv_heads;
    desc.head_dim = view->head_dim;
    desc.scale = 0.0f;
    if ((r = kvmix__check_desc(&desc)) != KVMIX_SUCCESS) return r;
    list = kvmix__view_sequence(view, seq);
    if ((r = kvmix__check_span_list(&desc, &list)) != KVMIX_SUCCESS) return r;
    for (i = 0; i < list.count; i++) {
        kvmix_span span = kvmix__span_at(&list, i);
        kvmix_layout kl = span.key_layout;
        kvmix__sections ks;
        kvmix_layout_resolve(&kl);
        ks = kvmix__layout_sections(&kl);
        for (t = 0; t < kl.n_tokens && pos < capacity_tokens; t++, pos++)
            scores[pos] = span.dead && span.dead[t]
                              ? -INFINITY
                              : kvmix__score_token(&span, &kl, &ks, t, view->n_kv_heads,
                                                   n_q_heads / view->n_kv_heads, memory);
    }
    return KVMIX_SUCCESS;
}

#endif /* KVMIX_IMPLEMENTATION_DONE */
#endif /* KVMIX_IMPLEMENTATION */
