"""Decode attention benchmark: kvmix (compressed cache views) against PyTorch SDPA in BF16
(cuDNN and flash backends) and kvmix's own all-FP16 path, on the same shapes, in one process.

Usage: python3 bench/bench_decode.py [--lib build/libkvmix_cuda_bench.so[,other.so...]] [--quick]
    [--shapes B,T;B,T] [--mixes int4,...] [--head-dim 32|64|96|128|160|192|256] [--stages auto,small]
    [--peer build/libbitdecoding_glue.so]
    (several --lib paths or stage choices: each variant is timed on the same arenas, one after
    another, for A/B comparisons in one process)
Prints the configuration, then one line per (batch, context, variant): median time, bytes the
kernel must read (compressed K/V of the batch), achieved bandwidth, fraction of the measured
read bandwidth, speedup over cuDNN and flash, and the fraction of the speed of a plain read of
the same bytes in one launch (timed per mix in the same run: the ceiling of a single call).
Times: CUDA events around each call, median of many calls after warm-up, rotating among input
sets whose total exceeds several L2 sizes. --peer adds BitDecoding's decode at 4 and 2 bits (keys
per channel over 128 tokens, values per token over 128 channels: its one built form) on the same
shapes, beside the plain read of its bytes (bench/peer/build_bitdecoding.sh builds the library;
its own loop of back-to-back calls on one input set, CUDA events around it).
"""
import argparse
import ctypes as C
import math
import os
import statistics
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FP16, INT8, INT4, INT2, INT2_CHANNEL, BOOSTED = 1, 2, 3, 4, 5, 6
STAGES = {"auto": 0, "small": 1}  # kvmix_cuda_stages
NAMES = {FP16: "fp16", INT8: "int8", INT4: "int4", INT2: "int2", INT2_CHANNEL: "int2c", BOOSTED: "boost"}


class Layout(C.Structure):
    _fields_ = [("format", C.c_int), ("n_tokens", C.c_int32), ("head_dim", C.c_int32),
                ("group_size", C.c_int32), ("n_boost", C.c_int32)]


class View(C.Structure):
    _fields_ = [("n_seqs", C.c_int32), ("n_kv_heads", C.c_int32), ("head_dim", C.c_int32),
                ("group_size", C.c_int32), ("value_group_size", C.c_int32), ("n_boost", C.c_int32),
                ("n_spans", C.c_int32),
                ("n_dead_flags", C.c_int32), ("base", C.c_void_p), ("base_bytes", C.c_size_t),
                ("spans", C.c_void_p), ("seq_first_span", C.c_void_p), ("dead", C.c_void_p)]


class DecodeDesc(C.Structure):
    _fields_ = [("n_q_heads", C.c_int32), ("scale", C.c_float), ("dtype", C.c_int),
                ("n_splits", C.c_int32), ("stages", C.c_int32)]


SPAN_DTYPE = np.dtype([("key_offset", "<u8"), ("value_offset", "<u8"), ("key_head_bytes", "<u4"),
                       ("value_head_bytes", "<u4"), ("n_tokens", "<i4"), ("dead_index", "<i4"),
                       ("key_format", "u1"), ("value_format", "u1"), ("reserved", "u1", 6)])
JOB_DTYPE = np.dtype([("src_offset", "<u8"), ("dst_offset", "<u8"), ("first_row", "<i4"), ("n_rows", "<i4")])
assert SPAN_DTYPE.itemsize == 40 and JOB_DTYPE.itemsize == 24


