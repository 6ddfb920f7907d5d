"""Tri-axial precision on the GPU runner: one kvmix-eval-cuda run per arm, a JSON object per line.

Usage: python3 bench/triaxial_sweep.py --eval build/kvmix-eval-cuda --model M.safetensors
           --data D.jsonl --spec examples/specs/kvm-byte.json --offset 75 --limit 75
           --arms ARMS --out results.jsonl [--batch 75]

An arm is a policy (a built-in name or a policy document) or POLICY+ALLOCATION: the policy with
each token stored by its template tag as the allocation (kvmix-calibrate's JSON) says, aging with
the turns (kvmix-eval --allocation). Arms are comma-separated. Each run's JSON (kvmix-eval's, with
the arm added, and the allocation's predicted bits as "predicted_bits") is appended to --out as
it ends; arms already in --out are skipped, so an interrupted sweep resumes.
"""
import json

import sweep_common


def main():
    a = sweep_common.parser().parse_args()
    for arm in sweep_common.arms_to_run(a):
        policy, _, allocation = arm.partition("+")
        cmd = sweep_common.eval_command(a, policy)
        predicted = None
        if allocation:
            cmd += ["--allocation", allocation]
            with open(allocation) as f:
                predicted = json.load(f)["bits"]
        result = sweep_common.run_arm(a, arm, cmd, {"predicted_bits": predicted})
        if result is None:
            continue
        print(f"{arm}: bits/token {result['bits_per_token']:.4f} agreement "
              f"{result['answer_agreement']:.4f} avg_bits {result['avg_bits']:.3f} packed_bits "
              f"{result['packed_bits']:.3f}"
              + (f" (predicted {predicted:.3f})" if predicted is not None else "")
              + f" {result['seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
