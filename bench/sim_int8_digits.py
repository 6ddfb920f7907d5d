"""Design study for an integer tensor-core decode path (bench/DECODE_NOTES.md, v8 item 1): how
many signed int8 digits the query and the probabilities need for the decode test's bound
(output NMSE 1e-6 against the float reference).

Simulates one kv head with 4 q heads, head_dim 128, 4096 tokens: keys int2 per channel over
pages of 128 tokens (codes exact), values int2 per token in groups of 32. query * scale per
(page, head) is split into n signed int8 digits under one power-of-two exponent; the
probabilities of each 16-token tile, times the value scale of each (token, group), the same per
(tile, head, group); minima in float. Prints the output NMSE against float64 attention over the
same dequantized cache for (query digits, probability digits), with keys of two magnitudes.
Usage: python3 bench/sim_int8_digits.py (numpy only)
"""
import numpy as np
rng = np.random.default_rng(0)
D, G, P, T, H = 128, 32, 128, 4096, 4

def digits(x, n, axis_max):
    # x: array; shared exponent over axis_max; returns reconstruction from n int8 digits
    m = np.max(np.abs(x), axis=axis_max, keepdims=True)
    e = np.ceil(np.log2(np.maximum(m, 1e-30) / 127.0))
    s = 2.0 ** e
    out = np.zeros_like(x); r = x.copy()
    for _ in range(n):
        d = np.clip(np.rint(r / s), -127, 127)
        out += d * s; r -= d * s; s = s / 256.0
    return out

def run(nd_q, nd_p, scale_keys=1.0):
    k = rng.standard_normal((T, D)) * (1 + 3 * rng.random(D)) * scale_keys
    v = rng.standard_normal((T, D))
    q = rng.standard_normal((H, D)) / np.sqrt(D) * 1.4427
    # int2 per channel keys per page
    kc = np.zeros_like(k); ksc = np.zeros((T // P, D)); kmn = np.zeros((T // P, D)); codes = np.zeros_like(k)
    for p in range(T // P):
        blk = k[p*P:(p+1)*P]; lo = blk.min(0); hi = blk.max(0); sc = (hi - lo) / 3
        c = np.clip(np.rint((blk - lo) / sc), 0, 3); codes[p*P:(p+1)*P] = c; ksc[p] = sc; kmn[p] = lo
        kc[p*P:(p+1)*P] = c * sc + lo
    vg = v.reshape(T, D // G, G); lo = vg.min(2, keepdims=True); sc = (vg.max(2, keepdims=True) - lo) / 3
    vcode = np.clip(np.rint((vg - lo) / sc), 0, 3); vdq = (vcode * sc + lo).reshape(T, D)
    # exact reference on the dequantized cache
    logit = q @ kc.T; pr = np.exp2(logit - logit.max(1, keepdims=True)); ref = (pr @ vdq) / pr.sum(1, keepdims=True)
    # simulated: per page B = digits(q * scale), minima const exact in fp32
    lg = np.zeros((H, T))
    for p in range(T // P):
        b = digits(q * ksc[p], nd_q, 1)
        lg[:, p*P:(p+1)*P] = b @ codes[p*P:(p+1)*P].T + (q @ kmn[p])[:, None]
    lg = lg.astype(np.float32).astype(np.float64)
    m = lg.max(1, keepdims=True); pp = np.exp2(lg - m)
    out = np.zeros((H, D)); tot = pp.sum(1)
    vcs = vcode.reshape(T, D); scs = sc[:, :, 0]; mns = lo[:, :, 0]
    for t0 in range(0, T, 16):
        for g in range(D // G):
            w = pp[:, t0:t0+16] * scs[t0:t0+16, g][None, :]
            wq = digits(w, nd_p, 1)
            out[:, g*G:(g+1)*G] += wq @ vcs[t0:t0+16, g*G:(g+1)*G] + (pp[:, t0:t0+16] @ mns[t0:t0+16, g])[:, None]
    out /= tot[:, None]
    return np.sum((out - ref) ** 2) / np.sum(ref ** 2)

print("query digits, probability digits: output NMSE (keys x1, keys x4)")
for nq, npd in ((2, 2), (2, 3), (3, 2), (3, 3), (1, 2)):
    print(nq, npd, ["%.2e" % run(nq, npd, s) for s in (1.0, 4.0)])
