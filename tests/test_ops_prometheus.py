"""The alert rules, their promtool unit tests, and a real Prometheus scraping a real daemon (issue 25).

- ``promtool check rules`` accepts contrib/prometheus/katsubushi-alerts.yaml, ``promtool test rules``
  passes its unit tests, every alert has a test in which it fires, and a broken rule fails them;
- a real Prometheus (Debian's ``prometheus``) on a free loopback port scrapes a leasing daemon's
  ``/metrics`` and a target where nothing listens, with the rules loaded: its HTTP API finds the
  daemon's series (lease metrics included), evaluates every rule, and has ``KatsubushiDown`` pending
  for the dead target;
- every PromQL expression of the Grafana dashboard (contrib/grafana/) is accepted by that Prometheus,
  and every metric the rules and the dashboard name is one the daemon exports.

The real-Prometheus tests share one Prometheus (about 6 s in all: one-second scrapes and evaluations).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import DaemonFactory, free_port, wait_for_port
from lease_helpers import start_leased

yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (the test extra)")

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "contrib" / "prometheus" / "katsubushi-alerts.yaml"
RULE_TESTS = ROOT / "contrib" / "prometheus" / "katsubushi-alerts.test.yaml"
DASHBOARD = ROOT / "contrib" / "grafana" / "katsubushi-dashboard.json"


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (Debian package prometheus; .ci/run installs it)")
    return found


def alerts() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"] if "alert" in rule]


# -- promtool --------------------------------------------------------------------------------------
def test_promtool_checks_the_rules() -> None:
    result = subprocess.run(
        [tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = subprocess.run(
        [tool("promtool"), "test", "rules", str(RULE_TESTS)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=RULES.parent,
    )
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_in_which_it_fires() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    firing = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    names = [rule["alert"] for rule in alerts()]
    assert len(names) == len(set(names))
    assert set(names) == firing, set(names) ^ firing
    assert all(rule["labels"]["severity"] in ("critical", "warning", "info") for rule in alerts())


def test_the_unit_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The same tests against a copy of the rules where one threshold is wrong: they fail, naming it."""
    broken = RULES.read_text().replace("expr: katsubushi_can_issue == 0", "expr: katsubushi_can_issue == 2")
    assert broken != RULES.read_text()
    (tmp_path / RULES.name).write_text(broken)
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    result = subprocess.run(
        [tool("promtool"), "test", "rules", RULE_TESTS.name], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode != 0 and "alertname: KatsubushiCannotIssue" in result.stdout + result.stderr


# -- a real Prometheus -----------------------------------------------------------------------------
@dataclass
class Running:
    url: str
    daemon_target: str
    dead_target: str
    names: set[str]  # every metric name Prometheus has from the daemon


def api(base: str, path: str, **params: str) -> Any:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    try:
        with urllib.request.urlopen(f"{base}{path}{query}", timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def wait_for(what: str, predicate: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"Prometheus: {what} within {timeout} s")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    binary = tool("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    # A leasing daemon, so that the lease metrics exist too (module scope: the fixtures by hand).
    from redis_servers import start_redis

    redis = start_redis(tmp / "redis")
    daemons = DaemonFactory(tmp)
    http = free_port()
    try:
        daemon = start_leased(daemons, redis.url, "--http-port", str(http))
        wait_for_port(http, daemon.proc)
        dead = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {
                    "job_name": "katsubushi",
                    "static_configs": [{"targets": [f"127.0.0.1:{http}", f"127.0.0.1:{dead}"]}],
                }
            ],
        }
        (tmp / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        port = free_port()
        log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - open for the process's life
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:

            def ready() -> bool:
                if proc.poll() is not None:
                    raise AssertionError(f"prometheus exited: {(tmp / 'prometheus.log').read_text()}")
                try:
                    with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                        return response.status == 200
                except OSError:
                    return False

            wait_for("ready", ready)

            def scraped() -> set[str] | None:
                found = api(base, "/api/v1/label/__name__/values", **{"match[]": '{job="katsubushi"}'})["data"]
                return set(found) if {"katsubushi_requests_total", "katsubushi_lease_state"} <= set(found) else None

            names = wait_for("the daemon's series", scraped)

            def both_scraped() -> bool:
                up = api(base, "/api/v1/query", query='up{job="katsubushi"}')["data"]["result"]
                return len(up) == 2

            wait_for("a scrape of each target", both_scraped)
            yield Running(base, f"127.0.0.1:{http}", f"127.0.0.1:{dead}", names)
        finally:
            proc.terminate()
            proc.wait(10)
            log.close()
    finally:
        daemons.stop_all()
        redis.stop()


def query(running: Running, expr: str) -> list[dict[str, Any]]:
    answer = api(running.url, "/api/v1/query", query=expr)
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


@pytest.mark.once
def test_prometheus_finds_the_daemons_series(prometheus: Running) -> None:
    series = query(prometheus, 'katsubushi_requests_total{job="katsubushi"}')
    assert {s["metric"]["instance"] for s in series} == {prometheus.daemon_target}
    assert {s["metric"]["protocol"] for s in series} == {"text", "binary", "meta", "http"}
    held = query(prometheus, 'katsubushi_lease_state{state="held"}')
    assert [s["value"][1] for s in held] == ["1"]
    up = {s["metric"]["instance"]: s["value"][1] for s in query(prometheus, 'up{job="katsubushi"}')}
    assert up == {prometheus.daemon_target: "1", prometheus.dead_target: "0"}
    # The default layout's time bits run out at 2015-01-01 + 2^41 ms.
    [end] = query(prometheus, "katsubushi_id_lifetime_end_timestamp_seconds")
    assert float(end["value"][1]) == (1_420_070_400_000 + (1 << 41)) / 1000


@pytest.mark.once
def test_prometheus_evaluates_every_rule_and_the_dead_target_is_down(prometheus: Running) -> None:
    def pending() -> list[dict[str, Any]]:
        found = api(prometheus.url, "/api/v1/alerts")["data"]["alerts"]
        return [a for a in found if a["labels"]["alertname"] == "KatsubushiDown"]

    [down] = wait_for("KatsubushiDown pending", pending)
    assert down["state"] == "pending"  # for: 1m
    assert down["labels"]["instance"] == prometheus.dead_target
    groups = wait_for(
        "every rule evaluated",
        lambda: [
            g
            for g in api(prometheus.url, "/api/v1/rules")["data"]["groups"]
            if g["name"] == "katsubushi" and all(r["lastEvaluation"][:4] != "0001" for r in g["rules"])
        ],
    )
    rules = groups[0]["rules"]
    assert len(rules) == len(alerts())
    assert [r["name"] for r in rules if r["health"] != "ok"] == []
    firing = {a["labels"]["alertname"] for a in api(prometheus.url, "/api/v1/alerts")["data"]["alerts"]}
    assert firing == {"KatsubushiDown"}, firing  # the healthy, leased daemon raises none


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel target, and the queries of the template variables."""
    board = json.loads(DASHBOARD.read_text())
    found = [(panel["title"], target["expr"]) for panel in board["panels"] for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            # Grafana's label_values(SELECTOR, LABEL) asks Prometheus for SELECTOR's series.
            text = variable["query"]["query"]
            selector = re.fullmatch(r"label_values\((.+), (\w+)\)", text)
            assert selector is not None, text
            found.append((f"variable {variable['name']}", selector.group(1)))
    return found


def as_prometheus_sees_it(expr: str) -> str:
    """Grafana's variables replaced as Grafana replaces them (all jobs and instances selected)."""
    for name, value in {
        "job": ".+",
        "instance": ".+",
        "__rate_interval": "1m",
        "__interval": "15s",
        "__range": "1h",
    }.items():
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in expr, expr
    return expr


def test_the_dashboard_has_the_panels_the_issue_asks_for() -> None:
    board = json.loads(DASHBOARD.read_text())
    text = json.dumps(board)
    for metric in (
        "katsubushi_requests_total",  # request rate by protocol
        "katsubushi_ids_issued_total",  # IDs per second
        "scrape_duration_seconds",  # latency: how fast the event loop answers
        "katsubushi_lease_state",  # lease state
        "katsubushi_lease_time_left_seconds",  # renew age
        "katsubushi_clock_backwards_events_total",  # clock wait
        "katsubushi_connections",  # connections
    ):
        assert metric in text, metric
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "job", "instance"}
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.once
def test_every_dashboard_expression_is_accepted_by_prometheus(prometheus: Running) -> None:
    expressions = dashboard_expressions()
    assert len(expressions) >= 20
    for title, expr in expressions:
        answer = api(prometheus.url, "/api/v1/query", query=as_prometheus_sees_it(expr))
        assert answer["status"] == "success", f"{title}: {expr}: {answer.get('error')}"
    # ... and a broken one is not (the check can fail).
    broken = api(prometheus.url, "/api/v1/query", query="sum by (protocol) (rate(katsubushi_requests_total[1m])")
    assert broken["status"] == "error"
    # The template variables find the daemon.
    instances = query(prometheus, as_prometheus_sees_it(dict(expressions)["variable instance"]))
    assert {s["metric"]["instance"] for s in instances} == {prometheus.daemon_target}


@pytest.mark.once
def test_every_metric_named_in_the_rules_and_the_dashboard_exists(prometheus: Running) -> None:
    """PromQL accepts any name; a misspelt one would silently match nothing."""
    text = RULES.read_text() + DASHBOARD.read_text()
    named = set(re.findall(r"\b(katsubushi_[a-z_]+|process_[a-z_]+|scrape_duration_seconds)\b", text))
    assert len(named) >= 20
    missing = named - prometheus.names
    assert missing == set(), missing
    assert "katsubushi_lease_renew_failures_total" in named and "process_cpu_seconds_total" in named
