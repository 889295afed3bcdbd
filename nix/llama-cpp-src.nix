# llama.cpp at the pin: the PyPI sdist the pin names (by its sha256), its tree hash checked with
# tools/dgr/toolchain/treehash.py, then patches/llama.cpp/ applied in the pin's order, each patch's blake3
# checked first. Everything comes from toolchains/llama.cpp.pin.json; nothing here repeats it.
{
  stdenv,
  fetchPypi,
  python3,
  pin,
  root,
}:
let
  sdist = builtins.head (builtins.filter (s: s.kind == "pypi-sdist") pin.sources);
  patches = map (p: {
    name = baseNameOf p.file;
    path = root + "/${p.file}";
    inherit (p) blake3;
  }) pin.patches;
  python = python3.withPackages (ps: [ ps.blake3 ]);
  inherit (import ./hash-scripts.nix { inherit root; }) treehash blake3sum;
  applyPatch = p: ''
    got=$(python3 ${blake3sum} ${p.path} | cut -d' ' -f1)
    if [ "$got" != "${p.blake3}" ]; then
      echo "patch ${p.name} changed: blake3 $got, the pin says ${p.blake3}" >&2
      exit 1
    fi
    patch -p1 --forward --no-backup-if-mismatch < ${p.path}
  '';
in
stdenv.mkDerivation {
  pname = "llama.cpp-src";
  version = pin.release;
  src = fetchPypi {
    pname = builtins.replaceStrings [ "-${sdist.version}.tar.gz" ] [ "" ] sdist.filename;
    inherit (sdist) version sha256;
  };
  sourceRoot = sdist.strip_prefix;
  nativeBuildInputs = [ python ];
  dontConfigure = true;
  dontBuild = true;
  installPhase = ''
    runHook preInstall
    python3 ${treehash} . --expect ${pin.tree_hash}
    ${builtins.concatStringsSep "\n" (map applyPatch patches)}
    cp -r . $out
    # the patch series hash the engine's numerics name (docs/numerics.md; the worker package reads it)
    python3 ${blake3sum} --series ${root + "/toolchains/llama.cpp.pin.json"} > $out/dgr-patch-series
    runHook postInstall
  '';
  passthru = {
    inherit (pin) commit tree_hash;
    patchNames = map (p: p.name) patches;
  };
}
