import logging

import pytest

pytest.importorskip("triton")
from triton import knobs  # noqa: E402

from tllm.kernels.triton import compile_log  # noqa: E402


def test_off_by_default(monkeypatch):
    monkeypatch.delenv("TLLM_LOG_TRITON_COMPILES", raising=False)
    assert compile_log.install_from_env() is False


def test_hooks_log_each_compile_with_its_time(monkeypatch, caplog):
    monkeypatch.setenv("TLLM_LOG_TRITON_COMPILES", "1")
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    assert compile_log.install_from_env() is True
    assert knobs.runtime.jit_cache_hook is compile_log._before
    with caplog.at_level(logging.WARNING, logger=compile_log.__name__):
        assert compile_log._before(repr="k[num_warps=4](x: *fp32)", key=1) is None  # compiles
        compile_log._after(repr="k[num_warps=4](x: *fp32)", key=1)
    assert "triton compiled k[num_warps=4](x: *fp32) in " in caplog.text
