"""What a run will do, counted from the program it will actually run.

A backend that compiles its ranks' programs before running them (the
simulator) can say, before any work, how many events it will simulate (one
pipeline per class of identical ones) and how many rows it will store; the
limits check prices those counts rather than a closed-form guess.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunSize:
    ranks: int
    program_events: int  # events of one pipeline's compiled program (compiled once)
    simulated_events: int  # events the engine simulates: representatives only
    trace_events: int  # events of every rank, as readers see the trace
    stored_events: int  # rows written to the run directory's trace store
