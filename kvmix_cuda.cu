/* kvmix_cuda.cu - CUDA kernel pack for kvmix (see kvmix_cuda.h). MIT licensed (see LICENSE).

   Rooms, one kernel family each after the shared helpers; a family's launchers follow its
   kernels:
     // >>helpers         fp16/bf16, block sections, exact quantize arithmetic, warp/block scans,
                          the span walker every view kernel uses
     // >>launch-common   what every launcher checks (launch status, head_dim, layouts)
     // >>quantize        packing FP16/BF16/float rows into blocks (kvmix_cuda_quantize)
     // >>copies          the cache's jobs: byte copies and dequantize, and their runner
                          (kvmix_cuda_copy_blocks, kvmix_cuda_cache_run)
     // >>views           view dequantize, scores and QueryMemory scoring (kvmix_cuda_view_*)
     // >>decode          decode attention on tensor cores (a CUDA-core walk for the other
                          shapes) and the merge of splits
                          (kvmix_cuda_decode*)
     // >>payload         the transfer payload's body, packed and unpacked on the device
                          (kvmix_cuda_payload_*)

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

constexpr int kvmix__view_tile_tokens = 32; /* tokens per block of dequantize and score */

__device__ __forceinline__ float kvmix__bf2f(uint16_t b) {
    return __uint_as_float((uint32_t)b << 16);
}
__device__ __forceinline__ uint16_t kvmix__f2bf(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

__device__ __forceinline__ float kvmix__elem2f(uint16_t e, int dtype) {
    return dtype == KVMIX_CUDA_BF16 ? kvmix__bf2f(e) : kvmix__h2f(e);
}
__device__ __forceinline__ uint16_t kvmix__f2elem(float x, int dtype) {
    return dtype == KVMIX_CUDA_BF16 ? kvmix__f2bf(x) : kvmix__f2h(x);
}
__device__ __forceinline__ float kvmix__load_elem(const uint16_t *p, int dtype) {
    return kvmix__elem2f(*p, dtype);
}
__device__ __forceinline__ void kvmix__store_elem(uint16_t *p, float x, int dtype) {
    *p = kvmix__f2elem(x, dtype);
}

/* Element k (0 .. 7) of eight 16-bit values in a 16-byte word, and the other way. */
__device__ __forceinline__ uint16_t kvmix__u16_of(const uint4 &w, int k) {
    uint32_t v = k < 4 ? (k < 2 ? w.x : w.y) : (k < 6 ? w.z : w.w);
    return (uint16_t)(v >> ((k & 1) * 16));
}
__device__ __forceinline__ uint4 kvmix__u16x8(const uint16_t *e) {
    return make_uint4(
        (uint32_t)e[0] | ((uint32_t)e[1] << 16), (uint32_t)e[2] | ((uint32_t)e[3] << 16),
        (uint32_t)e[4] | ((uint32_t)e[5] << 16), (uint32_t)e[6] | ((uint32_t)e[7] << 16));
}

/* A group's parameters (kvmix.h's kvmix__choose_qparams) and their rounded reciprocal scale,
   kvmix__quantize_code's first try. */
struct kvmix__qp {
    kvmix__qparams p;
    float inv_scale;
};

__device__ inline kvmix__qp kvmix__choose_qp(float lo, float hi, int levels, unsigned grid) {
    kvmix__qp q;
    q.p = kvmix__choose_qparams(lo, hi, levels, grid);
    q.inv_scale = __frcp_rn(q.p.scale);
    return q;
}

/* kvmix.h's kvmix__quantize_value, mostly without a division: while |quotient| < 1024, the
   product by the rounded 1 / scale lies within 2e-4 of the correctly rounded quotient (three
   roundings of 2^-24 relative), so both round to the same integer unless the product lies within
   1e-3 of a half; those few (about 0.2%) take the division of the rule itself. */
__device__ __forceinline__ uint32_t kvmix__quantize_code(float x, const kvmix__qp &q, int levels) {
    if (q.p.scale_h == 0) return 0;
    float r = __fmul_rn(__fsub_rn(x, q.p.min), q.inv_scale);
    if (!(fabsf(r - floorf(r) - 0.5f) >= 1e-3f) || !(fabsf(r) < 1024.0f))
        return kvmix__quantize_value(x, q.p, levels);
    return (uint32_t)fminf(fmaxf(rintf(r), 0.0f), (float)levels);
}

/* One group of `group` elements x (dtype) of a per-token row, as kvmix.h's kvmix__quantize_row:
   its packed codes into codes[0 .. group * bits / 8) and its (scale, min) pair into meta[0 .. 4).
   Byte stores only: codes and meta may be anywhere, global or shared. */
__device__ inline void kvmix__quantize_group(const uint16_t *x, int dtype, int group, int bits,
                                             uint8_t *codes, uint8_t *meta) {
    const int levels = (1 << bits) - 1, per_byte = 8 / bits;
    float lo = kvmix__load_elem(x, dtype), hi = lo;
    for (int c = 1; c < group; c++) {
        float v = kvmix__load_elem(x + c, dtype);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    kvmix__qp qp = kvmix__choose_qp(lo, hi, levels, kvmix__scale_grid(bits));
    for (int b = 0; b < group / per_byte; b++) {
        uint8_t byte = 0;
        for (int k = 0; k < per_byte; k++)
            kvmix__put_code(
                &byte, k, bits,
                kvmix__quantize_code(kvmix__load_elem(x + b * per_byte + k, dtype), qp, levels));
        codes[b] = byte;
    }
    kvmix__store_qparams(meta, qp.p);
}

/* Element (t, c) of a block, as kvmix.h's kvmix__decode_row (byte loads, any alignment). */
__device__ inline float kvmix__decode_value(int format, const uint8_t *blk,
                                            const kvmix__sections &s, int64_t t, int c, int group) {
    const uint8_t *row = blk + kvmix__row_at(&s, t);
    if (format == KVMIX_FORMAT_FP16) return kvmix__h2f(kvmix__load_u16(row + 2 * c));
    uint32_t q;
    const uint8_t *meta;
    if (kvmix__is_per_token_int(format)) {
        const int bits = kvmix__format_bits(format);
        const int32_t groups = (int32_t)(s.row_bytes * 8 / (uint64_t)bits) / group;
        q = kvmix__get_code(row, c, bits);
        meta = blk + kvmix__token_meta_at(&s, t, groups, c / group);
    } else {
        q = kvmix__channel_code(format, blk, &s, t, c);
        meta = blk + kvmix__channel_meta_at(&s, c);
    }
    return kvmix__dequantize_value(q, kvmix__h2f(kvmix__load_u16(meta)),
                                   kvmix__h2f(kvmix__load_u16(meta + 2)));
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

constexpr int kvmix__max_block_threads = 1024; /* of any CUDA block: the walker's scan */

struct kvmix__walk_smem {
    int64_t scratch[kvmix__max_block_threads / 32];
    int64_t start[kvmix__max_block_threads];
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

/* Whether a block of a view span is readable (kvmix__view_block_extent: the launchers checked the
   view's shape) and 16-byte aligned. */
__device__ inline bool kvmix__block_ok(int format, int n, uint64_t offset, uint32_t head_bytes,
                                       int n_kv, int d, int group, int n_boost, uint64_t base_bytes,
                                       kvmix__sections *out) {
    return ((offset | head_bytes) & 15u) == 0 &&
           kvmix__view_block_extent(format, n, offset, head_bytes, n_kv, d, group, n_boost,
                                    base_bytes, out) == KVMIX_SUCCESS;
}

} // namespace

// >>launch-common  what every launcher checks

static kvmix_result kvmix__launch_status(void) {
    return cudaGetLastError() == cudaSuccess ? KVMIX_SUCCESS : KVMIX_ERR_CUDA;
}

/* The head_dims this pack has run at: multiples of 32 (decode narrows them further). kvmix.h
   takes any multiple of 8; the quantize, view and payload kernels index channels without
   assuming more, but no GPU test has run them at 48 or 80, so those are UNSUPPORTED for now. */
static bool kvmix__head_dim_run(int32_t head_dim) { return head_dim % 32 == 0; }

/* Whether decode takes head_dim d: what the pack runs (kvmix__head_dim_run), up to the merge's
   block of a thread per dim. */
static bool kvmix__decode_head_dim(int32_t d) {
    return d > 0 && d <= 256 && kvmix__head_dim_run(d);
}

/* Resolves and checks a layout as kvmix_layout_resolve does. */
static kvmix_result kvmix__resolve(kvmix_layout *l) {
    return kvmix__layout_check(l->format, l->n_tokens, l->head_dim, &l->group_size, l->n_boost);
}

// >>quantize  packing rows into blocks

namespace {

struct kvmix__quantize_params {
    int format, n_tokens, head_dim, group_size, n_boost;
    kvmix__sections sec;
    const uint16_t *src;
    int64_t src_row_stride;
    uint8_t *dst;
    const kvmix_cuda_quantize_job *jobs;
    int32_t *error_flags;
};

struct kvmix__quantize_smem {
    float lo[KVMIX_MAX_HEAD_DIM], hi[KVMIX_MAX_HEAD_DIM], score[KVMIX_MAX_HEAD_DIM];
    kvmix__qp qp[KVMIX_MAX_HEAD_DIM];
    uint8_t boosted[KVMIX_MAX_HEAD_DIM];
    int16_t slot_channel[KVMIX_MAX_BOOST];
};
static_assert(KVMIX_MAX_BOOST < 256 && KVMIX_BOOST_NONE >= KVMIX_MAX_BOOST,
              "a slot fits a byte of the boost index, apart from NONE");

/* One block per job. [n_rows][head_dim] fp16 in, one block's rows (or the whole block) out. */
static __global__ void __launch_bounds__(256) kvmix__quantize_kernel(kvmix__quantize_params p) {
    __shared__ kvmix__quantize_smem sm;
    const kvmix_cuda_quantize_job job = p.jobs[blockIdx.x];
    const int d = p.head_dim;
    const bool per_channel = !kvmix__is_per_token_int(p.format) && p.format != KVMIX_FORMAT_FP16;
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
        bad |= !kvmix__fp16_finite(h);
    }
    if (__syncthreads_or(bad)) {
        if (threadIdx.x == 0 && p.error_flags)
            atomicOr(p.error_flags, KVMIX_CUDA_QUANTIZE_BAD_VALUE);
        return;
    }
    uint8_t *blk = p.dst + job.dst_offset;
    const kvmix__sections &s = p.sec;
    if (p.format == KVMIX_FORMAT_FP16) {
        uint16_t *out = (uint16_t *)(blk + (uint64_t)job.first_row * s.row_bytes);
        for (int64_t e = threadIdx.x; e < n_elems; e += blockDim.x)
            out[e] = src[(e / d) * p.src_row_stride + e % d];
        return;
    }
    if (!per_channel) {
        const int bits = kvmix__format_bits(p.format);
        const int groups = d / p.group_size, per_byte = 8 / bits;
        const int64_t n_tasks = (int64_t)job.n_rows * groups;
        for (int64_t task = threadIdx.x; task < n_tasks; task += blockDim.x) {
            int r = (int)(task / groups), g = (int)(task % groups);
            int64_t t = job.first_row + r;
            kvmix__quantize_group(
                src + r * p.src_row_stride + g * p.group_size, KVMIX_CUDA_FP16, p.group_size, bits,
                blk + (uint64_t)t * s.row_bytes + (uint64_t)g * p.group_size / per_byte,
                blk + kvmix__token_meta_at(&s, t, groups, g));
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
        const kvmix__qp qp = kvmix__choose_qp(sm.lo[c], sm.hi[c], levels, 1u);
        sm.qp[c] = qp;
        kvmix__store_qparams(blk + kvmix__channel_meta_at(&s, c), qp.p);
        if (boosted) {
            int slot = 0;
            for (int o = 0; o < c; o++) slot += sm.boosted[o];
            blk[s.index_offset + c] = sm.boosted[c] ? (uint8_t)slot : (uint8_t)KVMIX_BOOST_NONE;
            if (sm.boosted[c]) sm.slot_channel[slot] = (int16_t)c;
        }
    }
    __syncthreads();
    const int row_bytes = (int)s.row_bytes; /* 2-bit codes */
    for (int64_t e = threadIdx.x; e < (int64_t)n * row_bytes; e += blockDim.x) {
        int t = (int)(e / row_bytes), b = (int)(e % row_bytes);
        uint8_t byte = 0;
        for (int k = 0; k < 4; k++) {
            int c = b * 4 + k;
            uint32_t q = kvmix__quantize_code(kvmix__h2f(src[t * p.src_row_stride + c]), sm.qp[c],
                                              sm.boosted[c] ? 15 : 3);
            kvmix__put_code(&byte, k, 2, q & 3u); /* the low bits; boosted high bits below */
        }
        blk[(uint64_t)t * row_bytes + b] = byte;
    }
    if (boosted) {
        const int high_bytes = (int)s.high_row_bytes;
        for (int64_t e = threadIdx.x; e < (int64_t)n * high_bytes; e += blockDim.x) {
            int t = (int)(e / high_bytes), b = (int)(e % high_bytes);
            uint8_t byte = 0;
            for (int k = 0; k < 4; k++) {
                int c = sm.slot_channel[b * 4 + k];
                uint32_t q =
                    kvmix__quantize_code(kvmix__h2f(src[t * p.src_row_stride + c]), sm.qp[c], 15);
                kvmix__put_code(&byte, k, 2, q >> 2);
            }
            blk[kvmix__high_row_at(&s, t) + b] = byte;
        }
    }
}

} // namespace

extern "C" kvmix_result kvmix_cuda_quantize(const kvmix_layout *layout, const void *src,
                                            int64_t src_row_stride, void *dst,
                                            const kvmix_cuda_quantize_job *jobs, int32_t n_jobs,
                                            int32_t *error_flags, kvmix_stream stream) {
    if (!layout) return KVMIX_ERR_NULL_POINTER;
    kvmix_layout l = *layout;
    kvmix_result r = kvmix__resolve(&l);
    if (r != KVMIX_SUCCESS) return r;
    if (!kvmix__head_dim_run(l.head_dim)) return KVMIX_ERR_UNSUPPORTED;
    if (n_jobs < 0 || l.n_tokens < 1 || src_row_stride < l.head_dim)
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (n_jobs == 0) return KVMIX_SUCCESS;
    if (!src || !dst || !jobs) return KVMIX_ERR_NULL_POINTER;
    kvmix__quantize_params p;
    p.format = l.format, p.n_tokens = l.n_tokens, p.head_dim = l.head_dim;
    p.group_size = l.group_size, p.n_boost = l.n_boost;
    p.sec = kvmix__block_sections(l.format, l.n_tokens, l.head_dim, l.group_size, l.n_boost);
    p.src = (const uint16_t *)src, p.src_row_stride = src_row_stride, p.dst = (uint8_t *)dst;
    p.jobs = jobs, p.error_flags = error_flags;
    kvmix__quantize_kernel<<<(unsigned)n_jobs, 256, 0, (cudaStream_t)stream>>>(p);
    return kvmix__launch_status();
}

// >>copies  the cache's jobs: byte copies, dequantize, and their runner

namespace {

/* One block per job: n_rows bytes from src + src_offset to dst + dst_offset, in 16-byte vectors
   when both ends and the length allow. */
static __global__ void __launch_bounds__(256)
    kvmix__copy_kernel(const uint8_t *src, uint8_t *dst, const kvmix_quantize_job *jobs) {
    const kvmix_quantize_job job = jobs[blockIdx.x];
    const uint8_t *from = src + job.src_offset;
    uint8_t *to = dst + job.dst_offset;
    const int64_t n = job.n_rows;
    if (((job.src_offset | job.dst_offset | (uint64_t)n) & 15u) == 0) {
        for (int64_t i = threadIdx.x; i < n / 16; i += blockDim.x)
            ((uint4 *)to)[i] = ((const uint4 *)from)[i];
        return;
    }
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) to[i] = from[i];
}

/* One block per DEQUANTIZE job: rows first_row .. + n_rows of the block at src_offset of the
   arena (format, n_tokens rows, sections s) to FP16 rows from dst_offset; a job whose rows are
   not in the block writes nothing and raises KVMIX_CUDA_QUANTIZE_BAD_VALUE. */
struct kvmix__dequantize_params {
    int format, n_tokens, head_dim, group_size;
    kvmix__sections sec;
    uint8_t *arena;
    const kvmix_quantize_job *jobs;
    int32_t *error_flags;
};

static __global__ void __launch_bounds__(256)
    kvmix__dequantize_job_kernel(kvmix__dequantize_params p) {
    const kvmix_quantize_job job = p.jobs[blockIdx.x];
    if (job.first_row < 0 || job.n_rows < 1 || job.n_rows > p.n_tokens - job.first_row) {
        if (threadIdx.x == 0 && p.error_flags)
            atomicOr(p.error_flags, KVMIX_CUDA_QUANTIZE_BAD_VALUE);
        return;
    }
    const uint8_t *block = p.arena + job.src_offset;
    uint16_t *out = (uint16_t *)(p.arena + job.dst_offset);
    const int64_t n = (int64_t)job.n_rows * p.head_dim;
    for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
        const int64_t r = e / p.head_dim;
        const int c = (int)(e % p.head_dim);
        float v = kvmix__decode_value(p.format, block, p.sec, job.first_row + r, c, p.group_size);
        out[e] = kvmix__f2h(v);
    }
}

} // namespace

extern "C" kvmix_result kvmix_cuda_copy_blocks(const void *src, void *dst,
                                               const kvmix_quantize_job *jobs, int32_t n_jobs,
                                               kvmix_stream stream) {
    if (n_jobs < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    if (n_jobs == 0) return KVMIX_SUCCESS;
    if (!src || !dst || !jobs) return KVMIX_ERR_NULL_POINTER;
    kvmix__copy_kernel<<<(unsigned)n_jobs, 256, 0, (cudaStream_t)stream>>>((const uint8_t *)src,
                                                                           (uint8_t *)dst, jobs);
    return kvmix__launch_status();
}

/* The DEQUANTIZE jobs of one batch (layout of their source blocks). */
static kvmix_result kvmix__dequantize_jobs(const kvmix_layout *layout, void *arena,
                                           const kvmix_quantize_job *jobs, int32_t n_jobs,
                                           int32_t *error_flags, kvmix_stream stream) {
    kvmix_layout l = *layout;
    kvmix_result r = kvmix__resolve(&l);
    if (r != KVMIX_SUCCESS) return r;
    if (!kvmix__head_dim_run(l.head_dim)) return KVMIX_ERR_UNSUPPORTED;
    if (n_jobs == 0) return KVMIX_SUCCESS;
    kvmix__dequantize_params p;
    p.format = l.format, p.n_tokens = l.n_tokens, p.head_dim = l.head_dim;
    p.group_size = l.group_size;
    p.sec = kvmix__block_sections(l.format, l.n_tokens, l.head_dim, l.group_size, l.n_boost);
    p.arena = (uint8_t *)arena, p.jobs = jobs, p.error_flags = error_flags;
    kvmix__dequantize_job_kernel<<<(unsigned)n_jobs, 256, 0, (cudaStream_t)stream>>>(p);
    return kvmix__launch_status();
}

extern "C" kvmix_result kvmix_cuda_cache_run(const kvmix_cache_batch *batches, int32_t n_batches,
                                             const kvmix_quantize_job *jobs, const void *key_rows,
                                             const void *value_rows, void *arena,
                                             int32_t *error_flags, kvmix_stream stream) {
    if (n_batches < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    if (n_batches > 0 && (!batches || !jobs || !arena)) return KVMIX_ERR_NULL_POINTER;
    for (int32_t b = 0; b < n_batches; b++) { /* every batch checked before any is enqueued */
        const kvmix_cache_batch *batch = &batches[b];
        bool quantize = batch->kind == KVMIX_CACHE_BATCH_QUANTIZE;
        if (batch->first_job < 0 || batch->n_jobs < 0 ||
            (!quantize && batch->kind != KVMIX_CACHE_BATCH_COPY &&
             batch->kind != KVMIX_CACHE_BATCH_DEQUANTIZE))
            return KVMIX_ERR_INVALID_ARGUMENT;
        if (quantize && ((batch->source == KVMIX_CACHE_SOURCE_KEYS && !key_rows) ||
                         (batch->source == KVMIX_CACHE_SOURCE_VALUES && !value_rows)))
            return KVMIX_ERR_NULL_POINTER;
    }
    for (int32_t b = 0; b < n_batches; b++) {
        const kvmix_cache_batch *batch = &batches[b];
        const kvmix_quantize_job *first = jobs + batch->first_job;
        kvmix_result r;
        if (batch->kind == KVMIX_CACHE_BATCH_COPY) {
            r = kvmix_cuda_copy_blocks(arena, arena, first, batch->n_jobs, stream);
        } else if (batch->kind == KVMIX_CACHE_BATCH_DEQUANTIZE) {
            r = kvmix__dequantize_jobs(&batch->layout, arena, first, batch->n_jobs, error_flags,
                                       stream);
        } else {
            const void *src = batch->source == KVMIX_CACHE_SOURCE_KEYS     ? key_rows
                              : batch->source == KVMIX_CACHE_SOURCE_VALUES ? value_rows
                                                                           : arena;
            r = kvmix_cuda_quantize(&batch->layout, src, batch->src_row_stride, arena, first,
                                    batch->n_jobs, error_flags, stream);
        }
        if (r != KVMIX_SUCCESS) return r;
    }
    return KVMIX_SUCCESS;
}

// >>views  view dequantize and QueryMemory scoring

namespace {

struct kvmix__view_params {
    const uint8_t *base;
    uint64_t base_bytes;
    const kvmix_view_span *spans;
    const int32_t *seq_first_span;
    const uint8_t *dead;
    int n_spans, n_dead_flags, n_kv_heads, head_dim, group_size, n_boost, seq, capacity, dtype;
    int n_q_heads;
    uint16_t *keys_out, *values_out;
    const float *memory;
    float *scores;
    float *readout; /* key features: the readouts (scores takes the key norms) */
    /* batched intent scoring: sequence p.seq + blockIdx.y reads its memory memory_stride floats
       and writes its logits scores_stride floats after the previous one's */
    int64_t memory_stride, scores_stride;
};

/* Blocks of tokens [x * 32, x * 32 + 32): out [capacity][n_kv_heads][head_dim] of dtype. */
static __global__ void __launch_bounds__(256) kvmix__view_dequantize_kernel(kvmix__view_params p) {
    __shared__ kvmix__walk_smem sm;
    const int64_t lo = (int64_t)blockIdx.x * kvmix__view_tile_tokens;
    const int64_t hi = min(lo + kvmix__view_tile_tokens, (int64_t)p.capacity);
    const int d = p.head_dim, n_kv = p.n_kv_heads;
    const int first = p.seq_first_span[p.seq], last = p.seq_first_span[p.seq + 1];
    if (!kvmix__view_range_ok(first, last,
                              p.n_spans)) { /* no span read: every row of the tile NaN */
        const int64_t row = (int64_t)n_kv * d;
        for (int64_t e = threadIdx.x; e < (hi - lo) * row; e += blockDim.x)
            for (int which = 0; which < 2; which++) {
                uint16_t *out = which ? p.values_out : p.keys_out;
                if (out) kvmix__store_elem(out + lo * row + e, __int_as_float(0x7fffffff), p.dtype);
            }
        return;
    }
    kvmix__for_spans(p.spans, first, last, lo, hi, sm, [&](int si, int64_t start) {
        const kvmix_view_span sp = p.spans[si];
        int64_t t0 = max(lo, start), t1 = min(hi, start + (int64_t)sp.n_tokens);
        for (int which = 0; which < 2; which++) {
            uint16_t *out = which ? p.values_out : p.keys_out;
            if (!out) continue;
            int format = which ? sp.value_format : sp.key_format;
            uint64_t offset = which ? sp.value_offset : sp.key_offset;
            uint32_t head_bytes = which ? sp.value_head_bytes : sp.key_head_bytes;
            kvmix__sections s;
            bool ok = kvmix__block_ok(format, sp.n_tokens, offset, head_bytes, n_kv, d,
                                      p.group_size, p.n_boost, p.base_bytes, &s) &&
                      kvmix__view_dead_ok(sp.dead_index, sp.n_tokens, p.n_dead_flags);
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

/* Whether the key blocks and dead flags of view span sp can be read (its key sections in *s). */
__device__ inline bool kvmix__span_keys_ok(const kvmix__view_params &p, const kvmix_view_span &sp,
                                           kvmix__sections *s) {
    return kvmix__block_ok(sp.key_format, sp.n_tokens, sp.key_offset, sp.key_head_bytes,
                           p.n_kv_heads, p.head_dim, p.group_size, p.n_boost, p.base_bytes, s) &&
           kvmix__view_dead_ok(sp.dead_index, sp.n_tokens, p.n_dead_flags);
}

/* Blocks of 32 tokens, one warp per token: scores[t] = sum_h dot(memory[h], key_t[h / g]). */
static __global__ void __launch_bounds__(256) kvmix__view_score_kernel(kvmix__view_params p) {
    __shared__ kvmix__walk_smem sm;
    const int64_t lo = (int64_t)blockIdx.x * kvmix__view_tile_tokens;
    const int64_t hi = min(lo + kvmix__view_tile_tokens, (int64_t)p.capacity);
    const int d = p.head_dim, n_kv = p.n_kv_heads, g = p.n_q_heads / p.n_kv_heads;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const int first = p.seq_first_span[p.seq], last = p.seq_first_span[p.seq + 1];
    if (!kvmix__view_range_ok(first, last,
                              p.n_spans)) { /* no span read: every score of the tile NaN */
        for (int64_t t = lo + threadIdx.x; t < hi; t += blockDim.x)
            p.scores[t] = __int_as_float(0x7fffffff);
        return;
    }
    kvmix__for_spans(p.spans, first, last, lo, hi, sm, [&](int si, int64_t start) {
        const kvmix_view_span sp = p.spans[si];
        int64_t t0 = max(lo, start), t1 = min(hi, start + (int64_t)sp.n_tokens);
        kvmix__sections s;
        bool ok = kvmix__span_keys_ok(p, sp, &s);
        for (int64_t pos = t0 + warp; pos < t1; pos += n_warps) {
            int64_t t = pos - start;
            float acc = 0.0f;
            if (ok)
                for (int e = lane; e < n_kv * d; e += 32) {
                    int h = e / d, c = e % d;
                    float k = kvmix__decode_value(
                        sp.key_format, p.base + sp.key_offset + (uint64_t)h * sp.key_head_bytes, s,
                        t, c, p.group_size);
                    for (int j = 0; j < g; j++) acc += p.memory[(size_t)(h * g + j) * d + c] * k;
                }
            for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
            if (lane == 0) {
                if (!ok)
                    acc = __int_as_float(0x7fffffff);
                else if (sp.dead_index >= 0 && p.dead[sp.dead_index + t])
                    acc = -INFINITY;
                p.scores[pos] = acc;
            }
        }
    });
}

/* Key features (kvmix_ref_view_key_features): blocks of 32 tokens, one warp per token, its key
   rows decoded once per kv head: key_norm[t] (p.scores) = the mean over kv heads of the key's
   norm, readout[t] = the mean over q heads of scale * dot(memory[h], key); dead tokens 0, a bad
   span's NaN. */
static __global__ void __launch_bounds__(256)
    kvmix__key_features_kernel(kvmix__view_params p, float scale) {
    __shared__ kvmix__walk_smem sm;
    const int64_t lo = (int64_t)blockIdx.x * kvmix__view_tile_tokens;
    const int64_t hi = min(lo + kvmix__view_tile_tokens, (int64_t)p.capacity);
    const int d = p.head_dim, n_kv = p.n_kv_heads, g = p.n_q_heads / n_kv;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const int first = p.seq_first_span[p.seq], last = p.seq_first_span[p.seq + 1];
    if (!kvmix__view_range_ok(first, last, p.n_spans)) {
        for (int64_t t = lo + threadIdx.x; t < hi; t += blockDim.x)
            p.scores[t] = p.readout[t] = __int_as_float(0x7fffffff);
        return;
    }
    kvmix__for_spans(p.spans, first, last, lo, hi, sm, [&](int si, int64_t start) {
        const kvmix_view_span sp = p.spans[si];
        int64_t t0 = max(lo, start), t1 = min(hi, start + (int64_t)sp.n_tokens);
        kvmix__sections s;
        bool ok = kvmix__span_keys_ok(p, sp, &s);
        for (int64_t pos = t0 + warp; pos < t1; pos += n_warps) {
            const int64_t t = pos - start;
            float norms = 0.0f, logits = 0.0f;
            const bool dead = ok && sp.dead_index >= 0 && p.dead[sp.dead_index + t];
            for (int h = 0; ok && !dead && h < n_kv; h++) {
                const uint8_t *block = p.base + sp.key_offset + (uint64_t)h * sp.key_head_bytes;
                float key[KVMIX_MAX_HEAD_DIM / 32], squares = 0.0f;
                for (int i = 0; i < KVMIX_MAX_HEAD_DIM / 32 && lane + 32 * i < d; i++) {
                    key[i] = kvmix__decode_value(sp.key_format, block, s, t, lane + 32 * i,
                                                 p.group_size);
                    squares += key[i] * key[i];
                }
                for (int off = 16; off > 0; off >>= 1)
                    squares += __shfl_xor_sync(0xffffffffu, squares, off);
                norms += sqrtf(squares);
                for (int j = 0; j < g; j++) {
                    const float *m = p.memory + (size_t)(h * g + j) * d;
                    float dot = 0.0f;
                    for (int i = 0; i < KVMIX_MAX_HEAD_DIM / 32 && lane + 32 * i < d; i++)
                        dot += m[lane + 32 * i] * key[i];
                    for (int off = 16; off > 0; off >>= 1)
                        dot += __shfl_xor_sync(0xffffffffu, dot, off);
                    logits += dot * scale;
                }
            }
            if (lane == 0) {
                p.scores[pos] = ok ? norms / (float)n_kv : __int_as_float(0x7fffffff);
                p.readout[pos] = ok ? logits / (float)(n_kv * g) : __int_as_float(0x7fffffff);
            }
        }
    });
}

/* Query heads whose logits one pass over a key row accumulates (a kv head's group is taken in
   chunks of this many). */
constexpr int kvmix__intent_heads = 8;
/* FP16 rows: the query heads one thread's pass over its row serves. */
constexpr int kvmix__intent_fp16_heads = 4;
/* The most memory floats the logits kernel stages in shared memory: what the 48 KiB a block may
   have without opting in leaves beside the walk's static share. */
constexpr int kvmix__intent_smem_floats = (48 * 1024 - (int)sizeof(kvmix__walk_smem)) / 4;

/* Logits of FP16 key rows [t0, t1) of span sp, one thread per (token, kv head), a warp on
   consecutive tokens of one kv head: each row read 16 bytes at a time, its kv head's query heads
   taken four at a time against their memory (mem: [n_q_heads][d]; STAGED: in shared memory, read
   16 bytes at a time), each logit summed over the dims in order: its bits depend on neither g, the
   batch nor where the memory was read. Where the generic walk below spends a warp's shuffles and
   a per-element decode on each (token, kv head): the runner's recording path (FP16 caches). */
template <bool STAGED>
__device__ inline void kvmix__intent_fp16_rows(const kvmix__view_params &p,
                                               const kvmix_view_span &sp, const kvmix__sections &s,
                                               int64_t start, int64_t t0, int64_t t1,
                                               const float *mem, float scale, float *logits) {
    const int d = p.head_dim, n_kv = p.n_kv_heads, g = p.n_q_heads / n_kv;
    const int64_t n_tok = t1 - t0;
    for (int64_t task = threadIdx.x; task < n_tok * n_kv; task += blockDim.x) {
        const int kh = (int)(task / n_tok);
        const int64_t pos = t0 + task % n_tok, t = pos - start;
        if (sp.dead_index >= 0 && p.dead[sp.dead_index + t]) continue; /* -inf */
        const uint4 *row = (const uint4 *)(p.base + sp.key_offset +
                                           (uint64_t)kh * sp.key_head_bytes + kvmix__row_at(&s, t));
        for (int h0 = kh * g; h0 < (kh + 1) * g; h0 += kvmix__intent_fp16_heads) {
            const int heads = min(kvmix__intent_fp16_heads, (kh + 1) * g - h0);
            float acc[kvmix__intent_fp16_heads] = {};
            for (int c = 0; c < d; c += 8) {
                const uint4 w = row[c / 8];
                const uint32_t words[4] = {w.x, w.y, w.z, w.w};
                float k[8];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    k[2 * e] = kvmix__h2f((uint16_t)(words[e] & 0xffffu));
                    k[2 * e + 1] = kvmix__h2f((uint16_t)(words[e] >> 16));
                }
#pragma unroll
                for (int j = 0; j < kvmix__intent_fp16_heads; j++) {
                    if (j >= heads) break;
                    const float *m = mem + (size_t)(h0 + j) * d + c;
                    float mv[8];
                    if constexpr (STAGED) {
                        const float4 m0 = ((const float4 *)m)[0], m1 = ((const float4 *)m)[1];
                        mv[0] = m0.x, mv[1] = m0.y, mv[2] = m0.z, mv[3] = m0.w;
                        mv[4] = m1.x, mv[5] = m1.y, mv[6] = m1.z, mv[7] = m1.w;
                    } else {
#pragma unroll
                        for (int e = 0; e < 8; e++) mv[e] = m[e];
                    }
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[j] = fmaf(mv[e], k[e], acc[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < kvmix__intent_fp16_heads; j++)
                if (j < heads) logits[(size_t)(h0 + j) * p.capacity + pos] = acc[j] * scale;
        }
    }
}

/* Intent scoring, step 1 (after the logits were set to -inf): blocks of 32 tokens,
   logits[h][t] = scale * dot(memory[h], key_t[h / g]). FP16 spans take kvmix__intent_fp16_rows,
   against the memory staged in dynamic shared memory of n_q_heads * d floats where the launch
   gave it (`staged`); other spans one warp per (token, kv head), each key element decoded once per
   kvmix__intent_heads of the kv head's g query heads, lane-strided sums reduced across the warp
   (the order of one warp per query head, so the bits do not depend on g). Dead tokens stay -inf,
   a bad span's tokens get NaN. */
static __global__ void __launch_bounds__(256)
    kvmix__intent_logits_kernel(kvmix__view_params p, float scale, bool staged) {
    __shared__ kvmix__walk_smem sm;
    extern __shared__ float4 staged_memory[];
    const int64_t lo = (int64_t)blockIdx.x * kvmix__view_tile_tokens;
    const int64_t hi = min(lo + kvmix__view_tile_tokens, (int64_t)p.capacity);
    const int d = p.head_dim, n_kv = p.n_kv_heads, g = p.n_q_heads / n_kv,
              seq = p.seq + (int)blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const int first = p.seq_first_span[seq], last = p.seq_first_span[seq + 1];
    const float *memory = p.memory + blockIdx.y * p.memory_stride;
    float *logits = p.scores + blockIdx.y * p.scores_stride;
    float *mem = (float *)staged_memory;
    if (!kvmix__view_range_ok(first, last, p.n_spans)) {
        for (int64_t e = threadIdx.x; e < (hi - lo) * p.n_q_heads; e += blockDim.x)
            logits[(e / (hi - lo)) * p.capacity + lo + e % (hi - lo)] = __int_as_float(0x7fffffff);
        return;
    }
    if (staged) {
        for (int i = threadIdx.x; i < p.n_q_heads * d; i += blockDim.x) mem[i] = memory[i];
        __syncthreads();
    }
    kvmix__for_spans(p.spans, first, last, lo, hi, sm, [&](int si, int64_t start) {
        const kvmix_view_span sp = p.spans[si];
        int64_t t0 = max(lo, start), t1 = min(hi, start + (int64_t)sp.n_tokens);
        kvmix__sections s;
        bool ok = kvmix__span_keys_ok(p, sp, &s);
        if (ok && sp.key_format == KVMIX_FORMAT_FP16) {
            if (staged)
                kvmix__intent_fp16_rows<true>(p, sp, s, start, t0, t1, mem, scale, logits);
            else
                kvmix__intent_fp16_rows<false>(p, sp, s, start, t0, t1, memory, scale, logits);
            return;
        }
        for (int64_t task = warp; task < (t1 - t0) * n_kv; task += n_warps) {
            const int64_t pos = t0 + task / n_kv, t = pos - start;
            const int kh = (int)(task % n_kv);
            if (ok && sp.dead_index >= 0 && p.dead[sp.dead_index + t]) continue; /* -inf */
            const uint8_t *block = p.base + sp.key_offset + (uint64_t)kh * sp.key_head_bytes;
            for (int h0 = kh * g; h0 < (kh + 1) * g; h0 += kvmix__intent_heads) {
                const int heads = min(kvmix__intent_heads, (kh + 1) * g - h0);
                float acc[kvmix__intent_heads] = {};
                if (ok)
                    for (int c = lane; c < d; c += 32) {
                        const float k =
                            kvmix__decode_value(sp.key_format, block, s, t, c, p.group_size);
#pragma unroll
                        for (int j = 0; j < kvmix__intent_heads; j++)
                            if (j < heads) acc[j] += memory[(size_t)(h0 + j) * d + c] * k;
                    }
#pragma unroll
                for (int j = 0; j < kvmix__intent_heads; j++) {
                    if (j >= heads) break;
                    float a = acc[j];
                    for (int off = 16; off > 0; off >>= 1)
                        a += __shfl_xor_sync(0xffffffffu, a, off);
                    if (lane == 0)
                        logits[(size_t)(h0 + j) * p.capacity + pos] =
                            ok ? a * scale : __int_as_float(0x7fffffff);
                }
            }
        }
    });
}

/* Step 0: every logit -inf (tokens the walk does not reach, past the sequence, stay so). */
static __global__ void kvmix__fill_kernel(float *x, int64_t n, float v) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        x[i] = v;
}

/* Step 2: one block per (query head, sequence): the max and the sum of exp of its logits (NaN
   propagates). A sequence's logits are [n_heads][capacity], then its (max, sum) per head; the
   next sequence's start stride floats on. */
static __global__ void __launch_bounds__(256)
    kvmix__intent_norm_kernel(float *logits, int capacity, int64_t stride) {
    __shared__ float red[8];
    const float *x = logits + blockIdx.y * stride + (size_t)blockIdx.x * capacity;
    float *ml = logits + blockIdx.y * stride + (size_t)gridDim.x * capacity;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float m = -INFINITY, l = 0.0f;
    bool nan = false;
    for (int t = threadIdx.x; t < capacity; t += blockDim.x) {
        const float v = x[t];
        m = fmaxf(m, v);
        nan |= v != v;
    }
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) m = fmaxf(m, red[w]);
    __syncthreads();
    if (m != -INFINITY)
        for (int t = threadIdx.x; t < capacity; t += blockDim.x) l += expf(x[t] - m);
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) red[warp] = l;
    nan = __syncthreads_or(nan);
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) l += red[w];
        ml[2 * blockIdx.x] = m;
        ml[2 * blockIdx.x + 1] = nan ? __int_as_float(0x7fffffff) : l;
    }
}

/* Step 3: scores[t] = sum over heads of exp(logit - m) / l; -inf where every head's is -inf
   (dead, or past the sequence). Sequence blockIdx.y's scores start capacity floats after the
   previous one's. */
static __global__ void kvmix__intent_sum_kernel(const float *all_logits, int n_heads, int capacity,
                                                int64_t stride, float *all_scores) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= capacity) return;
    const float *logits = all_logits + blockIdx.y * stride,
                *ml = logits + (size_t)n_heads * capacity;
    float *scores = all_scores + (size_t)blockIdx.y * capacity;
    float sum = 0.0f;
    bool live = false;
    for (int h = 0; h < n_heads; h++) {
        const float x = logits[(size_t)h * capacity + t], m = ml[2 * h], l = ml[2 * h + 1];
        if (x == -INFINITY) continue;
        live = true;
        sum += expf(x - m) / l;
    }
    scores[t] = live ? sum : -INFINITY;
}

} // namespace

/* Host-side checks of a view whose arrays are on the device: its shape and arrays
   (kvmix_view_check's first steps; the kernels check every span they read), a 16-byte aligned
   base, and one group for keys and values. */
static kvmix_result kvmix__check_device_view(const kvmix_view *v) {
    if (!v) return KVMIX_ERR_NULL_POINTER;
    kvmix_result r;
    if ((r = kvmix__view_shape_check(v)) != KVMIX_SUCCESS ||
        (r = kvmix__view_arrays_check(v)) != KVMIX_SUCCESS)
        return r;
    if (!kvmix__head_dim_run(v->head_dim)) return KVMIX_ERR_UNSUPPORTED;
    /* the kernels read every per-token block with one group: values in groups of their own are
       not supported yet */
    if (kvmix__view_group(v->group_size, v->value_group_size, 1, KVMIX_FORMAT_INT4) !=
        kvmix__view_group(v->group_size, v->value_group_size, 0, KVMIX_FORMAT_INT4))
        return KVMIX_ERR_UNSUPPORTED;
    if (((uintptr_t)v->base & 15u) != 0) return KVMIX_ERR_INVALID_ARGUMENT;
    return KVMIX_SUCCESS;
}

static kvmix__view_params kvmix__view_params_of(const kvmix_view *v, int32_t seq) {
    kvmix__view_params p;
    p.base = v->base, p.base_bytes = v->base_bytes, p.spans = v->spans;
    p.seq_first_span = v->seq_first_span, p.dead = v->dead, p.n_spans = v->n_spans;
    p.n_dead_flags = v->n_dead_flags;
    p.n_kv_heads = v->n_kv_heads, p.head_dim = v->head_dim;
    p.group_size = kvmix__view_group(v->group_size, v->value_group_size, 0, KVMIX_FORMAT_INT4);
    p.n_boost = v->n_boost, p.seq = seq, p.capacity = 0, p.dtype = KVMIX_CUDA_FP16;
    p.n_q_heads = v->n_kv_heads, p.keys_out = p.values_out = nullptr;
    p.memory = nullptr, p.scores = nullptr, p.readout = nullptr;
    p.memory_stride = p.scores_stride = 0;
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
    unsigned blocks =
        (unsigned)((capacity_tokens + kvmix__view_tile_tokens - 1) / kvmix__view_tile_tokens);
    kvmix__view_dequantize_kernel<<<blocks, 256, 0, (cudaStream_t)stream>>>(p);
    return kvmix__launch_status();
}

extern "C" kvmix_result kvmix_cuda_view_score(const kvmix_view *view, int32_t seq,
                                              int32_t n_q_heads, const float *memory, float *scores,
                                              int32_t capacity_tokens, kvmix_stream stream) {
    kvmix_result r = kvmix__check_device_view(view);
    if (r != KVMIX_SUCCESS) return r;
    if (seq < 0 || seq >= view->n_seqs || capacity_tokens < 0 || n_q_heads <= 0 ||
        n_q_heads % view->n_kv_heads != 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (capacity_tokens == 0) return KVMIX_SUCCESS;
    if (!memory || !scores) return KVMIX_ERR_NULL_POINTER;
    kvmix__view_params p = kvmix__view_params_of(view, seq);
    p.capacity = capacity_tokens, p.n_q_heads = n_q_heads, p.memory = memory, p.scores = scores;
    unsigned blocks =
        (unsigned)((capacity_tokens + kvmix__view_tile_tokens - 1) / kvmix__view_tile_tokens);
    kvmix__view_score_kernel<<<blocks, 256, 0, (cudaStream_t)stream>>>(p);
    return kvmix__launch_status();
}

extern "C" kvmix_result kvmix_cuda_view_key_features(const kvmix_view *view, int32_t seq,
                                                     int32_t n_q_heads, float scale,
                                                     const float *memory, float *key_norm,
                                                     float *readout, int32_t capacity_tokens,
                                                     kvmix_stream stream) {
    kvmix_result r = kvmix__check_device_view(view);
    if (r != KVMIX_SUCCESS) return r;
    if (seq < 0 || seq >= view->n_seqs || capacity_tokens < 0 || n_q_heads <= 0 ||
        n_q_heads % view->n_kv_heads != 0 || !(scale >= 0.0f) || isinf(scale))
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (capacity_tokens == 0) return KVMIX_SUCCESS;
    if (!memory || !key_norm || !readout) return KVMIX_ERR_NULL_POINTER;
    kvmix__view_params p = kvmix__view_params_of(view, seq);
    p.capacity = capacity_tokens, p.n_q_heads = n_q_heads, p.memory = memory;
    p.scores = key_norm, p.readout = readout;
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)view->head_dim);
    unsigned blocks =
        (unsigned)((capacity_tokens + kvmix__view_tile_tokens - 1) / kvmix__view_tile_tokens);
    kvmix__key_features_kernel<<<blocks, 256, 0, (cudaStream_t)stream>>>(p, scale);
    return kvmix__launch_status();
}

/* Intent workspace: logits [n_q_heads][capacity_tokens], then (max, sum) per head. */
extern "C" kvmix_result kvmix_cuda_view_intent_workspace_bytes(int32_t n_q_heads,
                                                               int32_t capacity_tokens,
                                                               size_t *out_bytes) {
    if (!out_bytes) return KVMIX_ERR_NULL_POINTER;
    if (n_q_heads <= 0 || capacity_tokens < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    *out_bytes = (((size_t)n_q_heads * ((size_t)capacity_tokens + 2) * 4) + 255) & ~(size_t)255;
    return KVMIX_SUCCESS;
}

extern "C" kvmix_result kvmix_cuda_view_intent_score(const kvmix_view *view, int32_t seq,
                                                     int32_t n_q_heads, float scale,
                                                     const float *memory, float *scores,
                                                     int32_t capacity_tokens, void *workspace,
                                                     size_t workspace_bytes, kvmix_stream stream) {
    return kvmix_cuda_view_intent_score_seqs(view, seq, 1, n_q_heads, scale, memory, 0, scores,
                                             capacity_tokens, workspace, workspace_bytes, stream);
}

/* Sequences p.seq .. p.seq + n - 1 (n within a grid's y dimension): each one's part_bytes of the
   workspace (p.scores) hold its logits, then its (max, sum) per head. */
static void kvmix__intent_launch(kvmix__view_params p, int32_t n, float scale, float *scores,
                                 size_t part_bytes, cudaStream_t st) {
    const int64_t stride = (int64_t)(part_bytes / sizeof(float)), n_floats = stride * n;
    const unsigned fill_blocks = (unsigned)(n_floats / 256 + 1 < 4096 ? n_floats / 256 + 1 : 4096);
    kvmix__fill_kernel<<<fill_blocks, 256, 0, st>>>(p.scores, n_floats, -INFINITY);
    p.scores_stride = stride;
    const unsigned tiles =
        (unsigned)((p.capacity + kvmix__view_tile_tokens - 1) / kvmix__view_tile_tokens);
    const int staged_floats = p.n_q_heads * p.head_dim; /* FP16 rows' memory in shared memory */
    const bool staged = staged_floats <= kvmix__intent_smem_floats;
    kvmix__intent_logits_kernel<<<dim3(tiles, (unsigned)n), 256,
                                  staged ? (size_t)staged_floats * sizeof(float) : 0, st>>>(
        p, scale, staged);
    kvmix__intent_norm_kernel<<<dim3((unsigned)p.n_q_heads, (unsigned)n), 256, 0, st>>>(
        p.scores, p.capacity, stride);
    kvmix__intent_sum_kernel<<<dim3((unsigned)((p.capacity + 255) / 256), (unsigned)n), 256, 0,
                               st>>>(p.scores, p.n_q_heads, p.capacity, stride, scores);
}

extern "C" kvmix_result
kvmix_cuda_view_intent_score_seqs(const kvmix_view *view, int32_t first_seq, int32_t n_seqs,
                                  int32_t n_q_heads, float scale, const float *memory,
                                  int64_t memory_stride, float *scores, int32_t capacity_tokens,
                                  void *workspace, size_t workspace_bytes, kvmix_stream stream) {
    kvmix_result r = kvmix__check_device_view(view);
    if (r != KVMIX_SUCCESS) return r;
    if (first_seq < 0 || n_seqs < 0 || first_seq > view->n_seqs - n_seqs || capacity_tokens < 0 ||
        n_q_heads <= 0 || n_q_heads % view->n_kv_heads != 0 || memory_stride < 0 ||
        !(scale >= 0.0f) || isinf(scale))
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (capacity_tokens == 0 || n_seqs == 0) return KVMIX_SUCCESS;
    if (!memory || !scores || !workspace) return KVMIX_ERR_NULL_POINTER;
    size_t part;
    kvmix_cuda_view_intent_workspace_bytes(n_q_heads, capacity_tokens, &part);
    if (workspace_bytes / part < (size_t)n_seqs) return KVMIX_ERR_BUFFER_TOO_SMALL;
    kvmix__view_params p = kvmix__view_params_of(view, first_seq);
    p.capacity = capacity_tokens, p.n_q_heads = n_q_heads, p.memory_stride = memory_stride;
    if (scale == 0.0f) scale = 1.0f / sqrtf((float)view->head_dim);
    const int32_t grid_y = 65535;
    for (int32_t i = 0; i < n_seqs; i += grid_y) {
        p.seq = first_seq + i, p.memory = memory + i * memory_stride;
        p.scores = (float *)((char *)workspace + (size_t)i * part);
        kvmix__intent_launch(p, n_seqs - i < grid_y ? n_seqs - i : grid_y, scale,
                             scores + (size_t)i * capacity_tokens, part, (cudaStream_t)stream);
    }
    return kvmix__launch_status();
}

// >>decode  decode attention on tensor cores, and the merge of splits

namespace {

struct kvmix__decode_params {
    const uint8_t *base;
    uint64_t base_bytes;
    const kvmix_view_span *spans;
    const int32_t *seq_first_span;
    const uint8_t *dead;
    int n_spans, n_dead_flags, n_seqs, n_kv_heads, n_q_heads, q_per_kv, q_chunks, group_size;
    int n_boost, n_splits, dtype;
    float scale_log2; /* softmax scale * log2(e) */
    const uint16_t *q;
    float *part_out; /* [n_seqs][n_splits][n_q_heads][head_dim], normalized */
    float *part_lse; /* [n_seqs][n_splits][n_q_heads], log2 domain */
    uint16_t *out;   /* one split: the block writes out and lse itself (no merge launch) */
    float *lse;
};

/* ---- decode attention on tensor cores (mma.sync tiles, K/V staged by bulk copies) ------------

   Per warp: tiles of 16 tokens of one kv head against up to 4 query heads, with
   mma.sync.m16n8k16 (f16 inputs, f32 accumulators). The 8 columns of every B operand hold
   4 query heads x (hi, lo): an fp32 value v is carried as hi = fp16(v) and lo = fp16(v - hi),
   so each product is computed to ~22 bits and the two columns are summed in fp32 afterwards.
     logits   S^T[16 tokens x 8] += K[16 tokens x 16 dims] * B[16 dims x 8]
     output   O^T[16 dims x 8]   += V^T[16 dims x 16 tokens] * P^T[16 tokens x 8]
   Codes become fp16 exactly (code | 0x6400 is 1024 + code). Per-channel keys (2-bit codes)
   take the integer mma instead (m16n8k32, u8 codes against s8 digits, s32 accumulators): q times
   the channel scale is folded into B as four int8 digits under one power of two per head and
   page (kvmix__tc_chan_b), the minima into one constant per head. Per-token (scale, min) pairs are
   applied exactly: INT2 / INT4 scales lie on kvmix.h's scale grid, so code * scale is one exact
   fp16 product; INT8 takes code * scale = hi + lo in fp16 (two mmas). The minima go through one
   more small mma (keys: k = groups; values: rows = the lane's group). Boosted keys' high bits are one
   more mma over the boosted slots (B = 4 * q * scale of the slot's channel).

   Fragment geometry (lane L, r = L / 4, c = L % 4):
     QK A rows r, r + 8 = tokens r, r + 8 of the tile; lane c owns dims [c*D/4, (c+1)*D/4) of both
        rows, in 16-dim chunks; k-step j uses chunk j / 4, pairs (2v, 2v+8) and (2v+1, 2v+9),
        v = j % 4 (see kvmix__tc_kdim).
     PV A rows of m-tile i: row r = dim r*D/8 + 2i, row r + 8 = dim r*D/8 + 2i + 1; k = tokens
        2c, 2c+1, 2c+8, 2c+9; lane r owns dims [r*D/8, (r+1)*D/8) of its four tokens.
     C (both): lane holds rows r, r + 8 and columns 2c (hi), 2c+1 (lo) = query head c.
     Per-channel QK (m16n8k32): k-step s of 32 dims takes word s / 2 of the lane's D/4 codes of
        each row; a0 / a2 = its codes j, j + 4, j + 8, j + 12 as bytes, j = 2 (s % 2) / + 1.
   P moves from the C layout of S^T to the B layout of P^T with movmatrix.trans. */

constexpr int kvmix__tc_warps = 4;
constexpr float kvmix__ln2 = 0.69314718055994531f; /* the kernels' lse is log2; out's is natural */

__device__ __forceinline__ void kvmix__mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                           uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
/* C += A * B over k = 32: A u8 (codes), B s8 (digits), C s32 (exact). */
__device__ __forceinline__ void kvmix__imma(int32_t (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                            uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
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
/* (x & mask) | 0x6400 per half is 1024 + code * 2^k (one lop3); a * x + b gives the code exactly. */
__device__ __forceinline__ uint32_t kvmix__code(uint32_t x, uint32_t mask, uint32_t a, uint32_t b) {
    uint32_t y;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(y) : "r"(x), "r"(mask), "r"(0x64006400u));
    return kvmix__h2u(__hfma2(kvmix__u2h(y), kvmix__u2h(a), kvmix__u2h(b)));
}
/* 2^x for the online softmax (x <= 8; results under 2^-126 flush to 0). */
__device__ __forceinline__ float kvmix__ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
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
__device__ __forceinline__ uint32_t kvmix__split2(float v) { /* (hi, lo) of v */
    __half h = __float2half_rn(v);
    return kvmix__h2u(__halves2half2(h, __float2half_rn(v - __half2float(h))));
}
/* hi (part 0) or lo (part 1) halves of the two-term fp16 splits of a (low 16 bits) and b. */
__device__ __forceinline__ uint32_t kvmix__split_pair(float a, float b, int part) {
    const __half2 hi = __floats2half2_rn(a, b);
    if (!part) return kvmix__h2u(hi);
    const float2 f = __half22float2(hi);
    return kvmix__h2u(__floats2half2_rn(a - f.x, b - f.y));
}

template <int NW> __device__ __forceinline__ void kvmix__ldw(const uint8_t *p, uint32_t *w) {
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
template <int D> __device__ __forceinline__ int kvmix__tc_kdim(int c, int j, int e) {
    int base = c * (D / 4) + 16 * (j / 4), v = j % 4;
    return base + 2 * v + (e & 1) * 8 + (e >> 1);
}

/* Staging: each warp owns two stage buffers of kvmix__tc_cfg<D>::stage bytes in dynamic shared
   memory. A unit (up to 128 tokens of one span, fewer for wide formats so that it fits) is copied
   there in 16-byte words (bulk copies; zero-filled past the block's end) while the warp computes
   the previous unit from the other buffer. The regions of a unit (kvmix__tc_layout), each starting
   at a 16-byte boundary plus the source's misalignment: K rows, K high rows and boost index
   (boosted), K meta (per-token rows or per-channel table), scratch for the boosted-key B operand
   and slot->channel table, then the same for V. A unit with per-channel keys that covers its span
   is instead one copy per block, in the block's own layout. */
/* The decode kernel's tuned constants, chosen on an H100 (bench/DECODE_NOTES.md): stage bytes and
   blocks per SM at D 64 and 128, and the waves of blocks kvmix_cuda_decode_choose_splits aims for.
   A stage of 12.5 KiB holds a 128-token page of boosted keys with a quarter of D 128's channels
   boosted and INT2 values in groups of 32 in one unit (12 KiB took two units: 1.6-1.75x slower,
   DECODE_NOTES.md v24); at 2 blocks per SM, 4 warps' double buffers and the static part take 219
   KiB of the SM's 228. */
constexpr int kvmix__tc_stage_bytes = 12800;
constexpr int kvmix__tc_blocks_per_sm = 2;
constexpr int kvmix__split_waves = 1;
template <int D, bool SMALL = false> struct kvmix__tc_cfg {
    /* a stage holds 16 tokens of every format pair (FP16 keys and values: 64 * D bytes, plus the
       misalignment of each region); D 256 needs more than 12.5 KiB for that, and so runs one block
       per SM with 24 KiB stages (bench/DECODE_NOTES.md, v14). SMALL: stages for devices whose
       block holds less shared memory than Hopper's 227 KiB: with the static part, 4 warps'
       double buffers fit the 99 KiB of Ada and consumer Ampere at D 64 and 128 (11 KiB: a
       128-token page of INT2 keys and values in one unit), and A100's 163 KiB at D 256
       (DECODE_NOTES.md, v23) */
    static constexpr int stage =
        SMALL ? (D == 256 ? 18432 : 11264) : (D == 256 ? 24576 : kvmix__tc_stage_bytes);
    static constexpr int min_blocks = D == 256 || SMALL ? 1 : kvmix__tc_blocks_per_sm;
    static constexpr int dyn_bytes = 2 * kvmix__tc_warps * stage;
    static_assert(stage >= 64 * D + 64, "a stage must hold 16 tokens of FP16 keys and values");
};

constexpr int kvmix__tc_threads = kvmix__tc_warps * 32;
constexpr int kvmix__tc_min_group = 16; /* decode's smallest group (kvmix_cuda_decode) */

struct kvmix__tc_plan { /* spans of one walk chunk (index = thread of the block) */
    uint64_t koff[kvmix__tc_threads],
        voff[kvmix__tc_threads]; /* to the kv head's key / value block */
    int ntok[kvmix__tc_threads], ut[kvmix__tc_threads], dead[kvmix__tc_threads];
    int ub[kvmix__tc_threads], ue[kvmix__tc_threads];
    uint8_t kf[kvmix__tc_threads], vf[kvmix__tc_threads];
};

/* Index of (head h, dim d) in kvmix__tc_smem::q: dim-major with the 4 heads inner and one pad
   word quad after every 32 dims, so that the lanes building a B operand (head r / 2, dims 32
   apart across c) hit 16 different banks instead of one. */
__device__ __forceinline__ int kvmix__qi(int h, int d) { return ((d + (d >> 5)) << 2) + h; }
/* kvmix__qi(h, d0 + off) - kvmix__qi(h, d0) for a compile-time off, where d0 % 32 + off % 32 < 32
   (d0 a multiple of 32, or of 16 with off < 16, or d0 < 8 with off a multiple of 8) */
__host__ __device__ constexpr int kvmix__qi_step(int off) { return (off + (off >> 5)) << 2; }

template <int D> struct kvmix__tc_smem {
    static_assert(D <= 256, "qsum holds every group of a head of at most 256 dims");
    float q[4 * (D + D / 32)]; /* query * scale * log2(e), 0 for unused head slots; at kvmix__qi */
    float qsum[4][256 / kvmix__tc_min_group]; /* per-token keys: sum of q over each group */
    uint2 bq[D / 16][32]; /* B of the logits for every non-channel key format (lane fragments) */
    kvmix__tc_plan plan;
    int64_t scratch[32];
    uint64_t bar[kvmix__tc_warps][2]; /* mbarriers of the warps' stage buffers */
    int error;
};

template <int D> struct kvmix__tc_merge { /* aliases the stage buffers after the walk */
    float acc[kvmix__tc_warps][4][D];
    float m[kvmix__tc_warps][4], l[kvmix__tc_warps][4];
};

template <int D> struct kvmix__tc_state {
    float o[D / 16][4];
    float om[4], om2[4]; /* per-token value minima (om2: the lane's second group, D/8 > G) */
    float m, l;
};

/* kvmix__block_sections in 32 bits (a block lies inside its head stride, a uint32), with D known
   at compile time: the per-unit arithmetic of the walk. The one place the rule is written again:
   calling the shared function (or a 32-bit twin of it) here measured 3-5% slower on the INT2
   mixes (bench/DECODE_NOTES.md); the decode tests check every format against the reference. */
struct kvmix__tsec {
    uint32_t row_bytes, high_row_bytes, high_offset, meta_offset, index_offset, total_bytes;
};

template <int D>
__device__ __forceinline__ kvmix__tsec kvmix__tc_sections(int format, uint32_t n, int group,
                                                          int n_boost) {
    kvmix__tsec s;
    const bool boosted = format == KVMIX_FORMAT_BOOSTED;
    s.row_bytes = (uint32_t)(D * kvmix__format_bits(format) / 8);
    s.high_row_bytes = boosted ? (uint32_t)n_boost / 4 : 0u;
    s.high_offset = n * s.row_bytes;
    s.meta_offset = s.high_offset + n * s.high_row_bytes;
    if (format == KVMIX_FORMAT_FP16)
        s.index_offset = s.meta_offset;
    else if (kvmix__is_per_token_int(format))
        s.index_offset = s.meta_offset + n * (uint32_t)(D / group) * 4u;
    else
        s.index_offset = s.meta_offset + D * 4u;
    s.total_bytes = s.index_offset + (boosted ? (uint32_t)D : 0u);
    return s;
}

/* Stage offsets of a block's regions in a unit (0 where the format has none). */
struct kvmix__tc_block {
    int rows, high, meta, index;
};
struct kvmix__tc_regions {
    kvmix__tc_block k, v;
    int b2, sl, end; /* boosted keys: B scratch and slot->channel table; the unit's stage bytes */
};

__device__ __forceinline__ void kvmix__cp_async(uint32_t dst, const void *src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void kvmix__cp_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void kvmix__cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
/* Stage buffers. The Hopper path (KVMIX__BULK: built for sm_90 or sm_90a) fills them with bulk
   copies (the copy engine, one instruction per region) that complete on an mbarrier per buffer;
   partial words at a block's end go through cp.async. The portable path (every other target:
   Ampere, Ada, Blackwell; and a Hopper device running compute_80 PTX) copies every word with
   cp.async, and the cp.async group wait before a buffer is read is all its completion needs:
   the mbarrier calls below are empty there. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define KVMIX__BULK 1
#else
#define KVMIX__BULK 0
#endif
__device__ __forceinline__ void kvmix__bar_init(uint32_t bar) {
#if KVMIX__BULK
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
    (void)bar;
#endif
}
#if KVMIX__BULK
__device__ __forceinline__ void kvmix__bar_expect(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
}
#endif
__device__ __forceinline__ void kvmix__bar_arrive(uint32_t bar) {
#if KVMIX__BULK
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}" ::"r"(bar)
                 : "memory");
#else
    (void)bar;
#endif
}
__device__ __forceinline__ void kvmix__bar_wait(uint32_t bar, uint32_t parity) {
#if KVMIX__BULK
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
#else
    (void)bar, (void)parity;
#endif
}
#if KVMIX__BULK
__device__ __forceinline__ void kvmix__bulk_copy(uint32_t dst, const void *src, uint32_t bytes,
                                                 uint32_t bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
        "[%3];" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}
#endif
/* Orders the warp's earlier shared-memory reads of a stage before the copy engine rewrites it. */
__device__ __forceinline__ void kvmix__fence_proxy_async() {
#if KVMIX__BULK
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
/* Programmatic dependent launch (sm_90): the decode grid lets the merge launch early, and the
   merge waits for the decode grid's results. Without it (the portable path) the merge is an
   ordinary launch after the decode grid, and both are empty. */
__device__ __forceinline__ void kvmix__launch_dependents() {
#if KVMIX__BULK
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void kvmix__wait_primary() {
#if KVMIX__BULK
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* A stage buffer and its mbarrier (shared addresses). */
struct kvmix__tc_dst {
    uint32_t stage, bar;
};

/* Copies `words` 16-byte words from g to the shared address dst, zero-filling past the `avail`
   bytes that g's block holds from g on: the whole words in one bulk copy by lane 0 (completing
   on bar), the rest by cp.async. Not inlined: one copy of this code serves every region of every
   format pair and stays in the instruction cache. */
static __device__ __noinline__ void kvmix__tc_copy(uint32_t dst, uint32_t bar, const uint8_t *g,
                                                   int words, uint32_t avail, int lane) {
#if KVMIX__BULK
    const int whole = min(words, (int)(avail >> 4));
    if (whole > 0 && lane == 0) {
        kvmix__bar_expect(bar, 16u * (uint32_t)whole);
        kvmix__bulk_copy(dst, g, 16u * (uint32_t)whole, bar);
    }
#else
    const int whole = 0;
    (void)bar;
#endif
    for (int i = whole + lane; i < words; i += 32) {
        const uint32_t rel = 16u * (uint32_t)i;
        const int n = avail > rel ? (int)min(16u, avail - rel) : 0;
        kvmix__cp_async(dst + rel, g + rel, n);
    }
}

/* Places a region of len bytes whose source is at block offset src; with COPY, the warp copies
   it (the 16-byte words covering it, never past the block's total bytes). worst: assume the
   largest misalignment (for sizing). Returns the stage offset of the region's first byte. */
template <bool COPY>
__device__ __forceinline__ int kvmix__tc_put(int &off, uint32_t src, int len, bool worst,
                                             kvmix__tc_dst dst, const uint8_t *blk, uint32_t total,
                                             int lane) {
    const int delta = worst ? 15 : (int)(src & 15u);
    const int pos = off + delta, words = (delta + len + 15) >> 4;
    if constexpr (COPY)
        kvmix__tc_copy(dst.stage + (uint32_t)off, dst.bar, blk + (src & ~15u), words,
                       total - (src & ~15u), lane);
    off += words << 4;
    return pos;
}

/* The regions of tokens [a, a + n) of a block of format f (sections s). whole: the unit covers the
   block, which is copied in one piece with its regions at their block offsets; else each region
   (rows, high rows and boost index, meta: per-token rows or per-channel table) is placed and
   copied on its own. COPY issues the copies; worst sizes the regions for any misalignment. */
template <int D, bool COPY>
__device__ __forceinline__ kvmix__tc_block kvmix__tc_place(int f, const kvmix__tsec &s, int a,
                                                           int n, bool whole, int NG, bool worst,
                                                           int &off, kvmix__tc_dst dst,
                                                           const uint8_t *blk, int lane) {
    kvmix__tc_block b;
    if (whole) {
        const int words = (int)(s.total_bytes + 15u) >> 4;
        if constexpr (COPY)
            kvmix__tc_copy(dst.stage + (uint32_t)off, dst.bar, blk, words, s.total_bytes, lane);
        b.rows = off, b.high = off + (int)s.high_offset, b.meta = off + (int)s.meta_offset;
        b.index = off + (int)s.index_offset;
        off += words << 4;
        return b;
    }
    /* per-token regions hold whole 16-token tiles: the rows past n are the block's next bytes or
       zeros, finite either way (the tile loop reads them unclamped; their p is 0) */
    const int n16 = (n + 15) & ~15;
    const uint32_t total = s.total_bytes;
    b.high = b.meta = b.index = 0;
    b.rows = kvmix__tc_put<COPY>(off, (uint32_t)a * s.row_bytes, n16 * (int)s.row_bytes, false, dst,
                                 blk, total, lane);
    if (f == KVMIX_FORMAT_BOOSTED) {
        b.high = kvmix__tc_put<COPY>(off, s.high_offset + (uint32_t)a * s.high_row_bytes,
                                     n16 * (int)s.high_row_bytes, worst, dst, blk, total, lane);
        b.index = kvmix__tc_put<COPY>(off, s.index_offset, D, worst, dst, blk, total, lane);
    }
    if (kvmix__is_per_token_int(f))
        b.meta = kvmix__tc_put<COPY>(off, s.meta_offset + (uint32_t)(a * NG * 4), n16 * NG * 4,
                                     worst, dst, blk, total, lane);
    else if (kvmix__is_per_channel(f))
        b.meta = kvmix__tc_put<COPY>(off, s.meta_offset, D * 4, worst, dst, blk, total, lane);
    return b;
}

/* The regions of tokens [a, a + n) of a span of ntok tokens (sections ks, vs): the key block's,
   scratch for the boosted-key B operand and slot->channel table, the value block's. */
template <int D, bool COPY>
__device__ __forceinline__ kvmix__tc_regions kvmix__tc_layout(
    int kf, int vf, const kvmix__tsec &ks, const kvmix__tsec &vs, int a, int n, int ntok, int G,
    int nb, bool worst, kvmix__tc_dst dst, const uint8_t *kblk, const uint8_t *vblk, int lane) {
    kvmix__tc_regions g;
    int off = 0;
    const int NG = D / G;
    /* units of spans with per-channel keys are whole pages unless a split cuts them; other units
       are smaller than a page, and the test alone costs them ~1% (bench/DECODE_NOTES.md) */
    const bool whole = !worst && kvmix__is_per_channel(kf) && a == 0 && n == ntok && n % 16 == 0;
    g.k = kvmix__tc_place<D, COPY>(kf, ks, a, n, whole, NG, worst, off, dst, kblk, lane);
    g.b2 = g.sl = 0;
    if (kf == KVMIX_FORMAT_BOOSTED) {
        g.b2 = off;
        off += ((nb + 15) / 16) * 256;
        g.sl = off;
        off += D;
    }
    g.v = kvmix__tc_place<D, COPY>(vf, vs, a, n, whole, NG, worst, off, dst, vblk, lane);
    g.end = off;
    return g;
}

/* Tokens per unit of a format pair: the largest multiple of 16 (at most 128) that fits a stage. */
template <int D, int STAGE>
__device__ inline int kvmix__tc_unit_tokens(int kf, int vf, int ntok, int G, int nb) {
    const kvmix__tsec ks = kvmix__tc_sections<D>(kf, (uint32_t)ntok, G, nb);
    const kvmix__tsec vs = kvmix__tc_sections<D>(vf, (uint32_t)ntok, G, nb);
    int n = 128;
    while (n > 16 && kvmix__tc_layout<D, false>(kf, vf, ks, vs, 0, n, ntok, G, nb, true, {},
                                                nullptr, nullptr, 0)
                             .end > STAGE)
        n -= 16;
    return n;
}

__device__ __forceinline__ uint32_t kvmix__lds32(const uint8_t *p) { return *(const uint32_t *)p; }
/* NW (1, 2 or 4) words of shared memory at p (aligned to 4 * NW bytes) in one load. */
template <int NW> __device__ __forceinline__ void kvmix__lds_words(const uint8_t *p, uint32_t *w) {
    if constexpr (NW == 4) {
        const uint4 x = *(const uint4 *)p;
        w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
    } else if constexpr (NW == 2) {
        const uint2 x = *(const uint2 *)p;
        w[0] = x.x, w[1] = x.y;
    } else {
        w[0] = kvmix__lds32(p);
    }
}
__device__ __forceinline__ uint32_t kvmix__lds16(const uint8_t *p) { return *(const uint16_t *)p; }

/* Rows of K (per lane: its D/4 dims of tokens r and r+8) -> A registers of one 16-dim chunk:
   R[k] = (dim k, dim k + 8) of the chunk, k < 8, as exact fp16 codes (or fp16 values). */
template <int KF> __device__ __forceinline__ void kvmix__tc_kchunk(const uint32_t *w, uint32_t *R) {
    if constexpr (KF == KVMIX_FORMAT_FP16) {
#pragma unroll
        for (int k = 0; k < 8; k++)
            R[k] = kvmix__prmt(w[k / 2], w[4 + k / 2], (k & 1) ? 0x7632u : 0x5410u);
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

/* V words of two tokens (lane's D/8 dims each) -> R[k] = (token a dim k, token b dim k).
   INT2 / INT4: slo / shi are the byte selectors 0x5410 / 0x7632, or 0x1054 / 0x3276 when the
   lane loaded the two tokens in swapped order (bank-conflict swizzle of the V loads). */
template <int VF, int DV>
__device__ __forceinline__ void kvmix__tc_vpair(const uint32_t *a, const uint32_t *b, uint32_t *R,
                                                uint32_t slo = 0x5410u, uint32_t shi = 0x7632u) {
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
            kvmix__codes4(kvmix__prmt(a[k], b[k], slo), R + 8 * k);
            kvmix__codes4(kvmix__prmt(a[k], b[k], shi), R + 8 * k + 4);
        }
    } else {
        if constexpr (DV == 8) {
            kvmix__codes2(kvmix__prmt(a[0], b[0], slo), R);
        } else {
#pragma unroll
            for (int k = 0; k < DV / 16; k++) {
                kvmix__codes2(kvmix__prmt(a[k], b[k], slo), R + 16 * k);
                kvmix__codes2(kvmix__prmt(a[k], b[k], shi), R + 16 * k + 8);
            }
        }
    }
}

/* 16 bytes from shared memory, or from global memory (GL: FP16 spans read in place). */
template <bool GL> __device__ __forceinline__ uint4 kvmix__ld16(const uint8_t *p) {
    if constexpr (GL)
        return __ldg((const uint4 *)p);
    else
        return *(const uint4 *)p;
}

/* A registers of 16-dim chunk ch of a K row segment (the lane's D/4 dims) in shared memory. */
template <bool GL>
__device__ __forceinline__ void kvmix__tc_kload(int kf, const uint8_t *row, int ch, uint32_t *R) {
    if (kf == KVMIX_FORMAT_FP16) {
        uint4 x = kvmix__ld16<GL>(row + ch * 32), y = kvmix__ld16<GL>(row + ch * 32 + 16);
        uint32_t w[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
        kvmix__tc_kchunk<KVMIX_FORMAT_FP16>(w, R);
    } else if (kf == KVMIX_FORMAT_INT8) {
        uint4 x = *(const uint4 *)(row + ch * 16);
        uint32_t w[4] = {x.x, x.y, x.z, x.w};
        kvmix__tc_kchunk<KVMIX_FORMAT_INT8>(w, R);
    } else if (kf == KVMIX_FORMAT_INT4) {
        uint2 x = *(const uint2 *)(row + ch * 8);
        uint32_t w[2] = {x.x, x.y};
        kvmix__tc_kchunk<KVMIX_FORMAT_INT4>(w, R);
    } else {
        uint32_t w = kvmix__lds32(row + ch * 4);
        kvmix__tc_kchunk<KVMIX_FORMAT_INT2>(&w, R);
    }
}

/* The lane's D/8 dims of one V row (bytes = DV * bits / 8) into w. */
template <int DV, bool GL>
__device__ __forceinline__ void kvmix__tc_vload(int vb, const uint8_t *src, uint32_t *w) {
    const int bytes = DV * vb / 8;
    if (bytes == 2) {
        w[0] = kvmix__lds16(src);
    } else if (bytes == 4) {
        w[0] = kvmix__lds32(src);
    } else if (bytes == 8) {
        uint2 x = *(const uint2 *)src;
        w[0] = x.x, w[1] = x.y;
    } else {
#pragma unroll
        for (int i = 0; i < DV / 8; i++) { /* DV * 16 / 8 bytes at most: DV / 8 words of 16 bytes */
            if (16 * i < bytes) {
                uint4 x = kvmix__ld16<GL>(src + 16 * i);
                w[4 * i] = x.x, w[4 * i + 1] = x.y, w[4 * i + 2] = x.z, w[4 * i + 3] = x.w;
            }
        }
    }
}

template <int DV>
__device__ __forceinline__ void kvmix__tc_vconv(int vf, const uint32_t *a, const uint32_t *b,
                                                uint32_t *R, uint32_t slo, uint32_t shi) {
    if (vf == KVMIX_FORMAT_FP16)
        kvmix__tc_vpair<KVMIX_FORMAT_FP16, DV>(a, b, R);
    else if (vf == KVMIX_FORMAT_INT8)
        kvmix__tc_vpair<KVMIX_FORMAT_INT8, DV>(a, b, R);
    else if (vf == KVMIX_FORMAT_INT4)
        kvmix__tc_vpair<KVMIX_FORMAT_INT4, DV>(a, b, R, slo, shi);
    else
        kvmix__tc_vpair<KVMIX_FORMAT_INT2, DV>(a, b, R, slo, shi);
}

/* Per-channel keys: B of the integer logits mma for this unit, from the staged channel table KM
   ((scale, minimum) fp16 pairs). x = q * scale of head h is carried as round(x * 2^z) (at most
   2^20, z per head and unit from the largest |x|) = 2^14 d0 + 2^7 d1 + d2 (d0 signed, d1 and d2
   in 0..127), plus the residual as d3 / 128: ~27 bits against the largest, past fp32's 24.
   Columns of the two mmas per k-step: (2h, 2h + 1) = (d0, d1), then (d2, d3). Lane (c, r): head
   h = r / 2, digits r % 2 and 2 + r % 2, dims of lane slot c. Lanes r and r ^ 1 (lane ^ 4) need
   the same products: each computes the k-steps s with s % 2 = r % 2, all four digits, and passes
   its partner the two it needs. Sets bk[2s + m][b], fac (2^-z of head c) and kconst (sum over
   channels of q * minimum of head c; NaN where an x is not finite). */
template <int D>
__device__ __forceinline__ void kvmix__tc_chan_b(const kvmix__tc_smem<D> &sm, const uint8_t *KM,
                                                 int lane, uint32_t (&bk)[D / 16][2], float &fac,
                                                 float &kconst) {
    constexpr int DQ = D / 4, MY = D / 64; /* k-steps of 32 dims: D / 32, half per lane */
    constexpr float magic = 12582912.0f;   /* 1.5 * 2^23: x + magic holds rint(x) in its low bits */
    const int r = lane >> 2, c = lane & 3, h = r >> 1, part = r & 1;
    const float *q0 = &sm.q[kvmix__qi(h, c * DQ)] + kvmix__qi_step(2 * part);
    const uint8_t *s0 = KM + (c * DQ + 2 * part) * 4;
    float x[MY][8], qmin = 0.0f;
    uint32_t mx = 0u; /* largest |x| as bits (inf and NaN above every finite value) */
#pragma unroll
    for (int i = 0; i < MY; i++)
#pragma unroll
        for (int t = 0; t < 4; t++) { /* dims 16i + 4t + b of k-step 2i + part, b < 2 */
            const int off = 16 * i + 4 * t;
#pragma unroll
            for (int b = 0; b < 2; b++) {
                const uint32_t sm2 = kvmix__lds32(s0 + (off + b) * 4); /* scale | minimum << 16 */
                const float qv = q0[kvmix__qi_step(off + b)];
                x[i][2 * t + b] = qv * kvmix__h2f((uint16_t)sm2);
                qmin += qv * kvmix__h2f((uint16_t)(sm2 >> 16));
                mx = max(mx, __float_as_uint(x[i][2 * t + b]) & 0x7fffffffu);
            }
        }
#pragma unroll
    for (int off = 1; off <= 4; off <<= 1) { /* the 8 lanes of head h */
        mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        qmin += __shfl_xor_sync(0xffffffffu, qmin, off);
    }
    /* |x| < 2^(E - 126): scale by 2^(146 - E) for |round| <= 2^20 (E >= 21 keeps both normal) */
    const uint32_t E = max(mx >> 23, 21u);
    const float S = __uint_as_float((273u - E) << 23);
    if (E == 255u) qmin = __int_as_float(0x7fffffff);
    fac = __shfl_sync(0xffffffffu, __uint_as_float((E - 19u) << 23), 8 * c); /* lane 8c: head c */
    kconst = __shfl_sync(0xffffffffu, qmin, 8 * c);
#pragma unroll
    for (int i = 0; i < MY; i++)
#pragma unroll
        for (int b = 0; b < 2; b++) {
            uint32_t u[4], v[4];
#pragma unroll
            for (int t = 0; t < 4; t++) {
                const float y = x[i][2 * t + b], t1 = fmaf(y, S, magic);
                u[t] = __float_as_uint(t1); /* bits 0..21: round(y * S), two's complement */
                v[t] = __float_as_uint(fmaf(fmaf(y, S, magic - t1), 128.0f, magic));
            }
            const uint32_t h01 = kvmix__prmt(u[0], u[1], 0x5410u),
                           h23 = kvmix__prmt(u[2], u[3], 0x5410u);
            const uint32_t k01 = kvmix__prmt(u[0], u[1], 0x6521u),
                           k23 = kvmix__prmt(u[2], u[3], 0x6521u);
            uint32_t d[4];
            d[0] = kvmix__prmt(k01 << 2, k23 << 2, 0x7531u);               /* bits 14..21 */
            d[1] = kvmix__prmt(h01 << 1, h23 << 1, 0x7531u) & 0x7f7f7f7fu; /* bits 7..13 */
            d[2] = kvmix__prmt(h01, h23, 0x6420u) & 0x7f7f7f7fu;           /* bits 0..6 */
            d[3] = kvmix__prmt(kvmix__prmt(v[0], v[1], 0x0040u), kvmix__prmt(v[2], v[3], 0x0040u),
                               0x5410u);
            const uint32_t keep_a = part ? d[1] : d[0], keep_b = part ? d[3] : d[2];
            const uint32_t got_a = __shfl_xor_sync(0xffffffffu, part ? d[0] : d[1], 4);
            const uint32_t got_b = __shfl_xor_sync(0xffffffffu, part ? d[2] : d[3], 4);
            bk[4 * i][b] = part ? got_a : keep_a; /* k-step 2i */
            bk[4 * i + 1][b] = part ? got_b : keep_b;
            bk[4 * i + 2][b] = part ? keep_a : got_a; /* k-step 2i + 1 */
            bk[4 * i + 3][b] = part ? keep_b : got_b;
        }
}

/* B of the logits, lane (slot c, column r): head r / 2, part r % 2 (per-channel keys:
   kvmix__tc_chan_b, with kfac = 2^-z and kconst = sum of q * min of head c); per-token keys also
   B of the minima mma (k = group 4c + e). */
template <int D>
__device__ __forceinline__ void
kvmix__tc_key_b(kvmix__tc_smem<D> &sm, const uint8_t *KM, bool k_chan, bool k_tok, int NG, int lane,
                uint32_t (&bk)[D / 16][2], uint32_t (&bm)[2], float &kfac, float &kconst) {
    const int r = lane >> 2, c = lane & 3;
    if (k_chan) {
        kvmix__tc_chan_b<D>(sm, KM, lane, bk, kfac, kconst);
    } else {
#pragma unroll
        for (int j = 0; j < D / 16; j++) {
            uint2 b = sm.bq[j][lane];
            bk[j][0] = b.x, bk[j][1] = b.y;
        }
    }
    if (k_tok) {
        const int h = r >> 1, part = r & 1;
        float e[4];
#pragma unroll
        for (int x = 0; x < 4; x++) {
            int g = 4 * c + x;
            e[x] = g < NG ? sm.qsum[h][g] : 0.0f;
        }
        bm[0] = kvmix__split_pair(e[0], e[1], part);
        bm[1] = kvmix__split_pair(e[2], e[3], part);
    }
}

/* Boosted keys: B of the high bits' mma at b2, from a slot -> channel table built in the unit's
   scratch; returns the k-steps over the slots. */
template <int D>
__device__ __forceinline__ int kvmix__tc_boost_b(const kvmix__tc_smem<D> &sm, uint8_t *stg,
                                                 const kvmix__tc_regions &rg, const uint8_t *KM,
                                                 int nb, int lane, uint2 *b2) {
    const int r = lane >> 2, c = lane & 3;
    uint8_t *slot_ch = stg + rg.sl;
    const int ks2 = (nb + 15) / 16;
    for (int d = lane; d < D; d += 32) {
        int s = stg[rg.k.index + d];
        if (s < nb) slot_ch[s] = (uint8_t)d;
    }
    __syncwarp();
    const int h = r >> 1, part = r & 1;
    for (int jb = 0; jb < ks2; jb++) {
        float e[4];
#pragma unroll
        for (int x = 0; x < 4; x++) {
            int s = 16 * jb + 4 * c + x;
            e[x] = 0.0f;
            if (s < nb) {
                int d = slot_ch[s] & (D - 1);
                e[x] =
                    4.0f * sm.q[kvmix__qi(h, d)] * kvmix__h2f((uint16_t)kvmix__lds16(KM + d * 4));
            }
        }
        b2[jb * 32 + lane] =
            make_uint2(kvmix__split_pair(e[0], e[1], part), kvmix__split_pair(e[2], e[3], part));
    }
    __syncwarp();
    return ks2;
}

/* Per-channel values after a unit: o += min * the sum of p over it (lsp, the lane's part). */
template <int D>
__device__ __forceinline__ void kvmix__tc_channel_minima(kvmix__tc_state<D> &st, const uint8_t *VM,
                                                         int lane, float lsp) {
    const int r = lane >> 2;
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) lsp += __shfl_xor_sync(0xffffffffu, lsp, off);
#pragma unroll
    for (int i = 0; i < D / 16; i++) {
        int d = r * (D / 8) + 2 * i;
        st.o[i][0] += lsp * kvmix__h2f((uint16_t)kvmix__lds16(VM + d * 4 + 2));
        st.o[i][2] += lsp * kvmix__h2f((uint16_t)kvmix__lds16(VM + (d + 1) * 4 + 2));
    }
}

/* One warp: tokens [a, a + n) of a span, staged at stg (regions rg). KFT / VFT: the key / value
   format when known at compile time, 0 for the generic path (formats kf_rt / vf_rt). GL: K and V
   rows are read in place from global memory at kg / vg (FP16 pairs: no staging). */
template <int D, int KFT, int VFT, bool GL = false>
__device__ __forceinline__ void
kvmix__tc_unit(kvmix__tc_state<D> &st, kvmix__tc_smem<D> &sm, const kvmix__decode_params &p,
               uint8_t *stg, const kvmix__tc_regions &rg, int kf_rt, int vf_rt,
               const kvmix__tsec &ks, const kvmix__tsec &vs, int n, const uint8_t *dead,
               const uint8_t *kg = nullptr, const uint8_t *vg = nullptr) {
    constexpr int KS = D / 16, DQ = D / 4, DV = D / 8;
    constexpr int NWV = DV / 2; /* V words per lane per token, FP16 (the widest) */
    const int kf = KFT ? KFT : kf_rt, vf = VFT ? VFT : vf_rt;
    const bool k_chan = kvmix__is_per_channel(kf), k_tok = kvmix__is_per_token_int(kf);
    const bool v_chan = kvmix__is_per_channel(vf), v_tok = kvmix__is_per_token_int(vf);
    const int KB = kvmix__format_bits(kf), VB = kvmix__format_bits(vf);
    /* per-token INT2 / INT4 scales lie on kvmix.h's scale grid: code * scale is exact in fp16 */
    const bool k_exact = k_tok && KB <= 4, v_exact = v_tok && VB <= 4;
    const int lane = threadIdx.x & 31, r = lane >> 2, c = lane & 3;
    const int G = p.group_size, NG = D / G;
    const int gsh = __ffs(G) - 1; /* G divides D (64, 128 or 256): a power of two */
    /* a value lane's dims span two groups: D 256 with G 16 (decode takes G a multiple of 16, so
       never below D 256) */
    const bool two = DV > 16 && DV > G;
    const uint32_t krow = D * KB / 8, vrow = D * VB / 8;
    const uint8_t *K = GL ? kg : stg + rg.k.rows, *KM = stg + rg.k.meta,
                  *V = GL ? vg : stg + rg.v.rows, *VM = stg + rg.v.meta;

    uint32_t bk[KS][2], bm[2] = {0u, 0u};
    float kconst = 0.0f, kfac = 0.0f;
    kvmix__tc_key_b<D>(sm, KM, k_chan, k_tok, NG, lane, bk, bm, kfac, kconst);
    uint2 *b2 = (uint2 *)(stg + rg.b2);
    const int ks2 =
        kf == KVMIX_FORMAT_BOOSTED ? kvmix__tc_boost_b<D>(sm, stg, rg, KM, p.n_boost, lane, b2) : 0;
    float lsp = 0.0f; /* per-channel values: sum of p over this unit (head c, lane partial) */
    const bool vswz = !GL && (VFT == KVMIX_FORMAT_INT2 || VFT == KVMIX_FORMAT_INT4);
    const uint32_t vslo = vswz && (c >> 1) ? 0x1054u : 0x5410u; /* vshi = vslo + 0x2222 */

    /* rows of the last tile past n: staged ones are read as they are (kvmix__tc_place), rows
       read in place are clamped */
    auto row = [n](int t) { return GL ? min(t, n - 1) : t; };
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int kr0 = row(t0 + r), kr1 = row(t0 + r + 8);
        int vt[4];
        vt[0] = row(t0 + 2 * c), vt[1] = row(t0 + 2 * c + 1);
        vt[2] = row(t0 + 2 * c + 8), vt[3] = row(t0 + 2 * c + 9);
        /* ---- values and meta first (shared memory loads, used after the softmax) ---- */
        /* INT2 / INT4 rows: lanes c >= 2 load the two tokens of each pair in swapped order, so that
           the four token rows a load instruction touches fall into different banks */
        uint32_t vw[4][NWV];
#pragma unroll
        for (int x = 0; x < 4; x++) {
            const int vx = vswz ? row(t0 + 2 * c + ((x & 1) ^ (c >> 1)) + 8 * (x >> 1)) : vt[x];
            kvmix__tc_vload<DV, GL>(VB, V + (uint32_t)vx * vrow + r * (DV * VB / 8), vw[x]);
        }
        uint32_t vmeta[4] = {0u, 0u, 0u, 0u}, vmeta2[4] = {0u, 0u, 0u, 0u};
        if (v_tok) {
            const int gv = (r * DV) >> gsh;
#pragma unroll
            for (int x = 0; x < 4; x++) {
                vmeta[x] = kvmix__lds32(VM + ((uint32_t)vt[x] * NG + gv) * 4);
                if (two) vmeta2[x] = kvmix__lds32(VM + ((uint32_t)vt[x] * NG + gv + 1) * 4);
            }
        }

        /* ---- logits ---- */
        /* four accumulators (k-step j adds to j % 4), so that consecutive mmas do not wait on
           each other; INT8 keys keep code * scale in [0] and its rounding error in [1] */
        float sacc[4][4] = {};
        int32_t ia[4][4] = {}; /* per-channel keys: digits (0, 1) then (2, 3), by k-step parity */
        const uint8_t *k0 = K + (uint32_t)kr0 * krow + c * (DQ * KB / 8);
        const uint8_t *k1 = K + (uint32_t)kr1 * krow + c * (DQ * KB / 8);
        if (k_chan) {
            uint32_t w0[DQ / 16], w1[DQ / 16]; /* the lane's 2-bit codes of rows kr0, kr1 */
            kvmix__lds_words<DQ / 16>(k0, w0);
            kvmix__lds_words<DQ / 16>(k1, w1);
#pragma unroll
            for (int s = 0; s < D / 32; s++) {
                const uint32_t x0 = w0[s >> 1] >> (4 * (s & 1)), x1 = w1[s >> 1] >> (4 * (s & 1));
                const uint32_t a0 = x0 & 0x03030303u, a1 = x1 & 0x03030303u;
                const uint32_t a2 = (x0 >> 2) & 0x03030303u, a3 = (x1 >> 2) & 0x03030303u;
                kvmix__imma(ia[s & 1], a0, a1, a2, a3, bk[2 * s][0], bk[2 * s][1]);
                kvmix__imma(ia[2 + (s & 1)], a0, a1, a2, a3, bk[2 * s + 1][0], bk[2 * s + 1][1]);
            }
        } else {
#pragma unroll
            for (int ch = 0; ch < KS / 4; ch++) {
                uint32_t R0[8], R1[8];
                kvmix__tc_kload<GL>(kf, k0, ch, R0);
                kvmix__tc_kload<GL>(kf, k1, ch, R1);
                if (k_tok) {
                    const int g = (c * DQ + 16 * ch) >> gsh;
                    uint32_t m0 = kvmix__lds32(KM + ((uint32_t)kr0 * NG + g) * 4);
                    uint32_t m1 = kvmix__lds32(KM + ((uint32_t)kr1 * NG + g) * 4);
                    __half2 s0 = kvmix__u2h(kvmix__prmt(m0, m0, 0x1010u));
                    __half2 s1 = kvmix__u2h(kvmix__prmt(m1, m1, 0x1010u));
#pragma unroll
                    for (int v = 0; v < 4; v++) {
                        __half2 a0 = __hmul2(kvmix__u2h(R0[2 * v]), s0),
                                a2 = __hmul2(kvmix__u2h(R0[2 * v + 1]), s0);
                        __half2 a1 = __hmul2(kvmix__u2h(R1[2 * v]), s1),
                                a3 = __hmul2(kvmix__u2h(R1[2 * v + 1]), s1);
                        const int j = 4 * ch + v;
                        float(&acc)[4] = sacc[k_exact ? v : 0];
                        kvmix__mma(acc, kvmix__h2u(a0), kvmix__h2u(a1), kvmix__h2u(a2),
                                   kvmix__h2u(a3), bk[j][0], bk[j][1]);
                        if (!k_exact) { /* the rounding error of code * scale, as a second product */
                            __half2 l0 = __hfma2(kvmix__u2h(R0[2 * v]), s0, __hneg2(a0));
                            __half2 l2 = __hfma2(kvmix__u2h(R0[2 * v + 1]), s0, __hneg2(a2));
                            __half2 l1 = __hfma2(kvmix__u2h(R1[2 * v]), s1, __hneg2(a1));
                            __half2 l3 = __hfma2(kvmix__u2h(R1[2 * v + 1]), s1, __hneg2(a3));
                            kvmix__mma(sacc[1], kvmix__h2u(l0), kvmix__h2u(l1), kvmix__h2u(l2),
                                       kvmix__h2u(l3), bk[j][0], bk[j][1]);
                        }
                    }
                } else {
#pragma unroll
                    for (int v = 0; v < 4; v++) {
                        const int j = 4 * ch + v;
                        kvmix__mma(sacc[v], R0[2 * v], R1[2 * v], R0[2 * v + 1], R1[2 * v + 1],
                                   bk[j][0], bk[j][1]);
                    }
                }
            }
        }
        if (k_tok) { /* minima: A[token][group] */
            uint32_t mn[2][4];
#pragma unroll
            for (int x = 0; x < 4; x++) {
                int g = 4 * c + x;
                mn[0][x] = g < NG ? kvmix__lds32(KM + ((uint32_t)kr0 * NG + g) * 4) : 0u;
                mn[1][x] = g < NG ? kvmix__lds32(KM + ((uint32_t)kr1 * NG + g) * 4) : 0u;
            }
            kvmix__mma(sacc[2], kvmix__prmt(mn[0][0], mn[0][1], 0x7632u),
                       kvmix__prmt(mn[1][0], mn[1][1], 0x7632u),
                       kvmix__prmt(mn[0][2], mn[0][3], 0x7632u),
                       kvmix__prmt(mn[1][2], mn[1][3], 0x7632u), bm[0], bm[1]);
        }
        if (kf == KVMIX_FORMAT_BOOSTED) { /* high bits of the boosted slots */
            const uint32_t hrow = (uint32_t)ks.high_row_bytes;
            const uint8_t *h0 = stg + rg.k.high + (uint32_t)kr0 * hrow;
            const uint8_t *h1 = stg + rg.k.high + (uint32_t)kr1 * hrow;
            for (int jb = 0; jb < ks2; jb++) {
                uint32_t bi = 4 * jb + c;
                uint32_t x0 = bi < hrow ? h0[bi] : 0u, x1 = bi < hrow ? h1[bi] : 0u;
                x0 |= x0 << 14, x1 |= x1 << 14;
                uint2 b = b2[jb * 32 + lane];
                kvmix__mma(sacc[3], kvmix__code(x0, 0x00030003u, 0x3C003C00u, 0xE400E400u),
                           kvmix__code(x1, 0x00030003u, 0x3C003C00u, 0xE400E400u),
                           kvmix__code(x0 >> 4, 0x00030003u, 0x3C003C00u, 0xE400E400u),
                           kvmix__code(x1 >> 4, 0x00030003u, 0x3C003C00u, 0xE400E400u), b.x, b.y);
            }
        }

        /* ---- online softmax (head c, tokens r and r + 8) ---- */
        float s0 = kconst, s1 = kconst;
        if (k_chan) { /* sum of digits: 2^14 d0 + 2^7 d1 + d2 exactly, then d3 / 128 */
            const int32_t u0 =
                (ia[0][0] + ia[1][0]) * 16384 + (ia[0][1] + ia[1][1]) * 128 + ia[2][0] + ia[3][0];
            const int32_t u1 =
                (ia[0][2] + ia[1][2]) * 16384 + (ia[0][3] + ia[1][3]) * 128 + ia[2][2] + ia[3][2];
            const float lofac = kfac * 0.0078125f;
            s0 = fmaf((float)u0, kfac, fmaf((float)(ia[2][1] + ia[3][1]), lofac, kconst));
            s1 = fmaf((float)u1, kfac, fmaf((float)(ia[2][3] + ia[3][3]), lofac, kconst));
            if (kf == KVMIX_FORMAT_BOOSTED)
                s0 += sacc[3][0] + sacc[3][1], s1 += sacc[3][2] + sacc[3][3];
        } else {
#pragma unroll
            for (int a = 0; a < 4; a++)
                s0 += sacc[a][0] + sacc[a][1], s1 += sacc[a][2] + sacc[a][3];
        }
        {
            int t = t0 + r;
            if (t >= n || (dead && dead[t])) s0 = -INFINITY;
            t += 8;
            if (t >= n || (dead && dead[t])) s1 = -INFINITY;
        }
        /* the running max (the reference of p) moves only when a logit passes it by more than 8
           (log2 units): p stays under 2^8, and most tiles skip the reduction and the rescale */
        if (__any_sync(0xffffffffu, fmaxf(s0, s1) > st.m + 8.0f)) {
            float tmax = fmaxf(s0, s1);
#pragma unroll
            for (int off = 4; off < 32; off <<= 1)
                tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
            const float mnew = fmaxf(st.m, tmax), alpha = kvmix__ex2(st.m - mnew);
#pragma unroll
            for (int i = 0; i < D / 16; i++)
#pragma unroll
                for (int x = 0; x < 4; x++) st.o[i][x] *= alpha;
#pragma unroll
            for (int x = 0; x < 4; x++) st.om[x] *= alpha, st.om2[x] *= alpha;
            st.l *= alpha;
            lsp *= alpha;
            st.m = mnew;
        }
        const float msafe = st.m == -INFINITY ? 0.0f : st.m;
        const float p0 = kvmix__ex2(s0 - msafe), p1 = kvmix__ex2(s1 - msafe);
        st.l += p0 + p1;
        if (v_chan) lsp += p0 + p1;
        const uint32_t pb0 = kvmix__trans(kvmix__split2(p0)), pb1 = kvmix__trans(kvmix__split2(p1));

        /* ---- values ---- */
        uint32_t Ra[DV], Rb[DV];
        kvmix__tc_vconv<DV>(vf, vw[0], vw[1], Ra, vslo, vslo + 0x2222u);
        kvmix__tc_vconv<DV>(vf, vw[2], vw[3], Rb, vslo, vslo + 0x2222u);
        if (vf == KVMIX_FORMAT_BOOSTED) { /* add 4 * high bits of boosted channels */
            const uint32_t hrow = (uint32_t)vs.high_row_bytes;
#pragma unroll
            for (int k = 0; k < DV; k++) {
                int d = r * DV + k, s = stg[rg.v.index + d];
                if (s != KVMIX_BOOST_NONE) {
                    uint32_t hv[4];
#pragma unroll
                    for (int x = 0; x < 4; x++)
                        hv[x] =
                            (stg[rg.v.high + (uint32_t)vt[x] * hrow + (s >> 2)] >> ((s & 3) * 2)) &
                            3u;
                    __half2 ha = __halves2half2(__ushort2half_rn((unsigned short)hv[0]),
                                                __ushort2half_rn((unsigned short)hv[1]));
                    __half2 hb = __halves2half2(__ushort2half_rn((unsigned short)hv[2]),
                                                __ushort2half_rn((unsigned short)hv[3]));
                    Ra[k] = kvmix__h2u(__hfma2(ha, __float2half2_rn(4.0f), kvmix__u2h(Ra[k])));
                    Rb[k] = kvmix__h2u(__hfma2(hb, __float2half2_rn(4.0f), kvmix__u2h(Rb[k])));
                }
            }
        }
        if (vf == KVMIX_FORMAT_FP16) {
#pragma unroll
            for (int i = 0; i < D / 16; i++)
                kvmix__mma(st.o[i], Ra[2 * i], Ra[2 * i + 1], Rb[2 * i], Rb[2 * i + 1], pb0, pb1);
        } else {
            __half2 sa = __float2half2_rn(0.0f), sb = sa, sa2 = sa, sb2 = sa;
            if (v_tok) {
                sa = kvmix__u2h(kvmix__prmt(vmeta[0], vmeta[1], 0x5410u));
                sb = kvmix__u2h(kvmix__prmt(vmeta[2], vmeta[3], 0x5410u));
                sa2 = kvmix__u2h(kvmix__prmt(vmeta2[0], vmeta2[1], 0x5410u));
                sb2 = kvmix__u2h(kvmix__prmt(vmeta2[2], vmeta2[3], 0x5410u));
            }
#pragma unroll
            for (int i = 0; i < D / 16; i++) {
                const bool second = two && 2 * i >= G;
                __half2 s0a = second ? sa2 : sa, s0b = second ? sb2 : sb, s1a = s0a, s1b = s0b;
                if (v_chan) {
                    int d = r * DV + 2 * i;
                    s0a = s0b = __half2half2(__ushort_as_half((uint16_t)kvmix__lds16(VM + d * 4)));
                    s1a = s1b =
                        __half2half2(__ushort_as_half((uint16_t)kvmix__lds16(VM + (d + 1) * 4)));
                }
                __half2 a0 = __hmul2(kvmix__u2h(Ra[2 * i]), s0a),
                        a1 = __hmul2(kvmix__u2h(Ra[2 * i + 1]), s1a);
                __half2 a2 = __hmul2(kvmix__u2h(Rb[2 * i]), s0b),
                        a3 = __hmul2(kvmix__u2h(Rb[2 * i + 1]), s1b);
                kvmix__mma(st.o[i], kvmix__h2u(a0), kvmix__h2u(a1), kvmix__h2u(a2), kvmix__h2u(a3),
                           pb0, pb1);
                if (!v_exact) { /* the rounding error of code * scale, as a second product */
                    __half2 l0 = __hfma2(kvmix__u2h(Ra[2 * i]), s0a, __hneg2(a0));
                    __half2 l1 = __hfma2(kvmix__u2h(Ra[2 * i + 1]), s1a, __hneg2(a1));
                    __half2 l2 = __hfma2(kvmix__u2h(Rb[2 * i]), s0b, __hneg2(a2));
                    __half2 l3 = __hfma2(kvmix__u2h(Rb[2 * i + 1]), s1b, __hneg2(a3));
                    kvmix__mma(st.o[i], kvmix__h2u(l0), kvmix__h2u(l1), kvmix__h2u(l2),
                               kvmix__h2u(l3), pb0, pb1);
                }
            }
            if (v_tok) {
                uint32_t ma = kvmix__prmt(vmeta[0], vmeta[1], 0x7632u),
                         mb = kvmix__prmt(vmeta[2], vmeta[3], 0x7632u);
                kvmix__mma(st.om, ma, ma, mb, mb, pb0, pb1);
                if (two) {
                    ma = kvmix__prmt(vmeta2[0], vmeta2[1], 0x7632u),
                    mb = kvmix__prmt(vmeta2[2], vmeta2[3], 0x7632u);
                    kvmix__mma(st.om2, ma, ma, mb, mb, pb0, pb1);
                }
            }
        }
    }
    if (v_chan) kvmix__tc_channel_minima<D>(st, VM, lane, lsp);
}

/* FP16 keys and values at D 128 are read in place (units of 128 tokens, no staging): their
   16-token tiles are 8 KiB, enough bytes in flight per warp without a copy stage. */
template <int D> __host__ __device__ constexpr bool kvmix__tc_direct(int kf, int vf) {
    return D == 128 && kf == KVMIX_FORMAT_FP16 && vf == KVMIX_FORMAT_FP16;
}

/* The plan entry (jj or later) that holds unit k: the first whose units end after k (ue does
   not decrease, and its last entry is the chunk's unit count). */
__device__ __forceinline__ int kvmix__tc_find(const int *ue, int jj, int k, int lane) {
    for (;;) {
        const int j = jj + lane;
        const unsigned before = __ballot_sync(0xffffffffu, j < 128 && ue[j] <= k);
        jj += __popc(before);
        if (before != 0xffffffffu) return jj;
    }
}

/* Issues the copies of unit k (span jj of the plan) into the stage buffer dst; KFT / VFT as in
   kvmix__tc_run (known formats fold the section and region arithmetic to constants). */
template <int D, int KFT, int VFT>
__device__ __forceinline__ void kvmix__tc_stage(const kvmix__tc_smem<D> &sm,
                                                const kvmix__decode_params &p, int jj, int k,
                                                kvmix__tc_dst dst, int lane) {
    const int kf = KFT ? KFT : sm.plan.kf[jj], vf = VFT ? VFT : sm.plan.vf[jj];
    if (kvmix__tc_direct<D>(kf, vf)) return;
    const int ntok = sm.plan.ntok[jj];
    const int a = (k - sm.plan.ub[jj]) * sm.plan.ut[jj];
    const int n = min(ntok, a + sm.plan.ut[jj]) - a;
    const kvmix__tsec ks = kvmix__tc_sections<D>(kf, (uint32_t)ntok, p.group_size, p.n_boost);
    const kvmix__tsec vs = kvmix__tc_sections<D>(vf, (uint32_t)ntok, p.group_size, p.n_boost);
    kvmix__tc_layout<D, true>(kf, vf, ks, vs, a, n, ntok, p.group_size, p.n_boost, false, dst,
                              p.base + sm.plan.koff[jj], p.base + sm.plan.voff[jj], lane);
}

template <int V> struct kvmix__int_c { static constexpr int value = V; };

/* Calls fn(kvmix__int_c<KF>, kvmix__int_c<VF>) with the format pair as compile-time constants
   when it is one of the specialized pairs (the common cache mixes), else with <0, 0> (formats
   read at run time). One list for the copy issue and the compute of a unit. */
template <class Fn> __device__ __forceinline__ void kvmix__tc_dispatch(int kf, int vf, Fn &&fn) {
#define KVMIX__TC_PAIR(KF_, VF_)                                                                   \
    if (kf == KF_ && vf == VF_) return fn(kvmix__int_c<KF_>{}, kvmix__int_c<VF_>{});
    KVMIX__TC_PAIR(KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16)
    KVMIX__TC_PAIR(KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2)
    KVMIX__TC_PAIR(KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4)
    KVMIX__TC_PAIR(KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2)
    KVMIX__TC_PAIR(KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT2)
    KVMIX__TC_PAIR(KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT8)
#undef KVMIX__TC_PAIR
    fn(kvmix__int_c<0>{}, kvmix__int_c<0>{});
}

/* kvmix__tc_stage with the pair specialized where kvmix__tc_dispatch has it, between the fence
   that orders the warp's last reads of the buffer before the bulk copies and the arrival that
   (with the copies' bytes) completes the buffer's mbarrier phase. */
template <int D>
__device__ __forceinline__ void kvmix__tc_stage_any(const kvmix__tc_smem<D> &sm,
                                                    const kvmix__decode_params &p, int jj, int k,
                                                    kvmix__tc_dst dst, int lane) {
    kvmix__fence_proxy_async();
    __syncwarp();
    kvmix__tc_dispatch(sm.plan.kf[jj], sm.plan.vf[jj], [&](auto kft, auto vft) {
        kvmix__tc_stage<D, decltype(kft)::value, decltype(vft)::value>(sm, p, jj, k, dst, lane);
    });
    if (lane == 0) kvmix__bar_arrive(dst.bar);
}

/* Sections, regions and the unit itself, with the formats known at compile time where KFT / VFT
   are (the set-up arithmetic then folds to constants). */
template <int D, int KFT, int VFT, bool GL = false>
__device__ __forceinline__ void kvmix__tc_run(kvmix__tc_state<D> &st, kvmix__tc_smem<D> &sm,
                                              const kvmix__decode_params &p, uint8_t *stg,
                                              int kf_rt, int vf_rt, int jj, int a, int n,
                                              const uint8_t *dead, int lane) {
    const int kf = KFT ? KFT : kf_rt, vf = VFT ? VFT : vf_rt, ntok = sm.plan.ntok[jj];
    const kvmix__tsec ks = kvmix__tc_sections<D>(kf, (uint32_t)ntok, p.group_size, p.n_boost);
    const kvmix__tsec vs = kvmix__tc_sections<D>(vf, (uint32_t)ntok, p.group_size, p.n_boost);
    if constexpr (GL) {
        kvmix__tc_regions rg{};
        kvmix__tc_unit<D, KFT, VFT, true>(
            st, sm, p, stg, rg, kf, vf, ks, vs, n, dead,
            p.base + sm.plan.koff[jj] + (uint64_t)((uint32_t)a * ks.row_bytes),
            p.base + sm.plan.voff[jj] + (uint64_t)((uint32_t)a * vs.row_bytes));
    } else {
        const kvmix__tc_regions rg = kvmix__tc_layout<D, false>(
            kf, vf, ks, vs, a, n, ntok, p.group_size, p.n_boost, false, {}, nullptr, nullptr, lane);
        kvmix__tc_unit<D, KFT, VFT>(st, sm, p, stg, rg, kf, vf, ks, vs, n, dead);
    }
}

/* The block's result from its warps' partials in mg (read after a barrier): the normalized output
   and the log2 lse of its nq query heads from qh0, as split `split`'s partial or, with one split,
   as the final out and natural lse; NaN everywhere where err. */
template <int D>
__device__ void kvmix__decode_block_out(const kvmix__tc_merge<D> &mg, const kvmix__decode_params &p,
                                        bool err, int seq, int split, int qh0, int nq) {
    __syncthreads();
    const size_t part = ((size_t)seq * p.n_splits + split) * p.n_q_heads + qh0;
    for (int e = threadIdx.x; e < nq * D; e += blockDim.x) {
        int h = e / D, c = e % D;
        float mx = -INFINITY;
        for (int w = 0; w < kvmix__tc_warps; w++) mx = fmaxf(mx, mg.m[w][h]);
        float sum = 0.0f, o = 0.0f;
        if (mx != -INFINITY)
            for (int w = 0; w < kvmix__tc_warps; w++) {
                float wt = exp2f(mg.m[w][h] - mx);
                sum += wt * mg.l[w][h];
                o += wt * mg.acc[w][h][c];
            }
        float nan = __int_as_float(0x7fffffff);
        const float result = err ? nan : (sum > 0.0f ? o / sum : 0.0f);
        const float lse2 = err ? nan : (sum > 0.0f ? mx + log2f(sum) : -INFINITY);
        if (p.out) { /* one split: the final output, as kvmix__decode_merge_kernel writes it */
            kvmix__store_elem(p.out + part * D + e, result, p.dtype);
            if (c == 0 && p.lse) p.lse[part + h] = lse2 * kvmix__ln2;
        } else {
            p.part_out[part * D + e] = result;
            if (c == 0) p.part_lse[part + h] = lse2;
        }
    }
}

/* Grid (n_splits, n_kv_heads * q_chunks, n_seqs), 128 threads; a block serves query heads
   [kv * q_per_kv + chunk * 4, + 4) (fewer in the last chunk) over its split's token range. */
template <int D, bool SMALL>
static __global__ void __launch_bounds__(kvmix__tc_threads, kvmix__tc_cfg<D, SMALL>::min_blocks)
    kvmix__tc_decode_kernel(kvmix__decode_params p) {
    extern __shared__ __align__(16) uint8_t kvmix__tc_dyn[];
    __shared__ kvmix__tc_smem<D> sm;
    constexpr int W = kvmix__tc_warps, STAGE = kvmix__tc_cfg<D, SMALL>::stage;
    const int split = blockIdx.x, seq = blockIdx.z;
    const int kv = blockIdx.y / p.q_chunks, chunk = blockIdx.y % p.q_chunks;
    const int qh0 = kv * p.q_per_kv + chunk * 4, nq = min(4, p.q_per_kv - chunk * 4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int G = p.group_size, NG = D / G;

    /* the sequence's span range first: its load is in flight while the query table is built; a
       range outside the view's spans is an error, and no span of it is read */
    int first = p.seq_first_span[seq], last = p.seq_first_span[seq + 1];
    const bool bad_range = !kvmix__view_range_ok(first, last, p.n_spans);
    if (bad_range) first = last = 0;
    { /* all of a thread's query loads in flight at once (a serial loop costs one latency each) */
        constexpr int T = W * 32, NE = 4 * D / T;
        float qv[NE];
#pragma unroll
        for (int i = 0; i < NE; i++) {
            const int e = (int)threadIdx.x + i * T;
            qv[i] = e / D < nq
                        ? kvmix__load_elem(p.q + ((size_t)seq * p.n_q_heads + qh0) * D + e, p.dtype)
                        : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < NE; i++) {
            const int e = (int)threadIdx.x + i * T;
            sm.q[kvmix__qi(e / D, e % D)] = qv[i] * p.scale_log2;
        }
    }
    if (threadIdx.x == 0) sm.error = bad_range;
    if (lane == 0) { /* the warp's stage mbarriers, visible to the copy engine after the fence */
        kvmix__bar_init((uint32_t)__cvta_generic_to_shared(&sm.bar[warp][0]));
        kvmix__bar_init((uint32_t)__cvta_generic_to_shared(&sm.bar[warp][1]));
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 4 * 16; e += blockDim.x) {
        int h = e / 16, g = e % 16;
        float s = 0.0f;
        if (g < NG)
            for (int d = g * G; d < g * G + G; d++) s += sm.q[kvmix__qi(h, d)];
        sm.qsum[h][g] = s;
    }
    for (int e = threadIdx.x; e < (D / 16) * 32; e += blockDim.x) {
        const int j = e / 32, L = e % 32, h = (L >> 2) >> 1, part = (L >> 2) & 1, c = L & 3;
        float v[4];
#pragma unroll
        for (int x = 0; x < 4; x++) v[x] = sm.q[kvmix__qi(h, kvmix__tc_kdim<D>(c, j, x))];
        sm.bq[j][L] =
            make_uint2(kvmix__split_pair(v[0], v[1], part), kvmix__split_pair(v[2], v[3], part));
    }

    /* the split's spans: the sequence's spans cut into n_splits equal ranges by index, so that a
       block knows its first span without a pass over the spans before it */
    const int64_t n_spans = last - first;
    const int s_lo = first + (int)(n_spans * split / p.n_splits);
    const int s_hi = first + (int)(n_spans * (split + 1) / p.n_splits);

    kvmix__tc_state<D> st;
#pragma unroll
    for (int i = 0; i < D / 16; i++)
#pragma unroll
        for (int x = 0; x < 4; x++) st.o[i][x] = 0.0f;
#pragma unroll
    for (int x = 0; x < 4; x++) st.om[x] = 0.0f, st.om2[x] = 0.0f;
    st.m = -INFINITY, st.l = 0.0f;
    __syncthreads();
    uint8_t *const stage0 = kvmix__tc_dyn + warp * 2 * STAGE;
    const uint32_t stage0_sh = (uint32_t)__cvta_generic_to_shared(stage0);
    const uint32_t bar0_sh = (uint32_t)__cvta_generic_to_shared(&sm.bar[warp][0]);
    uint32_t phase = 0; /* bit b: parity of the next phase of stage buffer b's mbarrier */
    int unit_base = 0;
    /* the split's spans, 128 at a time: plan their units (up to 128 tokens each), then every warp
       walks its units with the next unit's copy in flight */
    for (int c0 = s_lo; c0 < s_hi; c0 += blockDim.x) {
        const int i = c0 + (int)threadIdx.x;
        int nu = 0;
        if (i < s_hi) {
            const kvmix_view_span sp = p.spans[i];
            kvmix__sections ks, vs;
            bool ok =
                kvmix__block_ok(sp.key_format, sp.n_tokens, sp.key_offset, sp.key_head_bytes,
                                p.n_kv_heads, D, G, p.n_boost, p.base_bytes, &ks) &&
                kvmix__block_ok(sp.value_format, sp.n_tokens, sp.value_offset, sp.value_head_bytes,
                                p.n_kv_heads, D, G, p.n_boost, p.base_bytes, &vs) &&
                kvmix__view_dead_ok(sp.dead_index, sp.n_tokens, p.n_dead_flags);
            if (!ok) {
                atomicExch(&sm.error, 1);
            } else {
                const int ut = kvmix__tc_direct<D>(sp.key_format, sp.value_format)
                                   ? 128
                                   : kvmix__tc_unit_tokens<D, STAGE>(sp.key_format, sp.value_format,
                                                                     sp.n_tokens, G, p.n_boost);
                const int t = threadIdx.x;
                sm.plan.koff[t] = sp.key_offset + (uint64_t)kv * sp.key_head_bytes;
                sm.plan.voff[t] = sp.value_offset + (uint64_t)kv * sp.value_head_bytes;
                sm.plan.ntok[t] = sp.n_tokens, sm.plan.ut[t] = ut;
                sm.plan.dead[t] = sp.dead_index;
                sm.plan.kf[t] = sp.key_format, sm.plan.vf[t] = sp.value_format;
                nu = (sp.n_tokens + ut - 1) / ut;
            }
        }
        int64_t total_units;
        const int ue = (int)kvmix__block_scan(nu, sm.scratch, &total_units);
        sm.plan.ub[threadIdx.x] = ue - nu, sm.plan.ue[threadIdx.x] = ue;
        __syncthreads();
        const int n_units = (int)total_units;
        int k = (warp - unit_base % W + W) % W, jj = 0, buf = 0;
        if (k < n_units) {
            jj = kvmix__tc_find(sm.plan.ue, jj, k, lane);
            kvmix__tc_stage_any<D>(sm, p, jj, k, {stage0_sh, bar0_sh}, lane);
        }
        kvmix__cp_commit();
        while (k < n_units) {
            const int k2 = k + W;
            int jj2 = jj;
            if (k2 < n_units) {
                jj2 = kvmix__tc_find(sm.plan.ue, jj2, k2, lane);
                kvmix__tc_stage_any<D>(
                    sm, p, jj2, k2,
                    {stage0_sh + (uint32_t)((buf ^ 1) * STAGE), bar0_sh + 8u * (uint32_t)(buf ^ 1)},
                    lane);
            }
            kvmix__cp_commit();
            kvmix__cp_wait<1>();
            kvmix__bar_wait(bar0_sh + 8u * (uint32_t)buf, (phase >> buf) & 1u);
            phase ^= 1u << buf;
            __syncwarp();
            {
                uint8_t *stg = stage0 + buf * STAGE;
                const int kf = sm.plan.kf[jj], vf = sm.plan.vf[jj];
                const int a = (k - sm.plan.ub[jj]) * sm.plan.ut[jj];
                const int n = min(sm.plan.ntok[jj], a + sm.plan.ut[jj]) - a;
                const uint8_t *dead =
                    sm.plan.dead[jj] >= 0 ? p.dead + sm.plan.dead[jj] + a : nullptr;
                kvmix__tc_dispatch(kf, vf, [&](auto kft, auto vft) {
                    constexpr int KF = decltype(kft)::value, VF = decltype(vft)::value;
                    kvmix__tc_run<D, KF, VF, kvmix__tc_direct<D>(KF, VF)>(st, sm, p, stg, kf, vf,
                                                                          jj, a, n, dead, lane);
                });
            }
            __syncwarp();
            k = k2, jj = jj2, buf ^= 1;
        }
        kvmix__cp_wait<0>();
        unit_base += n_units % W;
        __syncthreads();
    }
    /* the merge launch (programmatic dependent launch) may start once every block is here; it
       waits for this grid's completion before it reads the partial results */
    kvmix__launch_dependents();

    /* the warp's sum of p per head, then merge the block's warps */
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) st.l += __shfl_xor_sync(0xffffffffu, st.l, off);
    __syncthreads(); /* stage buffers no longer in use */
    kvmix__tc_merge<D> &mg = *reinterpret_cast<kvmix__tc_merge<D> *>(kvmix__tc_dyn);
    {
        const int r = lane >> 2, c = lane & 3;
        constexpr int DV = D / 8;
        const float omin = st.om[0] + st.om[1], omin2 = st.om2[0] + st.om2[1];
#pragma unroll
        for (int i = 0; i < D / 16; i++) {
            const float om = DV > G && 2 * i >= G ? omin2 : omin;
            mg.acc[warp][c][r * DV + 2 * i] = st.o[i][0] + st.o[i][1] + om;
            mg.acc[warp][c][r * DV + 2 * i + 1] = st.o[i][2] + st.o[i][3] + om;
        }
        if (r == 0) mg.m[warp][c] = st.m, mg.l[warp][c] = st.l;
    }
    kvmix__decode_block_out<D>(mg, p, sm.error != 0, seq, split, qh0, nq);
}

/* ---- decode of the other shapes on CUDA cores -------------------------------------------------

   The fragments above need head_dim 64, 128 or 256 and groups of 16 or more. Every other
   head_dim the pack runs (multiples of 32 up to 256: 32, 96, 160, ...) and group (8) takes this
   walk instead, over the same grid, partials and merge: the block's warps take turns over tiles of
   32 tokens of its split's spans. A lane decodes its token's key and scores it against the
   block's query heads (no reduction across lanes), the tile's softmax takes one warp reduction per
   head, then each lane adds the tile's weighted values for dims lane + 32 i. */

constexpr int kvmix__walk_blocks_per_sm = 4; /* the walk's occupancy floor (registers per thread) */

/* Whether decode at this head_dim and group runs on the tensor cores (else the walk). */
__host__ __device__ constexpr bool kvmix__tc_shape(int head_dim, int group) {
    return (head_dim == 64 || head_dim == 128 || head_dim == 256) &&
           group % kvmix__tc_min_group == 0;
}

/* One warp's running softmax over its tiles: per head, max m and sum l (the same in every lane)
   and output o for dims lane + 32 i. */
template <int NC> struct kvmix__walk_state { float m[4], l[4], o[4][NC]; };

/* The logits s[h] of the lane's token (-inf where it is dead or past the span) join each head's
   running softmax: w[h] gets the token's weight e^(s - new max). */
template <int NC>
__device__ __forceinline__ void kvmix__walk_softmax(kvmix__walk_state<NC> &st, const float (&s)[4],
                                                    int nq, float (&w)[4]) {
#pragma unroll
    for (int h = 0; h < 4; h++) {
        float mx = s[h];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        w[h] = 0.0f;
        if (h >= nq || mx == -INFINITY) continue; /* every token of the tile dead */
        const float mn = fmaxf(st.m[h], mx), corr = exp2f(st.m[h] - mn);
        w[h] = exp2f(s[h] - mn);
        float sum = w[h];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        st.l[h] = st.l[h] * corr + sum;
#pragma unroll
        for (int i = 0; i < NC; i++) st.o[h][i] *= corr;
        st.m[h] = mn;
    }
}

/* Tokens [t0, t0 + 32) of a span (kb / vb: the kv head's blocks) added to the warp's state; q:
   [4][32 NC] in shared memory, scaled. */
template <int NC>
__device__ __forceinline__ void
kvmix__walk_tile(kvmix__walk_state<NC> &st, const float *q, const kvmix__decode_params &p,
                 const kvmix_view_span &sp, const uint8_t *kb, const kvmix__sections &ks,
                 const uint8_t *vb, const kvmix__sections &vs, int t0, int nq, int lane) {
    constexpr int D = 32 * NC;
    const int t = t0 + lane, n = min(32, sp.n_tokens - t0);
    const bool live = lane < n && !(sp.dead_index >= 0 && p.dead[sp.dead_index + t]);
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (live)
        for (int c = 0; c < D; c++) {
            const float k = kvmix__decode_value(sp.key_format, kb, ks, t, c, p.group_size);
#pragma unroll
            for (int h = 0; h < 4; h++) s[h] = fmaf(q[h * D + c], k, s[h]);
        }
    float w[4];
#pragma unroll
    for (int h = 0; h < 4; h++) s[h] = live ? s[h] : -INFINITY;
    kvmix__walk_softmax<NC>(st, s, nq, w);
    for (int u = 0; u < n; u++) {
        float wu[4];
#pragma unroll
        for (int h = 0; h < 4; h++) wu[h] = __shfl_sync(0xffffffffu, w[h], u);
        if (wu[0] == 0.0f && wu[1] == 0.0f && wu[2] == 0.0f && wu[3] == 0.0f) continue;
#pragma unroll
        for (int i = 0; i < NC; i++) {
            const float v =
                kvmix__decode_value(sp.value_format, vb, vs, t0 + u, lane + 32 * i, p.group_size);
#pragma unroll
            for (int h = 0; h < 4; h++) st.o[h][i] = fmaf(wu[h], v, st.o[h][i]);
        }
    }
}

/* Grid and query heads as kvmix__tc_decode_kernel; head_dim 32 * NC. */
template <int NC>
static __global__ void __launch_bounds__(kvmix__tc_threads, kvmix__walk_blocks_per_sm)
    kvmix__walk_decode_kernel(kvmix__decode_params p) {
    constexpr int D = 32 * NC, W = kvmix__tc_warps;
    __shared__ kvmix__tc_merge<D> mg;
    __shared__ float q[4 * D];
    const int split = blockIdx.x, seq = blockIdx.z;
    const int kv = blockIdx.y / p.q_chunks, chunk = blockIdx.y % p.q_chunks;
    const int qh0 = kv * p.q_per_kv + chunk * 4, nq = min(4, p.q_per_kv - chunk * 4);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int e = threadIdx.x; e < 4 * D; e += blockDim.x)
        q[e] = e / D < nq
                   ? kvmix__load_elem(p.q + ((size_t)seq * p.n_q_heads + qh0) * D + e, p.dtype) *
                         p.scale_log2
                   : 0.0f;
    kvmix__walk_state<NC> st;
#pragma unroll
    for (int h = 0; h < 4; h++) {
        st.m[h] = -INFINITY, st.l[h] = 0.0f;
#pragma unroll
        for (int i = 0; i < NC; i++) st.o[h][i] = 0.0f;
    }
    int first = p.seq_first_span[seq], last = p.seq_first_span[seq + 1];
    bool err = !kvmix__view_range_ok(first, last, p.n_spans);
    if (err) first = last = 0;
    const int64_t n_spans = last - first; /* the split's spans, as the tensor-core kernel's */
    const int s_lo = first + (int)(n_spans * split / p.n_splits);
    const int s_hi = first + (int)(n_spans * (split + 1) / p.n_splits);
    __syncthreads();
    for (int si = s_lo; si < s_hi; si++) {
        const kvmix_view_span sp = p.spans[si];
        kvmix__sections ks, vs;
        if (!kvmix__block_ok(sp.key_format, sp.n_tokens, sp.key_offset, sp.key_head_bytes,
                             p.n_kv_heads, D, p.group_size, p.n_boost, p.base_bytes, &ks) ||
            !kvmix__block_ok(sp.value_format, sp.n_tokens, sp.value_offset, sp.value_head_bytes,
                             p.n_kv_heads, D, p.group_size, p.n_boost, p.base_bytes, &vs) ||
            !kvmix__view_dead_ok(sp.dead_index, sp.n_tokens, p.n_dead_flags)) {
            err = true;
            continue;
        }
        const uint8_t *kb = p.base + sp.key_offset + (uint64_t)kv * sp.key_head_bytes;
        const uint8_t *vb = p.base + sp.value_offset + (uint64_t)kv * sp.value_head_bytes;
        for (int t0 = 32 * warp; t0 < sp.n_tokens; t0 += 32 * W)
            kvmix__walk_tile<NC>(st, q, p, sp, kb, ks, vb, vs, t0, nq, lane);
    }
    kvmix__launch_dependents();
#pragma unroll
    for (int h = 0; h < 4; h++) {
#pragma unroll
        for (int i = 0; i < NC; i++) mg.acc[warp][h][lane + 32 * i] = st.o[h][i];
        if (lane == 0) mg.m[warp][h] = st.m[h], mg.l[warp][h] = st.l[h];
    }
    kvmix__decode_block_out<D>(mg, p, __syncthreads_or(err), seq, split, qh0, nq);
}

struct kvmix__merge_params {
    const float *part_out, *part_lse;
    int n_splits, n_q_heads, head_dim, dtype;
    uint16_t *out;
    float *lse;
};

/* One block per (sequence, query head), head_dim threads: merges the splits' partials. */
constexpr int kvmix__merge_threads = 256; /* the largest head_dim decode takes */

static __global__ void __launch_bounds__(kvmix__merge_threads)
    kvmix__decode_merge_kernel(kvmix__merge_params p) {
    /* blockDim.x = head_dim (a multiple of 32, at most 256): the splits' lse are read in parallel
       and their weights kept in shared memory, so that the partial outputs of all splits can be
       loaded with many reads in flight (a serial walk over 33+ splits was latency-bound) */
    __shared__ float sw[kvmix__merge_threads], rmx[kvmix__merge_threads / 32];
    __shared__ int rnan[kvmix__merge_threads / 32];
    const int sh = blockIdx.x, seq = sh / p.n_q_heads, h = sh % p.n_q_heads, c = threadIdx.x;
    const int lane = c & 31, warp = c >> 5, nw = (int)blockDim.x >> 5, nt = (int)blockDim.x;
    const size_t first = (size_t)seq * p.n_splits * p.n_q_heads + h;
    kvmix__wait_primary(); /* the decode grid's partials are written */
    /* the first 32 splits' partials are loaded with the lse, not after them */
    const size_t step = (size_t)p.n_q_heads * p.head_dim;
    const float *po0 = p.part_out + first * p.head_dim + c;
    float v0[32];
#pragma unroll
    for (int j = 0; j < 32; j++) v0[j] = po0[min(j, p.n_splits - 1) * step];
    float mx = -INFINITY, own_lse = 0.0f; /* this thread's split of the first chunk */
    bool nan = false;
    for (int s = c; s < p.n_splits; s += nt) {
        float l = p.part_lse[first + (size_t)s * p.n_q_heads];
        if (s == c) own_lse = l;
        nan |= l != l;
        mx = fmaxf(mx, l);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    nan = __any_sync(0xffffffffu, nan);
    if (lane == 0) rmx[warp] = mx, rnan[warp] = nan;
    __syncthreads();
    mx = -INFINITY, nan = false;
    for (int w = 0; w < nw; w++) mx = fmaxf(mx, rmx[w]), nan |= rnan[w] != 0;
    float sum = 0.0f, o = 0.0f;
    if (mx != -INFINITY && !nan) /* uniform over the block */
        for (int s0 = 0; s0 < p.n_splits; s0 += nt) {
            const int n = min(nt, p.n_splits - s0);
            __syncthreads(); /* sw of the previous chunk consumed */
            if (c < n)
                sw[c] =
                    exp2f((s0 ? p.part_lse[first + (size_t)(s0 + c) * p.n_q_heads] : own_lse) - mx);
            __syncthreads();
            const float *po = p.part_out + (first + (size_t)s0 * p.n_q_heads) * p.head_dim + c;
            /* 32 splits' partials loaded at once (indices past n re-read the last one), then
               summed in split order */
            for (int j0 = 0; j0 < n; j0 += 32) {
                float v[32];
#pragma unroll
                for (int j = 0; j < 32; j++)
                    v[j] = s0 == 0 && j0 == 0 ? v0[j] : po[min(j0 + j, n - 1) * step];
#pragma unroll
                for (int j = 0; j < 32; j++)
                    if (j0 + j < n) {
                        const float wt = sw[j0 + j];
                        sum += wt;
                        o += wt * v[j];
                    }
            }
        }
    float result = nan ? __int_as_float(0x7fffffff) : (sum > 0.0f ? o / sum : 0.0f);
    kvmix__store_elem(p.out + (size_t)sh * p.head_dim + c, result, p.dtype);
    if (c == 0 && p.lse)
        p.lse[sh] = nan ? __int_as_float(0x7fffffff)
                        : (sum > 0.0f ? (mx + log2f(sum)) * kvmix__ln2 : -INFINITY);
}

} // namespace

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

/* The share of the block slots that `blocks` blocks keep busy over the waves they take. */
static double kvmix__wave_fill(int64_t blocks, int64_t slots) {
    int64_t waves = (blocks + slots - 1) / slots;
    return (double)blocks / (double)(waves * slots);
}

extern "C" kvmix_result kvmix_cuda_decode_choose_splits(int32_t n_seqs, int32_t n_kv_heads,
                                                        int32_t n_q_heads, int32_t head_dim,
                                                        int64_t max_seq_tokens, int32_t n_sms,
                                                        int32_t *out_splits) {
    if (!out_splits) return KVMIX_ERR_NULL_POINTER;
    if (n_seqs < 0 || n_kv_heads <= 0 || n_q_heads <= 0 || n_q_heads % n_kv_heads != 0 ||
        max_seq_tokens < 0 || n_sms <= 0)
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (!kvmix__decode_head_dim(head_dim)) return KVMIX_ERR_UNSUPPORTED;
    const int g = n_q_heads / n_kv_heads;
    const int per_sm = !kvmix__tc_shape(head_dim, kvmix__tc_min_group) ? kvmix__walk_blocks_per_sm
                       : head_dim == 256 ? kvmix__tc_cfg<256>::min_blocks
                                         : kvmix__tc_cfg<128>::min_blocks;
    /* one block per (sequence, kv head, 4 query heads, split); per_sm fit on an SM: fill the
       machine in one wave, with at least ~256 tokens per split */
    int64_t blocks = (int64_t)(n_seqs > 0 ? n_seqs : 1) * n_kv_heads * ((g + 3) / 4);
    int64_t slots = (int64_t)per_sm * n_sms;
    int64_t want = kvmix__split_waves * slots / blocks;
    int64_t most = max_seq_tokens / 256;
    if (most > KVMIX_CUDA_MAX_SPLITS) most = KVMIX_CUDA_MAX_SPLITS;
    if (want > most) want = most;
    if (want < 1) want = 1;
    /* a last wave that is partly empty idles the rest of the machine (304 blocks on 264 slots
       take two waves): more splits, up to the first whose waves are 90% full, else the fullest */
    int64_t best = want;
    for (int64_t s = want + 1; kvmix__wave_fill(blocks * best, slots) < 0.9 && s <= most; s++)
        if (kvmix__wave_fill(blocks * s, slots) > kvmix__wave_fill(blocks * best, slots)) best = s;
    *out_splits = (int32_t)best;
    return KVMIX_SUCCESS;
}

/* Whether the device's block holds a decode block of this configuration: its static shared
   memory (as compiled for the device) and its stages. */
template <int D, bool SMALL> static cudaError_t kvmix__tc_fits(int device, bool *out) {
    static int known[2][64]; /* per device: 0 unknown, 1 fits, 2 does not */
    cudaFuncAttributes fa;
    int optin = 0;
    if (device >= 0 && device < 64 && known[SMALL][device]) {
        *out = known[SMALL][device] == 1;
        return cudaSuccess;
    }
    cudaError_t e = cudaFuncGetAttributes(&fa, kvmix__tc_decode_kernel<D, SMALL>);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (e != cudaSuccess) return e;
    *out = fa.sharedSizeBytes + (size_t)kvmix__tc_cfg<D, SMALL>::dyn_bytes <= (size_t)optin;
    if (device >= 0 && device < 64) known[SMALL][device] = *out ? 1 : 2;
    return cudaSuccess;
}

/* Allows the decode kernel of these stages its dynamic shared memory. Asked before every launch
   and occupancy query, not once per device: a device reset forgets it. */
template <int D, bool SMALL> static cudaError_t kvmix__tc_allow_stages() {
    return cudaFuncSetAttribute(kvmix__tc_decode_kernel<D, SMALL>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                kvmix__tc_cfg<D, SMALL>::dyn_bytes);
}

template <int D, bool SMALL>
static cudaError_t kvmix__tc_launch_as(dim3 grid, cudaStream_t stream,
                                       const kvmix__decode_params &p) {
    constexpr int bytes = kvmix__tc_cfg<D, SMALL>::dyn_bytes;
    cudaError_t e = kvmix__tc_allow_stages<D, SMALL>();
    if (e != cudaSuccess) return e;
    kvmix__tc_decode_kernel<D, SMALL><<<grid, kvmix__tc_threads, bytes, stream>>>(p);
    return cudaSuccess;
}

/* Which stages a decode at head_dim D takes on the current device: the Hopper-size ones where the
   device's block holds them and small ones were not asked for, else the small ones; *fits false
   where neither fits. */
template <int D> static cudaError_t kvmix__tc_choose(bool ask_small, bool *small, bool *fits) {
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    *small = ask_small;
    if (e == cudaSuccess && !ask_small) e = kvmix__tc_fits<D, false>(device, fits);
    if (e != cudaSuccess || (!ask_small && *fits)) return e;
    *small = true;
    return kvmix__tc_fits<D, true>(device, fits);
}

/* The decode grid in the stages kvmix__tc_choose gives; nothing launched where none fits. */
template <int D>
static cudaError_t kvmix__tc_launch(dim3 grid, cudaStream_t stream, const kvmix__decode_params &p,
                                    bool ask_small, bool *fits) {
    bool small = false;
    cudaError_t e = kvmix__tc_choose<D>(ask_small, &small, fits);
    if (e != cudaSuccess || !*fits) return e;
    return small ? kvmix__tc_launch_as<D, true>(grid, stream, p)
                 : kvmix__tc_launch_as<D, false>(grid, stream, p);
}

/* fn(kvmix__int_c<NC>) for the walk's kernel of head_dim d = 32 NC (a multiple of 32, at most
   256): its launch and its occupancy take the same instantiation. */
template <class Fn> static cudaError_t kvmix__walk_dispatch(int d, Fn &&fn) {
    switch (d / 32) {
    case 1: return fn(kvmix__int_c<1>{});
    case 2: return fn(kvmix__int_c<2>{});
    case 3: return fn(kvmix__int_c<3>{});
    case 4: return fn(kvmix__int_c<4>{});
    case 5: return fn(kvmix__int_c<5>{});
    case 6: return fn(kvmix__int_c<6>{});
    case 7: return fn(kvmix__int_c<7>{});
    default: return fn(kvmix__int_c<8>{});
    }
}

/* The walk's kernel for head_dim d. */
static cudaError_t kvmix__walk_launch(int d, dim3 grid, cudaStream_t stream,
                                      const kvmix__decode_params &p) {
    return kvmix__walk_dispatch(d, [&](auto nc) {
        kvmix__walk_decode_kernel<decltype(nc)::value><<<grid, kvmix__tc_threads, 0, stream>>>(p);
        return cudaSuccess;
    });
}

/* Whether the merge kernel the device runs is the Hopper build (compiled from compute_90, with
   griddepcontrol), not the portable one (any other target, or compute_80 PTX that a Hopper
   device runs when the driver is told to compile PTX). Asked once: the build does not change. */
static bool kvmix__merge_is_dependent() {
    static int known = -1;
    if (known < 0) {
        cudaFuncAttributes fa;
        known = cudaFuncGetAttributes(&fa, kvmix__decode_merge_kernel) == cudaSuccess &&
                fa.ptxVersion == 90;
    }
    return known == 1;
}

extern "C" kvmix_result kvmix_cuda_decode(const kvmix_view *view,
                                          const kvmix_cuda_decode_desc *desc, const void *q,
                                          void *out, float *lse, void *workspace,
                                          size_t workspace_bytes, kvmix_stream stream) {
    if (!desc) return KVMIX_ERR_NULL_POINTER;
    kvmix_result r = kvmix__check_device_view(view);
    if (r != KVMIX_SUCCESS) return r;
    const int d = view->head_dim;
    if (desc->n_q_heads <= 0 || desc->n_q_heads % view->n_kv_heads != 0 || !(desc->scale >= 0.0f) ||
        isinf(desc->scale) || desc->n_splits < 1 || desc->n_splits > KVMIX_CUDA_MAX_SPLITS ||
        (desc->stages != KVMIX_CUDA_STAGES_AUTO && desc->stages != KVMIX_CUDA_STAGES_SMALL))
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (!kvmix__decode_head_dim(d)) return KVMIX_ERR_UNSUPPORTED;
    const int group =
        kvmix__view_group(view->group_size, view->value_group_size, 0, KVMIX_FORMAT_INT4);
    if (desc->dtype != KVMIX_CUDA_FP16 && desc->dtype != KVMIX_CUDA_BF16)
        return KVMIX_ERR_UNSUPPORTED;
    if (view->n_seqs == 0) return KVMIX_SUCCESS;
    if (!q || !out || !workspace) return KVMIX_ERR_NULL_POINTER;
    size_t need;
    r = kvmix_cuda_decode_workspace_bytes(view->n_seqs, desc->n_q_heads, d, desc->n_splits, &need);
    if (r != KVMIX_SUCCESS) return r;
    if (workspace_bytes < need) return KVMIX_ERR_BUFFER_TOO_SMALL;
    if (((uintptr_t)workspace & 15u) != 0) return KVMIX_ERR_INVALID_ARGUMENT;
    const int q_per_kv = desc->n_q_heads / view->n_kv_heads;
    const int q_chunks = (q_per_kv + 3) / 4; /* blocks of up to 4 query heads per kv head */
    const int64_t grid_y = (int64_t)view->n_kv_heads * q_chunks;
    if (grid_y > 65535 || view->n_seqs > 65535) return KVMIX_ERR_UNSUPPORTED;

    kvmix__decode_params p;
    p.base = view->base, p.base_bytes = view->base_bytes, p.spans = view->spans;
    p.seq_first_span = view->seq_first_span, p.dead = view->dead, p.n_spans = view->n_spans;
    p.n_dead_flags = view->n_dead_flags, p.n_seqs = view->n_seqs, p.n_kv_heads = view->n_kv_heads;
    p.n_q_heads = desc->n_q_heads, p.q_per_kv = q_per_kv, p.q_chunks = q_chunks;
    p.group_size = group, p.n_boost = view->n_boost, p.n_splits = desc->n_splits;
    p.dtype = desc->dtype;
    float scale = desc->scale > 0.0f ? desc->scale : 1.0f / sqrtf((float)d);
    p.scale_log2 = scale * 1.4426950408889634f;
    p.q = (const uint16_t *)q;
    p.part_out = (float *)workspace;
    p.part_lse = p.part_out + (size_t)view->n_seqs * desc->n_splits * desc->n_q_heads * d;
    const bool one_split = desc->n_splits == 1;
    /* lse NULL: not wanted; both kernels test it before writing */
    p.out = one_split ? (uint16_t *)out : nullptr, p.lse = one_split ? lse : nullptr;

    dim3 grid((unsigned)desc->n_splits, (unsigned)grid_y, (unsigned)view->n_seqs);
    cudaStream_t s = (cudaStream_t)stream;
    cudaError_t ce;
    bool small = desc->stages == KVMIX_CUDA_STAGES_SMALL, fits = true;
    if (!kvmix__tc_shape(d, group))
        ce = kvmix__walk_launch(d, grid, s, p);
    else if (d == 64)
        ce = kvmix__tc_launch<64>(grid, s, p, small, &fits);
    else if (d == 128)
        ce = kvmix__tc_launch<128>(grid, s, p, small, &fits);
    else
        ce = kvmix__tc_launch<256>(grid, s, p, small, &fits);
    if (ce != cudaSuccess) return KVMIX_ERR_CUDA;
    if (!fits) return KVMIX_ERR_UNSUPPORTED; /* D 256 where a block holds less than 163 KiB */
    if ((r = kvmix__launch_status()) != KVMIX_SUCCESS || one_split) return r;

    kvmix__merge_params m;
    m.part_out = p.part_out, m.part_lse = p.part_lse, m.n_splits = desc->n_splits;
    m.n_q_heads = desc->n_q_heads, m.head_dim = d, m.dtype = desc->dtype;
    m.out = (uint16_t *)out, m.lse = lse;
    /* on the Hopper path, launched as a programmatic dependent of the decode grid: its launch
       overlaps that grid's last blocks instead of following its completion; the portable path's
       merge (no griddepcontrol) is an ordinary launch after it */
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(view->n_seqs * desc->n_q_heads));
    cfg.blockDim = dim3((unsigned)d);
    cfg.stream = s;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr, cfg.numAttrs = kvmix__merge_is_dependent() ? 1 : 0;
    const cudaError_t e = cudaLaunchKernelEx(&cfg, kvmix__decode_merge_kernel, m);
    r = kvmix__launch_status(); /* also clears a failed launch's error */
    return e == cudaSuccess ? r : KVMIX_ERR_CUDA;
}

template <int D, bool SMALL> static cudaError_t kvmix__tc_blocks_as(int *blocks) {
    cudaError_t e = kvmix__tc_allow_stages<D, SMALL>();
    return e == cudaSuccess ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                  blocks, kvmix__tc_decode_kernel<D, SMALL>, kvmix__tc_threads,
                                  kvmix__tc_cfg<D, SMALL>::dyn_bytes)
                            : e;
}

/* Blocks per SM of the configuration kvmix_cuda_decode launches on this device by default;
   *fits false where none fits. */
template <int D> static cudaError_t kvmix__tc_blocks(int *blocks, bool *fits) {
    bool small = false;
    cudaError_t e = kvmix__tc_choose<D>(false, &small, fits);
    if (e != cudaSuccess || !*fits) return e;
    return small ? kvmix__tc_blocks_as<D, true>(blocks) : kvmix__tc_blocks_as<D, false>(blocks);
}

/* Blocks per SM of the walk at head_dim d. */
static cudaError_t kvmix__walk_blocks(int d, int *blocks) {
    return kvmix__walk_dispatch(d, [&](auto nc) {
        return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            blocks, kvmix__walk_decode_kernel<decltype(nc)::value>, kvmix__tc_threads, 0);
    });
}

extern "C" kvmix_result kvmix_cuda_decode_blocks_per_sm(int32_t head_dim, int32_t q_per_kv,
                                                        int32_t *out_blocks) {
    if (!out_blocks) return KVMIX_ERR_NULL_POINTER;
    if (q_per_kv <= 0) return KVMIX_ERR_INVALID_ARGUMENT;
    if (!kvmix__decode_head_dim(head_dim)) return KVMIX_ERR_UNSUPPORTED;
    int blocks = 0;
    bool fits = true;
    cudaError_t e = !kvmix__tc_shape(head_dim, kvmix__tc_min_group)
                        ? kvmix__walk_blocks(head_dim, &blocks)
                    : head_dim == 64  ? kvmix__tc_blocks<64>(&blocks, &fits)
                    : head_dim == 128 ? kvmix__tc_blocks<128>(&blocks, &fits)
                                      : kvmix__tc_blocks<256>(&blocks, &fits);
    if (e != cudaSuccess) return KVMIX_ERR_CUDA;
    if (!fits) return KVMIX_ERR_UNSUPPORTED; /* as kvmix_cuda_decode there */
    *out_blocks = blocks;
    return KVMIX_SUCCESS;
}

// >>payload  the transfer payload's body, packed and unpacked

namespace {

/* A call runs up to three kernels in stream order: tiers (checks the device head against info and
   lists the token of every body row in the workspace), a check (pack: the input rows are
   representable in FP16; unpack: every block holds bytes a quantize call can write), then the
   kernel that writes, which does nothing unless the workspace's status word is still 0. */

constexpr int kvmix__payload_chunk_rows = 32; /* rows of one tier's blocks per thread block */

/* A payload's body (kvmix.h's >>transfer room) and the buffers of one call. Tier i (0, 1, 2) is
   format i + 1: FP16, INT8, INT4. */
struct kvmix__payload_params {
    int kind, dtype, head_dim, group_size, n_kv_heads, n_tokens;
    uint64_t n_slices;       /* n_layers * 2 * n_kv_heads: one block of each tier per slice */
    int n_rows[3];           /* tokens at tier i */
    int row_base[3];         /* tier i's first entry of the row list */
    int first_chunk[4];      /* blockIdx.x of tier i's first row chunk; [3]: all chunks */
    kvmix__sections sec[3];  /* tier i's block */
    uint64_t tier_offset[4]; /* tier i's block from its slice's start; [3]: slice bytes */
    uint64_t head_bytes;
    uint8_t head[KVMIX_PAYLOAD_HEADER_BYTES]; /* the header that info describes */
    uint8_t *payload;
    const uint16_t *keys_in, *values_in; /* pack: [n_layers][n_tokens][n_kv_heads][head_dim] */
    uint16_t *keys_out, *values_out;     /* unpack: the same shape */
    int32_t *status; /* workspace: 0, or the KVMIX_CUDA_PAYLOAD_* bits found so far */
    int32_t *rows;   /* workspace: the token of each body row, tier after tier */
    int32_t *error_flags;
};

/* The rows [r0, r0 + n) of one tier that this thread block handles, in every slice. */
struct kvmix__payload_chunk {
    int tier, r0, n;
};

__device__ inline kvmix__payload_chunk kvmix__payload_chunk_of(const kvmix__payload_params &p) {
    kvmix__payload_chunk c;
    const int b = (int)blockIdx.x;
    c.tier = b >= p.first_chunk[2] ? 2 : b >= p.first_chunk[1] ? 1 : 0;
    c.r0 = (b - p.first_chunk[c.tier]) * kvmix__payload_chunk_rows;
    c.n = min(kvmix__payload_chunk_rows, p.n_rows[c.tier] - c.r0);
    return c;
}

/* Slice s = (layer * 2 + kv) * n_kv_heads + head: its tier-i block, and the dtype offset of a
   token's row (layer, token, head) in keys or values. */
__device__ __forceinline__ uint8_t *kvmix__payload_block(const kvmix__payload_params &p, uint64_t s,
                                                         int tier) {
    return p.payload + p.head_bytes + s * p.tier_offset[3] + p.tier_offset[tier];
}
struct kvmix__payload_slice {
    uint64_t layer_row, head;
    int kv;
};
__device__ __forceinline__ kvmix__payload_slice
kvmix__payload_slice_of(const kvmix__payload_params &p, uint64_t s) {
    kvmix__payload_slice sl;
    const uint64_t n_kv = (uint64_t)p.n_kv_heads;
    sl.layer_row = s / (2u * n_kv) * (uint64_t)p.n_tokens;
    sl.kv = (int)((s / n_kv) & 1u);
    sl.head = s % n_kv;
    return sl;
}
__device__ __forceinline__ uint64_t kvmix__payload_row(const kvmix__payload_params &p,
                                                       const kvmix__payload_slice &sl, int t) {
    return ((sl.layer_row + (uint64_t)t) * (uint64_t)p.n_kv_heads + sl.head) * (uint64_t)p.head_dim;
}

__device__ inline void kvmix__payload_report(const kvmix__payload_params &p, int bit) {
    atomicOr(p.status, bit);
    if (p.error_flags) atomicOr(p.error_flags, bit);
}

/* One block of 1024 threads, 4 tokens per thread and tile: compares the device header with the
   one info describes, checks every tier (allowed for the kind; zeros after the table), and writes
   the row list: tier i's r-th token (position order) at rows[row_base[i] + r]. Sets the status
   word: 0, or KVMIX_CUDA_PAYLOAD_CORRUPT when the head disagrees with info. */
static __global__ void __launch_bounds__(1024)
    kvmix__payload_tiers_kernel(kvmix__payload_params p) {
    __shared__ int64_t scratch[32];
    const uint8_t *table = p.payload + KVMIX_PAYLOAD_HEADER_BYTES;
    const int64_t n = p.n_tokens, table_bytes = (int64_t)p.head_bytes - KVMIX_PAYLOAD_HEADER_BYTES;
    const int field_bits = 21; /* three tier counts in one int64: a tile has 4096 tokens */
    const int64_t field_mask = ((int64_t)1 << field_bits) - 1;
    bool bad =
        threadIdx.x < KVMIX_PAYLOAD_HEADER_BYTES && p.payload[threadIdx.x] != p.head[threadIdx.x];
    int64_t seen[3] = {0, 0, 0};
    for (int64_t t0 = 0; t0 < table_bytes; t0 += 4 * (int64_t)blockDim.x) {
        const int64_t t = t0 + 4 * (int64_t)threadIdx.x; /* table_bytes is a multiple of 16 */
        const uint32_t word = t < table_bytes ? *(const uint32_t *)(table + t) : 0u;
        int tier_of[4];
        int64_t mine = 0, total;
        for (int b = 0; b < 4; b++) {
            const uint32_t tier = (word >> (8 * b)) & 0xffu;
            int i = -1;
            if (t + b >= n)
                bad |= tier != 0; /* the table's padding */
            else if (tier >= KVMIX_FORMAT_FP16 && tier <= KVMIX_FORMAT_INT4)
                i = (int)tier - KVMIX_FORMAT_FP16;
            else
                bad |= !(p.kind == KVMIX_PAYLOAD_RESIDUAL && tier == KVMIX_PAYLOAD_NO_ROW);
            tier_of[b] = i;
            if (i >= 0) mine += (int64_t)1 << (field_bits * i);
        }
        int64_t before = kvmix__block_scan(mine, scratch, &total) - mine;
        for (int b = 0; b < 4; b++) {
            const int i = tier_of[b];
            if (i < 0) continue;
            const int64_t rank = seen[i] + ((before >> (field_bits * i)) & field_mask);
            if (rank < p.n_rows[i]) p.rows[p.row_base[i] + rank] = (int32_t)(t + b);
            before += (int64_t)1 << (field_bits * i);
        }
        for (int i = 0; i < 3; i++) seen[i] += (total >> (field_bits * i)) & field_mask;
    }
    for (int i = 0; i < 3; i++) bad |= seen[i] != p.n_rows[i];
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        *p.status = bad ? KVMIX_CUDA_PAYLOAD_CORRUPT : 0;
        if (bad && p.error_flags) atomicOr(p.error_flags, KVMIX_CUDA_PAYLOAD_CORRUPT);
    }
}

/* Pack's check, grid (row chunks, slices): every input row that a block will read is
   representable in FP16 (finite, |x| <= 65504), else status and flags get BAD_VALUE. */
static __global__ void __launch_bounds__(256)
    kvmix__payload_check_rows_kernel(kvmix__payload_params p) {
    if (*p.status != 0) return;
    const kvmix__payload_chunk c = kvmix__payload_chunk_of(p);
    const int32_t *rows = p.rows + p.row_base[c.tier] + c.r0;
    const int parts = p.head_dim / 8;
    bool bad = false;
    for (uint64_t s = blockIdx.y; s < p.n_slices; s += gridDim.y) {
        const kvmix__payload_slice sl = kvmix__payload_slice_of(p, s);
        const uint16_t *in = sl.kv ? p.values_in : p.keys_in;
        for (int e = threadIdx.x; e < c.n * parts; e += blockDim.x) {
            const uint4 w =
                *(const uint4 *)(in + kvmix__payload_row(p, sl, rows[e / parts]) + (e % parts) * 8);
            for (int k = 0; k < 8; k++) {
                const uint16_t x = kvmix__u16_of(w, k);
                bad |= p.dtype == KVMIX_CUDA_BF16 ? !(fabsf(kvmix__bf2f(x)) <= 65504.0f)
                                                  : !kvmix__fp16_finite(x);
            }
        }
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0)
        kvmix__payload_report(p, KVMIX_CUDA_PAYLOAD_BAD_VALUE);
}

/* Grid (row chunks, slices), 8 channels (one 16-byte word of input) a thread: writes rows
   [r0, r0 + n) of the chunk's tier in every slice, and the block's zero padding with its last
   rows. FP16 rows go straight through. INT8 and INT4 groups of G = 8 * 2^k <= 256 channels are
   quantized by the G / 8 lanes that hold them: (lo, hi) reduced over those lanes with ties to the
   lower lane, which gives kvmix.h's first-occurrence min and max (the sign of a zero matters);
   then each lane writes its 8 codes and the group's first lane the (scale, min) pair. Other
   group sizes take one thread per group (kvmix__quantize_group). */
static __global__ void __launch_bounds__(256) kvmix__payload_pack_kernel(kvmix__payload_params p) {
    if (*p.status != 0) return; /* a bad head or input row: no body byte is written */
    const kvmix__payload_chunk c = kvmix__payload_chunk_of(p);
    const int32_t *rows = p.rows + p.row_base[c.tier] + c.r0;
    const kvmix__sections sec = p.sec[c.tier];
    const int d = p.head_dim, parts = d / 8, row_bytes = (int)sec.row_bytes, n_units = c.n * parts;
    const int bits = kvmix__format_bits(c.tier + KVMIX_FORMAT_FP16), levels = (1 << bits) - 1;
    const int groups = d / p.group_size, lanes = p.group_size / 8, lane = threadIdx.x & 31;
    const bool by_lanes = lanes <= 32 && (lanes & (lanes - 1)) == 0;
    const bool last = c.r0 + c.n == p.n_rows[c.tier];
    for (uint64_t s = blockIdx.y; s < p.n_slices; s += gridDim.y) {
        const kvmix__payload_slice sl = kvmix__payload_slice_of(p, s);
        const uint16_t *in = sl.kv ? p.values_in : p.keys_in;
        uint8_t *blk = kvmix__payload_block(p, s, c.tier);
        if (c.tier == 0) {
            for (int e = threadIdx.x; e < n_units; e += blockDim.x) {
                const int r = e / parts, k = e % parts;
                uint4 w = *(const uint4 *)(in + kvmix__payload_row(p, sl, rows[r]) + k * 8);
                if (p.dtype == KVMIX_CUDA_BF16) {
                    uint16_t h[8];
                    for (int j = 0; j < 8; j++) h[j] = kvmix__f2h(kvmix__bf2f(kvmix__u16_of(w, j)));
                    w = kvmix__u16x8(h);
                }
                *(uint4 *)(blk + (uint64_t)(c.r0 + r) * row_bytes + k * 16) = w;
            }
            continue;
        }
        if (last && threadIdx.x < 3) { /* the block's padding: at most 3 words after the pairs */
            const uint64_t at =
                kvmix__token_meta_at(&sec, p.n_rows[c.tier], groups, 0) + 4 * threadIdx.x;
            if (at < p.tier_offset[c.tier + 1] - p.tier_offset[c.tier]) *(uint32_t *)(blk + at) = 0;
        }
        if (!by_lanes) {
            for (int task = threadIdx.x; task < c.n * groups; task += blockDim.x) {
                const uint64_t r = (uint64_t)(c.r0 + task / groups), g = (uint64_t)(task % groups);
                kvmix__quantize_group(
                    in + kvmix__payload_row(p, sl, rows[task / groups]) + g * p.group_size, p.dtype,
                    p.group_size, bits, blk + r * row_bytes + g * p.group_size * bits / 8,
                    blk + kvmix__token_meta_at(&sec, (int64_t)r, groups, (int32_t)g));
            }
            continue;
        }
        /* every lane runs every round (the shuffles); a group's lanes are all in or all out */
        for (int e0 = 0; e0 < n_units; e0 += blockDim.x) {
            const int e = e0 + (int)threadIdx.x, r = e / parts, k = e % parts;
            const bool on = e < n_units;
            const uint4 w = on ? *(const uint4 *)(in + kvmix__payload_row(p, sl, rows[r]) + k * 8)
                               : make_uint4(0, 0, 0, 0);
            float x[8];
            for (int j = 0; j < 8; j++) x[j] = kvmix__elem2f(kvmix__u16_of(w, j), p.dtype);
            float lo = x[0], hi = x[0];
            for (int j = 1; j < 8; j++) {
                lo = x[j] < lo ? x[j] : lo;
                hi = x[j] > hi ? x[j] : hi;
            }
            for (int off = 1; off < lanes; off <<= 1) {
                const float o_lo = __shfl_xor_sync(0xffffffffu, lo, off);
                const float o_hi = __shfl_xor_sync(0xffffffffu, hi, off);
                const bool o_first = (lane & off) != 0; /* the other lane's channels come first */
                lo = o_lo < lo || (!(lo < o_lo) && o_first) ? o_lo : lo;
                hi = o_hi > hi || (!(hi > o_hi) && o_first) ? o_hi : hi;
            }
            if (!on) continue;
            const kvmix__qp qp = kvmix__choose_qp(lo, hi, levels, kvmix__scale_grid(bits));
            uint8_t packed[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* 8 codes of 8 or 4 bits */
            for (int j = 0; j < 8; j++)
                kvmix__put_code(packed, j, bits, kvmix__quantize_code(x[j], qp, levels));
            const uint64_t row = (uint64_t)(c.r0 + r);
            if (bits == 8)
                memcpy(blk + row * row_bytes + k * 8, packed, 8);
            else
                memcpy(blk + row * row_bytes + k * 4, packed, 4);
            if (k % lanes == 0)
                *(uint32_t *)(blk + kvmix__token_meta_at(&sec, (int64_t)row, groups, k / lanes)) =
                    (uint32_t)qp.p.scale_h | ((uint32_t)qp.p.min_h << 16);
        }
    }
}

/* Unpack's check over the whole body, one 16-byte word a thread: FP16 rows hold no inf or NaN;
   (scale, min) pairs have a scale with the sign bit clear and both finite (kvmix.h's
   kvmix__check_block). Codes and padding are not read. Sets CORRUPT in status and flags. */
static __global__ void __launch_bounds__(256)
    kvmix__payload_check_blocks_kernel(kvmix__payload_params p) {
    if (*p.status != 0) return;
    const uint64_t slice_words = p.tier_offset[3] / 16, n_words = p.n_slices * slice_words;
    bool bad = false;
    for (uint64_t w = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; w < n_words;
         w += (uint64_t)gridDim.x * blockDim.x) {
        const uint64_t off = (w % slice_words) * 16;
        const int i = off >= p.tier_offset[2] ? 2 : off >= p.tier_offset[1] ? 1 : 0;
        const uint64_t rel = off - p.tier_offset[i];
        if (rel >= p.sec[i].total_bytes || (i != 0 && rel < p.sec[i].meta_offset)) continue;
        const uint4 v = *(const uint4 *)(p.payload + p.head_bytes + w * 16);
        if (i == 0) {
            for (int k = 0; k < 8; k++) bad |= !kvmix__fp16_finite(kvmix__u16_of(v, k));
            continue;
        }
        for (int k = 0; k < 4; k++) {
            if (rel + 4 * k >= p.sec[i].total_bytes) break; /* the block's padding */
            const uint16_t scale_h = kvmix__u16_of(v, 2 * k), min_h = kvmix__u16_of(v, 2 * k + 1);
            bad |= !kvmix__qparams_valid(scale_h, min_h);
        }
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0)
        kvmix__payload_report(p, KVMIX_CUDA_PAYLOAD_CORRUPT);
}

/* Grid (row chunks, slices), 8 channels a thread: decodes rows [r0, r0 + n) of the chunk's tier
   exactly as kvmix.h's kvmix__decode_row and writes them (ROWS) or adds them in float to the
   rows there (RESIDUAL), rounded to dtype. */
static __global__ void __launch_bounds__(256)
    kvmix__payload_unpack_kernel(kvmix__payload_params p) {
    if (*p.status != 0) return; /* a bad head or block: no output is written */
    const kvmix__payload_chunk c = kvmix__payload_chunk_of(p);
    const int32_t *rows = p.rows + p.row_base[c.tier] + c.r0;
    const kvmix__sections sec = p.sec[c.tier];
    const int parts = p.head_dim / 8, groups = p.head_dim / p.group_size;
    for (uint64_t s = blockIdx.y; s < p.n_slices; s += gridDim.y) {
        const kvmix__payload_slice sl = kvmix__payload_slice_of(p, s);
        uint16_t *out = sl.kv ? p.values_out : p.keys_out;
        if (!out) continue;
        const uint8_t *blk = kvmix__payload_block(p, s, c.tier);
        for (int e = threadIdx.x; e < c.n * parts; e += blockDim.x) {
            const int k = e % parts;
            const uint64_t r = (uint64_t)(c.r0 + e / parts);
            float v[8];
            if (c.tier == 0) {
                const uint4 w = *(const uint4 *)(blk + r * sec.row_bytes + k * 16);
                for (int j = 0; j < 8; j++) v[j] = kvmix__h2f(kvmix__u16_of(w, j));
            } else {
                /* 8 channels share a group: G is a multiple of 8 */
                const uint32_t m =
                    *(const uint32_t *)(blk + kvmix__token_meta_at(&sec, (int64_t)r, groups,
                                                                   k * 8 / p.group_size));
                const float scale = kvmix__h2f((uint16_t)(m & 0xffffu)),
                            min = kvmix__h2f((uint16_t)(m >> 16));
                uint64_t q;
                if (c.tier == 1) {
                    const uint2 w = *(const uint2 *)(blk + r * sec.row_bytes + k * 8);
                    q = (uint64_t)w.x | ((uint64_t)w.y << 32);
                } else {
                    const uint32_t w = *(const uint32_t *)(blk + r * sec.row_bytes + k * 4);
                    q = 0;
                    for (int j = 0; j < 8; j++) q |= (uint64_t)((w >> (4 * j)) & 15u) << (8 * j);
                }
                for (int j = 0; j < 8; j++)
                    v[j] = kvmix__dequantize_value((uint32_t)(q >> (8 * j)) & 0xffu, scale, min);
            }
            uint4 *dst = (uint4 *)(out + kvmix__payload_row(p, sl, rows[e / parts]) + k * 8);
            uint16_t h[8];
            if (p.kind == KVMIX_PAYLOAD_RESIDUAL) {
                const uint4 old = *dst;
                for (int j = 0; j < 8; j++)
                    v[j] = __fadd_rn(kvmix__elem2f(kvmix__u16_of(old, j), p.dtype), v[j]);
            }
            for (int j = 0; j < 8; j++) h[j] = kvmix__f2elem(v[j], p.dtype);
            *dst = kvmix__u16x8(h);
        }
    }
}

} // namespace

/* Payload workspace: the status word (int32 at byte 0: 0, or the KVMIX_CUDA_PAYLOAD_* bits the
   kernels found), then from byte 256 the row list (int32 per body row: the token of each FP16
   row, then of each INT8 row, then of each INT4 row, each tier in position order).
   Bytes: 256 + round_up(4 * n_tokens, 256). */
constexpr size_t kvmix__payload_rows_offset = 256;

extern "C" kvmix_result kvmix_cuda_payload_workspace_bytes(int32_t n_tokens, size_t *out_bytes) {
    if (!out_bytes) return KVMIX_ERR_NULL_POINTER;
    if (n_tokens < 0) return KVMIX_ERR_INVALID_ARGUMENT;
    *out_bytes = kvmix__payload_rows_offset + (((size_t)n_tokens * 4 + 255) & ~(size_t)255);
    return KVMIX_SUCCESS;
}

/* Checks info against what kvmix_payload_describe builds from its desc and counts, the dtype and
   the buffers every call needs, and fills p's shape. *nothing: a payload of 0 tokens, for which no
   check of the buffers is made and nothing is enqueued. */
static kvmix_result kvmix__payload_setup(const kvmix_payload_info *info, kvmix_cuda_dtype dtype,
                                         const void *payload, void *workspace,
                                         size_t workspace_bytes, int32_t *error_flags,
                                         kvmix__payload_params *p, bool *nothing) {
    if (!info) return KVMIX_ERR_NULL_POINTER;
    const kvmix_payload_desc &d = info->desc;
    kvmix_payload_info check = *info;
    int64_t n_rows = 0;
    if (kvmix__payload_check_desc(&check.desc) != KVMIX_SUCCESS || d.group_size == 0)
        return KVMIX_ERR_INVALID_ARGUMENT; /* a described payload has its group resolved */
    for (int i = 0; i < 3; i++) {
        if (kvmix__tier_count(info, i) < 0) return KVMIX_ERR_INVALID_ARGUMENT;
        n_rows += kvmix__tier_count(info, i);
    }
    if ((d.kind == KVMIX_PAYLOAD_ROWS ? n_rows != d.n_tokens : n_rows > d.n_tokens) ||
        kvmix__payload_sizes(&check) != KVMIX_SUCCESS || check.head_bytes != info->head_bytes ||
        check.total_bytes != info->total_bytes)
        return KVMIX_ERR_INVALID_ARGUMENT;
    if (!kvmix__head_dim_run(d.head_dim)) return KVMIX_ERR_UNSUPPORTED;
    p->tier_offset[0] = 0;
    for (int i = 0; i < 3; i++) {
        p->sec[i] = kvmix__tier_sections(info, i);
        p->tier_offset[i + 1] = p->tier_offset[i] + kvmix__tier_bytes(info, i);
    }
    const uint64_t head = info->head_bytes;
    const uint64_t slices = (uint64_t)d.n_layers * 2u * (uint64_t)d.n_kv_heads;
    if (dtype != KVMIX_CUDA_FP16 && dtype != KVMIX_CUDA_BF16) return KVMIX_ERR_UNSUPPORTED;
    *nothing = d.n_tokens == 0;
    if (*nothing) return KVMIX_SUCCESS;
    if (!payload || !workspace) return KVMIX_ERR_NULL_POINTER;
    size_t need;
    kvmix_cuda_payload_workspace_bytes(d.n_tokens, &need);
    if (workspace_bytes < need) return KVMIX_ERR_BUFFER_TOO_SMALL;
    if ((((uintptr_t)payload | (uintptr_t)workspace) & 15u) != 0) return KVMIX_ERR_INVALID_ARGUMENT;

    p->kind = d.kind, p->dtype = dtype, p->head_dim = d.head_dim, p->group_size = d.group_size;
    p->n_kv_heads = d.n_kv_heads, p->n_tokens = d.n_tokens, p->n_slices = slices;
    p->first_chunk[0] = 0;
    for (int i = 0; i < 3; i++) {
        p->n_rows[i] = kvmix__tier_count(info, i);
        p->row_base[i] = i == 0 ? 0 : p->row_base[i - 1] + p->n_rows[i - 1];
        p->first_chunk[i + 1] = p->first_chunk[i] + (p->n_rows[i] + kvmix__payload_chunk_rows - 1) /
                                                        kvmix__payload_chunk_rows;
    }
    p->head_bytes = head;
    kvmix__payload_header_put(info, p->head);
    p->payload = (uint8_t *)payload;
    p->keys_in = p->values_in = nullptr;
    p->keys_out = p->values_out = nullptr;
    p->status = (int32_t *)workspace;
    p->rows = (int32_t *)((uint8_t *)workspace + kvmix__payload_rows_offset);
    p->error_flags = error_flags;
    return KVMIX_SUCCESS;
}

/* Enqueues the tiers kernel, the check and the writer (pack or unpack) of a set-up call. */
static kvmix_result kvmix__payload_launch(const kvmix__payload_params &p, bool unpack,
                                          kvmix_stream stream) {
    cudaStream_t s = (cudaStream_t)stream;
    kvmix__payload_tiers_kernel<<<1, 1024, 0, s>>>(p);
    kvmix_result r = kvmix__launch_status();
    if (r != KVMIX_SUCCESS || p.first_chunk[3] == 0) return r; /* no row: the body is empty */
    dim3 grid((unsigned)p.first_chunk[3], (unsigned)(p.n_slices < 65535 ? p.n_slices : 65535));
    if (!unpack) {
        kvmix__payload_check_rows_kernel<<<grid, 256, 0, s>>>(p);
        if ((r = kvmix__launch_status()) != KVMIX_SUCCESS) return r;
        kvmix__payload_pack_kernel<<<grid, 256, 0, s>>>(p);
        return kvmix__launch_status();
    }
    const uint64_t words = p.n_slices * (p.tier_offset[3] / 16);
    const uint64_t blocks = (words + 255) / 256;
    kvmix__payload_check_blocks_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, s>>>(p);
    if ((r = kvmix__launch_status()) != KVMIX_SUCCESS) return r;
    if (!p.keys_out && !p.values_out) return KVMIX_SUCCESS;
    kvmix__payload_unpack_kernel<<<grid, 256, 0, s>>>(p);
    return kvmix__launch_status();
}

/* Pointers (payload, workspace, keys, values) must be 16-byte aligned: INVALID_ARGUMENT. */
extern "C" kvmix_result kvmix_cuda_payload_pack(const kvmix_payload_info *info, const void *keys,
                                                const void *values, kvmix_cuda_dtype dtype,
                                                void *payload, void *workspace,
                                                size_t workspace_bytes, int32_t *error_flags,
                                                kvmix_stream stream) {
    kvmix__payload_params p;
    bool nothing = false;
    kvmix_result r = kvmix__payload_setup(info, dtype, payload, workspace, workspace_bytes,
                                          error_flags, &p, &nothing);
    if (r != KVMIX_SUCCESS || nothing) return r;
    if (p.first_chunk[3] > 0 && (!keys || !values)) return KVMIX_ERR_NULL_POINTER;
    if ((((uintptr_t)keys | (uintptr_t)values) & 15u) != 0) return KVMIX_ERR_INVALID_ARGUMENT;
    p.keys_in = (const uint16_t *)keys, p.values_in = (const uint16_t *)values;
    return kvmix__payload_launch(p, false, stream);
}

extern "C" kvmix_result kvmix_cuda_payload_unpack(const kvmix_payload_info *info,
                                                  const void *payload, kvmix_cuda_dtype dtype,
                                                  void *keys, void *values, void *workspace,
                                                  size_t workspace_bytes, int32_t *error_flags,
                                                  kvmix_stream stream) {
    kvmix__payload_params p;
    bool nothing = false;
    kvmix_result r = kvmix__payload_setup(info, dtype, payload, workspace, workspace_bytes,
                                          error_flags, &p, &nothing);
    if (r != KVMIX_SUCCESS || nothing) return r;
    if ((((uintptr_t)keys | (uintptr_t)values) & 15u) != 0) return KVMIX_ERR_INVALID_ARGUMENT;
    p.keys_out = (uint16_t *)keys, p.values_out = (uint16_t *)values;
    return kvmix__payload_launch(p, true, stream);
}
