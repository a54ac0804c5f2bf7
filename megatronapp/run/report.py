"""What ``megatronapp run`` prints about a finished run (the CLI and the
torch backend's torchrun entry point print the same)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping


MAX_FAULT_LINES = 20  # the summary lists every fault; the terminal the first few
PROFILE_DIR = "profile"  # RUN_DIR/profile/rank{r}.pt.trace.json.gz with --profile


def print_summary(summary: Mapping[str, Any], out: Path) -> None:
    # loaded here: the command line imports this module before any command runs
    from ..program.features import feature_hooks
    from ..trace.summary_file import SUMMARY_FILE, summary_model

    run, hooks = summary_model(summary, out / SUMMARY_FILE), feature_hooks()
    # a feature's own head (MegaFBD: devices, roles, throughput), else the pipeline's
    headline = next((h for h in (f.headline(run) for f in hooks) if h is not None), None)
    print("\n".join(headline if headline is not None else pipeline_lines(summary)))
    for note in summary.get("adjustments", []):  # what Megatron would silently change
        print(f"  note: {note}")
    losses = summary.get("loss_per_iteration")
    if losses:  # a real run trains: say whether it learns
        print(loss_line(losses))
    for feature in hooks:
        for line in feature.lines(run, out):
            print(line)
    faults = summary["faults"] or [{"kind": "none"}]
    for f in faults[:MAX_FAULT_LINES]:
        detail = ", ".join(f"{k}={v}" for k, v in f.items() if k != "kind" and v is not None)
        print(f"  fault: {f['kind']}" + (f" ({detail})" if detail else ""))
    if len(faults) > MAX_FAULT_LINES:
        print(f"  ... and {len(faults) - MAX_FAULT_LINES} more faults (see summary.json)")
    stopped = summary.get("stopped")
    if stopped:  # a fail-stop fault ended the job: what it finished
        print(f"  stopped: rank {stopped['rank']} failed ({stopped['by']}) at "
              f"{stopped['at_s']:.6g} s, after {stopped['iterations_completed']} complete "
              "iterations")
    print("\n".join(written_lines(summary.get("trace", {}), out)))
    if (out / PROFILE_DIR).is_dir():
        print(f"  wrote {out / PROFILE_DIR}/ (torch.profiler traces, one per rank)")


LOSS_VALUES_SHOWN = 10  # more than this: first, last, min and a sparkline
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40


def loss_line(losses: list[float]) -> str:
    """Every loss of a short run; of a long one (1,500 steps) the first, the
    last, the lowest and a sparkline of the curve, on one line."""
    if len(losses) <= LOSS_VALUES_SHOWN:
        return "  loss per iteration (nats/token): " + " ".join(f"{x:.3f}" for x in losses)
    lowest = min(range(len(losses)), key=losses.__getitem__)
    return (f"  loss (nats/token) over {len(losses):,} iterations: first {losses[0]:.3f}, "
            f"last {losses[-1]:.3f}, lowest {losses[lowest]:.3f} at iteration {lowest} "
            f"{sparkline(losses)}")


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """The mean of each of ``width`` equal slices, as one block character each."""
    count = min(width, len(values))
    bins = [values[i * len(values) // count:(i + 1) * len(values) // count]
            for i in range(count)]
    means = [sum(b) / len(b) for b in bins]
    low, high = min(means), max(means)
    scale = (len(SPARK) - 1) / (high - low) if high > low else 0.0
    return "".join(SPARK[round((m - low) * scale)] for m in means)


def written_lines(trace: dict[str, Any], out: Path) -> list[str]:
    """Where the trace went, and how to look at a big one."""
    from ..trace.chrome import BROWSER_EVENTS

    stored = trace.get("stored_events")
    how = ("query it with megatronapp query or DuckDB" if stored is None else
           f"the {stored:,} of {trace.get('events', 0):,} that classes of identical ranks' "
           "representatives recorded; megatronapp query and export-trace see every rank")
    lines = [f"  wrote {out / 'trace.parquet'} ({trace.get('events', 0):,} events; {how}), "
             f"{out / 'summary.json'}"]
    if trace.get("trace_json"):
        lines.append(f"  wrote {out / 'trace.json'} (open in https://ui.perfetto.dev)")
    else:
        lines.append(f"  no trace.json: {trace.get('events', 0):,} events are more than a browser "
                     f"opens (limit {BROWSER_EVENTS:,}); export a selection with "
                     f"megatronapp export-trace {out} --ranks 0-63 --iterations 0")
    return lines


def pipeline_lines(summary: Mapping[str, Any]) -> list[str]:
    """The head of a pipeline run's summary: its shape and iteration times."""
    times = summary["iteration_times_s"]
    mean = sum(times) / len(times) if times else float("nan")
    sc = summary["scenario"]
    p = sc["parallel"]
    return [f"{sc['name']}: {summary['backend']} backend, {summary['world_size']} ranks "
            f"(tp {p['tp']}, pp {p['pp']}, dp {p['dp']}, vpp {p['vpp']}), schedule "
            f"{sc['schedule']}, {p['microbatches']} microbatches",
            f"  iterations: {len(times)}, mean {mean * 1e3:.3f} ms "
            f"(min {min(times) * 1e3:.3f}, max {max(times) * 1e3:.3f})",
            f"  bubble fraction: {summary['bubble_fraction']:.3f}"]
