"""Images: CLIP and SigLIP dual encoders equal sentence-transformers 6 (float32 on the CPU, within
1e-5 per vector) for every input form ST takes and every test image (formats, modes, EXIF
rotation, alpha, palette, 16-bit, CMYK); bad images are per-request errors; what the pipeline
cannot serve is refused at start-up, naming it."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from image_samples import build_broken_files, refused_here
from model_zoo import build_clip, build_siglip

TOL = 1e-5
TEXTS = ["a photo of a cat", "two dogs playing in the snow near a red house", "x", "an empty street at night " * 3]


@pytest.fixture(scope="module")
def clip_pipe(clip_dir):
    from pooling_pipeline import Pipeline

    with Pipeline(model=clip_dir, num_render_workers=1) as p:
        yield p


def vectors(pipe, inputs, **kwargs) -> np.ndarray:
    return np.stack([o.embedding for o in pipe.embed(inputs, use_tqdm=False, **kwargs)])


def data_uri(path) -> str:
    kind = path.suffix.lstrip(".").replace("jpg", "jpeg")
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def test_every_image_file_in_every_form_equals_st(clip_pipe, clip_st, images, image_backend):
    """A path, a data URI, {"image": path}, {"image": bytes}: opened as transformers' load_image opens
    them (EXIF rotation, RGB) for a PIL processor, decoded by the processor itself for a torchvision
    one (as ST hands it the path); a PIL image (opened lazily, or loaded) goes to the processor as it
    is. A file this environment's processor does not decode to 8-bit RGB is refused, naming it."""
    from PIL import Image

    refused = refused_here(image_backend)
    served = {name: path for name, path in images.items() if name not in refused}
    paths = [str(p) for p in served.values()]
    by_path = clip_st.encode(paths)
    opened = [Image.open(p) for p in images.values()]
    by_pil = clip_st.encode([Image.open(p) for p in images.values()])
    forms = {
        "path": (paths, by_path),
        "data URI": ([data_uri(p) for p in served.values()], by_path),
        "{'image': path}": ([{"image": p} for p in paths], by_path),
        "{'image': bytes}": ([{"image": p.read_bytes()} for p in served.values()], by_path),
        "PIL (lazy)": (opened, by_pil),
        "PIL (loaded)": ([im.copy() for im in (Image.open(p) for p in images.values())], by_pil),
    }
    for form, (inputs, reference) in forms.items():
        got = vectors(clip_pipe, inputs)
        assert got.shape == reference.shape
        worst = np.abs(got - reference).max(axis=1)
        assert worst.max() <= TOL, f"{form}: {dict(zip(images, worst.round(7)))}"
    # The forms differ where ST's do: a path's alpha is dropped, a PIL image's composited on white.
    alpha = list(images).index("alpha.png")
    assert np.abs(by_path[list(served).index("alpha.png")] - by_pil[alpha]).max() > 1e-3
    for name, why in refused.items():  # each alone, the call around it served
        outs = clip_pipe.embed([paths[0], str(images[name])], use_tqdm=False, errors="return")
        assert outs[0].error is None and "request 1" in outs[1].error and why in outs[1].error, (name, outs[1].error)
        if why == "cannot be decoded":
            with pytest.raises(RuntimeError):  # (ST fails on it too)
                clip_st.encode([str(images[name])])


def test_files_open_as_load_image_opens_them(clip_dir, images):
    """The worker's opening of a file is transformers' load_image without its copies: same mode,
    size, pixels and info, for every test image (EXIF rotation, CMYK, palette, 16-bit, ...)."""
    import platform

    from PIL import Image
    from transformers.image_utils import load_image

    from pooling_pipeline.core.shared.model_folder.load import load_model_spec
    from pooling_pipeline.workers.images import ImageRenderer

    renderer = ImageRenderer(load_model_spec(clip_dir))
    # (glibc's malloc keeps what a worker freed for the next image: nothing else to tune elsewhere)
    assert renderer.malloc_tuned == (platform.libc_ver()[0] == "glibc")
    for name, path in images.items():
        expected, got = load_image(str(path)), renderer.upright_rgb(Image.open(path))
        assert (got.mode, got.size, got.info) == (expected.mode, expected.size, expected.info), name
        assert got.tobytes() == expected.tobytes(), name


