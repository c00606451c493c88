"""Clients that keep asking daemons for IDs and record every reply, for the safety tests: the figure
that matters is how many IDs were issued twice, and it must be 0.

Each client is a thread with one connection to one daemon, sending ``GET`` of a few keys in a loop
(reconnecting when the daemon does not listen yet or restarts). Every reply is kept with the
monotonic times it was sent and received, so a test can also tell when a daemon stopped and resumed
serving, and which daemons issued under a worker id when.
"""

from __future__ import annotations

import itertools
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from conftest import Daemon, decode


@dataclass
class Reply:
    daemon: int  # index in Recorder.daemons
    sent: float  # time.monotonic()
    received: float
    ids: list[int]  # empty when the reply was an error
    error: bytes = b""


@dataclass
class Recorder:
    daemons: list[Daemon]
    clients_per_daemon: int = 2
    keys: int = 5
    replies: list[Reply] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    # -- running -------------------------------------------------------------------------------
    def start(self) -> Recorder:
        for index in range(len(self.daemons)):
            self._start_clients(index)
        return self

    def add(self, daemon: Daemon) -> int:
        """Start loading one more daemon (a restarted one, say); returns its index."""
        self.daemons.append(daemon)
        index = len(self.daemons) - 1
        self._start_clients(index)
        return index

    def _start_clients(self, index: int) -> None:
        for _ in range(self.clients_per_daemon):
            thread = threading.Thread(target=self._client, args=(index,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _client(self, index: int) -> None:
        daemon = self.daemons[index]
        request = b"GET " + b" ".join(b"k%d" % i for i in range(self.keys)) + b"\r\n"
        conn: socket.socket | None = None
        reader = None
        mine: list[Reply] = []
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = daemon.connect(timeout=5)
                    reader = conn.makefile("rb")
                assert reader is not None
                sent = time.monotonic()
                conn.sendall(request)
                ids: list[int] = []
                error = b""
                while True:
                    line = reader.readline()
                    if not line:
                        raise ConnectionError("closed")
                    if line.startswith(b"VALUE "):
                        ids.append(int(reader.readline()))
                    elif line == b"END\r\n":
                        break
                    else:
                        error = line.rstrip()
                        break
                mine.append(Reply(index, sent, time.monotonic(), ids, error))
                if error:
                    time.sleep(0.002)  # an error costs the daemon nothing; do not spin on it
            except (OSError, ValueError):
                if conn is not None:
                    conn.close()
                conn = reader = None
                time.sleep(0.02)
            if len(mine) >= 200:
                with self._lock:
                    self.replies.extend(mine)
                mine = []
        if conn is not None:
            conn.close()
        with self._lock:
            self.replies.extend(mine)

    # -- what happened -------------------------------------------------------------------------
    def ids(self) -> list[int]:
        return [i for r in self.replies for i in r.ids]

    def duplicates(self) -> int:
        """How many issued IDs had been issued before: the figure that must be 0."""
        every = self.ids()
        return len(every) - len(set(every))

    def served(self, daemon: int, after: float = 0.0, before: float = float("inf")) -> list[Reply]:
        """Successful replies of one daemon sent in [after, before), in time order."""
        return sorted(
            (r for r in self.replies if r.daemon == daemon and r.ids and after <= r.sent < before),
            key=lambda r: r.sent,
        )

    def errors(self, daemon: int, after: float = 0.0) -> list[Reply]:
        found = (r for r in self.replies if r.daemon == daemon and r.error and r.sent >= after)
        return sorted(found, key=lambda r: r.sent)

    def first_error(self, daemon: int, after: float) -> Reply | None:
        found = self.errors(daemon, after)
        return found[0] if found else None

    def resumed(self, daemon: int, after: float) -> Reply | None:
        """The first successful reply to a request sent after the daemon's first error (following
        ``after``) was received. Not after that error was *sent*: each client thread takes its time
        before it sends, so under load a request stamped later can reach the daemon earlier and be
        served before the fence went up; a request sent after an error came back cannot."""
        stopped = self.first_error(daemon, after)
        if stopped is None:
            return None
        served = self.served(daemon, stopped.received)
        return served[0] if served else None

    def holders(self) -> dict[int, dict[int, tuple[float, float]]]:
        """worker id -> daemon -> (first send, last receive) of its replies under that worker id."""
        spans: dict[int, dict[int, tuple[float, float]]] = {}
        for r in self.replies:
            for worker in {decode(i)[1] for i in r.ids}:
                per = spans.setdefault(worker, {})
                first, last = per.get(r.daemon, (r.sent, r.received))
                per[r.daemon] = (min(first, r.sent), max(last, r.received))
        return spans

    def overlapping_holders(self) -> list[tuple[int, int, int]]:
        """(worker id, daemon, daemon) for every two daemons whose spans under one worker id overlap in
        real time: no two daemons may issue under one worker id at the same time."""
        found = []
        for worker, per in self.holders().items():
            spans = sorted(per.items(), key=lambda item: item[1][0])
            for (a, (_, a_last)), (b, (b_first, _)) in itertools.pairwise(spans):
                if b_first < a_last:
                    found.append((worker, a, b))
        return found

    def summary(self) -> str:
        counts = Counter(r.daemon for r in self.replies if r.ids)
        # Errors by kind: their numbers (times, milliseconds) blanked out.
        errors = Counter(re.sub(rb"\d[\d:.TZ-]*", b"N", r.error).decode() for r in self.replies if r.error)
        return (
            f"{len(self.ids())} IDs, {self.duplicates()} duplicates; replies per daemon {dict(counts)};"
            f" errors {dict(errors)}"
        )
