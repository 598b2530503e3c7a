"""Typed messages on the wire: round trips, and malformed or foreign frames rejected (never pickled)."""

import os
import random

import msgspec
import numpy as np
import pytest
from helpers import engine_message

from pooling_pipeline.core.engine.columns import Requests
from pooling_pipeline.core.engine.main import pack_outputs
from pooling_pipeline.core.shared import messages as m
from pooling_pipeline.core.shared.schema import split_packed
from pooling_pipeline.core.shared.serial import INLINE_MAX_BYTES, Decoder, Encoder, ForeignMessage


def _inputs(lengths: list[int], chunked: bool = False, **columns) -> list[tuple]:
    """Rows for `engine_message`: request i has ids 0 .. lengths[i] - 1."""
    return [(i, np.arange(n, dtype=np.int32), m.PoolingParams(),
             {"chunk": i, "num_chunks": len(lengths), **columns} if chunked else columns)
            for i, n in enumerate(lengths)]


def _batch(rows: list[tuple], call: str = "c-") -> Requests:
    """A step's batch, as the engine has it: columns (here, of one message)."""
    msg = engine_message(call, rows)
    msg.check()
    return Requests.from_message(msg)


def test_round_trip_small_and_large_arrays():
    enc, dec = Encoder(), Decoder(m.EngineInbound)
    small = np.arange(7, dtype=np.int32)
    large = np.arange(INLINE_MAX_BYTES, dtype=np.int32)  # travels as its own frame
    frames = enc.encode(engine_message("call-", [
        (0, small),
        (5, large, m.PoolingParams(dimensions=8, normalize=False), {"token_type_start": 3}),
    ]))
    assert len(frames) == 2  # the packed ids are big enough for their own frame
    msg = dec.decode(frames)
    assert msg.call == "call-" and msg.indices.tolist() == [0, 5] and msg.lengths.tolist() == [7, INLINE_MAX_BYTES]
    # Only the columns some row differs in travel; the defaults do not.
    assert sorted(msg.columns) == ["param_of", "token_type_start"] and msg.columns["param_of"].tolist() == [0, 1]
    assert msg.params == [m.PoolingParams(), m.PoolingParams(dimensions=8, normalize=False)]
    requests = Requests.from_message(msg)  # as the engine reads it: columns
    np.testing.assert_array_equal(requests.ids(0), small)
    assert requests.dimensions.tolist() == [-1, 8] and requests.normalize.tolist() == [-1, 0]
    assert requests.token_type_start.tolist() == [-1, 3] and requests.indices.tolist() == [0, 5]
    np.testing.assert_array_equal(requests.ids(1), large)


@pytest.mark.parametrize("change", ["sum", "extra length", "negative", "2-D ids", "param_of", "entries", "column",
                                    "2-D column", "unknown column"])
def test_engine_input_columns_that_do_not_fit_are_rejected(change):
    ids, lengths, indices = np.arange(5, dtype=np.int32), np.array([2, 3]), np.array([0, 1])
    tasks, params, columns = ["embed"], [m.PoolingParams()], {}
    if change == "sum":
        lengths = np.array([2, 2])
    elif change == "extra length":
        lengths = np.array([2, 3, 0])
    elif change == "negative":
        lengths = np.array([-1, 6])
    elif change == "2-D ids":
        ids = np.arange(6, dtype=np.int32).reshape(2, 3)
    elif change == "param_of":
        columns = {"param_of": np.array([0, 1])}
    elif change == "entries":
        tasks = ["embed", "classify"]
    elif change == "column":
        columns = {"priority": np.array([1, 2, 3])}
    elif change == "2-D column":
        columns = {"chunk": np.zeros((2, 3), np.int64)}
    else:
        columns = {"no_such_column": np.array([1, 2])}
    msg = m.EngineInputBatch(worker=0, call="c-", indices=indices, lengths=lengths, token_ids=ids, tasks=tasks,
                             params=params, columns=columns)
    msg = Decoder(m.EngineInbound).decode(Encoder().encode(msg))
    with pytest.raises(ValueError):
        msg.check()


