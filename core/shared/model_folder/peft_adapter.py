"""A PEFT adapter in the Transformer module's folder (adapter_config.json), read as
sentence-transformers (ST) 6 and transformers find it, and checked in the caller's process.

ST's Transformer looks for adapter_config.json in the module's own folder (the model's root, or a
subfolder such as 0_Transformer/), and then needs peft: without it ST raises ImportError. Where the
base model's weights come from is transformers' rule: the folder itself when it holds a config.json
(a full model with an adapter saved beside it, as peft's `save_pretrained` into the model's folder
leaves it), else the adapter's `base_model_name_or_path` (what ST's `save` of a model with an
adapter writes: the adapter and the tokenizer, no config.json or base weights). That base is a local
folder, or a hub id found in the local Hugging Face cache -- never downloaded here.

Only the adapter kinds peft merges into the base layers, and whose merge was checked against peft's
own unmerged model (tests/test_peft_adapter.py), are taken (`MERGEABLE_TYPES`); the engine merges
them once, at load (core/engine/peft_merge.py). Any other kind is refused, named.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pooling_pipeline.core.shared.config import AdapterSpec
from pooling_pipeline.core.shared.model_folder.model_path import cached_hub_snapshot
from pooling_pipeline.core.shared.model_folder.st_files import read_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# peft's kinds whose weights merge into the layers they adapt, each checked (merged by the engine
# against peft's unmerged model) in tests/test_peft_adapter.py. LoRA's variants (DoRA, rsLoRA) are LORA.
MERGEABLE_TYPES = ("LORA", "ADALORA", "IA3", "LOHA", "LOKR")
# Kinds that add virtual tokens (or key/value prefixes) at run time: nothing to merge into the weights.
PROMPT_LEARNING_TYPES = ("PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "MULTITASK_PROMPT_TUNING", "ADAPTION_PROMPT",
                         "CPT", "CARTRIDGE")
# What the engine's base weights load from (a folder without them is only an adapter).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def adapter_files(where: Path) -> list[str]:
    """The PEFT adapter files in a module's folder (none: no adapter)."""
    if not (where / ADAPTER_CONFIG).is_file():
        return []  # transformers and ST key on the config alone
    return [ADAPTER_CONFIG] + [name for name in ADAPTER_WEIGHTS if (where / name).is_file()]


def read_adapter(where: Path) -> AdapterSpec | None:
    """The adapter in the Transformer module's folder `where`, or None where it has none."""
    files = adapter_files(where)
    if not files:
        return None
    named = f"{where}: a PEFT adapter ({', '.join(files)})"
    if importlib.util.find_spec("peft") is None:  # (ST raises ImportError here)
        raise ValueError(f"{named} needs the peft package to be loaded: pip install 'pooling-pipeline[peft]' "
                         "(sentence-transformers refuses it without peft too)")
    if len(files) == 1:
        raise ValueError(f"{named} has no weights (expected one of {', '.join(ADAPTER_WEIGHTS)})")
    cfg = read_json(where / ADAPTER_CONFIG)
    peft_type = str(cfg.get("peft_type"))
    if peft_type in PROMPT_LEARNING_TYPES:
        raise ValueError(f"{named} is a {peft_type} adapter: it adds virtual tokens at run time and cannot be "
                         f"merged into the model's weights; supported: {', '.join(MERGEABLE_TYPES)}")
    if peft_type not in MERGEABLE_TYPES:
        raise ValueError(f"{named} is of peft_type {peft_type!r}, which is not supported (supported: "
                         f"{', '.join(MERGEABLE_TYPES)}, merged into the base weights at load)")
    return AdapterSpec(peft_type=peft_type, base_path=str(_base_folder(where, cfg, named).resolve()))


def _base_folder(where: Path, cfg: dict, named: str) -> Path:
    """The folder of the base model's config.json and weights, by transformers' rule (module doc)."""
    if (where / "config.json").is_file():
        base = where
    else:
        name = cfg.get("base_model_name_or_path")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{named} has no config.json beside it and no base_model_name_or_path: its base model "
                             "is unknown")
        local = Path(name).expanduser()
        base = local if local.is_dir() else cached_hub_snapshot(name)
        if base is None:
            raise ValueError(f"{named}: its base model {name!r} (base_model_name_or_path) is neither a local folder "
                             "nor in the local Hugging Face cache; nothing is downloaded for a base model: download "
                             "it first (huggingface-cli download), or write its local path there")
        if adapter_files(base):
            raise ValueError(f"{named}: its base model {str(base)!r} holds an adapter of its own; an adapter on an "
                             "adapter is not supported")
    if not (base / "config.json").is_file() or not any((base / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(f"{named}: its base model folder {str(base)!r} lacks config.json or weights "
                         f"({', '.join(WEIGHT_FILES)})")
    return base
