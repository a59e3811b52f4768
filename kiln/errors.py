"""One error family. Each message names the file, field, tensor or parameter at fault."""


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
