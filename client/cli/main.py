"""The ``tierstore`` command line: argument parsing and printing only.

``tierstore daemon`` replaces this process with ``python -m tierstore.daemon`` (the
client never imports the daemon); the other subcommands talk to a running daemon
through ``tierstore.client``, except ``config``, which shows the settings a daemon
started here would use. Every error is one line on stderr that says what to do; a
closed pipe (``tierstore ls | head``) ends the command quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tierstore._version import __version__
from tierstore.config import ArgumentParser, ConfigError
from tierstore.errors import TierstoreError
from tierstore.units import format_size

from .statview import shown

__all__ = ["main", "build_parser"]

_SIGPIPE_STATUS = 141  # what a shell reports for a process killed by SIGPIPE, as `yes | head` gives

_WATCH_MOST_S = 86400.0
_WATCH_LEAST_S = 0.05
"""(a shorter interval would have ``stat --watch`` keep a core and the daemon busy)"""


def _interval(text: str) -> float:
    """``--watch SECONDS``: a finite number from 0.05 to a day."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not _WATCH_LEAST_S <= v <= _WATCH_MOST_S:
        raise argparse.ArgumentTypeError(f"must be from {_WATCH_LEAST_S} to {_WATCH_MOST_S:.0f} seconds, got {text}")
    return v

def _text(empty_ok: bool = False):
    """An argument as text the daemon can take: valid UTF-8 (a shell passes any bytes;
    Python keeps what is not UTF-8 as lone surrogates) and, unless ``empty_ok``, not empty
    (an empty ``--socket ""`` would otherwise mean the default)."""

    def check(text: str) -> str:
        if not text and not empty_ok:
            raise argparse.ArgumentTypeError("must not be empty")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise argparse.ArgumentTypeError(f"is not valid UTF-8: {text.encode('utf-8', 'surrogateescape')!r}") from None
        return text
    return check


def _socket_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", metavar="PATH", type=_text(), help="daemon socket (default: $TIERSTORE_SOCKET or the standard path)")


