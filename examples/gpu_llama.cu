/* gpu_llama.cu - the reference Llama models on a GPU over a device-arena kvmix cache
 * (gpu_llama.h). The numerics follow llama.c: fp32 weights and activations, RMSNorm with its sum
 * of squares in double, RoPE angles in double; keys and values reach the cache as FP16, as
 * kvmix_cache_write rounds them on the CPU, and the decode kernel reads FP16 queries. */
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <vector>

extern "C" {
#include "gpu_llama.h"
#include "kvmix_cuda.h"
#include "kvmix_kv.h"
}

namespace {

enum { MAX_SPLITS = 64, THREADS = 256, FILL_ROWS = 1024, PREFILL_CHUNK = 128 };
/* Batch-invariant products run cuBLAS over groups of this many rows, the last one padded:
   cuBLAS picks its kernel, and so each output's order of summation, by the number of rows. */
enum { PRODUCT_ROWS = 128 };
/* The fp32 reference attention: tokens per chunk (one block each), warps per block, and the most
   channels of a head (KVMIX_MAX_HEAD_DIM) a lane holds. */
enum { REF_CHUNK = 512, REF_WARPS = 4, REF_LANE_DIMS = 16 };

struct layer_weights {
    float *attn_norm, *ffn_norm, *qkv, *out, *gate_up, *down;
};

/* One layer's take of jobs (pinned, so that its upload runs in stream order while the host goes
   on) and the layer's view spans on the device. */
struct staging {
    kvmix_quantize_job *jobs; /* pinned [max_jobs] */
    kvmix_quantize_job *d_jobs;
    kvmix_view_span *d_spans; /* [span_capacity] */
    int32_t span_capacity;
};

/* A step's view, built once on the host (layer 0) and uploaded; capacities grow on demand. */
struct view_staging {
    kvmix_view view;
    kvmix_view_span *spans, *d_spans; /* pinned, device [span_capacity] */
    int32_t *first, *d_first;         /* [max_seqs + 1] */
    uint8_t *dead, *d_dead;           /* [dead_capacity] */
    int32_t span_capacity, dead_capacity;
};

/* Each kvmix sequence's spans of layer 0, kept on the device from one decode step to the next:
   a step rebuilds only what kvmix_cache_view_changes reports (a few spans at the end of each
   sequence) and gathers the step's sequences into its view, so the host's share is O(sequences)
   instead of O(pages). Sequences with dead rows take the whole view instead (kvmix_cache_view).
   Allocated on first use. */
struct kept_view {
    int32_t stride;                   /* spans a sequence can have: max_pages_per_seq */
    int32_t *n;                       /* host [max_seqs]: spans kept of each kvmix sequence */
    kvmix_view_span *d_slabs;         /* [max_seqs][stride] */
    kvmix_view_span *patch, *d_patch; /* pinned, device [patch_capacity]: rebuilt spans */
    int32_t *patch_at, *d_patch_at;   /* their slab index */
    int32_t patch_capacity, at_capacity;
    int32_t *kv, *d_kv; /* pinned, device [max_seqs]: the step's kvmix sequences */
    uint8_t *dead;      /* host [stride * page_tokens]: a rebuild's dead flags */
};

/* A prefill chunk's view of its sequence read back (gpu_llama_prefill), allocated on first use. */
struct prefill_rows {
    int32_t capacity;       /* view tokens a sequence can have: max_pages_per_seq * page_tokens */
    int32_t n_view;         /* the chunk's view tokens */
    uint16_t *k, *v;        /* FP16 [capacity][n_kv][D] */
    int32_t *kpos, *d_kpos; /* host, device [capacity]: each view token's position, -1 dead */
};

/* What sequences record for eviction (gpu_llama_observe), allocated on first use. Attention is
   summed on the device per view token (a sequence's view only grows between evictions) and
   folded to positions on the host before anything changes the view. */
struct observation {
    int32_t view_capacity;    /* view tokens a sequence may list: max_tokens + page_tokens */
    int32_t *flags;           /* host [max_seqs] */
    int32_t *n_queries;       /* host [max_seqs] */
    uint8_t *pending;         /* host [max_seqs]: d_mass holds attention not folded yet */
    float *d_qsum;            /* [max_seqs][n_layers][n_q][D] */
    float *d_mass;            /* [max_seqs][view_capacity] by view token */
    float *h_mass;            /* host [max_seqs][max_tokens] by position */
    float *d_scores;          /* [max(n_layers, max_seqs)][view_capacity]: intent scores per layer,
                              or a recorded step's attention per step row */
    int32_t *h_into, *d_into; /* pinned, device [max_seqs]: the sequence a step row's attention
                                 adds into, -1 for rows not recording it */
    float *h_scores;          /* pinned [n_layers][view_capacity] */
    int32_t *positions;       /* host [view_capacity] */
    float *d_memory;          /* [n_layers][n_q][D] */
    float *d_readout;         /* [n_layers][view_capacity]: key features' readouts per layer */
    void *work;               /* kvmix_cuda_view_intent_score_seqs's for max_seqs sequences */
    size_t work_bytes;
};

} // namespace

struct gpu_llama {
    llama_config c;
    char device_name[256];
    cudaStream_t stream;
    cublasHandle_t blas;
    float *embed, *final_norm, *head;
    layer_weights *layers; /* host array of device pointers */
    double *inv_freq;
    int32_t max_seqs, max_tokens;
    bool fp32;
    kvmix_policy policy;
    int32_t *next_pos; /* host [max_seqs] */
    uint8_t *in_use;   /* host [max_seqs] */
    /* the fp32 reference: [max_seqs][n_layers][n_kv_heads][max_tokens][head_dim] */
    float *ref_k, *ref_v;
    float *ref_part; /* each chunk's max, sum and weighted values: ref_part_floats() */
    /* the kvmix cache */
    kvmix_cache cache;
    void *cache_memory;
    uint8_t *arena;
    int32_t *kv_seq; /* [max_seqs] kvmix sequence of each sequence */
    int32_t *step_kv_seqs;
    kvmix_cache_batch *batches; /* [max_jobs] */
    staging *stages;            /* [n_layers + 1]: one per layer, the last for flushes */
    view_staging view;
    kept_view kept;
    prefill_rows prefill;
    uint16_t *fill_k, *fill_v; /* synthetic rows of gpu_llama_fill, [FILL_ROWS][n_kv][D] */
    /* storage by template tag (gpu_llama_tag): a tagger per sequence, the formats of the step */
    bool tagged;
    kvmix_policy tag_policy;
    kvmix_tag_precision tag_table;
    kvmix_tag_spec tag_spec;
    kvmix_tagger *taggers;         /* [max_seqs] */
    kvmix_cache_precision *by_tag; /* [max_seqs] */
    uint32_t *runs;                /* [max_seqs]: the step tokens' runs (kvmix_policy_token_run) */
    kvmix_tag *tags;               /* [max_seqs][max_tokens]: each position's tag */
    int32_t *turns;                /* [max_seqs]: the turn each sequence's cache was aged to */
    /* profile */
    bool profiling;
    cudaEvent_t *events; /* [2 n_layers]: around each layer's attention */
    gpu_llama_profile prof;
    int32_t *d_flags;
    uint16_t *k16, *v16, *q16, *o16;
    void *work;
    size_t work_bytes;
    int32_t n_sms, max_smem; /* multiprocessors, dynamic shared memory a block may have */
    int32_t fixed_splits;    /* gpu_llama_batch_invariant: decode's split count, 0 = by the step */
    int32_t max_rows;        /* rows the activations hold: a step's sequences or a chunk */
    /* activations [max_rows][...] */
    float *x, *xn, *qkv, *att, *ffn, *logits, *h_logits;
    int32_t *h_step, *d_step; /* [4 max_rows]: a step's tokens, positions, sequences, what each
                                 records (gpu_llama_observe) */
    observation obs;
    /* gpu_llama_capture: each sequence's capture (NULL: none), how many are set, and a step's
       post-RoPE q, k and v rows of every layer as they left the device [n_layers][max_rows][...] */
    llama_capture **captures;
    int32_t n_capturing;
    float *h_capture_rows;
};

namespace {

/* ---- kernels ------------------------------------------------------------------------------ */

__global__ void embed_kernel(const float *embed, const int32_t *tokens, int32_t hidden, float *x) {
    const float *row = embed + (size_t)tokens[blockIdx.x] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        x[(size_t)blockIdx.x * hidden + i] = row[i];
}

/* One block per row: out = x / sqrt(mean(x^2) + eps) * weight, the sum of squares in double. */
__global__ void rms_norm_kernel(const float *x, const float *weight, int32_t n, float eps,
                                float *out) {
    __shared__ double partial[THREADS];
    const float *row = x + (size_t)blockIdx.x * n;
    double sum = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += (double)row[i] * row[i];
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if ((int)threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
        __syncthreads();
    }
    float scale = (float)(1.0 / sqrt(partial[0] / n + eps));
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[(size_t)blockIdx.x * n + i] = row[i] * scale * weight[i];
}

/* Rotate-half RoPE of the query and key heads of each row of qkv at the row's position. */
__global__ void rope_kernel(float *qkv, const int32_t *pos, const double *inv_freq,
                            int32_t row_floats, int32_t head_dim) {
    int half = head_dim / 2, i = threadIdx.x;
    float *x = qkv + (size_t)blockIdx.x * row_floats + (size_t)blockIdx.y * head_dim;
    if (i >= half) return;
    double angle = (double)pos[blockIdx.x] * inv_freq[i];
    float c = (float)cos(angle), s = (float)sin(angle), a = x[i], b = x[i + half];
    x[i] = a * c - b * s;
    x[i + half] = b * c + a * s;
}

/* Keys, values and queries of each row as FP16 rows: k16, v16 [n][n_kv][D], q16 [n][n_q][D]. */
__global__ void to_half_kernel(const float *qkv, int32_t n_q, int32_t n_kv, int32_t head_dim,
                               __half *q16, __half *k16, __half *v16) {
    int32_t row_floats = (n_q + 2 * n_kv) * head_dim, q_floats = n_q * head_dim;
    int32_t kv_floats = n_kv * head_dim;
    const float *row = qkv + (size_t)blockIdx.x * row_floats;
    for (int i = threadIdx.x; i < row_floats; i += blockDim.x) {
        __half h = __float2half_rn(row[i]);
        if (i < q_floats)
            q16[(size_t)blockIdx.x * q_floats + i] = h;
        else if (i < q_floats + kv_floats)
            k16[(size_t)blockIdx.x * kv_floats + i - q_floats] = h;
        else
            v16[(size_t)blockIdx.x * kv_floats + i - q_floats - kv_floats] = h;
    }
}

__global__ void from_half_kernel(const __half *in, size_t n, float *out) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        out[i] = __half2float(in[i]);
}

__global__ void swiglu_kernel(float *gate_up, int32_t ffn) {
    float *row = gate_up + (size_t)blockIdx.x * 2 * ffn;
    for (int i = threadIdx.x; i < ffn; i += blockDim.x) {
        float g = row[i];
        row[i] = g / (1.0f + expf(-g)) * row[ffn + i];
    }
}

/* Adds the step's query rows of the sequences that record them to their sums: grid (n, n_q). */
__global__ void sum_queries_kernel(const float *qkv, const int32_t *step, int32_t n, int32_t layer,
                                   int32_t n_layers, int32_t n_q, int32_t row_floats,
                                   int32_t head_dim, float *qsum) {
    int32_t i = blockIdx.x, h = blockIdx.y, seq = step[2 * n + i];
    if (!(step[3 * n + i] & GPU_LLAMA_OBSERVE_QUERIES)) return;
    const float *q = qkv + (size_t)i * row_floats + (size_t)h * head_dim;
    float *sum = qsum + (((size_t)seq * n_layers + layer) * n_q + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) sum[d] += q[d];
}

/* Step row blockIdx.y's finite scores [n] added to its sequence's row of acc ([seqs][stride]),
   for rows whose into[] names one; dead and past-the-end tokens score -INFINITY. */
__global__ void add_finite_kernel(const float *scores, int32_t n, const int32_t *into,
                                  int32_t stride, float *acc) {
    int32_t i = blockIdx.x * blockDim.x + threadIdx.x, s = into[blockIdx.y];
    if (i >= n || s < 0) return;
    const float x = scores[(size_t)blockIdx.y * n + i];
    if (isfinite(x)) acc[(size_t)s * stride + i] += x;
}

/* Rebuilt spans into their sequences' slabs. */
__global__ void scatter_spans_kernel(const kvmix_view_span *patch, const int32_t *at, int32_t n,
                                     kvmix_view_span *slabs) {
    int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) slabs[at[i]] = patch[i];
}

/* The view's spans of step sequence blockIdx.x from its kvmix sequence's slab. */
__global__ void gather_spans_kernel(const kvmix_view_span *slabs, int32_t stride, const int32_t *kv,
                                    const int32_t *first, kvmix_view_span *out) {
    const kvmix_view_span *from = slabs + (size_t)kv[blockIdx.x] * stride;
    int32_t begin = first[blockIdx.x], end = first[blockIdx.x + 1];
    for (int32_t j = begin + (int32_t)threadIdx.x; j < end; j += blockDim.x)
        out[j] = from[j - begin];
}

/* Layer l's spans from layer 0's: a page lays its layers out one after another (kvmix.h,
   kvmix_cache_view). */
__global__ void shift_spans_kernel(const kvmix_view_span *in, kvmix_view_span *out, int32_t n,
                                   int32_t layer, int32_t n_kv) {
    int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    kvmix_view_span s = in[i];
    uint64_t step = (uint64_t)layer * (uint64_t)n_kv *
                    ((uint64_t)s.key_head_bytes + (uint64_t)s.value_head_bytes);
    s.key_offset += step;
    s.value_offset += step;
    out[i] = s;
}

/* Deterministic FP16 rows in [-2, 2) for synthetic fills. */
__global__ void fill_rows_kernel(__half *rows, size_t n, uint32_t salt) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ salt;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        rows[i] = __float2half_rn((float)(h & 0xffff) / 16384.0f - 2.0f);
    }
}

/* View rows to position rows: row t of src ([n][row] halves) to row positions[t] of dst, rows of
   dead view tokens (position -1) dropped. */
__global__ void scatter_rows_kernel(const __half *src, const int32_t *positions, int32_t n,
                                    size_t row, __half *dst) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)n * row;
         i += (size_t)gridDim.x * blockDim.x) {
        int32_t pos = positions[i / row];
        if (pos >= 0) dst[(size_t)pos * row + i % row] = src[i];
    }
}

struct ref_params {
    float *k, *v;        /* the fp32 reference cache */
    const float *qkv;    /* [n][row_floats] */
    const int32_t *seqs; /* [n] */
    const int32_t *pos;  /* [n] */
    float *att;          /* [n][n_q][D] */
    int32_t layer, n_layers, n_q, n_kv, head_dim, max_tokens;
    float scale;
};

