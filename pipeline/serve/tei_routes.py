"""text-embeddings-inference's routes, in its exact request and response shapes (dialect "tei"):

- `POST /embed`: pooled embeddings, `[[float, ...], ...]` (always a list, one per input)
- `POST /embed_sparse` (SPLADE): `[[{"index": token id, "value": weight}, ...], ...]`
- `POST /embed_all`: every token's vector before pooling, `[[[float, ...], ...], ...]` (one a token)
- `POST /rerank` (a cross-encoder): `[{"index", "score", "text" (return_text)}, ...]`, best first;
  a body with `documents` instead of `texts` (the Jina / Cohere shape vLLM serves on /rerank too)
  goes to `rerank_routes.rerank_documents`
- `POST /predict` (a sequence classifier): `[{"score", "label"}, ...]` by score, or a list of those
- `POST /similarity`: `inputs: {"source_sentence", "sentences"}` -> `[cosine, ...]`, one a sentence
- `POST /tokenize`: `[[{"id", "text", "special", "start", "stop"}, ...], ...]`
- `POST /decode`: token ids (one list, or a batch of them) -> `[text, ...]`
- `GET /info`: the model and the server's bounds, TEI's fields
- `POST /` and `POST /invocations` (SageMaker's): the model's own route, as TEI picks it --
  what huggingface_hub's `InferenceClient` (and LangChain's `HuggingFaceEndpointEmbeddings` through
  it) posts to when given the server's address

As TEI: `truncate` defaults to the server's --auto-truncate; without truncation an input over the
model's length is refused, naming its token count; a route the model cannot run is a 424.
The results are sentence-transformers' (the Pipeline's): where TEI and ST differ, ST wins (a prompt
name left out is the model's default_prompt_name; truncation keeps the tokenizer's own side).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import math
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from pooling_pipeline.core.shared.messages import PoolingParams
from pooling_pipeline.core.shared.model_folder.model_path import default_model_path
from pooling_pipeline.core.shared.options import TOO_LONG_MARK
from pooling_pipeline.request_options import model_prompts
from pooling_pipeline.serve.app import Request, Response, Route
from pooling_pipeline.serve.http import HTTPError, encode_json, float_rows
from pooling_pipeline.serve.media import NUMBERS, takes_media, text_prompt, token_ids_refusal
from pooling_pipeline.serve.rerank_routes import model_labels, rerank_documents
from pooling_pipeline.serve.tokenizer import served_tokenizer

# TEI's status for its "Validation" errors (an input over the model's length, too many inputs, an
# unknown prompt name): 413 up to TEI 1.8; TEI 1.9.0 answers 422 (its PR #818).
VALIDATION = 413
# TEI's status for a route the model cannot run (error_type "backend").
NOT_SERVED = 424
# TEI reads either capitalisation (serde aliases on its TruncationDirection).
Direction = Literal["Left", "Right", "left", "right"]
# TEI refuses a text of more characters than this many times its max input length, before tokenizing.
MAX_CHARS_PER_TOKEN = 250


class EmbedRequest(msgspec.Struct, kw_only=True):
    inputs: Any  # a string, a list of token ids, or a list of strings and token-id lists
    truncate: bool | None = None  # None: the server's --auto-truncate
    truncation_direction: Direction | None = None  # None: the tokenizer's side (right for almost every model)
    prompt_name: str | None = None  # None: the model's default_prompt_name, as ST
    normalize: bool = True
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None  # the first k values, renormalized if normalize


class EmbedSparseRequest(msgspec.Struct, kw_only=True):
    inputs: Any
    truncate: bool | None = None
    truncation_direction: Direction | None = None
    prompt_name: str | None = None


class EmbedAllRequest(EmbedSparseRequest, kw_only=True):
    """The same fields as /embed_sparse's."""


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    texts: list[str]
    truncate: bool | None = None
    truncation_direction: Direction | None = None
    raw_scores: bool = False  # the logit, without the model's activation
    return_text: bool = False


class PredictRequest(msgspec.Struct, kw_only=True):
    inputs: Any  # a string, a [text, text_pair] pair, or a batch: [[text], [text, text_pair], ...]
    truncate: bool | None = None
    truncation_direction: Direction | None = None
    raw_scores: bool = False


