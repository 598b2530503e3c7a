"""OpenAI's (and vLLM's) routes: `POST /v1/embeddings`, `GET /v1/models` and `GET /v1/models/{model}`
(and all without `/v1`, as TEI and Infinity serve them), in their exact shapes.

`input` is a string, a list of strings, a list of token ids or a list of such lists; `encoding_format`
"float" (JSON numbers) or "base64" (the float32 little-endian bytes, what the `openai` client asks for
by default and decodes with numpy); `dimensions` keeps the first k (a Matryoshka model's); `usage`
counts the prompt tokens the model saw. vLLM's extras are taken too: `truncate_prompt_tokens`,
`normalize`, `priority`, (Infinity's) `modality: "image"` for a CLIP / SigLIP model and `"audio"` for
CLAP, and vLLM's chat form: `messages` instead of `input` (one conversation, one embedding;
chat_inputs.py), with `image_url`, `input_audio` and `audio_url` parts.
An input longer than the model's length is a 400 naming it unless the request (truncate_prompt_tokens)
or the operator (--auto-truncate) asks for truncation, as vLLM does. The model's length is ST's
max_seq_length (`default_max_tokens`), what `max_model_len` reports: vLLM's for a sentence-transformers
model, which caps max_model_len at it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from pooling_pipeline.core.families import family_of
from pooling_pipeline.core.shared.messages import PoolingParams
from pooling_pipeline.serve.app import Request, Response, Route, list_response
from pooling_pipeline.serve.chat_inputs import chat_prompt
from pooling_pipeline.serve.http import HTTPError, embedding_items, encode_json
from pooling_pipeline.serve.media import NUMBERS, media_prompt, takes_media, text_prompt, token_ids_refusal


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: Any = None
    # vLLM's chat form: one conversation, one embedding (chat_inputs.py)
    messages: Any = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1)] | None = None
    normalize: bool | None = None
    priority: int = 0
    # Infinity's: the inputs are images (base64 / data:image/ URIs) for a CLIP / SigLIP model, or
    # audio clips (base64 / data:audio/ URIs of audio files) for a CLAP model
    modality: Literal["text", "image", "audio"] = "text"


def prompts_of(value: Any, request: Request, modality: str = "text", field: str = "input") -> list:
    """OpenAI's `input` forms as the pipeline's prompts: a string, a list of strings, a list of token
    ids (one input), a list of lists of token ids; images (audio clips) when `modality` is "image"
    ("audio")."""
    spec = request.server.spec
    images = takes_media(spec)
    if modality != "text":
        if not family_of(spec).takes(modality):
            raise HTTPError(400, f"this model takes no {'images' if modality == 'image' else modality} (modality "
                                 f"{modality!r})")
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise HTTPError(400, f"`{field}` must be a string or a list of strings")
        allowed = request.server.settings.allowed_local_media_path
        return [media_prompt(item, i, allowed, modality) for i, item in enumerate(items)]
    if isinstance(value, str):
        return [text_prompt(value, images)]
    if not isinstance(value, list):
        raise HTTPError(400, f"`{field}` must be a string, a list of strings, a list of token ids or a list of "
                             f"such lists; got {type(value).__name__}")
    kinds = set(map(type, value))  # (JSON gives exact types: bool is not int here)
    if kinds == {int}:
        return [{"prompt_token_ids": value}]
    if not images and kinds == {str}:
        return value  # (the common case, a list of texts: no copy)
    if value and all(k in NUMBERS for k in kinds):  # one input's token ids, one of them no integer
        raise HTTPError(400, token_ids_refusal(value, f"`{field}`"))
    prompts = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            prompts.append(text_prompt(item, images))
        elif isinstance(item, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in item):
            prompts.append({"prompt_token_ids": item})
        elif isinstance(item, list) and all(type(x) in NUMBERS for x in item):
            raise HTTPError(400, token_ids_refusal(item, f"`{field}`[{i}]"))
        else:
            raise HTTPError(400, f"`{field}`[{i}] must be a string or a list of token ids, got "
                                 f"{type(item).__name__}")
    return prompts


def max_model_len(request: Request) -> int:
    """The most tokens of an input the OpenAI-shaped routes keep: ST's max_seq_length, as /v1/models says."""
    return request.server.spec.default_max_tokens


