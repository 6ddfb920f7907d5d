"""Two runners' evictions of the same texts side by side: the CPU runner (kvmix-eval) as the GPU
runner's (kvmix-eval-cuda) oracle.

Usage: python3 bench/evict_compare.py CPU.json CPU.log GPU.json GPU.log
  *.json: kvmix-eval's output; *.log: its --evict-log (one eviction a line: text, request,
  positions). Prints bits/token of each and their relative difference, the eviction figures, how
  many evictions chose the same positions, and for the others the positions only one chose.
"""
import json
import sys


def evictions(path):
    with open(path) as f:
        return {(o["text"], o["request"]): set(o["positions"]) for o in map(json.loads, f)}


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    a, b = (json.load(open(p)) for p in sys.argv[1::2])
    ea, eb = evictions(sys.argv[2]), evictions(sys.argv[4])
    rel = (a["bits_per_token"] - b["bits_per_token"]) / b["bits_per_token"]
    print(f"bits/token {a['bits_per_token']:.6f} {b['bits_per_token']:.6f} ({rel * 100:+.4f}%)")
    print(f"eviction {a.get('eviction')}\n         {b.get('eviction')}")
    keys = sorted(set(ea) | set(eb))
    same = [k for k in keys if ea.get(k) == eb.get(k)]
    print(f"evictions with the same positions: {len(same)} of {len(keys)}")
    for k in keys:
        if ea.get(k) != eb.get(k):
            x, y = ea.get(k, set()), eb.get(k, set())
            print(f"  text {k[0]} request {k[1]}: first only {sorted(x - y)}, second only "
                  f"{sorted(y - x)}")


if __name__ == "__main__":
    main()
