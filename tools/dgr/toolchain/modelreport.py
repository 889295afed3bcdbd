"""The report of `dgr inspect`: what a GGUF model looks like to dgr.

Layers, widths, the seam and its bytes per token per wire dtype, bytes per layer, tensor ownership; the
chat template, and the special tokens a generation starts and stops with. The end-of-generation ids are
llama.cpp's own (`dgr.runtime.engine.read_vocab`: the vocabulary alone, no weights), the ids a worker of this
file advertises as its stops; without an engine library the report gives what the header declares.

(Not named `inspect`: a module of that name would shadow the standard library's.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from dgr.core.constants import Keys
from dgr.core.contract import WIRE_DTYPES
from dgr.core.errors import EngineError, GGUFError
from dgr.gguf.model import INPUT, OUTPUT, SHARED, model_info
from dgr.runtime.engine import read_vocab

GK = gguf.Keys


def inspect_model(path: str | Path) -> dict[str, Any]:
    """The report's fields; GGUFError (never anything else) when the file's bytes make no sense."""
    info = model_info(path)
    try:
        return _report(path, info)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError) as e:  # metadata of the wrong kind
        raise GGUFError(f"{path}: corrupt metadata ({type(e).__name__}: {e})") from None


def _report(path: str | Path, info) -> dict[str, Any]:
    h = info.header
    lb = info.layer_bytes()
    types: dict[str, int] = {}
    for t in h.tensors:
        types[t.type.name] = types.get(t.type.name, 0) + 1
    width = info.n_streams * info.n_embd
    return {
        "file": str(path),
        "arch": info.arch,
        "name": h.get(GK.General.NAME),
        "n_layer": info.n_layer,
        "n_layer_mtp": info.n_layer_all - info.n_layer,
        "n_embd": info.n_embd,
        "n_streams": info.n_streams,
        "n_hash_layers": info.n_hash_layers,
        "experts": _experts(info),
        "boundary_shape": [info.n_streams, info.n_embd],
        "boundary_bytes_per_token": {name: d.nbytes(width) for name, d in WIRE_DTYPES.items() if d.fits(width)},
        "tied_embeddings": info.tied_embeddings,
        "n_tensors": len(h.tensors),
        "tensor_types": dict(sorted(types.items())),
        "layer_bytes": lb[:info.n_layer],
        "mtp_layer_bytes": lb[info.n_layer:],
        "input_bytes": info.role_bytes(INPUT),
        "output_bytes": info.role_bytes(OUTPUT) + sum(t.nbytes for t in h.tensors
                                                      if info.tied_embeddings and t.name == "token_embd.weight"),
        "shared_bytes": info.role_bytes(SHARED),
        "total_tensor_bytes": sum(t.nbytes for t in h.tensors),
        "unknown_tensors": info.unknown,
        "chat_template": _chat_template(h),
        "special_tokens": _special_tokens(path, h),
        "stage": None if Keys.STAGE_INDEX not in h.kvs else {
            "index": h.get(Keys.STAGE_INDEX), "count": h.get(Keys.STAGE_COUNT),
            "layer_begin": h.get(Keys.LAYER_BEGIN), "layer_end": h.get(Keys.LAYER_END),
            "recipe": h.get(Keys.RECIPE_NAME), "boundary_dtype": h.get(Keys.BOUNDARY_DTYPE),
            "token_ids": h.get(Keys.BOUNDARY_TOKEN_IDS),
        },
    }


def _first_line(text: str, width: int = 100) -> str:
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    return line if len(line) <= width else line[:width - 3] + "..."


def _chat_template(h) -> dict[str, Any]:
    """tokenizer.chat_template: whether the file has one, its size and first line, and the names of any
    other templates it carries (tokenizer.chat_template.<name>)."""
    t = h.get(GK.Tokenizer.CHAT_TEMPLATE)
    prefix = GK.Tokenizer.CHAT_TEMPLATE + "."
    others = sorted(k[len(prefix):] for k in h.kvs if k.startswith(prefix))
    if not isinstance(t, str) or not t.strip():
        return {"present": False, "chars": 0, "first_line": None, "others": others}
    return {"present": True, "chars": len(t), "first_line": _first_line(t), "others": others}


def _special_tokens(path: str | Path, h) -> dict[str, Any]:
    """bos, eos, eot and every end-of-generation id, each with its text: llama.cpp's view of the vocabulary
    when the engine library is at hand ("from": "llama.cpp"), else what the header declares ("header")."""
    tokens = h.get(GK.Tokenizer.LIST)

    def tok(i) -> dict[str, Any] | None:
        if i is None or isinstance(i, bool) or not isinstance(i, int) or i < 0:
            return None
        text = tokens[i] if isinstance(tokens, list) and i < len(tokens) else None
        return {"id": i, "text": text if isinstance(text, str) else None}

    declared = {name: tok(h.get(key)) for name, key in (("bos", GK.Tokenizer.BOS_ID), ("eos", GK.Tokenizer.EOS_ID),
                                                         ("eot", GK.Tokenizer.EOT_ID), ("eom", GK.Tokenizer.EOM_ID))}
    if not isinstance(tokens, list):
        return {**declared, "eog": None, "from": "header", "note": "the file has no vocabulary"}

    try:
        v = read_vocab(path)
    except EngineError as err:
        return {**declared, "eog": None, "from": "header", "note": f"llama.cpp's view needs the engine: {err}"}
    return {"bos": tok(v.bos), "eos": tok(v.eos), "eot": tok(v.eot), "eom": declared["eom"],
            "eog": [tok(t) for t in v.eog], "from": "llama.cpp", "note": None}


def _experts(info) -> dict[str, int] | None:
    """Mixture-of-experts inventory from metadata and tensors (None for a dense model)."""
    h, arch = info.header, info.arch
    routed = h.get(GK.LLM.EXPERT_COUNT.format(arch=arch))
    if not routed:
        return None
    moe_layers = {info.layer_of[t.name] for t in h.tensors
                  if t.name.endswith("ffn_gate_exps.weight") and isinstance(info.layer_of.get(t.name), int)}
    return {
        "routed": int(routed),
        "shared": int(h.get(GK.LLM.EXPERT_SHARED_COUNT.format(arch=arch), 0) or 0),
        "active": int(h.get(GK.LLM.EXPERT_USED_COUNT.format(arch=arch), 0) or 0),
        "moe_layers": len([il for il in moe_layers if il < info.n_layer]),
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB ({n} B)"


def format_report(r: dict[str, Any]) -> str:
    lb = r["layer_bytes"]
    lines = [
        f"file:            {r['file']}",
        f"architecture:    {r['arch']}" + (f"  ({r['name']})" if r["name"] else ""),
        f"layers:          {r['n_layer']}" + (f" + {r['n_layer_mtp']} MTP (left out of bundles unless bundle.include_mtp)"
                                              if r["n_layer_mtp"] else ""),
        f"embedding width: {r['n_embd']}",
        f"boundary:        [n_tokens, {r['n_streams']}, {r['n_embd']}] per seam"
        + (f" (mHC: {r['n_streams']} x {r['n_embd']})" if r["n_streams"] > 1 else "")
        + "; bytes/token " + ", ".join(f"{d} {n}" for d, n in r["boundary_bytes_per_token"].items()),
    ]
    st = r.get("stage")
    if st:
        lines.append(f"bundle stage:    {st['index']} of {st['count']} (recipe {st['recipe']}), owns layers "
                     f"[{st['layer_begin']}, {st['layer_end']}); wire dtype {st['boundary_dtype']}"
                     + ("; needs the token-id sideband" if st["token_ids"] else ""))
    if r["n_hash_layers"]:
        lines.append(f"hash layers:     {r['n_hash_layers']} (a stage starting inside them needs the token ids)")
    if r["experts"]:
        e = r["experts"]
        lines.append(f"experts:         {e['routed']} routed + {e['shared']} shared, {e['active']} active per token; "
                     f"{e['moe_layers']} MoE layers")
    lines += [
        f"tied embeddings: {'yes (the last stage carries token_embd as the LM head)' if r['tied_embeddings'] else 'no'}",
        f"tensors:         {r['n_tensors']} (" + ", ".join(f"{k} {v}" for k, v in r["tensor_types"].items()) + ")",
    ]
    if lb and min(lb) == max(lb):
        lines.append(f"bytes per layer: {_mib(lb[0])} each")
    elif lb:
        lines.append(f"bytes per layer: min {_mib(min(lb))}, max {_mib(max(lb))}")
        lines.append("                 " + " ".join(str(b) for b in lb))
    if r["mtp_layer_bytes"]:
        lines.append(f"MTP layer bytes: {' '.join(str(b) for b in r['mtp_layer_bytes'])}")
    lines += [
        f"first stage:     {_mib(r['input_bytes'])} (token embedding)",
        f"last stage:      {_mib(r['output_bytes'])} (output norm and head"
        + (", the tied token_embd)" if r["tied_embeddings"] else ")"),
    ]
    if r["shared_bytes"]:
        lines.append(f"every stage:     {_mib(r['shared_bytes'])} (shared tables)")
    lines.append(f"total:           {_mib(r['total_tensor_bytes'])}")
    if r["unknown_tensors"]:
        lines.append(f"UNKNOWN tensors (belong to no layer dgr understands; a build would fail): "
                     f"{', '.join(r['unknown_tensors'])}")
    else:
        lines.append("unknown tensors: none")
    lines += _format_chat(r)
    return "\n".join(lines)


def _tok(t) -> str:
    return "-" if t is None else f"{t['id']} {t['text']!r}" if t["text"] is not None else str(t["id"])


def _format_chat(r: dict[str, Any]) -> list[str]:
    ct, st = r["chat_template"], r["special_tokens"]
    if ct["present"]:
        lines = [f"chat template:   yes ({ct['chars']} chars), first line: {ct['first_line']}"]
    else:
        lines = ["chat template:   none (serve chat with `dgr serve --chat-template FILE`, or use /v1/completions)"]
    if ct["others"]:
        lines.append(f"                 also named templates: {', '.join(ct['others'])}")
    lines.append("special tokens:  " + ", ".join(f"{k} {_tok(st[k])}" for k in ("bos", "eos", "eot", "eom")
                                               if st[k] is not None or k != "eom"))
    if st["eog"] is not None:
        lines.append(f"end of generation ({len(st['eog'])}, llama.cpp's list; a generation stops at any): "
                     + ", ".join(_tok(t) for t in st["eog"]))
    else:
        lines.append(f"end of generation: unknown ({st['note']}); the header declares the ids above")
    return lines
