"""Helpers for the metrics and descriptor tests: scrape a worker's /metrics, read its descriptor, and
write certificates for a worker's identity (as `dgr certify` would)."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from dgr.app.local import LocalRoute
from dgr.core.descriptor import Descriptor

_METRICS = re.compile(r"metrics on (\S+)")


def metrics_urls(route: LocalRoute) -> list[str]:
    """The /metrics URL of each stage's first worker (from the line it prints before serving)."""
    out = []
    for log in route.logs:
        found = [m.group(1) for line in log if (m := _METRICS.search(line))]
        assert found, "the worker printed no metrics URL:\n" + "".join(log)
        out.append(found[-1])
    return out


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET url; every sample as {(name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    """One sample's value (0 when absent)."""
    return samples.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))), 0.0)


def describe_cli(address: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgr", "worker", "describe", address, *flags],
                          capture_output=True, text=True, timeout=60)


def descriptor(address: str) -> Descriptor:
    """`dgr worker describe ADDRESS --json`, validated by the model."""
    out = describe_cli(address, "--json")
    assert out.returncode == 0, out.stderr
    return Descriptor.model_validate_json(out.stdout)


def cert_identity(desc: Descriptor, **override) -> dict:
    """The certificate identity fields of the worker `desc` describes (some overridden)."""
    i = desc.identity
    return {**dict(model=i.model, bundle_id=i.bundle_id, lane=i.lane, upstream_commit=i.upstream_commit,
                   patch_series=i.patch_series, engine_blake3=i.engine_blake3), **override}


def write_certificate(path: Path, identity: dict, stages: list[tuple[int, int, int]], contract: Path, *,
                      passed: bool = True) -> str:
    """A certificate of `identity` (the fields of dgr.core.certificate.Identity but the contract hash) for
    `stages` [(stage, begin, end)], measured against `contract` as it is now; returns its id (digest)."""
    from dgr.core import certificate as cm
    h = cm.contract_hash(contract)
    cert = cm.Certificate(
        identity=cm.Identity(**identity, contract_blake3=h),
        contract=cm.ContractRef(path=str(contract), blake3=h, name="alpha"),
        hardware=cm.Hardware(cpu_model="test cpu", cores=2, memory_bytes=1 << 30, os="linux"),
        stages=tuple(cm.StageRange(stage=s, layer_begin=b, layer_end=e) for s, b, e in stages),
        figures=(cm.Figure(check="parity greedy tokens", figure=0, threshold="== 0", passed=passed),),
        passed=passed, created_at="2026-12-01T00:00:00Z")
    cert.save(path)
    return cert.digest
