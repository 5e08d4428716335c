"""`magnitude list --show-details` over a models_dir, as a test reads it."""

from __future__ import annotations

from click.testing import CliRunner


def listed_details(models_dir, tmp_path, monkeypatch) -> str:
    """The listing's text with `models_dir` as the config's folder (the bundled model listed too)."""
    from magnitude_jupyter.cli.main import main

    config = tmp_path / "config.yaml"
    config.write_text(f"models_dir: {models_dir}\n")
    monkeypatch.setenv("MAGNITUDE_CONFIG", str(config))
    result = CliRunner().invoke(main, ["list", "--show-details"])
    assert result.exit_code == 0, result.output
    return result.output
