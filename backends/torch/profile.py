"""``--profile``: a torch.profiler (Kineto) trace per rank, beside our own.

A small hook around a rank's program: the profiler runs for the whole
program and every compute op is a ``record_function`` range named like the
op (forward, backward, optimizer), as a profiled Megatron-LM job would
annotate its work, and each iteration ends with ``prof.step()`` after its
optimizer op (``ProfilerStep#N`` ranges, as Megatron-LM's ``--profile``
writes them). Every thread is profiled: a slow link's sends leave from a
thread of their own (``interpreter.LateSend``). Communication shows as torch's own ``c10d::``/``gloo:``
(or NCCL) events. Each rank writes ``DIR/rank{r}.pt.trace.json.gz``.
"""
from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function

from megatronapp.parallel.ops import Compute, RankProgram

OPTIMIZER = "optimizer"  # the compute op that ends an iteration


def annotated(program: RankProgram, step: Callable[[], None]) -> RankProgram:
    """The same program, each compute op inside a range named after it and
    ``step`` called after each optimizer op (the end of an iteration)."""
    result = None
    while True:
        try:
            op = program.send(result)
        except StopIteration:
            return
        if isinstance(op, Compute):
            with record_function(op.name):
                result = yield op
            if op.name == OPTIMIZER:
                step()
        else:
            result = yield op


def _unchanged(program: RankProgram) -> RankProgram:
    return program


def _every_step(step: int) -> ProfilerAction:
    """Record every step (a schedule makes ``step()`` write its ranges)."""
    return ProfilerAction.RECORD


@contextmanager
def kineto_profile(out_dir: str | None, rank: int
                   ) -> Iterator[Callable[[RankProgram], RankProgram]]:
    """Profile the block when ``out_dir`` is set; yields the program wrapper."""
    if out_dir is None:
        yield _unchanged
        return
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities, schedule=_every_step,
                   experimental_config=_ExperimentalConfig(profile_all_threads=True))
    with kineto_markers_dropped():
        prof.start()
    try:
        yield lambda program: annotated(program, prof.step)
    finally:
        with kineto_markers_dropped():
            prof.stop()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(out_dir) / f"rank{rank}.pt.trace.json.gz"))


KINETO_MARKERS = (b"USDT:", b"STAGE:")


@contextmanager
def kineto_markers_dropped() -> Iterator[None]:
    """Kineto's C++ logger writes ``USDT: ... profiler_start`` (and ``STAGE:``)
    lines straight to file descriptor 2 when a profiler starts and stops, at a
    level no environment setting silences without silencing its errors too.
    Around those two calls only, stderr is caught and replayed without them."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True)
                    if not line.startswith(KINETO_MARKERS)]
            if kept:
                os.write(2, b"".join(kept))
