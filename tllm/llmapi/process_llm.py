"""ProcessLLM: an LLM whose engine runs in a process of its own, for the server.

In one process, the HTTP/SSE work of hundreds of streams and the executor loop share one GIL,
and the loop gets only part of it (the H200 server delivered 44% of the offline throughput).
Here the server process keeps HTTP, JSON and tokenization; a spawned engine process runs
`LLM` (executor loop, detokenization) and talks to it over two pipes:

    server -> engine  ("submit", batch_id, [(request_id, inputs, params)], streaming)
                      ("abort", request_id) | ("shutdown",)
    engine -> server  ("ready", info) | ("failed", exception)       once, at start
                      ("accepted", batch_id) | ("rejected", batch_id, ValueError)
                      ("deltas", [(request_id, delta)], done_ids, stats)

Request ids are chosen by the server side, so results exist before their first delta. The
engine batches every delta ready since its last send into one message (and sends stats at
least every HEARTBEAT_S); the server side applies one message per event-loop callback.
Validation stays where it is (LLM._submit): a refused prompt comes back as the ValueError.
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import multiprocessing
import queue
import signal
import threading
from typing import Any, Sequence

from tllm.llmapi.llm_args import LlmArgs
from tllm.llmapi.result import GenerationResult
from tllm.sampling_params import SamplingParams

HEARTBEAT_S = 0.1
_SHUTDOWN_TIMEOUT_S = 60.0


class ProcessLLM:
    """The server's handle on an engine process: `submit_batch`, `get_stats`, `is_alive`,
    `tokenizer`, `max_seq_len`, `shutdown` (what the server uses of an LLM)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        from tllm import loader
        self.args = LlmArgs(model=model, **kwargs)     # bad arguments fail here, at once
        self.tokenizer = loader.load_tokenizer(loader.resolve_model(model))
        context = multiprocessing.get_context("spawn")
        self._commands, engine_commands = context.Pipe(duplex=False)[::-1]
        engine_events, self._events = context.Pipe(duplex=False)[::-1]
        self._process = context.Process(
            target=engine_main, args=(model, kwargs, engine_commands, engine_events),
            name="tllm-engine")
        self._process.start()
        engine_commands.close()
        engine_events.close()
        ready = self._wait_until_ready()
        self.max_seq_len: int = ready["max_seq_len"]
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._results: dict[str, GenerationResult] = {}
        self._pending: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats: dict[str, Any] = {"stats": ready["stats"], "alive": True,
                                       "num_received": 0}
        self._num_sent = 0
        self._closed = False
        self._receiver = threading.Thread(target=self._receive, name="tllm-engine-events",
                                          daemon=True)
        self._receiver.start()

    # ---- what the server uses ----

    @property
    def is_alive(self) -> bool:
        return (not self._closed and self._process.is_alive() and self._receiver.is_alive()
                and self._stats["alive"])

    def get_stats(self) -> dict[str, int]:
        """The engine's latest stats (at most HEARTBEAT_S old); submissions it has not
        received yet count as waiting."""
        stats = dict(self._stats["stats"])
        in_flight = self._num_sent - self._stats["num_received"]
        stats["num_waiting"] = stats.get("num_waiting", 0) + max(0, in_flight)
        return stats

    async def submit_batch(self, inputs: Sequence[dict], sampling_params: Sequence[SamplingParams],
                           streaming: bool = False) -> list[GenerationResult]:
        """Submit prompts ({"prompt_token_ids", "prompt"}) all or none; raises the engine's
        ValueError if it refuses one."""
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        self._loop = asyncio.get_running_loop()
        for params in sampling_params:
            if not isinstance(params, SamplingParams):
                raise ValueError("sampling_params must be SamplingParams, got "
                                 f"{type(params).__name__}")
        batch_id = next(self._ids)
        items = [(f"r{next(self._ids)}", prompt, params)
                 for prompt, params in zip(inputs, sampling_params, strict=True)]
        results = [self._new_result(*item, streaming) for item in items]
        accepted = self._loop.create_future()
        self._pending[batch_id] = accepted
        sent = False
        try:
            self._send(("submit", batch_id, items, streaming))
            self._num_sent += len(items)
            sent = True
            await accepted
        except BaseException:
            for request_id, _, _ in items:
                self._results.pop(request_id, None)
                if sent:    # e.g. the caller was cancelled: the engine may run them anyway
                    self._abort_quietly(request_id)
            raise
        finally:
            self._pending.pop(batch_id, None)
        return results

    def _new_result(self, request_id: str, prompt: dict, params: SamplingParams,
                    streaming: bool) -> GenerationResult:
        """The caller's side of a request, registered to receive its deltas."""
        result = GenerationResult(request_id, prompt.get("prompt"),
                                  list(prompt["prompt_token_ids"]), params.n,
                                  params.logprobs is not None, streaming)
        result.set_abort(lambda: self._abort_quietly(request_id))
        self._results[request_id] = result
        return result

    def shutdown(self) -> None:
        """Stop the engine process (it frees the model and KV cache) and wait for it."""
        if self._closed:
            return
        self._closed = True
        try:
            self._send(("shutdown",))
        except OSError:             # the engine is gone already
            pass
        self._process.join(_SHUTDOWN_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._commands.close()
        self._receiver.join(timeout=5)
        self._events.close()

    def __enter__(self) -> ProcessLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- plumbing ----

    def _wait_until_ready(self) -> dict:
        while not self._events.poll(0.5):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited with code "
                                   f"{self._process.exitcode} while starting")
        try:
            kind, payload = self._events.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError("the engine process exited while starting") from None
        if kind == "failed":
            self._process.join()
            raise payload
        return payload

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except OSError:         # the engine is gone: nothing runs any more
            pass

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._commands.send(message)

    def _receive(self) -> None:
        """Engine messages, handed to the event loop one message per callback."""
        while True:
            try:
                message = self._events.recv()
            except (EOFError, OSError):
                break
            if message[0] == "deltas":
                self._stats = message[3]
                if message[1] or message[2]:
                    self._call_in_loop(self._apply_deltas, message[1], message[2])
            else:
                self._call_in_loop(self._settle, message)
        self._stats = {**self._stats, "alive": False}
        self._call_in_loop(self._fail_pending)

    def _call_in_loop(self, fn, *args) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:        # the loop is closed: nobody is listening
            pass

    def _apply_deltas(self, deltas: list, done: list[str]) -> None:
        for request_id, delta in deltas:
            result = self._results.get(request_id)
            if result is not None:
                result.deliver(delta)
        for request_id in done:
            self._results.pop(request_id, None)

    def _settle(self, message: tuple) -> None:
        future = self._pending.get(message[1])
        if future is None or future.done():
            return
        if message[0] == "accepted":
            future.set_result(None)
        else:
            future.set_exception(message[2])

    def _fail_pending(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(RuntimeError("the engine process has stopped"))


def engine_main(model: str, kwargs: dict, commands, events) -> None:
    """The engine process: build the LLM, then serve commands until shutdown or until the
    server's end of the pipe closes (the server died)."""
    from tllm.llmapi.llm import LLM
    # Ctrl-C reaches the whole process group: the server, not this process, decides when
    # the engine stops (it sends "shutdown" after its graceful shutdown).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        llm = LLM(model, **kwargs)
    except BaseException as exc:
        events.send(("failed", _picklable(exc)))
        return
    # The model, KV block tables and caches live as long as the process: keep them out of
    # the collector's full passes, which would otherwise pause the loop while it serves.
    gc.collect()
    gc.freeze()
    events.send(("ready", {"max_seq_len": llm.max_seq_len, "stats": llm.get_stats()}))
    _EngineServer(llm, events).run(commands)


class _EngineServer:
    """Runs commands on the LLM (main thread) and streams its deltas back (sender thread)."""

    def __init__(self, llm, events) -> None:
        self.llm = llm
        self.events = events
        self.sink: queue.Queue = queue.Queue()      # (engine result, delta) from the loop
        self.results: dict[str, GenerationResult] = {}
        self.finished_ids: queue.SimpleQueue = queue.SimpleQueue()
        self.num_received = 0
        self.sender = threading.Thread(target=self._send_deltas, name="tllm-engine-sender",
                                       daemon=True)

    def run(self, commands) -> None:
        self.sender.start()
        try:
            while True:
                try:
                    message = commands.recv()
                except (EOFError, OSError):
                    break
                self._forget_finished()
                if message[0] == "submit":
                    self._submit(*message[1:])
                elif message[0] == "abort":
                    result = self.results.get(message[1])
                    if result is not None:
                        result.abort()
                elif message[0] == "shutdown":
                    break
        finally:
            self.sink.put(None)         # the sender stops first: it reads the LLM's stats
            self.sender.join(timeout=5)
            self.events.close()
            self.llm.shutdown()

    def _submit(self, batch_id: int, items: list, streaming: bool) -> None:
        submitted = []
        try:
            for request_id, prompt, params in items:
                submitted.append(self.llm._submit(prompt, params, streaming, sink=self.sink,
                                                  request_id=request_id))
        except Exception as exc:
            for result in submitted:
                result.abort()
            self._post(("rejected", batch_id, _picklable(exc)))
        else:
            for result in submitted:
                self.results[result.request_id] = result
            self._post(("accepted", batch_id))
        self.num_received += len(items)

    def _forget_finished(self) -> None:
        while True:
            try:
                self.results.pop(self.finished_ids.get_nowait(), None)
            except queue.Empty:
                return

    def _send_deltas(self) -> None:
        """Everything the loop posted since the last send, as one message; stats alone
        every HEARTBEAT_S while nothing happens."""
        num_finished: dict[str, int] = {}
        stopping = False
        while not stopping:
            try:
                items = [self.sink.get(timeout=HEARTBEAT_S)]
            except queue.Empty:
                items = []
            while True:
                try:
                    items.append(self.sink.get_nowait())
                except queue.Empty:
                    break
            stopping = None in items
            deltas, done = [], []
            for item in items:
                if item is None:
                    continue
                result, delta = item
                deltas.append((result.request_id, delta))
                if delta.finish_reason is not None:
                    count = num_finished.get(result.request_id, 0) + 1
                    num_finished[result.request_id] = count
                    if count == result.num_samples:
                        del num_finished[result.request_id]
                        done.append(result.request_id)
                        self.finished_ids.put(result.request_id)
            stats = {"stats": self.llm.get_stats(), "alive": self.llm.is_alive,
                     "num_received": self.num_received}
            self._post(("deltas", deltas, done, stats))

    _post_lock = threading.Lock()

    def _post(self, message: tuple) -> None:
        with self._post_lock:
            try:
                self.events.send(message)
            except (OSError, ValueError):    # the server has gone
                pass


def _picklable(exc: BaseException) -> BaseException:
    """exc if it survives pickling, else a RuntimeError carrying its text."""
    import pickle
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
