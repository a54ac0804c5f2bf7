"""On a CUDA GPU: a one-rank job profiled as docs/diagnose-your-job.md says
is read back with its kernels (skipped where no GPU is)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatronapp.scan.ingest.kineto import kineto_files, load_kineto

from .support import run_cli


@pytest.mark.gpu
def test_a_one_rank_cuda_job_profiled_as_the_howto_says_is_read_back_with_its_kernels(
        tmp_path: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 1024)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=1, warmup=1, active=3),
                 on_trace_ready=tensorboard_trace_handler(str(tmp_path))) as prof:
        for _ in range(5):
            loss = model(torch.randn(256, 1024, device="cuda")).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    torch.cuda.synchronize()
    files = kineto_files(tmp_path)
    assert len(files) == 1
    raw = json.loads(files[0].read_text())
    kernels = [e for e in raw["traceEvents"] if e.get("cat") == "kernel"]
    assert kernels  # the profiler recorded the GPU's side
    job = load_kineto(files)
    ((rank, events),) = job.events.items()
    assert any(e.args.get("cat") == "kernel" for e in events)  # read back as the GPU ran them
    done = run_cli("analyze", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    (t,) = json.loads(done.stdout)["ranks"].values()
    assert t["compute_s"] > 0 and 0 <= t["idle_s"] <= t["gpu"]["window_s"]
