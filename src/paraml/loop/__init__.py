"""The one training loop: epochs and callbacks, the step inside a replica, inputs as global batches, compiling,
checkpoints and preemption. It reads a backend through its contract and imports no technique."""

__all__: list[str] = []
