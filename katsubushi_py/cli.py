"""The ``katsubushi-py`` command: serve IDs (the default), or one of the subcommands in ``COMMANDS``.

    katsubushi-py --worker-id 1                 serve on 127.0.0.1:11212
    katsubushi-py health                        fetch one ID from the daemon these flags describe
    katsubushi-py decode ID...                  one JSON line per ID
    katsubushi-py id-at TIME                    the smallest ID at an instant (or now)
    katsubushi-py partitions --start DATE --days N   MySQL PARTITION BY RANGE COLUMNS(id)
    katsubushi-py get [-n N] [--servers ...]    fetch IDs from running daemons, one per line
    katsubushi-py help [COMMAND]                what each command takes

Every failure is one line on stderr and a non-zero exit: 2 for bad input or configuration, 1 when
the daemon cannot start or stops on an error (or, for ``get``, when no server could issue IDs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import __version__
from .config import (
    ConfigError,
    OneLineParser,
    ServerConfig,
    add_layout_options,
    build_parser,
    layout_from_args,
    listen_settings,
    merged_settings,
    parse_duration,
    parse_server_config,
)
from .ids.encodings import ENCODINGS
from .ids.layout import LayoutError
from .ids.tools import ToolError, decode_many, id_at, partitions
from .issuing.errors import GenerationError
from .issuing.generator import Generator
from .issuing.statefile import StateDirectory, StateFile

if TYPE_CHECKING:
    from .daemon.server import Listeners

PROG = "katsubushi-py"
# The widest pool `lease init` makes: 16 worker-id bits (the daemons' --worker-bits decides what they use).
MAX_POOL_ID = 65535


def _fail(message: str, status: int = 2) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return status


# -- tools -----------------------------------------------------------------------------------------
def _tool_parser(name: str, description: str) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=f"{PROG} {name}", description=description, allow_abbrev=False)
    add_layout_options(parser)
    return parser


def cmd_decode(argv: Sequence[str]) -> int:
    """Print time, worker id and sequence of IDs as JSON lines."""
    parser = _tool_parser("decode", "Print time, worker id and sequence of IDs as JSON lines.")
    parser.add_argument("ids", nargs="*", help="IDs to decode; read from stdin when none are given")
    parser.add_argument("--encoding", choices=list(ENCODINGS), default="dec", help="how the IDs are written")
    args = parser.parse_args(argv)
    layout = layout_from_args(args)
    inputs = args.ids if args.ids else sys.stdin
    status = 0
    for line, ok in decode_many(layout, inputs, args.encoding):
        if ok:
            print(line, flush=False)
        else:
            sys.stdout.flush()
            print(line, file=sys.stderr)
            status = 2
    return status


def cmd_id_at(argv: Sequence[str]) -> int:
    """Print the smallest ID of an instant: now, ISO-8601 or unix seconds."""
    parser = _tool_parser("id-at", "Print the smallest ID of an instant (worker 0, sequence 0).")
    parser.add_argument(
        "time",
        help="now, ISO-8601 (UTC when no offset is given: 2026-01-01T09:00+09:00) or unix seconds (1465276650.777)",
    )
    args = parser.parse_args(argv)
    layout = layout_from_args(args)
    try:
        if args.time.strip().lower() == "now":
            print(layout.compose(time.time_ns() // 1_000_000, 0, 0))
        else:
            print(id_at(layout, args.time))
    except (ToolError, LayoutError) as exc:
        return _fail(str(exc))
    return 0


def cmd_partitions(argv: Sequence[str]) -> int:
    """Print MySQL PARTITION BY RANGE COLUMNS(id), one partition per day."""
    parser = _tool_parser("partitions", "Print MySQL PARTITION BY RANGE COLUMNS(id), one partition per day.")
    parser.add_argument("--start", required=True, help="first day, e.g. 2026-01-01 or 2026-01-01T00:00+09:00")
    parser.add_argument("--days", type=int, default=7, help="number of daily partitions (default 7)")
    parser.add_argument("--table", help="emit ALTER TABLE <table> ... ")
    parser.add_argument("--column", default="id", help="the ID column (default id)")
    args = parser.parse_args(argv)
    layout = layout_from_args(args)
    try:
        print(partitions(layout, args.start, args.days, table=args.table, column=args.column))
    except (ToolError, LayoutError) as exc:
        return _fail(str(exc))
    return 0


# -- get -------------------------------------------------------------------------------------------
def cmd_get(argv: Sequence[str]) -> int:
    """Fetch IDs from running daemons (with failover), one per line."""
    from .client import DEFAULT_SERVERS, SERVERS_ENV, AllServersFailed, Client
    from .issuing.issuer import MAX_IDS_PER_REQUEST

    parser = OneLineParser(prog=f"{PROG} get", description="Fetch IDs from katsubushi daemons (with failover).")
    parser.add_argument("-n", type=int, default=1, help="how many IDs (default 1)")
    parser.add_argument(
        "--servers",
        nargs="+",
        default=None,
        help=f"host:port or unix:/path, in order of preference; commas work too (env {SERVERS_ENV};"
        f" default {DEFAULT_SERVERS[0]})",
    )
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds per request, all servers (default 2)")
    args = parser.parse_args(argv)
    if args.n < 1:
        return _fail("-n must be at least 1")
    servers = args.servers or os.environ.get(SERVERS_ENV) or DEFAULT_SERVERS
    try:
        client = Client(servers, timeout=args.timeout)
    except ValueError as exc:
        return _fail(str(exc))
    with client:
        left = args.n
        while left:
            batch = min(left, MAX_IDS_PER_REQUEST)
            try:
                ids = client.fetch_many(batch)
            except AllServersFailed as exc:
                sys.stdout.flush()
                return _fail(str(exc), 1)
            sys.stdout.write("".join(f"{id_}\n" for id_ in ids))
            left -= batch
    return 0


# -- serve -----------------------------------------------------------------------------------------
class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)s %(message)s", "%Y-%m-%dT%H:%M:%S")
        )
    root = logging.getLogger("katsubushi_py")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # What Python cannot raise anywhere (a non-ASCII TLS server name, in CPython's own callback) goes
    # to this log, not as a traceback on stderr past its format.
    from .daemon.refusals import install_unraisable_hook

    install_unraisable_hook()


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise ConfigError("--loop uvloop: uvloop is not installed") from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def _make_generator(config: ServerConfig, state_dir: StateDirectory | None) -> Generator:
    """The daemon's generator: for a static worker id with its (locked) state file; for a leased one
    fenced, until the lease keeper points it at a worker id and that id's state file."""
    if config.worker_id is None:
        assert config.lease is not None
        generator = Generator(
            config.lease.min_worker_id,
            config.layout,
            max_backwards_wait=config.max_clock_wait,
            block_on_clock=False,  # a clock wait must not stall the event loop
        )
        generator.set_fence(0, "waiting for a worker id lease")
        return generator
    state: StateFile | None = None
    if config.state_file:
        state = StateFile(config.state_file)
    elif state_dir is not None:
        state = state_dir.file_for(config.worker_id)
    return Generator(
        config.worker_id,
        config.layout,
        max_backwards_wait=config.max_clock_wait,
        state_file=state,
        block_on_clock=False,  # a clock wait must not stall the event loop
        allow_worker_id_change=config.state_file_new_worker_id,
    )


