"""Request and response models: the HTTP contract that becomes the OpenAPI document."""

from __future__ import annotations

from typing import Annotated, Any, Literal

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


class CheckpointChainReport(BaseModel):
    """A checkpoint holds the window whole (a base) or what changed since the last one (a delta);
    scaled out, this rank's shard of it."""

    last_kind: Literal["base", "delta"] | None = Field(description="The newest checkpoint's window; null before one")
    chain_length: int = Field(description="Deltas since the newest base (0: the newest checkpoint is a base)")
    base_bytes: int = Field(description="Size of that base's file (scaled out: this rank's shard)")
    deltas_bytes: int = Field(
        description="Sizes of the delta files (shards) since it, summed (a new base at base_bytes)"
    )
    bytes_written: dict[str, int] = Field(description="Checkpoint bytes this process wrote, by kind: base, delta")
    written: dict[str, int] = Field(description="Checkpoints this process wrote, by kind: base, delta")


class ReadingsCompactionReport(BaseModel):
    """The window's readings compactions since the process started: planned at a cut, gathered on a
    thread of their own while ingest goes on, swapped in at a later cut."""

    in_flight: bool = Field(description="A compaction is planned and not swapped in yet")
    merges_total: int = Field(description="Compactions swapped in")
    bytes_total: int = Field(description="Bytes of readings they gathered into new chunks")
    last_gather_s: float | None = Field(description="How long the last one's gather took; null before one")
    last_bytes: int = Field(description="Bytes of readings the last one gathered")


class WindowReport(BaseModel):
    """The ``*_total`` fields count the Kafka messages the window's offsets cover, once each:
    a checkpoint saves them with the offsets, so they survive restarts and never count a
    replayed message twice. ``seen_total == accepted_total + sum(rejected_total) + held_out_total`` and
    ``size == accepted_total - evicted_total``. The Prometheus counters of the same names
    count what this process did since it started."""

    size: int = Field(description="Items in the window")
    capacity: int = Field(description="Most items the window holds (WINDOW_CAPACITY)")
    seen_total: int = Field(description="Messages covered: accepted_total, every rejected message and held_out_total")
    accepted_total: int = Field(description="Valid events offered to the window")
    rejected_total: dict[str, int] = Field(description="Refused (dead-lettered) messages by reason")
    held_out_total: int = Field(
        description="Valid events kept out of the window for the publish gate's holdout (HOLDOUT_SHARE)"
    )
    evicted_total: int = Field(
        description="Accepted events not in the window: lost the reservoir race (on arrival or later) "
        "or expired (MAX_AGE_S)"
    )
    half_life_s: float | None = Field(description="Recency half-life; null means a uniform reservoir")
    tokens: int = Field(description="Sum of lengths in the window")
    sensors: int = Field(description="Distinct sensor ids in the window")
    age_s: Quantiles | None
    length: Quantiles | None
    next_offsets: dict[str, int] = Field(description="Partition -> next offset the window covers")
    last_record_age_s: float | None = Field(
        None, description="Seconds since the consumer last read a record from Kafka; null before the first"
    )
    ingest_restarts_total: dict[str, int] = Field(
        default_factory=dict,
        description="Consumers recreated since start, by reason (unassigned, no_fetch_progress, no_heartbeat, error)",
    )
    dead_letters_pending: int = Field(0, description="Dead letters not yet acknowledged by Kafka")
    partitions: list[int] = Field(
        default_factory=list, description="Partitions this process consumes, ascending (scaled out: those it owns)"
    )
    checkpoints: CheckpointChainReport | None = Field(
        None, description="What this process's checkpoints wrote of the window (scaled out: this rank's shards)"
    )
    readings_compaction: ReadingsCompactionReport | None = Field(
        None, description="The window's readings compactions since the process started"
    )


class DPReport(BaseModel):
    model_config = ConfigDict(extra="allow")
    epsilon: float = Field(description="Largest epsilon any single privacy unit (event or sensor) has spent so far")
    delta: float
    target_epsilon: float
    unit: str = Field("event", description="The privacy unit: event or sensor")


