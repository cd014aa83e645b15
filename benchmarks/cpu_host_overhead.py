"""Host cost per generated token (issue "Throughput at scale"), on the CPU: a tiny random
Llama (2 layers, hidden 64: its forward is nearly free) decodes `--batch` requests at once,
and the loop's wall time per generated token is what the executor, scheduler, inputs,
sampler and output handling cost around it. The model's own forward is timed apart (the
`model` column) and taken out in `host`. `host cpu` counts CPU time instead of wall time
(the loop thread's outside the forward, plus the output thread's): it holds on a busy
machine, where wall times do not. Repeated; the median is reported.

    python benchmarks/cpu_host_overhead.py [--batches 64 512 1024] [--repeats 3]
    python benchmarks/cpu_host_overhead.py --sampling   # temperature, top-p/k, penalties,
                                                        # seeds and logprobs on

Comparator in the same run: the same model's forward alone (what a step costs with no host
work at all), so the host figure is the loop's, not the model's."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tllm import LLM, KvCacheConfig, SamplingParams  # noqa: E402

VOCAB = 384
HOST_THREADS = ("tllm-executor", "tllm-outputs")  # the loop and the output delivery


def tiny_llama(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, architectures=["LlamaForCausalLM"])
    LlamaForCausalLM(config).save_pretrained(path)


def sampling_params(args, sampling: bool) -> list[SamplingParams] | SamplingParams:
    if not sampling:
        return SamplingParams(max_tokens=args.osl, temperature=0, ignore_eos=True)
    return [SamplingParams(max_tokens=args.osl, temperature=0.8, top_p=0.9, top_k=50,
                           repetition_penalty=1.1, presence_penalty=0.2,
                           frequency_penalty=0.1, seed=i, logprobs=2, ignore_eos=True)
            for i in range(args.batch)]


class ForwardClock:
    """Sums the wall and loop-thread CPU time spent in the model's forward during a run."""

    def __init__(self, model) -> None:
        self.seconds = self.cpu_seconds = 0.0
        self._start = self._cpu_start = 0.0
        model.register_forward_pre_hook(self._begin)
        model.register_forward_hook(self._end)

    def _begin(self, *_):
        self._start, self._cpu_start = time.perf_counter(), time.thread_time()

    def _end(self, *_):
        self.seconds += time.perf_counter() - self._start
        self.cpu_seconds += time.thread_time() - self._cpu_start


def thread_cpu_seconds(names: tuple[str, ...]) -> float:
    """CPU time so far of this process's threads with these names (user + system)."""
    ids = {t.native_id for t in threading.enumerate() if t.name in names}
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id in ids)


def run_once(llm: LLM, clock: ForwardClock, args, sampling: bool) -> dict:
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (args.isl,), generator=g).tolist()}
               for _ in range(args.batch)]
    params = sampling_params(args, sampling)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    clock.seconds = clock.cpu_seconds = 0.0
    steps = llm._engine.executor.num_steps
    cpu_start = thread_cpu_seconds(HOST_THREADS)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    host_cpu = thread_cpu_seconds(HOST_THREADS) - cpu_start - clock.cpu_seconds
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"wall_s": wall, "tokens": tokens,
            "steps": llm._engine.executor.num_steps - steps,
            "us_per_token": wall / tokens * 1e6,
            "model_us_per_token": clock.seconds / tokens * 1e6,
            "host_us_per_token": (wall - clock.seconds) / tokens * 1e6,
            "host_cpu_us_per_token": host_cpu / tokens * 1e6}


def measure(path: Path, args, batch: int, sampling: bool) -> dict:
    args.batch = batch
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=batch * (args.isl + args.osl) + 512)
    with LLM(str(path), dtype="float32", max_batch_size=batch,
             max_num_tokens=max(batch * args.isl, 2048), kv_cache_config=kv) as llm:
        clock = ForwardClock(llm._engine.executor.runner.model)
        runs = [run_once(llm, clock, args, sampling) for _ in range(args.repeats)]
    best = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    best.update(batch=batch, sampling=sampling, runs=runs)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512, 1024])
    parser.add_argument("--isl", type=int, default=32)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sampling", action="store_true",
                        help="also run with every sampling option on")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch's intra-op threads (1 keeps a busy machine's OpenMP "
                             "spinning out of the host figures)")
    parser.add_argument("--json", help="write the full results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tiny_llama(Path(tmp))
        for batch in args.batches:
            for sampling in (False, True) if args.sampling else (False,):
                results.append(measure(Path(tmp), args, batch, sampling))
                r = results[-1]
                print(f"batch {batch:5d} {'sampling' if sampling else 'greedy  '}: "
                      f"{r['us_per_token']:6.1f} us/token in all, model "
                      f"{r['model_us_per_token']:5.1f}, host {r['host_us_per_token']:6.1f}, "
                      f"host cpu {r['host_cpu_us_per_token']:6.1f} ({r['steps']:.0f} steps)",
                      flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