def run_server(config: ServerConfig, listeners: Listeners | None = None, ready: Any = None) -> int:
    """Run one daemon process until a signal; its exit status. ``listeners``: sockets made by the
    ``--workers`` supervisor; ``ready``: called with the daemon once it listens."""
    from .daemon.server import StartupError, serve

    setup_logging(config.log_level, config.log_format)
    log = logging.getLogger("katsubushi_py")
    factory = loop_factory(config.loop)
    state_dir = StateDirectory(config.state_dir) if config.state_dir else None
    if state_dir is None and config.state_file is None:
        log.warning(
            "--no-state-file: no state is kept, so a restart after the wall clock stepped back can reissue IDs,"
            " and nothing stops a second daemon of this host from issuing under the same worker id"
        )
    try:
        if state_dir is not None:
            state_dir.create()
        generator = _make_generator(config, state_dir)
    except GenerationError as exc:
        return _fail(str(exc), 1)
    claim = state_dir.claim if state_dir is not None and config.lease is not None else None
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(serve(config, generator, ready, claim_state=claim, listeners=listeners))
    except StartupError as exc:
        return _fail(str(exc), exc.status)
    except KeyboardInterrupt:  # a second Ctrl-C during the graceful stop
        pass
    finally:
        try:
            generator.close()
        except GenerationError as exc:
            log.error("could not store the final high-water mark: %s", exc)
    log.info("stopped")
    return 0


