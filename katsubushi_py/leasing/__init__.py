"""Worker ids leased from Redis: where the pool lives (:mod:`.target`), the Lua scripts that change it
(:mod:`.scripts`), the daemon's side of a lease (:mod:`.keeper`) and the ``lease`` tools' view of a
pool (:mod:`.pool`)."""

from .keeper import LeaseKeeper, LeaseTimings
from .target import DEFAULT_NAMESPACE, LeaseError, LeaseRefused, NoFreeWorkerId, RedisTarget, parse_redis_url

__all__ = [
    "DEFAULT_NAMESPACE",
    "LeaseError",
    "LeaseKeeper",
    "LeaseRefused",
    "LeaseTimings",
    "NoFreeWorkerId",
    "RedisTarget",
    "parse_redis_url",
]
