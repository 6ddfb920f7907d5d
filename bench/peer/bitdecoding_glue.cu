/* bitdecoding_glue.cu - BitDecoding's decode (github DD-DuDa/BitDecoding, its kernels built
 * unchanged against stand-in PyTorch headers) behind a C entry point, so that bench_decode.py
 * times it in the same process as kvmix and cuDNN. Its supported form: keys quantized per
 * channel over groups of 128 tokens, values per token over 128 channels, 2 or 4 bits, head_dim
 * 128; its packer (kvcache_qpack) writes the packed cache from FP16 rows, its split-KV kernel
 * decodes one query token of every head, the query heads of a kv head as rows of one tile. */
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <vector>

#include <cutlass/numeric_types.h>

#include "include/flash.h"

namespace {

constexpr int kHeadDim = 128, kGroup = 128, kBlockN = 256;

/* The split count: the fewest splits whose waves fill at least 85% of the best fill over
   1..128 splits (two CTAs of 128 threads an SM), counting a split that leaves the same blocks
   per split as one fewer as no better. */
int choose_splits(int ctas, int sms, int n_blocks) {
    if (ctas >= 0.8f * sms) return 1;
    int most = std::min(std::min(128, sms), n_blocks);
    std::vector<float> fill(most + 1, 0.0f);
    float best = 0.0f;
    auto per = [&](int s) { return (n_blocks + s - 1) / s; };
    for (int s = 1; s <= most; s++) {
        if (s > 1 && per(s) == per(s - 1)) continue;
        float waves = float(ctas * s) / sms;
        fill[s] = waves / std::ceil(waves);
        best = std::max(best, fill[s]);
    }
    for (int s = 1; s <= most; s++)
        if (fill[s] >= 0.85f * best) return s;
    return 1;
}

/* Pseudo-random rows in [-1, 1): uniform, or (levels) one of -1, -1/3, 1/3, 1, which every group
   of 128 holds at both ends almost surely, so that 2- and 4-bit codes represent them exactly. */
__global__ void fill_half(__half *x, size_t n, uint32_t salt, bool levels) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ salt;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        x[i] = __float2half(levels ? (float)(h & 3u) * (2.0f / 3.0f) - 1.0f
                                   : (float)(h & 0xffff) / 32768.0f - 1.0f);
    }
}

/* NMSE of sequence 0's outputs (every query head) against exact attention over its FP16 rows
   before packing, in double on the host: what the quantization and the kernel leave. nmse[0]
   over every output channel, nmse[1] over channels 0-15 of each 32 and nmse[2] over 16-31 (a
   value tile of the peer's 2-bit path covers 16 words of a 32-channel MMA span). */