__device__ size_t ref_offset(const ref_params &p, int32_t seq, int32_t h, int32_t t) {
    return ((((size_t)seq * p.n_layers + p.layer) * p.n_kv + h) * p.max_tokens + t) * p.head_dim;
}

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

/* Stores each row's keys and values at its position of the fp32 reference cache. */
__global__ void ref_store_kernel(ref_params p) {
    int32_t i = blockIdx.x, h = blockIdx.y;
    const float *row = p.qkv + (size_t)i * (p.n_q + 2 * p.n_kv) * p.head_dim;
    const float *k = row + (size_t)(p.n_q + h) * p.head_dim;
    const float *v = row + (size_t)(p.n_q + p.n_kv + h) * p.head_dim;
    size_t at = ref_offset(p, p.seqs[i], h, p.pos[i]);
    for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
        p.k[at + d] = k[d];
        p.v[at + d] = v[d];
    }
}

/* Dynamic shared memory of attend_one over n tokens: its scores, padded to whole float4s. */
__host__ __device__ inline size_t attend_scores_bytes(int64_t n) {
    return (size_t)((n + 3) / 4) * sizeof(float4);
}

/* One query row of a block against n tokens in fp32, in llama_attend_rows' order of work (scores,
 * max, exp, a double sum, weighted values): key(t) and value(t) point at token t's rows (head_dim
 * floats or halves), visible(t) says whether the query sees it. scores: attend_scores_bytes(n) of
 * dynamic shared memory; the weighted sum reads them as float4s, the padding zero (a zero weight
 * is skipped), so no read passes the allocation. */
template <typename Visible, typename Key, typename Value>
__device__ void attend_one(const float *q, int32_t n, int32_t head_dim, float scale,
                           Visible visible, Key key, Value value, float *scores, float *out) {
    __shared__ double partial[THREADS];
    __shared__ float top[THREADS];
    float best = -INFINITY;
    for (int t = threadIdx.x; t < n; t += blockDim.x) {
        float acc = 0.0f;
        if (visible(t))
            for (int d = 0; d < head_dim; d++) acc += q[d] * to_float(key(t)[d]);
        scores[t] = visible(t) ? scale * acc : -INFINITY;
        best = fmaxf(best, scores[t]);
    }
    top[threadIdx.x] = best;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if ((int)threadIdx.x < stride)
            top[threadIdx.x] = fmaxf(top[threadIdx.x], top[threadIdx.x + stride]);
        __syncthreads();
    }
    best = top[0];
    double sum = 0.0;
    const int n4 = (n + 3) / 4 * 4;
    for (int t = threadIdx.x; t < n4; t += blockDim.x) {
        scores[t] = t < n && visible(t) ? expf(scores[t] - best) : 0.0f;
        sum += scores[t];
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if ((int)threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
        __syncthreads();
    }
    float inv_sum = (float)(1.0 / partial[0]);
    const float4 *weights = reinterpret_cast<const float4 *>(scores);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int t = 0; t < n4; t += 4) {
            const float4 w = weights[t / 4];
            if (w.x != 0.0f) acc += w.x * to_float(value(t)[d]);
            if (w.y != 0.0f) acc += w.y * to_float(value(t + 1)[d]);
            if (w.z != 0.0f) acc += w.z * to_float(value(t + 2)[d]);
            if (w.w != 0.0f) acc += w.w * to_float(value(t + 3)[d]);
        }
        out[d] = acc * inv_sum;
    }
}

/* Floats of one chunk's partial result: its max score, its sum of exponentials, head_dim
   weighted values. */
__host__ __device__ inline size_t ref_part_stride(int32_t head_dim) { return 2 + (size_t)head_dim; }

/* The fp32 reference attention of row blockIdx.x, query head blockIdx.y, over the REF_CHUNK
 * tokens of chunk blockIdx.z (positions 0 .. pos of the row's sequence): each warp takes every
 * REF_WARPS-th token, a lane holding the channels lane, lane + 32, ...; a token's score is one
 * butterfly sum over the warp, the chunk's weighted values a sum over its tokens, the warps' parts
 * added in warp order. What a row gets depends on its own sequence alone (no batch neighbour,
 * fixed chunks): batch-invariant. out: ref_part_stride floats at [row][head][chunk]. */
__global__ void ref_attend_chunk_kernel(ref_params p, int32_t n_chunks, float *part) {
    __shared__ float scores[REF_CHUNK], warp_best[REF_WARPS];
    __shared__ float warp_acc[REF_WARPS][REF_LANE_DIMS * 32];
    __shared__ double warp_sum[REF_WARPS];
    const int32_t i = blockIdx.x, hq = blockIdx.y, chunk = blockIdx.z;
    const int32_t h = hq / (p.n_q / p.n_kv), D = p.head_dim;
    const int32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int32_t n = p.pos[i] + 1, t0 = chunk * REF_CHUNK;
    const int32_t t1 = t0 + REF_CHUNK < n ? t0 + REF_CHUNK : n;
    float *out = part + (((size_t)i * p.n_q + hq) * n_chunks + chunk) * ref_part_stride(D);
    if (t0 >= n) { /* past the sequence: an empty part the merge skips */
        if (threadIdx.x == 0) out[0] = -INFINITY, out[1] = 0.0f;
        return;
    }
    const float *q = p.qkv + (size_t)i * (p.n_q + 2 * p.n_kv) * D + (size_t)hq * D;
    const size_t base = ref_offset(p, p.seqs[i], h, 0);
    float qv[REF_LANE_DIMS], acc[REF_LANE_DIMS];
    for (int j = 0; j < REF_LANE_DIMS; j++) {
        int d = lane + 32 * j;
        qv[j] = d < D ? q[d] : 0.0f, acc[j] = 0.0f;
    }
    float best = -INFINITY;
    for (int32_t t = t0 + warp; t < t1; t += REF_WARPS) {
        const float *k = p.k + base + (size_t)t * D;
        float dot = 0.0f;
        for (int j = 0; j < REF_LANE_DIMS && lane + 32 * j < D; j++)
            dot = fmaf(qv[j], k[lane + 32 * j], dot);
        for (int m = 16; m > 0; m /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, m);
        float score = p.scale * dot;
        if (lane == 0) scores[t - t0] = score;
        best = fmaxf(best, score);
    }
    if (lane == 0) warp_best[warp] = best;
    __syncthreads();
    best = warp_best[0];
    for (int w = 1; w < REF_WARPS; w++) best = fmaxf(best, warp_best[w]);
    double sum = 0.0;
    for (int32_t t = t0 + warp; t < t1; t += REF_WARPS) {
        const float weight = expf(scores[t - t0] - best);
        const float *v = p.v + base + (size_t)t * D;
        sum += weight;
        for (int j = 0; j < REF_LANE_DIMS && lane + 32 * j < D; j++)
            acc[j] = fmaf(weight, v[lane + 32 * j], acc[j]);
    }
    for (int j = 0; j < REF_LANE_DIMS; j++) warp_acc[warp][lane + 32 * j] = acc[j];
    if (lane == 0) warp_sum[warp] = sum;
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = warp_acc[0][d];
        for (int w = 1; w < REF_WARPS; w++) a += warp_acc[w][d];
        out[2 + d] = a;
    }
    if (threadIdx.x == 0) {
        double total = warp_sum[0];
        for (int w = 1; w < REF_WARPS; w++) total += warp_sum[w];
        out[0] = best, out[1] = (float)total;
    }
}

/* The chunks' parts of row blockIdx.x, query head blockIdx.y merged in chunk order into its
   attention output. */
__global__ void ref_attend_merge_kernel(ref_params p, int32_t n_chunks, const float *part) {
    const int32_t i = blockIdx.x, hq = blockIdx.y, D = p.head_dim;
    const size_t stride = ref_part_stride(D);
    const float *row = part + ((size_t)i * p.n_q + hq) * n_chunks * stride;
    float best = -INFINITY;
    for (int32_t c = 0; c < n_chunks; c++) best = fmaxf(best, row[c * stride]);
    double sum = 0.0;
    for (int32_t c = 0; c < n_chunks; c++)
        if (row[c * stride + 1] > 0.0f)
            sum += (double)row[c * stride + 1] * exp(row[c * stride] - best);
    const float inv_sum = (float)(1.0 / sum);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int32_t c = 0; c < n_chunks; c++)
            if (row[c * stride + 1] > 0.0f)
                acc = fmaf(row[c * stride + 2 + d], expf(row[c * stride] - best), acc);
        p.att[((size_t)i * p.n_q + hq) * D + d] = acc * inv_sum;
    }
}

/* Causal attention of a prefill chunk: query i (position pos0 + i) of head blockIdx.y over the
 * sequence's rows read back from its view (FP16, [n_view][n_kv][D]), view token t seen when
 * 0 <= kpos[t] <= pos0 + i (kpos: its position, -1 for a dead row). Dynamic shared memory:
 * attend_scores_bytes(n_view). */
__global__ void prefill_attend_kernel(const float *qkv, const __half *k, const __half *v,
                                      const int32_t *kpos, int32_t n_view, int32_t pos0,
                                      int32_t n_q, int32_t n_kv, int32_t head_dim, float scale,
                                      float *att) {
    extern __shared__ __align__(16) float scores[];
    int32_t i = blockIdx.x, hq = blockIdx.y, h = hq / (n_q / n_kv), pos = pos0 + i;
    const float *q = qkv + (size_t)i * (n_q + 2 * n_kv) * head_dim + (size_t)hq * head_dim;
    attend_one(
        q, n_view, head_dim, scale, [&](int t) { return kpos[t] >= 0 && kpos[t] <= pos; },
        [&](int t) { return k + ((size_t)t * n_kv + h) * head_dim; },
        [&](int t) { return v + ((size_t)t * n_kv + h) * head_dim; }, scores,
        att + ((size_t)i * n_q + hq) * head_dim);
}

/* ---- host helpers ------------------------------------------------------------------------- */

llama_result cuda_fail(char *err, size_t err_bytes, cudaError_t e, const char *what) {
    return llama_fail(err, err_bytes,
                      e == cudaErrorMemoryAllocation ? LLAMA_ERR_MEMORY : LLAMA_ERR_UNSUPPORTED,
                      "%s: %s", what, cudaGetErrorString(e));
}

#define TRY_CUDA(call, what)                                                                       \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) return cuda_fail(err, err_bytes, e_, what);                         \
    } while (0)

#define TRY_KVMIX(call, what)                                                                      \
    do {                                                                                           \
        kvmix_result r_ = (call);                                                                  \
        if (r_ != KVMIX_SUCCESS)                                                                   \
            return llama_fail(err, err_bytes,                                                      \
                              r_ == KVMIX_ERR_OUT_OF_MEMORY ? LLAMA_ERR_CAPACITY                   \
                                                            : LLAMA_ERR_UNSUPPORTED,               \
                              "%s: %s", what, kvmix_result_string(r_));                            \
    } while (0)

template <typename T> cudaError_t device_alloc(T **p, size_t count) {
    return cudaMalloc((void **)p, count * sizeof(T) > 0 ? count * sizeof(T) : 1);
}

template <typename T> cudaError_t pinned_alloc(T **p, size_t count) {
    return cudaMallocHost((void **)p, count * sizeof(T) > 0 ? count * sizeof(T) : 1);
}

llama_result upload(const float *host, size_t n, float **out, char *err, size_t err_bytes) {
    TRY_CUDA(device_alloc(out, n), "weights");
    TRY_CUDA(cudaMemcpy(*out, host, n * sizeof(float), cudaMemcpyHostToDevice), "weights");
    return LLAMA_OK;
}

llama_result upload_matrix(const llama_matrix *m, float **out, char *err, size_t err_bytes) {
    size_t n = (size_t)m->n_out * (size_t)m->n_in;
    float *rows = (float *)malloc(n * sizeof(float));
    if (!rows) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "weights: out of host memory");
    llama_matrix_rows(m, rows);
    llama_result r = upload(rows, n, out, err, err_bytes);
    free(rows);
    return r;
}

llama_result upload_model(gpu_llama *g, const llama_model *m, char *err, size_t err_bytes) {
    const llama_config *c = &m->config;
    llama_result r = upload(m->embed, (size_t)c->vocab * c->hidden, &g->embed, err, err_bytes);
    if (r == LLAMA_OK) r = upload(m->final_norm, (size_t)c->hidden, &g->final_norm, err, err_bytes);
    if (r == LLAMA_OK) r = upload_matrix(&m->head, &g->head, err, err_bytes);
    g->layers = (layer_weights *)calloc((size_t)c->n_layers, sizeof *g->layers);
    if (!g->layers) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    for (int32_t l = 0; r == LLAMA_OK && l < c->n_layers; l++) {
        const llama_layer *src = &m->layers[l];
        layer_weights *dst = &g->layers[l];
        r = upload(src->attn_norm, (size_t)c->hidden, &dst->attn_norm, err, err_bytes);
        if (r == LLAMA_OK)
            r = upload(src->ffn_norm, (size_t)c->hidden, &dst->ffn_norm, err, err_bytes);
        if (r == LLAMA_OK) r = upload_matrix(&src->qkv, &dst->qkv, err, err_bytes);
        if (r == LLAMA_OK) r = upload_matrix(&src->out, &dst->out, err, err_bytes);
        if (r == LLAMA_OK) r = upload_matrix(&src->gate_up, &dst->gate_up, err, err_bytes);
        if (r == LLAMA_OK) r = upload_matrix(&src->down, &dst->down, err, err_bytes);
    }
    return r;
}

/* y[n][out] = x[n][in] . W[out][in]^T (+ y when accumulate), fp32 without tensor-core rounding;
   rows of x are x_stride floats apart. */
llama_result matmul(gpu_llama *g, const float *w, int32_t n_out, int32_t n_in, const float *x,
                    int32_t x_stride, int32_t n, float *y, bool accumulate, char *err,
                    size_t err_bytes) {
    const float one = 1.0f, zero = 0.0f;
    /* batch-invariant: groups of PRODUCT_ROWS rows whatever n (the activations hold the padding) */
    const int32_t group = g->fixed_splits > 0 ? PRODUCT_ROWS : n;
    for (int32_t r0 = 0; r0 < n; r0 += group) {
        cublasStatus_t s = cublasSgemm(g->blas, CUBLAS_OP_T, CUBLAS_OP_N, n_out, group, n_in, &one,
                                       w, n_in, x + (size_t)r0 * x_stride, x_stride,
                                       accumulate ? &one : &zero, y + (size_t)r0 * n_out, n_out);
        if (s != CUBLAS_STATUS_SUCCESS)
            return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED, "cublasSgemm failed (%d)",
                              (int)s);
    }
    return LLAMA_OK;
}

/* The cache's desc for the policy: room for every sequence's pages at FP16, plus the pages in
   flight at a page boundary, as kvmix_kv.c sizes its one-sequence cache. */
