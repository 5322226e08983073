"""PredictBatcher: merged forwards give each request exactly its own answers, in order."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from broken_models import randomize_head

from device_params import DEVICES
from streamtrain.model.inference import Prediction, predict
from streamtrain.model.network import SensorModel
from streamtrain.model.normalization import RunningNorm
from streamtrain.serve.batcher import Overloaded, PredictBatcher


def _published(seed: int = 0, device: str = "cpu") -> SimpleNamespace:
    """A model whose body reaches its answers (a random head; an untrained one forecasts the last
    reading whatever the body computes), so answers tell models and company apart."""
    torch.manual_seed(seed)
    model = randomize_head(SensorModel(channels=1, d_model=16, n_heads=2, n_layers=1, max_len=64), seed).eval()
    model = model.to(device)
    return SimpleNamespace(model=model, served=model, norm=RunningNorm(1))


def _requests(count: int, seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        [rng.standard_normal((int(n), 1)).astype(np.float32) for n in rng.integers(1, 40, rng.integers(1, 6))]
        for _ in range(count)
    ]


class _Gated:
    """predict() that waits until released, recording the size of every call."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls: list[int] = []

    def __call__(self, model, norm, arrays, token_budget):  # noqa: ANN001 - the PredictFn shape
        self.calls.append(len(arrays))
        self.started.set()
        self.release.wait(10)
        return predict(model, norm, arrays, token_budget)


ONE = [np.ones((2, 1), np.float32)]  # a request of one short instance


def run_then_close(batcher: PredictBatcher, main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``main`` on a fresh event loop (20 s at most: a worker that died fails the test, not
    hangs it), then stop the batcher's workers."""
    try:
        return asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        batcher.close()


async def submit_while_busy(
    batcher: PredictBatcher,
    gated: _Gated,
    first: tuple[Any, list[np.ndarray]],
    rest: list[tuple[Any, list[np.ndarray]]],
) -> list[list[Prediction]]:
    """Submit ``first``; once the worker is busy with it, queue ``rest``; then release it."""
    blocker = asyncio.create_task(batcher.submit(*first))
    await asyncio.to_thread(gated.started.wait, 10)
    queued = [asyncio.create_task(batcher.submit(*request)) for request in rest]
    await asyncio.sleep(0.05)
    gated.release.set()
    return [await blocker] + [await task for task in queued]


@pytest.mark.parametrize("device", DEVICES)
def test_merged_requests_get_the_same_answers_as_alone_in_order(device: str) -> None:
    """Also on a GPU: the merged forward runs there (the model's device), answers as on the CPU."""
    published = _published(device=device)
    requests = _requests(12, seed=1)
    alone = [predict(published.model, published.norm, r, 4096) for r in requests]
    on_cpu = [predict(_published().model, published.norm, r, 4096) for r in requests]
    gated = _Gated()
    batcher = PredictBatcher(gated, 4096, workers=1, admit=64, max_instances=10_000)

    merged = run_then_close(
        batcher,
        lambda: submit_while_busy(batcher, gated, (published, requests[0]), [(published, r) for r in requests[1:]]),
    )
    assert gated.calls == [len(requests[0]), sum(len(r) for r in requests[1:])]  # one merged forward
    assert batcher.merged_forwards == 1
    for got, want in zip(merged, alone, strict=True):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g.next, w.next, atol=1e-5)
            assert g.anomaly_score == pytest.approx(w.anomaly_score, abs=1e-5)
    for got, want in zip(merged, on_cpu, strict=True):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g.next, w.next, rtol=1e-4, atol=1e-5)
            assert g.anomaly_score == pytest.approx(w.anomaly_score, rel=1e-4, abs=1e-5)


def test_requests_of_different_model_versions_are_not_merged() -> None:
    old, new = _published(0), _published(1)
    gated = _Gated()
    batcher = PredictBatcher(gated, 4096, workers=1, admit=64, max_instances=10_000)
    first, second, third = _requests(3, seed=2)

    _, from_new, from_old = run_then_close(
        batcher, lambda: submit_while_busy(batcher, gated, (old, first), [(new, second), (old, third)])
    )
    # the waiting `old` request joins neither the running forward nor the `new` one
    assert gated.calls == [len(first), len(second), len(third)]
    want_new = predict(new.model, new.norm, second, 4096)
    want_old = predict(old.model, old.norm, third, 4096)
    np.testing.assert_allclose([p.next for p in from_new], [p.next for p in want_new], atol=1e-5)
    np.testing.assert_allclose([p.next for p in from_old], [p.next for p in want_old], atol=1e-5)


def test_a_merge_stops_at_max_instances() -> None:
    published = _published()
    gated = _Gated()
    batcher = PredictBatcher(gated, 4096, workers=1, admit=64, max_instances=5)
    requests = [[np.ones((3, 1), np.float32)] * 2 for _ in range(4)]  # 2 instances each

    answers = run_then_close(
        batcher,
        lambda: submit_while_busy(batcher, gated, (published, requests[0]), [(published, r) for r in requests[1:]]),
    )
    for answer in answers[1:]:
        assert len(answer) == 2
    assert gated.calls == [2, 4, 2]


