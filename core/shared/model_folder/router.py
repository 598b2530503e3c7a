"""ST's Router (Asym): a model with a chain of modules per route."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from pooling_pipeline.core.shared.config import ModelSpec, PoolingSpec
from pooling_pipeline.core.shared.model_folder.chain_spec import spec_of_layout
from pooling_pipeline.core.shared.model_folder.st_config import positive_int, read_st_config
from pooling_pipeline.core.shared.model_folder.st_files import Module, read_json, read_modules, read_optional_json
from pooling_pipeline.core.shared.model_folder.st_layout import STLayout
from pooling_pipeline.core.shared.model_folder.st_modules import read_chain
from pooling_pipeline.core.shared.model_folder.transformer_config import check_tokenizer_files, tokenizer_max_length

_ROUTER_TYPES = {"Router", "Asym"}  # Asym: ST's older name of the same module
_ROUTER_KEYS = {"default_route", "allow_empty_key", "route_mappings"}


def router_module(root: Path) -> Module | None:
    """modules.json's Router (ST allows it only as the first, input module), or None."""
    if not (root / "modules.json").is_file():
        return None
    modules = read_modules(root / "modules.json")
    for position, module in enumerate(modules):
        if module.kind in _ROUTER_TYPES:
            if position != 0:
                raise ValueError(f"{root / 'modules.json'}: a {module.kind} module must come first")
            return module
    return None


def load_router_spec(root: Path, trust_remote_code: bool) -> ModelSpec:
    """A Router model: each route is the route's modules followed by the modules after the Router
    in modules.json (as ST runs them), read as one chain into a ModelSpec of its own. The spec
    returned is the first transformer route's, with the routes, their specs and ST's resolution."""
    modules_path = root / "modules.json"
    router, *after = read_modules(modules_path)
    config_path, config = _router_config(router.where)
    chains = _router_chains(router, config, config_path, after)
    route_specs = [_route_spec(root, name, chain, after, modules_path, trust_remote_code)
                   for name, chain in chains.items()]
    routes = list(chains)
    default_route, by_task, any_task = _router_resolution(config, config_path, routes)
    transformers = [spec for spec in route_specs if spec.input_module == "transformer"]
    dense_static = [name for name, spec in zip(routes, route_specs) if spec.input_module == "static_embedding"]
    if dense_static and any(spec.input_module == "sparse_static_embedding" for spec in route_specs):
        raise ValueError(f"{config_path}: a Router mixing StaticEmbedding and SparseStaticEmbedding is not supported")
    if not transformers:
        raise ValueError(f"{config_path}: no route has a Transformer; a Router of static embeddings only is not "
                         "supported")
    _check_routes_agree(route_specs, routes, config_path)
    return msgspec.structs.replace(
        transformers[0], routes=routes, route_specs=route_specs, default_route=default_route,
        route_by_task=by_task, route_any_task=any_task,
        max_model_len=max(spec.max_model_len for spec in route_specs),
        default_max_tokens=max(spec.default_max_tokens for spec in route_specs))


def _router_config(where: Path) -> tuple[Path, dict]:
    """router_config.json (or the legacy config.json ST falls back to)."""
    for name in ("router_config.json", "config.json"):
        if (where / name).is_file():
            config = read_json(where / name)
            if not isinstance(config.get("types"), dict) or not isinstance(config.get("structure"), dict):
                raise ValueError(f"{where / name}: a Router config needs 'types' and 'structure' objects")
            return where / name, config
    raise ValueError(f"{where}: the Router module has no router_config.json")


def _router_chains(router: Module, config: dict, config_path: Path, after: list[Module]) -> dict[str, list[Module]]:
    """Each route's modules (the route's own, then those after the Router), by route name."""
    types = config["types"]
    chains: dict[str, list[Module]] = {}
    for name, module_ids in config["structure"].items():
        if not isinstance(module_ids, list) or not module_ids:
            raise ValueError(f"{config_path}: route {name!r} has no modules")
        chain = []
        for module_id in module_ids:
            if module_id not in types or ".." in str(module_id) or str(module_id).startswith("/"):
                raise ValueError(f"{config_path}: route {name!r} names module {module_id!r} that 'types' lacks")
            chain.append(Module(saved_type=types[module_id], kind=str(types[module_id]).rsplit(".", 1)[-1],
                                 where=router.where / str(module_id)))
        chains[str(name)] = chain + after
    if not chains:
        raise ValueError(f"{config_path}: the Router has no routes")
    return chains


def _route_spec(root: Path, name: str, chain: list[Module], after: list[Module], modules_path: Path,
                trust_remote_code: bool) -> ModelSpec:
    if chain[0].kind == "SparseStaticEmbedding":
        if len(chain) > 1:
            raise ValueError(f"{modules_path}: route {name!r}: modules after SparseStaticEmbedding "
                             f"({chain[1].saved_type!r}) are not supported")
        static = _static_embedding_spec(chain[0].where)
        # (SparseEncoder's max_active_dims applies to every route's output)
        return msgspec.structs.replace(static, max_active_dims=positive_int(
            read_optional_json(root / "config_sentence_transformers.json"), "max_active_dims", root))
    if chain[0].kind in _ROUTER_TYPES:
        raise ValueError(f"{modules_path}: route {name!r}: a Router inside a Router is not supported")
    layout = STLayout(transformer_dir=root)
    read_st_config(layout, root)
    try:
        read_chain(layout, chain, modules_path, trust_remote_code)
        return spec_of_layout(root, layout, trust_remote_code)
    except ValueError as e:
        raise ValueError(f"route {name!r}: {e}") from None


