"""DEVICE and AMP: resolution, refusals, the GPU profile, the device stage, bf16 training, device-free checkpoints.

Every test here runs on the CPU; the ``cuda`` cases run on a GPU (``scripts/gpu-check.sh``)
and are skipped with a reason elsewhere. Where a GPU cannot be had, the CPU stands in:
the GPU profile's choice logic runs against a stand-in resolver, the one-ahead device
stage runs with ``ahead=True`` on the CPU, and bf16 autocast runs on the CPU.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import streamtrain.device as device_module
from device_params import CUDA, DEVICES, needs_cuda
from streamtrain.checkpoint.format import decode_checkpoint, encode_checkpoint
from streamtrain.config import GPU_PROFILE, SettingsError, load_settings
from streamtrain.data.collate import Batch, collate
from streamtrain.data.prefetch import DevicePrefetcher, Prefetcher, StagedBatch, pin_batch, stage_batch
from streamtrain.device import (
    DeviceError,
    Transfer,
    autocast,
    check_device_spec,
    inference_stream,
    resolve_device,
    to_device_async,
)
from streamtrain.metrics import Metrics
from streamtrain.model.inference import predict
from streamtrain.training.trainer import Trainer
from streamtrain.window.reservoir import RecencyWindow

torch.set_num_threads(1)

# amp is set so that the GPU profile (which turns bf16 on) leaves it as each test asks.
SMALL = dict(d_model=16, n_heads=2, n_layers=1, max_len=64, warmup_steps=1, publish_interval_s=1000.0, amp="off")


def sinusoids(rng: np.random.Generator, n: int, max_len: int = 64) -> list[np.ndarray]:
    """Noisy sinusoids around a level of 5 (a learnable signal), lengths 8..max_len."""
    out = []
    for _ in range(n):
        t = np.arange(int(rng.integers(8, max_len)))
        wave = 2 * np.sin(rng.uniform(0.2, 0.8) * t + rng.uniform(0, 6.3)) + 5 + 0.05 * rng.standard_normal(t.size)
        out.append(wave.astype(np.float32)[:, None])
    return out


def batches(count: int, size: int, seed: int) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [collate(sinusoids(rng, size), labels=rng.integers(0, 3, size)) for _ in range(count)]


def trainer_on(device: str, **overrides: Any) -> Trainer:
    settings = load_settings(**{**SMALL, "device": device, **overrides})
    return Trainer(settings, RecencyWindow(16, math.inf), Metrics())


# --------------------------------------------------------------------------- resolution
def test_device_specs_are_checked_and_resolved() -> None:
    assert check_device_spec(" CUDA:1 ") == "cuda:1"
    for bad in ("gpu", "cuda:", "cuda:-1", "cpu:0", "mps", ""):
        with pytest.raises(DeviceError, match="expected auto, cpu, cuda or cuda:N"):
            check_device_spec(bad)
    none, two = (lambda: False), (lambda: True)
    assert resolve_device("cpu", cuda_available=two, cuda_count=lambda: 2) == torch.device("cpu")
    assert resolve_device("auto", cuda_available=none, cuda_count=lambda: 0) == torch.device("cpu")
    assert resolve_device("auto", cuda_available=two, cuda_count=lambda: 2) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", cuda_available=two, cuda_count=lambda: 2) == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match=r"^DEVICE=cuda but no CUDA device is available .*set DEVICE=cpu"):
        resolve_device("cuda", cuda_available=none, cuda_count=lambda: 0)
    with pytest.raises(DeviceError, match=r"DEVICE=cuda:2 but this machine has 2 CUDA device\(s\)"):
        resolve_device("cuda:2", cuda_available=two, cuda_count=lambda: 2)


def test_bad_device_settings_are_one_line_naming_the_setting() -> None:
    with pytest.raises(SettingsError) as bad:
        load_settings(device="gpu")
    assert str(bad.value).startswith("invalid setting device (STREAMTRAIN_DEVICE)='gpu'") and "\n" not in str(bad.value)
    if not torch.cuda.is_available():
        with pytest.raises(SettingsError, match=r"^invalid setting device .*no CUDA device is available") as missing:
            load_settings(device="cuda")
        assert "\n" not in str(missing.value)
    with pytest.raises(SettingsError, match=r"^invalid setting amp .*'fp16'"):
        load_settings(amp="fp16")


def test_dp_mode_refuses_bf16_and_a_gpu_and_runs_auto_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMTRAIN_AMP", raising=False)  # AMP=auto, as deployed
    dp = dict(dp="on", shuffle="crypto")
    with pytest.raises(SettingsError, match=r"^invalid settings: amp=bf16 with dp=on: .*float32 or better.*AMP=off$"):
        load_settings(amp="bf16", **dp)
    monkeypatch.setattr(device_module, "resolve_device", _stand_in_gpu)  # settings import it when they validate
    with pytest.raises(SettingsError, match=r"^invalid settings: device=cuda:0 with dp=on: .*DEVICE=cpu or auto$"):
        load_settings(device="cuda", **dp)
    settings = load_settings(**dp)  # auto, on a machine with a GPU: DP stays on the CPU
    assert settings.device == "cpu" and settings.amp == "off" and settings.gpu_profile_applied == ()


@pytest.mark.parametrize(("amx", "dp", "expected"), [(True, False, "bf16"), (False, False, "off"), (True, True, "off")])
def test_amp_auto_is_bf16_on_a_cpu_with_amx_and_float32_elsewhere_and_with_dp(
    monkeypatch: pytest.MonkeyPatch, amx: bool, dp: bool, expected: str
) -> None:
    monkeypatch.delenv("STREAMTRAIN_AMP", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    settings = load_settings(device="cpu", **({"dp": "on", "shuffle": "crypto"} if dp else {}))
    assert settings.amp == expected and settings.precision == expected
    assert load_settings(device="cpu", amp="off").amp == "off"  # a value set by hand is kept


# --------------------------------------------------------------------------- the GPU profile
def _stand_in_gpu(spec: str) -> torch.device:
    """resolve_device on a machine with one GPU."""
    return resolve_device(spec, cuda_available=lambda: True, cuda_count=lambda: 1)


def test_on_the_cpu_the_defaults_stay() -> None:
    settings = load_settings(device="cpu")
    assert settings.device == "cpu" and settings.gpu_profile_applied == ()
    assert (settings.d_model, settings.n_layers, settings.token_budget, settings.amp) == (64, 2, 2048, "off")


def test_a_gpu_gets_the_profile_for_every_setting_not_set(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("STREAMTRAIN_AMP", raising=False)  # tests/conftest.py sets it; here AMP is not set
    monkeypatch.setattr(device_module, "resolve_device", _stand_in_gpu)  # settings import it when they validate
    settings = load_settings()
    assert settings.device == "cuda:0"
    assert settings.gpu_profile_applied == tuple(GPU_PROFILE)
    assert {name: getattr(settings, name) for name in GPU_PROFILE} == GPU_PROFILE
    assert settings.model_fields_set.isdisjoint(GPU_PROFILE)  # still "not set by the user"

    # Set by keyword, environment or TOML: the user's value wins, the rest comes from the profile.
    monkeypatch.setenv("STREAMTRAIN_TOKEN_BUDGET", "12000")
    toml = tmp_path / "s.toml"
    toml.write_text("amp = 'off'\n")
    settings = load_settings(toml, d_model=128)
    assert (settings.d_model, settings.n_heads, settings.token_budget, settings.amp) == (128, 8, 12000, "off")
    assert settings.n_layers == GPU_PROFILE["n_layers"]
    assert set(settings.gpu_profile_applied) == set(GPU_PROFILE) - {"d_model", "token_budget", "amp"}

    # A width the profile's heads do not divide keeps the CPU default heads instead of failing.
    monkeypatch.delenv("STREAMTRAIN_TOKEN_BUDGET")
    settings = load_settings(d_model=100)
    assert settings.n_heads == 4 and "n_heads" not in settings.gpu_profile_applied
    with pytest.raises(SettingsError, match="d_model .100. must be a multiple of n_heads .8."):
        load_settings(d_model=100, n_heads=8)


# --------------------------------------------------------------------------- autocast and transfers
def test_autocast_is_bf16_or_nothing() -> None:
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with autocast(torch.device("cpu"), "off"):
        assert linear(x).dtype == torch.float32
    with autocast(torch.device("cpu"), "bf16"):
        assert linear(x).dtype == torch.bfloat16
    assert linear.weight.dtype == torch.float32  # master weights untouched
    with pytest.raises(ValueError, match="amp must be"):
        autocast(torch.device("cpu"), "fp16")  # type: ignore[arg-type]


def test_bf16_autocast_keeps_no_cache_of_cast_weights() -> None:
    """The cache's mutex deadlocked an eager step against the background compile (device.py)."""
    with autocast(torch.device("cpu"), "bf16"):
        assert not torch.is_autocast_cache_enabled()
        with torch.autocast("cpu", enabled=False):  # the model's float32 islands inherit it
            assert not torch.is_autocast_cache_enabled()
    assert torch.is_autocast_cache_enabled()  # restored outside


