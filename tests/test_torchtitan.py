"""titan_cp inside torchtitan 0.3's own Trainer (:mod:`titan_cp.integrations.torchtitan`), offline on a CPU.

- The exactness bar: the CPU commands of docs/torchtitan.md, run as that page writes them (their dump
  folders moved to a temporary one, TensorBoard on): ``python -m titan_cp.integrations.torchtitan.train
  --module titan_cp.integrations.torchtitan --config llama3_debugmodel_cp`` on the repository's packed
  documents, launched with ``torchrun`` on 1 process and on 2 (CP 2: ring with doc_local, every block
  compiled by torchtitan: ``aot_eager`` here, the same traced graphs inductor compiles), from one
  seed checkpoint (torchtitan's own ``--checkpoint.create_seed_checkpoint``: its random init of
  sharded parameters depends on the sharding): every step's loss (torchtitan's global average, read at float32 from its TensorBoard
  events) equals the one-process run's within 1e-5 for 5 steps; the one-process run's step-2 checkpoint
  (copied by the page's line) resumed at CP 2 with Ulysses and doc_zigzag (another CP size, strategy and
  balance) gives its steps 3-5 within 1e-5. The page's lines run in one ``torchrun`` launch of 2
  processes, in order, each line in a fresh forked process (tests/forked_launch.py: torch and the other
  libraries imported once per worker; the 1-process lines on the first process alone).
- The one-process attention equals torchtitan's own FlexAttention forward under its packed-document
  mask (the causal and packed-document mask mods of the same positions) within 1e-5.
- The page's other blocks: the GPU command's arguments load with torchtitan's own ``ConfigManager``, and
  the ``with_titan_cp`` example makes a config function whose config runs titan_cp's attention.
- Bad input gets one clear line: strategy / balance typos, a batch without positions, CP with an
  attention titan_cp does not replace, another spmd backend, another torchtitan version.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from tests.forked_launch import free_port, launch, sections

pytest.importorskip("torchtitan", reason="torchtitan 0.3 is in the dev extra (Python >= 3.11)")

from titan_cp.attention import CPHandle  # noqa: E402

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "torchtitan.md"
CPU_LAUNCHER = "titan_cp.integrations.torchtitan.train"


def _doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def _doc_commands() -> list[list[str]]:
    """The command lines of the page's bash blocks (continuations joined), as argv lists."""
    lines = [line for block in _doc_blocks("bash") for line in re.sub(r"\\\n\s*", " ", block).splitlines()]
    return [shlex.split(line) for line in lines if line.strip()]


# Imported by the launch's workers once, before its steps (tests/forked_launch.py): what torchtitan's
# trainer imports, and torchtitan itself behind the CPU launcher's shims (its prepare(): what each
# step's launcher would do first, done once; a step's run then starts from there, forked).
PRELOAD = [
    "titan_cp", "torch._inductor.compile_fx", "torch.distributed.fsdp", "torch.distributed.checkpoint",
    "torchdata.stateful_dataloader", "datasets", "tensorboard", f"{CPU_LAUNCHER}:prepare",
]  # fmt: skip


def _program(command: list[str], dump: Path, seed: Path | None = None, **flags: str) -> list[str]:
    """What follows ``torchrun --nproc-per-node N`` on a command line of the page (``-m ...`` and its
    arguments), writing to ``dump`` (and loading ``seed``), with ``flags`` (``strategy="ulysses"``:
    ``--titan_cp.strategy ulysses``) set in place of the line's own and TensorBoard on."""
    assert command[:2] == ["torchrun", "--nproc-per-node"], command
    args = [*command[3:], "--metrics.enable_tensorboard"]
    args[args.index("--dump_folder") + 1] = str(dump)
    if seed is not None:
        args[args.index("--checkpoint.initial_load_path") + 1] = str(seed)
    assert seed is not None or "--checkpoint.initial_load_path" not in args, "pass the seed checkpoint"
    for key, value in flags.items():
        args[args.index(f"--titan_cp.{key}") + 1] = value
    if "--compile.enable" in args:  # the page's compiled line: traced through the same graphs, not code-generated
        args += ["--compile.backend", "aot_eager"]
    return args


