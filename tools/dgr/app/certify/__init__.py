"""Certification: `dgr certify` (a bundle against its whole model, judged by a committed contract) and
`dgr gate alpha` (every target of the contract's gate, one table)."""

from dgr.app.certify.contract import DEFAULT_CONTRACT, Contract, ContractError, LoadedContract, load_contract
from dgr.app.certify.gate import GateResult, Row, format_table, run_gate
from dgr.app.certify.runner import CertifyError, certify, engine_library, measure_speed, mtp_off
from dgr.app.certify.speed import Judged, SpeedRuns, judge, speed_figures
from dgr.app.certify.verdict import EXIT_CODES, INCONCLUSIVE, exit_code, is_inconclusive, overall

__all__ = ["DEFAULT_CONTRACT", "Contract", "ContractError", "LoadedContract", "load_contract", "GateResult", "Row",
           "format_table", "run_gate", "CertifyError", "certify", "engine_library", "measure_speed", "mtp_off",
           "Judged", "SpeedRuns", "judge", "speed_figures", "EXIT_CODES", "INCONCLUSIVE", "exit_code",
           "is_inconclusive", "overall"]
