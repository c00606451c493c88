"""The Kubernetes manifests in deploy/kubernetes/ (issue 25), checked offline:

- every resource validates against the Kubernetes API schemas (``kubernetes-validate``, strict: an
  unknown or misspelt field fails) for the oldest and the newest version checked;
- each container's command line (the image's ENTRYPOINT from the Dockerfile, then the manifest's
  ``args``, with the manifest's and the image's environment) is parsed by the daemon's own parser,
  and what it configures agrees with the manifest: ports, probes, the state volume, the worker id;
- what operators expect of a fleet is there: non-root, read-only root file system, no capabilities,
  seccomp RuntimeDefault, probes, resource requests, a PVC per pod, a PodDisruptionBudget and a
  headless Service for the StatefulSet, a Redis-leasing Deployment;
- every file the daemon's flags name (certificate, key, CA, credentials) is mounted read-only from a
  Secret or ConfigMap, and the flags parse with stand-in files in those places (the TLS ones made by
  ``openssl``, a users file and a token file);
- the container's command runs: a real daemon with the StatefulSet's (and the Deployment's) flags
  answers the probes' paths without credentials, and asks for them everywhere else.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import DAEMON_CMD, daemon_env, free_port, wait_for_port
from lease_helpers import init_pool, wait_until
from tls_certs import make_certs

import katsubushi_py
from katsubushi_py.config import ServerConfig, parse_server_config

yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (the test extra)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the test extra installs kubernetes-validate")

ROOT = Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
# The oldest Kubernetes minor the manifests promise to work with, and the newest the schemas know.
VERSIONS = ["1.30.0", kubernetes_validate.utils.latest_version()]
# A Redis URL where the manifests take one from a Secret.
SAMPLE_REDIS = "redis://redis.default.svc:6379/0?ns=myapp"


def resources() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


def of_kind(kind: str, file: str | None = None) -> list[dict[str, Any]]:
    return [doc for name, doc in resources() if doc["kind"] == kind and (file is None or name == file)]


def workloads() -> list[dict[str, Any]]:
    return of_kind("StatefulSet") + of_kind("Deployment")


def the_container(workload: dict[str, Any]) -> dict[str, Any]:
    [container] = workload["spec"]["template"]["spec"]["containers"]
    return container


# -- schemas ---------------------------------------------------------------------------------------
def test_the_manifests_are_there() -> None:
    kinds = sorted(doc["kind"] for _, doc in resources())
    expected = ["Service", "StatefulSet", "PodDisruptionBudget", "Service", "Deployment", "PodDisruptionBudget"]
    assert kinds == sorted([*expected, "NetworkPolicy"])


@pytest.mark.parametrize("version", VERSIONS)
def test_every_resource_validates_against_the_kubernetes_schemas(version: str) -> None:
    for name, doc in resources():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = f"{name}: {doc['kind']}/{doc['metadata']['name']} (Kubernetes {version})"
            raise AssertionError(f"{where}: {exc}") from None


def test_the_validation_would_catch_a_mistake() -> None:
    [statefulset] = of_kind("StatefulSet")
    the_container(statefulset)["securityContext"]["readOnlyRootFS"] = True  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFS"):
        kubernetes_validate.validate(statefulset, VERSIONS[0], strict=True)
    [deployment] = of_kind("Deployment")
    the_container(deployment)["ports"][0]["containerPort"] = "11212"  # a string
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


# -- the daemon's flags ----------------------------------------------------------------------------
def dockerfile_final_stage() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            if word.upper() == "FROM":
                stages.append([])
            stages[-1].append((word.upper(), rest.strip()))
    return stages[-1]


def image_entrypoint() -> list[str]:
    [entrypoint] = [rest for word, rest in dockerfile_final_stage() if word == "ENTRYPOINT"]
    return json.loads(entrypoint)


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in dockerfile_final_stage():
        if word == "ENV":
            env.update(pair.split("=", 1) for pair in rest.split())
    return env


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The image's environment, then the container's; a Secret's value is the sample URL."""
    env = dict(image_env())
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == ("katsubushi-redis", "url"), ref
            env[item["name"]] = SAMPLE_REDIS
    return env


