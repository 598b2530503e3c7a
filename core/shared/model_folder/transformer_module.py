"""The Transformer module's own sentence-transformers config (sentence_bert_config.json or its
older per-family names): max_seq_length, do_lower_case, the task, the modalities, and an LLM
reranker's chat-template settings; a key that would change the output is refused."""

from __future__ import annotations

from pathlib import Path

from pooling_pipeline.core.shared.config import ChatPairSpec
from pooling_pipeline.core.shared.model_folder.dual_encoder import FAMILIES, check_dual_encoder_modalities
from pooling_pipeline.core.shared.model_folder.multi_vector import read_multi_vector_lengths
from pooling_pipeline.core.shared.model_folder.retrieval import is_retriever_folder, read_retrieval_config
from pooling_pipeline.core.shared.model_folder.st_files import read_json, read_optional_json
from pooling_pipeline.core.shared.model_folder.st_layout import STLayout
from pooling_pipeline.core.shared.model_folder.vlm_embedder import is_vlm_embedder_folder, read_vlm_embedder_config

# sentence_bert_config.json keys that do not change the output of a text model.
_HARMLESS_TRANSFORMER_KEYS = {"max_seq_length", "do_lower_case", "transformer_task", "modality_config",
                              "module_output_name", "model_args", "tokenizer_args", "config_args", "cache_dir",
                              "backend", "unpad_inputs", "query_length", "document_length", "query_expansion",
                              "processing_kwargs"}
# Older ST saved the Transformer's config under a per-family name; the first one found is used.
ST_TRANSFORMER_CONFIGS = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                          "sentence_camembert_config.json", "sentence_albert_config.json",
                          "sentence_xlm-roberta_config.json", "sentence_xlnet_config.json")


def read_transformer_config(layout: STLayout, where: Path, legacy_clip: bool = False) -> None:
    """The Transformer module's sentence_bert_config.json: max_seq_length, do_lower_case and the
    task; a key that would change the output is refused. A dual encoder (CLIP, SigLIP) is one
    whose config names an image modality, a legacy CLIPModel module (`legacy_clip`), or a plain
    folder of such a family without ST's files: ST derives the same configuration for all three."""
    cfg = next((read_json(where / name) for name in ST_TRANSFORMER_CONFIGS if (where / name).is_file()), {})
    unknown = set(cfg) - _HARMLESS_TRANSFORMER_KEYS
    if unknown:
        raise ValueError(f"{where}/sentence_bert_config.json: keys {sorted(unknown)} are not supported")
    if isinstance(cfg.get("max_seq_length"), int):
        layout.max_seq_length = cfg["max_seq_length"]
    layout.do_lower_case = bool(cfg.get("do_lower_case", False))
    layout.task = _transformer_task(cfg, where) or layout.task
    if layout.task == "retrieval" or (not cfg and is_retriever_folder(where)):  # a ColPali page retriever
        read_retrieval_config(layout, cfg, where)
        return
    if is_vlm_embedder_folder(where):  # Qwen2-VL, Qwen3-VL: every input chat messages (an embedder, a reranker)
        template_kwargs, _ = _chat_template_kwargs(cfg.get("processing_kwargs") or {}, f"{where}/sentence_bert_config.json")
        read_vlm_embedder_config(layout, cfg, where, template_kwargs)
        return
    if layout.task == "text-generation":  # an LLM reranker: its own modalities and chat-template kwargs
        _read_causal_lm_config(layout, cfg, where)
        return
    if legacy_clip or set(cfg.get("modality_config") or {}) - {"text"} or _plain_dual_encoder(cfg, where):
        if cfg.get("modality_config"):
            check_dual_encoder_modalities(cfg, where)
        _check_no_extra_arguments(cfg, where)
        layout.dual_encoder = True
        layout.pooling_module = True  # its output is the sentence embedding already
        return
    _check_text_modality(cfg, where)
    if layout.multi_vector is not None:
        cfg = read_multi_vector_lengths(layout.multi_vector, cfg, where)
    _check_no_extra_arguments(cfg, where)


def _plain_dual_encoder(cfg: dict, where: Path) -> bool:
    """A dual encoder's folder without a saved modality configuration (ST derives one)."""
    return not cfg.get("modality_config") and \
        read_optional_json(where / "config.json").get("model_type") in FAMILIES


def _transformer_task(cfg: dict, where: Path) -> str | None:
    task = cfg.get("transformer_task")
    if task is not None and task not in ("feature-extraction", "sequence-classification", "fill-mask",
                                         "text-generation", "retrieval", "any-to-any"):
        raise ValueError(f"{where}/sentence_bert_config.json: transformer_task {task!r} is not supported")
    return task


