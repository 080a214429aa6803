#!/usr/bin/env python3
"""Structured-output backends on this CPU: xgrammar against llguidance, JSON Schema workload.

rtp picks its grammar backend by measurement. Both libraries turn a JSON Schema into a
matcher that, at every decode step, writes a row of the [B, ceil(V/32)] int32 token
bitmask (bit t of the row set = token t allowed) and then consumes the sampled token.
This tool measures, with rtp's default model's tokenizer (SmolLM2, V = 49152):

  import         `import <backend>` in a fresh interpreter after `import torch` (rtp
                 imports torch anyway), best of --import-runs
  setup          the once-per-server work: the backend's tokenizer built from rtp's
                 `tokenizers.Tokenizer` (llguidance: LLTokenizer(to_str()); xgrammar:
                 TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=
                 a copy))), then its compiler / executor objects
  compile        --schemas distinct JSON Schemas (generated here from --seed: nested
                 objects, arrays, enums, bounded integers and numbers, optional fields,
                 strings with patterns, lengths and formats, anyOf, nullable, $defs/$ref),
                 one at a time, as requests with one schema each would bring them:
                   cold     schema text -> a matcher ready for its first mask
                   1st mask that first mask (llguidance builds its lexer lazily, so part
                            of its compile work lands here; add the two to compare)
                   cached   the same schema again: xgrammar's compiler cache hit plus a
                            GrammarMatcher; llguidance has no cache, so deep_copy() of a
                            matcher kept from the cold compile (what rtp would keep)
  steps          --batch rows, row r following schema r % N, advanced in lockstep over a
                 valid document for its schema (generated with it, json.dumps'd, encoded
                 with rtp's tokenizer, eos appended). Per step: fill the B rows, check the
                 document's token is allowed in every row, consume it in every matcher.
                 A row that finishes its document gets a fresh matcher for the same
                 schema (a new request; built outside the timed region) and starts
                 again, so B stays constant for --steps steps (default: the longest
                 document, so every document is walked whole). Two passes, each with
                 fresh matchers:
                   batched  llguidance: fill_next_token_bitmask_par + consume_token_par on
                            an LLExecutor; xgrammar: BatchGrammarMatcher.
                            batch_fill_next_token_bitmask + batch_accept_token
                   per-row  a Python loop of the single-matcher calls
                 Reported: median and P99 ms per step, for fill and for consume.
  correctness    every token the backend masked out or refused is listed (a valid
                 document's token must always be allowed); the schemas a backend failed
                 to compile; and the batched pass's masks compared row by row between
                 the backends (same language expected: a difference names the schema,
                 the text so far, and tokens only one of them allows)
  footprint      bytes on disk (the files in each distribution's RECORD) of the backend
                 and of every installed distribution it pulls in that rtp's own
                 dependencies (pyproject's list, and theirs) do not already bring

Each backend is optional: whichever imports is measured, and the output says which did
not. --threads (default: the CPUs this process may use) is given to every thread pool
(GrammarCompiler, BatchGrammarMatcher, LLExecutor). Other processes' CPU seconds during
the measurement are reported: this machine may be shared.

Output: progress on stderr; a table on stdout, then as the LAST line of stdout one JSON
object with every figure (`| tail -n1 | python -m json.tool`).

Examples (xgrammar pulls torch, transformers and triton: keep it out of rtp's venv):
    python3 -m venv /tmp/xgvenv && /tmp/xgvenv/bin/pip install torch==2.13.0
    /tmp/xgvenv/bin/pip install xgrammar==0.2.8 llguidance==1.9.1 numpy tokenizers msgspec \\
        jsonschema gguf jinja2 safetensors starlette hypercorn prometheus-client httpx tqdm
    PYTHONPATH=. /tmp/xgvenv/bin/python tools/bench_grammar_backends.py
    python tools/bench_grammar_backends.py --backends llguidance --batch 16
    python tools/bench_grammar_backends.py --whitespace compact --schemas 256 --batch 128
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import math
import os
import random
import re
import subprocess
import sys
import time

import numpy as np

from _common import CpuWatch, cpu_description, error_text, note
from rtp.checkpoint.default_model import default_model_path
from rtp.checkpoint.tokenizer import Tokenizer

# pyproject.toml's [project] dependencies: what a backend's footprint is measured against.
RTP_DEPENDENCIES = ("torch", "numpy", "msgspec", "starlette", "hypercorn", "tokenizers", "safetensors",
                    "gguf", "jinja2", "prometheus-client", "httpx", "tqdm")
BACKENDS = ("xgrammar", "llguidance")
MAX_EXAMPLES = 5          # rejected tokens / mask differences listed in full per backend
MASK_STORE_LIMIT = 2 << 30  # bytes of stored masks (both backends) for the cross-check

# ---------------------------------------------------------------------------------------
# Schemas and their documents
# ---------------------------------------------------------------------------------------

_WORDS = ("name", "title", "city", "color", "status", "kind", "label", "owner", "region", "score",
          "price", "count", "level", "mode", "note", "tag", "code", "contact", "phone", "link",
          "start", "end", "size", "weight", "rank", "author", "topic", "lang", "unit", "zone",
          "budget", "version", "priority", "quantity", "summary", "country", "rating", "source")
_LOWER = "abcdefghijklmnopqrstuvwxyz"
# Free-text values: escapes, a newline, and multi-byte UTF-8 (which BPE splits mid-character).
_TEXTS = ("hello world", "Alice Smith", "the quick brown fox", 'she said "hi"', "line one\nline two",
          "path\\to\\file", "café ☕ naïve", "100% done", "tab\there", "A-12 / B-7", "", "Zürich, 8001")


def _word(r: random.Random, lo: int, hi: int) -> str:
    return "".join(r.choice(_LOWER) for _ in range(r.randint(lo, hi)))


def _digits(r: random.Random, n: int, alphabet: str = "0123456789") -> str:
    return "".join(r.choice(alphabet) for _ in range(n))


# pattern -> a generator of strings that match it (every pattern is anchored: search and
# full-match semantics agree, so the backends cannot differ on that)
_PATTERNS = {
    r"^[a-z]{3,8}$": lambda r: _word(r, 3, 8),
    r"^[A-Z]{2}-[0-9]{4}$": lambda r: _word(r, 2, 2).upper() + "-" + _digits(r, 4),
    r"^\+?[0-9]{3}-[0-9]{3}-[0-9]{4}$": lambda r: f"+{_digits(r, 3)}-{_digits(r, 3)}-{_digits(r, 4)}",
    r"^[a-f0-9]{8}(-[a-f0-9]{4}){2}$": lambda r: "-".join(
        (_digits(r, 8, "0123456789abcdef"), _digits(r, 4, "0123456789abcdef"), _digits(r, 4, "0123456789abcdef"))),
    r"^(red|green|blue)-[0-9]+$": lambda r: r.choice(("red", "green", "blue")) + "-" + str(r.randint(0, 999)),
    r"^v[0-9]+\.[0-9]+(\.[0-9]+)?$": lambda r: f"v{r.randint(0, 20)}.{r.randint(0, 99)}.{r.randint(0, 9)}",
}
_FORMATS = {
    "date": lambda r: f"20{r.randint(10, 29)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "date-time": lambda r: f"20{r.randint(10, 29)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
                           f"T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}Z",
    "email": lambda r: f"{_word(r, 2, 8)}.{_word(r, 2, 8)}@example.com",
    "uuid": lambda r: "-".join(_digits(r, n, "0123456789abcdef") for n in (8, 4, 4, 4, 12)),
}


class _SchemaMaker:
    """Random JSON Schemas of bounded size; `example` draws a valid instance of one."""

    def __init__(self, r: random.Random):
        self.r = r

    def schema(self) -> dict:
        r = self.r
        top = self.obj(0, r.randint(2, 9))
        if r.random() < 0.3:  # a shared definition used twice
            top["$defs"] = {"Item": self.obj(2, r.randint(2, 4))}
            top["properties"]["entries"] = {"type": "array", "items": {"$ref": "#/$defs/Item"},
                                            "minItems": 1, "maxItems": 3}
            top["properties"]["primary"] = {"$ref": "#/$defs/Item"}
            top["required"].append("primary")
        return top

    def obj(self, depth: int, n: int) -> dict:
        names = self.r.sample(_WORDS, n)
        props = {name: self.node(depth + 1) for name in names}
        required = [name for name in names if self.r.random() < 0.6]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    def node(self, depth: int) -> dict:
        r = self.r
        kinds = ["string", "pattern", "format", "integer", "number", "boolean", "enum"]
        if depth < 3:
            kinds += ["object", "array", "array", "anyOf", "nullable"]
        kind = r.choice(kinds)
        if kind == "string":
            if r.random() < 0.5:
                return {"type": "string"}
            lo = r.randint(0, 3)
            return {"type": "string", "minLength": lo, "maxLength": lo + r.randint(2, 24)}
        if kind == "pattern":
            return {"type": "string", "pattern": r.choice(sorted(_PATTERNS))}
        if kind == "format":
            return {"type": "string", "format": r.choice(sorted(_FORMATS))}
        if kind == "integer":
            lo = r.choice((-1000, -10, 0, 1, 18, 100))
            return {"type": "integer", "minimum": lo, "maximum": lo + r.choice((9, 99, 120, 5000, 100000))}
        if kind == "number":
            lo = r.choice((-90, -1, 0, 0, 10))
            bound = "exclusiveMinimum" if r.random() < 0.3 else "minimum"
            return {"type": "number", bound: lo, "maximum": lo + r.choice((1, 10, 180, 1000))}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "enum":
            values = r.sample(_WORDS, r.randint(2, 6))
            if r.random() < 0.2:
                values.append(None)
            return {"enum": values}
        if kind == "object":
            return self.obj(depth, r.randint(1, 5))
        if kind == "array":
            lo = r.randint(0, 2)
            return {"type": "array", "items": self.node(depth + 1), "minItems": lo, "maxItems": lo + r.randint(1, 3)}
        if kind == "anyOf":
            return {"anyOf": [self.node(depth + 1) for _ in range(r.randint(2, 3))]}
        return {"anyOf": [self.node(depth + 1), {"type": "null"}]}  # nullable

    def example(self, s: dict, defs: dict):
        r = self.r
        if "$ref" in s:
            return self.example(defs[s["$ref"].rsplit("/", 1)[1]], defs)
        if "enum" in s:
            return r.choice(s["enum"])
        if "anyOf" in s:
            return self.example(r.choice(s["anyOf"]), defs)
        t = s["type"]
        if t == "object":
            return {k: self.example(v, defs) for k, v in s["properties"].items()
                    if k in s["required"] or r.random() < 0.5}
        if t == "array":
            return [self.example(s["items"], defs) for _ in range(r.randint(s["minItems"], s["maxItems"]))]
        if t == "string":
            if "pattern" in s:
                return _PATTERNS[s["pattern"]](r)
            if "format" in s:
                return _FORMATS[s["format"]](r)
            if "maxLength" in s:
                return _word(r, max(s["minLength"], 0), s["maxLength"])
            return r.choice(_TEXTS)
        if t == "integer":
            return r.randint(s["minimum"], s["maximum"])
        if t == "number":
            lo = s.get("minimum", s.get("exclusiveMinimum"))
            x = round(r.uniform(lo, s["maximum"]), 2)
            return x if x > lo or "minimum" in s else round(lo + 0.25, 2)
        if t == "boolean":
            return r.random() < 0.5
        return None


class Case:
    """One schema, a valid document for it, and the document's tokens (eos last)."""

    def __init__(self, index: int, schema: dict, instance, doc: str, tokens: list[int]):
        self.index, self.schema, self.instance, self.doc, self.tokens = index, schema, instance, doc, tokens
        self.schema_text = json.dumps(schema)


