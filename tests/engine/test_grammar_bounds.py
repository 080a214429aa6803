"""The grammar compiler's bounds (rtp/engine/grammar/), on the default model's real tokenizer: every
spec past a limit is refused before any compile, every grammar no output satisfies is refused at
compile time, a compile past its time or abandoned by its callers is killed, and one client's
compiles do not hold up another's."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from rtp.checkpoint.tokenizer import Tokenizer
from rtp.engine.grammar import GrammarCompiler, GrammarLimits
from rtp.engine.grammar.spec import lark_repetition, regex_repetition
from rtp.errors import InvalidRequest
from rtp.sampling_params import StructuredOutputs as Spec


@pytest.fixture(scope="module")
def tokenizer(default_gguf):
    return Tokenizer.from_pretrained(default_gguf)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, 49152, [2], GrammarLimits(compile_timeout=1.0, max_bytes=4 << 20))
    c.compile(Spec(choice=["warm"])).result(60)  # the sandboxes are up
    yield c
    c.close()


def refusal(compiler, spec, client="a") -> str:
    with pytest.raises(InvalidRequest) as e:
        compiler.compile(spec, client).result(60)
    message = str(e.value)
    assert e.value.param == "structured_outputs"
    assert "\n" not in message and "Traceback" not in message and "<state>" not in message, message
    assert len(message) < 400, message
    return message


def slow_schema(tag: str, properties: int = 6000) -> dict:
    """A JSON Schema that takes llguidance seconds to build (its properties' patterns multiply); past
    2,000 properties its first key trips the parser's row limit, which the sandbox's walk finds."""
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string", "pattern": "[a-z]{1,50}"}
                                             for i in range(properties)}}


def sandboxes() -> set[int]:
    """Pids of this process's grammar sandboxes (its children running rtp.engine.grammar.sandbox)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid() and b"rtp.engine.grammar.sandbox" in cmdline:
            found.add(int(entry))
    return found


def warm(compiler) -> None:
    """Wait until the compiler's sandboxes (each worker's child and its spare) are up and ready."""
    compiler.compile(Spec(choice=["warm"])).result(60)
    deadline = time.monotonic() + 30
    while not compiler.warm:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("text, size", [("a{1000000}", 1_000_000), ("(ab{100}){100}", 10_100), (r"\d{3}-\d{4}", 4),
                                        (r"[a-z{}]{0,20}x", 20), (r"\x{10FFFF}{5}", 5), ("abc", 0)])
def test_regex_repetition_multiplies_nested_counts(text, size):
    assert regex_repetition(text) == size


def test_lark_repetition_reads_rules_literals_and_regexes():
    assert lark_repetition('start: "a"{100000}') == 100_000
    assert lark_repetition("start: /x{50}/ ~ 3") == 150
    assert lark_repetition('start: ("ab" | c){10}\nc: "d"') == 30
    assert lark_repetition('start: "{1000000}"  // a literal, not a count') == 0


@pytest.mark.parametrize("spec, says", [
    (Spec(choice=[f"choice {i} {'x' * 40}" for i in range(100_000)]), "--grammar-max-bytes"),
    (Spec(choice=[f"{i}" for i in range(5000)]), "--grammar-max-choices"),
    (Spec(regex="a{1000000}"), "--grammar-max-repetition"),
    (Spec(grammar='start: "a"{100000}'), "--grammar-max-repetition"),
    (Spec(json={"type": "string", "pattern": "(x{1000}){1000}"}), "--grammar-max-repetition"),
])
def test_a_spec_past_a_limit_is_refused_at_once(compiler, spec, says):
    started = time.perf_counter()
    assert says in refusal(compiler, spec)
    assert time.perf_counter() - started < 0.1


@pytest.mark.parametrize("spec", [
    Spec(regex=r"[^\x00-\x{10FFFF}]"),
    Spec(grammar='start: a\na: a "x"'),
    Spec(json={"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"}),
], ids=["empty-class", "lark-recursion", "schema-self-reference"])
def test_a_grammar_no_output_satisfies_is_refused(compiler, spec):
    assert "no output satisfies" in refusal(compiler, spec)


def test_grammar_syntax_is_tried_not_guessed(compiler):
    # Lark with GBNF's rule sign inside a literal: tried as GBNF, then built as Lark
    assert compiler.compile(Spec(grammar='start: "a::=b" | "c"')).result(60) is not None
    assert compiler.compile(Spec(grammar='root ::= "yes" | "no"')).result(60) is not None
    assert compiler.compile(Spec(grammar='start: "a::=b"', grammar_syntax="lark")).result(60) is not None
    assert "not GBNF" in refusal(compiler, Spec(grammar='start: "a::=b"', grammar_syntax="gbnf"))
    assert "neither GBNF" in refusal(compiler, Spec(grammar="root ::= undefined_rule"))


def test_a_compile_starved_of_cpu_is_refused_but_not_remembered(compiler):
    """A timeout is remembered as the grammar's own only when its compile spent the time: one whose
    child got no CPU (stopped here, as a loaded machine starves the niced child) gets the timeout's
    400 and is compiled afresh when asked again -- a small grammar is never refused for good because
    the machine was busy once."""
    spec = Spec(choice=["starved", "fed"])
    stopped = []
    for sandbox in compiler._sandboxes:  # whichever worker takes the job, its child is stopped
        sandbox.start()
        stopped.append(sandbox._proc.pid)
        os.kill(stopped[-1], signal.SIGSTOP)
    try:
        assert "longer than 1 s" in refusal(compiler, spec)
    finally:
        for pid in stopped:  # the child the compile did not reach goes on
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert compiler.compile(spec).result(60) is not None  # compiled afresh


def test_a_compile_past_its_time_is_killed_and_answered(compiler):
    started = time.perf_counter()
    assert "longer than 1 s" in refusal(compiler, Spec(json=slow_schema("t")))
    assert time.perf_counter() - started < 5
    # the refusal is remembered: the same grammar costs only its limit checks again (300 KB of schema)
    started = time.perf_counter()
    refusal(compiler, Spec(json=slow_schema("t")))
    assert time.perf_counter() - started < 0.3
    # and the next compile finds a warm sandbox
    started = time.perf_counter()
    compiler.compile(Spec(choice=["after", "timeout"])).result(60)
    assert time.perf_counter() - started < 0.5


def test_an_abandoned_compile_is_dropped_or_killed(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152, [2], GrammarLimits(compile_timeout=60.0, max_bytes=4 << 20), workers=1)
    try:
        warm(compiler)
        running = compiler.compile(Spec(json=slow_schema("r")), "a")
        queued = compiler.compile(Spec(json=slow_schema("q")), "a")
        time.sleep(0.3)
        started = time.perf_counter()
        assert running.cancel() and queued.cancel()
        small = compiler.compile(Spec(choice=["yes", "maybe"]), "b").result(60)
        assert small is not None and time.perf_counter() - started < 0.5
        assert compiler.stats()["refused"]["cancelled"] == 2
        # nothing was learned from them: asked again, they compile afresh (and are cancelled again)
        again = compiler.compile(Spec(json=slow_schema("r")), "a")
        assert not again.done()
        again.cancel()
    finally:
        compiler.close()


def test_one_clients_compiles_delay_anothers_by_at_most_one(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152, [2], GrammarLimits(compile_timeout=60.0, max_bytes=4 << 20), workers=1)
    try:
        warm(compiler)
        started = time.perf_counter()
        flood = [compiler.compile(Spec(json=slow_schema(f"f{i}", 2500)), "flood") for i in range(4)]
        flood[0].exception(60)  # refused, after a second of work: past 2,000 properties
        one = time.perf_counter() - started  # one slow compile
        mine = compiler.compile(Spec(choice=["mine"]), "other")
        mine.result(60)
        # the flood's second compile was running when this one came: the third and fourth wait behind it
        assert not flood[2].done() and not flood[3].done()
        waited = time.perf_counter() - started
        assert waited < 3 * one + 1, f"waited {waited:.2f} s in all behind {one:.2f} s compiles"
        for f in flood:
            f.cancel()
    finally:
        compiler.close()


def test_many_callers_share_one_compile_and_a_cancel_leaves_the_others(compiler):
    spec = Spec(json={"type": "object", "properties": {"shared": {"type": "integer"}}})
    first, second = compiler.compile(spec, "a"), compiler.compile(spec, "b")
    first.cancel()
    assert second.result(60) is not None
    assert compiler.compile(spec, "c").result(0) is not None  # cached


def test_a_runtime_failure_is_the_grammars_fault(compiler, tokenizer):
    """A grammar whose only branch leads nowhere after its first token passes the compile (some
    text begins it) but fails its request as an InvalidRequest, never an engine error."""
    import numpy as np

    from rtp.engine.grammar import GrammarSlots

    template = compiler.compile(Spec(grammar='start: "x" a\na: a "x"')).result(60)
    slots = GrammarSlots(4, 4, 49152)
    slots.set(0, template.deep_copy())
    x = tokenizer.encode("x", add_special_tokens=False)[0]
    failed, done = {}, set()
    for _ in range(3):
        slots.fill(np.array([0]))
        failed, done = slots.advance(np.array([0]), np.array([x]), set())
        if failed:
            break
    assert failed and isinstance(failed[0], InvalidRequest) and failed[0].param == "structured_outputs"
    assert "cannot be continued" in str(failed[0])


def test_the_sandboxes_are_gone_with_the_compiler(tokenizer):
    before = sandboxes()
    compiler = GrammarCompiler(tokenizer, 49152, [2], workers=1)
    warm(compiler)
    assert len(sandboxes() - before) == 2  # the child and its spare
    compiler.close()
    deadline = time.monotonic() + 30
    while sandboxes() - before:
        assert time.monotonic() < deadline, "a sandbox outlived its compiler"
        time.sleep(0.05)


def test_json_choices_up_to_the_limit_build(compiler):
    choices = [json.dumps({"n": i}) for i in range(4096)]
    assert compiler.compile(Spec(choice=choices)).result(60) is not None
