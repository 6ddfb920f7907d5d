# Checks of the kvm-long training stream and its bookkeeping, without torch or a GPU: a batch is
# a function of its step alone (a resumed run sees the batches of an unbroken one), the schedule
# continues across calls, pools and parts survive the trip through files.
import array, json, os, random, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus as C
import longdata as D

SEQ = 2048


def expect(ok, what):
    print(("ok  " if ok else "FAIL ") + what)
    return ok


def tiny_pools():
    code = array.array("B", ("def f(x):\n    return x\n\0" * 400).encode())
    traces = array.array("h", C.encode(C.trace(random.Random(0), [("a/b.py", [
        {"name": "f", "args": ["x"], "doc": "Returns x.", "body": "def f(x):\n    return x"}])]) * 20))
    return {"code": code, "trace": traces}


def check_batches(pools):
    a, b = D.batch_rows(pools, 7, 6, SEQ), D.batch_rows(pools, 7, 6, SEQ)
    ok = expect(a == b, "a step's batch is the same every time it is made")
    ok &= expect(a != D.batch_rows(pools, 8, 6, SEQ), "the next step's batch differs")
    ok &= expect(all(len(r) == SEQ + 1 and r[0] == C.EOT and max(r) < C.VOCAB for r in a),
                 "rows: seq + 1 ids in the vocabulary, <|endoftext|> first")
    kinds = {D.row_kind(f"{s}-{r}") for s in range(20) for r in range(6)}
    ok &= expect(kinds == {k for k, _ in D.MIX}, "the mix draws every kind")
    code_row = D.pool_row(pools["code"], "code-0", SEQ)
    ok &= expect(0 not in code_row and C.EOT in code_row[1:], "a file boundary in code is <|endoftext|>")
    return ok


def check_progress(tmp):
    """Three calls of 40 'seconds' equal one run of 120, and the rate falls to a tenth."""
    path, p = os.path.join(tmp, "progress.json"), D.new_progress(120.0)
    rates = []
    while not D.done(p):
        D.save_progress(p, path)
        p = D.load_progress(path)  # a new call
        for _ in range(4):
            rates.append(D.learning_rate(p, 1e-3, 2))
            p["step"] += 1; p["seconds"] += 10.0
    ok = expect(p["step"] == 12 and len(rates) == 12, "a run split into calls takes its steps")
    ok &= expect(rates[0] == 0.5e-3 and 0.95e-3 < rates[1] < 1e-3, "warmup, then near the peak")
    ok &= expect(all(x > y for x, y in zip(rates[1:], rates[2:])), "then falling, across calls too")
    ok &= expect(abs(D.learning_rate(p, 1e-3, 2) - 1e-4) < 1e-9, "the cosine ends at a tenth")
    ok &= expect(D.learning_rate(p, 1e-3, 4, since_start_step=12) == 0.25e-4, "a fresh optimizer warms up again")
    return ok


def check_files(tmp, pools):
    D.save_pools(pools, os.path.join(tmp, "pools"))
    back = D.load_pools(os.path.join(tmp, "pools"))
    ok = expect(back == pools, "pools survive save and load")
    ok &= expect(D.load_pools(os.path.join(tmp, "none")) is None, "no pools: None")
    src = os.path.join(tmp, "m.safetensors")
    with open(src, "wb") as f:
        f.write(os.urandom(10000))
    os.mkdir(os.path.join(tmp, "out"))
    m = D.split_file(src, os.path.join(tmp, "out"), part_bytes=4096)
    ok &= expect(len(m["parts"]) == 3, "a file splits into parts of at most part_bytes")
    manifest = os.path.join(tmp, "out", "m.safetensors.parts.json")
    D.join_parts(manifest, os.path.join(tmp, "joined"))
    ok &= expect(open(src, "rb").read() == open(os.path.join(tmp, "joined"), "rb").read(), "parts join back")
    with open(os.path.join(tmp, "out", m["parts"][1]), "r+b") as f:
        f.write(b"x")
    try:
        D.join_parts(manifest, os.path.join(tmp, "joined"))
        ok &= expect(False, "a damaged part is refused")
    except ValueError:
        ok &= expect(True, "a damaged part is refused")
    return ok


def main():
    pools = tiny_pools()
    with tempfile.TemporaryDirectory() as tmp:
        ok = check_batches(pools) & check_progress(tmp) & check_files(tmp, pools)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
