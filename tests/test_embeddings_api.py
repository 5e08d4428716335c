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


def test_embed_dataframe_keeps_order_fails_a_bad_row_alone_and_reuses_its_checkpoint(inproc, tmp_path):
    import pandas as pd

    from magnitude_jupyter.batch.embed import embed_dataframe, most_similar
    from magnitude_jupyter.client.http import Client

    texts = [f"Note {i}: the {'river' if i % 2 else 'mountain'} was {'cold' if i % 3 else 'quiet'}." for i in range(40)]
    texts[7] = "word " * 5000  # longer than one input may be: this row fails, the rest do not
    df = pd.DataFrame({"note": texts}, index=[f"n{i}" for i in range(40)])
    client = Client(inproc.url, inproc.token)
    checkpoint = tmp_path / "vectors.jsonl"
    out = embed_dataframe(df, "note", client, checkpoint=checkpoint, batch_rows=16, progress=False)
    assert list(out.index) == list(df.index) and list(df.columns) == ["note"]
    assert out.loc["n7", "embedding"] is None and "input 0" in out.loc["n7", "error"]
    good = out.drop(index="n7")
    assert good["error"].isna().all()
    assert all(abs(np.linalg.norm(v) - 1.0) < 1e-4 for v in good["embedding"])
    alone = client.embed([texts[12]])[0]
    assert np.dot(alone, out.loc["n12", "embedding"]) > 0.999  # batch order kept: row 12's own vector

    again = embed_dataframe(df, "note", client, checkpoint=checkpoint, progress=False)
    assert again.attrs["magnitude"]["skipped_from_checkpoint"] == 39
    assert np.allclose(np.stack(again.drop(index="n7")["embedding"]), np.stack(good["embedding"]), atol=1e-6)
    other = embed_dataframe(df.head(3), template="{{ note }}!", client=client, checkpoint=checkpoint, progress=False)
    assert other.attrs["magnitude"]["skipped_from_checkpoint"] == 0  # other texts: never a saved vector

    ranked = most_similar(out, texts[12], client=client, top=3)
    assert ranked.index[0] == "n12" and ranked["similarity"].is_monotonic_decreasing


def test_embed_dataframe_runs_in_process_on_an_engine(engine):
    import pandas as pd

    from magnitude_jupyter.batch.embed import embed_dataframe
    from magnitude_jupyter.batch.inprocess import EngineClient

    df = pd.DataFrame({"q": ["A cat sleeps.", "Rain falls."]})
    out = embed_dataframe(df, "q", EngineClient(engine), progress=False)
    assert out["error"].isna().all() and len(out.loc[0, "embedding"]) == engine.model_info.embedding_length
