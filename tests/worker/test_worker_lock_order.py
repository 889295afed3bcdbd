"""docs/worker.md, "Locks and their order", is every lock of dgr-worker (worker/server/): each mutex declared
there has a row in the section's table, under the class (or function) and in the file the row names, and each
row names a mutex that is declared. The order the section lists (`A` → `B`, outer first) names only locks of
the table and has no cycle; a lock it calls a leaf is never the outer one of a pair, and every lock is one or
the other. Every `file:function` or `file:line` it cites names a function of that file of worker/server/, or
a line it has.

So a new mutex without a row, a row whose mutex was removed, renamed or moved, or a citation of a function
that is gone fails here. What each row says (what the lock guards, who takes it while holding what) is read
from the code by a person; this keeps the list whole and its pointers live (cheaply: no build)."""
from __future__ import annotations

import re
from pathlib import Path

from support.paths import REPO

SERVER = REPO / "worker" / "server"
DOC = REPO / "docs" / "worker.md"
SECTION = "Locks and their order"

# Comments, string and character literals (raw strings first), preprocessor lines: blanked before scanning,
# so a brace or a `std::mutex` inside one counts for nothing. Newlines are kept (line numbers stay).
LEXEMES = re.compile(r'R"([^(\s]*)\(.*?\)\1"|//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|'
                     r"^[ \t]*#(?:\\\n|[^\n])*", re.S | re.M)
MUTEX = (r"(?:std::(?:recursive_|timed_|recursive_timed_|shared_|shared_timed_)?mutex|absl::Mutex|"
         r"grpc::internal::Mutex|gpr_mu)")
# a declaration: `std::mutex mu_;`, `mutable std::mutex mu_;`, `static std::mutex m{};` (the head before `;`/`{`)
DECL = re.compile(r"(?:^|[\s;{}])(?:(?:mutable|static|inline|thread_local)\s+)*" + MUTEX + r"\s+(\w+)\s*$")
KEYWORDS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype", "alignof", "static_assert",
            "noexcept", "new", "delete"}
CLASS = re.compile(r"^(?:template\s*<.*>\s*)?(?:class|struct|union)\s+([A-Za-z_]\w*(?:::[A-Za-z_]\w*)*)\s*"
                   r"(?:final\s*)?(?::(?!:).*)?$", re.S)
CALLED = re.compile(r"([A-Za-z_~]\w*(?:::[A-Za-z_~]\w*)*)\s*\(")
ENDS_LIKE_FUNCTION = re.compile(r"\)\s*(?:const|override|final|noexcept|mutable|volatile|&&?|\s)*"
                                r"(?:->\s*[\w:<>,\s*&]+)?$")


def strip(text: str) -> str:
    return LEXEMES.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def scope_of(head: str) -> tuple[str, str]:
    """What a `{` opens, from the text before it: ("class", name), ("function", name) or ("block", "")
    (a namespace, a control statement, a lambda, an initializer)."""
    head = " ".join(head.split())
    head = re.sub(r"^(?:(?:public|private|protected)\s*:\s*)+", "", head)
    if m := CLASS.match(head):
        return "class", m.group(1)
    if ENDS_LIKE_FUNCTION.search(head):
        for m in CALLED.finditer(head):
            name = m.group(1)
            if name.split("::")[-1] not in KEYWORDS:
                return "function", name
            break
    return "block", ""


def owner(stack: list[tuple[str, str]]) -> str:
    """The innermost class (with the classes around it) or function around a declaration."""
    classes: list[str] = []                          # innermost last
    for kind, name in reversed(stack):
        if kind == "class":
            classes.insert(0, name)
        elif classes:                                # the classes end at a function or a block around them
            break
        elif kind == "function":
            return name
    return "::".join(classes)


def declared_mutexes(text: str) -> list[str]:
    """`Owner::name` of every mutex declared in C++ source `text` (a member: its class; a local: its function)."""
    code = strip(text)
    stack: list[tuple[str, str]] = []
    depths: list[int] = []                           # the parentheses open around each open brace
    depth = 0                                        # parentheses open in the current braces
    found: list[str] = []
    last = 0
    for m in re.finditer(r"[{};()]", code):
        c = m.group(0)
        if c in "()":
            depth += 1 if c == "(" else -1
            continue
        if c == ";" and depth > 0:                   # `for (;;)`, `if (init; cond)`: not a statement's end
            continue
        head = code[last:m.start()]
        if c in ";{" and (d := DECL.search(head)):
            found.append(f"{owner(stack)}::{d.group(1)}" if owner(stack) else d.group(1))
        if c == "{":
            stack.append(scope_of(head))
            depths.append(depth)
            depth = 0
        elif c == "}":
            assert stack, f"unbalanced braces at offset {m.start()}"
            stack.pop()
            depth = depths.pop()
        last = m.end()
    assert not stack and depth == 0, "unbalanced braces or parentheses at the end"
    return found


