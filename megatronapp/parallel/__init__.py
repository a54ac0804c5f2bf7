"""Everything about the shape of a parallel job lives here: the rank grid (topology),
pipeline schedules, and the operations a rank performs (ops)."""

__all__ = ["ops", "schedules", "topology"]
