"""The planner on a torchtitan 0.3 config function: ``python -m titan_cp.plan --module M --config F``
(docs/planning.md, docs/torchtitan.md).

- ``llama3_8b_cp`` plans as the same run given titan_cp's way (``model.flavor = "8B"``, torchtitan's Llama 3
  8B, with its seq_len, batch, CP degree, op-level activation checkpointing and the titan_cp section's
  strategy and balance as config keys): every record equal but its model's name, less the candidates
  torchtitan's Trainer does not run with titan_cp's CP (pipeline meshes); hybrid among them, on torchtitan's
  cp axis split in two; its
  command is torchtitan's own launcher (on ``--gpu cpu``, titan_cp's CPU launcher of it). torchtitan's own
  overrides (``--titan_cp.strategy``, ``--training.seq_len``) reach the plan.
- Bad input is one line: a module that does not import, a config name that is not there (did you mean), a
  config without titan_cp's section, torchtitan missing or of another version.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from titan_cp.errors import is_user_error
from titan_cp.plan import main

pytest.importorskip("torchtitan", reason="torchtitan 0.3 is in the dev extra (Python >= 3.11)")

ROOT = Path(__file__).parents[1]
MODULE = "titan_cp.integrations.torchtitan"


def _page_command(page: str) -> list[str]:
    """The arguments of the page's one ``python -m titan_cp.plan --module`` line (a doc-test block)."""
    (line,) = re.findall(r"^python -m titan_cp\.plan --module .*$", (ROOT / page).read_text(), re.M)
    return shlex.split(line)[3:]


LLAMA3_8B_CP = _page_command("docs/planning.md")
# the same run given titan_cp's way: torchtitan's Llama 3 8B is titan_cp's flavor 8B (titan_cp.families.llama3.flavors);
# llama3_8b_cp: 131072 tokens a row, one row, CP 8, torchtitan's SelectiveAC (op level), ring over doc_local
THE_OTHER_WAY = [
    "--ngpu",
    "8",
    "--gpu",
    "h100",
    "--model.flavor",
    "8B",
    "--training.seq_len",
    "131072",
    "--training.local_batch_size",
    "1",
    "--parallelism.context_parallel_degree",
    "8",
    "--activation_checkpoint.mode",
    "op",
    "--parallelism.context_parallel_strategy",
    "ring",
    "--parallelism.context_parallel_load_balancer",
    "doc_local",
]


def _plan(argv: list[str], capsys) -> tuple[list[dict], str]:
    assert main(argv) == 0
    out = capsys.readouterr().out
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], out


def _torchtitan_runs(record: dict) -> bool:
    """Whether titan_cp's CP inside torchtitan's Trainer runs the record's mesh and strategy."""
    return record["pp"] == 1


def test_a_torchtitan_config_function_plans_as_its_shapes_given_the_other_way(capsys):
    assert LLAMA3_8B_CP == _page_command("docs/torchtitan.md")
    assert LLAMA3_8B_CP == ["--module", MODULE, "--config", "llama3_8b_cp", "--ngpu", "8", "--gpu", "h100"]
    ours, out = _plan(LLAMA3_8B_CP, capsys)
    theirs, their_out = _plan(THE_OTHER_WAY, capsys)
    assert {r.pop("flavor") for r in ours} == {"torchtitan:llama3/8B"}
    assert {r.pop("flavor") for r in theirs} == {"8B"}
    runs = [r for r in theirs if _torchtitan_runs(r)]
    assert ours == runs
    assert any(r["strategy"] == "hybrid" for r in ours)  # torchtitan's cp axis split into (ring, ulysses)
    best = ours[0]
    assert best["recommended"] and best["configured"] and (best["strategy"], best["cp"]) == ("ring", 8)
    assert out.split("recommended: ")[1].splitlines()[0] == their_out.split("recommended: ")[1].splitlines()[0]
    launch = (
        f"torchrun --standalone --nproc-per-node 8 -m torchtitan.train --module {MODULE} --config llama3_8b_cp "
        "--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 1 "
        "--parallelism.context_parallel_degree 8 --parallelism.tensor_parallel_degree 1 "
        "--parallelism.pipeline_parallel_degree 1 --titan_cp.strategy ring\n"
    )
    assert launch in out, out[-2000:]


def test_torchtitans_own_overrides_reach_the_plan(capsys):
    argv = [*LLAMA3_8B_CP, "--titan_cp.strategy", "ulysses", "--training.seq_len", "65536", "--top", "3"]
    records, _ = _plan(argv, capsys)
    assert {r["seq_len"] for r in records} == {65536}
    (configured,) = [r for r in _plan([*argv[:-2], "--top", "0"], capsys)[0] if r["configured"]]
    assert (configured["strategy"], configured["cp"], configured["balance"]) == ("ulysses", 8, "doc_local")
    _, out = _plan(["--module", MODULE, "--config", "llama3_debugmodel_cp", "--ngpu", "2", "--gpu", "cpu"], capsys)
    assert f"torchrun --standalone --nproc-per-node 2 -m {MODULE}.train --module {MODULE} --config" in out


def _one_line(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        main(argv)
    assert is_user_error(e.value) and "\n" not in str(e.value), str(e.value)


def test_bad_input_gets_one_clear_line(tmp_path, monkeypatch):
    _one_line(["--ngpu", "8", "--module", MODULE], "--module and --config name a torchtitan 0.3 config function")
    _one_line(
        ["--ngpu", "8", "--module", "titan_cp.integrations.torchtitn", "--config", "llama3_8b_cp"],
        r"--module 'titan_cp.integrations.torchtitn' does not import: no module .*"
        r"did you mean 'titan_cp.integrations.torchtitan'",
    )
    (tmp_path / "broken_recipes.py").write_text("import a_package_that_is_not_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _one_line(
        ["--ngpu", "8", "--module", "broken_recipes", "--config", "x"],
        r"--module 'broken_recipes' does not import: ModuleNotFoundError: No module named 'a_package_that_is_not_here'",
    )
    _one_line(
        ["--ngpu", "8", "--module", MODULE, "--config", "llama3_8b_pc"],
        rf"--config 'llama3_8b_pc' is not a config function of {re.escape(MODULE)}; did you mean 'llama3_8b_cp'.*"
        r"\(its config functions: (.*, )?llama3_8b_cp, llama3_debugmodel_cp, (.*, )?qwen3_debugmodel_cp(, .*)?\)",
    )
    _one_line(
        ["--ngpu", "8", "--module", "torchtitan.models.llama3", "--config", "llama3_debugmodel"],
        "returns Trainer.Config without a titan_cp section: plan a config function made with .*with_titan_cp",
    )
    import torchtitan  # noqa: PLC0415

    monkeypatch.setattr(torchtitan, "__version__", "0.2.0")
    _one_line([*LLAMA3_8B_CP], r"written for torchtitan 0\.3\.0, but torchtitan 0\.2\.0 is installed")
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # import torchtitan: ImportError
    _one_line([*LLAMA3_8B_CP], r"plans a torchtitan 0\.3 config function, and torchtitan is not installed: pip install")
