"""Issue 34's H200 figures: a Qwen2.5-VL-7B-shaped model with random weights (no dummy preset
holds a VLM, so transformers builds it from a Qwen2_5_VLConfig of 7B's shapes on the GPU and
saves it with a processor: the tests' small tokenizer, Qwen's image processor at its real
pixel limits), one random 1024x1024 image + about 128 text tokens per request -> 128 out:

  hf        transformers' generate on the same GPU in the same run (first, then freed):
            TTFT (a batch of one, 1 token out) and the batch of 32's output tokens per second
  tllm      the same through LLM.generate: TTFT at batch 1 (wall time of a 1-token request,
            preprocessing included, and the engine's own ttft_s), 32 requests' throughput,
            and the same 32 prompts without their images (the language model alone)
  cache     TTFT of a new image, of the same image again behind a different first text token
            (the encoder cache hits, no KV block can be reused) and of the identical prompt
            (prefix reuse too); the encoder's share of TTFT is (new - cache hit) / new

Results go to $OUT/vlm.json. The checkpoint (about 16 GiB) goes to /dev/shm when it has room.

    python benchmarks/gpu_vlm.py [--requests 32] [--budget 500]
    python benchmarks/gpu_vlm.py --tiny      # the plumbing on the CPU, a tiny Qwen2.5-VL
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.multimodal.conftest import (IMAGE, QwenReference, make_image,  # noqa: E402
                                       tiny_config, tiny_image_processor, tiny_tokenizer)

TEXT_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
               num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                "mrope_section": [16, 24, 24]})
VISION_7B = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                 out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                 temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                 hidden_act="silu", in_chans=3)
WORDS = "describe the picture in a few words what is in this image".split()


def qwen_vl_7b_config(tokenizer):
    """Qwen2.5-VL-7B-Instruct's shapes with the small tokenizer's special-token ids."""
    config = tiny_config(tokenizer)
    text = {**TEXT_7B, "pad_token_id": 0, "eos_token_id": None, "bos_token_id": None}
    return type(config)(text_config=text, vision_config=dict(VISION_7B),
                        image_token_id=config.image_token_id,
                        video_token_id=config.video_token_id,
                        vision_start_token_id=config.vision_start_token_id,
                        vision_end_token_id=config.vision_end_token_id,
                        architectures=["Qwen2_5_VLForConditionalGeneration"])


def build_model(tiny: bool, device: str, dtype: torch.dtype):
    """(folder, HF model on `device`, QwenReference) of a random Qwen2.5-VL."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    tokenizer = tiny_tokenizer()
    images = (tiny_image_processor() if tiny else
              Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 16384))
    config = tiny_config(tokenizer) if tiny else qwen_vl_7b_config(tokenizer)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype).eval()
    room = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").exists() else 0
    base = "/dev/shm" if room > 24 * 2**30 or tiny else None
    path = Path(tempfile.mkdtemp(dir=base)) / "qwen2_5_vl"
    model.save_pretrained(path)
    images.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, QwenReference(images, tokenizer, model.config)


def prompt_text(tokenizer, lead: str, with_image: bool, num_tokens: int) -> str:
    """A chat prompt: `lead`, the image (or none), then words up to about num_tokens."""
    words = [WORDS[i % len(WORDS)] for i in range(num_tokens)]
    while len(tokenizer(" ".join(words))["input_ids"]) > num_tokens:
        words.pop()
    image = IMAGE if with_image else ""
    return (f"<|im_start|>user\n{lead} {image}{' '.join(words)}<|im_end|>\n"
            "<|im_start|>assistant\n")


def synced() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def left_padded(parts: list[dict], pad_id: int) -> dict:
    """One batch from per-prompt processor outputs: the per-token rows ([1, L]: ids, mask,
    token types) left-padded to the longest (prompts differ by a token or two), the images'
    rows concatenated."""
    longest = max(p["input_ids"].shape[1] for p in parts)
    batch = {}
    for key in parts[0]:
        rows = [p[key] for p in parts]
        if rows[0].dim() == 2 and rows[0].shape[0] == 1 and key != "image_grid_thw":
            fill = pad_id if key == "input_ids" else 0
            rows = [torch.nn.functional.pad(r, (longest - r.shape[1], 0), value=fill)
                    for r in rows]
        batch[key] = torch.cat(rows)
    return batch


