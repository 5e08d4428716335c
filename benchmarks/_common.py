"""Shared bits of the benchmark scripts: prompts and table printing."""

from __future__ import annotations

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works to a child.",
    "List ten uses for a paperclip:",
    "The history of the printing press",
    "Describe the water cycle in detail.",
    "Write a letter to a friend about your summer.",
    "What are the benefits of regular exercise?",
    "Once upon a time, in a distant kingdom,",
    "Give step-by-step instructions to bake bread.",
    "Summarize the plot of a mystery novel you invent.",
    "Why is the sky blue? Explain thoroughly.",
    "Write a product review for a pair of headphones.",
    "Describe a walk through a busy city market.",
    "Explain the rules of chess briefly.",
    "Write a poem about the ocean at night.",
    "What makes a good teacher? Discuss.",
]


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)
