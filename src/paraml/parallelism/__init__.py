"""The techniques, each applied to a model from the plan: tensor splits, sharded optimizer state, recompute."""

__all__: list[str] = []
