"""``torchrun --nproc-per-node N -m titan_cp.generate --job.config_file X.toml [--section.key value ...]``.

The trainer's config (model, tokenizer, checkpoint, mesh) with a ``[generate]`` section
(:class:`titan_cp.config.Generate`): ``generate.task`` is ``generate`` (continue each prompt of
``generate.prompt_file``), ``score`` (log-likelihood of each record's continuation), ``needle``
(needle in a haystack over lengths x depths, with a heatmap) or ``lookup`` (the main job's
questions: held-out ``synthetic_lookup`` documents, each question answered by the model). Rank 0
prints the results and writes one JSON line per prompt (per trial, per question) to
``generate.output_file`` (default ``<task>.jsonl``).

The ranks are ``cp x tp`` (``parallelism.context_parallel_degree x tensor_parallel_degree``, launched as
that many processes): each prompt batch is sharded over cp by the layout
(``parallelism.context_parallel_load_balancer``, strategy ``context_parallel_strategy``), heads
over tp. Everything the config and the files can tell is checked before any process group
starts (:func:`prepare`): bad keys, the prompt file, each prompt's length against the positions the
model takes (RoPE's exact range for titan_cp's Llama, whose flavors' ``max_seq_len`` is
informational; ``max_position_embeddings`` for a Hugging Face model), the stop tokens, the output folder, the checkpoint and its shapes.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from titan_cp.config import Generate, JobConfig, load_config
from titan_cp.data import build_tokenizer
from titan_cp.data.datasets import LOOKUP_VALUES
from titan_cp.data.tokenizer import Tokenizer
from titan_cp.errors import plural, run_cli
from titan_cp.generate.engine import Generator
from titan_cp.generate.lookup import lookup_eval, lookup_questions, recall_by_shards
from titan_cp.generate.needle import accuracy_grid, draw_heatmap, needle_case, needle_eval
from titan_cp.generate.prompts import PromptRecord, read_prompts
from titan_cp.generate.registry import build_for_generation
from titan_cp.generate.sampling import Sampling
from titan_cp.generate.weights import (
    ModelSpec,
    WeightSource,
    check_weights,
    load_generation_weights,
    model_spec,
    weight_source,
)
from titan_cp.preflight import check_files
from titan_cp.train import compute_precision, init_distributed, mesh_line

logger = logging.getLogger("titan_cp")

USAGE = """usage: torchrun --nproc-per-node N -m titan_cp.generate --job.config_file X.toml [--section.key value ...]
       e.g. --generate.prompt_file prompts.jsonl --generate.max_new_tokens 64 [--generate.temperature 0.8]

The trainer's keys (model, tokenizer, checkpoint, parallelism: python -m titan_cp.train --help), and:"""


@dataclass
class GenerateJob:
    """What the config and the files say, checked before any process group (:func:`prepare`)."""

    cfg: JobConfig
    tokenizer: Tokenizer
    model: ModelSpec
    weights: WeightSource
    records: list[PromptRecord]
    prompts: list[list[int]]  # generate: the prompts; score: the contexts
    continuations: list[list[int]]
    stop_tokens: tuple[int, ...]
    output: Path
    heatmap: Path | None


def _output_path(cfg: JobConfig, key: str, value: str) -> Path:
    """``generate.<key> = value`` under ``job.dump_folder`` (unless absolute), where a file can be written."""
    path = Path(value) if Path(value).is_absolute() else Path(cfg.job.dump_folder) / value
    if path.is_dir():
        raise ValueError(f"generate.{key} = {value!r} is a folder ({path}); name a file")
    existing = next(p for p in path.parents if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"generate.{key} = {value!r}: cannot write in {str(existing)!r}; choose another file")
    return path


def _stop_tokens(g: Generate, tokenizer) -> tuple[int, ...]:
    for token in g.stop_tokens:
        if token >= tokenizer.vocab_size:
            raise ValueError(
                f"generate.stop_tokens has {token}, beyond the tokenizer's vocabulary of {tokenizer.vocab_size} ids"
            )
    return tuple(dict.fromkeys(([tokenizer.eos_id] if g.stop_at_eos else []) + list(g.stop_tokens)))


