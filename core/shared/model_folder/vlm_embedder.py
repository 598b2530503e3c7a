"""VLM embedders (Qwen3-VL-Embedding, GME and others built on Qwen2-VL / Qwen3-VL), as
sentence-transformers 6's Transformer module runs them: transformers' `Qwen2VLModel` / `Qwen3VLModel`
(AutoModel) with the model's processor, whose chat template renders every input -- a text, an image
-- as one user message (a prompt as a system message before it), with the `processing_kwargs`
saved for it (`add_generation_prompt`); the last attended token's hidden state (Pooling
"lasttoken"), then Normalize.

An image keeps its aspect ratio: the processor resizes it to a multiple of its patch grid between
its min and max pixels and cuts it into patches (its "dynamic resolution"), so its row in the engine
carries the processor's float patches and its (t, h, w) grid, and its ids one image token per merged
patch group. Read as plain JSON here; the render workers load the processor itself.
"""

from __future__ import annotations

from pathlib import Path

from pooling_pipeline.core.shared.config import ImageSpec, ModelSpec
from pooling_pipeline.core.shared.model_folder.st_files import read_json, read_optional_json
from pooling_pipeline.core.shared.model_folder.st_layout import STLayout

# Model types read here (their config's model_type), and the image processor their processor takes.
VLM_EMBEDDERS = {"qwen2_vl": ("Qwen2VLImageProcessor",), "qwen3_vl": ("Qwen2VLImageProcessor",)}
# What ST 6 saves (and derives) for such a Transformer: every modality through forward.
_FORWARD = {"method": "forward", "method_output_name": "last_hidden_state"}
EXPECTED_MODALITIES = {"text": _FORWARD, "image": _FORWARD, "video": _FORWARD,
                       "message": {**_FORWARD, "format": "structured"}}
# ... and for a multimodal reranker (transformer_task "any-to-any": the generative model's logits).
_LOGITS = {"method": "forward", "method_output_name": "logits"}
RERANKER_MODALITIES = {"text": _LOGITS, "image": _LOGITS, "video": _LOGITS, "message": {**_LOGITS, "format": "structured"}}


def is_vlm_embedder_folder(where: Path) -> bool:
    return read_optional_json(where / "config.json").get("model_type") in VLM_EMBEDDERS


def read_vlm_embedder_config(layout: STLayout, cfg: dict, where: Path, template_kwargs: dict) -> None:
    """The Transformer module's config of a VLM embedder (or none, for a plain folder: ST derives
    the same). `template_kwargs`: its processing_kwargs["chat_template"], read by the caller."""
    name = f"{where}/sentence_bert_config.json"
    task = cfg.get("transformer_task", "feature-extraction")
    if task not in ("feature-extraction", "any-to-any"):
        raise ValueError(f"{name}: transformer_task {task!r} is not supported for a Qwen-VL model (feature-extraction: "
                         "an embedder; any-to-any: a reranker)")
    reranker = task == "any-to-any"
    expected = RERANKER_MODALITIES if reranker else EXPECTED_MODALITIES
    modalities = {str(k): v for k, v in (cfg.get("modality_config") or expected).items()}
    if modalities != expected:
        raise ValueError(f"{name}: modalities {modalities} are not supported for a Qwen-VL "
                         f"{'reranker' if reranker else 'embedder'} ({expected})")
    output = "causal_logits" if reranker else "token_embeddings"
    if cfg.get("module_output_name", output) != output:
        raise ValueError(f"{name}: module_output_name {cfg['module_output_name']!r} is not supported here ({output})")
    for key in ("max_seq_length", "query_expansion", "query_length", "document_length", "model_args",
                "tokenizer_args", "config_args"):
        if cfg.get(key):  # (max_seq_length: ST cuts a row there, an image's tokens included)
            raise ValueError(f"{name}: {key} {cfg[key]!r} is not supported for a VLM embedder")
    unknown = set(template_kwargs) - {"add_generation_prompt"}
    if unknown:
        raise ValueError(f"{name}: processing_kwargs['chat_template'] keys {sorted(unknown)} are not supported for a "
                         "VLM embedder (add_generation_prompt only)")
    layout.vlm_embedder, layout.vlm_reranker = not reranker, reranker
    layout.task = task
    layout.chat_template_kwargs = dict(template_kwargs)


def _check_template(path: Path) -> None:
    """The processor's chat template (where transformers' processor finds it: chat_template.jinja,
    the legacy chat_template.json, processor_config.json, tokenizer_config.json), refused where it
    reads a `task` variable: ST passes its encode_query / encode_document task to such a template,
    which the pipeline does not yet. Its variables are read as ST reads them (transformers'
    `_get_template_variables`)."""
    from transformers.utils.chat_template_utils import _get_template_variables

    template_file = path / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else \
        read_optional_json(path / "chat_template.json").get("chat_template") or \
        read_optional_json(path / "processor_config.json").get("chat_template") or \
        read_optional_json(path / "tokenizer_config.json").get("chat_template")
    if not isinstance(template, str) or not template:
        raise ValueError(f"{str(path)!r}: a Qwen-VL model's processor without a chat template (ST renders every input "
                         "through it)")
    try:
        variables = _get_template_variables(template)
    except Exception as e:  # (a template transformers cannot parse: ST would fail on it too)
        raise ValueError(f"{str(path)!r}: its chat template cannot be parsed: {type(e).__name__}: {e}") from None
    if "task" in variables:
        raise ValueError(f"{str(path)!r}: the chat template reads a `task` variable, which sentence-transformers sets "
                         "from encode_query / encode_document; such templates are not supported yet")


