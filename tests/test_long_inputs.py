"""Long inputs end to end: left truncation, long_inputs="error" and "chunk" (against a hand-computed reference)."""

import time

import corpus
import numpy as np
import psutil
import pytest
import torch
from tiny_models import build_bert

from pooling_pipeline import Pipeline, PoolingParams, StepError
from pooling_pipeline.inputs import MESSAGE_CHARS, build_requests
from pooling_pipeline.options import CallOptions

TOL = 1e-5


def test_left_truncation_keeps_the_last_tokens(pipe, st_model):
    doc = corpus.long_document(150_000, seed=21)
    tok = st_model.tokenizer
    tok.truncation_side = "left"
    try:
        ids = tok(doc, truncation=True, max_length=256)["input_ids"]
    finally:
        tok.truncation_side = "right"
    left = pipe.embed([doc, "short"], truncation_side="left", use_tqdm=False)
    ref = pipe.embed([{"prompt_token_ids": ids}], use_tqdm=False)
    assert left[0].num_prompt_tokens == 256
    np.testing.assert_allclose(left[0].embedding, ref[0].embedding, atol=TOL, rtol=0)
    np.testing.assert_allclose(left[1].embedding, st_model.encode("short"), atol=TOL, rtol=0)
    # Token ids are cut on the same side: the last ones kept with truncation_side="left".
    long_ids = np.asarray(tok(doc[:20_000])["input_ids"], np.int32)
    for side, kept in (("left", long_ids[-40:]), ("right", long_ids[:40])):
        for prompt in (long_ids, {"prompt_token_ids": long_ids.tolist()}):  # the fast path and the other
            cut = pipe.embed([prompt], truncation_side=side, truncate_prompt_tokens=40, use_tqdm=False)[0]
            whole = pipe.embed([kept], use_tqdm=False)[0]
            assert cut.num_prompt_tokens == 40
            np.testing.assert_allclose(cut.embedding, whole.embedding, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="truncation_side must be one of 'left', 'right' or None"):
        pipe.embed([doc], truncation_side="middle")


def test_long_inputs_error_names_the_request_and_its_size(pipe):
    doc = corpus.long_document(400_000, seed=22)
    with pytest.raises(ValueError, match=r"request 2: .*prompt has at least \d+ tokens, more than the 256"):
        pipe.embed(["fine", "also fine", doc], long_inputs="error", use_tqdm=False)
    medium = " ".join(["word"] * 300)  # short enough to count exactly
    with pytest.raises(ValueError, match="request 0: .*prompt has 302 tokens, more than the 256"):
        pipe.embed([medium], long_inputs="error", use_tqdm=False)
    assert len(pipe.embed(["fine"], long_inputs="error", use_tqdm=False)) == 1
    with pytest.raises(ValueError, match="long_inputs must be"):
        pipe.embed(["x"], long_inputs="drop")


def test_long_inputs_error_refuses_token_ids_over_the_length_as_it_refuses_a_text(pipe):
    """Token ids were cut to max_tokens whatever the call said: long_inputs='error' is a refusal naming the
    request and its length, in every form they come in (the packed fast path and a dict prompt); the
    others of the call keep their results (errors='return') and ids that fit are used as they are."""
    fits = [101, *[2000 + k for k in range(20)], 102]
    over = [101, *[2000 + k % 500 for k in range(598)], 102]  # 600 ids
    for prompt in (over, {"prompt_token_ids": over}):
        with pytest.raises(ValueError, match=r"request 1: .*prompt has 600 tokens, more than the 256"):
            pipe.embed([fits, prompt], long_inputs="error", use_tqdm=False)
    outs = pipe.embed([fits, over, {"prompt_token_ids": fits}], long_inputs="error", errors="return", use_tqdm=False)
    assert outs[1].error is not None and "600 tokens" in outs[1].error
    reference = pipe.embed([fits], use_tqdm=False)[0].embedding
    for out in (outs[0], outs[2]):
        np.testing.assert_allclose(out.embedding, reference, atol=1e-5, rtol=0)
    cut, first_256 = pipe.embed([over, over[:256]], use_tqdm=False)  # (the default still cuts, on the right)
    np.testing.assert_allclose(cut.embedding, first_256.embedding, atol=1e-5, rtol=0)