kvmix_result cache_desc(const gpu_llama *g, kvmix_cache_desc *d) {
    memset(d, 0, sizeof *d);
    d->n_layers = g->c.n_layers;
    d->n_kv_heads = g->c.n_kv_heads;
    d->head_dim = g->c.head_dim;
    d->max_seqs = g->max_seqs;
    d->max_tokens_per_seq = g->max_tokens;
    kvmix_result r = kvmix_policy_apply(&g->policy, d, NULL);
    if (r != KVMIX_SUCCESS) return r;
    /* BOOSTED keys that a tag allocation asks of a policy without them: as kvmix_kv.c */
    if (d->n_boost == 0) d->n_boost = d->head_dim / 8;
    /* tagged tokens close a page at each new run: room for runs of 4 tokens, as kvmix_kv.c */
    d->max_pages_per_seq = d->max_tokens_per_seq / 4 + 8;
    size_t page_bytes =
        (size_t)d->n_layers * d->n_kv_heads * 2 * (size_t)d->page_tokens * (size_t)d->head_dim * 2;
    size_t granule = 256, pages = (size_t)(g->max_tokens / d->page_tokens) + 4;
    d->arena_bytes = (size_t)g->max_seqs * pages * ((page_bytes + granule - 1) / granule * granule);
    d->granule_bytes = granule;
    d->device_arena = 1;
    /* a step's writes and seals, and room for one compaction run (kvmix_cache_compact); or, if
       more, a whole sequence's re-tier at a new turn (kvmix_policy_retier_turn: a gather and a
       pack per block of every page), which runs on a queue its caller emptied */
    int64_t blocks = (int64_t)d->n_layers * d->n_kv_heads;
    int64_t step_jobs = (8 * (int64_t)g->max_seqs + 4 * (int64_t)d->page_tokens + 2) * blocks;
    int64_t retier_jobs = 4 * blocks * d->max_pages_per_seq;
    int64_t jobs = (step_jobs > retier_jobs ? step_jobs : retier_jobs) + 64;
    d->max_jobs = (int32_t)(jobs < (1 << 24) ? jobs : (1 << 24));
    return KVMIX_SUCCESS;
}

llama_result create_stage(gpu_llama *g, staging *s, char *err, size_t err_bytes) {
    size_t jobs = (size_t)g->cache.desc.max_jobs;
    TRY_CUDA(pinned_alloc(&s->jobs, jobs), "pinned staging");
    TRY_CUDA(device_alloc(&s->d_jobs, jobs), "job array");
    return LLAMA_OK;
}

void free_stage(staging *s) {
    cudaFreeHost(s->jobs);
    cudaFree(s->d_jobs);
    cudaFree(s->d_spans);
}

void free_view_staging(view_staging *v) {
    cudaFreeHost(v->spans);
    cudaFree(v->d_spans);
    cudaFreeHost(v->first);
    cudaFree(v->d_first);
    cudaFreeHost(v->dead);
    cudaFree(v->d_dead);
}

/* A pinned host array and its device twin with room for `need` elements: larger ones (with
   `slack` more) once the stream no longer reads the old ones. */
template <typename T>
llama_result grow_pair(gpu_llama *g, T **host, T **device, int32_t *capacity, int32_t need,
                       int32_t slack, char *err, size_t err_bytes) {
    if (need <= *capacity) return LLAMA_OK;
    int32_t cap = need + need / 2 + slack;
    TRY_CUDA(cudaStreamSynchronize(g->stream), "growing the view");
    cudaFreeHost(*host), cudaFree(*device);
    *host = NULL, *device = NULL, *capacity = 0;
    TRY_CUDA(pinned_alloc(host, (size_t)cap), "pinned staging");
    TRY_CUDA(device_alloc(device, (size_t)cap), "view arrays");
    *capacity = cap;
    return LLAMA_OK;
}

/* Room for n_spans spans and n_dead flags in the view staging. */
llama_result grow_view_staging(gpu_llama *g, int32_t n_spans, int32_t n_dead, char *err,
                               size_t err_bytes) {
    view_staging *v = &g->view;
    llama_result r =
        grow_pair(g, &v->spans, &v->d_spans, &v->span_capacity, n_spans, 64, err, err_bytes);
    return r == LLAMA_OK
               ? grow_pair(g, &v->dead, &v->d_dead, &v->dead_capacity, n_dead, 4096, err, err_bytes)
               : r;
}

llama_result create_cache(gpu_llama *g, size_t arena_bytes, char *err, size_t err_bytes) {
    kvmix_cache_desc d;
    size_t memory_bytes = 0;
    TRY_KVMIX(cache_desc(g, &d), "policy");
    if (arena_bytes != 0) { /* a budget: larger granules keep allocation scans short */
        d.arena_bytes = arena_bytes;
        d.granule_bytes = 4096;
    }
    if (g->policy.value_group_size != 0 && g->policy.value_group_size != g->policy.group_size)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED,
                          "policy %s: the decode kernel reads values in the keys' groups only",
                          g->policy.name);
    TRY_KVMIX(kvmix_cache_memory_bytes(&d, &memory_bytes, NULL), "cache desc");
    g->cache_memory = malloc(memory_bytes);
    if (!g->cache_memory) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    TRY_CUDA(device_alloc(&g->arena, d.arena_bytes), "the cache arena");
    TRY_KVMIX(kvmix_cache_init(&g->cache, &d, g->cache_memory, memory_bytes, g->arena, NULL),
              "cache");
    g->kv_seq = (int32_t *)malloc((size_t)g->max_seqs * sizeof(int32_t));
    g->step_kv_seqs = (int32_t *)malloc((size_t)g->max_seqs * sizeof(int32_t));
    g->batches = (kvmix_cache_batch *)malloc((size_t)d.max_jobs * sizeof(kvmix_cache_batch));
    g->stages = (staging *)calloc((size_t)g->c.n_layers + 1, sizeof(staging));
    g->events = (cudaEvent_t *)calloc(2 * (size_t)g->c.n_layers, sizeof(cudaEvent_t));
    if (!g->kv_seq || !g->step_kv_seqs || !g->batches || !g->stages || !g->events)
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    for (int32_t l = 0; l <= g->c.n_layers; l++) {
        llama_result r = create_stage(g, &g->stages[l], err, err_bytes);
        if (r != LLAMA_OK) return r;
    }
    for (int32_t i = 0; i < 2 * g->c.n_layers; i++)
        TRY_CUDA(cudaEventCreate(&g->events[i]), "events");
    TRY_CUDA(pinned_alloc(&g->view.first, (size_t)g->max_seqs + 1), "pinned staging");
    TRY_CUDA(device_alloc(&g->view.d_first, (size_t)g->max_seqs + 1), "view spans");
    size_t kv_halves = (size_t)g->max_rows * g->c.n_kv_heads * g->c.head_dim;
    size_t q_halves = (size_t)g->max_rows * g->c.n_heads * g->c.head_dim;
    TRY_CUDA(device_alloc(&g->k16, kv_halves), "rows");
    TRY_CUDA(device_alloc(&g->v16, kv_halves), "rows");
    TRY_CUDA(device_alloc(&g->q16, q_halves), "rows");
    TRY_CUDA(device_alloc(&g->o16, q_halves), "rows");
    TRY_CUDA(device_alloc(&g->d_flags, 1), "flags");
    TRY_CUDA(cudaMemset(g->d_flags, 0, sizeof(int32_t)), "flags");
    TRY_KVMIX(kvmix_cuda_decode_workspace_bytes(g->max_seqs, g->c.n_heads, g->c.head_dim,
                                                MAX_SPLITS, &g->work_bytes),
              "decode workspace");
    TRY_CUDA(cudaMalloc(&g->work, g->work_bytes), "decode workspace");
    return LLAMA_OK;
}

/* Chunks of the fp32 reference's longest row: a sequence at max_tokens. */
int32_t ref_max_chunks(const gpu_llama *g) { return (g->max_tokens + REF_CHUNK - 1) / REF_CHUNK; }

/* The fp32 reference's partial results: a chunk's part for every row a forward pass runs (a step's
   sequences or a prefill chunk's rows), query head and chunk. */
size_t ref_part_floats(const gpu_llama *g) {
    return (size_t)g->max_rows * g->c.n_heads * ref_max_chunks(g) * ref_part_stride(g->c.head_dim);
}

llama_result create_buffers(gpu_llama *g, char *err, size_t err_bytes) {
    const llama_config *c = &g->c;
    size_t n = (size_t)g->max_rows;
    size_t qkv = (size_t)(c->n_heads + 2 * c->n_kv_heads) * c->head_dim;
    TRY_CUDA(device_alloc(&g->x, n * c->hidden), "activations");
    TRY_CUDA(device_alloc(&g->xn, n * c->hidden), "activations");
    TRY_CUDA(device_alloc(&g->qkv, n * qkv), "activations");
    TRY_CUDA(device_alloc(&g->att, n * c->n_heads * c->head_dim), "activations");
    TRY_CUDA(device_alloc(&g->ffn, n * 2 * c->ffn), "activations");
    TRY_CUDA(device_alloc(&g->logits, n * c->vocab), "activations");
    /* batch-invariant products read whole groups of rows: the rows past a step's are defined */
    float *const rows[] = {g->x, g->xn, g->qkv, g->att, g->ffn, g->logits};
    const size_t hidden = (size_t)c->hidden, att = (size_t)c->n_heads * c->head_dim;
    const size_t floats[] = {hidden, hidden, qkv, att, 2 * (size_t)c->ffn, (size_t)c->vocab};
    for (int i = 0; i < 6; i++)
        TRY_CUDA(cudaMemset(rows[i], 0, n * floats[i] * sizeof(float)), "activations");
    TRY_CUDA(pinned_alloc(&g->h_logits, n * c->vocab), "pinned staging");
    TRY_CUDA(device_alloc(&g->d_step, 4 * n), "tokens");
    TRY_CUDA(pinned_alloc(&g->h_step, 4 * n), "pinned staging");
    double *inv = (double *)malloc((size_t)c->head_dim / 2 * sizeof(double));
    if (!inv) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    for (int32_t i = 0; i < c->head_dim / 2; i++)
        inv[i] = pow((double)c->rope_theta, -2.0 * i / c->head_dim);
    cudaError_t e = device_alloc(&g->inv_freq, (size_t)c->head_dim / 2);
    if (e == cudaSuccess)
        e = cudaMemcpy(g->inv_freq, inv, (size_t)c->head_dim / 2 * sizeof(double),
                       cudaMemcpyHostToDevice);
    free(inv);
    TRY_CUDA(e, "rope table");
    if (g->fp32) {
        size_t floats =
            (size_t)g->max_seqs * c->n_layers * c->n_kv_heads * (size_t)g->max_tokens * c->head_dim;
        TRY_CUDA(device_alloc(&g->ref_k, floats), "the fp32 cache");
        TRY_CUDA(device_alloc(&g->ref_v, floats), "the fp32 cache");
        TRY_CUDA(device_alloc(&g->ref_part, ref_part_floats(g)), "the fp32 attention's parts");
    }
    return LLAMA_OK;
}

