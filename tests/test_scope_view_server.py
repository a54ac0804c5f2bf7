"""The view's server, for real: a ``scope serve`` process on a free port and a
real websocket client.

Another origin, a missing or wrong token: refused at the handshake. Oversized,
malformed, binary and out-of-bounds messages: refused and logged, and the
server keeps serving; so does a message nested 2,000 deep. A Python
expression is data. Perturbations are off
unless asked for. The default bind is 127.0.0.1. Bad input: exit 2, one line.
"""
from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection

from megatronapp.scope.view.protocol import MAX_FRAME_BYTES, decode_frame
from tests.support import run_cli
from tests.scope_view_support import ViewServer, client, run_dir  # noqa: F401 - a fixture

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def server(run_dir: Path) -> Iterator[ViewServer]:
    with ViewServer(run_dir / "gen") as srv:
        yield srv


def receive_json(ws: ClientConnection) -> dict[str, Any]:
    while True:
        msg = ws.recv(timeout=120)
        if isinstance(msg, str):
            return json.loads(msg)  # type: ignore[no-any-return]


def test_the_page_is_served_with_a_strict_policy(server: ViewServer) -> None:
    import urllib.request

    with urllib.request.urlopen(server.url, timeout=20) as r:
        assert r.status == 200 and b"MegaScope" in r.read()
        csp = r.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe" not in csp
    assert "frame-ancestors 'none'" in csp


@pytest.mark.parametrize("token, origin, why", [
    (None, "", "missing or wrong token"),
    ("not-the-token", "", "missing or wrong token"),
    ("", "http://evil.example", "origin"),
    ("", None, "origin"),
    ("", "http://127.0.0.1:1", "origin"),
])
def test_a_websocket_without_the_token_or_from_another_origin_is_refused(
        server: ViewServer, token: str | None, origin: str | None, why: str) -> None:
    before = len(server.log)
    with pytest.raises(InvalidStatus) as err:
        client(server, token, origin)
    assert err.value.response.status_code == 403
    assert server.logged(before, why)
    with client(server) as ok:  # the server goes on
        assert receive_json(ok)["kind"] == "info"


def test_bad_messages_are_refused_and_the_connection_goes_on(server: ViewServer) -> None:
    bad = ["{not json", json.dumps({"type": "eval", "code": "1"}), "x" * 5000,
           json.dumps({"type": "generate", "prompt": "a", "tokens": -1}),
           json.dumps({"type": "series", "site": "resid_post", "stat": "no-such"})]
    with client(server) as ws:
        assert receive_json(ws)["kind"] == "info"
        for text in bad:
            ws.send(text)
            reply = receive_json(ws)
            assert reply["kind"] == "refused", text
        ws.send(b"\x00\x01binary")
        assert "binary" in receive_json(ws)["reason"]
        ws.send(json.dumps({"type": "series", "site": "resid_post", "stat": "std"}))
        header, arrays = decode_frame(ws.recv(timeout=60))  # type: ignore[arg-type]
        assert header["kind"] == "series" and arrays["values"].shape[0] == len(header["layers"])
    assert sum("refused a message" in line for line in server.log) >= len(bad) + 1


def test_a_frame_over_the_limit_closes_that_connection_only(server: ViewServer) -> None:
    with client(server) as ws:
        receive_json(ws)
        ws.send("y" * (MAX_FRAME_BYTES + 1))
        with pytest.raises(ConnectionClosed) as err:
            receive_json(ws)
        assert err.value.rcvd is not None and err.value.rcvd.code == 1009  # message too big
    assert server.alive()
    with client(server) as ws:
        assert receive_json(ws)["kind"] == "info"


