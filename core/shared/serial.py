"""msgspec encoding with numpy arrays carried as raw bytes.

A message becomes a list of frames: frame 0 is the msgpack header; an array field is encoded in
the header as `[dtype, shape, data]`, where `data` is the bytes themselves when the array is small
and otherwise the index of an extra frame that carries the array's buffer without a copy
(pyzmq sends memoryviews zero-copy). Decoding checks dtype, shape and size against the frame, so a
malformed or foreign frame raises `msgspec.ValidationError` / `DecodeError` -- callers log and drop
it -- instead of producing a bogus array. No pickle anywhere.

Within a process group every message starts with one more frame, the group's random key (16
bytes, made by the frontend and handed to the children in their environment). A decoder built
with the key drops a message whose first frame is not the key before reading anything else: a
constant-time compare per message, not per request. It keeps processes of the same user that do
not know the key (a stray client, a forger guessing ids) from injecting messages; it is not a
boundary against a process that can read the group's memory or environment (see the README).
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

# Arrays up to this size travel inline in the header: a separate frame costs more than a copy
# (every frame is a GIL hand-off in pyzmq; a message's packed token ids, a few dozen KB, stay
# inline). Larger ones (a step's vectors, ~260 KB for 170 MiniLM embeddings) get their own frame:
# copied once by ZeroMQ instead of three times through the header, and read as a view.
INLINE_MAX_BYTES = 1 << 16
ALLOWED_DTYPES = frozenset({"<i4", "<i8", "<f4", "<f2", "<f8", "|u1", "|i1", "|b1"})
MAX_NDIM = 4

Frames = Sequence[bytes | memoryview | Any]
KEY_BYTES = 16


class ForeignMessage(msgspec.DecodeError):
    """A message without the group's key: dropped unread."""


class Encoder:
    """Encodes a struct into frames, behind the group's key when given one. Not thread-safe (one
    per socket owner, or used under the owner's lock)."""

    def __init__(self, key: bytes | None = None) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Any] = []
        self._head: list[Any] = [] if key is None else [key]  # frames before the header

    def encode(self, obj: msgspec.Struct) -> list[Any]:
        # Array buffers are appended by _enc_hook while the header is being encoded.
        self._frames = frames = [*self._head, b""]
        frames[len(self._head)] = self._encoder.encode(obj)
        self._frames = []
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            dtype = arr.dtype.str
            if dtype not in ALLOWED_DTYPES:
                raise TypeError(f"array dtype {dtype} is not allowed on the wire")
            if arr.nbytes <= INLINE_MAX_BYTES:
                return (dtype, arr.shape, arr.tobytes())
            self._frames.append(arr.data.cast("B"))  # a flat byte view, no copy
            return (dtype, arr.shape, len(self._frames) - 1 - len(self._head))  # counted from the header
        raise NotImplementedError(f"cannot encode {type(obj).__name__} on the wire")


class Decoder:
    """Decodes frames into an expected type (a struct or a tagged union of structs); with a key,
    only messages that start with that key (ForeignMessage otherwise)."""

    def __init__(self, expected: Any, writable_arrays: bool = False, key: bytes | None = None) -> None:
        self._decoder = msgspec.msgpack.Decoder(expected, dec_hook=self._dec_hook)
        self._writable = writable_arrays
        self._key = key
        self._frames: Frames = ()

    def decode(self, frames: Frames) -> Any:
        if self._key is not None:
            if len(frames) < 2 or not hmac.compare_digest(_buffer(frames[0]), self._key):
                raise ForeignMessage("message without the group's key")
            frames = frames[1:]
        if not frames:
            raise msgspec.DecodeError("empty message")
        self._frames = frames
        try:
            return self._decoder.decode(_buffer(frames[0]))
        finally:
            self._frames = ()

    def _dec_hook(self, typ: type, obj: Any) -> Any:
        if typ is not np.ndarray:
            raise NotImplementedError(f"unexpected type {typ}")
        if not isinstance(obj, (list, tuple)) or len(obj) != 3:
            raise ValueError("array must be [dtype, shape, data]")
        dtype, shape, data = obj
        if dtype not in ALLOWED_DTYPES:
            raise ValueError(f"array dtype {dtype!r} is not allowed")
        if (
            not isinstance(shape, (list, tuple))
            or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in shape)
        ):
            raise ValueError(f"bad array shape {shape!r}")
        if isinstance(data, int) and not isinstance(data, bool):
            if not 1 <= data < len(self._frames):
                raise ValueError(f"array frame index {data} out of range")
            data = _buffer(self._frames[data])
        elif not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError("array data must be bytes or a frame index")
        np_dtype = np.dtype(dtype)
        if memoryview(data).nbytes != math.prod(shape) * np_dtype.itemsize:
            raise ValueError(f"array of shape {tuple(shape)} and dtype {dtype} does not match {len(data)} bytes")
        arr = np.frombuffer(data, dtype=np_dtype).reshape(shape)
        return arr.copy() if self._writable else arr


def _buffer(frame: Any) -> Any:
    """bytes for a bytes frame, a memoryview for a zmq.Frame received with copy=False."""
    return frame.buffer if hasattr(frame, "buffer") else frame
