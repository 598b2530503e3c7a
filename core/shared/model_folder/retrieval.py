"""Page retrievers (ColPali): transformers' `ColPaliForRetrieval` as sentence-transformers 6's
MultiVectorEncoder runs it -- a Transformer module with `transformer_task` "retrieval" (text and image
through the model's `forward`, its `embeddings`: L2-normalised, padding zeroed) and a MultiVectorMask
-- saved by ST, or a plain transformers folder (ST derives the same modules, with a default mask).

Texts are always rendered as queries by the processor (its `query_prefix`, then ten augmentation
tokens and a newline); an image is `<image>` x `image_seq_length`, `<bos>`, the `visual_prompt_prefix`
and a newline, its pixels from the processor's SiglipImageProcessor (one fixed size). Read as plain
JSON here; the render workers load the processor itself and check these facts at start-up.
"""

from __future__ import annotations

from pathlib import Path

from pooling_pipeline.core.shared.config import ImageSpec, ModelSpec, MultiVectorSpec, PoolingSpec
from pooling_pipeline.core.shared.model_folder.st_files import read_json, read_optional_json
from pooling_pipeline.core.shared.model_folder.st_layout import STLayout
from pooling_pipeline.core.shared.model_folder.vlm_embedder import qwen_image_spec

# Model types read here, and the image processor each one's processor takes.
RETRIEVERS = {"colpali": ("SiglipImageProcessor",), "colqwen2": ("Qwen2VLImageProcessor",)}
# What ST 6 saves (and derives) for these models' Transformer module.
EXPECTED_MODALITIES = {"text": {"method": "forward", "method_output_name": "embeddings"},
                       "image": {"method": "forward", "method_output_name": "embeddings"}}
GEMMA_POSITIONS = 8192  # GemmaConfig's max_position_embeddings default (rotary: a table ST never caps at)


def is_retriever_folder(where: Path) -> bool:
    return read_optional_json(where / "config.json").get("model_type") in RETRIEVERS


def read_retrieval_config(layout: STLayout, cfg: dict, where: Path) -> None:
    """The Transformer module's config of a page retriever (or none, for a plain folder)."""
    name = f"{where}/sentence_bert_config.json"
    if not is_retriever_folder(where):
        model_type = read_optional_json(where / "config.json").get("model_type")
        raise ValueError(f"{name}: transformer_task 'retrieval' on model_type {model_type!r}: only ColPali and "
                         f"ColQwen2 ({', '.join(RETRIEVERS)}) page retrievers are supported")
    modalities = cfg.get("modality_config") or EXPECTED_MODALITIES
    if {str(k): v for k, v in modalities.items()} != EXPECTED_MODALITIES:
        raise ValueError(f"{name}: modalities {modalities} are not supported for a page retriever "
                         f"(text and image through forward -> embeddings)")
    if cfg.get("module_output_name", "token_embeddings") != "token_embeddings":
        raise ValueError(f"{name}: module_output_name {cfg['module_output_name']!r} is not supported for a page "
                         "retriever (token_embeddings)")
    for key in ("query_expansion", "query_length", "document_length", "model_args", "tokenizer_args", "config_args"):
        if cfg.get(key):
            raise ValueError(f"{name}: {key} {cfg[key]!r} is not supported for a page retriever")
    if any((cfg.get("processing_kwargs") or {}).values()):
        raise ValueError(f"{name}: processing_kwargs {cfg['processing_kwargs']} are not supported")
    layout.task = "retrieval"
    if layout.multi_vector is None:  # a plain folder: ST's MultiVectorEncoder adds a default mask
        layout.multi_vector = MultiVectorSpec()


