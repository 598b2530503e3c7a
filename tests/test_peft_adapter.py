"""A PEFT adapter in the model folder (issue 48, item 10): loaded as sentence-transformers (ST) 6.3
loads it -- adapter_config.json in the Transformer module's folder, the base model from that folder
(when it holds a config.json) or from the adapter's base_model_name_or_path (a local folder, or a hub
id in the local cache) -- and merged into the base weights at load, equal to ST with peft within
1e-5 on the torch and the OpenVINO backends; the OpenVINO conversion is keyed by the adapter. Without
peft, or with an adapter kind that cannot be merged, the model is refused in the caller, named.

The reference is ST itself, loading the folder with peft (transformers' adapter integration, the
adapter unmerged). Building the adapters with ST's own `add_adapter` needs one allowance: transformers
5.25 asks for peft >= 0.22 there (MIN_PEFT_VERSION), newer than the newest release (0.21.2); its
loading path asks for no version. So `save_with_adapter` lowers that gate while it builds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
from pathlib import Path

import corpus
import model_zoo
import numpy as np
import pytest

from pooling_pipeline.core.shared.model_folder.load import load_model_spec

TOL = 1e-5
TEXTS = corpus.sentences(12, seed=481) + corpus.medium_texts(2, seed=482)
ADAPTED = 1e-2  # the adapter moves every reference vector by more than this (they measure 0.1-3)


@contextlib.contextmanager
def st_adds_adapters():
    """ST's `add_adapter`, with transformers' peft version gate lowered to the installed release."""
    import transformers.integrations.peft as integration

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(integration, "MIN_PEFT_VERSION", "0.21.0")
        yield


def lora(seed: int, targets: list[str], **kwargs):
    """A LoRA config whose weights start non-zero (init_lora_weights=False), so it changes the output."""
    import torch
    from peft import LoraConfig

    torch.manual_seed(seed)
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **kwargs)


def save_with_adapter(model_dir: str, target: Path, config, model_cls=None) -> str:
    """What ST 6.3's `save` writes for a model with an adapter (ST's own `add_adapter`): the adapter
    (adapter_config.json, adapter_model.safetensors) and the tokenizer in the Transformer's folder, no
    config.json or base weights; base_model_name_or_path is `model_dir`."""
    from sentence_transformers import SentenceTransformer

    with st_adds_adapters():
        model = (model_cls or SentenceTransformer)(model_dir, device="cpu")
        model.add_adapter(config)
        model.save(str(target))
    assert (target / "adapter_config.json").is_file() and not (target / "config.json").exists()
    return str(target)


def save_adapter_in_place(model_dir: str, target: Path, config) -> str:
    """A copy of `model_dir` with peft's own `save_pretrained` of an adapter written into its
    Transformer folder, beside the full model's config.json and weights (base_model_name_or_path
    names that folder)."""
    from peft import get_peft_model
    from transformers import AutoModel

    shutil.copytree(model_dir, target)
    get_peft_model(AutoModel.from_pretrained(str(target)), config).save_pretrained(str(target))
    return str(target)


def st_vectors(model_dir: str) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_dir, device="cpu").encode(TEXTS)


def pipeline_vectors(model_dir: str, backend: str = "torch") -> tuple[np.ndarray, dict]:
    from pooling_pipeline import Pipeline

    with Pipeline(model=model_dir, backend=backend, num_render_workers=1) as pipe:
        vectors = np.stack([o.embedding for o in pipe.embed(TEXTS, use_tqdm=False)])
        return vectors, pipe.stats()["engine"]


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= TOL, float(np.abs(got - want).max())


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("peft")
    base = model_zoo.build_st(root, "bert", name="st-bert")
    return {
        "base": base,
        "st_save": save_with_adapter(base, root / "st-bert-lora", lora(1, ["query", "value"])),
        "st_save_2": save_with_adapter(base, root / "st-bert-lora-2", lora(2, ["query", "value"])),
        "in_place": save_adapter_in_place(base, root / "st-bert-lora-in-place", lora(3, ["query", "key", "dense"])),
    }


# ---- equal to ST with peft -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("layout", ["st_save", "in_place"])
def test_adapter_merged_equals_sentence_transformers(models, layout):
    """Both layouts ST loads: its own save (the base named by base_model_name_or_path) and an adapter
    saved beside a full model (the base is that folder). The start-up info says the adapter is merged."""
    want = st_vectors(models[layout])
    assert float(np.abs(want - st_vectors(models["base"])).max()) > ADAPTED  # the adapter changes the output
    got, engine = pipeline_vectors(models[layout])
    assert engine["backend"] == "torch"
    base = models["base"] if layout == "st_save" else models[layout]
    assert engine["adapter"] == f"LORA merged into {Path(base).resolve()}"
    assert_close(got, want)


@pytest.mark.slow
def test_adapter_on_openvino_converts_the_merged_weights_and_keys_the_cache_by_the_adapter(models, tmp_path,
                                                                                          monkeypatch):
    """The OpenVINO backend converts the merged transformer (equal to ST); another adapter on the same
    base is another conversion, never the first one served from the cache. (Without the openvino
    extra, which CI installs, the backend is refused: asserted instead of skipping.)"""
    if importlib.util.find_spec("openvino") is None:
        with pytest.raises(ValueError, match="openvino"):
            pipeline_vectors(models["st_save"], "openvino")
        return
    monkeypatch.setenv("POOLING_PIPELINE_CACHE", str(tmp_path / "cache"))
    got, first = pipeline_vectors(models["st_save"], "openvino")
    assert first["backend"] == "openvino" and first["conversion"] == "converted"
    assert_close(got, st_vectors(models["st_save"]))
    got, second = pipeline_vectors(models["st_save_2"], "openvino")
    assert second["conversion"] == "converted" and second["conversion_cache"] != first["conversion_cache"]
    assert_close(got, st_vectors(models["st_save_2"]))
    got, again = pipeline_vectors(models["st_save"], "openvino")
    assert again["conversion"] == "cached" and again["conversion_cache"] == first["conversion_cache"]
    assert again["adapter"].startswith("LORA merged into") and again["adapter"].endswith("(the cached conversion of the merge)")
    assert_close(got, st_vectors(models["st_save"]))


def classifier_adapter_in_place(model_dir: str, target: Path) -> str:
    """A cross-encoder fine-tuned with peft's own API: LoRA with task_type SEQ_CLS, which trains the
    classifier head too (peft saves it as modules_to_save), saved beside the full model."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForSequenceClassification

    shutil.copytree(model_dir, target)
    adapted = get_peft_model(AutoModelForSequenceClassification.from_pretrained(str(target)),
                             lora(4, ["query", "value"], task_type="SEQ_CLS"))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "modules_to_save" in name:  # the head as trained: not the base's
                param.add_(0.5 * torch.randn_like(param))
    adapted.save_pretrained(str(target))
    assert set(json.loads((target / "adapter_config.json").read_text())["modules_to_save"]) >= {"classifier"}
    return str(target)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["st_save", "peft_in_place"])