def test_beyond_admit_is_refused_at_once_and_admitted_again_later() -> None:
    published = _published()
    gated = _Gated()
    batcher = PredictBatcher(gated, 4096, workers=1, admit=2, max_instances=100)

    async def main() -> None:
        tasks = [asyncio.create_task(batcher.submit(published, ONE)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded):
            await batcher.submit(published, ONE)
        gated.release.set()
        for task in tasks:
            await task
        assert len(await batcher.submit(published, ONE)) == 1

    run_then_close(batcher, main)


def test_a_failing_forward_fails_its_requests_and_the_worker_lives_on() -> None:
    published = _published()
    calls = []

    def flaky(model, norm, arrays, token_budget):  # noqa: ANN001
        calls.append(len(arrays))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return predict(model, norm, arrays, token_budget)

    batcher = PredictBatcher(flaky, 4096, workers=1, admit=8, max_instances=100)

    async def main() -> None:
        with pytest.raises(RuntimeError, match="boom"):
            await batcher.submit(published, ONE)
        assert len(await batcher.submit(published, ONE)) == 1

    run_then_close(batcher, main)


def test_a_cancelled_request_does_not_break_the_others() -> None:
    published = _published()
    gated = _Gated()
    batcher = PredictBatcher(gated, 4096, workers=1, admit=8, max_instances=100)

    async def main() -> None:
        gone = asyncio.create_task(batcher.submit(published, ONE))
        kept = asyncio.create_task(batcher.submit(published, ONE))
        await asyncio.to_thread(gated.started.wait, 10)
        gone.cancel()
        gated.release.set()
        assert len(await kept) == 1

    run_then_close(batcher, main)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError) as refused:
        PredictBatcher(predict, 4096, workers=4, admit=2, max_instances=10)
    assert str(refused.value) == (
        "PredictBatcher: need workers >= 1, admit >= workers, max_instances >= 1; got 4, 2, 10"
    )
    with pytest.raises(ValueError, match="got 1, 1, 0$"):
        PredictBatcher(predict, 4096, workers=1, admit=1, max_instances=0)
    with pytest.raises(ValueError, match="got 0, 1, 1$"):
        PredictBatcher(predict, 4096, workers=0, admit=1, max_instances=1)


def test_the_smallest_batcher_is_allowed_and_its_workers_are_named_daemons() -> None:
    batcher = PredictBatcher(predict, 4096, workers=2, admit=2, max_instances=1)
    try:
        assert [(t.name, t.daemon, t.is_alive()) for t in batcher._threads] == [
            ("predict-0", True, True),
            ("predict-1", True, True),
        ]
    finally:
        batcher.close()
    assert not any(t.is_alive() for t in batcher._threads)


def test_close_waits_ten_seconds_for_each_worker_by_default() -> None:
    batcher = PredictBatcher(predict, 4096, workers=2, admit=2, max_instances=1)
    threads, joined = batcher._threads, []
    batcher._threads = [SimpleNamespace(join=joined.append), SimpleNamespace(join=joined.append)]  # type: ignore[list-item]
    batcher.close()
    batcher.close(0.5)
    assert joined == [10.0, 10.0, 0.5, 0.5]
    for thread in threads:
        thread.join(5)


def test_a_merge_takes_requests_up_to_exactly_max_instances_and_counts_merged_forwards() -> None:
    published = _published()
    gated = _Gated()
    batcher = PredictBatcher(gated, 4096, workers=1, admit=64, max_instances=4)
    requests = [[np.ones((3, 1), np.float32)] * 2 for _ in range(5)]  # 2 instances each

    run_then_close(
        batcher,
        lambda: submit_while_busy(batcher, gated, (published, requests[0]), [(published, r) for r in requests[1:]]),
    )
    assert gated.calls == [2, 4, 4] and batcher.merged_forwards == 2


def test_a_full_queue_and_a_failed_forward_say_so(caplog: pytest.LogCaptureFixture) -> None:
    published = _published()
    gated = _Gated()
    batcher = PredictBatcher(gated, 4096, workers=1, admit=1, max_instances=100)

    async def main() -> None:
        task = asyncio.create_task(batcher.submit(published, ONE))
        await asyncio.to_thread(gated.started.wait, 10)
        with pytest.raises(Overloaded) as refused:
            await batcher.submit(published, ONE)
        assert str(refused.value) == "too many predictions in flight (1)"
        gated.release.set()
        await task

    run_then_close(batcher, main)

    def broken(model, norm, arrays, token_budget):  # noqa: ANN001
        raise RuntimeError("boom")

    failing = PredictBatcher(broken, 4096, workers=1, admit=4, max_instances=100)

    async def fail() -> None:
        with pytest.raises(RuntimeError, match="^boom$"):
            await failing.submit(published, ONE)

    with caplog.at_level(logging.ERROR, logger="streamtrain.serve.batcher"):
        run_then_close(failing, fail)
    assert [r.getMessage() for r in caplog.records] == ["predict forward failed for 1 requests"]


def test_after_close_requests_are_refused_as_overloaded() -> None:
    batcher = PredictBatcher(predict, 4096, workers=1, admit=2, max_instances=10)
    batcher.close()

    async def main() -> None:
        with pytest.raises(Overloaded, match="^the predict workers are stopping$"):
            await batcher.submit(_published(), ONE)

    asyncio.run(main())
