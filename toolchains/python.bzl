"""The Python test suite as Bazel targets: one py_test per tests/*/test_*.py file.

Each test runs through toolchains/bazel/dgr_launcher.py, which hands it the lane's Bazel-built engine
(found through runfiles) as $DGR_ENGINE_LIB. Tests share dgr's workspace (.dgr/ or $DGR_WORKSPACE:
the fetched upstream, downloaded models), which Bazel does not see: they are tagged `external` (never
cached as passed) and run one at a time (.bazelrc: --local_test_jobs=1).
"""

load("@rules_python//python:defs.bzl", "py_binary", "py_test")
load("//toolchains:lanes.bzl", "LANES", "lane_select")

def dgr_py_tests(srcs, lane = "cpu", data = [], slow = [], tags = [], cmake_engine = []):
    """`slow`: tests that get the eternal timeout (those of pytest's `slow` marker that run long under
    Bazel too). `cmake_engine`: tests that compare the engine with another CMake build of it (same
    flags on both sides), so they keep dgr's own CMake build rather than the Bazel one. A test file
    that collects no tests fails (the launcher keeps pytest's exit 5); helpers go in `data`."""
    engine = "//worker/engine:libdgr_engine_%s.so" % lane
    # dgr-worker (docs/worker.md), as $DGR_WORKER_BIN (a runfiles path; dgr.core.paths.env_path resolves it)
    worker = "//worker/server:dgr-worker"
    # the fake engine (worker/fake), as $DGR_FAKE_ENGINE_LIB (a runfiles path; dgr.testing.fake_engine
    # resolves it): for the in-process fake and for dgr-worker --fake-engine
    fake = "//worker/fake:libdgr_fake_engine.so"
    for src in srcs:
        # tests/<area>/test_x.py is //tests:test_x: the file's name alone (unique across the areas,
        # tests/suite/test_suite_launcher.py), so a target keeps its label when its file changes area
        name = src.split("/")[-1][:-len(".py")]
        own = src not in cmake_engine
        py_test(
            name = name,
            srcs = ["//toolchains/bazel:dgr_launcher.py", src],
            main = "//toolchains/bazel:dgr_launcher.py",
            args = (["--engine", "$(rootpath %s)" % engine] if own else []) + ["--pytest", "$(rootpath %s)" % src],
            data = data + ([engine] if own else []) + [worker, fake],
            env = {"DGR_WORKER_BIN": "$(rootpath %s)" % worker, "DGR_FAKE_ENGINE_LIB": "$(rootpath %s)" % fake},
            python_version = "PY3",
            deps = ["//tools/dgr:dgr_lib", "@rules_python//python/runfiles"],
            timeout = "eternal" if src in slow else "long",
            tags = ["external"] + tags,
        )

def dgr_workers():
    """`worker_<lane>`: `bazel run //worker:worker_cpu -- serve ...` runs `dgr worker serve ...` with
    the lane's engine, found through runfiles. Tagged like the lane (manual where hardware is needed)."""
    for lane, info in LANES.items():
        engine = "//worker/engine:libdgr_engine_%s.so" % lane
        py_binary(
            name = "worker_" + lane,
            srcs = ["//toolchains/bazel:dgr_launcher.py"],
            main = "//toolchains/bazel:dgr_launcher.py",
            args = ["--engine", "$(rootpath %s)" % engine, "worker"],
            data = [engine],
            python_version = "PY3",
            deps = ["//tools/dgr:dgr_lib", "@rules_python//python/runfiles"],
            tags = info.tags,
            visibility = ["//visibility:public"],
        )
    native.alias(
        name = "worker",
        actual = select(lane_select(":worker_%s")),
        visibility = ["//visibility:public"],
    )
