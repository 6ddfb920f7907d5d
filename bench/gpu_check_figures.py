"""Reruns a reduced set of the GPU-produced headline figures of bench/QUALITY.md and bench/RESULTS.md
and prints each beside the figure the doc records (bench/gpu_check_figures.json lists the checks).

Usage: python3 bench/gpu_check_figures.py --build build --shared DIR --gpu-name NAME --out DIR
           [--budget-seconds 300] [--jobs 3] [--list FILE] [--only REGEX] [--rest JSONL]
           [--runner PATH] [--device-args "ARGS"] [--limit-override N]

A check is one command (kvmix-eval-cuda, bench_decode.py or bench_serve) and the doc figures read
from its output. A check with "from_jsonl" reruns the arm of a raw results line (bench/evict,
bench/transfer, bench/triaxial): the line's "policy" object, written to a temporary file, is the
--policy, so the run uses what the recorded run used. Checks whose commands are the same run once.
Quality figures must match within 0.2% relative, speed figures within 10%; a difference within
half a unit of the last digit the doc prints also passes (the doc rounds). A speed figure recorded
on another GPU than --gpu-name is printed and marked "other GPU". A figure the doc says an older
build measured (a check's or field's "older_build": the commit and why the build since gives
another value) is marked "older build (...)" when it differs, not DIFFERS. A check with
"evict_as_run" sets those fields of the raw line's evict object to what the recorded run did (a
field the runner applies now but ignored then). Verdicts: ok, DIFFERS, older build, other GPU,
failed to run, skipped (budget), skipped (no model: its model file is not under --shared). Exit status 1 when a quality figure DIFFERS or fails to run.

Quality checks run --jobs at a time on the one GPU (the figures do not depend on it); speed checks
run alone, in the list's order. A check starts only while its estimate fits what is left of
--budget-seconds, judged when it starts; from the first that does not, the rest are "skipped
(budget)", and a run still going when the budget ends is cut ("skipped (budget: cut at N s)"). Measurements go
to OUT/gpu_check_figures.jsonl, each run's stdout and stderr to OUT/runs/.

Plumbing test on a machine without a GPU (the CPU runner, 2 texts):
    python3 bench/gpu_check_figures.py --build build --shared ../shared --gpu-name cpu --out /tmp/gcf \\
        --runner build/kvmix-eval --device-args "--device cpu" --limit-override 2 --only 'gpu-runner/small fp16'
"""
import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import threading
import time

QUALITY_TOL = 0.002
SPEED_TOL = 0.10


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--shared", required=True)
    ap.add_argument("--gpu-name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-seconds", type=float, default=300)
    ap.add_argument("--jobs", type=int, default=3, help="quality runs at once on the GPU")
    ap.add_argument("--list", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check_figures.json"))
    ap.add_argument("--only", default="", help="regular expression: only the checks whose name matches")
    ap.add_argument("--rest", default="", help="an earlier run's gpu_check_figures.jsonl: only the checks "
                    "its budget skipped or cut (the figures of one check list take more than one call)")
    ap.add_argument("--runner", default="", help="instead of BUILD/kvmix-eval-cuda (e.g. build/kvmix-eval)")
    ap.add_argument("--device-args", default="", help="extra runner arguments (e.g. '--device cpu')")
    ap.add_argument("--limit-override", type=int, default=0,
                    help="plumbing tests: run N texts (--limit N, --batch N) instead of the recorded ones")
    return ap.parse_args()


def gpu_model(name):
    m = re.search(r"\b(H100|H200|H800|A100|A10G?|L40S?|L4|B200|GB200|B100|RTX ?\w+|cpu)\b", name, re.I)
    return (m.group(1) if m else name).upper().replace(" ", "")


def dotted(obj, path):
    for p in path.split("."):
        if not isinstance(obj, dict) or p not in obj:
            return None
        obj = obj[p]
    return obj


def decimals(text):
    text = text.replace(",", "")
    return len(text.split(".")[1]) if "." in text else 0


def judge(recorded, measured, tol):
    """(relative difference, within tolerance?) of a measured value against the doc's text."""
    r = float(recorded.replace(",", ""))
    diff = measured - r
    rel = diff / abs(r) if r != 0 else (0.0 if diff == 0 else float("inf"))
    ok = abs(diff) <= max(tol * abs(r), 0.5 * 10 ** -decimals(recorded)) + 1e-12
    return rel, ok


def raw_line(path, arm):
    with open(path) as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                if d.get("arm") == arm:
                    return d
    raise KeyError(f"no arm {arm!r} in {path}")


def derive_data(spec, subst):
    """Writes the traces numbered spec['numbers'] (1-based, of spec['kind'], in file order)."""
    path = subst(spec["path"])
    wanted = set(spec["numbers"])
    n, kept = 0, []
    with open(subst(spec["from"])) as f:
        for line in f:
            if line.strip() and json.loads(line).get("kind") == spec["kind"]:
                n += 1
                if n in wanted:
                    kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) != len(wanted):
        raise ValueError(f"{path}: found {len(kept)} of {len(wanted)} traces")
    with open(path, "w") as f:
        f.writelines(kept)


