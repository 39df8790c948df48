"""titan_cp.config: TOML + CLI loading, torchtitan compatibility, validation errors that name keys."""

import warnings
from pathlib import Path

import pytest

from titan_cp.config import JobConfig, load_config
from titan_cp.preflight import check_files, check_model

REPO = Path(__file__).resolve().parents[1]

# torchtitan's Llama 3 8B preset (v0.2 schema), verbatim in keys and values.
TORCHTITAN_LLAMA3_8B = """
# NOTE: this toml config is a preset for 64 A100 GPUs.

[job]
dump_folder = "./outputs"
description = "Llama 3 8B training"

[profiling]
enable_profiling = true
save_traces_folder = "profile_trace"
profile_freq = 100

[metrics]
log_freq = 10
enable_tensorboard = true
save_tb_folder = "tb"

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
# converters = ["float8"]

[optimizer]
name = "AdamW"
lr = 3e-4
eps = 1e-8

[lr_scheduler]
warmup_steps = 200  # lr scheduler warm up

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 1.0  # grad norm clipping
steps = 1000
dataset = "c4"

[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
pipeline_parallel_degree = 1
context_parallel_degree = 1

[checkpoint]
enable = false
folder = "checkpoint"
interval = 500
last_save_model_only = true
export_dtype = "float32"
async_mode = "disabled" # ["disabled", "async", "async_with_pinned_mem"]

[compile]
enable=false
components = ["model", "loss"]

[activation_checkpoint]
mode = "selective"  # ["none", "selective", "full"]
selective_ac_option = "op"  # "int" = ac every positive int layer or 'op', ac based on ops policy

[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
filter_fqns = ["output"]

[validation]
enable = false
dataset = "c4_validation"
freq = 500
steps = 1200 # Recommend value for c4_validation with world-size=8 and seq_len=8192
"""

# torchtitan's older (v0.1) debug model TOML: renamed keys (enable_checkpoint, batch_size, lr_min).
TORCHTITAN_LLAMA3_DEBUG_V01 = """
[job]
dump_folder = "./outputs"
description = "Llama 3 debug training"
print_args = false
use_for_integration_test = true

[model]
name = "llama3"
flavor = "debugmodel"
tokenizer_path = "./tests/assets/test_tiktoken.model"

[lr_scheduler]
warmup_steps = 2
decay_ratio = 0.8
decay_type = "linear"
lr_min = 0.0

[training]
batch_size = 8
seq_len = 2048
steps = 10
compile = false
dataset = "c4_test"

[parallelism]
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
enable_async_tensor_parallel = false
context_parallel_degree = 1

[checkpoint]
enable_checkpoint = true
interval = 10
model_weights_only = false

[float8]
enable_fsdp_float8_all_gather = false
filter_fqns = ["output"]
"""


def write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load_quiet(argv):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # titan_cp's own configs must not warn
        return load_config(argv)


def test_defaults_validate_and_to_dict():
    cfg = load_quiet([])
    assert cfg == JobConfig()
    d = cfg.to_dict()
    assert d["parallelism"]["context_parallel_strategy"] == "ring"
    assert d["parallelism"]["context_parallel_load_balancer"] == "doc_local"
    assert d["training"]["dataset"] == "synthetic_recall"
    assert set(d) >= {
        "job",
        "profiling",
        "metrics",
        "model",
        "optimizer",
        "lr_scheduler",
        "training",
        "parallelism",
        "checkpoint",
        "activation_checkpoint",
        "compile",
        "validation",
        "comm",
    }


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = write(
        tmp_path, "[training]\nsteps = 7\nseq_len = 1024\n[optimizer]\nlr = 1e-3\n[lr_scheduler]\nwarmup_steps = 2\n"
    )
    cfg = load_quiet(["--job.config_file", path, "--training.steps", "9"])
    assert cfg.training.steps == 9  # CLI
    assert cfg.training.seq_len == 1024  # TOML
    assert cfg.optimizer.lr == 1e-3  # TOML
    assert cfg.training.local_batch_size == 8  # default
    assert cfg.job.config_file == path


