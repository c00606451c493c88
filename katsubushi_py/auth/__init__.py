"""Authentication: credentials from files (:mod:`.credentials`) and the memcached login (:mod:`.gate`).

HTTP and gRPC check a bearer token with :meth:`~.credentials.Credentials.check_authorization` in their
own front ends; memcached connections start in :class:`~.gate.AuthGate` until they log in.
"""

from .credentials import AuthConfig, Credentials, CredentialsError

__all__ = ["AuthConfig", "Credentials", "CredentialsError"]
