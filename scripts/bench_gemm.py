#!/usr/bin/env python
"""The CPU's ceiling for the forward pass, by precision: how fast this machine multiplies matrices
of the model's own shapes in float32 and in bfloat16, and how close the engine's compiled forward
pass (OpenVINO float32 and bfloat16, the torch module in float32) comes to it.

    python scripts/bench_gemm.py                 # the bundled all-MiniLM-L6-v2, batches of 8 x 256 tokens
    python scripts/bench_gemm.py --rows 64 --width 32 --model DIR

Why it exists: on a CPU with bfloat16 units (AMX, AVX512-BF16) OpenVINO computes in bfloat16 unless
told otherwise, and sentence-transformers' OpenVINO backend ships that way. A float32 forward pass
(what this project runs by default, to stay within 1e-5 of sentence-transformers) is bound by the
float32 matrix multiply; this prints both precisions' multiply side by side, measured in one run
(interleaved repeats, medians), with the model's GFLOP/s against them. The multiply is timed in
torch and in OpenVINO (compiled as the engine compiles its model): their kernels differ by CPU
vendor (torch's float32 GEMM ran at 0.7x OpenVINO's on an AMD EPYC), and a compiled forward's
fused kernels can beat one plain multiply (OpenVINO's float32 forward ran at 1.3x its single GEMM
there, 0.93x on another 2-core machine), so read the ratio of the forward rows, bfloat16 to
float32, as the price of precision.
The model's floating-point operations per token: 2 x the weights of its Linear layers (embedding
lookups cost none), plus attention's two products, 4 x width x hidden size per layer.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

PRECISION_NAMES = {"f32": "float32", "bf16": "bfloat16"}


def median_seconds(fn, repeats: int, inner: int) -> float:
    fn()  # warm: first-call allocation, weight packing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def model_flops_per_token(torch, model, width: int) -> float:
    # The encoder's layers only: a BERT pooler's dense layer runs once per text, not per token, and
    # sentence-transformers' pooling never calls it.
    layers = getattr(model, "encoder", model)
    linear = sum(m.weight.numel() for m in layers.modules() if isinstance(m, torch.nn.Linear))
    config = model.config
    return 2.0 * linear + 4.0 * width * config.hidden_size * config.num_hidden_layers


def add_openvino_rows(kernels: dict, forwards: dict, torch, model, spec, a, w, feed: dict, threads: int) -> None:
    """The multiply and the model's forward pass compiled by OpenVINO as the engine compiles them,
    in float32 and, on a CPU with bfloat16 units, bfloat16."""
    import openvino as ov

    from pooling_pipeline.core.engine.openvino_model import BackendUnavailable, compile_for_cpu, to_openvino
    from pooling_pipeline.core.shared.devices import openvino_cpu_has_bfloat16

    class Linear(torch.nn.Module):  # the one GEMM, its weight a constant of the graph
        def __init__(self, weight):
            super().__init__()
            self.weight = torch.nn.Parameter(weight, requires_grad=False)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.weight)

    gemm = ov.convert_model(Linear(w), example_input=a)
    a_np = a.numpy()
    # (Without bfloat16 units OpenVINO would run a "bf16" multiply in float32, mislabelled.)
    for precision in ("f32", "bf16") if openvino_cpu_has_bfloat16() else ("f32",):
        request = compile_for_cpu(ov, gemm, threads, precision).create_infer_request()
        kernels[f"matmul {PRECISION_NAMES[precision]} (OpenVINO)"] = (
            lambda request=request: request.infer({0: a_np}, share_inputs=True, share_outputs=True))
    for precision in ("f32", "bf16"):
        try:
            compiled, _ = to_openvino(model, spec, output="last_hidden_state", base=False,
                                      token_types="token_type_ids" in feed, threads=threads, precision=precision)
        except BackendUnavailable as e:
            print(f"OpenVINO {precision}: {e}")
            continue
        forwards[f"model forward {PRECISION_NAMES[precision]} (OpenVINO)"] = lambda compiled=compiled: compiled(**feed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the bundled all-MiniLM-L6-v2)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="default: the engine's CPU plan")
    args = parser.parse_args(argv)
    if min(args.rows, args.width, args.repeats) < 1:
        parser.error("--rows, --width and --repeats must be positive")

    import numpy as np
    import torch
    from transformers import AutoModel

    from pooling_pipeline.core.shared.model_folder.load import load_model_spec
    from pooling_pipeline.core.shared.model_folder.model_path import default_model_path
    from pooling_pipeline.cpu_plan import plan_cpu

    path = args.model or default_model_path()
    threads = args.threads or plan_cpu(None, "cpu").engine_threads
    torch.set_num_threads(threads)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    config = model.config
    tokens = args.rows * args.width
    hidden, inner_size = config.hidden_size, config.intermediate_size

    rows: list[tuple[str, float]] = []  # (what, GFLOP/s)
    a = torch.randn(tokens, hidden)
    w = torch.randn(inner_size, hidden)
    gemm_flops = 2.0 * tokens * hidden * inner_size
    a16, w16 = a.bfloat16(), w.bfloat16()
    # Into preallocated outputs (torch.mm's out=, OpenVINO's shared output buffer): the ceiling is
    # the multiply, not a 12 MB allocation per call.
    out, out16 = torch.empty(tokens, inner_size), torch.empty(tokens, inner_size, dtype=torch.bfloat16)
    wt, wt16 = w.t(), w16.t()
    kernels = {"matmul float32 (torch)": lambda: torch.mm(a, wt, out=out),
               "matmul bfloat16 (torch)": lambda: torch.mm(a16, wt16, out=out16)}

    per_token = model_flops_per_token(torch, model, args.width)
    ids = np.full((args.rows, args.width), min(1000, config.vocab_size - 1), dtype=np.int64)
    feed = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.ones_like(torch.from_numpy(ids))}
    if getattr(config, "type_vocab_size", 0):
        feed["token_type_ids"] = torch.zeros_like(feed["input_ids"])

    def torch_forward():
        with torch.inference_mode():
            model(**feed)

    forwards = {"model forward float32 (torch eager)": torch_forward}
    if importlib.util.find_spec("openvino") is None:
        print("OpenVINO rows skipped: pip install -e '.[openvino]'")
    else:
        add_openvino_rows(kernels, forwards, torch, model, load_model_spec(path), a, w, feed, threads)

    inner = max(1, int(2e9 // gemm_flops))  # about 2 GFLOP per timing
    seconds: dict[str, list[float]] = {name: [] for name in [*kernels, *forwards]}
    for _ in range(args.repeats):  # interleaved: the machine's noise hits every row alike
        for name, fn in kernels.items():
            seconds[name].append(median_seconds(fn, 1, inner))
        for name, fn in forwards.items():
            seconds[name].append(median_seconds(fn, 1, 1))
    for name in kernels:
        rows.append((name, gemm_flops / statistics.median(seconds[name]) / 1e9))
    for name in forwards:
        rows.append((name, per_token * tokens / statistics.median(seconds[name]) / 1e9))

    f32_peak = max(rate for name, rate in rows if name.startswith("matmul float32"))
    print(f"\nmodel {path}: {per_token / 1e6:.1f} MFLOP per token at width {args.width}; "
          f"batch {args.rows} x {args.width}; GEMM {tokens} x {hidden} x {inner_size}; {threads} threads; "
          f"median of {args.repeats}")
    print("| what | GFLOP/s | / fastest float32 matmul |")
    print("|---|---|---|")
    for name, rate in rows:
        print(f"| {name} | {rate:.0f} | {rate / f32_peak:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
