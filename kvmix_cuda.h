/* kvmix_cuda.h - CUDA kernel pack for kvmix: quantize/pack, dequantize, decode attention over a
   kvmix_view, QueryMemory scoring, transfer payload pack/unpack. MIT licensed (see LICENSE).

   Build kvmix_cuda.cu with nvcc (sm_90) and link it next to one file that defines
   KVMIX_IMPLEMENTATION. This header includes no CUDA header and compiles as C99 -pedantic and as
   C++; a cudaStream_t passes as kvmix_stream without a cast (NULL = the legacy default stream).

   Every launcher: validates its host-side arguments and returns a kvmix_result
   (KVMIX_ERR_UNSUPPORTED for a valid combination this pack does not implement, KVMIX_ERR_CUDA if
   the launch fails), never allocates, never synchronizes, never changes the current device, and
   only enqueues work on `stream`, so it can be captured into a CUDA graph. Device arrays (spans,
   jobs, dead flags) cannot be read on the host; what the kernels find wrong in them is reported
   on the device as documented per launcher. Launchers are thread-safe (no global state).

   head_dim: every launcher takes the multiples of 32 that kvmix.h accepts (decode: up to 256); a
   head_dim kvmix.h accepts that 32 does not divide (48, 80) is UNSUPPORTED here.

   Alignment: every block a kernel reads or writes as a whole (view spans' key and value blocks,
   their head strides, quantize destinations) must start at a multiple of 16 bytes of a base that
   is itself 16-byte aligned (cudaMalloc gives 256). Decode treats a misaligned span as corrupt.
*/
#ifndef KVMIX_CUDA_H
#define KVMIX_CUDA_H

#include "kvmix.h"

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st;
typedef struct CUstream_st *kvmix_stream;

/* Element type of queries, outputs and dequantized rows. */
typedef enum kvmix_cuda_dtype { KVMIX_CUDA_FP16 = 1, KVMIX_CUDA_BF16 = 2 } kvmix_cuda_dtype;

/* ------------------------------------------------------------------------------------------- */
/* Quantize and pack. One launch packs many blocks of one layout. Each job quantizes n_rows       */
/* consecutive FP16 source rows into rows [first_row, first_row + n_rows) of a destination block  */
/* of layout->n_tokens tokens, with bytes equal to kvmix_ref_quantize on the same values          */
/* converted to float:                                                                           */
/*   - FP16 and per-token formats (INT8/INT4/INT2): any row range; n_rows = 1 is the decode-time   */
/*     append of one token (it writes the row's codes and its (scale, min) pairs, nothing else).   */
/*   - INT2_CHANNEL and BOOSTED: a job must cover the whole block (first_row 0, n_rows =          */
/*     layout->n_tokens): a page flush. Channel ranking for BOOSTED runs on the GPU.               */
/* Jobs live in device memory, 24 bytes each: kvmix_quantize_job (kvmix.h), whose src_offset     */
/* counts fp16 elements from src to the job's first source row, dst_offset bytes from dst to the  */
/* destination block (its row 0, a 16-byte multiple), first_row the block row that source row 0  */
/* goes to and n_rows the rows to write (>= 1).                                                  */
typedef kvmix_quantize_job kvmix_cuda_quantize_job;

#define KVMIX_CUDA_QUANTIZE_BAD_VALUE 1 /* error_flags bit: a job's input had inf or NaN */
#define KVMIX_CUDA_QUANTIZE_BAD_JOB   2 /* error_flags bit: a job's row range is invalid */

/* Quantizes jobs[0 .. n_jobs) (device array) of FP16 rows src (device; row r of a job at
   src + job.src_offset + r * src_row_stride, head_dim used) into dst (device).
   layout: format, n_tokens (rows of each destination block), head_dim, group_size, n_boost, as
   kvmix_layout_resolve accepts them (UNSUPPORTED: a head_dim 32 does not divide).
   A job whose input holds inf or NaN, or whose row range does not fit the block, writes nothing
   and ORs its bit into *error_flags (device int32, may be NULL); other jobs are unaffected.
   Returns NULL_POINTER, INVALID_ARGUMENT (n_jobs < 0, src_row_stride < head_dim, n_tokens < 1),
   layout errors, CUDA. n_jobs == 0 enqueues nothing. */
