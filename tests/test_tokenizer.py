"""kiln.tokenizer against transformers' GGUF tokenizer conversion, plus decoding, streaming, templates."""

from __future__ import annotations

import random
import time
from pathlib import Path

import gguf
import pytest

from kiln import tokenizer as kiln_tokenizer
from kiln.chat import (CHATML_TEMPLATE, GEMMA_TEMPLATE, LLAMA3_TEMPLATE, PLAIN_TEMPLATE, RENDER_SECONDS,
                       ChatTemplateError, render_chat)
from kiln.errors import ContextLengthError, KilnError, ModelFileError, RequestError
from kiln.gguf import GGUFFile
from kiln.tokenizer import Tokenizer


# --- corpus ---------------------------------------------------------------------------------------
def _corpus() -> list[str]:
    whitespace = ["", " ", "  ", "   ", "\n", "\n\n", "\n\n\n\n\n", "\t", "\t\t", "\r\n", "\r", " \n ", "\t \t\n",
                  " " * 16, " " * 31, " " * 32, " " * 40, " " * 65, "\n" * 31, "\n" * 33, "\t" * 40, " \u00a0 ",
                  "\u3000", "\u2003x\u2003"]
    prose = [
        "Hello world", "Hello, world!", "hello world", "HELLO WORLD", " Hello world", "Hello world ",
        "  Hello world  ", "Hello\nworld", "Hello\n\nworld\n", "Hello\tworld",
        "The quick brown fox jumps over the lazy dog.",
        "I'm sure you're right, but they'll say we've done what she'd've wanted.", "DON'T SHOUT; IT'S RUDE",
        "y'all'd've", "'s 't 're 've 'm 'll 'd", "rock 'n' roll", "\"quoted\" and 'single' and `backticks`",
        "e.g. i.e. etc. Mr. Dr. U.S.A.", "...!!!???", "¿Qué tal? ¡Muy bien!", "naïve café résumé coöperate",
        "Ünïcödé wïth dïäcrïtïcs", "supercalifragilisticexpialidocious",
        "pneumonoultramicroscopicsilicovolcanoconiosis",
        "a" * 100, "ab" * 50, "The the THE tHe", "end.", ".start", "-dash-", "under_score_name", "camelCaseName",
        "PascalCaseName", "SCREAMING_SNAKE_CASE", "kebab-case-name", "email@example.com",
        "https://example.com/a?b=c&d=e#f",
        "C:\\Windows\\System32\\drivers", "/usr/local/bin/python3", "~/.config/kiln/config.toml",
    ]
    numbers = [
        "0", "1", "12", "123", "1234", "12345", "123456789", "12345678901234567890", "3.14159", "-42", "+7",
        "1,000,000", "1 000 000", "1e-10", "6.022e23", "0x1F", "0b1010", "v1.2.3", "2024-01-01", "12:34:56",
        "$1,234.56", "€99", "50%", "1/2", "10^9", " 2024", "a1b2c3", "x86_64", "Windows 11", "٠١٢٣٤٥٦٧٨٩",
        "一二三", "①②③", "Ⅻ", "½ ¾ ⅞", "１２３",
    ]
    code = [
        "def f(x):\n    return x * 2\n",
        "class Foo:\n    def __init__(self, bar: int = 0) -> None:\n        self.bar = bar\n",
        "for i in range(10):\n\tprint(i, end='')\n",
        "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)",
        "const add = (a, b) => a + b;\nconsole.log(`sum: ${add(1, 2)}`);",
        "function foo() {\n  if (x === null) { return; }\n}",
        "#include <stdio.h>\nint main(void) {\n    printf(\"%d\\n\", 42);\n    return 0;\n}",
        "fn main() {\n    let v: Vec<u8> = vec![1, 2, 3];\n    println!(\"{:?}\", v);\n}",
        "package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"hi\") }",
        "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
        "<html><body><div class=\"x\">Hi &amp; bye</div></body></html>",
        "<table><tr><td>1</td><td>2</td></tr></table>", "<b>bold</b> <i>it</i> <code>x</code>",
        "{\"key\": [1, 2.5, true, null], \"nested\": {\"a\": \"b\"}}",
        "#!/bin/bash\nset -euo pipefail\nfor f in *.txt; do echo \"$f\"; done",
        "\\begin{equation}\n  E = mc^2 \\quad \\frac{a}{b}\n\\end{equation}",
        "^(?:[a-z0-9!#$%&'*+/=?^_`{|}~-]+)@\\w+\\.\\w{2,}$",
        "key: value\nlist:\n  - one\n  - two\n", "--- a/f.py\n+++ b/f.py\n@@ -1,2 +1,2 @@\n-old\n+new\n",
        "x+=1;y-=2;z*=3;w/=4;a%=5;b**=6;c//=7", "a && b || !c", "i++ --j", "arr[0][1] = {}",
        "    indented with four spaces", "\t\ttwo tabs", "        eight spaces", "    \n    \n",
        "# Heading\n\n- item 1\n- item 2\n\n```python\nprint('x')\n```",
    ]
    scripts = [
        "你好，世界！", "我喜欢吃苹果和香蕉。", "こんにちは、世界。", "カタカナとひらがなと漢字", "안녕하세요 세계",
        "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก", "Привет, мир!", "Γειά σου Κόσμε",
        "გამარჯობა მსოფლიო", "Բարեւ աշխարհ", "ሰላም ልዑል", "வணக்கம் உலகம்", "ওহে বিশ্ব", "Xin chào thế giới",
        "Zdravo svete, čćžšđ", "Witaj świecie: ąęłńóśźż", "Merhaba dünya: ğüşıöç", "Hej världen: åäö",
        "e\u0301 vs \u00e9", "A\u030a\u0301", "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319",
        "zero\u200bwidth", "rtl\u200fmark\u200e", "\ufeffBOM at start", "soft\u00adhyphen", "∀x∈ℝ: x² ≥ 0",
        "→ ← ↑ ↓ ⇒ ⇔", "┌─┐\n│x│\n└─┘", "𝄞 𝕳𝖊𝖑𝖑𝖔 𓀀𓁐", "\ue000\uf8ff private use", "literal \ufffd replacement",
        "ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ", "ﬁ ﬂ ligatures", "Ω Å K", "\x00null\x01ctrl\x7fdel", "\x1b[31mred\x1b[0m",
    ]
    emoji = [
        "😀", "😀😃😄", "Hello 👋 world 🌍!", "👍🏽", "👩🏾‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸🇯🇵🇫🇷🇩🇪",
        "🇺", "1️⃣ #️⃣", "❤️ ❤", "🤷‍♂️", "🧑‍🤝‍🧑", "🫠🫡🫶", "emoji😀inside", "🎉🎉🎉🎉🎉", "👁️‍🗨️",
    ]
    chat = [
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
        "<|im_end|><|im_start|>", "abc<|im_end|>def", " <|im_end|> ", "<|im_start", "im_start|>", "<|endoftext|>",
        "<|endoftext|>text<|endoftext|>", "<repo_name>kiln<file_sep>tokenizer.py",
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
        "<start_of_turn>", "<end_of_turn>\n", "<bos>text", "text<eos>", "<pad><unk><mask>", "<unused0><unused99>",
        "<start_of_image><end_of_image>", "[multimodal]", "<0x41>", "<s></s>", "<|eot_id|>", "< |im_start| >",
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    ]
    corpus = whitespace + prose + numbers + code + scripts + emoji + chat
    # Deterministic mixtures of the hand-written pieces, to hit the joins between kinds of text.
    pool = ["the", "The", " ", "  ", "\n", "\t", ",", ".", "'s", "don't", "123", "4567", "😀", "👨‍👩‍👧", "日本語",
            "Привет", "مرحبا", "<|im_end|>", "<end_of_turn>", "<b>", "    ", "x=1;", "é", "\u0301", "🇫🇷", "–", "—"]
    rng = random.Random(20240601)
    for _ in range(120):
        corpus.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 12))))
    for word in ("hello", "World", "42", "日本", "😀"):
        for pad in (" ", "  ", "\n", "\t", " \n"):
            corpus += [pad + word, word + pad, pad + word + pad]
    return corpus


