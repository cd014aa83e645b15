"""AWQ and GPTQ checkpoints made here from a tiny random Llama, packed the way AutoAWQ
(WQLinear_GEMM.from_linear) and AutoGPTQ / GPTQModel (QuantLinear.pack) pack them, with the
packers and the dequantization formulas written in this file from those libraries' layouts
(independent of tllm.kernels.woq). Each is detected from its config.json, unpacks to exactly
the format's dequantized weight, and generates the greedy tokens of HF transformers running
those dequantized weights in fp32; plus online int4_awq / int8_wo, TP=2 on gloo, and the
errors of variants we do not run."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import make_tiny_model
from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.layers.quant import UnquantizedMethod
from tllm.layers.quant.woq import WoqConfig, WoqLinearMethod
from tllm.loader import CheckpointError
from tllm.loader.quantization import checkpoint_quant_config

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
IGNORED = "model.layers.1.mlp.down_proj"   # AWQ's modules_to_not_convert holds it
KV = KvCacheConfig(max_tokens=2048)
NUM_NEW = 16
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# ---- the libraries' packing, as their code lays it out ----

def quantize(w: torch.Tensor, bits: int, group: int, sym: bool):
    """w [out, in] -> (q int [out, in], scale [in / g, out] fp16, zero int [in / g, out]),
    min-max per group (GPTQ's sym: zero = 2^(bits-1))."""
    out_f, in_f = w.shape
    top = 2 ** bits - 1
    g = w.reshape(out_f, in_f // group, group)
    if sym:
        scale = (g.abs().amax(-1) * 2 / top).clamp(min=1e-5)
        zero = torch.full_like(scale, (top + 1) // 2)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / top).clamp(min=1e-5)
        zero = torch.round(-lo / scale).clamp(0, top)
    scale = scale.half()
    q = (torch.round(g / scale.float()[..., None]) + zero[..., None]).clamp(0, top)
    return q.reshape(out_f, in_f).long(), scale.t().contiguous(), zero.t().long().contiguous()


def awq_pack_cols(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit -> int32 [rows, cols / 8], AutoAWQ's loop: bits 4i hold column
    8c + order_map[i]."""
    rows, cols = values.shape
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for c in range(cols // 8):
        for i in range(8):
            packed[:, c] |= values[:, c * 8 + AWQ_ORDER[i]] << (i * 4)
    return _int32(packed)


def gptq_pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] -> int32 [rows * bits / 32, cols]: AutoGPTQ's qweight, consecutive rows
    (input features) in bits i*bits of one word."""
    per = 32 // bits
    packed = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for r in range(packed.shape[0]):
        for i in range(per):
            packed[r] |= values[r * per + i] << (bits * i)
    return _int32(packed)


def gptq_pack_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's qzeros: consecutive columns (output features) in one word."""
    return gptq_pack_rows(values.t().contiguous(), bits).t().contiguous()


def _int32(packed: torch.Tensor) -> torch.Tensor:
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def awq_tensors(w: torch.Tensor, group: int) -> dict:
    q, scale, zero = quantize(w, 4, group, sym=False)
    return {"qweight": awq_pack_cols(q.t().contiguous()), "qzeros": awq_pack_cols(zero),
            "scales": scale}


def gptq_tensors(w: torch.Tensor, bits: int, group: int, sym: bool, v1: bool,
                 perm: torch.Tensor | None) -> dict:
    """perm (act-order): the order GPTQ quantized the input features in; feature perm[i] is
    in group i // group, and g_idx records that."""
    in_f = w.shape[1]
    order = perm if perm is not None else torch.arange(in_f)
    q_sorted, scale, zero = quantize(w[:, order], bits, group, sym)
    q = torch.empty_like(q_sorted)
    q[:, order] = q_sorted
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_f) // group).int()
    stored_zero = (zero - 1) & (2 ** bits - 1) if v1 else zero
    return {"qweight": gptq_pack_rows(q.t().contiguous(), bits),
            "qzeros": gptq_pack_cols(stored_zero, bits), "scales": scale, "g_idx": g_idx}


# ---- the formats' dequantization (transformers / vLLM formulas) ----

def unpack_bits(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    per = 32 // bits
    shifts = torch.arange(per) * bits
    vals = (packed.long()[..., None] >> shifts) & (2 ** bits - 1)     # [..., per]
    if dim == 1:
        return vals.reshape(packed.shape[0], -1)
    return vals.permute(0, 2, 1).reshape(-1, packed.shape[1])


def dequant_awq(t: dict, group: int) -> torch.Tensor:
    reverse = [AWQ_ORDER.index(i) for i in range(8)]
    def unpack(p):
        v = unpack_bits(p, 4, dim=1).reshape(p.shape[0], -1, 8)
        return v[..., reverse].reshape(p.shape[0], -1)
    q, z = unpack(t["qweight"]), unpack(t["qzeros"])                # [in, out], [in/g, out]
    s = t["scales"].float()
    rows = torch.arange(q.shape[0]) // group
    return ((q - z[rows]) * s[rows]).t()


def dequant_gptq(t: dict, bits: int, v1: bool) -> torch.Tensor:
    q = unpack_bits(t["qweight"], bits, dim=0)                       # [in, out]
    z = unpack_bits(t["qzeros"], bits, dim=1) + (1 if v1 else 0)     # [groups, out]
    g = t["g_idx"].long()
    return ((q - z[g]) * t["scales"].float()[g]).t()


# ---- checkpoints ----

VARIANTS = {
    # name: (quantization_config, packer)
    "awq_g32": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                 "version": "gemm", "modules_to_not_convert": [IGNORED]}, "awq"),
    "gptq4_sym_v1": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                      "desc_act": False, "checkpoint_format": "gptq"}, "gptq"),
    "gptq4_asym_v2_actorder": ({"quant_method": "gptq", "bits": 4, "group_size": 16,
                                "sym": False, "desc_act": True, "format": "gptq_v2"}, "gptq"),
    "gptq8_asym_v1_actorder": ({"quant_method": "gptq", "bits": 8, "group_size": 32,
                                "sym": False, "desc_act": True,
                                "checkpoint_format": "gptq"}, "gptq"),
    "gptq8_channel": ({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": True,
                       "desc_act": False}, "gptq"),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32")
    model = make_tiny_model("Llama", path, seed=5)
    return path, model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _perms(state: dict) -> dict:
    """One act-order permutation per layer input (q/k/v share one, gate/up another)."""
    g = torch.Generator().manual_seed(1)
    perms = {}
    for name, w in state.items():
        parent = name.rsplit(".", 2)[0]
        for leaf, key in (("q_proj", "attn_in"), ("k_proj", "attn_in"), ("v_proj", "attn_in"),
                          ("o_proj", "o"), ("gate_proj", "mlp_in"), ("up_proj", "mlp_in"),
                          ("down_proj", "down")):
            if name.endswith(f"{leaf}.weight"):
                perms.setdefault(f"{parent}.{key}", torch.randperm(w.shape[1], generator=g))
                perms[name] = perms[f"{parent}.{key}"]
    return perms


def write_checkpoint(source, dst, variant: str):
    from safetensors.torch import save_file
    src, _, state = source
    config_q, packer = VARIANTS[variant]
    tensors, perms = {}, _perms(state)
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.endswith(LINEARS)) or module == IGNORED \
                and packer == "awq":
            tensors[name] = tensor
            continue
        group = config_q["group_size"]
        group = tensor.shape[1] if group == -1 else group
        if packer == "awq":
            parts = awq_tensors(tensor, group)
        else:
            parts = gptq_tensors(tensor, config_q["bits"], group, config_q["sym"],
                                 config_q.get("checkpoint_format", config_q.get("format",
                                                                                "gptq")) == "gptq",
                                 perms[name] if config_q["desc_act"] else None)
        tensors.update({f"{module}.{k}": v for k, v in parts.items()})
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = config_q
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def checkpoints(source, tmp_path_factory):
    root = tmp_path_factory.mktemp("woq")
    return {v: write_checkpoint(source, root / v, v) for v in VARIANTS}


