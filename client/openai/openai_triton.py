"""The OpenAI frontend's way into Triton: tritonclient's asyncio gRPC client, streaming.

One gRPC channel per frontend; every OpenAI prompt is one Triton request on its own
bidirectional stream (`stream_infer`), so tritonserver and the `tritium` backend batch them
in flight. Cancelling the stream (a client that went away) cancels the Triton request; the
backend then aborts it and frees its KV blocks.

Models: the READY models of the server whose backend is `tritium` (the LLM models; their
_ensemble / _bls wrappers take no chat messages), looked up again when an unknown name is asked,
and the LoRA adapters each lists in its `lora_adapters` parameter, served as models of their own
(`parent`: the LLM model; a request for one goes to the parent with sampling_parameters.lora_name).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator, Dict, List, Optional

from tritium.client.openai.openai_protocol import OpenAIError
from tritium.client.triton_client import Chunk, build_request, chunk_from_result, grpc_inputs

MODELS_TTL_S = 5.0


class TritonRequestError(RuntimeError):
    """The Triton server answered this request with an error (message as sent)."""


class TritonBridge:
    """`security` (client/security.py): the keys sent with every call (the admin key only with the
    model index and configs, which tritonserver restricts); `tls_ca`: gRPC over TLS, trusting it."""

    def __init__(self, url: str, timeout: float = 3600.0, security=None, tls_ca: Optional[str] = None):
        self.url = url.split("://", 1)[-1].rstrip("/")
        self.timeout = timeout
        self.headers = security.headers("grpc") if security is not None else {}
        self.admin_headers = security.headers("grpc", admin=True) if security is not None else {}
        self.tls_ca = tls_ca
        self._client = None
        self._models: Dict[str, float] = {}   # name -> time first seen (the `created` field)
        self._models_at = 0.0
        self.parents: Dict[str, str] = {}     # LoRA adapter served as a model -> its LLM model

    def _grpc(self):
        # Created inside the running event loop (grpc.aio channels belong to one loop).
        if self._client is None:
            import tritonclient.grpc.aio as aio
            from tritium.client.security import grpc_tls_kwargs
            self._client = aio.InferenceServerClient(self.url, **grpc_tls_kwargs(self.tls_ca))
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def _unavailable(self, e: Exception) -> OpenAIError:
        if "protocol is restricted" in str(e):  # tritonserver refused our keys
            why = " ".join(str(e).split())
            return OpenAIError(503, f"tritonserver at {self.url} refuses this API's calls ({why}): give it the "
                                    "server's keys (--api-key, --admin-key)", code="triton_unavailable")
        return OpenAIError(503, f"cannot reach tritonserver at {self.url} (grpc): {' '.join(str(e).split())}",
                           code="triton_unavailable")

    async def models(self, refresh: bool = False) -> Dict[str, float]:
        """{model name: created time} of the tritium LLM models that are READY."""
        if not refresh and self._models and time.monotonic() - self._models_at < MODELS_TTL_S:
            return self._models
        from tritonclient.utils import InferenceServerException
        c = self._grpc()
        try:
            index = await c.get_model_repository_index(headers=self.admin_headers, as_json=True)
            found, parents = {}, {}
            for m in index.get("models", []):
                if m.get("state") != "READY":
                    continue
                name = m["name"]
                cfg = await c.get_model_config(name, headers=self.admin_headers, as_json=True)
                if cfg.get("config", {}).get("backend") == "tritium":
                    found[name] = self._models.get(name, time.time())
                    for adapter in _lora_names(cfg.get("config", {})):
                        parents.setdefault(adapter, name)
        except InferenceServerException as e:
            raise await self._unavailable(e) from None
        for adapter in [a for a in parents if a in found]:  # a model's own name wins over an adapter's
            del parents[adapter]
        for adapter in parents:
            found[adapter] = self._models.get(adapter, time.time())
        self._models, self.parents, self._models_at = found, parents, time.monotonic()
        return found

    async def tool_format(self, name) -> str:
        """The tool-call format of a model's chat template (openai_tools.detect_format), read from
        its engine folder when this host can see it; "hermes" otherwise. Cached per model."""
        import os

        from tritium.backend.chat_template import read_template_source
        from tritium.client.openai.openai_tools import detect_format
        cache = self.__dict__.setdefault("_tool_formats", {})
        if name not in cache:
            fmt = "hermes"
            try:
                cfg = await self._grpc().get_model_config(str(name), headers=self.admin_headers, as_json=True)
                path = cfg.get("config", {}).get("parameters", {}).get("engine_dir", {}).get("string_value", "")
                path = os.path.expanduser(path.strip())
                if path and os.path.isdir(path):
                    fmt = detect_format(read_template_source(path))
            except Exception:  # noqa: BLE001 -- unknown model / unreadable folder: the default format
                pass
            cache[name] = fmt
        return cache[name]

    async def check_model(self, name: str) -> None:
        """OpenAIError 404 unless `name` is a served LLM model."""
        if name in await self.models():
            return
        models = await self.models(refresh=True)
        if name not in models:
            raise OpenAIError(404, f"The model '{name}' does not exist; served models: "
                                   f"{', '.join(sorted(models)) or '(none)'}", param="model", code="model_not_found")

    async def stream(self, model: str, request_kwargs: dict) -> AsyncIterator[Chunk]:
        """Yield the Chunks of one Triton request; closing the generator early cancels the request."""
        import tritonclient.grpc.aio as aio
        from tritonclient.utils import InferenceServerException
        kw = dict(request_kwargs)
        prompt = kw.pop("prompt", None)
        if model in self.parents:  # a LoRA adapter: its LLM model, with the adapter's name
            sp = json.loads(kw.get("sampling_parameters") or "{}")
            sp["lora_name"] = model
            kw["sampling_parameters"] = json.dumps(sp)
            model = self.parents[model]
        inputs = grpc_inputs(build_request(prompt, **kw), aio)
        done = asyncio.Event()

        async def requests():
            yield {"model_name": model, "inputs": inputs, "request_id": uuid.uuid4().hex,
                   "enable_empty_final_response": True}
            await done.wait()  # keep the stream open until the final response is in

        call = self._grpc().stream_infer(requests(), stream_timeout=self.timeout, headers=self.headers)
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    raise TritonRequestError(error.message() if isinstance(error, InferenceServerException)
                                             else str(error))
                resp = result.get_response()
                if resp.outputs:
                    yield chunk_from_result(result)
                final = resp.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    finished = True
                    return
        except InferenceServerException as e:
            finished = True
            if "UNAVAILABLE" in str(e.status() or "") or "failed to connect" in str(e).lower() \
                    or "protocol is restricted" in str(e):
                raise await self._unavailable(e) from None
            raise TritonRequestError(e.message()) from None
        finally:
            done.set()
            if not finished:
                call.cancel()  # the Triton request is cancelled: the backend aborts it, KV blocks freed


def _lora_names(config: dict) -> List[str]:
    """Adapter names in a model config's lora_adapters parameter ("name=path,...")."""
    text = config.get("parameters", {}).get("lora_adapters", {}).get("string_value", "")
    return [item.split("=", 1)[0].strip() for item in text.split(",") if "=" in item]


async def merged(streams: List[AsyncIterator[Chunk]]) -> AsyncIterator[tuple]:
    """Interleave several Chunk streams as (stream index, Chunk) in arrival order; an error in one
    stream ends all (the others are closed, which cancels their Triton requests)."""
    queue: "asyncio.Queue" = asyncio.Queue()
    end = object()

    async def pump(i, s):
        try:
            async for c in s:
                await queue.put((i, c))
            await queue.put((i, end))
        except BaseException as e:  # noqa: B902 - relayed to the consumer, cancellation included
            await queue.put((i, e))
        finally:
            await s.aclose()

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(tasks)
    try:
        while open_streams:
            i, item = await queue.get()
            if item is end:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

