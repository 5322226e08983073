"""Every setting of the service, validated once at start-up.

Sources, strongest first: explicit keyword arguments, environment variables
``STREAMTRAIN_<NAME>``, a TOML file (``--config FILE``), then the defaults below. The
defaults work against a local broker on ``localhost:9092``. A bad value stops start-up
with one line that names the setting (:func:`load_settings`).
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from streamtrain.ingest import security as kafka_security
from streamtrain.runtime.cpus import parse_cpu_list

if TYPE_CHECKING:
    from streamtrain.device import Precision

ENV_PREFIX = "STREAMTRAIN_"

#: What a GPU gets instead of the CPU defaults, field by field, unless that field was set
#: (keyword, environment or TOML). The CPU defaults would leave a GPU idle: a step of a
#: 64-wide, 2-layer model over 8,192 tokens is well under a millisecond of kernels, less
#: than the host needs to plan, launch and check it, so the GPU would wait on the host. A
#: 512-wide, 6-layer model over 65,536-token batches gives each step tens of milliseconds
#: of kernels, against a few milliseconds of host work per step. docs/accelerators.md.
GPU_PROFILE: dict[str, Any] = {
    "d_model": 512,
    "n_heads": 8,
    "n_layers": 6,
    "token_budget": 65536,
    "max_batch_sequences": 4096,
    "amp": "bf16",
}


class SettingsError(ValueError):
    """A setting is invalid; ``str(error)`` is one line naming it."""


class Settings(BaseSettings):
    """The outside contract's settings (docs/contract.md, section 4) plus tuning knobs."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        case_sensitive=False,
        extra="forbid",
        validate_default=True,
    )
    _toml_path: ClassVar[Path | None] = None
    _gpu_profile: tuple[str, ...] = PrivateAttr(default=())

    # --- Kafka -------------------------------------------------------------------------
    kafka_bootstrap: str = Field("localhost:9092", description="Kafka bootstrap servers, comma separated")
    topic: str = Field("sensor-events", min_length=1, max_length=200, description="Topic with sensor events")
    group_id: str = Field("streamtrain", min_length=1, description="Kafka consumer group")
    group_instance_id: str | None = Field(
        None,
        min_length=1,
        max_length=249,
        description=(
            "Static group membership: a stable id per replica (e.g. the pod name); a restarted replica gets its "
            "partitions back at once instead of after the 45 s session timeout"
        ),
    )
    topic_partitions: int = Field(3, ge=1, le=1024, description="Partitions when the service creates the topic")
    topic_replication_factor: int | None = Field(
        None,
        ge=1,
        le=32767,
        description=(
            "Replication factor of the topics the service creates (the topic and its .dlq); unset = the broker's "
            "default.replication.factor"
        ),
    )
    poll_max_records: int = Field(5000, ge=1, le=100_000, description="Records per consumer poll batch")
    max_message_bytes: int = Field(1 << 20, ge=64, description="Larger messages are dead-lettered as too_large")
    decode_workers: int = Field(1, ge=0, le=64, description="Processes that decode poll batches (0 = ingest thread)")
    ingest_stall_timeout_s: float = Field(
        15.0,
        ge=1.0,
        le=3600.0,
        description=(
            "The ingest watchdog recreates the consumer when it stays unassigned, fetches nothing while records wait, "
            "or gets no heartbeat through for this long; /readyz reports ingest_stalled after half of it"
        ),
    )
    dlq_send_attempts: int = Field(
        5,
        ge=1,
        le=1000,
        description=(
            "Failed attempts to forward a rejected message unchanged to the .dlq before a bounded stand-in goes "
            "instead (at once when the .dlq refuses the record itself)"
        ),
    )
    dlq_stand_in_bytes: int = Field(
        1024, ge=0, le=1 << 20, description="Bytes of the original value (and key) a dead-letter stand-in keeps"
    )

    # --- Kafka security (docs/contract.md, section 4; kafka-python options: kafka_security.py) ----
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How every Kafka client connects: PLAINTEXT, SSL (TLS), SASL_PLAINTEXT or SASL_SSL"
    )
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = Field(
        None,
        description=(
            "SASL mechanism (SASL_* protocols): PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER (token from "
            "KAFKA_SASL_PASSWORD_FILE, re-read when it changes)"
        ),
    )
    kafka_sasl_username: str | None = Field(None, min_length=1, description="SASL user name (PLAIN, SCRAM)")
    kafka_sasl_password: SecretStr | None = Field(
        None, description="SASL password (PLAIN, SCRAM); never logged or shown"
    )
    kafka_sasl_password_file: Path | None = Field(
        None,
        description=(
            "File holding the SASL password (a mounted secret, read at every connect) or, with OAUTHBEARER, the token"
        ),
    )
    kafka_ssl_cafile: Path | None = Field(
        None, description="PEM file of the CA(s) that sign the brokers' certificates; unset = the system trust store"
    )
    kafka_ssl_certfile: Path | None = Field(
        None, description="Client certificate (PEM) for mutual TLS; needs KAFKA_SSL_KEYFILE"
    )
    kafka_ssl_keyfile: Path | None = Field(None, description="Client private key (PEM) for mutual TLS")
    kafka_ssl_check_hostname: bool = Field(True, description="Verify the broker's host name against its certificate")

    # --- HTTP ----------------------------------------------------------------------------
    http_host: str = Field("0.0.0.0", description="HTTP bind address")
    http_port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    max_predict_batch: int = Field(256, ge=1, le=10_000, description="Instances per /v1/predict request")
    max_request_bytes: int = Field(8 << 20, ge=1024, description="Request bodies above this answer 413")
    predict_concurrency: int = Field(
        2,
        ge=1,
        le=256,
        description="Predict worker threads (forwards at once); waiting requests merge into their next forward",
    )
    predict_queue: int = Field(32, ge=0, le=10_000, description="Predict requests that may wait; beyond: 503")
    predict_merge_instances: int = Field(
        1024, ge=1, le=100_000, description="Most instances of merged requests in one predict forward"
    )
    admin_token: SecretStr | None = Field(None, description="Bearer token for /v1/admin; unset = admin routes off")

    # --- Events and window ---------------------------------------------------------------------
    window_capacity: int = Field(100_000, ge=1, le=50_000_000, description="Reservoir window size W")
    half_life_s: float = Field(3600.0, gt=0, description="Recency half-life in event time; inf = uniform")
    max_age_s: float | None = Field(None, gt=0, description="Reject and evict events older than this")
    max_future_skew_s: float = Field(300.0, ge=0, description="Events further ahead of the clock are rejected")
    max_len: int = Field(512, ge=1, le=1_000_000, description="Most time steps per event")
    channels: int = Field(1, ge=1, le=4096, description="Numbers per time step")
    n_classes: int = Field(0, ge=0, le=100_000, description="Label classes; 0 = no classification head")

    # --- Data pipeline -------------------------------------------------------------------------
    token_budget: int = Field(2048, ge=1, description="Padded tokens per batch (sequences x padded length)")
    max_batch_sequences: int = Field(1024, ge=1, description="Cap on sequences per batch")
    pad_to_multiple_of: int = Field(1, ge=1, le=4096, description="Round padded length up to this")
    pool_size: int = Field(4096, ge=1, description="Items sorted together when bucketing by length")
    pass_max_items: int = Field(
        768,
        ge=0,
        description=(
            "Items per training pass (0 = the whole window); smaller: lower event-to-trained latency, more padding"
        ),
    )
    min_batches_per_pass: int = Field(
        16,
        ge=1,
        le=100_000,
        description=(
            "A pass over a window smaller than this many token budgets is cut into this many smaller batches (more "
            "steps per replay)"
        ),
    )
    pass_fresh_share: float = Field(
        0.9, ge=0.0, le=1.0, description="Share of a bounded pass kept for events new since the last pass"
    )
    sampling: Literal["uniform", "sensor_balanced", "stratified", "curriculum"] = Field(
        "uniform",
        description=(
            "Which items a bounded pass replays: uniform, sensor_balanced (per-sensor quotas), stratified (label mix "
            "of the window in every batch) or curriculum (short items first, annealed)"
        ),
    )
    sensor_temperature: float = Field(
        2.0,
        gt=0,
        description=(
            "sensor_balanced: sensor s gets a pass share in proportion to n_s^(1/T); 1 = as in the window, inf = equal "
            "shares"
        ),
    )
    curriculum_strength: float = Field(
        3.0,
        ge=0,
        allow_inf_nan=False,
        description="curriculum: initial bias beta against long items, weights exp(-beta * length rank in [0, 1])",
    )
    curriculum_half_life_steps: float = Field(
        500.0, gt=0, description="curriculum: training steps over which beta halves (inf = never anneal)"
    )
    shuffle: Literal["seeded", "crypto"] = Field("seeded", description="seeded (reproducible) or crypto (OS CSPRNG)")
    seed: int = Field(0, ge=0, description="Base seed for seeded mode")

    # --- Model and training --------------------------------------------------------------------
    d_model: int = Field(64, ge=8, le=4096, description="Transformer width")
    n_heads: int = Field(
        4,
        ge=1,
        le=64,
        description="Attention heads (must divide D_MODEL); unset, a checkpoint's own (docs/performance.md)",
    )
    n_layers: int = Field(2, ge=1, le=48, description="Transformer blocks")
    learning_rate: float = Field(1e-3, gt=0, le=1.0, description="AdamW peak learning rate")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    warmup_steps: int = Field(50, ge=0, description="Linear learning-rate warm-up steps")
    grad_clip_norm: float = Field(1.0, gt=0, description="Global gradient-norm clip (non-DP training)")
    min_window_items: int = Field(16, ge=1, description="Training waits until the window holds this many")
    publish_interval_s: float = Field(2.0, gt=0, description="Seconds between model publications")
    publish_max_share: float = Field(
        0.1,
        gt=0,
        le=1,
        description=(
            "Most of the trainer's time publishing may take (the gate's holdout scoring, the linear fit): a slower "
            "publication waits longer than PUBLISH_INTERVAL_S"
        ),
    )
    model_versions_keep: int = Field(
        4, ge=1, le=1000, description="Published model versions kept in memory (the serving one and those before it)"
    )
    torch_threads: int = Field(
        1,
        ge=1,
        le=256,
        description=(
            "Intra-op threads of every torch op in the process: each training step and each of the PREDICT_CONCURRENCY "
            "predict forwards"
        ),
    )
    train_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Added to the OS niceness of the training threads (Linux): predict and ingest get the CPU first",
    )
    train_cpus: str = Field(
        "off",
        description=(
            "CPUs of the training thread alone (Linux): off, auto (the last TORCH_THREADS allowed CPUs) or a CPU list "
            "(2-3); the service's other threads keep the rest. Only where the service owns its CPUs"
        ),
    )
    device: str = Field(
        "auto",
        description=(
            "Where the model trains and predicts: auto (the first CUDA GPU when there is one, else the CPU), cpu, cuda "
            "or cuda:N; on a GPU the GPU profile applies (docs/accelerators.md)"
        ),
    )
    amp: Literal["auto", "bf16", "off"] = Field(
        "auto",
        description=(
            "Mixed precision of the training forward: bf16 (autocast; float32 weights, optimizer and loss; attention "
            "in float32 on the CPU), off, or auto: bf16 on a GPU and on a CPU with AMX, else off, and off with DP=on; "
            "bf16 is refused with DP=on"
        ),
    )
    compile: Literal["on", "off"] = Field(
        "on",
        description=(
            "torch.compile the training forward and the predict forward (compiled on a background thread at start-up, "
            "eager until ready; eager with one log line when compiling is unavailable or fails) or off"
        ),
    )
    prefetch_depth: int = Field(
        1, ge=1, le=64, description="Batches planned ahead of the trainer; each adds a step to event-to-trained latency"
    )

    # --- Learning quality ----------------------------------------------------------------------
    quality_max_events_per_s: float = Field(
        100.0,
        ge=0,
        description=(
            "Events a second the serving model scores before training on them (a random sample beyond); 0 = "
            "prequential scoring off"
        ),
    )
    quality_score_delay_s: float = Field(
        1.0,
        ge=0,
        description=(
            "Seconds after the last scoring when sampled events waiting for company are scored (at once when 64 "
            "wait; each by the model that served on its arrival); 0 = each poll batch's sample at once"
        ),
    )
    quality_half_life_events: float = Field(
        2000.0, gt=0, description="Half-life, in scored events, of the fading prequential averages in /v1/model quality"
    )
    drift_detector: Literal["adwin", "page_hinkley", "off"] = Field(
        "adwin", description="River drift detector on the prequential error: adwin, page_hinkley or off"
    )
    drift_adwin_delta: float = Field(
        0.002, gt=0, lt=1, description="ADWIN confidence delta (smaller: fewer, surer detections)"
    )
    drift_ph_threshold: float = Field(
        100.0,
        gt=0,
        description="Page-Hinkley threshold on the cumulative change of the error relative to its earlier level",
    )
    drift_reaction: Literal["none", "reset_optimizer"] = Field(
        "none", description="What a detected drift does to training: none, or reset_optimizer (clear AdamW's moments)"
    )
    holdout_share: float = Field(
        0.1,
        ge=0,
        description=(
            "Share of fresh events kept out of training to gate publishing and choose the forecaster (0 = gate off, "
            "the network serves unchecked); must be below 1; 0 by default with DP=on, where any other value is refused"
        ),
    )
    holdout_capacity: int = Field(
        256, ge=1, le=100_000, description="Most recent held-out events the publish gate scores"
    )
    holdout_min_events: int = Field(
        32, ge=1, description="Held-out events needed before the gate can hold a candidate back"
    )
    holdout_block_events: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description=(
            "A sensor's consecutive events are held out in blocks of this many; a block longer than the overlap of "
            "consecutive events (sliding windows) also keeps its overlapping neighbours out of training, so no "
            "held-out reading is trained on"
        ),
    )
    publish_gate_tolerance: float = Field(
        0.05,
        ge=0,
        description=(
            "A candidate network is held back when its holdout MSE exceeds (1 + this) x the reference network's (the "
            "best that passed the gate)"
        ),
    )
    linear_max_order: int = Field(
        24,
        ge=1,
        le=64,
        description=(
            "Most lags of the linear (ridge autoregression) forecaster; the order and penalty are chosen per channel "
            "by generalized cross-validation"
        ),
    )
    linear_fit_items: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        description="Window items (a random sample) the linear forecaster is fitted on at each publication",
    )
    max_replays_per_event: float = Field(
        8.0,
        ge=0,
        allow_inf_nan=False,
        description=(
            "Mean times each event may be trained on; a trainer faster than its stream then idles (0 = no limit)"
        ),
    )
    auto_rollback: bool = Field(
        True,
        description=(
            "Roll back to the previous version when its prequential skill beat the serving one's by ROLLBACK_MARGIN"
        ),
    )
    rollback_min_events: int = Field(
        100, ge=1, description="Scored events each version needs before an automatic rollback"
    )
    rollback_margin: float = Field(
        0.1, ge=0, description="Skill drop (1 - mse/naive units) that triggers an automatic rollback"
    )

    # --- Checkpoints ---------------------------------------------------------------------------
    checkpoint_dir: Path = Field(Path("var/checkpoints"), description="Where checkpoints go")
    checkpoint_interval_s: float = Field(60.0, gt=0, description="Seconds between checkpoints")
    checkpoint_keep: int = Field(3, ge=1, le=1000, description="Checkpoints kept")

    # --- Scale-out (WORLD_SIZE > 1, docs/scale-out.md) -----------------------------------------
    dist_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600.0,
        description=(
            "Scale-out: deadline of every collective; a rank that dies or hangs makes the others exit (status 17) "
            "within it"
        ),
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Scale-out: torch.distributed backend; auto = NCCL when training on CUDA, gloo on CPU"
    )

    # --- Differential privacy ------------------------------------------------------------------
    dp: Literal["on", "off"] = Field("off", description="DP-SGD training (needs shuffle=crypto)")
    dp_noise_multiplier: float = Field(1.1, description="Noise multiplier sigma (noise std / clip norm)")
    dp_clip_norm: float = Field(1.0, description="Per-unit gradient clip norm C")
    dp_q0: float = Field(0.05, description="Sampling probability of a fresh eligible record")
    dp_half_life_steps: float = Field(math.inf, description="Recency half-life of q_j in steps; inf = constant")
    dp_eligible_steps: int = Field(100, description="K: steps an admitted record stays eligible")
    dp_admit_per_step: int = Field(64, description="R: records admitted per public-clock step")
    dp_step_rate_hz: float = Field(2.0, description="Public clock: DP steps per second")
    dp_delta: float = Field(
        1e-12, description="delta of the per-unit guarantee (refused when delta x DP_EXPECTED_UNITS > 0.01)"
    )
    dp_target_epsilon: float = Field(
        8.0, description="Per-unit epsilon the configuration must not exceed (sensor unit: over its life)"
    )
    dp_expected_batch_size: float | None = Field(
        None, description="Public divisor of the noisy gradient sum (default: sum_j R*q_j)"
    )
    dp_unit: Literal["event", "sensor"] = Field(
        "event", description="Privacy unit: event (each event) or sensor (all of a sensor's events, lifetime budget)"
    )
    dp_sensor_events: int = Field(
        4, description="Sensor unit: b, most events of one sensor in the DP window (clipped together)"
    )
    dp_expected_units: float = Field(
        1e10, description="Privacy units (events or sensors) the deployment will admit over its whole life; sizes delta"
    )
    dp_admission_dir: Path | None = Field(
        None,
        description=(
            "Where the per-partition admission record lives (default CHECKPOINT_DIR/dp-admissions); shared by replicas"
        ),
    )
    dp_norm_mean: tuple[float, ...] | None = Field(None, description="Public input mean per channel (default 0)")
    dp_norm_std: tuple[float, ...] | None = Field(None, description="Public input std per channel (default 1)")
    dp_token_budget: int = Field(1024, ge=1, description="Padded tokens per DP micro-batch")

    # --- Logging -------------------------------------------------------------------------------
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._toml_path is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=cls._toml_path))
        return tuple(sources)

    @field_validator("half_life_s", "sensor_temperature", "curriculum_half_life_steps", mode="before")
    @classmethod
    def _half_life_accepts_inf(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in {"inf", "infinity", "none", "off"}:
            return math.inf
        return value

    @field_validator("train_cpus")
    @classmethod
    def _cpu_list_or_mode(cls, value: str) -> str:
        value = value.strip().lower()
        if value not in ("off", "auto"):
            parse_cpu_list(value)  # a ValueError names the bad entry
        return value

    @field_validator("device", mode="before")
    @classmethod
    def _device_exists(cls, value: Any) -> str:
        """cpu and cuda[:N] are checked against this machine here; auto is decided with DP (below)."""
        from streamtrain.device import check_device_spec, resolve_device  # torch, imported only to check settings

        spec = check_device_spec(value)
        if spec != "auto":
            spec = str(resolve_device(spec))
        return spec

    @field_validator("holdout_share")
    @classmethod
    def _holdout_leaves_training_data(cls, value: float) -> float:
        if value >= 1:
            raise ValueError(
                "must be below 1: a share of 1 or more would train on nothing; use e.g. 0.02, or 0 for no gate"
            )
        return value

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap_has_port(cls, value: str) -> str:
        for server in value.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"expected host:port[,host:port...], got {value!r}")
        return value

    @field_validator("kafka_security_protocol", "kafka_sasl_mechanism", mode="before")
    @classmethod
    def _kafka_security_names_any_case(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _kafka_security_rules(self) -> Settings:
        kafka_security.check(self)
        return self

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Settings:
        self._place_on_device()
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.sampling == "stratified" and self.n_classes == 0:
            raise ValueError(
                "sampling=stratified balances label classes but n_classes=0 (no labels): "
                "set STREAMTRAIN_N_CLASSES or choose another STREAMTRAIN_SAMPLING"
            )
        if self.sampling in ("sensor_balanced", "curriculum") and self.pass_max_items == 0:
            raise ValueError(
                f"sampling={self.sampling} chooses which items a pass takes, but pass_max_items=0 passes over "
                "the whole window (every item once, whatever the policy): set STREAMTRAIN_PASS_MAX_ITEMS > 0"
            )
        if self.dp == "on" and self.sampling != "uniform":
            raise ValueError(
                f"sampling={self.sampling} does not apply in DP mode (DP-SGD samples events by Poisson on its "
                "public clock, as its accounting assumes): set STREAMTRAIN_SAMPLING=uniform"
            )
        if self.dp == "on" and "holdout_share" not in self.model_fields_set:
            self.__dict__["holdout_share"] = 0.0  # the default gate scores events: off in DP mode unless asked
        if self.dp == "on" and self.holdout_share > 0:
            raise ValueError(
                f"holdout_share ({self.holdout_share}) must be 0 with dp=on: the publish gate scores private events "
                "outside the DP guarantee; set HOLDOUT_SHARE=0 (docs/privacy.md)"
            )
        return self

    def _place_on_device(self) -> None:
        """Resolve ``auto``, refuse what DP mode cannot do, and apply the GPU profile on a GPU.

        The device helpers (and torch) are imported here, not with this module: the CLI's import
        stays light for the processes that import it without loading settings (the decode worker
        the ``streamtrain`` script spawns imports the script again)."""
        from streamtrain.device import fast_bf16_matmul, resolve_device

        if self.dp == "on":
            if self.amp == "auto":
                self.__dict__["amp"] = "off"  # DP's clipping and noise stay float32
            if self.device.startswith("cuda"):
                raise ValueError(
                    f"device={self.device} with dp=on: DP-SGD (privacy/) trains on the CPU, its per-sample "
                    "clipping and noise in float32 or better; set STREAMTRAIN_DEVICE=cpu or auto"
                )
            if self.amp != "off":
                raise ValueError(
                    f"amp={self.amp} with dp=on: the DP step's per-sample gradients, clipping and noise must stay "
                    "float32 or better (its privacy analysis assumes exact clipping); set STREAMTRAIN_AMP=off"
                )
            self.__dict__["device"] = "cpu"  # auto: DP mode runs where its guarantees were checked
            return
        if self.device == "auto":
            self.__dict__["device"] = str(resolve_device("auto"))
        if self.device.startswith("cuda"):
            self._apply_gpu_profile()
        if self.amp == "auto":
            self.__dict__["amp"] = "bf16" if fast_bf16_matmul(self.device) else "off"

    def _apply_gpu_profile(self) -> None:
        applied = []
        for name, value in GPU_PROFILE.items():
            if name in self.model_fields_set:
                continue
            if name == "n_heads" and self.d_model % value:
                continue  # a D_MODEL set by hand keeps the CPU default heads when the profile's do not divide it
            self.__dict__[name] = value  # not marked as set: model_fields_set keeps meaning "the user set it"
            applied.append(name)
        self._gpu_profile = tuple(applied)

    @property
    def precision(self) -> Precision:
        """``AMP`` as resolved for this machine: bf16 or off (never auto)."""
        if self.amp == "auto":
            raise AssertionError("AMP=auto is resolved when the settings are validated")
        return self.amp

    @property
    def gpu_profile_applied(self) -> tuple[str, ...]:
        """The settings the GPU profile chose (empty on the CPU, or when the user set them all)."""
        return self._gpu_profile

    @property
    def dlq_topic(self) -> str:
        return f"{self.topic}.dlq"

    def public_dict(self) -> dict[str, Any]:
        """Settings as plain JSON values, secrets masked (for logs and /v1/model)."""
        out = self.model_dump(mode="json")
        out["admin_token"] = "***" if self.admin_token else None
        out["kafka_sasl_password"] = "***" if self.kafka_sasl_password else None
        return out


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build settings from defaults, an optional TOML file, env and ``overrides``.

    Raises :class:`SettingsError` whose message is one line naming the bad setting.
    """
    path = Path(config_file) if config_file else None
    if path is not None:
        if not path.is_file():
            raise SettingsError(f"config file {path} does not exist")
        try:
            tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    Settings._toml_path = path
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(_one_line(exc)) from None
    finally:
        Settings._toml_path = None


_SECRET_SETTINGS = frozenset({"admin_token", "kafka_sasl_password"})


def _one_line(exc: ValidationError) -> str:
    """The first error as ``invalid setting NAME (STREAMTRAIN_NAME)=value: why``."""
    err = exc.errors()[0]
    name = ".".join(str(p) for p in err.get("loc", ())) or "settings"
    given = err.get("input")
    secret = name in _SECRET_SETTINGS
    shown = "" if isinstance(given, dict) or given is None else ("=***" if secret else f"={given!r}")
    env = f" ({ENV_PREFIX}{name.upper()})" if name != "settings" else ""
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    if name == "settings":  # a rule across settings: the message names them
        return f"invalid settings: {err['msg'].removeprefix('Value error, ')}{more}"
    return f"invalid setting {name}{env}{shown}: {err['msg']}{more}"