def hf_part(model, reference, texts: list[str], images: list, new_tokens: int) -> dict:
    """TTFT of one request, then the whole batch's output tokens per second (left-padded)."""
    pad_id = reference.tokenizer.pad_token_id or 0

    def generate(batch_texts, batch_images, max_new):
        parts = [reference(t, [i]) for t, i in zip(batch_texts, batch_images)]
        inputs = {key: value.to(model.device)
                  for key, value in left_padded(parts, pad_id).items()}
        inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
        model.model.rope_deltas = None
        with torch.no_grad():
            return model.generate(**inputs, max_new_tokens=max_new, min_new_tokens=max_new,
                                  do_sample=False)
    generate(texts[:1], images[:1], 2)                        # warm-up
    start = synced()
    generate(texts[:1], images[:1], 1)
    ttft = synced() - start
    start = synced()
    generate(texts, images, new_tokens)
    seconds = synced() - start
    return {"ttft_s": ttft, "batch_s": seconds,
            "output_tokens_per_s": len(texts) * new_tokens / seconds}


def tllm_requests(texts, images):
    return [{"prompt": t, "multi_modal_data": {"image": [i]}} if i is not None else t
            for t, i in zip(texts, images)]


def tllm_ttft(llm, request) -> dict:
    from tllm import SamplingParams
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = synced()
    out = llm.generate(request, one, use_tqdm=False)
    wall = synced() - start
    return {"wall_s": wall, "engine_ttft_s": out.metrics.get("ttft_s")}