def test_on_the_cpu_transfers_are_plain_and_inference_streams_are_nothing() -> None:
    t = torch.arange(6.0)
    assert to_device_async(t, torch.device("cpu")) is t
    moved = Transfer({"a": t}, torch.device("cpu"), None).wait()
    assert moved["a"] is t
    with inference_stream(torch.device("cpu")):
        assert torch.equal(t * 2, torch.arange(0.0, 12.0, 2.0))


class _Counting:
    """A batch source that records how many batches were taken from it."""

    def __init__(self, items: list[Batch], fail_at: int | None = None) -> None:
        self.items, self.fail_at, self.taken, self.closed = items, fail_at, 0, False

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.fail_at is not None and self.taken == self.fail_at:
            raise RuntimeError("source broke")
        if self.taken == len(self.items):
            raise StopIteration
        self.taken += 1
        return self.items[self.taken - 1]

    def close(self) -> None:
        self.closed = True


def test_the_device_stage_keeps_one_batch_ahead_in_order() -> None:
    items = batches(5, 4, seed=1)
    source = _Counting(items)
    stage = DevicePrefetcher(source, "cpu", ahead=True)
    delivered = []
    for expected_taken in (2, 3, 4, 5, 5):
        batch = next(stage)
        assert source.taken == expected_taken  # the next batch was staged before this one was handed over
        delivered.append(batch)
    with pytest.raises(StopIteration):
        next(stage)
    assert stage.items_delivered == 5 and stage.data_wait_seconds > 0
    for got, want in zip(delivered, items, strict=True):
        assert isinstance(got, StagedBatch)
        assert got.values is want.values and got.lengths is want.lengths  # the host side is the batch itself
        assert torch.equal(got.on_device.values, want.values) and torch.equal(got.on_device.mask, want.mask)
    stage.close()
    assert source.closed