def retrieval_spec(st: STLayout) -> ModelSpec:
    """The spec of a ColPali page retriever and its mask."""
    path = st.transformer_dir
    config = read_json(path / "config.json")
    model_type = str(config.get("model_type"))
    mv = st.multi_vector
    if st.max_seq_length is not None:  # (ST would cut a query's row there, its suffix tokens first)
        raise ValueError(f"{path}: max_seq_length {st.max_seq_length} on a page retriever is not supported (its "
                         "queries are rendered whole by the processor)")
    if any(st.prompts.values()):
        raise ValueError(f"{path}: prompts {st.prompts} on a page retriever are not supported (its processor "
                         "renders a query's own prefix)")
    if mv.token_modules or st.normalize:
        raise ValueError(f"{path}: modules after a page retriever's Transformer other than its MultiVectorMask are "
                         "not supported")
    if model_type == "colqwen2":
        return _colqwen2_spec(st, config)
    vlm = config.get("vlm_config") or {}
    text, vision = vlm.get("text_config") or {}, vlm.get("vision_config") or {}
    saved = read_optional_json(path / "processor_config.json")
    image_processor = saved.get("image_processor") or read_optional_json(path / "preprocessor_config.json")
    if not image_processor:
        raise ValueError(f"{str(path)!r}: a page retriever without an image processor config")
    name = str(image_processor.get("image_processor_type", RETRIEVERS[model_type][0])).removesuffix("Fast")
    name = name.removesuffix("Pil")
    if name not in RETRIEVERS[model_type]:
        raise ValueError(f"{str(path)!r}: image processor {name!r} is not supported for {model_type}")
    size = image_processor.get("size") or {"height": 224, "width": 224}
    if not isinstance(size, dict) or "height" not in size or "width" not in size \
            or image_processor.get("do_resize") is False or image_processor.get("do_convert_rgb") is False:
        raise ValueError(f"{str(path)!r}: image processor settings {image_processor} do not give one fixed image size")
    height, width = int(size["height"]), int(size["width"])
    if (height, width) != (int(vision.get("image_size", 224)),) * 2:
        raise ValueError(f"{str(path)!r}: the image processor makes {height}x{width} images but the vision tower "
                         f"takes {vision.get('image_size', 224)}")
    mean = image_processor.get("image_mean", [0.5, 0.5, 0.5])
    std = image_processor.get("image_std", [0.5, 0.5, 0.5])
    mean = [float(mean)] * 3 if isinstance(mean, (int, float)) else [float(v) for v in mean]
    std = [float(std)] * 3 if isinstance(std, (int, float)) else [float(v) for v in std]
    seq = int(image_processor.get("image_seq_length") or (height // int(vision.get("patch_size", 14))) ** 2)
    positions = int(text.get("max_position_embeddings", GEMMA_POSITIONS))
    width_out = int(config.get("embedding_dim", 128))
    return ModelSpec(
        path=str(path.resolve()), model_type=model_type, architectures=[str(a) for a in config.get("architectures") or []],
        hidden_size=width_out, embedding_size=width_out, vocab_size=int(vlm.get("vocab_size") or text.get("vocab_size")),
        max_model_len=positions, default_max_tokens=positions, pooling=PoolingSpec(modes=["cls"]),
        normalize=False, do_lower_case=False, similarity="maxsim", prompts=st.prompts,
        default_prompt_name=st.default_prompt_name, tasks=["token_embed", "score"], routes=["query", "document"],
        default_route=None, multi_vector=mv, late_interaction=True, input_module="page_retriever",
        image=ImageSpec(processor_class=name, channels=3, height=height, width=width,
                        do_rescale=bool(image_processor.get("do_rescale", True)),
                        rescale_factor=float(image_processor.get("rescale_factor", 1 / 255)),
                        do_normalize=bool(image_processor.get("do_normalize", True)), mean=mean, std=std,
                        tokens=seq))


def _colqwen2_spec(st: STLayout, config: dict) -> ModelSpec:
    """ColQwen2: Qwen2-VL's text model and its dynamic-resolution image processor, the projection to
    `embedding_dim` values a token."""
    path, mv = st.transformer_dir, st.multi_vector
    vlm = config.get("vlm_config") or {}
    text, vision = vlm.get("text_config") or vlm, vlm.get("vision_config") or {}
    if "image_token_id" not in vlm:
        raise ValueError(f"{str(path)!r}: a ColQwen2 config without its VLM's image_token_id")
    image = qwen_image_spec(path, vision, int(vlm["image_token_id"]), RETRIEVERS["colqwen2"])
    positions = int(text.get("max_position_embeddings") or 32768)
    width = int(config.get("embedding_dim", 128))
    return ModelSpec(
        path=str(path.resolve()), model_type="colqwen2", architectures=[str(a) for a in config.get("architectures") or []],
        hidden_size=width, embedding_size=width, vocab_size=int(text.get("vocab_size") or vlm.get("vocab_size")),
        max_model_len=positions, default_max_tokens=positions, pooling=PoolingSpec(modes=["cls"]),
        normalize=False, do_lower_case=False, similarity="maxsim", prompts=st.prompts,
        default_prompt_name=st.default_prompt_name, tasks=["token_embed", "score"], routes=["query", "document"],
        default_route=None, multi_vector=mv, late_interaction=True, input_module="qwen_page_retriever", image=image)
