"""What the objectives notebook (09) drives: load past the knee from many clients, the objectives as
the server judges them, and a real Prometheus watching the same server with the shipped alert rules.

Kept out of the notebook so that a learner reads what happens, not thread plumbing; nothing here is
a mock: the requests go to a real `magnitude serve`, and Prometheus is Debian's own binary where it is
installed (`apt-get install prometheus`), started on a free port with the rules in `deploy/`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from .http import Client, ClientError
from .runtime import free_port

PACKAGE = Path(__file__).resolve().parent.parent  # magnitude_jupyter/
RULES_PACKAGED = PACKAGE / "deploy" / "prometheus" / "magnitude-rules.yml"  # in the wheel
RULES_SOURCE = PACKAGE.parent / "deploy" / "prometheus" / "magnitude-rules.yml"


def rules_path() -> Path:
    """The Prometheus rules the lesson loads: the wheel's copy, else the source checkout's."""
    return RULES_PACKAGED if RULES_PACKAGED.is_file() else RULES_SOURCE


TOPICS = ("a lighthouse", "a library", "a glacier", "a bakery", "a volcano", "a harbour", "a vineyard", "a comet")


@dataclass
class LoadResult:
    """What the clients saw: the time to first token of every answer served, and the refusals."""

    seconds: float
    ttft_ms: list[float] = field(default_factory=list)
    shed: int = 0  # 503 with Retry-After: the server predicted the objective would break
    errors: int = 0

    @property
    def ttft_p95_ms(self) -> float | None:
        if not self.ttft_ms:
            return None
        ordered = sorted(self.ttft_ms)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]

    def verdict(self, kept: bool | None) -> str:
        """What happened, in a sentence the lesson's text can rest on: written from the outcome, `kept`
        being the server's own judgement of the objective (`objective_holds`), the colour it shows."""
        if kept is None:
            return "The server has not judged the objective yet: too few answers."
        if kept and self.shed:
            return (
                "The answers served kept the objective (it holds); the requests that would have missed it "
                "were refused at once."
            )
        if kept:
            return (
                "The objective held: this machine served the load within it. Try more people "
                "(people * 2) to see it break."
            )
        if self.shed:
            return (
                "The answers served still missed the objective (BROKEN): the server let in more than two slots "
                "serve in time (its prediction learns from the answers it has seen: a burst at the start "
                "has little to learn from). Run the cell again, or give the objective more room."
            )
        return "The objective broke (BROKEN): most answers waited in the queue longer than it allows."

    def summary(self, objective_ms: float) -> str:
        p95 = self.ttft_p95_ms
        within = sum(1 for t in self.ttft_ms if t <= objective_ms)
        served = len(self.ttft_ms)
        text = f"{served} answers in {self.seconds:.0f} s"
        if served:
            text += f", TTFT p95 {p95:,.0f} ms against {objective_ms:,.0f} ({within / served:.0%} within)"
        if self.shed:
            text += f"; {self.shed} refused at once (503, come back later)"
        if self.errors:
            text += f"; {self.errors} failed"
        return text


def drive_load(client: Client, seconds: float, clients: int = 8, max_tokens: int = 24) -> LoadResult:
    """`clients` people asking at once, each a new question as soon as the last one is answered (a
    refused one waits a second), for `seconds`: more than the server's slots, so requests queue."""
    result = LoadResult(seconds)
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def person(k: int) -> None:
        n = 0
        while time.monotonic() < end:
            topic = TOPICS[(k + n) % len(TOPICS)]
            question = f"Person {k}, question {n}: describe {topic} in three sentences, for a child."
            n += 1
            started = time.monotonic()
            try:
                resp = client.open_chat_stream([{"role": "user", "content": question}], max_tokens=max_tokens)
            except ClientError:
                with lock:
                    result.errors += 1
                continue
            try:
                if resp.status_code == 503:
                    with lock:
                        result.shed += 1
                    time.sleep(1.0)
                    continue
                first = _first_token_time(resp) if resp.status_code == 200 else None
                with lock:
                    if first is None:
                        result.errors += 1
                    else:
                        result.ttft_ms.append(1000 * (first - started))
            except httpx.HTTPError:
                with lock:
                    result.errors += 1
            finally:
                resp.close()

    threads = [threading.Thread(target=person, args=(k,), daemon=True) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return result


def _first_token_time(resp: httpx.Response) -> float | None:
    """When the first piece of answer text arrived (the stream read to its end)."""
    first = None
    for line in resp.iter_lines():
        if first is not None or not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choices = json.loads(line[6:]).get("choices") or [{}]
        if (choices[0].get("delta") or {}).get("content"):
            first = time.monotonic()
    return first


def objective_holds(client: Client) -> bool | None:
    """The server's judgement of its (first) objective now: held, broken, or not judged yet (None)."""
    objectives = (client.status().get("slo") or {}).get("objectives", [])
    return objectives[0]["holds"] if objectives else None


def objective_lines(client: Client) -> list[str]:
    """The objectives as the server judges them now, as the Lab panel shows them (green, amber, red)."""
    lines = []
    for o in (client.status().get("slo") or {}).get("objectives", []):
        now = "no requests yet" if o["current"] is None else f"{o['current']:,.0f} ms"
        within = "" if o["compliance"] is None else f", {o['compliance']:.0%} within"
        verdict = {True: "holds", False: "BROKEN", None: "not judged yet"}[o["holds"]]
        lines.append(f"[{o['color']}] {o['what']}: {now} (objective {o['objective']:,.0f} ms){within}: {verdict}")
    return lines


class Prometheus:
    """A real Prometheus scraping one server every second with the shipped rules, their 5-minute
    alert delay shortened to `alert_after` (a workshop has no five minutes to wait); None from
    `start` where Prometheus is not installed."""

    def __init__(self, binary: str, server_url: str, token: str | None, alert_after: str) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="magnitude-prometheus-")
        folder = Path(self._tmp.name)
        rules = rules_path()
        (folder / "magnitude-rules.yml").write_text(rules.read_text().replace("for: 5m", f"for: {alert_after}"))
        (folder / "token").write_text(token or "none")
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["magnitude-rules.yml"],
            "scrape_configs": [
                {
                    "job_name": "magnitude",
                    "authorization": {"credentials_file": "token"},
                    "static_configs": [{"targets": [server_url.removeprefix("http://")]}],
                }
            ],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                binary,
                "--config.file=prometheus.yml",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    @classmethod
    def start(cls, server_url: str, token: str | None, alert_after: str = "5s") -> Prometheus | None:
        binary = shutil.which("prometheus")
        return cls(binary, server_url, token, alert_after) if binary else None

    def alert_states(self, alert: str = "MagnitudeSloBroken") -> list[str]:
        """The states `alert` is in now, as Prometheus's own API says (pending, firing)."""
        try:
            alerts = httpx.get(f"{self.url}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        except (httpx.HTTPError, ValueError, KeyError):
            return []
        return sorted({a["state"] for a in alerts if a["labels"].get("alertname") == alert})

    def watch(self, seconds: float, alert: str = "MagnitudeSloBroken") -> list[str]:
        """The states `alert` went through over `seconds`, in order, until it fires."""
        seen: list[str] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end and "firing" not in seen:
            for state in self.alert_states(alert):
                if state not in seen:
                    seen.append(state)
            time.sleep(0.5)
        return seen

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        finally:
            self._tmp.cleanup()