def test_without_look_ahead_the_stage_takes_only_what_it_delivers() -> None:
    source = _Counting(batches(3, 4, seed=2))
    stage = DevicePrefetcher(source, "cpu")  # the CPU default: PREFETCH_DEPTH stays the only look-ahead
    assert stage.ahead is False
    next(stage)
    assert source.taken == 1


def test_a_source_error_while_staging_ahead_comes_after_the_batch_in_hand() -> None:
    items = batches(3, 4, seed=3)
    stage = DevicePrefetcher(_Counting(items, fail_at=2), "cpu", ahead=True)
    assert next(stage).values is items[0].values
    assert next(stage).values is items[1].values  # staged before the source broke: still delivered
    with pytest.raises(RuntimeError, match="source broke"):
        next(stage)
    with pytest.raises(StopIteration):
        next(stage)


def test_the_prefetcher_transforms_in_its_own_thread_and_closes_through_the_stage() -> None:
    threads: list[str] = []

    def note(batch: Batch) -> Batch:
        threads.append(threading.current_thread().name)
        return batch

    prefetcher = Prefetcher(iter(batches(4, 2, seed=4)), depth=1, name="bench-producer", transform=note)
    with DevicePrefetcher(prefetcher, "cpu", ahead=True) as stage:
        assert len(list(stage)) == 4
    assert threads == ["bench-producer"] * 4
    assert not prefetcher.alive


