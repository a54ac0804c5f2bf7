"""Everything about a trace lives here: events and the tracer (events), event kinds, typed
columns, the Parquet store, Chrome and Perfetto exports, writing a run's traces (on_disk),
metrics and the summary computed from them, and the timeline plot."""

__all__ = ["chrome", "columns", "events", "kinds", "metrics", "on_disk", "perfetto", "store",
           "summary", "timeline"]
