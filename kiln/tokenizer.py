"""Text to token ids and back, built from the vocabulary a GGUF file carries.

llama.cpp is the reference for what the metadata means; the `tokenizers` library does the work.
Two vocabulary kinds are supported:

- `gpt2`: byte-level BPE. Text is split by the regexes `tokenizer.ggml.pre` names, then merged with
  the file's merges.
- `llama`: SentencePiece BPE (llama, Gemma). Spaces become "▁", characters the vocabulary lacks fall
  back to `<0xXX>` byte tokens, and merges are derived from the vocabulary when the file has none.

Control tokens (and unknown ones) are matched whole in the text when `parse_special` is on;
user-defined tokens always are, as in llama.cpp. Decoding goes through a per-token table of the exact
bytes each token stands for, so streamed text and decoded text agree byte for byte.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import os
import string
import threading
from array import array
from functools import cached_property
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers

from kiln.errors import ContextLengthError, KilnError, ModelFileError
from kiln.gguf import GGUFFile

# llama.cpp's token types (gguf `tokenizer.ggml.token_type`).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_HIDDEN_WHEN_SKIPPING = (UNKNOWN, CONTROL, UNUSED)

# Tokens that end generation when the vocabulary has them, besides the file's eos/eot/eom ids.
STOP_TOKEN_NAMES = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>", "<|end|>", "<|eom_id|>", "<|return|>",
                    "<|call|>")
# gpt-oss's harmony vocabulary (it has <|return|> and <|call|>): <|end|> closes one message of a reply (the
# reasoning) rather than the reply, and the tokens that frame its messages are rendered into the output text
# for the parser (kiln/harmony.py) to read, as llama.cpp does.
HARMONY_ENDS = ("<|return|>", "<|call|>")
HARMONY_FRAMING = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>")

# Pre-tokenizer regexes in their original (tokenizer.json) spelling, which the `tokenizers` regex
# engine runs as written; llama.cpp's llama-vocab.cpp rewrites some of them for std::regex.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's fallback for BPE files that name no known pre-tokenizer.
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


def _pre(regexes: tuple[str, ...], *, ignore_merges: bool = False, add_bos: bool = False) -> dict:
    return {"regexes": regexes, "ignore_merges": ignore_merges, "add_bos": add_bos}


_LLAMA3_PRE = _pre((_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_TOKENIZERS = {
    "default": _pre(_DEFAULT),
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), _pre((_GPT2,))),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"), _pre((r"\p{N}", _GPT2))),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), _LLAMA3_PRE),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _pre((_LLAMA3,))),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _pre((_QWEN2,))),
    **dict.fromkeys(("gpt-4o", "llama4"), _pre((_GPT4O,))),
}

# Bump when the cached tokenizer's construction changes, so stale caches are not reused.
_STATE_FILE = "tokenizer.npz"
_STATE_FORMAT = 2  # bump when the saved state changes meaning


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, in which byte-level tokens are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}


class Tokenizer:
    """Encode and decode text for one model. Build it with `Tokenizer.from_gguf`."""

    def __init__(self, backend: tokenizers.Tokenizer, tokens: ByteTable, token_types: np.ndarray,
                 token_bytes: ByteTable, *, bos_id: int | None, eos_id: int | None, add_bos: bool,
                 strip_space_prefix: bool, stop_ids: frozenset[int], chat_template: str | None, source: str):
        self._backend = backend
        self._tokens = tokens  # UTF-8 of each token's text
        self._types = bytes(np.asarray(token_types, dtype=np.uint8))  # indexing bytes gives a plain int
        self._bytes = token_bytes
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self._strip_space_prefix = strip_space_prefix
        self.stop_ids = stop_ids
        self._file_chat_template = chat_template
        self.source = source
        # `encode_special_tokens` is a flag on the shared backend, so flipping it must not race.
        self._lock = threading.Lock()

    # --- construction -----------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gguf: GGUFFile, cache_dir: Path | None = None) -> Tokenizer:
        """Build from the file's metadata. With `cache_dir` (a directory kept per model file, as the
        store provides), the built tokenizer is saved there and later loads skip the building."""
        if cache_dir is not None:
            cached = cls._load_state(Path(cache_dir) / _STATE_FILE, gguf)
            if cached is not None:
                return cached
        tokenizer = cls._build(gguf)
        if cache_dir is not None:
            tokenizer._save_state(Path(cache_dir) / _STATE_FILE, gguf)
        return tokenizer

    @classmethod
    def _build(cls, gguf: GGUFFile) -> Tokenizer:
        path, md = gguf.path, gguf.metadata
        kind = gguf.require("tokenizer.ggml.model")
        tokens = list(gguf.require("tokenizer.ggml.tokens"))
        n = len(tokens)
        types = np.asarray(md.get("tokenizer.ggml.token_type", np.full(n, NORMAL)), dtype=np.int32)
        if len(types) != n:
            raise ModelFileError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
        harmony = all(t in tokens for t in HARMONY_ENDS)
        if harmony:
            types = types.copy()
            for name in HARMONY_FRAMING:
                if name in tokens:
                    types[tokens.index(name)] = USER_DEFINED
        if len(set(tokens)) != n:
            seen: set[str] = set()
            dup = next(t for t in tokens if t in seen or seen.add(t))
            raise ModelFileError(f"{path}: tokenizer.ggml.tokens lists {dup!r} more than once")

        if kind == "gpt2":
            backend, add_bos_default = _byte_level_backend(gguf, tokens, types)
            add_space_prefix = False
            table = _byte_level_table(tokens, types)
            bos_default = eos_default = None
        elif kind == "llama":
            add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
            backend = _sentencepiece_backend(gguf, tokens, types, add_space_prefix)
            add_bos_default = True
            table = _sentencepiece_table(tokens, types)
            bos_default, eos_default = 1, 2  # llama.cpp's defaults for SentencePiece files
        else:
            raise ModelFileError(f"{path}: tokenizer.ggml.model is {kind!r}; kiln supports 'gpt2' and 'llama'")

        bos_id = _token_id(gguf, "tokenizer.ggml.bos_token_id", bos_default, n)
        eos_id = _token_id(gguf, "tokenizer.ggml.eos_token_id", eos_default, n)
        add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default))
        if add_bos and bos_id is None:
            raise ModelFileError(f"{path}: tokenizer.ggml.add_bos_token is set, tokenizer.ggml.bos_token_id missing")
        stops = {eos_id} | {_token_id(gguf, f"tokenizer.ggml.{k}_token_id", None, n) for k in ("eot", "eom")}
        stops |= {backend.token_to_id(name) for name in STOP_TOKEN_NAMES}
        if harmony:
            stops.discard(backend.token_to_id("<|end|>"))
        stops.discard(None)
        return cls(backend, ByteTable.of(t.encode() for t in tokens), types, ByteTable.of(table), bos_id=bos_id,
                   eos_id=eos_id, add_bos=add_bos,
                   strip_space_prefix=add_space_prefix, stop_ids=frozenset(stops),
                   chat_template=md.get("tokenizer.chat_template"), source=str(path))

    # --- the cache of a built tokenizer -------------------------------------------------------------
    def _save_state(self, file: Path, gguf: GGUFFile) -> None:
        """One .npz of plain arrays (no pickles), written atomically; a read-only store just skips it."""
        state = {"format": _STATE_FORMAT, "tokenizers": tokenizers.__version__, "file": _fingerprint(gguf),
                 "bos_id": self.bos_id,
                 "eos_id": self.eos_id, "add_bos": self.add_bos, "strip_space_prefix": self._strip_space_prefix,
                 "stop_ids": sorted(self.stop_ids), "chat_template": self._file_chat_template}
        from kiln.store import TMP_SUFFIX  # named so the store's start-up cleaning removes a killed write's

        partial = file.with_name(f"{file.name}.{os.getpid()}-{threading.get_ident()}{TMP_SUFFIX}")
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            with open(partial, "wb") as f:
                np.savez(f, state=_text_array(json.dumps(state)), backend=_text_array(self._backend.to_str()),
                         types=np.frombuffer(self._types, dtype=np.uint8).astype(np.int32),
                         **self._tokens.arrays("tokens"), **self._bytes.arrays("bytes"))
            os.replace(partial, file)
        except OSError:  # a full disk or a read-only store: no cache, and nothing left half-written
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)

    @classmethod
    def _load_state(cls, file: Path, gguf: GGUFFile) -> Tokenizer | None:
        try:
            with np.load(file, allow_pickle=False) as z:
                state = json.loads(z["state"].tobytes())
                if (state.get("format"), state.get("tokenizers"), state.get("file")) != (
                        _STATE_FORMAT, tokenizers.__version__, _fingerprint(gguf)):
                    return None
                backend = tokenizers.Tokenizer.from_str(z["backend"].tobytes().decode())
                tokens, table, types = ByteTable.load(z, "tokens"), ByteTable.load(z, "bytes"), z["types"]
        except Exception:  # a damaged or foreign cache file is rebuilt, never fatal
            return None
        return cls(backend, tokens, types, table, bos_id=state["bos_id"], eos_id=state["eos_id"],
                   add_bos=state["add_bos"], strip_space_prefix=state["strip_space_prefix"],
                   stop_ids=frozenset(state["stop_ids"]), chat_template=state["chat_template"], source=str(gguf.path))

    # --- encoding ---------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               max_tokens: int | None = None) -> list[int]:
        """Token ids for `text`. BOS is prepended per the file unless `add_bos` says otherwise, and never
        twice: text that already starts with the BOS token (a rendered chat template) keeps just that one.
        With `max_tokens`, text too long to be that few tokens is refused before the work of encoding it."""
        if max_tokens is not None and len(text) > self.max_chars(max_tokens):
            raise ContextLengthError(f"the prompt is {len(text)} characters, more than a context of {max_tokens} "
                                     f"tokens can hold (a token of this vocabulary is at most {self.max_chars(1)} "
                                     "characters); kiln does not truncate prompts")
        with self._lock:
            self._backend.encode_special_tokens = not parse_special
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and ids[:1] != [self.bos_id]:
            if self.bos_id is None:
                raise KilnError(f"{self.source} has no BOS token (tokenizer.ggml.bos_token_id) to add")
            ids.insert(0, self.bos_id)
        return ids

    def max_chars(self, n_tokens: int) -> int:
        """The longest text `n_tokens` tokens can stand for: each covers at most its longest token's bytes."""
        return n_tokens * self._longest_token

    @cached_property
    def _longest_token(self) -> int:
        return max(self._tokens.longest(), self._bytes.longest(), 1)

    # --- decoding ---------------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (a byte-level fragment may be part of a UTF-8 character)."""
        self._check_id(token_id)
        return self._bytes[token_id]

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        stream = self.stream(skip_special)
        return "".join(stream.feed(i) for i in ids) + stream.flush()

    def stream(self, skip_special: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special)

    # --- vocabulary -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_to_id(self, text: str) -> int | None:
        return self._backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str:
        self._check_id(token_id)
        return self._tokens[token_id].decode()

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._tokens):
            last = len(self._tokens) - 1
            raise KilnError(f"token id {token_id} is outside the vocabulary of {self.source} (0..{last})")

    # --- chat -------------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str:
        """The file's chat template, or kiln's fallback for the model family its special tokens show."""
        from kiln.chat import fallback_template

        return self._file_chat_template or fallback_template(self.token_to_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, max_tokens: int | None = None, **extra: Any) -> str:
        """The rendered chat; with `max_tokens`, a rendering too long to be that few tokens is refused."""
        from kiln.chat import ChatTemplateError, render_chat

        special = {name: self._tokens[i].decode() if i is not None else "" for name, i in
                   (("bos_token", self.bos_id), ("eos_token", self.eos_id))}
        max_chars = None if max_tokens is None else self.max_chars(max_tokens)
        try:
            return render_chat(self.chat_template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                               max_chars=max_chars, **special, **extra)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{self.source}: {e}") from None


