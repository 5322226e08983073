"""Kafka ingest: consumer thread, validation, dead letters, offsets the window covers.

One thread owns the kafka-python consumer (it is not thread-safe) and does everything
that touches it: poll, seek, commit, lag. Other threads talk to it through
:meth:`Ingestor.request_commit`. Rebalance callbacks run on kafka-python's IO thread,
where blocking consumer calls raise; they only call the local, non-blocking ``seek``.

Offsets: the window stores, under its own lock, the next offset per partition that its
state covers. A checkpoint saves that state; on restart each partition is sought to the
stored offset, so the window is exactly-once with respect to the topic. Offsets are
committed to the consumer group only after a checkpoint made them durable.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import threading
import time
from collections import Counter as TallyCounter
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import KafkaError, TopicAlreadyExistsError
from kafka.structs import OffsetAndMetadata

from streamtrain.config import Settings
from streamtrain.events import REASONS, DecodedBatch, EventBatch, EventLimits, decode_batch
from streamtrain.metrics import Metrics
from streamtrain.window import RecencyWindow

log = logging.getLogger(__name__)

_RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
# A commit must not hold the consumer thread (and with it a checkpoint) for the client's
# 30 s request timeout when the broker goes away: commits are best effort, the
# checkpoint's offsets are authoritative.
_COMMIT_TIMEOUT_MS = 3000


def ensure_topics(bootstrap: str, topics: Mapping[str, int], timeout_s: float = 10.0) -> None:
    """Create missing topics (name -> partitions); existing ones are left alone."""
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        existing = set(admin.list_topics())
        wanted = [NewTopic(name, num_partitions=p, replication_factor=1) for name, p in topics.items() if name not in existing]
        if wanted:
            try:
                admin.create_topics(wanted, timeout_ms=int(timeout_s * 1000))
            except TopicAlreadyExistsError:
                pass
    finally:
        admin.close()


@dataclass
class IngestStats:
    """Counters for ``GET /v1/window`` (the window adds its own)."""

    seen_total: int = 0
    accepted_total: int = 0
    rejected: TallyCounter[str] = field(default_factory=TallyCounter)

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())


class _SeekOnAssign(ConsumerRebalanceListener):
    """Runs on kafka-python's IO thread: only local, non-blocking calls here."""

    def __init__(self, ingestor: Ingestor) -> None:
        self._ingestor = ingestor

    def on_partitions_revoked(self, revoked: Any) -> None:
        partitions = sorted(tp.partition for tp in revoked)
        log.info("partitions revoked: %s", partitions)
        if self._ingestor.on_revoked is not None and partitions:
            self._ingestor.on_revoked(partitions)

    def on_partitions_assigned(self, assigned: Any) -> None:
        consumer = self._ingestor._consumer
        if self._ingestor.on_assigned is not None and assigned:
            self._ingestor.on_assigned(sorted(tp.partition for tp in assigned))
        stored = self._ingestor.resume_offsets()
        for tp in assigned:
            if tp.partition in stored and consumer is not None:
                consumer.seek(tp, stored[tp.partition])
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


def _exit_with_parent() -> None:
    """Decode-worker initializer: end the worker when the service ends, even by SIGKILL.

    A pool worker blocks on its call queue, whose pipe it holds both ends of, so it never
    sees the parent die; without this, every killed service leaves a worker (and the
    multiprocessing resource tracker) behind. The parent sentinel turns readable then.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class Decoder:
    """Decodes poll batches in a worker process, so JSON parsing runs beside the poll loop.

    kafka-python's own record parsing and our JSON decoding both hold the GIL; a process
    of its own lets them overlap on two cores. ``workers == 0`` decodes in the calling
    thread. A broken worker is replaced, and the batch decoded in-thread: nothing is lost.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None

    def submit(self, *args: Any) -> Future[DecodedBatch] | None:
        if self.workers <= 0:
            return None
        try:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"), initializer=_exit_with_parent
                )
            return self._pool.submit(decode_batch, *args)
        except (BrokenProcessPool, RuntimeError, OSError) as err:
            log.warning("decode worker unavailable (%s); decoding in the ingest thread", err)
            self._reset()
            return None

    def result(self, future: Future[DecodedBatch] | None, args: tuple[Any, ...]) -> DecodedBatch:
        if future is not None:
            try:
                return future.result()
            except (BrokenProcessPool, OSError) as err:
                log.warning("decode worker failed (%s); decoding this batch in the ingest thread", err)
                self._reset()
        return decode_batch(*args)

    def _reset(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)  # an idle worker exits at once


