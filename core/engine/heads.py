"""Output heads: what turns a step's forward output into each request's result, one object each.

A runner runs the transformer and hands its head a `StepRows` (the output it reads, the attention
mask, the rows' lengths, their ids and the batch); the head queues its device work and returns
(the tensors to copy back, the finish that makes each request's result on the host). A family
composes its runner with the head its models need (`ModelRunner(..., output_head=...)`): the
runner never asks which kind of model it runs.

- `PooledHead`: ST's Pooling modes (mean, CLS, last token, max, ...) and the Dense / LayerNorm /
  Normalize modules after it; per-token vectors for `token_embed`.
- `TokenVectorsHead`: a multi-vector (ColBERT) model's token vectors, as ST's MultiVectorEncoder.
- `SparseHead`: SPLADE's sparse vectors from MLM logits.
- `ClassifierHead`: a sequence- or token-classification head's logits, with the task's activation.
- `LogitScoreHead`: an LLM reranker's yes / no logits at the last token (its own forward).

`head_for_st_chain(spec)` is the head sentence-transformers' module chain asks for (the
transformer family's composition).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pooling_pipeline.core.engine.columns import Requests, option_groups
from pooling_pipeline.core.engine.device_copies import to_device
from pooling_pipeline.core.engine.pooling import SentenceHead, apply_activation, pool, splade
from pooling_pipeline.core.engine.sparse_outputs import sparse_outputs
from pooling_pipeline.core.shared.config import ModelSpec
from pooling_pipeline.core.shared.options import TASKS
from pooling_pipeline.core.shared.vectors import finish_embeddings, finish_sentence_embeddings

# (the tensors a step copies back, the host-side finish of their copies: one result per request)
HeadOutputs = tuple[list[torch.Tensor], Callable[[list[np.ndarray]], list | np.ndarray]]


class StepRows:
    """What a head reads of one step: the transformer's `output` it asked for (rows [n, ...]), the
    attention `mask` [n, L] and `lengths` [n] on the device, the lengths on the host, the padded
    `ids` and `real` tokens ([n, L'] on the host; None in a packed step) and the batch. `bucketed`:
    the step runs as on an accelerator (nothing may be read back before its end)."""

    __slots__ = ("output", "mask", "lengths", "lengths_np", "ids", "real", "batch", "bucketed")

    def __init__(self, output: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, lengths_np: np.ndarray,
                 batch: Requests, *, ids: np.ndarray | None = None, real: np.ndarray | None = None,
                 bucketed: bool = False) -> None:
        self.output, self.mask, self.lengths, self.lengths_np = output, mask, lengths, lengths_np
        self.batch, self.ids, self.real, self.bucketed = batch, ids, real, bucketed


class OutputHead:
    """What every head answers. `reads`: the transformer output it takes ("last_hidden_state", or a
    task head's "logits"); `base_model`: it reads the base model's hidden states of a model loaded
    with a task head (OpenVINO converts the base model then); `packed_refusal`: why it cannot read
    a packed step's rows (None: it can); `own_forward`: why the forward is the head's own (`forward`;
    no CUDA graph or 4-D mask for it), or None where the runner runs the model."""

    reads = "last_hidden_state"
    base_model = False
    packed_refusal: str | None = "its head reads the padded [rows, length] output (classification, SPLADE logits, LLM scores)"
    own_forward: str | None = None

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec

    @classmethod
    def for_runner(cls, spec: ModelSpec, runner) -> OutputHead:
        """The head of `runner` (a ModelRunner whose model is loaded), for `spec` (its route's)."""
        return cls(spec, runner.device)

    def attention_mask(self, mask: torch.Tensor, batch: Requests, lengths: np.ndarray) -> torch.Tensor:
        """The encoder's attention mask for these rows (`lengths`: the step's, a bucket's added rows
        after the batch's): the real tokens, as given."""
        return mask

    def forward(self, model, kwargs: dict, lengths: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{type(self).__name__} runs no forward of its own: this is a bug")

    def outputs(self, rows: StepRows) -> HeadOutputs:
        raise NotImplementedError


class PooledHead(OutputHead):
    """One vector per request as ST's Pooling (its modes; the prompt's tokens left out where the
    model says so) and the modules after it; `token_embed` requests get their tokens' vectors."""

    packed_refusal = None

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        # Dense / LayerNorm modules after pooling run in float32, as the pooled vector is.
        self.sentence_head = SentenceHead(spec.head_modules).to(device).eval() if spec.head_modules else None

    def outputs(self, rows: StepRows) -> HeadOutputs:
        batch, hidden, lengths_np = rows.batch, rows.output, rows.lengths_np
        # Requests that share options are finished together (usually the whole batch: one group).
        groups = option_groups(batch, batch.normalize)
        tensors = []
        for (task, _, _), members in groups:
            index = to_device(members, hidden.device) if len(members) < len(batch) else None
            part = hidden if index is None else hidden.index_select(0, index)
            if task == "token_embed":
                tensors.append(part.float())
                continue
            part_mask = self._pooling_mask(rows.mask, batch, members if index is not None else None)
            part_lengths = rows.lengths if index is None else rows.lengths.index_select(0, index)
            pooled = pool(part, part_mask, part_lengths, self.spec.pooling.modes)
            if self.sentence_head is not None:
                pooled = self.sentence_head(pooled)
            tensors.append(pooled)
        spec = self.spec

        def finish(arrays: list[np.ndarray]) -> list[np.ndarray] | np.ndarray:
            out: list = [None] * len(batch)
            for ((task, dimensions, normalize), members), values in zip(groups, arrays):
                if task == "token_embed":
                    vectors = finish_embeddings(values, dimensions, spec.normalize if normalize is None else normalize)
                    for i, row in enumerate(members.tolist()):
                        out[row] = vectors[i, : int(lengths_np[row])]
                    continue
                vectors = finish_sentence_embeddings(values, dimensions, normalize, spec.normalize, spec.truncate_dim)
                if len(members) == len(batch):  # one group: the matrix as it is
                    return vectors
                for i, row in enumerate(members.tolist()):
                    out[row] = vectors[i]
            return out

        return tensors, finish

    def _pooling_mask(self, mask: torch.Tensor, batch: Requests, rows: np.ndarray | None = None) -> torch.Tensor:
        """The tokens each request pools: its real tokens, less its prompt's when the model's
        Pooling has include_prompt=false (as ST, which zeroes the first prompt_length positions)."""
        pool_start = batch.pool_start if rows is None else batch.pool_start[rows]
        if rows is not None:
            mask = mask.index_select(0, to_device(rows, mask.device))
        if self.spec.pooling.include_prompt or not pool_start.any():
            return mask
        starts = to_device(np.ascontiguousarray(pool_start), mask.device)
        positions = torch.arange(mask.shape[1], device=mask.device)[None, :]
        return mask * (positions >= starts[:, None]).to(mask.dtype)


class TokenVectorsHead(OutputHead):
    """A multi-vector model's token vectors, as ST's MultiVectorEncoder: every token through the
    token-level Dense (Normalize) modules; each request gets the vectors of the tokens ST's
    MultiVectorMask keeps (`kept_tokens`), normalized as asked."""

    packed_refusal = "a multi-vector model's query expansion masks tokens inside a row"

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.spec = spec
        self.token_head, self.skip_ids = multi_vector_parts(spec, device)

    def attention_mask(self, mask: torch.Tensor, batch: Requests, lengths: np.ndarray) -> torch.Tensor:
        """A query's expansion tokens are left out of the encoder's attention (attend=False)."""
        starts = batch.expansion_start
        if not (starts >= 0).any():
            return mask
        ends = lengths.copy()
        ends[:len(batch)] = np.where(starts >= 0, starts, batch.lengths)
        ends_t = to_device(np.ascontiguousarray(ends), mask.device)
        return (torch.arange(mask.shape[1], device=mask.device)[None, :] < ends_t[:, None]).long()

    def outputs(self, rows: StepRows) -> HeadOutputs:
        batch, real = rows.batch, rows.real
        vectors = rows.output[:, :real.shape[1]].float()
        if self.token_head is not None:
            vectors = self.token_head(vectors)
        keep = kept_tokens(self.spec, self.skip_ids, rows.ids[:, :real.shape[1]], real, batch)
        normalize = np.where(batch.normalize < 0, int(self.spec.normalize), batch.normalize)
        # (the batch's own columns: RequestTable.take gathered them into a new array, which nothing
        # writes before finish reads it -- no copy needed)
        dimensions = batch.dimensions

        def finish(arrays: list[np.ndarray]) -> list[np.ndarray]:
            return kept_token_vectors(arrays[0], keep, dimensions, normalize)

        return [vectors], finish


class SparseHead(OutputHead):
    """SPLADE: log(1 + relu(MLM logits)) pooled over each request's tokens, as (token ids, weights)."""

    reads = "logits"

    def outputs(self, rows: StepRows) -> HeadOutputs:
        return sparse_outputs(splade(rows.output, rows.mask, self.spec.sparse), self.spec.max_active_dims,
                              on_device=rows.bucketed)


class ClassifierHead(OutputHead):
    """A classification head's logits; each request gets its task's activation (ST's CrossEncoder
    activation for `score`), or the raw logits with use_activation=False; per token for a
    token-classification head."""

    reads = "logits"

    def outputs(self, rows: StepRows) -> HeadOutputs:
        return activated_logits(rows.output, rows.lengths_np, rows.batch, self.spec,
                                per_token=self.spec.head == "token_classification")


class LogitScoreHead(OutputHead):
    """ST's LogitScore (an LLM reranker) without [batch, seq, vocab] logits: the base model's
    hidden state at each row's last real token (rows are right-padded; ST left-pads, the same
    token) times the lm_head rows of the true / false tokens, in the model's dtype as lm_head
    computes them; scored logit(true) - logit(false), with the score task's activation."""

    base_model = True
    own_forward = "an LLM reranker's scores"

    def __init__(self, spec: ModelSpec, device: torch.device, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.spec = spec
        self.rows = logit_score_rows(spec, model, device, dtype)

    @classmethod
    def for_runner(cls, spec: ModelSpec, runner) -> OutputHead:
        return cls(spec, runner.device, runner.model, runner.dtype)

    def forward(self, model, kwargs: dict, lengths: torch.Tensor) -> torch.Tensor:
        """-> [B, 1] float32 scores."""
        hidden = model.base_model(**kwargs).last_hidden_state
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
        logits = torch.nn.functional.linear(last, *self.rows)
        scores = logits[:, 0] if logits.shape[1] == 1 else logits[:, 0] - logits[:, 1]
        return scores.float().unsqueeze(1)

    def outputs(self, rows: StepRows) -> HeadOutputs:
        return activated_logits(rows.output, rows.lengths_np, rows.batch, self.spec, per_token=False)


def head_for_st_chain(spec: ModelSpec) -> type[OutputHead]:
    """The head a sentence-transformers module chain ends in: LogitScore, SpladePooling, a
    MultiVectorEncoder, a classification head, else Pooling (and what follows it)."""
    if spec.logit_score is not None:
        return LogitScoreHead
    if spec.sparse is not None:
        return SparseHead
    if spec.multi_vector is not None:
        return TokenVectorsHead
    return PooledHead if spec.head == "none" else ClassifierHead


def activated_logits(logits: torch.Tensor, lengths: np.ndarray, batch: Requests, spec: ModelSpec, *,
                     per_token: bool) -> HeadOutputs:
    """Logits [n, labels] (or [n, L, labels]) and each task's activation of them, copied back; the
    finish picks each row's by its task and use_activation."""
    logits = logits.float()
    codes = np.unique(batch.task).tolist()
    tensors = [logits] + [apply_activation(logits, spec, TASKS[code]) for code in codes]

    def finish(arrays: list[np.ndarray]) -> list[np.ndarray] | np.ndarray:
        out = arrays[0].copy()
        for code, activated in zip(codes, arrays[1:]):
            rows = (batch.task == code) & (batch.use_activation != 0)
            out[rows] = activated[rows]
        if not per_token:
            return out
        return [out[row, : int(lengths[row])] for row in range(len(batch))]

    return tensors, finish


def logit_score_rows(spec: ModelSpec, model: torch.nn.Module, device: torch.device,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The lm_head rows (and biases) of LogitScore's tokens: the true token's, then the false
    token's. Checked once against the model's own forward, so a family whose logits are more
    than lm_head(hidden) (softcapping, scaling) is refused rather than scored differently."""
    score = spec.logit_score
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"model {spec.path!r}: its output layer is {type(head).__name__}, not a Linear "
                         "lm_head; LogitScore cannot be computed from its rows")
    ids = [score.true_token_id] + ([] if score.false_token_id is None else [score.false_token_id])
    if max(ids) >= head.out_features or min(ids) < 0:
        raise ValueError(f"model {spec.path!r}: LogitScore token ids {ids} are outside its vocabulary "
                         f"of {head.out_features}")
    index = torch.tensor(ids, device=head.weight.device)
    rows = (head.weight.detach().index_select(0, index),
            None if head.bias is None else head.bias.detach().index_select(0, index))
    with torch.inference_mode():
        probe = torch.arange(1, 9, device=device)[None, :] % spec.vocab_size
        mask = torch.ones_like(probe)
        full = model(input_ids=probe, attention_mask=mask).logits[0, -1, ids].float()
        hidden = model.base_model(input_ids=probe, attention_mask=mask).last_hidden_state[:, -1]
        mine = torch.nn.functional.linear(hidden, rows[0], rows[1])[0].float()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if not torch.allclose(full, mine, rtol=tolerance, atol=tolerance):
        raise ValueError(f"model {spec.path!r}: its logits are not lm_head(last hidden state) "
                         f"({full.tolist()} vs {mine.tolist()}); this family is not supported as an LLM reranker")
    return rows


def multi_vector_parts(spec: ModelSpec, device: torch.device) -> tuple[SentenceHead | None, np.ndarray | None]:
    """A multi-vector model's token-level modules, and its skiplist as token ids (ST's
    MultiVectorMask.resolve_with_tokenizer: a word that is not one token of the vocabulary -- it
    maps to the unknown token -- is dropped, unless it is the unknown token itself)."""
    from transformers import AutoTokenizer

    mv = spec.multi_vector
    head = SentenceHead(mv.token_modules).to(device).eval() if mv.token_modules else None
    if not mv.mask_module or not mv.skiplist_words:
        return head, None
    tokenizer = AutoTokenizer.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    unk_id, unk = getattr(tokenizer, "unk_token_id", None), getattr(tokenizer, "unk_token", None)
    ids = [tokenizer.convert_tokens_to_ids(w) for w in mv.skiplist_words]
    ids = [i for w, i in zip(mv.skiplist_words, ids) if unk_id is None or i != unk_id or w == unk]
    return head, (np.asarray(ids, dtype=np.int64) if ids else None)


def kept_token_vectors(values: np.ndarray, keep: np.ndarray, dimensions: np.ndarray,
                       normalize: np.ndarray) -> list[np.ndarray]:
    """Each row's vectors at its kept tokens, cut to its `dimensions` (< 0: all) and normalized as it asks."""
    return [finish_embeddings(values[row][keep[row]], None if dimensions[row] < 0 else int(dimensions[row]),
                              bool(normalize[row]))
            for row in range(len(keep))]


def kept_tokens(spec: ModelSpec, skip_ids: np.ndarray | None, ids: np.ndarray, real: np.ndarray,
                batch: Requests) -> np.ndarray:
    """[n, longest] bool: the tokens whose vectors a request returns, as ST's MultiVectorMask keeps
    them -- its tokens (a query's expansion tokens included); less the skiplist's on the routes it
    applies to (no route counts as "document"); on non-query routes, only keep_only_token_ids.
    Without a MultiVectorMask, only the tokens the encoder attended to."""
    mv = spec.multi_vector
    keep = real.copy()
    starts = batch.expansion_start
    if not mv.mask_module:
        if (starts >= 0).any():
            ends = np.where(starts >= 0, starts, batch.lengths)
            keep &= np.arange(keep.shape[1])[None, :] < ends[:, None]
        return keep
    names = np.asarray([*spec.routes, "document"], dtype=object)  # route -1: no task, counts as a document
    route_of = names[batch.route]
    if skip_ids is not None:
        skipped = np.isin(route_of, mv.skiplist_tasks)
        if skipped.any():
            keep &= ~(np.isin(ids, skip_ids) & skipped[:, None])
    if mv.keep_only_token_ids:
        keep &= np.isin(ids, mv.keep_only_token_ids) | (route_of == "query")[:, None]
    return keep
