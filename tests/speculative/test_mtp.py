"""MTP drafting: a tiny DeepSeek-V3 checkpoint with a next-token module (layer
num_hidden_layers: enorm, hnorm, eh_proj, a MoE decoder layer, shared_head) drafts on the
EAGLE-3 drafter; greedy output is the output without speculation, drafts are proposed, and
the module's tensors are the checkpoint's."""
from __future__ import annotations

import pytest
import torch

from tests.models.test_deepseek_parity import make_tiny_deepseek
from tests.speculative.test_draft_model import engine_greedy, prompts
from tllm import MTPDecodingConfig


def add_mtp_module(path, hf_model) -> dict[str, torch.Tensor]:
    """Layer `num_hidden_layers` in a second safetensors file: the last layer's tensors
    (a MoE layer) plus random enorm, hnorm, eh_proj and shared_head."""
    from safetensors.torch import save_file
    config = hf_model.config
    last, mtp = config.num_hidden_layers - 1, config.num_hidden_layers
    g = torch.Generator().manual_seed(5)
    hidden = config.hidden_size
    tensors = {f"model.layers.{mtp}.{name}": torch.randn(shape, generator=g) * 0.1 + offset
               for name, shape, offset in [
                   ("enorm.weight", (hidden,), 1.0), ("hnorm.weight", (hidden,), 1.0),
                   ("eh_proj.weight", (hidden, 2 * hidden), 0.0),
                   ("shared_head.norm.weight", (hidden,), 1.0),
                   ("shared_head.head.weight", (config.vocab_size, hidden), 0.0)]}
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            if name.startswith(f"model.layers.{last}."):
                tensors[name.replace(f".{last}.", f".{mtp}.")] = f.get_tensor(name).clone()
    save_file(tensors, str(path / "mtp.safetensors"))
    return tensors


@pytest.fixture(scope="module")
def tiny_v3_with_mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v3_mtp")
    hf_model = make_tiny_deepseek("DeepseekV3", path)
    return path, add_mtp_module(path, hf_model)


def test_engine_greedy_identical_with_mtp(tiny_v3_with_mtp):
    path, _ = tiny_v3_with_mtp
    batch = prompts() + [list(range(3, 20))]
    plain, _ = engine_greedy(path, None, batch)
    spec, stats = engine_greedy(path, MTPDecodingConfig(max_draft_len=2), batch)
    assert spec == plain and stats["spec_draft_tokens"] > 0


def test_module_holds_the_checkpoint_tensors(tiny_v3_with_mtp):
    from tllm import LLM
    path, tensors = tiny_v3_with_mtp
    with LLM(str(path), speculative_config=MTPDecodingConfig(max_draft_len=1),
             kv_cache_config={"max_tokens": 256}) as llm:
        head = llm._engine.executor.speculation.drafter.head
        assert torch.equal(head.eh_proj.weight.cpu(), tensors["model.layers.3.eh_proj.weight"])
        assert torch.equal(head.block.self_attn.kv_b_proj.weight.cpu(),
                           tensors["model.layers.3.self_attn.kv_b_proj.weight"])
        assert head.embed_tokens is llm._engine.executor.runner.model.embed_tokens


def test_a_checkpoint_without_the_module_is_refused(tmp_path):
    from tllm import LLM
    make_tiny_deepseek("DeepseekV3", tmp_path)
    with pytest.raises(ValueError, match="no MTP module"):
        LLM(str(tmp_path), speculative_config=MTPDecodingConfig(max_draft_len=1),
            kv_cache_config={"max_tokens": 256})


def test_bf16_module_keeps_its_router_in_float32(tiny_v3_with_mtp):
    """Built in the target's dtype as the target is: the router's weight stays float32 (a
    bf16 one met float32 activations in the gate and failed every draft on a GPU)."""
    from tllm import LLM, SamplingParams
    path, _ = tiny_v3_with_mtp
    with LLM(str(path), dtype="bfloat16", kv_cache_config={"max_tokens": 256},
             speculative_config=MTPDecodingConfig(max_draft_len=1)) as llm:
        head = llm._engine.executor.speculation.drafter.head
        assert head.block.mlp.gate.weight.dtype == torch.float32
        assert head.eh_proj.weight.dtype == torch.bfloat16
        out = llm.generate({"prompt_token_ids": list(range(3, 12))},
                           SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                           use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 6
        assert llm.get_stats()["spec_draft_tokens"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_verify_steps_replay_graphs_with_the_hidden_states(tiny_v3_with_mtp):
    """With MTP the decode and verify steps replay CUDA graphs that hold the target's last
    hidden state too (MLA's verify rows through the decode kernel), and the MTP module's
    catch-up and chain steps replay its own graphs: the tokens are those without
    speculation, and every kind of graph did run."""
    from tllm import LLM, KvCacheConfig, SamplingParams
    path, _ = tiny_v3_with_mtp
    batch = [{"prompt_token_ids": p} for p in prompts() + [list(range(3, 20))]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = {}
    for spec in (None, MTPDecodingConfig(max_draft_len=2)):
        with LLM(str(path), dtype="float32", max_num_tokens=24, max_batch_size=3,
                 speculative_config=spec,
                 kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048)) as llm:
            graphs = llm._engine.executor.runner.cuda_graphs
            replays = []
            run = graphs.run
            graphs.run = lambda ids, metadata: replays.append(metadata.max_query_len) or run(
                ids, metadata)
            head_replays = []
            if spec is not None:
                head = llm._engine.executor.speculation.drafter.graphs
                head_run = head.run
                head.run = lambda *a: head_replays.append(a[2].max_query_len) or head_run(*a)
            out = llm.generate(batch, params, use_tqdm=False)
            outputs[spec is None] = [o.outputs[0].token_ids for o in out]
        if spec is not None:
            assert graphs.verify_graphs and graphs.collect_hidden is not None
            assert max(replays) > 1  # verify steps replayed
            assert 1 in head_replays  # the head's steps replayed (a catch-up's length
            # depends on what the target accepted, which random weights do not fix)
    assert outputs[False] == outputs[True]