def test_cli_forms():
    cfg = load_quiet(
        [
            "--training.steps=12",
            "--optimizer.lr",
            "3e-4",
            "--checkpoint.enable",
            "--compile.enable",
            "false",
            "--compile.components",
            "model",
            "--validation.recall_buckets=100,1000",
            "--checkpoint.no_initial_load_model_only",
            "--training.global_batch_size",
            "-1",
            "--lr_scheduler.decay_ratio",
            "none",
            "--parallelism.context_parallel_degree",
            "2",
            "--lr_scheduler.warmup_steps",
            "3",
        ]
    )
    assert cfg.training.steps == 12
    assert cfg.optimizer.lr == 3e-4
    assert cfg.checkpoint.enable is True
    assert cfg.compile.enable is False
    assert cfg.compile.components == ["model"]
    assert cfg.validation.recall_buckets == [100, 1000]
    assert cfg.checkpoint.initial_load_model_only is False
    assert cfg.lr_scheduler.decay_ratio is None
    assert cfg.parallel_degrees() == {"pp": 1, "dp_replicate": 1, "dp_shard": -1, "cp": 2, "tp": 1}


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--training.stepz", "3"], "did you mean 'training.steps'"),
        (["--parallelism.context_paralel_degree", "2"], "did you mean 'parallelism.context_parallel_degree'"),
        (["--parallelism.context_parallel_strategy", "rng"], "did you mean 'ring'"),
        (["--training.steps"], "--training.steps needs a value"),
        (["--training.steps", "ten"], "training.steps must be an integer"),
        (
            ["--checkpoint.enable", "maybe"],
            "--checkpoint.enable must be true or false (or given alone, meaning true), got 'maybe'",
        ),
        (["training.steps", "3"], "expected --section.key"),
    ],
)
def test_cli_errors(argv, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        load_config(argv)


def test_unknown_toml_key_is_an_error_with_hint(tmp_path):
    path = write(tmp_path, "[training]\nlocal_batchsize = 4\n")
    with pytest.raises(
        ValueError, match=r"unknown config key 'training.local_batchsize'.*did you mean 'training.local_batch_size'"
    ):
        load_config(["--job.config_file", path])
    path = write(tmp_path, "[trainer]\nsteps = 4\n", "other.toml")
    with pytest.raises(ValueError, match=r"'trainer.steps'.*did you mean 'training.steps'"):
        load_config(["--job.config_file", path])


def test_wrong_toml_types_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="training.steps must be an integer"):
        load_config(["--job.config_file", write(tmp_path, "[training]\nsteps = 1.5\n")])
    with pytest.raises(ValueError, match="checkpoint.enable must be true or false"):
        load_config(["--job.config_file", write(tmp_path, '[checkpoint]\nenable = "yes"\n', "b.toml")])


def load_with_one_warning(path):
    """Load ``path``, asserting exactly one warning; return the config and that warning's text."""
    with pytest.warns(UserWarning) as record:
        cfg = load_config(["--job.config_file", path])
    assert len(record) == 1
    return cfg, str(record[0].message)


def test_torchtitan_llama3_toml_loads_with_one_warning(tmp_path):
    path = write(tmp_path, TORCHTITAN_LLAMA3_8B)
    cfg, message = load_with_one_warning(path)
    for key in (
        "checkpoint.export_dtype",
        "quantize.linear.float8.filter_fqns",
        "quantize.linear.float8.enable_fsdp_float8_all_gather",
    ):
        assert key in message
    assert "profiling.enable_profiling" not in message and "training.seq_len" not in message
    assert cfg.profiling.enable_profiling is True
    assert cfg.model.flavor == "8B"
    assert cfg.model.hf_assets_path == "./assets/hf/Llama-3.1-8B"
    assert cfg.training.dataset == "c4"
    assert cfg.training.local_batch_size == 1
    assert cfg.activation_checkpoint.selective_ac_option == "op"
    assert cfg.validation.steps == 1200


def test_legacy_torchtitan_keys_are_renamed(tmp_path):
    path = write(tmp_path, TORCHTITAN_LLAMA3_DEBUG_V01)
    cfg, message = load_with_one_warning(path)
    assert "checkpoint.enable_checkpoint -> checkpoint.enable" in message
    assert "training.batch_size -> training.local_batch_size" in message
    assert "model.tokenizer_path" in message and "float8.filter_fqns" in message
    assert cfg.checkpoint.enable is True
    assert cfg.training.local_batch_size == 8
    assert cfg.compile.enable is False
    assert cfg.lr_scheduler.min_lr_factor == 0.0


