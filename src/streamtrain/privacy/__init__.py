"""Differential privacy for streaming training, split as Opacus splits it.

config (the public schedule) · clock (the public clock) · window (admission per clock step,
K-step eligibility, the event or sensor unit) · admissions (the durable admission record) ·
sampling (Poisson with q_j) · per_sample (torch.func gradients, clipping onto an integer
grid) · noise (exact discrete Gaussian from the CSPRNG) · accounting (per-unit ε with
dp_accounting) · validators (start-up refusals) · engine (one DP-SGD step on the public
clock) · trainer (the DP trainer the service runs). See docs/privacy.md.
"""

from streamtrain.privacy.accounting import PerEventAccountant, SensorLifetimeAccountant
from streamtrain.privacy.admissions import AdmissionRecord, AdmissionRecordError, participation
from streamtrain.privacy.clock import DPClock
from streamtrain.privacy.config import DPConfig, DPConfigError
from streamtrain.privacy.engine import DPAggregates, DPEngine, DPStepReport, public_norm
from streamtrain.privacy.noise import DiscreteGaussianNoise, discrete_gaussian
from streamtrain.privacy.per_sample import PerSampleGradients, clip_factors, sensor_per_sample_loss
from streamtrain.privacy.sampling import PoissonSampler
from streamtrain.privacy.validators import check_dp_safety, check_model_static, check_ranges
from streamtrain.privacy.window import DPWindow, EligibleSet, StepDecision

__all__ = [
    "AdmissionRecord",
    "AdmissionRecordError",
    "DPAggregates",
    "DPClock",
    "DPConfig",
    "DPConfigError",
    "DPEngine",
    "DPStepReport",
    "DPWindow",
    "DiscreteGaussianNoise",
    "EligibleSet",
    "PerEventAccountant",
    "PerSampleGradients",
    "PoissonSampler",
    "SensorLifetimeAccountant",
    "StepDecision",
    "discrete_gaussian",
    "participation",
    "check_dp_safety",
    "check_model_static",
    "check_ranges",
    "clip_factors",
    "public_norm",
    "sensor_per_sample_loss",
]
