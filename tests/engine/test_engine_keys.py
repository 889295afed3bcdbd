"""worker/engine/dgr_keys.h mirrors dgr.core.constants.Keys (the C++ engine reads the same GGUF keys), and
worker/engine/dgr_contract.h the defaults of dgr.core.constants it repeats."""

from __future__ import annotations

import re

from dgr.core.constants import DEFAULT_N_CTX, Keys


def test_cpp_keys_mirror_python_constants(repo_root):
    text = (repo_root / "worker/engine/dgr_keys.h").read_text()
    cpp = dict(re.findall(r'#define DGR_KEY_(\w+)\s+"([^"]+)"', text))
    py = {k: v for k, v in vars(Keys).items() if k.isupper()}
    assert cpp == py


def test_cpp_contract_defaults_mirror_python_constants(repo_root):
    text = (repo_root / "worker/engine/dgr_contract.h").read_text()
    assert re.search(r"#define DGR_DEFAULT_N_CTX\s+(\d+)", text).group(1) == str(DEFAULT_N_CTX)