def _check_text_modality(cfg: dict, where: Path) -> None:
    modalities = cfg.get("modality_config") or {}
    if set(modalities) - {"text"}:
        # "message": ST would render every text through the chat template and make the prompt a
        # system message; other modalities are not text at all.
        raise ValueError(f"{where}/sentence_bert_config.json: modalities {sorted(set(modalities) - {'text'})} are "
                         "not supported (text only)")
    text = modalities.get("text")
    if text is not None and (text.get("method", "forward") != "forward"
                             or text.get("method_output_name") not in (None, "last_hidden_state", "logits")):
        raise ValueError(f"{where}/sentence_bert_config.json: text modality {text} is not supported")


def _check_no_extra_arguments(cfg: dict, where: Path) -> None:
    if cfg.get("query_expansion") or cfg.get("query_length") or cfg.get("document_length"):
        raise ValueError(f"{where}/sentence_bert_config.json: query expansion / fixed query or document "
                         "lengths (multi-vector models) are not supported")
    processing = cfg.get("processing_kwargs") or {}
    if any(processing.get(k) for k in processing):
        raise ValueError(f"{where}/sentence_bert_config.json: processing_kwargs {processing} are not supported")
    if cfg.get("model_args") or cfg.get("tokenizer_args") or cfg.get("config_args"):
        raise ValueError(f"{where}/sentence_bert_config.json: model_args / tokenizer_args / config_args "
                         f"{ {k: cfg[k] for k in ('model_args', 'tokenizer_args', 'config_args') if cfg.get(k)} } "
                         "are not supported")


# processing_kwargs["chat_template"] keys that size or pad the tokenization, not the template's text.
_SIZE_KWARGS = {"padding", "truncation", "max_length", "return_tensors"}


def _read_causal_lm_config(layout: STLayout, cfg: dict, where: Path) -> None:
    """A text-generation Transformer (LLM reranker): its logits at the last position feed LogitScore.
    With a "message" modality, ST renders each pair through the chat template (`ChatPairSpec`);
    with "text" only, the pair is tokenized as a tokenizer text pair, like any cross-encoder."""
    name = f"{where}/sentence_bert_config.json"
    _check_no_extra_arguments({k: v for k, v in cfg.items() if k != "processing_kwargs"}, where)
    modalities = cfg.get("modality_config") or {"text": {"method": "forward", "method_output_name": "logits"}}
    if set(modalities) - {"text", "message"}:
        raise ValueError(f"{name}: modalities {sorted(set(modalities) - {'text', 'message'})} are not supported "
                         "for a text-generation Transformer (text and message only)")
    for key, params in modalities.items():
        if not isinstance(params, dict) or params.get("method", "forward") != "forward" \
                or params.get("method_output_name", "logits") != "logits":
            raise ValueError(f"{name}: {key} modality {params} is not supported (forward -> logits only)")
    if cfg.get("module_output_name", "causal_logits") != "causal_logits":
        raise ValueError(f"{name}: module_output_name {cfg['module_output_name']!r} is not supported "
                         "(causal_logits only)")
    template_kwargs, restore_suffix = _chat_template_kwargs(cfg.get("processing_kwargs") or {}, name)
    if "message" in modalities:
        message_format = modalities["message"].get("format", "auto")
        if message_format not in ("flat", "structured"):
            raise ValueError(f"{name}: message format {message_format!r} is not supported (flat or structured; "
                             "ST 6 saves the one it inferred)")
        _check_chat_template(where)
        layout.chat_pairs = ChatPairSpec(message_format=message_format, template_kwargs=template_kwargs,
                                         restore_suffix=restore_suffix)


def _chat_template_kwargs(processing: dict, name: str) -> tuple[dict, bool]:
    """processing_kwargs of an LLM reranker: only `chat_template` (the template's variables, and
    ST's restore_suffix flag) is honoured; anything that changes tokenization is refused."""
    if not isinstance(processing, dict) or set(processing) - {"chat_template"}:
        raise ValueError(f"{name}: processing_kwargs {processing} are not supported (only chat_template)")
    kwargs = dict(processing.get("chat_template") or {})
    restore_suffix = kwargs.pop("restore_suffix", True)
    if not isinstance(restore_suffix, bool) or _SIZE_KWARGS & set(kwargs) \
            or not all(v is None or isinstance(v, (bool, int, float, str)) for v in kwargs.values()):
        raise ValueError(f"{name}: processing_kwargs chat_template {processing.get('chat_template')} is not "
                         "supported (template variables of plain values and restore_suffix only)")
    return kwargs, restore_suffix


def _check_chat_template(where: Path) -> None:
    """The tokenizer's one chat template: chat_template.jinja or a string in tokenizer_config.json."""
    if (where / "chat_template.jinja").is_file():
        return
    template = read_optional_json(where / "tokenizer_config.json").get("chat_template")
    if not isinstance(template, str) or not template:
        raise ValueError(f"{where}: the Transformer has a message modality but the tokenizer has no single chat "
                         "template (chat_template.jinja or a string chat_template in tokenizer_config.json)")