class StreamDecoder:
    """Turns token ids into text one at a time, holding back bytes until they complete a character."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._first = True

    def feed(self, token_id: int) -> str:
        tok = self._tok
        piece = tok.token_bytes(token_id)
        kind = tok._types[token_id]
        if self._skip_special and kind in _HIDDEN_WHEN_SKIPPING:
            return ""
        if self._first:
            self._first = False
            # Undo the space SentencePiece put in front of the text, as transformers' Metaspace decoder does.
            if tok._strip_space_prefix and kind == NORMAL and piece.startswith(b" "):
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is left; an unfinished character comes out as U+FFFD."""
        return self._utf8.decode(b"", final=True)


# --- backends -------------------------------------------------------------------------------------
def _token_id(gguf: GGUFFile, key: str, default: int | None, n_tokens: int) -> int | None:
    if key not in gguf.metadata:
        return default if default is not None and default < n_tokens else None
    value = gguf.metadata[key]
    if not 0 <= int(value) < n_tokens:
        raise ModelFileError(f"{gguf.path}: {key} is {value}, outside the vocabulary of {n_tokens} tokens")
    return int(value)


def _special_tokens(tokens: list[str], types: np.ndarray) -> list[AddedToken]:
    """Tokens matched whole before any splitting: control and unknown ones only while parsing specials
    (`special=True` lets `encode_special_tokens` turn them off), user-defined ones always."""
    return [AddedToken(tokens[i], special=bool(types[i] != USER_DEFINED), normalized=False)
            for i in np.flatnonzero(np.isin(types, (UNKNOWN, CONTROL, USER_DEFINED)))]


