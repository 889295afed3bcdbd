"""What is fetched, verified and applied of the pinned upstream, as one report (`dgr upstream status`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dgr.core.errors import UpstreamError
from dgr.toolchain.pin import Pin, load_pin
from dgr.toolchain.upstream.apply import local_changes, patch_stamp
from dgr.toolchain.upstream.layout import layout
from dgr.toolchain.upstream.patchlist import check_patch_list
from dgr.toolchain.upstream.pristine import verify


def status(pin: Pin | None = None, ws: Path | None = None) -> dict[str, Any]:
    """What is fetched, verified and applied (for `dgr upstream status` and the engine build)."""
    pin = pin or load_pin()
    lay = layout(pin, ws)
    out: dict[str, Any] = {"commit": pin.commit, "release": pin.release, "pin": str(pin.path),
                           "tree_hash": pin.tree_hash, "workspace": str(lay.ws)}
    meta = json.loads(lay.pristine_meta.read_text()) if lay.pristine_meta.exists() else None
    out["fetched"] = bool(meta and lay.pristine.is_dir())
    out["source"] = meta["source"] if meta else None
    if out["fetched"]:
        try:
            verify(pin, ws)
            out["verified"], out["verify_error"] = True, None
        except UpstreamError as err:
            out["verified"], out["verify_error"] = False, str(err)
    else:
        out["verified"], out["verify_error"] = False, None
    try:
        check_patch_list(pin)
        out["patch_list_error"] = None
    except UpstreamError as err:
        out["patch_list_error"] = str(err)
    stamp = json.loads(lay.patched_stamp.read_text()) if lay.patched_stamp.exists() else None
    out["patched"] = str(lay.patched) if stamp and lay.patched.is_dir() else None
    out["patches_applied"] = [p["file"] for p in stamp["patches"]] if stamp else []
    out["patches_current"] = bool(stamp) and stamp == patch_stamp(pin)
    out["local_changes"] = local_changes(lay.patched) if out["patched"] else []
    return out
