"""torchtitan compatibility: the keys titan_cp accepts and ignores, the legacy keys it renames,
and the values it reads as its own.

A torchtitan Llama 3 TOML (v0.2, or the v0.1 names) loads unmodified: its keys that titan_cp
does not implement are listed in one warning and ignored, renamed keys are applied to their
new name (and listed in the same warning).
"""

from __future__ import annotations

import functools

# torchtitan (v0.2 and the legacy v0.1 names) keys titan_cp accepts and ignores, by section
# ("a.b" for nested tables such as [quantize.linear.float8]). Among them, what titan_cp does
# instead: it logs without colors (metrics.disable_color_printing), reduces gradients in fp32
# (training.mixed_precision_reduce), computes the loss on logits gathered over tp
# (parallelism.disable_loss_parallel) and splits layers evenly over the schedule's stages
# (parallelism.pipeline_parallel_layers_per_stage).
TORCHTITAN_ONLY: dict[str, tuple[str, ...]] = {
    "job": ("print_args", "use_for_integration_test", "save_config_file", "custom_config_module"),
    "profiling": ("profiler_active", "profiler_warmup"),
    "metrics": ("save_for_all_ranks", "enable_wandb", "disable_color_printing"),
    "model": ("tokenizer_path", "converters", "print_after_conversion"),
    "optimizer": ("early_step_in_backward",),
    "training": ("dtype", "gc_freq", "gc_debug", "mixed_precision_reduce"),
    "training.dataloader": ("num_workers", "persistent_workers", "pin_memory", "prefetch_factor"),
    "parallelism": (
        "enable_compiled_autograd",
        "enable_async_tensor_parallel",
        "disable_sequence_parallel",
        "pipeline_parallel_split_points",
        "module_fqns_per_model_part",
        "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers",
        "pipeline_parallel_schedule_csv",
        "pipeline_parallel_expert_parallel_overlap",
        "context_parallel_rotate_method",
        "expert_parallel_degree",
        "expert_tensor_parallel_degree",
        "expert_parallel_comm_backend",
        "disable_loss_parallel",
        "pipeline_parallel_layers_per_stage",
    ),
    "checkpoint": (
        "enable_ft_dataloader_checkpoints",
        "initial_load_in_hf_quantized",
        "export_dtype",
        "create_seed_checkpoint",
        "load_only",
        "model_weights_only",
        "enable_first_step_checkpoint",
    ),
    "activation_checkpoint": (
        "per_op_sac_force_recompute_mm_shapes_by_fqns",
        "early_stop",
        "memory_budget",
        "visualize_memory_budget_pareto",
        "preserve_rng_state",
        "determinism_check",
        "debug",
    ),
    "comm": ("trace_buf_size", "save_traces_folder", "save_traces_file_prefix", "mode"),
    "validation.dataloader": ("num_workers", "persistent_workers", "pin_memory", "prefetch_factor"),
    "float8": (
        "enable_fsdp_float8_all_gather",
        "precompute_float8_dynamic_scale_for_fsdp",
        "force_recompute_fp8_weight_in_bwd",
        "recipe_name",
        "filter_fqns",
        "emulate",
        "moe_fqns_prototype",
    ),
    "mx": ("mxfp8_dim1_cast_kernel_choice", "recipe_name", "filter_fqns"),
    "quantize.linear.float8": (
        "enable_fsdp_float8_all_gather",
        "precompute_float8_dynamic_scale_for_fsdp",
        "force_recompute_fp8_weight_in_bwd",
        "recipe_name",
        "filter_fqns",
        "emulate",
    ),
    "quantize.linear.mx": ("mxfp8_dim1_cast_kernel_choice", "recipe_name", "filter_fqns"),
    "quantize.grouped_mm.float8": ("fqns",),
    "quantize.grouped_mm.mx": ("recipe_name", "fqns"),
    "memory_estimation": ("enable", "enabled", "disable_fake_mode"),
    "fault_tolerance": (
        "enable",
        "process_group",
        "process_group_timeout_ms",
        "replica_id",
        "group_size",
        "min_replica_size",
        "semi_sync_method",
        "sync_steps",
        "should_quantize",
        "fragment_sync_delay",
        "fragment_update_alpha",
    ),
    "experimental": ("custom_import", "custom_args_module"),
    "debug": ("deterministic_warn_only", "moe_force_load_balance"),
}

# Renamed torchtitan keys: old dotted name -> titan_cp dotted name.
RENAMED = {
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "training.batch_size": "training.local_batch_size",
    "training.compile": "compile.enable",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
    "validation.enabled": "validation.enable",
    "debug.seed": "training.seed",
    "debug.deterministic": "training.deterministic",
}

# torchtitan values with a titan_cp equivalent.
VALUE_ALIASES = {"parallelism.context_parallel_load_balancer": {"headtail": "zigzag"}}


@functools.cache
def torchtitan_keys() -> frozenset[str]:
    """Every dotted key of :data:`TORCHTITAN_ONLY`."""
    return frozenset(f"{section}.{key}" for section, keys in TORCHTITAN_ONLY.items() for key in keys)
