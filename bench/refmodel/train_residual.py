"""Trains the intent residual (IntentKV's second phase, kvmix.h "Intent residual") on rows of the
tune half and writes its weights document (examples/intent_residual_json.h).

The rows: the GPU runner with the intent rule and no eviction (budget 1: every position stays,
so later prompts can attend to all of them) over the tune half, writing every position's
features and the attention the later requests' prompts gave it:

    build/kvmix-eval-cuda --model models/kvm-long.safetensors \\
        --data bench/refmodel/eval-dev-long.jsonl --kind trace --offset 0 --limit 100 \\
        --batch 100 --policy examples/policies/fp16-intent-rows.json \\
        --tag-spec examples/specs/kvm-byte.json --residual-rows rows.csv --residual-rows-rate 0.05

(fp16-intent-rows: the intent scorer as the study's intent arms use it, budget 1.) Then

    python3 bench/refmodel/train_residual.py --rows rows.csv --out weights.json

A position is positive when its target is among the top (1 - quantile) of its request's
(residual_data.labels), or, with --labels questions --data TRACES (the file the rows came from,
--data-offset its first text), when it holds the fact of a question answered after its request
(residual_data.question_labels): what the study's questions will ask for, not what later
prompts attend to. A fact asked for d turns on is a positive of about d requests, so the
questions far back carry most of the pairs; --weigh questions gives each pair of a fact's
position the weight 1 / the requests that label it (residual_data.question_weights), every
question once in all, in the loss and the held-out accuracy. The model: features standardized
on the training texts, Linear(13, H), GELU, Linear(H, 1) whose weight and bias start at zero,
times a learned alpha; the score the pruner ranks by is rule + alpha * r. It trains on pairs of
a positive and a negative of one request (a logistic loss on beta * (score_pos - score_neg),
beta > 0 learned), so only the order within a request matters, as in kvmix_evict_select. The
held-out texts (--holdout of them) choose the epoch by their pairwise accuracy; the rule alone
is the floor printed beside it, and the document is written only when the residual beats it
there (--force writes it anyway). The standardization is folded into w1 and b1
(residual_data.fold), alpha_max is --alpha-max.
"""
import argparse
import json
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus  # noqa: E402
import residual_data as R  # noqa: E402


class Residual(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.l1 = torch.nn.Linear(len(R.FEATURES), hidden)
        self.l2 = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.l2.weight)  # day zero: the rule
        torch.nn.init.zeros_(self.l2.bias)
        self.alpha = torch.nn.Parameter(torch.tensor(1.0))
        self.log_beta = torch.nn.Parameter(torch.tensor(0.0))

    def forward(self, rule, z):
        """rule + alpha * r for raw rules and standardized features z."""
        r = self.l2(torch.nn.functional.gelu(self.l1(z))).squeeze(-1)
        return rule + self.alpha * r


def tensors(data, keys, mean, std, label, weight, device):
    """Per key (offset, count) into the stacked rows, rules, standardized features, labels
    (label(key, rows)) and the labels' weights (weight(key, rows))."""
    rules, feats, labels, weights, spans = [], [], [], [], {}
    for key in keys:
        rows = data[key]
        spans[key] = (len(rules), len(rows))
        labels += label(key, rows)
        weights += weight(key, rows)
        for _, f, _ in rows:
            rules.append(f[0])
            feats.append([(f[k] - mean[k]) / std[k] for k in range(len(R.FEATURES))])
    as_tensor = lambda x: torch.tensor(x, dtype=torch.float32, device=device)
    return (spans, as_tensor(rules), as_tensor(feats).reshape(-1, len(R.FEATURES)), labels,
            weights)


def label_and_weight(a, raw):
    """(label(key, rows), weight(key, rows)): labels by attention (--quantile) or by the traces'
    questions (--data, read once for both); weights 1 a row, or with --weigh questions every
    question once in all."""
    ones = lambda key, rows: [1.0] * len(rows)
    if a.labels == "attention":
        return (lambda key, rows: R.labels(rows, a.quantile)), ones
    with open(a.data) as f:
        records = [json.loads(line) for line in f if line.strip()]
    facts = R.question_facts(raw, records, a.data_offset, corpus.encode)
    return R.question_labeler(facts), (ones if a.weigh == "positions" else
                                       R.question_weigher(facts))


def epoch_pairs(spans, labels, rng):
    """Index pairs (positive, negative) over the stacked rows, one per positive."""
    out = []
    for key, (start, n) in spans.items():
        out += [(start + i, start + j) for i, j in R.pairs(labels[start:start + n], rng)]
    rng.shuffle(out)
    return out


def held_out_accuracy(model, spans, rules, feats, labels, weights, with_residual):
    with torch.no_grad():
        scores = model(rules, feats) if with_residual else rules
    scores = scores.cpu().tolist()
    part = lambda x: {k: x[s:s + n] for k, (s, n) in spans.items()}
    return R.pairwise_accuracy(part(scores), part(labels), part(weights))


