# katsubushi-py: the wheel built from this checkout, with its compiled hot path, on a slim Python base,
# as a numeric non-root user.
#   docker build -t katsubushi-py:1.0.0 -t katsubushi-py .
#   docker run -d --name ids -p 127.0.0.1:11212:11212 -e WORKER_ID=1 -v katsubushi-data:/data katsubushi-py
# The README's Docker section has the rest (user networks, worker ids, the health check).

# The build stage is the full python image (buildpack-deps: gcc and the Python headers), so that
# setup.py compiles katsubushi_py/_speedups.c into the wheel; the final stage gets only the wheel.
# (tests/test_ops_image.py copies exactly what these COPY lines copy and builds the wheel the same way.)
FROM python:3.12-bookworm AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE MANIFEST.in ./
COPY katsubushi_py ./katsubushi_py
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.12-slim-bookworm
COPY --from=build /wheels /wheels
# The wheel just built, with the grpc extra (for --grpc-port); then the build fails unless the installed
# package runs the compiled hot path, gRPC's included (the pure-Python twin serves 0.6-0.75x memcached one key at a
# time). /data holds the state file (a high-water mark, so a restarted container never reissues IDs).
RUN set -- /wheels/katsubushi_py-*.whl \
    && pip install --no-cache-dir "katsubushi-py[grpc] @ file://$1" \
    && rm -rf /wheels \
    && python -c 'import sys, katsubushi_py.compiled as c; sys.exit(None if c.IMPLEMENTATION == "compiled" and c.grpc_speedups else "katsubushi-py: no compiled hot path in the image: " + (c.WHY_NOT_COMPILED or "the gRPC fast path (_grpc_speedups) was not built"))' \
    && mkdir /data \
    && chown 10001:10001 /data \
    && chmod 0700 /data
ENV PYTHONUNBUFFERED=1 \
    STATE_DIR=/data
VOLUME /data
# Numeric, so that Kubernetes' runAsNonRoot can check it; no entry in /etc/passwd is needed.
USER 10001:10001
# memcached protocol; --http-port and --grpc-port (off unless given) are published the same way.
EXPOSE 11212
# The daemon (process 1) answers what it received, stores its final mark and exits 0 on SIGTERM.
STOPSIGNAL SIGTERM
# Listens on every interface of the container; publish it on loopback or a user network only.
ENTRYPOINT ["katsubushi-py", "--host", "0.0.0.0"]
# Asks the daemon for one ID where process 1 listens: its own flags and environment, read from /proc/1,
# so a container started with --port or --sock is checked where it listens.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["katsubushi-py", "health", "--pid", "1", "--timeout", "3s"]