double now_seconds(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Takes the cache's queued jobs into `stage` and enqueues them with these source rows. */
llama_result run_jobs(gpu_llama *g, staging *stage, const void *keys, const void *values, char *err,
                      size_t err_bytes) {
    int32_t n_jobs = 0, n_batches = 0;
    TRY_KVMIX(kvmix_cache_jobs_take(&g->cache, stage->jobs, g->cache.desc.max_jobs, g->batches,
                                    g->cache.desc.max_jobs, &n_jobs, &n_batches),
              "taking the cache's jobs");
    if (n_jobs == 0) return LLAMA_OK;
    TRY_CUDA(cudaMemcpyAsync(stage->d_jobs, stage->jobs, (size_t)n_jobs * sizeof *stage->jobs,
                             cudaMemcpyHostToDevice, g->stream),
             "uploading jobs");
    TRY_KVMIX(kvmix_cuda_cache_run(g->batches, n_batches, stage->d_jobs, keys, values, g->arena,
                                   g->d_flags, g->stream),
              "running the cache's jobs");
    return LLAMA_OK;
}

/* A full job queue in the middle of a call: its jobs run now, through the spare stage. */
llama_result flush_jobs(gpu_llama *g, const void *keys, const void *values, char *err,
                        size_t err_bytes) {
    llama_result r = run_jobs(g, &g->stages[g->c.n_layers], keys, values, err, err_bytes);
    if (r != LLAMA_OK) return r;
    TRY_CUDA(cudaStreamSynchronize(g->stream), "flushing jobs");
    return LLAMA_OK;
}

/* A cache call that may find the job queue or the arena full (bytes a call frees wait for the
   take): the queued jobs run, with these source rows, and the call runs once more. */
template <typename Call>
llama_result call_with_room(gpu_llama *g, const void *keys, const void *values, const char *what,
                            char *err, size_t err_bytes, Call call) {
    kvmix_result r = call();
    if (r == KVMIX_ERR_OUT_OF_MEMORY) {
        g->prof.flushes++;
        llama_result f = flush_jobs(g, keys, values, err, err_bytes);
        if (f != LLAMA_OK) return f;
        r = call();
    }
    TRY_KVMIX(r, what);
    return LLAMA_OK;
}

/* The step's view of layer 0, built on the host and uploaded. */
llama_result upload_view(gpu_llama *g, int32_t n, char *err, size_t err_bytes) {
    view_staging *v = &g->view;
    int32_t n_spans = 0, n_dead = 0;
    TRY_KVMIX(kvmix_cache_view_counts(&g->cache, g->step_kv_seqs, n, &n_spans, &n_dead),
              "sizing the view");
    llama_result r = grow_view_staging(g, n_spans, n_dead, err, err_bytes);
    if (r != LLAMA_OK) return r;
    TRY_KVMIX(kvmix_cache_view(&g->cache, g->step_kv_seqs, n, 0, v->spans, v->span_capacity,
                               v->first, v->dead, v->dead_capacity, &v->view),
              "building the view");
    if (v->view.n_spans > 0)
        TRY_CUDA(cudaMemcpyAsync(v->d_spans, v->spans, (size_t)v->view.n_spans * sizeof *v->spans,
                                 cudaMemcpyHostToDevice, g->stream),
                 "uploading the view");
    TRY_CUDA(cudaMemcpyAsync(v->d_first, v->first, (size_t)(n + 1) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, g->stream),
             "uploading the view");
    if (v->view.n_dead_flags > 0)
        TRY_CUDA(cudaMemcpyAsync(v->d_dead, v->dead, (size_t)v->view.n_dead_flags,
                                 cudaMemcpyHostToDevice, g->stream),
                 "uploading the view");
    v->view.spans = v->d_spans;
    v->view.seq_first_span = v->d_first;
    v->view.dead = v->d_dead;
    return LLAMA_OK;
}

void free_kept_view(kept_view *k) {
    free(k->n);
    free(k->dead);
    cudaFree(k->d_slabs);
    cudaFreeHost(k->patch), cudaFree(k->d_patch);
    cudaFreeHost(k->patch_at), cudaFree(k->d_patch_at);
    cudaFreeHost(k->kv), cudaFree(k->d_kv);
}

llama_result create_kept_view(gpu_llama *g, char *err, size_t err_bytes) {
    kept_view *k = &g->kept;
    const kvmix_cache_desc *d = &g->cache.desc;
    if (k->n) return LLAMA_OK;
    k->stride = d->max_pages_per_seq;
    k->n = (int32_t *)calloc((size_t)d->max_seqs, sizeof(int32_t));
    k->dead = (uint8_t *)malloc((size_t)k->stride * (size_t)d->page_tokens);
    if (!k->n || !k->dead) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of memory");
    TRY_CUDA(device_alloc(&k->d_slabs, (size_t)d->max_seqs * (size_t)k->stride), "kept spans");
    TRY_CUDA(pinned_alloc(&k->kv, (size_t)g->max_seqs), "pinned staging");
    TRY_CUDA(device_alloc(&k->d_kv, (size_t)g->max_seqs), "kept spans");
    return LLAMA_OK;
}

/* Rebuilds the spans of kvmix sequence kv that changed since its last step into the patch
   staging (room for a whole sequence after n_patch); *dead: whether they hold dead rows. */
llama_result patch_kept_spans(gpu_llama *g, int32_t kv, int32_t *n_patch, bool *dead, char *err,
                              size_t err_bytes) {
    kept_view *k = &g->kept;
    int32_t from = 0, built = 0, n_dead = 0;
    TRY_KVMIX(kvmix_cache_view_changes(&g->cache, kv, &from), "view changes");
    if (from > k->n[kv]) from = k->n[kv];
    TRY_KVMIX(kvmix_cache_view_seq(&g->cache, kv, 0, from, k->patch + *n_patch, k->stride - from,
                                   k->dead, k->stride * g->cache.desc.page_tokens, 0, &built,
                                   &n_dead),
              "building the view");
    for (int32_t j = 0; j < built; j++) k->patch_at[*n_patch + j] = kv * k->stride + from + j;
    *n_patch += built;
    k->n[kv] = from + built;
    *dead = *dead || n_dead > 0;
    return LLAMA_OK;
}

/* The step's view of layer 0 from the kept spans: the changed ones rebuilt and scattered into
   their slabs, the step's sequences gathered, all on the stream. The whole view (upload_view)
   when a sequence has dead rows; its kept spans are rebuilt whole the next time. */
llama_result upload_step_view(gpu_llama *g, int32_t n, char *err, size_t err_bytes) {
    kept_view *k = &g->kept;
    view_staging *v = &g->view;
    int32_t n_patch = 0, total = 0, none = 0;
    bool dead = false;
    llama_result r = create_kept_view(g, err, err_bytes);
    int32_t most = n * k->stride; /* every sequence rebuilt whole */
    if (r == LLAMA_OK)            /* grown before it is written: growing loses the contents */
        r = grow_pair(g, &k->patch, &k->d_patch, &k->patch_capacity, most, 0, err, err_bytes);
    if (r == LLAMA_OK)
        r = grow_pair(g, &k->patch_at, &k->d_patch_at, &k->at_capacity, most, 0, err, err_bytes);
    for (int32_t i = 0; r == LLAMA_OK && i < n; i++) {
        int32_t kv = g->step_kv_seqs[i];
        r = patch_kept_spans(g, kv, &n_patch, &dead, err, err_bytes);
        v->first[i] = total;
        k->kv[i] = kv;
        total += k->n[kv];
    }
    if (r != LLAMA_OK) return r;
    if (dead) {
        for (int32_t i = 0; i < n; i++) k->n[g->step_kv_seqs[i]] = 0;
        return upload_view(g, n, err, err_bytes);
    }
    v->first[n] = total;
    if ((r = grow_view_staging(g, total, 0, err, err_bytes)) != LLAMA_OK) return r;
    if (n_patch > 0) {
        TRY_CUDA(cudaMemcpyAsync(k->d_patch, k->patch, (size_t)n_patch * sizeof *k->patch,
                                 cudaMemcpyHostToDevice, g->stream),
                 "uploading the view");
        TRY_CUDA(cudaMemcpyAsync(k->d_patch_at, k->patch_at, (size_t)n_patch * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, g->stream),
                 "uploading the view");
        scatter_spans_kernel<<<(n_patch + THREADS - 1) / THREADS, THREADS, 0, g->stream>>>(
            k->d_patch, k->d_patch_at, n_patch, k->d_slabs);
    }
    TRY_CUDA(cudaMemcpyAsync(v->d_first, v->first, (size_t)(n + 1) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, g->stream),
             "uploading the view");
    TRY_CUDA(cudaMemcpyAsync(k->d_kv, k->kv, (size_t)n * sizeof(int32_t), cudaMemcpyHostToDevice,
                             g->stream),
             "uploading the view");
    if (n > 0 && total > 0)
        gather_spans_kernel<<<n, 128, 0, g->stream>>>(k->d_slabs, k->stride, k->d_kv, v->d_first,
                                                      v->d_spans);
    /* the view's header (arena, shape) as kvmix_cache_view gives it, with the gathered spans */
    TRY_KVMIX(kvmix_cache_view(&g->cache, NULL, 0, 0, NULL, 0, &none, NULL, 0, &v->view),
              "the view's header");
    v->view.n_seqs = n;
    v->view.n_spans = total;
    v->view.spans = v->d_spans;
    v->view.seq_first_span = v->d_first;
    v->view.dead = v->d_dead;
    return LLAMA_OK;
}

/* Layer l's view: layer 0's spans moved to the layer, on the device. */
llama_result layer_view(gpu_llama *g, int32_t l, kvmix_view *out, char *err, size_t err_bytes) {
    staging *stage = &g->stages[l];
    *out = g->view.view;
    if (l == 0 || out->n_spans == 0) return LLAMA_OK;
    if (out->n_spans > stage->span_capacity) {
        int32_t cap = out->n_spans + out->n_spans / 2 + 64;
        cudaFree(stage->d_spans); /* waits for the kernels that read it */
        stage->d_spans = NULL, stage->span_capacity = 0;
        TRY_CUDA(device_alloc(&stage->d_spans, (size_t)cap), "view spans");
        stage->span_capacity = cap;
    }
    shift_spans_kernel<<<(out->n_spans + THREADS - 1) / THREADS, THREADS, 0, g->stream>>>(
        g->view.d_spans, stage->d_spans, out->n_spans, l, g->c.n_kv_heads);
    out->spans = stage->d_spans;
    return LLAMA_OK;
}

/* What the step's sequences record on layer l (gpu_llama_observe), from the layer's view and the
   step's fp32 queries; no sequence of the step has more than `longest` positions. */
llama_result record_layer(gpu_llama *g, int32_t l, const kvmix_view *view, const int32_t *seqs,
                          int32_t n, int64_t longest, char *err, size_t err_bytes) {
    observation *o = &g->obs;
    const llama_config *c = &g->c;
    int32_t row_floats = (c->n_heads + 2 * c->n_kv_heads) * c->head_dim, cap = o->view_capacity;
    bool queries = false, attention = false;
    for (int32_t i = 0; o->flags && i < n; i++) {
        int32_t s = seqs[i], f = o->flags[s];
        if ((f & GPU_LLAMA_OBSERVE_QUERIES) && l == 0) o->n_queries[s]++;
        queries = queries || (f & GPU_LLAMA_OBSERVE_QUERIES);
        attention = attention || (f & GPU_LLAMA_OBSERVE_ATTENTION);
    }
    if (attention && l == 0) { /* which sequence each row adds into, for every layer of the step */
        for (int32_t i = 0; i < n; i++) {
            int32_t s = seqs[i];
            o->h_into[i] = (o->flags[s] & GPU_LLAMA_OBSERVE_ATTENTION) ? s : -1;
            if (o->h_into[i] >= 0) o->pending[s] = 1;
        }
        TRY_CUDA(cudaMemcpyAsync(o->d_into, o->h_into, (size_t)n * sizeof(int32_t),
                                 cudaMemcpyHostToDevice, g->stream),
                 "uploading the recorders");
    }
    if (attention) { /* every row scored in one call: 4 launches, not 4 per recording sequence;
                        over the view tokens the step's sequences can have, not the capacity */
        int64_t reach = longest + g->cache.desc.page_tokens;
        int32_t step_cap = reach < cap ? (int32_t)reach : cap;
        TRY_KVMIX(kvmix_cuda_view_intent_score_seqs(view, 0, n, c->n_heads, 0.0f, g->qkv,
                                                    row_floats, o->d_scores, step_cap, o->work,
                                                    o->work_bytes, g->stream),
                  "attention of a recorded step");
        add_finite_kernel<<<dim3((step_cap + THREADS - 1) / THREADS, n), THREADS, 0, g->stream>>>(
            o->d_scores, step_cap, o->d_into, cap, o->d_mass);
    }
    if (queries)
        sum_queries_kernel<<<dim3(n, c->n_heads), 128, 0, g->stream>>>(
            g->qkv, g->d_step, n, l, c->n_layers, c->n_heads, row_floats, c->head_dim, o->d_qsum);
    return LLAMA_OK;
}

/* Attention of layer l through the cache: new rows written, jobs run, kvmix_cuda_decode over the
   layer's view of the step's sequences. */
llama_result attend_kvmix(gpu_llama *g, int32_t l, const int32_t *seqs, int32_t n, char *err,
                          size_t err_bytes) {
    const llama_config *c = &g->c;
    int64_t longest = 0;
    if (g->profiling) cudaEventRecord(g->events[2 * l], g->stream);
    to_half_kernel<<<n, THREADS, 0, g->stream>>>(g->qkv, c->n_heads, c->n_kv_heads, c->head_dim,
                                                 (__half *)g->q16, (__half *)g->k16,
                                                 (__half *)g->v16);
    double host_start = now_seconds();
    for (int32_t i = 0; i < n; i++) {
        int32_t kv = g->kv_seq[seqs[i]], pos = g->next_pos[seqs[i]];
        llama_result r = call_with_room(g, g->k16, g->v16, "writing rows", err, err_bytes, [&] {
            return kvmix_cache_write_rows(&g->cache, kv, l, pos, 1, i);
        });
        if (r != LLAMA_OK) return r;
        g->step_kv_seqs[i] = kv;
        if (pos + 1 > longest) longest = pos + 1;
    }
    llama_result rr = run_jobs(g, &g->stages[l], g->k16, g->v16, err, err_bytes);
    double view_start = now_seconds();
    if (rr == LLAMA_OK && l == 0) rr = upload_step_view(g, n, err, err_bytes);
    g->prof.view_seconds += now_seconds() - view_start;
    g->prof.host_seconds += now_seconds() - host_start;
    kvmix_view view;
    if (rr == LLAMA_OK) rr = layer_view(g, l, &view, err, err_bytes);
    if (rr != LLAMA_OK) return rr;
    kvmix_cuda_decode_desc desc = {c->n_heads, 0.0f, KVMIX_CUDA_FP16, 1, KVMIX_CUDA_STAGES_AUTO};
    TRY_KVMIX(kvmix_cuda_decode_choose_splits(n, c->n_kv_heads, c->n_heads, c->head_dim, longest,
                                              g->n_sms, &desc.n_splits),
              "split count");
    if (g->fixed_splits > 0) desc.n_splits = g->fixed_splits;
    if (desc.n_splits > MAX_SPLITS) desc.n_splits = MAX_SPLITS;
    TRY_KVMIX(
        kvmix_cuda_decode(&view, &desc, g->q16, g->o16, NULL, g->work, g->work_bytes, g->stream),
        "decode attention");
    size_t halves = (size_t)n * c->n_heads * c->head_dim;
    from_half_kernel<<<(unsigned)((halves + THREADS - 1) / THREADS), THREADS, 0, g->stream>>>(
        (const __half *)g->o16, halves, g->att);
    if (g->profiling) cudaEventRecord(g->events[2 * l + 1], g->stream);
    return record_layer(g, l, &view, seqs, n, longest, err, err_bytes);
}

/* Layer l's attention over the fp32 reference cache for the n rows in h_step, after storing their
   keys and values: chunks of REF_CHUNK tokens, then their merge. */
void attend_fp32(gpu_llama *g, int32_t l, int32_t n) {
    const llama_config *c = &g->c;
    ref_params p;
    p.k = g->ref_k, p.v = g->ref_v, p.qkv = g->qkv, p.seqs = g->d_step + 2 * n;
    p.pos = g->d_step + n;
    p.att = g->att, p.layer = l, p.n_layers = c->n_layers, p.n_q = c->n_heads;
    p.n_kv = c->n_kv_heads, p.head_dim = c->head_dim, p.max_tokens = g->max_tokens;
    p.scale = (float)(1.0 / sqrt((double)c->head_dim));
    int32_t longest = 0; /* tokens the longest row attends: its position + 1 */
    for (int32_t i = 0; i < n; i++)
        if (g->h_step[n + i] + 1 > longest) longest = g->h_step[n + i] + 1;
    int32_t n_chunks = (longest + REF_CHUNK - 1) / REF_CHUNK;
    ref_store_kernel<<<dim3(n, c->n_kv_heads), 128, 0, g->stream>>>(p);
    ref_attend_chunk_kernel<<<dim3(n, c->n_heads, n_chunks), 32 * REF_WARPS, 0, g->stream>>>(
        p, n_chunks, g->ref_part);
    ref_attend_merge_kernel<<<dim3(n, c->n_heads), 128, 0, g->stream>>>(p, n_chunks, g->ref_part);
}

/* Tags the step's tokens: *out (NULL when the cache is not tagged) gets the formats each asks
   for; a token that opens a new user turn first ages its sequence's cache to that turn
   (kvmix_policy_retier_turn, whose jobs run with the step's). */
llama_result tag_step(gpu_llama *g, const int32_t *seqs, const int32_t *tokens, int32_t n,
                      const kvmix_cache_precision **out, char *err, size_t err_bytes) {
    *out = NULL;
    if (!g->tagged) return LLAMA_OK;
    for (int32_t i = 0; i < n; i++) {
        int32_t s = seqs[i];
        kvmix_tag tag;
        kvmix_cache_precision *p = &g->by_tag[i];
        p->key_format = (uint8_t)g->tag_policy.key_format;
        p->value_format = (uint8_t)g->tag_policy.value_format;
        memset(&tag, 0, sizeof tag); /* a token the tagger refuses: turn 0, the policy's formats */
        g->runs[i] = 0;
        if (kvmix_tagger_feed(&g->taggers[s], &tokens[i], 1, &tag) == KVMIX_SUCCESS) {
            kvmix_policy_token_precision(&g->tag_policy, tag, tag.turn, p);
            kvmix_policy_token_run(&g->tag_policy, tag, &g->runs[i]);
        }
        g->tags[(size_t)s * (size_t)g->max_tokens + (size_t)g->next_pos[s]] = tag;
        if (tag.turn <= g->turns[s]) continue;
        g->turns[s] = tag.turn;
        llama_result r = call_with_room(g, g->k16, g->v16, "aging a sequence", err, err_bytes, [&] {
            return kvmix_policy_retier_turn(&g->tag_policy, &g->cache, g->kv_seq[s],
                                            &g->tags[(size_t)s * (size_t)g->max_tokens],
                                            g->next_pos[s], tag.turn, NULL);
        });
        if (r != LLAMA_OK) return r;
    }
    *out = g->by_tag;
    return LLAMA_OK;
}

llama_result reserve_positions(gpu_llama *g, const int32_t *seqs, int32_t n,
                               const kvmix_cache_precision *precisions, char *err,
                               size_t err_bytes) {
    double host_start = now_seconds();
    for (int32_t i = 0; i < n; i++) {
        int32_t kv = g->kv_seq[seqs[i]];
        const kvmix_cache_precision *p = precisions ? &precisions[i] : NULL;
        if (p) TRY_KVMIX(kvmix_cache_seq_set_run(&g->cache, kv, g->runs[i]), "setting a run");
        llama_result r =
            call_with_room(g, g->k16, g->v16, "reserving a position", err, err_bytes,
                           [&] { return kvmix_cache_reserve(&g->cache, kv, 1, p, NULL); });
        if (r != LLAMA_OK) return r;
    }
    g->prof.host_seconds += now_seconds() - host_start;
    return LLAMA_OK;
}

llama_result check_step(const gpu_llama *g, const int32_t *seqs, const int32_t *tokens, int32_t n,
                        char *err, size_t err_bytes) {
    if (n < 1 || n > g->max_seqs)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "step of %d sequences", n);
    for (int32_t i = 0; i < n; i++) {
        if (seqs[i] < 0 || seqs[i] >= g->max_seqs || !g->in_use[seqs[i]])
            return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "sequence %d is not started",
                              seqs[i]);
        if (tokens[i] < 0 || tokens[i] >= g->c.vocab)
            return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "token %d is outside the vocab",
                              tokens[i]);
        if (g->next_pos[seqs[i]] >= g->max_tokens)
            return llama_fail(err, err_bytes, LLAMA_ERR_CAPACITY, "sequence %d is full", seqs[i]);
        for (int32_t j = 0; j < i; j++)
            if (seqs[j] == seqs[i])
                return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "sequence %d twice in a step",
                                  seqs[i]);
    }
    return LLAMA_OK;
}