def _namespace_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", metavar="NS", type=_text(), help="namespace (job) to work in (default: 'default')")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="tierstore", description="Tiered tensor storage: one pool of GPU, pinned host and NVMe "
                       "memory per node, shared by every training process.")
    p.add_argument("--version", action="version", version=f"tierstore {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=ArgumentParser)
    sub.add_parser("version", help="print the version")
    sub.add_parser("daemon", help="run the node daemon in the foreground (tierstore daemon --help)", add_help=False)
    sub.add_parser("demo", help="train a small GPT with its optimizer state in the daemon (tierstore demo --help)",
                   add_help=False)
    cf = sub.add_parser("config", help="the settings a daemon started here would use, and where each comes from",
                        description="Show the effective value and source (default, file, env, flag) of every "
                        "setting, as `tierstore daemon` with the same flags would resolve them. Precedence: flags > "
                        "TIERSTORE_* variables > TOML file > defaults.")
    cf.add_argument("--json", action="store_true", help="machine-readable output")
    from tierstore.config import add_config_flags

    add_config_flags(cf)
    s = sub.add_parser("stat", help="tiers, namespaces, engine, prefetch counters of the running daemon")
    _socket_flag(s)
    s.add_argument("--json", action="store_true", help="machine-readable output (the stat() dict)")
    s.add_argument("--watch", type=_interval, metavar="SECONDS", help="redraw every SECONDS until interrupted")
    s.add_argument("--iterations", type=int, help=argparse.SUPPRESS)  # bounded --watch (tests)
    ls = sub.add_parser("ls", help="list the keyed objects of a namespace")
    _socket_flag(ls)
    _namespace_flag(ls)
    ls.add_argument("--prefix", default="", type=_text(empty_ok=True), help="only keys starting with this")
    ls.add_argument("--json", action="store_true", help="machine-readable output (info() of each object)")
    fr = sub.add_parser("free", help="free objects by key")
    _socket_flag(fr)
    _namespace_flag(fr)
    fr.add_argument("keys", nargs="+", metavar="KEY", type=_text(), help="keys to free")
    sn = sub.add_parser("snapshot", help="export a namespace as a Zarr v3 store (directory, .zip or URL)")
    _socket_flag(sn)
    sn.add_argument("namespace", type=_text(), help="namespace to export")
    sn.add_argument("dest", type=_text(), help="destination: a directory, a .zip file or a URL")
    sn.add_argument("--prefix", default="", type=_text(empty_ok=True), help="only keys starting with this")
    sn.add_argument("--sharded", action="store_true", help="NAMESPACE is a job: every JOB/... namespace on this "
                    "node goes to DEST (a shared directory), one Zarr store each, with an index")
    sn.add_argument("--node", type=_text(), help="this node's name in a sharded snapshot's index (default: the host name)")
    rs = sub.add_parser("restore", help="import a snapshot into a namespace")
    _socket_flag(rs)
    rs.add_argument("src", type=_text(), help="the snapshot: a directory, a .zip file or a URL")
    rs.add_argument("--namespace", metavar="NS", type=_text(), help="target namespace (default: the one the snapshot was taken "
                    "from)")
    rs.add_argument("--overwrite", action="store_true", help="replace keys the namespace already has")
    rs.add_argument("--sharded", action="store_true", help="SRC is a sharded snapshot: restore the namespaces its "
                    "index places on this node")
    rs.add_argument("--node", type=_text(), help="this node's name in the sharded snapshot's index (default: the host name)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["daemon"]:
        rc = _daemon_start_checks(argv[1:])
        if rc is not None:
            return rc
        # exec, not import: the client side never imports the daemon package
        os.execv(sys.executable, [sys.executable, "-m", "tierstore.daemon", *argv[1:]])
    try:
        if argv[:1] == ["demo"]:
            from .demo import main as demo_main

            return demo_main(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.cmd is None:
            parser.print_help()
            return 0
        if args.cmd == "version":
            print(f"tierstore {__version__}")
            return 0
        rc = _config_command(args) if args.cmd == "config" else _client_command(args)
        sys.stdout.flush()  # here, not at exit: a reader that went away is handled below
        return rc
    except ConfigError as e:
        print(f"tierstore: {_one_line(e)}; fix or unset it (tierstore config shows every setting and its source)",
              file=sys.stderr)
        return 2
    except TierstoreError as e:
        # (the client's advice is for Python callers; a command line has a flag for it)
        line = _one_line(e).replace("or pass autostart=True", "or pass --socket PATH")
        print(f"tierstore: {e.code}: {line}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"tierstore: {_one_line(e)}", file=sys.stderr)
        return 2
    except OSError as e:
        if isinstance(e, BrokenPipeError):
            return _quiet_broken_pipe()
        print(f"tierstore: {e.strerror or e}{': ' + e.filename if e.filename else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        for note in getattr(e, "__notes__", ()):  # (what an interrupted restore left, say)
            print(note, file=sys.stderr)
        return 130


def _daemon_start_checks(argv: list[str]) -> int | None:
    """The checks that can refuse a daemon start, run here before the exec: a refusal then
    costs one interpreter start, not two (the daemon runs them again; they take
    milliseconds). ``None``: go ahead."""
    from tierstore.config import daemon_parser, sourced_config_from_args
    from tierstore.preflight import check_daemon_start

    try:
        cfg, _ = sourced_config_from_args(daemon_parser().parse_args(argv))
    except ConfigError as e:
        print(f"tierstore daemon: invalid configuration: {_one_line(e)}; fix or unset it (tierstore config shows "
              "every setting and its source)", file=sys.stderr)
        return 2
    try:
        check_daemon_start(cfg)
    except (TierstoreError, OSError) as e:
        print(f"tierstore daemon: cannot start: {_one_line(e)}", file=sys.stderr)
        return 1
    return None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split("\n"))


def _quiet_broken_pipe() -> int:
    """The reader went away (``| head``): stop writing, and let nothing complain at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return _SIGPIPE_STATUS


def _config_command(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from tierstore.config import SECTIONS, describe_value, sourced_config_from_args

    cfg, sources = sourced_config_from_args(args)
    resolved = cfg.resolved()
    rows: dict[str, list[dict]] = {}
    for section in SECTIONS:
        for f in fields(getattr(cfg, section)):
            name, value = f.name, resolved.get(f.name)
            shown = describe_value(name, value)
            src = sources[name]
            if src == "default" and cfg.get(name) != value:
                src = "default (this machine)"
            if name == "nvme_bytes" and value is None:
                shown = "auto (64.0 GiB or the free space)"
            rows.setdefault(section, []).append({"name": name, "value": value, "shown": shown, "source": src})
    if args.json:
        print(json.dumps({section: {r["name"]: {"value": r["value"], "source": r["source"]} for r in section_rows}
                          for section, section_rows in rows.items()}, indent=2))
        return 0
    from tierstore.config import unknown_groups

    for name in unknown_groups(cfg.daemon.allowed_groups):
        print(f"tierstore: warning: allowed_groups names {name!r}, which this machine has no group of: a daemon "
              "started here refuses to start", file=sys.stderr)
    config_file = args.config or os.environ.get("TIERSTORE_CONFIG") or "(none)"
    print(f"tierstore {__version__} settings (precedence: flags > TIERSTORE_* variables > TOML file > defaults; "
          f"TOML file: {config_file})")
    for section, section_rows in rows.items():
        print(f"[{section}]")
        for r in section_rows:
            print(f"  {r['name']:22} {r['shown']:40} {r['source']}")
    return 0


def _client_command(args: argparse.Namespace) -> int:
    from .support import ANSWER_WITHIN_S, connect

    if args.cmd == "stat":
        from .statview import print_stat, watch

        if args.watch:
            return watch(lambda: connect(args.socket, "default", answer_within_s=ANSWER_WITHIN_S), args.watch,
                         as_json=args.json, iterations=args.iterations)
        with connect(args.socket, "default", answer_within_s=ANSWER_WITHIN_S) as c:
            st = c.stat(ops=args.json)
        if args.json:
            print(json.dumps(st, indent=2, default=str))
        else:
            print_stat(st)
        return 0
    if args.cmd == "ls":
        ns = args.namespace or "default"
        with connect(args.socket, ns, answer_within_s=ANSWER_WITHIN_S) as c:
            others = {} if args.namespace else {k: v for k, v in c.stat().get("namespaces", {}).items() if k != ns}
            if args.json:
                print(json.dumps(c.ls(prefix=args.prefix), indent=2))
            else:
                print(f"{'KEY':40} {'HANDLE':>14} {'DTYPE':>9} {'SHAPE':>16} {'SIZE':>10} {'TIERS':12} FLAGS")
                for r in c.iter_ls(prefix=args.prefix):  # a page at a time: any number of objects
                    flags = [f for f in ("durable", "ephemeral") if r.get(f)]
                    print(f"{shown(str(r['key'])):40} {r['handle']:>14} {r['dtype']:>9} {str(r['shape']):>16} "
                          f"{format_size(r['nbytes']):>10} {','.join(r['residency']):12} {','.join(flags)}")
        if others:
            first = sorted(others)[:5]
            more = f" and {len(others) - len(first)} more" if len(others) > len(first) else ""
            print(f"tierstore: listed namespace 'default'; the daemon also has {', '.join(map(shown, first))}{more} "
                  f"(tierstore ls --namespace NAME; tierstore stat lists them)", file=sys.stderr)
        return 0
    if args.cmd == "free":
        rc = 0
        ns = args.namespace or "default"
        with connect(args.socket, ns) as c:
            for k in args.keys:
                h = c.lookup(k)
                if h is None:
                    print(f"tierstore: no key {k!r} in namespace {ns!r}; tierstore ls --namespace {ns} lists them",
                          file=sys.stderr)
                    rc = 1
                    continue
                c.free(h)
                print(f"freed {k}")
        return rc
    if args.cmd in ("snapshot", "restore") and args.sharded:
        from .. import sharded

        def ns_client(ns):
            return connect(args.socket, ns)
        if args.cmd == "snapshot":
            doc = sharded.snapshot_job(ns_client, args.namespace, args.dest, node=args.node)
            for ns, e in doc["namespaces"].items():
                print(f"{ns}: {e['objects']} objects, {format_size(e['bytes'])} -> {e['store']}")
            print(f"node {doc['node']}: {len(doc['namespaces'])} namespaces of {doc['job']} -> {args.dest}")
        else:
            done = sharded.restore_job(ns_client, args.src, node=args.node, overwrite=args.overwrite)
            for ns, r in done.items():
                print(f"restored {r['objects']} objects, {format_size(r['bytes'])} into {ns}")
        return 0
    if args.cmd == "snapshot":
        with connect(args.socket, args.namespace) as c:
            r = c.snapshot(args.dest, prefix=args.prefix)
        print(f"snapshot of {args.namespace}: {r['objects']} objects, {format_size(r['bytes'])} in "
              f"{r['seconds']:.1f} s -> {args.dest}")
        if r["freed_meanwhile"]:
            print(f"{r['freed_meanwhile']} objects were freed while the snapshot ran, and are not in it",
                  file=sys.stderr)
        if not r["objects"]:  # (a mistyped namespace, most likely)
            print(f"warning: namespace {args.namespace!r} holds no objects{' under ' + repr(args.prefix) if args.prefix else ''}: "
                  "the snapshot is empty", file=sys.stderr)
        return 0
    if args.cmd == "restore":
        ns = args.namespace
        if ns is None:
            from tierstore.snapshot import snapshot_namespace

            ns = snapshot_namespace(args.src)  # the daemon refuses it if this uid may not enter it
        with connect(args.socket, ns) as c:
            r = c.restore(args.src, overwrite=args.overwrite)
        print(f"restored {r['objects']} objects, {format_size(r['bytes'])} into {ns} in {r['seconds']:.1f} s")
        return 0
    raise AssertionError(args.cmd)  # argparse only yields the commands above

