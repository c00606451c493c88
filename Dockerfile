# katsubushi-py: the same install step as the README's, on a slim Python base, as a non-root user.
FROM python:3.12-slim

WORKDIR /src
COPY pyproject.toml README.md ./
COPY katsubushi_py ./katsubushi_py
RUN pip install --no-cache-dir . && rm -rf /src \
    && useradd --system --uid 10001 --no-create-home katsubushi

USER katsubushi
WORKDIR /
EXPOSE 11212
# WORKER_ID must be given: docker run -e WORKER_ID=1 ... (or pass --worker-id 1)
ENTRYPOINT ["katsubushi-py", "--host", "0.0.0.0"]

# Fetch one ID over the memcached protocol.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import socket,sys; s=socket.create_connection(('127.0.0.1',int(__import__('os').environ.get('PORT') or 11212)),2); s.sendall(b'GET health\\r\\n'); d=s.recv(256); sys.exit(0 if d.startswith(b'VALUE health 0 ') else 1)"]
