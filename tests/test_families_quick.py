"""Every model family in the quick tier: one fast test each, a tiny model against its reference.

Families (one test each, parametrized where a family has several shapes):
  encoder embedders   BERT (mean with prompts and include_prompt=false; max; ST 2.x layout cls+mean + Dense),
                      XLM-R (cls), RoBERTa, MPNet, DistilBERT, ModernBERT, DeBERTa-v2 (mean)
  T5 encoders         sentence-t5 (T5 encoder, mean, Dense without bias, Normalize)
  decoder embedders   Qwen3-Embedding (last token, left padding, a query prompt);
                      EmbeddingGemma (bidirectional Gemma 3, mean)
  cross-encoders      one label (score: sigmoid); NLI, three labels (classify pairs: softmax)
  LLM rerankers       Qwen3-Reranker (chat template, LogitScore "yes" - "no")
  SPLADE              MLM + SpladePooling; inference-free (Router: SparseStaticEmbedding query route)
  ColBERT             ST 6's MultiVectorEncoder layout; PyLate's layout (query and document routes)
  static embeddings   ST's StaticEmbedding (+ Dense, Normalize); model2vec's folder
  Routers             dense (query / document Dense on a shared BERT); static query route
  token classification  per-token softmax (transformers is the reference: ST has no such model)
  dual encoders       CLIP, SigLIP and SigLIP2 (NaFlex), texts and images
  audio               CLAP, texts and clips (arrays, a WAV file)
  PEFT adapters       a LoRA adapter in the Transformer's folder, merged at load
  half precision      a bfloat16 checkpoint, run in float32 (ST with dtype float32 the reference)

Why in-process: what dominates a quick test is starting a process group (2-4 s each on 2 cores), and
a family's code is not in the processes but in the modules they run. So each test drives one tiny
model through those modules in this process, in the order a request meets them (`InProcess`): the
frontend's `build_requests` (options, prompts, routes, images checked and made RenderBatches), a
msgspec round trip as on the socket, the render worker's renderer, the packer's EngineInputBatch (and
its round trip), the engine's `Requests` and the runner the engine core picks for the family. What it
leaves out is the same for every family (sockets, scheduling, reordering, tested in the slow tier).
Every result is compared with sentence-transformers (or transformers) within 1e-5 (sparse: relative).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import corpus
import model_zoo as zoo
import numpy as np
import pytest

TOL = 1e-5
MATTERS = 1e-3  # what a reference must move by for the test to tell a part of the model apart
MAX_ITEMS = 64  # rows per engine message (the real default is larger: several messages get tested too)
TEXTS = corpus.sentences(6, seed=701) + [corpus.medium_texts(1, seed=702)[0] * 2, "a",
                                         "Émile's café: naïve façade — 東京 🙂"]
PAIRS = [(TEXTS[i], TEXTS[i + 1]) for i in range(0, 6, 2)] + [(TEXTS[6], TEXTS[0]), (TEXTS[7], TEXTS[8])]


# ---- the in-process path ------------------------------------------------------------------------

def wire(message, expected):
    """`message` encoded and decoded as on the group's sockets (no pickle: msgspec, arrays as frames)."""
    from pooling_pipeline.core.shared.serial import Decoder, Encoder

    return Decoder(expected).decode(Encoder().encode(message))


def engine_runner(spec):
    """The StepRunner the engine core builds for this model on a CPU in float32, with the torch
    backend: what the model's family runs (core/families/), as EngineCore.__init__ asks it."""
    from types import SimpleNamespace

    import torch

    from pooling_pipeline.core.families import family_of

    cfg = SimpleNamespace(model=spec, device="cpu", dtype="float32", backend="torch",
                          torch_threads=torch.get_num_threads(), quantize=None)
    return family_of(spec).runner(cfg)


