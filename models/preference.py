"""Preference objectives on the last stage, from each sequence's response log-probability (`sequence_log_probs`,
chunked, never a tokens x vocabulary tensor):

- `dpo`: TRL's DPOTrainer with loss_type="sigmoid": -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))) per pair,
  pi and ref the summed response log-probabilities of the policy and of the reference (the starting weights,
  precomputed once: evaluation/reference.py); rewards beta (pi - ref).
- `simpo`: TRL's CPOTrainer with loss_type="simpo", cpo_alpha=0: -log sigmoid(beta (avg_c - avg_r) - gamma) per
  pair, avg the response log-probability divided by its tokens; rewards beta avg. No reference.

A micro-batch holds its pairs' chosen sequences in its first half of rows and their rejected ones in the second
(data/collator.py `collate_preference`); a pair never spans micro-batches, so the step's loss, the mean over every
pair of the global batch, is a sum of per-micro-batch sums divided by the step's divisor, which a training
step's labels carry (with_step_divisor).

A mixture of experts adds router_aux_loss_coef times the micro-batch's load-balancing loss over its chosen and
rejected rows together (models/router_loss.py), as TRL adds `outputs.aux_loss` of that one forward to the loss:
DeepSpeed's mean over the micro-batches makes the step's the mean of theirs, as TRL's gradient accumulation does.
TRL's DPOTrainer asks for it whenever the config has a nonzero router_aux_loss_coef, whatever its
output_router_logits says; its CPOTrainer (SimPO) when output_router_logits is set (training/config_checks.py).
"""
import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

import collectives
from models.context_parallel import NO_CONTEXT_PARALLEL
from models import IGNORE_INDEX
from models.loss import next_token_labels, sequence_log_probs, split_step_divisor
from models.pipeline_layers import head_outputs
from models.tensor_parallel import NO_TENSOR_PARALLEL, AllReduce

OBJECTIVES = ("sft", "dpo", "simpo")
DPO_LOSS_TYPES = ("sigmoid",)
# TRL's metric names, logged as means over the pairs of a step (or of the eval set).
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclasses.dataclass(frozen=True)
class PreferenceSettings:
    """The `objective` key and its `dpo:` / `simpo:` nodes."""
    objective: str = "sft"
    beta: float = 0.1
    loss_type: str = "sigmoid"
    gamma: float = 0.5  # simpo: the target reward margin (TRL's simpo_gamma)

    @classmethod
    def from_cfg(cls, cfg):
        objective = cfg.objective
        if objective not in OBJECTIVES:
            raise ValueError(f"objective={objective!r} is not one of {', '.join(OBJECTIVES)}.")
        node = cfg.simpo if objective == "simpo" else cfg.dpo
        beta = node.beta
        if not (isinstance(beta, (int, float)) and not isinstance(beta, bool) and beta > 0):
            raise ValueError(f"{'simpo' if objective == 'simpo' else 'dpo'}.beta={beta!r} must be a positive number "
                             f"(TRL's default: 0.1 for DPO, 2.0 for SimPO).")
        if cfg.dpo.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"dpo.loss_type={cfg.dpo.loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}.")
        gamma = cfg.simpo.gamma
        if not (isinstance(gamma, (int, float)) and not isinstance(gamma, bool)):
            raise ValueError(f"simpo.gamma={gamma!r} must be a number (TRL's simpo_gamma, 0.5 by default).")
        return cls(objective, float(beta), cfg.dpo.loss_type, float(gamma))

    @property
    def preference(self):
        return self.objective != "sft"

    @property
    def needs_reference(self):
        return self.objective == "dpo"


