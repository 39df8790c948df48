"""``python -m titan_cp.plan``: parse the arguments, plan, print JSON lines, a table, the TOML and torchrun lines."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

from titan_cp.attention.strategy import get_strategy
from titan_cp.config import load_config
from titan_cp.data.row_mixes import ROW_MIXES
from titan_cp.errors import plural
from titan_cp.plan import torchtitan
from titan_cp.plan.devices import GB, GPUS, INTER, INTRA, device, node_count
from titan_cp.plan.search import Estimate, PlanResult, max_seq_len, plan

USAGE = """The planner: which mesh and CP strategy to run, before spending a GPU-hour.

    python -m titan_cp.plan --job.config_file X.toml --ngpu 8 [--gpu h100|h200|a100|cpu]
        [--nnodes N] [--doc-mix NAME] [--hbm-gb G] [--host-gb G] [--matmul-speedup F]
        [--plot out.png | --plot FOLDER] [--max-seq] [--all]
        [--section.key value ...]          # any config key, as in the trainer
    python -m titan_cp.plan --module M --config F --ngpu 8 [the options above]
        [--section.key value ...]          # torchtitan 0.3's own overrides of its config function

``--module/--config``: a torchtitan 0.3 config function made with titan_cp's ``with_titan_cp``
(``titan_cp.plan.torchtitan``), looked up as torchtitan's launcher does; the recommended plan's
command is torchtitan's launcher.

Every plan printed is one the trainer runs: its keys (the ``overrides`` of its JSON line, the TOML lines and
the ``torchrun`` line of the recommended one) pass the trainer's own config checks
(:mod:`titan_cp.plan.checks`). Without ``--nnodes`` the GPUs fill whole nodes of the device (8 GPUs; a
CPU host runs any number of ranks). Only the plans that can be within 2% of the fastest are estimated
(:mod:`titan_cp.plan.search`); the last line says how many others were not, and why. ``--all`` estimates
every plan the trainer runs.

``--max-seq``: the longest row (``training.seq_len``) that trains, by bisection over multiples of
65,536 tokens up to 2**24, with every option the planner may turn on (one row per rank,
full AC, unless the config says otherwise); prints one JSON line, the plan's row with
``max_seq_len`` and ``practical`` (its step within an hour), then one line naming the step's
seconds and tokens/s per GPU, and saying IMPRACTICAL when the step takes longer.
"""


def _takes_ulysses(e: Estimate) -> bool:
    return e.candidate.cp > 1 and e.candidate.attention.takes_ulysses_degree()


def record(e: Estimate, result: PlanResult) -> dict:
    """The JSON line of ``e`` (its keys: docs/planning.md); ``schedule``: the one the attention runs on the
    planned rows (``"local"`` without CP; Ulysses and hybrid run ``"ring"`` where documents stay home)."""
    c, cost, ctx = e.candidate, e.cost, result.context
    comm = {INTRA: 0, INTER: 0}
    detail = {}
    for name, t in cost.transfers.items():
        nbytes = cost.bytes_per_step(t)
        comm[t.link] = comm.get(t.link, 0) + nbytes
        detail[name] = {"bytes": int(nbytes), "link": t.link}
    ratio = cost.ring.ratio if cost.ring is not None else None
    out = {
        "strategy": c.strategy if c.cp > 1 else "none",
        "schedule": cost.schedule,
        **{k: v for k, v in c.degrees.items() if k != "pp"},
        "pp": c.pp,
        "ulysses_degree": c.ulysses_size,
        "seq_len": e.workload.seq_len,
        "local_tokens": e.workload.seq_len // c.cp * len(e.workload.rows),
        "memory_bytes_per_rank": int(e.memory.total),
        "memory_parts": {k: int(v) for k, v in e.memory.parts.items()},
        "fits": bool(e.fits),
        "headroom_bytes": e.headroom_bytes,
        "comm_bytes_per_rank": {k: int(v) for k, v in comm.items()},
        "comm_detail": detail,
        "ring_compute_over_transfer": None if ratio is None else round(ratio, 3),
        "compute_seconds": cost.compute_seconds,
        "exposed_comm_seconds": cost.exposed_seconds,
        "step_seconds": cost.step,
        "model_flops": int(e.model_flops),
        "tokens_per_second_per_gpu": e.tokens_per_second_per_gpu,
        "mfu": e.mfu,
        "configured": result.is_configured(e),
        "gpu": ctx.gpu,
        "ngpu": ctx.ngpu,
        "nnodes": ctx.nnodes,
        "doc_mix": ctx.doc_mix,
        "ac": ctx.ac,
        "flavor": ctx.flavor,
        "balance": ctx.balance,
        "recommended": bool(e is result.best and result.recommended),
        **options_record(e),
        "overrides": e.keys,
    }
    if e is result.best:
        out["reason"] = result.reason
    return out


def options_record(e: Estimate) -> dict:
    """The long-context options of ``e``'s plan and the host bytes they take."""
    w = e.workload
    return {
        "activation_checkpoint": w.ac,
        "cpu_offload": w.host.cpu_offload,
        "blocks_per_checkpoint": w.host.blocks_per_checkpoint,
        "tile_tokens": w.host.tile_tokens,
        "enable_cpu_offload": w.host.fsdp_offload,
        "host_bytes_per_rank": int(e.host_bytes),
        "host_bytes_per_node": int(e.host_bytes * min(e.device.gpus_per_node, e.candidate.ngpu)),
    }