class InProcess:
    """One model as the pipeline's processes hold it, in this process: the spec every process
    reads, a render worker's renderer and the engine core's runner."""

    def __init__(self, path: str) -> None:
        from pooling_pipeline.core.engine.columns import row_checks, task_lookup
        from pooling_pipeline.core.families import family_of
        from pooling_pipeline.core.shared.model_folder.load import load_model_spec
        from pooling_pipeline.inputs import Tokenization
        from pooling_pipeline.workers.render import build_renderer

        self.spec = load_model_spec(path)
        self.renderer = build_renderer(self.spec)
        self.runner = engine_runner(self.spec)
        family = family_of(self.spec)  # (the engine core's checks of each row, as EngineCore makes them)
        self.checks = row_checks(family.modalities, family.payloads(self.spec), family.row_rules(self.spec))
        self.runs_task = task_lookup(self.spec.tasks)
        # What a render worker reports at start-up (workers/main.py) and the frontend keeps.
        self.tokenization = Tokenization(num_special_tokens=self.renderer.tokenizer.num_special_tokens,
                                         truncation_side=str(getattr(self.renderer.hf, "truncation_side", "right")))

    def run(self, prompts: list, task: str, *, pairs: bool = False, **options) -> list:
        """Each prompt's engine result, in input order: a vector, class probabilities, a score's
        [1] array, (token ids, weights) of a sparse vector, or one vector per token."""
        from pooling_pipeline.core.engine.columns import Requests, invalid_rows
        from pooling_pipeline.core.shared import messages as m
        from pooling_pipeline.inputs import FailedRequest, build_requests
        from pooling_pipeline.options import CallOptions

        opts = CallOptions(task=task, pairs=pairs, use_tqdm=False, **options)
        source, _ = build_requests(prompts, opts, self.spec, self.tokenization, "c-0")
        results: dict[int, object] = {}
        while not source.exhausted:
            for batch in source.take(MAX_ITEMS, 1 << 30):
                assert not isinstance(batch, FailedRequest), batch
                rows, failed = self.renderer.render(wire(batch, m.WorkerInbound))
                assert not failed, failed
                messages, refused = rows.messages(0, batch.call, MAX_ITEMS, self.spec.vocab_size)
                assert not refused, refused
                for message in messages:
                    message = wire(message, m.EngineInbound)
                    message.check()
                    requests = Requests.from_message(message)
                    refused = invalid_rows(requests, self.spec, self.runs_task, message.columns.keys(), self.checks)
                    assert not refused, refused
                    values, _ = self.runner.run(requests)
                    results.update(zip(requests.indices.tolist(), values))
        assert sorted(results) == list(range(len(prompts)))
        return [results[i] for i in range(len(prompts))]

    def vectors(self, prompts: list, task: str = "embed", **options) -> np.ndarray:
        return np.stack(self.run(prompts, task, **options))


def assert_close(got, ref, what: str) -> None:
    got, ref = np.asarray(got), np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, the reference gives {ref.shape}"
    assert got.dtype == np.float32, f"{what}: dtype {got.dtype}"
    diff = float(np.abs(got - ref).max()) if got.size else 0.0
    assert diff <= TOL, f"{what}: max |diff| {diff:.3g} against the reference"


def assert_close_each(got: list, ref: list, what: str) -> None:
    assert len(got) == len(ref), what
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_close(g, r, f"{what}, input {i}")