def _check_length(where: str, tokens: int, reach: int, spec: ModelSpec, hint: str) -> None:
    """Positions ``0 .. reach - 1`` of a sequence of ``tokens`` input tokens fit the model (``spec.max_seq_len``)."""
    limit = f"the {spec.max_seq_len} positions of {spec.what} ({spec.bound})"
    if tokens > spec.max_seq_len:
        raise ValueError(f"{where}: {tokens} tokens, more than {limit}")
    if reach > spec.max_seq_len:
        raise ValueError(f"{where}: {tokens} tokens, {hint}, reach position {reach - 1}, beyond {limit}")


def _read(cfg: JobConfig, tokenizer, spec: ModelSpec):
    """``(records, prompts, continuations)`` of ``generate.prompt_file``, tokenized and checked."""
    g = cfg.generate
    if g.task == "lookup":
        seq_len = cfg.validation_rows()[1]
        lookup_questions(tokenizer, cfg.training.seed, seq_len, 1)  # a tokenizer or a length it cannot take
        _check_length(f"generate.task = 'lookup' on validation.seq_len = {seq_len}", seq_len, seq_len, spec, "")
        return [], [], []
    if g.task == "needle":
        for n in g.needle_lengths:
            answer = needle_case(tokenizer, n, 0.0, 0, g.seed).answer  # too short a length is named here
            where = f"generate.needle_lengths = {n}"  # the answer is scored, and generated with two tokens more
            _check_length(where, n, n + len(answer) + 1, spec, "with the answer generated after them")
        return [], [], []
    if not g.prompt_file:
        raise ValueError(
            f'generate.task = {g.task!r} needs generate.prompt_file (a text file, or JSON lines with a "prompt" key)'
        )
    records = read_prompts(g.prompt_file, continuations=g.task == "score")
    prompts = [tokenizer.encode(r.prompt, bos=True) for r in records]
    continuations = [tokenizer.encode(r.continuation) if r.continuation else [] for r in records]
    for r, p, c in zip(records, prompts, continuations):
        if g.task == "score" and not c:
            raise ValueError(f'{r.where}: the "continuation" has no tokens')
        extra = g.max_new_tokens - 1 if g.task == "generate" else len(c)
        hint = f"with generate.max_new_tokens = {g.max_new_tokens}" if g.task == "generate" else "with the continuation"
        _check_length(f"{r.where}: the prompt", len(p), len(p) + extra, spec, hint)
    return records, prompts, continuations


def _check_ranks(cfg: JobConfig, world_size: int) -> None:
    """``world_size`` is the ``cp x tp`` ranks generation runs on (no pipeline, no data parallelism), and
    those degrees make a mesh (:meth:`JobConfig.parallel_dims`)."""
    p = cfg.parallelism
    if p.pipeline_parallel_degree > 1:
        raise ValueError("titan_cp.generate runs no pipeline stages: set parallelism.pipeline_parallel_degree = 1")
    cp, tp = p.context_parallel_degree, p.tensor_parallel_degree
    if world_size != cp * tp:
        fix = f", or set --parallelism.context_parallel_degree {world_size // tp}" if world_size % tp == 0 else ""
        raise ValueError(
            f"titan_cp.generate runs on parallelism.context_parallel_degree x tensor_parallel_degree = {cp} x {tp} = "
            f"{plural(cp * tp, 'rank')} (no data parallelism), but {plural(world_size, 'rank')} "
            f"{'was' if world_size == 1 else 'were'} launched: launch {cp * tp}{fix}"
        )
    cfg.parallel_dims(world_size)


