"""Stop strings over streamed text: cut before the first stop, never print it, even when it spans tokens.

Text that might be the start of a stop string is held back until the next piece settles it; at the end
of a generation that did not stop, the held text is released.
"""

from __future__ import annotations


class StopScanner:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that can be printed now (after a stop: nothing, ever)."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self.pending = True, ""
            return buf[:cut]
        hold = self._held(buf)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def _held(self, buf: str) -> int:
        """Length of the longest tail of `buf` that begins some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if s.startswith(buf[-k:]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """At the end of a generation that did not stop: the text held back."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