def test_score_long_inputs_error_refuses_a_scored_text_over_the_length(pipe, st_model):
    """An embedding model's score embeds each text: with long_inputs='error' one over the 256 tokens kept is
    refused, naming it (its request: the queries first, then the documents) and its count; the default
    still cuts it, as ST's encode does. 'chunk' is no score's."""
    medium = " ".join(["word"] * 300)  # 302 tokens: counted exactly
    with pytest.raises(ValueError, match="request 2: .*prompt has 302 tokens, more than the 256"):
        pipe.score("a query", ["fine", medium], long_inputs="error", use_tqdm=False)
    for docs, options in ((["fine"], {"long_inputs": "error"}), ([medium], {})):
        got = [out.score for out in pipe.score("a query", docs, use_tqdm=False, **options)]
        ref = st_model.similarity(st_model.encode(["a query"]), st_model.encode(docs)).numpy()[0]
        np.testing.assert_allclose(got, ref, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="long_inputs='chunk' .* not score"):
        pipe.score("a query", ["fine"], long_inputs="chunk", use_tqdm=False)


def _chunk_reference(st_model, doc: str, max_tokens: int, overlap: int) -> tuple[np.ndarray, int]:
    """By hand: whole-document ids, windows, one forward per window, token-weighted mean, normalize."""
    tok, model = st_model.tokenizer, st_model[0].auto_model
    ids = tok(doc, add_special_tokens=False)["input_ids"]
    width, step = max_tokens - 2, max_tokens - 2 - overlap
    starts = [0]
    while starts[-1] + width < len(ids):
        starts.append(starts[-1] + step)
    total, tokens = np.zeros(384), 0
    with torch.inference_mode():
        for s in starts:
            window = [tok.cls_token_id, *ids[s:s + width], tok.sep_token_id]
            hidden = model(input_ids=torch.tensor([window])).last_hidden_state[0]
            total += hidden.mean(0).double().numpy() * len(window)
            tokens += len(window)
    vec = total / tokens
    return vec / np.linalg.norm(vec), len(starts)


def test_chunk_mode_equals_a_hand_computed_reference_and_keeps_order(pipe, st_model):
    docs = [corpus.long_document(n, seed=23 + n) for n in (3_000, 9_000, 1_000)]
    prompts = [docs[0], "a short sentence in between", docs[1], docs[2]]
    outs = pipe.embed(prompts, long_inputs="chunk", chunk_overlap=32, truncate_prompt_tokens=128, use_tqdm=False)
    assert [o.index for o in outs] == [0, 1, 2, 3]
    for prompt, out in zip(prompts, outs):
        ref, windows = _chunk_reference(st_model, prompt, 128, 32)
        assert out.num_chunks == windows
        np.testing.assert_allclose(out.embedding, ref, atol=TOL, rtol=0)
    assert outs[1].num_chunks == 1 and outs[2].num_chunks > 5
    dims = pipe.embed(docs[:1], long_inputs="chunk", pooling_params=PoolingParams(dimensions=64), use_tqdm=False)
    assert dims[0].embedding.shape == (64,) and abs(np.linalg.norm(dims[0].embedding) - 1) < 1e-5
    with pytest.raises(ValueError, match="chunk_overlap=200 leaves no room"):
        pipe.embed(docs[:1], long_inputs="chunk", chunk_overlap=200, truncate_prompt_tokens=128, use_tqdm=False)


def _peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float(psutil.Process(pid).memory_info().rss) / 2**20


@pytest.mark.slow
def test_chunk_mode_on_a_million_token_document_stays_bounded(tmp_path, model_path):
    """A tiny model keeps the forward pass short; what is measured is the pipeline's memory."""
    target = build_bert(tmp_path / "tiny", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=512)
    doc = corpus.long_document(4_100_000, seed=24)  # about a million tokens
    with Pipeline(model=str(target)) as pipe:
        before = {pid: _peak_rss_mb(pid) for pid in [pipe.pids["engine"], *pipe.pids["workers"]]}
        out = pipe.embed([doc, "after it"], long_inputs="chunk", use_tqdm=False)
        after = {pid: _peak_rss_mb(pid) for pid in before}
        stats = pipe.stats()
    assert out[0].num_prompt_tokens > 1_000_000 and out[0].num_chunks > 1900
    assert stats["max_in_core_seen"] <= pipe.engine_window
    for pid in before:  # a few times the document's 4 MB of text, not its token objects
        assert after[pid] - before[pid] < 400, (pid, before[pid], after[pid])


