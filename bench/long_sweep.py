"""Policies on long sessions: one kvmix-eval run per arm over the report half of
bench/refmodel/eval-dev-long.jsonl, then a markdown table per metric split by the questions' turn
distance (1, 3, 10, 30), with standard errors and each arm's difference to a baseline arm.

The full study (kvm-long, GPU runner, the report half: traces 101-200):

    python3 bench/long_sweep.py --eval build/kvmix-eval-cuda --model models/kvm-long.safetensors \\
        --data bench/refmodel/eval-dev-long.jsonl --spec examples/specs/kvm-byte.json \\
        --offset 100 --limit 100 --allocation build/long-alloc.json --out long-report.jsonl

where build/long-alloc.json is the tri-axial allocation calibrated on the tune half (traces 1-100),
from captures of the GPU runner (the CPU runner's files; the CPU runner takes 2.2 minutes for a
12.8K-token trace on two threads) and kvmix-calibrate (4.2 minutes a capture on one thread):

    build/kvmix-eval-cuda --model models/kvm-long.safetensors \\
        --data bench/refmodel/eval-dev-long.jsonl --kind trace --limit 16 --batch 16 \\
        --policy fp32 --capture DIR
    build/kvmix-calibrate --captures DIR --threads 16 --page-tokens 64 --key-group 128 \\
        --value-group 128 --sinks 32 --window 128 --price runs --instruction each --budget 3.5 \\
        --allocation build/long-alloc.json

Without --allocation the study has no tri-axial arm.

Usage: python3 bench/long_sweep.py --eval E --model M --data D --spec S --out OUT.jsonl
           [--arms ARMS] [--offset 100] [--limit 100] [--batch 100] [--baseline fp16]
           [--allocation A.json] [--envelope P.json] [--transfer-policy fp16]
           [--reference-tops PATH]

The fp32 reference (what every agreement compares with) runs once, first: its JSON goes to --out
as the arm "fp32" and its top-1s to --reference-tops (default OUT.jsonl.fp32-tops), which every
arm then reads (kvmix-eval --reference-tops) instead of running fp32 again. A file already
there is taken as it is: delete it with --out to start over.

--arms is comma-separated; "study" (the default) stands for the study's arms below. An arm is:
    NAME or FILE.json      a policy (built-in name or policy document): a fixed format
    POLICY+ALLOCATION      the policy with the tri-axial allocation (triaxial_sweep.py)
    PRECISION/SCORER/...   budgeted eviction (evict_sweep.py's arm, its policy document)
    PRECISION/SCORER/...@W.json  the same with the intent residual's weights W.json
                           (kvmix-eval --residual; intent and query scorers)
    MODE:B[:LAMBDA]        a hand-over with transfer tiers under --transfer-policy
                           (transfer_sweep.py's arm: kvmix-eval --transfer)
The study: fp16 (the baseline), int4, kivi2-sink, kitty-25, kitty-paper-25; eviction of fp16 at
50%, 25% and 12.5% of the history by intent (decay 0.5, pool 7), query (pool 7), streaming, h2o
and snapkv (the settings QUALITY.md chose on eval-dev traces 1-75); transfer at b = 0.3, 0.35
and 0.46 by tiered (lambda 0.005), random, sinks and ends, and uniform int8:1 and int4:1;
ENVELOPE+ALLOCATION when --allocation is given, ENVELOPE the policy whose geometry the allocation
was calibrated at (--envelope, default examples/policies/triaxial-p64.json: pages of 64, 32 sinks,
a window of 128, as `kvmix-calibrate --page-tokens 64 --sinks 32 --window 128` measures).

Each run's JSON, with its arm and command, is appended to --out as it ends; arms already there are
skipped, so an interrupted sweep resumes and a rerun with every arm done prints the tables alone.
A failed arm says so on its line, the sweep goes on, and the tables show it failed; the exit
status is 1 when any arm failed or was odd (sweep_common.py). The tables read kvmix-eval's
"by_distance" (examples/question_score.c): every question whose answer lies within the model's
context, for transfer arms those before the hand-over too. bench/sweep_selfcheck.py checks the
tables against a fake runner.
"""
import argparse
import json
import math
import os
import sys

import evict_sweep
import sweep_common

FIXED_ARMS = ["fp16", "int4", "kivi2-sink", "kitty-25", "kitty-paper-25"]
EVICT_BUDGETS = ["0.5", "0.25", "0.125"]
# scorer -> the arm's tail after the budget (decay/recent/pool), as chosen in QUALITY.md
EVICT_SCORERS = {"intent": "/0.5/64/7", "query": "/0/64/7", "streaming": "", "h2o": "",
                 "snapkv": ""}
TRANSFER_BUDGETS = ["0.3", "0.35", "0.46"]
TRANSFER_MODES = {"tiered": ":0.005", "random": "", "sinks": "", "ends": ""}  # mode -> lambda
METRICS = ["question_accuracy", "question_agreement", "answer_accuracy", "answer_agreement"]


