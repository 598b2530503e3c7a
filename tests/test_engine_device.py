"""Every CUDA call an engine core makes runs under its own device (core/device_copies.use_device):
a data-parallel engine core on cuda:1 must not time or wait for its steps on GPU 0's stream, read
its pinned copies back before they land, capture its graphs on a GPU 0 stream, or open a context
on GPU 0.

The suite has no GPU: `StandInCuda` plays torch.cuda on a machine of two GPUs, on the CPU. Each of
its calls records the device it acts on, as torch's own does -- the current device of the calling
thread (a process starts on cuda:0), or the device a stream or event names -- and tensors put on a
CUDA device stay on the CPU (`CudaOnHost`), the device they were named for recorded. The engine's
own path is run: its model family builds the runner for the engine's config, the start-up probe
runs its steps, and a step's events, copies and graph captures are looked at."""

from __future__ import annotations

import threading
from functools import partial

import msgspec
import numpy as np
import pytest
import torch
from model_zoo import build_clip, build_sentence_t5, build_st, build_static
from torch.overrides import TorchFunctionMode

from pooling_pipeline.core.engine.columns import COL, probe_batch
from pooling_pipeline.core.families import family_of
from pooling_pipeline.core.shared.config import EngineConfig
from pooling_pipeline.core.shared.messages import Payload
from pooling_pipeline.core.shared.model_folder.load import load_model_spec

TOL = 1e-5
GPUS = 2


class StandInCuda:
    """torch.cuda on a two-GPU machine as the engine calls it, held on the CPU. `calls`: (what ran,
    the device index it ran on) in order. Each stand-in acts as torch's does: an event records on
    the stream given, else on the current device's; `torch.cuda.stream(s)` and `torch.cuda.device(d)`
    switch the thread's current device for their block; `torch.cuda.graph` without a stream captures
    on a stream made on the device current at its first use (its default capture stream),
    synchronizing the current device first; CUDAGraph.capture_begin captures on the current device."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int] = (9, 0)) -> None:
        self.capability = capability  # every GPU's (8.0: A100, 9.0: H100 / H200, 7.5: T4)
        self.calls: list[tuple[str, int | None]] = []
        self._thread = threading.local()  # (CUDA's current device is per thread)
        self.default_capture_stream: Stream | None = None
        patches = {"is_available": lambda: True, "device_count": lambda: GPUS, "current_device": self.current,
                   "set_device": self.set_device, "device": lambda device: Switch(self, self.index(device), "device"),
                   "current_stream": lambda device=None: Stream(self, device, made=False),
                   "stream": lambda stream: Switch(self, stream.index, "stream"),
                   "Stream": partial(Stream, self), "Event": partial(Event, self), "CUDAGraph": partial(CUDAGraph, self),
                   "graph": partial(GraphCapture, self), "synchronize": self.synchronize,
                   "empty_cache": lambda: self.ran("empty_cache", self.current()),
                   "is_bf16_supported": self.is_bf16_supported, "mem_get_info": self.mem_get_info,
                   "get_device_capability": self.get_device_capability}
        for name, value in patches.items():
            monkeypatch.setattr(torch.cuda, name, value)
        # (a process-wide switch the engine turns on CUDA: not this test process's)
        monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: None)

    def current(self) -> int:
        return getattr(self._thread, "index", 0)

    def make_current(self, index: int) -> None:
        self._thread.index = index

    def index(self, device) -> int:
        """The index `device` names (None, or "cuda" without one: the current device)."""
        if device is None:
            return self.current()
        if isinstance(device, int):
            return device
        device = torch.device(device)
        assert device.type == "cuda", device
        return self.current() if device.index is None else device.index

    def ran(self, what: str, index: int | None) -> None:
        self.calls.append((what, index))

    def set_device(self, device) -> None:
        self.make_current(self.index(device))
        self.ran("set_device", self.current())

    def synchronize(self, device=None) -> None:
        self.ran("synchronize", self.index(device))

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        """As torch's: True on a GPU without bfloat16 units too unless emulation is left out."""
        self.ran("is_bf16_supported", self.current())
        return including_emulation or self.capability[0] >= 8

    def get_device_capability(self, device=None) -> tuple[int, int]:
        self.ran("get_device_capability", self.index(device))
        return self.capability

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.ran("mem_get_info", self.index(device))
        return 1 << 34, 1 << 35

    def devices(self) -> set:
        return {index for _, index in self.calls}


