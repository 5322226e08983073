"""The compiled forwards answer as the eager ones: predictions, training curves, checkpoints.

The rest of the suite runs with ``COMPILE=off`` (tests/conftest.py); these tests compile on
purpose, once per module (each compilation takes tens of seconds here). Predictions are
checked on :func:`broken_models.computing_model` (random body, random non-zero head): the
service's untrained model forecasts the last reading whatever its body computes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from broken_models import computing_model
from small_trainer import make_small_trainer

import streamtrain.training.trainer as trainer_module
from streamtrain.checkpoint.store import CheckpointStore
from streamtrain.data.collate import Batch
from streamtrain.model.compiled import (
    CompiledForward,
    compiled_graphs,
    compiling,
    pad_rows_and_positions,
    training_row_multiple,
)
from streamtrain.model.forecasters import NETWORK, ServedModel
from streamtrain.model.inference import CompiledInference, InferenceModel, PredictionArrays, predict_arrays
from streamtrain.model.network import SensorModel
from streamtrain.model.normalization import RunningNorm
from streamtrain.training.trainer import Trainer

torch.set_num_threads(1)

COMPILE_WAIT_S = 900.0  # a loaded 2-core machine compiles a forward and backward in one to three minutes


@pytest.fixture(scope="module")
def model() -> SensorModel:
    """Frozen, as the service publishes it (the compiled predict forward is guarded on that)."""
    return computing_model(channels=2, n_classes=3, max_len=64).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def norm() -> RunningNorm:
    norm = RunningNorm(2)
    norm.update(torch.randn(8, 20, 2, generator=torch.Generator().manual_seed(1)) * 3 + 1, torch.ones(8, 20).bool())
    return norm


GRAPHS_AFTER_WARM_UP: dict[str, int] = {}  # what this process had compiled when a fixture's warm-up ended


@pytest.fixture(scope="module")
def compiled_predict(model: SensorModel) -> CompiledInference:
    inference = CompiledInference(model, enabled=True)
    assert inference.compiled.wait(COMPILE_WAIT_S), "the predict forward did not compile in time"
    assert inference.compiled.state == "compiled", "torch.compile failed here (see the log): nothing was tested"
    GRAPHS_AFTER_WARM_UP["predict"] = compiled_graphs()
    return inference


def requests(seed: int) -> list[list[np.ndarray]]:
    """Requests of every shape the padding has to handle: one instance, one reading, long and mixed."""
    rng = np.random.default_rng(seed)

    def walk(length: int) -> np.ndarray:
        return np.cumsum(rng.standard_normal((length, 2)), axis=0).astype(np.float32) * 2 + 5

    return [
        [walk(1)],
        [walk(2)],  # L - 1 = 1: the forecast loss's shifted positions would specialize
        [walk(17)],
        [walk(1), walk(1)],
        [walk(int(n)) for n in rng.integers(1, 65, 40)],
        [walk(64), walk(2), walk(33)],
    ]


def assert_close_predictions(a: PredictionArrays, b: PredictionArrays, atol: float) -> None:
    np.testing.assert_allclose(a.next, b.next, atol=atol, rtol=0)
    np.testing.assert_allclose(a.anomaly_score, b.anomaly_score, atol=atol, rtol=0)
    assert a.probs is not None and b.probs is not None
    np.testing.assert_allclose(a.probs, b.probs, atol=atol, rtol=0)


def test_compiled_predictions_equal_the_eager_ones_within_1e_5(
    model: SensorModel, norm: RunningNorm, compiled_predict: CompiledInference
) -> None:
    moved = 0.0
    for values in requests(seed=0):
        eager = predict_arrays(model, norm, values, token_budget=256)
        compiled = predict_arrays(model, norm, values, token_budget=256, forward=compiled_predict)
        assert_close_predictions(compiled, eager, atol=1e-5)
        moved = max(moved, float(np.abs(eager.next - np.stack([v[-1] for v in values])).max()))
    assert moved > 0.5  # the body reaches the forecast (not the last value): the check means something


def test_every_batch_shape_runs_on_the_graph_the_warm_up_made(
    model: SensorModel, norm: RunningNorm, compiled_predict: CompiledInference
) -> None:
    for seed in (0, 1, 2):
        for values in requests(seed):
            predict_arrays(model, norm, values, token_budget=128, forward=compiled_predict)
    # one row, one or two readings, any size: no graph beyond the warm-up's (counted from
    # there, so shapes an earlier test of this module ran are not missed)
    assert compiled_graphs() == GRAPHS_AFTER_WARM_UP["predict"]


def test_a_forecaster_beside_the_network_is_answered_eagerly_on_no_new_graph(
    model: SensorModel, norm: RunningNorm, compiled_predict: CompiledInference
) -> None:
    served = ServedModel(model, NETWORK)  # a blend weight would be compiled in as a constant
    before = compiled_graphs()
    for values in requests(seed=3):
        eager = predict_arrays(served, norm, values, token_budget=256)
        answered = predict_arrays(served, norm, values, token_budget=256, forward=compiled_predict)
        np.testing.assert_array_equal(answered.next, eager.next)  # the same eager computation, bit for bit
    assert compiled_graphs() == before


def test_compiling_off_answers_eagerly_and_leaves_the_template_alone() -> None:
    template = computing_model(channels=2, n_classes=3, max_len=64).train()
    assert template.training and all(p.requires_grad for p in template.parameters())
    inference = CompiledInference(template, enabled=False)
    assert inference.compiled.name == "predict forward" and inference.compiled.state == "off"
    assert template.training and all(p.requires_grad for p in template.parameters())  # the copy is frozen, not it
    network = InferenceModel(template.eval(), RunningNorm(2))
    values, lengths = torch.randn(3, 5, 2), torch.tensor([5, 2, 1])
    with torch.no_grad():
        for got, want in zip(inference(network, values, lengths), network(values, lengths), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_small_inputs_are_padded_to_three_rows_and_positions_of_padding() -> None:
    values, mask = pad_rows_and_positions(torch.ones(1, 1, 3), torch.ones(1, 1, dtype=torch.bool))
    assert values.shape == (3, 3, 3) and mask.tolist() == [[True, False, False], [False] * 3, [False] * 3]
    assert values.sum() == 3  # pads are zero
    values, lengths = pad_rows_and_positions(torch.ones(1, 4, 1), torch.tensor([4]))
    assert values.shape == (3, 4, 1) and lengths.tolist() == [4, 0, 0]
    big = torch.ones(3, 5, 1)
    assert pad_rows_and_positions(big, torch.ones(3, 5))[0] is big


# ---------------------------------------------------------------------------------- training


def trained(trainer: Trainer, batches: list[Batch]) -> list[float]:
    losses = []
    for batch in batches:
        report = trainer.train_step(batch)
        assert report.applied
        losses.append(report.loss)
    return losses


@pytest.fixture(scope="module")
def trainers() -> Iterator[dict[str, Any]]:
    """Two small trainers from one seed, compiled and eager, and batches of their (identical) stream.

    The compiled one pads its token rows to a multiple of 16 as a step on a CPU does
    (:func:`training_row_multiple`), the eager one not at all: the curve, the checkpoints and the
    one graph for every batch shape are checked with the padding against none."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer_module, "training_row_multiple", lambda *_: 16)
        compiled = make_small_trainer(seed=5, compile="on", n_classes=0)
        patch.setattr(trainer_module, "training_row_multiple", lambda *_: 1)
        eager = make_small_trainer(seed=5, compile="off", n_classes=0)
    assert (compiled.forward.row_multiple, eager.forward.row_multiple) == (16, 1)
    assert compiled.forward.compiled.wait(COMPILE_WAIT_S), "the training forward did not compile in time"
    assert compiled.forward.compiled.state == "compiled", "torch.compile failed here (see the log): nothing was tested"
    source = iter(eager.dataset)
    yield {"compiled": compiled, "eager": eager, "batches": [next(source) for _ in range(12)]}


