"""Regenerate the Python stubs of tllm.proto (needs grpcio-tools): `python -m
tllm.serve.grpc.generate`. The stubs are committed, so that serving needs grpcio alone."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]     # the repository root: imports read tllm.serve.grpc
PROTO = "tllm/serve/grpc/tllm.proto"


def generate(out_dir: Path = ROOT) -> int:
    from grpc_tools import protoc
    return protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out_dir}",
                        f"--grpc_python_out={out_dir}", str(ROOT / PROTO)])


if __name__ == "__main__":
    sys.exit(generate())
