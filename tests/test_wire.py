"""Typed messages on the wire: round trips, and malformed or foreign frames rejected (never pickled)."""

import os
import random

import msgspec
import numpy as np
import pytest

from pooling_pipeline.core import messages as m
from pooling_pipeline.core.serial import INLINE_MAX_BYTES, Decoder, Encoder, ForeignMessage


def test_round_trip_small_and_large_arrays():
    enc, dec = Encoder(), Decoder(m.EngineInbound)
    small = np.arange(7, dtype=np.int32)
    large = np.arange(INLINE_MAX_BYTES, dtype=np.int32)  # 16 KB: travels as its own frame
    frames = enc.encode(m.EngineInputBatch.pack(0, [
        m.PoolingEngineInput("a", 0, "embed", small, m.PoolingParams()),
        m.PoolingEngineInput("b", 1, "embed", large, m.PoolingParams(dimensions=8, normalize=False)),
    ]))
    assert len(frames) == 2  # the packed ids are big enough for their own frame
    items = dec.decode(frames).unpack()
    assert [i.request_id for i in items] == ["a", "b"]
    np.testing.assert_array_equal(items[0].token_ids, small)
    np.testing.assert_array_equal(items[1].token_ids, large)
    assert items[1].params == m.PoolingParams(dimensions=8, normalize=False)


def test_packed_parts_that_do_not_fit_are_rejected():
    dec = Decoder(m.EngineInbound)
    item = m.PoolingEngineInput("a", 0, "embed", None, m.PoolingParams())
    for ids, lengths in [(np.arange(5, dtype=np.int32), np.array([4])),  # lengths do not add up
                         (np.arange(5, dtype=np.int32), np.array([5, 0])),  # one length too many
                         (np.arange(5, dtype=np.int32), np.array([-1])),
                         (np.arange(6, dtype=np.int32).reshape(2, 3), np.array([6]))]:
        msg = dec.decode(Encoder().encode(m.EngineInputBatch(0, [item], ids, lengths)))
        with pytest.raises(ValueError):
            msg.unpack()
    inline = m.PoolingEngineInput("a", 0, "embed", np.arange(2, dtype=np.int32), m.PoolingParams())
    msg = dec.decode(Encoder().encode(m.EngineInputBatch(0, [inline], np.zeros(0, np.int32), np.array([0]))))
    with pytest.raises(ValueError, match="packed"):
        msg.unpack()


def _inputs(lengths: list[int], chunked: bool = False) -> list[m.PoolingEngineInput]:
    return [m.PoolingEngineInput(f"p-{i}", i, "embed", np.arange(n, dtype=np.int32), m.PoolingParams(),
                                 chunk=i if chunked else -1, num_chunks=len(lengths) if chunked else 0)
            for i, n in enumerate(lengths)]


def test_output_vectors_travel_as_one_array_and_come_back_as_rows():
    enc, dec = Encoder(), Decoder(m.FrontendInbound, writable_arrays=True)
    vectors = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    batch = _inputs([4, 5, 6])
    for results in (vectors, list(vectors)):  # a runner's matrix, or one vector each
        msg = dec.decode(enc.encode(m.OutputBatch.pack(batch, results, 0.1, 12, 3)))
        assert msg.data is not None and msg.data.shape == (3, 8) and msg.arrays is None and msg.chunks is None
        assert msg.request_ids == ["p-0", "p-1", "p-2"] and msg.indices.tolist() == [0, 1, 2]
        assert msg.num_prompt_tokens.tolist() == [4, 5, 6]
        msg.unpack()
        assert msg.data is None
        np.testing.assert_array_equal(np.stack(msg.arrays), vectors)
    # Token vectors differ in length per request: they stay per output.
    ragged = [np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)]
    msg = dec.decode(enc.encode(m.OutputBatch.pack(_inputs([2, 3]), ragged, 0.1, 6, 2)))
    assert msg.data is None
    msg.unpack()
    assert [a.shape for a in msg.arrays] == [(2, 4), (3, 4)]
    # Chunks carry (chunk, number of chunks).
    msg = dec.decode(enc.encode(m.OutputBatch.pack(_inputs([2, 3], chunked=True), vectors[:2], 0.1, 6, 2)))
    assert msg.chunks.tolist() == [[0, 2], [1, 2]]
    # Decoded as views of the received frames (the frontend's decoder): every output gets its own
    # writable copy, so a result kept does not pin a frame or a batch.
    cases = [(_inputs([300, 2]), [(np.arange(300, dtype=np.int32), np.ones(300, np.float32)),
                                  (np.arange(2, dtype=np.int32), np.ones(2, np.float32))], True),
             (_inputs([300, 2]), [np.ones((300, 4), np.float32), np.ones((2, 4), np.float32)], False),
             (_inputs([4, 4, 4]), vectors, False)]
    for batch, results, sparse in cases:
        msg = Decoder(m.FrontendInbound).decode(enc.encode(m.OutputBatch.pack(batch, results, 0.1, 6, 2, sparse=sparse)))
        msg.unpack()
        for array in msg.arrays + (msg.sparse_ids or []):
            assert array.flags.owndata and array.flags.writeable
        if sparse:
            assert [a.tolist() for a in msg.sparse_ids] == [list(range(300)), [0, 1]]


