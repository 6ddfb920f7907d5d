/* Benchmark-only helper linked into libkvmix_cuda_bench.so: a plain device read kernel that
   measures the GPU's read bandwidth in the same process as the decode benchmark, and kvmix.h's
   host functions (payload heads for bench_payload.py). */
#define KVMIX_IMPLEMENTATION
#include "../kvmix.h"

#include <cuda_runtime.h>
#include <stdint.h>

static __global__ void kvmix_bench_read_kernel(const uint4 *p, size_t n, unsigned *sink) {
    uint32_t acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) atomicAdd(sink, 1u); /* keeps the loads; practically never taken */
}

/* Reads `bytes` (a multiple of 16) from p once. Returns 0 or a cudaError_t. */
extern "C" int kvmix_bench_read(const void *p, size_t bytes, unsigned *sink, int n_sms, void *stream) {
    kvmix_bench_read_kernel<<<n_sms * 8, 512, 0, (cudaStream_t)stream>>>((const uint4 *)p, bytes / 16, sink);
    return (int)cudaGetLastError();
}
