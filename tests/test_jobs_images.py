"""pipeline-run on images (a dual encoder, tiny CLIP): --image-field (JSONL paths relative to the
input's folder, a Parquet binary column, a `datasets` Image struct column) and a folder of images
as an input (ids = paths relative to it) give the Python API's vectors (`Pipeline.embed`) within
1e-5; a bad image is that record's error and the job goes on; a resume after a partial run equals a
full run; a resume with another --image-decode, or on a folder that changed, is refused; what an
image job cannot do is refused at start-up."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import FakePipelineBase
from image_samples import build_broken_files, refused_here

from pooling_pipeline import load_results
from pooling_pipeline.jobs.image_records import ImageRecordReader, expand_job_inputs
from pooling_pipeline.jobs.job_errors import UsageError
from pooling_pipeline.jobs.launcher import main

TOL = 1e-5
# Test images the job reads (formats, modes, EXIF rotation, alpha, palette, 16-bit).
ALL_NAMES = ["photo.jpg", "rotated.jpg", "cmyk.jpg", "alpha.png", "palette.png", "grey16.png", "anim.gif",
             "picture.bmp", "picture.tiff", "picture.webp"]
NAMES = list(ALL_NAMES)


@pytest.fixture(scope="module")
def broken(tmp_path_factory, images):
    return build_broken_files(tmp_path_factory.mktemp("broken"), images["photo.jpg"])


@pytest.fixture(scope="module", autouse=True)
def served_names(image_backend):
    """The test images this environment's image processor decodes (image_samples.refused_here)."""
    NAMES[:] = [name for name in ALL_NAMES if name not in refused_here(image_backend)]


@pytest.fixture(scope="module")
def expected(clip_dir, images):
    """{image name: its vector from the Python API}."""
    from pooling_pipeline import Pipeline

    with Pipeline(model=clip_dir, num_render_workers=1) as pipe:
        outs = pipe.embed([str(images[n]) for n in NAMES], use_tqdm=False)
    return {n: o.embedding for n, o in zip(NAMES, outs)}


def job(*args: str) -> int:
    return main(["--quiet", *args])


def photos_folder(root, images, broken=None):
    """A folder of images in sub-folders (and broken files in one of them), with a hidden file and
    another job's metadata folder that are not inputs."""
    folder = root / "photos"
    for k, name in enumerate(NAMES):
        target = folder / ("a" if k % 2 else "b/c") / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(images[name], target)
    for path in (broken or {}).values():
        (folder / "bad").mkdir(exist_ok=True)
        shutil.copy(path, folder / "bad" / path.name)
    (folder / ".hidden.jpg").write_bytes(images["photo.jpg"].read_bytes())
    (folder / "_meta").mkdir()
    (folder / "_meta" / "x.png").write_bytes(images["tiny.png"].read_bytes())
    return folder


def check_vectors(out, expected, by_id: dict[str, str]):
    """The output's vectors are the API's of each id's image."""
    ids, data = load_results(out)
    assert sorted(ids) == sorted(by_id)
    want = np.stack([expected[by_id[i]] for i in ids])
    assert data.shape == want.shape and np.abs(data - want).max() <= TOL
    return ids, data


