"""ST's StaticEmbedding in the engine (model2vec / potion models, ST's static-retrieval models): each
text's vector is the mean of its tokens' rows of one table -- `F.embedding_bag(mode="mean")`, the
very call ST's `nn.EmbeddingBag` makes --, then the modules after it (Dense, LayerNorm, Normalize)
as for a transformer's pooled vector. No transformer runs: a step costs a gather and a mean, so the
render workers' tokenization is the whole cost of the pipeline."""

from __future__ import annotations

import time

import numpy as np
import torch

from pooling_pipeline.core.engine.columns import Requests, option_groups, probe_batch
from pooling_pipeline.core.engine.device_copies import finish_step, record_end, start_events, to_device, to_host, use_device
from pooling_pipeline.core.engine.pooling import SentenceHead
from pooling_pipeline.core.engine.step_cost import probe_step_cost
from pooling_pipeline.core.engine.step_runner import PendingStep
from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.model_folder.static_embedding import load_static_weights
from pooling_pipeline.core.shared.options import TASKS
from pooling_pipeline.core.shared.vectors import finish_grouped_sentence_embeddings


class StaticEmbeddingRunner:
    """A StepRunner (core/engine/step_runner.py) for a StaticEmbedding model, or one Router route of it."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = use_device(device)  # (current before any CUDA call: see device_copies.use_device)
        self.dtype = torch.float32
        self.weight = load_static_weights(spec.path).float().to(self.device)
        if self.weight.shape[0] != spec.vocab_size:
            raise ValueError(f"{spec.path}: the static embedding table has {self.weight.shape[0]} rows, the layout "
                             f"said {spec.vocab_size}: this is a bug")
        self.sentence_head = SentenceHead(spec.head_modules).to(self.device).eval() if spec.head_modules else None
        self.backend_info: dict = {"backend": "torch", "model": "static embedding (no transformer)"}

    def step_cost(self, max_tokens: int) -> tuple[float, float]:

        token = min(1000, self.spec.vocab_size - 1)
        return probe_step_cost(lambda rows, tokens: self.run(probe_batch(rows, tokens, token, "embed")),
                               max_tokens, self.spec.max_model_len)

    def run(self, batch: Requests) -> tuple[list | np.ndarray, int]:
        results, padded, _ = self.finish(self.launch(batch))
        return results, padded

    @torch.inference_mode()
    def launch(self, batch: Requests):
        started = time.perf_counter()
        tasks = {TASKS[int(code)] for code in np.unique(batch.task)}
        if tasks - {"embed"}:
            raise ValueError(f"a static embedding model gives sentence embeddings only, not {sorted(tasks - {'embed'})}")
        # Each row's bag: its tokens from pool_start on (an empty text is one placeholder token not
        # counted, see workers/render.mark_empty_rows): an empty bag gives zeros, as in ST.
        lengths = batch.lengths.astype(np.int64)
        skipped = np.minimum(batch.pool_start.astype(np.int64), lengths)
        position = np.arange(len(batch.token_ids)) - np.repeat(batch.starts, lengths)
        ids = batch.token_ids[position >= np.repeat(skipped, lengths)].astype(np.int64)
        counts = lengths - skipped
        offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        begin, end = start_events(self.device)  # (on CUDA: the step runs on while the engine goes on)
        pooled = torch.nn.functional.embedding_bag(to_device(ids, self.device), self.weight,
                                                   to_device(offsets, self.device), mode="mean")
        if self.sentence_head is not None:
            pooled = self.sentence_head(pooled)
        host = [to_host(pooled)]
        record_end(end, self.device)
        groups = option_groups(batch, batch.normalize)
        spec = self.spec

        def finish(arrays: list[np.ndarray]) -> list[np.ndarray] | np.ndarray:
            return finish_grouped_sentence_embeddings(arrays[0], groups, spec)

        return PendingStep(int(lengths.sum()), host, finish, started, begin, end)

    def finish(self, step) -> tuple[list, int, float]:
        return finish_step(step)