/* ---- recording for eviction ---------------------------------------------------------------- */

/* observation_create's buffers; a failure leaves some allocated, which the caller frees. */
static llama_result observation_alloc(gpu_llama *g, char *err, size_t err_bytes) {
    observation *o = &g->obs;
    const llama_config *c = &g->c;
    size_t seqs = (size_t)g->max_seqs, q_floats = (size_t)c->n_layers * c->n_heads * c->head_dim;
    o->view_capacity = g->max_tokens + g->cache.desc.page_tokens;
    size_t cap = (size_t)o->view_capacity;
    o->flags = (int32_t *)calloc(seqs, sizeof(int32_t));
    o->n_queries = (int32_t *)calloc(seqs, sizeof(int32_t));
    o->pending = (uint8_t *)calloc(seqs, 1);
    o->h_mass = (float *)calloc(seqs * (size_t)g->max_tokens, sizeof(float));
    o->positions = (int32_t *)malloc(cap * sizeof(int32_t));
    if (!o->flags || !o->n_queries || !o->pending || !o->h_mass || !o->positions)
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    TRY_CUDA(device_alloc(&o->d_qsum, seqs * q_floats), "recorded queries");
    TRY_CUDA(device_alloc(&o->d_mass, seqs * cap), "recorded attention");
    size_t score_rows = seqs > (size_t)c->n_layers ? seqs : (size_t)c->n_layers;
    TRY_CUDA(device_alloc(&o->d_scores, score_rows * cap), "scores");
    TRY_CUDA(cudaMallocHost(&o->h_into, seqs * sizeof(int32_t)), "recorders");
    TRY_CUDA(cudaMalloc(&o->d_into, seqs * sizeof(int32_t)), "recorders");
    TRY_CUDA(pinned_alloc(&o->h_scores, (size_t)c->n_layers * cap), "scores");
    TRY_CUDA(device_alloc(&o->d_memory, q_floats), "query memory");
    TRY_CUDA(device_alloc(&o->d_readout, (size_t)c->n_layers * cap), "readouts");
    TRY_CUDA(cudaMemsetAsync(o->d_qsum, 0, seqs * q_floats * sizeof(float), g->stream), "zeroing");
    TRY_CUDA(cudaMemsetAsync(o->d_mass, 0, seqs * cap * sizeof(float), g->stream), "zeroing");
    TRY_KVMIX(kvmix_cuda_view_intent_workspace_bytes(c->n_heads, o->view_capacity, &o->work_bytes),
              "intent workspace");
    o->work_bytes *= seqs;
    TRY_CUDA(cudaMalloc(&o->work, o->work_bytes), "intent workspace");
    return LLAMA_OK;
}

void observation_free(observation *o) {
    free(o->flags), free(o->n_queries), free(o->pending), free(o->h_mass), free(o->positions);
    cudaFree(o->d_qsum), cudaFree(o->d_mass), cudaFree(o->d_scores), cudaFree(o->d_memory);
    cudaFree(o->d_readout);
    cudaFree(o->work), cudaFreeHost(o->h_scores), cudaFreeHost(o->h_into), cudaFree(o->d_into);
}

/* The recording buffers, on first use; after a failure none is kept, so the next call tries
   again rather than taking a partial set as ready. */
llama_result observation_create(gpu_llama *g, char *err, size_t err_bytes) {
    observation *o = &g->obs;
    if (o->flags) return LLAMA_OK;
    llama_result r = observation_alloc(g, err, err_bytes);
    if (r != LLAMA_OK) {
        observation_free(o);
        memset(o, 0, sizeof *o);
    }
    return r;
}

/* A new sequence records nothing and has nothing recorded. */
llama_result observation_reset(gpu_llama *g, int32_t seq, char *err, size_t err_bytes) {
    observation *o = &g->obs;
    const llama_config *c = &g->c;
    size_t q_floats = (size_t)c->n_layers * c->n_heads * c->head_dim, cap = o->view_capacity;
    if (!o->flags) return LLAMA_OK;
    o->flags[seq] = o->n_queries[seq] = 0;
    o->pending[seq] = 0;
    memset(o->h_mass + (size_t)seq * g->max_tokens, 0, (size_t)g->max_tokens * sizeof(float));
    TRY_CUDA(cudaMemsetAsync(o->d_qsum + seq * q_floats, 0, q_floats * sizeof(float), g->stream),
             "zeroing");
    TRY_CUDA(cudaMemsetAsync(o->d_mass + seq * cap, 0, cap * sizeof(float), g->stream), "zeroing");
    return LLAMA_OK;
}

/* Per-token values of a sequence's layer-0 view, downloaded from `device`, to positions:
   out[pos] += value (or = when assign), positions the view does not list untouched. */
llama_result view_to_positions(gpu_llama *g, int32_t seq, const float *device, float *out,
                               bool assign, char *err, size_t err_bytes) {
    observation *o = &g->obs;
    int32_t n = 0;
    TRY_KVMIX(kvmix_cache_view_positions(&g->cache, g->kv_seq[seq], 0, o->positions,
                                         o->view_capacity, &n),
              "view positions");
    TRY_CUDA(cudaMemcpyAsync(o->h_scores, device, (size_t)n * sizeof(float), cudaMemcpyDeviceToHost,
                             g->stream),
             "downloading scores");
    TRY_CUDA(cudaStreamSynchronize(g->stream), "downloading scores");
    for (int32_t k = 0; k < n; k++) {
        int32_t pos = o->positions[k];
        if (pos < 0) continue;
        out[pos] = assign ? o->h_scores[k] : out[pos] + o->h_scores[k];
    }
    return LLAMA_OK;
}

/* Recorded attention, still by view token on the device, added to the host's by position. */
llama_result fold_attention(gpu_llama *g, int32_t seq, char *err, size_t err_bytes) {
    observation *o = &g->obs;
    size_t cap = (size_t)o->view_capacity;
    if (!o->flags || !o->pending[seq]) return LLAMA_OK;
    llama_result r =
        view_to_positions(g, seq, o->d_mass + seq * cap, o->h_mass + (size_t)seq * g->max_tokens,
                          false, err, err_bytes);
    if (r != LLAMA_OK) return r;
    TRY_CUDA(cudaMemsetAsync(o->d_mass + seq * cap, 0, cap * sizeof(float), g->stream), "zeroing");
    o->pending[seq] = 0;
    return LLAMA_OK;
}

llama_result running_kvmix(const gpu_llama *g, int32_t seq, const char *who, char *err,
                           size_t err_bytes) {
    if (!g || seq < 0 || seq >= g->max_seqs || !g->in_use[seq])
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "%s: sequence %d is not running", who,
                          seq);
    if (g->fp32)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "%s: the fp32 cache keeps every token", who);
    return LLAMA_OK;
}

} // namespace

static llama_result create_runner(gpu_llama *g, const llama_model *model,
                                  const kvmix_policy *policy, int32_t max_seqs, int32_t max_tokens,
                                  size_t arena_bytes, char *err, size_t err_bytes);

extern "C" llama_result gpu_llama_create(const llama_model *model, const kvmix_policy *policy,
                                         int32_t max_seqs, int32_t max_tokens, size_t arena_bytes,
                                         gpu_llama **out, char *err, size_t err_bytes) {
    if (!model || !policy || !out)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_create: NULL argument");
    *out = NULL;
    if (max_seqs < 1 || max_seqs > (1 << 20) || max_tokens < 1 || max_tokens > (1 << 26))
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "gpu_llama_create: %d sequences of %d tokens", max_seqs, max_tokens);
    const llama_config *mc = &model->config;
    if ((mc->head_dim != 64 && mc->head_dim != 128 && mc->head_dim != 256) || mc->n_kv_heads < 1 ||
        mc->n_heads % mc->n_kv_heads != 0)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED,
                          "a model of head_dim %d, %d query and %d kv heads: the decode kernel "
                          "runs head_dim 64, 128 and 256 with whole query groups",
                          mc->head_dim, mc->n_heads, mc->n_kv_heads);
    gpu_llama *g = (gpu_llama *)calloc(1, sizeof *g);
    if (!g) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    llama_result r =
        create_runner(g, model, policy, max_seqs, max_tokens, arena_bytes, err, err_bytes);
    if (r != LLAMA_OK)
        gpu_llama_free(g); /* what was made before the failure */
    else
        *out = g;
    return r;
}

/* gpu_llama_create's work on a zeroed g, which gpu_llama_free releases whatever the outcome. */
static llama_result create_runner(gpu_llama *g, const llama_model *model,
                                  const kvmix_policy *policy, int32_t max_seqs, int32_t max_tokens,
                                  size_t arena_bytes, char *err, size_t err_bytes) {
    int device = 0;
    cudaDeviceProp prop;
    TRY_CUDA(cudaGetDevice(&device), "no CUDA device");
    TRY_CUDA(cudaGetDeviceProperties(&prop, device), "no CUDA device");
    g->c = model->config;
    snprintf(g->device_name, sizeof g->device_name, "%s", prop.name);
    g->n_sms = prop.multiProcessorCount;
    g->max_seqs = max_seqs;
    g->max_rows = max_seqs > PREFILL_CHUNK ? max_seqs : PREFILL_CHUNK;
    g->max_rows = (g->max_rows + PRODUCT_ROWS - 1) / PRODUCT_ROWS * PRODUCT_ROWS;
    g->max_tokens = max_tokens;
    g->fp32 = policy->key_format == KVMIX_KV_FORMAT_FP32;
    char why[256];
    if (!g->fp32 &&
        kvmix_kv_policy_resolve(policy, g->c.head_dim, &g->policy, why, sizeof why) != LLAMA_OK)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED, "%s", why);
    if (g->fp32 && attend_scores_bytes(max_tokens) > (size_t)prop.sharedMemPerBlockOptin)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED,
                          "fp32 attention holds %d scores in shared memory", max_tokens);
    g->next_pos = (int32_t *)calloc((size_t)max_seqs, sizeof(int32_t));
    g->in_use = (uint8_t *)calloc((size_t)max_seqs, 1);
    if (!g->next_pos || !g->in_use)
        return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    TRY_CUDA(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking), "stream");
    if (cublasCreate(&g->blas) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(g->blas, g->stream) != CUBLAS_STATUS_SUCCESS ||
        cublasSetMathMode(g->blas, CUBLAS_PEDANTIC_MATH) != CUBLAS_STATUS_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED, "cuBLAS could not start");
    llama_result r = upload_model(g, model, err, err_bytes);
    if (r == LLAMA_OK) r = create_buffers(g, err, err_bytes);
    if (r == LLAMA_OK && !g->fp32) r = create_cache(g, arena_bytes, err, err_bytes);
    cudaFuncAttributes fa;
    if (r == LLAMA_OK && !g->fp32) { /* the scores take what the block's own arrays leave */
        TRY_CUDA(cudaFuncGetAttributes(&fa, prefill_attend_kernel), "prefill attention");
        g->max_smem = (int32_t)(prop.sharedMemPerBlockOptin - fa.sharedSizeBytes);
        TRY_CUDA(cudaFuncSetAttribute(prefill_attend_kernel,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, g->max_smem),
                 "prefill attention");
    }
    return r;
}

extern "C" llama_result gpu_llama_batch_invariant(gpu_llama *g, bool on, char *err,
                                                  size_t err_bytes) {
    if (!g)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_batch_invariant: NULL");
    g->fixed_splits = 0;
    if (!on) return LLAMA_OK;
    /* the count a lone sequence of the longest length would get: every sequence's spans are cut
       the same way whatever steps beside it */
    int32_t splits = 1;
    TRY_KVMIX(kvmix_cuda_decode_choose_splits(1, g->c.n_kv_heads, g->c.n_heads, g->c.head_dim,
                                              g->max_tokens, g->n_sms, &splits),
              "split count");
    g->fixed_splits = splits < 1 ? 1 : splits > MAX_SPLITS ? MAX_SPLITS : splits;
    return LLAMA_OK;
}

