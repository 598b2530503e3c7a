"""vLLM's pooling routes beside `/v1/embeddings`, in its exact shapes (dialect "openai"):

- `POST /v1/rerank`, `/v2/rerank` (Jina / Cohere rerank, vLLM's `RerankRequest`): a query against
  documents, best first; `top_n` keeps the best n (0, the default: all).
- `POST /score`, `/v1/score` (vLLM's `ScoreRequest`): `text_1`/`text_2` (or `data_1`/`data_2`,
  `queries`/`documents`, `queries`/`items`), 1:1, 1:N or N:N.
- `POST /classify`, `/v1/classify` (vLLM serves `/classify`): class probabilities and the label of
  the best class, named by the model's `id2label`.
- `POST /pooling` (vLLM's generic route): the raw output of a task the model runs.

A score is the API's `score`: a cross-encoder's (or an LLM reranker's) activated logit, as ST's
CrossEncoder gives it; an embedding model's similarity of the two embeddings (cosine unless the
model's similarity_fn_name says otherwise), as vLLM and ST's `similarity` give it; MaxSim for a
ColBERT model. A route of a kind the model cannot do is vLLM's 501 ("The model does not support ...").
A field this server cannot honour is refused by name, never ignored (unknown fields are ignored, as
vLLM ignores them).
"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from pooling_pipeline.core.families import family_of
from pooling_pipeline.core.shared.messages import PoolingParams
from pooling_pipeline.core.shared.model_folder.st_files import read_optional_json
from pooling_pipeline.core.shared.options import EMBEDDING_TASKS, TooLong, read_too_long
from pooling_pipeline.request_options import model_prompts
from pooling_pipeline.serve.app import Request, Response, Route, list_response, response_id
from pooling_pipeline.serve.chat_inputs import part_prompt
from pooling_pipeline.serve.http import HTTPError, base64_string, encode_json, float_rows
from pooling_pipeline.serve.media import media_prompt, takes_media, text_prompt
from pooling_pipeline.serve.openai_routes import long_input_options, prompts_of, too_long, truncation
from pooling_pipeline.serve.tokenizer import served_tokenizer

UNSET: Any = msgspec.UNSET
TokenLimit = Annotated[int, msgspec.Meta(ge=-1)]  # truncate_prompt_tokens: -1 is the model's maximum


class _Common(msgspec.Struct, kw_only=True):
    """What every pooling request of vLLM takes (`PoolingBasicRequestMixin`)."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: TokenLimit | None = None
    priority: int = 0
    use_activation: bool | None = None  # the head's activation (sigmoid / softmax); False: raw logits
    # vLLM's fields that change results and that this server does not honour: refused when given.
    padding: Any = UNSET
    mm_processor_kwargs: Any = UNSET


class RerankRequest(_Common, kw_only=True):
    query: Any
    documents: Any
    top_n: Annotated[int, msgspec.Meta(ge=0)] = 0  # vLLM: 0 (or absent) is every document
    return_documents: bool | None = None  # Jina's (default true; vLLM always returns them); Infinity's (default false)
    max_tokens_per_doc: Annotated[int, msgspec.Meta(ge=1)] | None = None  # Cohere v2's; cross-encoders only
    truncation_side: Any = UNSET  # (a pair is cut as ST's CrossEncoder cuts it)


class ScoreRequest(_Common, kw_only=True):
    # vLLM takes one of these pairs of names (SCORE_SIDES), each a string or a list of strings.
    text_1: Any = UNSET
    text_2: Any = UNSET
    data_1: Any = UNSET
    data_2: Any = UNSET
    queries: Any = UNSET
    documents: Any = UNSET
    items: Any = UNSET
    truncation_side: Any = UNSET


SCORE_SIDES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))


class ClassifyRequest(_Common, kw_only=True):
    input: Any
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool = True
    normalize: Any = UNSET  # removed by vLLM (refused there too)
    messages: Any = UNSET  # vLLM's chat form


PoolingTask = Literal["embed", "token_embed", "classify", "token_classify"]
POOLING_TASKS = ("embed", "token_embed", "classify", "token_classify")


