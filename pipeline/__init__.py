"""Offline pooling inference (embeddings) with a multiprocess pipeline.

    from pipeline import Pipeline, PoolingParams
    with Pipeline() as pipe:
        outs = pipe.embed(["first text", "second text"])
"""

from core.messages import PoolingParams
from pipeline.api import Pipeline
from pipeline.results_store import load_results
from pipeline.errors import EngineDeadError, PipelineError, StepError, WorkerStartError
from pipeline.outputs import ClassificationOutput, EmbeddingOutput, PoolingRequestOutput, ScoringOutput

__all__ = ["Pipeline", "PoolingParams", "EmbeddingOutput", "ClassificationOutput", "ScoringOutput",
           "PoolingRequestOutput", "PipelineError", "EngineDeadError", "StepError",
           "WorkerStartError", "load_results"]
__version__ = "0.1.0"
