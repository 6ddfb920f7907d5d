/* Stand-in for PyTorch's header: the two checks the peer's launchers use. */
#pragma once
#include <cstdio>
#include <cuda_runtime.h>
#define C10_CUDA_CHECK(expr)                                                                       \
    do {                                                                                           \
        cudaError_t e_ = (expr);                                                                   \
        if (e_ != cudaSuccess) fprintf(stderr, "peer: %s: %s\n", #expr, cudaGetErrorString(e_));   \
    } while (0)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() C10_CUDA_CHECK(cudaGetLastError())