def prepare(cfg: JobConfig, world_size: int) -> GenerateJob:
    """Check everything the config and the files can tell for ``world_size`` ranks, before any process
    group: ``ValueError`` naming the key (and the file and line); the training data are not checked."""
    check_files(cfg, training=False)
    _check_ranks(cfg, world_size)
    tokenizer = build_tokenizer(cfg.model.hf_assets_path)
    spec = model_spec(cfg, tokenizer.vocab_size)
    stop = _stop_tokens(cfg.generate, tokenizer)
    records, prompts, continuations = _read(cfg, tokenizer, spec)
    g = cfg.generate
    output = _output_path(cfg, "output_file", f"{g.task}.jsonl" if g.output_file is None else g.output_file)
    heatmap = None
    if cfg.generate.task == "needle":
        heatmap = _output_path(cfg, "heatmap_file", cfg.generate.heatmap_file)
        try:
            import matplotlib  # noqa: F401, PLC0415 - optional: only the heatmap needs it
        except ImportError:
            raise ValueError(
                "generate.task = 'needle' draws generate.heatmap_file with matplotlib, which is not installed: "
                "pip install 'titan_cp[plot]'"
            ) from None
    weights = weight_source(cfg)
    check_weights(weights, spec)
    return GenerateJob(cfg, tokenizer, spec, weights, records, prompts, continuations, stop, output, heatmap)


def _generate(job: GenerateJob, generator: Generator) -> list[dict]:
    g = job.cfg.generate
    sampling = Sampling(g.temperature, g.top_p, g.seed)
    ids = [r.index for r in job.records]
    results = generator.generate(job.prompts, g.max_new_tokens, sampling, job.stop_tokens, prompt_ids=ids)
    return [
        {
            "index": r.index,
            "prompt_tokens": out.prompt_tokens,
            "tokens": out.tokens,
            "text": job.tokenizer.decode(out.tokens),
            "finish_reason": out.finish_reason,
            "time_to_first_token_s": round(out.time_to_first_token_s, 6),
            "tokens_per_s": None if out.tokens_per_s is None else round(out.tokens_per_s, 3),
            "decode_s": round(out.decode_s, 6),
        }
        for r, out in zip(job.records, results)
    ]


def _score(job: GenerateJob, generator: Generator) -> list[dict]:
    scores = generator.score(job.prompts, job.continuations)
    return [
        {
            "index": r.index,
            "context_tokens": len(p),
            "continuation_tokens": len(c),
            "logprobs": s.logprobs,
            "loglik": s.loglik,
            "greedy": s.greedy,
        }
        for r, p, c, s in zip(job.records, job.prompts, job.continuations, scores)
    ]


def _needle(job: GenerateJob, generator: Generator) -> list[dict]:
    g = job.cfg.generate
    return needle_eval(generator, job.tokenizer, g.needle_lengths, g.needle_depths, g.needle_trials, g.seed)


def _lookup(job: GenerateJob, generator: Generator) -> list[dict]:
    g, seq_len = job.cfg.generate, job.cfg.validation_rows()[1]
    return lookup_eval(generator, lookup_questions(job.tokenizer, job.cfg.training.seed, seq_len, g.lookup_documents))


TASKS = {"generate": _generate, "score": _score, "needle": _needle, "lookup": _lookup}


def _print_generated(job: GenerateJob, records: list[dict], world: int) -> None:
    for r in records:
        print(f"[{r['index']}] {r['text']}")
        logger.info(
            "prompt %d: %d prompt tokens, %d generated (%s), first token after %.3f s, %s tokens/s",
            r["index"], r["prompt_tokens"], len(r["tokens"]), r["finish_reason"],
            r["time_to_first_token_s"], r["tokens_per_s"],
        )  # fmt: skip


def _print_scores(job: GenerateJob, records: list[dict], world: int) -> None:
    for r in records:
        print(f"[{r['index']}] loglik {r['loglik']:.4f} over {r['continuation_tokens']} tokens, greedy {r['greedy']}")


def _print_needle(job: GenerateJob, records: list[dict], world: int) -> None:
    """The accuracy grid on stdout, and its heatmap."""
    g, p = job.cfg.generate, job.cfg.parallelism
    grid = accuracy_grid(records, g.needle_lengths, g.needle_depths)
    print("depth \\ tokens " + " ".join(f"{n:>7}" for n in g.needle_lengths))
    for d, row in zip(g.needle_depths, grid):
        print(f"{100 * d:>13.0f}% " + " ".join(f"{a:>7.2f}" for a in row))
    title = f"needle in a haystack: {job.model.what}, {plural(world, 'rank')} (cp {p.context_parallel_degree})"
    assert job.heatmap is not None, "the needle task always names its heatmap (prepare)"
    job.heatmap.parent.mkdir(parents=True, exist_ok=True)
    draw_heatmap(grid, g.needle_lengths, g.needle_depths, str(job.heatmap), title)
    logger.info("heatmap: %s", job.heatmap)