def tllm_throughput(llm, requests, new_tokens: int) -> dict:
    from tllm import SamplingParams
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = synced()
    outs = llm.generate(requests, params, use_tqdm=False)
    seconds = synced() - start
    ttfts = sorted(o.metrics.get("ttft_s", 0.0) for o in outs)
    return {"batch_s": seconds, "output_tokens_per_s": len(requests) * new_tokens / seconds,
            "ttft_median_s": ttfts[len(ttfts) // 2], "ttft_max_s": ttfts[-1]}


def cache_part(llm, tokenizer, num_tokens: int, seed: int) -> dict:
    """New image, the same image behind another lead (encoder cache), the identical prompt."""
    image = make_image(1024, 1024, seed)
    first = prompt_text(tokenizer, "first", True, num_tokens)
    other = prompt_text(tokenizer, "second", True, num_tokens)
    before = llm.get_stats()
    result = {"new_image": tllm_ttft(llm, tllm_requests([first], [image])[0]),
              "encoder_cache_hit": tllm_ttft(llm, tllm_requests([other], [image])[0]),
              "identical_prompt": tllm_ttft(llm, tllm_requests([first], [image])[0])}
    after = llm.get_stats()
    result["encoder_cache_hits"] = (after.get("encoder_cache_hits", 0)
                                    - before.get("encoder_cache_hits", 0))
    result["encoder_num_encoded"] = (after.get("encoder_num_encoded", 0)
                                     - before.get("encoder_num_encoded", 0))
    new, hit = result["new_image"]["wall_s"], result["encoder_cache_hit"]["wall_s"]
    result["encoder_share_of_ttft"] = (new - hit) / new
    return result


def tllm_part(path: Path, texts, text_only, images, args) -> dict:
    from tllm import LLM
    kwargs = ({"dtype": "float32", "device": "cpu"} if args.tiny else {"dtype": "bfloat16"})
    reference_tokenizer = tiny_tokenizer()
    with LLM(str(path), max_batch_size=args.requests, max_seq_len=4096,
             kv_cache_config={"max_tokens": args.kv_tokens}, **kwargs) as llm:
        warm = tllm_requests(texts[:1], [make_image(1024, 1024, 99)])
        tllm_ttft(llm, warm[0])                                       # warm-up
        result = {"ttft_batch1": tllm_ttft(llm, tllm_requests(texts[:1], images[:1])[0])}
        print(f"tllm TTFT {result['ttft_batch1']}", flush=True)
        result["throughput"] = tllm_throughput(llm, tllm_requests(texts, images),
                                               args.new_tokens)
        print(f"tllm throughput {result['throughput']}", flush=True)
        result["text_only"] = tllm_throughput(llm, text_only, args.new_tokens)
        result["text_only_ttft_batch1"] = tllm_ttft(llm, text_only[0])
        print(f"tllm text only {result['text_only']}", flush=True)
        result["cache"] = cache_part(llm, reference_tokenizer, args.text_tokens, 1000)
        print(f"tllm cache {result['cache']}", flush=True)
        result["stats"] = llm.get_stats()
    return result


def summary(results: dict) -> str:
    meta = results["meta"]
    lines = [f"vlm: {meta['requests']} requests, one {meta['image']} image + ~{meta['text_tokens']}"
             f" text tokens -> {meta['new_tokens']} on {meta['device']}"]
    hf, ours = results.get("hf"), results.get("tllm")
    if hf:
        lines.append(f"HF generate:  TTFT {hf['ttft_s'] * 1e3:.0f} ms, "
                     f"{hf['output_tokens_per_s']:.0f} out tok/s")
    if ours:
        lines.append(f"tllm:         TTFT {ours['ttft_batch1']['wall_s'] * 1e3:.0f} ms, "
                     f"{ours['throughput']['output_tokens_per_s']:.0f} out tok/s "
                     f"(text only: {ours['text_only']['output_tokens_per_s']:.0f} tok/s, "
                     f"TTFT {ours['text_only_ttft_batch1']['wall_s'] * 1e3:.0f} ms)")
        c = ours["cache"]
        lines.append(f"cache: TTFT new image {c['new_image']['wall_s'] * 1e3:.0f} ms, encoder "
                     f"cache hit {c['encoder_cache_hit']['wall_s'] * 1e3:.0f} ms, identical "
                     f"prompt {c['identical_prompt']['wall_s'] * 1e3:.0f} ms; encoder share "
                     f"{100 * c['encoder_share_of_ttft']:.0f}%; hits {c['encoder_cache_hits']}")
    for key in ("hf_error", "tllm_error"):
        if key in results:
            lines.append(f"{key}: {results[key][:300]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--text-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--kv-tokens", type=int, default=131072)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.requests = min(args.requests, 12)   # r0..r11: leads of different lengths
        args.text_tokens, args.new_tokens, args.kv_tokens = 16, 8, 4096
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    out_dir = Path(os.environ.get("OUT") or "/tmp/gpu_vlm")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"meta": {"date": datetime.date.today().isoformat(), "argv": sys.argv,
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                        else "cpu", "torch": torch.__version__, "requests": args.requests,
                        "image": "1024x1024", "text_tokens": args.text_tokens,
                        "new_tokens": args.new_tokens}}
    start = time.perf_counter()
    path, model, reference = build_model(args.tiny, device, dtype)
    results["meta"]["build_s"] = time.perf_counter() - start
    print(f"built and saved to {path} in {results['meta']['build_s']:.0f} s", flush=True)
    tokenizer = reference.tokenizer
    texts = [prompt_text(tokenizer, f"r{i}", True, args.text_tokens) for i in range(args.requests)]
    images = [make_image(1024, 1024, i) for i in range(args.requests)]
    text_only = [prompt_text(tokenizer, f"r{i}", False, args.text_tokens)
                 for i in range(args.requests)]
    results["meta"]["image_tokens"] = int(reference(texts[0], images[:1])["mm_token_type_ids"]
                                          .sum())
    if not args.skip_hf:
        try:
            results["hf"] = hf_part(model, reference, texts, images, args.new_tokens)
            print(f"HF {results['hf']}", flush=True)
        except Exception as exc:  # the engine's figures still come
            results["hf_error"] = f"{type(exc).__name__}: {exc}"
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        results["tllm"] = tllm_part(path, texts, text_only, images, args)
    except Exception as exc:
        results["tllm_error"] = f"{type(exc).__name__}: {exc}"
    shutil.rmtree(path.parent, ignore_errors=True)
    (out_dir / "vlm.json").write_text(json.dumps(results, indent=1, default=str))
    print(summary(results), flush=True)
    return 1 if "tllm_error" in results else 0


if __name__ == "__main__":
    sys.exit(main())
