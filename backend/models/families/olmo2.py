"""OLMo 2: norms after attention and after the MLP (none before), and RMSNorms over the whole q
and k projections (not per head) before RoPE."""
from .base import POST_NORMS, Family, llama_fields

OLMO2 = Family("olmo2", ("olmo2",), hf_fields=lambda cfg: {**llama_fields(cfg), "norm_placement": "post",
                                                           "qk_norm": "full"},
               norms=dict(POST_NORMS))
