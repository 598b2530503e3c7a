"""A drop-in for code written against sentence-transformers' `SentenceTransformer` (MTEB's model
protocol, retrieval libraries, notebooks), running over the process group.

    from pooling_pipeline import SentenceEncoder

    with SentenceEncoder() as model:                       # owns a Pipeline (any Pipeline option)
        emb = model.encode(["a text", "another"])          # [2, 384] float32 ndarray, as ST returns
        q = model.encode_query("what is it?")              # the model's "query" prompt, 1-D
        scores = model.similarity(q, emb)                  # torch tensor [1, 2], the model's similarity

    model = SentenceEncoder(pipeline=pipe)                 # or share a Pipeline (it stays open)

`encode` takes ST's arguments and returns ST's types and shapes: an [n, d] ndarray by default (1-D
for a single string), a tensor with `convert_to_tensor=True`, a list of tensors with
`convert_to_numpy=False`; `normalize_embeddings`, `truncate_dim` (cut, then normalized when asked,
as ST does), `precision` ("float32", "int8", "uint8", "binary", "ubinary", the values of ST's
`quantize_embeddings`), `prompt_name` / `prompt`. `batch_size` is accepted and ignored: the
engine forms its own batches under its token budget.

Prompts resolve as in ST 6.2: `prompts` is ST's dict, the empty "query" / "document" placeholders
filled by the model's saved prompts (so an e5 model's encode_document takes the empty "document"
before "passage: ", as ST's does); `encode` takes `prompt`, else `prompt_name`, else the model's
default_prompt_name; encode_query / encode_document name "query" / the first of "document",
"passage", "corpus" unless given a prompt or prompt name (an empty prompt then overrides the
default, as in ST). MTEB 2 calls `encode(dataloader, task_metadata=..., prompt_type=...)`: the
prompt is chosen as MTEB's own sentence-transformers wrapper chooses it (integrations/mteb_encoder.py);
MTEB 1's `prompt_type` (query / document, a str or its enum) selects what encode_query /
encode_document would; its `task_name` selects nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pooling_pipeline.api import Pipeline
from pooling_pipeline.core.families import family_of
from pooling_pipeline.core.shared.messages import PoolingParams
from pooling_pipeline.image_inputs import is_pil_image
from pooling_pipeline.integrations.langchain_embeddings import register_as_embeddings
from pooling_pipeline.quantization import PRECISIONS, quantize_embeddings
from pooling_pipeline.request_options import model_prompts
from pooling_pipeline.similarity import similarity_matrix, similarity_pairwise

DOCUMENT_PROMPT_NAMES = ("document", "passage", "corpus")  # what ST's encode_document looks for, in order
# MTEB 1 passed these to encode; they select nothing here beyond the prompt type. (MTEB 2's protocol,
# with task_metadata, goes to integrations/mteb_encoder.py.)
IGNORED_KEYWORDS = ("task_name", "prompt_type", "pool", "chunk_size")


class SentenceEncoder:
    def __init__(self, model: str | os.PathLike | None = None, *, pipeline: Pipeline | None = None,
                 **pipeline_options) -> None:
        if pipeline is not None and (model is not None or pipeline_options):
            raise ValueError("give either a pipeline to share, or a model and Pipeline options, not both")
        self._owns_pipeline = pipeline is None
        self.pipeline: Pipeline = Pipeline(model, **pipeline_options) if pipeline is None else pipeline
        spec = self.pipeline.model_spec
        if "embed" not in spec.tasks:
            raise ValueError(f"SentenceEncoder needs an embedding model; this one can do {spec.tasks}")
        self.prompts = model_prompts(spec)  # ST's own dict: its placeholders filled by the saved prompts
        self.default_prompt_name = spec.default_prompt_name
        self._takes_audio = family_of(spec).takes("audio")  # (a clip array is one input: `is_single_input`)
        self.similarity_fn_name = spec.similarity
        # The tokens kept of a text: settable as in ST (`model.max_seq_length = 256`), sent with every call.
        self.max_seq_length = spec.default_max_tokens
        self._default_max_seq_length = spec.default_max_tokens
        self._tokenizer = None
        self._mteb_meta = None
        self._model_id = None if model is None else str(model)

    # ---- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        if self._owns_pipeline:
            self.pipeline.close()

    def __enter__(self) -> SentenceEncoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- LangChain's Embeddings (langchain_core.embeddings): the same object, no wrapper --------
    # (InMemoryVectorStore.from_texts(docs, embedding=model) and every vector store that takes an
    # Embeddings call these four; documents and queries take the model's prompts, as encode_document
    # / encode_query do. Code that checks the type sees an Embeddings: integrations/langchain_embeddings.py.)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """The documents' vectors (the model's document prompt), as lists of floats."""
        return self.encode_document(list(texts)).tolist() if len(texts) else []

    def embed_query(self, text: str) -> list[float]:
        """The query's vector (the model's query prompt), as a list of floats."""
        return self.encode_query(text).tolist()

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        """`embed_documents` on the pipeline's async API: awaits without blocking the event loop."""
        if not len(texts):
            return []
        outs = await self.pipeline.aembed(list(texts), **self._async_options("document"))
        return [o.embedding.tolist() for o in outs]

    async def aembed_query(self, text: str) -> list[float]:
        """`embed_query` on the pipeline's async API."""
        outs = await self.pipeline.aembed([text], **self._async_options("query"))
        return outs[0].embedding.tolist()

    def _async_options(self, kind: str) -> dict:
        """What encode_query / encode_document give `embed` for `kind` (their prompt and route)."""
        return {"prompt_name": self._prompt_name_for_type(kind), "route": self._route(kind), "use_tqdm": False,
                "truncate_prompt_tokens": self._kept_tokens()}

    # ---- the surface of ST 6's SentenceTransformer that libraries reach for ------------------------

    @property
    def truncate_dim(self) -> int | None:
        """The model's saved truncate_dim (ST's attribute; `encode(truncate_dim=)` overrides it per call)."""
        return self.pipeline.model_spec.truncate_dim

    def get_embedding_dimension(self) -> int:
        """The width of `encode`'s vectors (ST 6.3's name): the model's, cut at its truncate_dim."""
        width = self.pipeline.model_spec.embedding_size
        return min(width, self.truncate_dim) if self.truncate_dim else width

    def get_sentence_embedding_dimension(self) -> int:
        """ST's older name of `get_embedding_dimension` (deprecated in ST 6.3, still answering there too)."""
        return self.get_embedding_dimension()

    def get_max_seq_length(self) -> int:
        """ST's older accessor of `max_seq_length`: the tokens kept of a text (settable, as in ST)."""
        return self.max_seq_length

    @property
    def device(self):
        """Where the model runs (the first engine core's device), as a torch.device."""
        import torch

        return torch.device(str(self.pipeline.stats()["engine"]["device"]))

    @property
    def tokenizer(self):
        """The model's tokenizer as ST exposes it (loaded in this process on first use; the render
        workers have their own)."""
        if self._tokenizer is None:
            from pooling_pipeline.workers.render import load_hf_tokenizer

            spec = self.pipeline.model_spec
            self._tokenizer = load_hf_tokenizer(spec.route_specs[0] if spec.route_specs else spec)
        return self._tokenizer

    @property
    def model_card_data(self) -> ModelCardData:
        """What ST's model card data says of the model, as far as the folder tells."""
        return ModelCardData(model_name=Path(self.pipeline.model_spec.path).name,
                             model_id=self._model_id, similarity_fn_name=self.similarity_fn_name)

    @property
    def mteb_model_meta(self):
        """What MTEB 2 reads of a model (its ModelMeta; MTEB imported on first use): with it,
        `mteb.evaluate(encoder, tasks)` takes this object as it is (see integrations/mteb_encoder.py)."""
        if self._mteb_meta is None:
            from pooling_pipeline.integrations.mteb_encoder import model_meta

            self._mteb_meta = model_meta(self)
        return self._mteb_meta

    # ---- encoding ----------------------------------------------------------------------------

    # `sentences` (typed Any, as ST's inputs): a str, an image, a dict input, a conversation, or a list, array or
    # MTEB DataLoader of them (`is_single_input` tells one input from a batch).
    def encode(self, sentences: Any, prompt_name: str | None = None, prompt: str | None = None,
               batch_size: int = 32, show_progress_bar: bool | None = None,
               output_value: str | None = "sentence_embedding", precision: str = "float32",
               convert_to_numpy: bool = True, convert_to_tensor: bool = False, device: str | None = None,
               normalize_embeddings: bool = False, truncate_dim: int | None = None, **kwargs: Any):
        """sentence-transformers' `encode`: the same arguments, return types and shapes (an [n, d] ndarray by
        default, 1-D for one input); `batch_size` is accepted and ignored (the engine forms its own batches)."""
        if "task_metadata" in kwargs:  # MTEB 2's protocol: a DataLoader and the task it runs
            from pooling_pipeline.integrations.mteb_encoder import encode_for_mteb

            return encode_for_mteb(self, sentences, batch_size=batch_size, show_progress_bar=show_progress_bar,
                                   precision=precision, convert_to_numpy=convert_to_numpy,
                                   convert_to_tensor=convert_to_tensor, normalize_embeddings=normalize_embeddings,
                                   truncate_dim=truncate_dim, **kwargs)
        unknown = set(kwargs) - set(IGNORED_KEYWORDS) - {"task"}  # task: ST's Router route (see _route)
        if unknown:
            raise TypeError(f"encode() got unexpected keyword arguments {sorted(unknown)}")
        if prompt is None and prompt_name is None and kwargs.get("prompt_type") is not None:
            prompt_name = self._prompt_name_for_type(kwargs["prompt_type"])
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if device is not None:
            raise ValueError("the device is fixed when the Pipeline starts: pass device= to SentenceEncoder()")
        if output_value not in ("sentence_embedding", "token_embeddings"):
            raise ValueError(f"output_value must be 'sentence_embedding' or 'token_embeddings', got {output_value!r}")
        if truncate_dim is not None and (not isinstance(truncate_dim, int) or truncate_dim < 1):
            raise ValueError(f"truncate_dim must be a positive int or None, got {truncate_dim!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        single = is_single_input(sentences, takes_audio=self._takes_audio)
        texts = [sentences] if single else sentences
        if not single and isinstance(texts, Sequence) and len(texts) == 0:
            return _empty(output_value, convert_to_tensor, convert_to_numpy)
        if output_value == "token_embeddings":
            return self._token_embeddings(texts, prompt_name, prompt, show_progress_bar, single, convert_to_tensor,
                                          convert_to_numpy)
        width = self.pipeline.model_spec.embedding_size
        # As ST: the call's truncate_dim replaces the model's saved one, so the engine gives the full
        # width (with the model's own Normalize, on the full width) and the cut is made here; without
        # it the engine applies the saved truncate_dim. Then the norm, on the cut vectors.
        params = PoolingParams(dimensions=width) if truncate_dim is not None else None
        outs = self.pipeline.embed(texts, pooling_params=params, use_tqdm=bool(show_progress_bar),
                                   truncate_prompt_tokens=self._kept_tokens(),
                                   prompt_name=prompt_name, prompt=prompt, route=self._route(kwargs.get("task")))
        vectors = np.stack([o.embedding for o in outs]) if outs else np.zeros((0, width), np.float32)
        if truncate_dim is not None:
            vectors = vectors[:, :truncate_dim]
        if normalize_embeddings and len(vectors):
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        if precision != "float32":
            vectors = quantize_embeddings(vectors, precision)
        return _shaped(vectors, single, convert_to_tensor, convert_to_numpy)

    def encode_query(self, sentences: Any, prompt_name: str | None = None, prompt: str | None = None,
                     **kwargs: Any):
        """encode with the model's "query" prompt unless another is given (ST's encode_query); the
        placeholder makes it the empty prompt on a model without one, not the default prompt."""
        if prompt_name is None and prompt is None:
            prompt_name = self._prompt_name_for_type("query")
        kwargs.setdefault("task", "query")
        return self.encode(sentences, prompt_name=prompt_name, prompt=prompt, **kwargs)

    def encode_document(self, sentences: Any, prompt_name: str | None = None,
                        prompt: str | None = None, **kwargs: Any):
        """encode with the model's "document" (else "passage", "corpus") prompt unless another is
        given (ST's encode_document): the "document" placeholder comes first, empty unless saved."""
        if prompt_name is None and prompt is None:
            prompt_name = self._prompt_name_for_type("document")
        kwargs.setdefault("task", "document")
        return self.encode(sentences, prompt_name=prompt_name, prompt=prompt, **kwargs)

    def __call__(self, features: dict, **kwargs: Any) -> dict:
        """ST's forward (a SentenceTransformer is a torch module): tokenized `features` in
        (`model.tokenizer(...)`'s input_ids and attention_mask, as tensors or arrays), the same dict
        out with "sentence_embedding" added ([n, d] float32 tensor). Each row's attended ids go to
        the engine as they are; token_type_ids other than zeros (a pair in one row) cannot be
        honoured here and are refused. "token_embeddings" is not added: `encode(...,
        output_value="token_embeddings")` gives them."""
        import torch

        if not isinstance(features, dict) or "input_ids" not in features or "attention_mask" not in features:
            raise TypeError("SentenceEncoder(features) takes the tokenizer's output: a dict with input_ids and "
                            "attention_mask")
        ids = np.asarray(features["input_ids"].cpu() if hasattr(features["input_ids"], "cpu") else features["input_ids"])
        mask = np.asarray(features["attention_mask"].cpu() if hasattr(features["attention_mask"], "cpu")
                          else features["attention_mask"])
        types = features.get("token_type_ids")
        if types is not None and np.asarray(types.cpu() if hasattr(types, "cpu") else types).any():
            raise ValueError("token_type_ids other than zeros (a pair in one row) are not supported by "
                             "SentenceEncoder(features); embed the texts with encode()")
        if ids.ndim != 2 or mask.shape != ids.shape:
            raise ValueError(f"input_ids and attention_mask must be [rows, tokens] of one shape, got "
                             f"{ids.shape} and {mask.shape}")
        rows = [row[attended.astype(bool)].astype(np.int64).tolist() for row, attended in zip(ids, mask)]
        outs = self.pipeline.embed(rows, use_tqdm=False)
        width = self.get_embedding_dimension()
        vectors = np.stack([o.embedding for o in outs]) if outs else np.zeros((0, width), np.float32)
        return {**features, "sentence_embedding": torch.from_numpy(np.ascontiguousarray(vectors))}

    def similarity(self, embeddings1, embeddings2):
        """[n, m] similarities with the model's similarity function, as a torch tensor: ST's
        `similarity` (one matrix operation, the same torch calls)."""
        return similarity_matrix(self.similarity_fn_name, embeddings1, embeddings2)

    def similarity_pairwise(self, embeddings1, embeddings2):
        """[n] similarities of the rows paired in order (ST's `similarity_pairwise`)."""
        return similarity_pairwise(self.similarity_fn_name, embeddings1, embeddings2)

    # ---- internals ------------------------------------------------------------------------

    def _kept_tokens(self) -> int | None:
        """The call's truncation: None while max_seq_length is the model's own (each route then keeps
        its own length), else the length the caller set."""
        if self.max_seq_length == self._default_max_seq_length:
            return None
        if not isinstance(self.max_seq_length, int) or self.max_seq_length < 1:
            raise ValueError(f"max_seq_length must be a positive int, got {self.max_seq_length!r}")
        return self.max_seq_length

    def _route(self, task: str | None) -> str | None:
        """ST's encode(task=...): a Router model's route; a model without routes ignores it, as ST does."""
        return task if self.pipeline.model_spec.routes else None

    def _token_embeddings(self, texts, prompt_name, prompt, show_progress_bar, single, convert_to_tensor,
                          convert_to_numpy):
        # ST returns the transformer's token vectors as they are (Normalize acts on sentence embeddings).
        outs = self.pipeline.encode(texts, task="token_embed", pooling_params=PoolingParams(normalize=False),
                                    truncate_prompt_tokens=self._kept_tokens(),
                                    use_tqdm=bool(show_progress_bar), prompt_name=prompt_name, prompt=prompt)
        arrays = [o.data for o in outs]
        if convert_to_tensor or not convert_to_numpy:
            import torch

            arrays = [torch.from_numpy(a) for a in arrays]
        return arrays[0] if single else arrays

    def _prompt_name_for_type(self, prompt_type: Any) -> str | None:
        """The prompt name ST's encode_query ("query") or encode_document (any other type: MTEB's
        "document", or "passage" in MTEB 1) would take, or None (then the default prompt applies)."""
        kind = str(getattr(prompt_type, "value", prompt_type))
        if kind == "query":
            return "query" if "query" in self.prompts else None
        return next((name for name in DOCUMENT_PROMPT_NAMES if name in self.prompts), None)


@dataclass
class ModelCardData:
    """The part of ST's SentenceTransformerModelCardData that libraries read (a model's name)."""

    model_name: str | None = None
    model_id: str | None = None
    base_model: str | None = None
    language: list[str] | None = None
    license: str | None = None
    similarity_fn_name: str | None = None


def _empty(output_value: str, convert_to_tensor: bool, convert_to_numpy: bool):
    """What ST's encode returns for no sentences, whatever the precision or truncate_dim: an empty
    1-D float64 array, an empty float32 tensor, or an empty list (token embeddings, or
    convert_to_numpy=False)."""
    if output_value == "token_embeddings" or (not convert_to_numpy and not convert_to_tensor):
        return []
    if convert_to_tensor:
        import torch

        return torch.zeros(0, dtype=torch.float32)
    return np.array([])


def is_single_input(inputs: object, takes_audio: bool = False) -> bool:
    """ST 6's rule (`is_singular_input`) for what is one input, not a batch: a str, a dict (an
    `{"image": ...}` input, a message), one conversation (a list of role/content dicts), a PIL image,
    an image array or tensor (3-D), and for a model that takes audio any numeric array or tensor (a
    clip). Lists, tuples, arrays of strings and data-frame columns are batches."""
    if isinstance(inputs, (str, dict)) or is_pil_image(inputs):
        return True
    if takes_audio and getattr(inputs, "ndim", 0) >= 1 and getattr(getattr(inputs, "dtype", None), "kind", "f") \
            not in "UO":
        return True
    if isinstance(inputs, list) and inputs and isinstance(inputs[0], dict) and {"role", "content"} <= set(inputs[0]):
        return True
    return getattr(inputs, "ndim", None) == 3 and getattr(inputs, "dtype", None) is not None \
        and getattr(inputs.dtype, "kind", "f") not in "UO"


def _shaped(vectors: np.ndarray, single: bool, convert_to_tensor: bool, convert_to_numpy: bool):
    """ST's return types: an ndarray (1-D for one string), a tensor, or a list of tensors."""
    if convert_to_tensor or not convert_to_numpy:
        import torch

        tensor = torch.from_numpy(np.ascontiguousarray(vectors))
        if convert_to_tensor:
            return tensor[0] if single else tensor
        return tensor[0] if single else list(tensor)
    return vectors[0] if single else vectors


# A LangChain Embeddings where langchain-core is installed (registered now, or when LangChain is imported).
register_as_embeddings(SentenceEncoder)
