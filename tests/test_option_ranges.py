"""Every option has a range, declared once and checked in the caller before any process starts (a
ValueError naming the option and its range); a call's buffers are sized by what it holds, not by the
in-flight window it may use (issue 48, item 11)."""

from __future__ import annotations

import gc

import msgspec
import numpy as np
import psutil
import pytest

from pooling_pipeline import Pipeline, api
from pooling_pipeline.call_stats import CallStats
from pooling_pipeline.frontend.reorder import MIN_CAPACITY, Ring
from pooling_pipeline.options import (
    CALL_OPTIONS,
    MAX_DATA_PARALLEL,
    MAX_ENGINE_WINDOW,
    MAX_INFLIGHT,
    MAX_NUM_SEQS,
    CallOptions,
    PipelineOptions,
    declared,
)
from pooling_pipeline.outputs import PoolingRequestOutput

MB = 1 << 20
# Checked by the code that reads them, in the caller, with their own errors: the per-request options
# (pipeline/request_options.py), the plugin (workers.render.load_plugin) and the simulated device.
CHECKED_BY_THEIR_READERS = {"pooling_params", "priority", "prompt", "prompt_name", "route", "io_processor",
                            "sim_device"}


class _Started(Exception):
    """A test's stand-in for starting the process group: the checks before it have all passed."""


@pytest.fixture
def no_process_group(monkeypatch):
    """`Pipeline(...)` stops where it would start processes (what it was given is kept)."""
    given = {}

    def start(spec, plan):
        given["plan"] = plan
        raise _Started

    monkeypatch.setattr(api, "ProcessGroup", start)
    return given


def _bounded(t: msgspec.inspect.Type) -> bool:
    """Whether a declared type has a range: both bounds of a number, a str's pattern or length, a
    Literal's values, a bool (None is one value)."""
    mi = msgspec.inspect
    if isinstance(t, mi.Metadata):
        return _bounded(t.type)
    if isinstance(t, mi.UnionType):
        return all(_bounded(x) for x in t.types)
    if isinstance(t, (mi.IntType, mi.FloatType)):
        return (t.ge is not None or t.gt is not None) and (t.le is not None or t.lt is not None)
    if isinstance(t, mi.StrType):
        return t.pattern is not None or t.max_length is not None
    return isinstance(t, (mi.LiteralType, mi.BoolType, mi.NoneType))


def test_every_pipeline_and_call_option_declares_a_range():
    callers = {name for names in CALL_OPTIONS.values() for name in names}
    options = [o for o in declared(PipelineOptions).values()] + [declared(CallOptions)[n] for n in sorted(callers)]
    unbounded = [o.name for o in options if o.name not in CHECKED_BY_THEIR_READERS and not _bounded(o.type)]
    assert not unbounded


@pytest.mark.parametrize("name, value", [
    ("max_num_seqs", 2**18), ("max_inflight", 2**62), ("engine_threads", 10**6), ("engine_window", 2**40),
    ("num_render_workers", 10**5), ("data_parallel_size", 10**4), ("max_num_batched_tokens", 2**40),
    ("max_image_pixels", 2**50), ("heartbeat_timeout_s", 0.001), ("startup_timeout_s", float("inf")),
    ("step_timeout_s", float("nan")), ("log_level", "chatty"), ("device", "cuda:99999999999")])
def test_an_extreme_pipeline_option_is_a_value_error_naming_it_and_its_range(no_process_group, name, value):
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match=rf"^{name} must be (an int in \[|a number in \[|a str matching)") as info:
        Pipeline(**{name: value})
    assert repr(value) in str(info.value)
    assert not no_process_group  # refused before the process group was started
    assert psutil.Process().children(recursive=True) == before


@pytest.mark.parametrize("name, value", [("truncate_prompt_tokens", 2**40), ("chunk_overlap", 2**40),
                                         ("max_tokens_per_query", 2**40), ("max_tokens_per_doc", 2**40)])
