"""The LLM API: generate, generate_async (awaitable, streamable), chat."""
from __future__ import annotations

import gc
import itertools
import queue
from typing import Any, Callable, Sequence, Union

import torch
from tqdm.auto import tqdm

from tllm.request import Request
from tllm.llmapi.engine import build_engine
from tllm.llmapi.flag_aliases import llm_args
from tllm.llmapi.pooling import PoolingClient
from tllm.llmapi.pooling_methods import PoolingMethods
from tllm.config import LlmArgs
from tllm.llmapi.result import GenerationResult
from tllm.llmapi.rollout import RolloutMethods, rollout_control
from tllm.llmapi.sequence_groups import bind_outputs, make_beam_group
from tllm.loader import DEFAULT_MODEL
from tllm.lora.request import LoRARequest
from tllm.lora.targets import LoraTargets
from tllm.multimodal.chat import has_image_parts, split_chat_images
from tllm.multimodal.fetch import media_fetcher
from tllm.multimodal.inputs import MultimodalInputs
from tllm.outputs import CompletionDelta, RequestOutput
from tllm.sampling_params import SamplingParams
from tllm.scheduler.policy import check_priority
from tllm.tokenizer import IncrementalDetokenizer

# A prompt: text, token ids, {"prompt": text} or {"prompt_token_ids": ids}; a dict may add
# "cache_salt" so that only prompts with the same salt share cached KV blocks, and
# "priority" (under scheduler_config.scheduling_policy="priority"). A vision-language model
# takes {"prompt": text, "multi_modal_data": {"image": [PIL image | path | uint8 array]}}
# (one placeholder token per image in the text; "add_special_tokens": False for text a chat
# template rendered).
PromptInput = Union[str, Sequence[int], dict]
Messages = list[dict[str, Any]]


