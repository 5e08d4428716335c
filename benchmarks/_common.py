"""Shared bits of the benchmark scripts: prompts, table printing, and `magnitude serve` in a child process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from magnitude_jupyter.client import Client

TOKEN = "bench-token"

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works to a child.",
    "List ten uses for a paperclip:",
    "The history of the printing press",
    "Describe the water cycle in detail.",
    "Write a letter to a friend about your summer.",
    "What are the benefits of regular exercise?",
    "Once upon a time, in a distant kingdom,",
    "Give step-by-step instructions to bake bread.",
    "Summarize the plot of a mystery novel you invent.",
    "Why is the sky blue? Explain thoroughly.",
    "Write a product review for a pair of headphones.",
    "Describe a walk through a busy city market.",
    "Explain the rules of chess briefly.",
    "Write a poem about the ocean at night.",
    "What makes a good teacher? Discuss.",
]


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class MagnitudeServer:
    """`magnitude serve` with its own config file and runtime folder; returns once the model is loaded."""

    def __init__(
        self,
        config: str = "",
        parallel: int = 8,
        threads: int | None = None,
        ctx_size: int = 8192,
        model: str | Path | None = None,
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        config_path = Path(self._tmp.name) / "config.yaml"
        config_path.write_text(config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {
            **os.environ,
            "MAGNITUDE_CONFIG": str(config_path),
            "MAGNITUDE_RUNTIME_DIR": str(Path(self._tmp.name) / "runtime"),
        }
        cmd = [sys.executable, "-m", "magnitude_jupyter.cli", "serve", "--port", str(self.port), "--token", TOKEN]
        cmd += ["--parallel", str(parallel), "--ctx-size", str(ctx_size)]
        if threads is not None:
            cmd += ["--threads", str(threads)]
        if model is not None:
            cmd += ["--model", str(model)]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = Client(self.url, TOKEN)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.client.wait_ready(timeout=2)
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("magnitude serve did not start") from None
                time.sleep(0.3)

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            stop_process(self.proc)
        self._tmp.cleanup()

    def __enter__(self) -> MagnitudeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