def test_output_vectors_travel_as_one_array():
    enc, dec = Encoder(), Decoder(m.FrontendInbound)
    vectors = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    batch = _batch(_inputs([4, 5, 6]))
    for results in (vectors, list(vectors)):  # a runner's matrix, or one vector each
        msg = dec.decode(enc.encode(pack_outputs(batch, results, 0.1, 12, 3)))
        msg.check()
        assert msg.data is not None and msg.data.shape == (3, 8) and msg.arrays is None and msg.chunks is None
        assert msg.calls == ["c-"] and msg.call_of is None and msg.indices.tolist() == [0, 1, 2]
        assert msg.num_prompt_tokens.tolist() == [4, 5, 6]
        np.testing.assert_array_equal(msg.data, vectors)
    # Token vectors differ in length per request: they stay per output.
    ragged = [np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)]
    msg = dec.decode(enc.encode(pack_outputs(_batch(_inputs([2, 3])), ragged, 0.1, 6, 2)))
    assert msg.data is None and [a.shape for a in msg.arrays] == [(2, 4), (3, 4)]
    # Chunks carry (chunk, number of chunks).
    msg = dec.decode(enc.encode(pack_outputs(_batch(_inputs([2, 3], chunked=True)), vectors[:2], 0.1, 6, 2)))
    assert msg.chunks.tolist() == [[0, 2], [1, 2]]
    # Decoded as views of the received frames (the frontend's decoder): every per-output array
    # gets its own writable copy, so a result kept does not pin a frame.
    cases = [(_inputs([300, 2]), [(np.arange(300, dtype=np.int32), np.ones(300, np.float32)),
                                  (np.arange(2, dtype=np.int32), np.ones(2, np.float32))], True),
             (_inputs([300, 2]), [np.ones((300, 4), np.float32), np.ones((2, 4), np.float32)], False)]
    for inputs, results, sparse in cases:
        msg = dec.decode(enc.encode(pack_outputs(_batch(inputs), results, 0.1, 6, 2, sparse=sparse)))
        msg.check()
        msg.own_arrays()
        for array in msg.arrays + (msg.sparse_ids or []):
            assert array.flags.owndata and array.flags.writeable
        if sparse:
            assert [a.tolist() for a in msg.sparse_ids] == [list(range(300)), [0, 1]]


def test_a_step_of_several_calls_names_each_outputs_call_and_splits_by_call():
    a, b = _batch(_inputs([3, 4]), "a-"), _batch(_inputs([5]), "b-")
    step = Requests(np.concatenate([a.calls, b.calls]), np.concatenate([a.cols, b.cols]),
                    np.concatenate([a.token_ids, b.token_ids]))
    vectors = np.arange(12, dtype=np.float32).reshape(3, 4)
    msg = Decoder(m.FrontendInbound).decode(Encoder().encode(pack_outputs(step, vectors, 0.3, 15, 3)))
    msg.check()
    assert msg.calls == ["a-", "b-"] and msg.call_of.tolist() == [0, 0, 1]
    first, second = msg.part(0), msg.part(1)
    assert first.calls == ["a-"] and first.indices.tolist() == [0, 1] and first.call_of is None
    np.testing.assert_array_equal(second.data, vectors[2:])
    assert second.num_prompt_tokens.tolist() == [5] and abs(first.busy_s - 0.2) < 1e-9


@pytest.mark.parametrize("change", ["indices", "tokens", "rows", "both", "neither", "arrays", "sparse", "chunks",
                                    "call_of", "calls"])