class PoolingRequest(ClassifyRequest, kw_only=True):
    task: PoolingTask | None = None  # default: the model's first task
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None  # embedding tasks (Matryoshka)
    encoding_format: Literal["float", "base64"] = "float"
    embed_dtype: Literal["float32"] = "float32"  # base64: the float32 bytes
    endianness: Literal["native", "little"] = "native"


# ---- rerank ------------------------------------------------------------------------------------

async def rerank_documents(request: Request) -> Response:
    """A query against documents, best first: vLLM's, Jina's and Cohere's shape (each document
    `{"text": ...}`, and `meta.warnings` naming what was cut: Cohere's field); or, on TEI's `/rerank`
    (which hands over bodies that carry `documents`) with --rerank-dialect infinity, Infinity's (each
    document a string). Both are what their clients parse: litellm's hosted_vllm/ reads
    `document["text"]`, its infinity/ the string, and both post to /rerank."""
    body: RerankRequest = request.json(RerankRequest)
    server = request.server
    server.check_model(body.model)
    _refuse_given(body, ("padding", "mm_processor_kwargs", "truncation_side"))
    _check_scores(server.spec, "Rerank (Score) API")
    query = _one_text(body.query, "query")
    documents, echoed = _documents(body.documents, "documents", request)
    infinity = request.dialect == "tei" and server.settings.rerank_dialect == "infinity"
    scores, cuts = await _pair_scores(request, [query], documents, body, ("query", "documents"),
                                      max_tokens_per_doc=body.max_tokens_per_doc, notes=not infinity)
    tokens = server.count_tokens(scores)
    # Best first; equal scores keep their input order (vLLM's stable sort, ST's CrossEncoder.rank).
    order = sorted(range(len(scores)), key=lambda i: -scores[i].score)
    if 0 < body.top_n < len(order):
        order = order[: body.top_n]
    model, usage = server.model_name(body.model), {"prompt_tokens": tokens, "total_tokens": tokens}
    if infinity:  # Infinity's ReRankResult; its return_documents defaults to false
        results = [{"relevance_score": scores[i].score, "index": i,
                    "document": (echoed[i]["text"] if echoed[i]["multi_modal"] is None else echoed[i]["multi_modal"])
                    if body.return_documents else None} for i in order]
        return Response(encode_json({"object": "rerank", "results": results, "model": model, "usage": usage,
                                     "id": response_id("infinity"), "created": int(time.time())}))
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i].score}
        if body.return_documents is not False:
            result["document"] = echoed[i]
        results.append(result)
    answer = {"id": response_id("rerank"), "model": model, "usage": usage, "results": results}
    if cuts:
        answer["meta"] = {"warnings": cuts}
    return Response(encode_json(answer))


# ---- score ---------------------------------------------------------------------------------------

async def score(request: Request) -> Response:
    body: ScoreRequest = request.json(ScoreRequest)
    server = request.server
    server.check_model(body.model)
    _refuse_given(body, ("padding", "mm_processor_kwargs", "truncation_side"))
    _check_scores(server.spec, "Score API")
    first, second = _score_sides(body)
    queries = _texts(getattr(body, first), first)
    documents, _ = _documents(getattr(body, second), second, request)
    if len(queries) != 1 and len(queries) != len(documents):
        raise HTTPError(400, f"`{first}` and `{second}` must be 1:1, 1:N or N:N; got {len(queries)} and "
                             f"{len(documents)} items")
    scores, _ = await _pair_scores(request, queries, documents, body, (first, second))
    tokens = server.count_tokens(scores)
    data = [{"index": i, "object": "score", "score": s.score} for i, s in enumerate(scores)]
    return list_response("score", server.model_name(body.model), data, tokens)


def _score_sides(body: ScoreRequest) -> tuple[str, str]:
    given = {name for pair in SCORE_SIDES for name in pair if getattr(body, name) is not UNSET}
    for pair in SCORE_SIDES:
        if given == set(pair):
            return pair
    names = ", ".join(f"{a}/{b}" for a, b in SCORE_SIDES)
    raise HTTPError(400, f"a score request gives one pair of: {names}; got {sorted(given) or 'none'}")


