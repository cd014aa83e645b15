"""The dispatch's own constant mark for Dynamo is the one torch's decorator sets, and a CPU
start (the CLI's import) never pays for importing torch._dynamo."""
from __future__ import annotations

import subprocess
import sys

import torch

from tllm.layers import dense_gemv_dispatch as dispatch


def test_constant_mark_matches_torch_decorator():
    def plain():
        return 1

    def marked():
        return 1

    torch.compiler.assume_constant_result(marked)
    added = set(vars(marked)) - set(vars(plain))
    assert added == {"_dynamo_marked_constant"}
    assert all(getattr(dispatch._decided_launch, name) == getattr(marked, name)
               for name in added)


def test_cli_import_leaves_dynamo_unloaded():
    code = "import sys, tllm.cli; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
