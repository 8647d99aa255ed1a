"""AsyncLLMEngine: an LLMEngine driven by a background loop thread, with a stream per request.

Any thread may call generate() or submit(); the request joins the running batch at the next step
(in-flight batching). generate() returns a plain iterator of RequestOutput, fed through a
queue.Queue, so it is safe to consume from the thread that created it while the loop runs.
submit() takes a callback instead: one delivery thread calls the callbacks of every request
that changed in a step, in step order, so a server needs one thread for all its requests rather
than one per request, and the loop never waits for a slow consumer. When that thread falls
behind (several steps queued), it merges each request's queued outputs into one (coalesce_outputs:
the new token ids and text deltas joined in order, the rest as of the latest step), so a slow
consumer gets fewer, larger responses rather than a growing backlog.
"""
from __future__ import annotations

import ctypes
import dataclasses
import queue
import sys
import threading
import traceback
from typing import Callable, Dict, Iterator, List, Optional, Union

from .engine import LLMEngine
from .placement import bind_thread
from .errors import TritiumError
from .sampling_params import SamplingParams
from .sequence import RequestOutput


def name_os_thread(name: str) -> None:
    """Give the calling thread its Python name in the OS too (Linux: the first 15 bytes), so
    `top -H`, `perf` and /proc/PID/task/TID/comm tell the engine loop, the delivery thread and
    the server's housekeeping apart from the stub's own threads. A no-op where it cannot."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One RequestOutput for two consecutive steps' outputs of a request: per sample, the new
    token ids and text deltas of both in order, everything else (all ids and text so far, log
    probs, finish reason) as of `b`; a sample only `a` reported stays as `a` reported it."""
    samples = {c.index: c for c in a.outputs}
    for c in b.outputs:
        prev = samples.get(c.index)
        if prev is not None:
            c = dataclasses.replace(c, new_token_ids=list(prev.new_token_ids or ()) + list(c.new_token_ids or ()),
                                    text_delta=(prev.text_delta or "") + (c.text_delta or ""))
        samples[c.index] = c
    return dataclasses.replace(b, outputs=list(samples.values()))


def coalesce_outputs(batches: List[list]) -> list:
    """Several steps' [(callback, output or error)] -> one list, each callback's items in order
    with consecutive RequestOutputs merged (merge_outputs); errors are never merged."""
    per_fn: Dict[Callable, list] = {}
    for batch in batches:
        for fn, item in batch:
            items = per_fn.setdefault(fn, [])
            if items and isinstance(item, RequestOutput) and isinstance(items[-1], RequestOutput):
                items[-1] = merge_outputs(items[-1], item)
            else:
                items.append(item)
    return [(fn, item) for fn, items in per_fn.items() for item in items]


class EngineDeadError(TritiumError, RuntimeError):
    """The loop thread hit an internal error; pending requests are failed with it."""

    code = "unavailable"


class EngineOverloadedError(TritiumError, RuntimeError):
    """The waiting queue is full (max_queue_size): the request was not added; retry later."""

    code = "overloaded"


