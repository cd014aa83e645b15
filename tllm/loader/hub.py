"""Hugging Face Hub ids ("org/name"): resolved to a snapshot folder of the local HF cache,
downloaded into it (huggingface_hub's own progress bars) when missing and the hub is
reachable. The HF environment (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE) is read here, when a
model resolves, so a setting made after import still counts."""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from tllm.loader.hf import CheckpointError

logger = logging.getLogger(__name__)

# Owner and name as the hub spells them; huggingface_hub validates the rest.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# What an engine reads: config, tokenizer and chat template files, and the weights.
_NEEDED = ["*.json", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_WEIGHTS = ["*.safetensors"]
_LEGACY_WEIGHTS = ["*.bin", "*.pt"]  # only for a repository without safetensors
# The engine reads the top folder only (repos keep ONNX exports, originals etc. below it).
_IGNORED = ["*/*"]
_TRUE = ("1", "on", "yes", "true")


def looks_like_hub_id(model: str) -> bool:
    return _HUB_ID.fullmatch(model) is not None


def hub_cache_dir(download_dir: str | os.PathLike | None = None) -> Path:
    """Where snapshots are looked for and saved: `download_dir`, else HF_HUB_CACHE, else
    $HF_HOME/hub, else huggingface_hub's default (~/.cache/huggingface/hub)."""
    if download_dir:
        return Path(download_dir).expanduser()
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    from huggingface_hub import constants
    return (os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE
            or bool(constants.HF_HUB_OFFLINE))


def resolve_hub_model(repo_id: str, revision: str | None = None,
                      download_dir: str | os.PathLike | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` (default: main): from the cache when
    it holds a complete one, else downloaded. CheckpointError naming the id, the cache and
    why when neither works."""
    cache_dir = hub_cache_dir(download_dir)
    snapshot, missing = _cached_snapshot(repo_id, revision, cache_dir)
    if snapshot is not None and not missing:
        return snapshot
    where = f"{repo_id!r}" + (f" (revision {revision!r})" if revision else "")
    found = (f"its cached snapshot {snapshot} lacks {missing}" if snapshot is not None
             else f"it is not in the Hugging Face cache {cache_dir}")
    if hub_offline():
        raise CheckpointError(f"model {where} is not a local path, {found}, and the hub is "
                              "offline (HF_HUB_OFFLINE is set)")
    logger.info("downloading %s into %s", where, cache_dir)
    return _download(repo_id, revision, cache_dir, where, found)


def _cached_snapshot(repo_id: str, revision: str | None,
                     cache_dir: Path) -> tuple[Path | None, str]:
    """(the cached snapshot folder or None, what it lacks that an engine needs or '')."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, LocalEntryNotFoundError
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                        local_files_only=True,
                                        allow_patterns=_NEEDED + _WEIGHTS,
                                        ignore_patterns=_IGNORED))
    except HFValidationError as exc:
        raise CheckpointError(f"model {repo_id!r} is neither a local path nor a valid "
                              f"hub id: {exc}") from None
    except LocalEntryNotFoundError:  # not cached, or known to be incomplete
        return None, ""
    return folder, _missing_files(folder)


def _missing_files(folder: Path) -> str:
    """What an engine needs that `folder` lacks ('' when nothing): the config and weights
    (every shard an index lists)."""
    if not (folder / "config.json").is_file():
        return "config.json"
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError):
            return index.name + " (unreadable)"
        absent = sorted(s for s in shards if not (folder / s).is_file())
        if absent:
            return f"{len(absent)} weight shards, e.g. {absent[0]}"
    has_weights = any(any(folder.glob(p)) for p in _WEIGHTS + _LEGACY_WEIGHTS)
    return "" if has_weights else "weight files"


def _download(repo_id: str, revision: str | None, cache_dir: Path, where: str,
              found: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                        allow_patterns=_NEEDED + _WEIGHTS,
                                        ignore_patterns=_IGNORED))
        if not any(folder.glob("*.safetensors")):  # an older repository: .bin weights
            folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                            allow_patterns=_NEEDED + _LEGACY_WEIGHTS,
                                            ignore_patterns=_IGNORED))
    except (RepositoryNotFoundError, GatedRepoError) as exc:  # OSErrors too: caught first
        raise CheckpointError(f"model {where} is not a local path and the hub refused it "
                              f"(not found, private or gated; set HF_TOKEN): {exc}") from None
    except RevisionNotFoundError as exc:  # an OSError too
        raise CheckpointError(f"model {where}: the hub has no such revision: {exc}") from None
    except (LocalEntryNotFoundError, OSError) as exc:  # connection errors included
        raise CheckpointError(f"model {where} is not a local path, {found}, and the hub "
                              f"could not be reached: {str(exc).splitlines()[0]}") from None
    missing = _missing_files(folder)
    if missing:
        raise CheckpointError(f"model {where}: the downloaded snapshot {folder} lacks "
                              f"{missing}")
    return folder
