/* GPU tests of kvmix_cuda.cu against kvmix.h's CPU references.
   Usage: test_cuda [--quick] [--seed N] [--only args|quantize|view|decode|arena|payload].
   Prints "N passed, N failed"; exit status 1 on failure. */
#define KVMIX_IMPLEMENTATION
#include "../kvmix.h"
#include "../kvmix_cuda.h"
#include "device_arena_scenario.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <vector>

static int g_passed, g_failed;
static uint64_t g_rng;

static void check(bool ok, const char *what) {
    if (ok)
        g_passed++;
    else {
        g_failed++;
        printf("FAIL: %s\n", what);
    }
}

#define CUDA_OK(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            printf("FAIL: %s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));     \
            g_failed++;                                                                            \
            return;                                                                                \
        }                                                                                          \
    } while (0)

static uint64_t rnd(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}
static float urand(void) { return (float)(rnd() >> 40) / 16777216.0f; }
static float nrand(void) {
    float u = urand() + 1e-7f, v = urand();
    return sqrtf(-2.0f * logf(u)) * cosf(6.2831853f * v);
}
static int irand(int n) { return (int)(rnd() % (uint64_t)n); }

/* A float rounded to dtype (FP16 or BF16), and back. */
static uint16_t to_dtype(float x, kvmix_cuda_dtype dt) {
    return dt == KVMIX_CUDA_BF16 ? kvmix_fp32_to_bf16(x) : kvmix_fp32_to_fp16(x);
}
static float from_dtype(uint16_t h, kvmix_cuda_dtype dt) {
    return dt == KVMIX_CUDA_BF16 ? kvmix_bf16_to_fp32(h) : kvmix_fp16_to_fp32(h);
}

/* Random fp16 rows [n][stride], D used: mixed distributions, outlier channels, constant
   channels and groups, negative zeros. */
static void fill_rows(std::vector<uint16_t> &h, int n, int d, int stride) {
    h.assign((size_t)n * stride, 0x7e00); /* NaN padding outside the used channels */
    std::vector<float> ch_scale(d);
    for (int c = 0; c < d; c++) {
        float s = 0.5f + urand();
        if (irand(8) == 0) s *= 20.0f;
        if (irand(16) == 0) s = 0.0f;
        ch_scale[c] = s;
    }
    int kind = irand(4);
    for (int t = 0; t < n; t++)
        for (int c = 0; c < d; c++) {
            float x = kind == 3 ? (float)(irand(9) - 4) * 0.25f
                                : nrand() * ch_scale[c] + (kind == 1 ? 3.0f : 0.0f);
            if (ch_scale[c] == 0.0f) x = kind == 2 ? -0.0f : 1.5f;
            h[(size_t)t * stride + c] = kvmix_fp32_to_fp16(x);
        }
}

static std::vector<float> to_float(const std::vector<uint16_t> &h) {
    std::vector<float> f(h.size());
    for (size_t i = 0; i < h.size(); i++) f[i] = kvmix_fp16_to_fp32(h[i]);
    return f;
}

static size_t align16(size_t x) { return (x + 15) & ~(size_t)15; }

/* ---- quantize ---------------------------------------------------------------------------- */

