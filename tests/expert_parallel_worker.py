"""One rank of a check of expert parallelism's dispatch (tests/test_expert_parallel.py), in a module of its own: the
ranks import it, and not the test module's imports."""
import json
import os

import torch


def dispatch_against_local_experts(rank, out_dir):
    """One rank of expert parallelism 2: its tokens through ExpertParallel (its half of the experts) and through
    LocalExperts (every expert, the same weights), for random routing and for routing where no token chooses rank
    0's experts (it receives no row): {case: [largest output difference, input-gradient, weights-gradient, each
    expert parameter's against the whole one's summed over both ranks, sliced]}."""
    from cluster.distributed import init_distributed
    from deepspeed_internals.registry import PipeDataParallelTopology
    from models.architecture import architecture_of
    from models.expert_parallel import build_expert_parallel
    from models.moe import Experts, LocalExperts
    from tests.tiny_models import MOE_CONFIGS
    init_distributed(timeout_minutes=2)
    experts = build_expert_parallel(PipeDataParallelTopology(num_pp=1, num_dp=2), 2)
    results = {}
    for family in ("qwen2_moe", "gpt_oss"):  # SwiGLU; GPT-OSS's transposed, biased, clamped experts
        config = MOE_CONFIGS[family]()
        moe = architecture_of(config).moe
        torch.manual_seed(0)
        whole = Experts(moe, config.hidden_size, torch.nn.functional.silu, 0, moe.num_experts)
        with torch.no_grad():
            for param in whole.parameters():
                param.normal_(std=0.1)
        first, count = experts.expert_range(moe.num_experts)
        mine = Experts(moe, config.hidden_size, torch.nn.functional.silu, first, count)
        with torch.no_grad():
            for param, source in zip(mine.parameters(), whole.parameters()):
                param.copy_(source[first:first + count])
        generator = torch.Generator().manual_seed(rank)
        tokens = 7 + 3 * rank
        hidden = torch.randn(tokens, config.hidden_size, generator=generator, requires_grad=True)
        weights = torch.rand(tokens, moe.top_k, generator=generator, requires_grad=True)
        random_ids = torch.stack([torch.randperm(moe.num_experts, generator=generator)[:moe.top_k]
                                  for _ in range(tokens)])
        second_half = moe.num_experts // 2 + random_ids % (moe.num_experts // 2)
        for case, expert_ids in (("random", random_ids), ("rank 0 chosen by none", second_half)):
            out = experts(hidden, expert_ids, weights, mine)
            reference = LocalExperts()(hidden, expert_ids, weights, whole)
            grad = torch.randn(out.shape, generator=generator)
            ours = torch.autograd.grad(out, [hidden, weights, *mine.parameters()], grad)
            theirs = torch.autograd.grad(reference, [hidden, weights, *whole.parameters()], grad)
            summed = [g.clone() for g in theirs[2:]]
            for g in summed:
                torch.distributed.all_reduce(g)
            results[f"{family} {case}"] = [(out - reference).abs().max().item()] + [
                (a - b).abs().max().item() for a, b in zip(ours, [*theirs[:2], *(s[first:first + count]
                                                                                  for s in summed)])]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


