"""`STLayout`: what a folder's sentence-transformers files say, gathered as they are read (by
st_config.py, st_modules.py, transformer_module.py and multi_vector.py) before the transformer's
own config.json joins it (chain_spec.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pooling_pipeline.core.shared.config import ChatPairSpec, HeadModule, LogitScoreSpec, MultiVectorSpec, PoolingSpec, SparseSpec


@dataclass
class STLayout:
    """What modules.json and the ST config files say, before the transformer's own config is read."""

    transformer_dir: Path
    task: str = "feature-extraction"
    max_seq_length: int | None = None
    do_lower_case: bool = False
    pooling: PoolingSpec = field(default_factory=lambda: PoolingSpec(modes=["mean"]))
    pooling_module: bool = False  # modules.json has a Pooling module (a Dense module must come after it)
    head_modules: list[HeadModule] = field(default_factory=list)
    normalize: bool = False
    sparse: SparseSpec | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    similarity: str = "cosine"
    truncate_dim: int | None = None
    max_active_dims: int | None = None
    score_activation: str | None = None  # CrossEncoder's saved activation_fn (ST 6)
    logit_score: LogitScoreSpec | None = None  # an LLM reranker's LogitScore module
    chat_pairs: ChatPairSpec | None = None  # a text-generation Transformer with a "message" modality
    multi_vector: MultiVectorSpec | None = None  # a MultiVectorEncoder (ColBERT): see multi_vector_config
    static_dir: Path | None = None  # the first module is a StaticEmbedding (model2vec): its folder
    dual_encoder: bool = False  # the Transformer is a dual encoder (CLIP, SigLIP): texts and images
    vlm_embedder: bool = False  # the Transformer is a VLM embedder (Qwen2-VL, Qwen3-VL): chat messages
    vlm_reranker: bool = False  # ... or a multimodal reranker's generative VLM (transformer_task any-to-any)
    chat_template_kwargs: dict = field(default_factory=dict)  # its processing_kwargs["chat_template"]