class TokenizeRequest(msgspec.Struct, kw_only=True):
    inputs: str | list[str]
    add_special_tokens: bool = True
    prompt_name: str | None = None


class SimilarityInput(msgspec.Struct, kw_only=True):
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(msgspec.Struct, kw_only=True):
    truncate: bool | None = None
    truncation_direction: Direction | None = None
    prompt_name: str | None = None


class SimilarityRequest(msgspec.Struct, kw_only=True):
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


class DecodeRequest(msgspec.Struct, kw_only=True):
    ids: Any  # a list of token ids, or a batch of such lists
    skip_special_tokens: bool = True


class _InputsShape(msgspec.Struct):
    """Whether `inputs` is a JSON object (a similarity request); left unparsed."""

    inputs: msgspec.Raw = msgspec.Raw()


class _RerankShape(msgspec.Struct):
    """Which rerank body this is: TEI's (`texts`) or Jina / Cohere's (`documents`); left unparsed."""

    texts: msgspec.Raw = msgspec.Raw()
    documents: msgspec.Raw = msgspec.Raw()


# ---- what the model can serve --------------------------------------------------------------------

def is_reranker(spec) -> bool:
    """TEI's reranker: a cross-encoder with one score (an LLM reranker's score too)."""
    return spec.score_kind == "cross_encoder" and (spec.head == "causal_lm" or spec.num_labels == 1)


def is_classifier(spec) -> bool:
    return spec.head == "sequence_classification" and "classify" in spec.tasks


# Each route's test of the model, and TEI's message when it fails.
SERVES = {
    "embed": (lambda spec: "embed" in spec.tasks, "Model is not an embedding model"),
    "embed_sparse": (lambda spec: "sparse_embed" in spec.tasks, "Model is not an embedding model with SPLADE pooling"),
    "embed_all": (lambda spec: "token_embed" in spec.tasks, "Model is not an embedding model"),
    "rerank": (is_reranker, "model is not a re-ranker model"),
    "predict": (is_classifier, "Model is not a classifier model"),
}


def _require(spec, route: str) -> None:
    serves, message = SERVES[route]
    if not serves(spec):
        raise HTTPError(NOT_SERVED, f"Backend error: {message}")


# ---- inputs and truncation -----------------------------------------------------------------------

def _is_id(x: object) -> bool:
    return type(x) is int and x >= 0  # (not a bool: JSON true is no token id)


def _embed_prompts(value: Any, spec) -> list:
    """TEI's `inputs`: a string, a list of token ids (one input; `[]` too), or a list of strings and
    token-id lists. An empty input is TEI's 400."""
    if isinstance(value, str) or (isinstance(value, list) and all(_is_id(x) for x in value)):
        items = [value]
    elif isinstance(value, list) and all(type(x) in NUMBERS for x in value):  # one input's ids, one of them bad
        raise HTTPError(422, token_ids_refusal(value, "`inputs`", nonnegative=True))
    elif isinstance(value, list):
        items = value
    else:
        raise HTTPError(422, "`inputs` must be a string, a list of token ids, or a list of strings and token-id "
                             f"lists; got {type(value).__name__}")
    images = takes_media(spec)
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            prompts.append(text_prompt(item, images))
        elif isinstance(item, list) and all(_is_id(x) for x in item):
            prompts.append({"prompt_token_ids": item})
        elif isinstance(item, list) and all(type(x) in NUMBERS for x in item):
            raise HTTPError(422, token_ids_refusal(item, f"`inputs`[{i}]", nonnegative=True))
        else:
            raise HTTPError(422, f"`inputs`[{i}] must be a string or a list of token ids (integers >= 0), got "
                                 f"{type(item).__name__}")
        if not item:
            raise HTTPError(400, f"request {i}: `inputs` cannot be empty")
    return prompts


def _truncates(request: Request, truncate: bool | None) -> bool:
    return request.server.settings.auto_truncate if truncate is None else truncate


def _side(direction: str | None) -> str | None:
    return None if direction is None else direction.lower()