def _print_lookup(job: GenerateJob, records: list[dict], world: int) -> None:
    """Each question and the model's answer, then recall: over all, and by distance in shards of this mesh."""
    for r in records:
        answered = r["generated_fact"] or f"token {r['generated_token']}"
        print(
            f"[document {r['document']}, question {r['question']}] ?{r['key']} asked {r['distance']} tokens after "
            f"its fact {r['fact']}: answered {answered} ({'right' if r['correct'] else 'wrong'})"
        )
    seq_len, cp = job.cfg.validation_rows()[1], job.cfg.parallelism.context_parallel_degree
    recall = recall_by_shards(records, seq_len, cp)
    right = sum(r["correct"] for r in records)
    line = f"recall {recall.pop('recall'):.3f} ({right} of {len(records)} answers; chance 1/{len(LOOKUP_VALUES)})"
    if cp > 1:
        named = {f"recall_shards_{k}": f"{k} back" for k in range(cp)} | {"recall_remote": "on another rank"}
        line += f"; by distance in shards of {seq_len // cp} tokens (cp {cp}): " + ", ".join(
            f"{named[k]} {v:.3f}" for k, v in recall.items()
        )
    print(line)


PRINTS = {"generate": _print_generated, "score": _print_scores, "needle": _print_needle, "lookup": _print_lookup}
"""What rank 0 prints of each ``generate.task``'s records (and draws: the needle's heatmap)."""


def _report(job: GenerateJob, records: list[dict], world: int) -> None:
    """Rank 0: the JSON lines, and the task's own account (:data:`PRINTS`)."""
    job.output.parent.mkdir(parents=True, exist_ok=True)
    job.output.write_text("".join(json.dumps(r) + "\n" for r in records))
    PRINTS[job.cfg.generate.task](job, records, world)
    logger.info("wrote %d records to %s", len(records), job.output)


def run(job: GenerateJob) -> list[dict]:
    """Start the process group and the mesh, build and load the model, run the task; rank 0 reports."""
    cfg, p = job.cfg, job.cfg.parallelism
    device = init_distributed(cfg)
    rank0 = dist.get_rank() == 0
    dims = cfg.parallel_dims(dist.get_world_size())
    dims.build_mesh(device.type)
    strategy, balance = p.context_parallel_strategy, p.context_parallel_load_balancer
    model = build_for_generation(job.model, dims, strategy, balance, device)
    if rank0:
        logger.info("mesh: %s", mesh_line(dims, cfg))
        logger.info("loading the weights of %s", job.weights.describe())
    load_generation_weights(job.weights, model, job.model)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[compute_precision(cfg, device.type, rank0)]
    model.to(dtype)
    records = TASKS[cfg.generate.task](job, Generator(model))
    if rank0:
        _report(job, records, dist.get_world_size())
    return records


def usage() -> str:
    """The command line and the ``[generate]`` keys with their types and defaults."""
    lines = [USAGE, "", "[generate]"]
    defaults, hints = Generate(), typing.get_type_hints(Generate)
    for key in Generate.hints():
        hint = hints[key]
        kind = typing.get_args(hint) if typing.get_origin(hint) is typing.Literal else getattr(hint, "__name__", hint)
        lines.append(f"  --generate.{key} ({kind}, default {getattr(defaults, key)!r})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run ``generate.task``; returns the records written to ``generate.output_file``. With no
    arguments, or ``--help``, prints the usage (exit status 2 and 0)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or any(a in ("--help", "-h") for a in argv):
        print(usage())
        raise SystemExit(0 if argv else 2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = load_config(argv, warn_adjustments=os.environ.get("RANK", "0") == "0", training=False)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    return run(prepare(cfg, world))


if __name__ == "__main__":
    run_cli(main)
