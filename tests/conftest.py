import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# Tests live in a folder per part of rtp (runtime/, kernels/, checkpoint/, models/, engine/,
# server/, router/, tools/), without __init__.py: each test module is imported by its basename (so basenames
# stay unique) with its own folder on sys.path, which serves helpers kept beside their tests
# (runtime/runtime_sim.py). Helpers shared across folders (servers.py, tiny_models.py, ranks.py)
# sit here: pytest's default import mode puts this conftest's folder on sys.path too, said
# explicitly here so that it does not hang on that. multiprocessing's spawned children get the
# same sys.path (tests/ranks.py relies on it).
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Property tests: thorough in CI, quick while iterating (RTP_HYPOTHESIS_PROFILE=dev).
settings.register_profile("ci", max_examples=150, deadline=None)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("RTP_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def default_gguf():
    """Path of rtp's default model (SmolLM2-135M-Instruct Q4_1 GGUF), fetched once into $RTP_HOME."""
    from rtp.checkpoint.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_model(default_gguf):
    """transformers' own fp32 load of the default GGUF (it dequantizes with the gguf package and
    undoes the q/k permutation): the reference for tensors and greedy tokens. Loaded once per
    session (about 20 s); tests that need it in another dtype deep-copy it."""
    transformers = pytest.importorskip("transformers")
    import torch

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf.parent), gguf_file=default_gguf.name, dtype=torch.float32)
    return model.eval()


# -- the shared RoPE tables stay as built ---------------------------------------------------------
# get_rope (rtp/models/rotary.py) hands every layer and every test with the same arguments one
# module, so one cos/sin table; rtp's C kernels read it by raw address (rope_store_kv, CPU-graph
# replays). A stray store into it, or a conversion of the shared module (.to(dtype)), showed up
# only as a wrong rotation many tests later (test_rotary, 4e-4 off, after ~370 passing tests).
# So each live table is checked before and after every test: a change fails the test that made
# it (at setup: it happened between tests, e.g. in a thread a test left running), and the table
# is put back so that later tests still see the right one.

_rope_references: dict[int, tuple[object, object, str]] = {}  # id(module) -> (module, clean table, first seen in)


def _rope_reference(rotary, key, rope, test: str):
    """The clean table of a shared RoPE module and the test it was first seen after: rebuilt
    from its key when first seen (so a table hit during the test that built it is caught too),
    kept from then on."""
    import torch

    known = _rope_references.get(id(rope))
    if known is not None and known[0] is rope:
        return known[1], known[2]
    table = rope.cos_sin_cache.detach().clone()
    try:
        head_dim, rotary_dim, max_position, base, scaling = key[:5]
        fresh = rotary._build_rope(head_dim, rotary_dim, max_position, base,
                                   None if scaling is None else dict(scaling)).cos_sin_cache.cpu()
    except Exception:  # a key layout this check does not know: trust the table as first seen
        fresh = table
    if (fresh.shape != table.shape or fresh.dtype != table.dtype
            or not torch.allclose(fresh, table, rtol=0, atol=1e-6)):
        table = fresh  # already wrong when first seen: _check_rope_tables reports it
    _rope_references[id(rope)] = (rope, table, test)
    return table, test


def _check_rope_tables(test: str, when: str) -> list[str]:
    import sys

    rotary = sys.modules.get("rtp.models.rotary")
    if rotary is None:
        return []
    import torch

    problems = []
    for key, rope in list(getattr(rotary, "_ROPE_CACHE", {}).items()):
        table = rope.cos_sin_cache
        if table.device.type != "cpu":
            continue
        ref, built = _rope_reference(rotary, key, rope, test)
        if table.dtype == ref.dtype and table.shape == ref.shape and torch.equal(table, ref):
            continue
        if table.dtype != ref.dtype or table.shape != ref.shape:
            what = f"is now {table.dtype} {tuple(table.shape)}, built as {ref.dtype} {tuple(ref.shape)}"
            rope.cos_sin_cache = ref.clone()
        else:
            diff = (table - ref).abs()
            rows = torch.nonzero(~(table == ref).all(dim=1)).flatten().tolist()
            what = (f"{len(rows)} of {table.shape[0]} rows changed (rows {rows[:8]}{' ...' if len(rows) > 8 else ''}),"
                    f" max abs change {diff.nan_to_num(float('inf')).max().item():.3g}")
            table.copy_(ref)
        problems.append(f"shared RoPE table {key[:5]} (built in or before {built}) {when}: {what}")
    return problems


@pytest.fixture(autouse=True)
def _rope_tables_unchanged(request):
    problems = _check_rope_tables(request.node.nodeid, "changed between tests, before this one")
    if problems:
        pytest.fail("\n".join(problems))
    yield
    problems = _check_rope_tables(request.node.nodeid, "changed during this test")
    if problems:
        pytest.fail("\n".join(problems))
