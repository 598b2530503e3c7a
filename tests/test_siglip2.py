"""SigLIP2 with its NaFlex processor through the whole pipeline: images keep their aspect ratio in a
number of patches of their own (up to 256, as Siglip2Processor calls its image processor, whatever
the saved max_num_patches says), travel as their patches and grid, and equal sentence-transformers 6
within 1e-5 in every input form; texts as ST encodes each alone; what ST fails on (an image not in
RGB: SigLIP2's processor does not convert) is that request's clear error."""

from __future__ import annotations

import numpy as np
import pytest
from model_zoo import build_siglip2

TOL = 1e-5
TEXTS = ["a photo of a cat", "two dogs playing in the snow near a red house", "x", "an empty street at night " * 3]


@pytest.fixture(scope="module")
def siglip2_dir(tmp_path_factory):
    return build_siglip2(tmp_path_factory.mktemp("siglip2"))


@pytest.fixture(scope="module")
def st(siglip2_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(siglip2_dir, device="cpu")


def vectors(pipe, inputs, **kwargs) -> np.ndarray:
    return np.stack([o.embedding for o in pipe.embed(inputs, use_tqdm=False, **kwargs)])


def test_the_spec_reads_the_processors_call_and_the_family_takes_it(siglip2_dir):
    from pooling_pipeline.core.families import family_of
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    spec = load_model_spec(siglip2_dir)
    assert spec.input_module == "naflex_dual_encoder" and family_of(spec).name == "naflex_dual_encoder"
    # (its image processor saved 64; the processor's call asks 256, which is what ST gets)
    assert (spec.image.max_patches, spec.image.patch_size, spec.image.tokens) == (256, 16, 256)
    payloads = family_of(spec).payloads(spec)
    assert payloads["patches"].item_shape == (768,) and payloads["patches"].max_items == 256


@pytest.mark.slow
def test_siglip2_images_of_any_shape_and_texts_equal_st(siglip2_dir, st, images, tmp_path):
    """Photos, a wide and a tall image, alpha and palette files (opened as load_image opens them),
    PIL images, arrays, bytes: one call, images of different patch counts in one step, each equal
    to ST's; texts equal ST's for each text alone; a non-RGB PIL image fails alone, naming why."""
    from PIL import Image

    from pooling_pipeline import Pipeline

    paths = [str(images[name]) for name in ("photo.jpg", "wide.png", "alpha.png", "palette.png", "rotated.jpg")]
    tall = Image.fromarray(np.random.default_rng(3).integers(0, 256, (700, 90, 3), dtype=np.uint8))
    small = np.random.default_rng(4).integers(0, 256, (20, 33, 3), dtype=np.uint8)
    image_ref = st.encode(paths)
    assert np.abs(image_ref[0] - image_ref[1]).max() > 1e-3
    with Pipeline(model=siglip2_dir, num_render_workers=1) as pipe:
        assert np.abs(vectors(pipe, paths) - image_ref).max() <= TOL
        got = vectors(pipe, [tall, small, {"image": images["photo.jpg"].read_bytes()}])
        assert np.abs(got - st.encode([tall, small, str(images["photo.jpg"])])).max() <= TOL
        text_ref = np.stack([st.encode([t])[0] for t in TEXTS])
        assert np.abs(vectors(pipe, TEXTS) - text_ref).max() <= TOL
        mixed = vectors(pipe, [TEXTS[0], paths[1], TEXTS[1], paths[0]])
        assert np.abs(mixed - np.stack([text_ref[0], image_ref[1], text_ref[1], image_ref[0]])).max() <= TOL
        gray = Image.fromarray(small).convert("L")
        outs = pipe.embed([paths[0], gray, paths[0]], use_tqdm=False, errors="return")
        assert outs[0].error is None and outs[2].error is None
        assert "request 1" in outs[1].error and "does not convert images to RGB" in outs[1].error, outs[1].error
        # (what ST does with it: PIL's processor and torchvision's fail with their own words)
        with pytest.raises((ValueError, RuntimeError), match="mean must have 1 elements|doesn't match the broadcast"):
            st.encode([gray])
        engine = pipe.stats()["engine"]
    assert engine["backend"] == "torch" and "NaFlex" in engine["model"], engine


def test_openvino_int8_and_draft_decoding_are_refused_for_naflex_in_the_caller(siglip2_dir):
    from pooling_pipeline import Pipeline

    with pytest.raises(ValueError, match="backend='openvino' cannot run a SigLIP2 NaFlex model"):
        Pipeline(model=siglip2_dir, backend="openvino")
    with pytest.raises(ValueError, match="quantize='int8' is not supported for a dual encoder"):
        Pipeline(model=siglip2_dir, quantize="int8")
    with pytest.raises(ValueError, match="image_decode='draft' applies to CLIP and SigLIP's fixed image size"):
        Pipeline(model=siglip2_dir, image_decode="draft")


@pytest.mark.slow
def test_pipeline_serve_and_pipeline_run_take_siglip2_images(siglip2_dir, st, images, tmp_path):
    """The server's /v1/embeddings with images as base64 and data URIs, and a pipeline-run job over a
    folder of images: ST's vectors, as the API gives them (nothing in either path knows NaFlex)."""
    import base64

    import httpx
    from serve_helpers import started_server

    from pooling_pipeline import load_results
    from pooling_pipeline.jobs.launcher import main as pipeline_run

    names = ["photo.jpg", "wide.png", "palette.png"]
    reference = st.encode([str(images[n]) for n in names])
    raw = [base64.b64encode(images[n].read_bytes()).decode() for n in names]
    uris = [f"data:image/{'jpeg' if n.endswith('jpg') else 'png'};base64,{b}" for n, b in zip(names, raw)]
    with started_server("--model", siglip2_dir, "--num-render-workers", "1") as server:
        for inputs in (raw, uris):
            response = httpx.post(server.url + "/v1/embeddings", json={"input": inputs, "modality": "image"}, timeout=120)
            assert response.status_code == 200, response.text
            got = np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
            assert np.abs(got - reference).max() <= TOL
    folder = tmp_path / "pictures"
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(images[name].read_bytes())
    out = tmp_path / "out"
    assert pipeline_run(["--quiet", "--model", siglip2_dir, "--input", str(folder), "--output", str(out)]) == 0
    ids, data = load_results(out)
    assert sorted(ids) == sorted(names)
    assert np.abs(data - reference[[names.index(i) for i in ids]]).max() <= TOL