extern "C" void gpu_llama_free(gpu_llama *g) {
    if (!g) return;
    if (g->stream) cudaStreamSynchronize(g->stream);
    for (int32_t l = 0; g->layers && l < g->c.n_layers; l++) {
        layer_weights *w = &g->layers[l];
        cudaFree(w->attn_norm), cudaFree(w->ffn_norm), cudaFree(w->qkv);
        cudaFree(w->out), cudaFree(w->gate_up), cudaFree(w->down);
    }
    free(g->layers);
    for (int32_t l = 0; g->stages && l <= g->c.n_layers; l++) free_stage(&g->stages[l]);
    free(g->stages);
    free_view_staging(&g->view);
    free_kept_view(&g->kept);
    free(g->prefill.kpos);
    cudaFree(g->prefill.k), cudaFree(g->prefill.v), cudaFree(g->prefill.d_kpos);
    observation_free(&g->obs);
    for (int32_t i = 0; g->events && i < 2 * g->c.n_layers; i++)
        if (g->events[i]) cudaEventDestroy(g->events[i]);
    free(g->events);
    cudaFree(g->fill_k), cudaFree(g->fill_v);
    cudaFree(g->embed), cudaFree(g->final_norm), cudaFree(g->head), cudaFree(g->inv_freq);
    cudaFree(g->ref_k), cudaFree(g->ref_v), cudaFree(g->ref_part), cudaFree(g->arena),
        cudaFree(g->d_flags);
    cudaFree(g->k16), cudaFree(g->v16), cudaFree(g->q16), cudaFree(g->o16), cudaFree(g->work);
    cudaFree(g->x), cudaFree(g->xn), cudaFree(g->qkv), cudaFree(g->att), cudaFree(g->ffn);
    cudaFree(g->logits), cudaFree(g->d_step);
    cudaFreeHost(g->h_logits), cudaFreeHost(g->h_step);
    if (g->blas) cublasDestroy(g->blas);
    if (g->stream) cudaStreamDestroy(g->stream);
    free(g->cache_memory), free(g->kv_seq), free(g->step_kv_seqs), free(g->batches);
    free(g->next_pos), free(g->in_use), free(g->taggers), free(g->by_tag), free(g->tags);
    free(g->turns), free(g->runs);
    free(g->captures), cudaFreeHost(g->h_capture_rows);
    free(g);
}

extern "C" llama_result gpu_llama_seq_start(gpu_llama *g, int32_t *out_seq, char *err,
                                            size_t err_bytes) {
    if (!g || !out_seq)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_seq_start: NULL argument");
    int32_t s = 0;
    while (s < g->max_seqs && g->in_use[s]) s++;
    if (s == g->max_seqs)
        return llama_fail(err, err_bytes, LLAMA_ERR_CAPACITY, "all %d sequences in use",
                          g->max_seqs);
    if (!g->fp32) TRY_KVMIX(kvmix_cache_seq_create(&g->cache, &g->kv_seq[s]), "new sequence");
    if (g->tagged) { /* a new stream */
        kvmix_tagger_init(&g->taggers[s], &g->tag_spec, NULL);
        g->turns[s] = 0;
    }
    if (!g->fp32) {
        llama_result r = observation_reset(g, s, err, err_bytes);
        if (r != LLAMA_OK) return r;
    }
    g->in_use[s] = 1;
    g->next_pos[s] = 0;
    if (g->captures) g->captures[s] = NULL;
    *out_seq = s;
    return LLAMA_OK;
}

extern "C" void gpu_llama_seq_end(gpu_llama *g, int32_t seq) {
    if (!g || seq < 0 || seq >= g->max_seqs || !g->in_use[seq]) return;
    if (!g->fp32) kvmix_cache_seq_free(&g->cache, g->kv_seq[seq]);
    if (g->captures && g->captures[seq]) g->captures[seq] = NULL, g->n_capturing--;
    g->in_use[seq] = 0;
}

extern "C" llama_result gpu_llama_capture(gpu_llama *g, int32_t seq, llama_capture *cap, char *err,
                                          size_t err_bytes) {
    if (!g || seq < 0 || seq >= g->max_seqs || !g->in_use[seq])
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_capture: bad sequence");
    const llama_config *c = &g->c;
    if (cap && (cap->n_layers != c->n_layers || cap->n_heads != c->n_heads ||
                cap->n_kv_heads != c->n_kv_heads || cap->head_dim != c->head_dim ||
                cap->n_tokens < 1 || !cap->token_ids || !cap->q || !cap->k || !cap->v))
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "gpu_llama_capture: not a capture of the model's shape");
    if (cap && !g->captures) { /* the staging first: captures set means it is there */
        const size_t row_floats = (size_t)(c->n_heads + 2 * c->n_kv_heads) * c->head_dim;
        if (!g->h_capture_rows)
            TRY_CUDA(pinned_alloc(&g->h_capture_rows,
                                  (size_t)c->n_layers * (size_t)g->max_rows * row_floats),
                     "capture staging");
        g->captures = (llama_capture **)calloc((size_t)g->max_seqs, sizeof *g->captures);
        if (!g->captures) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of memory");
    }
    if (!g->captures) return LLAMA_OK; /* nothing recorded, nothing to stop */
    g->n_capturing += (cap != NULL) - (g->captures[seq] != NULL);
    g->captures[seq] = cap;
    return LLAMA_OK;
}

extern "C" llama_result gpu_llama_begin_request(gpu_llama *g, int32_t seq, char *err,
                                                size_t err_bytes) {
    if (seq < 0 || seq >= g->max_seqs || !g->in_use[seq])
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "sequence %d is not started", seq);
    if (g->fp32 || g->policy.request_boundary != KVMIX_POLICY_BOUNDARY_FINISH) return LLAMA_OK;
    return call_with_room(g, g->k16, g->v16, "finishing a request", err, err_bytes,
                          [&] { return kvmix_cache_seq_finish(&g->cache, g->kv_seq[seq]); });
}

/* A view of kvmix sequence kv alone, uploaded (upload_view), and the position of each of its
   tokens: positions [capacity], *out_n of them, -1 for a row the sequence does not use or a dead
   one (evicted, or a compacted page's padding row that repeats a live position). */
static llama_result upload_seq_view(gpu_llama *g, int32_t kv, int32_t *positions, int32_t capacity,
                                    int32_t *out_n, char *err, size_t err_bytes) {
    const view_staging *v = &g->view;
    g->step_kv_seqs[0] = kv;
    llama_result r = upload_view(g, 1, err, err_bytes);
    if (r != LLAMA_OK) return r;
    TRY_KVMIX(kvmix_cache_view_positions(&g->cache, kv, 0, positions, capacity, out_n),
              "view positions");
    for (int32_t i = 0, t = 0; i < v->view.n_spans; t += v->spans[i++].n_tokens)
        for (int32_t j = 0; v->spans[i].dead_index >= 0 && j < v->spans[i].n_tokens; j++)
            if (t + j < *out_n && v->dead[v->spans[i].dead_index + j]) positions[t + j] = -1;
    return LLAMA_OK;
}

/* The model over n rows whose tokens, positions, sequences and recording flags are in h_step
   ([4][n]): attend(l) runs layer l's attention (the rows' keys and values in qkv, its output into
   att). Leaves the rows' logits in h_logits. */
/* The rows of the pass that forward just ran (h_step: tokens, positions, sequences) into the
   captures of their sequences, at their positions (those past a capture's n_tokens are left out). */
void record_captures(gpu_llama *g, int32_t n) {
    const llama_config *c = &g->c;
    const size_t q_floats = (size_t)c->n_heads * c->head_dim;
    const size_t kv_floats = (size_t)c->n_kv_heads * c->head_dim;
    const size_t row_floats = q_floats + 2 * kv_floats;
    for (int32_t i = 0; i < n; i++) {
        llama_capture *cap = g->captures[g->h_step[2 * n + i]];
        const int32_t pos = g->h_step[n + i];
        if (!cap || pos >= cap->n_tokens) continue;
        cap->token_ids[pos] = g->h_step[i];
        for (int32_t l = 0; l < c->n_layers; l++) {
            const float *row = g->h_capture_rows + ((size_t)l * g->max_rows + i) * row_floats;
            const size_t at = (size_t)l * cap->n_tokens + pos;
            memcpy(cap->q + at * q_floats, row, q_floats * sizeof(float));
            memcpy(cap->k + at * kv_floats, row + q_floats, kv_floats * sizeof(float));
            memcpy(cap->v + at * kv_floats, row + q_floats + kv_floats, kv_floats * sizeof(float));
        }
    }
}

template <typename Attend>
llama_result forward(gpu_llama *g, int32_t n, char *err, size_t err_bytes, Attend attend) {
    const llama_config *c = &g->c;
    llama_result r = LLAMA_OK;
    TRY_CUDA(cudaMemcpyAsync(g->d_step, g->h_step, 4 * (size_t)n * sizeof(int32_t),
                             cudaMemcpyHostToDevice, g->stream),
             "uploading tokens");
    const int32_t *d_pos = g->d_step + n;
    int32_t qkv_rows = (c->n_heads + 2 * c->n_kv_heads) * c->head_dim;
    embed_kernel<<<n, THREADS, 0, g->stream>>>(g->embed, g->d_step, c->hidden, g->x);
    for (int32_t l = 0; l < c->n_layers && r == LLAMA_OK; l++) {
        const layer_weights *w = &g->layers[l];
        rms_norm_kernel<<<n, THREADS, 0, g->stream>>>(g->x, w->attn_norm, c->hidden, c->norm_eps,
                                                      g->xn);
        r = matmul(g, w->qkv, qkv_rows, c->hidden, g->xn, c->hidden, n, g->qkv, false, err,
                   err_bytes);
        if (r != LLAMA_OK) break;
        rope_kernel<<<dim3(n, c->n_heads + c->n_kv_heads), c->head_dim / 2, 0, g->stream>>>(
            g->qkv, d_pos, g->inv_freq, qkv_rows, c->head_dim);
        if (g->n_capturing > 0)
            TRY_CUDA(cudaMemcpyAsync(g->h_capture_rows + (size_t)l * g->max_rows * qkv_rows, g->qkv,
                                     (size_t)n * qkv_rows * sizeof(float), cudaMemcpyDeviceToHost,
                                     g->stream),
                     "capturing rows");
        if ((r = attend(l)) != LLAMA_OK) break;
        r = matmul(g, w->out, c->hidden, c->n_heads * c->head_dim, g->att, c->n_heads * c->head_dim,
                   n, g->x, true, err, err_bytes);
        if (r != LLAMA_OK) break;
        rms_norm_kernel<<<n, THREADS, 0, g->stream>>>(g->x, w->ffn_norm, c->hidden, c->norm_eps,
                                                      g->xn);
        r = matmul(g, w->gate_up, 2 * c->ffn, c->hidden, g->xn, c->hidden, n, g->ffn, false, err,
                   err_bytes);
        if (r != LLAMA_OK) break;
        swiglu_kernel<<<n, THREADS, 0, g->stream>>>(g->ffn, c->ffn);
        r = matmul(g, w->down, c->hidden, c->ffn, g->ffn, 2 * c->ffn, n, g->x, true, err,
                   err_bytes);
    }
    if (r != LLAMA_OK) return r;
    rms_norm_kernel<<<n, THREADS, 0, g->stream>>>(g->x, g->final_norm, c->hidden, c->norm_eps,
                                                  g->xn);
    r = matmul(g, g->head, c->vocab, c->hidden, g->xn, c->hidden, n, g->logits, false, err,
               err_bytes);
    if (r != LLAMA_OK) return r;
    TRY_CUDA(cudaMemcpyAsync(g->h_logits, g->logits, (size_t)n * c->vocab * sizeof(float),
                             cudaMemcpyDeviceToHost, g->stream),
             "downloading logits");
    TRY_CUDA(cudaStreamSynchronize(g->stream), "the step");
    if (g->n_capturing > 0) record_captures(g, n);
    int32_t flags = 0;
    if (!g->fp32) {
        TRY_CUDA(cudaMemcpy(&flags, g->d_flags, sizeof flags, cudaMemcpyDeviceToHost), "flags");
        if (flags != 0) { /* reported once: the flags start clean for the next step */
            cudaMemset(g->d_flags, 0, sizeof(int32_t));
            return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                              "a key or value row was not finite (error flags %d)", flags);
        }
    }
    return LLAMA_OK;
}

extern "C" llama_result gpu_llama_step(gpu_llama *g, const int32_t *seqs, const int32_t *tokens,
                                       int32_t n, float *logits, char *err, size_t err_bytes) {
    if (!g || !seqs || !tokens || !logits)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_step: NULL argument");
    llama_result r = check_step(g, seqs, tokens, n, err, err_bytes);
    if (r != LLAMA_OK) return r;
    const llama_config *c = &g->c;
    double step_start = now_seconds();
    const kvmix_cache_precision *by_tag = NULL;
    if (!g->fp32 && ((r = tag_step(g, seqs, tokens, n, &by_tag, err, err_bytes)) != LLAMA_OK ||
                     (r = reserve_positions(g, seqs, n, by_tag, err, err_bytes)) != LLAMA_OK))
        return r;
    for (int32_t i = 0; i < n; i++) {
        g->h_step[i] = tokens[i];
        g->h_step[n + i] = g->next_pos[seqs[i]];
        g->h_step[2 * n + i] = seqs[i];
        g->h_step[3 * n + i] = g->obs.flags ? g->obs.flags[seqs[i]] : 0;
    }
    r = forward(g, n, err, err_bytes, [&](int32_t l) {
        if (!g->fp32) return attend_kvmix(g, l, seqs, n, err, err_bytes);
        attend_fp32(g, l, n);
        return LLAMA_OK;
    });
    if (r != LLAMA_OK) return r;
    memcpy(logits, g->h_logits, (size_t)n * c->vocab * sizeof(float));
    for (int32_t i = 0; i < n; i++) g->next_pos[seqs[i]]++;
    if (g->profiling && !g->fp32) {
        for (int32_t l = 0; l < c->n_layers; l++) {
            float ms = 0.0f;
            if (cudaEventElapsedTime(&ms, g->events[2 * l], g->events[2 * l + 1]) == cudaSuccess)
                g->prof.attention_seconds += 1e-3 * ms;
        }
    }
    g->prof.step_seconds += now_seconds() - step_start;
    g->prof.steps++;
    g->prof.tokens += n;
    return LLAMA_OK;
}

/* Reserves the chunk's positions one by one, each with the formats its tag asks for (the
   tagger sees the tokens in order, as steps would show them). */
llama_result reserve_chunk(gpu_llama *g, int32_t seq, const int32_t *tokens, int32_t pos0,
                           int32_t n, char *err, size_t err_bytes) {
    llama_result r = LLAMA_OK;
    for (int32_t j = 0; j < n && r == LLAMA_OK; j++) {
        const kvmix_cache_precision *by_tag = NULL;
        g->next_pos[seq] = pos0 + j; /* the position tag_step and its tags table see */
        r = tag_step(g, &seq, &tokens[j], 1, &by_tag, err, err_bytes);
        if (r == LLAMA_OK) r = reserve_positions(g, &seq, 1, by_tag, err, err_bytes);
    }
    g->next_pos[seq] = pos0;
    return r;
}

