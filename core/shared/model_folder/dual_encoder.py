"""Dual encoders (CLIP; SigLIP with a fixed image size; SigLIP2 with its NaFlex processor, whose images
keep their aspect ratio in a variable number of patches; CLAP, whose second tower takes audio): a
text tower and an image or audio tower that end in one embedding space, as sentence-transformers 6
runs them -- its `Transformer` module with the modality configuration it derives for these classes
(text: `get_text_features`, image: `get_image_features`, audio: `get_audio_features`, each's
`pooler_output`), or the legacy `CLIPModel` module of older `clip-ViT-*` saves -- followed by
whatever modules the model saves (Dense, LayerNorm, Normalize).

Read as plain JSON, like the rest of the folder: the families' defaults below stand in for a key a
config leaves out (transformers writes only what differs). The image processor's facts decide the
shape the render workers send; the workers load the processor itself and check those facts at
start-up. Anything else that carries images is refused here, naming it.
"""

from __future__ import annotations

from pathlib import Path

from pooling_pipeline.core.shared.config import AudioSpec, ImageSpec, ModelSpec, PoolingSpec
from pooling_pipeline.core.shared.model_folder.st_files import dense_chain_width, read_json, read_optional_json
from pooling_pipeline.core.shared.model_folder.st_layout import STLayout
from pooling_pipeline.core.shared.model_folder.transformer_config import model_lengths

# The configuration ST 6 derives for these classes (and the legacy CLIPModel module's): each
# modality's method, and its output's `pooler_output` (None where transformers returned a tensor).
EXPECTED_MODALITIES = {"text": "get_text_features", "image": "get_image_features"}
AUDIO_MODALITIES = {"text": "get_text_features", "audio": "get_audio_features"}

# Per family: the text and vision configs' defaults for what is read (transformers' own defaults),
# whether the vision sequence has a class token, and the image processors that reproduce ST here.
FAMILIES = {
    "clip": {"text": {"vocab_size": 49408, "max_position_embeddings": 77, "hidden_size": 512},
             "vision": {"image_size": 224, "patch_size": 32, "hidden_size": 768},
             "projection_dim": 512, "class_token": True, "processors": ("CLIPImageProcessor",)},
    "siglip": {"text": {"vocab_size": 32000, "max_position_embeddings": 64, "hidden_size": 768},
               "vision": {"image_size": 224, "patch_size": 16, "hidden_size": 768},
               "projection_dim": None, "class_token": False, "processors": ("SiglipImageProcessor",)},
    "siglip2": {"text": {"vocab_size": 256000, "max_position_embeddings": 64, "hidden_size": 768},
                "vision": {"patch_size": 16, "hidden_size": 768, "num_patches": 256},
                "projection_dim": None, "class_token": False, "processors": ("Siglip2ImageProcessor",),
                "naflex": True},
    # CLAP: a RoBERTa text tower (its position table reserves pad_token_id + 1 slots) and an HTS-AT
    # audio tower over the feature extractor's log-mel features.
    "clap": {"text": {"vocab_size": 50265, "max_position_embeddings": 514, "hidden_size": 768, "pad_token_id": 1},
             "audio": {"spec_size": 256, "num_mel_bins": 64, "patch_stride": [4, 4], "enable_fusion": False},
             "projection_dim": 512, "text_model_type": "roberta", "feature_extractors": ("ClapFeatureExtractor",),
             "modalities": AUDIO_MODALITIES},
}
# ClapFeatureExtractor's class defaults (transformers 5), for a key its saved config leaves out.
FEATURE_EXTRACTOR_DEFAULTS = {"ClapFeatureExtractor": {"sampling_rate": 48000, "hop_length": 480, "max_length_s": 10,
                                                       "feature_size": 64, "truncation": "fusion",
                                                       "padding": "repeatpad"}}
# What a processor passes its image processor on every call, whatever the image processor's saved
# settings say (its class's `images_kwargs`: a call's kwargs override the saved ones, transformers'
# ProcessorMixin._merge_kwargs; ST calls the processor). Siglip2Processor's, in transformers 5.
PROCESSOR_CALL = {"Siglip2ImageProcessor": {"max_num_patches": 256, "patch_size": 16}}
# What each processor class does when its saved config says nothing (transformers' class defaults).
PROCESSOR_DEFAULTS = {
    "CLIPImageProcessor": {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224},
                           "do_center_crop": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                           "image_std": [0.26862954, 0.26130258, 0.27577711]},
    "SiglipImageProcessor": {"size": {"height": 224, "width": 224}, "do_center_crop": False,
                             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    "Siglip2ImageProcessor": {"max_num_patches": 256, "patch_size": 16, "image_mean": [0.5, 0.5, 0.5],
                              "image_std": [0.5, 0.5, 0.5]},
}
REFUSED = ("page retrievers other than ColPali and ColQwen2, multimodal rerankers, fused image+text inputs to a dual "
           "encoder and video are not supported; image and audio models supported: CLIP, SigLIP and SigLIP2 dual "
           "encoders, CLAP, ColPali, ColQwen2, Qwen2-VL / Qwen3-VL embedders")


