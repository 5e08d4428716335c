"""The magics in real kernels (nbclient) against a real `magnitude serve`."""

from __future__ import annotations

import json

import pytest

from magnitude_jupyter.client.http import Client
from magnitude_jupyter.magics.prompt_cell import CUT_MARK

from .conftest import SECOND_MODEL
from .notebook_helpers import run_notebook, text_outputs
from .proxy import DroppingProxy

pytestmark = pytest.mark.model


def test_prompt_streams_interpolates_and_stores(connected, tmp_path):
    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            'topic = "the sea"\nnumbers = [3, 4]',
            "%%magnitude -o line --max-tokens 24\nWrite one sentence about {topic} and the number {numbers[1]}. {{ok}}",
            "print(repr(line)); print(_magnitude == line)",
            "%%magnitude -f json --max-tokens 48\nReply with only this JSON object and nothing else: "
            '{{"city": "Paris"}}',
            "print(type(_magnitude).__name__, sorted(_magnitude))",
        ],
        tmp_path,
    )
    # -f json asks the server for a JSON object (a grammar holds the answer to it) and parses it
    assert text_outputs(nb.cells[5]).split()[0] == "dict"
    (json_display,) = [o for o in nb.cells[4].outputs if o.output_type == "display_data"]
    assert json_display.metadata["magnitude"]["sampling"]["response_format"] == {"type": "json_object"}
    magic = nb.cells[2]
    (display,) = [o for o in magic.outputs if o.output_type == "display_data"]
    meta = display.metadata["magnitude"]
    assert meta["model"] == "smollm2-135m" and meta["engine"] == "magnitude"
    assert meta["usage"]["completion_tokens"] <= 24 and meta["sampling"]["reproducible"] is True
    assert len(meta["model_sha256"]) == 64 and meta["timings"]["ttft_ms"] > 0
    printed = text_outputs(nb.cells[3]).splitlines()
    assert printed[1] == "True"
    # The panel names the cell each request came from (nbclient gives no notebook path: "notebook").
    recent = Client(connected.url, connected.token).status()["recent"]
    cells = {r["origin"] for r in recent if (r.get("origin") or "").startswith("notebook · cell ")}
    # The two %%magnitude cells, each by its execution number, as In [N] shows it.
    assert {f"notebook · cell {nb.cells[i].execution_count}" for i in (2, 4)} <= cells, cells
    # The stored answer is what the cell showed, less the mark of an answer --max-tokens cut.
    cut = CUT_MARK if meta["finish_reason"] == "length" else ""
    assert display.data["text/plain"] == eval(printed[0]) + cut


def test_dataframe_batch_keeps_order_and_reports_failed_rows(connected, tmp_path):
    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            "import pandas as pd\n"
            'reviews = [f\'Review {i}: the product was {"great" if i % 2 else "bad"}.\' for i in range(50)]\n'
            "reviews[17] = 'word ' * 9000  # too long for the context: this row fails\n"
            "df = pd.DataFrame({'review': reviews}, index=[f'r{i}' for i in range(50)])",
            "%%magnitude --df df -o scored --concurrency 8 --max-tokens 4\n"
            "Is this review positive or negative? {{ review }}",
            "print(list(scored.index) == list(df.index), scored['answer'].notna().sum(), "
            "scored.loc['r17', 'error'] is not None, scored.drop(index='r17')['error'].isna().all(), "
            "list(df.columns) == ['review'])",
        ],
        tmp_path,
    )
    assert "49 of 50 rows scored, 1 failed" in text_outputs(nb.cells[2])
    assert text_outputs(nb.cells[3]).split() == ["True", "49", "True", "True", "True"]


def test_dataframe_batch_with_a_json_schema_fills_columns(connected, tmp_path):
    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            "import pandas as pd\n"
            "df = pd.DataFrame({'review': ['Loved it, works great.', 'Broke on day one.', 'Fine for the price.']})\n"
            "schema = {'type': 'object', 'required': ['sentiment', 'stars'], 'properties': {\n"
            "    'sentiment': {'type': 'string', 'enum': ['positive', 'negative']}, 'stars': {'type': 'integer'}}}",
            "%%magnitude --df df --json-schema schema -o scored --max-tokens 32\n"
            "Rate this review as JSON with sentiment and stars (1-5): {{ review }}",
            "print(scored['sentiment'].isin(['positive', 'negative']).all(), scored['error'].isna().all(), "
            "all(isinstance(s, int) for s in scored['stars']), type(scored['answer'].iloc[0]).__name__)",
            "%magnitude batch df --template 'Say {{ review }}' --json-schema '{\"properties\": {\"review\": {}}}'",
        ],
        tmp_path,
        allow_errors=True,
    )
    assert "3 of 3 rows scored" in text_outputs(nb.cells[2])
    assert text_outputs(nb.cells[3]).split() == ["True", "True", "True", "dict"]
    (error,) = [o for o in nb.cells[4].outputs if o.output_type == "error"]
    assert len(error.traceback) == 1 and "'review' would overwrite" in error.traceback[0]


