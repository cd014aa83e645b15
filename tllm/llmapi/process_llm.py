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
import queue
import signal
import threading
from typing import Any, Callable, Sequence

from tllm.llmapi.flag_aliases import llm_args
from tllm.config import LlmArgs
from tllm.gc_heap import frozen_heap
from tllm.llmapi.process_rollout import RolloutCalls, run_rollout_call
from tllm.llmapi.pooling_methods import ProcessPoolingMethods
from tllm.llmapi.result import DeltaStream
from tllm.llmapi.rollout import RolloutMethods
from tllm.log import LogSettings, active_settings, apply_settings
from tllm.outputs import CompletionDelta
from tllm.sampling_params import SamplingParams

HEARTBEAT_S = 0.1
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


def engine_main(args: LlmArgs, commands, events, log_settings: LogSettings | None = None) -> None:
    """The engine process: build the LLM, then serve commands until shutdown or until the
    server's end of the pipe closes (the server died)."""
    from tllm.llmapi.llm import LLM
    apply_settings(log_settings)
    # Ctrl-C reaches the whole process group: the server decides when the engine stops
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        llm = LLM.from_args(args)
    except BaseException as exc:
        events.send(("failed", _picklable(exc)))
        return
    # The model, KV block tables and caches live as long as the process: keep them out of
    # the collector's full passes, which would otherwise pause the loop while it serves.
    with frozen_heap():
        events.send(("ready", {"max_seq_len": llm.max_seq_len, "stats": llm.get_stats(),
                               "takes_images": llm.takes_images,
                               "disagg_info": llm.disagg_info,
                               "lora_targets": llm.lora_targets,
                               "sampling_defaults": llm.sampling_defaults,
                               "task": llm.task, "pooling_info": llm.pooling_info,
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
                elif message[0] == "encode":
                    self._encode(*message[1:])
                elif message[0] == "abort":     # applied at once: each reaches the loop's
                    for request_id in message[1]:   # inbox, drained between steps
                        abort = self.aborts.get(request_id)
                        if abort is not None:
                            abort()
                elif message[0] == "rollout":
                    run_rollout_call(self.llm, *message[1:], answer=lambda i, r, e: self._post(
                        ("rollout_done", i, r, e if e is None else _picklable(e))))
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
        self.num_received += _num_sequences(items)

    def _encode(self, request_id: str, prompt, params) -> None:
        def on_done(item) -> None:  # (output thread) its one message back
            self.sink.put((request_id, _picklable(item) if isinstance(item, Exception)
                           else item))
            self.finished_ids.put(request_id)
        self.aborts[request_id] = self.llm.add_pooling_request(prompt, params, request_id,
                                                               on_done)
        self.num_received += 1

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


def _num_sequences(items: list) -> int:
    """The engine's requests for these (id, prompt, params) items: n, best_of or the beams
    each (the engine's num_waiting counts these)."""
    return sum(params.num_sequences for _, _, params in items)


def _picklable(exc: BaseException) -> BaseException:
    """exc if it survives pickling, else a RuntimeError carrying its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
