"""The one door to DeepSpeed's internals: every DeepSpeed name the project uses that DeepSpeed's API documentation
does not cover goes through this package (registry.py: what is used and the start-up check; access.py: the
accessors the rooms call), and `check_deepspeed_internals` verifies them all at a run's start.

A leaf at the top level: it imports only DeepSpeed and the standard library, so models/, checkpoints/, planner/,
training/ and bench/ all import it without an upward arrow (inside any one of them, the others would reach up).

Used directly, as documented (deepspeed.readthedocs.io): deepspeed.initialize / init_distributed, deepspeed.pipe
(PipelineModule and its documented methods: topology(), ckpt_layer_path(_list); LayerSpec, TiedLayerSpec),
deepspeed.runtime.pipe.engine's PipelineEngine and its public methods, deepspeed.runtime.pipe.schedule (documented
as the way to extend pipeline parallelism: TrainSchedule, the instructions), deepspeed.checkpointing.checkpoint,
deepspeed.accelerator, deepspeed.ops.adam, deepspeed.utils.safe_*, the ds_to_universal converter. The public-named
attributes that describe the run and that the project only reads (the engine's stage_id, num_stages, micro_batches,
prev_stage / next_stage, grid and its rank and group getters, mpu, module, optimizer, lr_scheduler; the
PipelineModule's forward_funcs, tied_modules, num_stages, global_rank) are read where used: a rename there fails at
first use, naming the attribute.

Through this module, checked against DeepSpeed 0.19.8 (CHECKED_VERSION), with why:
- Names from modules the documentation does not cover (re-exported, resolved on first import: EXPORTED):
  TorchCheckpointEngine (its save and load): the checkpoint engine the trainer subclasses to load state files
  weights-only, and whose saves it hashes; LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address: the
  non-tensor types DeepSpeed's state files pickle, allowed for weights-only loading; PipeDataParallelTopology,
  PipeModelDataParallelTopology: the pipeline x data (x tensor) rank layout; partition_balanced, partition_uniform:
  DeepSpeed's own 'parameters', 'type:' and 'uniform' partitions; non_reentrant_checkpoint: activation
  checkpointing under LoRA; MEMORY_OPT_ALLREDUCE_SIZE: the flat-copy bucket of ZeRO-0's gradient all-reduce the
  memory plan counts; DeepSpeedZeroOptimizer: telling ZeRO's master weights from the parameters themselves;
  get_monitor_config, MonitorMaster (write_events), WandbMonitor: the run's metrics to W&B, CSV, Comet (a resume's
  replay rewrites the CSV monitor's files: csvMonitor's log_dir, and filenames, which keeps a second header out);
  deepspeed.runtime.pipe.p2p: the point-to-point layer the pipeline handlers call (below).
- Engine state the trainer writes or replaces (a rename would fail silently: DeepSpeed would just stop reading it):
  DeepSpeedEngine.clip_fp32_gradients (one clipping norm over all stages), _global_grad_norm (the norm it reports),
  checkpoint_engine built from _config (weights-only loads), save_zero_checkpoint and _common_checkpoint_state (no
  per-rank optimizer copies: the state is saved per layer), global_steps / global_samples / skipped_steps (restored
  on resume), _cast_module_mixed_precision (wrapped while the engine is built, so that the parameters transformers
  keeps in fp32, DeepSeek-V3's router, stay fp32); PipelineEngine.pipeline_enable_backward_allreduce (no all-reduce over a data-parallel group of one), total_loss
  (cleared before a forward pass whose outputs are per row),
  is_data_parallel (bench/pipeline_efficiency.py's own-replica baseline), _INSTRUCTION_MAP (the zero-bubble
  instructions; profiling's timers); deepspeed.ops.__compatible_ops__ (no shared-memory op built on CPUs).
- The pipeline engine's instruction state the zero-bubble handlers share with DeepSpeed's: pipe_buffers,
  pipe_recv_buf and _recv_tensor_meta, first_output_send and _send_tensor_meta, grad_layer, _exec_backward_pass,
  dynamic_shape / has_bool_tensors / is_pipe_partitioned (paths it refuses), using_bf16_optimizer with
  BF16_Optimizer.clear_lp_grads / update_hp_grads (the bf16 optimizer's per-backward gradient hand-off) and the
  _hp_grad it sets on each parameter (the fp32 sum of its micro-batches' gradients, which the tensor-parallel sums
  left to the step read, as PipelineEngine._exec_reduce_tied_grads reads it), and for ZeRO-1's own optimizer
  DeepSpeedZeroOptimizer.get_param_gradient_attribute (.grad, or grad_accum where it sums in another dtype);
  TrainSchedule._buffer_idx (a micro-batch's pipe buffer).
- The chunked engine (engines/chunked_engine.py, several chunks per rank) runs DeepSpeed's _exec_forward_pass,
  _exec_load_micro_batch and _exec_backward_pass per chunk and overrides is_first_stage, is_last_stage and
  _loss_stage_global_rank (the running chunk's, or the rank holding the first / last chunk) and
  _inference_schedule (evaluation's forwards); the names it adds are checked absent as the zero-bubble engine's are.
- A sequence length that changes between steps (engines/sequence_length.py): PipelineEngine.reset_activation_shape
  (public, DeepSpeed's hook for curriculum learning; checked because the chunked engine extends it and the project
  relies on it clearing first_output_send, pipe_recv_buf and grad_layer); the attribute sequence_length the project
  adds to the engine, checked absent as the zero-bubble engine's names are.
- For tests/test_p2p_order.py, which records the point-to-point operations of the engines' own handlers:
  PipelineEngine._exec_schedule (the instruction loop of train_batch and eval_batch), _inference_schedule, the p2p
  module's send and recv (what DeepSpeed's handlers call; its source must call them), and the state __init__ sets
  that the handlers read (num_pipe_buffers, has_attention_mask, is_grad_partitioned besides those above); under the
  chunked engine it replaces _exec_forward_pass, _exec_backward_pass and _exec_load_micro_batch on the engine
  (stand-ins that check what each chunk received: grad_layer, the inputs).
- PipelineModule internals: _grid (the tensor-parallel group), parts and _set_bounds (the partition), _local_start
  (the first layer index ckpt_layer_path counts from), _layer_specs (where a tied layer first appears),
  _synchronize_tied_weights; for several chunks per rank, _build (run once per chunk), stage_owner (a layer's
  rank), _index_tied_modules (narrowed to the tied weights on several ranks) and ckpt_layer_path(_list)
  (overridden: global layer indices).
- ZeRO's fragment bookkeeping, for the per-layer optimizer state: DeepSpeedZeroOptimizer.single_partition_of_fp32_groups
  and .optimizer, BF16_Optimizer.fp32_groups_flat_partition and .optimizer (bf16 with fp32 gradient accumulation:
  ZeRO-1's partitions in another class), param._hp_mapping (param_group_index, hp_fragment_address, lp_fragment_address); the fp16 loss
  scaler (optimizer.loss_scaler: cur_scale, cur_iter, last_overflow_iter, cur_hysteresis), restored on resume.
  Why not DeepSpeed's public safe_get_full_* / safe_set_full_*: checkpoints/optimizer_state.py's docstring.
- DeepSpeedCPUAdam's ds_opt_adam.adam_update(opt_id, step, ...) (offload): a resume replays its C++ optimizer's
  step count, whose powers of the betas are products taken a step at a time (replay_cpu_adam_steps).
- The launcher's per-node module name (LAUNCHER_MODULE): preemption recognises the launcher as its parent process,
  the supervisor the launchers it started (whose ranks it watches).
- Expert parallelism (models/expert_parallel.py) uses DeepSpeed's own expert support, which its engine switches on
  for a model holding a deepspeed.moe MoE layer: a stand-in subclass of MoE (no parameters; its
  set_deepspeed_parallelism makes nothing) added to a stage holding experts, the expert parameters marked as
  deepspeed.moe.utils.is_moe_param reads them (allreduce=False, group_name), and the project's groups registered in
  deepspeed.utils.groups (_EXPERT_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_GROUP and their _RANKS): the engine's
  gradient reduction, ZeRO-1's and the bf16 optimizer's partitions and the start-up broadcast then treat each slice
  over the ranks holding it. The engine's has_moe_layers is turned off around save_checkpoint and load_checkpoint
  (its MoE checkpoint layout: the project's layer files hold the experts). The clipping norm under it replaces
  DeepSpeedZeroOptimizer.scaled_global_norm (reading averaged_gradients, params_in_partition,
  model_parallel_rank) and BF16_Optimizer.get_grads_for_norm (reading fp32_groups_gradients,
  fp32_groups_has_gradients, bf16_groups); deepspeed.runtime.utils.is_model_parallel_parameter tells a split weight
  (engines/gradient_norm.py says why).
- Subclass overrides, checked for their parameters: PipelineEngine._train_schedule, _exec_send_activations,
  _exec_send_grads, _exec_recv_grads, _exec_reduce_tied_grads, _exec_backward_pass (engines/pipeline_engine.py: the
  last one is DeepSpeed's, from one node over a stage's floating outputs, with grad_layer put back after it);
  PipelineModule._partition_layers, load_state_dir, save_state_dict (models/pipeline.py); TorchCheckpointEngine.load
  (checkpoints/state_files.py). ZeroBubbleSchedule overrides PipeSchedule's documented steps(): no entry.
- Names the zero-bubble engine adds to PipelineEngine (its handlers _exec_backward_input_pass,
  _exec_backward_weight_pass, _exec_post_recv_activations, _exec_wait_recv_activations, _send_async; its state
  _sends, _posted_receives, zero_bubble_max_waiting), checked absent from DeepSpeed's engine classes (an attribute
  or self.<name> in their source): a DeepSpeed that came to use one would be overwritten, or overwrite it, silently.

The start-up check reads the source of the class that sets an instance attribute (`self.<name>` must appear in it)
instead of building an engine: an engine exists only after the process groups, the model and the optimizer do, and a
run must fail before any of that, on every rank alike. It checks that each name is there with its parameters, not
what it does: the tests do (docs/architecture.md#the-door-to-deepspeed lists them).
"""
LAUNCHER_MODULE = "deepspeed.launcher.launch"  # here, not in registry.py: the supervisor does not import DeepSpeed
