"""The client over connections that really break (a proxy cuts them mid-stream), against the real engine."""

from __future__ import annotations

import pytest

from magnitude_jupyter.client.http import Client, StreamResult
from magnitude_jupyter.engine import FinishReason

from .conftest import wait_for
from .proxy import DroppingProxy

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def proxy_url(proxy: DroppingProxy) -> str:
    return f"http://127.0.0.1:{proxy.port}"


def test_a_resumed_stream_loses_and_repeats_nothing(inproc):
    body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True, "reproducible": True}
    whole = Client(inproc.url, inproc.token).chat(MESSAGES, **body)
    proxy = DroppingProxy(port_of(inproc.url), cut_after=5)
    try:
        result = StreamResult()
        text = "".join(Client(proxy_url(proxy), inproc.token).stream_chat(MESSAGES, result=result, **body))
    finally:
        proxy.close()
    assert proxy.cuts == 1 and result.resumed == 1
    assert text == result.text == whole.text and result.usage["completion_tokens"] == 40


def test_ctrl_c_after_a_resume_cancels_the_generation_on_the_server(inproc, engine):
    proxy = DroppingProxy(port_of(inproc.url), cut_after=5)
    try:
        result = StreamResult()
        pieces = Client(proxy_url(proxy), inproc.token).stream_chat(
            MESSAGES, result=result, max_tokens=3000, temperature=0, ignore_eos=True
        )
        after_resume = 0
        for _ in pieces:
            after_resume += result.resumed
            if after_resume >= 3:
                break  # reading the re-attached stream now
        assert result.resumed == 1
        with pytest.raises(KeyboardInterrupt):
            pieces.throw(KeyboardInterrupt)
    finally:
        proxy.close()
    request = engine.get_request(result.id)
    # Nobody reads it any more: without the cancel it would run on for the 60 s grace period.
    wait_for(lambda: request.is_finished, timeout=15, what="the generation to be cancelled")
    assert request.finish_reason == FinishReason.CANCELLED
