#!/bin/bash
# examples/pd_nccl on a machine with two GPUs, built beforehand (make build/pd_nccl): builds
# nothing. In order:
#   1. the single-GPU run of the texts (GPU 0), the reference every decoded token is held to;
#   2. b = 1 (everything FP16) over NCCL, rank 0 prefilling and rank 1 decoding: every token must
#      agree with the reference, with the overlap and without;
#   3. the tiered budgets 0.5 and 0.3 (groups of 64 channels): the agreement is reported (no
#      bound);
#   4. b = 0.3 at groups of 32 channels must be refused at the start (all-INT4 is 0.32 there);
#   5. --inject truncate and --inject corrupt: the decode rank must refuse the broken payload,
#      its cache unchanged, and still agree at b = 1;
#   6. with 3 or more GPUs: every GPU a rank, half of them (at least one) prefilling, at b = 1:
#      every token must agree (the plan spreads texts over N prefill and M decode ranks);
#   7. --bench (a 2048-token prompt): bytes and time per layer, FP16 against tiered at b = 0.5
#      and 0.3, beside a plain ncclSend of the same bytes, and time to the first decoded token
#      with and without overlap.
#
#   bench/pd_nccl_check.sh [SHARED_DIR]      (default ../shared: models/ and data/)
#
# MODEL overrides the model (default SHARED_DIR/models/kvm-base.safetensors).
#
# Logs go to $OUT (default build/pd-nccl-check); summary.txt ends the output.
# Exit status: nonzero when a check fails.
set -u
cd "$(dirname "$0")/.."
SHARED=${1:-../shared}
OUT=${OUT:-build/pd-nccl-check}
BIN=${BIN:-build/pd_nccl}
TEXTS=${TEXTS:-6}
PROMPT=${PROMPT:-256}
GENERATE=${GENERATE:-32}
BENCH_PROMPT=${BENCH_PROMPT:-2048}
# INT8/INT4 rows in groups of 64 channels: every token fits b = 0.3 (at 32, all-INT4 is 0.32)
TIER_GROUP=${TIER_GROUP:-64}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0
export NCCL_NVLS_ENABLE=0 # no NVLink multicast (the program sets it too)
MODEL=${MODEL:-$SHARED/models/kvm-base.safetensors}
DATA="$SHARED/data/eval-dev.jsonl"
COMMON=(--model "$MODEL" --data "$DATA" --texts "$TEXTS" --prompt-tokens "$PROMPT"
    --generate "$GENERATE")

# step NAME COMMAND...: runs it with a 120 s bound, its log in $OUT/NAME.log, one summary line
step() {
    local name=$1
    shift
    local start=$(date +%s)
    timeout 120 "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local result="ok"
    [ $rc -ne 0 ] && result="FAILED (exit $rc)" && FAILED=1
    printf '%-24s %s, %ss; %s\n' "$name" "$result" "$(($(date +%s) - start))" \
        "$(grep -E 'agreement|refused|pd_nccl: (ok|FAILED)' "$OUT/$name.log" | tail -2 | tr '\n' ' ')" \
        >>"$SUMMARY"
}

if [ ! -x "$BIN" ]; then
    echo "$BIN not built (make build/pd_nccl)" | tee "$SUMMARY"
    exit 1
fi
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader && nvidia-smi topo -m; } \
    >"$OUT/gpus.txt" 2>&1

CUDA_VISIBLE_DEVICES=0 step reference "$BIN" --reference "$OUT/reference.txt" "${COMMON[@]}"
for overlap in "" --no-overlap; do
    step "b1${overlap:+-no-overlap}" "$BIN" "${COMMON[@]}" --ranks 2 --prefill 1 --budget 1 \
        --expect "$OUT/reference.txt" --min-agreement 1 $overlap
done
for b in 0.5 0.3; do
    step "tiered-$b" "$BIN" "${COMMON[@]}" --ranks 2 --prefill 1 --budget "$b" \
        --group-size "$TIER_GROUP" --expect "$OUT/reference.txt" --min-agreement 0
done
# b = 0.3 at groups of 32 cannot send every token: refused before any rank starts (exit 1)
start=$(date +%s)
timeout 60 "$BIN" "${COMMON[@]}" --ranks 2 --prefill 1 --budget 0.3 --group-size 32 \
    >"$OUT/refused-0.3.log" 2>&1
rc=$?
result="ok"
if [ $rc -ne 1 ] || ! grep -q "cannot send every token" "$OUT/refused-0.3.log"; then
    result="FAILED (exit $rc)" && FAILED=1
fi
printf '%-24s %s, %ss; %s\n' refused-0.3-group-32 "$result" "$(($(date +%s) - start))" \
    "$(tail -1 "$OUT/refused-0.3.log")" >>"$SUMMARY"
for inject in truncate corrupt; do
    step "inject-$inject" "$BIN" "${COMMON[@]}" --ranks 2 --prefill 1 --budget 1 \
        --expect "$OUT/reference.txt" --min-agreement 1 --inject "$inject"
done
GPUS=$(nvidia-smi --list-gpus 2>/dev/null | wc -l)
if [ "$GPUS" -ge 3 ]; then
    step "ranks-$GPUS" "$BIN" "${COMMON[@]}" --ranks "$GPUS" --prefill $((GPUS / 2)) --budget 1 \
        --expect "$OUT/reference.txt" --min-agreement 1
fi
step bench "$BIN" --bench --model "$MODEL" --data "$DATA" --prompt-tokens "$BENCH_PROMPT" --repeat 5 \
    --group-size "$TIER_GROUP"
grep -E '^\||^bench:' "$OUT/bench.log" >>"$SUMMARY"
cat "$OUT/gpus.txt" "$SUMMARY"
exit $FAILED
