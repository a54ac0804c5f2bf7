"""Interpreters of rank programs: ``sim`` (SimPy cluster) and ``torch`` (torch.distributed)."""
