"""Differential privacy for streaming training, split as Opacus splits it.

config (the public schedule) · window (admission per public-clock step, K-step eligibility)
· sampling (Poisson with q_j) · per_sample (torch.func gradients, clipping) · noise
(CSPRNG Gaussian, hardened) · accounting (per-event ε with dp_accounting) · validators
(start-up refusals) · engine (one DP-SGD step on the public clock). See docs/privacy.md.
"""

from streamtrain.privacy.accounting import PerEventAccountant
from streamtrain.privacy.config import DPConfig, DPConfigError
from streamtrain.privacy.engine import DPAggregates, DPEngine, DPStepReport, public_norm
from streamtrain.privacy.noise import SecureGaussianNoise
from streamtrain.privacy.per_sample import PerSampleGradients, clip_factors, sensor_per_sample_loss
from streamtrain.privacy.sampling import PoissonSampler
from streamtrain.privacy.validators import check_dp_safety, check_model_static, check_ranges
from streamtrain.privacy.window import DPClock, DPWindow, EligibleSet

__all__ = [
    "DPAggregates",
    "DPClock",
    "DPConfig",
    "DPConfigError",
    "DPEngine",
    "DPStepReport",
    "DPWindow",
    "EligibleSet",
    "PerEventAccountant",
    "PerSampleGradients",
    "PoissonSampler",
    "SecureGaussianNoise",
    "check_dp_safety",
    "check_model_static",
    "check_ranges",
    "clip_factors",
    "public_norm",
    "sensor_per_sample_loss",
]