def _too_long(index: int, tokens: int, limit: int, exact: bool = True) -> HTTPError:
    return HTTPError(VALIDATION, f"request {index}: `inputs` has {'' if exact else 'at least '}{tokens} tokens, "
                                 f"more than the {limit} this model keeps (truncate=false)")


def _text_options(request: Request, prompts: list, truncate: bool | None, direction: str | None) -> dict:
    """How over-long texts are handled. Without truncation the render workers refuse a text (by
    its token count); token ids, which they cut whatever the call says, are measured here."""
    if _truncates(request, truncate):
        return {"long_inputs": "truncate", "truncation_side": _side(direction)}
    limit = request.server.spec.default_max_tokens
    for i, prompt in enumerate(prompts):
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if ids is not None and len(ids) > limit:
            raise _too_long(i, len(ids), limit)
    return {"long_inputs": "error", "truncation_side": _side(direction)}


async def _run_texts(request: Request, n: int, call) -> list:
    """Runs a call of texts; a text the render workers refused as over-long is TEI's validation
    error, with how to have it cut."""
    try:
        return await request.server.run(n, call)
    except ValueError as e:
        if TOO_LONG_MARK not in str(e):
            raise
        raise HTTPError(VALIDATION, f"{e}; truncate=false: send \"truncate\": true (or start the server with "
                                    "--auto-truncate) to have it cut") from None


def _check_prompt_name(spec, name: str | None) -> None:
    prompts = model_prompts(spec)
    if name is not None and name not in prompts:
        raise HTTPError(VALIDATION, f"prompt_name={name!r} is not among the model's prompts {sorted(prompts)}")


def _prompt_text(spec, name: str | None) -> str:
    """The prompt the pipeline puts in front of a text: the one named, else the model's default."""
    _check_prompt_name(spec, name)
    name = name if name is not None else spec.default_prompt_name
    return model_prompts(spec).get(name, "") if name is not None else ""


def _pair_options(request: Request, items: list, truncate: bool | None, direction: str | None) -> dict:
    """Truncation for inputs that may be (text, text_pair) pairs. The pipeline cuts a pair
    longest-first from the right, as ST's CrossEncoder does (a pair cut from the left is refused);
    without truncation the render workers refuse an input over the model's length, measuring it as
    they render it (an LLM reranker's chat template included), and `_run_texts` answers TEI's 413."""
    if not _truncates(request, truncate):
        return {"long_inputs": "error"}
    if _side(direction) == "left":
        pair = next((i for i, item in enumerate(items) if isinstance(item, tuple)), None)
        if pair is not None:
            raise HTTPError(400, f"request {pair}: truncation_direction={direction!r} is not supported for a "
                                 "pair: a pair is truncated longest-first from the right, as ST's CrossEncoder does")
    return {"truncation_side": _side(direction)}


def _best_first(scores: list[float]) -> list[int]:
    """TEI's order: an ascending stable sort, reversed (equal scores end up last input first)."""
    if any(math.isnan(s) for s in scores):
        raise HTTPError(NOT_SERVED, "score is NaN")
    return sorted(range(len(scores)), key=scores.__getitem__)[::-1]


# ---- routes ----------------------------------------------------------------------------------------

def _embedding_inputs(request: Request, body: EmbedRequest | EmbedSparseRequest, route: str) -> tuple[list, dict]:
    """What /embed, /embed_sparse and /embed_all share: the model serves `route`, the inputs as prompts within the
    batch bound, the prompt name checked, and the truncation options."""
    spec = request.server.spec
    _require(spec, route)
    prompts = _embed_prompts(body.inputs, spec)
    request.server.check_batch(len(prompts))
    _check_prompt_name(spec, body.prompt_name)
    return prompts, _text_options(request, prompts, body.truncate, body.truncation_direction)


async def embed(request: Request) -> Response:
    body: EmbedRequest = request.json(EmbedRequest)
    server, spec = request.server, request.server.spec
    prompts, options = _embedding_inputs(request, body, "embed")
    if body.dimensions is not None and body.dimensions > spec.embedding_size:
        raise HTTPError(VALIDATION, f"`dimensions` should be smaller than the maximum embedding dimension "
                                    f"({spec.embedding_size}); got {body.dimensions}")
    params = PoolingParams(normalize=body.normalize, dimensions=body.dimensions)
    outs = await _run_texts(request, len(prompts), server.pipe.aembed(prompts, pooling_params=params,
                                                                      prompt_name=body.prompt_name, **options))
    server.count_tokens(outs)
    return Response(encode_json(float_rows(np.stack([out.data for out in outs]))))  # (one width: the call's)


