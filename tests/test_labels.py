"""--labels: every answer one of the labels, chosen by the model's likelihood of each, with its share."""

from __future__ import annotations

import pandas as pd
import pytest

from magnitude_jupyter.batch.inprocess import EngineClient
from magnitude_jupyter.batch.labels import label_shares, labels_grammar, parse_labels
from magnitude_jupyter.batch.score import BatchError, score_dataframe

REVIEWS = pd.DataFrame(
    {"review": ["Boils fast and looks great.", "Flickers and died in a week.", "Quiet and strong airflow."]},
    index=["a", "b", "c"],
)


def test_labels_parse_into_a_grammar_and_shares():
    assert parse_labels("positive, negative") == ["positive", "negative"] == parse_labels(["positive", "negative"])
    for bad in ("a,,b", "a,a", ""):
        with pytest.raises(ValueError, match="--labels"):
            parse_labels(bad)
    assert labels_grammar(["yes", 'say "no"']) == r'root ::= "yes" | "say \"no\""'
    assert label_shares({"x": 3e-6, "y": 1e-6}) == pytest.approx({"x": 0.75, "y": 0.25})
    assert label_shares({"x": 0.0, "y": 0.0}) == {"x": None, "y": None}


@pytest.mark.model
def test_every_answer_is_a_label_with_the_model_s_share_of_each(engine):
    client = EngineClient(engine)
    template = "Is this review positive or negative? {{ review }}"
    out = score_dataframe(REVIEWS, template, client=client, labels="positive,negative", logprobs=True, progress=False)
    assert list(out.index) == list(REVIEWS.index) and out["error"].isna().all()
    assert set(out["answer"]) <= {"positive", "negative"}
    for _, row in out.iterrows():
        shares = {"positive": row["p_positive"], "negative": row["p_negative"]}
        assert sum(shares.values()) == pytest.approx(1.0)
        assert row["answer"] == max(shares, key=shares.get) and row["probability"] == shares[row["answer"]]
    # The same rows without --logprobs: the same answers, no probability columns.
    plain = score_dataframe(REVIEWS, template, client=client, labels=["positive", "negative"], progress=False)
    assert "p_positive" not in plain.columns and plain["answer"].isin(["positive", "negative"]).all()
    with pytest.raises(BatchError, match="does not combine with --json"):
        score_dataframe(REVIEWS, template, client=client, labels="x,y", json_object=True, progress=False)
    with pytest.raises(BatchError, match="a label is given twice"):
        score_dataframe(REVIEWS, template, client=client, labels="x,x", progress=False)