def _launch(steps: list[dict], tmp: Path) -> subprocess.Popen:
    """One ``torchrun --nproc-per-node 2`` from the repository root running ``steps`` (programs of the
    page's command lines, each on its own port, and shell lines) in turn, each in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for step in steps:
        if "argv" in step:
            step["port"] = free_port()
    plan = dict(preload=PRELOAD, steps=steps, markers=str(tmp / "markers"))
    return launch(2, plan, tmp / "plan.json", ROOT, env)


def _finish(run: subprocess.Popen, name: str) -> dict[str, str]:
    """The launch's output by step; it must exit 0."""
    out, err = run.communicate(timeout=900)
    assert run.returncode == 0, f"{name} exited {run.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
    return sections(out)


def _losses(dump: Path) -> list[float]:
    """Every step's global average loss, as torchtitan wrote it to TensorBoard (float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    (events,) = glob.glob(str(dump / "tb" / "**" / "events.*"), recursive=True)
    acc = EventAccumulator(events)
    acc.Reload()
    return [e.value for e in acc.Scalars("loss_metrics/global_avg_loss")]


def test_cp2_losses_equal_the_one_process_run(tmp_path):
    seed_line, one_line, cp2_line, resumed_line = (c for c in _doc_commands() if CPU_LAUNCHER in c)
    assert "--checkpoint.create_seed_checkpoint" in seed_line and "--parallelism.context_parallel_degree" in cp2_line
    assert "--compile.enable" in cp2_line  # every block compiled (torchtitan's fullgraph) with titan_cp's attention
    assert seed_line[2] == one_line[2] == "1" and cp2_line[2] == resumed_line[2] == "2"
    (copy_line,) = (" ".join(c) for c in _doc_commands() if "cp" in c)
    seed = tmp_path / "seed" / "checkpoint" / "step-0"
    # one launch of 2 processes, in the page's order: the seed checkpoint and the one-process run on its
    # first process alone (as under --nproc-per-node 1), the page's copy of that run's step-2 checkpoint,
    # the CP 2 run from the seed, the resumed run from the copy
    steps = [
        dict(name="seed", argv=_program(seed_line, tmp_path / "seed"), nproc=int(seed_line[2])),
        dict(name="one", argv=_program(one_line, tmp_path / "one", seed), nproc=int(one_line[2])),
        dict(name="copy", shell=copy_line.replace("outputs/", f"{tmp_path}/")),
        dict(name="cp2", argv=_program(cp2_line, tmp_path / "cp2", seed), nproc=int(cp2_line[2])),
        dict(name="resumed", argv=_program(resumed_line, tmp_path / "resumed"), nproc=int(resumed_line[2])),
    ]
    out = _finish(_launch(steps, tmp_path), "the launch")
    assert (tmp_path / "resumed" / "checkpoint" / "step-2").is_dir()
    assert "Training starts at step 3" in out["resumed"]
    one = _losses(tmp_path / "one")
    assert len(one) == 5 and one[-1] < one[0] - 1.0, one  # five steps, and it trains
    cp2, resumed = _losses(tmp_path / "cp2"), _losses(tmp_path / "resumed")
    assert cp2 == pytest.approx(one, abs=1e-5), f"CP 2 ring, doc_local: {cp2} vs one process {one}"
    assert resumed == pytest.approx(one[2:], abs=1e-5), f"resumed at CP 2 ulysses: {resumed} vs {one[2:]}"


def test_the_pages_gpu_command_and_recipe_load():
    from torchtitan.config import ConfigManager  # noqa: PLC0415

    from titan_cp.integrations.torchtitan import TitanCPAttention, TitanCPTrainer  # noqa: PLC0415

    (gpu,) = (c for c in _doc_commands() if "torchtitan.train" in c)
    config = ConfigManager().parse_args(gpu[gpu.index("torchtitan.train") + 1 :])
    assert isinstance(config, TitanCPTrainer.Config) and config.parallelism.context_parallel_degree == 8
    assert (config.titan_cp.strategy, config.titan_cp.balance) == ("ring", "doc_local")
    (recipe,) = _doc_blocks("python")
    names: dict = {}
    exec(recipe, names)
    config = names["llama3_8b_cp"]()
    assert (config.titan_cp.strategy, config.titan_cp.balance) == ("ulysses", "doc_zigzag")
    attentions = [layer.attention.inner_attention for layer in config.model_spec.model.layers]
    assert len(attentions) == 32 and all(isinstance(a, TitanCPAttention.Config) for a in attentions)


def _packed_positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def test_one_process_attention_equals_torchtitans_flex_document_mask():
    """What torchtitan's Decoder builds for FlexAttention (causal and its packed-document mask mod of the
    positions), run by PyTorch's flex_attention, is what TitanCPAttention computes (GQA: 8 heads, 2 KV)."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention  # noqa: PLC0415
    from torchtitan.models.common.attention import (  # noqa: PLC0415
        get_causal_mask_mod,
        get_efficient_causal_mask_mod_for_packed_document,
    )

    from titan_cp.integrations.torchtitan import TitanCPAttention, shard_by_documents  # noqa: PLC0415
    from titan_cp.layout import DEFAULT_BALANCE  # noqa: PLC0415

    positions = _packed_positions([[5, 17, 3, 39], [64]])
    b, s = positions.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, s, n, 16, generator=g) for n in (8, 2, 2))  # (B, L, N, H), torchtitan's order
    tokens = torch.zeros(b, s, dtype=torch.int64)
    doc_lens = shard_by_documents(tokens, tokens, positions, CPHandle(None, balance=DEFAULT_BALANCE)).doc_lens
    assert doc_lens.tolist() == [[5, 17, 3, 39], [64, 0, 0, 0]]
    ours = TitanCPAttention.Config().build()(q, k, v, attention_masks=doc_lens, scale=None, enable_gqa=True)
    mask_mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(positions))
    block_mask = create_block_mask(mask_mod, b, None, s, s, device="cpu")
    flex = flex_attention(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(ours, flex.transpose(1, 2), atol=1e-5, rtol=0)
    causal = create_block_mask(get_causal_mask_mod(), b, None, s, s, device="cpu")
    across = flex_attention(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=causal, enable_gqa=True)
    assert not torch.allclose(ours, across.transpose(1, 2), atol=1e-3)  # the documents matter in this batch


def test_the_debug_configs_data_are_packed_documents_from_the_repository():
    """llama3_debugmodel_cp reads the repository's tokenizer and documents (no network); its 256-token rows
    hold several documents each, which doc_local at CP 2 places by document (not in halves)."""
    from titan_cp.integrations.torchtitan import ASSETS, llama3_debugmodel_cp, shard_by_documents  # noqa: PLC0415
    from titan_cp.layout import get_layout  # noqa: PLC0415

    config = llama3_debugmodel_cp()
    assert Path(config.hf_assets_path) == ASSETS / "tokenizer" and ASSETS.is_relative_to(ROOT)
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=256, local_batch_size=2)
    batch, labels = next(iter(loader))
    local = shard_by_documents(batch["input"], labels, batch["positions"], CPHandle(None, balance="doc_local"))
    rows = [[n for n in row if n] for row in local.doc_lens.tolist()]
    assert all(len(row) >= 2 for row in rows), rows
    index = get_layout(256, 2, "doc_local", rows).index(0).expand(2, 128)  # rank 0's tokens of each row
    assert any(not torch.equal(row, torch.arange(128)) for row in index), "doc_local cut the rows in halves"


