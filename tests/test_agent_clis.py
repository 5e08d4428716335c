"""Claude Code and Codex CLI (the npm packages, as users install them) against a real `magnitude serve`.

Claude Code's first turn carries about 21,000 tokens of system prompt and tool schemas; the bundled
model's context holds 8,192. What must hold is that every part of the request is understood (its
fields, mid-conversation system messages, tool schemas with zod's bounds, long maxLengths, patterns)
and that Claude Code shows the server's context error, in words. Codex CLI's first turn (Responses
API, hosted tools, developer messages) fits, and completes. `.ci/run` installs both into
~/.cache/magnitude-agents; elsewhere the tests are skipped unless MAGNITUDE_REQUIRE_AGENT_CLIS is set.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

AGENTS_DIR = Path(os.environ.get("MAGNITUDE_AGENTS_DIR") or Path.home() / ".cache" / "magnitude-agents")
CLAUDE_CODE = AGENTS_DIR / "node_modules" / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
CODEX = AGENTS_DIR / "node_modules" / ".bin" / "codex"


def installed(path: Path, package: str) -> None:
    if path.exists() and shutil.which("node"):
        return
    if os.environ.get("MAGNITUDE_REQUIRE_AGENT_CLIS"):
        pytest.fail(f"{package} is not installed at {path} (.ci/run installs it)")
    pytest.skip(f"{package} is not installed: npm install --prefix {AGENTS_DIR} {package}")


def claude_code() -> list[str]:
    installed(CLAUDE_CODE, "@anthropic-ai/claude-code")
    return ["node", str(CLAUDE_CODE)]


def test_claude_code_gets_the_servers_context_error_in_words(serve, tmp_path):
    command = claude_code()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": serve.url,
        "ANTHROPIC_API_KEY": serve.token,
        "ANTHROPIC_MODEL": "smollm2-135m",
        "ANTHROPIC_SMALL_FAST_MODEL": "smollm2-135m",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    done = subprocess.run(
        [*command, "-p", "Say hi"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    # Every field it sent was understood: the one error is the context, with the numbers.
    assert "the prompt is" in output and "context holds 8192" in output, output[-2000:]
    assert "is not a field" not in output and "not a valid JSON Schema" not in output


CODEX_CONFIG = """model = "smollm2-135m"
model_provider = "magnitude"

[model_providers.magnitude]
name = "magnitude"
base_url = "{url}/v1"
env_key = "MAGNITUDE_TOKEN"
wire_api = "responses"
"""


def test_codex_cli_completes_a_turn_over_the_responses_api(serve, tmp_path):
    installed(CODEX, "@openai/codex")
    (tmp_path / ".codex").mkdir()
    (tmp_path / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(url=serve.url))
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "MAGNITUDE_TOKEN": serve.token}
    done = subprocess.run(
        [str(CODEX), "exec", "--skip-git-repo-check", "Say hi"],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "tokens used" in output and "ERROR" not in output, output[-3000:]
