"""The intent residual's training data and weights, without torch (train_residual.py trains).

Rows come from `kvmix-eval --residual-rows` (examples/kvmix_eval.c): a CSV header, then per
position of each request that a later one followed "text, request, position, the 13 features
(kvmix_intent_residual_feature_name, in order), target", target being the attention the later
requests' prompts gave the position. Here: reading them grouped by request, a position's label
(its target among the top of its request's, or, from the traces' questions, whether it holds a
fact a question answered later asks for), a split of the texts, pairs of a positive and a
negative of one request, feature standardization folded into the first layer, the residual's
forward pass as kvmix computes it, the pairwise accuracy of scores within requests, and the
weights document examples/intent_residual_json.h reads.
"""
import csv
import math
import random

FEATURES = ["rule", "log_age", "log_turns_back", "role_instruction", "role_user",
            "role_assistant", "role_reasoning", "role_tool_call", "role_observation",
            "role_scaffold", "image", "key_norm", "readout"]
HEADER = ["text", "request", "position"] + FEATURES + ["target"]


def read_rows(path):
    """{(text, request): [(position, features, target), ...]} in file order. ValueError for a
    header that is not HEADER or a line of another width."""
    requests = {}
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header != HEADER:
            raise ValueError(f"{path}: header {header}, wanted {HEADER}")
        for line_number, row in enumerate(reader, start=2):
            if len(row) != len(HEADER):
                raise ValueError(f"{path}:{line_number}: {len(row)} fields, wanted {len(HEADER)}")
            key = (int(row[0]), int(row[1]))
            features = [float(x) for x in row[3:3 + len(FEATURES)]]
            requests.setdefault(key, []).append((int(row[2]), features, float(row[-1])))
    return requests


def drop_recent(requests, min_age):
    """The rows of positions at least min_age back from their request's newest: the policy's
    window keeps the nearer ones whatever they score. Ages are whole, so the cut lies half a
    position below (log_age, written as a float, may round below log(1 + min_age)). A request
    left with no row is dropped."""
    floor = math.log1p(min_age - 0.5)
    age = FEATURES.index("log_age")
    kept = {key: [r for r in rows if r[1][age] >= floor] for key, rows in requests.items()}
    return {key: rows for key, rows in kept.items() if rows}


def labels(rows, quantile):
    """1 for a position whose target is positive and at least the request's quantile-th target
    (quantile 0.9: about the top tenth), else 0."""
    targets = sorted(target for _, _, target in rows)
    threshold = targets[min(len(targets) - 1, int(quantile * len(targets)))]
    return [1 if target > 0.0 and target >= threshold else 0 for _, _, target in rows]


def request_ends(requests):
    """{(text, request): one past its newest position}, from rows before drop_recent (the rows
    are a sample of the positions: the newest sampled one, which lies in the request's own
    prompt, where no answer is)."""
    return {key: max(p for p, _, _ in rows) + 1 for key, rows in requests.items()}


def fact_spans(record, encode):
    """Per question of a long trace (longtrace.py's fields) (first, end, answered): token
    positions as the runners count them (<|endoftext|> at 0, so one past the encoding's) of the
    fact where its answer first occurs (its source turn, as longtrace.py checks) and of the
    answer the question's reply gives."""
    text, out = record["text"], []
    for q in record["questions"]:
        first = len(encode(text[:text.find(q["answer"])])) + 1
        out.append((first, first + len(encode(q["answer"])), q["token_start"] + 1))
    return out


def question_labels(rows, spans, end):
    """1 for a position inside the fact of a question answered at or after `end` (the request's:
    its own question included, which the eviction at its prompt must keep the fact for), else 0."""
    later = [(first, stop) for first, stop, answered in spans if answered >= end]
    return [1 if any(first <= p < stop for first, stop in later) else 0 for p, _, _ in rows]


def question_weights(rows, spans, end, text_ends):
    """Per row the weight of its label when every question counts once in all: a position of
    the fact of a question answered at or after `end` weighs 1 / n, n the requests of its text
    (their ends: text_ends) whose rows hold the fact's first position before the answer (first
    < end <= answered), summed over such questions; any other position weighs 1. Unweighted, a
    fact asked for 30 turns on is a positive of about 30 requests, one asked for at the next
    turn of one."""
    later = [(first, stop, sum(1 for e in text_ends if first < e <= answered))
             for first, stop, answered in spans if answered >= end]
    out = []
    for p, _, _ in rows:
        w = sum(1.0 / n for first, stop, n in later if first <= p < stop and n > 0)
        out.append(w if w > 0.0 else 1.0)
    return out


