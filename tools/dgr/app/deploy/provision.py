"""The bundle into every local host's store, verified: built from the recipe once, copied to the others.

A copy already in a store is verified in place (resumable, `dgr bundle verify`); a missing one is
copied from a verified copy (`dgr bundle provision`, which checks every chunk as it copies), or built
from the recipe into the first store that needs it (`dgr recipe build`, deterministic). Returns the
bundle folder per store.
"""

from __future__ import annotations

from pathlib import Path

from dgr.app.deploy.plan import Plan
from dgr.app.deploy.spec import DeployError
from dgr.core.log import get_logger
from dgr.toolchain.bundle import build, provision, verify_bundle

log = get_logger(__name__)


def provision_local(plan: Plan, *, progress: bool = False) -> dict[Path, Path]:
    """Make sure every local worker's store holds the bundle, verified; store -> bundle folder."""
    info = plan.bundle
    stores = list(dict.fromkeys(w.store for w in plan.workers if w.local))
    out: dict[Path, Path] = {}
    verified: Path | None = None
    for store in stores:
        have = info.copies.get(store)
        if have is not None:
            rep = verify_bundle(have, progress=progress)
            log.info("deploy: %s verified in %s (%d chunks)", rep.bundle_id[:12], have, rep.chunks_total)
            out[store], verified = have, verified or have
    for store in stores:
        if store in out:
            continue
        src = verified or info.source
        if src is None:
            if info.recipe_path is None:
                raise DeployError(f"{info.label}: no copy to provision {store} from; set bundle.source")
            log.info("deploy: building %s into %s", info.recipe_path, store)
            b = build(info.recipe_path, store, progress=progress)
            verify_bundle(b.root, progress=progress)   # what was written is what the manifest says
            out[store] = verified = b.root
            info.id, info.name = b.id, b.manifest.recipe.name
            continue
        rep = provision(src, store, progress=progress)
        if not rep.complete:
            raise DeployError(f"provisioning {info.label} into {store} stopped before the end; run `dgr up` again")
        log.info("deploy: provisioned %s into %s (%d chunks copied)", rep.bundle_id[:12], rep.dest,
                 rep.chunks_copied)
        out[store] = rep.dest
        verified = verified or rep.dest
    info.copies.update(out)
    return out
