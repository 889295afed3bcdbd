"""The flake's NixOS module (`nixosModules.default`) evaluates to the systemd services of its workers.

nixpkgs cannot be fetched here (docs/build.md, "Nix"), so, as tests/builds/test_build_nix.py does for the
shells, the flake is evaluated against a stand-in nixpkgs that this test writes: a flake whose `lib`
has the functions the module uses and a small `evalModules` (options with defaults and types checked,
submodules, unknown options refused, `mkIf`, assertions), as nixpkgs' lib does. The module's services
are then checked field by field, and the worker command line it writes is parsed by `dgr worker serve`'s
own argument parser. Only evaluating inside a real NixOS system is out of reach here.

The flake is copied (flake.nix, nix/, the pin) into a temporary folder and evaluated from there, so the
check does not depend on whether git already tracks a new file (a git flake sees tracked files only).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from dgr.cli.main import build_parser

from support.paths import REPO

STANDIN_FLAKE = '{ description = "stand-in for nixpkgs (dgr tests)"; outputs = { self }: { lib = import ./lib.nix; }; }\n'

# nixpkgs' lib, as far as dgr's module uses it, and an evalModules that checks what nixpkgs' does.
STANDIN_LIB = r"""
let
  lib = rec {
    mkOption = attrs: attrs // { _type = "option"; };
    mkIf = condition: content: { _type = "if"; inherit condition content; };
    optionals = c: l: if c then l else [ ];
    optionalAttrs = c: a: if c then a else { };
    nameValuePair = name: value: { inherit name value; };
    mapAttrs' = f: set: builtins.listToAttrs (map (n: f n set.${n}) (builtins.attrNames set));
    mapAttrsToList = f: set: map (n: f n set.${n}) (builtins.attrNames set);
    concatLists = builtins.concatLists;
    concatStringsSep = builtins.concatStringsSep;
    hasPrefix = p: s: builtins.substring 0 (builtins.stringLength p) s == p;
    escapeShellArg = a: "'" + builtins.replaceStrings [ "'" ] [ "'\\''" ] (toString a) + "'";
    types = {
      str = { name = "string"; check = builtins.isString; };
      int = { name = "signed integer"; check = builtins.isInt; };
      bool = { name = "boolean"; check = builtins.isBool; };
      package = { name = "package"; check = x: builtins.isAttrs x && x ? outPath; };
      enum = vs: { name = "one of ${builtins.concatStringsSep ", " vs}"; check = x: builtins.elem x vs; };
      nullOr = t: { name = "null or ${t.name}"; check = x: x == null || t.check x; inner = t; };
      listOf = t: { name = "list of ${t.name}"; check = x: builtins.isList x && builtins.all t.check x; };
      attrsOf = t: { name = "attribute set of ${t.name}"; check = builtins.isAttrs; elem = t; };
      submodule = m: { name = "submodule"; check = builtins.isAttrs; sub = m; };
    };

    isOption = o: builtins.isAttrs o && (o._type or "") == "option";

    # a value of type `t` at `path`: submodules evaluated, the type checked
    value = path: t: v:
      if v == null && t ? inner then null
      else if t ? inner then value path t.inner v
      else if t ? sub then evalSub path t.sub v
      else if t ? elem then builtins.mapAttrs (k: x: value "${path}.${k}" t.elem x) v
      else if t.check v then v
      else throw "The option `${path}' is not of type `${t.name}': ${builtins.toJSON v}";

    evalSub = path: m: defs:
      let mod = if builtins.isFunction m then m { name = lastOf path; } else m;
      in evalOpts path mod.options defs;

    lastOf = path: let parts = builtins.filter builtins.isString (builtins.split "\\." path);
      in builtins.elemAt parts (builtins.length parts - 1);

    evalOpts = path: opts: defs:
      let
        unknown = builtins.filter (k: !(opts ? ${k})) (builtins.attrNames defs);
        at = k: if path == "" then k else "${path}.${k}";
      in
      if unknown != [ ] then throw "The option `${at (builtins.head unknown)}' does not exist."
      else builtins.mapAttrs (k: o:
        if isOption o then
          (if defs ? ${k} then value (at k) o.type defs.${k}
           else if o ? default then value (at k) o.type o.default
           else throw "The option `${at k}' is used but not defined.")
        else evalOpts (at k) o (defs.${k} or { })) opts;

    resolve = x:
      if builtins.isAttrs x && (x._type or "") == "if" then (if x.condition then resolve x.content else { })
      else if builtins.isAttrs x && !(x ? outPath) then builtins.mapAttrs (n: resolve) x
      else x;

    merge = a: b: a // builtins.mapAttrs (n: v:
      if a ? ${n} && builtins.isAttrs v && builtins.isAttrs a.${n} then merge a.${n} v else v) b;

    # modules: the module under test (a function) and plain config sets
    evalModules = { modules, specialArgs ? { } }:
      let
        fns = builtins.filter builtins.isFunction modules;
        defs = builtins.foldl' merge { } (builtins.filter builtins.isAttrs modules);
        # the modules see the option values (nixpkgs merges lazily per option; this stand-in need not:
        # a module reads its own options only)
        results = map (f: f ({ config = declared; inherit lib; } // specialArgs)) fns;
        options = builtins.foldl' merge { } (map (r: r.options or { }) results);
        declared = evalOpts "" options (builtins.intersectAttrs options defs);
        config = builtins.foldl' merge declared (map (r: resolve (r.config or { })) results);
        failed = builtins.filter (a: !a.assertion) (config.assertions or [ ]);
      in
      if failed != [ ] then throw "Failed assertions:\n- ${builtins.concatStringsSep "\n- " (map (a: a.message) failed)}"
      else { inherit config options; };
  };
in
lib
"""

# One worker plain on loopback, one with mutual TLS on another address; a stand-in package.
CONFIG = r"""
m:
let
  lib = (builtins.getFlake "path:@STANDIN@").lib;
  pkg = { outPath = "/nix/store/00000000000000000000000000000000-dgr-worker-cpu"; name = "dgr-worker-cpu"; };
  pkgs = { system = "x86_64-linux"; stdenv.hostPlatform.system = "x86_64-linux"; };
  eval = lib.evalModules {
    specialArgs = { inherit pkgs; };
    modules = [ m { services.dgr.workers = @WORKERS@; } ];
  };
in eval.config.systemd.services
"""

WORKERS = """{
  stage0 = { bundle = "/srv/dgr/smollm2-135m-3stage-32052c63c9ad"; stage = 0; listen = "127.0.0.1:7100";
             package = pkg; threads = 1; };
  stage1 = { bundle = "/srv/dgr/smollm2-135m-3stage-32052c63c9ad"; stage = 1; listen = "10.0.0.2:7110";
             package = pkg; memoryMax = "2G";
             tls = { cert = "/etc/dgr/stage1.pem"; key = "/etc/dgr/stage1.key"; ca = "/etc/dgr/ca.pem"; }; };
}"""


@pytest.fixture(scope="module")
def flake(tmp_path_factory) -> tuple[Path, Path]:
    """(the flake's files copied, the stand-in nixpkgs flake)."""
    if shutil.which("nix") is None:
        pytest.skip("nix is not installed (Debian: apt-get install nix-bin; scripts/setup does)")
    root = tmp_path_factory.mktemp("nixos")
    src = root / "dgr"
    (src / "toolchains").mkdir(parents=True)
    shutil.copy2(REPO / "flake.nix", src / "flake.nix")
    shutil.copytree(REPO / "nix", src / "nix")
    shutil.copy2(REPO / "toolchains" / "llama.cpp.pin.json", src / "toolchains" / "llama.cpp.pin.json")
    standin = root / "nixpkgs"
    standin.mkdir()
    (standin / "flake.nix").write_text(STANDIN_FLAKE)
    (standin / "lib.nix").write_text(STANDIN_LIB)
    return src, standin


def _eval(flake, workers: str = WORKERS) -> subprocess.CompletedProcess:
    src, standin = flake
    apply = CONFIG.replace("@STANDIN@", str(standin)).replace("@WORKERS@", workers)
    return subprocess.run(
        ["nix", "--extra-experimental-features", "nix-command flakes", "eval", "--offline", "--impure", "--json",
         "--no-write-lock-file", "--override-input", "nixpkgs", f"path:{standin}",
         f"path:{src}#nixosModules.default", "--apply", apply],
        capture_output=True, text=True, timeout=300, env={**os.environ, "NIX_CONFIG": "warn-dirty = false"})


def test_the_module_evaluates_to_one_service_per_worker(flake):
    proc = _eval(flake)
    assert proc.returncode == 0, proc.stderr[-3000:]
    services = json.loads(proc.stdout)
    assert sorted(services) == ["dgr-worker-stage0", "dgr-worker-stage1"]
    s0, s1 = services["dgr-worker-stage0"], services["dgr-worker-stage1"]
    for s in (s0, s1):
        c = s["serviceConfig"]
        assert (c["Restart"], c["DynamicUser"], c["ProtectHome"], c["ProtectSystem"]) == ("on-failure", True, True, "strict")
        assert c["LimitNOFILE"] == 65536 and c["TasksMax"] == 512 and s["wantedBy"] == ["multi-user.target"]
    assert s1["serviceConfig"]["MemoryMax"] == "2G" and "MemoryMax" not in s0["serviceConfig"]
    assert s0["serviceConfig"]["LoadCredential"] == []
    assert s1["serviceConfig"]["LoadCredential"] == [
        "tls.pem:/etc/dgr/stage1.pem", "tls.key:/etc/dgr/stage1.key", "ca.pem:/etc/dgr/ca.pem"]
    argv = shlex.split(s1["serviceConfig"]["ExecStart"])
    assert argv[0] == "/nix/store/00000000000000000000000000000000-dgr-worker-cpu/bin/dgr-worker"
    args = build_parser().parse_args(["worker", *argv[1:]])       # dgr worker serve takes exactly these
    assert (args.bundle, args.stage, args.listen, args.lane) == (
        "/srv/dgr/smollm2-135m-3stage-32052c63c9ad", 1, "10.0.0.2:7110", "cpu")
    assert (args.tls_cert, args.tls_key, args.tls_ca) == ("%d/tls.pem", "%d/tls.key", "%d/ca.pem")
    a0 = build_parser().parse_args(["worker", *shlex.split(s0["serviceConfig"]["ExecStart"])[1:]])
    assert (a0.threads, a0.session_ttl, a0.tls_cert) == (1, 300.0, None)
    # bin/dgr-worker is the C++ worker (nix/package.nix): it takes every flag the unit passes, and no
    # Python runs under the unit
    takes = set(re.findall(r'"(--[a-z0-9-]+)"', (REPO / "worker" / "server" / "main.cpp").read_text()))
    for s in (s0, s1):
        argv = shlex.split(s["serviceConfig"]["ExecStart"])
        assert argv[1] == "serve"
        flags = {a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")}
        assert flags and flags <= takes, flags - takes
        env = s["environment"]
        assert "PYTHONUNBUFFERED" not in env and env["DGR_WORKSPACE"].startswith("/var/lib/dgr-worker-")


@pytest.mark.parametrize("workers, says", [
    ('{ w = { bundle = "/srv/b"; stage = 0; listen = "127.0.0.1:1"; package = pkg; stagee = 1; }; }',
     "The option `services.dgr.workers.w.stagee' does not exist"),
    ('{ w = { bundle = "/srv/b"; stage = 0; listen = "127.0.0.1:1"; package = pkg; lane = "tpu"; }; }',
     "The option `services.dgr.workers.w.lane' is not of type `one of cpu, cuda, rocm, vulkan, metal'"),
    ('{ w = { bundle = "/home/me/b"; stage = 0; listen = "127.0.0.1:1"; package = pkg; }; }',
     "services.dgr.workers.w.bundle /home/me/b is under /home"),
    ('{ w = { bundle = "/srv/b"; listen = "127.0.0.1:1"; package = pkg; }; }',
     "The option `services.dgr.workers.w.stage' is used but not defined"),
])
def test_a_wrong_worker_fails_the_evaluation_naming_it(flake, workers, says):
    proc = _eval(flake, workers)
    assert proc.returncode != 0
    assert says in proc.stderr, proc.stderr[-2000:]
