"""The schedules' orders timed on given F, B and W costs (transfers free): the bubble each leaves, for the planner's
balanced partition (planner/chunk_balance.py), link_transfers' order and bench/schedule_simulator.py."""
from schedules.orders import SPLIT_BACKWARD_SCHEDULES, rank_orders
from schedules.rules import chunk_ids, chunks_per_rank, producer
from schedules.zbv_order import EQUAL_TIMES, zbv_durations


def simulate(stages, micro_batches, costs, schedule, max_waiting=None, virtual_stages=1, orders=None):
    """Time every rank's order: each computation starts when its rank is free and its input is complete
    (transfers free). costs: per rank {"F": s, "B": s, "W": s} for all its layers (a rank's chunks split them
    evenly), or [one such per local chunk]; where a schedule does not split the backward, it costs B + W. orders:
    rank_orders' (by default this schedule's; zbv's list-scheduled for each rank's times). Returns
    {(kind, global_chunk, micro_batch): (start, end)} (one chunk per rank: the chunk is the stage)."""
    per_rank = chunks_per_rank(schedule, virtual_stages)
    costs = [c if isinstance(c, (list, tuple)) else [{kind: t / per_rank for kind, t in c.items()}] * per_rank
             for c in costs]
    if orders is None:  # zbv: the list schedule for these times
        zbv_times = (zbv_durations([{kind: sum(chunk[kind] for chunk in c) for kind in "FBW"} for c in costs])
                     if schedule == "zbv" else EQUAL_TIMES)
        orders = rank_orders(schedule, stages, micro_batches, virtual_stages, max_waiting, zbv_times=zbv_times)
    split = schedule in SPLIT_BACKWARD_SCHEDULES
    cost_of = [[{"F": c["F"], "B": c["B"] + (0 if split else c["W"]), "W": c["W"]} for c in rank_costs]
               for rank_costs in costs]
    chunk_of = [chunk_ids(schedule, stages, rank, virtual_stages) for rank in range(stages)]
    chunks = stages * per_rank
    done, free_at, position = {}, [0.0] * stages, [0] * stages
    progressed = True
    while progressed:
        progressed = False
        for rank in range(stages):
            while position[rank] < len(orders[rank]):
                kind, local, j = orders[rank][position[rank]]
                step = (kind, chunk_of[rank][local], j)
                source = producer(*step, chunks)
                if source is not None and source not in done:
                    break
                start = max(free_at[rank], done[source][1] if source else 0.0)
                done[step] = (start, start + cost_of[rank][local][kind])
                free_at[rank] = start + cost_of[rank][local][kind]
                position[rank] += 1
                progressed = True
    if any(position[rank] < len(orders[rank]) for rank in range(stages)):
        raise RuntimeError(f"{schedule} orders deadlock for {stages} stages and {micro_batches} micro-batches")
    return done
