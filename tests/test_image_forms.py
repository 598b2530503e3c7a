"""Images in every form users pass them: arrays of every shape and dtype decided as
sentence-transformers 6 decides them, raw base64, legacy processor configs, extreme aspect ratios in
bounded memory, and the image processor transformers picks in the environment (PIL, or torchvision
where it is installed). Vectors equal ST's within 1e-5 (float32, CPU); what ST refuses, or cannot
take, is refused naming the request."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest
from image_samples import photo
from model_zoo import build_clip

TOL = 1e-5


@pytest.fixture(scope="module")
def clip_pipe(clip_dir):
    from pooling_pipeline import Pipeline

    with Pipeline(model=clip_dir, num_render_workers=1) as p:
        yield p


@pytest.fixture(scope="module")
def rgb() -> np.ndarray:
    return np.asarray(photo(80, 60, seed=3))


def vectors(pipe, inputs, **kwargs) -> np.ndarray:
    return np.stack([o.embedding for o in pipe.embed(inputs, use_tqdm=False, **kwargs)])


# -- arrays: their dimensions decide their modality, their dtype their values --------------------


def test_arrays_that_are_not_3d_are_refused_as_st_refuses_them(clip_pipe, clip_st, rgb):
    """ST reads 1-D and 2-D arrays as audio and 4-D as video, neither of which a CLIP takes; the
    pipeline used to embed a grey image's rows as token ids, one vector per row."""
    import torch

    grey = rgb[..., 0]
    cases = [(rgb.reshape(-1), "audio"), (grey, "audio"), (rgb[None], "video"),
             (torch.from_numpy(grey.copy()), "audio"), (rgb[None, None], "video")]
    for array, kind in cases:
        with pytest.raises(ValueError, match="Modality"):
            clip_st.encode([array])
        for prompts in ([array], array):  # in a list, or as the call's whole input (one input to ST)
            with pytest.raises(ValueError, match=f"request 0: a {array.ndim}-D array .*{kind}"):
                clip_pipe.embed(prompts, use_tqdm=False)
    # errors="return": each is its own request's error; the good images around it are intact
    reference = clip_st.encode([rgb])[0]
    outs = clip_pipe.embed([rgb, grey, rgb, rgb[None], rgb], use_tqdm=False, errors="return")
    assert [o.error is None for o in outs] == [True, False, True, False, True]
    assert "request 1: a 2-D array" in outs[1].error and "request 3: a 4-D array" in outs[3].error
    for out in outs[::2]:
        assert np.abs(out.embedding - reference).max() <= TOL


def test_boolean_object_and_complex_arrays_are_read_as_st_reads_them(clip_pipe, clip_st, rgb, image_backend):
    """ST's processor reads a boolean array as 0/1 (a near-black image), an object array's numbers,
    and a complex array's real part; a complex image, an object array of non-numbers and a
    bfloat16 tensor (which ST cannot read) are refused naming the request. A torchvision processor
    resizes an array in its own dtype, to values beyond 0..255 or between integers, which the
    pipeline's 8-bit pixels cannot carry: those are refused, naming what they gave."""
    import torch

    accepted = {"bool": rgb > 128, "object": rgb.astype(object), "complex64": rgb.astype(np.complex64),
                "bool tensor": torch.from_numpy(rgb > 128), "float16 of integers": rgb.astype(np.float16),
                "object of bools": (rgb > 128).astype(object)}
    if image_backend == "torchvision":  # each equals ST's, or is refused naming the pixels it gave
        outs = clip_pipe.embed(list(accepted.values()), use_tqdm=False, errors="return")
        for k, (name, array) in enumerate(accepted.items()):
            if outs[k].error is None:
                assert np.abs(outs[k].embedding - clip_st.encode([array])[0]).max() <= TOL, name
            else:
                assert re.search(f"request {k}: .*an image array of dtype .* gives .* pixels", outs[k].error), name
        assert "request 1" in outs[1].error and "int64 pixels from -" in outs[1].error  # (-31 to 265)
    else:
        got = vectors(clip_pipe, list(accepted.values()))
        for k, (name, array) in enumerate(accepted.items()):
            assert np.abs(got[k] - clip_st.encode([array])[0]).max() <= TOL, name
        assert np.abs(got[0] - clip_st.encode([(rgb > 128).astype(np.uint8)])[0]).max() <= TOL  # 0/1 pixels
    with pytest.raises(ValueError, match="request 1: a complex array with non-zero imaginary parts"):
        clip_pipe.embed([rgb, rgb + 1j], use_tqdm=False)
    with pytest.raises(TypeError, match="request 1: an object array must hold numbers"):
        clip_pipe.embed([rgb, np.full((4, 4, 3), "x", dtype=object)], use_tqdm=False)
    bf16 = torch.from_numpy(rgb.copy()).to(torch.bfloat16)
    if image_backend == "pil":  # (a torchvision processor reads it; numpy, and so the pipeline, cannot)
        with pytest.raises(TypeError, match="BFloat16"):
            clip_st.encode([bf16])
    with pytest.raises(TypeError, match=r"request 1: a torch.bfloat16 tensor cannot be read as an image.*\.float\(\)"):
        clip_pipe.embed([rgb, bf16], use_tqdm=False)
    outs = clip_pipe.embed([bf16, rgb], use_tqdm=False, errors="return")
    assert "request 0" in outs[0].error and outs[1].error is None  # the rest of the call is served


