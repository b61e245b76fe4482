"""One rank of a parity run: the pipeline's losses and gradients on a batch, next to transformers' on the same
batch, written as JSON for the test process to judge."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import deepspeed  # noqa: E402
import collectives  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from models.layout import hf_name_of_layer_key, per_layer_share, per_layer_shares, split_fused  # noqa: E402
from models.context_parallel import NO_CONTEXT_PARALLEL  # noqa: E402
from models.loss import split_micro_batch  # noqa: E402
from models.lora import NO_LORA, LoraSettings  # noqa: E402
from checkpoints.layer_files import load_layer_slice  # noqa: E402
from deepspeed_internals.access import checkpoints_without_expert_files  # noqa: E402
from models.pipeline import build_pipeline_module, partition_stages  # noqa: E402
from models.tensor_parallel import shard_of  # noqa: E402
from tests.distributed import ProcessGroupPool  # noqa: E402
from tests.lora_reference import (adapter_values, hf_name_of_peft, peft_model, pipeline_layout,  # noqa: E402
                                  pipeline_slice)
from tests.tiny_models import make_batch  # noqa: E402
from cluster.distributed import init_distributed, parallel_topology  # noqa: E402
from engines.gradient_norm import model_norm  # noqa: E402
from engines.pipeline_engine import use_one_backward, use_zero_bubble  # noqa: E402


# The trainer's chunked LM loss, in chunks that split each micro-batch unevenly (0: the full logits).
CHUNK_TOKENS = 7


class GradientRecorder(torch.optim.Optimizer):
    """An optimizer whose step keeps the gradients DeepSpeed hands it (after data-parallel and tied reduction)."""

    def __init__(self, params):
        super().__init__(params, {})
        self.recorded = {}

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.recorded[p] = p.grad.detach().clone()


def hf_name_of_pipeline_param(name, num_hidden_layers):
    if name.startswith("tied_modules.embed."):
        return "model.embed_tokens.weight"
    index, key = name.split(".", 1)
    return hf_name_of_layer_key(int(index), key, num_hidden_layers)


class LayerFileOpens:
    """Records the layer files this process opens (an audit hook sees every open, whoever calls it)."""

    def __init__(self):
        self.paths = []
        self.active = False
        sys.addaudithook(self._hook)

    def _hook(self, event, args):
        if self.active and event == "open" and isinstance(args[0], str) and "layer_" in args[0]:
            self.paths.append(os.path.basename(args[0]))


def gradient_errors(module, recorded, ref_grads, num_hidden_layers, engine):
    """{HF name: max |pipeline - transformers| / max |transformers| (where that is 0, as for experts no token chose:
    max |pipeline|)} for each of this rank's parameters' gradients
    (recorded: {param: gradient}), against this rank's tensor-parallel slice of the HF gradient."""
    errors = {}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        hf_name = hf_name_of_pipeline_param(name, num_hidden_layers)
        ref = ref_grads[hf_name]
        if getattr(param, "tensor_parallel_dim", None) is not None:  # cut per block where it is (shard_of)
            ref = shard_of(ref, param.tensor_parallel_dim, engine.grid.get_slice_parallel_rank(),
                           engine.grid.get_slice_parallel_world_size(), getattr(param, "tensor_parallel_blocks", None))
        if hasattr(param, "expert_slice"):  # this rank's experts under expert parallelism
            ref = param.expert_slice.of(ref)
        difference, scale = (recorded[param] - ref).abs().max().item(), ref.abs().max().item()
        errors[hf_name] = difference / scale if scale else difference  # a slice of experts no token chose: zeros
    return errors


def gradient_norms(module, recorded, ref_grads, engine):
    """{'all' | 'experts': (the clipping norm's value over the pipeline's gradients, transformers')}: every
    weight, and an MoE model's experts alone (under expert parallelism each rank holds some)."""
    params = [(p, recorded[p]) for p in module.parameters() if p.requires_grad]
    experts = [(p, g) for p, g in params if hasattr(p, "expert_slice")]
    ref_experts = [g for name, g in ref_grads.items() if ".experts." in name]
    return {kind: (model_norm(pairs, engine, module.experts).item(),
                   torch.stack([g.float().pow(2).sum() for g in ref] or [torch.zeros(())]).sum().sqrt().item())
            for kind, pairs, ref in (("all", params, list(ref_grads.values())), ("experts", experts, ref_experts))}


