"""``[generate]``: generation, scoring, the needle-in-a-haystack evaluation and the main job's questions
(``python -m titan_cp.generate``).

The model, its weights (``[checkpoint]``), the tokenizer (``model.hf_assets_path``) and the mesh
(``[parallelism]``: cp and tp degrees, the CP strategy and layout) come from the other sections,
as in training; this section says what to run on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from titan_cp.config.values import AtLeast, IncreasingPositive, InRange, NonEmpty, Positive, Section


@dataclass
class Generate(Section, name="generate"):
    task: Literal["generate", "score", "needle", "lookup"] = "generate"
    """``generate``: continue each prompt of ``prompt_file``; ``score``: the log-likelihood of each
    record's ``continuation`` given its ``prompt`` (no decoding); ``needle``: the needle-in-a-haystack
    evaluation over ``needle_lengths`` x ``needle_depths``, with a heatmap; ``lookup``: the main job's
    questions, answered by the model: the first ``lookup_documents`` held-out ``synthetic_lookup``
    documents (the validation split of ``training.seed``, ``validation.seq_len`` tokens each, as the
    trainer's validation reads them), each question a prompt of the document up to it, its answer
    the token greedy decoding gives (``titan_cp/generate/lookup.py``)."""

    prompt_file: str | None = None
    """The prompts: a text file (the whole file is one prompt), or JSON lines (``.jsonl``/``.json``)
    with a ``"prompt"`` string per record (and a ``"continuation"`` string for ``task = "score"``)."""

    max_new_tokens: Annotated[int, Positive] = 64
    """Tokens to generate per prompt, at most (a prompt ends earlier at a stop token)."""

    temperature: Annotated[float, AtLeast(0)] = 0.0
    """Softmax temperature of sampling; 0: greedy (the most probable token)."""

    top_p: Annotated[float, InRange(0, 1, low_open=True)] = 1.0
    """Nucleus sampling: draw from the most probable tokens whose probability reaches ``top_p``
    (1: from every token). Used when ``temperature > 0``."""

    seed: Annotated[int, AtLeast(0)] = 0
    """Seed of sampling, per prompt (with its index in ``prompt_file``): the same tokens on every mesh."""

    stop_at_eos: bool = True
    """End a prompt's generation at the tokenizer's EOS token."""

    stop_tokens: list[Annotated[int, AtLeast(0)]] = field(default_factory=list)
    """More token ids that end a prompt's generation (comma-separated on the command line)."""

    output_file: str | None = None
    """JSON lines written by rank 0, one record per prompt (per needle trial), relative to
    ``job.dump_folder`` unless absolute. Default: ``<task>.jsonl`` (``generate.jsonl``, ``score.jsonl``,
    ``needle.jsonl``), so one task's run does not overwrite another's results."""

    needle_lengths: Annotated[list[int], IncreasingPositive] = field(default_factory=lambda: [256, 512, 1024, 2048])
    """``task = "needle"``: context lengths in tokens (the question included)."""

    needle_depths: Annotated[list[Annotated[float, InRange(0, 1)]], NonEmpty("give depths in [0, 1]")] = field(
        default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0]
    )
    """``task = "needle"``: where the fact sits in the haystack, as a fraction of it (0: first, 1: last)."""

    needle_trials: Annotated[int, Positive] = 2
    """``task = "needle"``: haystacks (different facts and filler) per length and depth."""

    lookup_documents: Annotated[int, Positive] = 8
    """``task = "lookup"``: held-out documents whose questions are asked (six each). The main job's
    validation reads the first 8 (``validation.steps`` rows of one document)."""

    heatmap_file: str = "needle_heatmap.png"
    """``task = "needle"``: the accuracy heatmap (depth x length, PNG; needs matplotlib), relative
    to ``job.dump_folder`` unless absolute."""

    def check(self) -> None:
        for key, value in (("output_file", self.output_file), ("heatmap_file", self.heatmap_file)):
            if value is not None and not value.strip():
                raise ValueError(f"generate.{key} is empty; name a file")