def test_a_few_compiled_training_steps_give_the_eager_curve(trainers: dict[str, Any]) -> None:
    batches = trainers["batches"][:8]
    graphs = compiled_graphs()
    compiled = trained(trainers["compiled"], batches)
    assert compiled_graphs() == graphs  # every batch shape on the warm-up's graph
    eager = trained(trainers["eager"], batches)
    np.testing.assert_allclose(compiled, eager, rtol=1e-4, atol=1e-6)
    assert eager[-1] < eager[0]  # the curve moves: the comparison is of training, not of a fixed point
    named = zip(trainers["compiled"].model.named_parameters(), trainers["eager"].model.parameters(), strict=True)
    for (name, a), b in named:
        if name.endswith("attn.key.bias"):
            # It adds q . b to all of a query's scores alike, which the softmax ignores: its gradient is
            # rounding noise, which Adam scales to steps of the learning rate's size either way (on an
            # AVX-512 CPU without AMX the two noises differ by 13-16% of those steps; no output moves).
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("writer", "reader"), [("compiled", "eager"), ("eager", "compiled")])
def test_a_checkpoint_written_with_compile_on_or_off_restores_with_the_other(
    trainers: dict[str, Any], tmp_path: Path, writer: str, reader: str
) -> None:
    source, target = trainers[writer], trainers[reader]
    trained(source, trainers["batches"][8:10])
    store = CheckpointStore(tmp_path / writer)
    with source.lock:
        store.save({"trainer": source.state_dict()}, step=source.step)
    loaded = store.load_latest()
    assert loaded is not None
    target.load_state_dict(loaded.state["trainer"])
    for a, b in zip(source.model.parameters(), target.model.parameters(), strict=True):
        assert torch.equal(a, b)
    batch = trainers["batches"][10]
    np.testing.assert_allclose(trained(target, [batch]), trained(source, [batch]), rtol=1e-4)


