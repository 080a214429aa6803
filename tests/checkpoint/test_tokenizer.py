"""Tokenizer: rtp's GGUF-built tokenizer against transformers' on the real default
model, chat templates, the incremental detokenizer, and error cases."""

import json

import pytest

from rtp.checkpoint.gguf import GGUFError
from rtp.checkpoint.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    " a single leading space",
    "def square(x):\n    return x ** 2  # comment\n\n\tindented = {'k': [1, 2]}\n",
    "emoji 😀🚀 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "中文测试，日本語のテキスト、한국어 문장",
    "numbers 12345 and 3.14159, fullwidth ２０２４",
    "it's don't we'll I'M THEY'RE",
    "\n\n\n   \r\n\tx\n",
    "",
    " ",
    "ÄÖÜ ß café naïve façade",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<file_sep>more<jupyter_code>",
    "glued<|im_start|>tokens<|im_end|>",
    "<not_special> <|im_start  |>",
]


@pytest.fixture(scope="module")
def tok(default_gguf):
    return Tokenizer.from_pretrained(default_gguf)


@pytest.fixture(scope="module")
def hf_tok(default_gguf):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless


def test_non_ascii_numerals_split_like_smollm(tok, hf_tok):
    # SmolLM's tokenizer (tokenizer.json: Digits(individual) then ByteLevel; llama.cpp's "smollm"
    # pre-tokenizer: \p{N} first) isolates every numeral, so " ①" is " " + "①". transformers'
    # GGUF converter drops that digit split and merges the space into "Ġâ" instead. ASCII digits
    # agree either way (the vocabulary has no " 1"-style tokens), which is why TEXTS match.
    assert tok.encode(" ①") == tok.encode(" ") + tok.encode("①")
    assert tok.encode("x 42") == hf_tok.encode("x 42") == tok.encode("x") + tok.encode(" ") + tok.encode("4") + \
        tok.encode("2")
    assert hf_tok.encode(" ①") != tok.encode(" ①")  # if transformers fixes this, drop the exception


def test_special_tokens(tok, hf_tok):
    assert tok.bos_token_id == hf_tok.bos_token_id == 1  # <|im_start|>
    assert tok.eos_token_id == hf_tok.eos_token_id == 2  # <|im_end|>
    assert tok.pad_token_id == hf_tok.pad_token_id == 2
    assert tok.vocab_size == len(hf_tok) == 49152
    assert tok.eos_token_ids[0] == 2 and tok.token_to_id("<|im_end|>") in tok.eos_token_ids
    assert set(tok.eos_token_ids) == {2, 0}  # <|im_end|> ends a turn, <|endoftext|> a document
    assert tok.encode("<|im_start|>") == [1]  # control tokens match whole
    assert tok.decode([1, 4093, 2]) == hf_tok.decode([1, 4093, 2], skip_special_tokens=True) == "user"


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Answer with émojis 😀."},
    {"role": "assistant", "content": "4 ✅"},
]