def test_cross_encoder_with_adapter_equals_sentence_transformers(tmp_path, layout):
    """A cross-encoder (sequence classification) with a LoRA adapter, saved by ST's CrossEncoder, or
    by peft with its classifier head trained too: its scores equal ST's."""
    from sentence_transformers import CrossEncoder

    from pooling_pipeline import Pipeline

    base = model_zoo.build_cross_encoder(tmp_path, num_labels=1)
    if layout == "st_save":
        model_dir = save_with_adapter(base, tmp_path / "ce-lora", lora(4, ["query", "value"], task_type="SEQ_CLS"),
                                      model_cls=CrossEncoder)
    else:
        model_dir = classifier_adapter_in_place(base, tmp_path / "ce-lora")
    queries, docs = TEXTS[:4], TEXTS[4:8]
    want = CrossEncoder(model_dir, device="cpu").predict(list(zip(queries, docs)))
    plain = CrossEncoder(base, device="cpu").predict(list(zip(queries, docs)))
    assert float(np.abs(want - plain).max()) > 1e-3
    with Pipeline(model=model_dir, num_render_workers=1) as pipe:
        got = np.array([o.score for o in pipe.score(queries, docs, use_tqdm=False)])
        assert pipe.stats()["engine"]["adapter"].startswith("LORA merged into")
    assert float(np.abs(got - want).max()) <= TOL


@pytest.mark.slow
def test_decoder_embedder_with_adapter_equals_sentence_transformers(tmp_path):
    """A decoder embedder (Qwen3-Embedding's shape: last-token pooling, a prompt) with a LoRA adapter."""
    from sentence_transformers import SentenceTransformer

    from pooling_pipeline import Pipeline

    base = model_zoo.build_decoder_embedder(tmp_path, "qwen3")
    model_dir = save_with_adapter(base, tmp_path / "qwen3-lora", lora(5, ["q_proj", "v_proj", "down_proj"]))
    want = SentenceTransformer(model_dir, device="cpu").encode(TEXTS, prompt_name="query")
    with Pipeline(model=model_dir, num_render_workers=1) as pipe:
        got = np.stack([o.embedding for o in pipe.embed(TEXTS, prompt_name="query", use_tqdm=False)])
        assert pipe.stats()["engine"]["adapter"] == f"LORA merged into {Path(base).resolve()}"
    assert_close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "dora", "adalora", "ia3", "loha", "lokr"])
