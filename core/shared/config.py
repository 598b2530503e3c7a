"""What the engine core and the render workers are started with, and the model facts they share.

Each child process gets its `EngineConfig` or `WorkerConfig` as a JSON file in the group's private
directory (its path on the command line), with the `ModelSpec` inside: everything about the model
a child needs, decided once in the caller's process (by `model_folder.load.load_model_spec`), so no
child reads the model's sentence-transformers files again. Only msgspec structs and the
vocabularies of their values live here; reading a model folder does not.
"""

from __future__ import annotations

import typing
from typing import Literal

import msgspec
import numpy as np

from pooling_pipeline.core.shared.options import Backend, EngineDtype, Quantize, Task
from pooling_pipeline.core.shared.sim_device import SimDevice

# Encoder-decoder families whose encoder alone embeds (as ST loads them): model_type -> class.
ENCODER_ONLY_CLASSES = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}
PoolingMode = Literal["cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]
POOLING_MODES: tuple[str, ...] = typing.get_args(PoolingMode)
# Dense activations ST saves by class path; the engine maps the class name to the torch module.
DENSE_ACTIVATIONS = ("Identity", "Tanh", "ReLU", "GELU", "Sigmoid", "SiLU", "Softplus", "LeakyReLU", "ELU")
# Similarity functions ST names in config_sentence_transformers.json (bi-encoder `score`).
SIMILARITIES = ("cosine", "dot", "euclidean", "manhattan")


# The sequence cap of a step, when the caller leaves it (PipelineOptions.max_num_seqs). On a CPU a
# step costs its padded tokens, and 64 measured best there (README's figures). On a GPU a step
# costs mostly its fixed host and launch overhead until thousands of tokens: the token budget
# (16,384 tokens) bounds a step, as TEI and vLLM batch by tokens, and the cap only stops very
# short texts from making steps of thousands (the first GPU run's 64-text steps spread a ~17 ms
# step over 64 texts).
CPU_MAX_NUM_SEQS, GPU_MAX_NUM_SEQS = 64, 1024
# The most pixels an image may have before a render worker decodes it (PipelineOptions.max_image_pixels):
# PIL's own decompression-bomb warning threshold.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485

class PoolingSpec(msgspec.Struct, kw_only=True):
    modes: list[PoolingMode]  # several are concatenated, in this order (as ST does)
    include_prompt: bool = True  # False: the prompt's tokens are left out of pooling


class HeadModule(msgspec.Struct, kw_only=True):
    """One ST module after pooling, applied by the engine in modules.json order."""

    kind: Literal["dense", "layer_norm", "normalize"]
    path: str = ""  # directory holding its weights (dense, layer_norm)
    in_features: int = 0
    out_features: int = 0
    bias: bool = True
    activation: str = "Identity"  # a DENSE_ACTIVATIONS name
    use_residual: bool = False


class SparseSpec(msgspec.Struct, kw_only=True):
    """SPLADE pooling of an MLM head's logits: max or sum over tokens of log(1 + relu(logits))."""

    pooling: Literal["max", "sum"] = "max"
    activation: Literal["relu", "log1p_relu"] = "relu"


class LogitScoreSpec(msgspec.Struct, kw_only=True):
    """ST's LogitScore on a causal LM: at the last real token, logit[true] - logit[false] (or
    logit[true] alone when false_token_id is None); CrossEncoder's activation follows."""

    true_token_id: int
    false_token_id: int | None = None


class ChatPairSpec(msgspec.Struct, kw_only=True):
    """How ST 6 renders a (query, document) pair when the Transformer has a "message" modality:
    messages with roles "query" and "document" (a prompt as a "system" message first), through
    the tokenizer's chat template, tokenized without special tokens and cut at max_length, then
    the template's suffix written back over the last tokens of a cut row (restore_suffix)."""

    message_format: Literal["flat", "structured"]  # content as a string, or [{"type": "text", "text": ...}]
    template_kwargs: dict[str, bool | int | float | str | None] = {}  # processing_kwargs["chat_template"]
    restore_suffix: bool = True
class QueryExpansion(msgspec.Struct, kw_only=True):
    """ST's query_expansion (ColBERT): queries padded up to `length` tokens with `token` (the
    tokenizer's mask token when None); "fixed" also truncates them to it, "min" keeps longer ones.
    attend=False: the encoder does not attend to those tokens, yet their vectors are returned."""

    strategy: Literal["fixed", "min"] = "fixed"
    attend: bool = False
    token: str | None = None
    length: int = 32


class MultiVectorSpec(msgspec.Struct, kw_only=True):
    """A late-interaction (ColBERT) model, as ST's MultiVectorEncoder runs it: one vector per kept
    token, through token-level Dense / Normalize modules; routes "query" and "document" (and none,
    ST's encode() without a task) choose the prompt, the length and which tokens are kept."""

    token_modules: list[HeadModule] = []  # Dense (and a Normalize that is not last) on every token
    query_length: int | None = None  # the query route's truncation (without expansion, or "min")
    document_length: int | None = None  # the document route's truncation
    query_expansion: QueryExpansion | None = None
    # MultiVectorMask: without one, every attended token is returned (no skiplist, no expansion).
    mask_module: bool = True
    skiplist_words: list[str] = []  # tokens dropped from the output (their ids, as the tokenizer has them)
    # The routes the skiplist applies to ("document" covers requests without a route too, as in ST).
    skiplist_tasks: list[str] = msgspec.field(default_factory=lambda: ["document"])
    keep_only_token_ids: list[int] | None = None  # non-query routes keep only these ids
    legacy_prefixes: list[str] = []  # PyLate/Stanford markers ST registers as special tokens
    length_normalize: bool = False  # similarity "meanmaxsim": MaxSim divided by the query's vectors


class ImageSpec(msgspec.Struct, kw_only=True):
    """The image tower of a dual encoder (CLIP, SigLIP): what its image processor makes of an
    image (the render worker runs the processor's own resize and crop, which end in uint8 pixels of
    one fixed shape) and the last two steps the engine does itself on the device: rescale and
    normalize, as the processor would (equal to its float output within 1e-6)."""

    processor_class: str  # the image processor transformers picks here (a PIL-backend class)
    channels: int
    height: int
    width: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: list[float]
    std: list[float]
    # The vision transformer's sequence per image (patches, plus a class token where it has one):
    # an image request counts this many tokens in the engine's step budget (NaFlex: at most).
    tokens: int
    # NaFlex (SigLIP2): an image keeps its aspect ratio, resized to at most `max_patches` patches of
    # `patch_size` pixels, which travel as the processor's float values (height and width are 0:
    # no one size). 0 for a processor of one fixed size.
    max_patches: int = 0
    patch_size: int = 0
    # A VLM embedder (Qwen2-VL, Qwen3-VL): patches merged merge_size x merge_size into one vision
    # token, each an `image_token_id` in the row's ids (channels: 3 x the temporal patch).
    merge_size: int = 1
    image_token_id: int = -1


class AudioSpec(msgspec.Struct, kw_only=True):
    """The audio tower of a CLAP model: what its feature extractor makes of a clip (the render worker
    runs the extractor itself: log-mel features of one fixed shape, `channels` x `frames` x
    `mel_bins`, float32) and what it takes. ST never resamples an array: a clip at another rate
    than `sampling_rate` is refused, as the extractor refuses it; a file is decoded and resampled to
    it (transformers' `load_audio`). A clip longer than `max_samples` is refused: the extractor
    would crop a random window of it ("rand_trunc", "fusion"), so its vector would not be
    reproducible."""

    feature_extractor_class: str
    sampling_rate: int
    max_samples: int
    channels: int
    frames: int
    mel_bins: int
    truncation: str
    # The audio transformer's sequence per clip (its patches): what an audio request counts in the
    # engine's step budget.
    tokens: int


class PayloadSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a row's named array (`messages.Payload`) must be for a model, as its family declares it
    (`ModelFamily.payloads`): its items' dtype (numpy's `dtype.str`, "|u1" for uint8) and shape, and
    how many items one row may carry -- what bounds the engine's memory by bytes per request."""

    dtype: str
    item_shape: tuple[int, ...]
    max_items: int = 1

    @property
    def item_bytes(self) -> int:
        size = int(np.dtype(self.dtype).itemsize)
        for d in self.item_shape:
            size *= d
        return size


