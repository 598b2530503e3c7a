"""Which backend runs the model's transformer, checked in the caller before any process starts
(the engine core decides "auto" itself: only it can convert the model and check the result), and
how the engine's choice is told back to the user."""

from __future__ import annotations

import importlib.util
import os

from pooling_pipeline.cpu_plan import cuda_expected

INSTALL_HINT = "pip install 'pooling-pipeline[openvino]'"


def engine_backend(backend: str, quantize: str | None, device: str, dtype: str) -> str:
    """The backend the engine cores are asked for. A combination that cannot be honoured is a
    ValueError here, never a silent change in the engine."""
    full_precision = dtype in ("auto", "float32")
    if quantize is not None:
        if backend == "openvino":
            raise ValueError("quantize='int8' runs on the torch backend; use backend='torch' or 'auto'")
        if device == "sim" or cuda_expected(device):
            raise ValueError(f"quantize='int8' is dynamic quantization for a CPU; device {device!r} is not one "
                             "(pass device='cpu')")
        if not full_precision:
            raise ValueError(f"quantize='int8' quantizes a float32 model; dtype {dtype!r} is not float32")
        return "torch"
    # OpenVINO compiles for float32 or, asked for, bfloat16 (on a CPU with bfloat16 units).
    openvino_dtype = full_precision or dtype == "bfloat16"
    if backend != "openvino":
        return "torch" if device == "sim" or not openvino_dtype else backend
    if device == "sim" or cuda_expected(device):
        raise ValueError(f"backend='openvino' runs on the CPU; device {device!r} is not the CPU (pass device='cpu')")
    if not openvino_dtype:
        raise ValueError(f"backend='openvino' runs in float32 or bfloat16; dtype {dtype!r} is neither")
    if importlib.util.find_spec("openvino") is None:
        raise ValueError(f"backend='openvino' needs the openvino package: {INSTALL_HINT}")
    if dtype == "bfloat16" and not openvino_cpu_has_bfloat16():
        raise ValueError("backend='openvino' with dtype='bfloat16' needs a CPU with bfloat16 units; this one has "
                         "none (use dtype='float32')")
    return "openvino"


def static_backend(backend: str, quantize: str | None, dtype: str) -> str:
    """A StaticEmbedding model has no transformer to convert or quantize: torch runs its float32
    table (ST's own arithmetic); asking for anything else is refused, not ignored."""
    if backend == "openvino" or quantize is not None or dtype not in ("auto", "float32"):
        raise ValueError("a static embedding model (StaticEmbedding, no transformer) runs its float32 table on torch: "
                         f"not backend={backend!r}, quantize={quantize!r}, dtype={dtype!r} (leave them at their "
                         "defaults)")
    return "torch"


def dual_encoder_backend(backend: str, quantize: str | None, device: str, dtype: str) -> str:
    """A dual encoder (CLIP, SigLIP): its text tower runs on torch; its image tower on OpenVINO
    under backend="openvino" (a CPU, float32) and under "auto" on a CPU in float32 where OpenVINO is
    installed and its compiled tower gives torch's vectors (checked at every start; else torch);
    on torch otherwise, in the dtype asked. int8 quantization covers text transformers only:
    refused, not ignored."""
    if quantize is not None:
        raise ValueError(f"quantize={quantize!r} is not supported for a dual encoder (CLIP, SigLIP)")
    full_precision = dtype in ("auto", "float32")
    if backend != "openvino":
        return "torch" if device == "sim" or not full_precision or cuda_expected(device) else backend
    if device not in ("cpu", "auto") or cuda_expected(device) or not full_precision:
        raise ValueError("backend='openvino' runs a dual encoder's image tower on the CPU in float32: pass "
                         f"device='cpu' and dtype float32 or auto (got device={device!r}, dtype={dtype!r})")
    if importlib.util.find_spec("openvino") is None:
        raise ValueError(f"backend='openvino' needs the openvino package: {INSTALL_HINT}")
    return "openvino"


