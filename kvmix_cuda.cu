/* kvmix_cuda.cu - CUDA kernel pack for kvmix (see kvmix_cuda.h). MIT licensed (see LICENSE).

   Rooms:
     // >>helpers   fp16/bf16, block sections, exact quantize arithmetic, warp/block scans,
                    the span walker every view kernel uses
     // >>kernels   quantize, view dequantize, QueryMemory scoring, decode attention + merge
     // >>launch    argument checks, grid choice, dispatch

   The byte formats and the float arithmetic of quantize/dequantize are the ones documented in
   kvmix.h's >>formats room; kernels here use __fsub_rn/__fdiv_rn/__fmul_rn/__fadd_rn (never a
   fused multiply-add) wherever bytes or dequantized values must equal the CPU reference.
   Decode attention reassociates its sums (scales folded into the query, codes converted with
   exponent tricks), so it matches kvmix_ref_view_decode to float rounding, not bit for bit. */
#include "kvmix_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

// >>helpers

namespace {

#ifndef KVMIX__DECODE_U
#define KVMIX__DECODE_U 4
#endif
constexpr int kvmix__decode_warps = 4;
constexpr int kvmix__decode_threads = kvmix__decode_warps * 32;
constexpr int kvmix__view_tile_tokens = 32; /* tokens per block of dequantize and score */

__device__ __forceinline__ float kvmix__h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ uint16_t kvmix__f2h(float x) { return __half_as_ushort(__float2half_rn(x)); }
__device__ __forceinline__ float kvmix__bf2f(uint16_t b) { return __uint_as_float((uint32_t)b << 16); }
__device__ __forceinline__ uint16_t kvmix__f2bf(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

__device__ __forceinline__ float kvmix__load_elem(const uint16_t *p, int dtype) {
    return dtype == KVMIX_CUDA_BF16 ? kvmix__bf2f(*p) : kvmix__h2f(*p);
}
__device__ __forceinline__ void kvmix__store_elem(uint16_t *p, float x, int dtype) {
    *p = dtype == KVMIX_CUDA_BF16 ? kvmix__f2bf(x) : kvmix__f2h(x);
}

__host__ __device__ constexpr int kvmix__bits_of(int format) {
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

__host__ __device__ constexpr bool kvmix__per_token(int format) {
    return format == KVMIX_FORMAT_INT8 || format == KVMIX_FORMAT_INT4 || format == KVMIX_FORMAT_INT2;
}

/* Section offsets of one block (the same arithmetic as kvmix.h's kvmix__layout_sections). */
struct kvmix__sec {
    uint64_t row_bytes, high_row_bytes, high_offset, meta_offset, index_offset, total_bytes;
};

__host__ __device__ inline kvmix__sec kvmix__sections(int format, int64_t n, int d, int group,
                                                      int n_boost) {
    kvmix__sec s;
    bool boosted = format == KVMIX_FORMAT_BOOSTED;
    s.row_bytes = (uint64_t)d * (uint64_t)kvmix__bits_of(format) / 8;
    s.high_row_bytes = boosted ? (uint64_t)n_boost / 4 : 0;
    s.high_offset = (uint64_t)n * s.row_bytes;
    s.meta_offset = s.high_offset + (uint64_t)n * s.high_row_bytes;
    if (format == KVMIX_FORMAT_FP16)
        s.index_offset = s.meta_offset;
    else if (kvmix__per_token(format))
        s.index_offset = s.meta_offset + (uint64_t)n * (uint64_t)(d / group) * 4;
    else
        s.index_offset = s.meta_offset + (uint64_t)d * 4;
    s.total_bytes = s.index_offset + (boosted ? (uint64_t)d : 0);
    if (n == 0) s.total_bytes = 0;
    return s;
}

/* (scale, min) of a group with `levels` steps over [lo, hi]: kvmix.h's kvmix__choose_qparams. */
struct kvmix__qp {
    uint16_t scale_h, min_h;
    float scale, min;
};

__device__ inline kvmix__qp kvmix__choose_qparams(float lo, float hi, int levels) {
    kvmix__qp p;
    p.min_h = kvmix__f2h(lo);
    if (kvmix__h2f(p.min_h) > lo) {
        uint16_t h = p.min_h;
        p.min_h = (h == 0x0000u || h == 0x8000u) ? (uint16_t)0x8001u
                  : (h & 0x8000u)                ? (uint16_t)(h + 1u)
                                                 : (uint16_t)(h - 1u);
    }
    p.min = kvmix__h2f(p.min_h);
    float step = __fdiv_rn(__fsub_rn(hi, p.min), (float)levels);
    p.scale_h = kvmix__f2h(step);
    while (__dadd_rn(__dmul_rn((double)kvmix__h2f(p.scale_h), (double)levels), (double)p.min) <
           (double)hi)
        p.scale_h = (uint16_t)(p.scale_h + 1u);
    p.scale = kvmix__h2f(p.scale_h);
    return p;
}

__device__ __forceinline__ uint32_t kvmix__quantize_value(float x, const kvmix__qp &p,
                                                          int levels) {
    if (p.scale_h == 0) return 0;
    float q = rintf(__fdiv_rn(__fsub_rn(x, p.min), p.scale));
    q = fminf(fmaxf(q, 0.0f), (float)levels);
    return (uint32_t)q;
}

__device__ __forceinline__ float kvmix__dequantize_value(uint32_t q, float scale, float min) {
    return __fadd_rn(__fmul_rn((float)q, scale), min);
}

__device__ __forceinline__ uint32_t kvmix__ld_u16(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8);
}

/* Element (t, c) of a block, exactly as kvmix.h's kvmix__decode_row (byte loads, any alignment). */
__device__ inline float kvmix__decode_value(int format, const uint8_t *blk, const kvmix__sec &s,
                                            int64_t t, int c, int group) {
    const uint8_t *row = blk + (uint64_t)t * s.row_bytes;
    if (format == KVMIX_FORMAT_FP16) return kvmix__h2f((uint16_t)kvmix__ld_u16(row + 2 * c));
    int bits = kvmix__bits_of(format), per_byte = 8 / bits;
    uint32_t q = (row[c / per_byte] >> ((c % per_byte) * bits)) & ((1u << bits) - 1u);
    const uint8_t *meta;
    if (kvmix__per_token(format)) {
        int groups = (int)(s.row_bytes * 8 / (uint64_t)bits) / group;
        meta = blk + s.meta_offset + ((uint64_t)t * (uint64_t)groups + (uint64_t)(c / group)) * 4;
    } else {
        if (format == KVMIX_FORMAT_BOOSTED) {
            uint8_t slot = blk[s.index_offset + c];
            if (slot != KVMIX_BOOST_NONE) {
                const uint8_t *high = blk + s.high_offset + (uint64_t)t * s.high_row_bytes;
                q |= ((high[slot / 4] >> ((slot % 4) * 2)) & 3u) << 2;
            }
        }
        meta = blk + s.meta_offset + (uint64_t)c * 4;
    }
    return kvmix__dequantize_value(q, kvmix__h2f((uint16_t)kvmix__ld_u16(meta)),
                                   kvmix__h2f((uint16_t)kvmix__ld_u16(meta + 2)));
}

/* Inclusive block-wide sum scan of one int64 per thread; scratch: 32 shared int64.
   Every thread of the block must call it. */
__device__ inline int64_t kvmix__block_scan(int64_t v, int64_t *scratch, int64_t *total) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    for (int off = 1; off < 32; off <<= 1) {
        int64_t o = __shfl_up_sync(0xffffffffu, v, off);
        if (lane >= off) v += o;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    int64_t before = 0, all = 0;
    for (int w = 0; w < n_warps; w++) {
        if (w < warp) before += scratch[w];
        all += scratch[w];
    }
    *total = all;
    return v + before;
}

struct kvmix__walk_smem {
    int64_t scratch[32];
    int64_t start[1024];
};

/* Calls fn(span_index, first_token_of_span) for every span of [first, last) that overlaps tokens
   [lo, hi) of the sequence, in order (spans of n_tokens < 1 count as empty and may be skipped). All threads of the block call this; fn is called by all of them, uniformly. */
template <class Fn>
__device__ void kvmix__for_spans(const kvmix_view_span *spans, int first, int last, int64_t lo,
                                 int64_t hi, kvmix__walk_smem &sm, Fn fn) {
    int64_t base = 0;
    for (int c0 = first; c0 < last && base < hi; c0 += blockDim.x) {
        int i = c0 + (int)threadIdx.x;
        int64_t n = i < last ? (int64_t)max(spans[i].n_tokens, 0) : 0, total;
        int64_t end = base + kvmix__block_scan(n, sm.scratch, &total);
        int64_t start = end - n;
        sm.start[threadIdx.x] = start;
        int j_begin = __syncthreads_count(i < last && end <= lo);
        int j_end = __syncthreads_count(i < last && start < hi);
        for (int j = j_begin; j < j_end; j++) {
            int64_t s = sm.start[j];
            fn(c0 + j, s);
        }
        base += total;
        __syncthreads();
    }
}

/* Whether a block of a view span is readable: known format, extent inside base, aligned. */
__device__ inline bool kvmix__block_ok(int format, int n, uint64_t offset, uint32_t head_bytes,
                                       int n_kv, int d, int group, int n_boost,
                                       uint64_t base_bytes, kvmix__sec *out) {
    if (kvmix__bits_of(format) == 0 || n < 1) return false;
    kvmix__sec s = kvmix__sections(format, n, d, group, n_boost);
    if (head_bytes < s.total_bytes || ((offset | head_bytes) & 15u) != 0) return false;
    uint64_t extent = (uint64_t)head_bytes * (uint64_t)(n_kv - 1) + s.total_bytes;
    if (offset > base_bytes || extent > base_bytes - offset) return false;
    *out = s;
    return true;
}

/* 1 + code * 2^-B as a float, for the B-bit code at bit `pos` of w (pos a compile-time value
   in unrolled loops): the code is moved under the exponent of 1.0f. */
template <int B>
__device__ __forceinline__ float kvmix__code1(uint32_t w, int pos) {
    constexpr int target = 23 - B;
    uint32_t moved = pos <= target ? (w << (target - pos)) : (w >> (pos - target));
    return __uint_as_float((moved & (((1u << B) - 1u) << target)) | 0x3f800000u);
}

template <int N>
__device__ __forceinline__ void kvmix__load_words(const uint8_t *p, uint32_t *w) {
    if constexpr (N == 1) {
        w[0] = *(const uint32_t *)p;
    } else if constexpr (N == 2) {
        uint2 v = *(const uint2 *)p;
        w[0] = v.x, w[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < N / 4; i++) {
            uint4 v = ((const uint4 *)p)[i];
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    }
}

} // namespace

// >>kernels

namespace {

/* ---- quantize ---------------------------------------------------------------------------- */

struct kvmix__quantize_params {
    int format, n_tokens, head_dim, group_size, n_boost;
    kvmix__sec sec;
    const uint16_t *src;
    int64_t src_row_stride;
    uint8_t *dst;
    const kvmix_cuda_quantize_job *jobs;
    int32_t *error_flags;
};

struct kvmix__quantize_smem {
    float lo[KVMIX_MAX_HEAD_DIM], hi[KVMIX_MAX_HEAD_DIM], score[KVMIX_MAX_HEAD_DIM];
    float scale[KVMIX_MAX_HEAD_DIM], min[KVMIX_MAX_HEAD_DIM];
    uint16_t scale_h[KVMIX_MAX_HEAD_DIM];
    uint8_t boosted[KVMIX_MAX_HEAD_DIM];
    int16_t slot_channel[256];
};

/* One block per job. [n_rows][head_dim] fp16 in, one block's rows (or the whole block) out. */
static __global__ void __launch_bounds__(256) kvmix__quantize_kernel(kvmix__quantize_params p) {
    __shared__ kvmix__quantize_smem sm;
    const kvmix_cuda_quantize_job job = p.jobs[blockIdx.x];
    const int d = p.head_dim;
    const bool per_channel = !kvmix__per_token(p.format) && p.format != KVMIX_FORMAT_FP16;
    bool bad_job = job.n_rows < 1 || job.first_row < 0 || job.first_row > p.n_tokens - job.n_rows ||
                   (per_channel && (job.first_row != 0 || job.n_rows != p.n_tokens)) ||
                   (job.dst_offset & 15u) != 0;
    if (bad_job) {
        if (threadIdx.x == 0 && p.error_flags) atomicOr(p.error_flags, KVMIX_CUDA_QUANTIZE_BAD_JOB);
        return;
    }
    const uint16_t *src = p.src + job.src_offset;
    const int64_t n_elems = (int64_t)job.n_rows * d;
    int bad = 0;
    for (int64_t e = threadIdx.x; e < n_elems; e += blockDim.x) {
        uint16_t h = src[(e / d) * p.src_row_stride + e % d];
        bad |= (h & 0x7c00u) == 0x7c00u;
    }
    if (__syncthreads_or(bad)) {
        if (threadIdx.x == 0 && p.error_flags) atomicOr(p.error_flags, KVMIX_CUDA_QUANTIZE_BAD_VALUE);
        return;
    }
    uint8_t *blk = p.dst + job.dst_offset;
    const kvmix__sec &s = p.sec;
    if (p.format == KVMIX_FORMAT_FP16) {
        uint16_t *out = (uint16_t *)(blk + (uint64_t)job.first_row * s.row_bytes);
        for (int64_t e = threadIdx.x; e < n_elems; e += blockDim.x)
            out[e] = src[(e / d) * p.src_row_stride + e % d];
        return;
    }
    if (!per_channel) {
        const int bits = kvmix__bits_of(p.format), levels = (1 << bits) - 1;
        const int groups = d / p.group_size, per_byte = 8 / bits;
        const int64_t n_tasks = (int64_t)job.n_rows * groups;
        for (int64_t task = threadIdx.x; task < n_tasks; task += blockDim.x) {
            int r = (int)(task / groups), g = (int)(task % groups);
            const uint16_t *x = src + r * p.src_row_stride + g * p.group_size;
            float lo = kvmix__h2f(x[0]), hi = lo;
            for (int c = 1; c < p.group_size; c++) {
                float v = kvmix__h2f(x[c]);
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
            kvmix__qp qp = kvmix__choose_qparams(lo, hi, levels);
            int64_t t = job.first_row + r;
            uint8_t *row = blk + (uint64_t)t * s.row_bytes + (uint64_t)g * p.group_size / per_byte;
            for (int b = 0; b < p.group_size / per_byte; b++) {
                uint32_t byte = 0;
                for (int k = 0; k < per_byte; k++)
                    byte |= kvmix__quantize_value(kvmix__h2f(x[b * per_byte + k]), qp, levels)
                            << (k * bits);
                row[b] = (uint8_t)byte;
            }
            uint8_t *meta = blk + s.meta_offset + ((uint64_t)t * groups + g) * 4;
            meta[0] = (uint8_t)(qp.scale_h & 0xffu);
            meta[1] = (uint8_t)(qp.scale_h >> 8);
            meta[2] = (uint8_t)(qp.min_h & 0xffu);
            meta[3] = (uint8_t)(qp.min_h >> 8);
        }
        return;
    }
    /* per channel over the block's n tokens; BOOSTED ranks channels by sum |x| (token order) */
    const int n = p.n_tokens;
    const bool boosted = p.format == KVMIX_FORMAT_BOOSTED;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float v = kvmix__h2f(src[c]), lo = v, hi = v, score = 0.0f;
        for (int t = 0; t < n; t++) {
            v = kvmix__h2f(src[t * p.src_row_stride + c]);
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
            score = __fadd_rn(score, fabsf(v));
        }
        sm.lo[c] = lo, sm.hi[c] = hi, sm.score[c] = score;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        int rank = 0;
        if (boosted)
            for (int o = 0; o < d; o++)
                rank += sm.score[o] > sm.score[c] || (sm.score[o] == sm.score[c] && o < c);
        sm.boosted[c] = boosted && rank < p.n_boost;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        int levels = sm.boosted[c] ? 15 : 3;
        kvmix__qp qp = kvmix__choose_qparams(sm.lo[c], sm.hi[c], levels);
        sm.scale[c] = qp.scale, sm.min[c] = qp.min, sm.scale_h[c] = qp.scale_h;
        uint8_t *meta = blk + s.meta_offset + (uint64_t)c * 4;
        meta[0] = (uint8_t)(qp.scale_h & 0xffu);
        meta[1] = (uint8_t)(qp.scale_h >> 8);
        meta[2] = (uint8_t)(qp.min_h & 0xffu);
        meta[3] = (uint8_t)(qp.min_h >> 8);
        if (boosted) {
            int slot = 0;
            for (int o = 0; o < c; o++) slot += sm.boosted[o];
            blk[s.index_offset + c] = sm.boosted[c] ? (uint8_t)slot : (uint8_t)KVMIX_BOOST_NONE;
            if (sm.boosted[c]) sm.slot_channel[slot] = (int16_t)c;
        }
    }
    __syncthreads();
    const int row_bytes = d / 4;
    for (int64_t e = threadIdx.x; e < (int64_t)n * row_bytes; e += blockDim.x) {
        int t = (int)(e / row_bytes), b = (int)(e % row_bytes);
        uint32_t byte = 0;
        for (int k = 0; k < 4; k++) {
            int c = b * 4 + k;
            kvmix__qp qp;
            qp.scale_h = sm.scale_h[c], qp.scale = sm.scale[c], qp.min = sm.min[c];
            uint32_t q = kvmix__quantize_value(kvmix__h2f(src[t * p.src_row_stride + c]), qp,
                                               sm.boosted[c] ? 15 : 3);
            byte |= (q & 3u) << (2 * k);
        }
        blk[(uint64_t)t * row_bytes + b] = (uint8_t)byte;
    }
    if (boosted) {
        const int high_bytes = p.n_boost / 4;
        for (int64_t e = threadIdx.x; e < (int64_t)n * high_bytes; e += blockDim.x) {
            int t = (int)(e / high_bytes), b = (int)(e % high_bytes);
            uint32_t byte = 0;
            for (int k = 0; k < 4; k++) {
                int c = sm.slot_channel[b * 4 + k];
                kvmix__qp qp;
                qp.scale_h = sm.scale_h[c], qp.scale = sm.scale[c], qp.min = sm.min[c];
                uint32_t q = kvmix__quantize_value(kvmix__h2f(src[t * p.src_row_stride + c]), qp, 15);
                byte |= (q >> 2) << (2 * k);
            }
            blk[s.high_offset + (uint64_t)t * high_bytes + b] = (uint8_t)byte;
        }
    }
}

/* ---- view dequantize and QueryMemory scoring --------------------------------------------- */

struct kvmix__view_params {
    const uint8_t *base;
    uint64_t base_bytes;
    const kvmix_view_span *spans;
    const int32_t *seq_first_span;
    const uint8_t *dead;
    int n_dead_flags, n_kv_heads, head_dim, group_size, n_boost, seq, capacity, dtype, n_q_heads;
    uint16_t *keys_out, *values_out;
    const float *memory;
    float *scores;
};

/* Blocks of tokens [x * 32, x * 32 + 32): out [capacity][n_kv_heads][head_dim] of dtype. */
static __global__ void __launch_bounds__(256) kvmix__view_dequantize_kernel(kvmix__view_params p) {
    __shared__ kvmix__walk_smem sm;
    const int64_t lo = (int64_t)blockIdx.x * kvmix__view_tile_tokens;
    const int64_t hi = min(lo + kvmix__view_tile_tokens, (int64_t)p.capacity);
    const int d = p.head_dim, n_kv = p.n_kv_heads;
    kvmix__for_spans(p.spans, p.seq_first_span[p.seq], p.seq_first_span[p.seq + 1], lo, hi, sm,
                     [&](int si, int64_t start) {
        const kvmix_view_span sp = p.spans[si];
        int64_t t0 = max(lo, start), t1 = min(hi, start + (int64_t)sp.n_tokens);
        for (int which = 0; which < 2; which++) {
            uint16_t *out = which ? p.values_out : p.keys_out;
            if (!out) continue;
            int format = which ? sp.value_format : sp.key_format;
            uint64_t offset = which ? sp.value_offset : sp.key_offset;
            uint32_t head_bytes = which ? sp.value_head_bytes : sp.key_head_bytes;
            kvmix__sec s;
            bool ok = kvmix__block_ok(format, sp.n_tokens, offset, head_bytes, n_kv, d,
                                      p.group_size, p.n_boost, p.base_bytes, &s) &&
                      (sp.dead_index < 0 || sp.dead_index <= p.n_dead_flags - sp.n_tokens);
            int64_t n_elems = (t1 - t0) * n_kv * d;
            for (int64_t e = threadIdx.x; e < n_elems; e += blockDim.x) {
                int64_t pos = t0 + e / ((int64_t)n_kv * d);
                int h = (int)((e / d) % n_kv), c = (int)(e % d);
                int64_t t = pos - start;
                float v;
                if (!ok)
                    v = __int_as_float(0x7fffffff);
                else if (sp.dead_index >= 0 && p.dead[sp.dead_index + t])
                    v = 0.0f;
                else
                    v = kvmix__decode_value(format, p.base + offset + (uint64_t)h * head_bytes, s,
                                            t, c, p.group_size);
                kvmix__store_elem(out + (uint64_t)pos * n_kv * d + (uint64_t)h * d + c, v, p.dtype);
            }
        }
    });
}

/* Blocks of 32 tokens, one warp per token: scores[t] = sum_h dot(memory[h], key_t[h / g]). */
static __global__ void __launch_bounds__(256) kvmix__view_score_kernel(kvmix__view_params p) {
    __shared__ kvmix__walk_smem sm;
    const int64_t lo = (int64_t)blockIdx.x * kvmix__view_tile_tokens;
    const int64_t hi = min(lo + kvmix__view_tile_tokens, (int64_t)p.capacity);
    const int d = p.head_dim, n_kv = p.n_kv_heads, g = p.n_q_heads / p.n_kv_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    kvmix__for_spans(p.spans, p.seq_first_span[p.seq], p.seq_first_span[p.seq + 1], lo, hi, sm,
                     [&](int si, int64_t start) {
        const kvmix_view_span sp = p.spans[si];
        int64_t t0 = max(lo, start), t1 = min(hi, start + (int64_t)sp.n_tokens);
        kvmix__sec s;
        bool ok = kvmix__block_ok(sp.key_format, sp.n_tokens, sp.key_offset, sp.key_head_bytes,
                                  n_kv, d, p.group_size, p.n_boost, p.base_bytes, &s) &&
                  (sp.dead_index < 0 || sp.dead_index <= p.n_dead_flags - sp.n_tokens);
        for (int64_t pos = t0 + warp; pos < t1; pos += n_warps) {
            int64_t t = pos - start;
            float acc = 0.0f;
            if (ok)
                for (int e = lane; e < n_kv * d; e += 32) {
                    int h = e / d, c = e % d;
                    float k = kvmix__decode_value(sp.key_format,
                                                  p.base + sp.key_offset + (uint64_t)h * sp.key_head_bytes,
                                                  s, t, c, p.group_size);
                    for (int j = 0; j < g; j++) acc += p.memory[(size_t)(h * g + j) * d + c] * k;
                }
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
            if (lane == 0) {
                if (!ok) acc = __int_as_float(0x7fffffff);
                else if (sp.dead_index >= 0 && p.dead[sp.dead_index + t]) acc = -INFINITY;
                p.scores[pos] = acc;
            }
        }
    });
}

/* ---- decode attention -------------------------------------------------------------------- */

struct kvmix__decode_params {
    const uint8_t *base;
    uint64_t base_bytes;
    const kvmix_view_span *spans;
    const int32_t *seq_first_span;
    const uint8_t *dead;
    int n_dead_flags, n_seqs, n_kv_heads, n_q_heads, q_per_kv, q_chunks, group_size, n_boost;
    int n_splits, dtype;
    float scale_log2; /* softmax scale * log2(e) */
    const uint16_t *q;
    float *part_out;  /* [n_seqs][n_splits][n_q_heads][head_dim], normalized */
    float *part_lse;  /* [n_seqs][n_splits][n_q_heads], log2 domain */
};

/* Lane geometry: a lane owns CPL consecutive channels of one token; LPT lanes hold a token;
   a warp step covers TPW tokens; a chunk is U steps. */
template <int D, int NQ>
struct kvmix__geo {
    static constexpr int CPL = 16;
    static constexpr int LPT = D / CPL;
    static constexpr int TPW = 32 / LPT;
    static constexpr int U = KVMIX__DECODE_U;
    static constexpr int CHUNK = TPW * U;
};

template <int D, int NQ>
struct kvmix__decode_smem {
    float q[NQ][D];
    union {
        float qh[kvmix__decode_warps][D][NQ]; /* boosted keys: weight of a slot's high bits */
        struct {
            float acc[kvmix__decode_warps][NQ][D];
            float m[kvmix__decode_warps][NQ], l[kvmix__decode_warps][NQ];
        } merge;
    } u;
    float vmeta[kvmix__decode_warps][2][D]; /* per-channel values: 4 * scale, min - 4 * scale */
    uint8_t vslot[kvmix__decode_warps][D];  /* boosted values: channel slot */
    kvmix__walk_smem walk;
    int error;
};

/* Per-warp online-softmax state and the current span's key preparation. */
template <int D, int NQ>
struct kvmix__warp_state {
    using G = kvmix__geo<D, NQ>;
    float acc[NQ][G::CPL];
    float accmin[NQ];
    float m[NQ], l[NQ];
    float qk[NQ][G::CPL]; /* query prepared for the span's key format */
    float kaux[NQ];       /* per-token keys: sum of qk; per-channel keys: constant term */
};

/* Logits (log2 domain, partial over the lane's channels, then reduced over the token's lanes)
   of U steps of tokens. */
template <int D, int NQ, int KF>
__device__ __forceinline__ void kvmix__chunk_logits(const kvmix__warp_state<D, NQ> &st,
                                                    const uint8_t *kblk, const kvmix__sec &ks,
                                                    int group_size, int n_boost,
                                                    const float (*qh)[NQ], int tok0,
                                                    int tlast, int gi, int li,
                                                    float (&s)[kvmix__geo<D, NQ>::U][NQ]) {
    using G = kvmix__geo<D, NQ>;
    constexpr int B = KF == KVMIX_FORMAT_FP16 ? 16 : KF == KVMIX_FORMAT_INT8 ? 8 : KF == KVMIX_FORMAT_INT4 ? 4 : 2;
    constexpr int KW = G::CPL * B / 32;
    constexpr int SB = KW >= 8 ? 4 : G::U;
    const int c0 = li * G::CPL;
#pragma unroll
    for (int u0 = 0; u0 < G::U; u0 += SB) {
        uint32_t w[SB][KW];
        uint32_t meta[SB];
#pragma unroll
        for (int u = 0; u < SB; u++) {
            int t = min(tok0 + (u0 + u) * G::TPW + gi, tlast);
            kvmix__load_words<KW>(kblk + (uint32_t)t * (uint32_t)(D * B / 8) + c0 * B / 8, w[u]);
            if constexpr (kvmix__per_token(KF))
                meta[u] = *(const uint32_t *)(kblk + (uint32_t)ks.meta_offset +
                                              ((uint32_t)t * (uint32_t)(D / group_size) + c0 / group_size) * 4);
        }
#pragma unroll
        for (int u = 0; u < SB; u++) {
            float dot[NQ];
#pragma unroll
            for (int h = 0; h < NQ; h++) dot[h] = 0.0f;
            if constexpr (KF == KVMIX_FORMAT_FP16) {
#pragma unroll
                for (int i = 0; i < G::CPL / 2; i++) {
                    float2 x = __half22float2(*(const __half2 *)&w[u][i]);
#pragma unroll
                    for (int h = 0; h < NQ; h++)
                        dot[h] = fmaf(st.qk[h][2 * i + 1], x.y, fmaf(st.qk[h][2 * i], x.x, dot[h]));
                }
            } else {
#pragma unroll
                for (int i = 0; i < G::CPL; i++) {
                    float f = kvmix__code1<B>(w[u][(i * B) / 32], (i * B) % 32);
#pragma unroll
                    for (int h = 0; h < NQ; h++) dot[h] = fmaf(st.qk[h][i], f, dot[h]);
                }
                if constexpr (kvmix__per_token(KF)) {
                    float sc = kvmix__h2f((uint16_t)(meta[u] & 0xffffu)) * (float)(1 << B);
                    float mn = kvmix__h2f((uint16_t)(meta[u] >> 16));
#pragma unroll
                    for (int h = 0; h < NQ; h++) dot[h] = fmaf(dot[h] - st.kaux[h], sc, mn * st.kaux[h]);
                } else {
#pragma unroll
                    for (int h = 0; h < NQ; h++) dot[h] += st.kaux[h];
                    if constexpr (KF == KVMIX_FORMAT_BOOSTED) {
                        int t = min(tok0 + (u0 + u) * G::TPW + gi, tlast);
                        const uint8_t *high = kblk + (uint32_t)ks.high_offset + (uint32_t)t * (uint32_t)ks.high_row_bytes;
                        for (int slot = li; slot < n_boost; slot += G::LPT) {
                            float code = (float)((high[slot >> 2] >> ((slot & 3) * 2)) & 3u);
#pragma unroll
                            for (int h = 0; h < NQ; h++) dot[h] = fmaf(qh[slot][h], code, dot[h]);
                        }
                    }
                }
            }
#pragma unroll
            for (int off = 1; off < G::LPT; off <<= 1)
#pragma unroll
                for (int h = 0; h < NQ; h++) dot[h] += __shfl_xor_sync(0xffffffffu, dot[h], off);
#pragma unroll
            for (int h = 0; h < NQ; h++) s[u0 + u][h] = dot[h];
        }
    }
}

/* acc += p * v over U steps of tokens. */
template <int D, int NQ, int VF>
__device__ __forceinline__ void kvmix__chunk_values(kvmix__warp_state<D, NQ> &st,
                                                    const uint8_t *vblk, const kvmix__sec &vs,
                                                    int group_size, const float (*vmeta)[D],
                                                    const uint8_t *vslot, int tok0,
                                                    int tlast, int gi, int li,
                                                    const float (&pr)[kvmix__geo<D, NQ>::U][NQ]) {
    using G = kvmix__geo<D, NQ>;
    constexpr int B = VF == KVMIX_FORMAT_FP16 ? 16 : VF == KVMIX_FORMAT_INT8 ? 8 : VF == KVMIX_FORMAT_INT4 ? 4 : 2;
    constexpr int KW = G::CPL * B / 32;
    constexpr int SB = KW >= 8 ? 4 : G::U;
    const int c0 = li * G::CPL;
#pragma unroll
    for (int u0 = 0; u0 < G::U; u0 += SB) {
        uint32_t w[SB][KW];
        uint32_t meta[SB];
#pragma unroll
        for (int u = 0; u < SB; u++) {
            int t = min(tok0 + (u0 + u) * G::TPW + gi, tlast);
            kvmix__load_words<KW>(vblk + (uint32_t)t * (uint32_t)(D * B / 8) + c0 * B / 8, w[u]);
            if constexpr (kvmix__per_token(VF))
                meta[u] = *(const uint32_t *)(vblk + (uint32_t)vs.meta_offset +
                                              ((uint32_t)t * (uint32_t)(D / group_size) + c0 / group_size) * 4);
        }
#pragma unroll
        for (int u = 0; u < SB; u++) {
            if constexpr (VF == KVMIX_FORMAT_FP16) {
#pragma unroll
                for (int i = 0; i < G::CPL / 2; i++) {
                    float2 x = __half22float2(*(const __half2 *)&w[u][i]);
#pragma unroll
                    for (int h = 0; h < NQ; h++) {
                        st.acc[h][2 * i] = fmaf(pr[u0 + u][h], x.x, st.acc[h][2 * i]);
                        st.acc[h][2 * i + 1] = fmaf(pr[u0 + u][h], x.y, st.acc[h][2 * i + 1]);
                    }
                }
            } else if constexpr (kvmix__per_token(VF)) {
                float sc = kvmix__h2f((uint16_t)(meta[u] & 0xffffu)) * (float)(1 << B);
                float mn = kvmix__h2f((uint16_t)(meta[u] >> 16));
                float ps[NQ];
#pragma unroll
                for (int h = 0; h < NQ; h++) {
                    ps[h] = pr[u0 + u][h] * sc;
                    st.accmin[h] += fmaf(pr[u0 + u][h], mn, -ps[h]);
                }
#pragma unroll
                for (int i = 0; i < G::CPL; i++) {
                    float f = kvmix__code1<B>(w[u][(i * B) / 32], (i * B) % 32);
#pragma unroll
                    for (int h = 0; h < NQ; h++) st.acc[h][i] = fmaf(ps[h], f, st.acc[h][i]);
                }
            } else {
                int t = min(tok0 + (u0 + u) * G::TPW + gi, tlast);
                const uint8_t *high = vblk + (uint32_t)vs.high_offset + (uint32_t)t * (uint32_t)vs.high_row_bytes;
#pragma unroll
                for (int i = 0; i < G::CPL; i++) {
                    float f = kvmix__code1<2>(w[u][(i * 2) / 32], (i * 2) % 32);
                    float v = fmaf(f, vmeta[0][c0 + i], vmeta[1][c0 + i]);
                    if constexpr (VF == KVMIX_FORMAT_BOOSTED) {
                        int slot = vslot[c0 + i];
                        if (slot != KVMIX_BOOST_NONE)
                            v = fmaf((float)((high[slot >> 2] >> ((slot & 3) * 2)) & 3u),
                                     vmeta[0][c0 + i], v);
                    }
#pragma unroll
                    for (int h = 0; h < NQ; h++) st.acc[h][i] = fmaf(pr[u0 + u][h], v, st.acc[h][i]);
                }
            }
        }
    }
}

/* Grid (n_splits, n_kv_heads * q_chunks, n_seqs), 128 threads. Each block: query heads
   [kv * q_per_kv + chunk * NQ, + NQ) of one sequence over its split's token range. */
template <int D, int NQ>
static __global__ void __launch_bounds__(kvmix__decode_threads)
    kvmix__decode_kernel(kvmix__decode_params p) {
    using G = kvmix__geo<D, NQ>;
    __shared__ kvmix__decode_smem<D, NQ> sm;
    const int split = blockIdx.x, seq = blockIdx.z;
    const int kv = blockIdx.y / p.q_chunks, qh0 = kv * p.q_per_kv + (blockIdx.y % p.q_chunks) * NQ;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gi = lane / G::LPT, li = lane % G::LPT, c0 = li * G::CPL;

    for (int e = threadIdx.x; e < NQ * D; e += blockDim.x)
        sm.q[e / D][e % D] =
            kvmix__load_elem(p.q + ((size_t)seq * p.n_q_heads + qh0) * D + e, p.dtype) * p.scale_log2;
    if (threadIdx.x == 0) sm.error = 0;

    /* the sequence's token count, then this split's range */
    const int first = p.seq_first_span[seq], last = p.seq_first_span[seq + 1];
    int64_t total_tokens = 0;
    int bad_count = 0;
    for (int c = first; c < last; c += blockDim.x) {
        int i = c + threadIdx.x;
        int n = i < last ? p.spans[i].n_tokens : 1;
        int64_t part = i < last ? (int64_t)max(n, 0) : 0, sum;
        kvmix__block_scan(part, sm.walk.scratch, &sum);
        total_tokens += sum;
        bad_count += __syncthreads_count(n < 1);
    }
    const int64_t lo = total_tokens * split / p.n_splits;
    const int64_t hi = total_tokens * (split + 1) / p.n_splits;

    kvmix__warp_state<D, NQ> st;
#pragma unroll
    for (int h = 0; h < NQ; h++) {
        st.m[h] = -INFINITY, st.l[h] = 0.0f, st.accmin[h] = 0.0f, st.kaux[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < G::CPL; i++) st.acc[h][i] = 0.0f, st.qk[h][i] = 0.0f;
    }
    __syncthreads();
    int chunk_base = 0;
    if (bad_count == 0)
        kvmix__for_spans(p.spans, first, last, lo, hi, sm.walk, [&](int si, int64_t start) {
            const kvmix_view_span sp = p.spans[si];
            kvmix__sec ks, vs;
            bool ok = kvmix__block_ok(sp.key_format, sp.n_tokens, sp.key_offset, sp.key_head_bytes,
                                      p.n_kv_heads, D, p.group_size, p.n_boost, p.base_bytes, &ks) &&
                      kvmix__block_ok(sp.value_format, sp.n_tokens, sp.value_offset,
                                      sp.value_head_bytes, p.n_kv_heads, D, p.group_size,
                                      p.n_boost, p.base_bytes, &vs) &&
                      (sp.dead_index < 0 || sp.dead_index <= p.n_dead_flags - sp.n_tokens);
            if (!ok) {
                if (threadIdx.x == 0) sm.error = 1;
                return;
            }
            const uint8_t *kblk = p.base + sp.key_offset + (uint64_t)kv * sp.key_head_bytes;
            const uint8_t *vblk = p.base + sp.value_offset + (uint64_t)kv * sp.value_head_bytes;
            const int kf = sp.key_format, vf = sp.value_format;
            /* prepare the query for this span's key format */
            if (kf == KVMIX_FORMAT_INT2_CHANNEL || kf == KVMIX_FORMAT_BOOSTED) {
#pragma unroll
                for (int h = 0; h < NQ; h++) st.kaux[h] = 0.0f;
#pragma unroll
                for (int i = 0; i < G::CPL; i++) {
                    uint32_t mw = *(const uint32_t *)(kblk + ks.meta_offset + (uint64_t)(c0 + i) * 4);
                    float sc = kvmix__h2f((uint16_t)(mw & 0xffffu)), mn = kvmix__h2f((uint16_t)(mw >> 16));
                    int slot = kf == KVMIX_FORMAT_BOOSTED ? kblk[ks.index_offset + c0 + i] : KVMIX_BOOST_NONE;
#pragma unroll
                    for (int h = 0; h < NQ; h++) {
                        float qs = sm.q[h][c0 + i] * sc;
                        st.qk[h][i] = 4.0f * qs;
                        st.kaux[h] += fmaf(sm.q[h][c0 + i], mn, -4.0f * qs);
                        if (slot < p.n_boost && gi == 0) sm.u.qh[warp][slot][h] = 4.0f * qs;
                    }
                }
                __syncwarp();
            } else {
#pragma unroll
                for (int h = 0; h < NQ; h++) {
                    st.kaux[h] = 0.0f;
#pragma unroll
                    for (int i = 0; i < G::CPL; i++) {
                        st.qk[h][i] = sm.q[h][c0 + i];
                        st.kaux[h] += st.qk[h][i];
                    }
                }
            }
            if (vf == KVMIX_FORMAT_INT2_CHANNEL || vf == KVMIX_FORMAT_BOOSTED) {
                for (int c = lane; c < D; c += 32) {
                    uint32_t mw = *(const uint32_t *)(vblk + vs.meta_offset + (uint64_t)c * 4);
                    float sc = kvmix__h2f((uint16_t)(mw & 0xffffu)), mn = kvmix__h2f((uint16_t)(mw >> 16));
                    sm.vmeta[warp][0][c] = 4.0f * sc;
                    sm.vmeta[warp][1][c] = mn - 4.0f * sc;
                    sm.vslot[warp][c] =
                        vf == KVMIX_FORMAT_BOOSTED ? vblk[vs.index_offset + c] : (uint8_t)KVMIX_BOOST_NONE;
                }
                __syncwarp();
            }
            const int ta = (int)(max(lo, start) - start), tb = (int)(min(hi, start + (int64_t)sp.n_tokens) - start);
            const int n_chunks = (tb - ta + G::CHUNK - 1) / G::CHUNK;
            const uint8_t *dead = sp.dead_index >= 0 ? p.dead + sp.dead_index : nullptr;
            for (int ch = (warp - chunk_base % kvmix__decode_warps + kvmix__decode_warps) %
                          kvmix__decode_warps;
                 ch < n_chunks; ch += kvmix__decode_warps) {
                const int tok0 = ta + ch * G::CHUNK, tlast = tb - 1;
                float s[G::U][NQ];
                switch (kf) {
                case KVMIX_FORMAT_FP16:
                    kvmix__chunk_logits<D, NQ, KVMIX_FORMAT_FP16>(st, kblk, ks, p.group_size, p.n_boost, sm.u.qh[warp], tok0, tlast, gi, li, s);
                    break;
                case KVMIX_FORMAT_INT8:
                    kvmix__chunk_logits<D, NQ, KVMIX_FORMAT_INT8>(st, kblk, ks, p.group_size, p.n_boost, sm.u.qh[warp], tok0, tlast, gi, li, s);
                    break;
                case KVMIX_FORMAT_INT4:
                    kvmix__chunk_logits<D, NQ, KVMIX_FORMAT_INT4>(st, kblk, ks, p.group_size, p.n_boost, sm.u.qh[warp], tok0, tlast, gi, li, s);
                    break;
                case KVMIX_FORMAT_INT2:
                    kvmix__chunk_logits<D, NQ, KVMIX_FORMAT_INT2>(st, kblk, ks, p.group_size, p.n_boost, sm.u.qh[warp], tok0, tlast, gi, li, s);
                    break;
                case KVMIX_FORMAT_INT2_CHANNEL:
                    kvmix__chunk_logits<D, NQ, KVMIX_FORMAT_INT2_CHANNEL>(st, kblk, ks, p.group_size, p.n_boost, sm.u.qh[warp], tok0, tlast, gi, li, s);
                    break;
                default:
                    kvmix__chunk_logits<D, NQ, KVMIX_FORMAT_BOOSTED>(st, kblk, ks, p.group_size, p.n_boost, sm.u.qh[warp], tok0, tlast, gi, li, s);
                    break;
                }
                /* mask, online softmax over the chunk */
                float cmax[NQ];
#pragma unroll
                for (int h = 0; h < NQ; h++) cmax[h] = -INFINITY;
#pragma unroll
                for (int u = 0; u < G::U; u++) {
                    int t = tok0 + u * G::TPW + gi;
                    bool live = t <= tlast && !(dead && dead[t]);
#pragma unroll
                    for (int h = 0; h < NQ; h++) {
                        s[u][h] = live ? s[u][h] : -INFINITY;
                        cmax[h] = fmaxf(cmax[h], s[u][h]);
                    }
                }
#pragma unroll
                for (int off = G::LPT; off < 32; off <<= 1)
#pragma unroll
                    for (int h = 0; h < NQ; h++)
                        cmax[h] = fmaxf(cmax[h], __shfl_xor_sync(0xffffffffu, cmax[h], off));
                bool any = false;
#pragma unroll
                for (int h = 0; h < NQ; h++) {
                    if (cmax[h] > st.m[h]) {
                        float alpha = exp2f(st.m[h] - cmax[h]);
                        st.m[h] = cmax[h];
                        st.l[h] *= alpha;
                        st.accmin[h] *= alpha;
#pragma unroll
                        for (int i = 0; i < G::CPL; i++) st.acc[h][i] *= alpha;
                    }
                    any |= st.m[h] != -INFINITY;
                }
                if (!any) continue;
#pragma unroll
                for (int u = 0; u < G::U; u++)
#pragma unroll
                    for (int h = 0; h < NQ; h++) {
                        s[u][h] = st.m[h] == -INFINITY ? 0.0f : exp2f(s[u][h] - st.m[h]);
                        st.l[h] += s[u][h];
                    }
                switch (vf) {
                case KVMIX_FORMAT_FP16:
                    kvmix__chunk_values<D, NQ, KVMIX_FORMAT_FP16>(st, vblk, vs, p.group_size, sm.vmeta[warp], sm.vslot[warp], tok0, tlast, gi, li, s);
                    break;
                case KVMIX_FORMAT_INT8:
                    kvmix__chunk_values<D, NQ, KVMIX_FORMAT_INT8>(st, vblk, vs, p.group_size, sm.vmeta[warp], sm.vslot[warp], tok0, tlast, gi, li, s);
                    break;
                case KVMIX_FORMAT_INT4:
                    kvmix__chunk_values<D, NQ, KVMIX_FORMAT_INT4>(st, vblk, vs, p.group_size, sm.vmeta[warp], sm.vslot[warp], tok0, tlast, gi, li, s);
                    break;
                case KVMIX_FORMAT_INT2:
                    kvmix__chunk_values<D, NQ, KVMIX_FORMAT_INT2>(st, vblk, vs, p.group_size, sm.vmeta[warp], sm.vslot[warp], tok0, tlast, gi, li, s);
                    break;
                case KVMIX_FORMAT_INT2_CHANNEL:
                    kvmix__chunk_values<D, NQ, KVMIX_FORMAT_INT2_CHANNEL>(st, vblk, vs, p.group_size, sm.vmeta[warp], sm.vslot[warp], tok0, tlast, gi, li, s);
                    break;
                default:
                    kvmix__chunk_values<D, NQ, KVMIX_FORMAT_BOOSTED>(st, vblk, vs, p.group_size, sm.vmeta[warp], sm.vslot[warp], tok0, tlast, gi, li, s);
                    break;
                }
            }
            chunk_base += n_chunks % kvmix__decode_warps;
            __syncwarp();
        });
    else if (threadIdx.x == 0)
        sm.error = 1;

    /* reduce over the warp's token groups, then merge the block's warps */
#pragma unroll
    for (int off = G::LPT; off < 32; off <<= 1)
#pragma unroll
        for (int h = 0; h < NQ; h++) {
            st.l[h] += __shfl_xor_sync(0xffffffffu, st.l[h], off);
            st.accmin[h] += __shfl_xor_sync(0xffffffffu, st.accmin[h], off);
#pragma unroll
            for (int i = 0; i < G::CPL; i++)
                st.acc[h][i] += __shfl_xor_sync(0xffffffffu, st.acc[h][i], off);
        }
    __syncthreads();
    if (gi == 0) {
#pragma unroll
        for (int h = 0; h < NQ; h++) {
#pragma unroll
            for (int i = 0; i < G::CPL; i++) sm.u.merge.acc[warp][h][c0 + i] = st.acc[h][i] + st.accmin[h];
            if (li == 0) sm.u.merge.m[warp][h] = st.m[h], sm.u.merge.l[warp][h] = st.l[h];
        }
    }
    __syncthreads();
    const size_t part = ((size_t)seq * p.n_splits + split) * p.n_q_heads + qh0;
    for (int e = threadIdx.x; e < NQ * D; e += blockDim.x) {
        int h = e / D, c = e % D;
        float mx = -INFINITY;
        for (int w = 0; w < kvmix__decode_warps; w++) mx = fmaxf(mx, sm.u.merge.m[w][h]);
        float sum = 0.0f, o = 0.0f;
        if (mx != -INFINITY)
            for (int w = 0; w < kvmix__decode_warps; w++) {
                float wt = exp2f(sm.u.merge.m[w][h] - mx);
                sum += wt * sm.u.merge.l[w][h];
                o += wt * sm.u.merge.acc[w][h][c];
            }
        float nan = __int_as_float(0x7fffffff);
        bool err = sm.error != 0;
        p.part_out[part * D + e] = err ? nan : (sum > 0.0f ? o / sum : 0.0f);
        if (c == 0) p.part_lse[part + h] = err ? nan : (sum > 0.0f ? mx + log2f(sum) : -INFINITY);
    }
}

/* ---- decode attention on tensor cores (v2) ---------------------------------------------------

   Per warp: tiles of 16 tokens of one kv head against up to 4 query heads, with
   mma.sync.m16n8k16 (f16 inputs, f32 accumulators). The 8 columns of every B operand hold
   4 query heads x (hi, lo): an fp32 value v is carried as hi = fp16(v) and lo = fp16(v - hi),
   so each product is computed to ~22 bits and the two columns are summed in fp32 afterwards.
     logits   S^T[16 tokens x 8] += K[16 tokens x 16 dims] * B[16 dims x 8]
     output   O^T[16 dims x 8]   += V^T[16 dims x 16 tokens] * P^T[16 tokens x 8]
   Codes become fp16 exactly (code | 0x6400 is 1024 + code). Per-channel key scales are folded
   into B (per page), their minima into one constant per head. Per-token (scale, min) pairs are
   applied exactly: code * scale = hi + lo in fp16 (two mmas), and the minima go through one more
   small mma (keys: k = groups; values: rows = the lane's group). Boosted keys' high bits are one
   more mma over the boosted slots (B = 4 * q * scale of the slot's channel).

   Fragment geometry (lane L, r = L / 4, c = L % 4):
     QK A rows r, r + 8 = tokens r, r + 8 of the tile; lane c owns dims [c*D/4, (c+1)*D/4) of both
        rows, in 16-dim chunks; k-step j uses chunk j / 4, pairs (2v, 2v+8) and (2v+1, 2v+9),
        v = j % 4 (see kvmix__tc_kdim).
     PV A rows of m-tile i: row r = dim r*D/8 + 2i, row r + 8 = dim r*D/8 + 2i + 1; k = tokens
        2c, 2c+1, 2c+8, 2c+9; lane r owns dims [r*D/8, (r+1)*D/8) of its four tokens.
     C (both): lane holds rows r, r + 8 and columns 2c (hi), 2c+1 (lo) = query head c.
   P moves from the C layout of S^T to the B layout of P^T with movmatrix.trans. */

constexpr int kvmix__tc_warps = 4;
constexpr int kvmix__tc_unit_tokens = 128; /* tokens of a span one warp takes at a time */

__device__ __forceinline__ void kvmix__mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                           uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t kvmix__trans(uint32_t x) {
    uint32_t y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}
__device__ __forceinline__ uint32_t kvmix__prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
__device__ __forceinline__ uint32_t kvmix__h2u(__half2 h) { return *(uint32_t *)&h; }
__device__ __forceinline__ __half2 kvmix__u2h(uint32_t u) { return *(__half2 *)&u; }
/* (x & mask) | 0x6400 per half is 1024 + code * 2^k; a * x + b gives the code exactly. */
__device__ __forceinline__ uint32_t kvmix__code(uint32_t x, uint32_t mask, uint32_t a, uint32_t b) {
    return kvmix__h2u(__hfma2(kvmix__u2h((x & mask) | 0x64006400u), kvmix__u2h(a), kvmix__u2h(b)));
}
/* x: two 16-bit halves of 2-bit codes; R[k] = (code k of low half, code k of high half). */
__device__ __forceinline__ void kvmix__codes2(uint32_t x, uint32_t *R) {
    R[0] = kvmix__code(x, 0x00030003u, 0x3C003C00u, 0xE400E400u);
    R[1] = kvmix__code(x, 0x000C000Cu, 0x34003400u, 0xDC00DC00u);
    R[2] = kvmix__code(x, 0x00300030u, 0x2C002C00u, 0xD400D400u);
    R[3] = kvmix__code(x, 0x00C000C0u, 0x24002400u, 0xCC00CC00u);
    R[4] = kvmix__code(x, 0x03000300u, 0x1C001C00u, 0xC400C400u);
    uint32_t y = x >> 10;
    R[5] = kvmix__code(y, 0x00030003u, 0x3C003C00u, 0xE400E400u);
    R[6] = kvmix__code(y, 0x000C000Cu, 0x34003400u, 0xDC00DC00u);
    R[7] = kvmix__code(y, 0x00300030u, 0x2C002C00u, 0xD400D400u);
}
/* x: two halves of 4 nibbles; R[k] = (nibble k low, nibble k high). */
__device__ __forceinline__ void kvmix__codes4(uint32_t x, uint32_t *R) {
    R[0] = kvmix__code(x, 0x000F000Fu, 0x3C003C00u, 0xE400E400u);
    R[1] = kvmix__code(x, 0x00F000F0u, 0x2C002C00u, 0xD400D400u);
    uint32_t y = x >> 8;
    R[2] = kvmix__code(y, 0x000F000Fu, 0x3C003C00u, 0xE400E400u);
    R[3] = kvmix__code(y, 0x00F000F0u, 0x2C002C00u, 0xD400D400u);
}
/* R[k] = (byte k of a, byte k of b), k < 4. */
__device__ __forceinline__ void kvmix__codes8(uint32_t a, uint32_t b, uint32_t *R) {
#pragma unroll
    for (int k = 0; k < 4; k++)
        R[k] = kvmix__code(kvmix__prmt(a, b, (uint32_t)(k | ((4 + k) << 8))), 0x00FF00FFu,
                           0x3C003C00u, 0xE400E400u);
}
/* hi or lo half of v's two-term fp16 split. */
__device__ __forceinline__ uint16_t kvmix__split(float v, int part) {
    __half h = __float2half_rn(v);
    if (part) h = __float2half_rn(v - __half2float(h));
    return __half_as_ushort(h);
}
__device__ __forceinline__ uint32_t kvmix__split2(float v) { /* (hi, lo) of v */
    __half h = __float2half_rn(v);
    return kvmix__h2u(__halves2half2(h, __float2half_rn(v - __half2float(h))));
}
__device__ __forceinline__ uint32_t kvmix__pack(uint16_t lo, uint16_t hi) {
    return (uint32_t)lo | ((uint32_t)hi << 16);
}

template <int NW>
__device__ __forceinline__ void kvmix__ldw(const uint8_t *p, uint32_t *w) {
    if constexpr (NW % 4 == 0) {
#pragma unroll
        for (int i = 0; i < NW / 4; i++) {
            uint4 v = __ldg((const uint4 *)p + i);
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    } else if constexpr (NW == 2) {
        uint2 v = __ldg((const uint2 *)p);
        w[0] = v.x, w[1] = v.y;
    } else {
        w[0] = __ldg((const uint32_t *)p);
    }
}

/* Dim of QK k position e (0..3 for k = 2c, 2c+1, 2c+8, 2c+9) of k-step j for lane slot c. */
template <int D>
__device__ __forceinline__ int kvmix__tc_kdim(int c, int j, int e) {
    int base = c * (D / 4) + 16 * (j / 4), v = j % 4;
    return base + 2 * v + (e & 1) * 8 + (e >> 1);
}

template <int F>
__host__ __device__ constexpr int kvmix__fbits() {
    return F == KVMIX_FORMAT_FP16 ? 16 : F == KVMIX_FORMAT_INT8 ? 8 : F == KVMIX_FORMAT_INT4 ? 4 : 2;
}

template <int D>
struct kvmix__tc_smem {
    float q[4][D];     /* query * scale * log2(e); 0 for unused head slots */
    float qsum[4][16]; /* per-token keys: sum of q over each group */
    uint8_t slot_ch[kvmix__tc_warps][256];
    union {
        uint2 b2[kvmix__tc_warps][16][32]; /* boosted keys: B of the high-bit mma */
        struct {
            float acc[kvmix__tc_warps][4][D];
            float m[kvmix__tc_warps][4], l[kvmix__tc_warps][4];
        } merge;
    } u;
    kvmix__walk_smem walk;
    int error;
};

template <int D>
struct kvmix__tc_state {
    float o[D / 16][4];
    float om[4];
    float m, l;
};

/* Rows of K (per lane: its D/4 dims of tokens r and r+8) -> A registers of one 16-dim chunk:
   R[k] = (dim k, dim k + 8) of the chunk, k < 8, as exact fp16 codes (or fp16 values). */
template <int KF>
__device__ __forceinline__ void kvmix__tc_kchunk(const uint32_t *w, uint32_t *R) {
    if constexpr (KF == KVMIX_FORMAT_FP16) {
#pragma unroll
        for (int k = 0; k < 8; k++) R[k] = kvmix__prmt(w[k / 2], w[4 + k / 2], (k & 1) ? 0x7632u : 0x5410u);
    } else if constexpr (KF == KVMIX_FORMAT_INT8) {
        kvmix__codes8(w[0], w[2], R);
        kvmix__codes8(w[1], w[3], R + 4);
    } else if constexpr (KF == KVMIX_FORMAT_INT4) {
        kvmix__codes4(kvmix__prmt(w[0], w[1], 0x5410u), R);
        kvmix__codes4(kvmix__prmt(w[0], w[1], 0x7632u), R + 4);
    } else {
        kvmix__codes2(w[0], R);
    }
}

/* V words of two tokens (lane's D/8 dims each) -> R[k] = (token a dim k, token b dim k). */
template <int VF, int DV>
__device__ __forceinline__ void kvmix__tc_vpair(const uint32_t *a, const uint32_t *b, uint32_t *R) {
    if constexpr (VF == KVMIX_FORMAT_FP16) {
#pragma unroll
        for (int k = 0; k < DV / 2; k++) {
            R[2 * k] = kvmix__prmt(a[k], b[k], 0x5410u);
            R[2 * k + 1] = kvmix__prmt(a[k], b[k], 0x7632u);
        }
    } else if constexpr (VF == KVMIX_FORMAT_INT8) {
#pragma unroll
        for (int k = 0; k < DV / 4; k++) kvmix__codes8(a[k], b[k], R + 4 * k);
    } else if constexpr (VF == KVMIX_FORMAT_INT4) {
#pragma unroll
        for (int k = 0; k < DV / 8; k++) {
            kvmix__codes4(kvmix__prmt(a[k], b[k], 0x5410u), R + 8 * k);
            kvmix__codes4(kvmix__prmt(a[k], b[k], 0x7632u), R + 8 * k + 4);
        }
    } else {
        if constexpr (DV == 8) {
            kvmix__codes2(kvmix__prmt(a[0], b[0], 0x5410u), R);
        } else {
#pragma unroll
            for (int k = 0; k < DV / 16; k++) {
                kvmix__codes2(kvmix__prmt(a[k], b[k], 0x5410u), R + 16 * k);
                kvmix__codes2(kvmix__prmt(a[k], b[k], 0x7632u), R + 16 * k + 8);
            }
        }
    }
}

/* One warp: tokens [ta, tb) of a span (at most kvmix__tc_unit_tokens), keys KF, values VF. */
template <int D, int KF, int VF>
__device__ __forceinline__ void kvmix__tc_unit(kvmix__tc_state<D> &st, kvmix__tc_smem<D> &sm,
                                            const kvmix__decode_params &p, const uint8_t *kblk,
                                            const kvmix__sec &ks, const uint8_t *vblk,
                                            const kvmix__sec &vs, const uint8_t *dead, int ta,
                                            int tb) {
    constexpr int KS = D / 16, DQ = D / 4, DV = D / 8;
    constexpr int KB = kvmix__fbits<KF>(), VB = kvmix__fbits<VF>();
    constexpr bool k_chan = KF == KVMIX_FORMAT_INT2_CHANNEL || KF == KVMIX_FORMAT_BOOSTED;
    constexpr bool k_tok = kvmix__per_token(KF);
    constexpr bool v_chan = VF == KVMIX_FORMAT_INT2_CHANNEL || VF == KVMIX_FORMAT_BOOSTED;
    constexpr bool v_tok = kvmix__per_token(VF);
    constexpr int NWK = DQ * KB / 32;             /* K words per lane per row */
    constexpr int NWV = DV * VB / 32 > 0 ? DV * VB / 32 : 1; /* V words per lane per token */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, c = lane & 3;
    const int G = p.group_size, NG = D / G;
    const uint32_t krow = D * KB / 8, vrow = D * VB / 8;

    /* B of the logits: lane (slot c, column r): head r / 2, part r % 2 */
    uint32_t bk[KS][2];
    {
        const int h = r >> 1, part = r & 1;
#pragma unroll
        for (int j = 0; j < KS; j++) {
            uint16_t e[4];
#pragma unroll
            for (int x = 0; x < 4; x++) {
                int d = kvmix__tc_kdim<D>(c, j, x);
                float v = sm.q[h][d];
                if constexpr (k_chan) v *= kvmix__h2f((uint16_t)kvmix__ld_u16(kblk + ks.meta_offset + (uint64_t)d * 4));
                e[x] = kvmix__split(v, part);
            }
            bk[j][0] = kvmix__pack(e[0], e[1]);
            bk[j][1] = kvmix__pack(e[2], e[3]);
        }
    }
    float kconst = 0.0f; /* per-channel keys: sum over channels of q * min (head c) */
    if constexpr (k_chan) {
        for (int d = r; d < D; d += 8)
            kconst += sm.q[c][d] * kvmix__h2f((uint16_t)kvmix__ld_u16(kblk + ks.meta_offset + (uint64_t)d * 4 + 2));
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) kconst += __shfl_xor_sync(0xffffffffu, kconst, off);
    }
    uint32_t bm[2] = {0u, 0u}; /* per-token keys: B of the minima mma (k = group 4c + e) */
    if constexpr (k_tok) {
        const int h = r >> 1, part = r & 1;
        uint16_t e[4];
#pragma unroll
        for (int x = 0; x < 4; x++) {
            int g = 4 * c + x;
            e[x] = kvmix__split(g < NG ? sm.qsum[h][g] : 0.0f, part);
        }
        bm[0] = kvmix__pack(e[0], e[1]);
        bm[1] = kvmix__pack(e[2], e[3]);
    }
    int ks2 = 0; /* boosted keys: k-steps over the slots */
    if constexpr (KF == KVMIX_FORMAT_BOOSTED) {
        const int nb = p.n_boost;
        ks2 = (nb + 15) / 16;
        for (int d = lane; d < D; d += 32) {
            int s = kblk[ks.index_offset + d];
            if (s < nb) sm.slot_ch[warp][s] = (uint8_t)d;
        }
        __syncwarp();
        const int h = r >> 1, part = r & 1;
        for (int jb = 0; jb < ks2; jb++) {
            uint16_t e[4];
#pragma unroll
            for (int x = 0; x < 4; x++) {
                int s = 16 * jb + 4 * c + x;
                float v = 0.0f;
                if (s < nb) {
                    int d = sm.slot_ch[warp][s];
                    v = 4.0f * sm.q[h][d] *
                        kvmix__h2f((uint16_t)kvmix__ld_u16(kblk + ks.meta_offset + (uint64_t)d * 4));
                }
                e[x] = kvmix__split(v, part);
            }
            sm.u.b2[warp][jb][lane] = make_uint2(kvmix__pack(e[0], e[1]), kvmix__pack(e[2], e[3]));
        }
        __syncwarp();
    }
    float lsp = 0.0f; /* per-channel values: sum of p over this unit (head c, lane partial) */

    for (int t0 = ta; t0 < tb; t0 += 16) {
        const int tl = tb - 1;
        /* ---- loads ---- */
        const int kr0 = min(t0 + r, tl), kr1 = min(t0 + r + 8, tl);
        uint32_t kw[2][NWK];
        kvmix__ldw<NWK>(kblk + (uint32_t)kr0 * krow + c * (NWK * 4), kw[0]);
        kvmix__ldw<NWK>(kblk + (uint32_t)kr1 * krow + c * (NWK * 4), kw[1]);
        int vt[4];
        vt[0] = min(t0 + 2 * c, tl), vt[1] = min(t0 + 2 * c + 1, tl);
        vt[2] = min(t0 + 2 * c + 8, tl), vt[3] = min(t0 + 2 * c + 9, tl);
        uint32_t vw[4][NWV];
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const uint8_t *src = vblk + (uint32_t)vt[x] * vrow + r * (DV * VB / 8);
            if constexpr (DV * VB / 8 == 2)
                vw[x][0] = *(const uint16_t *)src;
            else
                kvmix__ldw<NWV>(src, vw[x]);
        }
        uint32_t vmeta[4] = {0u, 0u, 0u, 0u};
        if constexpr (v_tok) {
            const int gv = r * DV / G;
#pragma unroll
            for (int x = 0; x < 4; x++)
                vmeta[x] = __ldg((const uint32_t *)(vblk + vs.meta_offset + ((uint32_t)vt[x] * NG + gv) * 4));
        }

        /* ---- logits ---- */
        float sacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ch = 0; ch < KS / 4; ch++) {
            uint32_t R0[8], R1[8];
            if constexpr (KF == KVMIX_FORMAT_FP16 || KF == KVMIX_FORMAT_INT8 || KF == KVMIX_FORMAT_INT4) {
                constexpr int WPC = 16 * KB / 32; /* words per 16-dim chunk */
                kvmix__tc_kchunk<KF>(kw[0] + ch * WPC, R0);
                kvmix__tc_kchunk<KF>(kw[1] + ch * WPC, R1);
            } else {
                kvmix__tc_kchunk<KF>(kw[0] + ch, R0);
                kvmix__tc_kchunk<KF>(kw[1] + ch, R1);
            }
            if constexpr (k_tok) {
                const int g = (c * DQ + 16 * ch) / G;
                uint32_t m0 = __ldg((const uint32_t *)(kblk + ks.meta_offset + ((uint32_t)kr0 * NG + g) * 4));
                uint32_t m1 = __ldg((const uint32_t *)(kblk + ks.meta_offset + ((uint32_t)kr1 * NG + g) * 4));
                __half2 s0 = kvmix__u2h(kvmix__prmt(m0, m0, 0x1010u));
                __half2 s1 = kvmix__u2h(kvmix__prmt(m1, m1, 0x1010u));
#pragma unroll
                for (int v = 0; v < 4; v++) {
                    __half2 a0 = __hmul2(kvmix__u2h(R0[2 * v]), s0), a2 = __hmul2(kvmix__u2h(R0[2 * v + 1]), s0);
                    __half2 a1 = __hmul2(kvmix__u2h(R1[2 * v]), s1), a3 = __hmul2(kvmix__u2h(R1[2 * v + 1]), s1);
                    __half2 l0 = __hfma2(kvmix__u2h(R0[2 * v]), s0, __hneg2(a0));
                    __half2 l2 = __hfma2(kvmix__u2h(R0[2 * v + 1]), s0, __hneg2(a2));
                    __half2 l1 = __hfma2(kvmix__u2h(R1[2 * v]), s1, __hneg2(a1));
                    __half2 l3 = __hfma2(kvmix__u2h(R1[2 * v + 1]), s1, __hneg2(a3));
                    const int j = 4 * ch + v;
                    kvmix__mma(sacc, kvmix__h2u(a0), kvmix__h2u(a1), kvmix__h2u(a2), kvmix__h2u(a3), bk[j][0], bk[j][1]);
                    kvmix__mma(sacc, kvmix__h2u(l0), kvmix__h2u(l1), kvmix__h2u(l2), kvmix__h2u(l3), bk[j][0], bk[j][1]);
                }
            } else {
#pragma unroll
                for (int v = 0; v < 4; v++) {
                    const int j = 4 * ch + v;
                    kvmix__mma(sacc, R0[2 * v], R1[2 * v], R0[2 * v + 1], R1[2 * v + 1], bk[j][0], bk[j][1]);
                }
            }
        }
        if constexpr (k_tok) { /* minima: A[token][group] */
            uint32_t mn[2][4];
#pragma unroll
            for (int x = 0; x < 4; x++) {
                int g = 4 * c + x;
                mn[0][x] = g < NG ? __ldg((const uint32_t *)(kblk + ks.meta_offset + ((uint32_t)kr0 * NG + g) * 4)) : 0u;
                mn[1][x] = g < NG ? __ldg((const uint32_t *)(kblk + ks.meta_offset + ((uint32_t)kr1 * NG + g) * 4)) : 0u;
            }
            kvmix__mma(sacc, kvmix__prmt(mn[0][0], mn[0][1], 0x7632u), kvmix__prmt(mn[1][0], mn[1][1], 0x7632u),
                       kvmix__prmt(mn[0][2], mn[0][3], 0x7632u), kvmix__prmt(mn[1][2], mn[1][3], 0x7632u), bm[0], bm[1]);
        }
        if constexpr (KF == KVMIX_FORMAT_BOOSTED) { /* high bits of the boosted slots */
            const uint32_t hrow = (uint32_t)ks.high_row_bytes;
            const uint8_t *h0 = kblk + ks.high_offset + (uint32_t)kr0 * hrow;
            const uint8_t *h1 = kblk + ks.high_offset + (uint32_t)kr1 * hrow;
            for (int jb = 0; jb < ks2; jb++) {
                uint32_t bi = 4 * jb + c;
                uint32_t x0 = bi < hrow ? h0[bi] : 0u, x1 = bi < hrow ? h1[bi] : 0u;
                x0 |= x0 << 14, x1 |= x1 << 14;
                uint2 b = sm.u.b2[warp][jb][lane];
                kvmix__mma(sacc, kvmix__code(x0, 0x00030003u, 0x3C003C00u, 0xE400E400u),
                           kvmix__code(x1, 0x00030003u, 0x3C003C00u, 0xE400E400u),
                           kvmix__code(x0 >> 4, 0x00030003u, 0x3C003C00u, 0xE400E400u),
                           kvmix__code(x1 >> 4, 0x00030003u, 0x3C003C00u, 0xE400E400u), b.x, b.y);
            }
        }

        /* ---- online softmax (head c, tokens r and r + 8) ---- */
        float s0 = sacc[0] + sacc[1] + kconst, s1 = sacc[2] + sacc[3] + kconst;
        {
            int t = t0 + r;
            if (t > tl || (dead && dead[t])) s0 = -INFINITY;
            t += 8;
            if (t > tl || (dead && dead[t])) s1 = -INFINITY;
        }
        float tmax = fmaxf(s0, s1);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
        const float mnew = fmaxf(st.m, tmax);
        const float msafe = mnew == -INFINITY ? 0.0f : mnew;
        const float alpha = exp2f(st.m - msafe);
        if (__any_sync(0xffffffffu, alpha != 1.0f)) {
#pragma unroll
            for (int i = 0; i < D / 16; i++)
#pragma unroll
                for (int x = 0; x < 4; x++) st.o[i][x] *= alpha;
#pragma unroll
            for (int x = 0; x < 4; x++) st.om[x] *= alpha;
            st.l *= alpha;
            lsp *= alpha;
        }
        st.m = mnew;
        const float p0 = exp2f(s0 - msafe), p1 = exp2f(s1 - msafe);
        st.l += p0 + p1;
        if constexpr (v_chan) lsp += p0 + p1;
        const uint32_t pb0 = kvmix__trans(kvmix__split2(p0)), pb1 = kvmix__trans(kvmix__split2(p1));

        /* ---- values ---- */
        uint32_t Ra[DV], Rb[DV];
        kvmix__tc_vpair<VF, DV>(vw[0], vw[1], Ra);
        kvmix__tc_vpair<VF, DV>(vw[2], vw[3], Rb);
        if constexpr (VF == KVMIX_FORMAT_BOOSTED) { /* add 4 * high bits of boosted channels */
            const uint32_t hrow = (uint32_t)vs.high_row_bytes;
#pragma unroll
            for (int k = 0; k < DV; k++) {
                int d = r * DV + k, s = vblk[vs.index_offset + d];
                if (s != KVMIX_BOOST_NONE) {
                    uint32_t hv[4];
#pragma unroll
                    for (int x = 0; x < 4; x++)
                        hv[x] = (vblk[vs.high_offset + (uint32_t)vt[x] * hrow + (s >> 2)] >> ((s & 3) * 2)) & 3u;
                    __half2 ha = __halves2half2(__ushort2half_rn((unsigned short)hv[0]), __ushort2half_rn((unsigned short)hv[1]));
                    __half2 hb = __halves2half2(__ushort2half_rn((unsigned short)hv[2]), __ushort2half_rn((unsigned short)hv[3]));
                    Ra[k] = kvmix__h2u(__hfma2(ha, __float2half2_rn(4.0f), kvmix__u2h(Ra[k])));
                    Rb[k] = kvmix__h2u(__hfma2(hb, __float2half2_rn(4.0f), kvmix__u2h(Rb[k])));
                }
            }
        }
        if constexpr (VF == KVMIX_FORMAT_FP16) {
#pragma unroll
            for (int i = 0; i < D / 16; i++) kvmix__mma(st.o[i], Ra[2 * i], Ra[2 * i + 1], Rb[2 * i], Rb[2 * i + 1], pb0, pb1);
        } else {
            __half2 sa, sb;
            if constexpr (v_tok) {
                sa = kvmix__u2h(kvmix__prmt(vmeta[0], vmeta[1], 0x5410u));
                sb = kvmix__u2h(kvmix__prmt(vmeta[2], vmeta[3], 0x5410u));
            }
#pragma unroll
            for (int i = 0; i < D / 16; i++) {
                __half2 s0a = sa, s0b = sb, s1a = sa, s1b = sb;
                if constexpr (v_chan) {
                    int d = r * DV + 2 * i;
                    s0a = s0b = __half2half2(__ushort_as_half((uint16_t)kvmix__ld_u16(vblk + vs.meta_offset + (uint64_t)d * 4)));
                    s1a = s1b = __half2half2(__ushort_as_half((uint16_t)kvmix__ld_u16(vblk + vs.meta_offset + (uint64_t)(d + 1) * 4)));
                }
                __half2 a0 = __hmul2(kvmix__u2h(Ra[2 * i]), s0a), a1 = __hmul2(kvmix__u2h(Ra[2 * i + 1]), s1a);
                __half2 a2 = __hmul2(kvmix__u2h(Rb[2 * i]), s0b), a3 = __hmul2(kvmix__u2h(Rb[2 * i + 1]), s1b);
                __half2 l0 = __hfma2(kvmix__u2h(Ra[2 * i]), s0a, __hneg2(a0));
                __half2 l1 = __hfma2(kvmix__u2h(Ra[2 * i + 1]), s1a, __hneg2(a1));
                __half2 l2 = __hfma2(kvmix__u2h(Rb[2 * i]), s0b, __hneg2(a2));
                __half2 l3 = __hfma2(kvmix__u2h(Rb[2 * i + 1]), s1b, __hneg2(a3));
                kvmix__mma(st.o[i], kvmix__h2u(a0), kvmix__h2u(a1), kvmix__h2u(a2), kvmix__h2u(a3), pb0, pb1);
                kvmix__mma(st.o[i], kvmix__h2u(l0), kvmix__h2u(l1), kvmix__h2u(l2), kvmix__h2u(l3), pb0, pb1);
            }
            if constexpr (v_tok) {
                uint32_t ma = kvmix__prmt(vmeta[0], vmeta[1], 0x7632u), mb = kvmix__prmt(vmeta[2], vmeta[3], 0x7632u);
                kvmix__mma(st.om, ma, ma, mb, mb, pb0, pb1);
            }
        }
    }
    if constexpr (v_chan) { /* per-channel minima: o += min * sum of p over the unit */
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) lsp += __shfl_xor_sync(0xffffffffu, lsp, off);
#pragma unroll
        for (int i = 0; i < D / 16; i++) {
            int d = r * DV + 2 * i;
            st.o[i][0] += lsp * kvmix__h2f((uint16_t)kvmix__ld_u16(vblk + vs.meta_offset + (uint64_t)d * 4 + 2));
            st.o[i][2] += lsp * kvmix__h2f((uint16_t)kvmix__ld_u16(vblk + vs.meta_offset + (uint64_t)(d + 1) * 4 + 2));
        }
    }
}