def test_validate_checks_configs_built_in_code():
    from titan_cp.config import Compile, Parallelism

    with pytest.raises(ValueError, match="parallelism.context_parallel_strategy must be one of.*did you mean 'ring'"):
        JobConfig(parallelism=Parallelism(context_parallel_strategy="rign")).validate()
    with pytest.raises(ValueError, match="compile.components must be one of"):
        JobConfig(compile=Compile(components=["model", "optimizer"])).validate()


def test_flavor_choices_are_the_model_module_flavors():
    from titan_cp.families.llama3.flavors import FLAVORS

    for flavor in FLAVORS:
        assert load_quiet(["--model.flavor", flavor]).model.flavor == flavor


def test_headtail_is_zigzag():
    cfg = load_quiet(["--parallelism.context_parallel_load_balancer", "headtail"])
    assert cfg.parallelism.context_parallel_load_balancer == "zigzag"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--training.steps", "0"], "training.steps must be positive"),
        (["--training.local_batch_size", "-2"], "training.local_batch_size must be positive"),
        (["--optimizer.lr", "-1"], "optimizer.lr must be positive"),
        (["--optimizer.beta2", "1.0"], "optimizer.beta2 must be in"),
        (["--model.name", "llama2"], "model.name must be one of"),
        (["--model.flavor", "8b"], "did you mean '8B'"),
        (["--parallelism.tensor_parallel_degree", "0"], "parallelism.tensor_parallel_degree must be positive"),
        (
            ["--parallelism.data_parallel_shard_degree", "-2"],
            "parallelism.data_parallel_shard_degree must be positive or -1",
        ),
        (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio"),
        (["--activation_checkpoint.selective_ac_option", "every"], "activation_checkpoint.selective_ac_option"),
        (["--validation.recall_buckets", "100,50"], "validation.recall_buckets"),
        (
            ["--parallelism.context_parallel_ulysses_degree", "2"],
            "only used with parallelism.context_parallel_strategy",
        ),
        (
            [
                "--parallelism.context_parallel_strategy",
                "hybrid",
                "--parallelism.context_parallel_degree",
                "4",
                "--parallelism.context_parallel_ulysses_degree",
                "3",
            ],
            "context_parallel_ulysses_degree \\(3\\) must divide",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--training.local_batch_size",
                "3",
                "--parallelism.pipeline_parallel_microbatch_size",
                "2",
            ],
            "pipeline_parallel_microbatch_size",
        ),
        (["--training.packing", "bestfit"], "training.packing must be one of .*did you mean 'best_fit'"),
        (["--training.packing_lookahead", "0"], "training.packing_lookahead must be positive"),
        (["--training.loss_roles", "assistant,bot"], "training.loss_roles must be one of"),
        (["--training.loss_roles", ""], "training.loss_roles is empty"),
        (["--validation.dataset", "mixture"], "validation.dataset = 'mixture' is not supported"),
    ],
)
def test_bad_values_name_the_key(argv, fragment):
    with pytest.raises(ValueError, match=fragment):
        check_model(load_config(argv))  # the model's keys are its family's (titan_cp.preflight.check_model)


@pytest.mark.parametrize(
    "balancer, cp, seq_len, ok",
    [
        ("zigzag", 4, 8192, True),
        ("zigzag", 4, 8196, False),
        ("doc_zigzag", 3, 6 * 7, True),
        ("doc_zigzag", 3, 3 * 7, True),
        ("doc_zigzag", 3, 3 * 7 + 1, False),
        ("contiguous", 3, 3 * 7, True),
        ("contiguous", 4, 4 * 7 + 2, False),
        ("zigzag", 1, 7, True),
    ],
)
@pytest.mark.parametrize("key", ["training.seq_len", "validation.seq_len"])
def test_seq_len_divisibility_names_both_keys(key, balancer, cp, seq_len, ok):
    argv = [
        "--parallelism.context_parallel_load_balancer",
        balancer,
        "--parallelism.context_parallel_degree",
        str(cp),
        "--training.seq_len",
        str(2 * cp * 8),
        f"--{key}",
        str(seq_len),
    ]
    if ok:
        cfg = load_quiet(argv)
        assert getattr(cfg, key.split(".")[0]).seq_len == seq_len
    else:
        with pytest.raises(
            ValueError,
            match=rf"{key} \({seq_len}\) must be divisible by "
            rf"parallelism.context_parallel_degree \({cp}\)",
        ):
            load_config(argv)


