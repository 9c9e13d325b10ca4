"""llguidance vs xgrammar, measured the same way: tokenizer setup, schema compile, time to fill one
token's mask (a fixed JSON document walked token by token), RSS growth, and JSON-Schema coverage
(each schema must compile, and random walks through its masks must give instances that
`jsonschema` accepts; a keyword refused at compile time is counted as not covered, but is safe).

    python -m pagedllm.bench.grammar_engines --make-vocab DIR     # DIR/tok49k.json, DIR/tok262k.json
    python -m pagedllm.bench.grammar_engines llg|xgr DIR/tok49k.json

The 262k vocabulary is SmolLM2's 49k byte-level BPE plus concatenations of its tokens (a
stand-in for Gemma's 262k vocabulary, which cannot be fetched here). xgrammar is not a
dependency: install it beside torch with `pip install --no-deps xgrammar apache-tvm-ffi`.
One process per engine and vocabulary, so the RSS figures do not mix.
"""
# Each engine's modules are imported after the baseline's resident memory is read (E402).
# ruff: noqa: E402

import json
import random
import sys
import time

import jsonschema


def make_vocab(out: str) -> None:
    from pagedllm.loading.gguf import read_gguf
    from pagedllm.loading.source import default_model_path

    tk = read_gguf(default_model_path()).tokenizer.backend
    tk.save(f"{out}/tok49k.json")
    d = json.loads(tk.to_str())
    vocab = d["model"]["vocab"]
    toks = [t for t in vocab if len(t) > 1]
    rng, seen = random.Random(0), set(vocab)
    while len(vocab) < 262144:
        t = rng.choice(toks) + rng.choice(toks)
        if t not in seen:
            seen.add(t)
            vocab[t] = len(vocab)
    with open(f"{out}/tok262k.json", "w") as f:
        json.dump(d, f)


if sys.argv[1] == "--make-vocab":
    make_vocab(sys.argv[2])
    sys.exit(0)
engine, vocab_file = sys.argv[1], sys.argv[2]
from tokenizers import Tokenizer

tk = Tokenizer.from_file(vocab_file)
V = tk.get_vocab_size(with_added_tokens=True)


def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20


import torch

