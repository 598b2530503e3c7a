"""CLAP through the whole pipeline: texts and audio clips in every form sentence-transformers 6 takes
for it -- 1-D arrays (any numeric dtype, as its feature extractor reads them), `{"array",
"sampling_rate"}`, `{"audio": ...}`, files (decoded and resampled to the extractor's rate as
transformers' load_audio does), bytes, data URIs -- equal ST within 1e-5; what ST refuses or cannot
reproduce (another rate for an array, a multi-channel array, a clip longer than the extractor's
window, which it crops at random; a CLAP with fusion) is a clear error naming the request."""

from __future__ import annotations

import base64
import json
import os
import wave

import numpy as np
import pytest
from model_zoo import build_clap

TOL = 1e-5
RATE = 48000
TEXTS = ["a dog barking", "rain on a tin roof at night", "x"]


@pytest.fixture(scope="module")
def clap_dir(tmp_path_factory):
    return build_clap(tmp_path_factory.mktemp("clap"))


@pytest.fixture(scope="module")
def st(clap_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(clap_dir, device="cpu")


def clip(seconds: float, seed: int, rate: int = RATE) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * (200 + 50 * seed) * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def write_wav(path, samples: np.ndarray, rate: int = RATE, frames: int | None = None) -> str:
    """A 16-bit PCM WAV file; with `frames`, that many (silent past `samples`), written as a sparse
    file: a long clip that takes no disk."""
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.setnframes(frames or len(pcm))
        w.writeframes(pcm.tobytes())
    if frames is not None:
        data = bytearray(open(path, "rb").read(44))
        data[40:44] = (frames * 2).to_bytes(4, "little")
        data[4:8] = (36 + frames * 2).to_bytes(4, "little")
        with open(path, "r+b") as f:
            f.write(bytes(data))
            f.truncate(44 + frames * 2)
    return str(path)


def vectors(pipe, inputs, **kwargs) -> np.ndarray:
    return np.stack([o.embedding for o in pipe.embed(inputs, use_tqdm=False, **kwargs)])


@pytest.mark.slow
def test_clap_arrays_files_and_texts_equal_st(clap_dir, st, tmp_path):
    """One Pipeline: arrays of several lengths (and dtypes), a dict with its rate, a WAV file, a FLAC
    at 16 kHz (resampled on decoding, as load_audio does), bytes and a data URI, and texts -- mixed
    in one call, each equal to ST's."""
    import soundfile

    from pooling_pipeline import Pipeline

    clips = [clip(1, 0), clip(2.5, 1), clip(10, 2)]
    wav = write_wav(tmp_path / "a.wav", clip(3, 3))
    flac = str(tmp_path / "b.flac")
    soundfile.write(flac, clip(2, 4, rate=16000), 16000)
    wav_bytes = open(wav, "rb").read()
    uri = "data:audio/wav;base64," + base64.b64encode(wav_bytes).decode()
    ints = (clip(1.5, 5) * 1000).astype(np.int16)  # (raw values, as the extractor reads them)
    ref = st.encode(clips + [clip(1, 6).astype(np.float64), ints])
    file_ref = st.encode([wav, flac])
    assert np.abs(file_ref[0] - file_ref[1]).max() > 1e-3 and np.abs(ref[0] - ref[1]).max() > 1e-3
    text_ref = st.encode(TEXTS)
    with Pipeline(model=clap_dir, num_render_workers=1) as pipe:
        got = vectors(pipe, clips + [clip(1, 6).astype(np.float64), ints])
        assert np.abs(got - ref).max() <= TOL
        got = vectors(pipe, [wav, flac, {"audio": wav_bytes}, {"audio": uri}, uri, {"audio": flac},
                             {"array": clips[0], "sampling_rate": RATE}, {"audio": clips[1]},
                             {"audio": {"array": clips[0]}}, {"array": clips[1], "sampling_rate": float(RATE)}])
        expected = np.stack([file_ref[0], file_ref[1], file_ref[0], file_ref[0], file_ref[0], file_ref[1], ref[0], ref[1],
                             ref[0], ref[1]])
        # (ST takes the nested form without a rate, and a float rate equal to the extractor's)
        assert np.abs(st.encode([{"audio": {"array": clips[0]}}]) - ref[:1]).max() <= TOL
        assert np.abs(st.encode([{"array": clips[1], "sampling_rate": float(RATE)}]) - ref[1:2]).max() <= TOL
        assert np.abs(got - expected).max() <= TOL
        mixed = vectors(pipe, [TEXTS[0], clips[1], TEXTS[1], wav, TEXTS[2]])
        assert np.abs(mixed - np.stack([text_ref[0], ref[1], text_ref[1], file_ref[0], text_ref[2]])).max() <= TOL
        engine = pipe.stats()["engine"]
    assert engine["backend"] == "torch" and "CLAP" in engine["model"], engine


@pytest.mark.slow
def test_a_bad_clip_fails_alone_naming_the_request(clap_dir, st, tmp_path):
    """Each refusal names its request; the requests around it get ST's vectors. A one-hour file is
    refused from its header, before it is decoded."""
    import torch

    from pooling_pipeline import Pipeline

    good = clip(1, 0)
    hour = write_wav(tmp_path / "hour.wav", clip(0.1, 1), frames=3600 * RATE)
    not_audio = tmp_path / "text.wav"
    not_audio.write_text("not a wav file")
    bad = {"rate": {"array": good, "sampling_rate": 16000}, "stereo": np.stack([good, good]),
           "long array": clip(10.5, 2), "one hour file": hour, "not audio": {"audio": str(not_audio)},
           "no rate": {"array": good}, "image": np.zeros((8, 8, 3), np.uint8), "url": "https://example.com/a.wav",
           "empty": np.zeros(0, np.float32), "strings": {"audio": 3}, "fused": {"audio": good, "text": "a"},
           "message": {"role": "user", "content": "a dog"}, "bfloat16": torch.zeros(100, dtype=torch.bfloat16)}
    why = {"rate": "sampling rate is 16000 Hz", "stereo": "multi-channel", "long array": "10.50 s long",
           "one hour file": "3600.00 s long", "not audio": "cannot be decoded", "no rate": "'sampling_rate'",
           "image": "an image", "url": "is not fetched", "empty": "empty", "strings": "must hold a path",
           "fused": "fuses modalities", "message": "chat-style", "bfloat16": "bfloat16"}
    ref = st.encode([good])[0]
    with Pipeline(model=clap_dir, num_render_workers=1) as pipe:
        for name, value in bad.items():
            outs = pipe.embed([good, value, good], use_tqdm=False, errors="return")
            assert outs[0].error is None and outs[2].error is None, name
            assert np.abs(outs[2].embedding - ref).max() <= TOL
            assert outs[1].error is not None and "request 1" in outs[1].error and why[name] in outs[1].error, \
                (name, outs[1].error)
        # (a string that is no existing file is a text, as ST reads it)
        assert np.abs(vectors(pipe, ["/no/such/clip.wav"]) - st.encode(["/no/such/clip.wav"])).max() <= TOL
    with pytest.raises(ValueError, match="16000"):  # (ST refuses another rate too)
        st.encode([bad["rate"]])


def test_clap_refusals_in_the_caller(clap_dir, tmp_path):
    """OpenVINO, int8 and image options are refused before any process starts; so is a CLAP with
    fusion, whose feature extractor marks a random clip of each batch as long."""
    import json
    import shutil

    from pooling_pipeline import Pipeline
    from pooling_pipeline.core.shared.model_folder.load import load_model_spec

    with pytest.raises(ValueError, match="backend='openvino' cannot run a CLAP model"):
        Pipeline(model=clap_dir, backend="openvino")
    with pytest.raises(ValueError, match="quantize='int8' is not supported for a CLAP model"):
        Pipeline(model=clap_dir, quantize="int8")
    with pytest.raises(ValueError, match="image_decode='draft' applies to a model that takes images"):
        Pipeline(model=clap_dir, image_decode="draft")
    fused = tmp_path / "fused"
    shutil.copytree(clap_dir, fused)
    config = json.loads((fused / "config.json").read_text())
    config["audio_config"]["enable_fusion"] = True
    (fused / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="enable_fusion=True is not supported"):
        load_model_spec(str(fused))
    config["audio_config"]["enable_fusion"] = False
    (fused / "config.json").write_text(json.dumps(config))
    processor = json.loads((fused / "processor_config.json").read_text())
    processor["feature_extractor"]["truncation"] = "fusion"
    (fused / "processor_config.json").write_text(json.dumps(processor))
    with pytest.raises(ValueError, match="truncation 'fusion' is not supported"):
        load_model_spec(str(fused))


@pytest.mark.slow
def test_sentence_encoder_takes_a_clip_as_one_input(clap_dir, st):
    """SentenceEncoder.encode reads a numeric array as one clip (ST's is_singular_input) and a list
    as a batch, with ST's shapes."""
    from pooling_pipeline import SentenceEncoder

    one, two = clip(1, 0), clip(2, 1)
    with SentenceEncoder(clap_dir) as model:
        single = model.encode(one)
        batch = model.encode([one, two])
    assert single.shape == st.encode(one).shape == (16,)
    assert np.abs(single - st.encode(one)).max() <= TOL and np.abs(batch - st.encode([one, two])).max() <= TOL


@pytest.mark.slow
def test_pipeline_run_embeds_audio_folders_and_fields_as_st(clap_dir, st, tmp_path, capsys):
    """pipeline-run on a CLAP model: a folder of audio files (ids = paths relative to it), a JSONL
    with --audio-field (paths relative to its folder) and a Parquet binary column give ST's vectors;
    a bad clip is that record's error; what an audio job cannot do is refused at start-up."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pooling_pipeline import load_results
    from pooling_pipeline.jobs.launcher import main

    folder = tmp_path / "clips"
    (folder / "a").mkdir(parents=True)
    paths = {"a/one.wav": write_wav(folder / "a" / "one.wav", clip(1, 0)),
             "two.wav": write_wav(folder / "two.wav", clip(2, 1)),
             "long.wav": write_wav(folder / "long.wav", clip(11, 2))}
    (folder / "notes.txt.bak").write_text("not an input")
    ref = dict(zip(["a/one.wav", "two.wav"], st.encode([paths["a/one.wav"], paths["two.wav"]])))

    def check(out, want: dict):
        ids, data = load_results(out)
        assert sorted(ids) == sorted(want), ids
        assert np.abs(data - np.stack([want[i] for i in ids])).max() <= TOL

    assert main(["--quiet", "--model", clap_dir, "--input", str(folder), "--output", str(tmp_path / "o1"),
                 "--errors", "return"]) == 0
    check(tmp_path / "o1", ref)
    errors = (tmp_path / "o1" / "__job__" / "errors.jsonl").read_text()
    assert '"clip": 2' in errors and "long.wav" in errors and "11.00 s long" in errors, errors
    records = tmp_path / "records.jsonl"
    records.write_text("\n".join(json.dumps({"id": k, "sound": os.path.relpath(p, tmp_path)})
                                 for k, p in paths.items() if k != "long.wav"))
    assert main(["--quiet", "--model", clap_dir, "--input", str(records), "--audio-field", "sound",
                 "--output", str(tmp_path / "o2")]) == 0
    check(tmp_path / "o2", ref)
    table = tmp_path / "clips.parquet"
    pq.write_table(pa.table({"id": ["x", "y"], "audio": pa.array([open(paths["two.wav"], "rb").read(),
                                                                   open(paths["a/one.wav"], "rb").read()])}), table)
    assert main(["--quiet", "--model", clap_dir, "--input", str(table), "--audio-field", "audio",
                 "--output", str(tmp_path / "o3")]) == 0
    check(tmp_path / "o3", {"x": ref["two.wav"], "y": ref["a/one.wav"]})
    for flags, why in ((["--input", str(folder), "--prompt", "x"], "--prompt shape texts"),
                       (["--input", str(records), "--audio-field", "sound", "--image-field", "sound"],
                        "--image-field and --audio-field"),
                       (["--input", str(folder), "--task", "classify"], "a CLAP model embeds audio")):
        capsys.readouterr()
        assert main(["--quiet", "--model", clap_dir, "--output", str(tmp_path / "bad"), *flags]) != 0
        assert why in capsys.readouterr().err


@pytest.mark.slow
def test_pipeline_serve_takes_clips_as_infinity_and_vllm_send_them(clap_dir, st, tmp_path):
    """pipeline-serve with CLAP: `modality: "audio"` inputs (base64, data URIs, files under the
    allowed directory) and vLLM's chat form (`input_audio` and `audio_url` parts, a text message)
    equal ST's vectors; what the model cannot take is a 400 naming it."""
    import httpx
    from serve_helpers import started_server

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    wav = write_wav(allowed / "a.wav", clip(2, 0))
    raw = base64.b64encode(open(wav, "rb").read()).decode()
    ref, text_ref = st.encode([wav])[0], st.encode(["a dog barking"])[0]
    with started_server("--model", clap_dir, "--num-render-workers", "1", "--allowed-local-media-path",
                        str(allowed)) as srv:
        def post(body):
            return httpx.post(srv.url + "/v1/embeddings", json=body, timeout=120)

        def vector(body):
            response = post(body)
            assert response.status_code == 200, response.text
            return np.array(response.json()["data"][0]["embedding"], dtype=np.float32)

        for item in (raw, "data:audio/wav;base64," + raw, wav, "file://" + wav):
            assert np.abs(vector({"input": [item], "modality": "audio"}) - ref).max() <= TOL, item[:40]
        for part in ({"type": "input_audio", "input_audio": {"data": raw, "format": "wav"}},
                     {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + raw}}):
            got = vector({"messages": [{"role": "user", "content": [part]}]})
            assert np.abs(got - ref).max() <= TOL, part["type"]
        got = vector({"messages": [{"role": "user", "content": "a dog barking"}]})
        assert np.abs(got - text_ref).max() <= TOL
        for body, why in (({"input": ["https://example.com/a.wav"], "modality": "audio"}, "not fetched"),
                          ({"input": ["x"], "modality": "image"}, "takes no images"),
                          ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "audio_url", "audio_url": {"url": wav}}]}]},
                           "holds 2 parts"),
                          ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                        "image_url": {"url": "data:image/png;base64,AA"}}]}]},
                           "takes no image inputs"),
                          ({"input": [base64.b64encode(b"not audio").decode()], "modality": "audio"}, "cannot be decoded")):
            response = post(body)
            assert response.status_code == 400 and why in response.text, (body, response.text)
