"""The certification contract: the committed TOML file `dgr certify` reads its workload and thresholds from."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dgr.core.errors import DgrError, first_field_error
from dgr.core.hashing import bytes_blake3
from dgr.core.paths import REPO_ROOT

DEFAULT_CONTRACT = REPO_ROOT / "certification" / "alpha.toml"

_STRICT = ConfigDict(extra="forbid", frozen=True)


class ContractError(DgrError):
    """A contract file that cannot be read or does not say what a certification needs."""


class Parity(BaseModel):
    model_config = _STRICT
    prompts: list[str] = []
    random_prompts: list[int] = []          # lengths of seeded random-id prompts
    seed: int = 11
    max_new_tokens: int = Field(16, ge=1)
    chunk_tokens: int = Field(64, ge=1)
    n_ctx: int = Field(512, ge=16)
    max_abs_logit_diff: float = Field(0.0, ge=0.0)


class Speed(BaseModel):
    model_config = _STRICT
    applies_to: Literal["real-weights", "all", "none"] = "real-weights"
    prompt: str = "The capital of France is"
    decode_tokens: int = Field(32, ge=2)
    prefill_tokens: int = Field(256, ge=1)
    repeats: int = Field(3, ge=1)
    decode_ratio_min: float = Field(ge=0.0)
    prefill_ratio_min: float = Field(ge=0.0)


class Synthetic(BaseModel):
    """A random-weight model the gate writes itself (`dgr synth`) and splits at `stages`."""

    model_config = _STRICT
    name: str
    arch: Literal["deepseek4", "llama"] = "deepseek4"
    layers: int = Field(ge=1)
    hash_layers: int = 3
    embd: int = 128
    mtp: bool = True
    v4shape: bool = False                   # the real model's narrow-block options (synth_deepseek4_v4shape)
    seed: int = 0
    stages: list[tuple[int, int]]


class MtpRefusal(BaseModel):
    model_config = _STRICT
    synthetic: str


class LongContext(BaseModel):
    """The long-context lane (dgr.app.bench.scale.long_context): one `tokens`-token prompt of random ids,
    prefilled by a random-weight `arch` model whole and split into `stages` stages (even cuts, one worker
    process each, the prompt's chunks of `chunk_tokens` pipelined across them); the logits rows both return
    must be the same bit for bit and the greedy tokens after the prompt the same. TTFT and memory per stage
    are reported beside them."""

    model_config = _STRICT
    arch: Literal["llama", "qwen2"] = "llama"
    layers: int = Field(8, ge=2)
    tokens: int = Field(ge=64)
    stages: int = Field(4, ge=2)
    chunk_tokens: int = Field(512, ge=1)

    @model_validator(mode="after")
    def _fits(self):
        if self.stages > self.layers:
            raise ValueError(f"gate.long_context: {self.stages} stages need at least as many layers "
                             f"({self.layers} given)")
        return self


class Gate(BaseModel):
    model_config = _STRICT
    recipes: list[str] = []
    synthetic: list[Synthetic] = []
    mtp_refusal: MtpRefusal | None = None
    long_context: LongContext | None = None

    @field_validator("synthetic")
    @classmethod
    def _unique(cls, v: list[Synthetic]) -> list[Synthetic]:
        names = [s.name for s in v]
        if len(set(names)) != len(names):
            raise ValueError(f"gate.synthetic names must be unique, got {names}")
        return v


class MtpSpeculation(BaseModel):
    """What the ring does with MTP drafts (dgr.app.bench.speculate_mtp): tokens per trip on a synthetic V4 whose
    drafts agree with its trunk at `agree`, and the rejected-draft cost on one whose drafts never agree."""

    model_config = _STRICT
    agree: float = Field(0.8, gt=0.0, le=1.0)
    stages: int = Field(4, ge=2, le=4)
    tokens: int = Field(48, ge=8)
    rounds: int = Field(3, ge=1)
    tokens_per_trip_min: float = Field(ge=1.0)
    rejected_cost_max: float = Field(ge=1.0)


class MtpSoak(BaseModel):
    model_config = _STRICT
    seconds: float = Field(30.0, gt=0)
    sessions: int = Field(2, ge=1)
    max_tokens: int = Field(32, ge=2)
    errors_max: int = Field(0, ge=0)
    rss_growth_max_mib: float = Field(ge=0.0)


class Mtp(BaseModel):
    """Beta's MTP rows (docs/deepseek4.md section 4): `targets` (names of gate.synthetic) are built again with
    bundle.include_mtp = true; on each, MTP on must equal MTP off (greedy tokens, every logit) and a kill -9 of
    the last stage in the middle of a draft step, with a replica, must give the same text."""

    model_config = _STRICT
    targets: list[str]
    draft_k: int = Field(4, ge=1, le=16)
    speculation: MtpSpeculation
    soak: MtpSoak


class Contract(BaseModel):
    model_config = _STRICT
    name: str
    lane: str = "cpu"
    threads_per_process: int = Field(0, ge=0)
    parity: Parity
    speed: Speed | None = None
    gate: Gate = Gate()
    mtp: Mtp | None = None                  # beta: MTP on; alpha has none (and refuses MTP)

    def threads(self, stages: int, cores: int) -> int:
        """Compute threads of each worker and of the whole model for a route of `stages` stages."""
        return self.threads_per_process or max(1, cores // max(1, stages))


class LoadedContract(BaseModel):
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    contract: Contract
    path: Path
    blake3: str

    @property
    def ref_path(self) -> str:
        """The path a certificate records: repository-relative when the file is inside the checkout."""
        try:
            return str(self.path.resolve().relative_to(REPO_ROOT))
        except ValueError:
            return str(self.path.resolve())


def load_contract(path: str | Path | None = None) -> LoadedContract:
    """Read and validate a contract file (default: certification/alpha.toml) and hash its bytes."""
    p = Path(path) if path is not None else DEFAULT_CONTRACT
    try:
        raw = p.read_bytes()
        data = tomllib.loads(raw.decode("utf-8"))
    except OSError as e:
        raise ContractError(f"{p}: cannot read the certification contract ({e.strerror})") from e
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ContractError(f"{p}: not valid TOML: {e}") from e
    try:
        c = Contract.model_validate(data)
    except ValidationError as e:
        raise ContractError(f"{p}: {first_field_error(e)}") from e
    if not c.parity.prompts and not c.parity.random_prompts:
        raise ContractError(f"{p}: [parity] needs prompts or random_prompts")
    if c.mtp is not None:
        v4 = {s.name for s in c.gate.synthetic if s.arch == "deepseek4" and s.mtp}
        bad = [t for t in c.mtp.targets if t not in v4]
        if bad or not c.mtp.targets:
            raise ContractError(f"{p}: mtp.targets {bad or '[]'}: name gate.synthetic DeepSeek V4 targets with "
                                f"mtp = true (one of {sorted(v4)})")
    # the bytes validated are the bytes hashed (dgr.core.certificate.contract_hash of the file, while unchanged)
    return LoadedContract(contract=c, path=p, blake3=bytes_blake3(raw))


def mtp_refused(where: str) -> str:
    """Why alpha refuses a bundle or recipe with MTP on (`where` names it)."""
    return (f"{where}: MTP is on (bundle.include_mtp): alpha certifies bundles with MTP off (MTP drafting is "
            "beta, docs/deepseek4.md section 4); set include_mtp false")