def _static_embedding_spec(where: Path) -> ModelSpec:
    """ST's SparseStaticEmbedding: its tokenizer (in its folder) tokenizes the text without special
    tokens, truncated at the tokenizer's model_max_length; each token id present gets its weight."""
    cfg = read_optional_json(where / "config.json")
    if set(cfg) - {"frozen"}:
        raise ValueError(f"{where}/config.json: SparseStaticEmbedding keys {sorted(set(cfg) - {'frozen'})} are not "
                         "supported (an idf.json 'path' is not read: weights must be saved in the module's folder)")
    if not any((where / name).is_file() for name in ("model.safetensors", "pytorch_model.bin")):
        raise ValueError(f"{where}: SparseStaticEmbedding has no weights (model.safetensors or pytorch_model.bin)")
    check_tokenizer_files(where, f"{where}: SparseStaticEmbedding")
    max_length = tokenizer_max_length(where)
    if max_length is None:
        raise ValueError(f"{where}: SparseStaticEmbedding's tokenizer has no model_max_length (ST would not "
                         "truncate its texts at all); not supported")
    vocab_size = _static_vocab_size(where)
    return ModelSpec(path=str(where.resolve()), model_type="", architectures=[], hidden_size=vocab_size,
                     embedding_size=vocab_size, vocab_size=vocab_size, max_model_len=max_length,
                     default_max_tokens=max_length, pooling=PoolingSpec(modes=["max"]), normalize=False,
                     do_lower_case=False, tasks=["sparse_embed"], input_module="sparse_static_embedding",
                     add_special_tokens=False)


def _static_vocab_size(where: Path) -> int:
    """The length of the saved weight vector (ST's num_dimensions), read from the safetensors header."""
    path = where / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"{where}: SparseStaticEmbedding weights must be model.safetensors")
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    shape = (header.get("weight") or {}).get("shape")
    if not (isinstance(shape, list) and len(shape) == 1):
        raise ValueError(f"{path}: SparseStaticEmbedding needs one 'weight' vector, got {shape}")
    return int(shape[0])


def _router_resolution(config: dict, config_path: Path, routes: list[str]
                       ) -> tuple[str | None, dict[str, str], str | None]:
    """ST's Router resolution for text inputs: (default route, route by task, any task's route).
    ST's order: (task, "text"), (task, None), (None, "text"), (None, None), the task's own route,
    a route named "text", then (no task) the default route; allow_empty_key with no default
    makes the first route the default."""
    import ast

    params = config.get("parameters") or {}
    if set(params) - _ROUTER_KEYS:
        raise ValueError(f"{config_path}: Router parameters {sorted(set(params) - _ROUTER_KEYS)} are not supported")
    default = params.get("default_route")
    if default is None and params.get("allow_empty_key", True):
        default = routes[0]
    if default is not None and default not in routes:
        raise ValueError(f"{config_path}: default_route {default!r} is not among the routes {routes}")
    mappings = {}
    for key, route in (params.get("route_mappings") or {}).items():
        try:
            task, modality = ast.literal_eval(key)
        except (ValueError, SyntaxError, TypeError):
            raise ValueError(f"{config_path}: route_mappings key {key!r} is not a (task, modality) pair") from None
        if route not in routes:
            raise ValueError(f"{config_path}: route_mappings maps {key} to {route!r}, not among the routes {routes}")
        if modality in ("text", None):  # other modalities never apply to text
            mappings[(task, modality)] = route
    by_task = {}
    for (task, _modality), route in sorted(mappings.items(), key=lambda kv: kv[0][1] is None):
        if task is not None:
            by_task.setdefault(task, route)  # (task, "text") before (task, None)
    any_task = mappings.get((None, "text"), mappings.get((None, None)))
    return default, by_task, any_task


def _check_routes_agree(route_specs: list[ModelSpec], routes: list[str], config_path: Path) -> None:
    """What one engine and one request format need of all routes: one task family, one vocabulary."""
    tasks = {"sparse_embed" in spec.tasks for spec in route_specs}
    if len(tasks) > 1:
        raise ValueError(f"{config_path}: the routes {routes} compute different things "
                         f"({[spec.tasks for spec in route_specs]}); a Router mixing sparse and dense routes "
                         "is not supported")
    vocab_sizes = {spec.vocab_size for spec in route_specs}
    if len(vocab_sizes) > 1:
        raise ValueError(f"{config_path}: the routes {routes} have different vocabularies "
                         f"({[spec.vocab_size for spec in route_specs]}); not supported")
    sizes = {spec.embedding_size for spec in route_specs}
    if "sparse_embed" not in route_specs[0].tasks and len(sizes) > 1:
        raise ValueError(f"{config_path}: the routes {routes} give embeddings of different sizes "
                         f"({[spec.embedding_size for spec in route_specs]}); not supported")
    if any(spec.head != "none" for spec in route_specs):
        raise ValueError(f"{config_path}: routes ending in a classification head are not supported")
