"""Reading the files of a sentence-transformers folder: JSON, the entries of modules.json, and the
module configs several layouts share (a Dense module: on the sentence embedding, or on every
token of a multi-vector model)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pooling_pipeline.core.shared.config import DENSE_ACTIVATIONS, HeadModule

IGNORED_TYPES = {"Dropout"}  # no effect at inference


@dataclass(frozen=True)
class Module:
    """One entry of modules.json."""

    saved_type: object  # the class path as saved (messages quote it)
    kind: str           # its last part: ST moved the module classes between packages over time
    where: Path         # the module's folder


def read_modules(modules_path: Path) -> list[Module]:
    """modules.json's entries, in their `idx` order."""
    try:
        modules = json.loads(modules_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{modules_path} is not valid JSON: {e}") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_path} must be a list of module objects")
    return [Module(saved_type=m.get("type"), kind=str(m.get("type", "")).rsplit(".", 1)[-1],
                    where=modules_path.parent / str(m.get("path", "")))
            for m in sorted(modules, key=lambda m: m.get("idx", 0))]


def dense_module(cfg: dict, where: Path, trust_remote_code: bool) -> HeadModule:
    """A Dense module's config (on the sentence embedding) as the engine runs it."""
    unknown = set(cfg) - {"in_features", "out_features", "bias", "activation_function", "module_input_name",
                          "module_output_name", "use_residual"}
    if unknown:
        raise ValueError(f"{where}/config.json: Dense keys {sorted(unknown)} are not supported")
    for key in ("module_input_name", "module_output_name"):
        if cfg.get(key, "sentence_embedding") != "sentence_embedding":
            raise ValueError(f"{where}/config.json: a Dense module on {cfg[key]!r} is not supported "
                             "(only on the sentence embedding)")
    activation = _dense_activation(cfg, where, trust_remote_code)
    return HeadModule(kind="dense", path=str(where.resolve()), in_features=int(cfg["in_features"]),
                      out_features=int(cfg["out_features"]), bias=bool(cfg.get("bias", True)), activation=activation,
                      use_residual=bool(cfg.get("use_residual", False)))


def dense_chain_width(size: int, modules) -> int:
    """The width after a chain of head modules that starts `size` wide: each Dense must take what
    the module before it gives (a mismatch is the folder's error, named), and gives its out_features."""
    for module in modules:
        if module.kind == "dense":
            if module.in_features != size:
                raise ValueError(f"Dense module in {module.path!r} takes {module.in_features} features but the "
                                 f"module before it gives {size}")
            size = module.out_features
    return size


def _dense_activation(cfg: dict, where: Path, trust_remote_code: bool) -> str:
    """The torch.nn class name of a Dense module's activation."""
    activation = str(cfg.get("activation_function") or "torch.nn.modules.activation.Tanh")
    if not activation.startswith("torch.") and not trust_remote_code:
        activation = "torch.nn.modules.activation.Tanh"  # what ST loads for an untrusted class path
    name = activation.rsplit(".", 1)[-1]
    if not activation.startswith("torch.") or name not in DENSE_ACTIVATIONS:
        raise ValueError(f"{where}/config.json: Dense activation {activation!r} is not supported "
                         f"(torch.nn {DENSE_ACTIVATIONS})")
    return name


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model file {path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model file {path} is not a JSON object")
    return data


def read_optional_json(path: Path) -> dict:
    return read_json(path) if path.is_file() else {}
