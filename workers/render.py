"""Turns a RenderBatch into engine inputs in columns: tokenization and truncation, nothing else."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pooling_pipeline.core.families import family_of
from pooling_pipeline.core.shared.config import DEFAULT_MAX_IMAGE_PIXELS, ModelSpec
from pooling_pipeline.core.shared.messages import PoolingParams, RenderBatch, RenderOptions, RenderParams
from pooling_pipeline.core.shared.options import too_long
from pooling_pipeline.core.shared.schema import MODALITIES, ids_out_of_range, packed_lengths, split_packed
from pooling_pipeline.workers.packer import EngineInputPacker
from pooling_pipeline.workers.truncation import TruncatingTokenizer

MAX_CACHED_PROMPTS = 1024  # prompts whose token count a worker remembers
# ST's probe of a chat template's pair roles: a baseline pair, then one varying each role's content.
PAIR_ROLE_PROBES = (("alpha", "bravo"), ("charlie", "bravo"), ("alpha", "foxtrot"))


def load_hf_tokenizer(spec: ModelSpec):
    """The tokenizer exactly as transformers configures it for this model.

    transformers adjusts the backend from tokenizer_config.json (lowercasing, special tokens), so
    the fast backend is taken from AutoTokenizer rather than read from tokenizer.json directly --
    except for ST's StaticEmbedding, which loads its tokenizer.json as it is.
    """
    if family_of(spec).tokenizer_from_json:
        return static_tokenizer(spec)
    # (remote tokenizer code may import anything; a dual encoder's image processor needs PIL)
    with unused_imports_hidden(unless=spec.trust_remote_code, keep=media_processor_imports(spec)):
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(spec.path, trust_remote_code=spec.trust_remote_code)
    if getattr(hf, "backend_tokenizer", None) is None:
        raise ValueError(f"model {spec.path!r} has no fast tokenizer")
    if spec.multi_vector is not None and spec.multi_vector.legacy_prefixes:
        register_prefix_tokens(hf, spec.multi_vector.legacy_prefixes)
    return hf


def static_tokenizer(spec: ModelSpec):
    """ST's StaticEmbedding tokenizer: tokenizer.json as `tokenizers` loads it (no transformers
    adjustment), its own truncation side, wrapped for the Renderer's few questions."""
    from tokenizers import Tokenizer

    with unused_imports_hidden():
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(Path(spec.path) / "tokenizer.json")))
    hf.truncation_side = "left" if spec.static_truncate_left else "right"
    return hf


# Importable libraries a render worker never uses, that loading a tokenizer would import: torch
# (~190 MB; transformers' config module imports it for RoPE helpers), trio (~3 MB; the hub's HTTP
# client takes it when installed, for async transports -- a worker reads local files only) and
# PIL (~1.5 MB; transformers' image helpers). Each is an optional import for those libraries.
HIDDEN_WHILE_LOADING = ("torch", "trio", "PIL")


def media_processor_imports(spec: ModelSpec) -> tuple[str, ...]:
    """What the model's image or audio processors import, kept importable in its worker (its
    family says: PIL for images, and torch where their processors need it)."""
    return family_of(spec).worker_imports()


@contextlib.contextmanager
def unused_imports_hidden(unless: bool = False, keep: tuple[str, ...] = ()):
    """While transformers is first imported, torch (and HIDDEN_WHILE_LOADING's others) are made
    unimportable (a None entry in sys.modules, as Python documents): transformers then behaves as
    in a tokenizers-only install, with the same tokenizer classes and configuration. Only where
    neither torch nor transformers is imported yet (a worker before its first load; never a
    caller's process, nor after a plugin imported either); they are importable again afterwards,
    for a plugin that wants them."""
    if unless or "torch" in sys.modules or "transformers" in sys.modules:
        yield
        return
    hidden = [name for name in HIDDEN_WHILE_LOADING if name not in sys.modules and name not in keep]
    for name in hidden:
        sys.modules[name] = None
    quiet = NotFoundNotice()  # its "PyTorch was not found" advice is expected here, once per worker
    logging.getLogger("transformers").addFilter(quiet)
    try:
        yield
    finally:
        logging.getLogger("transformers").removeFilter(quiet)
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


class NotFoundNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def register_prefix_tokens(hf, prefixes: list[str]) -> None:
    """PyLate's [Q] / [D] (or [unused0]) markers as ST's MultiVectorEncoder registers them: a
    prefix the tokenizer knows (whole, or its first word) but splits becomes a non-normalized
    special token, so the prepended text tokenizes to that one token, as the model was trained."""
    from transformers import AddedToken

    added = set(getattr(hf, "added_tokens_encoder", None) or {})
    vocab = hf.get_vocab()
    to_register = []
    for value in prefixes:
        if not value or not value.split():
            continue
        for prefix in (value, value.split(None, 1)[0]):
            if prefix not in added and prefix not in vocab:
                continue
            if hf.tokenize(prefix) != [prefix]:
                to_register.append(AddedToken(prefix, normalized=False, special=True))
            break
    if to_register:
        hf.add_special_tokens({"additional_special_tokens": to_register})


