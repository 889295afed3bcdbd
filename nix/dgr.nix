# The dgr tool (CLI and library: recipes, bundles, upstream, worker service) from pyproject.toml.
# Its engine comes from the worker package (DGR_ENGINE_LIB), not from here.
{
  python3Packages,
  root,
  pythonDeps,
}:
let
  project = (builtins.fromTOML (builtins.readFile (root + "/pyproject.toml"))).project;
  # the version is written once, in dgr/__init__.py (pyproject.toml reads it there too)
  version = builtins.head (
    builtins.match ".*__version__ = \"([^\"]+)\".*" (builtins.readFile (root + "/tools/dgr/__init__.py"))
  );
  # pyproject.toml, setup.py (it copies the pin's facts into the package) and the package only: tests, docs and Nix files do not rebuild the tool.
  src = builtins.path {
    path = root;
    name = "dgr-src";
    filter =
      path: type:
      let
        rel = builtins.substring (builtins.stringLength (toString root) + 1) (-1) (toString path);
      in
      rel == "pyproject.toml"
      || rel == "setup.py"
      || rel == "toolchains"
      || rel == "toolchains/llama.cpp.pin.json"
      || rel == "tools"
      || (builtins.substring 0 10 rel == "tools/dgr/" || rel == "tools/dgr")
      && builtins.match ".*(__pycache__|\\.pyc|BUILD\\.bazel)" rel == null;
  };
in
python3Packages.buildPythonApplication {
  pname = project.name;
  inherit version;
  pyproject = true;
  inherit src;
  build-system = [ python3Packages.setuptools ];
  dependencies = pythonDeps python3Packages;
  # nixpkgs' versions may differ from pyproject's ranges (grpcio); the tests decide, not pip.
  pythonRelaxDeps = true;
  doCheck = false;
  meta = {
    description = project.description;
    mainProgram = "dgr";
  };
}