def micro_batches(batch, micro_batch_size, gas, dp_size, dp_rank, context=NO_CONTEXT_PARALLEL):
    """The micro-batches of one data-parallel rank: row block (step * replicas + replica) for each step, of which
    a context group's rank takes its tokens (dp_size and dp_rank: DeepSpeed's data axis, which holds the context
    ranks)."""
    input_ids, attention_mask, labels = batch
    seq = input_ids.shape[1]
    position_ids = torch.arange(seq).expand_as(input_ids)
    replica, replicas = context.replica(dp_rank, dp_size)
    for step in range(gas):
        rows = slice((step * replicas + replica) * micro_batch_size,
                     (step * replicas + replica + 1) * micro_batch_size)
        yield split_micro_batch(context, ((input_ids[rows], attention_mask[rows], position_ids[rows]), labels[rows]))


def hf_reference(hf_dir, batch, micro_batch_size, lora=None, adapters=None, sequence_coef=0.0):
    """transformers' losses and gradients by HF name; with lora (LoraSettings) and adapters ({HF name: value}),
    peft's model with those adapters and the adapters' gradients; with sequence_coef, each micro-batch's loss plus
    that times DeepSeek-V3's sequence-wise balance loss over its routers' logits and choices (the paper's
    definition, tests/test_deepseek_balancing.py)."""
    from tests.test_deepseek_balancing import captured_routing, direct_sequence_loss
    if lora is None:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    else:
        model = peft_model(hf_dir, lora, adapters)
    input_ids, attention_mask, labels = batch
    captured = captured_routing(model) if sequence_coef else None
    losses = []
    for start in range(0, input_ids.shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        loss = model(input_ids[rows], attention_mask=attention_mask[rows], labels=labels[rows]).loss
        if sequence_coef:
            loss = loss + sequence_coef * direct_sequence_loss(captured, attention_mask[rows],
                                                               model.config.n_routed_experts,
                                                               model.config.num_experts_per_tok)
            captured.clear()
        losses.append(loss)
    torch.stack(losses).mean().backward()
    grads = split_fused({hf_name_of_peft(n): p.grad for n, p in model.named_parameters() if p.requires_grad},
                        model.config)  # Phi-3's fused weights as the pipeline's parts
    if lora is not None:
        grads = pipeline_layout(grads, model.config, lora)  # the experts' adapters as the pipeline holds them
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)  # the same tensor as the embedding's
    return [loss.item() for loss in losses], per_layer_grads(grads, model.config)


def per_layer_grads(grads, config):
    """grads with Gemma 4's per-layer embeddings' as the pipeline holds them: each decoder layer's share (the shared
    norm's whole gradient in every layer: its copies' gradients are summed, as a tied weight's)."""
    for name in [name for name in grads if per_layer_shares(name, config) is not None]:
        whole = grads.pop(name)
        for share in per_layer_shares(name, config):
            grads[hf_name_of_layer_key(share[0], share[1], config.num_hidden_layers)] = per_layer_share(whole, share)
    return grads


def per_layer_norm_copies(names):
    """Gemma 4's per-layer norm among names (HF names of per_layer_grads): every layer's copy, of which a pipeline
    stage holds one Parameter under its first layer's name."""
    return {name for name in names if name.endswith("per_layer_projection_norm.weight")}


def set_adapters(module, adapters, parallel):
    """Each adapter factor of this rank's stage to its slice of adapters[HF name]."""
    num_hidden_layers = module.model_config.num_hidden_layers
    with torch.no_grad():
        for name, param in module.named_parameters():
            if param.requires_grad:
                value = adapters[hf_name_of_pipeline_param(name, num_hidden_layers)]
                param.copy_(pipeline_slice(value, param, parallel.rank, parallel.size))