def errors_of(out) -> dict:
    path = out / "__job__" / "errors.jsonl"
    return {e["id"]: e for e in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


# -- with the model (process groups) ---------------------------------------------------------------

def test_a_folder_of_images_end_to_end(tmp_path, clip_dir, images, broken, expected):
    """One record per image file, sorted by its path relative to the folder (its id), hidden and
    "_" names skipped; the broken files are per-record errors and the rest of the job completes."""
    folder = photos_folder(tmp_path, images, broken)
    out = tmp_path / "out"
    assert job("--model", clip_dir, "--input", str(folder), "--output", str(out), "--errors", "return",
               "--chunk-rows", "4") == 0
    by_id = {("a/" if k % 2 else "b/c/") + name: name for k, name in enumerate(NAMES)}
    ids, _ = check_vectors(out, expected, by_id)
    errors = errors_of(out)
    assert set(errors) == {f"bad/{p.name}" for p in broken.values()}, errors
    assert all(e["file"] == str(folder) and "image" in e for e in errors.values())
    manifest = json.loads((out / "__job__" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["records_done"] == len(NAMES) + len(broken)
    assert manifest["params"]["image_decode"] == "exact"
    assert manifest["input_fingerprints"][0]["images"] == len(NAMES) + len(broken)
    # The input order is the sorted relative paths (errors.jsonl's index says where the bad ones were).
    order = sorted([*ids, *errors])
    assert ids == [i for i in order if i not in errors]
    assert all(order.index(i) == e["index"] for i, e in errors.items())


@pytest.mark.slow
def test_jsonl_with_relative_paths_and_bad_records(tmp_path, clip_dir, images, broken, expected, monkeypatch):
    """Paths relative to the JSONL's folder (and absolute ones); a missing file, a broken image, a
    null, a number and a missing field are errors of their records."""
    shutil.copytree(images["photo.jpg"].parent, tmp_path / "data" / "pics")
    shutil.copy(broken["truncated"], tmp_path / "data" / "pics" / "truncated.jpg")
    rows = [{"id": f"r{k}", "img": f"pics/{n}"} for k, n in enumerate(NAMES)]
    rows[3]["img"] = str(tmp_path / "data" / "pics" / NAMES[3])  # absolute
    rows += [{"id": "missing", "img": "pics/nope.jpg"}, {"id": "truncated", "img": "pics/truncated.jpg"},
             {"id": "null", "img": None}, {"id": "number", "img": 7}, {"id": "none"}]
    path = tmp_path / "data" / "recs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)  # not the JSONL's folder: relative paths are not relative to the working directory
    assert job("--model", clip_dir, "--input", "data/recs.jsonl", "--image-field", "img", "--output", str(out),
               "--errors", "return", "--format", "parquet") == 0
    check_vectors(out, expected, {f"r{k}": n for k, n in enumerate(NAMES)})
    errors = errors_of(out)
    assert set(errors) == {"missing", "truncated", "null", "number", "none"}
    assert "nope.jpg" in errors["missing"]["error"] and "cannot be decoded" in errors["truncated"]["error"]
    assert errors["null"]["error"] == "field 'img' is null" and "got int" in errors["number"]["error"]
    assert errors["none"]["error"] == "no field 'img' (--image-field)" and errors["none"]["line"] == len(NAMES) + 5


@pytest.mark.slow
def test_parquet_binary_and_datasets_image_struct_columns(tmp_path, clip_dir, images, expected, monkeypatch):
    """A binary column (each row an image file's bytes) and a `datasets` Image struct column (bytes
    when present, else the path, relative to the Parquet file's folder) in one job."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, Features, Image, Value

    (tmp_path / "in" / "pics").mkdir(parents=True)
    pq.write_table(pa.table({"id": [f"b{k}" for k in range(len(NAMES))],
                             "image": pa.array([images[n].read_bytes() for n in NAMES], pa.binary())}),
                   tmp_path / "in" / "1-bytes.parquet")
    structs = []
    for k, name in enumerate(NAMES):
        if k % 2:  # a path only, relative to the Parquet file
            shutil.copy(images[name], tmp_path / "in" / "pics" / name)
            structs.append(f"pics/{name}")
        else:  # the bytes, and a path that is not there: the bytes win
            structs.append({"bytes": images[name].read_bytes(), "path": f"elsewhere/{name}"})
    with monkeypatch.context() as m:
        m.chdir(tmp_path / "in")  # (datasets reads a path's file when the dataset is built)
        Dataset.from_dict({"id": [f"s{k}" for k in range(len(NAMES))], "image": structs},
                          features=Features({"id": Value("string"), "image": Image()})).to_parquet("2-struct.parquet")
    stored = pq.read_table(tmp_path / "in" / "2-struct.parquet").column("image").to_pylist()
    assert stored[0]["bytes"] and stored[1] == {"bytes": None, "path": f"pics/{NAMES[1]}"}  # both kinds of row
    out = tmp_path / "out"
    assert job("--model", clip_dir, "--input", str(tmp_path / "in"), "--image-field", "image",
               "--output", str(out)) == 0  # under --image-field a folder's record files are its inputs
    check_vectors(out, expected, {**{f"b{k}": n for k, n in enumerate(NAMES)},
                                  **{f"s{k}": n for k, n in enumerate(NAMES)}})


@pytest.mark.slow
def test_a_resume_after_a_partial_run_equals_a_full_run(tmp_path, clip_dir, images, broken, expected):
    folder = photos_folder(tmp_path, images, {"truncated": broken["truncated"]})
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["--model", clip_dir, "--input", str(folder), "--errors", "return", "--chunk-rows", "3"]
    assert job(*common, "--output", str(full)) == 0
    assert job(*common, "--output", str(part), "--limit", "4") == 0
    assert not json.loads((part / "__job__" / "manifest.json").read_text())["complete"]
    # Another decoding would mix two kinds of vectors in one job: refused before the model starts.
    assert job(*common, "--output", str(part), "--resume", "--image-decode", "draft") == 2
    assert job(*common, "--output", str(part), "--resume") == 0
    full_ids, full_data = load_results(full)
    part_ids, part_data = load_results(part)
    assert part_ids == full_ids and np.abs(part_data - full_data).max() <= TOL
    assert errors_of(part) == errors_of(full) and set(errors_of(full)) == {"bad/truncated.jpg"}


# -- without a model -------------------------------------------------------------------------------

class FakePipeline(FakePipelineBase):
    """A stand-in for the model: one vector per image, from its path's length or its bytes' length."""

    def encode_stream(self, prompts, task, **kw):
        for i, prompt in enumerate(prompts):
            assert set(prompt) == {"image"}
            yield SimpleNamespace(data=np.full(4, len(prompt["image"]), np.float32), error=None, num_prompt_tokens=1,
                                  index=i)


@pytest.fixture
def no_model(monkeypatch):
    import pooling_pipeline
    from pooling_pipeline.jobs import launcher

    monkeypatch.setattr(pooling_pipeline, "Pipeline", FakePipeline)
    monkeypatch.setattr(launcher, "format_stats", lambda stats: [])
    return monkeypatch


def test_a_resume_refuses_a_changed_folder_and_another_image_decode(tmp_path, clip_dir, images, no_model, capsys):
    """A folder is fingerprinted by its listing: a file added, or one rewritten (its size or
    modification time), makes a resume refuse, naming the folder; another --image-decode too, naming
    both values."""
    folder = photos_folder(tmp_path, images)
    out = tmp_path / "out"
    argv = ["--model", clip_dir, "--input", str(folder), "--output", str(out)]
    assert job(*argv, "--limit", "3") == 0
    assert job(*argv, "--resume", "--image-decode", "draft") == 2
    err = capsys.readouterr().err
    assert "--image-decode exact" in err and "--image-decode draft" in err, err
    os.utime(folder / "a" / NAMES[1], ns=(1, 1))
    assert job(*argv, "--resume") == 3
    assert "input folder" in (err := capsys.readouterr().err) and f"the same {len(NAMES)} image files" in err, err
    shutil.copy(images["tiny.png"], folder / "a" / "new.png")
    assert job(*argv, "--resume") == 3
    assert f"{len(NAMES)} image files then, {len(NAMES) + 1} now" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--long-inputs", "chunk"], "--long-inputs shape texts"),
    (["--prompt", "a photo of "], "--prompt shape texts"),
    (["--task", "token_embed"], "--task embed"),
    (["--id-field", "id"], "drop --id-field"),
    (["--ray"], "not supported with --ray"),
])
def test_what_an_image_job_cannot_do_is_refused_at_start_up(tmp_path, clip_dir, images, no_model, capsys, extra,
                                                            message):
    folder = photos_folder(tmp_path, images)
    assert job("--model", clip_dir, "--input", str(folder), "--output", str(tmp_path / "out"), *extra) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "__job__" / "manifest.json").exists()


def test_image_field_refusals(tmp_path, clip_dir, no_model, capsys):
    recs = tmp_path / "recs.jsonl"
    recs.write_text('{"id": "a", "image": "x.jpg", "text": "t"}\n')
    out = str(tmp_path / "out")
    assert job("--input", str(recs), "--image-field", "image", "--output", out) == 2  # the default text model
    assert "takes no images" in capsys.readouterr().err
    assert job("--model", clip_dir, "--input", str(recs), "--image-field", "image", "--pair-field", "text",
               "--output", out) == 2
    assert "--image-field and --pair-field" in capsys.readouterr().err
    assert job("--model", clip_dir, "--input", str(recs), "--image-field", "picture", "--output", out) == 3
    assert "--image-field 'picture' matches nothing" in capsys.readouterr().err
    lines = tmp_path / "paths.txt"
    lines.write_text("x.jpg\n")
    assert job("--model", clip_dir, "--input", str(lines), "--image-field", "image", "--output", out) == 2
    assert "--image-field needs fields" in capsys.readouterr().err


def test_which_folders_are_images(tmp_path, images):
    """A folder of images is one input for a model that takes images; a text folder stays a text
    folder (its stray images are not inputs); a folder mixing both is refused for an image model;
    images given one by one are refused (give their folder); a text model refuses an images-only folder."""
    pics = tmp_path / "pics"
    pics.mkdir()
    shutil.copy(images["photo.jpg"], pics / "p.jpg")
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("hello\n")
    shutil.copy(images["photo.jpg"], texts / "logo.jpg")
    yes, no = (lambda: "image"), (lambda: None)
    [folder] = expand_job_inputs([str(pics)], "auto", None, yes)
    assert folder.format == "images" and folder.files == ("p.jpg",)
    assert [s.path for s in expand_job_inputs([str(texts)], "auto", None, no)] == [str(texts / "a.txt")]
    with pytest.raises(UsageError, match="holds both image files .* and record files"):
        expand_job_inputs([str(texts)], "auto", None, yes)
    with pytest.raises(UsageError, match="the model takes no images"):
        expand_job_inputs([str(pics)], "auto", None, no)
    with pytest.raises(UsageError, match="is an image file: give the folder"):
        expand_job_inputs([str(pics / "p.jpg")], "auto", None, yes)
    with pytest.raises(UsageError, match="all images or all texts"):
        expand_job_inputs([str(pics), str(texts / "a.txt")], "auto", None, yes)
    # Under --image-field a folder's record files are the inputs (the images are what they name).
    assert [s.path for s in expand_job_inputs([str(texts)], "auto", "image", yes)] == [str(texts / "a.txt")]


def test_image_field_values(tmp_path):
    """What a record's image field may hold, read without a model: relative paths resolved against
    the input's folder, a struct's bytes before its path, data URIs as they are; the rest errors."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": "rel", "image": "sub/x.jpg"}, {"id": "abs", "image": "/abs/y.png"},
            {"id": "uri", "image": "data:image/png;base64,AAAA"}, {"id": "struct", "image": {"bytes": None, "path": "z.jpg"}},
            {"id": "empty", "image": ""}, {"id": "list", "image": ["a"]}, {"id": "nostruct", "image": {"bytes": None,
                                                                                                       "path": None}}]
    path = tmp_path / "recs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = {r.id: (r.text, r.error) for r in ImageRecordReader(expand_job_inputs([str(path)], "auto", "image", None),
                                                              "image").records()}
    assert got["rel"] == ({"image": str(tmp_path / "sub" / "x.jpg")}, None)
    assert got["abs"] == ({"image": "/abs/y.png"}, None) and got["uri"][0] == {"image": rows[2]["image"]}
    assert got["struct"] == ({"image": str(tmp_path / "z.jpg")}, None)
    assert got["empty"] == (None, "field 'image' is an empty path") and "got list" in got["list"][1]
    assert got["nostruct"][1] == "field 'image' is an image struct with neither bytes nor a path"
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": pa.array([b"\x89PNG", None, b""], pa.binary())}), table)
    got = [(r.id, r.text, r.error) for r in ImageRecordReader(expand_job_inputs([str(table)], "auto", "image", None),
                                                              "image").records()]
    assert got == [(f"{table}:1", {"image": b"\x89PNG"}, None), (f"{table}:2", None, "field 'image' is null"),
                   (f"{table}:3", None, "field 'image' holds no bytes (an empty image)")]