# --------------------------------------------------------------------------- training on a device
@pytest.mark.parametrize("device", DEVICES)
def test_the_trainer_lives_on_its_device_and_a_staged_step_equals_a_host_step(device: str) -> None:
    """A batch staged by the device pipeline trains exactly as the same host batch does.

    On the CPU bit for bit. On a GPU the first step too (same weights, same inputs, a
    deterministic forward); later steps to a tolerance, since CUDA's memory-efficient
    attention accumulates its backward with atomics (not bit-reproducible) and AdamW's
    normalized steps can enlarge such last-bit differences.
    """
    torch.manual_seed(0)
    host, staged = trainer_on(device), trainer_on(device)
    assert next(host.model.parameters()).device.type == device
    exact = device == "cpu"
    for index, batch in enumerate(batches(6, 8, seed=5)):
        a = host.train_step(batch)
        source = pin_batch(batch) if device == "cuda" else batch
        b = staged.train_step(stage_batch(source, host.device).ready())
        assert a.applied and b.applied and a.real_tokens == b.real_tokens
        assert a.loss == pytest.approx(b.loss, rel=1e-6 if exact or index == 0 else 1e-3)
    for p, q in zip(host.model.parameters(), staged.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, **({} if exact else {"rtol": 1e-2, "atol": 5e-3}))
    assert host.norm.mean.dtype == torch.float64 and host.norm.mean.device.type == "cpu"  # statistics stay on the host
    torch.testing.assert_close(host.norm.mean, staged.norm.mean, rtol=0, atol=0)  # the same host arithmetic
    published = host.publish()
    assert next(published.model.parameters()).device.type == device  # the frozen copy serves from the device
    answers = predict(published.model, published.norm, sinusoids(np.random.default_rng(6), 5), 512)
    assert all(np.isfinite(a.next).all() for a in answers)


def test_bf16_training_converges_as_float32_does() -> None:
    """Same seed, same 80 batches, same initial weights: bf16 autocast and float32 end at
    the same held-out loss within 5% (measured: 0.1%), and both far below the start.

    The tolerance is the claim the docs make: bf16 rounds each matrix product's inputs to
    8 significant bits, which perturbs every step a little but not where training goes.
    """
    data = batches(80, 16, seed=7)
    held_out = collate(sinusoids(np.random.default_rng(99), 256))
    seen_dtypes: set[torch.dtype] = set()
    results = {}
    for amp in ("off", "bf16"):
        trainer = trainer_on("cpu", d_model=32, n_heads=4, n_layers=2, amp=amp, warmup_steps=10, learning_rate=3e-3)
        hook = trainer.model.blocks[0].ff_in.register_forward_hook(lambda m, i, o: seen_dtypes.add(o.dtype))
        start = trainer.evaluate(held_out)
        losses = [trainer.train_step(batch).loss for batch in data]
        hook.remove()
        assert trainer.step == len(data)  # no step refused
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # float32 master weights
        trainer.settings = trainer.settings.model_copy(update={"amp": "off"})  # judge both in float32
        results[amp] = (start, trainer.evaluate(held_out), float(np.mean(losses[-10:])))
    assert seen_dtypes == {torch.float32, torch.bfloat16}  # autocast really ran the bf16 arm in bf16
    (start32, end32, tail32), (start16, end16, tail16) = results["off"], results["bf16"]
    assert start16 == start32  # the same initial model
    assert end32 < 0.2 * start32 and end16 < 0.2 * start16  # both learned
    assert end16 == pytest.approx(end32, rel=0.05)
    assert tail16 == pytest.approx(tail32, rel=0.05)


# --------------------------------------------------------------------------- checkpoints across devices
def _through_a_checkpoint_file(state: dict[str, Any]) -> dict[str, Any]:
    """The state as it comes back from a checkpoint's bytes (safetensors: host tensors)."""
    return decode_checkpoint(b"".join(encode_checkpoint(state, step=1, created_at=0.0))).state


ROUND_TRIPS = [
    pytest.param("cpu", "cpu", id="cpu-cpu"),
    pytest.param("cuda", "cpu", marks=needs_cuda, id="cuda-cpu"),
    pytest.param("cpu", "cuda", marks=needs_cuda, id="cpu-cuda"),
]


