"""`dgr bench soak` for 0.2 minutes: the report has its fields, no errors, every worker alive; real engine once."""

from __future__ import annotations

import argparse
import json

import pytest

from dgr.cli.commands import bench

FIELDS = {"engine", "stages", "sessions", "minutes", "seconds", "generations", "tokens", "tokens_per_s", "errors",
          "error_count", "recovered", "mismatched", "processes"}


def _soak(tmp_path, *extra) -> tuple[int, dict]:
    p = argparse.ArgumentParser(prog="dgr")
    bench.register(p.add_subparsers())
    out = tmp_path / "soak.json"
    args = p.parse_args(["bench", "soak", "--minutes", "0.2", "--json", str(out), *extra])
    rc = args.func(args)
    return rc, json.loads(out.read_text())


@pytest.mark.parametrize("engine", ["fake", "real"])
def test_soak_reports_fields_and_zero_errors(tmp_path, capsys, engine, request):
    if engine == "real":
        request.getfixturevalue("engine_lib")
    rc, rep = _soak(tmp_path, *(["--fake"] if engine == "fake" else ["--max-tokens", "16"]))
    table = capsys.readouterr().out
    assert FIELDS <= set(rep)
    assert rc == 0 and rep["errors"] == {} and rep["error_count"] == 0, rep["error_samples"]
    assert rep["stages"] == 3 and rep["sessions"] == 4 and rep["engine"] == ("fake" if engine == "fake" else "llama.cpp")
    assert rep["generations"] >= 4 and rep["tokens"] > 0 and isinstance(rep["mismatched"], int)
    if engine == "fake":
        # (the real engine's repeats under 4 concurrent sessions can differ: reported, see docs/reliability.md)
        assert rep["mismatched"] == 0, rep["mismatch_samples"]
    assert rep["rss_samples"] and all(len(s) == 1 + len(rep["processes"]) for s in rep["rss_samples"])
    names = [p["name"] for p in rep["processes"]]
    assert names == ["stage 0", "stage 1", "stage 2", "client"]
    for p in rep["processes"]:
        assert p["alive_at_end"] and p["rss_start_kib"] > 0 and p["rss_end_kib"] > 0 and p["hwm_end_kib"] > 0
        assert p["growth_kib"] == p["rss_end_kib"] - p["rss_start_kib"]
    assert "RSS start" in table and "stage 2" in table and "errors: 0" in table


def test_soak_with_hostile_members_leaves_honest_sessions_exact_and_workers_serving(tmp_path, capsys):
    """`--hostile 2`: two members attack the route in a loop (docs/security.md) beside four honest sessions
    under mutual TLS; every attack is refused, every honest repeat equals its undisturbed run, every new
    connection is answered, and every worker is alive at the end."""
    rc, rep = _soak(tmp_path, "--fake", "--hostile", "2")
    table = capsys.readouterr().out
    assert rep["hostile"] == 2 and rep["generations"] >= 4 and rep["mismatched"] == 0, rep["mismatch_samples"]
    assert rep["errors"] == {} and rep["breaches"] == 0, (rep["error_samples"], rep["attacks"])
    kinds = {k.split(":")[0] for k in rep["attacks"]}
    assert kinds == {"poison", "hog", "grammar", "scan", "forge", "flood"}, rep["attacks"]
    assert rep["attacks"].get("grammar: ENGINE", 0) >= 1 and rep["attacks"].get("scan: BAD_FRAME", 0) >= 1
    assert rep["probes"] > 0 and rep["probe_failures"] == 0
    assert all(p["alive_at_end"] for p in rep["processes"])
    assert rc == 0 and "hostile members 2" in table and "breaches 0" in table
