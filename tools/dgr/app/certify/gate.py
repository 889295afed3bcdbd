"""`dgr gate alpha` and `dgr gate beta`: certify every target of the contract's [gate] and print one table.

First the MTP refusal (alpha: an MTP-on recipe must be refused before anything runs), then each committed
recipe (real weights: parity and the speed gate), then each synthetic target (parity and MTP off; the
10+ stage scenario among them), then the long-context lane when the contract has one
(dgr.app.certify.long_context). A contract with an `[mtp]` section (beta) then certifies its MTP targets
with MTP on and the speculation rows (dgr.app.certify.beta). Each certificate is written to the output
folder; the gate passes only when every row of every target passes. A target that cannot be certified at
all is one failed row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dgr.app.certify import fixtures
from dgr.app.certify.beta import certify_mtp, certify_speculation
from dgr.app.certify.contract import LoadedContract, load_contract
from dgr.app.certify.long_context import long_context_figures
from dgr.app.certify.runner import certify, engine_library
from dgr.app.certify.verdict import INCONCLUSIVE, INCONCLUSIVE_RUN, is_inconclusive, mark, overall
from dgr.core.certificate import Certificate, Figure
from dgr.core.errors import DgrError
from dgr.core.log import get_logger
from dgr.runtime.engine_abi import build_numerics

log = get_logger(__name__)

SCENARIO_MIN_STAGES = 10
LONG_CONTEXT = "long-context"            # the long-context lane's rows


@dataclass
class Row:
    target: str
    figure: Figure


@dataclass
class GateResult:
    contract: LoadedContract
    rows: list[Row] = field(default_factory=list)
    certificates: dict[str, Path] = field(default_factory=dict)
    numerics: str = ""           # the engine library's (docs/numerics.md): every certificate names it with its switches

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.figure.passed for r in self.rows)

    @property
    def verdict(self) -> str:
        """passed, failed, or inconclusive (no row failed, a speed row could not decide: dgr.app.certify.verdict)."""
        return overall(r.figure for r in self.rows)

    def table(self) -> str:
        return format_table(self.rows, f"dgr gate {self.contract.contract.name} "
                            f"(contract {self.contract.ref_path}, blake3 {self.contract.blake3[:16]}; "
                            f"numerics {self.numerics or 'unknown'})")


def _fmt(v) -> str:
    if isinstance(v, float):
        return "0" if v == 0 else f"{v:.3g}"
    return str(v)


def format_table(rows: list[Row], title: str = "") -> str:
    """One line per row: check (target: what), figure, threshold, pass (yes, NO or inconclusive); then the
    verdict: PASSED, FAILED, or INCONCLUSIVE when no row failed but a speed row could not decide."""
    cells = [("check", "figure", "threshold", "pass")]
    cells += [(f"{r.target}: {r.figure.check}", _fmt(r.figure.figure), r.figure.threshold, mark(r.figure))
              for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [title] if title else []
    for k, c in enumerate(cells):
        lines.append("  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    ok = sum(r.figure.passed for r in rows)
    busy = sum(is_inconclusive(r.figure) for r in rows)
    v = overall(r.figure for r in rows)
    lines.append(f"{ok}/{len(rows)} rows pass" + (f", {busy} inconclusive" if busy else "") + f": {v.upper()}" +
                 (f" ({INCONCLUSIVE}: not a pass; rerun on a quieter machine)" if v == INCONCLUSIVE_RUN else ""))
    return "\n".join(lines)


def _add(res: GateResult, name: str, cert: Certificate, out_dir: Path) -> None:
    for f in cert.figures:
        res.rows.append(Row(name, f))
    path = cert.save(out_dir / f"{name}.json")
    res.certificates[name] = path


def run_gate(contract: str | Path | None = None, *, out_dir: str | Path | None = None, lane: str | None = None,
             lib: str | Path | None = None, root: Path | None = None) -> GateResult:
    """Run the gate of `contract` (default certification/alpha.toml); certificates go to `out_dir`
    (default: the workspace's certificates/<contract name>/)."""
    lc = load_contract(contract)
    c = lc.contract
    lane = lane or c.lane
    out = Path(out_dir) if out_dir else fixtures.certify_root().parent / "certificates" / c.name
    res = GateResult(contract=lc)
    by_name = {s.name: s for s in c.gate.synthetic}

    # 1. The MTP refusal, before anything is built or run.
    if c.gate.mtp_refusal is not None:
        spec = by_name.get(c.gate.mtp_refusal.synthetic)
        if spec is None:
            raise DgrError(f"{lc.path}: gate.mtp_refusal names {c.gate.mtp_refusal.synthetic!r}, "
                           f"not one of gate.synthetic {sorted(by_name)}")
        res.rows.append(Row(spec.name, fixtures.mtp_refusal(spec, root)))
    lib = engine_library(lane, lib)
    res.numerics = build_numerics(lib)

    # 2. Committed recipes (real weights), 3. synthetic targets.
    targets = [(Path(r).parent.name if Path(r).name == "recipe.toml" else Path(r).stem,
                lambda r=r: fixtures.bundle_for_recipe(r)) for r in c.gate.recipes]
    targets += [(s.name, lambda s=s: fixtures.synthetic_bundle(s, root)) for s in c.gate.synthetic]
    for name, make in targets:
        log.info("gate: certifying %s", name)
        try:
            bundle = make()
            cert = certify(bundle.root, contract=lc, lane=lane, lib=lib)
        except DgrError as e:
            res.rows.append(_failed(name, e))
            continue
        _add(res, name, cert, out)
        if len(cert.stages) >= SCENARIO_MIN_STAGES:
            n = len(cert.stages)
            procs = next((f.figure for f in cert.figures if f.check == "stages in worker processes"), 0)
            res.rows.append(Row(name, Figure(
                check=f"{SCENARIO_MIN_STAGES}+ stage scenario", figure=f"{n} stages, {procs} processes",
                threshold=f">= {SCENARIO_MIN_STAGES} stages, exact", passed=cert.passed and procs == n,
                detail=f"{bundle.manifest.model.n_layer} main layers + "
                       f"{bundle.manifest.model.n_layer_all - bundle.manifest.model.n_layer} MTP (left out)")))

    # 4. The long-context lane: one long prompt, whole and split, on a model the gate writes.
    if c.gate.long_context is not None:
        spec = c.gate.long_context
        log.info("gate: the long-context lane (%d tokens, %d stages)", spec.tokens, spec.stages)
        try:
            figs = long_context_figures(spec, lib=lib, threads=c.threads(spec.stages, os.cpu_count() or 1))
            res.rows.extend(Row(LONG_CONTEXT, f) for f in figs)
        except DgrError as e:
            res.rows.append(_failed(LONG_CONTEXT, e))

    # 5. Beta: the MTP targets with MTP on, then the speculation rows.
    if c.mtp is not None:
        jobs = [(f"{t}+mtp", lambda t=t, k=k: certify_mtp(by_name[t], lc, lane=lane, lib=lib, root=root, soak=k == 0))
                for k, t in enumerate(c.mtp.targets)]
        jobs.append(("mtp-speculation",
                     lambda: certify_speculation(lc, lane=lane, lib=lib, root=root or fixtures.certify_root())))
        for name, job in jobs:
            log.info("gate: certifying %s", name)
            try:
                _add(res, name, job(), out)
            except DgrError as e:
                res.rows.append(_failed(name, e))
    return res


def _failed(name: str, e: DgrError) -> Row:
    """A target that could not be certified at all: one failed row saying why."""
    return Row(name, Figure(check="certified", figure=f"error: {e}".splitlines()[0][:160], threshold="runs",
                            passed=False, detail=str(e)))
