# The kvm-long training stream, without torch: every batch is a pure function of (step, row), so a
# run resumed at step N sees exactly the batches a run that never stopped would have seen.
# Rows mix long sessions (longtrace.py with the TRAIN_SEED seeds, never the eval seeds) with the
# original corpus kinds (raw Python source and short traces, corpus.py) so the model keeps them.
#
# Also the bookkeeping of a training run split over several calls: progress (steps and seconds
# so far), the learning-rate schedule over the whole run, and the split of a file into parts
# small enough to come back from a call.
import array, hashlib, json, math, os, random, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus as C
import longtrace as L

MIX = (("long", 0.6), ("code", 0.2), ("trace", 0.2))  # row kinds and their shares


def long_row(key, seq):
    """seq + 1 ids: <|endoftext|>, then whole long sessions (the last one cut) from seed key."""
    rng = random.Random(L.TRAIN_SEED.format(key))
    ids = [C.EOT]
    while len(ids) < seq + 1:
        ids += C.encode(L.session(rng)["text"]) + [C.EOT]
    return ids[:seq + 1]


def pool_row(pool, key, seq):
    """seq + 1 ids: <|endoftext|>, then a window of a pool at a start drawn from key (a 0 byte,
    between two source files, is <|endoftext|>)."""
    start = random.Random(key).randrange(len(pool) - seq)
    return [C.EOT] + [C.EOT if t == 0 else t for t in pool[start:start + seq]]


def row_kind(key):
    x, acc = random.Random(f"mix-{key}").random(), 0.0
    for kind, share in MIX:
        acc += share
        if x < acc:
            return kind
    return MIX[-1][0]


def batch_rows(pools, step, batch, seq):
    """The batch of one step: batch lists of seq + 1 ids (pools: {"code": ids, "trace": ids})."""
    rows = []
    for r in range(batch):
        key = f"{step}-{r}"
        kind = row_kind(key)
        rows.append(long_row(key, seq) if kind == "long" else pool_row(pools[kind], f"{kind}-{key}", seq))
    return rows


POOL_FILES = {"code": ("code.u8", "B"), "trace": ("trace.i16", "h")}


def build_pools(roots, code_bytes, trace_tokens, seed=0, procs=1):
    """The original corpus kinds: training source files (bytes, 0 between files) and short
    traces over them (ids)."""
    _, parts, funcs = C.build(roots, code_bytes, seed=seed, procs=procs)
    code = array.array("B", "\0".join(parts["train"]).encode())
    rng, traces = random.Random(seed + 1000), array.array("h")
    while len(traces) < trace_tokens:
        traces.extend(C.encode(C.trace(rng, funcs["train"])) + [C.EOT])
    return {"code": code, "trace": traces}


def save_pools(pools, directory):
    os.makedirs(directory, exist_ok=True)
    for k, (name, _) in POOL_FILES.items():
        with open(os.path.join(directory, name), "wb") as f:
            pools[k].tofile(f)


def load_pools(directory):
    """The pools save_pools wrote, or None when any is missing."""
    pools = {}
    for k, (name, typecode) in POOL_FILES.items():
        p = os.path.join(directory, name)
        if not os.path.exists(p):
            return None
        a = array.array(typecode)
        with open(p, "rb") as f:
            a.frombytes(f.read())
        pools[k] = a
    return pools


# >>progress: a run of total_seconds of training, done in calls of a few minutes each

def new_progress(total_seconds):
    return {"step": 0, "seconds": 0.0, "total_seconds": total_seconds}


def learning_rate(progress, peak, warmup_steps, since_start_step=0):
    """Linear warmup (again after a resume without optimizer state: since_start_step), then a
    cosine from peak to peak / 10 over the whole run's training seconds."""
    frac = min(1.0, progress["seconds"] / progress["total_seconds"])
    warm = min(1.0, (progress["step"] - since_start_step + 1) / warmup_steps)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def done(progress):
    return progress["seconds"] >= progress["total_seconds"]


def save_progress(progress, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(progress, f)
    os.replace(tmp, path)  # a call cut short never leaves half a file


def load_progress(path):
    with open(path) as f:
        return json.load(f)


# >>parts: a call returns files of at most 16 MiB; the model is ~45 MiB

PART_BYTES = 15 << 20


def split_file(path, out_dir, part_bytes=PART_BYTES):
    """path -> out_dir/NAME.partNN files and out_dir/NAME.parts.json (their order and sha256)."""
    name, parts = os.path.basename(path), []
    data = open(path, "rb").read()
    for i in range(0, max(1, len(data)), part_bytes):
        part = f"{name}.part{len(parts):02d}"
        with open(os.path.join(out_dir, part), "wb") as f:
            f.write(data[i:i + part_bytes])
        parts.append(part)
    manifest = {"file": name, "parts": parts, "sha256": hashlib.sha256(data).hexdigest()}
    with open(os.path.join(out_dir, name + ".parts.json"), "w") as f:
        json.dump(manifest, f)
    return manifest


def join_parts(manifest_path, out_path):
    """Joins the parts a manifest lists into out_path; raises ValueError on a wrong sha256."""
    m = json.load(open(manifest_path))
    d = os.path.dirname(os.path.abspath(manifest_path))
    data = b"".join(open(os.path.join(d, p), "rb").read() for p in m["parts"])
    if hashlib.sha256(data).hexdigest() != m["sha256"]:
        raise ValueError(f"{manifest_path}: the joined parts do not match their sha256")
    with open(out_path, "wb") as f:
        f.write(data)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "join":
        sys.exit("usage: longdata.py join NAME.parts.json OUT")
    join_parts(sys.argv[2], sys.argv[3])
