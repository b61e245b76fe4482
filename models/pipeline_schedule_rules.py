"""How many micro-batches a pipeline schedule keeps on each stage: the rules the schedules' orders follow
(training/schedule.py) and the memory plan counts (planner/stage_costs.py), kept here, below both, once."""


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
