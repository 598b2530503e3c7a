"""The `ModelSpec` of one chain of modules: what the sentence-transformers layout says
(`STLayout`) joined with the transformer's config.json, each helper below deciding one thing
(the head, the tasks, the class the engine loads, the embedding size, ...)."""

from __future__ import annotations

from pathlib import Path

from pooling_pipeline.core.shared.config import ENCODER_ONLY_CLASSES, ModelSpec, PoolingSpec
from pooling_pipeline.core.shared.model_folder.dual_encoder import dual_encoder_spec
from pooling_pipeline.core.shared.model_folder.multi_vector import with_multi_vector
from pooling_pipeline.core.shared.model_folder.peft_adapter import adapter_files, read_adapter
from pooling_pipeline.core.shared.model_folder.retrieval import retrieval_spec
from pooling_pipeline.core.shared.model_folder.st_files import dense_chain_width, read_json
from pooling_pipeline.core.shared.model_folder.st_layout import STLayout
from pooling_pipeline.core.shared.model_folder.static_embedding import STATIC_MAX_TOKENS, static_folder_facts
from pooling_pipeline.core.shared.model_folder.transformer_config import (
    check_encoder_only,
    check_remote_code,
    check_text_model,
    model_lengths,
    padding_rules,
    transformer_config,
    widths,
)
from pooling_pipeline.core.shared.model_folder.vlm_embedder import vlm_embedder_spec, vlm_reranker_spec

# Cross-encoder activations by ST's saved class path.
SCORE_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Softmax": "softmax", "Tanh": "tanh"}


def spec_of_layout(root: Path, st: STLayout, trust_remote_code: bool) -> ModelSpec:
    """The spec of one chain of modules: a Transformer (or a StaticEmbedding) and what runs after it."""
    if st.static_dir is not None:
        return _static_spec(st)
    if st.task == "retrieval":  # a ColPali page retriever (core/shared/model_folder/retrieval.py)
        return retrieval_spec(st)
    if st.vlm_embedder:  # core/shared/model_folder/vlm_embedder.py
        return vlm_embedder_spec(st)
    if st.vlm_reranker:
        config = read_json(st.transformer_dir / "config.json")
        return vlm_reranker_spec(st, _score_activation(st.score_activation, config, 1, trust_remote_code))
    if st.dual_encoder:
        if adapter_files(st.transformer_dir):  # (ST would load it; the image tower's conversion has no merge)
            raise ValueError(f"{st.transformer_dir}: a PEFT adapter ({', '.join(adapter_files(st.transformer_dir))}) "
                             "on a dual encoder (CLIP, SigLIP) is not supported")
        return dual_encoder_spec(st)
    path = st.transformer_dir
    adapter = read_adapter(path)
    config = transformer_config(path, Path(adapter.base_path) if adapter is not None else None)
    model_type = str(config.get("model_type", ""))
    check_remote_code(config, model_type, path, trust_remote_code)
    check_text_model(config, model_type, path)
    hidden_size, vocab_size = widths(config, model_type, path)
    check_encoder_only(config, model_type)
    lengths = model_lengths(st.max_seq_length, config, model_type, path)
    architectures = [str(a) for a in config.get("architectures") or []]
    head = _head(st.task, architectures)
    num_labels = 1 if head == "causal_lm" else _num_labels(config)  # ST: a LogitScore gives one score
    late_interaction = _late_interaction(config, architectures)
    _check_masked_lm_is_sparse(st, root)
    _check_causal_reranker(st, config, root)
    spec = ModelSpec(
        path=str(path.resolve()),
        model_type=model_type,
        architectures=architectures,
        hidden_size=hidden_size,
        embedding_size=_embedding_size(hidden_size, st),
        vocab_size=vocab_size,
        max_model_len=lengths.max_model_len,
        default_max_tokens=lengths.default_max_tokens,
        whole_text=lengths.whole_text,
        pooling=st.pooling,
        head_modules=st.head_modules,
        # Late-interaction (ColBERT) token vectors are compared normalized: part of the model.
        normalize=st.normalize or late_interaction,
        do_lower_case=st.do_lower_case,
        model_class=_model_class(st, head, model_type),
        head=head,
        num_labels=num_labels if head != "none" else 0,
        multi_label=config.get("problem_type") == "multi_label_classification",
        score_activation=_score_activation(st.score_activation, config, num_labels, trust_remote_code),
        late_interaction=late_interaction,
        sparse=st.sparse,
        similarity=st.similarity,
        truncate_dim=st.truncate_dim,
        max_active_dims=st.max_active_dims,
        prompts=st.prompts,
        default_prompt_name=st.default_prompt_name,
        matryoshka_dimensions=_matryoshka_dimensions(config),
        tasks=_tasks(st, head, num_labels),
        trust_remote_code=trust_remote_code,
        logit_score=st.logit_score,
        chat_pairs=st.chat_pairs,
        adapter=adapter,
        **padding_rules(config, model_type, path),
    )
    return with_multi_vector(spec, st, path)


