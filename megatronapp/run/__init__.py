"""Everything that composes the features into `megatronapp run` lives here: the rank programs
a run executes with MegaDPP and MegaScope plugged in (jobs), writing the run (write) and what it
prints (report)."""

__all__ = ["jobs", "report", "write"]
