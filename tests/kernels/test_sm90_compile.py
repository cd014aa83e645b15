"""The Triton interpreter runs a kernel as Python, so a kernel that would not compile for the
GPU passes every CPU test. benchmarks/sm90_compile_check.py compiles the kernels with the
least GPU coverage (the MoE decode paths, the fused q/k norms, the biased GEMV, the chunk
masks) for sm_90 with Triton's bundled ptxas, no GPU needed; here it must succeed. It runs in
a fresh process: this one has the interpreter switched on (conftest)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "sm90_compile_check.py"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="Triton's bundled ptxas is not installed")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode == 3:  # the script's NO_TOOLCHAIN: a trivial kernel fails too
        pytest.skip(done.stdout.strip()[-300:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FAILED" not in done.stdout
