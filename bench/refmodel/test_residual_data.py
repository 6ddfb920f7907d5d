# Checks of the intent residual's data and weights code, without torch: rows read back as
# written, labels take the top of each request, the split keeps sessions whole, pairs are one
# positive and one negative of a request, the window's positions dropped, folding the
# standardization into the first layer gives the same residual, the pairwise accuracy on
# hand-computed cases, the document kvmix reads (its fields and sizes), and the question labels
# (a fact's token positions as the runners count them, labels only for questions answered later)
# and their weights when every question counts once.
import math, os, random, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus
import residual_data as R


def expect(ok, what):
    print(("ok  " if ok else "FAIL ") + what)
    return ok


def write_rows(path, rows):
    with open(path, "w") as f:
        f.write(",".join(R.HEADER) + "\n")
        for text, request, position, features, target in rows:
            f.write(",".join(str(x) for x in [text, request, position] + features + [target]) + "\n")


def check_rows(tmp):
    rng = random.Random(3)
    rows = [(t, q, p, [rng.uniform(-1, 1) for _ in R.FEATURES], rng.uniform(0, 5))
            for t in range(3) for q in range(2) for p in range(10)]
    path = os.path.join(tmp, "rows.csv")
    write_rows(path, rows)
    got = R.read_rows(path)
    ok = expect(sorted(got) == [(t, q) for t in range(3) for q in range(2)], "requests grouped")
    ok &= expect(all(len(v) == 10 for v in got.values()), "every row read")
    first = got[(0, 0)][0]
    ok &= expect(first[0] == 0 and first[1] == rows[0][3] and first[2] == rows[0][4],
                 "a row's position, features and target read back")
    with open(path, "a") as f:
        f.write("1,2,3\n")
    ok &= expect(refused(path), "a short line is refused")
    with open(path, "w") as f:
        f.write("text,request,position,rule\n")
    ok &= expect(refused(path), "another header is refused")
    return ok


def refused(path):
    """Whether read_rows refuses the file with a ValueError."""
    try:
        R.read_rows(path)
    except ValueError:
        return True
    return False


def check_labels_split_pairs():
    rows = [(p, [0.0] * len(R.FEATURES), float(p)) for p in range(20)]
    y = R.labels(rows, 0.9)
    ok = expect(y == [0] * 18 + [1, 1], "labels: the top tenth of the request's targets")
    zero = [(p, [0.0] * len(R.FEATURES), 0.0) for p in range(5)]
    ok &= expect(R.labels(zero, 0.9) == [0] * 5, "labels: no attention, no positive")
    keys = [(t, q) for t in range(10) for q in range(3)]
    train, held = R.split_texts(keys, 0.2, 7)
    ok &= expect(len({t for t, _ in held}) == 2 and not ({t for t, _ in train} & {t for t, _ in held}),
                 "split: two texts of ten held out whole")
    ok &= expect(R.split_texts(keys, 0.2, 7) == (train, held), "split: the same for a seed")
    p = R.pairs(y, random.Random(1))
    ok &= expect(len(p) == 2 and all(y[i] == 1 and y[j] == 0 for i, j in p),
                 "pairs: each positive with a negative")
    ok &= expect(R.pairs([1, 1], random.Random(1)) == [], "pairs: none without a negative")
    age = R.FEATURES.index("log_age")
    aged = lambda back: [math.log1p(back) if k == age else 0.0 for k in range(len(R.FEATURES))]
    requests = {(0, 0): [(p, aged(99 - p), 1.0) for p in range(100)],
                (0, 1): [(p, aged(9 - p), 1.0) for p in range(10)]}
    kept = R.drop_recent(requests, 64)
    ok &= expect(list(kept) == [(0, 0)] and [r[0] for r in kept[(0, 0)]] == list(range(36)),
                 "drop_recent: positions 64 and more back kept, a request left empty dropped")
    return ok


def check_fold():
    rng = random.Random(5)
    # features 11 and 12 constant: one far from 0 (whose variance rounds to a tiny number), one 0
    feats = [[rng.gauss(3, 2) if k < 11 else (12345.678 if k == 11 else 0.0)
              for k in range(len(R.FEATURES))] for _ in range(50)]
    mean, std = R.standardization(feats)
    ok = expect(math.isinf(std[11]) and math.isinf(std[12]) and
                abs(mean[0] - sum(f[0] for f in feats) / 50) < 1e-12,
                "standardization: means, constant features' std inf")
    w1 = [[rng.gauss(0, 1) for _ in R.FEATURES] for _ in range(4)]
    b1 = [rng.gauss(0, 1) for _ in range(4)]
    w2 = [rng.gauss(0, 1) for _ in range(4)]
    fw1, fb1 = R.fold(w1, b1, mean, std)
    worst = 0.0
    for f in feats:
        z = [(f[k] - mean[k]) / std[k] for k in range(len(R.FEATURES))]
        worst = max(worst, abs(R.residual(w1, b1, w2, 0.3, z) - R.residual(fw1, fb1, w2, 0.3, f)))
    ok &= expect(worst < 1e-9, f"fold: the same residual on raw features (worst {worst:.1e})")
    ok &= expect(all(row[11] == 0.0 and row[12] == 0.0 for row in fw1) and
                 all(math.isfinite(b) for b in fb1), "fold: constant features' weights 0")
    ok &= expect(abs(R.gelu(1.0) - 0.8413447460685429) < 1e-12 and R.gelu(0.0) == 0.0,
                 "gelu: the exact form")
    return ok