def reference_weight(variant: str, path, module: str) -> torch.Tensor:
    from safetensors.torch import load_file
    t = load_file(str(path / "model.safetensors"))
    config_q, packer = VARIANTS[variant]
    if f"{module}.weight" in t:
        return t[f"{module}.weight"]
    parts = {k: t[f"{module}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")
             if f"{module}.{k}" in t}
    if packer == "awq":
        return dequant_awq(parts, config_q["group_size"])
    v1 = config_q.get("checkpoint_format", config_q.get("format", "gptq")) == "gptq"
    return dequant_gptq(parts, config_q["bits"], v1)


def load_tllm(path):
    from tllm import loader
    from tllm.attention import get_attention_backend
    src = loader.resolve_model(str(path))
    config, checkpoint = loader.load_config(src)
    quant = loader.quant_config(src, config, None)
    model = loader.build_model(config, get_attention_backend("torch"), torch.float32,
                               torch.device("cpu"), 256, quant)
    loader.load_weights(model, src, checkpoint, 0)
    return model


def hf_dequantized(variant: str, path, source):
    import transformers
    model = transformers.LlamaForCausalLM(source[1].config).eval()
    model.load_state_dict(source[2])
    for name, _ in source[2].items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.endswith(LINEARS):
            model.get_submodule(module).weight.data.copy_(reference_weight(variant, path, module))
    return model


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 19, 37)]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NUM_NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def tllm_greedy(path, batch, **kwargs) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    with LLM(str(path), kv_cache_config=KV, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# ---- the tests ----

def test_test_packers_match_the_documented_bit_positions():
    values = torch.arange(16).reshape(1, 16) % 16
    word = int(awq_pack_cols(values)[0, 0])
    assert [(word >> (4 * i)) & 15 for i in range(8)] == AWQ_ORDER   # output 2 in bits 4..7
    rows = torch.arange(8)[:, None].expand(8, 3)
    assert int(gptq_pack_rows(rows, 4)[0, 0]) == 0x76543210


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_detected_and_unpacked_exactly(variant, checkpoints, source):
    path = checkpoints[variant]
    model = load_tllm(path)
    assert isinstance(model.quant_config, WoqConfig)
    for i, layer in enumerate(model.layers):
        for parent, merged in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"),
                               ("mlp", "gate_up_proj"), ("mlp", "down_proj")):
            ours = getattr(getattr(layer, parent), merged)
            hf_names = [f"model.layers.{i}.{parent}.{p}" for p in MERGED.get(merged, (merged,))]
            expected = torch.cat([reference_weight(variant, path, n) for n in hf_names])
            if IGNORED in hf_names and variant.startswith("awq"):
                assert isinstance(ours.quant, UnquantizedMethod)
            else:
                assert isinstance(ours.quant, WoqLinearMethod)
                assert ours.qweight.dtype == torch.int32   # kept packed
            assert torch.equal(ours.quant.dequantized_weight(ours).float(), expected), merged


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_equals_hf_on_dequantized_weights(variant, checkpoints, source):
    path = checkpoints[variant]
    reference = hf_dequantized(variant, path, source)
    batch = prompts(source[1].config.vocab_size)
    for prompt, ours in zip(batch, tllm_greedy(path, batch)):
        assert ours == hf_greedy(reference, prompt)


