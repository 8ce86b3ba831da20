"""The one synchronised wall-clock timer: on CUDA, kernels run asynchronously, so a section's time is the
GPU's only when the device is synchronised at both ends."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """(fn(), seconds it took on `device`)."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


class SectionTimer:
    """Wall seconds per named section, summed over calls: `timer("draft", fn, *args)` runs fn(*args)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    def __call__(self, section: str, fn: Callable[..., T], *args) -> T:
        out, seconds = timed(lambda: fn(*args), self.device)
        self.seconds[section] += seconds
        return out
