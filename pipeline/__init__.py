"""Offline pooling inference (embeddings) with a multiprocess pipeline.

    from pooling_pipeline import Pipeline, PoolingParams
    with Pipeline() as pipe:
        outs = pipe.embed(["first text", "second text"])
"""

from pooling_pipeline.api import Pipeline
from pooling_pipeline.core.messages import PoolingParams
from pooling_pipeline.errors import EngineDeadError, PipelineError, StepError, WorkerStartError
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
           "StepError", "WorkerStartError", "load_results", "quantize_embeddings"]
__version__ = "0.1.0"
