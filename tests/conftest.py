"""Test tiers, and shared fixtures made once per session: tiny HF checkpoints of every family and
variant, their Megatron conversions (made with the user-facing converter script), and the demo's
inputs."""

import os

import pytest

from tests.launch import finish, last_json, run, start

# Tiers (markers registered in pytest.ini): `pytest -m unit` is `make test-quick`.
UNIT = "unit"  # in this process only: no subprocess, no process group, no vLLM; seconds
DISTRIBUTED = "distributed"  # launches gloo worlds or megarl's tools (tests/workers/*, converters)
E2E = "e2e"  # vLLM, the training loop, Ray, Slurm: scripts end to end
# Every test module's tier, by module name: a tier, or (the module's tier, {test function: its tier})
# for a module that mixes tiers. A module missing here fails collection, so each new one gets a tier.
TIERS = {
    "test_activations_hybrid": UNIT,
    "test_actor_critic": DISTRIBUTED,
    # the sandbox and the tool pool start processes; the rollouts run real vLLM
    "test_agent_loop": (E2E, {name: UNIT for name in (
        "test_hermes_calls_are_parsed_and_bad_ones_named", "test_calculator_is_exact_and_refuses_code",
        "test_schemas_come_from_the_attribute_or_the_signature",
        "test_tool_demo_traces_call_insert_and_answer", "test_records_choose_tools_as_verl_lays_them_out")}),
    "test_algos_advantage_step": UNIT,
    "test_algos_advantages": UNIT,
    "test_algos_distill": UNIT,
    "test_algos_losses": UNIT,
    "test_algos_rollout_correction": UNIT,
    "test_algos_shaping": UNIT,
    "test_algos_staleness": UNIT,
    "test_async_rollout": E2E,  # rollout ranks of their own: real vLLM, the loop under torchrun
    # every bench script at its smallest size; most start vLLM, the trainer or torchrun worlds
    "test_bench_smoke": (E2E, {"test_every_bench_make_bench_runs_is_smoked_here": UNIT,
                               "test_bench_rewards": DISTRIBUTED, "test_bench_sync_copies": DISTRIBUTED,
                               "test_bench_train": DISTRIBUTED, "test_bench_memory": DISTRIBUTED}),
    "test_algos_vocab_parallel": (UNIT, {"test_two_rank_gloo_group_matches_full_log_softmax_with_each_kernel":
                                       DISTRIBUTED}),
    "test_architecture": UNIT,
    "test_checkpoint_extra_state": (DISTRIBUTED, {"test_only_extra_state_may_be_on_one_side_fuzzed": UNIT,
                                                   "test_a_long_mismatch_is_named_in_part": UNIT}),
    "test_checkpoint_files": (DISTRIBUTED, {"test_missing_and_truncated_hf_shards": UNIT}),
    "test_collective_timeout": DISTRIBUTED,
    "test_config_keys": UNIT,
    "test_conversion": (DISTRIBUTED, {"test_converter_names_its_directions": UNIT}),
    "test_conversion_fuzz": (DISTRIBUTED, {"test_ci_seeds_cover_mtp_states_and_uneven_stages": UNIT}),
    "test_cpu_compat": UNIT,
    "test_device_choice": UNIT,
    "test_device_memory": UNIT,
    "test_disk_room": UNIT,
    "test_docs": UNIT,  # README.md and docs/*.md: length, links, anchors, config keys
    "test_dynamic_sampling": UNIT,
    "test_fp8_checkpoints": (DISTRIBUTED, {"test_reader_dequantizes_as_vllm_does": UNIT,
                                           "test_published_fp8_configs_are_read": UNIT,
                                           "test_transformers_own_fp8_read_is_the_reference_where_it_is_right":
                                               UNIT,
                                           "test_other_formats_are_refused_by_name": UNIT}),
    # two torchrun launches (convert + FP8 export), vLLM's loader, transformers
    "test_fp8_export": DISTRIBUTED,
    "test_fp8_quantizer": UNIT,
    "test_eval_config": UNIT,
    "test_eval_metrics": UNIT,
    "test_evaluate_script": UNIT,
    # scripts/gpu_check.sh end to end on the CPU (parity, bench and memory launches); the size check
    # real vLLM FP8 engines after real syncs (scripts/verify_sync.py); the layout check alone
    "test_fp8_engine": (E2E, {
        "test_what_an_fp8_engine_cannot_hold_is_refused_by_name": UNIT,
        "test_plan_sync_counts_fp8_engine_bytes": UNIT,
        "test_the_plan_quantizes_on_the_sender_where_its_slabs_are_whole_blocks": UNIT}),
    "test_gpu_check": (DISTRIBUTED, {"test_the_gpu_plan_is_the_issue_s_check": UNIT,
                                     "test_problems_name_each_failed_check": UNIT,
                                     "test_the_dense_update_and_the_head_are_held_to_their_targets_on_a_gpu":
                                         UNIT,
                                     "test_travel_size_sums_the_wheels_and_refuses_over_the_limit": UNIT}),
    "test_gpu_smoke": E2E,  # tests/gpu/: skipped without CUDA (tests/gpu/conftest.py)
    "test_gated_delta_rule": UNIT,
    "test_hybrid_packing": DISTRIBUTED,  # one two-rank launch
    "test_hf_config": UNIT,
    "test_gpt_oss": UNIT,
    # the parity and round-trip launches (one per world size); the syncs into vLLM; the rest reads
    # files in this process
    "test_lora": (DISTRIBUTED, {"test_vllm_generates_with_the_adapters_merged_in": E2E, **{
        name: UNIT for name in (
        "test_the_adapters_change_the_model", "test_config_refuses_bad_values_by_name",
        "test_a_kind_the_family_lacks_is_refused_naming_its_kinds",
        "test_expert_slices_follow_peft_s_own_delta", "test_transformers_4_expert_adapters_are_refused",
        "test_run_adapter_sizes_are_the_files", "test_actor_lora_init_resolves_to_the_folders_adapters",
        "test_some_projections_of_a_fused_linear_read_as_those_alone",
        "test_actor_lora_targets_take_hf_projection_names",
        "test_peft_s_unsupported_features_are_refused_naming_the_field",
        "test_megarl_s_names_select_the_adapted_projections_in_peft")}}),
    # the export's receives on the links' device; one live export at PP2 on two gloo ranks
    "test_hf_export": (UNIT, {"test_a_live_export_with_direct_slabs_receives_only_on_the_links_device":
                              DISTRIBUTED}),
    # make -n: prints the install's commands, runs none
    "test_install": (UNIT, {"test_make_install_selects_environment_lock_and_steps": DISTRIBUTED}),
    "test_layout_flags": UNIT,
    "test_layout_parity": DISTRIBUTED,
    "test_loop": E2E,
    "test_nonfinite": DISTRIBUTED,
    # a colocated run's memory events on the real engine, instrumented (vLLM, the loop)
    # the planner's terms here; its plan against a real actor's measured phases (gloo ranks)
    "test_memory_plan": (DISTRIBUTED, {name: UNIT for name in (
        "test_meta_model_holds_what_the_sync_layout_says", "test_sync_bound_holds_the_planned_peak",
        "test_activations_shrink_with_recompute_tp_and_pipeline_units",
        "test_a_lora_actor_trains_its_adapters_alone", "test_plan_matches_the_h200_slices",
        "test_step_transients_match_the_resident_set", "test_knobs_leave_out_what_the_run_has_set")}),
    "test_memory_order": (E2E, {"test_phase_timer_moves_seconds_between_phases": UNIT}),
    "test_offload": E2E,  # its launches hand memory over to a real vLLM engine
    "test_packing": UNIT,
    "test_parallel_dims": UNIT,
    "test_param_layout_te": UNIT,
    "test_placement": UNIT,
    "test_plan_sync": E2E,  # real syncs through scripts/verify_sync.py: vLLM
    "test_plan_sync_unit": UNIT,
    "test_portable_attention": UNIT,
    "test_presets": UNIT,
    "test_producer_seam": UNIT,
    "test_prompts": UNIT,
    "test_resharding_plan": UNIT,
    "test_recompute_offload": (DISTRIBUTED, {name: UNIT for name in (
        "test_recompute_settings_are_refused_with_the_fix",
        "test_recompute_fields_reach_megatron_or_name_the_problem",
        "test_offload_settings_and_the_optimizer_config_they_make")}),
    "test_reward_terms": UNIT,
    # the scoring pool's tests start worker processes
    "test_rewards": (UNIT, {name: DISTRIBUTED for name in (
        "test_failures_score_zero_and_are_counted",
        "test_hanging_and_dying_functions_are_cut_and_their_workers_replaced",
        "test_a_reward_file_outside_any_package_as_verl_names_it")}),
    "test_rollout_engine": (UNIT, {"test_sampling_parameters_reach_vllm": E2E}),
    "test_routing_replay": E2E,  # vLLM returns routing; the actor replays it
    # the code sandbox tried as a red team would (bubblewrap processes, a tool worker); seconds
    "test_sandbox": DISTRIBUTED,
    # the SandboxFusion client against a small real run_code server in the test; seconds
    "test_sandbox_http": DISTRIBUTED,
    "test_routing_holes": UNIT,
    "test_slurm": E2E,
    "test_slurm_env": DISTRIBUTED,  # sources the sbatch scripts' env.sh in bash
    "test_source_layout": UNIT,
    "test_source_layout_live": DISTRIBUTED,
    "test_spec_keys": DISTRIBUTED,  # Megatron models at TP2 over gloo
    "test_streaming_rollout": E2E,  # partial rollouts on a real vLLM engine
    # one 2-rank launch: the actor and teachers at layouts of their own, against transformers
    "test_teacher": (DISTRIBUTED, {name: UNIT for name in (
        "test_a_teacher_layout_that_does_not_divide_the_world_is_refused_by_name",
        "test_flops_count_the_teachers_forward_with_its_own_architecture",
        "test_plan_memory_shows_the_teacher_phase_and_preflight_refuses_one_that_does_not_fit")}),
    # a vLLM server shared by the module, a two-rank worker, a run whose served teacher is killed
    "test_teacher_served": (E2E, {"test_token_scores_read_vllm_prompt_logprobs": UNIT,
                                  "test_a_url_that_does_not_answer_is_refused": UNIT}),
    "test_teacher_config": UNIT,
    # real TensorBoard, W&B (offline) and MLflow (SQLite) files, read back; ~10 s
    "test_trackers": UNIT,
    "test_trainer_checkpoint": UNIT,
    "test_trainer_flops": UNIT,
    # one pair of two-rank converter launches whose ranks disagree; the rest pure
    "test_transformer_engine_choice": (UNIT, {
        "test_ranks_on_different_layer_specs_are_refused_before_any_model_is_built": DISTRIBUTED}),
    "test_two_node_ray": E2E,  # a two-node Ray cluster on this machine, one step of the demo
    "test_typed_config": UNIT,
    "test_value_model": DISTRIBUTED,
    "test_vllm_cpu_fixes": E2E,  # imports vLLM's sampler (seconds); no engine
    "test_weight_sync": (E2E, {"test_stale_shared_memory_segments_are_removed": UNIT}),
    "test_weight_sync_fuzz": (E2E, {"test_seeds_cover_the_risky_corners": UNIT}),
    "test_weight_transforms": UNIT,
    "test_worker_env": UNIT,
}