def test_interrupt_keeps_finished_rows_and_checkpoint_finishes(connected, tmp_path):
    checkpoint = tmp_path / "rows.jsonl"
    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            "import pandas as pd, pathlib, threading, time, _thread\n"
            "df = pd.DataFrame({'text': [f'Tell me a fact about the number {i}.' for i in range(40)]})",
            # interrupt once two rows are in the checkpoint: finished rows exist, most are still to do
            f"def interrupt_after_two_rows(path=pathlib.Path({str(checkpoint)!r})):\n"
            "    while not (path.exists() and path.read_text().count(chr(10)) >= 2):\n"
            "        time.sleep(0.05)\n"
            "    _thread.interrupt_main()\n"
            "threading.Thread(target=interrupt_after_two_rows, daemon=True).start()\n"
            f"%magnitude batch df --template 'Q: {{{{ text }}}}' --concurrency 4 --max-tokens 24 "
            f"--checkpoint {checkpoint} -o first",
            "done_first = first['error'].isna().sum(); print(done_first, first.attrs['magnitude']['interrupted'])",
            f"%magnitude batch df --template 'Q: {{{{ text }}}}' --concurrency 4 --max-tokens 24 "
            f"--checkpoint {checkpoint} -o second",
            "print(second['error'].isna().sum(), second.attrs['magnitude']['skipped_from_checkpoint'] == done_first)",
        ],
        tmp_path,
        timeout=600,
    )
    first_done, interrupted = text_outputs(nb.cells[3]).split()
    assert interrupted == "True" and 0 < int(first_done) < 40
    assert "interrupted" in text_outputs(nb.cells[2])
    assert text_outputs(nb.cells[5]).split() == ["40", "True"]
    rows = [json.loads(line)["row"] for line in checkpoint.read_text().splitlines()]
    assert sorted(rows, key=int) == [str(i) for i in range(40)]  # every row once: none scored twice


def test_dropped_connection_resumes_with_identical_text(server, monkeypatch, tmp_path):
    proxy = DroppingProxy(server.port, cut_after=6)
    monkeypatch.setenv("MAGNITUDE_URL", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("MAGNITUDE_TOKEN", server.token)
    try:
        nb = run_notebook(
            [
                "%load_ext magnitude_jupyter",
                "%%magnitude -o resumed --max-tokens 40\nTell me about lighthouses.",
                "%%magnitude -o again --max-tokens 40\nTell me about lighthouses.",
                "print(resumed == again, len(resumed) > 20)",
            ],
            tmp_path,
        )
    finally:
        proxy.close()
    assert proxy.cuts == 1
    meta = next(o for o in nb.cells[1].outputs if o.output_type == "display_data").metadata["magnitude"]
    assert meta["resumed"] >= 1
    assert text_outputs(nb.cells[3]).split() == ["True", "True"]


def test_bad_input_gives_one_clear_line(connected, tmp_path, monkeypatch):
    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            "import pandas as pd\ndf = pd.DataFrame({'review': ['fine']})",
            "%%magnitude --df df\nClassify {{ review }",
            "%%magnitude --df df\nClassify {{ rating }}",
            "%%magnitude --temperature hot\nHello",
            "%%magnitude\nHello {undefined_name}",
            "%magnitude connect http://127.0.0.1:9",
            "%%magnitude --json\nHello",
        ],
        tmp_path,
        allow_errors=True,
    )
    errors = []
    for cell in nb.cells[2:]:
        (error,) = [o for o in cell.outputs if o.output_type == "error"]
        assert len(error.traceback) == 1, error.traceback
        errors.append(error.traceback[0])
    assert all(e.startswith("magnitude: ") for e in errors)
    assert "template error" in errors[0]
    assert "'rating'" in errors[1] and "review" in errors[1]
    assert "--temperature" in errors[2]
    assert "{undefined_name}" in errors[3]
    assert "cannot reach" in errors[4]
    assert "-f json" in errors[5]


def test_kernel_interrupt_cancels_the_generation_on_the_server(connected, tmp_path):
    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            "import threading, _thread\nthreading.Timer(2.0, _thread.interrupt_main).start()",
            "%%magnitude --max-tokens 2000 --ignore-eos\nCount from 1 to 1000, separated by commas.",
            "import time\nfrom magnitude_jupyter.client.http import discover\nclient = discover()\n"
            "time.sleep(0.5)\nstatus = client.status()\n"
            "print(status['running'], status['recent'][0]['finish_reason'])",
        ],
        tmp_path,
        allow_errors=True,
    )
    (error,) = [o for o in nb.cells[2].outputs if o.output_type == "error"]
    # one line, not the HTTP client's traceback; the answer so far stays, marked
    assert error.ename == "MagnitudeError" and error.traceback == [
        "magnitude: interrupted: the answer so far is above; the server stopped generating it"
    ]
    (partial,) = [o for o in nb.cells[2].outputs if o.output_type == "display_data"]
    assert partial.data["text/plain"].endswith(" … (interrupted)")
    assert text_outputs(nb.cells[3]).split() == ["0", "cancelled"]


