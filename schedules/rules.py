"""Which chunks of layers a rank holds and how many micro-batches a pipeline schedule keeps on each stage: the rules
the schedules' orders follow (schedules/orders.py) and the memory plan counts (planner/stage_costs.py), kept here, below both, once."""


def chunks_per_rank(schedule, virtual_stages=1):
    """Chunks of layers each rank holds: v under interleaved_1f1b, 2 under zbv, else 1."""
    return {"interleaved_1f1b": virtual_stages or 1, "zbv": 2}.get(schedule, 1)


def chunk_ids(schedule, stages, rank, virtual_stages=1):
    """The global chunk of each of this rank's local chunks, in local order: interleaved_1f1b [r, r + p, ...,
    r + (v-1)p], zbv [r, 2p - 1 - r] (the V: down the ranks, back up; rank 0 holds the first and the last), the
    one-chunk schedules [r]."""
    if schedule == "zbv":
        return [rank, 2 * stages - 1 - rank]
    return [rank + k * stages for k in range(chunks_per_rank(schedule, virtual_stages))]


def in_flight_micro_batches(stage, num_stages, micro_batches):
    """1F1B: stage s runs num_stages - s forward passes before its first backward."""
    return min(num_stages - stage, micro_batches)


def waiting_micro_batches(stage, num_stages, micro_batches, schedule, max_waiting=None):
    """Micro-batches waiting only for their W at a stage's peak: ZB-H1 holds s of them back on stage s (at most
    max_waiting if given), next to 1F1B's in flight, never more than the step's."""
    if schedule != "zero_bubble":
        return 0
    return min(held_back_micro_batches(stage, max_waiting),
               micro_batches - in_flight_micro_batches(stage, num_stages, micro_batches))


def held_back_micro_batches(stage, max_waiting=None):
    """zero_bubble's steady state: stage s runs W s micro-batches after their B (ZB-H1), at most max_waiting."""
    return stage if max_waiting is None else min(stage, max_waiting)


def producer(kind, chunk, micro_batch, chunks):
    """The computation whose output (kind, chunk, micro_batch) needs: the previous chunk's forward, the next chunk's
    input gradient (the last chunk's own forward: its loss), its own B for a W; None for the first forward."""
    if kind == "F":
        return ("F", chunk - 1, micro_batch) if chunk > 0 else None
    if kind == "B":
        return ("B", chunk + 1, micro_batch) if chunk < chunks - 1 else ("F", chunk, micro_batch)
    return ("B", chunk, micro_batch)
