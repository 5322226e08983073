"""Training data pipeline: randomness modes, token-budget bucketing, collate, the dataset, prefetch."""

from streamtrain.data.bucketing import (
    DEFAULT_BATCHES_PER_POOL,
    BatchPlan,
    PassDiagnostics,
    TokenBudget,
    auto_pool_size,
    describe_plan,
    equalize_batch_count,
    plan_batches,
)
from streamtrain.data.collate import Batch, collate, collate_flat
from streamtrain.data.dataset import WindowBatchDataset
from streamtrain.data.prefetch import Prefetcher
from streamtrain.data.randomness import (
    SHUFFLE_MODES,
    CryptoRandomness,
    Randomness,
    SeededRandomness,
    ShuffleMode,
    derive_seed,
    derive_seed_sequence,
    make_randomness,
)

__all__ = [
    "DEFAULT_BATCHES_PER_POOL",
    "SHUFFLE_MODES",
    "Batch",
    "BatchPlan",
    "CryptoRandomness",
    "PassDiagnostics",
    "Prefetcher",
    "Randomness",
    "SeededRandomness",
    "ShuffleMode",
    "TokenBudget",
    "WindowBatchDataset",
    "auto_pool_size",
    "collate",
    "collate_flat",
    "derive_seed",
    "derive_seed_sequence",
    "describe_plan",
    "equalize_batch_count",
    "make_randomness",
    "plan_batches",
]
