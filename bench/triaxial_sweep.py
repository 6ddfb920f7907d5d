"""Tri-axial precision on the GPU runner: one kvmix-eval-cuda run per arm, a JSON object per line.

Usage: python3 bench/triaxial_sweep.py --eval build/kvmix-eval-cuda --model M.safetensors
           --data D.jsonl --spec examples/specs/kvm-byte.json --offset 75 --limit 75
           --arms ARMS --out results.jsonl [--batch 75]

An arm is a policy (a built-in name or a policy document) or POLICY+ALLOCATION: the policy with
each token stored by its template tag as the allocation (kvmix-calibrate's JSON) says, aging with
the turns (kvmix-eval --allocation). Arms are comma-separated. Each run's JSON (kvmix-eval's, with
the arm added, and the allocation's predicted bits as "predicted_bits") is appended to --out as
it ends; arms already in --out are skipped, so an interrupted sweep resumes. An arm that fails
(or whose output lacks a field) says so on its line and the sweep goes on; the exit status is 1
when any did (sweep_common.py).
"""
import json
import sys

import sweep_common


def run_one(a, arm):
    policy, _, allocation = arm.partition("+")
    cmd = sweep_common.eval_command(a, policy)
    predicted = None
    if allocation:
        cmd += ["--allocation", allocation]
        with open(allocation) as f:
            predicted = json.load(f)["bits"]
    result = sweep_common.run_arm(a, arm, cmd, {"predicted_bits": predicted})
    n = lambda path, spec: sweep_common.number(result, path, spec)
    return (f"{arm}: bits/token {n('bits_per_token', '.4f')} agreement "
            f"{n('answer_agreement', '.4f')} avg_bits {n('avg_bits', '.3f')} packed_bits "
            f"{n('packed_bits', '.3f')}"
            + (f" (predicted {n('predicted_bits', '.3f')})" if predicted is not None else "")
            + f" {n('seconds', '.1f')} s")


def main():
    a = sweep_common.parser().parse_args()
    sys.exit(sweep_common.sweep(a, lambda arm: run_one(a, arm)))


if __name__ == "__main__":
    main()
