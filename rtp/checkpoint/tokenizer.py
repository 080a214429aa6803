"""Tokenizer: HF `tokenizers` for text <-> ids, jinja2 for chat templates, and an
incremental detokenizer for streaming.

Two sources:
  HF directory   tokenizer.json (+ tokenizer_config.json for the chat template and
                 the bos/eos/pad names, generation_config.json for extra stop ids)
  .gguf file     llama.cpp's `tokenizer.ggml.*` metadata, rebuilt into a
                 `tokenizers.Tokenizer`: byte-level BPE (tokenizer.ggml.model 'gpt2') or
                 SentencePiece BPE ('llama': Llama-2, Mistral, Gemma); see `_gguf_backend`

`IncrementalDetokenizer` turns a stream of ids into text pieces the way vLLM does:
decode a short window twice (up to the last emitted token, and up to the newest)
and emit the difference, holding back while the window ends in a partial UTF-8
character. Pieces concatenate to `decode(ids)`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

# Chat-turn and document terminators that stop generation when the vocabulary has
# them as special tokens, besides the declared eos (llama.cpp's end-of-generation set
# works the same way). SmolLM2's eos is <|im_end|>; it also ends documents with
# <|endoftext|>.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>",
               "<end_of_turn>", "<|end_of_text|>")

# llama.cpp token types (tokenizer.ggml.token_type); unused (5) and byte (6) tokens
# are plain vocabulary entries here
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# SentencePiece writes a space as U+2581 inside its pieces
_SPACE_MARK = "\u2581"
# ids llama.cpp assumes for a SentencePiece vocabulary whose file does not name them
_SENTENCEPIECE_DEFAULT_IDS = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}

# Pre-tokenizer split regexes, by llama.cpp's `tokenizer.ggml.pre` name. None means
# ByteLevel's built-in GPT-2 pattern.
_GPT2 = None
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# name -> (regex, split every digit first, ignore_merges)
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool, bool]] = {
    **{name: (_GPT2, False, False) for name in ("default", "gpt2", "gpt-2", "phi-2", "olmo")},
    # GPT-2 pattern after isolating each digit (SmolLM's tokenizer.json: Digits + ByteLevel)
    **{name: (_GPT2, True, False) for name in
       ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")},
    # llama.cpp tokenizes llama3-family vocabularies with ignore_merges, like tiktoken
    **{name: (_LLAMA3, False, True) for name in
       ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")},
    **{name: (_QWEN2, False, False) for name in ("qwen2", "deepseek-r1-qwen", "megrez")},
}


_GIL_FREE_CHARS = 16 << 10  # texts this long are encoded without holding the GIL
_GIL_FREE_IDS = 4 << 10  # id lists this long are decoded without holding the GIL


class TokenizerError(ValueError):
    """A tokenizer source that cannot be loaded."""


class Tokenizer:
    """Text <-> token ids, chat templates and the special ids the engine stops on."""

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, unk_token: str | None = None,
                 extra_eos_token_ids: Iterable[int] = ()):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.bos_token_id = self._id(bos_token)
        self.eos_token_id = self._id(eos_token)
        self.pad_token_id = self._id(pad_token)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        eos = [self.eos_token_id, *extra_eos_token_ids]
        eos += [self._id(t) for t in _END_TOKENS if t in specials]
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos if i is not None))
        self._template = None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # ---- loading ---------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """From an HF checkpoint directory (or its tokenizer.json) or a .gguf file."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer source not found: {path}")
        if path.is_file() and path.name == "tokenizer.json":
            return cls.from_hf_dir(path.parent)
        if path.is_file():
            return cls.from_gguf(path)
        return cls.from_hf_dir(path)

    def use_chat_template(self, spec: str) -> None:
        """Replace the chat template: a Jinja file, or the name of one rtp ships (chat_templates/)."""
        shipped = _CHAT_TEMPLATES / f"{spec}.jinja"
        path = shipped if shipped.is_file() else Path(spec).expanduser()
        if not path.is_file():
            names = ", ".join(sorted(p.stem for p in _CHAT_TEMPLATES.glob("*.jinja")))
            raise FileNotFoundError(f"chat template {spec!r} is neither a file nor one rtp ships ({names})")
        source = path.read_text(encoding="utf-8")
        _compile_template(source)  # a template that does not parse fails at startup, not per request
        self.chat_template, self._template = source, None

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        tokenizer_json = path / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise TokenizerError(
                f"{path} has no tokenizer.json; rtp needs a fast-tokenizer file (save one with "
                f"transformers: AutoTokenizer.from_pretrained(...).save_pretrained(dir)) or a .gguf file")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")

        def token(name):
            value = config.get(name, special_map.get(name))
            return value.get("content") if isinstance(value, dict) else value

        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if template is None:
            template = _read_json(path / "chat_template.json").get("chat_template")

        generation = _read_json(path / "generation_config.json") or _read_json(path / "config.json")
        extra_eos = generation.get("eos_token_id")
        extra_eos = extra_eos if isinstance(extra_eos, list) else [] if extra_eos is None else [extra_eos]
        return cls(backend, chat_template=template, bos_token=token("bos_token"),
                   eos_token=token("eos_token"), pad_token=token("pad_token"),
                   unk_token=token("unk_token"), extra_eos_token_ids=extra_eos)

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        from rtp.checkpoint.gguf_header import GGUFFile  # no torch: `rtp route` loads a GGUF's tokenizer

        gguf = GGUFFile(path)
        meta = dict(gguf.tokenizer_metadata)
        tokens = meta.get("tokens")
        if not tokens:
            raise TokenizerError(f"{path} has no tokenizer.ggml.tokens")
        if meta.get("model") == "llama":
            for key, default in _SENTENCEPIECE_DEFAULT_IDS.items():
                meta.setdefault(key, default)

        def token(key):
            index = meta.get(key)
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        backend = _gguf_backend(meta, str(path), token("bos_token_id"), token("eos_token_id"),
                                architecture=gguf.get("general.architecture"))
        return cls(backend, chat_template=meta.get("chat_template"), bos_token=token("bos_token_id"),
                   eos_token=token("eos_token_id"), pad_token=token("padding_token_id"),
                   unk_token=token("unknown_token_id"))

    # ---- text <-> ids ----------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) >= _GIL_FREE_CHARS:
            # the tokenizers library holds the GIL through encode() (0.4 s for a 1 MB prompt here,
            # measured, with every other thread stopped) but lets it go in encode_batch()
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) >= _GIL_FREE_IDS:
            # decode() holds the GIL too (a million ids: 0.13 s here, 0.38 s on a slower CPU, every
            # other thread stopped, the server's event loop included); decode_batch() lets it go
            return self.backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ---- chat ------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render a conversation with the model's chat template (jinja2, sandboxed).

        Extra keyword arguments (tools, documents, enable_thinking, ...) reach the template
        as variables. With tokenize=True the text is encoded without adding special tokens:
        templates write their own bos.
        """
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                     "pad_token": self.pad_token, "unk_token": self.unk_token}
        variables.update(kwargs)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **variables)
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalDetokenizer:
    """Feed ids one at a time, get text pieces back.

    Keeps two offsets into a short window of ids (vLLM's scheme): `prefix` .. `read` is
    already-emitted tokens decoded again for context (byte-level merges and SentencePiece's
    leading-space rule depend on the neighbours), `read` .. end is not yet emitted. Each
    step decodes only that window, so the cost per token does not grow with the sequence,
    and the window is all it keeps (the runtime holds the request's tokens). `read` only
    ever stops where the text is whole, so the window never starts inside a UTF-8 character.
    """

    _CONTEXT = 6  # prompt tokens of context, so the first generated piece decodes as it would in place

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)[-self._CONTEXT:]  # the window
        self._prefix, self._read = 0, len(self.ids)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes ('' while a character is still partial)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._advance()
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end of a stream: whatever `add` held back (e.g. a byte sequence never completed)."""
        if self._read == len(self.ids):
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        piece = self._decode(self._prefix)[len(prefix_text):]
        self._advance()
        return piece

    def _advance(self) -> None:
        """Everything in the window is emitted: what was unread becomes the context."""
        del self.ids[:self._read]
        self._prefix, self._read = 0, len(self.ids)


# ---- GGUF -> tokenizers.Tokenizer --------------------------------------------


def _gguf_backend(meta: dict, source: str, bos: str | None, eos: str | None,
                  architecture: str | None = None) -> tokenizers.Tokenizer:
    """The tokenizer llama.cpp runs for a GGUF file, rebuilt from its `tokenizer.ggml.*` metadata."""
    kind = meta.get("model")
    if kind == "gpt2":
        return _byte_level_bpe(meta, source, bos, eos)
    if kind == "llama":
        return _sentencepiece_bpe(meta, source, bos, eos, architecture)
    raise TokenizerError(f"{source}: GGUF tokenizer model {kind!r} is not supported (rtp builds 'gpt2', "
                         f"byte-level BPE, and 'llama', SentencePiece); load the tokenizer from the "
                         f"model's HF directory instead")


def _byte_level_bpe(meta: dict, source: str, bos: str | None, eos: str | None) -> tokenizers.Tokenizer:
    """tokenizer.ggml.model 'gpt2': byte-level BPE after the pre-tokenizer `tokenizer.ggml.pre` names."""
    tokens: list[str] = meta["tokens"]
    types: list[int] = meta.get("token_type") or [_NORMAL] * len(tokens)
    merges_raw = meta.get("merges")
    if not merges_raw:
        raise TokenizerError(f"{source}: byte-level GGUF tokenizer has no tokenizer.ggml.merges")
    pre = meta.get("pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        # The split decides which merges can ever apply; guessing one would hand the model ids
        # it was not trained on, with nothing to show for it but worse output.
        raise TokenizerError(
            f"{source}: unknown tokenizer.ggml.pre {pre!r}, so rtp cannot tell how this vocabulary "
            f"splits text (known: {', '.join(sorted(_PRE_TOKENIZERS))}); load the tokenizer from the "
            f"model's HF directory instead")
    regex, split_digits, ignore_merges = _PRE_TOKENIZERS[pre]

    # The vocabulary as the file spells it: normal tokens in the byte-level alphabet,
    # control/user-defined tokens as their literal text (they are matched whole, as
    # added tokens, before BPE runs). Duplicated spellings keep their first id.
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in merges_raw if m.count(" ") == 1]
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges,
                                              fuse_unk=False, byte_fallback=False))
    if regex is None:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        byte_level = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if split_digits:
        byte_level = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()

    _add_whole_tokens(backend, tokens, types, special_types={_CONTROL})
    _add_bos_eos(backend, bos if meta.get("add_bos_token") else None,
                 eos if meta.get("add_eos_token") else None)
    return backend