def study_arms(allocation, envelope):
    arms = list(FIXED_ARMS)
    arms += [f"fp16/{scorer}/{budget}{tail}" for budget in EVICT_BUDGETS
             for scorer, tail in EVICT_SCORERS.items()]
    arms += [f"{mode}:{budget}{tail}" for budget in TRANSFER_BUDGETS
             for mode, tail in TRANSFER_MODES.items()]
    arms += ["int8:1", "int4:1"]
    return arms + ([f"{envelope}+{allocation}"] if allocation else [])


def expand_arms(text, allocation, envelope):
    """The arms of --arms, "study" replaced by the study's arms, each arm once (where it first
    appears: "fp16,kitty-25,study" runs those two first)."""
    arms = []
    for arm in text.split(","):
        arms += study_arms(allocation, envelope) if arm == "study" else [arm]
    return list(dict.fromkeys(arms))


def arm_kind(arm):
    """tri, evict, transfer or policy: which of the arm forms above the text is."""
    if "@" in arm:  # an eviction with weights, whose path may hold anything
        return "evict"
    if "+" in arm:
        return "tri"
    if arm.endswith(".json"):  # a policy document's path may hold "/" and ":"
        return "policy"
    if "/" in arm:
        return "evict"
    return "transfer" if ":" in arm else "policy"


def run_arm(a, policies, arm):
    """Runs the arm (sweep_common.run_arm: its JSON is appended to --out) and returns its JSON."""
    kind = arm_kind(arm)
    if kind == "tri":
        policy, allocation = arm.split("+", 1)
        return sweep_common.run_arm(
            a, arm, sweep_common.eval_command(a, policy) + ["--allocation", allocation])
    if kind == "evict":
        evict_arm, _, residual = arm.partition("@")
        doc, flags = evict_sweep.arm_setup(a, policies, evict_arm)
        return evict_sweep.run_document(
            a, arm, doc, flags + (["--residual", residual] if residual else []))
    if kind == "transfer":
        return sweep_common.run_arm(
            a, arm, sweep_common.eval_command(a, a.transfer_policy) + ["--transfer", arm])
    return sweep_common.run_arm(a, arm, sweep_common.eval_command(a, arm))


def run_one(a, policies, arm):
    result = run_arm(a, policies, arm)
    n = lambda path, spec: sweep_common.number(result, path, spec)
    if not isinstance(result.get("by_distance"), list):
        raise sweep_common.ArmOdd("output lacks by_distance (no question within the context?)")
    n_questions = sum(b.get("n_questions", 0) for b in result["by_distance"])
    return (f"{arm}: {n_questions} questions, bits/token {n('bits_per_token', '.4f')} "
            f"agreement {n('answer_agreement', '.4f')} {n('seconds', '.1f')} s")


def reference_pass(a):
    """The fp32 run whose top-1s every arm reads, unless --reference-tops is already there; the
    file appears only once the run succeeded. Raises sweep_common.ArmFailed."""
    if os.path.exists(a.reference_tops):
        print(f"reference: {a.reference_tops} (an earlier fp32 run)", flush=True)
        return
    part = a.reference_tops + ".part"
    own = argparse.Namespace(**{**vars(a), "reference_tops": None})
    result = sweep_common.run_arm(a, "fp32", sweep_common.eval_command(own, "fp32") +
                                  ["--tops", part])
    os.replace(part, a.reference_tops)
    print(f"reference: fp32 -> {a.reference_tops}, "
          f"{sweep_common.number(result, 'seconds', '.1f', '-')} s", flush=True)


# >>tables: everything below reads --out alone, so the self-check feeds it fake results


def load_results(path):
    """arm -> its JSON, the last line of each arm in the JSONL file at path."""
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    result = json.loads(line)
                    results[result["arm"]] = result
    return results


def estimate(bins, metric, distance, and_beyond=False):
    """(p, n) of metric over the bins (kvmix-eval's by_distance) at distance (and_beyond: at it
    and every distance past it), or over all of them when distance is None; n counts questions.
    The answer-token rates pool by answer tokens. None when no bin has a question there."""
    chosen = [b for b in bins if distance is None or b["distance"] == distance or
              (and_beyond and b["distance"] > distance)]
    weight_key = "n_answer_tokens" if metric.startswith("answer_") else "n_questions"
    weight = sum(b[weight_key] for b in chosen)
    n = sum(b["n_questions"] for b in chosen)
    if n == 0 or weight == 0:
        return None
    return sum(b[metric] * b[weight_key] for b in chosen) / weight, n


def standard_error(p, n):
    """The binomial standard error of a rate p over n trials."""
    return math.sqrt(p * (1.0 - p) / n)


def difference(arm, base):
    """(arm - base, its standard error) of two (p, n) estimates, as independent samples."""
    return arm[0] - base[0], math.hypot(standard_error(*arm), standard_error(*base))


def rate_cell(est):
    return "-" if est is None else f"{est[0]:.3f} ± {standard_error(*est):.3f}"


def difference_cell(est, base):
    if est is None or base is None:
        return "-"
    d, se = difference(est, base)
    return f"{d:+.3f} ± {se:.3f}"


