"""The `tritium` Triton Python-based backend: decoupled, in-flight-batched LLM serving.

Installed as `<backend-dir>/tritium/model.py` (see tritium.client.server), so a model's
config.pbtxt says `backend: "tritium"` and carries no model.py of its own. Parameters:
`engine_dir` (absolute, or relative to the model's folder; `~` expands; $VARS do not), and optional
`num_kv_blocks`, `max_num_seqs`, `max_num_batched_tokens`, `enable_prefix_caching`, `device`,
`max_queue_size` (waiting requests beyond which new ones fail as overloaded; default 1024),
`num_threads` (torch intra-op threads; default every core) and `small_step_threads` (threads for
steps of fewer than 4 tokens; default one fewer; see engine.ThreadPolicy), and for a
tensor-parallel engine `threads_per_rank` (threads of each worker process; default: the cores
divided by the ranks; also rank 0's default num_threads). See docs/tensor-parallel.md.
Speculative decoding (docs/speculative.md): `speculative_method` (ngram or draft; empty =
off), `draft_engine_dir` (for draft; a path like engine_dir) and `num_speculative_tokens` (default 4).

One AsyncLLMEngine per model instance runs its own background loop; every request that any
execute() call hands over joins the running batch at the next engine step. The engine's one
delivery thread turns each step's outputs into responses (stream.py; tensor contract:
contract.py). A housekeeping thread polls cancellation of the open requests every
CANCEL_POLL_S (a cancelled request is aborted within about two engine steps, waiting or not), and
copies the engine's stats into the gauges and flushes the metrics every STATS_PERIOD_S: each of
those is an IPC round trip to the server, kept off the per-token path.
"""
from __future__ import annotations

import json
import os
import threading
import time
import uuid

import triton_python_backend_utils as pb_utils

from tritium.backend.async_engine import AsyncLLMEngine
from tritium.backend.chat_template import ChatTemplate, NoChatTemplateError
from tritium.backend.config import EngineConfig
from tritium.backend.engine import ThreadPolicy
from tritium.backend.guided import state as guided_state
from tritium.backend.lora.setup import resolve_request_lora
from tritium.backend.triton_backend.lora_params import lora_config_from_params
from tritium.backend.prompt_limits import encode_prompt, max_token_chars
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.speculative.config import DEFAULT_NUM_SPECULATIVE_TOKENS, SpeculativeConfig
from tritium.backend.triton_backend.contract import resolve_path
from tritium.backend.triton_backend.metrics import TritiumMetrics
from tritium.backend.triton_backend.request import batch_size_of, error_prefix, parse_row
from tritium.backend.triton_backend.stream import RequestState, RowStream

_ENGINE_INT_PARAMS = ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_queue_size",
                      "threads_per_rank")
DEFAULT_MAX_QUEUE_SIZE = 1024  # requests waiting for their first step; more are refused as overloaded
STATS_PERIOD_S = 0.05   # gauges and metric flushes
CANCEL_POLL_S = 0.02    # is_cancelled() of every open request (one IPC round trip each)


def _int_params(params: dict, names) -> dict:
    """The integer parameters among `names` that config.pbtxt sets (name -> value)."""
    out = {}
    for name in names:
        v = params.get(name, "").strip()
        if v:
            try:
                out[name] = int(v)
            except ValueError:
                raise ValueError(f"parameter {name} must be an integer, got {v!r}") from None
    return out


def _engine_kwargs(params: dict) -> dict:
    kw = _int_params(params, _ENGINE_INT_PARAMS)
    for name in ("enable_prefix_caching", "deterministic"):  # deterministic: docs/determinism.md
        v = params.get(name, "").strip().lower()
        if v:
            if v not in ("true", "false", "1", "0"):
                raise ValueError(f"parameter {name} must be true or false, got {v!r}")
            kw[name] = v in ("true", "1")
    if params.get("device", "").strip():
        kw["device"] = params["device"].strip()
    return kw


def _speculative(params: dict, model_dir: str):
    """Parameters speculative_method / draft_engine_dir / num_speculative_tokens -> SpeculativeConfig or None."""
    method = params.get("speculative_method", "").strip().lower()
    draft = params.get("draft_engine_dir", "").strip()
    k = _int_params(params, ("num_speculative_tokens",)).get("num_speculative_tokens")
    if not method:
        if draft or k is not None:
            raise ValueError("parameters draft_engine_dir / num_speculative_tokens need speculative_method "
                             "(ngram or draft)")
        return None
    return SpeculativeConfig(method, num_speculative_tokens=DEFAULT_NUM_SPECULATIVE_TOKENS if k is None else k,
                             draft_engine_dir=resolve_path(draft, model_dir) if draft else None).validate()


def _tensor_parallel_size(engine_dir: str) -> int:
    try:
        return EngineConfig.load(engine_dir).tensor_parallel_size
    except Exception:  # the engine load reports it properly
        return 1