class AdapterSpec(msgspec.Struct, kw_only=True):
    """A PEFT adapter in the transformer's folder (`ModelSpec.path`: adapter_config.json and its
    weights, beside the tokenizer): the engine loads the base model from `base_path` and merges the
    adapter into its weights once, at load (core/engine/peft_merge.py), where sentence-transformers with
    peft runs it unmerged. Read by model_folder/peft_adapter.py."""

    peft_type: str  # adapter_config.json's peft_type: one peft merges exactly (MERGEABLE_TYPES there)
    base_path: str  # the base model's folder (its config.json and weights): `ModelSpec.path` itself when it holds them


class ModelSpec(msgspec.Struct, kw_only=True):
    path: str  # the transformer's directory (config, weights, tokenizer; under a PEFT adapter: see `adapter`)
    model_type: str
    architectures: list[str]
    hidden_size: int  # the transformer's output width
    embedding_size: int  # width of the final embedding (after Dense modules, pooling modes concatenated)
    vocab_size: int
    max_model_len: int  # the most tokens the model accepts
    default_max_tokens: int  # truncation when the caller gives none (ST's max_seq_length)
    pooling: PoolingSpec
    head_modules: list[HeadModule] = []  # Dense / LayerNorm / Normalize after pooling, in order
    normalize: bool  # a final Normalize module: embeddings are L2-normalized by default
    do_lower_case: bool  # ST lowercases the text itself when set
    model_class: Literal["auto", "encoder_only", "masked_lm", "causal_lm"] = "auto"
    # "none" (hidden states) | "sequence_classification" | "token_classification" | "causal_lm" (LogitScore)
    head: str = "none"
    num_labels: int = 0
    multi_label: bool = False  # problem_type multi_label_classification: sigmoid per label
    score_activation: str = "sigmoid"  # cross-encoder score: ST's configured (or default) activation
    late_interaction: bool = False  # token embeddings scored with MaxSim (ColBERT style)
    sparse: SparseSpec | None = None  # SPLADE models: task "sparse_embed"
    similarity: str = "cosine"  # bi-encoder score (ST's similarity_fn_name)
    # ST's truncate_dim: the first k values of the final embedding (after Normalize, not renormalized),
    # unless the caller asks for `dimensions`.
    truncate_dim: int | None = None
    max_active_dims: int | None = None  # sparse_embed: keep the k largest weights (ST's max_active_dims)
    prompts: dict[str, str] = {}  # ST prompts by name (config_sentence_transformers.json)
    default_prompt_name: str | None = None
    matryoshka_dimensions: list[int] | None = None
    tasks: list[Task] = []
    trust_remote_code: bool = False
    # ST's Router (and query/document models): the routes a request may take, by name; a request's
    # route travels as its index here (the `route` request column), -1 when the call names none.
    routes: list[str] = []
    default_route: str | None = None  # the route of a request that names none (None: the model has one path)
    logit_score: LogitScoreSpec | None = None  # LLM rerankers (head "causal_lm"): task "score" only
    chat_pairs: ChatPairSpec | None = None  # pairs rendered through the chat template (else tokenizer pairs)
    # processing_kwargs["chat_template"] of a model that renders every input as chat messages (a VLM embedder)
    chat_template_kwargs: dict[str, bool | int | float | str | None] = {}
    # ST's Router resolution for text (route_mappings): a task's route, and the catch-all route of
    # any task ((None, "text") or (None, None)); a task naming a route takes it, as ST does.
    route_by_task: dict[str, str] = {}
    route_any_task: str | None = None
    # One spec per route, in `routes` order (each a chain the engine runs on its own); this spec is
    # then the first transformer route's, with the widest max_model_len of them all.
    route_specs: list[ModelSpec] = []
    # What a route starts with: a transformer, or ST's SparseStaticEmbedding (a weight per token
    # id of the text, tokenized without special tokens; `path` holds its tokenizer and weights).
    # ST's StaticEmbedding (model2vec): the mean of the text's token vectors, no transformer.
    # A dual encoder (CLIP, SigLIP): texts through its text tower, images through its image tower
    # (`image`), each ending in the shared embedding space, as ST 6's Transformer runs them; SigLIP2
    # with NaFlex images ("naflex_dual_encoder"). The name of the model's family (core/families/:
    # `family_of` refuses a name no family has), so a new family needs no change here.
    input_module: str = "transformer"
    image: ImageSpec | None = None
    audio: AudioSpec | None = None
    add_special_tokens: bool = True
    static_truncate_left: bool = False  # a StaticEmbedding's tokenizer.json truncates from the left
    multi_vector: MultiVectorSpec | None = None  # ST's MultiVectorEncoder (ColBERT, PyLate layouts)
    adapter: AdapterSpec | None = None  # a PEFT adapter on the transformer, merged at load
    # A row longer than this runs unpadded, in a forward with only rows of its own length: padding
    # changes the model's output for a row (Funnel's pooled attention: 0, every row; BigBird's
    # block-sparse attention: its full-attention switch). None: padded batches are exact.
    unpadded_above: int | None = None
    # BigBird's attention_type "block_sparse": block-sparse for a row longer than this, full
    # attention at or below it -- what transformers picks for one text alone (it switches itself
    # for good on the first short batch; the engine sets the type before every forward).
    block_sparse_above: int | None = None
    # No max length anywhere (no max_seq_length, tokenizer model_max_length or position table): ST
    # keeps the whole text. With no length from the call, a text over max_model_len is refused, not cut.
    whole_text: bool = False

    @property
    def base_path(self) -> str:
        """Where the transformer's config.json and weights load from: a PEFT adapter's base model,
        else `path` (the tokenizer is always read from `path`, as sentence-transformers reads it)."""
        return self.adapter.base_path if self.adapter is not None else self.path

    @property
    def score_kind(self) -> str | None:
        if "score" not in self.tasks:
            return None
        if self.head in ("sequence_classification", "causal_lm"):
            return "cross_encoder"
        return "late_interaction" if self.late_interaction else "bi_encoder"