def test_gradient_accumulation():
    cfg = load_quiet(["--training.local_batch_size", "2", "--training.global_batch_size", "12"])
    assert cfg.resolve_batch_sizes(dp_degree=3) == (12, 2)
    assert cfg.resolve_batch_sizes(dp_degree=6) == (12, 1)
    with pytest.raises(
        ValueError, match=r"training.global_batch_size \(12\) must be a multiple of training.local_batch_size \(2\)"
    ):
        cfg.resolve_batch_sizes(dp_degree=4)
    cfg = load_quiet(["--training.local_batch_size", "2", "--training.gradient_accumulation_steps", "3"])
    assert cfg.resolve_batch_sizes(dp_degree=2) == (12, 3)
    assert load_quiet(["--training.local_batch_size", "2"]).resolve_batch_sizes(dp_degree=4) == (8, 1)
    # with every degree known, load_config checks divisibility itself
    with pytest.raises(ValueError, match="training.global_batch_size"):
        load_config(
            [
                "--parallelism.data_parallel_shard_degree",
                "2",
                "--training.local_batch_size",
                "2",
                "--training.global_batch_size",
                "6",
            ]
        )
    with pytest.raises(ValueError, match="training.gradient_accumulation_steps \\(2\\) disagrees"):
        load_config(
            [
                "--parallelism.data_parallel_shard_degree",
                "2",
                "--training.local_batch_size",
                "2",
                "--training.global_batch_size",
                "12",
                "--training.gradient_accumulation_steps",
                "2",
            ]
        )


