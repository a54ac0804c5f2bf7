"""``megatronapp topology --fbd`` and ``megatronapp fbd-compare``."""
from __future__ import annotations

import json

from megatronapp.cli import main


def test_topology_fbd_json_places_every_worker_once(capsys):
    assert main(["topology", "--tp", "4", "--pp", "2", "--fbd", "--forward-tp", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    workers = [w for row in out["devices"] for w in row["workers"]]
    assert sorted(workers) == sorted([f"F{v}" for v in range(8)] + [f"B{v}" for v in range(8)])
    assert [len(r["workers"]) for r in out["devices"] if r["instance"] == "F"] == [2] * 4


def test_topology_fbd_bad_forward_tp_is_one_line_exit_2(capsys):
    assert main(["topology", "--tp", "2", "--fbd", "--forward-tp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--forward-tp" in err[0]


def test_fbd_compare_names_a_bad_field(capsys):
    assert main(["fbd-compare", "scenarios/fbd_hetero.yaml", "--set",
                 "fbd.backward_class=tpu"]) == 2
    assert "fbd.backward_class" in capsys.readouterr().err


def test_fbd_compare_prints_every_plan(capsys):
    assert main(["fbd-compare", "scenarios/fbd_hetero.yaml", "--set", "iterations=2"]) == 0
    out = capsys.readouterr().out
    assert "co-located, all devices" in out and "FBD F->slow B->fast" in out
