"""Budgeted eviction on the GPU runner: one kvmix-eval-cuda run per arm, a JSON object per line.

Usage: python3 bench/evict_sweep.py --eval build/kvmix-eval-cuda --model M.safetensors
           --data D.jsonl --spec examples/specs/kvm-byte.json --offset 75 --limit 75
           --arms ARMS --out results.jsonl [--allocation A.json] [--batch 75]

An arm is precision/scorer/budget[/decay[/recent[/pool[/share]]]]: precision a built-in policy name (fp16, kitty-25,
...) whose settings the run takes (`kvmix-eval --list-policies`), scorer one of none, intent,
query, streaming, h2o, snapkv, budget the fraction of history kept, decay the QueryMemory decay
(intent only), recent the recent floor (most recent positions always kept; default 64, the
floor H2O has always had; streaming ignores it), pool the max-pool width of the scores (odd;
default 7 for snapkv, 1 (none) for the others; streaming ignores it), share the recent floor as
a share of the budget (recent_fraction: the larger floor holds; H2O's paper keeps 0.5; default
none). "tri" as the precision runs the built-in fp16 policy with --allocation (the
tri-axial per-tag formats). Arms are comma-separated; "none" arms ignore the budget. Every arm
shares the forced set (the first 4 positions and the request's user message) and the scorer
settings below, so that arms differ in the scorer alone. Each run's JSON (kvmix-eval's, with the
arm added) is appended to --out as it ends; arms already in --out are skipped, so an interrupted
sweep resumes. An arm that fails (or whose output lacks a field) says so on its line and the sweep
goes on; the exit status is 1 when any did (sweep_common.py).
"""
import json
import os
import subprocess
import sys
import tempfile

import sweep_common

PREFIX_TOKENS = 4  # the protected prefix: the attention sinks
RECENT_TOKENS = 64  # the recent floor of an arm that names none
OBSERVE_TOKENS = 32  # SnapKV's observation window
SNAPKV_POOL_TOKENS = 7  # SnapKV's pooling width of an arm that names none


def builtin_policies(eval_bin):
    out = subprocess.run([eval_bin, "--list-policies"], check=True, capture_output=True, text=True)
    return {p["name"]: p for p in map(json.loads, out.stdout.splitlines())}


def policy_document(base, scorer, budget, decay, recent, pool, share=0.0):
    doc = dict(base)
    doc["name"] = base["name"] if scorer == "none" else f"{base['name']}+{scorer}-{budget:g}"
    if scorer != "none":
        doc["evict"] = {"scorer": scorer, "budget_fraction": budget, "decay": decay,
                        "prefix_tokens": PREFIX_TOKENS, "recent_tokens": recent,
                        "observe_tokens": OBSERVE_TOKENS, "pool_tokens": pool}
        if share != 0:  # a share outside [0, 1] goes in, for kvmix-eval to refuse
            doc["evict"]["recent_fraction"] = share
    return doc


def parse_arm(text):
    parts = text.split("/")
    precision, scorer = parts[0], parts[1]
    budget = float(parts[2]) if len(parts) > 2 else 1.0
    decay = float(parts[3]) if len(parts) > 3 else 0.0
    recent = int(parts[4]) if len(parts) > 4 else RECENT_TOKENS
    pool = int(parts[5]) if len(parts) > 5 else SNAPKV_POOL_TOKENS if scorer == "snapkv" else 1
    share = float(parts[6]) if len(parts) > 6 else 0.0
    return precision, scorer, budget, decay, recent, pool, share


def arm_setup(a, policies, arm):
    """The arm's policy document and the flags it adds to the eval command. Raises ArmFailed for a
    tri arm without --allocation or a precision that is no built-in policy."""
    precision, scorer, budget, decay, recent, pool, share = parse_arm(arm)
    if precision == "tri" and not a.allocation:
        raise sweep_common.ArmFailed("a tri arm needs --allocation")
    base = "fp16" if precision == "tri" else precision
    if base not in policies:
        raise sweep_common.ArmFailed(f"no built-in policy {precision}")
    doc = policy_document(policies[base], scorer, budget, decay, recent, pool, share)
    return doc, (["--allocation", a.allocation] if precision == "tri" else [])


def run_document(a, arm, doc, flags):
    """sweep_common.run_arm over the policy document doc, written to a file for the run alone."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(doc, f)
    try:
        return sweep_common.run_arm(a, arm, sweep_common.eval_command(a, f.name) + flags)
    finally:
        os.unlink(f.name)


def run_one(a, policies, arm):
    scorer = parse_arm(arm)[1]
    result = run_document(a, arm, *arm_setup(a, policies, arm))
    n = lambda path, spec: sweep_common.number(result, path, spec)
    evicted = n("eviction.evicted_tokens", "") if scorer != "none" else "0"
    return (f"{arm}: bits/token {n('bits_per_token', '.4f')} "
            f"agreement {n('answer_agreement', '.4f')} "
            f"recall agreement {n('recall.answer_agreement', '.4f')} "
            f"recall bits {n('recall.answer_bits_per_token', '.4f')} "
            f"evicted {evicted} {n('seconds', '.1f')} s")


def main():
    ap = sweep_common.parser()
    ap.add_argument("--allocation")
    a = ap.parse_args()
    policies = builtin_policies(a.eval)
    sys.exit(sweep_common.sweep(a, lambda arm: run_one(a, policies, arm)))


if __name__ == "__main__":
    main()
