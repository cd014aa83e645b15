"""The LLM API's pooling side: which task an engine serves (`resolve_task`), and the client
that turns prompts into pooling requests and their results into PoolingRequestOutputs
(`embed`, `score`, `classify`, `encode_async`, `score_async`).

A pooling request is a Request with PoolingParams: it runs its prompt through the same
executor loop as generation (tllm.runner.pooling pools its hidden states) and ends after its
prompt's last step, its KV blocks freed then. Its result travels as one callback from the
output thread; the sync methods wait on futures, the async ones await them."""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from typing import Any, Callable, Sequence

import torch

from tllm.loader.pooling_config import pooler_config
from tllm.outputs import PoolingRequestOutput
from tllm.pooling_params import PoolerConfig, PoolingParams
from tllm.request import Request
from tllm.runner.pooling import Pooler, YesNoHead
from tllm.sampling_params import SamplingParams

# what a request of each task needs of the model: its head (score, classify) or none
_HEAD_TASKS = ("score", "classify")


def resolve_task(requested: str, model) -> str:
    """The engine's task: the one asked for, checked against the model, or the model's."""
    own = getattr(model, "pooling_task", None)
    name = type(model).__name__
    if requested == "auto":
        return own or "generate"
    if requested == "generate" and own is not None:
        raise ValueError(f"task: {name} is a pooling model ({own}); it cannot generate")
    is_lm = own is None and hasattr(model, "lm_head")  # a reranker by Qwen3-Reranker's rule
    if (requested == "classify" or (requested == "score" and not is_lm)) and not hasattr(
            model, "pooling_head"):
        raise ValueError(f"task: {name} has no classification head for task {requested!r} "
                         "(only 'embed' or 'generate')")
    return requested


def setup_pooling(args, parts, executor, tokenizer) -> tuple[str, dict]:
    """The engine's task and pooling info; its runner pools from now on (on one pipeline
    stage: rank 0 then holds the final hidden states). A pooling task's defaults come from
    the model's sentence-transformers layout; a generating model embeds its last token, or
    scores by the yes/no rule (task "score")."""
    task = resolve_task(args.task, parts.model)
    if args.pipeline_parallel_size == 1:
        folder = parts.source.path if parts.source.kind == "hf" else None
        config = (PoolerConfig("last") if task == "generate"
                  else pooler_config(parts.model, folder))
        head = None
        if task == "score" and not hasattr(parts.model, "pooling_head"):
            head = yes_no_head(parts.model, tokenizer)
        executor.runner.enable_pooling(Pooler(parts.model, config, head))
    elif task != "generate":
        raise ValueError(f"task: {task!r} runs without pipeline parallelism (pp_size 1)")
    return task, pooling_info(parts.model, task)


def yes_no_head(model, tokenizer) -> YesNoHead:
    """Qwen3-Reranker's rule on a causal LM: its tokenizer's "yes" and "no" tokens."""
    ids = [] if tokenizer is None else [tokenizer.hf.convert_tokens_to_ids(t)
                                        for t in ("yes", "no")]
    if len(ids) != 2 or tokenizer.hf.unk_token_id in ids or None in ids:
        raise ValueError(f"task: 'score' on {type(model).__name__} scores by the yes/no rule "
                         "(Qwen3-Reranker), which needs a tokenizer with 'yes' and 'no' tokens")
    return YesNoHead(model, *ids)


# Qwen3-Reranker's prompt for a (query, document) pair, as its model card gives it
RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_RERANKER_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements "
                    "based on the Query and the Instruct provided. Note that the answer can "
                    "only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def reranker_prompt(query: str, document: str) -> str:
    return (f"{_RERANKER_PREFIX}<Instruct>: {RERANKER_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}{_RERANKER_SUFFIX}")


