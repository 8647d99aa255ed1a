"""The `tritium` Triton Python-based backend: decoupled, in-flight-batched LLM serving.

Installed as `<backend-dir>/tritium/model.py` (see tritium.client.server), so a model's
config.pbtxt says `backend: "tritium"` and carries no model.py of its own. Parameters:
`engine_dir` (absolute, or relative to the model's folder; `~` and $VARS expand), and optional
`num_kv_blocks`, `max_num_seqs`, `max_num_batched_tokens`, `enable_prefix_caching`, `device`.

One AsyncLLMEngine per model instance runs its own background loop; every request that any
execute() call hands over joins the running batch at the next engine step. One thread per
request drains the engine's stream and sends responses (tensor contract: triton_contract.py).
"""
from __future__ import annotations

import json
import os
import threading
import time
import uuid

import triton_python_backend_utils as pb_utils

from tritium.backend.triton_contract import NUM_CONTEXT_IDS, resolve_path, response_arrays, token_logprobs
from tritium.backend.triton_request import batch_size_of, error_prefix, parse_row
from tritium.backend.triton_metrics import TritiumMetrics

_ENGINE_INT_PARAMS = ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens")
STATS_PERIOD_S = 0.1


def _engine_kwargs(params: dict) -> dict:
    kw = {}
    for name in _ENGINE_INT_PARAMS:
        v = params.get(name, "").strip()
        if v:
            try:
                kw[name] = int(v)
            except ValueError:
                raise ValueError(f"parameter {name} must be an integer, got {v!r}") from None
    v = params.get("enable_prefix_caching", "").strip().lower()
    if v:
        if v not in ("true", "false", "1", "0"):
            raise ValueError(f"parameter enable_prefix_caching must be true or false, got {v!r}")
        kw["enable_prefix_caching"] = v in ("true", "1")
    if params.get("device", "").strip():
        kw["device"] = params["device"].strip()
    return kw


class _RequestState:
    """Book-keeping of one Triton request (all its batch rows and samples)."""

    def __init__(self, sender, num_streams: int):
        self.sender = sender
        self.lock = threading.Lock()
        self.remaining = num_streams   # (row, sample) streams not finished yet
        self.closed = False            # the final flag went out


