"""MTEB 2's encoder protocol on a SentenceEncoder: `mteb.evaluate(encoder, tasks)` takes the
encoder as it is (MTEB recognises a model by its `mteb_model_meta`).

MTEB hands `encode` a DataLoader of batches and the task it runs; its own sentence-transformers
wrapper (mteb.models.SentenceTransformerEncoderWrapper) then chooses a prompt from the model's
`prompts` by MTEB's priorities (task name + prompt type, task name, task type + prompt type, task
type, prompt type), picks encode_query / encode_document / encode by the prompt type, and encodes
all the task's texts in one call. This module does exactly that, with MTEB's own functions for the
choice, so a SentenceEncoder scores what the same model scores under sentence-transformers -- and
the texts reach the pipeline as one large call (the engine batches them), not one batch at a time.

MTEB is imported only here, when MTEB calls: it is MTEB's own dependency, not this package's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class SentenceEncoder(Protocol):
    """What this module asks of the encoder MTEB hands back (integrations/sentence_encoder.py's
    SentenceEncoder, which calls into this module: a protocol here, not an import, keeps the two
    modules from importing each other)."""

    model_card_data: Any
    similarity_fn_name: str
    prompts: dict[str, str]

    def get_max_seq_length(self) -> int | None: ...

    def get_embedding_dimension(self) -> int | None: ...

    def encode(self, sentences: Any, **kwargs: Any) -> Any: ...

    def encode_query(self, sentences: Any, **kwargs: Any) -> Any: ...

    def encode_document(self, sentences: Any, **kwargs: Any) -> Any: ...

# What MTEB passes with the DataLoader (besides its EncodeKwargs: batch_size, show_progress_bar,
# precision, which encode takes as sentence-transformers does).
PROTOCOL_KEYWORDS = ("task_metadata", "hf_split", "hf_subset", "prompt_type")
NON_TEXT_FEATURES = ("image", "audio", "video")


def model_meta(encoder: SentenceEncoder):
    """The ModelMeta MTEB's wrapper derives from a SentenceTransformer, from what the folder says:
    name (a hub id, when the model was named by one; None for a local folder, as sentence-
    transformers gives for one), width, kept tokens, similarity function, text only."""
    from mteb.models import ModelMeta

    model_id = encoder.model_card_data.model_id
    name = model_id if model_id and "/" in model_id and not Path(model_id).exists() else None
    return ModelMeta.create_empty(overwrites=dict(
        name=name, revision=None, max_tokens=encoder.get_max_seq_length(),
        embed_dim=encoder.get_embedding_dimension(), similarity_fn_name=encoder.similarity_fn_name,
        framework=["PyTorch"], modalities=["text"]))


def encode_for_mteb(encoder: SentenceEncoder, inputs: Any, *, task_metadata: Any, prompt_type: Any = None,
                    hf_split: str | None = None, hf_subset: str | None = None, **encode_kwargs: Any):
    """MTEB's `encode(inputs, *, task_metadata, hf_split, hf_subset, prompt_type, **kwargs)`: the
    [n, d] vectors of every text in `inputs` (a DataLoader of {"text": [...]} batches, or a plain
    sequence of texts), in order."""
    features = getattr(getattr(inputs, "dataset", None), "features", None) or {}
    carried = [name for name in NON_TEXT_FEATURES if name in features]
    if carried:
        raise ValueError(f"MTEB task {task_metadata.name!r} gives {carried} inputs; this encoder embeds text only")
    texts = _texts(inputs)
    prompt = _prompt(encoder, task_metadata, prompt_type)
    kind = str(getattr(prompt_type, "value", prompt_type)) if prompt_type is not None else None
    if kind == "query":
        return encoder.encode_query(texts, prompt=prompt, **encode_kwargs)
    if kind == "document":
        return encoder.encode_document(texts, prompt=prompt, **encode_kwargs)
    if kind is not None:
        raise ValueError(f"unknown MTEB prompt type {prompt_type!r}")
    return encoder.encode(texts, prompt=prompt, **encode_kwargs)


def _texts(inputs: Any) -> list[str]:
    """Every text of a DataLoader's batches (MTEB's "text" column), or the sequence itself."""
    if isinstance(inputs, str):
        return [inputs]
    if hasattr(inputs, "dataset") and hasattr(inputs, "batch_size"):
        return [text for batch in inputs for text in batch["text"]]
    return list(inputs)


def _prompt(encoder: SentenceEncoder, task_metadata: Any, prompt_type: Any) -> str | None:
    """The prompt MTEB's sentence-transformers wrapper would choose from the model's prompts (keys
    MTEB does not know are left out, as it leaves them out), or None."""
    from mteb.models.abs_encoder import AbsEncoder, get_prompt_name

    prompts, _ = AbsEncoder.validate_task_to_prompt_name(dict(encoder.prompts) or None, raise_for_invalid_keys=False)
    if not prompts:
        return None
    name = get_prompt_name(prompts, task_metadata, prompt_type)
    return prompts.get(name) if name else None