def check_dual_encoder_modalities(cfg: dict, where: Path) -> None:
    """A Transformer module whose saved modality configuration has more than text: accepted only as
    ST derives it for a dual encoder (text and image, or text and audio for CLAP, each through its
    get_*_features)."""
    modalities = cfg.get("modality_config") or {}
    name = f"{where}/sentence_bert_config.json"
    expected = AUDIO_MODALITIES if "audio" in modalities else EXPECTED_MODALITIES
    if set(modalities) != set(expected):
        raise ValueError(f"{name}: modalities {sorted(map(str, modalities))}: {REFUSED}")
    for modality, method in expected.items():
        params = modalities[modality]
        if not isinstance(params, dict) or params.get("method") != method \
                or params.get("method_output_name") not in ("pooler_output", None):
            raise ValueError(f"{name}: {modality} modality {params} is not supported ({method} -> pooler_output)")
    if cfg.get("module_output_name", "sentence_embedding") != "sentence_embedding":
        raise ValueError(f"{name}: module_output_name {cfg['module_output_name']!r} is not supported for a dual "
                         "encoder (sentence_embedding)")


def dual_encoder_spec(st: STLayout) -> ModelSpec:
    """The spec of a dual encoder and the modules after it."""
    path = st.transformer_dir
    config = read_json(path / "config.json")
    model_type = str(config.get("model_type", ""))
    family = FAMILIES.get(model_type)
    if family is None:
        architectures = ", ".join(map(str, config.get("architectures") or [])) or "unknown architecture"
        raise ValueError(f"{str(path)!r} holds {architectures} (model_type {model_type!r}) with an image modality: "
                         f"{REFUSED}")
    text = {**family["text"], **(config.get("text_config") or {})}
    width = config.get("projection_dim", family["projection_dim"]) if family["projection_dim"] else \
        text.get("projection_size") or text["hidden_size"]
    text_type = family.get("text_model_type", f"{model_type}_text_model")
    max_model_len, default_max_tokens, _ = model_lengths(st.max_seq_length, text, text_type, path)
    if "audio" in family:
        audio = _audio_spec(path, family, {**family["audio"], **(config.get("audio_config") or {})})
        input_module, image = "clap", None
    else:
        vision = {**family["vision"], **(config.get("vision_config") or {})}
        input_module = "naflex_dual_encoder" if family.get("naflex") else "dual_encoder"
        audio, image = None, _image_spec(path, family, vision)
    return ModelSpec(
        path=str(path.resolve()), model_type=model_type, architectures=[str(a) for a in config.get("architectures") or []],
        hidden_size=int(width), embedding_size=dense_chain_width(int(width), st.head_modules),
        vocab_size=int(text["vocab_size"]), max_model_len=max_model_len, default_max_tokens=default_max_tokens,
        pooling=PoolingSpec(modes=["cls"]), head_modules=st.head_modules, normalize=st.normalize,
        do_lower_case=st.do_lower_case, similarity=st.similarity, truncate_dim=st.truncate_dim,
        prompts=st.prompts, default_prompt_name=st.default_prompt_name, tasks=["embed", "score"],
        input_module=input_module, image=image, audio=audio)