def arm_problem(results, arm):
    """Why the arm has no row of figures, or None when it has one."""
    if arm not in results:
        return "FAILED: no result in --out (its line above says why)"
    if not isinstance(results[arm].get("by_distance"), list):
        return "no by_distance in its JSON"
    return None


def distances_of(results):
    return sorted({b["distance"] for r in results.values()
                   for b in r.get("by_distance") or []})


def count_table(results, arms, distances):
    lines = ["| arm | " + " | ".join(f"d={d}" for d in distances) + " |",
             "|---" * (len(distances) + 1) + "|"]
    for arm in arms:
        problem = arm_problem(results, arm)
        if problem:
            lines.append(f"| {arm} | {problem} |")
            continue
        by = {b["distance"]: b for b in results[arm]["by_distance"]}
        cells = [f"{by[d]['n_questions']} / {by[d]['n_answer_tokens']}" if d in by else "-"
                 for d in distances]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def table_columns(distances):
    """(label, distance, and_beyond) of a metric table: each distance, the distances from each
    middle one on pooled (d=3+: the questions 3 or more turns back), then all of them."""
    return ([(f"d={d}", d, False) for d in distances] +
            [(f"d={d}+", d, True) for d in distances[1:-1]] + [("all", None, False)])


def metric_table(results, arms, distances, metric, baseline):
    columns = table_columns(distances)
    lines = ["| arm | " + " | ".join(f"{c} | Δ {c}" for c, _, _ in columns) + " |",
             "|---" * (2 * len(columns) + 1) + "|"]
    base_bins = None if arm_problem(results, baseline) else results[baseline]["by_distance"]
    for arm in arms:
        problem = arm_problem(results, arm)
        if problem:
            lines.append(f"| {arm} | {problem} |")
            continue
        cells = []
        for _, d, beyond in columns:
            est = estimate(results[arm]["by_distance"], metric, d, beyond)
            base = None if base_bins is None else estimate(base_bins, metric, d, beyond)
            cells += [rate_cell(est), "-" if arm == baseline else difference_cell(est, base)]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def devices_of(results, arms):
    return sorted({results[arm]["device"] for arm in arms
                   if arm in results and "device" in results[arm]})


def report(results, arms, baseline):
    """The markdown tables of the arms' results, as lines."""
    distances = distances_of({arm: results[arm] for arm in arms if arm in results})
    lines = ["## Results", "",
             f"device: {', '.join(devices_of(results, arms)) or 'none recorded'}", ""]
    if not distances:
        return lines + ["No arm scored a question (none within the model's context?)."]
    lines += ["Each cell: rate ± binomial standard error sqrt(p(1-p)/n), n = the cell's questions "
              "(the answer-token rates too: a question's tokens are not independent, so counting "
              "questions is the cautious n). Δ: the arm minus the baseline "
              f"({baseline}), standard error sqrt(se_arm² + se_baseline²), the "
              "independent-samples approximation (the arms answer the same questions, so it "
              "overstates the paired error). d=N+: distance N and beyond pooled; all: every "
              "distance pooled.", "",
              "### Questions / answer tokens scored", ""]
    lines += count_table(results, arms, distances)
    for metric in METRICS:
        lines += ["", f"### {metric}", ""]
        lines += metric_table(results, arms, distances, metric, baseline)
    return lines


def configuration(a, arms):
    return ["# Long-session policy sweep", "",
            f"- runner: {a.eval}", f"- model: {a.model}",
            f"- data: {a.data} (offset {a.offset}, limit {a.limit}, batch {a.batch})",
            f"- tag spec: {a.spec}", f"- transfer arms' policy: {a.transfer_policy}",
            f"- allocation: {a.allocation or 'none'}", f"- baseline: {a.baseline}",
            f"- results: {a.out}", f"- arms ({len(arms)}): {','.join(arms)}", ""]


def main():
    ap = sweep_common.parser(arms_default="study")
    ap.set_defaults(offset=100, limit=100, batch=100)
    ap.add_argument("--allocation")
    ap.add_argument("--envelope", default="examples/policies/triaxial-p64.json")
    ap.add_argument("--baseline", default="fp16")
    ap.add_argument("--transfer-policy", default="fp16")
    ap.add_argument("--reference-tops")
    a = ap.parse_args()
    a.reference_tops = a.reference_tops or a.out + ".fp32-tops"
    arms = expand_arms(a.arms, a.allocation, a.envelope)
    a.arms = ",".join(arms)
    print("\n".join(configuration(a, arms)), flush=True)
    needs_policies = any(arm_kind(arm) == "evict" for arm in arms)
    policies = evict_sweep.builtin_policies(a.eval) if needs_policies else {}
    try:
        if sweep_common.arms_to_run(a):  # every arm done: the tables alone, no reference needed
            reference_pass(a)
    except sweep_common.ArmFailed as e:
        print(f"reference: FAILED: {e}", flush=True)
        sys.exit(1)
    status = sweep_common.sweep(a, lambda arm: run_one(a, policies, arm))
    print("\n" + "\n".join(report(load_results(a.out), arms, a.baseline)), flush=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