# ---------------------------------------------------------------------------------- fallback


def test_a_compiler_that_fails_leaves_the_function_eager_with_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    def no_compiler(_run: Any) -> None:
        raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")

    with caplog.at_level(logging.WARNING, logger="streamtrain.model.compiled"):
        forward = CompiledForward(lambda x: x + 1, name="test forward", enabled=True, warm_up=no_compiler)
        assert forward.wait(60)
    assert forward.state == "failed" and forward(1) == 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "test forward" in lines[0] and "running eager" in lines[0] and "C++" in lines[0]


def test_a_compiled_call_that_fails_falls_back_to_eager_for_good(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    forward = CompiledForward(lambda x: calls.append("eager") or x, name="test forward", enabled=True,
                              warm_up=lambda run: None)  # fmt: skip
    assert forward.wait(60) and forward.state == "compiled"

    def recompile_fails(x: int) -> int:
        calls.append("compiled")
        raise torch._dynamo.exc.TorchDynamoException("recompilation failed")

    forward._active = recompile_fails
    with caplog.at_level(logging.WARNING, logger="streamtrain.model.compiled"):
        assert forward(3) == 3 and forward(4) == 4
    assert calls == ["compiled", "eager", "eager"] and forward.state == "failed"
    assert len(caplog.records) == 1


def test_compile_off_never_compiles() -> None:
    forward = CompiledForward(lambda x: x, name="test forward", enabled=False, warm_up=lambda run: run(1))
    assert forward.wait(0) and forward.state == "off" and not forward.compiled


def _compiler_assertion(x: int) -> int:
    """Raises an AssertionError from a frame of torch._dynamo, as its guard checks do."""
    namespace: dict[str, Any] = {}
    source = "def check(x):\n    raise AssertionError('Guard failed on the same frame it was created.')\n"
    exec(compile(source, str(Path(torch._dynamo.__file__).parent / "guards.py"), "exec"), namespace)
    return namespace["check"](x)


def test_a_compiler_assertion_answers_that_call_eagerly_and_keeps_the_graphs(caplog: pytest.LogCaptureFixture) -> None:
    forward = CompiledForward(lambda x: -x, name="test forward", enabled=True, warm_up=lambda run: None)
    assert forward.wait(60) and forward.state == "compiled"
    compiled = [_compiler_assertion, lambda x: x]  # fails once, then the graphs answer
    forward._active = lambda x: compiled.pop(0)(x)
    with caplog.at_level(logging.WARNING, logger="streamtrain.model.compiled"):
        assert forward(3) == -3  # eager
        assert forward(4) == 4  # compiled again
    assert forward.state == "compiled" and forward.eager_answers == 1
    assert len(caplog.records) == 1 and "ran eager" in caplog.records[0].getMessage()


def test_an_assertion_of_the_compiled_function_itself_is_not_swallowed() -> None:
    forward = CompiledForward(lambda x: x, name="test forward", enabled=True, warm_up=lambda run: None)
    assert forward.wait(60)

    def model_assertion(x: int) -> int:
        raise AssertionError("the model's own check")

    forward._active = model_assertion
    with pytest.raises(AssertionError, match="the model's own check"):
        forward(1)
    assert forward.eager_answers == 0


def test_a_stop_while_compiling_leaves_without_the_interpreters_teardown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The teardown under a compile thread in C++ aborted a cleanly stopped service (status -6)."""
    from streamtrain import cli

    exits: list[int] = []

    def record_exit(status: int) -> None:
        exits.append(status)

    monkeypatch.setattr(cli.os, "_exit", record_exit)
    assert not compiling() and cli.leave(0) == 0 and exits == []
    release = threading.Event()
    forward = CompiledForward(lambda x: x, name="slow forward", enabled=True, warm_up=lambda run: release.wait(60))
    try:
        assert compiling()
        cli.leave(1)
        assert exits == [1]
    finally:
        release.set()
        forward._thread.join(60)
    assert not compiling()


@pytest.mark.parametrize("serialize", [True, False])
def test_background_compiles_take_turns_where_they_must(serialize: bool) -> None:
    """With a process-wide FX tracing flag (torch 2.11), two overlapping compiles failed one of them."""
    inside: list[int] = []
    overlapped = threading.Event()
    both_started = threading.Barrier(2, timeout=0.5)

    def warm_up(_run: Any) -> None:
        inside.append(1)
        if len(inside) > 1:
            overlapped.set()
        try:
            both_started.wait()  # returns at once when both are inside; breaks when they take turns
        except threading.BrokenBarrierError:
            pass
        time.sleep(0.05)
        inside.pop()

    forwards = [
        CompiledForward(lambda x: x, name=f"forward {i}", enabled=True, warm_up=warm_up, serialize=serialize)
        for i in range(2)
    ]
    assert all(forward.wait(30) for forward in forwards)
    assert all(forward.state == "compiled" for forward in forwards)
    assert overlapped.is_set() is not serialize


def test_compiles_take_turns_by_default_only_where_torchs_fx_flag_is_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.fx._symbolic_trace as symbolic_trace

    forward = CompiledForward(lambda x: x, name="test forward", enabled=False, warm_up=lambda run: None)
    assert forward._serialize is not hasattr(symbolic_trace, "_is_fx_tracing_tls")
    monkeypatch.delattr(symbolic_trace, "_is_fx_tracing_tls", raising=False)
    assert CompiledForward(lambda x: x, name="test forward", enabled=False, warm_up=lambda run: None)._serialize


@pytest.mark.parametrize(
    ("device", "budget", "multiple"), [("cpu", 2048, 128), ("cpu", 8192, 512), ("cpu", 8, 1), ("cuda", 2048, 1)]
)
def test_token_rows_are_padded_on_a_cpu_to_a_sixteenth_of_the_budget(device: str, budget: int, multiple: int) -> None:
    assert training_row_multiple(torch.device(device), budget) == multiple


@pytest.mark.parametrize("amp", ["bf16", "off"])
def test_a_trainer_on_a_cpu_pads_its_token_rows_to_a_sixteenth_of_the_budget(amp: str) -> None:
    assert make_small_trainer(compile="off", amp=amp, token_budget=1024).forward.row_multiple == 64