def test_an_array_call_is_one_image_and_a_string_array_a_batch(clip_pipe, clip_st, rgb, tmp_path):
    """A numeric array is one input whatever its shape (ST's is_singular_input); an array of
    strings or objects is a batch of its items."""
    single = clip_pipe.embed(rgb, use_tqdm=False)
    assert len(single) == 1 and np.abs(single[0].embedding - clip_st.encode(rgb)).max() <= TOL
    path = tmp_path / "photo.png"
    photo(90, 70, seed=4).save(path)
    batch = vectors(clip_pipe, np.array([str(path), "a photo of a cat"]))
    np.testing.assert_allclose(batch, clip_st.encode(np.array([str(path)])).tolist() + [clip_st.encode("a photo of a cat")],
                               atol=TOL, rtol=0)


# -- raw base64 -----------------------------------------------------------------------------------


def test_raw_base64_is_an_image_as_load_image_reads_it(clip_pipe, clip_st, tmp_path):
    """{"image": "<base64>"}, without a data: prefix (transformers' load_image decodes it; so does
    ST); text that is no file and no base64 is refused in the caller, base64 that is no image in
    the worker, each naming its request."""
    path = tmp_path / "photo.jpg"
    photo(120, 90, seed=5).save(path, quality=90)
    encoded = base64.b64encode(path.read_bytes()).decode()
    reference = clip_st.encode([{"image": encoded}])[0]
    assert np.abs(reference - clip_st.encode([str(path)])[0]).max() <= TOL
    wrapped = "\n".join(encoded[k:k + 76] for k in range(0, len(encoded), 76))  # (MIME line breaks, as decodebytes takes)
    got = vectors(clip_pipe, [{"image": encoded}, {"image": wrapped}])
    assert np.abs(got - reference).max() <= TOL
    with pytest.raises(ValueError, match="request 1: image 'cat.jpg' is neither an existing file"):
        clip_pipe.embed([{"image": encoded}, {"image": "cat.jpg"}], use_tqdm=False)
    with pytest.raises(ValueError, match="request 0: .*base64 data's image .*cannot"):
        clip_pipe.embed([{"image": base64.b64encode(b"not an image").decode()}], use_tqdm=False)


# -- a legacy CLIPModel save in the 2021 processor format -----------------------------------------


def legacy_2021(tmp_path: Path) -> str:
    """A legacy clip-ViT-* save (the CLIPModel module) whose preprocessor_config.json is in the
    2021 format older saves carry: a feature extractor type, integer sizes, no image_processor_type."""
    folder = Path(build_clip(tmp_path, layout="legacy", normalize=True))
    (folder / "0_CLIPModel" / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "size": 224}, indent=2))
    return str(folder)


