# The dgr tool (CLI and library: recipes, bundles, upstream, worker service) from pyproject.toml.
# Its engine comes from the worker package (DGR_ENGINE_LIB), not from here.
{
  python3Packages,
  root,
  pythonDeps,
}:
let
  project = (builtins.fromTOML (builtins.readFile (root + "/pyproject.toml"))).project;
  # pyproject.toml and the package only: tests, docs and Nix files do not rebuild the tool.
  src = builtins.path {
    path = root;
    name = "dgr-src";
    filter =
      path: type:
      let
        rel = builtins.substring (builtins.stringLength (toString root) + 1) (-1) (toString path);
      in
      rel == "pyproject.toml"
      || rel == "tools"
      || (builtins.substring 0 10 rel == "tools/dgr/" || rel == "tools/dgr")
      && builtins.match ".*(__pycache__|\\.pyc|BUILD\\.bazel)" rel == null;
  };
in
python3Packages.buildPythonApplication {
  pname = project.name;
  inherit (project) version;
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
