"""Who may talk to the daemon: peer credentials (SO_PEERCRED) checked on every accept.

Admitted: the daemon's own uid, root, and members of the configured groups (primary
or supplementary). Namespace ownership (one uid per namespace) is the store's
business; this module only answers "may this peer connect at all".
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
import time
from dataclasses import dataclass

__all__ = ["PeerCred", "peer_cred", "resolve_groups", "admitted"]

_UCRED = struct.Struct("3i")


@dataclass(slots=True, frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return PeerCred(pid, uid, gid)


def resolve_groups(names: list[str]) -> set[int]:
    """Group names or numeric gids to gids; unknown names raise ValueError."""
    gids = set()
    for n in names:
        if n.isdigit():
            gids.add(int(n))
            continue
        try:
            gids.add(grp.getgrnam(n).gr_gid)
        except KeyError:
            raise ValueError(f"allowed_groups: no group named {n!r}") from None
    return gids


_GROUPS_KEPT_S = 5.0
"""How long a uid's groups are kept once looked up: a process opening connections in a
tight loop costs the daemon no user-database lookup each (a membership change is seen
within this long)."""
_groups_cache: dict[tuple[int, int], tuple[float, frozenset[int]]] = {}


def _groups_of(uid: int, gid: int) -> frozenset[int]:
    now = time.monotonic()
    hit = _groups_cache.get((uid, gid))
    if hit is not None and now - hit[0] < _GROUPS_KEPT_S:
        return hit[1]
    try:
        groups = frozenset(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except KeyError:
        groups = frozenset({gid})
    if len(_groups_cache) >= 4096:
        _groups_cache.clear()
    _groups_cache[(uid, gid)] = (now, groups)
    return groups


def admitted(cred: PeerCred, allowed_gids: set[int], own_uid: int | None = None) -> bool:
    own = os.geteuid() if own_uid is None else own_uid
    if cred.uid in (own, 0):
        return True
    return bool(allowed_gids and _groups_of(cred.uid, cred.gid) & allowed_gids)