class EngineConfig(msgspec.Struct, kw_only=True):
    model: ModelSpec
    device: str  # "cpu" | "cuda" | "cuda:N"
    dtype: EngineDtype
    max_num_seqs: int
    max_num_batched_tokens: int | None  # None: the engine picks by device
    window: int  # most requests admitted in the engine at once
    max_message_items: int  # most requests in one EngineInputBatch (to keep the window exact)
    torch_threads: int
    input_endpoint: str  # engine binds; render workers push inputs here
    control_endpoint: str  # frontend binds (a ROUTER); engine connects a DEALER for Abort/Shutdown
    # The engine's address on the control socket: random, known to the frontend and this engine only,
    # so Abort and Shutdown reach this engine and no other peer of the socket (see runtime.addressed_socket).
    control_routing_id: bytes = b""
    output_endpoint: str  # frontend binds; engine pushes results
    parent_pid: int
    log_level: str = "WARNING"
    sim: SimDevice | None = None  # device "sim": the simulated accelerator's step time
    index: int = 0  # which engine core of the group (data parallel: 0 .. data_parallel_size - 1)
    backend: Backend = "torch"  # (see ModelRunner)
    quantize: Quantize | None = None  # (torch backend)


class WorkerConfig(msgspec.Struct, kw_only=True):
    index: int
    model: ModelSpec
    work_endpoint: str  # frontend binds (a ROUTER); this worker connects a DEALER for RenderBatch
    routing_id: bytes = b""  # this process's address on the work socket (random, new per start)
    engine_endpoints: list[str]  # one per engine core (each binds its own); RenderBatch.engine picks one
    output_endpoint: str
    parent_pid: int
    io_processor: str | None = None  # "package.module:ClassName" plugin, loaded in each worker
    max_message_items: int = 16  # most engine inputs per message (the engine's window counts on it)
    log_level: str = "WARNING"
    # How a worker of a model that takes images opens them (the caller's options, PipelineOptions):
    # JPEG draft decoding (opt-in), and the most pixels an image may have before it is decoded.
    image_draft: bool = False
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
