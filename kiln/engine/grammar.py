"""Structured output: JSON schemas and tagged JSON (tool calls) compiled by llguidance into token masks.

A `Constraint` is what `Sequence.constraint` expects: before each sample `allowed()` gives the tokens the
grammar permits next (one bool per vocabulary entry), `consume` advances it past the sampled token, and
`done()` says the grammar takes nothing more, which ends the sequence.
"""

from __future__ import annotations

import json
import threading
import weakref

import llguidance as llg
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from kiln.errors import Field, KilnError, RequestError

# Compact JSON: with free whitespace a small model can pad a document with newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_lltokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lltokenizers_lock = threading.Lock()


def lltokenizer(tokenizer) -> llg.LLTokenizer:
    """llguidance's view of a kiln tokenizer; built once per tokenizer (it walks the whole vocabulary)."""
    with _lltokenizers_lock:
        if tokenizer not in _lltokenizers:
            _lltokenizers[tokenizer] = _build_lltokenizer(tokenizer)
        return _lltokenizers[tokenizer]


class _Vocabulary:
    """The interface `llguidance.TokenizerWrapper` reads."""

    def __init__(self, tokenizer):
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, tokenizer.bos_id
        self.tokens, self.special_token_ids = [], []
        for i in range(tokenizer.vocab_size):
            piece = tokenizer.token_bytes(i)
            # Tokens that decoding hides (control tokens) are special: llguidance marks them with a 0xFF
            # prefix so that grammar text can never be spelled with them.
            if piece and not tokenizer.stream(skip_special=True).feed(i) and tokenizer.stream(skip_special=False).feed(i):
                piece = b"\xff" + piece
                self.special_token_ids.append(i)
            self.tokens.append(piece)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_bos=False, parse_special=False)


def _build_lltokenizer(tokenizer) -> llg.LLTokenizer:
    stops = sorted(tokenizer.stop_ids) or None
    return llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer)), eos_token=stops)


def json_grammar(schema: dict | None, param: str) -> str:
    """A grammar for JSON matching `schema`; None means any JSON object (OpenAI's json_object, Ollama's "json")."""
    if schema is not None and not isinstance(schema, dict):
        raise RequestError((Field(param), f": a JSON schema must be an object, got {type(schema).__name__}"), param)
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(schema or {"type": "object"}, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise RequestError((Field(param), f": not a usable JSON schema ({e})"), param) from None
    error = llg.LLMatcher.validate_grammar(grammar)  # without a tokenizer: reported before any model is needed
    if error:
        raise RequestError((Field(param), f": the schema cannot be enforced: {error}"), param)
    return grammar


def tagged_json_grammar(open_tag: str, schema: dict, close_tag: str) -> str:
    """`open_tag`, then JSON matching `schema`, then `close_tag` — e.g. one tool call."""
    schema = {**schema, "x-guidance": JSON_OPTIONS}
    return llg.LLMatcher.grammar_from_lark(f"start: {json.dumps(open_tag)} %json {json.dumps(schema)} {json.dumps(close_tag)}")


class Constraint:
    def __init__(self, tokenizer, grammar: str, param: str):
        matcher = llg.LLMatcher(lltokenizer(tokenizer), grammar, log_level=0)
        if matcher.is_error():
            raise RequestError((Field(param), f": the schema cannot be enforced: {matcher.get_error()}"), param)
        self._matcher = matcher
        self._vocab = tokenizer.vocab_size
        self._bits = np.full((1, (lltokenizer(tokenizer).vocab_size + 31) // 32), -1, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        fill_next_token_bitmask(self._matcher, self._bits)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab].astype(bool)

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise KilnError(f"the output grammar rejected token {token}: {self._matcher.get_error()}")

    def done(self) -> bool:
        return self._matcher.is_stopped()