static void test_quantize_case(kvmix_layout l) {
    char name[160];
    const int d = l.head_dim, n = l.n_tokens, stride = d + 8, n_jobs = 3;
    size_t block_bytes = 0;
    kvmix_layout_bytes(&l, &block_bytes);
    std::vector<uint16_t> src;
    fill_rows(src, n * n_jobs, d, stride);
    std::vector<float> srcf = to_float(src);
    size_t gap = 48, pitch = align16(block_bytes + gap), dst_bytes = pitch * n_jobs;
    std::vector<uint8_t> expect(dst_bytes, 0xA5);
    std::vector<kvmix_cuda_quantize_job> jobs(n_jobs);
    for (int j = 0; j < n_jobs; j++) {
        int jj = n_jobs - 1 - j; /* block j from source rows of job jj: offsets are not in order */
        jobs[j].src_offset = (uint64_t)jj * n * stride;
        jobs[j].dst_offset = pitch * j;
        jobs[j].first_row = 0;
        jobs[j].n_rows = n;
        kvmix_ref_quantize(&l, srcf.data() + (size_t)jj * n * stride, stride,
                           expect.data() + pitch * j, block_bytes);
    }
    uint16_t *d_src;
    uint8_t *d_dst;
    kvmix_cuda_quantize_job *d_jobs;
    int32_t *d_flags, flags = 0;
    CUDA_OK(cudaMalloc(&d_src, src.size() * 2));
    CUDA_OK(cudaMalloc(&d_dst, dst_bytes));
    CUDA_OK(cudaMalloc(&d_jobs, sizeof(kvmix_cuda_quantize_job) * (n_jobs + n)));
    CUDA_OK(cudaMalloc(&d_flags, 4));
    CUDA_OK(cudaMemcpy(d_src, src.data(), src.size() * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d_dst, 0xA5, dst_bytes));
    CUDA_OK(cudaMemset(d_flags, 0, 4));
    CUDA_OK(cudaMemcpy(d_jobs, jobs.data(), sizeof(kvmix_cuda_quantize_job) * n_jobs,
                       cudaMemcpyHostToDevice));
    kvmix_result r = kvmix_cuda_quantize(&l, d_src, stride, d_dst, d_jobs, n_jobs, d_flags, 0);
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> got(dst_bytes);
    CUDA_OK(cudaMemcpy(got.data(), d_dst, dst_bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(&flags, d_flags, 4, cudaMemcpyDeviceToHost));
    size_t first_diff = dst_bytes;
    for (size_t i = 0; i < dst_bytes; i++)
        if (got[i] != expect[i]) {
            first_diff = i;
            break;
        }
    snprintf(
        name, sizeof name,
        "quantize fmt %d D %d n %d boost %d: bytes equal (first diff %zu of %zu), r %d flags %d",
        l.format, d, n, l.n_boost, first_diff, dst_bytes, r, flags);
    check(r == KVMIX_SUCCESS && flags == 0 && first_diff == dst_bytes, name);

    /* decode-time append: one job per row into one block */
    if (l.format == KVMIX_FORMAT_FP16 || l.format == KVMIX_FORMAT_INT8 ||
        l.format == KVMIX_FORMAT_INT4 || l.format == KVMIX_FORMAT_INT2) {
        std::vector<kvmix_cuda_quantize_job> rows(n);
        for (int t = 0; t < n; t++) {
            rows[t].src_offset = (uint64_t)t * stride;
            rows[t].dst_offset = 0;
            rows[t].first_row = t;
            rows[t].n_rows = 1;
        }
        CUDA_OK(cudaMemcpy(d_jobs, rows.data(), sizeof(kvmix_cuda_quantize_job) * n,
                           cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(d_dst, 0xA5, dst_bytes));
        r = kvmix_cuda_quantize(&l, d_src, stride, d_dst, d_jobs, n, d_flags, 0);
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(got.data(), d_dst, dst_bytes, cudaMemcpyDeviceToHost));
        std::vector<uint8_t> exp1(block_bytes);
        kvmix_ref_quantize(&l, srcf.data(), stride, exp1.data(), block_bytes);
        bool same = memcmp(got.data(), exp1.data(), block_bytes) == 0 && got[block_bytes] == 0xA5;
        snprintf(name, sizeof name, "append fmt %d D %d n %d: bytes equal", l.format, d, n);
        check(r == KVMIX_SUCCESS && same, name);
    }
    /* a job with an infinite input writes nothing and sets the flag */
    {
        uint16_t inf = 0x7c00;
        CUDA_OK(
            cudaMemcpy(d_src + (size_t)(n - 1) * stride + d / 2, &inf, 2, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(d_jobs, jobs.data(), sizeof(kvmix_cuda_quantize_job) * n_jobs,
                           cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(d_dst, 0xA5, dst_bytes));
        CUDA_OK(cudaMemset(d_flags, 0, 4));
        r = kvmix_cuda_quantize(&l, d_src, stride, d_dst, d_jobs, n_jobs, d_flags, 0);
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(got.data(), d_dst, dst_bytes, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(&flags, d_flags, 4, cudaMemcpyDeviceToHost));
        /* job 2 reads source block 0 (which holds the inf): its destination stays poisoned */
        bool untouched = true;
        for (size_t i = 0; i < block_bytes; i++) untouched &= got[pitch * 2 + i] == 0xA5;
        bool others = memcmp(got.data(), expect.data(), pitch * 2) == 0;
        snprintf(name, sizeof name, "quantize fmt %d D %d n %d: inf input flagged, block untouched",
                 l.format, d, n);
        check(r == KVMIX_SUCCESS && flags == KVMIX_CUDA_QUANTIZE_BAD_VALUE && untouched && others,
              name);
    }
    cudaFree(d_src);
    cudaFree(d_dst);
    cudaFree(d_jobs);
    cudaFree(d_flags);
}

static void test_quantize(bool quick) {
    const int dims[] = {64, 128, 256};
    const int ns[] = {1, 31, 32, 33, 64, 128};
    for (int di = 0; di < 3; di++)
        for (int ni = 0; ni < 6; ni++) {
            if (quick && (di == 2 || (ni != 0 && ni != 3))) continue;
            for (int f = KVMIX_FORMAT_FP16; f <= KVMIX_FORMAT_BOOSTED; f++) {
                /* BOOSTED: two boost counts; per-token integer formats: groups of 32 and one
                   group per head (the value geometry of a Kitty layout) */
                bool per_token =
                    f == KVMIX_FORMAT_INT8 || f == KVMIX_FORMAT_INT4 || f == KVMIX_FORMAT_INT2;
                for (int b = 0; b < (f == KVMIX_FORMAT_BOOSTED || per_token ? 2 : 1); b++) {
                    kvmix_layout l;
                    memset(&l, 0, sizeof l);
                    l.format = (kvmix_format)f;
                    l.n_tokens = ns[ni];
                    l.head_dim = dims[di];
                    l.n_boost = f == KVMIX_FORMAT_BOOSTED ? (b ? dims[di] / 4 : dims[di] / 8) : 0;
                    l.group_size = per_token && b ? dims[di] : 0;
                    kvmix_layout_resolve(&l, NULL);
                    test_quantize_case(l);
                }
            }
        }
}

/* ---- views ------------------------------------------------------------------------------- */

struct test_view {
    int d, n_kv, n_seqs, n_boost;
    std::vector<uint8_t> arena;
    std::vector<kvmix_view_span> spans;
    std::vector<int32_t> first;
    std::vector<uint8_t> dead;
    std::vector<int64_t> seq_tokens;
    kvmix_view host; /* host pointers */
    kvmix_view dev;  /* device pointers */
    uint8_t *d_arena;
    kvmix_view_span *d_spans;
    int32_t *d_first;
    uint8_t *d_dead;
};

static double g_decode_max_out, g_decode_max_lse; /* largest decode nmse seen (bound 1e-6) */
/* the format pairs the decode kernel compiles specialized (kvmix__tc_dispatch) */
static const int common_pairs[][2] = {
    {KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_INT2}, {KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4},
    {KVMIX_FORMAT_BOOSTED, KVMIX_FORMAT_INT2},      {KVMIX_FORMAT_INT2, KVMIX_FORMAT_INT2},
    {KVMIX_FORMAT_INT8, KVMIX_FORMAT_INT8},         {KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16}};
static int g_group = 32;     /* group size of the per-token blocks of the views built next */
static int g_long_pages = 0; /* > 0: the long sequences of the next views have this many spans */
static int g_wide_rows = 0;  /* bit 0: values, bit 1: keys of the next views get wide rows */

static const int key_formats[] = {KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED,
                                  KVMIX_FORMAT_INT4,         KVMIX_FORMAT_INT8,
                                  KVMIX_FORMAT_INT2,         KVMIX_FORMAT_FP16};
static const int value_formats[] = {KVMIX_FORMAT_INT2,         KVMIX_FORMAT_INT4,
                                    KVMIX_FORMAT_INT8,         KVMIX_FORMAT_FP16,
                                    KVMIX_FORMAT_INT2_CHANNEL, KVMIX_FORMAT_BOOSTED};

/* About one row in 16 of rows [n][d] times 128: per-token scales past 64 (1024 * scale past
   fp16's range) beside ordinary ones in the same 16-token tiles. fill_rows stays within +-174 (nrand
   below 5.7, channel scales below 30), so elements stay within +-22300 and a row's range, the
   largest code * scale, within fp16. */
static void widen_rows(std::vector<uint16_t> &rows, int n, int d) {
    for (int t = 0; t < n; t++)
        if (irand(16) == 0)
            for (int c = 0; c < d; c++) {
                uint16_t &h = rows[(size_t)t * d + c];
                h = kvmix_fp32_to_fp16(kvmix_fp16_to_fp32(h) * 128.0f);
            }
}

/* Appends one span of n tokens: keys and values of every kv head quantized by the CPU. */
static void add_span(test_view &v, int kf, int vf, int n, bool with_dead) {
    kvmix_view_span s;
    memset(&s, 0, sizeof s);
    s.n_tokens = n;
    s.key_format = (uint8_t)kf;
    s.value_format = (uint8_t)vf;
    for (int which = 0; which < 2; which++) {
        kvmix_layout l;
        memset(&l, 0, sizeof l);
        l.format = (kvmix_format)(which ? vf : kf);
        l.n_tokens = n;
        l.head_dim = v.d;
        l.n_boost = l.format == KVMIX_FORMAT_BOOSTED ? v.n_boost : 0;
        l.group_size = (l.format == KVMIX_FORMAT_INT8 || l.format == KVMIX_FORMAT_INT4 ||
                        l.format == KVMIX_FORMAT_INT2)
                           ? g_group
                           : 0;
        kvmix_layout_resolve(&l, NULL);
        size_t bytes = 0;
        kvmix_layout_bytes(&l, &bytes);
        size_t head_bytes = align16(bytes) + 16 * (size_t)irand(2);
        size_t offset = align16(v.arena.size());
        v.arena.resize(offset + head_bytes * v.n_kv, 0x5A);
        for (int h = 0; h < v.n_kv; h++) {
            std::vector<uint16_t> rows;
            fill_rows(rows, n, v.d, v.d);
            if (g_wide_rows & (which ? 1 : 2)) widen_rows(rows, n, v.d);
            std::vector<float> f = to_float(rows);
            kvmix_ref_quantize(&l, f.data(), v.d, v.arena.data() + offset + head_bytes * h, bytes);
        }
        if (which)
            s.value_offset = offset, s.value_head_bytes = (uint32_t)head_bytes;
        else
            s.key_offset = offset, s.key_head_bytes = (uint32_t)head_bytes;
    }
    s.dead_index = -1;
    if (with_dead) {
        s.dead_index = (int32_t)v.dead.size();
        for (int t = 0; t < n; t++) v.dead.push_back(irand(5) == 0);
    }
    v.spans.push_back(s);
}

/* Sequences of sinks, pages of mixed formats and sizes, a partial buffer, dead tokens; plus an
   empty sequence and an all-dead one. */
static void build_view(test_view &v, int d, int n_kv, int n_seqs, int n_boost, bool quick) {
    v.d = d, v.n_kv = n_kv, v.n_seqs = n_seqs, v.n_boost = n_boost;
    v.arena.clear(), v.spans.clear(), v.first.clear(), v.dead.clear(), v.seq_tokens.clear();
    int next_pair = 0;
    for (int s = 0; s < n_seqs; s++) {
        v.first.push_back((int32_t)v.spans.size());
        int64_t tokens = 0;
        int kind = s % 4;
        if (kind == 1) {
            v.seq_tokens.push_back(0);
            continue;
        }                /* empty */
        if (kind == 2) { /* one fully dead span */
            add_span(v, KVMIX_FORMAT_INT4, KVMIX_FORMAT_INT4, 33, false);
            v.spans.back().dead_index = (int32_t)v.dead.size();
            for (int t = 0; t < 33; t++) v.dead.push_back(1);
            v.seq_tokens.push_back(33);
            continue;
        }
        add_span(v, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, 4, false); /* sinks */
        tokens += 4;
        int pages = g_long_pages ? g_long_pages : quick ? 4 : 4 + irand(6);
        for (int i = 0; i < pages; i++) {
            const int sizes[] = {32, 64, 128};
            int n = g_long_pages ? 16 << irand(2) : sizes[irand(3)];
            /* every other page one of the pairs the decode kernel specializes, in turn over the
               view (all six once its live sequences hold six such pages: every view of 5 or more
               sequences), the others paired round-robin */
            int kf = key_formats[(i + s) % 6], vf = value_formats[(i + 2 * s) % 6];
            if (i % 2) {
                const int *pair = common_pairs[next_pair++ % 6];
                kf = pair[0], vf = pair[1];
            }
            add_span(v, kf, vf, n, irand(3) == 0);
            tokens += n;
        }
        const int tails[] = {1, 31, 33};
        int n = tails[irand(3)];
        add_span(v, KVMIX_FORMAT_FP16, KVMIX_FORMAT_FP16, n, irand(2) == 0); /* buffer */
        tokens += n;
        v.seq_tokens.push_back(tokens);
    }
    v.first.push_back((int32_t)v.spans.size());
    if (v.dead.empty()) v.dead.push_back(0);
    v.arena.resize(align16(v.arena.size()) + 16, 0x5A);
    memset(&v.host, 0, sizeof v.host);
    v.host.n_seqs = n_seqs, v.host.n_kv_heads = n_kv, v.host.head_dim = d,
    v.host.group_size = g_group;
    v.host.n_boost = n_boost, v.host.n_spans = (int32_t)v.spans.size();
    v.host.n_dead_flags = (int32_t)v.dead.size();
    v.host.base = v.arena.data(), v.host.base_bytes = v.arena.size();
    v.host.spans = v.spans.data(), v.host.seq_first_span = v.first.data(),
    v.host.dead = v.dead.data();
    v.d_arena = nullptr, v.d_spans = nullptr, v.d_first = nullptr, v.d_dead = nullptr;
}

static bool upload_view(test_view &v) {
    bool ok =
        cudaMalloc(&v.d_arena, v.arena.size()) == cudaSuccess &&
        cudaMalloc(&v.d_spans, sizeof(kvmix_view_span) * (v.spans.size() + 1)) == cudaSuccess &&
        cudaMalloc(&v.d_first, 4 * v.first.size()) == cudaSuccess &&
        cudaMalloc(&v.d_dead, v.dead.size()) == cudaSuccess &&
        cudaMemcpy(v.d_arena, v.arena.data(), v.arena.size(), cudaMemcpyHostToDevice) ==
            cudaSuccess &&
        cudaMemcpy(v.d_spans, v.spans.data(), sizeof(kvmix_view_span) * v.spans.size(),
                   cudaMemcpyHostToDevice) == cudaSuccess &&
        cudaMemcpy(v.d_first, v.first.data(), 4 * v.first.size(), cudaMemcpyHostToDevice) ==
            cudaSuccess &&
        cudaMemcpy(v.d_dead, v.dead.data(), v.dead.size(), cudaMemcpyHostToDevice) == cudaSuccess;
    v.dev = v.host;
    v.dev.base = v.d_arena, v.dev.spans = v.d_spans, v.dev.seq_first_span = v.d_first,
    v.dev.dead = v.d_dead;
    check(ok, "upload view");
    return ok;
}

static void free_view(test_view &v) {
    cudaFree(v.d_arena);
    cudaFree(v.d_spans);
    cudaFree(v.d_first);
    cudaFree(v.d_dead);
}

static double nmse(const std::vector<float> &a, const std::vector<float> &ref, bool *finite_ok) {
    double num = 0.0, den = 0.0;
    bool ok = true;
    for (size_t i = 0; i < a.size(); i++) {
        if (isinf(ref[i])) {
            ok &= a[i] == ref[i];
            continue;
        }
        if (!isfinite(a[i])) {
            ok = false;
            continue;
        }
        double e = (double)a[i] - ref[i];
        num += e * e;
        den += (double)ref[i] * ref[i];
    }
    *finite_ok = ok;
    return den > 0.0 ? num / den : num;
}

/* ---- decode ------------------------------------------------------------------------------ */

/* The exact reference rounded to dtype; where it lies within 1e-5 (relative) of the midpoint
   between that and the GPU's value, the GPU's value: either rounding is right there. Outputs of
   sequences with one dominant token sit on such midpoints (a dequantized value has few bits). */
static float rounded_reference(float got, float ref, kvmix_cuda_dtype dtype) {
    const float r = from_dtype(to_dtype(ref, dtype), dtype);
    const bool tie = got != r && fabs((double)ref - 0.5 * ((double)got + r)) <= 1e-5 * fabs(ref);
    return tie ? got : r;
}

/* Queries of n_q heads for every sequence of v: q in dtype (qh) and as floats (qf). */
static void random_queries(const test_view &v, int n_q, kvmix_cuda_dtype dtype,
                           std::vector<uint16_t> &qh, std::vector<float> &qf) {
    const size_t n = (size_t)v.n_seqs * n_q * v.d;
    qh.resize(n), qf.resize(n);
    for (size_t i = 0; i < n; i++) {
        qh[i] = to_dtype(nrand(), dtype);
        qf[i] = from_dtype(qh[i], dtype);
    }
}

/* Device buffers of one decode call, outputs and workspace poisoned with 0xFF (NaN). */
struct decode_io {
    uint16_t *q = nullptr, *out = nullptr;
    float *lse = nullptr;
    void *ws = nullptr;
    size_t n_out = 0, n_lse = 0, ws_bytes = 0;
    kvmix_cuda_decode_desc desc;

    decode_io(const test_view &v, const std::vector<uint16_t> &qh, int n_q, int n_splits,
              kvmix_cuda_dtype dtype) {
        n_out = qh.size(), n_lse = (size_t)v.n_seqs * n_q;
        kvmix_cuda_decode_workspace_bytes(v.n_seqs, n_q, v.d, n_splits, &ws_bytes);
        CUDA_OK(cudaMalloc(&q, n_out * 2));
        CUDA_OK(cudaMalloc(&out, n_out * 2));
        CUDA_OK(cudaMalloc(&lse, n_lse * 4));
        CUDA_OK(cudaMalloc(&ws, ws_bytes));
        CUDA_OK(cudaMemcpy(q, qh.data(), n_out * 2, cudaMemcpyHostToDevice));
        desc.n_q_heads = n_q, desc.scale = 0.0f, desc.dtype = dtype, desc.n_splits = n_splits;
        desc.stages = KVMIX_CUDA_STAGES_AUTO;
    }
    ~decode_io() {
        cudaFree(q);
        cudaFree(out);
        cudaFree(lse);
        cudaFree(ws);
    }
    /* runs decode over view (lse too when with_lse) into *r and copies out (as dtype) and lse
       back; *r stays KVMIX_ERR_CUDA when a CUDA call of the test fails */
    void run(const kvmix_view *view, bool with_lse, std::vector<uint16_t> &out_h,
             std::vector<float> &lse_h, kvmix_result *r) {
        *r = KVMIX_ERR_CUDA;
        out_h.assign(n_out, 0), lse_h.assign(n_lse, 0.0f);
        CUDA_OK(cudaMemset(out, 0xFF, n_out * 2));
        CUDA_OK(cudaMemset(lse, 0xFF, n_lse * 4));
        CUDA_OK(cudaMemset(ws, 0xFF, ws_bytes));
        const kvmix_result got =
            kvmix_cuda_decode(view, &desc, q, out, with_lse ? lse : NULL, ws, ws_bytes, 0);
        CUDA_OK(cudaGetLastError());
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(out_h.data(), out, n_out * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(lse_h.data(), lse, n_lse * 4, cudaMemcpyDeviceToHost));
        *r = got;
    }
};

static void test_decode_case(int d, int n_kv, int q_per_kv, int n_seqs, int n_boost, int n_splits,
                             kvmix_cuda_dtype dtype, bool quick) {
    char name[200];
    test_view v;
    build_view(v, d, n_kv, n_seqs, n_boost, quick);
    if (!upload_view(v)) return;
    const int n_q = n_kv * q_per_kv;
    const size_t n_out = (size_t)n_seqs * n_q * d;
    std::vector<uint16_t> qh;
    std::vector<float> qf;
    random_queries(v, n_q, dtype, qh, qf);
    std::vector<float> ref_out(n_out), ref_lse((size_t)n_seqs * n_q);
    kvmix_result rr =
        kvmix_ref_view_decode(&v.host, n_q, 0.0f, qf.data(), ref_out.data(), ref_lse.data());
    check(rr == KVMIX_SUCCESS, "reference decode");
    decode_io io(v, qh, n_q, n_splits, dtype);
    std::vector<uint16_t> out_h;
    std::vector<float> out(n_out), lse, ref_rounded(n_out);
    kvmix_result r;
    io.run(&v.dev, true, out_h, lse, &r);
    for (size_t i = 0; i < n_out; i++) {
        out[i] = from_dtype(out_h[i], dtype);
        ref_rounded[i] = rounded_reference(out[i], ref_out[i], dtype);
    }
    bool ok_out, ok_lse;
    double e_out = nmse(out, ref_rounded, &ok_out), e_lse = nmse(lse, ref_lse, &ok_lse);
    snprintf(
        name, sizeof name,
        "decode D %d G %d kv %d g %d seqs %d boost %d splits %d %s: nmse out %.2e lse %.2e (r %d)",
        d, g_group, n_kv, q_per_kv, n_seqs, n_boost, n_splits,
        dtype == KVMIX_CUDA_BF16 ? "bf16" : "fp16", e_out, e_lse, r);
    check(r == KVMIX_SUCCESS && ok_out && ok_lse && e_out <= 1e-6 && e_lse <= 1e-6, name);
    if (getenv("KVMIX_TEST_VERBOSE")) printf("%s\n", name);
    /* without lse: the same output, bit for bit (the kernels are deterministic) */
    std::vector<uint16_t> again;
    std::vector<float> no_lse;
    io.run(&v.dev, false, again, no_lse, &r);
    snprintf(name, sizeof name, "decode D %d splits %d without lse: the same output (r %d)", d,
             n_splits, r);
    check(r == KVMIX_SUCCESS && again == out_h, name);
    /* the small stages (what devices with less shared memory run): units of fewer tokens, the
       same reference */
    io.desc.stages = KVMIX_CUDA_STAGES_SMALL;
    io.run(&v.dev, true, again, no_lse, &r);
    std::vector<float> small_out(n_out);
    for (size_t i = 0; i < n_out; i++) small_out[i] = from_dtype(again[i], dtype);
    double s_out = nmse(small_out, ref_rounded, &ok_out), s_lse = nmse(no_lse, ref_lse, &ok_lse);
    snprintf(name, sizeof name, "decode D %d splits %d small stages: nmse out %.2e lse %.2e (r %d)",
             d, n_splits, s_out, s_lse, r);
    check(r == KVMIX_SUCCESS && ok_out && ok_lse && s_out <= 1e-6 && s_lse <= 1e-6, name);
    if (s_out > e_out) e_out = s_out;
    if (s_lse > e_lse) e_lse = s_lse;
    if (e_out > g_decode_max_out) g_decode_max_out = e_out;
    if (e_lse > g_decode_max_lse) g_decode_max_lse = e_lse;
    if (g_failed && getenv("KVMIX_TEST_VERBOSE")) {
        for (int s = 0; s < n_seqs; s++)
            printf("  seq %d lse gpu %g ref %g\n", s, lse[(size_t)s * n_q],
                   ref_lse[(size_t)s * n_q]);
    }
    free_view(v);
}

/* Whether every output and lse of sequence bad_seq is NaN while sequence 0's outputs match the
   reference (finite, NMSE *e within 1e-6). */
static bool only_sequence_nan(const std::vector<uint16_t> &out_h, const std::vector<float> &lse,
                              const std::vector<float> &ref_out, int n_q, int d, int bad_seq,
                              kvmix_cuda_dtype dtype, double *e) {
    const size_t per_seq = (size_t)n_q * d;
    bool bad_nan = true, good_ok = true;
    for (size_t i = 0; i < per_seq; i++)
        bad_nan &= isnan(from_dtype(out_h[bad_seq * per_seq + i], dtype));
    for (int h = 0; h < n_q; h++) bad_nan &= isnan(lse[(size_t)bad_seq * n_q + h]);
    std::vector<float> got(per_seq), want(per_seq);
    for (size_t i = 0; i < per_seq; i++) {
        got[i] = from_dtype(out_h[i], dtype);
        want[i] = rounded_reference(got[i], ref_out[i], dtype);
    }
    *e = nmse(got, want, &good_ok);
    return bad_nan && good_ok && *e <= 1e-6;
}

/* A span the device rejects (no tokens, an unknown format, a block past base_bytes) turns every
   output and lse of its sequence into NaN, whichever split walks it; so does a span range that
   leaves the view's spans, and no span past the view is read. The other sequences keep their
   results. Two ranges: the view's n_spans one short of the last sequence's end (the span there
   is valid, so only the range check catches it), and that end 1000 spans past the array
   (compute-sanitizer catches a read). */
static void test_decode_bad_input(bool quick, int d) {
    const int n_kv = 2, n_q = 8, n_seqs = 4, bad_seq = n_seqs - 1; /* the last */
    const kvmix_cuda_dtype dtype = KVMIX_CUDA_BF16;
    test_view v;
    build_view(v, d, n_kv, n_seqs, d / 8, quick);
    if (!upload_view(v)) return;
    std::vector<uint16_t> qh;
    std::vector<float> qf;
    random_queries(v, n_q, dtype, qh, qf);
    std::vector<float> ref_out(qh.size()), ref_lse((size_t)n_seqs * n_q);
    check(kvmix_ref_view_decode(&v.host, n_q, 0.0f, qf.data(), ref_out.data(), ref_lse.data()) ==
              KVMIX_SUCCESS,
          "reference decode");
    /* a page of the bad sequence: between its sinks and its buffer */
    const int first = v.first[bad_seq], seq_spans = v.first[bad_seq + 1] - first;
    const int bad = first + 1 + irand(seq_spans - 2);
    const int splits[] = {1, 3, 7, 12};
    for (int kind = 0; kind < 3; kind++) {
        kvmix_view_span sp = v.spans[bad];
        if (kind == 0) sp.n_tokens = 0;
        if (kind == 1) sp.key_format = 99;
        if (kind == 2) sp.value_offset = v.arena.size();
        CUDA_OK(cudaMemcpy(v.d_spans + bad, &sp, sizeof sp, cudaMemcpyHostToDevice));
        for (int n_splits : splits) {
            decode_io io(v, qh, n_q, n_splits, dtype);
            std::vector<uint16_t> out_h;
            std::vector<float> lse;
            kvmix_result r;
            io.run(&v.dev, true, out_h, lse, &r);
            double e;
            const bool ok = only_sequence_nan(out_h, lse, ref_out, n_q, d, bad_seq, dtype, &e);
            char name[160];
            snprintf(name, sizeof name,
                     "decode D %d: bad span (%d) of %d in sequence %d, %d splits: NaN there, "
                     "other sequence nmse %.2e (r %d)",
                     d, kind, bad - first, bad_seq, n_splits, e, r);
            check(r == KVMIX_SUCCESS && ok, name);
        }
        CUDA_OK(cudaMemcpy(v.d_spans + bad, &v.spans[bad], sizeof sp, cudaMemcpyHostToDevice));
    }
    for (int way = 0; way < 2; way++) {
        kvmix_view view = v.dev;
        if (way == 0) view.n_spans -= 1;
        const int32_t end = way == 0 ? v.host.n_spans : v.host.n_spans + 1000;
        CUDA_OK(cudaMemcpy(v.d_first + n_seqs, &end, 4, cudaMemcpyHostToDevice));
        decode_io io(v, qh, n_q, way == 0 ? 1 : 5, dtype);
        std::vector<uint16_t> out_h;
        std::vector<float> lse;
        kvmix_result r;
        io.run(&view, true, out_h, lse, &r);
        double e;
        const bool ok = only_sequence_nan(out_h, lse, ref_out, n_q, d, bad_seq, dtype, &e);
        char name[160];
        snprintf(name, sizeof name,
                 "decode D %d: span range of sequence %d ends %s: NaN there, other sequence nmse "
                 "%.2e (r %d)",
                 d, bad_seq, way == 0 ? "one past n_spans" : "1000 past the spans", e, r);
        check(r == KVMIX_SUCCESS && ok, name);
    }
    free_view(v);
}

/* Decode at head_dim d over views of every shape test_decode_case varies: query heads per kv
   head 1-8, fp16 and bf16, 1-64 splits (quick: the first two). */
static void test_decode_dim(int d, bool quick) {
    test_decode_case(d, 2, 4, 5, d / 8, 1, KVMIX_CUDA_FP16, quick);
    test_decode_case(d, 2, 4, 5, d / 4, 3, KVMIX_CUDA_BF16, quick);
    if (quick) return;
    test_decode_case(d, 4, 1, 4, d / 8, 7, KVMIX_CUDA_FP16, quick);
    test_decode_case(d, 1, 2, 6, d / 4, 2, KVMIX_CUDA_BF16, quick);
    test_decode_case(d, 2, 8, 5, d / 8, 17, KVMIX_CUDA_FP16, quick);
    test_decode_case(d, 3, 6, 3, d / 4, 64, KVMIX_CUDA_BF16, quick);
}

/* The shapes the tensor-core fragments do not take run the CUDA-core walk: head_dims 32 and 96
   (and 160, 192 in full runs), and groups of 8 at a tensor-core head_dim; against the same
   reference, with every format pair, dead flags, splits and a long sequence of short spans. */
static void test_decode_walk(bool quick) {
    const int dims[] = {96, 32, 160, 192};
    for (int di = 0; di < (quick ? 2 : 4); di++) test_decode_dim(dims[di], quick);
    g_group = 8;
    test_decode_case(128, 2, 4, 5, 16, 3, KVMIX_CUDA_FP16, quick);
    test_decode_case(96, 2, 4, 5, 12, 2, KVMIX_CUDA_BF16, quick);
    g_group = 96; /* one group per head */
    test_decode_case(96, 2, 4, 5, 24, 3, KVMIX_CUDA_BF16, quick);
    g_group = 32;
    g_long_pages = quick ? 300 : 1100;
    test_decode_case(96, 1, 4, 4, 12, quick ? 1 : 33, KVMIX_CUDA_BF16, quick);
    g_long_pages = 0;
    g_wide_rows = 3;
    test_decode_case(96, 2, 4, 5, 12, 3, KVMIX_CUDA_FP16, quick);
    g_wide_rows = 0;
}

static void test_decode(bool quick) {
    const int dims[] = {64, 128, 256};
    for (int di = 0; di < 3; di++)
        if (!quick || dims[di] != 256) test_decode_dim(dims[di], quick);
    /* boosted slot counts whose high-bit rows hold an odd number of bytes (12 slots: 3 bytes),
       and whose last k-step of 32 slots is partly filled (40 at D 128, 68 at D 256) */
    test_decode_case(128, 2, 4, 5, 12, 2, KVMIX_CUDA_FP16, quick);
    test_decode_case(128, 2, 4, 5, 40, 1, KVMIX_CUDA_BF16, quick);
    if (!quick) test_decode_case(256, 2, 4, 4, 68, 3, KVMIX_CUDA_FP16, quick);
    /* group 16: at D 256 a value lane's 32 dims span two groups */
    g_group = 16;
    for (int di = 0; di < 3; di++) {
        int d = dims[di];
        if (quick && d != 128) continue;
        test_decode_case(d, 2, 4, 5, d / 8, 3, KVMIX_CUDA_BF16, quick);
        if (!quick) test_decode_case(d, 2, 8, 4, d / 4, 5, KVMIX_CUDA_FP16, quick);
    }
    /* group 64: two groups per row at D 128 (the specialized format pairs with a group other
       than the default) */
    g_group = 64;
    test_decode_case(128, 2, 4, 5, 16, 3, KVMIX_CUDA_FP16, quick);
    /* one group per head (the value geometry of a Kitty layout): a value lane's dims in one group
       at every head_dim */
    for (int di = 0; di < 3; di++) {
        if (quick && dims[di] != 128) continue;
        g_group = dims[di];
        test_decode_case(dims[di], 2, 4, 5, dims[di] / 8, 3, KVMIX_CUDA_BF16, quick);
    }
    g_group = 32;
    /* long sequences of short spans: splits of more than 128 spans (walked in several chunks:
       300 and 550 spans), and splits that start deep into the sequence */
    g_long_pages = quick ? 300 : 1100;
    test_decode_case(128, 1, 4, 4, 16, quick ? 1 : 33, KVMIX_CUDA_BF16, quick);
    if (!quick) test_decode_case(64, 2, 4, 4, 8, 2, KVMIX_CUDA_FP16, quick);
    g_long_pages = 0;
    /* wide value rows, then wide key rows (widen_rows): large per-token scales beside small ones
       in the same tiles */
    for (int wide = 1; wide <= 2; wide++) {
        g_wide_rows = wide;
        test_decode_case(128, 2, 4, 5, 16, 3, KVMIX_CUDA_BF16, quick);
        if (!quick) {
            test_decode_case(64, 2, 4, 5, 8, 1, KVMIX_CUDA_FP16, quick);
            test_decode_case(256, 2, 4, 5, 32, 2, KVMIX_CUDA_FP16, quick);
        }
    }
    g_wide_rows = 0;
    test_decode_walk(quick);
    test_decode_bad_input(quick, 128);
    test_decode_bad_input(quick, 96); /* the walk */
}

/* ---- dequantize and score ---------------------------------------------------------------- */

/* kvmix_cuda_view_intent_score against kvmix_ref_view_intent_score on one sequence of a view:
   the same scores for its tokens (dead ones -inf), -inf past its length up to cap. */
static void check_intent_scores(const test_view &v, int seq, int n_q, const float *d_mem,
                                const std::vector<float> &mem, int cap) {
    char name[200];
    const int64_t n = v.seq_tokens[seq];
    size_t ws_bytes = 0;
    void *d_ws;
    float *d_out;
    std::vector<float> got(cap), ref(n > 0 ? n : 1);
    check(kvmix_cuda_view_intent_workspace_bytes(n_q, cap, &ws_bytes) == KVMIX_SUCCESS,
          "intent workspace");
    CUDA_OK(cudaMalloc(&d_ws, ws_bytes));
    CUDA_OK(cudaMalloc(&d_out, (size_t)cap * 4));
    kvmix_result r =
        kvmix_cuda_view_intent_score(&v.dev, seq, n_q, 0.0f, d_mem, d_out, cap, d_ws, ws_bytes, 0);
    check(kvmix_cuda_view_intent_score(&v.dev, seq, n_q, 0.0f, d_mem, d_out, cap, d_ws,
                                       ws_bytes - 256, 0) == KVMIX_ERR_BUFFER_TOO_SMALL,
          "intent score: small workspace refused");
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(got.data(), d_out, (size_t)cap * 4, cudaMemcpyDeviceToHost));
    kvmix_result rr =
        kvmix_ref_view_intent_score(&v.host, seq, n_q, 0.0f, mem.data(), ref.data(), (int32_t)n);
    double worst = 0.0;
    bool same_dead = true, within = true;
    for (int64_t t = 0; t < n; t++) {
        if (ref[t] == -INFINITY || got[t] == -INFINITY) {
            same_dead &= ref[t] == got[t];
            continue;
        }
        within &= fabs((double)got[t] - ref[t]) <= 1e-4; /* NaN fails */
        worst = fmax(worst, fabs((double)got[t] - ref[t]));
    }
    for (int t = (int)n; t < cap; t++) same_dead &= got[t] == -INFINITY;
    snprintf(name, sizeof name,
             "intent score D %d seq %d, %d query heads: largest difference %.2e (bound 1e-4), dead "
             "and past -inf",
             v.d, seq, n_q, worst);
    check(r == KVMIX_SUCCESS && rr == KVMIX_SUCCESS && same_dead && within, name);
    cudaFree(d_ws);
    cudaFree(d_out);
}

/* kvmix_cuda_view_key_features against kvmix_ref_view_key_features on one sequence of a view:
   the same features within float rounding (dead tokens 0), entries past its length left; bad
   arguments refused. */
static void check_key_features(const test_view &v, int seq, int n_q, const float *d_mem,
                               const std::vector<float> &mem, int cap) {
    char name[200];
    const int64_t n = v.seq_tokens[seq];
    float *d_norm, *d_readout;
    std::vector<float> norm(cap), readout(cap), ref_norm(n > 0 ? n : 1), ref_readout(n > 0 ? n : 1);
    CUDA_OK(cudaMalloc(&d_norm, (size_t)cap * 4));
    CUDA_OK(cudaMalloc(&d_readout, (size_t)cap * 4));
    CUDA_OK(cudaMemset(d_norm, 0xEE, (size_t)cap * 4));
    CUDA_OK(cudaMemset(d_readout, 0xEE, (size_t)cap * 4));
    kvmix_result r =
        kvmix_cuda_view_key_features(&v.dev, seq, n_q, 0.0f, d_mem, d_norm, d_readout, cap, 0);
    check(kvmix_cuda_view_key_features(&v.dev, seq, n_q + 1, 0.0f, d_mem, d_norm, d_readout, cap,
                                       0) == KVMIX_ERR_INVALID_ARGUMENT &&
              kvmix_cuda_view_key_features(&v.dev, seq, n_q, -1.0f, d_mem, d_norm, d_readout, cap,
                                           0) == KVMIX_ERR_INVALID_ARGUMENT &&
              kvmix_cuda_view_key_features(&v.dev, v.n_seqs, n_q, 0.0f, d_mem, d_norm, d_readout,
                                           cap, 0) == KVMIX_ERR_INVALID_ARGUMENT &&
              kvmix_cuda_view_key_features(&v.dev, seq, n_q, 0.0f, d_mem, nullptr, d_readout, cap,
                                           0) == KVMIX_ERR_NULL_POINTER,
          "key features: bad arguments refused");
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(norm.data(), d_norm, (size_t)cap * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(readout.data(), d_readout, (size_t)cap * 4, cudaMemcpyDeviceToHost));
    kvmix_result rr = kvmix_ref_view_key_features(&v.host, seq, n_q, 0.0f, mem.data(),
                                                  ref_norm.data(), ref_readout.data(), (int32_t)n);
    double worst = 0.0;
    bool dead_zero = true, past_left = true, within = true;
    for (int64_t t = 0; t < n; t++) {
        if (ref_norm[t] == 0.0f) dead_zero &= norm[t] == 0.0f && readout[t] == 0.0f;
        const double dn = fabs((double)norm[t] - ref_norm[t]) / (1.0 + fabs(ref_norm[t]));
        const double dr = fabs((double)readout[t] - ref_readout[t]) / (1.0 + fabs(ref_readout[t]));
        within &= dn <= 1e-4 && dr <= 1e-4; /* NaN fails */
        worst = fmax(worst, fmax(dn, dr));
    }
    uint32_t poison = 0xEEEEEEEEu;
    for (int t = (int)n; t < cap; t++)
        past_left &= memcmp(&norm[t], &poison, 4) == 0 && memcmp(&readout[t], &poison, 4) == 0;
    snprintf(name, sizeof name,
             "key features D %d seq %d: largest relative difference %.2e (bound 1e-4), dead 0, "
             "past the sequence left",
             v.d, seq, worst);
    check(r == KVMIX_SUCCESS && rr == KVMIX_SUCCESS && within && dead_zero && past_left, name);
    cudaFree(d_norm);
    cudaFree(d_readout);
}

/* kvmix_cuda_view_intent_score_seqs over every sequence of a view, each with its own memory at
   an odd stride: the same bits as kvmix_cuda_view_intent_score per sequence; a workspace one part
   short, a range past the view and a negative stride refused. */
static void check_intent_score_seqs(const test_view &v, int n_q, int cap) {
    char name[200];
    const int n = v.n_seqs;
    const int64_t stride = (int64_t)n_q * v.d + 3;
    size_t part = 0;
    check(kvmix_cuda_view_intent_workspace_bytes(n_q, cap, &part) == KVMIX_SUCCESS,
          "intent workspace");
    std::vector<float> mem((size_t)stride * n);
    for (auto &x : mem) x = nrand();
    float *d_mem, *d_all, *d_one;
    void *d_ws;
    CUDA_OK(cudaMalloc(&d_mem, mem.size() * 4));
    CUDA_OK(cudaMalloc(&d_all, (size_t)n * cap * 4));
    CUDA_OK(cudaMalloc(&d_one, (size_t)n * cap * 4));
    CUDA_OK(cudaMalloc(&d_ws, part * n));
    CUDA_OK(cudaMemcpy(d_mem, mem.data(), mem.size() * 4, cudaMemcpyHostToDevice));
    kvmix_result r = kvmix_cuda_view_intent_score_seqs(&v.dev, 0, n, n_q, 0.0f, d_mem, stride,
                                                       d_all, cap, d_ws, part * n, 0);
    bool alone_ok = true;
    for (int s = 0; s < n; s++)
        alone_ok &= kvmix_cuda_view_intent_score(&v.dev, s, n_q, 0.0f, d_mem + s * stride,
                                                 d_one + (size_t)s * cap, cap, d_ws, part,
                                                 0) == KVMIX_SUCCESS;
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<float> all((size_t)n * cap), one((size_t)n * cap);
    CUDA_OK(cudaMemcpy(all.data(), d_all, all.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(one.data(), d_one, one.size() * 4, cudaMemcpyDeviceToHost));
    snprintf(name, sizeof name, "intent score of %d sequences in one call D %d: each as alone", n,
             v.d);
    check(r == KVMIX_SUCCESS && alone_ok && memcmp(all.data(), one.data(), all.size() * 4) == 0,
          name);
    check(kvmix_cuda_view_intent_score_seqs(&v.dev, 0, n, n_q, 0.0f, d_mem, stride, d_all, cap,
                                            d_ws, part * n - 1, 0) == KVMIX_ERR_BUFFER_TOO_SMALL,
          "intent score of sequences: a workspace one part short refused");
    check(kvmix_cuda_view_intent_score_seqs(&v.dev, 1, n, n_q, 0.0f, d_mem, stride, d_all, cap,
                                            d_ws, part * n, 0) == KVMIX_ERR_INVALID_ARGUMENT &&
              kvmix_cuda_view_intent_score_seqs(&v.dev, 0, n, n_q, 0.0f, d_mem, -1, d_all, cap,
                                                d_ws, part * n, 0) == KVMIX_ERR_INVALID_ARGUMENT,
          "intent score of sequences: a range past the view, a negative stride refused");
    cudaFree(d_mem);
    cudaFree(d_all);
    cudaFree(d_one);
    cudaFree(d_ws);
}

/* A head's intent logits do not depend on the heads that share its kv head (the kernel serves up
   to 8 a pass, 4 on FP16 rows) nor on where the kernel read the memory (FP16 rows: staged in
   shared memory up to about 40 KiB of it): with g query heads per kv head, each head scored as
   the only one of its kv head (its memory row alone) has the bits it has among the g (the
   workspace's logits [n_q][cap]). */
static void check_intent_logits_alone(const test_view &v, int g) {
    const int n_q = v.n_kv * g, cap = (int)v.seq_tokens[0] + 5;
    const size_t row = (size_t)v.d;
    size_t ws9_bytes = 0, ws1_bytes = 0;
    kvmix_cuda_view_intent_workspace_bytes(n_q, cap, &ws9_bytes);
    kvmix_cuda_view_intent_workspace_bytes(v.n_kv, cap, &ws1_bytes);
    std::vector<float> mem9((size_t)n_q * row), mem1((size_t)v.n_kv * row);
    std::vector<float> logits9((size_t)n_q * cap), logits1((size_t)v.n_kv * cap);
    for (auto &x : mem9) x = nrand();
    float *d_mem9, *d_mem1, *d_out;
    void *d_ws9, *d_ws1;
    CUDA_OK(cudaMalloc(&d_mem9, mem9.size() * 4));
    CUDA_OK(cudaMalloc(&d_mem1, mem1.size() * 4));
    CUDA_OK(cudaMalloc(&d_out, (size_t)cap * 4));
    CUDA_OK(cudaMalloc(&d_ws9, ws9_bytes));
    CUDA_OK(cudaMalloc(&d_ws1, ws1_bytes));
    CUDA_OK(cudaMemcpy(d_mem9, mem9.data(), mem9.size() * 4, cudaMemcpyHostToDevice));
    bool ok = kvmix_cuda_view_intent_score(&v.dev, 0, n_q, 0.0f, d_mem9, d_out, cap, d_ws9,
                                           ws9_bytes, 0) == KVMIX_SUCCESS;
    CUDA_OK(cudaMemcpy(logits9.data(), d_ws9, logits9.size() * 4, cudaMemcpyDeviceToHost));
    for (int j = 0; j < g; j++) {
        for (int kh = 0; kh < v.n_kv; kh++)
            memcpy(&mem1[kh * row], &mem9[(kh * g + j) * row], row * 4);
        CUDA_OK(cudaMemcpy(d_mem1, mem1.data(), mem1.size() * 4, cudaMemcpyHostToDevice));
        ok &= kvmix_cuda_view_intent_score(&v.dev, 0, v.n_kv, 0.0f, d_mem1, d_out, cap, d_ws1,
                                           ws1_bytes, 0) == KVMIX_SUCCESS;
        CUDA_OK(cudaMemcpy(logits1.data(), d_ws1, logits1.size() * 4, cudaMemcpyDeviceToHost));
        for (int kh = 0; kh < v.n_kv; kh++)
            ok &= memcmp(&logits1[(size_t)kh * cap], &logits9[(size_t)(kh * g + j) * cap],
                         (size_t)cap * 4) == 0;
    }
    char name[160];
    snprintf(name, sizeof name,
             "intent logits D %d: each of %d heads per kv head the bits it has scored alone", v.d,
             g);
    check(ok, name);
    cudaFree(d_mem9), cudaFree(d_mem1), cudaFree(d_out), cudaFree(d_ws9), cudaFree(d_ws1);
}

/* The intent scores of the view's first sequence with 1, 4 and 9 query heads per kv head (9: past
   the kernel's chunk of 8 heads a key row serves at once). */
static void check_intent_head_groups(const test_view &v) {
    for (int g : {1, 4, 9}) {
        const int n_q = v.n_kv * g;
        std::vector<float> mem((size_t)n_q * v.d);
        for (auto &x : mem) x = nrand();
        float *d_mem;
        CUDA_OK(cudaMalloc(&d_mem, mem.size() * 4));
        CUDA_OK(cudaMemcpy(d_mem, mem.data(), mem.size() * 4, cudaMemcpyHostToDevice));
        check_intent_scores(v, 0, n_q, d_mem, mem, (int)v.seq_tokens[0] + 5);
        cudaFree(d_mem);
    }
}

static void test_view_dequantize_score(int d, int n_kv, int n_boost, kvmix_cuda_dtype dtype,
                                       bool quick) {
    char name[200];
    test_view v;
    build_view(v, d, n_kv, 4, n_boost, quick);
    if (!upload_view(v)) return;
    for (int seq = 0; seq < v.n_seqs; seq++) {
        int64_t n = v.seq_tokens[seq];
        int cap = (int)n + 5;
        size_t elems = (size_t)cap * n_kv * d;
        uint16_t *d_k, *d_v;
        float *d_mem, *d_scores;
        const int g = 2, n_q = n_kv * g;
        CUDA_OK(cudaMalloc(&d_k, elems * 2));
        CUDA_OK(cudaMalloc(&d_v, elems * 2));
        CUDA_OK(cudaMalloc(&d_mem, (size_t)n_q * d * 4));
        CUDA_OK(cudaMalloc(&d_scores, (size_t)cap * 4));
        CUDA_OK(cudaMemset(d_k, 0xEE, elems * 2));
        CUDA_OK(cudaMemset(d_v, 0xEE, elems * 2));
        CUDA_OK(cudaMemset(d_scores, 0xEE, (size_t)cap * 4));
        std::vector<float> mem((size_t)n_q * d);
        for (auto &x : mem) x = nrand();
        CUDA_OK(cudaMemcpy(d_mem, mem.data(), mem.size() * 4, cudaMemcpyHostToDevice));
        kvmix_result r1 = kvmix_cuda_view_dequantize(&v.dev, seq, dtype, d_k, d_v, cap, 0);
        kvmix_result r2 = kvmix_cuda_view_score(&v.dev, seq, n_q, d_mem, d_scores, cap, 0);
        CUDA_OK(cudaDeviceSynchronize());
        std::vector<uint16_t> kh(elems), vh(elems);
        std::vector<float> scores(cap);
        CUDA_OK(cudaMemcpy(kh.data(), d_k, elems * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(vh.data(), d_v, elems * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(scores.data(), d_scores, (size_t)cap * 4, cudaMemcpyDeviceToHost));
        /* expected rows, from the CPU decoder */
        bool same = true;
        std::vector<float> ref_scores, got_scores;
        bool dead_ok = true;
        int64_t pos = 0;
        std::vector<float> row(d);
        for (int si = v.first[seq]; si < v.first[seq + 1]; si++) {
            const kvmix_view_span &sp = v.spans[si];
            for (int which = 0; which < 2; which++) {
                kvmix_layout l;
                memset(&l, 0, sizeof l);
                l.format = (kvmix_format)(which ? sp.value_format : sp.key_format);
                l.n_tokens = sp.n_tokens, l.head_dim = d;
                l.n_boost = l.format == KVMIX_FORMAT_BOOSTED ? n_boost : 0;
                l.group_size = (l.format == KVMIX_FORMAT_INT8 || l.format == KVMIX_FORMAT_INT4 ||
                                l.format == KVMIX_FORMAT_INT2)
                                   ? v.host.group_size
                                   : 0;
                kvmix_layout_resolve(&l, NULL);
                for (int t = 0; t < sp.n_tokens; t++) {
                    bool dead = sp.dead_index >= 0 && v.dead[sp.dead_index + t];
                    double sc = 0.0;
                    for (int h = 0; h < n_kv; h++) {
                        const uint8_t *blk =
                            v.arena.data() + (which ? sp.value_offset : sp.key_offset) +
                            (size_t)h * (which ? sp.value_head_bytes : sp.key_head_bytes);
                        kvmix_ref_dequantize_row(&l, blk,
                                                 (size_t)(v.arena.data() + v.arena.size() - blk), t,
                                                 row.data());
                        const std::vector<uint16_t> &got = which ? vh : kh;
                        for (int c = 0; c < d; c++) {
                            float x = dead ? 0.0f : row[c];
                            uint16_t e = to_dtype(x, dtype);
                            same &= got[((size_t)(pos + t) * n_kv + h) * d + c] == e;
                            if (!which)
                                for (int j = 0; j < g; j++)
                                    sc += (double)mem[(size_t)(h * g + j) * d + c] * row[c];
                        }
                    }
                    if (!which) {
                        if (dead)
                            dead_ok &= scores[pos + t] == -INFINITY;
                        else
                            ref_scores.push_back((float)sc), got_scores.push_back(scores[pos + t]);
                    }
                }
            }
            pos += sp.n_tokens;
        }
        bool tail = true;
        for (size_t i = (size_t)n * n_kv * d; i < elems; i++)
            tail &= kh[i] == 0xEEEE && vh[i] == 0xEEEE;
        snprintf(name, sizeof name,
                 "view dequantize D %d seq %d (%lld tokens) %s: rows equal, tail untouched", d, seq,
                 (long long)n, dtype == KVMIX_CUDA_BF16 ? "bf16" : "fp16");
        check(r1 == KVMIX_SUCCESS && same && tail, name);
        bool fin;
        double e = nmse(got_scores, ref_scores, &fin);
        snprintf(name, sizeof name, "view score D %d seq %d: nmse %.2e, dead -inf", d, seq, e);
        check(r2 == KVMIX_SUCCESS && fin && dead_ok && e <= 1e-6, name);
        check_intent_scores(v, seq, n_q, d_mem, mem, cap);
        check_key_features(v, seq, n_q, d_mem, mem, cap);
        cudaFree(d_k);
        cudaFree(d_v);
        cudaFree(d_mem);
        cudaFree(d_scores);
    }
    int64_t longest = 0;
    for (int seq = 0; seq < v.n_seqs; seq++)
        longest = v.seq_tokens[seq] > longest ? v.seq_tokens[seq] : longest;
    check_intent_score_seqs(v, 2 * n_kv, (int)longest + 5);
    check_intent_head_groups(v);
    check_intent_logits_alone(v, 9);
    check_intent_logits_alone(v, 39 * 1024 / 4 / (v.n_kv * v.d));     /* near the most staged */
    check_intent_logits_alone(v, 48 * 1024 / 4 / (v.n_kv * v.d) + 1); /* memory not staged */
    free_view(v);
}

/* The device's checks in dequantize and score. A span whose key format is unknown: its key rows
   and scores are NaN, every other row and score of the sequence is a number. A span range that
   leaves the view's spans (the two of test_decode_bad_input): NaN in every row and score up to
   capacity_tokens, and no span past the view is read. Nothing past capacity_tokens is written. */
static void test_view_bad_input(void) {
    const int d = 128, n_kv = 2, n_seqs = 4, bad_seq = n_seqs - 1, n_q = 4;
    test_view v;
    build_view(v, d, n_kv, n_seqs, 16, true);
    if (!upload_view(v)) return;
    const int len = (int)v.seq_tokens[bad_seq], cap = len + 2, rows = cap + 3;
    const size_t row = (size_t)n_kv * d, elems = (size_t)rows * row;
    const int first = v.first[bad_seq], bad = first + 1; /* the first page after the sinks */
    const int bad_lo = v.spans[first].n_tokens, bad_hi = bad_lo + v.spans[bad].n_tokens;
    uint16_t *d_k, *d_v;
    float *d_mem, *d_scores, *d_norm, *d_readout;
    CUDA_OK(cudaMalloc(&d_k, elems * 2));
    CUDA_OK(cudaMalloc(&d_v, elems * 2));
    CUDA_OK(cudaMalloc(&d_mem, (size_t)n_q * d * 4));
    CUDA_OK(cudaMalloc(&d_scores, (size_t)rows * 4));
    CUDA_OK(cudaMalloc(&d_norm, (size_t)rows * 4));
    CUDA_OK(cudaMalloc(&d_readout, (size_t)rows * 4));
    CUDA_OK(cudaMemset(d_mem, 0, (size_t)n_q * d * 4));
    const char *ways[] = {"a key format unknown in one span", "the span range one past n_spans",
                          "the span range 1000 past the spans"};
    for (int way = 0; way < 3; way++) {
        kvmix_view view = v.dev;
        kvmix_view_span sp = v.spans[bad];
        sp.key_format = 99;
        if (way == 0) CUDA_OK(cudaMemcpy(v.d_spans + bad, &sp, sizeof sp, cudaMemcpyHostToDevice));
        if (way == 1) view.n_spans -= 1;
        const int32_t end = way == 2 ? v.host.n_spans + 1000 : v.host.n_spans;
        CUDA_OK(cudaMemcpy(v.d_first + n_seqs, &end, 4, cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(d_k, 0xEE, elems * 2));
        CUDA_OK(cudaMemset(d_v, 0xEE, elems * 2));
        CUDA_OK(cudaMemset(d_scores, 0xEE, (size_t)rows * 4));
        CUDA_OK(cudaMemset(d_norm, 0xEE, (size_t)rows * 4));
        CUDA_OK(cudaMemset(d_readout, 0xEE, (size_t)rows * 4));
        const kvmix_result r1 =
            kvmix_cuda_view_dequantize(&view, bad_seq, KVMIX_CUDA_FP16, d_k, d_v, cap, 0);
        const kvmix_result r2 = kvmix_cuda_view_score(&view, bad_seq, n_q, d_mem, d_scores, cap, 0);
        const kvmix_result r3 = kvmix_cuda_view_key_features(&view, bad_seq, n_q, 0.0f, d_mem,
                                                             d_norm, d_readout, cap, 0);
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(v.d_spans + bad, &v.spans[bad], sizeof sp, cudaMemcpyHostToDevice));
        std::vector<uint16_t> kh(elems), vh(elems);
        std::vector<uint32_t> scores(rows), norms(rows), readouts(rows);
        CUDA_OK(cudaMemcpy(kh.data(), d_k, elems * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(vh.data(), d_v, elems * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(scores.data(), d_scores, (size_t)rows * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(norms.data(), d_norm, (size_t)rows * 4, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(readouts.data(), d_readout, (size_t)rows * 4, cudaMemcpyDeviceToHost));
        bool ok = r1 == KVMIX_SUCCESS && r2 == KVMIX_SUCCESS && r3 == KVMIX_SUCCESS;
        for (int t = 0; t < rows; t++) {
            /* what row t must be: untouched past cap, empty past the sequence, else NaN or not */
            const bool written = t < (way == 0 ? len : cap), in_bad = t >= bad_lo && t < bad_hi;
            const bool k_nan = way != 0 || in_bad, v_nan = way != 0;
            for (size_t i = t * row; i < (t + 1) * row; i++)
                ok &= written ? isnan(from_dtype(kh[i], KVMIX_CUDA_FP16)) == k_nan &&
                                    isnan(from_dtype(vh[i], KVMIX_CUDA_FP16)) == v_nan
                              : kh[i] == 0xEEEE && vh[i] == 0xEEEE;
            for (const std::vector<uint32_t> *out : {&scores, &norms, &readouts}) {
                float x;
                memcpy(&x, &(*out)[t], 4);
                ok &= written ? isnan(x) == k_nan : (*out)[t] == 0xEEEEEEEEu;
            }
        }
        char name[160];
        snprintf(name, sizeof name,
                 "view dequantize/score/key features, sequence %d with %s: NaN exactly there, "
                 "nothing past capacity",
                 bad_seq, ways[way]);
        check(ok, name);
    }
    cudaFree(d_k);
    cudaFree(d_v);
    cudaFree(d_mem);
    cudaFree(d_scores);
    cudaFree(d_norm);
    cudaFree(d_readout);
    free_view(v);
}

/* ---- transfer payload -------------------------------------------------------------------- */

static const char *dtype_name(kvmix_cuda_dtype dt) {
    return dt == KVMIX_CUDA_BF16 ? "bf16" : "fp16";
}

/* Random rows [n_rows][d] of dtype: per-channel scales with outlier channels, tiny channels (below
   FP16's normal range, so BF16 rows exercise subnormal rounding), constant channels, negative
   zeros, a quarter-step kind with exact ties, and a kind of mostly zeros of both signs (the group
   minimum's sign is its first occurrence's). */
static void fill_payload_rows(std::vector<uint16_t> &h, size_t n_rows, int d, kvmix_cuda_dtype dt) {
    h.resize(n_rows * d);
    std::vector<float> ch_scale(d);
    for (int c = 0; c < d; c++) {
        float s = 0.5f + urand();
        if (irand(8) == 0) s *= 20.0f;
        if (irand(16) == 0) s = 3e-6f;
        if (irand(16) == 0) s = 0.0f;
        ch_scale[c] = s;
    }
    int kind = irand(5);
    for (size_t t = 0; t < n_rows; t++) {
        const float sign = irand(2) ? 1.0f : -1.0f; /* kind 4: zeros of both signs and one sign */
        for (int c = 0; c < d; c++) {
            float x = kind == 3 ? (float)(irand(9) - 4) * 0.25f
                                : nrand() * ch_scale[c] + (kind == 1 ? 3.0f : 0.0f);
            if (kind == 4) x = irand(4) == 0 ? sign * urand() : (irand(2) ? 0.0f : -0.0f);
            if (ch_scale[c] == 0.0f && kind != 4) x = kind == 2 ? -0.0f : 1.5f;
            if (irand(4096) == 0) x = (irand(2) ? 1.0f : -1.0f) * 30000.0f;
            h[t * d + c] = to_dtype(x, dt);
        }
    }
}

static size_t first_diff(const std::vector<uint8_t> &a, const std::vector<uint8_t> &b) {
    for (size_t i = 0; i < a.size() && i < b.size(); i++)
        if (a[i] != b[i]) return i;
    return a.size() == b.size() ? a.size() : (a.size() < b.size() ? a.size() : b.size());
}

static bool all_bytes(const std::vector<uint8_t> &a, size_t from, size_t to, uint8_t v) {
    for (size_t i = from; i < to; i++)
        if (a[i] != v) return false;
    return true;
}

/* Byte offset of block (layer, kv, head, tier i) from the >>transfer comment's formula, with the
   block sizes from kvmix_layout_bytes (independent of both implementations' own arithmetic). */
static size_t payload_block_offset(const kvmix_payload_info &info, int l, int kv, int h, int i,
                                   size_t *block_bytes) {
    const int counts[3] = {info.n_fp16, info.n_int8, info.n_int4};
    size_t tier[3], slice = 0;
    for (int j = 0; j < 3; j++) {
        kvmix_layout bl;
        memset(&bl, 0, sizeof bl);
        bl.format = (kvmix_format)(KVMIX_FORMAT_FP16 + j);
        bl.n_tokens = counts[j], bl.head_dim = info.desc.head_dim;
        bl.group_size = j ? info.desc.group_size : 0;
        size_t bytes = 0;
        kvmix_layout_bytes(&bl, &bytes);
        tier[j] = align16(bytes);
        if (j == i) *block_bytes = bytes;
        slice += tier[j];
    }
    size_t off = info.head_bytes + (((size_t)l * 2 + kv) * info.desc.n_kv_heads + h) * slice;
    for (int j = 0; j < i; j++) off += tier[j];
    return off;
}

struct payload_dev {
    uint16_t *keys, *values, *out_k, *out_v;
    uint8_t *payload;
    void *ws;
    int32_t *flags;
};

static void payload_dev_free(payload_dev &g) {
    cudaFree(g.keys);
    cudaFree(g.values);
    cudaFree(g.out_k);
    cudaFree(g.out_v);
    cudaFree(g.payload);
    cudaFree(g.ws);
    cudaFree(g.flags);
}

/* mix: 0 all FP16, 1 all INT4, 2 random FP16/INT8/INT4, 3 random with NO_ROW (RESIDUAL), 4 all
   NO_ROW (RESIDUAL: an empty body). errors: also run the error paths on this case. */
static void test_payload_case(kvmix_payload_kind kind, int d, int g, int n, int n_kv, int n_layers,
                              int mix, kvmix_cuda_dtype dt, bool errors) {
    char name[300];
    std::vector<uint8_t> tiers(n);
    for (int t = 0; t < n; t++) {
        int tier = mix == 0 ? KVMIX_FORMAT_FP16 : mix == 1 ? KVMIX_FORMAT_INT4 : 1 + irand(3);
        if (mix == 3 && irand(3) == 0) tier = KVMIX_PAYLOAD_NO_ROW;
        if (mix == 4) tier = KVMIX_PAYLOAD_NO_ROW;
        tiers[t] = (uint8_t)tier;
    }
    kvmix_payload_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.kind = kind, desc.head_dim = d, desc.n_kv_heads = n_kv, desc.group_size = g;
    desc.first_layer = irand(4), desc.n_layers = n_layers, desc.n_tokens = n;
    desc.first_position = irand(5000), desc.id = rnd();
    desc.base_id = kind == KVMIX_PAYLOAD_RESIDUAL ? rnd() : 0;
    kvmix_payload_info info;
    kvmix_result rd = kvmix_payload_describe(&desc, tiers.data(), &info, NULL);
    std::vector<uint8_t> head(info.head_bytes);
    kvmix_result rh = kvmix_payload_write_head(&info, tiers.data(), head.data(), head.size(), NULL);
    snprintf(name, sizeof name, "payload describe/write_head kind %d D %d G %d n %d", kind, d, g,
             n);
    check(rd == KVMIX_SUCCESS && rh == KVMIX_SUCCESS, name);
    if (rd != KVMIX_SUCCESS || rh != KVMIX_SUCCESS) return;
    const size_t row_elems = (size_t)n_kv * d, n_elems = (size_t)n_layers * n * row_elems;
    const size_t total = info.total_bytes, out_bytes = n_elems * 2;
    /* inputs; rows of NO_ROW tokens hold NaN: they must not be read */
    std::vector<uint16_t> keys, values;
    fill_payload_rows(keys, (size_t)n_layers * n * n_kv, d, dt);
    fill_payload_rows(values, (size_t)n_layers * n * n_kv, d, dt);
    for (int l = 0; l < n_layers; l++)
        for (int t = 0; t < n; t++)
            if (tiers[t] == KVMIX_PAYLOAD_NO_ROW)
                for (size_t e = 0; e < row_elems; e++) {
                    keys[((size_t)l * n + t) * row_elems + e] =
                        dt == KVMIX_CUDA_BF16 ? 0x7fc0 : 0x7e00;
                    values[((size_t)l * n + t) * row_elems + e] = 0x7c00;
                }
    std::vector<float> kf(n_elems), vf(n_elems);
    for (size_t i = 0; i < n_elems; i++)
        kf[i] = from_dtype(keys[i], dt), vf[i] = from_dtype(values[i], dt);
    std::vector<uint8_t> expect(total, 0x11);
    size_t packed = 0;
    kvmix_result rp = kvmix_payload_pack(&desc, tiers.data(), kf.data(), vf.data(), expect.data(),
                                         total, &packed, NULL);
    snprintf(name, sizeof name, "payload CPU pack kind %d D %d G %d n %d", kind, d, g, n);
    check(rp == KVMIX_SUCCESS && packed == total, name);
    if (rp != KVMIX_SUCCESS) return;

    payload_dev gd;
    memset(&gd, 0, sizeof gd);
    size_t ws_bytes = 0;
    kvmix_cuda_payload_workspace_bytes(n, &ws_bytes);
    CUDA_OK(cudaMalloc(&gd.keys, out_bytes + 16));
    CUDA_OK(cudaMalloc(&gd.values, out_bytes + 16));
    CUDA_OK(cudaMalloc(&gd.out_k, out_bytes + 16));
    CUDA_OK(cudaMalloc(&gd.out_v, out_bytes + 16));
    CUDA_OK(cudaMalloc(&gd.payload, total));
    CUDA_OK(cudaMalloc(&gd.ws, ws_bytes));
    CUDA_OK(cudaMalloc(&gd.flags, 4));
    CUDA_OK(cudaMemcpy(gd.keys, keys.data(), out_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(gd.values, values.data(), out_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(gd.ws, 0xFF, ws_bytes));
    int32_t flags = -1;
    std::vector<uint8_t> got(total);
    /* Pack: body poisoned, head copied; returns r, fills got and flags. */
    auto run_pack = [&](const void *k, const void *v) -> kvmix_result {
        cudaMemset(gd.payload, 0xA5, total);
        cudaMemcpy(gd.payload, head.data(), head.size(), cudaMemcpyHostToDevice);
        cudaMemset(gd.flags, 0, 4);
        kvmix_result r =
            kvmix_cuda_payload_pack(&info, k, v, dt, gd.payload, gd.ws, ws_bytes, gd.flags, 0);
        cudaDeviceSynchronize();
        cudaMemcpy(got.data(), gd.payload, total, cudaMemcpyDeviceToHost);
        cudaMemcpy(&flags, gd.flags, 4, cudaMemcpyDeviceToHost);
        return r;
    };
    const bool has_rows = info.n_fp16 + info.n_int8 + info.n_int4 > 0;
    kvmix_result r = run_pack(has_rows ? gd.keys : NULL, has_rows ? gd.values : NULL);
    size_t diff = first_diff(got, expect);
    snprintf(name, sizeof name,
             "payload pack kind %d D %d G %d n %d kv %d layers %d mix %d %s: bytes equal (first "
             "diff %zu of %zu), r %d flags %d",
             kind, d, g, n, n_kv, n_layers, mix, dtype_name(dt), diff, total, r, flags);
    check(r == KVMIX_SUCCESS && flags == 0 && diff == total, name);

    /* Unpack the CPU's bytes. ROWS: outputs poisoned; RESIDUAL: outputs hold old rows (finite),
       the expectation is kvmix_payload_unpack added to their floats, rounded to dtype. One case in
       three passes keys NULL: they must stay as they were. */
    CUDA_OK(cudaMemcpy(gd.payload, expect.data(), total, cudaMemcpyHostToDevice));
    std::vector<uint16_t> old_k(n_elems, 0xEEEE), old_v(n_elems, 0xEEEE);
    if (kind == KVMIX_PAYLOAD_RESIDUAL) {
        fill_payload_rows(old_k, (size_t)n_layers * n * n_kv, d, dt);
        fill_payload_rows(old_v, (size_t)n_layers * n * n_kv, d, dt);
    }
    const bool no_keys = irand(3) == 0;
    std::vector<float> ek(n_elems, 0.0f), ev(n_elems, 0.0f);
    for (size_t i = 0; i < n_elems && kind == KVMIX_PAYLOAD_RESIDUAL; i++)
        ek[i] = from_dtype(old_k[i], dt), ev[i] = from_dtype(old_v[i], dt);
    bool cpu_ok = true;
    for (int l = 0; l < n_layers; l++)
        cpu_ok &=
            kvmix_payload_unpack(expect.data(), total, desc.first_layer + l,
                                 ek.data() + (size_t)l * n * row_elems,
                                 ev.data() + (size_t)l * n * row_elems, NULL) == KVMIX_SUCCESS;
    std::vector<uint16_t> want_k(n_elems), want_v(n_elems), got_k(n_elems), got_v(n_elems);
    for (size_t i = 0; i < n_elems; i++) {
        want_k[i] = no_keys ? old_k[i] : to_dtype(ek[i], dt);
        want_v[i] = to_dtype(ev[i], dt);
    }
    auto run_unpack = [&](bool with_keys) -> kvmix_result {
        cudaMemcpy(gd.out_k, old_k.data(), out_bytes, cudaMemcpyHostToDevice);
        cudaMemcpy(gd.out_v, old_v.data(), out_bytes, cudaMemcpyHostToDevice);
        cudaMemset(gd.flags, 0, 4);
        kvmix_result r2 =
            kvmix_cuda_payload_unpack(&info, gd.payload, dt, with_keys ? gd.out_k : NULL, gd.out_v,
                                      gd.ws, ws_bytes, gd.flags, 0);
        cudaDeviceSynchronize();
        cudaMemcpy(got_k.data(), gd.out_k, out_bytes, cudaMemcpyDeviceToHost);
        cudaMemcpy(got_v.data(), gd.out_v, out_bytes, cudaMemcpyDeviceToHost);
        cudaMemcpy(&flags, gd.flags, 4, cudaMemcpyDeviceToHost);
        return r2;
    };
    r = run_unpack(!no_keys);
    size_t bad_k = 0, bad_v = 0;
    for (size_t i = 0; i < n_elems; i++)
        bad_k += got_k[i] != want_k[i], bad_v += got_v[i] != want_v[i];
    snprintf(name, sizeof name,
             "payload unpack kind %d D %d G %d n %d kv %d layers %d mix %d %s%s: rows equal "
             "(%zu, %zu differ), r %d flags %d",
             kind, d, g, n, n_kv, n_layers, mix, dtype_name(dt), no_keys ? " (keys NULL)" : "",
             bad_k, bad_v, r, flags);
    check(cpu_ok && r == KVMIX_SUCCESS && flags == 0 && bad_k == 0 && bad_v == 0, name);
    CUDA_OK(cudaGetLastError());

    if (errors && has_rows) {
        /* an input row that FP16 cannot hold: BAD_VALUE, the body untouched */
        int t;
        do t = irand(n);
        while (tiers[t] == KVMIX_PAYLOAD_NO_ROW);
        const int l = irand(n_layers), kv = irand(2);
        const size_t e = ((size_t)l * n + t) * row_elems + irand((int)row_elems);
        uint16_t *in = kv ? gd.values : gd.keys;
        uint16_t bad = dt == KVMIX_CUDA_BF16 ? (irand(2) ? kvmix_fp32_to_bf16(70000.0f) : 0xff80)
                                             : (irand(2) ? 0x7c00 : 0xfe00);
        CUDA_OK(cudaMemcpy(in + e, &bad, 2, cudaMemcpyHostToDevice));
        r = run_pack(gd.keys, gd.values);
        snprintf(name, sizeof name,
                 "payload pack D %d n %d %s: value 0x%04x flagged BAD_VALUE, body untouched "
                 "(r %d flags %d)",
                 d, n, dtype_name(dt), bad, r, flags);
        check(r == KVMIX_SUCCESS && flags == KVMIX_CUDA_PAYLOAD_BAD_VALUE &&
                  memcmp(got.data(), head.data(), head.size()) == 0 &&
                  all_bytes(got, head.size(), total, 0xA5),
              name);
        const uint16_t good = kv ? values[e] : keys[e];
        CUDA_OK(cudaMemcpy(in + e, &good, 2, cudaMemcpyHostToDevice));

        /* a tier byte or a header field on the device head that disagrees with info: CORRUPT,
           nothing written, by pack and by unpack */
        for (int what = 0; what < 3; what++) {
            std::vector<uint8_t> bad_head = head;
            const int tt = irand(n);
            if (what == 0) /* another tier: the counts disagree */
                bad_head[KVMIX_PAYLOAD_HEADER_BYTES + tt] =
                    (uint8_t)(tiers[tt] == KVMIX_FORMAT_FP16 ? KVMIX_FORMAT_INT4
                                                             : KVMIX_FORMAT_FP16);
            else if (what == 1) /* not a tier */
                bad_head[KVMIX_PAYLOAD_HEADER_BYTES + tt] =
                    (uint8_t)(kind == KVMIX_PAYLOAD_ROWS && irand(2) ? 0 : 4 + irand(250));
            else /* a header byte (the id) */
                bad_head[40 + irand(8)] ^= (uint8_t)(1u << irand(8));
            CUDA_OK(cudaMemset(gd.payload, 0xA5, total));
            CUDA_OK(cudaMemcpy(gd.payload, bad_head.data(), head.size(), cudaMemcpyHostToDevice));
            CUDA_OK(cudaMemset(gd.flags, 0, 4));
            r = kvmix_cuda_payload_pack(&info, gd.keys, gd.values, dt, gd.payload, gd.ws, ws_bytes,
                                        gd.flags, 0);
            CUDA_OK(cudaDeviceSynchronize());
            CUDA_OK(cudaMemcpy(got.data(), gd.payload, total, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(&flags, gd.flags, 4, cudaMemcpyDeviceToHost));
            snprintf(name, sizeof name,
                     "payload pack D %d n %d: bad head (%d) flagged CORRUPT, body untouched (r %d "
                     "flags %d)",
                     d, n, what, r, flags);
            check(r == KVMIX_SUCCESS && flags == KVMIX_CUDA_PAYLOAD_CORRUPT &&
                      all_bytes(got, head.size(), total, 0xA5),
                  name);
            std::vector<uint8_t> bad_payload = expect;
            memcpy(bad_payload.data(), bad_head.data(), head.size());
            CUDA_OK(cudaMemcpy(gd.payload, bad_payload.data(), total, cudaMemcpyHostToDevice));
            r = run_unpack(true);
            snprintf(name, sizeof name,
                     "payload unpack D %d n %d: bad head (%d) flagged CORRUPT, outputs untouched "
                     "(r %d flags %d)",
                     d, n, what, r, flags);
            check(r == KVMIX_SUCCESS && flags == KVMIX_CUDA_PAYLOAD_CORRUPT && got_k == old_k &&
                      got_v == old_v,
                  name);
        }

        /* a block no quantize call writes: a scale with its sign bit set, an infinite minimum, an
           infinite FP16 row element. The CPU refuses it too; the GPU writes nothing. */
        for (int what = 0; what < 3; what++) {
            int want_tier = what == 2 ? 0 : (info.n_int8 > 0 ? 1 : info.n_int4 > 0 ? 2 : -1);
            const int counts[3] = {info.n_fp16, info.n_int8, info.n_int4};
            if (want_tier < 0 || counts[want_tier] == 0) continue;
            std::vector<uint8_t> bad_payload = expect;
            const int bl = irand(n_layers), bkv = irand(2), bh = irand(n_kv);
            size_t block_bytes = 0;
            size_t off = payload_block_offset(info, bl, bkv, bh, want_tier, &block_bytes);
            const int row = irand(counts[want_tier]);
            if (want_tier == 0) {
                size_t at = off + ((size_t)row * d + irand(d)) * 2;
                bad_payload[at] = 0x00, bad_payload[at + 1] = irand(2) ? 0x7c : 0xfe;
            } else {
                const int groups = d / info.desc.group_size;
                const size_t row_bytes = want_tier == 1 ? (size_t)d : (size_t)d / 2;
                const size_t pair = off + (size_t)counts[want_tier] * row_bytes +
                                    ((size_t)row * groups + irand(groups)) * 4;
                if (what == 0)
                    bad_payload[pair + 1] |= 0x80; /* scale's sign */
                else
                    bad_payload[pair + 3] = (uint8_t)((bad_payload[pair + 3] & 0x80) | 0x7c);
            }
            std::vector<float> tmp(n * row_elems);
            kvmix_result rc = kvmix_payload_unpack(bad_payload.data(), total, desc.first_layer + bl,
                                                   tmp.data(), tmp.data(), NULL);
            CUDA_OK(cudaMemcpy(gd.payload, bad_payload.data(), total, cudaMemcpyHostToDevice));
            r = run_unpack(true);
            snprintf(name, sizeof name,
                     "payload unpack D %d n %d: corrupt block (%d, tier %d) flagged CORRUPT, "
                     "outputs untouched (cpu %d, r %d flags %d)",
                     d, n, what, want_tier, rc, r, flags);
            check(rc == KVMIX_ERR_CORRUPT_DATA && r == KVMIX_SUCCESS &&
                      flags == KVMIX_CUDA_PAYLOAD_CORRUPT && got_k == old_k && got_v == old_v,
                  name);
        }
        CUDA_OK(cudaGetLastError());
    }
    payload_dev_free(gd);
}

static void test_payload(bool quick) {
    const int dims[] = {64, 128, 256}, ns[] = {1, 15, 16, 17, 130}, groups[] = {16, 32};
    int serial = 0;
    for (int di = 0; di < 3; di++)
        for (int gi = 0; gi < 2; gi++)
            for (int ni = 0; ni < 5; ni++) {
                if (quick && (di == 2 || ni == 1 || ni == 2 || (gi == 0 && ni != 4))) continue;
                for (int mix = 0; mix < 4; mix++)
                    for (int di2 = 0; di2 < (mix >= 2 ? 2 : 1); di2++, serial++) {
                        bool bf16 = mix >= 2 ? di2 == 1 : (serial / 3) % 2 == 1;
                        kvmix_cuda_dtype dt = bf16 ? KVMIX_CUDA_BF16 : KVMIX_CUDA_FP16;
                        kvmix_payload_kind kind =
                            mix == 3 ? KVMIX_PAYLOAD_RESIDUAL : KVMIX_PAYLOAD_ROWS;
                        int n_kv = serial % 2 ? 3 : 1, n_layers = (serial / 2) % 2 ? 2 : 1;
                        test_payload_case(kind, dims[di], groups[gi], ns[ni], n_kv, n_layers, mix,
                                          dt, mix >= 2);
                    }
            }
    /* odd shapes: D 32, 96, 512 and groups of 8 to 512 channels (G 48 and 512: one thread per
       group), a RESIDUAL that carries nothing, more than one tile of the tier scan (4096 tokens),
       more slices than a grid's y (65535) */
    test_payload_case(KVMIX_PAYLOAD_ROWS, 32, 8, 37, 2, 2, 2, KVMIX_CUDA_BF16, true);
    test_payload_case(KVMIX_PAYLOAD_ROWS, 96, 48, 70, 3, 1, 2, KVMIX_CUDA_FP16, true);
    test_payload_case(KVMIX_PAYLOAD_ROWS, 128, 64, 50, 2, 1, 2, KVMIX_CUDA_FP16, true);
    test_payload_case(KVMIX_PAYLOAD_ROWS, 256, 256, 45, 1, 2, 2, KVMIX_CUDA_BF16, true);
    test_payload_case(KVMIX_PAYLOAD_RESIDUAL, 512, 512, 33, 1, 1, 3, KVMIX_CUDA_FP16, true);
    test_payload_case(KVMIX_PAYLOAD_ROWS, 512, 8, 40, 1, 2, 2, KVMIX_CUDA_BF16, true);
    test_payload_case(KVMIX_PAYLOAD_RESIDUAL, 128, 32, 40, 2, 2, 4, KVMIX_CUDA_FP16, false);
    test_payload_case(KVMIX_PAYLOAD_RESIDUAL, 64, 32, 5000, 1, 1, 3, KVMIX_CUDA_BF16, true);
    if (!quick) {
        test_payload_case(KVMIX_PAYLOAD_ROWS, 128, 32, 9000, 2, 1, 2, KVMIX_CUDA_FP16, false);
        test_payload_case(KVMIX_PAYLOAD_ROWS, 32, 16, 2, 16400, 2, 2, KVMIX_CUDA_FP16, false);
    }
}

static void test_payload_arguments(void) {
    char dummy_storage[512];
    void *dummy = (void *)(((uintptr_t)dummy_storage + 15) & ~(uintptr_t)15);
    size_t ws = 0;
    check(kvmix_cuda_payload_workspace_bytes(0, &ws) == KVMIX_SUCCESS && ws == 256,
          "payload workspace: 0 tokens");
    check(kvmix_cuda_payload_workspace_bytes(100, &ws) == KVMIX_SUCCESS && ws == 256 + 512,
          "payload workspace: 100 tokens");
    check(kvmix_cuda_payload_workspace_bytes(-1, &ws) == KVMIX_ERR_INVALID_ARGUMENT,
          "payload workspace: negative");
    check(kvmix_cuda_payload_workspace_bytes(5, NULL) == KVMIX_ERR_NULL_POINTER,
          "payload workspace: NULL");
    const int n = 20;
    uint8_t tiers[n];
    for (int t = 0; t < n; t++) tiers[t] = (uint8_t)(1 + t % 3);
    kvmix_payload_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.kind = KVMIX_PAYLOAD_ROWS, desc.head_dim = 128, desc.n_kv_heads = 2, desc.n_layers = 1;
    desc.n_tokens = n;
    kvmix_payload_info info, bad;
    check(kvmix_payload_describe(&desc, tiers, &info, NULL) == KVMIX_SUCCESS,
          "payload args: describe");
    kvmix_cuda_payload_workspace_bytes(n, &ws);
    const kvmix_cuda_dtype f16 = KVMIX_CUDA_FP16;
    check(kvmix_cuda_payload_pack(NULL, dummy, dummy, f16, dummy, dummy, ws, NULL, 0) ==
              KVMIX_ERR_NULL_POINTER,
          "payload pack: NULL info");
    check(kvmix_cuda_payload_unpack(NULL, dummy, f16, dummy, dummy, dummy, ws, NULL, 0) ==
              KVMIX_ERR_NULL_POINTER,
          "payload unpack: NULL info");
    check(kvmix_cuda_payload_pack(&info, dummy, dummy, f16, NULL, dummy, ws, NULL, 0) ==
              KVMIX_ERR_NULL_POINTER,
          "payload pack: NULL payload");
    check(kvmix_cuda_payload_pack(&info, dummy, dummy, f16, dummy, NULL, ws, NULL, 0) ==
              KVMIX_ERR_NULL_POINTER,
          "payload pack: NULL workspace");
    check(kvmix_cuda_payload_pack(&info, NULL, dummy, f16, dummy, dummy, ws, NULL, 0) ==
              KVMIX_ERR_NULL_POINTER,
          "payload pack: NULL keys");
    check(kvmix_cuda_payload_pack(&info, dummy, NULL, f16, dummy, dummy, ws, NULL, 0) ==
              KVMIX_ERR_NULL_POINTER,
          "payload pack: NULL values");
    check(kvmix_cuda_payload_unpack(&info, NULL, f16, dummy, dummy, dummy, ws, NULL, 0) ==
              KVMIX_ERR_NULL_POINTER,
          "payload unpack: NULL payload");
    check(kvmix_cuda_payload_unpack(&info, dummy, f16, dummy, dummy, NULL, ws, NULL, 0) ==
              KVMIX_ERR_NULL_POINTER,
          "payload unpack: NULL workspace");
    check(kvmix_cuda_payload_pack(&info, dummy, dummy, f16, dummy, dummy, ws - 1, NULL, 0) ==
              KVMIX_ERR_BUFFER_TOO_SMALL,
          "payload pack: small workspace");
    check(kvmix_cuda_payload_unpack(&info, dummy, f16, dummy, dummy, dummy, ws - 4, NULL, 0) ==
              KVMIX_ERR_BUFFER_TOO_SMALL,
          "payload unpack: small workspace");
    check(kvmix_cuda_payload_pack(&info, dummy, dummy, (kvmix_cuda_dtype)3, dummy, dummy, ws, NULL,
                                  0) == KVMIX_ERR_UNSUPPORTED,
          "payload pack: dtype");
    check(kvmix_cuda_payload_unpack(&info, dummy, (kvmix_cuda_dtype)0, dummy, dummy, dummy, ws,
                                    NULL, 0) == KVMIX_ERR_UNSUPPORTED,
          "payload unpack: dtype");
    check(kvmix_cuda_payload_pack(&info, dummy, dummy, f16, (uint8_t *)dummy + 8, dummy, ws, NULL,
                                  0) == KVMIX_ERR_INVALID_ARGUMENT,
          "payload pack: misaligned payload");
    check(kvmix_cuda_payload_unpack(&info, dummy, f16, (uint8_t *)dummy + 2, dummy, dummy, ws, NULL,
                                    0) == KVMIX_ERR_INVALID_ARGUMENT,
          "payload unpack: misaligned keys");
    /* info that is not a description */
    const char *what[] = {"total_bytes", "head_bytes", "counts",   "head_dim",
                          "group_size",  "kind",       "n_layers", "rows base_id"};
    for (int w = 0; w < 8; w++) {
        bad = info;
        switch (w) {
        case 0: bad.total_bytes += 16; break;
        case 1: bad.head_bytes -= 16; break;
        case 2: bad.n_fp16 += 1, bad.n_int4 -= 1; break;
        case 3: bad.desc.head_dim = 100; break;
        case 4: bad.desc.group_size = 0; break;
        case 5: bad.desc.kind = (kvmix_payload_kind)3; break;
        case 6: bad.desc.n_layers = 0; break;
        default: bad.desc.base_id = 7; break;
        }
        char name[120];
        snprintf(name, sizeof name, "payload pack/unpack: bad info (%s)", what[w]);
        check(kvmix_cuda_payload_pack(&bad, dummy, dummy, f16, dummy, dummy, ws, NULL, 0) ==
                      KVMIX_ERR_INVALID_ARGUMENT &&
                  kvmix_cuda_payload_unpack(&bad, dummy, f16, dummy, dummy, dummy, ws, NULL, 0) ==
                      KVMIX_ERR_INVALID_ARGUMENT,
              name);
    }
    bad = info, bad.n_fp16 += 1; /* ROWS: more rows than tokens */
    check(kvmix_cuda_payload_pack(&bad, dummy, dummy, f16, dummy, dummy, ws, NULL, 0) ==
              KVMIX_ERR_INVALID_ARGUMENT,
          "payload pack: more rows than tokens");
    /* 0 tokens: nothing to check or enqueue */
    desc.n_tokens = 0;
    kvmix_payload_info empty;
    check(kvmix_payload_describe(&desc, NULL, &empty, NULL) == KVMIX_SUCCESS &&
              kvmix_cuda_payload_pack(&empty, NULL, NULL, f16, NULL, NULL, 0, NULL, 0) ==
                  KVMIX_SUCCESS &&
              kvmix_cuda_payload_unpack(&empty, NULL, f16, NULL, NULL, NULL, 0, NULL, 0) ==
                  KVMIX_SUCCESS,
          "payload: 0 tokens enqueue nothing");
    bad = empty, bad.n_int8 = 1;
    check(kvmix_cuda_payload_pack(&bad, NULL, NULL, f16, NULL, NULL, 0, NULL, 0) ==
              KVMIX_ERR_INVALID_ARGUMENT,
          "payload: 0 tokens with rows");
    check(cudaGetLastError() == cudaSuccess, "no CUDA error left by payload bad-argument calls");
}

/* ---- bad arguments ----------------------------------------------------------------------- */

/* Occupancy of the decode kernel: a count for every head_dim the launcher takes (UNSUPPORTED only
   where the device holds no stage size of it, as kvmix_cuda_decode), errors for bad arguments. */
static void test_decode_blocks_per_sm(void) {
    for (int d : {32, 64, 96, 128, 160, 256}) {
        int32_t blocks = -1;
        const kvmix_result r = kvmix_cuda_decode_blocks_per_sm(d, 4, &blocks);
        char name[96];
        snprintf(name, sizeof name, "decode blocks per SM at head_dim %d: %d (r %d)", d, blocks, r);
        check((r == KVMIX_SUCCESS && blocks >= 1) || (r == KVMIX_ERR_UNSUPPORTED && d == 256),
              name);
    }
    int32_t blocks = 0;
    check(kvmix_cuda_decode_blocks_per_sm(128, 4, NULL) == KVMIX_ERR_NULL_POINTER,
          "decode blocks per SM: NULL");
    check(kvmix_cuda_decode_blocks_per_sm(128, 0, &blocks) == KVMIX_ERR_INVALID_ARGUMENT,
          "decode blocks per SM: no query heads");
    check(kvmix_cuda_decode_blocks_per_sm(288, 4, &blocks) == KVMIX_ERR_UNSUPPORTED,
          "decode blocks per SM: head_dim 288");
    check(kvmix_cuda_decode_blocks_per_sm(80, 4, &blocks) == KVMIX_ERR_UNSUPPORTED,
          "decode blocks per SM: head_dim 80");
}

static void test_bad_arguments(void) {
    char dummy_storage[256];
    void *dummy = (void *)(((uintptr_t)dummy_storage + 15) & ~(uintptr_t)15);
    kvmix_layout l;
    memset(&l, 0, sizeof l);
    l.format = KVMIX_FORMAT_INT4, l.n_tokens = 32, l.head_dim = 128;
    kvmix_cuda_quantize_job *jobs = (kvmix_cuda_quantize_job *)dummy;
    check(kvmix_cuda_quantize(NULL, dummy, 128, dummy, jobs, 1, NULL, 0) == KVMIX_ERR_NULL_POINTER,
          "quantize: NULL layout");
    check(kvmix_cuda_quantize(&l, NULL, 128, dummy, jobs, 1, NULL, 0) == KVMIX_ERR_NULL_POINTER,
          "quantize: NULL src");
    check(kvmix_cuda_quantize(&l, dummy, 64, dummy, jobs, 1, NULL, 0) == KVMIX_ERR_INVALID_ARGUMENT,
          "quantize: short stride");
    check(kvmix_cuda_quantize(&l, dummy, 128, dummy, jobs, -1, NULL, 0) ==
              KVMIX_ERR_INVALID_ARGUMENT,
          "quantize: negative jobs");
    check(kvmix_cuda_quantize(&l, dummy, 128, dummy, jobs, 0, NULL, 0) == KVMIX_SUCCESS,
          "quantize: no jobs");
    l.format = (kvmix_format)9;
    check(kvmix_cuda_quantize(&l, dummy, 128, dummy, jobs, 1, NULL, 0) == KVMIX_ERR_UNKNOWN_FORMAT,
          "quantize: unknown format");
    l.format = KVMIX_FORMAT_INT4, l.head_dim = 100;
    check(kvmix_cuda_quantize(&l, dummy, 128, dummy, jobs, 1, NULL, 0) == KVMIX_ERR_BAD_SHAPE,
          "quantize: head_dim 100");
    l.head_dim = 128, l.format = KVMIX_FORMAT_BOOSTED, l.n_boost = 6;
    check(kvmix_cuda_quantize(&l, dummy, 128, dummy, jobs, 1, NULL, 0) == KVMIX_ERR_BAD_SHAPE,
          "quantize: n_boost 6");

    kvmix_view v;
    memset(&v, 0, sizeof v);
    v.n_seqs = 1, v.n_kv_heads = 2, v.head_dim = 128, v.n_spans = 1, v.n_boost = 16;
    v.base = (const uint8_t *)dummy, v.base_bytes = 64, v.spans = (const kvmix_view_span *)dummy;
    v.seq_first_span = (const int32_t *)dummy;
    kvmix_cuda_decode_desc desc;
    desc.n_q_heads = 8, desc.scale = 0.0f, desc.dtype = KVMIX_CUDA_BF16, desc.n_splits = 2;
    desc.stages = KVMIX_CUDA_STAGES_AUTO;
    size_t ws = 0;
    check(kvmix_cuda_decode_workspace_bytes(1, 8, 128, 2, &ws) == KVMIX_SUCCESS &&
              ws == (size_t)2 * 8 * 129 * 4,
          "workspace bytes");
    check(kvmix_cuda_decode_workspace_bytes(1, 8, 128, 0, &ws) == KVMIX_ERR_INVALID_ARGUMENT,
          "workspace: 0 splits");
    check(kvmix_cuda_decode(NULL, &desc, dummy, dummy, NULL, dummy, ws, 0) ==
              KVMIX_ERR_NULL_POINTER,
          "decode: NULL view");
    check(kvmix_cuda_decode(&v, NULL, dummy, dummy, NULL, dummy, ws, 0) == KVMIX_ERR_NULL_POINTER,
          "decode: NULL desc");
    check(kvmix_cuda_decode(&v, &desc, NULL, dummy, NULL, dummy, ws, 0) == KVMIX_ERR_NULL_POINTER,
          "decode: NULL q");
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, NULL, ws, 0) == KVMIX_ERR_NULL_POINTER,
          "decode: NULL workspace");
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws - 4, 0) ==
              KVMIX_ERR_BUFFER_TOO_SMALL,
          "decode: small workspace");
    desc.n_q_heads = 7;
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws, 0) ==
              KVMIX_ERR_INVALID_ARGUMENT,
          "decode: heads not a multiple");
    desc.n_q_heads = 8, desc.n_splits = 0;
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws, 0) ==
              KVMIX_ERR_INVALID_ARGUMENT,
          "decode: 0 splits");
    desc.n_splits = 2, desc.stages = 2;
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws, 0) ==
              KVMIX_ERR_INVALID_ARGUMENT,
          "decode: unknown stages");
    desc.stages = KVMIX_CUDA_STAGES_AUTO, desc.scale = -1.0f;
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws, 0) ==
              KVMIX_ERR_INVALID_ARGUMENT,
          "decode: negative scale");
    desc.scale = 0.0f, desc.dtype = (kvmix_cuda_dtype)7;
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws, 0) == KVMIX_ERR_UNSUPPORTED,
          "decode: dtype");
    desc.dtype = KVMIX_CUDA_FP16;
    v.head_dim = 288; /* past the merge's block of a thread per dim */
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws, 0) == KVMIX_ERR_UNSUPPORTED,
          "decode: head_dim 288");
    v.head_dim = 80, v.group_size = 16; /* a view kvmix.h takes; 32 does not divide 80 */
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws, 0) == KVMIX_ERR_UNSUPPORTED,
          "decode: head_dim 80");
    v.group_size = 0;
    v.head_dim = 100;
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws, 0) == KVMIX_ERR_BAD_SHAPE,
          "decode: head_dim 100");
    v.head_dim = 128, v.group_size = 32;
    v.value_group_size = 128; /* values in groups of their own */
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws, 0) == KVMIX_ERR_UNSUPPORTED,
          "decode: value groups of 128 beside key groups of 32");
    check(kvmix_cuda_view_dequantize(&v, 0, KVMIX_CUDA_FP16, dummy, dummy, 4, 0) ==
              KVMIX_ERR_UNSUPPORTED,
          "dequantize: value groups of their own");
    v.value_group_size = 0;
    v.group_size = 0, v.base = (const uint8_t *)dummy + 1;
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws, 0) ==
              KVMIX_ERR_INVALID_ARGUMENT,
          "decode: misaligned base");
    v.base = (const uint8_t *)dummy, v.seq_first_span = NULL;
    check(kvmix_cuda_decode(&v, &desc, dummy, dummy, NULL, dummy, ws, 0) == KVMIX_ERR_NULL_POINTER,
          "decode: NULL seq_first_span");
    v.seq_first_span = (const int32_t *)dummy;
    check(kvmix_cuda_view_dequantize(&v, 1, KVMIX_CUDA_FP16, dummy, dummy, 4, 0) ==
              KVMIX_ERR_INVALID_ARGUMENT,
          "dequantize: seq out of range");
    check(kvmix_cuda_view_dequantize(&v, 0, (kvmix_cuda_dtype)3, dummy, dummy, 4, 0) ==
              KVMIX_ERR_UNSUPPORTED,
          "dequantize: dtype");
    check(kvmix_cuda_view_score(&v, 0, 3, (const float *)dummy, (float *)dummy, 4, 0) ==
              KVMIX_ERR_INVALID_ARGUMENT,
          "score: heads");
    check(kvmix_cuda_view_score(&v, 0, 4, NULL, (float *)dummy, 4, 0) == KVMIX_ERR_NULL_POINTER,
          "score: NULL memory");
    int32_t splits = 0;
    check(kvmix_cuda_decode_choose_splits(8, 8, 32, 128, 32768, 132, &splits) == KVMIX_SUCCESS &&
              splits >= 1,
          "choose splits");
    int32_t wide = 0, grouped = 0; /* D 256 runs one block per SM, 16 q heads per kv head 4 */
    check(kvmix_cuda_decode_choose_splits(1, 8, 32, 256, 1 << 20, 128, &wide) == KVMIX_SUCCESS &&
              kvmix_cuda_decode_choose_splits(1, 8, 32, 128, 1 << 20, 128, &splits) ==
                  KVMIX_SUCCESS &&
              kvmix_cuda_decode_choose_splits(1, 8, 128, 128, 1 << 20, 128, &grouped) ==
                  KVMIX_SUCCESS &&
              wide * 2 == splits && grouped * 4 == splits,
          "choose splits: head_dim and grouped-query ratio");
    check(kvmix_cuda_decode_choose_splits(8, 8, 32, 96, 32768, 132, &splits) == KVMIX_SUCCESS &&
              splits >= 1,
          "choose splits: head_dim 96 (CUDA-core walk)");
    check(kvmix_cuda_decode_choose_splits(8, 8, 32, 288, 32768, 132, &splits) ==
              KVMIX_ERR_UNSUPPORTED,
          "choose splits: head_dim 288");
    /* 152 sequences of 2 kv heads: 304 blocks would take a second wave of 40 on 264 slots */
    check(kvmix_cuda_decode_choose_splits(152, 2, 4, 128, 32768, 132, &splits) == KVMIX_SUCCESS &&
              304.0 * splits / (264.0 * ((304 * splits + 263) / 264)) >= 0.9,
          "choose splits: waves at least 90% full");
    check(kvmix_cuda_decode_choose_splits(152, 2, 4, 128, 512, 132, &splits) == KVMIX_SUCCESS &&
              splits == 2,
          "choose splits: the fullest within 256 tokens a split");
    check(cudaGetLastError() == cudaSuccess, "no CUDA error left by bad-argument calls");
}

