"""Self-check of the sweeps' arm handling (sweep_common.py), no GPU needed: runs
triaxial_sweep.py, evict_sweep.py, transfer_sweep.py and long_sweep.py against a fake
kvmix-eval-cuda whose behavior each arm picks, and checks every arm's line, what --out keeps and
the exit status; for long_sweep.py also its tables' rates, standard errors and differences.

Usage: python3 bench/sweep_selfcheck.py        prints "N passed, N failed"; exit status 1 on a failure

The fake prints a full JSON object, except for a policy or --transfer value that names one of:
fp32 (packed_bits null, as kvmix-eval prints it), boom (exit status 3 with a message), garbage
(not JSON), lacking (no answer_agreement), wrongtype (seconds a string). Its by_distance has
100 questions (400 answer tokens) at distance 1, every rate 0.4 for a policy naming int4 and 0.5
for the others, and 25 questions (50 tokens) at distance 30, every rate 0.2."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import long_sweep  # noqa: E402 (found through HERE)

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
if "--tops" in opt:  # long_sweep.py's reference pass
    with open(opt["--tops"], "w") as f:
        f.write("fake tops\n")
if "--reference-tops" in opt and (not os.path.exists(opt["--reference-tops"]) or "fp32" in what):
    print("fake-eval: no reference tops", file=sys.stderr)
    sys.exit(4)
out = {"bits_per_token": 1.25, "answer_agreement": 0.875, "avg_bits": 4.5, "packed_bits": 4.25,
       "seconds": 2.0, "recall": {"answer_agreement": 0.5, "answer_bits_per_token": 2.5},
       "device": "Fake GPU"}
near = 0.4 if "int4" in what else 0.5
out["by_distance"] = [
    {"distance": d, "n_questions": nq, "question_accuracy": p, "question_agreement": p,
     "n_answer_tokens": nt, "answer_accuracy": p, "answer_agreement": p}
    for d, nq, nt, p in ((1, 100, 400, near), (30, 25, 50, 0.2))]
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


def table_rows(stdout, title):
    """arm -> its row (the cells after the arm) of the table under "### title"."""
    rows, inside = {}, False
    for line in stdout.splitlines():
        if line.startswith("### "):
            inside = line == f"### {title}"
        elif inside and line.startswith("| ") and not line.startswith("| arm |"):
            arm, _, rest = line[2:].partition(" | ")
            rows[arm] = rest
    return rows


def check_long_math():
    """The table math on hand-computed figures, and the arms' order."""
    arms = long_sweep.expand_arms("kitty-25,study,ends:0.3", "A.json", "E.json")
    study = long_sweep.study_arms("A.json", "E.json")
    check(arms[0] == "kitty-25" and sorted(arms) == sorted(study) and arms[1:4] == study[:3],
          f"expand_arms: {arms[:5]}")
    check(abs(long_sweep.standard_error(0.5, 100) - 0.05) < 1e-12, "se(0.5, 100)")
    d, se = long_sweep.difference((0.4, 100), (0.5, 100))
    check(abs(d + 0.1) < 1e-12 and abs(se - 0.07) < 1e-12, f"difference: {d}, {se}")
    bins = [{"distance": 1, "n_questions": 100, "n_answer_tokens": 400, "question_accuracy": 0.5,
             "answer_accuracy": 0.5},
            {"distance": 30, "n_questions": 25, "n_answer_tokens": 50, "question_accuracy": 0.2,
             "answer_accuracy": 0.2}]
    p, n = long_sweep.estimate(bins, "question_accuracy", None)
    check(abs(p - 0.44) < 1e-12 and n == 125, f"questions pooled: {p}, {n}")
    p, n = long_sweep.estimate(bins, "answer_accuracy", None)  # pooled by tokens, n questions
    check(abs(p - 210 / 450) < 1e-12 and n == 125, f"tokens pooled: {p}, {n}")
    check(long_sweep.estimate(bins, "question_accuracy", 10) is None, "no bin at distance 10")
    p, n = long_sweep.estimate(bins, "question_accuracy", 10, True)
    check(abs(p - 0.2) < 1e-12 and n == 25, f"distance 10 and beyond: {p}, {n}")
    p, n = long_sweep.estimate(bins, "question_accuracy", 1, True)
    check(abs(p - 0.44) < 1e-12 and n == 125, f"distance 1 and beyond: {p}, {n}")
    three = bins[:1] + [dict(bins[1], distance=3)] + bins[1:]
    row = table_rows("### m\n" + "\n".join(long_sweep.metric_table(
        {"x": {"by_distance": three}}, ["x"], [1, 3, 30], "question_accuracy", "x")), "m")
    check(row == {"x": "0.500 ± 0.050 | - | 0.200 ± 0.080 | - | 0.200 ± 0.080 | - | "
                       "0.200 ± 0.057 | - | 0.400 ± 0.040 | - |"},
          f"a middle distance and beyond pooled: {row}")
    results = {"int4": {"by_distance": bins}}
    row = table_rows("### m\n" + "\n".join(long_sweep.metric_table(
        results, ["int4"], [1, 30], "question_accuracy", "fp16")), "m")
    check(row == {"int4": "0.500 ± 0.050 | - | 0.200 ± 0.080 | - | 0.440 ± 0.044 | - |"},
          f"no baseline result, no differences: {row}")