#define KVMIX__TC_V(D_, KF_)                                                                       \
    switch (vf) {                                                                                  \
    case KVMIX_FORMAT_FP16: kvmix__tc_unit<D_, KF_, KVMIX_FORMAT_FP16>(st, sm, p, kblk, ks, vblk, vs, dead, ua, ub); break; \
    case KVMIX_FORMAT_INT8: kvmix__tc_unit<D_, KF_, KVMIX_FORMAT_INT8>(st, sm, p, kblk, ks, vblk, vs, dead, ua, ub); break; \
    case KVMIX_FORMAT_INT4: kvmix__tc_unit<D_, KF_, KVMIX_FORMAT_INT4>(st, sm, p, kblk, ks, vblk, vs, dead, ua, ub); break; \
    case KVMIX_FORMAT_INT2: kvmix__tc_unit<D_, KF_, KVMIX_FORMAT_INT2>(st, sm, p, kblk, ks, vblk, vs, dead, ua, ub); break; \
    case KVMIX_FORMAT_INT2_CHANNEL: kvmix__tc_unit<D_, KF_, KVMIX_FORMAT_INT2_CHANNEL>(st, sm, p, kblk, ks, vblk, vs, dead, ua, ub); break; \
    default: kvmix__tc_unit<D_, KF_, KVMIX_FORMAT_BOOSTED>(st, sm, p, kblk, ks, vblk, vs, dead, ua, ub); break; \
    }