def test_output_columns_that_do_not_fit_are_rejected(change):
    calls, idx, tok, call_of = ["a-"], np.array([0, 1]), np.array([3, 4]), None
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
    elif change == "call_of":
        call_of = np.array([0, 1])  # names a second call that is not there
    elif change == "calls":
        calls = []
    else:
        chunks = np.zeros((2, 3), np.int64)
    msg = Decoder(m.FrontendInbound).decode(Encoder().encode(
        m.OutputBatch(calls=calls, indices=idx, num_prompt_tokens=tok, busy_s=0.1, padded_tokens=8, in_core=2,
                      call_of=call_of, data=data, arrays=arrays, sparse_ids=sparse_ids, chunks=chunks)))
    with pytest.raises(ValueError):
        msg.check()


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
    index = ["<i8", [1], b"\x00" * 8]
    header = msgspec.msgpack.encode(["EngineInputBatch", 0, "c-", index, ["<i8", [1], b"\x03" + b"\x00" * 7], bad,
                                     ["embed"], [{}]])
    with pytest.raises(msgspec.ValidationError):
        Decoder(m.EngineInbound).decode([header])


def test_render_batches_carry_one_input_form_and_shared_options():
    enc, dec = Encoder(), Decoder(m.WorkerInbound)
    options = m.RenderOptions(task="embed", max_tokens=16, params=m.PoolingParams(), text_prefix="query: ")
    indices = np.array([3, 4, 9])
    texts = dec.decode(enc.encode(m.RenderBatch(call="c-", indices=indices, options=options, texts=["a", "b", "c"], engine=1)))
    assert texts.check() == 3 and texts.options == options and texts.engine == 1 and texts.indices.tolist() == [3, 4, 9]
    ids = np.arange(5000, dtype=np.int32)
    packed = dec.decode(enc.encode(m.RenderBatch(call="c-", indices=indices, options=options, token_ids=ids,
                                                 lengths=np.array([1, 4, 4995]))))
    assert packed.check() == 3
    assert [a.tolist()[:2] for a in split_packed(packed.token_ids, packed.lengths.tolist())] == [[0], [1, 2], [5, 6]]
    items = [m.RenderParams(options=options, conversation=[{"role": "user", "content": "hi"}]),
             m.RenderParams(options=m.RenderOptions(task="embed", max_tokens=8,
                                                    params=m.PoolingParams(normalize=False)), prompt="x")]
    general = dec.decode(enc.encode(m.RenderBatch(call="c-", indices=indices[:2], items=items, chat_template="tmpl")))
    assert general.check() == 2 and general.items[1].options.max_tokens == 8 and general.chat_template == "tmpl"


def test_a_resent_batch_says_so_through_the_worker_to_the_engine():
    """A lost worker's requests are re-sent marked `resent`: the mark travels in the RenderBatch and
    in the EngineInputBatch (the engine looks up waiting copies only for those), absent otherwise."""
    enc = Encoder()
    options = m.RenderOptions(task="embed", max_tokens=16, params=m.PoolingParams())
    batch = m.RenderBatch(call="c-", indices=np.array([3, 4]), options=options, texts=["a", "b"])
    plain = enc.encode(batch)
    again = enc.encode(msgspec.structs.replace(batch.select([1]), resent=True))
    worker_side = Decoder(m.WorkerInbound)
    assert not worker_side.decode(plain).resent and worker_side.decode(again).resent
    msg = engine_message("c-", [(4, np.array([5, 6], np.int32))])
    msg.resent = True
    engine_side = Decoder(m.EngineInbound).decode(enc.encode(msg))
    assert engine_side.resent and not Decoder(m.EngineInbound).decode(enc.encode(engine_message("c-", [(4, [5])]))).resent


@pytest.mark.parametrize("change", ["two forms", "no form", "lengths", "texts", "no options", "items with options",
                                    "pairs", "2-D indices"])
