"""Everything about the machine a command runs on lives here: size limits checked before a
run (limits), worker pools (executors) and pausing the garbage collector (gc_pause)."""

__all__ = ["executors", "gc_pause", "limits"]