def check_long_sweep(tmp):
    out = os.path.join(tmp, "long.jsonl")
    cmd = [sys.executable, os.path.join(HERE, "long_sweep.py"), "--eval",
           os.path.join(tmp, "fake-eval"), "--model", "m", "--data", "d", "--spec", "s",
           "--arms", "fp16,int4,boom,fp16/h2o/0.5,tiered:0.3,fp16/intent/0.5@w.json", "--out", out]
    run = subprocess.run(cmd, capture_output=True, text=True)
    check(run.returncode == 1, f"long: exit status {run.returncode}, wanted 1\n{run.stderr}")
    for want in ("- runner: " + os.path.join(tmp, "fake-eval"),
                 "- data: d (offset 100, limit 100, batch 100)", "- baseline: fp16",
                 "boom: FAILED: exit status 3", "int4: 125 questions, bits/token 1.2500",
                 "device: Fake GPU", "independent-samples approximation"):
        check(want in run.stdout, f"long: no {want!r} in\n{run.stdout}")
    failed = "FAILED: no result in --out (its line above says why) |"
    rows = table_rows(run.stdout, "question_accuracy")
    check(rows == {
        "fp16": "0.500 ± 0.050 | - | 0.200 ± 0.080 | - | 0.440 ± 0.044 | - |",
        "int4": "0.400 ± 0.049 | -0.100 ± 0.070 | 0.200 ± 0.080 | +0.000 ± 0.113 | "
                "0.360 ± 0.043 | -0.080 ± 0.062 |",
        "boom": failed,
        "fp16/h2o/0.5": "0.500 ± 0.050 | +0.000 ± 0.071 | 0.200 ± 0.080 | +0.000 ± 0.113 | "
                        "0.440 ± 0.044 | +0.000 ± 0.063 |",
        "tiered:0.3": "0.500 ± 0.050 | +0.000 ± 0.071 | 0.200 ± 0.080 | +0.000 ± 0.113 | "
                      "0.440 ± 0.044 | +0.000 ± 0.063 |",
        "fp16/intent/0.5@w.json": "0.500 ± 0.050 | +0.000 ± 0.071 | 0.200 ± 0.080 | "
                                  "+0.000 ± 0.113 | 0.440 ± 0.044 | +0.000 ± 0.063 |"},
          f"long: question_accuracy {rows}")
    # the answer-token rates pool the distances by tokens: (0.4 * 400 + 0.2 * 50) / 450
    rows = table_rows(run.stdout, "answer_agreement")
    check(rows.get("int4", "").endswith("| 0.378 ± 0.043 | -0.089 ± 0.062 |"),
          f"long: answer_agreement {rows}")
    rows = table_rows(run.stdout, "Questions / answer tokens scored")
    check(rows.get("int4") == "100 / 400 | 25 / 50 |" and rows.get("boom") == failed,
          f"long: counts {rows}")
    # the fp32 reference ran once, first, and every arm read its top-1s
    with open(out) as f:
        commands = [json.loads(line)["command"] for line in f]
    reads = lambda c: "--reference-tops" in c and c[c.index("--reference-tops") + 1] == \
        out + ".fp32-tops"
    residual = [c for c in commands if "--residual" in c]
    check(len(residual) == 1 and residual[0][residual[0].index("--residual") + 1] == "w.json",
          f"long: the residual arm's weights {residual}")
    check(commands and commands[0][-2] == "--tops" and not reads(commands[0]) and
          all(reads(c) for c in commands[1:]),
          f"long: reference pass and reuse {commands}")
    run = subprocess.run(cmd, capture_output=True, text=True)  # resumed: nothing runs again
    check(f"reference: {out}.fp32-tops (an earlier fp32 run)" in run.stdout,
          f"long: resumed reference\n{run.stdout}")


def check_evict_arms():
    """An eviction arm's seventh part is the recent floor's share of the budget."""
    import evict_sweep
    for arm, want in (("fp16/h2o/0.25/0/64/1/0.5", 0.5), ("fp16/h2o/0.25", None)):
        doc = evict_sweep.policy_document({"name": "fp16"}, *evict_sweep.parse_arm(arm)[1:])
        got = doc["evict"].get("recent_fraction")
        check(got == want and doc["evict"]["recent_tokens"] == 64, f"{arm}: recent_fraction {got}")


def main():
    check_long_math()
    check_evict_arms()
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
        check_long_sweep(tmp)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
