"""The engine core stays small and knows no feature by name; a feature is a component added beside it.

A component written here (no core file edited) sees every hook of every step in order, and ends
requests through the step's finishes, which the core applies in one place: the runtime's state
holds together afterwards.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from rtp import LLM, SamplingParams
from rtp.engine import core
from rtp.engine.component import Component

CORE = Path(core.__file__)
FEATURES = ("grammar", "draft", "handoff", "disaggregation", "eplb", "balancer", "prefill_budget", "governor",
            "speculation", "tensor_parallel", "kv_transfer")


def test_the_core_is_small_and_its_step_is_five_calls():
    source = CORE.read_text()
    assert len(source.splitlines()) < 150
    step = inspect.getsource(core.EngineCore.step)
    assert len(step.splitlines()) <= 25
    calls = [n.func.attr for n in sorted((n for n in ast.walk(ast.parse(step.strip())) if isinstance(n, ast.Call)
                                          and isinstance(n.func, ast.Attribute)), key=lambda n: (n.lineno, n.col_offset))]
    assert calls == ["schedule", "forward", "sample", "update", "emit"]


def test_the_core_imports_no_feature():
    tree = ast.parse(CORE.read_text())
    modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    for module in modules:
        assert not any(f in module for f in FEATURES), module
    text = CORE.read_text().lower()
    for name in ("draftmodel", "kvhandoff", "grammars", "expertbalancer", "prefillbudget", "speculationgovernor"):
        assert name not in text, name


class Recorder(Component):
    """Every hook, in order; and a feature: no request may generate more than `cap` tokens."""

    name = "recorder"

    def __init__(self, cap: int):
        self.cap = cap
        self.calls: list[str] = []
        self.admitted = 0
        self.gone: set[int] = set()

    def admit(self, request):
        self.admitted += 1

    def before_schedule(self, core):
        self.calls.append("before_schedule")

    def before_forward(self, step):
        self.calls.append("before_forward")

    def after_forward(self, step):
        self.calls.append("after_forward")

    def after_sample(self, step):
        self.calls.append("after_sample")
        lengths = step.core.scheduler.output_lengths(step.slots) + 1
        for row, n in enumerate(lengths):
            if n >= self.cap:
                step.finishes.end(row)

    def after_emit(self, step):
        self.calls.append("after_emit")

    def after_step(self, step):
        self.calls.append("after_step")
        assert step.seconds > 0

    def finished(self, rid):
        self.gone.add(rid)

    def stats(self):
        return {"admitted": self.admitted}


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(model=str(default_gguf), dtype="float32", compile=False, max_model_len=128, max_num_seqs=4)


def test_a_component_added_beside_the_core_runs_its_hooks_and_ends_requests(llm):
    recorder = Recorder(cap=3)
    llm.engine.add_component(recorder)
    try:
        outs = llm.generate(["Once upon a time", "The sea is"], SamplingParams(temperature=0, max_tokens=20,
                                                                              ignore_eos=True, n=2))
        assert llm.engine.stats()["recorder"] == {"admitted": 2}
    finally:
        llm.engine.components.remove(recorder)
    for out in outs:
        for choice in out.outputs:
            assert len(choice.token_ids) == 3 and choice.finish_reason == "stop"
    assert recorder.admitted == 2 and len(recorder.gone) == 4
    hooks = ["before_schedule", "before_forward", "after_forward", "after_sample", "after_emit", "after_step"]
    assert recorder.calls[:6] == hooks and len(recorder.calls) % 6 == 0
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not len(engine.requests) and not len(engine.outputs)
    engine.scheduler.check_integrity()
    assert engine.allocator.num_used == 0


HOOKS = ("admit", "before_schedule", "before_forward", "after_forward", "after_sample", "after_emit", "after_step",
         "finished", "reserved", "resume", "stats")


def test_every_component_answers_every_hook(llm):
    """No component hides a hook under an attribute of the same name (a set called `reserved` did)."""
    for component in llm.engine.components:
        for hook in HOOKS:
            assert callable(getattr(component, hook)), (type(component).__name__, hook)