def test_the_2021_processor_format_reads_as_transformers_reads_it(tmp_path):
    from transformers import AutoImageProcessor

    from pooling_pipeline.core.shared.model_folder.dual_encoder import _standard_sizes, processor_class_name
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    folder = legacy_2021(tmp_path)
    image = load_model_spec(folder).image
    loaded = AutoImageProcessor.from_pretrained(Path(folder) / "0_CLIPModel")
    assert image.processor_class == type(loaded).__name__.removesuffix("Pil") == "CLIPImageProcessor"
    assert (image.height, image.width, image.tokens) == (224, 224, 50)
    # The size forms transformers standardizes: an int size is the shortest edge, an int crop or a
    # pair the exact size.
    assert _standard_sizes({"size": 256, "crop_size": 224}) == {"size": {"shortest_edge": 256},
                                                                "crop_size": {"height": 224, "width": 224}}
    assert _standard_sizes({"size": [224, 200]})["size"] == {"height": 224, "width": 200}
    family = {"processors": ("CLIPImageProcessor",)}
    assert processor_class_name({"image_processor_type": "CLIPImageProcessorFast"}, family) == "CLIPImageProcessor"
    assert processor_class_name({}, family) == "CLIPImageProcessor"  # (transformers falls back to the model type)


@pytest.mark.slow
def test_a_legacy_2021_save_equals_st(tmp_path, rgb):
    from sentence_transformers import SentenceTransformer

    from pooling_pipeline import Pipeline

    folder = legacy_2021(tmp_path)
    st = SentenceTransformer(folder, device="cpu")
    inputs = [rgb, "a photo of a cat"]
    reference = np.concatenate([st.encode([rgb]), st.encode(["a photo of a cat"])])
    with Pipeline(model=folder, num_render_workers=1) as pipe:
        got = vectors(pipe, inputs)
    assert np.abs(got - reference).max() <= TOL


# -- extreme aspect ratios in bounded memory -------------------------------------------------------


def test_the_crop_window_is_pillows_resize_then_crop_bit_for_bit():
    """The crop's pixels computed alone equal Pillow's whole resize then the crop, for every filter
    and shapes from slivers to near-squares (each enlarged, as a sliver's resize is)."""
    from PIL import Image

    from pooling_pipeline.workers.crop_window import FILTERS, resized_crop

    rng = np.random.default_rng(0)
    checked = 0
    for trial in range(120):
        short, long = int(rng.integers(1, 200)), int(rng.integers(200, 2500))
        width, height = (short, long) if trial % 2 else (long, short)
        edge = (224, 256, 336)[trial % 3]
        if width <= height:
            new = (int(edge * height / width), edge)
        else:
            new = (edge, int(edge * width / height))
        if short >= edge or new[0] * new[1] > 12_000_000:
            continue
        resample = list(FILTERS)[trial % len(FILTERS)]
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        whole = np.asarray(Image.fromarray(pixels).resize((new[1], new[0]), resample))
        top, left = (new[0] - 224) // 2, (new[1] - 224) // 2
        got = resized_crop(pixels, new, (224, 224), resample)
        assert np.array_equal(got, whole[top:top + 224, left:left + 224]), (width, height, new, resample)
        checked += 1
    assert checked >= 60


@pytest.fixture
def pil_processors(monkeypatch):
    """transformers' PIL image processors in this process, as where torchvision is not installed
    (where it is, transformers picks its torchvision ones): the worker's Pillow shortcuts serve them."""
    from transformers import AutoImageProcessor

    loader = AutoImageProcessor.from_pretrained.__func__
    monkeypatch.setattr(AutoImageProcessor, "from_pretrained",
                        classmethod(lambda cls, *args, **kwargs: loader(cls, *args, **{"backend": "pil", **kwargs})))


