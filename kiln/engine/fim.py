"""Fill-in-the-middle: a model's FIM tokens, and the prompt built from them as llama.cpp's infill builds it.

The tokens come from the GGUF's `tokenizer.ggml.fim_*_token_id` keys; older files have them only by
text in the vocabulary, found by the names llama.cpp looks for. The prompt is prefix-suffix-middle:
[repo name, each extra file after a file separator, the current file's,] PRE prefix, SUF suffix, MID
(the part in brackets for llama-server's repo-level requests only), and the model writes
the middle; it ends at the model's end tokens or at fim_pad / fim_rep / fim_sep, which llama.cpp also
treats as the end of generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from kiln.engine.model import Model
    from kiln.gguf import GGUFFile

# The texts llama.cpp recognises each FIM token by (Qwen2.5-Coder, StarCoder and Granite, DeepSeek-Coder,
# CodeLlama, GLM-4.5).
NAMES = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>", "<|file_separator|>", "<file_sep>", "<filename>"),
}
REPO_NAME = "myproject\n"  # llama.cpp's placeholder project name after the repo token
CURRENT_FILE = "filename\n"  # and its placeholder for the file being edited
SNIPPET = "\n\n--- snippet ---\n\n"  # between extra files when the model has no file separator


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @property
    def ends(self) -> frozenset[int]:
        """Tokens that end a middle besides the model's own stop tokens."""
        return frozenset(t for t in (self.pad, self.rep, self.sep) if t is not None)


@dataclass
class Infill:
    """A fill-in-the-middle request: the text before the cursor, the text after it, and other files of the
    project ({filename, text}) the model may read."""

    prefix: str
    suffix: str
    extra: list[dict] | None = None  # None: the file alone, as Ollama's templates put it; a list, even
    # empty: llama-server's repo-level layout, with the project's header before the prefix
    prompt: str = ""  # llama-server's `prompt`: more text right before the cursor, after `prefix`


def find(get: Callable[[str], object], lookup: Callable[[str], int | None], vocab_size: int) -> FimTokens | None:
    """The FIM tokens of a model whose metadata is `get` and whose vocabulary `lookup` maps text to ids;
    None when it lacks any of prefix, suffix and middle. Ids outside the vocabulary are ignored."""
    found = {}
    for role, names in NAMES.items():
        token = get(f"tokenizer.ggml.fim_{role}_token_id")
        if not (isinstance(token, int) and 0 <= token < vocab_size):
            token = next((t for t in map(lookup, names) if t is not None), None)
        found[role] = token
    if None in (found["pre"], found["suf"], found["mid"]):
        return None
    return FimTokens(**found)


def model_tokens(model: Model) -> FimTokens | None:
    tok = model.tokenizer
    return find(model.gguf.get, tok.token_to_id, tok.vocab_size)


def file_tokens(gguf: GGUFFile) -> FimTokens | None:
    """As `model_tokens`, from a file that is not loaded (what /api/show reports)."""
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    wanted = {name for names in NAMES.values() for name in names}
    ids = {}
    for i, text in enumerate(tokens):
        if text in wanted:
            ids.setdefault(text, i)
    return find(gguf.get, ids.get, len(tokens))


def prompt_ids(model: Model, fim: FimTokens, infill: Infill) -> list[int]:
    """The prefix-suffix-middle prompt, as llama.cpp's format_infill lays it out."""
    tok = model.tokenizer

    def text(s: str) -> list[int]:
        return tok.encode(s, add_bos=False, parse_special=False) if s else []

    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    middle = [fim.pre, *text(infill.prefix), *text(infill.prompt), fim.suf, *text(infill.suffix), fim.mid]
    if infill.extra is None:
        return [*bos, *middle]
    extra: list[int] = [fim.rep, *text(REPO_NAME)] if fim.rep is not None else []
    for chunk in infill.extra:
        if fim.sep is not None:
            extra += [fim.sep, *text((chunk.get("filename") or "tmp") + "\n")]
        else:
            extra += text(SNIPPET)
        extra += text(chunk.get("text") or "")
    if fim.sep is not None:
        extra += [fim.sep, *text(CURRENT_FILE)]
    return [*extra, *bos, *middle]
