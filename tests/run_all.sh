#!/bin/sh
# Runs every test program given after the first three arguments (build dir, shared dir, fuzz
# iterations) and the model tests when the shared models exist, and prints one final line
# "N passed, N failed" summing them all. A program that prints its own "N passed, N failed" line
# counts with its numbers; any other counts as one check that passes when it exits 0.
build=$1 shared=$2 fuzz_runs=$3
shift 3
passed=0 failed=0
log=$build/test-log.txt
: >"$log"

count() { # name, exit status, output file
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$3" | tail -n 1)
    if [ -n "$line" ]; then
        p=${line%% passed*}
        f=${line#*passed, }
        f=${f%% failed}
        if [ "$2" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
    elif [ "$2" -eq 0 ]; then p=1 f=0
    else p=0 f=1
    fi
    passed=$((passed + p))
    failed=$((failed + f))
    status=ok
    [ "$f" -ne 0 ] && status=FAILED
    echo "$status  $1 ($p passed, $f failed)"
    if [ "$f" -ne 0 ]; then tail -n 40 "$3"; fi
    cat "$3" >>"$log"
}

# A fuzz smoke run takes the per-input limits of make fuzz (tests/fuzz_limits.h): an input that runs
# FUZZ_TIMEOUT seconds or takes the process past FUZZ_RSS_MB MiB fails the run, saved as
# ./timeout-* or ./oom-*. It also runs the inputs kept in tests/fuzz_regress/NAME (findings).
fuzz_limits="-timeout=${FUZZ_TIMEOUT:-10} -rss_limit_mb=${FUZZ_RSS_MB:-2048}"

# Every program starts at once in the background (they are independent; the fuzz runs and the
# model tests take longest) and is counted afterwards in the order given, with its own output.
names=
start() { # name, command...
    name=$1
    shift
    ("$@" >"$build/.test-out-$name" 2>&1
        echo $? >"$build/.test-rc-$name") &
    names="$names $name"
}

for program in "$@"; do
    case $program in
    */fuzz_*_run)
        target=$(basename "$program" _run)
        # shellcheck disable=SC2086 # the limits and the kept inputs are separate words
        start "$(basename "$program")" "$program" "$fuzz_runs" $fuzz_limits \
            $(ls tests/fuzz_regress/"${target#fuzz_}"/* 2>/dev/null)
        ;;
    *) start "$(basename "$program")" "$program" ;;
    esac
done
if [ -d "$shared/models" ]; then
    for program in "$build"/model_test_*; do
        [ -x "$program" ] && start "$(basename "$program")" "$program" "$shared"
    done
fi
wait
for name in $names; do
    count "$name" "$(cat "$build/.test-rc-$name")" "$build/.test-out-$name"
done
[ -d "$shared/models" ] ||
    echo "model tests skipped: $shared/models not found (make test SHARED=path/to/shared)"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
