"""The pipelined loader: bit-identical to safetensors' own reader, clear errors for every kind
of broken checkpoint, and `rtp convert` round trips (rtp/checkpoint/loader.py, checkpoint.py,
safetensors_format.py, sequential_reader.py, convert.py).

Tiny random Llama checkpoints written with safetensors' own `save_file`, split in shards
with an index; chunk sizes far below the tensor sizes so that tensors straddle reads.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import random
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rtp.checkpoint import CheckpointError, open_checkpoint, stream_tensors
from rtp.checkpoint.loader import LoadOptions, load_model
from rtp.checkpoint.reader import ALIGN, SequentialReader, plan_reads

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 160, "hidden_size": 64,
          "intermediate_size": 112, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": False}
LAYER = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
         "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def tiny_tensors(tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights: bf16 matrices, fp32 norms (so loading in bf16 also converts)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab, d = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"], 16
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (4 * d, h), p + "self_attn.k_proj.weight": (2 * d, h),
                   p + "self_attn.v_proj.weight": (2 * d, h), p + "self_attn.o_proj.weight": (h, 4 * d),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    return {name: torch.randn(shape, generator=g).to(torch.float32 if len(shape) == 1 else torch.bfloat16)
            for name, shape in shapes.items()}


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], shards: int = 3, tied: bool = False,
                     **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**CONFIG, "tie_word_embeddings": tied, **config}))
    names = list(tensors)
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return path
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: tensors[n] for n in part}, path / file, metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def reference(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out |= load_file(file)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def o_direct_works(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


def reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rtp-reader"]


# ---- the read plan ------------------------------------------------------------------


class _Span:
    def __init__(self, path, begin, end):
        self.path, self.begin, self.end = path, begin, end


def test_read_plan_covers_every_span_in_order_with_aligned_reads():
    rng = random.Random(0)
    for _ in range(100):
        spans, offset = [], rng.randrange(0, 10_000)
        for f in range(rng.randint(1, 3)):
            for _ in range(rng.randint(1, 20)):
                offset += rng.choice([0, 0, rng.randrange(64)])  # GGUF-style gaps
                size = rng.choice([0, rng.randrange(1, 200), rng.randrange(1, 20_000)])
                spans.append(_Span(Path(f"f{f}"), offset, offset + size))
                offset += size
            offset = rng.randrange(0, 100)
        chunk = rng.choice([97, 4096, 10_000, 1 << 20])
        covered: dict[int, list[tuple[int, int]]] = {}
        order = []
        for read in plan_reads(spans, chunk):
            assert read.offset % ALIGN == 0 and read.length % ALIGN == 0
            assert read.length <= -(-chunk // ALIGN) * ALIGN + 2 * ALIGN
            for index, lo, hi in read.pieces:
                assert spans[index].path == read.path and read.offset <= lo <= hi <= read.offset + read.length
                covered.setdefault(index, []).append((lo, hi))
                order.append(index)
        assert order == sorted(order) and set(order) == set(range(len(spans)))
        for index, pieces in covered.items():  # the pieces of a span tile it exactly
            assert pieces[0][0] == spans[index].begin and pieces[-1][1] == spans[index].end
            assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))


# ---- bit-identical reads --------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("chunk", [777, 4096, 40_000, 32 << 20])
def test_stream_is_bit_identical_to_load_file(tmp_path, chunk, direct):
    path = write_checkpoint(tmp_path / "ckpt", tiny_tensors(tied=False), shards=3)
    expected = reference(path)
    records = open_checkpoint(path).records
    assert [(r.path, r.begin) for r in records] == sorted((r.path, r.begin) for r in records)
    seen = set()
    for record, tensor in stream_tensors(records, chunk_bytes=chunk, direct=direct):
        assert same_bits(tensor, expected[record.name]), record.name
        seen.add(record.name)
    assert seen == set(expected)
    assert not reader_threads()


def test_reader_uses_o_direct_when_forced_and_buffered_reads_otherwise(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", tiny_tensors(tied=False), shards=2)
    records = open_checkpoint(path).records
    for direct, mode in [(True, "direct"), (False, "buffered")]:
        if mode == "direct" and not o_direct_works(records[0].path):
            continue
        with SequentialReader(records, chunk_bytes=5000, direct=direct) as reader:
            for _ in reader:
                pass
        assert set(reader.modes.values()) == {mode}


@pytest.mark.parametrize("refused_at", ["open", "read"])
def test_o_direct_refused_falls_back_to_buffered_reads(tmp_path, monkeypatch, refused_at):
    """Filesystems without O_DIRECT refuse it with EINVAL, at open or at the first read."""
    path = write_checkpoint(tmp_path / "ckpt", tiny_tensors(tied=False), shards=1)
    records = open_checkpoint(path).records
    expected = reference(path)
    direct_fds = set()
    real_open, real_preadv = os.open, os.preadv

    def refusing_open(file, flags, *args):
        if flags & os.O_DIRECT and refused_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(file, flags, *args)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refusing_preadv(fd, buffers, offset, *flags):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "preadv", refusing_preadv)
    with SequentialReader(records, chunk_bytes=3000, direct=True) as reader:
        for index, raw in reader:
            assert same_bits(records[index].decode(raw), expected[records[index].name])
    assert set(reader.modes.values()) == {"buffered"}
    assert bool(direct_fds) == (refused_at == "read")


def test_auto_mode_reads_cached_files_buffered_and_cold_ones_direct(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", tiny_tensors(tied=False), shards=1)
    file = path / "model.safetensors"
    if not o_direct_works(file) or not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("needs O_DIRECT and RWF_NOWAIT")
    records = open_checkpoint(path).records

    def mode():
        with SequentialReader(records, chunk_bytes=5000) as reader:
            for _ in reader:
                pass
        return reader.modes[file]

    file.read_bytes()
    assert mode() == "buffered"  # just read: in the page cache
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert mode() == "direct"


def test_prefault_leaves_memory_as_it_was():
    from rtp.checkpoint.prefault import Prefault

    written = torch.arange(3 << 20, dtype=torch.int32)
    fresh = torch.empty(5 << 20, dtype=torch.uint8)
    with Prefault([written[7:], fresh]) as prefault:
        pass
    assert torch.equal(written, torch.arange(3 << 20, dtype=torch.int32))
    assert prefault.ranges[0] == (written[7:].data_ptr(), ((3 << 20) - 7) * 4)
    assert not [t for t in threading.enumerate() if t.name == "rtp-prefault"]


# ---- load_model: parameters equal to the checkpoint -----------------------------------


def expected_parameter(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    if ".qkv_proj." in name:
        return torch.cat([tensors[name.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj")])
    if ".gate_up_proj." in name:
        return torch.cat([tensors[name.replace("gate_up_proj", p)] for p in ("gate_proj", "up_proj")])
    if name == "lm_head.weight" and name not in tensors:
        return tensors["model.embed_tokens.weight"]
    return tensors[name]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_load_model_is_bit_identical_to_load_file(tmp_path, tied, direct):
    path = write_checkpoint(tmp_path / "ckpt", tiny_tensors(tied=tied), shards=3, tied=tied)
    # a stray file outside the index (Mistral repos ship consolidated.safetensors) is not read
    (path / "consolidated.safetensors").write_bytes(b"not a checkpoint")
    expected = {}
    for file in sorted(path.glob("model-*.safetensors")):
        expected |= load_file(file)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"), LoadOptions(chunk_bytes=1000, direct=direct))
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, param in params.items():
        assert same_bits(param.detach(), expected_parameter(name, expected).to(torch.bfloat16)), name
    if tied:
        assert params["lm_head.weight"] is params["model.embed_tokens.weight"]
    assert not reader_threads()


def test_tied_checkpoint_that_also_stores_the_head_loads(tmp_path):
    tensors = tiny_tensors(tied=True)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    path = write_checkpoint(tmp_path / "ckpt", tensors, shards=1, tied=True)
    model, _ = load_model(path, torch.float32, torch.device("cpu"), LoadOptions(chunk_bytes=4096))
    assert same_bits(model.lm_head.weight.detach(), tensors["model.embed_tokens.weight"].float())


# ---- broken checkpoints ----------------------------------------------------------------


def _header(file: Path) -> tuple[dict, int]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + n]), n


def _rewrite_header(file: Path, edit) -> None:
    """Apply edit(header) and write the file again with the same data (offsets are relative to it)."""
    header, n = _header(file)
    data = file.read_bytes()[8 + n:]
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _last_tensor(file: Path) -> str:
    header, _ = _header(file)
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


SHARD = "model-00002-of-00003.safetensors"


def _truncate(path):
    file = path / SHARD
    last = _last_tensor(file)
    os.truncate(file, file.stat().st_size - 10)
    return SHARD, last, "overruns the file"


def _matrix(file: Path) -> str:
    header, _ = _header(file)
    return next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)


def _overrun(path):
    file = path / SHARD
    name = _matrix(file)

    def edit(h):
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [b + 10**6, e + 10**6]
    _rewrite_header(file, edit)
    return SHARD, name, "overruns the file"


def _bad_json(path):
    file = path / SHARD
    raw = bytearray(file.read_bytes())
    raw[8:20] = b"{not json!!!"
    file.write_bytes(bytes(raw))
    return SHARD, "", "not valid JSON"


def _header_length(path):
    file = path / SHARD
    raw = bytearray(file.read_bytes())
    raw[:8] = struct.pack("<Q", 1 << 40)
    file.write_bytes(bytes(raw))
    return SHARD, "", "header length"


def _short_file(path):
    (path / SHARD).write_bytes(b"\x01\x02")
    return SHARD, "", "too short"


def _overlap(path):
    file = path / SHARD
    header, _ = _header(file)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a, b = names[0], names[1]

    def edit(h):
        size = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
        h[b]["data_offsets"] = [h[a]["data_offsets"][1] - 2, h[a]["data_offsets"][1] - 2 + size]
    _rewrite_header(file, edit)
    return SHARD, a, "overlap"


def _unknown_dtype(path):
    name = _matrix(path / SHARD)
    _rewrite_header(path / SHARD, lambda h: h[name].update(dtype="Q4"))
    return SHARD, name, "unknown dtype"


def _size_mismatch(path):
    name = _matrix(path / SHARD)
    _rewrite_header(path / SHARD, lambda h: h[name].update(shape=[h[name]["shape"][0] + 1, h[name]["shape"][1]]))
    return SHARD, name, "needs"


def _missing_tensor(path):
    tensors = tiny_tensors(tied=False)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    for file in path.glob("*.safetensors*"):
        file.unlink()
    write_checkpoint(path, tensors, shards=3)
    return "ckpt", "model.layers.1.mlp.down_proj.weight", "lacks"


def _missing_shard(path):
    (path / SHARD).unlink()
    return SHARD, "", "missing"


def _index_disagrees(path):
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = next(n for n, f in data["weight_map"].items() if f == SHARD)
    data["weight_map"][name] = "model-00001-of-00003.safetensors"
    index.write_text(json.dumps(data))
    return "model-00001-of-00003.safetensors", name, "lacks tensor"


def _wrong_shape(path):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    return "", "mlp.gate_proj.weight", "shape"


def _wrong_dtype(path):
    tensors = tiny_tensors(tied=False)
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = tensors[name].to(torch.int16)
    for file in path.glob("*.safetensors*"):
        file.unlink()
    write_checkpoint(path, tensors, shards=3)
    return "", name, "int16"


def _no_place(path):
    tensors = tiny_tensors(tied=False) | {"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}
    for file in path.glob("*.safetensors*"):
        file.unlink()
    write_checkpoint(path, tensors, shards=3)
    return "", "extra_proj", "no place"


@pytest.mark.parametrize("damage", [_truncate, _overrun, _bad_json, _header_length, _short_file, _overlap,
                                    _unknown_dtype, _size_mismatch, _missing_tensor, _missing_shard,
                                    _index_disagrees, _wrong_shape, _wrong_dtype, _no_place],
                         ids=lambda f: f.__name__.lstrip("_"))
def test_broken_checkpoint_is_a_clear_error_before_any_data_is_read(tmp_path, damage, monkeypatch):
    path = write_checkpoint(tmp_path / "ckpt", tiny_tensors(tied=False), shards=3)
    file, tensor, why = damage(path)

    def no_reads(*args, **kwargs):
        raise AssertionError("weights were read before the checkpoint was checked")

    monkeypatch.setattr(SequentialReader, "__iter__", no_reads)
    with pytest.raises(CheckpointError) as info:
        load_model(path, torch.bfloat16, torch.device("cpu"))
    message = str(info.value)
    assert file in message and tensor in message and why in message, message


def test_file_truncated_while_loading_names_file_and_tensor(tmp_path):
    path = write_checkpoint(tmp_path / "ckpt", tiny_tensors(tied=False), shards=1)
    records = open_checkpoint(path).records  # headers checked while the file was whole
    os.truncate(path / "model.safetensors", records[-1].begin + 3)
    with pytest.raises(CheckpointError, match=f"model.safetensors: cannot read tensor {records[-1].name}"):
        for _ in stream_tensors(records, chunk_bytes=1000, direct=False):
            pass
    assert not reader_threads()


def test_read_error_stops_the_reader_thread(tmp_path, monkeypatch):
    path = write_checkpoint(tmp_path / "ckpt", tiny_tensors(tied=False), shards=2)
    records = open_checkpoint(path).records
    real = os.preadv
    calls = []

    def failing(fd, buffers, offset, *flags):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(CheckpointError, match="Input/output error"):
        for _ in stream_tensors(records, chunk_bytes=2000, direct=False):
            pass
    assert not reader_threads()


# ---- GGUF through the same pipeline ----------------------------------------------------


def write_tiny_gguf(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A llama GGUF of `tensors` (HF names): matrices with 32-multiple rows as Q8_0, the rest F16/F32."""
    gguf = pytest.importorskip("gguf")
    from rtp.checkpoint import gguf as rtp_gguf

    to_gguf = {hf: name for name, hf in rtp_gguf._GLOBAL_NAMES.items()}
    to_layer = {hf: name for name, hf in rtp_gguf._LAYER_NAMES.items()}
    writer = gguf.GGUFWriter(str(file), "llama")
    writer.add_architecture()
    writer.add_context_length(CONFIG["max_position_embeddings"])
    writer.add_embedding_length(CONFIG["hidden_size"])
    writer.add_feed_forward_length(CONFIG["intermediate_size"])
    writer.add_block_count(CONFIG["num_hidden_layers"])
    writer.add_head_count(CONFIG["num_attention_heads"])
    writer.add_head_count_kv(CONFIG["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(CONFIG["vocab_size"])
    for name, t in tensors.items():
        stem = name.removesuffix(".weight")
        if stem in to_gguf:
            gguf_name = to_gguf[stem]
        else:
            _, _, layer, rest = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{to_layer[rest]}"
        w = t.float().numpy()
        if w.ndim == 2 and w.shape[1] % 32 == 0 and "embed" not in name:
            writer.add_tensor(gguf_name + ".weight", gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name + ".weight", w.astype("float16") if w.ndim == 2 else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_gguf_streams_the_same_tensors_at_any_chunk_size(tmp_path, direct):
    from rtp.checkpoint.gguf import GGUFCheckpoint

    file = tmp_path / "tiny.gguf"
    write_tiny_gguf(file, tiny_tensors(tied=False))
    ckpt = GGUFCheckpoint(file)
    whole = dict(ckpt.tensors())  # the path tests/checkpoint/test_gguf.py checks against transformers
    records = ckpt.records()
    assert max(r.nbytes for r in records) > 1000  # so chunks of 1000 bytes cut tensors
    got = {record.name: tensor.clone() for record, tensor in stream_tensors(records, chunk_bytes=1000,
                                                                              direct=direct)}
    assert set(got) == set(whole) == set(tiny_tensors(tied=False))
    for name, tensor in got.items():
        assert same_bits(tensor, whole[name]), name
    model, _ = load_model(file, torch.float32, torch.device("cpu"), LoadOptions(chunk_bytes=1000, direct=direct))
    assert same_bits(model.model.layers[1].mlp.down_proj.weight.detach(), whole["model.layers.1.mlp.down_proj.weight"])


# ---- rtp convert -------------------------------------------------------------------------


def test_convert_writes_the_model_order_in_shards_and_loads_identically(tmp_path):
    from rtp.cli import main

    src = write_checkpoint(tmp_path / "src", tiny_tensors(tied=True), shards=3, tied=True)
    (src / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    dst = tmp_path / "dst"
    assert main(["convert", str(src), str(dst), "--dtype", "fp32", "--shard-size", "30000",
                 "--chunk-size", "1000"]) == 0
    shards = sorted(dst.glob("*.safetensors"))
    assert len(shards) > 1 and (dst / "model.safetensors.index.json").is_file()
    assert (dst / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    assert json.loads((dst / "config.json").read_text())["torch_dtype"] == "float32"
    names = [r.name for r in open_checkpoint(dst).records]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "model.norm.weight"
    layer0 = [n.removeprefix("model.layers.0.").removesuffix(".weight") for n in names if ".layers.0." in n]
    assert layer0 == ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                      "post_attention_layernorm"]
    expected = reference(src)
    converted = reference(dst)
    assert set(converted) == set(expected)
    for name, tensor in converted.items():
        assert same_bits(tensor, expected[name].float()), name
    a, _ = load_model(src, torch.float32, torch.device("cpu"))
    b, _ = load_model(dst, torch.float32, torch.device("cpu"))
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert same_bits(p.detach(), q.detach()), name
    assert main(["convert", str(src), str(dst)]) == 1  # never over an existing directory
    assert not list(tmp_path.glob(".dst.partial-*"))


@pytest.fixture(scope="module")
def converted_default(default_gguf, tmp_path_factory):
    from rtp.checkpoint.convert import convert

    dst = tmp_path_factory.mktemp("convert") / "smollm2"
    convert(default_gguf, dst)  # a GGUF converts to exact fp32 by default
    return dst


def test_converted_default_model_gives_the_same_greedy_output(default_gguf, converted_default):
    from rtp.llm import LLM
    from rtp.sampling_params import SamplingParams

    assert {p.name for p in converted_default.iterdir()} == {
        "model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = []
    for model in (default_gguf, converted_default):
        llm = LLM(model=str(model), dtype="float32", compile=False, max_num_seqs=1, max_model_len=64)
        tok = llm.tokenizer
        chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       tokenize=True)
        outputs.append({"greedy": llm.generate(chat, params)[0].outputs[0].token_ids, "chat": chat,
                        "ids": tok.encode("Hello, world! 123 <|im_start|>user\n"),
                        "eos": tok.eos_token_ids, "bos": tok.bos_token_id})
        del llm
    assert outputs[0] == outputs[1]
