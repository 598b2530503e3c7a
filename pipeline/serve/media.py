"""A request's inputs as the Pipeline's prompts, with no file or network access that request content
can drive: a text is always a text (a dual encoder would take a string naming an existing image or
audio file for that file, as sentence-transformers does: a server wraps it as {"text": ...}); an image
or audio clip is base64 or a `data:image/` (`data:audio/`) URI, and a local file only under the
directory the operator allowed (`--allowed-local-media-path`, vLLM's flag), never a URL."""

from __future__ import annotations

import base64
import binascii
import os

import msgspec

from pooling_pipeline.core.families import family_of
from pooling_pipeline.serve.http import HTTPError


def takes_media(spec) -> bool:
    """The model takes images or audio (a bare string naming such a file would be read as it): a
    multimodal reranker's pairs too."""
    family = family_of(spec)
    return bool(family.media_renderers) or family.pair_input is not None


def text_prompt(text: str, images: bool) -> object:
    """A text as the pipeline reads it on this model: `{"text": ...}` where a bare string could be read
    as an image or audio file's name."""
    return {"text": text} if images else text


NUMBERS = (int, float, bool)  # what JSON numbers and booleans decode to: a list of these is meant as token ids


def token_ids_refusal(ids: list, where: str, nonnegative: bool = False) -> str:
    """Why a list of JSON numbers is no list of token ids, naming its first bad value by its position
    (`[101, 2.5]` is one input whose second id is no integer, not an input 101 of the wrong type)."""
    for k, x in enumerate(ids):
        if type(x) is not int or (nonnegative and x < 0):
            kind = {float: "float ", bool: "boolean "}.get(type(x), "")
            rule = "integers >= 0" if nonnegative else "integers"
            return f"{where}[{k}]: token ids must be {rule}, got {kind}{msgspec.json.encode(x).decode()}"
    raise RuntimeError(f"{where} holds only token ids, yet was refused: this is a bug")


def media_prompt(value: object, index: int, allowed_dir: str | None, modality: str = "image") -> dict:
    """An image (audio) input of a request: a `data:image/` (`data:audio/`) URI, raw base64 of an
    image (audio) file, or (where the operator allowed a directory) a path or file:// URI inside it."""
    one = "an image" if modality == "image" else "an audio clip"
    if not isinstance(value, str):
        raise HTTPError(400, f"input {index}: {one} is a string (base64 or a data:{modality}/ URI), "
                             f"got {type(value).__name__}")
    if value.startswith(f"data:{modality}/"):
        return {modality: value}
    if value.startswith(("http://", "https://")):
        raise HTTPError(400, f"input {index}: {modality} URLs are not fetched by this server; send the {modality} as "
                             f"base64 or a data:{modality}/ URI")
    if value.startswith("file://"):
        return {modality: _allowed_file(value.removeprefix("file://"), index, allowed_dir, modality)}
    compact = "".join(value.split())  # (base64 with MIME line breaks)
    try:  # strict base64 first: a JPEG's base64 starts with "/9j/", which also reads as an absolute path
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        data = b""
    if data:
        return {modality: data}
    if os.path.isabs(value):
        return {modality: _allowed_file(value, index, allowed_dir, modality)}
    local = " or a path under the allowed media directory" if allowed_dir else ""
    raise HTTPError(400, f"input {index}: {one} must be base64, a data:{modality}/ URI{local}; got {value[:80]!r}")


def _allowed_file(path: str, index: int, allowed_dir: str | None, modality: str = "image") -> str:
    if allowed_dir is None:
        raise HTTPError(400, f"input {index}: local files are not read by this server (no "
                             f"--allowed-local-media-path); send the {modality} as base64 or a data:{modality}/ URI")
    real = os.path.realpath(path)
    root = os.path.realpath(allowed_dir)
    if os.path.commonpath([real, root]) != root:
        raise HTTPError(400, f"input {index}: {path!r} is outside the allowed media directory")
    if not os.path.isfile(real):
        raise HTTPError(400, f"input {index}: {path!r} is not a file")
    return real
