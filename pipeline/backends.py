"""Which backend runs the model's transformer, checked in the caller before any process starts
(the engine core decides "auto" itself: only it can convert the model and check the result), and
how the engine's choice is told back to the user."""

from __future__ import annotations

import importlib.util

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
    if backend != "openvino":
        return "torch" if device == "sim" or not full_precision else backend
    if device == "sim" or cuda_expected(device):
        raise ValueError(f"backend='openvino' runs on the CPU; device {device!r} is not the CPU (pass device='cpu')")
    if not full_precision:
        raise ValueError(f"backend='openvino' runs in float32; dtype {dtype!r} is not float32")
    if importlib.util.find_spec("openvino") is None:
        raise ValueError(f"backend='openvino' needs the openvino package: {INSTALL_HINT}")
    return "openvino"


def describe_backend(engine: dict) -> str:
    """One line on what runs the model, from the engine's start-up info (Pipeline.stats()["engine"])."""
    backend = engine.get("backend", "torch")
    if backend == "openvino":
        if engine.get("conversion") == "converted":
            how = f"converted in {engine.get('conversion_s', 0):.1f} s, cached in {engine.get('conversion_cache')}"
        else:
            how = f"conversion {engine.get('conversion', 'cached')}"
        return (f"backend openvino {engine.get('openvino_version', '').split('-')[0]} ({how}; compiled in "
                f"{engine.get('compile_s', 0):.1f} s; checked against torch: {engine.get('verified_max_diff', 0):.1e})")
    extra = []
    if engine.get("quantize"):
        extra.append(f"quantize {engine['quantize']}")
    if engine.get("openvino_refused"):
        extra.append(f"openvino refused: {engine['openvino_refused']}")
    return f"backend {backend}" + (f" ({'; '.join(extra)})" if extra else "")