def command(check, a, index):
    """The check's argv (and its env), with placeholders filled; writes its policy file."""
    runner = a.runner or os.path.join(a.build, "kvmix-eval-cuda")
    policy_text = None
    if check.get("policy") == "from_jsonl":
        policy = raw_line(check["from_jsonl"], check["arm"])["policy"]
        for k, v in check.get("evict_as_run", {}).items():
            policy["evict"][k] = v
        policy_text = json.dumps(policy, sort_keys=True)

    def subst(s):
        return (s.replace("{runner}", runner).replace("{build}", a.build).replace("{shared}", a.shared)
                .replace("{out}", a.out))
    if check.get("derive_data"):
        derive_data(check["derive_data"], subst)
    argv = []
    for tok in check["args"]:
        if tok == "{device_args}":
            argv += a.device_args.split()
        elif tok == "{policy}":
            path = os.path.join(a.out, "policies", f"{index:02d}.json")
            with open(path, "w") as f:
                f.write(policy_text)
            argv.append(path)
        else:
            argv.append(subst(tok))
    if a.limit_override and argv and argv[0] == runner:
        for flag in ("--limit", "--batch"):
            if flag in argv:
                argv[argv.index(flag) + 1] = str(a.limit_override)
            else:
                argv += [flag, str(a.limit_override)]
    env = dict(os.environ, **check.get("env", {}))
    key = json.dumps([argv[:], policy_text, check.get("env")])
    if policy_text is not None:  # the run's identity: the policy's content, not its file name
        key = json.dumps([[x if not x.startswith(os.path.join(a.out, "policies")) else "{policy}" for x in argv],
                          policy_text, check.get("env")])
    return argv, env, key


def parse_decode(stdout):
    """bench_decode.py rows: {(batch, ctx, variant): {'ms': .., 'x_cudnn': ..}}."""
    rows = {}
    pat = re.compile(r"^\s*(\d+)\s+(\d+)\s+(.+?)\s+(\d+\.\d{4})\s+(\d+\.\d)\s+(\d+)\s+(\d+)%(?:\s+(\S+)\s+(\S+))?")
    for line in stdout.splitlines():
        m = pat.match(line)
        if m:
            row = {"ms": float(m.group(4))}
            if m.group(8) and m.group(8) != "nan":
                row["x_cudnn"] = float(m.group(8))
            rows[(int(m.group(1)), int(m.group(2)), m.group(3).strip())] = row
    return rows


