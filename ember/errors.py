"""The exceptions ember raises. Each names the offending value in its message."""


class EmberError(Exception):
    """Base class: an error the CLI prints as one line instead of a traceback."""


class GGUFError(EmberError):
    """The file is missing, truncated, corrupt, or not a GGUF file."""


class UnsupportedModelError(EmberError):
    """The architecture or a tensor type is not one ember can run."""


class UnknownModelError(EmberError):
    """A model alias that is neither registered nor a path to a .gguf file."""


class ChecksumError(EmberError):
    """A fetched model file does not have the sha256 the registry expects."""


class ModelFetchError(EmberError):
    """Fetching a model's package from the package index failed."""


class TokenizerError(EmberError):
    """The GGUF's tokenizer metadata is missing or of an unsupported kind."""


class ChatTemplateError(EmberError):
    """The chat template failed to render (syntax error or raise_exception)."""


class NonFiniteLogits(EmberError):
    """A forward pass gave a request NaN or infinite logits (no token can be drawn)."""


class InvalidDecodeState(EmberError):
    """The history/KV invariant ``len(history) == kv_len + 1`` was violated."""


class InvalidMessage(EmberError, ValueError):
    """A chat message that cannot be rendered safely; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