kvmix_result kvmix_cuda_quantize(const kvmix_layout *layout, const void *src,
                                 int64_t src_row_stride, void *dst,
                                 const kvmix_cuda_quantize_job *jobs, int32_t n_jobs,
                                 int32_t *error_flags, kvmix_stream stream);

/* ------------------------------------------------------------------------------------------- */
/* The jobs of a cache whose arena is device memory (kvmix.h, "Device arena").                   */

/* Byte copies: job j copies jobs[j].n_rows bytes from src + src_offset to dst + dst_offset
   (jobs: device array). The ranges of one launch must not overlap. Returns NULL_POINTER,
   INVALID_ARGUMENT (n_jobs < 0), CUDA. */
kvmix_result kvmix_cuda_copy_blocks(const void *src, void *dst, const kvmix_quantize_job *jobs,
                                    int32_t n_jobs, kvmix_stream stream);

/* Runs the batches of one kvmix_cache_jobs_take in order on `stream`, as kvmix_ref_cache_run does
   on the host: jobs is the take's job array copied to device memory, key_rows and value_rows the
   device FP16 rows that kvmix_cache_write_rows named (may be NULL when no batch reads them),
   arena the cache's device arena. A QUANTIZE job whose rows are not finite FP16, or a DEQUANTIZE
   job whose rows are not in its block, writes nothing and ORs KVMIX_CUDA_QUANTIZE_BAD_VALUE into
   *error_flags (device int32, may be NULL). Every
   batch is checked before any is enqueued (INVALID_ARGUMENT: a bad kind or job range;
   NULL_POINTER: rows a batch reads); then returns the first launcher error (layouts; later
   batches are not enqueued). */
kvmix_result kvmix_cuda_cache_run(const kvmix_cache_batch *batches, int32_t n_batches,
                                  const kvmix_quantize_job *jobs, const void *key_rows,
                                  const void *value_rows, void *arena, int32_t *error_flags,
                                  kvmix_stream stream);

/* ------------------------------------------------------------------------------------------- */
/* Dequantize a sequence of a view (device pointers in base, spans, seq_first_span, dead) into    */
/* contiguous rows for an external prefill attention kernel:                                     */
/*   keys_out, values_out: [capacity_tokens][n_kv_heads][head_dim] of dtype.                      */
/* Token i of the sequence (counting every span's tokens, dead ones included) goes to row i, so a */
/* row index is the token's position in the view. Dead tokens are written as zeros: the caller     */
/* masks them (the same dead[] flags) in its attention. Rows past the sequence's length are left   */
/* as they were; tokens past capacity_tokens are not written. Values are exactly                  */
/* kvmix_ref_dequantize's floats rounded to dtype. Either output may be NULL (not written).       */
/* The device checks each span as decode does: a bad span's rows are NaN. A sequence whose span   */
/* range lies outside [0, n_spans] gets NaN in every row up to capacity_tokens (no span read).    */
/* Returns NULL_POINTER, INVALID_ARGUMENT (seq out of range, capacity_tokens < 0), BAD_SHAPE,     */
/* UNSUPPORTED (dtype, head_dim), CUDA. */
kvmix_result kvmix_cuda_view_dequantize(const kvmix_view *view, int32_t seq, kvmix_cuda_dtype dtype,
                                        void *keys_out, void *values_out, int32_t capacity_tokens,
                                        kvmix_stream stream);