@pytest.mark.parametrize(("written_on", "loaded_on"), ROUND_TRIPS)
def test_a_checkpoint_loads_on_another_device_and_back_with_the_same_answers(written_on: str, loaded_on: str) -> None:
    train, more = batches(4, 8, seed=8), batches(2, 8, seed=9)
    items = sinusoids(np.random.default_rng(10), 12)
    writer = trainer_on(written_on)
    for batch in train:
        writer.train_step(batch)
    state = _through_a_checkpoint_file(writer.state_dict())
    assert all(t.device.type == "cpu" for t in state["model"].values())  # nothing in the file names a device

    reader = trainer_on(loaded_on)
    reader.load_state_dict(state)
    assert next(reader.model.parameters()).device.type == loaded_on
    want = predict(writer.model, writer.norm, items, 512)
    got = predict(reader.model, reader.norm, items, 512)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b.next, a.next, rtol=1e-5, atol=1e-5)
        assert b.anomaly_score == pytest.approx(a.anomaly_score, rel=1e-5, abs=1e-5)
    # The optimizer state came along: both continue alike (a fresh AdamW would move every
    # weight by about the learning rate at once). Across devices float32 kernels differ in
    # the last bits, which AdamW's normalized steps can enlarge: a looser tolerance there.
    for batch in more:
        writer.train_step(batch)
        reader.train_step(batch)
    tolerance = 1e-6 if written_on == loaded_on else 1e-2
    for a, b in zip(
        predict(writer.model, writer.norm, items, 512), predict(reader.model, reader.norm, items, 512), strict=True
    ):
        np.testing.assert_allclose(b.next, a.next, rtol=tolerance, atol=tolerance)
    back = trainer_on(written_on)
    back.load_state_dict(_through_a_checkpoint_file(reader.state_dict()))
    for q, r in zip(reader.model.parameters(), back.model.parameters(), strict=True):
        torch.testing.assert_close(r.cpu(), q.cpu(), rtol=0, atol=0)  # a copy, bit for bit
    assert back.optimizer.state_dict()["state"].keys() == reader.optimizer.state_dict()["state"].keys()


# --------------------------------------------------------------------------- GPU only
@pytest.mark.parametrize("device", [CUDA])
def test_on_a_gpu_batches_are_pinned_copied_on_a_side_stream_and_arrive_whole(device: str) -> None:
    items = [pin_batch(b) for b in batches(6, 16, seed=11)]
    assert all(b.values.is_pinned() for b in items)
    stage = DevicePrefetcher(iter(items), device)
    assert stage.ahead is True and stage._stream is not None
    for got, want in zip(stage, items, strict=True):
        assert got.on_device.values.device.type == "cuda" and got.lengths.device.type == "cpu"
        torch.testing.assert_close(got.on_device.values.cpu(), want.values, rtol=0, atol=0)
        torch.testing.assert_close(got.on_device.labels.cpu(), want.labels, rtol=0, atol=0)


@pytest.mark.parametrize("device", [CUDA])
def test_on_a_gpu_training_matches_the_cpu_and_bf16_learns(device: str) -> None:
    data = batches(30, 16, seed=12)
    held_out = collate(sinusoids(np.random.default_rng(13), 128))
    cpu, gpu, bf16 = trainer_on("cpu"), trainer_on(device), trainer_on(device, amp="bf16")
    start = cpu.evaluate(held_out)
    for batch in data:
        cpu.train_step(batch)
        gpu.train_step(batch)
        bf16.train_step(batch)
    assert gpu.evaluate(held_out) == pytest.approx(cpu.evaluate(held_out), rel=1e-2)
    assert bf16.evaluate(held_out) == pytest.approx(cpu.evaluate(held_out), rel=0.05)
    assert cpu.evaluate(held_out) < 0.5 * start


@pytest.mark.parametrize("amp", ["bf16", "off"])
@pytest.mark.parametrize("device", [CUDA])
def test_a_training_step_on_a_gpu_attends_without_cudnns_kernel(device: str, amp: str) -> None:
    """cuDNN's attention planned on the host for each new batch shape: 4 ms a call on an H200."""
    trainer = trainer_on(device, amp=amp)
    batch = batches(1, 8, seed=12)[0]
    trainer.train_step(batch)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.train_step(batch)
    ops = {event.key for event in prof.key_averages()}
    assert not [op for op in ops if "cudnn_attention" in op]
    assert [op for op in ops if "flash_attention" in op or "efficient_attention" in op]
