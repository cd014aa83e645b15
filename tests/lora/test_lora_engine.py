"""Multi-LoRA serving on a tiny random Llama with two tiny PEFT adapters made here: greedy
tokens per adapter equal HF transformers + PeftModel with that adapter, in one mixed batch
with base-only requests; adapters evicted and reloaded (max_loras=1) give the same outputs;
bad adapter folders are refused with a clear error and break nothing; KV blocks and adapter
slots are all free afterwards."""
from __future__ import annotations

import shutil
import time

import pytest
import torch

pytest.importorskip("peft")

from tests.lora.adapters import ALL_TARGETS, edit_config, hf_greedy, make_adapter  # noqa: E402
from tllm import LLM, KvCacheConfig, LoRARequest, SamplingParams  # noqa: E402

NUM_NEW = 8
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0)
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [11, 12, 13], list(range(40, 75)), [300, 301, 7, 9, 4]]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """{name: (LoRARequest, PeftModel)}: "qv" (q/v, rank 4) and "all" (every projection,
    rank 8, rslora)."""
    _, base = tiny_llama
    root = tmp_path_factory.mktemp("adapters")
    qv = make_adapter(base, root / "qv", ["q_proj", "v_proj"], rank=4, alpha=8, seed=1)
    full = make_adapter(base, root / "all", ALL_TARGETS, rank=8, alpha=16, seed=2,
                        use_rslora=True)
    return {"qv": (LoRARequest("qv", 1, str(root / "qv")), qv),
            "all": (LoRARequest("all", 2, str(root / "all")), full)}


@pytest.fixture(scope="module")
def expected(tiny_llama, adapters):
    """HF greedy tokens of every prompt: base, and with each adapter."""
    _, base = tiny_llama
    want = {None: [hf_greedy(base, p, NUM_NEW) for p in PROMPTS]}
    for name, (_, peft_model) in adapters.items():
        want[name] = [hf_greedy(peft_model, p, NUM_NEW) for p in PROMPTS]
    return want


def make_llm(path, **kwargs) -> LLM:
    options = dict(max_num_tokens=24, max_batch_size=8, max_seq_len=128, enable_lora=True,
                   max_loras=2, max_lora_rank=8,
                   kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=2048))
    options.update(kwargs)
    return LLM(str(path), **options)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    with make_llm(tiny_llama[0]) as llm:
        yield llm


def assert_all_free(llm) -> None:
    kv, lora = llm._engine.kv_cache, llm._engine.lora
    for _ in range(100):  # an abort is applied by the loop thread shortly after
        if kv.num_free_blocks == kv.num_blocks and lora.num_active_slots == 0:
            break
        time.sleep(0.01)
    assert kv.num_free_blocks == kv.num_blocks
    assert lora.num_active_slots == 0


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_the_adapters_change_the_output(expected):
    assert expected["qv"] != expected[None] and expected["all"] != expected[None]
    assert expected["qv"] != expected["all"]


def test_mixed_batch_matches_hf_peft_per_adapter(llm, adapters, expected):
    names = [None, "qv", "all"]
    prompts, loras, want = [], [], []
    for i, prompt in enumerate(PROMPTS):
        for j, name in enumerate(names):
            name = names[(i + j) % 3]  # each prompt under each adapter, interleaved
            prompts.append(prompt)
            loras.append(adapters[name][0] if name else None)
            want.append(expected[name][i])
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    assert tokens(outputs) == want
    assert_all_free(llm)


def test_one_adapter_for_every_prompt_and_chunked_prefill(llm, adapters, expected):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapters["all"][0])
    assert tokens(outputs) == expected["all"]  # the 35-token prompt is chunked (24 a step)
    assert_all_free(llm)


def test_prompt_dict_names_its_adapter(llm, adapters, expected):
    out = llm.generate({"prompt_token_ids": PROMPTS[0], "lora_request": adapters["qv"][0]},
                       GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == expected["qv"][0]


def test_prefix_cache_is_not_shared_across_adapters(llm, adapters, expected):
    prompt = PROMPTS[2]  # 8 full blocks of 4
    base = llm.generate(prompt, GREEDY, use_tqdm=False)
    adapted = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["qv"][0])
    assert base.outputs[0].token_ids == expected[None][2]
    assert adapted.outputs[0].token_ids == expected["qv"][2]


def test_evicted_and_reloaded_adapters_give_the_same_outputs(tiny_llama, adapters, expected):
    """One slot for two adapters: requests of the other adapter wait until the slot is free,
    then it is reloaded; outputs are unchanged."""
    qv, full = adapters["qv"][0], adapters["all"][0]
    with make_llm(tiny_llama[0], max_loras=1) as llm:
        loras = [qv, full, None, full, qv, qv, full, None]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        names = {id(qv): "qv", id(full): "all"}
        want = [expected[names[id(lr)] if lr else None][i % len(PROMPTS)]
                for i, lr in enumerate(loras)]
        assert tokens(outputs) == want
        assert llm._engine.lora.num_loads >= 2  # the slot changed hands
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=qv)
        assert tokens(again) == expected["qv"]
        assert llm._engine.lora.num_loads >= 3  # and back
        assert_all_free(llm)