def _audio_spec(path: Path, family: dict, audio: dict) -> AudioSpec:
    """What the model's feature extractor makes of a clip, from its saved config."""
    saved = read_optional_json(path / "processor_config.json").get("feature_extractor") \
        or read_optional_json(path / "preprocessor_config.json")
    if not saved:
        raise ValueError(f"{str(path)!r}: an audio model without a feature extractor config "
                         "(processor_config.json or preprocessor_config.json)")
    name = str(saved.get("feature_extractor_type", family["feature_extractors"][0]))
    if name not in family["feature_extractors"]:
        raise ValueError(f"{str(path)!r}: feature extractor {name!r} is not supported for this model (supported: "
                         f"{', '.join(family['feature_extractors'])})")
    facts = {**FEATURE_EXTRACTOR_DEFAULTS[name], **saved}
    if audio.get("enable_fusion"):
        raise ValueError(f"{str(path)!r}: a CLAP model with enable_fusion=True is not supported: its feature extractor "
                         "marks a random clip of every batch as a long one (truncation 'fusion'), so "
                         "sentence-transformers' vectors for a clip change from call to call")
    if facts["truncation"] != "rand_trunc":  # ("fusion": four mel channels, a random clip marked long)
        raise ValueError(f"{str(path)!r}: feature extractor truncation {facts['truncation']!r} is not supported (a "
                         "CLAP without fusion: 'rand_trunc'); with 'fusion' sentence-transformers marks a random clip "
                         "of every batch as a long one, so its vectors are not reproducible")
    rate, hop = int(facts["sampling_rate"]), int(facts["hop_length"])
    most = int(facts.get("nb_max_samples") or facts["max_length_s"] * rate)
    mel_bins = int(facts["feature_size"])
    if mel_bins != int(audio["num_mel_bins"]):
        raise ValueError(f"{str(path)!r}: the feature extractor makes {mel_bins} mel bins but the audio tower takes "
                         f"{audio['num_mel_bins']}")
    stride = audio["patch_stride"]
    stride = (stride, stride) if isinstance(stride, int) else tuple(stride)
    spec_size = int(audio["spec_size"])
    return AudioSpec(feature_extractor_class=name, sampling_rate=rate, max_samples=most, channels=1,
                     frames=most // hop + 1, mel_bins=mel_bins, truncation=str(facts["truncation"]),
                     tokens=(spec_size // int(stride[0])) * (spec_size // int(stride[1])))


def _image_spec(path: Path, family: dict, vision: dict) -> ImageSpec:
    """What the model's image processor makes of an image, from its saved config."""
    saved = read_optional_json(path / "processor_config.json").get("image_processor") \
        or read_optional_json(path / "preprocessor_config.json")
    if not saved:
        raise ValueError(f"{str(path)!r}: a dual encoder without an image processor config "
                         "(processor_config.json or preprocessor_config.json)")
    name = processor_class_name(saved, family)
    if name not in family["processors"]:
        raise ValueError(f"{str(path)!r}: image processor {name!r} is not supported for this model (supported: "
                         f"{', '.join(family['processors'])})")
    facts = {**PROCESSOR_DEFAULTS[name], **_standard_sizes(saved)}
    mean, std = facts["image_mean"], facts["image_std"]
    mean = [float(mean)] * 3 if isinstance(mean, (int, float)) else [float(v) for v in mean]
    std = [float(std)] * 3 if isinstance(std, (int, float)) else [float(v) for v in std]
    rescale = {"do_rescale": bool(facts.get("do_rescale", True)), "rescale_factor": float(facts.get("rescale_factor", 1 / 255)),
               "do_normalize": bool(facts.get("do_normalize", True)), "mean": mean, "std": std}
    if family.get("naflex"):
        facts.update(PROCESSOR_CALL[name])
        patch, most = int(facts["patch_size"]), int(facts["max_num_patches"])
        if patch != int(vision["patch_size"]):
            raise ValueError(f"{str(path)!r}: the processor cuts {patch} px patches but the vision tower takes "
                             f"{vision['patch_size']} px ones")
        if facts.get("do_resize") is False:
            raise ValueError(f"{str(path)!r}: image processor settings (do_resize=False) are not supported")
        return ImageSpec(processor_class=name, channels=3, height=0, width=0, tokens=most, max_patches=most,
                         patch_size=patch, **rescale)
    if facts.get("do_center_crop"):
        shape = facts["crop_size"]
    elif facts.get("do_resize", True) and "height" in facts["size"] and "width" in facts["size"]:
        shape = facts["size"]
    else:
        raise ValueError(f"{str(path)!r}: image processor settings {saved} do not give one fixed image size")
    if facts.get("do_pad") or facts.get("do_convert_rgb") is False:
        raise ValueError(f"{str(path)!r}: image processor settings (do_pad / do_convert_rgb=False) are not supported")
    height, width = int(shape["height"]), int(shape["width"])
    patch = int(vision["patch_size"])
    if height != int(vision["image_size"]) or width != int(vision["image_size"]):
        raise ValueError(f"{str(path)!r}: the image processor makes {height}x{width} images but the vision tower "
                         f"takes {vision['image_size']}x{vision['image_size']}")
    return ImageSpec(processor_class=name, channels=3, height=height, width=width,
                     tokens=(height // patch) * (width // patch) + (1 if family["class_token"] else 0), **rescale)


def processor_class_name(saved: dict, family: dict) -> str:
    """The image processor's class as transformers' AutoImageProcessor resolves it from the saved
    config, without its backend suffix ("Pil" or, before transformers 5, "Fast"): the config's
    `image_processor_type`, else its 2021-era `feature_extractor_type` ("CLIPFeatureExtractor" is
    CLIPImageProcessor), else the family's own. Which backend runs it -- PIL, or torchvision where
    that is installed -- is transformers' choice in the render workers, as it is in ST's process."""
    declared = saved.get("image_processor_type")
    if declared is None and saved.get("feature_extractor_type") is not None:
        declared = str(saved["feature_extractor_type"]).replace("FeatureExtractor", "ImageProcessor")
    if declared is None:
        return family["processors"][0]
    return str(declared).removesuffix("Fast").removesuffix("Pil")


def _standard_sizes(saved: dict) -> dict:
    """`size` and `crop_size` in the form transformers' processors standardize them to (its
    `get_size_dict`, as these classes call it): an int `size` is the shortest edge, a (height,
    width) pair or an int `crop_size` the exact size. Older configs saved the ints."""
    facts = dict(saved)
    for key, square in (("size", False), ("crop_size", True)):
        value = facts.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            facts[key] = {"height": value, "width": value} if square else {"shortest_edge": value}
        elif isinstance(value, (list, tuple)) and len(value) == 2:
            facts[key] = {"height": value[0], "width": value[1]}
        elif value is not None and not isinstance(value, dict):
            raise ValueError(f"image processor {key} {value!r} is not a size transformers reads")
    return facts
