"""Draft sources for speculative decoding: what the origin proposes for the last stage to verify.

The origin (stage 0) asks its session's `DraftSource` for up to k tokens that may follow the history
(prompt + tokens so far), sends them with the last accepted token as one step of k+1 positions, and
tells the source how many the last stage accepted. A source that proposes nothing costs nothing: the
step is a plain one-position decode. `NgramDrafts` (prompt lookup) needs no model: it finds the latest
earlier occurrence of the history's last n tokens and proposes what followed them, which pays off on
text that restates its context (code to edit, quotes, lists). "mtp" drafts come from the model's own
MTP block on the route's last stage (a bundle built with `bundle.include_mtp = true`, DeepSeek V4): the
origin asks the last stage for them with each step (Step.mtp_drafts) and sends them back as the next
step's drafts, so there is no client-side object for it (`check_source` accepts the name; the route's
`has_mtp` decides).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dgr.core.errors import WireError

DEFAULT_DRAFT_K = 4
MAX_DRAFT_K = 16          # a speculative step is never split into frames: k+1 positions stay small
SOURCES = ("ngram", "mtp")


class DraftSource(Protocol):
    """One session's drafter at the origin."""

    name: str

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that may follow `history` (append-only between calls); [] for none."""
        ...

    def observe(self, drafted: int, accepted: int) -> None:
        """The last stage accepted `accepted` of the `drafted` tokens last proposed."""
        ...


class NgramDrafts:
    """Prompt lookup: match the history's last n tokens (n from `n_max` down to `n_min`) against an
    earlier occurrence and propose the tokens that followed it there.

    An index of every n-gram's latest end is kept incrementally (history is append-only), so a lookup
    is O(n_max) however long the history. Drafts that keep missing cost a (k+1)-position step for one
    token, so the source backs off: after a draft with nothing accepted it asks for a longer match
    (n_min + misses in a row, up to n_max) before drafting again, and once even n_max-grams keep missing
    it pauses (2, 4, 8 ... up to MAX_PAUSE plain steps) before trying again; one accepted draft resets both.
    Text that does not restate itself then pays for a draft now and then, not at every step."""

    MAX_PAUSE = 32

    name = "ngram"

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise WireError(f"ngram drafts: need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.seen = 0                    # history[:seen] is indexed (every n-gram ending before seen-1)
        self.misses = 0                  # drafts in a row with nothing accepted
        self.pause = 0                   # plain steps left before drafting again

    def _catch_up(self, history: Sequence[int]) -> None:
        # index n-grams ending at e for e < len(history): each has a continuation history[e]
        stop = len(history) - 1
        for e in range(max(self.seen, 1), stop + 1):
            for n, idx in self.index.items():
                if e >= n:
                    idx[tuple(history[e - n:e])] = e
        self.seen = max(self.seen, stop + 1)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(history) < self.n_min + 1:
            return []
        self._catch_up(history)
        if self.pause:
            self.pause -= 1
            return []
        n_least = min(self.n_max, self.n_min + self.misses)
        end = len(history)
        for n in range(self.n_max, n_least - 1, -1):
            e = self.index[n].get(tuple(history[end - n:end])) if end >= n else None
            if e is not None:
                return list(history[e:e + k])
        return []

    def observe(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        if accepted:
            self.misses = self.pause = 0
            return
        self.misses += 1
        beyond = self.misses - (self.n_max - self.n_min)   # misses with the longest match required
        if beyond > 0:
            self.pause = min(self.MAX_PAUSE, 2 ** beyond)


def check_source(name: str) -> str:
    """A draft source's name as the origin knows it (Generate.draft_source); unknown names: WireError saying
    which exist."""
    if name not in SOURCES:
        raise WireError(f"unknown draft source {name!r}: choose one of {', '.join(SOURCES)}")
    return name


def make_source(name: str) -> DraftSource:
    """The client-side twin of the origin's draft source `name` (the one the C++ origin runs, for tests that
    compare proposals). "mtp" has none: its drafts come from the last stage's MTP block."""
    if check_source(name) == "ngram":
        return NgramDrafts()
    raise WireError("the mtp draft source runs on the route's last stage (its MTP block), not in a client")


def check_k(k: int) -> int:
    """A draft count a route accepts: 1..MAX_DRAFT_K."""
    if not 1 <= k <= MAX_DRAFT_K:
        raise WireError(f"draft k must be in 1..{MAX_DRAFT_K} (positions verified per ring beyond the first), got {k}")
    return k


__all__ = ["DEFAULT_DRAFT_K", "MAX_DRAFT_K", "DraftSource", "NgramDrafts", "SOURCES", "check_k", "check_source", "make_source"]
