"""Tiny PEFT LoRA adapters made in the test (peft's get_peft_model + save_pretrained), with
random (non-zero) lora_B so that each adapter changes the model's output."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_model, path: Path, targets: list[str], rank: int, alpha: float,
                 seed: int, use_rslora: bool = False, scale: float = 0.3):
    """Save an adapter of `base_model` (left untouched) to `path`; returns the PeftModel."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(base_model), config).eval()
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * scale)
    peft_model.save_pretrained(path)
    return peft_model


def hf_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=num_new,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def edit_config(path: Path, **changes) -> None:
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))