def test_a_python_expression_is_decoded_as_text_not_run(server: ViewServer,
                                                        tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    expression = f"__import__('os').system('touch {marker}')"
    with client(server) as ws:
        receive_json(ws)
        ws.send(json.dumps({"type": "generate", "prompt": expression, "tokens": 2}))
        header, _ = decode_frame(ws.recv(timeout=120))  # type: ignore[arg-type]
        assert "".join(header["window"]).endswith(expression[-len(header["window"]):])
        ws.send(json.dumps({"type": "series", "site": expression[:60], "stat": "mean"}))
        replies = [receive_json(ws) for _ in range(2)]
    assert {r["kind"] for r in replies} == {"done", "refused"}
    assert not marker.exists()


def test_perturbations_are_off_unless_the_server_allows_them(server: ViewServer) -> None:
    with client(server) as ws:
        info = receive_json(ws)
        assert info["allow_perturb"] is False
        ws.send(json.dumps({"type": "generate", "prompt": "a", "tokens": 1,
                            "perturb": {"kind": "act_noise", "sigma": 0.1}}))
        reply = receive_json(ws)
    assert reply["kind"] == "refused" and "--allow-perturb" in reply["reason"]


def test_live_generation_streams_one_frame_per_token(server: ViewServer) -> None:
    with client(server) as ws:
        info = receive_json(ws)
        ws.send(json.dumps({"type": "generate", "prompt": "def f", "tokens": 3, "top_k": 4}))
        frames = [decode_frame(ws.recv(timeout=120)) for _ in range(3)]  # type: ignore[arg-type]
        assert receive_json(ws) == {"kind": "done", "steps": 3, "stopped": False}
    layers, heads = info["live"]["layers"], info["live"]["heads"]
    for step, (header, arrays) in enumerate(frames):
        assert header["step"] == step and len(header["clean"]["topk"]) == 4
        tokens = len(header["window"])
        assert tokens == 5 + step
        assert arrays[f"clean/attention/layer{layers}"].shape == (heads, tokens, tokens)
        assert arrays["clean/pca/layer1"].shape == (tokens, 2)
        assert arrays["clean/stats/resid_post/std"].shape == (layers, tokens)
    assert [h["window"][-1] for h, _ in frames[1:]] == [h["clean"]["token"] for h, _ in frames[:-1]]


def test_the_default_bind_is_the_loopback_address(server: ViewServer) -> None:
    port = int(server.origin.rsplit(":", 1)[1])
    assert server.origin == f"http://127.0.0.1:{port}"
    listening = [line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if line.split()[3] == "0A"]  # state LISTEN
    assert f"0100007F:{port:04X}" in listening  # 127.0.0.1, little-endian hex
    assert f"00000000:{port:04X}" not in listening


def test_a_port_in_use_is_exit_2_one_line(run_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        r = run_cli("scope", "serve", str(run_dir / "gen"), "--port",
                    str(taken.getsockname()[1]))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "--port" in r.stderr and "in use" in r.stderr


def test_a_directory_that_is_not_a_capture_is_exit_2_one_line(run_dir: Path) -> None:
    for target in (run_dir / "checkpoint", run_dir / "missing"):
        r = run_cli("scope", "serve", str(target))
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.count("\n") == 1 and "CAPTURE_DIR_OR_RUN_DIR" in r.stderr


def test_another_host_name_is_refused(server: ViewServer) -> None:
    """A page on another name resolving to 127.0.0.1 (DNS rebinding) gets nothing."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(server.url, headers={"Host": "attacker.example"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=20)
    assert err.value.code == 400


def test_stop_ends_a_generation_early(server: ViewServer) -> None:
    with client(server) as ws:
        receive_json(ws)
        ws.send(json.dumps({"type": "generate", "prompt": "def", "tokens": 200}))
        decode_frame(ws.recv(timeout=120))  # type: ignore[arg-type]
        ws.send(json.dumps({"type": "stop"}))
        done = receive_json(ws)
    assert done["kind"] == "done" and done["stopped"] is True and done["steps"] < 200


def test_a_deeply_nested_message_is_refused_and_the_connection_goes_on(
        server: ViewServer) -> None:
    with client(server) as ws:
        receive_json(ws)
        ws.send("[" * 2000 + "]" * 2000)
        reply = receive_json(ws)
        assert reply["kind"] == "refused" and "recursion" in reply["reason"]
        ws.send(json.dumps({"type": "series", "site": "resid_post", "stat": "std"}))
        assert isinstance(ws.recv(timeout=60), bytes)


@pytest.mark.parametrize("option, value", [("--header-timeout", "0"), ("--header-timeout", "nan"),
                                           ("--header-timeout", "inf"),
                                           ("--max-connections", "0")])
def test_a_limit_out_of_range_is_exit_2_one_line(run_dir: Path, option: str, value: str) -> None:
    r = run_cli("scope", "serve", str(run_dir / "gen"), "--port", "0", option, value)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and option in r.stderr


def test_the_server_prints_no_third_party_warning(server: ViewServer) -> None:
    """stderr holds the view's own lines only (uvicorn's legacy websockets
    implementation warned of its deprecation on every start)."""
    with client(server) as ws:
        assert receive_json(ws)["kind"] == "info"  # started and answering
    assert not any("Warning" in line for line in server.log), server.log