def bad_copy(adapters, tmp_path, name: str):
    """A copy of the "all" adapter's folder to break."""
    target = tmp_path / name
    shutil.copytree(adapters["all"][0].lora_path, target)
    return target


def test_bad_adapter_folders_are_refused_and_nothing_breaks(llm, adapters, expected,
                                                           tiny_llama, tmp_path):
    _, base = tiny_llama
    cases = {}
    make_adapter(base, tmp_path / "rank", ["q_proj"], rank=16, alpha=16, seed=3)
    cases["rank"] = (tmp_path / "rank", "above max_lora_rank")
    missing = bad_copy(adapters, tmp_path, "missing")
    (missing / "adapter_model.safetensors").unlink()
    cases["missing"] = (missing, "no adapter_model.safetensors")
    no_config = bad_copy(adapters, tmp_path, "no_config")
    (no_config / "adapter_config.json").unlink()
    cases["no_config"] = (no_config, "no adapter_config.json")
    unknown = bad_copy(adapters, tmp_path, "unknown")
    edit_config(unknown, target_modules=["q_proj", "lm_head"])
    cases["unknown"] = (unknown, "'lm_head'")
    cases["shapes"] = (_wrong_shapes(adapters, tmp_path), "the model needs")
    cases["nowhere"] = (tmp_path / "does_not_exist", "no adapter_config.json")
    cases["pickled"] = (_pickled_bin(adapters, tmp_path), "weights_only")
    layer = bad_copy(adapters, tmp_path, "layer")
    _edit_weights(layer, lambda w: {k.replace("layers.1.", "layers.5."): v for k, v in w.items()})
    cases["layer"] = (layer, "no projection 'layers.5.")
    for i, (name, (path, message)) in enumerate(cases.items()):
        bad = LoRARequest(name, 100 + i, str(path))
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=bad)
    good = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=adapters["qv"][0])
    assert tokens(good) == expected["qv"]
    assert_all_free(llm)


def _edit_weights(path, edit) -> None:
    from safetensors.torch import load_file, save_file
    weights = path / "adapter_model.safetensors"
    save_file(edit(load_file(weights)), weights)


class _CallsPrint:
    def __reduce__(self):
        return print, ("a pickled call ran",)


def _pickled_bin(adapters, tmp_path):
    """adapter_model.bin whose pickle calls a function: weights_only refuses it."""
    path = bad_copy(adapters, tmp_path, "pickled")
    (path / "adapter_model.safetensors").unlink()
    torch.save({"x": _CallsPrint()}, path / "adapter_model.bin")
    return path


def _wrong_shapes(adapters, tmp_path):
    from safetensors.torch import load_file, save_file
    path = bad_copy(adapters, tmp_path, "shapes")
    tensors = load_file(path / "adapter_model.safetensors")
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = torch.randn(tensors[key].shape[0] + 4, tensors[key].shape[1])
    save_file(tensors, path / "adapter_model.safetensors")
    return path


def test_lora_request_without_enable_lora_is_refused(tiny_llama, adapters):
    with LLM(str(tiny_llama[0]), max_num_tokens=24, max_batch_size=2, max_seq_len=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=256)) as llm:
        with pytest.raises(ValueError, match="enable_lora"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=adapters["qv"][0])


def test_lora_request_arguments_are_checked():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/tmp")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and Triton need a GPU")
@pytest.mark.parametrize("use_graphs", [True, False])
def test_gpu_mixed_batch_with_and_without_cuda_graphs(tiny_llama, adapters, expected,
                                                      use_graphs):
    """The Triton LoRA kernels, in captured decode graphs (slots read from the static buffer
    at replay) and eagerly, give HF + PeftModel's tokens (float32)."""
    from tllm import CudaGraphConfig
    graphs = CudaGraphConfig(batch_sizes=[1, 2, 4, 8]) if use_graphs else None
    with make_llm(tiny_llama[0], device="cuda", dtype="float32",
                  cuda_graph_config=graphs) as llm:
        assert (llm._engine.executor.runner.cuda_graphs is not None) == use_graphs
        names = [None, "qv", "all"]
        loras = [adapters[names[i % 3]][0] if names[i % 3] else None for i in range(8)]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        want = [expected[names[i % 3]][i % len(PROMPTS)] for i in range(8)]
        assert tokens(outputs) == want
        assert_all_free(llm)