class AsyncLLMEngine:
    """Thread-safe wrapper: generate() streams, abort() cancels, stats() snapshots."""

    def __init__(self, engine_dir: Optional[str] = None, *, engine: Optional[LLMEngine] = None,
                 max_queue_size: Optional[int] = None, coalesce: bool = False, **kwargs):
        if max_queue_size is not None and (isinstance(max_queue_size, bool) or not isinstance(max_queue_size, int)
                                           or max_queue_size < 1):
            raise ValueError(f"max_queue_size must be an integer >= 1 or None, got {max_queue_size!r}")
        self.engine = engine if engine is not None else LLMEngine(engine_dir, **kwargs)
        self.max_queue_size = max_queue_size  # most requests waiting for a first step; None = no bound
        self.num_rejected = 0                 # requests refused because the queue was full
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.config
        self._cv = threading.Condition()
        # request id -> its queue (generate) or callback (submit)
        self._streams: Dict[str, Union["queue.Queue", Callable]] = {}
        self._deliveries: "queue.Queue" = queue.Queue()  # per step: [(callback, output or error)]
        self._delivery_thread: Optional[threading.Thread] = None
        self.coalesce = bool(coalesce)  # merge a lagging delivery's queued outputs per request
        self.num_coalesced = 0          # outputs merged into another (responses saved)
        self._stopped = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name="tritium-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API
    def generate(self, request_id: str, prompt: Optional[str] = None, prompt_token_ids: Optional[List[int]] = None,
                 params: Optional[SamplingParams] = None, priority: int = 0,
                 **lora) -> Iterator[RequestOutput]:
        """Add a request and return its stream (lora: lora_name= or lora_task_id=, see
        LLMEngine.add_request). Bad input raises ValueError here, before streaming."""
        q: "queue.Queue" = queue.Queue()
        with self._cv:
            self._check_admission()
            self.engine.add_request(request_id, prompt=prompt, prompt_token_ids=prompt_token_ids,
                                    params=params, priority=priority, **lora)
            self._streams[request_id] = q
            self._cv.notify()
        return self._stream(request_id, q)

    def submit(self, request_id: str, prompt_token_ids: List[int], params: SamplingParams,
               on_output: Callable[[Union[RequestOutput, BaseException]], None], priority: int = 0,
               **lora) -> None:
        """Add a request whose outputs go to on_output(output), called from the delivery thread;
        an engine failure calls on_output(error). Bad input raises ValueError here."""
        with self._cv:
            self._check_admission()
            if self._delivery_thread is None:
                self._delivery_thread = threading.Thread(target=self._deliver_loop, name="tritium-deliver",
                                                         daemon=True)
                self._delivery_thread.start()
            self.engine.add_request(request_id, prompt_token_ids=prompt_token_ids, params=params,
                                    priority=priority, **lora)
            self._streams[request_id] = on_output
            self._cv.notify()

    def _deliver_loop(self) -> None:
        name_os_thread("tritium-deliver")
        while True:
            batch = self._deliveries.get()
            if batch is None:
                return
            stop = False
            if self.coalesce:
                batches = [batch]
                while True:  # every step queued behind it
                    try:
                        more = self._deliveries.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stop = True
                        break
                    batches.append(more)
                if len(batches) > 1:
                    batch = coalesce_outputs(batches)
                    self.num_coalesced += sum(map(len, batches)) - len(batch)
            for fn, item in batch:
                try:
                    fn(item)
                except Exception:  # a consumer's bug must not stop deliveries to the others
                    traceback.print_exc()
            if stop:
                return

    def _check_admission(self) -> None:
        """Under self._cv: raise if the engine cannot take a new request."""
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}")
        if self._stopped:
            raise EngineDeadError("engine is shut down")
        waiting = len(self.engine.scheduler.waiting)
        if self.max_queue_size is not None and waiting >= self.max_queue_size:
            self.num_rejected += 1
            raise EngineOverloadedError(f"overloaded: {waiting} requests are waiting (max_queue_size "
                                        f"{self.max_queue_size}); retry later")

    @property
    def is_healthy(self) -> bool:
        """False once the loop thread died (every request since fails with the cause) or stopped,
        or a tensor-parallel worker failed (the next step fails with the cause)."""
        return self._error is None and not self._stopped and self.engine.failure is None

    @property
    def failure(self) -> Optional[str]:
        """Why the engine cannot serve (the loop's error, or a tensor-parallel worker's), or None."""
        return repr(self._error) if self._error is not None else self.engine.failure

    def _stream(self, request_id: str, q: "queue.Queue") -> Iterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:  # consumer went away (or error): free the request's blocks
                self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its stream ends with finish_reason "abort"."""
        with self._cv:
            ok = self.engine.abort(request_id)
            self._cv.notify()
            return ok

    def stats(self) -> dict:
        with self._cv:
            return self.engine.stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; unfinished streams get an error."""
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout)
        self._fail_all(RuntimeError("engine shut down"))
        self.engine.close()  # tensor parallelism: stops the worker processes
        if self._delivery_thread is not None:
            self._deliveries.put(None)
            self._delivery_thread.join(timeout)

    # ------------------------------------------------------------------ loop
    def _fail_all(self, err: BaseException) -> None:
        with self._cv:
            streams, self._streams = self._streams, {}
            self.engine.abort_all()
        callbacks = []
        for sink in streams.values():
            if isinstance(sink, queue.Queue):
                sink.put(err)
            else:
                callbacks.append((sink, err))
        if callbacks:
            self._deliveries.put(callbacks)

    def _loop(self) -> None:
        bind_thread(self.engine.device)  # Triton kernels launch on the thread's current device
        name_os_thread("tritium-loop")
        while True:
            with self._cv:
                while not self._stopped and not self.engine.has_unfinished():
                    self._cv.wait()
                if self._stopped:
                    return
                try:
                    outputs = self.engine.step()
                except BaseException as e:  # an internal bug must not hang every client
                    self._error = e
                    outputs = None
                queued, callbacks = [], []
                for out in outputs or []:
                    sink = self._streams.get(out.request_id)
                    if sink is not None:
                        (queued if isinstance(sink, queue.Queue) else callbacks).append((sink, out))
                        if out.finished:
                            del self._streams[out.request_id]
            if outputs is None:
                self._fail_all(EngineDeadError(f"engine step failed: {self._error!r}"))
                return
            for q, out in queued:
                q.put(out)
            if callbacks:
                self._deliveries.put(callbacks)
