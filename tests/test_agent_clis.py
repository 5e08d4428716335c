"""The agents our users run, installed as they install them, configured as their own docs say,
against a real `magnitude serve`: Claude Code (default tools, `--tools ""`, and an older release
whose tool schemas use `propertyNames`), Codex CLI, Pi Agent (its docs' minimal custom provider)
and Hermes Agent (its documented non-interactive setup).

Their first turns carry 6,000-13,000 tokens of system prompt and tool schemas (Claude Code's 21,000
by Anthropic's count), and Hermes Agent refuses a model whose context is under 64k. They run on a
tiny model with the bundled model's tokenizer and template and a 64k context
(`tiny_models.write_agent_model`): the whole turn is computed in seconds, and the answer is "Hi!"
by construction. On the bundled model (8,192 cells) Claude Code must get the server's context
error, in words. `.ci/run` installs the agents into ~/.cache/magnitude-agents; elsewhere these
tests are skipped unless MAGNITUDE_REQUIRE_AGENT_CLIS is set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from magnitude_jupyter.client.runtime import LocalServer

pytestmark = pytest.mark.model

AGENTS_DIR = Path(os.environ.get("MAGNITUDE_AGENTS_DIR") or Path.home() / ".cache" / "magnitude-agents")
CLAUDE_CODE = AGENTS_DIR / "node_modules" / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
# The release whose TaskCreate schema holds `propertyNames` (a keyword no grammar holds).
OLDER_CLAUDE_CODE = AGENTS_DIR / "claude-code-2.1.197" / CLAUDE_CODE.relative_to(AGENTS_DIR)
CODEX = AGENTS_DIR / "node_modules" / ".bin" / "codex"
PI = AGENTS_DIR / "node_modules" / "@mariozechner" / "pi-coding-agent" / "dist" / "cli.js"
HERMES = AGENTS_DIR / "hermes" / "bin" / "hermes"
AGENT_TOKEN = "agent-token-123"  # Hermes Agent takes a key of 4 characters or more only
ANSWER = "Hi!"  # what the agent model answers (tiny_models.AGENT_ANSWER)


def installed(path: Path, package: str) -> None:
    if path.exists() and shutil.which("node"):
        return
    if os.environ.get("MAGNITUDE_REQUIRE_AGENT_CLIS"):
        pytest.fail(f"{package} is not installed at {path} (.ci/run installs it)")
    pytest.skip(f"{package} is not installed: npm install --prefix {AGENTS_DIR} {package}")


def claude_code() -> list[str]:
    installed(CLAUDE_CODE, "@anthropic-ai/claude-code")
    return ["node", str(CLAUDE_CODE)]


@pytest.fixture(scope="module")
def agent_serve(tmp_path_factory, model_path):
    """`magnitude serve` on the agent model: 64k cells for two sessions."""
    from magnitude_jupyter.models.tiny_models import AGENT_CONTEXT, write_agent_model

    model = write_agent_model(tmp_path_factory.mktemp("agent-model") / "tiny-agent.gguf", model_path)
    server = LocalServer(
        ("--model", str(model), "--parallel", "2", "--ctx-size", str(AGENT_CONTEXT)),
        token=AGENT_TOKEN,
        config="engine:\n  default_max_tokens: 256\n",
    )
    yield server
    server.stop()


def run(command: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


def claude_code_env(url: str, token: str, home: Path, model: str) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_API_KEY": token,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }


def test_claude_code_gets_the_servers_context_error_in_words(serve, tmp_path):
    command = claude_code()
    env = claude_code_env(serve.url, serve.token, tmp_path, "smollm2-135m")
    done = subprocess.run(
        [*command, "-p", "Say hi"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    # Every field it sent was understood: the one error is the context, with the numbers.
    assert "the prompt is" in output and "context holds 8192" in output, output[-2000:]
    assert "is not a field" not in output and "not a valid JSON Schema" not in output


CODEX_CONFIG = """model = "tiny-agent"
model_provider = "magnitude"

[model_providers.magnitude]
name = "magnitude"
base_url = "{url}/v1"
env_key = "MAGNITUDE_TOKEN"
wire_api = "responses"
"""


@pytest.mark.parametrize("tools", ["default", "none"])
def test_claude_code_completes_a_turn(agent_serve, tmp_path, tools):
    command = [*claude_code(), "-p", "Say hi", *(["--tools", ""] if tools == "none" else [])]
    output = run(command, claude_code_env(agent_serve.url, agent_serve.token, tmp_path, "tiny-agent"), tmp_path)
    assert ANSWER in output and "API Error" not in output, output[-3000:]


def test_an_older_claude_code_whose_schemas_use_property_names_completes_a_turn(agent_serve, tmp_path):
    installed(OLDER_CLAUDE_CODE, "@anthropic-ai/claude-code@2.1.197")
    command = ["node", str(OLDER_CLAUDE_CODE), "-p", "Say hi"]
    output = run(command, claude_code_env(agent_serve.url, agent_serve.token, tmp_path, "tiny-agent"), tmp_path)
    assert ANSWER in output and "API Error" not in output, output[-3000:]


def test_codex_cli_completes_a_turn_over_the_responses_api(agent_serve, tmp_path):
    installed(CODEX, "@openai/codex")
    (tmp_path / ".codex").mkdir()
    (tmp_path / ".codex" / "config.toml").write_text(CODEX_CONFIG.format(url=agent_serve.url))
    work = tmp_path / "work"
    work.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "MAGNITUDE_TOKEN": agent_serve.token}
    output = run([str(CODEX), "exec", "--skip-git-repo-check", "Say hi"], env, work)
    assert ANSWER in output and "tokens used" in output and "ERROR" not in output, output[-3000:]


def test_pi_agent_completes_a_turn_with_its_docs_minimal_provider(agent_serve, tmp_path):
    installed(PI, "@mariozechner/pi-coding-agent")
    # docs/models.md, "Minimal Example": the API, a key, and each model's id.
    provider = {"baseUrl": f"{agent_serve.url}/v1", "api": "openai-completions", "apiKey": agent_serve.token}
    config = {"providers": {"magnitude": {**provider, "models": [{"id": "tiny-agent"}]}}}
    (tmp_path / ".pi" / "agent").mkdir(parents=True)
    (tmp_path / ".pi" / "agent" / "models.json").write_text(json.dumps(config))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PI_OFFLINE": "1"}
    command = ["node", str(PI), "-p", "Say hi", "--provider", "magnitude", "--model", "tiny-agent"]
    output = run(command, env, tmp_path)
    assert ANSWER in output and "400" not in output, output[-3000:]


def test_hermes_agent_learns_the_context_and_completes_a_turn(agent_serve, tmp_path):
    installed(HERMES, "hermes-agent (PyPI)")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    # Its non-interactive setup, as `hermes setup` prints it.
    for key, value in (
        ("model.provider", "custom"),
        ("model.base_url", f"{agent_serve.url}/v1"),
        ("model.default", "tiny-agent"),
        ("model.api_key", agent_serve.token),
    ):
        run([str(HERMES), "config", "set", key, value], env, tmp_path)
    output = run([str(HERMES), "-z", "Say hi"], env, tmp_path)
    # It asks for 64k of context or refuses to start: it learnt the model's from the server.
    assert ANSWER in output and "below the minimum" not in output, output[-3000:]