def assert_differs(a, b, what: str) -> None:
    """The reference depends on `what` (so a pipeline that ignored it would fail the test)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape != b.shape or np.abs(a - b).max() > MATTERS, f"{what} does not change the reference"


def dense_sparse(results: list, width: int) -> np.ndarray:
    out = np.zeros((len(results), width), dtype=np.float32)
    for row, (ids, weights) in enumerate(results):
        assert np.all(np.diff(ids) > 0), "sparse ids must ascend"
        out[row, ids] = weights
    return out


def assert_sparse_close(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    """The same non-zeros, each weight within 1e-5 relative (SPLADE's weights reach the tens)."""
    assert np.array_equal(got != 0, ref != 0), f"{what}: the non-zero dimensions differ"
    rel = np.abs(got.astype(np.float64) - ref) / np.maximum(np.abs(ref.astype(np.float64)), 1.0)
    assert rel.max() <= TOL, f"{what}: max relative diff {rel.max():.3g}"


def mixed(n: int) -> list[str]:
    return ["query" if i % 2 == 0 else "document" for i in range(n)]


# ---- encoder embedders and T5 -------------------------------------------------------------------

EMBEDDERS = {
    "bert mean, prompt left out of pooling": lambda tmp: zoo.build_bert_prompts(tmp, include_prompt=False),
    "bert max": lambda tmp: zoo.build_st(tmp, "bert", pooling_mode="max"),
    "bert ST 2.x layout, cls+mean, Dense": lambda tmp: zoo.build_bert_old_layout(tmp, ("cls", "mean"), dense=True),
    "xlmr cls": lambda tmp: zoo.build_st(tmp, "xlmr", pooling_mode="cls"),
    "roberta mean": lambda tmp: zoo.build_encoder(tmp, "roberta"),
    "mpnet mean": lambda tmp: zoo.build_encoder(tmp, "mpnet"),
    "distilbert mean": lambda tmp: zoo.build_encoder(tmp, "distilbert"),
    "modernbert mean": lambda tmp: zoo.build_encoder(tmp, "modernbert"),
    "deberta-v2 mean": lambda tmp: zoo.build_encoder(tmp, "deberta-v2"),
    "sentence-t5": lambda tmp: zoo.build_sentence_t5(tmp),
}


@pytest.mark.parametrize("family", list(EMBEDDERS))
def test_encoder_embedders_equal_st(family, tmp_path):
    """Pooling (and the modules after it) as ST's encode gives it, the model's default prompt
    included; a text past max_seq_length (128) cut there."""
    from sentence_transformers import SentenceTransformer

    path = EMBEDDERS[family](tmp_path)
    st = SentenceTransformer(path, device="cpu")
    model = InProcess(path)
    assert_close(model.vectors(TEXTS), st.encode(TEXTS), family)
    if family.startswith("bert mean"):  # the default prompt, its tokens left out of the mean
        assert_close(model.vectors(TEXTS, prompt_name="passage"), st.encode(TEXTS, prompt_name="passage"),
                     f"{family}, prompt_name='passage'")
        assert_differs(st.encode(TEXTS), st.encode(TEXTS, prompt_name="passage"), "the prompt")


# ---- decoder embedders --------------------------------------------------------------------------

def build_bidirectional_gemma3(target: Path) -> str:
    """EmbeddingGemma's shape, tiny: a Gemma 3 text model with bidirectional attention and a 16-token
    sliding window, mean pooled, Normalize, saved by sentence-transformers (the Qwen-style tokenizer)."""
    import torch
    import transformers as tf
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    tok = zoo.qwen_tokenizer()
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    config = tf.Gemma3TextConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
                                 pad_token_id=eot, eos_token_id=eot, bos_token_id=eot, sliding_window=16,
                                 use_bidirectional_attention=True, initializer_range=zoo.INIT_RANGE)
    hf_dir = target / "hf-gemma3"
    tf.Gemma3TextModel(config).save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    path = target / "st-gemma3-bidirectional"
    SentenceTransformer(modules=[Transformer(str(hf_dir)), Pooling(32, "mean"), Normalize()], device="cpu",
                        prompts={"query": "task: search result | query: "}).save(str(path))
    shutil.rmtree(hf_dir)
    return str(path)


DECODERS = {
    "qwen3 last token": lambda tmp: zoo.build_decoder_embedder(tmp, "qwen3"),
    "gemma3 bidirectional mean": build_bidirectional_gemma3,
}


@pytest.mark.parametrize("family", list(DECODERS))
def test_decoder_embedders_equal_st(family, tmp_path):
    """Last-token pooling after left padding (ST's) against the pipeline's unpadded rows, and a
    bidirectional decoder's mean; the query prompt in front."""
    from sentence_transformers import SentenceTransformer

    path = DECODERS[family](tmp_path)
    st = SentenceTransformer(path, device="cpu")
    model = InProcess(path)
    assert_close(model.vectors(TEXTS), st.encode(TEXTS), family)
    query = st.encode(TEXTS, prompt_name="query")
    assert_differs(query, st.encode(TEXTS), "the query prompt")
    assert_close(model.vectors(TEXTS, prompt_name="query"), query, f"{family}, prompt_name='query'")


# ---- cross-encoders and LLM rerankers -----------------------------------------------------------

