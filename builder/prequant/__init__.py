"""Import pre-quantized Hugging Face checkpoints (GPTQ, AWQ, compressed-tensors) without re-quantizing.

    detect_import_in(folder, raw_config)        -> ImportSpec or None (raises on unsupported variants)
    imported_engine_tensors(m, ckpt, dtype, spec) -> (engine tensors, per-linear LayerQuant, report)

The stored codes, scales and zero points are mapped onto Tritium's packed layouts
(tritium.kernels.quant_layouts), so the engine computes the weights the producing library
dequantizes to. See docs/quantization.md, "Importing pre-quantized checkpoints".
"""
from .assemble import imported_engine_tensors, imported_quant_config
from .options import check_import_options
from .spec import ImportSpec, detect_import, detect_import_in

__all__ = ["ImportSpec", "check_import_options", "detect_import", "detect_import_in", "imported_engine_tensors",
           "imported_quant_config"]