def _sentencepiece_bpe(meta: dict, source: str, bos: str | None, eos: str | None,
                       architecture: str | None) -> tokenizers.Tokenizer:
    """tokenizer.ggml.model 'llama': a SentencePiece vocabulary (Llama-2, Mistral, Gemma).

    llama.cpp (like SentencePiece's own BPE) writes every space as U+2581, starts from single
    characters and keeps joining the adjacent pair whose joined piece is in the vocabulary
    with the best score; a character with no piece falls back to its UTF-8 bytes as
    <0xXX> tokens. That is BPE whose merges rank by the score of what they produce, so it is
    built as a `models.BPE` with byte fallback. The file says nothing about how its
    SentencePiece model was trained: a unigram-trained vocabulary is tokenized the same way
    (as llama.cpp does), not by unigram's best-path search.
    """
    tokens: list[str] = meta["tokens"]
    types: list[int] = meta.get("token_type") or [_NORMAL] * len(tokens)
    gemma = (architecture or "").startswith("gemma")

    # Gemma's files store their whitespace-run pieces with real spaces. Text reaches the model
    # with every space already turned into U+2581, so only that spelling can ever match; such a
    # piece becomes an ordinary vocabulary entry instead of an added token matched in the raw text.
    spelled = [t.replace(" ", _SPACE_MARK) if " " in t and t.isspace() else t for t in tokens]
    respelled = {i for i, (t, s) in enumerate(zip(tokens, spelled)) if t != s}
    vocab: dict[str, int] = {}
    for i, t in enumerate(spelled):
        vocab.setdefault(t, i)

    if meta.get("merges"):  # written by converters that start from a tokenizer.json
        merges = [tuple(m.split(" ", 1)) for m in meta["merges"] if m.count(" ") == 1]
    else:
        scores = meta.get("scores")
        if gemma or not scores:
            # transformers' converter ranks Gemma's pieces by file position, having found that
            # their scores do not follow the merge order (SentencePiece's BPE trainer appends
            # pieces in the order it creates them). Ranking them the same way gives the same ids.
            priority = [-float(i) for i in range(len(spelled))]
        else:
            priority = [float(x) for x in scores]
        merges = _merges_by_priority(spelled, types, priority, respelled)

    unk_id = meta.get("unknown_token_id")
    unk = spelled[unk_id] if unk_id is not None and 0 <= unk_id < len(spelled) else None
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True,
                                              byte_fallback=True))

    # llama.cpp puts SentencePiece's leading space before every stretch of text, one after a
    # special token included (Llama-2's reference code encoded each turn on its own, so
    # "<s>[INST]" is "<s>" "▁[INST]"). A normalizer runs on each stretch between added tokens
    # separately, which gives exactly that; Metaspace's "first" scheme (transformers' current
    # LlamaTokenizer) would prefix only the start of the text. Gemma writes no leading space:
    # its converter says add_space_prefix=false; files from before that flag go by architecture.
    add_prefix = meta.get("add_space_prefix")
    if add_prefix is None:
        add_prefix = not gemma
    spaces = normalizers.Replace(" ", _SPACE_MARK)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE_MARK), spaces]) if add_prefix else spaces
    decode_steps = [decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:  # drop the space the encoder added (once, after Fuse made the text one piece)
        decode_steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(decode_steps)

    # <unk> is written in text as itself (Llama's tokenizer.json lists it as special, and
    # llama.cpp matches unknown-type tokens whole as it does control ones)
    user_types = [_NORMAL if i in respelled else k for i, k in enumerate(types)]
    _add_whole_tokens(backend, tokens, user_types, special_types={_CONTROL, _UNKNOWN})
    # SentencePiece vocabularies start with BOS unless the file says otherwise (llama.cpp's default)
    _add_bos_eos(backend, bos if meta.get("add_bos_token", True) else None,
                 eos if meta.get("add_eos_token", False) else None)
    return backend


def _merges_by_priority(pieces: list[str], types: list[int], priority: list[float],
                        whole_words: set[int]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: each way to cut a piece into two other
    pieces, ranked by the piece's priority (its score), best first.

    Only pieces text can turn into are targets: normal ones, and user-defined ones that are
    matched as vocabulary entries (`whole_words`, the respelled whitespace runs). Control,
    byte and unused pieces never come out of plain text in SentencePiece.
    Ties (equal scores are common in small or unigram vocabularies) go to the longer left
    part, then file order: transformers breaks them that way, and agreeing costs nothing.
    Costs one dict lookup per cut: a second or two for a 256k-piece vocabulary.
    """
    first_id: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        first_id.setdefault(piece, i)
    ranked = []
    for i, piece in enumerate(pieces):
        if first_id[piece] != i or not (types[i] == _NORMAL or i in whole_words):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in first_id and right in first_id:
                ranked.append((-priority[i], -cut, cut - len(piece), i, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_whole_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int],
                      special_types: set[int]) -> None:
    """Tokens llama.cpp matches whole in the raw text before the model splits it: those of
    `special_types` as special tokens (skipped when decoding with skip_special_tokens),
    user-defined ones as plain added tokens. Either kind cuts the text into stretches that
    are normalized (and, for SentencePiece, given their leading space) one by one."""
    special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in special_types]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _add_bos_eos(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    """Wrap encode(..., add_special_tokens=True) in the given bos/eos (None: not added)."""
    single, pair, ids = ["$A"], ["$A", "$B"], {}
    if bos is not None:
        single, pair = [bos, *single], [bos, "$A", bos, "$B"]
        ids[bos] = backend.token_to_id(bos)
    if eos is not None:
        single, pair = [*single, eos], [*pair, eos]
        ids[eos] = backend.token_to_id(eos)
    if ids:
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=list(ids.items()))


# ---- chat templates ------------------------------------------------------------

_CHAT_TEMPLATES = Path(__file__).parent / "chat_templates"


def _compile_template(source: str):
    """A jinja2 template in a sandbox, configured as transformers renders chat templates."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (used to mark assistant tokens) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not parse: {e}") from e


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
