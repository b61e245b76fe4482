"""ZB-V's order (Qi et al., "Pipeline Parallelism with Controllable Memory"): rank r holds chunks r and 2p-1-r, and
each rank's forwards, input gradients (B) and weight gradients (W) are list-scheduled in simulated time, for given
F, B, W durations per chunk (equal by default, or conf's zbv_times), under a few policies; the shortest step wins.
schedules/orders.py turns the orders into instructions and point-to-point programs."""
import collections
import functools
import math

from schedules.rules import chunk_ids, producer

EQUAL_TIMES = ((1, 1, 1),)  # zbv_order's durations for F = B = W on every rank


# ZB-V's list-scheduling policies, each a (backward taken first when two are ready, W before starting a new
# micro-batch, room kept for the second-chunk forwards of started micro-batches); zbv_orders takes the one whose
# step is shortest (sail-sg's V schedule also tries a few). Without the room a rank may fill its memory with first
# chunks and stall: that policy is then left out.
ZBV_POLICIES = tuple((first, w_first, room) for room in (False, True) for first, w_first in ((0, 0), (1, 0), (0, 1)))


def zbv_list_orders(stages, micro_batches, max_waiting, policy, durations=EQUAL_TIMES):
    """ZB-V's orders for all ranks by list scheduling (transfers free; durations: F, B, W of a chunk in whole time
    units, one for all ranks or one per rank): each time unit, every rank that is free runs, if its input is there,
    the first of: a W if more than max_waiting wait for theirs, a B, an F (the second chunk's first: it finishes a
    micro-batch) while fewer than 2p micro-batch-chunks are between their F and W (1F1B's activations: p
    micro-batches of a whole stage), a W.
    Returns (orders, step time), or None where the policy stalls."""
    first_backward, w_before_new, keep_room = policy
    duration = [dict(zip("FBW", units)) for units in (durations * stages if len(durations) == 1 else durations)]
    busy_until = [0] * stages
    chunks, chunk_of = 2 * stages, [chunk_ids("zbv", stages, rank) for rank in range(stages)]
    ends, orders = {}, [[] for _ in range(stages)]
    forwards, backwards = [[0, 0] for _ in range(stages)], [[0, 0] for _ in range(stages)]
    waiting = [collections.deque() for _ in range(stages)]
    held, time, left = [0] * stages, 0, 6 * stages * micro_batches

    def ready(rank, kind, local):
        count = (forwards if kind == "F" else backwards)[rank][local]
        limit = micro_batches if kind == "F" else forwards[rank][local]
        source = producer(kind, chunk_of[rank][local], count, chunks)
        return count < limit and (source is None or ends.get(source, time + 1) <= time)

    while left:
        if time > 2 * (stages + micro_batches) * chunks * max(map(sum, durations)):
            return None
        picks = []
        for rank in range(stages):
            if busy_until[rank] > time:
                picks.append(None)
                continue
            backward = [local for local in (first_backward, 1 - first_backward) if ready(rank, "B", local)]
            # a new micro-batch only with room left for the second-chunk forwards of those already started
            room = chunks - held[rank] - (forwards[rank][0] - forwards[rank][1] if keep_room else 0)
            forward = [local for local in (1, 0)
                       if ready(rank, "F", local) and (room > 0 if local == 0 else held[rank] < chunks)]
            if waiting[rank] and (max_waiting is not None and len(waiting[rank]) > max_waiting):
                pick = ("W", *waiting[rank][0])
            elif backward:
                pick = ("B", backward[0], backwards[rank][backward[0]])
            elif waiting[rank] and w_before_new and forward and forward[0] == 0:
                pick = ("W", *waiting[rank][0])
            elif forward:
                pick = ("F", forward[0], forwards[rank][forward[0]])
            else:
                pick = ("W", *waiting[rank][0]) if waiting[rank] else None
            picks.append(pick)
        for rank, pick in enumerate(picks):
            if pick is None:
                continue
            kind, local, micro_batch = pick
            ends[(kind, chunk_of[rank][local], micro_batch)] = busy_until[rank] = time + duration[rank][kind]
            orders[rank].append(pick)
            left -= 1
            if kind == "F":
                forwards[rank][local] += 1
                held[rank] += 1
            elif kind == "B":
                backwards[rank][local] += 1
                waiting[rank].append((local, micro_batch))
            else:
                waiting[rank].popleft()
                held[rank] -= 1
        time += 1
    return orders, max(busy_until)


