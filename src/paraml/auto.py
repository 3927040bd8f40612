"""``Parallel("auto")``: the rule that picks a strategy, with the numbers behind the choice.

The rule, in order:

1. ``TF_CONFIG`` describes a cluster of more than one worker -> ``multi_worker``;
2. more than one device, and the estimated training memory fits on one device -> ``mirrored``;
3. more than one device (the model does not fit on one) -> ``model_parallel`` with a balanced partition;
4. otherwise -> ``single``.

Device memory comes from TensorFlow where it can tell (GPUs), else from the ``device_memory`` option
(``"2GiB"``, ``"512MB"`` or bytes). Unknown memory counts as "fits": data parallelism is the faster default.
"""

from __future__ import annotations

from dataclasses import dataclass

from .memory import MemoryEstimate
from .sizes import format_bytes

__all__ = ["AutoDecision", "decide"]


@dataclass(frozen=True)
class AutoDecision:
    """What ``auto`` chose and why: :meth:`explain` says it in words, with the numbers."""

    strategy: str
    num_workers: int
    num_devices: int
    estimate: MemoryEstimate | None
    device_memory: int | None

    def explain(self) -> str:
        """Why this strategy, with the numbers that decided it."""
        if self.strategy == "multi_worker":
            return f"chose 'multi_worker': TF_CONFIG describes a cluster of {self.num_workers} workers"
        if self.num_devices <= 1:
            return "chose 'single': one device is available"
        need = f"estimated training memory {format_bytes(self.estimate.total)}" if self.estimate else "memory unknown"
        if self.estimate is not None:
            e = self.estimate
            parts = [("parameters", e.parameters), ("gradients", e.gradients), ("optimizer slots", e.optimizer_slots)]
            parts.append((f"activations for batch {e.batch_size}", e.activations))
            need += " (" + ", ".join(f"{name} {format_bytes(size)}" for name, size in parts) + ")"
        have = (
            f"device memory {format_bytes(self.device_memory)}"
            if self.device_memory is not None
            else "device memory unknown (pass device_memory='16GiB' to decide by it)"
        )
        if self.strategy == "mirrored":
            return f"chose 'mirrored' on {self.num_devices} devices: the model fits on one device: {need}; {have}"
        return (
            f"chose 'model_parallel' on {self.num_devices} devices: the model does not fit on one device: "
            f"{need} > {have}"
        )


def decide(
    *, num_workers: int, num_devices: int, estimate: MemoryEstimate | None, device_memory: int | None
) -> AutoDecision:
    """Apply the rule of this module (pure: no TensorFlow, so each branch is testable on its own)."""
    if num_workers > 1:
        strategy = "multi_worker"
    elif num_devices <= 1:
        strategy = "single"
    elif estimate is None or device_memory is None or estimate.total <= device_memory:
        strategy = "mirrored"
    else:
        strategy = "model_parallel"
    return AutoDecision(strategy, num_workers, num_devices, estimate, device_memory)