class Stream:
    def __init__(self, cuda: StandInCuda, device=None, priority: int = 0, made: bool = True) -> None:
        self.cuda, self.index = cuda, cuda.index(device)
        self.device = torch.device("cuda", self.index)
        cuda.ran("Stream" if made else "current_stream", self.index)

    def wait_stream(self, other: Stream) -> None:
        self.cuda.ran("wait_stream", self.index)


class Event:
    def __init__(self, cuda: StandInCuda, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.cuda, self.index = cuda, None  # (a CUDA event is made on the device of its first record)

    def record(self, stream: Stream | None = None) -> None:
        self.index = (stream or Stream(self.cuda, None, made=False)).index
        self.cuda.ran("Event.record", self.index)

    def synchronize(self) -> None:
        self.cuda.ran("Event.synchronize", self.index)

    def elapsed_time(self, end: Event) -> float:
        self.cuda.ran("Event.elapsed_time", self.index)
        return 0.0


class CUDAGraph:
    def __init__(self, cuda: StandInCuda) -> None:
        self.cuda, self.index = cuda, None

    def capture_begin(self, *pool, **options) -> None:
        self.index = self.cuda.current()
        self.cuda.ran("CUDAGraph.capture_begin", self.index)

    def capture_end(self) -> None:
        self.cuda.ran("CUDAGraph.capture_end", self.cuda.current())

    def replay(self) -> None:  # (under a guard of its capture's device, as torch's)
        self.cuda.ran("CUDAGraph.replay", self.index)

    def pool(self) -> tuple:
        return ("pool", self.index)


class Switch:
    """A block under another current device (torch.cuda.device; a stream's block switches it too)."""

    def __init__(self, cuda: StandInCuda, index: int, what: str) -> None:
        self.cuda, self.index, self.what = cuda, index, what

    def __enter__(self) -> None:
        self.before = self.cuda.current()
        self.cuda.ran(self.what, self.index)
        self.cuda.make_current(self.index)

    def __exit__(self, *exc) -> None:
        self.cuda.make_current(self.before)


class GraphCapture:
    """torch.cuda.graph: synchronizes and empties the current device's cache, then captures on its
    stream (given, or the default capture stream, made once on the device current then)."""

    def __init__(self, cuda: StandInCuda, cuda_graph: CUDAGraph, pool=None, stream: Stream | None = None,
                 **options) -> None:
        if stream is None and cuda.default_capture_stream is None:
            cuda.default_capture_stream = Stream(cuda)
        self.cuda, self.graph, self.pool = cuda, cuda_graph, () if pool is None else (pool,)
        self.block = Switch(cuda, (stream or cuda.default_capture_stream).index, "stream")

    def __enter__(self) -> None:
        self.cuda.synchronize()
        self.cuda.ran("empty_cache", self.cuda.current())
        self.block.__enter__()
        self.graph.capture_begin(*self.pool)

    def __exit__(self, *exc) -> None:
        self.graph.capture_end()
        self.block.__exit__(*exc)


class CudaOnHost(TorchFunctionMode):
    """Tensors named for a CUDA device are made on the CPU, the device they were named for recorded
    (`cuda.calls`: "tensor on"); pinned host memory is plain memory, its allocation recorded on the
    current device (torch allocates it in the current device's context)."""

    def __init__(self, cuda: StandInCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.device:  # (naming a device allocates nothing: modes see torch.device(...) too)
            return func(*args, **kwargs)
        if func is torch.Tensor.pin_memory:
            self.cuda.ran("pin_memory", self.cuda.current())
            return args[0]
        if kwargs.pop("pin_memory", False):
            self.cuda.ran("pinned alloc", self.cuda.current())
        return func(*[self._host(a) for a in args], **{k: self._host(v) for k, v in kwargs.items()})

    def _host(self, value):
        if isinstance(value, str) and value.startswith("cuda"):
            value = torch.device(value)
        if isinstance(value, torch.device) and value.type == "cuda":
            self.cuda.ran("tensor on", self.cuda.index(value))
            return torch.device("cpu")
        return value


def engine_config(model: str, device: str) -> EngineConfig:
    """An engine core's config, as the process group writes it for engine core 1 of two."""
    return EngineConfig(model=load_model_spec(model), device=device, dtype="float32", max_num_seqs=64,
                        max_num_batched_tokens=256, window=256, max_message_items=16, torch_threads=1,
                        input_endpoint="ipc:///nowhere/in", control_endpoint="ipc:///nowhere/control",
                        output_endpoint="ipc:///nowhere/out", parent_pid=0, index=1, backend="torch")


def run_engine_side(cuda: StandInCuda, cfg: EngineConfig, batches: list):
    """What an engine core does with its runner, under the stand-in: built by the model's family (the
    engine's start), the start-up probe's steps, then `batches` launched and finished. -> (runner,
    each batch's results, the graphs captured by the probe)."""
    with CudaOnHost(cuda):
        runner = family_of(cfg.model).runner(cfg)
        runner.step_cost(cfg.max_num_batched_tokens)
        probed = getattr(runner, "graph_stats", dict)().get("captured", 0)
        return runner, [runner.run(batch)[0] for batch in batches], probed


def assert_cpu_results(monkeypatch: pytest.MonkeyPatch, cfg: EngineConfig, batches: list, got: list) -> None:
    """The results are those of the same model's runner on the CPU (built without the stand-in)."""
    monkeypatch.undo()
    plain = family_of(cfg.model).runner(msgspec.structs.replace(cfg, device="cpu"))
    for batch, results in zip(batches, got):
        np.testing.assert_allclose(results, plain.run(batch)[0], atol=TOL, rtol=0)


def assert_all_on(cuda: StandInCuda, index: int, expected: set[str]) -> None:
    """Every CUDA call ran on cuda:`index` (none on another GPU), the first of them made it current,
    and the calls `expected` were among them (so the check saw the paths it is about)."""
    elsewhere = [(what, i) for what, i in cuda.calls if i != index]
    assert not elsewhere, f"CUDA calls off cuda:{index}: {sorted(set(elsewhere))}"
    assert cuda.calls[0] == ("set_device", index), cuda.calls[:3]
    missing = expected - {what for what, _ in cuda.calls}
    assert not missing, f"never called (the check missed a path): {missing}"


def text_batch(rows: int, length: int, seed: int):
    batch = probe_batch(rows, length, 7, "embed")
    batch.token_ids[:] = np.random.default_rng(seed).integers(5, 200, len(batch.token_ids))
    return batch


STEP_CALLS = {"set_device", "Event.record", "Event.synchronize", "Event.elapsed_time", "pin_memory", "tensor on"}


@pytest.mark.slow
def test_a_transformer_engine_on_the_second_gpu_makes_every_cuda_call_there(monkeypatch, tmp_path):
    """A transformer model's engine core on cuda:1 (device steps, CUDA graphs on): runner built, the
    probe's steps, two steps of new shapes -- events recorded and waited for, inputs pinned and
    copied, graphs captured and replayed: every call on cuda:1, the first one making it current.
    (Before: the events and the pinned buffers were GPU 0's, and graphs were captured on a GPU 0
    stream.) The vectors are the CPU runner's: each step is of a shape the probe did not capture
    (a stand-in replay gives the output of its capture, which ran on that step's inputs)."""
    cfg = engine_config(build_st(tmp_path, "bert"), "cuda:1")  # (built before CUDA is stood in for)
    cuda = StandInCuda(monkeypatch)
    batches = [text_batch(3, 9, seed=0), text_batch(5, 21, seed=1)]
    runner, got, probed = run_engine_side(cuda, cfg, batches)
    assert str(runner.device) == "cuda:1" and runner.backend_info["cuda_graphs"] == "on"
    assert runner.graph_stats()["captured"] == probed + 2 and "off" not in runner.graph_stats(), runner.graph_stats()
    assert_all_on(cuda, 1, STEP_CALLS | {"Stream", "CUDAGraph.capture_begin", "CUDAGraph.replay", "synchronize"})
    assert_cpu_results(monkeypatch, cfg, batches, got)


@pytest.mark.slow
def test_a_dual_encoder_engine_on_the_second_gpu_makes_every_cuda_call_there(monkeypatch, tmp_path):
    """A CLIP model's engine core on cuda:1: its towers, image normalization constants, a step of
    texts and an image -- every CUDA call on cuda:1; the vectors are the CPU runner's."""
    cfg = engine_config(build_clip(tmp_path), "cuda:1")
    cuda = StandInCuda(monkeypatch)
    mixed = text_batch(3, 6, seed=2)
    mixed.cols[1, COL["modality"]] = 1
    mixed.payloads["pixels"] = Payload(counts=np.array([0, 1, 0], np.int64),
                                       data=np.random.default_rng(3).integers(0, 256, (1, 3, 224, 224), dtype=np.uint8))
    runner, got, _ = run_engine_side(cuda, cfg, [mixed])
    assert str(runner.device) == "cuda:1"
    assert_all_on(cuda, 1, STEP_CALLS)
    assert_cpu_results(monkeypatch, cfg, [mixed], got)


@pytest.mark.slow
def test_a_static_embedding_engine_on_the_second_gpu_makes_every_cuda_call_there(monkeypatch, tmp_path):
    """A StaticEmbedding model's engine core on cuda:1: its table and a step -- every CUDA call on
    cuda:1; the vectors are the CPU runner's."""
    cfg = engine_config(build_static(tmp_path), "cuda:1")
    cuda = StandInCuda(monkeypatch)
    batches = [text_batch(4, 7, seed=4)]
    runner, got, _ = run_engine_side(cuda, cfg, batches)
    assert str(runner.device) == "cuda:1"
    assert_all_on(cuda, 1, STEP_CALLS)
    assert_cpu_results(monkeypatch, cfg, batches, got)


def test_events_and_graph_captures_name_the_engines_device_whatever_the_threads_current_one(monkeypatch):
    """The pieces that name the device, for cuda:1 while the thread's current device is still cuda:0:
    a step's events record on cuda:1's stream; a graph's warm-up, synchronize and capture run under
    cuda:1 on a capture stream of cuda:1 (torch.cuda.graph's default one is made on the current
    device). Plain "cuda" resolves to the current device, with its index (the engine reports "cuda:0")."""
    from pooling_pipeline.core.engine.cuda_graphs import CudaGraphs, GraphedForward
    from pooling_pipeline.core.engine.device_copies import start_events
    from pooling_pipeline.core.engine.model_runner import resolve_device

    cuda = StandInCuda(monkeypatch)
    one = torch.device("cuda:1")
    weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    with CudaOnHost(cuda):
        start_events(one)
        graphed = GraphedForward(lambda inputs: inputs["x"] @ weight, CudaGraphs(one), half=False)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
        assert torch.allclose(graphed({"x": x}), x @ weight, atol=TOL)
    assert graphed.stats()["captured"] == 1
    assert cuda.devices() == {1}, sorted(set(cuda.calls))
    assert {"CUDAGraph.capture_begin", "synchronize", "Event.record"} <= {what for what, _ in cuda.calls}
    cuda.calls.clear()
    assert str(resolve_device("cuda")) == "cuda:0" and cuda.calls == [("set_device", 0)]


# dtype="auto" on CUDA, by (compute capability, the checkpoint's stored dtype, model_type). 7.5: a T4
# (no bfloat16 units: torch.cuda.is_bf16_supported() still says True, through emulation); 8.0: A100;
# 9.0: H100 / H200. T5-style encoders and Gemma overflow in float16: never run in it.
AUTO_ON_CUDA = {
    ((7, 5), "float32", "bert"): torch.float16, ((7, 5), "bfloat16", "bert"): torch.float16,
    ((7, 5), "float16", "bert"): torch.float16, ((7, 5), "float32", "t5"): torch.float32,
    ((7, 5), "bfloat16", "gemma3_text"): torch.float32, ((7, 5), "float32", "umt5"): torch.float32,
    ((8, 0), "float32", "bert"): torch.bfloat16, ((8, 0), "bfloat16", "qwen3"): torch.bfloat16,
    ((8, 0), "float16", "bert"): torch.float16, ((8, 0), "float32", "t5"): torch.bfloat16,
    ((8, 0), "float16", "mt5"): torch.bfloat16,
    ((9, 0), "float32", "bert"): torch.bfloat16, ((9, 0), "float32", "mt5"): torch.bfloat16,
    ((9, 0), "float16", "xlm-roberta"): torch.float16, ((9, 0), "bfloat16", "gemma3_text"): torch.bfloat16,
}


@pytest.mark.parametrize("capability", [(7, 5), (8, 0), (9, 0)])
def test_auto_dtype_on_cuda_is_bfloat16_where_the_gpu_has_it_and_never_float16_for_a_family_that_overflows(
        monkeypatch, capability):
    """dtype="auto" on CUDA: bfloat16 for a float32 checkpoint on sm80+ (before: float16 everywhere),
    float16 only on a GPU without bfloat16 units (before: a bfloat16 checkpoint ran in emulated
    bfloat16 there), a float16 checkpoint kept; a T5 / mT5 / UMT5 encoder or Gemma never in float16
    (float32 on sm75, said). The choice names itself; dtype="float16" for such a family is refused."""
    from pooling_pipeline.core.engine.model_runner import choose_dtype

    StandInCuda(monkeypatch, capability)
    cuda = torch.device("cuda:0")
    for (cap, stored, family), expected in AUTO_ON_CUDA.items():
        if cap != capability:
            continue
        chosen, why = choose_dtype("auto", cuda, stored, family)
        assert chosen == expected, (cap, stored, family, chosen)
        name = str(expected).removeprefix("torch.")
        assert why.startswith(f"{name} for a {stored} checkpoint on cuda:0 (compute capability {cap[0]}.{cap[1]}"), why
        assert ("overflows in float16" in why) == (family in ("t5", "mt5", "umt5", "gemma3_text")), why
    assert choose_dtype("auto", torch.device("cpu"), "float32", "t5") == (torch.float32, None)
    assert choose_dtype("float16", cuda, "float32", "bert") == (torch.float16, None)
    for device in (cuda, torch.device("cpu")):
        with pytest.raises(ValueError, match=r"dtype='float16' cannot run a 't5' model.*dtype='bfloat16'.*dtype='float32'"):
            choose_dtype("float16", device, "float32", "t5")


@pytest.mark.slow
@pytest.mark.parametrize("capability, expected", [((7, 5), torch.float32), ((9, 0), torch.bfloat16)])
def test_a_t5_engine_on_cuda_never_loads_in_float16(monkeypatch, tmp_path, capability, expected):
    """The engine's own start for a sentence-T5 model under dtype="auto": its runner is built in
    float32 on a GPU without bfloat16 units and in bfloat16 on an H100, the start-up line says which
    and why; dtype="float16" is a start-up ValueError naming the two that work."""
    from pooling_pipeline.backends import describe_backend

    cfg = msgspec.structs.replace(engine_config(build_sentence_t5(tmp_path), "cuda:0"), dtype="auto")
    with CudaOnHost(StandInCuda(monkeypatch, capability)):
        runner = family_of(cfg.model).runner(cfg)
        assert runner.dtype == expected and next(runner.model.parameters()).dtype == expected
        line = describe_backend({"dtype": str(expected).removeprefix("torch."), "device": "cuda:0", **runner.backend_info})
        assert f"dtype auto: {str(expected).removeprefix('torch.')} for a float32 checkpoint on cuda:0" in line, line
        assert "not float16: a 't5' model overflows in float16" in line, line
        with pytest.raises(ValueError, match="dtype='float16' cannot run a 't5' model"):
            family_of(cfg.model).runner(msgspec.structs.replace(cfg, dtype="float16"))