#: Where the manifests mount the TLS Secret; the tests put certificates made by openssl there instead.
TLS_MOUNT = "/etc/katsubushi-py/tls"
#: The flags that name a file the daemon reads (never the state directory, which it writes).
FILE_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca", "--auth-file", "--token-file")
#: The stand-in credentials: a user of the users file, and a token of the token file.
USER, PASSWORD, TOKEN = "app1", "stand-in-password", "stand-in-token-0123456789abcdef"


@functools.cache
def tls_files() -> Path:
    """A directory standing for the TLS Secret's mount: tls.crt, tls.key, ca.crt (tests/tls_certs.py)."""
    certs = make_certs(Path(tempfile.mkdtemp(prefix="k8s-tls-")))
    for source, name in ((certs.server.cert, "tls.crt"), (certs.server.key, "tls.key"), (certs.ca.cert, "ca.crt")):
        shutil.copyfile(source, certs.directory / name)
    return certs.directory


@functools.cache
def stand_in(mount: str) -> Path:
    """A local directory standing for the volume mounted at ``mount``: TLS_MOUNT's certificates, or
    an empty directory that :func:`local_paths` fills with the files the flags name."""
    return tls_files() if mount == TLS_MOUNT else Path(tempfile.mkdtemp(prefix="k8s-secret-"))


def file_arguments(args: list[str]) -> list[tuple[str, str]]:
    """(flag, path) for every flag in ``args`` that names a file the daemon reads."""
    return [(flag, path) for flag, path in itertools.pairwise(args) if flag in FILE_FLAGS]