def test_render_batches_that_do_not_fit_are_rejected(change):
    options = m.RenderOptions(task="embed", max_tokens=16, params=m.PoolingParams())
    fields = {"options": options, "texts": ["a", "b"]}
    indices = np.array([0, 1])
    if change == "two forms":
        fields.update(token_ids=np.arange(3, dtype=np.int32), lengths=np.array([1, 2]))
    elif change == "no form":
        del fields["texts"]
    elif change == "lengths":
        fields = {"options": options, "token_ids": np.arange(3, dtype=np.int32), "lengths": np.array([1, 3])}
    elif change == "texts":
        fields["texts"] = ["a"]
    elif change == "no options":
        del fields["options"]
    elif change == "items with options":
        fields = {"options": options, "items": [m.RenderParams(options=options, prompt="a")] * 2}
    elif change == "pairs":
        fields["pairs"] = ["only one"]
    else:
        indices = np.array([[0, 1]])
    msg = Decoder(m.WorkerInbound).decode(Encoder().encode(m.RenderBatch(call="c-", indices=indices, **fields)))
    with pytest.raises(ValueError):
        msg.check()


def test_fuzzed_frames_never_crash_the_decoder():
    rng = random.Random(1)
    enc = Encoder()
    valid = enc.encode(engine_message("c-", _inputs([5, 2]), worker=3))[0]
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
                msg = dec.decode([frame])
                if hasattr(msg, "check"):
                    msg.check()
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                rejected += 1
    assert rejected > 3000  # most of them are garbage for most sockets, and none raised anything else


def test_messages_without_the_group_key_are_dropped_unread():
    """Within a group every message starts with the group's random key: a well-formed message
    from a process that does not know it (a forger guessing ids) is refused before decoding."""
    key = os.urandom(16)
    enc, dec = Encoder(key), Decoder(m.EngineInbound, key=key)
    ids = np.arange(INLINE_MAX_BYTES, dtype=np.int32)  # large: its own frame, after the key and the header
    msg = engine_message("c-", [(0, ids)])
    frames = enc.encode(msg)
    assert frames[0] == key and len(frames) == 3
    np.testing.assert_array_equal(dec.decode(frames).token_ids, ids)
    forged = [Encoder().encode(msg), Encoder(os.urandom(16)).encode(msg), [key], [], [key[:-1] + b"x", *frames[1:]],
              [frames[1], *frames]]
    for frames in forged:
        with pytest.raises(ForeignMessage):
            dec.decode(frames)
    assert issubclass(ForeignMessage, msgspec.DecodeError)  # every receiver's "drop and log" path


def test_the_engine_refuses_each_bad_row_naming_it_and_keeps_the_rest():
    """One vectorized pass over a message: a valid one gives nothing to refuse; each broken rule
    names its row (the first rule it breaks), whatever columns the message carried."""
    from types import SimpleNamespace

    from pooling_pipeline.core.engine.columns import invalid_rows, task_lookup

    model = SimpleNamespace(max_model_len=8, vocab_size=100, tasks=["embed"], routes=["query", "document"], image=None)
    runs = task_lookup(model.tasks)
    good = (0, np.arange(3, dtype=np.int32))
    msg = engine_message("c-", [good, (1, np.arange(5, dtype=np.int32), m.PoolingParams(), {"token_type_start": 2})])
    assert invalid_rows(Requests.from_message(msg), model, runs, msg.columns.keys()) == []
    rows = [good,
            (1, np.arange(9, dtype=np.int32)),  # longer than the model takes
            (2, np.array([5, 100], np.int32)),  # an id outside the vocabulary
            (3, np.arange(3, dtype=np.int32), m.PoolingParams(), {"token_type_start": 3}),
            (4, np.arange(3, dtype=np.int32), m.PoolingParams(), {"pool_start": -1}),
            (5, np.arange(3, dtype=np.int32), m.PoolingParams(), {"chunk": 2, "num_chunks": 2}),
            (6, np.array([-1, 4], np.int32)),  # negative: read as unsigned, huge
            (7, np.arange(3, dtype=np.int32), m.PoolingParams(), {"route": 2})]  # the model has two routes
    msg = engine_message("c-", rows)
    for sent in (msg.columns.keys(), None):
        refused = dict(invalid_rows(Requests.from_message(msg), model, runs, sent))
        assert sorted(refused) == [1, 2, 3, 4, 5, 6, 7]
        assert "9 tokens" in refused[1] and "outside [0, 100)" in refused[2] and "token_type_start 3" in refused[3]
        assert "pool_start -1" in refused[4] and "chunk 2 of 2" in refused[5] and "outside [0, 100)" in refused[6]
        assert "route 2" in refused[7]
    other = engine_message("c-", [good], task="classify")  # a task the model does not run
    assert "task" in invalid_rows(Requests.from_message(other), model, runs, other.columns.keys())[0][1]


