"""The typed errors of baton. Every message names the bad value and the fix."""

from __future__ import annotations

import re


class BatonError(Exception):
    """Base of every error baton raises on purpose."""


class ConfigError(BatonError, ValueError):
    """A configuration value is invalid; the message names the field path."""


class PluginError(BatonError):
    """Base of plugin discovery and lookup errors."""


class PluginNotFoundError(PluginError, LookupError):
    """A config names a plugin that is not installed."""


class DuplicatePluginError(PluginError):
    """Two plugins registered one name for one kind."""


class PluginLoadError(PluginError):
    """A plugin failed to import, raised inside a hook, or targets another API version."""


class InvalidRequestError(BatonError, ValueError):
    """A request or its sampling parameters are invalid; the engine keeps serving others.

    ``param`` names the request field at fault (``"top_k"``, ``"prompt"``, ...), so
    the HTTP layer can answer with OpenAI's ``param``; messages about a sampling
    field also say ``SamplingParams.<field>``, which survives a process boundary.
    """

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt, or the prompt plus max_tokens, does not fit in ``model.max_model_len``."""


class ProtocolError(BatonError):
    """A frame could not be decoded into a protocol message."""


class EngineDeadError(BatonError, RuntimeError):
    """The engine core (or one of its workers) died; no further request can be served."""


class EngineShuttingDownError(BatonError, RuntimeError):
    """The engine is shutting down and refuses new requests."""


class EngineSleepingError(BatonError, RuntimeError):
    """The engine is asleep (``sleep(level)``: its KV cache is freed) and refuses requests until
    ``wake_up()``."""


class ExecutorError(BatonError, RuntimeError):
    """The executor failed to run a step or to start."""


class ModelLoadError(BatonError):
    """A model could not be found or is not supported."""


class StructuredOutputError(BatonError, ValueError):
    """A structured-output spec is invalid, fails to compile, or no backend is installed."""


class TransportError(BatonError, OSError):
    """A transport channel failed (peer gone, closed, timed out)."""


#: The request field an error's message names: a sampling field, or (a KV connector's refusal)
#: kv_transfer_params at its start.
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)|^(kv_transfer_params)\b")


def error_from_message(message: str) -> BaseException:
    """Rebuild an error sent across a process as ``"ClassName: text"`` (utility calls, request errors)."""
    name, sep, text = message.partition(": ")
    cls = globals().get(name) if sep else None
    if isinstance(cls, type) and issubclass(cls, InvalidRequestError):
        m = _SAMPLING_FIELD.search(text)
        return cls(text, param=(m.group(1) or m.group(2)) if m else None)
    if isinstance(cls, type) and issubclass(cls, BatonError):
        return cls(text)
    return BatonError(message)


def worker_error(rank: int, message: str) -> BaseException:
    """The error worker ``rank`` sent as ``"ClassName: text"`` for one call, rebuilt with the
    worker named (``ClassName: worker 0: text``): a baton error keeps its type, any other is an
    ``ExecutorError``."""
    name, sep, text = message.partition(": ")
    if not sep:
        return ExecutorError(f"worker {rank}: {message}")
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, BatonError) and cls is not BatonError:
        return error_from_message(f"{name}: worker {rank}: {text}")
    return ExecutorError(f"{name}: worker {rank}: {text}")
