"""Plans as values and the planners that make them: sizes, a model's observed layers, stage partitions, pipeline
schedules, optimizer state, and the one parallel plan every technique reads."""

__all__: list[str] = []
