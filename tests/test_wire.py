"""Typed messages on the wire: round trips, and malformed or foreign frames rejected (never pickled)."""

import random

import msgspec
import numpy as np
import pytest

from core import messages as m
from core.serial import INLINE_MAX_BYTES, Decoder, Encoder


def test_round_trip_small_and_large_arrays():
    enc, dec = Encoder(), Decoder(m.EngineInbound)
    small = np.arange(7, dtype=np.int32)
    large = np.arange(INLINE_MAX_BYTES, dtype=np.int32)  # 16 KB: travels as its own frame
    frames = enc.encode(m.EngineInputBatch(0, [
        m.PoolingEngineInput("a", 0, "embed", small, m.PoolingParams()),
        m.PoolingEngineInput("b", 1, "embed", large, m.PoolingParams(dimensions=8, normalize=False)),
    ]))
    assert len(frames) == 2
    msg = dec.decode(frames)
    assert [i.request_id for i in msg.items] == ["a", "b"]
    np.testing.assert_array_equal(msg.items[0].token_ids, small)
    np.testing.assert_array_equal(msg.items[1].token_ids, large)
    assert msg.items[1].params == m.PoolingParams(dimensions=8, normalize=False)


def test_wrong_type_for_the_socket_is_rejected():
    frames = Encoder().encode(m.Shutdown())
    with pytest.raises(msgspec.ValidationError):
        Decoder(m.EngineInbound).decode(frames)


@pytest.mark.parametrize("bad", [
    ["int32", [3], b"\x00" * 12],  # a dtype name outside the allowed byte-order-explicit set
    ["<i4", [4], b"\x00" * 12],  # shape does not match the bytes
    ["<i4", [-1], b""],
    ["<i4", [3], 5],  # frame index out of range
    ["O", [1], b"\x00" * 8],  # object arrays are never allowed
    "not an array",
])
def test_malformed_arrays_are_rejected(bad):
    header = msgspec.msgpack.encode(["EngineInputBatch", 0, [["a", 0, "embed", bad, {}]]])
    with pytest.raises(msgspec.ValidationError):
        Decoder(m.EngineInbound).decode([header])


def test_fuzzed_frames_never_crash_the_decoder():
    rng = random.Random(1)
    enc = Encoder()
    valid = enc.encode(m.EngineInputBatch(3, [m.PoolingEngineInput("x", 1, "embed", np.arange(5, dtype=np.int32),
                                                                    m.PoolingParams())]))[0]
    decoders = [Decoder(t) for t in (m.EngineInbound, m.EngineControl, m.WorkerInbound, m.FrontendInbound)]
    rejected = 0
    for i in range(3000):
        if i % 3 == 0:
            frame = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
        elif i % 3 == 1:
            frame = valid[: rng.randrange(len(valid))]
        else:
            data = bytearray(valid)
            data[rng.randrange(len(data))] = rng.getrandbits(8)
            frame = bytes(data)
        for dec in decoders:
            try:
                dec.decode([frame])
            except (msgspec.DecodeError, msgspec.ValidationError):
                rejected += 1
    assert rejected > 3000  # most of them are garbage for most sockets, and none raised anything else
