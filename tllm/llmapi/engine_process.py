"""The engine process of ProcessLLM (tllm.llmapi.process_llm, which describes the protocol):
build the LLM, then run the server's commands on it (main thread) and stream its deltas back
(a sender thread), until shutdown or until the server's end of the pipe closes."""
from __future__ import annotations

import pickle
import queue
import signal
import threading
from typing import Callable

from tllm.config import LlmArgs
from tllm.gc_heap import frozen_heap
from tllm.llmapi.process_rollout import run_rollout_call
from tllm.log import LogSettings, apply_settings
from tllm.outputs import CompletionDelta

HEARTBEAT_S = 0.1   # stats alone at least this often while nothing happens


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
