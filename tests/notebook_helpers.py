"""Run notebooks in a real IPython kernel (nbclient)."""

from __future__ import annotations

import nbformat
from nbclient import NotebookClient


def run_notebook(cells: list[str], tmp_path, timeout: int = 300, allow_errors: bool = False):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=allow_errors,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    return nb


def text_outputs(cell) -> str:
    out = []
    for output in cell.outputs:
        if output.output_type == "stream":
            out.append(output.text)
        elif output.output_type in ("display_data", "execute_result"):
            out.append(output.data.get("text/plain", ""))
        elif output.output_type == "error":
            out.append("\n".join(output.traceback))
    return "".join(out)