def _tiers(module: str):
    """(the module's tier, {test function: tier}) as TIERS gives them."""
    entry = TIERS[module]
    return entry if isinstance(entry, tuple) else (entry, {})


class _Untiered(pytest.Module):
    def collect(self):
        raise self.CollectError(
            f"{self.path.name} has no test tier: add {self.path.stem!r} to TIERS in tests/conftest.py "
            f"({UNIT}, {DISTRIBUTED} or {E2E}; see docs/testing.md)")


def pytest_pycollect_makemodule(module_path, parent):
    if module_path.stem not in TIERS:
        return _Untiered.from_parent(parent, path=module_path)
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        default, tests = _tiers(item.path.stem)
        stale = sorted(name for name in tests if not hasattr(item.module, name))
        if stale:
            raise pytest.UsageError(f"TIERS in tests/conftest.py names tests that {item.path.name} does "
                                    f"not have: {stale}")
        item.add_marker(getattr(pytest.mark, tests.get(getattr(item, "originalname", item.name), default)))


def pytest_collection_finish(session):
    """Refuse to start tests that launch anything on a disk too full to hold what they write."""
    if not any(item.get_closest_marker(UNIT) is None for item in session.items):
        return
    import tempfile

    from tests import disk_room

    folder = str(session.config.option.basetemp or tempfile.gettempdir())
    folder = folder if os.path.isdir(folder) else os.path.dirname(os.path.abspath(folder))
    why = disk_room.shortfall(folder, disk_room.SUITE_GIB)
    if why:
        raise pytest.UsageError(why)


