"""Build options that make no sense with a pre-quantized source, refused before any work."""
from __future__ import annotations

from .spec import ImportSpec

# BuildOptions field -> (its default, the flag) that re-quantizing or calibrating would need
_REFUSED = {"quantization": ("none", "--quantization"), "group_size": (None, "--group-size"),
            "kv_cache_dtype": ("auto", "--kv-cache-dtype"), "calibration_text": (None, "--calibration-text"),
            "calibration_samples": (None, "--calibration-samples"), "exclude_modules": (None, "--exclude-modules"),
            "embedding_quantization": (None, "--embedding-quantization")}


def check_import_options(opts, spec: ImportSpec, source: str) -> None:
    """Raise ValueError naming the flag when a build of a pre-quantized source asks to quantize."""
    for name, (default, flag) in _REFUSED.items():
        value = getattr(opts, name, default)
        if value != default:
            raise ValueError(
                f"{flag} {value}: {source} is already quantized ({spec.format}, config.json quantization_config); "
                f"Tritium imports its stored weights as they are and does not re-quantize or calibrate them. "
                f"Drop {flag}, or build from the float checkpoint to quantize with Tritium")
