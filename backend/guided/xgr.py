"""Import xgrammar, also inside Triton's Python backend stub.

xgrammar's tokenizer_info imports transformers at module level (for two isinstance checks in
TokenizerInfo.from_huggingface, which Tritium does not call), and transformers imports ssl through
huggingface_hub. The stub of the nvidia-pytriton wheel can run on a libpython whose `_ssl` does
not load (seen: "undefined symbol: _PyModule_Add"), which would make every constrained request
fail. If the plain import fails, xgrammar is imported with a stand-in `transformers` whose
names are empty classes (also the base of xgrammar.contrib.hf's LogitsProcessor, unused here),
removed again afterwards.
"""
from __future__ import annotations

import sys
import types

_xgr = None


def xgrammar():
    """The xgrammar module."""
    global _xgr
    if _xgr is not None:
        return _xgr
    try:
        import xgrammar as xgr
    except ImportError:
        for name in [n for n in sys.modules if n == "xgrammar" or n.startswith("xgrammar.")]:
            del sys.modules[name]
        shim = types.ModuleType("transformers")
        shim.__getattr__ = lambda name: type(name, (), {})  # stand-in classes for any name asked for
        saved = sys.modules.get("transformers")
        sys.modules["transformers"] = shim
        try:
            import xgrammar as xgr
        finally:
            if saved is None:
                sys.modules.pop("transformers", None)
            else:
                sys.modules["transformers"] = saved
    _xgr = xgr
    return xgr