@pytest.mark.parametrize("change", ["indices", "tokens", "rows", "both", "neither", "arrays", "sparse", "chunks"])
def test_output_columns_that_do_not_fit_are_rejected(change):
    ids, idx, tok = ["a", "b"], np.array([0, 1]), np.array([3, 4])
    data, arrays, sparse_ids, chunks = np.ones((2, 4), np.float32), None, None, None
    if change == "indices":
        idx = np.array([0, 1, 2])
    elif change == "tokens":
        tok = np.array([3])
    elif change == "rows":
        data = np.ones((3, 4), np.float32)
    elif change == "both":
        arrays = [np.ones(4, np.float32)] * 2
    elif change == "neither":
        data = None
    elif change == "arrays":
        data, arrays = None, [np.ones(4, np.float32)]
    elif change == "sparse":
        data, arrays, sparse_ids = None, [np.ones(4, np.float32)] * 2, [np.arange(3, dtype=np.int32)] * 2
    else:
        chunks = np.zeros((2, 3), np.int64)
    msg = Decoder(m.FrontendInbound).decode(Encoder().encode(
        m.OutputBatch(ids, idx, tok, 0.1, 8, 2, data, arrays, sparse_ids, chunks)))
    with pytest.raises(ValueError):
        msg.unpack()


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
    header = msgspec.msgpack.encode(["EngineInputBatch", 0, [["a", 0, "embed", None, {}]], bad,
                                     ["<i8", [1], b"\x03" + b"\x00" * 7]])
    with pytest.raises(msgspec.ValidationError):
        Decoder(m.EngineInbound).decode([header])


def test_fuzzed_frames_never_crash_the_decoder():
    rng = random.Random(1)
    enc = Encoder()
    valid = enc.encode(m.EngineInputBatch.pack(3, [m.PoolingEngineInput("x", 1, "embed", np.arange(5, dtype=np.int32),
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


def test_messages_without_the_group_key_are_dropped_unread():
    """Within a group every message starts with the group's random key: a well-formed message
    from a process that does not know it (a forger guessing ids) is refused before decoding."""
    key = os.urandom(16)
    enc, dec = Encoder(key), Decoder(m.EngineInbound, key=key)
    ids = np.arange(INLINE_MAX_BYTES, dtype=np.int32)  # large: its own frame, after the key and the header
    msg = m.EngineInputBatch.pack(0, [m.PoolingEngineInput("a", 0, "embed", ids, m.PoolingParams())])
    frames = enc.encode(msg)
    assert frames[0] == key and len(frames) == 3
    np.testing.assert_array_equal(dec.decode(frames).unpack()[0].token_ids, ids)
    forged = [Encoder().encode(msg), Encoder(os.urandom(16)).encode(msg), [key], [], [key[:-1] + b"x", *frames[1:]],
              [frames[1], *frames]]
    for frames in forged:
        with pytest.raises(ForeignMessage):
            dec.decode(frames)
    assert issubclass(ForeignMessage, msgspec.DecodeError)  # every receiver's "drop and log" path


def test_render_batch_packs_token_ids_and_leaves_the_items_as_they_were():
    enc, dec = Encoder(), Decoder(m.WorkerInbound)
    ids_a, ids_b = np.arange(5, dtype=np.int32), np.arange(3000, dtype=np.int32)
    items = [m.RenderParams("t", 0, "embed", 16, m.PoolingParams(), prompt="text"),
             m.RenderParams("a", 1, "embed", 16, m.PoolingParams(), token_ids=ids_a),
             m.RenderParams("c", 2, "embed", 16, m.PoolingParams(), conversation=[{"role": "user", "content": "hi"}]),
             m.RenderParams("b", 3, "embed", 16, m.PoolingParams(), token_ids=ids_b)]
    frames = m.RenderBatch.encode_packed(enc, items, "tmpl", 1)
    assert items[1].token_ids is ids_a and items[3].token_ids is ids_b  # the frontend keeps them to re-send
    msg = dec.decode(frames)
    assert msg.with_ids.tolist() == [1, 3] and msg.lengths.tolist() == [5, 3000]
    out = msg.unpack()
    assert [o.request_id for o in out] == ["t", "a", "c", "b"] and msg.chat_template == "tmpl" and msg.engine == 1
    assert out[0].prompt == "text" and out[0].token_ids is None and out[2].token_ids is None
    np.testing.assert_array_equal(out[1].token_ids, ids_a)
    np.testing.assert_array_equal(out[3].token_ids, ids_b)
    plain = dec.decode(m.RenderBatch.encode_packed(enc, items[:1]))
    assert plain.token_ids is None and plain.unpack()[0].prompt == "text"


@pytest.mark.parametrize("change", ["lengths", "position", "twice", "missing", "text too"])
def test_render_batch_packed_parts_that_do_not_fit_are_rejected(change):
    items = [m.RenderParams("a", 0, "embed", 16, m.PoolingParams(), prompt=None),
             m.RenderParams("b", 1, "embed", 16, m.PoolingParams(), prompt=None)]
    ids, lengths, where = np.arange(6, dtype=np.int32), np.array([2, 4]), np.array([0, 1])
    if change == "lengths":
        lengths = np.array([2, 5])
    elif change == "position":
        where = np.array([0, 2])
    elif change == "twice":
        where = np.array([1, 1])
    elif change == "missing":
        lengths = None
    else:
        items[1].prompt = "and text"
    msg = Decoder(m.WorkerInbound).decode(Encoder().encode(m.RenderBatch(items, None, 0, ids, lengths, where)))
    with pytest.raises(ValueError):
        msg.unpack()
