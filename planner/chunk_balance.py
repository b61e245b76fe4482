"""`partition: balanced` under a schedule with several chunks per rank (interleaved_1f1b, zbv).

A rank runs its chunks one after another, so the step is set by each rank's chunks together and by the idle time
its order leaves, not by the costliest chunk. Evening out the chunks' compute, as `balanced` evens out stages, gave
the small bench shape's ZB-V rank 1 five decoder layers against rank 0's three and the LM head; and rank 0, which
starts the step's first forward and ends its last backward, is the one rank that never waits for the fill (rank r
waits for micro-batch 0's forward through the chunks before its own). So here `balanced` minimises the step the
schedule's order takes (schedules/orders.py simulate, transfers free) on the plan's F, B and W of every chunk
(planner/stage_costs.py: FLOPs, the chunked loss's head all in F), ZB-V's V order made for those times as
zbv_times=auto makes it for the measured ones: from the chunks evened out, it moves one decoder layer across a
chunk boundary at a time while the simulated step shrinks. With units (partition_costs=measured, the default here:
planner/measured_costs.py) the chunks' F, B and W are the device's measured times instead of FLOPs.
"""
from models.partition import balanced_decoder_counts, counts_kinds, decoder_kinds
from schedules.orders import rank_orders
from schedules.rules import chunk_ids, chunks_per_rank
from schedules.simulator import simulate
from schedules.zbv_order import configured_zbv_durations, stage_times
from planner.measured_costs import measured_stage_cost
from planner.stage_costs import StageCostModel


def chunk_pass_costs(model, counts, schedule, units=None):
    """[{"F", "B", "W"} of each global chunk] in decoder layers' compute (of FLOPs, or of units' measured times);
    ZB-V's first chunk runs its backward whole (engines/chunked_engine.py), its W in its B, and interleaved_1f1b
    every chunk's."""
    chunk_kinds = counts_kinds(counts, decoder_kinds(model.layers.config))
    if units is not None:
        return [{kind: seconds / units.decoder_seconds for kind, seconds in units.pass_seconds(
                    model.layers.chunks(kinds), split=schedule == "zbv" and chunk > 0).items()}
                for chunk, kinds in enumerate(chunk_kinds)]
    costs = []
    for chunk, kinds in enumerate(chunk_kinds):
        flops = model.layers.stage_pass_flops(kinds)
        if schedule == "zbv" and chunk == 0:
            flops = {"F": flops["F"], "B": flops["B"] + flops["W"], "W": 0}
        costs.append({kind: value / model.compute_unit for kind, value in flops.items()})
    return costs


def simulated_step(model, counts, num_stages, units=None):
    """The step the workload's schedule takes on chunks of counts[g] decoder layers, in decoder layers' compute."""
    workload = model.workload
    chunks = chunk_pass_costs(model, counts, workload.pipeline_schedule, units)
    ranks = [[chunks[chunk] for chunk in chunk_ids(workload.pipeline_schedule, num_stages, rank,
                                                   workload.virtual_stages)] for rank in range(num_stages)]
    times = workload.zbv_times
    if times == "auto":  # the V order zbv_auto makes for these times, measured
        times = stage_times([(rank, *(sum(chunk[kind] for chunk in rank_chunks) for kind in "FBW"))
                             for rank, rank_chunks in enumerate(ranks)], num_stages)
    orders = rank_orders(workload.pipeline_schedule, num_stages, workload.micro_batches, workload.virtual_stages,
                         workload.zero_bubble_max_waiting, configured_zbv_durations(times))
    done = simulate(num_stages, workload.micro_batches, ranks, workload.pipeline_schedule,
                    workload.zero_bubble_max_waiting, workload.virtual_stages, orders)
    return max(end for _, end in done.values())


def balanced_chunk_counts(config, workload, num_stages, units=None):
    """Decoder layers per global chunk (at least one each) that `balanced` gives a schedule with several chunks per
    rank: the chunks' compute evened out (models/partition.py), then single layers moved across a chunk boundary,
    the largest gain first, while the simulated step shrinks. units: measured UnitCosts (None: the plan's FLOPs)."""
    chunks = num_stages * chunks_per_rank(workload.pipeline_schedule, workload.virtual_stages)
    model = StageCostModel(config, workload, chunks)
    cost = model.cost if units is None else measured_stage_cost(model, units)
    counts = balanced_decoder_counts(config.num_hidden_layers, chunks, cost, decoder_kinds(config))
    step = simulated_step(model, counts, num_stages, units)
    while True:
        moves = []
        for source in range(chunks):
            for target in (source - 1, source + 1):
                if counts[source] > 1 and 0 <= target < chunks:
                    moved = list(counts)
                    moved[source] -= 1
                    moved[target] += 1
                    moves.append((simulated_step(model, moved, num_stages, units), moved))
        best = min(moves, key=lambda move: move[0], default=None)  # the first on ties
        if best is None or best[0] >= step * (1 - 1e-9):
            return counts
        step, counts = best