/* Room for a sequence's view rows read back: the dequantized keys and values, and each view
   token's position. */
llama_result create_prefill(gpu_llama *g, char *err, size_t err_bytes) {
    prefill_rows *p = &g->prefill;
    if (p->kpos) return LLAMA_OK;
    p->capacity = g->cache.desc.max_pages_per_seq * g->cache.desc.page_tokens;
    size_t halves = (size_t)p->capacity * g->c.n_kv_heads * g->c.head_dim;
    p->kpos = (int32_t *)malloc((size_t)p->capacity * sizeof(int32_t));
    if (!p->kpos) return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    TRY_CUDA(device_alloc(&p->k, halves), "prefill rows");
    TRY_CUDA(device_alloc(&p->v, halves), "prefill rows");
    TRY_CUDA(device_alloc(&p->d_kpos, (size_t)p->capacity), "prefill rows");
    return LLAMA_OK;
}

/* The chunk's view (built once, after layer 0's rows are written: every layer has the same
   positions when it attends) and each view token's position, -1 for a dead row. */
llama_result upload_chunk_view(gpu_llama *g, int32_t kv, char *err, size_t err_bytes) {
    prefill_rows *p = &g->prefill;
    llama_result r = upload_seq_view(g, kv, p->kpos, p->capacity, &p->n_view, err, err_bytes);
    if (r != LLAMA_OK) return r;
    if (attend_scores_bytes(p->n_view) > (size_t)g->max_smem)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED,
                          "prefill attends at most %d cached tokens (%d here)",
                          g->max_smem / (int)sizeof(float), p->n_view);
    TRY_CUDA(cudaMemcpyAsync(p->d_kpos, p->kpos, (size_t)p->n_view * sizeof(int32_t),
                             cudaMemcpyHostToDevice, g->stream),
             "uploading positions");
    return LLAMA_OK;
}

/* Attention of layer l for a chunk of n positions from pos0 of one sequence: its rows written
   through the cache's jobs, then every cached row read back (kvmix_cuda_view_dequantize) and
   attended causally. */
llama_result attend_chunk(gpu_llama *g, int32_t l, int32_t seq, int32_t pos0, int32_t n, char *err,
                          size_t err_bytes) {
    const llama_config *c = &g->c;
    prefill_rows *p = &g->prefill;
    int32_t kv = g->kv_seq[seq];
    to_half_kernel<<<n, THREADS, 0, g->stream>>>(g->qkv, c->n_heads, c->n_kv_heads, c->head_dim,
                                                 (__half *)g->q16, (__half *)g->k16,
                                                 (__half *)g->v16);
    llama_result r = call_with_room(g, g->k16, g->v16, "writing rows", err, err_bytes, [&] {
        return kvmix_cache_write_rows(&g->cache, kv, l, pos0, n, 0);
    });
    if (r == LLAMA_OK) r = run_jobs(g, &g->stages[l], g->k16, g->v16, err, err_bytes);
    if (r == LLAMA_OK && l == 0) r = upload_chunk_view(g, kv, err, err_bytes);
    kvmix_view view;
    if (r == LLAMA_OK) r = layer_view(g, l, &view, err, err_bytes);
    if (r != LLAMA_OK) return r;
    TRY_KVMIX(
        kvmix_cuda_view_dequantize(&view, 0, KVMIX_CUDA_FP16, p->k, p->v, p->capacity, g->stream),
        "reading rows back");
    prefill_attend_kernel<<<dim3(n, c->n_heads), THREADS, attend_scores_bytes(p->n_view),
                            g->stream>>>(
        g->qkv, (const __half *)p->k, (const __half *)p->v, p->d_kpos, p->n_view, pos0, c->n_heads,
        c->n_kv_heads, c->head_dim, (float)(1.0 / sqrt((double)c->head_dim)), g->att);
    return LLAMA_OK;
}

extern "C" llama_result gpu_llama_prefill(gpu_llama *g, int32_t seq, const int32_t *tokens,
                                          int32_t n_tokens, float *logits, char *err,
                                          size_t err_bytes) {
    if (!g || !tokens || n_tokens < 0 || seq < 0 || seq >= g->max_seqs || !g->in_use[seq])
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_prefill: bad arguments");
    for (int32_t j = 0; j < n_tokens; j++)
        if (tokens[j] < 0 || tokens[j] >= g->c.vocab)
            return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "token %d is outside the vocab",
                              tokens[j]);
    if (n_tokens > g->max_tokens - g->next_pos[seq])
        return llama_fail(err, err_bytes, LLAMA_ERR_CAPACITY, "sequence %d is full", seq);
    llama_result r = g->fp32 ? LLAMA_OK : create_prefill(g, err, err_bytes);
    for (int32_t done = 0; r == LLAMA_OK && done < n_tokens;) {
        int32_t n = n_tokens - done < PREFILL_CHUNK ? n_tokens - done : PREFILL_CHUNK;
        int32_t pos0 = g->next_pos[seq];
        if (!g->fp32 &&
            (r = reserve_chunk(g, seq, tokens + done, pos0, n, err, err_bytes)) != LLAMA_OK)
            break;
        for (int32_t j = 0; j < n; j++) {
            g->h_step[j] = tokens[done + j];
            g->h_step[n + j] = pos0 + j;
            g->h_step[2 * n + j] = seq;
            g->h_step[3 * n + j] = 0; /* a chunk records nothing */
        }
        r = forward(g, n, err, err_bytes, [&](int32_t l) {
            if (!g->fp32) return attend_chunk(g, l, seq, pos0, n, err, err_bytes);
            attend_fp32(g, l, n);
            return LLAMA_OK;
        });
        if (r != LLAMA_OK) break;
        if (logits)
            memcpy(logits + (size_t)done * g->c.vocab, g->h_logits,
                   (size_t)n * g->c.vocab * sizeof(float));
        g->next_pos[seq] = pos0 + n;
        done += n;
    }
    return r;
}

/* Appends n_tokens positions to a sequence through the cache's write path, in chunks of FILL_ROWS
   (reserve, the rows' copy jobs of every layer, the jobs run), then packs its full pages as a
   decode step would. Layer l's rows of the chunk at `done` are source rows
   l * layer_rows + (advance ? done : 0) of keys and values (device FP16). precisions: [n_tokens]
   or NULL (the policy's). */
static llama_result append_rows(gpu_llama *g, int32_t seq, int32_t n_tokens,
                                const kvmix_cache_precision *precisions, const void *keys,
                                const void *values, int64_t layer_rows, bool advance,
                                const char *what, char *err, size_t err_bytes) {
    int32_t kv = g->kv_seq[seq];
    llama_result r = LLAMA_OK;
    for (int32_t done = 0; r == LLAMA_OK && done < n_tokens;) {
        int32_t n = n_tokens - done < FILL_ROWS ? n_tokens - done : FILL_ROWS;
        int32_t pos = g->next_pos[seq];
        const kvmix_cache_precision *p = precisions ? precisions + done : NULL;
        r = call_with_room(g, keys, values, what, err, err_bytes,
                           [&] { return kvmix_cache_reserve(&g->cache, kv, n, p, NULL); });
        for (int32_t l = 0; r == LLAMA_OK && l < g->c.n_layers; l++)
            r = call_with_room(g, keys, values, what, err, err_bytes, [&] {
                return kvmix_cache_write_rows(&g->cache, kv, l, pos, n,
                                              l * layer_rows + (advance ? done : 0));
            });
        if (r == LLAMA_OK) r = flush_jobs(g, keys, values, err, err_bytes);
        if (r == LLAMA_OK) g->next_pos[seq] += n, done += n;
    }
    if (r == LLAMA_OK)
        r = call_with_room(g, keys, values, what, err, err_bytes,
                           [&] { return kvmix_cache_seal_ready(&g->cache, kv); });
    return r == LLAMA_OK ? flush_jobs(g, keys, values, err, err_bytes) : r;
}

extern "C" llama_result gpu_llama_fill(gpu_llama *g, int32_t seq, int32_t n_tokens,
                                       const kvmix_cache_precision *precisions, char *err,
                                       size_t err_bytes) {
    if (!g || seq < 0 || seq >= g->max_seqs || !g->in_use[seq] || n_tokens < 0)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_fill: bad arguments");
    if (g->fp32)
        return llama_fail(err, err_bytes, LLAMA_ERR_UNSUPPORTED, "gpu_llama_fill: fp32 cache");
    if (n_tokens > g->max_tokens - g->next_pos[seq])
        return llama_fail(err, err_bytes, LLAMA_ERR_CAPACITY, "sequence %d is full", seq);
    size_t halves = (size_t)FILL_ROWS * g->c.n_kv_heads * g->c.head_dim;
    if (!g->fill_k) {
        TRY_CUDA(device_alloc(&g->fill_k, halves), "fill rows");
        TRY_CUDA(device_alloc(&g->fill_v, halves), "fill rows");
        fill_rows_kernel<<<64, THREADS, 0, g->stream>>>((__half *)g->fill_k, halves, 1u);
        fill_rows_kernel<<<64, THREADS, 0, g->stream>>>((__half *)g->fill_v, halves, 2u);
    }
    /* every chunk reads the same synthetic rows */
    return append_rows(g, seq, n_tokens, precisions, g->fill_k, g->fill_v, 0, false,
                       "filling a sequence", err, err_bytes);
}

/* Positions of a sequence's view tokens on the device (-1 dead), *out_n of them, into a buffer
   the caller frees. */
static llama_result upload_view_positions(gpu_llama *g, int32_t seq, int32_t **out, int32_t *out_n,
                                          char *err, size_t err_bytes) {
    llama_result r = observation_create(g, err, err_bytes); /* the positions buffer */
    if (r == LLAMA_OK && g->cache.n_jobs > 0) r = flush_jobs(g, g->k16, g->v16, err, err_bytes);
    if (r == LLAMA_OK)
        r = upload_seq_view(g, g->kv_seq[seq], g->obs.positions, g->obs.view_capacity, out_n, err,
                            err_bytes);
    if (r != LLAMA_OK) return r;
    TRY_CUDA(device_alloc(out, (size_t)*out_n), "view positions");
    TRY_CUDA(cudaMemcpyAsync(*out, g->obs.positions, (size_t)*out_n * sizeof(int32_t),
                             cudaMemcpyHostToDevice, g->stream),
             "view positions");
    return LLAMA_OK;
}

extern "C" llama_result gpu_llama_rows_read_device(gpu_llama *g, int32_t seq, void *keys,
                                                   void *values, char *err, size_t err_bytes) {
    llama_result r = running_kvmix(g, seq, "gpu_llama_rows_read_device", err, err_bytes);
    if (r == LLAMA_OK && (!keys || !values))
        r = llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_rows_read_device: NULL rows");
    int32_t *d_positions = NULL, n = 0;
    if (r == LLAMA_OK) r = upload_view_positions(g, seq, &d_positions, &n, err, err_bytes);
    const llama_config *c = &g->c;
    size_t row = (size_t)c->n_kv_heads * c->head_dim, layer = (size_t)g->next_pos[seq] * row;
    uint16_t *dk = NULL, *dv = NULL;
    cudaError_t ce = r == LLAMA_OK ? device_alloc(&dk, (size_t)n * row) : cudaSuccess;
    if (r == LLAMA_OK && ce == cudaSuccess) ce = device_alloc(&dv, (size_t)n * row);
    for (int32_t l = 0; r == LLAMA_OK && ce == cudaSuccess && l < c->n_layers; l++) {
        __half *k = (__half *)keys + l * layer, *v = (__half *)values + l * layer;
        kvmix_view view;
        kvmix_result kr = KVMIX_SUCCESS;
        ce = cudaMemsetAsync(k, 0, layer * sizeof(__half), g->stream);
        if (ce == cudaSuccess) ce = cudaMemsetAsync(v, 0, layer * sizeof(__half), g->stream);
        if (ce == cudaSuccess && (r = layer_view(g, l, &view, err, err_bytes)) == LLAMA_OK)
            kr = kvmix_cuda_view_dequantize(&view, 0, KVMIX_CUDA_FP16, dk, dv, n, g->stream);
        if (kr != KVMIX_SUCCESS)
            r = llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "reading rows: %s",
                           kvmix_result_string(kr));
        if (r != LLAMA_OK || ce != cudaSuccess || n == 0) continue;
        scatter_rows_kernel<<<64, THREADS, 0, g->stream>>>((const __half *)dk, d_positions, n, row,
                                                           k);
        scatter_rows_kernel<<<64, THREADS, 0, g->stream>>>((const __half *)dv, d_positions, n, row,
                                                           v);
        ce = cudaGetLastError();
    }
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(g->stream); /* the caller's streams read */
    cudaFree(dk), cudaFree(dv), cudaFree(d_positions);
    if (r == LLAMA_OK && ce != cudaSuccess) r = cuda_fail(err, err_bytes, ce, "reading rows");
    return r;
}

extern "C" llama_result gpu_llama_rows_read(gpu_llama *g, int32_t seq, float *keys, float *values,
                                            char *err, size_t err_bytes) {
    llama_result r = running_kvmix(g, seq, "gpu_llama_rows_read", err, err_bytes);
    if (r == LLAMA_OK && (!keys || !values))
        r = llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_rows_read: NULL rows");
    if (r != LLAMA_OK) return r;
    const llama_config *c = &g->c;
    size_t halves = (size_t)c->n_layers * g->next_pos[seq] * c->n_kv_heads * c->head_dim;
    std::vector<uint16_t> hk(halves), hv(halves);
    uint16_t *dk = NULL, *dv = NULL;
    cudaError_t ce = device_alloc(&dk, halves);
    if (ce == cudaSuccess) ce = device_alloc(&dv, halves);
    if (ce == cudaSuccess) r = gpu_llama_rows_read_device(g, seq, dk, dv, err, err_bytes);
    if (ce == cudaSuccess && r == LLAMA_OK)
        ce = cudaMemcpy(hk.data(), dk, halves * 2, cudaMemcpyDeviceToHost);
    if (ce == cudaSuccess && r == LLAMA_OK)
        ce = cudaMemcpy(hv.data(), dv, halves * 2, cudaMemcpyDeviceToHost);
    cudaFree(dk), cudaFree(dv);
    if (r == LLAMA_OK && ce != cudaSuccess) r = cuda_fail(err, err_bytes, ce, "reading rows");
    for (size_t i = 0; r == LLAMA_OK && i < halves; i++)
        keys[i] = kvmix_fp16_to_fp32(hk[i]), values[i] = kvmix_fp16_to_fp32(hv[i]);
    return r;
}

/* Rows as FP16 for the cache's copy jobs; false when one is not a finite FP16. */
static bool rows_to_fp16(const float *rows, size_t n, uint16_t *out) {
    for (size_t i = 0; i < n; i++) {
        if (!(fabsf(rows[i]) <= 65504.0f)) return false;
        out[i] = kvmix_fp32_to_fp16(rows[i]);
    }
    return true;
}