async def embed_sparse(request: Request) -> Response:
    body: EmbedSparseRequest = request.json(EmbedSparseRequest)
    server = request.server
    prompts, options = _embedding_inputs(request, body, "embed_sparse")
    outs = await _run_texts(request, len(prompts), server.pipe.aencode(prompts, task="sparse_embed",
                                                                       prompt_name=body.prompt_name, **options))
    server.count_tokens(outs)
    return Response(encode_json([[{"index": i, "value": v} for i, v in zip(out.indices.tolist(), out.data.tolist())]
                                 for out in outs]))


async def embed_all(request: Request) -> Response:
    """TEI's /embed_all: the transformer's output for every token, special tokens included, not
    pooled and not normalized (sentence-transformers' `output_value="token_embeddings"`)."""
    body: EmbedAllRequest = request.json(EmbedAllRequest)
    server = request.server
    prompts, options = _embedding_inputs(request, body, "embed_all")
    outs = await _run_texts(request, len(prompts), server.pipe.aencode(
        prompts, task="token_embed", pooling_params=PoolingParams(normalize=False), prompt_name=body.prompt_name,
        **options))
    server.count_tokens(outs)
    return Response(encode_json([float_rows(out.data) for out in outs]))


async def rerank(request: Request) -> Response:
    shape: _RerankShape = request.json(_RerankShape)
    if not shape.texts and shape.documents:  # the Jina / Cohere shape: its own module answers it
        return await rerank_documents(request)
    body: RerankRequest = request.json(RerankRequest)
    server = request.server
    if not body.texts:
        raise HTTPError(400, "`texts` cannot be empty")
    _require(server.spec, "rerank")
    server.check_batch(len(body.texts), "`texts`")
    if not body.query and "" in body.texts:
        raise HTTPError(400, f"request {body.texts.index('')}: `inputs` cannot be empty")
    # (score takes no truncation side: a pair is cut from the right, and _pair_options refuses the left)
    options = _pair_options(request, [(body.query, text) for text in body.texts], body.truncate,
                            body.truncation_direction)
    params = PoolingParams(use_activation=False) if body.raw_scores else None
    scores = await _run_texts(request, len(body.texts), server.pipe.ascore(
        body.query, body.texts, pooling_params=params, long_inputs=options.get("long_inputs", "truncate")))
    server.count_tokens(scores)
    ranks = []
    for i in _best_first([out.score for out in scores]):
        rank = {"index": i, "text": body.texts[i], "score": scores[i].score} if body.return_text else \
            {"index": i, "score": scores[i].score}
        ranks.append(rank)
    return Response(encode_json(ranks))


def _predict_items(value: Any) -> tuple[list, bool]:
    """TEI's PredictInput: a string or a [text, text_pair] list is one input; a list of lists (each
    [text] or [text, text_pair]) a batch. Returns (items: str or (text, text_pair), one input?)."""
    if isinstance(value, str):
        items, single = [value], True
    elif isinstance(value, list) and value and isinstance(value[0], str):
        items, single = [_sequence(value, 0)], True
    elif isinstance(value, list) and value:
        items, single = [_sequence(v, i) for i, v in enumerate(value)], False
    else:
        raise HTTPError(422, "`inputs` must be a string, a pair of strings [string, string] or a batch of mixed "
                             "strings and pairs [[string], [string, string], ...]")
    for i, item in enumerate(items):
        if item == "" or item == ("", ""):
            raise HTTPError(400, f"request {i}: `inputs` cannot be empty")
    return items, single


def _sequence(value: Any, index: int) -> str | tuple[str, str]:
    if not (isinstance(value, list) and 1 <= len(value) <= 2 and all(isinstance(s, str) for s in value)):
        raise HTTPError(422, f"`inputs`[{index}] must be [string] or [string, string]")
    return value[0] if len(value) == 1 else (value[0], value[1])


