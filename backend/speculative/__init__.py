"""Speculative decoding: proposers (n-gram prompt lookup, a draft engine), the acceptance rules,
and the per-step glue with the engine. See docs/speculative.md."""