async def _pair_scores(request: Request, queries: list[str], documents: list[str], body: _Common,
                       sides: tuple[str, str], max_tokens_per_doc: int | None = None,
                       notes: bool = False) -> tuple[list, list[str]]:
    """The API's `score` of the pairs (one query against every document, or pair by pair), and (`notes`)
    what was cut. `sides`: the request's names of the queries and the documents.

    vLLM's rule for an over-long input: a 400 naming it and its token count, unless the request
    (truncate_prompt_tokens; max_tokens_per_doc, for the documents alone) or the operator (--auto-truncate)
    asks for a cut. The render workers refuse it (long_inputs='error'), measuring each pair as they
    render it, an LLM reranker's chat template included: this process tokenizes nothing before the
    call is admitted."""
    server = request.server
    spec = server.spec
    kind = spec.score_kind
    if body.use_activation is not None and kind != "cross_encoder":
        raise HTTPError(400, f"`use_activation` applies to a cross-encoder's scores; this model scores by the "
                             f"{spec.similarity if kind == 'bi_encoder' else 'MaxSim'} of its embeddings")
    if max_tokens_per_doc is not None and kind != "cross_encoder":
        raise HTTPError(400, "max_tokens_per_doc applies to a cross-encoder's pairs; this model embeds each text: "
                             "use truncate_prompt_tokens")
    server.check_batch(len(documents))  # (before any work on them)
    keep = truncation(request, body.truncate_prompt_tokens)
    measured = _measured(spec)
    refuse = measured and keep is None and not server.settings.auto_truncate
    images = takes_media(spec)  # (a CLIP model reads a bare string naming a file as that image)
    firsts = [text_prompt(t, images) for t in queries]
    seconds = [text_prompt(t, images) if isinstance(t, str) else t for t in documents]  # (or an image's prompt)
    # What the pipeline runs: a cross-encoder reads each pair at once; an embedding model embeds each text.
    requests = len(seconds) if kind == "cross_encoder" else len(firsts) + len(seconds)
    params = PoolingParams(use_activation=body.use_activation) if body.use_activation is not None else None
    start = functools.partial(server.pipe.ascore, firsts, seconds, pooling_params=params, truncate_prompt_tokens=keep,
                              priority=body.priority, max_tokens_per_doc=max_tokens_per_doc,
                              long_inputs="error" if refuse else "truncate")
    cut_asked = keep is not None or max_tokens_per_doc is not None or server.settings.auto_truncate
    cuts = None
    # (measured once admitted, and only what was cut)
    if notes and measured and cut_asked and len(queries) == 1 and all(isinstance(d, str) for d in documents):
        cuts = functools.partial(_cuts, request, queries[0], documents, sides, keep, max_tokens_per_doc)
    try:
        return await server.run(requests, _scored(start, cuts), client_inputs=len(seconds))
    except ValueError as e:
        refused = read_too_long(str(e))
        if refused is None:
            raise
        raise _too_long_pair(request, refused, len(queries), sides) from None


def _measured(spec) -> bool:
    """Whether an over-long input can be told from what the dialects ask: a routed or multi-vector model's
    texts are cut at each route's length, and a dual encoder's text at its tower's, as ST cuts them."""
    plain = spec.score_kind == "cross_encoder" or (spec.multi_vector is None and not spec.routes)
    return plain and not takes_media(spec)


def _too_long_pair(request: Request, refused: TooLong, num_queries: int, sides: tuple[str, str]) -> HTTPError:
    """The render workers' refusal in the dialect's words, naming the input as the request named it: vLLM's
    400 (TEI's 413 Validation, on its /rerank)."""
    spec = request.server.spec
    i = refused.index
    also = ""
    if spec.score_kind == "cross_encoder":
        where = f"request {i}: the pair (`{sides[0]}`{'' if num_queries == 1 else f'[{i}]'}, `{sides[1]}`[{i}])"
        if spec.chat_pairs is not None:
            where += " as the model's chat template renders it"  # (max_tokens_per_doc: the worker refuses it)
        elif sides[1] == "documents":
            also = " (or max_tokens_per_doc)"
    elif i < num_queries:  # an embedding model's call: the queries, then the documents
        where = f"`{sides[0]}`" if sides[0] == "query" else f"request {i}: `{sides[0]}`[{i}]"
    else:
        where = f"request {i - num_queries}: `{sides[1]}`[{i - num_queries}]"
    status = 413 if request.dialect == "tei" else 400  # (TEI's "Validation" for an input over its length)
    return too_long(where, refused.tokens, spec.default_max_tokens, refused.exact, also, status)


