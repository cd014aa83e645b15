"""ProcessLLM: an LLM whose engine runs in a process of its own, for the server.

In one process, the HTTP/SSE work of hundreds of streams and the executor loop share one GIL,
and the loop gets only part of it (the H200 server delivered 44% of the offline throughput).
Here the server process keeps HTTP, JSON and tokenization; a spawned engine process runs
`LLM` (executor loop, detokenization) and talks to it over two pipes:

    server -> engine  ("submit", batch_id, [(request_id, inputs, params)])
                      | ("abort", [request_id, ...]) | ("shutdown",)
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

If the engine process dies, its pipe closes: the receiver thread sees it at once, every open
request of that process ends with EngineDeadError, and so do submissions, until `restart()`
starts a new process in its place (the server's supervisor decides whether and when).
"""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import pickle
import threading
from typing import Any, Sequence

from tllm.llmapi.flag_aliases import llm_args
from tllm.config import LlmArgs
from tllm.llmapi.engine_process import HEARTBEAT_S, _num_sequences, engine_main
from tllm.llmapi.process_rollout import RolloutCalls
from tllm.llmapi.pooling_methods import ProcessPoolingMethods
from tllm.llmapi.result import DeltaStream
from tllm.llmapi.rollout import RolloutMethods
from tllm.log import active_settings
from tllm.outputs import CompletionDelta
from tllm.sampling_params import SamplingParams

_SHUTDOWN_TIMEOUT_S = 60.0


class EngineDeadError(RuntimeError):
    """The engine process has exited: its open requests end with this, and submissions fail
    with it until `restart()`."""


