"""Request and response models: the HTTP contract that becomes the OpenAPI document."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Health(BaseModel):
    status: str = Field(examples=["ok"])


class Readiness(BaseModel):
    status: str = Field(examples=["ready", "not_ready"])
    reasons: list[str] = Field(default_factory=list)


class Quantiles(BaseModel):
    min: float
    p50: float
    p90: float
    max: float
    mean: float


class WindowReport(BaseModel):
    size: int
    capacity: int
    seen_total: int = Field(description="Messages read from Kafka")
    accepted_total: int = Field(description="Valid events offered to the window")
    rejected_total: dict[str, int] = Field(description="Refused messages by reason")
    evicted_total: int = Field(description="Accepted events pushed out (or never kept)")
    half_life_s: float | None = Field(description="Recency half-life; null means a uniform reservoir")
    tokens: int = Field(description="Sum of lengths in the window")
    sensors: int = Field(description="Distinct sensor ids in the window")
    age_s: Quantiles | None
    length: Quantiles | None
    next_offsets: dict[str, int] = Field(description="Partition -> next offset the window covers")


class DPReport(BaseModel):
    model_config = ConfigDict(extra="allow")
    epsilon: float = Field(description="Largest epsilon any single privacy unit (event or sensor) has spent so far")
    delta: float
    target_epsilon: float
    unit: str = Field("event", description="The privacy unit: event or sensor")


class ModelReport(BaseModel):
    version: int | None
    step: int
    tokens_trained: int | None = Field(description="Real tokens trained on (null in DP mode: data-dependent)")
    loss: float | None
    published_at: float | None
    dp: DPReport | None
    training: dict[str, Any] = Field(default_factory=dict, description="Pass diagnostics and timings")


class Instance(BaseModel):
    # Checked by events.parse_values (one rule per 422, the same rules as Kafka events),
    # so the field accepts anything and only its documented schema is precise.
    values: list[Any] = Field(
        description="Readings, one per time step: numbers (channels = 1) or arrays of C numbers",
        json_schema_extra={
            "examples": [[0.12, 0.53, 0.49]],
            "minItems": 1,
            "items": {"anyOf": [{"type": "number"}, {"type": "array", "items": {"type": "number"}, "minItems": 1}]},
        },
    )


class PredictRequest(BaseModel):
    instances: list[Instance] = Field(description="1..max_predict_batch instances, answered in this order")


class PredictionOut(BaseModel):
    next: list[float] = Field(description="Forecast of the reading after the last one")
    anomaly_score: float = Field(description="Mean squared one-step-ahead error, in units of the training variance")
    probs: list[float] | None = Field(None, description="Class probabilities (only when n_classes > 0)")


class PredictResponse(BaseModel):
    model_version: int
    predictions: list[PredictionOut]


class CheckpointResult(BaseModel):
    path: str
    step: int


class ErrorOut(BaseModel):
    detail: Any