/* Grid (n_splits, n_kv_heads * q_chunks, n_seqs), 128 threads; a block serves query heads
   [kv * q_per_kv + chunk * 4, + 4) (fewer in the last chunk) over its split's token range. */
template <int D>
static __global__ void __launch_bounds__(kvmix__tc_warps * 32) kvmix__tc_decode_kernel(kvmix__decode_params p) {
    __shared__ kvmix__tc_smem<D> sm;
    const int split = blockIdx.x, seq = blockIdx.z;
    const int kv = blockIdx.y / p.q_chunks, chunk = blockIdx.y % p.q_chunks;
    const int qh0 = kv * p.q_per_kv + chunk * 4, nq = min(4, p.q_per_kv - chunk * 4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int G = p.group_size, NG = D / G;

    for (int e = threadIdx.x; e < 4 * D; e += blockDim.x) {
        int h = e / D;
        sm.q[h][e % D] = h < nq ? kvmix__load_elem(p.q + ((size_t)seq * p.n_q_heads + qh0) * D + e, p.dtype) * p.scale_log2
                                : 0.0f;
    }
    if (threadIdx.x == 0) sm.error = 0;
    __syncthreads();
    for (int e = threadIdx.x; e < 4 * 16; e += blockDim.x) {
        int h = e / 16, g = e % 16;
        float s = 0.0f;
        if (g < NG)
            for (int d = g * G; d < g * G + G; d++) s += sm.q[h][d];
        sm.qsum[h][g] = s;
    }

    const int first = p.seq_first_span[seq], last = p.seq_first_span[seq + 1];
    int64_t total_tokens = 0;
    int bad_count = 0;
    for (int c0 = first; c0 < last; c0 += blockDim.x) {
        int i = c0 + threadIdx.x;
        int n = i < last ? p.spans[i].n_tokens : 1;
        int64_t part = i < last ? (int64_t)max(n, 0) : 0, sum;
        kvmix__block_scan(part, sm.walk.scratch, &sum);
        total_tokens += sum;
        bad_count += __syncthreads_count(n < 1);
    }
    const int64_t lo = total_tokens * split / p.n_splits;
    const int64_t hi = total_tokens * (split + 1) / p.n_splits;

    kvmix__tc_state<D> st;
#pragma unroll
    for (int i = 0; i < D / 16; i++)
#pragma unroll
        for (int x = 0; x < 4; x++) st.o[i][x] = 0.0f;
#pragma unroll
    for (int x = 0; x < 4; x++) st.om[x] = 0.0f;
    st.m = -INFINITY, st.l = 0.0f;
    __syncthreads();
    int unit_base = 0;
    /* the spans overlapping [lo, hi), walked inline (no lambda: the state must stay in registers) */
    int64_t span_base = 0;
    for (int c0 = first; bad_count == 0 && c0 < last && span_base < hi; c0 += blockDim.x) {
        const int i = c0 + (int)threadIdx.x;
        int64_t n = i < last ? (int64_t)max(p.spans[i].n_tokens, 0) : 0, total;
        int64_t end = span_base + kvmix__block_scan(n, sm.walk.scratch, &total);
        sm.walk.start[threadIdx.x] = end - n;
        const int j_begin = __syncthreads_count(i < last && end <= lo);
        const int j_end = __syncthreads_count(i < last && end - n < hi);
        for (int jj = j_begin; jj < j_end; jj++) {
            const int si = c0 + jj;
            const int64_t start = sm.walk.start[jj];
            const kvmix_view_span sp = p.spans[si];
            kvmix__sec ks, vs;
            bool ok = kvmix__block_ok(sp.key_format, sp.n_tokens, sp.key_offset, sp.key_head_bytes,
                                      p.n_kv_heads, D, p.group_size, p.n_boost, p.base_bytes, &ks) &&
                      kvmix__block_ok(sp.value_format, sp.n_tokens, sp.value_offset,
                                      sp.value_head_bytes, p.n_kv_heads, D, p.group_size,
                                      p.n_boost, p.base_bytes, &vs) &&
                      (sp.dead_index < 0 || sp.dead_index <= p.n_dead_flags - sp.n_tokens);
            if (!ok) {
                if (threadIdx.x == 0) sm.error = 1;
                continue;
            }
            const uint8_t *kblk = p.base + sp.key_offset + (uint64_t)kv * sp.key_head_bytes;
            const uint8_t *vblk = p.base + sp.value_offset + (uint64_t)kv * sp.value_head_bytes;
            const int kf = sp.key_format, vf = sp.value_format;
            const uint8_t *dead = sp.dead_index >= 0 ? p.dead + sp.dead_index : nullptr;
            const int ta = (int)(max(lo, start) - start), tb = (int)(min(hi, start + (int64_t)sp.n_tokens) - start);
            const int n_units = (tb - ta + kvmix__tc_unit_tokens - 1) / kvmix__tc_unit_tokens;
            for (int u = (warp - unit_base % kvmix__tc_warps + kvmix__tc_warps) % kvmix__tc_warps; u < n_units;
                 u += kvmix__tc_warps) {
                const int ua = ta + u * kvmix__tc_unit_tokens, ub = min(tb, ua + kvmix__tc_unit_tokens);
                switch (kf) {
                case KVMIX_FORMAT_FP16: KVMIX__TC_V(D, KVMIX_FORMAT_FP16) break;
                case KVMIX_FORMAT_INT8: KVMIX__TC_V(D, KVMIX_FORMAT_INT8) break;
                case KVMIX_FORMAT_INT4: KVMIX__TC_V(D, KVMIX_FORMAT_INT4) break;
                case KVMIX_FORMAT_INT2: KVMIX__TC_V(D, KVMIX_FORMAT_INT2) break;
                case KVMIX_FORMAT_INT2_CHANNEL: KVMIX__TC_V(D, KVMIX_FORMAT_INT2_CHANNEL) break;
                default: KVMIX__TC_V(D, KVMIX_FORMAT_BOOSTED) break;
                }
            }
            unit_base += n_units % kvmix__tc_warps;
        }
        span_base += total;
        __syncthreads();
    }
    if (bad_count != 0 && threadIdx.x == 0) sm.error = 1;

    /* the warp's sum of p per head, then merge the block's warps */
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) st.l += __shfl_xor_sync(0xffffffffu, st.l, off);
    __syncthreads(); /* b2 (union) no longer in use */
    {
        const int r = lane >> 2, c = lane & 3;
        constexpr int DV = D / 8;
        const float omin = st.om[0] + st.om[1];
#pragma unroll
        for (int i = 0; i < D / 16; i++) {
            sm.u.merge.acc[warp][c][r * DV + 2 * i] = st.o[i][0] + st.o[i][1] + omin;
            sm.u.merge.acc[warp][c][r * DV + 2 * i + 1] = st.o[i][2] + st.o[i][3] + omin;
        }
        if (r == 0) sm.u.merge.m[warp][c] = st.m, sm.u.merge.l[warp][c] = st.l;
    }
    __syncthreads();
    const size_t part = ((size_t)seq * p.n_splits + split) * p.n_q_heads + qh0;
    for (int e = threadIdx.x; e < nq * D; e += blockDim.x) {
        int h = e / D, c = e % D;
        float mx = -INFINITY;
        for (int w = 0; w < kvmix__tc_warps; w++) mx = fmaxf(mx, sm.u.merge.m[w][h]);
        float sum = 0.0f, o = 0.0f;
        if (mx != -INFINITY)
            for (int w = 0; w < kvmix__tc_warps; w++) {
                float wt = exp2f(sm.u.merge.m[w][h] - mx);
                sum += wt * sm.u.merge.l[w][h];
                o += wt * sm.u.merge.acc[w][h][c];
            }
        float nan = __int_as_float(0x7fffffff);
        bool err = sm.error != 0;
        p.part_out[part * D + e] = err ? nan : (sum > 0.0f ? o / sum : 0.0f);
        if (c == 0) p.part_lse[part + h] = err ? nan : (sum > 0.0f ? mx + log2f(sum) : -INFINITY);
    }
}

