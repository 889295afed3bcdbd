"""setuptools hook (everything else is in pyproject.toml): a built dgr carries the pin's facts.

An installed wheel has no checkout to read toolchains/llama.cpp.pin.json from, so the build writes
dgr/toolchain/_build.json (the llama.cpp commit and the ordered patch series, taken from the one pin file) into
the package; dgr.toolchain.buildinfo reads it there and `dgr --version` reports it.
"""

import json
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PIN = Path(__file__).resolve().parent / "toolchains" / "llama.cpp.pin.json"


class BuildPyWithPin(build_py):
    def run(self):
        super().run()
        pin = json.loads(PIN.read_text())
        facts = {"commit": pin["commit"], "release": pin.get("release", ""),
                 "patches": [{"file": p["file"], "blake3": p["blake3"]} for p in pin["patches"]]}
        out = Path(self.build_lib) / "dgr" / "toolchain" / "_build.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")


setup(cmdclass={"build_py": BuildPyWithPin})