def test_cross_encoder_scores_equal_st(tmp_path):
    """One label: score() is ST's predict (sigmoid of the logit), pairs with token types, cut
    longest-first at 128."""
    from sentence_transformers import CrossEncoder

    path = zoo.build_cross_encoder(tmp_path, num_labels=1)
    model = InProcess(path)
    got = np.concatenate(model.run(PAIRS, "score", pairs=True))
    assert_close(got, CrossEncoder(path, device="cpu").predict(PAIRS), "cross-encoder scores")


def test_nli_cross_encoder_classifies_pairs_as_st(tmp_path):
    """Three labels (an NLI cross-encoder, DeBERTa-v3's shape): classify of (text, text_pair) is
    ST's predict(apply_softmax=True); use_activation=False its logits."""
    from sentence_transformers import CrossEncoder

    from pooling_pipeline import PoolingParams

    path = zoo.build_cross_encoder(tmp_path, num_labels=3, family="deberta-v2")
    ce = CrossEncoder(path, device="cpu")
    model = InProcess(path)
    assert_close(np.stack(model.run(PAIRS, "classify")), ce.predict(PAIRS, apply_softmax=True), "NLI probabilities")
    raw = model.run(PAIRS, "classify", pooling_params=PoolingParams(use_activation=False))
    assert_close(np.stack(raw), ce.predict(PAIRS), "NLI logits")
    swapped = [(b, a) for a, b in PAIRS]
    assert_differs(ce.predict(PAIRS), ce.predict(swapped), "the pair's order")


def test_llm_reranker_scores_equal_st(tmp_path):
    """Qwen3-Reranker's shape: the pair through the chat template, LogitScore ("yes" - "no") at the
    last position, sigmoid; a long document cut with the template's suffix put back."""
    from sentence_transformers import CrossEncoder

    path = zoo.build_llm_reranker(tmp_path, "qwen3")
    model = InProcess(path)
    pairs = PAIRS + [(TEXTS[0], TEXTS[6] * 3)]
    got = np.concatenate(model.run(pairs, "score", pairs=True))
    assert_close(got, CrossEncoder(path, device="cpu").predict(pairs), "LLM reranker scores")


# ---- sparse (SPLADE) ----------------------------------------------------------------------------

def test_splade_equals_st(tmp_path):
    from sentence_transformers import SparseEncoder

    path = zoo.build_splade(tmp_path)
    ref = SparseEncoder(path, device="cpu").encode(TEXTS, convert_to_tensor=True).to_dense().numpy()
    assert (ref != 0).sum(1).min() > 0
    got = dense_sparse(InProcess(path).run(TEXTS, "sparse_embed"), ref.shape[1])
    assert_sparse_close(got, ref, "SPLADE")


def test_inference_free_splade_takes_each_route_as_st(tmp_path):
    """Query route: SparseStaticEmbedding (no special tokens, a weight per token present); document
    route: MLM + SpladePooling(log1p_relu); both in one batch by per-request routes."""
    from sentence_transformers import SparseEncoder

    path = zoo.build_inference_free_splade(tmp_path)
    se = SparseEncoder(path, device="cpu")
    query = se.encode_query(TEXTS, convert_to_tensor=True).to_dense().numpy()
    document = se.encode_document(TEXTS, convert_to_tensor=True).to_dense().numpy()
    assert_differs(query, document, "the route")
    routes = mixed(len(TEXTS))
    ref = np.stack([query[i] if r == "query" else document[i] for i, r in enumerate(routes)])
    got = dense_sparse(InProcess(path).run(TEXTS, "sparse_embed", route=routes), ref.shape[1])
    assert_sparse_close(got, ref, "inference-free SPLADE, mixed routes")


# ---- multi-vector (ColBERT) ---------------------------------------------------------------------

COLBERTS = {
    "ST 6 MultiVectorEncoder": lambda tmp: zoo.build_colbert(tmp),
    "PyLate layout": lambda tmp: zoo.build_pylate_colbert(tmp),
}


