"""Offline pooling inference (embeddings) with a multiprocess pipeline.

    from pooling_pipeline import Pipeline, PoolingParams
    with Pipeline() as pipe:
        outs = pipe.embed(["first text", "second text"])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# The public names, imported on first use (PEP 562): a render worker runs
# `python -m pooling_pipeline.workers.main`, which imports this package first, and must not pay for
# the caller's API (the frontend, input adapters, model layout: ~10 MB of RSS in each worker).
_EXPORTS = {
    "Pipeline": "pooling_pipeline.api",
    "PoolingParams": "pooling_pipeline.core.shared.messages",
    "EngineDeadError": "pooling_pipeline.errors",
    "EngineRestartedError": "pooling_pipeline.errors",
    "PipelineError": "pooling_pipeline.errors",
    "StepError": "pooling_pipeline.errors",
    "WorkerStartError": "pooling_pipeline.errors",
    "SentenceEncoder": "pooling_pipeline.integrations.sentence_encoder",
    "load_results": "pooling_pipeline.jobs.results_store",
    "ClassificationOutput": "pooling_pipeline.outputs",
    "EmbeddingOutput": "pooling_pipeline.outputs",
    "PoolingRequestOutput": "pooling_pipeline.outputs",
    "RankedDocument": "pooling_pipeline.outputs",
    "ScoringOutput": "pooling_pipeline.outputs",
    "SparseEmbeddingOutput": "pooling_pipeline.outputs",
    "quantize_embeddings": "pooling_pipeline.quantization",
}

if TYPE_CHECKING:  # what static analysers and IDEs see
    from pooling_pipeline.api import Pipeline
    from pooling_pipeline.core.shared.messages import PoolingParams
    from pooling_pipeline.errors import EngineDeadError, EngineRestartedError, PipelineError, StepError, WorkerStartError
    from pooling_pipeline.integrations.sentence_encoder import SentenceEncoder
    from pooling_pipeline.jobs.results_store import load_results
    from pooling_pipeline.outputs import (
        ClassificationOutput,
        EmbeddingOutput,
        PoolingRequestOutput,
        RankedDocument,
        ScoringOutput,
        SparseEmbeddingOutput,
    )
    from pooling_pipeline.quantization import quantize_embeddings

__all__ = ["Pipeline", "PoolingParams", "SentenceEncoder", "EmbeddingOutput", "ClassificationOutput", "ScoringOutput",
           "SparseEmbeddingOutput", "RankedDocument", "PoolingRequestOutput", "PipelineError", "EngineDeadError",
           "EngineRestartedError", "StepError", "WorkerStartError", "load_results", "quantize_embeddings"]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pooling_pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