struct kvmix__merge_params {
    const float *part_out, *part_lse;
    int n_splits, n_q_heads, head_dim, dtype;
    uint16_t *out;
    float *lse;
};

/* One block per (sequence, query head), head_dim threads: merges the splits' partials. */
static __global__ void __launch_bounds__(256) kvmix__decode_merge_kernel(kvmix__merge_params p) {
    const int sh = blockIdx.x, seq = sh / p.n_q_heads, h = sh % p.n_q_heads, c = threadIdx.x;
    const size_t first = (size_t)seq * p.n_splits * p.n_q_heads + h;
    float mx = -INFINITY;
    bool nan = false;
    for (int s = 0; s < p.n_splits; s++) {
        float l = p.part_lse[first + (size_t)s * p.n_q_heads];
        nan |= l != l;
        mx = fmaxf(mx, l);
    }
    float sum = 0.0f, o = 0.0f;
    if (mx != -INFINITY && !nan)
        for (int s = 0; s < p.n_splits; s++) {
            size_t i = first + (size_t)s * p.n_q_heads;
            float wt = exp2f(p.part_lse[i] - mx);
            sum += wt;
            o += wt * p.part_out[i * p.head_dim + c];
        }
    float result = nan ? __int_as_float(0x7fffffff) : (sum > 0.0f ? o / sum : 0.0f);
    kvmix__store_elem(p.out + (size_t)sh * p.head_dim + c, result, p.dtype);
    if (c == 0 && p.lse)
        p.lse[sh] = nan ? __int_as_float(0x7fffffff)
                        : (sum > 0.0f ? (mx + log2f(sum)) * 0.69314718055994531f : -INFINITY);
}

} // namespace

