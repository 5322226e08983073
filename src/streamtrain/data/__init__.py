"""Training data pipeline: randomness modes, pass sampling policies, token-budget bucketing,
collate, the dataset, prefetch."""

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
from streamtrain.data.collate import Batch, BatchPosition, collate, collate_flat
from streamtrain.data.dataset import WindowBatchDataset
from streamtrain.data.passes import PassSampler, PassSelection, pass_sampler_from_settings
from streamtrain.data.policies import (
    SAMPLING_POLICIES,
    CurriculumPolicy,
    SamplingPolicy,
    SensorBalancedPolicy,
    StratifiedPolicy,
    UniformPolicy,
    make_policy,
)
from streamtrain.data.prefetch import Prefetcher
from streamtrain.data.randomness import (
    SHUFFLE_MODES,
    STREAM_PURPOSES,
    CryptoRandomness,
    Randomness,
    SeededRandomness,
    ShuffleMode,
    StreamPurpose,
    derive_seed,
    derive_seed_sequence,
    make_randomness,
)

__all__ = [
    "DEFAULT_BATCHES_PER_POOL",
    "SAMPLING_POLICIES",
    "SHUFFLE_MODES",
    "STREAM_PURPOSES",
    "Batch",
    "BatchPlan",
    "BatchPosition",
    "CryptoRandomness",
    "CurriculumPolicy",
    "PassDiagnostics",
    "PassSampler",
    "PassSelection",
    "Prefetcher",
    "Randomness",
    "SamplingPolicy",
    "SeededRandomness",
    "SensorBalancedPolicy",
    "ShuffleMode",
    "StratifiedPolicy",
    "StreamPurpose",
    "TokenBudget",
    "UniformPolicy",
    "WindowBatchDataset",
    "auto_pool_size",
    "collate",
    "collate_flat",
    "derive_seed",
    "derive_seed_sequence",
    "describe_plan",
    "equalize_batch_count",
    "make_policy",
    "make_randomness",
    "pass_sampler_from_settings",
    "plan_batches",
]
