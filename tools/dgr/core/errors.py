"""Typed errors. `str(err)` is the message the user sees: what was wrong and what to do."""


class DgrError(Exception):
    """Base of every error dgr reports to a user (the CLI prints it and exits non-zero)."""

    exit_code = 2


class RecipeError(DgrError):
    """A recipe is invalid: names the file, the field and what would be valid."""


class SourceError(DgrError):
    """A model source could not be fetched or does not match its hash."""


class BundleError(DgrError):
    """A bundle could not be built, or is corrupt (names the file and chunk)."""


class StoreError(DgrError):
    """A store location is refused or unusable."""


class GGUFError(DgrError):
    """A GGUF file is unreadable or not what dgr expects."""


class UpstreamError(DgrError):
    """The pinned upstream could not be fetched, verified or patched."""


class EngineError(DgrError):
    """The ShardEngine refused an input or could not be built/loaded."""


class CacheMiss(EngineError):
    """The session's cache does not hold what the step expects: re-prefill at a new epoch."""

    def __init__(self, message: str, *, held: int, expected: int):
        super().__init__(message)
        self.held = held
        self.expected = expected


class Unsupported(EngineError):
    """The engine cannot do this for this model, by design (DGR_E_UNSUPPORTED): e.g. a recurrent model's state
    cannot drop positions. Not a fault: the caller refuses the feature by name."""


class SchemaMismatch(EngineError):
    """A boundary's schema (streams, width, dtype, sideband) does not match the stage's."""


class WireError(DgrError):
    """A remote hop failed or answered a typed error; names the hop."""


class ReleaseError(DgrError):
    """A release archive does not match its manifest (names the file), or could not be built."""


def first_field_error(err) -> str:
    """`field.path: what is wrong` for the first problem a pydantic ValidationError reports (files whose
    errors name one field: manifests, certification contracts)."""
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
    return f"{loc}: {first['msg'].removeprefix('Value error, ')}"