def engine_openmp_env(backend: str, device: str, spec, environ=None) -> dict[str, str]:
    """The OpenMP setting of an engine core whose text transformer OpenVINO is to run on the CPU
    (backend "openvino", or "auto" there where openvino is installed): torch's threads sleep as soon
    as a parallel loop ends ({"OMP_WAIT_POLICY": "PASSIVE"}); {} elsewhere. A caller's own
    OMP_WAIT_POLICY is kept.

    Why: torch's OpenMP threads (libgomp) spin for a few milliseconds after each parallel loop by
    default, and after an OpenVINO forward the step's pooling is such a loop, so they spun on the
    cores OpenVINO's threads (TBB, pinned) needed for the next forward. On the 2-core AMD EPYC, MiniLM,
    medium texts in bfloat16: the forward alone 127 docs/s, with torch's pooling after it 115; with
    the threads sleeping, 126 (pooling alone: 0.15 ms a step). In the pipeline, paired, 6 rounds:
    medium texts 1.05x (bfloat16) and 1.04x (float32), short sentences 1.11x and 1.06x. Not for the
    torch backend, whose forward is OpenMP's own loops one after another: passive, 0.95x and 0.98x."""
    environ = os.environ if environ is None else environ
    if (backend == "torch" or spec.input_module in ("dual_encoder", "static_embedding") or device == "sim"
            or cuda_expected(device) or importlib.util.find_spec("openvino") is None):
        return {}
    if backend == "auto" and spec.trust_remote_code:  # "auto" keeps the torch module for a model's own code
        return {}
    return {"OMP_WAIT_POLICY": environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def openvino_cpu_has_bfloat16() -> bool:
    """Whether OpenVINO's CPU plugin computes in bfloat16 here (else it would silently run float32)."""
    import openvino

    return "BF16" in openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


def describe_checkpoint_precision(engine: dict) -> str | None:
    """The start-up notice for a model stored in half precision and run in float32 on a CPU (the
    engine's `checkpoint_dtype` facts), or None."""
    stored = engine.get("checkpoint_dtype")
    if stored is None or engine.get("dtype") != "float32":
        return None
    measured = engine.get("checkpoint_dtype_max_diff")
    distance = (f"measured on a probe batch: max |diff| {measured:.1e} between the two" if measured is not None
                else "not measured for this model")
    return (f"the model's weights are stored in {stored}: this runs them in float32 (dtype='auto' on a CPU; "
            f"more exact), where sentence-transformers computes in {stored} on a CPU ({distance}); pass "
            f"dtype='{stored}' for {stored} arithmetic like ST's")


def describe_backend(engine: dict) -> str:
    """One line on what runs the model, from the engine's start-up info (Pipeline.stats()["engine"])."""
    backend = engine.get("backend", "torch")
    if backend == "openvino":
        if engine.get("conversion") == "converted":
            how = f"converted in {engine.get('conversion_s', 0):.1f} s, cached in {engine.get('conversion_cache')}"
        else:
            how = f"conversion {engine.get('conversion', 'cached')}"
        checked = f"checked against torch: {engine.get('verified_max_diff', 0):.1e}"
        if engine.get("precision") == "bf16":
            checked += f", in bfloat16 {engine.get('verified_bf16_max_diff', 0):.1e}"
        towers = " image tower (text tower on torch)" if engine.get("image_tower") == "openvino" else ""
        return (f"backend openvino{towers} {engine.get('openvino_version', '').split('-')[0]} "
                f"{'bfloat16' if engine.get('precision') == 'bf16' else 'float32'} ({how}; compiled in "
                f"{engine.get('compile_s', 0):.1f} s; {checked})")
    extra = []
    if engine.get("quantize"):
        extra.append(f"quantize {engine['quantize']}")
    if engine.get("openvino_refused"):
        extra.append(f"openvino refused: {engine['openvino_refused']}")
    where = f" {engine['dtype']} on {engine['device']}" if engine.get("dtype") and engine.get("device") else ""
    return f"backend {backend}{where}" + (f" ({'; '.join(extra)})" if extra else "")


def cpu_has_bfloat16_units() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), read from /proc/cpuinfo
    (no library import in the caller)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def describe_faster_precision(engine: dict) -> str | None:
    """A notice for a CPU with bfloat16 units running float32 (the default, held to
    sentence-transformers within 1e-5): what the opt-in bfloat16 would give and cost, or None."""
    if engine.get("device") != "cpu" or engine.get("dtype") != "float32" or engine.get("backend") == "sim" \
            or "static" in str(engine.get("model", "")) or not cpu_has_bfloat16_units():
        return None
    return ("this CPU has bfloat16 units: dtype='bfloat16' runs the transformer about 1.8x faster here (opt-in; "
            "it moves vectors by about 1 - cos 5e-5, measured on all-MiniLM-L6-v2: see docs/backends.md); the "
            "default stays float32, sentence-transformers' result within 1e-5")