def _top_parser() -> argparse.ArgumentParser:
    """The daemon's parser, with a usage and help that also list the subcommands."""
    width = max(len(name) for name in COMMANDS) + 2
    lines = [f"  {name:<{width}}{_summary(func)}" for name, func in COMMANDS.items()]
    return build_parser(
        usage=f"{PROG} [--worker-id N | --worker-id-from ordinal|ip | --redis URL] [options]\n"
        f"       {PROG} COMMAND [options]      ({PROG} help COMMAND for its options)",
        description="Serve unique 64-bit IDs over the memcached protocol (GET a -> one ID).\n\n"
        "commands:\n" + "\n".join(lines),
    )


def _summary(func: Callable[[Sequence[str]], int]) -> str:
    return (func.__doc__ or "").strip().split("\n", 1)[0]


def run_workers(config: ServerConfig) -> int:
    """``--workers N``: a supervisor and N daemon processes (see katsubushi_py/daemon/workers.py)."""
    from .daemon.server import StartupError
    from .daemon.workers import Board, Supervisor, attach

    setup_logging(config.log_level, config.log_format)

    def run_child(child: ServerConfig, listeners: Listeners, board: Board, index: int) -> int:
        return run_server(child, listeners, lambda daemon: attach(daemon, board, index))

    try:
        return Supervisor(config, run_child).run()
    except StartupError as exc:
        return _fail(str(exc), 1)


def cmd_serve(argv: Sequence[str]) -> int:
    """Serve IDs (the default when no command is given)."""
    # A reload asked for while the daemon starts must not end it (katsubushi_py.entry does this before
    # the imports; again here for callers of this module's main).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    config, _ = parse_server_config(argv, os.environ, _top_parser())
    if config is None:
        print(f"{PROG} version: {__version__}")
        return 0
    return run_workers(config) if config.workers > 1 else run_server(config)


def cmd_health(argv: Sequence[str]) -> int:
    """Fetch one ID from the daemon that the same flags and environment describe; exit 0 or 1."""
    from .health import (
        HealthError,
        daemon_arguments,
        fetch_one_id,
        read_process,
        resolve_from_daemon,
        targets,
        tls_targets,
    )

    parser = build_parser(
        prog=f"{PROG} health",
        usage=f"{PROG} health [--pid PID | the daemon's flags] [--timeout DURATION]",
        description="Ask a running daemon for one ID, the way it was configured: give this command the\n"
        "daemon's own flags (or run it with the daemon's environment), or --pid to read both from the\n"
        "daemon's process. Prints one line; exit status 0 if every listener answered with an ID, else 1.",
    )
    group = parser.add_argument_group("health check")
    group.add_argument(
        "--pid",
        type=int,
        metavar="PID",
        help="read the daemon's flags and environment from /proc/PID (in a container: --pid 1)",
    )
    group.add_argument("--timeout", default="2s", metavar="DURATION", help="for each answer (default 2s)")
    try:
        args = parser.parse_args(list(argv))
        timeout = parse_duration(args.timeout, "timeout")
        pid = args.pid
        if pid is None:
            settings = merged_settings(args, os.environ)
            layout = layout_from_args(args)
        else:
            # Daemon flags that were given: those absent from a bare parse (argparse.SUPPRESS) or changed.
            defaults = vars(parser.parse_args([]))
            given = {k for k, v in vars(args).items() if k not in defaults or defaults[k] != v}
            if given - {"pid", "timeout"}:
                raise ConfigError("--pid reads the daemon's flags from its process; give no others")
            cmdline, environ = read_process(pid)
            daemon_args = build_parser().parse_args(daemon_arguments(cmdline, pid))
            settings = resolve_from_daemon(merged_settings(daemon_args, environ), pid)
            layout = layout_from_args(daemon_args)
        found, context = tls_targets(targets(*listen_settings(settings)), settings)
        login = health_login(settings.get("auth_file"))
        answers = []
        for target in found:
            parts = layout.decompose(fetch_one_id(target, timeout, login, None if target.path else context))
            answers.append(f"{target.display} issued {parts.id} (worker {parts.worker_id})")
    except (ConfigError, HealthError) as exc:
        print(f"{PROG} health: unhealthy: {exc}", file=sys.stderr)
        return 1  # Docker reserves exit status 2; every failure is "unhealthy"
    print(f"{PROG} health: ok: " + "; ".join(answers))
    return 0


