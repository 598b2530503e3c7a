"""vLLM's chat form of `/v1/embeddings`: `messages` instead of `input`, one conversation giving one
embedding, its content a string or OpenAI's parts -- `{"type": "text", "text"}`, `{"type":
"image_url", "image_url": {"url"}}`, `{"type": "input_audio", "input_audio": {"data", "format"}}`,
`{"type": "audio_url", "audio_url": {"url"}}`.

A dual encoder (CLIP, SigLIP) or CLAP embeds one text, one image or one clip: the conversation must
hold exactly one such part (vLLM's pooling of these models takes the same), else a 400 naming what
it holds. A VLM embedder (Qwen3-VL-Embedding) takes the conversation as it is, texts and images,
through its chat template, as vLLM does. A text model takes the conversation through its chat
template (the pipeline's conversations: each message's text parts joined by a newline, as vLLM
joins them); an image or audio part there is a 400.
"""

from __future__ import annotations

from typing import Any

from pooling_pipeline.core.families import family_of
from pooling_pipeline.serve.http import HTTPError
from pooling_pipeline.serve.media import media_prompt

# A part's type -> (the modality it carries, where its data sits in the part).
MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "audio_url": "audio"}
REFUSED_PARTS = {"video_url": "video", "input_video": "video", "file": "file"}


def chat_prompt(messages: Any, spec, allowed_dir: str | None) -> object:
    """The conversation as one of the pipeline's prompts (a 400 naming what is wrong)."""
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "`messages` must be a non-empty list of {role, content} messages")
    parts = []  # (message index, role, part)
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise HTTPError(400, f"`messages`[{i}] must be an object with 'role' and 'content'")
        content = message["content"]
        if isinstance(content, str):
            parts.append((i, message["role"], {"type": "text", "text": content}))
        elif isinstance(content, list):
            parts.extend((i, message["role"], part) for part in content)
        else:
            raise HTTPError(400, f"`messages`[{i}].content must be a string or a list of parts, got "
                                 f"{type(content).__name__}")
    for i, _, part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in REFUSED_PARTS:
            raise HTTPError(400, f"`messages`[{i}]: {REFUSED_PARTS[kind]} inputs are not supported")
        if kind != "text" and kind not in MEDIA_PARTS:
            raise HTTPError(400, f"`messages`[{i}]: a content part's type must be 'text', 'image_url', 'input_audio' "
                                 f"or 'audio_url', got {kind!r}")
    family = family_of(spec)
    if family.message_input is not None:  # (a VLM embedder: the conversation as it is, its images read)
        return _conversation(messages, family, allowed_dir)
    if family.media_renderers:
        return _single_input(parts, family, allowed_dir)
    media = [(i, part["type"]) for i, _, part in parts if part["type"] != "text"]
    if media:
        raise HTTPError(400, f"`messages`[{media[0][0]}]: a {media[0][1]} part, but this model takes text only")
    conversation = []
    for i, message in enumerate(messages):
        texts = [part.get("text") for k, _, part in parts if k == i]
        if not all(isinstance(t, str) for t in texts):
            raise HTTPError(400, f"`messages`[{i}]: a text part's 'text' must be a string")
        conversation.append({"role": message["role"], "content": "\n".join(texts)})
    return conversation


def _conversation(messages: list, family, allowed_dir: str | None) -> list[dict]:
    """A model that renders chat messages (a VLM embedder) takes the conversation as it is: its
    string contents, its text parts, and its image parts as the pipeline's image parts."""
    conversation = []
    for i, message in enumerate(messages):
        content = message["content"]
        if not isinstance(content, str):
            content = [_message_part(part, f"`messages`[{i}]", i, family, allowed_dir) for part in content]
        conversation.append({"role": message["role"], "content": content})
    return conversation


def _message_part(part: dict, where: str, index: int, family, allowed_dir: str | None) -> dict:
    prompt = part_prompt(part, where, index, family, allowed_dir)  # ({"text": ...} or {"image": ...})
    kind, value = next(iter(prompt.items()))
    return {"type": kind, kind: value}


def _single_input(parts: list, family, allowed_dir: str | None) -> object:
    """A dual encoder's or CLAP's one input: the conversation's one part."""
    if len(parts) != 1:
        kinds = ", ".join(part["type"] for _, _, part in parts) or "nothing"
        raise HTTPError(400, f"this model embeds one text, image or audio clip per conversation (its towers take one "
                             f"input each); `messages` holds {len(parts)} parts ({kinds}): send each as its own request")
    i, _, part = parts[0]
    return part_prompt(part, f"`messages`[{i}]", i, family, allowed_dir)


def part_prompt(part: dict, where: str, index: int, family, allowed_dir: str | None) -> object:
    """One content part (`{"type": "text" | "image_url" | "input_audio" | "audio_url", ...}`) as the
    pipeline's prompt for a model that takes images or audio: a text as `{"text": ...}`."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in REFUSED_PARTS:
        raise HTTPError(400, f"{where}: {REFUSED_PARTS[kind]} inputs are not supported")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise HTTPError(400, f"{where}: a text part's 'text' must be a string")
        return {"text": part["text"]}
    if kind not in MEDIA_PARTS:
        raise HTTPError(400, f"{where}: a content part's type must be 'text', 'image_url', 'input_audio' or "
                             f"'audio_url', got {kind!r}")
    modality = MEDIA_PARTS[kind]
    if not family.takes(modality):
        raise HTTPError(400, f"{where}: a {kind} part, but this model takes no {modality} inputs")
    if kind == "input_audio":
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, dict) else None
        if not isinstance(data, str):
            raise HTTPError(400, f"{where}: an input_audio part must hold {{'data': base64, 'format'}}")
        return media_prompt(data, index, None, modality)  # (base64 of the file: never a path)
    holder = part.get(kind)
    url = holder.get("url") if isinstance(holder, dict) else holder
    if not isinstance(url, str):
        raise HTTPError(400, f"{where}: a {kind} part must hold {{'url': ...}}")
    return media_prompt(url, index, allowed_dir, modality)
