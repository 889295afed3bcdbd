# The two hashing scripts the source derivations run before anything is built (dgr is not installed
# there): toolchains/bazel/blake3sum.py (a file's blake3) and tools/dgr/toolchain/treehash.py (a tree's), with
# tools/dgr/core/hashing.py they import from beside them (the one file-hashing module). Just those files, in
# the tree's layout, so that editing anything else rebuilds nothing. Run them with Python + blake3.
{ root }:
let
  keep = [ "tools" "tools/dgr" "tools/dgr/__init__.py" "tools/dgr/core" "tools/dgr/core/__init__.py"
           "tools/dgr/core/hashing.py" "tools/dgr/toolchain"
           "tools/dgr/toolchain/treehash.py"
           "toolchains" "toolchains/bazel" "toolchains/bazel/blake3sum.py" ];
  scripts = builtins.path {
    path = root;
    name = "dgr-hash-scripts";
    filter = path: _type:
      builtins.elem (builtins.replaceStrings [ "${toString root}/" ] [ "" ] (toString path)) keep;
  };
in
{
  treehash = "${scripts}/tools/dgr/toolchain/treehash.py";
  blake3sum = "${scripts}/toolchains/bazel/blake3sum.py";
}