class LLM(RolloutMethods, PoolingMethods):
    """An LLM with its own executor loop, e.g. `LLM("smollm2")` or `LLM("/path/to/hf_dir",
    max_batch_size=64, kv_cache_config=KvCacheConfig(max_tokens=65536))`."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs: Any) -> None:
        self._build(llm_args(model, kwargs))    # vLLM's keyword names taken too

    @classmethod
    def from_args(cls, args: LlmArgs) -> LLM:
        """An LLM from arguments validated already (ProcessLLM validates them in the server
        process, where a bad one fails at once, and builds the engine process's LLM so)."""
        llm = cls.__new__(cls)
        llm._build(args)
        return llm

    def _build(self, args: LlmArgs) -> None:
        self.args = args
        self._engine = build_engine(args)
        self._ids = itertools.count()
        self._closed = False
        self._pooling = PoolingClient(self._engine, args)  # embed, score, classify

    # ---- public API ----

    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def max_seq_len(self) -> int:
        return self._engine.max_seq_len

    @property
    def takes_images(self) -> bool:
        """Whether prompts may carry images (a vision-language model)."""
        return self._engine.multimodal is not None

    @property
    def sampling_defaults(self) -> dict[str, float | int]:
        """What the model's generation_config.json recommends (temperature, top_p, top_k,
        min_p, repetition_penalty; see `generation_config`): the defaults of calls and
        server requests that do not set them."""
        return dict(self._engine.sampling_defaults)

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a call without any: tllm's, under the model's defaults."""
        return SamplingParams(**self._engine.sampling_defaults)

    @property
    def is_alive(self) -> bool:
        """Whether the executor loop thread is running."""
        return not self._closed and self._engine.executor.is_alive

    def get_stats(self) -> dict[str, int]:
        """Running/waiting requests, KV blocks total/free, executor steps taken."""
        stats = self._engine.executor.stats()
        if self._engine.disagg is not None:
            stats.update(self._engine.disagg.stats())
        return stats

    @property
    def lora_targets(self) -> LoraTargets | None:
        """What adapters may target here (None: LoRA is off): a server checks an adapter
        against it when it registers one, not at its first request."""
        lora = self._engine.lora
        return None if lora is None else lora.model.targets

    @property
    def disagg_info(self) -> dict[str, str] | None:
        """A disaggregated worker's role and transport; a context server's KV endpoint and
        the source id requests name it by (None: not a disaggregated worker)."""
        agent = self._engine.disagg
        if agent is None:
            return None
        return {"role": agent.config.role, "transport": agent.config.transport,
                "kv_endpoint": agent.kv_endpoint, "kv_source_id": agent.kv_source_id}

    def get_kv_cache_stats(self) -> dict[str, float]:
        """Prefix-reuse hit rate, onboards/offloads/swaps, per-tier usage, preemptions;
        blocks freed by sliding windows, and per KV cache group (`group<g>_window`, 0 for
        full attention) the blocks it holds; `peak_requests`: the most requests holding
        blocks at once."""
        stats = self._engine.kv_cache.stats_dict()
        stats["preemptions"] = self._engine.executor.scheduler.num_preemptions
        return stats

    def generate(self, inputs: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: int | Sequence[int] | None = None
                 ) -> RequestOutput | list[RequestOutput]:
        """Run prompts to completion, batched together; one output per prompt, in order.
        `lora_request`: the adapter of every prompt, or one per prompt (None: the base).
        `priority`: every prompt's, or one per prompt (lower runs first; needs
        scheduler_config.scheduling_policy="priority")."""
        prompts, single = _as_prompt_list(inputs)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _broadcast_params(sampling_params, len(prompts))
        loras = _broadcast_loras(lora_request, len(prompts))
        priorities = _broadcast_priorities(priority, len(prompts))
        sink: queue.Queue = queue.Queue()
        results = [self._submit(p, sp, streaming=False, sink=sink, lora_request=lora,
                                priority=level)
                   for p, sp, lora, level in zip(prompts, params, loras, priorities)]
        num_unfinished = len(results)
        with tqdm(total=len(results), disable=not use_tqdm, desc="Generating") as bar:
            while num_unfinished:
                result, delta = sink.get()
                if result.apply(delta).finished:
                    num_unfinished -= 1
                    bar.update(1)
        outputs = [r.result() for r in results]
        return outputs[0] if single else outputs

    def generate_async(self, inputs: PromptInput,
                       sampling_params: SamplingParams | None = None,
                       streaming: bool = False,
                       lora_request: LoRARequest | None = None,
                       priority: int | None = None) -> GenerationResult:
        """Submit one prompt; await the result, or `async for` over it when streaming."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        return self._submit(inputs, sampling_params, streaming,
                            lora_request=lora_request, priority=priority)

    async def submit_batch(self, inputs: Sequence[PromptInput],
                           sampling_params: Sequence[SamplingParams],
                           streaming: bool = False) -> list[GenerationResult]:
        """generate_async for each prompt, all or none: if one is refused (ValueError), the
        others are aborted and the error raised. The server's way in (see ProcessLLM)."""
        return submit_all_or_none(self.generate_async, inputs, sampling_params, streaming)

    def chat(self, messages: Messages | list[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             **template_kwargs: Any) -> RequestOutput | list[RequestOutput]:
        """Generate replies to conversations, formatted with the model's chat template."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        prompts = [self._chat_prompt(conv, add_generation_prompt, template_kwargs)
                   for conv in conversations]
        outputs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                                lora_request=lora_request)
        return outputs[0] if single else outputs

    def _chat_prompt(self, messages: Messages, add_generation_prompt: bool,
                     template_kwargs: dict) -> dict:
        """A conversation as a prompt: token ids, or with image parts (OpenAI
        `image_url` parts, or `{"type": "image", "image": ...}`), text and images."""
        tokenizer = self._require_tokenizer()
        if not has_image_parts(messages):
            return {"prompt_token_ids": tokenizer.encode_chat(
                messages, add_generation_prompt=add_generation_prompt, **template_kwargs),
                "prompt": None}
        fetcher = media_fetcher(self.args.allowed_media_domains,
                                self.args.media_fetch_timeout_s, self.args.max_media_fetch_bytes)
        messages, images = split_chat_images(
            messages, allowed_local_path=self.args.allowed_local_media_path,
            fetch=fetcher.fetch if fetcher else None)
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return {"prompt": text, "multi_modal_data": {"image": images},
                "add_special_tokens": False}   # the template wrote them

    def _rollout_call(self, name: str, *args):
        """Sleep, wake, weight updates (tllm.llmapi.rollout)."""
        self._check_open()
        if getattr(self, "_rollout", None) is None:
            self._rollout = rollout_control(self._engine, self.args.sleep_mode_policy)
        attr = getattr(self._rollout, name)
        return attr(*args) if callable(attr) else attr

    def shutdown(self) -> None:
        """Stop the loop thread and release the model and KV cache."""
        if self._closed:
            return
        self._closed = True
        self._engine.close()
        device = self._engine.device
        # nothing the LLM keeps may still reach the model: a caller holding the closed LLM
        # while it builds the next one must not hold two models' memory
        self._engine = self._pooling = self._rollout = None  # type: ignore[assignment]
        if device.type == "cuda":
            # the runner's reference cycles hold the weights until collected, and the
            # caching allocator never asks Python to collect (on a CPU the next automatic
            # collection frees them; a collection here cost 0.2-0.5 s a shutdown)
            gc.collect()
            torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- requests ----

    def add_request(self, prompt: PromptInput, params: SamplingParams, request_id: str,
                    on_delta: Callable[[CompletionDelta], None]) -> Callable[[], None]:
        """Submit one prompt (n samples) whose deltas go straight to on_delta, on the executor
        thread, with no result object (for relays such as the engine process); returns its
        abort. Raises ValueError, submitting nothing, if the prompt is refused."""
        self._check_open()
        requests = self._new_requests(prompt, params, request_id)[2]
        self._start(requests, on_delta)
        return self._aborter(requests)

    def _submit(self, prompt: PromptInput, params: SamplingParams, streaming: bool,
                sink: queue.Queue | None = None,
                lora_request: LoRARequest | None = None,
                priority: int | None = None) -> GenerationResult:
        self._check_open()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids))
        text, token_ids, requests = self._new_requests(prompt, params, request_id,
                                                       lora_request, priority)
        result = GenerationResult(request_id, text, token_ids, params, streaming, sink,
                                  abort=self._aborter(requests))
        for request in requests:  # a caller that waits for the whole output gets it once
            request.stream_outputs = streaming
        self._start(requests, result.post)
        return result

    def _new_requests(self, prompt: PromptInput, params: SamplingParams, request_id: str,
                      lora_request: LoRARequest | None = None, priority: int | None = None
                      ) -> tuple[str | None, list[int], list[Request]]:
        """(prompt text, prompt token ids, one Request per sample), validated. A dict
        prompt may name its adapter ("lora_request") and priority, as the server's do."""
        if lora_request is None and isinstance(prompt, dict):
            lora_request = prompt.get("lora_request")
        if priority is None and isinstance(prompt, dict):
            priority = prompt.get("priority")
        self._check_lora(lora_request)
        self._pooling.check_generate()
        priority = check_priority(priority, self.args.scheduler_config.scheduling_policy)
        text, token_ids, multimodal = self._tokenize(prompt)
        requests = self._make_requests(request_id, token_ids, params)
        for request in requests:
            request.lora_request = lora_request
            request.priority = priority
            request.multimodal = multimodal
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            for request in requests:
                request.cache_salt = str(prompt["cache_salt"])
        if isinstance(prompt, dict) and prompt.get("disaggregated_params") is not None:
            if self._engine.disagg is None:
                raise ValueError("disaggregated_params: this engine has no disaggregation "
                                 "role (serve it with --role context or generation)")
            self._engine.disagg.prepare(requests, prompt["disaggregated_params"])
        return text, token_ids, requests

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        if lora_request is None:
            return
        lora = self._engine.lora
        if lora is None:
            raise ValueError("lora_request: this LLM serves no adapters (build it with "
                             "enable_lora=True)")
        lora.check(lora_request)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM has been shut down")

    def _start(self, requests: list[Request],
               on_delta: Callable[[CompletionDelta], None]) -> None:
        bind_outputs(requests, on_delta, self.tokenizer)
        engine = self._engine
        submit = engine.executor.submit if engine.disagg is None else engine.disagg.submit
        for request in requests:
            submit(request)

    def _aborter(self, requests: list[Request]) -> Callable[[], None]:
        engine = self._engine
        abort = engine.executor.abort if engine.disagg is None else engine.disagg.abort
        return lambda: [abort(r.request_id) for r in requests]

    def _tokenize(self, prompt: PromptInput
                  ) -> tuple[str | None, list[int], MultimodalInputs | None]:
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            return self._process_multimodal(prompt)
        return (*self._tokenize_text(prompt), None)

    def _process_multimodal(self, prompt: dict
                            ) -> tuple[str, list[int], MultimodalInputs | None]:
        """A prompt with images: its placeholders expanded, the images processed."""
        processor = self._engine.multimodal
        if processor is None:
            raise ValueError(f"multi_modal_data: model {self.args.model!r} takes no images")
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data must be {'image': [images]}, got "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        text = prompt.get("prompt")
        if not isinstance(text, str) or not text:
            raise ValueError("inputs: a prompt with multi_modal_data needs its text as "
                             "'prompt' (with the model's image placeholders)")
        token_ids, multimodal = processor.process(
            text, data.get("image") or [],
            add_special_tokens=bool(prompt.get("add_special_tokens", True)))
        return text, token_ids, multimodal if multimodal.items else None

    def _tokenize_text(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("inputs: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("inputs: the prompt is empty")
            return prompt, self._require_tokenizer().encode(prompt)
        return None, _check_token_ids(prompt)

    def _make_requests(self, request_id: str, token_ids: list[int],
                       params: SamplingParams) -> list[Request]:
        engine = self._engine
        self._check_prompt(token_ids)
        room = engine.max_seq_len - len(token_ids)
        max_new = min(params.max_tokens or room, room)
        eos = engine.tokenizer.eos_token_ids if engine.tokenizer else _config_eos(engine.config)
        requests: list[Request] = []
        num_sequences = params.num_sequences  # n, best_of or the beam width
        for i in range(num_sequences):
            requests.append(Request(
                request_id=request_id if num_sequences == 1 else f"{request_id}-{i}",
                prompt_token_ids=token_ids, sampling_params=params, max_new_tokens=max_new,
                eos_token_ids=eos, sample_index=i,
                prefix_leader=requests[0] if requests else None,
                detokenizer=self._detokenizer(token_ids, params),
                generator=self._generator(params.seed, i)))
        if params.use_beam_search:
            make_beam_group(requests, params, max_blocks=engine.kv_cache.max_blocks(requests[0]),
                            num_blocks=engine.kv_cache.num_blocks,
                            max_batch_size=self.args.max_batch_size,
                            max_num_tokens=self.args.max_num_tokens)
        if not engine.kv_cache.fits_ever(requests[0]):
            raise ValueError(
                f"inputs: a request of {len(token_ids)} prompt tokens + {max_new} new tokens "
                f"needs more KV blocks than the cache has ({engine.kv_cache.num_blocks}); "
                "raise kv_cache_config.max_tokens or lower max_tokens")
        return requests

    def _check_prompt(self, token_ids: list[int]) -> None:
        engine, args = self._engine, self.args
        if len(token_ids) >= engine.max_seq_len:
            raise ValueError(f"inputs: the prompt has {len(token_ids)} tokens; max_seq_len is "
                             f"{engine.max_seq_len}, which leaves no room to generate")
        vocab = engine.config.vocab_size
        if max(token_ids) >= vocab:
            raise ValueError(f"inputs: token id {max(token_ids)} is outside the vocabulary "
                             f"(size {vocab})")
        if not args.enable_chunked_prefill and len(token_ids) > args.max_num_tokens:
            raise ValueError(f"inputs: the prompt has {len(token_ids)} tokens, more than "
                             f"max_num_tokens ({args.max_num_tokens}) without chunked prefill")

    def _detokenizer(self, token_ids: list[int], params: SamplingParams):
        if not params.detokenize or self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, token_ids, params)

    def _generator(self, seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        generator = torch.Generator(device=self._engine.device)
        generator.manual_seed(seed + index)
        return generator

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"inputs: model {self.args.model!r} has no tokenizer; "
                             "pass prompt_token_ids instead of text")
        return self.tokenizer


def submit_all_or_none(generate_async, inputs: Sequence[PromptInput],
                       params: Sequence[SamplingParams], streaming: bool) -> list:
    results = []
    try:
        for prompt, prompt_params in zip(inputs, params, strict=True):
            results.append(generate_async(prompt, prompt_params, streaming=streaming))
    except BaseException:
        for result in results:
            result.abort()
        raise
    return results


def _as_prompt_list(inputs) -> tuple[list[PromptInput], bool]:
    if isinstance(inputs, (str, dict)):
        return [inputs], True
    if isinstance(inputs, Sequence) and inputs and all(_is_token(t) for t in inputs):
        return [inputs], True
    if isinstance(inputs, Sequence) and inputs:
        return list(inputs), False
    raise ValueError(f"inputs must be a prompt or a non-empty list of prompts, got {inputs!r}")


def _broadcast_loras(lora_request, count: int) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"lora_request: {len(loras)} given for {count} prompts")
    return loras


def _broadcast_priorities(priority, count: int) -> list[int | None]:
    if priority is None or _is_token(priority):
        return [priority] * count
    if isinstance(priority, (str, bytes)) or not isinstance(priority, Sequence):
        raise ValueError(f"priority: an int or one int per prompt, got {priority!r}")
    if len(priority) != count:
        raise ValueError(f"priority: {len(priority)} given for {count} prompts")
    return list(priority)


def _broadcast_params(params, count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params: {len(params)} given for {count} prompts")
    return params


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(token_ids) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    if not isinstance(token_ids, Sequence) or isinstance(token_ids, str) or not token_ids:
        raise ValueError("inputs: prompt_token_ids must be a non-empty list of ints")
    if not all(_is_token(t) and t >= 0 for t in token_ids):
        raise ValueError("inputs: prompt_token_ids must hold non-negative ints")
    return list(token_ids)


def _config_eos(config) -> frozenset[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(eos) if isinstance(eos, list) else frozenset([eos])