def test_arrays_and_tensors_equal_st(clip_pipe, clip_st, images):
    import torch
    from PIL import Image

    rgb = np.asarray(Image.open(images["photo.jpg"]).convert("RGB"))
    inputs = [rgb, np.ascontiguousarray(rgb.transpose(2, 0, 1)), np.asarray(Image.open(images["alpha.png"])),
              torch.from_numpy(rgb.copy())]
    reference = np.concatenate([clip_st.encode([x]) for x in inputs])
    assert np.abs(vectors(clip_pipe, inputs) - reference).max() <= TOL
    single = clip_pipe.embed(rgb, use_tqdm=False)  # one image, not a list of rows
    assert len(single) == 1 and np.abs(single[0].embedding - reference[0]).max() <= TOL
    # A float array comes out of the processor's resize as floats, which ST rescales by 1/255 once
    # more; the pipeline sends uint8 pixels, so it refuses such an array, naming it.
    with pytest.raises(ValueError, match="request 0: .*dtype <f4 gives float32 pixels"):
        clip_pipe.embed([rgb.astype(np.float32) / 255], use_tqdm=False)


def test_texts_and_a_mixed_call_equal_st(clip_pipe, clip_st, images):
    """Texts run the text tower; a call mixing texts and images routes each input (ST refuses such a
    batch: each side here equals ST's encode of that modality)."""
    text_ref = clip_st.encode(TEXTS)
    assert np.abs(vectors(clip_pipe, TEXTS) - text_ref).max() <= TOL
    image_ref = clip_st.encode([str(images["photo.jpg"]), str(images["palette.png"])])
    mixed = vectors(clip_pipe, [TEXTS[0], str(images["photo.jpg"]), {"text": TEXTS[1]}, str(images["palette.png"])])
    assert np.abs(mixed - np.stack([text_ref[0], image_ref[0], text_ref[1], image_ref[1]])).max() <= TOL
    with pytest.raises(ValueError, match="mixes multiple modalities"):
        clip_st.encode([TEXTS[0], str(images["photo.jpg"])])


def test_score_and_similarity_between_texts_and_images_equal_st(clip_pipe, clip_st, clip_dir, images):
    from pooling_pipeline.integrations.sentence_encoder import SentenceEncoder

    pictures = [str(images["photo.jpg"]), str(images["rotated.jpg"])]
    reference = clip_st.similarity(clip_st.encode(TEXTS[:2]), clip_st.encode(pictures)).numpy()
    scores = [o.score for o in clip_pipe.score(TEXTS[:2], pictures, use_tqdm=False)]
    assert np.abs(np.asarray(scores) - np.diag(reference)).max() <= TOL
    from PIL import Image

    encoder = SentenceEncoder(clip_dir, num_render_workers=1)
    try:
        got = encoder.similarity(encoder.encode(TEXTS[:2]), encoder.encode(pictures)).numpy()
        one = encoder.encode(Image.open(pictures[0]))  # one image, not a batch: a 1-D vector, as ST gives
    finally:
        encoder.close()
    assert np.abs(got - reference).max() <= TOL
    reference_one = clip_st.encode(Image.open(pictures[0]))
    assert one.shape == reference_one.shape == (16,) and np.abs(one - reference_one).max() <= TOL


