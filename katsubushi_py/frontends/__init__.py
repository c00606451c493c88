"""Wire protocols, each a thin sans-IO translation onto :class:`katsubushi_py.issuing.issuer.Issuer`:
bytes in, reply bytes out, no sockets."""