def replicated_gradient_spread(module, optimizer, engine):
    """Largest difference, over the tensor-parallel group, of the gradients of parameters every rank holds whole."""
    group = engine.grid.get_slice_parallel_group()
    spread = 0.0
    for _, param in module.named_parameters():
        if param.requires_grad and getattr(param, "tensor_parallel_dim", None) is None:
            grad = optimizer.recorded[param]
            gathered = [torch.empty_like(grad) for _ in range(engine.grid.get_slice_parallel_world_size())]
            torch.distributed.all_gather(gathered, grad, group=group)
            spread = max(spread, max((g - grad).abs().max().item() for g in gathered))
    return spread


def record_deferred_weights(engine):
    """{name of each parameter whose gradient a zero-bubble W computed}, filled as the engine runs."""
    names = {p: n for n, p in engine.module.named_parameters()}
    queue, deferred = engine.module.parallel.weight_grads, set()
    add = queue.add

    def recording_add(params_and_grads_fn):
        def recorded():
            pairs = params_and_grads_fn()
            # a weight every tensor-parallel rank holds whole enters as a view (its gradient summed over the group)
            deferred.update(names[p if p.is_leaf else p._base] for p, _ in pairs)
            return pairs
        add(recorded)
    queue.add = recording_add
    return deferred


def fused_expert_weights(module):
    """The stage's trainable fused expert weights ([experts, in, out]: no other parameter has three dimensions)."""
    return [p for p in module.parameters() if hasattr(p, "expert_slice") and p.requires_grad and p.dim() == 3]


class ExpertGradientSums:
    """Counts, while active, the all-reduces over the tensor-parallel group of tensors shaped as one of the stage's
    fused expert weights (their gradients' sums: once per step, not per micro-batch). Their biases are left out: a
    router's weight may have a bias's shape ([experts, hidden])."""

    def __init__(self, module, group):
        self.shapes = {tuple(p.shape) for p in fused_expert_weights(module)}
        self.group, self.count, self.active = group, 0, False
        all_reduce = collectives.all_reduce

        def counted(tensor, op=collectives.ReduceOp.SUM, group=None):
            self.count += self.active and group is self.group and tuple(tensor.shape) in self.shapes
            return all_reduce(tensor, op=op, group=group)
        self.restore = lambda: setattr(collectives, "all_reduce", all_reduce)
        collectives.all_reduce = counted


def shared_reference(references, rank, path, key, compute):
    """compute() (transformers' run, the same on every rank) on rank 0 only, once per key (the model and adapters:
    the launch's cases share its batch), handed to every rank through the file at path."""
    if rank == 0:
        references[key] = references.get(key) or compute()
        torch.save(references[key], path)
    torch.distributed.barrier()
    return torch.load(path, weights_only=True)


