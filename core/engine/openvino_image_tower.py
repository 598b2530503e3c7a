"""A dual encoder's image tower (`get_image_features`) compiled by OpenVINO for the CPU, float32:
what runs a CLIP / SigLIP image tower under backend="openvino", and under "auto" on a CPU where
OpenVINO is installed (1.2-1.3x the torch forward of a ViT-B/32 on this project's 2-core CPU, batches
of 8-64, max |diff| ~5e-6; a CLIP tower converts without the last layer's unread positions,
core/engine/image_features.py, another 7%). Converted from the loaded torch module with a dynamic batch and
cached on disk like the text transformers' conversions (core/engine/openvino_model.py: keyed by the model's files
and the library versions, checksummed, a damaged entry removed and rebuilt); every start -- from the
cache too -- checks the compiled tower against torch on a probe batch of real pixel values (the torch
module is loaded anyway: the text tower runs on it), and a difference above the project's float32
tolerance (1e-5, relative above 1) is refused, naming it, rather than serve different vectors."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from pooling_pipeline.core.engine.image_features import FromPixels, ImageFeatures, image_features_module
from pooling_pipeline.core.engine.openvino_model import (
    NOT_CACHED,
    BackendUnavailable,
    cache_key,
    cached_conversion,
    compile_for_cpu,
    default_cache_root,
)
from pooling_pipeline.core.shared.config import ImageSpec

TOLERANCE = 1e-5
PROBE_IMAGES = 4


def compile_image_tower(model, spec, threads: int, normalization: tuple) -> tuple[object, dict]:
    """(the compiled image tower: called with [n, C, H, W] uint8 pixels, its [0] the vectors; the
    start-up facts: conversion cached or converted, times, the max difference to torch on the
    probe). The graph starts with the processor's rescale and normalize, `normalization` = (scale,
    mean, std) tensors. Raises BackendUnavailable when OpenVINO cannot convert the tower or the
    result differs from torch."""
    import openvino as ov

    image: ImageSpec = spec.image
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (PROBE_IMAGES, image.channels, image.height, image.width), dtype=np.uint8)
    tower, graph = image_features_module(model)
    converted_module = FromPixels(tower, *normalization).eval()
    with torch.inference_mode():  # the reference: the whole tower, as sentence-transformers runs it
        expected = ImageFeatures(model).eval()(converted_module.values(torch.from_numpy(pixels))).float().numpy()
    shape = [image.channels, image.height, image.width]
    constants = [t.flatten().tolist() for t in normalization]
    key = cache_key(spec, ov.__version__, output="image_features", input=["uint8", *shape], graph=graph,
                    normalization=constants)
    folder = os.path.join(default_cache_root(), "openvino", key)
    warnings: list[str] = []
    started = time.perf_counter()

    def convert():
        try:
            return ov.convert_model(converted_module, example_input=(torch.from_numpy(pixels),),
                                    input=[(ov.PartialShape([-1, *shape]), ov.Type.u8)])
        except Exception as e:  # a tower the converter cannot trace
            raise BackendUnavailable(f"OpenVINO could not convert the image tower: {type(e).__name__}: {e}") from e

    converted, cached, saved = cached_conversion(ov, folder, key, convert, warnings)
    info: dict = {"conversion": "cached" if cached else "converted", "conversion_cache": folder if saved else NOT_CACHED,
                  "image_graph": graph}
    info["conversion_s"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    compiled = StreamedTower(ov, converted, threads)
    info["compile_s"] = round(time.perf_counter() - started, 3)
    got = compiled(pixels)[0]
    max_diff = float(np.abs(got - expected).max()) if got.shape == expected.shape else float("inf")
    bound = TOLERANCE * max(1.0, float(np.abs(expected).max()))
    if not max_diff <= bound:
        raise BackendUnavailable(f"the image tower compiled by OpenVINO differs from torch by {max_diff:.2e} on a "
                                 f"probe batch (more than {bound:.1e})")
    info.update(verified_max_diff=max_diff, openvino_version=ov.__version__, precision="f32",
                image_streams=compiled.streams)
    if warnings:
        info["warnings"] = "; ".join(warnings)
    return compiled, info


class StreamedTower:
    """The compiled tower, a step's images split between STREAMS independent inference streams
    that run at once, each on its share of the engine's threads.

    Why not one stream on every thread, as the text transformers run: the render workers share the
    cores with the engine, and a step of one stream is a series of parallel loops whose threads
    wait for each other at every layer, so a worker that takes a core for its ~3 ms of decoding
    stalls the other threads too. Two streams do not wait for each other: one goes on while the
    other is preempted. On this project's 2-core CPU that measured 1.02-1.07x the images/s of one
    stream on two threads with the render worker beside it (three alternating pairs of runs), and
    the same alone (a ViT-B/32 costs the same per image at batch 16-48, so half a step's batch
    loses nothing). The price is a lone image's latency: a step of one image runs on one stream,
    on its share of the threads."""

    STREAMS = 2

    def __init__(self, ov, converted, threads: int) -> None:
        self.streams = self.STREAMS if threads >= self.STREAMS else 1
        self.compiled = compile_for_cpu(ov, converted, threads, "f32", streams=self.streams)
        self.requests = [self.compiled.create_infer_request() for _ in range(self.streams)]

    def __call__(self, pixels: np.ndarray) -> list[np.ndarray]:
        """[the vectors of `pixels`' images, in order], as the compiled model's call gives them."""
        parts = np.array_split(pixels, min(self.streams, len(pixels)))
        busy = self.requests[:len(parts)]
        for request, part in zip(busy, parts):
            request.start_async({0: np.ascontiguousarray(part)})
        for request in busy:
            request.wait()
        return [np.concatenate([request.get_output_tensor(0).data for request in busy])]  # (a copy)
