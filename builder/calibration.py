"""Calibration windows, a layer-by-layer runner over calibration samples, and the docstring texts.

The default calibration set is the shipped mix of prose, dialogue and code (calibration_mix.py).
The docstrings of fixed lists of Python standard-library modules, read from their source with
`ast` (nothing is imported or executed), were the default calibration and evaluation texts
before it; they remain as `tritium eval --domain docstrings` and as a way to rebuild the former
default (`default_calibration_text()` written to a file, passed as `--calibration-text`).
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
from typing import Callable, List, Optional, Sequence

import torch

from tritium.kernels.attention_metadata import AttentionMetadata

CALIBRATION_MODULES = (
    "argparse", "subprocess", "threading", "logging", "json", "unittest.case", "functools",
    "inspect", "typing", "tarfile", "shutil", "os", "datetime", "collections", "email.message",
    "http.client", "urllib.request", "pathlib", "socket", "asyncio.tasks",
)
EVAL_MODULES = (
    "difflib", "textwrap", "statistics", "fractions", "heapq", "calendar", "configparser", "csv",
    "dataclasses", "enum", "optparse", "mailbox", "imaplib", "smtplib", "ftplib", "pprint",
    "random", "contextlib",
)
CALIBRATION_SEQ_LEN = 128     # tokens per calibration sample
MIN_CALIBRATION_CHARS = 2000  # below this a text cannot give meaningful statistics
MIN_CALIBRATION_TOKENS = 512


def module_docstrings(module: str) -> str:
    """Docstrings of a stdlib module (module, classes, functions; ast order) as one text."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ""
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                docs.append(doc)
    return "\n\n".join(docs)


def default_calibration_text() -> str:
    """The former default calibration text: docstrings of CALIBRATION_MODULES."""
    return "\n\n".join(t for t in map(module_docstrings, CALIBRATION_MODULES) if t)


def default_eval_text() -> str:
    """The former default evaluation text: docstrings of EVAL_MODULES (disjoint from
    default_calibration_text)."""
    return "\n\n".join(t for t in map(module_docstrings, EVAL_MODULES) if t)