async def predict(request: Request) -> Response:
    body: PredictRequest = request.json(PredictRequest)
    items, single = _predict_items(body.inputs)
    server = request.server
    spec = server.spec
    _require(spec, "predict")
    server.check_batch(len(items))
    options = _pair_options(request, items, body.truncate, body.truncation_direction)
    params = PoolingParams(use_activation=False) if body.raw_scores else None
    outs = await _run_texts(request, len(items), server.pipe.aclassify(items, pooling_params=params, **options))
    server.count_tokens(outs)
    labels = model_labels(spec.base_path, spec.num_labels)
    predictions = []
    for out in outs:
        scores = out.data.tolist()
        predictions.append([{"score": scores[k], "label": labels[k]} for k in _best_first(scores)])
    return Response(encode_json(predictions[0] if single else predictions))


async def similarity(request: Request) -> Response:
    """TEI's /similarity: the source sentence's cosine with each sentence, on the model's embeddings
    (sentence-transformers' `similarity` with cos_sim: a zero vector's cosine is 0)."""
    body: SimilarityRequest = request.json(SimilarityRequest)
    server = request.server
    if not body.inputs.sentences:
        raise HTTPError(400, "`inputs.sentences` cannot be empty")
    params = body.parameters or SimilarityParameters()
    embed_body = EmbedRequest(inputs=[body.inputs.source_sentence, *body.inputs.sentences], truncate=params.truncate,
                              truncation_direction=params.truncation_direction, prompt_name=params.prompt_name)
    prompts, options = _embedding_inputs(request, embed_body, "embed")
    outs = await _run_texts(request, len(prompts), server.pipe.aembed(
        prompts, pooling_params=PoolingParams(normalize=False), prompt_name=params.prompt_name, **options))
    server.count_tokens(outs)
    vectors = np.stack([out.data for out in outs]).astype(np.float64)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)  # (torch's normalize eps)
    return Response(encode_json(float_rows((vectors[1:] @ vectors[0]).astype(np.float32))))


async def tokenize(request: Request) -> Response:
    body: TokenizeRequest = request.json(TokenizeRequest)
    server = request.server
    spec = server.spec
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    server.check_batch(len(texts))
    prompt = _prompt_text(spec, body.prompt_name)
    limit = spec.default_max_tokens * MAX_CHARS_PER_TOKEN
    for i, text in enumerate(texts):
        if not text:
            raise HTTPError(400, f"request {i}: `inputs` cannot be empty")
        if len(text) > limit:
            raise HTTPError(VALIDATION, f"request {i}: `inputs` must have less than {limit} characters. "
                                        f"Given: {len(text)}")
    tokenizer = await served_tokenizer(server)
    tokens = await asyncio.to_thread(lambda: [tokenizer.tokenize(prompt + text, body.add_special_tokens)
                                              for text in texts])
    return Response(encode_json(tokens))


async def decode(request: Request) -> Response:
    """TEI's /decode: `ids` is one list of token ids (its text, in a list of one) or a batch of them."""
    body: DecodeRequest = request.json(DecodeRequest)
    server = request.server
    ids = body.ids
    if isinstance(ids, list) and all(_is_id(x) for x in ids):
        batch = [ids]
    elif isinstance(ids, list) and all(isinstance(item, list) for item in ids):
        server.check_batch(len(ids), "`ids`")
        batch = ids
    elif isinstance(ids, list) and all(type(x) in NUMBERS for x in ids):
        raise HTTPError(422, token_ids_refusal(ids, "`ids`", nonnegative=True))
    else:
        raise HTTPError(422, "`ids` must be a list of token ids (integers >= 0) or a list of such lists")
    tokenizer = await served_tokenizer(server)
    vocab = tokenizer.vocab_size
    for i, item in enumerate(batch):
        bad = next((x for x in item if not (_is_id(x) and x < vocab)), None) if item else None
        if bad is not None:
            raise HTTPError(422, f"request {i}: {bad!r} is not a token id of this model (0 .. {vocab - 1})")
    texts = await asyncio.to_thread(lambda: [tokenizer.decode(item, body.skip_special_tokens) for item in batch])
    return Response(encode_json(texts))


