"""compressed-tensors float quantization, as llm-compressor writes it: "-FP8-dynamic" (e4m3
weights with a `weight_scale` per channel [N, 1], activations per token at run time), "-FP8"
(one `weight_scale` and one static `input_scale` per layer) and FP8_BLOCK (a `weight_scale`
per block); optional fp8 KV cache scales (`self_attn.k_scale` / `v_scale`). The config is
read and validated by the compressed-tensors package itself."""
from __future__ import annotations

from tllm.extras import require_extra
from tllm.layers.quant.fp8 import Fp8Config, Fp8Scheme
from tllm.loader.hf import CheckpointError
from tllm.loader.quant_formats import unsupported

FORMAT = "compressed-tensors"
STORED_FORMATS = ("float-quantized", "naive-quantized")
WEIGHT_STRATEGIES = ("channel", "tensor", "block")


def parse(raw: dict) -> Fp8Config:
    require_extra("quant", "a compressed-tensors checkpoint")   # an optional dependency
    from compressed_tensors.quantization import QuantizationConfig  # slow import: only here

    try:
        config = QuantizationConfig.model_validate(raw)
    except (ValueError, TypeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"invalid compressed-tensors quantization_config: {first}") from None
    if raw.get("sparsity_config"):
        kind = raw["sparsity_config"].get("format", "sparse")
        raise unsupported(FORMAT, f"sparse weights ({kind})")
    if raw.get("transform_config"):
        raise unsupported(FORMAT, "transformed (rotated) weights")
    if not config.config_groups:
        raise unsupported(FORMAT, "no quantized linear layers (kv cache only)")
    schemes = {_group_scheme(config, group) for group in config.config_groups.values()}
    if len(schemes) > 1:
        raise unsupported(FORMAT, "config groups of different schemes "
                          f"({', '.join(sorted(config.config_groups))})")
    scheme = schemes.pop()
    aliases = (("weight_scale", "weight_scale_inv"),) if scheme.weight == "block" else ()
    return Fp8Config(scheme, ignore_patterns(config.ignore or ()),
                     has_kv_scales=_has_kv_scales(config.kv_cache_scheme),
                     param_aliases=aliases)


def _group_scheme(config, group) -> Fp8Scheme:
    """The Fp8Scheme of one config group, or the error that names what it holds."""
    stored = getattr(group, "format", None) or config.format
    weights, inputs = group.weights, group.input_activations
    if weights is None:
        raise unsupported(FORMAT, "activation-only quantization")
    if weights.type != "float" or weights.num_bits != 8:
        raise unsupported(FORMAT, describe(weights, "weights"))
    if stored not in STORED_FORMATS:
        raise unsupported(FORMAT, f"fp8 weights stored as {stored!r}")
    if group.targets != ["Linear"]:
        raise unsupported(FORMAT, f"a config group of some layers only ({group.targets})")
    if (not weights.symmetric or weights.dynamic
            or weights.strategy not in WEIGHT_STRATEGIES):
        raise unsupported(FORMAT, describe(weights, "weights"))
    if inputs is None:
        raise unsupported(FORMAT, describe(weights, "weights")
                          + " and 16-bit activations (weight-only)")
    if inputs.type != "float" or inputs.num_bits != 8 or not inputs.symmetric:
        raise unsupported(FORMAT, describe(inputs, "activations"))
    if group.output_activations is not None:
        raise unsupported(FORMAT, describe(group.output_activations, "output activations"))
    if weights.strategy == "block":
        rows, cols = weights.block_structure
        # per token (or per token and group of block columns, finer still) at run time
        if inputs.dynamic is not True or inputs.strategy not in ("token", "group", "tensor") or (
                inputs.strategy == "group" and inputs.group_size != cols):
            raise unsupported(FORMAT, f"fp8 weights (block {rows}x{cols}) and "
                              + describe(inputs, "activations"))
        return Fp8Scheme(weight="block", block=(rows, cols))
    if inputs.dynamic is True and inputs.strategy in ("token", "tensor"):
        # a dynamic per-tensor scale is run per token, as vLLM does: never coarser
        return Fp8Scheme(weight=weights.strategy, activation="dynamic")
    if inputs.dynamic is False and inputs.strategy == "tensor":
        return Fp8Scheme(weight=weights.strategy, activation="static")
    raise unsupported(FORMAT, describe(weights, "weights") + " and "
                      + describe(inputs, "activations"))


def _has_kv_scales(kv) -> bool:
    if kv is None:
        return False
    if kv.type != "float" or kv.num_bits != 8 or kv.strategy != "tensor" or kv.dynamic:
        raise unsupported(FORMAT, describe(kv, "kv cache"))
    return True


def describe(args, role: str) -> str:
    """"int4 weights (group strategy)", "fp8 activations (tensor strategy, dynamic)"."""
    kind = f"{'fp' if args.type == 'float' else 'int'}{args.num_bits}"
    extra = [f"{args.strategy} strategy"]
    if args.dynamic:
        extra.append("dynamic" if args.dynamic is True else f"dynamic={args.dynamic}")
    if not args.symmetric:
        extra.append("asymmetric, with zero points")
    return f"{kind} {role} ({', '.join(extra)})"


def ignore_patterns(names) -> tuple[str, ...]:
    """compressed-tensors ignores a module whose name equals an entry, or that a "re:" entry
    matches from the start (re.match)."""
    return tuple(f"re:(?:{n[3:]}).*" if n.startswith("re:") else n for n in names)