def selected_params(request, name: str) -> set:
    """The values of parameter `name` in the selected tests that use the requesting (module-scoped)
    fixture: one that launches the work of several cases at once launches only what will be read."""
    values = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if (item.module is request.module and request.fixturename in item.fixturenames
                and callspec is not None and name in callspec.params):
            values.add(callspec.params[name])
    return values


# Every family, plus the variants that break naive code (tied embeddings, one KV head).
MODELS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "llama_tied", "qwen2_gqa1", "glm4_moe",
          "deepseek_v3", "gpt_oss", "qwen3_next", "qwen3_5_moe"]
# Sigmoid + expert-bias routing, shared experts, dense first layers, MTP (and MLA for DeepSeek).
DEEPSEEK_MODELS = ["glm4_moe", "deepseek_v3"]
# Gated DeltaNet hybrids: linear-attention layers beside gated full attention, a gated shared expert.
HYBRID_MODELS = ["qwen3_next", "qwen3_5_moe"]
MOE_MODELS = ["qwen3_moe", "mixtral", *DEEPSEEK_MODELS, "gpt_oss", *HYBRID_MODELS]
# Converted with 2 ranks (each rank writes half the layers); the others with one process.
TWO_RANK_CONVERSION = {"qwen3_moe", "llama_tied", "qwen2"}
# Three layers: no even split over two pipeline stages, which the converter and the check scripts
# give 1 and 2 (ParallelDims.fit_stages). In hf_models beside MODELS; megatron_models leaves them
# out (tests/test_conversion.py converts the DeepSeek one with scripts/convert.py).
ODD_LAYER_MODELS = {"deepseek_v3_3layers": "deepseek_v3", "llama_tied_3layers": "llama_tied"}
# In hf_models only (tests/test_weight_sync.py): gpt-oss as published, its experts in MXFP4, and
# Qwen3-MoE in block FP8.
HF_ONLY_MODELS = ["gpt_oss_mxfp4", "qwen3_moe_fp8"]


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    from megarl.demo.tiny_checkpoint import make_named

    root = tmp_path_factory.mktemp("hf")
    return {**{name: make_named(name, str(root / name)) for name in [*MODELS, *HF_ONLY_MODELS]},
            **{name: make_named(model, str(root / name), num_hidden_layers=3)
               for name, model in ODD_LAYER_MODELS.items()}}