@pytest.mark.parametrize("layout", list(COLBERTS))
def test_colbert_token_vectors_equal_st(layout, tmp_path):
    """Queries: the [Q] prefix, expansion to 16 tokens; documents: [D], cut at 48 tokens, the
    punctuation skiplist dropped; each route's vectors as ST's encode_query / encode_document (a
    route per request too), and the frontend's MaxSim of them as ST's similarity_pairwise."""
    from sentence_transformers import MultiVectorEncoder

    from pooling_pipeline.api import _max_sim

    path = COLBERTS[layout](tmp_path)
    st = MultiVectorEncoder(path, device="cpu")
    model = InProcess(path)
    texts = TEXTS + ["what, then, is it?!"]
    refs = {"query": st.encode_query(texts, convert_to_numpy=True),
            "document": st.encode_document(texts, convert_to_numpy=True)}
    assert_differs(refs["query"][0], refs["document"][0], "the route")
    got = {route: model.run(texts, "token_embed", route=route) for route in refs}
    for route in refs:
        assert_close_each(got[route], [np.asarray(v) for v in refs[route]], f"ColBERT ({layout}), {route}")
    routes = mixed(len(texts))
    assert_close_each(model.run(texts, "token_embed", route=routes),
                      [np.asarray(refs[r][i]) for i, r in enumerate(routes)], f"ColBERT ({layout}), mixed routes")
    scores = np.asarray([_max_sim(q, d) for q, d in zip(got["query"], got["document"])])
    ref = st.similarity_pairwise(refs["query"], refs["document"]).numpy()
    assert np.abs(scores - ref).max() <= TOL * max(1.0, np.abs(ref).max()), "MaxSim"


# ---- static embeddings and Routers --------------------------------------------------------------

STATIC = {
    "StaticEmbedding + Dense + Normalize": lambda tmp: zoo.build_static(tmp, dense=True, normalize=True),
    "model2vec folder": lambda tmp: zoo.build_model2vec(tmp),
}


@pytest.mark.parametrize("layout", list(STATIC))
def test_static_embeddings_equal_st(layout, tmp_path):
    from sentence_transformers import SentenceTransformer

    path = STATIC[layout](tmp_path)
    texts = TEXTS + [""]  # an empty bag: zeros, as ST's EmbeddingBag gives
    assert_close(InProcess(path).vectors(texts), SentenceTransformer(path, device="cpu").encode(texts), layout)


ROUTERS = {
    "dense query / document": lambda tmp: zoo.build_router_dense(tmp),
    "static query route": lambda tmp: zoo.build_router_static_query(tmp),
}


@pytest.mark.parametrize("layout", list(ROUTERS))
def test_routers_equal_st(layout, tmp_path):
    """Each request runs its route (per-request routes: one batch split and put back in order);
    no route named is the Router's default ("document")."""
    from sentence_transformers import SentenceTransformer

    path = ROUTERS[layout](tmp_path)
    st = SentenceTransformer(path, device="cpu")
    query, document = st.encode_query(TEXTS), st.encode_document(TEXTS)
    assert_differs(query, document, "the route")
    routes = mixed(len(TEXTS))
    model = InProcess(path)
    assert_close(model.vectors(TEXTS, route=routes),
                 np.stack([query[i] if r == "query" else document[i] for i, r in enumerate(routes)]),
                 f"Router ({layout}), mixed routes")
    assert_close(model.vectors(TEXTS), st.encode(TEXTS), f"Router ({layout}), the default route")


# ---- token classification -----------------------------------------------------------------------

def test_token_classification_equals_transformers(tmp_path):
    """Every token's label probabilities (softmax), special tokens included, as transformers'
    BertForTokenClassification gives them."""
    import torch
    from tiny_models import build_bert
    from transformers import AutoTokenizer, BertForTokenClassification

    path = build_bert(tmp_path / "token-cls", BertForTokenClassification, num_labels=5)
    hf, tok = BertForTokenClassification.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    texts = TEXTS[:6] + TEXTS[7:]
    got = InProcess(path).run(texts, "token_classify")
    with torch.inference_mode():
        ref = [torch.softmax(hf(**tok(t, return_tensors="pt")).logits[0], -1).numpy() for t in texts]
    assert_close_each(got, ref, "token classification")


# ---- dual encoders (images) ---------------------------------------------------------------------

