# Trains kvm-long: kvm-base (../../../shared/models/kvm-base.safetensors) continued at a 16384
# context with RoPE theta raised from 10000 to 500000, on the stream of longdata.py (long
# sessions of longtrace.py mixed with the original corpus kinds). The model, its layer code and
# its safetensors writer are those of ../../../shared/refmodel/train.py (HF Llama names, config
# JSON in __metadata__, all F16); what is new is the time-boxed, resumable run:
#
#   python3 train_long.py --init kvm-base.safetensors --work WORK --out OUT --call-seconds 480
#
# runs at most --call-seconds of wall time, then saves WORK/state.pt (fp32 weights, optimizer,
# progress) and WORK/kvm-long.safetensors, and splits the latter into OUT/*.partNN (at most
# 15 MiB each) with a manifest (longdata.py join). Run it again with the same WORK and it goes on
# where it stopped, exactly (the batches are a function of the step). On a fresh machine without
# WORK/state.pt, --resume M.safetensors goes on from a saved model (its progress is in its
# metadata) with a fresh optimizer, warmed up again. The run ends after --total-seconds of
# training; that call also scores the answers of eval-dev-long.jsonl's tune half by distance.
import argparse, array, collections, json, math, multiprocessing as mp, os, site, struct, sys, sysconfig, time
import torch, torch.nn as nn, torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus as C
import longdata as D

LONG = dict(name="kvm-long", hidden_size=512, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=128, intermediate_size=1408,
            max_position_embeddings=16384, rope_theta=500000.0,
            seq=16384, batch=8, lr=6e-4, warmup=100)
# A CPU-sized model of the same code, for trying the run logic in seconds.
TINY = dict(name="kvm-long-tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, intermediate_size=128,
            max_position_embeddings=1024, rope_theta=500000.0,
            seq=1024, batch=2, lr=1e-3, warmup=5)
SAVE_SECONDS = 45  # kept from --call-seconds for saving the state and the model


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__(); self.w = nn.Parameter(torch.ones(d)); self.eps = eps
    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype) * self.w