class Ingestor:
    """Consumes the topic into the window on a thread of its own; never crashes on input."""

    def __init__(
        self,
        settings: Settings,
        window: RecencyWindow,
        metrics: Metrics,
        *,
        on_events: Callable[[EventBatch, dict[int, int]], None] | None = None,
        on_assigned: Callable[[list[int]], None] | None = None,
        on_revoked: Callable[[list[int]], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.on_events = on_events  # DP mode: every valid event also goes to the DP window
        # DP mode: partitions arriving and leaving (IO thread: local work only, no consumer calls)
        self.on_assigned = on_assigned
        self.on_revoked = on_revoked
        self.apply_lock = threading.Lock()  # held while a batch lands; checkpoints take it
        self.window = window
        self.metrics = metrics
        self.limits = EventLimits.from_settings(settings)
        self.stats = IngestStats()
        self._decoder = Decoder(settings.decode_workers)
        self._clock = clock
        self._consumer: KafkaConsumer | None = None
        self._producer: KafkaProducer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._commits: queue.Queue[tuple[dict[int, int], threading.Event]] = queue.Queue()
        self._dlq_failures = 0
        self._dlq_lock = threading.Lock()
        self._connected = False
        self._polled: dict[int, int] = {}  # next offset per partition of every polled batch
        self._reported_evicted = 0
        self._last_gauges = 0.0
        self.last_error: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ingest", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def connected(self) -> bool:
        """True while the consumer holds a live connection to a broker."""
        return self._connected and self._thread is not None and self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ called from other threads
    def flush_dead_letters(self, timeout_s: float = 10.0) -> bool:
        """Wait until every dead letter sent so far is acknowledged; False if any failed."""
        producer = self._producer
        if producer is None:
            return True
        try:
            producer.flush(timeout=timeout_s)
        except KafkaError as err:
            log.warning("dead-letter flush failed: %s", err)
            return False
        with self._dlq_lock:
            failed, self._dlq_failures = self._dlq_failures, 0
        return failed == 0

    def request_commit(self, offsets: Mapping[int, int], timeout_s: float = 10.0) -> bool:
        """Ask the consumer thread to commit ``offsets`` to the group; True once done."""
        if not self.running or not offsets:
            return False
        done = threading.Event()
        self._commits.put((dict(offsets), done))
        return done.wait(timeout_s)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            try:
                self._connect()
                attempt = 0
                self._consume()
            except Exception as err:  # noqa: BLE001 - the ingest thread must survive anything
                self._connected = False
                self.metrics.kafka_connected.set(0)
                self.last_error = f"{type(err).__name__}: {err}"
                delay = _RETRY_BACKOFF_S[min(attempt, len(_RETRY_BACKOFF_S) - 1)]
                attempt += 1
                log.warning("kafka ingest error (%s); retrying in %.1fs", self.last_error, delay)
                self._close_clients()
                self._stop.wait(delay)
        self._close_clients()
        self._decoder.close()

    def _connect(self) -> None:
        s = self.settings
        self._polled = {}  # what an earlier consumer polled is in the window by now
        ensure_topics(s.kafka_bootstrap, {s.topic: s.topic_partitions, s.dlq_topic: s.topic_partitions})
        self._producer = KafkaProducer(
            bootstrap_servers=s.kafka_bootstrap,
            acks="all",
            linger_ms=20,
            retries=2147483647,
            max_request_size=max(s.max_message_bytes + 65536, 1 << 20),
            client_id="streamtrain-dlq",
        )
        consumer = KafkaConsumer(
            bootstrap_servers=s.kafka_bootstrap,
            group_id=s.group_id,
            # Static membership (KIP-345): a replica that comes back under the same id
            # takes over its old member at once; without it, a crashed member holds its
            # partitions until the session times out.
            group_instance_id=s.group_instance_id,
            client_id="streamtrain-ingest",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=s.poll_max_records,
            max_partition_fetch_bytes=max(8 << 20, s.max_message_bytes + 65536),
            fetch_max_bytes=64 << 20,
            reconnect_backoff_max_ms=2000,
            request_timeout_ms=30000,
            metadata_max_age_ms=30000,  # a topic's partitions show up within 30 s, not 5 min
        )
        self._consumer = consumer
        # A just-created topic can be missing from the first metadata; subscribing then
        # would assign nothing until the next metadata refresh.
        deadline = time.monotonic() + 15.0
        while not consumer.partitions_for_topic(s.topic) and time.monotonic() < deadline and not self._stop.is_set():
            self._stop.wait(0.2)
        consumer.subscribe([s.topic], listener=_SeekOnAssign(self))
        log.info("ingest connected to %s, topic %s, group %s", s.kafka_bootstrap, s.topic, s.group_id)

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
                self.metrics.kafka_connected.set(1 if self._connected else 0)
                if records:
                    in_flight.append(self._submit(records))
                # Apply finished batches in poll order; wait only when the pipeline is full or idle.
                while in_flight and (in_flight[0].done() or len(in_flight) > 1 or not records):
                    self._apply(in_flight.popleft())
                self._serve_commits(consumer)
                self._update_gauges(consumer)
        finally:
            while in_flight:  # what was polled is applied, so the window's offsets stay exact
                self._apply(in_flight.popleft())

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
        """Dead-letter, insert and count one decoded poll batch; the window records its offsets."""
        decoded = self._decoder.result(pending.future, pending.args)
        messages = pending.messages
        for position, rejection in decoded.rejections:
            self._dead_letter(messages[position], rejection.reason)
        with self.apply_lock:
            if len(decoded.events):
                self.window.insert_batch(decoded.events, pending.next_offsets)
            else:
                self.window.advance_offsets(pending.next_offsets)
            if self.on_events is not None:
                self.on_events(decoded.events, pending.next_offsets)
        reasons = TallyCounter(r.reason for _, r in decoded.rejections)
        self.stats.seen_total += len(messages)
        self.stats.accepted_total += len(decoded.events)
        self.stats.rejected.update(reasons)
        self.metrics.events_consumed.inc(len(messages))
        self.metrics.events_accepted.inc(len(decoded.events))
        for reason, count in reasons.items():
            self.metrics.events_rejected.labels(reason).inc(count)

    def _process(self, records: Mapping[TopicPartition, list[Any]]) -> None:
        """Decode and apply one poll batch at once (no pipelining)."""
        self._apply(self._submit(records))

    def _dead_letter(self, message: Any, reason: str) -> None:
        """Forward the raw message unchanged to ``<topic>.dlq`` with the four headers."""
        assert self._producer is not None and reason in REASONS
        headers = [
            ("reason", reason.encode()),
            ("source_topic", message.topic.encode()),
            ("source_partition", str(message.partition).encode()),
            ("source_offset", str(message.offset).encode()),
        ]
        future = self._producer.send(self.settings.dlq_topic, key=message.key, value=message.value, headers=headers)
        future.add_errback(self._on_dead_letter_failed)

    def _on_dead_letter_failed(self, err: Exception) -> None:
        log.warning("dead-letter send failed: %s", err)
        self.metrics.dead_letters_failed.inc()
        with self._dlq_lock:
            self._dlq_failures += 1

    def _serve_commits(self, consumer: KafkaConsumer) -> None:
        while True:
            try:
                offsets, done = self._commits.get_nowait()
            except queue.Empty:
                return
            assigned = {tp.partition: tp for tp in consumer.assignment()}
            to_commit = {
                assigned[p]: OffsetAndMetadata(o, "", -1) for p, o in offsets.items() if p in assigned
            }
            try:
                if to_commit and self._connected:  # while the broker is away the next checkpoint commits
                    consumer.commit(to_commit, timeout_ms=_COMMIT_TIMEOUT_MS)
            except KafkaError as err:
                log.warning("offset commit failed (checkpoint offsets stay authoritative): %s", err)
            finally:
                done.set()

    def _update_gauges(self, consumer: KafkaConsumer) -> None:
        now = time.monotonic()
        evicted = self.window.evicted_total
        if evicted > self._reported_evicted:
            self.metrics.window_evicted.inc(evicted - self._reported_evicted)
            self._reported_evicted = evicted
        self.metrics.window_size.set(len(self.window))
        if now - self._last_gauges < 1.0:
            return
        self._last_gauges = now
        self.metrics.window_tokens.set(self.window.tokens)
        positions = self.window.next_offsets
        lag = 0
        for tp in consumer.assignment():
            end = consumer.highwater(tp)
            if end is not None:
                lag += max(0, end - positions.get(tp.partition, 0))
        self.metrics.consumer_lag.set(lag)

    @staticmethod
    def _broker_connected(consumer: KafkaConsumer) -> bool:
        client = consumer._client  # kafka-python exposes connection state only on its client
        try:
            return any(client.connected(broker.node_id) for broker in client.cluster.brokers())
        except Exception:  # noqa: BLE001 - a diagnostics probe must not break ingest
            return False

    def _close_clients(self) -> None:
        for client in (self._consumer, self._producer):
            if client is None:
                continue
            try:
                client.close(timeout=2) if isinstance(client, KafkaProducer) else client.close(autocommit=False)
            except Exception:  # noqa: BLE001
                pass
        self._consumer = None
        self._producer = None
