"""Log lines that a uid's connections cause, limited per uid: a client looping on
errors (admitted or refused) does not fill the log or slow the loop writing it; the next
line that is written says how many of that uid's were left out. Used on the event loop
only."""

from __future__ import annotations

import time

__all__ = ["UidLines"]

_MOST_UIDS = 4096
"""Uids remembered at once (a flood of uids forgets them all, and starts counting anew)."""


class UidLines:
    """At most ``per_s`` lines a second for each uid."""

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self._seen: dict[int, list] = {}
        """uid -> [when its current second began, lines written in it, lines left out since its last]"""

    def allow(self, uid: int) -> int | None:
        """None: leave this line out; else how many of the uid's were left out since its last."""
        now = time.monotonic()
        st = self._seen.get(uid)
        if st is None or now - st[0] >= 1.0:
            if st is None and len(self._seen) >= _MOST_UIDS:
                self._seen.clear()
            self._seen[uid] = [now, 1, 0]
            return st[2] if st is not None else 0
        if st[1] < self.per_s:
            st[1] += 1
            quiet, st[2] = st[2], 0
            return quiet
        st[2] += 1
        return None

    @staticmethod
    def left_out(quiet: int) -> str:
        """The words a line adds for the lines left out before it."""
        return f" (and {quiet} more of this uid's left out)" if quiet else ""