@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:], CONVERSATION[:2]],
                         ids=["system+user+assistant", "no-system", "system+user"])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert text == expected
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    hf_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    hf_ids = hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids
    assert ids == list(hf_ids)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_sandbox_and_raise_exception(tok):
    strict = Tokenizer(tok.backend, chat_template="{% if messages|length == 0 %}{{ raise_exception('empty') }}"
                                                  "{% endif %}{{ messages[0]['content']|tojson }}")
    assert strict.apply_chat_template([{"role": "user", "content": "é"}]) == '"é"'
    with pytest.raises(Exception, match="empty"):
        strict.apply_chat_template([])
    escape = Tokenizer(tok.backend, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        escape.apply_chat_template([])
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(tok.backend).apply_chat_template([])


# ---- incremental detokenizer ------------------------------------------------------------


def _stream(tok, ids, **kwargs):
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    return pieces, detok


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_pieces_concatenate_to_decode(tok, text, skip):
    ids = tok.encode(text)
    pieces, detok = _stream(tok, ids, skip_special_tokens=skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_holds_back_partial_characters(tok):
    text = "😀🚀👨‍👩‍👧 中文测试 日本語"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # several characters span more than one byte-level token
    pieces, _ = _stream(tok, ids)
    assert "" in pieces[:-1]  # something was held back until its character completed
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_after_prompt(tok):
    prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=True)
    completion = tok.encode("Sure — here's 🍕 for you.\nBye!")
    pieces, detok = _stream(tok, completion, prompt_ids=prompt)
    assert "".join(pieces) == tok.decode(completion)
    assert len(detok.ids) <= 8  # a window, not the whole sequence again (the runtime holds that)


def test_incremental_window_stays_short(tok):
    ids = tok.encode("Streaming text of some length, with émojis 😀 and 中文, repeated. " * 40)
    detok = IncrementalDetokenizer(tok)
    lengths = []
    decode = tok.decode

    class Spy:
        def decode(self, window, skip_special_tokens=True):
            lengths.append(len(window))
            return decode(window, skip_special_tokens=skip_special_tokens)

    detok.tokenizer = Spy()
    for i in ids:
        detok.add(i)
    assert len(ids) > 500 and max(lengths) <= 8  # O(1) per token, not a re-decode of everything


def test_incremental_flush_emits_an_unfinished_character(tok):
    ids = tok.encode("ok 😀")
    detok = IncrementalDetokenizer(tok)
    out = [detok.add(i) for i in ids[:-1]]  # the emoji's last byte never arrives
    assert "".join(out).startswith("ok") and "\ufffd" not in "".join(out)
    rest = detok.flush()
    assert rest.endswith("\ufffd") and "".join(out) + rest == tok.decode(ids[:-1])
    assert detok.flush() == ""


# ---- HF directories and errors -------------------------------------------------------------


def test_hf_directory_matches_transformers(tmp_path, hf_tok):
    hf_tok.save_pretrained(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == hf_tok.encode(text)
        assert tok.decode(tok.encode(text)) == hf_tok.decode(hf_tok.encode(text), skip_special_tokens=True)
    assert tok.chat_template == hf_tok.chat_template
    assert tok.apply_chat_template(CONVERSATION) == hf_tok.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)


def test_hf_directory_extra_eos_from_generation_config(tmp_path, tok):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": {"content": "<|endoftext|>"}, "chat_template": [{"name": "default", "template": "x"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    t = Tokenizer.from_pretrained(tmp_path)
    assert t.eos_token_ids[:2] == [0, 5] and 2 in t.eos_token_ids
    assert t.apply_chat_template([]) == "x"


def test_gguf_add_bos_and_pre_tokenizer(tmp_path):
    gguf = pytest.importorskip("gguf")
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    tokens = ["<s>", "</s>", *alphabet, "Ġh", "Ġhi", "12"]
    types = [3, 3] + [1] * (len(tokens) - 2)
    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_architecture()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")  # digits one at a time: "12" must not merge
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["Ġ h", "Ġh i", "1 2"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = Tokenizer.from_pretrained(path)
    hi, one, two = tokens.index("Ġhi"), tokens.index("1"), tokens.index("2")
    assert t.encode(" hi12") == [0, hi, one, two]
    assert t.encode(" hi", add_special_tokens=False) == [hi]
    assert t.decode(t.encode(" hi12")) == " hi12"
    assert t.eos_token_ids == [1] and t.bos_token_id == 0


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    junk = tmp_path / "model.gguf"
    junk.write_text("not a gguf")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        Tokenizer.from_pretrained(junk)


def test_chat_templates_rtp_ships_and_files(default_gguf, tmp_path):
    tok = Tokenizer.from_pretrained(default_gguf)
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    tok.use_chat_template("chatml-tools")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == plain  # no tools: the same
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    assert '"name": "lookup"' in tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools,
                                                         tokenize=False)
    mine = tmp_path / "t.jinja"
    mine.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    tok.use_chat_template(str(mine))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    with pytest.raises(FileNotFoundError, match="chatml-tools"):
        tok.use_chat_template("no-such-template")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(Exception, match="does not parse"):
        tok.use_chat_template(str(broken))
