"""A first start on a busy machine: the attention probe keeps to its time and never remembers what it
measured under contention, and whoever waits for a load waits while it makes progress, then says
where it stood. Fakes stand in for llama.cpp's decode and the clock (no wall time is asserted)."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Any, ClassVar

import pytest

from magnitude_jupyter.engine import attention_probe


class FakeLlama:
    """The few llama.cpp calls the probe makes; every decode advances a fake clock by `step_s`."""

    def __init__(self, clock: list[float], step_s: float) -> None:
        self.clock, self.step_s, self.decodes = clock, step_s, 0

    def llama_batch_init(self, *args: Any) -> Any:
        class Batch:
            def __init__(self) -> None:
                size = 4096
                self.token = [0] * size
                self.pos = [0] * size
                self.n_seq_id = [0] * size
                self.seq_id = [[0] for _ in range(size)]
                self.logits = [0] * size
                self.n_tokens = 0

        return Batch()

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        self.decodes += 1
        self.clock[0] += self.step_s
        return 0

    def llama_get_memory(self, ctx: Any) -> Any:
        return object()

    def llama_memory_seq_cp(self, *args: Any) -> None:
        pass

    def llama_memory_seq_rm(self, *args: Any) -> bool:
        return True

    def llama_batch_free(self, batch: Any) -> None:
        pass

    def llama_free(self, ctx: Any) -> None:
        pass


@pytest.fixture
def fake_probe(monkeypatch, tmp_path):
    clock = [0.0]
    monkeypatch.setattr(attention_probe.time, "perf_counter", lambda: clock[0])
    monkeypatch.setenv("MAGNITUDE_ATTENTION_FILE", str(tmp_path / "attention.json"))

    def run(step_s: float, others_cores: float = 0.0) -> tuple[Any, FakeLlama]:
        fake = FakeLlama(clock, step_s)
        monkeypatch.setattr(attention_probe, "llama_cpp", fake)
        # Other processes' CPU use, as the probe reads it: `others_cores` for every second of the fake clock.
        monkeypatch.setattr(attention_probe, "_busy_seconds", lambda: (clock[0] * (others_cores + 1), clock[0]))
        return fake, fake

    return run


def test_the_probe_keeps_to_its_time_budget_whatever_a_step_costs(fake_probe):
    """Steps ten times slower than a quiet machine's: the probe stops at its budget, in whichever phase."""
    fake, _ = fake_probe(step_s=2.0)
    with pytest.raises(attention_probe.ProbeNotTrusted, match="ran out"):
        attention_probe.measure(lambda *a: object(), 1000, 1024, 16, 512, budget_s=8.0)
    # Each decode advances the fake clock 2 s: past 8 s the probe stops, whatever phase it is in.
    assert fake.decodes <= 8.0 / 2.0 + 1


def test_a_quiet_measurement_is_remembered_with_its_conditions(fake_probe):
    fake_probe(step_s=0.01)
    choice = attention_probe.measure(lambda *a: object(), 1000, 256, 4, 512)
    assert choice.trusted and choice.others_cores == 0.0
    attention_probe.remember("key", choice)
    remembered = attention_probe.remembered("key")
    assert remembered is not None and remembered.others_cores == 0.0 and remembered.spread == choice.spread


def test_a_measurement_under_contention_is_never_remembered(fake_probe):
    fake_probe(step_s=0.01, others_cores=2.0)
    choice = attention_probe.measure(lambda *a: object(), 1000, 256, 4, 512)
    assert not choice.trusted and choice.others_cores == pytest.approx(2.0)
    attention_probe.remember("key", choice)
    assert attention_probe.remembered("key") is None


def test_the_default_for_the_cpu_family_is_named():
    flash, family = attention_probe.default_flash_attention()
    assert isinstance(flash, bool) and family


class _LoadingServer(http.server.BaseHTTPRequestHandler):
    """/health as a loading server answers it: a new phase on each of the first polls, then stuck."""

    phases: ClassVar[list[str]] = []
    polls: ClassVar[list[int]] = [0]

    def do_GET(self) -> None:
        n = self.polls[0]
        self.polls[0] += 1
        phase = self.phases[min(n, len(self.phases) - 1)]
        body = json.dumps({"status": "loading", "model": "m", "phase": phase, "progress": min(n, len(self.phases))})
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args: Any) -> None:
        pass


