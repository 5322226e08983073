"""Kafka ingest: consumer thread, liveness watchdog, offsets the window covers.

One thread owns the kafka-python consumer (it is not thread-safe) and does everything
that touches it: poll, seek, commit, lag, the watchdog's probes. Other threads talk to it
through :meth:`Ingestor.request_commit`. Rebalance callbacks run on kafka-python's IO
thread, where blocking consumer calls raise; they only call the local, non-blocking ``seek``.

Offsets: the window stores, under its own lock, the next offset per partition that its
state covers. A checkpoint saves that state; on restart each partition is sought to the
stored offset, so the window is exactly-once with respect to the topic. Offsets are
committed to the consumer group only after a checkpoint made them durable, and a
checkpoint waits for the dead letters of the offsets it covers (``dead_letters.py``).
A partition revoked from this member keeps its offset in the window: should it come back
(the other member left), it resumes where this window stopped, so the window never holds
a message twice; commits only ever name partitions this member owns.

Decoding: each poll batch is decoded (``decoders.py``) while the next poll runs, and the
batches are applied in poll order; a partition (re)assigned meanwhile resumes past
everything polled, so a batch still in flight is never read twice.

Liveness: the consumer comes from a factory (``consumers.py``; by default
:func:`~streamtrain.ingest.consumers.subscribed_consumer` joins the consumer group) with the
kafka-python patches of ``kafka_compat.py`` installed; the watchdog (``watchdog.py``) judges
it after every poll, and an overdue stall closes it and opens a new one that resumes from
the window's offsets.

Scale-out (``owned_partitions`` given): the partitions are *assigned*, not subscribed, so
ownership is the pure rule of ``streamtrain.distributed.ownership`` and no rebalance ever moves a
partition; offsets are still committed under ``GROUP_ID``. The consumer thread looks at the
topic's partition count every few seconds and assigns partitions added to the topic that
this rank owns; they start from the group's committed offset, or the earliest. The watchdog
works the same ("unassigned" cannot happen to a rank that owns partitions; "no fetch
progress while the log end moves" can).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import Counter as TallyCounter
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata

from streamtrain.config import Settings
from streamtrain.events import REASONS, DecodedBatch, EventBatch, EventLimits
from streamtrain.ingest import security as kafka_security
from streamtrain.ingest.consumers import (
    ConsumerFactory,
    OwnedPartitions,
    SeekingListener,
    assign_owned,
    assigned_consumer,
    fetch_bytes,
    subscribed_consumer,
    topic_partition_count,
)
from streamtrain.ingest.dead_letters import DeadLetterOutbox
from streamtrain.ingest.decoders import Decoder
from streamtrain.ingest.topics import PartitionReplicas, TopicLimits, degraded_report, prepare_topics
from streamtrain.ingest.watchdog import ConsumerProbe, IngestWatchdog, Stall
from streamtrain.metrics import Metrics
from streamtrain.window.reservoir import RecencyWindow

__all__ = ["IngestStalled", "IngestStats", "Ingestor"]

log = logging.getLogger(__name__)

_RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
# A commit must not hold the consumer thread (and with it a checkpoint) for the client's
# 30 s request timeout when the broker goes away: commits are best effort, the
# checkpoint's offsets are authoritative.
_COMMIT_TIMEOUT_MS = 3000
_END_OFFSETS_TIMEOUT_MS = 2000
_PARTITION_CHECK_S = 5.0  # scale-out: how often the topic's partition count is looked at
_UNREACHABLE_AFTER_S = 5.0  # a leader not connected this long is named in kafka_degraded


class IngestStalled(Exception):
    """The watchdog found the consumer stalled for too long."""

    def __init__(self, stall: Stall) -> None:
        super().__init__(f"{stall.reason}: {stall.detail}")
        self.stall = stall


@dataclass
class IngestStats:
    """What this process consumed since it started (``GET /v1/window`` reports the window's ledger)."""

    seen_total: int = 0
    accepted_total: int = 0
    rejected: TallyCounter[str] = field(default_factory=TallyCounter)

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


class _SeekOnAssign(SeekingListener):
    """Runs on kafka-python's IO thread: only local, non-blocking calls here."""

    def __init__(self, ingestor: Ingestor) -> None:
        super().__init__()
        self._ingestor = ingestor

    def on_partitions_revoked(self, revoked: Any) -> None:
        partitions = sorted(tp.partition for tp in revoked)
        self._ingestor.assigned = self._ingestor.assigned - set(partitions)
        log.info("partitions revoked: %s", partitions)
        if self._ingestor.on_revoked is not None and partitions:
            self._ingestor.on_revoked(partitions)

    def on_partitions_assigned(self, assigned: Any) -> None:
        consumer = self.consumer if self.consumer is not None else self._ingestor._consumer
        if self._ingestor.on_assigned is not None and assigned:
            self._ingestor.on_assigned(sorted(tp.partition for tp in assigned))
        stored = self._ingestor.resume_offsets()
        for tp in assigned:
            if tp.partition in stored and consumer is not None:
                consumer.seek(tp, stored[tp.partition])
        self._ingestor.assigned = frozenset(tp.partition for tp in assigned)
        log.info(
            "partitions assigned: %s (resuming from stored offsets for %s)",
            sorted(tp.partition for tp in assigned),
            sorted(tp.partition for tp in assigned if tp.partition in stored),
        )


@dataclass
class _PendingBatch:
    messages: list[Any]
    next_offsets: dict[int, int]
    future: Future[DecodedBatch] | None
    args: tuple[Any, ...]

    def done(self) -> bool:
        return self.future is None or self.future.done()


class Ingestor:
    """Consumes the topic into the window on a thread of its own; never crashes on input,
    never stops for good: the watchdog recreates a stalled consumer."""

    def __init__(
        self,
        settings: Settings,
        window: RecencyWindow,
        metrics: Metrics,
        *,
        on_events: Callable[[EventBatch, dict[int, int]], None] | None = None,
        on_assigned: Callable[[list[int]], None] | None = None,
        on_revoked: Callable[[list[int]], None] | None = None,
        before_insert: Callable[[EventBatch], EventBatch] | None = None,
        on_idle: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
        consumer_factory: ConsumerFactory | None = None,
        dead_letters: DeadLetterOutbox | None = None,
        owned_partitions: OwnedPartitions | None = None,
    ) -> None:
        """``owned_partitions`` (scale-out): assign those partitions instead of joining the
        group; the default factory is then :func:`assigned_consumer`."""
        self.settings = settings
        self.on_events = on_events  # DP mode: every valid event also goes to the DP window
        # DP mode: partitions arriving and leaving (IO thread: local work only, no consumer calls)
        self.on_assigned = on_assigned
        self.on_revoked = on_revoked
        # Test-then-train: the serving model scores a batch before the window (and so the
        # trainer) can see it; returns the events the window gets (held-out ones stay out).
        self.before_insert = before_insert
        self.on_idle = on_idle  # after a poll that brought nothing (the ingest thread): scores that wait
        self.apply_lock = threading.Lock()  # held while a batch lands; checkpoints take it
        self.window = window
        self.metrics = metrics
        self.limits = EventLimits.from_settings(settings)
        self.stats = IngestStats()
        self.dead_letters = dead_letters or DeadLetterOutbox(settings, metrics)
        self.watchdog = IngestWatchdog(settings.ingest_stall_timeout_s)
        self.restarts: TallyCounter[str] = TallyCounter()
        self.topic_limits: TopicLimits | None = None
        self.assigned: frozenset[int] = frozenset()  # partitions the consumer owns now
        self.owned_partitions = owned_partitions
        self.partition_count = 0  # the topic's partitions as last seen (scale-out)
        if consumer_factory is None:
            if owned_partitions is None:
                consumer_factory = subscribed_consumer
            else:
                consumer_factory = lambda s, listener: assigned_consumer(s, listener, self._owned)  # noqa: E731
        self._consumer_factory = consumer_factory
        self._last_partition_check = -math.inf  # never (the monotonic clock starts at the machine's boot)
        self._decoder = Decoder(settings.decode_workers)
        self._clock = clock
        self._consumer: KafkaConsumer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._commits: queue.Queue[tuple[dict[int, int], threading.Event]] = queue.Queue()
        self._connected = False
        self._polled: dict[int, int] = {}  # next offset per partition of every polled batch
        self._reported_evicted = 0
        self._reported_compaction_bytes = 0  # what window_compaction_bytes counted of window.compactions
        self._last_gauges = -math.inf
        self._last_end_probe = -math.inf
        self._started_at = time.monotonic()
        self._last_record_at: float | None = None  # monotonic
        self._last_restart: tuple[str, float] | None = None  # reason, monotonic time
        self.last_error: str | None = None
        #: ``kafka_degraded: ...`` while a partition lacks a reachable leader or in-sync replicas (/readyz note)
        self.kafka_degraded: str | None = None
        self._unreachable_since: dict[int, float] = {}  # broker -> monotonic time its connection was first missed
        metrics.ingest_last_record_age.set_function(self._record_age_or_uptime)
        kafka_security.watch(settings)  # before any client: it learns what kafka-python's loggers say

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.dead_letters.start()
        self._thread = threading.Thread(target=self._run, name="ingest", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.dead_letters.close(timeout)

    @property
    def connected(self) -> bool:
        """True while the consumer holds a live connection to a broker."""
        return self._connected and self._thread is not None and self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ called from other threads
    def dead_letter_mark(self) -> int:
        """Taken with the window state (under ``apply_lock``): the dead letters it covers."""
        return self.dead_letters.mark()

    def flush_dead_letters(self, timeout_s: float = 10.0, upto: int | None = None) -> bool:
        """Wait until every dead letter up to the mark ``upto`` (None: all so far) is
        acknowledged by Kafka; False (and they stay pending, retried) if not in time."""
        return self.dead_letters.wait_acknowledged(upto, timeout_s)

    def request_commit(self, offsets: Mapping[int, int], timeout_s: float = 10.0) -> bool:
        """Ask the consumer thread to commit ``offsets`` to the group; True once done."""
        if not self.running or not offsets:
            return False
        done = threading.Event()
        self._commits.put((dict(offsets), done))
        return done.wait(timeout_s)

    @property
    def last_record_age_s(self) -> float | None:
        """Seconds since the consumer last read a record; None before the first."""
        at = self._last_record_at
        return None if at is None else time.monotonic() - at

    def _record_age_or_uptime(self) -> float:
        at = self._last_record_at
        return time.monotonic() - (self._started_at if at is None else at)

    def stall_report(self) -> str | None:
        """What ``/readyz`` says while ingest is stalled (None when it is not, or not yet long)."""
        stall = self.watchdog.current
        if not self.connected or not self.watchdog.reportable(stall):
            return None
        assert stall is not None
        age = stall.age(time.monotonic())
        report = f"{stall.reason}: {stall.detail}; for {age:.0f} s"
        if self.restarts:
            last_reason, at = self._last_restart or ("?", time.monotonic())
            report += (
                f"; consumer recreated {sum(self.restarts.values())} times, "
                f"last for {last_reason} {time.monotonic() - at:.0f} s ago"
            )
        else:
            report += f"; the watchdog recreates the consumer after {self.settings.ingest_stall_timeout_s:g} s"
        return report

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        attempt = 0
        self._decoder.start(self.limits)  # imports while the topics are prepared and the group is joined
        while not self._stop.is_set():
            try:
                self._connect()
                attempt = 0
                self._consume()
            except IngestStalled as stalled:
                self._restarted(stalled.stall.reason)
                log.warning(
                    "ingest stalled: %s; recreating the consumer (it resumes from the window's offsets)", stalled
                )
                self._close_consumer()
            except Exception as err:  # noqa: BLE001 - the ingest thread must survive anything
                self._connected = False
                self.metrics.kafka_connected.set(0)
                error = self._security_reason(err) or f"{type(err).__name__}: {err}"
                changed = error != self.last_error
                self.last_error = error
                self._set_security_gauges()
                delay = _RETRY_BACKOFF_S[min(attempt, len(_RETRY_BACKOFF_S) - 1)]
                attempt += 1
                if self._consumer is not None:  # it had a consumer: this is a restart
                    self._restarted("error")
                if changed:  # one line per state change, not one per retry
                    log.warning("kafka ingest error (%s); retrying (every %.0f s at most)", error, _RETRY_BACKOFF_S[-1])
                self._close_consumer()
                self._stop.wait(delay)
        self._close_consumer()
        self._decoder.close()

    def _security_reason(self, err: Exception) -> str | None:
        """A ``kafka_auth_failed:`` / ``kafka_authorization_failed:`` reason for ``err``, if it is one."""
        s = self.settings
        reason = kafka_security.authorization_reason(err, "READ", topic=s.topic, group=s.group_id)
        return reason or kafka_security.watch(s).current()

    @property
    def security_failure(self) -> str | None:
        """What ``/readyz`` says while Kafka refuses this service's credentials or its ACLs do not suffice."""
        error = self.last_error
        if not self._connected and error is not None and error.startswith(kafka_security.FAILURE_PREFIXES):
            return error
        return self.dead_letters.security_failure

    def _security_resolved(self) -> None:
        log.info("kafka security failure resolved (%s); ingest goes on", self.last_error)
        kafka_security.watch(self.settings).clear()
        self.last_error = None
        self._set_security_gauges()

    def _set_security_gauges(self) -> None:
        failure = self.security_failure or ""
        for kind in kafka_security.FAILURE_KINDS:
            self.metrics.kafka_security_failing.labels(kind).set(1 if failure.startswith(kind + ":") else 0)

    def _restarted(self, reason: str) -> None:
        self.restarts[reason] += 1
        self._last_restart = (reason, time.monotonic())
        self.metrics.ingest_restarts.labels(reason).inc()

    def _connect(self) -> None:
        s = self.settings
        self._polled = {}  # what an earlier consumer polled is in the window by now
        self.topic_limits = prepare_topics(s)
        self.dead_letters.configure(self.topic_limits.source_max_message_bytes, fetch_bytes(s))
        self._consumer = self._consumer_factory(s, _SeekOnAssign(self))
        self.watchdog.reset()
        self._last_end_probe = -math.inf
        if self.security_failure is None:  # while one lasts, the retries stay quiet
            log.info(
                "ingest connected to %s (%s), topic %s, group %s",
                s.kafka_bootstrap,
                kafka_security.describe(s),
                s.topic,
                s.group_id,
            )

    def _consume(self) -> None:
        """Poll, and decode the previous batch meanwhile (in the decode process if there is one)."""
        consumer = self._consumer
        assert consumer is not None
        in_flight: deque[_PendingBatch] = deque()
        try:
            while not self._stop.is_set():
                # Never poll(0): a zero timeout can leave a group rejoin unfinished (kafka-python 3).
                records = consumer.poll(timeout_ms=250)
                self._connected = self._broker_connected(consumer)
                if self._connected and (self.last_error or "").startswith(kafka_security.FAILURE_PREFIXES):
                    self._security_resolved()
                self.metrics.kafka_connected.set(1 if self._connected else 0)
                if records:
                    self._last_record_at = time.monotonic()
                    in_flight.append(self._submit(records))
                # Apply finished batches in poll order; wait only when the pipeline is full or idle.
                while in_flight and (in_flight[0].done() or len(in_flight) > 1 or not records):
                    self._apply(in_flight.popleft())
                if not records and self.on_idle is not None:
                    self.on_idle()
                self._serve_commits(consumer)
                self._update_gauges(consumer)
                self._follow_partitions(consumer)
                self._check_liveness(consumer)
        finally:
            while in_flight:  # what was polled is applied, so the window's offsets stay exact
                self._apply(in_flight.popleft())

    def _owned(self, count: int) -> list[int]:
        assert self.owned_partitions is not None
        self.partition_count = max(self.partition_count, count)
        return self.owned_partitions(count)

    def _follow_partitions(self, consumer: KafkaConsumer) -> None:
        """Scale-out: assign partitions added to the topic that this rank owns."""
        now = time.monotonic()
        if self.owned_partitions is None or now - self._last_partition_check < _PARTITION_CHECK_S:
            return
        self._last_partition_check = now
        try:
            # assigned partitions keep the topic in the consumer's metadata, refreshed every
            # 10 s; a rank that owns none asks the broker itself
            count = topic_partition_count(consumer, self.settings.topic, refresh=not self.assigned)
        except KafkaError as err:
            log.debug("partition count: %s", err)
            return
        owned = self._owned(count) if count else []
        if count and set(owned) != set(self.assigned):
            log.info("topic %s has %d partitions: this rank now owns %s", self.settings.topic, count, owned)
            assign_owned(consumer, self.settings.topic, owned, _SeekOnAssign(self))

    def resume_offsets(self) -> dict[int, int]:
        """Where each partition goes on after a (re)assignment: past everything polled.

        Batches still in flight to the window will be applied, so seeking back to the
        window's own offsets would read them a second time (duplicates in the window).
        """
        resume = self.window.next_offsets
        for partition, offset in self._polled.copy().items():
            resume[partition] = max(resume.get(partition, offset), offset)
        return resume

    def _submit(self, records: Mapping[TopicPartition, list[Any]]) -> _PendingBatch:
        messages = [m for batch in records.values() for m in batch]
        next_offsets = {tp.partition: batch[-1].offset + 1 for tp, batch in records.items() if batch}
        self._polled.update(next_offsets)
        args = (
            [m.value for m in messages],
            self.limits,
            self._clock(),
            [m.partition for m in messages],
            [m.offset for m in messages],
        )
        future = self._decoder.submit(*args)
        return _PendingBatch(messages, next_offsets, future, args)

    def _apply(self, pending: _PendingBatch) -> None:
        """Dead-letter, insert and count one decoded poll batch; the window records its offsets.

        Dead letters are queued before the window takes the batch's offsets, so a
        checkpoint's mark (taken under ``apply_lock``) covers every one of them.
        """
        decoded = self._decoder.result(pending.future, pending.args)
        messages = pending.messages
        for position, rejection in decoded.rejections:
            assert rejection.reason in REASONS
            self.dead_letters.submit(messages[position], rejection.reason)
        reasons = TallyCounter(r.reason for _, r in decoded.rejections)
        with self.apply_lock:
            to_window = decoded.events
            if self.before_insert is not None and len(to_window):
                to_window = self.before_insert(to_window)
            held_out = len(decoded.events) - len(to_window)
            if len(to_window):
                self.window.insert_batch(to_window, pending.next_offsets, rejected=reasons, held_out=held_out)
            else:
                self.window.advance_offsets(pending.next_offsets, rejected=reasons, held_out=held_out)
            if self.on_events is not None:
                self.on_events(decoded.events, pending.next_offsets)
        self.stats.seen_total += len(messages)
        self.stats.accepted_total += len(decoded.events)
        self.stats.rejected.update(reasons)
        self.metrics.events_consumed.inc(len(messages))
        self.metrics.events_accepted.inc(len(decoded.events))
        for reason, count in reasons.items():
            self.metrics.events_rejected.labels(reason).inc(count)

    def _serve_commits(self, consumer: KafkaConsumer) -> None:
        while True:
            try:
                offsets, done = self._commits.get_nowait()
            except queue.Empty:
                return
            assigned = {tp.partition: tp for tp in consumer.assignment()}
            to_commit = {assigned[p]: OffsetAndMetadata(o, "", -1) for p, o in offsets.items() if p in assigned}
            try:
                if to_commit and self._connected:  # while the broker is away the next checkpoint commits
                    consumer.commit(to_commit, timeout_ms=_COMMIT_TIMEOUT_MS)
            except KafkaError as err:
                log.warning("offset commit failed (checkpoint offsets stay authoritative): %s", err)
            finally:
                done.set()

    # ------------------------------------------------------------------ liveness
    def _check_liveness(self, consumer: KafkaConsumer) -> None:
        """Probe the consumer for the watchdog; raise :class:`IngestStalled` when a stall is overdue."""
        stall = self.watchdog.observe(self._probe(consumer))
        if self.watchdog.overdue(stall):
            assert stall is not None
            raise IngestStalled(stall)

    def _probe(self, consumer: KafkaConsumer) -> ConsumerProbe:
        subscription = consumer._subscription  # kafka-python keeps assignment state here; reading it is local
        coordinator = consumer._coordinator
        assigned = frozenset(tp.partition for tp in subscription.assigned_partitions())
        fetchable = frozenset(tp.partition for tp in subscription.fetchable_partitions())
        group_state: str | None = None
        heartbeat_age: float | None = None
        if subscription.partitions_auto_assigned():
            group_state = str(coordinator.state).strip("<>")
            beat = coordinator.heartbeat
            heartbeat_age = time.monotonic() - max(beat.last_receive, beat.last_reset)
        positions = self.resume_offsets()
        for partition in assigned - positions.keys():
            state = subscription.assignment.get(TopicPartition(self.settings.topic, partition))
            if state is not None and state.has_valid_position:
                positions[partition] = state.position.offset
        log_ends = None
        now = time.monotonic()
        if fetchable and self._connected and now - self._last_end_probe >= max(1.0, self.watchdog.timeout_s / 5):
            self._last_end_probe = now
            try:
                ends = consumer.end_offsets(
                    [TopicPartition(self.settings.topic, p) for p in fetchable], timeout_ms=_END_OFFSETS_TIMEOUT_MS
                )
                log_ends = {tp.partition: int(end) for tp, end in ends.items() if end is not None}
            except KafkaError as err:
                log.debug("end offsets for the watchdog: %s", err)
        return ConsumerProbe(
            connected=self._connected,
            group_state=group_state,
            assigned=assigned,
            fetchable=fetchable,
            heartbeat_age_s=heartbeat_age,
            positions={p: o for p, o in positions.items() if p in assigned},
            log_ends=log_ends,
        )

    def _update_gauges(self, consumer: KafkaConsumer) -> None:
        now = time.monotonic()
        evicted = self.window.evicted_since_start  # not evicted_total: a restored window's past is not news
        if evicted > self._reported_evicted:
            self.metrics.window_evicted.inc(evicted - self._reported_evicted)
            self._reported_evicted = evicted
        self.metrics.window_size.set(len(self.window))
        if now - self._last_gauges < 1.0:
            return
        self._last_gauges = now
        self.metrics.window_tokens.set(self.window.tokens)
        compactions = self.window.compactions
        self.metrics.window_compaction_in_flight.set(int(compactions.in_flight))
        if compactions.bytes_total > self._reported_compaction_bytes:
            self.metrics.window_compaction_bytes.inc(compactions.bytes_total - self._reported_compaction_bytes)
            self._reported_compaction_bytes = compactions.bytes_total
        self._set_security_gauges()
        positions = self.window.next_offsets
        lag = 0
        for tp in consumer.assignment():
            end = consumer.highwater(tp)
            if end is not None:
                lag += max(0, end - positions.get(tp.partition, 0))
        self.metrics.consumer_lag.set(lag)
        self._note_degraded(consumer)

    def _note_degraded(self, consumer: KafkaConsumer) -> None:
        """``kafka_degraded`` (a /readyz note) from the consumer's metadata: partitions without a
        reachable leader or with replicas out of sync; one log line per change."""
        report = None
        if self._connected:
            client = consumer._client  # kafka-python keeps partition metadata and connections on its client
            try:
                known = client.cluster._partitions.get(self.settings.topic) or {}
                partitions = {
                    int(p): PartitionReplicas(int(m.leader_id), tuple(m.replica_nodes), tuple(m.isr_nodes))
                    for p, m in known.items()
                }
                now = time.monotonic()
                for broker in {r.leader for r in partitions.values() if r.leader >= 0}:
                    if client.connected(broker):
                        self._unreachable_since.pop(broker, None)
                    else:
                        self._unreachable_since.setdefault(broker, now)

                def reachable(broker: int) -> bool:  # not connected for a moment (start-up, a rejoin) is not news
                    return now - self._unreachable_since.get(broker, now) < _UNREACHABLE_AFTER_S

                fetched = {tp.partition for tp in consumer.assignment()}
                report = degraded_report(self.settings.topic, partitions, reachable, fetched)
            except Exception as err:  # noqa: BLE001 - a diagnostics probe must not break ingest
                log.debug("replication report: %s", err)
                return
        if report != self.kafka_degraded:
            if report is not None:
                log.warning("%s (ingest goes on from the brokers that remain)", report)
            elif self._connected:
                log.info("kafka no longer degraded (was: %s)", self.kafka_degraded)
            self.kafka_degraded = report

    @staticmethod
    def _broker_connected(consumer: KafkaConsumer) -> bool:
        client = consumer._client  # kafka-python exposes connection state only on its client
        try:
            return any(client.connected(broker.node_id) for broker in client.cluster.brokers())
        except Exception:  # noqa: BLE001 - a diagnostics probe must not break ingest
            return False

    def _close_consumer(self) -> None:
        consumer, self._consumer = self._consumer, None
        self._connected = False
        if self.assigned and self.on_revoked is not None:  # leaving the group gives the partitions up
            self.on_revoked(sorted(self.assigned))
        self.assigned = frozenset()
        if consumer is None:
            return
        try:
            consumer.close(autocommit=False, timeout_ms=5000)
        except Exception:  # noqa: BLE001
            pass
