"""Stop strings on one sequence's text stream: emit what is safe, hold back what might start a stop string."""
from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Cuts a streamed text before its first stop string, whatever chunks the text arrives in.

    "First" is the occurrence that completes first (smallest end; of those, the earliest start), so the
    stream stops as soon as any stop string has been generated, never waiting on a longer one that might
    still be completing. Where no stop string contains another, this is simply the earliest occurrence.
    """

    def __init__(self, stop: Sequence[str]):
        if isinstance(stop, str):
            raise ValueError("stop must be a sequence of strings, not one string")
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._stops = tuple(dict.fromkeys(stop))  # unique, in order
        # Every proper prefix of a stop string: a tail of the text equal to one of these is held back.
        self._prefixes = {s[:n] for s in self._stops for n in range(1, len(s))}
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Append text; return (text safe to emit now, whether a stop string has completed)."""
        if self._stopped:
            return "", True
        buf = self._held + text
        # The held tail holds no whole stop string, so anything found ends inside the new text.
        cut = None  # (end, start) of the first completed occurrence
        for s in self._stops:
            start = buf.find(s)
            if start >= 0 and (cut is None or (start + len(s), start) < cut):
                cut = (start + len(s), start)
        if cut is not None:
            self._held, self._stopped = "", True
            return buf[:cut[1]], True
        hold = self._tail_to_hold(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        """The held-back text, at the end of a stream in which no stop string completed."""
        held, self._held = self._held, ""
        return held

    def _tail_to_hold(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        for n in range(min(len(buf), self._max_hold), 0, -1):
            if buf[-n:] in self._prefixes:
                return n
        return 0