def rtn_reference(w: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoAWQ's pseudo-quantization of w with one group per row (the tiny model's layers have
    64 or 128 inputs, so groups of 128 cover whole rows), scales rounded to fp16."""
    top = 2 ** bits - 1
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    scale = ((hi - lo).clamp(min=1e-5) / top).half().float()
    zero = (-torch.round(lo / scale)).clamp(0, top)
    return ((torch.round(w / scale) + zero).clamp(0, top) - zero) * scale


@pytest.mark.parametrize("quantization,bits", [("int4_awq", 4), ("int8_wo", 8)])
def test_online_quantization_round_to_nearest(quantization, bits, source):
    """Every linear layer's dequantized weight equals the RTN reference, and the greedy tokens
    equal HF transformers running those weights."""
    from tllm import loader
    from tllm.attention import get_attention_backend
    path = source[0]
    src = loader.resolve_model(str(path))
    config, checkpoint = loader.load_config(src)
    quant = loader.quant_config(src, config, quantization)
    model = loader.build_model(config, get_attention_backend("torch"), torch.float32,
                               torch.device("cpu"), 256, quant)
    loader.load_weights(model, src, checkpoint, 0)
    down = model.layers[0].mlp.down_proj
    w = source[2]["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(down.quant.dequantized_weight(down), rtn_reference(w, bits))
    assert down.qweight.shape == (64, 128 * bits // 32)
    import transformers
    reference = transformers.LlamaForCausalLM(source[1].config).eval()
    reference.load_state_dict(source[2])
    for name, tensor in source[2].items():
        if name.endswith(".weight") and name.removesuffix(".weight").endswith(LINEARS):
            reference.get_submodule(name.removesuffix(".weight")).weight.data.copy_(
                rtn_reference(tensor, bits))
    batch = prompts(source[1].config.vocab_size)
    ours = tllm_greedy(path, batch, quantization=quantization)
    assert ours == [hf_greedy(reference, p) for p in batch]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["awq_g32", "gptq4_sym_v1"])
def test_tp2_on_gloo_equals_tp1(variant, checkpoints, source):
    """Groups of 32 stay whole in each rank's half of o_proj (32 inputs) and down_proj (64)."""
    path = checkpoints[variant]
    batch = prompts(source[1].config.vocab_size)
    cpu = dict(device="cpu")   # two ranks over gloo, also where a GPU (or one) is visible
    assert (tllm_greedy(path, batch, tensor_parallel_size=2, **cpu)
            == tllm_greedy(path, batch, **cpu))


