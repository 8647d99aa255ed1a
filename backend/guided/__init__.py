"""Grammar-constrained decoding (structured outputs): request field, compile cache, matcher hooks."""
from .params import GUIDE_TYPES, MAX_GUIDE_CHARS, GuidedDecodingParams

__all__ = ["GUIDE_TYPES", "MAX_GUIDE_CHARS", "GuidedDecodingParams"]