class PreferenceLoss:
    """The pipeline's loss_fn under a preference objective: (the head's input and weight, (labels, reference
    log-probabilities), and in a training step its divisor) -> the summed pair losses / the divisor (the step's pairs
    per micro-batch and rank: with_step_divisor), or without one (evaluation) the micro-batch's mean over its pairs.
    Each call adds its pairs' metric sums to those of its window (kept on the device: no synchronisation per
    micro-batch): a training forward's to the training window, an evaluation's (no gradient) to the evaluation's, so
    that evaluating leaves the training window's sums alone. An MoE model's router loss (LoadBalancingLoss) is added
    times its coefficient."""

    def __init__(self, settings, parallel=NO_TENSOR_PARALLEL, chunk_tokens=1024, context=NO_CONTEXT_PARALLEL,
                 grad_sum_dtype=None, router=None, logit_cap=None):
        self.settings, self.parallel, self.chunk_tokens, self.context = settings, parallel, chunk_tokens, context
        self.logit_cap = logit_cap  # Gemma's final_logit_softcapping, on each chunk's logits (models/loss.py)
        self.grad_sum_dtype = grad_sum_dtype  # the run's grad_accum_dtype, for the head's chunks
        self.router = router
        self.totals = {"training": None, "evaluation": None}  # per window, the metrics' sums, then the pairs

    def units(self, labels, whole=False):
        """What the loss averages over: the pairs with a response token (evaluation pads with empty rows); of a
        micro-batch split over the context group (not whole), every rank of the group counts them all. A 0-d int64
        tensor beside the labels."""
        context = NO_CONTEXT_PARALLEL if whole else self.context
        labels = labels[0]
        tokens = response_tokens(next_token_labels(labels, context), labels.shape[0], context)
        return scored_pairs(tokens).sum().to(torch.int64)

    def __call__(self, outputs, labels):
        (labels, reference), divisor = split_step_divisor(labels, 2)
        (hidden, weight), routing = head_outputs(outputs, chunked=True)
        logps, tokens = self.log_probs(hidden, weight, labels)
        scored = scored_pairs(tokens).to(logps.device)
        if self.settings.objective == "simpo":
            chosen, rejected = (logps / tokens.clamp(min=1)).chunk(2)
            chosen_rewards, rejected_rewards = self.settings.beta * chosen, self.settings.beta * rejected
            margin = self.settings.beta * (chosen - rejected) - self.settings.gamma
        else:
            chosen, rejected = logps.chunk(2)
            ref_chosen, ref_rejected = reference.to(logps.device).chunk(2)
            chosen_rewards = self.settings.beta * (chosen - ref_chosen)
            rejected_rewards = self.settings.beta * (rejected - ref_rejected)
            margin = chosen_rewards - rejected_rewards
        losses = -F.logsigmoid(margin) * scored
        self.add_metrics(scored, chosen.detach(), rejected.detach(), chosen_rewards.detach(),
                         rejected_rewards.detach())
        if divisor is None:
            divisor = scored.sum().clamp(min=1)
        loss = self.context.whole_sequence_loss(losses.sum() / divisor)
        aux = self.router(routing) if self.router is not None else None
        return loss if aux is None else loss + self.router.coef * aux

    def log_probs(self, hidden, weight, labels):
        """(each row's summed response log-probability, each row's response tokens), both (rows,) and whole over the
        context group, from the head's input and weight."""
        rows = labels.shape[0]
        next_labels = next_token_labels(labels, self.context).to(hidden.device)
        logps = sequence_log_probs(hidden, weight, next_labels, rows, self.parallel, self.chunk_tokens,
                                   self.grad_sum_dtype, self.logit_cap)
        tokens = response_tokens(next_labels, rows, self.context)
        if self.context.size > 1:  # each rank summed its tokens of every sequence
            logps = AllReduce.apply(logps, self.context.group)
        return logps, tokens

    def add_metrics(self, scored, chosen, rejected, chosen_rewards, rejected_rewards):
        values = (chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).float(),
                  chosen_rewards - rejected_rewards, chosen, rejected)
        sums = torch.stack([(value * scored).sum() for value in values] + [scored.sum()]).double()
        window = "training" if torch.is_grad_enabled() else "evaluation"
        self.totals[window] = sums if self.totals[window] is None else self.totals[window] + sums

    def take_metrics(self, evaluation=False):
        """TRL's metrics as means over the pairs scored since the last call on any rank, in training forwards (or
        with evaluation=True, in evaluation's), on every rank (a collective): sums over the world, where only last
        stages hold nonzero sums, and the tensor-parallel ranks of one, which add the same, leave the means
        unchanged; {} when no pair was scored."""
        window = "evaluation" if evaluation else "training"
        totals = self.totals[window] if self.totals[window] is not None else torch.zeros(
            len(METRICS) + 1, dtype=torch.float64, device=collectives.device())
        self.totals[window] = None
        if dist.is_initialized():
            collectives.all_reduce(totals)
        *sums, pairs = totals.tolist()
        return {name: value / pairs for name, value in zip(METRICS, sums)} if pairs else {}


class ReferenceLogProbs:
    """The pipeline's loss_fn while DPO's reference log-probabilities are computed (evaluation/reference.py): each
    row's summed response log-probability under the preference loss's settings, no gradient, no metric."""

    def __init__(self, preference):
        self.preference = preference

    def __call__(self, outputs, labels):
        (labels, _), _ = split_step_divisor(labels, 2)
        (hidden, weight), _ = head_outputs(outputs, chunked=True)
        return self.preference.log_probs(hidden, weight, labels)[0].detach()


def response_tokens(next_labels, rows, context):
    """(rows,) labelled next tokens of each row (next_labels: flattened), summed over the context group, each of
    whose ranks holds a share of every row."""
    tokens = (next_labels != IGNORE_INDEX).view(rows, -1).sum(dim=1)
    if context.size > 1:
        collectives.all_reduce(tokens, group=context.group)
    return tokens


def scored_pairs(tokens):
    """(pairs,) 1.0 where the pair's chosen sequence has a response token to score, from each row's response
    tokens (chosen rows, then rejected rows)."""
    return (tokens[: tokens.shape[0] // 2] > 0).float()
