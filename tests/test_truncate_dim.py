"""Matryoshka cuts and normalization, as sentence-transformers and vLLM define them (issue 34, items 1, 2, 4).

- ST's `encode(truncate_dim=k)` replaces the model's saved truncate_dim (any k up to the full width)
  and cuts after the model's own modules (a final Normalize acts on the full width); its
  `normalize_embeddings=True` cuts first, then normalizes.
- `PoolingParams(dimensions=k)` is vLLM's `dimensions`: the first k values, normalized when
  normalization is on (the model's final Normalize by default), whatever truncate_dim says.
- `PoolingParams(normalize=True)` on a model with a saved truncate_dim is ST's
  `normalize_embeddings=True`: unit vectors of truncate_dim values.
"""

from __future__ import annotations

import corpus
import model_zoo as zoo
import numpy as np
import pytest

from pooling_pipeline import Pipeline, PoolingParams, SentenceEncoder

TOL = 1e-5
TEXTS = corpus.sentences(12, seed=71) + corpus.medium_texts(3, seed=72) + ["", "a"]


def st_model(path: str):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu")


def vectors(pipe, **params) -> np.ndarray:
    outs = pipe.embed(TEXTS, pooling_params=PoolingParams(**params) if params else None, use_tqdm=False)
    return np.stack([o.embedding for o in outs])


def assert_close(got, ref, what: str) -> None:
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, sentence-transformers gives {ref.shape}"
    diff = float(np.abs(got.astype(np.float64) - ref).max())
    assert diff <= TOL, f"{what}: max |diff| {diff:.3g} vs sentence-transformers"


def norms(v: np.ndarray) -> np.ndarray:
    return np.linalg.norm(v, axis=1)


@pytest.fixture(scope="module")
def normalized_model(tmp_path_factory) -> str:
    """BERT, mean pooling, Normalize, saved with truncate_dim=8 (of 32)."""
    return zoo.build_st(tmp_path_factory.mktemp("td"), "bert", name="st-bert-td8-norm", normalize=True, truncate_dim=8)


@pytest.fixture(scope="module")
def raw_model(tmp_path_factory) -> str:
    """The same without Normalize."""
    return zoo.build_st(tmp_path_factory.mktemp("td"), "bert", name="st-bert-td8-raw", normalize=False, truncate_dim=8)


# One process group per model, shared by this module's tests (each call sets its own options).
@pytest.fixture(scope="module")
def pipes(normalized_model, raw_model):
    with Pipeline(model=normalized_model, num_render_workers=1) as norm, \
            Pipeline(model=raw_model, num_render_workers=1) as raw:
        yield {normalized_model: norm, raw_model: raw}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["normalized_model", "raw_model"])
def test_encoder_truncate_dim_replaces_the_saved_one(request, pipes, which):
    """Item 1: truncate_dim above (and below) the saved 8 gives that many values, equal to ST's,
    with and without normalize_embeddings."""
    path = request.getfixturevalue(which)
    st = st_model(path)
    assert st.encode(["x"]).shape == (1, 8)
    with SentenceEncoder(pipeline=pipes[path]) as enc:
        for truncate_dim in (None, 4, 24, 32):
            for normalize in (False, True):
                ref = st.encode(TEXTS, truncate_dim=truncate_dim, normalize_embeddings=normalize)
                got = enc.encode(TEXTS, truncate_dim=truncate_dim, normalize_embeddings=normalize)
                assert_close(got, ref, f"{which} truncate_dim={truncate_dim} normalize_embeddings={normalize}")
        assert enc.encode(TEXTS[:2], truncate_dim=24).shape == (2, 24)


@pytest.mark.slow
def test_normalize_true_with_a_saved_truncate_dim_gives_unit_vectors(normalized_model, raw_model, pipes):
    """Item 2: normalize=True cuts to the saved truncate_dim, then normalizes (ST's
    normalize_embeddings=True); the default is ST's default output (Normalize on the full width,
    then the cut: not unit vectors); normalize=False is the raw cut."""
    for path in (normalized_model, raw_model):
        st, pipe = st_model(path), pipes[path]
        unit = vectors(pipe, normalize=True)
        assert_close(unit, st.encode(TEXTS, normalize_embeddings=True), f"{path} normalize=True")
        assert np.allclose(norms(unit), 1.0, atol=1e-6)
        default = vectors(pipe)
        assert_close(default, st.encode(TEXTS), f"{path} default")
        raw_full = vectors(pipe, normalize=False, dimensions=32)
        assert_close(vectors(pipe, normalize=False), raw_full[:, :8], f"{path} normalize=False")
        if path == normalized_model:  # ST's default output here is not a unit vector: the test can fail
            assert norms(default).max() < 0.99


@pytest.mark.slow
def test_dimensions_is_vllms(normalized_model, raw_model, pipes):
    """Item 4: dimensions=k is the first k values of the full output, normalized when normalization
    is on: on a model without Normalize, ST's truncate_dim=k exactly (unnormalized); on a model with
    Normalize, ST's truncate_dim=k with normalize_embeddings=True (unit vectors)."""
    st_raw, st_norm = st_model(raw_model), st_model(normalized_model)
    raw, norm = pipes[raw_model], pipes[normalized_model]
    for k in (4, 16, 32):
        got = vectors(raw, dimensions=k)
        assert_close(got, st_raw.encode(TEXTS, truncate_dim=k), f"raw dimensions={k}")
    assert norms(got).min() > 1.5  # unnormalized: the test tells the two apart
    assert_close(vectors(raw, dimensions=16, normalize=True),
                 st_raw.encode(TEXTS, truncate_dim=16, normalize_embeddings=True), "raw dimensions=16 normalize")
    for k in (4, 16):
        got = vectors(norm, dimensions=k)
        assert_close(got, st_norm.encode(TEXTS, truncate_dim=k, normalize_embeddings=True), f"norm dimensions={k}")
        assert np.allclose(norms(got), 1.0, atol=1e-6)
