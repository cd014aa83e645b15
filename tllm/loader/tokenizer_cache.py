"""A GGUF file's tokenizer, saved once as an HF tokenizer folder and read from there after.

transformers builds a GGUF's tokenizer from the file's metadata: with a 49k-token vocabulary
and its merges that is ~200k metadata strings read one by one (5-6 s for SmolLM2 on a 2-core
CPU), on every start of every process. The saved folder (tokenizer.json, its config, the chat
template) loads in a fraction of a second. The key is the file's resolved path, size and
modification time, so a replaced file gets a new entry. The folder lives under
$TLLM_CACHE_DIR (default ~/.cache/tllm); `TLLM_CACHE_DIR=off` turns the cache off, and any
failure to read or write it falls back to building from the file."""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from tllm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
# Part of the key: bump when what is saved (or how it is built) changes.
CACHE_VERSION = 1


def cache_root() -> Path | None:
    setting = os.environ.get("TLLM_CACHE_DIR", "")
    if setting.lower() in ("off", "0", "none"):
        return None
    return Path(setting) if setting else Path.home() / ".cache" / "tllm"


def entry_dir(path: Path) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    resolved = path.resolve()
    stat = resolved.stat()
    key = f"{CACHE_VERSION}|{resolved}|{stat.st_size}|{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return root / "gguf-tokenizers" / f"{resolved.stem}-{digest}"


def cached_tokenizer(path: Path, build: Callable[[], Tokenizer]) -> Tokenizer:
    """The tokenizer of the GGUF at `path`: from its saved folder when there is one, else
    `build()`, saved for the next time."""
    try:
        entry = entry_dir(path)
    except OSError:
        entry = None
    if entry is not None and (entry / "tokenizer.json").is_file():
        try:
            return Tokenizer.from_pretrained(entry)
        except Exception as exc:  # a damaged entry: rebuild it
            logger.warning("tokenizer cache entry %s unreadable (%s); rebuilding", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    tokenizer = build()
    if entry is not None:
        _save(tokenizer, entry)
    return tokenizer


def _save(tokenizer: Tokenizer, entry: Path) -> None:
    """Written into a temporary folder and renamed, so a reader never sees half an entry
    (and of two processes saving at once, one rename wins)."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".saving-", dir=entry.parent))
        tokenizer.hf.save_pretrained(staging)
        try:
            os.replace(staging, entry)
        except OSError:  # another process saved it first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        logger.info("tokenizer cache not written (%s): %s", entry, exc)
