"""dgr.runtime.wire.drafts and its C++ twin, the origin's draft sources (worker/server/speculation/drafts.{h,cpp}),
agree: worker/server/speculation/drafts_test.cpp holds the Python's drafts and refusals on fixed cases as
literals (between its `twin:` markers) and checks the C++ against them; here the Python is checked against the
same literals, read out of that file, so a change on either side fails one of the two tests. Builds nothing
(the route-level comparison, with real workers, is tests/worker/test_worker_cpp_speculate.py)."""

from __future__ import annotations

import json
import re

import pytest

from dgr.core.errors import WireError
from dgr.runtime.wire import drafts
from dgr.runtime.wire.drafts import NgramDrafts, check_k, check_source, make_source

from support.paths import REPO

PART = REPO / "worker" / "server" / "speculation"


def twin_block(name: str) -> list:
    """The entries between `// twin:<name> {` and `// twin:<name> }` in drafts_test.cpp, as JSON ({} read as [])."""
    text = (PART / "drafts_test.cpp").read_text()
    m = re.search(rf"// twin:{name} \{{\n(.*?)\n\s*// twin:{name} \}}", text, re.S)
    assert m, f"drafts_test.cpp: no twin:{name} block"
    body = m.group(1).replace("{", "[").replace("}", "]")
    return json.loads("[" + re.sub(r",\s*$", "", body) + "]")


def rings(tokens: list[int], n_min: int, n_max: int, k: int, start: int) -> list[list[int]]:
    """drafts_test.cpp's rings(): the drafts of every ring of a session whose last stage draws `tokens`."""
    src, history, out = NgramDrafts(n_min, n_max), list(tokens[:start]), []
    while len(history) < len(tokens):
        d = src.propose(history, k)
        truth = tokens[len(history):]
        acc = 0
        while acc < len(d) and acc < len(truth) and d[acc] == truth[acc]:
            acc += 1
        src.observe(len(d), acc)
        out.append(d)
        history += truth[:acc + 1]
    return out


LOOKUPS = twin_block("lookups")
RINGS = twin_block("rings")
REFUSALS = twin_block("refusals")


@pytest.mark.parametrize("case", LOOKUPS, ids=[c[0] for c in LOOKUPS])
def test_a_new_source_proposes_the_cpp_tests_drafts(case):
    _, history, k, want = case
    assert NgramDrafts().propose(history, k) == want


@pytest.mark.parametrize("case", RINGS, ids=[c[0] for c in RINGS])
def test_a_session_drafts_the_cpp_tests_drafts_ring_by_ring(case):
    _, n_min, n_max, k, start, tokens, want = case
    assert any(want) and [] in want, "a case should both draft and back off"
    got = rings(tokens, n_min, n_max, k, start)
    first_diff = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    assert got == want, f"ring {first_diff}: {got[first_diff] if first_diff is not None else got}"


@pytest.mark.parametrize("case", REFUSALS, ids=[f"{c[0]}-{c[1]!r}" for c in REFUSALS])
def test_refusals_say_what_the_cpp_says(case):
    kind, arg, message = case
    calls = {"source": [lambda: check_source(arg), lambda: make_source(arg)],
             "k": [lambda: check_k(int(arg))],
             "ngram": [lambda: NgramDrafts(*map(int, arg.split()))]}[kind]
    for call in calls:
        with pytest.raises(WireError) as e:
            call()
        assert str(e.value) == message


def test_the_constants_are_the_same():
    header = (PART / "drafts.h").read_text()
    assert int(re.search(r"DEFAULT_DRAFT_K = (\d+);", header).group(1)) == drafts.DEFAULT_DRAFT_K
    assert int(re.search(r"MAX_DRAFT_K = (\d+);", header).group(1)) == drafts.MAX_DRAFT_K
    ngram = header[header.index("class NgramDrafts"):]
    assert int(re.search(r"MAX_PAUSE = (\d+);", ngram).group(1)) == NgramDrafts.MAX_PAUSE
    assert re.search(r"NgramDrafts\(int n_min = 2, int n_max = 4\)", header)
    assert (NgramDrafts().n_min, NgramDrafts().n_max) == (2, 4)
