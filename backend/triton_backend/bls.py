"""NAME_bls: a Business Logic Scripting model in front of the `tritium` LLM model.

It forwards every input it receives to the LLM model named by its `llm_model` parameter as a
decoupled BLS request (`InferenceRequest.exec(decoupled=True)`), then relays each streamed
response, so it is the template for custom logic (routing, guard rails, prompt templates)
around generation with no client change. Decoupled itself; the repository writer puts a
two-line model.py in its folder that imports this class.
"""
from __future__ import annotations

import json
import threading

from tritium.backend.errors import to_wire
from tritium.backend.triton_backend.contract import OUTPUTS

OUTPUT_NAMES = [s.name for s in OUTPUTS]


class BLSModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.llm_model = cfg.get("parameters", {}).get("llm_model", {}).get("string_value", "").strip()
        if not self.llm_model:
            raise ValueError(f"model '{args['model_name']}' needs parameter llm_model")

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self._relay, args=(request,), daemon=True).start()
        return None

    def _relay(self, request):
        import triton_python_backend_utils as pb_utils
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sender = request.get_response_sender()
        try:
            inner = pb_utils.InferenceRequest(
                model_name=self.llm_model, inputs=list(request.inputs()),
                requested_output_names=OUTPUT_NAMES)
            responses = inner.exec(decoupled=True)
            for resp in responses:
                if request.is_cancelled():
                    # ResponseIterator.cancel() exists from python_backend 25.04 on; with Triton
                    # 2.51 the inner request runs to its end, its responses unread.
                    if hasattr(responses, "cancel"):
                        responses.cancel()
                    sender.send(flags=final)
                    return
                if resp.has_error():
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(resp.error().message())),
                                flags=final)
                    return
                tensors = [t for t in (pb_utils.get_output_tensor_by_name(resp, n) for n in OUTPUT_NAMES)
                           if t is not None]
                if tensors:
                    sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
            sender.send(flags=final)
        except Exception as e:  # a failing relay answers this request only
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(to_wire(e, f"{self.llm_model}: "))),
                        flags=final)
