"""Switch-offs of the planner's named terms and hardware sources, the plan's one mesh, and the mends of the review
(tests/helpers/mutations.py runs them)."""
from __future__ import annotations

from mutation_tools import Mutation, Rewrite

RUNS = "tests/test_published_runs.py::test_every_run_is_predicted_within_tolerance"
PARALLEL_TERMS = "tests/test_cost_parallel_terms.py::"
SOURCES = "tests/test_hardware_sources.py::"
STEP_PEAK = "tests/test_step_peak.py::"

PLANNER = {
    "zero3_gathers_whole_layers": Mutation(
        "DeepSpeed ZeRO-3 is priced gathering whole layers ahead, not one submodule ahead of the one computing",
        Rewrite("colozoo.cost.step_time:_zero3_chain",
                ('if software.zero3_gather_unit == "submodule":', "if False:")),
        ("tests/test_published_runs.py::test_layouts_compared_on_the_same_gpus_rank_as_measured",)),
    "gather_buffers_free": Mutation(
        "zeroing each gathered buffer on the compute stream costs nothing",
        Rewrite("colozoo.cost.step_time:_buffer_fill", ("if not software.gather_buffer_zeroed:", "if True:")),
        ("tests/test_published_runs.py::test_layouts_compared_on_the_same_gpus_rank_as_measured",)),
    "compute_behind_traffic_adds": Mutation(
        "compute shorter than the traffic beside it still adds its SM contention to the step",
        Rewrite("colozoo.cost.step_time:overlapped",
                ("together = max(comm, compute + contention * comm)",
                 "together = max(comm, compute) + contention * min(compute, comm)")),
        ("tests/test_cost_terms.py::test_overlap_hides_traffic_but_takes_sms",)),
    "fused_swiglu_saves_all": Mutation(
        "a fused SwiGLU is priced saving its product as well as its two inputs",
        Rewrite("colozoo.cost.saved_layout:fused_swiglu_bytes",
                ("return max(0.0, elementwise - 2 * down) if down else 0.0", "return 0.0")),
        ("tests/test_saved_layout.py::test_fused_swiglu_keeps_only_its_two_inputs",)),
    "zero3_holds_whole_units": Mutation(
        "ZeRO-3 per submodule is priced holding a whole layer's gathered weights",
        Rewrite("colozoo.cost.zero3_submodules:held_share", ("return max(pairs) / sum(sizes)", "return 1.0")),
        ("tests/test_cost_terms.py::test_zero3_gathered_by_submodule",)),
    "ring_sends_hidden_states": Mutation(
        "context-parallel ring attention passes hidden-state-wide blocks instead of the family's keys and values",
        Rewrite("colozoo.cost.context_parallel:kv_bytes_per_token",
                ("return width * local / kv * itemsize", "return None")),
        (RUNS,)),
    "expert_group_spans_tp": Mutation(
        "Megatron-Core's folded expert layout is priced as colozoo's tp x ep span",
        Rewrite("colozoo.cost.experts:expert_span", ("return ep if folded else tp * ep", "return tp * ep")),
        (PARALLEL_TERMS + "test_expert_groups_and_their_all_to_all",)),
    "reduce_behind_last_backward_only": Mutation(
        "under the interleaved schedule the gradient reduction hides behind one micro-batch's backward only",
        Rewrite("colozoo.cost.step_time:reduce_window",
                ("return backward * (1 + min(plan.pp, plan.num_microbatches) * (v - 1) / v)", "return backward")),
        (PARALLEL_TERMS + "test_reduce_window_of_the_interleaved_cool_down",)),
    "expert_gemms_not_grouped": Mutation(
        "grouped expert GEMMs are traced as one product, not one per expert",
        Rewrite("colozoo.cost.op_flops:grouped_gemm_shape",
                ('if op != "_grouped_mm" or not flops', 'if True or op != "_grouped_mm" or not flops')),
        (PARALLEL_TERMS + "test_traced_expert_gemms_are_grouped_per_expert",)),
    "attention_backward_as_fast_as_forward": Mutation(
        "fused attention's backward is priced at its forward's speed",
        Rewrite("colozoo.cost.attention_speed:pass_tflops",
                ('return bwd * FWD_OVER_BWD if phase == "fwd" else bwd', "return both")),
        ("tests/test_attention_speed.py::test_backward_slower_than_forward_and_the_sum_as_measured",)),
    "every_ring_step_on_the_network": Mutation(
        "a ring leaving the node pays the network's latency on every step, NVLink hops included",
        Rewrite("colozoo.cost.network:latency_steps", ("between = steps * nodes / n", "between = steps")),
        ("tests/test_cost_terms.py::test_collectives_per_link_and_algorithm",)),
    "latency_beside_the_transfer": Mutation(
        "a collective pays every step's latency on top of its transfer, as if NCCL did not pipeline a step's slices",
        Rewrite("colozoo.cost.network:pipelined_seconds",
                ("max(hw.collective_latency_s, step) + between * max(hw.inter_node_latency_s, step))",
                 "hw.collective_latency_s + between * hw.inter_node_latency_s) + transfer")),
        ("tests/test_cost_terms.py::test_collectives_per_link_and_algorithm",
         "tests/test_grad_buckets.py::test_long_steps_hide_their_latency")),
    "tile_fit_takes_the_first": Mutation(
        "the measured GEMM grid does not choose the small tile: the first smaller candidate at the full rate always",
        Rewrite("colozoo.cost.measure:fit_small_tile",
                ("best = min(((tile, rate / 100) for tile in smaller for rate in range(50, 101)), key=error)",
                 "best = (smaller[0], 1.0)")),
        (SOURCES + "test_the_tile_fit_recovers_the_small_tile_a_grid_was_made_with",)),
    "one_gemm_tile": Mutation(
        "a GEMM is priced on the large tile only, as if cuBLAS never took a smaller one where it fills the SMs better",
        Rewrite("colozoo.cost.compute_time:wave_efficiency",
                ("([(hw.small_tile, hw.small_tile_efficiency)] if hw.small_tile else [])", "[]")),
        ("tests/test_cost_terms.py::test_gemm_tiles_fill_waves_of_sms",
         SOURCES + "test_tile_and_wave_quantization_explain_the_h200s_products")),
    "datasheet_preset_unknown": Mutation(
        "a GPU's name finds no datasheet preset (its measured fields then replace the datasheet's peaks)",
        Rewrite("colozoo.cost.measure:datasheet_preset",
                ('if any(part in upper for part in ("PCIE", "NVL", "GH200", "GB200")):', "if True:")),
        (SOURCES + "test_datasheet_presets_by_device_name",)),
    "plan_json_nested": Mutation(
        "a plan's JSON nests its degrees instead of the flat form config.json and plan --json hold",
        Rewrite("colozoo.runtime.plan:Plan.to_dict", ('return {**settings.pop("degrees"), **settings}',
                                                      "return settings")),
        ("tests/test_cost_terms.py::test_plan_holds_its_mesh_as_a_parallel_config",)),
    "sequence_multiple_ignores_tp": Mutation(
        "the sequence multiple under cp x sequence parallelism forgets that each cp share splits over tp",
        Rewrite("colozoo.core.sequence:sequence_multiple",
                ("return math.lcm(2 * cp if cp > 1 else 1, cp * sequence_parallel_tp)",
                 "return 2 * cp if cp > 1 else 1")),
        ("tests/test_finetune_honest.py::test_padding_multiple_is_what_the_layers_split",)),
    "grpo_draws_an_sft_batch": Mutation(
        "each GRPO step also draws an SFT batch it never trains on",
        Rewrite("colozoo.finetune.loop:next_batch", ("if trainer.rl is not None:", "if False:")),
        ("tests/test_finetune_grpo.py::test_stopped_run_resumes_exactly_between_two_uses_of_its_rollouts",)),
    "scoring_at_the_union_of_positions": Mutation(
        "evaluation projects every row's logits at the longest row's count of positions plus one",
        Rewrite("colozoo.evaluation.scoring:_kept_positions",
                ("width = max(map(len, needed))", "width = max(map(len, needed)) + 1")),
        ("tests/test_eval_scoring.py::test_each_row_projects_only_its_own_positions_and_scores_as_a_whole_forward",)),
    "saved_as_colozoo_saves": Mutation(
        "the memory model keeps colozoo's saved activations whatever the framework the run used",
        Rewrite("colozoo.cost.cost_model:_as_saved_by", ("if not (modules or hidden or fused or shard or copies):", "if True:")),
        ("tests/test_saved_layout.py::test_assemble_saves_as_the_software_does",)),
    "attention_keeps_projection_views": Mutation(
        "an attention kernel that copies q, k and v is priced keeping the whole qkv projection v is a slice of",
        Rewrite("colozoo.cost.cost_model:_as_saved_by",
                ("+ (u.attention_unviewed_bytes if copies else 0))", "+ 0)")),
        ("tests/test_saved_layout.py::test_attention_keeps_the_whole_projection_for_v_unless_its_kernel_copies_it[2]",)),
    "expert_dispatch_whole_tokens": Mutation(
        "Megatron-Core's expert all-to-all is priced carrying whole tokens from every tensor-parallel rank",
        Rewrite("colozoo.cost.experts:dispatched_share",
                ("return 1 / plan.tp if sharded and plan.sequence_parallel and plan.tp > 1 else 1.0", "return 1.0")),
        (PARALLEL_TERMS + "test_megatron_dispatch_moves_a_ranks_part_of_each_token", RUNS)),
    "split_experts_keep_rows_on_the_shard": Mutation(
        "experts split over tp are priced keeping their dispatched rows on the sequence shard",
        Rewrite("colozoo.cost.saved_layout:moe_shard_bytes",
                ("and (experts_whole or not _parts(key)[0].endswith(EXPERTS)))", ")")),
        ("tests/test_saved_layout.py::test_folded_experts_keep_a_tp_share_of_the_hidden_wide_rows",)),
    "dense_mlp_kept_as_routed": Mutation(
        "a dense layer's MLP inputs are priced on the sequence shard, as a routed MoE block's",
        Rewrite("colozoo.cost.saved_layout:moe_shard_bytes",
                ("if tp <= 1 or not hidden or not any(_parts(key)[0].endswith(EXPERTS) for key in module_saved):",
                 "if tp <= 1 or not hidden:")),
        ("tests/test_saved_layout.py::test_folded_experts_keep_a_tp_share_of_the_hidden_wide_rows",
         "tests/test_published_runs.py::test_every_run_fits_its_gpus")),
    "optimizer_states_always_fp32": Mutation(
        "master weights and optimizer states are priced in fp32 whatever dtype the software keeps them in",
        Rewrite("colozoo.cost.cost_model:_model_states",
                ("elements, state_bytes = trained // itemsize, software.optimizer_state_bytes",
                 "elements, state_bytes = trained // itemsize, 4")),
        ("tests/test_cost_terms.py::test_optimizer_states_kept_in_the_softwares_dtype",)),
    "grads_in_the_parameters_dtype": Mutation(
        "gradients are priced in the parameters' dtype whatever buffer the software accumulates them in",
        Rewrite("colozoo.cost.software:Software.grad_bytes",
                ("return (self.grad_reduce_bytes or itemsize) if self.grads_in_reduce_dtype else itemsize",
                 "return itemsize")),
        ("tests/test_cost_terms.py::test_gradients_kept_in_the_buffer_the_software_reduces_them_in",)),
    "grad_buffer_grows_with_the_backward": Mutation(
        "a gradient buffer allocated once is priced growing through the first backward like autograd's gradients",
        Rewrite("colozoo.cost.cost_model:_dynamic_peak",
                ("growing = m == 1 and not grad_buffer", "growing = m == 1")),
        ("tests/test_cost_terms.py::test_gradients_kept_in_the_buffer_the_software_reduces_them_in",)),
    "master_weights_as_wide_as_the_states": Mutation(
        "master weights are priced at the optimizer states' width whatever the software keeps of them",
        Rewrite("colozoo.cost.cost_model:_model_states",
                ("master_bytes = state_bytes if software.master_weight_bytes is None else software.master_weight_bytes",
                 "master_bytes = state_bytes")),
        ("tests/test_cost_terms.py::test_master_weights_kept_as_the_software_keeps_them",)),
    "forward_holds_all_it_saves": Mutation(
        "a unit's forward is priced holding everything it saves beside its worst temporaries, even what it saves later",
        Rewrite("colozoo.cost.cost_model:_dynamic_peak",
                ('unsaved = p.fwd_unsaved_bytes if policy == "none" else 0', "unsaved = 0")),
        (STEP_PEAK + "test_a_steps_peak_is_what_a_real_step_holds[1-64-8-2-256]",)),
    "backward_holds_all_it_saved": Mutation(
        "a unit's backward is priced holding everything it saved beside its worst temporaries, even what it released",
        Rewrite("colozoo.cost.cost_model:_dynamic_peak",
                ("held = rebuilt + p.bwd_transient_bytes - p.bwd_released_bytes",
                 "held = rebuilt + p.bwd_transient_bytes")),
        (STEP_PEAK + "test_a_steps_peak_is_what_a_real_step_holds[1-64-8-2-256]",)),
    "unsaved_bytes_released_twice": Mutation(
        "what the software does not save is taken off the backward's peak even where the backward had released it",
        Rewrite("colozoo.cost.cost_model:_as_saved_by",
                ("bwd_released_bytes=int(max(0, u.bwd_released_bytes - dropped(u)))",
                 "bwd_released_bytes=u.bwd_released_bytes")),
        (STEP_PEAK + "test_what_the_software_does_not_save_lowers_the_peak_only_where_it_was_held",)),
    "kept_gradients_all_made_at_the_worst_op": Mutation(
        "a unit's first backward is priced holding all the gradients it makes at its worst op, not those made so far",
        Rewrite("colozoo.cost.cost_model:_dynamic_peak",
                ("made = p.bwd_kept_grad_bytes * grad_per_byte if growing",
                 "made = p.grad_bytes * grad_per_byte if growing")),
        (STEP_PEAK + "test_a_steps_peak_with_the_gradients_it_makes[2-256-4-1-128-1]",)),
    "fresh_gradients_all_made_at_the_worst_op": Mutation(
        "a later micro-batch's backward is priced holding all its fresh gradients at once, not one GEMM's until added",
        Rewrite("colozoo.cost.cost_model:_dynamic_peak",
                ("else p.bwd_fresh_grad_bytes * fresh_per_byte", "else p.grad_bytes * fresh_per_byte")),
        (STEP_PEAK + "test_a_steps_peak_with_the_gradients_it_makes[1-512-8-1-64-2]",)),
    "tied_gradient_released_with_the_head": Mutation(
        "the tied embedding's gradient the fused head saves is priced released with the head's backward",
        Rewrite("colozoo.cost.cost_model:_dynamic_peak",
                ("live -= max(0.0, _saved_under(p, policy) - p.bwd_outlived_bytes)",
                 "live -= _saved_under(p, policy)")),
        (STEP_PEAK + "test_the_heads_weight_gradient_is_held_where_autograd_holds_it[gpt2]",)),
    "forward_made_gradient_made_again": Mutation(
        "a weight gradient the fused head makes in its forward is priced as made again in its backward",
        Rewrite("colozoo.cost.attribution:walk_memory",
                ("made_in_bwd = grads_by[name] - saved_by[name]", "made_in_bwd = grads_by[name]")),
        (STEP_PEAK + "test_a_layers_backward_makes_its_gradients_as_it_runs",)),
    "forward_made_gradient_held_twice": Mutation(
        "a weight gradient the fused head makes in its forward is priced held as saved after its backward, and kept",
        Rewrite("colozoo.cost.attribution:walk_memory",
                ("for r in saved_by[name] - grads_by[name]", "for r in saved_by[name]")),
        (STEP_PEAK + "test_the_heads_weight_gradient_is_held_where_autograd_holds_it[untied]",)),
    "generic_weights_traced_as_activations": Mutation(
        "a generic module's meta stand-ins are traced as activations and their gradients as temporaries",
        Rewrite("colozoo.cost.model_trace:_trace_sizes", ("stand_ins=stand_ins)", "stand_ins=None)")),
        ("tests/test_profiler.py::"
         "test_a_generic_modules_weights_and_gradients_are_neither_activations_nor_temporaries",)),
    "ddp_buckets_unpriced": Mutation(
        "torch DDP's gradient buckets are priced as absent, the gradients growing as autograd makes them",
        Rewrite("colozoo.cost.cost_model:_stage_cost",
                ("buckets = (software.torch_ddp_buckets and", "buckets = False and (software.torch_ddp_buckets and")),
        (STEP_PEAK + "test_a_data_parallel_steps_peak_with_ddps_buckets[1]",)),
    "no_sync_gradients_unpriced": Mutation(
        "the gradients micro-batches under DDP's no_sync accumulate beside its buckets are priced as the buckets'",
        Rewrite("colozoo.cost.cost_model:_stage_cost",
                ("held_grads = states.grads * (2 if buckets and plan.num_microbatches > 1 else 1)",
                 "held_grads = states.grads")),
        (STEP_PEAK + "test_a_data_parallel_steps_peak_with_ddps_buckets[2]",)),
    "ddp_gradients_beside_its_buckets": Mutation(
        "colozoo's DDP keeps its gradients as tensors of their own beside its buckets, not as views of them",
        Rewrite("colozoo.runtime.parallelize:_wrapped",
                (", gradient_as_bucket_view=True)", ")")),
        (STEP_PEAK + "test_a_data_parallel_steps_peak_with_ddps_buckets[1]",)),
    "fsdp_gathers_over_its_shard": Mutation(
        "a gathered layer is priced as the shards a rank lacks, not as weights of their own beside its shard",
        Rewrite("colozoo.cost.fsdp_memory:fsdp_walk",
                ("return (u.param_bytes - u.expert_param_bytes) + u.expert_param_bytes * (edp > 1)",
                 "return ((u.param_bytes - u.expert_param_bytes) * (1 - 1 / shard)"
                 " + u.expert_param_bytes * (1 - 1 / edp))")),
        (STEP_PEAK + "test_a_fully_sharded_steps_peak[2-layers]",)),
    "fsdp_root_resharded": Mutation(
        "FSDP's root (the embedding and head) is priced as gathered only while it computes",
        Rewrite("colozoo.cost.fsdp_memory:fsdp_walk",
                ("return float(sum(whole(u) for u in in_order if id(u) not in is_layer)), walk", "return 0.0, walk")),
        (STEP_PEAK + "test_a_fully_sharded_steps_peak[2-layers]",)),
    "fsdp_backward_prefetches_nothing": Mutation(
        "a layer's backward is priced without the next layer's gather issued before it computes",
        Rewrite("colozoo.cost.fsdp_memory:FsdpWalk.weights",
                ("return so_far + (g[prv] if self.regather and prv is not None else 0.0)", "return so_far")),
        (STEP_PEAK + "test_a_fully_sharded_steps_peak[4-layers]",)),
    "fsdp_gradients_made_sharded": Mutation(
        "FSDP's gradients are priced as shards as the backward makes them, not whole until reduce-scattered",
        Rewrite("colozoo.cost.cost_model:_dynamic_peak",
                ("made = (p.bwd_fresh_grad_bytes if deferred else p.bwd_kept_grad_bytes) + reducing",
                 "made = (p.bwd_fresh_grad_bytes if deferred else p.bwd_kept_grad_bytes * grad_per_byte) + reducing")),
        (STEP_PEAK + "test_a_fully_sharded_steps_peak[4-layers]",)),
    "reduce_scatter_input_released_at_once": Mutation(
        "a reduce-scatter's input is priced as freed when issued, not held through the next layer's backward",
        Rewrite("colozoo.cost.cost_model:_dynamic_peak",
                ("made = (p.bwd_fresh_grad_bytes if deferred else p.bwd_kept_grad_bytes) + reducing",
                 "made = (p.bwd_fresh_grad_bytes if deferred else p.bwd_kept_grad_bytes)")),
        (STEP_PEAK + "test_a_fully_sharded_steps_peak[4-layers]",)),
    "deferred_fsdp_gradients_sharded": Mutation(
        "FSDP's gradients kept to the last backward (torch's pipelines) are priced as shards, not accumulated whole",
        Rewrite("colozoo.cost.cost_model:_dynamic_peak",
                ("unsharded = traced_grads * fsdp.reduce_ratio if deferred else 0.0", "unsharded = 0.0")),
        (STEP_PEAK + "test_under_a_pipeline_fsdp_holds_what_ddp_holds",)),
    "wgrad_computed_beside_the_buffer": Mutation(
        "Megatron-Core's GEMMs are priced computing weight gradients into tensors of their own before adding them",
        Rewrite("colozoo.cost.cost_model:_dynamic_peak",
                ("fresh_per_byte = 0.0 if wgrad_fused else 1.0 if grad_buffer else grad_per_byte",
                 "fresh_per_byte = 1.0 if grad_buffer else grad_per_byte")),
        ("tests/test_cost_terms.py::test_gradients_kept_in_the_buffer_the_software_reduces_them_in",)),
    "out_tensors_read": Mutation(
        "an op's out= tensor is priced as read as well as written",
        Rewrite("colozoo.cost.trace:kernel_of",
                ('read, inputs = _tensor_bytes((args, {k: v for k, v in kwargs.items() if k != "out"}))',
                 "read, inputs = _tensor_bytes((args, kwargs))")),
        ("tests/test_cost_terms.py::test_an_out_tensor_is_written_not_read",)),
    "bare_allocations_priced": Mutation(
        "a bare allocation (torch.empty) is priced as a kernel writing the whole tensor",
        Rewrite("colozoo.cost.trace:kernel_of", ("or name in ALLOCATIONS:", ":")),
        ("tests/test_cost_terms.py::test_an_out_tensor_is_written_not_read",)),
    "unfused_head_softmax_beside_its_copy": Mutation(
        "the torch cross entropy writes the softmax of half-precision logits beside their fp32 copy, not into it",
        Rewrite("colozoo.kernels.cross_entropy:_VocabParallelCrossEntropy.forward",
                ("log_probs = torch.log_softmax(logits, dim=-1, out=logits if owned else None)",
                 "log_probs = torch.log_softmax(logits, dim=-1)")),
        ("tests/test_fused_head_pricing.py::test_an_unfused_head_turns_its_fp32_copy_into_the_softmax[1]",)),
    "preset_base_not_followed": Mutation(
        "a software preset takes only its own fields, not its base preset's",
        Rewrite("colozoo.cost.published:preset_fields",
                ("return {**(preset_fields(software[base], software) if base != \"colozoo\" else {}), **own}",
                 "return own")),
        ("tests/test_published_schema.py::test_a_preset_builds_on_another",)),
    "saved_views_cover_the_storage": Mutation(
        "a saved view is counted covering its whole storage",
        Rewrite("colozoo.cost.trace:SavedTensor.viewed_bytes",
                ("return min(self.nbytes, sum(math.prod(shape) for _, shape, _ in self.views) * self.dtype.itemsize)",
                 "return self.nbytes")),
        ("tests/test_saved_layout.py::test_attention_keeps_the_whole_projection_for_v_unless_its_kernel_copies_it[2]",)),
    "sequence_parallel_saves_whole": Mutation(
        "a sequence-parallel column linear is counted keeping its gathered input, not its 1/tp shard",
        Rewrite("colozoo.cost.saved_layout:sequence_shard_bytes",
                ("return sum(n for key, n in module_saved.items() if _parts(key)[1] == COLUMN_PARALLEL) "
                 "* (1 - 1 / tp)",
                 "return 0.0")),
        ("tests/test_saved_layout.py::test_fused_norms_keep_their_input_and_sp_linears_their_shard",)),
    "optimizer_priced_fused": Mutation(
        "every optimizer step is priced as one fused pass, whatever kernels the software runs",
        Rewrite("colozoo.cost.step_time:estimate",
                ("fused_pass * OPTIMIZER_PASSES[software.optimizer_kernels]", "fused_pass")),
        ("tests/test_optimizer_traffic.py::test_step_prices_the_optimizer_kernels_the_software_runs",)),
    "hardware_table_shared": Mutation(
        "a hardware's attention-speed table given as a dict stays writable (shared by every later answer)",
        Rewrite("colozoo.cost.hardware:Hardware.__post_init__",
                ('object.__setattr__(self, "attention_speed", attention_speed.frozen(self.attention_speed))', "pass")),
        ("tests/test_attention_speed.py::test_the_published_tables_are_read_only",)),
    "hardware_none_override_dropped": Mutation(
        "an override of None on a field that takes a number is not refused",
        Rewrite("colozoo.cost.hardware:_given",
                ("if value is None and _default(known[key]) is not None:", "if False:")),
        (SOURCES + "test_an_override_of_none_is_a_value_or_refused",)),
    "measured_memory_from_preset": Mutation(
        "a measured CPU preset keeps the links preset's 80 GB instead of the machine's memory",
        Rewrite("colozoo.cost.measure:device_fields", ("memory = host_memory_bytes()", "memory = hw.gpu_memory")),
        (SOURCES + "test_measured_on_the_cpu_it_names_the_cpu_loads_as_a_preset_and_plans",)),
    "optimizer_unfused": Mutation(
        "build_optimizer leaves torch to pick its default (foreach) AdamW where the fused kernel runs",
        Rewrite("colozoo.runtime.training:build_optimizer", ('kwargs["fused"] = _fused_kernel_runs(trainable)', "pass")),
        ("tests/test_training.py::test_optimizer_runs_the_fused_kernel_unless_told_otherwise",)),
    "grad_buckets_all_ddp": Mutation(
        "every software's gradient reduction is cut into torch DDP's 25 MiB buckets, whatever its own buckets",
        Rewrite("colozoo.cost.software:Software.grad_reduce_calls",
                ("GRAD_BUCKETS[self.grad_buckets](grad_bytes, itemsize, dp)",
                 'GRAD_BUCKETS["ddp"](grad_bytes, itemsize, dp)')),
        ("tests/test_grad_buckets.py::test_reduction_calls_follow_the_software_buckets[8]",)),
    "tp_wgrad_overlap_ignored": Mutation(
        "Megatron-LM's async tensor-parallel all-reduce hides nothing: the backward's collectives all show",
        Rewrite("colozoo.cost.step_time:_unit_terms",
                ("if software.tp_wgrad_overlap and is_layer:", "if False:")),
        ("tests/test_tp_wgrad_overlap.py::test_half_the_backward_collective_hides[False-tp.all_reduce]",)),
    "published_keys_unchecked": Mutation(
        "a misspelt key of a published run is ignored, its default priced in silence",
        Rewrite("colozoo.cost.published_schema:_keys", ("if unknown:", "if False:")),
        ("tests/test_published_schema.py::test_a_wrong_entry_is_an_error_naming_the_run_and_key[micro_batch_size]",)),
    "grad_clip_unpriced": Mutation(
        "the gradient clipping's passes over the gradients cost nothing",
        Rewrite("colozoo.cost.step_time:estimate",
                ('+ shard_grads * software.grad_clip_passes)', "+ 0)")),
        ("tests/test_clipping_traffic.py::test_step_prices_the_clipping_passes_the_software_makes[0-1]",)),
    "head_always_fused": Mutation(
        "every framework's LM head is priced as colozoo's fused linear cross-entropy",
        Rewrite("colozoo.cost.model_trace:_step_of",
                ('if not fused_head and set(batch) == {"input_ids", "labels"}:', "if False:")),
        ("tests/test_fused_head_pricing.py::test_the_head_decides_a_small_model_with_a_large_vocabulary",)),
    "validation_traces_ignore_the_head": Mutation(
        "the validation's trace cache serves one software's head to another",
        Rewrite("colozoo.cost.validate:TraceCache.key",
                ("w.dtype, w.target, run.software.fused_head, run.software.triton_fusions)",
                 "w.dtype, w.target, run.software.triton_fusions)")),
        ("tests/test_fused_head_pricing.py::test_the_head_decides_a_small_model_with_a_large_vocabulary",)),
    "planner_traces_ignore_the_head": Mutation(
        "the planner's trace cache serves one software's head to another",
        Rewrite("colozoo.cost.planner:_traces",
                ("workload.dtype, workload.target, fused_head, fusions)", "workload.dtype, workload.target, fusions)")),
        ("tests/test_fused_head_pricing.py::test_the_planner_traces_the_head_its_software_runs",)),
}