class ProcessLLM(RolloutMethods, ProcessPoolingMethods):
    """The server's handle on an engine process: `submit_batch`, `get_stats`, `is_alive`,
    `tokenizer`, `max_seq_len`, `lora_targets`, `sampling_defaults`, `shutdown` (what the
    server uses of an LLM), and `restart` once the process has died."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.args = llm_args(model, kwargs)     # bad arguments fail here, at once
        self._context = multiprocessing.get_context("spawn")
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._lifecycle = threading.Lock()     # a restart and shutdown, one at a time
        self._engine, ready = self._start_engine()
        self.max_seq_len: int = ready["max_seq_len"]
        self.takes_images: bool = ready["takes_images"]
        self.disagg_info: dict[str, str] | None = ready.get("disagg_info")
        self.lora_targets = ready.get("lora_targets")   # tllm.lora.adapter.LoraTargets | None
        self.tokenizer = _unpickled_tokenizer(ready["tokenizer"], self.args)
        # generation_config.json's defaults (LLM.sampling_defaults): the server applies them
        self.sampling_defaults: dict[str, float | int] = ready["sampling_defaults"]
        self.task: str = ready["task"]                  # "generate" or a pooling task
        self.pooling_info: dict = ready["pooling_info"]

    # ---- what the server uses ----

    @property
    def is_alive(self) -> bool:
        return not self._closed and self._engine.is_alive()

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._engine.process.pid

    @property
    def exitcode(self) -> int | None:
        """The engine process's exit code (None while it runs; -N: killed by signal N)."""
        return self._engine.process.exitcode

    def get_stats(self) -> dict[str, int]:
        """The engine's latest stats (at most HEARTBEAT_S old); submissions it has not
        received yet count as waiting."""
        engine = self._engine
        stats = dict(engine.stats["stats"])
        in_flight = engine.num_sent - engine.stats["num_received"]
        stats["num_waiting"] = stats.get("num_waiting", 0) + max(0, in_flight)
        return stats

    async def submit_batch(self, inputs: Sequence[dict], sampling_params: Sequence[SamplingParams],
                           streaming: bool = False) -> list[DeltaStream]:
        """Submit prompts ({"prompt_token_ids", "prompt"}) all or none; raises the engine's
        ValueError if it refuses one, EngineDeadError if the engine process has exited. One
        DeltaStream per prompt."""
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        self._loop = asyncio.get_running_loop()
        for params in sampling_params:
            if not isinstance(params, SamplingParams):
                raise ValueError("sampling_params must be SamplingParams, got "
                                 f"{type(params).__name__}")
        engine = self._engine
        batch_id = next(self._ids)
        items = [(f"r{next(self._ids)}", prompt, params)
                 for prompt, params in zip(inputs, sampling_params, strict=True)]
        streams = [self._new_stream(engine, *item, streaming) for item in items]
        accepted = self._loop.create_future()
        engine.pending[batch_id] = accepted
        sent = False
        try:
            engine.send(("submit", batch_id, items))
            engine.num_sent += _num_sequences(items)
            sent = True
            await accepted
        except BaseException:
            for request_id, _, _ in items:
                engine.streams.pop(request_id, None)
                if sent:    # e.g. the caller was cancelled: the engine may run them anyway
                    self._abort(engine, request_id)
            raise
        finally:
            engine.pending.pop(batch_id, None)
        return streams

    def _new_stream(self, engine: _EngineProcess, request_id: str, prompt: dict,
                    params: SamplingParams, streaming: bool) -> DeltaStream:
        """The caller's side of a request, registered to receive its deltas (a prompt with
        images has its token ids made in the engine process: none here)."""
        stream = DeltaStream(request_id, prompt.get("prompt"),
                             prompt.get("prompt_token_ids", []), params, streaming,
                             abort=lambda: self._abort(engine, request_id))
        engine.streams[request_id] = stream
        return stream

    def _rollout_call(self, name: str, *args):
        """Sleep, wake, weight updates: run in the engine process (llmapi/process_rollout)."""
        return self._engine.rollout.call(self._engine.send, name, args)

    def restart(self) -> None:
        """Replace the engine process with a new one (the old one has died, or is killed
        here): blocks until the new one is ready, and raises as the constructor does if it
        cannot start. The old one's open requests have ended with EngineDeadError."""
        with self._lifecycle:
            if self._closed:
                raise RuntimeError("this LLM has been shut down")
            self._engine.stop(graceful=False)
            self._engine, ready = self._start_engine()
            self.disagg_info = ready.get("disagg_info")  # a new KV endpoint, if any

    def shutdown(self) -> None:
        """Stop the engine process (it frees the model and KV cache) and wait for it (and
        for a restart in progress first)."""
        with self._lifecycle:
            if self._closed:
                return
            self._closed = True
            self._engine.stop(graceful=True)

    def __enter__(self) -> ProcessLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- plumbing ----

    def _start_engine(self) -> tuple[_EngineProcess, dict]:
        """A new engine process, ready, with its receiver thread; and its "ready" info."""
        commands, engine_commands = self._context.Pipe(duplex=False)[::-1]
        engine_events, events = self._context.Pipe(duplex=False)[::-1]
        process = self._context.Process(
            target=engine_main, name="tllm-engine",  # logging as this process's (tllm.log)
            args=(self.args, engine_commands, engine_events, active_settings()))
        process.start()
        engine_commands.close()
        engine_events.close()
        engine = _EngineProcess(process, commands, events)
        try:
            ready = engine.wait_until_ready()
        except BaseException:
            engine.stop(graceful=False)
            raise
        engine.stats = {"stats": ready["stats"], "alive": True, "num_received": 0}
        engine.receiver = threading.Thread(target=self._receive, args=(engine,),
                                           name="tllm-engine-events", daemon=True)
        engine.receiver.start()
        return engine, ready

    def _abort(self, engine: _EngineProcess, request_id: str) -> None:
        """Aborts asked for in one event-loop turn go to the engine as one message: a burst
        of disconnects would otherwise be a pipe message each, and the engine's main thread
        may wait for the GIL (held by its loop thread) once per message."""
        engine.aborts.append(request_id)
        if len(engine.aborts) > 1:
            return
        try:
            asyncio.get_running_loop().call_soon(engine.send_aborts)
        except RuntimeError:        # not on an event loop: send it now
            engine.send_aborts()

    def _receive(self, engine: _EngineProcess) -> None:
        """Engine messages, handed to the event loop one message per callback; at the end
        (the process exited or was stopped), its open requests fail."""
        while True:
            try:
                message = engine.events.recv()
            except (EOFError, OSError):
                break
            if message[0] == "rollout_done":
                engine.rollout.settle(message)
            elif message[0] == "deltas":
                engine.stats = message[2]
                if message[1]:
                    self._call_in_loop(self._deliver, engine, message[1])
            else:
                self._call_in_loop(self._settle, engine, message)
        engine.stats = {**engine.stats, "alive": False}
        engine.process.join(timeout=1.0)    # its pipe closes as it exits: know its exit code
        engine.rollout.fail_all(EngineDeadError(engine.death_note()))   # (no event loop)
        self._call_in_loop(engine.fail_all)

    def _call_in_loop(self, fn, *args) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:        # the loop is closed: nobody is listening
            pass

    @staticmethod
    def _deliver(engine: _EngineProcess, deltas: list[tuple[str, CompletionDelta]]) -> None:
        for request_id, delta in deltas:
            stream = engine.streams.get(request_id)
            if stream is not None and stream.deliver(delta):
                del engine.streams[request_id]      # its last delta: nothing more comes

    @staticmethod
    def _settle(engine: _EngineProcess, message: tuple) -> None:
        future = engine.pending.get(message[1])
        if future is None or future.done():
            return
        if message[0] == "accepted":
            future.set_result(None)
        else:
            future.set_exception(message[2])