@pytest.mark.parametrize("path", sorted((REPO / "train_configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_train_config_loads(path):
    cfg = load_quiet(["--job.config_file", str(path)])
    assert cfg.model.name == "llama3"
    assert path.read_text().startswith("#"), "each preset starts with a comment header"
    assert cfg.parallelism.context_parallel_degree > 1


def test_train_configs_present():
    names = {p.name for p in (REPO / "train_configs").glob("*.toml")}
    assert names >= {
        "debug_cp.toml",
        "debug_fsdp_cp.toml",
        "debug_tp_cp.toml",
        "debug_pp_cp.toml",
        "debug_hybrid_cp.toml",
        "llama3_8b_128k.toml",
        "llama3_8b_256k.toml",
        "llama3_70b_cp.toml",
    }


# --------------------------------------------------------------------------------------------
# every key is read by the package


def _attributes_read(trees) -> set[str]:
    import ast

    return {
        node.attr
        for tree in trees
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
    }


# JobConfig methods that hand values to the run (not validation), e.g. the mesh degrees.
CONFIG_READERS = {"parallel_degrees", "resolve_batch_sizes"}


# Fields read generically rather than by attribute name, with the reader.
READ_GENERICALLY = {
    "job.config_file": "load_config takes it from argv before the config exists",
}


def test_every_config_field_is_read_outside_config_py():
    """A key that nothing reads is a bug: each field name must be read as an attribute somewhere in
    titan_cp/ outside the config package (validation does not count)."""
    import ast
    import dataclasses

    from titan_cp import config

    package = REPO / "titan_cp" / "config"
    trees = [ast.parse(p.read_text()) for p in (REPO / "titan_cp").rglob("*.py") if package not in p.parents]
    readers = [
        node
        for p in package.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name in CONFIG_READERS
    ]
    assert {node.name for node in readers} == CONFIG_READERS
    trees += readers
    read = _attributes_read(trees)
    unread = [
        f"{section.name}.{f.name}"
        for section in dataclasses.fields(config.JobConfig)
        for f in dataclasses.fields(section.default_factory())
        if f.name not in read and f"{section.name}.{f.name}" not in READ_GENERICALLY
    ]
    assert not unread, f"config keys read by nothing in titan_cp/: {unread}"


# --------------------------------------------------------------------------------------------
# bad input: clear errors naming the key, before any process group


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--optimizer.lr", "nan"], "optimizer.lr must be a finite number"),
        (["--optimizer.lr", "inf"], "optimizer.lr must be a finite number"),
        (["--optimizer.lr", "1e400"], "optimizer.lr must be a finite number"),
        (["--training.max_norm", "nan"], "training.max_norm must be a finite number"),
        (["--training.seed", str(2**64)], "training.seed = 18446744073709551616 does not fit in 64 bits"),
        (["--training.steps", str(2**63)], "training.steps = .* does not fit in 64 bits"),
        (["--checkpoint.load_step", "-2"], "checkpoint.load_step must be >= -1"),
        (
            ["--parallelism.tensor_parallel_degree", "3", "--model.flavor", "tiny"],
            r"parallelism.tensor_parallel_degree \(3\) must divide the heads of model.flavor = 'tiny' \(4\)",
        ),
        (
            ["--parallelism.tensor_parallel_degree", "4", "--model.flavor", "tiny"],
            r"tensor_parallel_degree \(4\) must divide the KV heads",
        ),
        (
            [
                "--parallelism.context_parallel_strategy",
                "ulysses",
                "--parallelism.context_parallel_degree",
                "8",
                "--model.flavor",
                "tiny",
            ],
            r"parallelism.context_parallel_degree \(8\) must divide the query heads",
        ),
        (
            [
                "--parallelism.context_parallel_strategy",
                "hybrid",
                "--parallelism.context_parallel_degree",
                "8",
                "--parallelism.context_parallel_ulysses_degree",
                "8",
                "--model.flavor",
                "tiny",
            ],
            r"parallelism.context_parallel_ulysses_degree \(8\) must divide",
        ),
        (
            ["--parallelism.pipeline_parallel_degree", "4", "--model.flavor", "tiny"],
            r"pipeline_parallel_degree \(4\) .* 4 stages, more than the 2 layers of model.flavor = 'tiny'",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
                "--model.flavor",
                "tiny",
            ],
            "4 stages, more than the 2 layers",
        ),
        (["--validation.enable", "--validation.steps", "-1"], "validation.steps = -1 .* 'synthetic_recall' is endless"),
    ],
)
def test_bad_numbers_and_degrees_name_the_key(argv, fragment):
    with pytest.raises(ValueError, match=fragment):
        check_model(load_config(["--lr_scheduler.warmup_steps", "1", *argv]))


def test_toml_non_finite_and_huge_values(tmp_path):
    with pytest.raises(ValueError, match="training.max_norm must be a finite number"):
        load_config(["--job.config_file", write(tmp_path, "[training]\nmax_norm = nan\n")])
    with pytest.raises(ValueError, match="optimizer.lr must be a finite number"):
        load_config(["--job.config_file", write(tmp_path, "[optimizer]\nlr = inf\n", "b.toml")])


def test_configs_built_in_code_are_checked_too():
    from titan_cp.config import Optimizer, Training

    with pytest.raises(ValueError, match="optimizer.lr must be a finite number"):
        JobConfig(optimizer=Optimizer(lr=float("nan"))).validate()
    with pytest.raises(ValueError, match="training.seed = .* does not fit in 64 bits"):
        JobConfig(training=Training(seed=2**70)).validate()


def test_warmup_longer_than_the_run_is_shortened_with_a_warning():
    with pytest.warns(UserWarning, match=r"lr_scheduler.warmup_steps \(200\) is longer than training.steps \(5\)"):
        cfg = load_config(["--training.steps", "5"])
    assert cfg.lr_scheduler.warmup_steps == 5


def test_toml_syntax_error_and_missing_file_name_the_file(tmp_path):
    path = write(tmp_path, "[training\nsteps = 3\n")
    with pytest.raises(ValueError, match=rf"job.config_file = '{path}' is not valid TOML"):
        load_config(["--job.config_file", path])
    with pytest.raises(ValueError, match="job.config_file = 'nope.toml' does not exist"):
        load_config(["--job.config_file", "nope.toml"])