r0 = rss()
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "green", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOC = json.dumps(
    {
        "name": "Alice",
        "age": 33,
        "email": "alice@example.com",
        "tags": ["red", "blue"],
        "address": {"street": "12 Long Road", "zip": "12345"},
    },
    separators=(",", ":"),
)
ids = tk.encode(DOC, add_special_tokens=False).ids
t0 = time.perf_counter()
if engine == "llg":
    import llguidance as llg
    import llguidance.torch as lt

    tok = llg.LLTokenizer(open(vocab_file).read(), eos_token=0)

    def compile(kind, spec):
        g = {
            "json": lambda: llg.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False}),
            "regex": lambda: llg.LLMatcher.grammar_from_regex(spec),
        }[kind]()
        m = llg.LLMatcher(tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    bm = lt.allocate_token_bitmask(1, V)

    def fill(m):
        lt.fill_next_token_bitmask(m, bm, 0)

    def accept(m, t):
        return m.consume_token(t)
else:
    import xgrammar as xgr

    d = json.loads(open(vocab_file).read())
    enc = [None] * V
    for s, i in d["model"]["vocab"].items():
        enc[i] = s
    for a in d["added_tokens"]:
        enc[a["id"]] = a["content"]
    info = xgr.TokenizerInfo(enc, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=V, stop_token_ids=[0])
    comp = xgr.GrammarCompiler(info, max_threads=1)

    def compile(kind, spec):
        c = (
            comp.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
            if kind == "json"
            else comp.compile_regex(spec)
        )
        return xgr.GrammarMatcher(c)

    bm = xgr.allocate_token_bitmask(1, V)

    def fill(m):
        m.fill_next_token_bitmask(bm)

    def accept(m, t):
        return m.accept_token(t)


setup = time.perf_counter() - t0
t0 = time.perf_counter()
m = compile("json", SCHEMA)
first_compile = time.perf_counter() - t0
t0 = time.perf_counter()
m = compile("json", SCHEMA)
second_compile = time.perf_counter() - t0
times = []
for _ in range(5):
    m = compile("json", SCHEMA)
    for t in ids:
        a = time.perf_counter()
        fill(m)
        times.append(time.perf_counter() - a)
        assert accept(m, t), ("rejected", t, tk.decode([t]))
times.sort()
r1 = rss()
# coverage: each schema must compile, and a random walk through its masks must give a valid instance
COV = {
    "enum": {"enum": ["a", "b", 3]},
    "const": {"const": "x"},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    "allOf": {"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 9}]},
    "$ref/$defs": {
        "$defs": {"p": {"type": "integer", "minimum": 1, "maximum": 5}},
        "type": "array",
        "items": {"$ref": "#/$defs/p"},
        "maxItems": 3,
    },
    "recursive": {
        "$defs": {
            "n": {
                "type": "object",
                "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2}},
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/n",
    },
    "pattern": {"type": "string", "pattern": "^[a-c]{2,4}-[0-9]+$"},
    "format date-time": {"type": "string", "format": "date-time"},
    "format date": {"type": "string", "format": "date"},
    "format uuid": {"type": "string", "format": "uuid"},
    "format email": {"type": "string", "format": "email"},
    "format ipv4": {"type": "string", "format": "ipv4"},
    "format uri": {"type": "string", "format": "uri"},
    "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 4},
    "integer range": {"type": "integer", "minimum": -5, "maximum": 17},
    "exclusiveMinimum": {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 9},
    "number range": {"type": "number", "minimum": 0.5, "maximum": 2.5},
    "multipleOf": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
    "min/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    "prefixItems": {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 3}, {"type": "integer"}],
        "items": False,
    },
    "uniqueItems": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 3},
    "additionalProperties false": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "additionalProperties": False,
    },
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
    "patternProperties": {
        "type": "object",
        "patternProperties": {"^x": {"type": "integer"}},
        "additionalProperties": False,
        "maxProperties": 2,
    },
    "min/maxProperties": {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "minProperties": 1,
        "maxProperties": 2,
    },
    "required": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "required": ["b"],
        "additionalProperties": False,
    },
    "type list": {"type": ["integer", "null"]},
    "if/then/else": {"if": {"type": "integer"}, "then": {"minimum": 3}, "else": {"type": "string", "maxLength": 2}},
    "not": {"not": {"type": "integer"}},
}
rng = random.Random(1)
eos = 0
texts = [tk.decode([i]) for i in range(V)]
lens = [len(t) for t in texts]
cov = {}
for name, sch in COV.items():
    try:
        m = compile("json", sch)
    except Exception as e:
        cov[name] = "compile error: " + str(e).splitlines()[0][:80]
        continue
    ok = bad = 0
    err = ""
    for trial in range(5):
        m = compile("json", sch)
        out = []
        for step in range(120):
            fill(m)
            row = bm[0]
            allowed = [
                i for i in torch.nonzero(((row[:, None] >> torch.arange(32)) & 1).flatten()[:V]).flatten().tolist()
            ]
            if not allowed:
                break
            if eos in allowed and (rng.random() < 0.6 or len(allowed) == 1):
                break
            short = [i for i in allowed if lens[i] <= 2 and i != eos] or [i for i in allowed if i != eos]
            if step > 25:
                closing = [i for i in short if any(c in texts[i] for c in '"]}')]
                if closing and rng.random() < 0.7:
                    short = closing
            t = rng.choice(short)
            out.append(t)
            if not accept(m, t):
                err = "token rejected"
                break
        txt = tk.decode(out)
        if step == 119:
            continue  # the walk ran out of steps: says nothing about the engine
        try:
            jsonschema.validate(json.loads(txt), sch, format_checker=jsonschema.FormatChecker())
            ok += 1
        except Exception as e:
            bad += 1
            err = err or f"{txt[:40]!r}: {str(e).splitlines()[0][:60]}"
    cov[name] = "ok" if bad == 0 else f"{ok}/5 valid ({err})"
ms = [t * 1e3 for t in times]
print(
    json.dumps(
        {
            "engine": engine,
            "vocab": V,
            "tokenizer_setup_s": round(setup, 3),
            "compile_first_ms": round(first_compile * 1e3, 1),
            "compile_again_ms": round(second_compile * 1e3, 1),
            "mask_ms_median": round(ms[len(ms) // 2], 4),
            "mask_ms_mean": round(sum(ms) / len(ms), 4),
            "mask_ms_p99": round(ms[int(len(ms) * 0.99)], 4),
            "mask_ms_max": round(ms[-1], 3),
            "rss_delta_mb": round(r1 - r0),
            "coverage_ok": sum(v == "ok" for v in cov.values()),
            "coverage_total": len(cov),
            "failed": {k: v for k, v in cov.items() if v != "ok"},
        },
        indent=1,
    )
)
