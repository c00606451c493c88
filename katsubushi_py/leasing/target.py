"""Where a pool of worker ids lives: the Redis URL (one Redis, a Redis Cluster's seed nodes, or the
sentinels that name a master), the namespace and its keys. :mod:`.nodes` finds and connects to the
node that holds them.

All keys of a namespace share the hash tag ``{ns}``, so a Redis Cluster keeps them in one slot, and
a script plus the ``WAIT`` after it can go over one connection to that slot's master.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

DEFAULT_NAMESPACE = "katsubushi"


class LeaseError(RuntimeError):
    """Leasing cannot work as configured (bad URL, pool empty and told not to wait, ...)."""


class NoFreeWorkerId(LeaseError):
    """Every worker id of the range is leased."""


class LeaseRefused(LeaseError):
    """Leasing cannot start safely, and retrying will not change that: Redis is set up so that a lease
    could be lost (``min-replicas-to-write`` 0 beside replicas, an evicting ``maxmemory-policy``), or it
    could not be reached or used for the whole ``--lease-start-timeout``. The daemon exits 2 (a
    configuration to fix: the shipped systemd unit does not restart it)."""


@dataclass(frozen=True)
class RedisTarget:
    """Where the pool lives: a Redis URL without our own parameters, and the namespace.

    ``url`` is what redis-py connects with: for one Redis, the URL itself; for Sentinel and Cluster, a
    template whose host and port :meth:`node_url` replaces with the node found (the master Sentinel
    names, the cluster node that owns the namespace's slot), keeping credentials, TLS and options.
    ``seeds`` are the sentinels, or the cluster's seed nodes; ``service`` the master's name in
    Sentinel; ``sentinel_options`` what the sentinels themselves are connected with (redis-py's
    ``sentinel_kwargs``). ``replica_acks``: how many replicas must acknowledge each lease write (None:
    the master's ``min-replicas-to-write``, else every replica it has had since it last started or was
    promoted; see ``link``). ``allow``: the unsafe Redis settings start-up accepts (``settings``)."""

    url: str
    namespace: str
    cluster: bool = False
    seeds: tuple[tuple[str, int], ...] = ()
    service: str = ""
    sentinel_options: tuple[tuple[str, object], ...] = ()
    replica_acks: int | None = None
    allow: frozenset[str] = frozenset()  # unsafe Redis settings the URL accepts (``allow=``; see ALLOW)

    @property
    def sentinel(self) -> bool:
        return bool(self.service)

    @property
    def display(self) -> str:
        """The URL without a password, for logs."""
        parts = urlsplit(self.url)
        if self.sentinel or self.cluster:
            hosts = ",".join(_hostport(host, port) for host, port in self.seeds)
            if self.cluster:
                return f"rediscluster://{hosts} (ns={self.namespace})"
            scheme = "rediss+sentinel" if parts.scheme == "rediss" else "redis+sentinel"
            db = parts.path.strip("/")
            query = f"?db={db}" if db not in ("", "0") else ""
            return f"{scheme}://{hosts}/{self.service}{query} (ns={self.namespace})"
        netloc = parts.netloc.rsplit("@", 1)[-1]
        return urlunsplit((parts.scheme, netloc, parts.path, "", "")) + f" (ns={self.namespace})"

    def node_url(self, host: str, port: int) -> str:
        """The URL of one node (a master found through Sentinel or the cluster): this URL's scheme,
        credentials, database and options, that node's address."""
        parts = urlsplit(self.url)
        netloc = parts.netloc.rsplit("@", 1)
        auth = netloc[0] + "@" if len(netloc) == 2 else ""
        return urlunsplit((parts.scheme, auth + _hostport(host, port), parts.path, parts.query, ""))

    def keys(self) -> LeaseKeys:
        tag = "{" + self.namespace + "}"
        return LeaseKeys(
            ids=f"{tag}:ids",
            owners=f"{tag}:owners",
            last=f"{tag}:last_ms",
            released=f"{tag}:released",
            stats=f"{tag}:stats",
            pool=f"{tag}:pool",
        )


@dataclass(frozen=True)
class LeaseKeys:
    ids: str
    owners: str
    last: str
    released: str
    stats: str
    pool: str  # the pool's identity (epoch), range and recovery barrier

    @property
    def all(self) -> list[str]:
        """Every key, in the order every script takes them."""
        return [self.ids, self.owners, self.last, self.released, self.stats, self.pool]


_SCHEMES = ("redis", "rediss", "unix", "rediscluster", "redis+sentinel", "rediss+sentinel")
# What the sentinels themselves may be connected with (redis-py's ``sentinel_kwargs``), given in the URL
# as ``sentinel_<name>``; the booleans among them.
_SENTINEL_OPTIONS = {
    "username",
    "password",
    "ssl",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_cert_reqs",
    "ssl_check_hostname",
}
_BOOLEAN = {"ssl", "ssl_check_hostname"}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _boolean(name: str, value: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise LeaseError(f"invalid {name}={value!r} in Redis URL: use true or false")


def _hosts(netloc: str, url: str, default_port: int) -> tuple[str, tuple[tuple[str, int], ...]]:
    """``[user:pass@]host1[:port],host2[:port],...``: the credentials part (with its ``@``, or "") and
    the addresses."""
    auth, _, hosts = netloc.rpartition("@")
    found = []
    for item in hosts.split(","):
        item = item.strip()
        if item.startswith("["):  # [IPv6]:port
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
        else:
            host, _, port_text = item.partition(":")
        try:
            port = int(port_text) if port_text else default_port
        except ValueError:
            raise LeaseError(f"invalid port {port_text!r} in Redis URL {url!r}") from None
        if not host or not 0 < port < 65536:
            raise LeaseError(f"invalid host {item!r} in Redis URL {url!r}")
        found.append((host, port))
    return (auth + "@" if auth else ""), tuple(found)


# What ``allow=`` may name: Redis settings that start-up otherwise refuses (see :mod:`.settings`).
ALLOW = {
    "no-min-replicas": "a master with replicas (or any Sentinel master) whose min-replicas-to-write is 0",
    "evicting": "an allkeys-* maxmemory-policy",
}
# redis-py's own URL options (what ``from_url`` reads from the query, and the TLS ones it passes on).
_REDIS_OPTIONS = {
    "socket_timeout",
    "socket_connect_timeout",
    "socket_read_size",
    "socket_keepalive",
    "retry_on_timeout",
    "max_connections",
    "health_check_interval",
    "timeout",
    "protocol",
    "client_name",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_ca_data",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
    "ssl_cert_reqs",
    "ssl_check_hostname",
    "ssl_min_version",
}
_OWN = ("ns", "replica_acks", "allow")


def _allow(value: str) -> set[str]:
    found = {item.strip() for item in value.split(",") if item.strip()}
    unknown = sorted(found - set(ALLOW))
    if unknown:
        raise LeaseError(f"unknown allow={','.join(unknown)} in Redis URL (known: {', '.join(ALLOW)})")
    return found


def _passed_on(key: str, scheme: str) -> bool:
    """Whether ``key`` is an option for redis-py (or, in a Sentinel URL, for the sentinels)."""
    if key in _REDIS_OPTIONS or (key == "db" and scheme == "unix"):
        return True
    return scheme.endswith("+sentinel") and (key in ("db", "ssl") or key.startswith("sentinel_"))


def _unknown_option(key: str, scheme: str) -> LeaseError:
    """An option nobody reads: a typo (``nz=`` for ``ns=``) refused at once, not taken for an outage."""
    known = [*_OWN, *(["db", "ssl", "sentinel_*"] if scheme.endswith("+sentinel") else [])]
    known += ["db"] if scheme == "unix" else []
    return LeaseError(
        f"unknown parameter {key!r} in Redis URL (known: {', '.join(known)}, and redis-py's"
        f" {', '.join(sorted(_REDIS_OPTIONS))})"
    )


def _replica_acks(value: str) -> int | None:
    if value == "all":
        return None
    if value.isdigit():
        return int(value)
    raise LeaseError(f"invalid replica_acks={value!r} in Redis URL: use all (the default) or a number of replicas")


def parse_redis_url(url: str) -> RedisTarget:
    """``redis://[user:pass@]host[:port][/db]?ns=NAME``, ``rediss://`` (TLS), ``unix:///path?db=N&ns=NAME``,
    go-katsubushi's cluster form ``rediscluster://host:port[,host:port...]?ns=NAME`` (no database), and
    Sentinel's ``redis+sentinel://[user:pass@]host:26379[,host:26379...]/SERVICE?ns=NAME&db=N``
    (``rediss+sentinel://`` or ``ssl=true``: TLS to the master; ``sentinel_password``, ``sentinel_ssl``
    and the other ``sentinel_*`` options: how to reach the sentinels). Every form takes
    ``replica_acks`` (``all``, the default, or a number), ``allow`` (unsafe Redis settings accepted
    anyway: ``ALLOW``) and redis-py's connection options; any other parameter is a typo, refused."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise LeaseError(
            f"invalid scheme in Redis URL {url!r}: use redis://, rediss://, unix://, rediscluster:// or redis+sentinel://"
        )
    query = parse_qsl(parts.query, keep_blank_values=True)
    namespace = DEFAULT_NAMESPACE
    acks: int | None = None
    allow: set[str] = set()
    rest = []
    for key, value in query:
        if key == "ns":
            namespace = value
        elif key == "replica_acks":
            acks = _replica_acks(value)
        elif key == "allow":
            allow |= _allow(value)
        elif _passed_on(key, scheme):
            rest.append((key, value))
        else:
            raise _unknown_option(key, scheme)
    if not namespace or any(ch in namespace for ch in "{}"):
        raise LeaseError(f"invalid namespace {namespace!r} in Redis URL: it must be non-empty, without braces")
    if scheme.endswith("+sentinel"):
        target = _sentinel_target(url, scheme, parts.netloc, parts.path, rest, namespace, acks)
        return replace(target, allow=frozenset(allow))
    cluster = scheme == "rediscluster"
    seeds: tuple[tuple[str, int], ...] = ()
    netloc = parts.netloc
    if cluster:
        if parts.path not in ("", "/"):
            raise LeaseError("a rediscluster:// URL cannot select a database")
        scheme = "redis"
        auth, seeds = _hosts(netloc, url, 6379)
        netloc = auth + _hostport(*seeds[0])
    elif scheme in ("redis", "rediss") and "," in netloc:
        raise LeaseError(f"Redis URL {url!r} names several hosts: use rediscluster:// or redis+sentinel://")
    if scheme in ("redis", "rediss") and not cluster and not parts.hostname:
        raise LeaseError(f"Redis URL {url!r} has no host")
    clean = urlunsplit((scheme, netloc, parts.path, urlencode(rest), ""))
    return RedisTarget(
        url=clean, namespace=namespace, cluster=cluster, seeds=seeds, replica_acks=acks, allow=frozenset(allow)
    )


def _sentinel_target(
    url: str, scheme: str, netloc: str, path: str, query: list[tuple[str, str]], namespace: str, acks: int | None
) -> RedisTarget:
    auth, sentinels = _hosts(netloc, url, 26379)
    service, _, db_path = path.strip("/").partition("/")
    if not service:
        raise LeaseError(f"Redis URL {url!r} names no Sentinel service: redis+sentinel://HOST:26379/SERVICE?ns=NAME")
    db = db_path
    tls = scheme == "rediss+sentinel"
    options: list[tuple[str, object]] = []
    rest = []
    for key, value in query:
        if key == "db":
            db = value
        elif key == "ssl":
            tls = tls or _boolean(key, value)
        elif key.startswith("sentinel_"):
            name = key.removeprefix("sentinel_")
            if name not in _SENTINEL_OPTIONS:
                known = ", ".join(sorted("sentinel_" + o for o in _SENTINEL_OPTIONS))
                raise LeaseError(f"unknown Sentinel option {key!r} in Redis URL (known: {known})")
            options.append((name, _boolean(key, value) if name in _BOOLEAN else value))
        else:
            rest.append((key, value))
    if db and not db.isdigit():
        raise LeaseError(f"invalid database {db!r} in Redis URL {url!r}")
    # The master's URL, its host and port found through Sentinel at each connection (node_url).
    netloc = auth + _hostport(*sentinels[0])
    template = urlunsplit(("rediss" if tls else "redis", netloc, f"/{db or 0}", urlencode(rest), ""))
    return RedisTarget(
        url=template,
        namespace=namespace,
        seeds=sentinels,
        service=service,
        sentinel_options=tuple(options),
        replica_acks=acks,
    )


def released_channel(target: RedisTarget) -> str:
    """The pub/sub channel a clean release announces itself on, so that waiting daemons wake at once."""
    return "{" + target.namespace + "}:released"


def holder_prefix(target: RedisTarget) -> str:
    """The holder channels' name before the worker id: each holder stays subscribed to its id's channel
    while it holds it, so that a script can see a live holder where Redis's data forgot it (see
    ``subscribers`` in scripts.py). Hash-tagged: in a Redis Cluster the channel is on the pool's slot."""
    return "{" + target.namespace + "}:holder:"