extern "C" llama_result gpu_llama_rows_ingest_device(gpu_llama *g, int32_t seq, int32_t n_tokens,
                                                     const void *keys, const void *values,
                                                     char *err, size_t err_bytes) {
    llama_result r = running_kvmix(g, seq, "gpu_llama_rows_ingest", err, err_bytes);
    if (r == LLAMA_OK && (!keys || !values || n_tokens < 0 || g->next_pos[seq] != 0))
        r = llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                       "gpu_llama_rows_ingest: NULL rows, a negative count or a sequence with "
                       "positions");
    if (r == LLAMA_OK && n_tokens > g->max_tokens)
        r = llama_fail(err, err_bytes, LLAMA_ERR_CAPACITY, "sequence %d is full", seq);
    if (r != LLAMA_OK) return r;
    /* the caller's rows are ready on any of its streams; the jobs run on this one */
    TRY_CUDA(cudaDeviceSynchronize(), "ingesting rows");
    /* layer l's rows are source rows l * n_tokens .. */
    return append_rows(g, seq, n_tokens, NULL, keys, values, n_tokens, true, "ingesting rows", err,
                       err_bytes);
}

extern "C" llama_result gpu_llama_rows_ingest(gpu_llama *g, int32_t seq, int32_t n_tokens,
                                              const float *keys, const float *values, char *err,
                                              size_t err_bytes) {
    llama_result r = running_kvmix(g, seq, "gpu_llama_rows_ingest", err, err_bytes);
    if (r == LLAMA_OK && (!keys || !values || n_tokens < 0))
        r = llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                       "gpu_llama_rows_ingest: NULL rows or a negative count");
    if (r != LLAMA_OK) return r;
    const llama_config *c = &g->c;
    size_t halves = (size_t)c->n_layers * n_tokens * c->n_kv_heads * c->head_dim;
    std::vector<uint16_t> hk(halves), hv(halves);
    if (!rows_to_fp16(keys, halves, hk.data()) || !rows_to_fp16(values, halves, hv.data()))
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "gpu_llama_rows_ingest: a row is not a finite FP16");
    uint16_t *dk = NULL, *dv = NULL;
    cudaError_t ce = device_alloc(&dk, halves);
    if (ce == cudaSuccess) ce = device_alloc(&dv, halves);
    if (ce == cudaSuccess) ce = cudaMemcpy(dk, hk.data(), halves * 2, cudaMemcpyHostToDevice);
    if (ce == cudaSuccess) ce = cudaMemcpy(dv, hv.data(), halves * 2, cudaMemcpyHostToDevice);
    if (ce == cudaSuccess)
        r = gpu_llama_rows_ingest_device(g, seq, n_tokens, dk, dv, err, err_bytes);
    cudaFree(dk), cudaFree(dv); /* after the jobs that read them: flush_jobs synchronized */
    if (ce != cudaSuccess) r = cuda_fail(err, err_bytes, ce, "ingesting rows");
    return r;
}

extern "C" llama_result gpu_llama_tag(gpu_llama *g, const kvmix_tag_spec *spec,
                                      const kvmix_tag_precision *table, char *err,
                                      size_t err_bytes) {
    if (!g || !spec || !table)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_tag: NULL argument");
    if (g->fp32)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                          "gpu_llama_tag: the fp32 cache keeps every token in fp32");
    for (int32_t s = 0; s < g->max_seqs; s++)
        if (g->in_use[s])
            return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT,
                              "gpu_llama_tag: sequences are running");
    kvmix_error why;
    if (kvmix_tag_spec_check(spec, &why) != KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_tag: bad spec: %s %s",
                          why.field, why.reason);
    if (!g->taggers) {
        g->taggers = (kvmix_tagger *)calloc((size_t)g->max_seqs, sizeof *g->taggers);
        g->by_tag = (kvmix_cache_precision *)calloc((size_t)g->max_seqs, sizeof *g->by_tag);
        g->tags = (kvmix_tag *)calloc((size_t)g->max_seqs * (size_t)g->max_tokens, sizeof *g->tags);
        g->turns = (int32_t *)calloc((size_t)g->max_seqs, sizeof *g->turns);
        g->runs = (uint32_t *)calloc((size_t)g->max_seqs, sizeof *g->runs);
        if (!g->taggers || !g->by_tag || !g->tags || !g->turns || !g->runs)
            return llama_fail(err, err_bytes, LLAMA_ERR_MEMORY, "out of host memory");
    }
    llama_result r = kvmix_kv_policy_tagged(&g->policy, table, &g->tag_table, &g->tag_policy,
                                            "gpu_llama_tag", err, err_bytes);
    if (r != LLAMA_OK) return r;
    g->tag_spec = *spec;
    g->tagged = true;
    return LLAMA_OK;
}

extern "C" void gpu_llama_profile_start(gpu_llama *g) {
    memset(&g->prof, 0, sizeof g->prof);
    g->profiling = true;
}

extern "C" void gpu_llama_profile_get(const gpu_llama *g, gpu_llama_profile *out) {
    *out = g->prof;
}

extern "C" const kvmix_cache *gpu_llama_inner(const gpu_llama *g, int32_t seq,
                                              int32_t *out_kv_seq) {
    bool running = g && !g->fp32 && seq >= 0 && seq < g->max_seqs && g->in_use[seq];
    if (out_kv_seq) *out_kv_seq = running ? g->kv_seq[seq] : -1;
    return running ? &g->cache : NULL;
}

extern "C" void gpu_llama_seq_stats(const gpu_llama *g, int32_t seq, llama_kv_stats *out) {
    memset(out, 0, sizeof *out);
    if (seq < 0 || seq >= g->max_seqs || !g->in_use[seq]) return;
    if (g->fp32) {
        out->n_tokens = g->next_pos[seq];
        out->bytes = 2 * (size_t)out->n_tokens * g->c.n_layers * g->c.n_kv_heads * g->c.head_dim *
                     sizeof(float);
        out->avg_bits = out->n_tokens > 0 ? 32.0 : 0.0;
        return;
    }
    kvmix_cache_seq_stats st;
    if (kvmix_cache_seq_stats_get(&g->cache, g->kv_seq[seq], &st) != KVMIX_SUCCESS) return;
    out->n_tokens = st.n_live_tokens;
    out->bytes = (size_t)ceil(st.attributed_bytes);
    out->avg_bits = st.n_live_tokens > 0 ? st.bits_per_element : 0.0;
    out->packed_bits = st.packed_bits_per_element;
    out->n_packed_tokens = st.n_packed_rows;
}

extern "C" double gpu_llama_seq_assigned_bits(const gpu_llama *g, int32_t seq,
                                              const tag_prices *prices) {
    if (seq < 0 || seq >= g->max_seqs || !g->in_use[seq] || !g->tagged) return 0.0;
    return kvmix_kv_assigned_bits(&g->cache, g->kv_seq[seq], &g->tag_policy,
                                  &g->tags[(size_t)seq * (size_t)g->max_tokens], g->turns[seq],
                                  prices);
}

extern "C" const char *gpu_llama_device_name(const gpu_llama *g) { return g->device_name; }

extern "C" llama_result gpu_llama_observe(gpu_llama *g, int32_t seq, int32_t flags, char *err,
                                          size_t err_bytes) {
    llama_result r = running_kvmix(g, seq, "gpu_llama_observe", err, err_bytes);
    if (r != LLAMA_OK) return r;
    if (flags & ~(GPU_LLAMA_OBSERVE_QUERIES | GPU_LLAMA_OBSERVE_ATTENTION))
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_observe: flags %d", flags);
    if ((r = observation_create(g, err, err_bytes)) != LLAMA_OK) return r;
    g->obs.flags[seq] = flags;
    return LLAMA_OK;
}

extern "C" llama_result gpu_llama_observed_take(gpu_llama *g, int32_t seq, float *query_sum,
                                                int32_t *out_n_queries, float *attention, char *err,
                                                size_t err_bytes) {
    llama_result r = running_kvmix(g, seq, "gpu_llama_observed_take", err, err_bytes);
    if (r == LLAMA_OK) r = observation_create(g, err, err_bytes);
    if (r != LLAMA_OK) return r;
    observation *o = &g->obs;
    const llama_config *c = &g->c;
    size_t q_floats = (size_t)c->n_layers * c->n_heads * c->head_dim;
    if (query_sum) {
        TRY_CUDA(cudaMemcpyAsync(query_sum, o->d_qsum + seq * q_floats, q_floats * sizeof(float),
                                 cudaMemcpyDeviceToHost, g->stream),
                 "downloading queries");
        TRY_CUDA(
            cudaMemsetAsync(o->d_qsum + seq * q_floats, 0, q_floats * sizeof(float), g->stream),
            "zeroing");
        TRY_CUDA(cudaStreamSynchronize(g->stream), "downloading queries");
        if (out_n_queries) *out_n_queries = o->n_queries[seq];
        o->n_queries[seq] = 0;
    }
    if (attention) {
        if ((r = fold_attention(g, seq, err, err_bytes)) != LLAMA_OK) return r;
        float *mass = o->h_mass + (size_t)seq * g->max_tokens;
        memcpy(attention, mass, (size_t)g->next_pos[seq] * sizeof(float));
        memset(mass, 0, (size_t)g->max_tokens * sizeof(float));
    }
    return LLAMA_OK;
}

/* A caller's query memory ([n_layers][n_heads][head_dim]) to the device and the view of sequence
   seq alone (steps build their own): what scoring one sequence's positions reads. */
static llama_result upload_memory_and_view(gpu_llama *g, int32_t seq, const float *memory,
                                           char *err, size_t err_bytes) {
    const llama_config *c = &g->c;
    TRY_CUDA(cudaMemcpyAsync(g->obs.d_memory, memory,
                             (size_t)c->n_layers * c->n_heads * c->head_dim * sizeof(float),
                             cudaMemcpyHostToDevice, g->stream),
             "uploading the memory");
    g->step_kv_seqs[0] = g->kv_seq[seq];
    return upload_view(g, 1, err, err_bytes);
}

extern "C" llama_result gpu_llama_intent_scores(gpu_llama *g, int32_t seq, const float *memory,
                                                float *scores, char *err, size_t err_bytes) {
    llama_result r = running_kvmix(g, seq, "gpu_llama_intent_scores", err, err_bytes);
    if (r == LLAMA_OK && (!memory || !scores))
        r = llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_intent_scores: NULL");
    if (r == LLAMA_OK) r = observation_create(g, err, err_bytes);
    if (r != LLAMA_OK) return r;
    observation *o = &g->obs;
    const llama_config *c = &g->c;
    size_t row = (size_t)c->n_heads * c->head_dim, cap = o->view_capacity;
    int32_t n_pos = g->next_pos[seq];
    if ((r = upload_memory_and_view(g, seq, memory, err, err_bytes)) != LLAMA_OK) return r;
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvmix_view view;
        if ((r = layer_view(g, l, &view, err, err_bytes)) != LLAMA_OK) return r;
        TRY_KVMIX(kvmix_cuda_view_intent_score(&view, 0, c->n_heads, 0.0f, o->d_memory + l * row,
                                               o->d_scores + l * cap, (int32_t)cap, o->work,
                                               o->work_bytes, g->stream),
                  "intent scores");
    }
    for (int32_t t = 0; t < n_pos; t++) scores[t] = -INFINITY; /* released pages list nothing */
    for (int32_t l = 0; l < c->n_layers && r == LLAMA_OK; l++)
        r = view_to_positions(g, seq, o->d_scores + l * cap, scores, l == 0, err, err_bytes);
    return r;
}

extern "C" llama_result gpu_llama_key_features(gpu_llama *g, int32_t seq, const float *memory,
                                               float *key_norm, float *readout, char *err,
                                               size_t err_bytes) {
    llama_result r = running_kvmix(g, seq, "gpu_llama_key_features", err, err_bytes);
    if (r == LLAMA_OK && (!memory || !key_norm || !readout))
        r = llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_key_features: NULL");
    if (r == LLAMA_OK) r = observation_create(g, err, err_bytes);
    if (r != LLAMA_OK) return r;
    observation *o = &g->obs;
    const llama_config *c = &g->c;
    size_t row = (size_t)c->n_heads * c->head_dim, cap = o->view_capacity;
    int32_t n_pos = g->next_pos[seq];
    if ((r = upload_memory_and_view(g, seq, memory, err, err_bytes)) != LLAMA_OK) return r;
    for (int32_t l = 0; l < c->n_layers; l++) {
        kvmix_view view;
        if ((r = layer_view(g, l, &view, err, err_bytes)) != LLAMA_OK) return r;
        TRY_KVMIX(kvmix_cuda_view_key_features(&view, 0, c->n_heads, 0.0f, o->d_memory + l * row,
                                               o->d_scores + l * cap, o->d_readout + l * cap,
                                               (int32_t)cap, g->stream),
                  "key features");
    }
    for (int32_t t = 0; t < n_pos; t++) key_norm[t] = readout[t] = 0.0f; /* evicted: 0 */
    for (int32_t l = 0; l < c->n_layers && r == LLAMA_OK; l++) {
        r = view_to_positions(g, seq, o->d_scores + l * cap, key_norm, false, err, err_bytes);
        if (r == LLAMA_OK)
            r = view_to_positions(g, seq, o->d_readout + l * cap, readout, false, err, err_bytes);
    }
    for (int32_t t = 0; t < n_pos; t++) key_norm[t] /= c->n_layers, readout[t] /= c->n_layers;
    return r;
}

extern "C" llama_result gpu_llama_evict(gpu_llama *g, int32_t seq, const int32_t *positions,
                                        int32_t n_positions, char *err, size_t err_bytes) {
    llama_result r = running_kvmix(g, seq, "gpu_llama_evict", err, err_bytes);
    if (r == LLAMA_OK) r = fold_attention(g, seq, err, err_bytes);
    if (r != LLAMA_OK) return r;
    kvmix_result k = kvmix_cache_evict(&g->cache, g->kv_seq[seq], positions, n_positions);
    if (k != KVMIX_SUCCESS)
        return llama_fail(err, err_bytes, LLAMA_ERR_ARGUMENT, "gpu_llama_evict: %s",
                          kvmix_cache_last_error(&g->cache));
    /* the pages left mostly dead give their memory back; a full job queue runs and the
       compaction goes on */
    for (size_t freed = 1; freed > 0;) {
        if (g->cache.n_jobs > 0 && (r = flush_jobs(g, g->k16, g->v16, err, err_bytes)) != LLAMA_OK)
            return r;
        TRY_KVMIX(
            kvmix_cache_compact(&g->cache, g->kv_seq[seq], KVMIX_KV_COMPACT_LIVE_FRACTION, &freed),
            "compacting");
        if (g->cache.n_jobs == 0) break;
    }
    return LLAMA_OK;
}