async def _scored(start, cuts) -> tuple[list, list[str]]:
    """What server.run awaits once the call is admitted: the scores (`start()`), and what `cuts(scores)`
    says was cut of them. (Nothing is started before: a call refused a place starts no coroutine.)"""
    scores = await start()
    return scores, [] if cuts is None else await cuts(scores)


async def _cuts(request: Request, query: str, documents: list[str], sides: tuple[str, str], keep: int | None,
                max_doc: int | None, scores: list) -> list[str]:
    """What was cut of the scored pairs (Cohere's meta.warnings), measured in this process after the call,
    inside its admission, and only where the kept length says a cut may have happened (a pair at the
    tokens kept, a document at max_tokens_per_doc): each no further than that length needs."""
    server = request.server
    spec = server.spec
    tokenizer = await served_tokenizer(server)
    limit = spec.default_max_tokens if keep is None else keep
    name = spec.default_prompt_name  # (the pipeline puts the model's default prompt in front of each query)
    prompt = model_prompts(spec).get(name, "") if name is not None else ""
    kept = [out.num_prompt_tokens for out in scores]
    if spec.score_kind != "cross_encoder":
        measure = _text_cuts
    elif spec.chat_pairs is not None:
        measure = _chat_pair_cuts
    else:
        measure = _pair_cuts
    return await asyncio.to_thread(measure, tokenizer, prompt, query, documents, kept, sides, limit, max_doc)


def _pair_cuts(tokenizer, prompt: str, query: str, documents: list[str], kept: list[int], sides: tuple[str, str],
               limit: int, max_doc: int | None) -> list[str]:
    """A cross-encoder's pairs, each as the pipeline kept it: the document cut to max_doc, then the pair.
    A pair shorter than `limit` was not cut longest-first: its document's kept length tells whether
    max_doc may have cut it."""
    query = prompt + query
    query_tokens, _ = tokenizer.content_tokens(query, limit)
    cuts = []
    for i, document in enumerate(documents):
        document_kept = kept[i] - tokenizer.num_special_tokens_pair - query_tokens
        if kept[i] < limit and (max_doc is None or document_kept < max_doc):
            continue  # nothing of this pair was cut
        length = tokenizer.measure(query, document, limit, max_doc)
        if length.pair_cut:
            cuts.append(f"`{sides[1]}`[{i}] was cut to {max_doc} tokens (max_tokens_per_doc)")
        if length.tokens > limit:
            cuts.append(f"request {i}: the pair (`{sides[0]}`, `{sides[1]}`[{i}]) was cut from "
                        f"{'' if length.exact else 'at least '}{length.tokens} to {limit} tokens, longest first")
    return cuts


def _chat_pair_cuts(tokenizer, prompt: str, query: str, documents: list[str], kept: list[int],
                    sides: tuple[str, str], limit: int, max_doc: int | None) -> list[str]:
    """An LLM reranker's pairs, each rendered through the model's chat template as the render workers
    render it (ST's): one that reached `limit` tokens is measured whole (as far as `limit` needs)."""
    cuts = []
    for i, document in enumerate(documents):
        if kept[i] < limit:
            continue
        tokens, exact = tokenizer.chat_pair_tokens(query, document, prompt or None, limit)
        if tokens > limit:
            cuts.append(f"request {i}: the pair (`{sides[0]}`, `{sides[1]}`[{i}]) as the model's chat template "
                        f"renders it was cut from {'' if exact else 'at least '}{tokens} to {limit} tokens")
    return cuts