def display_meta(cell) -> dict:
    """The provenance a %%magnitude cell saved with its answer."""
    return next(o for o in cell.outputs if o.output_type == "display_data").metadata["magnitude"]


def test_a_conversation_sends_its_history_and_a_rerun_replaces_its_turn(connected, tmp_path):
    first = "%%magnitude --chat trip -s 'You are a travel agent.' --max-tokens 16\nI want to visit Lisbon."
    # The server's second model holds 2,048 cells: two turns of 1,100 tokens do not fit it.
    long_turn = f"%%magnitude --chat long --model {SECOND_MODEL} --max-tokens 4 {{}}\n{{}}: " + "word " * 1100
    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            first,
            "%%magnitude --chat trip --max-tokens 16 -o talk\nWhat should I eat there?",
            "h = %magnitude history trip\nprint(len(h), list(h.role), len(talk), talk[-1]['role'])",
            first,  # the cell that made turn 1 runs again: it replaces turn 1 and drops turn 2
            "h = %magnitude history trip\nprint(len(h))",
            "%magnitude chats",
            "%magnitude reset trip\n%magnitude chats",
            long_turn.format("", "First"),
            long_turn.format("", "Second"),  # 2 × 1,100 tokens do not fit 2,048 cells
            long_turn.format("--trim", "Second"),
        ],
        tmp_path,
        allow_errors=True,
        timeout=600,
    )
    one, two = (display_meta(nb.cells[i]) for i in (1, 2))
    assert one["conversation"] == {"name": "trip", "turn": 1, "trimmed": 0} and two["conversation"]["turn"] == 2
    # the second turn sent the first one with it, and found it in the prefix cache
    assert two["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"] + one["usage"]["completion_tokens"]
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= one["usage"]["prompt_tokens"]
    assert text_outputs(nb.cells[3]).split()[:2] == ["5", "['system',"] and text_outputs(nb.cells[3]).split()[-2:] == [
        "5",
        "assistant",
    ]
    assert text_outputs(nb.cells[5]).strip() == "3"  # system + one turn again
    assert "trip: 1 turns" in text_outputs(nb.cells[6])
    assert "no conversations yet" in text_outputs(nb.cells[7])
    (error,) = [o for o in nb.cells[9].outputs if o.output_type == "error"]
    assert len(error.traceback) == 1 and "no longer fits" in error.traceback[0] and "--trim" in error.traceback[0]
    trimmed = display_meta(nb.cells[10])
    assert trimmed["conversation"]["trimmed"] == 1 and trimmed["conversation"]["turn"] == 1


def test_embed_cells_give_vectors_for_lines_and_for_rows(connected, tmp_path):
    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            "%%magnitude --embed -o vectors\nThe kettle boils.\n\nThe kettle boils.\nSnow on the hills.",
            "import numpy as np; print(vectors.shape[0], round(float(vectors[0] @ vectors[1]), 3) >= 0.999)",
            "import pandas as pd\ndf = pd.DataFrame({'review': ['Boils fast.', 'Broke in a week.']})",
            "%%magnitude --df df --embed -o embedded\nReview: {{ review }}",
            "print(list(embedded.columns), embedded['error'].isna().all())",
            "%%magnitude --embed --system hi\nText",
        ],
        tmp_path,
        allow_errors=True,
    )
    assert "3 texts" in text_outputs(nb.cells[1])
    assert text_outputs(nb.cells[2]).split() == ["3", "True"]
    assert "2 of 2 rows embedded" in text_outputs(nb.cells[4])
    assert text_outputs(nb.cells[5]).strip() == "['review', 'embedding', 'error'] True"
    (error,) = [o for o in nb.cells[6].outputs if o.output_type == "error"]
    assert "--system" in error.evalue


def test_a_calibration_still_running_shows_itself_again_when_its_cell_runs_again(connected, tmp_path):
    """A page reloaded before saving loses the widget's output, not its run: the cell run again shows
    the running widget (its progress as it is now), and starts nothing new."""
    nb = run_notebook(
        [
            "%load_ext magnitude_jupyter",
            # at least 600 s a level: still running when the next cells run, whatever the machine
            "%magnitude calibrate --concurrency 1 --requests 1 --max-tokens 4 --min-seconds 600 --no-probe --start",
            "first = _magnitude_calibration\nagain = get_ipython().run_line_magic('magnitude', 'calibrate')",
            "print(again is first, first.running())\nfirst.stop()\nfirst.wait(120)\nprint(first.running())",
        ],
        tmp_path,
    )
    assert "still running in this kernel: here it is again" in text_outputs(nb.cells[2])
    assert text_outputs(nb.cells[3]).split() == ["True", "True", "False"]