def block_bytes(fmt, n, d, group=32, n_boost=0):
    bits = {FP16: 16, INT8: 8, INT4: 4, INT2: 2, INT2_CHANNEL: 2, BOOSTED: 2}[fmt]
    data = n * d * bits // 8
    if fmt == FP16:
        return data
    if fmt in (INT8, INT4, INT2):
        return data + n * (d // group) * 4
    if fmt == INT2_CHANNEL:
        return data + d * 4
    return data + n * n_boost // 4 + d * 4 + d


def align16(x):
    return (x + 15) // 16 * 16


MIXES = {
    # name: function(page index) -> (key format, value format)
    "int4": lambda i: (INT4, INT4),
    "int2/int4 75/25": lambda i: (INT4, INT4) if i % 4 == 3 else (INT2_CHANNEL, INT2),
    "kivi2 (int2 only)": lambda i: (INT2_CHANNEL, INT2),
    "boost k16 + int2": lambda i: (BOOSTED, INT2),
    "boost k32 + int2": lambda i: (BOOSTED, INT2),
    "kitty (k25% + int2/head)": lambda i: (BOOSTED, INT2),
    "int8": lambda i: (INT8, INT8),
    "fp16 (kvmix)": lambda i: (FP16, FP16),
}


# Mixes with a geometry of their own, by name prefix: head_dim -> (group of the INT8/INT4/INT2
# blocks, boosted key channels). Kitty's layout boosts a quarter of the key channels (32 of 128)
# and keeps INT2 values in one group per head; "boost k32" boosts a quarter with values in groups
# of 32 (a page of 128 tokens that just fits a 12.5 KiB stage, and the small stages split in two
# units). Every other mix: groups of 32, NB boosted channels.
GEOMETRY = {"kitty": lambda d: (d, d // 4), "boost k32": lambda d: (32, d // 4)}


def geometry(mix, d, n_boost):
    for prefix, of_dim in GEOMETRY.items():
        if mix.startswith(prefix):
            return of_dim(d)
    return 32, n_boost


def head_block_bytes(fmt, n, d, group, n_boost):
    """Bytes one head's block of fmt takes in an arena (aligned to 16); n_boost counts for
    BOOSTED blocks only."""
    return align16(block_bytes(fmt, n, d, group, n_boost if fmt == BOOSTED else 0))


def mix_bytes(mix, i, n, d, n_boost):
    """Bytes of page i's key and value blocks of one head."""
    group, nb = geometry(mix, d, n_boost)
    return sum(head_block_bytes(f, n, d, group, nb) for f in MIXES[mix](i))


class Lib:
    def __init__(self, path):
        self.lib = C.CDLL(path)
        L = self.lib
        L.kvmix_cuda_quantize.argtypes = [C.POINTER(Layout), C.c_void_p, C.c_int64, C.c_void_p, C.c_void_p,
                                          C.c_int32, C.c_void_p, C.c_void_p]
        L.kvmix_cuda_decode.argtypes = [C.POINTER(View), C.POINTER(DecodeDesc), C.c_void_p, C.c_void_p, C.c_void_p,
                                        C.c_void_p, C.c_size_t, C.c_void_p]
        L.kvmix_cuda_decode_workspace_bytes.argtypes = [C.c_int32, C.c_int32, C.c_int32, C.c_int32, C.POINTER(C.c_size_t)]
        L.kvmix_cuda_decode_choose_splits.argtypes = [C.c_int32, C.c_int32, C.c_int32, C.c_int32, C.c_int64,
                                                      C.c_int32, C.POINTER(C.c_int32)]
        L.kvmix_cuda_decode_blocks_per_sm.argtypes = [C.c_int32, C.c_int32, C.POINTER(C.c_int32)]
        L.kvmix_bench_read.argtypes = [C.c_void_p, C.c_size_t, C.c_void_p, C.c_int, C.c_void_p]

    def check(self, r, what):
        if r != 0:
            raise RuntimeError(f"{what} returned {r}")


class Arena:
    """n_seqs sequences of n_tokens tokens in pages of P tokens, formats from a mix, quantized on
    the GPU by kvmix_cuda_quantize from random fp16 rows."""

    def __init__(self, lib, mix, n_seqs, n_tokens, H, D, P, n_boost, src, stream):
        pages_per_seq = n_tokens // P
        group, n_boost = geometry(mix, D, n_boost)
        spans = np.zeros(n_seqs * pages_per_seq, SPAN_DTYPE)
        offset = 0
        jobs = {}  # (format) -> list of (src_off, dst_off)
        k = 0
        n_src_blocks = src.shape[0]
        rng = np.random.default_rng(1)
        for s in range(n_seqs):
            for i in range(pages_per_seq):
                kf, vf = MIXES[mix](i)
                sp = spans[k]
                for which, fmt in ((0, kf), (1, vf)):
                    hb = head_block_bytes(fmt, P, D, group, n_boost)
                    if which == 0:
                        sp["key_offset"], sp["key_head_bytes"] = offset, hb
                    else:
                        sp["value_offset"], sp["value_head_bytes"] = offset, hb
                    lst = jobs.setdefault(fmt, [])
                    base_src = int(rng.integers(0, n_src_blocks))
                    for h in range(H):
                        lst.append((((base_src + h) % n_src_blocks) * P * D, offset + h * hb))
                    offset += hb * H
                sp["n_tokens"], sp["dead_index"] = P, -1
                sp["key_format"], sp["value_format"] = kf, vf
                k += 1
        self.bytes = offset
        self.base = torch.empty(offset + 16, dtype=torch.uint8, device="cuda")
        for fmt, lst in jobs.items():
            arr = np.zeros(len(lst), JOB_DTYPE)
            arr["src_offset"] = [a for a, _ in lst]
            arr["dst_offset"] = [b for _, b in lst]
            arr["first_row"], arr["n_rows"] = 0, P
            dj = torch.from_numpy(arr.view(np.uint8)).cuda()
            lay = Layout(fmt, P, D, group if fmt in (INT8, INT4, INT2) else 0, n_boost if fmt == BOOSTED else 0)
            lib.check(lib.lib.kvmix_cuda_quantize(C.byref(lay), src.data_ptr(), D, self.base.data_ptr(),
                                                  dj.data_ptr(), len(lst), None, stream), "quantize")
        torch.cuda.synchronize()
        self.spans = torch.from_numpy(spans.view(np.uint8)).cuda()
        self.first = torch.arange(0, n_seqs * pages_per_seq + 1, pages_per_seq, dtype=torch.int32, device="cuda")
        self.dead = torch.zeros(16, dtype=torch.uint8, device="cuda")
        self.view = View(n_seqs, H, D, group, 0, n_boost, len(spans), 0, self.base.data_ptr(), offset + 16,
                         self.spans.data_ptr(), self.first.data_ptr(), self.dead.data_ptr())


def time_calls(fns, warmup=10, iters=60):
    """Median of per-call CUDA-event times (ms), rotating over fns."""
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/libkvmix_cuda_bench.so")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="BATCH,CTX,MIX: one kvmix case, no baselines (for profilers)")
    ap.add_argument("--shapes", default="", help="BATCH,CTX;BATCH,CTX...: only these shapes (with baselines)")
    ap.add_argument("--mixes", default="", help="comma-separated mix names (prefixes): only these mixes")
    ap.add_argument("--head-dim", type=int, default=128, choices=(32, 64, 96, 128, 160, 192, 256),
                    help="head_dim of the cache and queries (the issue's shapes use 128; 32, 96, 160 "
                         "and 192 run the CUDA-core walk)")
    ap.add_argument("--stages", default="auto",
                    help="auto, small or auto,small: the decode kernel's stage buffers, the device's "
                         "own or the small ones (what Ada and consumer Ampere run); each is a "
                         "variant of every --lib")
    ap.add_argument("--peer", default="",
                    help="BitDecoding's decode behind bench/peer/bitdecoding_glue.cu: timed on every shape")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with several --lib: time them in this many interleaved rounds, report the median")
    args = ap.parse_args()
    libs = [Lib(x) for x in args.lib.split(",")]
    lib = libs[0]
    variants = [(vlib, st) for vlib in libs for st in args.stages.split(",")]  # [index] in the report
    dev = torch.cuda.get_device_properties(0)
    n_sms = dev.multi_processor_count
    free, total = torch.cuda.mem_get_info()
    H, HQ, D, P, NB = 8, 32, args.head_dim, 128, 16
    print(f"device: {dev.name}, {n_sms} SMs, L2 {dev.L2_cache_size / 2**20:.0f} MiB, memory {total / 2**30:.1f} GiB, torch {torch.__version__}")
    print(f"shape: {HQ} q heads, {H} kv heads, head_dim {D}, page {P} tokens, group 32, boost k={NB} "
          f"(kitty: group {geometry('kitty', D, NB)[0]}, boost k={geometry('kitty', D, NB)[1]}); query length 1; "
          "bf16 SDPA with enable_gqa")
    stream = torch.cuda.current_stream().cuda_stream
    torch.manual_seed(0)

    # plain read bandwidth: 4 GiB read once per call
    buf = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
    buf.random_(0, 255)
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    t = time_calls([lambda: lib.check(lib.lib.kvmix_bench_read(buf.data_ptr(), buf.numel(), sink.data_ptr(), n_sms, stream), "read")], 3, 20)
    read_bw = buf.numel() / t / 1e6
    half = buf.numel() // 2
    t2 = time_calls([lambda: buf[half:].copy_(buf[:half])], 3, 20)
    copy_bw = 2 * half / t2 / 1e6
    del buf
    print(f"read bandwidth {read_bw:.0f} GB/s (4 GiB read kernel); device copy {copy_bw:.0f} GB/s counting read+write")

    occ = C.c_int32(0)
    lib.check(lib.lib.kvmix_cuda_decode_blocks_per_sm(D, HQ // H, C.byref(occ)), "occupancy")
    print(f"decode kernel (D={D}, 4 q heads/block, 128 threads): {occ.value} blocks/SM = {occ.value * 4} warps/SM")

    src = (torch.randn(512, P, D, device="cuda") * (1 + 3 * torch.rand(512, 1, D, device="cuda"))).half()
    batches = [1, 8, 32]
    contexts = [4096, 32768, 131072]
    if args.only:
        b, t, mix = args.only.split(",", 2)
        B, T = int(b), int(t)
        arena = Arena(lib, mix, B, T, H, D, P, NB, src, stream)
        splits = C.c_int32(0)
        lib.check(lib.lib.kvmix_cuda_decode_choose_splits(B, H, HQ, D, T, n_sms, C.byref(splits)), "splits")
        ws_bytes = C.c_size_t(0)
        lib.check(lib.lib.kvmix_cuda_decode_workspace_bytes(B, HQ, D, splits.value, C.byref(ws_bytes)), "ws")
        ws = torch.empty(ws_bytes.value, dtype=torch.uint8, device="cuda")
        qh = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(B, HQ, D, device="cuda", dtype=torch.bfloat16)
        desc = DecodeDesc(HQ, 0.0, 2, splits.value, STAGES[args.stages.split(",")[0]])
        fn = lambda: lib.check(lib.lib.kvmix_cuda_decode(C.byref(arena.view), C.byref(desc), qh.data_ptr(), out.data_ptr(),
                                                         None, ws.data_ptr(), ws_bytes.value, stream), "decode")
        ms = time_calls([fn], 3, 10)
        print(f"{B} {T} {mix}: {ms:.4f} ms, {arena.bytes / 1e6:.1f} MB, splits {splits.value}")
        return
    if args.quick:
        batches, contexts = [1, 8], [4096, 32768]
    shapes = [(B, T) for B in batches for T in contexts]
    if args.shapes:
        shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shapes.split(";")]
    results = []
    print(f"{'batch':>5} {'ctx':>7} {'variant':<18} {'ms':>8} {'MB read':>9} {'GB/s':>7} {'%read':>6} {'x cudnn':>8} {'x flash':>8}"
          f" {'%same':>7}")
    print("(%read: of the 4 GiB read's bandwidth; %same: of the plain read of the same bytes in one launch)")
    for B, T in shapes:
        kv_bf16 = 2 * B * H * T * D * 2
        if kv_bf16 * 1.3 > free:
            print(f"{B:>5} {T:>7} skipped: bf16 K/V of {kv_bf16 / 2**30:.1f} GiB does not fit with room to spare")
            continue
        sets = max(1, min(8, math.ceil(400e6 / kv_bf16)))
        qs = [torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        ks = [torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        vs = [torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
        base = {}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    fns = [lambda i=i: F.scaled_dot_product_attention(qs[i], ks[i], vs[i], enable_gqa=True) for i in range(sets)]
                    ms = time_calls(fns)
                base[name] = ms
                print(f"{B:>5} {T:>7} {'sdpa ' + name + ' bf16':<18} {ms:8.4f} {kv_bf16 / 1e6:9.1f} {kv_bf16 / ms / 1e6:7.0f} {100 * kv_bf16 / ms / 1e6 / read_bw:5.0f}%")
            except Exception as e:  # noqa: BLE001
                print(f"{B:>5} {T:>7} sdpa {name}: not available ({type(e).__name__}: {str(e)[:100]})")
        del qs, ks, vs
        torch.cuda.empty_cache()
        if args.peer:
            time_peer(args.peer, lib, B, T, H, HQ, D, n_sms, base, read_bw, stream)
        for mix in MIXES:
            if args.mixes and not any(mix.startswith(m) for m in args.mixes.split(",")):
                continue
            # bytes of one set, to size the rotation
            per_set = sum(H * mix_bytes(mix, i, P, D, NB) for i in range(T // P)) * B
            sets = max(1, min(8, math.ceil(400e6 / per_set)))
            if per_set * sets * 1.2 > torch.cuda.mem_get_info()[0]:
                print(f"{B:>5} {T:>7} {mix:<18} skipped: arena does not fit")
                continue
            read_ms = time_read(lib, per_set, sets, n_sms, stream)  # before the arenas: never both in memory
            print(f"{B:>5} {T:>7} {'read, same bytes':<18} {read_ms:8.4f} {per_set / 1e6:9.1f} "
                  f"{per_set / read_ms / 1e6:7.0f} {100 * per_set / read_ms / 1e6 / read_bw:5.0f}%")
            arenas = [Arena(lib, mix, B, T, H, D, P, NB, src, stream) for _ in range(sets)]
            times = [[] for _ in variants]
            for _ in range(args.rounds):  # interleaved, so that clock and thermal drift hit every variant
                for vi, (vlib, st) in enumerate(variants):
                    times[vi].append(time_decode(vlib, st, arenas, sets, B, T, n_sms, H, HQ, D, stream))
            for vi in range(len(variants)):
                report(vi if len(variants) > 1 else None, statistics.median(times[vi]), arenas, B, T, mix, base,
                       read_bw, read_ms, results, variants[vi][0].splits)
            del arenas
            torch.cuda.empty_cache()
    flush_bench(lib, src, H, D, P, NB, stream)


def time_decode(lib, stages, arenas, sets, B, T, n_sms, H, HQ, D, stream):
    """Median time (ms) of one decode call over the arena sets (stage buffers `stages`, a name of
    STAGES); lib.splits records the split count."""
    splits = C.c_int32(0)
    lib.check(lib.lib.kvmix_cuda_decode_choose_splits(B, H, HQ, D, T, n_sms, C.byref(splits)), "splits")
    ws_bytes = C.c_size_t(0)
    lib.check(lib.lib.kvmix_cuda_decode_workspace_bytes(B, HQ, D, splits.value, C.byref(ws_bytes)), "ws")
    ws = torch.empty(ws_bytes.value, dtype=torch.uint8, device="cuda")
    qh = [torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16) for _ in range(sets)]
    out = torch.empty(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(B, HQ, device="cuda", dtype=torch.float32)
    desc = DecodeDesc(HQ, 0.0, 2, splits.value, STAGES[stages])

    def call(i):
        lib.check(lib.lib.kvmix_cuda_decode(C.byref(arenas[i].view), C.byref(desc), qh[i].data_ptr(),
                                            out.data_ptr(), lse.data_ptr(), ws.data_ptr(), ws_bytes.value,
                                            stream), "decode")
    ms = time_calls([lambda i=i: call(i) for i in range(sets)])
    if not torch.isfinite(out.float()).all():
        print("  WARNING: non-finite output")
    lib.splits = splits.value
    del ws, qh, out, lse
    return ms


def time_peer(path, lib, B, T, H, HQ, D, n_sms, base, read_bw, stream):
    """BitDecoding at 4 and 2 bits on this shape (bitdecoding_glue.cu's bitdecoding_time), one
    line each as kvmix's, its %same against the plain read of its bytes, and how far its outputs
    are from exact attention over the rows it packed (quantization included), then over rows its
    codes represent exactly (bitdecoding_exact_nmse: float rounding alone should remain), split
    by output channel (0-15 and 16-31 of each 32, where its 2-bit values' tiles part)."""
    peer = C.CDLL(path)
    peer.bitdecoding_time.argtypes = [C.c_int] * 6 + [C.POINTER(C.c_double), C.POINTER(C.c_double),
                                                      C.POINTER(C.c_int), C.POINTER(C.c_int),
                                                      C.POINTER(C.c_double)]
    peer.bitdecoding_exact_nmse.argtypes = [C.c_int] * 5 + [C.POINTER(C.c_double)] * 3
    for bits in (4, 2):
        ms, nbytes, splits, finite, nmse = C.c_double(), C.c_double(), C.c_int(), C.c_int(), C.c_double()
        r = peer.bitdecoding_time(B, T, HQ, H, bits, 200, C.byref(ms), C.byref(nbytes), C.byref(splits),
                                  C.byref(finite), C.byref(nmse))
        name = f"bitdecoding int{bits}"
        if D != 128 or r != 0:
            print(f"{B:>5} {T:>7} {name:<18} not run ({'head_dim 128 only' if D != 128 else f'error {r}'})")
            continue
        read_ms = time_read(lib, int(nbytes.value), 1, n_sms, stream)
        bw = nbytes.value / ms.value / 1e6
        print(f"{B:>5} {T:>7} {name:<18} {ms.value:8.4f} {nbytes.value / 1e6:9.1f} {bw:7.0f} "
              f"{100 * bw / read_bw:5.0f}% {base.get('cudnn', float('nan')) / ms.value:8.2f} "
              f"{base.get('flash', float('nan')) / ms.value:8.2f} {100 * read_ms / ms.value:6.0f}%  "
              f"(splits {splits.value}, NMSE {nmse.value:.1e} against exact attention over the "
              f"unpacked rows{'' if finite.value else ', output NOT finite'})")
        exact, low, high = C.c_double(), C.c_double(), C.c_double()
        if peer.bitdecoding_exact_nmse(B, T, HQ, H, bits, C.byref(exact), C.byref(low),
                                       C.byref(high)) == 0:
            print(f"{'':>14}{name}: NMSE {exact.value:.1e} over rows of four values (exact in its "
                  f"codes; output channels 0-15 of each 32: {low.value:.1e}, 16-31: {high.value:.1e})")


def time_read(lib, nbytes, sets, n_sms, stream):
    """Median time (ms) of the plain read kernel over nbytes, one launch per call, rotating over as
    many buffers as the decode rotates arenas: what one launch can do with the same bytes."""
    stride = align16(nbytes)
    buf = torch.empty(stride * sets, dtype=torch.uint8, device="cuda")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    ms = time_calls([lambda i=i: lib.check(lib.lib.kvmix_bench_read(buf.data_ptr() + i * stride, nbytes,
                                                                     sink.data_ptr(), n_sms, stream), "read")
                     for i in range(sets)])
    del buf
    return ms


def report(label, ms, arenas, B, T, mix, base, read_bw, read_ms, results, splits):
    nbytes = arenas[0].bytes
    bw = nbytes / ms / 1e6
    xc = base.get("cudnn", float("nan")) / ms
    xf = base.get("flash", float("nan")) / ms
    name = mix if label is None else f"{mix} [{label}]"
    print(f"{B:>5} {T:>7} {name:<18} {ms:8.4f} {nbytes / 1e6:9.1f} {bw:7.0f} {100 * bw / read_bw:5.0f}% {xc:8.2f} {xf:8.2f}"
          f" {100 * read_ms / ms:6.0f}%  (splits {splits})")
    results.append((B, T, mix, ms, nbytes, bw, xc, xf))


def flush_bench(lib, src, H, D, P, NB, stream):
    # page flush: one full page per sequence (keys boosted k=16 or int2 per channel, values int2)
    if os.environ.get("BENCH_NO_FLUSH"):
        return
    print("page flush (one 128-token page per sequence, 8 kv heads, keys and values):")
    for B in (8, 32):
        for kf in (BOOSTED, INT2_CHANNEL, INT4):
            vf = INT2 if kf != INT4 else INT4
            n = B * H
            dst_k = head_block_bytes(kf, P, D, 32, NB)
            dst_v = head_block_bytes(vf, P, D, 32, 0)
            dst = torch.empty(n * (dst_k + dst_v) + 16, dtype=torch.uint8, device="cuda")
            jk = np.zeros(n, JOB_DTYPE)
            jv = np.zeros(n, JOB_DTYPE)
            jk["src_offset"] = (np.arange(n) % 512) * P * D
            jv["src_offset"] = ((np.arange(n) + 7) % 512) * P * D
            jk["dst_offset"] = np.arange(n) * dst_k
            jv["dst_offset"] = n * dst_k + np.arange(n) * dst_v
            jk["n_rows"] = jv["n_rows"] = P
            djk = torch.from_numpy(jk.view(np.uint8)).cuda()
            djv = torch.from_numpy(jv.view(np.uint8)).cuda()
            lk = Layout(kf, P, D, 32 if kf == INT4 else 0, NB if kf == BOOSTED else 0)
            lv = Layout(vf, P, D, 32, 0)

            def flush():
                lib.check(lib.lib.kvmix_cuda_quantize(C.byref(lk), src.data_ptr(), D, dst.data_ptr(), djk.data_ptr(), n, None, stream), "qk")
                lib.check(lib.lib.kvmix_cuda_quantize(C.byref(lv), src.data_ptr(), D, dst.data_ptr(), djv.data_ptr(), n, None, stream), "qv")
            ms = time_calls([flush], 5, 40)
            print(f"  batch {B:>3} keys {NAMES[kf]:<5} values {NAMES[vf]:<5}: flush {ms * 1000:8.1f} us, per decode step {ms * 1000 / P:6.2f} us")


if __name__ == "__main__":
    main()