class _EngineProcess:
    """One engine process, its two pipes, what it last reported, and the requests sent to
    it (their handles and submissions waiting for an answer; event loop only)."""

    def __init__(self, process, commands, events) -> None:
        self.process = process
        self.commands = commands        # server -> engine
        self.events = events            # engine -> server
        self.receiver: threading.Thread | None = None
        self.stats: dict[str, Any] = {"stats": {}, "alive": False, "num_received": 0}
        self.num_sent = 0
        self.streams: dict[str, DeltaStream] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self.aborts: list[str] = []     # to send at the end of this event-loop turn
        self.is_gone = False            # its receiver has ended: nothing more comes
        self.rollout = RolloutCalls()   # sleep, wake, weight updates waiting for answers
        self._send_lock = threading.Lock()

    def is_alive(self) -> bool:
        return (self.process.is_alive() and self.receiver is not None
                and self.receiver.is_alive() and self.stats["alive"])

    def wait_until_ready(self) -> dict:
        while not self.events.poll(0.5):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited with code "
                                   f"{self.process.exitcode} while starting")
        try:
            kind, payload = self.events.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError("the engine process exited while starting") from None
        if kind == "failed":
            self.process.join()
            raise payload
        return payload

    def send(self, message: tuple) -> None:
        """Send a command; EngineDeadError if the process has gone."""
        if self.is_gone:
            raise EngineDeadError(self.death_note())
        try:
            with self._send_lock:
                self.commands.send(message)
        except (OSError, ValueError) as exc:    # a broken or closed pipe
            raise EngineDeadError(self.death_note()) from exc

    def send_aborts(self) -> None:
        ids, self.aborts = self.aborts, []
        if ids:
            try:
                self.send(("abort", ids))
            except EngineDeadError:     # nothing runs there any more
                pass

    def fail_all(self) -> None:
        """(Event loop.) Its receiver ended: every open request and submission fails."""
        self.is_gone = True
        error = EngineDeadError(self.death_note())
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.fail(error)

    def death_note(self) -> str:
        code = self.process.exitcode
        return ("the engine process has stopped" if code is None else
                f"the engine process exited with code {code}")

    def stop(self, graceful: bool) -> None:
        """Ask it to shut down (graceful) or kill it; wait for it, close the pipes."""
        if graceful:
            try:
                self.send(("shutdown",))
            except EngineDeadError:
                pass
            self.process.join(_SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.commands.close()
        if self.receiver is not None:
            self.receiver.join(timeout=5)
        self.events.close()


def _unpickled_tokenizer(data: bytes | None, args: LlmArgs):
    """The engine's tokenizer, or, if it did not survive pickling, one loaded here."""
    if data is not None:
        try:
            return pickle.loads(data)
        except Exception:
            pass
    from tllm import loader
    return loader.load_tokenizer(loader.resolve_model(args.model, args.revision,
                                                      args.download_dir))
