"""Claude Code (the npm package, as users install it) against a real `magnitude serve`.

Its first turn carries about 21,000 tokens of system prompt and tool schemas; the bundled model's
context holds 8,192. What must hold is that every part of the request is understood (its fields,
mid-conversation system messages, tool schemas with zod's bounds, long maxLengths, patterns) and
that Claude Code shows the server's context error, in words. `.ci/run` installs the package into
~/.cache/magnitude-agents; elsewhere the test is skipped unless MAGNITUDE_REQUIRE_AGENT_CLIS is set.
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


def claude_code() -> list[str]:
    if CLAUDE_CODE.exists() and shutil.which("node"):
        return ["node", str(CLAUDE_CODE)]
    if os.environ.get("MAGNITUDE_REQUIRE_AGENT_CLIS"):
        pytest.fail(f"Claude Code is not installed at {CLAUDE_CODE} (.ci/run installs it)")
    pytest.skip(f"Claude Code is not installed: npm install --prefix {AGENTS_DIR} @anthropic-ai/claude-code")


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
