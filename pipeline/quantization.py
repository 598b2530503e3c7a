"""Embedding precisions as sentence-transformers names and computes them (`quantize_embeddings`):
float32, int8 and uint8 (per-dimension ranges, 256 buckets), binary and ubinary (sign bits packed
8 to a byte). numpy only."""

from __future__ import annotations

import typing
from typing import Literal

import numpy as np

Precision = Literal["float32", "int8", "uint8", "binary", "ubinary"]
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)


def quantization_ranges(calibration: np.ndarray) -> np.ndarray:
    """[2, dim]: each dimension's minimum and maximum over the calibration embeddings."""
    if calibration.ndim != 2 or calibration.shape[0] < 2:
        raise ValueError("int8 / uint8 ranges need at least two calibration embeddings (give `ranges` or "
                         "`calibration_embeddings` for fewer)")
    return np.vstack((calibration.min(axis=0), calibration.max(axis=0)))


def quantize_embeddings(embeddings: np.ndarray, precision: Precision, ranges: np.ndarray | None = None,
                        calibration_embeddings: np.ndarray | None = None) -> np.ndarray:
    """The same values as sentence-transformers' `quantize_embeddings` for a [n, dim] float array.
    int8 / uint8 ranges come from `ranges`, else `calibration_embeddings`, else the embeddings."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    embeddings = np.asarray(embeddings)
    if precision == "float32":
        return embeddings.astype(np.float32)
    if precision.endswith("int8"):
        if ranges is None:
            ranges = quantization_ranges(embeddings if calibration_embeddings is None
                                         else np.asarray(calibration_embeddings))
        ranges = np.asarray(ranges, dtype=np.float32)
        starts = ranges[0]
        steps = (ranges[1] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        buckets = np.clip(np.floor((embeddings - starts) / steps), 0, 255)
        return buckets.astype(np.uint8) if precision == "uint8" else (buckets - 128).astype(np.int8)
    packed = np.packbits(embeddings > 0, axis=-1)
    return packed if precision == "ubinary" else (packed - 128).astype(np.int8)