def _text_cuts(tokenizer, prompt: str, query: str, documents: list[str], kept: list[int], sides: tuple[str, str],
               limit: int, max_doc: int | None) -> list[str]:
    """An embedding model's scored texts, each embedded alone (the model's default prompt in front); a pair's
    kept length is its query's and its document's."""
    cuts = []
    length = tokenizer.measure(prompt + query, None, limit)
    if length.tokens > limit:
        cuts.append(f"`{sides[0]}` was cut from {'' if length.exact else 'at least '}{length.tokens} to {limit} tokens")
    query_kept = min(length.tokens, limit)
    for i, document in enumerate(documents):
        if kept[i] - query_kept < limit:
            continue  # its document was kept whole
        length = tokenizer.measure(prompt + document, None, limit)
        if length.tokens > limit:
            cuts.append(f"request {i}: `{sides[1]}`[{i}] was cut from {'' if length.exact else 'at least '}"
                        f"{length.tokens} to {limit} tokens")
    return cuts


def _check_scores(spec, api: str) -> None:
    """vLLM answers 501 NotImplementedError on a route of a kind its model does not serve."""
    if spec.score_kind is None:
        raise HTTPError(501, f"The model does not support {api}")


# ---- classify ------------------------------------------------------------------------------------

async def classify(request: Request) -> Response:
    body: ClassifyRequest = request.json(ClassifyRequest)
    server = request.server
    server.check_model(body.model)
    if "classify" not in server.spec.tasks:
        raise HTTPError(501, "The model does not support Classification API")
    prompts = _text_inputs(body, request)
    params = PoolingParams(use_activation=body.use_activation) if body.use_activation is not None else None
    outs = await server.run(len(prompts), server.pipe.aclassify(prompts, pooling_params=params,
                                                                 **_text_options(body, request, prompts)))
    tokens = server.count_tokens(outs)
    labels = model_labels(server.spec.base_path, server.spec.num_labels)
    data = []
    for i, out in enumerate(outs):
        probs = out.data.tolist()
        data.append({"index": i, "label": labels[int(np.argmax(out.data))], "probs": probs, "num_classes": len(probs)})
    return list_response("classify", server.model_name(body.model), data, tokens)


@functools.lru_cache(maxsize=8)
def model_labels(base_path: str, num_labels: int) -> tuple[str, ...]:
    """The class names of the model's config.json `id2label`, as transformers reads them (vLLM's
    `hf_config.id2label`): "LABEL_i" for a class the config does not name."""
    id2label = read_optional_json(Path(base_path) / "config.json").get("id2label") or {}
    return tuple(str(id2label.get(str(i), f"LABEL_{i}")) for i in range(num_labels))


# ---- pooling -------------------------------------------------------------------------------------

async def pooling(request: Request) -> Response:
    body: PoolingRequest = request.json(PoolingRequest)
    server = request.server
    server.check_model(body.model)
    task = body.task or server.spec.tasks[0]
    if task not in POOLING_TASKS:
        raise HTTPError(400, f"task {task!r} is not served on /pooling (it serves {list(POOLING_TASKS)}); this model "
                             f"can do {server.spec.tasks}")
    prompts = _text_inputs(body, request)
    embedding = task in EMBEDDING_TASKS
    # vLLM's use_activation is an embedding's normalization and a classifier's softmax / sigmoid.
    params = PoolingParams(dimensions=body.dimensions,
                           normalize=body.use_activation if embedding else None,
                           use_activation=None if embedding else body.use_activation)
    outs = await server.run(len(prompts), server.pipe.aencode(prompts, task=task, pooling_params=params,
                                                               **_text_options(body, request, prompts)))
    tokens = server.count_tokens(outs)
    vector = base64_string if body.encoding_format == "base64" else float_rows
    data = [{"index": i, "object": "pooling", "data": vector(out.data)} for i, out in enumerate(outs)]
    return list_response("pooling", server.model_name(body.model), data, tokens)


# ---- shared --------------------------------------------------------------------------------------

def _text_inputs(body: ClassifyRequest, request: Request) -> list:
    """classify's and pooling's `input` as prompts, with the fields they cannot honour refused."""
    _refuse_given(body, ("padding", "mm_processor_kwargs"))
    if body.normalize is not UNSET:
        raise HTTPError(400, "Parameter `normalize` was removed; use `use_activation` instead.")
    if body.messages is not UNSET:
        raise HTTPError(400, "chat `messages` are not served on this route; send the text as `input`")
    if not body.add_special_tokens:
        raise HTTPError(400, "add_special_tokens=false is not supported: the model's special tokens are always added")
    return prompts_of(body.input, request)