@functools.lru_cache(maxsize=64)
def zbv_orders(stages, micro_batches, max_waiting=None, durations=EQUAL_TIMES):
    """Every rank's ZB-V order: the shortest step among ZBV_POLICIES' list schedules (the first on ties)."""
    schedules = [zbv_list_orders(stages, micro_batches, max_waiting, policy, durations) for policy in ZBV_POLICIES]
    return min((schedule for schedule in schedules if schedule), key=lambda orders_and_time: orders_and_time[1])[0]


def zbv_order(stages, micro_batches, rank, max_waiting=None, durations=EQUAL_TIMES):
    """ZB-V on one rank: [(kind, local_chunk, micro_batch)], kinds F, B (input gradient) and W (weight gradient);
    local chunk 0 is global chunk r (down the V), 1 is 2p-1-r (back up). At most 2p micro-batch-chunks between their
    F and their W on any rank (1F1B's first stage: p micro-batches of whole-stage activations), at most max_waiting
    (if given) waiting only for W. For F = B = W the step is the work plus the pipeline's fill, (p - 1) chunk
    forwards, on 2, 3 and 4 ranks for every m = p ... 64 and on 8 for every multiple of 8 (tests/test_schedule.py
    checks p = 2, 4, 8); elsewhere up to 4 chunk forwards more (p = 5-7, and p = 8 at m = 9, 10, 13). durations:
    a chunk's F, B, W in whole units (zbv_durations), one for all ranks or one per rank, to list-schedule for other
    times; the default's order is the one for F = B = W."""
    return list(zbv_orders(stages, micro_batches, max_waiting, durations)[rank])


def zbv_durations(times):
    """Each rank's {"F", "B", "W"} times of a chunk ([one per rank]) as the small whole numbers zbv_order schedules
    with (to half of the shortest): ((F, B, W) per rank), or one (F, B, W) where all ranks' are alike."""
    shortest = min(value for rank_times in times for value in rank_times.values() if value > 0)
    units = [[max(1, round(2 * rank_times[kind] / shortest)) for kind in "FBW"] for rank_times in times]
    divisor = math.gcd(*sum(units, []))
    durations = tuple(tuple(unit // divisor for unit in rank_units) for rank_units in units)
    return durations[:1] if len(set(durations)) == 1 else durations


ZBV_TIMES_SPREAD = 8  # conf's zbv_times within 8x of each other: at most 16 units each (zbv_durations)


def configured_zbv_durations(zbv_times):
    """zbv_order's durations for conf's zbv_times: a chunk's [F, B, W] times, the same on every rank or one per
    rank ([[F, B, W], ...]), or None for F = B = W ("auto" too: its first steps run that order,
    engines/zbv_auto.py)."""
    if not zbv_times or zbv_times == "auto":
        return EQUAL_TIMES
    per_rank = [zbv_times] if isinstance(zbv_times[0], (int, float)) else zbv_times
    return zbv_durations([dict(zip("FBW", times)) for times in per_rank])


def stage_times(rows, stages):
    """[[F, B, W] per stage] from every rank's (stage, F, B, W) seconds: the mean over each stage's ranks, each time
    raised to 1 / ZBV_TIMES_SPREAD of the longest (the V order's list schedule takes times within that spread)."""
    times = []
    for stage in range(stages):
        mine = [row[1:] for row in rows if int(row[0]) == stage]
        times.append([sum(column) / len(mine) for column in zip(*mine)])
    floor = max(map(max, times)) / ZBV_TIMES_SPREAD
    return [[max(t, floor) for t in stage_row] for stage_row in times]
