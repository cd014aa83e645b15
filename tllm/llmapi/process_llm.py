"""ProcessLLM: an LLM whose engine runs in a process of its own, for the server.

In one process, the HTTP/SSE work of hundreds of streams and the executor loop share one GIL,
and the loop gets only part of it (the H200 server delivered 44% of the offline throughput).
Here the server process keeps HTTP, JSON and tokenization; a spawned engine process runs
`LLM` (executor loop, detokenization) and talks to it over two pipes:

    server -> engine  ("submit", batch_id, [(request_id, inputs, params)]) | ("abort", request_id)
                      | ("shutdown",)
    engine -> server  ("ready", info) | ("failed", exception)       once, at start
                      ("accepted", batch_id) | ("rejected", batch_id, ValueError)
                      ("deltas", [(request_id, CompletionDelta)], stats)

The LLM arguments are validated once, here (a bad one fails at once), and the engine builds
its LLM from them; its tokenizer comes back in "ready" (pickled), so it is loaded once. Request
ids are chosen by the server side, so handles exist before their first delta. The engine
builds no result objects: each request's updates become CompletionDeltas on the executor
thread (LLM.add_request), which a sender thread batches into one message per send (stats at
least every HEARTBEAT_S). The server side holds a DeltaStream per request and hands it the
deltas as they are, one message per event-loop callback. Validation stays where it is (the
engine's LLM): a refused prompt comes back as the ValueError.
"""
from __future__ import annotations

import asyncio
import gc
import itertools
import multiprocessing
import pickle
import queue
import signal
import threading
from typing import Any, Callable, Sequence

from tllm.llmapi.llm_args import LlmArgs
from tllm.llmapi.result import DeltaStream
from tllm.outputs import CompletionDelta
from tllm.sampling_params import SamplingParams

HEARTBEAT_S = 0.1
_SHUTDOWN_TIMEOUT_S = 60.0


class ProcessLLM:
    """The server's handle on an engine process: `submit_batch`, `get_stats`, `is_alive`,
    `tokenizer`, `max_seq_len`, `shutdown` (what the server uses of an LLM)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.args = LlmArgs(model=model, **kwargs)     # bad arguments fail here, at once
        context = multiprocessing.get_context("spawn")
        self._commands, engine_commands = context.Pipe(duplex=False)[::-1]
        engine_events, self._events = context.Pipe(duplex=False)[::-1]
        self._process = context.Process(
            target=engine_main, args=(self.args, engine_commands, engine_events),
            name="tllm-engine")
        self._process.start()
        engine_commands.close()
        engine_events.close()
        ready = self._wait_until_ready()
        self.max_seq_len: int = ready["max_seq_len"]
        self.tokenizer = _unpickled_tokenizer(ready["tokenizer"], model)
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._streams: dict[str, DeltaStream] = {}
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
                           streaming: bool = False) -> list[DeltaStream]:
        """Submit prompts ({"prompt_token_ids", "prompt"}) all or none; raises the engine's
        ValueError if it refuses one. One DeltaStream per prompt."""
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
        streams = [self._new_stream(*item, streaming) for item in items]
        accepted = self._loop.create_future()
        self._pending[batch_id] = accepted
        sent = False
        try:
            self._send(("submit", batch_id, items))
            self._num_sent += len(items)
            sent = True
            await accepted
        except BaseException:
            for request_id, _, _ in items:
                self._streams.pop(request_id, None)
                if sent:    # e.g. the caller was cancelled: the engine may run them anyway
                    self._abort_quietly(request_id)
            raise
        finally:
            self._pending.pop(batch_id, None)
        return streams

    def _new_stream(self, request_id: str, prompt: dict, params: SamplingParams,
                    streaming: bool) -> DeltaStream:
        """The caller's side of a request, registered to receive its deltas."""
        stream = DeltaStream(request_id, prompt.get("prompt"), prompt["prompt_token_ids"],
                             params, streaming, abort=lambda: self._abort_quietly(request_id))
        self._streams[request_id] = stream
        return stream

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
                self._stats = message[2]
                if message[1]:
                    self._call_in_loop(self._deliver, message[1])
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

    def _deliver(self, deltas: list[tuple[str, CompletionDelta]]) -> None:
        for request_id, delta in deltas:
            stream = self._streams.get(request_id)
            if stream is not None and stream.deliver(delta):
                del self._streams[request_id]       # its last delta: nothing more comes

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


