"""pipeline-serve's hand-written JSON of embedding rows (serve/http.py's `embedding_items`, joined into the
body by serve/app.py's `list_response`): every dtype and layout a row can come in, read back by the
standard library's json and base64 as a client reads them."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from pooling_pipeline.serve.app import list_response
from pooling_pipeline.serve.http import base64_string, embedding_items, encode_json, float_rows


def rows_of_every_layout() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    wide = rng.standard_normal((3, 10)).astype(np.float32)
    return [rng.standard_normal(5).astype(np.float32),  # plain float32
            rng.standard_normal(5).astype(np.float16),  # another precision: widened to float32
            rng.standard_normal(5),  # float64: narrowed to float32, as the model's rows are
            wide[:, 2],  # a strided column: not contiguous
            np.array([0.0, -0.0, 1e-45, 3.4028235e38, -1.5], dtype=">f4"),  # big-endian, a subnormal, the max
            np.zeros(0, dtype=np.float32)]  # empty (dimensions never gives one, but it must not break)


def float32_rows_one_strided() -> list[np.ndarray]:
    """All float32, as the pipeline's rows are, but one a strided view: the encoder's fast path must not take it."""
    wide = np.random.default_rng(8).standard_normal((3, 10)).astype(np.float32)
    return [wide[0], wide[:, 3], wide[2]]


@pytest.mark.parametrize("make_rows", [rows_of_every_layout, float32_rows_one_strided])
@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_embedding_list_reads_back_as_the_float32_rows(encoding_format, make_rows):
    rows = make_rows()
    body = json.loads(list_response("embd", "m", embedding_items(rows, encoding_format), 12).body)
    assert list(body) == ["id", "object", "created", "model", "data", "usage"]
    assert body["object"] == "list" and body["model"] == "m" and body["id"].startswith("embd-")
    assert body["usage"] == {"prompt_tokens": 12, "total_tokens": 12, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    assert [item["index"] for item in body["data"]] == list(range(len(rows)))
    for item, row in zip(body["data"], rows):
        assert list(item) == ["object", "index", "embedding"] and item["object"] == "embedding"
        if encoding_format == "base64":
            got = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        else:
            got = np.asarray(item["embedding"], dtype=np.float64).astype(np.float32)
        want = row.astype(np.float32)
        assert got.shape == want.shape
        # exact: the JSON numbers read back as the same float32 values, the base64 is their bytes
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bit for bit (-0.0 too)


def test_the_dict_form_of_data_is_the_same_envelope():
    parts = json.loads(list_response("score", "m", embedding_items([np.ones(2, np.float32)], "float"), 3).body)
    plain = json.loads(list_response("score", "m", [{"object": "embedding", "index": 0, "embedding": [1.0, 1.0]}],
                                     3).body)
    for body in (parts, plain):
        body.pop("id"), body.pop("created")
    assert parts == plain


def test_pooling_values_read_back_as_float32_in_either_format():
    """/pooling's `data` (any shape: a vector, or a token-by-dimension matrix) in a msgspec-encoded body."""
    rows = [*rows_of_every_layout(), np.random.default_rng(3).standard_normal((4, 6)).astype(">f4")]
    for row in rows:
        want = row.astype(np.float32)
        text = json.loads(encode_json({"data": base64_string(row)}))["data"]
        got = np.frombuffer(base64.b64decode(text), dtype="<f4").reshape(want.shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        numbers = json.loads(encode_json({"data": float_rows(row)}))["data"]
        got = np.asarray(numbers, dtype=np.float64).astype(np.float32).reshape(want.shape)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
