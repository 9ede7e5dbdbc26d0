"""The one msgpack codec of baton.

``MsgpackEncoder.encode(obj)`` returns a list of frames: the msgpack body first,
then one out-of-band frame per large torch tensor or numpy array (the body holds
only dtype, shape and frame index), so a transport can send them without a copy.
``MsgpackDecoder(T).decode(frames)`` rebuilds ``T``; tensors come back as views
of the received frames (no copy). Anything malformed raises ProtocolError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec
import numpy as np

from baton.errors import ProtocolError

try:  # torch is a dependency of baton-core, but the codec must not need it to load
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]

T = TypeVar("T")
Frame = bytes | bytearray | memoryview

_EXT_NUMPY = 1
_EXT_TORCH = 2
#: Arrays smaller than this travel inside the body; larger ones as their own frame.
INLINE_MAX_BYTES = 256


class MsgpackEncoder:
    """Encode structs to frames; one encoder per thread (it keeps a scratch list)."""

    def __init__(self, inline_max_bytes: int = INLINE_MAX_BYTES) -> None:
        self._inline_max = inline_max_bytes
        self._aux: list[Frame] | None = None
        self._enc = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, obj: Any) -> list[Frame]:
        self._aux = frames = [b""]
        try:
            frames[0] = self._enc.encode(obj)
        finally:
            self._aux = None
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if torch is not None and isinstance(obj, torch.Tensor):
            t = obj.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            t = t.contiguous()
            dtype = str(t.dtype).removeprefix("torch.")
            # uint8 view: works for every dtype numpy lacks (bfloat16)
            data = t.view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
            return msgspec.msgpack.Ext(_EXT_TORCH, self._pack(dtype, list(t.shape), data))
        if isinstance(obj, np.ndarray):
            a = np.ascontiguousarray(obj)
            return msgspec.msgpack.Ext(_EXT_NUMPY, self._pack(a.dtype.str, list(a.shape), a))
        raise TypeError(f"baton's codec cannot encode {type(obj).__name__}; use a msgspec struct")

    def _pack(self, dtype: str, shape: list[int], arr: np.ndarray) -> bytes:
        assert self._aux is not None
        if arr.nbytes <= self._inline_max:
            return msgspec.msgpack.encode((dtype, shape, arr.tobytes()))
        self._aux.append(memoryview(arr.reshape(-1).view(np.uint8)))
        return msgspec.msgpack.encode((dtype, shape, len(self._aux) - 1))


class MsgpackDecoder(Generic[T]):
    """Decode frames into ``type_`` (a struct type, or Any)."""

    def __init__(self, type_: Any = Any) -> None:
        self._frames: Sequence[Frame] = ()
        self._dec = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook, dec_hook=_dec_hook)

    def decode(self, frames: Sequence[Frame] | Frame) -> T:
        if isinstance(frames, bytes | bytearray | memoryview):
            frames = (frames,)
        if not frames:
            raise ProtocolError("empty message: expected a msgpack body frame")
        self._frames = frames
        try:
            return self._dec.decode(frames[0])
        except (
            msgspec.DecodeError,
            msgspec.ValidationError,
            ValueError,
            TypeError,
            IndexError,
        ) as e:
            raise ProtocolError(f"malformed frame ({len(frames)} frames): {e}") from e
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        dtype, shape, payload = msgspec.msgpack.decode(data)
        buf = self._frames[payload] if isinstance(payload, int) else payload
        if code == _EXT_NUMPY:
            return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
        if code == _EXT_TORCH:
            if torch is None:  # pragma: no cover
                raise ProtocolError("a torch tensor arrived but torch is not installed")
            raw = np.frombuffer(buf, dtype=np.uint8)
            if raw.size == 0:
                return torch.empty(shape, dtype=getattr(torch, dtype))
            if not raw.flags.writeable:  # torch warns on read-only buffers; copy is rare
                raw = raw.copy()
            return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
        raise ProtocolError(f"unknown msgpack extension type {code}")


def _dec_hook(type_: Any, obj: Any) -> Any:
    # Fields annotated with torch.Tensor / np.ndarray: the ext hook already built them.
    if (torch is not None and type_ is torch.Tensor and isinstance(obj, torch.Tensor)) or (
        type_ is np.ndarray and isinstance(obj, np.ndarray)
    ):
        return obj
    raise TypeError(f"expected {type_}, got {type(obj).__name__}")
