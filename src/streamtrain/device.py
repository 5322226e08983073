"""Where the model computes: the DEVICE setting, bf16 autocast, and host-to-device copies that never block.

One module owns every CUDA detail, so the rest of the code asks three questions only:
which device (:func:`resolve_device`), which precision for a forward (:func:`autocast`),
and how a tensor gets there without making the host wait (:func:`to_device_async`,
:class:`Transfer`). On the CPU every helper is the plain operation (no stream, no pinning,
no autocast when AMP is off), so the CPU path computes exactly what it did before.

Why the care on a GPU: CUDA runs kernels asynchronously, so the host queues a training
step and goes on planning the next batch. Anything that waits for the GPU (a copy from
ordinary pageable memory, reading a value back) empties that queue and leaves the GPU idle
while the host catches up. Copies therefore go from pinned host memory with
``non_blocking=True``, batches travel on a side stream one batch ahead (:class:`Transfer`),
and predictions run on their own high-priority streams (:func:`inference_stream`) so a
request does not queue behind a training step's kernels.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Literal

import torch

Precision = Literal["bf16", "off"]

_SPEC = re.compile(r"^(auto|cpu|cuda(?::(\d+))?)$")


class DeviceError(ValueError):
    """The DEVICE setting cannot be used on this machine; ``str(error)`` is one line."""


def check_device_spec(spec: str) -> str:
    """``spec`` in canonical form (lower case, trimmed) if it reads auto, cpu, cuda or cuda:N."""
    canonical = str(spec).strip().lower()
    if not _SPEC.match(canonical):
        raise DeviceError(f"expected auto, cpu, cuda or cuda:N, got {spec!r}")
    return canonical


def resolve_device(
    spec: str,
    *,
    cuda_available: Callable[[], bool] = torch.cuda.is_available,
    cuda_count: Callable[[], int] = torch.cuda.device_count,
) -> torch.device:
    """The device ``spec`` names on this machine: ``auto`` is ``cuda:0`` when CUDA is available, else the CPU.

    ``cuda`` without a usable CUDA device, or ``cuda:N`` past the last one, raises
    :class:`DeviceError` naming the setting and the way out. (The two callables are there
    so tests can stand in for a machine with GPUs.)
    """
    canonical = check_device_spec(spec)
    if canonical == "cpu":
        return torch.device("cpu")
    if canonical == "auto":
        return torch.device("cuda", 0) if cuda_available() else torch.device("cpu")
    if not cuda_available():
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
        raise DeviceError(
            f"DEVICE={canonical} but no CUDA device is available (torch {torch.__version__}, {built}): "
            "set DEVICE=cpu, or auto to use a GPU only where there is one"
        )
    index = int(canonical.partition(":")[2] or 0)
    count = cuda_count()
    if index >= count:
        raise DeviceError(f"DEVICE={canonical} but this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def autocast(device: torch.device, amp: Precision) -> contextlib.AbstractContextManager[object]:
    """The precision context of a training forward: bf16 autocast, or nothing.

    Under bf16 autocast the matrix products run in bfloat16 while the weights, their
    gradients and the optimizer state stay float32 (autocast casts copies, per op), and
    reductions, norms and softmax stay float32 (autocast's own op lists). bfloat16 has
    float32's exponent range, so no loss scaling is needed.

    Autocast's cache of cast weights is off: it is one process-wide map behind a mutex that
    its clearing holds while it frees Python objects, so an eager step leaving autocast
    deadlocked with the background compile tracing under autocast (which held the GIL and
    waited for that mutex; docs/performance.md). The model uses each weight once per
    forward, so the cache had no cast to reuse within a step.
    """
    if amp == "off":
        return contextlib.nullcontext()
    if amp == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=False)
    raise ValueError(f"amp must be 'bf16' or 'off', got {amp!r}")


def fast_bf16_matmul(device: str | torch.device) -> bool:
    """Whether bf16 matmuls beat float32 ones here: on CUDA, and on a CPU with AMX tiles (the
    model's matmuls ran 4-8x faster in bf16 on one: docs/performance.md). Without AMX the
    CPU's bf16 kernels are no faster, and mixed precision only adds casts."""
    device = torch.device(device)
    if device.type == "cuda":
        return True
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return device.type == "cpu" and probe is not None and bool(probe())


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device`` without making the host wait for the GPU.

    To a GPU the copy goes from pinned memory (a pinned tensor as it is, otherwise a pinned
    copy: PyTorch's caching host allocator keeps that buffer until the copy has run) with
    ``non_blocking=True``, on the current stream; a copy from pageable memory would wait
    for every kernel queued before it. Anywhere else it is ``tensor.to(device)``.
    """
    if not is_cuda(device) or tensor.device == device:
        return tensor.to(device)
    if tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


class Transfer:
    """Named host tensors copied to ``device`` on ``stream``, ready when :meth:`wait` says so.

    The copy is queued at construction (``non_blocking`` from pinned memory, on the side
    stream, so it overlaps the kernels of the step that runs meanwhile on the compute
    stream) and an event marks its end. :meth:`wait` makes the *current* stream wait for
    that event (the host does not wait) and records the current stream on every copied
    tensor: the caching allocator then keeps their memory until the compute stream's use
    of it is done, although they were allocated on the side stream. Without a stream (the
    CPU, or a device that is not CUDA) the tensors are moved at once and :meth:`wait`
    returns them.
    """

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], device: torch.device, stream: torch.cuda.Stream | None = None
    ) -> None:
        self.device = device
        self._event: torch.cuda.Event | None = None
        if stream is None or not is_cuda(device):
            self._tensors = {name: to_device_async(t, device) for name, t in tensors.items()}
            return
        self._sources = tensors  # pinned host tensors stay referenced until the copy is waited for
        with torch.cuda.stream(stream):
            self._tensors = {name: to_device_async(t, device) for name, t in tensors.items()}
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def wait(self) -> dict[str, torch.Tensor]:
        """The copied tensors, safe to use on the current stream from now on."""
        if self._event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self._event)
            for tensor in self._tensors.values():
                tensor.record_stream(current)
            self._event = None
            self._sources = {}
        return self._tensors


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A stream of its own for copies to ``device`` (None off CUDA)."""
    return torch.cuda.Stream(device) if is_cuda(device) else None


_local = threading.local()


@contextlib.contextmanager
def inference_stream(device: torch.device) -> Iterator[None]:
    """Run the enclosed GPU work on this thread's own high-priority stream (nothing off CUDA).

    Predict forwards come from several worker threads while the trainer keeps the default
    stream full; on a stream of their own, with a higher priority, their kernels are
    scheduled ahead of the queued training kernels instead of behind them. The caller reads
    the results back to the host inside the block (which waits for this stream only).
    """
    if not is_cuda(device):
        yield
        return
    streams: dict[torch.device, torch.cuda.Stream] = getattr(_local, "streams", None) or {}
    _local.streams = streams
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device, priority=-1)
    with torch.cuda.stream(stream):
        yield


def settle(device: torch.device) -> None:
    """Wait until the work queued on ``device``'s current stream has run (nothing off CUDA).

    After a published copy of the model is made: predict streams read those weights
    without any ordering against the trainer's stream, so the copy must be complete first.
    """
    if is_cuda(device):
        torch.cuda.current_stream(device).synchronize()


def describe(device: torch.device) -> str:
    """One line for logs and benchmark tables: the device and what it is."""
    if is_cuda(device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return f"cuda:{index} ({props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__})"
    return f"cpu (torch {torch.__version__}, {torch.get_num_threads()} threads)"