def _toml(value: Any) -> str:
    return json.dumps(value)  # TOML's own spelling of a string, an integer or a boolean


def overrides(e: Estimate) -> list[str]:
    """The TOML lines of ``e``'s config keys (:attr:`~titan_cp.plan.search.Estimate.keys`), by section."""
    sections: dict[str, list[str]] = {}
    for key, value in e.keys.items():
        section, name = key.split(".")
        sections.setdefault(section, []).append(f"{name} = {_toml(value)}")
    return [line for section, lines in sections.items() for line in (f"[{section}]", *lines)]


def flags(keys: dict[str, Any]) -> list[str]:
    """``keys`` as the trainer's command-line overrides (``--section.key value``, booleans ``true``/``false``)."""
    return [
        x
        for key, value in keys.items()
        for x in (f"--{key}", str(value).lower() if value in (True, False) else str(value))
    ]


def launch_lines(e: Estimate, ngpu: int, nnodes: int, config_file: str | None) -> list[str]:
    """The ``torchrun`` line that runs ``e`` (every key it sets) on ``nnodes`` nodes of ``ngpu // nnodes`` GPUs."""
    cfg = f"--job.config_file {config_file or 'X.toml'}"
    keys = " ".join(flags(e.keys))
    per_node = ngpu // nnodes
    if nnodes == 1:
        return [f"torchrun --standalone --nproc-per-node {per_node} -m titan_cp.train {cfg} {keys}"]
    return [
        f"torchrun --nnodes {nnodes} --nproc-per-node {per_node} --rdzv-backend c10d "
        f"--rdzv-endpoint $HEAD_NODE:29500 --rdzv-id $JOB_ID -m titan_cp.train {cfg} {keys}"
    ]


def row(r: dict) -> str:
    """One table row of a record."""
    mesh = f"pp{r['pp']} rep{r['dp_replicate']} fsdp{r['dp_shard']} cp{r['cp']} tp{r['tp']}" + (
        f" ep{r['ep']}" if r["ep"] > 1 else ""
    )
    takes = r["cp"] > 1 and get_strategy(r["strategy"]).takes_ulysses_degree()
    strat = r["strategy"] + (f"(u{r['ulysses_degree']})" if takes else "")
    ratio = r["ring_compute_over_transfer"]
    return (
        f"{'*' if r['recommended'] else ' '} {mesh:<30} {strat:<12} {r['schedule']:<9} "
        f"{r['memory_bytes_per_rank'] / GB:8.1f} "
        f"{'yes' if r['fits'] else 'no':>4} {r['comm_bytes_per_rank'][INTRA] / GB:8.2f} "
        f"{r['comm_bytes_per_rank'][INTER] / GB:8.2f} {'-' if ratio is None else f'{ratio:.1f}':>6} "
        f"{r['step_seconds']:8.3f} {r['tokens_per_second_per_gpu']:10,.0f} {100 * r['mfu']:5.1f}"
    )


PLOT_NAME = "plan.png"  # what --plot FOLDER writes in the folder
HEADER = (
    f"  {'mesh':<30} {'strategy':<12} {'schedule':<9} {'mem GB':>8} {'fits':>4} {'intra GB':>8} {'inter GB':>8} "
    f"{'c/t':>6} {'step s':>8} {'tok/s/GPU':>10} {'MFU%':>5}"
)