def parse_serve(stdout):
    """bench_serve rows at each policy's largest batch, with the summary ratios."""
    rows = {}
    pat = re.compile(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\+?\s+(\d+)\s+([\d.]+)\s+(\d+)\s")
    for line in stdout.splitlines():
        m = pat.match(line)
        if m and int(m.group(6)) == int(m.group(5)):
            rows[m.group(1)] = {"mib_per_seq": float(m.group(4)), "fit": int(m.group(5)),
                                "ms_per_step": float(m.group(7)), "tokens_per_second": float(m.group(8))}
        m = re.match(r"^\s+(\S+) at \d+, largest batch .*: ([\d.]+)x the sequences, ([\d.]+)x the decode", line)
        if m:
            rows.setdefault(m.group(1), {}).update(x_sequences=float(m.group(2)), x_tokens_per_second=float(m.group(3)))
    return rows


def measure(check, stdout):
    """Each field's measured value (None when the output lacks it)."""
    parse = check.get("parse")
    if parse == "bench_decode":
        rows = parse_decode(stdout)
        return [dotted(rows.get((f["match"]["batch"], f["match"]["ctx"], f["match"]["variant"]), {}), f["value"])
                for f in check["fields"]]
    if parse == "bench_serve":
        rows = parse_serve(stdout)
        return [rows.get(f["match"]["policy"], {}).get(f["value"]) for f in check["fields"]]
    result = json.loads(stdout)
    out = []
    for f in check["fields"]:
        v = dotted(result, f["path"])
        out.append(None if v is None else v * f.get("scale", 1))
    return out


def run_one(argv, env, timeout, log_base):
    t0 = time.time()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
        rc, so, se = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, so, se = "timeout", e.stdout or "", (e.stderr or "") + f"\ntimed out after {timeout:.0f} s"
        so, se = (so.decode() if isinstance(so, bytes) else so), (se.decode() if isinstance(se, bytes) else se)
    except OSError as e:
        rc, so, se = "error", "", str(e)
    with open(log_base + ".out", "w") as f:
        f.write(so)
    with open(log_base + ".err", "w") as f:
        f.write(" ".join(argv) + "\n" + se)
    return {"rc": rc, "stdout": so, "stderr": se, "seconds": time.time() - t0}


class Budget:
    """The figure stage's clock. A check is judged against it when it really starts (a worker
    takes it), not when it is queued: queueing is instant, so a budget read at submission lets
    every check in. From the first check whose estimate does not fit, the rest are skipped, and a
    run still going at the deadline is cut (its verdict says so), so the stage ends on time."""

    def __init__(self, seconds):
        self.start = time.time()
        self.deadline = self.start + seconds
        self.closed = False
        self.lock = threading.Lock()

    def run(self, name, est, argv, env, log_base):
        with self.lock:
            left = self.deadline - time.time()
            if self.closed or est > left:
                self.closed = True
                return {"skipped": "skipped (budget)"}
        print(f"[{time.time() - self.start:6.1f} s] started {name}", file=sys.stderr, flush=True)
        timeout = min(max(60.0, 4.0 * est), left)
        res = run_one(argv, env, timeout, log_base)
        if res["rc"] == "timeout" and timeout == left:
            res["skipped"] = f"skipped (budget: cut at {timeout:.0f} s)"
        return res


def main():
    a = parse_args()
    for k in ("build", "shared", "out", "list"):
        setattr(a, k, os.path.abspath(getattr(a, k)))
    if a.runner and os.sep in a.runner:
        a.runner = os.path.abspath(a.runner)
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # paths are from the repo root
    for d in ("", "policies", "runs"):
        os.makedirs(os.path.join(a.out, d), exist_ok=True)
    with open(a.list) as f:
        checks = json.load(f)["checks"]
    if a.only:
        checks = [c for c in checks if re.search(a.only, c["name"])]
    if a.rest:
        with open(a.rest) as f:
            left = {d["check"] for d in map(json.loads, f) if d["verdict"].startswith("skipped (budget")}
        checks = [c for c in checks if c["name"] in left]
    here = gpu_model(a.gpu_name)
    budget = Budget(a.budget_seconds)
    runs = {}  # key -> future or result
    pool = concurrent.futures.ThreadPoolExecutor(max(1, a.jobs))
    plan = []
    for i, c in enumerate(checks):
        try:
            argv, env, key = command(c, a, i)
        except (OSError, KeyError, ValueError) as e:
            plan.append((c, None, f"failed to run ({e})"))
            continue
        if key in runs:
            plan.append((c, key, None))
            continue
        missing = [x for x in argv if x.endswith(".safetensors") and not os.path.exists(x)]
        if missing:  # a model this machine was not given (kvm-base is 47 MB): said, not failed
            plan.append((c, None, f"skipped (no model: {os.path.basename(missing[0])})"))
            continue
        job = (c["name"], c.get("est_seconds", 30), argv, env, os.path.join(a.out, "runs", f"{i:02d}"))
        if c.get("kind") == "speed":  # alone on the GPU: wait for the quality runs, then run
            for fut in list(runs.values()):
                if isinstance(fut, concurrent.futures.Future):
                    fut.result()
            runs[key] = budget.run(*job)
        else:
            runs[key] = pool.submit(budget.run, *job)
        plan.append((c, key, None))
    pool.shutdown(wait=True)

    table, counts, bad = [], {}, False
    jsonl = open(os.path.join(a.out, "gpu_check_figures.jsonl"), "w")
    for c, key, verdict0 in plan:
        res = runs.get(key)
        if isinstance(res, concurrent.futures.Future):
            res = res.result()
        values, why = None, verdict0
        if why is None and "skipped" in res:
            why = res["skipped"]
        elif why is None:
            if res["rc"] != 0:
                tail = (res["stderr"].strip().splitlines() or [""])[-1][:120]
                why = f"failed to run (rc {res['rc']}: {tail})"
            else:
                try:
                    values = measure(c, res["stdout"])
                except (ValueError, KeyError) as e:
                    why = f"failed to run (output: {e})"
        recorded_on = c.get("recorded_on", "")
        for j, f in enumerate(c["fields"]):
            kind = f.get("kind", c.get("kind", "quality"))
            m, rel = None, None
            if why:
                verdict = why
            elif values[j] is None:
                verdict = "failed to run (no such figure in the output)"
            else:
                m = values[j]
                rel, ok = judge(f["recorded"], m, SPEED_TOL if kind == "speed" else QUALITY_TOL)
                older = f.get("older_build") or c.get("older_build")
                if kind == "speed" and gpu_model(recorded_on) != here:
                    verdict = "other GPU"
                elif not ok and older:
                    verdict = f"older build ({older})"
                else:
                    verdict = "ok" if ok else "DIFFERS"
            short = ("failed to run" if verdict.startswith("failed") else
                     "skipped (no model)" if verdict.startswith("skipped (no model") else
                     "older build" if verdict.startswith("older build") else
                     "skipped (budget)" if verdict.startswith("skipped") else verdict)
            counts[short] = counts.get(short, 0) + 1
            if kind == "quality" and (short == "DIFFERS" or short == "failed to run"):
                bad = True
            name = f"{c['name']}: {f['column']}" + (" [speed]" if kind == "speed" else "")
            table.append((name, f["recorded"], "-" if m is None else f"{m:.6g}",
                          "-" if rel is None else f"{100 * rel:+.3f}%", verdict))
            jsonl.write(json.dumps({"check": c["name"], "column": f["column"], "kind": kind, "recorded": f["recorded"],
                                    "recorded_on": recorded_on, "measured": m, "relative_difference": rel,
                                    "verdict": verdict, "gpu": a.gpu_name, "doc": c.get("doc"),
                                    "seconds": round(res["seconds"], 2) if isinstance(res, dict) and "seconds" in res else None}) + "\n")
    jsonl.close()
    w = [max(len(r[k]) for r in table + [("check", "recorded", "measured", "rel. diff", "verdict")]) for k in range(4)]
    print(f"{'check':<{w[0]}}  {'recorded':>{w[1]}}  {'measured':>{w[2]}}  {'rel. diff':>{w[3]}}  verdict")
    for r in table:
        print(f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}  {r[4]}")
    order = ["ok", "DIFFERS", "older build", "other GPU", "failed to run", "skipped (budget)", "skipped (no model)"]
    print(f"{len(table)} figures of {len(checks)} checks in {time.time() - budget.start:.0f} s on {a.gpu_name}: "
          + ", ".join(f"{counts.get(k, 0)} {k}" for k in order))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
