"""SentencePiece vocabularies in GGUF files (tokenizer.ggml.model 'llama': Llama-2, Mistral,
Gemma): rtp's tokenizer against transformers' GGUF conversion and against sentencepiece itself.

No model hub: small SentencePiece models are trained here on the text below, then written as
GGUF files the way llama.cpp's converter writes them (tokens, scores, token types, special
ids, add_bos_token). Three flavours:

  bpe      BPE-trained, Llama layout: a leading space before the text (add_dummy_prefix)
  unigram  unigram-trained, same layout. llama.cpp, transformers and rtp all tokenize a
           'llama' vocabulary by merging the best-scored pair (the file does not say how it
           was trained), so this is compared with transformers, not with sentencepiece
  gemma    BPE-trained without the leading space, in a file that says general.architecture
           'gemma2' and add_space_prefix=false and spells its whitespace-run pieces with
           real spaces, as Gemma's GGUFs do. (transformers converts 'gemma2' and 'gemma3'
           files; it rejects plain 'gemma' as an architecture it does not support.)

Where rtp and transformers differ, it is on purpose and tested as such below: rtp tokenizes
as llama.cpp (and sentencepiece, and Llama-2's own tokenizer.json) do.
"""

import random

import pytest

from rtp.checkpoint.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

# Training text: prose in a few scripts, code, numbers, whitespace runs. Lines are shuffled
# into a few thousand sentences so the trainer sees repeated words to merge.
CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Language models read text as tokens; a tokenizer turns words into numbers and back again.",
    "She said: \"It's not what you think, and we'll never know what they'd have done.\"",
    "Il était une fois une petite café naïve à la façade élégante, près de l'église.",
    "Die Straße ist heute sehr schön, aber über den Bergen ziehen dunkle Wolken auf.",
    "Москва — столица России, а Санкт-Петербург — её культурная столица.",
    "中文测试：机器学习模型需要大量的数据。日本語のテキストも少し入れます。",
    "한국어 문장도 포함합니다. 토크나이저는 모든 언어를 처리해야 합니다.",
    "def square(x):\n    return x ** 2  # the square of x",
    "for i in range(10):\n        print(f\"{i}: {square(i)}\")",
    "if (count > 0 && items[count - 1] != NULL) { free(items[--count]); }",
    "{\"name\": \"rtp\", \"version\": \"0.1.0\", \"tags\": [\"llm\", \"inference\"]}",
    "Numbers: 0 1 2 3 4 5 6 7 8 9, 42, 3.14159, 2024-05-01, 1,000,000 and 0x1F.",
    "    indented    with   runs   of     spaces\tand\ttabs",
    "emoji 😀 and 🚀 and 🎉 appear in chats 😀😀 sometimes.",
    "Prices rose 12% in Q3; the CEO's memo (dated 07/11) blamed supply chains.",
]
USER_DEFINED = ["<tool>"]  # matched whole in text, never split
CONTROL = ["<|im_end|>"]  # a chat-turn terminator rtp stops on

# Text to tokenize. None has an added token in it or starts with a space (those are the
# tests further down).
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "trailing spaces  ",
    "def square(x):\n    return x ** 2  # comment\n\n\tindented = {'k': [1, 2]}\n",
    "emoji 😀🚀 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "中文测试，日本語のテキスト、한국어 문장",
    "Москва и Санкт-Петербург",
    "numbers 12345 and 3.14159, fullwidth ２０２４",
    "it's don't we'll I'M THEY'RE",
    "\n\n\n   \r\n\tx\n",
    "ÄÖÜ ß café naïve façade",
    "unseen letters ǅ ﬁ Ω ∀x∈ℝ",  # not in the vocabulary: byte fallback
    "",
]
LEADING_SPACE_TEXTS = [" ", "  ", " a single leading space", "  two leading spaces", " \n space then newline"]


def _train(directory, name: str, model_type: str, add_dummy_prefix: bool, gemma_specials: bool = False):
    lines = [line for line in CORPUS_LINES for _ in range(3)] + USER_DEFINED * 20
    random.Random(0).shuffle(lines)
    corpus = directory / f"{name}.txt"
    corpus.write_text("\n".join(lines * 20), encoding="utf-8")
    # Llama-2's settings: no normalization beyond spaces (a 'llama' GGUF has no field for a
    # normalizer), digits one by one, whitespace-only pieces, bytes for what is not in the vocabulary
    specials = {}
    if gemma_specials:  # Gemma's names and ids (transformers' GemmaTokenizer adds them if missing)
        specials = {"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3, "pad_piece": "<pad>",
                    "eos_piece": "<eos>", "bos_piece": "<bos>", "unk_piece": "<unk>"}
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / name), model_type=model_type, vocab_size=700,
        hard_vocab_limit=False, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix, split_digits=True,
        allow_whitespace_only_pieces=True, character_coverage=1.0, user_defined_symbols=USER_DEFINED,
        control_symbols=CONTROL + (["<mask>"] if gemma_specials else []), num_threads=1, minloglevel=2,
        **specials)
    return spm.SentencePieceProcessor(model_file=str(directory / f"{name}.model"))