@pytest.mark.slow
def test_tp2_act_order_row_parallel_is_refused(checkpoints):
    with pytest.raises(Exception, match="act-order"):
        tllm_greedy(checkpoints["gptq4_asym_v2_actorder"], [[5, 6, 7]], tensor_parallel_size=2,
                    device="cpu")


# ---- detection and refusal from the config alone ----

def _detect(raw: dict):
    return checkpoint_quant_config(None, SimpleNamespace(quantization_config=raw))


UNSUPPORTED = {
    "awq gemv": ({"quant_method": "awq", "version": "gemv"}, "AWQ with version 'gemv'"),
    "awq marlin": ({"quant_method": "awq", "format": "marlin"}, "version 'marlin'"),
    "awq symmetric": ({"quant_method": "awq", "zero_point": False}, "zero_point=false"),
    "awq 8 bit": ({"quant_method": "awq", "bits": 8}, "AWQ with 8-bit"),
    "gptq 3 bit": ({"quant_method": "gptq", "bits": 3}, "GPTQ with 3-bit"),
    "gptq marlin": ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
                    "checkpoint_format 'marlin'"),
    "gptq dynamic": ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*": {}}}, "dynamic"),
    "gptq lm_head": ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "lm_head"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_variant_is_named(case):
    raw, message = UNSUPPORTED[case]
    with pytest.raises(CheckpointError, match=message):
        _detect(raw)


def test_group_not_whole_in_a_layer_is_refused():
    config = _detect({"quant_method": "awq", "group_size": 48})
    with pytest.raises(ValueError, match="whole groups of 48"):
        from tllm.layers.linear import Linear
        Linear(64, 32, quant=config.linear_method("layers.0.mlp.down_proj"))


def test_gptq_block_list_leaves_other_layers_unquantized():
    config = _detect({"quant_method": "gptq", "bits": 4, "group_size": 128,
                      "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj",
                                                        "self_attn.v_proj"], ["mlp.down_proj"]]})
    assert isinstance(config.linear_method("layers.0.self_attn.o_proj"), UnquantizedMethod)
    assert isinstance(config.linear_method("layers.0.mlp.down_proj"), WoqLinearMethod)
    assert isinstance(config.linear_method("layers.0.self_attn.qkv_proj",
                                           MERGED["qkv_proj"]), WoqLinearMethod)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", ["awq_g32", "gptq4_asym_v2_actorder", "gptq8_channel"])
def test_cuda_kernels_greedy_equals_cpu_reference(variant, checkpoints, source):
    """The Triton paths (GEMV at decode, dequantize + matmul in prefill; CUDA graphs) in
    float32 against the CPU's dequantize-then-matmul run."""
    path = checkpoints[variant]
    batch = prompts(source[1].config.vocab_size)
    assert tllm_greedy(path, batch, device="cuda", dtype="float32") == tllm_greedy(path, batch)


def test_int8_lm_head_round_to_nearest(source):
    """quantization="int4_awq_int8_head": the LM head is weight-only int8 (RTN, groups of the
    64 hidden features here), the layers int4 as int4_awq; greedy tokens equal HF running
    those weights."""
    from tllm import loader
    from tllm.attention import get_attention_backend
    from tllm.layers.quant.woq_head import WoqLMHead
    from tllm.kernels import woq
    path = source[0]
    src = loader.resolve_model(str(path))
    config, checkpoint = loader.load_config(src)
    quant = loader.quant_config(src, config, "int4_awq_int8_head")
    model = loader.build_model(config, get_attention_backend("torch"), torch.float32,
                               torch.device("cpu"), 256, quant)
    loader.load_weights(model, src, checkpoint, 0)
    head = model.lm_head
    assert isinstance(head, WoqLMHead) and head.weight is None
    assert head.qweight.dtype == torch.int32 and head.layout.bits == 8
    w_head = source[2]["lm_head.weight"]
    assert torch.equal(woq.dequantize(head.qweight, head.scales, head.zeros, head.layout),
                       rtn_reference(w_head, 8))
    import transformers
    reference = transformers.LlamaForCausalLM(source[1].config).eval()
    reference.load_state_dict(source[2])
    for name, tensor in source[2].items():
        if name.endswith(".weight") and name.removesuffix(".weight").endswith(LINEARS):
            reference.get_submodule(name.removesuffix(".weight")).weight.data.copy_(
                rtn_reference(tensor, 4))
    reference.lm_head.weight.data.copy_(rtn_reference(w_head, 8))
    batch = prompts(source[1].config.vocab_size)
    ours = tllm_greedy(path, batch, quantization="int4_awq_int8_head")
    assert ours == [hf_greedy(reference, p) for p in batch]
