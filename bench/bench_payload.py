"""Transfer payload benchmark: kvmix_cuda_payload_pack / _unpack on the GPU against a device copy
of the same FP16 rows, timed in one process.

Usage: python3 bench/bench_payload.py [--lib build/libkvmix_cuda_bench.so]
A payload here is one layer of one sequence: n_tokens x 8 kv heads x head_dim 128, keys and
values, FP16 rows in and out, tiers per token from a mix (sinks and the most recent tokens FP16,
then INT8, the cold rest INT4). Prints per case: median time of pack and of unpack, bytes moved
(FP16 rows read + payload written, or payload read + rows written), achieved bandwidth, payload
size against the FP16 rows, and the time of a device copy of the FP16 rows (read + write)
measured in the same run, as the baseline.
"""
import argparse
import ctypes as C
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import time_calls  # noqa: E402

FP16, INT8, INT4 = 1, 2, 3
ROWS = 1


class PayloadDesc(C.Structure):
    _fields_ = [("kind", C.c_int), ("head_dim", C.c_int32), ("n_kv_heads", C.c_int32),
                ("group_size", C.c_int32), ("first_layer", C.c_int32), ("n_layers", C.c_int32),
                ("n_tokens", C.c_int32), ("first_position", C.c_int64), ("id", C.c_uint64),
                ("base_id", C.c_uint64)]


class PayloadInfo(C.Structure):
    _fields_ = [("desc", PayloadDesc), ("n_fp16", C.c_int32), ("n_int8", C.c_int32),
                ("n_int4", C.c_int32), ("head_bytes", C.c_size_t), ("total_bytes", C.c_size_t)]


MIXES = {
    # name: fraction (FP16, INT8); the rest INT4. FP16 goes to the first 32 (sinks) and the most
    # recent tokens, INT8 to the next most recent.
    "all fp16": (1.0, 0.0),
    "10/30/60 fp16/int8/int4": (0.1, 0.3),
    "all int4": (0.0, 0.0),
}


def tiers_of(n, mix):
    f16, f8 = MIXES[mix]
    n16, n8 = int(n * f16), int(n * f8)
    sinks = min(32, n16)
    recent = n - (n16 - sinks)  # first of the most recent FP16 tokens
    t = np.full(n, INT4, np.uint8)
    t[:sinks] = FP16
    t[recent:] = FP16
    t[recent - n8:recent] = INT8
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libkvmix_cuda_bench.so")
    args = ap.parse_args()
    L = C.CDLL(args.lib)
    L.kvmix_payload_describe.argtypes = [C.POINTER(PayloadDesc), C.c_void_p, C.POINTER(PayloadInfo),
                                         C.c_void_p]  # kvmix_error *: None
    L.kvmix_payload_write_head.argtypes = [C.POINTER(PayloadInfo), C.c_void_p, C.c_void_p, C.c_size_t, C.c_void_p]
    L.kvmix_cuda_payload_workspace_bytes.argtypes = [C.c_int32, C.POINTER(C.c_size_t)]
    L.kvmix_cuda_payload_pack.argtypes = [C.POINTER(PayloadInfo), C.c_void_p, C.c_void_p, C.c_int, C.c_void_p,
                                          C.c_void_p, C.c_size_t, C.c_void_p, C.c_void_p]
    L.kvmix_cuda_payload_unpack.argtypes = [C.POINTER(PayloadInfo), C.c_void_p, C.c_int, C.c_void_p, C.c_void_p,
                                            C.c_void_p, C.c_size_t, C.c_void_p, C.c_void_p]

    def check(r, what):
        if r != 0:
            raise RuntimeError(f"{what} returned {r}")

    dev = torch.cuda.get_device_properties(0)
    H, D = 8, 128
    print(f"device: {dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}")
    print(f"payload: one layer, {H} kv heads, head_dim {D}, group 32, keys + values, FP16 rows in/out")
    stream = torch.cuda.current_stream().cuda_stream
    torch.manual_seed(0)
    print(f"{'tokens':>7} {'mix':<24} {'op':<7} {'ms':>8} {'MB moved':>9} {'GB/s':>7} {'payload/fp16':>12} {'copy ms':>8} {'x copy':>7}")
    for n in (4096, 32768):
        sets = 4
        keys = [torch.randn(1, n, H, D, device="cuda").half() for _ in range(sets)]
        values = [torch.randn(1, n, H, D, device="cuda").half() for _ in range(sets)]
        outk, outv = torch.empty_like(keys[0]), torch.empty_like(values[0])
        row_bytes = 2 * keys[0].numel() * 2
        copy_ms = time_calls([lambda i=i: (outk.copy_(keys[i]), outv.copy_(values[i])) for i in range(sets)])
        for mix in MIXES:
            tiers = tiers_of(n, mix)
            desc = PayloadDesc(ROWS, D, H, 0, 0, 1, n, 0, 1, 0)
            info = PayloadInfo()
            check(L.kvmix_payload_describe(C.byref(desc), tiers.ctypes.data, C.byref(info), None), "describe")
            head = np.zeros(info.head_bytes, np.uint8)
            check(L.kvmix_payload_write_head(C.byref(info), tiers.ctypes.data, head.ctypes.data, head.size, None), "head")
            payloads = []
            for _ in range(sets):
                p = torch.empty(info.total_bytes, dtype=torch.uint8, device="cuda")
                p[:info.head_bytes].copy_(torch.from_numpy(head))
                payloads.append(p)
            wsb = C.c_size_t(0)
            check(L.kvmix_cuda_payload_workspace_bytes(n, C.byref(wsb)), "workspace")
            ws = torch.empty(max(wsb.value, 1), dtype=torch.uint8, device="cuda")
            flags = torch.zeros(1, dtype=torch.int32, device="cuda")

            def pack(i):
                check(L.kvmix_cuda_payload_pack(C.byref(info), keys[i].data_ptr(), values[i].data_ptr(), FP16,
                                                payloads[i].data_ptr(), ws.data_ptr(), wsb.value, flags.data_ptr(),
                                                stream), "pack")

            def unpack(i):
                check(L.kvmix_cuda_payload_unpack(C.byref(info), payloads[i].data_ptr(), FP16, outk.data_ptr(),
                                                  outv.data_ptr(), ws.data_ptr(), wsb.value, flags.data_ptr(),
                                                  stream), "unpack")

            pack_ms = time_calls([lambda i=i: pack(i) for i in range(sets)])
            unpack_ms = time_calls([lambda i=i: unpack(i) for i in range(sets)])
            torch.cuda.synchronize()
            if int(flags.item()) != 0:
                raise RuntimeError(f"error flags {int(flags.item())}")
            moved = row_bytes + info.total_bytes
            ratio = info.total_bytes / row_bytes
            for op, ms in (("pack", pack_ms), ("unpack", unpack_ms)):
                print(f"{n:>7} {mix:<24} {op:<7} {ms:8.4f} {moved / 1e6:9.1f} {moved / ms / 1e6:7.0f} {ratio:12.3f} {copy_ms:8.4f} {copy_ms / ms:7.2f}")


if __name__ == "__main__":
    main()