def default_route(spec):
    """TEI's `POST /` for this model: /rerank for a reranker, /predict for a classifier,
    /embed_sparse for SPLADE, else /embed (the kinds of `model_type`, which /info shows)."""
    if is_reranker(spec):
        return rerank
    if spec.head == "sequence_classification":
        return predict
    return embed_sparse if "sparse_embed" in spec.tasks else embed


async def default(request: Request) -> Response:
    """TEI's `POST /` and SageMaker's `POST /invocations`: the model's own route. For an embedding
    model a body whose `inputs` is an object -- `{"source_sentence", "sentences"}`, what
    huggingface_hub's `sentence_similarity` sends -- is a /similarity request (TEI takes it there
    only when started with TASK=sentence-similarity; an /embed body's `inputs` is never an object)."""
    handler = default_route(request.server.spec)
    if handler is embed and bytes(request.json(_InputsShape).inputs)[:1] == b"{":  # (a Raw value: no whitespace)
        handler = similarity
    return await handler(request)


async def info(request: Request) -> Response:
    server = request.server
    pipe, spec, settings = server.pipe, server.spec, server.settings
    engine = pipe.stats().get("engine", {})
    model_id, model_sha = model_identity(spec.path)
    return Response(encode_json({
        "model_id": model_id, "model_sha": model_sha, "model_dtype": engine.get("dtype", "float32"),
        "served_model_name": settings.served_model_names[0], "model_type": model_type(spec),
        # TEI's bound on inputs in flight (a permit per input): the pipeline's window
        "max_concurrent_requests": pipe.max_inflight,
        "max_input_length": spec.default_max_tokens,
        "max_batch_tokens": engine.get("max_num_batched_tokens"),
        "max_batch_requests": pipe.max_num_seqs,
        "max_client_batch_size": settings.max_client_batch_size,
        "auto_truncate": settings.auto_truncate,
        "tokenization_workers": pipe.cpu_plan.render_workers,
        "version": _version(), "sha": None, "docker_label": None,
    }))


def model_type(spec) -> dict:
    """TEI's model_type: {"classifier" | "reranker": {id2label, label2id}} or {"embedding": {pooling}}."""
    if spec.head == "sequence_classification" or is_reranker(spec):
        labels = model_labels(spec.base_path, max(spec.num_labels, 1))
        return {"reranker" if is_reranker(spec) else "classifier": {
            "id2label": {str(k): name for k, name in enumerate(labels)},
            "label2id": {name: k for k, name in enumerate(labels)}}}
    if "sparse_embed" in spec.tasks:
        return {"embedding": {"pooling": "splade"}}
    return {"embedding": {"pooling": "+".join(POOLING_NAMES.get(mode, mode) for mode in spec.pooling.modes)}}


POOLING_NAMES = {"lasttoken": "last_token"}  # ST's pooling modes TEI spells otherwise


def model_identity(path: str) -> tuple[str, str | None]:
    """(model_id, model_sha): a hub snapshot's repository and commit, the bundled model's hub id, or
    the local folder (and no sha)."""
    parts = Path(path).parts
    if "snapshots" in parts:
        at = len(parts) - 1 - parts[::-1].index("snapshots")
        if at >= 1 and parts[at - 1].startswith("models--") and at + 1 < len(parts):
            return parts[at - 1].removeprefix("models--").replace("--", "/"), parts[at + 1]
    if Path(path) == Path(default_model_path()):
        return "sentence-transformers/all-MiniLM-L6-v2", None
    return path, None


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("pooling-pipeline")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


ROUTES = [Route("POST", "/embed", embed, "tei"),
          Route("POST", "/embed_sparse", embed_sparse, "tei"),
          Route("POST", "/embed_all", embed_all, "tei"),
          Route("POST", "/rerank", rerank, "tei"),
          Route("POST", "/predict", predict, "tei"),
          Route("POST", "/similarity", similarity, "tei"),
          Route("POST", "/", default, "tei"),
          Route("POST", "/invocations", default, "tei"),
          Route("POST", "/tokenize", tokenize, "tei", inference=False),
          Route("POST", "/decode", decode, "tei", inference=False),
          Route("GET", "/info", info, "tei", inference=False)]