def check_accuracy_and_document():
    scores = {(0, 0): [0.9, 0.1, 0.5, 0.5], (0, 1): [1.0, 2.0]}
    lab = {(0, 0): [1, 0, 1, 0], (0, 1): [0, 0]}
    # request (0, 0): positives 0.9, 0.5 against negatives 0.1, 0.5: 1 + 1 + 1 + 0.5 of 4
    ok = expect(R.pairwise_accuracy(scores, lab) == 3.5 / 4, "pairwise accuracy, ties half")
    ok &= expect(math.isnan(R.pairwise_accuracy({(0, 1): [1.0]}, {(0, 1): [1]})),
                 "pairwise accuracy: no pairs, NaN")
    # weighted: positive 0.9 (both pairs right) weighs 3, positive 0.5 (1.5 of 2) weighs 1
    weights = {(0, 0): [3.0, 1.0, 1.0, 1.0], (0, 1): [1.0, 1.0]}
    ok &= expect(R.pairwise_accuracy(scores, lab, weights) == (3 * 2 + 1.5) / (3 * 2 + 2),
                 "pairwise accuracy: a positive's pairs count its weight")
    doc = R.document([[0.0] * len(R.FEATURES)] * 2, [0.0, 0.0], [0.0, 0.0], 0.0, 1.0, 4.0, "x")
    ok &= expect(doc["version"] == 1 and doc["hidden"] == 2 and doc["features"] == R.FEATURES and
                 len(doc["w1"][0]) == 13 and doc["alpha_max"] == 4.0, "document: fields and sizes")
    return ok


def check_question_labels():
    text = ("<|im_start|>user\nread the log<|im_end|>\n<|im_start|>tool\nport 48213 open<|im_end|>\n"
            "<|im_start|>user\nwhich port?<|im_end|>\n<|im_start|>assistant\n48213<|im_end|>\n")
    answer_at = text.rfind("48213")
    record = {"text": text, "questions": [
        {"answer": "48213", "token_start": len(corpus.encode(text[:answer_at]))}]}
    spans = R.fact_spans(record, corpus.encode)
    ids = [corpus.EOT] + corpus.encode(text)  # as the runners hold it: <|endoftext|> first
    first, stop, answered = spans[0]
    ok = expect(len(spans) == 1 and ids[first:stop] == list(b"48213") and
                ids[answered:answered + 5] == list(b"48213") and first < answered,
                "fact spans: the fact's and the answer's positions as the runners count them")
    # a request whose rows end before the answer: the fact's positions positive; one whose rows
    # reach past it (the question answered already): none
    rows = [(p, [0.0] * len(R.FEATURES), 0.0) for p in range(answered - 4)]
    labels = R.question_labels(rows, spans, R.request_ends({(0, 0): rows})[(0, 0)])
    ok &= expect(labels == [1 if first <= p < stop else 0 for p, _, _ in rows] and sum(labels) == 5,
                 "question labels: the fact of a question answered later")
    ok &= expect(sum(R.question_labels(rows, spans, answered + 1)) == 0,
                 "question labels: none for a question answered before the request's end")
    # three requests of the text: one ending before the fact, two holding it before the answer
    # (the fact's positions weigh 1/2 in each), one ending after the answer (no label)
    ends = [first, first + 6, answered - 4, answered + 1]
    w = R.question_weights(rows, spans, answered - 4, ends)
    ok &= expect(w == [0.5 if first <= p < stop else 1.0 for p, _, _ in rows],
                 "question weights: a fact's positions share one question among its requests")
    ok &= expect(R.question_weights(rows, spans, answered + 1, ends) == [1.0] * len(rows),
                 "question weights: 1 where no later question labels a position")
    return ok


def main():
    with tempfile.TemporaryDirectory() as tmp:
        ok = check_rows(tmp)
    ok &= check_labels_split_pairs()
    ok &= check_fold()
    ok &= check_accuracy_and_document()
    ok &= check_question_labels()
    print("residual data: all checks passed" if ok else "residual data: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
