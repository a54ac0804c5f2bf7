"""Faults a training job suffers, each kind one module behind one protocol
(``protocol.FaultSpec``): its scenario schema, its effects (data the simulator
and the torch backend interpret alike), its ground truth and what MegaScan
should name, how the closed loop moves it, its cost. Adding a kind is adding
a module and registering it here; nothing else dispatches on a fault's kind.
"""
from __future__ import annotations

from .clock_skew import ClockSkew
from .combined import (JobEffects, LinkEffect, check_faults, effects_of, ground_truth,
                       skewed_ranks)
from .crash import Crash
from .device_variation import DeviceVariation
from .effects import HostDelay, HostStalls, Outage, Speed, Window
from .host_stall import HostStall
from .link_flap import LinkFlap
from .link_jitter import LinkJitter
from .peers import exchange_error, layout_text, peers_of
from .protocol import Activity, Effects, FaultCost, FaultSpec, Job, LinkFault, RankFault, Truth
from .registry import KINDS, kind_names, parse_fault, parse_faults, register, registered
from .slow_link import SlowLink
from .throttle import Throttle

for _kind in (Throttle, SlowLink, LinkJitter, ClockSkew, HostStall, LinkFlap, Crash,
              DeviceVariation):
    register(_kind)

__all__ = ["KINDS", "Activity", "ClockSkew", "Crash", "DeviceVariation", "Effects", "FaultCost",
           "FaultSpec", "HostDelay", "HostStall", "HostStalls", "Job", "JobEffects",
           "LinkEffect", "LinkFault", "LinkFlap", "LinkJitter", "Outage", "RankFault",
           "SlowLink", "Speed", "Throttle", "Truth", "Window", "check_faults", "effects_of",
           "exchange_error", "ground_truth", "kind_names", "layout_text", "parse_fault",
           "parse_faults", "peers_of", "register", "registered", "skewed_ranks"]
