/* kvmix.h - mixed-precision, prunable KV cache for LLM inference. MIT licensed (see LICENSE).

   Single-file library. In exactly one C or C++ file write

       #define KVMIX_IMPLEMENTATION
       #include "kvmix.h"

   Other files include it without the define. Define KVMIX_STATIC as well to make every function
   static to that file. The header compiles as C99, C11 and C++.

   Options (define before the implementing include):
     KVMIX_MALLOC(bytes) / KVMIX_FREE(ptr)  the default allocator (all or none; malloc/free)
     KVMIX_ASSERT(cond)                     internal invariants only (default: assert)
     KVMIX_NO_POLICY                        the core alone: formats, reference, views, the
                                            cache and the payload (before every include)

   Conventions: every function that can fail returns a kvmix_result and writes its outputs only on
   success, so a failed call leaves everything as it was (a cache only notes why:
   kvmix_cache_last_error). Sizes in bytes are size_t; counts are int32_t. In descs, zero means
   the default: none for a count of things kept, the documented value for a size or capacity.
   Calls that check a caller's description say what is wrong through a kvmix_error.
   There is no mutable global state: calls on distinct objects may run on any threads.

   Rooms (search for the marker). The core:
     // >>rules     the formats' pure rules, shared with kvmix_cuda.cu (in the declarations: no
                    KVMIX_IMPLEMENTATION needed; __host__ __device__ under nvcc)
     // >>core      results, allocator, fp16/bf16
     // >>formats   packed byte formats and their CPU reference (the spec of every GPU kernel)
     // >>ref       reference decode attention and the partial-result merge
     // >>view      cache views: many sequences' spans in one region, for CPU or GPU attention
     // >>cache     the paged mixed-precision cache. Its sub-sections ("---- name ----"):
                    why a call failed; the write plan's state; jobs, page geometry and format
                    order; a sequence's records; the granule bitmap (the arena); page
                    descriptors; desc, memory layout, init; sequences (create, fork, truncate,
                    evict, free); writes: plan, then commit; re-tiering; aging a sequence;
                    compaction; reading; views; accounting; invariants
     // >>transfer  the transfer payload: tiered rows for prefill-to-decode transfer, residuals
   The policy layer, built on the core's public calls alone (define KVMIX_NO_POLICY to leave it
   out):
     // >>tags      template specs and the streaming tagger: per token a turn, a modality, a role
     // >>policy    policies: what a cache applies per token, the built-ins, a token's formats
                    and run, aging a sequence's pages as its turns age
     // >>alloc     bit allocation: a precision per tag under a budget (exhaustive, greedy, DP)
     // >>intent    intent-aware eviction: the session store, QueryMemory, budgeted selection,
                    the learned residual on the intent scores (IntentKV phase 2)
     // >>tiers     transfer tiers: per-token FP16 / INT8 / INT4 under a byte budget, INT4 probe
*/
#ifndef KVMIX_H
#define KVMIX_H

#include <stddef.h>
#include <stdint.h>

#define KVMIX_VERSION_MAJOR  0
#define KVMIX_VERSION_MINOR  2
#define KVMIX_VERSION_PATCH  0
#define KVMIX_VERSION_STRING "0.2.0"

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
    KVMIX_ERR_INVALID_ARGUMENT = -2, /* a count, index or option is out of range, or the call is
                                        not allowed in the object's state */
    KVMIX_ERR_BAD_SHAPE = -3,        /* head_dim, group size or boost count not supported */
    KVMIX_ERR_UNKNOWN_FORMAT = -4,   /* a kvmix_format value that does not exist */
    KVMIX_ERR_BUFFER_TOO_SMALL = -5, /* a caller buffer is smaller than the size query says */
    KVMIX_ERR_BAD_VALUE = -6,        /* an input is NaN, infinite or beyond the FP16 range */
    KVMIX_ERR_OUT_OF_MEMORY = -7,    /* no room left: an allocator, a cache's arena, tables or job
                                        queue, or a bit budget that cannot hold the cheapest choice */
    KVMIX_ERR_UNSUPPORTED = -8,      /* valid, but not supported by this backend or build */
    KVMIX_ERR_CORRUPT_DATA = -9,     /* packed bytes, or cache bookkeeping, that no call could have
                                        written */
    KVMIX_ERR_VERSION = -10,         /* serialized input (a payload) of a version this build does
                                        not read */
    KVMIX_ERR_MALFORMED = -11,       /* serialized input that does not follow its documented byte
                                        layout (a payload's header or tier table) */
    KVMIX_ERR_NOT_FOUND = -12,       /* what was asked for does not exist (a name, an evicted
                                        position, a page) */
    KVMIX_ERR_CUDA = -13             /* the CUDA runtime reported an error */
} kvmix_result;

/* A static English description of a result; never NULL, also for unknown values. */
KVMIXDEF const char *kvmix_result_string(kvmix_result result);

/* Library version as "MAJOR.MINOR.PATCH" of the implementation that was compiled. */
KVMIXDEF const char *kvmix_version_string(void);

/* What a call that checks a caller's description (a cache desc, a layout, a view, a payload desc
   or head, a tier desc, a policy, an eviction policy, a tag spec or precision table, a session
   store desc, an allocation problem) or a size query's arguments found wrong: the field as the
   struct or the call spells it ("n_sink", "group_size", "n_tokens_per_seq"; "desc" for a NULL
   desc) and why, both static strings. Every such call takes a kvmix_error *out_error as its
   last parameter (NULL: not wanted) and fills it on every return: "" and "" on success. */
typedef struct kvmix_error {
    const char *field;
    const char *reason;
} kvmix_error;

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

/* The format's lowercase name ("fp16", "int8", "int4", "int2", "int2_channel", "boosted"), as
   policy documents spell it; "unknown" for a value that is not a kvmix_format. Never NULL. */
KVMIXDEF const char *kvmix_format_name(kvmix_format format);

#define KVMIX_GROUP_SIZE_DEFAULT 32
#define KVMIX_MAX_HEAD_DIM       512
#define KVMIX_MAX_BOOST          252 /* boosted channels of a block: slots fit a byte beside NONE */
#define KVMIX_BOOST_NONE         0xFF /* channel-to-slot index entry of a channel that is not boosted */

/* The shape of one block. Zero fields take defaults: group_size 0 means 32 (per-token formats).
   Constraints: head_dim a positive multiple of 8, at most KVMIX_MAX_HEAD_DIM; n_tokens >= 0;
   group_size (per-token integer formats) a multiple of 8 that divides head_dim (so the default
   32 needs a head_dim 32 divides: at 48 or 80 pass 16, or head_dim for one group a row);
   n_boost (BOOSTED only, else 0) a multiple of 4, at most head_dim and at most KVMIX_MAX_BOOST;
   0 means none boosted (every channel at 2 bits, with the index), as everywhere else. */
typedef struct kvmix_layout {
    kvmix_format format;
    int32_t n_tokens;
    int32_t head_dim;
    int32_t group_size;
    int32_t n_boost;
} kvmix_layout;

/* Checks a layout and writes it back with defaults resolved; *out_error (NULL: not wanted) names
   the field at fault ("layout" when NULL). Returns KVMIX_ERR_NULL_POINTER,
   KVMIX_ERR_UNKNOWN_FORMAT, KVMIX_ERR_INVALID_ARGUMENT (negative n_tokens) or
   KVMIX_ERR_BAD_SHAPE. */
KVMIXDEF kvmix_result kvmix_layout_resolve(kvmix_layout *layout, kvmix_error *out_error);

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
   first (FP16 rows, scales and minima finite, scales' sign bit clear, boost index a
   permutation of its slots): on
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
    kvmix_layout key_layout; /* n_tokens and head_dim must equal value_layout's */
    kvmix_layout value_layout;
    const void *keys;        /* kv head h's block starts at keys + h * key_head_bytes */
    const void *values;      /* kv head h's block starts at values + h * value_head_bytes */
    size_t key_head_bytes;   /* 0 = the key block's size (heads packed back to back) */
    size_t value_head_bytes; /* 0 = the value block's size */
    size_t keys_bytes;       /* readable bytes at keys, checked against the heads' extent */
    size_t values_bytes;
    const uint8_t *dead; /* [n_tokens], nonzero = the token is evicted and skipped; or NULL */
} kvmix_span;

typedef struct kvmix_attention_desc {
    int32_t n_q_heads; /* a multiple of n_kv_heads; q head i reads kv head i / (n_q / n_kv) */
    int32_t n_kv_heads;
    int32_t head_dim;
    float scale; /* softmax scale; 0 = 1 / sqrt(head_dim) */
} kvmix_attention_desc;

/* One decode step: out[h] = softmax(scale * q[h] . K^T) V over every live token of every span,
   lse[h] = log(sum over live tokens of exp(scale * q[h] . k)) (natural log). With no live token,
   out[h] is zero and lse[h] is -INFINITY. q, out: [n_q_heads][head_dim] floats; lse: [n_q_heads],
   or NULL when not wanted (out is the same either way). Validates everything (including the
   packed bytes) before writing. Thread-safe. */
KVMIXDEF kvmix_result kvmix_ref_attention_decode(const kvmix_attention_desc *desc, const float *q,
                                                 const kvmix_span *spans, int32_t n_spans,
                                                 float *out, float *lse);

/* Merges two partial results over disjoint token sets into the result over their union.
   out_*: [n_heads][head_dim], lse_*: [n_heads]; lse (the union's) may be NULL when not wanted.
   out/lse may alias a or b. */
KVMIXDEF kvmix_result kvmix_ref_attention_merge(int32_t n_heads, int32_t head_dim,
                                                const float *out_a, const float *lse_a,
                                                const float *out_b, const float *lse_b, float *out,
                                                float *lse);

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
    int32_t group_size;       /* of every per-token integer key block; 0 = 32 */
    int32_t value_group_size; /* of every per-token integer value block; 0 = group_size */
    int32_t n_boost;          /* of every BOOSTED block (0: none boosted) */
    int32_t n_spans;
    int32_t n_dead_flags;
    const uint8_t *base; /* blocks lie in [base, base + base_bytes) */
    size_t base_bytes;
    const kvmix_view_span *spans;  /* [n_spans], sequence after sequence */
    const int32_t *seq_first_span; /* [n_seqs + 1]: sequence s owns spans [first[s], first[s+1]) */
    const uint8_t *dead;           /* [n_dead_flags], nonzero = evicted token */
} kvmix_view;

/* Checks a host view's structure: counts, formats, sequence boundaries, block extents inside
   base_bytes, dead flag ranges. It reads spans, seq_first_span (not the blocks), so it needs
   host pointers. *out_error (NULL: not wanted) names the field of kvmix_view, or of the
   kvmix_view_span, at fault ("view" when NULL). Returns KVMIX_ERR_NULL_POINTER,
   INVALID_ARGUMENT, BAD_SHAPE, UNKNOWN_FORMAT or BUFFER_TOO_SMALL (a block outside the base
   region). */
KVMIXDEF kvmix_result kvmix_view_check(const kvmix_view *view, kvmix_error *out_error);

/* Decode attention for every sequence of a host view: q, out [n_seqs][n_q_heads][head_dim],
   lse [n_seqs][n_q_heads] or NULL when not wanted, as kvmix_ref_attention_decode per sequence;
   scale 0 = 1/sqrt(D). Validates the view and every packed block before writing. */
KVMIXDEF kvmix_result kvmix_ref_view_decode(const kvmix_view *view, int32_t n_q_heads, float scale,
                                            const float *q, float *out, float *lse);

/* Fast decode on the CPU: what kvmix_ref_view_decode computes, several times faster. Per kv
   head it reads each page's rows once for all the query heads that share them, decoding a tile
   of rows at a time in loops a compiler vectorizes (FP16 through F16C where the build or, in a
   dispatching build, the CPU has it),
   with a blockwise online softmax; the work is split into (sequence, kv head, range of at most
   KVMIX_DECODE_CHUNK_SPANS spans) tasks whose partial results are merged in a fixed order, so
   the result does not depend on how many threads ran it. It agrees with the reference within
   float rounding (tests/unit_fast_decode.c bounds the NMSE), not bit for bit.

   It checks the view's structure (kvmix_view_check: every block inside base_bytes), not the
   packed bytes inside the blocks (the reference does): a cache's own views hold what its seals
   wrote, and bytes no seal wrote give wrong numbers, never a read outside the blocks. Each task
   keeps about 48 KiB on its thread's stack (64 KiB where the build has AVX-512). */
#define KVMIX_DECODE_CHUNK_SPANS 16

/* The loops the fast decode runs in this build on this CPU: "avx512" (a build with AVX-512F,
   AVX2, FMA and F16C), "avx2" (a build with AVX2, FMA and F16C, or a GCC 5+ or Clang build for
   x86-64 on a CPU that has them, unless KVMIX_NO_CPU_DISPATCH, MSVC's headers or a CUDA source),
   else "portable". */
KVMIXDEF const char *kvmix_cpu_decode_loops(void);

/* Runs task(task_arg, i) once for every i in [0, n_tasks), on any threads, in any order, and
   returns when all have run: the caller's thread pool (an OpenMP parallel for, a job system). */
typedef void (*kvmix_task_fn)(void *task_arg, int32_t task);
typedef void (*kvmix_parallel_for_fn)(void *user, int32_t n_tasks, kvmix_task_fn task,
                                      void *task_arg);

/* How a fast decode runs: NULL, or n_threads 0 or 1 without parallel_for, is the calling thread
   alone. parallel_for, when set, runs the tasks (n_threads is then ignored); else n_threads > 1
   starts n_threads - 1 POSIX threads for the call, the calling thread being the last (where the
   build has no POSIX threads, or KVMIX_NO_THREADS is defined, the calling thread runs them all). */
typedef struct kvmix_parallel {
    int32_t n_threads;
    kvmix_parallel_for_fn parallel_for;
    void *user; /* passed to parallel_for */
} kvmix_parallel;

/* Workspace bytes of kvmix_view_decode on this view with n_q_heads query heads. Returns
   NULL_POINTER, kvmix_view_check's errors, or INVALID_ARGUMENT (n_q_heads not a positive multiple
   of n_kv_heads, more than size_t bytes). */
KVMIXDEF kvmix_result kvmix_view_decode_workspace(const kvmix_view *view, int32_t n_q_heads,
                                                  size_t *out_bytes);

/* Decode attention for every sequence of a host view, as kvmix_ref_view_decode (q, out
   [n_seqs][n_q_heads][head_dim], lse [n_seqs][n_q_heads] or NULL, scale 0 = 1/sqrt(head_dim)),
   fast and on as many threads as `parallel` gives. workspace: 8-byte aligned, at least
   kvmix_view_decode_workspace bytes. Returns NULL_POINTER, kvmix_view_check's errors,
   INVALID_ARGUMENT (n_q_heads, scale, parallel->n_threads negative, workspace not aligned) or
   BUFFER_TOO_SMALL (workspace_bytes); nothing is written on failure. */
KVMIXDEF kvmix_result kvmix_view_decode(const kvmix_view *view, int32_t n_q_heads, float scale,
                                        const float *q, float *out, float *lse, void *workspace,
                                        size_t workspace_bytes, const kvmix_parallel *parallel);

/* QueryMemory scores of sequence `seq` of a host view, for eviction: for each token t of the
   sequence (all spans in order, dead ones included), scores[t] = sum over q heads h of
   dot(memory[h], key_t of kv head h / (n_q_heads / n_kv_heads)), summed in float over heads,
   then channels; dead tokens score -INFINITY. memory: [n_q_heads][head_dim]; scores:
   [capacity_tokens]; tokens past capacity_tokens are not scored (as on the GPU, which cannot
   know a sequence's length ahead). Validates the view and the sequence's blocks first. */
KVMIXDEF kvmix_result kvmix_ref_view_score(const kvmix_view *view, int32_t seq, int32_t n_q_heads,
                                           const float *memory, float *scores,
                                           int32_t capacity_tokens);

/* Intent scores of sequence `seq` of a host view (one layer), for eviction: for each query head
   h, the softmax over the sequence's live tokens of scale * dot(memory[h], key_t) (key_t of kv
   head h / (n_q_heads / n_kv_heads), read in its stored format; scale 0 = 1/sqrt(head_dim)),
   summed over the heads: scores[t] in [0, n_q_heads], dead tokens -INFINITY. A caller sums
   the layers. memory: [n_q_heads][head_dim]; scores: [capacity_tokens]; tokens past
   capacity_tokens are left out, of the softmax too (pass the sequence's length). Validates as
   kvmix_ref_view_score; nothing is written on failure. */
KVMIXDEF kvmix_result kvmix_ref_view_intent_score(const kvmix_view *view, int32_t seq,
                                                  int32_t n_q_heads, float scale,
                                                  const float *memory, float *scores,
                                                  int32_t capacity_tokens);

/* The key features of the intent residual (kvmix_intent_residual_features) of sequence `seq` of
   a host view (one layer): for each token t of the sequence, key_norm[t] = the mean over kv heads
   of the L2 norm of t's key as stored, and readout[t] = the mean over query heads h of
   scale * dot(memory[h], key_t of kv head h / (n_q_heads / n_kv_heads)) (scale 0 =
   1/sqrt(head_dim)): kvmix_intent_readout of one query per head, whose softmax over queries is
   1. Sums in float over channels in order, then over heads; dead tokens get 0 in both. A caller
   averages the layers. memory: [n_q_heads][head_dim]; key_norm, readout: [capacity_tokens];
   tokens past capacity_tokens are left out. Validates as kvmix_ref_view_intent_score; nothing
   is written on failure. */
KVMIXDEF kvmix_result kvmix_ref_view_key_features(const kvmix_view *view, int32_t seq,
                                                  int32_t n_q_heads, float scale,
                                                  const float *memory, float *key_norm,
                                                  float *readout, int32_t capacity_tokens);

/* ------------------------------------------------------------------------------------------- */
/* Paged mixed-precision cache. One model shape (layers, kv heads, head_dim), one byte arena of    */
/* caller memory from which pages of every format are carved, sequences with page tables and slot */
/* maps, prefix sharing by reference count, eviction, re-tiering, views for attention. The design */
/* (page layout, buffer and window, sharing, fragmentation) is written out in the >>cache room.   */
/*                                                                                               */
/* A call that names a place takes it in the order sequence(s), layer, position: write(cache,     */
/* seq, layer, position, ...), read(cache, seq, layer, position, ...), view(cache, seqs, n_seqs,  */
/* layer, ...).                                                                                  */
/*                                                                                               */
/* Thread safety: one writer per cache. Functions that take a non-const kvmix_cache* must not run */
/* concurrently with any other call on the same cache; const ones may run together on any        */
/* threads. Distinct caches are independent.                                                     */

#define KVMIX_CACHE_DEAD_SLOT 0u /* slot-map value of an evicted position: the sentinel page */

typedef enum kvmix_cache_partial {
    KVMIX_CACHE_PARTIAL_DEFAULT = 0,   /* = KEEP_FP16 */
    KVMIX_CACHE_PARTIAL_KEEP_FP16 = 1, /* finish leaves a partial page as the FP16 buffer */
    KVMIX_CACHE_PARTIAL_QUANTIZE = 2   /* finish seals it in per-token formats (see >>cache) */
} kvmix_cache_partial;

typedef enum kvmix_cache_rows {
    KVMIX_CACHE_ROWS_ORIGINAL = 0, /* retier rows are the page's original K/V rows */
    KVMIX_CACHE_ROWS_RESIDUAL = 1  /* retier rows are added to the page's dequantized rows */
} kvmix_cache_rows;

/* The formats a token asks for (from any policy); each a kvmix_format, or 0 for that side of the
   cache's desc.default_precision: wherever a cache call takes a precision, {0, 0} means the
   default precision, {0, KVMIX_FORMAT_INT8} default keys and INT8 values. */
typedef struct kvmix_cache_precision {
    uint8_t key_format;
    uint8_t value_format;
} kvmix_cache_precision;

/* What a cache holds. Zero fields take defaults, and kvmix_cache_desc_resolve and the inits write
   the resolved values back. A zero count of things kept (n_sink, n_window, n_boost) means none;
   a zero size or capacity means the value its comment gives. Required: n_layers, n_kv_heads,
   head_dim. The defaults store like the built-in "int4" policy (pages of 32
   tokens, INT4 keys and values in groups of 32 channels, no sinks, no window) for one sequence
   of up to 4096 positions; kvmix_policy_apply writes another policy in.

   What a sequence holds: new rows land in an FP16 buffer page of page_tokens rows, allocated
   whole, and a page is quantized only once it is full (and older than the window). So a
   sequence shorter than a page is all FP16 at a page's bytes (a 10-token sequence with pages
   of 32 holds 32 FP16 rows: 51 bits per stored element), and a longer one keeps its last
   partial page (and the window) FP16; kvmix_cache_seq_stats_get counts all of it. */
typedef struct kvmix_cache_desc {
    int32_t n_layers;            /* 1 .. 4096 */
    int32_t n_kv_heads;          /* 1 .. 4096 */
    int32_t head_dim;            /* a multiple of 8, at most KVMIX_MAX_HEAD_DIM; group_size and
                                    value_group_size must divide it */
    int32_t page_tokens;         /* 0 = 32, the built-in policies' page; a multiple of 8 in
                                    8 .. 1024: tokens per page, over which per-channel keys
                                    take their statistics, and the FP16 buffer's size */
    int32_t max_seqs;            /* 0 = 1; live sequences at once, 1 .. 2^20 (each costs its
                                    slot map and page table in metadata, reserved up front) */
    int32_t max_tokens_per_seq;  /* 0 = 4096; positions per sequence, 1 .. 2^26 (4 bytes of
                                    slot map each, per sequence) */
    int32_t max_pages_per_seq;   /* 0 = ceil(max_tokens_per_seq / page_tokens) + 8 */
    int32_t n_sink;              /* first positions kept FP16 forever, 0 .. page_tokens; 0 = none */
    int32_t n_window;            /* most recent positions kept FP16, 0 .. max_tokens_per_seq;
                                    0 = none (the buffer page still fills in FP16) */
    int32_t window_values_only;  /* 0: the window keeps keys and values FP16; 1: values only,
                                    keys are sealed once their page is full (Kitty's layout) */
    int32_t group_size;          /* 0 = 32; of the per-token integer formats (keys, and values
                                    unless value_group_size is set) */
    int32_t value_group_size;    /* 0 = group_size; of the per-token integer value blocks */
    int32_t n_boost;             /* boosted channels of BOOSTED blocks, a multiple of 4 up to
                                    head_dim and 252; 0 = none, and then a BOOSTED precision is
                                    refused (BAD_SHAPE) */
    kvmix_cache_partial partial; /* what kvmix_cache_seq_finish does to a partial page;
                                    0 = KEEP_FP16 */
    kvmix_cache_precision
        default_precision; /* for NULL precisions and zero formats; {0, 0} = INT4 keys,
                              INT4 values */
    size_t arena_bytes;    /* bytes of the page arena (a multiple of granule_bytes is used, the
                              rest ignored); 0 = kvmix_cache_arena_bytes_for of max_seqs
                              sequences of max_tokens_per_seq positions */
    size_t granule_bytes;  /* 0 = 256; allocation unit of the arena, a power of two 64 .. 2^20 */
    int32_t device_arena;  /* 0: the arena is host memory that the calls write; 1: it is device
                              memory the host never touches: calls that move row bytes queue
                              jobs instead (see "Device arena" below) */
    int32_t max_jobs;      /* device arena: queued jobs between two kvmix_cache_jobs_take;
                              0 = 4 * n_layers * n_kv_heads * max_seqs, or what one compaction
                              run may queue, (2 * page_tokens + 1) * 2 * n_layers * n_kv_heads,
                              when more (at most 2^24) */
} kvmix_cache_desc;

/* A page descriptor (read-only for callers). Page 0 is the sentinel: it owns no bytes and is
   never freed; evicted positions point at it. */
typedef struct kvmix_cache_page {
    uint64_t offset;     /* bytes from the arena start */
    uint32_t n_granules; /* arena granules held; 0 for a free descriptor and the sentinel */
    int32_t refcount;    /* page-table entries that reference it; 0 = free */
    int32_t n_rows;      /* rows written (buffer) or rows of the packed blocks (sealed) */
    int32_t capacity;    /* rows an FP16 block is laid out for (its kv-head stride); = n_rows
                              for packed pages */
    uint8_t key_format;  /* storage formats (kvmix_format) */
    uint8_t value_format;
    uint8_t want_key; /* formats the page is sealed to: the highest precision its rows asked */
    uint8_t want_value;
    uint8_t sealed; /* 0: an FP16 buffer that accepts rows; 1: sealed */
    uint8_t sink;   /* holds sink positions (stays FP16 when sealed) */
    uint8_t closed; /* a buffer a new run closed: takes no rows, seals at capacity rows, the rows
                       past n_rows repeating its last one (dead in views) */
    uint8_t reserved;
    uint32_t run; /* the run of its rows (kvmix_cache_seq_set_run) */
} kvmix_cache_page;

/* One entry of a sequence's page table: rows [0, n_rows) of `page` hold positions first_pos ..
   first_pos + n_rows - 1 of the sequence (those the slot map still points at). A page that
   kvmix_cache_compact wrote (n_positions > 0) covers positions first_pos .. first_pos +
   n_positions - 1 instead, its n_rows rows holding those of them that were live then, in
   increasing order (the slot map says which row is whose). */
typedef struct kvmix_cache_entry {
    uint32_t page;
    int32_t first_pos;
    int32_t n_rows;
    int32_t n_positions; /* 0: n_rows (row = position - first_pos); > 0: a compacted page */
} kvmix_cache_entry;

typedef struct kvmix_cache_seq {
    int32_t in_use;
    int32_t n_tokens;    /* positions 0 .. n_tokens - 1 exist (reserved) */
    int32_t n_live;      /* of them, not evicted */
    int32_t n_entries;   /* page-table entries in use */
    int32_t n_written;   /* positions 0 .. n_written - 1 have rows on every layer */
    uint32_t run;        /* the run of the positions reserved next (kvmix_cache_seq_set_run) */
    int32_t view_from;   /* entries from this one on may have other spans than at the last
                          kvmix_cache_view_changes for the sequence */
    uint32_t view_epoch; /* the cache's view epoch at that call */
} kvmix_cache_seq;

#define KVMIX_CACHE_ERROR_BYTES 128 /* a cache's last-error message, its NUL included */

/* Where the arena's searches for free granules start, for the last sizes asked (private). */
typedef struct kvmix__fit_hints {
    int64_t size[8]; /* granules */
    int64_t at[8];   /* low end: no free run of size[k] starts below at[k]; high end: none ends
                        above it */
    int32_t next;    /* the slot a new size takes */
} kvmix__fit_hints;

typedef struct kvmix__arena_hints {
    int64_t first_free;    /* no free granule below it */
    int64_t last_free_end; /* no free granule at or above it */
    kvmix__fit_hints low;  /* first fit from the low end: pages that stay */
    kvmix__fit_hints high; /* last fit from the high end: pages that are freed again */
} kvmix__arena_hints;

/* The cache's own state: its memory, the granule allocator, the plan of one call, a device
   arena's queue. Private: nothing in it is promised from one version to the next; tests read it,
   callers never write it. */
typedef struct kvmix__cache_private {
    void *memory; /* the metadata memory (kvmix_cache_memory_bytes) */
    size_t memory_bytes;
    kvmix_allocator allocator; /* of kvmix_cache_init_allocator; owns_memory says whether used */
    int32_t owns_memory;
    int32_t n_free_pages; /* descriptors on the free stack */
    int32_t journal_capacity;
    int64_t n_granules; /* arena granules */
    int64_t n_free_granules;
    kvmix__arena_hints hints;
    uint32_t *free_pages; /* [max_pages] stack of free descriptors */
    uint64_t *bitmap;     /* [ceil(n_granules / 64)] one bit per used granule */
    float *scratch;       /* [page_tokens * head_dim] */
    void *sim;            /* planning state of one call */
    void *journal;        /* allocator operations of one call's plan */
    /* device arena only: queued jobs, arena released when they are taken */
    void *jobs;              /* [desc.max_jobs] */
    int32_t n_retired_runs;  /* granule runs of sealed buffers, held until the take */
    void *retired_runs;      /* [desc.max_jobs] */
    uint32_t *retired_pages; /* [max_pages] released descriptors, held until the take */
    int32_t n_retired_pages;
    uint32_t segment;              /* jobs of one segment run in any order; segments in order */
    uint32_t *page_segment;        /* [max_pages][2] the segments that last wrote, read each page */
    size_t full_block_bytes[2][8]; /* [is_value][format] of a block of page_tokens rows */
    uint32_t view_epoch; /* moves when a change reaches every sequence that shares a page */
    char error[KVMIX_CACHE_ERROR_BYTES]; /* kvmix_cache_last_error */
} kvmix__cache_private;

/* A cache. Transparent so that tests and tools can read its tables; change it only through the
   functions below. Everything it points at lives in the metadata memory and the arena. */
typedef struct kvmix_cache {
    kvmix_cache_desc desc;      /* resolved */
    uint8_t *arena;             /* desc.arena_bytes; views use it as base */
    int32_t max_pages;          /* page descriptors, the sentinel included */
    int32_t n_jobs;             /* device arena: jobs queued (kvmix_cache_jobs_take) */
    kvmix_cache_seq *seqs;      /* [max_seqs] */
    kvmix_cache_entry *entries; /* [max_seqs][max_pages_per_seq] */
    uint32_t *slots;            /* [max_seqs][max_tokens_per_seq]: page * page_tokens + row */
    int32_t *written;           /* [max_seqs][n_layers]: positions 0 .. written - 1 of the
                                     layer have rows (kvmix_cache_write) */
    kvmix_cache_page *pages;    /* [max_pages] */
    kvmix__cache_private priv;  /* the implementation's own state: not for callers */
} kvmix_cache;

/* Accounting of a whole cache. Bytes per format count key blocks under the key format and value
   blocks under the value format; FP16 buffers count their whole allocation (unused rows too). */
typedef struct kvmix_cache_stats {
    size_t arena_bytes;      /* usable: n_granules * granule_bytes */
    size_t arena_used_bytes; /* granules held by pages */
    size_t arena_free_bytes;
    size_t largest_free_bytes; /* the largest run of free granules (fragmentation) */
    size_t metadata_bytes;     /* the metadata memory: tables, slot maps, free lists, scratch */
    size_t format_bytes[8];    /* indexed by kvmix_format; [0] = allocation padding */
    int32_t n_seqs;
    int32_t n_pages;               /* live page descriptors */
    int32_t n_shared_pages;        /* of them, referenced more than once */
    int32_t n_buffer_pages;        /* of them, FP16 buffers not sealed yet */
    int64_t n_tokens;              /* positions, summed over sequences */
    int64_t n_live_tokens;         /* not evicted, summed over sequences */
    double arena_bits_per_element; /* arena_used_bytes * 8 / (live tokens * L * H * D * 2) */
    double bits_per_element;       /* (arena_used_bytes + metadata_bytes) * 8 / the same */
} kvmix_cache_stats;

/* Accounting of one sequence. Shared pages are attributed in equal shares to their sharers. */
typedef struct kvmix_cache_seq_stats {
    int32_t n_tokens;
    int32_t n_live_tokens;
    int32_t n_pages;           /* referenced pages */
    int32_t n_shared_pages;    /* of them, also referenced by another sequence */
    int32_t n_fp16_rows;       /* live positions stored in FP16 (sinks, window, buffer) */
    int32_t n_fp16_key_rows;   /* live positions whose keys are FP16 (n_fp16_rows among them) */
    int32_t n_fp16_value_rows; /* live positions whose values are FP16 (a values-only window's
                                  too) */
    int32_t n_packed_rows;     /* live positions in sealed pages other than the sinks': what a
                                  policy's formats hold (not the window and buffer) */
    size_t referenced_bytes;   /* arena bytes of every page it references */
    size_t metadata_bytes;     /* its slot map, page table and sequence record */
    double attributed_bytes;   /* sum of page bytes / refcount, plus metadata_bytes */
    double bits_per_element;   /* attributed_bytes * 8 / (live tokens * L * H * D * 2) */
    double packed_bytes;       /* the attributed bytes of those sealed pages */
    double packed_bits_per_element; /* packed_bytes * 8 / (n_packed_rows * L * H * D * 2) */
    size_t format_bytes[8];         /* of the referenced pages, as in kvmix_cache_stats */
} kvmix_cache_seq_stats;

/* Checks a desc and writes it back with defaults resolved; on failure *desc is unchanged and
   *out_error names the field and says why. arena_bytes 0 resolves to
   kvmix_cache_arena_bytes_for(desc, max_seqs, max_tokens_per_seq): every sequence at its
   longest in default_precision, so a desc can be sized before its arena is chosen (resolve,
   allocate desc.arena_bytes, init with the resolved desc). Returns KVMIX_ERR_NULL_POINTER,
   INVALID_ARGUMENT (a count or option out of range, sizes that overflow), BAD_SHAPE (head_dim,
   group_size, n_boost) or UNKNOWN_FORMAT (default_precision). Pure, thread-safe. */
KVMIXDEF kvmix_result kvmix_cache_desc_resolve(kvmix_cache_desc *desc, kvmix_error *out_error);

/* Bytes of metadata memory a cache of this desc needs (the arena is separate: desc.arena_bytes,
   0 resolved as kvmix_cache_desc_resolve does). Returns NULL_POINTER or
   kvmix_cache_desc_resolve's errors, *out_error naming the field. */
KVMIXDEF kvmix_result kvmix_cache_memory_bytes(const kvmix_cache_desc *desc, size_t *out_bytes,
                                               kvmix_error *out_error);

/* Arena bytes (for desc.arena_bytes, which is not read) that hold n_seqs sequences of
   n_tokens_per_seq positions each, stored in desc.default_precision, from the first reserve to
   the last write. It is every sequence at the most it holds while it grows (the sink page,
   sealed pages, the FP16 buffer pages of the window and the one being filled, key-sealed pages
   of a values-only window, each rounded up to granules), plus once the peak of a page boundary:
   the reserve that starts a page takes the next FP16 buffer page, then seals an older one and
   holds its FP16 and its sealed bytes until the seal is done, so an arena of the steady-state
   bytes fails there. It is exact (one granule less can fail) for rows written by reserve and
   write, ingest or append, with the sequences taking turns (as a batched decode does) or
   filling one after another; at random interleavings too, except with a values-only window,
   whose key-sealed pages can leave gaps between buffer pages (allow a buffer page per sequence
   more). More precise per-token formats, forks (a copy on write takes a buffer page), partial
   pages sealed at a request boundary and re-tiering need more. A device arena holds what its
   jobs free until kvmix_cache_jobs_take: take them after every reserve. Returns NULL_POINTER,
   kvmix_cache_desc_resolve's errors or INVALID_ARGUMENT (n_seqs beyond max_seqs,
   n_tokens_per_seq beyond max_tokens_per_seq, more bytes than size_t counts), *out_error
   naming the desc field or the argument ("n_seqs", "n_tokens_per_seq"). */
KVMIXDEF kvmix_result kvmix_cache_arena_bytes_for(const kvmix_cache_desc *desc, int32_t n_seqs,
                                                  int32_t n_tokens_per_seq, size_t *out_bytes,
                                                  kvmix_error *out_error);

/* Initializes a cache into caller memory: `memory` (8-byte aligned, memory_bytes at least the
   size query) for all bookkeeping and `arena` (desc->arena_bytes) for pages. Both stay owned by
   the caller and must outlive the cache; nothing else is allocated, ever. Writes the resolved
   desc back (with arena_bytes 0, the arena must hold what kvmix_cache_desc_resolve resolves it
   to). Returns desc errors, NULL_POINTER, INVALID_ARGUMENT (misaligned memory) or
   BUFFER_TOO_SMALL; *out_error names the desc field ("n_sink") or the argument ("memory_bytes"),
   as the cache's last error does ("desc.n_sink: ..."). */
KVMIXDEF kvmix_result kvmix_cache_init(kvmix_cache *cache, kvmix_cache_desc *desc, void *memory,
                                       size_t memory_bytes, void *arena, kvmix_error *out_error);

/* As kvmix_cache_init, with the metadata memory and the arena taken from `allocator` (NULL =
   KVMIX_MALLOC); arena_bytes 0 allocates what kvmix_cache_desc_resolve resolves it to. Returns
   OUT_OF_MEMORY when the allocator fails (field "allocator"). */
KVMIXDEF kvmix_result kvmix_cache_init_allocator(kvmix_cache *cache, kvmix_cache_desc *desc,
                                                 const kvmix_allocator *allocator,
                                                 kvmix_error *out_error);

/* Releases what kvmix_cache_init_allocator allocated (nothing for kvmix_cache_init) and zeroes
   the struct. NULL is ignored. */
KVMIXDEF void kvmix_cache_deinit(kvmix_cache *cache);

/* Why the last call on this cache that records failed, as "argument: why" (for example
   "first_position: its positions are not reserved yet (kvmix_cache_reserve first)", or
   "desc.n_sink: must be in 0 .. page_tokens" from an init); "" when that call succeeded. Every
   function that takes a non-const kvmix_cache records, the inits included (a failed init writes
   only the message into *cache); apart from the message a failed call changes nothing. Functions
   that take a const cache do not record, so that they may run concurrently: their failures
   leave the message as it was. The message lives in the cache until its next recording call;
   the library never prints it. Never NULL (a static message for a NULL cache). */
KVMIXDEF const char *kvmix_cache_last_error(const kvmix_cache *cache);

/* Creates an empty sequence; *out_seq receives its id in [0, max_seqs).
   Returns OUT_OF_MEMORY when max_seqs sequences are live. */
KVMIXDEF kvmix_result kvmix_cache_seq_create(kvmix_cache *cache, int32_t *out_seq);

/* Creates a sequence whose positions 0 .. n_prefix - 1 are those of `parent` (0 <= n_prefix <=
   parent's n_written: rows written on every layer): pages are shared by reference count,
   slot-map entries copied (positions the parent evicted stay evicted in the child; later
   evictions are private). A shared buffer page is copied when either sequence adds positions to
   it. Never allocates arena bytes. */
KVMIXDEF kvmix_result kvmix_cache_seq_fork(kvmix_cache *cache, int32_t parent, int32_t n_prefix,
                                           int32_t *out_seq);

/* Frees a sequence: pages that no other sequence references return to the arena. */
KVMIXDEF kvmix_result kvmix_cache_seq_free(kvmix_cache *cache, int32_t seq);

/* Writing rows. A position first exists (kvmix_cache_reserve), then gets its rows layer by layer
   (kvmix_cache_write), as an inference loop computes them: reserve the step's tokens, then after
   layer l has computed their K/V, write layer l and run its attention, which sees them.
   kvmix_cache_ingest and kvmix_cache_append do both for every layer in one call.

   Per layer, rows are written in position order without gaps: a sequence keeps, per layer, the
   count of positions written (cache->written) and n_written, the count written on every layer.
   Positions reserved but not yet written on a layer are invisible on that layer: kvmix_cache_read
   refuses them and views of the layer (so decode) end before them; views of other layers are not
   affected. Sealing rule: a page is sealed only when all its positions are below n_written, that
   is written on every layer; sealing happens in reserve, ingest, append and finish, never in write,
   so rows written after the reserve that took their page are sealed by a later call.
   Positions past n_written can be neither evicted nor forked from. */

/* Appends n_tokens positions (n_tokens, n_tokens + 1, ...) to a sequence without rows: slot map,
   page table and FP16 buffer rows (allocated, copy on write of a shared buffer page done), to be
   filled by kvmix_cache_write on every layer. precisions: [n_tokens] requested formats (NULL =
   desc.default_precision for all, a zero format its side of it); sink positions are FP16
   whatever they ask. Pages that became sealable (see the sealing rule above; only positions
   written before this call count) are sealed on the way. *out_first_position (may be NULL)
   receives the first new position. n_tokens 0 does nothing. Returns NULL_POINTER,
   INVALID_ARGUMENT (seq, n_tokens beyond max_tokens_per_seq), UNKNOWN_FORMAT, BAD_SHAPE (BOOSTED
   asked while desc.n_boost is 0), or OUT_OF_MEMORY (arena, page table or descriptors full),
   leaving the cache exactly as before. */
KVMIXDEF kvmix_result kvmix_cache_reserve(kvmix_cache *cache, int32_t seq, int32_t n_tokens,
                                          const kvmix_cache_precision *precisions,
                                          int32_t *out_first_position);

/* Writes layer `layer`'s rows of positions first_position .. first_position + n_tokens - 1 of a
   sequence into its FP16 buffer. keys, values: [n_tokens][n_kv_heads][head_dim] floats, each
   finite with |x| <= 65504. first_position may not exceed the layer's written count (no gaps) and
   the positions must be reserved; a position already written may be written again while its page
   is an unsealed FP16 buffer (its keys not sealed either) that only this sequence references and
   it is not evicted. Never
   allocates, never seals. Returns NULL_POINTER, INVALID_ARGUMENT (seq, layer, a position out of
   range, a gap, a rewrite of a sealed, shared or evicted row) or BAD_VALUE; nothing is written
   on error. n_tokens 0 does nothing. Thread safety: as every non-const call, not concurrently
   with any other call on the cache, writes of other layers or sequences included. */
KVMIXDEF kvmix_result kvmix_cache_write(kvmix_cache *cache, int32_t seq, int32_t layer,
                                        int32_t first_position, int32_t n_tokens, const float *keys,
                                        const float *values);

/* Appends n_tokens positions with their rows on every layer: kvmix_cache_reserve and
   kvmix_cache_write of every layer in one call, except that the new rows count as written for
   the sealing of this very call (a prefill seals the pages it fills). keys, values:
   [n_layers][n_tokens][n_kv_heads][head_dim] floats, each finite with |x| <= 65504 (else
   BAD_VALUE). precisions as kvmix_cache_reserve. Rows go to the sequence's FP16 buffer page;
   pages that are full and older than the window are sealed (quantized) on the way. Returns
   NULL_POINTER, INVALID_ARGUMENT (seq, n_tokens beyond max_tokens_per_seq, a reserved position
   not written on every layer yet), UNKNOWN_FORMAT, BAD_SHAPE, BAD_VALUE, or OUT_OF_MEMORY
   (arena, page table or descriptors full), leaving the cache exactly as before. */
KVMIXDEF kvmix_result kvmix_cache_ingest(kvmix_cache *cache, int32_t seq, int32_t n_tokens,
                                         const float *keys, const float *values,
                                         const kvmix_cache_precision *precisions);

/* One decode step: kvmix_cache_ingest of one token. keys, values: [n_layers][n_kv_heads][head_dim].
   precision as one of kvmix_cache_reserve's: {0, 0} stores it in desc.default_precision. */
KVMIXDEF kvmix_result kvmix_cache_append(kvmix_cache *cache, int32_t seq, const float *keys,
                                         const float *values, kvmix_cache_precision precision);

/* Seals what the next kvmix_cache_reserve would seal first (full pages whose positions are
   written on every layer and left the window), adding no position: for a loop that writes rows
   in bulk and wants them packed before it stops. Returns NULL_POINTER, INVALID_ARGUMENT (seq) or
   OUT_OF_MEMORY, leaving the cache exactly as before. */
KVMIXDEF kvmix_result kvmix_cache_seal_ready(kvmix_cache *cache, int32_t seq);

/* Ends a request: seals every full buffer page it does not share, whatever the window, then
   applies desc.partial to its partial last page if not shared; pages with positions not written
   on every layer are left as they are. The sequence stays usable (later rows start a new page if
   the last one was sealed). Returns NULL_POINTER, INVALID_ARGUMENT (seq) or OUT_OF_MEMORY,
   leaving the cache exactly as before. */
KVMIXDEF kvmix_result kvmix_cache_seq_finish(kvmix_cache *cache, int32_t seq);

/* Sets the run of the positions the sequence reserves from now on (reserve, ingest, append; 0 at
   creation, a fork's child takes its parent's). A page holds one run: the first position of a
   run that differs from the rows of the buffer page being filled closes that page at its rows
   (its FP16 bytes move to an allocation of just them, a copy; it then seals as a full page would)
   and opens a new one. Runs let pages hold tokens whose precision will age alike, so that each
   page is stored in what its tokens ask for (kvmix_policy_token_run gives a tag's); with one run
   throughout (0), pages fill whatever the formats and seal in the highest precision their rows
   ask for. The sink page ignores runs. Returns NULL_POINTER or INVALID_ARGUMENT (seq). */
KVMIXDEF kvmix_result kvmix_cache_seq_set_run(kvmix_cache *cache, int32_t seq, uint32_t run);

/* Evicts positions (each in [0, n_written); repeats and already evicted ones are fine): their
   slot-map entries become KVMIX_CACHE_DEAD_SLOT, no row moves. A page none of whose rows the
   sequence still uses is released (returned to the arena when no one else references it), except
   the buffer page that is still being filled. Validates all positions before changing anything. */
KVMIXDEF kvmix_result kvmix_cache_evict(kvmix_cache *cache, int32_t seq, const int32_t *positions,
                                        int32_t n_positions);

/* Rewinds a sequence: keeps positions 0 .. n_tokens - 1 and drops the rest (a loop that
   regenerates from a position, a chat that edits its last turn, rejected speculative tokens),
   as if they had never been reserved; the next reserve continues at position n_tokens. Pages
   holding only dropped positions are released (returned to the arena when no one else
   references them). The page that holds position n_tokens - 1 and later ones is cut there:
     - shared with another sequence (a fork's prefix): never written; this sequence uses fewer
       of its rows, and a later reserve copies those (copy on write) as after a fork;
     - an FP16 buffer (the sink page, the page being filled, the window): it forgets the rows
       past the cut and takes new rows there;
     - sealed FP16 (sealed by flag: its bytes are still rows): it reopens as the buffer;
     - sealed in a packed format (or its keys sealed in a values-only window): its rows stay
       and the cut ones are dead in views, as a fork's inside a sealed page; new positions start
       a new page. Packed rows cannot take more rows, and reopening would dequantize and later
       requantize the kept rows, changing what attention saw.
   Positions stay where they were (rotary phases hold). The FP16 rows of a fresh sequence fed
   the same tokens are the same bits, so are per-token formats once their pages are sealed
   alike; per-channel key blocks (INT2_CHANNEL, BOOSTED) keep the scales of the rows they were
   sealed with. A page keeps the highest precision its rows asked for, the dropped ones'
   included, and sealed pages stay sealed: the window refills as tokens come. Views report the
   cut entry on (kvmix_cache_view_changes). Never allocates, never moves a byte (a device arena
   queues no job), so it cannot run out of memory. n_tokens equal to the sequence's does
   nothing. Returns NULL_POINTER or INVALID_ARGUMENT (seq, n_tokens not in 0 .. the sequence's
   positions), changing nothing. */
KVMIXDEF kvmix_result kvmix_cache_seq_truncate(kvmix_cache *cache, int32_t seq, int32_t n_tokens);

/* Gives back what scattered evictions hold: the sequence's sealed pages that no one else
   references (shared pages never move; nor do the sinks' page and FP16 buffers) and whose live
   rows are at most max_live_fraction (0, 1] of their rows are compacted. Runs of consecutive such
   pages of the same formats have their survivors' rows moved, in position order, into a new page
   of those formats that holds just them (rows rounded up to a multiple of 8 that repeat the last
   survivor and no position uses; up to page_tokens), when that takes fewer granules, and are
   released. Positions, and so their rotary phase, stay: views, reads and eviction see the
   same positions (kvmix_cache_entry says how a compacted page covers them). FP16 and per-token
   rows move byte for byte; per-channel key blocks (INT2_CHANNEL, BOOSTED) are dequantized, rounded
   to FP16 and quantized again over their new rows (new channel scales). A device arena queues
   COPY jobs and, for per-channel blocks, the gather into transient FP16 rows (DEQUANTIZE) and the
   packing (QUANTIZE). A run with no room (arena, page descriptors, the job queue) stays as it is:
   nothing needs compaction to be correct, and a device arena's caller may take the jobs and call
   again (a run needs up to (2 * page_tokens + 1) * 2 * n_layers * n_kv_heads jobs: a desc.max_jobs
   below that leaves runs a host arena would compact). *out_bytes_freed (may be NULL): arena bytes released (on a device arena once the jobs
   are taken). Returns NULL_POINTER, INVALID_ARGUMENT (seq, max_live_fraction). */
KVMIXDEF kvmix_result kvmix_cache_compact(kvmix_cache *cache, int32_t seq, double max_live_fraction,
                                          size_t *out_bytes_freed);

/* Rewrites the sealed page that holds `position` of `seq` in `precision` (a zero format: that
   side of desc.default_precision), keeping its page id and every slot map (all sequences
   sharing the page see the new formats). keys, values: NULL, or
   [n_layers][n_rows][n_kv_heads][head_dim] for the page's n_rows (kvmix_cache_page): NULL
   requantizes from the dequantized rows (demotion); rows given are the originals or residuals
   added to the dequantized rows (upgrade). Without rows the page is requantized from its rows
   dequantized and rounded to FP16 (what a device arena's gather yields; a device arena takes only
   this form). A page whose new blocks are no larger is rewritten in its own bytes (a host arena's
   demotion needs no free arena; a device arena's takes an FP16 staging page, held until the
   take, and 4 * n_layers * n_kv_heads jobs); a larger one moves to a new allocation.
   Returns NOT_FOUND (no page holds the position), INVALID_ARGUMENT (page not sealed yet, bad
   rows mode), UNKNOWN_FORMAT, BAD_SHAPE, BAD_VALUE, OUT_OF_MEMORY; the cache is unchanged on
   error. */
KVMIXDEF kvmix_result kvmix_cache_retier(kvmix_cache *cache, int32_t seq, int32_t position,
                                         kvmix_cache_precision precision, const float *keys,
                                         const float *values, kvmix_cache_rows rows);

/* What position `position` of a sequence now asks to be stored in, for kvmix_cache_seq_age:
   *out is written (a zero format: nothing asked, that side stays as it is); a result other than
   KVMIX_SUCCESS refuses the call. Called once or more per live position, in any order: the same
   position must get the same answer within one call. */
typedef kvmix_result (*kvmix_cache_position_wants)(void *ctx, int32_t position,
                                                   kvmix_cache_precision *out);

/* Ages a sequence's stored precision to what its positions now ask for (`wants`), as a loop does
   when a new turn makes older tokens less important. For every page the sequence alone references
   (sinks excepted), the highest precision its live positions ask for, per side, becomes its
   formats wherever it is lower: a sealed page is re-tiered down to it in its own bytes
   (kvmix_cache_retier without rows), an FP16 buffer page will be sealed to it. Precision never
   rises (bytes a demotion dropped do not come back), and a page whose lower formats would take
   more bytes (per-channel metadata over a few rows) keeps its own; shared pages are left as they
   are: they belong to every sharer. A device arena queues each page's gather and packing through
   one FP16 staging page. *out_pages (may be NULL): sealed pages re-tiered. Returns NULL_POINTER,
   INVALID_ARGUMENT (seq), the first result `wants` refused with, UNKNOWN_FORMAT (an answer the
   cache cannot store), or OUT_OF_MEMORY (a device arena without room for the staging or the jobs:
   take the jobs and call again); nothing changes on error. */
KVMIXDEF kvmix_result kvmix_cache_seq_age(kvmix_cache *cache, int32_t seq,
                                          kvmix_cache_position_wants wants, void *ctx,
                                          int32_t *out_pages);

/* The slot of a position: page * page_tokens + row, or KVMIX_CACHE_DEAD_SLOT when evicted. */
KVMIXDEF kvmix_result kvmix_cache_locate(const kvmix_cache *cache, int32_t seq, int32_t position,
                                         uint32_t *out_slot);

/* Reads back one position of one layer, dequantized: keys, values [n_kv_heads][head_dim] (either
   may be NULL), and the storage formats when out_precision is not NULL.
   Returns NOT_FOUND for an evicted position and INVALID_ARGUMENT for one not written on that
   layer yet (nothing written to the outputs). */
KVMIXDEF kvmix_result kvmix_cache_read(const kvmix_cache *cache, int32_t seq, int32_t layer,
                                       int32_t position, float *keys, float *values,
                                       kvmix_cache_precision *out_precision);

/* Sizes of a view of these sequences: enough for every layer (exact when every reserved
   position is written; a layer with reserved positions not written yet may need less). */
KVMIXDEF kvmix_result kvmix_cache_view_counts(const kvmix_cache *cache, const int32_t *seqs,
                                              int32_t n_seqs, int32_t *out_n_spans,
                                              int32_t *out_n_dead_flags);

/* Fills a view of layer `layer` for sequences seqs[0 .. n_seqs - 1] into caller arrays: spans
   [max_spans], seq_first_span [n_seqs + 1], dead [max_dead_flags] (sizes from
   kvmix_cache_view_counts). base is the arena, offsets are from it, so the same view describes a
   device copy of the arena. Each page a sequence references is one span (its blocks: one per kv
   head, strided by the head bytes); rows the sequence does not use (evicted, past its fork point)
   are dead flags. A sequence's span of an FP16 page ends at the positions the layer has rows for
   (reserved positions not written on the layer are left out). The view stays valid until the
   next call that changes the cache. A page lays its layers out one after another: where two
   layers have the same positions written, layer l's spans are layer 0's with both offsets
   moved by l * n_kv_heads * (key_head_bytes + value_head_bytes), so a GPU loop may build one
   view per step and move it to each layer on the device. */
KVMIXDEF kvmix_result kvmix_cache_view(const kvmix_cache *cache, const int32_t *seqs,
                                       int32_t n_seqs, int32_t layer, kvmix_view_span *spans,
                                       int32_t max_spans, int32_t *seq_first_span, uint8_t *dead,
                                       int32_t max_dead_flags, kvmix_view *out_view);

/* Incremental views, for a loop that keeps each sequence's spans from one step to the next (a
   view costs O(pages) where a decode step changes a few spans at the end of each sequence).
   *out_first_entry = the first page-table entry of `seq` whose span, on any layer, may differ
   from the one it had at the previous call for `seq`: 0 at the first call, and after an
   eviction, a compaction, or a seal or retier of a page that other sequences share. The next
   call counts from this one. Returns NULL_POINTER or INVALID_ARGUMENT (seq). */
KVMIXDEF kvmix_result kvmix_cache_view_changes(kvmix_cache *cache, int32_t seq,
                                               int32_t *out_first_entry);

/* The spans of sequence seq in kvmix_cache_view's view of `layer`, from page-table entry
   first_entry on: span j is entry first_entry + j, up to the first entry the layer has no rows
   of yet (the entries after it have none either). Dead flags of spans with rows the sequence
   does not use go to dead[0 ..], their dead_index counted from dead_first (the index dead[0] has
   in the whole view's array). *out_n_spans and *out_n_dead_flags say what was written.
   Returns NULL_POINTER, INVALID_ARGUMENT (seq, layer, first_entry not in 0 .. n_entries, a
   negative size or dead_first) or BUFFER_TOO_SMALL (nothing written). */
KVMIXDEF kvmix_result kvmix_cache_view_seq(const kvmix_cache *cache, int32_t seq, int32_t layer,
                                           int32_t first_entry, kvmix_view_span *spans,
                                           int32_t max_spans, uint8_t *dead, int32_t max_dead_flags,
                                           int32_t dead_first, int32_t *out_n_spans,
                                           int32_t *out_n_dead_flags);

/* The position of each token that kvmix_cache_view lists for sequence `seq` on layer `layer`, in
   the view's order (the index a view's per-token output, such as kvmix_ref_view_intent_score's
   scores, has): positions [capacity], *out_n of them; -1 for a row the sequence does not use (a
   shared page's rows past its fork point). Evicted positions still listed keep their position.
   Returns NULL_POINTER, INVALID_ARGUMENT (seq, layer) or BUFFER_TOO_SMALL (nothing written). */
KVMIXDEF kvmix_result kvmix_cache_view_positions(const kvmix_cache *cache, int32_t seq,
                                                 int32_t layer, int32_t *positions,
                                                 int32_t capacity, int32_t *out_n);

/* Workspace bytes of kvmix_cache_ref_decode for these sequences as they are now; it grows with
   them (kvmix_cache_ref_decode_workspace_max bounds it). */
KVMIXDEF kvmix_result kvmix_cache_ref_decode_workspace(const kvmix_cache *cache,
                                                       const int32_t *seqs, int32_t n_seqs,
                                                       size_t *out_bytes);

/* The most workspace kvmix_cache_ref_decode can need for n_seqs (0 .. max_seqs) sequences of a
   cache of this desc, whatever they hold: a sequence's view has at most max_pages_per_seq spans
   and page_tokens dead flags per span. It is at least kvmix_cache_ref_decode_workspace of any
   n_seqs sequences of such a cache, so a loop allocates it once. Returns NULL_POINTER,
   kvmix_cache_desc_resolve's errors or INVALID_ARGUMENT (n_seqs, more than size_t bytes), with
   *out_error naming the field. */
KVMIXDEF kvmix_result kvmix_cache_ref_decode_workspace_max(const kvmix_cache_desc *desc,
                                                           int32_t n_seqs, size_t *out_bytes,
                                                           kvmix_error *out_error);

/* CPU reference decode step of layer `layer` over cached sequences: builds the view in
   `workspace` (8-byte aligned) and runs kvmix_ref_view_decode. q, out
   [n_seqs][n_q_heads][head_dim], lse [n_seqs][n_q_heads] or NULL when not wanted; scale 0 =
   1/sqrt(head_dim).
   It changes nothing in the cache but records why it failed (kvmix_cache_last_error), so it
   takes a non-const cache and must not overlap other calls on it; to decode on many threads at
   once, build views (kvmix_cache_view) and run kvmix_ref_view_decode on them. */
KVMIXDEF kvmix_result kvmix_cache_ref_decode(kvmix_cache *cache, const int32_t *seqs,
                                             int32_t n_seqs, int32_t layer, int32_t n_q_heads,
                                             float scale, const float *q, float *out, float *lse,
                                             void *workspace, size_t workspace_bytes);

/* Workspace bytes of kvmix_cache_decode for these sequences as they are now, with n_q_heads
   query heads; it grows with them (kvmix_cache_decode_workspace_max bounds it). */
KVMIXDEF kvmix_result kvmix_cache_decode_workspace(const kvmix_cache *cache, const int32_t *seqs,
                                                   int32_t n_seqs, int32_t n_q_heads,
                                                   size_t *out_bytes);

/* The most workspace kvmix_cache_decode can need for n_seqs (0 .. max_seqs) sequences of a cache
   of this desc with n_q_heads query heads, whatever they hold, so a loop allocates it once.
   Returns NULL_POINTER, kvmix_cache_desc_resolve's errors or INVALID_ARGUMENT (n_seqs,
   n_q_heads, more than size_t bytes), with *out_error naming the field. */
KVMIXDEF kvmix_result kvmix_cache_decode_workspace_max(const kvmix_cache_desc *desc, int32_t n_seqs,
                                                       int32_t n_q_heads, size_t *out_bytes,
                                                       kvmix_error *out_error);

/* The fast decode step of layer `layer` over cached sequences: kvmix_cache_ref_decode's
   arguments and result, plus how to run in parallel (see kvmix_view_decode; NULL: the calling
   thread). It builds the view in `workspace` (kvmix_cache_decode_workspace bytes, 8-byte
   aligned) and runs kvmix_view_decode on it. Like the reference it changes nothing in the cache
   but records why it failed, so it must not overlap other calls on the cache; its own tasks
   read the cache on the threads `parallel` gives. */
KVMIXDEF kvmix_result kvmix_cache_decode(kvmix_cache *cache, const int32_t *seqs, int32_t n_seqs,
                                         int32_t layer, int32_t n_q_heads, float scale,
                                         const float *q, float *out, float *lse, void *workspace,
                                         size_t workspace_bytes, const kvmix_parallel *parallel);

KVMIXDEF kvmix_result kvmix_cache_stats_get(const kvmix_cache *cache, kvmix_cache_stats *out);
KVMIXDEF kvmix_result kvmix_cache_seq_stats_get(const kvmix_cache *cache, int32_t seq,
                                                kvmix_cache_seq_stats *out);

/* What a token stored in `precision` costs in a full sealed page of this cache: the page's
   arena bytes (blocks, their metadata, granule padding) in bits per key/value element, the
   figure packed_bits_per_element (kvmix_cache_seq_stats) reaches when every page is full and
   holds one precision. Returns NULL_POINTER, UNKNOWN_FORMAT or BAD_SHAPE (BOOSTED without
   boosted channels). Pure. */
KVMIXDEF kvmix_result kvmix_cache_precision_bits(const kvmix_cache *cache,
                                                 kvmix_cache_precision precision, double *out_bits);

/* The same for a sealed page that holds `rows` rows, 1 .. page_tokens, in bits per element of
   those rows: below page_tokens it is a page a new run closed (kvmix_cache_seq_set_run), whose
   rows round up to a multiple of 8 and whose per-channel statistics cover them alone, so a
   short run costs more per token than a full page. What a tag allocation prices a tag's runs
   at (kvmix_alloc_problem.tag_bits). Returns precision_bits' errors and INVALID_ARGUMENT (rows
   out of range). Pure. */
KVMIXDEF kvmix_result kvmix_cache_page_bits(const kvmix_cache *cache,
                                            kvmix_cache_precision precision, int32_t rows,
                                            double *out_bits);

/* Device arena (desc.device_arena = 1). The arena passed to kvmix_cache_init is a device pointer
   that the host never dereferences (views use it as base, so they describe device memory). The
   host keeps all bookkeeping as in a host arena; every call that would touch row bytes queues
   jobs instead, which the caller runs in order on one stream (kvmix_cuda_cache_run, or
   kvmix_ref_cache_run on a host copy) with the same bytes as a host arena gets:
     - kvmix_cache_write_rows queues the copy of FP16 rows from the caller's device arrays;
     - reserve and finish queue the seals of full pages (and of a partial page at finish) and the
       copy on write of a shared buffer page;
     - compact queues the gather of survivors' rows (DEQUANTIZE) and their packing (QUANTIZE);
     - retier without rows (a demotion) queues the gather of the page's rows into FP16 staging
       and their packing into its new blocks;
     - kvmix_cache_write, ingest, append, read, ref_decode and retier with rows, which pass rows
       through host memory, return INVALID_ARGUMENT (retier: UNSUPPORTED).
   Arena bytes a call releases (a sealed buffer, a freed page) stay allocated until the jobs are
   taken, so that a queued job never reads bytes that a later one overwrites. Run the jobs of one
   take before any kernel reads the cache (a view is only valid once they ran). A call that would
   queue more than desc.max_jobs, or needs a page descriptor that a released page still holds,
   returns OUT_OF_MEMORY and changes nothing: take the jobs and call again. */

/* What a batch of jobs does. */
typedef enum kvmix_cache_batch_kind {
    KVMIX_CACHE_BATCH_QUANTIZE = 0,  /* FP16 source rows into blocks of `layout` */
    KVMIX_CACHE_BATCH_COPY = 1,      /* bytes: a job copies n_rows bytes from src_offset */
    KVMIX_CACHE_BATCH_DEQUANTIZE = 2 /* rows of blocks of `layout` into FP16 rows of the arena */
} kvmix_cache_batch_kind;

/* Where the source offsets of a batch count from. */
typedef enum kvmix_cache_source {
    KVMIX_CACHE_SOURCE_KEYS = 0,   /* the key rows given to kvmix_cache_run's executor */
    KVMIX_CACHE_SOURCE_VALUES = 1, /* the value rows */
    KVMIX_CACHE_SOURCE_ARENA = 2   /* the arena itself (seals, copies on write) */
} kvmix_cache_source;

/* One job, 24 bytes, the layout kvmix_cuda_quantize reads from device memory. QUANTIZE: source
   row r is at src_offset + r * src_row_stride FP16 elements of the source, and goes to row
   first_row + r of the block at dst_offset bytes of the arena. COPY: n_rows bytes from byte
   src_offset of the arena to byte dst_offset. DEQUANTIZE: rows first_row .. first_row + n_rows
   - 1 of the block at src_offset bytes of the arena, dequantized and rounded to FP16, go to
   head_dim-element rows one after another from dst_offset bytes of the arena. */
typedef struct kvmix_quantize_job {
    uint64_t src_offset;
    uint64_t dst_offset;
    int32_t first_row;
    int32_t n_rows;
} kvmix_quantize_job;

/* Jobs [first_job, first_job + n_jobs) of a take that run as one launch. A batch may start only
   when every earlier batch has finished (launches in order on one stream). */
typedef struct kvmix_cache_batch {
    kvmix_layout layout;    /* QUANTIZE: of the destination blocks (resolved) */
    int32_t kind;           /* kvmix_cache_batch_kind */
    int32_t source;         /* kvmix_cache_source */
    int64_t src_row_stride; /* QUANTIZE: FP16 elements between source rows */
    int32_t first_job;
    int32_t n_jobs;
} kvmix_cache_batch;

/* Queues the copy of layer `layer`'s rows of positions first_position .. + n_tokens - 1 (rules
   as kvmix_cache_write) from rows source_row .. source_row + n_tokens - 1 of the caller's FP16
   key and value arrays, each [rows][n_kv_heads][head_dim], passed to the executor. Returns
   NULL_POINTER, INVALID_ARGUMENT (host arena, as kvmix_cache_write, source_row < 0) or
   OUT_OF_MEMORY (the job queue is full); nothing is queued on error. Rows that are not finite
   FP16 are reported by the executor (KVMIX_CUDA_QUANTIZE_BAD_VALUE) and leave their rows as
   they were. */
KVMIXDEF kvmix_result kvmix_cache_write_rows(kvmix_cache *cache, int32_t seq, int32_t layer,
                                             int32_t first_position, int32_t n_tokens,
                                             int64_t source_row);

/* Moves the queued jobs, in execution order and grouped into batches, into jobs [max_jobs] and
   batches [max_batches] (both at most cache->n_jobs are needed), empties the queue and releases
   the arena bytes held for it. Returns NULL_POINTER, INVALID_ARGUMENT (host arena) or
   BUFFER_TOO_SMALL (nothing taken). */
KVMIXDEF kvmix_result kvmix_cache_jobs_take(kvmix_cache *cache, kvmix_quantize_job *jobs,
                                            int32_t max_jobs, kvmix_cache_batch *batches,
                                            int32_t max_batches, int32_t *out_n_jobs,
                                            int32_t *out_n_batches);

/* CPU reference executor: runs batches over `arena` (a host copy of the device arena) with
   key_rows and value_rows (FP16 bit patterns, may be NULL when no batch reads them), exactly as
   kvmix_cuda_cache_run does on the device. Batches are checked before any runs (a bad kind,
   range, layout or missing source: INVALID_ARGUMENT or NULL_POINTER, nothing written). A
   QUANTIZE job whose rows are not finite FP16, or a QUANTIZE or DEQUANTIZE job whose rows do not
   fit its block, writes nothing; *out_bad_jobs (may be NULL) counts them. */
KVMIXDEF kvmix_result kvmix_ref_cache_run(const kvmix_cache_batch *batches, int32_t n_batches,
                                          const kvmix_quantize_job *jobs, const uint16_t *key_rows,
                                          const uint16_t *value_rows, uint8_t *arena,
                                          int32_t *out_bad_jobs);

/* Verifies every invariant of the bookkeeping: reference counts equal the page-table references,
   page allocations are disjoint and are exactly the used granules, free lists are consistent,
   slot maps point into their own page tables, the sentinel is intact. Returns
   KVMIX_ERR_CORRUPT_DATA on the first violation. O(metadata); for tests and debugging. */
KVMIXDEF kvmix_result kvmix_cache_check(const kvmix_cache *cache);

/* ------------------------------------------------------------------------------------------- */
/* Transfer payload: the K/V rows of n_tokens consecutive positions of layers [first_layer,      */
/* first_layer + n_layers), each token at its own tier (FP16, INT8 or INT4 per token), to move a  */
/* prefill's cache to a decode worker. A payload per layer lets the sender stream layers as they  */
/* are computed; the receiver writes each layer with kvmix_cache_write (kvmix_cache_reserve      */
/* first), the same path as a prefill. A RESIDUAL payload upgrades rows received at a cold tier:  */
/* it carries (original - what the base payload decodes to) at a tier per token, and unpacking it */
/* adds to the rows the base payload gave. The byte layout (version 1) is in the >>transfer room. */

typedef enum kvmix_payload_kind {
    KVMIX_PAYLOAD_ROWS = 1,    /* every token's rows at its tier */
    KVMIX_PAYLOAD_RESIDUAL = 2 /* residuals of some tokens, to add to a ROWS payload's rows */
} kvmix_payload_kind;

#define KVMIX_PAYLOAD_VERSION      1
#define KVMIX_PAYLOAD_HEADER_BYTES 80
#define KVMIX_PAYLOAD_NO_ROW       0 /* tier of a token a RESIDUAL payload carries nothing for */

/* What a payload holds. Tiers are kvmix_format values: KVMIX_FORMAT_FP16, _INT8 or _INT4 per
   token, or KVMIX_PAYLOAD_NO_ROW (RESIDUAL only). Sinks are pinned by the policy that picks the
   tiers, not here. */
typedef struct kvmix_payload_desc {
    kvmix_payload_kind kind;
    int32_t head_dim;       /* a multiple of 8, at most KVMIX_MAX_HEAD_DIM, that group_size
                               divides */
    int32_t n_kv_heads;     /* 1 .. 65535 */
    int32_t group_size;     /* of the INT8/INT4 rows; 0 = KVMIX_GROUP_SIZE_DEFAULT */
    int32_t first_layer;    /* >= 0 */
    int32_t n_layers;       /* 1 .. 65535 */
    int32_t n_tokens;       /* >= 0 */
    int64_t first_position; /* >= 0: where the rows belong in the receiver's sequence */
    uint64_t id;            /* the sender's name for this payload */
    uint64_t base_id;       /* RESIDUAL: the id of the ROWS payload it refines; ROWS: 0 */
} kvmix_payload_desc;

/* A payload's shape and where its parts are, from kvmix_payload_describe or kvmix_payload_read_head. */
typedef struct kvmix_payload_info {
    kvmix_payload_desc desc;        /* group_size resolved */
    int32_t n_fp16, n_int8, n_int4; /* tokens at each tier (RESIDUAL: the rest carry nothing) */
    size_t head_bytes;              /* header + tier table (padded to 16): the body starts here */
    size_t total_bytes;             /* the whole payload */
} kvmix_payload_info;

/* Shape and size of the payload of these tiers ([desc->n_tokens] bytes; may be NULL when
   n_tokens is 0). *out_error (NULL: not wanted) names the field of kvmix_payload_desc at fault,
   "tiers" or the NULL argument. Returns NULL_POINTER, INVALID_ARGUMENT (kind, ranges, ids, a
   tier not allowed for the kind), BAD_SHAPE (head_dim, group_size, or a payload beyond 2^62
   bytes). */
KVMIXDEF kvmix_result kvmix_payload_describe(const kvmix_payload_desc *desc, const uint8_t *tiers,
                                             kvmix_payload_info *out_info, kvmix_error *out_error);

/* Writes the header and tier table (info->head_bytes bytes) of the payload that `info` describes
   (from kvmix_payload_describe with the same tiers) into dst. A GPU sender copies them to the
   device buffer before kvmix_cuda_payload_pack writes the body. *out_error (NULL: not wanted):
   as describe's, "info" when it does not match the tiers, or the argument at fault. Returns
   NULL_POINTER, describe's errors, INVALID_ARGUMENT (info does not match the tiers),
   BUFFER_TOO_SMALL. */
KVMIXDEF kvmix_result kvmix_payload_write_head(const kvmix_payload_info *info, const uint8_t *tiers,
                                               void *dst, size_t dst_bytes, kvmix_error *out_error);

/* Packs a whole payload: head, then every layer's blocks quantized by the >>formats CPU
   reference. keys, values: [n_layers][n_tokens][n_kv_heads][head_dim] floats (the residuals for
   a RESIDUAL payload; rows of NO_ROW tokens are not read), finite with |x| <= 65504.
   *out_bytes (may be NULL) receives info.total_bytes. *out_error (NULL: not wanted): as
   describe's, or the argument at fault. Returns describe's errors, BUFFER_TOO_SMALL, BAD_VALUE;
   nothing is written on error. */
KVMIXDEF kvmix_result kvmix_payload_pack(const kvmix_payload_desc *desc, const uint8_t *tiers,
                                         const float *keys, const float *values, void *dst,
                                         size_t dst_bytes, size_t *out_bytes,
                                         kvmix_error *out_error);

/* Reads and checks a payload's header and tier table from the first src_bytes bytes (at least
   the head; the body need not be there yet). *out_tiers (may be NULL) points into src.
   *out_error (NULL: not wanted) names the header field at fault as the >>transfer layout spells
   it ("magic", "version", "n_tokens", "reserved", "total_bytes" ...), "tiers" for the tier table,
   or the argument. Returns NULL_POINTER, MALFORMED (not a payload, truncated head, reserved bytes
   set, tier table that disagrees with the header's counts), VERSION (a version this build does
   not read), INVALID_ARGUMENT / BAD_SHAPE (fields out of range). Never reads past src_bytes. */
KVMIXDEF kvmix_result kvmix_payload_read_head(const void *src, size_t src_bytes,
                                              kvmix_payload_info *out_info,
                                              const uint8_t **out_tiers, kvmix_error *out_error);

/* Decodes layer `layer` (absolute: first_layer <= layer < first_layer + n_layers) of a whole
   payload into keys, values: [n_tokens][n_kv_heads][head_dim] floats (either may be NULL).
   ROWS: every token's rows are written. RESIDUAL: each carried residual is added in float to the
   row already there; rows of NO_ROW tokens are left. Every block of the layer is checked before
   anything is written. *out_error (NULL: not wanted): as read_head's, or "layer", "src_bytes",
   "src" (a corrupt block). Returns read_head's errors, INVALID_ARGUMENT (layer), BUFFER_TOO_SMALL
   (src_bytes < total_bytes), CORRUPT_DATA (a block no quantize call could have written). */
KVMIXDEF kvmix_result kvmix_payload_unpack(const void *src, size_t src_bytes, int32_t layer,
                                           float *keys, float *values, kvmix_error *out_error);

#ifndef KVMIX_NO_POLICY /* the policy layer: the core above never calls it */

/* ------------------------------------------------------------------------------------------- */
/* Template tags: a streaming tagger that reads the token ids of a chat template as an inference  */
/* loop produces them and writes, per token, a turn index, a modality and a role. A template spec */
/* (kvmix_tag_spec) is plain data: the id sequences of the template's markers and role words.    */
/* The JSON form of a spec lives with the tools in examples/ (tag_spec_json.c).                   */
/*                                                                                               */
/* Model of a stream: messages are  START header HEADER_END content END . The header holds the    */
/* role word(s) and, in harmony-like templates, a CHANNEL marker followed by a channel name, and   */
/* maybe a RECIPIENT marker followed by the recipient (harmony's " to=" before functions.NAME,    */
/* after the role word or after the channel name). The content may hold brackets (reasoning,     */
/* tool call, tool response: one level) and vision spans.                                         */
/*   - Scaffold: message start/end markers, every header token (role words, the header end such   */
/*     as ChatML's newline after the role, channel markers and names, recipients), bracket and    */
/*     vision marker tokens, and every token outside a message (e.g. ChatML's newline after       */
/*     <|im_end|>).                                                                               */
/*   - Message role: the longest role name (spec->roles) that is a prefix of the header gives the */
/*     role of the content: system/developer -> instruction (tool schemas live there), user,     */
/*     assistant, tool -> observation. In an assistant message a channel name (longest match      */
/*     after the channel marker) selects the role instead (harmony: analysis -> reasoning,        */
/*     commentary and final -> assistant: commentary without a recipient is a preamble the user   */
/*     sees), and a recipient marker anywhere in the header makes the message a tool call        */
/*     (tool_call, whatever the channel: harmony calls functions on commentary and its built-in  */
/*     tools on analysis). Channels and recipients apply to assistant messages only (a tool's     */
/*     result names its recipient too: "functions.NAME to=assistant").                           */
/*   - Brackets override the message role for their content: reasoning, tool_call, observation    */
/*     (tool response). In an instruction message (system, developer) bracket ids are content:    */
/*     system prompts name the tags when they explain tool use. Tokens inside vision brackets and  */
/*     image-pad ids have modality IMAGE and the role around them.                               */
/*   - Turns: turn 0 is everything before the first user message. A user message starts a new     */
/*     turn at its first content token, unless that token opens a tool response (ChatML sends a    */
/*     tool result as a user message wrapped in <tool_response>): such a message is an            */
/*     observation of the current turn, and its content outside brackets is observation too.      */
/*     Header tokens of the user message still carry the previous turn.                           */
/*   - Streaming: each token's tag is written when it is fed, from what came before it. A marker   */
/*     of several ids takes effect at its last id, which is tagged as the marker; its earlier ids  */
/*     were tagged as what they looked like when fed. Feeding one id at a time or in runs of any   */
/*     length gives the same tags.                                                               */
/*   - Broken streams never fail a call. The fallback tag has KVMIX_TAG_FLAG_FALLBACK set: a   */
/*     message with an unknown role word, an unknown channel or a header longer than           */
/*     KVMIX_TAG_MAX_HEADER tokens has its content tagged USER (unknown role, which starts no  */
/*     turn) or its header's role (channel or length wrong), flagged, except inside brackets.  */
/*     A stray or mismatched close bracket, an open bracket or vision span while one is open   */
/*     (it replaces it), a message start inside a message that never ended (the old one        */
/*     ends), a message end that closes an open bracket or vision span, and any bracket, end   */
/*     or image pad outside a message are scaffold (image pad: modality IMAGE), flagged;       */
/*     n_breaks counts them.                                                                   */
/*   - Role starts (spec->role_starts): special tokens that name a role and open its content,    */
/*     with no header (DeepSeek V3's User and Assistant tokens; its begin-of-sentence token is   */
/*     followed by the system prompt). One ends the message before it, which may have no end     */
/*     marker (DeepSeek's user messages).                                                        */
/*   - A bracket whose close marker the spec leaves empty (Llama 3.1's <|python_tag|> tool call)  */
/*     runs to the message end, which closes it without a break.                                  */

#define KVMIX_TAG_MAX_IDS       16   /* ids in one marker or name sequence */
#define KVMIX_TAG_MAX_ALTS      4    /* alternative sequences of one marker (e.g. harmony's ends) */
#define KVMIX_TAG_MAX_NAMES     16   /* role names, and channel names, of one spec */
#define KVMIX_TAG_MAX_STARTS    8    /* role starts of one spec */
#define KVMIX_TAG_MAX_HEADER    64   /* header tokens before the fallback ends a header */
#define KVMIX_TAG_NAME_BYTES    24   /* a role or channel name as text, NUL included */
#define KVMIX_TAG_FLAG_FALLBACK 1    /* kvmix_tag.flags: the stream broke the template here */
#define KVMIX_TAG_FILTER_BITS   4096 /* size of the hot path's id filter (kvmix_tagger.filter) */

typedef enum kvmix_tag_role {
    KVMIX_ROLE_INSTRUCTION = 0, /* system prompt, developer message, tool schemas */
    KVMIX_ROLE_USER = 1,
    KVMIX_ROLE_ASSISTANT = 2, /* the answer */
    KVMIX_ROLE_REASONING = 3,
    KVMIX_ROLE_TOOL_CALL = 4,
    KVMIX_ROLE_OBSERVATION = 5, /* tool results */
    KVMIX_ROLE_SCAFFOLD = 6     /* template markers, role words, text between messages */
} kvmix_tag_role;
#define KVMIX_TAG_N_ROLES 7

typedef enum kvmix_tag_modality {
    KVMIX_MODALITY_TEXT = 0,
    KVMIX_MODALITY_IMAGE = 1
} kvmix_tag_modality;

/* Temporal bucket of a token relative to the current turn (kvmix_tag_bucket_of). */
typedef enum kvmix_tag_bucket {
    KVMIX_BUCKET_CURRENT = 0,  /* turn == current turn (or later) */
    KVMIX_BUCKET_PREVIOUS = 1, /* turn == current - 1 */
    KVMIX_BUCKET_TWO_BACK = 2, /* turn == current - 2 */
    KVMIX_BUCKET_OLDER = 3     /* turn <= current - 3 */
} kvmix_tag_bucket;

/* The tag of one token, 8 bytes. */
typedef struct kvmix_tag {
    int32_t turn;     /* >= 0: number of user turns started up to and including this token */
    uint8_t role;     /* kvmix_tag_role */
    uint8_t modality; /* kvmix_tag_modality */
    uint8_t flags;    /* KVMIX_TAG_FLAG_* */
    uint8_t reserved; /* 0 */
} kvmix_tag;

/* A sequence of token ids; n_ids == 0 means "not used". */
typedef struct kvmix_tag_seq {
    int32_t n_ids;                  /* 0 .. KVMIX_TAG_MAX_IDS */
    int32_t ids[KVMIX_TAG_MAX_IDS]; /* each >= 0; entries past n_ids are ignored */
} kvmix_tag_seq;

/* A marker: any of up to KVMIX_TAG_MAX_ALTS sequences (unused ones have n_ids 0). */
typedef struct kvmix_tag_marker {
    kvmix_tag_seq alts[KVMIX_TAG_MAX_ALTS];
} kvmix_tag_marker;

/* A role word after the message start, or a channel name after the channel marker. */
typedef struct kvmix_tag_name {
    char text[KVMIX_TAG_NAME_BYTES]; /* for people and tools; the tagger reads only ids */
    int32_t role;                    /* kvmix_tag_role, not SCAFFOLD */
    kvmix_tag_seq seq;               /* n_ids >= 1 */
} kvmix_tag_name;

/* A template spec: plain data, all zero = nothing. message_end needs at least one sequence, and
   so do message_start and header_end unless the spec has role starts; every other marker is
   optional. Content markers (message start and
   end, brackets, vision, image pad, role starts) are matched anywhere and must all differ from
   one another;
   header_end, channel and recipient are matched only inside a header and must differ from one
   another. */
typedef struct kvmix_tag_spec {
    kvmix_tag_marker message_start; /* ChatML <|im_start|>; harmony <|start|> */
    kvmix_tag_marker message_end;   /* <|im_end|>; <|end|>, <|call|>, <|return|> */
    kvmix_tag_marker header_end;    /* ChatML: the newline after the role; harmony <|message|> */
    kvmix_tag_marker channel;       /* harmony <|channel|>; none in ChatML */
    kvmix_tag_marker recipient;     /* harmony " to=" (two ids): the message is a tool call */
    kvmix_tag_marker reasoning_open, reasoning_close; /* <think> </think> */
    kvmix_tag_marker tool_call_open, tool_call_close; /* <tool_call> </tool_call> */
    kvmix_tag_marker tool_response_open, tool_response_close;
    kvmix_tag_marker vision_open, vision_close; /* <|vision_start|> <|vision_end|> */
    kvmix_tag_marker image_pad;                 /* <|image_pad|>: one id each */
    int32_t n_roles;                            /* 0 .. KVMIX_TAG_MAX_NAMES */
    kvmix_tag_name roles[KVMIX_TAG_MAX_NAMES];
    int32_t n_channels; /* 0 .. KVMIX_TAG_MAX_NAMES */
    kvmix_tag_name channels[KVMIX_TAG_MAX_NAMES];
    int32_t n_role_starts; /* 0 .. KVMIX_TAG_MAX_STARTS: content markers that start a */
    kvmix_tag_name role_starts[KVMIX_TAG_MAX_STARTS]; /* message of their role, headless */
} kvmix_tag_spec;

/* Streaming tagger state: fixed size, in caller memory, no pointers (it may be copied to fork a
   stream, or saved). Read-only for callers except through the functions below; `turn` is the
   current turn, `n_fed` the ids fed so far, `n_breaks` the template breaks seen. */
typedef struct kvmix_tagger {
    kvmix_tag_spec spec;
    uint64_t filter[KVMIX_TAG_FILTER_BITS / 64]; /* last ids of content markers, by id % bits */
    int64_t n_fed;
    int64_t n_breaks;
    int32_t turn;
    int32_t mode;      /* private: outside, content, first content token, header */
    kvmix_tag current; /* private: the tag of a plain token in the current state */
    int32_t msg_role, msg_fallback, msg_user, bracket, vision, channel_role, channel_at;
    int32_t recipient_at; /* private: header position after a recipient marker, or -1 */
    int32_t n_header;
    int32_t header[KVMIX_TAG_MAX_IDS];      /* first header ids */
    int32_t channel_ids[KVMIX_TAG_MAX_IDS]; /* first ids after the channel marker */
    int32_t history[KVMIX_TAG_MAX_IDS];     /* the last ids fed, ring by n_fed */
    int32_t pad_mode;                       /* private: image pads on the hot path ... */
    int32_t pads[KVMIX_TAG_MAX_ALTS];       /* ... in this mode, when they end no other marker */
} kvmix_tagger;

/* Checks a spec: counts and lengths in range, ids >= 0, name roles valid and not SCAFFOLD, the
   required markers present, image pads one id each, content markers distinct from each other
   and header markers (header_end, channel, recipient) distinct from each other. Returns
   KVMIX_SUCCESS, KVMIX_ERR_NULL_POINTER or KVMIX_ERR_INVALID_ARGUMENT, *out_error naming the
   spec member ("message_start", "roles"). Thread-safe. */
KVMIXDEF kvmix_result kvmix_tag_spec_check(const kvmix_tag_spec *spec, kvmix_error *out_error);

/* Initializes a tagger for a new stream: copies the spec (which the caller may then free) and
   starts outside any message at turn 0. Returns kvmix_tag_spec_check's errors (with its
   *out_error); on error *tagger is unchanged. */
KVMIXDEF kvmix_result kvmix_tagger_init(kvmix_tagger *tagger, const kvmix_tag_spec *spec,
                                        kvmix_error *out_error);

/* Starts a new stream with the same spec. Returns KVMIX_ERR_NULL_POINTER or
   KVMIX_ERR_INVALID_ARGUMENT (a tagger whose spec no longer checks). */
KVMIXDEF kvmix_result kvmix_tagger_reset(kvmix_tagger *tagger);

/* Feeds n_ids token ids (any int32 value; ids no marker uses are content) and writes their tags
   to out_tags [n_ids]. Runs of any length give the same tags as one id at a time. ids and
   out_tags may be NULL when n_ids is 0. Returns KVMIX_ERR_NULL_POINTER or
   KVMIX_ERR_INVALID_ARGUMENT (n_ids < 0); then nothing is written and the state is unchanged.
   Never fails on the ids' content (see the fallback above). One writer per tagger; taggers on
   distinct streams are independent. */
KVMIXDEF kvmix_result kvmix_tagger_feed(kvmix_tagger *tagger, const int32_t *ids, int32_t n_ids,
                                        kvmix_tag *out_tags);

/* Bucket of a token of turn `turn` when the stream is at `current_turn`: CURRENT for turn >=
   current_turn, PREVIOUS one before, TWO_BACK two before, OLDER beyond. Pure. */
KVMIXDEF kvmix_tag_bucket kvmix_tag_bucket_of(int32_t turn, int32_t current_turn);

/* Lowercase names: roles "instruction", "user", "assistant", "reasoning", "tool_call",
   "observation", "scaffold"; modalities "text", "image"; buckets "current", "previous",
   "two_back", "older"; "unknown" for other values. Static strings, never NULL. */
KVMIXDEF const char *kvmix_tag_role_name(kvmix_tag_role role);
KVMIXDEF const char *kvmix_tag_modality_name(kvmix_tag_modality modality);
KVMIXDEF const char *kvmix_tag_bucket_name(kvmix_tag_bucket bucket);

/* The role of a name as kvmix_tag_role_name spells it (case-sensitive, NUL-terminated) into
   *out_role. Returns KVMIX_ERR_NULL_POINTER or KVMIX_ERR_NOT_FOUND. */
KVMIXDEF kvmix_result kvmix_tag_role_from_name(const char *name, kvmix_tag_role *out_role);

/* ------------------------------------------------------------------------------------------- */
/* Tag precision: the formats each template tag gets (what a bit allocation assigns), so that a   */
/* policy stores every token by its tag. A token's tag is fixed once tagged, but its temporal     */
/* bucket ages as new user turns begin, so its formats are a function of the current turn.       */

#define KVMIX_TAG_N_BUCKETS    4
#define KVMIX_TAG_N_MODALITIES 2

typedef struct kvmix_tag_precision {
    /* [kvmix_tag_bucket][kvmix_tag_role][kvmix_tag_modality]: each a pair of kvmix_formats; a
       zero format is that side of the policy's key_format / value_format */
    kvmix_cache_precision formats[KVMIX_TAG_N_BUCKETS][KVMIX_TAG_N_ROLES][KVMIX_TAG_N_MODALITIES];
} kvmix_tag_precision;

/* Sets every tag's formats to `precision`. Returns NULL_POINTER or UNKNOWN_FORMAT (nothing
   written then). */
KVMIXDEF kvmix_result kvmix_tag_precision_fill(kvmix_tag_precision *table,
                                               kvmix_cache_precision precision);

/* Checks that every entry holds known formats or 0. *out_error (NULL: not wanted) names the first
   bad entry by bucket, role and modality name ("formats[previous][user][image]"; "table" when
   NULL) and its side. Returns NULL_POINTER or UNKNOWN_FORMAT. Pure. */
KVMIXDEF kvmix_result kvmix_tag_precision_check(const kvmix_tag_precision *table,
                                                kvmix_error *out_error);

/* ------------------------------------------------------------------------------------------- */
/* Policies: how a cache stores tokens. A policy names the formats of sealed key and value blocks, */
/* the channel group of per-token integer formats, the boosted channels of BOOSTED keys, the page  */
/* size (the span of per-channel key statistics), the FP16 sinks and window, and what a request   */
/* boundary does to a partial page. kvmix_policy_apply writes a policy into a cache desc, so the   */
/* cache built from that desc applies it; built-ins (KIVI, Kitty, INT4 ...) come from             */
/* kvmix_policy_at. Policies are plain data: pure functions, thread-safe.                        */

#define KVMIX_POLICY_NAME_BYTES        64   /* a name, its terminating NUL included */
#define KVMIX_GROUP_HEAD_DIM           (-1) /* a policy's group: one group per head (head_dim) */
#define KVMIX_POLICY_DESCRIPTION_BYTES 256  /* a description, its terminating NUL included */

/* What an inference loop does at a request boundary (a new user turn of a session). */
typedef enum kvmix_policy_boundary {
    KVMIX_POLICY_BOUNDARY_FINISH = 0,  /* kvmix_cache_seq_finish: seal every full page, window
                                          included, and apply partial_page */
    KVMIX_POLICY_BOUNDARY_CONTINUE = 1 /* nothing: a continuing session keeps its FP16 window */
} kvmix_policy_boundary;

/* Budgeted eviction (a loop's, after each request's prompt: kvmix_evict_select and the calls
   next to it, // >>intent): which scorer ranks the history, and how much of it stays. */
typedef enum kvmix_evict_scorer {
    KVMIX_EVICT_INTENT = 1,    /* the session's QueryMemory: kvmix_ref_view_intent_score summed
                                  over layers */
    KVMIX_EVICT_QUERY = 2,     /* the same over the request's own actionable queries alone (no
                                  memory: what the session's memory adds is measured on it) */
    KVMIX_EVICT_STREAMING = 3, /* StreamingLLM: the prefix (sinks) and the most recent positions */
    KVMIX_EVICT_H2O = 4,       /* H2O: attention mass accumulated over every query so far */
    KVMIX_EVICT_SNAPKV = 5     /* SnapKV: attention mass of the prompt's last observe_tokens
                                  queries, max-pooled over pool_tokens neighbours */
} kvmix_evict_scorer;

/* The widest pool: a neighbourhood, not a window over the history (pooling costs
   n_positions * pool_tokens). */
#define KVMIX_EVICT_MAX_POOL 1023

typedef struct kvmix_evict_policy {
    int32_t scorer;         /* a kvmix_evict_scorer */
    int32_t budget_tokens;  /* live positions a sequence keeps at most; 0 = budget_fraction */
    double budget_fraction; /* else of the positions it has, in (0, 1] */
    double decay;           /* INTENT: QueryMemory decay, [0, 1) (kvmix_query_memory_update) */
    int32_t prefix_tokens;  /* first positions always kept (the protected system prefix); 0 =
                               none */
    int32_t recent_tokens;  /* most recent positions always kept, a floor under every scorer but
                               STREAMING (whose score is recency); 0 = none */
    int32_t observe_tokens; /* SNAPKV: queries observed at the prompt's end; 0 = 32 */
    int32_t pool_tokens;    /* max-pool width of the scores of every scorer but STREAMING (a
                               kept position keeps its neighbours: a copied word needs its
                               bytes), odd, at most KVMIX_EVICT_MAX_POOL; 0 = 7 for SNAPKV, 1
                               (none) for the others */
    double recent_fraction; /* the recent floor as a share of the budget (kvmix_evict_budget),
                               in [0, 1]: the floor is the larger of this and recent_tokens
                               (H2O's paper keeps half its budget recent; STREAMING ignores
                               both); 0 = recent_tokens alone */
} kvmix_evict_policy;

typedef struct kvmix_policy {
    char name[KVMIX_POLICY_NAME_BYTES]; /* non-empty, NUL-terminated */
    char description[KVMIX_POLICY_DESCRIPTION_BYTES];
    int32_t key_format;         /* kvmix_format of sealed key blocks */
    int32_t value_format;       /* kvmix_format of sealed value blocks */
    int32_t group_size;         /* channels per scale of INT8/INT4/INT2 key blocks (and value
                                   blocks unless value_group_size says otherwise): a multiple of 8
                                   in 8 .. 512 that divides head_dim, or KVMIX_GROUP_HEAD_DIM */
    int32_t value_group_size;   /* of INT8/INT4/INT2 value blocks, as group_size; 0 = group_size */
    int32_t n_boost;            /* channels BOOSTED keys keep at 4 bits, whether the policy's own
                                   formats or its tag_precision (a tag allocation) ask for BOOSTED:
                                   a multiple of 4 in 0 .. 252; 0 = given by boost_fraction
                                   instead; both 0 = none, which a policy whose own formats are
                                   BOOSTED may not have */
    double boost_fraction;      /* n_boost as a fraction of head_dim, in [0, 1]; when both are set
                                   they must agree for the model's head_dim */
    int32_t page_tokens;        /* tokens per page, a multiple of 8 in 8 .. 1024 (no default: 0 is
                                   refused) */
    int32_t sink_tokens;        /* first positions kept FP16 for good, 0 .. page_tokens; 0 = none */
    int32_t window_tokens;      /* most recent positions kept FP16, 0 .. 2^26; 0 = none */
    int32_t window_values_only; /* 1: the window keeps values only (kvmix_cache_desc) */
    int32_t partial_page;       /* a kvmix_cache_partial: a request boundary's partial last page;
                                   0 = KEEP_FP16 */
    int32_t request_boundary;   /* a kvmix_policy_boundary: what the loop does when a request
                                   (a user turn) begins; 0 = FINISH */
    const struct kvmix_tag_precision *tag_precision; /* NULL: every token is stored in
                                   key_format / value_format; else each token's formats by its
                                   template tag (kvmix_policy_token_precision); caller memory
                                   that must outlive the policy's use */
    kvmix_evict_policy evict; /* scorer 0: none; else what the loop evicts once each request's
                                 prompt ran (the cache itself evicts nothing on its own) */
} kvmix_policy;

/* The built-in policies, by index 0 .. kvmix_policy_count() - 1: fp16, int8, int4, kivi2,
   kivi2-sink, kitty-12, kitty-25, kitty-paper-12, kitty-paper-25 (README.md, "Policies"). NULL
   for an index out of range. */
KVMIXDEF int32_t kvmix_policy_count(void);
KVMIXDEF const kvmix_policy *kvmix_policy_at(int32_t index);
/* The built-in of this name, or NULL (also for a NULL name). */
KVMIXDEF const kvmix_policy *kvmix_policy_find(const char *name);

/* Checks the rules that hold whatever the model: formats, ranges, multiples, sinks within a
   page, boost settings present where the formats are BOOSTED, a NUL-terminated non-empty name and
   a NUL-terminated description. Returns KVMIX_SUCCESS, NULL_POINTER (policy) or
   INVALID_ARGUMENT / UNKNOWN_FORMAT with *out_error (may be NULL) naming the field. */
KVMIXDEF kvmix_result kvmix_policy_check(const kvmix_policy *policy, kvmix_error *out_error);

/* The policy for a model of this head_dim: checked, groups resolved (value_group_size 0 made
   group_size, KVMIX_GROUP_HEAD_DIM made head_dim), n_boost resolved from boost_fraction (and
   boost_fraction from n_boost), groups and n_boost checked against head_dim. A resolved
   policy resolves to itself. Returns kvmix_policy_check's errors and BAD_SHAPE (head_dim not a
   multiple of 8 up to KVMIX_MAX_HEAD_DIM, group_size not dividing it, n_boost beyond it, a
   fraction that gives no multiple of 4) with *out_error; *out is written only on success. */
KVMIXDEF kvmix_result kvmix_policy_resolve(const kvmix_policy *policy, int32_t head_dim,
                                           kvmix_policy *out, kvmix_error *out_error);

/* Writes the policy, resolved for desc->head_dim, into a cache desc: page_tokens, n_sink,
   n_window (at most desc->max_tokens_per_seq when that is set), window_values_only, group_size,
   value_group_size, n_boost, partial and default_precision; the caller's shape, capacity and arena fields are left alone. A cache
   initialized from the desc then stores every token reserved with NULL precisions as the policy
   says. Returns kvmix_policy_resolve's errors (desc untouched then) or NULL_POINTER. */
KVMIXDEF kvmix_result kvmix_policy_apply(const kvmix_policy *policy, kvmix_cache_desc *desc,
                                         kvmix_error *out_error);

/* The formats a policy stores a token of tag `tag` in while the stream is at `current_turn`:
   the policy's key_format / value_format when it has no tag_precision, else
   tag_precision->formats[kvmix_tag_bucket_of(tag.turn, current_turn)][tag.role][tag.modality]
   with a zero format replaced by the policy's, so never 0. Returns NULL_POINTER,
   INVALID_ARGUMENT (a role or modality out of range), or the policy's check errors
   (kvmix_policy_check); *out is written only on success. Pure, thread-safe. */
KVMIXDEF kvmix_result kvmix_policy_token_precision(const kvmix_policy *policy, kvmix_tag tag,
                                                   int32_t current_turn,
                                                   kvmix_cache_precision *out);

/* The run (kvmix_cache_seq_set_run) of a token of tag `tag`: 0 without tag_precision, else a
   nonzero 32-bit hash of the tag's turn and its formats in every bucket, so that the tokens a page
   holds age alike and kvmix_policy_retier_turn gives each of them what it asks for. Errors as
   kvmix_policy_token_precision; *out_run is written only on success. Pure, thread-safe. */
KVMIXDEF kvmix_result kvmix_policy_token_run(const kvmix_policy *policy, kvmix_tag tag,
                                             uint32_t *out_run);
/* Ages a sequence's stored precision to `current_turn`, as a loop calls it when a new user turn
   begins. For every page the sequence alone references (sinks excepted), the formats its live
   positions now ask for (kvmix_policy_token_precision of tags[position] at current_turn; the
   highest precision over the page, per side) become its formats wherever they are lower: a
   sealed page is re-tiered down to them in its own bytes (kvmix_cache_retier without rows), an
   FP16 buffer page will be sealed to them. Precision never rises: bytes a demotion dropped do not
   come back, and a page whose lower formats would take more bytes (per-channel metadata over a
   few rows) keeps its own. Shared pages are left as they are: they belong to every sharer. tags:
   [n_tags], the tag of each position, n_tags >= the sequence's positions. *out_pages (may be
   NULL): sealed pages re-tiered. A device arena queues each page's gather and packing
   (kvmix_cache_retier) through one FP16 staging page. Returns NULL_POINTER, INVALID_ARGUMENT
   (seq, n_tags, current_turn < 0, a tag's role or modality out of range), the policy's check
   errors, or OUT_OF_MEMORY (a device arena without room for the staging or the jobs: take the
   jobs and call again); nothing changes on error. */
KVMIXDEF kvmix_result kvmix_policy_retier_turn(const kvmix_policy *policy, kvmix_cache *cache,
                                               int32_t seq, const kvmix_tag *tags, int32_t n_tags,
                                               int32_t current_turn, int32_t *out_pages);

/* ------------------------------------------------------------------------------------------- */
/* Bit allocation: which precision each token tag gets under a memory budget. Calibration gives,  */
/* for every active tag t (e.g. "current turn / text / user") and every candidate precision p    */
/* (e.g. INT2 keys + INT2 values, boosted keys + INT2 values, INT4, INT8, FP16), a distortion     */
/* D[t][p] (the attention-output MSE when only t's tokens are stored at p) and t's token count.  */
/* The allocators choose one precision per tag:                                                 */
/*                                                                                               */
/*   minimize   sum_t D[t][choice[t]]                                                            */
/*   subject to sum_t tokens[t] * bits[choice[t]] <= budget_bits * sum_t tokens[t]               */
/*   (with tag_bits: tag_bits[t][choice[t]] in place of bits[choice[t]])                         */
/*                                                                                               */
/* bits[p] is precision p's cost in effective bits per cached element with every byte of         */
/* metadata included (for keys + values, the mean of both layouts' kvmix_layout_bits at a full   */
/* page), so a budget in bits per element is what memory will hold. D[t][p] is taken as it is:   */
/* the total is the plain sum over tags, no weighting by tokens; a caller whose distortion is a  */
/* per-token mean multiplies it by the tag's tokens first. The constraint is evaluated in double, */
/* each side summed in tag order; every allocator returns a choice that satisfies it exactly so. */
/*                                                                                               */
/*   kvmix_alloc_two_level  two precisions (low, high): exhaustive and optimal for n_tags <= 22   */
/*                          (KVMIX_ALLOC_EXACT_MAX_TAGS), greedy by distortion gain per bit above */
/*   kvmix_alloc_knapsack   every precision: exact multiple-choice knapsack by dynamic            */
/*                          programming over a discretized budget                                 */
/*   kvmix_alloc_knapsack_sweep  the same program's least distortion at every budget of the grid  */
/*                                                                                               */
/* Both read only the problem and write only the caller's outputs and workspace: no allocation,  */
/* no state, thread-safe for distinct outputs and workspaces.                                    */

#define KVMIX_ALLOC_EXACT_MAX_TAGS 22      /* two-level exhaustive search up to this many tags */
#define KVMIX_ALLOC_MAX_TAGS       1048576 /* 2^20 */
#define KVMIX_ALLOC_MAX_PRECISIONS 64
#define KVMIX_ALLOC_MAX_BITS       65536.0  /* largest bits[p] accepted */
#define KVMIX_ALLOC_STEPS_DEFAULT  4096     /* knapsack budget grid when budget_steps is 0 */
#define KVMIX_ALLOC_MAX_STEPS      16777216 /* 2^24 */

/* A calibration table and a budget. Pointers are borrowed for the call only. Zero-initialize it
   (= {0}) before setting members, so that a member a later version adds keeps its default. */
typedef struct kvmix_alloc_problem {
    int32_t n_tags;           /* active tags, 1 .. KVMIX_ALLOC_MAX_TAGS */
    int32_t n_precisions;     /* candidate precisions, 1 .. KVMIX_ALLOC_MAX_PRECISIONS */
    const int64_t *tokens;    /* [n_tags] token count of each tag, >= 0 (0 is allowed: such a tag
                                 costs nothing); the sum must be in 1 .. 2^53 */
    const double *distortion; /* [n_tags][n_precisions] row-major, finite, >= 0, any unit (the
                                 sum over tags of each tag's largest must be finite) */
    const double *bits;       /* [n_precisions] effective bits per element, in (0, 65536] */
    double budget_bits;       /* B: average bits per element over all tokens, finite, > 0 */
    const double *tag_bits;   /* NULL: every tag's tokens cost bits[p]; else [n_tags][n_precisions]
                                 row-major, in (0, 65536]: what tag t's tokens cost at p, e.g.
                                 priced by the runs they come in (kvmix_cache_page_bits), which
                                 replaces bits[p] in every cost below (bits still orders the two
                                 levels of kvmix_alloc_two_level) */
} kvmix_alloc_problem;

typedef enum kvmix_alloc_method {
    KVMIX_ALLOC_AUTO = 0,       /* two-level: exhaustive when n_tags <= 22, else greedy */
    KVMIX_ALLOC_EXHAUSTIVE = 1, /* two-level, n_tags <= KVMIX_ALLOC_EXACT_MAX_TAGS: optimal */
    KVMIX_ALLOC_GREEDY = 2,     /* two-level, any n_tags: by distortion gain per bit */
    KVMIX_ALLOC_KNAPSACK = 3    /* what kvmix_alloc_knapsack reports */
} kvmix_alloc_method;

/* What an allocation achieved. */
typedef struct kvmix_alloc_summary {
    double distortion;         /* sum_t D[t][choice[t]], summed in tag order */
    double bits;               /* sum_t tokens[t] * cost / sum_t tokens[t] (cost: tag_bits or
                                  bits of choice[t]): at most
                                  B (up to the rounding of this division; the budget test
                                  itself is on the cost, see above) */
    kvmix_alloc_method method; /* the method that ran (AUTO resolved) */
    int32_t optimal;           /* 1: no choice within the budget has a smaller distortion
                                  (exhaustive; knapsack: among choices of the discretized
                                  costs, see there); 0: greedy */
} kvmix_alloc_summary;

/* Checks a problem as every allocation call below does first: counts in range, arrays given,
   token counts >= 0 with a sum in 1 .. 2^53, bits and tag_bits in (0, 65536], distortions and
   budget_bits finite and >= 0 (> 0). Returns KVMIX_SUCCESS, NULL_POINTER, INVALID_ARGUMENT or
   BAD_VALUE, the result those calls give for it, and *out_error naming the member ("tokens",
   "budget_bits"). Pure, thread-safe. */
KVMIXDEF kvmix_result kvmix_alloc_problem_check(const kvmix_alloc_problem *problem,
                                                kvmix_error *out_error);

/* Workspace bytes kvmix_alloc_two_level needs for n_tags tags with this method: 32 * n_tags when
   it runs greedy (GREEDY, or AUTO with n_tags > KVMIX_ALLOC_EXACT_MAX_TAGS), 0 when it runs the
   exhaustive search. Returns KVMIX_ERR_NULL_POINTER or KVMIX_ERR_INVALID_ARGUMENT (n_tags out
   of range, an unknown method, EXHAUSTIVE with n_tags > KVMIX_ALLOC_EXACT_MAX_TAGS). */
KVMIXDEF kvmix_result kvmix_alloc_two_level_workspace_bytes(int32_t n_tags,
                                                            kvmix_alloc_method method,
                                                            size_t *out_bytes);

/* Two-level allocation: every tag gets precision `low` or `high` (indices into bits and the
   distortion rows; bits[low] < bits[high]).
   - EXHAUSTIVE (AUTO when n_tags <= 22): the minimum over all 2^n_tags assignments within the
     budget, up to rounding of the distortion sums (about 1e-14 of the total). Among
     assignments of equal distortion one is kept deterministically. Time O(2^n_tags): a table of
     the first 8 tags' 256 subset sums (on the stack, 4 KiB), an outer loop over the other tags'
     subsets; about 4M steps of two additions at n_tags = 22, a few ms. No workspace.
   - GREEDY (AUTO when n_tags > 22): starts with every tag at low and upgrades tags to high in
     decreasing order of (D[t][low] - D[t][high]) / (tokens[t] * (bits[high] - bits[low]))
     (ties: lower tag index first; zero-token tags first), skipping a tag whose upgrade does
     not fit and going on with the next; tags whose distortion does not drop are never
     upgraded. So its distortion is never above all-low. Time O(n log n) (merge sort).
   workspace: kvmix_alloc_two_level_workspace_bytes for the method (8-byte aligned; NULL is fine
   when that is 0).
   choice: [n_tags] receives low or high per tag; out: the summary (may be NULL).
   Returns KVMIX_ERR_NULL_POINTER, KVMIX_ERR_INVALID_ARGUMENT (counts, indices, bits[low] >=
   bits[high], a negative token count, zero tokens in all, EXHAUSTIVE with n_tags > 22, an
   unknown method, misaligned workspace), KVMIX_ERR_BAD_VALUE (a distortion, bits or budget
   that is NaN, infinite, negative or out of range), KVMIX_ERR_BUFFER_TOO_SMALL (workspace),
   KVMIX_ERR_OUT_OF_MEMORY (infeasible: the budget cannot hold every tag at low). Nothing is
   written on error. Thread-safe. */
KVMIXDEF kvmix_result kvmix_alloc_two_level(const kvmix_alloc_problem *problem, int32_t low,
                                            int32_t high, kvmix_alloc_method method,
                                            void *workspace, size_t workspace_bytes,
                                            int32_t *choice, kvmix_alloc_summary *out);

/* Workspace bytes of kvmix_alloc_knapsack for this problem and grid: (budget_steps + 1) *
   (n_tags + 16), about n_tags * budget_steps bytes (a choice table and two rows of doubles).
   Reads only n_tags and n_precisions of the problem; budget_steps 0 = KVMIX_ALLOC_STEPS_DEFAULT.
   Returns KVMIX_ERR_NULL_POINTER, KVMIX_ERR_INVALID_ARGUMENT (counts or budget_steps out of
   range, more than SIZE_MAX bytes). */
KVMIXDEF kvmix_result kvmix_alloc_knapsack_workspace_bytes(const kvmix_alloc_problem *problem,
                                                           int32_t budget_steps, size_t *out_bytes);

/* Multiple-choice knapsack over every precision, by dynamic programming over a discretized
   budget. Let c[t][p] = tokens[t] * bits[p] (or tag_bits[t][p]), m[t] = min_p c[t][p], C =
   sum_t m[t] and S = budget_bits * sum_t tokens[t] - C, the room above the cheapest choice. The
   grid has budget_steps cells (0 = KVMIX_ALLOC_STEPS_DEFAULT, at most KVMIX_ALLOC_MAX_STEPS) of
   q = S / budget_steps; each tag's extra cost c[t][p] - m[t] is rounded UP to whole cells (one
   within a relative 2^-40 of a whole number of cells counts as that number). The result is
   the least distortion among choices whose rounded extra costs fit in budget_steps cells
   (optimal = 1), and it always satisfies the real, undiscretized budget. When every extra cost
   is a multiple of q, discretization loses nothing and the result is the exact optimum;
   otherwise a choice may be missed only if its real cost is within n_tags * q of the budget.
   Among choices of equal distortion one is kept deterministically. Time O(n_tags *
   n_precisions * budget_steps).
   workspace: kvmix_alloc_knapsack_workspace_bytes (8-byte aligned). choice: [n_tags]
   precision indices; out: the summary (may be NULL).
   Returns KVMIX_ERR_NULL_POINTER, KVMIX_ERR_INVALID_ARGUMENT (counts, budget_steps, token
   counts, misaligned workspace), KVMIX_ERR_BAD_VALUE (as kvmix_alloc_two_level),
   KVMIX_ERR_BUFFER_TOO_SMALL (workspace), KVMIX_ERR_OUT_OF_MEMORY (infeasible: the budget
   cannot hold every tag at its cheapest precision). Nothing is written on error. Thread-safe. */
KVMIXDEF kvmix_result kvmix_alloc_knapsack(const kvmix_alloc_problem *problem, int32_t budget_steps,
                                           void *workspace, size_t workspace_bytes, int32_t *choice,
                                           kvmix_alloc_summary *out);

/* Budget sweep: the least distortion at every budget of a knapsack grid, from one dynamic
   program. With C, S and q as for kvmix_alloc_knapsack (problem->budget_bits is the largest
   budget of the sweep), for w = 0 .. budget_steps: out_budget_bits[w] = (C + w * q) /
   sum_t tokens[t], and out_distortion[w] = the least distortion among choices whose rounded
   extra costs fit in w cells (so such a choice holds out_budget_bits[w], up to the rounding of
   that division); non-increasing in w. Each output has budget_steps + 1 entries
   (KVMIX_ALLOC_STEPS_DEFAULT + 1 when budget_steps is 0); either may be NULL. To get the
   choice at one of these budgets, call kvmix_alloc_knapsack with it. Workspace, time, returns
   and thread safety as kvmix_alloc_knapsack. */
KVMIXDEF kvmix_result kvmix_alloc_knapsack_sweep(const kvmix_alloc_problem *problem,
                                                 int32_t budget_steps, void *workspace,
                                                 size_t workspace_bytes, double *out_budget_bits,
                                                 double *out_distortion);

/* ------------------------------------------------------------------------------------------- */
/* Session store: per-session memories (the intent policy's QueryMemory) in caller memory,     */
/* found by a session key and replaced least recently used first. Implementation: // >>intent. */

typedef enum kvmix_session_key_kind {
    KVMIX_SESSION_KEY_ID = 1,   /* the caller's explicit session id */
    KVMIX_SESSION_KEY_SPAN = 2, /* the ids of a designated session span (the first user message) */
    KVMIX_SESSION_KEY_PREFIX = 3, /* the request's first input ids */
    KVMIX_SESSION_KEY_LOCAL = 4   /* this request alone: matches no other, is never stored */
} kvmix_session_key_kind;

/* A resolved key. Two keys are the same session when kind, id and ids[0 .. n_ids) are equal;
   hash (of all three) only finds candidates. ids point into the caller's array until
   kvmix_session_store_acquire copies them. */
typedef struct kvmix_session_key {
    int32_t kind;  /* a kvmix_session_key_kind */
    int32_t n_ids; /* SPAN, PREFIX: the ids that make the key; 0 otherwise */
    const int32_t *ids;
    uint64_t id; /* ID: the session id; LOCAL: the request's serial; 0 otherwise */
    uint64_t hash;
} kvmix_session_key;

/* A request's key, the first that applies: the explicit *session_id when session_id is not NULL;
   else the session span's ids when n_span_ids > 0; else the first n_prefix input ids when
   n_prefix > 0 and the request has that many; else a LOCAL key of request_serial. A span or
   prefix keeps at most max_key_ids ids (its first): that is the key. Returns NULL_POINTER,
   INVALID_ARGUMENT (a negative count, max_key_ids < 1). Pure. */
KVMIXDEF kvmix_result kvmix_session_key_resolve(const uint64_t *session_id, const int32_t *span_ids,
                                                int32_t n_span_ids, const int32_t *input_ids,
                                                int32_t n_input_ids, int32_t n_prefix,
                                                int32_t max_key_ids, uint64_t request_serial,
                                                kvmix_session_key *out_key);

typedef struct kvmix_session_store_desc {
    int32_t capacity;      /* sessions held at once, 1 .. 2^20 */
    int32_t memory_floats; /* floats of one session's memory, 1 .. 2^28 */
    int32_t max_key_ids;   /* ids a stored key may have, 0 = 256, at most 2^16 */
} kvmix_session_store_desc;

/* One held session (read-only for callers). */
typedef struct kvmix_session_entry {
    uint64_t hash, id, last_use; /* last_use: the store's clock at its last acquire; 0 = free */
    int32_t kind, n_ids;
    int32_t next; /* the next entry of its hash bucket, -1 at the end */
    int32_t reserved;
} kvmix_session_entry;

/* A store: transparent for tests and tools; change it only through the calls below. */
typedef struct kvmix_session_store {
    kvmix_session_store_desc desc; /* resolved */
    int32_t n_used;
    int32_t n_buckets; /* a power of two >= capacity */
    uint64_t clock;
    kvmix_session_entry *entries; /* [capacity] */
    int32_t *buckets;             /* [n_buckets] first entry, -1 when empty */
    int32_t *key_ids;             /* [capacity][max_key_ids] */
    float *memories;              /* [capacity][memory_floats] */
} kvmix_session_store;

/* Bytes of caller memory a store of this desc needs. Returns NULL_POINTER, INVALID_ARGUMENT
   (*out_error naming the desc field). */
KVMIXDEF kvmix_result kvmix_session_store_memory_bytes(const kvmix_session_store_desc *desc,
                                                       size_t *out_bytes, kvmix_error *out_error);

/* Initializes an empty store in `memory` (16-byte aligned, of kvmix_session_store_memory_bytes;
   the store keeps pointers into it). Returns NULL_POINTER, INVALID_ARGUMENT (desc, alignment),
   BUFFER_TOO_SMALL, *out_error naming the desc field or the argument. */
KVMIXDEF kvmix_result kvmix_session_store_init(kvmix_session_store *store,
                                               const kvmix_session_store_desc *desc, void *memory,
                                               size_t memory_bytes, kvmix_error *out_error);

/* The memory of `key`'s session: its own when the store holds the session (*out_found 1), else
   a free entry's or the least recently used one's (an O(capacity) search), zeroed and now the
   key's (*out_found 0). Either way the session becomes the most recently used. A LOCAL key is
   never stored: *out_memory NULL, *out_found 0. Returns NULL_POINTER, INVALID_ARGUMENT (an
   unknown kind, n_ids out of 0 .. max_key_ids, ids NULL with n_ids > 0). Not thread-safe. */
KVMIXDEF kvmix_result kvmix_session_store_acquire(kvmix_session_store *store,
                                                  const kvmix_session_key *key, float **out_memory,
                                                  int32_t *out_found);

/* QueryMemory: per layer, one unit-norm row per query head (kv heads expanded under grouped-query
   attention) of what a session's requests asked for. At each request the mean of the post-RoPE
   query rows over its actionable span is blended in:
       m = decay * m + (1 - decay) * mean / |mean|,   then m / |m|      (each row on its own)
   A zero row (a new session's) takes the normalized mean; a zero mean leaves the row as it was.
   memory and the result: [n_layers][n_q_heads][head_dim]; queries: [n_tokens][n_layers]
   [n_q_heads][head_dim]. Sums in double. Returns NULL_POINTER, INVALID_ARGUMENT (counts, decay
   outside [0, 1)), BAD_VALUE (a query that is not finite; nothing written). */
KVMIXDEF kvmix_result kvmix_query_memory_update(float *memory, int32_t n_layers, int32_t n_q_heads,
                                                int32_t head_dim, const float *queries,
                                                int32_t n_tokens, float decay);

/* ------------------------------------------------------------------------------------------- */
/* Budgeted eviction: once a request's prompt ran, the positions of a sequence beyond a budget    */
/* are evicted (kvmix_cache_evict) lowest score first, never one of the forced set (the protected */
/* prefix and the request's actionable span). The scorers differ only in the scores they give;   */
/* the runner computes them (intent scores from the view, attention mass), these calls shape and */
/* select. Implementation: // >>intent.                                                          */

/* "intent", "query", "streaming", "h2o", "snapkv"; NULL for another value. */
KVMIXDEF const char *kvmix_evict_scorer_name(int32_t scorer);

/* Checks a policy and writes it back with defaults resolved (on failure *policy is unchanged and
   *out_error, may be NULL, names the field). Returns NULL_POINTER, INVALID_ARGUMENT. Pure. */
KVMIXDEF kvmix_result kvmix_evict_policy_resolve(kvmix_evict_policy *policy,
                                                 kvmix_error *out_error);

/* The live positions a sequence of n_positions positions keeps: budget_tokens, or
   ceil(budget_fraction * n_positions), at least 1. Returns NULL_POINTER, INVALID_ARGUMENT
   (a policy that does not resolve, n_positions < 0). */
KVMIXDEF kvmix_result kvmix_evict_budget(const kvmix_evict_policy *policy, int32_t n_positions,
                                         int32_t *out_keep);

/* The forced set of a request: forced[t] = 1 for the first prefix_tokens positions and for the
   actionable span [actionable_first, actionable_end), 0 elsewhere; forced: [n_positions].
   Returns NULL_POINTER, INVALID_ARGUMENT (counts, a span outside 0 .. n_positions). */
KVMIXDEF kvmix_result kvmix_evict_forced(const kvmix_evict_policy *policy, int32_t n_positions,
                                         int32_t actionable_first, int32_t actionable_end,
                                         uint8_t *forced);

/* Turns the runner's raw scores into the scorer's, in place: STREAMING scores[t] = t; the others
   each the maximum of the raw scores within pool_tokens / 2 positions either side (unchanged at
   pool_tokens 1), then the last max(recent_tokens, ceil(recent_fraction * keep)) positions
   +INFINITY (the recent floor; keep: kvmix_evict_budget of n_positions). -INFINITY
   (evicted) stays. A policy not yet resolved pools as its resolved form would.
   scratch: [n_positions] floats (when pooling; may be NULL otherwise). Returns NULL_POINTER,
   INVALID_ARGUMENT, BAD_VALUE (a NaN or +INFINITY raw score; nothing written). */
KVMIXDEF kvmix_result kvmix_evict_shape_scores(const kvmix_evict_policy *policy, float *scores,
                                               int32_t n_positions, float *scratch);

/* Chooses what to evict: of the positions t < n_positions with live[t] (NULL = all live), the
   forced ones stay, and the others, highest score first (the later position first on ties),
   fill what is left of keep; out_positions [n_positions] receives the rest in increasing order,
   *out_n_evict of them (none when the live positions fit in keep; every unforced one when the
   forced ones alone exceed it). Returns NULL_POINTER, INVALID_ARGUMENT (counts, keep < 0),
   BAD_VALUE (a NaN score of a live position; nothing written). Pure. */
KVMIXDEF kvmix_result kvmix_evict_select(const float *scores, const uint8_t *live,
                                         const uint8_t *forced, int32_t n_positions, int32_t keep,
                                         int32_t *out_positions, int32_t *out_n_evict);

/* ------------------------------------------------------------------------------------------- */
/* Intent residual (IntentKV's second phase): a learned correction of the INTENT scorer's raw    */
/* scores (the rule: QueryMemory scores summed over layers, before kvmix_evict_shape_scores), a  */
/* two-layer GELU MLP over a fixed list of per-position features, scaled by a learned scalar     */
/* clipped at inference. Its output projection starts at zero, so untrained weights give the     */
/* rule bit for bit. The weights are the caller's (trained outside kvmix on frozen-model         */
/* features; examples/intent_residual_json.h reads them from JSON). Implementation: // >>intent. */

/* The features of a position t, in this order, for a sequence of n positions (the newest n - 1)
   at a request of turn current_turn; kvmix_intent_residual_features writes them:
     RULE            the rule's raw score of t (finite; a position whose rule is infinite is not
                     rescored)
     LOG_AGE         log(1 + (n - 1 - t)): positions back from the newest, natural log
     LOG_TURNS_BACK  log(1 + max(0, current_turn - turn of t)); 0 without tags
     ROLE + r        1 for t's tag role r (a kvmix_tag_role, 7 of them), 0 for the other roles;
                     all 0 without tags
     IMAGE           1 for an image token (the tag's modality), else 0
     KEY_NORM        the mean over layers and kv heads of |key of t| (L2, as stored: dequantized)
     READOUT         the mean over layers and q heads h of kvmix_intent_readout (scale 0) of t's
                     key (as stored) of h's kv head against queries of h: the actionable span's
                     post-RoPE queries, or the QueryMemory vector the request scores with
   KEY_NORM and READOUT are the caller's to compute: kvmix_ref_view_key_features gives both for
   one layer with one query per head (the runners pass the memory they score with, and average
   the layers). Feature scaling, if any, is folded into w1 and b1 by whoever trains the
   weights. */
typedef enum kvmix_intent_feature {
    KVMIX_INTENT_FEATURE_RULE = 0,
    KVMIX_INTENT_FEATURE_LOG_AGE = 1,
    KVMIX_INTENT_FEATURE_LOG_TURNS_BACK = 2,
    KVMIX_INTENT_FEATURE_ROLE = 3, /* + kvmix_tag_role: 3 .. 9 */
    KVMIX_INTENT_FEATURE_IMAGE = 10,
    KVMIX_INTENT_FEATURE_KEY_NORM = 11,
    KVMIX_INTENT_FEATURE_READOUT = 12
} kvmix_intent_feature;
#define KVMIX_INTENT_RESIDUAL_N_FEATURES 13
#define KVMIX_INTENT_RESIDUAL_MAX_HIDDEN 256

/* The name of feature k, as weight files list them: "rule", "log_age", "log_turns_back",
   "role_instruction", "role_user", "role_assistant", "role_reasoning", "role_tool_call",
   "role_observation", "role_scaffold", "image", "key_norm", "readout"; NULL for another k. */
KVMIXDEF const char *kvmix_intent_residual_feature_name(int32_t feature);

/* The residual's weights (F = n_features, H = hidden), in caller memory; read-only to kvmix. */
typedef struct kvmix_intent_residual {
    int32_t n_features; /* F: KVMIX_INTENT_RESIDUAL_N_FEATURES (the list above, in its order) */
    int32_t hidden;     /* H: 1 .. KVMIX_INTENT_RESIDUAL_MAX_HIDDEN */
    const float *w1;    /* [H][F]: hidden unit j's weight of feature k at w1[j * F + k] */
    const float *b1;    /* [H] */
    const float *w2;    /* [H]: the output projection (zero on day zero) */
    float b2;           /* its bias (zero on day zero) */
    float alpha;        /* the learned scale of the residual */
    float alpha_max;    /* the inference clip: alpha is used clamped to [-alpha_max, alpha_max] */
} kvmix_intent_residual;

/* Checks weights: n_features, hidden in range (INVALID_ARGUMENT), w1, b1, w2 not NULL
   (NULL_POINTER), every weight, b2, alpha and alpha_max finite (BAD_VALUE), alpha_max >= 0
   (INVALID_ARGUMENT); *out_error (may be NULL) names the member. Pure. */
KVMIXDEF kvmix_result kvmix_intent_residual_check(const kvmix_intent_residual *w,
                                                  kvmix_error *out_error);

/* The feature rows of positions 0 .. n_positions - 1 (the list above): features [n_positions]
   [KVMIX_INTENT_RESIDUAL_N_FEATURES] from rule [n_positions] (the raw scores; -INFINITY for a dead
   position is copied as it is), tags [n_positions] (NULL: none), current_turn (the request's
   turn, with tags), key_norm and readout [n_positions] (each NULL: 0). Logarithms in double,
   rounded once. Returns NULL_POINTER, INVALID_ARGUMENT (n_positions < 0, current_turn < 0 with
   tags, a tag whose turn is negative or whose role or modality does not exist: "tags"),
   BAD_VALUE (a NaN rule, a key_norm negative or not finite, a readout not finite); *out_error
   names the argument; nothing is written on failure. Pure. */
KVMIXDEF kvmix_result kvmix_intent_residual_features(const float *rule, const kvmix_tag *tags,
                                                     int32_t current_turn, const float *key_norm,
                                                     const float *readout, int32_t n_positions,
                                                     float *features, kvmix_error *out_error);

/* The READOUT of one attention head: for each key i, with s_j = scale * dot(keys[i], queries[j])
   over the n_queries queries (scale 0 = 1 / sqrt(head_dim)), out[i] = sum_j p_j * s_j where
   p = softmax(s): the similarity of the key to the queries, weighted by how much each query
   would attend to it; 0 when n_queries is 0. keys [n_keys][head_dim], queries [n_queries]
   [head_dim], out [n_keys]. In double (dot products, then exp(s_j - max s)), rounded once,
   clamped to +-FLT_MAX. Time n_keys * n_queries * head_dim. Returns NULL_POINTER,
   INVALID_ARGUMENT (negative counts, head_dim < 1, scale negative or not finite), BAD_VALUE (a
   key or query not finite); nothing is written on failure. Pure. */
KVMIXDEF kvmix_result kvmix_intent_readout(const float *keys, int32_t n_keys, const float *queries,
                                           int32_t n_queries, int32_t head_dim, float scale,
                                           float *out, kvmix_error *out_error);

/* Rescored positions: for each i < n, with f = features[i] (a row of
   KVMIX_INTENT_RESIDUAL_N_FEATURES, normally kvmix_intent_residual_features's) and
   a = clamp(alpha, -alpha_max, alpha_max):
       x_j    = b1[j] + sum_k w1[j][k] * f[k]               (j < H, k ascending)
       r      = b2 + sum_j w2[j] * gelu(x_j)                (j ascending)
       out[i] = rule[i] + a * r                             (rounded once to float)
   in double, gelu(x) = x / 2 * (1 + erf(x / sqrt(2))) (the exact GELU, PyTorch's default
   nn.GELU()). out[i] = rule[i] exactly, bit for bit, when rule[i] is infinite (-INFINITY: a dead
   position; its features are not read), when a * r is 0, and for every i when a is 0 or w2 and
   b2 are all zero: zero output weights are the rule. A finite out is clamped to +-FLT_MAX. out
   may be rule (in place); features must not overlap out. Returns NULL_POINTER (w or its arrays,
   rule, features, out with n > 0), INVALID_ARGUMENT (n < 0, or as kvmix_intent_residual_check),
   BAD_VALUE (a weight not finite, a NaN rule, a feature not finite of a position with a finite
   rule); *out_error names the member or the argument; nothing is written on failure. Time
   n * H * F. Pure. */
KVMIXDEF kvmix_result kvmix_intent_residual_scores(const kvmix_intent_residual *w,
                                                   const float *features, const float *rule,
                                                   int32_t n, float *out, kvmix_error *out_error);

/* ------------------------------------------------------------------------------------------- */
/* Transfer tiers: which tier (FP16, INT8, INT4) each token of a prefilled sequence travels at   */
/* under a byte budget, for kvmix_payload_pack. Costs are real bytes with metadata, relative to  */
/* FP16 (at group 32, INT8 0.5625 and INT4 0.3125). Implementation: // >>tiers.                  */

/* Bytes of one token's row at INT8 and INT4 (per-token groups of group_size, their (scale, min)
   pairs included) over its FP16 row: out_cost[0] FP16 = 1, [1] INT8, [2] INT4. Returns
   NULL_POINTER, BAD_SHAPE (head_dim, group_size as kvmix_payload_describe takes them). */
KVMIXDEF kvmix_result kvmix_tier_costs(int32_t head_dim, int32_t group_size, double out_cost[3]);

/* Importance of each token: importance[j] = stat[j] * exp(-lambda * (n_tokens - 1 - j)), stat an
   attention statistic of the prefill (accumulated attention mass) or, without one, the norms of
   kvmix_tier_norms. Returns NULL_POINTER, INVALID_ARGUMENT (n_tokens < 0, lambda negative or not
   finite), BAD_VALUE (a stat that is negative or not finite; nothing written). */
KVMIXDEF kvmix_result kvmix_tier_importance(const float *stat, int32_t n_tokens, double lambda,
                                            float *importance);

/* The key/value-norm fallback statistic: norms[j] = sqrt(sum of squares of token j's keys and
   values over n_rows_per_token floats each), keys, values: [n_tokens][n_rows_per_token] (a
   token's rows of every layer and kv head, laid out one after another). Returns NULL_POINTER,
   INVALID_ARGUMENT, BAD_VALUE (a value not finite). */
KVMIXDEF kvmix_result kvmix_tier_norms(const float *keys, const float *values, int32_t n_tokens,
                                       int64_t n_rows_per_token, float *norms);

typedef struct kvmix_tier_desc {
    int32_t n_tokens;   /* >= 0 */
    int32_t head_dim;   /* for the tiers' real costs */
    int32_t group_size; /* of the INT8/INT4 rows; 0 = KVMIX_GROUP_SIZE_DEFAULT */
    int32_t n_sink;     /* first positions pinned to FP16 (kept first), 0 .. n_tokens */
    double budget;      /* b: bytes allowed over the all-FP16 bytes, (0, 1] */
    int32_t allow_int4; /* 0: the model's INT4 probe failed, FP16 and INT8 only */
    int32_t reserved;   /* 0 */
} kvmix_tier_desc;

/* What kvmix_tier_choose picked. */
typedef struct kvmix_tier_plan {
    int32_t n_fp16, n_int8, n_int4;
    int32_t n_dropped; /* the last resort: tokens not sent (KVMIX_PAYLOAD_NO_ROW) */
    double cost; /* bytes over the all-FP16 bytes, at most the budget unless sinks exceed it */
} kvmix_tier_plan;

/* Tiers under the budget: sinks FP16 first; then only the two adjacent tiers whose costs bracket
   what is left are used (FP16 + INT8 when it is at least all-INT8, else INT8 + INT4), as many of
   the higher as fit, the most important tokens taking it (the later on ties), so FP16 never
   meets INT4 outside the sinks. When even the cheapest allowed tier for every token does not
   fit, the least important tokens are not sent: their tier is KVMIX_PAYLOAD_NO_ROW, which a ROWS
   payload does not carry: send the runs between them as payloads of their own and evict them on
   the receiver (a last resort; sinks always stay). tiers: [n_tokens] kvmix_format values for
   kvmix_payload_pack. Sorts a work array of n_tokens indices (KVMIX_MALLOC). Returns
   NULL_POINTER, INVALID_ARGUMENT (counts, budget, reserved, allow_int4 not 0 or 1), BAD_SHAPE
   (head_dim, group_size), BAD_VALUE (an importance that is NaN), OUT_OF_MEMORY; nothing is
   written on error. *out_error (NULL: not wanted) names the field of kvmix_tier_desc or the
   argument at fault. Thread-safe. */
KVMIXDEF kvmix_result kvmix_tier_choose(const kvmix_tier_desc *desc, const float *importance,
                                        uint8_t *tiers, kvmix_tier_plan *out_plan,
                                        kvmix_error *out_error);

/* The INT4 tolerance probe: runs trial(ctx, index, budget, &passed) for index 0 .. n_trials - 1
   at an aggressive budget and sets *out_allow_int4 when at least n_pass of them passed (the
   paper: 3 trials at b = 0.3, 2 to pass). A trial transfers a sequence tiered with INT4 allowed
   and judges the answer; it returns KVMIX_SUCCESS or an error, which stops the probe and is
   returned (*out_allow_int4 untouched). *out_n_passed (may be NULL): trials that passed.
   Returns NULL_POINTER, INVALID_ARGUMENT (n_trials < 1, n_pass outside 1 .. n_trials, budget
   outside (0, 1]). */
typedef kvmix_result (*kvmix_tier_trial_fn)(void *ctx, int32_t index, double budget,
                                            int32_t *out_passed);
KVMIXDEF kvmix_result kvmix_tier_probe(kvmix_tier_trial_fn trial, void *ctx, int32_t n_trials,
                                       int32_t n_pass, double budget, int32_t *out_allow_int4,
                                       int32_t *out_n_passed);

#endif /* KVMIX_NO_POLICY */

// >>rules
/* ------------------------------------------------------------------------------------------- */
/* Format rules, shared by the host and the device. The pure arithmetic of the byte formats      */
/* (geometry, scale and minimum, codes), the checks of layouts and view blocks, and the payload  */
/* header's fields: written once, compiled as C99 here and as __host__ __device__ code when nvcc */
/* compiles kvmix_cuda.cu, which calls them instead of keeping copies. Private (kvmix__ names):  */
/* the formats themselves are documented in the >>formats and >>transfer rooms.                 */
/* ------------------------------------------------------------------------------------------- */
#include <math.h>
#include <string.h>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define KVMIX__RULE static __host__ __device__ inline
#else
#define KVMIX__RULE static inline
#endif
#if defined(__cplusplus) && __cplusplus >= 201402L
#define KVMIX__CONST constexpr /* usable in the kernels' template arguments */
#else
#define KVMIX__CONST
#endif

KVMIX__RULE uint32_t kvmix__float_bits(float value) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(value);
#else
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
#endif
}

KVMIX__RULE float kvmix__bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(bits);
#else
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
#endif
}

/* FP32 to FP16, rounding to nearest even; beyond the range: infinity; NaN: 0x7fff. */
KVMIX__RULE uint16_t kvmix__f2h(float value) {
#if defined(__CUDA_ARCH__)
    return __half_as_ushort(__float2half_rn(value));
#else
    uint32_t bits = kvmix__float_bits(value);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return 0x7fff;                      /* NaN */
    if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (magnitude >= 0x38800000u) {                                  /* normal half: >= 2^-14 */
        uint32_t odd = (magnitude >> 13) & 1u;
        magnitude += 0xfffu + odd;
        return (uint16_t)(sign | ((magnitude - 0x38000000u) >> 13));
    }
    if (magnitude < 0x33000000u) return sign; /* below 2^-25: rounds to zero */
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
#endif
}

KVMIX__RULE float kvmix__h2f(uint16_t half) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(half));
#else
    uint32_t sign = (uint32_t)(half & 0x8000u) << 16;
    uint32_t exponent = (half >> 10) & 0x1fu;
    uint32_t mantissa = half & 0x3ffu;
    if (exponent == 0x1f) return kvmix__bits_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        float magnitude = (float)mantissa * (1.0f / 16777216.0f); /* exact: mantissa * 2^-24 */
        return sign ? -magnitude : magnitude;
    }
    return kvmix__bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

/* Float operations each rounded once: the device compiler would otherwise fuse a multiply and
   an add, and the bytes and dequantized values must equal the host's. */
KVMIX__RULE float kvmix__fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}
KVMIX__RULE float kvmix__fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}
KVMIX__RULE float kvmix__fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
KVMIX__RULE float kvmix__fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

/* Little-endian 16-bit loads and stores, so packed bytes mean the same on every host. */
KVMIX__RULE uint16_t kvmix__load_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
KVMIX__RULE void kvmix__store_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v & 0xffu);
    p[1] = (uint8_t)(v >> 8);
}

/* An FP16 bit pattern of a finite value (not infinity or NaN). */
KVMIX__RULE int kvmix__fp16_finite(uint16_t h) { return (h & 0x7c00u) != 0x7c00u; }

/* A (scale, min) pair a quantize call can write: a finite scale with the sign bit clear (never
   -0) and a finite minimum. */
KVMIX__RULE int kvmix__qparams_valid(uint16_t scale_h, uint16_t min_h) {
    return (scale_h & 0x8000u) == 0 && kvmix__fp16_finite(scale_h) && kvmix__fp16_finite(min_h);
}

/* Bits per code of a format; 0 for a value that is not a kvmix_format. */
KVMIX__RULE KVMIX__CONST int kvmix__format_bits(int format) {
    switch (format) {
    case KVMIX_FORMAT_FP16: return 16;
    case KVMIX_FORMAT_INT8: return 8;
    case KVMIX_FORMAT_INT4: return 4;
    case KVMIX_FORMAT_INT2:
    case KVMIX_FORMAT_INT2_CHANNEL:
    case KVMIX_FORMAT_BOOSTED: return 2;
    default: return 0;
    }
}

KVMIX__RULE KVMIX__CONST int kvmix__is_per_token_int(int format) {
    return format == KVMIX_FORMAT_INT8 || format == KVMIX_FORMAT_INT4 ||
           format == KVMIX_FORMAT_INT2;
}

KVMIX__RULE KVMIX__CONST int kvmix__is_per_channel(int format) {
    return format == KVMIX_FORMAT_INT2_CHANNEL || format == KVMIX_FORMAT_BOOSTED;
}

/* A boosted block's channel count: a multiple of 4 (high bits pack 4 a byte), at most head_dim
   and KVMIX_MAX_BOOST. */
KVMIX__RULE int kvmix__boost_count_ok(int32_t n_boost, int32_t head_dim) {
    return n_boost >= 0 && n_boost % 4 == 0 && n_boost <= head_dim && n_boost <= KVMIX_MAX_BOOST;
}

/* A head_dim every format can take where its groups divide it: a multiple of 8, so that a
   per-channel block's 2-bit rows fill whole bytes and the reference's dot product runs in 8
   lanes, at most KVMIX_MAX_HEAD_DIM (the decoders' row buffers). */
#define KVMIX__HEAD_DIM_RULE "must be a positive multiple of 8 up to KVMIX_MAX_HEAD_DIM"
KVMIX__RULE int kvmix__head_dim_ok(int64_t head_dim) {
    return head_dim > 0 && head_dim % 8 == 0 && head_dim <= KVMIX_MAX_HEAD_DIM;
}

/* A check's verdict: the result and, when it failed, the argument and why (static strings), as
   a kvmix_error reports them. */
typedef struct kvmix__why {
    kvmix_result result;
    const char *argument;
    const char *reason;
} kvmix__why;

KVMIX__RULE kvmix__why kvmix__why_not(kvmix_result result, const char *argument,
                                      const char *reason) {
    kvmix__why w;
    w.result = result;
    w.argument = argument;
    w.reason = reason;
    return w;
}

KVMIX__RULE kvmix__why kvmix__why_ok(void) { return kvmix__why_not(KVMIX_SUCCESS, NULL, NULL); }

/* kvmix_layout's constraints; *group_size 0 resolves to KVMIX_GROUP_SIZE_DEFAULT for the
   per-token integer formats. Fields as kvmix_layout spells them. */
#define KVMIX__GROUP_RULE "must be a multiple of 8 that divides head_dim"
#define KVMIX__BOOST_RULE "must be a multiple of 4, at most head_dim and KVMIX_MAX_BOOST"
KVMIX__RULE kvmix__why kvmix__layout_why(int format, int64_t n_tokens, int32_t head_dim,
                                         int32_t *group_size, int32_t n_boost) {
    const kvmix_result shape = KVMIX_ERR_BAD_SHAPE;
    if (kvmix__format_bits(format) == 0)
        return kvmix__why_not(KVMIX_ERR_UNKNOWN_FORMAT, "format", "not a kvmix_format");
    if (n_tokens < 0) return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_tokens", "negative");
    if (!kvmix__head_dim_ok(head_dim))
        return kvmix__why_not(shape, "head_dim", KVMIX__HEAD_DIM_RULE);
    if (kvmix__is_per_token_int(format)) {
        if (*group_size == 0) *group_size = KVMIX_GROUP_SIZE_DEFAULT;
        if (*group_size < 0 || *group_size % 8 != 0 || head_dim % *group_size != 0)
            return kvmix__why_not(shape, "group_size", KVMIX__GROUP_RULE);
    } else if (*group_size != 0) {
        return kvmix__why_not(shape, "group_size", "must be 0: the format has no groups");
    }
    if (format == KVMIX_FORMAT_BOOSTED) {
        if (!kvmix__boost_count_ok(n_boost, head_dim))
            return kvmix__why_not(shape, "n_boost", KVMIX__BOOST_RULE);
    } else if (n_boost != 0) {
        return kvmix__why_not(shape, "n_boost", "must be 0: only BOOSTED boosts channels");
    }
    return kvmix__why_ok();
}

KVMIX__RULE kvmix_result kvmix__layout_check(int format, int64_t n_tokens, int32_t head_dim,
                                             int32_t *group_size, int32_t n_boost) {
    return kvmix__layout_why(format, n_tokens, head_dim, group_size, n_boost).result;
}

/* Sections of one block of a checked layout; offsets from the block start. */
typedef struct kvmix__sections {
    uint64_t data_bytes;  /* codes (dense codes for BOOSTED); FP16 rows for FP16 */
    uint64_t row_bytes;   /* one token's share of the data section */
    uint64_t high_offset; /* BOOSTED: high bits */
    uint64_t high_row_bytes;
    uint64_t meta_offset;
    uint64_t index_offset; /* BOOSTED: channel-to-slot index */
    uint64_t total_bytes;  /* 0 for a block of no tokens */
} kvmix__sections;

KVMIX__RULE kvmix__sections kvmix__block_sections(int format, int64_t n_tokens, int32_t head_dim,
                                                  int32_t group_size, int32_t n_boost) {
    kvmix__sections s;
    uint64_t n = (uint64_t)n_tokens, d = (uint64_t)head_dim;
    int boosted = format == KVMIX_FORMAT_BOOSTED;
    s.row_bytes = d * (uint64_t)kvmix__format_bits(format) / 8u;
    s.data_bytes = n * s.row_bytes;
    s.high_row_bytes = boosted ? (uint64_t)n_boost / 4u : 0u;
    s.high_offset = s.data_bytes;
    s.meta_offset = s.high_offset + n * s.high_row_bytes;
    if (format == KVMIX_FORMAT_FP16)
        s.index_offset = s.meta_offset;
    else if (kvmix__is_per_token_int(format))
        s.index_offset = s.meta_offset + n * (d / (uint64_t)group_size) * 4u;
    else
        s.index_offset = s.meta_offset + d * 4u;
    s.total_bytes = n == 0 ? 0u : s.index_offset + (boosted ? d : 0u);
    return s;
}

/* Byte offsets, from the block start, of token t's codes, its high bits (BOOSTED), the (scale,
   min) pair of its group g of `groups` (per-token formats) and channel c's pair (per-channel). */
KVMIX__RULE uint64_t kvmix__row_at(const kvmix__sections *s, int64_t t) {
    return (uint64_t)t * s->row_bytes;
}
KVMIX__RULE uint64_t kvmix__high_row_at(const kvmix__sections *s, int64_t t) {
    return s->high_offset + (uint64_t)t * s->high_row_bytes;
}
KVMIX__RULE uint64_t kvmix__token_meta_at(const kvmix__sections *s, int64_t t, int32_t groups,
                                          int32_t g) {
    return s->meta_offset + ((uint64_t)t * (uint64_t)groups + (uint64_t)g) * 4u;
}
KVMIX__RULE uint64_t kvmix__channel_meta_at(const kvmix__sections *s, int32_t c) {
    return s->meta_offset + (uint64_t)c * 4u;
}

/* A group's (scale, min) pair: FP16 bit patterns and their values. */
typedef struct kvmix__qparams {
    uint16_t scale_h;
    uint16_t min_h;
    float scale;
    float min;
} kvmix__qparams;

KVMIX__RULE uint16_t kvmix__fp16_step_down(uint16_t h) {
    if (h == 0x0000u || h == 0x8000u) return 0x8001u;
    return (h & 0x8000u) ? (uint16_t)(h + 1u) : (uint16_t)(h - 1u);
}

/* Scale grid S of a per-token group of `bits`-bit codes (see >>formats). */
KVMIX__RULE KVMIX__CONST unsigned kvmix__scale_grid(int bits) {
    return bits == 2 ? 4u : bits == 4 ? 16u : 1u;
}

/* Parameters for values in [lo, hi] with `levels` steps and scale grid `grid` (see >>formats).
   The test scale * levels + min is exact in double (FP16 operands, levels < 256), so it needs
   no care about rounding. */
KVMIX__RULE kvmix__qparams kvmix__choose_qparams(float lo, float hi, int levels, unsigned grid) {
    kvmix__qparams p;
    float step;
    p.min_h = kvmix__f2h(lo);
    if (kvmix__h2f(p.min_h) > lo) p.min_h = kvmix__fp16_step_down(p.min_h);
    p.min = kvmix__h2f(p.min_h);
    step = kvmix__fdiv(kvmix__fsub(hi, p.min), (float)levels);
    p.scale_h = (uint16_t)((kvmix__f2h(step) + grid - 1u) / grid * grid);
    while ((double)kvmix__h2f(p.scale_h) * levels + (double)p.min < (double)hi)
        p.scale_h = (uint16_t)(p.scale_h + grid); /* non-negative: the next grid FP16 up */
    p.scale = kvmix__h2f(p.scale_h);
    return p;
}

/* Code of x: rint((x - min) / scale) clamped to [0, levels]; 0 when scale is 0. */
KVMIX__RULE uint32_t kvmix__quantize_value(float x, kvmix__qparams p, int levels) {
    float q;
    if (p.scale_h == 0) return 0;
    q = rintf(kvmix__fdiv(kvmix__fsub(x, p.min), p.scale));
    if (q < 0.0f) q = 0.0f;
    if (q > (float)levels) q = (float)levels;
    return (uint32_t)q;
}

KVMIX__RULE float kvmix__dequantize_value(uint32_t q, float scale, float min) {
    return kvmix__fadd(kvmix__fmul((float)q, scale), min);
}

KVMIX__RULE void kvmix__store_qparams(uint8_t *meta, kvmix__qparams p) {
    kvmix__store_u16(meta, p.scale_h);
    kvmix__store_u16(meta + 2, p.min_h);
}

/* Code c of a row of `bits`-bit codes (2, 4 or 8: they never straddle a byte), low bits first;
   bit offset c * bits, so no division per code. put ORs into a zeroed row. */
KVMIX__RULE void kvmix__put_code(uint8_t *row, int32_t c, int bits, uint32_t q) {
    uint64_t at = (uint64_t)c * (uint64_t)bits;
    row[at >> 3] = (uint8_t)(row[at >> 3] | (q << (at & 7u)));
}

KVMIX__RULE uint32_t kvmix__get_code(const uint8_t *row, int32_t c, int bits) {
    uint64_t at = (uint64_t)c * (uint64_t)bits;
    return (row[at >> 3] >> (at & 7u)) & ((1u << bits) - 1u);
}

/* The 2-bit code of element (t, c) of a per-channel block, with the high bits of a boosted
   channel: its 4-bit code. */
KVMIX__RULE uint32_t kvmix__channel_code(int format, const uint8_t *block, const kvmix__sections *s,
                                         int64_t t, int32_t c) {
    uint32_t q = kvmix__get_code(block + kvmix__row_at(s, t), c, 2);
    if (format == KVMIX_FORMAT_BOOSTED) {
        uint8_t slot = block[s->index_offset + (uint64_t)c];
        if (slot != KVMIX_BOOST_NONE)
            q |= kvmix__get_code(block + kvmix__high_row_at(s, t), slot, 2) << 2;
    }
    return q;
}

/* The group of a view's keys (is_value 0) or values of `format`: value_group_size 0 takes
   group_size, 0 the default; formats without groups have none (0). */
KVMIX__RULE int32_t kvmix__view_group(int32_t group_size, int32_t value_group_size, int is_value,
                                      int format) {
    int32_t g = is_value && value_group_size != 0 ? value_group_size : group_size;
    if (!kvmix__is_per_token_int(format)) return 0;
    return g != 0 ? g : KVMIX_GROUP_SIZE_DEFAULT;
}

/* A view block of a view whose shape is checked (kvmix__view_shape_check): keys or values of
   n_kv_heads heads, head_bytes apart, n_tokens rows of `format` at `offset`, every head's block
   inside the base region of base_bytes. group and n_boost: the view's for this format. On success
   *out holds its sections. */
KVMIX__RULE kvmix_result kvmix__view_block_extent(int format, int32_t n_tokens, uint64_t offset,
                                                  uint32_t head_bytes, int32_t n_kv_heads,
                                                  int32_t head_dim, int32_t group, int32_t n_boost,
                                                  uint64_t base_bytes, kvmix__sections *out) {
    uint64_t extent;
    if (kvmix__format_bits(format) == 0) return KVMIX_ERR_UNKNOWN_FORMAT;
    if (n_tokens <= 0) return KVMIX_ERR_INVALID_ARGUMENT;
    *out = kvmix__block_sections(format, n_tokens, head_dim, group, n_boost);
    if (head_bytes < out->total_bytes) return KVMIX_ERR_INVALID_ARGUMENT;
    extent = (uint64_t)head_bytes * (uint64_t)(n_kv_heads - 1) + out->total_bytes;
    if (offset > base_bytes || extent > base_bytes - offset) return KVMIX_ERR_BUFFER_TOO_SMALL;
    return KVMIX_SUCCESS;
}

/* A view span's dead flags, if it has any (dead_index >= 0), lie inside n_dead_flags. */
KVMIX__RULE int kvmix__view_dead_ok(int32_t dead_index, int32_t n_tokens, int32_t n_dead_flags) {
    return dead_index == -1 || (dead_index >= 0 && n_tokens <= n_dead_flags - dead_index);
}

/* A sequence's span range [first, last) of a view of n_spans spans. */
KVMIX__RULE int kvmix__view_range_ok(int32_t first, int32_t last, int32_t n_spans) {
    return first >= 0 && last >= first && last <= n_spans;
}

/* The view's own fields (>>view): counts, head_dim, groups, boost count. Fields as kvmix_view
   spells them. */
KVMIX__RULE kvmix__why kvmix__view_shape_why(const kvmix_view *v) {
    const kvmix_result bad = KVMIX_ERR_INVALID_ARGUMENT, shape = KVMIX_ERR_BAD_SHAPE;
    int32_t groups[2];
    int i;
    if (v->n_seqs < 0) return kvmix__why_not(bad, "n_seqs", "negative");
    if (v->n_kv_heads <= 0) return kvmix__why_not(bad, "n_kv_heads", "must be at least 1");
    if (v->n_spans < 0) return kvmix__why_not(bad, "n_spans", "negative");
    if (v->n_dead_flags < 0) return kvmix__why_not(bad, "n_dead_flags", "negative");
    if (!kvmix__head_dim_ok(v->head_dim))
        return kvmix__why_not(shape, "head_dim", KVMIX__HEAD_DIM_RULE);
    groups[0] = kvmix__view_group(v->group_size, v->value_group_size, 0, KVMIX_FORMAT_INT4);
    groups[1] = kvmix__view_group(v->group_size, v->value_group_size, 1, KVMIX_FORMAT_INT4);
    for (i = 0; i < 2; i++) /* a value group of 0 is group_size's: named there first */
        if (groups[i] < 0 || groups[i] % 8 != 0 || v->head_dim % groups[i] != 0)
            return kvmix__why_not(shape, i ? "value_group_size" : "group_size", KVMIX__GROUP_RULE);
    if (!kvmix__boost_count_ok(v->n_boost, v->head_dim))
        return kvmix__why_not(shape, "n_boost", KVMIX__BOOST_RULE);
    return kvmix__why_ok();
}

KVMIX__RULE kvmix_result kvmix__view_shape_check(const kvmix_view *v) {
    return kvmix__view_shape_why(v).result;
}

/* The view's arrays are given where its counts need them. */
KVMIX__RULE kvmix__why kvmix__view_arrays_why(const kvmix_view *v) {
    const kvmix_result null = KVMIX_ERR_NULL_POINTER;
    if (!v->seq_first_span) return kvmix__why_not(null, "seq_first_span", "NULL");
    if (v->n_spans > 0 && !v->spans) return kvmix__why_not(null, "spans", "NULL with n_spans > 0");
    if (v->n_spans > 0 && !v->base) return kvmix__why_not(null, "base", "NULL with n_spans > 0");
    if (v->n_dead_flags > 0 && !v->dead)
        return kvmix__why_not(null, "dead", "NULL with n_dead_flags > 0");
    return kvmix__why_ok();
}

KVMIX__RULE kvmix_result kvmix__view_arrays_check(const kvmix_view *v) {
    return kvmix__view_arrays_why(v).result;
}

/* ---- the transfer payload (>>transfer) ---- */

#define KVMIX__PAYLOAD_MAX_BYTES ((uint64_t)1 << 62)

KVMIX__RULE void kvmix__store_u32(uint8_t *p, uint32_t v) {
    kvmix__store_u16(p, (uint16_t)(v & 0xffffu));
    kvmix__store_u16(p + 2, (uint16_t)(v >> 16));
}
KVMIX__RULE uint32_t kvmix__load_u32(const uint8_t *p) {
    return (uint32_t)kvmix__load_u16(p) | ((uint32_t)kvmix__load_u16(p + 2) << 16);
}
KVMIX__RULE void kvmix__store_u64(uint8_t *p, uint64_t v) {
    kvmix__store_u32(p, (uint32_t)(v & 0xffffffffu));
    kvmix__store_u32(p + 4, (uint32_t)(v >> 32));
}
KVMIX__RULE uint64_t kvmix__load_u64(const uint8_t *p) {
    return (uint64_t)kvmix__load_u32(p) | ((uint64_t)kvmix__load_u32(p + 4) << 32);
}

KVMIX__RULE uint64_t kvmix__round16(uint64_t n) { return (n + 15u) & ~(uint64_t)15u; }

/* The format of tier i (0, 1, 2: FP16, INT8, INT4). */
KVMIX__RULE int kvmix__tier_format(int i) {
    return i == 0 ? KVMIX_FORMAT_FP16 : i == 1 ? KVMIX_FORMAT_INT8 : KVMIX_FORMAT_INT4;
}

/* Tier i's token count in info. */
KVMIX__RULE int32_t kvmix__tier_count(const kvmix_payload_info *info, int i) {
    return i == 0 ? info->n_fp16 : i == 1 ? info->n_int8 : info->n_int4;
}

/* Sections of tier i's block in a payload of this shape (FP16 has no groups). */
KVMIX__RULE kvmix__sections kvmix__tier_sections(const kvmix_payload_info *info, int i) {
    return kvmix__block_sections(kvmix__tier_format(i), kvmix__tier_count(info, i),
                                 info->desc.head_dim, i == 0 ? 0 : info->desc.group_size, 0);
}

/* Bytes of tier i's block in the body, padded to 16. */
KVMIX__RULE uint64_t kvmix__tier_bytes(const kvmix_payload_info *info, int i) {
    return kvmix__round16(kvmix__tier_sections(info, i).total_bytes);
}

/* Bytes of one (layer, keys or values, kv head) slice of the body: its three tier blocks. */
KVMIX__RULE uint64_t kvmix__payload_slice(const kvmix_payload_info *info) {
    return kvmix__tier_bytes(info, 0) + kvmix__tier_bytes(info, 1) + kvmix__tier_bytes(info, 2);
}

/* Range checks of a description; writes it back with group_size resolved. Fields as
   kvmix_payload_desc spells them. */
KVMIX__RULE kvmix__why kvmix__payload_desc_why(kvmix_payload_desc *d) {
    const kvmix_result bad = KVMIX_ERR_INVALID_ARGUMENT;
    if (d->kind != KVMIX_PAYLOAD_ROWS && d->kind != KVMIX_PAYLOAD_RESIDUAL)
        return kvmix__why_not(bad, "kind", "not a kvmix_payload_kind");
    if (d->n_kv_heads < 1 || d->n_kv_heads > 65535)
        return kvmix__why_not(bad, "n_kv_heads", "must be in 1 .. 65535");
    if (d->n_layers < 1 || d->n_layers > 65535)
        return kvmix__why_not(bad, "n_layers", "must be in 1 .. 65535");
    if (d->first_layer < 0 || d->first_layer > 0x7fffffff - d->n_layers)
        return kvmix__why_not(bad, "first_layer",
                              "must be >= 0, first_layer + n_layers an int32_t");
    if (d->n_tokens < 0) return kvmix__why_not(bad, "n_tokens", "negative");
    if (d->first_position < 0) return kvmix__why_not(bad, "first_position", "negative");
    if (d->kind == KVMIX_PAYLOAD_ROWS && d->base_id != 0)
        return kvmix__why_not(bad, "base_id", "must be 0 in a ROWS payload");
    return kvmix__layout_why(KVMIX_FORMAT_INT8, 0, d->head_dim, &d->group_size, 0);
}

KVMIX__RULE kvmix_result kvmix__payload_check_desc(kvmix_payload_desc *d) {
    return kvmix__payload_desc_why(d).result;
}

/* Head and total sizes of info (desc checked, counts set); BAD_SHAPE beyond 2^62 bytes or
   size_t. */
KVMIX__RULE kvmix_result kvmix__payload_sizes(kvmix_payload_info *info) {
    uint64_t blocks = (uint64_t)info->desc.n_layers * 2u * (uint64_t)info->desc.n_kv_heads;
    uint64_t head = KVMIX_PAYLOAD_HEADER_BYTES + kvmix__round16((uint64_t)info->desc.n_tokens);
    uint64_t slice = kvmix__payload_slice(info); /* < 2^31 * 2 * 512 * 3: no overflow */
    if (slice > (KVMIX__PAYLOAD_MAX_BYTES - head) / blocks) return KVMIX_ERR_BAD_SHAPE;
    if (head + blocks * slice > (uint64_t)(size_t)-1) return KVMIX_ERR_BAD_SHAPE;
    info->head_bytes = (size_t)head;
    info->total_bytes = (size_t)(head + blocks * slice);
    return KVMIX_SUCCESS;
}

/* The KVMIX_PAYLOAD_HEADER_BYTES header bytes that info describes (reserved fields zero). */
KVMIX__RULE void kvmix__payload_header_put(const kvmix_payload_info *info, uint8_t *p) {
    const kvmix_payload_desc *d = &info->desc;
    int i;
    for (i = 0; i < KVMIX_PAYLOAD_HEADER_BYTES; i++) p[i] = 0;
    p[0] = 'K', p[1] = 'V', p[2] = 'M', p[3] = 'P';
    kvmix__store_u16(p + 4, KVMIX_PAYLOAD_VERSION);
    kvmix__store_u16(p + 6, (uint16_t)d->kind);
    kvmix__store_u32(p + 8, (uint32_t)d->head_dim);
    kvmix__store_u32(p + 12, (uint32_t)d->n_kv_heads);
    kvmix__store_u32(p + 16, (uint32_t)d->group_size);
    kvmix__store_u32(p + 20, (uint32_t)d->first_layer);
    kvmix__store_u32(p + 24, (uint32_t)d->n_layers);
    kvmix__store_u32(p + 28, (uint32_t)d->n_tokens);
    kvmix__store_u64(p + 32, (uint64_t)d->first_position);
    kvmix__store_u64(p + 40, d->id);
    kvmix__store_u64(p + 48, d->base_id);
    kvmix__store_u32(p + 56, (uint32_t)info->n_fp16);
    kvmix__store_u32(p + 60, (uint32_t)info->n_int8);
    kvmix__store_u32(p + 64, (uint32_t)info->n_int4);
    kvmix__store_u64(p + 72, (uint64_t)info->total_bytes);
}

#endif /* KVMIX_H */

/* =========================================================================================== */
/* Implementation                                                                               */
/* =========================================================================================== */
#ifdef KVMIX_IMPLEMENTATION
#ifndef KVMIX_IMPLEMENTATION_DONE
#define KVMIX_IMPLEMENTATION_DONE

#include <math.h>
#include <string.h>
/* A build for x86-64 without AVX2, FMA and F16C (plain -O2) still has the fast decode's AVX2
   loops with GCC and Clang: compiled for those instructions by a target pragma and taken where
   the CPU has them (KVMIX_NO_CPU_DISPATCH keeps such a build to its portable loops). Not with
   MSVC's headers (clang-cl) nor in CUDA sources, where the host decode is not what runs. */
#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) &&                               \
    (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 5)) && defined(__x86_64__) &&         \
    !defined(_MSC_VER) && !defined(__CUDACC__) && !defined(KVMIX_NO_CPU_DISPATCH)
#define KVMIX__AVX2_DISPATCH 1
#endif
#if (defined(__F16C__) && defined(__AVX__)) || defined(KVMIX__AVX2_DISPATCH)
#include <immintrin.h> /* the fast decode's FP16 rows and four-head loops */
#endif

#if defined(KVMIX_MALLOC) != defined(KVMIX_FREE)
#error "define both KVMIX_MALLOC and KVMIX_FREE, or neither"
#endif
#ifndef KVMIX_MALLOC
#include <stdlib.h>
#define KVMIX_MALLOC(bytes) malloc(bytes)
#define KVMIX_FREE(ptr)     free(ptr)
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
    case KVMIX_ERR_INVALID_ARGUMENT: return "an argument is out of range or not allowed now";
    case KVMIX_ERR_BAD_SHAPE: return "head_dim, group size or boost count not supported";
    case KVMIX_ERR_UNKNOWN_FORMAT: return "unknown format";
    case KVMIX_ERR_BUFFER_TOO_SMALL: return "buffer too small";
    case KVMIX_ERR_BAD_VALUE: return "input is NaN, infinite or beyond the FP16 range";
    case KVMIX_ERR_OUT_OF_MEMORY: return "no room left (allocator, arena, table or budget)";
    case KVMIX_ERR_UNSUPPORTED: return "not supported by this backend or build";
    case KVMIX_ERR_CORRUPT_DATA: return "packed bytes or bookkeeping are corrupt";
    case KVMIX_ERR_VERSION: return "serialized input of a version this build does not read";
    case KVMIX_ERR_MALFORMED: return "serialized input does not follow its byte layout";
    case KVMIX_ERR_NOT_FOUND: return "not found";
    case KVMIX_ERR_CUDA: return "CUDA runtime error";
    }
    return "unknown kvmix_result";
}

KVMIXDEF const char *kvmix_version_string(void) { return KVMIX_VERSION_STRING; }

/* Fills a caller's kvmix_error (NULL: not wanted) and passes the result on. */
static kvmix_result kvmix__fail(kvmix_error *out_error, kvmix_result result, const char *field,
                                const char *reason) {
    if (out_error) {
        out_error->field = field;
        out_error->reason = reason;
    }
    return result;
}

static kvmix_result kvmix__succeed(kvmix_error *out_error) {
    return kvmix__fail(out_error, KVMIX_SUCCESS, "", "");
}

KVMIXDEF uint16_t kvmix_fp32_to_fp16(float value) { return kvmix__f2h(value); }

KVMIXDEF float kvmix_fp16_to_fp32(uint16_t half) { return kvmix__h2f(half); }

KVMIXDEF uint16_t kvmix_fp32_to_bf16(float value) {
    uint32_t bits = kvmix__float_bits(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

KVMIXDEF float kvmix_bf16_to_fp32(uint16_t bf16) { return kvmix__bits_float((uint32_t)bf16 << 16); }

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
     scale = fp16 of (largest - min) / L (float division), its bit pattern rounded up to a
             multiple of S, then raised by S while min + L * scale < largest (evaluated
             exactly, in double), so every value lies in [min, min + L * scale]. S is 4 for
             INT2 and 16 for INT4 groups (scales with 9 and 7 significant bits), 1 otherwise:
             q * scale is then exact in FP16 for every code q of a per-token group, so a
             decoder may multiply codes by scales in FP16 without rounding;
     q     = 0 if scale == 0, else rint((x - min) / scale) in float (round half to even),
             clamped to [0, L].
   Dequantizing: x' = (float)q * scale + min, each operation rounded to float (no fused
   multiply-add), so |x' - x| <= scale / 2 up to float rounding.
*/

KVMIXDEF const char *kvmix_format_name(kvmix_format format) {
    switch (format) {
    case KVMIX_FORMAT_FP16: return "fp16";
    case KVMIX_FORMAT_INT8: return "int8";
    case KVMIX_FORMAT_INT4: return "int4";
    case KVMIX_FORMAT_INT2: return "int2";
    case KVMIX_FORMAT_INT2_CHANNEL: return "int2_channel";
    case KVMIX_FORMAT_BOOSTED: return "boosted";
    }
    return "unknown";
}

KVMIXDEF kvmix_result kvmix_layout_resolve(kvmix_layout *layout, kvmix_error *out_error) {
    kvmix_layout resolved;
    kvmix__why w;
    if (!layout) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "layout", "NULL");
    resolved = *layout;
    w = kvmix__layout_why(resolved.format, resolved.n_tokens, resolved.head_dim,
                          &resolved.group_size, resolved.n_boost);
    if (w.result != KVMIX_SUCCESS) return kvmix__fail(out_error, w.result, w.argument, w.reason);
    *layout = resolved;
    return kvmix__succeed(out_error);
}

/* Section sizes of a resolved layout. */
static kvmix__sections kvmix__layout_sections(const kvmix_layout *layout) {
    return kvmix__block_sections(layout->format, layout->n_tokens, layout->head_dim,
                                 layout->group_size, layout->n_boost);
}

KVMIXDEF kvmix_result kvmix_layout_bytes(const kvmix_layout *layout, size_t *out_bytes) {
    kvmix_layout resolved;
    kvmix_result r;
    if (!layout || !out_bytes) return KVMIX_ERR_NULL_POINTER;
    resolved = *layout;
    if ((r = kvmix_layout_resolve(&resolved, NULL)) != KVMIX_SUCCESS) return r;
    *out_bytes = kvmix__layout_sections(&resolved).total_bytes;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_layout_bits(const kvmix_layout *layout, double *out_bits) {
    kvmix_layout resolved;
    kvmix_result r;
    if (!layout || !out_bits) return KVMIX_ERR_NULL_POINTER;
    resolved = *layout;
    if ((r = kvmix_layout_resolve(&resolved, NULL)) != KVMIX_SUCCESS) return r;
    if (resolved.n_tokens == 0) return KVMIX_ERR_INVALID_ARGUMENT;
    *out_bits = (double)kvmix__layout_sections(&resolved).total_bytes * 8.0 /
                ((double)resolved.n_tokens * (double)resolved.head_dim);
    return KVMIX_SUCCESS;
}

static int kvmix__representable(float x) { return x >= -65504.0f && x <= 65504.0f; } /* NaN: no */

/* Row t of an FP16 or per-token block (zeroed before: codes are ORed in) from the floats x. */
static void kvmix__quantize_row(const kvmix_layout *l, const kvmix__sections *s, const float *x,
                                uint8_t *block, int32_t t) {
    int bits = kvmix__format_bits(l->format), levels = (1 << bits) - 1;
    int32_t groups, g, c;
    uint8_t *row = block + (size_t)t * s->row_bytes;
    if (l->format == KVMIX_FORMAT_FP16) {
        for (c = 0; c < l->head_dim; c++) kvmix__store_u16(row + 2 * c, kvmix_fp32_to_fp16(x[c]));
        return;
    }
    groups = l->head_dim / l->group_size;
    for (g = 0; g < groups; g++) {
        int32_t c0 = g * l->group_size, c1 = c0 + l->group_size;
        float lo = x[c0], hi = x[c0];
        kvmix__qparams p;
        for (c = c0; c < c1; c++) {
            if (x[c] < lo) lo = x[c];
            if (x[c] > hi) hi = x[c];
        }
        p = kvmix__choose_qparams(lo, hi, levels, kvmix__scale_grid(bits));
        for (c = c0; c < c1; c++)
            kvmix__put_code(row, c, bits, kvmix__quantize_value(x[c], p, levels));
        kvmix__store_qparams(block + kvmix__token_meta_at(s, t, groups, g), p);
    }
}

static void kvmix__quantize_rows(const kvmix_layout *l, const float *src, int32_t stride,
                                 uint8_t *dst) {
    kvmix__sections s = kvmix__layout_sections(l);
    int32_t t;
    for (t = 0; t < l->n_tokens; t++) kvmix__quantize_row(l, &s, src + (size_t)t * stride, dst, t);
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
        p = kvmix__choose_qparams(lo, hi, levels, 1u);
        for (t = 0; t < l->n_tokens; t++) {
            uint32_t q = kvmix__quantize_value(src[(size_t)t * stride + c], p, levels);
            kvmix__put_code(dst + (size_t)t * s.row_bytes, c, 2, q & 3u);
            if (is_boosted[c]) kvmix__put_code(dst + kvmix__high_row_at(&s, t), slot, 2, q >> 2);
        }
        kvmix__store_qparams(dst + kvmix__channel_meta_at(&s, c), p);
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
    if ((r = kvmix_layout_resolve(&l, NULL)) != KVMIX_SUCCESS) return r;
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
    if (l.format == KVMIX_FORMAT_FP16 || kvmix__is_per_token_int(l.format))
        kvmix__quantize_rows(&l, src, row_stride, (uint8_t *)dst);
    else
        kvmix__quantize_per_channel(&l, src, row_stride, (uint8_t *)dst);
    return KVMIX_SUCCESS;
}

/* Checks what a quantize call guarantees about packed bytes: finite FP16 rows and parameters,
   scales with the sign bit clear, and a boost index that gives each of the n_boost slots to exactly one
   channel. */
static kvmix_result kvmix__check_block(const kvmix_layout *l, const uint8_t *block) {
    kvmix__sections s = kvmix__layout_sections(l);
    size_t meta_end = s.index_offset, i;
    if (l->n_tokens == 0) return KVMIX_SUCCESS;
    if (l->format == KVMIX_FORMAT_FP16) {
        for (i = 0; i < s.total_bytes; i += 2)
            if (!kvmix__fp16_finite(kvmix__load_u16(block + i))) return KVMIX_ERR_CORRUPT_DATA;
        return KVMIX_SUCCESS;
    }
    for (i = s.meta_offset; i < meta_end; i += 4)
        if (!kvmix__qparams_valid(kvmix__load_u16(block + i), kvmix__load_u16(block + i + 2)))
            return KVMIX_ERR_CORRUPT_DATA;
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
    *scale = kvmix__h2f(kvmix__load_u16(meta));
    *min = kvmix__h2f(kvmix__load_u16(meta + 2));
}

/* The scale and minimum of every channel of a checked per-channel block: a block's rows share
   them, so a reader of many rows decodes them once. */
static void kvmix__channel_params(const kvmix_layout *l, const kvmix__sections *s,
                                  const uint8_t *block, float *scale, float *min) {
    int32_t c;
    for (c = 0; c < l->head_dim; c++)
        kvmix__meta_at(block + kvmix__channel_meta_at(s, c), &scale[c], &min[c]);
}

/* Row t of a checked per-channel block, given its channel parameters. */
static void kvmix__decode_channel_row(const kvmix_layout *l, const kvmix__sections *s,
                                      const uint8_t *block, int32_t t, const float *scale,
                                      const float *min, float *out) {
    int32_t c;
    for (c = 0; c < l->head_dim; c++)
        out[c] = kvmix__dequantize_value(kvmix__channel_code(l->format, block, s, t, c), scale[c],
                                         min[c]);
}

/* Row t of a checked block; the one decoder that attention and dequantize share. */
static void kvmix__decode_row(const kvmix_layout *l, const kvmix__sections *s, const uint8_t *block,
                              int32_t t, float *out) {
    const uint8_t *row = block + kvmix__row_at(s, t);
    int bits = kvmix__format_bits(l->format);
    int32_t c;
    float scale, min;
    if (l->format == KVMIX_FORMAT_FP16) {
        for (c = 0; c < l->head_dim; c++) out[c] = kvmix__h2f(kvmix__load_u16(row + 2 * c));
    } else if (kvmix__is_per_token_int(l->format)) {
        int32_t groups = l->head_dim / l->group_size, g;
        for (g = 0; g < groups; g++) { /* one scale and minimum per group */
            kvmix__meta_at(block + kvmix__token_meta_at(s, t, groups, g), &scale, &min);
            for (c = g * l->group_size; c < (g + 1) * l->group_size; c++)
                out[c] = kvmix__dequantize_value(kvmix__get_code(row, c, bits), scale, min);
        }
    } else {
        float scales[KVMIX_MAX_HEAD_DIM], mins[KVMIX_MAX_HEAD_DIM];
        kvmix__channel_params(l, s, block, scales, mins);
        kvmix__decode_channel_row(l, s, block, t, scales, mins, out);
    }
}

/* Resolves the layout and checks the packed block `src` of `src_bytes`. */
static kvmix_result kvmix__open_block(const kvmix_layout *layout, const void *src, size_t src_bytes,
                                      kvmix_layout *l, kvmix__sections *s) {
    kvmix_result r;
    if (!layout) return KVMIX_ERR_NULL_POINTER;
    *l = *layout;
    if ((r = kvmix_layout_resolve(l, NULL)) != KVMIX_SUCCESS) return r;
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
        if ((r = kvmix_layout_resolve(&l, NULL)) != KVMIX_SUCCESS) return r;
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

/* q . k over dim channels (a multiple of 8) in 8 interleaved partial sums, added pairwise: a
   fixed order, so every build gives the same bits, that a compiler can vectorize. */
static inline float kvmix__dot(const float *q, const float *k, int32_t dim) {
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int32_t c, j;
    for (c = 0; c < dim; c += 8)
        for (j = 0; j < 8; j++) part[j] += q[c + j] * k[c + j];
    return ((part[0] + part[4]) + (part[2] + part[6])) +
           ((part[1] + part[5]) + (part[3] + part[7]));
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
    float key_scale[KVMIX_MAX_HEAD_DIM], key_min[KVMIX_MAX_HEAD_DIM];
    int32_t dim, t, g, channel_keys;
    kvmix_layout_resolve(&kl, NULL);
    kvmix_layout_resolve(&vl, NULL);
    dim = kl.head_dim;
    ks = kvmix__layout_sections(&kl);
    vs = kvmix__layout_sections(&vl);
    kblock = kvmix__head_block(span->keys, span->key_head_bytes, &ks, h);
    vblock = kvmix__head_block(span->values, span->value_head_bytes, &vs, h);
    channel_keys = kvmix__is_per_channel(kl.format);
    if (channel_keys) kvmix__channel_params(&kl, &ks, kblock, key_scale, key_min);
    for (t = 0; t < kl.n_tokens; t++) {
        if (span->dead && span->dead[t]) continue;
        if (channel_keys)
            kvmix__decode_channel_row(&kl, &ks, kblock, t, key_scale, key_min, key);
        else
            kvmix__decode_row(&kl, &ks, kblock, t, key);
        kvmix__decode_row(&vl, &vs, vblock, t, value);
        for (g = 0; g < n_q; g++) {
            const float *qrow = q + (size_t)g * dim;
            kvmix__softmax_add(&states[g], acc + (size_t)g * dim, dim,
                               kvmix__dot(qrow, key, dim) * scale, value);
        }
    }
}

static void kvmix__heads_begin(kvmix__softmax_state *states, float *acc, int32_t n_q, int32_t dim) {
    int32_t g, c;
    for (g = 0; g < n_q; g++) {
        states[g].max = -INFINITY;
        states[g].sum = 0.0f;
        for (c = 0; c < dim; c++) acc[(size_t)g * dim + c] = 0.0f;
    }
}

/* Normalizes the accumulated outputs and writes the log-sum-exp when lse is not NULL; no live
   token gives 0, -inf. */
static void kvmix__heads_finish(const kvmix__softmax_state *states, float *out, float *lse,
                                int32_t n_q, int32_t dim) {
    int32_t g, c;
    for (g = 0; g < n_q; g++) {
        float inv = states[g].sum > 0.0f ? 1.0f / states[g].sum : 0.0f;
        for (c = 0; c < dim; c++) out[(size_t)g * dim + c] *= inv;
        if (lse) lse[g] = states[g].sum > 0.0f ? states[g].max + logf(states[g].sum) : -INFINITY;
    }
}

/* The spans of one sequence: a caller's array, or a range of a view's spans. */
typedef struct kvmix__span_list {
    const kvmix_span *spans; /* the array, or NULL for a view range */
    const kvmix_view *view;
    int32_t first;
    int32_t count;
} kvmix__span_list;

static int kvmix__format_known(int32_t format) { return kvmix__format_bits(format) != 0; }

/* A (key, value) pair of formats a cache stores, a zero format standing for a default. */
static int kvmix__precision_known(kvmix_cache_precision p) {
    return (p.key_format == 0 || kvmix__format_known(p.key_format)) &&
           (p.value_format == 0 || kvmix__format_known(p.value_format));
}

/* Whether v is in [lo, hi] and a multiple of `multiple`: the shape of most desc rules. */
static int kvmix__int_in(int32_t v, int32_t lo, int32_t hi, int32_t multiple) {
    return v >= lo && v <= hi && v % multiple == 0;
}

/* The block layout of a view's keys or values; the format must be known. */
static kvmix_layout kvmix__view_layout(const kvmix_view *view, int is_value, uint8_t format,
                                       int32_t n_tokens) {
    kvmix_layout l;
    l.format = (kvmix_format)format;
    l.n_tokens = n_tokens;
    l.head_dim = view->head_dim;
    l.group_size = kvmix__view_group(view->group_size, view->value_group_size, is_value, format);
    l.n_boost = l.format == KVMIX_FORMAT_BOOSTED ? view->n_boost : 0;
    return l;
}

/* A view span as a kvmix_span whose extents run to the end of the base region. */
static kvmix_span kvmix__span_of_view(const kvmix_view *view, const kvmix_view_span *vs) {
    kvmix_span s;
    s.key_layout = kvmix__view_layout(view, 0, vs->key_format, vs->n_tokens);
    s.value_layout = kvmix__view_layout(view, 1, vs->value_format, vs->n_tokens);
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
                                out + (size_t)first * dim, lse ? lse + first : NULL);
        }
}

static kvmix_result kvmix__check_desc(const kvmix_attention_desc *d) {
    if (d->n_kv_heads <= 0 || d->n_q_heads <= 0 || d->n_q_heads % d->n_kv_heads != 0 ||
        !(d->scale >= 0.0f) || isinf(d->scale))
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (!kvmix__head_dim_ok(d->head_dim)) return KVMIX_ERR_BAD_SHAPE;
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
    if (!desc || !q || !out) return KVMIX_ERR_NULL_POINTER;
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
                                                const float *out_b, const float *lse_b, float *out,
                                                float *lse) {
    int32_t h, c;
    if (!out_a || !lse_a || !out_b || !lse_b || !out) return KVMIX_ERR_NULL_POINTER;
    if (n_heads < 0 || head_dim < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    for (h = 0; h < n_heads; h++) {
        float la = lse_a[h], lb = lse_b[h], m = la > lb ? la : lb, wa, wb, total;
        if (m == -INFINITY) { /* both empty */
            for (c = 0; c < head_dim; c++) out[(size_t)h * head_dim + c] = 0.0f;
            if (lse) lse[h] = -INFINITY;
            continue;
        }
        wa = expf(la - m);
        wb = expf(lb - m);
        total = wa + wb;
        for (c = 0; c < head_dim; c++) {
            size_t i = (size_t)h * head_dim + c;
            out[i] = (wa * out_a[i] + wb * out_b[i]) / total;
        }
        if (lse) lse[h] = m + logf(total);
    }
    return KVMIX_SUCCESS;
}

// >>view

/* A view span of a view whose shape is checked: its dead flags and both blocks. Fields as
   kvmix_view_span spells them. */
static kvmix__why kvmix__view_span_why(const kvmix_view *view, const kvmix_view_span *vs) {
    const kvmix_result bad = KVMIX_ERR_INVALID_ARGUMENT;
    kvmix__sections unused;
    kvmix_result r;
    int kv;
    if (vs->n_tokens <= 0) return kvmix__why_not(bad, "n_tokens", "a span's must be at least 1");
    if (!kvmix__view_dead_ok(vs->dead_index, vs->n_tokens, view->n_dead_flags))
        return kvmix__why_not(bad, "dead_index", "a span's flags must lie in n_dead_flags (or -1)");
    for (kv = 0; kv < 2; kv++) {
        int format = kv ? vs->value_format : vs->key_format;
        r = kvmix__view_block_extent(
            format, vs->n_tokens, kv ? vs->value_offset : vs->key_offset,
            kv ? vs->value_head_bytes : vs->key_head_bytes, view->n_kv_heads, view->head_dim,
            kvmix__view_group(view->group_size, view->value_group_size, kv, format), view->n_boost,
            view->base_bytes, &unused);
        /* with n_tokens checked, each of the extent's failures has one cause */
        if (r == KVMIX_ERR_UNKNOWN_FORMAT)
            return kvmix__why_not(r, kv ? "value_format" : "key_format", "not a kvmix_format");
        if (r == KVMIX_ERR_BUFFER_TOO_SMALL)
            return kvmix__why_not(r, kv ? "value_offset" : "key_offset",
                                  "the heads' blocks end past base_bytes");
        if (r != KVMIX_SUCCESS)
            return kvmix__why_not(r, kv ? "value_head_bytes" : "key_head_bytes",
                                  "less than one head's block");
    }
    return kvmix__why_ok();
}

/* The view's sequence boundaries: from 0 to n_spans, never decreasing. */
static kvmix__why kvmix__view_sequences_why(const kvmix_view *view) {
    int32_t s;
    if (view->seq_first_span[0] != 0 || view->seq_first_span[view->n_seqs] != view->n_spans)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "seq_first_span",
                              "must start at 0 and end at n_spans");
    for (s = 0; s < view->n_seqs; s++)
        if (!kvmix__view_range_ok(view->seq_first_span[s], view->seq_first_span[s + 1],
                                  view->n_spans))
            return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "seq_first_span",
                                  "must not decrease, within 0 .. n_spans");
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_view_check(const kvmix_view *view, kvmix_error *out_error) {
    kvmix__why w;
    int32_t i;
    if (!view) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "view", "NULL");
    if ((w = kvmix__view_shape_why(view)).result != KVMIX_SUCCESS ||
        (w = kvmix__view_arrays_why(view)).result != KVMIX_SUCCESS ||
        (w = kvmix__view_sequences_why(view)).result != KVMIX_SUCCESS)
        return kvmix__fail(out_error, w.result, w.argument, w.reason);
    for (i = 0; i < view->n_spans; i++)
        if ((w = kvmix__view_span_why(view, &view->spans[i])).result != KVMIX_SUCCESS)
            return kvmix__fail(out_error, w.result, w.argument, w.reason);
    return kvmix__succeed(out_error);
}

static kvmix__span_list kvmix__view_sequence(const kvmix_view *view, int32_t s) {
    kvmix__span_list list;
    list.spans = NULL;
    list.view = view;
    list.first = view->seq_first_span[s];
    list.count = view->seq_first_span[s + 1] - list.first;
    return list;
}

KVMIXDEF kvmix_result kvmix_ref_view_decode(const kvmix_view *view, int32_t n_q_heads, float scale,
                                            const float *q, float *out, float *lse) {
    kvmix_attention_desc desc;
    kvmix_result r;
    int32_t s;
    if (!q || !out) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix_view_check(view, NULL)) != KVMIX_SUCCESS) return r;
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
                               out + first * view->head_dim, lse ? lse + first : NULL);
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
        kvmix__decode_row(kl, ks, kvmix__head_block(span->keys, span->key_head_bytes, ks, h), t,
                          key);
        for (g = 0; g < group; g++)
            for (c = 0; c < dim; c++) sum += memory[(size_t)(h * group + g) * dim + c] * key[c];
    }
    return sum;
}

KVMIXDEF kvmix_result kvmix_ref_view_score(const kvmix_view *view, int32_t seq, int32_t n_q_heads,
                                           const float *memory, float *scores,
                                           int32_t capacity_tokens) {
    kvmix_attention_desc desc;
    kvmix__span_list list;
    kvmix_result r;
    int32_t pos = 0, i, t;
    if (!memory || !scores) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix_view_check(view, NULL)) != KVMIX_SUCCESS) return r;
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
        kvmix_layout_resolve(&kl, NULL);
        ks = kvmix__layout_sections(&kl);
        for (t = 0; t < kl.n_tokens && pos < capacity_tokens; t++, pos++)
            scores[pos] = span.dead && span.dead[t]
                              ? -INFINITY
                              : kvmix__score_token(&span, &kl, &ks, t, view->n_kv_heads,
                                                   n_q_heads / view->n_kv_heads, memory);
    }
    return KVMIX_SUCCESS;
}

/* scale * dot(q, key_t of kv head h) for token t of a checked span; key decoded into key[]. */
static float kvmix__head_logit(const kvmix_span *span, const kvmix_layout *kl,
                               const kvmix__sections *ks, int32_t t, int32_t h, const float *q,
                               float scale, float *key) {
    float sum = 0.0f;
    int32_t c;
    kvmix__decode_row(kl, ks, kvmix__head_block(span->keys, span->key_head_bytes, ks, h), t, key);
    for (c = 0; c < kl->head_dim; c++) sum += q[c] * key[c];
    return sum * scale;
}

/* The checks kvmix_ref_view_intent_score and kvmix_ref_view_key_features share: the view, the
   arguments, the query heads against the view's shape, and sequence seq's spans (into *list). */
static kvmix_result kvmix__query_sequence(const kvmix_view *view, int32_t seq, int32_t n_q_heads,
                                          float scale, int32_t capacity_tokens,
                                          kvmix__span_list *list) {
    kvmix_attention_desc desc;
    kvmix_result r;
    if ((r = kvmix_view_check(view, NULL)) != KVMIX_SUCCESS) return r;
    if (seq < 0 || seq >= view->n_seqs || capacity_tokens < 0 || !(scale >= 0.0f) ||
        scale == INFINITY)
        return KVMIX_ERR_INVALID_ARGUMENT;
    desc.n_q_heads = n_q_heads;
    desc.n_kv_heads = view->n_kv_heads;
    desc.head_dim = view->head_dim;
    desc.scale = scale;
    if ((r = kvmix__check_desc(&desc)) != KVMIX_SUCCESS) return r;
    *list = kvmix__view_sequence(view, seq);
    return kvmix__check_span_list(&desc, list);
}

/* One query head's pass over the first `capacity` tokens of a sequence: with add 0, its softmax
   max and sum (*m, *l, online); with add 1, p_t = exp(logit - m) / l added to scores[t]. */
static void kvmix__intent_pass(const kvmix__span_list *list, int32_t kv_head, const float *q,
                               float scale, int32_t capacity, int add, float *m, float *l,
                               float *scores) {
    float key[KVMIX_MAX_HEAD_DIM];
    int32_t i, t, pos = 0;
    for (i = 0; i < list->count && pos < capacity; i++) {
        kvmix_span span = kvmix__span_at(list, i);
        kvmix_layout kl = span.key_layout;
        kvmix__sections ks;
        kvmix_layout_resolve(&kl, NULL);
        ks = kvmix__layout_sections(&kl);
        for (t = 0; t < kl.n_tokens && pos < capacity; t++, pos++) {
            float x;
            if (span.dead && span.dead[t]) continue;
            x = kvmix__head_logit(&span, &kl, &ks, t, kv_head, q, scale, key);
            if (add) {
                scores[pos] += expf(x - *m) / *l;
            } else if (x > *m) {
                *l = *l * expf(*m - x) + 1.0f;
                *m = x;
            } else {
                *l += expf(x - *m);
            }
        }
    }
}

KVMIXDEF kvmix_result kvmix_ref_view_intent_score(const kvmix_view *view, int32_t seq,
                                                  int32_t n_q_heads, float scale,
                                                  const float *memory, float *scores,
                                                  int32_t capacity_tokens) {
    kvmix__span_list list;
    kvmix_result r;
    int32_t h, i, t, pos = 0, group;
    if (!memory || !scores) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__query_sequence(view, seq, n_q_heads, scale, capacity_tokens, &list)) !=
        KVMIX_SUCCESS)
        return r;
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)view->head_dim);
    group = n_q_heads / view->n_kv_heads;
    for (i = 0; i < list.count && pos < capacity_tokens; i++) { /* live 0, dead -inf */
        kvmix_span span = kvmix__span_at(&list, i);
        for (t = 0; t < span.key_layout.n_tokens && pos < capacity_tokens; t++, pos++)
            scores[pos] = span.dead && span.dead[t] ? -INFINITY : 0.0f;
    }
    for (h = 0; h < n_q_heads; h++) {
        const float *q = memory + (size_t)h * (size_t)view->head_dim;
        float m = -INFINITY, l = 0.0f;
        kvmix__intent_pass(&list, h / group, q, scale, capacity_tokens, 0, &m, &l, scores);
        if (l > 0.0f)
            kvmix__intent_pass(&list, h / group, q, scale, capacity_tokens, 1, &m, &l, scores);
    }
    return KVMIX_SUCCESS;
}

/* Token t of a checked span: the mean over kv heads of its key's norm, and the mean over query
   heads of scale * dot(memory of the head, its kv head's key). */
static void kvmix__key_features_token(const kvmix_span *span, const kvmix_layout *kl,
                                      const kvmix__sections *ks, int32_t t, int32_t n_kv_heads,
                                      int32_t group, const float *memory, float scale,
                                      float *key_norm, float *readout) {
    float key[KVMIX_MAX_HEAD_DIM], norms = 0.0f, logits = 0.0f;
    int32_t h, g, c, dim = kl->head_dim;
    for (h = 0; h < n_kv_heads; h++) {
        float squares = 0.0f;
        kvmix__decode_row(kl, ks, kvmix__head_block(span->keys, span->key_head_bytes, ks, h), t,
                          key);
        for (c = 0; c < dim; c++) squares += key[c] * key[c];
        norms += sqrtf(squares);
        for (g = 0; g < group; g++) {
            float dot = 0.0f;
            for (c = 0; c < dim; c++) dot += memory[(size_t)(h * group + g) * dim + c] * key[c];
            logits += dot * scale;
        }
    }
    *key_norm = norms / (float)n_kv_heads;
    *readout = logits / (float)(n_kv_heads * group);
}

KVMIXDEF kvmix_result kvmix_ref_view_key_features(const kvmix_view *view, int32_t seq,
                                                  int32_t n_q_heads, float scale,
                                                  const float *memory, float *key_norm,
                                                  float *readout, int32_t capacity_tokens) {
    kvmix__span_list list;
    kvmix_result r;
    int32_t i, t, pos = 0;
    if (!memory || !key_norm || !readout) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__query_sequence(view, seq, n_q_heads, scale, capacity_tokens, &list)) !=
        KVMIX_SUCCESS)
        return r;
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)view->head_dim);
    for (i = 0; i < list.count && pos < capacity_tokens; i++) {
        kvmix_span span = kvmix__span_at(&list, i);
        kvmix_layout kl = span.key_layout;
        kvmix__sections ks;
        kvmix_layout_resolve(&kl, NULL);
        ks = kvmix__layout_sections(&kl);
        for (t = 0; t < kl.n_tokens && pos < capacity_tokens; t++, pos++) {
            key_norm[pos] = readout[pos] = 0.0f;
            if (!(span.dead && span.dead[t]))
                kvmix__key_features_token(&span, &kl, &ks, t, view->n_kv_heads,
                                          n_q_heads / view->n_kv_heads, memory, scale,
                                          &key_norm[pos], &readout[pos]);
        }
    }
    return KVMIX_SUCCESS;
}

// >>fast

static size_t kvmix__align8(size_t n) { return (n + 7) / 8 * 8; }

/* The fast CPU decode (kvmix_view_decode). A task is (sequence, kv head, chunk of spans); it
   keeps per query head an unnormalized output, a running max and a running sum in the workspace
   (a "partial"), which a merge in chunk order turns into out and lse. Rows are decoded a tile at
   a time into floats on the stack (KVMIX__TILE_FLOATS per operand), then every query head of
   the kv head takes the tile's logits, one softmax rescale and one weighted sum of its values. */

#define KVMIX__TILE_FLOATS 4096 /* floats of one decoded tile: 32 rows at head_dim 128 */
#define KVMIX__TILE_ROWS   32   /* rows of a tile at most: loops of a known count vectorize */

#if defined(__GNUC__) || defined(__clang__) || defined(_MSC_VER)
#define KVMIX__RESTRICT __restrict
#else
#define KVMIX__RESTRICT
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVMIX__AVX2 1 /* the decode loops below in 256-bit registers */
#endif
/* The AVX2 loops are compiled in (kvmix__avx2_runs says whether they run); in a dispatching build
   between KVMIX__AVX2_BEGIN and KVMIX__AVX2_END, which compile them for those instructions. */
#if defined(KVMIX__AVX2) || defined(KVMIX__AVX2_DISPATCH)
#define KVMIX__AVX2_LOOPS 1
#endif
/* _Pragma takes one string literal, which the formatter would split: */
/* clang-format off */
#if defined(KVMIX__AVX2_DISPATCH) && defined(__clang__)
#define KVMIX__AVX2_BEGIN \
    _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define KVMIX__AVX2_END _Pragma("clang attribute pop")
#elif defined(KVMIX__AVX2_DISPATCH)
#define KVMIX__AVX2_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define KVMIX__AVX2_END   _Pragma("GCC pop_options")
#else
#define KVMIX__AVX2_BEGIN
#define KVMIX__AVX2_END
#endif
/* clang-format on */

#ifdef KVMIX__AVX2_DISPATCH
/* CPUID leaf `leaf`, subleaf 0: eax, ebx, ecx, edx into r. */
static void kvmix__cpuid(uint32_t leaf, uint32_t r[4]) {
    __asm__ __volatile__("cpuid"
                         : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3])
                         : "a"(leaf), "c"(0));
}

/* Whether the CPU has AVX2, FMA and F16C and the system saves the 256-bit registers: CPUID and
   XGETBV themselves, no runtime library's feature table (not every toolchain links one). */
static int kvmix__cpu_has_avx2(void) {
    uint32_t r[4], xcr0_lo, xcr0_hi;
    kvmix__cpuid(0, r);
    if (r[0] < 7) return 0;
    kvmix__cpuid(1, r); /* ecx: FMA 12, OSXSAVE 27, AVX 28, F16C 29 */
    if ((r[2] & 0x38001000u) != 0x38001000u) return 0;
    __asm__ __volatile__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    (void)xcr0_hi;
    if ((xcr0_lo & 6u) != 6u) return 0; /* the XMM and YMM state */
    kvmix__cpuid(7, r);                 /* ebx: AVX2 5 */
    return (int)(r[1] >> 5 & 1u);
}
#endif

/* Whether the AVX2 loops run here: always in an AVX2 build, where the CPU has AVX2, FMA and F16C
   in a dispatching one (the CPU's answer is the same every call), never elsewhere. */
static int kvmix__avx2_runs(void) {
#if defined(KVMIX__AVX2)
    return 1;
#elif defined(KVMIX__AVX2_DISPATCH)
    static int known = -1; /* asked once: CPUID takes microseconds in a virtual machine */
    int has = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (has < 0) {
        has = kvmix__cpu_has_avx2();
        __atomic_store_n(&known, has, __ATOMIC_RELAXED);
    }
    return has;
#else
    return 0;
#endif
}

/* FP16 bits to float without branches, so a loop of them vectorizes: the exponent and mantissa
   shifted into a float and scaled by 2^112 is exact for normal and subnormal halves alike;
   infinities and NaNs (which seals never write) take the all-ones exponent. A CPU that flushes
   denormal inputs (DAZ, as -ffast-math sets it) reads the subnormal halves as 0 here, where F16C
   does not: an exact integer path for them costs this loop 15%. */
static inline float kvmix__h2f_flat(uint16_t h) {
    uint32_t em = (uint32_t)(h & 0x7fffu) << 13;
    uint32_t scaled = kvmix__float_bits(kvmix__bits_float(em) * 5.192296858534828e+33f); /* 2^112 */
    uint32_t special = 0u - (uint32_t)((h & 0x7c00u) == 0x7c00u); /* all ones: inf or NaN */
    uint32_t magnitude = (scaled & ~special) | ((em | 0x7f800000u) & special);
    return kvmix__bits_float(magnitude | (uint32_t)(h & 0x8000u) << 16);
}

/* Eight stored FP16 values (little-endian) at p as floats: one instruction with F16C, else a
   loop of known length that vectorizes at -O2. */
static inline void kvmix__fp16_eight(const uint8_t *KVMIX__RESTRICT p, float *KVMIX__RESTRICT out) {
#if defined(__F16C__) && defined(__AVX__)
    _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p)));
#else
    uint16_t half[8];
    int32_t j;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(half, p, sizeof half);
#else
    for (j = 0; j < 8; j++) half[j] = (uint16_t)(p[2 * j] | p[2 * j + 1] << 8);
#endif
    for (j = 0; j < 8; j++) out[j] = kvmix__h2f_flat(half[j]);
#endif
}

#ifdef KVMIX__AVX2_DISPATCH
KVMIX__AVX2_BEGIN
/* n (a multiple of 8) stored FP16 values at p as floats, eight an F16C instruction: the
   dispatching build's kvmix__fp16_eight, the same exact values. */
static void kvmix__fp16_run_f16c(const uint8_t *p, int32_t n, float *out) {
    int32_t j;
    for (j = 0; j < n; j += 8)
        _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(
                                      (const __m128i *)(const void *)(p + 2 * (size_t)j))));
}
KVMIX__AVX2_END
#endif

/* n stored FP16 values at p as floats: eight at a time, the rest one by one. */
static inline void kvmix__fp16_halves(const uint8_t *KVMIX__RESTRICT p, int32_t n,
                                      float *KVMIX__RESTRICT out) {
    int32_t j = 0;
#ifdef KVMIX__AVX2_DISPATCH
    if (kvmix__avx2_runs()) kvmix__fp16_run_f16c(p, j = n / 8 * 8, out);
#endif
    for (; j + 8 <= n; j += 8) kvmix__fp16_eight(p + 2 * j, out + j);
    for (; j < n; j++) out[j] = kvmix__h2f_flat((uint16_t)(p[2 * j] | p[2 * j + 1] << 8));
}

/* Eight codes of `bits` bits (4 or 2, low bits first) from the bytes at p, as an integer whose
   bits 4j or 2j up hold code j: eight lanes of one shift each, which vectorizes where a byte
   loop's shifts would not (x86 has no byte shifts). */
static inline uint32_t kvmix__eight_codes(const uint8_t *p, int bits) {
    return bits == 4
               ? (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24
               : (uint32_t)p[0] | (uint32_t)p[1] << 8;
}

#ifdef KVMIX__AVX2_LOOPS
KVMIX__AVX2_BEGIN
/* kvmix__dequantize_codes of 4- or 2-bit codes: eight codes shifted into eight lanes at once. */
static inline void kvmix__dequantize_codes8(const uint8_t *KVMIX__RESTRICT codes, int bits,
                                            int32_t n, const float *scale, const float *min,
                                            int per_channel, float *KVMIX__RESTRICT out) {
    const __m256i shifts = bits == 4 ? _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)
                                     : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i mask = _mm256_set1_epi32((int)((1u << bits) - 1u));
    int32_t i;
    for (i = 0; i < n; i += 8) {
        __m256i word = _mm256_set1_epi32((int)kvmix__eight_codes(codes + i * bits / 8, bits));
        __m256 x = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(word, shifts), mask));
        __m256 s = per_channel ? _mm256_loadu_ps(scale + i) : _mm256_set1_ps(scale[0]);
        __m256 m = per_channel ? _mm256_loadu_ps(min + i) : _mm256_set1_ps(min[0]);
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(x, s, m));
    }
}
KVMIX__AVX2_END
#endif

/* n codes (n a multiple of 8) of `bits` bits times scale[c] plus min[c] (per channel), or times
   scale[0] plus min[0] for every c when per_channel is 0. */
static inline void kvmix__dequantize_codes(const uint8_t *KVMIX__RESTRICT codes, int bits,
                                           int32_t n, const float *scale, const float *min,
                                           int per_channel, float *KVMIX__RESTRICT out) {
    uint32_t mask = (1u << bits) - 1u;
    int32_t i, j;
    if (bits == 8) {
        for (i = 0; i < n; i++)
            out[i] = (float)codes[i] * scale[per_channel ? i : 0] + min[per_channel ? i : 0];
        return;
    }
#ifdef KVMIX__AVX2_LOOPS
    if (kvmix__avx2_runs()) {
        kvmix__dequantize_codes8(codes, bits, n, scale, min, per_channel, out);
        return;
    }
#endif
    for (i = 0; i + 16 <= n; i += 16) { /* two words a step, then an odd eight */
        uint32_t lo = kvmix__eight_codes(codes + i * bits / 8, bits);
        uint32_t hi = kvmix__eight_codes(codes + (i + 8) * bits / 8, bits);
        for (j = 0; j < 8; j++) {
            out[i + j] = (float)((lo >> (j * bits)) & mask) * scale[per_channel ? i + j : 0] +
                         min[per_channel ? i + j : 0];
            out[i + 8 + j] =
                (float)((hi >> (j * bits)) & mask) * scale[per_channel ? i + 8 + j : 0] +
                min[per_channel ? i + 8 + j : 0];
        }
    }
    if (i < n) {
        uint32_t word = kvmix__eight_codes(codes + i * bits / 8, bits);
        for (j = 0; j < 8; j++)
            out[i + j] = (float)((word >> (j * bits)) & mask) * scale[per_channel ? i + j : 0] +
                         min[per_channel ? i + j : 0];
    }
}

/* What decoding a block's rows needs beyond its layout: per-channel blocks' scales, minimums
   and boosted slots (KVMIX_BOOST_NONE for a plain channel or an index entry out of range). */
typedef struct kvmix__row_decoder {
    kvmix_layout layout;
    kvmix__sections sections;
    const uint8_t *block;
    float scale[KVMIX_MAX_HEAD_DIM], min[KVMIX_MAX_HEAD_DIM];
    uint8_t slot[KVMIX_MAX_HEAD_DIM];
} kvmix__row_decoder;

/* kv head h's block of a span operand (base, head_bytes, layout as kvmix_span gives them), its
   layout resolved into *resolved and its sections into *sections. */
static const uint8_t *kvmix__operand_block(const kvmix_layout *layout, const void *base,
                                           size_t head_bytes, int32_t h, kvmix_layout *resolved,
                                           kvmix__sections *sections) {
    *resolved = *layout;
    kvmix_layout_resolve(resolved, NULL);
    *sections = kvmix__layout_sections(resolved);
    return kvmix__head_block(base, head_bytes, sections, h);
}

static void kvmix__row_decoder_open(kvmix__row_decoder *d, const kvmix_layout *layout,
                                    const uint8_t *base, size_t head_bytes, int32_t h) {
    float pairs[2 * KVMIX_MAX_HEAD_DIM];
    int32_t c;
    d->block = kvmix__operand_block(layout, base, head_bytes, h, &d->layout, &d->sections);
    if (!kvmix__is_per_channel(d->layout.format)) return;
    /* the (scale, min) pairs of every channel, converted eight halves at a time */
    kvmix__fp16_halves(d->block + kvmix__channel_meta_at(&d->sections, 0), 2 * d->layout.head_dim,
                       pairs);
    for (c = 0; c < d->layout.head_dim; c++)
        d->scale[c] = pairs[2 * c], d->min[c] = pairs[2 * c + 1];
    if (d->layout.format != KVMIX_FORMAT_BOOSTED) return; /* slot is read for boosted keys only */
    for (c = 0; c < d->layout.head_dim; c++) {
        uint8_t slot = d->block[d->sections.index_offset + c];
        d->slot[c] = slot < d->layout.n_boost ? slot : (uint8_t)KVMIX_BOOST_NONE;
    }
}

static inline void kvmix__channel_row(const kvmix__row_decoder *d, int32_t t,
                                      float *KVMIX__RESTRICT out) {
    int32_t c, dim = d->layout.head_dim;
    kvmix__dequantize_codes(d->block + kvmix__row_at(&d->sections, t), 2, dim, d->scale, d->min, 1,
                            out);
    if (d->layout.format == KVMIX_FORMAT_BOOSTED) { /* the high bits add 4 * scale per unit */
        const uint8_t *high = d->block + kvmix__high_row_at(&d->sections, t);
        for (c = 0; c < dim; c++) {
            uint8_t slot = d->slot[c];
            if (slot != KVMIX_BOOST_NONE)
                out[c] = (float)(((uint32_t)(high[slot >> 2] >> ((slot & 3) * 2)) & 3u) << 2 |
                                 kvmix__get_code(d->block + kvmix__row_at(&d->sections, t), c, 2)) *
                             d->scale[c] +
                         d->min[c];
        }
    }
}

/* Rows [t0, t0 + n) into tile[n][head_dim]. */
static inline void kvmix__decode_tile(const kvmix__row_decoder *d, int32_t t0, int32_t n,
                                      float *tile) {
    const kvmix_layout *l = &d->layout;
    int32_t dim = l->head_dim, i, g;
    for (i = 0; i < n; i++) {
        const uint8_t *row = d->block + kvmix__row_at(&d->sections, t0 + i);
        float *out = tile + (size_t)i * dim;
        if (l->format == KVMIX_FORMAT_FP16) {
            kvmix__fp16_halves(row, dim, out);
        } else if (kvmix__is_per_token_int(l->format)) {
            int bits = kvmix__format_bits(l->format);
            int32_t groups = dim / l->group_size;
            float meta[2 * KVMIX_MAX_HEAD_DIM / 8]; /* the row's (scale, min) pairs, in order */
            kvmix__fp16_halves(d->block + kvmix__token_meta_at(&d->sections, t0 + i, groups, 0),
                               2 * groups, meta);
            for (g = 0; g < groups; g++)
                kvmix__dequantize_codes(row + (size_t)g * l->group_size * bits / 8, bits,
                                        l->group_size, &meta[2 * g], &meta[2 * g + 1], 0,
                                        out + (size_t)g * l->group_size);
        } else {
            kvmix__channel_row(d, t0 + i, out);
        }
    }
}

/* Where a task keeps its query heads' state: acc [group][dim], then max [group], sum [group]. */
typedef struct kvmix__partial {
    float *acc, *max, *sum;
} kvmix__partial;

/* e^x for x <= 0, -inf included (0): 2^n times a polynomial on the remainder, relative error
   below 1e-6, in float arithmetic without calls or branches (kvmix__exp_nonpositive8 is its
   eight-lane twin). */
static inline float kvmix__exp_nonpositive(float x) {
    const float round = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float clamped = x >= -87.0f ? x : -87.0f, n = (clamped * 1.44269504f + round) - round;
    float r = (clamped - n * 0.693145752f) - n * 1.42860677e-6f; /* ln 2 in two parts */
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f +
                                                  r * (0.0416666679f + r * (0.00833333377f +
                                                                            r * 0.00138888892f)))));
    float result = p * kvmix__bits_float((uint32_t)((int32_t)n + 127) << 23);
    return x >= -87.0f ? result : 0.0f; /* and 0 for a NaN, never an int from it */
}

/* One query head's share of a decoded tile: logits of its live rows, one rescale, weights,
   and the weighted sum of the value rows, eight channels at a time held over the whole tile. */
static inline void kvmix__attend_tile(const float *KVMIX__RESTRICT q, const float *ktile,
                                      const float *vtile, const uint8_t *dead, int32_t n,
                                      int32_t dim, float scale, float *KVMIX__RESTRICT acc,
                                      float *max, float *sum) {
    float logit[KVMIX__TILE_FLOATS / 8], w[KVMIX__TILE_FLOATS / 8], tile_max = -INFINITY;
    float total = 0.0f;
    int32_t t, c, j;
    for (t = 0; t < n; t++) {
        logit[t] =
            dead && dead[t] ? -INFINITY : kvmix__dot(q, ktile + (size_t)t * dim, dim) * scale;
        if (logit[t] > tile_max) tile_max = logit[t];
    }
    if (tile_max == -INFINITY) return; /* every row dead */
    if (tile_max > *max) {
        float rescale = kvmix__exp_nonpositive(*max - tile_max); /* 0 on the first live tile */
        for (c = 0; c < dim; c++) acc[c] *= rescale;
        *sum *= rescale;
        *max = tile_max;
    }
    for (t = 0; t < n; t++) w[t] = kvmix__exp_nonpositive(logit[t] - *max); /* dead rows: 0 */
    for (t = 0; t < n; t++) total += w[t];
    for (c = 0; c < dim; c += 8) {
        float part[8];
        for (j = 0; j < 8; j++) part[j] = acc[c + j];
        for (t = 0; t < n; t++)
            for (j = 0; j < 8; j++) part[j] += w[t] * vtile[(size_t)t * dim + c + j];
        for (j = 0; j < 8; j++) acc[c + j] = part[j];
    }
    *sum += total;
}

KVMIXDEF const char *kvmix_cpu_decode_loops(void) {
#if defined(KVMIX__AVX2) && defined(__AVX512F__)
    return "avx512";
#else
    return kvmix__avx2_runs() ? "avx2" : "portable";
#endif
}

/* Where the AVX2 loops run (kvmix__avx2_runs), query heads go four at a time over each row (two
   key rows a step, sixteen value channels held in registers), FP16 rows are read where they are
   used, and the next tile's bytes are asked of the caches as the current one runs: memory
   speed for FP16 rows. Elsewhere every head takes kvmix__attend_tile. */
#ifdef KVMIX__AVX2_LOOPS

/* Bytes a tile will read next, asked of the caches a slice at a time while the current tile's
   arithmetic runs: the next span's blocks start apart from this one's, where a stream prefetcher
   starts over, and asked all at once they would wait behind each other. */
typedef struct kvmix__ahead {
    const uint8_t *at[2]; /* keys, values */
    size_t bytes[2];
} kvmix__ahead;

/* Slice `part` of `parts` of the bytes ahead. */
static inline void kvmix__prefetch_slice(const kvmix__ahead *a, int32_t part, int32_t parts) {
#if defined(__GNUC__) || defined(__clang__)
    int i;
    for (i = 0; a && i < 2; i++) {
        size_t from = a->bytes[i] * (size_t)part / (size_t)parts & ~(size_t)63;
        size_t to = a->bytes[i] * (size_t)(part + 1) / (size_t)parts, at;
        for (at = from; at < to; at += 64) __builtin_prefetch(a->at[i] + at, 0, 3);
    }
#else
    (void)a, (void)part, (void)parts;
#endif
}

/* kv head h's key and value blocks of a view span, whole: what its first tile reads. */
static kvmix__ahead kvmix__span_ahead(const kvmix_view *view, const kvmix_view_span *vs,
                                      int32_t h) {
    kvmix_span span = kvmix__span_of_view(view, vs);
    const kvmix_layout *layouts[2] = {&span.key_layout, &span.value_layout};
    const void *bases[2] = {span.keys, span.values};
    size_t head_bytes[2] = {span.key_head_bytes, span.value_head_bytes};
    kvmix__ahead a;
    int i;
    for (i = 0; i < 2; i++) {
        kvmix_layout l;
        kvmix__sections sections;
        a.at[i] = kvmix__operand_block(layouts[i], bases[i], head_bytes[i], h, &l, &sections);
        a.bytes[i] = (size_t)sections.total_bytes;
    }
    return a;
}

KVMIX__AVX2_BEGIN

/* The sum of eight partial sums in a fixed order (as kvmix__dot adds its own). */
static inline float kvmix__sum8(const float *p) {
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

static inline __m256 kvmix__row_v8(const uint8_t *row, int fp16, int32_t c) {
    return fp16 ? _mm256_cvtph_ps(
                      _mm_loadu_si128((const __m128i *)(const void *)(row + 2 * (size_t)c)))
                : _mm256_loadu_ps((const float *)(const void *)(row + 4 * (size_t)c));
}

static inline float kvmix__hsum_v8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* Four query heads' dot products (q: [4][dim]) with two key rows: out0[g], out1[g]; eight
   independent chains, each row read once for the four. */
static inline void kvmix__logits4_rows2(const float *KVMIX__RESTRICT q, const uint8_t *k0,
                                        const uint8_t *k1, int fp16, int32_t dim, float *out0,
                                        float *out1) {
    __m256 s00 = _mm256_setzero_ps(), s10 = s00, s20 = s00, s30 = s00;
    __m256 s01 = s00, s11 = s00, s21 = s00, s31 = s00;
    int32_t c;
    for (c = 0; c < dim; c += 8) {
        __m256 a = kvmix__row_v8(k0, fp16, c), b = kvmix__row_v8(k1, fp16, c);
        __m256 q0 = _mm256_loadu_ps(q + c), q1 = _mm256_loadu_ps(q + dim + c);
        __m256 q2 = _mm256_loadu_ps(q + 2 * dim + c), q3 = _mm256_loadu_ps(q + 3 * dim + c);
        s00 = _mm256_fmadd_ps(q0, a, s00), s01 = _mm256_fmadd_ps(q0, b, s01);
        s10 = _mm256_fmadd_ps(q1, a, s10), s11 = _mm256_fmadd_ps(q1, b, s11);
        s20 = _mm256_fmadd_ps(q2, a, s20), s21 = _mm256_fmadd_ps(q2, b, s21);
        s30 = _mm256_fmadd_ps(q3, a, s30), s31 = _mm256_fmadd_ps(q3, b, s31);
    }
    out0[0] = kvmix__hsum_v8(s00), out0[1] = kvmix__hsum_v8(s10);
    out0[2] = kvmix__hsum_v8(s20), out0[3] = kvmix__hsum_v8(s30);
    out1[0] = kvmix__hsum_v8(s01), out1[1] = kvmix__hsum_v8(s11);
    out1[2] = kvmix__hsum_v8(s21), out1[3] = kvmix__hsum_v8(s31);
}

/* acc[4][dim] += w[4][KVMIX__TILE_ROWS] * rows[t][dim] over n rows row_bytes apart (FP16 or
   floats): sixteen channels of the four heads in eight registers held over the rows. */
static inline void kvmix__weighted4(const float *KVMIX__RESTRICT w, const uint8_t *rows,
                                    size_t row_bytes, int fp16, int32_t n, int32_t dim,
                                    float *KVMIX__RESTRICT acc) {
    float *a0 = acc, *a1 = acc + dim, *a2 = acc + 2 * (size_t)dim, *a3 = acc + 3 * (size_t)dim;
    const float *w0 = w, *w1 = w + KVMIX__TILE_ROWS, *w2 = w + 2 * KVMIX__TILE_ROWS,
                *w3 = w + 3 * KVMIX__TILE_ROWS;
    int32_t c, t;
    for (c = 0; c + 16 <= dim; c += 16) {
        __m256 x0 = _mm256_loadu_ps(a0 + c), y0 = _mm256_loadu_ps(a0 + c + 8);
        __m256 x1 = _mm256_loadu_ps(a1 + c), y1 = _mm256_loadu_ps(a1 + c + 8);
        __m256 x2 = _mm256_loadu_ps(a2 + c), y2 = _mm256_loadu_ps(a2 + c + 8);
        __m256 x3 = _mm256_loadu_ps(a3 + c), y3 = _mm256_loadu_ps(a3 + c + 8);
        for (t = 0; t < n; t++) {
            const uint8_t *row = rows + (size_t)t * row_bytes;
            __m256 v = kvmix__row_v8(row, fp16, c), u = kvmix__row_v8(row, fp16, c + 8);
            __m256 b0 = _mm256_broadcast_ss(w0 + t), b1 = _mm256_broadcast_ss(w1 + t);
            __m256 b2 = _mm256_broadcast_ss(w2 + t), b3 = _mm256_broadcast_ss(w3 + t);
            x0 = _mm256_fmadd_ps(b0, v, x0), y0 = _mm256_fmadd_ps(b0, u, y0);
            x1 = _mm256_fmadd_ps(b1, v, x1), y1 = _mm256_fmadd_ps(b1, u, y1);
            x2 = _mm256_fmadd_ps(b2, v, x2), y2 = _mm256_fmadd_ps(b2, u, y2);
            x3 = _mm256_fmadd_ps(b3, v, x3), y3 = _mm256_fmadd_ps(b3, u, y3);
        }
        _mm256_storeu_ps(a0 + c, x0), _mm256_storeu_ps(a0 + c + 8, y0);
        _mm256_storeu_ps(a1 + c, x1), _mm256_storeu_ps(a1 + c + 8, y1);
        _mm256_storeu_ps(a2 + c, x2), _mm256_storeu_ps(a2 + c + 8, y2);
        _mm256_storeu_ps(a3 + c, x3), _mm256_storeu_ps(a3 + c + 8, y3);
    }
    for (; c < dim; c += 8) { /* dim: a multiple of 8 */
        __m256 x0 = _mm256_loadu_ps(a0 + c), x1 = _mm256_loadu_ps(a1 + c);
        __m256 x2 = _mm256_loadu_ps(a2 + c), x3 = _mm256_loadu_ps(a3 + c);
        for (t = 0; t < n; t++) {
            __m256 v = kvmix__row_v8(rows + (size_t)t * row_bytes, fp16, c);
            x0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + t), v, x0);
            x1 = _mm256_fmadd_ps(_mm256_broadcast_ss(w1 + t), v, x1);
            x2 = _mm256_fmadd_ps(_mm256_broadcast_ss(w2 + t), v, x2);
            x3 = _mm256_fmadd_ps(_mm256_broadcast_ss(w3 + t), v, x3);
        }
        _mm256_storeu_ps(a0 + c, x0), _mm256_storeu_ps(a1 + c, x1);
        _mm256_storeu_ps(a2 + c, x2), _mm256_storeu_ps(a3 + c, x3);
    }
}

/* The largest of n = KVMIX__TILE_ROWS values, eight lanes at a time. */
static inline float kvmix__max_rows(const float *x) {
    float m[8];
    int32_t t, j;
    for (j = 0; j < 8; j++) m[j] = x[j];
    for (t = 8; t < KVMIX__TILE_ROWS; t += 8)
        for (j = 0; j < 8; j++) m[j] = x[t + j] > m[j] ? x[t + j] : m[j];
    for (j = 1; j < 8; j++) m[0] = m[j] > m[0] ? m[j] : m[0];
    return m[0];
}

/* kvmix__exp_nonpositive on eight lanes, step for step (the compilers do not vectorize the
   scalar loop: its arrays may alias). */
static inline __m256 kvmix__exp_nonpositive8(__m256 x) {
    const __m256 lowest = _mm256_set1_ps(-87.0f), round = _mm256_set1_ps(12582912.0f);
    const __m256 in_range = _mm256_cmp_ps(x, lowest, _CMP_GE_OQ); /* false for NaN */
    __m256 clamped = _mm256_blendv_ps(lowest, x, in_range), n, r, p;
    n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(clamped, _mm256_set1_ps(1.44269504f)), round),
                      round);
    r = _mm256_sub_ps(_mm256_sub_ps(clamped, _mm256_mul_ps(n, _mm256_set1_ps(0.693145752f))),
                      _mm256_mul_ps(n, _mm256_set1_ps(1.42860677e-6f)));
    p = _mm256_add_ps(_mm256_set1_ps(0.00833333377f),
                      _mm256_mul_ps(r, _mm256_set1_ps(0.00138888892f)));
    p = _mm256_add_ps(_mm256_set1_ps(0.0416666679f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(0.166666672f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(0.5f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(r, p));
    p = _mm256_mul_ps(p,
                      _mm256_castsi256_ps(_mm256_slli_epi32(
                          _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23)));
    return _mm256_and_ps(p, in_range);
}

/* One query head's tile logits [KVMIX__TILE_ROWS] (-inf for dead rows) into weights w: its
   running max raised to the tile's (acc [dim] and sum rescaled), w = e^(logit - max), the
   weights added to its sum. */
static inline void kvmix__softmax_row(const float *logit, float *w, int32_t dim,
                                      float *KVMIX__RESTRICT acc, float *max, float *sum) {
    float tile_max = kvmix__max_rows(logit), part[8], m;
    __m256 total = _mm256_setzero_ps(), shift;
    int32_t t, c;
    if (tile_max > *max) { /* every row dead leaves tile_max -inf: no change */
        float rescale = kvmix__exp_nonpositive(*max - tile_max); /* 0 on the first tile */
        __m256 by = _mm256_set1_ps(rescale);
        for (c = 0; c + 8 <= dim; c += 8) /* head_dim is a multiple of 8 */
            _mm256_storeu_ps(acc + c, _mm256_mul_ps(_mm256_loadu_ps(acc + c), by));
        *sum *= rescale;
        *max = tile_max;
    }
    m = *max == -INFINITY ? 0.0f : *max; /* no live row yet: every weight 0 */
    shift = _mm256_set1_ps(m);
    for (t = 0; t < KVMIX__TILE_ROWS; t += 8) {
        __m256 e = kvmix__exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(logit + t), shift));
        _mm256_storeu_ps(w + t, e);
        total = _mm256_add_ps(total, e);
    }
    _mm256_storeu_ps(part, total);
    *sum += kvmix__sum8(part);
}

/* kvmix__softmax_row for four query heads: logit and w [4][KVMIX__TILE_ROWS], acc [4][dim]. */
static inline void kvmix__softmax_rows4(float (*logit)[KVMIX__TILE_ROWS],
                                        float (*w)[KVMIX__TILE_ROWS], int32_t dim,
                                        float *KVMIX__RESTRICT acc, float *max, float *sum) {
    int32_t g;
    for (g = 0; g < 4; g++)
        kvmix__softmax_row(logit[g], w[g], dim, acc + (size_t)g * dim, &max[g], &sum[g]);
}

/* kvmix__attend_tile for four query heads at once (q [4][dim], acc [4][dim], max and sum [4])
   over n <= KVMIX__TILE_ROWS key and value rows row_bytes apart, FP16 as stored (fp16) or
   decoded floats: the logits and the weighted sum read each row once for the four; rows past n
   count as dead. */
static inline void kvmix__attend4(const float *KVMIX__RESTRICT q, const uint8_t *keys,
                                  const uint8_t *values, size_t row_bytes, int fp16,
                                  const uint8_t *dead, int32_t n, int32_t dim, float scale,
                                  const kvmix__ahead *ahead, float *KVMIX__RESTRICT acc, float *max,
                                  float *sum) {
    float logit[4][KVMIX__TILE_ROWS], w[4][KVMIX__TILE_ROWS];
    int32_t t, g;
    for (t = 0; t < KVMIX__TILE_ROWS; t += 2) {
        int live0 = t < n && !(dead && dead[t]), live1 = t + 1 < n && !(dead && dead[t + 1]);
        float l0[4] = {0}, l1[4] = {0};
        kvmix__prefetch_slice(ahead, t / 2, KVMIX__TILE_ROWS / 2);
        if (live0 || live1) /* a row past n reads row t in its place, then counts as dead */
            kvmix__logits4_rows2(q, keys + (size_t)t * row_bytes,
                                 keys + (size_t)(t + 1 < n ? t + 1 : t) * row_bytes, fp16, dim, l0,
                                 l1);
        for (g = 0; g < 4; g++) {
            logit[g][t] = live0 ? l0[g] * scale : -INFINITY;
            logit[g][t + 1] = live1 ? l1[g] * scale : -INFINITY;
        }
    }
    kvmix__softmax_rows4(logit, w, dim, acc, max, sum);
    kvmix__weighted4(&w[0][0], values, row_bytes, fp16, n, dim, acc);
}

/* kvmix__attend4 for one query head (a query group that four heads do not divide, such as one
   query head per kv head): two chains of eight lanes a key row, then thirty-two channels of the
   weighted sum in four registers held over the rows. */
static inline void kvmix__attend1(const float *KVMIX__RESTRICT q, const uint8_t *keys,
                                  const uint8_t *values, size_t row_bytes, int fp16,
                                  const uint8_t *dead, int32_t n, int32_t dim, float scale,
                                  float *KVMIX__RESTRICT acc, float *max, float *sum) {
    float logit[KVMIX__TILE_ROWS], w[KVMIX__TILE_ROWS];
    int32_t t, c;
    for (t = 0; t < KVMIX__TILE_ROWS; t++) {
        const uint8_t *k = keys + (size_t)t * row_bytes;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0;
        if (t >= n || (dead && dead[t])) {
            logit[t] = -INFINITY;
            continue;
        }
        for (c = 0; c + 16 <= dim; c += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), kvmix__row_v8(k, fp16, c), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), kvmix__row_v8(k, fp16, c + 8), s1);
        }
        if (c < dim) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), kvmix__row_v8(k, fp16, c), s0);
        logit[t] = kvmix__hsum_v8(_mm256_add_ps(s0, s1)) * scale;
    }
    kvmix__softmax_row(logit, w, dim, acc, max, sum);
    for (c = 0; c + 32 <= dim; c += 32) {
        __m256 x0 = _mm256_loadu_ps(acc + c), x1 = _mm256_loadu_ps(acc + c + 8);
        __m256 x2 = _mm256_loadu_ps(acc + c + 16), x3 = _mm256_loadu_ps(acc + c + 24);
        for (t = 0; t < n; t++) {
            const uint8_t *row = values + (size_t)t * row_bytes;
            __m256 b = _mm256_broadcast_ss(w + t);
            x0 = _mm256_fmadd_ps(b, kvmix__row_v8(row, fp16, c), x0);
            x1 = _mm256_fmadd_ps(b, kvmix__row_v8(row, fp16, c + 8), x1);
            x2 = _mm256_fmadd_ps(b, kvmix__row_v8(row, fp16, c + 16), x2);
            x3 = _mm256_fmadd_ps(b, kvmix__row_v8(row, fp16, c + 24), x3);
        }
        _mm256_storeu_ps(acc + c, x0), _mm256_storeu_ps(acc + c + 8, x1);
        _mm256_storeu_ps(acc + c + 16, x2), _mm256_storeu_ps(acc + c + 24, x3);
    }
    for (; c < dim; c += 8) { /* dim: a multiple of 8 */
        __m256 x = _mm256_loadu_ps(acc + c);
        for (t = 0; t < n; t++)
            x = _mm256_fmadd_ps(_mm256_broadcast_ss(w + t),
                                kvmix__row_v8(values + (size_t)t * row_bytes, fp16, c), x);
        _mm256_storeu_ps(acc + c, x);
    }
}

KVMIX__AVX2_END
#endif /* KVMIX__AVX2_LOOPS */

/* Where the build also has AVX-512, the four-head loops take INT rows too, sixteen channels a
   register, without a decoded tile: per-token INT4 and INT2 codes (groups of a multiple of 16
   channels) look their dequantized value up in a table of their group's values (code * scale +
   min for every code, as kvmix__dequantize_codes computes it) by the code in each lane's low
   four bits; per-channel INT2 keys enter as bare codes, their scales folded into the query and
   their minimums into one bias per query head; FP16 rows as stored. A span whose keys or values
   are another format (INT8, boosted keys, per-channel INT2 values, groups that 16 does not
   divide), or whose head_dim 16 does not divide, takes the tiles above for both. */
#if defined(KVMIX__AVX2) && defined(__AVX512F__)
#define KVMIX__AVX512 1
/* Every lane: the maskz forms below, where the plain ones pass GCC's "undefined" vector
   through, which g++ 12 reports as maybe used uninitialized. */
#define KVMIX__ALL16 ((__mmask16)0xffff)

typedef enum kvmix__lanes_kind {
    KVMIX__LANES_NONE,        /* a decoded tile: the paths above */
    KVMIX__LANES_FP16,        /* FP16 rows as stored */
    KVMIX__LANES_TOKEN_INT,   /* per-token INT4 / INT2 codes through their group's table */
    KVMIX__LANES_CHANNEL_INT2 /* per-channel INT2 key codes, scales and minimums folded */
} kvmix__lanes_kind;

/* One span operand as the 512-bit loops read it. */
typedef struct kvmix__lanes {
    kvmix__lanes_kind kind;
    const kvmix__row_decoder *decoder; /* block, sections, layout; per-channel scales, minimums */
    int32_t bits, group_size, groups;
} kvmix__lanes;

static kvmix__lanes kvmix__lanes_of(const kvmix__row_decoder *d, int key) {
    const kvmix_layout *l = &d->layout;
    kvmix__lanes s;
    s.decoder = d;
    s.bits = kvmix__format_bits(l->format);
    s.group_size = l->group_size;
    s.groups = kvmix__is_per_token_int(l->format) ? l->head_dim / l->group_size : 0;
    s.kind = KVMIX__LANES_NONE;
    if (l->head_dim % 16 != 0) return s;
    if (l->format == KVMIX_FORMAT_FP16)
        s.kind = KVMIX__LANES_FP16;
    else if ((l->format == KVMIX_FORMAT_INT4 || l->format == KVMIX_FORMAT_INT2) &&
             l->group_size % 16 == 0)
        s.kind = KVMIX__LANES_TOKEN_INT;
    else if (key && l->format == KVMIX_FORMAT_INT2_CHANNEL)
        s.kind = KVMIX__LANES_CHANNEL_INT2;
    return s;
}

/* INT4 lanes come in the order of one 64-bit word shifted by 4k in quadword k: lane 2k holds
   channel k of the block, lane 2k + 1 channel 8 + k. These index vectors take a natural block to
   that order and back. */
#define KVMIX__INT4_ORDER   _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15)
#define KVMIX__INT4_UNORDER _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)

/* Codes 16b .. 16b + 15 of a row of `bits`-bit codes in the low bits of the lanes (what lies
   above them is other codes: a table lookup reads the low four bits alone): INT2 code j in lane
   j, INT4 in KVMIX__INT4_ORDER. */
static inline __m512i kvmix__codes16(const uint8_t *row, int32_t bits, int32_t b) {
    if (bits == 4) {
        long long word;
        memcpy(&word, row + 8 * (size_t)b, sizeof word);
        return _mm512_maskz_srlv_epi64((__mmask8)0xff, _mm512_set1_epi64(word),
                                       _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28));
    }
    int word;
    memcpy(&word, row + 4 * (size_t)b, sizeof word);
    return _mm512_maskz_srlv_epi32(
        KVMIX__ALL16, _mm512_set1_epi32(word),
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
}

/* The table of a group: entry i is the value of code i (INT4) or of code i & 3 (INT2, whose
   lanes hold the next code above their own). */
static inline __m512 kvmix__group_table(int32_t bits, float scale, float min) {
    const __m512 codes = bits == 4
                             ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                             : _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    return _mm512_fmadd_ps(codes, _mm512_set1_ps(scale), _mm512_set1_ps(min));
}

/* Row t's group tables (TOKEN_INT) into tables[groups]. */
static inline void kvmix__row_tables(const kvmix__lanes *s, int32_t t, __m512 *tables) {
    const kvmix__row_decoder *d = s->decoder;
    float meta[2 * KVMIX_MAX_HEAD_DIM / 16];
    int32_t g;
    kvmix__fp16_halves(d->block + kvmix__token_meta_at(&d->sections, t, s->groups, 0),
                       2 * s->groups, meta);
    for (g = 0; g < s->groups; g++)
        tables[g] = kvmix__group_table(s->bits, meta[2 * g], meta[2 * g + 1]);
}

/* Channels 16b .. 16b + 15 of a row: dequantized (table: their group's, for TOKEN_INT), or the
   bare codes of per-channel INT2 keys. */
static inline __m512 kvmix__lanes16(const kvmix__lanes *s, const uint8_t *row, int32_t b,
                                    __m512 table) {
    switch (s->kind) {
    case KVMIX__LANES_FP16:
        return _mm512_maskz_cvtph_ps(
            KVMIX__ALL16, _mm256_loadu_si256((const __m256i *)(const void *)(row + 32 * b)));
    case KVMIX__LANES_TOKEN_INT:
        return _mm512_maskz_permutexvar_ps(KVMIX__ALL16, kvmix__codes16(row, s->bits, b), table);
    default:
        return _mm512_maskz_permutexvar_ps(
            KVMIX__ALL16, kvmix__codes16(row, 2, b),
            _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3));
    }
}

/* Eight lanes of a, the lower (half 0) or upper (1), through a maskz extract (g++ 12 builds
   the plain extract and the cast from its "undefined" vector). */
static inline __m256 kvmix__half8(__m512 a, int half) {
    return _mm256_castpd_ps(
        half ? _mm512_maskz_extractf64x4_pd((__mmask8)0xf, _mm512_castps_pd(a), 1)
             : _mm512_maskz_extractf64x4_pd((__mmask8)0xf, _mm512_castps_pd(a), 0));
}

/* The sums of four registers' lanes: out[g] = the sum of a's, b's, c's, d's lanes, halves added
   pairwise until each register's sum sits in one lane. */
static inline void kvmix__hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d, float *out) {
    __m256 ab = _mm256_hadd_ps(_mm256_add_ps(kvmix__half8(a, 0), kvmix__half8(a, 1)),
                               _mm256_add_ps(kvmix__half8(b, 0), kvmix__half8(b, 1)));
    __m256 cd = _mm256_hadd_ps(_mm256_add_ps(kvmix__half8(c, 0), kvmix__half8(c, 1)),
                               _mm256_add_ps(kvmix__half8(d, 0), kvmix__half8(d, 1)));
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}

/* Four query heads' logits (before the softmax scale) with rows t and u of the keys: out0[g],
   out1[g]. q: [4][dim], per-channel scales already folded in; bias[g] added. */
static inline void kvmix__logits4_rows2_512(const float *KVMIX__RESTRICT q, const kvmix__lanes *k,
                                            int32_t t, int32_t u, const float *bias, float *out0,
                                            float *out1) {
    const kvmix__row_decoder *d = k->decoder;
    const uint8_t *r0 = d->block + kvmix__row_at(&d->sections, t);
    const uint8_t *r1 = d->block + kvmix__row_at(&d->sections, u);
    int32_t dim = d->layout.head_dim, b, g, group = 0, group_end;
    __m512 tables0[KVMIX_MAX_HEAD_DIM / 16], tables1[KVMIX_MAX_HEAD_DIM / 16];
    __m512 s00 = _mm512_setzero_ps(), s10 = s00, s20 = s00, s30 = s00;
    __m512 s01 = s00, s11 = s00, s21 = s00, s31 = s00;
    int token = k->kind == KVMIX__LANES_TOKEN_INT;
    if (token) {
        kvmix__row_tables(k, t, tables0);
        kvmix__row_tables(k, u, tables1);
    } else {
        tables0[0] = tables1[0] = _mm512_setzero_ps(); /* not read */
    }
    group_end = token ? k->group_size / 16 : dim / 16; /* the block past the current group's */
    for (b = 0; b < dim / 16; b++) {
        __m512 a, c;
        if (b == group_end) group++, group_end += k->group_size / 16;
        a = kvmix__lanes16(k, r0, b, tables0[group]), c = kvmix__lanes16(k, r1, b, tables1[group]);
        __m512 q0 = _mm512_loadu_ps(q + 16 * b), q1 = _mm512_loadu_ps(q + dim + 16 * b);
        __m512 q2 = _mm512_loadu_ps(q + 2 * dim + 16 * b);
        __m512 q3 = _mm512_loadu_ps(q + 3 * dim + 16 * b);
        s00 = _mm512_fmadd_ps(q0, a, s00), s01 = _mm512_fmadd_ps(q0, c, s01);
        s10 = _mm512_fmadd_ps(q1, a, s10), s11 = _mm512_fmadd_ps(q1, c, s11);
        s20 = _mm512_fmadd_ps(q2, a, s20), s21 = _mm512_fmadd_ps(q2, c, s21);
        s30 = _mm512_fmadd_ps(q3, a, s30), s31 = _mm512_fmadd_ps(q3, c, s31);
    }
    kvmix__hsum4_512(s00, s10, s20, s30, out0);
    kvmix__hsum4_512(s01, s11, s21, s31, out1);
    for (g = 0; g < 4; g++) out0[g] += bias[g], out1[g] += bias[g];
}

/* acc[4][dim] += w[4][KVMIX__TILE_ROWS] * value rows [t0, t0 + n): thirty-two channels of the
   four heads in eight registers held over the rows (sixteen in four for an odd last block). */
/* Sixteen channels of an accumulator as value lanes of v hold them (INT4's order), and back. */
static inline __m512 kvmix__acc_load(const kvmix__lanes *v, const float *p) {
    __m512 x = _mm512_loadu_ps(p);
    return v->kind == KVMIX__LANES_TOKEN_INT && v->bits == 4
               ? _mm512_maskz_permutexvar_ps(KVMIX__ALL16, KVMIX__INT4_ORDER, x)
               : x;
}

static inline void kvmix__acc_store(const kvmix__lanes *v, float *p, __m512 x) {
    _mm512_storeu_ps(p, v->kind == KVMIX__LANES_TOKEN_INT && v->bits == 4
                            ? _mm512_maskz_permutexvar_ps(KVMIX__ALL16, KVMIX__INT4_UNORDER, x)
                            : x);
}

static inline void kvmix__weighted4_512(const float *KVMIX__RESTRICT w, const kvmix__lanes *v,
                                        int32_t t0, int32_t n, float *KVMIX__RESTRICT acc) {
    const kvmix__row_decoder *d = v->decoder;
    int32_t dim = d->layout.head_dim, blocks = dim / 16, b, t;
    float *a0 = acc, *a1 = acc + dim, *a2 = acc + 2 * (size_t)dim, *a3 = acc + 3 * (size_t)dim;
    const float *w0 = w, *w1 = w + KVMIX__TILE_ROWS, *w2 = w + 2 * KVMIX__TILE_ROWS,
                *w3 = w + 3 * KVMIX__TILE_ROWS;
    float meta[KVMIX__TILE_ROWS][2 * KVMIX_MAX_HEAD_DIM / 16];
    int token = v->kind == KVMIX__LANES_TOKEN_INT;
    if (token)
        for (t = 0; t < n; t++)
            kvmix__fp16_halves(d->block + kvmix__token_meta_at(&d->sections, t0 + t, v->groups, 0),
                               2 * v->groups, meta[t]);
    for (b = 0; b < blocks; b += 2) {
        int32_t pair = b + 1 < blocks, c = 16 * b; /* pair: a second block of sixteen channels */
        __m512 x0 = kvmix__acc_load(v, a0 + c), x1 = kvmix__acc_load(v, a1 + c);
        __m512 x2 = kvmix__acc_load(v, a2 + c), x3 = kvmix__acc_load(v, a3 + c);
        __m512 y0 = pair ? kvmix__acc_load(v, a0 + c + 16) : x0,
               y1 = pair ? kvmix__acc_load(v, a1 + c + 16) : x1;
        __m512 y2 = pair ? kvmix__acc_load(v, a2 + c + 16) : x2,
               y3 = pair ? kvmix__acc_load(v, a3 + c + 16) : x3;
        /* the groups of the two blocks (TOKEN_INT): the same one unless a group is 16 channels */
        int32_t first = token ? c / v->group_size : 0;
        int32_t second = token ? (c + 16 * pair) / v->group_size : 0;
        for (t = 0; t < n; t++) {
            const uint8_t *row = d->block + kvmix__row_at(&d->sections, t0 + t);
            __m512 lo_table = _mm512_setzero_ps(), hi_table = lo_table, lo, hi, b0, b1, b2, b3;
            if (token) {
                lo_table = kvmix__group_table(v->bits, meta[t][2 * first], meta[t][2 * first + 1]);
                hi_table = second == first ? lo_table
                                           : kvmix__group_table(v->bits, meta[t][2 * second],
                                                                meta[t][2 * second + 1]);
            }
            lo = kvmix__lanes16(v, row, b, lo_table);
            hi = pair ? kvmix__lanes16(v, row, b + 1, hi_table) : lo;
            b0 = _mm512_set1_ps(w0[t]), b1 = _mm512_set1_ps(w1[t]);
            b2 = _mm512_set1_ps(w2[t]), b3 = _mm512_set1_ps(w3[t]);
            x0 = _mm512_fmadd_ps(b0, lo, x0), y0 = _mm512_fmadd_ps(b0, hi, y0);
            x1 = _mm512_fmadd_ps(b1, lo, x1), y1 = _mm512_fmadd_ps(b1, hi, y1);
            x2 = _mm512_fmadd_ps(b2, lo, x2), y2 = _mm512_fmadd_ps(b2, hi, y2);
            x3 = _mm512_fmadd_ps(b3, lo, x3), y3 = _mm512_fmadd_ps(b3, hi, y3);
        }
        kvmix__acc_store(v, a0 + c, x0), kvmix__acc_store(v, a1 + c, x1);
        kvmix__acc_store(v, a2 + c, x2), kvmix__acc_store(v, a3 + c, x3);
        if (pair) {
            kvmix__acc_store(v, a0 + c + 16, y0), kvmix__acc_store(v, a1 + c + 16, y1);
            kvmix__acc_store(v, a2 + c + 16, y2), kvmix__acc_store(v, a3 + c + 16, y3);
        }
    }
}

/* kvmix__attend4 over rows [t0, t0 + n) read through k and v (neither NONE). */
static inline void kvmix__attend4_512(const float *KVMIX__RESTRICT q, const kvmix__lanes *k,
                                      const kvmix__lanes *v, int32_t t0, const uint8_t *dead,
                                      int32_t n, float scale, const kvmix__ahead *ahead,
                                      float *KVMIX__RESTRICT acc, float *max, float *sum) {
    float logit[4][KVMIX__TILE_ROWS], w[4][KVMIX__TILE_ROWS], bias[4] = {0, 0, 0, 0};
    float folded[4 * KVMIX_MAX_HEAD_DIM];
    int32_t dim = k->decoder->layout.head_dim, t, g, c;
    const float *qk = q;
    if (k->kind == KVMIX__LANES_TOKEN_INT && k->bits == 4) { /* q in the INT4 lanes' order */
        for (c = 0; c < 4 * dim; c += 16)
            _mm512_storeu_ps(folded + c,
                             _mm512_maskz_permutexvar_ps(KVMIX__ALL16, KVMIX__INT4_ORDER,
                                                         _mm512_loadu_ps(q + c)));
        qk = folded;
    }
    if (k->kind == KVMIX__LANES_CHANNEL_INT2) { /* q . (code * s + m) = (q * s) . code + q . m */
        for (g = 0; g < 4; g++) {
            float part[16];
            __m512 lanes = _mm512_setzero_ps(); /* lane j: channels j, j + 16, ... */
            for (c = 0; c < dim; c += 16) {
                __m512 x = _mm512_loadu_ps(q + g * dim + c);
                _mm512_storeu_ps(folded + g * dim + c,
                                 _mm512_mul_ps(x, _mm512_loadu_ps(k->decoder->scale + c)));
                lanes = _mm512_fmadd_ps(x, _mm512_loadu_ps(k->decoder->min + c), lanes);
            }
            _mm512_storeu_ps(part, lanes);
            for (c = 0; c < 16; c++) bias[g] += part[c];
        }
        qk = folded;
    }
    for (t = 0; t < KVMIX__TILE_ROWS; t += 2) {
        int live0 = t < n && !(dead && dead[t]), live1 = t + 1 < n && !(dead && dead[t + 1]);
        float l0[4] = {0}, l1[4] = {0};
        kvmix__prefetch_slice(ahead, t / 2, KVMIX__TILE_ROWS / 2);
        if (live0 || live1) /* a row past n reads row t in its place, then counts as dead */
            kvmix__logits4_rows2_512(qk, k, t0 + t, t0 + (t + 1 < n ? t + 1 : t), bias, l0, l1);
        for (g = 0; g < 4; g++) {
            logit[g][t] = live0 ? l0[g] * scale : -INFINITY;
            logit[g][t + 1] = live1 ? l1[g] * scale : -INFINITY;
        }
    }
    kvmix__softmax_rows4(logit, w, dim, acc, max, sum);
    kvmix__weighted4_512(&w[0][0], v, t0, n, acc);
}

#endif /* KVMIX__AVX512 */

/* A view span's rows of kv head h added to the partial of `group` query heads q [group][dim]. */
static void kvmix__fast_span(const kvmix_view *view, const kvmix_view_span *vs,
                             const kvmix_view_span *next, int32_t h, const float *q, int32_t group,
                             float scale, kvmix__partial p) {
    kvmix_span span = kvmix__span_of_view(view, vs);
    kvmix__row_decoder keys, values;
    float ktile[KVMIX__TILE_FLOATS], vtile[KVMIX__TILE_FLOATS];
    int32_t dim = view->head_dim, t0, g;
    int32_t rows =
        KVMIX__TILE_FLOATS / dim < KVMIX__TILE_ROWS ? KVMIX__TILE_FLOATS / dim : KVMIX__TILE_ROWS;
    kvmix__row_decoder_open(&keys, &span.key_layout, (const uint8_t *)span.keys,
                            span.key_head_bytes, h);
    kvmix__row_decoder_open(&values, &span.value_layout, (const uint8_t *)span.values,
                            span.value_head_bytes, h);
    int32_t fours = 0; /* heads [0, fours) taken four at a time, the rest one at a time */
    int avx2 = 0;      /* the AVX2 loops run: kvmix__attend4, kvmix__attend1 */
    int fp16 = 0;      /* FP16 rows, read as stored by the AVX2 loops: no tiles */
    int lanes = 0;     /* INT rows read as stored by the four heads (kvmix__attend4_512) */
    if (kvmix__avx2_runs()) {
        avx2 = 1;
        fours = group / 4 * 4;
        fp16 = keys.layout.format == KVMIX_FORMAT_FP16 && values.layout.format == KVMIX_FORMAT_FP16;
    }
#ifndef KVMIX__AVX2_LOOPS
    (void)next;
#endif
#ifdef KVMIX__AVX512
    kvmix__lanes key_lanes = kvmix__lanes_of(&keys, 1), value_lanes = kvmix__lanes_of(&values, 0);
    lanes = !fp16 && key_lanes.kind != KVMIX__LANES_NONE && value_lanes.kind != KVMIX__LANES_NONE;
#endif
    for (t0 = 0; t0 < vs->n_tokens; t0 += rows) {
        int32_t n = vs->n_tokens - t0 < rows ? vs->n_tokens - t0 : rows;
        const uint8_t *dead = span.dead ? span.dead + t0 : NULL;
#ifdef KVMIX__AVX2_LOOPS
        kvmix__ahead ahead; /* the next tile's rows: this span's, else the next span's blocks */
        if (fours == 0) {
            ahead.bytes[0] = ahead.bytes[1] = 0;
            ahead.at[0] = ahead.at[1] = NULL;
        } else if (t0 + rows < vs->n_tokens) {
            ahead.at[0] = keys.block + kvmix__row_at(&keys.sections, t0 + rows);
            ahead.at[1] = values.block + kvmix__row_at(&values.sections, t0 + rows);
            ahead.bytes[0] = (size_t)keys.sections.row_bytes * (size_t)rows;
            ahead.bytes[1] = (size_t)values.sections.row_bytes * (size_t)rows;
        } else if (next) {
            ahead = kvmix__span_ahead(view, next, h);
        } else {
            ahead.bytes[0] = ahead.bytes[1] = 0;
            ahead.at[0] = ahead.at[1] = NULL;
        }
#endif
#ifdef KVMIX__AVX512
        for (g = 0; lanes && g < fours; g += 4)
            kvmix__attend4_512(q + (size_t)g * dim, &key_lanes, &value_lanes, t0, dead, n, scale,
                               &ahead, p.acc + (size_t)g * dim, &p.max[g], &p.sum[g]);
#endif
        if (!fp16 && (!lanes || fours < group)) {
            kvmix__decode_tile(&keys, t0, n, ktile);
            kvmix__decode_tile(&values, t0, n, vtile);
        }
#ifdef KVMIX__AVX2_LOOPS
        for (g = 0; !lanes && g < fours; g += 4)
            if (fp16)
                kvmix__attend4(q + (size_t)g * dim, keys.block + kvmix__row_at(&keys.sections, t0),
                               values.block + kvmix__row_at(&values.sections, t0),
                               (size_t)keys.sections.row_bytes, 1, dead, n, dim, scale, &ahead,
                               p.acc + (size_t)g * dim, &p.max[g], &p.sum[g]);
            else
                kvmix__attend4(q + (size_t)g * dim, (const uint8_t *)ktile, (const uint8_t *)vtile,
                               (size_t)dim * sizeof(float), 0, dead, n, dim, scale, &ahead,
                               p.acc + (size_t)g * dim, &p.max[g], &p.sum[g]);
        for (g = fours; avx2 && g < group; g++)
            if (fp16)
                kvmix__attend1(q + (size_t)g * dim, keys.block + kvmix__row_at(&keys.sections, t0),
                               values.block + kvmix__row_at(&values.sections, t0),
                               (size_t)keys.sections.row_bytes, 1, dead, n, dim, scale,
                               p.acc + (size_t)g * dim, &p.max[g], &p.sum[g]);
            else
                kvmix__attend1(q + (size_t)g * dim, (const uint8_t *)ktile, (const uint8_t *)vtile,
                               (size_t)dim * sizeof(float), 0, dead, n, dim, scale,
                               p.acc + (size_t)g * dim, &p.max[g], &p.sum[g]);
#endif
        for (g = fours; !avx2 && g < group; g++)
            kvmix__attend_tile(q + (size_t)g * dim, ktile, vtile, dead, n, dim, scale,
                               p.acc + (size_t)g * dim, &p.max[g], &p.sum[g]);
    }
}

/* The tasks of one view decode: sequences' chunks numbered sequence-major, then kv head, then
   chunk; chunk_first[s] is sequence s's first task. */
typedef struct kvmix__fast_job {
    const kvmix_view *view;
    int32_t n_q_heads, group;
    float scale;
    const float *q;
    const int32_t *task_first; /* [n_seqs + 1] */
    float *partials;           /* per task: group * (head_dim + 2) floats */
} kvmix__fast_job;

static int32_t kvmix__chunks_of(const kvmix_view *view, int32_t s) {
    int32_t spans = view->seq_first_span[s + 1] - view->seq_first_span[s];
    return spans == 0 ? 1 : (spans + KVMIX_DECODE_CHUNK_SPANS - 1) / KVMIX_DECODE_CHUNK_SPANS;
}

static size_t kvmix__partial_floats(const kvmix_view *view, int32_t group) {
    return (size_t)group * ((size_t)view->head_dim + 2u);
}

static kvmix__partial kvmix__partial_at(const kvmix__fast_job *job, int32_t task) {
    kvmix__partial p;
    p.acc = job->partials + (size_t)task * kvmix__partial_floats(job->view, job->group);
    p.max = p.acc + (size_t)job->group * job->view->head_dim;
    p.sum = p.max + job->group;
    return p;
}

static void kvmix__fast_task(void *arg, int32_t task) {
    const kvmix__fast_job *job = (const kvmix__fast_job *)arg;
    const kvmix_view *view = job->view;
    int32_t lo = 0, hi = view->n_seqs, s, chunks, h, chunk, i, end, g;
    kvmix__partial p = kvmix__partial_at(job, task);
    while (hi - lo > 1) { /* the sequence whose tasks hold this one */
        int32_t mid = lo + (hi - lo) / 2;
        if (job->task_first[mid] <= task)
            lo = mid;
        else
            hi = mid;
    }
    s = lo;
    chunks = kvmix__chunks_of(view, s);
    h = (task - job->task_first[s]) / chunks;
    chunk = (task - job->task_first[s]) % chunks;
    for (g = 0; g < job->group; g++) {
        p.max[g] = -INFINITY;
        p.sum[g] = 0.0f;
    }
    memset(p.acc, 0, (size_t)job->group * view->head_dim * sizeof(float));
    i = view->seq_first_span[s] + chunk * KVMIX_DECODE_CHUNK_SPANS;
    end = i + KVMIX_DECODE_CHUNK_SPANS;
    if (end > view->seq_first_span[s + 1]) end = view->seq_first_span[s + 1];
    for (; i < end; i++) {
        kvmix__fast_span(
            view, &view->spans[i], i + 1 < view->seq_first_span[s + 1] ? &view->spans[i + 1] : NULL,
            h, job->q + ((size_t)s * job->n_q_heads + (size_t)h * job->group) * view->head_dim,
            job->group, job->scale, p);
    }
}

/* Sequence s's chunks of kv head h merged in order into out and lse. */
static void kvmix__fast_merge(const kvmix__fast_job *job, int32_t s, int32_t h, float *out,
                              float *lse) {
    int32_t dim = job->view->head_dim, chunks = kvmix__chunks_of(job->view, s), k, g, c;
    int32_t first = job->task_first[s] + h * chunks;
    for (g = 0; g < job->group; g++) {
        size_t row = ((size_t)s * job->n_q_heads + (size_t)h * job->group + g);
        float m = -INFINITY, total = 0.0f, *o = out + row * dim;
        for (k = 0; k < chunks; k++) {
            kvmix__partial p = kvmix__partial_at(job, first + k);
            if (p.max[g] > m) m = p.max[g];
        }
        for (c = 0; c < dim; c++) o[c] = 0.0f;
        if (m != -INFINITY)
            for (k = 0; k < chunks; k++) {
                kvmix__partial p = kvmix__partial_at(job, first + k);
                float w = expf(p.max[g] - m);
                total += w * p.sum[g];
                for (c = 0; c < dim; c++) o[c] += w * p.acc[(size_t)g * dim + c];
            }
        if (total > 0.0f)
            for (c = 0; c < dim; c++) o[c] /= total;
        if (lse) lse[row] = total > 0.0f ? m + logf(total) : -INFINITY;
    }
}

#if !defined(KVMIX_NO_THREADS) && (defined(__unix__) || defined(__APPLE__))
#include <pthread.h>
#define KVMIX__PTHREADS 1
#endif

/* Tasks run by the library's own threads: thread i takes tasks i, i + n, i + 2n, ... */
typedef struct kvmix__stride {
    kvmix_task_fn task;
    void *arg;
    int32_t n_tasks, first, step;
} kvmix__stride;

static void *kvmix__stride_run(void *arg) {
    const kvmix__stride *st = (const kvmix__stride *)arg;
    int32_t i;
    for (i = st->first; i < st->n_tasks; i += st->step) st->task(st->arg, i);
    return NULL;
}

#define KVMIX__MAX_OWN_THREADS 256

static void kvmix__run_tasks(const kvmix_parallel *parallel, int32_t n_tasks, kvmix_task_fn task,
                             void *arg) {
    kvmix__stride all;
    all.task = task;
    all.arg = arg;
    all.n_tasks = n_tasks;
    all.first = 0;
    all.step = 1;
    if (parallel && parallel->parallel_for) {
        parallel->parallel_for(parallel->user, n_tasks, task, arg);
        return;
    }
#ifdef KVMIX__PTHREADS
    if (parallel && parallel->n_threads > 1 && n_tasks > 1) {
        kvmix__stride stride[KVMIX__MAX_OWN_THREADS];
        pthread_t thread[KVMIX__MAX_OWN_THREADS];
        int started[KVMIX__MAX_OWN_THREADS];
        int32_t n = parallel->n_threads, i;
        if (n > n_tasks) n = n_tasks;
        if (n > KVMIX__MAX_OWN_THREADS) n = KVMIX__MAX_OWN_THREADS;
        for (i = 0; i < n; i++) {
            stride[i] = all;
            stride[i].first = i;
            stride[i].step = n;
            /* a thread that cannot start leaves its tasks to the calling thread */
            started[i] =
                i < n - 1 && pthread_create(&thread[i], NULL, kvmix__stride_run, &stride[i]) == 0;
        }
        for (i = 0; i < n; i++)
            if (!started[i]) kvmix__stride_run(&stride[i]);
        for (i = 0; i < n - 1; i++)
            if (started[i]) pthread_join(thread[i], NULL);
        return;
    }
#endif
    kvmix__stride_run(&all);
}

/* Tasks of the view: per sequence n_kv_heads times its chunks; 0 when past int32 counts. */
static int64_t kvmix__fast_tasks(const kvmix_view *view) {
    int64_t n = 0;
    int32_t s;
    for (s = 0; s < view->n_seqs; s++) n += (int64_t)view->n_kv_heads * kvmix__chunks_of(view, s);
    return n;
}

/* Workspace of a fast decode with n_tasks tasks: task_first, then the partials; 0 past size_t. */
static size_t kvmix__fast_workspace_bytes(int64_t n_seqs, int64_t n_tasks, int32_t head_dim,
                                          int32_t group) {
    double bytes = (double)(n_seqs + 1) * 4.0 + 8.0 +
                   (double)n_tasks * (double)group * ((double)head_dim + 2.0) * 4.0;
    if (bytes >= (double)(size_t)-1 || n_tasks > INT32_MAX) return 0;
    return kvmix__align8(((size_t)n_seqs + 1) * sizeof(int32_t)) +
           (size_t)n_tasks * (size_t)group * ((size_t)head_dim + 2u) * sizeof(float);
}

static kvmix_result kvmix__fast_check(const kvmix_view *view, int32_t n_q_heads) {
    kvmix_result r = kvmix_view_check(view, NULL);
    if (r != KVMIX_SUCCESS) return r;
    if (n_q_heads <= 0 || n_q_heads % view->n_kv_heads != 0) return KVMIX_ERR_INVALID_ARGUMENT;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_view_decode_workspace(const kvmix_view *view, int32_t n_q_heads,
                                                  size_t *out_bytes) {
    kvmix_result r;
    size_t bytes;
    if (!out_bytes) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__fast_check(view, n_q_heads)) != KVMIX_SUCCESS) return r;
    bytes = kvmix__fast_workspace_bytes(view->n_seqs, kvmix__fast_tasks(view), view->head_dim,
                                        n_q_heads / view->n_kv_heads);
    if (bytes == 0) return KVMIX_ERR_INVALID_ARGUMENT;
    *out_bytes = bytes;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_view_decode(const kvmix_view *view, int32_t n_q_heads, float scale,
                                        const float *q, float *out, float *lse, void *workspace,
                                        size_t workspace_bytes, const kvmix_parallel *parallel) {
    kvmix__fast_job job;
    int32_t *task_first = (int32_t *)workspace, s, h;
    size_t need;
    kvmix_result r;
    if (!q || !out || !workspace) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix_view_decode_workspace(view, n_q_heads, &need)) != KVMIX_SUCCESS) return r;
    if (!(scale >= 0.0f) || isinf(scale) || ((uintptr_t)workspace & 7u) != 0 ||
        (parallel && parallel->n_threads < 0))
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (workspace_bytes < need) return KVMIX_ERR_BUFFER_TOO_SMALL;
    task_first[0] = 0;
    for (s = 0; s < view->n_seqs; s++)
        task_first[s + 1] = task_first[s] + view->n_kv_heads * kvmix__chunks_of(view, s);
    job.view = view;
    job.n_q_heads = n_q_heads;
    job.group = n_q_heads / view->n_kv_heads;
    job.scale = kvmix__softmax_scale(scale, view->head_dim);
    job.q = q;
    job.task_first = task_first;
    job.partials = (float *)(void *)((uint8_t *)workspace +
                                     kvmix__align8(((size_t)view->n_seqs + 1) * sizeof(int32_t)));
    kvmix__run_tasks(parallel, task_first[view->n_seqs], kvmix__fast_task, &job);
    for (s = 0; s < view->n_seqs; s++)
        for (h = 0; h < view->n_kv_heads; h++) kvmix__fast_merge(&job, s, h, out, lse);
    return KVMIX_SUCCESS;
}

// >>cache
/*
   The paged mixed-precision cache.

   Arena and pages. All K/V bytes live in one arena of caller memory, cut into granules
   (desc.granule_bytes, 256 by default) and handed out from a bitmap with one bit per granule.
   A page is any run of granules, whatever its format, so capacity is the sum of all free bytes:
   a workload whose INT2/INT4/FP16 mix differs from what was expected keeps running while bytes
   remain. Pages that stay while a sequence grows (sealed pages, sink pages) are taken first fit
   from the low end; pages it frees again (FP16 buffer pages, their copies on write, key-sealed
   pages of a values-only window) last fit from the high end. Mixed in one pool, a sealed page
   would land in the hole a freed buffer left and leave a gap no page fits; kept apart, the
   buffers' holes are refilled by buffers and the sealed pages pack, so an arena needs what its
   pages hold at their peak (kvmix_cache_arena_bytes_for) and no more. Fragmentation otherwise:
   freeing clears bits, so neighbouring free runs coalesce by construction; an allocation can
   still fail while enough bytes are free in smaller runs (kvmix_cache_stats reports the largest
   free run). Internal waste is under one granule per page. Allocation is deterministic (the
   same state and requests give the same offsets), which makes plans repeatable (below).

   A page holds page_tokens (P) consecutive positions of one sequence for every layer and kv
   head (sink pages hold the first n_sink positions). Its bytes, layer after layer, are
       [K block of head 0 .. K block of head H-1][V block of head 0 .. V block of head H-1]
   where each block is one kvmix_layout block (the >>formats layouts) of the page's key or value
   format. So a view of layer l lists, per page, key_offset = page + l * layer_bytes with
   key_head_bytes = the key block size, and the values right after the H key blocks. FP16 blocks
   of a buffer page are laid out for `capacity` rows (their head stride) and hold n_rows of them.
   A page descriptor records offset, granules, formats, rows, reference count; page 0 is the
   sentinel that evicted positions point at; it owns no bytes and is never freed.

   Sequences. Each has a page table (entries: page, first position, rows it uses, in position
   order) and a slot map: position -> page * P + row, or KVMIX_CACHE_DEAD_SLOT. A position's row
   never moves: eviction rewrites the slot-map entry only; RoPE phases stay what they were.

   Reserve, then write by layer. A model computes layer l's K/V of a new token only after layers
   0 .. l-1 ran, and layer l's attention must already see it. So a position is first reserved
   (slot map, page-table entry, a row of the FP16 buffer page: everything that can fail, planned
   like any allocating call), then its rows are written layer by layer (kvmix_cache_write: FP16
   stores into rows that exist, which cannot fail once validated). Each sequence keeps per layer
   the count of positions written, written in order without gaps, and n_written, their minimum.
   Unwritten rows are never read: kvmix_cache_read refuses them, a view of layer l clips a
   sequence's FP16 spans at that layer's count, and sealing (below) waits for n_written. Keeping
   the rows' state as counters costs one int32 per sequence and layer, and a check per span;
   per-row flags would cost a bit per row and layer in every page. The counters also make the
   other invariants cheap: eviction and fork only take positions below n_written, so a row not
   yet written is used by its own sequence only, and sealed pages hold written rows only.
   ingest and append are the same plan with the rows stored as each position is reserved, so the
   rows count as written for the seals of that same call (a prefill seals the pages it fills,
   as if it were reserve + write per layer with sealing after the writes).

   Precision. Every token carries a requested (key, value) format from a policy. Tokens of a page
   share its formats: the page is sealed to the highest precision any of its rows asked for, per
   key and value separately, in the order FP16 > INT8 > INT4 > BOOSTED > INT2 > INT2_CHANNEL
   (bits per element), so no token gets less than it asked for. Sink positions are FP16. So that
   a page's tokens ask for the same, a sequence's positions carry a run (kvmix_cache_seq_set_run)
   and a page holds one: the first position of a new run closes the buffer page being filled
   (its rows copied into an FP16 allocation of just them, rounded up to 8 rows; it takes no more
   rows and seals once written and out of the window, its rows past the live ones repeating the
   last, dead in views). Re-tiering (kvmix_cache_retier, kvmix_policy_retier_turn) then gives
   each page, and so each token, what its tokens ask for as their turn ages.

   Buffer, window, sealing (KIVI-style). New rows always land in the sequence's FP16 buffer page
   (in the arena, so views reach it from the same base). A page is sealed, that is quantized in
   one step into a new allocation of its requested formats and its FP16 bytes freed, when it is
   full, all its positions are older than the window, first_pos + P <= n_tokens - n_window
   (n_tokens counts reserved positions), and all are written on every layer, first_pos + P <=
   n_written. Seals happen in the allocating calls (reserve, ingest, append, finish) only; with
   reserve + write, the page that the last write filled is sealed by the next reserve.
   The FP16 tail therefore holds the n_window most recent tokens plus the part of the current page,
   at most n_window + 2P - 1 tokens when rows come by ingest or append (with reserve + write, full
   pages also wait for their last rows and the next reserve): the window is the buffer's tail,
   counted in whole pages. Per-channel keys (INT2_CHANNEL, BOOSTED) are computed over a full page,
   and decode tokens reach them exactly like prefill tokens; the cost of a seal is amortized over
   the P appends that filled the page. A page that asked for FP16 only is sealed by flag, without a
   copy. With desc.window_values_only (Kitty's layout: a key quantization buffer of one page and a
   window of FP16 values) a page is sealed in two steps: once full and written, its keys are
   quantized into a new allocation that holds them packed and the values still FP16 (the page stays
   unsealed but takes no rows); once it leaves the window, the whole page is sealed, its packed keys
   copied byte for byte. The window then holds values only; keys are FP16 in the page being filled.
   kvmix_cache_seq_finish seals every full page the sequence does not share and applies
   desc.partial to its partial one if not shared (pages shared with another sequence are left to
   the window, so that one request's end never quantizes another's recent rows): KEEP_FP16 leaves
   it as the buffer; QUANTIZE seals its n rows now, with per-channel formats replaced by per-token
   ones of no lower precision (INT2_CHANNEL -> INT2, BOOSTED -> INT4), since per-channel statistics
   over a few rows are not what the policy asked for. Rows appended after a sealed partial page
   start a new page.

   Sharing. kvmix_cache_seq_fork copies the parent's page-table entries of a prefix (the last one
   clipped to the prefix) and its slot map; each page's reference count counts page-table entries. A
   shared page has one format for all its sharers: sealing or re-tiering it changes the descriptor,
   never the slot maps; the window promise holds for pages a sequence does not share, a shared page
   being sealed when it leaves the window of the sharer that passes it first (shared prefixes are
   usually old). A buffer page with refcount > 1 is copied before a sequence adds positions to it
   (copy on write of the rows it uses, in reserve, ingest, append; kvmix_cache_write never copies:
   its new rows are the writer's alone, see above); a sealed page cannot take rows, so a child
   forked inside one starts a new page and the page's rows past its fork point are dead to it (views
   flag them). A page returns to the arena when its count reaches zero: when the last sequence that
   references it is freed, or evicts all its rows there.

   Failure atomicity (check, then commit). Every call validates its arguments first. Calls that
   allocate (reserve, ingest, append, finish) first run a plan: the same decisions as the real run,
   on a small copy of the sequence's unsealed pages, with the arena operations applied to the bitmap
   and journaled. If any allocation fails the journal is undone, which restores the bitmap and
   counters bit for bit, and the call returns KVMIX_ERR_OUT_OF_MEMORY before any other byte changed.
   Otherwise the journal is undone too and the real run repeats the plan; since allocation is
   deterministic it gets the same offsets and cannot fail. Retier allocates at most once (nothing
   when the new blocks fit the old bytes) and validates before writing.

   Memory. kvmix_cache_memory_bytes covers all bookkeeping: sequence records, page tables
   [max_seqs][max_pages_per_seq], slot maps [max_seqs][max_tokens_per_seq] (4 bytes a position),
   written counts [max_seqs][n_layers], page descriptors (max_seqs * max_pages_per_seq + 1: every
   page is referenced by an entry, so they never run out), the descriptor free stack, the granule
   bitmap, a scratch block of P * head_dim floats and the plan state. Stats count all of it in bits
   per element.

   Threads: one writer per cache (see the declarations).
*/

#define KVMIX__CACHE_ALIGN      64
#define KVMIX__CACHE_MAX_LAYERS 4096
#define KVMIX__CACHE_MAX_HEADS  4096

/* ---- why a call failed ----------------------------------------------------------------------- */

/* kvmix__why, a check's verdict, is with the rules (>>rules): they give it too. */

/* Appends text to the cache's message at *at, truncating it to the buffer. */
static void kvmix__error_append(kvmix_cache *c, size_t *at, const char *text) {
    while (*text && *at + 1 < KVMIX_CACHE_ERROR_BYTES) c->priv.error[(*at)++] = *text++;
    c->priv.error[*at] = 0;
}

/* The verdict of a call that records: its message becomes "<prefix><argument>: <reason>", or ""
   when it succeeded. Returns the verdict's result. */
static kvmix_result kvmix__record_as(kvmix_cache *c, const char *prefix, kvmix__why w) {
    size_t at = 0;
    c->priv.error[0] = 0;
    if (w.result == KVMIX_SUCCESS) return KVMIX_SUCCESS;
    kvmix__error_append(c, &at, prefix);
    kvmix__error_append(c, &at, w.argument);
    kvmix__error_append(c, &at, ": ");
    kvmix__error_append(c, &at, w.reason);
    return w.result;
}

static kvmix_result kvmix__record(kvmix_cache *c, kvmix__why w) {
    return kvmix__record_as(c, "", w);
}

KVMIXDEF const char *kvmix_cache_last_error(const kvmix_cache *cache) {
    return cache ? cache->priv.error : "cache: NULL";
}

/* ---- the write plan's state ------------------------------------------------------------------ */

/* One unsealed page of the sequence a plan works on, oldest first. */
typedef struct kvmix__sim_page {
    int32_t entry; /* index in the sequence's page table */
    int32_t first_pos;
    int32_t rows;      /* rows the sequence uses */
    int32_t page_rows; /* rows of the descriptor */
    int32_t capacity;
    uint8_t shared; /* refcount > 1 */
    uint8_t sealed;
    uint8_t sink;
    uint8_t want_key;
    uint8_t want_value;
    uint8_t keys_sealed; /* keys packed, values still FP16 (a values-only window) */
    uint8_t closed;
    uint8_t reserved;
    uint32_t run;
    int64_t start; /* granule */
    int64_t n_granules;
} kvmix__sim_page;

typedef struct kvmix__arena_op {
    int64_t start;
    int64_t n;
    int64_t taken; /* 1 = allocation, 0 = free */
} kvmix__arena_op;

/* A write call's plan (dry = 1) or its real run (dry = 0); both take the same decisions. */
typedef struct kvmix__plan {
    int dry;
    int overflow;
    int32_t n_ops;
    int32_t n;         /* pages[] used */
    int32_t next_seal; /* first page that may still need sealing */
    int32_t len;       /* the sequence's n_tokens as the run goes */
    int32_t written;   /* positions written on every layer as the run goes (seals wait for it) */
    int32_t n_entries;
    int32_t tail_open; /* pages[n - 1] is the last page-table entry and unsealed */
    int32_t new_pages; /* descriptors taken */
    int32_t max_ops;   /* journal entries written */
    int32_t n_sealed;  /* seals that used the scratch block */
    int32_t n_jobs;    /* device arena: jobs queued */
    kvmix__sim_page *pages;
    kvmix__arena_op *ops;
    kvmix__why failure; /* what ran out, when something did */
} kvmix__plan;

/* The plan cannot go on: `argument` ran out of room. */
static kvmix_result kvmix__plan_fail(kvmix__plan *plan, const char *argument, const char *reason) {
    plan->failure = kvmix__why_not(KVMIX_ERR_OUT_OF_MEMORY, argument, reason);
    return KVMIX_ERR_OUT_OF_MEMORY;
}

#define KVMIX__HELD_DESCRIPTORS "released pages hold them until kvmix_cache_jobs_take"
#define KVMIX__NO_RUN           "no free run of granules for "

/* ---- jobs, page geometry and format order ---------------------------------------------------- */

/* A queued job of a device arena, with what decides its batch. */
typedef struct kvmix__job {
    kvmix_quantize_job job;
    uint32_t segment;
    uint8_t kind;     /* kvmix_cache_batch_kind */
    uint8_t source;   /* kvmix_cache_source */
    uint8_t is_value; /* QUANTIZE: of the destination block */
    uint8_t format;   /* QUANTIZE: of the destination block */
    int32_t block_rows;
    int32_t taken; /* while kvmix_cache_jobs_take groups them */
} kvmix__job;

/* Granules of a device arena held until the jobs are taken. */
typedef struct kvmix__run {
    int64_t start;
    int64_t n;
} kvmix__run;

/* Byte geometry of a page with these formats: block sizes and the stride of one layer. */
typedef struct kvmix__geom {
    size_t key_bytes;
    size_t value_bytes;
    size_t layer_bytes;
    size_t total_bytes;
} kvmix__geom;

static int kvmix__format_rank(int32_t format) {
    switch (format) {
    case KVMIX_FORMAT_FP16: return 6;
    case KVMIX_FORMAT_INT8: return 5;
    case KVMIX_FORMAT_INT4: return 4;
    case KVMIX_FORMAT_BOOSTED: return 3;
    case KVMIX_FORMAT_INT2: return 2;
    case KVMIX_FORMAT_INT2_CHANNEL: return 1;
    }
    return 0;
}

/* A requested precision with each zero format replaced by the desc's default for that side. */
static kvmix_cache_precision kvmix__precision_or_default(const kvmix_cache *c,
                                                         kvmix_cache_precision p) {
    if (p.key_format == 0) p.key_format = c->desc.default_precision.key_format;
    if (p.value_format == 0) p.value_format = c->desc.default_precision.value_format;
    return p;
}

/* Whether a resolved precision can be stored: BOOSTED needs boosted channels. */
static int kvmix__boost_ok(const kvmix_cache_desc *d, kvmix_cache_precision p) {
    return d->n_boost > 0 ||
           (p.key_format != KVMIX_FORMAT_BOOSTED && p.value_format != KVMIX_FORMAT_BOOSTED);
}

#define KVMIX__NO_BOOST "BOOSTED asked for, but desc.n_boost is 0 (no boosted channels)"

/* Whether a requested precision names formats: known ones, or 0 for the default. */
static uint8_t kvmix__higher_format(uint8_t a, uint8_t b) {
    return kvmix__format_rank(a) >= kvmix__format_rank(b) ? a : b;
}

/* The per-token format of no lower precision that a partial page uses instead. */
static uint8_t kvmix__per_token_format(uint8_t format) {
    if (format == KVMIX_FORMAT_INT2_CHANNEL) return KVMIX_FORMAT_INT2;
    if (format == KVMIX_FORMAT_BOOSTED) return KVMIX_FORMAT_INT4;
    return format;
}

/* The layout of a page's key (is_value 0) or value block of `rows` rows. */
static kvmix_layout kvmix__cache_layout(const kvmix_cache *c, int is_value, int32_t format,
                                        int32_t rows) {
    kvmix_layout l;
    l.format = (kvmix_format)format;
    l.n_tokens = rows;
    l.head_dim = c->desc.head_dim;
    l.group_size = !kvmix__is_per_token_int(l.format) ? 0
                   : is_value                         ? c->desc.value_group_size
                                                      : c->desc.group_size;
    l.n_boost = l.format == KVMIX_FORMAT_BOOSTED ? c->desc.n_boost : 0;
    return l;
}

/* Bytes between consecutive blocks of a page: the block's size rounded up to 16 bytes, so that
   every block of a view starts 16-byte aligned, as GPU kernels load them in 16-byte vectors. */
static size_t kvmix__cache_block_bytes(const kvmix_cache *c, int is_value, int32_t format,
                                       int32_t rows, int32_t capacity) {
    kvmix_layout l;
    size_t bytes;
    int full =
        format == KVMIX_FORMAT_FP16 ? capacity == c->desc.page_tokens : rows == c->desc.page_tokens;
    if (full && format > 0 && format < 8 && c->priv.full_block_bytes[is_value][format] != 0)
        return c->priv.full_block_bytes[is_value][format]; /* views ask this for every page */
    if (format == KVMIX_FORMAT_FP16) {
        bytes = (size_t)capacity * (size_t)c->desc.head_dim * 2;
    } else {
        l = kvmix__cache_layout(c, is_value, format, rows);
        bytes = kvmix__layout_sections(&l).total_bytes;
    }
    return (bytes + 15) / 16 * 16;
}

static kvmix__geom kvmix__page_geom(const kvmix_cache *c, int32_t key_format, int32_t value_format,
                                    int32_t rows, int32_t capacity) {
    kvmix__geom g;
    g.key_bytes = kvmix__cache_block_bytes(c, 0, key_format, rows, capacity);
    g.value_bytes = kvmix__cache_block_bytes(c, 1, value_format, rows, capacity);
    g.layer_bytes = (size_t)c->desc.n_kv_heads * (g.key_bytes + g.value_bytes);
    g.total_bytes = g.layer_bytes * (size_t)c->desc.n_layers;
    return g;
}

static kvmix__geom kvmix__geom_of(const kvmix_cache *c, const kvmix_cache_page *p) {
    return kvmix__page_geom(c, p->key_format, p->value_format, p->n_rows, p->capacity);
}

/* Offset from the page start of kv head h's key (is_value 0) or value block of a layer. */
static size_t kvmix__block_offset(const kvmix_cache *c, const kvmix__geom *g, int32_t layer,
                                  int is_value, int32_t head) {
    size_t at = g->layer_bytes * (size_t)layer;
    if (is_value)
        return at + (size_t)c->desc.n_kv_heads * g->key_bytes + g->value_bytes * (size_t)head;
    return at + g->key_bytes * (size_t)head;
}

static int64_t kvmix__granules_of(const kvmix_cache *c, size_t bytes) {
    return (int64_t)((bytes + c->desc.granule_bytes - 1) / c->desc.granule_bytes);
}

/* ---- a sequence's records: page table, slot map, written counts ------------------------------ */

static kvmix_cache_entry *kvmix__seq_entries(const kvmix_cache *c, int32_t seq) {
    return c->entries + (size_t)seq * (size_t)c->desc.max_pages_per_seq;
}

static uint32_t *kvmix__seq_slots(const kvmix_cache *c, int32_t seq) {
    return c->slots + (size_t)seq * (size_t)c->desc.max_tokens_per_seq;
}

/* [n_layers] positions written per layer. */
static int32_t *kvmix__seq_written(const kvmix_cache *c, int32_t seq) {
    return c->written + (size_t)seq * (size_t)c->desc.n_layers;
}

static void kvmix__seq_set_written(kvmix_cache *c, int32_t seq, int32_t n) {
    int32_t *w = kvmix__seq_written(c, seq), layer;
    for (layer = 0; layer < c->desc.n_layers; layer++) w[layer] = n;
    c->seqs[seq].n_written = n;
}

/* Entries of a sequence from `entry` on may have other spans now (kvmix_cache_view_changes). */
static void kvmix__view_touch(kvmix_cache *c, int32_t seq, int32_t entry) {
    if (entry < c->seqs[seq].view_from) c->seqs[seq].view_from = entry;
}

static uint32_t kvmix__slot(const kvmix_cache *c, uint32_t page, int32_t row) {
    return page * (uint32_t)c->desc.page_tokens + (uint32_t)row;
}

/* One past the last position an entry covers. */
static int32_t kvmix__entry_end(const kvmix_cache_entry *e) {
    return e->first_pos + (e->n_positions > 0 ? e->n_positions : e->n_rows);
}

/* How many of rows [0, n) of an entry's page the sequence still uses, and which (live[row],
   when live is not NULL). A compacted page's rows are found through the slot map over the
   positions it covers (slots below the page's first wrap around and fail the test). */
static int32_t kvmix__entry_rows_live(const kvmix_cache *c, const uint32_t *slots,
                                      const kvmix_cache_entry *e, int32_t n, uint8_t *live) {
    int32_t row, pos, count = 0;
    uint32_t first = kvmix__slot(c, e->page, 0);
    if (e->n_positions == 0) {
        for (row = 0; row < n; row++) {
            int used = row < e->n_rows && slots[e->first_pos + row] == first + (uint32_t)row;
            if (live) live[row] = (uint8_t)used;
            count += used;
        }
        return count;
    }
    if (live) memset(live, 0, (size_t)n);
    for (pos = e->first_pos; pos < kvmix__entry_end(e); pos++)
        if (slots[pos] - first < (uint32_t)n) {
            if (live) live[slots[pos] - first] = 1;
            count++;
        }
    return count;
}

/* ---- the granule bitmap -------------------------------------------------------------------- */

static int kvmix__granule_used(const uint64_t *bitmap, int64_t i) {
    return (int)((bitmap[i >> 6] >> (i & 63)) & 1u);
}

static void kvmix__granules_mark(uint64_t *bitmap, int64_t start, int64_t n, int used) {
    int64_t i = start, end = start + n;
    while (i < end) {
        if ((i & 63) == 0 && end - i >= 64) {
            bitmap[i >> 6] = used ? ~(uint64_t)0 : 0;
            i += 64;
            continue;
        }
        if (used)
            bitmap[i >> 6] |= (uint64_t)1 << (i & 63);
        else
            bitmap[i >> 6] &= ~((uint64_t)1 << (i & 63));
        i++;
    }
}

/* Trailing zero bits of a nonzero word. */
static int kvmix__ctz64(uint64_t x) {
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_ctzll(x);
#else
    int n = 0;
    while (!(x & 1u)) x >>= 1, n++;
    return n;
#endif
}

/* Leading zero bits of a nonzero word. */
static int kvmix__clz64(uint64_t x) {
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_clzll(x);
#else
    int n = 0;
    while (!(x >> 63)) x <<= 1, n++;
    return n;
#endif
}

/* The first run of n free granules at or after the hint (first fit), or -1. Walks the bitmap a
   word at a time: used and free stretches are skipped whole. */
static int64_t kvmix__arena_find(const kvmix_cache *c, int64_t n, int64_t from) {
    const uint64_t *bm = c->priv.bitmap;
    int64_t total = c->priv.n_granules,
            i = from > c->priv.hints.first_free ? from : c->priv.hints.first_free;
    if (n <= 0 || n > c->priv.n_free_granules) return -1;
    while (i + n <= total) {
        int64_t j, end = i + n;
        uint64_t used = bm[i >> 6] >> (i & 63);
        if (used & 1u) { /* skip the used bits from i on */
            uint64_t free_bits = ~used;
            i = free_bits == 0 || (i & 63) + kvmix__ctz64(free_bits) >= 64
                    ? (i | 63) + 1
                    : i + kvmix__ctz64(free_bits);
            continue;
        }
        j = i;
        while (j < end) { /* the free run from i */
            uint64_t w = bm[j >> 6] >> (j & 63);
            if (w == 0) {
                j = (j | 63) + 1;
                continue;
            }
            j += kvmix__ctz64(w);
            break;
        }
        if (j >= end) return i;
        i = j;
    }
    return -1;
}

/* The granules at and below i - 1, granule i - 1 as the top bit (bits under word i - 1's first
   granule read as free). */
static uint64_t kvmix__bits_below(const uint64_t *bitmap, int64_t i) {
    return bitmap[(i - 1) >> 6] << (63 - ((i - 1) & 63));
}

/* The last run of n free granules that ends at or before the hint (last fit: the mirror of
   kvmix__arena_find), or -1. */
static int64_t kvmix__arena_find_last(const kvmix_cache *c, int64_t n, int64_t below) {
    const uint64_t *bm = c->priv.bitmap;
    int64_t i = below < c->priv.hints.last_free_end ? below : c->priv.hints.last_free_end;
    if (n <= 0 || n > c->priv.n_free_granules) return -1;
    while (i - n >= 0) {
        int64_t j, start = i - n;
        uint64_t used = kvmix__bits_below(bm, i);
        if (used >> 63) { /* skip the used bits from i - 1 down */
            i -= ~used == 0 ? 64 : kvmix__clz64(~used);
            continue;
        }
        j = i;
        while (j > start) { /* the free run down from i - 1 */
            uint64_t w = kvmix__bits_below(bm, j);
            if (w == 0) {
                j = (j - 1) & ~(int64_t)63;
                continue;
            }
            j -= kvmix__clz64(w);
            break;
        }
        if (j <= start) return start;
        i = j;
    }
    return -1;
}

static int kvmix__journal(kvmix_cache *c, kvmix__plan *plan, int64_t start, int64_t n, int taken) {
    if (!plan || !plan->dry) return 1;
    if (plan->n_ops >= c->priv.journal_capacity) {
        plan->overflow = 1;
        return 0;
    }
    plan->ops[plan->n_ops].start = start;
    plan->ops[plan->n_ops].n = n;
    plan->ops[plan->n_ops].taken = taken;
    plan->n_ops++;
    if (plan->n_ops > plan->max_ops) plan->max_ops = plan->n_ops;
    return 1;
}

/* The slot of size n's fit hint, or -1. A search for n starts at the hint: it scans past the
   small holes on its way only once. */
static int32_t kvmix__fit_slot(const kvmix__fit_hints *h, int64_t n) {
    int32_t k;
    for (k = 0; k < 8; k++)
        if (h->size[k] == n) return k;
    return -1;
}

/* Records where the next search for n may start (a successful search's result). */
static void kvmix__fit_found(kvmix__fit_hints *h, int64_t n, int64_t at) {
    int32_t k = kvmix__fit_slot(h, n);
    if (k < 0) {
        k = h->next;
        h->next = (k + 1) % 8;
        h->size[k] = n;
    }
    h->at[k] = at;
}

/* Granules [start, end) became free: a run of any size may now start at or above the free run
   that holds them, or end at or below its end. */
static void kvmix__fit_freed(kvmix_cache *c, int64_t start, int64_t end) {
    const uint64_t *bm = c->priv.bitmap;
    kvmix__arena_hints *h = &c->priv.hints;
    int32_t k;
    while (start > 0 && !kvmix__granule_used(bm, start - 1))
        start -= (start & 63) == 0 && bm[(start - 1) >> 6] == 0 ? 64 : 1;
    while (end < c->priv.n_granules && !kvmix__granule_used(bm, end))
        end += (end & 63) == 0 && bm[end >> 6] == 0 ? 64 : 1;
    if (end > c->priv.n_granules) end = c->priv.n_granules;
    for (k = 0; k < 8; k++) {
        if (h->low.at[k] > start) h->low.at[k] = start;
        if (h->high.at[k] < end) h->high.at[k] = end;
    }
    if (start < h->first_free) h->first_free = start;
    if (end > h->last_free_end) h->last_free_end = end;
}

/* Which end of the arena a page comes from. Pages that stay while a sequence grows (sealed pages,
   sinks) are taken first fit from the low end; pages it frees again (FP16 buffer pages, their
   copies on write, the key-sealed pages of a values-only window) last fit from the high end.
   So the two kinds never interleave: a freed buffer leaves a hole that the next buffer fills,
   and sealed pages pack together; what an arena must hold is then what its pages hold
   (kvmix_cache_arena_bytes_for), without gaps between sizes that fit nothing. */
enum { KVMIX__LASTING = 0, KVMIX__PASSING = 1 };

/* Takes n granules from the end that `passing` says; returns the first or -1 (nothing
   changed). */
static int64_t kvmix__arena_take(kvmix_cache *c, kvmix__plan *plan, int64_t n, int passing) {
    kvmix__arena_hints *h = &c->priv.hints;
    kvmix__fit_hints *fit = passing ? &h->high : &h->low;
    int32_t k = kvmix__fit_slot(fit, n);
    int64_t start = passing ? kvmix__arena_find_last(c, n, k < 0 ? c->priv.n_granules : fit->at[k])
                            : kvmix__arena_find(c, n, k < 0 ? 0 : fit->at[k]);
    if (start < 0 || !kvmix__journal(c, plan, start, n, 1)) return -1;
    kvmix__fit_found(fit, n, passing ? start + n : start);
    kvmix__granules_mark(c->priv.bitmap, start, n, 1);
    c->priv.n_free_granules -= n;
    if (start == h->first_free) h->first_free = start + n;
    if (start + n == h->last_free_end) h->last_free_end = start;
    return start;
}

static void kvmix__granules_free(kvmix_cache *c, int64_t start, int64_t n) {
    kvmix__granules_mark(c->priv.bitmap, start, n, 0);
    c->priv.n_free_granules += n;
    kvmix__fit_freed(c, start, start + n);
}

/* Frees n granules; a device arena holds them (as used) until the jobs are taken. */
static void kvmix__arena_give(kvmix_cache *c, kvmix__plan *plan, int64_t start, int64_t n) {
    if (n <= 0) return;
    if (c->desc.device_arena) {
        if (!plan || !plan->dry) {
            kvmix__run *runs = (kvmix__run *)c->priv.retired_runs;
            KVMIX_ASSERT(c->priv.n_retired_runs < c->desc.max_jobs);
            runs[c->priv.n_retired_runs].start = start;
            runs[c->priv.n_retired_runs++].n = n;
        }
        return;
    }
    if (!kvmix__journal(c, plan, start, n, 0)) return;
    kvmix__granules_free(c, start, n);
}

/* Undoes a plan's journaled arena operations, newest first, and restores the search hints,
   which the undone allocations would leave too far in. */
static void kvmix__plan_undo(kvmix_cache *c, kvmix__plan *plan, const kvmix__arena_hints *hints) {
    while (plan->n_ops > 0) {
        const kvmix__arena_op *op = &plan->ops[--plan->n_ops];
        kvmix__granules_mark(c->priv.bitmap, op->start, op->n, op->taken ? 0 : 1);
        c->priv.n_free_granules += op->taken ? op->n : -op->n;
    }
    c->priv.hints = *hints;
}

/* ---- page descriptors -------------------------------------------------------------------- */

static uint32_t kvmix__page_pop(kvmix_cache *c) {
    KVMIX_ASSERT(c->priv.n_free_pages > 0);
    return c->priv.free_pages[--c->priv.n_free_pages];
}

/* Drops one reference; the last one returns the page's granules and its descriptor. */
static void kvmix__page_release(kvmix_cache *c, uint32_t id) {
    kvmix_cache_page *p = &c->pages[id];
    KVMIX_ASSERT(id != 0 && p->refcount > 0);
    if (--p->refcount > 0) {
        /* the sequences left may now write rows the released one wrote in this segment: their
           writes wait for it, as after a read */
        if (c->desc.device_arena) c->priv.page_segment[2 * id + 1] = c->priv.segment;
        return;
    }
    if (c->desc.device_arena) { /* bytes and descriptor held until the jobs are taken */
        c->priv.retired_pages[c->priv.n_retired_pages++] = id;
        return;
    }
    kvmix__arena_give(c, NULL, (int64_t)(p->offset / c->desc.granule_bytes),
                      (int64_t)p->n_granules);
    memset(p, 0, sizeof *p);
    c->priv.free_pages[c->priv.n_free_pages++] = id;
}

static uint8_t *kvmix__page_block(const kvmix_cache *c, const kvmix_cache_page *p,
                                  const kvmix__geom *g, int32_t layer, int is_value, int32_t head) {
    return c->arena + p->offset + kvmix__block_offset(c, g, layer, is_value, head);
}

/* Jobs of one segment may run in any order. Before jobs that read page `read` and write page
   `write` (0: none), a new segment starts when they would read what the current one writes,
   write what it reads, or (rewrite) write what it writes; after them, mark_pages records the
   pages they touch. */
static void kvmix__fence(kvmix_cache *c, uint32_t read, uint32_t write, int rewrite) {
    const uint32_t *seg = c->priv.page_segment;
    if ((read != 0 && seg[2 * read] == c->priv.segment) ||
        (write != 0 &&
         (seg[2 * write + 1] == c->priv.segment || (rewrite && seg[2 * write] == c->priv.segment))))
        c->priv.segment++;
}

static void kvmix__mark_pages(kvmix_cache *c, uint32_t read, uint32_t write) {
    if (read != 0) c->priv.page_segment[2 * read + 1] = c->priv.segment;
    if (write != 0) c->priv.page_segment[2 * write] = c->priv.segment;
}

static void kvmix__queue(kvmix_cache *c, kvmix__job job) {
    kvmix__job *q = (kvmix__job *)c->priv.jobs;
    KVMIX_ASSERT(c->n_jobs < c->desc.max_jobs);
    job.segment = c->priv.segment;
    job.taken = 0;
    q[c->n_jobs++] = job;
}

static kvmix__job kvmix__copy_job(uint64_t src, uint64_t dst, size_t bytes) {
    kvmix__job j;
    memset(&j, 0, sizeof j);
    j.kind = KVMIX_CACHE_BATCH_COPY;
    j.source = KVMIX_CACHE_SOURCE_ARENA;
    j.job.src_offset = src;
    j.job.dst_offset = dst;
    j.job.n_rows = (int32_t)bytes;
    return j;
}

static kvmix__job kvmix__quantize_job(int source, int is_value, int32_t format, int32_t block_rows,
                                      uint64_t src, uint64_t dst, int32_t first_row,
                                      int32_t n_rows) {
    kvmix__job j;
    memset(&j, 0, sizeof j);
    j.kind = KVMIX_CACHE_BATCH_QUANTIZE;
    j.source = (uint8_t)source;
    j.is_value = (uint8_t)is_value;
    j.format = (uint8_t)format;
    j.block_rows = block_rows;
    j.job.src_offset = src;
    j.job.dst_offset = dst;
    j.job.first_row = first_row;
    j.job.n_rows = n_rows;
    return j;
}

static kvmix__job kvmix__dequantize_job(int is_value, int32_t format, int32_t block_rows,
                                        uint64_t src, uint64_t dst, int32_t first_row,
                                        int32_t n_rows) {
    kvmix__job j = kvmix__quantize_job(KVMIX_CACHE_SOURCE_ARENA, is_value, format, block_rows, src,
                                       dst, first_row, n_rows);
    j.kind = KVMIX_CACHE_BATCH_DEQUANTIZE;
    return j;
}

/* Quantizes src [rows][head_dim] into a block of `format` at dst (no checks: finite input). */
static void kvmix__cache_quantize(const kvmix_cache *c, int is_value, int32_t format, int32_t rows,
                                  const float *src, uint8_t *dst) {
    kvmix_layout l = kvmix__cache_layout(c, is_value, format, rows);
    kvmix__sections s = kvmix__layout_sections(&l);
    memset(dst, 0, s.total_bytes);
    if (l.format == KVMIX_FORMAT_FP16 || kvmix__is_per_token_int(l.format))
        kvmix__quantize_rows(&l, src, l.head_dim, dst);
    else
        kvmix__quantize_per_channel(&l, src, l.head_dim, dst);
}

/* Dequantizes rows [0, rows) of a page's block into dst [rows][head_dim]. */
static void kvmix__page_block_read(const kvmix_cache *c, const kvmix_cache_page *p,
                                   const kvmix__geom *g, int32_t layer, int is_value, int32_t head,
                                   float *dst) {
    kvmix_layout l =
        kvmix__cache_layout(c, is_value, is_value ? p->value_format : p->key_format, p->n_rows);
    kvmix__sections s = kvmix__layout_sections(&l);
    const uint8_t *block = kvmix__page_block(c, p, g, layer, is_value, head);
    int32_t t;
    for (t = 0; t < p->n_rows; t++)
        kvmix__decode_row(&l, &s, block, t, dst + (size_t)t * (size_t)c->desc.head_dim);
}

/* ---- desc, memory layout, init ------------------------------------------------------------- */

/* Where each table lives in the metadata memory. */
typedef struct kvmix__cache_regions {
    size_t seqs, entries, slots, written, pages, free_pages, bitmap, scratch, sim, journal, jobs,
        retired_runs, retired_pages, page_segment, total;
    int64_t n_granules;
    int32_t max_pages;
    int32_t journal_capacity;
} kvmix__cache_regions;

/* Appends count * elem bytes at 64-byte alignment; 0 on overflow. */
static int kvmix__region(size_t *cursor, size_t count, size_t elem, size_t *offset) {
    size_t at = (*cursor + KVMIX__CACHE_ALIGN - 1) / KVMIX__CACHE_ALIGN * KVMIX__CACHE_ALIGN;
    if (at < *cursor || (elem != 0 && count > ((size_t)-1 - at) / elem)) return 0;
    *offset = at;
    *cursor = at + count * elem;
    return 1;
}

static int kvmix__cache_regions_of(const kvmix_cache_desc *d, kvmix__cache_regions *r) {
    size_t cursor = 0, n_jobs, n_held;
    int64_t max_pages = (int64_t)d->max_seqs * d->max_pages_per_seq + 1;
    if (max_pages > 0x7fffffff || max_pages * d->page_tokens > (int64_t)0xffffffffu) return 0;
    r->max_pages = (int32_t)max_pages;
    r->n_granules = (int64_t)(d->arena_bytes / d->granule_bytes);
    r->journal_capacity = 4 * d->max_pages_per_seq + 16;
    if (!(kvmix__region(&cursor, (size_t)d->max_seqs, sizeof(kvmix_cache_seq), &r->seqs) &&
          kvmix__region(&cursor, (size_t)d->max_seqs * (size_t)d->max_pages_per_seq,
                        sizeof(kvmix_cache_entry), &r->entries) &&
          (size_t)d->max_seqs <= (size_t)-1 / (size_t)d->max_tokens_per_seq &&
          kvmix__region(&cursor, (size_t)d->max_seqs * (size_t)d->max_tokens_per_seq,
                        sizeof(uint32_t), &r->slots) &&
          kvmix__region(&cursor, (size_t)d->max_seqs * (size_t)d->n_layers, sizeof(int32_t),
                        &r->written) &&
          kvmix__region(&cursor, (size_t)r->max_pages, sizeof(kvmix_cache_page), &r->pages) &&
          kvmix__region(&cursor, (size_t)r->max_pages, sizeof(uint32_t), &r->free_pages) &&
          kvmix__region(&cursor, (size_t)((r->n_granules + 63) / 64), sizeof(uint64_t),
                        &r->bitmap) &&
          kvmix__region(&cursor, (size_t)d->page_tokens * (size_t)d->head_dim, sizeof(float),
                        &r->scratch) &&
          kvmix__region(&cursor, (size_t)d->max_pages_per_seq, sizeof(kvmix__sim_page), &r->sim) &&
          kvmix__region(&cursor, (size_t)r->journal_capacity, sizeof(kvmix__arena_op),
                        &r->journal)))
        return 0;
    /* a device arena's job queue and what it holds until the take */
    n_jobs = d->device_arena ? (size_t)d->max_jobs : 0;
    n_held = d->device_arena ? (size_t)r->max_pages : 0;
    if (!(kvmix__region(&cursor, n_jobs, sizeof(kvmix__job), &r->jobs) &&
          kvmix__region(&cursor, n_jobs, sizeof(kvmix__run), &r->retired_runs) &&
          kvmix__region(&cursor, n_held, sizeof(uint32_t), &r->retired_pages) &&
          kvmix__region(&cursor, n_held, 2 * sizeof(uint32_t), &r->page_segment)))
        return 0;
    r->total = cursor;
    return 1;
}

/* The counts and capacities, each within its documented range; zeros already defaulted. */
/* The most jobs one compaction run queues: a page of survivors that are all apart, two copies
   (or a gather) each per block, and one packing per block. */
static int64_t kvmix__compact_max_jobs(const kvmix_cache_desc *d) {
    return (2 * (int64_t)d->page_tokens + 1) * 2 * (int64_t)d->n_layers * (int64_t)d->n_kv_heads;
}

static kvmix__why kvmix__desc_counts_ok(const kvmix_cache_desc *d) {
    const kvmix_result bad = KVMIX_ERR_INVALID_ARGUMENT;
    if (!kvmix__int_in(d->page_tokens, 8, 1024, 8))
        return kvmix__why_not(bad, "page_tokens", "must be a multiple of 8 in 8 .. 1024");
    if (!kvmix__int_in(d->max_seqs, 1, 1 << 20, 1))
        return kvmix__why_not(bad, "max_seqs", "must be in 1 .. 2^20");
    if (!kvmix__int_in(d->max_tokens_per_seq, 1, 1 << 26, 1))
        return kvmix__why_not(bad, "max_tokens_per_seq", "must be in 1 .. 2^26");
    if (!kvmix__int_in(d->max_pages_per_seq, 1, 1 << 24, 1))
        return kvmix__why_not(bad, "max_pages_per_seq", "must be in 1 .. 2^24");
    if (!kvmix__int_in(d->n_sink, 0, d->page_tokens, 1))
        return kvmix__why_not(bad, "n_sink", "must be in 0 .. page_tokens");
    if (!kvmix__int_in(d->n_window, 0, d->max_tokens_per_seq, 1))
        return kvmix__why_not(bad, "n_window", "must be in 0 .. max_tokens_per_seq");
    if (!kvmix__int_in(d->window_values_only, 0, 1, 1))
        return kvmix__why_not(bad, "window_values_only", "must be 0 or 1");
    if (d->partial != KVMIX_CACHE_PARTIAL_KEEP_FP16 && d->partial != KVMIX_CACHE_PARTIAL_QUANTIZE)
        return kvmix__why_not(bad, "partial", "must be a kvmix_cache_partial");
    if (d->granule_bytes < 64 || d->granule_bytes > ((size_t)1 << 20) ||
        (d->granule_bytes & (d->granule_bytes - 1)) != 0)
        return kvmix__why_not(bad, "granule_bytes", "must be a power of two in 64 .. 2^20");
    if (d->arena_bytes != 0 && d->arena_bytes < d->granule_bytes)
        return kvmix__why_not(bad, "arena_bytes", "must be 0 or at least granule_bytes");
    return kvmix__why_ok();
}

/* Channel groups, boosted channels and the default formats against head_dim. */
static kvmix__why kvmix__desc_formats_ok(const kvmix_cache_desc *d) {
    kvmix_layout probe;
    memset(&probe, 0, sizeof probe);
    probe.format = KVMIX_FORMAT_INT4;
    probe.head_dim = d->head_dim;
    probe.group_size = d->group_size;
    if (kvmix_layout_resolve(&probe, NULL) != KVMIX_SUCCESS)
        return kvmix__why_not(KVMIX_ERR_BAD_SHAPE, "group_size",
                              "must be a multiple of 8 that divides head_dim");
    probe.group_size = d->value_group_size;
    if (kvmix_layout_resolve(&probe, NULL) != KVMIX_SUCCESS)
        return kvmix__why_not(KVMIX_ERR_BAD_SHAPE, "value_group_size",
                              "must be a multiple of 8 that divides head_dim");
    probe.format = KVMIX_FORMAT_BOOSTED;
    probe.group_size = 0;
    probe.n_boost = d->n_boost;
    if (kvmix_layout_resolve(&probe, NULL) != KVMIX_SUCCESS)
        return kvmix__why_not(KVMIX_ERR_BAD_SHAPE, "n_boost",
                              "must be a multiple of 4, at most head_dim and 252");
    if (!kvmix__format_known(d->default_precision.key_format) ||
        !kvmix__format_known(d->default_precision.value_format))
        return kvmix__why_not(KVMIX_ERR_UNKNOWN_FORMAT, "default_precision",
                              "holds a value that is not a kvmix_format");
    if (!kvmix__boost_ok(d, d->default_precision))
        return kvmix__why_not(KVMIX_ERR_BAD_SHAPE, "n_boost", KVMIX__NO_BOOST);
    return kvmix__why_ok();
}

static kvmix__why kvmix__arena_bytes_for(const kvmix_cache_desc *resolved, int32_t n_seqs,
                                         int32_t n_tokens_per_seq, size_t *out_bytes);

/* Checks a desc and writes it back with defaults resolved (unchanged on failure). */
static kvmix__why kvmix__desc_resolve(kvmix_cache_desc *desc) {
    kvmix_cache_desc d = *desc;
    kvmix__cache_regions regions;
    double fp16_page_bytes;
    kvmix__why w;
    if (!kvmix__int_in(d.n_layers, 1, KVMIX__CACHE_MAX_LAYERS, 1))
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_layers", "must be in 1 .. 4096");
    if (!kvmix__int_in(d.n_kv_heads, 1, KVMIX__CACHE_MAX_HEADS, 1))
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_kv_heads", "must be in 1 .. 4096");
    if (!kvmix__head_dim_ok(d.head_dim))
        return kvmix__why_not(KVMIX_ERR_BAD_SHAPE, "head_dim", KVMIX__HEAD_DIM_RULE);
    if (!kvmix__int_in(d.device_arena, 0, 1, 1))
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "device_arena", "must be 0 or 1");
    if (!kvmix__int_in(d.max_jobs, 0, 1 << 24, 1))
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "max_jobs", "must be in 0 .. 2^24");
    if (d.page_tokens == 0) d.page_tokens = 32;
    if (d.max_seqs == 0) d.max_seqs = 1;
    if (d.max_tokens_per_seq == 0) d.max_tokens_per_seq = 4096;
    if (d.max_pages_per_seq == 0 && d.page_tokens > 0 && d.max_tokens_per_seq > 0)
        d.max_pages_per_seq = (d.max_tokens_per_seq + d.page_tokens - 1) / d.page_tokens + 8;
    if (d.group_size == 0) d.group_size = KVMIX_GROUP_SIZE_DEFAULT;
    if (d.value_group_size == 0) d.value_group_size = d.group_size;
    if (d.partial == KVMIX_CACHE_PARTIAL_DEFAULT) d.partial = KVMIX_CACHE_PARTIAL_KEEP_FP16;
    if (d.default_precision.key_format == 0) d.default_precision.key_format = KVMIX_FORMAT_INT4;
    if (d.default_precision.value_format == 0) d.default_precision.value_format = KVMIX_FORMAT_INT4;
    if (d.granule_bytes == 0) d.granule_bytes = 256;
    if (d.max_jobs == 0 && d.device_arena && d.max_seqs > 0) {
        int64_t per_block = (int64_t)d.n_layers * d.n_kv_heads, jobs = 4 * per_block * d.max_seqs;
        if (jobs < kvmix__compact_max_jobs(&d)) jobs = kvmix__compact_max_jobs(&d);
        d.max_jobs = (int32_t)(jobs < (1 << 24) ? jobs : (1 << 24));
    }
    if ((w = kvmix__desc_counts_ok(&d)).result != KVMIX_SUCCESS) return w;
    if ((w = kvmix__desc_formats_ok(&d)).result != KVMIX_SUCCESS) return w;
    /* the largest page (an FP16 buffer) must be addressable in granules */
    fp16_page_bytes = 4.0 * d.n_layers * d.n_kv_heads * d.page_tokens * (double)d.head_dim;
    if (fp16_page_bytes / (double)d.granule_bytes > 2147483647.0)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "granule_bytes",
                              "too small: an FP16 page needs more than 2^31 granules");
    if (d.arena_bytes == 0 &&
        kvmix__arena_bytes_for(&d, d.max_seqs, d.max_tokens_per_seq, &d.arena_bytes).result !=
            KVMIX_SUCCESS)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "arena_bytes",
                              "0 sizes max_seqs sequences of max_tokens_per_seq positions: more "
                              "bytes than size_t counts");
    if (!kvmix__cache_regions_of(&d, &regions))
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "max_seqs",
                              "with max_tokens_per_seq and max_pages_per_seq, more metadata "
                              "than memory can address");
    *desc = d;
    return kvmix__why_ok();
}

/* Fills a caller's kvmix_error from a verdict and passes its result on. */
static kvmix_result kvmix__report(kvmix_error *out_error, kvmix__why w) {
    if (w.result == KVMIX_SUCCESS) return kvmix__succeed(out_error);
    return kvmix__fail(out_error, w.result, w.argument, w.reason);
}

KVMIXDEF kvmix_result kvmix_cache_desc_resolve(kvmix_cache_desc *desc, kvmix_error *out_error) {
    if (!desc) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "desc", "NULL");
    return kvmix__report(out_error, kvmix__desc_resolve(desc));
}

KVMIXDEF kvmix_result kvmix_cache_memory_bytes(const kvmix_cache_desc *desc, size_t *out_bytes,
                                               kvmix_error *out_error) {
    kvmix_cache_desc d;
    kvmix__cache_regions regions;
    kvmix__why w;
    if (!desc || !out_bytes)
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, !desc ? "desc" : "out_bytes", "NULL");
    d = *desc;
    if ((w = kvmix__desc_resolve(&d)).result != KVMIX_SUCCESS) return kvmix__report(out_error, w);
    kvmix__cache_regions_of(&d, &regions);
    *out_bytes = regions.total;
    return kvmix__succeed(out_error);
}

/* The most granules one sequence holds while it grows to n positions stored in
   desc.default_precision: after any call (*settled) and within one (*peak: a page boundary
   takes the next buffer page, then the seal holds the page it quantizes and the new sealed page
   at once). Rows come `lag` calls after their reserve (1: reserve, then write; 0: ingest or
   append), which moves the seals: a page is sealed once full, written and out of the window,
   and with a values-only window its keys once full and written. It follows the plan's events
   a page at a time: new page, seal, key seal, each every page_tokens positions. */
static void kvmix__seq_granules(const kvmix_cache *c, int32_t n, int32_t lag, int64_t *settled,
                                int64_t *peak) {
    const kvmix_cache_desc *d = &c->desc;
    uint8_t kf = d->default_precision.key_format, vf = d->default_precision.value_format;
    int64_t P = d->page_tokens, regular = (int64_t)n - d->n_sink; /* positions after the sinks */
    int64_t window = d->n_window > lag ? d->n_window : lag;       /* seal: full + this - 1 */
    int by_flag = kf == KVMIX_FORMAT_FP16 && vf == KVMIX_FORMAT_FP16;
    int keyed = d->window_values_only && kf != KVMIX_FORMAT_FP16 && d->n_window > lag;
    int64_t buffer = kvmix__granules_of(
        c,
        kvmix__page_geom(c, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, 0, d->page_tokens).total_bytes);
    int64_t sealed = kvmix__granules_of(
        c, kvmix__page_geom(c, kf, vf, d->page_tokens, d->page_tokens).total_bytes);
    int64_t key_sealed = kvmix__granules_of(
        c, kvmix__page_geom(c, kf, KVMIX_FORMAT_FP16, d->page_tokens, d->page_tokens).total_bytes);
    int64_t cur = 0, next_new = 0, next_seal = P + window - 1, next_key = P + lag - 1, r;
    *settled = *peak = 0;
    if (n > 0 && d->n_sink > 0) /* the sink page: FP16 for good, sealed by flag */
        cur = *settled = *peak = kvmix__granules_of(
            c, kvmix__page_geom(c, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, 0, d->n_sink).total_bytes);
    for (;;) {
        int64_t top;
        r = next_new < next_seal ? next_new : next_seal;
        if (keyed && next_key < r) r = next_key;
        if (r >= regular) break;
        if (r == next_new) {
            cur += buffer;
            next_new += P;
        }
        top = cur;
        if (r == next_seal) {
            if (!by_flag) {
                top = cur + sealed;
                cur += sealed - (keyed ? key_sealed : buffer);
            }
            next_seal += P;
        }
        if (keyed && r == next_key) {
            if (cur + key_sealed > top) top = cur + key_sealed;
            cur += key_sealed - buffer;
            next_key += P;
        }
        if (cur > *settled) *settled = cur;
        if (top > *peak) *peak = top;
    }
}

/* kvmix_cache_arena_bytes_for of a resolved desc. */
static kvmix__why kvmix__arena_bytes_for(const kvmix_cache_desc *resolved, int32_t n_seqs,
                                         int32_t n_tokens_per_seq, size_t *out_bytes) {
    kvmix_cache c;
    int64_t settled = 0, peak = 0, lag_settled, lag_peak;
    double granules;
    int32_t lag;
    if (n_seqs < 0 || n_seqs > resolved->max_seqs)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_seqs", "must be in 0 .. max_seqs");
    if (n_tokens_per_seq < 0 || n_tokens_per_seq > resolved->max_tokens_per_seq)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_tokens_per_seq",
                              "must be in 0 .. max_tokens_per_seq");
    memset(&c, 0, sizeof c);
    c.desc = *resolved;
    for (lag = 0; lag <= 1; lag++) {
        kvmix__seq_granules(&c, n_tokens_per_seq, lag, &lag_settled, &lag_peak);
        if (lag_settled > settled) settled = lag_settled;
        if (lag_peak > peak) peak = lag_peak;
    }
    /* every sequence at its most, one of them inside a page boundary */
    granules = n_seqs > 0 ? (double)(n_seqs - 1) * (double)settled + (double)peak : 0.0;
    if (granules < 1.0) granules = 1.0; /* a valid desc.arena_bytes */
    if (granules * (double)c.desc.granule_bytes >= (double)(size_t)-1)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_seqs",
                              "with n_tokens_per_seq, more bytes than size_t counts");
    *out_bytes = (size_t)granules * c.desc.granule_bytes;
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_arena_bytes_for(const kvmix_cache_desc *desc, int32_t n_seqs,
                                                  int32_t n_tokens_per_seq, size_t *out_bytes,
                                                  kvmix_error *out_error) {
    kvmix_cache_desc d;
    kvmix__why w;
    if (!desc || !out_bytes)
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, !desc ? "desc" : "out_bytes", "NULL");
    d = *desc;
    d.arena_bytes = (size_t)1 << 20; /* not read: any size that resolves */
    if ((w = kvmix__desc_resolve(&d)).result == KVMIX_SUCCESS)
        w = kvmix__arena_bytes_for(&d, n_seqs, n_tokens_per_seq, out_bytes);
    return kvmix__report(out_error, w);
}

/* kvmix_cache_init's work once the desc is resolved. */
static void kvmix__cache_setup(kvmix_cache *cache, const kvmix_cache_desc *d, uint8_t *m,
                               const kvmix__cache_regions *g, void *arena) {
    int32_t i;
    memset(m, 0, g->total);
    memset(cache, 0, sizeof *cache);
    cache->desc = *d;
    cache->arena = (uint8_t *)arena;
    cache->priv.memory = m;
    cache->priv.memory_bytes = g->total;
    cache->max_pages = g->max_pages;
    cache->priv.journal_capacity = g->journal_capacity;
    cache->priv.n_granules = g->n_granules;
    cache->priv.n_free_granules = g->n_granules;
    cache->priv.hints.last_free_end = g->n_granules;
    cache->seqs = (kvmix_cache_seq *)(void *)(m + g->seqs);
    cache->entries = (kvmix_cache_entry *)(void *)(m + g->entries);
    cache->slots = (uint32_t *)(void *)(m + g->slots);
    cache->written = (int32_t *)(void *)(m + g->written);
    cache->pages = (kvmix_cache_page *)(void *)(m + g->pages);
    cache->priv.free_pages = (uint32_t *)(void *)(m + g->free_pages);
    cache->priv.bitmap = (uint64_t *)(void *)(m + g->bitmap);
    cache->priv.scratch = (float *)(void *)(m + g->scratch);
    cache->priv.sim = (void *)(m + g->sim);
    cache->priv.journal = (void *)(m + g->journal);
    cache->priv.jobs = (void *)(m + g->jobs);
    cache->priv.retired_runs = (void *)(m + g->retired_runs);
    cache->priv.retired_pages = (uint32_t *)(void *)(m + g->retired_pages);
    cache->priv.page_segment = (uint32_t *)(void *)(m + g->page_segment);
    cache->priv.segment = 1;
    for (i = KVMIX_FORMAT_FP16; i <= KVMIX_FORMAT_BOOSTED; i++) {
        cache->priv.full_block_bytes[0][i] =
            kvmix__cache_block_bytes(cache, 0, i, d->page_tokens, d->page_tokens);
        cache->priv.full_block_bytes[1][i] =
            kvmix__cache_block_bytes(cache, 1, i, d->page_tokens, d->page_tokens);
    }
    /* the sentinel: pinned, no bytes */
    cache->pages[0].refcount = 1;
    cache->pages[0].sealed = 1;
    cache->pages[0].key_format = KVMIX_FORMAT_FP16;
    cache->pages[0].value_format = KVMIX_FORMAT_FP16;
    for (i = 0; i < g->max_pages - 1; i++)
        cache->priv.free_pages[i] = (uint32_t)(g->max_pages - 1 - i);
    cache->priv.n_free_pages = g->max_pages - 1;
}

/* A refused init: the cache records "<prefix><field>: <reason>" and *out_error gets the field. */
static kvmix_result kvmix__init_fail(kvmix_cache *cache, kvmix_error *out_error, const char *prefix,
                                     kvmix__why w) {
    kvmix__report(out_error, w);
    return kvmix__record_as(cache, prefix, w);
}

/* Records a refused desc as "desc.<field>: <reason>". */
static kvmix_result kvmix__init_fail_desc(kvmix_cache *cache, kvmix_error *out_error,
                                          kvmix__why w) {
    return kvmix__init_fail(cache, out_error, "desc.", w);
}

KVMIXDEF kvmix_result kvmix_cache_init(kvmix_cache *cache, kvmix_cache_desc *desc, void *memory,
                                       size_t memory_bytes, void *arena, kvmix_error *out_error) {
    kvmix_cache_desc d;
    kvmix__cache_regions g;
    kvmix__why w;
    if (!cache) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "cache", "NULL");
    if (!desc || !memory || !arena)
        return kvmix__init_fail(cache, out_error, "",
                                kvmix__why_not(KVMIX_ERR_NULL_POINTER,
                                               !desc     ? "desc"
                                               : !memory ? "memory"
                                                         : "arena",
                                               "NULL"));
    d = *desc;
    if ((w = kvmix__desc_resolve(&d)).result != KVMIX_SUCCESS)
        return kvmix__init_fail_desc(cache, out_error, w);
    if (((uintptr_t)memory & 7u) != 0)
        return kvmix__init_fail(
            cache, out_error, "",
            kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "memory", "not 8-byte aligned"));
    kvmix__cache_regions_of(&d, &g);
    if (memory_bytes < g.total)
        return kvmix__init_fail(cache, out_error, "",
                                kvmix__why_not(KVMIX_ERR_BUFFER_TOO_SMALL, "memory_bytes",
                                               "less than kvmix_cache_memory_bytes"));
    kvmix__cache_setup(cache, &d, (uint8_t *)memory, &g, arena);
    *desc = d;
    return kvmix__succeed(out_error);
}

/* Returns memory taken from the allocator (NULL functions: KVMIX_FREE). */
static void kvmix__allocator_free(const kvmix_allocator *a, void *ptr) {
    if (a->free_fn)
        a->free_fn(ptr, a->user);
    else
        KVMIX_FREE(ptr);
}

KVMIXDEF kvmix_result kvmix_cache_init_allocator(kvmix_cache *cache, kvmix_cache_desc *desc,
                                                 const kvmix_allocator *allocator,
                                                 kvmix_error *out_error) {
    kvmix_allocator a;
    kvmix_cache_desc d;
    kvmix__cache_regions g;
    void *memory, *arena;
    kvmix_result r;
    kvmix__why w;
    if (!cache) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "cache", "NULL");
    if (!desc)
        return kvmix__init_fail(cache, out_error, "",
                                kvmix__why_not(KVMIX_ERR_NULL_POINTER, "desc", "NULL"));
    d = *desc;
    if ((w = kvmix__desc_resolve(&d)).result != KVMIX_SUCCESS)
        return kvmix__init_fail_desc(cache, out_error, w);
    if (d.device_arena)
        return kvmix__init_fail_desc(
            cache, out_error,
            kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "device_arena",
                           "a device arena is the caller's: kvmix_cache_init takes it"));
    kvmix__cache_regions_of(&d, &g); /* resolved: it fits */
    memset(&a, 0, sizeof a);
    if (allocator && allocator->alloc_fn && allocator->free_fn) a = *allocator;
    memory = a.alloc_fn ? a.alloc_fn(g.total, a.user) : KVMIX_MALLOC(g.total);
    arena = a.alloc_fn ? a.alloc_fn(d.arena_bytes, a.user) : KVMIX_MALLOC(d.arena_bytes);
    if (!memory || !arena) {
        if (memory) kvmix__allocator_free(&a, memory);
        if (arena) kvmix__allocator_free(&a, arena);
        return kvmix__init_fail(cache, out_error, "",
                                kvmix__why_not(KVMIX_ERR_OUT_OF_MEMORY, "allocator",
                                               !memory ? "no metadata memory" : "no arena"));
    }
    r = kvmix_cache_init(cache, &d, memory, g.total, arena, out_error);
    if (r != KVMIX_SUCCESS) {
        kvmix__allocator_free(&a, arena);
        kvmix__allocator_free(&a, memory);
        return r;
    }
    cache->priv.allocator = a;
    cache->priv.owns_memory = 1;
    *desc = d;
    return KVMIX_SUCCESS;
}

KVMIXDEF void kvmix_cache_deinit(kvmix_cache *cache) {
    if (!cache) return;
    if (cache->priv.owns_memory) {
        kvmix__allocator_free(&cache->priv.allocator, cache->arena);
        kvmix__allocator_free(&cache->priv.allocator, cache->priv.memory);
    }
    memset(cache, 0, sizeof *cache);
}

/* ---- sequences ----------------------------------------------------------------------------- */

static kvmix__why kvmix__cache_ok(const kvmix_cache *c) {
    if (!c->seqs)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "cache",
                              "not initialized (kvmix_cache_init)");
    return kvmix__why_ok();
}

static kvmix__why kvmix__cache_seq_ok(const kvmix_cache *c, int32_t seq) {
    if (!c->seqs) return kvmix__cache_ok(c);
    if (seq < 0 || seq >= c->desc.max_seqs || !c->seqs[seq].in_use)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "seq",
                              "not a live sequence (kvmix_cache_seq_create)");
    return kvmix__why_ok();
}

static int32_t kvmix__free_seq_id(const kvmix_cache *c) {
    int32_t s;
    for (s = 0; s < c->desc.max_seqs; s++)
        if (!c->seqs[s].in_use) return s;
    return -1;
}

static kvmix__why kvmix__seq_create(kvmix_cache *cache, int32_t *out_seq) {
    kvmix__why w;
    int32_t s;
    if (!out_seq) return kvmix__why_not(KVMIX_ERR_NULL_POINTER, "out_seq", "NULL");
    if ((w = kvmix__cache_ok(cache)).result != KVMIX_SUCCESS) return w;
    if ((s = kvmix__free_seq_id(cache)) < 0)
        return kvmix__why_not(KVMIX_ERR_OUT_OF_MEMORY, "desc.max_seqs",
                              "that many sequences are live (kvmix_cache_seq_free one)");
    memset(&cache->seqs[s], 0, sizeof cache->seqs[s]);
    cache->seqs[s].in_use = 1;
    *out_seq = s;
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_seq_create(kvmix_cache *cache, int32_t *out_seq) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__seq_create(cache, out_seq));
}

/* Whether entry j still has a row the sequence uses. */
static int kvmix__entry_live(const kvmix_cache *c, int32_t seq, const kvmix_cache_entry *e) {
    return kvmix__entry_rows_live(c, kvmix__seq_slots(c, seq), e, c->pages[e->page].n_rows, NULL) >
           0;
}

/* Whether entry e (last: the last one) has no row in use and may go: any but the buffer page
   still being filled. */
static int kvmix__entry_dead(const kvmix_cache *c, int32_t seq, const kvmix_cache_entry *e,
                             int last) {
    const kvmix_cache_page *p = &c->pages[e->page];
    int filling = last && !p->sealed && e->n_rows < p->capacity;
    return !filling && !kvmix__entry_live(c, seq, e);
}

/* Releases the pages of entries with no row in use, except a buffer page still being filled;
   compacts the page table. */
static void kvmix__drop_dead_entries(kvmix_cache *c, int32_t seq) {
    kvmix_cache_seq *s = &c->seqs[seq];
    kvmix_cache_entry *e = kvmix__seq_entries(c, seq);
    int32_t i, kept = 0;
    for (i = 0; i < s->n_entries; i++) {
        if (kvmix__entry_dead(c, seq, &e[i], i == s->n_entries - 1)) {
            kvmix__page_release(c, e[i].page);
            continue;
        }
        e[kept++] = e[i];
    }
    for (i = kept; i < s->n_entries; i++) memset(&e[i], 0, sizeof e[i]);
    s->n_entries = kept;
    kvmix__view_touch(c, seq, 0);
}

static kvmix__why kvmix__seq_fork(kvmix_cache *cache, int32_t parent, int32_t n_prefix,
                                  int32_t *out_seq) {
    const kvmix_cache_seq *ps;
    const kvmix_cache_entry *pe;
    kvmix_cache_seq *cs;
    kvmix_cache_entry *ce;
    uint32_t *slots;
    kvmix__why w;
    int32_t child, i, pos;
    if (!out_seq) return kvmix__why_not(KVMIX_ERR_NULL_POINTER, "out_seq", "NULL");
    if ((w = kvmix__cache_seq_ok(cache, parent)).result != KVMIX_SUCCESS) {
        w.argument = "parent";
        return w;
    }
    ps = &cache->seqs[parent];
    if (n_prefix < 0 || n_prefix > ps->n_written)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_prefix",
                              "must be in 0 .. the parent's positions written on every layer");
    if ((child = kvmix__free_seq_id(cache)) < 0)
        return kvmix__why_not(KVMIX_ERR_OUT_OF_MEMORY, "desc.max_seqs",
                              "that many sequences are live (kvmix_cache_seq_free one)");
    cs = &cache->seqs[child];
    pe = kvmix__seq_entries(cache, parent);
    ce = kvmix__seq_entries(cache, child);
    memset(cs, 0, sizeof *cs);
    cs->in_use = 1;
    cs->n_tokens = n_prefix;
    cs->run = ps->run;
    kvmix__seq_set_written(cache, child, n_prefix); /* also cs->n_written */
    for (i = 0; i < ps->n_entries && pe[i].first_pos < n_prefix; i++) {
        ce[i] = pe[i];
        if (ce[i].n_positions > n_prefix - ce[i].first_pos)
            ce[i].n_positions = n_prefix - ce[i].first_pos; /* a compacted page's rows stay */
        else if (ce[i].n_positions == 0 && ce[i].n_rows > n_prefix - ce[i].first_pos)
            ce[i].n_rows = n_prefix - ce[i].first_pos;
        cache->pages[ce[i].page].refcount++;
        cs->n_entries++;
    }
    slots = kvmix__seq_slots(cache, child);
    memcpy(slots, kvmix__seq_slots(cache, parent), (size_t)n_prefix * sizeof(uint32_t));
    for (pos = 0; pos < n_prefix; pos++)
        if (slots[pos] != KVMIX_CACHE_DEAD_SLOT) cs->n_live++;
    kvmix__drop_dead_entries(cache, child);
    *out_seq = child;
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_seq_fork(kvmix_cache *cache, int32_t parent, int32_t n_prefix,
                                           int32_t *out_seq) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__seq_fork(cache, parent, n_prefix, out_seq));
}

/* Releases the pages of entries [from, n_entries) and shortens the page table to `from`. */
static void kvmix__entries_release(kvmix_cache *c, int32_t seq, int32_t from) {
    kvmix_cache_seq *s = &c->seqs[seq];
    kvmix_cache_entry *e = kvmix__seq_entries(c, seq);
    int32_t i;
    for (i = from; i < s->n_entries; i++) {
        kvmix__page_release(c, e[i].page);
        memset(&e[i], 0, sizeof e[i]);
    }
    s->n_entries = from;
}

static kvmix__why kvmix__seq_free(kvmix_cache *cache, int32_t seq) {
    kvmix__why w;
    if ((w = kvmix__cache_seq_ok(cache, seq)).result != KVMIX_SUCCESS) return w;
    kvmix__entries_release(cache, seq, 0);
    kvmix__seq_set_written(cache, seq, 0);
    memset(&cache->seqs[seq], 0, sizeof cache->seqs[seq]);
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_seq_free(kvmix_cache *cache, int32_t seq) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__seq_free(cache, seq));
}

static kvmix__why kvmix__evict(kvmix_cache *cache, int32_t seq, const int32_t *positions,
                               int32_t n_positions) {
    kvmix_cache_seq *s;
    uint32_t *slots;
    kvmix__why w;
    int32_t i;
    if ((w = kvmix__cache_seq_ok(cache, seq)).result != KVMIX_SUCCESS) return w;
    if (n_positions < 0)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_positions", "negative");
    if (n_positions == 0) return kvmix__why_ok();
    if (!positions) return kvmix__why_not(KVMIX_ERR_NULL_POINTER, "positions", "NULL");
    s = &cache->seqs[seq];
    for (i = 0; i < n_positions; i++)
        if (positions[i] < 0 || positions[i] >= s->n_written)
            return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "positions",
                                  "one is not in 0 .. the positions written on every layer");
    slots = kvmix__seq_slots(cache, seq);
    for (i = 0; i < n_positions; i++)
        if (slots[positions[i]] != KVMIX_CACHE_DEAD_SLOT) {
            slots[positions[i]] = KVMIX_CACHE_DEAD_SLOT;
            s->n_live--;
        }
    kvmix__drop_dead_entries(cache, seq);
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_evict(kvmix_cache *cache, int32_t seq, const int32_t *positions,
                                        int32_t n_positions) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__evict(cache, seq, positions, n_positions));
}

/* Entry e, which covers position n - 1 and later ones, keeps the positions below n. Only a page
   the sequence holds alone changes: an FP16 one forgets its rows past the cut and is (again) the
   buffer; a packed one keeps its rows, dead past the cut (kvmix_cache_seq_truncate says why). */
static void kvmix__entry_cut(kvmix_cache *c, kvmix_cache_entry *e, int32_t n) {
    kvmix_cache_page *p = &c->pages[e->page];
    if (e->n_positions > 0) { /* compacted: its rows stay, found through the slot map */
        e->n_positions = n - e->first_pos;
        return;
    }
    e->n_rows = n - e->first_pos;
    if (p->refcount > 1 || p->key_format != KVMIX_FORMAT_FP16 ||
        p->value_format != KVMIX_FORMAT_FP16)
        return;
    p->n_rows = e->n_rows;
    p->sealed = 0;
    /* device arena: queued writes of the cut rows run before the writes that reuse them */
    if (c->desc.device_arena) c->priv.page_segment[2 * e->page + 1] = c->priv.segment;
}

/* Positions [n, n_tokens) leave the slot map; returns how many of them were live. */
static int32_t kvmix__slots_cut(kvmix_cache *c, int32_t seq, int32_t n) {
    uint32_t *slots = kvmix__seq_slots(c, seq);
    int32_t pos, live = 0;
    for (pos = n; pos < c->seqs[seq].n_tokens; pos++) {
        live += slots[pos] != KVMIX_CACHE_DEAD_SLOT;
        slots[pos] = KVMIX_CACHE_DEAD_SLOT;
    }
    return live;
}

static kvmix__why kvmix__seq_truncate(kvmix_cache *cache, int32_t seq, int32_t n_tokens) {
    kvmix_cache_seq *s;
    kvmix_cache_entry *e;
    int32_t *written;
    int32_t keep, layer;
    kvmix__why w;
    if ((w = kvmix__cache_seq_ok(cache, seq)).result != KVMIX_SUCCESS) return w;
    s = &cache->seqs[seq];
    if (n_tokens < 0 || n_tokens > s->n_tokens)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_tokens",
                              "must be in 0 .. the sequence's positions");
    if (n_tokens == s->n_tokens) return kvmix__why_ok();
    e = kvmix__seq_entries(cache, seq);
    for (keep = 0; keep < s->n_entries && e[keep].first_pos < n_tokens; keep++) continue;
    kvmix__entries_release(cache, seq, keep);
    kvmix__view_touch(cache, seq, keep);
    if (keep > 0 && kvmix__entry_end(&e[keep - 1]) > n_tokens) {
        kvmix__entry_cut(cache, &e[keep - 1], n_tokens);
        kvmix__view_touch(cache, seq, keep - 1);
    }
    s->n_live -= kvmix__slots_cut(cache, seq, n_tokens);
    s->n_tokens = n_tokens;
    written = kvmix__seq_written(cache, seq);
    for (layer = 0; layer < cache->desc.n_layers; layer++)
        if (written[layer] > n_tokens) written[layer] = n_tokens;
    if (s->n_written > n_tokens) s->n_written = n_tokens;
    /* the cut page may hold no live row now: it goes as after an eviction */
    if (keep > 0 && kvmix__entry_dead(cache, seq, &e[keep - 1], 1))
        kvmix__entries_release(cache, seq, keep - 1);
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_seq_truncate(kvmix_cache *cache, int32_t seq, int32_t n_tokens) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__seq_truncate(cache, seq, n_tokens));
}

/* ---- writes: plan, then commit ------------------------------------------------------------- */

static void kvmix__plan_begin(kvmix_cache *c, int32_t seq, kvmix__plan *plan, int dry) {
    const kvmix_cache_seq *s = &c->seqs[seq];
    const kvmix_cache_entry *e = kvmix__seq_entries(c, seq);
    int32_t i = s->n_entries, j;
    memset(plan, 0, sizeof *plan);
    plan->dry = dry;
    plan->pages = (kvmix__sim_page *)c->priv.sim;
    plan->ops = (kvmix__arena_op *)c->priv.journal;
    plan->len = s->n_tokens;
    plan->written = s->n_written;
    plan->n_entries = s->n_entries;
    while (i > 0 && !c->pages[e[i - 1].page].sealed) i--;
    for (j = i; j < s->n_entries; j++) {
        const kvmix_cache_page *p = &c->pages[e[j].page];
        kvmix__sim_page *sp = &plan->pages[plan->n++];
        memset(sp, 0, sizeof *sp);
        sp->entry = j;
        sp->first_pos = e[j].first_pos;
        sp->rows = e[j].n_rows;
        sp->page_rows = p->n_rows;
        sp->capacity = p->capacity;
        sp->shared = p->refcount > 1;
        sp->sink = p->sink;
        sp->want_key = p->want_key;
        sp->want_value = p->want_value;
        sp->keys_sealed = p->key_format != KVMIX_FORMAT_FP16;
        sp->run = p->run;
        sp->closed = p->closed;
        sp->start = (int64_t)(p->offset / c->desc.granule_bytes);
        sp->n_granules = (int64_t)p->n_granules;
    }
    plan->tail_open = plan->n > 0 && plan->pages[plan->n - 1].entry == s->n_entries - 1;
}

/* The rows the sequence uses of buffer page sp move to a new buffer page of `capacity` rows:
   copy on write of a shared page (its capacity), or the close of a run (closing: its rows
   rounded up to a multiple of 8, the alignment of the blocks the decode kernel reads). */
static kvmix_result kvmix__plan_copy(kvmix_cache *c, int32_t seq, kvmix__plan *plan,
                                     kvmix__sim_page *sp, int32_t capacity, int closing) {
    kvmix__geom g = kvmix__page_geom(c, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, 0, capacity);
    kvmix__geom og = kvmix__page_geom(c, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, 0, sp->capacity);
    int64_t n = kvmix__granules_of(c, g.total_bytes), start;
    if (plan->dry && plan->new_pages + 1 > c->priv.n_free_pages)
        return kvmix__plan_fail(plan, "page descriptors", KVMIX__HELD_DESCRIPTORS);
    if ((start = kvmix__arena_take(c, plan, n, KVMIX__PASSING)) < 0)
        return kvmix__plan_fail(plan, "arena", KVMIX__NO_RUN "the copy of a buffer page");
    if (plan->dry && c->desc.device_arena)
        plan->n_jobs += 2 * c->desc.n_layers * c->desc.n_kv_heads;
    if (!plan->dry) {
        kvmix_cache_entry *e = &kvmix__seq_entries(c, seq)[sp->entry];
        uint32_t old = e->page, id = kvmix__page_pop(c), *slots = kvmix__seq_slots(c, seq);
        kvmix_cache_page *np = &c->pages[id];
        const kvmix_cache_page *op = &c->pages[old];
        size_t row_bytes = (size_t)sp->rows * (size_t)c->desc.head_dim * 2;
        int32_t layer, kv, h, r;
        *np = *op;
        np->offset = (uint64_t)start * c->desc.granule_bytes;
        np->n_granules = (uint32_t)n;
        np->refcount = 1;
        np->n_rows = sp->rows;
        np->capacity = capacity;
        np->closed = (uint8_t)closing;
        if (c->desc.device_arena) kvmix__fence(c, old, id, 0);
        for (layer = 0; layer < c->desc.n_layers; layer++)
            for (kv = 0; kv < 2; kv++)
                for (h = 0; h < c->desc.n_kv_heads; h++) {
                    size_t from = kvmix__block_offset(c, &og, layer, kv, h);
                    size_t to = kvmix__block_offset(c, &g, layer, kv, h);
                    if (c->desc.device_arena)
                        kvmix__queue(
                            c, kvmix__copy_job(op->offset + from, np->offset + to, row_bytes));
                    else
                        memcpy(c->arena + np->offset + to, c->arena + op->offset + from, row_bytes);
                }
        if (c->desc.device_arena) kvmix__mark_pages(c, old, id);
        for (r = 0; r < sp->rows; r++)
            if (slots[e->first_pos + r] == kvmix__slot(c, old, r))
                slots[e->first_pos + r] = kvmix__slot(c, id, r);
        e->page = id;
        kvmix__page_release(c, old);
    }
    /* a page the sequence alone held is freed (by its release above when real): the plan frees
       its granules too, so that it sees the arena the real run will */
    if (plan->dry && !sp->shared) kvmix__arena_give(c, plan, sp->start, sp->n_granules);
    plan->new_pages++;
    sp->start = start;
    sp->n_granules = n;
    sp->shared = 0;
    sp->page_rows = sp->rows;
    sp->capacity = capacity;
    sp->closed = (uint8_t)closing;
    return KVMIX_SUCCESS;
}

/* A new buffer page at the end of the page table (a sink page while positions < n_sink). */
static kvmix_result kvmix__plan_new_page(kvmix_cache *c, int32_t seq, kvmix__plan *plan) {
    int32_t capacity = c->desc.page_tokens, sink = 0;
    kvmix__geom g;
    kvmix__sim_page *sp;
    int64_t n, start;
    if (plan->len < c->desc.n_sink) {
        capacity = c->desc.n_sink - plan->len;
        sink = 1;
    }
    if (plan->n_entries >= c->desc.max_pages_per_seq)
        return kvmix__plan_fail(plan, "desc.max_pages_per_seq", "the page table is full");
    if (plan->dry && plan->new_pages + 1 > c->priv.n_free_pages)
        return kvmix__plan_fail(plan, "page descriptors", KVMIX__HELD_DESCRIPTORS);
    g = kvmix__page_geom(c, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, 0, capacity);
    n = kvmix__granules_of(c, g.total_bytes);
    if ((start = kvmix__arena_take(c, plan, n, sink ? KVMIX__LASTING : KVMIX__PASSING)) < 0)
        return kvmix__plan_fail(plan, "arena", KVMIX__NO_RUN "a new page");
    sp = &plan->pages[plan->n++];
    memset(sp, 0, sizeof *sp);
    sp->entry = plan->n_entries;
    sp->first_pos = plan->len;
    sp->capacity = capacity;
    sp->sink = (uint8_t)sink;
    sp->want_key = sp->want_value = sink ? (uint8_t)KVMIX_FORMAT_FP16 : 0;
    sp->start = start;
    sp->n_granules = n;
    if (!plan->dry) {
        uint32_t id = kvmix__page_pop(c);
        kvmix_cache_page *p = &c->pages[id];
        kvmix_cache_entry *e = &kvmix__seq_entries(c, seq)[plan->n_entries];
        memset(p, 0, sizeof *p);
        p->offset = (uint64_t)start * c->desc.granule_bytes;
        p->n_granules = (uint32_t)n;
        p->refcount = 1;
        p->capacity = capacity;
        p->key_format = p->value_format = KVMIX_FORMAT_FP16;
        p->want_key = p->want_value = sp->want_key;
        p->sink = (uint8_t)sink;
        memset(e, 0, sizeof *e);
        e->page = id;
        e->first_pos = plan->len;
        c->seqs[seq].n_entries++;
    }
    plan->n_entries++;
    plan->new_pages++;
    plan->tail_open = 1;
    return KVMIX_SUCCESS;
}

/* Reserves the next position in buffer page sp: its row, slot-map entry and the page's requested
   formats. Its rows are stored separately (kvmix__rows_store). */
static void kvmix__plan_reserve(kvmix_cache *c, int32_t seq, kvmix__plan *plan, kvmix__sim_page *sp,
                                kvmix_cache_precision want) {
    if (!sp->sink) {
        sp->want_key = kvmix__higher_format(sp->want_key, want.key_format);
        sp->want_value = kvmix__higher_format(sp->want_value, want.value_format);
        sp->run = c->seqs[seq].run;
    }
    if (!plan->dry) {
        kvmix_cache_entry *e = &kvmix__seq_entries(c, seq)[sp->entry];
        kvmix_cache_page *p = &c->pages[e->page];
        int32_t row = sp->rows;
        p->n_rows = row + 1;
        p->want_key = sp->want_key;
        p->want_value = sp->want_value;
        p->run = sp->run;
        e->n_rows = row + 1;
        kvmix__seq_slots(c, seq)[plan->len] = kvmix__slot(c, e->page, row);
        c->seqs[seq].n_tokens++;
        c->seqs[seq].n_live++;
    }
    sp->rows++;
    sp->page_rows = sp->rows;
    plan->len++;
}

/* Stores one position's FP16 rows of one layer into row `row` of buffer page p: keys, values
   [n_kv_heads][head_dim], FP16-representable. */
static void kvmix__rows_store(kvmix_cache *c, const kvmix_cache_page *p, int32_t layer, int32_t row,
                              const float *keys, const float *values) {
    kvmix__geom g = kvmix__geom_of(c, p);
    int32_t d = c->desc.head_dim, h, i;
    KVMIX_ASSERT(!p->sealed && p->key_format == KVMIX_FORMAT_FP16 && row < p->capacity);
    for (h = 0; h < c->desc.n_kv_heads; h++) {
        const float *k = keys + (size_t)h * d, *v = values + (size_t)h * d;
        uint8_t *kb = kvmix__page_block(c, p, &g, layer, 0, h) + (size_t)row * d * 2;
        uint8_t *vb = kvmix__page_block(c, p, &g, layer, 1, h) + (size_t)row * d * 2;
        for (i = 0; i < d; i++) {
            kvmix__store_u16(kb + 2 * i, kvmix_fp32_to_fp16(k[i]));
            kvmix__store_u16(vb + 2 * i, kvmix_fp32_to_fp16(v[i]));
        }
    }
}

/* Copies a page's block (keys or values of one head and layer) into its sealed form: as it is
   when already in the target format (the keys of a page sealed keys first), else from FP16. */
static void kvmix__seal_block(kvmix_cache *c, int is_value, uint8_t source_format,
                              const uint8_t *src, uint8_t format, int32_t rows, uint8_t *dst) {
    int32_t i, n = rows * c->desc.head_dim;
    if (source_format == format) {
        memcpy(dst, src, kvmix__cache_block_bytes(c, is_value, format, rows, rows));
        return;
    }
    KVMIX_ASSERT(source_format == KVMIX_FORMAT_FP16);
    for (i = 0; i < n; i++) c->priv.scratch[i] = kvmix__h2f(kvmix__load_u16(src + 2 * i));
    kvmix__cache_quantize(c, is_value, format, rows, c->priv.scratch, dst);
}

/* The job of kvmix__seal_block for a device arena: a byte copy or a quantization from FP16. */
static void kvmix__queue_seal(kvmix_cache *c, int is_value, uint8_t source_format, uint8_t format,
                              int32_t rows, uint64_t src, uint64_t dst) {
    kvmix__job j;
    if (source_format == format)
        j = kvmix__copy_job(src, dst, kvmix__cache_block_bytes(c, is_value, format, rows, rows));
    else
        j = kvmix__quantize_job(KVMIX_CACHE_SOURCE_ARENA, is_value, format, rows, src / 2, dst, 0,
                                rows);
    kvmix__queue(c, j);
}

/* A closed page's rows [live, capacity) repeat its last row, so that a seal over its capacity
   (whole blocks of 8) takes statistics of its rows alone. */
static void kvmix__pad_rows(kvmix_cache *c, uint32_t id, int32_t live) {
    const kvmix_cache_page *p = &c->pages[id];
    kvmix__geom g = kvmix__geom_of(c, p);
    size_t row = (size_t)c->desc.head_dim * 2;
    int32_t layer, kv, h, r;
    if (c->desc.device_arena) kvmix__fence(c, id, id, 1);
    for (layer = 0; layer < c->desc.n_layers; layer++)
        for (kv = 0; kv < 2; kv++)
            for (h = 0; h < c->desc.n_kv_heads; h++) {
                uint64_t last = p->offset + kvmix__block_offset(c, &g, layer, kv, h) +
                                (uint64_t)(live - 1) * row;
                for (r = live; r < p->capacity; r++) {
                    uint64_t to = last + (uint64_t)(r - live + 1) * row;
                    if (c->desc.device_arena)
                        kvmix__queue(c, kvmix__copy_job(last, to, row));
                    else
                        memcpy(c->arena + to, c->arena + last, row);
                }
            }
    if (c->desc.device_arena) kvmix__mark_pages(c, id, id);
}

/* Seals buffer page sp with `rows` rows into (key_format, value_format): by flag when both are
   FP16, otherwise quantized into a new allocation and the old bytes freed. With keys_only the
   values stay FP16 and the page unsealed: a values-only window still holds them. */
static kvmix_result kvmix__plan_seal(kvmix_cache *c, int32_t seq, kvmix__plan *plan,
                                     kvmix__sim_page *sp, uint8_t key_format, uint8_t value_format,
                                     int32_t rows, int keys_only) {
    kvmix__geom g;
    int64_t n, start;
    if (sp->sink || key_format == 0) key_format = KVMIX_FORMAT_FP16;
    if (sp->sink || value_format == 0 || keys_only) value_format = KVMIX_FORMAT_FP16;
    if (keys_only && key_format == KVMIX_FORMAT_FP16) return KVMIX_SUCCESS; /* nothing yet */
    if (sp->closed && sp->page_rows < rows) { /* its padding first, then its seal */
        if (plan->dry && c->desc.device_arena)
            plan->n_jobs += (rows - sp->page_rows) * 2 * c->desc.n_layers * c->desc.n_kv_heads;
        if (!plan->dry)
            kvmix__pad_rows(c, kvmix__seq_entries(c, seq)[sp->entry].page, sp->page_rows);
        sp->page_rows = rows;
    }
    if (key_format == KVMIX_FORMAT_FP16 && value_format == KVMIX_FORMAT_FP16) {
        if (!plan->dry) {
            kvmix_cache_page *p = &c->pages[kvmix__seq_entries(c, seq)[sp->entry].page];
            p->n_rows = rows;
            p->sealed = 1;
        }
        sp->sealed = 1;
        return KVMIX_SUCCESS;
    }
    g = kvmix__page_geom(c, key_format, value_format, rows, rows);
    n = kvmix__granules_of(c, g.total_bytes);
    if ((start = kvmix__arena_take(c, plan, n, keys_only ? KVMIX__PASSING : KVMIX__LASTING)) < 0)
        return kvmix__plan_fail(plan, "arena", KVMIX__NO_RUN "sealing a page");
    if (plan->dry && c->desc.device_arena)
        plan->n_jobs += 2 * c->desc.n_layers * c->desc.n_kv_heads;
    if (!plan->dry) {
        uint32_t id = kvmix__seq_entries(c, seq)[sp->entry].page;
        kvmix_cache_page *p = &c->pages[id];
        kvmix__geom og;
        int32_t layer, kv, h;
        p->n_rows = rows; /* a buffer's rows past the sequence's are stale when not shared */
        og = kvmix__geom_of(c, p);
        if (p->refcount > 1) c->priv.view_epoch++; /* the other sharers' spans change too */
        if (c->desc.device_arena) kvmix__fence(c, id, 0, 0); /* new bytes: no one reads them */
        for (layer = 0; layer < c->desc.n_layers; layer++)
            for (kv = 0; kv < 2; kv++)
                for (h = 0; h < c->desc.n_kv_heads; h++) {
                    uint64_t src = p->offset + kvmix__block_offset(c, &og, layer, kv, h);
                    uint64_t dst = (uint64_t)start * c->desc.granule_bytes +
                                   kvmix__block_offset(c, &g, layer, kv, h);
                    uint8_t from = kv ? p->value_format : p->key_format;
                    uint8_t to = kv ? value_format : key_format;
                    if (c->desc.device_arena)
                        kvmix__queue_seal(c, kv, from, to, rows, src, dst);
                    else
                        kvmix__seal_block(c, kv, from, c->arena + src, to, rows, c->arena + dst);
                }
        if (c->desc.device_arena) kvmix__mark_pages(c, id, id);
        p->offset = (uint64_t)start * c->desc.granule_bytes;
        p->n_granules = (uint32_t)n;
        p->key_format = key_format;
        p->value_format = value_format;
        p->capacity = rows;
        p->sealed = (uint8_t)!keys_only;
        plan->n_sealed++;
    }
    kvmix__arena_give(c, plan, sp->start, sp->n_granules);
    sp->start = start;
    sp->n_granules = n;
    sp->sealed = (uint8_t)!keys_only;
    sp->keys_sealed = key_format != KVMIX_FORMAT_FP16;
    return KVMIX_SUCCESS;
}

/* A page is full when the sequence holds all of its capacity. A closed page takes no more rows:
   it is full once its writer holds all of its rows (a child forked inside it holds fewer, and
   the rows past its fork point may not be written yet). A page whose keys are sealed is full
   whoever holds it: every row was written before that seal, and a child forked inside it (which
   holds fewer rows) can neither write it nor seal its keys again over fewer rows. */
static int kvmix__sim_full_and_written(const kvmix__plan *plan, const kvmix__sim_page *sp) {
    int full =
        sp->rows == sp->capacity || sp->keys_sealed || (sp->closed && sp->rows == sp->page_rows);
    return full && (int64_t)sp->first_pos + sp->rows <= plan->written;
}

/* A values-only window: the keys of full pages inside it are sealed now (values stay FP16). */
static kvmix_result kvmix__plan_seal_window_keys(kvmix_cache *c, int32_t seq, kvmix__plan *plan) {
    int32_t i;
    for (i = plan->next_seal; c->desc.window_values_only && i < plan->n; i++) {
        kvmix__sim_page *sp = &plan->pages[i];
        kvmix_result r;
        if (sp->sealed || sp->keys_sealed || sp->sink || !kvmix__sim_full_and_written(plan, sp))
            continue;
        r = kvmix__plan_seal(c, seq, plan, sp, sp->want_key, KVMIX_FORMAT_FP16, sp->capacity, 1);
        if (r != KVMIX_SUCCESS) return r;
    }
    return KVMIX_SUCCESS;
}

/* Seals, oldest first, full buffer pages that left the window, and the keys of those inside a
   values-only window; forced (at the end of a request), every full page the sequence does not
   share, whatever the window. */
static kvmix_result kvmix__plan_seal_ready(kvmix_cache *c, int32_t seq, kvmix__plan *plan,
                                           int force) {
    int32_t i;
    if (force) {
        for (i = plan->next_seal; i < plan->n; i++) {
            kvmix__sim_page *sp = &plan->pages[i];
            kvmix_result r;
            if (sp->sealed || sp->shared || !kvmix__sim_full_and_written(plan, sp)) continue;
            r = kvmix__plan_seal(c, seq, plan, sp, sp->want_key, sp->want_value, sp->capacity, 0);
            if (r != KVMIX_SUCCESS) return r;
        }
        return KVMIX_SUCCESS;
    }
    while (plan->next_seal < plan->n) {
        kvmix__sim_page *sp = &plan->pages[plan->next_seal];
        kvmix_result r;
        if (!sp->sealed) {
            if (!kvmix__sim_full_and_written(plan, sp)) break;
            if (!sp->sink &&
                (int64_t)sp->first_pos + sp->rows > (int64_t)plan->len - c->desc.n_window)
                break;
            r = kvmix__plan_seal(c, seq, plan, sp, sp->want_key, sp->want_value, sp->capacity, 0);
            if (r != KVMIX_SUCCESS) return r;
        }
        plan->next_seal++;
    }
    return kvmix__plan_seal_window_keys(c, seq, plan);
}

/* The whole call: n_tokens positions reserved, with their rows of every layer stored when keys
   is not NULL (then they count as written for the seals that follow), then (finish) sealing and
   the partial-page policy. keys, values: [n_layers][n_tokens][n_kv_heads][head_dim] or NULL. */
static kvmix_result kvmix__plan_run(kvmix_cache *c, int32_t seq, kvmix__plan *plan,
                                    int32_t n_tokens, const float *keys, const float *values,
                                    const kvmix_cache_precision *precisions, int finish) {
    size_t token_floats = (size_t)c->desc.n_kv_heads * (size_t)c->desc.head_dim;
    size_t layer_stride = token_floats * (size_t)n_tokens;
    kvmix_result r;
    int32_t t;
    for (t = 0; t < n_tokens; t++) {
        kvmix__sim_page *tail = plan->tail_open ? &plan->pages[plan->n - 1] : NULL;
        kvmix_cache_precision want =
            precisions ? kvmix__precision_or_default(c, precisions[t]) : c->desc.default_precision;
        int writable = tail && !tail->sealed && !tail->keys_sealed && !tail->closed &&
                       tail->rows < tail->capacity;
        if (writable && !tail->sink && tail->rows > 0 && c->seqs[seq].run != tail->run) {
            /* a new run: the page closes at its rows (FP16 bytes of just them, to 8) */
            if ((r = kvmix__plan_copy(c, seq, plan, tail, (tail->rows + 7) / 8 * 8, 1)) !=
                KVMIX_SUCCESS)
                return r;
            writable = 0;
        }
        if (writable && tail->shared) {
            if ((r = kvmix__plan_copy(c, seq, plan, tail, tail->capacity, 0)) != KVMIX_SUCCESS)
                return r;
        } else if (!writable) {
            if ((r = kvmix__plan_new_page(c, seq, plan)) != KVMIX_SUCCESS) return r;
            tail = &plan->pages[plan->n - 1];
        }
        kvmix__plan_reserve(c, seq, plan, tail, want);
        if (keys) {
            if (!plan->dry) {
                const kvmix_cache_entry *e = &kvmix__seq_entries(c, seq)[tail->entry];
                size_t at = token_floats * (size_t)t;
                int32_t layer;
                for (layer = 0; layer < c->desc.n_layers; layer++, at += layer_stride)
                    kvmix__rows_store(c, &c->pages[e->page], layer, e->n_rows - 1, keys + at,
                                      values + at);
            }
            plan->written = plan->len;
        }
        if ((r = kvmix__plan_seal_ready(c, seq, plan, 0)) != KVMIX_SUCCESS) return r;
    }
    if (n_tokens == 0 && !finish) return kvmix__plan_seal_ready(c, seq, plan, 0);
    if (finish) {
        kvmix__sim_page *tail;
        if ((r = kvmix__plan_seal_ready(c, seq, plan, 1)) != KVMIX_SUCCESS) return r;
        tail = plan->tail_open ? &plan->pages[plan->n - 1] : NULL;
        if (c->desc.partial == KVMIX_CACHE_PARTIAL_QUANTIZE && tail && !tail->sealed &&
            !tail->sink && !tail->shared && tail->rows > 0 && tail->rows < tail->capacity &&
            (int64_t)tail->first_pos + tail->rows <= plan->written) {
            r = kvmix__plan_seal(c, seq, plan, tail, kvmix__per_token_format(tail->want_key),
                                 kvmix__per_token_format(tail->want_value), tail->rows, 0);
            if (r != KVMIX_SUCCESS) return r;
        }
    }
    return plan->overflow ? KVMIX_ERR_OUT_OF_MEMORY : KVMIX_SUCCESS;
}

/* Plans the call (undoing its arena operations), then runs it for real. */
static kvmix__why kvmix__plan_and_run(kvmix_cache *c, int32_t seq, int32_t n_tokens,
                                      const float *keys, const float *values,
                                      const kvmix_cache_precision *precisions, int finish) {
    kvmix__plan plan;
    kvmix__arena_hints hints = c->priv.hints;
    kvmix_result r;
    /* the plan state and the scratch block are zero between calls, so that a failed call
       leaves every byte of the metadata memory as it was */
    kvmix__plan_begin(c, seq, &plan, 1);
    r = kvmix__plan_run(c, seq, &plan, n_tokens, keys, values, precisions, finish);
    if (plan.overflow)
        kvmix__plan_fail(&plan, "n_tokens", "more arena operations than a plan holds");
    kvmix__plan_undo(c, &plan, &hints);
    memset(plan.pages, 0, (size_t)plan.n * sizeof *plan.pages);
    memset(plan.ops, 0, (size_t)plan.max_ops * sizeof *plan.ops);
    /* a device arena's queue holds the jobs and, one per seal, the granules released */
    if (r == KVMIX_SUCCESS && plan.n_jobs > c->desc.max_jobs - c->n_jobs)
        r = kvmix__plan_fail(&plan, "desc.max_jobs", "the job queue is full (take the jobs)");
    if (r != KVMIX_SUCCESS) return plan.failure;
    kvmix__plan_begin(c, seq, &plan, 0);
    /* a plan changes the entries it loaded (the unsealed ones at the end) and adds new ones */
    kvmix__view_touch(c, seq, plan.n > 0 ? plan.pages[0].entry : plan.n_entries);
    r = kvmix__plan_run(c, seq, &plan, n_tokens, keys, values, precisions, finish);
    KVMIX_ASSERT(r == KVMIX_SUCCESS);
    memset(plan.pages, 0, (size_t)plan.n * sizeof *plan.pages);
    if (plan.n_sealed > 0)
        memset(c->priv.scratch, 0,
               (size_t)c->desc.page_tokens * (size_t)c->desc.head_dim * sizeof(float));
    if (keys) kvmix__seq_set_written(c, seq, c->seqs[seq].n_tokens);
    return kvmix__why_ok();
}

static int kvmix__rows_representable(const float *x, size_t n) {
    size_t i;
    for (i = 0; i < n; i++)
        if (!kvmix__representable(x[i])) return 0;
    return 1;
}

/* The checks shared by reserve and ingest: the sequence, the count, the formats. */
static kvmix__why kvmix__extend_ok(const kvmix_cache *c, int32_t seq, int32_t n_tokens,
                                   const kvmix_cache_precision *precisions) {
    kvmix__why w;
    int32_t t;
    if ((w = kvmix__cache_seq_ok(c, seq)).result != KVMIX_SUCCESS) return w;
    if (n_tokens < 0) return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_tokens", "negative");
    if (n_tokens > c->desc.max_tokens_per_seq - c->seqs[seq].n_tokens)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_tokens",
                              "the sequence would pass desc.max_tokens_per_seq");
    for (t = 0; precisions && t < n_tokens; t++) {
        if (!kvmix__precision_known(precisions[t]))
            return kvmix__why_not(KVMIX_ERR_UNKNOWN_FORMAT, "precisions",
                                  "a value that is not a kvmix_format");
        if (!kvmix__boost_ok(&c->desc, kvmix__precision_or_default(c, precisions[t])))
            return kvmix__why_not(KVMIX_ERR_BAD_SHAPE, "precisions", KVMIX__NO_BOOST);
    }
    return kvmix__why_ok();
}

static kvmix__why kvmix__reserve(kvmix_cache *cache, int32_t seq, int32_t n_tokens,
                                 const kvmix_cache_precision *precisions,
                                 int32_t *out_first_position) {
    kvmix__why w;
    int32_t first;
    if ((w = kvmix__extend_ok(cache, seq, n_tokens, precisions)).result != KVMIX_SUCCESS) return w;
    first = cache->seqs[seq].n_tokens;
    if (n_tokens > 0 &&
        (w = kvmix__plan_and_run(cache, seq, n_tokens, NULL, NULL, precisions, 0)).result !=
            KVMIX_SUCCESS)
        return w;
    if (out_first_position) *out_first_position = first;
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_reserve(kvmix_cache *cache, int32_t seq, int32_t n_tokens,
                                          const kvmix_cache_precision *precisions,
                                          int32_t *out_first_position) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache,
                         kvmix__reserve(cache, seq, n_tokens, precisions, out_first_position));
}

/* The checks of a write of layer rows: the place (kvmix_cache_write's rules) and, for positions
   written before, that no one else sees them. */
static kvmix__why kvmix__write_ok(const kvmix_cache *c, int32_t seq, int32_t layer,
                                  int32_t first_position, int32_t n_tokens) {
    const kvmix_result bad = KVMIX_ERR_INVALID_ARGUMENT;
    const uint32_t *slots;
    const int32_t *written;
    uint32_t page_tokens = (uint32_t)c->desc.page_tokens;
    int32_t t, end;
    kvmix__why w;
    if ((w = kvmix__cache_seq_ok(c, seq)).result != KVMIX_SUCCESS) return w;
    written = kvmix__seq_written(c, seq);
    if (layer < 0 || layer >= c->desc.n_layers)
        return kvmix__why_not(bad, "layer", "must be in 0 .. desc.n_layers - 1");
    if (n_tokens < 0) return kvmix__why_not(bad, "n_tokens", "negative");
    if (first_position < 0) return kvmix__why_not(bad, "first_position", "negative");
    if (n_tokens > c->seqs[seq].n_tokens - first_position)
        return kvmix__why_not(bad, "first_position",
                              "its positions are not reserved yet (kvmix_cache_reserve first)");
    if (first_position > written[layer])
        return kvmix__why_not(bad, "first_position",
                              "past the layer's written rows: rows go in order, without gaps");
    slots = kvmix__seq_slots(c, seq);
    /* a row written before is rewritten only where no one else sees it; rows not written yet are
       in unsealed pages, live, and used by this sequence only (seals wait for n_written, eviction
       and fork take positions below it) */
    end = first_position + n_tokens < written[layer] ? first_position + n_tokens : written[layer];
    for (t = first_position; t < end; t++) {
        const kvmix_cache_page *p = &c->pages[slots[t] / page_tokens];
        if (slots[t] == KVMIX_CACHE_DEAD_SLOT || p->sealed || p->key_format != KVMIX_FORMAT_FP16 ||
            p->refcount > 1)
            return kvmix__why_not(bad, "first_position",
                                  "rewrites a row that is sealed, shared or evicted");
    }
    return kvmix__why_ok();
}

/* Positions up to `end` of the layer have rows: the layer's count and n_written follow. */
static void kvmix__note_written(kvmix_cache *c, int32_t seq, int32_t layer, int32_t end) {
    kvmix_cache_seq *s = &c->seqs[seq];
    const kvmix_cache_entry *e = kvmix__seq_entries(c, seq);
    int32_t *written = kvmix__seq_written(c, seq), l, least, j;
    int was_least;
    if (end <= written[layer]) return;
    for (j = s->n_entries - 1; j > 0 && e[j].first_pos > written[layer]; j--) continue;
    kvmix__view_touch(c, seq, j < 0 ? 0 : j); /* the entry that held the layer's end grows */
    was_least = written[layer] == s->n_written;
    written[layer] = end;
    if (!was_least) return;
    least = written[0];
    for (l = 1; l < c->desc.n_layers; l++)
        if (written[l] < least) least = written[l];
    s->n_written = least;
}

/* Which of two row arrays holds a value that is not FP16-representable, or NULL. */
static const char *kvmix__rows_unrepresentable(const float *keys, const float *values, size_t n) {
    if (!kvmix__rows_representable(keys, n)) return "keys";
    if (!kvmix__rows_representable(values, n)) return "values";
    return NULL;
}

#define KVMIX__NOT_FP16 "a value is NaN, infinite or beyond the FP16 range"

static kvmix__why kvmix__write(kvmix_cache *cache, int32_t seq, int32_t layer,
                               int32_t first_position, int32_t n_tokens, const float *keys,
                               const float *values) {
    const uint32_t *slots;
    const char *bad_rows;
    uint32_t page_tokens;
    int32_t t;
    size_t hd;
    kvmix__why w;
    if (cache->desc.device_arena)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "cache",
                              "its arena is device memory (kvmix_cache_write_rows)");
    if ((w = kvmix__write_ok(cache, seq, layer, first_position, n_tokens)).result != KVMIX_SUCCESS)
        return w;
    if (n_tokens == 0) return kvmix__why_ok();
    if (!keys || !values)
        return kvmix__why_not(KVMIX_ERR_NULL_POINTER, !keys ? "keys" : "values", "NULL");
    hd = (size_t)cache->desc.n_kv_heads * (size_t)cache->desc.head_dim;
    if ((bad_rows = kvmix__rows_unrepresentable(keys, values, (size_t)n_tokens * hd)) != NULL)
        return kvmix__why_not(KVMIX_ERR_BAD_VALUE, bad_rows, KVMIX__NOT_FP16);
    slots = kvmix__seq_slots(cache, seq);
    page_tokens = (uint32_t)cache->desc.page_tokens;
    for (t = 0; t < n_tokens; t++) {
        uint32_t slot = slots[first_position + t];
        KVMIX_ASSERT(slot != KVMIX_CACHE_DEAD_SLOT);
        kvmix__rows_store(cache, &cache->pages[slot / page_tokens], layer,
                          (int32_t)(slot % page_tokens), keys + hd * (size_t)t,
                          values + hd * (size_t)t);
    }
    kvmix__note_written(cache, seq, layer, first_position + n_tokens);
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_write(kvmix_cache *cache, int32_t seq, int32_t layer,
                                        int32_t first_position, int32_t n_tokens, const float *keys,
                                        const float *values) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache,
                         kvmix__write(cache, seq, layer, first_position, n_tokens, keys, values));
}

/* Positions first .. of a sequence whose rows are consecutive rows of one page: their count. */
static int32_t kvmix__page_run(const kvmix_cache *c, int32_t seq, int32_t first, int32_t n) {
    const uint32_t *slots = kvmix__seq_slots(c, seq);
    int32_t k = 1;
    while (k < n && slots[first + k] == slots[first] + (uint32_t)k &&
           slots[first + k] / (uint32_t)c->desc.page_tokens ==
               slots[first] / (uint32_t)c->desc.page_tokens)
        k++;
    return k;
}

static kvmix__why kvmix__write_rows(kvmix_cache *cache, int32_t seq, int32_t layer,
                                    int32_t first_position, int32_t n_tokens, int64_t source_row) {
    const uint32_t *slots;
    const int32_t *written;
    uint32_t page_tokens;
    int32_t t, k, runs = 0, n_heads, d;
    kvmix__why w;
    if (!cache->desc.device_arena)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "cache",
                              "its arena is host memory (kvmix_cache_write)");
    if (source_row < 0) return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "source_row", "negative");
    if ((w = kvmix__write_ok(cache, seq, layer, first_position, n_tokens)).result != KVMIX_SUCCESS)
        return w;
    n_heads = cache->desc.n_kv_heads;
    d = cache->desc.head_dim;
    for (t = 0; t < n_tokens; t += kvmix__page_run(cache, seq, first_position + t, n_tokens - t))
        runs++;
    if ((int64_t)runs * 2 * n_heads > (int64_t)cache->desc.max_jobs - cache->n_jobs)
        return kvmix__why_not(KVMIX_ERR_OUT_OF_MEMORY, "desc.max_jobs",
                              "the job queue is full (take the jobs)");
    slots = kvmix__seq_slots(cache, seq);
    written = kvmix__seq_written(cache, seq);
    page_tokens = (uint32_t)cache->desc.page_tokens;
    for (t = 0; t < n_tokens; t += k) {
        int32_t pos = first_position + t, kv, h;
        uint32_t id = slots[pos] / page_tokens;
        const kvmix_cache_page *p = &cache->pages[id];
        kvmix__geom g = kvmix__geom_of(cache, p);
        k = kvmix__page_run(cache, seq, pos, n_tokens - t);
        kvmix__fence(cache, 0, id, pos < written[layer]); /* a rewrite runs after the write */
        for (kv = 0; kv < 2; kv++)
            for (h = 0; h < n_heads; h++) {
                uint64_t src = (uint64_t)(source_row + t) * (uint64_t)n_heads * (uint64_t)d +
                               (uint64_t)h * (uint64_t)d;
                kvmix__job j = kvmix__quantize_job(
                    kv ? KVMIX_CACHE_SOURCE_VALUES : KVMIX_CACHE_SOURCE_KEYS, kv, KVMIX_FORMAT_FP16,
                    p->capacity, src, p->offset + kvmix__block_offset(cache, &g, layer, kv, h),
                    (int32_t)(slots[pos] % page_tokens), k);
                kvmix__queue(cache, j);
            }
        kvmix__mark_pages(cache, 0, id);
    }
    kvmix__note_written(cache, seq, layer, first_position + n_tokens);
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_write_rows(kvmix_cache *cache, int32_t seq, int32_t layer,
                                             int32_t first_position, int32_t n_tokens,
                                             int64_t source_row) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(
        cache, kvmix__write_rows(cache, seq, layer, first_position, n_tokens, source_row));
}

/* The batch a job belongs to within its segment. */
static int kvmix__same_batch(const kvmix__job *a, const kvmix__job *b) {
    if (a->kind != b->kind) return 0;
    if (a->kind == KVMIX_CACHE_BATCH_COPY) return 1;
    return a->source == b->source && a->is_value == b->is_value && a->format == b->format &&
           a->block_rows == b->block_rows;
}

/* Groups the queue, segment by segment, into batches of jobs that one launch runs; writes them
   when jobs is not NULL. Returns the number of batches. */
static int32_t kvmix__group_jobs(kvmix_cache *c, kvmix_quantize_job *jobs,
                                 kvmix_cache_batch *batches) {
    kvmix__job *q = (kvmix__job *)c->priv.jobs;
    int32_t i, k, m, seg_end, n_batches = 0, n_out = 0;
    for (i = 0; i < c->n_jobs; i = seg_end) {
        for (seg_end = i; seg_end < c->n_jobs && q[seg_end].segment == q[i].segment; seg_end++) {
        }
        for (k = i; k < seg_end; k++) {
            if (q[k].taken) continue;
            if (batches) {
                kvmix_cache_batch *b = &batches[n_batches];
                memset(b, 0, sizeof *b);
                b->kind = q[k].kind;
                b->source = q[k].source;
                b->first_job = n_out;
                if (q[k].kind != KVMIX_CACHE_BATCH_COPY) {
                    b->layout = kvmix__cache_layout(c, q[k].is_value, q[k].format, q[k].block_rows);
                    kvmix_layout_resolve(&b->layout, NULL);
                    b->src_row_stride = q[k].source == KVMIX_CACHE_SOURCE_ARENA
                                            ? c->desc.head_dim
                                            : (int64_t)c->desc.n_kv_heads * c->desc.head_dim;
                }
            }
            for (m = k; m < seg_end; m++) {
                if (q[m].taken || !kvmix__same_batch(&q[k], &q[m])) continue;
                q[m].taken = 1;
                if (jobs) jobs[n_out] = q[m].job;
                n_out++;
            }
            if (batches) batches[n_batches].n_jobs = n_out - batches[n_batches].first_job;
            n_batches++;
        }
    }
    return n_batches;
}

/* The take: what the queue held is released. */
static void kvmix__release_held(kvmix_cache *c) {
    const kvmix__run *runs = (const kvmix__run *)c->priv.retired_runs;
    int32_t i;
    for (i = 0; i < c->priv.n_retired_runs; i++) kvmix__granules_free(c, runs[i].start, runs[i].n);
    for (i = 0; i < c->priv.n_retired_pages; i++) {
        uint32_t id = c->priv.retired_pages[i];
        kvmix_cache_page *p = &c->pages[id];
        kvmix__granules_free(c, (int64_t)(p->offset / c->desc.granule_bytes),
                             (int64_t)p->n_granules);
        memset(p, 0, sizeof *p);
        c->priv.free_pages[c->priv.n_free_pages++] = id;
    }
    memset(c->priv.retired_runs, 0, (size_t)c->priv.n_retired_runs * sizeof(kvmix__run));
    c->priv.n_retired_runs = 0;
    c->priv.n_retired_pages = 0;
}

static kvmix__why kvmix__jobs_take(kvmix_cache *cache, kvmix_quantize_job *jobs, int32_t max_jobs,
                                   kvmix_cache_batch *batches, int32_t max_batches,
                                   int32_t *out_n_jobs, int32_t *out_n_batches) {
    kvmix__job *q;
    int32_t i, n_batches;
    kvmix__why w;
    if (!out_n_jobs || !out_n_batches)
        return kvmix__why_not(KVMIX_ERR_NULL_POINTER, !out_n_jobs ? "out_n_jobs" : "out_n_batches",
                              "NULL");
    if ((w = kvmix__cache_ok(cache)).result != KVMIX_SUCCESS) return w;
    if (!cache->desc.device_arena)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "cache",
                              "its arena is host memory: it queues no jobs");
    if (cache->n_jobs > 0 && (!jobs || !batches))
        return kvmix__why_not(KVMIX_ERR_NULL_POINTER, !jobs ? "jobs" : "batches", "NULL");
    q = (kvmix__job *)cache->priv.jobs;
    n_batches = kvmix__group_jobs(cache, NULL, NULL);
    for (i = 0; i < cache->n_jobs; i++) q[i].taken = 0;
    if (max_jobs < cache->n_jobs)
        return kvmix__why_not(KVMIX_ERR_BUFFER_TOO_SMALL, "max_jobs", "less than cache->n_jobs");
    if (max_batches < n_batches)
        return kvmix__why_not(KVMIX_ERR_BUFFER_TOO_SMALL, "max_batches",
                              "less than the batches of the queue (at most cache->n_jobs)");
    kvmix__group_jobs(cache, jobs, batches);
    memset(q, 0, (size_t)cache->n_jobs * sizeof *q);
    *out_n_jobs = cache->n_jobs;
    *out_n_batches = n_batches;
    cache->n_jobs = 0;
    kvmix__release_held(cache);
    /* every page's segment stamp is now older than the current segment */
    if (++cache->priv.segment == 0) {
        memset(cache->priv.page_segment, 0, 2 * (size_t)cache->max_pages * sizeof(uint32_t));
        cache->priv.segment = 1;
    }
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_jobs_take(kvmix_cache *cache, kvmix_quantize_job *jobs,
                                            int32_t max_jobs, kvmix_cache_batch *batches,
                                            int32_t max_batches, int32_t *out_n_jobs,
                                            int32_t *out_n_batches) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__jobs_take(cache, jobs, max_jobs, batches, max_batches,
                                                 out_n_jobs, out_n_batches));
}

static kvmix__why kvmix__ingest(kvmix_cache *cache, int32_t seq, int32_t n_tokens,
                                const float *keys, const float *values,
                                const kvmix_cache_precision *precisions) {
    const char *bad_rows;
    kvmix__why w;
    size_t n;
    if (cache->desc.device_arena)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "cache",
                              "its arena is device memory: rows pass the host here");
    if ((w = kvmix__extend_ok(cache, seq, n_tokens, precisions)).result != KVMIX_SUCCESS) return w;
    if (n_tokens == 0) return kvmix__why_ok();
    if (!keys || !values)
        return kvmix__why_not(KVMIX_ERR_NULL_POINTER, !keys ? "keys" : "values", "NULL");
    if (cache->seqs[seq].n_written != cache->seqs[seq].n_tokens)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "seq",
                              "has reserved positions not written on every layer yet");
    n = (size_t)cache->desc.n_layers * (size_t)n_tokens * (size_t)cache->desc.n_kv_heads *
        (size_t)cache->desc.head_dim;
    if ((bad_rows = kvmix__rows_unrepresentable(keys, values, n)) != NULL)
        return kvmix__why_not(KVMIX_ERR_BAD_VALUE, bad_rows, KVMIX__NOT_FP16);
    return kvmix__plan_and_run(cache, seq, n_tokens, keys, values, precisions, 0);
}

KVMIXDEF kvmix_result kvmix_cache_ingest(kvmix_cache *cache, int32_t seq, int32_t n_tokens,
                                         const float *keys, const float *values,
                                         const kvmix_cache_precision *precisions) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__ingest(cache, seq, n_tokens, keys, values, precisions));
}

KVMIXDEF kvmix_result kvmix_cache_append(kvmix_cache *cache, int32_t seq, const float *keys,
                                         const float *values, kvmix_cache_precision precision) {
    return kvmix_cache_ingest(cache, seq, 1, keys, values, &precision);
}

/* Seals what is ready (finish 0) or ends a request (finish 1). */
static kvmix__why kvmix__seal(kvmix_cache *cache, int32_t seq, int finish) {
    kvmix__why w;
    if ((w = kvmix__cache_seq_ok(cache, seq)).result != KVMIX_SUCCESS) return w;
    return kvmix__plan_and_run(cache, seq, 0, NULL, NULL, NULL, finish);
}

KVMIXDEF kvmix_result kvmix_cache_seal_ready(kvmix_cache *cache, int32_t seq) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__seal(cache, seq, 0));
}

KVMIXDEF kvmix_result kvmix_cache_seq_finish(kvmix_cache *cache, int32_t seq) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__seal(cache, seq, 1));
}

KVMIXDEF kvmix_result kvmix_cache_seq_set_run(kvmix_cache *cache, int32_t seq, uint32_t run) {
    kvmix__why w;
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    if ((w = kvmix__cache_seq_ok(cache, seq)).result == KVMIX_SUCCESS) cache->seqs[seq].run = run;
    return kvmix__record(cache, w);
}

/* ---- re-tiering ----------------------------------------------------------------------------- */

/* The new contents of one block into c->priv.scratch [n_rows][head_dim]: the dequantized rows, the
   given originals, or dequantized + residual. rows_in: [n_layers][n_rows][n_kv_heads][head_dim]. */
static void kvmix__retier_source(const kvmix_cache *c, const kvmix_cache_page *p,
                                 const kvmix__geom *g, int32_t layer, int is_value, int32_t head,
                                 const float *rows_in, kvmix_cache_rows mode) {
    int32_t n = p->n_rows, d = c->desc.head_dim, t, i;
    size_t heads = (size_t)c->desc.n_kv_heads;
    if (!rows_in || mode == KVMIX_CACHE_ROWS_RESIDUAL)
        kvmix__page_block_read(c, p, g, layer, is_value, head, c->priv.scratch);
    if (!rows_in) { /* a demotion: from the rows rounded to FP16, as a device arena gathers them */
        for (t = 0; t < n * d; t++) c->priv.scratch[t] = kvmix__h2f(kvmix__f2h(c->priv.scratch[t]));
        return;
    }
    for (t = 0; t < n; t++) {
        const float *x = rows_in + (((size_t)layer * n + t) * heads + (size_t)head) * d;
        float *y = c->priv.scratch + (size_t)t * d;
        for (i = 0; i < d; i++) y[i] = mode == KVMIX_CACHE_ROWS_ORIGINAL ? x[i] : y[i] + x[i];
    }
}

/* Whether the new contents of one block (as kvmix__retier_source) are all FP16-representable;
   decodes row by row on the stack. */
static int kvmix__retier_valid(const kvmix_cache *c, const kvmix_cache_page *p,
                               const kvmix__geom *g, int32_t layer, int is_value, int32_t head,
                               const float *rows_in, kvmix_cache_rows mode) {
    kvmix_layout l =
        kvmix__cache_layout(c, is_value, is_value ? p->value_format : p->key_format, p->n_rows);
    kvmix__sections s = kvmix__layout_sections(&l);
    const uint8_t *block = kvmix__page_block(c, p, g, layer, is_value, head);
    float row[KVMIX_MAX_HEAD_DIM];
    int32_t d = c->desc.head_dim, t, i;
    size_t heads = (size_t)c->desc.n_kv_heads;
    for (t = 0; t < p->n_rows; t++) {
        const float *x =
            rows_in ? rows_in + (((size_t)layer * p->n_rows + t) * heads + (size_t)head) * d : NULL;
        if (!x || mode == KVMIX_CACHE_ROWS_RESIDUAL) kvmix__decode_row(&l, &s, block, t, row);
        for (i = 0; i < d; i++) {
            float y = !x ? row[i] : mode == KVMIX_CACHE_ROWS_ORIGINAL ? x[i] : row[i] + x[i];
            if (!kvmix__representable(y)) return 0;
        }
    }
    return 1;
}

static const kvmix_cache_entry *kvmix__entry_at(const kvmix_cache *c, int32_t seq,
                                                int32_t position) {
    const kvmix_cache_entry *e = kvmix__seq_entries(c, seq);
    int32_t lo = 0, hi = c->seqs[seq].n_entries - 1;
    while (lo <= hi) { /* entries are in increasing, disjoint position ranges */
        int32_t mid = lo + (hi - lo) / 2;
        if (position < e[mid].first_pos)
            hi = mid - 1;
        else if (position >= kvmix__entry_end(&e[mid]))
            lo = mid + 1;
        else
            return &e[mid];
    }
    return NULL;
}

/* The checks of a retier, its rows' values included; *out_page: the page to rewrite. */
static kvmix__why kvmix__retier_ok(const kvmix_cache *cache, int32_t seq, int32_t position,
                                   kvmix_cache_precision precision, const float *keys,
                                   const float *values, kvmix_cache_rows rows, uint32_t *out_page) {
    const kvmix_cache_entry *e;
    const kvmix_cache_page *p;
    kvmix__geom og;
    int32_t layer, kv, h;
    kvmix__why w;
    if ((w = kvmix__cache_seq_ok(cache, seq)).result != KVMIX_SUCCESS) return w;
    if (cache->desc.device_arena && (keys || values))
        return kvmix__why_not(KVMIX_ERR_UNSUPPORTED, "cache",
                              "its arena is device memory: given rows would pass the host");
    if (position < 0 || position >= cache->seqs[seq].n_tokens)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "position",
                              "must be in 0 .. the sequence's positions - 1");
    if (rows != KVMIX_CACHE_ROWS_ORIGINAL && rows != KVMIX_CACHE_ROWS_RESIDUAL)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "rows", "must be a kvmix_cache_rows");
    if (!kvmix__precision_known(precision))
        return kvmix__why_not(KVMIX_ERR_UNKNOWN_FORMAT, "precision",
                              "a value that is not a kvmix_format");
    if (!kvmix__boost_ok(&cache->desc, kvmix__precision_or_default(cache, precision)))
        return kvmix__why_not(KVMIX_ERR_BAD_SHAPE, "precision", KVMIX__NO_BOOST);
    if (!(e = kvmix__entry_at(cache, seq, position)))
        return kvmix__why_not(KVMIX_ERR_NOT_FOUND, "position", "evicted: no page holds it");
    p = &cache->pages[e->page];
    if (!p->sealed)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "position",
                              "its page is an FP16 buffer, not sealed yet");
    og = kvmix__geom_of(cache, p);
    /* validate every block's new contents before writing any (no byte of the cache changes); a
       device arena's rows are out of the host's reach (a demotion there keeps FP16 rows) */
    for (layer = 0; !cache->desc.device_arena && layer < cache->desc.n_layers; layer++)
        for (kv = 0; kv < 2; kv++)
            for (h = 0; h < cache->desc.n_kv_heads; h++)
                if (!kvmix__retier_valid(cache, p, &og, layer, kv, h, kv ? values : keys, rows))
                    return kvmix__why_not(KVMIX_ERR_BAD_VALUE, kv ? "values" : "keys",
                                          "a new row value is NaN, infinite or beyond FP16");
    *out_page = e->page;
    return kvmix__why_ok();
}

/* Whether a page's blocks in `precision` fit its own bytes: each block's new bytes then end no
   later than its old ones, and it is read completely before it is written. */
static int kvmix__retier_in_place(const kvmix_cache *c, const kvmix_cache_page *p,
                                  kvmix_cache_precision precision) {
    kvmix__geom og = kvmix__geom_of(c, p),
                ng = kvmix__page_geom(c, precision.key_format, precision.value_format, p->n_rows,
                                      p->n_rows);
    return ng.key_bytes <= og.key_bytes && ng.value_bytes <= og.value_bytes;
}

/* Host arena: rewrites every block of page p into the blocks of ng at arena byte `to`. */
static void kvmix__retier_write(kvmix_cache *c, const kvmix_cache_page *p, const kvmix__geom *og,
                                const kvmix__geom *ng, kvmix_cache_precision precision, size_t to,
                                const float *keys, const float *values, kvmix_cache_rows rows) {
    int32_t layer, kv, h;
    for (layer = 0; layer < c->desc.n_layers; layer++)
        for (kv = 0; kv < 2; kv++)
            for (h = 0; h < c->desc.n_kv_heads; h++) {
                uint8_t *dst = c->arena + to + kvmix__block_offset(c, ng, layer, kv, h);
                kvmix__retier_source(c, p, og, layer, kv, h, kv ? values : keys, rows);
                kvmix__cache_quantize(c, kv, kv ? precision.value_format : precision.key_format,
                                      p->n_rows, c->priv.scratch, dst);
            }
    memset(c->priv.scratch, 0,
           (size_t)p->n_rows * (size_t)c->desc.head_dim * sizeof(float)); /* zero between calls */
}

/* Device arena, a demotion: queues the gather of every block of page `page` into FP16 rows at
   `staging` (an FP16 page of its rows), then their packing into the blocks of ng at byte `to`.
   The staging may be one that an earlier page's packing still reads: a new segment starts. */
static void kvmix__retier_queue(kvmix_cache *c, uint32_t page, const kvmix__geom *og,
                                const kvmix__geom *ng, kvmix_cache_precision precision, uint64_t to,
                                uint64_t staging) {
    const kvmix_cache_page *p = &c->pages[page];
    kvmix__geom sg =
        kvmix__page_geom(c, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, p->n_rows, p->n_rows);
    int32_t layer, kv, h, pass;
    c->priv.segment++;
    for (pass = 0; pass < 2; pass++) {
        if (pass == 1) kvmix__fence(c, page, page, 1); /* the packing reads what the gather wrote */
        for (layer = 0; layer < c->desc.n_layers; layer++)
            for (kv = 0; kv < 2; kv++)
                for (h = 0; h < c->desc.n_kv_heads; h++) {
                    uint64_t rows_at = staging + kvmix__block_offset(c, &sg, layer, kv, h);
                    if (pass == 0)
                        kvmix__queue(c, kvmix__dequantize_job(
                                            kv, kv ? p->value_format : p->key_format, p->capacity,
                                            p->offset + kvmix__block_offset(c, og, layer, kv, h),
                                            rows_at, 0, p->n_rows));
                    else
                        kvmix__queue_seal(c, kv, KVMIX_FORMAT_FP16,
                                          kv ? precision.value_format : precision.key_format,
                                          p->n_rows, rows_at,
                                          to + kvmix__block_offset(c, ng, layer, kv, h));
                }
        kvmix__mark_pages(c, page, pass ? page : 0);
    }
}

/* Re-tiers page `page` (checked) into `precision` (resolved): in its own bytes when they
   suffice, else in a new allocation. A device arena (a demotion) gathers through the FP16
   staging at arena byte `staging`. Returns 0 (nothing changed) when the arena has no room for
   the larger page. */
static int kvmix__retier_page(kvmix_cache *c, uint32_t page, kvmix_cache_precision precision,
                              const float *keys, const float *values, kvmix_cache_rows rows,
                              uint64_t staging) {
    kvmix_cache_page *p = &c->pages[page];
    kvmix__geom og = kvmix__geom_of(c, p),
                ng = kvmix__page_geom(c, precision.key_format, precision.value_format, p->n_rows,
                                      p->n_rows);
    int64_t old_start = (int64_t)(p->offset / c->desc.granule_bytes),
            old_n = (int64_t)p->n_granules, new_n = kvmix__granules_of(c, ng.total_bytes);
    int in_place = kvmix__retier_in_place(c, p, precision);
    int64_t start = old_start;
    if (!in_place && (start = kvmix__arena_take(c, NULL, new_n, KVMIX__LASTING)) < 0) return 0;
    if (c->desc.device_arena)
        kvmix__retier_queue(c, page, &og, &ng, precision, (uint64_t)start * c->desc.granule_bytes,
                            staging);
    else
        kvmix__retier_write(c, p, &og, &ng, precision, (size_t)start * c->desc.granule_bytes, keys,
                            values, rows);
    if (in_place)
        kvmix__arena_give(c, NULL, old_start + new_n, old_n - new_n);
    else
        kvmix__arena_give(c, NULL, old_start, old_n);
    p->offset = (uint64_t)start * c->desc.granule_bytes;
    p->n_granules = (uint32_t)new_n;
    p->key_format = p->want_key = precision.key_format;
    p->value_format = p->want_value = precision.value_format;
    p->capacity = p->n_rows;
    return 1;
}

/* A device arena's FP16 staging for demoting n_pages pages of up to `rows` rows (*out_granules
   of them; given back, it is held until the take), or -1 when the arena or the job queue has no
   room: two jobs per block and page, and held runs for the staging and each page's freed
   bytes. */
static int64_t kvmix__retier_staging(kvmix_cache *c, int32_t rows, int32_t n_pages,
                                     int64_t *out_granules) {
    kvmix__geom sg = kvmix__page_geom(c, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, rows, rows);
    int64_t jobs = 4 * (int64_t)c->desc.n_layers * (int64_t)c->desc.n_kv_heads * n_pages;
    *out_granules = kvmix__granules_of(c, sg.total_bytes);
    if (c->n_jobs + jobs > c->desc.max_jobs ||
        c->priv.n_retired_runs + 2 * (int64_t)n_pages + 1 > c->desc.max_jobs)
        return -1;
    return kvmix__arena_take(c, NULL, *out_granules, KVMIX__PASSING);
}

static kvmix__why kvmix__retier(kvmix_cache *cache, int32_t seq, int32_t position,
                                kvmix_cache_precision precision, const float *keys,
                                const float *values, kvmix_cache_rows rows) {
    uint32_t page = 0;
    int64_t staging = -1, staging_n = 0;
    int done;
    kvmix__why w = kvmix__retier_ok(cache, seq, position, precision, keys, values, rows, &page);
    if (w.result != KVMIX_SUCCESS) return w;
    precision = kvmix__precision_or_default(cache, precision);
    if (cache->desc.device_arena &&
        (staging = kvmix__retier_staging(cache, cache->pages[page].n_rows, 1, &staging_n)) < 0)
        return kvmix__why_not(KVMIX_ERR_OUT_OF_MEMORY, "arena",
                              "no room for the FP16 staging or the jobs: take the jobs first");
    done = kvmix__retier_page(cache, page, precision, keys, values, rows,
                              staging < 0 ? 0 : (uint64_t)staging * cache->desc.granule_bytes);
    if (staging >= 0) kvmix__arena_give(cache, NULL, staging, staging_n);
    if (!done)
        return kvmix__why_not(KVMIX_ERR_OUT_OF_MEMORY, "arena",
                              "no free run of granules for the larger page");
    cache->priv.view_epoch++; /* every sharer's span of the page changes */
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_retier(kvmix_cache *cache, int32_t seq, int32_t position,
                                         kvmix_cache_precision precision, const float *keys,
                                         const float *values, kvmix_cache_rows rows) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__retier(cache, seq, position, precision, keys, values, rows));
}

/* ---- aging a sequence (kvmix_cache_seq_age) -------------------------------------------------- */

/* The formats entry e's live positions ask for, per side the highest (answers checked first). */
static kvmix_cache_precision kvmix__entry_wants(const kvmix_cache *c, int32_t seq,
                                                const kvmix_cache_entry *e,
                                                kvmix_cache_position_wants wants, void *ctx) {
    const uint32_t *slots = kvmix__seq_slots(c, seq);
    kvmix_cache_precision want = {0, 0}, p;
    int32_t pos;
    for (pos = e->first_pos; pos < kvmix__entry_end(e); pos++)
        if (slots[pos] / (uint32_t)c->desc.page_tokens == e->page) {
            p.key_format = p.value_format = 0;
            (void)wants(ctx, pos, &p);
            want.key_format = kvmix__higher_format(want.key_format, p.key_format);
            want.value_format = kvmix__higher_format(want.value_format, p.value_format);
        }
    return want;
}

/* The lower of a stored format and a wanted one (0: nothing wanted, the stored stays). */
static uint8_t kvmix__lower_format(uint8_t stored, uint8_t want) {
    return want != 0 && kvmix__format_rank(want) < kvmix__format_rank(stored) ? want : stored;
}

/* Entry e's page demoted to what its positions want, or its own formats when that is nothing
   (shared, sinks, an FP16 buffer, a larger page, formats the cache cannot store). */
static kvmix_cache_precision kvmix__aged_precision(const kvmix_cache *c, int32_t seq,
                                                   const kvmix_cache_entry *e,
                                                   kvmix_cache_position_wants wants, void *ctx) {
    const kvmix_cache_page *p = &c->pages[e->page];
    kvmix_cache_precision want, aged;
    aged.key_format = p->key_format;
    aged.value_format = p->value_format;
    if (!p->sealed || p->sink || p->refcount > 1) return aged;
    want = kvmix__entry_wants(c, seq, e, wants, ctx);
    want.key_format = kvmix__lower_format(p->key_format, want.key_format);
    want.value_format = kvmix__lower_format(p->value_format, want.value_format);
    if (!kvmix__boost_ok(&c->desc, want) || !kvmix__retier_in_place(c, p, want)) return aged;
    return want;
}

static int kvmix__same_precision(kvmix_cache_precision a, uint8_t key, uint8_t value) {
    return a.key_format == key && a.value_format == value;
}

/* Asks `wants` about every live position before anything changes: a refusal or a format the
   cache does not know fails the call whole. */
static kvmix__why kvmix__seq_age_ok(const kvmix_cache *c, int32_t seq,
                                    kvmix_cache_position_wants wants, void *ctx) {
    const uint32_t *slots;
    kvmix_cache_precision p;
    kvmix_result r;
    int32_t pos;
    kvmix__why w = kvmix__cache_seq_ok(c, seq);
    if (w.result != KVMIX_SUCCESS) return w;
    if (!wants) return kvmix__why_not(KVMIX_ERR_NULL_POINTER, "wants", "NULL");
    slots = kvmix__seq_slots(c, seq);
    for (pos = 0; pos < c->seqs[seq].n_tokens; pos++) {
        if (slots[pos] == KVMIX_CACHE_DEAD_SLOT) continue;
        p.key_format = p.value_format = 0;
        if ((r = wants(ctx, pos, &p)) != KVMIX_SUCCESS)
            return kvmix__why_not(r, "wants", "refused a position");
        if (!kvmix__precision_known(p))
            return kvmix__why_not(KVMIX_ERR_UNKNOWN_FORMAT, "wants",
                                  "a format the cache cannot store");
    }
    return kvmix__why_ok();
}

static kvmix__why kvmix__seq_age(kvmix_cache *cache, int32_t seq, kvmix_cache_position_wants wants,
                                 void *ctx, int32_t *out_pages) {
    kvmix_cache_entry *e;
    int32_t j, n_pages = 0, max_rows = 0;
    int64_t staging = -1, staging_n = 0;
    kvmix__why w = kvmix__seq_age_ok(cache, seq, wants, ctx);
    if (w.result != KVMIX_SUCCESS) return w;
    e = kvmix__seq_entries(cache, seq);
    for (j = 0; j < cache->seqs[seq].n_entries; j++) {
        const kvmix_cache_page *p = &cache->pages[e[j].page];
        if (!kvmix__same_precision(kvmix__aged_precision(cache, seq, &e[j], wants, ctx),
                                   p->key_format, p->value_format)) {
            n_pages++;
            if (p->n_rows > max_rows) max_rows = p->n_rows;
        }
    }
    if (n_pages > 0 && cache->desc.device_arena &&
        (staging = kvmix__retier_staging(cache, max_rows, n_pages, &staging_n)) < 0)
        return kvmix__why_not(KVMIX_ERR_OUT_OF_MEMORY, "arena",
                              "no room for the FP16 staging or the jobs: take the jobs first");
    for (j = 0; j < cache->seqs[seq].n_entries; j++) {
        kvmix_cache_page *p = &cache->pages[e[j].page];
        kvmix_cache_precision aged = kvmix__aged_precision(cache, seq, &e[j], wants, ctx);
        if (!p->sealed && !p->sink && p->refcount == 1) { /* a buffer: sealed to what it wants */
            kvmix_cache_precision want = kvmix__entry_wants(cache, seq, &e[j], wants, ctx);
            if (p->key_format == KVMIX_FORMAT_FP16) /* keys a values-only window sealed stay */
                p->want_key = kvmix__lower_format(p->want_key, want.key_format);
            p->want_value = kvmix__lower_format(p->want_value, want.value_format);
        } else if (!kvmix__same_precision(aged, p->key_format, p->value_format)) {
            kvmix__retier_page(cache, e[j].page, aged, NULL, NULL, KVMIX_CACHE_ROWS_ORIGINAL,
                               staging < 0 ? 0 : (uint64_t)staging * cache->desc.granule_bytes);
            kvmix__view_touch(cache, seq, j); /* its span's formats changed; no one shares it */
        }
    }
    if (staging >= 0) kvmix__arena_give(cache, NULL, staging, staging_n);
    if (out_pages) *out_pages = n_pages;
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_seq_age(kvmix_cache *cache, int32_t seq,
                                          kvmix_cache_position_wants wants, void *ctx,
                                          int32_t *out_pages) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__seq_age(cache, seq, wants, ctx, out_pages));
}

/* ---- compaction ----------------------------------------------------------------------------- */

enum { KVMIX__MAX_PAGE_TOKENS = 1024 }; /* desc.page_tokens' bound: a page's row flags fit */

/* Entries [first, end) of a sequence whose survivors, `rows` of them, move to one new page of
   `page_rows` rows: rows rounded up to a multiple of 8 (blocks keep the alignment of page_tokens
   rows that the decode kernel reads them with), the rows past the survivors repeating the last
   one, unused (dead in views). */
typedef struct kvmix__compact_run {
    int32_t first, end, rows, page_rows;
    int64_t old_granules;
} kvmix__compact_run;

/* Live rows of entry e when compaction may move its page (sealed, the sequence's alone, not the
   sinks', with dead rows, at most max_live of them live), else -1. */
static int32_t kvmix__compact_live(const kvmix_cache *c, int32_t seq, const kvmix_cache_entry *e,
                                   double max_live) {
    const kvmix_cache_page *p = &c->pages[e->page];
    int32_t live;
    if (!p->sealed || p->refcount != 1 || p->sink) return -1;
    live = kvmix__entry_rows_live(c, kvmix__seq_slots(c, seq), e, p->n_rows, NULL);
    return live > 0 && live < p->n_rows && live <= max_live * p->n_rows ? live : -1;
}

/* The next run from entry *at on: consecutive movable pages of the same formats whose survivors
   fit a page; rows 0 when none is left. */
static kvmix__compact_run kvmix__compact_next(const kvmix_cache *c, int32_t seq, int32_t *at,
                                              double max_live) {
    const kvmix_cache_entry *e = kvmix__seq_entries(c, seq);
    kvmix__compact_run run = {0, 0, 0, 0, 0};
    int32_t n = c->seqs[seq].n_entries, live;
    for (; *at < n; (*at)++) {
        const kvmix_cache_page *p = &c->pages[e[*at].page];
        live = kvmix__compact_live(c, seq, &e[*at], max_live);
        if (run.rows > 0 && (live < 0 || run.rows + live > c->desc.page_tokens ||
                             p->key_format != c->pages[e[run.first].page].key_format ||
                             p->value_format != c->pages[e[run.first].page].value_format))
            break;
        if (live < 0) continue;
        if (run.rows == 0) run.first = *at;
        run.rows += live;
        run.old_granules += (int64_t)p->n_granules;
        run.end = *at + 1;
    }
    run.page_rows = (run.rows + 7) / 8 * 8;
    return run;
}

/* Whether a block format keeps its rows apart (FP16, per-token integers): rows then move byte
   for byte; per-channel blocks are gathered and quantized again over their new rows. */
static int kvmix__rows_movable(int32_t format) {
    return format == KVMIX_FORMAT_FP16 || kvmix__is_per_token_int(format);
}

/* The byte ranges that move rows [row, row + n) of block `from` (rows_from rows) to rows [k,
   k + n) of block `to` (rows_to rows), for a movable format: codes, then (per-token integers)
   their (scale, min) pairs. Offsets are from each block's start; returns how many ranges. */
static int kvmix__row_ranges(const kvmix_cache *c, int is_value, int32_t format, int32_t rows_from,
                             int32_t rows_to, int32_t row, int32_t k, int32_t n, uint64_t from[2],
                             uint64_t to[2], uint64_t bytes[2]) {
    kvmix_layout lf = kvmix__cache_layout(c, is_value, format, rows_from);
    kvmix_layout lt = kvmix__cache_layout(c, is_value, format, rows_to);
    kvmix__sections sf = kvmix__layout_sections(&lf), st = kvmix__layout_sections(&lt);
    int32_t groups;
    from[0] = kvmix__row_at(&sf, row), to[0] = kvmix__row_at(&st, k);
    bytes[0] = (uint64_t)n * sf.row_bytes;
    if (format == KVMIX_FORMAT_FP16) return 1;
    groups = lf.head_dim / lf.group_size;
    from[1] = kvmix__token_meta_at(&sf, row, groups, 0),
    to[1] = kvmix__token_meta_at(&st, k, groups, 0);
    bytes[1] = (uint64_t)n * (uint64_t)groups * 4u;
    return 2;
}

/* Calls visit(c, ctx, entry, row, k, n) for each run of consecutive live rows of the run's pages,
   k counting the rows before it: the order the survivors take in the new page; then once per
   padding row with the last survivor. */
typedef void (*kvmix__live_run_fn)(kvmix_cache *c, void *ctx, const kvmix_cache_entry *e,
                                   int32_t row, int32_t k, int32_t n);
static void kvmix__live_runs(kvmix_cache *c, int32_t seq, const kvmix__compact_run *run,
                             kvmix__live_run_fn visit, void *ctx) {
    const kvmix_cache_entry *e = kvmix__seq_entries(c, seq), *last = NULL;
    uint8_t live[KVMIX__MAX_PAGE_TOKENS];
    int32_t j, row, end, k = 0, last_row = 0;
    for (j = run->first; j < run->end; j++) {
        int32_t n = c->pages[e[j].page].n_rows;
        kvmix__entry_rows_live(c, kvmix__seq_slots(c, seq), &e[j], n, live);
        for (row = 0; row < n; row = end) {
            for (end = row; end < n && live[end] == live[row]; end++) {
            }
            if (!live[row]) continue;
            visit(c, ctx, &e[j], row, k, end - row);
            k += end - row;
            last = &e[j], last_row = end - 1;
        }
    }
    for (; last && k < run->page_rows; k++) visit(c, ctx, last, last_row, k, 1);
}

/* What one block of the new page takes from the run: (layer, kv, head), the new page, where
   gathered FP16 rows go (device) and how many jobs a device arena needs. */
typedef struct kvmix__block_move {
    const kvmix_cache_page *np;
    int32_t layer, kv, head;
    uint64_t staging; /* device: FP16 rows of this block, for a per-channel format */
    int64_t n_runs;
} kvmix__block_move;

static int32_t kvmix__block_format(const kvmix_cache_page *p, int kv) {
    return kv ? p->value_format : p->key_format;
}

static uint64_t kvmix__block_at(const kvmix_cache *c, const kvmix_cache_page *p, int32_t layer,
                                int kv, int32_t head) {
    kvmix__geom g = kvmix__geom_of(c, p);
    return p->offset + kvmix__block_offset(c, &g, layer, kv, head);
}

/* Host arena: moves (FP16, per-token) or decodes into the scratch rows (per-channel, each value
   rounded to FP16 as a device arena's gather is) one run of live rows. */
static void kvmix__host_move(kvmix_cache *c, void *ctx, const kvmix_cache_entry *e, int32_t row,
                             int32_t k, int32_t n) {
    const kvmix__block_move *m = (const kvmix__block_move *)ctx;
    const kvmix_cache_page *p = &c->pages[e->page];
    int32_t format = kvmix__block_format(p, m->kv), r, i, d = c->desc.head_dim;
    const uint8_t *from = c->arena + kvmix__block_at(c, p, m->layer, m->kv, m->head);
    if (kvmix__rows_movable(format)) {
        uint64_t f[2], t[2], bytes[2];
        uint8_t *to = c->arena + kvmix__block_at(c, m->np, m->layer, m->kv, m->head);
        int ranges =
            kvmix__row_ranges(c, m->kv, format, p->n_rows, m->np->n_rows, row, k, n, f, t, bytes);
        for (i = 0; i < ranges; i++) memcpy(to + t[i], from + f[i], (size_t)bytes[i]);
        return;
    }
    {
        kvmix_layout l = kvmix__cache_layout(c, m->kv, format, p->n_rows);
        kvmix__sections s = kvmix__layout_sections(&l);
        for (r = 0; r < n; r++) {
            float *out = c->priv.scratch + (size_t)(k + r) * (size_t)d;
            kvmix__decode_row(&l, &s, from, row + r, out);
            for (i = 0; i < d; i++) out[i] = kvmix__h2f(kvmix__f2h(out[i]));
        }
    }
}

/* Device arena: queues the copies (FP16, per-token) or the gather into FP16 staging rows
   (per-channel) of one run of live rows. */
static void kvmix__device_move(kvmix_cache *c, void *ctx, const kvmix_cache_entry *e, int32_t row,
                               int32_t k, int32_t n) {
    const kvmix__block_move *m = (const kvmix__block_move *)ctx;
    const kvmix_cache_page *p = &c->pages[e->page];
    int32_t format = kvmix__block_format(p, m->kv), i;
    uint64_t from = kvmix__block_at(c, p, m->layer, m->kv, m->head);
    kvmix__fence(c, e->page, (uint32_t)(m->np - c->pages), 0);
    if (kvmix__rows_movable(format)) {
        uint64_t f[2], t[2], bytes[2];
        uint64_t to = kvmix__block_at(c, m->np, m->layer, m->kv, m->head);
        int ranges =
            kvmix__row_ranges(c, m->kv, format, p->n_rows, m->np->n_rows, row, k, n, f, t, bytes);
        for (i = 0; i < ranges; i++)
            kvmix__queue(c, kvmix__copy_job(from + f[i], to + t[i], bytes[i]));
    } else {
        kvmix__queue(c, kvmix__dequantize_job(
                            m->kv, format, p->n_rows, from,
                            m->staging + (uint64_t)k * (uint64_t)c->desc.head_dim * 2u, row, n));
    }
    kvmix__mark_pages(c, e->page, (uint32_t)(m->np - c->pages));
}

static void kvmix__count_move(kvmix_cache *c, void *ctx, const kvmix_cache_entry *e, int32_t row,
                              int32_t k, int32_t n) {
    (void)c, (void)e, (void)row, (void)k, (void)n;
    ((kvmix__block_move *)ctx)->n_runs++;
}

/* Jobs a device arena queues for the run: two per run of live rows per block (copies of codes
   and pairs, or a gather), one packing per per-channel block. */
static int64_t kvmix__compact_jobs(kvmix_cache *c, int32_t seq, const kvmix__compact_run *run) {
    kvmix__block_move m;
    memset(&m, 0, sizeof m);
    kvmix__live_runs(c, seq, run, kvmix__count_move, &m);
    return (2 * m.n_runs + 1) * 2 * (int64_t)c->desc.n_layers * (int64_t)c->desc.n_kv_heads;
}

/* Fills (host) or queues the filling of (device) every block of page id from the run's
   survivors; staging: device bytes of an FP16 page of the run's rows, for per-channel blocks,
   which a device arena packs once every gather is queued. */
static void kvmix__compact_fill(kvmix_cache *c, int32_t seq, const kvmix__compact_run *run,
                                uint32_t id, uint64_t staging) {
    const kvmix_cache_page *np = &c->pages[id];
    kvmix__geom sg =
        kvmix__page_geom(c, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, np->n_rows, np->n_rows);
    int device = c->desc.device_arena, pass;
    kvmix__block_move m;
    memset(&m, 0, sizeof m);
    m.np = np;
    for (pass = 0; pass < 1 + device; pass++) {
        if (pass == 1) kvmix__fence(c, id, id, 1); /* the packing reads what the gather wrote */
        for (m.layer = 0; m.layer < c->desc.n_layers; m.layer++)
            for (m.kv = 0; m.kv < 2; m.kv++)
                for (m.head = 0; m.head < c->desc.n_kv_heads; m.head++) {
                    int32_t format = kvmix__block_format(np, m.kv);
                    uint8_t *to = c->arena + kvmix__block_at(c, np, m.layer, m.kv, m.head);
                    m.staging = staging + kvmix__block_offset(c, &sg, m.layer, m.kv, m.head);
                    if (pass == 0)
                        kvmix__live_runs(c, seq, run,
                                         device ? kvmix__device_move : kvmix__host_move, &m);
                    if (kvmix__rows_movable(format)) continue;
                    if (device && pass == 1) {
                        kvmix__queue_seal(c, m.kv, KVMIX_FORMAT_FP16, (uint8_t)format, np->n_rows,
                                          m.staging, (uint64_t)(to - c->arena));
                    } else if (!device) {
                        kvmix__cache_quantize(c, m.kv, format, np->n_rows, c->priv.scratch, to);
                        memset(c->priv.scratch, 0, /* zero between calls */
                               (size_t)np->n_rows * (size_t)c->desc.head_dim * sizeof(float));
                    }
                }
        if (pass == 1) kvmix__mark_pages(c, id, id);
    }
}

/* Points the run's live positions at their rows of page id, releases the old pages and makes the
   run's entries one. */
static void kvmix__compact_commit(kvmix_cache *c, int32_t seq, const kvmix__compact_run *run,
                                  uint32_t id) {
    kvmix_cache_seq *s = &c->seqs[seq];
    kvmix_cache_entry *e = kvmix__seq_entries(c, seq);
    uint32_t *slots = kvmix__seq_slots(c, seq);
    int32_t first = e[run->first].first_pos, end = kvmix__entry_end(&e[run->end - 1]), pos, j;
    int32_t k = 0, gone = run->end - run->first - 1;
    for (pos = first; pos < end; pos++)
        if (slots[pos] != KVMIX_CACHE_DEAD_SLOT) slots[pos] = kvmix__slot(c, id, k++);
    for (j = run->first; j < run->end; j++) kvmix__page_release(c, e[j].page);
    e[run->first].page = id;
    e[run->first].first_pos = first;
    e[run->first].n_rows = run->page_rows;
    e[run->first].n_positions = end - first;
    memmove(&e[run->first + 1], &e[run->end], (size_t)(s->n_entries - run->end) * sizeof *e);
    s->n_entries -= gone;
    kvmix__view_touch(c, seq, run->first);
    memset(&e[s->n_entries], 0, (size_t)gone * sizeof *e);
}

/* Compacts one run into a new page; returns the granules it frees, 0 (nothing changed) when it
   would free none or the arena, the descriptors or the job queue have no room. */
static int64_t kvmix__compact_run_once(kvmix_cache *c, int32_t seq, const kvmix__compact_run *run) {
    const kvmix_cache_page *src = &c->pages[kvmix__seq_entries(c, seq)[run->first].page];
    kvmix__geom ng =
        kvmix__page_geom(c, src->key_format, src->value_format, run->page_rows, run->page_rows);
    kvmix__geom sg =
        kvmix__page_geom(c, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, run->page_rows, run->page_rows);
    int64_t n = kvmix__granules_of(c, ng.total_bytes), sn = kvmix__granules_of(c, sg.total_bytes);
    int64_t start, staging = -1;
    int device = c->desc.device_arena;
    int gather = device &&
                 (!kvmix__rows_movable(src->key_format) || !kvmix__rows_movable(src->value_format));
    kvmix_cache_page *np;
    uint32_t id;
    if (n >= run->old_granules || c->priv.n_free_pages < 1) return 0;
    if (device && (c->n_jobs + kvmix__compact_jobs(c, seq, run) > c->desc.max_jobs ||
                   c->priv.n_retired_runs >= c->desc.max_jobs))
        return 0;
    if ((start = kvmix__arena_take(c, NULL, n, KVMIX__LASTING)) < 0) return 0;
    if (gather && (staging = kvmix__arena_take(c, NULL, sn, KVMIX__PASSING)) < 0) {
        kvmix__granules_free(c, start, n);
        return 0;
    }
    id = kvmix__page_pop(c);
    np = &c->pages[id];
    memset(np, 0, sizeof *np);
    np->offset = (uint64_t)start * c->desc.granule_bytes;
    np->n_granules = (uint32_t)n;
    np->refcount = 1;
    np->n_rows = np->capacity = run->page_rows;
    np->key_format = np->want_key = src->key_format;
    np->value_format = np->want_value = src->value_format;
    np->sealed = 1;
    kvmix__compact_fill(c, seq, run, id,
                        staging < 0 ? 0 : (uint64_t)staging * c->desc.granule_bytes);
    if (staging >= 0) kvmix__arena_give(c, NULL, staging, sn); /* held until the take */
    kvmix__compact_commit(c, seq, run, id);
    return run->old_granules - n;
}

static kvmix__why kvmix__compact(kvmix_cache *cache, int32_t seq, double max_live_fraction,
                                 size_t *out_bytes_freed) {
    kvmix__why w;
    int32_t at = 0;
    size_t freed = 0;
    if ((w = kvmix__cache_seq_ok(cache, seq)).result != KVMIX_SUCCESS) return w;
    if (!(max_live_fraction > 0.0 && max_live_fraction <= 1.0))
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "max_live_fraction", "not in (0, 1]");
    for (;;) {
        kvmix__compact_run run = kvmix__compact_next(cache, seq, &at, max_live_fraction);
        int64_t granules;
        if (run.rows == 0) break;
        if ((granules = kvmix__compact_run_once(cache, seq, &run)) > 0) {
            freed += (size_t)granules * cache->desc.granule_bytes;
            at = run.first + 1; /* the run is one entry now */
        }
    }
    if (out_bytes_freed) *out_bytes_freed = freed;
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_compact(kvmix_cache *cache, int32_t seq, double max_live_fraction,
                                          size_t *out_bytes_freed) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__compact(cache, seq, max_live_fraction, out_bytes_freed));
}

/* ---- reading -------------------------------------------------------------------------------- */

KVMIXDEF kvmix_result kvmix_cache_locate(const kvmix_cache *cache, int32_t seq, int32_t position,
                                         uint32_t *out_slot) {
    kvmix_result r;
    if (!cache || !out_slot) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__cache_seq_ok(cache, seq).result) != KVMIX_SUCCESS) return r;
    if (position < 0 || position >= cache->seqs[seq].n_tokens) return KVMIX_ERR_INVALID_ARGUMENT;
    *out_slot = kvmix__seq_slots(cache, seq)[position];
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_cache_read(const kvmix_cache *cache, int32_t seq, int32_t layer,
                                       int32_t position, float *keys, float *values,
                                       kvmix_cache_precision *out_precision) {
    const kvmix_cache_page *p;
    kvmix__geom g;
    kvmix_result r;
    uint32_t slot;
    int32_t row, h, kv;
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    if (cache->desc.device_arena) return KVMIX_ERR_INVALID_ARGUMENT; /* rows on the device */
    if ((r = kvmix__cache_seq_ok(cache, seq).result) != KVMIX_SUCCESS) return r;
    if (position < 0 || position >= cache->seqs[seq].n_tokens || layer < 0 ||
        layer >= cache->desc.n_layers || position >= kvmix__seq_written(cache, seq)[layer])
        return KVMIX_ERR_INVALID_ARGUMENT; /* beyond the sequence, or its row not written yet */
    slot = kvmix__seq_slots(cache, seq)[position];
    if (slot == KVMIX_CACHE_DEAD_SLOT) return KVMIX_ERR_NOT_FOUND;
    p = &cache->pages[slot / (uint32_t)cache->desc.page_tokens];
    row = (int32_t)(slot % (uint32_t)cache->desc.page_tokens);
    g = kvmix__geom_of(cache, p);
    for (kv = 0; kv < 2; kv++) {
        float *out = kv ? values : keys;
        kvmix_layout l =
            kvmix__cache_layout(cache, kv, kv ? p->value_format : p->key_format, p->n_rows);
        kvmix__sections s = kvmix__layout_sections(&l);
        if (!out) continue;
        for (h = 0; h < cache->desc.n_kv_heads; h++)
            kvmix__decode_row(&l, &s, kvmix__page_block(cache, p, &g, layer, kv, h), row,
                              out + (size_t)h * cache->desc.head_dim);
    }
    if (out_precision) {
        out_precision->key_format = p->key_format;
        out_precision->value_format = p->value_format;
    }
    return KVMIX_SUCCESS;
}

/* ---- views ---------------------------------------------------------------------------------- */

/* Tokens of the span of an entry on a layer: the packed block's rows (all written: seals wait for
   n_written), or the rows an FP16 page holds for the sequence that the layer has written (FP16
   blocks are readable by prefix); layer -1: every reserved row, the most of any layer. */
static int32_t kvmix__span_tokens(const kvmix_cache *c, int32_t seq, int32_t layer,
                                  const kvmix_cache_page *p, const kvmix_cache_entry *e) {
    int32_t n = e->n_rows;
    if (p->key_format != KVMIX_FORMAT_FP16 || p->value_format != KVMIX_FORMAT_FP16)
        return p->n_rows;
    if (layer >= 0 && kvmix__seq_written(c, seq)[layer] - e->first_pos < n)
        n = kvmix__seq_written(c, seq)[layer] - e->first_pos;
    return n;
}

/* Whether the n rows of entry e are all the sequence's: without a row check when the sequence
   has evicted nothing and the span ends inside the entry (views cost O(pages) then). */
static int kvmix__span_all_live(const kvmix_cache *c, int32_t seq, const kvmix_cache_entry *e,
                                int32_t n) {
    if (n <= e->n_rows && e->n_positions == 0 && c->seqs[seq].n_live == c->seqs[seq].n_tokens)
        return 1;
    return kvmix__entry_rows_live(c, kvmix__seq_slots(c, seq), e, n, NULL) == n;
}

static kvmix__why kvmix__view_seqs_ok(const kvmix_cache *c, const int32_t *seqs, int32_t n_seqs) {
    int32_t i;
    if (n_seqs < 0) return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_seqs", "negative");
    if (n_seqs > 0 && !seqs) return kvmix__why_not(KVMIX_ERR_NULL_POINTER, "seqs", "NULL");
    for (i = 0; i < n_seqs; i++) {
        kvmix__why w = kvmix__cache_seq_ok(c, seqs[i]);
        if (w.result != KVMIX_SUCCESS) {
            if (c->seqs) w.argument = "seqs";
            return w;
        }
    }
    return kvmix__why_ok();
}

/* Spans and dead flags of one sequence's view of a layer (-1: enough for every layer) from
   entry `first` on: one span per entry up to the first the layer has no rows of. */
static void kvmix__view_seq_count(const kvmix_cache *c, int32_t seq, int32_t layer, int32_t first,
                                  int64_t *n_spans, int64_t *n_dead) {
    const kvmix_cache_entry *e = kvmix__seq_entries(c, seq);
    int32_t j;
    for (j = first; j < c->seqs[seq].n_entries; j++) {
        int32_t n = kvmix__span_tokens(c, seq, layer, &c->pages[e[j].page], &e[j]);
        if (n <= 0) break;
        (*n_spans)++;
        if (!kvmix__span_all_live(c, seq, &e[j], n)) *n_dead += n;
    }
}

static void kvmix__view_count(const kvmix_cache *c, int32_t layer, const int32_t *seqs,
                              int32_t n_seqs, int64_t *n_spans, int64_t *n_dead) {
    int32_t i;
    *n_spans = *n_dead = 0;
    for (i = 0; i < n_seqs; i++) kvmix__view_seq_count(c, seqs[i], layer, 0, n_spans, n_dead);
}

/* Writes what kvmix__view_seq_count counts: spans, and dead flags from dead[0] whose indices in
   the view start at dead_first. Returns the flags written. */
static int32_t kvmix__view_seq_fill(const kvmix_cache *c, int32_t seq, int32_t layer, int32_t first,
                                    kvmix_view_span *spans, uint8_t *dead, int32_t dead_first,
                                    int32_t *out_n_spans) {
    const kvmix_cache_entry *e = kvmix__seq_entries(c, seq);
    const uint32_t *slots = kvmix__seq_slots(c, seq);
    int32_t j, row, k = 0, f = 0;
    for (j = first; j < c->seqs[seq].n_entries; j++, k++) {
        const kvmix_cache_page *p = &c->pages[e[j].page];
        kvmix__geom g = kvmix__geom_of(c, p);
        kvmix_view_span *vs = &spans[k];
        int32_t n = kvmix__span_tokens(c, seq, layer, p, &e[j]);
        if (n <= 0) break;
        memset(vs, 0, sizeof *vs);
        vs->key_offset = p->offset + kvmix__block_offset(c, &g, layer, 0, 0);
        vs->value_offset = p->offset + kvmix__block_offset(c, &g, layer, 1, 0);
        vs->key_head_bytes = (uint32_t)g.key_bytes;
        vs->value_head_bytes = (uint32_t)g.value_bytes;
        vs->n_tokens = n;
        vs->key_format = p->key_format;
        vs->value_format = p->value_format;
        vs->dead_index = -1;
        if (!kvmix__span_all_live(c, seq, &e[j], n)) {
            vs->dead_index = dead_first + f;
            kvmix__entry_rows_live(c, slots, &e[j], n, dead + f);
            for (row = 0; row < n; row++, f++) dead[f] = (uint8_t)!dead[f];
        }
    }
    *out_n_spans = k;
    return f;
}

KVMIXDEF kvmix_result kvmix_cache_view_counts(const kvmix_cache *cache, const int32_t *seqs,
                                              int32_t n_seqs, int32_t *out_n_spans,
                                              int32_t *out_n_dead_flags) {
    int64_t n_spans, n_dead;
    kvmix_result r;
    if (!cache || !out_n_spans || !out_n_dead_flags) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__view_seqs_ok(cache, seqs, n_seqs).result) != KVMIX_SUCCESS) return r;
    kvmix__view_count(cache, -1, seqs, n_seqs, &n_spans, &n_dead);
    if (n_spans > 0x7fffffff || n_dead > 0x7fffffff) return KVMIX_ERR_INVALID_ARGUMENT;
    *out_n_spans = (int32_t)n_spans;
    *out_n_dead_flags = (int32_t)n_dead;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_cache_view(const kvmix_cache *cache, const int32_t *seqs,
                                       int32_t n_seqs, int32_t layer, kvmix_view_span *spans,
                                       int32_t max_spans, int32_t *seq_first_span, uint8_t *dead,
                                       int32_t max_dead_flags, kvmix_view *out_view) {
    int64_t n_spans, n_dead;
    int32_t i, k = 0, f = 0;
    kvmix_result r;
    if (!cache || !seq_first_span || !out_view) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__view_seqs_ok(cache, seqs, n_seqs).result) != KVMIX_SUCCESS) return r;
    if (layer < 0 || layer >= cache->desc.n_layers || max_spans < 0 || max_dead_flags < 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    kvmix__view_count(cache, layer, seqs, n_seqs, &n_spans, &n_dead);
    if (n_spans > max_spans || n_dead > max_dead_flags) return KVMIX_ERR_BUFFER_TOO_SMALL;
    if ((n_spans > 0 && !spans) || (n_dead > 0 && !dead)) return KVMIX_ERR_NULL_POINTER;
    for (i = 0; i < n_seqs; i++) {
        int32_t n = 0;
        seq_first_span[i] = k;
        f += kvmix__view_seq_fill(cache, seqs[i], layer, 0, spans + k, dead + f, f, &n);
        k += n;
    }
    seq_first_span[n_seqs] = k;
    memset(out_view, 0, sizeof *out_view);
    out_view->n_seqs = n_seqs;
    out_view->n_kv_heads = cache->desc.n_kv_heads;
    out_view->head_dim = cache->desc.head_dim;
    out_view->group_size = cache->desc.group_size;
    out_view->value_group_size = cache->desc.value_group_size;
    out_view->n_boost = cache->desc.n_boost;
    out_view->n_spans = k;
    out_view->n_dead_flags = f;
    out_view->base = cache->arena;
    out_view->base_bytes = (size_t)cache->priv.n_granules * cache->desc.granule_bytes;
    out_view->spans = spans;
    out_view->seq_first_span = seq_first_span;
    out_view->dead = dead;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_cache_view_changes(kvmix_cache *cache, int32_t seq,
                                               int32_t *out_first_entry) {
    kvmix_cache_seq *s;
    kvmix_result r;
    if (!cache || !out_first_entry) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__cache_seq_ok(cache, seq).result) != KVMIX_SUCCESS) return r;
    s = &cache->seqs[seq];
    *out_first_entry = s->view_epoch != cache->priv.view_epoch ? 0
                       : s->view_from < s->n_entries           ? s->view_from
                                                               : s->n_entries;
    s->view_from = s->n_entries;
    s->view_epoch = cache->priv.view_epoch;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_cache_view_seq(const kvmix_cache *cache, int32_t seq, int32_t layer,
                                           int32_t first_entry, kvmix_view_span *spans,
                                           int32_t max_spans, uint8_t *dead, int32_t max_dead_flags,
                                           int32_t dead_first, int32_t *out_n_spans,
                                           int32_t *out_n_dead_flags) {
    int64_t n_spans = 0, n_dead = 0;
    kvmix_result r;
    if (!cache || !out_n_spans || !out_n_dead_flags) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__cache_seq_ok(cache, seq).result) != KVMIX_SUCCESS) return r;
    if (layer < 0 || layer >= cache->desc.n_layers || first_entry < 0 ||
        first_entry > cache->seqs[seq].n_entries || max_spans < 0 || max_dead_flags < 0 ||
        dead_first < 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    kvmix__view_seq_count(cache, seq, layer, first_entry, &n_spans, &n_dead);
    if (n_spans > max_spans || n_dead > max_dead_flags) return KVMIX_ERR_BUFFER_TOO_SMALL;
    if ((n_spans > 0 && !spans) || (n_dead > 0 && !dead)) return KVMIX_ERR_NULL_POINTER;
    *out_n_dead_flags =
        kvmix__view_seq_fill(cache, seq, layer, first_entry, spans, dead, dead_first, out_n_spans);
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_cache_view_positions(const kvmix_cache *cache, int32_t seq,
                                                 int32_t layer, int32_t *positions,
                                                 int32_t capacity, int32_t *out_n) {
    const kvmix_cache_entry *e;
    const uint32_t *slots;
    int64_t total = 0;
    int32_t j, row, k = 0;
    if (!cache || !out_n) return KVMIX_ERR_NULL_POINTER;
    if (kvmix__cache_seq_ok(cache, seq).result != KVMIX_SUCCESS || layer < 0 ||
        layer >= cache->desc.n_layers || capacity < 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    e = kvmix__seq_entries(cache, seq);
    for (j = 0; j < cache->seqs[seq].n_entries; j++) {
        int32_t n = kvmix__span_tokens(cache, seq, layer, &cache->pages[e[j].page], &e[j]);
        if (n > 0) total += n;
    }
    if (total > capacity) return KVMIX_ERR_BUFFER_TOO_SMALL;
    if (total > 0 && !positions) return KVMIX_ERR_NULL_POINTER;
    slots = kvmix__seq_slots(cache, seq);
    for (j = 0; j < cache->seqs[seq].n_entries; j++) {
        int32_t n = kvmix__span_tokens(cache, seq, layer, &cache->pages[e[j].page], &e[j]), pos;
        uint32_t first = kvmix__slot(cache, e[j].page, 0);
        for (row = 0; row < n; row++)
            positions[k + row] =
                e[j].n_positions == 0 && row < e[j].n_rows ? e[j].first_pos + row : -1;
        for (pos = e[j].first_pos; e[j].n_positions > 0 && pos < kvmix__entry_end(&e[j]); pos++)
            if (slots[pos] - first < (uint32_t)n)
                positions[k + (int32_t)(slots[pos] - first)] = pos;
        k += n;
    }
    *out_n = k;
    return KVMIX_SUCCESS;
}

/* Workspace of a view of n_seqs sequences with these counts: spans, seq_first_span, dead flags,
   each part 8-byte aligned; 0 when that is more than size_t counts. */
static size_t kvmix__decode_workspace_bytes(int64_t n_seqs, int64_t n_spans, int64_t n_dead) {
    double bytes = (double)n_spans * (double)sizeof(kvmix_view_span) +
                   (double)(n_seqs + 1) * (double)sizeof(int32_t) + (double)n_dead + 16.0;
    if (bytes >= (double)(size_t)-1) return 0;
    return kvmix__align8((size_t)n_spans * sizeof(kvmix_view_span)) +
           kvmix__align8(((size_t)n_seqs + 1) * sizeof(int32_t)) + (size_t)n_dead;
}

KVMIXDEF kvmix_result kvmix_cache_ref_decode_workspace(const kvmix_cache *cache,
                                                       const int32_t *seqs, int32_t n_seqs,
                                                       size_t *out_bytes) {
    int32_t n_spans, n_dead;
    size_t bytes;
    kvmix_result r;
    if (!out_bytes) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix_cache_view_counts(cache, seqs, n_seqs, &n_spans, &n_dead)) != KVMIX_SUCCESS)
        return r;
    if ((bytes = kvmix__decode_workspace_bytes(n_seqs, n_spans, n_dead)) == 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    *out_bytes = bytes;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_cache_ref_decode_workspace_max(const kvmix_cache_desc *desc,
                                                           int32_t n_seqs, size_t *out_bytes,
                                                           kvmix_error *out_error) {
    kvmix_cache_desc d;
    int64_t n_spans;
    size_t bytes;
    kvmix__why w;
    if (!desc || !out_bytes)
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, !desc ? "desc" : "out_bytes", "NULL");
    d = *desc;
    if ((w = kvmix__desc_resolve(&d)).result != KVMIX_SUCCESS) return kvmix__report(out_error, w);
    if (n_seqs < 0 || n_seqs > d.max_seqs)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "n_seqs",
                           "must be in 0 .. max_seqs");
    /* a span per page-table entry, and at most a dead flag per row of each */
    n_spans = (int64_t)n_seqs * d.max_pages_per_seq;
    if ((bytes = kvmix__decode_workspace_bytes(n_seqs, n_spans, n_spans * d.page_tokens)) == 0)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "n_seqs",
                           "more workspace than size_t counts");
    *out_bytes = bytes;
    return kvmix__succeed(out_error);
}

/* The checks of a decode over cached sequences (reference or fast) that the view decodes would
   make without saying why. */
static kvmix__why kvmix__cache_decode_ok(const kvmix_cache *cache, const int32_t *seqs,
                                         int32_t n_seqs, int32_t layer, int32_t n_q_heads,
                                         float scale, const float *q, const float *out,
                                         void *workspace) {
    kvmix__why w;
    if (!q || !out || !workspace)
        return kvmix__why_not(KVMIX_ERR_NULL_POINTER,
                              !q     ? "q"
                              : !out ? "out"
                                     : "workspace",
                              "NULL");
    if (cache->desc.device_arena)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "cache",
                              "its arena is device memory (kvmix_cuda_decode reads a view)");
    if (((uintptr_t)workspace & 7u) != 0)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "workspace", "not 8-byte aligned");
    if ((w = kvmix__view_seqs_ok(cache, seqs, n_seqs)).result != KVMIX_SUCCESS) return w;
    if (layer < 0 || layer >= cache->desc.n_layers)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "layer",
                              "must be in 0 .. desc.n_layers - 1");
    if (n_q_heads <= 0 || n_q_heads % cache->desc.n_kv_heads != 0)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "n_q_heads",
                              "must be a positive multiple of desc.n_kv_heads");
    if (!(scale >= 0.0f) || isinf(scale))
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "scale",
                              "must be finite and >= 0 (0 = 1 / sqrt(head_dim))");
    return kvmix__why_ok();
}

/* The view of the sequences' layer laid out at the head of a decode workspace (spans,
   seq_first_span, dead flags: kvmix__decode_workspace_bytes of the counts given). */
static void kvmix__workspace_view(const kvmix_cache *cache, const int32_t *seqs, int32_t n_seqs,
                                  int32_t layer, int32_t n_spans, int32_t n_dead, uint8_t *w,
                                  kvmix_view *view) {
    size_t spans_bytes = kvmix__align8((size_t)n_spans * sizeof(kvmix_view_span));
    size_t first_bytes = kvmix__align8(((size_t)n_seqs + 1) * sizeof(int32_t));
    kvmix_cache_view(cache, seqs, n_seqs, layer, (kvmix_view_span *)(void *)w, n_spans,
                     (int32_t *)(void *)(w + spans_bytes), w + spans_bytes + first_bytes, n_dead,
                     view);
}

static kvmix__why kvmix__ref_decode(const kvmix_cache *cache, const int32_t *seqs, int32_t n_seqs,
                                    int32_t layer, int32_t n_q_heads, float scale, const float *q,
                                    float *out, float *lse, void *workspace,
                                    size_t workspace_bytes) {
    int32_t n_spans, n_dead;
    size_t need;
    uint8_t *w = (uint8_t *)workspace;
    kvmix_view view;
    kvmix__why why;
    why = kvmix__cache_decode_ok(cache, seqs, n_seqs, layer, n_q_heads, scale, q, out, workspace);
    if (why.result != KVMIX_SUCCESS) return why;
    if (kvmix_cache_view_counts(cache, seqs, n_seqs, &n_spans, &n_dead) != KVMIX_SUCCESS)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "seqs", "a view of 2^31 spans or more");
    need = kvmix__decode_workspace_bytes(n_seqs, n_spans, n_dead);
    if (need == 0 || workspace_bytes < need) /* 0: more than any buffer */
        return kvmix__why_not(KVMIX_ERR_BUFFER_TOO_SMALL, "workspace_bytes",
                              "less than kvmix_cache_ref_decode_workspace");
    kvmix__workspace_view(cache, seqs, n_seqs, layer, n_spans, n_dead, w, &view);
    if (kvmix_ref_view_decode(&view, n_q_heads, scale, q, out, lse) != KVMIX_SUCCESS)
        return kvmix__why_not(KVMIX_ERR_CORRUPT_DATA, "arena",
                              "a packed block no seal wrote (kvmix_cache_check)");
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_ref_decode(kvmix_cache *cache, const int32_t *seqs,
                                             int32_t n_seqs, int32_t layer, int32_t n_q_heads,
                                             float scale, const float *q, float *out, float *lse,
                                             void *workspace, size_t workspace_bytes) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__ref_decode(cache, seqs, n_seqs, layer, n_q_heads, scale, q,
                                                  out, lse, workspace, workspace_bytes));
}

/* The fast decode's workspace after the view's: where its part starts. */
static size_t kvmix__cache_fast_offset(int32_t n_seqs, int32_t n_spans, int32_t n_dead) {
    return kvmix__align8(kvmix__decode_workspace_bytes(n_seqs, n_spans, n_dead));
}

/* Tasks of a fast decode of the cache's sequences as they are now (one view span per page-table
   entry, as kvmix_cache_view builds). */
static int64_t kvmix__cache_fast_tasks(const kvmix_cache *cache, const int32_t *seqs,
                                       int32_t n_seqs) {
    int64_t n = 0;
    int32_t i, spans = 0, dead = 0; /* the callers counted these sequences first: it succeeds */
    for (i = 0; i < n_seqs; i++) {
        kvmix_cache_view_counts(cache, &seqs[i], 1, &spans, &dead);
        n += (int64_t)cache->desc.n_kv_heads *
             (spans == 0 ? 1 : (spans + KVMIX_DECODE_CHUNK_SPANS - 1) / KVMIX_DECODE_CHUNK_SPANS);
    }
    return n;
}

KVMIXDEF kvmix_result kvmix_cache_decode_workspace(const kvmix_cache *cache, const int32_t *seqs,
                                                   int32_t n_seqs, int32_t n_q_heads,
                                                   size_t *out_bytes) {
    int32_t n_spans, n_dead;
    size_t fast;
    kvmix_result r;
    if (!out_bytes) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix_cache_view_counts(cache, seqs, n_seqs, &n_spans, &n_dead)) != KVMIX_SUCCESS)
        return r;
    if (n_q_heads <= 0 || n_q_heads % cache->desc.n_kv_heads != 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    fast = kvmix__fast_workspace_bytes(n_seqs, kvmix__cache_fast_tasks(cache, seqs, n_seqs),
                                       cache->desc.head_dim, n_q_heads / cache->desc.n_kv_heads);
    if (kvmix__decode_workspace_bytes(n_seqs, n_spans, n_dead) == 0 || fast == 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    *out_bytes = kvmix__cache_fast_offset(n_seqs, n_spans, n_dead) + fast;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_cache_decode_workspace_max(const kvmix_cache_desc *desc, int32_t n_seqs,
                                                       int32_t n_q_heads, size_t *out_bytes,
                                                       kvmix_error *out_error) {
    kvmix_cache_desc d;
    int64_t n_spans, chunks;
    size_t view, fast;
    kvmix__why w;
    if (!desc || !out_bytes)
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, !desc ? "desc" : "out_bytes", "NULL");
    d = *desc;
    if ((w = kvmix__desc_resolve(&d)).result != KVMIX_SUCCESS) return kvmix__report(out_error, w);
    if (n_seqs < 0 || n_seqs > d.max_seqs)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "n_seqs",
                           "must be in 0 .. max_seqs");
    if (n_q_heads <= 0 || n_q_heads % d.n_kv_heads != 0)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "n_q_heads",
                           "must be a positive multiple of desc.n_kv_heads");
    n_spans = (int64_t)n_seqs * d.max_pages_per_seq;
    chunks = (d.max_pages_per_seq + KVMIX_DECODE_CHUNK_SPANS - 1) / KVMIX_DECODE_CHUNK_SPANS;
    view = kvmix__decode_workspace_bytes(n_seqs, n_spans, n_spans * d.page_tokens);
    fast =
        kvmix__fast_workspace_bytes(n_seqs, (int64_t)n_seqs * d.n_kv_heads * (chunks ? chunks : 1),
                                    d.head_dim, n_q_heads / d.n_kv_heads);
    if (view == 0 || fast == 0 || kvmix__align8(view) + fast < fast)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "n_seqs",
                           "more workspace than size_t counts");
    *out_bytes = kvmix__align8(view) + fast;
    return kvmix__succeed(out_error);
}

static kvmix__why kvmix__fast_decode(const kvmix_cache *cache, const int32_t *seqs, int32_t n_seqs,
                                     int32_t layer, int32_t n_q_heads, float scale, const float *q,
                                     float *out, float *lse, void *workspace,
                                     size_t workspace_bytes, const kvmix_parallel *parallel) {
    int32_t n_spans, n_dead;
    size_t need, offset;
    uint8_t *w = (uint8_t *)workspace;
    kvmix_view view;
    kvmix__why why;
    why = kvmix__cache_decode_ok(cache, seqs, n_seqs, layer, n_q_heads, scale, q, out, workspace);
    if (why.result != KVMIX_SUCCESS) return why;
    if (parallel && parallel->n_threads < 0)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "parallel", "n_threads is negative");
    if (kvmix_cache_decode_workspace(cache, seqs, n_seqs, n_q_heads, &need) != KVMIX_SUCCESS)
        return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, "seqs",
                              "more workspace than size_t counts");
    if (workspace_bytes < need)
        return kvmix__why_not(KVMIX_ERR_BUFFER_TOO_SMALL, "workspace_bytes",
                              "less than kvmix_cache_decode_workspace");
    kvmix_cache_view_counts(cache, seqs, n_seqs, &n_spans, &n_dead);
    offset = kvmix__cache_fast_offset(n_seqs, n_spans, n_dead);
    kvmix__workspace_view(cache, seqs, n_seqs, layer, n_spans, n_dead, w, &view);
    if (kvmix_view_decode(&view, n_q_heads, scale, q, out, lse, w + offset,
                          workspace_bytes - offset, parallel) != KVMIX_SUCCESS)
        return kvmix__why_not(KVMIX_ERR_CORRUPT_DATA, "arena",
                              "a view that does not check (kvmix_cache_check)");
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_cache_decode(kvmix_cache *cache, const int32_t *seqs, int32_t n_seqs,
                                         int32_t layer, int32_t n_q_heads, float scale,
                                         const float *q, float *out, float *lse, void *workspace,
                                         size_t workspace_bytes, const kvmix_parallel *parallel) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix__record(cache, kvmix__fast_decode(cache, seqs, n_seqs, layer, n_q_heads, scale, q,
                                                   out, lse, workspace, workspace_bytes, parallel));
}

/* ---- accounting ----------------------------------------------------------------------------- */

static void kvmix__page_format_bytes(const kvmix_cache *c, const kvmix_cache_page *p,
                                     size_t *format_bytes) {
    kvmix__geom g = kvmix__geom_of(c, p);
    size_t blocks = (size_t)c->desc.n_layers * (size_t)c->desc.n_kv_heads;
    format_bytes[p->key_format] += blocks * g.key_bytes;
    format_bytes[p->value_format] += blocks * g.value_bytes;
    format_bytes[0] += (size_t)p->n_granules * c->desc.granule_bytes - g.total_bytes;
}

static double kvmix__elements(const kvmix_cache *c, int64_t n_live) {
    return (double)n_live * c->desc.n_layers * c->desc.n_kv_heads * c->desc.head_dim * 2.0;
}

KVMIXDEF kvmix_result kvmix_cache_page_bits(const kvmix_cache *cache,
                                            kvmix_cache_precision precision, int32_t rows,
                                            double *out_bits) {
    kvmix__geom g;
    int32_t held;
    if (!cache || !out_bits) return KVMIX_ERR_NULL_POINTER;
    if (!kvmix__precision_known(precision)) return KVMIX_ERR_UNKNOWN_FORMAT;
    if (rows < 1 || rows > cache->desc.page_tokens) return KVMIX_ERR_INVALID_ARGUMENT;
    precision = kvmix__precision_or_default(cache, precision);
    if (!kvmix__boost_ok(&cache->desc, precision)) return KVMIX_ERR_BAD_SHAPE;
    held = rows == cache->desc.page_tokens ? rows : (rows + 7) / 8 * 8; /* as a closed page */
    g = kvmix__page_geom(cache, precision.key_format, precision.value_format, held, held);
    *out_bits = (double)kvmix__granules_of(cache, g.total_bytes) *
                (double)cache->desc.granule_bytes * 8.0 / kvmix__elements(cache, rows);
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_cache_precision_bits(const kvmix_cache *cache,
                                                 kvmix_cache_precision precision,
                                                 double *out_bits) {
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    return kvmix_cache_page_bits(cache, precision, cache->desc.page_tokens, out_bits);
}

KVMIXDEF kvmix_result kvmix_cache_stats_get(const kvmix_cache *cache, kvmix_cache_stats *out) {
    kvmix_cache_stats st;
    int64_t i, run = 0, best = 0;
    int32_t s;
    double elements;
    if (!cache || !out) return KVMIX_ERR_NULL_POINTER;
    if (!cache->seqs) return KVMIX_ERR_INVALID_ARGUMENT;
    memset(&st, 0, sizeof st);
    st.arena_bytes = (size_t)cache->priv.n_granules * cache->desc.granule_bytes;
    st.arena_free_bytes = (size_t)cache->priv.n_free_granules * cache->desc.granule_bytes;
    st.arena_used_bytes = st.arena_bytes - st.arena_free_bytes;
    st.metadata_bytes = cache->priv.memory_bytes;
    for (i = 0; i < cache->priv.n_granules; i++) {
        run = kvmix__granule_used(cache->priv.bitmap, i) ? 0 : run + 1;
        if (run > best) best = run;
    }
    st.largest_free_bytes = (size_t)best * cache->desc.granule_bytes;
    for (i = 1; i < cache->max_pages; i++) {
        const kvmix_cache_page *p = &cache->pages[i];
        if (p->refcount == 0) continue;
        st.n_pages++;
        if (p->refcount > 1) st.n_shared_pages++;
        if (!p->sealed) st.n_buffer_pages++;
        kvmix__page_format_bytes(cache, p, st.format_bytes);
    }
    for (s = 0; s < cache->desc.max_seqs; s++) {
        if (!cache->seqs[s].in_use) continue;
        st.n_seqs++;
        st.n_tokens += cache->seqs[s].n_tokens;
        st.n_live_tokens += cache->seqs[s].n_live;
    }
    elements = kvmix__elements(cache, st.n_live_tokens);
    if (elements > 0) {
        st.arena_bits_per_element = (double)st.arena_used_bytes * 8.0 / elements;
        st.bits_per_element =
            ((double)st.arena_used_bytes + (double)st.metadata_bytes) * 8.0 / elements;
    }
    *out = st;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_cache_seq_stats_get(const kvmix_cache *cache, int32_t seq,
                                                kvmix_cache_seq_stats *out) {
    kvmix_cache_seq_stats st;
    const kvmix_cache_entry *e;
    const uint32_t *slots;
    kvmix_result r;
    int32_t j, live;
    double elements;
    if (!cache || !out) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__cache_seq_ok(cache, seq).result) != KVMIX_SUCCESS) return r;
    memset(&st, 0, sizeof st);
    e = kvmix__seq_entries(cache, seq);
    slots = kvmix__seq_slots(cache, seq);
    st.n_tokens = cache->seqs[seq].n_tokens;
    st.n_live_tokens = cache->seqs[seq].n_live;
    st.metadata_bytes = (size_t)cache->desc.max_tokens_per_seq * sizeof(uint32_t) +
                        (size_t)cache->desc.max_pages_per_seq * sizeof(kvmix_cache_entry) +
                        sizeof(kvmix_cache_seq);
    st.attributed_bytes = (double)st.metadata_bytes;
    for (j = 0; j < cache->seqs[seq].n_entries; j++) {
        const kvmix_cache_page *p = &cache->pages[e[j].page];
        size_t bytes = (size_t)p->n_granules * cache->desc.granule_bytes;
        st.n_pages++;
        if (p->refcount > 1) st.n_shared_pages++;
        st.referenced_bytes += bytes;
        st.attributed_bytes += (double)bytes / (double)p->refcount;
        kvmix__page_format_bytes(cache, p, st.format_bytes);
        live = kvmix__entry_rows_live(cache, slots, &e[j], p->n_rows, NULL);
        if (p->key_format == KVMIX_FORMAT_FP16) st.n_fp16_key_rows += live;
        if (p->value_format == KVMIX_FORMAT_FP16) st.n_fp16_value_rows += live;
        if (p->key_format == KVMIX_FORMAT_FP16 && p->value_format == KVMIX_FORMAT_FP16)
            st.n_fp16_rows += live;
        if (p->sealed && !p->sink) {
            st.n_packed_rows += live;
            st.packed_bytes += (double)bytes / (double)p->refcount;
        }
    }
    elements = kvmix__elements(cache, st.n_live_tokens);
    if (elements > 0) st.bits_per_element = st.attributed_bytes * 8.0 / elements;
    elements = kvmix__elements(cache, st.n_packed_rows);
    if (elements > 0) st.packed_bits_per_element = st.packed_bytes * 8.0 / elements;
    *out = st;
    return KVMIX_SUCCESS;
}

/* ---- invariants ----------------------------------------------------------------------------- */

/* Source rows of a QUANTIZE job as floats, or 0 when one is not finite FP16. */
static int kvmix__job_rows(const uint16_t *src, int64_t stride, const kvmix_quantize_job *j,
                           int32_t head_dim, float *out) {
    int32_t r, c;
    for (r = 0; r < j->n_rows; r++)
        for (c = 0; c < head_dim; c++) {
            uint16_t h = src[j->src_offset + (uint64_t)r * (uint64_t)stride + (uint64_t)c];
            if (!kvmix__fp16_finite(h)) return 0;
            out[(size_t)r * (size_t)head_dim + (size_t)c] = kvmix__h2f(h);
        }
    return 1;
}

/* One QUANTIZE job: rows into an FP16 or per-token block, or a whole per-channel block. */
static int kvmix__run_quantize_job(const kvmix_layout *l, const uint16_t *src, int64_t stride,
                                   const kvmix_quantize_job *j, uint8_t *arena, float *rows) {
    kvmix__sections s = kvmix__layout_sections(l);
    uint8_t *block = arena + j->dst_offset;
    int32_t r;
    int whole = l->format == KVMIX_FORMAT_INT2_CHANNEL || l->format == KVMIX_FORMAT_BOOSTED;
    if (j->first_row < 0 || j->n_rows < 1 || j->n_rows > l->n_tokens - j->first_row ||
        (whole && j->n_rows != l->n_tokens))
        return 0;
    if (!kvmix__job_rows(src, stride, j, l->head_dim, rows)) return 0;
    if (whole) {
        memset(block, 0, s.total_bytes);
        kvmix__quantize_per_channel(l, rows, l->head_dim, block);
        return 1;
    }
    for (r = 0; r < j->n_rows; r++) {
        memset(block + (size_t)(j->first_row + r) * s.row_bytes, 0, s.row_bytes);
        kvmix__quantize_row(l, &s, rows + (size_t)r * (size_t)l->head_dim, block, j->first_row + r);
    }
    return 1;
}

/* One DEQUANTIZE job: block rows to FP16 rows, or 0 when its rows are not in the block. */
static int kvmix__run_dequantize_job(const kvmix_layout *l, const kvmix_quantize_job *j,
                                     uint8_t *arena, float *row) {
    kvmix__sections s = kvmix__layout_sections(l);
    uint8_t *out = arena + j->dst_offset;
    int32_t r, c;
    if (j->first_row < 0 || j->n_rows < 1 || j->n_rows > l->n_tokens - j->first_row) return 0;
    for (r = 0; r < j->n_rows; r++) {
        kvmix__decode_row(l, &s, arena + j->src_offset, j->first_row + r, row);
        for (c = 0; c < l->head_dim; c++)
            kvmix__store_u16(out + ((size_t)r * (size_t)l->head_dim + (size_t)c) * 2,
                             kvmix__f2h(row[c]));
    }
    return 1;
}

/* The FP16 rows a QUANTIZE batch reads: key rows, value rows or the arena. */
static const uint16_t *kvmix__batch_source(const kvmix_cache_batch *b, const uint16_t *key_rows,
                                           const uint16_t *value_rows, const uint8_t *arena) {
    if (b->source == KVMIX_CACHE_SOURCE_KEYS) return key_rows;
    if (b->source == KVMIX_CACHE_SOURCE_VALUES) return value_rows;
    return (const uint16_t *)(const void *)arena;
}

/* Checks every batch before any runs; *max_rows: the most rows a QUANTIZE block holds. */
static kvmix_result kvmix__batches_ok(const kvmix_cache_batch *batches, int32_t n_batches,
                                      const uint16_t *key_rows, const uint16_t *value_rows,
                                      const uint8_t *arena, size_t *max_floats) {
    int32_t b;
    *max_floats = 1;
    for (b = 0; b < n_batches; b++) {
        const kvmix_cache_batch *batch = &batches[b];
        kvmix_layout l = batch->layout;
        int quantize = batch->kind == KVMIX_CACHE_BATCH_QUANTIZE;
        if (batch->n_jobs < 0 || batch->first_job < 0 ||
            (batch->kind != KVMIX_CACHE_BATCH_COPY && !quantize &&
             batch->kind != KVMIX_CACHE_BATCH_DEQUANTIZE))
            return KVMIX_ERR_INVALID_ARGUMENT;
        if (batch->kind == KVMIX_CACHE_BATCH_COPY) continue;
        if (quantize && !kvmix__batch_source(batch, key_rows, value_rows, arena))
            return KVMIX_ERR_NULL_POINTER;
        if (kvmix_layout_resolve(&l, NULL) != KVMIX_SUCCESS ||
            (quantize && batch->src_row_stride < l.head_dim))
            return KVMIX_ERR_INVALID_ARGUMENT;
        if ((size_t)l.n_tokens * (size_t)l.head_dim > *max_floats)
            *max_floats = (size_t)l.n_tokens * (size_t)l.head_dim;
    }
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_ref_cache_run(const kvmix_cache_batch *batches, int32_t n_batches,
                                          const kvmix_quantize_job *jobs, const uint16_t *key_rows,
                                          const uint16_t *value_rows, uint8_t *arena,
                                          int32_t *out_bad_jobs) {
    float *rows;
    size_t max_floats;
    int32_t b, i, bad = 0;
    kvmix_result r;
    if (n_batches < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    if (n_batches > 0 && (!batches || !jobs || !arena)) return KVMIX_ERR_NULL_POINTER;
    r = kvmix__batches_ok(batches, n_batches, key_rows, value_rows, arena, &max_floats);
    if (r != KVMIX_SUCCESS) return r;
    rows = (float *)KVMIX_MALLOC(max_floats * sizeof(float));
    if (!rows) return KVMIX_ERR_OUT_OF_MEMORY;
    for (b = 0; b < n_batches; b++) {
        const kvmix_cache_batch *batch = &batches[b];
        const uint16_t *src = kvmix__batch_source(batch, key_rows, value_rows, arena);
        kvmix_layout l = batch->layout;
        kvmix_layout_resolve(&l, NULL);
        for (i = 0; i < batch->n_jobs; i++) {
            const kvmix_quantize_job *j = &jobs[batch->first_job + i];
            if (batch->kind == KVMIX_CACHE_BATCH_COPY)
                memmove(arena + j->dst_offset, arena + j->src_offset, (size_t)j->n_rows);
            else if (batch->kind == KVMIX_CACHE_BATCH_DEQUANTIZE)
                bad += !kvmix__run_dequantize_job(&l, j, arena, rows);
            else
                bad += !kvmix__run_quantize_job(&l, src, batch->src_row_stride, j, arena, rows);
        }
    }
    KVMIX_FREE(rows);
    if (out_bad_jobs) *out_bad_jobs = bad;
    return KVMIX_SUCCESS;
}

/* Whether a released descriptor of a device arena waits for the take. */
static int kvmix__page_held(const kvmix_cache *c, uint32_t id) {
    int32_t i;
    for (i = 0; i < c->priv.n_retired_pages; i++)
        if (c->priv.retired_pages[i] == id) return 1;
    return 0;
}

KVMIXDEF kvmix_result kvmix_cache_check(const kvmix_cache *cache) {
    const kvmix_cache_desc *d;
    int64_t used = 0, bits = 0, i;
    int32_t s, j, k, n_live_pages = 0;
    if (!cache) return KVMIX_ERR_NULL_POINTER;
    if (!cache->seqs) return KVMIX_ERR_INVALID_ARGUMENT;
    d = &cache->desc;
    if (cache->pages[0].refcount != 1 || cache->pages[0].n_granules != 0)
        return KVMIX_ERR_CORRUPT_DATA;
    /* descriptors: reference counts, arena extents */
    for (i = 1; i < cache->max_pages; i++) {
        const kvmix_cache_page *p = &cache->pages[i];
        int64_t refs = 0, start, g;
        if (p->refcount == 0) {
            if (p->n_granules != 0 && !kvmix__page_held(cache, (uint32_t)i))
                return KVMIX_ERR_CORRUPT_DATA;
            used += p->n_granules; /* a device arena's released page, until the take */
            continue;
        }
        n_live_pages++;
        for (s = 0; s < d->max_seqs; s++) {
            const kvmix_cache_entry *e = kvmix__seq_entries(cache, s);
            if (!cache->seqs[s].in_use) continue;
            for (j = 0; j < cache->seqs[s].n_entries; j++) refs += e[j].page == (uint32_t)i;
        }
        if (refs != p->refcount) return KVMIX_ERR_CORRUPT_DATA;
        if (p->offset % d->granule_bytes != 0 || p->n_granules == 0 ||
            kvmix__geom_of(cache, p).total_bytes > (size_t)p->n_granules * d->granule_bytes ||
            p->n_rows < 0 || p->n_rows > p->capacity || p->capacity > d->page_tokens)
            return KVMIX_ERR_CORRUPT_DATA;
        start = (int64_t)(p->offset / d->granule_bytes);
        if (start + (int64_t)p->n_granules > cache->priv.n_granules) return KVMIX_ERR_CORRUPT_DATA;
        for (g = start; g < start + (int64_t)p->n_granules; g++)
            if (!kvmix__granule_used(cache->priv.bitmap, g)) return KVMIX_ERR_CORRUPT_DATA;
        used += p->n_granules;
    }
    for (j = 0; j < cache->priv.n_retired_runs; j++)
        used += ((const kvmix__run *)cache->priv.retired_runs)[j].n;
    for (i = 0; i < cache->priv.n_granules; i++) bits += kvmix__granule_used(cache->priv.bitmap, i);
    for (i = 0; i < cache->priv.n_granules; i++)
        if (!kvmix__granule_used(cache->priv.bitmap, i) &&
            (i < cache->priv.hints.first_free || i >= cache->priv.hints.last_free_end))
            return KVMIX_ERR_CORRUPT_DATA; /* a search would miss it */
    /* disjoint extents: each page's granules are set and their sum is the set bits */
    if (bits != used || cache->priv.n_granules - cache->priv.n_free_granules != used)
        return KVMIX_ERR_CORRUPT_DATA;
    /* the free stack holds exactly the free descriptors, once each */
    if (cache->priv.n_free_pages + n_live_pages + cache->priv.n_retired_pages !=
        cache->max_pages - 1)
        return KVMIX_ERR_CORRUPT_DATA;
    for (j = 0; j < cache->priv.n_free_pages; j++) {
        uint32_t id = cache->priv.free_pages[j];
        if (id == 0 || id >= (uint32_t)cache->max_pages || cache->pages[id].refcount != 0)
            return KVMIX_ERR_CORRUPT_DATA;
        for (k = 0; k < j; k++)
            if (cache->priv.free_pages[k] == id) return KVMIX_ERR_CORRUPT_DATA;
    }
    /* sequences: ordered entries, slot maps that point into their own entries */
    for (s = 0; s < d->max_seqs; s++) {
        const kvmix_cache_seq *q = &cache->seqs[s];
        const kvmix_cache_entry *e = kvmix__seq_entries(cache, s);
        const uint32_t *slots = kvmix__seq_slots(cache, s);
        const int32_t *written = kvmix__seq_written(cache, s);
        int32_t pos, live = 0, end = 0, least = 0x7fffffff, layer;
        if (!q->in_use) {
            for (layer = 0; layer < d->n_layers; layer++)
                if (written[layer] != 0) return KVMIX_ERR_CORRUPT_DATA;
            continue;
        }
        if (q->n_entries < 0 || q->n_entries > d->max_pages_per_seq || q->n_tokens < 0 ||
            q->n_tokens > d->max_tokens_per_seq)
            return KVMIX_ERR_CORRUPT_DATA;
        /* written counts: at most the reserved positions, n_written their minimum */
        for (layer = 0; layer < d->n_layers; layer++) {
            if (written[layer] < 0 || written[layer] > q->n_tokens) return KVMIX_ERR_CORRUPT_DATA;
            if (written[layer] < least) least = written[layer];
        }
        if (least != q->n_written) return KVMIX_ERR_CORRUPT_DATA;
        for (j = 0; j < q->n_entries; j++) {
            const kvmix_cache_page *p = &cache->pages[e[j].page];
            if (e[j].page == 0 || e[j].page >= (uint32_t)cache->max_pages || p->refcount <= 0 ||
                e[j].first_pos < end || e[j].n_rows <= 0 || e[j].n_positions < 0 ||
                kvmix__entry_end(&e[j]) > q->n_tokens || e[j].n_rows > p->n_rows ||
                (p->sealed && kvmix__entry_end(&e[j]) > q->n_written) ||
                (e[j].n_positions > 0 && !p->sealed))
                return KVMIX_ERR_CORRUPT_DATA; /* sealed pages hold written rows only */
            end = kvmix__entry_end(&e[j]);
        }
        for (pos = 0; pos < q->n_tokens; pos++) {
            const kvmix_cache_entry *hit;
            uint32_t slot = slots[pos];
            if (slot == KVMIX_CACHE_DEAD_SLOT) continue;
            live++;
            hit = kvmix__entry_at(cache, s, pos);
            if (!hit ||
                (hit->n_positions == 0 &&
                 slot != kvmix__slot(cache, hit->page, pos - hit->first_pos)) ||
                (hit->n_positions > 0 &&
                 slot - kvmix__slot(cache, hit->page, 0) >= (uint32_t)hit->n_rows))
                return KVMIX_ERR_CORRUPT_DATA;
        }
        if (live != q->n_live) return KVMIX_ERR_CORRUPT_DATA;
    }
    return KVMIX_SUCCESS;
}

// >>transfer
/*
   Transfer payload, version 1. Little-endian; offsets from the payload's first byte.

   header (KVMIX_PAYLOAD_HEADER_BYTES = 80 bytes):
      0 magic "KVMP"          4 u16 version (1)      6 u16 kind (kvmix_payload_kind)
      8 u32 head_dim         12 u32 n_kv_heads      16 u32 group_size
     20 u32 first_layer      24 u32 n_layers        28 u32 n_tokens
     32 i64 first_position   40 u64 id              48 u64 base_id
     56 u32 n_fp16           60 u32 n_int8          64 u32 n_int4
     68 u32 reserved (0)     72 u64 total_bytes
   tier table at 80: n_tokens bytes (token t's tier: a kvmix_format value FP16, INT8 or INT4, or
     KVMIX_PAYLOAD_NO_ROW in a RESIDUAL payload), then zeros up to a multiple of 16 bytes;
     head_bytes = 80 + round_up(n_tokens, 16).
   body at head_bytes: for each layer in order, keys then values, for each kv head, for each tier
     in the order FP16, INT8, INT4: one block in that tier's >>formats layout (n = the tier's token
     count, head_dim, group_size) whose row r is the r-th token at that tier in position order,
     then zeros up to a multiple of 16 bytes. A tier with no tokens takes no bytes.
   Every block's offset follows from the header alone: with tier_bytes(i) = round_up(block bytes
   of tier i, 16) and slice = the sum of the three, block (layer l, kv (0 keys, 1 values), head h,
   tier i) starts at head_bytes + ((l * 2 + kv) * n_kv_heads + h) * slice + the tier_bytes of
   the tiers before i; total_bytes = head_bytes + n_layers * 2 * n_kv_heads * slice.
   Layer l of the body is absolute layer first_layer + l.
*/

/* 0, 1, 2 for the FP16, INT8, INT4 tiers; -1 for anything else (NO_ROW included). */
static int kvmix__tier_index(uint8_t tier) {
    int i;
    for (i = 0; i < 3; i++)
        if (tier == (uint8_t)kvmix__tier_format(i)) return i;
    return -1;
}

static int kvmix__tier_allowed(kvmix_payload_kind kind, uint8_t tier) {
    return kvmix__tier_index(tier) >= 0 ||
           (kind == KVMIX_PAYLOAD_RESIDUAL && tier == KVMIX_PAYLOAD_NO_ROW);
}

/* The layout of tier i's block in a payload of this shape. */
static kvmix_layout kvmix__tier_layout(const kvmix_payload_info *info, int i) {
    kvmix_layout l;
    l.format = (kvmix_format)kvmix__tier_format(i);
    l.n_tokens = kvmix__tier_count(info, i);
    l.head_dim = info->desc.head_dim;
    l.group_size = i == 0 ? 0 : info->desc.group_size; /* FP16 has no groups */
    l.n_boost = 0;
    return l;
}

/* The three tier blocks of one slice (layer index within the payload, kv, head). */
typedef struct kvmix__tier_blocks {
    kvmix_layout layout[3];
    kvmix__sections sections[3];
    size_t offset[3]; /* from the payload's first byte */
} kvmix__tier_blocks;

static kvmix__tier_blocks kvmix__payload_blocks(const kvmix_payload_info *info, int32_t layer,
                                                int kv, int32_t head) {
    kvmix__tier_blocks b;
    uint64_t off =
        info->head_bytes +
        (((uint64_t)layer * 2u + (uint64_t)kv) * (uint64_t)info->desc.n_kv_heads + (uint64_t)head) *
            kvmix__payload_slice(info);
    int i;
    for (i = 0; i < 3; i++) {
        b.layout[i] = kvmix__tier_layout(info, i);
        b.sections[i] = kvmix__layout_sections(&b.layout[i]);
        b.offset[i] = (size_t)off;
        off += kvmix__round16((uint64_t)b.sections[i].total_bytes);
    }
    return b;
}

/* Why kvmix__payload_sizes refused a payload (BAD_SHAPE: its bytes do not fit). */
#define KVMIX__PAYLOAD_TOO_BIG "with n_kv_heads, head_dim and n_tokens: beyond 2^62 bytes or size_t"

KVMIXDEF kvmix_result kvmix_payload_describe(const kvmix_payload_desc *desc, const uint8_t *tiers,
                                             kvmix_payload_info *out_info, kvmix_error *out_error) {
    const kvmix_result null = KVMIX_ERR_NULL_POINTER;
    kvmix_payload_info info;
    int32_t counts[3] = {0, 0, 0}, t;
    kvmix_result r;
    kvmix__why w;
    if (!desc) return kvmix__fail(out_error, null, "desc", "NULL");
    if (!out_info) return kvmix__fail(out_error, null, "out_info", "NULL");
    if (!tiers && desc->n_tokens > 0) return kvmix__fail(out_error, null, "tiers", "NULL");
    memset(&info, 0, sizeof info);
    info.desc = *desc;
    if ((w = kvmix__payload_desc_why(&info.desc)).result != KVMIX_SUCCESS)
        return kvmix__fail(out_error, w.result, w.argument, w.reason);
    for (t = 0; t < info.desc.n_tokens; t++) {
        if (!kvmix__tier_allowed(info.desc.kind, tiers[t]))
            return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "tiers",
                               "a tier not FP16, INT8 or INT4 (or NO_ROW, RESIDUAL only)");
        if (kvmix__tier_index(tiers[t]) >= 0) counts[kvmix__tier_index(tiers[t])]++;
    }
    info.n_fp16 = counts[0];
    info.n_int8 = counts[1];
    info.n_int4 = counts[2];
    if ((r = kvmix__payload_sizes(&info)) != KVMIX_SUCCESS)
        return kvmix__fail(out_error, r, "n_layers", KVMIX__PAYLOAD_TOO_BIG);
    *out_info = info;
    return kvmix__succeed(out_error);
}

KVMIXDEF kvmix_result kvmix_payload_write_head(const kvmix_payload_info *info, const uint8_t *tiers,
                                               void *dst, size_t dst_bytes,
                                               kvmix_error *out_error) {
    kvmix_payload_info check;
    const kvmix_payload_desc *d;
    uint8_t *p = (uint8_t *)dst;
    kvmix_result r;
    if (!info || !dst)
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, !info ? "info" : "dst", "NULL");
    if ((r = kvmix_payload_describe(&info->desc, tiers, &check, out_error)) != KVMIX_SUCCESS)
        return r;
    if (memcmp(&check.desc, &info->desc, sizeof check.desc) != 0 || check.n_fp16 != info->n_fp16 ||
        check.n_int8 != info->n_int8 || check.n_int4 != info->n_int4 ||
        check.head_bytes != info->head_bytes || check.total_bytes != info->total_bytes)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "info",
                           "not what kvmix_payload_describe gives for these tiers");
    if (dst_bytes < info->head_bytes)
        return kvmix__fail(out_error, KVMIX_ERR_BUFFER_TOO_SMALL, "dst_bytes",
                           "less than info->head_bytes");
    d = &info->desc;
    memset(p, 0, info->head_bytes);
    kvmix__payload_header_put(info, p);
    if (d->n_tokens > 0) memcpy(p + KVMIX_PAYLOAD_HEADER_BYTES, tiers, (size_t)d->n_tokens);
    return kvmix__succeed(out_error);
}

/* Rows of layer l, kind kv of a [n_layers][n_tokens][n_kv_heads][head_dim] array. */
static const float *kvmix__payload_rows(const kvmix_payload_info *info, const float *rows,
                                        int32_t layer) {
    return rows + (size_t)layer * (size_t)info->desc.n_tokens * (size_t)info->desc.n_kv_heads *
                      (size_t)info->desc.head_dim;
}

KVMIXDEF kvmix_result kvmix_payload_pack(const kvmix_payload_desc *desc, const uint8_t *tiers,
                                         const float *keys, const float *values, void *dst,
                                         size_t dst_bytes, size_t *out_bytes,
                                         kvmix_error *out_error) {
    const kvmix_result null = KVMIX_ERR_NULL_POINTER;
    kvmix_payload_info info;
    kvmix_result r;
    const size_t row_floats = desc ? (size_t)desc->n_kv_heads * (size_t)desc->head_dim : 0;
    int32_t layer, kv, h, t, c;
    if ((r = kvmix_payload_describe(desc, tiers, &info, out_error)) != KVMIX_SUCCESS) return r;
    if (!dst) return kvmix__fail(out_error, null, "dst", "NULL");
    if (info.n_fp16 + info.n_int8 + info.n_int4 > 0 && (!keys || !values))
        return kvmix__fail(out_error, null, !keys ? "keys" : "values", "NULL with rows to send");
    if (dst_bytes < info.total_bytes)
        return kvmix__fail(out_error, KVMIX_ERR_BUFFER_TOO_SMALL, "dst_bytes",
                           "less than the payload's total_bytes");
    for (layer = 0; layer < info.desc.n_layers; layer++)
        for (kv = 0; kv < 2; kv++) {
            const float *rows = kvmix__payload_rows(&info, kv ? values : keys, layer);
            for (t = 0; t < info.desc.n_tokens; t++) {
                if (kvmix__tier_index(tiers[t]) < 0) continue;
                for (c = 0; c < (int32_t)row_floats; c++)
                    if (!kvmix__representable(rows[(size_t)t * row_floats + (size_t)c]))
                        return kvmix__fail(out_error, KVMIX_ERR_BAD_VALUE, kv ? "values" : "keys",
                                           "a value not finite or beyond FP16's +-65504");
            }
        }
    kvmix_payload_write_head(&info, tiers, dst, dst_bytes, NULL);
    memset((uint8_t *)dst + info.head_bytes, 0, info.total_bytes - info.head_bytes);
    for (layer = 0; layer < info.desc.n_layers; layer++)
        for (kv = 0; kv < 2; kv++)
            for (h = 0; h < info.desc.n_kv_heads; h++) {
                const float *rows = kvmix__payload_rows(&info, kv ? values : keys, layer);
                kvmix__tier_blocks b = kvmix__payload_blocks(&info, layer, kv, h);
                int32_t rank[3] = {0, 0, 0};
                for (t = 0; t < info.desc.n_tokens; t++) {
                    int i = kvmix__tier_index(tiers[t]);
                    if (i < 0) continue;
                    kvmix__quantize_row(&b.layout[i], &b.sections[i],
                                        rows + (size_t)t * row_floats +
                                            (size_t)h * (size_t)info.desc.head_dim,
                                        (uint8_t *)dst + b.offset[i], rank[i]++);
                }
            }
    if (out_bytes) *out_bytes = info.total_bytes;
    return kvmix__succeed(out_error);
}

/* A u32 header field that must fit an int32_t. */
static int kvmix__field_i32(const uint8_t *p, int32_t *out) {
    uint32_t v = kvmix__load_u32(p);
    if (v > 0x7fffffffu) return 0;
    *out = (int32_t)v;
    return 1;
}

/* The header's u32 fields that must fit an int32_t, into d and counts [n_fp16, n_int8, n_int4];
   one that does not is named as the >>transfer layout spells it. */
static kvmix__why kvmix__payload_head_ints(const uint8_t *p, kvmix_payload_desc *d,
                                           int32_t counts[3]) {
    static const int at[9] = {8, 12, 16, 20, 24, 28, 56, 60, 64};
    static const char *const name[9] = {"head_dim",    "n_kv_heads", "group_size",
                                        "first_layer", "n_layers",   "n_tokens",
                                        "n_fp16",      "n_int8",     "n_int4"};
    int32_t *field[9];
    int i;
    field[0] = &d->head_dim, field[1] = &d->n_kv_heads, field[2] = &d->group_size;
    field[3] = &d->first_layer, field[4] = &d->n_layers, field[5] = &d->n_tokens;
    field[6] = &counts[0], field[7] = &counts[1], field[8] = &counts[2];
    for (i = 0; i < 9; i++)
        if (!kvmix__field_i32(p + at[i], field[i]))
            return kvmix__why_not(KVMIX_ERR_INVALID_ARGUMENT, name[i], "beyond int32_t");
    return kvmix__why_ok();
}

/* The tier table of a head whose header is checked: tiers the kind allows, as many at each tier
   as the header counts, zero padding up to head_bytes. */
static kvmix__why kvmix__payload_table_why(const uint8_t *p, const kvmix_payload_info *info) {
    const kvmix_result malformed = KVMIX_ERR_MALFORMED;
    int32_t counts[3] = {0, 0, 0}, t;
    size_t i;
    for (t = 0; t < info->desc.n_tokens; t++) {
        uint8_t tier = p[KVMIX_PAYLOAD_HEADER_BYTES + t];
        if (!kvmix__tier_allowed(info->desc.kind, tier))
            return kvmix__why_not(malformed, "tiers", "a tier the kind does not allow");
        if (kvmix__tier_index(tier) >= 0) counts[kvmix__tier_index(tier)]++;
    }
    if (counts[0] != info->n_fp16 || counts[1] != info->n_int8 || counts[2] != info->n_int4)
        return kvmix__why_not(malformed, "tiers", "disagrees with n_fp16, n_int8 and n_int4");
    for (i = KVMIX_PAYLOAD_HEADER_BYTES + (size_t)info->desc.n_tokens; i < info->head_bytes; i++)
        if (p[i] != 0) return kvmix__why_not(malformed, "tiers", "padding after it not zero");
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_payload_read_head(const void *src, size_t src_bytes,
                                              kvmix_payload_info *out_info,
                                              const uint8_t **out_tiers, kvmix_error *out_error) {
    const kvmix_result malformed = KVMIX_ERR_MALFORMED, bad = KVMIX_ERR_INVALID_ARGUMENT;
    const uint8_t *p = (const uint8_t *)src;
    kvmix_payload_info info;
    kvmix_payload_desc d;
    int32_t counts[3];
    uint64_t pos;
    kvmix_result r;
    kvmix__why w;
    if (!src) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "src", "NULL");
    if (!out_info) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "out_info", "NULL");
    if (src_bytes < KVMIX_PAYLOAD_HEADER_BYTES)
        return kvmix__fail(out_error, malformed, "src_bytes", "less than the 80-byte header");
    if (memcmp(p, "KVMP", 4) != 0)
        return kvmix__fail(out_error, malformed, "magic", "not \"KVMP\": not a payload");
    if (kvmix__load_u16(p + 4) != KVMIX_PAYLOAD_VERSION)
        return kvmix__fail(out_error, KVMIX_ERR_VERSION, "version", "not KVMIX_PAYLOAD_VERSION");
    if (kvmix__load_u32(p + 68) != 0)
        return kvmix__fail(out_error, malformed, "reserved", "must be 0");
    memset(&d, 0, sizeof d);
    d.kind = (kvmix_payload_kind)kvmix__load_u16(p + 6);
    pos = kvmix__load_u64(p + 32);
    if ((w = kvmix__payload_head_ints(p, &d, counts)).result != KVMIX_SUCCESS)
        return kvmix__fail(out_error, w.result, w.argument, w.reason);
    if (pos > (uint64_t)INT64_MAX)
        return kvmix__fail(out_error, bad, "first_position", "beyond int64_t");
    if (d.group_size == 0) /* written resolved; 0 would mean a default */
        return kvmix__fail(out_error, bad, "group_size", "0: a payload's is written resolved");
    d.first_position = (int64_t)pos;
    d.id = kvmix__load_u64(p + 40);
    d.base_id = kvmix__load_u64(p + 48);
    memset(&info, 0, sizeof info);
    info.desc = d;
    if ((w = kvmix__payload_desc_why(&info.desc)).result != KVMIX_SUCCESS)
        return kvmix__fail(out_error, w.result, w.argument, w.reason);
    if ((int64_t)counts[0] + counts[1] + counts[2] > d.n_tokens)
        return kvmix__fail(out_error, malformed, "n_fp16", "n_fp16 + n_int8 + n_int4 > n_tokens");
    info.n_fp16 = counts[0];
    info.n_int8 = counts[1];
    info.n_int4 = counts[2];
    if ((r = kvmix__payload_sizes(&info)) != KVMIX_SUCCESS)
        return kvmix__fail(out_error, r, "n_layers", KVMIX__PAYLOAD_TOO_BIG);
    if (src_bytes < info.head_bytes)
        return kvmix__fail(out_error, malformed, "src_bytes",
                           "less than the header and tier table");
    if (kvmix__load_u64(p + 72) != (uint64_t)info.total_bytes)
        return kvmix__fail(out_error, malformed, "total_bytes", "not what the other fields give");
    if ((w = kvmix__payload_table_why(p, &info)).result != KVMIX_SUCCESS)
        return kvmix__fail(out_error, w.result, w.argument, w.reason);
    *out_info = info;
    if (out_tiers) *out_tiers = p + KVMIX_PAYLOAD_HEADER_BYTES;
    return kvmix__succeed(out_error);
}

KVMIXDEF kvmix_result kvmix_payload_unpack(const void *src, size_t src_bytes, int32_t layer,
                                           float *keys, float *values, kvmix_error *out_error) {
    kvmix_payload_info info;
    const uint8_t *tiers, *p = (const uint8_t *)src;
    float row[KVMIX_MAX_HEAD_DIM];
    kvmix_result r;
    int32_t l, kv, h, t, c;
    int i;
    r = kvmix_payload_read_head(src, src_bytes, &info, &tiers, out_error);
    if (r != KVMIX_SUCCESS) return r;
    if (layer < info.desc.first_layer || layer - info.desc.first_layer >= info.desc.n_layers)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "layer",
                           "outside first_layer .. first_layer + n_layers - 1");
    if (src_bytes < info.total_bytes)
        return kvmix__fail(out_error, KVMIX_ERR_BUFFER_TOO_SMALL, "src_bytes",
                           "less than the payload's total_bytes");
    l = layer - info.desc.first_layer;
    for (kv = 0; kv < 2; kv++)
        for (h = 0; h < info.desc.n_kv_heads; h++) {
            kvmix__tier_blocks b = kvmix__payload_blocks(&info, l, kv, h);
            for (i = 0; i < 3; i++)
                if ((r = kvmix__check_block(&b.layout[i], p + b.offset[i])) != KVMIX_SUCCESS)
                    return kvmix__fail(out_error, r, "src",
                                       "a block of the layer no quantize call could write");
        }
    for (kv = 0; kv < 2; kv++) {
        float *out = kv ? values : keys;
        if (!out) continue;
        for (h = 0; h < info.desc.n_kv_heads; h++) {
            kvmix__tier_blocks b = kvmix__payload_blocks(&info, l, kv, h);
            int32_t rank[3] = {0, 0, 0};
            for (t = 0; t < info.desc.n_tokens; t++) {
                float *dst = out + ((size_t)t * (size_t)info.desc.n_kv_heads + (size_t)h) *
                                       (size_t)info.desc.head_dim;
                if ((i = kvmix__tier_index(tiers[t])) < 0) continue;
                kvmix__decode_row(&b.layout[i], &b.sections[i], p + b.offset[i], rank[i]++, row);
                for (c = 0; c < info.desc.head_dim; c++)
                    dst[c] = info.desc.kind == KVMIX_PAYLOAD_RESIDUAL ? dst[c] + row[c] : row[c];
            }
        }
    }
    return kvmix__succeed(out_error);
}

#ifndef KVMIX_NO_POLICY

// >>tags
/* The streaming tagger. The hot path (kvmix_tagger_feed's inner loop) runs while the state is
   outside a message or in a message's content: one bit test of the id in a filter of the last ids
   of every content marker, and one 8-byte store. Any other id, and every header id, goes through
   kvmix__tagger_step, which matches markers against the ids fed before (the run itself, then a
   ring of the last KVMIX_TAG_MAX_IDS ids of earlier runs), so runs and single ids agree. */

enum {
    KVMIX__TAG_OUTSIDE = 0, /* between messages */
    KVMIX__TAG_CONTENT = 1, /* a message's content */
    KVMIX__TAG_FIRST = 2,   /* before the first content token of a user message */
    KVMIX__TAG_HEADER = 3   /* after a message start, before its header end */
};

enum { /* content markers, in the order kvmix__tag_content_marker lists them */
       KVMIX__TAG_K_NONE,
       KVMIX__TAG_K_START,
       KVMIX__TAG_K_END,
       KVMIX__TAG_K_REASONING_OPEN,
       KVMIX__TAG_K_REASONING_CLOSE,
       KVMIX__TAG_K_TOOL_CALL_OPEN,
       KVMIX__TAG_K_TOOL_CALL_CLOSE,
       KVMIX__TAG_K_TOOL_RESPONSE_OPEN,
       KVMIX__TAG_K_TOOL_RESPONSE_CLOSE,
       KVMIX__TAG_K_VISION_OPEN,
       KVMIX__TAG_K_VISION_CLOSE,
       KVMIX__TAG_K_IMAGE_PAD,
       KVMIX__TAG_N_KINDS,
       KVMIX__TAG_K_ROLE_START = KVMIX__TAG_N_KINDS /* spec->role_starts, not a marker */
};

static const kvmix_tag_marker *kvmix__tag_content_marker(const kvmix_tag_spec *s, int kind) {
    switch (kind) {
    case KVMIX__TAG_K_START: return &s->message_start;
    case KVMIX__TAG_K_END: return &s->message_end;
    case KVMIX__TAG_K_REASONING_OPEN: return &s->reasoning_open;
    case KVMIX__TAG_K_REASONING_CLOSE: return &s->reasoning_close;
    case KVMIX__TAG_K_TOOL_CALL_OPEN: return &s->tool_call_open;
    case KVMIX__TAG_K_TOOL_CALL_CLOSE: return &s->tool_call_close;
    case KVMIX__TAG_K_TOOL_RESPONSE_OPEN: return &s->tool_response_open;
    case KVMIX__TAG_K_TOOL_RESPONSE_CLOSE: return &s->tool_response_close;
    case KVMIX__TAG_K_VISION_OPEN: return &s->vision_open;
    case KVMIX__TAG_K_VISION_CLOSE: return &s->vision_close;
    default: return &s->image_pad;
    }
}

/* The member of kvmix_tag_spec that holds a content marker, as kvmix_error names it. */
static const char *kvmix__tag_content_name(int kind) {
    static const char *const names[] = {"",
                                        "message_start",
                                        "message_end",
                                        "reasoning_open",
                                        "reasoning_close",
                                        "tool_call_open",
                                        "tool_call_close",
                                        "tool_response_open",
                                        "tool_response_close",
                                        "vision_open",
                                        "vision_close",
                                        "image_pad"};
    return names[kind];
}

static int kvmix__tag_seq_ok(const kvmix_tag_seq *q) {
    int32_t i;
    if (q->n_ids < 0 || q->n_ids > KVMIX_TAG_MAX_IDS) return 0;
    for (i = 0; i < q->n_ids; i++)
        if (q->ids[i] < 0) return 0;
    return 1;
}

static int kvmix__tag_seq_equal(const kvmix_tag_seq *a, const kvmix_tag_seq *b) {
    int32_t i;
    if (a->n_ids != b->n_ids) return 0;
    for (i = 0; i < a->n_ids; i++)
        if (a->ids[i] != b->ids[i]) return 0;
    return 1;
}

static int kvmix__tag_marker_used(const kvmix_tag_marker *m) {
    int a;
    for (a = 0; a < KVMIX_TAG_MAX_ALTS; a++)
        if (m->alts[a].n_ids > 0) return 1;
    return 0;
}

#define KVMIX__TAG_NAMES_RULE                                                                      \
    "a count past its maximum, a name of no ids or an id < 0, or a role that is SCAFFOLD or not "  \
    "a "                                                                                           \
    "kvmix_tag_role"
static int kvmix__tag_names_ok(const kvmix_tag_name *names, int32_t n, int32_t max) {
    int32_t i;
    if (n < 0 || n > max) return 0;
    for (i = 0; i < n; i++) {
        if (!kvmix__tag_seq_ok(&names[i].seq) || names[i].seq.n_ids < 1) return 0;
        if (names[i].role < 0 || names[i].role >= KVMIX_ROLE_SCAFFOLD) return 0;
    }
    return 1;
}

/* Role starts are content markers too: each differs from the others and from every marker. */
static int kvmix__tag_role_starts_distinct(const kvmix_tag_spec *spec) {
    int32_t r, r2;
    int k, a;
    for (r = 0; r < spec->n_role_starts; r++) {
        const kvmix_tag_seq *q = &spec->role_starts[r].seq;
        for (r2 = 0; r2 < r; r2++)
            if (kvmix__tag_seq_equal(q, &spec->role_starts[r2].seq)) return 0;
        for (k = KVMIX__TAG_K_START; k < KVMIX__TAG_N_KINDS; k++)
            for (a = 0; a < KVMIX_TAG_MAX_ALTS; a++)
                if (kvmix__tag_seq_equal(q, &kvmix__tag_content_marker(spec, k)->alts[a])) return 0;
    }
    return 1;
}

/* A marker's alternatives: ids in range, and none equal to an alternative of the `n_before`
   markers before it (others[]) or, when `distinct`, to an earlier one of its own. */
static const char *kvmix__tag_marker_fault(const kvmix_tag_marker *m,
                                           const kvmix_tag_marker *const *others, int n_before,
                                           int distinct) {
    int a, a2, k2;
    for (a = 0; a < KVMIX_TAG_MAX_ALTS; a++) {
        const kvmix_tag_seq *q = &m->alts[a];
        if (!kvmix__tag_seq_ok(q)) return "an alternative with an id < 0 or past KVMIX_TAG_MAX_IDS";
        if (q->n_ids == 0) continue;
        for (a2 = 0; distinct && a2 < a; a2++)
            if (kvmix__tag_seq_equal(q, &m->alts[a2])) return "repeats one of its alternatives";
        for (k2 = 0; k2 < n_before; k2++)
            for (a2 = 0; a2 < KVMIX_TAG_MAX_ALTS; a2++)
                if (kvmix__tag_seq_equal(q, &others[k2]->alts[a2]))
                    return "equals an alternative of another marker of its kind";
    }
    return NULL;
}

KVMIXDEF kvmix_result kvmix_tag_spec_check(const kvmix_tag_spec *spec, kvmix_error *out_error) {
    const kvmix_result bad = KVMIX_ERR_INVALID_ARGUMENT;
    const kvmix_tag_marker *seen[KVMIX__TAG_N_KINDS] = {0}; /* read only once written */
    const char *fault;
    int k, a;
    if (!spec) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "spec", "NULL");
    for (k = KVMIX__TAG_K_START; k < KVMIX__TAG_N_KINDS; k++) {
        const kvmix_tag_marker *m = kvmix__tag_content_marker(spec, k);
        if ((fault = kvmix__tag_marker_fault(m, seen, k - KVMIX__TAG_K_START, 1)) != NULL)
            return kvmix__fail(out_error, bad, kvmix__tag_content_name(k), fault);
        for (a = 0; k == KVMIX__TAG_K_IMAGE_PAD && a < KVMIX_TAG_MAX_ALTS; a++)
            if (m->alts[a].n_ids > 1)
                return kvmix__fail(out_error, bad, "image_pad", "an alternative of more than 1 id");
        seen[k - KVMIX__TAG_K_START] = m;
    }
    seen[0] = &spec->header_end, seen[1] = &spec->channel, seen[2] = &spec->recipient;
    for (k = 0; k < 3; k++) /* the header markers, distinct from each other */
        if ((fault = kvmix__tag_marker_fault(seen[k], seen, k, 0)) != NULL)
            return kvmix__fail(out_error, bad,
                               k == 0   ? "header_end"
                               : k == 1 ? "channel"
                                        : "recipient",
                               fault);
    if (!kvmix__tag_marker_used(&spec->message_end))
        return kvmix__fail(out_error, bad, "message_end", "required: has no alternative");
    if (spec->n_role_starts == 0 && !kvmix__tag_marker_used(&spec->message_start))
        return kvmix__fail(out_error, bad, "message_start",
                           "required without role_starts: has no alternative");
    if (kvmix__tag_marker_used(&spec->message_start) && !kvmix__tag_marker_used(&spec->header_end))
        return kvmix__fail(out_error, bad, "header_end",
                           "required with message_start (its messages end their header there): "
                           "has no alternative");
    if (!kvmix__tag_names_ok(spec->roles, spec->n_roles, KVMIX_TAG_MAX_NAMES))
        return kvmix__fail(out_error, bad, "roles", KVMIX__TAG_NAMES_RULE);
    if (!kvmix__tag_names_ok(spec->channels, spec->n_channels, KVMIX_TAG_MAX_NAMES))
        return kvmix__fail(out_error, bad, "channels", KVMIX__TAG_NAMES_RULE);
    if (!kvmix__tag_names_ok(spec->role_starts, spec->n_role_starts, KVMIX_TAG_MAX_STARTS))
        return kvmix__fail(out_error, bad, "role_starts", KVMIX__TAG_NAMES_RULE);
    if (!kvmix__tag_role_starts_distinct(spec))
        return kvmix__fail(out_error, bad, "role_starts",
                           "equals another role start or a content marker");
    return kvmix__succeed(out_error);
}

static void kvmix__tagger_update(kvmix_tagger *t) {
    kvmix_tag c;
    c.turn = t->turn;
    c.modality = KVMIX_MODALITY_TEXT;
    c.flags = 0;
    c.reserved = 0;
    if (t->mode == KVMIX__TAG_OUTSIDE || t->mode == KVMIX__TAG_HEADER) {
        c.role = KVMIX_ROLE_SCAFFOLD;
    } else {
        int32_t role = t->msg_role;
        if (role == KVMIX_ROLE_ASSISTANT && t->channel_role >= 0) role = t->channel_role;
        c.flags = (uint8_t)(t->msg_fallback ? KVMIX_TAG_FLAG_FALLBACK : 0);
        if (t->bracket) {
            static const uint8_t bracket_role[4] = {0, KVMIX_ROLE_REASONING, KVMIX_ROLE_TOOL_CALL,
                                                    KVMIX_ROLE_OBSERVATION};
            role = bracket_role[t->bracket & 3];
            c.flags = 0;
        }
        c.role = (uint8_t)role;
        if (t->vision) c.modality = KVMIX_MODALITY_IMAGE;
    }
    t->current = c;
}

KVMIXDEF kvmix_result kvmix_tagger_reset(kvmix_tagger *tagger) {
    int k, a;
    if (!tagger) return KVMIX_ERR_NULL_POINTER;
    if (kvmix_tag_spec_check(&tagger->spec, NULL) != KVMIX_SUCCESS)
        return KVMIX_ERR_INVALID_ARGUMENT;
    memset(tagger->filter, 0, sizeof tagger->filter);
    for (k = KVMIX__TAG_K_START; k < KVMIX__TAG_N_KINDS; k++) {
        const kvmix_tag_marker *m = kvmix__tag_content_marker(&tagger->spec, k);
        for (a = 0; a < KVMIX_TAG_MAX_ALTS; a++)
            if (m->alts[a].n_ids > 0) {
                uint32_t h = (uint32_t)m->alts[a].ids[m->alts[a].n_ids - 1] % KVMIX_TAG_FILTER_BITS;
                tagger->filter[h / 64] |= (uint64_t)1 << (h % 64);
            }
    }
    for (k = 0; k < tagger->spec.n_role_starts; k++) {
        const kvmix_tag_seq *q = &tagger->spec.role_starts[k].seq;
        uint32_t h = (uint32_t)q->ids[q->n_ids - 1] % KVMIX_TAG_FILTER_BITS;
        tagger->filter[h / 64] |= (uint64_t)1 << (h % 64);
    }
    /* image pads that end no other content marker are tagged on the hot path */
    tagger->pad_mode = -1;
    for (a = 0; a < KVMIX_TAG_MAX_ALTS; a++) {
        const kvmix_tag_seq *pad = &tagger->spec.image_pad.alts[a];
        int k2, a2, alone = pad->n_ids == 1;
        for (k2 = KVMIX__TAG_K_START; alone && k2 < KVMIX__TAG_K_IMAGE_PAD; k2++) {
            const kvmix_tag_marker *m = kvmix__tag_content_marker(&tagger->spec, k2);
            for (a2 = 0; a2 < KVMIX_TAG_MAX_ALTS; a2++)
                if (m->alts[a2].n_ids > 0 && m->alts[a2].ids[m->alts[a2].n_ids - 1] == pad->ids[0])
                    alone = 0;
        }
        for (k2 = 0; alone && k2 < tagger->spec.n_role_starts; k2++) {
            const kvmix_tag_seq *q = &tagger->spec.role_starts[k2].seq;
            if (q->ids[q->n_ids - 1] == pad->ids[0]) alone = 0;
        }
        if (!alone) continue;
        if (tagger->pad_mode < 0)
            for (k = 0; k < KVMIX_TAG_MAX_ALTS; k++) tagger->pads[k] = pad->ids[0];
        tagger->pads[a] = pad->ids[0];
        tagger->pad_mode = KVMIX__TAG_CONTENT;
    }
    if (tagger->pad_mode < 0) memset(tagger->pads, 0, sizeof tagger->pads);
    tagger->n_fed = 0;
    tagger->n_breaks = 0;
    tagger->turn = 0;
    tagger->mode = KVMIX__TAG_OUTSIDE;
    tagger->msg_role = KVMIX_ROLE_USER;
    tagger->msg_fallback = 0;
    tagger->msg_user = 0;
    tagger->bracket = 0;
    tagger->vision = 0;
    tagger->channel_role = -1;
    tagger->channel_at = -1;
    tagger->recipient_at = -1;
    tagger->n_header = 0;
    memset(tagger->header, 0, sizeof tagger->header);
    memset(tagger->channel_ids, 0, sizeof tagger->channel_ids);
    memset(tagger->history, 0, sizeof tagger->history);
    kvmix__tagger_update(tagger);
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_tagger_init(kvmix_tagger *tagger, const kvmix_tag_spec *spec,
                                        kvmix_error *out_error) {
    kvmix_result r;
    if (!tagger) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "tagger", "NULL");
    if ((r = kvmix_tag_spec_check(spec, out_error)) != KVMIX_SUCCESS) return r;
    if (&tagger->spec != spec) memmove(&tagger->spec, spec, sizeof *spec);
    return kvmix_tagger_reset(tagger);
}

/* Nonzero when `q` ends at run index i (absolute position base + i) and lies within the last
   `limit` ids. Earlier ids come from the run, then from the ring of the previous runs. */
static int kvmix__tag_ends_at(const kvmix_tagger *t, const int32_t *ids, int32_t i, int64_t base,
                              const kvmix_tag_seq *q, int64_t limit) {
    int32_t k, n = q->n_ids;
    if (n <= 0 || n > limit || (int64_t)n > base + i + 1) return 0;
    for (k = 0; k < n; k++) {
        int32_t back = n - 1 - k, id;
        if (back <= i)
            id = ids[i - back];
        else
            id = t->history[(uint64_t)(base + i - back) % KVMIX_TAG_MAX_IDS];
        if (id != q->ids[k]) return 0;
    }
    return 1;
}

static int kvmix__tag_marker_ends_at(const kvmix_tagger *t, const int32_t *ids, int32_t i,
                                     int64_t base, const kvmix_tag_marker *m, int64_t limit,
                                     int32_t *io_len) {
    int a, hit = 0;
    for (a = 0; a < KVMIX_TAG_MAX_ALTS; a++)
        if (m->alts[a].n_ids > *io_len && kvmix__tag_ends_at(t, ids, i, base, &m->alts[a], limit)) {
            *io_len = m->alts[a].n_ids;
            hit = 1;
        }
    return hit;
}

/* The content marker (longest) that ends at ids[i], or KVMIX__TAG_K_NONE; for a role start,
   KVMIX__TAG_K_ROLE_START with its index in *out_start. */
static int kvmix__tag_content_match(const kvmix_tagger *t, const int32_t *ids, int32_t i,
                                    int64_t base, int32_t *out_start) {
    uint32_t h = (uint32_t)ids[i] % KVMIX_TAG_FILTER_BITS;
    int k, best = KVMIX__TAG_K_NONE;
    int32_t len = 0, r;
    if (!((t->filter[h / 64] >> (h % 64)) & 1)) return best;
    for (k = KVMIX__TAG_K_START; k < KVMIX__TAG_N_KINDS; k++)
        if (kvmix__tag_marker_ends_at(t, ids, i, base, kvmix__tag_content_marker(&t->spec, k),
                                      KVMIX_TAG_MAX_IDS, &len))
            best = k;
    for (r = 0; r < t->spec.n_role_starts; r++) {
        const kvmix_tag_seq *q = &t->spec.role_starts[r].seq;
        if (q->n_ids > len && kvmix__tag_ends_at(t, ids, i, base, q, KVMIX_TAG_MAX_IDS)) {
            len = q->n_ids;
            best = KVMIX__TAG_K_ROLE_START;
            *out_start = r;
        }
    }
    return best;
}

/* The longest name whose ids are a prefix of have[0 .. n_have), or -1. */
static int32_t kvmix__tag_name_match(const kvmix_tag_name *names, int32_t n_names,
                                     const int32_t *have, int32_t n_have) {
    int32_t i, k, best = -1, best_len = 0;
    if (n_have > KVMIX_TAG_MAX_IDS) n_have = KVMIX_TAG_MAX_IDS;
    for (i = 0; i < n_names; i++) {
        const kvmix_tag_seq *q = &names[i].seq;
        if (q->n_ids > n_have || q->n_ids <= best_len) continue;
        for (k = 0; k < q->n_ids && have[k] == q->ids[k]; k++) {
        }
        if (k == q->n_ids) {
            best = i;
            best_len = q->n_ids;
        }
    }
    return best;
}

/* Ends a header: the message's role from its role word, channel and recipient. */
static void kvmix__tagger_end_header(kvmix_tagger *t, int overflow) {
    int32_t r = kvmix__tag_name_match(t->spec.roles, t->spec.n_roles, t->header, t->n_header);
    t->channel_role = -1;
    if (r < 0) {
        t->msg_role = KVMIX_ROLE_USER;
        t->msg_fallback = 1;
        t->msg_user = 0;
    } else {
        t->msg_role = t->spec.roles[r].role;
        t->msg_fallback = overflow;
        t->msg_user = t->msg_role == KVMIX_ROLE_USER;
    }
    if (t->msg_role == KVMIX_ROLE_ASSISTANT && t->channel_at >= 0) {
        int32_t c = kvmix__tag_name_match(t->spec.channels, t->spec.n_channels, t->channel_ids,
                                          t->n_header - t->channel_at);
        if (c < 0)
            t->msg_fallback = 1;
        else
            t->channel_role = t->spec.channels[c].role;
    }
    if (t->msg_role == KVMIX_ROLE_ASSISTANT && t->recipient_at >= 0)
        t->channel_role = KVMIX_ROLE_TOOL_CALL; /* addressed to a tool */
    if (t->msg_fallback) t->n_breaks++;
    t->mode = t->msg_user ? KVMIX__TAG_FIRST : KVMIX__TAG_CONTENT;
    kvmix__tagger_update(t);
}

static void kvmix__tagger_start_message(kvmix_tagger *t) {
    t->mode = KVMIX__TAG_HEADER;
    t->n_header = 0;
    t->channel_at = -1;
    t->recipient_at = -1;
    t->channel_role = -1;
    t->bracket = 0;
    t->vision = 0;
    t->msg_fallback = 0;
    t->msg_user = 0;
    kvmix__tagger_update(t);
}

/* Starts a message whose role the role start `r` names: no header, content next. */
static void kvmix__tagger_start_role(kvmix_tagger *t, int32_t r) {
    kvmix__tagger_start_message(t);
    t->msg_role = t->spec.role_starts[r].role;
    t->msg_user = t->msg_role == KVMIX_ROLE_USER;
    t->mode = t->msg_user ? KVMIX__TAG_FIRST : KVMIX__TAG_CONTENT;
    kvmix__tagger_update(t);
}

/* Nonzero while a span is open that a message must not end inside: a vision span, or a bracket
   the spec has a close marker for (one without, like <|python_tag|>, runs to the message end). */
static int kvmix__tagger_span_open(const kvmix_tagger *t) {
    if (t->vision) return 1;
    return t->bracket != 0 && kvmix__tag_marker_used(kvmix__tag_content_marker(
                                  &t->spec, KVMIX__TAG_K_REASONING_CLOSE + 2 * (t->bracket - 1)));
}

/* One id that the hot path does not handle: a header id, a content marker's last id, the first
   content id of a user message, or an id that shares a filter bit with a marker. */
static kvmix_tag kvmix__tagger_step(kvmix_tagger *t, const int32_t *ids, int32_t i, int64_t base) {
    kvmix_tag out;
    int32_t start = 0;
    int kind = kvmix__tag_content_match(t, ids, i, base, &start), stray = 0, brk = 0;
    if (t->mode == KVMIX__TAG_HEADER) {
        int32_t len = 0, pos;
        if (kind == KVMIX__TAG_K_START || kind == KVMIX__TAG_K_END ||
            kind == KVMIX__TAG_K_ROLE_START) {
            t->n_breaks++;
            if (kind == KVMIX__TAG_K_START)
                kvmix__tagger_start_message(t);
            else if (kind == KVMIX__TAG_K_ROLE_START)
                kvmix__tagger_start_role(t, start);
            else {
                t->mode = KVMIX__TAG_OUTSIDE;
                kvmix__tagger_update(t);
            }
            out = t->current;
            out.role = KVMIX_ROLE_SCAFFOLD;
            out.modality = KVMIX_MODALITY_TEXT;
            out.flags = KVMIX_TAG_FLAG_FALLBACK;
            return out;
        }
        if (t->n_header < KVMIX_TAG_MAX_HEADER) {
            pos = t->n_header++;
            if (pos < KVMIX_TAG_MAX_IDS) t->header[pos] = ids[i];
            if (t->channel_at >= 0 && pos - t->channel_at < KVMIX_TAG_MAX_IDS)
                t->channel_ids[pos - t->channel_at] = ids[i];
            out = t->current; /* scaffold */
            if (kvmix__tag_marker_ends_at(t, ids, i, base, &t->spec.header_end, t->n_header, &len))
                kvmix__tagger_end_header(t, 0);
            else if (kvmix__tag_marker_ends_at(t, ids, i, base, &t->spec.channel, t->n_header,
                                               &len))
                t->channel_at = t->n_header;
            else if (kvmix__tag_marker_ends_at(t, ids, i, base, &t->spec.recipient, t->n_header,
                                               &len))
                t->recipient_at = t->n_header;
            out.turn = t->turn;
            return out;
        }
        kvmix__tagger_end_header(t, 1); /* too long: this id is the first content id */
    }
    if (t->mode == KVMIX__TAG_FIRST) {
        t->mode = KVMIX__TAG_CONTENT;
        if (kind == KVMIX__TAG_K_TOOL_RESPONSE_OPEN) {
            t->msg_role = KVMIX_ROLE_OBSERVATION; /* a tool result sent as a user message */
            t->msg_user = 0;
        } else if (t->turn < 0x7fffffff) {
            t->turn++;
        }
        kvmix__tagger_update(t);
    }
    out = t->current;
    if (kind == KVMIX__TAG_K_NONE) return out;
    if (t->mode != KVMIX__TAG_OUTSIDE && t->msg_role == KVMIX_ROLE_INSTRUCTION &&
        kind >= KVMIX__TAG_K_REASONING_OPEN && kind <= KVMIX__TAG_K_TOOL_RESPONSE_CLOSE)
        return out; /* a system prompt that names the tags: content */
    if (t->mode == KVMIX__TAG_OUTSIDE) {
        stray = kind != KVMIX__TAG_K_START && kind != KVMIX__TAG_K_ROLE_START;
    } else {
        switch (kind) {
        case KVMIX__TAG_K_START:
            brk = 1; /* the message never ended */
            break;
        case KVMIX__TAG_K_ROLE_START: /* ends the message before it */
            brk = kvmix__tagger_span_open(t);
            break;
        case KVMIX__TAG_K_END:
            brk = kvmix__tagger_span_open(t);
            t->mode = KVMIX__TAG_OUTSIDE;
            break;
        case KVMIX__TAG_K_REASONING_OPEN:
        case KVMIX__TAG_K_TOOL_CALL_OPEN:
        case KVMIX__TAG_K_TOOL_RESPONSE_OPEN:
            brk = t->bracket != 0;
            t->bracket = (kind - KVMIX__TAG_K_REASONING_OPEN) / 2 + 1;
            break;
        case KVMIX__TAG_K_REASONING_CLOSE:
        case KVMIX__TAG_K_TOOL_CALL_CLOSE:
        case KVMIX__TAG_K_TOOL_RESPONSE_CLOSE:
            if (t->bracket == (kind - KVMIX__TAG_K_REASONING_CLOSE) / 2 + 1)
                t->bracket = 0;
            else
                stray = 1;
            break;
        case KVMIX__TAG_K_VISION_OPEN:
            brk = t->vision;
            t->vision = 1;
            break;
        case KVMIX__TAG_K_VISION_CLOSE:
            if (t->vision)
                t->vision = 0;
            else
                stray = 1;
            break;
        default: /* image pad: content of the image */
            out.modality = KVMIX_MODALITY_IMAGE;
            return out;
        }
    }
    if (kind == KVMIX__TAG_K_START)
        kvmix__tagger_start_message(t);
    else if (kind == KVMIX__TAG_K_ROLE_START)
        kvmix__tagger_start_role(t, start);
    else
        kvmix__tagger_update(t);
    out = t->current;
    out.turn = t->turn;
    out.role = KVMIX_ROLE_SCAFFOLD;
    out.modality =
        (uint8_t)(kind == KVMIX__TAG_K_IMAGE_PAD ? KVMIX_MODALITY_IMAGE : KVMIX_MODALITY_TEXT);
    out.flags = (uint8_t)(stray || brk ? KVMIX_TAG_FLAG_FALLBACK : 0);
    if (stray || brk) t->n_breaks++;
    return out;
}

KVMIXDEF kvmix_result kvmix_tagger_feed(kvmix_tagger *tagger, const int32_t *ids, int32_t n_ids,
                                        kvmix_tag *out_tags) {
    int64_t base;
    int32_t i = 0, j;
    if (!tagger) return KVMIX_ERR_NULL_POINTER;
    if (n_ids < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    if (n_ids == 0) return KVMIX_SUCCESS;
    if (!ids || !out_tags) return KVMIX_ERR_NULL_POINTER;
    base = tagger->n_fed;
    if (n_ids == 1 && tagger->mode <= KVMIX__TAG_CONTENT) { /* a decode step: one id */
        const uint32_t h = (uint32_t)ids[0] % KVMIX_TAG_FILTER_BITS;
        if (!((tagger->filter[h / 64] >> (h % 64)) & 1)) {
            out_tags[0] = tagger->current;
            tagger->history[(uint64_t)base % KVMIX_TAG_MAX_IDS] = ids[0];
            tagger->n_fed = base + 1;
            return KVMIX_SUCCESS;
        }
    }
    while (i < n_ids) {
        if (tagger->mode <= KVMIX__TAG_CONTENT) {
            const kvmix_tag cur = tagger->current;
            const uint64_t *filter = tagger->filter;
            const int pads = tagger->mode == tagger->pad_mode;
            const int32_t p0 = tagger->pads[0], p1 = tagger->pads[1], p2 = tagger->pads[2],
                          p3 = tagger->pads[3];
            kvmix_tag image = cur;
            image.modality = KVMIX_MODALITY_IMAGE;
            for (; i < n_ids; i++) {
                const int32_t id = ids[i];
                const uint32_t h = (uint32_t)id % KVMIX_TAG_FILTER_BITS;
                if ((filter[h / 64] >> (h % 64)) & 1) {
                    if (!pads || (id != p0 && id != p1 && id != p2 && id != p3)) break;
                    out_tags[i] = image;
                } else {
                    out_tags[i] = cur;
                }
            }
            if (i == n_ids) break;
        }
        out_tags[i] = kvmix__tagger_step(tagger, ids, i, base);
        i++;
    }
    for (j = n_ids > KVMIX_TAG_MAX_IDS ? n_ids - KVMIX_TAG_MAX_IDS : 0; j < n_ids; j++)
        tagger->history[(uint64_t)(base + j) % KVMIX_TAG_MAX_IDS] = ids[j];
    tagger->n_fed = base + n_ids;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_tag_bucket kvmix_tag_bucket_of(int32_t turn, int32_t current_turn) {
    int64_t d = (int64_t)current_turn - (int64_t)turn;
    if (d <= 0) return KVMIX_BUCKET_CURRENT;
    if (d == 1) return KVMIX_BUCKET_PREVIOUS;
    if (d == 2) return KVMIX_BUCKET_TWO_BACK;
    return KVMIX_BUCKET_OLDER;
}

static const char *const kvmix__tag_role_names[KVMIX_TAG_N_ROLES] = {
    "instruction", "user", "assistant", "reasoning", "tool_call", "observation", "scaffold"};

KVMIXDEF const char *kvmix_tag_role_name(kvmix_tag_role role) {
    if ((int)role < 0 || (int)role >= KVMIX_TAG_N_ROLES) return "unknown";
    return kvmix__tag_role_names[role];
}

KVMIXDEF const char *kvmix_tag_modality_name(kvmix_tag_modality modality) {
    switch (modality) {
    case KVMIX_MODALITY_TEXT: return "text";
    case KVMIX_MODALITY_IMAGE: return "image";
    default: return "unknown";
    }
}

KVMIXDEF const char *kvmix_tag_bucket_name(kvmix_tag_bucket bucket) {
    switch (bucket) {
    case KVMIX_BUCKET_CURRENT: return "current";
    case KVMIX_BUCKET_PREVIOUS: return "previous";
    case KVMIX_BUCKET_TWO_BACK: return "two_back";
    case KVMIX_BUCKET_OLDER: return "older";
    default: return "unknown";
    }
}

KVMIXDEF kvmix_result kvmix_tag_role_from_name(const char *name, kvmix_tag_role *out_role) {
    int i;
    if (!name || !out_role) return KVMIX_ERR_NULL_POINTER;
    for (i = 0; i < KVMIX_TAG_N_ROLES; i++)
        if (strcmp(name, kvmix__tag_role_names[i]) == 0) {
            *out_role = (kvmix_tag_role)i;
            return KVMIX_SUCCESS;
        }
    return KVMIX_ERR_NOT_FOUND;
}

/* ---- tag precision ------------------------------------------------------------------------ */

KVMIXDEF kvmix_result kvmix_tag_precision_fill(kvmix_tag_precision *table,
                                               kvmix_cache_precision precision) {
    int b, r, m;
    if (!table) return KVMIX_ERR_NULL_POINTER;
    if (!kvmix__precision_known(precision)) return KVMIX_ERR_UNKNOWN_FORMAT;
    for (b = 0; b < KVMIX_TAG_N_BUCKETS; b++)
        for (r = 0; r < KVMIX_TAG_N_ROLES; r++)
            for (m = 0; m < KVMIX_TAG_N_MODALITIES; m++) table->formats[b][r][m] = precision;
    return KVMIX_SUCCESS;
}

/* Each entry of kvmix_tag_precision.formats by its bucket, role and modality names, for a
   kvmix_error: its strings are static, so every entry's name is spelled out here. */
#define KVMIX__TAG_ENTRY(b, r)                                                                     \
    { "formats[" b "][" r "][text]", "formats[" b "][" r "][image]" }
#define KVMIX__TAG_BUCKET(b)                                                                       \
    {                                                                                              \
        KVMIX__TAG_ENTRY(b, "instruction"), KVMIX__TAG_ENTRY(b, "user"),                           \
            KVMIX__TAG_ENTRY(b, "assistant"), KVMIX__TAG_ENTRY(b, "reasoning"),                    \
            KVMIX__TAG_ENTRY(b, "tool_call"), KVMIX__TAG_ENTRY(b, "observation"),                  \
            KVMIX__TAG_ENTRY(b, "scaffold")                                                        \
    }
static const char *const
    kvmix__tag_entry_names[KVMIX_TAG_N_BUCKETS][KVMIX_TAG_N_ROLES][KVMIX_TAG_N_MODALITIES] = {
        KVMIX__TAG_BUCKET("current"), KVMIX__TAG_BUCKET("previous"), KVMIX__TAG_BUCKET("two_back"),
        KVMIX__TAG_BUCKET("older")};

KVMIXDEF kvmix_result kvmix_tag_precision_check(const kvmix_tag_precision *table,
                                                kvmix_error *out_error) {
    int b, r, m;
    if (!table) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "table", "NULL");
    for (b = 0; b < KVMIX_TAG_N_BUCKETS; b++)
        for (r = 0; r < KVMIX_TAG_N_ROLES; r++)
            for (m = 0; m < KVMIX_TAG_N_MODALITIES; m++) {
                kvmix_cache_precision p = table->formats[b][r][m];
                if (kvmix__precision_known(p)) continue;
                return kvmix__fail(out_error, KVMIX_ERR_UNKNOWN_FORMAT,
                                   kvmix__tag_entry_names[b][r][m],
                                   p.key_format == 0 || kvmix__format_known(p.key_format)
                                       ? "value_format: not a kvmix_format or 0"
                                       : "key_format: not a kvmix_format or 0");
            }
    return kvmix__succeed(out_error);
}

// >>policy

#define KVMIX__KEEP KVMIX_CACHE_PARTIAL_KEEP_FP16

#define KVMIX__NO_EVICT                                                                            \
    { 0, 0, 0.0, 0.0, 0, 0, 0, 0, 0.0 }
static const kvmix_policy kvmix__builtin_policies[] = {
    {"fp16", "keys and values FP16 in the kvmix cache", KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, 32, 0,
     0, 0.0, 32, 0, 0, 0, KVMIX__KEEP, 0, NULL, KVMIX__NO_EVICT},
    {"int8", "INT8 keys and values, per token, groups of 32 channels", KVMIX_FORMAT_INT8,
     KVMIX_FORMAT_INT8, 32, 0, 0, 0.0, 32, 0, 0, 0, KVMIX__KEEP, 0, NULL, KVMIX__NO_EVICT},
    {"int4", "INT4 keys and values, per token, groups of 32 channels", KVMIX_FORMAT_INT4,
     KVMIX_FORMAT_INT4, 32, 0, 0, 0.0, 32, 0, 0, 0, KVMIX__KEEP, 0, NULL, KVMIX__NO_EVICT},
    {"kivi2",
     "KIVI-2: INT2 per-channel keys over pages of 32 tokens, INT2 per-token values (groups of "
     "32), the 128 most recent tokens FP16 (the residual)",
     KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2, 32, 0, 0, 0.0, 32, 0, 128, 0, KVMIX__KEEP, 0,
     NULL, KVMIX__NO_EVICT},
    {"kivi2-sink",
     "kivi2 (INT2 per-channel keys over pages of 32 tokens, INT2 per-token values, the 128 most "
     "recent tokens FP16) plus the first 32 tokens kept FP16 (attention sinks)",
     KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2, 32, 0, 0, 0.0, 32, 32, 128, 0, KVMIX__KEEP, 0,
     NULL, KVMIX__NO_EVICT},
    {"kitty-12",
     "Kitty: 2-bit per-channel keys over pages of 32 tokens with the head_dim/8 channels of "
     "largest mean |k| boosted to 4 bits, INT2 per-token values (groups of 32), 32 FP16 sinks, "
     "the 128 most recent tokens FP16",
     KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2, 32, 0, 0, 0.125, 32, 32, 128, 0, KVMIX__KEEP, 0, NULL,
     KVMIX__NO_EVICT},
    {"kitty-25",
     "Kitty: 2-bit per-channel keys over pages of 32 tokens with the head_dim/4 channels of "
     "largest mean |k| boosted to 4 bits, INT2 per-token values (groups of 32), 32 FP16 sinks, "
     "the 128 most recent tokens FP16",
     KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2, 32, 0, 0, 0.25, 32, 32, 128, 0, KVMIX__KEEP, 0, NULL,
     KVMIX__NO_EVICT},
    {"kitty-paper-12",
     "Kitty as its paper lays it out: BOOSTED keys (head_dim/8 channels at 4 bits) over pages of "
     "128 tokens, INT2 per-token values in one group per head, 32 FP16 sinks, the values of the "
     "128 most recent tokens FP16 (keys wait in the page being filled)",
     KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2, KVMIX_GROUP_HEAD_DIM, 0, 0, 0.125, 128, 32, 128, 1,
     KVMIX__KEEP, 0, NULL, KVMIX__NO_EVICT},
    {"kitty-paper-25",
     "Kitty as its paper lays it out: BOOSTED keys (head_dim/4 channels at 4 bits) over pages of "
     "128 tokens, INT2 per-token values in one group per head, 32 FP16 sinks, the values of the "
     "128 most recent tokens FP16 (keys wait in the page being filled)",
     KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2, KVMIX_GROUP_HEAD_DIM, 0, 0, 0.25, 128, 32, 128, 1,
     KVMIX__KEEP, 0, NULL, KVMIX__NO_EVICT},
};

#undef KVMIX__KEEP
#undef KVMIX__NO_EVICT

KVMIXDEF int32_t kvmix_policy_count(void) {
    return (int32_t)(sizeof kvmix__builtin_policies / sizeof kvmix__builtin_policies[0]);
}

KVMIXDEF const kvmix_policy *kvmix_policy_at(int32_t index) {
    return index >= 0 && index < kvmix_policy_count() ? &kvmix__builtin_policies[index] : NULL;
}

KVMIXDEF const kvmix_policy *kvmix_policy_find(const char *name) {
    int32_t i;
    for (i = 0; name && i < kvmix_policy_count(); i++)
        if (strcmp(kvmix__builtin_policies[i].name, name) == 0) return &kvmix__builtin_policies[i];
    return NULL;
}

static int kvmix__text_ok(const char *text, size_t bytes, int allow_empty) {
    return memchr(text, 0, bytes) != NULL && (allow_empty || text[0] != 0);
}

/* The numeric fields, each within its documented range. */
static kvmix_result kvmix__policy_check_ranges(const kvmix_policy *p, kvmix_error *e) {
    const kvmix_result bad = KVMIX_ERR_INVALID_ARGUMENT;
    if (p->group_size != KVMIX_GROUP_HEAD_DIM && !kvmix__int_in(p->group_size, 8, 512, 8))
        return kvmix__fail(e, bad, "group_size",
                           "must be a multiple of 8 in 8 .. 512, or head_dim");
    if (p->value_group_size != 0 && p->value_group_size != KVMIX_GROUP_HEAD_DIM &&
        !kvmix__int_in(p->value_group_size, 8, 512, 8))
        return kvmix__fail(e, bad, "value_group_size",
                           "must be 0 (group_size), a multiple of 8 in 8 .. 512, or head_dim");
    if (!kvmix__int_in(p->n_boost, 0, 252, 4))
        return kvmix__fail(e, bad, "n_boost", "must be a multiple of 4 in 0 .. 252");
    if (!(p->boost_fraction >= 0.0 && p->boost_fraction <= 1.0))
        return kvmix__fail(e, bad, "boost_fraction", "must be a number in 0 .. 1");
    if (!kvmix__int_in(p->page_tokens, 8, 1024, 8))
        return kvmix__fail(e, bad, "page_tokens", "must be a multiple of 8 in 8 .. 1024");
    if (!kvmix__int_in(p->sink_tokens, 0, p->page_tokens, 1))
        return kvmix__fail(e, bad, "sink_tokens", "must be in 0 .. page_tokens");
    if (!kvmix__int_in(p->window_tokens, 0, 1 << 26, 1))
        return kvmix__fail(e, bad, "window_tokens", "must be in 0 .. 2^26");
    if (!kvmix__int_in(p->window_values_only, 0, 1, 1))
        return kvmix__fail(e, bad, "window_values_only", "must be 0 or 1");
    if (p->partial_page < KVMIX_CACHE_PARTIAL_DEFAULT ||
        p->partial_page > KVMIX_CACHE_PARTIAL_QUANTIZE)
        return kvmix__fail(e, bad, "partial_page", "must be a kvmix_cache_partial");
    if (p->request_boundary != KVMIX_POLICY_BOUNDARY_FINISH &&
        p->request_boundary != KVMIX_POLICY_BOUNDARY_CONTINUE)
        return kvmix__fail(e, bad, "request_boundary", "must be a kvmix_policy_boundary");
    if (p->tag_precision && kvmix_tag_precision_check(p->tag_precision, NULL) != KVMIX_SUCCESS)
        return kvmix__fail(e, KVMIX_ERR_UNKNOWN_FORMAT, "tag_precision",
                           "holds a format that is not a kvmix_format");
    return KVMIX_SUCCESS;
}

static int kvmix__evict_policy_ok(const kvmix_evict_policy *p, kvmix_error *out_error);

/* No eviction (scorer 0, every other field 0 too), or a checked one. */
static kvmix_result kvmix__policy_check_evict(const kvmix_evict_policy *ev,
                                              kvmix_error *out_error) {
    kvmix_evict_policy none;
    memset(&none, 0, sizeof none);
    if (ev->scorer == 0 && memcmp(ev, &none, sizeof none) != 0)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "evict",
                           "has settings but no scorer");
    if (ev->scorer != 0 && !kvmix__evict_policy_ok(ev, out_error))
        return KVMIX_ERR_INVALID_ARGUMENT;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_policy_check(const kvmix_policy *p, kvmix_error *out_error) {
    int boosted;
    kvmix_result r;
    if (!p) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "policy", "NULL");
    if (!kvmix__text_ok(p->name, sizeof p->name, 0))
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "name",
                           "must be non-empty and NUL-terminated");
    if (!kvmix__text_ok(p->description, sizeof p->description, 1))
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "description",
                           "must be NUL-terminated");
    if (!kvmix__format_known(p->key_format))
        return kvmix__fail(out_error, KVMIX_ERR_UNKNOWN_FORMAT, "key_format",
                           "is not a kvmix_format");
    if (!kvmix__format_known(p->value_format))
        return kvmix__fail(out_error, KVMIX_ERR_UNKNOWN_FORMAT, "value_format",
                           "is not a kvmix_format");
    if ((r = kvmix__policy_check_ranges(p, out_error)) != KVMIX_SUCCESS) return r;
    boosted = p->key_format == KVMIX_FORMAT_BOOSTED || p->value_format == KVMIX_FORMAT_BOOSTED;
    if (boosted && p->n_boost == 0 && p->boost_fraction == 0.0)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "n_boost",
                           "a boosted format needs n_boost or boost_fraction");
    if ((r = kvmix__policy_check_evict(&p->evict, out_error)) != KVMIX_SUCCESS) return r;
    return kvmix__succeed(out_error);
}

/* n_boost and boost_fraction of a checked boosted policy made to agree for head_dim. */
static kvmix_result kvmix__policy_resolve_boost(kvmix_policy *p, int32_t head_dim, kvmix_error *e) {
    if (p->n_boost != 0 && p->boost_fraction != 0.0 &&
        p->boost_fraction * head_dim != (double)p->n_boost)
        return kvmix__fail(e, KVMIX_ERR_BAD_SHAPE, "boost_fraction",
                           "disagrees with n_boost for the model's head_dim");
    if (p->n_boost == 0) {
        double n = p->boost_fraction * head_dim;
        if (n != floor(n) || !kvmix__int_in((int32_t)n, 4, 252, 4))
            return kvmix__fail(e, KVMIX_ERR_BAD_SHAPE, "boost_fraction",
                               "of the model's head_dim is not a multiple of 4 in 4 .. 252");
        p->n_boost = (int32_t)n;
    }
    if (p->n_boost > head_dim)
        return kvmix__fail(e, KVMIX_ERR_BAD_SHAPE, "n_boost", "exceeds the model's head_dim");
    p->boost_fraction = (double)p->n_boost / head_dim;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_policy_resolve(const kvmix_policy *policy, int32_t head_dim,
                                           kvmix_policy *out, kvmix_error *out_error) {
    kvmix_policy p;
    kvmix_result r;
    if (!out) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "out", "NULL");
    if ((r = kvmix_policy_check(policy, out_error)) != KVMIX_SUCCESS) return r;
    p = *policy;
    if (!kvmix__head_dim_ok(head_dim))
        return kvmix__fail(out_error, KVMIX_ERR_BAD_SHAPE, "head_dim", KVMIX__HEAD_DIM_RULE);
    if (p.value_group_size == 0) p.value_group_size = p.group_size;
    if (p.evict.scorer != 0) kvmix_evict_policy_resolve(&p.evict, NULL);
    if (p.group_size == KVMIX_GROUP_HEAD_DIM) p.group_size = head_dim;
    if (p.value_group_size == KVMIX_GROUP_HEAD_DIM) p.value_group_size = head_dim;
    if (head_dim % p.group_size != 0)
        return kvmix__fail(out_error, KVMIX_ERR_BAD_SHAPE, "group_size",
                           "does not divide the model's head_dim");
    if (head_dim % p.value_group_size != 0)
        return kvmix__fail(out_error, KVMIX_ERR_BAD_SHAPE, "value_group_size",
                           "does not divide the model's head_dim");
    if (p.n_boost != 0 || p.boost_fraction != 0.0)
        if ((r = kvmix__policy_resolve_boost(&p, head_dim, out_error)) != KVMIX_SUCCESS) return r;
    *out = p;
    return kvmix__succeed(out_error);
}

KVMIXDEF kvmix_result kvmix_policy_apply(const kvmix_policy *policy, kvmix_cache_desc *desc,
                                         kvmix_error *out_error) {
    kvmix_policy p;
    kvmix_result r;
    if (!desc) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "desc", "NULL");
    if ((r = kvmix_policy_resolve(policy, desc->head_dim, &p, out_error)) != KVMIX_SUCCESS)
        return r;
    desc->page_tokens = p.page_tokens;
    desc->n_sink = p.sink_tokens;
    desc->n_window = desc->max_tokens_per_seq > 0 && p.window_tokens > desc->max_tokens_per_seq
                         ? desc->max_tokens_per_seq
                         : p.window_tokens;
    desc->window_values_only = p.window_values_only;
    desc->group_size = p.group_size;
    desc->value_group_size = p.value_group_size;
    desc->n_boost = p.n_boost; /* 0: the policy stores no BOOSTED block */
    desc->partial = (kvmix_cache_partial)p.partial_page;
    desc->default_precision.key_format = (uint8_t)p.key_format;
    desc->default_precision.value_format = (uint8_t)p.value_format;
    return KVMIX_SUCCESS;
}

/* ---- a token's formats and run under a policy ---------------------------------------------- */

/* A token's run (kvmix_cache_seq_set_run): its turn and its tag's formats in every bucket,
   FNV-1a hashed (0 made 1), so that tokens that will age alike share pages. */
static uint32_t kvmix__tag_run(const kvmix_tag_precision *table, kvmix_tag tag) {
    uint32_t h = 2166136261u;
    int32_t b, i;
    uint8_t bytes[4 + 2 * KVMIX_TAG_N_BUCKETS];
    for (i = 0; i < 4; i++) bytes[i] = (uint8_t)((uint32_t)tag.turn >> (8 * i));
    for (b = 0; b < KVMIX_TAG_N_BUCKETS; b++) {
        bytes[4 + 2 * b] = table->formats[b][tag.role][tag.modality].key_format;
        bytes[5 + 2 * b] = table->formats[b][tag.role][tag.modality].value_format;
    }
    for (i = 0; i < (int32_t)sizeof bytes; i++) h = (h ^ bytes[i]) * 16777619u;
    return h ? h : 1u;
}

/* The checks of a token's policy (non-NULL) and tag. */
static kvmix_result kvmix__token_ok(const kvmix_policy *policy, kvmix_tag tag) {
    kvmix_result r = kvmix_policy_check(policy, NULL);
    if (r != KVMIX_SUCCESS) return r;
    if (tag.role >= KVMIX_TAG_N_ROLES || tag.modality >= KVMIX_TAG_N_MODALITIES)
        return KVMIX_ERR_INVALID_ARGUMENT;
    return KVMIX_SUCCESS;
}

/* kvmix_policy_token_precision of a checked policy and tag. */
static kvmix_cache_precision kvmix__token_formats(const kvmix_policy *policy, kvmix_tag tag,
                                                  int32_t current_turn) {
    kvmix_cache_precision out;
    out.key_format = out.value_format = 0;
    if (policy->tag_precision)
        out = policy->tag_precision
                  ->formats[kvmix_tag_bucket_of(tag.turn, current_turn)][tag.role][tag.modality];
    if (out.key_format == 0) out.key_format = (uint8_t)policy->key_format;
    if (out.value_format == 0) out.value_format = (uint8_t)policy->value_format;
    return out;
}

KVMIXDEF kvmix_result kvmix_policy_token_precision(const kvmix_policy *policy, kvmix_tag tag,
                                                   int32_t current_turn,
                                                   kvmix_cache_precision *out) {
    kvmix_result r;
    if (!policy || !out) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__token_ok(policy, tag)) != KVMIX_SUCCESS) return r;
    *out = kvmix__token_formats(policy, tag, current_turn);
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_policy_token_run(const kvmix_policy *policy, kvmix_tag tag,
                                             uint32_t *out_run) {
    kvmix_result r;
    if (!policy || !out_run) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__token_ok(policy, tag)) != KVMIX_SUCCESS) return r;
    *out_run = policy->tag_precision ? kvmix__tag_run(policy->tag_precision, tag) : 0;
    return KVMIX_SUCCESS;
}

/* What a position asks for under a policy at a turn: kvmix_cache_seq_age's question. */
typedef struct kvmix__turn_wants {
    const kvmix_policy *policy;
    const kvmix_tag *tags;
    int32_t n_tags, current_turn;
} kvmix__turn_wants;

static kvmix_result kvmix__turn_wants_of(void *ctx, int32_t position, kvmix_cache_precision *out) {
    const kvmix__turn_wants *t = (const kvmix__turn_wants *)ctx;
    if (position >= t->n_tags) return KVMIX_ERR_INVALID_ARGUMENT;
    if (t->tags[position].role >= KVMIX_TAG_N_ROLES ||
        t->tags[position].modality >= KVMIX_TAG_N_MODALITIES)
        return KVMIX_ERR_INVALID_ARGUMENT;
    *out = kvmix__token_formats(t->policy, t->tags[position], t->current_turn);
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_policy_retier_turn(const kvmix_policy *policy, kvmix_cache *cache,
                                               int32_t seq, const kvmix_tag *tags, int32_t n_tags,
                                               int32_t current_turn, int32_t *out_pages) {
    kvmix__turn_wants t;
    kvmix_result r;
    if (!policy || !cache || !tags) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix_policy_check(policy, NULL)) != KVMIX_SUCCESS) return r;
    if (n_tags < 0 || current_turn < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    t.policy = policy;
    t.tags = tags;
    t.n_tags = n_tags;
    t.current_turn = current_turn;
    return kvmix_cache_seq_age(cache, seq, kvmix__turn_wants_of, &t, out_pages);
}

// >>alloc
/*
   Bit allocation. Every allocator validates the whole problem first (kvmix__alloc_check), then
   checks that the cheapest choice fits the budget; from there on nothing can fail, so the
   caller's `choice` array serves as the working assignment.

   Costs are in token-bits: c[t][p] = tokens[t] * bits[p] (tag_bits[t][p] when given) in
   double, and the budget is limit = budget_bits * T with T = sum of tokens (exact: an int64 sum
   of at most 2^53). The canonical test of a choice is kvmix__alloc_cost(choice) <= limit, summed in tag order. The
   fast paths add costs in other orders (subset-sum tables, running sums), which may differ from
   the canonical sum by rounding. So a fast-path cost above limit + tol rejects, one at most
   limit - tol accepts, and one in between is summed canonically before the choice is kept; tol
   bounds the rounding error of the fast sums (a few dozen ulps of the largest possible cost).
   With integer token counts and bits that are multiples of 2^-k (every kvmix format's are) all
   sums are exact, and the band only catches choices exactly at the budget; tag_bits priced by
   runs are any doubles, and the band is what keeps their sums honest.

   Two-level exhaustive: tags 0..7 form an inner set whose 256 subset sums of (cost, distortion)
   increments are tabulated; an outer loop runs over the subsets of the other tags (up to 2^14),
   summing their increments directly, and the inner loop adds the table: two additions, one
   compare per assignment, no drift (a Gray-code walk over all n bits would do one addition per
   state but accumulate rounding over 4M steps, and branch on which bit flips).

   Knapsack: costs relative to each tag's cheapest precision, so the grid spans only the room
   above the cheapest choice (S = limit - C) and the all-cheapest choice is always on it.
   dp[t][w] = the least distortion of tags 0..t with rounded extra cost at most w cells;
   dp[t][w] = min_p dp[t-1][w - u[t][p]] + D[t][p], dp[-1][w] = 0. Two rows of doubles and a
   byte per (tag, cell) for the argmin p; the choice is read back from w = budget_steps. Rounding
   every u up keeps the real extra cost at most w * q <= S; should rounding of q itself let the
   canonical sum exceed the limit, the read-back restarts from w - 1 (then optimal = 0).
*/
#include <float.h>

#define KVMIX__ALLOC_MAX_TOTAL_TOKENS 9007199254740992LL /* 2^53 */
#define KVMIX__ALLOC_INNER_BITS       8
#define KVMIX__ALLOC_2_POW_M40        9.094947017729282379e-13 /* 2^-40 */
#define KVMIX__ALLOC_2_POW_M50        8.881784197001252323e-16 /* 2^-50 */

typedef struct kvmix__alloc_info {
    double total_tokens; /* T */
    double limit;        /* budget_bits * T, in token-bits */
} kvmix__alloc_info;

/* A greedy candidate: its gain per bit and its tag. */
typedef struct kvmix__alloc_item {
    double key;
    int32_t tag;
    int32_t reserved;
} kvmix__alloc_item;

static kvmix__why kvmix__alloc_check(const kvmix_alloc_problem *p, kvmix__alloc_info *info) {
    const kvmix_result bad = KVMIX_ERR_INVALID_ARGUMENT, bad_value = KVMIX_ERR_BAD_VALUE;
    int64_t total = 0;
    double worst = 0.0;
    int32_t t, k;
    if (!p) return kvmix__why_not(KVMIX_ERR_NULL_POINTER, "problem", "NULL");
    if (!kvmix__int_in(p->n_tags, 1, KVMIX_ALLOC_MAX_TAGS, 1))
        return kvmix__why_not(bad, "n_tags", "must be in 1 .. KVMIX_ALLOC_MAX_TAGS");
    if (!kvmix__int_in(p->n_precisions, 1, KVMIX_ALLOC_MAX_PRECISIONS, 1))
        return kvmix__why_not(bad, "n_precisions", "must be in 1 .. KVMIX_ALLOC_MAX_PRECISIONS");
    if (!p->tokens || !p->distortion || !p->bits)
        return kvmix__why_not(KVMIX_ERR_NULL_POINTER,
                              !p->tokens       ? "tokens"
                              : !p->distortion ? "distortion"
                                               : "bits",
                              "NULL");
    for (t = 0; t < p->n_tags; t++) {
        if (p->tokens[t] < 0 || p->tokens[t] > KVMIX__ALLOC_MAX_TOTAL_TOKENS - total)
            return kvmix__why_not(bad, "tokens", "a count below 0, or a sum past 2^53");
        total += p->tokens[t];
    }
    if (total == 0) return kvmix__why_not(bad, "tokens", "sum to 0");
    for (k = 0; k < p->n_precisions; k++)
        if (!(p->bits[k] > 0.0 && p->bits[k] <= KVMIX_ALLOC_MAX_BITS))
            return kvmix__why_not(bad_value, "bits", "a value not in (0, 65536]");
    for (k = 0; p->tag_bits && k < p->n_tags * p->n_precisions; k++)
        if (!(p->tag_bits[k] > 0.0 && p->tag_bits[k] <= KVMIX_ALLOC_MAX_BITS))
            return kvmix__why_not(bad_value, "tag_bits", "a value not in (0, 65536]");
    if (!(p->budget_bits > 0.0 && p->budget_bits <= DBL_MAX))
        return kvmix__why_not(bad_value, "budget_bits", "not finite and > 0");
    for (t = 0; t < p->n_tags; t++) {
        const double *row = p->distortion + (size_t)t * (size_t)p->n_precisions;
        double most = 0.0;
        for (k = 0; k < p->n_precisions; k++) {
            if (!(row[k] >= 0.0 && row[k] <= DBL_MAX))
                return kvmix__why_not(bad_value, "distortion", "a value not finite and >= 0");
            if (row[k] > most) most = row[k];
        }
        worst += most;
    }
    if (!(worst <= DBL_MAX))
        return kvmix__why_not(bad_value, "distortion", "the tags' largest sum past DBL_MAX");
    info->total_tokens = (double)total;
    info->limit = p->budget_bits * info->total_tokens;
    if (!(info->limit <= DBL_MAX))
        return kvmix__why_not(bad_value, "budget_bits", "times the tokens, past DBL_MAX");
    return kvmix__why_ok();
}

KVMIXDEF kvmix_result kvmix_alloc_problem_check(const kvmix_alloc_problem *problem,
                                                kvmix_error *out_error) {
    kvmix__alloc_info info;
    return kvmix__report(out_error, kvmix__alloc_check(problem, &info));
}

/* Tag t's tokens at precision k, in token-bits. */
static double kvmix__alloc_tag_cost(const kvmix_alloc_problem *p, int32_t t, int32_t k) {
    return (double)p->tokens[t] *
           (p->tag_bits ? p->tag_bits[(size_t)t * (size_t)p->n_precisions + (size_t)k]
                        : p->bits[k]);
}

/* The canonical cost of a choice, in token-bits, summed in tag order. */
static double kvmix__alloc_cost(const kvmix_alloc_problem *p, const int32_t *choice) {
    double cost = 0.0;
    int32_t t;
    for (t = 0; t < p->n_tags; t++) cost += kvmix__alloc_tag_cost(p, t, choice[t]);
    return cost;
}

/* The same for the two-level assignment `mask` (bit t set = tag t at high). */
static double kvmix__alloc_mask_cost(const kvmix_alloc_problem *p, int32_t low, int32_t high,
                                     uint32_t mask) {
    double cost = 0.0;
    int32_t t;
    for (t = 0; t < p->n_tags; t++)
        cost += kvmix__alloc_tag_cost(p, t, (mask >> t) & 1u ? high : low);
    return cost;
}

static void kvmix__alloc_summarize(const kvmix_alloc_problem *p, const kvmix__alloc_info *info,
                                   const int32_t *choice, kvmix_alloc_method method,
                                   int32_t optimal, kvmix_alloc_summary *out) {
    double distortion = 0.0;
    int32_t t;
    if (!out) return;
    for (t = 0; t < p->n_tags; t++)
        distortion += p->distortion[(size_t)t * (size_t)p->n_precisions + (size_t)choice[t]];
    out->distortion = distortion;
    out->bits = kvmix__alloc_cost(p, choice) / info->total_tokens;
    out->method = method;
    out->optimal = optimal;
}

static kvmix_result kvmix__alloc_resolve(int32_t n_tags, kvmix_alloc_method method,
                                         kvmix_alloc_method *out) {
    if (n_tags < 1 || n_tags > KVMIX_ALLOC_MAX_TAGS) return KVMIX_ERR_INVALID_ARGUMENT;
    switch (method) {
    case KVMIX_ALLOC_AUTO:
        *out = n_tags <= KVMIX_ALLOC_EXACT_MAX_TAGS ? KVMIX_ALLOC_EXHAUSTIVE : KVMIX_ALLOC_GREEDY;
        return KVMIX_SUCCESS;
    case KVMIX_ALLOC_EXHAUSTIVE:
        if (n_tags > KVMIX_ALLOC_EXACT_MAX_TAGS) return KVMIX_ERR_INVALID_ARGUMENT;
        *out = method;
        return KVMIX_SUCCESS;
    case KVMIX_ALLOC_GREEDY: *out = method; return KVMIX_SUCCESS;
    case KVMIX_ALLOC_KNAPSACK: break;
    }
    return KVMIX_ERR_INVALID_ARGUMENT;
}

KVMIXDEF kvmix_result kvmix_alloc_two_level_workspace_bytes(int32_t n_tags,
                                                            kvmix_alloc_method method,
                                                            size_t *out_bytes) {
    kvmix_alloc_method resolved = KVMIX_ALLOC_AUTO;
    kvmix_result r;
    if (!out_bytes) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__alloc_resolve(n_tags, method, &resolved)) != KVMIX_SUCCESS) return r;
    *out_bytes =
        resolved == KVMIX_ALLOC_GREEDY ? (size_t)n_tags * 2 * sizeof(kvmix__alloc_item) : 0;
    return KVMIX_SUCCESS;
}

/* Exhaustive two-level search; writes the best assignment into choice. */
static void kvmix__alloc_exhaustive(const kvmix_alloc_problem *p, const kvmix__alloc_info *info,
                                    int32_t low, int32_t high, int32_t *choice) {
    double dc[KVMIX_ALLOC_EXACT_MAX_TAGS], dd[KVMIX_ALLOC_EXACT_MAX_TAGS];
    double tc[1 << KVMIX__ALLOC_INNER_BITS], td[1 << KVMIX__ALLOC_INNER_BITS];
    double base_c = 0.0, base_d = 0.0, most = 0.0, tol, limit_hi, limit_lo, best_d = HUGE_VAL;
    const size_t np = (size_t)p->n_precisions;
    const int32_t n = p->n_tags;
    const int32_t n_in = n < KVMIX__ALLOC_INNER_BITS ? n : KVMIX__ALLOC_INNER_BITS;
    const uint32_t n_inner = 1u << n_in, n_outer = 1u << (n - n_in);
    uint32_t best = 0, j, om;
    int32_t t;
    for (t = 0; t < n; t++) {
        double lo = kvmix__alloc_tag_cost(p, t, low);
        double hi = kvmix__alloc_tag_cost(p, t, high);
        base_c += lo;
        most += hi > lo ? hi : lo;
        dc[t] = hi - lo;
        base_d += p->distortion[(size_t)t * np + (size_t)low];
        dd[t] = p->distortion[(size_t)t * np + (size_t)high] -
                p->distortion[(size_t)t * np + (size_t)low];
    }
    tc[0] = td[0] = 0.0;
    for (j = 1; j < n_inner; j++) {
        int32_t b = 0;
        while (!((j >> b) & 1u)) b++;
        tc[j] = tc[j & (j - 1u)] + dc[b];
        td[j] = td[j & (j - 1u)] + dd[b];
    }
    tol = most * KVMIX__ALLOC_2_POW_M40; /* at most 2 * 22 + 2 roundings of <= 2^-53 most */
    limit_hi = info->limit + tol;
    limit_lo = info->limit - tol;
    for (om = 0; om < n_outer; om++) {
        double oc = base_c, od = base_d;
        int32_t b;
        for (b = 0; b < n - n_in; b++)
            if ((om >> b) & 1u) {
                oc += dc[n_in + b];
                od += dd[n_in + b];
            }
        for (j = 0; j < n_inner; j++) {
            double c = oc + tc[j], d = od + td[j];
            if ((c <= limit_hi) & (d < best_d)) {
                uint32_t mask = (om << n_in) | j;
                if (c > limit_lo && kvmix__alloc_mask_cost(p, low, high, mask) > info->limit)
                    continue;
                best_d = d;
                best = mask;
            }
        }
    }
    for (t = 0; t < n; t++) choice[t] = (best >> t) & 1u ? high : low;
}

/* Stable bottom-up merge sort of a[0..n) by decreasing key, ping-ponging with b; returns the
   array that holds the result. Stable, so equal keys keep increasing tag order. */
static kvmix__alloc_item *kvmix__alloc_sort(kvmix__alloc_item *a, kvmix__alloc_item *b, size_t n) {
    size_t width, lo;
    for (width = 1; width < n; width *= 2) {
        kvmix__alloc_item *swap;
        for (lo = 0; lo < n; lo += 2 * width) {
            size_t mid = n - lo > width ? lo + width : n;
            size_t hi = n - mid > width ? mid + width : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) b[k++] = a[j].key > a[i].key ? a[j++] : a[i++];
            while (i < mid) b[k++] = a[i++];
            while (j < hi) b[k++] = a[j++];
        }
        swap = a;
        a = b;
        b = swap;
    }
    return a;
}

/* Greedy two-level allocation. workspace: two arrays of [n_tags] items. */
static void kvmix__alloc_greedy(const kvmix_alloc_problem *p, const kvmix__alloc_info *info,
                                int32_t low, int32_t high, void *workspace, int32_t *choice) {
    kvmix__alloc_item *items = (kvmix__alloc_item *)workspace;
    const size_t np = (size_t)p->n_precisions;
    double cost = 0.0, most = 0.0, tol;
    size_t m = 0, i;
    int32_t t;
    for (t = 0; t < p->n_tags; t++) {
        double lo = kvmix__alloc_tag_cost(p, t, low);
        double hi = kvmix__alloc_tag_cost(p, t, high);
        double gain = p->distortion[(size_t)t * np + (size_t)low] -
                      p->distortion[(size_t)t * np + (size_t)high];
        choice[t] = low;
        cost += lo;
        most += hi > lo ? hi : lo;
        if (gain > 0.0) {
            items[m].key = hi - lo > 0.0 ? gain / (hi - lo) : HUGE_VAL;
            items[m].tag = t;
            items[m].reserved = 0;
            m++;
        }
    }
    items = kvmix__alloc_sort(items, items + p->n_tags, m);
    /* the running sum has at most n_tags + 1 more roundings than the canonical one */
    tol = most * ((double)p->n_tags + 16.0) * KVMIX__ALLOC_2_POW_M50;
    for (i = 0; i < m; i++) {
        double next;
        t = items[i].tag;
        next = cost + (kvmix__alloc_tag_cost(p, t, high) - kvmix__alloc_tag_cost(p, t, low));
        if (next > info->limit + tol) continue;
        choice[t] = high;
        if (next > info->limit - tol) {
            next = kvmix__alloc_cost(p, choice);
            if (next > info->limit) {
                choice[t] = low;
                continue;
            }
        }
        cost = next;
    }
}

KVMIXDEF kvmix_result kvmix_alloc_two_level(const kvmix_alloc_problem *problem, int32_t low,
                                            int32_t high, kvmix_alloc_method method,
                                            void *workspace, size_t workspace_bytes,
                                            int32_t *choice, kvmix_alloc_summary *out) {
    kvmix__alloc_info info;
    kvmix_alloc_method resolved = KVMIX_ALLOC_AUTO;
    size_t need = 0;
    double cost = 0.0;
    kvmix_result r;
    int32_t t;
    if ((r = kvmix__alloc_check(problem, &info).result) != KVMIX_SUCCESS) return r;
    if (!choice) return KVMIX_ERR_NULL_POINTER;
    if (low < 0 || low >= problem->n_precisions || high < 0 || high >= problem->n_precisions ||
        !(problem->bits[low] < problem->bits[high]))
        return KVMIX_ERR_INVALID_ARGUMENT;
    if ((r = kvmix_alloc_two_level_workspace_bytes(problem->n_tags, method, &need)) !=
        KVMIX_SUCCESS)
        return r;
    (void)kvmix__alloc_resolve(problem->n_tags, method, &resolved);
    if (need > 0) {
        if (workspace_bytes < need) return KVMIX_ERR_BUFFER_TOO_SMALL;
        if (!workspace) return KVMIX_ERR_NULL_POINTER;
        if (((uintptr_t)workspace & 7u) != 0) return KVMIX_ERR_INVALID_ARGUMENT;
    }
    for (t = 0; t < problem->n_tags; t++) cost += kvmix__alloc_tag_cost(problem, t, low);
    if (cost > info.limit) return KVMIX_ERR_OUT_OF_MEMORY;
    if (resolved == KVMIX_ALLOC_EXHAUSTIVE)
        kvmix__alloc_exhaustive(problem, &info, low, high, choice);
    else
        kvmix__alloc_greedy(problem, &info, low, high, workspace, choice);
    kvmix__alloc_summarize(problem, &info, choice, resolved, resolved == KVMIX_ALLOC_EXHAUSTIVE,
                           out);
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_alloc_knapsack_workspace_bytes(const kvmix_alloc_problem *problem,
                                                           int32_t budget_steps,
                                                           size_t *out_bytes) {
    size_t cells;
    if (!problem || !out_bytes) return KVMIX_ERR_NULL_POINTER;
    if (problem->n_tags < 1 || problem->n_tags > KVMIX_ALLOC_MAX_TAGS ||
        problem->n_precisions < 1 || problem->n_precisions > KVMIX_ALLOC_MAX_PRECISIONS ||
        budget_steps < 0 || budget_steps > KVMIX_ALLOC_MAX_STEPS)
        return KVMIX_ERR_INVALID_ARGUMENT;
    cells = (size_t)(budget_steps == 0 ? KVMIX_ALLOC_STEPS_DEFAULT : budget_steps) + 1;
    if (cells > (size_t)-1 / ((size_t)problem->n_tags + 16)) return KVMIX_ERR_INVALID_ARGUMENT;
    *out_bytes = cells * ((size_t)problem->n_tags + 16);
    return KVMIX_SUCCESS;
}

/* Tag t's cost at its cheapest precision, in token-bits. */
static double kvmix__alloc_tag_cheapest(const kvmix_alloc_problem *p, int32_t t) {
    double least = kvmix__alloc_tag_cost(p, t, 0), c;
    int32_t k;
    for (k = 1; k < p->n_precisions; k++)
        if ((c = kvmix__alloc_tag_cost(p, t, k)) < least) least = c;
    return least;
}

/* Cells of tag t's extra cost at precision k over its cheapest cost `cheapest`, rounded up (a
   value within 2^-40 relative of a whole number of cells counts as that number, so that a cost
   meant to lie on the grid is not pushed a cell up by rounding; the canonical check of the result
   covers the difference); steps + 1 (never fits) when above steps. */
static int32_t kvmix__alloc_units(const kvmix_alloc_problem *p, int32_t t, int32_t k,
                                  double cheapest, double room, int32_t steps) {
    double extra = kvmix__alloc_tag_cost(p, t, k) - cheapest;
    double x;
    if (!(extra > 0.0)) return 0;
    x = extra * (double)steps / room; /* +inf when room is 0 */
    if (!(x <= (double)steps + 1.0)) return steps + 1;
    x = ceil(x - x * KVMIX__ALLOC_2_POW_M40);
    return x > (double)steps ? steps + 1 : (int32_t)x;
}

/* The grid of one knapsack call: the cheapest choice's cost, the room above it (limit -
   cheapest) and the number of cells. */
typedef struct kvmix__alloc_grid {
    kvmix__alloc_info info;
    int32_t steps;
    double cheapest, room;
} kvmix__alloc_grid;

/* Checks a knapsack call's arguments and sets up its grid. */
static kvmix_result kvmix__alloc_grid_init(const kvmix_alloc_problem *problem, int32_t budget_steps,
                                           const void *workspace, size_t workspace_bytes,
                                           kvmix__alloc_grid *g) {
    size_t need = 0;
    kvmix_result r;
    int32_t t;
    if ((r = kvmix__alloc_check(problem, &g->info).result) != KVMIX_SUCCESS) return r;
    if ((r = kvmix_alloc_knapsack_workspace_bytes(problem, budget_steps, &need)) != KVMIX_SUCCESS)
        return r;
    if (workspace_bytes < need) return KVMIX_ERR_BUFFER_TOO_SMALL;
    if (!workspace) return KVMIX_ERR_NULL_POINTER;
    if (((uintptr_t)workspace & 7u) != 0) return KVMIX_ERR_INVALID_ARGUMENT;
    g->cheapest = 0.0;
    for (t = 0; t < problem->n_tags; t++) g->cheapest += kvmix__alloc_tag_cheapest(problem, t);
    if (g->cheapest > g->info.limit) return KVMIX_ERR_OUT_OF_MEMORY;
    g->steps = budget_steps == 0 ? KVMIX_ALLOC_STEPS_DEFAULT : budget_steps;
    g->room = g->info.limit - g->cheapest;
    return KVMIX_SUCCESS;
}

/* The dynamic program over the grid. workspace: two rows of [steps + 1] doubles, then the argmin
   table [n_tags][steps + 1] bytes. Returns the final row: the least distortion of all tags with
   rounded extra cost at most w cells, for every w. */
static const double *kvmix__alloc_dp(const kvmix_alloc_problem *problem, const kvmix__alloc_grid *g,
                                     void *workspace) {
    const int32_t steps = g->steps;
    const size_t cells = (size_t)steps + 1;
    double *prev = (double *)workspace, *next = prev + cells;
    uint8_t *table = (uint8_t *)(next + cells);
    int32_t units[KVMIX_ALLOC_MAX_PRECISIONS];
    int32_t t, k, w;
    for (w = 0; w <= steps; w++) prev[w] = 0.0;
    for (t = 0; t < problem->n_tags; t++) {
        const double *row = problem->distortion + (size_t)t * (size_t)problem->n_precisions;
        uint8_t *arg = table + (size_t)t * cells;
        const double cheapest = kvmix__alloc_tag_cheapest(problem, t);
        double *swap;
        for (k = 0; k < problem->n_precisions; k++)
            units[k] = kvmix__alloc_units(problem, t, k, cheapest, g->room, steps);
        for (w = 0; w <= steps; w++) next[w] = HUGE_VAL;
        for (k = 0; k < problem->n_precisions; k++) {
            const double d = row[k];
            const int32_t u = units[k];
            if (u > steps) continue;
            for (w = u; w <= steps; w++) {
                double v = prev[w - u] + d;
                if (v < next[w]) {
                    next[w] = v;
                    arg[w] = (uint8_t)k;
                }
            }
        }
        swap = prev;
        prev = next;
        next = swap;
    }
    return prev;
}

KVMIXDEF kvmix_result kvmix_alloc_knapsack(const kvmix_alloc_problem *problem, int32_t budget_steps,
                                           void *workspace, size_t workspace_bytes, int32_t *choice,
                                           kvmix_alloc_summary *out) {
    kvmix__alloc_grid g;
    const uint8_t *table;
    size_t cells;
    int32_t t, k, w, capacity;
    kvmix_result r;
    if (problem && !choice) return KVMIX_ERR_NULL_POINTER;
    if ((r = kvmix__alloc_grid_init(problem, budget_steps, workspace, workspace_bytes, &g)) !=
        KVMIX_SUCCESS)
        return r;
    (void)kvmix__alloc_dp(problem, &g, workspace);
    cells = (size_t)g.steps + 1;
    table = (const uint8_t *)((double *)workspace + 2 * cells);
    /* read the choice back; restart one cell lower if rounding let the real sum overspend */
    for (capacity = g.steps;; capacity--) {
        w = capacity;
        for (t = problem->n_tags; t-- > 0;) {
            k = table[(size_t)t * cells + (size_t)w];
            choice[t] = k;
            w -= kvmix__alloc_units(problem, t, k, kvmix__alloc_tag_cheapest(problem, t), g.room,
                                    g.steps);
        }
        KVMIX_ASSERT(w >= 0);
        if (capacity == 0 || kvmix__alloc_cost(problem, choice) <= g.info.limit) break;
    }
    kvmix__alloc_summarize(problem, &g.info, choice, KVMIX_ALLOC_KNAPSACK, capacity == g.steps,
                           out);
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_alloc_knapsack_sweep(const kvmix_alloc_problem *problem,
                                                 int32_t budget_steps, void *workspace,
                                                 size_t workspace_bytes, double *out_budget_bits,
                                                 double *out_distortion) {
    kvmix__alloc_grid g;
    const double *last;
    int32_t w;
    kvmix_result r;
    if ((r = kvmix__alloc_grid_init(problem, budget_steps, workspace, workspace_bytes, &g)) !=
        KVMIX_SUCCESS)
        return r;
    last = kvmix__alloc_dp(problem, &g, workspace);
    for (w = 0; w <= g.steps; w++) {
        if (out_budget_bits)
            out_budget_bits[w] =
                (g.cheapest + g.room * ((double)w / (double)g.steps)) / g.info.total_tokens;
        if (out_distortion) out_distortion[w] = last[w];
    }
    return KVMIX_SUCCESS;
}

// >>intent

/* FNV-1a over 64-bit words. */
static uint64_t kvmix__fnv_word(uint64_t h, uint64_t word) {
    int i;
    for (i = 0; i < 8; i++) {
        h ^= (word >> (8 * i)) & 0xffu;
        h *= 1099511628211u;
    }
    return h;
}

static uint64_t kvmix__session_hash(int32_t kind, uint64_t id, const int32_t *ids, int32_t n_ids) {
    uint64_t h = kvmix__fnv_word(14695981039346656037u, (uint64_t)kind);
    int32_t i;
    h = kvmix__fnv_word(h, id);
    for (i = 0; i < n_ids; i++) h = kvmix__fnv_word(h, (uint32_t)ids[i]);
    return kvmix__fnv_word(h, (uint64_t)n_ids);
}

KVMIXDEF kvmix_result kvmix_session_key_resolve(const uint64_t *session_id, const int32_t *span_ids,
                                                int32_t n_span_ids, const int32_t *input_ids,
                                                int32_t n_input_ids, int32_t n_prefix,
                                                int32_t max_key_ids, uint64_t request_serial,
                                                kvmix_session_key *out_key) {
    kvmix_session_key k;
    if (!out_key) return KVMIX_ERR_NULL_POINTER;
    if (n_span_ids < 0 || n_input_ids < 0 || n_prefix < 0 || max_key_ids < 1)
        return KVMIX_ERR_INVALID_ARGUMENT;
    if ((n_span_ids > 0 && !span_ids) || (n_input_ids > 0 && !input_ids))
        return KVMIX_ERR_NULL_POINTER;
    memset(&k, 0, sizeof k);
    if (session_id) {
        k.kind = KVMIX_SESSION_KEY_ID;
        k.id = *session_id;
    } else if (n_span_ids > 0) {
        k.kind = KVMIX_SESSION_KEY_SPAN;
        k.ids = span_ids;
        k.n_ids = n_span_ids < max_key_ids ? n_span_ids : max_key_ids;
    } else if (n_prefix > 0 && n_input_ids >= n_prefix) {
        k.kind = KVMIX_SESSION_KEY_PREFIX;
        k.ids = input_ids;
        k.n_ids = n_prefix < max_key_ids ? n_prefix : max_key_ids;
    } else {
        k.kind = KVMIX_SESSION_KEY_LOCAL;
        k.id = request_serial;
    }
    k.hash = kvmix__session_hash(k.kind, k.id, k.ids, k.n_ids);
    *out_key = k;
    return KVMIX_SUCCESS;
}

/* The desc with defaults, or INVALID_ARGUMENT. */
static kvmix__why kvmix__session_desc_resolve(const kvmix_session_store_desc *in,
                                              kvmix_session_store_desc *out) {
    const kvmix_result bad = KVMIX_ERR_INVALID_ARGUMENT;
    *out = *in;
    if (out->max_key_ids == 0) out->max_key_ids = 256;
    if (!kvmix__int_in(out->capacity, 1, 1 << 20, 1))
        return kvmix__why_not(bad, "capacity", "must be in 1 .. 2^20");
    if (!kvmix__int_in(out->memory_floats, 1, 1 << 28, 1))
        return kvmix__why_not(bad, "memory_floats", "must be in 1 .. 2^28");
    if (!kvmix__int_in(out->max_key_ids, 1, 1 << 16, 1))
        return kvmix__why_not(bad, "max_key_ids", "must be in 0 .. 2^16");
    return kvmix__why_ok();
}

static int32_t kvmix__session_buckets(int32_t capacity) {
    int32_t n = 1;
    while (n < capacity) n *= 2;
    return n;
}

/* Region sizes of a resolved desc, each a multiple of 16 bytes: entries, buckets, key ids,
   memories. */
static void kvmix__session_regions(const kvmix_session_store_desc *d, size_t sizes[4]) {
    size_t cap = (size_t)d->capacity;
    sizes[0] = (cap * sizeof(kvmix_session_entry) + 15u) & ~(size_t)15u;
    sizes[1] = ((size_t)kvmix__session_buckets(d->capacity) * 4u + 15u) & ~(size_t)15u;
    sizes[2] = (cap * (size_t)d->max_key_ids * 4u + 15u) & ~(size_t)15u;
    sizes[3] = (cap * (size_t)d->memory_floats * 4u + 15u) & ~(size_t)15u;
}

KVMIXDEF kvmix_result kvmix_session_store_memory_bytes(const kvmix_session_store_desc *desc,
                                                       size_t *out_bytes, kvmix_error *out_error) {
    kvmix_session_store_desc d;
    size_t sizes[4];
    kvmix__why w;
    if (!desc || !out_bytes)
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, !desc ? "desc" : "out_bytes", "NULL");
    if ((w = kvmix__session_desc_resolve(desc, &d)).result != KVMIX_SUCCESS)
        return kvmix__report(out_error, w);
    kvmix__session_regions(&d, sizes);
    *out_bytes = sizes[0] + sizes[1] + sizes[2] + sizes[3];
    return kvmix__succeed(out_error);
}

KVMIXDEF kvmix_result kvmix_session_store_init(kvmix_session_store *store,
                                               const kvmix_session_store_desc *desc, void *memory,
                                               size_t memory_bytes, kvmix_error *out_error) {
    kvmix_session_store s;
    size_t sizes[4];
    uint8_t *m = (uint8_t *)memory;
    int32_t i;
    kvmix__why w;
    if (!store || !desc || !memory)
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER,
                           !store  ? "store"
                           : !desc ? "desc"
                                   : "memory",
                           "NULL");
    memset(&s, 0, sizeof s);
    if ((w = kvmix__session_desc_resolve(desc, &s.desc)).result != KVMIX_SUCCESS)
        return kvmix__report(out_error, w);
    if (((uintptr_t)memory & 15u) != 0)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "memory", "not 16-byte aligned");
    kvmix__session_regions(&s.desc, sizes);
    if (memory_bytes < sizes[0] + sizes[1] + sizes[2] + sizes[3])
        return kvmix__fail(out_error, KVMIX_ERR_BUFFER_TOO_SMALL, "memory_bytes",
                           "less than kvmix_session_store_memory_bytes");
    s.n_buckets = kvmix__session_buckets(s.desc.capacity);
    s.entries = (kvmix_session_entry *)(void *)m;
    s.buckets = (int32_t *)(void *)(m + sizes[0]);
    s.key_ids = (int32_t *)(void *)(m + sizes[0] + sizes[1]);
    s.memories = (float *)(void *)(m + sizes[0] + sizes[1] + sizes[2]);
    memset(s.entries, 0, sizes[0]);
    for (i = 0; i < s.n_buckets; i++) s.buckets[i] = -1;
    for (i = 0; i < s.desc.capacity; i++) s.entries[i].next = -1;
    *store = s;
    return kvmix__succeed(out_error);
}

static int32_t *kvmix__session_ids(const kvmix_session_store *s, int32_t e) {
    return s->key_ids + (size_t)e * (size_t)s->desc.max_key_ids;
}

/* The entry holding `key`, or -1: hash candidates, then kind, id and ids compared. */
static int32_t kvmix__session_find(const kvmix_session_store *s, const kvmix_session_key *key) {
    int32_t e = s->buckets[key->hash & (uint64_t)(s->n_buckets - 1)];
    for (; e >= 0; e = s->entries[e].next) {
        const kvmix_session_entry *x = &s->entries[e];
        if (x->hash == key->hash && x->kind == key->kind && x->id == key->id &&
            x->n_ids == key->n_ids &&
            (key->n_ids == 0 ||
             memcmp(kvmix__session_ids(s, e), key->ids, (size_t)key->n_ids * 4u) == 0))
            return e;
    }
    return -1;
}

/* A free entry, else the least recently used one, taken out of its bucket. */
static int32_t kvmix__session_take(kvmix_session_store *s) {
    int32_t e, best = 0, *link;
    for (e = 0; e < s->desc.capacity; e++) {
        if (s->entries[e].last_use == 0) return e;
        if (s->entries[e].last_use < s->entries[best].last_use) best = e;
    }
    link = &s->buckets[s->entries[best].hash & (uint64_t)(s->n_buckets - 1)];
    while (*link != best) link = &s->entries[*link].next;
    *link = s->entries[best].next;
    s->n_used--;
    return best;
}

KVMIXDEF kvmix_result kvmix_session_store_acquire(kvmix_session_store *store,
                                                  const kvmix_session_key *key, float **out_memory,
                                                  int32_t *out_found) {
    int32_t e;
    int32_t *bucket;
    kvmix_session_entry *x;
    if (!store || !key || !out_memory || !out_found) return KVMIX_ERR_NULL_POINTER;
    if (key->kind < KVMIX_SESSION_KEY_ID || key->kind > KVMIX_SESSION_KEY_LOCAL || key->n_ids < 0 ||
        key->n_ids > store->desc.max_key_ids || (key->n_ids > 0 && !key->ids))
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (key->kind == KVMIX_SESSION_KEY_LOCAL) {
        *out_memory = NULL;
        *out_found = 0;
        return KVMIX_SUCCESS;
    }
    e = kvmix__session_find(store, key);
    *out_found = e >= 0;
    if (e < 0) {
        e = kvmix__session_take(store);
        x = &store->entries[e];
        x->hash = key->hash;
        x->id = key->id;
        x->kind = key->kind;
        x->n_ids = key->n_ids;
        if (key->n_ids > 0) memcpy(kvmix__session_ids(store, e), key->ids, (size_t)key->n_ids * 4u);
        memset(store->memories + (size_t)e * (size_t)store->desc.memory_floats, 0,
               (size_t)store->desc.memory_floats * sizeof(float));
        bucket = &store->buckets[key->hash & (uint64_t)(store->n_buckets - 1)];
        x->next = *bucket;
        *bucket = e;
        store->n_used++;
    }
    store->entries[e].last_use = ++store->clock;
    *out_memory = store->memories + (size_t)e * (size_t)store->desc.memory_floats;
    return KVMIX_SUCCESS;
}

/* Scales row x of n floats to unit norm in place; 0 when its norm is 0 (left as it is). */
static int kvmix__unit_row(double *x, int32_t n) {
    double norm = 0.0;
    int32_t i;
    for (i = 0; i < n; i++) norm += x[i] * x[i];
    if (norm == 0.0) return 0;
    norm = sqrt(norm);
    for (i = 0; i < n; i++) x[i] /= norm;
    return 1;
}

KVMIXDEF kvmix_result kvmix_query_memory_update(float *memory, int32_t n_layers, int32_t n_q_heads,
                                                int32_t head_dim, const float *queries,
                                                int32_t n_tokens, float decay) {
    double mean[KVMIX_MAX_HEAD_DIM], row[KVMIX_MAX_HEAD_DIM];
    size_t rows, r, stride, i;
    int32_t t, c;
    if (!memory || (!queries && n_tokens > 0)) return KVMIX_ERR_NULL_POINTER;
    if (n_layers < 1 || n_q_heads < 1 || head_dim < 1 || head_dim > KVMIX_MAX_HEAD_DIM ||
        n_tokens < 0 || !(decay >= 0.0f && decay < 1.0f))
        return KVMIX_ERR_INVALID_ARGUMENT;
    rows = (size_t)n_layers * (size_t)n_q_heads;
    stride = rows * (size_t)head_dim;
    for (i = 0; i < stride * (size_t)n_tokens; i++)
        if (!(queries[i] - queries[i] == 0.0f)) return KVMIX_ERR_BAD_VALUE;
    for (r = 0; r < rows; r++) {
        float *m = memory + r * (size_t)head_dim;
        double kept = 0.0;
        for (c = 0; c < head_dim; c++) mean[c] = 0.0;
        for (t = 0; t < n_tokens; t++)
            for (c = 0; c < head_dim; c++)
                mean[c] += queries[(size_t)t * stride + r * (size_t)head_dim + (size_t)c];
        if (!kvmix__unit_row(mean, head_dim)) continue; /* nothing asked: the row stays */
        for (c = 0; c < head_dim; c++) kept += (double)m[c] * (double)m[c];
        for (c = 0; c < head_dim; c++)
            row[c] = kept == 0.0 ? mean[c] : (double)decay * m[c] + (1.0 - (double)decay) * mean[c];
        if (!kvmix__unit_row(row, head_dim)) continue; /* opposite and equal: keep the old row */
        for (c = 0; c < head_dim; c++) m[c] = (float)row[c];
    }
    return KVMIX_SUCCESS;
}

/* ---- budgeted eviction --------------------------------------------------------------------- */

static int kvmix__evict_fail(kvmix_error *out_error, const char *field, const char *reason) {
    kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, field, reason);
    return 0;
}

static int kvmix__evict_policy_ok(const kvmix_evict_policy *p, kvmix_error *out_error) {
    if (p->scorer < KVMIX_EVICT_INTENT || p->scorer > KVMIX_EVICT_SNAPKV)
        return kvmix__evict_fail(out_error, "scorer", "not a kvmix_evict_scorer");
    if (p->budget_tokens < 0) return kvmix__evict_fail(out_error, "budget_tokens", "negative");
    if (p->budget_tokens == 0 && !(p->budget_fraction > 0.0 && p->budget_fraction <= 1.0))
        return kvmix__evict_fail(out_error, "budget_fraction",
                                 "not in (0, 1] while budget_tokens is 0");
    if (!(p->decay >= 0.0 && p->decay < 1.0))
        return kvmix__evict_fail(out_error, "decay", "not in [0, 1)");
    if (p->prefix_tokens < 0) return kvmix__evict_fail(out_error, "prefix_tokens", "negative");
    if (p->recent_tokens < 0) return kvmix__evict_fail(out_error, "recent_tokens", "negative");
    if (!(p->recent_fraction >= 0.0 && p->recent_fraction <= 1.0))
        return kvmix__evict_fail(out_error, "recent_fraction", "not in [0, 1]");
    if (p->observe_tokens < 0) return kvmix__evict_fail(out_error, "observe_tokens", "negative");
    if (p->pool_tokens < 0 || p->pool_tokens > KVMIX_EVICT_MAX_POOL ||
        (p->pool_tokens > 0 && p->pool_tokens % 2 == 0))
        return kvmix__evict_fail(out_error, "pool_tokens", "not odd, or past KVMIX_EVICT_MAX_POOL");
    return 1;
}

KVMIXDEF const char *kvmix_evict_scorer_name(int32_t scorer) {
    static const char *const names[] = {"intent", "query", "streaming", "h2o", "snapkv"};
    return scorer >= KVMIX_EVICT_INTENT && scorer <= KVMIX_EVICT_SNAPKV ? names[scorer - 1] : NULL;
}

/* The pooling width a policy ranks with (its default when 0); 1 = none. */
static int32_t kvmix__evict_pool_tokens(const kvmix_evict_policy *p) {
    if (p->scorer == KVMIX_EVICT_STREAMING) return 1;
    if (p->pool_tokens > 0) return p->pool_tokens;
    return p->scorer == KVMIX_EVICT_SNAPKV ? 7 : 1;
}

KVMIXDEF kvmix_result kvmix_evict_policy_resolve(kvmix_evict_policy *policy,
                                                 kvmix_error *out_error) {
    if (!policy) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "policy", "NULL");
    if (!kvmix__evict_policy_ok(policy, out_error)) return KVMIX_ERR_INVALID_ARGUMENT;
    if (policy->observe_tokens == 0) policy->observe_tokens = 32;
    if (policy->pool_tokens == 0) policy->pool_tokens = kvmix__evict_pool_tokens(policy);
    return kvmix__succeed(out_error);
}

/* The positions a valid policy keeps of n_positions: at least 1. */
static int32_t kvmix__evict_keep(const kvmix_evict_policy *p, int32_t n_positions) {
    double keep = p->budget_tokens > 0 ? (double)p->budget_tokens
                                       : ceil(p->budget_fraction * (double)n_positions);
    return keep < 1.0 ? 1 : (int32_t)keep;
}

/* The recent floor of a valid policy over n_positions: the larger of its two forms. */
static int32_t kvmix__evict_recent(const kvmix_evict_policy *p, int32_t n_positions) {
    int32_t shared = (int32_t)ceil(p->recent_fraction * (double)kvmix__evict_keep(p, n_positions));
    return shared > p->recent_tokens ? shared : p->recent_tokens;
}

KVMIXDEF kvmix_result kvmix_evict_budget(const kvmix_evict_policy *policy, int32_t n_positions,
                                         int32_t *out_keep) {
    if (!policy || !out_keep) return KVMIX_ERR_NULL_POINTER;
    if (!kvmix__evict_policy_ok(policy, NULL) || n_positions < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    *out_keep = kvmix__evict_keep(policy, n_positions);
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_evict_forced(const kvmix_evict_policy *policy, int32_t n_positions,
                                         int32_t actionable_first, int32_t actionable_end,
                                         uint8_t *forced) {
    int32_t t;
    if (!policy || (!forced && n_positions > 0)) return KVMIX_ERR_NULL_POINTER;
    if (!kvmix__evict_policy_ok(policy, NULL) || n_positions < 0 || actionable_first < 0 ||
        actionable_end < actionable_first || actionable_end > n_positions)
        return KVMIX_ERR_INVALID_ARGUMENT;
    for (t = 0; t < n_positions; t++)
        forced[t] =
            (uint8_t)(t < policy->prefix_tokens || (t >= actionable_first && t < actionable_end));
    return KVMIX_SUCCESS;
}

/* SnapKV's pooling: each score the maximum within `radius` positions either side. */
static void kvmix__max_pool(float *scores, int32_t n, int32_t radius, float *scratch) {
    int32_t t, u;
    memcpy(scratch, scores, (size_t)n * sizeof *scores);
    for (t = 0; t < n; t++) {
        float best = scratch[t];
        if (best == -INFINITY) continue; /* evicted stays evicted */
        for (u = t - radius < 0 ? 0 : t - radius; u <= t + radius && u < n; u++)
            if (scratch[u] > best) best = scratch[u];
        scores[t] = best;
    }
}

KVMIXDEF kvmix_result kvmix_evict_shape_scores(const kvmix_evict_policy *policy, float *scores,
                                               int32_t n_positions, float *scratch) {
    int32_t t, pool, recent;
    if (!policy || (!scores && n_positions > 0)) return KVMIX_ERR_NULL_POINTER;
    if (!kvmix__evict_policy_ok(policy, NULL) || n_positions < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    pool = kvmix__evict_pool_tokens(policy);
    recent = kvmix__evict_recent(policy, n_positions);
    if (pool > 1 && !scratch && n_positions > 0) return KVMIX_ERR_NULL_POINTER;
    for (t = 0; t < n_positions; t++)
        if (scores[t] != scores[t] || scores[t] == INFINITY) return KVMIX_ERR_BAD_VALUE;
    if (pool > 1) kvmix__max_pool(scores, n_positions, pool / 2, scratch);
    for (t = 0; t < n_positions; t++) {
        if (scores[t] == -INFINITY) continue;
        if (policy->scorer == KVMIX_EVICT_STREAMING)
            scores[t] = (float)t;
        else if (t >= n_positions - recent)
            scores[t] = INFINITY;
    }
    return KVMIX_SUCCESS;
}

/* Whether position a ranks below b for keeping: a lower score, or the earlier on ties; with no
   scores, the earlier position. */
static int kvmix__ranks_below(const float *scores, int32_t a, int32_t b) {
    if (!scores) return a < b;
    return scores[a] < scores[b] || (scores[a] == scores[b] && a < b);
}

/* Heap sort of positions by rank, lowest first (no allocation, O(n log n)). */
static void kvmix__sift(const float *scores, int32_t *heap, int32_t root, int32_t n) {
    for (;;) {
        int32_t top = root, l = 2 * root + 1, r = l + 1, tmp;
        if (l < n && kvmix__ranks_below(scores, heap[top], heap[l])) top = l;
        if (r < n && kvmix__ranks_below(scores, heap[top], heap[r])) top = r;
        if (top == root) return;
        tmp = heap[root], heap[root] = heap[top], heap[top] = tmp;
        root = top;
    }
}

static void kvmix__sort_by_rank(const float *scores, int32_t *pos, int32_t n) {
    int32_t i, tmp;
    for (i = n / 2 - 1; i >= 0; i--) kvmix__sift(scores, pos, i, n);
    for (i = n - 1; i > 0; i--) {
        tmp = pos[0], pos[0] = pos[i], pos[i] = tmp;
        kvmix__sift(scores, pos, 0, i);
    }
}

KVMIXDEF kvmix_result kvmix_evict_select(const float *scores, const uint8_t *live,
                                         const uint8_t *forced, int32_t n_positions, int32_t keep,
                                         int32_t *out_positions, int32_t *out_n_evict) {
    int32_t t, n_live = 0, n_forced = 0, n_candidates = 0, room;
    if (!out_n_evict || ((!scores || !out_positions) && n_positions > 0))
        return KVMIX_ERR_NULL_POINTER;
    if (n_positions < 0 || keep < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    for (t = 0; t < n_positions; t++)
        if ((!live || live[t]) && scores[t] != scores[t]) return KVMIX_ERR_BAD_VALUE;
    for (t = 0; t < n_positions; t++) {
        if (live && !live[t]) continue;
        n_live++;
        if (forced && forced[t])
            n_forced++;
        else
            out_positions[n_candidates++] = t;
    }
    *out_n_evict = 0;
    if (n_live <= keep) return KVMIX_SUCCESS;
    room = keep > n_forced ? keep - n_forced : 0;
    kvmix__sort_by_rank(scores, out_positions, n_candidates);
    *out_n_evict = n_candidates - room;
    kvmix__sort_by_rank(NULL, out_positions, *out_n_evict);
    return KVMIX_SUCCESS;
}

/* ---- the intent residual ------------------------------------------------------------------- */

KVMIXDEF const char *kvmix_intent_residual_feature_name(int32_t feature) {
    static const char *const names[KVMIX_INTENT_RESIDUAL_N_FEATURES] = {
        "rule",           "log_age",        "log_turns_back", "role_instruction", "role_user",
        "role_assistant", "role_reasoning", "role_tool_call", "role_observation", "role_scaffold",
        "image",          "key_norm",       "readout"};
    return feature >= 0 && feature < KVMIX_INTENT_RESIDUAL_N_FEATURES ? names[feature] : NULL;
}

/* Whether all n floats are finite. */
static int kvmix__finite_all(const float *x, size_t n) {
    size_t i;
    for (i = 0; i < n; i++)
        if (!(x[i] - x[i] == 0.0f)) return 0;
    return 1;
}

KVMIXDEF kvmix_result kvmix_intent_residual_check(const kvmix_intent_residual *w,
                                                  kvmix_error *out_error) {
    const kvmix_result bad = KVMIX_ERR_BAD_VALUE, invalid = KVMIX_ERR_INVALID_ARGUMENT;
    size_t h;
    if (!w) return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "w", "NULL");
    if (w->n_features != KVMIX_INTENT_RESIDUAL_N_FEATURES)
        return kvmix__fail(out_error, invalid, "n_features",
                           "must be KVMIX_INTENT_RESIDUAL_N_FEATURES");
    if (w->hidden < 1 || w->hidden > KVMIX_INTENT_RESIDUAL_MAX_HIDDEN)
        return kvmix__fail(out_error, invalid, "hidden",
                           "must be in 1 .. KVMIX_INTENT_RESIDUAL_MAX_HIDDEN");
    if (!w->w1 || !w->b1 || !w->w2)
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER,
                           !w->w1   ? "w1"
                           : !w->b1 ? "b1"
                                    : "w2",
                           "NULL");
    h = (size_t)w->hidden;
    if (!kvmix__finite_all(w->w1, h * KVMIX_INTENT_RESIDUAL_N_FEATURES))
        return kvmix__fail(out_error, bad, "w1", "not finite");
    if (!kvmix__finite_all(w->b1, h)) return kvmix__fail(out_error, bad, "b1", "not finite");
    if (!kvmix__finite_all(w->w2, h)) return kvmix__fail(out_error, bad, "w2", "not finite");
    if (!kvmix__finite_all(&w->b2, 1)) return kvmix__fail(out_error, bad, "b2", "not finite");
    if (!kvmix__finite_all(&w->alpha, 1)) return kvmix__fail(out_error, bad, "alpha", "not finite");
    if (!kvmix__finite_all(&w->alpha_max, 1))
        return kvmix__fail(out_error, bad, "alpha_max", "not finite");
    if (w->alpha_max < 0.0f) return kvmix__fail(out_error, invalid, "alpha_max", "negative");
    return kvmix__succeed(out_error);
}

/* The field of a position's inputs that kvmix_intent_residual_features refuses, or NULL;
   *result says how. */
static const char *kvmix__feature_inputs_bad(const float *rule, const kvmix_tag *tag,
                                             const float *key_norm, const float *readout,
                                             kvmix_result *result) {
    *result = KVMIX_ERR_BAD_VALUE;
    if (*rule != *rule) return "rule";
    if (key_norm && !(kvmix__finite_all(key_norm, 1) && *key_norm >= 0.0f)) return "key_norm";
    if (readout && !kvmix__finite_all(readout, 1)) return "readout";
    *result = KVMIX_ERR_INVALID_ARGUMENT;
    if (tag &&
        (tag->turn < 0 || tag->role >= KVMIX_TAG_N_ROLES || tag->modality > KVMIX_MODALITY_IMAGE))
        return "tags";
    return NULL;
}

/* One position's feature row (inputs checked). */
static void kvmix__feature_row(float *f, float rule, const kvmix_tag *tag, int32_t current_turn,
                               int32_t age, float key_norm, float readout) {
    int32_t back = tag && tag->turn < current_turn ? current_turn - tag->turn : 0, r;
    f[KVMIX_INTENT_FEATURE_RULE] = rule;
    f[KVMIX_INTENT_FEATURE_LOG_AGE] = (float)log1p((double)age);
    f[KVMIX_INTENT_FEATURE_LOG_TURNS_BACK] = (float)log1p((double)back);
    for (r = 0; r < KVMIX_TAG_N_ROLES; r++)
        f[KVMIX_INTENT_FEATURE_ROLE + r] = tag && tag->role == r ? 1.0f : 0.0f;
    f[KVMIX_INTENT_FEATURE_IMAGE] = tag && tag->modality == KVMIX_MODALITY_IMAGE ? 1.0f : 0.0f;
    f[KVMIX_INTENT_FEATURE_KEY_NORM] = key_norm;
    f[KVMIX_INTENT_FEATURE_READOUT] = readout;
}

KVMIXDEF kvmix_result kvmix_intent_residual_features(const float *rule, const kvmix_tag *tags,
                                                     int32_t current_turn, const float *key_norm,
                                                     const float *readout, int32_t n_positions,
                                                     float *features, kvmix_error *out_error) {
    const size_t F = KVMIX_INTENT_RESIDUAL_N_FEATURES;
    kvmix_result why;
    const char *bad;
    int32_t t;
    if (n_positions < 0)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "n_positions", "negative");
    if (n_positions > 0 && (!rule || !features))
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, !rule ? "rule" : "features", "NULL");
    if (tags && current_turn < 0)
        return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "current_turn", "negative");
    for (t = 0; t < n_positions; t++)
        if ((bad = kvmix__feature_inputs_bad(&rule[t], tags ? &tags[t] : NULL,
                                             key_norm ? &key_norm[t] : NULL,
                                             readout ? &readout[t] : NULL, &why)) != NULL)
            return kvmix__fail(out_error, why, bad,
                               why == KVMIX_ERR_BAD_VALUE
                                   ? "NaN, not finite, or a negative norm"
                                   : "a negative turn, or a role or modality that does not exist");
    for (t = 0; t < n_positions; t++)
        kvmix__feature_row(features + (size_t)t * F, rule[t], tags ? &tags[t] : NULL, current_turn,
                           n_positions - 1 - t, key_norm ? key_norm[t] : 0.0f,
                           readout ? readout[t] : 0.0f);
    return kvmix__succeed(out_error);
}

/* scale * dot(a, b) over n floats, in double. */
static double kvmix__dot_scaled(const float *a, const float *b, int32_t n, double scale) {
    double sum = 0.0;
    int32_t c;
    for (c = 0; c < n; c++) sum += (double)a[c] * (double)b[c];
    return sum * scale;
}

static float kvmix__clamp_float(double x) {
    return x > FLT_MAX ? FLT_MAX : x < -FLT_MAX ? -FLT_MAX : (float)x;
}

/* One key's readout against m queries of dim floats (m >= 1). */
static float kvmix__readout_row(const float *key, const float *queries, int32_t m, int32_t dim,
                                double scale) {
    double top = -HUGE_VAL, z = 0.0, acc = 0.0;
    int32_t j;
    for (j = 0; j < m; j++) {
        double s = kvmix__dot_scaled(key, queries + (size_t)j * (size_t)dim, dim, scale);
        if (s > top) top = s;
    }
    for (j = 0; j < m; j++) {
        double s = kvmix__dot_scaled(key, queries + (size_t)j * (size_t)dim, dim, scale);
        double p = exp(s - top);
        z += p;
        acc += p * s;
    }
    return kvmix__clamp_float(acc / z);
}

KVMIXDEF kvmix_result kvmix_intent_readout(const float *keys, int32_t n_keys, const float *queries,
                                           int32_t n_queries, int32_t head_dim, float scale,
                                           float *out, kvmix_error *out_error) {
    const kvmix_result invalid = KVMIX_ERR_INVALID_ARGUMENT;
    double s;
    int32_t i;
    if (n_keys < 0 || n_queries < 0)
        return kvmix__fail(out_error, invalid, n_keys < 0 ? "n_keys" : "n_queries", "negative");
    if (head_dim < 1) return kvmix__fail(out_error, invalid, "head_dim", "must be at least 1");
    if (!(scale >= 0.0f) || scale == INFINITY)
        return kvmix__fail(out_error, invalid, "scale", "negative or not finite");
    if (n_keys > 0 && (!keys || !out))
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, !keys ? "keys" : "out", "NULL");
    if (n_queries > 0 && !queries)
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER, "queries", "NULL");
    if (n_keys > 0 && !kvmix__finite_all(keys, (size_t)n_keys * (size_t)head_dim))
        return kvmix__fail(out_error, KVMIX_ERR_BAD_VALUE, "keys", "not finite");
    if (n_queries > 0 && !kvmix__finite_all(queries, (size_t)n_queries * (size_t)head_dim))
        return kvmix__fail(out_error, KVMIX_ERR_BAD_VALUE, "queries", "not finite");
    s = scale == 0.0f ? 1.0 / sqrt((double)head_dim) : (double)scale;
    for (i = 0; i < n_keys; i++)
        out[i] = n_queries == 0 ? 0.0f
                                : kvmix__readout_row(keys + (size_t)i * (size_t)head_dim, queries,
                                                     n_queries, head_dim, s);
    return kvmix__succeed(out_error);
}

/* The exact GELU (erf form). */
static double kvmix__gelu(double x) { return 0.5 * x * (1.0 + erf(x * 0.70710678118654752440)); }

/* r = b2 + sum_j w2[j] * gelu(b1[j] + sum_k w1[j][k] * f[k]), in double. */
static double kvmix__residual_row(const kvmix_intent_residual *w, const float *f) {
    double r = (double)w->b2;
    int32_t j, k;
    for (j = 0; j < w->hidden; j++) {
        const float *row = w->w1 + (size_t)j * KVMIX_INTENT_RESIDUAL_N_FEATURES;
        double x = (double)w->b1[j];
        for (k = 0; k < KVMIX_INTENT_RESIDUAL_N_FEATURES; k++) x += (double)row[k] * (double)f[k];
        r += (double)w->w2[j] * kvmix__gelu(x);
    }
    return r;
}

/* The clipped scale, 0 when the output projection is zero: then the rule is the output. */
static double kvmix__residual_scale(const kvmix_intent_residual *w) {
    double a = w->alpha > w->alpha_max    ? (double)w->alpha_max
               : w->alpha < -w->alpha_max ? -(double)w->alpha_max
                                          : (double)w->alpha;
    int32_t j;
    if (w->b2 != 0.0f) return a;
    for (j = 0; j < w->hidden; j++)
        if (w->w2[j] != 0.0f) return a;
    return 0.0;
}

KVMIXDEF kvmix_result kvmix_intent_residual_scores(const kvmix_intent_residual *w,
                                                   const float *features, const float *rule,
                                                   int32_t n, float *out, kvmix_error *out_error) {
    const size_t F = KVMIX_INTENT_RESIDUAL_N_FEATURES;
    kvmix_result r;
    double a;
    int32_t i;
    if ((r = kvmix_intent_residual_check(w, out_error)) != KVMIX_SUCCESS) return r;
    if (n < 0) return kvmix__fail(out_error, KVMIX_ERR_INVALID_ARGUMENT, "n", "negative");
    if (n > 0 && (!features || !rule || !out))
        return kvmix__fail(out_error, KVMIX_ERR_NULL_POINTER,
                           !features ? "features"
                           : !rule   ? "rule"
                                     : "out",
                           "NULL");
    for (i = 0; i < n; i++) {
        if (rule[i] != rule[i]) return kvmix__fail(out_error, KVMIX_ERR_BAD_VALUE, "rule", "NaN");
        if (kvmix__finite_all(&rule[i], 1) && !kvmix__finite_all(features + (size_t)i * F, F))
            return kvmix__fail(out_error, KVMIX_ERR_BAD_VALUE, "features", "not finite");
    }
    a = kvmix__residual_scale(w);
    for (i = 0; i < n; i++) {
        double d = a == 0.0 || !kvmix__finite_all(&rule[i], 1)
                       ? 0.0
                       : a * kvmix__residual_row(w, features + (size_t)i * F);
        out[i] = d == 0.0 ? rule[i] : kvmix__clamp_float((double)rule[i] + d);
    }
    return kvmix__succeed(out_error);
}

// >>tiers

/* Bytes of one token's row (keys or values of one head) at `format`, codes and pairs. */
static double kvmix__tier_row_bytes(int32_t format, int32_t head_dim, int32_t group_size) {
    kvmix__sections s = kvmix__block_sections(format, 1, head_dim, group_size, 0);
    if (format == KVMIX_FORMAT_FP16) return (double)s.row_bytes;
    return (double)s.row_bytes + 4.0 * (double)(head_dim / group_size);
}

KVMIXDEF kvmix_result kvmix_tier_costs(int32_t head_dim, int32_t group_size, double out_cost[3]) {
    double fp16;
    if (!out_cost) return KVMIX_ERR_NULL_POINTER;
    if (group_size == 0) group_size = KVMIX_GROUP_SIZE_DEFAULT;
    if (kvmix__layout_check(KVMIX_FORMAT_INT4, 1, head_dim, &group_size, 0) != KVMIX_SUCCESS)
        return KVMIX_ERR_BAD_SHAPE;
    fp16 = kvmix__tier_row_bytes(KVMIX_FORMAT_FP16, head_dim, group_size);
    out_cost[0] = 1.0;
    out_cost[1] = kvmix__tier_row_bytes(KVMIX_FORMAT_INT8, head_dim, group_size) / fp16;
    out_cost[2] = kvmix__tier_row_bytes(KVMIX_FORMAT_INT4, head_dim, group_size) / fp16;
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_tier_importance(const float *stat, int32_t n_tokens, double lambda,
                                            float *importance) {
    int32_t j;
    if ((!stat || !importance) && n_tokens > 0) return KVMIX_ERR_NULL_POINTER;
    if (n_tokens < 0 || !(lambda >= 0.0 && lambda < INFINITY)) return KVMIX_ERR_INVALID_ARGUMENT;
    for (j = 0; j < n_tokens; j++)
        if (!(stat[j] >= 0.0f && stat[j] < INFINITY)) return KVMIX_ERR_BAD_VALUE;
    for (j = 0; j < n_tokens; j++)
        importance[j] = (float)((double)stat[j] * exp(-lambda * (double)(n_tokens - 1 - j)));
    return KVMIX_SUCCESS;
}

KVMIXDEF kvmix_result kvmix_tier_norms(const float *keys, const float *values, int32_t n_tokens,
                                       int64_t n_rows_per_token, float *norms) {
    int64_t i, n;
    int32_t j;
    if ((!keys || !values || !norms) && n_tokens > 0) return KVMIX_ERR_NULL_POINTER;
    if (n_tokens < 0 || n_rows_per_token < 1) return KVMIX_ERR_INVALID_ARGUMENT;
    n = (int64_t)n_tokens * n_rows_per_token;
    for (i = 0; i < n; i++)
        if (!(keys[i] - keys[i] == 0.0f && values[i] - values[i] == 0.0f))
            return KVMIX_ERR_BAD_VALUE;
    for (j = 0; j < n_tokens; j++) {
        double sum = 0.0;
        for (i = (int64_t)j * n_rows_per_token; i < (int64_t)(j + 1) * n_rows_per_token; i++)
            sum += (double)keys[i] * keys[i] + (double)values[i] * values[i];
        norms[j] = (float)sqrt(sum);
    }
    return KVMIX_SUCCESS;
}

/* How many of m tokens take the higher of two tiers (costs hi > lo) within `room`: the most that
   fit, 0 .. m. */
static int32_t kvmix__tier_upgrades(int32_t m, double room, double hi, double lo) {
    double k = floor((room - (double)m * lo) / (hi - lo) + 1e-9);
    return k <= 0.0 ? 0 : k >= (double)m ? m : (int32_t)k;
}

/* A tier desc's fields, as kvmix_tier_desc spells them. */
static kvmix__why kvmix__tier_desc_why(const kvmix_tier_desc *d) {
    const kvmix_result bad = KVMIX_ERR_INVALID_ARGUMENT;
    int32_t group_size = d->group_size;
    if (d->n_tokens < 0) return kvmix__why_not(bad, "n_tokens", "negative");
    if (d->n_sink < 0 || d->n_sink > d->n_tokens)
        return kvmix__why_not(bad, "n_sink", "must be in 0 .. n_tokens");
    if (!(d->budget > 0.0 && d->budget <= 1.0))
        return kvmix__why_not(bad, "budget", "must be a number in (0, 1]");
    if (d->reserved != 0) return kvmix__why_not(bad, "reserved", "must be 0");
    if (d->allow_int4 != 0 && d->allow_int4 != 1)
        return kvmix__why_not(bad, "allow_int4", "must be 0 or 1");
    return kvmix__layout_why(KVMIX_FORMAT_INT4, 1, d->head_dim, &group_size, 0); /* as costs */
}

KVMIXDEF kvmix_result kvmix_tier_choose(const kvmix_tier_desc *desc, const float *importance,
                                        uint8_t *tiers, kvmix_tier_plan *out_plan,
                                        kvmix_error *out_error) {
    const kvmix_result null = KVMIX_ERR_NULL_POINTER;
    double cost[3], room;
    int32_t n, m, j, n_hi, n_lo, *order = NULL;
    uint8_t hi, lo;
    kvmix_tier_plan plan;
    kvmix__why w;
    if (!desc) return kvmix__fail(out_error, null, "desc", "NULL");
    if (!out_plan) return kvmix__fail(out_error, null, "out_plan", "NULL");
    if ((!importance || !tiers) && desc->n_tokens > 0)
        return kvmix__fail(out_error, null, !importance ? "importance" : "tiers", "NULL");
    if ((w = kvmix__tier_desc_why(desc)).result != KVMIX_SUCCESS)
        return kvmix__fail(out_error, w.result, w.argument, w.reason);
    n = desc->n_tokens;
    kvmix_tier_costs(desc->head_dim, desc->group_size, cost); /* checked above */
    for (j = desc->n_sink; j < n; j++)
        if (importance[j] != importance[j])
            return kvmix__fail(out_error, KVMIX_ERR_BAD_VALUE, "importance",
                               "a NaN past the sinks");
    memset(&plan, 0, sizeof plan);
    m = n - desc->n_sink;
    room = desc->budget * (double)n - (double)desc->n_sink;
    if (room >= (double)m * cost[1]) { /* FP16 + INT8 */
        hi = KVMIX_FORMAT_FP16, lo = KVMIX_FORMAT_INT8;
        n_hi = kvmix__tier_upgrades(m, room, 1.0, cost[1]);
        n_lo = m - n_hi;
    } else if (desc->allow_int4 && room >= (double)m * cost[2]) { /* INT8 + INT4 */
        hi = KVMIX_FORMAT_INT8, lo = KVMIX_FORMAT_INT4;
        n_hi = kvmix__tier_upgrades(m, room, cost[1], cost[2]);
        n_lo = m - n_hi;
    } else { /* the last resort: the cheapest allowed tier for as many as fit */
        hi = KVMIX_FORMAT_FP16, lo = desc->allow_int4 ? KVMIX_FORMAT_INT4 : KVMIX_FORMAT_INT8;
        n_hi = 0;
        n_lo = kvmix__tier_upgrades(m, room, lo == KVMIX_FORMAT_INT4 ? cost[2] : cost[1], 0.0);
    }
    if (m > 0 && !(order = (int32_t *)KVMIX_MALLOC((size_t)m * sizeof *order)))
        return kvmix__fail(out_error, KVMIX_ERR_OUT_OF_MEMORY, "n_tokens",
                           "KVMIX_MALLOC of the work array failed");
    for (j = 0; j < m; j++) order[j] = desc->n_sink + j;
    kvmix__sort_by_rank(importance, order, m); /* least important first */
    for (j = 0; j < desc->n_sink; j++) tiers[j] = KVMIX_FORMAT_FP16;
    for (j = 0; j < m; j++)
        tiers[order[j]] = j >= m - n_hi ? hi : j >= m - n_hi - n_lo ? lo : KVMIX_PAYLOAD_NO_ROW;
    KVMIX_FREE(order);
    plan.n_dropped = m - n_hi - n_lo;
    plan.n_fp16 = desc->n_sink + (hi == KVMIX_FORMAT_FP16 ? n_hi : 0);
    plan.n_int8 = hi == KVMIX_FORMAT_INT8 ? n_hi : lo == KVMIX_FORMAT_INT8 ? n_lo : 0;
    plan.n_int4 = lo == KVMIX_FORMAT_INT4 ? n_lo : 0;
    plan.cost =
        n > 0 ? ((double)plan.n_fp16 + plan.n_int8 * cost[1] + plan.n_int4 * cost[2]) / n : 0.0;
    *out_plan = plan;
    return kvmix__succeed(out_error);
}

KVMIXDEF kvmix_result kvmix_tier_probe(kvmix_tier_trial_fn trial, void *ctx, int32_t n_trials,
                                       int32_t n_pass, double budget, int32_t *out_allow_int4,
                                       int32_t *out_n_passed) {
    int32_t i, passed = 0;
    if (!trial || !out_allow_int4) return KVMIX_ERR_NULL_POINTER;
    if (n_trials < 1 || n_pass < 1 || n_pass > n_trials || !(budget > 0.0 && budget <= 1.0))
        return KVMIX_ERR_INVALID_ARGUMENT;
    for (i = 0; i < n_trials; i++) {
        int32_t ok = 0;
        kvmix_result r = trial(ctx, i, budget, &ok);
        if (r != KVMIX_SUCCESS) return r;
        passed += ok != 0;
    }
    *out_allow_int4 = passed >= n_pass;
    if (out_n_passed) *out_n_passed = passed;
    return KVMIX_SUCCESS;
}

#endif /* KVMIX_NO_POLICY */

#endif /* KVMIX_IMPLEMENTATION_DONE */
#endif /* KVMIX_IMPLEMENTATION */