def test_bad_images_are_per_request_errors(clip_pipe, clip_st, images, tmp_path):
    """Each bad input fails alone, naming its request and why; the good ones in the call are intact."""
    broken = build_broken_files(tmp_path, images["photo.jpg"])
    good = str(images["photo.jpg"])
    bad = {**{name: str(path) for name, path in broken.items()},
           "url": "https://example.com/cat.jpg", "bad bytes": {"image": b"\x00garbage"},
           "message": {"role": "user", "content": "a cat"}, "fused": {"image": good, "text": "a cat"},
           "bad data URI": "data:image/png;base64,AAAA"}
    why = {"truncated": "truncated", "not an image": "cannot identify", "empty": "cannot identify",
           "bomb": "decompression bomb", "url": "not fetched", "bad bytes": "cannot identify",
           "message": "chat-style", "fused": "fuses modalities", "bad data URI": "cannot"}
    inputs = [good]
    for value in bad.values():
        inputs += [value, good]
    outs = clip_pipe.embed(inputs, use_tqdm=False, errors="return")
    reference = clip_st.encode([good])[0]
    for k, out in enumerate(outs):
        if k % 2 == 0:
            assert out.error is None and np.abs(out.embedding - reference).max() <= TOL
        else:
            name = list(bad)[k // 2]
            assert out.error is not None and f"request {k}" in out.error and why[name] in out.error, (name, out.error)
    with pytest.raises(ValueError, match="request 1: .*truncated"):
        clip_pipe.embed([good, str(broken["truncated"])], use_tqdm=False)
    assert np.abs(vectors(clip_pipe, [good])[0] - reference).max() <= TOL  # the group serves on


@pytest.mark.slow
def test_a_worker_killed_amid_a_batch_of_images_loses_and_doubles_nothing(clip_dir, clip_st, tmp_path):
    """A worker sends a batch's images to the engine in parts as it renders them; one killed amid a
    batch is replaced, what it left unanswered comes again from the other worker, and each image
    comes back once, equal to ST's vector (an answer from a part it had already sent, arriving after
    the re-send, is a duplicate the frontend drops)."""
    import os
    import signal
    import time

    from PIL import Image

    from pooling_pipeline import Pipeline

    rng = np.random.default_rng(5)
    files = []
    for k in range(4):  # photo-sized, so a batch takes a worker a while to decode
        path = tmp_path / f"photo{k}.jpg"
        Image.fromarray(rng.integers(0, 256, (1200, 1600, 3), dtype=np.uint8)).save(path, quality=90)
        files.append(str(path))
    inputs = [files[k % len(files)] for k in range(160)]
    reference = dict(zip(files, clip_st.encode(files)))

    def killing_at(position: int, victim: int):
        for k, path in enumerate(inputs):  # (drawn as the window frees: the kill lands mid-call)
            if k == position:
                os.kill(victim, signal.SIGKILL)
            yield path

    with Pipeline(model=clip_dir, num_render_workers=2, max_num_seqs=16) as pipe:
        restarts = 0
        for position in (60, 110):
            victim = pipe.pids["workers"][0]
            outs = list(pipe.embed_stream(killing_at(position, victim)))
            assert [o.index for o in outs] == list(range(len(inputs)))  # none lost, none doubled
            got = np.stack([o.embedding for o in outs])
            assert np.abs(got - np.stack([reference[path] for path in inputs])).max() <= TOL
            restarts += pipe.stats()["worker_restarts"]
            deadline = time.monotonic() + 10  # replaced, by this call or by the group's monitor
            while time.monotonic() < deadline and victim in pipe.pids["workers"]:
                time.sleep(0.1)
            assert victim not in pipe.pids["workers"] and len(pipe.pids["workers"]) == 2
        assert restarts >= 1  # at least one death was seen and handled inside a running call


def test_a_text_model_refuses_image_inputs(pipe):
    with pytest.raises(ValueError, match="request 0: an image input, but model .* takes text only"):
        pipe.embed([{"image": b"x"}], use_tqdm=False)


def test_unsupported_image_models_are_refused_at_start_up(clip_dir, tmp_path):
    import json
    import shutil

    from pooling_pipeline import Pipeline
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    vlm = tmp_path / "vlm"
    shutil.copytree(clip_dir, vlm)
    config = json.loads((vlm / "config.json").read_text())
    (vlm / "config.json").write_text(json.dumps({**config, "model_type": "llava", "architectures": ["LlavaModel"]}))
    with pytest.raises(ValueError, match="LlavaModel .*than ColPali and ColQwen2, multimodal rerankers"):
        load_model_spec(vlm)
    audio = tmp_path / "audio"
    shutil.copytree(clip_dir, audio)
    cfg = json.loads((audio / "sentence_bert_config.json").read_text())
    cfg["modality_config"]["audio"] = {"method": "get_audio_features", "method_output_name": "pooler_output"}
    (audio / "sentence_bert_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="modalities .*audio.*multimodal rerankers"):
        load_model_spec(audio)
    with pytest.raises(ValueError, match="quantize='int8' is not supported for a dual encoder"):
        Pipeline(model=clip_dir, quantize="int8")


def test_engine_input_with_pixels_is_checked():
    """A CLIP's engine admits an image row with its one uint8 [C, H, W] item and its vision tokens,
    and refuses, naming the row, pixels of another shape or dtype, an image row without pixels, a
    text row with them, another payload's name; a text model refuses image rows (its family takes none)."""
    from types import SimpleNamespace

    from pooling_pipeline.core.engine.columns import Requests, invalid_rows, row_checks, task_lookup
    from pooling_pipeline.core.families import FAMILIES
    from pooling_pipeline.core.shared.config import ImageSpec
    from pooling_pipeline.core.shared.messages import EngineInputBatch, Payload, PoolingParams

    image = ImageSpec(processor_class="CLIPImageProcessor", channels=3, height=4, width=4, do_rescale=True,
                      rescale_factor=1 / 255, do_normalize=True, mean=[0.5] * 3, std=[0.5] * 3, tokens=3)
    model = SimpleNamespace(max_model_len=8, vocab_size=100, tasks=["embed"], routes=[], image=image)
    family = FAMILIES["dual_encoder"]
    checks = row_checks(family.modalities, family.payloads(model), family.row_rules(model))

    def refused(pixels, modality, counts=None, name="pixels", lengths=(3, 3)):
        counts = np.asarray([int(m == 1) for m in modality] if counts is None else counts, np.int64)
        msg = EngineInputBatch(worker=0, call="c", indices=np.arange(2), lengths=np.array(lengths),
                               token_ids=np.zeros(sum(lengths), np.int32), tasks=["embed"], params=[PoolingParams()],
                               columns={"modality": np.array(modality)},
                               payloads={} if pixels is None else {name: Payload(counts=counts, data=pixels)})
        msg.check()
        return dict(invalid_rows(Requests.from_message(msg), model, task_lookup(model.tasks), msg.columns.keys(),
                                 checks))

    assert refused(np.zeros((2, 3, 4, 4), np.uint8), [1, 1]) == {}
    assert refused(np.zeros((1, 3, 4, 4), np.uint8), [0, 1]) == {}  # a text and an image in one message
    assert "must be |u1 items of shape (3, 4, 4)" in refused(np.zeros((2, 3, 4, 4), np.float32), [1, 1])[0]
    assert "must be |u1 items of shape (3, 4, 4)" in refused(np.zeros((2, 3, 5, 4), np.uint8), [1, 1])[1]
    assert refused(None, [1, 0]) == {0: "an image row must carry its pixels, one image"}
    assert refused(np.zeros((2, 3, 4, 4), np.uint8), [0, 1], counts=[1, 1]) == {0: "a text row carries no pixels"}
    assert "at most 1 items a row" in refused(np.zeros((2, 3, 4, 4), np.uint8), [1, 0], counts=[2, 0])[0]
    assert "payload 'audio' is not one this model takes" in refused(np.zeros((1, 3, 4, 4), np.uint8), [1, 0],
                                                                      counts=[1, 0], name="audio")[0]
    assert "vision tokens" in refused(np.zeros((2, 3, 4, 4), np.uint8), [1, 1], lengths=(3, 4))[1]
    text_model = SimpleNamespace(**{**vars(model), "image": None})
    msg = EngineInputBatch(worker=0, call="c", indices=np.arange(1), lengths=np.array([3]), token_ids=np.zeros(3, np.int32),
                           tasks=["embed"], params=[PoolingParams()], columns={"modality": np.array([1])})
    assert invalid_rows(Requests.from_message(msg), text_model, task_lookup(model.tasks), msg.columns.keys()) == [
        (0, "an image input, but the model takes no images")]
    with pytest.raises(ValueError, match="counts do not add up"):
        EngineInputBatch(worker=0, call="c", indices=np.arange(1), lengths=np.array([3]), token_ids=np.zeros(3, np.int32),
                         tasks=["embed"], params=[PoolingParams()],
                         payloads={"pixels": Payload(counts=np.array([2]), data=np.zeros((1, 3, 4, 4), np.uint8))}).check()


def test_a_worker_sends_images_to_the_engine_a_few_at_a_time():
    """A batch of images is rendered and sent in parts (the engine starts on the first part, not
    after the whole batch); a batch of texts, or of a few images, goes whole."""
    from pooling_pipeline.core.shared import messages as m
    from pooling_pipeline.workers.main import IMAGE_ROWS_PER_PART, parts_to_send_as_rendered

    options = m.RenderOptions(task="embed", max_tokens=77, params=m.PoolingParams())
    n = 2 * IMAGE_ROWS_PER_PART + 3
    items = [m.RenderParams(options=options, media=m.MediaData(path=f"/images/{k}.jpg", nbytes=1)) if k % 5
             else m.RenderParams(options=options, prompt=f"text {k}") for k in range(n)]
    batch = m.RenderBatch(call="c", indices=np.arange(100, 100 + n), items=items, engine=1)
    parts = parts_to_send_as_rendered(batch)
    assert [len(part.items) for part in parts] == [IMAGE_ROWS_PER_PART, IMAGE_ROWS_PER_PART, 3]
    assert np.concatenate([part.indices for part in parts]).tolist() == batch.indices.tolist()
    assert [item for part in parts for item in part.items] == items
    assert all(part.call == "c" and part.engine == 1 and part.check() == len(part.items) for part in parts)
    texts = m.RenderBatch(call="c", indices=np.arange(n), items=[m.RenderParams(options=options, prompt="t")] * n)
    assert parts_to_send_as_rendered(texts) == [texts]
    few = m.RenderBatch(call="c", indices=np.arange(3), items=items[1:4])
    assert parts_to_send_as_rendered(few) == [few]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["legacy", "plain"])
def test_legacy_clip_module_and_plain_folder_equal_st(layout, tmp_path, images):
    from sentence_transformers import SentenceTransformer

    from pooling_pipeline import Pipeline

    path = build_clip(tmp_path, layout=layout, normalize=layout == "legacy")
    st = SentenceTransformer(path, device="cpu")
    inputs = [*TEXTS[:2], str(images["photo.jpg"]), str(images["cmyk.jpg"])]
    reference = np.concatenate([st.encode(TEXTS[:2]), st.encode(inputs[2:])])
    with Pipeline(model=path, num_render_workers=1) as p:
        got = vectors(p, inputs)
    assert np.abs(got - reference).max() <= TOL
    if layout == "legacy":
        assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)