def _thread_policy(params: dict, tp_size: int = 1, kwargs: dict = None):
    """Parameters num_threads (default: every core, or its share of them per tensor-parallel rank)
    and small_step_threads (default: one fewer): see ThreadPolicy."""
    vals = _int_params(params, ("num_threads", "small_step_threads"))
    per_rank = max(1, (os.cpu_count() or 1) // tp_size)
    if tp_size > 1 and kwargs is not None:
        kwargs.setdefault("threads_per_rank", per_rank)
    threads = vals.get("num_threads", per_rank if tp_size > 1 else os.cpu_count() or 1)
    return ThreadPolicy(threads, vals.get("small_step_threads", max(1, threads - 1)))


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
            kwargs = _engine_kwargs(params)
            policy = _thread_policy(params, _tensor_parallel_size(engine_dir), kwargs)
            spec = _speculative(params, model_dir)
            if spec is not None:
                kwargs["speculative"] = spec
            lora = lora_config_from_params(params, model_dir)
            if lora is not None:
                kwargs["lora"] = lora
            if not os.path.isdir(engine_dir):
                raise FileNotFoundError(f"engine_dir {engine_dir} does not exist")
            kwargs.setdefault("max_queue_size", DEFAULT_MAX_QUEUE_SIZE)
            self.engine = AsyncLLMEngine(engine_dir, **kwargs)
            self.engine.engine.thread_policy = policy
            guided_state.warm_up(self.engine.engine)  # structured outputs: vocabulary tables, in the background
        except Exception as e:  # one line in the server log, not a traceback through the stub
            raise pb_utils.TritonModelException(
                f"tritium: cannot load engine for model '{name}' from {engine_dir}: {type(e).__name__}: "
                f"{' '.join(str(e).split())}") from None
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.chat_template, self._chat_template_error = None, None
        try:
            self.chat_template = ChatTemplate.from_engine_dir(engine_dir)
        except ValueError as e:  # no template (or a broken one): chat requests fail with this message
            self._chat_template_error = f"model '{name}': {e}"
        self._token_chars = max_token_chars(self.tokenizer) if self.tokenizer is not None else 1
        self.metrics = TritiumMetrics(pb_utils, name, version)
        self._rows_lock = threading.Lock()
        self._rows = set()  # open RowStreams, polled for cancellation
        self._reported_dead = False
        self._stop = threading.Event()
        self._stats_thread = threading.Thread(target=self._stats_loop, name="tritium-stats", daemon=True)
        self._stats_thread.start()
        pb_utils.Logger.log_info(f"tritium: model '{name}' serving engine {engine_dir} "
                                 f"({self.config.model.architecture}, {self.config.dtype})")

    # ---- housekeeping: cancellation, engine stats -> gauges, metric flushes ------------------
    def _stats_loop(self):
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
            self._rows.discard(row)

    def _update_stats(self):
        try:
            healthy = self.engine.is_healthy
            if not healthy and not self._reported_dead and not self._stop.is_set():
                self._reported_dead = True
                cause = self.engine._error or getattr(self.engine.engine.runner, "_error", None)
                pb_utils.Logger.log_error(f"tritium: the engine is unhealthy ({cause!r}); every request "
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
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tritium: {type(e).__name__}: {e}")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _parse(self, arrays: dict):
        """All rows of a request -> list of (ParsedRequest, prompt ids, SamplingParams)."""
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
                        raise ValueError("text_input needs an engine with a tokenizer; send input_ids instead")
                    ids = encode_prompt(self.tokenizer, p.prompt, self.config.limits.max_seq_len,
                                        self._token_chars)
                else:
                    ids = p.prompt_token_ids
                if p.params.get("max_tokens", 0) is None:  # sampling_parameters max_tokens null
                    p.params["max_tokens"] = max(1, self.config.limits.max_seq_len - len(ids))
                sp = SamplingParams(**p.params)
                sp.validate(self.config.limits.max_seq_len, self.config.model.vocab_size, len(ids))
                self._check_lora(p)
            except ValueError as e:
                raise ValueError(error_prefix(batch, r) + str(e)) from None
            rows.append((p, ids, sp))
        return rows

    def _check_lora(self, p) -> None:
        """Cache an adapter sent with the request, and resolve the row's adapter now (loading it on
        demand), so that a bad one fails this request with its reason before anything runs."""
        manager = self.engine.engine.lora
        if p.lora_tensors is not None:
            if manager is None:
                raise ValueError(f"lora_task_id {p.lora_task_id}: this model serves no LoRA adapters "
                                 f"(set parameter lora_adapters or enable_lora)")
            manager.register_task(p.lora_task_id, *p.lora_tensors)
        resolve_request_lora(manager, p.lora_name, p.lora_task_id)

    def _admit(self, request):
        arrival = time.monotonic()
        try:
            arrays = {t.name(): t.as_numpy() for t in request.inputs()}
            rows = self._parse(arrays)
        except ValueError as e:
            request.get_response_sender().send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                                               flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        state = RequestState(pb_utils, request, sum(sp.n for _, _, sp in rows))
        base_id = request.request_id() or uuid.uuid4().hex
        for r, (p, ids, sp) in enumerate(rows):
            rid = f"{base_id}-{uuid.uuid4().hex[:8]}-{r}"
            stream = RowStream(state, self.engine, self.metrics, self.tokenizer, r, rid, p, ids, sp.n, arrival,
                               self._row_done)
            with self._rows_lock:
                self._rows.add(stream)
            try:
                self.engine.submit(rid, list(ids), sp, stream.on_output, lora_name=p.lora_name,
                                   lora_task_id=p.lora_task_id)
            except Exception as e:  # engine dead or shut down: this request fails, with the cause
                self._row_done(stream)
                state.close_with_error(f"tritium: request failed: {type(e).__name__}: {e}")
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