class QualityReport(BaseModel):
    model_config = ConfigDict(extra="allow")
    n: int = Field(description="Events scored by the serving model before they were trained on")
    prequential_mse: float | None = Field(description="Forecast MSE per step of the serving model (fading average)")
    naive_mse: float | None = Field(description="The last-value forecast's MSE on the same events")
    skill: float | None = Field(description="1 - prequential_mse / naive_mse")
    drifts: int = Field(description="Drift detections so far")


class ModelReport(BaseModel):
    version: int | None
    step: int
    tokens_trained: int | None = Field(description="Real tokens trained on (null in DP mode: data-dependent)")
    loss: float | None
    published_at: float | None
    dp: DPReport | None
    training: dict[str, Any] = Field(default_factory=dict, description="Pass diagnostics and timings")
    quality: QualityReport | None = Field(
        None, description="Test-then-train quality of the serving model; null until the first event was scored"
    )
    versions: list[int] = Field(default_factory=list, description="Kept versions (rollback targets), ascending")
    forecaster: dict[str, Any] | None = Field(
        None,
        description="What the serving version forecasts with (kind: network, last_value, linear or blend) and, "
        "from the last publication, each forecaster's held-out MSE and why the candidate was or was not "
        "published; null in DP mode",
    )
    replays_per_event: float | None = Field(
        None,
        description="Mean times each accepted event was trained on (bounded by MAX_REPLAYS_PER_EVENT); null in DP mode",
    )
    world_size: int = Field(1, description="Ranks that train this one model (WORLD_SIZE; 1 for one process)")
    rank: int = Field(0, description="This process's rank, 0..world_size-1")


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: int = Field(strict=True, description="A kept version (see /v1/model versions)")


class RollbackResult(BaseModel):
    version: int = Field(description="The version that serves now")
    previous: int | None = Field(description="The version that served before")


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
    model_age_s: float = Field(description="Seconds since the answering version was published")
    predictions: list[PredictionOut]


class CheckpointResult(BaseModel):
    path: str
    step: int


class ErrorOut(BaseModel):
    detail: Any


# ---------------------------------------------------------------------- Open Inference Protocol v2
# The KServe / Triton request and response bodies. The infer route reads the body itself
# (JSON, or JSON plus binary tensor data), checks it with these models and answers
# ``{"error": ...}``; they are also what the OpenAPI document shows.


class OIPTensorIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(description="values (required) or lengths (optional)")
    shape: list[Annotated[int, Field(ge=0)]] = Field(description="values: [batch, length, channels]; lengths: [batch]")
    datatype: str = Field(description="values: FP32; lengths: INT32 or INT64", examples=["FP32"])
    parameters: dict[str, Any] | None = Field(
        None, description="binary_data_size: the tensor's bytes follow the JSON header (binary extension)"
    )
    data: list[Any] | None = Field(None, description="Row-major contents, flat or nested; absent with binary_data_size")


class OIPRequestedOutput(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(description="next, anomaly_score or probs")
    parameters: dict[str, Any] | None = Field(None, description="binary_data: true answers this output as raw bytes")


class OIPInferRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    id: str | None = Field(None, description="Echoed in the answer")
    model_name: str | None = Field(None, description="Ignored (the path names the model); KServe's client sends it")
    parameters: dict[str, Any] | None = Field(
        None, description="binary_data_output: true answers every output as raw bytes"
    )
    inputs: list[OIPTensorIn] = Field(min_length=1)
    outputs: list[OIPRequestedOutput] | None = Field(
        None, description="Outputs to answer, in this order (default: all)"
    )


class OIPTensorOut(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class OIPInferResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    parameters: dict[str, Any] = Field(description="model_age_s: seconds since this version was published")
    outputs: list[OIPTensorOut]


class OIPTensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class OIPModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[OIPTensorMetadata]
    outputs: list[OIPTensorMetadata]


class OIPServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class OIPLive(BaseModel):
    live: bool


class OIPReady(BaseModel):
    ready: bool
    name: str | None = None
    error: str | None = None


class OIPError(BaseModel):
    error: str