def cmd_lease(argv: Sequence[str]) -> int:
    """Inspect or create the Redis pool of worker ids (init, stats, list)."""
    from .leasing import LeaseError, parse_redis_url
    from .leasing.keeper import init_pool
    from .leasing.pool import pool_snapshot, pool_stats

    parser = OneLineParser(prog=f"{PROG} lease", description="Inspect or create the Redis pool of worker ids.")
    sub = parser.add_subparsers(dest="action", required=True)
    for action, text in (
        (
            "init",
            "create the pool of worker ids MIN..MAX, serving at once (does nothing if it exists). Only for a"
            " namespace that is new, or whose daemons are all stopped: a pool that daemons create themselves"
            " waits out a lease ttl plus twice the clock skew first, in case Redis lost the one before",
        ),
        (
            "stats",
            "counts: ids in use, free and quarantined, data loss events, lease time left, outcomes, the pool's"
            " high-water mark (JSON)",
        ),
        ("list", "one JSON line per worker id: owner, time left, last millisecond, quarantined"),
    ):
        p = sub.add_parser(action, help=text, description=text)
        p.add_argument(
            "--redis",
            default=os.environ.get("REDIS") or os.environ.get("redis"),  # noqa: SIM112 - katsubushi reads both
            help="redis://HOST:PORT/DB?ns=NAME (env REDIS)",
        )
        if action == "init":
            p.add_argument("--min", type=int, default=1, help="lowest worker id (default 1)")
            p.add_argument(
                "--max",
                type=int,
                default=1023,
                help="highest worker id (default 1023; more with a wider --worker-bits on the daemons)",
            )
    args = parser.parse_args(argv)
    if not args.redis:
        return _fail("set --redis URL (or REDIS)")
    try:
        target = parse_redis_url(args.redis)
    except LeaseError as exc:
        return _fail(str(exc))

    async def run() -> list[str]:
        """What to print: written after Redis is done with, so that an error writing it (a closed
        pipe: ``lease list | head -1``) is not taken for a Redis error."""
        if args.action == "init":
            if not 0 <= args.min <= args.max <= MAX_POOL_ID:
                raise LeaseError(f"need 0 <= --min <= --max <= {MAX_POOL_ID}")
            added = await init_pool(target, args.min, args.max)
            if added:
                return [f"created worker id pool {args.min}..{args.max} in {target.display} ({added} ids)"]
            return [f"pool already exists in {target.display}; unchanged"]
        snapshot = await pool_snapshot(target)
        if args.action == "stats":
            return [json.dumps(pool_stats(snapshot), indent=2)]
        return [json.dumps(row, separators=(",", ":")) for row in snapshot["ids"]]

    try:
        lines = asyncio.run(run())
    except LeaseError as exc:
        return _fail(str(exc))
    except Exception as exc:  # the Redis client's connection and protocol errors
        return _fail(f"{target.display}: {exc}", 1)
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0


def cmd_help(argv: Sequence[str]) -> int:
    """Show what a command takes: help [COMMAND]."""
    if not argv:
        _top_parser().print_help()
        return 0
    name = argv[0]
    if name not in COMMANDS:
        return _fail(f"no command {name!r}; commands: {', '.join(COMMANDS)}")
    if name == "help":
        return cmd_help([])
    # The rest names a subcommand's action: `help lease init` is `lease init --help`.
    return COMMANDS[name]([*argv[1:], "--help"])


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "serve": cmd_serve,
    "health": cmd_health,
    "decode": cmd_decode,
    "id-at": cmd_id_at,
    "partitions": cmd_partitions,
    "lease": cmd_lease,
    "get": cmd_get,
    "help": cmd_help,
}


def health_login(auth_file: object) -> bytes:
    """With --auth-file, the health check logs in as the file's first user (a text login, noreply)."""
    if not auth_file:
        return b""
    from .auth.credentials import CredentialsError, first_user

    try:
        user, password = first_user(str(auth_file))
    except CredentialsError as exc:
        raise ConfigError(str(exc)) from None
    data = user + b" " + password
    return b"set health 0 0 %d noreply\r\n%b\r\n" % (len(data), data)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in COMMANDS:
        command, rest = COMMANDS[args[0]], args[1:]
    elif args and not args[0].startswith("-"):
        return _fail(f"unknown command {args[0]!r}; commands: {', '.join(COMMANDS)} (or options to serve)")
    else:
        command, rest = cmd_serve, args
    try:
        return command(rest)
    except SystemExit as exc:  # argparse after --help
        return exc.code if isinstance(exc.code, int) else 0
    except ConfigError as exc:
        return _fail(str(exc))
    except BrokenPipeError:
        # The reader went away (``| head -1``): not an error. Point stdout at /dev/null so that the
        # interpreter's final flush does not report the closed pipe again.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