def pooling_info(model, task: str) -> dict:
    """What a server reports of a pooling engine: the embedding size (None where it does
    not embed) and the labels of a classifier (None without a head)."""
    config = model.config
    labels = None
    if hasattr(model, "pooling_head"):
        id2label = getattr(config, "id2label", None) or {}
        labels = [str(id2label.get(i, i)) for i in range(config.num_labels)]
    embeds = task in ("embed", "generate")
    return {"embedding_size": int(config.hidden_size) if embeds else None, "labels": labels}


class PoolingClient:
    """Pooling requests on one engine (LLM's embed/score/classify and their async forms)."""

    def __init__(self, engine, args) -> None:
        self._engine = engine
        self._args = args
        self.task: str = engine.task
        self.info: dict = engine.pooling_info
        runner = engine.executor.runner
        self._pooler = runner.pooler.config if runner.pooler is not None else None
        self._has_head = runner.pooler is not None and runner.pooler.head is not None
        self._yes_no = runner.pooler is not None and isinstance(runner.pooler.head, YesNoHead)
        self._model = runner.model
        self._ids = itertools.count()

    # ---- checks ----

    def check_generate(self) -> None:
        if self.task != "generate":
            raise ValueError(f"task: this LLM serves task {self.task!r}, not generation; use "
                             "embed/score/classify (or encode_async)")

    def _check_params(self, params: PoolingParams) -> None:
        if not isinstance(params, PoolingParams):
            raise ValueError(f"params must be PoolingParams, got {type(params).__name__}")
        if self._pooler is None:
            raise ValueError("task: this engine cannot pool (it runs pipeline stages)")
        allowed = ("embed", *(_HEAD_TASKS if self._has_head else ()))
        if params.task not in allowed:
            raise ValueError(f"task: this LLM (task {self.task!r}) cannot serve a "
                             f"{params.task!r} request; it serves {', '.join(allowed)}")
        size = self.info["embedding_size"]
        if params.dimensions is not None and (size is None or params.dimensions > size):
            raise ValueError(f"dimensions: {params.dimensions} is more than the model's "
                             f"embedding size ({size})")

    # ---- requests ----

    def submit(self, prompt, params: PoolingParams, request_id: str | None = None
               ) -> concurrent.futures.Future:
        """Submit one prompt; the future gets its PoolingRequestOutput (or the error).
        ValueError, submitting nothing, if the prompt or params are refused."""
        self._check_params(params)
        request_id = request_id or f"pool-{next(self._ids)}"
        token_ids, token_types = self._tokenize(prompt, params)
        request = self._make_request(request_id, token_ids, token_types, params)
        future: concurrent.futures.Future = concurrent.futures.Future()
        request.on_update = lambda r: _deliver(r, future)
        request.stream_outputs = False
        self._engine.executor.submit(request)
        return future

    def abort(self, request_id: str) -> None:
        self._engine.executor.abort(request_id)

    def _make_request(self, request_id: str, token_ids: list[int],
                      token_types: list[int] | None, params: PoolingParams) -> Request:
        engine = self._engine
        if params.truncate_prompt_tokens is not None:
            cut = max(0, len(token_ids) - params.truncate_prompt_tokens)
            token_ids = token_ids[cut:]
            token_types = token_types[cut:] if token_types is not None else None
        self._check_prompt(token_ids)
        request = Request(request_id=request_id, prompt_token_ids=token_ids,
                          sampling_params=SamplingParams(max_tokens=1, detokenize=False),
                          max_new_tokens=1, pooling_params=params, token_type_ids=token_types)
        if not self._reuses_prefix():  # a unique salt: its blocks are never shared
            request.cache_salt = f"pooling:{request_id}:{id(request)}"
        if not engine.kv_cache.fits_ever(request):
            raise ValueError(f"inputs: a prompt of {len(token_ids)} tokens needs more KV "
                             f"blocks than the cache has ({engine.kv_cache.num_blocks})")
        return request

    def _reuses_prefix(self) -> bool:
        """Reusing cached blocks skips their tokens' hidden states: safe only where the
        pooled state is the last token's and keys never depend on later tokens."""
        return (self._pooler.pooling_type == "last"
                and getattr(self._model, "is_causal", True))

    def _check_prompt(self, token_ids: list[int]) -> None:
        engine, args = self._engine, self._args
        limit = min(engine.max_seq_len, getattr(self._model, "max_prompt_len", 1 << 62))
        if len(token_ids) > limit:
            raise ValueError(f"inputs: the prompt has {len(token_ids)} tokens, more than "
                             f"the model takes ({limit}: max_seq_len, or its positions)")
        vocab = engine.config.vocab_size
        if max(token_ids) >= vocab:
            raise ValueError(f"inputs: token id {max(token_ids)} is outside the vocabulary "
                             f"(size {vocab})")
        one_step = not getattr(self._model, "is_causal", True) or not args.enable_chunked_prefill
        if one_step and len(token_ids) > args.max_num_tokens:
            raise ValueError(f"inputs: the prompt has {len(token_ids)} tokens, more than "
                             f"max_num_tokens ({args.max_num_tokens}), and this model computes "
                             "a prompt in one step")

    def _tokenize(self, prompt, params: PoolingParams) -> tuple[list[int], list[int] | None]:
        if isinstance(prompt, tuple):
            if len(prompt) != 2 or not all(isinstance(p, str) and p for p in prompt):
                raise ValueError("inputs: a pair prompt is (text, text), both non-empty")
            if params.task != "score":
                raise ValueError("inputs: a (text, text) pair is scored (task 'score')")
            if self._yes_no:  # a decoder reranker reads the pair in its template
                return self._require_tokenizer().encode(reranker_prompt(*prompt)), None
            return self._require_tokenizer().encode_pair(*prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return _token_ids(prompt["prompt_token_ids"]), None
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("inputs: the prompt is empty")
            return self._require_tokenizer().encode(prompt), None
        return _token_ids(prompt), None

    def _require_tokenizer(self):
        if self._engine.tokenizer is None:
            raise ValueError("inputs: this model has no tokenizer; pass prompt_token_ids")
        return self._engine.tokenizer

    # ---- the API ----

    def run(self, prompts: Sequence, params: Sequence[PoolingParams]
            ) -> list[PoolingRequestOutput]:
        """Submit all (or none: one refused aborts the others), wait for every output."""
        futures, ids = [], []
        prompts = self._tokenized_together(prompts)
        try:
            for prompt, prompt_params in zip(prompts, params, strict=True):
                ids.append(f"pool-{next(self._ids)}")
                futures.append(self.submit(prompt, prompt_params, ids[-1]))
        except BaseException:
            for request_id in ids:
                self.abort(request_id)
            raise
        return [f.result() for f in futures]

    def _tokenized_together(self, prompts: Sequence) -> list:
        """The plain-text prompts tokenized in one batch call (one call a text was about
        half of a BERT-base's embedding time for 256 texts of 512 tokens on an H100)."""
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str) and p]
        if len(texts) < 2 or self._engine.tokenizer is None:
            return list(prompts)
        out = list(prompts)
        encoded = self._engine.tokenizer.encode_batch([prompts[i] for i in texts])
        for i, token_ids in zip(texts, encoded):
            out[i] = {"prompt_token_ids": token_ids}
        return out

    def embed(self, prompts, dimensions: int | None = None,
              normalize: bool | None = None) -> list[PoolingRequestOutput]:
        items = _prompt_list(prompts)
        params = PoolingParams("embed", dimensions=dimensions, normalize=normalize)
        return self.run(items, [params] * len(items))

    def classify(self, prompts) -> list[PoolingRequestOutput]:
        items = _prompt_list(prompts)
        return self.run(items, [PoolingParams("classify")] * len(items))

    def score(self, query: str, documents: Sequence[str]) -> list[PoolingRequestOutput]:
        _check_score_inputs(query, documents)
        if self.task == "score":
            return self.run([(query, d) for d in documents],
                            [PoolingParams("score")] * len(documents))
        embeddings = self.run([query, *documents],
                              [PoolingParams("embed", normalize=True)] * (1 + len(documents)))
        return _cosines(embeddings)

    async def encode_async(self, prompt, params: PoolingParams,
                           request_id: str | None = None) -> PoolingRequestOutput:
        future = self.submit(prompt, params, request_id)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if request_id is not None:
                self.abort(request_id)
            raise

    async def score_async(self, query: str, documents: Sequence[str]
                          ) -> list[PoolingRequestOutput]:
        return await score_with(self.encode_async, self.task, query, documents)

    def add_request(self, prompt, params: PoolingParams, request_id: str,
                    on_done: Callable[[PoolingRequestOutput | Exception], None]
                    ) -> Callable[[], None]:
        """Submit one prompt whose output (or error, a refusal included) goes to on_done
        (for relays such as the engine process); returns its abort."""
        try:
            future = self.submit(prompt, params, request_id)
        except Exception as exc:
            on_done(exc)
            return lambda: None
        future.add_done_callback(lambda f: on_done(f.exception() or f.result()))
        return lambda: self.abort(request_id)