def _text_options(body: ClassifyRequest, request: Request, prompts: list) -> dict:
    return {"priority": body.priority, "truncation_side": body.truncation_side,
            **long_input_options(request, body.truncate_prompt_tokens, prompts)}


def _refuse_given(body: msgspec.Struct, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(body, name) is not UNSET:
            raise HTTPError(400, f"`{name}` is not supported by this server (it would change the results); "
                                 f"leave it out")


def _one_text(value: Any, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "content" in value:
        raise HTTPError(400, f"`{field}`: multi-modal content is not supported by this server; send a string")
    raise HTTPError(400, f"`{field}` must be a string, got {type(value).__name__}")


def _documents(values: Any, field: str, request: Request) -> tuple[list, list[dict]]:
    """Rerank documents: strings, Cohere's and Jina's `{"text": ...}`, and for a model that takes images
    or audio, Jina's `{"image": base64 or data URI}` and vLLM's multi-modal `{"content": [parts]}` (each
    part one document: text, image_url, input_audio, audio_url) or a list of such parts. (the pipeline's
    prompt of each -- a string for a text --, and the document as the response echoes it.)"""
    spec = request.server.spec
    family = family_of(spec)
    if not family.media_renderers and family.pair_input is None:  # (a multimodal reranker's documents may be images)
        texts = _texts(values, field)
        return texts, [{"text": t, "multi_modal": None} for t in texts]
    allowed = request.server.settings.allowed_local_media_path
    if isinstance(values, dict) and isinstance(values.get("content"), list):
        values = values["content"]
    elif isinstance(values, (str, dict)):
        values = [values]
    if not isinstance(values, list):
        raise HTTPError(400, f"`{field}` must be a string or a list of documents, got {type(values).__name__}")
    if not values:
        raise HTTPError(400, f"`{field}` cannot be empty")
    prompts, echoed = [], []
    for i, value in enumerate(values):
        where = f"`{field}`[{i}]"
        if isinstance(value, dict) and set(value) == {"text"}:
            value = value["text"]
        if isinstance(value, str):
            prompts.append(value)
            echoed.append({"text": value, "multi_modal": None})
        elif isinstance(value, dict) and set(value) == {"image"}:  # Jina's image document
            if not family.takes("image"):
                raise HTTPError(400, f"{where}: an image, but this model takes no images")
            prompts.append(media_prompt(value["image"], i, allowed, "image"))
            echoed.append({"text": None, "multi_modal": value})
        elif isinstance(value, dict) and "type" in value:
            prompts.append(part_prompt(value, where, i, family, allowed))
            echoed.append({"text": value.get("text") if value.get("type") == "text" else None, "multi_modal":
                           None if value.get("type") == "text" else value})
        else:
            raise HTTPError(400, f"{where} must be a string, {{'text': ...}}, {{'image': ...}} or a content part")
    return prompts, echoed


def _texts(values: Any, field: str) -> list[str]:
    """A string (one text) or a list of strings."""
    if isinstance(values, str):
        return [values]
    if isinstance(values, dict) and "content" in values:
        raise HTTPError(400, f"`{field}`: multi-modal content is not supported by this server; send strings")
    if not isinstance(values, list):
        raise HTTPError(400, f"`{field}` must be a string or a list of strings, got {type(values).__name__}")
    if not values:
        raise HTTPError(400, f"`{field}` cannot be empty")
    return [_one_text(value, f"{field}[{i}]") for i, value in enumerate(values)]


ROUTES = [Route("POST", "/v1/rerank", rerank_documents, "openai"),
          Route("POST", "/v2/rerank", rerank_documents, "openai"),
          Route("POST", "/score", score, "openai"),
          Route("POST", "/v1/score", score, "openai"),
          Route("POST", "/classify", classify, "openai"),
          Route("POST", "/v1/classify", classify, "openai"),
          Route("POST", "/pooling", pooling, "openai")]
