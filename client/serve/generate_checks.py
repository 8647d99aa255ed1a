"""The HTTP guard's type check of a generate / generate_stream body against the Tritium tensor
contract (backend/triton_backend/contract.py).

tritonserver 2.51 turns each top-level field of a generate body into an input tensor itself, and
a value of the wrong JSON type comes back as `Unable to parse 'data': ...` or `batch size does not
match other inputs`, naming neither the field nor what it should hold. The guard checks the
contract's fields first and answers 400 naming the field and its type; fields outside the
contract go on to tritonserver unchanged.
"""
from __future__ import annotations

import math
import re

from tritium.backend.triton_backend.contract import INPUTS
from tritium.client.serve.http_checks import GuardError

_GENERATE = re.compile(r"/v2/models/[^/]+(?:/versions/[0-9]+)?/generate(?:_stream)?")
_SPECS = {s.name: s for s in INPUTS}
_INT_RANGE = {"TYPE_INT32": (-2 ** 31, 2 ** 31 - 1), "TYPE_UINT64": (0, 2 ** 64 - 1)}


def is_generate(target: str) -> bool:
    return bool(_GENERATE.fullmatch(target.split("?", 1)[0]))


def _scalar_ok(data_type: str, v) -> bool:
    if data_type == "TYPE_STRING":
        return isinstance(v, str)
    if data_type == "TYPE_BOOL":
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    if data_type in _INT_RANGE:
        lo, hi = _INT_RANGE[data_type]
        return isinstance(v, int) and lo <= v <= hi
    return isinstance(v, (int, float)) and math.isfinite(v)  # TYPE_FP32


_WHAT = {"TYPE_STRING": "a string", "TYPE_BOOL": "true or false", "TYPE_FP32": "a finite number",
         "TYPE_INT32": "an integer in [-2147483648, 2147483647]", "TYPE_UINT64": "an integer in [0, 2^64 - 1]"}


def check_generate_fields(body) -> None:
    """Raise GuardError 400 naming the first contract field whose JSON value has the wrong type
    or shape (a scalar input takes a value or a one-element list; a list input a flat list)."""
    if not isinstance(body, dict):
        raise GuardError(400, "a generate request body must be a JSON object of input names to values")
    for name, v in body.items():
        spec = _SPECS.get(name)
        if spec is None:
            continue
        if len(spec.dims) > 1:  # lora_weights / lora_config: generate's JSON fields are flat
            raise GuardError(400, f"{name} is a 2-D tensor; send it with the infer API (gRPC, or HTTP "
                                  f"/v2/models/NAME/infer), not generate")
        many = spec.dims == (-1,)
        values = v if isinstance(v, list) else [v]
        if (not many and len(values) != 1) or not all(_scalar_ok(spec.data_type, x) for x in values):
            what = _WHAT[spec.data_type]
            want = f"{what} or a list of them" if many else what
            raise GuardError(400, f"{name} must be {want}, got {_describe(v)}")


def _describe(v) -> str:
    if isinstance(v, list):
        return f"a list of {len(v)}"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return repr(v)[:40]
    if isinstance(v, str):
        return f"a string of {len(v)} characters"
    return "an object" if isinstance(v, dict) else "null"
