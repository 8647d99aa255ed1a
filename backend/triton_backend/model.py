"""The `tritium` Triton Python-based backend: decoupled, in-flight-batched LLM serving.

Installed as `<backend-dir>/tritium/model.py` (see tritium.client.serve.server), so a model's
config.pbtxt says `backend: "tritium"` and carries no model.py of its own. Parameters:
`engine_dir` (absolute, or relative to the model's folder; `~` expands; $VARS do not), and the
engine options of backend/engine_options.py (num_kv_blocks, max_num_seqs, max_queue_size,
num_threads, small_step_threads, threads_per_rank, speculative_method, draft_engine_dir,
num_speculative_tokens, ...: one table for this backend, `tritium build --repo` and `tritium
generate`). See docs/tensor-parallel.md and docs/speculative.md.

One AsyncLLMEngine per model instance runs its own background loop; every request that any
execute() call hands over joins the running batch at the next engine step. The engine's one
delivery thread turns each step's outputs into responses (stream.py; tensor contract:
contract.py). A housekeeping thread polls cancellation of the open requests, a few every
CANCEL_POLL_S (a cancelled request is aborted within about two engine steps, waiting or not), and
copies the engine's stats into the gauges (those that changed) and flushes the metrics every
STATS_PERIOD_S: each of those is an IPC round trip to the server, kept off the per-token path.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
import uuid

import triton_python_backend_utils as pb_utils


def _honor_pythonpath(environ=os.environ, path=sys.path) -> None:
    """The Python backend's stub runs its interpreter isolated (sys.flags.isolated: PYTHONPATH is
    ignored), so without this the stub imports the tritium package its Python has installed while
    this model.py is the copy from the tritium that `tritium serve` runs (server.py installs it):
    with PYTHONPATH pointing at another tree (a checkout, a worktree), the two would differ. Its
    entries go first on sys.path, as in the process that started the server."""
    entries = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for p in reversed(entries):
        if p in path:
            path.remove(p)
        path.insert(0, p)


_honor_pythonpath()

from tritium.backend.async_engine import AsyncLLMEngine, name_os_thread
from tritium.backend.chat_template import ChatTemplate, NoChatTemplateError
from tritium.backend.config import EngineConfig
from tritium.backend.engine_options import engine_setup, options_from_params
from tritium.backend.lora.setup import resolve_request_lora
from tritium.backend.placement import apply_instance_placement
from tritium.backend.prompt_limits import encode_prompt, max_token_chars
from tritium.backend.errors import RequestError, error_info, to_wire
from tritium.backend.guided import state as guided_state
from tritium.backend.triton_backend.contract import OUTPUT_NAMES_PARAMETER, output_names_parameter, resolve_path
from tritium.backend.triton_backend.metrics import TritiumMetrics
from tritium.backend.triton_backend.request import batch_size_of, error_prefix, parse_row
from tritium.backend.triton_backend.stream import RequestState, RowStream
from tritium.backend.triton_backend.tensor_cache import TensorCache

# Gauges and metric flushes. engine.stats() holds the engine's lock (the next step waits for it)
# and each gauge set is an IPC round trip: at 0.05 s this thread took 0.2 ms of CPU per token of
# a single stream, all of it taken from the engine step on 2 cores.
STATS_PERIOD_S = 0.25
CANCEL_POLL_S = 0.02    # is_cancelled() of open requests (one IPC round trip each) ...
CANCEL_CHECKS_PER_POLL = 4  # ... at most this many per poll, in turn: a cancelled request of n
# open ones is seen within ceil(n / 4) polls (at concurrency 16, 80 ms: under two of its steps),
# while the checks cost the step's cores at most 200 round trips a second


def _log_params(path: str, rows) -> None:
    """TRITIUM_REQUEST_LOG: one JSON line per admitted row, the SamplingParams the engine gets
    (tests/test_request_walkthrough.py reads it to follow a field from every surface)."""
    with open(path, "a", encoding="utf-8") as f:
        for _, _, sp in rows:
            f.write(json.dumps(dataclasses.asdict(sp)) + "\n")


def _tensor_parallel_size(engine_dir: str) -> int:
    try:
        return EngineConfig.load(engine_dir).tensor_parallel_size
    except Exception:  # the engine load reports it properly
        return 1


def _coalesce(params: dict) -> bool:
    """Parameter coalesce_responses (default false: one response per engine step and stream, as
    the TensorRT-LLM contract's streaming clients expect): when true and the delivery thread falls
    behind the engine, a stream's queued tokens go out in one response
    (docs/serving.md#per-token-work-beside-the-step)."""
    v = (params.get("coalesce_responses") or "false").strip().lower()
    if v not in ("true", "false", "1", "0"):
        raise ValueError(f"parameter coalesce_responses must be true or false, got {v!r}")
    return v in ("true", "1")


# The stub's GIL switch interval (sys.setswitchinterval): how long a thread that wants the GIL
# waits before the holder must give it up. The engine loop's Python part of each step waits for
# the GIL whenever the delivery or housekeeping thread holds it (pb_utils calls keep it through
# their IPC round trips). The default stays Python's own, 5000 us: 200 us measured no better
# within the noise of a shared host once the metric bursts were gone (docs/benchmarks.md
# "Server overhead per token"), and one stub crashed at load with it (docs/serving.md).
DEFAULT_SWITCH_INTERVAL_US = 5000
SWITCH_INTERVAL_RANGE_US = (20, 100000)


def _switch_interval_us(params: dict) -> float:
    """Parameter gil_switch_interval_us (default DEFAULT_SWITCH_INTERVAL_US; 5000 is Python's
    own default), docs/serving.md#per-token-work-beside-the-step."""
    raw = (params.get("gil_switch_interval_us") or "").strip()
    if not raw:
        return float(DEFAULT_SWITCH_INTERVAL_US)
    lo, hi = SWITCH_INTERVAL_RANGE_US
    try:
        v = float(raw)
    except ValueError:
        v = float("nan")
    if not lo <= v <= hi:  # also NaN
        raise ValueError(f"parameter gil_switch_interval_us must be a number of microseconds in [{lo}, {hi}], "
                         f"got {raw!r}")
    return v


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        name, version = args["model_name"], args["model_version"]
        if not pb_utils.using_decoupled_model_transaction_policy(self.model_config):
            raise pb_utils.TritonModelException(
                f"tritium: model '{name}' must set model_transaction_policy {{ decoupled: true }}")
        params = {k: v.get("string_value", "") for k, v in self.model_config.get("parameters", {}).items()}
        if not params.get("engine_dir", "").strip():
            raise pb_utils.TritonModelException(f"tritium: model '{name}' needs parameter engine_dir")
        model_dir = args["model_repository"]  # the model folder (repository/NAME)
        engine_dir = resolve_path(params["engine_dir"], model_dir)
        try:
            switch_us = _switch_interval_us(params)
            sys.setswitchinterval(switch_us / 1e6)  # this stub process serves this model instance only
            setup = engine_setup(options_from_params(params), model_dir, _tensor_parallel_size(engine_dir),
                                 server=True)
            if not os.path.isdir(engine_dir):
                raise FileNotFoundError(f"engine_dir {engine_dir} does not exist")
            # KIND_GPU -> cuda:<model_instance_device_id> (docs/serving.md#placement)
            apply_instance_placement(args, self.model_config, setup.engine_kwargs)
            self.engine = AsyncLLMEngine(engine_dir, max_queue_size=setup.max_queue_size,
                                         thread_policy=setup.thread_policy, coalesce=_coalesce(params),
                                         **setup.engine_kwargs)
            guided_state.warm_up(self.engine.engine)  # structured outputs: vocabulary tables, in the background
        except Exception as e:  # one line in the server log, not a traceback through the stub
            raise pb_utils.TritonModelException(
                f"tritium: cannot load engine for model '{name}' from {engine_dir}: {type(e).__name__}: "
                f"{' '.join(str(e).split())}") from None
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self._request_log = os.environ.get("TRITIUM_REQUEST_LOG") or None
        self.chat_template, self._chat_template_error = None, None
        try:
            self.chat_template = ChatTemplate.from_engine_dir(engine_dir)
        except ValueError as e:  # no template (or a broken one): chat requests fail with this message
            self._chat_template_error = f"model '{name}': {e}"
        self._token_chars = max_token_chars(self.tokenizer) if self.tokenizer is not None else 1
        self.metrics = TritiumMetrics(pb_utils, name, version)
        self.tensors = TensorCache(pb_utils.Tensor)  # the delivery thread's repeated small outputs
        self._rows_lock = threading.Lock()
        self._rows = {}  # open RowStreams (keys, in arrival order), polled for cancellation
        self._cancel_cursor = 0
        self._reported_dead = False
        self._stop = threading.Event()
        pb_utils.Logger.log_info(f"tritium: model '{name}' serving engine {engine_dir} "
                                 f"({self.config.model.architecture}, {self.config.dtype}; "
                                 f"GIL switch interval {round(sys.getswitchinterval() * 1e6)} us; "
                                 f"tritium.backend from {os.path.dirname(sys.modules['tritium.backend'].__file__)})")
        # Last: initialize's own IPC (the log line above) is over before this thread's begins.
        self._stats_thread = threading.Thread(target=self._stats_loop, name="tritium-stats", daemon=True)
        self._stats_thread.start()

    # ---- housekeeping: cancellation, engine stats -> gauges, metric flushes ------------------
    def _stats_loop(self):
        name_os_thread("tritium-stats")
        last_stats = 0.0
        while not self._stop.wait(CANCEL_POLL_S):
            self._poll_cancelled()
            now = time.monotonic()
            if now - last_stats >= STATS_PERIOD_S:
                last_stats = now
                self._update_stats()

    def _poll_cancelled(self):
        with self._rows_lock:
            rows = list(self._rows)
        states = list({id(row.state): row.state for row in rows}.values())
        if len(states) > CANCEL_CHECKS_PER_POLL:  # the next few requests, in turn
            start = self._cancel_cursor % len(states)
            self._cancel_cursor = start + CANCEL_CHECKS_PER_POLL
            pick = {id(s) for s in (states + states)[start:start + CANCEL_CHECKS_PER_POLL]}
            rows = [row for row in rows if id(row.state) in pick]
        seen = {}
        for row in rows:
            try:
                key = id(row.state)
                if key not in seen:
                    seen[key] = row.state.is_cancelled()
                if seen[key]:
                    row.cancel()
            except Exception as e:  # never let one request stop the polling of the others
                pb_utils.Logger.log_warn(f"tritium: cancellation check failed: {e}")

    def _row_done(self, row):
        with self._rows_lock:
            self._rows.pop(row, None)

    def _update_stats(self):
        try:
            healthy = self.engine.is_healthy
            if not healthy and not self._reported_dead and not self._stop.is_set():
                self._reported_dead = True
                pb_utils.Logger.log_error(f"tritium: the engine is unhealthy ({self.engine.failure}); every request "
                                          f"fails with this cause until the model is reloaded")
            self.metrics.update_engine_stats(dict(self.engine.stats(), healthy=healthy,
                                                  rejected=self.engine.num_rejected))
            self.metrics.flush()
        except Exception as e:  # metrics must never take the model down
            pb_utils.Logger.log_warn(f"tritium: stats update failed: {e}")

    # ---- requests -----------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            try:
                self._admit(request)
            except Exception as e:  # never leave a request without its final response
                pb_utils.Logger.log_error(f"tritium: admitting a request failed: {type(e).__name__}: {e}")
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(to_wire(e))),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _parse(self, arrays: dict):
        """All rows of a request -> list of (ParsedRequest, prompt ids, SamplingParams). The
        SamplingParams is built (so checked) by parse_row; the engine checks what depends on it
        (the context length) when the row is submitted."""
        batch = batch_size_of(arrays)
        rows = []
        for r in range(batch):
            try:
                p = parse_row(arrays, r, batch, self.config.model.vocab_size)
                if p.messages is not None:
                    if self.chat_template is None:
                        raise NoChatTemplateError(self._chat_template_error)
                    p.prompt = self.chat_template.render(p.messages, add_generation_prompt=True,
                                                         **({"tools": p.tools} if p.tools else {}))
                if p.prompt is not None:
                    if self.tokenizer is None:
                        raise RequestError("text_input needs an engine with a tokenizer; send input_ids instead",
                                           field="prompt")
                    ids = encode_prompt(self.tokenizer, p.prompt, self.config.limits.max_seq_len,
                                        self._token_chars)
                else:
                    ids = p.prompt_token_ids
                self._check_lora(p)
            except ValueError as e:
                info = error_info(e)
                raise RequestError(error_prefix(batch, r) + info["message"], field=info["field"],
                                   code=info["code"]) from None
            rows.append((p, ids, p.sampling))
        return rows

    def _check_lora(self, p) -> None:
        """Cache an adapter sent with the request, and resolve the row's adapter now (loading it on
        demand), so that a bad one fails this request with its reason before anything runs."""
        manager = self.engine.engine.lora
        if p.lora_tensors is not None:
            if manager is None:
                raise RequestError(f"lora_task_id {p.lora_task_id}: this model serves no LoRA adapters "
                                   f"(set parameter lora_adapters or enable_lora)", field="lora_task_id")
            manager.register_task(p.lora_task_id, *p.lora_tensors)
        resolve_request_lora(manager, p.lora_name, p.lora_task_id)

    def _admit(self, request):
        arrival = time.monotonic()
        try:
            arrays = {t.name(): t.as_numpy() for t in request.inputs()}
            rows = self._parse(arrays)
            try:
                output_names = output_names_parameter(request.parameters())
            except ValueError as e:
                raise RequestError(str(e), field=OUTPUT_NAMES_PARAMETER) from None
        except RequestError as e:
            request.get_response_sender().send(pb_utils.InferenceResponse(error=pb_utils.TritonError(to_wire(e))),
                                               flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        if self._request_log:
            _log_params(self._request_log, rows)
        state = RequestState(pb_utils, request, sum(sp.n for _, _, sp in rows), self.tensors, output_names)
        base_id = request.request_id() or uuid.uuid4().hex
        for r, (p, ids, sp) in enumerate(rows):
            rid = f"{base_id}-{uuid.uuid4().hex[:8]}-{r}"
            stream = RowStream(state, self.engine, self.metrics, self.tokenizer, r, rid, p, ids, sp.n, arrival,
                               self._row_done)
            with self._rows_lock:
                self._rows[stream] = None
            try:
                self.engine.submit(rid, list(ids), sp, stream.on_output)
            except Exception as e:  # bad for this engine (too long), overloaded or dead: this request fails
                self._row_done(stream)
                state.close_with_error(to_wire(e, error_prefix(len(rows), r)))
                with self._rows_lock:
                    siblings = [o for o in self._rows if o.state is state]
                for other in siblings:  # rows already submitted: abort them (the error went out)
                    other.cancel()
                return

    def finalize(self):
        self._stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if getattr(self, "metrics", None) is not None:
            self.metrics.flush()
