"""One randomness interface with two modes: reproducible (seeded) and unpredictable (crypto).

Every random decision the pipeline makes (item order, length tie-breaks, batch order, and
the DP path's Poisson sampling) goes through a :class:`Randomness`. Both modes share one
implementation of every draw on top of a single primitive, a vector of uniform 64-bit
words, so the two modes differ only in where the bits come from:

* ``seeded``: numpy's PCG64, keyed by a :class:`numpy.random.SeedSequence` derived from
  ``(seed, purpose, pass, rank, worker)``. Same inputs, same stream; different purposes,
  passes, ranks or workers get statistically independent streams (``SeedSequence``
  hashes the spawn key). The purpose tag keeps decisions apart that would otherwise
  draw from one stream: the pass sampler's choice of items (``select``) and the batch
  planner's order (``plan``) for the same pass are two children of the seed, so a
  change in one never shifts the other.
* ``crypto``: every bit comes from the OS CSPRNG (``os.urandom``). Not reproducible by
  design: differential privacy needs sampling and order an adversary cannot predict.

Why the derived draws are exact (no modulo or rounding bias), given uniform words:

* :meth:`Randomness.integers` rejects words at or above the largest multiple of ``high``
  below 2**64, so every residue has exactly the same number of accepted preimages.
* :meth:`Randomness.bernoulli` compares an infinite uniform binary fraction ``U`` with
  ``p`` 64 bits at a time and only draws more bits on an exact tie, so
  ``P(U < p) == p`` for every float64 ``p`` (floats are dyadic rationals), not just to
  2**-53.
* :meth:`Randomness.sample` keeps the first ``k`` distinct values of i.i.d. uniform draws
  in order of first appearance; the draws' law does not change when the values are
  relabelled, so every ordered ``k``-tuple of distinct values is equally likely.
* :meth:`CryptoRandomness.permutation` argsorts i.i.d. uniform 64-bit keys. An i.i.d.
  vector's law does not change when its coordinates are permuted, and "all keys
  distinct" is a permutation-invariant event, so conditioned on it every ordering of
  the keys is equally likely; a draw with any tie (probability about n**2 / 2**65) is
  rejected as a whole and redrawn, which is exactly that conditioning.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import ClassVar, Final, Literal, get_args

import numpy as np
from numpy.typing import ArrayLike

from streamtrain.data._validate import require_int

ShuffleMode = Literal["seeded", "crypto"]
SHUFFLE_MODES: Final[tuple[str, ...]] = get_args(ShuffleMode)

StreamPurpose = Literal["plan", "select", "worker", "torch", "linear"]
"""What a stream decides: batch planning, pass selection, a DataLoader worker's torch seed,
the trainer's torch generator (re-seeded when a restore changes SEED), the window sample
the linear forecaster is fitted on."""
STREAM_PURPOSES: Final[tuple[str, ...]] = get_args(StreamPurpose)
# The first word of every spawn key; fixed numbers, so a stream never changes with code order.
_PURPOSE_TAGS: Final[dict[str, int]] = {"plan": 1, "select": 2, "worker": 3, "torch": 4, "linear": 5}

_TWO_POW_64: Final = 2**64
_TWO_POW_64_FLOAT: Final = float(2**64)
_TWO_POW_MINUS_53: Final = 2.0**-53


class Randomness(ABC):
    """Draws built on one primitive, :meth:`raw_uint64`; subclasses only supply the bits."""

    mode: ClassVar[ShuffleMode]
    reproducible: ClassVar[bool]

    @abstractmethod
    def raw_uint64(self, n: int) -> np.ndarray:
        """``n`` independent uniform 64-bit words (``uint64 [n]``)."""

    def random(self, n: int) -> np.ndarray:
        """``n`` uniform float64 in [0, 1) on the 2**-53 grid (top 53 bits of a word)."""
        words = self.raw_uint64(require_int(n, "n"))
        return (words >> np.uint64(11)).astype(np.float64) * _TWO_POW_MINUS_53

    def integers(self, high: int, n: int) -> np.ndarray:
        """``n`` uniform int64 in ``[0, high)`` by rejection (no modulo bias)."""
        n = require_int(n, "n")
        high = require_int(high, "high", 1)
        if high >= 2**63:
            raise ValueError(f"high must be below 2**63 (an int64 result), got {high}")
        accept_below = _TWO_POW_64 - _TWO_POW_64 % high  # a multiple of high, <= 2**64
        out = np.empty(n, dtype=np.int64)
        pending = np.arange(n)
        while pending.size:
            words = self.raw_uint64(pending.size)
            if accept_below < _TWO_POW_64:
                ok = words < np.uint64(accept_below)
            else:
                ok = np.ones(pending.size, dtype=bool)
            out[pending[ok]] = (words[ok] % np.uint64(high)).astype(np.int64)
            pending = pending[~ok]
        return out

    def bernoulli(self, p: ArrayLike) -> np.ndarray:
        """One exact Bernoulli(p[i]) draw per element of ``p``: bool, same shape as ``p``.

        Compares a uniform binary fraction with ``p`` in 64-bit chunks; element ``i`` needs
        another chunk only when the first 64 bits equal ``p``'s exactly (chance 2**-64).
        """
        probs = np.asarray(p, dtype=np.float64)
        if not np.all(np.isfinite(probs)) or np.any((probs < 0.0) | (probs > 1.0)):
            raise ValueError("bernoulli probabilities must be finite and within [0, 1]")
        flat = probs.ravel()
        out = flat >= 1.0  # p == 1 is certain; p == 0 falls out of the loop as False
        pending = np.flatnonzero((flat > 0.0) & (flat < 1.0))
        remainder = flat[pending]  # the part of p not yet decided, as a fraction in [0, 1)
        while pending.size:
            scaled = remainder * _TWO_POW_64_FLOAT  # exact: scaling by a power of two
            whole = np.floor(scaled)
            words = self.raw_uint64(pending.size)
            threshold = whole.astype(np.uint64)  # exact: an integer float below 2**64
            out[pending[words < threshold]] = True
            # On an exact tie the outcome depends on the next chunk versus the fraction left.
            tie = (words == threshold) & (scaled > whole)
            pending, remainder = pending[tie], (scaled - whole)[tie]
        return out.reshape(probs.shape)

    def permutation(self, n: int) -> np.ndarray:
        """A uniformly random permutation of ``range(n)`` as int64 (see module docstring)."""
        n = require_int(n, "n")
        while True:
            keys = self.raw_uint64(n)
            order = np.argsort(keys)  # stability is moot: a draw with ties is thrown away
            sorted_keys = keys[order]
            if n < 2 or not np.any(sorted_keys[1:] == sorted_keys[:-1]):
                return order.astype(np.int64, copy=False)

    def sample(self, n: int, k: int) -> np.ndarray:
        """``k`` distinct ints of ``range(n)`` as int64, every ordered ``k``-tuple equally likely.

        The first ``k`` distinct values of a sequence of i.i.d. uniform draws, in the order
        they first appear: by exchangeability that is a uniform ordered ``k``-tuple, and the
        work is O(k), where a permutation's is O(n) (a pass of 8,192 items from a window of
        10M: docs/operations.md). Where ``k`` is a large share of ``n`` and draws would
        repeat often, the first ``k`` of a permutation.
        """
        n = require_int(n, "n")
        k = require_int(k, "k")
        if k > n:
            raise ValueError(f"cannot take {k} distinct items of {n}")
        if k == 0:
            return np.zeros(0, dtype=np.int64)
        if 4 * k > n:
            return self.permutation(n)[:k]
        draws = self.integers(n, k + k * k // n + 16)  # ~k**2 / 2n repeats expected
        while True:
            values, first = np.unique(draws, return_index=True)
            if values.size >= k:
                return draws[np.sort(first)[:k]]
            draws = np.concatenate([draws, self.integers(n, 2 * (k - values.size) + 16)])


class SeededRandomness(Randomness):
    """Reproducible PCG64 stream for one ``(seed, purpose, pass, rank, worker)`` coordinate.

    ``rank=None`` / ``worker=None`` mean "shared by all ranks / workers": the batch plan
    uses that coordinate so every rank plans the same pass and then takes its own shard.
    """

    mode: ClassVar[ShuffleMode] = "seeded"
    reproducible: ClassVar[bool] = True

    def __init__(
        self,
        seed: int,
        pass_index: int = 0,
        rank: int | None = None,
        worker: int | None = None,
        *,
        purpose: StreamPurpose = "plan",
    ):
        self.purpose = purpose
        self.seed_sequence = derive_seed_sequence(seed, pass_index, rank, worker, purpose=purpose)
        self.generator = np.random.Generator(np.random.PCG64(self.seed_sequence))

    def raw_uint64(self, n: int) -> np.ndarray:
        return self.generator.bit_generator.random_raw(require_int(n, "n"))

    def permutation(self, n: int) -> np.ndarray:
        # numpy's Fisher-Yates with unbiased bounded integers: same law, fewer draws.
        return self.generator.permutation(require_int(n, "n")).astype(np.int64, copy=False)


class CryptoRandomness(Randomness):
    """Unpredictable draws: every bit from the OS CSPRNG; accepts no seed on purpose."""

    mode: ClassVar[ShuffleMode] = "crypto"
    reproducible: ClassVar[bool] = False

    def raw_uint64(self, n: int) -> np.ndarray:
        n = require_int(n, "n")
        return np.frombuffer(bytearray(os.urandom(8 * n)), dtype="<u8").astype(np.uint64, copy=False)


def derive_seed_sequence(
    seed: int,
    pass_index: int = 0,
    rank: int | None = None,
    worker: int | None = None,
    *,
    purpose: StreamPurpose = "plan",
) -> np.random.SeedSequence:
    """The SeedSequence of one stream: entropy ``seed``, spawn key ``(purpose, pass, rank, worker)``.

    That is the ``(pass, rank, worker)`` descendant of the root ``SeedSequence(seed)``'s
    child for the purpose tag: what ``SeedSequence.spawn`` would hand out, addressed by
    name so that no stream depends on how many were spawned before it. ``None`` (shared
    by all ranks or workers) is encoded as 0 and index ``i`` as ``i + 1``, so a shared
    stream never coincides with rank 0's or worker 0's own stream.
    """
    seed = require_int(seed, "seed")
    pass_index = require_int(pass_index, "pass_index")
    if purpose not in _PURPOSE_TAGS:
        raise ValueError(f"stream purpose must be one of {STREAM_PURPOSES}, got {purpose!r}")
    rank_key = 0 if rank is None else require_int(rank, "rank") + 1
    worker_key = 0 if worker is None else require_int(worker, "worker") + 1
    return np.random.SeedSequence(entropy=seed, spawn_key=(_PURPOSE_TAGS[purpose], pass_index, rank_key, worker_key))


def derive_seed(
    seed: int,
    pass_index: int = 0,
    rank: int | None = None,
    worker: int | None = None,
    *,
    purpose: StreamPurpose = "worker",
) -> int:
    """A 63-bit integer seed for libraries that take one (``torch.manual_seed``), per stream."""
    sequence = derive_seed_sequence(seed, pass_index, rank, worker, purpose=purpose)
    word = sequence.generate_state(1, dtype=np.uint64)[0]
    return int(word >> np.uint64(1))


def make_randomness(
    mode: ShuffleMode,
    seed: int = 0,
    pass_index: int = 0,
    rank: int | None = None,
    worker: int | None = None,
    *,
    purpose: StreamPurpose = "plan",
) -> Randomness:
    """The randomness for one stream; ``crypto`` ignores the coordinates by design."""
    if mode == "seeded":
        return SeededRandomness(seed, pass_index, rank, worker, purpose=purpose)
    if mode == "crypto":
        return CryptoRandomness()
    raise ValueError(f"shuffle mode must be one of {SHUFFLE_MODES}, got {mode!r}; set STREAMTRAIN_SHUFFLE accordingly")