def text_provenance(text: str, source: str) -> dict:
    return {"source": source, "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def calibration_samples(token_ids: Sequence[int], num_samples: int,
                        seq_len: int = CALIBRATION_SEQ_LEN) -> List[List[int]]:
    """Split a token stream into up to num_samples consecutive windows of seq_len tokens
    (shorter windows when the text is short). Raises ValueError when the text is too short."""
    n = len(token_ids)
    if n < MIN_CALIBRATION_TOKENS:
        raise ValueError(f"calibration text too short: {n} tokens, need at least {MIN_CALIBRATION_TOKENS}")
    seq_len = min(seq_len, n // num_samples)
    if seq_len < 32:
        seq_len = 32
        num_samples = n // 32
    return [list(token_ids[i * seq_len:(i + 1) * seq_len]) for i in range(num_samples)]


class LayerwiseRunner:
    """Runs a DecoderLM one layer at a time over calibration samples, holding each layer's inputs.

    Samples are packed into chunks of several sequences (one AttentionMetadata each) with a
    private float KV cache per chunk, so a layer's forward is exactly the model's forward.
    """

    def __init__(self, model, samples: List[List[int]], max_chunk_tokens: int = 2048):
        self.model = model
        m = model.cfg.model
        self.block_size = model.cfg.limits.block_size
        self.chunks = []
        cur: List[List[int]] = []
        for s in samples:
            if cur and sum(map(len, cur)) + len(s) > max_chunk_tokens:
                self.chunks.append(cur)
                cur = []
            cur.append(s)
        if cur:
            self.chunks.append(cur)
        self.metas, self.positions, self.num_blocks = [], [], []
        self.hidden: List[torch.Tensor] = []
        self.residual: List[Optional[torch.Tensor]] = []
        for seqs in self.chunks:
            tables, nb = [], 0
            for s in seqs:
                need = (len(s) + self.block_size - 1) // self.block_size
                tables.append(list(range(nb, nb + need)))
                nb += need
            lens = [len(s) for s in seqs]
            self.metas.append(AttentionMetadata.build(lens, lens, tables, self.block_size))
            self.positions.append(torch.cat([torch.arange(n) for n in lens]))
            self.num_blocks.append(nb)
            ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
            # the model's own lookup: an int8 table, Gemma's / Granite's embedding multiplier
            embed = getattr(model, "embed", None)
            self.hidden.append(embed(ids) if embed is not None else model.embed_tokens_weight[ids])
            self.residual.append(None)
        # multi-head latent attention caches one latent row per token (backend/model_runner.py)
        self.latent = bool(m.kv_lora_rank)
        self.kv_shape = (1, m.kv_lora_rank + m.qk_rope_head_dim) if self.latent else (m.num_kv_heads, m.head_dim)
        self.num_tokens = sum(len(s) for s in samples)

    @torch.no_grad()
    def run_layer(self, idx: int, on_chunk: Optional[Callable[[torch.Tensor], None]] = None,
                  advance: bool = False) -> None:
        """Forward layer idx over every chunk. on_chunk(positions) is called before each chunk
        (hooks use it to know token positions); advance=True keeps the outputs as the next
        layer's inputs."""
        layer = self.model.layers[idx]
        dtype = self.hidden[0].dtype
        for c, meta in enumerate(self.metas):
            if on_chunk is not None:
                on_chunk(self.positions[c])
            shape = (self.num_blocks[c], self.block_size) + self.kv_shape
            kv = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            if self.latent:
                kv = (kv[0], kv[0][..., :0])
            h, r = layer(self.positions[c], self.hidden[c], self.residual[c], kv, meta,
                         self.model.rope_state(self.positions[c]))
            if advance:
                self.hidden[c], self.residual[c] = h, r


def capture_inputs(modules: dict, fn: Callable[[str, torch.Tensor], None]):
    """Register forward pre-hooks calling fn(name, x2d_float) on each module; returns handles."""
    handles = []
    for name, mod in modules.items():
        def hook(_m, args, _name=name):
            x = args[0]
            fn(_name, x.reshape(-1, x.shape[-1]).float())
        handles.append(mod.register_forward_pre_hook(hook))
    return handles


def kv_sample_hook(layer, cos_sin_cache: torch.Tensor, stats: dict, seed: int = 0,
                   positions: Optional[dict] = None):
    """Forward hook on layer.qkv_proj that appends each chunk's K (after RoPE) and V, (T, Hkv, D),
    to stats['k'] / stats['v']: what the layer writes into its KV cache.

    K is rotated at positions drawn uniformly from the whole RoPE table (the engine's context),
    not at the calibration windows' own positions: RoPE turns each channel pair by an angle that
    grows with position, so keys at position 2000 put their weight in other channels than keys at
    position 100 (on SmolLM2, evaluation K at up to 2048 tokens reached 1.17x the amax of K at the
    calibration positions < 128). The draw is deterministic (seeded).

    With positions (a dict whose "p" holds the chunk's token positions, set by the runner's
    on_chunk), also accumulates the attention each key receives in its own sequence (the sum over
    queries of the causal softmax, at the real positions): stats['w'] (Hkv,) and the weighted sums
    stats['kw'] / stats['vw'] (Hkv, D), for attention-weighted offsets (kv_scales.py)."""
    from tritium.kernels import ops
    gen = torch.Generator().manual_seed(seed)
    nq, nkv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim

    def rot(q, k, pos):
        # the layer's RoPE (none on a NoPE layer, partial on Phi's); a bare layer: full RoPE
        if cos_sin_cache is None:
            return q, k
        if hasattr(layer, "rotate_qk"):
            return layer.rotate_qk(q, k, pos, _OneTable(layer.rope_kind, cos_sin_cache))
        return ops.rotary(q, k, pos, cos_sin_cache)

    def hook(_m, _args, out):
        t = out.shape[0]
        q = out[:, :nq].reshape(t, layer.num_heads, layer.head_dim)
        k = out[:, nq:nq + nkv].reshape(t, layer.num_kv_heads, layer.head_dim)
        v = out[:, nq + nkv:].reshape(t, layer.num_kv_heads, layer.head_dim)
        if hasattr(layer, "norm_qk"):  # the family's q/k norm comes before RoPE
            q, k = layer.norm_qk(q, k)
        drawn = torch.randint(0, cos_sin_cache.shape[0] if cos_sin_cache is not None else 1, (t,),
                              generator=gen).to(out.device)
        _, k_drawn = rot(q.clone(), k.clone(), drawn)
        stats.setdefault("k", []).append(k_drawn.float())
        stats.setdefault("v", []).append(v.float().clone())
        if positions is not None:
            pos = positions["p"].to(out.device)
            qr, kr = rot(q.clone(), k.clone(), pos)
            _accumulate_attention(stats, qr, kr, v, pos, None, layer.scale)
    return hook


class _OneTable:
    """A RopeState-like view holding one table (what rotate_qk reads)."""

    def __init__(self, kind, cache):
        self.caches, self.tables = {kind: cache}, {}


def _accumulate_attention(stats: dict, q, k, v, positions, cos_sin_cache, scale: float) -> None:
    """Attention received by each key of each sequence in a packed chunk (sequences start where
    the position is 0), summed into stats['w'] / stats['kw'] / stats['vw'] per KV head. With a
    cos_sin_cache q and k are rotated here; None: they arrive rotated."""
    from tritium.kernels import ops
    if cos_sin_cache is not None:
        q, k = ops.rotary(q.clone(), k.clone(), positions, cos_sin_cache)
    q, k, v = q.float(), k.float(), v.float()
    hkv, d = k.shape[1], k.shape[2]
    rep = q.shape[1] // hkv
    starts = (positions == 0).nonzero().flatten().tolist() + [positions.shape[0]]
    for a, b in zip(starts[:-1], starts[1:]):
        n = b - a
        qs = q[a:b].reshape(n, hkv, rep, d)
        scores = torch.einsum("thrd,shd->hrts", qs, k[a:b]) * scale
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        p = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        received = p.sum(dim=(1, 2))  # (Hkv, n): attention each key gets from every query head
        stats["w"] = stats.get("w", 0) + received.sum(dim=1)
        stats["kw"] = stats.get("kw", 0) + torch.einsum("hs,shd->hd", received, k[a:b])
        stats["vw"] = stats.get("vw", 0) + torch.einsum("hs,shd->hd", received, v[a:b])