/* ------------------------------------------------------------------------------------------- */
/* Decode attention over a view: one query token per sequence, every sequence of the view in one  */
/* launch, split-KV with a log-sum-exp merge (with n_splits > 1, a second small kernel on the     */
/* same stream, launched as a programmatic dependent of the first, which waits for the first grid */
/* to complete; with one split the first kernel writes out and lse itself).                      */
/*   q, out: [n_seqs][n_q_heads][head_dim] of dtype; lse: [n_seqs][n_q_heads] float (natural log, */
/*   as kvmix_ref_view_decode; -INFINITY and a zero row for a sequence with no live token), or   */
/*   NULL when not wanted: no kernel writes it then, and out is the same. Query heads            */
/*   i*g .. i*g+g-1 read kv head i (g = n_q_heads / n_kv_heads) and share each K/V load. Each    */
/*   sequence's spans are cut into n_splits ranges of equal span counts (a split's               */
/*   first span is known without reading the spans before it); a split walks its spans.          */
/* Supported: head_dim a multiple of 32 up to 256, any group_size the view takes, values in the  */
/* same groups as keys (a view whose value_group_size differs is UNSUPPORTED, by every launcher   */
/* that reads a view); every format for keys and values, dead flags. head_dim 64, 128 and 256    */
/* with groups of 16 or more run on the tensor cores; other shapes (head_dim 32, 96, 160, 192,   */
/* 224; groups of 8) on a CUDA-core walk to the same results, slower (bench/RESULTS.md). The     */
/* device checks each span it reads (known formats, n_tokens >= 1, blocks inside base_bytes and  */
/* 16-byte aligned, dead range inside n_dead_flags) and each sequence's span range (inside       */
/* [0, n_spans]): a sequence with a bad span or range gets NaN in out and lse.                   */
/* The kernel's stage buffers (shared memory a block copies spans into): AUTO takes Hopper-size
   stages where the device's block holds them (H100, H200, Blackwell data-center parts) and the
   small ones elsewhere (Ada, consumer Ampere, A100 at head_dim 256); SMALL asks for the small
   ones anywhere (tests run them on a Hopper device). Where neither fits (head_dim 256 on a block
   of less than 163 KiB), decode returns UNSUPPORTED. */
typedef enum kvmix_cuda_stages {
    KVMIX_CUDA_STAGES_AUTO = 0,
    KVMIX_CUDA_STAGES_SMALL = 1
} kvmix_cuda_stages;

typedef struct kvmix_cuda_decode_desc {
    int32_t n_q_heads;      /* a multiple of the view's n_kv_heads */
    float scale;            /* softmax scale; 0 = 1 / sqrt(head_dim) */
    kvmix_cuda_dtype dtype; /* of q and out */
    int32_t n_splits;       /* 1 .. KVMIX_CUDA_MAX_SPLITS ranges per sequence */
    int32_t stages;         /* a kvmix_cuda_stages; 0 = AUTO */
} kvmix_cuda_decode_desc;

#define KVMIX_CUDA_MAX_SPLITS 1024

/* Workspace bytes for decode: n_seqs * n_splits * n_q_heads * (head_dim + 1) * 4.
   Returns NULL_POINTER, INVALID_ARGUMENT. */
kvmix_result kvmix_cuda_decode_workspace_bytes(int32_t n_seqs, int32_t n_q_heads, int32_t head_dim,
                                               int32_t n_splits, size_t *out_bytes);

/* A split count that fills n_sms multiprocessors for a batch whose longest sequence has
   max_seq_tokens tokens, from every shape parameter the decode grid depends on: sequences, kv
   heads, query heads per kv head, head_dim (blocks per SM). Host arithmetic only; at least 1, at
   most KVMIX_CUDA_MAX_SPLITS. Returns NULL_POINTER, INVALID_ARGUMENT, UNSUPPORTED (head_dim). */
kvmix_result kvmix_cuda_decode_choose_splits(int32_t n_seqs, int32_t n_kv_heads, int32_t n_q_heads,
                                             int32_t head_dim, int64_t max_seq_tokens,
                                             int32_t n_sms, int32_t *out_splits);

/* Enqueues decode attention. view: host struct whose pointers are device pointers. lse may be
   NULL (not wanted); q, out and workspace may not. workspace:
   device memory of workspace_bytes >= kvmix_cuda_decode_workspace_bytes (256-byte aligned).
   Returns NULL_POINTER, INVALID_ARGUMENT, BAD_SHAPE, BUFFER_TOO_SMALL (workspace),
   UNSUPPORTED (head_dim, group_size, dtype), CUDA. */
