"""The sampling defaults a model recommends in its generation_config.json, as vLLM's
`--generation-config` takes them: `auto` (the default) reads the model folder's file, `vllm`
ignores it (tllm's own defaults), a path reads that folder's file (or that file). Its
temperature, top_p, top_k, min_p and repetition_penalty become the defaults of the requests
and `LLM.generate` calls that do not set them; other keys (EOS ids aside, read by the
tokenizer) are not sampling defaults here."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from tllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
def config_file(setting: str, model_dir: Path | None) -> Path | None:
    """The file a setting reads (None: none). `model_dir`: an HF model's folder (None for a
    GGUF file or random weights, which come without one, as in vLLM)."""
    if setting == "vllm":
        return None
    if setting == "auto":
        file = model_dir / FILE_NAME if model_dir is not None else None
        return file if file is not None and file.is_file() else None
    path = Path(setting).expanduser()
    file = path / FILE_NAME if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"generation_config {setting!r}: no {FILE_NAME} there")
    return file


def sampling_defaults(setting: str, model_dir: Path | None) -> dict[str, float | int]:
    """The sampling defaults the setting gives (empty: tllm's own), logged when there are
    any. ValueError naming the file for one that is not JSON or holds a bad value."""
    file = config_file(setting, model_dir)
    if file is None:
        return {}
    defaults = read_sampling_defaults(file)
    if defaults:
        logger.info("sampling defaults from %s: %s (for requests that do not set them; "
                    "--generation-config vllm ignores the file)", file,
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


def read_sampling_defaults(file: Path) -> dict[str, float | int]:
    fix = "(--generation-config vllm ignores the file)"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: not readable JSON: {exc} {fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object {fix}")
    defaults = {key: data[key] for key in SAMPLING_KEYS if data.get(key) is not None}
    for key, value in defaults.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{file}: {key} must be a number, got {value!r} {fix}")
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc} {fix}") from None
    return defaults