def mount_of(container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume mount that ``path`` is in (the longest mount path that contains it)."""
    found = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert found, f"{path} is not on any volume of the container"
    return max(found, key=lambda m: len(m["mountPath"]))


def local_paths(args: list[str], container: dict[str, Any] | None = None) -> list[str]:
    """The manifest's arguments with each Secret's mount moved to its :func:`stand_in` directory
    (TLS_MOUNT's without ``container``), the credential files written there: a users file with
    USER's password, a token file with TOKEN."""
    mounts = [TLS_MOUNT] if container is None else [m["mountPath"] for m in container["volumeMounts"]]
    moved = list(args)
    for i, arg in enumerate(args):
        for mount in mounts:
            if arg.startswith(mount + "/"):
                moved[i] = str(stand_in(mount)) + arg[len(mount) :]
    for flag, path in file_arguments(moved):
        content = {"--auth-file": f"{USER}:{PASSWORD}\n", "--token-file": f"{TOKEN}\n"}.get(flag)
        if content is not None:
            Path(path).write_text(content)
    return moved


def daemon_config(workload: dict[str, Any], pod_name: str) -> ServerConfig:
    """What the daemon in this workload's pod ``pod_name`` makes of its command line and environment,
    parsed by the daemon's own parser (``--hostname`` stands for the pod's host name)."""
    container = the_container(workload)
    entrypoint = image_entrypoint()
    assert entrypoint[0] == "katsubushi-py" and "command" not in container, "the image's entrypoint runs"
    argv = local_paths([*entrypoint[1:], *container["args"]], container)
    if "--worker-id-from" in argv:
        argv += ["--hostname", pod_name]
    config, _ = parse_server_config(argv, container_env(container))
    assert config is not None
    return config


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return number


def test_the_statefulsets_flags_give_each_pod_its_ordinal_as_worker_id() -> None:
    [statefulset] = of_kind("StatefulSet")
    name = statefulset["metadata"]["name"]
    for ordinal in (0, 1, statefulset["spec"]["replicas"] - 1):
        config = daemon_config(statefulset, f"{name}-{ordinal}")
        assert config.worker_id == ordinal and config.lease is None
        assert config.worker_id_source.startswith(f"hostname '{name}-{ordinal}'")


def test_the_deployments_flags_lease_worker_ids_from_redis() -> None:
    [deployment] = of_kind("Deployment")
    config = daemon_config(deployment, "katsubushi-leased-7c9d8f6b5-x9k22")
    assert config.worker_id is None and config.lease is not None
    assert config.lease.target.namespace == "myapp"


@pytest.mark.parametrize("kind", ["StatefulSet", "Deployment"])
def test_the_flags_agree_with_the_manifest(kind: str) -> None:
    [workload] = of_kind(kind)
    container = the_container(workload)
    config = daemon_config(workload, f"{workload['metadata']['name']}-0")
    assert config.host == "0.0.0.0"  # reachable on the pod's address
    assert config.port == port_number(container, "memcached")
    assert config.http_port == port_number(container, "http")
    for probe in ("readinessProbe", "livenessProbe"):
        assert port_number(container, container[probe]["httpGet"]["port"]) == config.http_port
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert port_number(container, container["startupProbe"]["tcpSocket"]["port"]) == config.port
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert config.state_dir in mounts and config.state_file is None
    if config.tls is not None:  # the certificate and key are in the Secret's mount, and the probes speak TLS
        assert mounts[TLS_MOUNT]["readOnly"] is True
        assert config.tls.cert == f"{tls_files()}/tls.crt" and config.tls.key == f"{tls_files()}/tls.key"
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["scheme"] == "HTTPS"
        [volume] = [
            v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mounts[TLS_MOUNT]["name"]
        ]
        assert volume["secret"]["secretName"] == "katsubushi-tls"
    if config.auth is not None:  # logins: the probes ask only what stays open without credentials
        assert config.auth.auth_file is not None and config.auth.token_file is not None
        open_paths = {"/healthz", "/livez"} | ({"/metrics"} if config.auth.metrics_no_auth else set())
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["path"] in open_paths, probe
            assert "httpHeaders" not in container[probe]["httpGet"], "no credentials in the manifest"
    assert container["image"].endswith(f":{katsubushi_py.__version__}")


def test_the_statefulset_serves_tls_and_asks_for_logins() -> None:
    """The example a fleet copies shows both (issue 27): TLS, memcached users and bearer tokens."""
    [statefulset] = of_kind("StatefulSet")
    config = daemon_config(statefulset, "katsubushi-0")
    assert config.tls is not None and config.auth is not None
    assert config.auth.auth_file and config.auth.token_file and not config.auth.metrics_no_auth


@pytest.mark.parametrize("kind", ["StatefulSet", "Deployment"])
def test_every_file_the_flags_name_is_mounted_read_only_from_a_secret(kind: str) -> None:
    """Certificates, keys and credentials come from a Secret (or a ConfigMap), mounted read-only, and
    the key each flag names is one the volume projects; the daemon's parser reads the stand-ins."""
    [workload] = of_kind(kind)
    container = the_container(workload)
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    args = [*image_entrypoint()[1:], *container["args"]]
    for flag, path in file_arguments(args):
        mount = mount_of(container, path)
        assert mount.get("readOnly") is True, (flag, path)
        volume = volumes[mount["name"]]
        source = volume.get("secret") or volume.get("configMap")
        assert source is not None, f"{flag} {path}: the volume {mount['name']} is not a Secret or ConfigMap"
        key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
        if "items" in source:  # only the keys listed are there
            assert key in [item["path"] for item in source["items"]], (flag, key)
        assert "/" not in key and key, (flag, path)
    # Every Secret volume is mounted, read-only.
    for name, volume in volumes.items():
        if "secret" in volume:
            [mount] = [m for m in container["volumeMounts"] if m["name"] == name]
            assert mount["readOnly"] is True, name
    config = daemon_config(workload, f"{workload['metadata']['name']}-0")
    named = {
        "--tls-cert": config.tls.cert if config.tls else None,
        "--tls-key": config.tls.key if config.tls else None,
        "--tls-ca": config.tls.ca if config.tls else None,
        "--auth-file": config.auth.auth_file if config.auth else None,
        "--token-file": config.auth.token_file if config.auth else None,
    }
    local = dict(file_arguments(local_paths(args, container)))
    assert {flag: path for flag, path in named.items() if path is not None} == local


def test_a_file_outside_the_secrets_would_be_caught() -> None:
    [statefulset] = of_kind("StatefulSet")
    container = the_container(statefulset)
    with pytest.raises(AssertionError, match="not on any volume"):
        mount_of(container, "/etc/katsubushi-py/users")
    assert mount_of(container, "/etc/katsubushi-py/auth/users")["name"] == "auth"


def test_a_flag_the_daemon_does_not_know_would_be_caught() -> None:
    """The parse above is strict: a manifest with a misspelt flag fails it."""
    from katsubushi_py.config import ConfigError

    [statefulset] = of_kind("StatefulSet")
    the_container(statefulset)["args"].append("--htpp-port")
    with pytest.raises(ConfigError, match="unrecognized arguments: --htpp-port"):
        daemon_config(statefulset, "katsubushi-0")


# -- what a fleet needs ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["StatefulSet", "Deployment"])
def test_the_pods_are_locked_down(kind: str) -> None:
    [workload] = of_kind(kind)
    pod = workload["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert (
        pod["securityContext"]["runAsUser"]
        == 10001
        == int(next(rest for word, rest in dockerfile_final_stage() if word == "USER").split(":")[0])
    )
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    container = the_container(workload)
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]} and security["privileged"] is False
    requests = container["resources"]["requests"]
    assert set(requests) == {"cpu", "memory"} and "memory" in container["resources"]["limits"]


