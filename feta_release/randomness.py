"""Randomness for everything that touches private data: at least 128 bits of OS entropy in every seed.

``torch.Generator.manual_seed`` takes 64 bits, and numpy's ``default_rng(secrets.randbits(63))`` would keep
only 63: a seed that small can be searched exhaustively by anyone who wants to subtract the noise. Here a
torch generator's whole Mersenne-Twister state (624 x 32 bits) is filled from a key of >= 256 bits (expanded
with SHAKE-256, a standard XOF: no home-made construction), and numpy generators are seeded with 256-bit
integers (``SeedSequence`` takes arbitrary-size entropy).

Known limitation (documented in the README): the samplers behind these generators (Mersenne Twister, PCG64)
and the floating-point Gaussian noise are not cryptographic and the noise is not exactly a Gaussian on the
reals (Mironov 2012: floating-point attacks on Laplace/Gaussian noise). Seeds are unpredictable; the
noise distribution itself is only approximately the one the accountant assumes.
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
import torch

__all__ = [
    "SEED_BYTES",
    "os_key",
    "torch_generator_from",
    "os_torch_generator",
    "numpy_generator_from",
    "os_numpy_generator",
]

SEED_BYTES = 32  # 256 bits
_MT_WORDS = 624
# torch's CPU generator state (CPUGeneratorImplStateLegacy): uint64 initial seed, int left, int seeded,
# uint64 next, then 624 uint64 slots holding the 32-bit MT19937 words, then the normal-sample cache.
_MT_OFFSET = 24


def os_key() -> bytes:
    """A fresh 256-bit key from the OS (``secrets``)."""
    return secrets.token_bytes(SEED_BYTES)


def torch_generator_from(key: bytes) -> torch.Generator:
    """A CPU torch generator whose full MT19937 state is derived from ``key`` (>= 16 bytes; deterministic, so
    a run can be resumed from a stored key; the state is also saved in checkpoints)."""
    if len(key) < 16:
        raise ValueError(f"a private seed needs >= 128 bits, got {len(key) * 8}")
    g = torch.Generator()
    state = g.get_state().clone()
    if state.numel() < _MT_OFFSET + 8 * _MT_WORDS:
        raise RuntimeError(f"unexpected torch generator state of {state.numel()} bytes; cannot seed it fully")
    words = np.frombuffer(hashlib.shake_256(b"feta-torch-mt19937\n" + key).digest(4 * _MT_WORDS), dtype="<u4")
    words = words.astype("<u8")
    if not words.any():  # the all-zero MT state is degenerate (probability 2^-19968)
        words[0] = 1
    state[_MT_OFFSET : _MT_OFFSET + 8 * _MT_WORDS] = torch.frombuffer(
        bytearray(words.tobytes()), dtype=torch.uint8
    )
    g.set_state(state)
    return g


def os_torch_generator() -> torch.Generator:
    """A torch generator seeded with 256 fresh bits from the OS (nobody, the coordinator included, can predict
    it)."""
    return torch_generator_from(os_key())


def numpy_generator_from(key: bytes) -> np.random.Generator:
    if len(key) < 16:
        raise ValueError(f"a private seed needs >= 128 bits, got {len(key) * 8}")
    return np.random.default_rng(int.from_bytes(key, "little"))


def os_numpy_generator() -> np.random.Generator:
    """A numpy PCG64 generator seeded with 256 fresh bits from the OS."""
    return numpy_generator_from(os_key())
