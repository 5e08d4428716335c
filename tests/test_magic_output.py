"""What the magics show a participant: the status in a few lines, a cut answer marked as cut."""

from __future__ import annotations

from magnitude_jupyter.client.http import StreamResult
from magnitude_jupyter.magics.prompt_cell import CUT_MARK, answer_bundle
from magnitude_jupyter.magics.server_commands import status_lines

STATUS = {
    "model": "smollm2-135m",
    "state": "ready",
    "parallel": 8,
    "running": 2,
    "waiting": 1.0,
    "kv_cells_total": 8192,
    "kv_cells_used": 2048,
    "recent_tokens_per_s": 57.25,
    "generated_tokens_total": 1234.0,
    "prefix_cache_hit_rate": 0.42,
    "slo": {
        "window_s": 300,
        "objectives": [
            {"what": "TTFT p95", "unit": "ms", "objective": 2000.0, "current": 850.4, "holds": True},
            {"what": "end-to-end p95", "unit": "ms", "objective": 8000.0, "current": None, "holds": None},
        ],
    },
}


def test_status_in_a_few_lines_with_integers_as_integers():
    assert status_lines(STATUS) == [
        "model      smollm2-135m (ready)",
        "slots      2 of 8 in use, 1 waiting",
        "KV cache   2,048 of 8,192 cells hold tokens (25%)",
        "speed      57.2 tokens/s now, 1,234 generated",
        "cache      42% of prompt tokens came from the cache",
        "objective  TTFT p95 850 ms (limit 2,000): holds",
        "objective  end-to-end p95 - ms (limit 8,000): no requests yet",
    ]
    assert status_lines({"object": "list"}) == ['{"object": "list"}']  # another server: what it says


def test_a_cut_answer_is_marked_where_it_is_shown_not_where_it_is_kept():
    cut = StreamResult(text="A large language model is", finish_reason="length")
    assert answer_bundle(cut) == {"text/plain": "A large language model is" + CUT_MARK}
    assert answer_bundle(StreamResult(text="Done.", finish_reason="stop")) == {"text/plain": "Done."}
