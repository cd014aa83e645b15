"""The progress bar while weights load: one step per stored tensor of an HF or GGUF
checkpoint, reaching the total; off when asked, above INFO, or under TQDM_DISABLE."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.loader.gguf_writer import write_gguf
from tllm import loader
from tllm.attention.interface import get_attention_backend
from tllm.loader import hf


@pytest.fixture(autouse=True)
def _bars_allowed(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)


def load(path, **kwargs) -> None:
    source = loader.resolve_model(str(path))
    config, checkpoint = loader.load_config(source)
    model = loader.build_model(config, get_attention_backend("torch"), torch.float32,
                               torch.device("cpu"), 64)
    loader.load_weights(model, source, checkpoint, seed=0, **kwargs)


def test_hf_checkpoint_shows_a_bar_over_its_tensors(tiny_llama, capsys):
    num = hf.count_tensors(hf.weight_files(tiny_llama[0]))
    assert num == len(tiny_llama[1].state_dict())
    load(tiny_llama[0])
    err = capsys.readouterr().err
    assert "Loading weights: 100%" in err and f"{num}/{num}" in err


def test_gguf_checkpoint_shows_a_bar_over_its_tensors(tiny_llama, tmp_path, capsys):
    path = write_gguf(tiny_llama[1], tmp_path / "tiny.gguf", "llama")
    num = loader.load_config(loader.resolve_model(str(path)))[1].num_weight_tensors
    load(path)
    err = capsys.readouterr().err
    assert "Loading weights: 100%" in err and f"{num}/{num}" in err


def test_no_bar_when_asked_when_quiet_or_under_tqdm_disable(tiny_llama, capsys, monkeypatch):
    load(tiny_llama[0], show_progress=False)
    assert "Loading weights" not in capsys.readouterr().err
    tllm_logger = logging.getLogger("tllm")
    monkeypatch.setattr(tllm_logger, "level", logging.WARNING)
    load(tiny_llama[0])
    assert "Loading weights" not in capsys.readouterr().err
    monkeypatch.setattr(tllm_logger, "level", logging.NOTSET)
    monkeypatch.setenv("TQDM_DISABLE", "1")
    load(tiny_llama[0])
    assert "Loading weights" not in capsys.readouterr().err
