# Checks of the long-session generator (no GPU, a few seconds): the committed eval file is what
# its seeds generate, every recorded answer span holds its answer at the recorded distance, and
# the checks catch a moved span, a wrong distance and an edited text.
import copy, json, os, random, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import longtrace as L

EVAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval-dev-long.jsonl")


def expect(ok, what):
    print(("ok  " if ok else "FAIL ") + what)
    return ok


def broken_copies(row):
    """(what, row) pairs, each with one recorded fact made wrong."""
    q = row["questions"][0]
    moved = copy.deepcopy(row); moved["questions"][0]["char_start"] += 1
    far = copy.deepcopy(row); far["questions"][0]["distance"] = q["distance"] + 1
    edited = copy.deepcopy(row)
    src = row["turn_starts"][q["source_turn"]]
    edited["text"] = edited["text"][:src] + q["answer"] + edited["text"][src:]  # a second copy before
    return [("moved span", moved), ("wrong distance", far), ("repeated answer", edited)]


def main():
    ok = expect(L.check(EVAL) == [], "eval-dev-long.jsonl regenerates from its seeds, spans valid")
    row = json.loads(open(EVAL).readline())
    for what, bad in broken_copies(row):
        q = bad["questions"][0]
        ok &= expect(L.answer_problems(bad["text"], bad["turn_starts"], q) != [], f"check catches a {what}")
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        lines = open(EVAL).read().splitlines(True)
        f.write("".join(lines[:2]).replace('"n_turns": ', '"n_turns": 1', 1))
    ok &= expect(any("not what eval_set" in p for p in L.check(f.name)), "check catches an edited file")
    os.unlink(f.name)
    s = L.session(random.Random(L.TRAIN_SEED.format(0)))
    ok &= expect(s["text"] not in {json.loads(x)["text"] for x in lines}, "a training seed is no eval trace")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
