"""Transfer tiers on the GPU runner: one kvmix-eval-cuda run per arm, a JSON object per line.

Usage: python3 bench/transfer_sweep.py --eval build/kvmix-eval-cuda --model M.safetensors
           --data D.jsonl --spec examples/specs/kvm-byte.json --offset 75 --limit 75
           --arms ARMS --out results.jsonl [--policy fp16] [--batch 75]

An arm is a --transfer value, MODE:B[:LAMBDA] (examples/transfer_plan.h: tiered, norms, int8,
int4, random, sinks, ends), or "none" (no hand-over: the same texts untransferred). Arms are
comma-separated. Each text is handed over once, at the end of the first user message that ends
at or after half of it; the figures after the hand-over are the run's "transfer.after". Each
run's JSON (kvmix-eval's, with the arm added) is appended to --out as it ends; arms already in
--out are skipped, so an interrupted sweep resumes.
"""
import sweep_common


def main():
    ap = sweep_common.parser()
    ap.add_argument("--policy", default="fp16")
    a = ap.parse_args()
    for arm in sweep_common.arms_to_run(a):
        cmd = sweep_common.eval_command(a, a.policy)
        if arm != "none":
            cmd += ["--transfer", arm]
        result = sweep_common.run_arm(a, arm, cmd)
        if result is None:
            continue
        x = result.get("transfer")
        if x:
            after = x["after"]
            print(f"{arm}: realized b {x['realized_budget']:.4f} fp16/int8/int4/dropped "
                  f"{x['n_fp16']}/{x['n_int8']}/{x['n_int4']}/{x['n_dropped']} after: bits/token "
                  f"{after['bits_per_token']:.4f} agreement {after['answer_agreement']:.4f} "
                  f"{result['seconds']:.1f} s", flush=True)
        else:
            print(f"{arm}: bits/token {result['bits_per_token']:.4f} "
                  f"{result['seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
