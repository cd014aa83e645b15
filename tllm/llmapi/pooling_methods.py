"""The pooling methods of LLM and ProcessLLM (embed, score, classify and their async forms),
kept beside the classes so that each stays about generation. LLM's run on its PoolingClient
(tllm.llmapi.pooling); ProcessLLM's send the request to its engine process."""
from __future__ import annotations

import asyncio
from typing import Sequence

from tllm.llmapi.pooling import PooledResult, pool_sync, score_with
from tllm.pooling_params import PoolingParams


class PoolingMethods:
    """LLM's: needs `_pooling` (a PoolingClient) and `_check_open()`."""

    @property
    def task(self) -> str:
        """"generate", "embed", "score" or "classify" (the model's, or task=...)."""
        return self._pooling.task

    @property
    def pooling_info(self) -> dict:
        """{"embedding_size": int | None, "labels": list[str] | None}"""
        return dict(self._pooling.info)

    def embed(self, prompts, *, dimensions: int | None = None, normalize: bool | None = None):
        """One PoolingRequestOutput (`.embedding`) per prompt, in order."""
        self._check_open()
        return self._pooling.embed(prompts, dimensions, normalize)

    def score(self, query: str, documents: Sequence[str]):
        """Each document's score against the query (`.score`): a cross-encoder's, or the
        cosine of an embedder's embeddings."""
        self._check_open()
        return self._pooling.score(query, documents)

    def classify(self, prompts):
        """One PoolingRequestOutput (`.probs`, one per label) per prompt, in order."""
        self._check_open()
        return self._pooling.classify(prompts)

    async def encode_async(self, prompt, params, request_id: str | None = None):
        self._check_open()
        return await self._pooling.encode_async(prompt, params, request_id)

    async def score_async(self, query: str, documents: Sequence[str]):
        self._check_open()
        return await self._pooling.score_async(query, documents)

    def add_pooling_request(self, prompt, params, request_id: str, on_done):
        """add_request's pooling twin: on_done gets the output or the error."""
        self._check_open()
        return self._pooling.add_request(prompt, params, request_id, on_done)


class ProcessPoolingMethods:
    """ProcessLLM's: needs `_engine`, `_ids`, `_closed`, `_abort()` and the `task` the engine
    process reported."""

    async def encode_async(self, prompt, params, request_id: str | None = None):
        """A pooling request (LLM.encode_async) run in the engine process; its refusal
        comes back as the ValueError."""
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        engine, request_id = self._engine, request_id or f"p{next(self._ids)}"
        result = PooledResult(asyncio.get_running_loop())
        self._loop = asyncio.get_running_loop()
        engine.streams[request_id] = result
        engine.send(("encode", request_id, prompt, params))
        engine.num_sent += 1
        try:
            return await result.future
        except asyncio.CancelledError:
            self._abort(engine, request_id)
            raise
        finally:
            engine.streams.pop(request_id, None)

    async def score_async(self, query: str, documents: Sequence[str]):
        return await score_with(self.encode_async, self.task, query, documents)

    def embed(self, prompts, *, dimensions: int | None = None, normalize: bool | None = None):
        """LLM.embed's (and classify's, score's) sync forms, outside any event loop."""
        return pool_sync(self.encode_async, prompts,
                         PoolingParams("embed", dimensions=dimensions, normalize=normalize))

    def classify(self, prompts):
        return pool_sync(self.encode_async, prompts, PoolingParams("classify"))

    def score(self, query: str, documents: Sequence[str]):
        return asyncio.run(self.score_async(query, documents))