def _byte_level_backend(gguf: GGUFFile, tokens: list[str], types: np.ndarray) -> tuple[tokenizers.Tokenizer, bool]:
    """The backend, and whether this pre-tokenizer's models want BOS when the file does not say."""
    pre_name = gguf.metadata.get("tokenizer.ggml.pre", "default")
    if pre_name not in _PRE_TOKENIZERS:
        raise ModelFileError(
            f"{gguf.path}: tokenizer.ggml.pre is {pre_name!r}, a pre-tokenizer kiln does not know; "
            f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    pre = _PRE_TOKENIZERS[pre_name]
    backend = _bpe(gguf, tokens, _file_merges(gguf), ignore_merges=pre["ignore_merges"])
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre["regexes"]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.add_tokens(_special_tokens(tokens, types))
    return backend, pre["add_bos"]


def _sentencepiece_backend(gguf: GGUFFile, tokens: list[str], types: np.ndarray,
                           add_space_prefix: bool) -> tokenizers.Tokenizer:
    md = gguf.metadata
    if "tokenizer.ggml.merges" in md:
        return _assemble_sentencepiece(gguf, tokens, types, _file_merges(gguf), add_space_prefix)
    # Gemma's scores do not follow its merge order; the order of the tokens in the file does.
    by_position = gguf.architecture.startswith("gemma") or "tokenizer.ggml.scores" not in md
    scores = None if by_position else np.asarray(md["tokenizer.ggml.scores"], dtype=np.float32)
    if scores is not None and len(scores) != len(tokens):
        raise ModelFileError(f"{gguf.path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    return _assemble_sentencepiece(gguf, tokens, types, _derive_merges(tokens, types, scores), add_space_prefix)


def _derive_merges(tokens: list[str], types: np.ndarray, scores: np.ndarray | None) -> list[tuple[str, str]]:
    """Every way to cut a normal token in two known tokens, best token first: SentencePiece merges the
    adjacent pair whose joined token scores highest, which is BPE with this merge order. Only normal
    tokens are merge results, so text never turns into a control or byte token by merging."""
    known = set(tokens)
    normal = np.flatnonzero(types == NORMAL)
    if scores is not None:
        normal = normal[np.argsort(-scores[normal], kind="stable")]
    merges = []
    for i in normal.tolist():
        token = tokens[i]
        merges.extend((token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in known and token[k:] in known)
    return merges


def _file_merges(gguf: GGUFFile) -> list[tuple[str, str]]:
    merges = [tuple(m.split(" ", 1)) for m in gguf.require("tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ModelFileError(f"{gguf.path}: tokenizer.ggml.merges has an entry that is not two tokens and a space")
    return merges


def _bpe(gguf: GGUFFile, tokens: list[str], merges: list[tuple[str, str]], **options) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, **options))
    except Exception as e:  # tokenizers reports a merge of unknown tokens as a bare Exception
        raise ModelFileError(f"{gguf.path}: tokenizer.ggml.merges does not fit the vocabulary ({e})") from None


def _assemble_sentencepiece(gguf: GGUFFile, tokens: list[str], types: np.ndarray, merges: list[tuple[str, str]],
                            add_space_prefix: bool) -> tokenizers.Tokenizer:
    unk_id = _token_id(gguf, "tokenizer.ggml.unknown_token_id", 0 if tokens[0] == "<unk>" else None, len(tokens))
    backend = _bpe(gguf, tokens, merges, byte_fallback=True, unk_token=None if unk_id is None else tokens[unk_id])
    # Each stretch of text between special tokens is normalized on its own, so the prefix space lands
    # after every special token, as llama.cpp puts it there.
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    backend.add_tokens(_special_tokens(tokens, types))
    return backend


def _byte_level_table(tokens: list[str], types: np.ndarray) -> list[bytes]:
    """Normal tokens are spelled in GPT-2's byte alphabet; special ones are plain text."""
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    table = [t.encode() for t in tokens]
    for i in np.flatnonzero(types == NORMAL).tolist():
        if all(c in byte_of for c in tokens[i]):
            table[i] = bytes(byte_of[c] for c in tokens[i])
    return table


def _sentencepiece_table(tokens: list[str], types: np.ndarray) -> list[bytes]:
    """Normal tokens spell spaces as "▁"; `<0xXX>` byte tokens stand for one byte; the rest are plain text."""
    table = [t.replace("▁", " ").encode() for t in tokens]
    for i in np.flatnonzero(types != NORMAL).tolist():
        token = tokens[i]
        is_byte = (types[i] == BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">")
                   and all(c in string.hexdigits for c in token[3:5]))
        table[i] = bytes([int(token[3:5], 16)]) if is_byte else token.encode()
    return table


def _fingerprint(gguf: GGUFFile) -> list:
    """Enough to notice a cache directory shared by another model file (the store keeps one per file)."""
    return [gguf.file_size(), gguf.data_offset, len(gguf.metadata.get("tokenizer.ggml.tokens", ()))]


def _text_array(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8)


class ByteTable:
    """Many short byte strings in one blob with their end offsets: a vocabulary's token texts cost a few
    bytes each this way instead of a Python object each (SmolLM2's two tables: 0.8 MB instead of 6 MB)."""

    def __init__(self, blob: bytes, ends: array):
        self._blob, self._ends = blob, ends

    @classmethod
    def of(cls, items) -> ByteTable:
        items = list(items)
        return cls(b"".join(items), array("q", accumulate(len(b) for b in items)))

    @classmethod
    def load(cls, z, name: str) -> ByteTable:
        return cls(z[f"{name}_blob"].tobytes(), array("q", z[f"{name}_ends"].astype(np.int64).tobytes()))

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        return {f"{name}_blob": np.frombuffer(self._blob, dtype=np.uint8),
                f"{name}_ends": np.frombuffer(self._ends, dtype=np.int64)}

    def __len__(self) -> int:
        return len(self._ends)

    def longest(self) -> int:
        ends = np.frombuffer(self._ends, dtype=np.int64)
        return int(np.diff(ends, prepend=0).max()) if len(ends) else 0

    def __getitem__(self, i: int) -> bytes:
        return self._blob[self._ends[i - 1] if i else 0 : self._ends[i]]
