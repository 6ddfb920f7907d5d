# Long agent sessions for kvm-long and for telling cache policies apart: 10-40 user turns,
# 8000-16000 tokens (bytes + the reference models' special tokens), in the ChatML form of
# ../../../shared/data/eval-dev.jsonl. Work turns bring random facts (tool outputs: inventory
# records, database rows, config files, long logs with one ERROR line; user-given constraints);
# question turns (user message "Earlier ...") ask for one fact introduced 1, 3, 10 or 30 turns
# before. The assistant's reply is <think> that names where to look (never the value), then the
# value alone, so only a model that still attends to the source turn can copy it.
#
# Every value is drawn at random with enough entropy that it cannot be guessed, and a session is
# redrawn until each answer occurs exactly once before its reply, inside its source turn.
#
#   python3 longtrace.py eval [--out PATH] [--count N]   the evaluation set (seeds "eval-long-N")
#   python3 longtrace.py check PATH                      regenerate and compare; validate spans
#   python3 longtrace.py stats PATH                      turns, tokens, questions per distance
import argparse, hashlib, json, os, random, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import corpus as C

DISTANCES = (1, 3, 10, 30)
MIN_TOKENS, MAX_TOKENS = 8000, 16000  # 16000 + <|endoftext|> leaves room in a 16384 context
MIN_TURNS, MAX_TURNS = 10, 40
QUESTION_RATE = 0.4  # of the turns that have an earlier work turn at some distance
LONG_RATE = 0.8      # of the turns that can ask at distance 30: the rarest, so asked first
LONG_SESSIONS = 0.5  # sessions of more than 30 turns, the ones that can ask at distance 30
FACTS_ASKED = 2      # questions a work turn answers at most (each work turn holds 2 facts or more)
EVAL_COUNT = 200
EVAL_SEED = "eval-long-{}"    # the eval set: trace i from random.Random(EVAL_SEED.format(i))
TRAIN_SEED = "train-long-{}"  # the training stream: never one of the eval seeds

TOOLS = [
    {"name": "query_inventory", "description": "List the hosts of a cluster.",
     "parameters": {"cluster": "string"}},
    {"name": "query_db", "description": "Run a read-only SQL query.",
     "parameters": {"sql": "string"}},
    {"name": "read_file", "description": "Return the contents of a file.",
     "parameters": {"path": "string"}},
    {"name": "fetch_logs", "description": "Return the latest log lines of a service.",
     "parameters": {"service": "string", "lines": "integer"}},
]

CONSTRAINTS = [  # (label in the question, sentence template, value drawer name)
    ("ticket for this work", "Tag every commit with the ticket {}.", "ticket"),
    ("release branch", "Only push to the release branch rel/{}.", "name"),
    ("rate limit", "Keep the rollout under {} requests per minute.", "big"),
    ("on-call contact", "If anything breaks, page {}.", "person"),
    ("maintenance window", "The maintenance window opens at {} UTC.", "clock"),
    ("budget code", "Bill the compute to budget code {}.", "hexcode"),
    ("deploy region", "Deploy only to the region {}.", "region"),
    ("approval token", "Use the approval token {} when the deploy asks.", "token"),
]

CONFIG_KEYS = ["retry_limit", "cache_ttl_s", "queue_name", "pool_size", "api_key", "shard_seed",
               "owner", "flush_interval_ms", "bucket", "replica_zone", "max_batch", "timeout_ms",
               "log_sink", "secret_id", "admin", "spill_dir", "port", "heartbeat_ms", "salt",
               "mirror_host", "quota_units", "trace_id", "schema_rev", "lease_s"]

CONSONANTS, VOWELS = "bdfghklmnprstvz", "aeiou"


class Draw:
    """Random values for one session; every value is fresh (never drawn before in it)."""

    def __init__(self, rng):
        self.rng, self.used = rng, set()

    def fresh(self, make):
        while True:
            v = make()
            if v not in self.used:
                self.used.add(v)
                return v

    def word(self, syllables=2):
        r = self.rng
        return "".join(r.choice(CONSONANTS) + r.choice(VOWELS) for _ in range(syllables)) + r.choice(CONSONANTS)

    def name(self):
        return self.fresh(lambda: f"{self.word()}-{self.word()}-{self.rng.randint(10, 99)}")

    def person(self):
        return self.fresh(lambda: f"{self.word(1).capitalize()} {self.word(2).capitalize()}")

    def big(self):
        return self.fresh(lambda: str(self.rng.randint(10000, 99999)))

    def hexcode(self):
        return self.fresh(lambda: "".join(self.rng.choice("0123456789abcdef") for _ in range(8)))

    def ticket(self):
        up = "ABCDEFGHJKLMNPQRSTUVWXYZ"
        return self.fresh(lambda: "".join(self.rng.choice(up) for _ in range(3)) + f"-{self.rng.randint(1000, 9999)}")

    def ip(self):
        r = self.rng
        return self.fresh(lambda: f"10.{r.randint(0, 255)}.{r.randint(0, 255)}.{r.randint(1, 254)}")

    def clock(self):
        return self.fresh(lambda: f"{self.rng.randint(0, 23):02d}:{self.rng.randint(0, 59):02d}")

    def region(self):
        return self.fresh(lambda: f"{self.rng.choice(['eu', 'us', 'ap', 'sa'])}-{self.word(1)}-{self.rng.randint(1, 9)}")

    def token(self):
        al = "abcdefghjkmnpqrstuvwxyz23456789"
        return self.fresh(lambda: "".join(self.rng.choice(al) for _ in range(10)))

    def value(self):
        """A config value of a random type."""
        return getattr(self, self.rng.choice(["big", "hexcode", "name", "ip", "token"]))()