def plot(records: list[dict], path: str) -> None:
    """Memory per rank and predicted tokens/s per GPU of every candidate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in records:
        color = "C2" if r["recommended"] else ("C0" if r["fits"] else "C3")
        ax.scatter(r["memory_bytes_per_rank"] / GB, r["tokens_per_second_per_gpu"], color=color, s=18)
    best = records[0]
    ax.annotate(
        f"cp{best['cp']} {best['strategy']}", (best["memory_bytes_per_rank"] / GB, best["tokens_per_second_per_gpu"])
    )
    ax.set_xlabel("memory per rank (GB)")
    ax.set_ylabel("predicted tokens/s per GPU")
    ax.set_title(f"{best['flavor']} seq {best['seq_len']} on {best['ngpu']} {best['gpu']} (red: does not fit)")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m titan_cp.plan",
        description=USAGE.split("\n\n")[0],
        epilog="Any --section.key value is a config override, as in the trainer.",
    )
    p.add_argument("--ngpu", type=int, required=True, help="GPUs in all")
    p.add_argument("--gpu", default="h100", help=f"one of {sorted(GPUS)}")
    p.add_argument(
        "--nnodes", type=int, default=None, help="nodes (default: --ngpu in whole nodes of the device, 8 GPUs each)"
    )
    p.add_argument("--doc-mix", default="causal", help=f"document mix of the rows: {sorted(ROW_MIXES)}")
    p.add_argument("--hbm-gb", type=float, default=None, help="memory per GPU, GB (default: the GPU's)")
    p.add_argument("--host-gb", type=float, default=2000.0, help="host memory per node, GB, for the offloads")
    p.add_argument("--max-seq", action="store_true", help="print the longest seq_len that trains (one JSON line)")
    p.add_argument("--matmul-speedup", type=float, default=1.0, help="e.g. 1.48 for float8 + compile (see Stack)")
    p.add_argument(
        "--plot", metavar="PNG", help=f"draw the candidates to this .png file, or to {PLOT_NAME} in this folder"
    )
    p.add_argument("--top", type=int, default=0, help="print only the best N rows (0: all)")
    p.add_argument(
        "--all", action="store_true", help="estimate every plan the trainer runs, not only those that can be the best"
    )
    p.add_argument("--module", help="a torchtitan 0.3 run: the module of its config function (with --config)")
    p.add_argument("--config", help="a torchtitan 0.3 run: the config function's name (with --module)")
    return p


def _print_launch(result: PlanResult, config_file: str | None, tt: torchtitan.TorchtitanPlan | None = None) -> None:
    best, ctx = result.best, result.context

    def lines(ngpu: int, nnodes: int) -> list[str]:
        if tt is not None:
            return torchtitan.launch_lines(best, ngpu, nnodes, tt.run)
        return launch_lines(best, ngpu, nnodes, config_file)

    print("\n".join(["", *(overrides(best) if tt is None else [torchtitan.flags(best, tt.run)]), ""]))
    for line in lines(ctx.ngpu, ctx.nnodes):
        print(line)
    if ctx.nnodes == 1:
        several = lines(2 * ctx.ngpu, 2)[0].replace("--nnodes 2", "--nnodes N")
        print(several + "   # several nodes (plan again with --nnodes N for their degrees)")


MAX_SEQ_DEFAULTS = {  # --max-seq plans one row per rank under full AC unless the config says otherwise
    "--training.local_batch_size": "1",
    "--training.global_batch_size": "1",
    "--activation_checkpoint.mode": "full",
}


def _machine(args: argparse.Namespace, tt: torchtitan.TorchtitanPlan | None) -> dict[str, Any]:
    """What :func:`plan` and :func:`max_seq_len` take besides the job config: the machine and the rows
    from the command line, and a torchtitan run's model (``given``)."""
    return dict(
        ngpu=args.ngpu,
        gpu=args.gpu,
        nnodes=args.nnodes,
        doc_mix=args.doc_mix,
        hbm_gb=args.hbm_gb,
        matmul_speedup=args.matmul_speedup,
        host_gb=args.host_gb,
        given=tt.given if tt is not None else None,
    )


def _print_max_seq(args: argparse.Namespace, rest: list[str], tt: torchtitan.TorchtitanPlan | None) -> int:
    if tt is not None:  # a torchtitan run is planned with its own batch and checkpointing
        job_config = tt.job_config
    else:
        given = {a.split("=")[0] for a in rest}
        defaults = [x for k, v in MAX_SEQ_DEFAULTS.items() if k not in given for x in (k, v)]
        job_config = load_config(defaults + rest)
    n, result = max_seq_len(job_config, **_machine(args, tt))
    if result is None:
        raise ValueError(
            f"--max-seq: not even 65536 tokens fit {plural(args.ngpu, args.gpu + ' GPU')} with every option on"
        )
    best = result.best
    practical = best.cost.step <= PRACTICAL_STEP_SECONDS
    print(json.dumps({"max_seq_len": n, "practical": practical, **record(best, result)}))
    print(max_seq_line(n, best, practical))
    return 0


PRACTICAL_STEP_SECONDS = 3600.0  # --max-seq: a longest row whose one optimizer step takes longer is called impractical