def test_the_statefulset_keeps_its_state_on_a_claim_per_pod_behind_a_headless_service() -> None:
    [statefulset] = of_kind("StatefulSet")
    spec = statefulset["spec"]
    [claim] = spec["volumeClaimTemplates"]
    [mount] = [m for m in the_container(statefulset)["volumeMounts"] if m["mountPath"] == "/data"]
    assert claim["metadata"]["name"] == mount["name"] and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    [service] = [s for s in of_kind("Service") if s["metadata"]["name"] == spec["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"] == labels == service["spec"]["selector"]


@pytest.mark.parametrize("kind", ["StatefulSet", "Deployment"])
def test_a_disruption_budget_and_a_service_select_each_workload(kind: str) -> None:
    [workload] = of_kind(kind)
    labels = workload["spec"]["template"]["metadata"]["labels"]
    budgets = [b for b in of_kind("PodDisruptionBudget") if b["spec"]["selector"]["matchLabels"] == labels]
    assert len(budgets) == 1 and budgets[0]["spec"]["maxUnavailable"] == 1
    services = [s for s in of_kind("Service") if s["spec"]["selector"] == labels]
    assert len(services) == 1
    ports = {p["name"]: p["targetPort"] for p in services[0]["spec"]["ports"]}
    assert ports == {"memcached": "memcached", "http": "http"}


def test_the_network_policy_opens_exactly_the_two_ports() -> None:
    [policy] = of_kind("NetworkPolicy")
    ports = sorted(port["port"] for rule in policy["spec"]["ingress"] for port in rule["ports"])
    container_ports = sorted(p["containerPort"] for p in the_container(of_kind("StatefulSet")[0])["ports"])
    assert ports == container_ports
    for workload in workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


# -- the command runs ------------------------------------------------------------------------------
def recv_line(sock: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\r\n"):
        byte = sock.recv(1)
        assert byte, f"closed after {line!r}"
        line += byte
    return line


def http_status(port: int, path: str, scheme: str = "HTTP", token: str | None = None) -> int:
    """The probe's answer; over HTTPS without checking the certificate, as the kubelet does."""
    context = ssl._create_unverified_context() if scheme == "HTTPS" else None
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    request = urllib.request.Request(f"{scheme.lower()}://127.0.0.1:{port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def run_container_command(
    workload: dict[str, Any], pod_name: str, tmp_path: Path, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    """The container's command on loopback: its flags with the ports, host and state volume moved
    to this machine (tests listen on 127.0.0.1 and free ports only)."""
    container = the_container(workload)
    args = [*image_entrypoint()[1:], *container["args"]]
    port, http = free_port(), free_port()
    data = tmp_path / "data"
    data.mkdir(parents=True)
    moved = {"0.0.0.0": "127.0.0.1", str(port_number(container, "http")): str(http), "/data": str(data)}
    argv = [*DAEMON_CMD, *local_paths([moved.get(a, a) for a in args], container), "--port", str(port)]
    if "--worker-id-from" in argv:
        argv += ["--hostname", pod_name]
    env = {k: str(data) if v == "/data" else v for k, v in container_env(container).items()}
    env.update(extra_env or {})
    log = tmp_path / "daemon.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=daemon_env(data, env)
        )
    return proc, port, http, log


@pytest.mark.once
def test_the_statefulsets_command_answers_its_probes(tmp_path: Path) -> None:
    [statefulset] = of_kind("StatefulSet")
    container = the_container(statefulset)
    proc, port, http, log = run_container_command(statefulset, "katsubushi-2", tmp_path)
    try:
        wait_for_port(port, proc)  # the startup probe: a TCP connection to the memcached port
        wait_for_port(http, proc)
        for probe in ("readinessProbe", "livenessProbe"):  # without credentials, as the kubelet asks
            get = container[probe]["httpGet"]
            assert http_status(http, get["path"], get.get("scheme", "HTTP")) == 200
        # Everything else asks for the token (the metrics too).
        assert [http_status(http, path, "HTTPS") for path in ("/id", "/stats", "/metrics")] == [401] * 3
        assert http_status(http, "/id", "HTTPS", token=TOKEN) == 200
        context = ssl.create_default_context(cafile=str(tls_files() / "ca.crt"))
        login = f"{USER} {PASSWORD}".encode()
        with context.wrap_socket(
            socket.create_connection(("127.0.0.1", port), timeout=5), server_hostname="localhost"
        ) as s:
            s.sendall(b"GET a\r\n")
            assert recv_line(s) == b"CLIENT_ERROR unauthenticated\r\n"
            s.sendall(b"set auth 0 0 %d\r\n%b\r\nGET a\r\n" % (len(login), login))
            assert recv_line(s) == b"STORED\r\n"
            reply = recv_line(s) + recv_line(s)
        assert reply.startswith(b"VALUE a 0 ") and (int(reply.split(b"\r\n")[1]) >> 12) & 0x3FF == 2
        # The image's HEALTHCHECK (and an exec probe) with the container's flags: over TLS, logged in.
        args = [*image_entrypoint()[1:], *container["args"]]
        flags = local_paths(["127.0.0.1" if a == "0.0.0.0" else a for a in args], container)
        health = subprocess.run(
            [*DAEMON_CMD, "health", *flags, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
            env=daemon_env(tmp_path / "health"),
        )
        assert health.returncode == 0 and " issued " in health.stdout, health.stderr
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    text = log.read_text()
    assert "worker id 2 from hostname 'katsubushi-2'" in text
    assert (tmp_path / "data" / "worker-2.state").exists()
    assert all(json.loads(line)["level"] in ("info", "warning") for line in text.splitlines()), text


@pytest.mark.once
def test_the_deployments_command_is_ready_once_it_holds_a_lease(tmp_path: Path, redis_server: Any) -> None:
    """Not ready (/healthz 503) but alive while Redis cannot be reached; ready once it holds a lease
    from the pool ``lease init`` made."""
    [deployment] = of_kind("Deployment")
    container = the_container(deployment)
    ready = container["readinessProbe"]["httpGet"]["path"]
    alive = container["livenessProbe"]["httpGet"]["path"]
    nowhere = f"redis://127.0.0.1:{free_port()}/0?ns=k8s"
    proc, _, http, _ = run_container_command(deployment, "katsubushi-leased-1", tmp_path / "a", {"REDIS": nowhere})
    try:
        wait_for_port(http, proc)
        assert (http_status(http, ready), http_status(http, alive)) == (503, 200)
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    init_pool(redis_server.url, "k8s")
    url = f"{redis_server.url}?ns=k8s"
    proc, _, http, log = run_container_command(deployment, "katsubushi-leased-2", tmp_path / "b", {"REDIS": url})
    try:
        wait_for_port(http, proc)
        wait_until(lambda: http_status(http, ready) == 200, timeout=15)
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    assert "leased worker id" in log.read_text()
