"""VLM embedders (Qwen3-VL-Embedding's layout, on tiny Qwen2-VL and Qwen3-VL models): texts and images
of any size -- paths, data URIs, bytes, PIL images, arrays -- alone, mixed in one call and with
prompts, a text and an image in one input, chat messages -- each equal to sentence-transformers 6's
encode within 1e-5 (float32, CPU, torch); what the pipeline does not take (video, audio, other
parts) is refused naming the request. transformers 5 loads these models' processors only where torchvision is installed."""

from __future__ import annotations

import base64

import numpy as np
import pytest

pytest.importorskip("torchvision", reason="transformers 5 loads a Qwen-VL processor only with torchvision")

TOL = 1e-5
TEXTS = ["A photo of a cat sitting on a red sofa.", "short", "The quick brown fox jumps over the lazy dog. " * 6]


@pytest.fixture(scope="module", params=["qwen2_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow)])
def vlm(request, tmp_path_factory):
    """(the model folder, ST's model of it, a Pipeline on it)."""
    from sentence_transformers import SentenceTransformer
    from vlm_models import build_qwen2vl_embedder, build_qwen3vl_embedder

    from pooling_pipeline import Pipeline

    build = build_qwen2vl_embedder if request.param == "qwen2_vl" else build_qwen3vl_embedder
    folder = build(str(tmp_path_factory.mktemp(request.param) / "model"))
    st = SentenceTransformer(folder, device="cpu")
    with Pipeline(model=folder, num_render_workers=1) as pipe:
        yield folder, st, pipe


def vectors(pipe, inputs, **kwargs) -> np.ndarray:
    return np.stack([o.embedding for o in pipe.embed(inputs, use_tqdm=False, **kwargs)])


def pictures(tmp_path):
    """Images of several sizes and forms: PIL (smaller than the least pixels, in between, larger
    than the most), an array, a PNG and a JPEG by path, a data URI."""
    from image_samples import photo

    small, middle, large = photo(20, 33, seed=1), photo(56, 40, seed=2), photo(300, 200, seed=3)
    png, jpg = tmp_path / "page.png", tmp_path / "photo.jpg"
    photo(90, 120, seed=4).save(png)
    photo(130, 70, seed=5).save(jpg, quality=90)
    uri = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    return [small, middle, large, np.asarray(photo(64, 48, seed=6)), str(png), str(jpg), uri]


def test_texts_and_images_of_any_size_equal_st(vlm, tmp_path):
    folder, st, pipe = vlm
    images = pictures(tmp_path)
    assert np.abs(vectors(pipe, TEXTS) - st.encode(TEXTS)).max() <= TOL
    got = vectors(pipe, images)
    reference = st.encode(images)
    assert np.abs(got - reference).max() <= TOL
    assert np.abs(reference[0] - reference[2]).max() > 1e-3  # (different images, different vectors)
    mixed = [TEXTS[0], images[2], TEXTS[1], images[4]]
    assert np.abs(vectors(pipe, mixed) - st.encode(mixed)).max() <= TOL
    # an image file's bytes: the file's own decoding (ST takes the path)
    with open(images[5], "rb") as f:
        as_bytes = vectors(pipe, [{"image": f.read()}])
    assert np.abs(as_bytes[0] - reference[5]).max() <= TOL
    norms = np.linalg.norm(got, axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5)  # (its Normalize module)


def test_prompts_are_a_system_message_as_st_makes_them(vlm, tmp_path):
    folder, st, pipe = vlm
    image = pictures(tmp_path)[1]
    inputs = [TEXTS[0], image]
    instruction = "Retrieve images or text relevant to the user's query."
    reference = st.encode(inputs, prompt=instruction)
    assert np.abs(vectors(pipe, inputs, prompt=instruction) - reference).max() <= TOL
    assert np.abs(reference - st.encode(inputs)).max() > 1e-4  # (the prompt changes the vectors)
    if "query" in st.prompts:
        got = vectors(pipe, inputs, prompt_name="query")
        assert np.abs(got - st.encode(inputs, prompt_name="query")).max() <= TOL


def test_score_between_a_text_and_an_image_equals_st(vlm, tmp_path):
    folder, st, pipe = vlm
    image = pictures(tmp_path)[2]
    want = float(st.similarity(st.encode([TEXTS[0]]), st.encode([image]))[0, 0])
    got = pipe.score([TEXTS[0]], [image], use_tqdm=False)[0].score
    assert abs(got - want) <= TOL


def test_a_text_and_an_image_in_one_input_and_chat_messages_equal_st(vlm, tmp_path):
    """{"text", "image"} (parts in the dict's key order), a conversation of messages (string content,
    parts, its own system message, two images in one message), one conversation as the call's whole
    input, and a batch mixing them with texts and images: each equal to ST's."""
    folder, st, pipe = vlm
    small, middle, large, array, png, jpg, uri = pictures(tmp_path)
    fused = [{"text": "a cat on a sofa", "image": middle}, {"image": middle, "text": "a cat on a sofa"},
             {"text": "a page", "image": png}]
    reference = st.encode(fused)
    assert np.abs(vectors(pipe, fused) - reference).max() <= TOL
    assert np.abs(reference[0] - reference[1]).max() > 1e-4  # (the parts' order is the dict's)
    conversations = [
        [{"role": "user", "content": [{"type": "image", "image": large}, {"type": "text", "text": "describe it"}]}],
        [{"role": "system", "content": "You embed pages."}, {"role": "user", "content": "plain string content"}],
        [{"role": "user", "content": [{"type": "text", "text": "two pictures"}, {"type": "image", "image": small},
                                      {"type": "image", "image": jpg}]}],
        [{"role": "user", "content": [{"type": "image", "image": uri}]}],
    ]
    reference = st.encode(conversations)
    assert np.abs(vectors(pipe, conversations) - reference).max() <= TOL
    one = pipe.embed(conversations[0], use_tqdm=False)  # (one conversation: one input)
    assert len(one) == 1 and np.abs(one[0].embedding - reference[0]).max() <= TOL
    # A conversation batched with inputs of other forms, ST renders as one user message with no
    # content (its batch_to_message), a vector changed by 0.06-0.2 here; each input equals ST's
    # encode of that input alone (a batch of one form, or batch_size=1).
    mixed = [TEXTS[0], conversations[2], fused[0], small]
    alone = np.stack([st.encode([one])[0] for one in mixed])
    assert np.abs(vectors(pipe, mixed) - alone).max() <= TOL
    instruction = "Represent this for retrieval."
    got = vectors(pipe, [conversations[1], fused[0]], prompt=instruction)
    alone = np.stack([st.encode([one], prompt=instruction)[0] for one in (conversations[1], fused[0])])
    assert np.abs(got - alone).max() <= TOL


def test_what_it_does_not_take_is_refused_naming_the_request(vlm, tmp_path):
    """Video and audio parts, parts of other shapes, more images than an input holds; a text holding
    the model's image token has no image for it (ST's processor fails on it too)."""
    folder, st, pipe = vlm
    image = pictures(tmp_path)[1]
    cases = [{"text": "a clip", "video": [image, image]},
             [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
             [{"role": "user", "content": [{"type": "image", "image": image}] * 9}],
             [{"role": "user"}]]
    for case in cases:
        outs = pipe.embed([TEXTS[0], case], use_tqdm=False, errors="return")
        assert outs[0].error is None and "request 1" in outs[1].error, (case, outs[1].error)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\x00" * 64)
    for video in (str(clip), "https://youtu.be/abc"):  # (ST reads both as videos)
        with pytest.raises(ValueError, match="request 0: .*is a video to sentence-transformers"):
            pipe.embed([video], use_tqdm=False)
    with pytest.raises(ValueError, match="request 0: .*tokens"):  # (ST would cut it and restore the template's tail)
        pipe.embed([TEXTS[2]], truncate_prompt_tokens=12, use_tqdm=False)
    outs = pipe.embed([TEXTS[1], "look: <|image_pad|>"], use_tqdm=False, errors="return")
    assert outs[0].error is None and "request 1" in outs[1].error and "image_pad|> tokens" in outs[1].error, outs[1].error
    with pytest.raises(Exception, match="(?i)image"):
        st.encode(["look: <|image_pad|>"])


def test_options_it_cannot_honour_are_refused_in_the_caller(vlm):
    from pooling_pipeline import Pipeline

    folder, st, pipe = vlm
    with pytest.raises(ValueError, match="backend='openvino' cannot run a VLM embedder"):
        Pipeline(model=folder, backend="openvino")
    with pytest.raises(ValueError, match="quantize='int8' is not supported for a VLM embedder"):
        Pipeline(model=folder, quantize="int8")


def test_bad_images_are_refused_each_alone(vlm, tmp_path):
    """A decompression bomb (refused from its header, before decoding), a truncated file, a file that
    is no image: each its request's error, the call around them served."""
    from image_samples import build_broken_files

    folder, st, pipe = vlm
    images = pictures(tmp_path)
    broken = build_broken_files(tmp_path / "broken", tmp_path / "photo.jpg")
    outs = pipe.embed([images[4], str(broken["bomb"]), str(broken["truncated"]), str(broken["not an image"])],
                      use_tqdm=False, errors="return")
    assert outs[0].error is None
    assert "request 1" in outs[1].error and "decompression bomb" in outs[1].error, outs[1].error
    assert "request 2" in outs[2].error and "request 3" in outs[3].error


@pytest.mark.slow
def test_pipeline_serve_takes_images_and_chat_messages_as_vllm_does(vlm, tmp_path):
    """/v1/embeddings: images as data URIs (`modality: image`), and vLLM's chat form -- `messages`
    with text and image_url parts, one embedding per conversation -- equal to ST's."""
    import httpx
    from serve_helpers import started_server

    folder, st, pipe = vlm
    small, middle, large, array, png, jpg, uri = pictures(tmp_path)
    with started_server("--model", folder, "--num-render-workers", "1") as server:
        response = httpx.post(server.url + "/v1/embeddings", json={"input": [uri], "modality": "image"}, timeout=120)
        assert response.status_code == 200, response.text
        got = np.array(response.json()["data"][0]["embedding"], dtype=np.float32)
        assert np.abs(got - st.encode([png])[0]).max() <= TOL
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                                 {"type": "text", "text": "what is on this page?"}]}]
        response = httpx.post(server.url + "/v1/embeddings", json={"messages": messages}, timeout=120)
        assert response.status_code == 200, response.text
        got = np.array(response.json()["data"][0]["embedding"], dtype=np.float32)
        want = st.encode([[{"role": "user", "content": [{"type": "image", "image": png},
                                                        {"type": "text", "text": "what is on this page?"}]}]])[0]
        assert np.abs(got - want).max() <= TOL
        bad = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]
        response = httpx.post(server.url + "/v1/embeddings", json={"messages": bad}, timeout=120)
        assert response.status_code == 400 and "audio" in response.text


