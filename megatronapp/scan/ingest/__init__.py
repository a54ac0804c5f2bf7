"""Reading traces: our Parquet store, Chrome JSON, torch.profiler (Kineto) folders, into event columns and sync ops."""