def test_an_extreme_call_option_is_a_value_error_naming_it_and_its_range(name, value):
    from pooling_pipeline.core.shared.options import checked

    with pytest.raises(ValueError, match=rf"^{name} must be an int in \[-?\d+, \d+\]"):
        checked(CallOptions, {"task": "score", name: value})


def test_derived_windows_stay_within_their_bounds(no_process_group):
    """The largest legal max_num_seqs on the most engine cores: the in-flight window and the engine's,
    derived from it, are held to their declared bounds."""
    pipe = Pipeline.__new__(Pipeline)
    with pytest.raises(_Started):
        pipe.__init__(max_num_seqs=MAX_NUM_SEQS, data_parallel_size=MAX_DATA_PARALLEL, device="cpu")
    assert pipe.max_inflight == MAX_INFLIGHT
    assert no_process_group["plan"].engine_window <= MAX_ENGINE_WINDOW


def test_the_reorder_ring_grows_with_what_the_call_holds_and_keeps_every_answer():
    """Requests sent in blocks and answered out of order while the ring grows under them: results
    come back in input order, each with its own vector, and the ring never outgrows what was held."""
    ring = Ring(MAX_INFLIGHT, "c-", PoolingRequestOutput, CallStats(), default_normalize=False, keep_all=False)
    assert ring.mask + 1 == MIN_CAPACITY  # a call starts small, whatever the bound
    rng = np.random.default_rng(7)
    issued, out, results, most_held = 0, [], [], 0
    for _ in range(60):
        count = int(rng.integers(1, 40))
        ring.make_room(issued, issued + count)  # as Call._issue does before drawing its grant
        indices = np.arange(issued, issued + count, dtype=np.int64)
        ring.out_index[indices & ring.mask] = indices  # sent (Call._send)
        issued += count
        out.extend(indices.tolist())
        most_held = max(most_held, issued - ring.next_index)
        rng.shuffle(out)
        answered, out = np.asarray(out[: len(out) // 2], dtype=np.int64), out[len(out) // 2:]
        vectors = np.repeat(answered[:, None].astype(np.float32), 3, axis=1)
        ring.accept_vectors(answered, vectors, answered + 1)
        results += ring.hand_back(issued)
    rest = np.asarray(out, dtype=np.int64)
    ring.accept_vectors(rest, np.repeat(rest[:, None].astype(np.float32), 3, axis=1), rest + 1)
    results += ring.hand_back(issued)
    assert [r.index for r in results] == list(range(issued))
    assert all(r.data.tolist() == [r.index] * 3 and r.num_prompt_tokens == r.index + 1 for r in results)
    assert ring.mask + 1 < 2 * most_held


def test_a_ring_asked_for_more_than_the_bound_is_a_bug():
    ring = Ring(64, "c-", PoolingRequestOutput, CallStats(), default_normalize=False, keep_all=False)
    with pytest.raises(RuntimeError, match="this is a bug"):
        ring.make_room(0, 65)


@pytest.mark.slow
def test_one_prompt_calls_under_the_largest_window_keep_the_frontend_flat(model_path):
    """Ten one-prompt calls with the largest in-flight window: the caller's process grows by a few
    MB at most. (A ring sized by the window took 16 MB a call here -- 8 bytes a slot in its index
    column and in its list of vectors, 2**20 slots -- freed only by the garbage collector, which is
    kept off during the calls so that what each call allocates is what it keeps.)"""
    me = psutil.Process()
    with Pipeline(model_path, num_render_workers=1, max_inflight=MAX_INFLIGHT, engine_window=64) as pipe:
        pipe.embed(["warming up"], use_tqdm=False)
        gc.collect()
        gc.disable()
        try:
            before = me.memory_info().rss
            for _ in range(10):
                (out,) = pipe.embed(["one prompt"], use_tqdm=False)
                assert out.embedding.shape == (384,)
            grown = me.memory_info().rss - before
        finally:
            gc.enable()
    assert grown < 8 * MB, f"the caller grew by {grown / MB:.1f} MB over ten one-prompt calls"
