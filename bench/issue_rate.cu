/* How many instructions a byte can a streaming decode afford? (bench/DECODE_NOTES.md, v38)

   Each warp streams its own slice of a buffer through a ring of shared-memory stages filled by
   cp.async (the copies cost the warp one instruction per 16 bytes a lane, as the decode's bulk
   copies cost it almost none), and for every 16 bytes a lane reads back from shared memory it
   issues ALU instructions on them: four independent chains of LOP3 and HFMA2, a code
   conversion's mix. Swept over the ALU work per byte and the warps per SM (set by the shared
   memory a block asks for), it prints the bandwidth beside a plain read of the same buffer in
   the same process: the curve a page layout's instruction count has to land under.

   nvcc -std=c++17 -O3 -gencode=arch=compute_90,code=sm_90 bench/issue_rate.cu -o build/issue_rate
   build/issue_rate [GiB]                                              (default 2 GiB) */
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));             \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

constexpr int kThreads = 128, kWarps = kThreads / 32;
constexpr int kUnroll = 4;                     /* 16-byte chunks a lane per stage */
constexpr int kStageBytes = 32 * 16 * kUnroll; /* a warp's stage: 2 KiB */
constexpr int kStages = 4;

__device__ __forceinline__ void copy16(uint32_t dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void wait_groups() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
__device__ __forceinline__ uint32_t lop3(uint32_t a, uint32_t b) {
    uint32_t d;
    asm volatile("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(0x64006400u));
    return d;
}
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm volatile("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x3C003C00u));
    return d;
}

/* OPS ALU instructions on the 16 bytes w in CHAINS independent chains (4: one per word; 1: each
   instruction waits for the last), alternating kinds. */
template <int OPS, int CHAINS> __device__ __forceinline__ void work(uint4 w, uint32_t *acc) {
    uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < OPS; i++) {
        const int c = CHAINS == 4 ? i & 3 : 0;
        acc[c] = (i >> 2) & 1 ? hfma2(acc[c], x[i & 3]) : lop3(x[i & 3], acc[c]);
    }
}

/* Every warp reads n_stages stages of its own slice of src through the ring. */
template <int OPS, int CHAINS>
__global__ void __launch_bounds__(kThreads)
    stream_kernel(const uint8_t *src, int64_t stages_per_warp, uint32_t *sink) {
    extern __shared__ __align__(16) uint8_t ring[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t gw = (int64_t)blockIdx.x * kWarps + warp;
    const uint8_t *base = src + gw * stages_per_warp * kStageBytes;
    uint8_t *mine = ring + warp * kStages * kStageBytes;
    const uint32_t smem = (uint32_t)__cvta_generic_to_shared(mine);
    auto issue = [&](int64_t s) {
        if (s < stages_per_warp)
#pragma unroll
            for (int u = 0; u < kUnroll; u++) {
                const int off = (u * 32 + lane) * 16;
                copy16(smem + (uint32_t)((s % kStages) * kStageBytes + off),
                       base + s * kStageBytes + off);
            }
        commit();
    };
    for (int s = 0; s < kStages - 1; s++) issue(s);
    uint32_t acc[4] = {(uint32_t)lane, 1u, 2u, 3u};
    for (int64_t s = 0; s < stages_per_warp; s++) {
        issue(s + kStages - 1);
        wait_groups<kStages - 1>();
        __syncwarp();
        const uint8_t *stage = mine + (s % kStages) * kStageBytes;
#pragma unroll
        for (int u = 0; u < kUnroll; u++) {
            const uint4 w = *(const uint4 *)(stage + (u * 32 + lane) * 16);
            if constexpr (OPS == 0)
                acc[u] ^= w.x ^ w.y ^ w.z ^ w.w;
            else
                work<OPS, CHAINS>(w, acc);
        }
        __syncwarp();
    }
    sink[gw * 32 + lane] = acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
}

/* The plain read: every thread 16 bytes at a time, grid-strided, summed into the sink. */
__global__ void read_kernel(const uint4 *src, int64_t n, uint32_t *sink) {
    uint32_t x = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const uint4 v = __ldg(src + i);
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    sink[(int64_t)blockIdx.x * blockDim.x + threadIdx.x] = x;
}

template <typename F> static float time_ms(F launch) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    launch();
    CHECK(cudaDeviceSynchronize());
    float best = 1e30f;
    for (int r = 0; r < 5; r++) {
        CHECK(cudaEventRecord(a));
        launch();
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        if (ms < best) best = ms;
    }
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    return best;
}

struct Device {
    int sms, smem_per_sm, smem_optin;
    double clock_ghz;
};

/* One row: OPS ALU instructions per 16-byte chunk at `blocks` blocks an SM. */
template <int OPS, int CHAINS>
static void row(const Device &d, const uint8_t *buf, size_t bytes, uint32_t *sink, int blocks,
                double read_gbs) {
    const int grid = d.sms * blocks;
    /* each block asks for an equal share of the SM's shared memory, so that `blocks` fit */
    const int ring = kWarps * kStages * kStageBytes;
    int smem = d.smem_per_sm / blocks - 1024; /* the driver's 1 KiB a block */
    if (smem > d.smem_optin) smem = d.smem_optin;
    if (smem < ring) {
        printf("%6d %5d %6d   (a ring of %d bytes does not fit %d blocks)\n", CHAINS, OPS,
               blocks * kWarps, ring, blocks);
        return;
    }
    CHECK(cudaFuncSetAttribute(stream_kernel<OPS, CHAINS>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int fit = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, stream_kernel<OPS, CHAINS>, kThreads,
                                                        smem));
    const int64_t per_warp = (int64_t)(bytes / kStageBytes) / ((int64_t)grid * kWarps);
    const double moved = (double)per_warp * kStageBytes * grid * kWarps;
    const float ms =
        time_ms([&] { stream_kernel<OPS, CHAINS><<<grid, kThreads, smem>>>(buf, per_warp, sink); });
    CHECK(cudaGetLastError());
    const double gbs = moved / (ms * 1e6);
    /* warp instructions a byte: OPS ALU + 1 LDS per 512 bytes a warp reads (cp.async, loop and
       waits come on top, ~1.5 a chunk) */
    printf("%6d %5d %6d %8d %9.3f %9.4f %9.0f %6.0f%%\n", CHAINS, OPS, blocks * kWarps,
           fit * kWarps, (OPS + 1) / 512.0, ms, gbs, 100.0 * gbs / read_gbs);
}

template <int CHAINS, int... OPS>
static void sweep(const Device &d, const uint8_t *buf, size_t bytes, uint32_t *sink, int blocks,
                  double read_gbs) {
    (row<OPS, CHAINS>(d, buf, bytes, sink, blocks, read_gbs), ...);
}

int main(int argc, char **argv) {
    const size_t bytes = (size_t)((argc > 1 ? atof(argv[1]) : 2.0) * (1u << 30)) / 4096 * 4096;
    Device d;
    cudaDeviceProp p;
    CHECK(cudaGetDeviceProperties(&p, 0));
    d.sms = p.multiProcessorCount;
    d.smem_per_sm = (int)p.sharedMemPerMultiprocessor;
    d.smem_optin = (int)p.sharedMemPerBlockOptin;
    int khz = 0;
    CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    d.clock_ghz = khz / 1e6;
    uint8_t *buf;
    uint32_t *sink;
    CHECK(cudaMalloc(&buf, bytes));
    CHECK(cudaMemset(buf, 0x5a, bytes));
    CHECK(cudaMalloc(&sink, (size_t)d.sms * 64 * kThreads * sizeof(uint32_t)));
    const int64_t n16 = (int64_t)(bytes / 16);
    const float read_ms =
        time_ms([&] { read_kernel<<<d.sms * 8, 256>>>((const uint4 *)buf, n16, sink); });
    const double read_gbs = bytes / (read_ms * 1e6);
    printf("device %s, %d SMs, %.2f GHz, shared memory %d KiB an SM; buffer %.2f GiB\n", p.name,
           d.sms, d.clock_ghz, d.smem_per_sm / 1024, bytes / 1073741824.0);
    printf("plain read: %.4f ms, %.0f GB/s\n", read_ms, read_gbs);
    printf("ring: %d stages of %d bytes a warp (cp.async, %d chunks of 16 bytes a lane a stage)\n",
           kStages, kStageBytes, kUnroll);
    printf("%6s %5s %6s %8s %9s %9s %9s %7s\n", "chains", "ops", "warps", "fit", "ins/byte", "ms",
           "GB/s", "%read");
    printf("(chains: independent ALU chains a lane; ops: ALU instructions a lane per 16 bytes; "
           "warps: asked an SM; fit: what the occupancy "
           "calculator grants; ins/byte: warp instructions a byte, ALU and the LDS)\n");
    for (int blocks : {2, 3, 4, 6})
        sweep<4, 0, 8, 16, 32, 48, 64, 96, 128>(d, buf, bytes, sink, blocks, read_gbs);
    for (int blocks : {2, 4, 6})
        sweep<1, 16, 32, 48, 64, 96>(d, buf, bytes, sink, blocks, read_gbs);
    CHECK(cudaFree(buf));
    CHECK(cudaFree(sink));
    return 0;
}