def rope(x, cos, sin):  # rotate_half convention (HF Llama)
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        D_, H, KV, hd, FF = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["intermediate_size"]
        self.H, self.KV, self.hd = H, KV, hd
        self.n1, self.n2 = RMSNorm(D_), RMSNorm(D_)
        self.q = nn.Linear(D_, H * hd, bias=False); self.k = nn.Linear(D_, KV * hd, bias=False)
        self.v = nn.Linear(D_, KV * hd, bias=False); self.o = nn.Linear(H * hd, D_, bias=False)
        self.g = nn.Linear(D_, FF, bias=False); self.u = nn.Linear(D_, FF, bias=False); self.d = nn.Linear(FF, D_, bias=False)
    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.n1(x)
        q = self.q(h).view(B, T, self.H, self.hd).transpose(1, 2)
        k = self.k(h).view(B, T, self.KV, self.hd).transpose(1, 2)
        v = self.v(h).view(B, T, self.KV, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin).to(v.dtype), rope(k, cos, sin).to(v.dtype)
        # kv heads repeated by hand: SDPA's enable_gqa may take the math path, which at 16K holds
        # a T x T matrix per head; the flash path wants equal head counts.
        k, v = (t.repeat_interleave(self.H // self.KV, dim=1) for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(B, T, -1))
        h = self.n2(x)
        return x + self.d(F.silu(self.g(h)) * self.u(h))


class LM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.emb = nn.Embedding(C.VOCAB, c["hidden_size"])
        self.blocks = nn.ModuleList([Block(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"])
        nn.init.normal_(self.emb.weight, std=0.02)
        for b in self.blocks:
            for m in (b.q, b.k, b.v, b.g, b.u):
                nn.init.normal_(m.weight, std=0.02)
            for m in (b.o, b.d):
                nn.init.normal_(m.weight, std=0.02 / math.sqrt(2 * c["num_hidden_layers"]))
        hd = c["head_dim"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        t = torch.arange(c["max_position_embeddings"]).float()
        fr = torch.outer(t, inv); emb = torch.cat((fr, fr), -1)
        self.register_buffer("cos", emb.cos()[None, None], persistent=False)
        self.register_buffer("sin", emb.sin()[None, None], persistent=False)
    def forward(self, idx):
        T = idx.shape[1]
        x = self.emb(idx)
        cos, sin = self.cos[:, :, :T].to(x.dtype), self.sin[:, :, :T].to(x.dtype)
        for b in self.blocks:
            x = b(x, cos, sin)
        return F.linear(self.norm(x), self.emb.weight)


def named_tensors(model):
    """The model's parameters under their safetensors (HF Llama) names."""
    out = {"model.embed_tokens.weight": model.emb.weight, "model.norm.weight": model.norm.w}
    for i, b in enumerate(model.blocks):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": b.n1.w, p + "post_attention_layernorm.weight": b.n2.w,
                    p + "self_attn.q_proj.weight": b.q.weight, p + "self_attn.k_proj.weight": b.k.weight,
                    p + "self_attn.v_proj.weight": b.v.weight, p + "self_attn.o_proj.weight": b.o.weight,
                    p + "mlp.gate_proj.weight": b.g.weight, p + "mlp.up_proj.weight": b.u.weight,
                    p + "mlp.down_proj.weight": b.d.weight})
    return out


def save_safetensors(model, path, extra):
    c = model.c
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "name": c["name"],
              **{k: c[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size",
                                   "max_position_embeddings", "rope_theta")},
              "rope_convention": "rotate_half", "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "tie_word_embeddings": True, "vocab_size": C.VOCAB, "torch_dtype": "float16",
              "tokenizer": {"type": "bytes+specials", "byte_ids": "0-255",
                            "special_tokens": C.SPECIAL_ID, "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"},
              **extra}
    tensors = named_tensors(model)
    header, blobs, off = {"__metadata__": {"config": json.dumps(config)}}, [], 0
    for k in sorted(tensors):
        b = tensors[k].detach().to(torch.float16).contiguous().cpu().numpy().tobytes()
        header[k] = {"dtype": "F16", "shape": list(tensors[k].shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b); off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(hj))); f.write(hj)
        for b in blobs:
            f.write(b)
    os.replace(path + ".tmp", path)


def load_safetensors(path):
    """(config dict, {name: fp32 tensor}) of an F16 reference-model file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    config = json.loads(header.pop("__metadata__")["config"])
    tensors = {}
    for k, h in header.items():
        lo, hi = h["data_offsets"]
        tensors[k] = torch.frombuffer(bytearray(data[lo:hi]), dtype=torch.float16).view(h["shape"]).float()
    return config, tensors


def load_weights(model, path):
    """The weights of path into model (same shapes; context and RoPE theta may differ)."""
    config, tensors = load_safetensors(path)
    own = named_tensors(model)
    if set(own) != set(tensors) or any(own[k].shape != tensors[k].shape for k in own):
        raise ValueError(f"{path}: its tensors do not fit {model.c['name']}")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(tensors[k])
    return config


# >>stream: batches made ahead in worker processes, in step order

_POOLS = None


def _batch(args):
    step, batch, seq = args
    rows = D.batch_rows(_POOLS, step, batch, seq)
    return array.array("h", [t for r in rows for t in r]).tobytes()


def batches(pools, first_step, batch, seq, procs, ahead=8):
    global _POOLS
    _POOLS = pools  # inherited by the forked workers
    with mp.get_context("fork").Pool(procs) as pool:
        pending, step = collections.deque(), first_step
        while True:
            while len(pending) < ahead:
                pending.append(pool.apply_async(_batch, ((step, batch, seq),))); step += 1
            raw = pending.popleft().get()
            yield torch.frombuffer(bytearray(raw), dtype=torch.int16).view(batch, seq + 1).long()


def pools_for(work, roots, code_bytes, trace_tokens, procs):
    """The corpus pools cached in WORK/pools (a warm machine's next call skips building them)."""
    cache = os.path.join(work, "pools")
    pools = D.load_pools(cache)
    if pools is None:
        t0 = time.time()
        pools = D.build_pools(roots, code_bytes, trace_tokens, procs=procs)
        D.save_pools(pools, cache)
        print(f"pools built in {time.time() - t0:.0f}s:", {k: len(v) for k, v in pools.items()}, flush=True)
    return pools


# >>run

def start(args, c, dev):
    """(model, optimizer, progress, step the optimizer started at) from WORK, --resume or --init."""
    model = LM(c).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=(0.9, 0.95), weight_decay=0.1,
                            fused=dev == "cuda")
    state = os.path.join(args.work, "state.pt")
    if os.path.exists(state):
        s = torch.load(state, map_location=dev)
        model.load_state_dict(s["model"]); opt.load_state_dict(s["optimizer"])
        return model, opt, s["progress"], s["optimizer_start"]
    if args.resume:
        progress = load_weights(model, args.resume)["train_progress"]
        return model, opt, progress, progress["step"]
    if args.init:
        load_weights(model, args.init)
    return model, opt, D.new_progress(args.total_seconds), 0


def train_call(args, c, dev, model, opt, progress, opt_start, pools, call_start):
    gen = batches(pools, progress["step"], c["batch"], c["seq"], args.procs)
    losses = []
    while not D.done(progress) and time.time() - call_start < args.call_seconds - SAVE_SECONDS:
        t0 = time.time()
        lr = D.learning_rate(progress, c["lr"], c["warmup"], opt_start)
        for g in opt.param_groups:
            g["lr"] = lr
        xb = next(gen).to(dev, non_blocking=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            logits = model(xb[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, C.VOCAB), xb[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        progress["step"] += 1; progress["seconds"] += time.time() - t0
        if progress["step"] % 20 == 0:
            print(f"step {progress['step']} trained {progress['seconds']:.0f}s of {progress['total_seconds']:.0f}s "
                  f"loss {sum(losses[-20:]) / len(losses[-20:]):.4f} lr {lr:.2e}", flush=True)
    return sum(losses[-20:]) / max(1, len(losses[-20:]))


@torch.no_grad()
def answer_accuracy(model, dev, seq, n_traces):
    """Top-1 accuracy on the answer tokens of eval-dev-long.jsonl's tune half, by distance."""
    model.eval()
    hit, total = collections.Counter(), collections.Counter()
    rows = [json.loads(x) for x in open(os.path.join(HERE, "eval-dev-long.jsonl"))]
    for r in [r for r in rows if r["split"] == "tune"][:n_traces]:
        ids = ([C.EOT] + C.encode(r["text"]))[:seq + 1]
        x = torch.tensor(ids, device=dev)[None]
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            top = model(x[:, :-1]).argmax(-1)[0].tolist()
        for q in r["questions"]:
            for i in range(q["token_start"] + 1, min(q["token_end"] + 1, len(ids))):  # id i, predicted at i - 1
                hit[q["distance"]] += top[i - 1] == ids[i]; total[q["distance"]] += 1
    model.train()
    return {str(d): hit[d] / total[d] for d in sorted(total)}


def save_call(args, c, model, opt, progress, opt_start, extra):
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "progress": progress,
                "optimizer_start": opt_start}, os.path.join(args.work, "state.pt.tmp"))
    os.replace(os.path.join(args.work, "state.pt.tmp"), os.path.join(args.work, "state.pt"))
    path = os.path.join(args.work, c["name"] + ".safetensors")
    save_safetensors(model, path, {"train_progress": progress, **extra})
    D.split_file(path, args.out)
    D.save_progress(progress, os.path.join(args.out, "progress.json"))


def main():
    ap = argparse.ArgumentParser(description="Trains kvm-long in time-boxed, resumable calls.")
    ap.add_argument("--work", required=True, help="state, pools and the model (kept between calls)")
    ap.add_argument("--out", required=True, help="where the model's parts go (what a call returns)")
    ap.add_argument("--init", help="the model to continue (kvm-base.safetensors)")
    ap.add_argument("--resume", help="a kvm-long.safetensors of an earlier call, when WORK has no state.pt")
    ap.add_argument("--call-seconds", type=float, default=480, help="wall time of this call")
    ap.add_argument("--total-seconds", type=float, default=1320, help="training time of the whole run")
    ap.add_argument("--tiny", action="store_true", help="the CPU-sized model, to try the run logic")
    ap.add_argument("--procs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--roots", nargs="*", default=None, help="Python source trees for the corpus pools")
    ap.add_argument("--code-bytes", type=int, default=200_000_000)
    ap.add_argument("--trace-tokens", type=int, default=20_000_000)
    ap.add_argument("--eval-traces", type=int, default=100)
    args = ap.parse_args()
    call_start = time.time()
    roots = args.roots or sorted({p for p in site.getsitepackages() + [sysconfig.get_paths()["stdlib"]] if os.path.isdir(p)})
    os.makedirs(args.work, exist_ok=True); os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    c, dev = (TINY if args.tiny else LONG), ("cuda" if torch.cuda.is_available() else "cpu")
    model, opt, progress, opt_start = start(args, c, dev)
    print(f"{c['name']} from step {progress['step']}, {progress['seconds']:.0f}s of {progress['total_seconds']:.0f}s", flush=True)
    pools = pools_for(args.work, roots, args.code_bytes, args.trace_tokens, args.procs)
    loss = train_call(args, c, dev, model, opt, progress, opt_start, pools, call_start)
    extra = {"train_loss": loss, "train_tokens": progress["step"] * c["batch"] * c["seq"]}
    if D.done(progress):
        extra["eval_answer_accuracy_by_distance"] = answer_accuracy(model, dev, c["seq"], args.eval_traces)
    save_call(args, c, model, opt, progress, opt_start, extra)
    print(json.dumps({"progress": progress, **extra}), flush=True)


if __name__ == "__main__":
    main()