def _static_spec(st: STLayout) -> ModelSpec:
    """ST's StaticEmbedding and the modules after it (Dense, LayerNorm, Normalize): the engine takes
    the mean of each text's token vectors (see static_embedding.py for what is read)."""
    rows, width, kept, truncate_left = static_folder_facts(st.static_dir)
    max_tokens = kept or STATIC_MAX_TOKENS
    return ModelSpec(
        path=str(st.static_dir.resolve()), model_type="static_embedding", architectures=["StaticEmbedding"],
        hidden_size=width, embedding_size=_embedding_size(width, st), vocab_size=rows, max_model_len=max_tokens,
        default_max_tokens=max_tokens, pooling=PoolingSpec(modes=["mean"]), head_modules=st.head_modules,
        normalize=st.normalize, do_lower_case=False, similarity=st.similarity, truncate_dim=st.truncate_dim,
        prompts=st.prompts, default_prompt_name=st.default_prompt_name, tasks=["embed", "score"],
        input_module="static_embedding", add_special_tokens=False, static_truncate_left=truncate_left)


def _head(st_task: str, architectures: list[str]) -> str:
    """What the transformer ends in: hidden states ("none"), a classification head, or a causal
    LM's logits read by LogitScore ("causal_lm")."""
    if st_task == "text-generation":
        return "causal_lm"
    if st_task == "sequence-classification" or any(a.endswith("ForSequenceClassification") for a in architectures):
        return "sequence_classification"
    if any(a.endswith("ForTokenClassification") for a in architectures):
        return "token_classification"
    return "none"


def _num_labels(config: dict) -> int:
    id2label = config.get("id2label")
    return len(id2label) if isinstance(id2label, dict) and id2label else int(config.get("num_labels") or 2)


def _late_interaction(config: dict, architectures: list[str]) -> bool:
    return bool(config.get("late_interaction")) or any("colbert" in a.lower() for a in architectures)


def _tasks(st: STLayout, head: str, num_labels: int) -> list[str]:
    if head == "causal_lm":  # an LLM reranker scores pairs; it has no embeddings or classes to give
        return ["score"]
    if st.sparse is not None:
        return ["sparse_embed"]
    if head == "sequence_classification":
        return ["classify", "score"] if num_labels == 1 else ["classify"]
    if head == "token_classification":
        return ["token_classify"]
    return ["embed", "token_embed", "score"]


def _model_class(st: STLayout, head: str, model_type: str) -> str:
    """Which transformers class the engine loads (see ModelSpec.model_class)."""
    if st.sparse is not None:
        return "masked_lm"
    if head == "causal_lm":
        return "causal_lm"
    if head == "none" and model_type in ENCODER_ONLY_CLASSES:
        return "encoder_only"
    return "auto"


def _check_masked_lm_is_sparse(st: STLayout, root: Path) -> None:
    if st.task == "fill-mask" and st.sparse is None:
        raise ValueError(f"{str(root)!r}: a masked-LM transformer without SpladePooling is not supported")


# Causal-LM config keys that change the logits after lm_head (Gemma 2/3 softcapping, Cohere and
# Granite scaling): the engine computes lm_head rows only, so such a family is refused.
LOGIT_TRANSFORM_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _check_causal_reranker(st: STLayout, config: dict, root: Path) -> None:
    """A text-generation Transformer is an LLM reranker: exactly Transformer + LogitScore."""
    if st.task != "text-generation" and st.logit_score is None:
        return
    if st.task != "text-generation":
        raise ValueError(f"{root}/modules.json: a LogitScore module needs a Transformer with transformer_task "
                         f"'text-generation' (found {st.task!r})")
    if st.logit_score is None:
        raise ValueError(f"{root}: a Transformer with transformer_task 'text-generation' is supported only as an "
                         "LLM reranker followed by a LogitScore module (modules.json has none)")
    if st.pooling_module or st.head_modules or st.normalize or st.sparse is not None:
        raise ValueError(f"{root}/modules.json: modules besides Transformer + LogitScore on a causal LM are not "
                         "supported")
    for key in LOGIT_TRANSFORM_KEYS:
        if config.get(key) not in (None, 1, 1.0):
            raise ValueError(f"{root}: config.json {key}={config[key]!r} transforms the causal LM's logits, which "
                             "LogitScore reads; this family is not supported as an LLM reranker")


def _matryoshka_dimensions(config: dict) -> list[int] | None:
    dims = config.get("matryoshka_dimensions")
    return [int(d) for d in dims] if isinstance(dims, list) and dims else None


def _score_activation(saved: str | None, config: dict, num_labels: int, trust_remote_code: bool) -> str:
    """The activation ST's CrossEncoder.predict applies: `activation_fn` in
    config_sentence_transformers.json (ST 6), else in config.json (`sentence_transformers.activation_fn`
    from ST 4-5, `sbert_ce_default_activation_function` before), else Sigmoid for one label and
    Identity for more. An activation outside torch is ST's default too unless code is trusted."""
    saved = saved or (config.get("sentence_transformers") or {}).get("activation_fn") \
        or config.get("sbert_ce_default_activation_function")
    default = "sigmoid" if num_labels == 1 else "identity"
    if not saved:
        return default
    name = str(saved).rsplit(".", 1)[-1]
    if str(saved).startswith("torch.") and name in SCORE_ACTIVATIONS:
        return SCORE_ACTIVATIONS[name]
    if not str(saved).startswith("torch.") and not trust_remote_code:
        return default
    raise ValueError(f"the cross-encoder's activation {saved!r} is not supported (supported: torch.nn "
                     f"{sorted(SCORE_ACTIVATIONS)})")


def _embedding_size(hidden_size: int, st: STLayout) -> int:
    return dense_chain_width(hidden_size * len(st.pooling.modes), st.head_modules)
