"""One error family. Each message names the file, field, tensor or parameter at fault."""

import errno
import functools
import os
import re


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


class ContextLengthError(KilnError):
    """A prompt plus requested tokens does not fit the context; kiln never truncates silently."""


class RequestError(KilnError):
    """A generation request with a bad parameter; `param` names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


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
