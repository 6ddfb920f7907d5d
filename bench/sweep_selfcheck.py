"""Self-check of the sweeps' arm handling (sweep_common.py), no GPU needed: runs
triaxial_sweep.py, evict_sweep.py and transfer_sweep.py against a fake kvmix-eval-cuda whose
behavior each arm picks, and checks every arm's line, what --out keeps and the exit status.

Usage: python3 bench/sweep_selfcheck.py        prints "N passed, N failed"; exit status 1 on a failure

The fake prints a full JSON object, except for a policy or --transfer value that names one of:
fp32 (packed_bits null, as kvmix-eval prints it), boom (exit status 3 with a message), garbage
(not JSON), lacking (no answer_agreement), wrongtype (seconds a string)."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

FAKE_EVAL = r'''
import json, os, sys
argv = sys.argv[1:]
if argv == ["--list-policies"]:
    for name in ("fp16", "fp32", "boom", "garbage", "lacking", "wrongtype"):
        print(json.dumps({"version": 1, "name": name}))
    sys.exit(0)
opt = dict(zip(argv[::2], argv[1::2]))
what = opt["--policy"]
if os.path.exists(what):  # evict_sweep's policy document
    with open(what) as f:
        what = json.load(f)["name"]
what += " " + opt.get("--transfer", "")
out = {"bits_per_token": 1.25, "answer_agreement": 0.875, "avg_bits": 4.5, "packed_bits": 4.25,
       "seconds": 2.0, "recall": {"answer_agreement": 0.5, "answer_bits_per_token": 2.5}}
if "+" in what:
    out["eviction"] = {"evicted_tokens": 17}
if "--transfer" in opt:
    out["transfer"] = {"realized_budget": 0.25, "n_fp16": 1, "n_int8": 2, "n_int4": 3,
                       "n_dropped": 4, "after": {"bits_per_token": 1.5, "answer_agreement": None}}
if "fp32" in what:
    out["packed_bits"] = None
if "boom" in what:
    print("fake-eval: boom", file=sys.stderr)
    sys.exit(3)
if "garbage" in what:
    print("not json")
    sys.exit(0)
if "lacking" in what:
    del out["answer_agreement"]
if "wrongtype" in what:
    out["seconds"] = "soon"
print(json.dumps(out))
'''

passed = failed = 0


def check(cond, what):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print(f"FAILED: {what}")


def sweep(tmp, script, arms, *extra):
    out = os.path.join(tmp, script + ".jsonl")
    cmd = [sys.executable, os.path.join(HERE, script), "--eval", os.path.join(tmp, "fake-eval"),
           "--model", "m", "--data", "d", "--spec", "s", "--arms", ",".join(arms), "--out", out,
           *extra]
    run = subprocess.run(cmd, capture_output=True, text=True)
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    kept = []
    if os.path.exists(out):
        with open(out) as f:
            kept = [json.loads(line)["arm"] for line in f]
    return run, lines, kept


def expect(script, run, lines, kept, want, want_kept, want_rc):
    """want: arm -> the start of its line after "ARM: "."""
    check(list(lines) == list(want), f"{script}: arms {list(lines)}, wanted {list(want)}")
    for arm, start in want.items():
        got = lines.get(arm, "")
        check(got.startswith(start), f"{script}: {arm}: {got!r} does not start with {start!r}")
    check(kept == want_kept, f"{script}: --out keeps {kept}, wanted {want_kept}")
    check(run.returncode == want_rc, f"{script}: exit status {run.returncode}, wanted {want_rc}"
          f"\n{run.stderr}")


def main():
    with tempfile.TemporaryDirectory() as tmp:
        fake = os.path.join(tmp, "fake-eval")
        with open(fake, "w") as f:
            f.write(f"#!{sys.executable}\n{FAKE_EVAL}")
        os.chmod(fake, 0o755)
        alloc = os.path.join(tmp, "alloc.json")
        with open(alloc, "w") as f:
            json.dump({"bits": 3.5}, f)

        # triaxial: the fp32 arm (packed_bits null) no longer stops the sweep
        arms = ["fp32", "boom", "fp16+" + alloc, "garbage", "lacking", "wrongtype",
                "fp16+" + os.path.join(tmp, "no-such.json"), "int4"]
        run, lines, kept = sweep(tmp, "triaxial_sweep.py", arms)
        expect("triaxial", run, lines, kept, {
            "fp32": "bits/token 1.2500 agreement 0.8750 avg_bits 4.500 packed_bits - 2.0 s",
            "boom": "FAILED: exit status 3: fake-eval: boom",
            "fp16+" + alloc: "bits/token 1.2500 agreement 0.8750 avg_bits 4.500 packed_bits "
                             "4.250 (predicted 3.500) 2.0 s",
            "garbage": "FAILED: output is not JSON",
            "lacking": "ODD: output lacks answer_agreement",
            "wrongtype": 'ODD: seconds is not a number: "soon"',
            "fp16+" + os.path.join(tmp, "no-such.json"): "FAILED: FileNotFoundError",
            "int4": "bits/token 1.2500",
        }, ["fp32", "fp16+" + alloc, "lacking", "wrongtype", "int4"], 1)
        # a rerun runs only the arms that failed, and says so again
        run, lines, kept = sweep(tmp, "triaxial_sweep.py", arms)
        missing = "fp16+" + os.path.join(tmp, "no-such.json")
        check(sorted(lines) == sorted(["boom", "garbage", missing]),
              f"triaxial rerun: arms {list(lines)}")
        check(run.returncode == 1, "triaxial rerun: exit status")
        # all good: exit status 0
        run, lines, kept = sweep(tmp, "triaxial_sweep.py", ["fp32", "int4"])
        check(run.returncode == 0 and lines == {}, "triaxial: every arm done already")
        run, lines, kept = sweep(tmp, "triaxial_sweep.py", ["int8", "kivi2"])
        check(run.returncode == 0 and list(lines) == ["int8", "kivi2"], "triaxial: good arms")

        run, lines, kept = sweep(tmp, "evict_sweep.py",
                                 ["fp32/h2o/0.5", "boom/none", "nosuch/h2o/0.5", "fp16/none",
                                  "tri/h2o/0.5", "fp16/h2o/x", "lacking/h2o/0.25", "fp16/snapkv/0.5"])
        expect("evict", run, lines, kept, {
            "fp32/h2o/0.5": "bits/token 1.2500 agreement 0.8750 recall agreement 0.5000 "
                            "recall bits 2.5000 evicted 17 2.0 s",
            "boom/none": "FAILED: exit status 3",
            "nosuch/h2o/0.5": "FAILED: no built-in policy nosuch",
            "fp16/none": "bits/token 1.2500 agreement 0.8750 recall agreement 0.5000 "
                         "recall bits 2.5000 evicted 0 2.0 s",
            "tri/h2o/0.5": "FAILED: a tri arm needs --allocation",
            "fp16/h2o/x": "FAILED: ValueError",
            "lacking/h2o/0.25": "ODD: output lacks answer_agreement",
            "fp16/snapkv/0.5": "bits/token 1.2500",
        }, ["fp32/h2o/0.5", "fp16/none", "lacking/h2o/0.25", "fp16/snapkv/0.5"], 1)

        run, lines, kept = sweep(tmp, "transfer_sweep.py",
                                 ["tiered:0.25", "boom:0.5", "none", "garbage:0.5", "int8:0.5"])
        expect("transfer", run, lines, kept, {
            "tiered:0.25": "realized b 0.2500 fp16/int8/int4/dropped 1/2/3/4 after: bits/token "
                           "1.5000 agreement - 2.0 s",
            "boom:0.5": "FAILED: exit status 3",
            "none": "bits/token 1.2500 2.0 s",
            "garbage:0.5": "FAILED: output is not JSON",
            "int8:0.5": "realized b 0.2500",
        }, ["tiered:0.25", "none", "int8:0.5"], 1)
        run, lines, kept = sweep(tmp, "transfer_sweep.py", ["ends:0.5"],
                                 "--policy", "wrongtype")
        check(lines.get("ends:0.5", "").startswith("ODD: seconds is not a number")
              and run.returncode == 1, f"transfer: odd seconds: {lines}")

        run, lines, kept = sweep(tmp, "transfer_sweep.py", ["int4:0.25"], "--eval", "/no/such/eval")
        check(lines.get("int4:0.25", "").startswith("FAILED: cannot run /no/such/eval")
              and run.returncode == 1, f"transfer: no eval: {lines}")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