def test_every_supported_kind_merges_to_the_unmerged_adapter(tmp_path, kind):
    """Each kind MERGEABLE_TYPES takes: the engine's merged transformer computes what peft's unmerged
    model computes (to float32 rounding)."""
    import torch
    from peft import AdaLoraConfig, IA3Config, LoHaConfig, LoKrConfig, PeftModel, get_peft_model
    from tiny_models import build_bert
    from transformers import AutoConfig, BertModel

    from pooling_pipeline.core.engine.model_runner import load_transformer

    base = build_bert(tmp_path / "base")
    config = {
        "lora": lambda: lora(6, ["query", "value", "dense"]),
        "dora": lambda: lora(6, ["query", "value"], use_dora=True),
        "adalora": lambda: AdaLoraConfig(init_r=4, target_modules=["query", "value"], total_step=10,
                                         init_lora_weights=False),
        "ia3": lambda: IA3Config(target_modules=["key", "value", "output.dense"], feedforward_modules=["output.dense"],
                                 init_ia3_weights=False),
        "loha": lambda: LoHaConfig(r=4, alpha=8, target_modules=["query", "value"], init_weights=False),
        "lokr": lambda: LoKrConfig(r=4, alpha=8, target_modules=["query", "value"], init_weights=False),
    }[kind]()
    torch.manual_seed(7)
    adapted = get_peft_model(BertModel.from_pretrained(base), config)
    with torch.no_grad():  # kinds whose weights start at the identity: moved off it
        for name, param in adapted.named_parameters():
            if "ia3_l" in name or (kind == "adalora" and "lora_" in name):
                param.add_(0.3 * torch.randn_like(param))
    adapter_dir = tmp_path / kind
    adapted.save_pretrained(adapter_dir)
    model_zoo.copy_wordpiece(adapter_dir)

    spec = load_model_spec(adapter_dir)
    assert spec.adapter is not None and spec.adapter.base_path == str(Path(base).resolve())
    merged = load_transformer(spec, AutoConfig.from_pretrained(spec.base_path), torch.float32)
    assert not any("lora" in n or "ia3" in n or "hada" in n or "lokr" in n for n, _ in merged.named_parameters())
    reference = PeftModel.from_pretrained(BertModel.from_pretrained(base), str(adapter_dir)).eval()
    plain = BertModel.from_pretrained(base).eval()
    ids = torch.randint(0, 30000, (3, 24), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    mask[2, 10:] = 0
    with torch.no_grad():
        got, want = (m(input_ids=ids, attention_mask=mask)[0][mask.bool()] for m in (merged, reference))
        before = plain(input_ids=ids, attention_mask=mask)[0][mask.bool()]
    assert float((want - before).abs().max()) > 100 * TOL  # the adapter changes the output (LoHa's least: ~9e-3)
    assert float((got - want).abs().max()) <= TOL


# ---- refused in the caller, named ------------------------------------------------------------------

def adapter_folder(target: Path, peft_type: str = "LORA", base: str | None = None, weights: bool = True,
                   config: bool = True) -> Path:
    """A hand-written folder (no model is built): a BERT config.json (unless `config` is False),
    the WordPiece tokenizer, adapter_config.json and a placeholder adapter weights file. Enough for
    what the caller reads; no engine loads it."""
    target.mkdir(parents=True)
    model_zoo.copy_wordpiece(target)
    if config:
        (target / "config.json").write_text(json.dumps({
            "model_type": "bert", "architectures": ["BertModel"], "hidden_size": 32, "vocab_size": 30522,
            "max_position_embeddings": 128}))
        (target / "model.safetensors").write_bytes(b"base weights")
    (target / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type,
                                                            "base_model_name_or_path": base}))
    if weights:
        (target / "adapter_model.safetensors").write_bytes(b"adapter weights")
    return target


def test_without_peft_the_caller_is_told_the_files_and_the_extra(tmp_path, monkeypatch):
    """As ST refuses without peft (ImportError), the caller gets a ValueError before any process
    starts, naming the adapter's files and the extra to install. peft is made unimportable here."""
    import sys

    from pooling_pipeline import Pipeline

    folder = adapter_folder(tmp_path / "m")
    monkeypatch.setitem(sys.modules, "peft", None)
    for load in (lambda: load_model_spec(folder), lambda: Pipeline(model=str(folder))):
        with pytest.raises(ValueError) as e:
            load()
        message = str(e.value)
        assert "adapter_config.json" in message and "adapter_model.safetensors" in message
        assert "pooling-pipeline[peft]" in message


