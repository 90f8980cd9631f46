"""The offloaded optimizer's progress record and torn-step marker, and what reads them
back: resume and rewind.

The progress record, ``PREFIX/_progress``, is one object: the completed steps, then
(group, index, current version) of each parameter with state. It is written last in
a step, after every parameter, so it names one consistent set of versions; with two
versions kept, the record it replaces is kept first as ``PREFIX/_progress.prev``
(``rewind``). Single-version state is updated in place, so a marker object,
``PREFIX/_torn``, lies in the pool from a step's first update to its record: a resume
that finds it refuses with ``TornState``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from tierstore.errors import TierstoreError

from .state import Key, StateTensors

__all__ = ["Progress", "TornState"]

log = logging.getLogger(__name__)


_NO_STATE = [-1, -1, -1]
"""The progress record's one triple when no parameter has state (so it is not read as
the older record of the step count alone)."""


class TornState(TierstoreError):
    """A resume found single-version optimizer state that a process stopped updating in
    the middle of a step (``crash_consistent=False``): it cannot continue from it."""

    code = "TornState"


class Progress:
    """Completed steps, the progress records in the pool and the torn-step marker."""

    def __init__(self, states: StateTensors) -> None:
        self.states = states
        self.completed = 0
        """Optimizer steps completed (and, after a resume, recovered from the pool)."""
        self._last_record: list[int] | None = None  # the progress record last written or resumed from
        self._torn_marked = False  # single-version: the torn-step marker is in the pool

    @property
    def _record_key(self) -> str:
        return f"{self.states.prefix}/_progress"

    @property
    def _prev_key(self) -> str:
        return f"{self.states.prefix}/_progress.prev"

    @property
    def _torn_key(self) -> str:
        return f"{self.states.prefix}/_torn"

    def cleared(self) -> None:
        """The objects under the prefix were freed: the torn-step marker with them."""
        self._torn_marked = False

    def forget(self) -> None:
        """Free the progress records and the torn-step marker, so that a resume finds no
        state to take up until the next ``write`` (before the state is replaced in place)."""
        for key in (self._record_key, self._prev_key, self._torn_key):
            h = self.states.store.lookup(key)
            if h is not None:
                self.states.store.free(h)
        self._torn_marked = False
        self._last_record = None

    def write(self, keep_previous: bool = False) -> None:
        """The progress record: [completed steps, then (group, index, current version) per
        parameter with state; with none, the one triple ``_NO_STATE``]. One put, so it names
        one consistent set of versions (a record of the step count alone is an older
        format's, every parameter at the step's parity).
        ``keep_previous`` (a step's end, two versions kept): the record it replaces is kept
        first as the previous one, whose versions the step left intact (``rewind``)."""
        rec = [self.completed]
        for (gi, pi), v in sorted(self.states.cur.items()):
            if self.states.layout.get((gi, pi)):
                rec += [gi, pi, v]
        if len(rec) == 1:
            rec += _NO_STATE
        if keep_previous and self.states.versions == 2 and self._last_record is not None:
            # before the new record: a crash between the two leaves both naming the old step
            self.states.store.put(torch.tensor(self._last_record, dtype=torch.int64), key=self._prev_key,
                                  replace=True, durable=self.states.durable)
        self.states.store.put(torch.tensor(rec, dtype=torch.int64), key=self._record_key, replace=True,
                              durable=self.states.durable)
        self._last_record = rec

    def begin_updates(self) -> None:
        """Before a step's first update. Single-version state is updated in place, so from
        here until the step's progress record a process that dies leaves a torn state: a
        marker object says so to a resume."""
        if self.states.versions == 1 and not self._torn_marked:
            self.states.store.put(torch.tensor([self.completed + 1], dtype=torch.int64), key=self._torn_key,
                                  replace=True, durable=self.states.durable)
            self._torn_marked = True

    def complete(self, updated: set[Key], fresh: set[Key]) -> None:
        """A step's end: the versions it wrote (of the parameters ``updated``; ``fresh``: those
        whose state it made) become current, and the progress record says so."""
        states = self.states
        for key in updated:
            if not states.layout.get(key):  # no state kept (a rule without any): nothing to name
                continue
            if key in fresh or states.versions == 1:  # made this step (both versions equal), or in place
                states.cur[key] = (self.completed + 1) % 2 if states.versions == 2 else 0
            else:
                states.cur[key] = 1 - states.cur.get(key, 0)
        self.completed += 1
        self.write(keep_previous=True)
        if self._torn_marked:  # the progress record names a whole step again: nothing is torn
            h = states.store.lookup(self._torn_key)
            if h is not None:
                states.store.free(h)
            self._torn_marked = False

    def _read(self, key: str) -> list[int] | None:
        h = self.states.store.lookup(key)
        return None if h is None else [int(x) for x in self.states.store.get(h).reshape(-1).tolist()]

    def resume(self, param_groups: list[dict[str, Any]] | None = None,
               needs_master: Callable[[torch.Tensor], bool] | None = None) -> bool:
        """Take up the state under the prefix (layout and current versions); False when there
        is none to take up. With ``param_groups`` (and ``needs_master``), a parameter whose
        state is there in part is refused (``_incomplete``)."""
        states = self.states
        rec = self._read(self._record_key)
        if rec is None:
            left = [k for k in states.store.keys(states.prefix + "/") if k.rsplit("/", 1)[-1] != "_owner"]
            if left:  # state without a record: an overwriting restore or a first step cut short
                log.warning("resume: no progress record under %r, but %d other objects are there (a restore or "
                            "the first step stopped part-way?): they are not resumed; starting fresh",
                            states.prefix, len(left))
            else:
                log.info("resume: no progress record under %r (nothing to resume yet, or another namespace or "
                         "prefix than the run's); starting fresh", states.prefix)
            return False
        self.completed = rec[0]
        self._last_record = rec
        if states.store.lookup(self._torn_key) is not None:
            raise TornState(
                f"the optimizer state under {states.prefix!r} was being updated in place (crash_consistent=False) "
                f"when its process stopped during step {self.completed + 1}: some parameters hold that step's "
                f"state, others step {self.completed}'s. Load a checkpoint (load_state_dict) or start afresh "
                "(resume=False); crash_consistent=True keeps state a killed process resumes from")
        if (len(rec) - 1) % 3:
            raise ValueError(f"the progress record under {states.prefix!r} is malformed ({len(rec)} numbers); "
                             "was this prefix written by something else?")
        named = {(rec[i], rec[i + 1]): rec[i + 2] for i in range(1, len(rec), 3)}
        legacy = len(rec) == 1  # a record of the step count only: every version is the step's parity
        for k in states.store.keys(prefix=states.prefix + "/"):
            rest = k[len(states.prefix) + 1:]
            if rest.startswith("_") or "@" not in rest:
                continue
            idx, name = rest.split("/", 1)
            gi, pi = (int(x) for x in idx.split("."))
            if not legacy and (gi, pi) not in named:
                continue  # first written by a step that did not complete: not part of the resumed state
            name = name.rsplit("@", 1)[0]
            name, _, tag = name.partition("#")
            states.layout.setdefault((gi, pi), {})[name] = tag or "tensor"
        lost = sorted(key for key in named if key not in states.layout and min(key) >= 0)  # not _NO_STATE
        if lost:
            raise ValueError(
                f"the progress record under {states.prefix!r} (step {self.completed}) names the state of {len(lost)} "
                f"parameter(s) that the pool does not hold (e.g. parameter {lost[0][0]}.{lost[0][1]}): freed, or "
                "lost with a daemon that stopped while the state was volatile (durable=False); load a checkpoint "
                "(load_state_dict) or start afresh (resume=False)")
        if param_groups is not None:
            self._incomplete(param_groups, needs_master, [k for k in named if k in states.layout])
        states.cur = {key: (self.completed % 2 if legacy else named[key]) for key in states.layout}
        self._settle_versions()
        self._hold_durably()
        log.info("resumed %d parameters' optimizer state at step %d", len(states.layout), self.completed)
        return True

    def _incomplete(self, param_groups: list[dict[str, Any]], needs_master: Callable[[torch.Tensor], bool] | None,
                    keys: list[Key]) -> None:
        """``ValueError`` where a parameter the record names holds only part of its state:
        no fp32 master where this optimizer keeps one, or fewer state names than another
        parameter of the same group, shape and dtype (a rule's state depends on those, not
        on which parameter it is) — objects freed by hand, or lost."""
        states = self.states
        names: dict[tuple, set[str]] = {}
        for gi, pi in keys:
            if gi >= len(param_groups) or pi >= len(param_groups[gi]["params"]):
                continue  # (the groups differ from the run's: the state's own checks speak of that)
            p = param_groups[gi]["params"][pi]
            have = set(states.layout[(gi, pi)])
            if needs_master is not None and needs_master(p) and "master" not in have:
                raise ValueError(
                    f"the optimizer state under {states.prefix!r} (step {self.completed}) has no fp32 master for "
                    f"parameter {gi}.{pi}, which this optimizer keeps one for (freed, or the state was written with "
                    "master_weights=False): load a checkpoint (load_state_dict) or start afresh (resume=False)")
            names.setdefault((gi, tuple(p.shape), p.dtype), set()).update(have - {"master"})
        for gi, pi in keys:
            if gi >= len(param_groups) or pi >= len(param_groups[gi]["params"]):
                continue
            p = param_groups[gi]["params"][pi]
            missing = names[(gi, tuple(p.shape), p.dtype)] - set(states.layout[(gi, pi)])
            if missing:
                raise ValueError(
                    f"the optimizer state under {states.prefix!r} (step {self.completed}) of parameter {gi}.{pi} "
                    f"lacks {sorted(missing)}, which the group's other parameters of its shape have (freed, or "
                    "lost): load a checkpoint (load_state_dict) or start afresh (resume=False)")

    def _hold_durably(self) -> None:
        """After a resume with ``durable=True``, state put volatile before (a job that ran with
        ``durable=False``) is put again durable: check-ins write an object through only if it
        is durable, so it would not survive a daemon crash otherwise."""
        states = self.states
        if not states.durable:
            return
        volatile = [e["key"] for e in states.store.ls(states.prefix + "/") if not e.get("durable")]
        for key in volatile:
            h = states.store.lookup(key)
            if h is not None:
                states.put(key, states.store.get(h))
        if volatile:
            log.info("resume: %d objects under %r put again durable", len(volatile), states.prefix)

    def _settle_versions(self) -> None:
        """After a resume, keep the versions this optimizer keeps, whatever kept the state
        before: a second version is made where there is one alone, and single-version state
        moves to version 0 with the other freed. The progress record is rewritten before
        anything it names is freed."""
        states = self.states
        moved, extra = [], []
        for (gi, pi), layout in states.layout.items():
            cur = states.cur[(gi, pi)]
            for name in layout:
                here, other = states.lookup(gi, pi, name, cur), states.lookup(gi, pi, name, 1 - cur)
                if here is None:
                    raise ValueError(f"the progress record under {states.prefix!r} names version {cur} of "
                                     f"{states.key(gi, pi, name, cur)}, which the pool does not hold")
                if states.versions == 2 and other is None:
                    states.put(states.key(gi, pi, name, 1 - cur), states.store.get(here))
                elif states.versions == 1 and cur != 0:
                    states.put(states.key(gi, pi, name, 0), states.store.get(here))
                    extra.append(states.key(gi, pi, name, 1))
                    moved.append((gi, pi))
                elif states.versions == 1 and other is not None:
                    extra.append(states.key(gi, pi, name, 1))
        for key in moved:
            states.cur[key] = 0
        if moved:
            self.write()
        for k in extra:
            states.free_key(k)

    def rewind(self, step: int) -> None:
        """Go back to the state after ``step``, the step before the last completed one (see
        ``OffloadedOptimizer.rewind_to``); the parameters are the caller's to restore."""
        states = self.states
        if step != self.completed - 1:
            raise ValueError(f"can go back one step only, from {self.completed} to {self.completed - 1}, "
                             f"not to {step}; restore a checkpoint instead")
        rec = self._read(self._prev_key) if states.versions == 2 else None
        if rec is None or rec[0] != step:
            raise ValueError(f"the state of step {step} is not kept under {states.prefix!r} (it is with "
                             "crash_consistent=True, for the step before the last); restore a checkpoint instead")
        named = {(rec[i], rec[i + 1]): rec[i + 2] for i in range(1, len(rec), 3)}
        for key in list(states.layout):
            if key in named:
                continue
            if "master" in states.layout[key]:  # the step wrote its first state over the value before
                raise ValueError(f"parameter {key[0]}.{key[1]} got its state and fp32 master in step "
                                 f"{self.completed}, so its value before that step is not kept; restore a "
                                 "checkpoint instead")
        for key in list(states.layout):
            if key not in named:  # first met in the step undone: it has no state before it
                del states.layout[key]
        states.cur = {key: named[key] for key in states.layout}
        self.completed = step
