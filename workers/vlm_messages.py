"""A render worker's texts and images for a VLM embedder (Qwen2-VL, Qwen3-VL), as
sentence-transformers 6 hands them to the model's processor: each input one user message -- a text
part or an image part -- the call's prompt a system message before it (which replaces the chat
template's default one), rendered by `apply_chat_template` with the saved `processing_kwargs`
(`add_generation_prompt`), one input per call (the same ids and patches as ST's batched call, less
its padding). An image is opened as ST's processor opens it: a file, data URI or bytes decoded by
the processor itself (a torchvision processor: `fetch_images`), after its size is read from the
file's header; a PIL image or array as it is. Its row: the ids (one image token per merged group of
patches), the processor's float patches and its (t, h, w) grid."""

from __future__ import annotations

import numpy as np

from pooling_pipeline.core.shared.config import DEFAULT_MAX_IMAGE_PIXELS, ModelSpec
from pooling_pipeline.core.shared.messages import ChatTurn, MediaData
from pooling_pipeline.core.shared.options import too_long
from pooling_pipeline.workers.images import ImageError, ImageOpener

# What ST passes the processor on each call (its Transformer's text, image and common kwargs), less
# its truncation: ST cuts a row at the tokenizer's length and writes the template's tail back over its
# end (restore_suffix); the pipeline sees a row's whole length and refuses one that long instead.
PROCESSOR_KWARGS = {"text_kwargs": {"padding": True, "truncation": False}, "images_kwargs": {},
                    "videos_kwargs": {}, "common_kwargs": {"return_tensors": "pt"}}


class ChatRenderer:
    """The model's processor and its chat template, as ST calls them for one input."""

    takes_prompt = True  # (the render worker hands it the call's prompt apart from the input)

    def __init__(self, spec: ModelSpec, draft: bool = False, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        from transformers import AutoProcessor

        try:
            self.processor = AutoProcessor.from_pretrained(spec.path)
        except ImportError as e:  # (transformers 5 loads a Qwen-VL processor with its video processor)
            raise ValueError(f"{spec.path}: the model's processor cannot load here ({e}); a VLM embedder needs "
                             "torchvision installed, as sentence-transformers does") from None
        self.spec = spec
        self.template_kwargs = dict(spec.chat_template_kwargs)
        self.opener = ImageOpener(self.processor.image_processor, max_pixels)

    def features(self, messages: list[dict], prompt: str | None) -> dict:
        """The processor's output for one input's messages, the prompt's system message before them
        (an empty prompt adds none; with a system message of their own, it is a second one: ST's way)."""
        if prompt:
            messages = [{"role": "system", "content": [{"type": "text", "text": prompt}]}, *messages]
        return self.processor.apply_chat_template([messages], tokenize=True, return_dict=True, return_tensors="pt",
                                                  processor_kwargs=PROCESSOR_KWARGS, **self.template_kwargs)

    def ids(self, out: dict, max_tokens: int) -> np.ndarray:
        """The row's ids; one longer than the model takes is refused (ST would cut it at the
        tokenizer's length and write the template's tail back over its end)."""
        ids = out["input_ids"][0].numpy().astype(np.int64)
        if len(ids) > min(max_tokens, self.spec.max_model_len):
            raise ValueError(too_long("prompt", len(ids), True, min(max_tokens, self.spec.max_model_len)))
        return ids


    def image_row(self, out: dict, max_tokens: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(the ids, {"patches": [n, width] float32, "grid_thw": [images, 3] int64}) of an output with images."""
        return self.ids(out, max_tokens), {
            "patches": np.ascontiguousarray(out["pixel_values"].numpy(), dtype=np.float32),
            "grid_thw": out["image_grid_thw"].numpy().astype(np.int64)}


class VlmTexts(ChatRenderer):
    """A VLM embedder's texts (one user message of one text part each), and its inputs of several
    parts: a text and an image in one message, chat messages (workers/render.py's `_render_messages`)."""

    def render(self, text: str, max_tokens: int, long_inputs: str, truncate_left: bool,
               prompt: str | None = None) -> np.ndarray:
        return self.ids(self.features([{"role": "user", "content": [{"type": "text", "text": text}]}], prompt),
                        max_tokens)

    def render_messages(self, turns: list[ChatTurn], prompt: str | None, max_tokens: int,
                        per_side_limits: bool = False) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(ids, payloads) of chat messages: their images opened as any image input is.
        `per_side_limits`: the call set max_tokens_per_query / _doc, which a pair rendered as one
        conversation cannot honour (ST cuts the conversation as a whole)."""
        if per_side_limits:
            raise ValueError("max_tokens_per_query / max_tokens_per_doc do not apply to a chat-template reranker "
                             "(ST truncates the rendered conversation as a whole); use truncate_prompt_tokens")
        messages, images = [], 0
        for turn in turns:
            if turn.parts is None:
                messages.append({"role": turn.role, "content": turn.content})
                continue
            content = []
            for part in turn.parts:
                if part.media is None:
                    content.append({"type": "text", "text": part.text})
                else:
                    content.append({"type": "image", "image": self.opener.open(part.media)})
                    images += 1
            messages.append({"role": turn.role, "content": content})
        try:
            out = self.features(messages, prompt)
        except ImageError:
            raise
        except Exception as e:
            raise ValueError(f"the processor cannot take these messages: {type(e).__name__}: {e}") from None
        if not images:
            return self.ids(out, max_tokens), {}
        return self.image_row(out, max_tokens)


class VlmImages(ChatRenderer):
    """A VLM embedder's images: one image part each, through the processor's dynamic resolution."""

    def __init__(self, spec: ModelSpec, draft: bool = False, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        super().__init__(spec, max_pixels=max_pixels)
        tokens, payloads = self.render(MediaData(values=np.zeros(48 * 64 * 3, np.uint8), dtype="|u1", shape=[48, 64, 3]))
        image = spec.image
        width = image.channels * image.patch_size ** 2
        if payloads["patches"].shape[1] != width or int((tokens == image.image_token_id).sum()) * image.merge_size ** 2 \
                != len(payloads["patches"]):
            raise ValueError(f"{spec.path}: the processor makes {len(payloads['patches'])} patches of "
                             f"{payloads['patches'].shape[1]} values, the frontend expected {width} values and one "
                             f"image token (id {image.image_token_id}) per {image.merge_size ** 2}: this is a bug")

    def render(self, image: MediaData, prompt: str | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(its ids, {"patches": [n, width] float32, "grid_thw": [1, 3] int64})."""
        opened = self.opener.open(image)
        try:
            out = self.features([{"role": "user", "content": [{"type": "image", "image": opened}]}], prompt)
        except Exception as e:
            raise ImageError(f"the processor cannot take this image: {type(e).__name__}: {e}") from None
        return self.image_row(out, self.spec.max_model_len)