def engine_main(args: LlmArgs, commands, events) -> None:
    """The engine process: build the LLM, then serve commands until shutdown or until the
    server's end of the pipe closes (the server died)."""
    from tllm.llmapi.llm import LLM
    # Ctrl-C reaches the whole process group: the server, not this process, decides when
    # the engine stops (it sends "shutdown" after its graceful shutdown).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        llm = LLM.from_args(args)
    except BaseException as exc:
        events.send(("failed", _picklable(exc)))
        return
    # The model, KV block tables and caches live as long as the process: keep them out of
    # the collector's full passes, which would otherwise pause the loop while it serves.
    gc.collect()
    gc.freeze()
    events.send(("ready", {"max_seq_len": llm.max_seq_len, "stats": llm.get_stats(),
                           "tokenizer": _pickled_tokenizer(llm.tokenizer)}))
    _EngineServer(llm, events).run(commands)


class _EngineServer:
    """Runs commands on the LLM (main thread) and streams its deltas back (sender thread)."""

    def __init__(self, llm, events) -> None:
        self.llm = llm
        self.events = events
        self.sink: queue.SimpleQueue = queue.SimpleQueue()  # (request id, delta), from the loop
        self.aborts: dict[str, Callable[[], None]] = {}     # of unfinished requests
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
                    abort = self.aborts.get(message[1])
                    if abort is not None:
                        abort()
                elif message[0] == "shutdown":
                    break
        finally:
            self.sink.put(None)         # the sender stops first: it reads the LLM's stats
            self.sender.join(timeout=5)
            self.events.close()
            self.llm.shutdown()

    def _submit(self, batch_id: int, items: list) -> None:
        aborts = {}
        try:
            for request_id, prompt, params in items:
                relay = _Relay(request_id, params.n, self.sink, self.finished_ids)
                aborts[request_id] = self.llm.add_request(prompt, params, request_id, relay)
        except Exception as exc:
            for abort in aborts.values():
                abort()
            self._post(("rejected", batch_id, _picklable(exc)))
        else:
            self.aborts.update(aborts)
            self._post(("accepted", batch_id))
        self.num_received += len(items)

    def _forget_finished(self) -> None:
        while True:
            try:
                self.aborts.pop(self.finished_ids.get_nowait(), None)
            except queue.Empty:
                return

    def _send_deltas(self) -> None:
        """Everything the loop posted since the last send, as one message; stats alone
        every HEARTBEAT_S while nothing happens."""
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
            deltas = [item for item in items if item is not None]
            stats = {"stats": self.llm.get_stats(), "alive": self.llm.is_alive,
                     "num_received": self.num_received}
            self._post(("deltas", deltas, stats))

    _post_lock = threading.Lock()

    def _post(self, message: tuple) -> None:
        with self._post_lock:
            try:
                self.events.send(message)
            except (OSError, ValueError):    # the server has gone
                pass


class _Relay:
    """One prompt's on_delta (executor thread): its deltas go to the sender as they are, and
    its id to `finished` once every sample has ended."""

    __slots__ = ("request_id", "num_unfinished", "sink", "finished")

    def __init__(self, request_id: str, num_samples: int, sink: queue.SimpleQueue,
                 finished: queue.SimpleQueue) -> None:
        self.request_id = request_id
        self.num_unfinished = num_samples
        self.sink = sink
        self.finished = finished

    def __call__(self, delta: CompletionDelta) -> None:
        if delta.error is not None:      # it crosses the pipe: send what pickles
            delta.error = _picklable(delta.error)
        self.sink.put((self.request_id, delta))
        if delta.finish_reason is not None:
            self.num_unfinished -= 1
            if self.num_unfinished == 0:
                self.finished.put(self.request_id)


def _pickled_tokenizer(tokenizer) -> bytes | None:
    """The engine's tokenizer (or None) pickled for the server (HF fast tokenizers pickle:
    about 1.5 MB and 70 ms to load for SmolLM2's); None if it does not pickle."""
    try:
        return pickle.dumps(tokenizer)
    except Exception:
        return None


def _unpickled_tokenizer(data: bytes | None, model: str):
    """The engine's tokenizer, or, if it did not survive pickling, one loaded here."""
    if data is not None:
        try:
            return pickle.loads(data)
        except Exception:
            pass
    from tllm import loader
    return loader.load_tokenizer(loader.resolve_model(model))


def _picklable(exc: BaseException) -> BaseException:
    """exc if it survives pickling, else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