def code_locks(root: Path = SERVER) -> set[tuple[str, str]]:
    """(Owner::name, path from the repository) of every mutex declared in worker/server/ and its parts'
    folders (*.h, *.cpp; not the parts' *_test.cpp)."""
    out = set()
    for p in sorted(q for q in [*root.rglob("*.h"), *root.rglob("*.cpp")] if not q.name.endswith("_test.cpp")):
        for name in declared_mutexes(p.read_text()):
            out.add((name, p.relative_to(REPO).as_posix() if p.is_relative_to(REPO) else p.name))
    return out


def section(doc: str) -> str:
    m = re.search(rf"^## {re.escape(SECTION)}\n(.*?)(?=^## |\Z)", doc, re.M | re.S)
    assert m, f'docs/worker.md has no "## {SECTION}" section'
    return m.group(1)


def table_rows(sec: str) -> list[tuple[str, str, str]]:
    """(lock, file, owner cell) of each row of the section's first table."""
    rows = []
    lines = [line for line in sec.splitlines() if line.startswith("|")]
    for line in lines[2:]:                           # after the header and its |---| line
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        lock = re.findall(r"`([^`]+)`", cells[0])
        path = re.findall(r"`(worker/server/[^`]+)`", cells[1]) if len(cells) > 1 else []
        rows.append((lock[0] if lock else cells[0], path[0] if path else "", cells[1] if len(cells) > 1 else ""))
    return rows


def mismatch(code: set[tuple[str, str]], rows: list[tuple[str, str, str]]) -> tuple[list, list]:
    """(declared mutexes without a row, rows without a declared mutex)."""
    listed = {(lock, path) for lock, path, _ in rows}
    return sorted(code - listed), sorted(listed - code)


def order_pairs(sec: str) -> list[tuple[str, str]]:
    """(outer, inner) for each step of each `- `A` → `B` → ...` line."""
    pairs = []
    for line in sec.splitlines():
        if line.startswith("- ") and "→" in line:
            steps = [re.findall(r"`([^`]+)`", part) for part in line.split("→")]
            for outer, inner in zip(steps, steps[1:]):
                pairs += [(a, b) for a in outer[-1:] for b in inner]
    return pairs


def leaves(sec: str) -> list[str]:
    """The locks of the paragraph that opens with "Leaves:"."""
    m = re.search(r"^Leaves:(.*?)(?:\n\s*\n|\Z)", sec, re.M | re.S)
    return re.findall(r"`([^`]+)`", m.group(1)) if m else []


def cycle(pairs: list[tuple[str, str]]) -> list[str]:
    graph: dict[str, set[str]] = {}
    for a, b in pairs:
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> list[str]:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path + [n, m]
            if not state.get(m) and (c := visit(m, path + [n])):
                return c
        state[n] = 2
        return []

    for n in sorted(graph):
        if not state.get(n) and (c := visit(n, [])):
            return c
    return []


def bad_citations(sec: str, root: Path = SERVER) -> list[str]:
    """`file:function` / `file:line` citations (`part/file:...` for a part's folder) whose file is not in worker/server/, whose function the file
    does not define or call, or whose line it does not have."""
    bad = []
    for file, target in re.findall(r"`((?:\w+/)?[\w.]+\.(?:cpp|h)):([A-Za-z_~][\w:~]*|\d+)`", sec):
        p = root / file
        if not p.is_file():
            bad.append(f"{file}:{target} (no such file)")
        elif target.isdigit():
            if not 1 <= int(target) <= len(p.read_text().splitlines()):
                bad.append(f"{file}:{target} (no such line)")
        elif not re.search(rf"(?<![\w]){re.escape(target.split('::')[-1])}\s*\(", strip(p.read_text())):
            bad.append(f"{file}:{target} (no such function)")
    return bad