CORPUS = _corpus()


def test_corpus_is_large_and_varied():
    assert len(CORPUS) >= 200
    assert len(set(CORPUS)) >= 200
    assert "" in CORPUS


# --- real models ----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory) -> Path:
    """Gemma's cache directory (the store keeps one per model file)."""
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="session")
def smollm2(smollm2_path, tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(smollm2_path), cache_dir=tmp_path_factory.mktemp("smollm2-cache"))


@pytest.fixture(scope="session")
def gemma3(gemma3_path, tokenizer_cache) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(gemma3_path), cache_dir=tokenizer_cache)


def _transformers_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    return _transformers_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_path):
    return _transformers_tokenizer(gemma3_path)


@pytest.fixture(scope="session")
def smollm2_reference(hf_smollm2):
    """transformers' conversion of SmolLM2 with the pre-tokenizer SmolLM2's own tokenizer.json has.

    The file says `tokenizer.ggml.pre = 'smollm'`, which transformers' GGUF mapping lacks, so it falls back to
    GPT-2's split and keeps digits together; SmolLM2 splits them first (`Digits(individual_digits=True)`, then
    `ByteLevel`), as llama.cpp's 'smollm' does. See test_transformers_does_not_split_smollm2_digits.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    reference = Backend.from_str(hf_smollm2.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return reference


@pytest.fixture(scope="session")
def gemma3_sentencepiece(gemma3_path):
    """Google's SentencePiece, loaded with a model rebuilt from the file's vocabulary: the reference for Gemma.

    The GGUF spells user-defined whitespace pieces with real spaces (llama.cpp's converter does); SentencePiece
    matches them on its normalized text, where spaces are "▁".
    """
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2 as spm_model

    metadata = GGUFFile(gemma3_path).metadata
    model = spm_model.ModelProto()
    model.trainer_spec.model_type = spm_model.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = True
    model.trainer_spec.vocab_size = len(metadata["tokenizer.ggml.tokens"])
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = False
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = True
    for text, kind, score in zip(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"].tolist(),
                                 metadata["tokenizer.ggml.scores"].tolist()):
        piece = model.pieces.add()
        piece.piece, piece.type, piece.score = text.replace(" ", "▁") if kind == 4 else text, kind, score
    return spm.SentencePieceProcessor(model_proto=model.SerializeToString())


@pytest.fixture(params=["smollm2", "gemma3"])
def model_pair(request):
    """(kiln tokenizer, transformers tokenizer) for one model."""
    return request.getfixturevalue(request.param), request.getfixturevalue(f"hf_{request.param}")


@pytest.fixture(params=["smollm2", "gemma3"])
def kiln_model(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


@pytest.mark.slow
def test_smollm2_ids_equal_transformers(smollm2, smollm2_reference):
    mismatches = []
    for text in CORPUS:
        ours, theirs = smollm2.encode(text, add_bos=False), smollm2_reference.encode(text, add_special_tokens=False).ids
        if ours != theirs:
            mismatches.append(f"{text!r}: kiln {ours} transformers {theirs}")
    assert not mismatches, "\n".join(mismatches)


# transformers rebuilds Gemma's user-defined whitespace pieces (2..31 spaces) as merges of "▁", which pairs a
# long run up differently: 32 spaces become 16+16 where SentencePiece and llama.cpp match 31 whole, then 1.
def _gemma_transformers_diverges(text: str) -> bool:
    return " " * 32 in text


@pytest.mark.slow
def test_gemma3_ids_equal_transformers(gemma3, hf_gemma3, gemma3_sentencepiece):
    mismatches, divergent = [], 0
    for text in CORPUS:
        ours, theirs = gemma3.encode(text, add_bos=False), hf_gemma3.encode(text, add_special_tokens=False)
        if _gemma_transformers_diverges(text):
            divergent += 1
            assert ours == gemma3_sentencepiece.encode(text) and ours != theirs, text
        elif ours != theirs:
            mismatches.append(f"{text!r}: kiln {ours} transformers {theirs}")
    assert not mismatches, "\n".join(mismatches)
    assert divergent >= 3


@pytest.mark.slow
def test_gemma3_ids_equal_sentencepiece(gemma3, gemma3_sentencepiece):
    # SentencePiece never reads control tokens out of text, so kiln is asked not to either.
    mismatches = []
    for text in CORPUS:
        ours, theirs = gemma3.encode(text, add_bos=False, parse_special=False), gemma3_sentencepiece.encode(text)
        if ours != theirs:
            mismatches.append(f"{text!r}: kiln {ours} sentencepiece {theirs}")
    assert not mismatches, "\n".join(mismatches)


@pytest.mark.slow
def test_transformers_does_not_split_smollm2_digits(smollm2, hf_smollm2, smollm2_reference):
    for text, expected in (("  42", ["ĠĠ", "4", "2"]), ("½ ¾", ["Â½", "Ġ", "Â¾"])):
        ours = smollm2.encode(text)
        assert [smollm2.id_to_token(i) for i in ours] == expected
        assert ours == smollm2_reference.encode(text, add_special_tokens=False).ids
        assert ours != hf_smollm2.encode(text, add_special_tokens=False)


@pytest.mark.slow
def test_bos_matches_transformers(model_pair):
    kiln, hf = model_pair
    for text in ("Hello world", "", " leading space", "<|im_start|>user\nHi<|im_end|>"):
        assert kiln.encode(text) == hf.encode(text), text


@pytest.mark.slow
def test_decode_equals_transformers_decode(model_pair):
    kiln, hf = model_pair
    for text in CORPUS:
        ids = kiln.encode(text, add_bos=False)
        assert kiln.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert kiln.decode(ids, skip_special=False) == hf.decode(ids, skip_special_tokens=False), text


@pytest.mark.slow
def test_special_tokens_and_stops(smollm2, gemma3):
    assert (smollm2.bos_id, smollm2.eos_id, smollm2.add_bos) == (1, 2, False)
    assert smollm2.stop_ids == {smollm2.token_to_id("<|im_end|>"), smollm2.token_to_id("<|endoftext|>")}
    assert (gemma3.bos_id, gemma3.eos_id, gemma3.add_bos) == (2, 1, True)
    assert gemma3.stop_ids == {1, gemma3.token_to_id("<end_of_turn>")}
    assert smollm2.vocab_size == 49152 and gemma3.vocab_size == 262144
    assert gemma3.id_to_token(2) == "<bos>" and gemma3.token_to_id("<bos>") == 2
    assert gemma3.token_to_id("no such token, surely") is None
    with pytest.raises(KilnError, match="outside the vocabulary"):
        gemma3.id_to_token(262144)


@pytest.mark.slow
def test_bos_is_not_doubled(gemma3):
    assert gemma3.encode("<bos>Hi") == [2, gemma3.encode("Hi", add_bos=False)[0]]
    assert gemma3.encode("Hi")[0] == 2 and gemma3.encode("Hi", add_bos=False)[0] != 2


@pytest.mark.slow
def test_parse_special_off_spells_specials_as_text(kiln_model):
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>",
                "<unk>", "<pad>"]
    special_ids = {kiln_model.token_to_id(s) for s in specials} - {None}
    assert len(special_ids) >= 3
    for text in ("<|im_start|>user<|im_end|>", "<start_of_turn>model<end_of_turn>", "<bos><eos><unk><pad>"):
        ids = kiln_model.encode(text, add_bos=False, parse_special=False)
        assert not special_ids & set(ids)
        assert kiln_model.decode(ids) == text
        in_text = {kiln_model.token_to_id(s) for s in specials if s in text} - {None}
        assert in_text <= set(kiln_model.encode(text, add_bos=False))


@pytest.mark.slow
def test_user_defined_tokens_always_match(gemma3):
    """llama.cpp matches user-defined tokens whole even when special tokens are not parsed."""
    for parse_special in (True, False):
        assert gemma3.encode("<b>", add_bos=False, parse_special=parse_special) == [gemma3.token_to_id("<b>")]
        assert gemma3.encode("\n\n", add_bos=False, parse_special=parse_special) == [gemma3.token_to_id("\n\n")]


@pytest.mark.slow
def test_round_trip(kiln_model):
    for text in CORPUS:
        ids = kiln_model.encode(text, add_bos=False)
        assert kiln_model.decode(ids, skip_special=False) == text
        assert kiln_model.decode(kiln_model.encode(text, add_bos=False, parse_special=False)) == text
        assert b"".join(kiln_model.token_bytes(i) for i in ids) == text.encode()


@pytest.mark.slow
@pytest.mark.parametrize("skip_special", [True, False])
def test_stream_equals_full_decode(kiln_model, skip_special):
    for text in CORPUS:
        ids = kiln_model.encode(text)
        stream = kiln_model.stream(skip_special)
        pieces = [stream.feed(i) for i in ids] + [stream.flush()]
        assert "".join(pieces) == kiln_model.decode(ids, skip_special)
        assert "".join(pieces).count("\ufffd") == text.count("\ufffd"), text
        assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def _complete_prefix(data: bytes) -> str:
    """The longest prefix of `data` that is whole UTF-8 characters."""
    for cut in range(4):
        try:
            return data[: len(data) - cut].decode()
        except UnicodeDecodeError:
            continue
    raise AssertionError(f"{data!r} is not UTF-8")


@pytest.mark.slow
def test_stream_emits_each_character_as_soon_as_it_is_complete(kiln_model):
    for text in CORPUS:
        stream, received, emitted = kiln_model.stream(skip_special=False), b"", ""
        for token_id in kiln_model.encode(text, add_bos=False):
            received += kiln_model.token_bytes(token_id)
            emitted += stream.feed(token_id)
            assert emitted == _complete_prefix(received), text
        assert stream.flush() == ""


@pytest.mark.slow
def test_emoji_spread_over_three_tokens_comes_out_whole_at_the_last(smollm2):
    ids = smollm2.encode("😀")
    assert [smollm2.id_to_token(i) for i in ids] == ["ðŁ", "ĺ", "Ģ"]
    stream = smollm2.stream()
    assert [stream.feed(i) for i in ids] == ["", "", "😀"]


@pytest.mark.slow
def test_character_from_byte_fallback_comes_out_at_the_last(gemma3):
    # U+13000 (𓀀) is not in Gemma's vocabulary: it falls back to its four UTF-8 byte tokens.
    ids = gemma3.encode("𓀀", add_bos=False)
    assert [gemma3.id_to_token(i) for i in ids] == ["<0xF0>", "<0x93>", "<0x80>", "<0x80>"]
    stream = gemma3.stream()
    assert [stream.feed(i) for i in ids] == ["", "", "", "𓀀"]
    stream = gemma3.stream()
    assert [stream.feed(i) for i in ids[:3]] == ["", "", ""]
    assert stream.flush() == "\ufffd"


@pytest.mark.slow
def test_gemma_tokenizer_is_cached(gemma3, gemma3_path, tokenizer_cache, monkeypatch):
    assert len(list(tokenizer_cache.glob("tokenizer.npz"))) == 1

    def no_derivation(*args):
        raise AssertionError("merges derived again despite the cache")

    monkeypatch.setattr(kiln_tokenizer, "_derive_merges", no_derivation)
    cached = Tokenizer.from_gguf(GGUFFile(gemma3_path), cache_dir=tokenizer_cache)
    assert cached.encode("Hello world") == gemma3.encode("Hello world") == [2, 9259, 1902]


def test_a_failed_cache_write_leaves_nothing(smollm2_path, tmp_path, monkeypatch):
    def full_disk(f, **arrays):
        f.write(b"half a cache")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kiln_tokenizer.np, "savez", full_disk)
    tok = Tokenizer.from_gguf(GGUFFile(smollm2_path), cache_dir=tmp_path)
    assert tok.encode("Hello world")  # the tokenizer works without its cache
    assert list(tmp_path.iterdir()) == []


# --- chat templates -------------------------------------------------------------------------------
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]


@pytest.mark.slow
def test_smollm2_template_renders_chatml(smollm2):
    assert smollm2.chat_template.startswith("{% for message in messages %}")
    assert smollm2.apply_chat_template(MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    # Without a system message the file's template supplies its own.
    assert smollm2.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
    )


@pytest.mark.slow
def test_smollm2_template_matches_transformers(smollm2, hf_smollm2):
    for add_generation_prompt in (True, False):
        theirs = hf_smollm2.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert smollm2.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt) == theirs


@pytest.mark.slow
def test_gemma_without_template_falls_back_to_turns(gemma3):
    assert gemma3.chat_template == GEMMA_TEMPLATE
    rendered = gemma3.apply_chat_template(MESSAGES)
    assert rendered == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = gemma3.encode(rendered)
    assert ids[:3] == [2, gemma3.token_to_id("<start_of_turn>"), gemma3.token_to_id("user")]


def test_fallback_choice_follows_the_vocabulary():
    def vocab(*names):
        return {name: i for i, name in enumerate(names)}.get

    assert render_chat(PLAIN_TEMPLATE, MESSAGES) == "Be brief.\n\nUser: Hi!\nAssistant: Hello.\nUser: Bye\nAssistant:"
    from kiln.chat import fallback_template

    assert fallback_template(vocab("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>")) == CHATML_TEMPLATE
    assert fallback_template(vocab("<start_of_turn>", "<end_of_turn>")) == GEMMA_TEMPLATE
    assert fallback_template(vocab("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")) == LLAMA3_TEMPLATE
    assert fallback_template(vocab("<s>", "</s>")) == PLAIN_TEMPLATE
    assert render_chat(LLAMA3_TEMPLATE, MESSAGES[1:2], bos_token="<|begin_of_text|>") == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render_chat(CHATML_TEMPLATE, [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]) == (
        "<|im_start|>user\nparts<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_sees_tools_extra_and_hf_helpers():
    template = (
        "{% for t in tools %}{{ t | tojson }}{% endfor %}|{{ flag }}|{{ strftime_now('%Y') | length }}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}|{{ ns.n }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}|{{ m.role }}{% endfor %}"
        "{% generation %}|gen{% endgeneration %}"
    )
    tools = [{"name": "f", "description": "<&> é"}]
    out = render_chat(template, MESSAGES, tools=tools, flag=True)
    assert out == '{"name": "f", "description": "<&> é"}|True|4|4|system|gen'


def test_messages_must_be_objects():
    with pytest.raises(RequestError, match=r"messages\[1\] is 'hi'") as info:
        render_chat(CHATML_TEMPLATE, [{"role": "user", "content": "a"}, "hi"])
    assert info.value.param == "messages"


def test_none_fields_are_dropped():
    template = "{% for m in messages %}{{ 'content' in m }}{% endfor %}"
    assert render_chat(template, [{"role": "assistant", "content": None}]) == "False"


@pytest.mark.parametrize(
    "template, problem",
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError: access to str.__class__"),
        ("{{ messages.__class__ }}", "SecurityError"),
        ("{{ (messages | first).items.__self__ }}", "SecurityError"),
        ("{{ cycler.__init__.__globals__ }}", "SecurityError"),
        ("{% set ns = namespace(_x=1) %}", "underscore"),
        ("{{ messages.append(1) }}", "SecurityError: access to list.append"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{% for m in messages %}", "syntax error"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ],
)
def test_template_failures_are_kiln_errors(template, problem):
    with pytest.raises(ChatTemplateError, match=problem) as info:
        render_chat(template, MESSAGES)
    assert isinstance(info.value, KilnError)


@pytest.mark.parametrize(
    "template, problem",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "within its 2 s budget"),
        ("{% if true %}" * 5000 + "{% endif %}" * 5000, "nests too deeply"),
        ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", "recurses too deeply"),
        ("{{ 'x' * 2000000000 }}", "memory"),
    ],
)
def test_templates_render_under_a_budget(template, problem):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=problem):
        render_chat(template, MESSAGES)
    assert time.monotonic() - t0 < RENDER_SECONDS + 5
    assert render_chat(PLAIN_TEMPLATE, MESSAGES[1:2]) == "User: Hi!\nAssistant:"  # the next render is unaffected


def test_template_output_is_bounded_by_what_the_context_holds():
    with pytest.raises(ContextLengthError, match="over 1000 characters"):
        render_chat("{% for i in range(100000) %}xxxxxxxxxx{% endfor %}", MESSAGES, max_chars=1000)
    assert render_chat(PLAIN_TEMPLATE, MESSAGES[1:2], max_chars=22) == "User: Hi!\nAssistant:"
    with pytest.raises(ContextLengthError, match="messages are 2000 characters"):  # known before rendering
        render_chat(PLAIN_TEMPLATE, [{"role": "user", "content": [{"type": "text", "text": "x" * 1992}]}], max_chars=1000)


# --- tiny tokenizers written here -----------------------------------------------------------------
def _write_gguf(path: Path, **fields) -> GGUFFile:
    writer = gguf.GGUFWriter(str(path), arch=fields.pop("arch", "llama"))
    writer.add_tokenizer_model(fields.pop("model"))
    if "pre" in fields:
        writer.add_tokenizer_pre(fields.pop("pre"))
    writer.add_token_list(fields.pop("tokens"))
    writer.add_token_types(fields.pop("types"))
    for name, value in fields.items():
        getattr(writer, f"add_{name}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


def _byte_level_vocab():
    alphabet = list(kiln_tokenizer.bytes_to_unicode().values())
    merges = ["Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "h e", "l l", "he ll", "hell o", "Ġ 1", "1 2"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + alphabet + [m.replace(" ", "") for m in merges]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


def test_tiny_byte_level_tokenizer(tmp_path):
    tokens, types, merges = _byte_level_vocab()
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "tiny.gguf", model="gpt2", pre="qwen2", tokens=tokens,
                                          types=types, token_merges=merges, eos_token_id=2))
    ids = tok.encode("<|im_start|>hello world 12<|im_end|>")
    assert [tok.id_to_token(i) for i in ids] == ["<|im_start|>", "hello", "Ġworld", "Ġ", "1", "2", "<|im_end|>"]
    # qwen2 splits digits one by one, so neither "Ġ1" nor "12" may form although both merges exist.
    assert tok.token_to_id("Ġ1") is not None and tok.token_to_id("12") is not None
    assert tok.decode(ids) == "hello world 12"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>hello world 12<|im_end|>"
    assert tok.token_bytes(tok.token_to_id("Ġworld")) == b" world"
    assert tok.bos_id is None and not tok.add_bos and tok.stop_ids == {0, 2}
    assert tok.encode("é")  == [tok.token_to_id("Ã"), tok.token_to_id("©")]
    assert tok.decode(tok.encode("naïve 😀")) == "naïve 😀"


def test_smollm_pre_tokenizer_splits_digits(tmp_path):
    tokens, types, merges = _byte_level_vocab()
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "tiny.gguf", model="gpt2", pre="smollm", tokens=tokens,
                                          types=types, token_merges=merges))
    assert [tok.id_to_token(i) for i in tok.encode("12 world")] == ["1", "2", "Ġworld"]
    gpt2 = Tokenizer.from_gguf(_write_gguf(tmp_path / "gpt2.gguf", model="gpt2", pre="gpt-2", tokens=tokens,
                                           types=types, token_merges=merges))
    assert [gpt2.id_to_token(i) for i in gpt2.encode("12 world")] == ["12", "Ġworld"]


def test_unknown_pre_tokenizer_is_a_clear_error(tmp_path):
    tokens, types, merges = _byte_level_vocab()
    path = tmp_path / "odd.gguf"
    with pytest.raises(ModelFileError, match=r"odd\.gguf.*tokenizer\.ggml\.pre is 'mystery-bpe'.*qwen2.*smollm"):
        Tokenizer.from_gguf(_write_gguf(path, model="gpt2", pre="mystery-bpe", tokens=tokens, types=types,
                                        token_merges=merges))


def test_bad_tokenizer_metadata_is_a_clear_error(tmp_path):
    tokens, types, merges = _byte_level_vocab()
    with pytest.raises(ModelFileError, match="tokenizer.ggml.model is 'wordpiece'"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "a.gguf", model="wordpiece", tokens=tokens, types=types))
    with pytest.raises(ModelFileError, match="'tokenizer.ggml.merges' is missing"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "b.gguf", model="gpt2", pre="qwen2", tokens=tokens, types=types))
    with pytest.raises(ModelFileError, match="more than once"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "c.gguf", model="gpt2", pre="qwen2", tokens=tokens + ["a"],
                                        types=types + [1], token_merges=merges))
    with pytest.raises(ModelFileError, match="merges does not fit the vocabulary"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "e.gguf", model="gpt2", pre="qwen2", tokens=tokens, types=types,
                                        token_merges=merges + ["Ġw orld"]))
    with pytest.raises(ModelFileError, match="bos_token_id is 9999"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "d.gguf", model="gpt2", pre="qwen2", tokens=tokens, types=types,
                                        token_merges=merges, bos_token_id=9999))


def _sentencepiece_vocab():
    # A llama-style vocabulary: control tokens, byte tokens, then pieces best first (by score).
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d",
              "▁h", "ll", "▁he", "▁hell", "▁hello", "▁w", "or", "▁wor", "ld", "▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    # Single characters score lowest; longer pieces keep the order they are listed in.
    scores = [0.0] * 259 + [-100.0 - i if len(p) == 1 else -float(i) for i, p in enumerate(pieces)]
    return tokens, types, scores


def test_tiny_sentencepiece_tokenizer(tmp_path):
    tokens, types, scores = _sentencepiece_vocab()
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "spm.gguf", model="llama", tokens=tokens, types=types,
                                          token_scores=scores, bos_token_id=1, eos_token_id=2))
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "▁hello", "▁world"]
    assert tok.decode(ids) == "hello world"
    # The prefix space goes in front of every stretch of text after a special token, as llama.cpp does.
    assert [tok.id_to_token(i) for i in tok.encode("hello</s>world", add_bos=False)] == ["▁hello", "</s>", "▁world"]
    # "é" is not in the vocabulary: it falls back to its UTF-8 bytes.
    assert [tok.id_to_token(i) for i in tok.encode("é", add_bos=False)] == ["▁", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("é")) == "é"
    assert tok.decode(ids, skip_special=False) == "<s> hello world"
    assert tok.decode(tok.encode("  hello", add_bos=False)) == "  hello"
    assert tok.stop_ids == {2} and tok.add_bos and tok.chat_template == PLAIN_TEMPLATE


def test_template_errors_name_the_model_file(tmp_path):
    tokens, types, scores = _sentencepiece_vocab()
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "broken.gguf", model="llama", tokens=tokens, types=types,
                                          token_scores=scores, chat_template="{% if %}"))
    with pytest.raises(ChatTemplateError, match=r"broken\.gguf.*syntax error on line 1"):
        tok.apply_chat_template(MESSAGES)


def test_sentencepiece_cache_is_written_once_and_survives_damage(tmp_path, monkeypatch):
    tokens, types, scores = _sentencepiece_vocab()
    model = _write_gguf(tmp_path / "spm.gguf", model="llama", tokens=tokens, types=types, token_scores=scores)
    cache = tmp_path / "cache"
    first = Tokenizer.from_gguf(model, cache_dir=cache).encode("hello world")
    [cached] = cache.glob("tokenizer.npz")
    assert not list(cache.glob(".*tmp"))

    derived = []
    real_derive = kiln_tokenizer._derive_merges
    monkeypatch.setattr(kiln_tokenizer, "_derive_merges", lambda *a: derived.append(1) or real_derive(*a))
    assert Tokenizer.from_gguf(model, cache_dir=cache).encode("hello world") == first
    assert derived == []
    cached.write_bytes(b"not an npz file")
    assert Tokenizer.from_gguf(model, cache_dir=cache).encode("hello world") == first
    assert derived == [1]
    assert Tokenizer.from_gguf(model, cache_dir=cache).encode("hello world") == first
    assert derived == [1]
    other = _write_gguf(tmp_path / "other.gguf", model="llama", tokens=tokens[:-1], types=types[:-1],
                        token_scores=scores[:-1])
    assert Tokenizer.from_gguf(other, cache_dir=cache).vocab_size == len(tokens) - 1  # not the cached one


def test_a_text_too_long_for_the_context_is_refused_before_encoding(tmp_path):
    tokens, types, scores = _sentencepiece_vocab()
    tok = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", model="llama", tokens=tokens, types=types,
                                          token_scores=scores))
    text = "hello world " * 500
    ids = tok.encode(text)
    assert len(ids) * tok.max_chars(1) >= len(text)  # the bound holds for text made of the longest pieces
    assert tok.encode(text, max_tokens=len(ids)) == ids
    tok._backend = None  # refused on its length alone: encoding it would fail here
    with pytest.raises(ContextLengthError, match="more than a context of 10 tokens"):
        tok.encode("hello " * 10_000_000, max_tokens=10)
