# The official BLAKE3 C implementation dgr-worker compiles in (-DDGR_BLAKE3_SRC): the PyPI sdist that
# worker/third_party/blake3.json names (by its sha256), its strip_prefix (c_impl/vendor) taken, and only
# the pin's files kept, each checked against the pin's blake3 first, as `dgr build-engine` does
# (tools/dgr/toolchain/upstream/vendored.py). Everything comes from the pin; nothing here repeats it.
{
  stdenv,
  fetchPypi,
  python3,
  blake3Pin,
  root,
}:
let
  sdist = builtins.head (builtins.filter (s: s.kind == "pypi-sdist") blake3Pin.sources);
  python = python3.withPackages (ps: [ ps.blake3 ]);
  inherit (import ./hash-scripts.nix { inherit root; }) blake3sum;
  names = builtins.attrNames blake3Pin.files;
  keepFile = name: ''
    got=$(python3 ${blake3sum} ${name} | cut -d' ' -f1)
    if [ "$got" != "${blake3Pin.files.${name}}" ]; then
      echo "${name} of ${sdist.filename}: blake3 $got, the pin says ${blake3Pin.files.${name}}" >&2
      exit 1
    fi
    install -Dm644 ${name} $out/${name}
  '';
in
stdenv.mkDerivation {
  pname = "${blake3Pin.name}-c-src";
  version = blake3Pin.version;
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
    ${builtins.concatStringsSep "\n" (map keepFile names)}
    runHook postInstall
  '';
  passthru = {
    inherit (blake3Pin) files;
    inherit (sdist) sha256;
    cVersion = blake3Pin.c_version;
  };
}
