#!/bin/bash
# Builds BitDecoding's decode for bench_decode.py --peer, without PyTorch:
#   bench/peer/build_bitdecoding.sh BITDECODING_DIR CUTLASS_INCLUDE_DIR [OUT]
# BITDECODING_DIR: a checkout of github DD-DuDa/BitDecoding; CUTLASS_INCLUDE_DIR: the include/ of
# the CUTLASS commit its libs/cutlass submodule names. Its split-KV decode and its packer, at 4
# and 2 bits (keys per channel over 128 tokens, values per token over 128 channels, head_dim 128:
# the form its sources instantiate), compiled unchanged for sm_90 with its own flags against the
# stand-in PyTorch headers of bench/peer/shim, and bench/peer/bitdecoding_glue.cu around them,
# into OUT (default build/libbitdecoding_glue.so). ARCH=sm_80 etc. builds for another GPU.
set -eu
cd "$(dirname "$0")/../.."
BD=$1 CUT=$2 OUT=${3:-build/libbitdecoding_glue.so} ARCH=${ARCH:-sm_90}
SRC=$BD/csrc/bit_decode/src
FLAGS="-std=c++17 -O3 -gencode arch=compute_${ARCH#sm_},code=$ARCH -Ibench/peer/shim -I$CUT -I$SRC
  -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__ -U__CUDA_NO_HALF2_OPERATORS__
  -U__CUDA_NO_BFLOAT16_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda
  --use_fast_math -maxrregcount=255 -w -Xcompiler -fPIC"
mkdir -p build
objs=() pids=()
for f in flash_fwd_split_hdim128_fp16_sm80_4bit flash_fwd_split_hdim128_fp16_sm80_2bit \
    flash_qpack_hdim128_fp16_sm80_4bit flash_qpack_hdim128_fp16_sm80_2bit; do
    nvcc $FLAGS -c "$SRC/genfile/$f.cu" -o "build/peer_$f.o" &
    objs+=("build/peer_$f.o") pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done # set -e: a failed compile stops here
nvcc $FLAGS -shared bench/peer/bitdecoding_glue.cu "${objs[@]}" -o "$OUT"
echo "built $OUT"
