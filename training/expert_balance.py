"""DeepSeek-V3's auxiliary-loss-free balancing in training (moe.bias_update_rate): after each optimizer step, every
MoE layer's expert loads over the global batch move its router's e_score_correction_bias towards balance
(models/sigmoid_router.py balanced_correction_bias). transformers implements the forward only; a rate of 0 keeps the
checkpoint's bias, frozen, as it does.

The loads are what the loss already receives (models/router_loss.py): every sparse layer's top-k counts of the real
tokens travel in the tuple between stages to the last stage, which adds each training micro-batch's on the device
(its tensor-parallel and context groups' whole tokens; counted once per micro-batch, whatever activation
checkpointing recomputes, because the loss runs once). After the step one all-reduce over every rank, to which one
rank of each last stage's tensor-parallel and context groups gives its sums, hands every rank the global batch's
loads of every layer (every data-parallel rank, every micro-batch); each rank then moves the biases of its own sparse layers, the same on every replica. No
host sync: the counts stay on the device, and the update is a device op. The bias is a buffer of its layer, saved,
resumed and exported with it.
"""
import torch

import collectives
from models.pipeline_layers import StageDecoder
from models.sigmoid_router import balanced_correction_bias


class CorrectionBiasBalancing:
    def __init__(self, engine, rate):
        self.rate = rate
        self.loss = engine.module.loss_fn.router  # built counting the step's loads (build_engine)
        self.routers = [(layer.sparse_row, layer.mlp.gate) for layer in engine.module.forward_funcs
                        if isinstance(layer, StageDecoder) and layer.sparse]
        # the loads of a last stage's tensor-parallel and context groups are the whole micro-batches' on each rank
        self.gives_loads = engine.is_last_stage() and engine.grid.get_slice_parallel_rank() == 0 and \
            engine.module.context.rank == 0

    @torch.no_grad()
    def step(self, updated=True):
        """After a step's optimizer step: every sparse layer's bias moved by the step's loads (a collective); with
        updated=False (a step skipped as not finite, alike on every rank) the loads are dropped and the biases stay."""
        loads = self.loss.take_step_loads()
        if not updated:
            return
        if not self.gives_loads:
            loads.zero_()
        collectives.all_reduce(loads)
        for row, router in self.routers:
            bias = router.e_score_correction_bias
            bias.copy_(balanced_correction_bias(bias, loads[row], self.rate))


def rank_overload_warning(metrics, factor, step):
    """One line naming each sparse layer whose busiest expert-parallel rank received more than `factor` times its
    balanced share of the routed tokens in the logging window ending at `step` (metrics: the router loss's
    take_metrics, expert_rank_load/layer_{i}), else None. The memory plan counts each rank's balanced share of the
    routed tokens (planner/decoder_costs.py): routing that collapses onto one rank's experts takes more there."""
    over = {key.rsplit("_", 1)[1]: load for key, load in metrics.items()
            if key.startswith("expert_rank_load/") and load > factor}
    if not factor or not over:
        return None
    layers = ", ".join(f"{layer} ({load:.2f}x)" for layer, load in over.items())
    return (f"trainer_pipe: warning: step {step}: an expert-parallel rank received more than moe.rank_load_warning="
            f"{factor} times its balanced share of the routed tokens of decoder layer(s) {layers} in the last logging "
            f"window: the routing collapses onto its experts, whose activations the memory plan counts at the balanced "
            f"share; turn on or raise the load-balancing loss (output_router_logits=true, router_aux_loss_coef in "
            f"config.json) or, for DeepSeek-V3's router, moe.bias_update_rate, or set moe.rank_load_warning=0 to "
            f"silence this.")