@pytest.mark.slow
def test_siglip_equals_st(tmp_path, images):
    """SigLIP pools its text tower's last position, so ST's batched text results move with the
    batch's padding; the pipeline gives each text ST's result for it encoded alone."""
    from sentence_transformers import SentenceTransformer

    from pooling_pipeline import Pipeline

    path = build_siglip(tmp_path)
    st = SentenceTransformer(path, device="cpu")
    pictures = [str(images["photo.jpg"]), str(images["alpha.png"]), str(images["wide.png"])]
    text_ref = np.stack([st.encode([t])[0] for t in TEXTS])
    assert np.abs(st.encode(TEXTS) - text_ref).max() > 1e-3  # ST's batch differs from its single texts
    with Pipeline(model=path, num_render_workers=1) as p:
        assert np.abs(vectors(p, TEXTS) - text_ref).max() <= TOL
        assert np.abs(vectors(p, pictures) - st.encode(pictures)).max() <= TOL
        engine = p.stats()["engine"]
    # SigLIP's attention-pooling head reads every position: its tower converts whole.
    assert engine["image_tower"] == "openvino" and engine["image_graph"] == "whole tower", engine


@pytest.mark.slow
def test_openvino_image_tower_equals_st(clip_dir, clip_pipe, clip_st, images, tmp_path, monkeypatch):
    """The image tower compiled by OpenVINO (checked against torch at every start), the text tower on
    torch, both within 1e-5 of ST: under the default backend ("auto", on this CPU with the extra
    installed) and backend="openvino", whose second start serves the conversion its first cached.
    (In a cache of their own: the suite's cache is shared by every test a worker runs, and its
    least recently used entries go when it is full -- this test once met its entry evicted.)"""
    import os

    from pooling_pipeline import Pipeline

    monkeypatch.setenv("POOLING_PIPELINE_CACHE", str(tmp_path / "cache"))
    with Pipeline(model=clip_dir, backend="openvino", num_render_workers=1) as p:
        first = p.stats()["engine"]
    assert first["conversion"] == "converted", first

    pictures = [str(images["photo.jpg"]), str(images["alpha.png"]), str(images["wide.png"])]
    default = clip_pipe.stats()["engine"]
    assert default["backend"] == "openvino" and default["image_tower"] == "openvino", default
    assert default["image_graph"] == "class position"  # (core/engine/image_features.py)
    # A step's images split between two streams (in order: the 3 pictures below are one step)
    assert default["image_streams"] == (2 if int(default["torch_threads"]) >= 2 else 1)
    assert default["verified_max_diff"] <= TOL
    with Pipeline(model=clip_dir, backend="openvino", num_render_workers=1) as p:
        got = vectors(p, [*pictures, TEXTS[1]])
        engine = p.stats()["engine"]
    assert engine["backend"] == "openvino" and engine["image_tower"] == "openvino"
    facts = ("conversion", "conversion_cache", "warnings", "image_graph")
    why = {"first": {k: first.get(k) for k in facts}, "second": {k: engine.get(k) for k in facts},
           "cache entries now": sorted(os.listdir(os.path.dirname(engine["conversion_cache"])))}
    assert engine["conversion"] == "cached" and engine["conversion_cache"] == first["conversion_cache"], why
    # the same graph as the default start's (its entry's name is the conversion's key)
    assert os.path.basename(engine["conversion_cache"]) == os.path.basename(default["conversion_cache"]), why
    assert np.abs(got[:3] - clip_st.encode(pictures)).max() <= TOL
    assert np.abs(got[3] - clip_st.encode(TEXTS[1])).max() <= TOL
    np.testing.assert_allclose(got, vectors(clip_pipe, [*pictures, TEXTS[1]]), atol=TOL, rtol=0)


