"""`partition_costs: measured`: what `balanced` weighs a stage or a chunk by when the device's own times replace the
plan's FLOPs (engines/cost_calibration.py times them at start-up, before the pipeline is built).

The plan's FLOPs weigh the LM head and its loss, and a split backward (B, then W), as the matmuls count them; a
device does not follow them exactly: on the project's CPU the head and loss take less of a decoder layer's time
than their FLOPs say, and a split backward takes longer than a whole one, which FLOPs count equal
(bench/trainer_profile.py prints both). Under interleaved_1f1b and zbv, where `balanced` picks the split with the
shortest simulated step (chunk_balance.py), those differences choose the split, so there the measured costs are the
default.

A unit's times (seconds per micro-batch, every rank's mean): its forward F, its backward run whole (BW), and run
split as the zero-bubble schedules run it: B (input gradients, with the gradients nobody defers: embedding and norm
weights) then W (the deferred weight gradients). Units: the embedding, one decoder layer, and the final norm with
the LM head and the loss (all on the HEAD kind; the NORM kind costs nothing apart). A checkpointed decoder run
computes its forward again in B.
"""
import dataclasses

from models.partition import DECODER, EMBEDDING, HEAD, NORM, timed_kind

PARTITION_COSTS = ("auto", "flops", "measured")
UNITS = (EMBEDDING, DECODER, HEAD)
TIMES = ("F", "B", "W", "BW")


@dataclasses.dataclass(frozen=True)
class UnitCosts:
    """{unit: {"F", "B", "W", "BW": seconds per micro-batch}} for UNITS, measured on `device`."""
    seconds: dict
    device: str

    def numbers(self):
        """The times as one flat list (UNITS x TIMES), the form the ranks all-gather."""
        return [self.seconds[unit][time] for unit in UNITS for time in TIMES]

    @classmethod
    def from_numbers(cls, numbers, device):
        flat = iter(numbers)
        return cls({unit: {time: next(flat) for time in TIMES} for unit in UNITS}, device)

    def of(self, kind, time):
        return 0.0 if kind == NORM else self.seconds[timed_kind(kind)][time]

    def pass_seconds(self, runs, split):
        """{"F", "B", "W"} seconds of a stage or chunk, given as LayerCosts.chunks' (kinds, checkpointed) runs;
        split: its backward runs as B then W (else whole, all in B)."""
        forward = sum(self.of(kind, "F") for run, _ in runs for kind in run)
        recomputed = sum(self.of(kind, "F") for run, checkpointed in runs if checkpointed for kind in run)
        kinds = [kind for run, _ in runs for kind in run]
        if split:
            return {"F": forward, "B": sum(self.of(kind, "B") for kind in kinds) + recomputed,
                    "W": sum(self.of(kind, "W") for kind in kinds)}
        return {"F": forward, "B": sum(self.of(kind, "BW") for kind in kinds) + recomputed, "W": 0.0}

    @property
    def decoder_seconds(self):
        """One decoder layer's training time under 1F1B (F + a whole backward): the unit of `compute`."""
        return self.seconds[DECODER]["F"] + self.seconds[DECODER]["BW"]

    def describe(self):
        """One line: each unit's F/B/W/BW in milliseconds, and the head against a decoder layer."""
        cells = ", ".join(f"{unit} {'/'.join(f'{self.seconds[unit][t] * 1e3:.2f}' for t in TIMES)}" for unit in UNITS)
        head = (self.seconds[HEAD]["F"] + self.seconds[HEAD]["BW"]) / self.decoder_seconds
        split = (self.seconds[DECODER]["B"] + self.seconds[DECODER]["W"]) / self.seconds[DECODER]["BW"]
        return (f"measured on {self.device}, ms per micro-batch F/B/W/whole backward: {cells}; the head and loss "
                f"{head:.2f} decoder layers, a split decoder backward {split:.3f} x a whole one")


def measured_stage_cost(model, units):
    """StageCostModel.cost with the measured compute: (bytes over the device's memory, decoder layers' time). Under
    zero_bubble and zbv every stage (chunk) but the first splits its backward (schedules/orders.py)."""
    def cost(stage, kinds, start=None):
        over, _ = model.cost(stage, kinds, start)
        split = model.workload.pipeline_schedule in ("zero_bubble", "zbv") and stage > 0
        seconds = units.pass_seconds(model.layers.chunks(kinds), split)
        return over, sum(seconds.values()) / units.decoder_seconds
    return cost


def uses_measured_costs(cfg):
    """Whether `balanced` weighs this run by measured times: partition_costs=measured, or auto under the schedules
    with several chunks per rank; never for another partition method."""
    if cfg.partition != "balanced":
        return False
    if cfg.partition_costs == "auto":
        return cfg.pipeline_schedule in ("interleaved_1f1b", "zbv") and not measured_costs_unsupported(cfg)
    return cfg.partition_costs == "measured"


def measured_costs_unsupported(cfg):
    """Why the calibration cannot time this run's layers (it times one unsplit layer of each unit), or None."""
    if cfg.tensor_parallel_size > 1:
        return f"tensor_parallel_size={cfg.tensor_parallel_size}"
    if cfg.context_parallel_size > 1:
        return f"context_parallel_size={cfg.context_parallel_size}"
    if cfg.lora.rank > 0:
        return f"lora.rank={cfg.lora.rank}"
    if cfg.objective != "sft":
        return f"objective={cfg.objective}"
    return None


def partition_costs_note(cfg, units):
    """What `balanced` weighed the stages by, for the stage plan's and the memory plan's headers."""
    if cfg.partition != "balanced":
        return ""
    if units is not None:
        return f" on costs {units.describe()}"
    if uses_measured_costs(cfg):
        return (f" on the plan's FLOPs (partition_costs={cfg.partition_costs}: the run measures this device's costs "
                f"at start-up and partitions on them)")
    return " on the plan's FLOPs"