@pytest.mark.parametrize("peft_type, reason", [("PROMPT_TUNING", "virtual tokens"), ("PREFIX_TUNING", "virtual tokens"),
                                               ("VERA", "not supported"), ("XLORA", "not supported")])
def test_adapter_kinds_that_are_not_merged_are_refused_by_name(tmp_path, peft_type, reason):
    folder = adapter_folder(tmp_path / "m", peft_type=peft_type)
    with pytest.raises(ValueError, match=f"{peft_type}.*{reason}|{reason}.*{peft_type}"):
        load_model_spec(folder)


def test_adapter_without_weights_is_refused(tmp_path):
    with pytest.raises(ValueError, match="adapter_config.json.*has no weights"):
        load_model_spec(adapter_folder(tmp_path / "m", weights=False))


def test_base_model_from_a_local_folder_or_the_hub_cache_never_downloaded(tmp_path, monkeypatch):
    """An adapter without config.json beside it loads its base from base_model_name_or_path: a
    local folder, or a hub id in the local cache; a hub id the cache lacks is a clear error (nothing
    is downloaded, even with the hub reachable)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32, "vocab_size": 30522}))
    (base / "model.safetensors").write_bytes(b"base weights")

    local = load_model_spec(adapter_folder(tmp_path / "local", base=str(base), config=False))
    assert local.adapter.base_path == str(base.resolve()) and local.path == str((tmp_path / "local").resolve())
    assert local.base_path == local.adapter.base_path and local.hidden_size == 32

    snapshot = model_zoo.lay_out_hf_cache(base, tmp_path / "hf", repo_id="zoo-org/peft-base")
    cached = load_model_spec(adapter_folder(tmp_path / "cached", base="zoo-org/peft-base", config=False))
    assert cached.adapter.base_path == str(Path(snapshot).resolve())

    with pytest.raises(ValueError, match="'zoo-org/not-cached'.*nor in the local Hugging Face cache"):
        load_model_spec(adapter_folder(tmp_path / "missing", base="zoo-org/not-cached", config=False))
    with pytest.raises(ValueError, match="base model is unknown"):
        load_model_spec(adapter_folder(tmp_path / "none", base=None, config=False))
    (base / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(ValueError, match="adapter of its own"):
        load_model_spec(adapter_folder(tmp_path / "chained", base=str(base), config=False))


def test_adapter_in_a_subfolder_transformer_module(tmp_path):
    """ST looks in the Transformer module's own folder (0_Transformer/ here), not the model's root."""
    root = tmp_path / "m"
    adapter_folder(root / "0_Transformer")
    (root / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"}]))
    spec = load_model_spec(root)
    assert spec.adapter is not None and spec.adapter.base_path == str((root / "0_Transformer").resolve())


def test_dual_encoder_with_adapter_is_refused(tmp_path):
    folder = tmp_path / "clip"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "clip"}))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    with pytest.raises(ValueError, match="adapter_config.json.*dual encoder"):
        load_model_spec(folder)


def test_conversion_cache_and_job_fingerprint_cover_the_adapter_and_its_base(tmp_path):
    """The OpenVINO conversion's key and a job's model fingerprint change with the adapter's weights
    and with the base model's weights in their own folder (and with an adapter saved beside a full
    model: its folder's files)."""
    from pooling_pipeline.core.engine.openvino_model import cache_key
    from pooling_pipeline.jobs.job_spec import JobModel
    from pooling_pipeline.jobs.launcher import model_fingerprint_files

    base = tmp_path / "base"
    adapter_folder(base, peft_type="LORA")
    (base / "adapter_config.json").unlink()
    (base / "adapter_model.safetensors").unlink()
    folder = adapter_folder(tmp_path / "m", base=str(base), config=False)

    def identities() -> tuple[str, str]:
        spec = load_model_spec(folder)
        files = model_fingerprint_files(JobModel(root=folder, spec=spec))
        return cache_key(spec, "0", output="last_hidden_state", base=False, inputs=["input_ids"]), json.dumps(files)

    first = identities()
    (folder / "adapter_model.safetensors").write_bytes(b"other adapter weights")
    second = identities()
    (base / "model.safetensors").write_bytes(b"other base weights")
    third = identities()
    assert len({first[0], second[0], third[0]}) == 3 and len({first[1], second[1], third[1]}) == 3

    in_place = adapter_folder(tmp_path / "in-place")
    before = cache_key(load_model_spec(in_place), "0", output="last_hidden_state", base=False, inputs=["input_ids"])
    (in_place / "adapter_model.safetensors").write_bytes(b"other adapter weights")
    assert cache_key(load_model_spec(in_place), "0", output="last_hidden_state", base=False,
                     inputs=["input_ids"]) != before