def truncation(request: Request, truncate_prompt_tokens: int | None) -> int | None:
    """The tokens a request asks to keep, as vLLM reads truncate_prompt_tokens: -1 is max_model_len, more
    than it a 400. (The pipeline would keep up to the position table: more than /v1/models reports.)"""
    if truncate_prompt_tokens is None:
        return None
    limit = max_model_len(request)
    if truncate_prompt_tokens == -1:
        return limit
    if truncate_prompt_tokens > limit:
        raise HTTPError(400, f"truncate_prompt_tokens={truncate_prompt_tokens} is greater than max_model_len "
                             f"({limit}). Please, select a smaller truncation size.")
    return truncate_prompt_tokens


def too_long(where: str, tokens: int, limit: int, exact: bool = True, also: str = "", status: int = 400) -> HTTPError:
    """vLLM's refusal of an over-long input (a 400), naming the input, its token count and how to have it cut."""
    return HTTPError(status, f"{where} has {'' if exact else 'at least '}{tokens} tokens, more than this model's "
                          f"maximum context length of {limit} tokens (max_model_len); send truncate_prompt_tokens"
                          f"{also} to have it cut, or start the server with --auto-truncate")


def long_input_options(request: Request, truncate_prompt_tokens: int | None, prompts: list) -> dict:
    """How an over-long input is handled: cut where the request or the operator says, else refused --
    a text by the render workers (by its token count), token ids here: the workers cut those whatever
    the call says (300, 600 or 10^6 ids were once cut to 256 in silence)."""
    limit = truncation(request, truncate_prompt_tokens)
    if limit is not None:
        return {"truncate_prompt_tokens": limit, "long_inputs": "truncate"}
    if request.server.settings.auto_truncate:
        return {"long_inputs": "truncate"}
    limit = max_model_len(request)
    for i, prompt in enumerate(prompts):
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if ids is not None and len(ids) > limit:
            raise too_long(f"request {i}: `input`", len(ids), limit)
    return {"long_inputs": "error"}


async def embeddings(request: Request) -> Response:
    body: EmbeddingRequest = request.json(EmbeddingRequest)
    server = request.server
    server.check_model(body.model)
    if (body.input is None) == (body.messages is None):
        raise HTTPError(400, "send either `input` or `messages` (vLLM's chat form), not both" if body.input is not None
                        else "`input` (or vLLM's `messages`) is required")
    if body.messages is not None:
        prompts = [chat_prompt(body.messages, server.spec, server.settings.allowed_local_media_path)]
    else:
        prompts = prompts_of(body.input, request, body.modality)
    params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize)
    outs = await server.run(len(prompts), server.pipe.aembed(
        prompts, pooling_params=params, priority=body.priority,
        **long_input_options(request, body.truncate_prompt_tokens, prompts)))
    tokens = server.count_tokens(outs)
    data = embedding_items([out.data for out in outs], body.encoding_format)
    return list_response("embd", server.model_name(body.model), data, tokens)


def model_card(request: Request, name: str) -> dict:
    """vLLM's ModelCard; `max_model_len` is the length the server keeps, not the position table's."""
    return {"id": name, "object": "model", "created": int(request.server.started), "owned_by": "pooling-pipeline",
            "root": name, "parent": None, "max_model_len": max_model_len(request)}


async def models(request: Request) -> Response:
    names = request.server.settings.served_model_names
    return Response(encode_json({"object": "list", "data": [model_card(request, name) for name in names]}))


async def model(request: Request) -> Response:
    """`GET /v1/models/{model}` (the `openai` client's models.retrieve); a name not served is a 404."""
    request.server.check_model(request.param)
    return Response(encode_json(model_card(request, request.param)))


# Without the /v1 prefix too, as TEI and Infinity serve them: an `openai` client given the server's
# bare address (base_url="http://host:port") asks for /embeddings and /models.
ROUTES = [Route("POST", "/v1/embeddings", embeddings, "openai"),
          Route("POST", "/embeddings", embeddings, "openai"),
          Route("GET", "/v1/models", models, "openai", inference=False),
          Route("GET", "/models", models, "openai", inference=False),
          Route("GET", "/v1/models/{model}", model, "openai", inference=False),
          Route("GET", "/models/{model}", model, "openai", inference=False)]