def max_seq_line(n: int, e: Estimate, practical: bool) -> str:
    """The human-readable line of ``--max-seq``: the length, its mesh, its step time and throughput, and
    plainly when that step is impractical (over :data:`PRACTICAL_STEP_SECONDS`)."""
    c, step = e.candidate, e.cost.step
    mesh = f"pp{c.pp} rep{c.dp_replicate} fsdp{c.dp_shard} cp{c.cp} tp{c.tp}" + (f" ep{c.ep}" if c.ep > 1 else "")
    strat = c.strategy + (f"(u{c.ulysses})" if _takes_ulysses(e) else "") if c.cp > 1 else "no CP"
    if c.cp > 1 and e.cost.schedule != c.strategy:
        strat += f" (the {e.cost.schedule} schedule)"
    line = (
        f"longest row: {n:,} tokens on {mesh} {strat}: one step takes {step:,.0f} s ({step / 3600:.2f} h), "
        f"{e.tokens_per_second_per_gpu:,.0f} tokens/s per GPU"
    )
    if practical:
        return line
    return line + (
        f". IMPRACTICAL: a step over {PRACTICAL_STEP_SECONDS / 3600:.0f} h; it fits memory but would barely train "
        "(ask for a shorter training.seq_len, or more GPUs)"
    )


def check_args(args: argparse.Namespace) -> None:
    """``ValueError`` naming the option for a value the planner cannot use (before anything is computed)."""
    if args.doc_mix not in ROW_MIXES:
        raise ValueError(f"--doc-mix {args.doc_mix!r} is unknown; choose one of {sorted(ROW_MIXES)}")
    device(args.gpu)
    for name, value in (("--ngpu", args.ngpu), ("--nnodes", args.nnodes)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    node_count(args.gpu, args.ngpu, args.nnodes)  # --nnodes dividing --ngpu, or --ngpu in whole nodes
    for name, value in (
        ("--hbm-gb", args.hbm_gb),
        ("--host-gb", args.host_gb),
        ("--matmul-speedup", args.matmul_speedup),
    ):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value}")
    if args.top < 0:
        raise ValueError(f"--top must be 0 (every row) or a positive number of rows, got {args.top}")
    if (args.module is None) != (args.config is None):
        raise ValueError("--module and --config name a torchtitan 0.3 config function together: give both")
    if args.plot is not None:
        plot_path(args.plot)


def plot_path(value: str) -> Path:
    """Where ``--plot value`` draws: ``value`` itself when it names a ``.png`` file, ``<value>/plan.png``
    when it is an existing folder. ``ValueError`` naming the option for anything else (another
    suffix, a folder that does not exist or cannot be written, the filesystem root), and when
    matplotlib is missing: all before anything is computed."""
    given = Path(value)
    path = given / PLOT_NAME if given.is_dir() else given
    if path.suffix.lower() != ".png":
        raise ValueError(
            f"--plot {value!r}: name a .png file (e.g. --plot {PLOT_NAME}) or an existing folder to write "
            f"{PLOT_NAME} in"
        )
    folder = path.resolve().parent
    if not folder.is_dir():
        raise ValueError(f"--plot {value!r}: the folder {str(folder)!r} does not exist")
    if folder.parent == folder:
        raise ValueError(f"--plot {value!r}: would write {str(path.resolve())!r} at the filesystem root; name another")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--plot {value!r}: the folder {str(folder)!r} is not writable")
    try:
        import matplotlib  # noqa: F401, PLC0415 - optional: only the plot needs it
    except ImportError:
        raise ValueError(
            f"--plot {value!r} draws with matplotlib, which is not installed: pip install 'titan_cp[plot]'"
        ) from None
    return path


def main(argv: list[str] | None = None) -> int:
    """Plan and print (module docstring); bad options and config keys raise ``ValueError`` naming them
    (``titan_cp.errors.run_cli`` prints the one line and exits 2)."""
    args, rest = parser().parse_known_args(argv)
    check_args(args)
    tt = torchtitan.read(args.module, args.config, rest) if args.module is not None else None
    if args.max_seq:
        return _print_max_seq(args, rest, tt)
    job_config = tt.job_config if tt is not None else load_config(rest)
    result = plan(job_config, **_machine(args, tt), exhaustive=args.all)
    records = [record(e, result) for e in result.estimates]
    shown = records[: args.top] if args.top else records
    for r in shown:
        print(json.dumps(r))
    print("\n" + HEADER)
    for r in shown:
        print(row(r))
    print(f"\n{result.skipped.line(len(records))}")
    print(f"recommended: {result.reason}")
    if result.recommended:
        _print_launch(result, job_config.job.config_file, tt)
    if args.plot is not None:
        path = plot_path(args.plot)
        plot(records, str(path))
        print(f"plot: {path}")
    return 0