def load_tokenizer(spec: ModelSpec) -> Tokenizer:
    return Tokenizer.from_str(load_hf_tokenizer(spec).backend_tokenizer.to_str())


def render_backend(spec: ModelSpec, hf_tokenizer) -> Tokenizer:
    """The `tokenizers` backend a worker renders text with: transformers' configured one, with ST's
    do_lower_case in front and no special tokens where ST adds none. (pipeline-serve's /tokenize
    builds its tokenizer here too, so the ids it shows are the ones the model sees.)"""
    backend = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    if spec.do_lower_case:
        lowercase_first(backend)
    if not spec.add_special_tokens:  # ST's SparseStaticEmbedding tokenizes without special tokens
        backend.post_processor = None
    return backend


def load_plugin(target: str):
    """Instantiates "package.module:ClassName" (an io_processor plugin)."""
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"io_processor must look like 'package.module:ClassName', got {target!r}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load io_processor {target!r}: {e}") from None
    for method in ("render", "post_process"):
        if not callable(getattr(cls, method, None)):
            raise ValueError(f"io_processor {target!r} has no {method}() method")
    return cls()


def _build(target: str, spec: ModelSpec, **options):
    """A family's media renderer from its "module:Class" name (core/families/base.py)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)(spec, **options)


class Renderer:
    def __init__(self, spec: ModelSpec, hf_tokenizer, plugin=None, image_draft: bool = False,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> None:
        self.spec = spec
        self.hf = hf_tokenizer  # for chat templates
        self.tokenizer = TruncatingTokenizer(render_backend(spec, hf_tokenizer))
        self.plugin = plugin
        # ST leaves the prompt's tokens out of pooling when its Pooling has include_prompt=false.
        self.pools_without_prompt = not spec.pooling.include_prompt
        self.special_ids = set(getattr(hf_tokenizer, "all_special_ids", []))
        self.prompt_tokens: dict[tuple[str, int, bool], int] = {}
        # A tokenizer that does not hand token_type_ids to its model (RoBERTa style, or a config
        # that drops them) means the model sees zeros: then no boundary travels either.
        self.sends_token_types = "token_type_ids" in getattr(hf_tokenizer, "model_input_names", ["token_type_ids"])
        self.chat_suffixes: dict[str | None, list[int]] = {}  # LLM rerankers: the template's tail, by prompt
        self.pair_roles_failure: str | None = None if spec.chat_pairs is None else self._probe_pair_roles()
        self.expansion_id = expansion_token_id(spec, hf_tokenizer)
        # Chunk mode: raw chunk vectors of the full width (the frontend pools them, then finishes the
        # document's vector as the call asked, a saved truncate_dim included).
        self.chunk_params = PoolingParams(normalize=False, dimensions=spec.embedding_size if spec.truncate_dim else None)
        # What opens and processes each modality the family takes beyond text (images, audio).
        self.media = {modality: _build(target, spec, draft=image_draft, max_pixels=max_image_pixels)
                      for modality, target in family_of(spec).media_renderers.items()}
        own_texts = family_of(spec).text_renderer
        self.own_texts = None if own_texts is None else _build(own_texts, spec, draft=image_draft,
                                                               max_pixels=max_image_pixels)

    def render(self, batch: RenderBatch) -> tuple[EngineInputPacker, list[tuple[int, str]]]:
        """The batch's engine inputs in columns, and the requests that failed with why."""
        rows, failed = self._render(batch)
        if not self.spec.add_special_tokens:  # (a static embedding's empty texts)
            mark_empty_rows(rows, range(len(rows)))
        return rows, failed

    def _render(self, batch: RenderBatch) -> tuple[EngineInputPacker, list[tuple[int, str]]]:
        rows = EngineInputPacker()
        failed: list[tuple[int, str]] = []
        indices = batch.indices.tolist()
        opts = batch.options
        if self.own_texts is not None:  # the family's processor renders texts (a page retriever's queries)
            self._render_with_own_texts(rows, batch, indices, failed)
        elif self.spec.multi_vector is not None:
            self._render_multi_vector(rows, batch, indices, failed)
        elif batch.items is not None:
            for index, item in zip(indices, batch.items):
                self._render_item(rows, index, item, batch.chat_template, failed)
        elif opts.max_tokens < self.tokenizer.num_special_tokens:
            error = (f"ValueError: cannot keep {opts.max_tokens} tokens: the model adds "
                     f"{self.tokenizer.num_special_tokens} special tokens")
            failed = [(index, error) for index in indices]
        elif batch.token_ids is not None:  # used verbatim, cut to max_tokens (refused under long_inputs='error')
            sizes = packed_lengths(batch.token_ids, batch.lengths, len(indices))
            ids = split_packed(batch.token_ids, sizes)
            keep = opts.max_tokens
            if max(sizes, default=0) > keep:
                if opts.long_inputs == "error":
                    self._add_each(rows, indices, ids, opts, failed, lambda a: (self._kept_ids(a, keep, opts), {}))
                    return rows, failed
                ids = [a[-keep:] if opts.truncate_left else a[:keep] for a in ids]
            rows.extend(indices, ids, opts)
        elif batch.pairs is not None and self.spec.chat_pairs is not None:  # an LLM reranker's chat template
            self._add_each(rows, indices, zip(batch.texts, batch.pairs), opts, failed,
                           lambda pair: (self._chat_pair_ids(*pair, opts.text_prefix, opts), {}))
        else:
            self._render_texts(rows, batch, indices, failed)
        return rows, failed

    def _render_with_own_texts(self, rows: EngineInputPacker, batch: RenderBatch, indices: list[int],
                               failed: list[tuple[int, str]]) -> None:
        """Texts through the family's own text renderer (the call's prompt in front), images and
        audio through its media renderers; other input forms are this model's refusal."""
        def text_ids(text: str, opts: RenderOptions) -> np.ndarray:
            if getattr(self.own_texts, "takes_prompt", False):  # (a VLM's prompt: a system message)
                return self.own_texts.render(text, opts.max_tokens, opts.long_inputs, opts.truncate_left,
                                             prompt=opts.text_prefix)
            return self.own_texts.render((opts.text_prefix or "") + text, opts.max_tokens, opts.long_inputs,
                                         opts.truncate_left)

        if batch.items is None:
            if batch.texts is None or batch.pairs is not None:
                failed.extend((index, f"ValueError: model {self.spec.path!r} takes texts and images only")
                              for index in indices)
                return
            self._add_each(rows, indices, batch.texts, batch.options, failed,
                           lambda text: (text_ids(text, batch.options), {}))
            return
        for index, item in zip(indices, batch.items):
            if item.media is not None:
                self._render_media(rows, index, item, failed)
            elif item.prompt is not None and item.pair is None:
                self._add_each(rows, [index], [item.prompt], item.options, failed,
                               lambda text, opts=item.options: (text_ids(text, opts), {}))
            elif item.messages is not None and hasattr(self.own_texts, "render_messages"):
                self._render_messages(rows, index, item, failed)
            else:
                failed.append((index, f"ValueError: model {self.spec.path!r} takes texts and images only (no token "
                                      "ids, pairs or conversations)"))

    @staticmethod
    def _kept_ids(ids, max_tokens: int, opts: RenderOptions):
        """Token ids given as they are: cut to `max_tokens` on the truncation side, or, under
        long_inputs='error', refused naming their length (as a text is: they were once cut whatever the
        call said)."""
        if len(ids) <= max_tokens:
            return ids
        if opts.long_inputs == "error":
            raise ValueError(too_long("prompt", len(ids), True, max_tokens))
        return ids[-max_tokens:] if opts.truncate_left else ids[:max_tokens]

    def _add_each(self, rows: EngineInputPacker, indices: list[int], inputs, opts: RenderOptions,
                  failed: list[tuple[int, str]], render) -> None:
        """Each request rendered alone: `render(input)` gives its ids and the columns it computed;
        any failure becomes that request's error, never a crash."""
        for index, value in zip(indices, inputs):
            try:
                ids, computed = render(value)
            except Exception as e:
                failed.append((index, f"{type(e).__name__}: {e}"))
                continue
            rows.add(index, ids, opts, **computed)

    def _render_texts(self, rows: EngineInputPacker, batch: RenderBatch, indices: list[int],
                      failed: list[tuple[int, str]]) -> None:
        """Texts (or a cross-encoder's pairs) sharing the batch's options, the prompt in front."""
        opts = batch.options
        pool_start = self._prompt_tokens(opts.text_prefix, opts) if self.pools_without_prompt else 0
        texts = batch.texts
        if opts.text_prefix:  # as ST: the prompt, then the text (of a pair: the query)
            texts = [opts.text_prefix + t for t in texts]
        if batch.pairs is not None:
            self._add_each(rows, indices, zip(texts, batch.pairs), opts, failed,
                           lambda pair: self._pair_ids(*pair, opts, pool_start))
            return
        if opts.long_inputs == "chunk":
            for index, text in zip(indices, texts):
                try:
                    self._add_chunks(rows, index, text, opts)
                except Exception as e:
                    failed.append((index, f"{type(e).__name__}: {e}"))
            return
        # Short texts kept from the start go through the tokenizer in one batched call; the rest
        # one by one (the truncation planner: a long text costs what its kept prefix costs). Under
        # long_inputs='error' a text kept shorter than max_tokens was not cut: only one that reached
        # it is counted again (the servers' default mode; counting every text first cost a second
        # tokenization of each, one by one).
        tokenizer = self.tokenizer
        refuse = opts.long_inputs == "error"
        batched = opts.long_inputs in ("truncate", "error") and not opts.truncate_left
        limit = tokenizer.short_text_chars(opts.max_tokens) if batched else -1
        short = [i for i, t in enumerate(texts) if len(t) <= limit]
        encoded: dict[int, list[int]] = {}
        if short:
            try:
                encoded = dict(zip(short, tokenizer.encode_many([texts[i] for i in short], opts.max_tokens)))
                if len(short) == len(texts) and not (refuse and any(len(ids) >= opts.max_tokens
                                                                    for ids in encoded.values())):
                    rows.extend(indices, list(encoded.values()), opts, pool_start=pool_start)
                    return
            except Exception:
                encoded = {}  # retried one by one below, so the failure lands on the right request

        def text_ids(numbered: tuple[int, str]) -> tuple[list[int], dict]:
            i, text = numbered
            ids = encoded.get(i)
            if ids is None:
                ids = tokenizer.encode(text, opts.max_tokens, left=opts.truncate_left)
            if refuse and len(ids) >= opts.max_tokens:
                self._refuse_if_too_long(text, opts.max_tokens)
            return ids, {"pool_start": pool_start}

        self._add_each(rows, indices, enumerate(texts), opts, failed, text_ids)

    def _pair_ids(self, query: str, document: str, opts: RenderOptions, pool_start: int) -> tuple[list[int], dict]:
        """A cross-encoder's pair, truncated longest-first; its columns: where type 1 starts, the prompt's tokens."""
        ids, type_ids = self._encode_pair(query, document, opts)
        start = compress_token_type_ids(type_ids) if self.sends_token_types else None
        return ids, {"token_type_start": -1 if start is None else start, "pool_start": pool_start}

    def _encode_pair(self, query: str, document: str, opts: RenderOptions) -> tuple[list[int], list[int]]:
        """(ids, type ids) of a text pair: each side capped (max_query_tokens / max_doc_tokens), then the
        pair cut longest-first, as ST's CrossEncoder cuts it -- or, under long_inputs='error', refused
        naming its length when that cut would shorten it."""
        ids, type_ids = self.tokenizer.encode_pair(query, document, opts.max_tokens,
                                                   opts.max_query_tokens, opts.max_doc_tokens)
        if opts.long_inputs == "error" and len(ids) >= opts.max_tokens:  # (a shorter pair was not cut: no recount)
            tokens, exact = self.tokenizer.pair_tokens(query, document, opts.max_tokens,
                                                       opts.max_query_tokens, opts.max_doc_tokens)
            if tokens > opts.max_tokens:
                raise ValueError(too_long("pair", tokens, exact, opts.max_tokens))
        return ids, type_ids

    def _add_chunks(self, rows: EngineInputPacker, index: int, text: str, opts: RenderOptions) -> None:
        """Chunk mode: the document's chunks, each a row under its index with raw-vector params."""
        chunks = self._chunks(text, opts)
        for k, ids in enumerate(chunks):
            rows.add(index, ids, opts, params=self.chunk_params, chunk=k, num_chunks=len(chunks))

    # ---- multi-vector (ColBERT) models: ST's MultiVectorEncoder.preprocess per route ----------

    def _render_multi_vector(self, rows: EngineInputPacker, batch: RenderBatch, indices: list[int],
                             failed: list[tuple[int, str]]) -> None:
        """Each request's ids for its route (its prompt, its length, query expansion), one by one."""
        if batch.items is not None:
            inputs = [(item.options, item.prompt, item.token_ids, item) for item in batch.items]
        elif batch.token_ids is not None:
            ids = split_packed(batch.token_ids, packed_lengths(batch.token_ids, batch.lengths, len(indices)))
            inputs = [(batch.options, None, a, None) for a in ids]
        else:
            inputs = [(batch.options, text, None, None) for text in batch.texts]
        for index, (opts, text, token_ids, item) in zip(indices, inputs):
            try:
                if batch.pairs is not None or (item is not None and (item.pair is not None or item.raw is not None
                                                                     or item.conversation is not None)):
                    raise ValueError("a multi-vector model encodes single texts or token ids (no pairs, "
                                     "conversations or plugin input)")
                ids, expansion_start = self._multi_vector_ids(opts, text, token_ids)
            except Exception as e:  # any failure becomes this request's error, never a crash
                failed.append((index, f"{type(e).__name__}: {e}"))
                continue
            rows.add(index, ids, opts, expansion_start=expansion_start)

    def _multi_vector_ids(self, opts: RenderOptions, text: str | None, token_ids) -> tuple[list[int], int]:
        """(ids, expansion_start): the route's prompt and the text, truncated to the route's length;
        a query padded with the expansion token to the expansion length."""
        mv = self.spec.multi_vector
        route = self.spec.routes[opts.route] if opts.route >= 0 else None
        expansion = mv.query_expansion if route == "query" else None
        max_tokens = self._route_max_tokens(route, opts.max_tokens)
        if text is not None:
            prompt = opts.text_prefix if opts.text_prefix is not None else self._route_prompt(route)
            text = (prompt or "") + text
            if opts.long_inputs == "error" and (expansion is None or expansion.strategy != "fixed"):
                self._refuse_if_too_long(text, max_tokens)
            ids = list(self.tokenizer.encode(text, max_tokens, left=opts.truncate_left))
        elif token_ids is not None:  # used verbatim (special tokens included), cut to the route's length
            ids = list(self._kept_ids(np.asarray(token_ids).tolist(), max_tokens, opts))
        else:
            raise ValueError("request has no input")
        if expansion is None or len(ids) >= expansion.length or not ids:
            return ids, -1
        real = len(ids)
        return ids + [self.expansion_id] * (expansion.length - real), -1 if expansion.attend else real

    def _route_max_tokens(self, route: str | None, call_max_tokens: int) -> int:
        """ST's per-task max length: the query expansion length ("fixed"; "min": at least it, up to
        query_length), query_length, document_length; the call's truncation where the model gives none."""
        mv = self.spec.multi_vector
        expansion = mv.query_expansion if route == "query" else None
        length = mv.query_length if route == "query" else mv.document_length if route == "document" else None
        if expansion is not None:
            if expansion.strategy == "fixed":
                return expansion.length
            return max(length, expansion.length) if length is not None else call_max_tokens
        return length if length is not None else call_max_tokens

    def _route_prompt(self, route: str | None) -> str | None:
        """The prompt of a request that names none: ST's encode_query / encode_document take the
        model's "query" / "document" prompt (none when it has none); encode() without a task, the
        default prompt."""
        if route is not None:
            return self.spec.prompts.get(route)
        name = self.spec.default_prompt_name
        return self.spec.prompts.get(name) if name else None

    def _render_item(self, rows: EngineInputPacker, index: int, item: RenderParams, chat_template: str | None,
                     failed: list[tuple[int, str]]) -> None:
        """The general path: one request with its own options and input form."""
        opts = item.options
        if item.media is not None:
            self._render_media(rows, index, item, failed)
            return
        try:
            if opts.max_tokens < self.tokenizer.num_special_tokens:
                raise ValueError(f"cannot keep {opts.max_tokens} tokens: the model adds "
                                 f"{self.tokenizer.num_special_tokens} special tokens")
            prompt = item.prompt
            if opts.text_prefix and prompt is not None:
                prompt = opts.text_prefix + prompt
            if opts.long_inputs == "chunk" and prompt is not None:
                self._add_chunks(rows, index, prompt, opts)
                return
            ids, type_start = self._render_one(item, prompt, chat_template)
            pool_start = self._prompt_tokens(opts.text_prefix, opts) if self.pools_without_prompt else 0
        except Exception as e:  # any failure becomes this request's error, never a crash
            failed.append((index, f"{type(e).__name__}: {e}"))
            return
        rows.add(index, ids, opts, token_type_start=-1 if type_start is None else type_start, pool_start=pool_start)

    def _render_messages(self, rows: EngineInputPacker, index: int, item: RenderParams,
                         failed: list[tuple[int, str]]) -> None:
        """Chat messages (or a text and an image in one input) through the family's text renderer:
        an image row when any part is an image."""
        try:
            opts = item.options
            ids, payloads = self.own_texts.render_messages(
                item.messages, opts.text_prefix, opts.max_tokens,
                per_side_limits=opts.max_query_tokens is not None or opts.max_doc_tokens is not None)
        except Exception as e:  # (a bad image, a template that refuses the messages: this request's error)
            failed.append((index, f"{type(e).__name__}: {e}"))
            return
        modality = MODALITIES.index("image" if payloads else "text")
        rows.add(index, ids, item.options, payloads=payloads, modality=modality)

    def _render_media(self, rows: EngineInputPacker, index: int, item: RenderParams,
                      failed: list[tuple[int, str]]) -> None:
        media = item.media
        renderer = self.media.get(media.modality)
        if renderer is None or media.modality not in MODALITIES:
            failed.append((index, f"ValueError: model {self.spec.path!r} takes no {media.modality} inputs"))
            return
        try:
            # (a renderer that takes the call's prompt renders it with the input: a VLM's system message)
            tokens, payloads = renderer.render(media, prompt=item.options.text_prefix) \
                if getattr(renderer, "takes_prompt", False) else renderer.render(media)
        except ValueError as e:  # a bad image or clip (ImageError, AudioError) is this request's error
            failed.append((index, f"ValueError: {e}"))
            return
        except Exception as e:  # never a crash
            failed.append((index, f"{type(e).__name__}: {e}"))
            return
        # (its token ids, or its sequence's length in placeholder ids: what the engine's step budget weighs)
        ids = tokens if isinstance(tokens, np.ndarray) else np.zeros(tokens, np.int64)
        rows.add(index, ids, item.options, payloads=payloads, modality=MODALITIES.index(media.modality))

    def _render_one(self, item: RenderParams, prompt: str | None, chat_template: str | None):
        opts = item.options
        if item.raw is not None:
            if self.plugin is None:
                raise ValueError("this pipeline has no io_processor to render plugin input")
            rendered = self.plugin.render(item.raw)
            if isinstance(rendered, str):
                return self.tokenizer.encode(rendered, opts.max_tokens), None
            return self._ids(list(rendered)[: opts.max_tokens]), None
        if item.token_ids is not None:
            return self._kept_ids(np.asarray(item.token_ids), opts.max_tokens, opts), None
        if item.conversation is not None:
            text = self.hf.apply_chat_template(item.conversation, chat_template=chat_template, tokenize=False)
            # Like transformers' apply_chat_template(tokenize=True): the template owns the special tokens.
            return self.tokenizer.encode(text, opts.max_tokens, add_special_tokens=False), None
        if prompt is None:
            raise ValueError("request has no input")
        if item.pair is not None and self.spec.chat_pairs is not None:
            return self._chat_pair_ids(item.prompt, item.pair, opts.text_prefix, opts), None
        if item.pair is not None:
            ids, type_ids = self._encode_pair(prompt, item.pair, opts)
            return ids, compress_token_type_ids(type_ids) if self.sends_token_types else None
        if opts.long_inputs == "error":
            self._refuse_if_too_long(prompt, opts.max_tokens)
        return self.tokenizer.encode(prompt, opts.max_tokens, left=opts.truncate_left), None

    # ---- LLM rerankers: a pair through the chat template, as ST 6's Transformer renders it ----------

    def _chat_pair_ids(self, query: str, document: str, prompt: str | None, opts: RenderOptions) -> list[int]:
        """ST's "message" path for a (query, document) pair: the messages through the chat template,
        tokenized without special tokens (the template owns them), cut at max_tokens on the
        tokenizer's truncation side; a row that reached max_tokens gets the template's suffix back
        over its last tokens (ST's restore_suffix), so the model still reads the answer position.
        Under long_inputs='error' a render longer than max_tokens is refused, naming its length (the
        template's own text counts: ~128 tokens of the tiny Qwen3-style one)."""
        if opts.max_query_tokens is not None or opts.max_doc_tokens is not None:
            raise ValueError("max_tokens_per_query / max_tokens_per_doc do not apply to a chat-template reranker "
                             "(ST truncates the rendered conversation as a whole); use truncate_prompt_tokens")
        if self.pair_roles_failure is not None:  # ST refuses such a pair rather than score the template alone
            raise ValueError(f"the model's chat template cannot carry a query/document pair: {self.pair_roles_failure}")
        left = opts.truncate_left or getattr(self.hf, "truncation_side", "right") == "left"
        rendered = self._render_pair(query, document, prompt)
        ids = self.tokenizer.encode(rendered, opts.max_tokens, add_special_tokens=False, left=left)
        if opts.long_inputs == "error" and len(ids) >= opts.max_tokens:  # (a shorter render was not cut)
            tokens, exact = self.tokenizer.count_tokens(rendered, opts.max_tokens)
            if tokens > opts.max_tokens:
                raise ValueError(too_long("pair (as the model's chat template renders it)", tokens, exact,
                                          opts.max_tokens))
        if self.spec.chat_pairs.restore_suffix and len(ids) >= opts.max_tokens:
            suffix = self._chat_suffix(prompt)
            keep = min(len(suffix), len(ids))
            if keep:
                ids = list(ids[: len(ids) - keep]) + suffix[len(suffix) - keep:]
        return ids

    def chat_pair_tokens(self, query: str, document: str, prompt: str | None, limit: int) -> tuple[int, bool]:
        """The tokens of a pair's render through the chat template, counted no further than `limit` needs
        to tell: (tokens, exact). (A server's account of what was cut: pooling_pipeline.serve.tokenizer.)"""
        return self.tokenizer.count_tokens(self._render_pair(query, document, prompt), limit)

    def _pair_messages(self, query: str, document: str, prompt: str | None) -> list[dict]:
        """ST's pair_to_messages (roles "query", "document"), a prompt first as a "system" message."""
        structured = self.spec.chat_pairs.message_format == "structured"

        def message(role: str, text: str) -> dict:
            return {"role": role, "content": [{"type": "text", "text": text}] if structured else text}

        head = [message("system", prompt)] if prompt else []
        return head + [message("query", query), message("document", document)]

    def _probe_pair_roles(self) -> str | None:
        """ST's pair-role probe: why the template drops the "query" or "document" content (or raises),
        decided by rendering probe pairs and comparing the renders; None when both reach the prompt."""
        try:
            base, *varied = (self._render_pair(query, document, None) for query, document in PAIR_ROLE_PROBES)
        except Exception as e:
            return f"it raised {type(e).__name__}: {e}"
        dropped = [role for role, render in zip(("query", "document"), varied) if render == base]
        return f"the {' and '.join(map(repr, dropped))} content does not reach the rendered prompt" if dropped else None

    def _render_pair(self, query: str, document: str, prompt: str | None) -> str:
        messages = self._pair_messages(query, document, prompt)
        return self.hf.apply_chat_template(messages, tokenize=False, **self.spec.chat_pairs.template_kwargs)

    def _chat_suffix(self, prompt: str | None) -> list[int]:
        """The template's fixed tail, found as ST finds it: the pair rendered with fillers "0" and
        "1 2 3 4" (the system prompt kept), the longest common token suffix of the two renders;
        none when the renders never diverge. Cached per prompt."""
        if prompt not in self.chat_suffixes:
            if len(self.chat_suffixes) >= MAX_CACHED_PROMPTS:
                self.chat_suffixes.clear()
            suffix: list[int] = []
            try:
                first, second = (self.tokenizer.tokenizer.encode(self._render_pair(filler, filler, prompt),
                                                                 add_special_tokens=False).ids
                                 for filler in ("0", "1 2 3 4"))
                count = 0
                for a, b in zip(reversed(first), reversed(second)):
                    if a != b:
                        break
                    count += 1
                if 0 < count < min(len(first), len(second)):
                    suffix = first[len(first) - count:]
            except Exception:  # ST: a suffix that cannot be derived is none, never a failed request
                suffix = []
            self.chat_suffixes[prompt] = suffix
        return self.chat_suffixes[prompt]

    def _prompt_tokens(self, prompt: str | None, opts: RenderOptions) -> int:
        """ST's prompt_length: the prompt tokenized alone as the texts are -- truncated at the
        tokens kept, special tokens included --, less a trailing special token (the text follows
        the prompt, not the end of the sequence). A prompt longer than what is kept thus leaves
        the last kept token(s) to pool, as in ST."""
        if not prompt:
            return 0
        key = (prompt, opts.max_tokens, opts.truncate_left)
        if key not in self.prompt_tokens:
            if len(self.prompt_tokens) >= MAX_CACHED_PROMPTS:  # per-request prompts: stay bounded
                self.prompt_tokens.clear()
            ids = self.tokenizer.encode(prompt, opts.max_tokens, left=opts.truncate_left)
            self.prompt_tokens[key] = len(ids) - (1 if ids and ids[-1] in self.special_ids else 0)
        return self.prompt_tokens[key]

    def _refuse_if_too_long(self, text: str, max_tokens: int) -> None:
        budget = self.tokenizer.content_budget(max_tokens)
        count, exact = self.tokenizer.count_tokens(text, budget)
        if count > budget:
            total = count + self.tokenizer.num_special_tokens
            why = ""
            if self.spec.whole_text and max_tokens == self.spec.max_model_len:  # (the call gave no length)
                why = (f": the model has no max length, so sentence-transformers keeps the whole text, and the "
                       f"pipeline keeps up to {max_tokens} tokens whole rather than cut it; pass "
                       "truncate_prompt_tokens to cut it, or long_inputs='chunk'")
            raise ValueError(too_long("prompt", total, exact, max_tokens) + why)

    def _chunks(self, text: str, opts: RenderOptions) -> list[list[int]]:
        """Chunk mode: the whole document in chunks of `max_tokens` (special tokens included),
        consecutive chunks sharing `chunk_overlap` tokens. Each chunk is its own engine input
        under the document's index; the frontend pools them back into one embedding."""
        width = self.tokenizer.content_budget(opts.max_tokens)
        step = width - opts.chunk_overlap
        if width < 1 or step < 1:
            raise ValueError(f"chunk_overlap={opts.chunk_overlap} leaves no room in chunks of "
                             f"{opts.max_tokens} tokens")
        chunks: list[list[int]] = []
        buffer: list[int] = []
        for piece in self.tokenizer.content_ids(text):
            buffer.extend(piece)
            while len(buffer) > width:  # more tokens follow: this chunk is not the last
                chunks.append(buffer[:width])
                buffer = buffer[step:]
        if buffer or not chunks:
            chunks.append(buffer)
        out = [self.tokenizer.with_special_tokens(content) for content in chunks]
        for ids in out:  # a document fails whole, not one of its chunks
            if not ids:
                raise ValueError("prompt is empty after tokenization")
            if ids_out_of_range(np.asarray(ids, dtype=np.int64), self.spec.vocab_size):
                raise ValueError(f"token ids must be in [0, {self.spec.vocab_size})")
        return out

    @staticmethod
    def _ids(ids) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise TypeError("rendered input must be a flat list of integer token ids")
        return arr.astype(np.int64)


