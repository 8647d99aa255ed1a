"""The OpenAI-compatible API in front of tritonserver."""
