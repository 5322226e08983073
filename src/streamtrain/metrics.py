"""Every Prometheus metric of the service, declared once (docs/contract.md, section 3).

One :class:`Metrics` instance per service, on its own registry, so tests can build as
many services as they like. Names: ``streamtrain_`` prefix, base units, counters end in
``_total``, labels bounded (reasons and HTTP codes only).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from streamtrain.events import REASONS
from streamtrain.model.forecasters import FORECASTER_KINDS

disable_created_metrics()  # no *_created series: dashboards never use them

#: Why the ingest thread recreated its consumer: the watchdog's three stall kinds, or an error.
INGEST_RESTART_REASONS = ("unassigned", "no_fetch_progress", "no_heartbeat", "error")
#: How a dead letter reached ``<topic>.dlq``: unchanged, or as a bounded stand-in.
DEAD_LETTER_FORMS = ("raw", "stand_in")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_AGE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 14400, 86400)


class _WindowAgeCollector(Collector):
    """``streamtrain_window_age_seconds{quantile}``, computed from the window at scrape time."""

    def __init__(self, source: Callable[[], tuple[float, float]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "streamtrain_window_age_seconds", "Age of window items by quantile", labels=["quantile"]
        )
        p50, p90 = self._source()
        family.add_metric(["0.5"], p50)
        family.add_metric(["0.9"], p90)
        yield family


class _ModelInfoCollector(Collector):
    """``streamtrain_model_info{version}`` (1 for the version that serves, 0 for the other
    kept ones: at most MODEL_VERSIONS_KEEP series) and ``streamtrain_model_age_seconds``."""

    def __init__(self, source: Callable[[], tuple[list[int], int | None, float | None]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        kept, serving, published_at = self._source()
        info = GaugeMetricFamily(
            "streamtrain_model_info",
            "Kept model versions: 1 for the one that serves, 0 for the others",
            labels=["version"],
        )
        for version in kept:
            info.add_metric([str(version)], 1.0 if version == serving else 0.0)
        yield info
        age = GaugeMetricFamily("streamtrain_model_age_seconds", "Seconds since the serving version was published")
        if published_at is not None:
            age.add_metric([], max(0.0, time.time() - published_at))
        yield age


#: What ``/metrics`` shows in DP mode: the public clock, ε, versions, health and the
#: predict path (whose inputs are the caller's). Everything else counts or times private
#: events (consumed, rejected, window, tokens, batch sizes, step time, loss) and moves to
#: the operator plane (``/v1/admin/metrics``, admin token), outside the DP guarantee.
DP_PUBLIC_METRICS = frozenset(
    {
        "streamtrain_kafka_connected",
        "streamtrain_kafka_security_failing",
        "streamtrain_train_steps",
        "streamtrain_model_version",
        "streamtrain_model_info",
        "streamtrain_model_age_seconds",
        "streamtrain_dp_epsilon",
        "streamtrain_dp_record_failures",
        "streamtrain_checkpoints_written",
        "streamtrain_checkpoint_failures",
        "streamtrain_checkpoints_corrupt",
        "streamtrain_predict_requests",
        "streamtrain_predict_latency_seconds",
    }
)


class _OnlyFamilies(Collector):
    """A view of a registry with only the named metric families (for the DP public plane)."""

    def __init__(self, registry: CollectorRegistry, names: frozenset[str]) -> None:
        self._registry, self._names = registry, names

    def collect(self) -> Iterable[Metric]:
        return (family for family in self._registry.collect() if family.name in self._names)


class Metrics:
    """The service's metrics on a private registry."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        # Ingest
        self.events_consumed = Counter("streamtrain_events_consumed", "Messages read from Kafka", registry=registry)
        self.events_accepted = Counter("streamtrain_events_accepted", "Events put into the window", registry=registry)
        self.events_rejected = Counter(
            "streamtrain_events_rejected", "Messages refused, by reason", ["reason"], registry=registry
        )
        for reason in REASONS:
            self.events_rejected.labels(reason)
        self.dead_letters_failed = Counter(
            "streamtrain_dead_letters_failed",
            "Dead-letter send attempts that failed (each is retried, or replaced by a stand-in)",
            registry=registry,
        )
        self.dead_letters_written = Counter(
            "streamtrain_dead_letters_written",
            "Dead letters acknowledged by Kafka, by form (raw, stand_in)",
            ["form"],
            registry=registry,
        )
        for form in DEAD_LETTER_FORMS:
            self.dead_letters_written.labels(form)
        self.dead_letters_pending = Gauge(
            "streamtrain_dead_letters_pending",
            "Dead letters not yet acknowledged (checkpoints and commits wait for them)",
            registry=registry,
        )
        self.ingest_restarts = Counter(
            "streamtrain_ingest_restarts",
            "Consumers recreated by the ingest thread, by reason (unassigned, no_fetch_progress, no_heartbeat, error)",
            ["reason"],
            registry=registry,
        )
        for reason in INGEST_RESTART_REASONS:
            self.ingest_restarts.labels(reason)
        self.ingest_last_record_age = Gauge(
            "streamtrain_ingest_last_record_age_seconds",
            "Seconds since the consumer last read a record (since start before the first)",
            registry=registry,
        )
        self.consumer_lag = Gauge(
            "streamtrain_consumer_lag_messages",
            "Sum over assigned partitions of end offset minus position",
            registry=registry,
        )
        self.kafka_connected = Gauge(
            "streamtrain_kafka_connected", "1 while the consumer has a live broker connection", registry=registry
        )
        self.kafka_security_failing = Gauge(
            "streamtrain_kafka_security_failing",
            "1 while Kafka refuses the service, by kind: kafka_auth_failed (credentials, TLS) or "
            "kafka_authorization_failed (an ACL missing)",
            ["kind"],
            registry=registry,
        )
        for kind in ("kafka_auth_failed", "kafka_authorization_failed"):
            self.kafka_security_failing.labels(kind)
        # Window
        self.window_size = Gauge("streamtrain_window_size", "Items in the window", registry=registry)
        self.window_capacity = Gauge("streamtrain_window_capacity", "Most items the window holds", registry=registry)
        self.window_tokens = Gauge("streamtrain_window_tokens", "Sum of lengths in the window", registry=registry)
        self.window_evicted = Counter("streamtrain_window_evicted", "Items pushed out of the window", registry=registry)
        self.window_compaction_bytes = Counter(
            "streamtrain_window_compaction_bytes",
            "Bytes of readings the window's compactions gathered into new chunks",
            registry=registry,
        )
        self.window_compaction_in_flight = Gauge(
            "streamtrain_window_compaction_in_flight",
            "1 while a readings compaction is planned and not swapped in yet",
            registry=registry,
        )
        # Training
        self.train_steps = Counter("streamtrain_train_steps", "Optimizer steps", registry=registry)
        self.train_tokens = Counter("streamtrain_train_tokens", "Real (unpadded) tokens trained on", registry=registry)
        self.train_padding_tokens = Counter(
            "streamtrain_train_padding_tokens", "Pad positions in trained batches", registry=registry
        )
        self.train_loss = Gauge("streamtrain_train_loss", "Smoothed training loss", registry=registry)
        self.train_step_seconds = Histogram(
            "streamtrain_train_step_seconds", "Wall time of one step", buckets=_STEP_BUCKETS, registry=registry
        )
        self.train_batch_sequences = Histogram(
            "streamtrain_train_batch_sequences", "Sequences per batch", buckets=_SEQ_BUCKETS, registry=registry
        )
        self.train_skipped_steps = Counter(
            "streamtrain_train_skipped_steps", "Steps refused, by reason", ["reason"], registry=registry
        )
        for reason in ("non_finite_loss", "non_finite_grad"):
            self.train_skipped_steps.labels(reason)
        self.train_data_wait_seconds = Counter(
            "streamtrain_train_data_wait_seconds", "Time the trainer waited for batches", registry=registry
        )
        self.train_sample_age_seconds = Histogram(
            "streamtrain_train_sample_age_seconds",
            "Age (event time to training) of trained samples",
            buckets=_AGE_BUCKETS,
            registry=registry,
        )
        self.train_passes = Counter("streamtrain_train_passes", "Completed passes over the window", registry=registry)
        self.train_last_pass = Gauge(
            "streamtrain_train_last_pass",
            "Diagnostics of the last completed pass (padding_share, batches, adjacent_length_corr, ...)",
            ["field"],
            registry=registry,
        )
        self.model_version = Gauge("streamtrain_model_version", "Version of the model that serves", registry=registry)
        # Learning quality (quality.py)
        self.prequential_mse = Gauge(
            "streamtrain_prequential_mse",
            "Serving model's forecast MSE on events scored before training on them (fading average)",
            registry=registry,
        )
        self.prequential_naive_mse = Gauge(
            "streamtrain_prequential_naive_mse",
            "Last-value forecast's MSE on the same scored events (fading average)",
            registry=registry,
        )
        self.prequential_events = Counter(
            "streamtrain_prequential_events", "Events scored by the serving model before training", registry=registry
        )
        self.drift_detected = Counter(
            "streamtrain_drift_detected", "Drifts detected in the prequential error", registry=registry
        )
        self.publish_held = Counter(
            "streamtrain_publish_held", "Candidate models held back by the publish gate", registry=registry
        )
        self.model_forecaster = Gauge(
            "streamtrain_model_forecaster",
            "1 for the forecast the serving version gives (network, last_value, linear or blend), 0 for the others",
            ["forecaster"],
            registry=registry,
        )
        for kind in FORECASTER_KINDS:
            self.model_forecaster.labels(kind)
        self.model_holdout_mse = Gauge(
            "streamtrain_model_holdout_mse",
            "Held-out forecast MSE per step of each forecaster at the last publication (candidate's units)",
            ["forecaster"],
            registry=registry,
        )
        self.train_replays_per_event = Gauge(
            "streamtrain_train_replays_per_event", "Mean times each accepted event was trained on", registry=registry
        )
        self.train_budget_wait_seconds = Counter(
            "streamtrain_train_budget_wait_seconds",
            "Time the trainer idled because the replay budget (MAX_REPLAYS_PER_EVENT) was spent",
            registry=registry,
        )
        self.model_rollbacks = Counter(
            "streamtrain_model_rollbacks", "Rollbacks to an earlier version, by trigger", ["trigger"], registry=registry
        )
        for trigger in ("admin", "automatic"):
            self.model_rollbacks.labels(trigger)
        self.dp_epsilon = Gauge(
            "streamtrain_dp_epsilon", "Largest per-unit epsilon spent so far (DP mode only)", registry=registry
        )
        self.dp_record_failures = Counter(
            "streamtrain_dp_record_failures",
            "DP admission record syncs that failed (the model was held back, DP mode only)",
            registry=registry,
        )
        # Checkpoints
        self.checkpoints_written = Counter("streamtrain_checkpoints_written", "Checkpoints written", registry=registry)
        self.checkpoint_failures = Counter(
            "streamtrain_checkpoint_failures", "Checkpoint writes that failed", registry=registry
        )
        self.checkpoints_corrupt = Counter(
            "streamtrain_checkpoints_corrupt", "Checkpoints skipped on load as corrupt", registry=registry
        )
        self.checkpoint_bytes = Counter(
            "streamtrain_checkpoint_bytes_written",
            "Bytes of checkpoint files written, by kind: base (the whole window) or delta (what changed)",
            ["kind"],
            registry=registry,
        )
        self.checkpoint_chain_length = Gauge(
            "streamtrain_checkpoint_chain_length",
            "Window deltas the newest checkpoint builds on since its base (0: it is a base)",
            registry=registry,
        )
        # Scale-out
        self.rank_info = Gauge(
            "streamtrain_rank_info",
            "1, labelled with this process's rank and the world size (1 and 0 for one process)",
            ["rank", "world_size"],
            registry=registry,
        )
        # Serving
        self.predict_requests = Counter(
            "streamtrain_predict_requests", "Predict requests by HTTP status", ["code"], registry=registry
        )
        self.predict_latency = Histogram(
            "streamtrain_predict_latency_seconds",
            "Predict request latency",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )

    def watch_window_age(self, source: Callable[[], tuple[float, float]]) -> None:
        """Serve the window-age quantiles from ``source`` at every scrape."""
        self.registry.register(_WindowAgeCollector(source))

    def watch_models(self, source: Callable[[], tuple[list[int], int | None, float | None]]) -> None:
        """Serve model_info and model_age_seconds from ``source`` (kept versions, the serving
        version, its publication time) at every scrape."""
        self.registry.register(_ModelInfoCollector(source))

    def exposition(self, public_only: bool = False) -> bytes:
        """Prometheus text; ``public_only`` keeps the DP public plane (:data:`DP_PUBLIC_METRICS`)."""
        if public_only:
            return generate_latest(_OnlyFamilies(self.registry, DP_PUBLIC_METRICS))
        return generate_latest(self.registry)