def test_a_waiter_follows_the_loads_progress_and_names_the_phase_where_it_stopped():
    from magnitude_jupyter.client.http import Client, ClientError

    phases = [f"measuring the attention kernels (step {i} of 40)" for i in range(1, 9)]
    _LoadingServer.phases, _LoadingServer.polls = phases, [0]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _LoadingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seen: list[str] = []
    try:
        client = Client(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(ClientError, match=r"no progress .* while measuring the attention kernels \(step 8 of 40\)"):
            client.wait_ready(on_progress=seen.append, stall_s=4.0)
    finally:
        server.shutdown()
    assert seen == phases  # told every phase, in order, once each


def test_the_cli_shows_each_phase_on_one_line_of_a_terminal(capsys, monkeypatch):
    from magnitude_jupyter.cli.main import _LoadProgress

    progress = _LoadProgress()
    progress.tty = False
    progress("reading the model file (40%)")
    progress("measuring the attention kernels (step 3 of 40)")
    err = capsys.readouterr().err
    assert "magnitude: reading the model file (40%)" in err and "step 3 of 40" in err


def test_a_request_waiting_for_its_model_is_listed_under_its_cells_name(model_path):
    """While the model loads, /status lists the request under the origin its client gave (the panel's
    Running list shows it there, with no cancel); once the engine has it, it is listed as the engine's."""
    import httpx

    from magnitude_jupyter.config import Settings
    from magnitude_jupyter.engine import Engine

    from .conftest import InProcessServer, wait_for

    engine = Engine(
        str(model_path), settings=Settings(), parallel=2, ctx_size=1024, prefix_cache_ram_mib=0, flash_attention=True
    )
    held = threading.Event()
    load = engine._runner_factory
    engine._runner_factory = lambda es: (held.wait(60), load(es))[1]  # the load waits for the test
    server = InProcessServer(engine)
    answers: list[httpx.Response] = []
    body = {
        "messages": [{"role": "user", "content": "Name three colours of the sky at dusk"}],
        "max_tokens": 2,
        "origin": "01_first_prompts.ipynb · cell 2",
    }
    url, headers = server.url, server.headers()
    calls = [
        lambda: httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120),
        # How the magics load the first model: the cell waits for the load, named.
        lambda: httpx.post(
            f"{url}/models/{engine.model_id}/load", json={"origin": "cell 1"}, headers=headers, timeout=120
        ),
    ]
    callers = [threading.Thread(target=lambda c=c: answers.append(c())) for c in calls]
    try:
        for caller in callers:
            caller.start()

        def listed() -> list[dict[str, Any]]:
            status = httpx.get(f"{url}/status", headers=headers, timeout=10).json()
            return [r for r in status["requests"] if r["status"] == "waiting for the model"]

        wait_for(lambda: len(listed()) == 2, what="both requests listed as waiting for their model")
        by_origin = {r["origin"]: r for r in listed()}
        assert by_origin["01_first_prompts.ipynb · cell 2"]["prompt_head"] == "Name three colours of the sky at dusk"
        assert "cell 1" in by_origin
        held.set()
        for caller in callers:
            caller.join(120)
        assert [a.status_code for a in answers] == [200, 200]
        assert listed() == []
    finally:
        held.set()
        server.stop()
        engine.shutdown()


def test_a_request_that_names_nobody_is_listed_under_its_client_program(inproc):
    """The official SDKs send no origin: the panel lists their requests under the program that sent
    them (its User-Agent), a request that gives a user under that user."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=inproc.url + "/v1", api_key=inproc.token, max_retries=0)
    asked = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Say hi"}], max_tokens=2
    )
    recent = httpx.get(f"{inproc.url}/status", headers=inproc.headers(), timeout=10).json()["recent"]
    (mine,) = [r for r in recent if r["id"] == asked.id]
    assert mine["origin"].startswith("OpenAI/Python ")
