"""A real slow link between two ranks: the kernel holds back the bytes one
rank sends another.

The job runs in a network namespace of its own (nothing outside it is
touched, and it vanishes with the job) whose loopback carries Ethernet-sized
packets (MTU 1500, no segmentation offload beyond it) through an HTB
queueing discipline; each slowed channel (sender -> receiver) gets a class
whose rate is the link's bandwidth. Gloo connects every pair of ranks with TCP on
127.0.0.1, so addresses cannot tell pairs apart: once every process group is
connected, each rank lists its own TCP connections (its file descriptors,
then ``/proc/net/tcp``), and the sender's connections to the receiver are
filtered (u32, by port pair) into the channel's class. Everything the
sender sends the receiver, point-to-point or a collective's share, then
waits in that class; other pairs and the reverse direction are untouched.

Needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``) and ``tc``; the kernel
here has ``sch_htb`` but no ``sch_netem``, so a slow link is a narrow one,
not a long one (a fixed delay): with a burst of about one packet, a message
of B bytes arrives about B / rate after it is sent (measured here within
10% from 16 KiB to 256 KiB), as over an Ethernet link of that bandwidth.
Nothing here imports megatronapp or the launcher."""
from __future__ import annotations

import ctypes
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

CLONE_NEWNET = 0x40000000
ROOT_HANDLE = "1:"
MTU = "1500"
BURST = "2k"  # one packet: a message waits for its bytes beyond it


class ShapingUnavailable(RuntimeError):
    """The machine cannot shape a link (not root, no ``tc``, no HTB)."""


@dataclass(frozen=True)
class Connection:
    """One TCP connection as its owner sees it: its local and remote ports."""
    local_port: int
    remote_port: int


def enter_private_network() -> None:
    """Move this process (and the ranks it will fork) into a new network
    namespace with its loopback up, Ethernet-sized, and an HTB root on it."""
    if os.geteuid() != 0:
        raise ShapingUnavailable("a shaped link needs root (a network namespace of its own)")
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0:
        raise ShapingUnavailable(f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}")
    run_tc(["ip", "link", "set", "lo", "up", "mtu", MTU, "gso_max_size", MTU])
    run_tc(["tc", "qdisc", "add", "dev", "lo", "root", "handle", ROOT_HANDLE, "htb"])


def channel_class(index: int) -> str:
    """The HTB class id of the ``index``-th slowed channel."""
    return f"1:{10 + index}"


def add_channel_class(index: int, mbit: float) -> None:
    run_tc(["tc", "class", "add", "dev", "lo", *class_args(channel_class(index), mbit)])


def class_args(classid: str, mbit: float) -> list[str]:
    """``tc class`` arguments after the device: class ``classid`` at ``mbit``."""
    return ["parent", ROOT_HANDLE, "classid", classid, "htb", "rate", f"{mbit:g}mbit",
            "ceil", f"{mbit:g}mbit", "burst", BURST, "cburst", BURST]


def run_tc(command: list[str]) -> None:
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except FileNotFoundError as error:
        raise ShapingUnavailable(f"{command[0]} is not installed") from error
    except subprocess.CalledProcessError as error:
        raise ShapingUnavailable(f"{' '.join(command)}: {error.stderr.strip()}") from error


def own_connections(exclude_port: int) -> list[Connection]:
    """This process's established TCP connections over IPv4 loopback,
    without those that touch ``exclude_port`` (the rendezvous store's)."""
    inodes = own_socket_inodes()
    table = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return [c for c in established(table, inodes)
            if exclude_port not in (c.local_port, c.remote_port)]


def own_socket_inodes() -> set[str]:
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def established(table: Iterable[str], inodes: set[str]) -> list[Connection]:
    """The established connections among ``/proc/net/tcp`` rows that belong
    to the sockets ``inodes``."""
    connections = []
    for row in table:
        fields = row.split()
        local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
        if state == "01" and inode in inodes:  # 01: TCP_ESTABLISHED
            connections.append(Connection(int(local.split(":")[1], 16),
                                          int(remote.split(":")[1], 16)))
    return connections


def channel_ports(sender: list[Connection], receiver: list[Connection]) -> list[Connection]:
    """The sender's connections whose other end is one of the receiver's."""
    ends = {(c.remote_port, c.local_port) for c in receiver}
    return [c for c in sender if (c.local_port, c.remote_port) in ends]


def filter_into(classid: str, connections: Iterable[Connection]) -> int:
    """Send what goes out on ``connections`` through class ``classid``;
    how many connections that is."""
    count = 0
    for c in connections:
        run_tc(["tc", "filter", "add", "dev", "lo", "parent", ROOT_HANDLE, "protocol", "ip",
                "prio", "1", "u32", "match", "ip", "sport", str(c.local_port), "0xffff",
                "match", "ip", "dport", str(c.remote_port), "0xffff", "flowid", classid])
        count += 1
    return count


class RateSwitch:
    """Switches the shaped classes between their slow rate and an unshaped
    one, for an intermittent slow link: one ``tc -batch`` process reads the
    changes, so the rank that switches spends a pipe write, not a ``tc`` run."""

    def __init__(self, classids: list[str], slow_mbit: float, fast_mbit: float) -> None:
        self.classids, self.slow_mbit, self.fast_mbit = classids, slow_mbit, fast_mbit
        self.slow = True  # the classes start slow
        self.tc = subprocess.Popen(["tc", "-force", "-batch", "-"], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, text=True)

    def set(self, slow: bool) -> None:
        if slow == self.slow:
            return
        self.slow = slow
        mbit = self.slow_mbit if slow else self.fast_mbit
        assert self.tc.stdin is not None
        for classid in self.classids:
            self.tc.stdin.write(" ".join(["class", "change", "dev", "lo",
                                          *class_args(classid, mbit)]) + "\n")
        self.tc.stdin.flush()
