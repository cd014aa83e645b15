"""Optional dependencies and the package extras that install them (pyproject.toml):
`pip install 'tllm[bench]'` for plots, `'tllm[visual]'` for visual generation, `'tllm[quant]'`
for llm-compressor (compressed-tensors) checkpoints. A feature checks its extra where it
starts, so the rest of tllm runs without them."""
from __future__ import annotations

import importlib.util

# extra -> the modules it provides (import names)
EXTRAS = {"bench": ("matplotlib",), "visual": ("diffusers", "PIL"),
          "grpc": ("grpc", "google.protobuf"), "quant": ("compressed_tensors",)}
_PIP_NAMES = {"PIL": "pillow", "grpc": "grpcio", "google.protobuf": "protobuf",
              "compressed_tensors": "compressed-tensors"}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def require_extra(extra: str, feature: str) -> None:
    """Raise MissingExtraError, naming `feature` and the extra, unless every module of the
    extra is installed. Nothing is imported."""
    for module in EXTRAS[extra]:
        if importlib.util.find_spec(module) is None:
            name = _PIP_NAMES.get(module, module)
            raise MissingExtraError(f"{feature} needs {name}: pip install 'tllm[{extra}]'")
