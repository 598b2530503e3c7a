"""A VLM embedder's inputs beyond one text or one image, read as sentence-transformers 6 reads them
for a model whose processor has a chat template (`sentence_transformers.base.modality`): a dict of
several modalities -- {"text": ..., "image": ...} -- is one user message whose parts follow the
dict's own key order; a dict with "role" and "content" is one chat message, and a list of such
dicts a conversation, handed to the template as they are (a plain string content stays a string).
Each image (a part {"type": "image", "image": x}, or a dict's "image") is read as any image input
(`image_inputs`: a path, data URI, base64, bytes, PIL image or array); the render worker opens it.
Video and audio parts are refused naming the request, as is any other part. A multimodal
reranker's (query, document) pair is two such messages, with roles "query" and "document"."""

from __future__ import annotations

from pooling_pipeline.core.families.vlm_embedder import MAX_IMAGES_PER_INPUT
from pooling_pipeline.core.shared.messages import ChatPart, ChatTurn
from pooling_pipeline.image_inputs import MODALITY_KEYS, image_dict_input, image_input, is_video_string
from pooling_pipeline.inputs import check_text


def _refuse_video(text: str, index: int) -> None:
    """A string ST reads as a video is refused, not embedded as the text of its name."""
    if is_video_string(text):
        raise ValueError(f"request {index}: {text[:200]!r} is a video to sentence-transformers; video inputs are not "
                         "supported")


def message_input(prompt: object, index: int, spec=None) -> list[ChatTurn] | None:
    """The prompt as chat messages, None when it is one text or one image (or not a prompt this
    reads); ValueError or TypeError naming the request when it cannot be taken."""
    if isinstance(prompt, str):
        _refuse_video(prompt, index)
        return None
    if isinstance(prompt, dict):
        if "role" in prompt and "content" in prompt:
            return _counted([_turn(prompt, 0, index)], index)
        keys = list(prompt)
        if len(keys) > 1 and set(keys) <= MODALITY_KEYS:
            if set(keys) - {"text", "image"}:
                raise ValueError(f"request {index}: a dict with {sorted(set(keys) - {'text', 'image'})} inputs; this "
                                 "model takes texts and images only")
            parts = [_part({"type": key, key: prompt[key]}, 0, index) for key in keys]
            return _counted([ChatTurn(role="user", parts=parts)], index)
        return None
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
        return _counted([_turn(message, k, index) for k, message in enumerate(prompt)], index)
    return None


def _turn(message: dict, turn: int, index: int) -> ChatTurn:
    if set(message) != {"role", "content"}:
        raise ValueError(f"request {index}: chat message {turn} must have exactly the keys 'role' and 'content', got "
                         f"{sorted(map(str, message))}")
    role = check_text(message["role"], index, f"chat message {turn} role")
    content = message["content"]
    if isinstance(content, str):
        return ChatTurn(role=role, content=check_text(content, index, f"chat message {turn} content"))
    if not isinstance(content, (list, tuple)) or not all(isinstance(part, dict) for part in content):
        raise TypeError(f"request {index}: chat message {turn} content must be a str or a list of parts (dicts), got "
                        f"{type(content).__name__}")
    return ChatTurn(role=role, parts=[_part(part, turn, index) for part in content])


def _part(part: dict, turn: int, index: int) -> ChatPart:
    kind = part.get("type")
    if kind == "text" and set(part) == {"type", "text"}:
        return ChatPart(text=check_text(part["text"], index, f"chat message {turn} text part"))
    if kind == "image" and set(part) == {"type", "image"}:
        return ChatPart(media=image_dict_input(part["image"], index))
    raise ValueError(f"request {index}: chat message {turn} has a part {sorted(map(str, part))} of type {kind!r}; "
                     "this model takes {'type': 'text', 'text': ...} and {'type': 'image', 'image': ...} parts")


def _counted(turns: list[ChatTurn], index: int) -> list[ChatTurn]:
    images = sum(part.media is not None for turn in turns for part in turn.parts or ())
    if images > MAX_IMAGES_PER_INPUT:
        raise ValueError(f"request {index}: {images} images in one input, more than the {MAX_IMAGES_PER_INPUT} one "
                         "input may hold")
    return turns


def pair_input(query: object, document: object, index: int, spec=None) -> list[ChatTurn]:
    """A (query, document) pair as ST's CrossEncoder renders it for a model with a chat template: a
    message with role "query", then one with role "document", each holding its side's parts -- a
    text, an image (a path or data URI of an image, a PIL image, an array, `{"image": ...}`), or a
    `{"text", "image"}` dict's parts in its key order."""
    turns = [ChatTurn(role=role, parts=_side(side, role, index)) for role, side in (("query", query), ("document", document))]
    return _counted(turns, index)


def _side(value: object, role: str, index: int) -> list[ChatPart]:
    if isinstance(value, dict) and value and set(value) <= MODALITY_KEYS:
        if set(value) - {"text", "image"}:
            raise ValueError(f"request {index}: the {role}'s {sorted(set(value) - {'text', 'image'})} inputs; this "
                             "model takes texts and images only")
        return [_part({"type": key, key: value[key]}, 0, index) for key in value]
    image = image_input(value, index)
    if image is not None:
        return [ChatPart(media=image)]
    if isinstance(value, str):
        _refuse_video(value, index)
    return [ChatPart(text=check_text(value, index, role))]