def run(rank, cases, num_stages, micro_batch_size, gas, seq_len, out_dir, tensor_parallel=1):
    init_distributed(timeout_minutes=2)
    opens = LayerFileOpens()
    results, references = {}, {}
    for case in ProcessGroupPool().runs(cases):  # the cases' engines share their process groups
        config = AutoConfig.from_pretrained(case["hf_dir"])
        lora = LoraSettings(**case["lora"]) if "lora" in case else NO_LORA
        adapters = adapter_values(config, lora, seed=7, nonzero_b=True) if lora.enabled else None
        # DeepSeek-V3's sequence-wise balance loss, as training/config_checks.py sets the run's
        sequence_coef = config.sequence_aux_loss_coef = case.get("sequence_aux_loss_coef", 0.0)
        dp_size = torch.distributed.get_world_size() // (num_stages * tensor_parallel)
        replicas = dp_size // case.get("context_parallel", 1)  # the data axis holds the context ranks
        batch = make_batch(micro_batch_size * gas * replicas, seq_len, config.vocab_size, seed=1)
        if config.pad_token_id is not None:  # a real token in every row, as eos is where pad = eos
            for ids in (batch[0], batch[2]):
                ids[:, 3] = config.pad_token_id
        module = build_pipeline_module(config, parallel_topology(num_stages, tensor_parallel),
                                       stage_bounds=partition_stages(config, num_stages,
                                                                     case.get("partition", "parameters")),
                                       layer_loader=load_layer_slice,
                                       attention_impl=case.get("attention", "sdpa"),
                                       activation_checkpoint_interval=case.get("checkpoint_interval", 0),
                                       sequence_parallel=case.get("sequence_parallel", True),
                                       recompute_sequence_gather=case.get("recompute_sequence_gather", False),
                                       loss_chunk_tokens=case.get("loss_chunk_tokens", CHUNK_TOKENS), lora=lora,
                                       expert_parallel_size=case.get("expert_parallel", 1),
                                       context_parallel_size=case.get("context_parallel", 1))
        if case.get("compile"):
            module.compile()
        optimizer = GradientRecorder([p for p in module.parameters() if p.requires_grad])
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config={
            "train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": gas,
            "steps_per_print": 10**9, "gradient_clipping": 0.0,
            "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}})
        checkpoints_without_expert_files(engine)
        opens.paths, opens.active = [], True
        engine.load_checkpoint(case["ds_dir"], load_module_only=True)
        opens.active = False
        base = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
        if lora.enabled:
            set_adapters(module, adapters, module.parallel)
        deferred = set()
        if case.get("schedule") == "zero_bubble":
            use_zero_bubble(engine)
            deferred = record_deferred_weights(engine)
        else:
            use_one_backward(engine)
        step_losses = []
        loss_fn = module.loss_fn
        module.loss_fn = lambda logits, labels: step_losses.append(loss_fn(logits, labels)) or step_losses[-1]
        expert_sums = ExpertGradientSums(module, engine.grid.get_slice_parallel_group())
        expert_sums.active = True
        mean_loss = engine.train_batch(micro_batches(batch, micro_batch_size, gas, dp_size,
                                                     engine.grid.data_parallel_id, module.context))
        expert_sums.active = False
        expert_sums.restore()
        ref_losses, ref_grads = shared_reference(
            references, rank, os.path.join(out_dir, f"{case['name']}-hf.pt"), (case["hf_dir"], lora, replicas, sequence_coef),
            lambda: hf_reference(case["hf_dir"], batch, micro_batch_size, lora if lora.enabled else None, adapters,
                                 sequence_coef))
        grad_errors = gradient_errors(module, optimizer.recorded, ref_grads, config.num_hidden_layers, engine)
        norms = gradient_norms(module, optimizer.recorded, ref_grads, engine)
        results[case["name"]] = {
            "stage": engine.stage_id, "dp_rank": engine.grid.data_parallel_id, "parts": [int(p) for p in module.parts],
            "context_rank": module.context.rank,
            "layer_files_opened": sorted(set(opens.paths)),
            "losses": [loss.item() for loss in step_losses], "mean_loss": float(mean_loss),
            "ref_losses": ref_losses, "grad_errors": grad_errors, "ref_param_names": sorted(ref_grads),
            "replicated_grad_spread": replicated_gradient_spread(module, optimizer, engine), "norms": norms,
            "expert_grad_sums": [expert_sums.count, len(fused_expert_weights(module))],
            "param_names": [name for name, _ in module.named_parameters()], "deferred_weights": sorted(deferred),
            "expert_slices": {name: list(param.expert_slice) for name, param in module.named_parameters()
                              if hasattr(param, "expert_slice")},
            "frozen_unchanged_without_grad": all(p.grad is None and torch.equal(p, base[n])
                                                 for n, p in module.named_parameters() if not p.requires_grad)}
        if case.get("save_grads"):  # for tests comparing two runs' gradients directly
            torch.save({name: optimizer.recorded[param] for name, param in module.named_parameters()},
                       os.path.join(out_dir, f"{case['name']}-rank{rank}.pt"))
        torch.distributed.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()
