"""One error family. Each message names the file, field, tensor or parameter at fault."""

from __future__ import annotations

import copy
import errno
import functools
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping


class KilnError(Exception):
    """An error the user can act on; the CLI prints it on one line and exits non-zero."""


class ModelFileError(KilnError):
    """A model file is truncated, corrupt, or uses something kiln does not support."""


class UnsupportedModelError(ModelFileError):
    """A well-formed file describing an architecture or tensor type kiln does not run."""


class ModelNotFoundError(KilnError):
    """A tag or path that names no model kiln has or knows."""


class StoreError(KilnError):
    """Downloading, verifying or writing a model in the store failed."""


@dataclass(frozen=True)
class Field:
    """A request field named in an error message, by kiln's name for it (kiln.engine.request)."""

    name: str


class FieldError(KilnError):
    """A request with a bad field; `param` names it. Raised in kiln's terms: the message is text and
    `Field`s, so that an API whose fields are named otherwise says them in its own names (`renamed`)."""

    def __init__(self, message: str | tuple[str | Field, ...], param: str | None = None):
        self.parts = (message,) if isinstance(message, str) else tuple(message)
        self.param = param
        super().__init__(self._render({}))

    def _render(self, names: Mapping[str, str]) -> str:
        return "".join(names.get(p.name, p.name) if isinstance(p, Field) else str(p) for p in self.parts)

    def renamed(self, names: Mapping[str, str]) -> FieldError:
        """This error with kiln's field names replaced by `names`' (those it lacks stay kiln's)."""
        error = copy.copy(self)
        error.param = names.get(self.param, self.param)
        error.args = (self._render(names),)
        return error


@contextmanager
def fields_named(names: Mapping[str, str]) -> Iterator[None]:
    """Errors raised inside name request fields as an API calls them (`names`: kiln's name -> its own)."""
    try:
        yield
    except FieldError as e:
        raise e.renamed(names) from None


class ContextLengthError(FieldError):
    """A prompt plus requested tokens does not fit the context; kiln never truncates silently."""


class RequestError(FieldError):
    """A generation request with a bad parameter; `param` names it."""


_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/[^\s'\"`,;:()<>\[\]]+")


def without_paths(message: str) -> str:
    """`message` with each absolute path on this machine cut to its last part, for a client that should
    learn neither the store's location nor the user's name. A path is one whose first directory exists,
    so routes such as /api/blobs/... stay as they are."""

    def cut(match: re.Match) -> str:
        path = match.group(0)
        first, _, rest = path[1:].partition("/")
        return path.rstrip("/").rsplit("/", 1)[-1] if rest and _is_root_dir(first) else path

    return _ABSOLUTE_PATH.sub(cut, message)


@functools.lru_cache(maxsize=64)
def _is_root_dir(name: str) -> bool:
    return os.path.isdir("/" + name)


def describe_os_error(error: OSError, doing: str) -> str:
    """One line for a failed system call: what was being done and why, a full disk said plainly."""
    where = f" ({os.path.basename(str(error.filename))})" if error.filename else ""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{doing}: the disk is full{where}; free some space and try again"
    return f"{doing}: {error.strerror or error}{where}"