def vlm_embedder_spec(st: STLayout) -> ModelSpec:
    """The spec of a VLM embedder: its text model's sizes, its image processor's patches."""
    path = st.transformer_dir
    config = read_json(path / "config.json")
    model_type = str(config.get("model_type"))
    text, vision = config.get("text_config") or {}, config.get("vision_config") or {}
    if st.pooling.modes != ["lasttoken"] or st.head_modules or st.multi_vector is not None:
        raise ValueError(f"{path}: a VLM embedder is supported with Pooling 'lasttoken' (and Normalize) after its "
                         f"Transformer, found pooling {st.pooling.modes} and {len(st.head_modules)} other modules")
    _check_template(path)
    image = qwen_image_spec(path, vision, int(config["image_token_id"]), VLM_EMBEDDERS[model_type])
    longest, hidden = _text_facts(path, text, config)
    return ModelSpec(
        path=str(path.resolve()), model_type=model_type, architectures=[str(a) for a in config.get("architectures") or []],
        hidden_size=hidden, embedding_size=hidden, vocab_size=int(text.get("vocab_size") or config.get("vocab_size")),
        max_model_len=longest, default_max_tokens=longest, pooling=st.pooling, normalize=st.normalize,
        do_lower_case=False, similarity=st.similarity, prompts=st.prompts, default_prompt_name=st.default_prompt_name,
        truncate_dim=st.truncate_dim, tasks=["embed", "score"], input_module="vlm_embedder",
        chat_template_kwargs=st.chat_template_kwargs,
        image=image)


def _text_facts(path: Path, text: dict, config: dict) -> tuple[int, int]:
    """(the longest row, the hidden size) of a Qwen-VL model's text model. ST cuts a row at the
    tokenizer's model_max_length (a composite config has no position limit it reads); the pipeline
    refuses a row past it, or past the text model's positions."""
    tokenizer = read_optional_json(path / "tokenizer_config.json")
    longest = int(tokenizer.get("model_max_length") or text.get("max_position_embeddings") or 32768)
    longest = min(longest, int(text.get("max_position_embeddings") or longest))
    return longest, int(text.get("hidden_size") or config.get("hidden_size"))


def qwen_image_spec(path: Path, vision: dict, image_token_id: int, processors: tuple[str, ...]) -> ImageSpec:
    """A Qwen-VL image processor's facts (a VLM embedder's, ColQwen2's): its patches (3 x the temporal
    patch x patch x patch values each: `channels` is 3 x the temporal patch), their merge into
    vision tokens, the most an image has (its max_pixels), rescale and normalize."""
    saved = read_optional_json(path / "processor_config.json")
    processor = saved.get("image_processor") or read_optional_json(path / "preprocessor_config.json")
    if not processor:
        raise ValueError(f"{str(path)!r}: a Qwen-VL model without an image processor config")
    name = str(processor.get("image_processor_type", processors[0])).removesuffix("Fast").removesuffix("Pil")
    if name not in processors:
        raise ValueError(f"{str(path)!r}: image processor {name!r} is not supported here ({', '.join(processors)})")
    patch = int(processor.get("patch_size", vision.get("patch_size", 14)))
    temporal = int(processor.get("temporal_patch_size", vision.get("temporal_patch_size", 2)))
    merge = int(processor.get("merge_size", vision.get("spatial_merge_size", 2)))
    size = processor.get("size") or {}
    max_pixels = int(processor.get("max_pixels") or size.get("longest_edge") or 0)
    if max_pixels <= 0:
        raise ValueError(f"{str(path)!r}: the image processor config gives no max_pixels (size.longest_edge)")
    max_patches = max_pixels // (patch * patch)  # (the processor resizes an image to at most max_pixels)
    mean, std = processor.get("image_mean", [0.5] * 3), processor.get("image_std", [0.5] * 3)
    return ImageSpec(processor_class=name, channels=3 * temporal, height=0, width=0,
                     do_rescale=bool(processor.get("do_rescale", True)),
                     rescale_factor=float(processor.get("rescale_factor", 1 / 255)),
                     do_normalize=bool(processor.get("do_normalize", True)),
                     mean=[float(v) for v in mean], std=[float(v) for v in std],
                     tokens=max_patches // (merge * merge), max_patches=max_patches, patch_size=patch,
                     merge_size=merge, image_token_id=image_token_id)


def vlm_reranker_spec(st: STLayout, score_activation: str) -> ModelSpec:
    """The spec of a multimodal reranker (Qwen3-VL-Reranker's kind): its generative VLM's logits at
    the last token, read by LogitScore (ST's CrossEncoder; `score_activation` as its predict applies)."""
    path = st.transformer_dir
    config = read_json(path / "config.json")
    model_type = str(config.get("model_type"))
    text, vision = config.get("text_config") or {}, config.get("vision_config") or {}
    if st.logit_score is None or st.head_modules or st.multi_vector is not None or st.pooling_module:
        raise ValueError(f"{path}: a multimodal reranker is supported as its Transformer (any-to-any) followed by one "
                         "LogitScore module")
    _check_template(path)
    image = qwen_image_spec(path, vision, int(config["image_token_id"]), VLM_EMBEDDERS[model_type])
    longest, hidden = _text_facts(path, text, config)
    return ModelSpec(
        path=str(path.resolve()), model_type=model_type, architectures=[str(a) for a in config.get("architectures") or []],
        hidden_size=hidden, embedding_size=1, vocab_size=int(text.get("vocab_size") or config.get("vocab_size")),
        max_model_len=longest, default_max_tokens=longest, pooling=st.pooling, normalize=False, do_lower_case=False,
        prompts=st.prompts, default_prompt_name=st.default_prompt_name, tasks=["score"], head="causal_lm",
        model_class="causal_lm", num_labels=1, score_activation=score_activation, logit_score=st.logit_score,
        input_module="vlm_reranker", chat_template_kwargs=st.chat_template_kwargs, image=image)
