/* Stand-in for PyTorch's header, for building the peer's kernels without PyTorch: the one type
   their params struct names (dropout is off in every decode timed here). */
#pragma once
#include <cstdint>
#include <string> /* the params struct names std::string; PyTorch's headers bring it in */
namespace at {
struct PhiloxCudaState {
    uint64_t seed = 0, offset = 0;
};
} // namespace at
