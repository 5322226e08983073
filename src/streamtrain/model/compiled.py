"""torch.compile for the training and predict forwards, warmed up off the critical path, eager as the fallback.

A :class:`CompiledForward` runs ``fn`` eagerly until a background thread has compiled it
(``torch.compile(dynamic=True)``) on example inputs and, for training, run its backward
once, so neither the first training step nor the first prediction waits for the compiler
(tens of seconds on a small CPU). From then on every call takes the compiled code. When
compiling is off (``COMPILE=off``), unavailable (no C++ compiler for inductor, a torch
build without it) or fails, it stays eager and says so in one log line.

Graphs: the compiled code is shape-generic in the batch and length dimensions, so one
graph serves every batch the planner makes. PyTorch still specializes a dimension of size
0 or 1, and the forecast loss compares positions ``1:`` with ``:-1`` (``L - 1`` of them), so
inputs are padded to at least :data:`MIN_DYNAMIC_SIZE` rows and positions first (pad rows
have no real position, pad positions come after the real ones; the causal model computes
every real position as before) and the output cut back. ``graphs`` counts what
this process compiled; docs/performance.md has the measurements behind the choice.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch
import torch.nn.functional as F

from streamtrain.device import Precision, autocast
from streamtrain.model.network import ModelOutput, SensorModel

log = logging.getLogger(__name__)

R = TypeVar("R")

#: What a compiled call raises when compiling (not the model) fails.
COMPILER_ERRORS: tuple[type[BaseException], ...] = (
    torch._dynamo.exc.TorchDynamoException,
    torch._inductor.exc.InductorError,
)

#: How the background compile threads are named (:func:`compiling` finds them by it).
COMPILE_THREAD_PREFIX = "compile-"
#: Packages of torch whose own assertions are compiler failures, not the compiled function's.
COMPILER_PACKAGES = ("_dynamo", "_inductor")

#: Smallest batch and length a compiled forward sees: sizes 0 and 1 get graphs of their own, and
#: so does a length of 2 (its ``L - 1`` is 1): a recompile on the first such batch, seconds on
#: a small CPU with the interpreter held (predict p99 in bench/soak.py --realistic).
MIN_DYNAMIC_SIZE = 3


def _fx_tracing_flag_is_per_thread() -> bool:
    """Whether this torch keeps FX's "tracing now" flag per thread (2.15 does; 2.11, as on the GPU
    machine's image, keeps one for the process, so a compile seen mid-trace by another thread's
    compile fails with "using FX to symbolically trace a dynamo-optimized function")."""
    import torch.fx._symbolic_trace as symbolic_trace

    return hasattr(symbolic_trace, "_is_fx_tracing_tls")


#: Held by a background compile where compiles must not overlap (see :func:`_fx_tracing_flag_is_per_thread`).
_ONE_COMPILE_AT_A_TIME = threading.Lock()


def pad_rows_and_positions(
    values: torch.Tensor, mask: torch.Tensor, minimum: int = MIN_DYNAMIC_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """``values [B, L, ...]`` and ``mask [B, L]`` (or lengths ``[B]``) padded to at least ``minimum``
    rows and positions; pad rows and positions are zero (not real)."""
    rows = max(0, minimum - values.shape[0])
    positions = max(0, minimum - values.shape[1])
    if not rows and not positions:
        return values, mask
    trailing = [0, 0] * (values.dim() - 2)
    values = F.pad(values, [*trailing, 0, positions, 0, rows])
    mask = F.pad(mask, [0, positions, 0, rows] if mask.dim() == 2 else [0, rows])
    return values, mask


def cut_output(output: ModelOutput, batch: int, length: int) -> ModelOutput:
    """``output`` of a padded forward, back to the first ``batch`` rows and ``length`` positions."""
    logits = output.logits
    return ModelOutput(output.forecast[:batch, :length], None if logits is None else logits[:batch])


class CompiledForward(Generic[R]):
    """``fn`` compiled in the background (see the module docstring); eager until then, or for good
    when compiling is off or fails.

    ``warm_up(run)`` calls ``run`` (the compiled function) on example inputs exactly as the
    real callers will (same grad mode, training flag and dtypes: the compiled code is
    guarded on them), and runs the backward when the callers will. ``enabled=False``
    never compiles. ``serialize`` (default: where this torch needs it) makes background
    compiles of the process take turns.
    """

    def __init__(
        self,
        fn: Callable[..., R],
        *,
        name: str,
        enabled: bool,
        warm_up: Callable[[Callable[..., R]], None],
        niceness: int = 0,
        serialize: bool | None = None,
    ) -> None:
        self.name = name
        # the training and predict forwards compile on threads of their own; with a process-wide
        # FX flag they take turns (the one that waits stays eager meanwhile)
        self._serialize = not _fx_tracing_flag_is_per_thread() if serialize is None else serialize
        self._eager = fn
        self._active: Callable[..., R] = fn
        self._warm_up = warm_up
        self._niceness = niceness
        self.state = "off"  # off | warming | compiled | failed
        self.compile_seconds: float | None = None
        self.eager_answers = 0  # calls answered eagerly after a compiler assertion (the graphs kept)
        self._done = threading.Event()
        if not enabled:
            self._done.set()
            return
        self.state = "warming"
        self._thread = threading.Thread(target=self._compile, name=f"{COMPILE_THREAD_PREFIX}{name}", daemon=True)
        self._thread.start()

    def __call__(self, *args: Any) -> R:
        active = self._active
        if active is self._eager:
            return active(*args)
        try:
            return active(*args)
        except COMPILER_ERRORS as err:  # a recompile for inputs unlike the warm-up's failed
            self._fail(err)
            return self._eager(*args)
        except AssertionError as err:
            if not _raised_in_the_compiler(err):
                raise
            # dynamo's own consistency check failed while recompiling (seen once in a soak:
            # "Guard failed on the same frame it was created"): this call answers eagerly and
            # the graphs made so far serve on
            self.eager_answers += 1
            log.warning("torch.compile of the %s: recompiling failed, this call ran eager: %s", self.name, err)
            return self._eager(*args)

    def _fail(self, err: BaseException) -> None:
        self._active = self._eager
        self.state = "failed"
        log.warning("torch.compile of the %s failed, running eager: %s: %s", self.name, type(err).__name__, err)

    @property
    def compiled(self) -> bool:
        return self.state == "compiled"

    def wait(self, timeout: float | None = None) -> bool:
        """Block until compiling has finished (or was never started); False on timeout."""
        return self._done.wait(timeout)

    def _compile(self) -> None:
        from streamtrain.training.publishing import lower_thread_priority  # the training threads' niceness

        lower_thread_priority(self._niceness)
        started = time.perf_counter()
        try:
            with _ONE_COMPILE_AT_A_TIME if self._serialize else contextlib.nullcontext():
                compiled = torch.compile(self._eager, dynamic=True)
                self._warm_up(compiled)
        except Exception as err:  # noqa: BLE001 - any compiler failure: say it once, stay eager
            self._fail(err)
        else:
            self.compile_seconds = time.perf_counter() - started
            self._active = compiled
            self.state = "compiled"
            log.info("%s compiled in %.1f s (torch.compile, dynamic shapes)", self.name, self.compile_seconds)
        finally:
            self._done.set()


def _raised_in_the_compiler(err: BaseException) -> bool:
    """Whether ``err`` was raised by torch's compiler stack rather than by the function compiled."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and any(f"torch{os.sep}{part}{os.sep}" in frames[-1].filename for part in COMPILER_PACKAGES)