@pytest.mark.slow
def test_pipeline_run_embeds_a_folder_of_images(vlm, tmp_path):
    """pipeline-run on a folder of images: each file's vector equals ST's (ids are the paths)."""
    from pooling_pipeline import load_results
    from pooling_pipeline.jobs.launcher import main

    folder, st, pipe = vlm
    small, middle, large, array, png, jpg, uri = pictures(tmp_path)
    photos = tmp_path / "photos"
    photos.mkdir()
    for path in (png, jpg):
        (photos / path.rsplit("/", 1)[1]).write_bytes(open(path, "rb").read())
    out = tmp_path / "out"
    assert main(["--quiet", "--model", folder, "--input", str(photos), "--output", str(out)]) == 0
    ids, data = load_results(out)
    want = {name: st.encode([str(photos / name)])[0] for name in ("page.png", "photo.jpg")}
    assert sorted(ids) == sorted(want)
    assert np.abs(data - np.stack([want[i] for i in ids])).max() <= TOL


def test_sentence_encoder_takes_st_s_input_forms(vlm, tmp_path):
    """SentenceEncoder.encode (ST's signature) on one input of each form -- a text, an image, a
    {"text", "image"} dict, one conversation -- gives ST's 1-D vector for it; encode_query uses the
    model's "query" prompt as ST's does."""
    from pooling_pipeline.integrations.sentence_encoder import SentenceEncoder

    folder, st, pipe = vlm
    image = pictures(tmp_path)[1]
    conversation = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "x"}]}]
    encoder = SentenceEncoder(pipeline=pipe)
    for one in (TEXTS[0], image, {"text": "a cat", "image": image}, conversation):
        got = encoder.encode(one)
        assert got.shape == (st.get_sentence_embedding_dimension(),)
        assert np.abs(got - st.encode(one)).max() <= TOL
    if "query" in st.prompts:
        assert np.abs(encoder.encode_query([TEXTS[0], image]) - st.encode_query([TEXTS[0], image])).max() <= TOL


def test_a_chat_template_reading_a_task_is_refused_at_load(vlm, tmp_path):
    """ST hands such a template encode_query's / encode_document's task: not supported yet, a clear
    refusal rather than vectors rendered without it."""
    import shutil

    from pooling_pipeline import Pipeline

    folder, st, pipe = vlm
    copy = tmp_path / "with-task"
    shutil.copytree(folder, copy)
    template = copy / "chat_template.jinja"
    template.write_text(template.read_text() + "{% if task %}{{ task }}{% endif %}")
    with pytest.raises(ValueError, match="reads a `task` variable"):
        Pipeline(model=str(copy))
