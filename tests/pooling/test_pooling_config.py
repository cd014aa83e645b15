"""The sentence-transformers layout decides pooling and normalisation: both its pooling
config forms, the architecture's default without one, and unsupported modules refused."""
import json

import pytest

from tllm.loader.pooling_config import pooler_config
from tllm.pooling_params import PoolerConfig, PoolingParams


class Encoder:
    default_pooling = "cls"


def write_layout(path, modules, pooling):
    (path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
         for i, (t, p) in enumerate(modules)]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def test_defaults_without_a_layout(tmp_path):
    assert pooler_config(Encoder(), tmp_path) == PoolerConfig("cls", normalize=True)
    assert pooler_config(object(), None) == PoolerConfig("last", normalize=True)


@pytest.mark.parametrize("pooling,expected", [
    ({"pooling_mode": "mean"}, "mean"), ({"pooling_mode": ["lasttoken"]}, "last"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls")])
def test_pooling_modes_new_and_legacy(tmp_path, pooling, expected):
    write_layout(tmp_path, [("Transformer", ""), ("Pooling", "1_Pooling")], pooling)
    assert pooler_config(Encoder(), tmp_path) == PoolerConfig(expected, normalize=False)


@pytest.mark.parametrize("modules,pooling,match", [
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")],
     {"pooling_mode": "mean"}, "Dense"),
    ([("Pooling", "1_Pooling")], {"pooling_mode": "max"}, "max"),
    ([("Pooling", "1_Pooling")], {"pooling_mode": "mean", "include_prompt": False}, "prompt")])
def test_what_cannot_be_served_is_refused(tmp_path, modules, pooling, match):
    write_layout(tmp_path, modules, pooling)
    with pytest.raises(ValueError, match=match):
        pooler_config(Encoder(), tmp_path)


@pytest.mark.parametrize("kwargs,match", [
    (dict(task="embed", dimensions=0), "dimensions"), (dict(task="embed", normalize=1),
                                                        "normalize"),
    (dict(task="embed", truncate_prompt_tokens=0), "truncate_prompt_tokens")])
def test_pooling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoolingParams(**kwargs)