def test_the_renderer_computes_a_sliver_as_the_processor_does(clip_dir, pil_processors):
    """Through the worker's renderer: a sliver's pixels (a PIL image, an array, grey) equal the
    processor's own, and the shortcut is the one taken."""
    from PIL import Image

    from pooling_pipeline.core.shared.model_folder.load import load_model_spec
    from pooling_pipeline.image_inputs import image_input
    from pooling_pipeline.workers.images import ImageRenderer

    renderer = ImageRenderer(load_model_spec(clip_dir))
    assert renderer.window.usable
    rng = np.random.default_rng(1)
    sliver = rng.integers(0, 256, (3000, 12, 3), dtype=np.uint8)  # resized to 224 x 56,000
    for image in (Image.fromarray(sliver), sliver, Image.fromarray(sliver[..., 0]), np.ascontiguousarray(sliver.T)):
        opened = renderer.open(image_input(image, 0))
        assert renderer.window.takes(renderer.window.resized_size(opened))
        expected = renderer.processor([opened], do_rescale=False, do_normalize=False, return_tensors="np")
        assert np.array_equal(renderer.pixels(image_input(image, 0)), expected["pixel_values"][0])


@pytest.mark.slow
def test_extreme_aspect_ratios_stay_in_bounded_memory_and_equal_st(clip_dir, clip_st, tmp_path, image_backend):
    """A 10 x 50,000 PNG (1 kB on disk) took a worker to ~2.5 GB while the processor resized it to
    224 x 1,120,000 before its crop, and a 2 x 200,000 one asked for ~20 GB; now each costs the crop.
    The worker's peak RSS (VmHWM) is held to a bound; the vector equals ST's (for a 10 x 20,000 one,
    whose whole resize the test can afford). A torchvision processor, whose resize the crop window
    does not reproduce, has each refused before its resize, naming why."""
    from PIL import Image

    from pooling_pipeline import Pipeline

    rng = np.random.default_rng(2)
    files = {}
    for width, height in ((10, 50_000), (200_000, 2), (10, 20_000)):
        image = Image.fromarray(np.repeat(rng.integers(0, 256, (height, 1, 3), dtype=np.uint8), width, axis=1)
                                if width < height else
                                np.repeat(rng.integers(0, 256, (1, width, 3), dtype=np.uint8), height, axis=0))
        files[(width, height)] = tmp_path / f"sliver-{width}x{height}.png"
        image.save(files[(width, height)])
    with Pipeline(model=clip_dir, num_render_workers=1) as pipe:
        worker = pipe.pids["workers"][0]
        photo(64, 48, seed=5).save(tmp_path / "warm.png")
        vectors(pipe, [str(tmp_path / "warm.png")])  # (the worker warm: its first image's imports)
        before = peak_rss_mb(worker)
        outs = pipe.embed([str(path) for path in files.values()], use_tqdm=False, errors="return")
        grown = peak_rss_mb(worker) - before
    assert grown < 150, f"the worker's peak RSS grew by {grown:.0f} MB"
    if image_backend == "torchvision":
        assert all("(an extreme aspect ratio)" in (out.error or "") for out in outs), [out.error for out in outs]
        return
    assert not any(out.error for out in outs), [out.error for out in outs]
    got = np.stack([out.embedding for out in outs])
    assert np.isfinite(got).all()
    assert np.abs(got[2] - clip_st.encode([str(files[(10, 20_000)])])[0]).max() <= TOL


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident set size (Linux's VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for process {pid}")


# -- the image processor transformers picks: PIL, or torchvision where it is installed --------------


def test_torchvision_installed_is_served_with_the_processor_transformers_picks(clip_dir, monkeypatch, pil_processors):
    """With torchvision installed, transformers (and so ST) picks its torchvision processor. The
    frontend no longer refuses that environment: it reads the processor's class from the model's
    files and leaves the backend to transformers; the worker runs whichever processor transformers
    loads, and keeps the Pillow shortcuts for the PIL one (a torchvision processor runs every image
    itself, and a resize too large for it is refused rather than run)."""
    import importlib.util

    from transformers import AutoImageProcessor

    from pooling_pipeline.core.shared.messages import MediaData
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec
    from pooling_pipeline.workers import images
    from pooling_pipeline.workers.crop_window import MAX_RESIZED_PIXELS

    real_find_spec = importlib.util.find_spec
    with monkeypatch.context() as m:
        m.setattr(importlib.util, "find_spec",
                  lambda name, *a: object() if name == "torchvision" else real_find_spec(name, *a))
        spec = load_model_spec(clip_dir)  # (it used to be refused here)
    assert spec.image.processor_class == "CLIPImageProcessor"

    pil = images.ImageRenderer(spec)
    assert pil.backend == "pil" and pil.direct.usable and pil.window.usable

    real = AutoImageProcessor.from_pretrained(clip_dir)

    class TorchvisionStandIn(type(real)):
        """The processor as a torchvision one presents itself (its own resize: here the PIL one's)."""

        backend = "torchvision"
        calls = 0

        def __call__(self, *args, **kwargs):
            TorchvisionStandIn.calls += 1
            return super().__call__(*args, **kwargs)

    TorchvisionStandIn.__name__ = "CLIPImageProcessor"
    stand_in = TorchvisionStandIn.from_pretrained(clip_dir)
    monkeypatch.setattr(AutoImageProcessor, "from_pretrained", lambda *args, **kwargs: stand_in)
    renderer = images.ImageRenderer(spec)
    assert renderer.backend == "torchvision" and renderer.direct is None and not renderer.window.usable
    image = photo(300, 200, seed=6)
    before = TorchvisionStandIn.calls
    got = renderer.pixels(MediaData(values=np.frombuffer(image.tobytes(), np.uint8), mode="RGB", shape=[300, 200]))
    assert TorchvisionStandIn.calls == before + 1  # the processor itself ran it
    assert np.array_equal(got, pil.pixels(MediaData(values=np.frombuffer(image.tobytes(), np.uint8), mode="RGB",
                                                    shape=[300, 200])))
    sliver = np.zeros((3000, 12, 3), np.uint8)  # resized to 224 x 56,000
    assert 224 * 56_000 > MAX_RESIZED_PIXELS
    with pytest.raises(images.ImageError, match=r"would be resized to 224x56000 .*\(an extreme aspect ratio\)"):
        renderer.pixels(MediaData(values=sliver.reshape(-1), dtype="|u1", shape=list(sliver.shape)))


def test_a_processor_that_differs_from_the_model_files_is_refused(clip_dir, tmp_path):
    """The worker checks that transformers loads the processor the frontend read, rescaling and
    normalizing as the engine will (the engine does those two steps itself)."""
    import shutil

    from transformers import AutoImageProcessor

    from pooling_pipeline.core.shared.model_folder.load import load_model_spec
    from pooling_pipeline.workers.images import check_processor

    spec = load_model_spec(clip_dir)
    check_processor(AutoImageProcessor.from_pretrained(clip_dir), spec)
    other = tmp_path / "other"
    shutil.copytree(clip_dir, other)
    config = json.loads((other / "processor_config.json").read_text())
    config["image_processor"]["image_mean"] = [0.5, 0.5, 0.5]
    (other / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rescales and normalizes with"):
        check_processor(AutoImageProcessor.from_pretrained(other), spec)


def test_an_image_worker_keeps_torch_importable_where_torchvision_is_installed(clip_dir, monkeypatch):
    """transformers picks its torchvision processors only where torch imports too; a worker hides
    torch while it loads transformers (190 MB it never uses for text), so an image model's worker
    keeps torch where torchvision is installed -- or it would run the PIL processor while ST, in
    the caller's process, runs the torchvision one (4e-4 apart on a test CLIP)."""
    import importlib.util

    from pooling_pipeline.core.shared.model_folder.load import load_model_spec
    from pooling_pipeline.workers.render import media_processor_imports

    spec = load_model_spec(clip_dir)
    real_find_spec = importlib.util.find_spec
    installed = importlib.util.find_spec("torchvision") is not None
    assert media_processor_imports(spec) == (("PIL", "torch") if installed else ("PIL",))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "torchvision" else real_find_spec(name, *a))
    assert media_processor_imports(spec) == ("PIL", "torch")
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchvision" else real_find_spec(name, *a))
    assert media_processor_imports(spec) == ("PIL",)
