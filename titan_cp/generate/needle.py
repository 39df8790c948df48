"""Needle in a haystack: is a fact recalled wherever it sits in a long context?

For each context length ``L`` and depth ``d`` (a fraction of the haystack), ``trials`` contexts of
exactly ``L`` tokens are built in the format of the built-in recall corpus
(:class:`titan_cp.data.datasets.SyntheticRecall`), so a model trained on it is asked what it learned::

    <BOS>Remember these facts.\\n  filler ... fact @4k9d2x.\\n ... filler  \\nRecall @
                                  └ d of the filler ┘                      the question: the key

The filler repeats sentences from a small per-context pool, as the corpus does; the fact goes
in at the sentence boundary nearest depth ``d``. Every context of one length is generated and
scored in one batch (all at once, under the CP layout): a trial is ``correct`` when the text
greedy decoding produces starts with the value; ``answer_loglik`` is the value's log-likelihood
(scoring), informative even where a model is not yet right. The heatmap draws the accuracy of
each (depth, length) cell, as long-context papers draw it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from titan_cp.data.datasets import _KEYS, _VALUE_CHARS, _sentence
from titan_cp.data.tokenizer import Tokenizer
from titan_cp.errors import plural
from titan_cp.generate.engine import Generator

HEADER = "Remember these facts.\n"
VALUE_CHARS = 6


@dataclass(frozen=True)
class NeedleCase:
    """One context: ``context`` (exactly ``length`` token ids, the question last) and the ``answer`` ids."""

    length: int
    depth: float
    trial: int
    key: str
    value: str
    context: list[int]
    answer: list[int]


def _parts(tokenizer: Tokenizer, key: str, value: str) -> tuple[list[int], list[int], list[int]]:
    """``(head + fact + question, fact, question)`` token ids; the head starts with BOS."""
    head = tokenizer.encode(HEADER, bos=True)
    fact = tokenizer.encode(f"fact {key}{value}.\n")
    question = tokenizer.encode(f"\nRecall {key}")
    return head + fact + question, fact, question


def needle_case(tokenizer: Tokenizer, length: int, depth: float, trial: int, seed: int = 0) -> NeedleCase:
    """The context of ``(length, depth, trial)``, a function of them and ``seed`` alone."""
    rng = random.Random(f"needle/{seed}/{length}/{depth}/{trial}")
    key = rng.choice(_KEYS)
    value = "".join(rng.choices(_VALUE_CHARS, k=VALUE_CHARS))
    fixed, fact, question = _parts(tokenizer, key, value)
    room = length - len(fixed)
    if room < 0:
        raise ValueError(
            f"generate.needle_lengths: {plural(length, 'token')} cannot hold the header, the fact and the question "
            f"({len(fixed)} tokens); give lengths of at least {len(fixed)}"
        )
    pool = [tokenizer.encode(_sentence(rng)) for _ in range(rng.randint(4, 12))]
    filler: list[int] = []
    ends = [0]
    while len(filler) < room:
        filler += rng.choice(pool)
        ends.append(min(len(filler), room))
    filler = filler[:room]
    cut = min(ends, key=lambda e: (abs(e - depth * room), e))  # the sentence boundary nearest the depth
    head = fixed[: len(fixed) - len(fact) - len(question)]
    context = head + filler[:cut] + fact + filler[cut:] + question
    assert len(context) == length, (len(context), length)
    return NeedleCase(length, depth, trial, key, value, context, tokenizer.encode(value))


def needle_eval(
    generator: Generator,
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    seed: int = 0,
) -> list[dict]:
    """One record per (length, depth, trial): the answer, the text greedy decoding produced (stripped),
    whether it starts with the answer (and the share of the answer's characters it has in place), and
    the answer's log-likelihood."""
    records = []
    for length in lengths:
        cases = [needle_case(tokenizer, length, d, t, seed) for d in depths for t in range(trials)]
        contexts, answers = [c.context for c in cases], [c.answer for c in cases]
        # two tokens more than the answer: a tokenizer may cut the generated text otherwise
        generated = generator.generate(contexts, max(len(a) for a in answers) + 2)
        scores = generator.score(contexts, answers)
        for case, gen, score in zip(cases, generated, scores):
            text = tokenizer.decode(gen.tokens).strip()
            hits = sum(a == b for a, b in zip(text, case.value))
            records.append(
                {
                    "context_tokens": length,
                    "depth": case.depth,
                    "trial": case.trial,
                    "key": case.key,
                    "answer": case.value,
                    "generated": text,
                    "correct": text.startswith(case.value),
                    "answer_char_accuracy": hits / len(case.value),
                    "answer_loglik": score.loglik,
                    "time_to_first_token_s": gen.time_to_first_token_s,
                }
            )
    return records


def accuracy_grid(records: Sequence[dict], lengths: Sequence[int], depths: Sequence[float]) -> list[list[float]]:
    """``grid[i][j]``: the share of correct trials at depth ``depths[i]`` and length ``lengths[j]``."""
    grid = []
    for d in depths:
        row = []
        for n in lengths:
            cell = [r["correct"] for r in records if r["depth"] == d and r["context_tokens"] == n]
            row.append(sum(cell) / len(cell) if cell else float("nan"))
        grid.append(row)
    return grid


def draw_heatmap(
    grid: Sequence[Sequence[float]], lengths: Sequence[int], depths: Sequence[float], path: str, title: str
) -> None:
    """The accuracy heatmap (rows: depth, top to bottom; columns: context length) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.5 * len(depths)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("depth of the fact")
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