def tiny_images() -> list:
    """Two small RGB images of different sizes and aspect ratios (resized and cropped to 224)."""
    from PIL import Image

    rng = np.random.default_rng(7)
    return [Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)),
            Image.fromarray(np.linspace(0, 255, 300 * 90 * 3).astype(np.uint8).reshape(90, 300, 3))]


DUAL_ENCODERS = {"clip": lambda tmp: zoo.build_clip(tmp, layout="st"), "siglip": lambda tmp: zoo.build_siglip(tmp),
                 "siglip2 NaFlex": lambda tmp: zoo.build_siglip2(tmp)}


@pytest.mark.parametrize("family", list(DUAL_ENCODERS))
def test_dual_encoders_equal_st_for_texts_and_images(family, tmp_path):
    """Texts on the text tower, images (resized, cropped and normalized) on the image tower; one
    call may mix both. SigLIP's text tower pools its last position: each text as ST encodes it alone."""
    from sentence_transformers import SentenceTransformer

    path = DUAL_ENCODERS[family](tmp_path)
    st = SentenceTransformer(path, device="cpu")
    texts, images = TEXTS[:3] + TEXTS[7:], tiny_images()
    text_ref = np.concatenate([st.encode([t]) for t in texts])
    image_ref = st.encode(images)
    assert_differs(image_ref[0], image_ref[1], "the image")
    got = InProcess(path).vectors(texts + images)
    assert_close(got, np.concatenate([text_ref, image_ref]), f"{family}, texts and images in one call")


def test_clap_equals_st_for_texts_and_clips(tmp_path):
    """Texts on the text tower, clips (arrays of two lengths, a WAV file decoded as load_audio
    decodes it) through the feature extractor in the worker and the audio tower; one call mixes them."""
    from sentence_transformers import SentenceTransformer
    from test_clap import clip, write_wav

    path = zoo.build_clap(tmp_path / "model")
    st = SentenceTransformer(path, device="cpu")
    clips = [clip(1, 0), clip(3, 1), write_wav(tmp_path / "a.wav", clip(2, 2))]
    texts = TEXTS[:3]
    clip_ref, text_ref = st.encode(clips), st.encode(texts)
    assert_differs(clip_ref[0], clip_ref[1], "the clip")
    got = InProcess(path).vectors(texts + clips)
    assert_close(got, np.concatenate([text_ref, clip_ref]), "clap, texts and clips in one call")


# ---- PEFT adapters and half-precision checkpoints -----------------------------------------------

def test_peft_adapter_is_merged_as_st_applies_it(tmp_path):
    """A LoRA adapter saved by peft in the Transformer's folder beside the base weights: merged at
    load, equal to ST with the adapter (unmerged, through peft)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    base = zoo.build_st(tmp_path, "bert", name="st-bert")
    path = tmp_path / "st-bert-lora"
    shutil.copytree(base, path)
    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], init_lora_weights=False)
    get_peft_model(AutoModel.from_pretrained(str(path)), config).save_pretrained(str(path))
    ref = SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    assert_differs(ref, SentenceTransformer(base, device="cpu").encode(TEXTS), "the adapter")
    model = InProcess(str(path))
    assert "merged" in model.runner.backend_info.get("adapter", ""), model.runner.backend_info
    assert_close(model.vectors(TEXTS), ref, "LoRA adapter")


def test_half_precision_checkpoint_runs_in_float32_as_st_does_asked(tmp_path):
    """A bfloat16 checkpoint (Qwen3-Embedding ships so) runs in float32 on a CPU: ST loading it
    with dtype float32 is the reference; the start-up facts name the checkpoint's dtype."""
    import torch
    from sentence_transformers import SentenceTransformer

    path = zoo.to_half_checkpoint(zoo.build_decoder_embedder(tmp_path, "qwen3"), "bfloat16")
    ref = SentenceTransformer(path, device="cpu", model_kwargs={"dtype": torch.float32}).encode(TEXTS)
    model = InProcess(path)
    assert model.runner.backend_info["checkpoint_dtype"] == "bfloat16", model.runner.backend_info
    assert_close(model.vectors(TEXTS), ref, "bfloat16 checkpoint in float32")
