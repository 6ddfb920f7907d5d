"""How well fixed combinations of the intent residual's features rank the facts later questions
ask for, on rows of `kvmix-eval --residual-rows` (no training, no torch): the pairwise accuracy
(residual_data.pairwise_accuracy) of each ranking against the question labels
(residual_data.question_labels), positions within --min-age of the request's newest dropped as
train_residual.py drops them. It says whether a feature carries what the residual could learn
before a training run is spent on it.

    python3 bench/refmodel/feature_signal.py --rows rows.csv \\
        --data bench/refmodel/eval-dev-long.jsonl [--data-offset 0] [--min-age 64]

The rankings: the rule; recency (-log_age); recency + 1 for an observation (the tag that holds
most facts); and that with z-scored key_norm or readout (over the rows) subtracted, at a few
weights, then per text the last of those against recency + observation.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import residual_data as R  # noqa: E402

COLUMN = {name: i for i, name in enumerate(R.FEATURES)}


def labelled(rows_path, data, offset, min_age):
    """({(text, request): rows}, {(text, request): labels}) of the rows past min_age."""
    raw = R.read_rows(rows_path)
    requests = R.drop_recent(raw, min_age)
    with open(data) as f:
        records = [json.loads(line) for line in f if line.strip()]
    label = R.question_labeler(R.question_facts(raw, records, offset, corpus.encode))
    return requests, {key: label(key, rows) for key, rows in requests.items()}


def z_scorer(requests, name):
    """f -> the feature `name` of f standardized over every row."""
    values = [f[COLUMN[name]] for rows in requests.values() for _, f, _ in rows]
    mean, std = statistics.fmean(values), statistics.pstdev(values) or 1.0
    return lambda f: (f[COLUMN[name]] - mean) / std


def accuracy(requests, labels, score):
    return R.pairwise_accuracy({k: [score(f) for _, f, _ in rows] for k, rows in requests.items()},
                               labels)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--data-offset", type=int, default=0)
    ap.add_argument("--min-age", type=int, default=64)
    a = ap.parse_args()
    requests, labels = labelled(a.rows, a.data, a.data_offset, a.min_age)
    print(f"rows {sum(len(r) for r in requests.values())}, requests {len(requests)}, "
          f"texts {len({k[0] for k in requests})}, facts {sum(sum(v) for v in labels.values())}")
    key_norm, readout = z_scorer(requests, "key_norm"), z_scorer(requests, "readout")

    def recency_obs(f):
        return -f[COLUMN["log_age"]] + f[COLUMN["role_observation"]]

    rankings = [("rule", lambda f: f[COLUMN["rule"]]),
                ("recency", lambda f: -f[COLUMN["log_age"]]),
                ("recency + observation", recency_obs)]
    for w in (0.3, 0.5, 1.0, 2.0):
        rankings.append((f"recency + observation - {w} z(readout)",
                         lambda f, w=w: recency_obs(f) - w * readout(f)))
        rankings.append((f"recency + observation - {w} z(key_norm)",
                         lambda f, w=w: recency_obs(f) - w * key_norm(f)))
    rankings.append(("recency + observation - z(readout) - 0.5 z(key_norm)",
                     lambda f: recency_obs(f) - readout(f) - 0.5 * key_norm(f)))
    print("| ranking | pairwise accuracy |\n|---|---|")
    for name, score in rankings:
        print(f"| {name} | {accuracy(requests, labels, score):.4f} |")
    print("\n| text | recency + observation | - z(readout) - 0.5 z(key_norm) |\n|---|---|---|")
    for text in sorted({k[0] for k in requests}):
        mine = {k: v for k, v in requests.items() if k[0] == text}
        both = accuracy(mine, labels, lambda f: recency_obs(f) - readout(f) - 0.5 * key_norm(f))
        print(f"| {a.data_offset + text} | {accuracy(mine, labels, recency_obs):.4f} | "
              f"{both:.4f} |")


if __name__ == "__main__":
    main()