def _write_gguf(path, sp, architecture: str, *, add_space_prefix: bool | None = None,
                spaces_as_spaces: bool = False, special_ids: bool = True) -> None:
    """The tokenizer.ggml.* keys as llama.cpp's converter writes a SentencePiece model."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_unknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            kind = gguf.TokenType.CONTROL
        elif sp.is_unused(i):
            kind = gguf.TokenType.UNUSED
        elif sp.is_byte(i):
            kind = gguf.TokenType.BYTE
        elif piece in USER_DEFINED:  # sentencepiece's Python API cannot say; we defined them
            kind = gguf.TokenType.USER_DEFINED
        else:
            kind = gguf.TokenType.NORMAL
        if spaces_as_spaces and set(piece) == {"\u2581"} and len(piece) > 1:
            piece, kind = " " * len(piece), gguf.TokenType.USER_DEFINED  # as Gemma's GGUFs store them
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types.append(int(kind))
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    if special_ids:
        writer.add_bos_token_id(sp.bos_id())
        writer.add_eos_token_id(sp.eos_id())
        writer.add_unk_token_id(sp.unk_id())
        if sp.pad_id() >= 0:
            writer.add_pad_token_id(sp.pad_id())
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class Flavour:
    def __init__(self, directory, name, model_type, architecture, leading_space):
        self.name, self.leading_space = name, leading_space
        self.sp = _train(directory, name, model_type, add_dummy_prefix=leading_space,
                         gemma_specials=architecture.startswith("gemma"))
        self.path = directory / f"{name}.gguf"
        _write_gguf(self.path, self.sp, architecture, add_space_prefix=None if leading_space else False,
                    spaces_as_spaces=not leading_space)
        self.tok = Tokenizer.from_pretrained(self.path)
        self._hf = None

    @property
    def hf(self):
        if self._hf is None:
            transformers = pytest.importorskip("transformers")
            transformers.logging.set_verbosity_error()
            self._hf = transformers.AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        return self._hf

    def sp_ids(self, text: str) -> list[int]:
        """sentencepiece's own ids, with the BOS the file asks for."""
        return [self.sp.bos_id(), *self.sp.encode(text)]


@pytest.fixture(scope="module")
def flavours(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spm")
    return {
        "bpe": Flavour(directory, "bpe", "bpe", "llama", leading_space=True),
        "unigram": Flavour(directory, "unigram", "unigram", "llama", leading_space=True),
        "gemma": Flavour(directory, "gemma", "bpe", "gemma2", leading_space=False),
    }


@pytest.fixture(params=["bpe", "unigram", "gemma"])
def flavour(request, flavours):
    return flavours[request.param]


# ---- against transformers and sentencepiece ----------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(flavour, text):
    tok, hf = flavour.tok, flavour.hf
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert tok.decode(ids) == text  # identity normalization and byte fallback lose nothing


@pytest.mark.parametrize("name", ["bpe", "gemma"])
@pytest.mark.parametrize("text", TEXTS + LEADING_SPACE_TEXTS)
def test_bpe_vocabularies_match_sentencepiece(flavours, name, text):
    flavour = flavours[name]
    ids = flavour.tok.encode(text)
    assert ids == flavour.sp_ids(text)
    assert flavour.tok.decode(ids) == flavour.sp.decode(ids[1:]) == text


@pytest.mark.parametrize("text", LEADING_SPACE_TEXTS)
def test_text_starting_with_a_space(flavours, text):
    # SentencePiece puts its leading space before the text whatever the text starts with:
    # " a" is "▁▁a". transformers' Metaspace pre-tokenizer skips it when the text already
    # starts with one, so its ids differ from sentencepiece's and llama.cpp's here.
    for name in ("bpe", "unigram"):
        flavour = flavours[name]
        ids = flavour.tok.encode(text)
        assert ids[:2] == flavour.sp_ids(text)[:2]  # the same start as sentencepiece ...
        assert ids != flavour.hf.encode(text)  # ... not transformers' (if it is fixed, drop this)
        assert flavour.tok.decode(ids) == flavour.hf.decode(ids, skip_special_tokens=True) == text
    gemma = flavours["gemma"]  # no leading space to add: the same everywhere
    assert gemma.tok.encode(text) == gemma.hf.encode(text) == gemma.sp_ids(text)


def test_whitespace_run_pieces(flavours):
    # The gemma file spells "▁▁▁▁" as four real spaces; rtp (like transformers) respells it,
    # so indentation is one token, not four
    gemma = flavours["gemma"]
    four = gemma.sp.piece_to_id("\u2581" * 4)
    assert four != gemma.sp.unk_id()
    assert gemma.tok.id_to_token(four) == "\u2581" * 4
    assert gemma.tok.encode("    x", add_special_tokens=False) == gemma.sp.encode("    x")
    assert four in gemma.tok.encode("    x", add_special_tokens=False)
    assert gemma.tok.decode([four]) == "    "


# ---- added tokens: the places rtp follows llama.cpp rather than transformers --------------


def _per_stretch(flavour, text: str) -> list[int]:
    """llama.cpp's ids: each stretch of text between added tokens is encoded on its own
    (with the leading space, where the vocabulary has one), the added tokens as their ids."""
    tok, sp, ids = flavour.tok, flavour.sp, [flavour.sp.bos_id()]
    added = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)]
    whole = sorted(added + USER_DEFINED, key=len, reverse=True)
    rest = text
    while rest:
        hits = [(rest.find(t), t) for t in whole if t in rest]
        if not hits:
            ids += flavour.sp.encode(rest)
            break
        at, token = min(hits)
        if at:
            ids += flavour.sp.encode(rest[:at])
        ids.append(tok.token_to_id(token))
        rest = rest[at + len(token):]
    return ids