def test_every_mutex_of_the_worker_has_a_row_and_every_row_a_mutex() -> None:
    code = code_locks()
    assert len(code) >= 10, f"the scan found too few mutexes to be right: {sorted(code)}"
    rows = table_rows(section(DOC.read_text()))
    missing, stale = mismatch(code, rows)
    assert not missing, (f"docs/worker.md \"{SECTION}\" has no row for {missing}: add one (what it guards, what "
                         "is held when it is taken, whether it is a leaf) and its place in the order")
    assert not stale, f"docs/worker.md \"{SECTION}\" has rows for locks that are not declared there: {stale}"
    for lock, path, cell in rows:
        assert f"`{lock.rsplit('::', 1)[0]}`" in cell, f"the row of {lock} does not name its owner in its owner cell"


def test_the_order_names_locks_of_the_table_has_no_cycle_and_every_lock_is_placed() -> None:
    sec = section(DOC.read_text())
    locks = {lock for lock, _, _ in table_rows(sec)}
    pairs = order_pairs(sec)
    assert pairs, "the section lists no order (`A` → `B` lines)"
    assert leaves(sec), "the section names no leaves (a paragraph opening with \"Leaves:\")"
    named = {n for pair in pairs for n in pair} | set(leaves(sec))
    assert not named - locks, f"the order names locks the table has not: {sorted(named - locks)}"
    assert not cycle(pairs), f"the order has a cycle: {' → '.join(cycle(pairs))}"
    outer = {a for a, _ in pairs}
    assert not outer & set(leaves(sec)), f"leaves taken with another lock inside: {sorted(outer & set(leaves(sec)))}"
    unplaced = locks - outer - set(leaves(sec))
    assert not unplaced, f"neither a leaf nor the outer lock of a pair in the order: {sorted(unplaced)}"


def test_every_citation_names_a_function_or_line_of_the_worker() -> None:
    sec = section(DOC.read_text())
    assert re.search(r"`[\w.]+\.(?:cpp|h):\w+`", sec), "the section cites no `file:function`"
    assert not bad_citations(sec), bad_citations(sec)


# The checks themselves: a snippet with what the scan must tell apart, and the doc with a row taken out
SNIPPET = """
#include <mutex>
#define NOT_A_SCOPE(x) { x; }
namespace dgr {
struct Counts { std::mutex mu; int n = 0; };        // a member
class Outer final : public Base {
  public:
    void f() { std::lock_guard<std::mutex> g(mu_); const char * s = "{ std::mutex fake; "; char c = '{'; }
  private:
    struct Inner { mutable std::mutex m_; };         /* std::mutex not_this; { */
    std::mutex mu_;
};
class Outer::Later { std::recursive_mutex r_; };
void serve(int x) {
    auto lambda = [&](int y) { return y; };
    if (x) { std::mutex local; }
    if (int y = x; y > 0) { std::mutex in_if; }
    for (;;) { break; }
    std::thread([&] { std::mutex in_lambda; x++; }).detach();
}
}  // namespace dgr
"""


def test_the_scan_finds_members_locals_and_nested_classes_and_nothing_in_comments_or_strings() -> None:
    assert sorted(declared_mutexes(SNIPPET)) == sorted(
        ["Counts::mu", "Outer::Inner::m_", "Outer::mu_", "Outer::Later::r_", "serve::local", "serve::in_if",
         "serve::in_lambda"])


def test_the_check_fails_when_a_mutex_has_no_row_or_a_row_no_mutex() -> None:
    doc = DOC.read_text()
    sec = section(doc)
    rows = table_rows(sec)
    code = code_locks()
    assert mismatch(code, rows) == ([], [])
    gone = next(r for r in rows if r[0] == "Link::mu_")
    assert mismatch(code, [r for r in rows if r != gone]) == ([("Link::mu_", "worker/server/link.h")], [])
    new = ("StageWorker::other_mu_", "worker/server/worker.h")
    assert mismatch(code | {new}, rows) == ([new], [])
    assert mismatch(code - {("Link::mu_", "worker/server/link.h")}, rows) == (
        [], [("Link::mu_", "worker/server/link.h")])
    assert cycle([("a", "b"), ("b", "c"), ("c", "a")]) and not cycle([("a", "b"), ("a", "c"), ("b", "c")])
    assert bad_citations("`link.cpp:cancel_locked` `link.cpp:no_such_thing` `nope.cpp:f` `link.cpp:99999`") == [
        "link.cpp:no_such_thing (no such function)", "nope.cpp:f (no such file)", "link.cpp:99999 (no such line)"]
    assert bad_citations("`ring/link_table.h:prune` `ring/link_table.h:no_such_thing` `ring/nope.h:f`") == [
        "ring/link_table.h:no_such_thing (no such function)", "ring/nope.h:f (no such file)"]