def replicated_expert_grads_when_a_rank_routes_no_row(rank, out_dir):
    """One rank of tensor parallel 2 (sequence parallel): a layer's experts whole on both, rank 0 running its rows
    through the grouped GEMM, rank 1 with no row at all (an expert-parallel rank no token chose: each expert's row
    block alone, every one empty): {each expert tensor: the largest difference of this rank's gradient from the
    sum of both ranks' own gradients}."""
    from cluster.distributed import init_distributed
    from models.architecture import architecture_of
    from models.moe import Experts
    from models.tensor_parallel import TensorParallel, sum_gradients_at_step, sum_step_gradients
    from tests.tiny_models import MOE_CONFIGS
    init_distributed(timeout_minutes=2)
    config = MOE_CONFIGS["qwen3_moe"]()
    moe = architecture_of(config).moe
    torch.manual_seed(0)
    experts = Experts(moe, config.hidden_size, torch.nn.functional.silu, 0, moe.num_experts)
    parallel = TensorParallel(2, rank, True, group=torch.distributed.group.WORLD)
    sum_gradients_at_step(experts, parallel)  # as the stage's plan makes a sparse layer's experts under sequence
    rows = [11, 0][rank]  # parallelism: summed over the group once, at the step
    counts = torch.tensor([rows] + [0] * (moe.num_experts - 1))
    tokens = torch.randn(rows, config.hidden_size, generator=torch.Generator().manual_seed(1))
    experts(tokens, counts, counts.tolist() if rows == 0 else None).pow(2).sum().backward()
    sum_step_gradients(experts, parallel, lambda param: param.grad)
    local = [torch.zeros_like(p) for p in experts.parameters()]
    if rows:  # this rank's own gradients, without the group: the block's math on a single rank
        alone = Experts(moe, config.hidden_size, torch.nn.functional.silu, 0, moe.num_experts)
        alone.load_state_dict(experts.state_dict())
        alone(tokens, counts).pow(2).sum().backward()
        local = [p.grad for p in alone.parameters()]
    summed = [g.clone() for g in local]
    for g in summed:
        torch.distributed.all_reduce(g)
    results = {name: (p.grad - s).abs().max().item() for (name, p), s in zip(experts.named_parameters(), summed)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


def checkpointed_dispatch_exchanges(rank, out_dir):
    """One rank of expert parallelism 2: a sparse decoder layer (Qwen3-MoE's, padded rows) run plain and under each
    of DeepSpeed's checkpointing functions, with its dispatch kept (keeping_dispatch), with only its routing kept
    and, to show what they save, recomputed: {run: [all-to-alls in forward, in backward, host syncs in backward,
    the outputs' and every gradient's largest difference from the plain run's], "kept bytes": [the received
    tokens', the rows come back's]}."""
    from deepspeed import checkpointing

    import collectives
    from cluster.distributed import init_distributed
    from deepspeed_internals.registry import PipeDataParallelTopology, non_reentrant_checkpoint
    from models.architecture import architecture_of
    from models.attention import StageAttentionInputs
    from models.expert_parallel import KeptDispatch, build_expert_parallel, keeping_dispatch
    from models.pipeline_layers import DecoderLayerPipe, StagePlan, StageTuple
    from tests.host_syncs import HostSyncs
    from tests.tiny_models import MOE_CONFIGS
    init_distributed(timeout_minutes=2)
    experts = build_expert_parallel(PipeDataParallelTopology(num_pp=1, num_dp=2), 2)
    config = MOE_CONFIGS["qwen3_moe"]()
    layer_index = architecture_of(config).sparse_layers.index(True)
    torch.manual_seed(0)
    layer = DecoderLayerPipe(config, StageAttentionInputs(config, row_layout="padded"), layer_index,
                             StagePlan(experts=experts))
    generator = torch.Generator().manual_seed(rank)
    document_ids = torch.ones(2, 12, dtype=torch.long)
    document_ids[1, 9:] = 0  # padding
    hidden = torch.randn(2, 12, config.hidden_size, generator=generator)
    grad = torch.randn(hidden.shape, generator=generator)
    all_to_alls = []
    all_to_all = collectives.all_to_all_single

    def counted(*args, **kwargs):
        all_to_alls.append(1)
        return all_to_all(*args, **kwargs)
    collectives.all_to_all_single = counted
    kept_bytes, record = [], KeptDispatch.record
    KeptDispatch.record = classmethod(lambda cls, plan, rows, back: kept_bytes.append([rows.nbytes, back.nbytes]) or
                                      record(plan, rows, back))
    runs = {"plain": None, "reentrant": checkpointing.checkpoint, "non-reentrant": non_reentrant_checkpoint}
    for name in ("reentrant", "non-reentrant"):
        runs[f"{name}, its routing kept"] = keeping_dispatch(runs[name], keep_rows=False)
    runs.update({f"{name} kept": keeping_dispatch(runs[name]) for name in ("reentrant", "non-reentrant")})
    results, reference = {}, None
    for name, checkpoint in runs.items():
        layer.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_()
        stage = StageTuple(config)
        inputs = stage.start(x, document_ids, torch.arange(12).expand(2, 12))
        run = (lambda *tensors: layer(tensors))
        all_to_alls.clear()
        out = stage.unpack(run(*inputs) if checkpoint is None else checkpoint(run, *inputs)).hidden
        forward = len(all_to_alls)
        all_to_alls.clear()
        with HostSyncs() as syncs:
            out.backward(grad)
        tensors = [out.detach(), x.grad, *(p.grad for p in layer.parameters())]
        reference = reference or tensors
        results[name] = [forward, len(all_to_alls), len(syncs.ops),
                         max((a - b).abs().max().item() for a, b in zip(tensors, reference))]
    results["kept bytes"] = kept_bytes[-1]  # the last run's: a checkpointed block's, kept
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()
