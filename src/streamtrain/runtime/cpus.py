"""A core of its own for the training thread (``TRAIN_CPUS``), the rest for ingest and serving.

One process runs the trainer beside the Kafka consumer, its decode worker and the HTTP
threads. Left to the scheduler, the busy training thread and a dozen threads that wake
every few milliseconds share every core, and the trainer spends a third of its time
runnable but not running (measured in docs/performance.md, "The trainer's share of the
cores"). Pinning it to CPUs of its own, and every other thread of the process (and the
processes they start later) to the remaining CPUs, gives it those cores whole.

Only for a service that owns its CPUs (a container with a cpuset, ``taskset``, a host of its
own): two replicas sharing a host's CPUs with ``auto`` would both pin to the same last CPU,
so the default is off. Linux only; elsewhere, or where refused, it says so and pins nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = [
    "TrainingCpus",
    "leave_training_cpus",
    "parse_cpu_list",
    "pin_training_thread",
    "plan_training_cpus",
    "release_training_cpus",
]

_pinned: TrainingCpus | None = None  # what pin_training_thread did in this process
_lock = threading.Lock()


@dataclass(frozen=True)
class TrainingCpus:
    """The CPUs the training thread runs on, and those every other thread of the process keeps."""

    training: frozenset[int]
    rest: frozenset[int]


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"3"``, ``"2-3"``, ``"0,2,4-5"`` (the kernel's cpu-list format) as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty entry in the CPU list {text!r}")
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"{part!r} in {text!r} is not a CPU number or range (e.g. 3, 2-3, 0,2,4-5)")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"range {part!r} in {text!r} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def plan_training_cpus(
    setting: str, allowed: frozenset[int], torch_threads: int, local_ranks: int = 1
) -> TrainingCpus | str:
    """What ``TRAIN_CPUS=setting`` pins among the process's ``allowed`` CPUs, or why nothing.

    ``auto``: the last ``torch_threads`` allowed CPUs train (a training step runs that many
    intra-op threads), provided at least one CPU is left for the rest; not beside other ranks
    on the host (``local_ranks`` > 1, torchrun's ``LOCAL_WORLD_SIZE``), which would all pick
    the same CPUs. A CPU list: those CPUs, which must be allowed and leave one.
    """
    if setting == "auto" and local_ranks > 1:
        return f"{local_ranks} ranks on this host would all pin the same CPUs (give each its own cpuset instead)"
    if setting == "auto":
        if len(allowed) <= torch_threads:
            return f"{len(allowed)} CPU(s) allowed, {torch_threads} torch thread(s): no CPU would be left for ingest"
        training = frozenset(sorted(allowed)[-torch_threads:])
    else:
        training = parse_cpu_list(setting)
        if not training <= allowed:
            return f"CPUs {sorted(training - allowed)} are not among this process's allowed CPUs {sorted(allowed)}"
    rest = allowed - training
    if not rest:
        return f"CPUs {sorted(training)} are all this process may use: none would be left for ingest"
    return TrainingCpus(training, rest)


def _move_threads(cpus: frozenset[int], skip: int | None = None) -> None:
    """Every thread of the process but ``skip`` (a native id) onto ``cpus``."""
    try:
        thread_ids = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        thread_ids = [threading.get_native_id()]
    for tid in thread_ids:
        if tid != skip:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # the thread ended meanwhile
                continue


def pin_training_thread(setting: str, torch_threads: int) -> TrainingCpus | None:
    """Pin the calling (training) thread per ``TRAIN_CPUS``, and move the process's other
    threads off its CPUs. Threads started later inherit their starter's CPUs, so those the
    training thread starts should call :func:`leave_training_cpus`. None when nothing was pinned."""
    global _pinned
    if not setting or setting == "off":
        return None
    if not sys.platform.startswith("linux") or not hasattr(os, "sched_setaffinity"):
        log.info("TRAIN_CPUS=%s ignored: CPU affinity per thread needs Linux", setting)
        return None
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)  # torchrun's ranks on this host
    except ValueError:  # the launcher's own check (distributed.launch) names a bad value at start-up
        local_ranks = 1
    plan = plan_training_cpus(setting, frozenset(os.sched_getaffinity(0)), torch_threads, local_ranks)
    if isinstance(plan, str):
        log.warning("TRAIN_CPUS=%s: nothing pinned: %s", setting, plan)
        return None
    try:
        os.sched_setaffinity(0, plan.training)  # 0: the calling thread
        _move_threads(plan.rest, skip=threading.get_native_id())
    except OSError as err:
        log.warning("TRAIN_CPUS=%s: could not pin the training thread: %s", setting, err)
        return None
    with _lock:
        _pinned = plan
    log.info(
        "training thread on CPU(s) %s; the service's other threads on %s (TRAIN_CPUS=%s)",
        _cpu_list(plan.training), _cpu_list(plan.rest), setting,
    )  # fmt: skip
    return plan


def leave_training_cpus() -> None:
    """Move the calling thread off the training CPUs (a helper the training thread started)."""
    with _lock:
        plan = _pinned
    if plan is None:
        return
    try:
        os.sched_setaffinity(0, plan.rest)
    except OSError as err:
        log.warning("could not move %s off the training CPUs: %s", threading.current_thread().name, err)


def release_training_cpus() -> None:
    """Give every thread of the process all the CPUs the plan split again (the trainer stopped;
    a service started after it in the same process plans afresh)."""
    global _pinned
    with _lock:
        plan, _pinned = _pinned, None
    if plan is not None:
        _move_threads(plan.training | plan.rest)


def _cpu_list(cpus: frozenset[int]) -> str:
    return ",".join(str(cpu) for cpu in sorted(cpus))
