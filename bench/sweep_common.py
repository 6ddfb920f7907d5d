"""What the GPU runner's sweeps (evict_sweep.py, transfer_sweep.py, triaxial_sweep.py) share: their flags, the
kvmix-eval-cuda command over the selected traces, and the run of one arm, whose JSON (with the
arm added) is appended to --out as it ends; arms already in --out are skipped, so an
interrupted sweep resumes."""
import argparse
import json
import os
import subprocess
import sys


def parser():
    ap = argparse.ArgumentParser()
    for flag in ("--eval", "--model", "--data", "--spec", "--arms", "--out"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=75)
    ap.add_argument("--batch", type=int, default=75)
    return ap


def arms_to_run(a):
    done = set()
    if os.path.exists(a.out):
        with open(a.out) as f:
            done = {json.loads(line)["arm"] for line in f if line.strip()}
    return [arm for arm in a.arms.split(",") if arm not in done]


def eval_command(a, policy):
    return [a.eval, "--model", a.model, "--data", a.data, "--kind", "trace", "--offset",
            str(a.offset), "--limit", str(a.limit), "--batch", str(a.batch), "--policy", policy,
            "--tag-spec", a.spec]


def run_arm(a, arm, cmd, extra=None):
    """The run's JSON with the arm (and the fields of extra), appended to --out; None (said on
    stderr) when it failed."""
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        print(f"{arm}: failed: {run.stderr.strip()}", file=sys.stderr)
        return None
    result = json.loads(run.stdout)
    result["arm"] = arm
    result.update(extra or {})
    with open(a.out, "a") as f:
        f.write(json.dumps(result) + "\n")
    return result
