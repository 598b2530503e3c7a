"""msgspec encoding with numpy arrays carried as raw bytes.

A message becomes a list of frames: frame 0 is the msgpack header; an array field is encoded in
the header as `[dtype, shape, data]`, where `data` is the bytes themselves when the array is small
and otherwise the index of an extra frame that carries the array's buffer without a copy
(pyzmq sends memoryviews zero-copy). Decoding checks dtype, shape and size against the frame, so a
malformed or foreign frame raises `msgspec.ValidationError` / `DecodeError` -- callers log and drop
it -- instead of producing a bogus array. No pickle anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

# Arrays smaller than this travel inline in the header: a separate frame costs more than a copy.
INLINE_MAX_BYTES = 4096
ALLOWED_DTYPES = frozenset({"<i4", "<i8", "<f4", "<f2", "<f8", "|u1", "|i1", "|b1"})
MAX_NDIM = 4

Frames = Sequence[bytes | memoryview | Any]


class Encoder:
    """Encodes a struct into frames. Not thread-safe (one per socket owner)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Any] = []

    def encode(self, obj: msgspec.Struct) -> list[Any]:
        # Array buffers are appended by _enc_hook while the header is being encoded.
        self._frames = frames = [b""]
        frames[0] = self._encoder.encode(obj)
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
            return (dtype, arr.shape, len(self._frames) - 1)
        raise NotImplementedError(f"cannot encode {type(obj).__name__} on the wire")


class Decoder:
    """Decodes frames into an expected type (a struct or a tagged union of structs)."""

    def __init__(self, expected: Any, writable_arrays: bool = False) -> None:
        self._decoder = msgspec.msgpack.Decoder(expected, dec_hook=self._dec_hook)
        self._writable = writable_arrays
        self._frames: Frames = ()

    def decode(self, frames: Frames) -> Any:
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
