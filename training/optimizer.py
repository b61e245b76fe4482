"""The optimizer used with nan_policy=skip (otherwise the DeepSpeed config's optimizer is used)."""
import torch

import collectives


class SkipNonFiniteAdamW(torch.optim.AdamW):
    """AdamW that leaves weights and moments untouched when any rank's gradients hold NaN or inf. Every rank takes
    the same decision (one all-reduce), so stages and data-parallel replicas stay consistent."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.skipped_steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        # On the collective's device (NCCL takes no host tensor), one flag for all gradients: no sync per tensor.
        bad = torch.zeros(1, device=collectives.device())
        for grad in grads:
            bad.logical_or_(~torch.isfinite(grad).all().to(bad.device))
        collectives.all_reduce(bad)
        if bad.item():
            self.skipped_steps += 1
            return None
        return super().step(closure)


def skipping_optimizer(cfg, params):
    """SkipNonFiniteAdamW with the hyper-parameters of the config's deepspeed.optimizer node."""
    optimizer_params = dict(cfg.deepspeed.optimizer.params)
    return SkipNonFiniteAdamW(params, lr=optimizer_params["lr"], betas=tuple(optimizer_params["betas"]),
                              eps=optimizer_params["eps"], weight_decay=optimizer_params["weight_decay"],
                              fused=optimizer_params.get("fused"))
