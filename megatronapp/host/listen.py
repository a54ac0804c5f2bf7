"""Everything about what this project listens on lives here: this machine
only (loopback), unless the user explicitly asks for more.

A server bound to a loopback address is reachable from this machine alone; any
other address (another interface's, ``0.0.0.0`` or ``::``, a host name other
than ``localhost``) needs an explicit opt-in, and is announced with a warning.
"""
from __future__ import annotations

import ipaddress
import socket

from ..errors import UserError

WILDCARDS = ("0.0.0.0", "::")  # every interface
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` leaves the socket reachable from this machine only."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_bind(host: str, allow_remote: bool, option: str = "--host",
               opt_in: str = "--allow-remote") -> None:
    """Refuse a non-loopback ``host`` unless ``allow_remote`` (one line naming
    the option and the opt-in)."""
    if not allow_remote and not is_loopback(host):
        raise UserError(f"{option}: {host} is reachable from other machines; bind 127.0.0.1 "
                        f"(the default), or pass {opt_in} to listen there on purpose")


def remote_warning(host: str, port: int) -> str:
    """What a server bound to a non-loopback address says on stderr."""
    where = "every interface" if host in WILDCARDS else host
    return (f"warning: listening on {where} (port {port}): anyone who can reach this machine "
            "and has the URL's token can use the view")


def host_names(host: str) -> list[str]:
    """The names a client may use to reach a server bound to ``host``: the
    address itself, and this machine's names when it is a wildcard."""
    if host not in WILDCARDS:
        return [host]
    names = [socket.gethostname(), socket.getfqdn()]
    return list(dict.fromkeys(n for n in names if n))
