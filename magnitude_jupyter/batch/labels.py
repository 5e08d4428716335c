"""One label per row, chosen by likelihood: what the model thinks of each label, not what it rambles.

A 135M model asked for "one word: positive or negative" often starts a sentence instead. So each
label is scored on its own, as evaluation harnesses score multiple choice: the answer is held to
that label by a llama.cpp grammar, and the model's own probability of the label's tokens (its
distribution before the grammar narrowed it) is read back. The most likely label is the answer, and
the probabilities renormalized over the labels say how sure the model was: 0.5 and 0.5 is a coin
toss. The prompt is the same for every label, so the prefix cache computes it once per row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence


def parse_labels(value: str | Sequence[str] | None) -> list[str]:
    """Labels from a list or a comma-separated string; each non-empty, none twice."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    labels = [str(item).strip() for item in items]
    if not labels or any(not label for label in labels):
        raise ValueError(f"--labels: give non-empty labels separated by commas, got {value!r}")
    if len(set(labels)) != len(labels):
        raise ValueError(f"--labels: a label is given twice in {value!r}")
    return labels


def labels_grammar(labels: Sequence[str]) -> str:
    """GBNF that admits exactly one of the labels (JSON string escapes are GBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(label, ensure_ascii=False) for label in labels)


def probability_column(label: str) -> str:
    return f"p_{label}"


def label_shares(likelihoods: dict[str, float]) -> dict[str, float | None]:
    """Each label's likelihood as a share of all the labels' (None for all when every one is 0)."""
    total = sum(likelihoods.values())
    if total <= 0:
        return dict.fromkeys(likelihoods)
    return {label: value / total for label, value in likelihoods.items()}
