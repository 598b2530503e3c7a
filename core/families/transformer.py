"""Text transformers: encoders, decoder embedders, cross-encoders and LLM rerankers, SPLADE,
ColBERT, and ST's Routers over them (a Router's static routes too). The engine runs them through
core/engine/model_runner.py, on torch or (on a CPU) compiled by OpenVINO (core/engine/openvino_model.py)."""

from __future__ import annotations

from typing import Any

from pooling_pipeline.core.families.base import ModelFamily
from pooling_pipeline.core.shared.devices import cuda_expected, openvino_cpu_has_bfloat16, openvino_installed

INSTALL_HINT = "pip install 'pooling-pipeline[openvino]'"


class TransformerFamily(ModelFamily):
    name = "transformer"

    def longest_input(self, spec) -> int:
        if spec.route_specs:  # a Router: its longest route's (a static one's is 0: any length, a step of its own)
            from pooling_pipeline.core.families import family_of

            return max((family_of(route).longest_input(route) for route in spec.route_specs), default=0)
        return spec.max_model_len

    def backend(self, backend: str, quantize: str | None, device: str, dtype: str) -> str:
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
        if not openvino_installed():
            raise ValueError(f"backend='openvino' needs the openvino package: {INSTALL_HINT}")
        if dtype == "bfloat16" and not openvino_cpu_has_bfloat16():
            raise ValueError("backend='openvino' with dtype='bfloat16' needs a CPU with bfloat16 units; this one has "
                             "none (use dtype='float32')")
        return "openvino"

    def engine_environment(self, backend: str, device: str, spec, environ: dict) -> dict[str, str]:
        """OpenVINO on the CPU (backend "openvino", or "auto" there where it is installed): torch's
        OpenMP threads sleep as soon as a parallel loop ends ({"OMP_WAIT_POLICY": "PASSIVE"}; a
        caller's own value is kept).

        Why: torch's OpenMP threads (libgomp) spin for a few milliseconds after each parallel loop
        by default, and after an OpenVINO forward the step's pooling is such a loop, so they spun on
        the cores OpenVINO's threads (TBB, pinned) needed for the next forward. On the 2-core AMD
        EPYC, MiniLM, medium texts in bfloat16: the forward alone 127 docs/s, with torch's pooling
        after it 115; with the threads sleeping, 126 (pooling alone: 0.15 ms a step). In the
        pipeline, paired, 6 rounds: medium texts 1.05x (bfloat16) and 1.04x (float32), short
        sentences 1.11x and 1.06x. Not for the torch backend, whose forward is OpenMP's own loops
        one after another: passive, 0.95x and 0.98x."""
        if backend == "torch" or device == "sim" or cuda_expected(device) or not openvino_installed():
            return {}
        if backend == "auto" and spec.trust_remote_code:  # "auto" keeps the torch module for a model's own code
            return {}
        return {"OMP_WAIT_POLICY": environ.get("OMP_WAIT_POLICY", "PASSIVE")}

    def runner(self, cfg, **device_steps: Any):
        """The model runner, with the output head sentence-transformers' module chain ends in (each
        route's own for a Router): pooling, multi-vector, SPLADE, a classifier or LLM scores."""
        from pooling_pipeline.core.engine.heads import head_for_st_chain
        from pooling_pipeline.core.engine.model_runner import ModelRunner

        return ModelRunner(cfg.model, cfg.device, cfg.dtype, backend=cfg.backend, threads=cfg.torch_threads,
                           quantize=cfg.quantize, output_head=head_for_st_chain, **device_steps)
