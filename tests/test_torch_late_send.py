"""A slow link's send, as the torch backend's profile shows it: the program's
send call when it posted the send, the transfer's work from when the
message leaves on the link's own thread (no processes: the post is stubbed)."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.profiler import record_function  # noqa: E402

from backends.torch.interpreter import SEND_CALL, LateSend  # noqa: E402
from backends.torch.profile import kineto_profile  # noqa: E402
from megatronapp.scan.ingest.kineto import read_json_any  # noqa: E402

WORK = "gloo:send"


class Sent:
    """A posted transfer that is already done."""

    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True


def test_a_late_send_is_called_on_the_program_thread_and_leaves_from_the_link(tmp_path: Path):
    released = threading.Event()

    def post() -> Sent:  # gloo makes its work when the link hands it the message
        released.wait()
        with record_function(WORK):
            return Sent()

    link = ThreadPoolExecutor(1)
    with kineto_profile(str(tmp_path), rank=0):
        send = LateSend(post, 0.0, link)
        released.set()  # the message leaves only once the program has gone on
        send.wait()
    link.shutdown()
    events: list[dict[str, Any]] = read_json_any(tmp_path / "rank0.pt.trace.json.gz")["traceEvents"]
    (call,) = [e for e in events if e.get("name") == SEND_CALL]
    (work,) = [e for e in events if e.get("name") == WORK]
    assert call["tid"] == threading.get_native_id() != work["tid"]
    assert call["ts"] + call["dur"] <= work["ts"]