def question_facts(raw, records, offset, encode):
    """(request ends, spans(text)), what question_labeler and question_weigher read: records the
    traces the rows came from (their text 0 at records[offset]), raw the rows before
    drop_recent (for request_ends); each text's fact_spans found once."""
    ends, found = request_ends(raw), {}

    def spans(text):
        if text not in found:
            found[text] = fact_spans(records[offset + text], encode)
        return found[text]
    return ends, spans


def question_labeler(facts):
    """label(key, rows) by the traces' questions (question_labels over question_facts)."""
    ends, spans = facts
    return lambda key, rows: question_labels(rows, spans(key[0]), ends[key])


def question_weigher(facts):
    """weight(key, rows): question_weights over question_facts."""
    ends, spans = facts
    by_text = {}
    for (text, _), end in ends.items():
        by_text.setdefault(text, []).append(end)
    return lambda key, rows: question_weights(rows, spans(key[0]), ends[key], by_text[key[0]])


def split_texts(keys, holdout, seed):
    """(train keys, held-out keys): the texts shuffled by seed, the last share `holdout` of them
    held out whole, so no session is on both sides."""
    texts = sorted({text for text, _ in keys})
    random.Random(seed).shuffle(texts)
    n_held = max(1, round(holdout * len(texts))) if len(texts) > 1 else 0
    held = set(texts[len(texts) - n_held:])
    train = [k for k in sorted(keys) if k[0] not in held]
    return train, [k for k in sorted(keys) if k[0] in held]


def pairs(label_list, rng):
    """(positive, negative) index pairs of one request: each positive with one negative drawn
    at random; none when either side is empty."""
    positives = [i for i, y in enumerate(label_list) if y]
    negatives = [i for i, y in enumerate(label_list) if not y]
    if not positives or not negatives:
        return []
    return [(i, rng.choice(negatives)) for i in positives]


def standardization(feature_rows):
    """(mean, std) per feature over the rows; a constant feature (one value on every row) gets
    std inf: standardized to 0 on every row, so the trained layer never reads it and its folded
    weights are 0 (a feature the rows lacked cannot move the residual where a runner gives it)."""
    n = len(feature_rows)
    mean = [sum(f[k] for f in feature_rows) / n for k in range(len(FEATURES))]
    std = []
    for k in range(len(FEATURES)):
        var = sum((f[k] - mean[k]) ** 2 for f in feature_rows) / n
        constant = all(f[k] == feature_rows[0][k] for f in feature_rows)
        std.append(math.inf if constant else math.sqrt(var))
    return mean, std


def fold(w1, b1, mean, std):
    """The first layer on raw features from one trained on standardized ones:
    w1 (x - mean) / std + b1 = (w1 / std) x + (b1 - w1 . mean / std)."""
    w = [[w1[j][k] / std[k] for k in range(len(FEATURES))] for j in range(len(w1))]
    b = [b1[j] - sum(w1[j][k] * mean[k] / std[k] for k in range(len(FEATURES)))
         for j in range(len(w1))]
    return w, b


def gelu(x):
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def residual(w1, b1, w2, b2, features):
    """The residual r of one position, as kvmix_intent_residual_scores computes it (before
    alpha): b2 + sum_j w2[j] gelu(b1[j] + sum_k w1[j][k] f[k])."""
    return b2 + sum(w2[j] * gelu(b1[j] + sum(w1[j][k] * features[k]
                                             for k in range(len(FEATURES))))
                    for j in range(len(w1)))


def pairwise_accuracy(scores_by_request, labels_by_request, weights_by_request=None):
    """The share of (positive, negative) pairs within one request that the scores order right,
    ties counting half, over every request with both: an AUC pooled over requests. With
    weights (per row, as labels), a positive's pairs count its weight."""
    right = total = 0.0
    for key, scores in scores_by_request.items():
        label_list = labels_by_request[key]
        weights = weights_by_request[key] if weights_by_request else [1.0] * len(scores)
        pos = sorted((s, w) for s, y, w in zip(scores, label_list, weights) if y)
        neg = sorted(s for s, y in zip(scores, label_list) if not y)
        if not pos or not neg:
            continue
        i = 0  # negatives below the current positive, by a merge
        for p, w in pos:
            while i < len(neg) and neg[i] < p:
                i += 1
            j = i
            while j < len(neg) and neg[j] == p:
                j += 1
            right += w * (i + 0.5 * (j - i))
            total += w * len(neg)
    return right / total if total else float("nan")


def document(w1, b1, w2, b2, alpha, alpha_max, description):
    """The weights document (examples/intent_residual_json.h, version 1)."""
    return {"version": 1, "description": description[:255], "features": FEATURES,
            "hidden": len(w1), "w1": [list(map(float, row)) for row in w1],
            "b1": list(map(float, b1)), "w2": list(map(float, w2)), "b2": float(b2),
            "alpha": float(alpha), "alpha_max": float(alpha_max)}