kvmix_result kvmix_cuda_decode(const kvmix_view *view, const kvmix_cuda_decode_desc *desc,
                               const void *q, void *out, float *lse, void *workspace,
                               size_t workspace_bytes, kvmix_stream stream);

/* Thread blocks of the decode kernel that fit on one multiprocessor of the current device for
   this head_dim and query group (n_q_heads / n_kv_heads), in the stages kvmix_cuda_decode takes
   there by default. For tuning and reports. Returns NULL_POINTER, INVALID_ARGUMENT, UNSUPPORTED
   (head_dim; a device on which kvmix_cuda_decode is UNSUPPORTED at it), CUDA. */
kvmix_result kvmix_cuda_decode_blocks_per_sm(int32_t head_dim, int32_t q_per_kv,
                                             int32_t *out_blocks);

/* ------------------------------------------------------------------------------------------- */
/* QueryMemory scoring of one sequence's stored keys: for token t of the sequence (position in    */
/* the view, dead ones included),                                                               */
/*   scores[t] = sum over q heads h of dot(memory[h], key_t of kv head h / g), g = n_q/n_kv,      */
/* with keys dequantized exactly as kvmix_ref_dequantize_row; dead tokens score -INFINITY.       */
/*   memory: [n_q_heads][head_dim] float (device); scores: [capacity_tokens] float (device).     */
/* Tokens past capacity_tokens are not scored; entries past the sequence's length are left. A bad */
/* span's tokens score NaN; a span range outside [0, n_spans] gives NaN up to capacity_tokens.    */
/* Returns NULL_POINTER, INVALID_ARGUMENT, BAD_SHAPE, UNSUPPORTED (head_dim), CUDA. */
kvmix_result kvmix_cuda_view_score(const kvmix_view *view, int32_t seq, int32_t n_q_heads,
                                   const float *memory, float *scores, int32_t capacity_tokens,
                                   kvmix_stream stream);

/* Intent scores (kvmix_ref_view_intent_score on the GPU): for each query head h, the softmax
   over the sequence's live tokens (those before capacity_tokens) of scale * dot(memory[h], key_t
   of kv head h / g), summed over heads into scores[t]; dead tokens and entries past the
   sequence's length get -INFINITY; a bad span makes every score NaN. scale 0 = 1/sqrt(head_dim).
   memory [n_q_heads][head_dim], scores [capacity_tokens], workspace of
   kvmix_cuda_view_intent_workspace_bytes: device memory. Four launches on `stream`.
   Returns NULL_POINTER, INVALID_ARGUMENT, BAD_SHAPE, BUFFER_TOO_SMALL, UNSUPPORTED (head_dim),
   CUDA. */
kvmix_result kvmix_cuda_view_intent_workspace_bytes(int32_t n_q_heads, int32_t capacity_tokens,
                                                    size_t *out_bytes);
kvmix_result kvmix_cuda_view_intent_score(const kvmix_view *view, int32_t seq, int32_t n_q_heads,
                                          float scale, const float *memory, float *scores,
                                          int32_t capacity_tokens, void *workspace,
                                          size_t workspace_bytes, kvmix_stream stream);

/* The intent residual's key features (kvmix_ref_view_key_features on the GPU): for token t of the
   sequence, key_norm[t] = the mean over kv heads of the norm of its stored key and readout[t] =
   the mean over query heads h of scale * dot(memory[h], key_t of kv head h / g); dead tokens 0,
   a bad span's tokens NaN, entries past the sequence's length left. Sums over channels and heads
   in another order than the reference (float rounding apart, the same values). scale 0 =
   1/sqrt(head_dim). memory [n_q_heads][head_dim], key_norm and readout [capacity_tokens]: device
   memory. One launch on `stream`. Returns NULL_POINTER, INVALID_ARGUMENT, BAD_SHAPE,
   UNSUPPORTED (head_dim), CUDA. */
kvmix_result kvmix_cuda_view_key_features(const kvmix_view *view, int32_t seq, int32_t n_q_heads,
                                          float scale, const float *memory, float *key_norm,
                                          float *readout, int32_t capacity_tokens,
                                          kvmix_stream stream);