@pytest.fixture(scope="session")
def verified_sync(hf_models):
    """get(world, model, flags): scripts/verify_sync.py's report (actor perturbed by 0.05) at one
    layout, run once per session per (world, model, flags) and shared: the sync tests and the
    planner's comparison read one run. get.begin(world, model, flags) starts that run in the
    background (get then waits for it): runs of one rank side by side."""
    started = {}

    def begin(world: int, model: str, flags):
        key = (world, model, tuple(flags))
        if key not in started:
            started[key] = start("scripts/verify_sync.py", "--hf-dir", hf_models[model], "--perturb", "0.05",
                                 *flags, nproc=world, timeout=900)
        return started[key]

    def get(world: int, model: str, flags) -> dict:
        return last_json(begin(world, model, flags).result())

    get.begin = begin
    return get


@pytest.fixture(scope="session")
def engine_checks(hf_models):
    """tests/workers/engine_checks.py on the tiny Qwen3: the sampling tests' observations and the
    refused updates' messages, from one vLLM engine (tests/test_rollout_engine.py and
    tests/test_weight_sync.py)."""
    return last_json(run("tests/workers/engine_checks.py", "--hf-dir", hf_models["qwen3"]))


@pytest.fixture(scope="session")
def megatron_models(hf_models, tmp_path_factory):
    """Every model of MODELS converted by the converter script's own function, one launch per world size,
    both at once (tests/test_conversion.py runs the script itself)."""
    import json

    root = tmp_path_factory.mktemp("megatron")
    out = {name: str(root / name) for name in MODELS}
    jobs = {nproc: [["hf_to_megatron", hf_models[name], out[name]] for name in MODELS
                    if (name in TWO_RANK_CONVERSION) == (nproc == 2)] for nproc in (1, 2)}
    finish(*(start("tests/workers/convert_models.py", "--jobs", json.dumps(work), nproc=nproc, timeout=900)
             for nproc, work in jobs.items()))
    for path in out.values():
        assert os.path.isfile(os.path.join(path, "megarl_model.json"))
    return out


@pytest.fixture(scope="session")
def demo_inputs(tmp_path_factory):
    """The demo task's prompts (train.jsonl), held-out additions (heldout.jsonl), model (model/) and
    its Megatron conversion (megatron/), as make demo makes them (test_demo_reward_rises measured
    its bar on these), and the distillation demo's teacher (teacher/), as make demo-distill makes
    it: the same warm start carried on (model/ is unchanged by it)."""
    root = tmp_path_factory.mktemp("demo_inputs")
    run("scripts/prepare_demo.py", "--out", str(root), "--teacher-steps", "200")
    return root
