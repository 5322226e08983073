"""TRAIN_CPUS: the CPU-list format, which CPUs a setting gives the trainer, and a real trainer pinned.

Pinning changes the affinity of every thread of a process, so the tests that pin run in a
child process of their own and report what the kernel says each thread may use.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import streamtrain.runtime.cpus as cpus_module
from streamtrain.config import SettingsError, load_settings
from streamtrain.runtime.cpus import TrainingCpus, parse_cpu_list, plan_training_cpus

ROOT = Path(__file__).resolve().parents[3]
CAN_PIN = sys.platform.startswith("linux") and hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2
needs_two_cpus = pytest.mark.skipif(not CAN_PIN, reason="needs Linux and at least 2 allowed CPUs")


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("3", {3}), ("2-3", {2, 3}), ("0,2,4-5", {0, 2, 4, 5}), (" 1 , 1 ", {1}), ("7-7", {7})],
)
def test_a_cpu_list_reads_as_the_kernel_writes_it(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == frozenset(cpus)


@pytest.mark.parametrize(("text", "says"), [("", "empty"), ("1,", "empty"), ("a", "not a CPU"), ("3-1", "backwards")])
def test_a_bad_cpu_list_names_its_bad_entry(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_cpu_list(text)


@given(st.frozensets(st.integers(0, 255), min_size=1))
def test_any_set_of_cpus_written_as_a_list_reads_back(cpus: frozenset[int]) -> None:
    assert parse_cpu_list(",".join(map(str, sorted(cpus)))) == cpus


def test_the_setting_is_checked_when_the_settings_load() -> None:
    assert load_settings(train_cpus=" AUTO ").train_cpus == "auto"
    assert load_settings().train_cpus == "off"
    with pytest.raises(SettingsError, match="not a CPU number"):
        load_settings(train_cpus="two")


def test_auto_gives_the_trainer_the_last_cpus_and_leaves_the_rest() -> None:
    assert plan_training_cpus("auto", frozenset({0, 1}), 1) == TrainingCpus(frozenset({1}), frozenset({0}))
    assert plan_training_cpus("auto", frozenset({2, 5, 7, 9}), 2) == TrainingCpus(frozenset({7, 9}), frozenset({2, 5}))


def test_nothing_is_pinned_where_nothing_would_be_left_or_the_cpus_are_not_allowed() -> None:
    assert "no CPU would be left" in str(plan_training_cpus("auto", frozenset({0}), 1))
    assert "no CPU would be left" in str(plan_training_cpus("auto", frozenset({0, 1}), 2))
    assert "not among" in str(plan_training_cpus("3", frozenset({0, 1}), 1))
    assert "none would be left" in str(plan_training_cpus("0-1", frozenset({0, 1}), 1))
    assert plan_training_cpus("0", frozenset({0, 1}), 1) == TrainingCpus(frozenset({0}), frozenset({1}))


def test_auto_pins_nothing_beside_other_ranks_on_the_host() -> None:
    assert "would all pin the same CPUs" in str(plan_training_cpus("auto", frozenset(range(8)), 1, local_ranks=2))
    assert plan_training_cpus("auto", frozenset(range(8)), 1, local_ranks=1) == TrainingCpus(
        frozenset({7}), frozenset(range(7))
    )


# A real Service's trainer thread started with TRAIN_CPUS, beside a thread started before it
# (as ingest is); printed: what each thread may run on once the trainer has stepped.
SERVICE_PROBE = textwrap.dedent(
    """
    import json, os, sys, tempfile, threading, time
    from pathlib import Path
    sys.path.insert(0, {fixtures!r})
    import numpy as np
    from quality_service_fixtures import build_service, feed, oscillations

    stop = threading.Event()
    ingest_like = threading.Thread(target=stop.wait, name="ingest-like", daemon=True)
    ingest_like.start()
    service = build_service(Path(tempfile.mkdtemp()), train_cpus={setting!r}, compile="off")
    feed(service, oscillations(np.random.default_rng(0), 64, time.time()))
    service.trainer.start()
    deadline = time.time() + 60
    while service.trainer.step < 3 and time.time() < deadline:
        time.sleep(0.05)
    cpus = {{t.name: sorted(os.sched_getaffinity(t.native_id)) for t in threading.enumerate()}}
    step = service.trainer.step
    service.trainer.stop()
    after = {{t.name: sorted(os.sched_getaffinity(t.native_id)) for t in threading.enumerate()}}
    stop.set()
    print(json.dumps({{"cpus": cpus, "after": after, "step": step}}))
    """
)


def probe(setting: str) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """What each thread may run on while the trainer trains, and after it stopped."""
    script = SERVICE_PROBE.format(fixtures=str(ROOT / "tests/unit/quality"), setting=setting)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["step"] >= 3, report
    return report["cpus"], report["after"]


@needs_two_cpus
def test_a_started_trainer_runs_alone_on_its_cpus_and_its_helpers_leave_them() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    cpus, after = probe("auto")
    assert cpus["trainer"] == allowed[-1:], cpus
    rest = allowed[:-1]
    assert cpus["MainThread"] == rest and cpus["ingest-like"] == rest, cpus
    assert cpus["trainer-prefetch"] == rest, cpus  # started by the trainer, yet off its CPU
    # a stopped trainer gives its CPUs back: a service started next in the process plans afresh
    assert after["MainThread"] == allowed and after["ingest-like"] == allowed, after


@needs_two_cpus
def test_off_leaves_every_thread_where_the_scheduler_puts_it() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    cpus, _ = probe("off")
    assert {name: cpu for name, cpu in cpus.items() if cpu != allowed} == {}, cpus


class Kernel:
    """``os``'s affinity calls for this process, recorded instead of made (this test process stays as it is)."""

    def __init__(self, allowed: set[int], threads: list[int], gone: set[int] | None = None) -> None:
        self.allowed, self.threads, self.gone = frozenset(allowed), threads, gone or set()
        self.set: list[tuple[int, frozenset[int]]] = []
        self.refuse = False

    def sched_getaffinity(self, tid: int) -> frozenset[int]:
        assert tid == 0, "the process's own CPUs are the calling thread's (0)"
        return self.allowed

    def sched_setaffinity(self, tid: int, cpus: frozenset[int]) -> None:
        if self.refuse:
            raise PermissionError(1, "Operation not permitted")
        if tid in self.gone:
            raise ProcessLookupError(tid)
        self.set.append((tid, frozenset(cpus)))

    def listdir(self, path: str) -> list[str]:
        assert path == "/proc/self/task"
        return [str(t) for t in self.threads]


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Kernel:
    fake = Kernel({0, 1, 2, 3}, threads=[100, 103, 101, 102], gone={103})  # 103 ends before it is moved
    for name in ("sched_getaffinity", "sched_setaffinity", "listdir"):
        monkeypatch.setattr(cpus_module.os, name, getattr(fake, name))
    monkeypatch.setattr(cpus_module.threading, "get_native_id", lambda: 101)
    monkeypatch.setattr(cpus_module, "_pinned", None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return fake


def test_pinning_puts_the_caller_on_its_cpus_every_other_thread_off_them_and_says_so(
    kernel: Kernel, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="streamtrain.runtime.cpus"):
        plan = cpus_module.pin_training_thread("auto", torch_threads=2)
    assert plan == TrainingCpus(frozenset({2, 3}), frozenset({0, 1}))
    # the caller (0: the calling thread) first, then every thread but the caller; 103 ended meanwhile
    assert kernel.set == [(0, frozenset({2, 3})), (100, frozenset({0, 1})), (102, frozenset({0, 1}))]
    assert [r.getMessage() for r in caplog.records] == [
        "training thread on CPU(s) 2,3; the service's other threads on 0,1 (TRAIN_CPUS=auto)"
    ]
    kernel.set.clear()
    cpus_module.leave_training_cpus()  # a helper the trainer started
    assert kernel.set == [(0, frozenset({0, 1}))]
    kernel.set.clear()
    cpus_module.release_training_cpus()
    assert kernel.set == [(t, frozenset({0, 1, 2, 3})) for t in (100, 101, 102)]
    kernel.set.clear()
    cpus_module.leave_training_cpus()  # nothing pinned any more: nothing to leave
    cpus_module.release_training_cpus()
    assert kernel.set == []


@pytest.mark.parametrize("setting", ["", "off"])
def test_off_or_unset_pins_nothing(kernel: Kernel, setting: str) -> None:
    assert cpus_module.pin_training_thread(setting, torch_threads=1) is None and kernel.set == []


def test_a_plan_that_cannot_work_pins_nothing_and_says_why(
    kernel: Kernel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING, logger="streamtrain.runtime.cpus"):
        assert cpus_module.pin_training_thread("auto", torch_threads=1) is None
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")  # the launcher names a bad value; here it counts as 1
        assert cpus_module.pin_training_thread("auto", torch_threads=1) is not None
    assert kernel.set[0] == (0, frozenset({3}))
    assert [r.getMessage() for r in caplog.records] == [
        "TRAIN_CPUS=auto: nothing pinned: 2 ranks on this host would all pin the same CPUs "
        "(give each its own cpuset instead)"
    ]


def test_a_refused_affinity_pins_nothing_and_says_so(kernel: Kernel, caplog: pytest.LogCaptureFixture) -> None:
    kernel.refuse = True
    with caplog.at_level(logging.WARNING, logger="streamtrain.runtime.cpus"):
        assert cpus_module.pin_training_thread("2-3", torch_threads=2) is None
        cpus_module.leave_training_cpus()  # nothing was pinned: nothing asked
    assert [r.getMessage() for r in caplog.records] == [
        "TRAIN_CPUS=2-3: could not pin the training thread: [Errno 1] Operation not permitted"
    ]
    assert cpus_module._pinned is None


def test_a_helper_that_cannot_leave_says_which_thread_it_is(kernel: Kernel, caplog: pytest.LogCaptureFixture) -> None:
    assert cpus_module.pin_training_thread("3", torch_threads=1) is not None
    kernel.refuse = True
    with caplog.at_level(logging.WARNING, logger="streamtrain.runtime.cpus"):
        cpus_module.leave_training_cpus()
    assert [r.getMessage() for r in caplog.records] == [
        f"could not move {threading.current_thread().name} off the training CPUs: [Errno 1] Operation not permitted"
    ]


def test_without_proc_only_the_calling_thread_is_moved(kernel: Kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_proc(path: str) -> list[str]:
        raise FileNotFoundError(path)

    monkeypatch.setattr(cpus_module.os, "listdir", no_proc)
    cpus_module._move_threads(frozenset({0}))
    assert kernel.set == [(101, frozenset({0}))]


def test_elsewhere_than_linux_nothing_is_pinned_and_it_says_so(
    kernel: Kernel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpus_module.sys, "platform", "darwin")
    with caplog.at_level(logging.INFO, logger="streamtrain.runtime.cpus"):
        assert cpus_module.pin_training_thread("auto", torch_threads=1) is None
    assert [r.getMessage() for r in caplog.records] == ["TRAIN_CPUS=auto ignored: CPU affinity per thread needs Linux"]
    assert kernel.set == []
