"""Transfer tiers on the GPU runner: one kvmix-eval-cuda run per arm, a JSON object per line.

Usage: python3 bench/transfer_sweep.py --eval build/kvmix-eval-cuda --model M.safetensors
           --data D.jsonl --spec examples/specs/kvm-byte.json --offset 75 --limit 75
           --arms ARMS --out results.jsonl [--policy fp16] [--batch 75]

An arm is a --transfer value, MODE:B[:LAMBDA] (examples/transfer_plan.h: tiered, norms, int8,
int4, random, sinks, ends), or "none" (no hand-over: the same texts untransferred). Arms are
comma-separated. Each text is handed over once, at the end of the first user message that ends
at or after half of it; the figures after the hand-over are the run's "transfer.after". Each
run's JSON (kvmix-eval's, with the arm added) is appended to --out as it ends; arms already in
--out are skipped, so an interrupted sweep resumes. An arm that fails (or whose output lacks a
field) says so on its line and the sweep goes on; the exit status is 1 when any did
(sweep_common.py).
"""
import sys

import sweep_common


def run_one(a, arm):
    cmd = sweep_common.eval_command(a, a.policy)
    if arm != "none":
        cmd += ["--transfer", arm]
    result = sweep_common.run_arm(a, arm, cmd)
    n = lambda path, spec: sweep_common.number(result, path, spec)
    if "transfer" in result and result["transfer"] is not None:
        return (f"{arm}: realized b {n('transfer.realized_budget', '.4f')} fp16/int8/int4/dropped "
                f"{n('transfer.n_fp16', '')}/{n('transfer.n_int8', '')}/"
                f"{n('transfer.n_int4', '')}/{n('transfer.n_dropped', '')} after: bits/token "
                f"{n('transfer.after.bits_per_token', '.4f')} agreement "
                f"{n('transfer.after.answer_agreement', '.4f')} {n('seconds', '.1f')} s")
    if arm != "none":
        raise sweep_common.ArmOdd("output lacks transfer")
    return f"{arm}: bits/token {n('bits_per_token', '.4f')} {n('seconds', '.1f')} s"


def main():
    ap = sweep_common.parser()
    ap.add_argument("--policy", default="fp16")
    a = ap.parse_args()
    sys.exit(sweep_common.sweep(a, lambda arm: run_one(a, arm)))


if __name__ == "__main__":
    main()