def build_renderer(spec: ModelSpec, plugin=None, image_draft: bool = False,
                   max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """The worker's renderer: one Renderer, or for a Router model one per route (each with its
    route's own tokenizer and special-token rule). `image_draft`, `max_image_pixels`: how a model
    that takes images has them opened (the caller's options, from the WorkerConfig)."""
    if not spec.route_specs:
        return Renderer(spec, load_hf_tokenizer(spec), plugin, image_draft, max_image_pixels)
    return RoutedRenderer(spec, [Renderer(route, load_hf_tokenizer(route), plugin) for route in spec.route_specs])


class RoutedRenderer:
    """Renders each request with its route's Renderer (its `route` option; -1: the default
    route). Its `tokenizer` and `hf` are the default route's (what the worker reports)."""

    def __init__(self, spec: ModelSpec, renderers: list[Renderer]) -> None:
        self.spec = spec
        self.renderers = renderers
        self.default = spec.routes.index(spec.default_route) if spec.default_route is not None else 0
        self.tokenizer = renderers[self.default].tokenizer
        self.hf = renderers[self.default].hf

    def _renderer(self, route: int) -> Renderer:
        return self.renderers[self.default if route < 0 else route]

    def render(self, batch: RenderBatch) -> tuple[EngineInputPacker, list[tuple[int, str]]]:
        if batch.items is None:  # one route for the whole batch
            return self._renderer(batch.options.route).render(batch)
        rows = EngineInputPacker()
        failed: list[tuple[int, str]] = []
        for index, item in zip(batch.indices.tolist(), batch.items):
            renderer, first = self._renderer(item.options.route), len(rows)
            renderer._render_item(rows, index, item, batch.chat_template, failed)
            if not renderer.spec.add_special_tokens:
                mark_empty_rows(rows, range(first, len(rows)))
        return rows, failed


def mark_empty_rows(rows: EngineInputPacker, where: range) -> None:
    """A text with no tokens on a route that adds no special tokens (ST's SparseStaticEmbedding
    gives it an all-zero vector): it travels as one placeholder token with pool_start 1, so the
    engine counts none of its tokens (an engine input is never empty)."""
    empty = [i for i in where if len(rows.ids[i]) == 0]
    if not empty:
        return
    column = rows.columns.setdefault("pool_start", [0] * len(rows))
    for i in empty:
        rows.ids[i] = [0]
        column[i] = 1


def expansion_token_id(spec: ModelSpec, hf) -> int | None:
    """The id ST's query expansion pads queries with: its configured token, else the mask token,
    else EOS (PyLate's chain); with none, the pad id stays (as in ST, which swaps nothing)."""
    expansion = spec.multi_vector.query_expansion if spec.multi_vector is not None else None
    if expansion is None:
        return None
    if expansion.token is not None:
        return int(hf.convert_tokens_to_ids(expansion.token))
    for candidate in (hf.mask_token_id, hf.eos_token_id, hf.pad_token_id):
        if candidate is not None:
            return int(candidate)
    raise ValueError(f"model {spec.path!r}: query expansion needs a mask, EOS or pad token")


def lowercase_first(tokenizer: Tokenizer) -> None:
    """ST's do_lower_case: a Lowercase normalizer in front of the tokenizer's own (unless that one
    lowercases already), so the text is lowercased exactly as ST's tokenizer does it."""
    from tokenizers import normalizers

    described = json.dumps(json.loads(tokenizer.to_str()).get("normalizer"))
    if '"type": "Lowercase"' in described or '"lowercase": true' in described:
        return
    current = tokenizer.normalizer
    tokenizer.normalizer = normalizers.Sequence([normalizers.Lowercase()] + ([current] if current else []))


def compress_token_type_ids(type_ids: list[int]) -> int | None:
    """Zeros then ones -> the index of the first 1 (None when all zeros)."""
    arr = np.asarray(type_ids)
    ones = np.flatnonzero(arr)
    if ones.size == 0:
        return None
    start = int(ones[0])
    if not (arr[start:] == 1).all():
        raise ValueError("token type ids are not zeros followed by ones")
    return start