/* kvmix_cuda_view_intent_score of sequences first_seq .. first_seq + n_seqs - 1 in the same four
   launches: sequence first_seq + i reads memory + i * memory_stride (floats) and writes scores +
   i * capacity_tokens; the workspace holds n_seqs times kvmix_cuda_view_intent_workspace_bytes.
   Each sequence's scores are those kvmix_cuda_view_intent_score gives it alone. For a step of
   many sequences (an H2O-style recorder): one call where n_seqs calls would launch 4 n_seqs
   kernels. Returns what kvmix_cuda_view_intent_score returns. */
kvmix_result kvmix_cuda_view_intent_score_seqs(const kvmix_view *view, int32_t first_seq,
                                               int32_t n_seqs, int32_t n_q_heads, float scale,
                                               const float *memory, int64_t memory_stride,
                                               float *scores, int32_t capacity_tokens,
                                               void *workspace, size_t workspace_bytes,
                                               kvmix_stream stream);

/* ------------------------------------------------------------------------------------------- */
/* Transfer payload body (kvmix.h's >>transfer room). The head (header and tier table,           */
/* info->head_bytes) is host work: the sender writes it with kvmix_payload_write_head and copies  */
/* it to the start of the device payload; the receiver reads it with kvmix_payload_read_head      */
/* from a host copy of those bytes. Both kernels read the tiers from the device payload's head    */
/* and check them against info (counts per tier) before touching any row.                        */
/*   keys, values: [n_layers][n_tokens][n_kv_heads][head_dim] of dtype (the payload's layers).    */
/* Workspace: caller-owned device memory of kvmix_cuda_payload_workspace_bytes. The payload,      */
/* workspace, keys and values must be 16-byte aligned (INVALID_ARGUMENT otherwise).               */

/* error_flags bits: an input row has inf, NaN or |x| > 65504; the device head disagrees with
   info, or a block holds bytes no quantize call could have written */
#define KVMIX_CUDA_PAYLOAD_BAD_VALUE 1
#define KVMIX_CUDA_PAYLOAD_CORRUPT   2

/* Workspace bytes for a payload of n_tokens tokens. Returns NULL_POINTER, INVALID_ARGUMENT. */
kvmix_result kvmix_cuda_payload_workspace_bytes(int32_t n_tokens, size_t *out_bytes);

/* Packs the body of the payload `info` describes into payload (device, info->total_bytes, head
   already there): the bytes kvmix_payload_pack writes for the same rows converted to float.
   Rows of NO_ROW tokens (RESIDUAL) are not read. If an input row is not representable in FP16
   or the head disagrees with info, the matching bit is ORed into *error_flags (device int32,
   may be NULL) and no body byte is written. Returns NULL_POINTER, INVALID_ARGUMENT (info not a
   valid description, n_tokens 0 with rows), BUFFER_TOO_SMALL (workspace), UNSUPPORTED (dtype,
   head_dim), CUDA. A payload of 0 tokens enqueues nothing. */
kvmix_result kvmix_cuda_payload_pack(const kvmix_payload_info *info, const void *keys,
                                     const void *values, kvmix_cuda_dtype dtype, void *payload,
                                     void *workspace, size_t workspace_bytes, int32_t *error_flags,
                                     kvmix_stream stream);

/* Decodes every layer of the payload (device, info->total_bytes) into keys and values (either
   may be NULL): ROWS writes each token's rows as kvmix_payload_unpack's floats rounded to dtype;
   RESIDUAL adds each carried residual to the dtype row in float and rounds the sum, leaving the
   rows of NO_ROW tokens. If the head disagrees with info or a block is corrupt, the bit is ORed
   into *error_flags and no output is written. Returns as kvmix_cuda_payload_pack. */
kvmix_result kvmix_cuda_payload_unpack(const kvmix_payload_info *info, const void *payload,
                                       kvmix_cuda_dtype dtype, void *keys, void *values,
                                       void *workspace, size_t workspace_bytes,
                                       int32_t *error_flags, kvmix_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* KVMIX_CUDA_H */
