"""transformers' auxiliary load-balancing loss of a mixture-of-experts model, over the pipeline's stages.

transformers (`load_balancing_loss_func` in each MoE family's modeling file) computes one loss per forward over the
routers of all the MoE layers: the real tokens' top-k choices per expert and their router probabilities, each summed
over the layers and divided by (layers x real tokens), multiplied, summed over the experts and times their number.
It is not a sum of per-layer terms, and the layers live on different stages, so the tuple between stages carries
what the last stage needs (models/pipeline_layers.py Routing), from the embedding on:

- every sparse layer's top-k counts, [sparse layers, E] int64: no gradient; the loss takes their sum over the
  layers, the expert-load metrics each layer's;
- with the loss on (transformers' output_router_logits), the running sum of the router probabilities, [E] fp32,
  whose gradient goes back through every stage boundary to every router, as transformers adds each layer's to zeros.

DeepSeek-V3's sequence-wise balance loss (models/sigmoid_router.py sequence_balance, the run's
moe.sequence_aux_loss_coef) is a sum of per-layer terms: the same floating [E] slot carries their running sum instead.

Under tensor parallelism with sequence parallelism, and under context parallelism, each rank's statistics are of
its share of the tokens: summed over the tensor-parallel and the context group at the loss (a sequence-wise term's
per-sequence sums in each layer already: models/moe.py RoutedTokens). The loss is then whole on every rank of a
context group, and its gradient scaled as every such loss's (ContextParallel.whole_sequence_loss): DeepSpeed
averages the group's gradients, each of which reaches only its own tokens.

A micro-batch's loss is transformers' `outputs.loss`, the cross-entropy plus router_aux_loss_coef x this loss
(CausalLMLoss); DeepSpeed's mean over the global batch's micro-batches makes the step's the token-mean cross-entropy
plus the coefficient times the mean of the micro-batches' losses.
"""
import torch
import torch.distributed as dist

import collectives
from models.architecture import architecture_of
from models.context_parallel import NO_CONTEXT_PARALLEL
from models.tensor_parallel import NO_TENSOR_PARALLEL, AllReduce


class LoadBalancingLoss:
    """The last stage's side of it: the loss of a micro-batch from the routing statistics it receives, and the
    metrics of the micro-batches trained since the last take_metrics (sums kept on the device); with
    counts_step_loads (DeepSeek-V3's bias balancing, training/expert_balance.py) also the loads of the step so far."""

    def __init__(self, config, parallel=NO_TENSOR_PARALLEL, counts_step_loads=False, context=NO_CONTEXT_PARALLEL):
        architecture = architecture_of(config)
        moe = architecture.moe
        self.enabled, self.coef = moe.aux_loss, moe.aux_loss_coef
        self.sequence_wise = moe.sequence_aux_loss_coef > 0  # DeepSeek-V3's, instead (models/sigmoid_router.py)
        if self.sequence_wise:
            self.coef = moe.sequence_aux_loss_coef
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.sparse_layers = [i for i, sparse in enumerate(architecture.sparse_layers) if sparse]
        self.parallel, self.context = parallel, context
        self.totals = None  # per layer and expert: top-k counts; then the loss's sum and the micro-batches
        self.counts_step_loads = counts_step_loads
        self.step_loads = None  # the step's counts so far, when counted

    @property
    def carried(self):
        """How many routing tensors follow the LM head's outputs."""
        return 2 if self.enabled or self.sequence_wise else 1

    def __call__(self, routing):
        """The auxiliary loss of a micro-batch before its coefficient (0-d fp32, None when it is off) from its
        Routing: transformers' load-balancing loss, or DeepSeek-V3's sequence-wise one (the sum of the carried
        terms, which each layer made whole over the tensor-parallel and context groups already)."""
        counts, sums = routing.counts, routing.loss_sums
        # the groups whose ranks routed shares of the micro-batch's tokens (the tensor-parallel one is the stage's,
        # made after this loss)
        token_groups = [group for group, split in ((self.parallel.group, self.parallel.sequence_parallel),
                                                   (self.context.group, self.context.size > 1)) if split]
        if token_groups:
            counts = counts.clone()
        for group in token_groups:
            collectives.all_reduce(counts, group=group)
            if self.enabled:
                sums = AllReduce.apply(sums, group)
        loss = None
        if self.sequence_wise:
            loss = sums.sum()
        elif self.enabled:
            chosen = counts.sum(dim=0).float()
            rows = (counts.sum() / self.top_k).float().clamp(min=1)  # layers x real tokens (1: an empty batch's 0)
            loss = torch.sum(chosen / rows * (sums / rows).unsqueeze(0)) * self.num_experts
        if loss is not None:
            loss = self.context.whole_sequence_loss(loss)
        if torch.is_grad_enabled():  # a training forward: evaluation's leave the training window's sums alone
            self.add_metrics(counts, loss)
            if self.counts_step_loads:
                self.step_loads = counts if self.step_loads is None else self.step_loads + counts
        return loss

    def add_metrics(self, counts, loss):
        step = torch.zeros(2, dtype=torch.float64, device=counts.device) if loss is None else \
            torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=counts.device)])
        sums = torch.cat([counts.reshape(-1).double(), step])
        self.totals = sums if self.totals is None else self.totals + sums

    def take_step_loads(self):
        """[sparse layers, E] int64: each sparse layer's top-k counts of the real tokens of the micro-batches trained
        since the last call (zeros when none; of the whole micro-batches under tensor and context parallelism), on
        the device."""
        loads, self.step_loads = self.step_loads, None
        if loads is None:
            return torch.zeros(len(self.sparse_layers), self.num_experts, dtype=torch.int64, device=collectives.device())
        return loads

    def take_metrics(self, expert_parallel=1):
        """{aux_loss: the mean over the micro-batches trained since the last call, expert_load/layer_{i}: each sparse
        layer's largest over its mean tokens per expert, and with experts split over expert_parallel > 1 ranks
        (E / expert_parallel consecutive experts each) expert_rank_load/layer_{i}: the tokens its busiest rank
        received over a rank's mean (summed over the expert-parallel groups)}, on every rank (a collective: only last
        stages hold nonzero sums; the tensor-parallel and context ranks of one add the same, which leaves the ratios
        unchanged);
        {} when none."""
        size = len(self.sparse_layers) * self.num_experts + 2
        totals = self.totals if self.totals is not None else torch.zeros(size, dtype=torch.float64,
                                                                         device=collectives.device())
        self.totals = None
        if dist.is_initialized():
            collectives.all_reduce(totals)
        counts = totals[:-2].view(len(self.sparse_layers), self.num_experts)
        loss_sum, micro_batches = totals[-2:].tolist()
        metrics = {"aux_loss": loss_sum / micro_batches} if micro_batches else {}
        means = counts.mean(dim=1)
        loads = (counts.amax(dim=1) / means.clamp(min=1e-30)).tolist()
        metrics.update({f"expert_load/layer_{layer}": load for layer, load, mean in
                        zip(self.sparse_layers, loads, means.tolist()) if mean})
        if expert_parallel > 1:
            ranks = counts.view(len(self.sparse_layers), expert_parallel, -1).sum(dim=2)
            rank_loads = (ranks.amax(dim=1) / ranks.mean(dim=1).clamp(min=1e-30)).tolist()
            metrics.update({f"expert_rank_load/layer_{layer}": load for layer, load, mean in
                            zip(self.sparse_layers, rank_loads, means.tolist()) if mean})
        return metrics
