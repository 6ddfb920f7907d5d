"""What the sweeps (evict_sweep.py, transfer_sweep.py, triaxial_sweep.py, long_sweep.py) share:
their flags, the kvmix-eval-cuda command over the selected traces, the run of one arm, whose JSON
(with the arm and its command added) is appended to --out as it ends (arms already in --out are
skipped, so an interrupted sweep resumes), the fields of an arm's line, and the loop over the arms.

An arm that fails says so on its line and the sweep goes on with the next one:
    ARM: FAILED: why     the arm did not run (its run exited non-zero, printed no JSON object, or
                         the arm could not be set up: a bad arm text, an unknown policy, an
                         unreadable allocation); nothing is appended, so a rerun tries it again
    ARM: ODD: why        the run printed a JSON object that lacks a field the line shows, or has
                         one that is not a number; the JSON is appended as it came (the run's
                         figures are kept), so a rerun skips it: delete its line from --out to
                         run it again
A field that is null (a figure the run could not take: fp32's packed_bits, an agreement over no
answer tokens) is shown as "-" and is not odd. The exit status is 1 when any arm failed or was
odd, else 0. bench/sweep_selfcheck.py runs the sweeps against a fake kvmix-eval-cuda."""
import argparse
import json
import os
import subprocess
import sys


class ArmFailed(Exception):
    """The arm did not run; the message says why."""


class ArmOdd(Exception):
    """The arm ran, but its JSON lacks a field its line shows; the message says which."""


def parser(arms_default=None):
    """The sweeps' flags; --arms is required unless arms_default is given."""
    ap = argparse.ArgumentParser()
    for flag in ("--eval", "--model", "--data", "--spec", "--out"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--arms", required=arms_default is None, default=arms_default)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=75)
    ap.add_argument("--batch", type=int, default=75)
    return ap


def arms_to_run(a):
    done = set()
    if os.path.exists(a.out):
        with open(a.out) as f:
            done = {json.loads(line)["arm"] for line in f if line.strip()}
    return [arm for arm in a.arms.split(",") if arm not in done]


def eval_command(a, policy):
    """The run of policy over the selected traces; with a.reference_tops (long_sweep.py) the fp32
    reference's top-1s come from that file instead of a pass of their own."""
    reference = getattr(a, "reference_tops", None)
    return [a.eval, "--model", a.model, "--data", a.data, "--kind", "trace", "--offset",
            str(a.offset), "--limit", str(a.limit), "--batch", str(a.batch), "--policy", policy,
            "--tag-spec", a.spec] + (["--reference-tops", reference] if reference else [])


def run_arm(a, arm, cmd, extra=None):
    """The run's JSON with the arm, its command (and the fields of extra), appended to --out.
    Raises ArmFailed when the run could not start, exited non-zero (its stderr is copied to
    stderr) or printed no JSON object; nothing is appended then."""
    try:
        run = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ArmFailed(f"cannot run {cmd[0]}: {e}") from None
    if run.returncode != 0:
        err = run.stderr.strip()
        if err:
            print(f"{arm}: {err}", file=sys.stderr, flush=True)
        last = err.splitlines()[-1] if err else "no message"
        raise ArmFailed(f"exit status {run.returncode}: {last}")
    try:
        result = json.loads(run.stdout)
    except ValueError as e:
        raise ArmFailed(f"output is not JSON ({e})") from None
    if not isinstance(result, dict):
        raise ArmFailed("output is not a JSON object")
    result["arm"] = arm
    result["command"] = cmd
    result.update(extra or {})
    with open(a.out, "a") as f:
        f.write(json.dumps(result) + "\n")
    return result


_REQUIRED = object()


def number(result, path, spec, default=_REQUIRED):
    """The number at path in result (dot-separated keys: "recall.answer_agreement") formatted by
    spec (a format spec: ".4f"); "-" when it is null; default (a string) when it is absent and a
    default is given. Raises ArmOdd when it is absent without a default, or is not a number."""
    value = result
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            if default is not _REQUIRED:
                return default
            raise ArmOdd(f"output lacks {path}")
        value = value[key]
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArmOdd(f"{path} is not a number: {json.dumps(value)}")
    return format(value, spec)


def sweep(a, run_one):
    """Runs run_one(arm) for each arm of --arms not yet in --out, in order, and prints the line it
    returns, or the arm's FAILED or ODD line when it raises (any Exception: one arm's trouble
    never stops the others). Returns the exit status: 1 when any arm failed or was odd, else 0;
    those arms are named on stderr at the end."""
    bad = []
    for arm in arms_to_run(a):
        try:
            line = run_one(arm)
        except ArmOdd as e:
            line = f"{arm}: ODD: {e} (its JSON is in {a.out})"
            bad.append(arm)
        except ArmFailed as e:
            line = f"{arm}: FAILED: {e}"
            bad.append(arm)
        except Exception as e:  # the arm's own setup: its text, its policy, its files
            line = f"{arm}: FAILED: {type(e).__name__}: {e}"
            bad.append(arm)
        print(line, flush=True)
    if bad:
        print(f"{len(bad)} arm(s) failed or odd: {','.join(bad)}", file=sys.stderr, flush=True)
    return 1 if bad else 0