void nmse_sequence0(const __half *k, const __half *v, const __half *q, const __half *o, int s,
                    int h, int h_k, int d, double nmse[3]) {
    std::vector<__half> kh((size_t)s * h_k * d), vh(kh.size()), qh((size_t)h * d), oh(qh.size());
    cudaMemcpy(kh.data(), k, kh.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(vh.data(), v, vh.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(qh.data(), q, qh.size() * 2, cudaMemcpyDeviceToHost);
    cudaMemcpy(oh.data(), o, oh.size() * 2, cudaMemcpyDeviceToHost);
    double err[3] = {0.0, 0.0, 0.0}, ref[3] = {0.0, 0.0, 0.0};
    std::vector<double> logit(s), out(d);
    for (int head = 0; head < h; head++) {
        const int kv = head / (h / h_k);
        double m = -1e300, l = 0.0;
        for (int t = 0; t < s; t++) {
            double x = 0.0;
            for (int c = 0; c < d; c++)
                x += (double)__half2float(qh[(size_t)head * d + c]) *
                     __half2float(kh[((size_t)t * h_k + kv) * d + c]);
            logit[t] = x / std::sqrt((double)d);
            m = std::max(m, logit[t]);
        }
        std::fill(out.begin(), out.end(), 0.0);
        for (int t = 0; t < s; t++) {
            const double p = std::exp(logit[t] - m);
            l += p;
            for (int c = 0; c < d; c++) out[c] += p * __half2float(vh[((size_t)t * h_k + kv) * d + c]);
        }
        for (int c = 0; c < d; c++) {
            const double want = out[c] / l, got = __half2float(oh[(size_t)head * d + c]);
            for (int part : {0, 1 + (c % 32 >= 16)})
                err[part] += (got - want) * (got - want), ref[part] += want * want;
        }
    }
    for (int part = 0; part < 3; part++) nmse[part] = err[part] / ref[part];
}

template <int Bits> void pack(Flash_fwd_params &p, cudaStream_t st) {
    run_kvcache_qpack_<cutlass::half_t, kHeadDim, 1, Bits, kGroup>(p, st);
}
template <int Bits> void decode(Flash_fwd_params &p, cudaStream_t st) {
    run_mha_fwd_splitkv_dispatch<cutlass::half_t, kHeadDim, false, 1, Bits, kGroup>(p, st);
}

} // namespace

/* Packs random FP16 keys and values of b sequences of s tokens (h_k kv heads; `levels`: rows of
   four values that 2 and 4 bits represent exactly, fill_half) and times `reps` decode calls for h
   query heads (h / h_k a kv head). *out_ms: milliseconds a call (events around the reps);
   *out_bytes: the packed cache and its parameters, what a call reads; *out_splits: the split
   count; *out_finite: whether every output is a number; out_nmse: sequence 0's outputs against
   exact attention over the rows before packing (nmse_sequence0's three). Returns 0, or -1 for a
   shape it does not take, -2 for a CUDA error. s must be a multiple of 256. */
static int run_peer(int b, int s, int h, int h_k, int bits, int reps, bool levels, double *out_ms,
                    double *out_bytes, int *out_splits, int *out_finite, double out_nmse[3]) {
    if ((bits != 2 && bits != 4) || b < 1 || s < kBlockN || s % kBlockN || h_k < 1 || h % h_k)
        return -1;
    const int d = kHeadDim, pack_n = 16 / bits, groups = h / h_k;
    const size_t rows = (size_t)b * s * h_k * d;
    const size_t k_pack_n = (size_t)b * (s / pack_n) * h_k * d, k_par_n = (size_t)b * (s / kGroup) * h_k * d;
    const size_t v_pack_n = (size_t)b * s * h_k * (d / pack_n), v_par_n = (size_t)b * (d / kGroup) * h_k * s;
    __half *k = nullptr, *v = nullptr, *q = nullptr, *o = nullptr;
    uint16_t *k_pack = nullptr, *v_pack = nullptr;
    float *k_par = nullptr, *v_par = nullptr, *lse = nullptr, *lse_acc = nullptr, *o_acc = nullptr;
    int dev = 0, sms = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    const int n_blocks = (s + kBlockN - 1) / kBlockN;
    const int splits = choose_splits(b * h_k, 2 * sms, n_blocks);
    bool ok = cudaMalloc(&k, rows * 2) == cudaSuccess && cudaMalloc(&v, rows * 2) == cudaSuccess &&
              cudaMalloc(&q, (size_t)b * h * d * 2) == cudaSuccess &&
              cudaMalloc(&o, (size_t)b * h * d * 2) == cudaSuccess &&
              cudaMalloc(&k_pack, k_pack_n * 2) == cudaSuccess &&
              cudaMalloc(&v_pack, v_pack_n * 2) == cudaSuccess &&
              cudaMalloc(&k_par, k_par_n * 4) == cudaSuccess &&
              cudaMalloc(&v_par, v_par_n * 4) == cudaSuccess &&
              cudaMalloc(&lse, (size_t)b * h * 4) == cudaSuccess &&
              cudaMalloc(&lse_acc, (size_t)splits * b * h * 4) == cudaSuccess &&
              cudaMalloc(&o_acc, (size_t)splits * b * h * d * 4) == cudaSuccess;
    cudaStream_t st = 0;
    if (ok) {
        fill_half<<<1024, 256>>>(k, rows, 1u, levels), fill_half<<<1024, 256>>>(v, rows, 2u, levels);
        fill_half<<<64, 256>>>(q, (size_t)b * h * d, 3u, false);
        Flash_fwd_params p = {}; /* the packer's: FP16 rows [b][s][h_k][d] in, packed out */
        p.k_ptr = k, p.v_ptr = v, p.K_pack_ptr = k_pack, p.k_params_ptr = k_par;
        p.v_pack_ptr = v_pack, p.v_params_ptr = v_par;
        p.k_row_stride = p.v_row_stride = (int64_t)h_k * d, p.k_head_stride = p.v_head_stride = d;
        p.k_batch_stride = p.v_batch_stride = (int64_t)s * h_k * d;
        p.K_pack_row_stride = (int64_t)h_k * d, p.K_pack_head_stride = d;
        p.K_pack_batch_stride = (int64_t)(s / pack_n) * h_k * d;
        p.k_params_row_stride = (int64_t)h_k * d, p.k_params_head_stride = d, p.k_params_dim_stride = 1;
        p.k_params_batch_stride = (int64_t)(s / kGroup) * h_k * d;
        p.v_pack_row_stride = (int64_t)h_k * (d / pack_n), p.v_pack_head_stride = d / pack_n;
        p.v_pack_batch_stride = (int64_t)s * h_k * (d / pack_n);
        p.v_params_row_stride = 1, p.v_params_head_stride = s, p.v_params_dim_stride = (int64_t)h_k * s;
        p.v_params_batch_stride = (int64_t)(d / kGroup) * h_k * s;
        p.b = b, p.h = h_k, p.h_k = h_k, p.h_h_k_ratio = 1, p.seqlen_k = s, p.d = d;
        p.quant_mode = "k-channel", p.group_size = kGroup, p.page_block_size = 1;
        if (bits == 4) pack<4>(p, st); else pack<2>(p, st);
        /* the decode's: q [b][1][h][d] read as [b][groups][h_k][d] (the query heads of a kv head
           as the rows of its tile), out alike */
        Flash_fwd_params f = p;
        f.k_ptr = f.v_ptr = nullptr;
        f.q_ptr = q, f.o_ptr = o, f.softmax_lse_ptr = lse;
        f.q_row_stride = f.o_row_stride = d, f.q_head_stride = f.o_head_stride = (int64_t)groups * d;
        f.q_batch_stride = f.o_batch_stride = (int64_t)h * d;
        f.h = h_k, f.h_k = h_k, f.h_h_k_ratio = 1;
        f.seqlen_q = groups, f.seqlen_q_rounded = 128, f.seqlen_k_rounded = (s + 127) / 128 * 128;
        f.d_rounded = d;
        const float scale = 1.0f / std::sqrt((float)d);
        f.scale_softmax = scale, f.scale_softmax_log2 = scale * (float)M_LOG2E, f.softcap = 0.0f;
        f.p_dropout = 1.0f, f.p_dropout_in_uint8_t = 255, f.rp_dropout = 1.0f;
        f.scale_softmax_rp_dropout = scale;
        f.is_causal = false, f.window_size_left = f.window_size_right = -1;
        f.is_seqlens_k_cumulative = true, f.rotary_dim = 0, f.seqlenq_ngroups_swapped = true;
        f.num_splits = splits, f.softmax_lseaccum_ptr = lse_acc, f.oaccum_ptr = o_acc;
        f.page_block_size_pack = 1; /* as its decode entry sets it without a block table */
        auto call = [&] { if (bits == 4) decode<4>(f, st); else decode<2>(f, st); };
        for (int i = 0; i < 5; i++) call();
        cudaEvent_t e0, e1;
        cudaEventCreate(&e0), cudaEventCreate(&e1);
        cudaEventRecord(e0, st);
        for (int i = 0; i < reps; i++) call();
        cudaEventRecord(e1, st);
        ok = cudaEventSynchronize(e1) == cudaSuccess && cudaGetLastError() == cudaSuccess;
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, e0, e1);
        cudaEventDestroy(e0), cudaEventDestroy(e1);
        std::vector<__half> out((size_t)b * h * d);
        ok = ok && cudaMemcpy(out.data(), o, out.size() * 2, cudaMemcpyDeviceToHost) == cudaSuccess;
        int finite = 1;
        for (const __half &x : out) finite &= std::isfinite(__half2float(x));
        *out_ms = ms / reps;
        *out_bytes = 2.0 * (k_pack_n + v_pack_n) + 4.0 * (k_par_n + v_par_n);
        *out_splits = splits, *out_finite = finite;
        if (ok)
            nmse_sequence0(k, v, q, o, s, h, h_k, d, out_nmse);
        else
            out_nmse[0] = out_nmse[1] = out_nmse[2] = NAN;
    }
    cudaFree(k), cudaFree(v), cudaFree(q), cudaFree(o), cudaFree(k_pack), cudaFree(v_pack);
    cudaFree(k_par), cudaFree(v_par), cudaFree(lse), cudaFree(lse_acc), cudaFree(o_acc);
    return ok ? 0 : -2;
}

extern "C" int bitdecoding_time(int b, int s, int h, int h_k, int bits, int reps, double *out_ms,
                                double *out_bytes, int *out_splits, int *out_finite,
                                double *out_nmse) {
    double nmse[3];
    const int r =
        run_peer(b, s, h, h_k, bits, reps, false, out_ms, out_bytes, out_splits, out_finite, nmse);
    *out_nmse = nmse[0];
    return r;
}

/* The peer's own error at `bits`: sequence 0's NMSE (as bitdecoding_time's) over rows that its
   codes represent exactly, where only float rounding should remain; one decode call. *out_low /
   *out_high: the same over output channels 0-15 / 16-31 of each 32. */
extern "C" int bitdecoding_exact_nmse(int b, int s, int h, int h_k, int bits, double *out_nmse,
                                      double *out_low, double *out_high) {
    double ms = 0.0, bytes = 0.0, nmse[3];
    int splits = 0, finite = 0;
    const int r = run_peer(b, s, h, h_k, bits, 1, true, &ms, &bytes, &splits, &finite, nmse);
    *out_nmse = nmse[0], *out_low = nmse[1], *out_high = nmse[2];
    return r;
}