ADDED_TOKEN_TEXTS = ["x<|im_end|>y", "<s>hi</s> there", "<bos>hi<eos> there", "a <tool> b", "<tool>", "<unk> z",
                     "hi<|im_end|>"]


@pytest.mark.parametrize("text", ADDED_TOKEN_TEXTS)
def test_added_tokens_split_the_text_like_llama_cpp(flavours, text):
    # Control, unknown and user-defined tokens are matched whole, and the text after one gets
    # its own leading space: llama.cpp does that, and so did Llama-2's reference code and
    # tokenizer.json ("<s>[INST]" is "<s>" "▁[INST]"). transformers' LlamaTokenizer adds the
    # space only at the very start; without a leading space (gemma) the two agree.
    bpe, gemma = flavours["bpe"], flavours["gemma"]
    assert bpe.tok.encode(text) == _per_stretch(bpe, text)
    assert gemma.tok.encode(text) == gemma.hf.encode(text) == _per_stretch(gemma, text)
    for flavour in (bpe, gemma):
        ids = flavour.tok.encode(text)
        assert flavour.tok.decode(ids, skip_special_tokens=False) == flavour.hf.decode(ids, skip_special_tokens=False)


def test_special_ids(flavour):
    tok, hf, sp = flavour.tok, flavour.hf, flavour.sp
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (sp.bos_id(), sp.eos_id())
    assert tok.token_to_id("<unk>") == sp.unk_id()
    assert tok.pad_token_id == hf.pad_token_id == (sp.pad_id() if sp.pad_id() >= 0 else None)
    assert tok.vocab_size == len(hf) == sp.get_piece_size()
    assert set(tok.eos_token_ids) == {sp.eos_id(), sp.piece_to_id("<|im_end|>")}  # a chat-turn end stops too
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [sp.piece_to_id("<|im_end|>")]
    assert tok.decode([sp.bos_id(), *sp.encode("hi"), sp.eos_id()]) == "hi"


def test_incremental_detokenizer_keeps_spaces(flavour):
    # SentencePiece decoding drops the leading space of the text only; the detokenizer decodes
    # windows, and each window's first space must survive
    for text in ("Hello, world! The quick brown fox.", "def square(x):\n    return x ** 2", "中文 😀 café  x"):
        ids = flavour.tok.encode(text, add_special_tokens=False)
        for prompt in ([], flavour.tok.encode("prompt text")):
            detok = IncrementalDetokenizer(flavour.tok, prompt)
            pieces = [detok.add(i) for i in ids] + [detok.flush()]
            expected = flavour.tok.decode(prompt + ids)[len(flavour.tok.decode(prompt)):]
            assert "".join(pieces) == expected


# ---- metadata --------------------------------------------------------------------------------


def test_file_without_special_ids_or_space_flag(flavours, tmp_path):
    # llama.cpp's defaults for a SentencePiece file: <unk> 0, <s> 1, </s> 2, BOS added;
    # no add_space_prefix key means a leading space, except for Gemma
    bpe = flavours["bpe"]
    plain = tmp_path / "plain.gguf"
    _write_gguf(plain, bpe.sp, "llama", special_ids=False)
    tok = Tokenizer.from_pretrained(plain)
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token) == (1, 2, "<unk>")
    assert tok.encode("Hello world") == bpe.tok.encode("Hello world")
    gemma = flavours["gemma"]
    unflagged = tmp_path / "gemma.gguf"
    _write_gguf(unflagged, gemma.sp, "gemma", spaces_as_spaces=True)
    assert Tokenizer.from_pretrained(unflagged).encode("Hello world") == gemma.tok.encode("Hello world")


def test_unknown_byte_level_pre_tokenizer_is_an_error(tmp_path):
    from tokenizers.pre_tokenizers import ByteLevel

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("no-such-pre")
    writer.add_token_list(sorted(ByteLevel.alphabet()) + ["Ġh"])
    writer.add_token_merges(["Ġ h"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TokenizerError, match=r"unknown tokenizer.ggml.pre 'no-such-pre'.*smollm"):
        Tokenizer.from_pretrained(path)


def test_unsupported_tokenizer_model(tmp_path):
    path = tmp_path / "t5.gguf"
    writer = gguf.GGUFWriter(str(path), "t5")
    writer.add_tokenizer_model("t5")
    writer.add_token_list(["<pad>", "</s>", "<unk>", "\u2581a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TokenizerError, match="'t5' is not supported"):
        Tokenizer.from_pretrained(path)