# A value each checked request column's rule refuses (with the columns it is read with), and the reason.
BAD_COLUMN_VALUES = {
    "token_type_start": ({"token_type_start": 3}, "token_type_start 3 is outside the prompt"),
    "pool_start": ({"pool_start": -1}, "pool_start -1 is negative"),
    "chunk": ({"chunk": 2, "num_chunks": 2}, "chunk 2 of 2 is not a chunk"),
    "num_chunks": ({"chunk": 1, "num_chunks": 1}, "chunk 1 of 1 is not a chunk"),
    "route": ({"route": 2}, "route 2 is not one of the model's 2 routes"),
    "expansion_start": ({"expansion_start": 4}, "expansion_start 4 is not a token of the row's 3"),
    "modality": ({"modality": 1}, "an image input, but the model takes no images"),
}


def test_the_columns_the_engine_checks_are_those_its_rules_read():
    """The usual message (no checked column carried) skips the rules; which columns are checked is
    read from the rules themselves (`ROW_RULES`, a text model's `TEXT_ONLY`), every one a column
    `core.shared.schema` declares, so a new column needs no edit in `invalid_rows` (issue 50, item 8).
    A message carrying one checked column alone, with a value its rule refuses, is refused naming it; one carrying only columns
    any value of which is valid (priority) passes."""
    from types import SimpleNamespace

    from pooling_pipeline.core.engine.columns import TEXT_ONLY, invalid_rows, task_lookup
    from pooling_pipeline.core.shared.schema import DEFAULTS

    checked = TEXT_ONLY.checked
    assert checked == {name for rule in TEXT_ONLY.rules for name in rule.reads} <= DEFAULTS.keys()
    assert set(BAD_COLUMN_VALUES) == checked  # (a new checked column gets its case here)
    assert "priority" not in checked and "param_of" not in checked
    model = SimpleNamespace(max_model_len=8, vocab_size=100, tasks=["embed"], routes=["query", "document"], image=None)
    runs = task_lookup(model.tasks)
    for name, (columns, why) in BAD_COLUMN_VALUES.items():
        msg = engine_message("c-", [(0, np.arange(3, dtype=np.int32)),
                                    (1, np.arange(3, dtype=np.int32), m.PoolingParams(), columns)])
        assert name in msg.columns
        refused = invalid_rows(Requests.from_message(msg), model, runs, msg.columns.keys())
        assert [row for row, _ in refused] == [1] and why in refused[0][1], (name, refused)
    free = engine_message("c-", [(0, np.arange(3, dtype=np.int32), m.PoolingParams(), {"priority": -5})])
    assert set(free.columns) == {"priority"}
    assert invalid_rows(Requests.from_message(free), model, runs, free.columns.keys()) == []


def test_wire_structs_are_built_by_keyword_only():
    """Built by position, two fields of one type could swap silently (a Heartbeat's counts): every
    message struct refuses it (issue 36)."""
    for struct in (m.Heartbeat, m.Ready, m.Abort, m.StepFailed, m.RenderFailed, m.RenderOptions, m.RenderParams,
                   m.RenderBatch, m.EngineInputBatch, m.OutputBatch, m.PoolingParams):
        with pytest.raises(TypeError):
            struct("positional", 0)
    beat = m.Heartbeat(role="worker", index=0, busy_s=0.0, pid=1, received=3, finished=2, sent_at=0.0, info={})
    assert (beat.received, beat.finished) == (3, 2)