class TritonPythonModel:
    def initialize(self, args):
        from tritium.backend.engine import AsyncLLMEngine
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
            if not os.path.isdir(engine_dir):
                raise FileNotFoundError(f"engine_dir {engine_dir} does not exist")
            self.engine = AsyncLLMEngine(engine_dir, **kwargs)
        except Exception as e:  # one line in the server log, not a traceback through the stub
            raise pb_utils.TritonModelException(
                f"tritium: cannot load engine for model '{name}' from {engine_dir}: {type(e).__name__}: "
                f"{' '.join(str(e).split())}") from None
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.metrics = TritiumMetrics(pb_utils, name, version)
        self._stop = threading.Event()
        self._stats_thread = threading.Thread(target=self._stats_loop, name="tritium-stats", daemon=True)
        self._stats_thread.start()
        pb_utils.Logger.log_info(f"tritium: model '{name}' serving engine {engine_dir} "
                                 f"({self.config.model.architecture}, {self.config.dtype})")

    # ---- engine stats -> gauges ---------------------------------------------------------
    def _stats_loop(self):
        while not self._stop.wait(STATS_PERIOD_S):
            self._update_stats()

    def _update_stats(self):
        try:
            self.metrics.update_engine_stats(self.engine.stats())
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
        from tritium.backend.sampling_params import SamplingParams
        batch = batch_size_of(arrays)
        rows = []
        for r in range(batch):
            try:
                p = parse_row(arrays, r, batch, self.config.model.vocab_size)
                if p.prompt is not None:
                    if self.tokenizer is None:
                        raise ValueError("text_input needs an engine with a tokenizer; send input_ids instead")
                    ids = self.tokenizer.encode(p.prompt).ids
                else:
                    ids = p.prompt_token_ids
                sp = SamplingParams(**p.params)
                sp.validate(self.config.limits.max_seq_len, self.config.model.vocab_size, len(ids))
            except ValueError as e:
                raise ValueError(error_prefix(batch, r) + str(e)) from None
            rows.append((p, ids, sp))
        return rows

    def _admit(self, request):
        sender = request.get_response_sender()
        arrival = time.monotonic()
        try:
            arrays = {t.name(): t.as_numpy() for t in request.inputs()}
            rows = self._parse(arrays)
        except ValueError as e:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        state = _RequestState(sender, sum(sp.n for _, _, sp in rows))
        base_id = request.request_id() or uuid.uuid4().hex
        for r, (p, ids, sp) in enumerate(rows):
            rid = f"{base_id}-{uuid.uuid4().hex[:8]}-{r}"
            threading.Thread(target=self._serve_row, name=f"tritium-{rid}",
                             args=(request, state, r, rid, p, ids, sp, arrival), daemon=True).start()

    def _send(self, state: _RequestState, arrays: dict, stream_done: bool):
        """Send one response; the request's final flag rides on the last stream's last response."""
        with state.lock:
            if state.closed:
                return
            if stream_done:
                state.remaining -= 1
            final = state.remaining == 0
            tensors = [pb_utils.Tensor(k, v) for k, v in arrays.items()]
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            state.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
            state.closed = final

    def _close_with_error(self, state: _RequestState, msg: str):
        with state.lock:
            if state.closed:
                return
            state.closed = True
            state.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(msg)),
                              flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _close_cancelled(self, state: _RequestState):
        with state.lock:
            if not state.closed:
                state.closed = True
                state.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _serve_row(self, request, state, row, rid, p, ids, sp, arrival):
        n = sp.n
        # With exclude_input_in_output false, output_ids start with the prompt ids and
        # text_output with the prompt (tensorrtllm_backend's convention); both go out once.
        echo_ids = [] if p.exclude_input_in_output else list(ids)
        echo_text = "" if p.exclude_input_in_output else (
            p.prompt if p.prompt is not None else self.tokenizer.decode(ids) if self.tokenizer else "")
        sent_ids = [[] for _ in range(n)]       # ids already sent, per sample (context_ids source)
        done = [False] * n
        token_times = [[] for _ in range(n)]
        try:
            for out in self.engine.generate(rid, prompt_token_ids=list(ids), params=sp):
                if state.closed or request.is_cancelled():
                    self.engine.abort(rid)
                    self._close_cancelled(state)
                    return
                now = time.monotonic()
                for c in out.outputs:
                    i = c.index
                    if done[i]:
                        continue
                    new_ids = list(c.new_token_ids or [])
                    token_times[i].extend([now] * len(new_ids))
                    finished = c.finish_reason is not None
                    self.metrics.add_tokens(0, len(new_ids))
                    if p.stream and (new_ids or c.text_delta or finished):
                        first = not sent_ids[i]
                        text = (echo_text if first else "") + (c.text_delta or "")
                        out_ids = (echo_ids if first else []) + new_ids
                        self._emit(state, c, row, text, out_ids, new_ids, sent_ids[i], len(ids), p, finished)
                        sent_ids[i].extend(out_ids)
                    elif finished and not p.stream:
                        self._emit(state, c, row, echo_text + c.text, echo_ids + list(c.token_ids),
                                   list(c.token_ids), [], len(ids), p, True)
                    if finished:
                        done[i] = True
                        self.metrics.observe_token_times(arrival, token_times[i])
                if all(done):
                    break
            self.metrics.add_tokens(len(ids), 0)
        except Exception as e:  # engine error: this request only
            self.engine.abort(rid)
            self._close_with_error(state, f"tritium: request failed: {type(e).__name__}: {e}")
        finally:
            self._update_stats()

    def _emit(self, state, c, row, text, out_ids, gen_ids, prev_ids, num_input, p, finished):
        """One response. out_ids: what output_ids carries; gen_ids: the generated ids among them."""
        lps = token_logprobs(c.logprobs, list(c.token_ids)) if p.return_log_probs else []
        new_lps = lps[len(lps) - len(gen_ids):] if lps and gen_ids else []
        cum = c.cum_logprob if p.return_log_probs else None
        arrays = response_arrays(
            text=text, new_ids=out_ids, finish_reason=c.finish_reason if finished else None,
            cum_log_prob=cum, log_probs=new_lps, num_input_tokens=num_input,
            num_output_tokens=len(c.token_ids), batch_index=row, sequence_index=c.index,
            context_ids=prev_ids[-NUM_CONTEXT_IDS:])
        self._send(state, arrays, stream_done=finished)

    def finalize(self):
        self._stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