@pytest.mark.slow
@pytest.mark.parametrize("errors", ["raise", "return"])
def test_a_failed_step_listing_two_chunks_of_one_document(faulty_pipe, errors):
    """A step can fail with several chunks of one document in it (the engine fails every waiting
    request when scheduling itself fails). The document fails once -- StepError, or one error
    output -- and everything else is unharmed."""
    import threading

    import zmq

    from pooling_pipeline.core.shared import messages as m

    pipe, _ = faulty_pipe  # the session's (test_process_group's step failure uses it too)
    doc = corpus.long_document(400_000, seed=25)  # hundreds of chunks: still in flight after a second
    group = pipe._group

    def fail_two_chunks_of_the_document() -> None:
        time.sleep(1.0)
        call = next(iter(pipe._dispatcher.calls.values()))
        assert call._owns(0)  # the document, still in flight
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.connect(group.endpoints["results"])
        sock.send_multipart(group.encoder.encode(m.StepFailed(calls=[call.prefix, call.prefix], indices=[0, 0],
                                                              error="RuntimeError: boom")))
        sock.close(linger=1000)

    injector = threading.Thread(target=fail_two_chunks_of_the_document)
    injector.start()
    try:
        if errors == "raise":
            with pytest.raises(StepError, match="boom"):
                pipe.embed([doc, "short text"], long_inputs="chunk", use_tqdm=False)
        else:
            outs = pipe.embed([doc, "short text"], long_inputs="chunk", errors="return", use_tqdm=False)
            assert "boom" in outs[0].error and outs[0].data is None
            assert outs[1].error is None
    finally:
        injector.join()
    assert pipe.embed(["the next call works"], use_tqdm=False)[0].error is None