def make_cases(n: int, seed: int, tok: Tokenizer, whitespace: str) -> list[Case]:
    """n distinct schemas; schema i depends only on (seed, i), so a smaller n is a prefix."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
        note("jsonschema is not installed: the generated documents are not validated")
    separators = (",", ":") if whitespace == "compact" else None
    seen, cases = set(), []
    for i in range(n):
        r = random.Random(f"{seed}:{i}")
        maker = _SchemaMaker(r)
        schema = maker.schema()
        while json.dumps(schema, sort_keys=True) in seen:
            schema = maker.schema()
        seen.add(json.dumps(schema, sort_keys=True))
        instance = maker.example(schema, schema.get("$defs", {}))
        if jsonschema is not None:
            jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(instance)
        doc = json.dumps(instance, ensure_ascii=False, separators=separators)
        cases.append(Case(i, schema, instance, doc, tok.encode(doc, add_special_tokens=False) + [tok.eos_token_ids[0]]))
    return cases


# ---------------------------------------------------------------------------------------
# The backends, behind one small interface
# ---------------------------------------------------------------------------------------

class LLGuidance:
    name = dist = "llguidance"

    def __init__(self, tok: Tokenizer, vocab: int, threads: int, whitespace: str):
        import llguidance
        import llguidance.numpy as llnp
        self.ll, self.llnp = llguidance, llnp
        t = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=tok.eos_token_ids)
        self.tokenizer_ms = (time.perf_counter() - t) * 1e3
        self.executor = llguidance.LLExecutor(threads)
        self.setup_ms = (time.perf_counter() - t) * 1e3
        self.vocab = vocab
        self.options = ({"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
                        if whitespace == "compact" else {"whitespace_flexible": True})
        self.info = {"is_canonical": self.tokenizer.is_canonical, "eos_tokens": self.tokenizer.eos_tokens}

    def _checked(self, m):
        if m.is_error():  # LLMatcher never raises on a bad grammar: it starts in an error state
            raise ValueError(m.get_error())
        return m

    def compile_ready(self, schema_text: str):
        """(grammar, matcher): the grammar is the schema wrapped; every LLMatcher compiles it anew."""
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema_text, defaults=self.options)
        m = self._checked(self.ll.LLMatcher(self.tokenizer, grammar))
        return grammar, m

    def cached_ready(self, schema_text: str, kept):
        return kept.deep_copy()

    def matcher(self, grammar: str):
        return self._checked(self.ll.LLMatcher(self.tokenizer, grammar))

    def bitmask(self, rows: int):
        mask = self.llnp.allocate_token_bitmask(rows, self.vocab)
        return mask, mask

    def fill(self, matchers, mask, batched: bool, pairs=None) -> None:
        if batched:
            self.llnp.fill_next_token_bitmask_par(self.executor, pairs, mask)
        else:
            for i, m in enumerate(matchers):
                self.llnp.fill_next_token_bitmask(m, mask, i)

    def consume(self, matchers, tokens: list[int], batched: bool) -> list[bool]:
        if batched:
            return self.executor.consume_token_par(list(zip(matchers, tokens)))
        return [m.consume_token(t) for m, t in zip(matchers, tokens)]

    def pairs(self, matchers):
        return [(m, i) for i, m in enumerate(matchers)]

    def error(self, m) -> str:
        return m.get_error() if m.is_error() else ""


class XGrammar:
    name = dist = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab: int, threads: int, whitespace: str):
        import tokenizers
        import transformers
        import xgrammar
        self.xgr = xgrammar
        t = time.perf_counter()
        # A copy: PreTrainedTokenizerFast may set padding/truncation on the object it wraps.
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tok.backend.to_str()))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=tok.eos_token_ids)
        self.tokenizer_ms = (time.perf_counter() - t) * 1e3
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=True)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.setup_ms = (time.perf_counter() - t) * 1e3
        self.vocab = vocab
        self.options = ({"any_whitespace": False, "separators": (",", ":")} if whitespace == "compact"
                        else {"any_whitespace": True})
        self.info = {"vocab_type": info.vocab_type.name, "add_prefix_space": info.add_prefix_space,
                     "stop_token_ids": info.stop_token_ids}

    def compile_ready(self, schema_text: str):
        compiled = self.compiler.compile_json_schema(schema_text, **self.options)
        return compiled, self.xgr.GrammarMatcher(compiled)

    def cached_ready(self, schema_text: str, kept):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(schema_text, **self.options))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int):
        mask = self.xgr.allocate_token_bitmask(rows, self.vocab)
        return mask, mask.numpy()  # the numpy view shares the tensor's memory

    def fill(self, matchers, mask, batched: bool, pairs=None) -> None:
        if batched:
            self.batch.batch_fill_next_token_bitmask(matchers, mask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(mask, i)

    def consume(self, matchers, tokens: list[int], batched: bool) -> list[bool]:
        if batched:
            return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        return [m.accept_token(t) for m, t in zip(matchers, tokens)]

    def pairs(self, matchers):
        return None

    def error(self, m) -> str:
        return ""


_CLASSES = {"xgrammar": XGrammar, "llguidance": LLGuidance}

# ---------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------


def stats_ms(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values)
    return {"n": len(values), "p50": round(float(np.percentile(a, 50)), 4), "p99": round(float(np.percentile(a, 99)), 4),
            "max": round(float(a.max()), 4), "mean": round(float(a.mean()), 4)}


def measure_import(module: str, runs: int) -> float | None:
    """Seconds to import `module` in a fresh interpreter that has imported torch already."""
    code = f"import time, torch; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    best = None
    for _ in range(runs):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
        if p.returncode != 0:
            return None
        best = min(best or math.inf, float(p.stdout.strip().splitlines()[-1]))
    return round(best, 3)


def measure_compile(backend, cases: list[Case]) -> tuple[dict, dict]:
    """Cold compile, first mask and cached compile per schema; returns (figures, grammars)."""
    cold, first, cached, errors, grammars, kept = [], [], [], [], {}, {}
    mask, _ = backend.bitmask(1)
    for c in cases:
        t0 = time.perf_counter()
        try:
            grammar, m = backend.compile_ready(c.schema_text)
        except Exception as e:
            errors.append({"schema": c.index, "error": error_text(e)})
            continue
        t1 = time.perf_counter()
        backend.fill([m], mask, batched=False)
        t2 = time.perf_counter()
        cold.append((t1 - t0) * 1e3)
        first.append((t2 - t1) * 1e3)
        grammars[c.index], kept[c.index] = grammar, m
    for c in cases:
        if c.index in kept:
            t0 = time.perf_counter()
            backend.cached_ready(c.schema_text, kept[c.index])
            cached.append((time.perf_counter() - t0) * 1e3)
    cold_plus_first = [a + b for a, b in zip(cold, first)]
    return ({"cold_ms": stats_ms(cold), "first_mask_ms": stats_ms(first), "cold_plus_first_mask_ms": stats_ms(cold_plus_first),
             "cached_ms": stats_ms(cached), "failed": errors}, grammars)


def measure_steps(backend, grammars: dict, cases: list[Case], tok: Tokenizer, batch: int, steps: int,
                  batched: bool, keep_masks: bool) -> tuple[dict, tuple | None]:
    """B matchers in lockstep over their documents for `steps` steps; see the module docstring.

    With keep_masks, also returns every step's bitmask and each row's position in its document.
    """
    row_case = [cases[r % len(cases)] for r in range(batch)]
    matchers = [backend.matcher(grammars[c.index]) for c in row_case]
    pairs = backend.pairs(matchers)
    pos = [0] * batch
    mask, view = backend.bitmask(batch)
    rows = np.arange(batch)
    masks = np.empty((steps, batch, view.shape[1]), np.int32) if keep_masks else None
    positions = np.empty((steps, batch), np.int32) if keep_masks else None
    fill_ms, consume_ms, rejected = [], [], []
    n_rejected = 0
    for s in range(steps):
        tokens = [c.tokens[p] for c, p in zip(row_case, pos)]
        t0 = time.perf_counter()
        backend.fill(matchers, mask, batched, pairs)
        t1 = time.perf_counter()
        if keep_masks:
            masks[s], positions[s] = view, pos
        ids = np.asarray(tokens)
        allowed = (view[rows, ids >> 5] >> (ids & 31)) & 1
        t2 = time.perf_counter()
        ok = backend.consume(matchers, tokens, batched)
        t3 = time.perf_counter()
        fill_ms.append((t1 - t0) * 1e3)
        consume_ms.append((t3 - t2) * 1e3)
        renewed = False
        for r, c in enumerate(row_case):
            bad = not (allowed[r] and ok[r])
            if bad:
                n_rejected += 1
                if len(rejected) < MAX_EXAMPLES:
                    rejected.append({"schema": c.index, "token_index": pos[r], "token": tokens[r],
                                     "token_text": tok.decode([tokens[r]], skip_special_tokens=False),
                                     "text_before": tok.decode(c.tokens[:pos[r]], skip_special_tokens=False)[-80:],
                                     "in_mask": bool(allowed[r]), "consumed": bool(ok[r]),
                                     "error": backend.error(matchers[r])[:300]})
            pos[r] += 1
            if bad or pos[r] == len(c.tokens):  # a new request for the same schema
                matchers[r], pos[r], renewed = backend.matcher(grammars[c.index]), 0, True
        if renewed:
            pairs = backend.pairs(matchers)
    return ({"fill_ms": stats_ms(fill_ms), "consume_ms": stats_ms(consume_ms), "steps": steps,
             "rejected_tokens": n_rejected, "rejected_examples": rejected},
            (masks, positions) if keep_masks else None)


def compare_masks(rec_a: tuple, rec_b: tuple, names: tuple[str, str], cases: list[Case], tok: Tokenizer) -> dict:
    """Rows where the two backends' masks differ, with the tokens only one of them allows.

    Only rows at the same place of the same document in both runs are compared: a row that
    one backend rejected restarts there, and is out of step with the other run after that.
    """
    (a, pos_a), (b, pos_b) = rec_a, rec_b
    steps, batch, _ = a.shape
    same_place = pos_a == pos_b
    differ = np.nonzero((a != b).any(axis=2) & same_place)
    examples = []
    row_case = [cases[r % len(cases)] for r in range(batch)]
    for s, r in zip(*differ):
        if len(examples) == MAX_EXAMPLES:
            break
        c = row_case[r]
        p = int(pos_a[s, r])
        bits_a = np.unpackbits(a[s, r].view(np.uint8), bitorder="little")
        bits_b = np.unpackbits(b[s, r].view(np.uint8), bitorder="little")
        only = {}
        for name, x, y in ((names[0], bits_a, bits_b), (names[1], bits_b, bits_a)):
            ids = np.nonzero(x & ~y)[0]
            only[name] = {"count": int(len(ids)),
                          "first": [tok.decode([int(t)], skip_special_tokens=False) for t in ids[:8]]}
        examples.append({"schema": c.index, "token_index": p,
                         "text_before": tok.decode(c.tokens[:p], skip_special_tokens=False)[-80:],
                         "allowed_only_by": only})
    return {"rows_compared": int(same_place.sum()), "rows_differing": int(len(differ[0])),
            "schemas_differing": sorted({row_case[r].index for r in differ[1]}), "examples": examples}


# ---------------------------------------------------------------------------------------
# Install footprint
# ---------------------------------------------------------------------------------------

def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requires(dist) -> list[str]:
    """Names of the distributions `dist` requires in this environment (no extras)."""
    names = []
    for req in dist.requires or []:
        try:
            from packaging.requirements import Requirement
            parsed = Requirement(req)
            if parsed.marker is not None and not parsed.marker.evaluate({"extra": ""}):
                continue
            names.append(parsed.name)
        except ImportError:  # no packaging: drop extras-only requirements, keep the rest
            if "extra ==" not in req:
                names.append(re.match(r"[A-Za-z0-9_.-]+", req).group(0))
    return names


def _closure(roots, missing: set | None = None) -> set[str]:
    seen, todo = set(), [_canon(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if missing is not None:
                missing.add(name)
            continue
        seen.add(name)
        todo.extend(_canon(n) for n in _requires(dist))
    return seen


def _size_mb(name: str) -> float:
    total = 0
    for f in md.distribution(name).files or []:
        try:
            total += os.lstat(f.locate()).st_size
        except OSError:
            pass
    return total / 2**20


def footprint(dist: str) -> dict:
    missing: set[str] = set()
    base = _closure(RTP_DEPENDENCIES, missing)
    own = _closure([dist])
    added = sorted(own - base - {_canon(dist)})
    sizes = {name: round(_size_mb(name), 1) for name in added}
    own_mb = _size_mb(dist)
    return {"site_packages": os.path.dirname(str(md.distribution(dist).locate_file(""))),
            "own_mb": round(own_mb, 1), "added_deps_mb": round(sum(sizes.values()), 1),
            "total_mb": round(own_mb + sum(sizes.values()), 1),
            "added_deps": dict(sorted(sizes.items(), key=lambda kv: -kv[1])),
            "shared_with_rtp": sorted((own & base) - {_canon(dist)}),
            "rtp_deps_not_installed": sorted(missing)}


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------

def _f(x, nd=2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _p(s: dict, nd=2, keys=("p50", "p99")) -> str:
    return " / ".join(_f(s.get(k), nd) for k in keys) if s.get("n") else "-"


def print_table(res: dict) -> None:
    names = list(res["backends"])
    rows = []
    get = lambda name, *path: _dig(res["backends"][name], path)  # noqa: E731
    rows.append(("version", [get(n, "version") for n in names]))
    rows.append(("import after torch (s)", [_f(get(n, "import_s")) for n in names]))
    rows.append(("tokenizer setup (ms)", [_f(get(n, "tokenizer_ms"), 1) for n in names]))
    rows.append(("setup incl. compiler/executor (ms)", [_f(get(n, "setup_ms"), 1) for n in names]))
    rows.append(("compile cold P50 / P99 / max (ms)",
                 [_p(get(n, "compile", "cold_ms"), 3, ("p50", "p99", "max")) for n in names]))
    rows.append(("  first mask P50 / P99 (ms)", [_p(get(n, "compile", "first_mask_ms"), 3) for n in names]))
    rows.append(("  cold + first mask P50 / P99 (ms)", [_p(get(n, "compile", "cold_plus_first_mask_ms"), 3) for n in names]))
    rows.append(("  cached P50 / P99 (ms)", [_p(get(n, "compile", "cached_ms"), 4) for n in names]))
    rows.append(("  schemas failed", [str(len(get(n, "compile", "failed") or [])) for n in names]))
    b = res["settings"]["batch"]
    for mode in ("batched", "per_row"):
        rows.append((f"fill B={b} {mode} median / P99 (ms/step)", [_p(get(n, "steps", mode, "fill_ms"), 3) for n in names]))
        rows.append((f"consume B={b} {mode} median / P99 (ms/step)",
                     [_p(get(n, "steps", mode, "consume_ms"), 3) for n in names]))
    rows.append(("valid tokens rejected (batched, per-row)",
                 [f"{get(n, 'steps', 'batched', 'rejected_tokens')}, {get(n, 'steps', 'per_row', 'rejected_tokens')}"
                  for n in names]))
    rows.append(("install: own / added deps / total (MB)",
                 [f"{_f(get(n, 'footprint', 'own_mb'), 1)} / {_f(get(n, 'footprint', 'added_deps_mb'), 1)} / "
                  f"{_f(get(n, 'footprint', 'total_mb'), 1)}" for n in names]))
    width = max(len(r[0]) for r in rows) + 2
    col = max(24, *(len(str(v)) for r in rows for v in r[1])) + 2
    print(f"{'':{width}}" + "".join(f"{n:{col}}" for n in names))
    for label, values in rows:
        print(f"{label:{width}}" + "".join(f"{str(v):{col}}" for v in values))
    for n in names:
        fp = get(n, "footprint") or {}
        added = ", ".join(f"{k} {v:.1f}" for k, v in (fp.get("added_deps") or {}).items()) or "none"
        print(f"{n} adds to rtp's environment (MB): {added}")
        if fp.get("rtp_deps_not_installed"):
            print(f"  (rtp dependencies not installed here, so not subtracted: {fp['rtp_deps_not_installed']})")
    cmp = res.get("mask_comparison")
    if cmp:
        print(f"\nmasks compared (batched pass): {cmp['rows_differing']} of {cmp['rows_compared']} rows differ, "
              f"in schemas {cmp['schemas_differing'][:20]}")
        for ex in cmp["examples"]:
            only = "; ".join(f"only {k}: {v['count']} e.g. {v['first'][:4]}" for k, v in ex["allowed_only_by"].items())
            print(f"  schema {ex['schema']} after {ex['text_before']!r}: {only}")
    for n in names:
        for key in ("batched", "per_row"):
            for ex in get(n, "steps", key, "rejected_examples") or []:
                print(f"{n} {key} rejected {ex['token_text']!r} in schema {ex['schema']} after {ex['text_before']!r}: "
                      f"in_mask={ex['in_mask']} consumed={ex['consumed']} {ex['error']}")
        for f in get(n, "compile", "failed") or []:
            print(f"{n} failed to compile schema {f['schema']}: {f['error']}")
    if res["missing"]:
        print(f"not measured (not importable): {res['missing']}")


def _dig(d, path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help="comma-separated backends to measure, of: %(default)s (default: both)")
    ap.add_argument("--schemas", type=int, default=64, help="distinct JSON Schemas generated (default %(default)s)")
    ap.add_argument("--batch", type=int, default=64, help="rows B of the bitmask, one matcher each (default %(default)s)")
    ap.add_argument("--steps", type=int, default=0,
                    help="lockstep decode steps (default 0: the longest document's token count, eos included)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the schema generator (default %(default)s)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for every backend thread pool (default: this process's CPUs, %(default)s)")
    ap.add_argument("--whitespace", choices=("flexible", "compact"), default="flexible",
                    help="flexible: JSON whitespace allowed between tokens (both backends' default), documents "
                         "written with ', ' and ': '; compact: no whitespace allowed, documents written compactly")
    ap.add_argument("--import-runs", type=int, default=2, help="fresh interpreters per import timing, best kept (default %(default)s)")
    ap.add_argument("--no-compare", action="store_true", help="skip storing and comparing the masks across backends")
    ap.add_argument("--model", default=None, help="tokenizer source: a .gguf or HF directory (default: rtp's default model)")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in wanted if b not in _CLASSES]
    if unknown:
        sys.exit(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    available, missing = [], {}
    for name in wanted:
        try:
            importlib.import_module(name)
            available.append(name)
        except Exception as e:
            missing[name] = error_text(e)
            note(f"{name}: not importable, skipped ({missing[name]})")

    path = args.model or default_model_path()
    tok = Tokenizer.from_pretrained(path)
    vocab = tok.backend.get_vocab_size(with_added_tokens=True)
    note(f"tokenizer {path}: vocab {vocab}, eos {tok.eos_token_ids}")
    cases = make_cases(args.schemas, args.seed, tok, args.whitespace)
    lengths = [len(c.tokens) for c in cases]
    steps = args.steps or max(lengths)
    note(f"{len(cases)} schemas, documents of {min(lengths)}-{max(lengths)} tokens (median {int(np.median(lengths))}); "
         f"{steps} steps at B={args.batch}")

    res = {"settings": {"schemas": args.schemas, "batch": args.batch, "steps": steps, "seed": args.seed,
                        "threads": args.threads, "whitespace": args.whitespace, "vocab": vocab,
                        "tokenizer": str(path), "cpu": cpu_description(), "cpus": os.cpu_count(),
                        "python": sys.version.split()[0], "doc_tokens": stats_ms(lengths)},
           "backends": {}, "missing": missing}
    words = math.ceil(vocab / 32)
    store = not args.no_compare and len(available) > 1 and len(available) * steps * args.batch * words * 4 <= MASK_STORE_LIMIT
    if not args.no_compare and len(available) > 1 and not store:
        note("masks too large to store for the cross-check: skipped (lower --steps or --batch)")
    backends, all_grammars, masks = {}, {}, {}
    for name in available:
        out = res["backends"][name] = {"version": md.version(name)}
        note(f"{name} {out['version']}: timing the import in fresh interpreters")
        out["import_s"] = measure_import(name, args.import_runs)
        with CpuWatch() as watch:
            b = backends[name] = _CLASSES[name](tok, vocab, args.threads, args.whitespace)
            out.update(tokenizer_ms=round(b.tokenizer_ms, 1), setup_ms=round(b.setup_ms, 1), tokenizer_info=b.info)
            note(f"{name}: setup {b.setup_ms:.0f} ms; compiling {len(cases)} schemas")
            out["compile"], all_grammars[name] = measure_compile(b, cases)
        out["compile"]["other_cpu_s"] = watch.other_cpu_s

    # Steps run only on the schemas every measured backend compiled, so the batches match.
    usable = [c for c in cases if all(c.index in g for g in all_grammars.values())]
    if len(usable) < len(cases):
        note(f"{len(cases) - len(usable)} schemas failed on some backend: steps use the other {len(usable)}")
    res["settings"]["schemas_in_steps"] = len(usable)
    if usable:
        steps = args.steps or max(len(c.tokens) for c in usable)
        res["settings"]["steps"] = steps
        for name in available:
            out, b = res["backends"][name], backends[name]
            out["steps"] = {}
            for mode in ("batched", "per_row"):
                note(f"{name}: {steps} steps at B={args.batch}, {mode}")
                with CpuWatch() as watch:
                    out["steps"][mode], rec = measure_steps(b, all_grammars[name], usable, tok, args.batch, steps,
                                                            mode == "batched", store and mode == "batched")
                out["steps"][mode]["other_cpu_s"] = watch.other_cpu_s
                if rec is not None:
                    masks[name] = rec
        if len(masks) == 2:
            a, bname = list(masks)
            res["mask_comparison"] = compare_masks(masks[a], masks[bname], (a, bname), usable, tok)
            masks.clear()
    for name in available:
        res["backends"][name]["footprint"] = footprint(name)
    print_table(res)
    print(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