def compiling() -> bool:
    """Whether a :class:`CompiledForward` of this process is still compiling in the background."""
    return any(thread.name.startswith(COMPILE_THREAD_PREFIX) and thread.is_alive() for thread in threading.enumerate())


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (every compiled function together)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ----------------------------------------------------------------------------------------
# the training forward


def training_forward(
    model: SensorModel, x_norm: torch.Tensor, mask: torch.Tensor, amp: Precision, row_multiple: int = 1
) -> ModelOutput:
    """The training step's forward: ``model`` under ``AMP``'s autocast (its token rows padded to a
    multiple of ``row_multiple``: :func:`training_row_multiple`), the output in ``x_norm``'s dtype
    (the weights'; the same tensors when AMP is off)."""
    with autocast(x_norm.device, amp):
        output = model(x_norm, mask, row_multiple=row_multiple)
    logits = output.logits
    dtype = x_norm.dtype
    return ModelOutput(output.forecast.to(dtype), None if logits is None else logits.to(dtype))


def training_row_multiple(device: torch.device, token_budget: int) -> int:
    """What the training forward pads its token rows to a multiple of: on a CPU a sixteenth of
    the token budget (at most 1/16 more rows, 16 row counts up to a full batch), where the
    matmul kernels are built and cached per row count (bf16 and float32 alike ran faster
    padded: docs/performance.md, "One matmul kernel per row count"); 1 on a GPU, where that
    was not measured."""
    if device.type == "cpu":
        return max(1, token_budget // 16)
    return 1


#: (rows, positions) of the warm-up batches: a tiny one and one of a realistic size. Inductor
#: still makes a few choices by size (a short reduction or a long one) and guards them, so a
#: forward may have a graph for tiny batches and one for the rest; both are made at warm-up.
WARM_UP_SIZES = ((3, 5), (97, 61))


def example_batches(channels: int, max_len: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Warm-up batches ``(values, mask)`` of :data:`WARM_UP_SIZES` (positions at most ``max_len``),
    rows full, shorter and of one reading. No size equals another or ``channels``: equal sizes
    are compiled as one symbol (and recompiled once they differ)."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for rows, positions in WARM_UP_SIZES:
        positions = min(positions, max_len)
        while positions in (rows, channels) and positions > MIN_DYNAMIC_SIZE:
            positions -= 1
        while rows in (positions, channels):
            rows += 1
        lengths = torch.tensor([positions] + [max(1, positions - 2 * i) for i in range(1, rows)])
        mask = torch.arange(positions)[None, :] < lengths[:, None]
        values = torch.randn(rows, positions, channels, generator=generator) * mask[..., None]
        batches.append((values.to(device), mask.to(device)))
    return batches


class ModelForward:
    """``forward(model, x_norm, mask) -> ModelOutput`` of the training step: compiled (once
    warmed up) unless ``enabled`` is False; inputs padded as the module docstring says."""

    def __init__(
        self, template: SensorModel, amp: Precision, *, enabled: bool, niceness: int = 0, row_multiple: int = 1
    ) -> None:
        self.amp: Precision = amp
        self.row_multiple = row_multiple
        eager = functools.partial(training_forward, amp=amp, row_multiple=row_multiple)
        template = copy.deepcopy(template)  # the warm-up trains a copy: the live model is left alone

        def warm_up(run: Callable[..., ModelOutput]) -> None:
            model = template.train()
            for values, mask in example_batches(model.channels, model.max_len, next(model.parameters()).device):
                output = run(model, values, mask)
                loss = output.forecast.square().mean()
                if output.logits is not None:
                    loss = loss + output.logits.square().mean()
                loss.backward()  # compiles the backward graph too

        self.compiled = CompiledForward(
            eager, name="training forward", enabled=enabled, warm_up=warm_up, niceness=niceness
        )

    def __call__(self, model: SensorModel, x_norm: torch.Tensor, mask: torch.Tensor) -> ModelOutput:
        if not self.compiled.compiled:
            return self.compiled(model, x_norm, mask)
        batch, length = mask.shape
        padded_x, padded_mask = pad_rows_and_positions(x_norm, mask)
        if padded_x is x_norm:
            return self.compiled(model, x_norm, mask)
        return cut_output(self.compiled(model, padded_x, padded_mask), batch, length)