def _cjk_text(num_chars: int, seed: int) -> str:
    """Ideographs (BMP and plane 2) with a fullwidth comma or full stop now and then: no space anywhere."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0x4E00, 0x9FA6, num_chars)
    codes[rng.random(num_chars) < 0.001] = 0x20000 + rng.integers(0, 0xA6D0)  # CJK extension B
    codes[rng.random(num_chars) < 0.02] = rng.choice([0xFF0C, 0x3002])  # ， 。 (punctuation: pre-tokens of their own)
    return codes.astype("<u4").tobytes().decode("utf-32-le")


class _CountingTokenizer:
    """A `tokenizers.Tokenizer` that counts the characters it is asked to tokenize."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.characters = tokenizer, 0

    def encode(self, text, *args, **kwargs):
        self.characters += len(text)
        return self.tokenizer.encode(text, *args, **kwargs)

    def encode_batch(self, texts, *args, **kwargs):
        self.characters += sum(map(len, texts))
        return self.tokenizer.encode_batch(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def _characters_tokenized(model_path: str, text: str, keep: int, left: bool) -> int:
    """How many characters the render worker's truncating tokenizer tokenizes to keep `keep` tokens."""
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec
    from pooling_pipeline.workers.render import load_tokenizer
    from pooling_pipeline.workers.truncation import TruncatingTokenizer

    planner = TruncatingTokenizer(load_tokenizer(load_model_spec(model_path)))
    planner.tokenizer = counting = _CountingTokenizer(planner.tokenizer)
    planner.batch_tokenizer = _CountingTokenizer(planner.batch_tokenizer)
    ids = planner.encode(text, keep, left=left)
    assert len(ids) == keep
    return counting.characters + planner.batch_tokenizer.characters


@pytest.mark.slow
def test_millions_of_cjk_characters_without_spaces_cost_what_256_tokens_cost(model_path, st_model):
    """A 2M-character CJK text with no whitespace (one pre-token per ideograph, for BERT): each
    truncation side gives sentence-transformers' vector, in seconds, without the render worker
    tokenizing the whole text (3M such characters tokenized whole cost a worker 1.3 GB). 10M
    characters measured on this (loaded) 2-core machine: 2-4.6 s a side, the worker's peak +71 MB;
    sentence-transformers 89 s and 5.9 GB for the same vector (within 1.5e-8)."""
    text = _cjk_text(2_000_000, seed=25)
    with Pipeline(num_render_workers=1) as pipe:
        worker = pipe.pids["workers"][0]
        before = _peak_rss_mb(worker)
        right = pipe.embed([text, "短い"], use_tqdm=False)
        left = pipe.embed([text], truncation_side="left", use_tqdm=False)
        grew = _peak_rss_mb(worker) - before
    assert right[0].num_prompt_tokens == left[0].num_prompt_tokens == 256
    assert grew < 300, grew  # the text is 8 MB as UTF-32; its tokens, whole, would be ~600 MB
    # What the cost is, counted rather than timed (a bound that holds on any machine): the
    # characters the worker's truncating tokenizer hands to `tokenizers` to keep 256 tokens.
    for left_side in (False, True):
        counted = _characters_tokenized(model_path, text, 256, left_side)
        assert counted < 20_000, (left_side, counted)  # of 2,000,000: a small multiple of what is kept
    np.testing.assert_allclose(right[0].embedding, st_model.encode(text), atol=TOL, rtol=0)
    np.testing.assert_allclose(right[1].embedding, st_model.encode("短い"), atol=TOL, rtol=0)
    st_model.tokenizer.truncation_side = "left"
    try:
        np.testing.assert_allclose(left[0].embedding, st_model.encode(text), atol=TOL, rtol=0)
    finally:
        st_model.tokenizer.truncation_side = "right"


@pytest.mark.slow
def test_chunk_mode_on_cjk_without_spaces_equals_a_hand_computed_reference(pipe, st_model):
    """Chunk mode tokenizes a long document in pieces of ~64k characters: here the pieces of a CJK
    text without spaces are cut between ideographs, and the windows are those of the whole text's ids."""
    from pooling_pipeline.workers.truncation import CHUNK_TOKENIZE_CHARS

    doc = _cjk_text(CHUNK_TOKENIZE_CHARS + 6_000, seed=26)  # two pieces
    [out] = pipe.embed([doc], long_inputs="chunk", use_tqdm=False)
    ref, windows = _chunk_reference(st_model, doc, 256, 0)
    assert out.num_chunks == windows
    np.testing.assert_allclose(out.embedding, ref, atol=TOL, rtol=0)


@pytest.mark.slow
def test_long_documents_travel_to_the_workers_in_messages_of_bounded_size(pipe, st_model):
    """The engine waits for a worker's whole message: long documents go a few at a time (alone
    past MESSAGE_CHARS), so the first reaches the engine without waiting for the others to be
    shipped and rendered; short texts still share one message; results stay in order."""
    docs = [corpus.long_document(150_000 + 100_000 * (i % 3), seed=i) for i in range(7)]
    short = [f"sentence number {i}" for i in range(40)]
    prompts = docs[:3] + short + docs[3:]
    opts = CallOptions(task="embed", use_tqdm=False)
    for materialized in (True, False):
        source, _ = build_requests(list(prompts) if materialized else iter(prompts), opts, pipe.model_spec,
                                   pipe._tokenization, "probe")
        if materialized:  # a list is checked whole first, as the API does
            pieces = list(source.drain(256).pieces)
        else:  # a generator is drawn as the frontend draws it: 256 slots granted, 64 MB of room
            pieces = []
            while not source.exhausted:
                pieces += source.take(256, 64 << 20)
        sizes = [[len(prompts[i]) for i in piece.indices] for piece in pieces]
        assert [i for piece in pieces for i in piece.indices] == list(range(len(prompts)))
        for held in sizes:  # up to the bound, one request at least
            assert sum(held[:-1]) < MESSAGE_CHARS, (materialized, sizes)
        assert len(sizes) >= len(docs) // 2 + 1, sizes  # the long documents were split up ...
        assert max(map(len, sizes)) >= len(short), sizes  # ... the short texts were not
    got = pipe.embed(prompts, use_tqdm=False)
    want = st_model.encode(prompts)
    np.testing.assert_allclose(np.stack([out.embedding for out in got]), want, atol=TOL, rtol=0)
