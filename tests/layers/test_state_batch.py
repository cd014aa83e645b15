"""A state-space mixer captured into piecewise graphs (DeferredBatch): its state update is
handed to the recorder with a closure that, at replay, plans the step's batch and runs the
update on the step's rows. A stand-in recorder runs that closure at once with a mixed
step's metadata (a prompt chunk from position 0 and a decode): the outputs and states equal
the eager forward's, the buffer it asks for has the update's shape and dtype, and the step
is planned once for all layers."""
import copy
from types import SimpleNamespace

import pytest
import torch

from tllm.kv_cache.state_cache import StateCache
from tllm.layers.gated_deltanet import DeltaNetStateSpec, GatedDeltaNet, GatedDeltaNetDims
from tllm.layers.mamba2 import Mamba2Dims, Mamba2Mixer, StateSpec
from tllm.layers.state_batch import DeferredBatch

MAMBA = Mamba2Dims(hidden_size=32, num_heads=4, head_dim=8, num_groups=2, state_size=8,
                   conv_kernel=4, chunk_size=4, eps=1e-5)
DELTA = GatedDeltaNetDims(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8,
                          head_v_dim=6, conv_kernel=4, eps=1e-5, chunk_size=4)


class RunAtOnce:
    """A recorder that runs each deferred call at once, with the step's metadata."""

    def __init__(self, step_metadata) -> None:
        self.step_metadata = step_metadata
        self.calls = 0

    def defer(self, method, q, k, v, state, metadata, *rest, like):
        out = method(q, k, v, state, self.step_metadata, *rest)
        assert out.shape == like.shape and out.dtype == like.dtype
        self.calls += 1
        return out


def _random(mixer):
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mixer.A_log.copy_(torch.rand_like(mixer.A_log).log())
    return mixer


@pytest.mark.parametrize("kind", ["mamba2", "gated_deltanet"])
@torch.no_grad()
def test_deferred_update_equals_eager(kind):
    torch.manual_seed(0)
    mixers, spec = (([_random(Mamba2Mixer(MAMBA)) for _ in range(2)], StateSpec(MAMBA, 2))
                    if kind == "mamba2" else
                    ([_random(GatedDeltaNet(DELTA)) for _ in range(2)],
                     DeltaNetStateSpec(DELTA, 2)))
    cache = StateCache(spec, num_slots=3, dtype=torch.float32, device="cpu")
    for layer in cache.layers:
        layer.conv.normal_()
        layer.ssm.normal_()
    # slot 0: a 5-token prompt chunk from position 0; slot 2: a decode at position 7
    step = SimpleNamespace(max_query_len=5, request_slots=torch.tensor([0, 2]),
                           request_slots_cpu=[0, 2], query_lens_cpu=[5, 1],
                           seq_lens_cpu=[5, 8], capture=None)
    hidden = torch.randn(6, 32)
    eager_layers = copy.deepcopy(cache.layers)
    batch = cache.batch(step)
    want = [m(hidden, batch, s) for m, s in zip(mixers, eager_layers)]
    recorder = RunAtOnce(step)
    cache._planned = (None, None)   # (the eager run above planned this step already)
    deferred = cache.batch(SimpleNamespace(capture=recorder))
    assert isinstance(deferred, DeferredBatch)
    got = [m(hidden, deferred, s) for m, s in zip(mixers, cache.layers)]
    assert recorder.calls == 2
    assert cache.batch(step) is cache.batch(step)   # one plan a step, whoever asks
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    for layer, eager in zip(cache.layers, eager_layers):
        torch.testing.assert_close(layer.ssm, eager.ssm)
        torch.testing.assert_close(layer.conv, eager.conv)