def test_the_class_position_tower_is_clips_whole_tower_and_only_clips(clip_dir, tmp_path):
    """CLIP's image vector reads the last layer's class position only, so the converted tower runs
    that layer there alone: the whole tower's vectors within float32 rounding. A subclass, a
    forward hook or another tower (SigLIP) is converted whole."""
    import torch
    from transformers import AutoModel, CLIPModel

    from pooling_pipeline.core.engine.image_features import ClassPositionCLIP, ImageFeatures, image_features_module

    model = AutoModel.from_pretrained(clip_dir).eval()
    module, graph = image_features_module(model)
    assert isinstance(module, ClassPositionCLIP) and graph == "class position"
    pixels = torch.randn(5, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        whole, trimmed = ImageFeatures(model)(pixels), module(pixels)
    assert whole.shape == trimmed.shape == (5, model.config.projection_dim)
    assert float((whole - trimmed).abs().max()) <= 1e-6 * max(1.0, float(whole.abs().max()))

    class Custom(CLIPModel):
        pass

    assert image_features_module(Custom(model.config).eval())[1] == "whole tower"
    handle = model.vision_model.encoder.layers[-1].mlp.register_forward_hook(lambda *args: None)
    assert image_features_module(model)[1] == "whole tower"
    handle.remove()
    assert image_features_module(model.train())[1] == "whole tower"
    siglip = AutoModel.from_pretrained(build_siglip(tmp_path)).eval()
    assert image_features_module(siglip)[1] == "whole tower"


def test_which_backend_runs_a_dual_encoder():
    """The caller's decision: "auto" reaches the engine (which tries OpenVINO for the image tower on a
    CPU in float32), torch where OpenVINO cannot apply, and what cannot be honoured is refused."""
    from pooling_pipeline.core.families import FAMILIES

    dual_encoder_backend = FAMILIES["dual_encoder"].backend

    assert dual_encoder_backend("auto", None, "cpu", "auto") == "auto"
    assert dual_encoder_backend("auto", None, "cpu", "bfloat16") == "torch"
    assert dual_encoder_backend("auto", None, "sim", "auto") == "torch"
    assert dual_encoder_backend("torch", None, "cpu", "float32") == "torch"
    assert dual_encoder_backend("openvino", None, "cpu", "float32") == "openvino"
    with pytest.raises(ValueError, match="float32"):
        dual_encoder_backend("openvino", None, "cpu", "float16")
    with pytest.raises(ValueError, match="not supported for a dual encoder"):
        dual_encoder_backend("auto", "int8", "cpu", "auto")


def test_auto_keeps_torch_when_openvino_cannot_serve_the_image_tower(clip_dir, monkeypatch):
    """Under "auto" an image tower OpenVINO cannot convert or match runs on torch, the reason in the
    start-up facts; backend="openvino" is refused naming it."""
    import torch

    from pooling_pipeline.core.engine import openvino_image_tower
    from pooling_pipeline.core.engine.dual_encoder_runner import DualEncoderRunner
    from pooling_pipeline.core.engine.openvino_model import BackendUnavailable
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    def refuse(*args, **kwargs):
        raise BackendUnavailable("differs from torch by 3.0e-02 on a probe batch")

    monkeypatch.setattr(openvino_image_tower, "compile_image_tower", refuse)
    spec = load_model_spec(clip_dir)
    runner = DualEncoderRunner(spec, torch.device("cpu"), torch.float32, backend="auto")
    assert runner.image_tower is None and runner.backend_info["backend"] == "torch"
    assert "differs from torch" in runner.backend_info["openvino_refused"]
    with pytest.raises(ValueError, match="backend='openvino' cannot run the image tower.*differs from torch"):
        DualEncoderRunner(spec, torch.device("cpu"), torch.float32, backend="openvino")


def test_an_image_tower_read_from_the_cache_counts_as_used(clip_dir, tmp_path, monkeypatch):
    """The conversion cache keeps its MAX_CACHE_ENTRIES most recently used entries. An image tower
    read from it is marked used, and converting one prunes, as for the text transformers. (Read and
    never marked, a tower in daily use was evicted by newer conversions of other models: the full
    suite once saw the second start of a model convert its tower again.)"""
    import os

    import torch

    from pooling_pipeline.core.engine.dual_encoder_runner import DualEncoderRunner
    from pooling_pipeline.core.engine.openvino_model import MAX_CACHE_ENTRIES
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    monkeypatch.setenv("POOLING_PIPELINE_CACHE", str(tmp_path))
    spec = load_model_spec(clip_dir)

    def start() -> dict:
        return DualEncoderRunner(spec, torch.device("cpu"), torch.float32, backend="openvino", threads=1).backend_info

    first = start()
    assert first["conversion"] == "converted", first
    folder = first["conversion_cache"]
    parent = os.path.dirname(folder)
    os.utime(folder, (1, 1))  # last used long ago ...
    for i in range(MAX_CACHE_ENTRIES):  # ... and as many entries of other models used since
        os.makedirs(os.path.join(parent, f"other-{i}"))
    second = start()
    assert second["conversion"] == "cached" and second["conversion_cache"] == folder, second
    assert os.stat(folder).st_mtime > 1
    # The next conversion of any model keeps the most recently used: this tower among them.
    os.utime(os.path.join(parent, "other-0"), (2, 2))
    os.rename(folder, folder + "-moved")  # (this tower's entry away, so the next start converts and prunes)
    third = start()
    assert third["conversion"] == "converted", third
    left = sorted(e.name for e in os.scandir(parent))
    assert len(left) == MAX_CACHE_ENTRIES and "other-0" not in left and os.path.basename(folder) in left, left