async def score_with(encode_async, task: str, query: str, documents: Sequence[str]
                     ) -> list[PoolingRequestOutput]:
    """Each document's score: a cross-encoder's for the (query, document) pair (task
    "score"), else the cosine of the embeddings."""
    _check_score_inputs(query, documents)
    if task == "score":
        return list(await asyncio.gather(*[
            encode_async((query, d), PoolingParams("score")) for d in documents]))
    embed = PoolingParams("embed", normalize=True)
    outputs = await asyncio.gather(*[encode_async(text, embed)
                                     for text in [query, *documents]])
    return _cosines(list(outputs))


def pool_sync(encode_async, prompts, params: PoolingParams) -> list[PoolingRequestOutput]:
    """The sync embed/classify of a handle that only has encode_async (ProcessLLM), on
    an event loop of its own."""
    items = _prompt_list(prompts)

    async def run() -> list[PoolingRequestOutput]:
        return list(await asyncio.gather(*[encode_async(p, params) for p in items]))
    return asyncio.run(run())


class PooledResult:
    """The caller's side of a pooling request run in another process: `deliver` gets its
    output or error (event loop thread); await `future`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.future: asyncio.Future = loop.create_future()

    def deliver(self, item: PoolingRequestOutput | Exception) -> bool:
        if not self.future.done():
            if isinstance(item, Exception):
                self.future.set_exception(item)
            else:
                self.future.set_result(item)
        return True    # its only message

    def fail(self, error: Exception) -> None:
        self.deliver(error)


def _deliver(request: Request, future: concurrent.futures.Future) -> None:
    """On the output thread, once the request has ended."""
    if not request.is_finished or future.done():
        return
    if request.pooled is None:
        future.set_exception(request.error or RuntimeError(
            f"request {request.request_id} was aborted"))
        return
    future.set_result(PoolingRequestOutput(request.request_id, request.prompt_token_ids,
                                           request.pooled.tolist()))


def _cosines(outputs: list[PoolingRequestOutput]) -> list[PoolingRequestOutput]:
    """Each document's cosine with the query (embeddings normalised already)."""
    query = torch.tensor(outputs[0].data)
    return [PoolingRequestOutput(o.request_id, o.prompt_token_ids,
                                 [float(query @ torch.tensor(o.data))]) for o in outputs[1:]]


def _check_score_inputs(query: Any, documents: Any) -> None:
    if not isinstance(query, str) or not query:
        raise ValueError("query must be a non-empty string")
    if (isinstance(documents, str) or not isinstance(documents, Sequence) or not documents
            or not all(isinstance(d, str) and d for d in documents)):
        raise ValueError("documents must be a non-empty list of non-empty strings")


def _prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(_is_token(t) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a prompt or a non-empty list of prompts, "
                         f"got {prompts!r}")
    return list(prompts)


def _token_ids(token_ids) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    if (isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence)
            or not token_ids or not all(_is_token(t) and t >= 0 for t in token_ids)):
        raise ValueError("inputs: prompt_token_ids must be a non-empty list of "
                         "non-negative ints")
    return list(token_ids)


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
