"""deploy/: Prometheus rules checked and unit-tested by promtool, a dashboard and rules that name only
metrics the server exports, and a real Prometheus that scrapes `magnitude serve` and fires the alert."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RULES = DEPLOY / "prometheus" / "magnitude-rules.yml"
DASHBOARD = DEPLOY / "grafana" / "magnitude-dashboard.json"
NAME = re.compile(r"\bmagnitude[_:][a-z0-9_:]*")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def listen(port: int) -> list[str]:
    return [f"--web.listen-address=127.0.0.1:{port}"]


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get("MAGNITUDE_REQUIRE_PROMETHEUS"):
            pytest.fail(f"{name} is required here (Debian's prometheus package)")
        pytest.skip(f"{name} is not installed (apt-get install prometheus)")
    return found


def test_the_lesson_finds_the_rules_it_loads():
    """Notebook 09's Prometheus loads the repository's rules, wherever the lesson's module lies."""
    from magnitude_jupyter.client.objectives_lesson import rules_path

    assert (
        rules_path().is_file()
        and rules_path().read_text() == (DEPLOY / "prometheus" / "magnitude-rules.yml").read_text()
    )


def test_promtool_checks_the_rules_and_their_unit_tests_pass():
    promtool = tool("promtool")
    subprocess.run([promtool, "check", "rules", str(RULES)], check=True, capture_output=True)
    result = subprocess.run(
        [promtool, "test", "rules", "magnitude-rules.test.yml"], cwd=RULES.parent, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def expressions() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads(DASHBOARD.read_text())
    exprs += [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return exprs


@pytest.mark.model
def test_the_dashboard_and_the_rules_name_only_what_the_server_exports(server):
    headers = {"Authorization": f"Bearer {server.token}"}
    exported = set()
    for line in httpx.get(server.url + "/metrics", headers=headers).text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            exported |= {name + suffix for suffix in HISTOGRAM_SUFFIXES} if kind == "histogram" else {name}
    groups = yaml.safe_load(RULES.read_text())["groups"]
    recorded = {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}
    named = {name for expr in expressions() for name in NAME.findall(expr)}
    assert named - exported - recorded == set()
    assert {"magnitude_slo_burn_rate", "magnitude_slo_compliance_ratio"} <= named


@pytest.mark.model
def test_a_real_prometheus_scrapes_the_server_and_the_broken_objective_alert_goes_pending_then_fires(tmp_path):
    from magnitude_jupyter.client.http import Client
    from magnitude_jupyter.client.runtime import LocalServer
    from tests.conftest import free_port

    prometheus = tool("prometheus")
    # An objective every answer misses: the alert's path, by construction, on any machine.
    with LocalServer(
        ("--parallel", "2", "--ctx-size", "1024", "--slo-e2e-p95-ms", "0.001"), token="prom-token", config=""
    ) as server:
        Client(server.url, server.token).chat([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
        (tmp_path / "token").write_text(server.token)
        # The deployed rules, with the alert's 5 minutes shortened to seconds for the test.
        rules = RULES.read_text().replace("for: 5m", "for: 4s")
        (tmp_path / "magnitude-rules.yml").write_text(rules)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["magnitude-rules.yml"],
            "scrape_configs": [
                {
                    "job_name": "magnitude",
                    "authorization": {"credentials_file": "token"},
                    "static_configs": [{"targets": [server.url.removeprefix("http://")]}],
                }
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        proc = subprocess.Popen(
            [prometheus, "--config.file=prometheus.yml", f"--storage.tsdb.path={tmp_path / 'data'}", *listen(port)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            states = []
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and "firing" not in states:
                try:
                    alerts = httpx.get(f"http://127.0.0.1:{port}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
                except (httpx.HTTPError, ValueError):
                    alerts = []
                for alert in alerts:
                    if alert["labels"]["alertname"] == "MagnitudeSloBroken" and alert["state"] not in states[-1:]:
                        states.append(alert["state"])
                        assert alert["labels"]["objective"] == "e2e_p95_ms"
                time.sleep(0.5)
            assert states == ["pending", "firing"]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
