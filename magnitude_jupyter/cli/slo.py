"""`magnitude slo`: each objective of the running server, its value now and whether it holds."""

from __future__ import annotations

import json
from typing import Any

import click

MARKS = {"green": "holds", "amber": "holds, burning its budget", "red": "BROKEN", "grey": "no requests yet"}


def slo_lines(slo: dict[str, Any], model: str) -> list[str]:
    """The objectives of one model as a table, in words."""
    objectives = slo.get("objectives") or []
    if not objectives:
        return [f"{model}: no objectives set (slo: in the config, or magnitude serve --slo-ttft-p95-ms ...)"]
    window = slo.get("window_s", 0)
    lines = [f"{model}, over the last {window:g} s:"]
    lines.append(
        f"  {'objective':<20} {'limit':>10} {'now':>10} {'within':>8} {'burn':>6} {'budget left':>11} "
        f"{'requests':>9}  state"
    )
    for o in objectives:
        unit = o["unit"]
        bound = ">=" if unit == "tok/s" else "<="
        now = f"{o['current']:,.0f}" if o["current"] is not None and unit == "ms" else _num(o["current"], ".1f")
        lines.append(
            f"  {o['what']:<20} {bound}{o['objective']:>8,.0f} {now:>10} {_num(o['compliance'], '.1%'):>8} "
            f"{_num(o['burn_rate'], '.2f'):>6} {_num(o['budget_left'], '.0%'):>11} {o['requests']:>9}  "
            + MARKS[o["color"]]
        )
    return lines


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


@click.command("slo")
@click.option("--model", default=None, help="This model's objectives (default: the server's default model).")
@click.option("--url", default=None, help="Server URL ending before /v1 (default: the running one).")
@click.option("--token", default=None, envvar="MAGNITUDE_TOKEN", help="Bearer token for --url.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def slo_cmd(model: str | None, url: str | None, token: str | None, as_json: bool) -> None:
    """Each service-level objective of the running server: its value over the window, the share of
    requests within it, the error budget left, and whether it holds. Exits 1 when one is broken."""
    from ..client.http import Client, ClientError, discover

    try:
        client = Client(url, token, source="--url") if url else discover(start=False)
        status = client.status(model)
    except ClientError as exc:
        raise click.ClickException(str(exc)) from exc
    slo = status.get("slo") or {}
    if as_json:
        click.echo(json.dumps({"model": status.get("model"), **slo}, indent=2))
    else:
        for line in slo_lines(slo, str(status.get("model"))):
            click.echo(line)
    if any(o.get("holds") is False for o in slo.get("objectives") or []):
        raise SystemExit(1)