/* ---- device arena ------------------------------------------------------------------------ */

/* Runs a cache's jobs on the GPU: staged rows and jobs uploaded, kvmix_cuda_cache_run. */
struct gpu_executor {
    uint8_t *arena;
    uint16_t *keys, *values; /* room for max_rows rows */
    kvmix_quantize_job *jobs;
    int32_t *flags;
    size_t row_halves;
};

static int gpu_run(void *ctx, const kvmix_cache_batch *batches, int32_t n_batches,
                   const kvmix_quantize_job *jobs, int32_t n_jobs, const uint16_t *key_rows,
                   const uint16_t *value_rows, int64_t n_rows, int32_t *bad_jobs) {
    gpu_executor *g = (gpu_executor *)ctx;
    size_t bytes = (size_t)n_rows * g->row_halves * 2;
    int32_t flags = 0;
    if (cudaMemcpy(g->keys, key_rows, bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(g->values, value_rows, bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(g->jobs, jobs, (size_t)n_jobs * sizeof *jobs, cudaMemcpyHostToDevice) !=
            cudaSuccess ||
        cudaMemset(g->flags, 0, sizeof(int32_t)) != cudaSuccess)
        return 0;
    if (kvmix_cuda_cache_run(batches, n_batches, g->jobs, g->keys, g->values, g->arena, g->flags,
                             NULL) != KVMIX_SUCCESS ||
        cudaMemcpy(&flags, g->flags, sizeof flags, cudaMemcpyDeviceToHost) != cudaSuccess)
        return 0;
    *bad_jobs = flags != 0;
    return 1;
}

static int gpu_fetch(void *ctx, uint8_t *host, size_t bytes) {
    return cudaMemcpy(host, ((gpu_executor *)ctx)->arena, bytes, cudaMemcpyDeviceToHost) ==
           cudaSuccess;
}

/* The unit_device_arena workloads with the jobs run by the pack: the same bytes as a host arena. */
static void test_device_arena(bool quick) {
    for (int which = 0; which < 4; which++) {
        kvmix_cache_desc d = {};
        d.n_layers = 2, d.n_kv_heads = 2, d.head_dim = which == 3 ? 128 : 64;
        d.page_tokens = 16, d.max_seqs = 5, d.max_tokens_per_seq = 160;
        d.arena_bytes = (size_t)1 << 21, d.max_jobs = 400;
        d.n_boost = 8; /* the scenario asks for BOOSTED keys */
        if (which == 0) d.n_window = 16;
        if (which == 1) d.n_sink = 4, d.n_window = 32, d.window_values_only = 1;
        if (which == 2) {
            d.n_sink = 8, d.partial = KVMIX_CACHE_PARTIAL_QUANTIZE;
            d.group_size = 16, d.value_group_size = 64;
        }
        gpu_executor g = {};
        g.row_halves = (size_t)d.n_kv_heads * (size_t)d.head_dim;
        size_t max_rows = 4 * (size_t)d.n_layers * 32;
        CUDA_OK(cudaMalloc(&g.arena, d.arena_bytes));
        CUDA_OK(cudaMemset(g.arena, 0, d.arena_bytes));
        CUDA_OK(cudaMalloc(&g.keys, max_rows * g.row_halves * 2));
        CUDA_OK(cudaMalloc(&g.values, max_rows * g.row_halves * 2));
        CUDA_OK(cudaMalloc(&g.jobs, (size_t)d.max_jobs * sizeof(kvmix_quantize_job)));
        CUDA_OK(cudaMalloc(&g.flags, sizeof(int32_t)));
        da_executor ex = {&g, g.arena, gpu_run, gpu_fetch};
        int64_t compacted_all = 0, retiered_all = 0;
        /* a random scenario may neither compact nor re-tier: more seeds (up to 12) until both ran */
        for (int seed = 0;
             seed < (quick ? 2 : 6) || ((compacted_all == 0 || retiered_all == 0) && seed < 12);
             seed++) {
            char why[160], what[240];
            da_counts counts = {0, 0, 0};
            int failures = da_scenario(&d, rnd(), 400, &ex, why, sizeof why, &counts);
            snprintf(what, sizeof what, "device arena desc %d seed %d: %s", which, seed, why);
            check(failures == 0 && counts.jobs > 100, what);
            compacted_all += counts.compacted;
            retiered_all += counts.retiered;
        }
        check(compacted_all > 0, "device arena: compaction ran (gather and packing jobs)");
        check(retiered_all > 0, "device arena: pages were re-tiered (gather and packing jobs)");
        cudaFree(g.arena);
        cudaFree(g.keys);
        cudaFree(g.values);
        cudaFree(g.jobs);
        cudaFree(g.flags);
    }
}

int main(int argc, char **argv) {
    bool quick = false;
    const char *only = NULL; /* one group of tests */
    g_rng = (uint64_t)time(NULL) * 2654435761u ^ (uint64_t)clock();
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = true;
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            g_rng = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
    }
    auto runs = [only](const char *group) { return !only || !strcmp(only, group); };
    if (g_rng == 0) g_rng = 1;
    printf("seed %llu%s\n", (unsigned long long)g_rng, quick ? " (quick)" : "");
    int dev_count = 0;
    if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
        printf("no CUDA device\n0 passed, 1 failed\n");
        return 1;
    }
    if (runs("args")) {
        test_bad_arguments();
        test_decode_blocks_per_sm();
        test_payload_arguments();
    }
    if (runs("quantize")) {
        test_quantize(quick);
        printf("quantize: %d passed, %d failed so far\n", g_passed, g_failed);
    }
    if (runs("view")) {
        const int dims[] = {64, 128, 256};
        for (int di = 0; di < 3; di++) {
            if (quick && di == 2) continue;
            test_view_dequantize_score(dims[di], 2, dims[di] / 8, KVMIX_CUDA_FP16, quick);
            if (!quick)
                test_view_dequantize_score(dims[di], 3, dims[di] / 4, KVMIX_CUDA_BF16, quick);
            g_group = dims[di]; /* one group per head */
            test_view_dequantize_score(dims[di], 2, dims[di] / 4, KVMIX_CUDA_BF16, quick);
            g_group = 32;
        }
        test_view_bad_input();
        printf("dequantize/score: %d passed, %d failed so far\n", g_passed, g_failed);
    }
    if (runs("decode")) {
        test_decode(quick);
        printf(
            "decode: %d passed, %d failed so far; largest nmse out %.2e, lse %.2e (bound 1e-6)\n",
            g_passed, g_failed, g_decode_max_out, g_decode_max_lse);
    }
    if (runs("arena")) {
        test_device_arena(quick);
        printf("device arena: %d passed, %d failed so far\n", g_passed, g_failed);
    }
    if (runs("payload")) {
        test_payload(quick);
        printf("payload: %d passed, %d failed so far\n", g_passed, g_failed);
    }
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed ? 1 : 0;
}
