"""Optional glue for training frameworks; each module imports its framework lazily."""

__all__: list[str] = []
