#!/usr/bin/env python
"""One CPU peer of the benchmark (sentence-transformers with its OpenVINO or ONNX backend), run by
bench_embed.py as a child of whatever interpreter has the peer's packages installed.

The peers' packages (optimum-intel, optimum-onnx) do not install next to this project's
sentence-transformers, so they live in a separate environment (README, "Benchmark") and this file
imports nothing of the project: only numpy, torch and sentence_transformers.

    python scripts/peer_embed.py PEER MODEL_DIR WORK_DIR --threads 2 --max-seq-length 256 --batch-size 32

PEER is `torch`, `openvino`, `onnx` or `onnx-int8`. Protocol: one JSON object per line. Once loaded
it writes `{"ready": true, "load_s": ..., "versions": {...}, "detail": ...}` (or `{"skipped": reason}`
and exits); then for each request line `{"texts": json_file, "out": npy_file, "repeats": n}` read on
stdin it times `encode` n times after a warm-up, saves the last run's vectors to `out` and writes
`{"seconds": [...]}` (or `{"error": ...}`). Everything the libraries print goes to stderr, so stdout
carries the protocol only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

PEERS = ("torch", "openvino", "openvino-f32", "onnx", "onnx-int8")


def quantization_config() -> str:
    """The dynamic int8 configuration sentence-transformers offers for this CPU (its names)."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return "arm64"
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        flags = []
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    return "avx512" if "avx512f" in flags else "avx2"


def openvino_precision(model) -> str:
    """The precision the peer's compiled OpenVINO model computes in (its CPU plugin's choice)."""
    ov_model = model[0].auto_model
    compiled = getattr(ov_model, "compiled_model", None) or getattr(ov_model, "request", None)
    try:
        hint = compiled.get_property("INFERENCE_PRECISION_HINT")  # an openvino Type: <Type: 'bfloat16'>
        return str(hint).removeprefix("<Type: '").removesuffix("'>")
    except Exception as e:  # an optimum version that keeps it elsewhere
        return f"unknown precision ({type(e).__name__})"


def load(peer: str, model_dir: str, work_dir: Path, threads: int):
    """Returns (model, detail). The models are exported from the safetensors on the fly, as
    sentence-transformers does for a model that ships no onnx/ or openvino/ folder."""
    from sentence_transformers import SentenceTransformer

    if peer == "torch":
        return SentenceTransformer(model_dir, device="cpu"), "torch float32"
    if peer in ("openvino", "openvino-f32"):
        # The same thread count as the torch references get (bench_embed.py pins them all alike).
        # "openvino" is what a user gets: OpenVINO's default precision, bfloat16 on a CPU with
        # bfloat16 units; "openvino-f32" asks for float32, like for like with the pipeline's default.
        config = {"INFERENCE_NUM_THREADS": str(threads)}
        if peer == "openvino-f32":
            config["INFERENCE_PRECISION_HINT"] = "f32"
        model = SentenceTransformer(model_dir, device="cpu", backend="openvino", model_kwargs={"ov_config": config})
        return model, f"OpenVINO IR exported on load, computing in {openvino_precision(model)}"
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    kwargs = {"provider": "CPUExecutionProvider", "session_options": options}
    if peer == "onnx":
        return SentenceTransformer(model_dir, device="cpu", backend="onnx", model_kwargs=kwargs), "ONNX exported on load, float32"
    shipped = sorted(Path(model_dir).glob("onnx/model_q*int8_*.onnx"))  # qint8, or quint8 for avx2
    if shipped:
        file_name = str(shipped[0].relative_to(model_dir))
        model = SentenceTransformer(model_dir, device="cpu", backend="onnx", model_kwargs={**kwargs, "file_name": file_name})
        return model, f"shipped {file_name}"
    # What sentence-transformers' docs tell a user to do: export to ONNX, then quantize it dynamically.
    from sentence_transformers import export_dynamic_quantized_onnx_model

    config = quantization_config()
    exported = work_dir / "onnx-export"
    fp32 = SentenceTransformer(model_dir, device="cpu", backend="onnx", model_kwargs=kwargs)
    fp32.save_pretrained(str(exported))
    export_dynamic_quantized_onnx_model(fp32, config, str(exported))
    # Named after the weights' type: model_qint8_avx512_vnni.onnx, model_quint8_avx2.onnx, ...
    file_name = str(next(exported.glob(f"onnx/model_q*int8_{config}.onnx")).relative_to(exported))
    model = SentenceTransformer(str(exported), device="cpu", backend="onnx", model_kwargs={**kwargs, "file_name": file_name})
    return model, f"export_dynamic_quantized_onnx_model(..., {config!r}) -> {file_name}"


def versions() -> dict:
    from importlib import metadata

    found = {"python": platform.python_version()}
    for dist in ("sentence-transformers", "transformers", "torch", "optimum", "optimum-intel", "optimum-onnx",
                 "openvino", "onnxruntime"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def serve(model, batch_size: int, reply) -> None:
    import numpy as np

    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            texts = json.loads(Path(request["texts"]).read_text())
            model.encode(texts[:64], batch_size=batch_size)
            seconds = []
            for _ in range(int(request["repeats"])):
                start = time.perf_counter()
                vectors = model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
                seconds.append(time.perf_counter() - start)
            np.save(request["out"], np.asarray(vectors, dtype=np.float32))
            reply({"seconds": seconds})
        except Exception as exc:  # reported to the parent, which prints it in the table
            traceback.print_exc()
            reply({"error": f"{type(exc).__name__}: {exc}"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peer", choices=PEERS)
    ap.add_argument("model_dir")
    ap.add_argument("work_dir")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--max-seq-length", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    args = ap.parse_args()

    # Keep the protocol on the real stdout; whatever the libraries print goes to stderr.
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")
        protocol.flush()

    try:
        import torch

        torch.set_num_threads(args.threads)
        start = time.perf_counter()
        model, detail = load(args.peer, args.model_dir, Path(args.work_dir), args.threads)
        model.max_seq_length = args.max_seq_length
        load_s = time.perf_counter() - start
    except Exception as exc:  # an uninstalled backend is a skipped row, not a failed benchmark
        traceback.print_exc()
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        reply({"skipped": f"{type(exc).__name__}: {first}", "versions": versions()})
        return
    reply({"ready": True, "load_s": load_s, "detail": detail, "versions": versions()})
    serve(model, args.batch_size, reply)


if __name__ == "__main__":
    main()
