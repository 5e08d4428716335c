"""OpenAI's embeddings API with the official `openai` SDK, against the real app and engine."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

pytestmark = pytest.mark.model


@pytest.fixture
def client(inproc):
    return openai.OpenAI(base_url=inproc.url + "/v1", api_key=inproc.token, max_retries=0, timeout=300)


def test_texts_become_unit_vectors_in_order_and_the_same_text_the_same_vector(client):
    texts = [
        "The lighthouse keeper lit the lamp.",
        "Bread rises in a warm oven.",
        "The lighthouse keeper lit the lamp.",
    ]
    result = client.embeddings.create(model="smollm2-135m", input=texts)
    vectors = [np.array(item.embedding) for item in sorted(result.data, key=lambda d: d.index)]
    assert [item.index for item in result.data] == [0, 1, 2]
    assert all(abs(np.linalg.norm(v) - 1.0) < 1e-4 for v in vectors)
    # Exactly the same tokens through the same decode, alone or batched: the same vector, up to float noise.
    assert np.dot(vectors[0], vectors[2]) > 0.999
    assert np.dot(vectors[0], vectors[1]) < 0.999
    assert result.usage.prompt_tokens > 0


def test_token_arrays_and_base64_work(client):
    result = client.embeddings.create(model="smollm2-135m", input=[[1, 2, 3, 4], [5, 6, 7]], encoding_format="base64")
    assert len(result.data) == 2
    raw = client.embeddings.with_raw_response.create(model="smollm2-135m", input="hello", encoding_format="base64")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    vector = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert abs(np.linalg.norm(vector) - 1.0) < 1e-4


def test_what_cannot_be_honoured_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="smollm2-135m", input="hi", dimensions=64)
    assert "dimensions" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="smollm2-135m", input="word " * 5000)
    assert "input 0" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="smollm2-135m", input=[[1, 2, 10**9]])
    assert "vocabulary" in str(caught.value)