def export(model, mean, std, alpha_max, description):
    w1 = model.l1.weight.detach().cpu().double().tolist()
    b1 = model.l1.bias.detach().cpu().double().tolist()
    fw1, fb1 = R.fold(w1, b1, mean, std)
    w2 = model.l2.weight.detach().cpu().double()[0].tolist()
    return R.document(fw1, fb1, w2, float(model.l2.bias.item()), float(model.alpha.item()),
                      alpha_max, description)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--quantile", type=float, default=0.9)
    ap.add_argument("--holdout", type=float, default=0.2)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--alpha-max", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-age", type=int, default=64,
                    help="drop positions this close to the newest: the policy's window keeps them")
    ap.add_argument("--labels", choices=("attention", "questions"), default="attention")
    ap.add_argument("--data", help="with --labels questions: the traces the rows came from")
    ap.add_argument("--data-offset", type=int, default=0, help="the rows' text 0 in --data")
    ap.add_argument("--weigh", choices=("positions", "questions"), default="positions",
                    help="questions: a fact's pairs weigh 1 / the requests that label it "
                    "(residual_data.question_weights), so each question counts once")
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    if a.labels == "questions" and not a.data:
        ap.error("--labels questions needs --data")
    if a.weigh == "questions" and a.labels != "questions":
        ap.error("--weigh questions needs --labels questions")
    if not 1 <= a.hidden <= 256:  # KVMIX_INTENT_RESIDUAL_MAX_HIDDEN
        ap.error("--hidden must be 1..256")
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    raw = R.read_rows(a.rows)
    label, weight = label_and_weight(a, raw)
    data = R.drop_recent(raw, a.min_age)
    train_keys, held_keys = R.split_texts(list(data), a.holdout, a.seed)
    if not train_keys or not held_keys:
        print(f"{a.rows}: {len(train_keys)} requests to train on, {len(held_keys)} held out: "
              "too few")
        return 1
    mean, std = R.standardization([f for k in train_keys for _, f, _ in data[k]])
    train = tensors(data, train_keys, mean, std, label, weight, device)
    held = tensors(data, held_keys, mean, std, label, weight, device)
    print(f"rows {sum(len(v) for v in data.values())}, requests {len(train_keys)} train / "
          f"{len(held_keys)} held out, positives {sum(train[3])} / {sum(held[3])}, "
          f"device {device}", flush=True)
    model = Residual(a.hidden).to(device)
    floor = held_out_accuracy(model, *held, False)
    print(f"held-out pairwise accuracy, the rule alone: {floor:.4f}", flush=True)
    if math.isnan(floor):
        print("no held-out request has both a positive and a negative: cannot choose an epoch")
        return 1
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    best, best_state, best_epoch = -1.0, None, 0
    for epoch in range(1, a.epochs + 1):
        pair_list = epoch_pairs(train[0], train[3], rng)
        if not pair_list:
            print("no request has both a positive and a negative: nothing to train on")
            return 1
        pairs = torch.tensor(pair_list, device=device)
        pair_weights = torch.tensor([train[4][i] for i, _ in pair_list], device=device)
        total = 0.0
        for start in range(0, len(pairs), a.batch):
            p, w = pairs[start:start + a.batch], pair_weights[start:start + a.batch]
            idx = torch.cat([p[:, 0], p[:, 1]])
            s = model(train[1][idx], train[2][idx])
            margin = s[:len(p)] - s[len(p):]
            pair_loss = torch.nn.functional.softplus(-torch.exp(model.log_beta) * margin)
            # positions: the plain mean, so the weights of earlier runs train again bit for bit
            loss = (pair_loss.mean() if a.weigh == "positions" else
                    (w * pair_loss).sum() / w.sum())
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():  # the inference clip
                model.alpha.clamp_(-a.alpha_max, a.alpha_max)
            total += loss.item() * len(p)
        acc = held_out_accuracy(model, *held, True)
        print(f"epoch {epoch}: train loss {total / max(1, len(pairs)):.4f}, held-out pairwise "
              f"accuracy {acc:.4f} (rule {floor:.4f})", flush=True)
        if acc > best:
            best, best_epoch = acc, epoch
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if best_state is None:
        print("the held-out accuracy was never a number")
        return 1
    model.load_state_dict(best_state)
    print(f"best: epoch {best_epoch}, held-out pairwise accuracy {best:.4f} against the rule's "
          f"{floor:.4f}", flush=True)
    if best <= floor and not a.force:
        print("the residual does not beat the rule on the held-out texts: no document written")
        return 1
    labels = f"quantile {a.quantile}" if a.labels == "attention" else "question labels"
    if a.weigh == "questions":
        labels += ", each question once"
    description = (f"train_residual.py on {os.path.basename(a.rows)}: hidden {a.hidden}, "
                   f"{labels}, epoch {best_epoch}, held-out pairwise accuracy "
                   f"{best:.4f} (rule {floor:.4f})")
    with open(a.out, "w") as f:
        json.dump(export(model, mean, std, a.alpha_max, description), f, allow_nan=False)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