def msg(role, body):
    return f"<|im_start|>{role}\n{body}<|im_end|>\n"


def tool_call(name, args):
    call = json.dumps({"name": name, "arguments": args})
    return f"<tool_call>\n{call}\n</tool_call>"


def tool_round(ask, plan, name, args, body, seen, reply):
    """One tool round: the user asks, the assistant plans and calls the tool, the tool answers
    with body, the assistant notes what it saw and replies."""
    return (msg("user", ask)
            + msg("assistant", f"<think>\n{plan}\n</think>\n" + tool_call(name, args))
            + msg("tool", f"<tool_response>\n{body}\n</tool_response>")
            + msg("assistant", f"<think>\n{seen}\n</think>\n{reply}"))


# A work turn returns (text, facts); a fact is (question, think, value, kind).

def inventory_turn(d, size):
    cluster = d.name()
    hosts = []
    for _ in range(max(2, size // 95)):
        hosts.append({"host": d.name(), "ip": d.ip(), "port": int(d.big()), "build": d.hexcode()})
    body = "\n".join(json.dumps(h) for h in hosts)
    labels = {"ip": "IP address", "port": "port", "build": "build id"}
    facts = []
    for h in d.rng.sample(hosts, min(3, len(hosts))):
        field = d.rng.choice(list(labels))
        facts.append((f"Earlier the inventory of cluster {cluster} listed the host {h['host']}. "
                      f"What was its {labels[field]}?",
                      f"The {labels[field]} of {h['host']} is in that inventory output.",
                      str(h[field]), "tool_value"))
    text = tool_round(f"List the hosts of the cluster {cluster}.",
                      f"I will query the inventory of {cluster}.",
                      "query_inventory", {"cluster": cluster}, body,
                      f"The inventory lists {len(hosts)} hosts.",
                      f"The cluster {cluster} has {len(hosts)} hosts, each with an address, a port and a build.")
    return text, facts


def db_turn(d, size):
    table = d.rng.choice(["orders", "invoices", "shipments", "refunds"])
    region = d.region()
    rows = [(d.ticket(), d.person(), d.big()) for _ in range(max(2, size // 40))]
    sql = f"SELECT id, owner, amount FROM {table} WHERE region = '{region}'"
    body = "id | owner | amount\n" + "\n".join(f"{a} | {b} | {c}" for a, b, c in rows)
    facts = []
    for rid, owner, amount in d.rng.sample(rows, min(3, len(rows))):
        field, value = d.rng.choice([("owner", owner), ("amount", amount)])
        facts.append((f"Earlier the query of {table} in {region} returned the row {rid}. What was its {field}?",
                      f"The {field} of {rid} is in that query result.", value, "tool_value"))
    text = tool_round(f"How many {table} are there in {region}, and who owns them?",
                      f"A query of the {table} table will tell.", "query_db", {"sql": sql}, body,
                      f"The query returned {len(rows)} rows.",
                      f"There are {len(rows)} {table} in {region}; the table above lists their owners.")
    return text, facts


def file_turn(d, size):
    path = f"conf/{d.word()}/{d.word()}.ini"
    keys = d.rng.sample(CONFIG_KEYS, min(len(CONFIG_KEYS), max(3, size // 32)))
    pairs = [(k, d.value()) for k in keys]
    body = f"# {path}\n[{d.word()}]\n" + "\n".join(f"{k} = {v}" for k, v in pairs)
    facts = [(f"Earlier you read {path}. What value did it set for {k}?",
              f"{path} sets {k}; I will copy it from that file.", v, "file_value")
             for k, v in d.rng.sample(pairs, min(3, len(pairs)))]
    text = tool_round(f"Show me the settings in {path}.", f"I will read {path}.",
                      "read_file", {"path": path}, body, f"The file sets {len(pairs)} keys.",
                      f"{path} sets {len(pairs)} keys in one section.")
    return text, facts


def log_turn(d, size):
    """A long log with exactly one ERROR line: the needle."""
    service = d.name()
    n = max(8, size // 62)
    bad = d.rng.randrange(n)
    lines, facts = [], []
    for i in range(n):
        clock = f"{d.rng.randint(0, 23):02d}:{d.rng.randint(0, 59):02d}:{d.rng.randint(0, 59):02d}"
        job, worker = d.hexcode(), d.name()
        if i == bad:
            lines.append(f"{clock} ERROR job={job} worker={worker} failed: exit status {d.rng.randint(1, 255)}")
            facts = [(f"Earlier the log of {service} had one ERROR line. Which job id did it name?",
                      f"The ERROR line of the {service} log names the job.", job, "needle"),
                     (f"Earlier the log of {service} had one ERROR line. Which worker did it name?",
                      f"The ERROR line of the {service} log names the worker.", worker, "needle")]
        else:
            lines.append(f"{clock} INFO job={job} worker={worker} took {d.rng.randint(5, 999)}ms")
    text = tool_round(f"Fetch the recent logs of {service}.",
                      f"I will fetch {n} lines of the {service} log.",
                      "fetch_logs", {"service": service, "lines": n}, "\n".join(lines),
                      f"The log has {n} lines.", f"Fetched {n} lines of the {service} log.")
    return text, facts


def constraint_turn(d, unused):
    """The user states 2-3 constraints (each kind once a session); the reply does not repeat them."""
    picked = [unused.pop(d.rng.randrange(len(unused))) for _ in range(min(len(unused), d.rng.randint(2, 3)))]
    facts, sentences = [], []
    for label, template, drawer in picked:
        v = getattr(d, drawer)()
        sentences.append(template.format(v))
        facts.append((f"Earlier I told you the {label}. What was it?",
                      f"The user gave the {label} in an earlier message.", v, "constraint"))
    text = (msg("user", "Before you go on: " + " ".join(sentences))
            + msg("assistant", "<think>\nThe user set constraints for the rest of the work.\n</think>\n"
                  "Noted; I will keep to them."))
    return text, facts


WORK_TURNS = [(inventory_turn, 95 * 4), (db_turn, 40 * 6), (file_turn, 32 * 8), (log_turn, 62 * 30)]


def system_prompt():
    lines = ["You are an operations agent working across a long session.",
             "Call a tool by writing a JSON object inside <tool_call> tags.",
             "When asked about an earlier turn, answer with the exact value, copied.", "", "# Tools"]
    return "\n".join(lines + [json.dumps(t, separators=(", ", ": ")) for t in TOOLS])


def plan_roles(rng, n_turns):
    """Per turn: None (a work turn) or the distance of the question asked there."""
    roles, open_facts, asked = [], [], {d: 0 for d in DISTANCES}
    for t in range(n_turns):
        ok = [d for d in DISTANCES if t - d >= 0 and roles[t - d] is None and open_facts[t - d] > 0]
        if DISTANCES[-1] in ok and rng.random() < LONG_RATE:
            d = DISTANCES[-1]
        elif ok and rng.random() < QUESTION_RATE:
            d = min(ok, key=lambda d: (asked[d], -d))  # the distance asked least so far, longest first
        else:
            d = None
        if d is not None:
            roles.append(d); open_facts.append(0); asked[d] += 1; open_facts[t - d] -= 1
        else:
            roles.append(None); open_facts.append(FACTS_ASKED)
    return roles


def draft(rng, roles, scale):
    """One session's text, the char offset of each turn, and its questions (unvalidated)."""
    d = Draw(rng)
    text, starts, facts, questions = msg("system", system_prompt()), [], [], []
    unused = list(CONSTRAINTS)
    for t, role in enumerate(roles):
        starts.append(len(text))
        if role is None:
            if len(unused) >= FACTS_ASKED and rng.random() < 0.2:
                body, f = constraint_turn(d, unused)
            else:
                make, mean = rng.choice(WORK_TURNS)
                body, f = make(d, int(mean * scale * rng.uniform(0.5, 1.5)))
            text += body
            facts.append(f)
            continue
        source = t - role
        q, think, value, kind = facts[source].pop(rng.randrange(len(facts[source])))
        text += msg("user", q)
        head = f"<|im_start|>assistant\n<think>\n{think}\n</think>\n"
        questions.append({"turn": t, "source_turn": source, "distance": role, "kind": kind,
                          "answer": value, "char_start": len(text) + len(head)})
        text += head + value + "<|im_end|>\n"
        facts.append([])
    return text, starts, questions


def n_tokens(text):
    return len(C.encode(text))


def answer_problems(text, starts, q):
    """Why a question's answer is not determined by its context (empty list: it is)."""
    out = []
    a, s, e = q["answer"], q["char_start"], q["char_start"] + len(q["answer"])
    src_lo, src_hi = starts[q["source_turn"]], starts[q["source_turn"] + 1]
    if text[s:e] != a:
        out.append("span does not hold the answer")
    if text[:s].count(a) != 1:
        out.append(f"answer occurs {text[:s].count(a)} times before its reply")
    elif not src_lo <= text.find(a) < src_hi:
        out.append("answer first occurs outside its source turn")
    if q["turn"] - q["source_turn"] != q["distance"] or q["distance"] not in DISTANCES:
        out.append("distance is not turn - source_turn")
    if not starts[q["turn"]] < s < (starts[q["turn"] + 1] if q["turn"] + 1 < len(starts) else len(text)):
        out.append("answer outside its turn")
    return out


def session(rng):
    """One validated session: a dict with the eval-dev fields (kind, text) and the new ones."""
    long = rng.random() < LONG_SESSIONS
    n_turns = rng.randint(DISTANCES[-1] + 1, MAX_TURNS) if long else rng.randint(MIN_TURNS, DISTANCES[-1])
    roles = plan_roles(rng, n_turns)
    target = rng.uniform(MIN_TOKENS + 500, MAX_TOKENS - 500)
    scale = target / (250 * n_turns)
    while True:
        text, starts, questions = draft(rng, roles, scale)
        n = n_tokens(text)
        if n > MAX_TOKENS or n < MIN_TOKENS:
            scale *= target / n
            continue
        if any(answer_problems(text, starts, q) for q in questions):
            continue
        for q in questions:
            q["char_end"] = q["char_start"] + len(q["answer"])
            q["token_start"] = n_tokens(text[:q["char_start"]])  # + 1 in the runner (<|endoftext|> first)
            q["token_end"] = q["token_start"] + len(q["answer"])  # answers are ASCII: a token a byte
        return {"kind": "trace", "text": text, "n_turns": n_turns, "n_tokens": n,
                "turn_starts": starts, "questions": questions}


def eval_set(count=EVAL_COUNT):
    out = []
    for i in range(count):
        s = session(random.Random(EVAL_SEED.format(i)))
        out.append({"kind": s.pop("kind"), "split": "tune" if i < count // 2 else "report",
                    "seed": EVAL_SEED.format(i), "text": s.pop("text"), **s})
    return out


def dumps(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def check(path):
    """Problems of a committed eval file: differs from its regeneration, or a bad answer span."""
    data = open(path, "rb").read()
    rows = [json.loads(line) for line in data.decode().splitlines()]
    problems = []
    if hashlib.sha256(dumps(eval_set(len(rows))).encode()).digest() != hashlib.sha256(data).digest():
        problems.append(f"{path} is not what eval_set({len(rows)}) generates")
    for i, r in enumerate(rows):
        if not MIN_TOKENS <= n_tokens(r["text"]) == r["n_tokens"] <= MAX_TOKENS:
            problems.append(f"trace {i}: n_tokens")
        for q in r["questions"]:
            ids = C.encode(r["text"])[q["token_start"]:q["token_end"]]
            if bytes(ids) != q["answer"].encode():
                problems.append(f"trace {i} turn {q['turn']}: token span does not hold the answer")
            problems += [f"trace {i} turn {q['turn']}: {p}" for p in answer_problems(r["text"], r["turn_starts"], q)]
    return problems


def stats(path):
    rows = [json.loads(line) for line in open(path)]
    out = {}
    for split in ("tune", "report"):
        rs = [r for r in rows if r["split"] == split]
        qs = [q for r in rs for q in r["questions"]]
        out[split] = {"traces": len(rs),
                      "turns": [min(r["n_turns"] for r in rs), sum(r["n_turns"] for r in rs) / len(rs), max(r["n_turns"] for r in rs)],
                      "tokens": [min(r["n_tokens"] for r in rs), sum(r["n_tokens"] for r in rs) / len(rs), max(r["n_tokens"] for r in rs)],
                      "questions_per_distance": {d: sum(q["distance"] == d for q in qs) for d in DISTANCES},
                      "questions_per_kind": {k: sum(q["kind"] == k for q in qs) for k in sorted({q["kind"] for q in qs})}}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("command", choices=["eval", "check", "stats"])
    ap.add_argument("path", nargs="?", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval-dev-long.jsonl"))
    ap.add_argument("--count", type=int, default=EVAL_COUNT)
    a = ap.parse_args()
    if a.command == "eval":
        with open(a.path, "w") as f:
            f.write(dumps(eval_set(a.count)))
    elif a.command == "stats":
        print(json.dumps(stats(a.path), indent=1))
    else:
        problems = check(a.path)
        print("\n".join(problems[:20]) or f"{a.path}: ok")
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