// >>launch

static kvmix_result kvmix__launch_status(void) {
    return cudaGetLastError() == cudaSuccess ? KVMIX_SUCCESS : KVMIX_ERR_CUDA;
}

/* Resolves and checks a layout the way kvmix_layout_resolve does (no kvmix.h implementation is
   linked into this file). */
static kvmix_result kvmix__resolve(kvmix_layout *l) {
    if (kvmix__bits_of(l->format) == 0) return KVMIX_ERR_UNKNOWN_FORMAT;
    if (l->n_tokens < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    if (l->head_dim <= 0 || l->head_dim % 32 != 0 || l->head_dim > KVMIX_MAX_HEAD_DIM)
        return KVMIX_ERR_BAD_SHAPE;
    if (kvmix__per_token(l->format)) {
        if (l->group_size == 0) l->group_size = KVMIX_GROUP_SIZE_DEFAULT;
        if (l->group_size < 0 || l->group_size % 8 != 0 || l->head_dim % l->group_size != 0)
            return KVMIX_ERR_BAD_SHAPE;
    } else if (l->group_size != 0) {
        return KVMIX_ERR_BAD_SHAPE;
    }
    if (l->format == KVMIX_FORMAT_BOOSTED) {
        if (l->n_boost < 0 || l->n_boost % 4 != 0 || l->n_boost > l->head_dim || l->n_boost > 252)
            return KVMIX_ERR_BAD_SHAPE;
    } else if (l->n_boost != 0) {
        return KVMIX_ERR_BAD_SHAPE;
    }
    return KVMIX_SUCCESS;
}

extern "C" kvmix_result kvmix_cuda_quantize(const kvmix_layout *layout, const void *src,
                                            int64_t src_row_stride, void *dst,
                                            const kvmix_cuda_quantize_job *jobs, int32_t n_jobs,
                                            int32_t *error_flags, kvmix_stream stream) {
    if (!layout) return KVMIX_ERR_NULL_POINTER;
    kvmix_layout l = *layout;
    kvmix_result r = kvmix__resolve(&l);
    if (r != KVMIX_SUCCESS) return r;
    if (n_jobs < 0 || l.n_tokens < 1 || src_row_stride < l.head_dim) return KVMIX_ERR_INVALID_ARGUMENT;
    if (n_jobs == 0) return KVMIX_SUCCESS;
    if (!src || !dst || !jobs) return KVMIX_ERR_NULL_POINTER;
    kvmix__quantize_params p;
    p.format = l.format, p.n_tokens = l.n_tokens, p.head_dim = l.head_dim;
    p.group_size = l.group_size, p.n_boost = l.n_boost;
    p.sec = kvmix__sections(l.format, l.n_tokens, l.head_dim, l.group_size, l.n_boost);
    p.src = (const uint16_t *)src, p.src_row_stride = src_row_stride, p.dst = (uint8_t *)dst;
    p.jobs = jobs, p.error_flags = error_flags;
    kvmix__quantize_kernel<<<(unsigned)n_jobs, 256, 0, (cudaStream_t)stream>>>(p);
    return kvmix__launch_status();
}

/* Host-side checks of a view whose arrays are on the device. */
static kvmix_result kvmix__check_device_view(const kvmix_view *v) {
    if (!v) return KVMIX_ERR_NULL_POINTER;
    if (v->n_seqs < 0 || v->n_kv_heads <= 0 || v->n_spans < 0 || v->n_dead_flags < 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (v->head_dim <= 0 || v->head_dim % 32 != 0 || v->head_dim > KVMIX_MAX_HEAD_DIM)
        return KVMIX_ERR_BAD_SHAPE;
    int group = v->group_size ? v->group_size : KVMIX_GROUP_SIZE_DEFAULT;
    if (group < 0 || group % 8 != 0 || v->head_dim % group != 0) return KVMIX_ERR_BAD_SHAPE;
    if (v->n_boost < 0 || v->n_boost % 4 != 0 || v->n_boost > v->head_dim || v->n_boost > 252)
        return KVMIX_ERR_BAD_SHAPE;
    if (!v->seq_first_span || (v->n_spans > 0 && (!v->spans || !v->base)) ||
        (v->n_dead_flags > 0 && !v->dead))
        return KVMIX_ERR_NULL_POINTER;
    if (((uintptr_t)v->base & 15u) != 0) return KVMIX_ERR_INVALID_ARGUMENT;
    return KVMIX_SUCCESS;
}

static kvmix__view_params kvmix__view_params_of(const kvmix_view *v, int32_t seq) {
    kvmix__view_params p;
    p.base = v->base, p.base_bytes = v->base_bytes, p.spans = v->spans;
    p.seq_first_span = v->seq_first_span, p.dead = v->dead, p.n_dead_flags = v->n_dead_flags;
    p.n_kv_heads = v->n_kv_heads, p.head_dim = v->head_dim;
    p.group_size = v->group_size ? v->group_size : KVMIX_GROUP_SIZE_DEFAULT;
    p.n_boost = v->n_boost, p.seq = seq, p.capacity = 0, p.dtype = KVMIX_CUDA_FP16;
    p.n_q_heads = v->n_kv_heads, p.keys_out = p.values_out = nullptr;
    p.memory = nullptr, p.scores = nullptr;
    return p;
}

extern "C" kvmix_result kvmix_cuda_view_dequantize(const kvmix_view *view, int32_t seq,
                                                   kvmix_cuda_dtype dtype, void *keys_out,
                                                   void *values_out, int32_t capacity_tokens,
                                                   kvmix_stream stream) {
    kvmix_result r = kvmix__check_device_view(view);
    if (r != KVMIX_SUCCESS) return r;
    if (seq < 0 || seq >= view->n_seqs || capacity_tokens < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    if (dtype != KVMIX_CUDA_FP16 && dtype != KVMIX_CUDA_BF16) return KVMIX_ERR_UNSUPPORTED;
    if (capacity_tokens == 0 || (!keys_out && !values_out)) return KVMIX_SUCCESS;
    kvmix__view_params p = kvmix__view_params_of(view, seq);
    p.capacity = capacity_tokens, p.dtype = dtype;
    p.keys_out = (uint16_t *)keys_out, p.values_out = (uint16_t *)values_out;
    unsigned blocks = (unsigned)((capacity_tokens + kvmix__view_tile_tokens - 1) / kvmix__view_tile_tokens);
    kvmix__view_dequantize_kernel<<<blocks, 256, 0, (cudaStream_t)stream>>>(p);
    return kvmix__launch_status();
}

extern "C" kvmix_result kvmix_cuda_view_score(const kvmix_view *view, int32_t seq,
                                              int32_t n_q_heads, const float *memory,
                                              float *scores, int32_t capacity_tokens,
                                              kvmix_stream stream) {
    kvmix_result r = kvmix__check_device_view(view);
    if (r != KVMIX_SUCCESS) return r;
    if (seq < 0 || seq >= view->n_seqs || capacity_tokens < 0 || n_q_heads <= 0 ||
        n_q_heads % view->n_kv_heads != 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (capacity_tokens == 0) return KVMIX_SUCCESS;
    if (!memory || !scores) return KVMIX_ERR_NULL_POINTER;
    kvmix__view_params p = kvmix__view_params_of(view, seq);
    p.capacity = capacity_tokens, p.n_q_heads = n_q_heads, p.memory = memory, p.scores = scores;
    unsigned blocks = (unsigned)((capacity_tokens + kvmix__view_tile_tokens - 1) / kvmix__view_tile_tokens);
    kvmix__view_score_kernel<<<blocks, 256, 0, (cudaStream_t)stream>>>(p);
    return kvmix__launch_status();
}

extern "C" kvmix_result kvmix_cuda_decode_workspace_bytes(int32_t n_seqs, int32_t n_q_heads,
                                                          int32_t head_dim, int32_t n_splits,
                                                          size_t *out_bytes) {
    if (!out_bytes) return KVMIX_ERR_NULL_POINTER;
    if (n_seqs < 0 || n_q_heads <= 0 || head_dim <= 0 || n_splits < 1 ||
        n_splits > KVMIX_CUDA_MAX_SPLITS)
        return KVMIX_ERR_INVALID_ARGUMENT;
    *out_bytes = (size_t)n_seqs * (size_t)n_splits * (size_t)n_q_heads * ((size_t)head_dim + 1) * 4;
    return KVMIX_SUCCESS;
}

extern "C" kvmix_result kvmix_cuda_decode_choose_splits(int32_t n_seqs, int32_t n_kv_heads,
                                                        int32_t n_q_heads, int64_t max_seq_tokens,
                                                        int32_t n_sms, int32_t *out_splits) {
    if (!out_splits) return KVMIX_ERR_NULL_POINTER;
    if (n_seqs < 0 || n_kv_heads <= 0 || n_q_heads <= 0 || n_q_heads % n_kv_heads != 0 ||
        max_seq_tokens < 0 || n_sms <= 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    int g = n_q_heads / n_kv_heads;
    /* one block per (sequence, kv head, 4 query heads, split); about 4 blocks fit on an SM:
       fill the machine in one wave, with at least ~256 tokens per split */
    int64_t blocks = (int64_t)(n_seqs > 0 ? n_seqs : 1) * n_kv_heads * ((g + 3) / 4);
    int64_t want = 4 * (int64_t)n_sms / blocks;
    int64_t most = max_seq_tokens / 256;
    if (want > most) want = most;
    if (want < 1) want = 1;
    if (want > KVMIX_CUDA_MAX_SPLITS) want = KVMIX_CUDA_MAX_SPLITS;
    *out_splits = (int32_t)want;
    return KVMIX_SUCCESS;
}

template <int D, int NQ>
static void kvmix__decode_dispatch(dim3 grid, cudaStream_t stream, const kvmix__decode_params &p) {
    kvmix__decode_kernel<D, NQ><<<grid, kvmix__decode_threads, 0, stream>>>(p);
}

template <int D>
static void kvmix__decode_dispatch_nq(int nq, dim3 grid, cudaStream_t stream,
                                      const kvmix__decode_params &p) {
    switch (nq) {
    case 1: kvmix__decode_dispatch<D, 1>(grid, stream, p); break;
    case 2: kvmix__decode_dispatch<D, 2>(grid, stream, p); break;
    default: kvmix__decode_dispatch<D, 4>(grid, stream, p); break;
    }
}

/* Query heads per block: 4, 2 or 1 (a group of 8 runs as two blocks of 4 heads). */
static int kvmix__heads_per_block(int q_per_kv) {
    return q_per_kv % 4 == 0 ? 4 : q_per_kv % 2 == 0 ? 2 : 1;
}

extern "C" kvmix_result kvmix_cuda_decode(const kvmix_view *view, const kvmix_cuda_decode_desc *desc,
                                          const void *q, void *out, float *lse, void *workspace,
                                          size_t workspace_bytes, kvmix_stream stream) {
    if (!desc) return KVMIX_ERR_NULL_POINTER;
    kvmix_result r = kvmix__check_device_view(view);
    if (r != KVMIX_SUCCESS) return r;
    const int d = view->head_dim;
    if (desc->n_q_heads <= 0 || desc->n_q_heads % view->n_kv_heads != 0 || !(desc->scale >= 0.0f) ||
        isinf(desc->scale) || desc->n_splits < 1 || desc->n_splits > KVMIX_CUDA_MAX_SPLITS)
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (d != 64 && d != 128 && d != 256) return KVMIX_ERR_UNSUPPORTED;
    int group = view->group_size ? view->group_size : KVMIX_GROUP_SIZE_DEFAULT;
    if (group % 16 != 0) return KVMIX_ERR_UNSUPPORTED;
    if (desc->dtype != KVMIX_CUDA_FP16 && desc->dtype != KVMIX_CUDA_BF16) return KVMIX_ERR_UNSUPPORTED;
    if (view->n_seqs == 0) return KVMIX_SUCCESS;
    if (!q || !out || !workspace) return KVMIX_ERR_NULL_POINTER;
    size_t need;
    r = kvmix_cuda_decode_workspace_bytes(view->n_seqs, desc->n_q_heads, d, desc->n_splits, &need);
    if (r != KVMIX_SUCCESS) return r;
    if (workspace_bytes < need) return KVMIX_ERR_BUFFER_TOO_SMALL;
    if (((uintptr_t)workspace & 15u) != 0) return KVMIX_ERR_INVALID_ARGUMENT;
    const int q_per_kv = desc->n_q_heads / view->n_kv_heads;
    /* tensor-core kernel unless a value lane's D/8 dims would span two groups (D 256, G 16) */
    const bool tc = d / 8 <= group;
    const int nq = tc ? 4 : kvmix__heads_per_block(q_per_kv);
    const int q_chunks = tc ? (q_per_kv + 3) / 4 : q_per_kv / nq;
    const int64_t grid_y = (int64_t)view->n_kv_heads * q_chunks;
    if (grid_y > 65535 || view->n_seqs > 65535) return KVMIX_ERR_UNSUPPORTED;

    kvmix__decode_params p;
    p.base = view->base, p.base_bytes = view->base_bytes, p.spans = view->spans;
    p.seq_first_span = view->seq_first_span, p.dead = view->dead;
    p.n_dead_flags = view->n_dead_flags, p.n_seqs = view->n_seqs, p.n_kv_heads = view->n_kv_heads;
    p.n_q_heads = desc->n_q_heads, p.q_per_kv = q_per_kv, p.q_chunks = q_chunks;
    p.group_size = group, p.n_boost = view->n_boost, p.n_splits = desc->n_splits;
    p.dtype = desc->dtype;
    float scale = desc->scale > 0.0f ? desc->scale : 1.0f / sqrtf((float)d);
    p.scale_log2 = scale * 1.4426950408889634f;
    p.q = (const uint16_t *)q;
    p.part_out = (float *)workspace;
    p.part_lse = p.part_out + (size_t)view->n_seqs * desc->n_splits * desc->n_q_heads * d;

    dim3 grid((unsigned)desc->n_splits, (unsigned)grid_y, (unsigned)view->n_seqs);
    cudaStream_t s = (cudaStream_t)stream;
    const unsigned threads = kvmix__tc_warps * 32;
    if (tc) {
        switch (d) {
        case 64: kvmix__tc_decode_kernel<64><<<grid, threads, 0, s>>>(p); break;
        case 128: kvmix__tc_decode_kernel<128><<<grid, threads, 0, s>>>(p); break;
        default: kvmix__tc_decode_kernel<256><<<grid, threads, 0, s>>>(p); break;
        }
    } else {
        kvmix__decode_dispatch_nq<256>(nq, grid, s, p); /* SIMT kernel (v1) */
    }
    if ((r = kvmix__launch_status()) != KVMIX_SUCCESS) return r;

    kvmix__merge_params m;
    m.part_out = p.part_out, m.part_lse = p.part_lse, m.n_splits = desc->n_splits;
    m.n_q_heads = desc->n_q_heads, m.head_dim = d, m.dtype = desc->dtype;
    m.out = (uint16_t *)out, m.lse = lse;
    kvmix__decode_merge_kernel<<<(unsigned)(view->n_seqs * desc->n_q_heads), (unsigned)d, 0, s>>>(m);
    return kvmix__launch_status();
}

extern "C" kvmix_result kvmix_cuda_decode_blocks_per_sm(int32_t head_dim, int32_t q_per_kv,
                                                        int32_t *out_blocks) {
    if (!out_blocks) return KVMIX_ERR_NULL_POINTER;
    if (q_per_kv <= 0) return KVMIX_ERR_INVALID_ARGUMENT;
    int blocks = 0;
    cudaError_t e = cudaErrorInvalidValue;
    const int threads = kvmix__tc_warps * 32;
    if (head_dim == 64) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kvmix__tc_decode_kernel<64>, threads, 0);
    if (head_dim == 128) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kvmix__tc_decode_kernel<128>, threads, 0);
    if (head_dim == 256) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kvmix__tc_decode_kernel<256>, threads, 0);
    if (head_dim != 64 && head_dim != 128 && head_dim != 256) return KVMIX_ERR_UNSUPPORTED;
    if (e != cudaSuccess) return KVMIX_ERR_CUDA;
    *out_blocks = blocks;
    return KVMIX_SUCCESS;
}
