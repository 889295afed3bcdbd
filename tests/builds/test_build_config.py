"""The build's configuration agrees with itself: lanes, configs, Nix packages, offline stand-ins.

Fast checks of files only; the tests that run Bazel and Nix are test_build_bazel_*.py and
test_build_nix.py.
"""

from __future__ import annotations

import re

from dgr.core.constants import LANES

from support.paths import REPO


def _lanes_table() -> dict[str, str]:
    """lane -> its struct(...) text, from toolchains/lanes.bzl's LANES table."""
    text = (REPO / "toolchains/lanes.bzl").read_text()
    table = text[text.index("LANES = {"):]
    table = table[: table.index("\n}\n")]
    parts = re.split(r'\n    "(\w+)": struct\(', table)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_lane_has_a_bazel_entry_a_config_and_a_nix_package():
    table = _lanes_table()
    assert sorted(table) == sorted(LANES), "toolchains/lanes.bzl LANES must list dgr.core.constants.LANES"
    bazelrc = (REPO / ".bazelrc").read_text()
    scope = (REPO / "nix/scope.nix").read_text()
    for lane in LANES:
        assert f"build:{lane} --define=dgr_lane={lane}" in bazelrc, f".bazelrc lacks --config={lane}"
        assert re.search(rf"^\s+{lane} = ", scope, re.M), f"nix/scope.nix lacks the {lane} package"


def _status(body: str) -> str:
    return re.search(r'status = "([\w-]+)"', body).group(1)


def test_lanes_built_here_are_tested_and_the_others_kept_out_of_bazel_test_all():
    tests_build = (REPO / "tests/BUILD.bazel").read_text()
    table = _lanes_table()
    assert _status(table["cpu"]) == "built-here"
    for lane, body in table.items():
        tags = re.search(r"tags = \[([^\]]*)\]", body).group(1)
        status = _status(body)
        if status == "built-here":
            # built and tested by `bazel test //...` on this machine: not manual, and its tests exist
            assert '"manual"' not in tags, f"lane {lane} is built here: `bazel test //...` must build it"
            assert lane == "cpu" or f'lane = "{lane}"' in tests_build, f"no py_test runs the {lane} lane's engine"
        else:
            assert '"manual"' in tags, f"lane {lane} needs hardware or another OS: it must be manual"
            assert status in ("compiles-here", "declared")
            if status == "declared":
                assert re.search(r'reason = \(?\s*"\S', body), f"declared lane {lane} must say why"


def test_the_lanes_table_in_docs_says_what_each_lane_is():
    """docs/build.md's lanes table follows LANES (no drift between the docs and the tree)."""
    doc = (REPO / "docs/build.md").read_text()
    words = {"built-here": "built and tested", "compiles-here": "compiles and links", "declared": "declared"}
    for lane, body in _lanes_table().items():
        row = re.search(rf"^\| {lane} \| ([^|]*)\|", doc, re.M)
        assert row, f"docs/build.md's lanes table has no row for {lane}"
        assert row.group(1).strip().startswith(words[_status(body)]), (lane, row.group(0))


def test_offline_stand_ins_exist_for_every_local_repository():
    workspace = (REPO / "WORKSPACE").read_text()
    repos = re.findall(r'local_repository\(\s*name = "(\w+)",\s*path = "([^"]+)"', workspace)
    assert {name for name, _ in repos} >= {"rules_cc", "rules_java", "remote_coverage_tools"}
    for name, path in repos:
        assert (REPO / path / "WORKSPACE").read_text().strip() == f'workspace(name = "{name}")'
    ignored = (REPO / ".bazelignore").read_text().split()
    for _, path in repos:
        assert path in ignored, f"{path} must be in .bazelignore (it is its own repository)"


def test_bazel_and_nix_read_the_one_pin_file():
    rule = (REPO / "toolchains/llama_cpp.bzl").read_text()
    assert "json.decode(ctx.read(" in rule and '"//toolchains:llama.cpp.pin.json"' in rule
    flake = (REPO / "flake.nix").read_text()
    assert "builtins.fromJSON (builtins.readFile ./toolchains/llama.cpp.pin.json)" in flake
    src = (REPO / "nix/llama-cpp-src.nix").read_text()
    assert "pin.patches" in src and "pin.tree_hash" in src and "tools/dgr/toolchain/treehash.py" in src


def test_cmake_and_bazel_compile_the_same_files_of_llama_cpps_common():
    """The engine's grammar support compiles a few files of llama.cpp's common/; both builds name the same ones."""
    cmake = (REPO / "worker/CMakeLists.txt").read_text()
    bazel = (REPO / "toolchains/bazel/llama.cpp.BUILD.bazel").read_text()
    in_cmake = re.search(r"set\(DGR_COMMON_FILES ([^)]*)\)", cmake).group(1).split()
    in_bazel = re.findall(r'"([\w-]+\.cpp)"', bazel[bazel.index("DGR_COMMON_FILES = ["):].split("]")[0])
    assert in_cmake and sorted(in_cmake) == sorted(in_bazel)


def test_cmake_and_bazel_compile_the_cpu_lane_for_one_declared_baseline():
    """docs/numerics.md: the checkout's CMake engine and Bazel's (and so the release's) compile ggml's CPU backend
    with the same one flag, so their workers compute the same bits and share a route."""
    import re

    from dgr.core.constants import CPU_VARIANTS

    bzl = (REPO / "toolchains/lanes.bzl").read_text()
    bazel_flag = re.search(r'"@bazel_tools//src/conditions:linux_x86_64": \["(-march=[^"]+)"\]', bzl).group(1)
    cmake = (REPO / "worker/CMakeLists.txt").read_text()
    assert re.search(r'set\(DGR_CPU_ARCH_FLAG "([^"]+)"\)', cmake).group(1) == bazel_flag == f"-march={CPU_VARIANTS[0]}"
    assert re.search(r'set\(DGR_CPU_VARIANT "([^"]+)" CACHE', cmake).group(1) == CPU_VARIANTS[0]
    # the flag goes on ggml-cpu alone, as Bazel's CPU_ARCH_COPTS do (ggml-base keeps the default target)
    assert "target_compile_options(ggml-cpu PRIVATE ${DGR_CPU_ARCH_FLAG})" in cmake