def test_two_toml_keys_for_one_setting_is_an_error(tmp_path):
    path = write(tmp_path, "[training]\nbatch_size = 4\nlocal_batch_size = 2\n")
    with pytest.raises(
        ValueError, match="training.batch_size and training.local_batch_size .* both set training.local_batch_size"
    ):
        load_config(["--job.config_file", path])
    # the command line overrides the TOML, whichever name it uses
    path = write(tmp_path, "[training]\nlocal_batch_size = 2\n", "b.toml")
    with pytest.warns(UserWarning, match="renamed"):
        assert load_config(["--job.config_file", path, "--training.batch_size", "4"]).training.local_batch_size == 4


def test_check_files_before_any_process_group(tmp_path):
    cfg = load_quiet(["--model.hf_assets_path", str(tmp_path)])
    with pytest.raises(ValueError, match="model.hf_assets_path = .* holds no tokenizer.json"):
        check_files(cfg)
    cfg = load_quiet(["--training.dataset", "c4"])
    with pytest.raises(ValueError, match="training.dataset = 'c4' is not built in .* set training.dataset_path"):
        check_files(cfg)
    cfg = load_quiet(["--training.dataset", "text", "--training.dataset_path", str(tmp_path / "none")])
    with pytest.raises(ValueError, match="training.dataset_path = .* does not exist"):
        check_files(cfg)
    cfg = load_quiet(["--validation.enable", "--validation.dataset", "text", "--validation.steps", "2"])
    with pytest.raises(ValueError, match="validation.dataset = 'text' is not built in"):
        check_files(cfg)
    cfg = load_quiet(["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--checkpoint.load_step", "4"])
    with pytest.raises(ValueError, match="checkpoint.load_step = 4, but .* holds no checkpoint"):
        check_files(cfg)
    (tmp_path / "checkpoint" / "step-2").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"checkpoint.load_step = 4, but .* holds steps \[2\]"):
        check_files(cfg)
    cfg = load_quiet(["--checkpoint.initial_load_path", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="checkpoint.initial_load_path = .* does not exist"):
        check_files(cfg)
    check_files(load_quiet([]))  # the defaults need no file


def test_no_arguments_and_help_print_usage(capsys):
    from titan_cp.train import main

    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: torchrun") and "--training.steps (int, default 10000)" in out
    for argv in (["--help"], ["--job.config_file", "train_configs/debug_cp.toml", "-h"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("usage:")


def test_empty_jsonl_file_disables_it(tmp_path):
    from titan_cp.metrics import MetricsLogger

    cfg = load_quiet(["--metrics.save_jsonl_file="])
    assert cfg.metrics.save_jsonl_file == ""
    logger = MetricsLogger(tmp_path, cfg, enabled=True)
    logger.log(
        {
            "step": 1,
            "loss": 1.0,
            "grad_norm": 1.0,
            "lr": 1e-3,
            "tokens_per_second": 1.0,
            "mfu": 0.5,
            "memory_bytes": 0,
            "eta_seconds": 0.0,
        },
        console=True,
    )
    logger.close()
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------
# the package's own shape: bounds beside the fields, keys given, validation apart from adjustment


def _bounded_keys(bound):
    from titan_cp.config.job import known_keys
    from titan_cp.config.values import split_hint

    return [key for key, hint in known_keys().items() if bound in split_hint(hint)[1]]


def test_bound_errors_name_the_key_the_field_sits_at():
    """Every field declared ``Annotated[int, Positive]`` (or ``PositiveOrAuto``) refuses 0 (or -2)
    with an error naming its own section and field, for configs built in code too."""
    from titan_cp.config.values import Positive, PositiveOrAuto

    positive, auto = _bounded_keys(Positive), _bounded_keys(PositiveOrAuto)
    assert {"training.steps", "optimizer.lr", "parallelism.context_parallel_degree"} <= set(positive)
    assert {"training.global_batch_size", "validation.steps"} <= set(auto)
    for keys, bad, words in ((positive, 0, "must be positive"), (auto, -2, r"must be positive or -1 \(automatic\)")):
        for key in keys:
            cfg = JobConfig.from_values({key: bad})
            with pytest.raises(ValueError, match=rf"^{key} {words}, got -?[0-9.]+"):
                cfg.validate()


def test_given_keys_are_those_of_the_toml_and_the_command_line(tmp_path):
    path = write(tmp_path, "[training]\nbatch_size = 4\nsteps = 7\n[lr_scheduler]\nwarmup_steps = 2\n")
    with pytest.warns(UserWarning, match="renamed"):
        cfg = load_config(["--job.config_file", path, "--optimizer.lr", "1e-3"])
    for key in ("training.local_batch_size", "training.steps", "optimizer.lr", "job.config_file"):
        assert cfg.is_given(key), key
    assert not cfg.is_given("training.mixed_precision_param") and not cfg.is_given("training.batch_size")
    assert JobConfig().given_keys == frozenset()


def test_validation_changes_nothing_and_reconcile_adjusts(monkeypatch):
    from titan_cp.config import Training

    cfg = JobConfig(training=Training(steps=5))
    cfg.validate()
    assert cfg.lr_scheduler.warmup_steps == 200  # validation is pure
    notes = cfg.reconcile()
    assert cfg.lr_scheduler.warmup_steps == 5
    assert notes == ["lr_scheduler.warmup_steps (200) is longer than training.steps (5): warming up over 5 steps"]
    assert cfg.reconcile() == []
    # whether to warn is the caller's: no environment variable is read
    monkeypatch.setenv("RANK", "3")
    with pytest.warns(UserWarning, match="lr_scheduler.warmup_steps"):
        load_config(["--training.steps", "5"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(["--training.steps", "5"], warn_adjustments=False).lr_scheduler.warmup_steps == 5


@pytest.mark.parametrize(
    "schedule,local_batch_size,rows,refusal",
    [
        ("1F1B", 1, 1, r"'1F1B' needs at least as many microbatches as its 2 pipeline stages, got 1 microbatch "
         r"\(training.local_batch_size 1 / parallelism.pipeline_parallel_microbatch_size 1\): raise "
         r"training.local_batch_size to 2 or more$"),
        ("1F1B", 2, 2, r"got 1 microbatch .*: raise training.local_batch_size to 4 or more or lower "
         r"parallelism.pipeline_parallel_microbatch_size$"),
        ("DualPipeV", 3, 1, r"'DualPipeV' needs at least as many microbatches as its 4 pipeline stages, got 3"),
        ("Interleaved1F1B", 5, 1, r"'Interleaved1F1B' needs the microbatches to be a multiple of its rounds "
         r"\(5 // parallelism.pipeline_parallel_degree 2 = 2\), got 5 microbatches .*: set "
         r"training.local_batch_size to 4 or 6$"),
        ("InterleavedZeroBubble", 7, 1, r"multiple of its rounds \(7 // .* = 3\), .* to 6 or 8$"),
        # what the schedules run (tests/test_composition.py runs Interleaved1F1B's 4 stages on 2 microbatches)
        ("1F1B", 2, 1, None),
        ("GPipe", 1, 1, None),
        ("Interleaved1F1B", 3, 1, None),
        ("Interleaved1F1B", 6, 1, None),
        ("ZBVZeroBubble", 1, 1, None),
        ("DualPipeV", 4, 1, None),
    ],
)  # fmt: skip
def test_pipeline_microbatches_the_schedule_cannot_take_are_refused_before_start(
    schedule, local_batch_size, rows, refusal
):
    """PP 2 x CP 2: ``torch.distributed.pipelining``'s schedules refuse too few microbatches (1F1B, DualPipeV) or a
    count their rounds do not divide (the interleaved ones) when they are built, after the process groups; the
    config refuses them first, in one line naming the keys."""
    argv = [
        "--model.flavor", "debugmodel",
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.context_parallel_degree", "2",
        "--parallelism.pipeline_parallel_schedule", schedule,
        "--parallelism.pipeline_parallel_microbatch_size", str(rows),
        "--training.local_batch_size", str(local_batch_size),
    ]  # fmt: skip
    if refusal is None:
        load_config(argv)
        return
    with pytest.raises(ValueError, match=r"^parallelism.pipeline_parallel_schedule = " + ".*" + refusal) as e:
        load_config(argv)
    assert "\n" not in str(e.value)