def test_bad_input_gets_one_clear_line(monkeypatch):
    from types import SimpleNamespace  # noqa: PLC0415

    import torchtitan  # noqa: PLC0415
    from torchtitan.models.llama3.config_registry import llama3_debugmodel  # noqa: PLC0415

    import titan_cp.integrations.torchtitan as tt  # noqa: PLC0415

    with pytest.raises(ValueError, match=r"--titan_cp.strategy 'rnig'.*did you mean 'ring'"):
        tt.TitanCPConfig(strategy="rnig")
    with pytest.raises(ValueError, match=r"--titan_cp.balance 'doc_locl'.*did you mean 'doc_local'"):
        tt.TitanCPConfig(balance="doc_locl")
    with pytest.raises(ValueError, match=r"'hybrid' takes a --titan_cp.ulysses_degree of 2 or more, got .* 1"):
        tt.TitanCPConfig(strategy="hybrid")
    with pytest.raises(ValueError, match=r"'ring' takes none, got --titan_cp.ulysses_degree 2"):
        tt.TitanCPConfig(strategy="ring", ulysses_degree=2)
    with pytest.raises(ValueError, match=r"did you mean 'ulysses'"):
        tt.with_titan_cp(llama3_debugmodel, strategy="ulyses")
    from torchtitan.models.gpt_oss.config_registry import gpt_oss_debugmodel  # noqa: PLC0415

    with pytest.raises(
        ValueError, match=r"does not run torchtitan's gpt-oss yet: .*sliding windows and per-head sinks"
    ):
        tt.with_titan_cp(gpt_oss_debugmodel)()

    trainer = SimpleNamespace(cp=CPHandle(None), config=tt.llama3_debugmodel_cp())
    tokens = torch.zeros(1, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="the dataloader must yield .*'positions'"):
        tt.TitanCPTrainer.post_dataloading_process(trainer, {"input": tokens}, tokens)
    with pytest.raises(ValueError, match="positions do not describe packed documents"):
        tt.TitanCPTrainer.post_dataloading_process(trainer, {"input": tokens, "positions": tokens + 3}, tokens)

    with pytest.raises(ValueError, match="not the documents tensor that titan_cp's Trainer makes"):
        q = torch.randn(1, 8, 2, 4)
        tt.TitanCPAttention.Config().build()(q, q, q, attention_masks=None)

    with torch.device("meta"):
        flex_model = llama3_debugmodel().model_spec.model.build()
    with pytest.raises(
        ValueError, match=r"an attention titan_cp does not replace: \['layers.0.attention.inner_attention"
    ):
        tt.apply_titan_cp(flex_model, None)

    config = tt.llama3_debugmodel_cp()
    config.parallelism.spmd_backend = "spmd_types"
    with pytest.raises(ValueError, match="set --parallelism.spmd_backend partial_dtensor"):
        tt.TitanCPTrainer(config)
    config = tt.llama3_debugmodel_cp()
    config.validator.enable = True
    with pytest.raises(ValueError, match="does not run torchtitan's validator yet.*drop --validator.enable"):
        tt.TitanCPTrainer(config)

    config = tt.llama3_debugmodel_cp()
    config.parallelism.pipeline_parallel_degree = 2
    if not tt.trainer._schedules_take_microbatch_lists():  # torchtitan 0.3's PP on this torch: refused, naming why
        with pytest.raises(ValueError, match=r"step\(arg_mbs=\.\.\., kwarg_mbs=\.\.\.\).*drop --parallelism.pipeline"):
            tt.TitanCPTrainer(config)

    monkeypatch.setattr(torchtitan, "__version__", "0.2.0")
    with pytest.raises(RuntimeError, match=r"written for torchtitan 0\.3\.0, but torchtitan 0\.2\.0 is installed"):
        tt.check_version()


@pytest.mark.parametrize(
    "name, layers, seq_len",
    [("llama3_debugmodel_cp", 6, 2048), ("qwen3_debugmodel_cp", 8, 2048), ("llama3_8b_cp", 32, 131072)],
)
def test_each_config_function_loads_with_titan_cp_in_every_layer(name, layers, seq_len):
    from torchtitan.config import ConfigManager  # noqa: PLC0415

    from titan_cp.integrations.torchtitan import TitanCPAttention, TitanCPParallelize  # noqa: PLC0415

    config = ConfigManager().parse_args(["--module", "titan_cp.integrations.torchtitan", "--config", name])
    attentions = [layer.attention.inner_attention for layer in config.model_spec.model.layers]
    assert len(attentions) == layers and all(isinstance(a, TitanCPAttention.Config) for a in attentions)
    assert isinstance(config.model_spec.parallelize_fn, TitanCPParallelize)
    assert config.training.seq_len == seq_len and config.parallelism.spmd_backend == "partial_dtensor"
