"""MegaFBD on the command line: ``megatronapp topology --fbd`` and ``fbd-compare``."""
from __future__ import annotations

import argparse
import json
from typing import Any

from megatronapp.host import limits
from megatronapp.parallel.topology import Topology

from .ranks import FbdLayout, coordinated_groups


def build_layout(topo: Topology, forward_tp: int | None) -> FbdLayout:
    from megatronapp.errors import UserError

    degree = topo.tp if forward_tp is None else forward_tp
    if degree < 1 or topo.tp % degree:
        raise UserError(f"--forward-tp: {degree} must be >= 1 and divide --tp = {topo.tp}")
    return FbdLayout(topo, forward_tp=degree, backward_tp=topo.tp)


def print_layout(topo: Topology, forward_tp: int | None, as_json: bool) -> int:
    layout = build_layout(topo, forward_tp)
    groups = [list(g) for g in coordinated_groups(layout)]
    if as_json:
        print(json.dumps({"devices": layout.mapping_rows(), "coordinator_groups": groups}))
        return 0
    print(layout.format_mapping())
    print(f"coordinator groups: cross-device p2p pairs and DP groups (worker ids; F v = v, "
          f"B v = {layout.virtual_ranks} + v): {groups}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from backends.sim import compare_plans
    from megatronapp.scenario.config import load_scenario

    from .hetero import format_table

    scenario = load_scenario(args.scenario, args.set)
    plans = 4  # co-located twice, MegaFBD as configured and with classes swapped
    limits.enforce(args, limits.estimate_runs([scenario] * plans), what="comparing plans")
    print(format_table([(scenario.name, compare_plans(scenario))]))
    return 0


def register(subparsers: Any, plot_hooks: list) -> None:
    """Add this module's subcommands; ``plot_hooks`` gets extra plotters."""
    cmp = subparsers.add_parser(
        "fbd-compare", help="simulate MegaFBD against co-located Megatron on a scenario's cluster")
    cmp.add_argument("scenario", help="scenario YAML file with cluster.device_classes and fbd")
    cmp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a scenario key (repeatable)")
    limits.add_options(cmp)
    cmp.set_defaults(func=cmd_compare)
