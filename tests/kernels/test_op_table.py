"""The op table (rtp/kernels/ops.py) against what was built from it: every op has its C function in the
extension, an entry in the replay's table (kernel_ops.c) that agrees with the definition, a Python entry
point with the table's fields, and a torch-facing wrapper in cpu_kernels.py; and recorded calls keep
the word layout they had before the table existed."""

import ast
import ctypes
import inspect
import pathlib
import struct

import pytest
import torch

from rtp.kernels import cpu_kernels, ops

pytestmark = pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs rtp's CPU kernels (AVX-512 BF16)")

# (code, rows word, address words) of every op as kernel_calls.c spelled them by hand before the table:
# a CPU graph holds these numbers, so an op keeps its code and layout (append new ops, never reorder).
RECORDED_LAYOUT = {
    "linear_q4_1": (1, 10, 0xfa), "linear_q8": (2, 11, 0x1ba), "linear_tiles": (3, 10, 0xe2),
    "add_rms_norm": (4, 12, 0x24a), "rope_store_kv": (5, 11, 0x305da), "decode_attention": (6, 9, 0x301ae),
    "embed_rows": (7, 7, 0x32), "silu_mul": (8, 5, 0xa), "prefill_attention": (9, 0, 0x1808ee),
    "gather_rows": (10, 4, 0x2a), "linear_q4_k": (11, 10, 0xfa), "linear_bf16": (12, 10, 0xd2),
    "linear_u8": (13, 13, 0x672), "rms_norm": (14, 10, 0x92), "qk_rms_norm": (15, 7, 0x1a),
    "gelu_tanh_mul": (16, 5, 0xa), "softcap": (17, 4, 0x2),
}


def test_recorded_calls_keep_their_layout():
    for name, (code, rows, addresses) in RECORDED_LAYOUT.items():
        op = ops.BY_NAME[name]
        assert (op.code, op.rows_word, op.address_mask) == (code, rows, addresses), name
    assert [op.code for op in ops.OPS] == list(range(1, len(ops.OPS) + 1))
    assert cpu_kernels.CALL_WORDS == cpu_kernels._k.CALL_WORDS == ops.CALL_WORDS


@pytest.mark.parametrize("op", ops.OPS, ids=lambda op: op.name)
def test_every_op_has_its_function_replay_entry_and_binding(op):
    lib = ctypes.CDLL(cpu_kernels._k.__file__)
    for _, function in op.functions_on(ops.ARCH):  # every ISA path's variant of this architecture (AArch64's:
        assert hasattr(lib, function), f"{function} is not in {cpu_kernels._k.__file__}"  # test_arm_kernels.py)
    # the replay's entry (rtp_ops[], generated from the same table) agrees with the definition
    assert cpu_kernels._k.op_entry(op.code) == (op.name, op.words, op.rows_word, op.plan_word(ops.DECODE_ROWS),
                                                op.plan_word(ops.PREFILL_ROWS), op.plan_when_word, op.address_mask,
                                                ops.ISAS.index(op.lowest_isa) + 1)
    assert cpu_kernels._k.rows_word(op.code) == op.rows_word == cpu_kernels.rows_word(op.code)
    assert cpu_kernels._k.address_words(op.code) == op.address_mask == cpu_kernels.address_words(op.code)
    assert cpu_kernels._k.OP_NAMES[op.code] == op.name == cpu_kernels.op_name(op.code)
    # the Python entry point takes the op's fields, in word order
    params = list(inspect.signature(getattr(cpu_kernels._k, op.name)).parameters)
    assert params == [f.name for f in op.fields]


def test_codes_outside_the_table_run_nothing():
    for code in (0, -1, len(ops.OPS) + 1, 1 << 40):
        assert cpu_kernels._k.op_entry(code) is None
        assert cpu_kernels._k.rows_word(code) == 0 and cpu_kernels._k.address_words(code) == 0
    calls = torch.zeros(1, ops.CALL_WORDS, dtype=torch.int64)
    calls[0, 0] = len(ops.OPS) + 1
    with pytest.raises(ValueError, match=f"no kernel op {len(ops.OPS) + 1}"):
        cpu_kernels.run_calls(calls.numpy(), 0)


def _wrapped_ops() -> set[str]:
    """The _k entry points that functions of cpu_kernels.py call."""
    tree = ast.parse(pathlib.Path(cpu_kernels.__file__).read_text())
    return {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "_k"}


def test_every_op_has_a_torch_wrapper():
    missing = [op.name for op in ops.OPS if op.name not in _wrapped_ops()]
    assert not missing, f"ops no function of rtp/kernels/cpu_kernels.py calls: {missing}"


def test_an_entry_point_writes_the_fields_in_table_order():
    """softcap's call as recorded: each field in its word, the float as a double's bits, zeros after."""
    x = torch.ones(3, 40)
    cpu_kernels.record_start()
    cpu_kernels.softcap(x[:2, :33], 30.0)
    words = list(cpu_kernels.record_stop())
    op = ops.BY_NAME["softcap"]
    assert len(words) == ops.CALL_WORDS and words[0] == op.code
    named = dict(zip((f.name for f in op.fields), words[1:]))
    assert named == {"x": x.data_ptr(), "ldx": 40, "cap": struct.unpack("<q", struct.pack("<d", 30.0))[0],
                     "t": 2, "n": 33}
    assert words[op.words:] == [0] * (ops.CALL_WORDS - op.words)
