"""Counter-based random streams: a seeded sequence's draws are the same numbers on every device.

A seeded sequence owns a SeedStream (seed, counter). Draw number c of the stream has the 32-bit
key K_c = mix(mix(seed) ^ c); its uniform for vocabulary id i is built from
h = mix32(K_c ^ mix32(i)), u = (h >> 8 + 1/2) / 2^24, and its Exp(1) value is -log u. The
integer part is exact in int64 torch arithmetic on any device (the mixer's multipliers are below
2^31, so no product reaches 2^63), so the host sampler, the device sampler and speculative
verification see identical uniforms on CPU and on CUDA; only the final log may round differently
in its last bit between devices. A draw is indexed by vocabulary id, so the device sampler
computes the noise of a top-k row at its k candidates only, and a row's noise never depends on
what else shares the batch.

mix32 is a two-round xor-shift-multiply mixer (Wellons' "hash prospector" lowbias32 family,
constants 0x21f0aaad and 0x735a2d97, both < 2^31). Unseeded sequences use torch's default
generator of the logits' device instead.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x21F0AAAD, 0x735A2D97
_TWO_M24 = 1.0 / (1 << 24)


def mix32_int(x: int) -> int:
    """mix32 on a Python int (0 <= x < 2^32)."""
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    return x ^ (x >> 15)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """mix32 element-wise on an int64 tensor of values in [0, 2^32); exact on every device."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 15)


_ID_HASH: Dict[Tuple[int, str], torch.Tensor] = {}


def id_hash(vocab: int, device) -> torch.Tensor:
    """mix32(i) for i in [0, vocab) on `device` (int64; computed once per vocabulary and device)."""
    device = torch.device(device)
    key = (vocab, str(device))
    t = _ID_HASH.get(key)
    if t is None:
        t = _ID_HASH[key] = mix32(torch.arange(vocab, dtype=torch.int64, device=device))
    return t


def uniforms_from_hash(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniforms in (0, 1): 24 bits, centred in their cell (never 0 or 1)."""
    return ((h >> 8).to(torch.float32) + 0.5) * _TWO_M24


def exponential_at(keys: torch.Tensor, ids_hashed: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise of draws `keys` (R,) int64 at hashed ids (V,) or (R, K) -> (R, V) / (R, K) float32."""
    h = mix32(keys[:, None] ^ ids_hashed)
    return -torch.log(uniforms_from_hash(h))


class SeedStream:
    """The random stream of one seeded sequence; `counter` draws have been taken from it."""
    __slots__ = ("seed", "counter", "_base")

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.counter = 0
        # Fold a 64-bit seed into 32 bits through the mixer (both halves count).
        self._base = mix32_int((mix32_int(self.seed & _M32) ^ (self.seed >> 32)) & _M32)

    def next_key(self) -> int:
        """The key of the next draw (and advance the stream)."""
        k = mix32_int(self._base ^ (self.counter & _M32))
        self.counter += 1
        return k

    def exponential(self, vocab: int, device="cpu") -> torch.Tensor:
        """One vocabulary-sized Exp(1) draw (V,) float32 on `device`."""
        keys = torch.tensor([self.next_key()], dtype=torch.int64, device=device)
        return exponential_at(keys, id_hash(vocab, device))[0]

    def uniform(self) -> float:
        """One Uniform(0, 1) number (a whole draw: the uniform at id 0)."""
        return (((mix32_int(self.next_key() ^ mix32_int(0)) >> 8) + 0.5) * _TWO_M24)
