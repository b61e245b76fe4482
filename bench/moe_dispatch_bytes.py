"""The bytes an expert-parallel sparse layer's all-to-alls move, per rank and micro-batch, counted from routing
(no processes: each rank's tokens routed here, what each rank would send counted as models/expert_parallel.py sends
it). Before: one row per choice each way (a token sent to each of its k experts separately). Now: one row per token
and rank holding one of its experts, with its choices there (k int64), on the way there; one row per choice back, so
that each token sums its k outputs in transformers' order. Backward runs both legs' reverses, the same bytes.

Routings: DeepSeek-V3's group-limited one (256 experts in 8 groups, a token's top-8 among its 4 best groups: at most
4 ranks at expert parallel 8, a group a rank) and Qwen3-30B-A3B's plain top-8 of 128, each at expert parallel 8,
bf16 rows of their hidden sizes, random router scores. "Off the rank": the bytes that leave it (its own rows stay).

    python bench/moe_dispatch_bytes.py [--tokens 4096] [--ranks 8]
"""
from common import bench_parser, parse_args

import torch  # noqa: E402

ROUTINGS = {"deepseek_v3": dict(experts=256, top_k=8, groups=8, top_groups=4, hidden=7168),
            "qwen3_30b_a3b": dict(experts=128, top_k=8, groups=None, top_groups=None, hidden=2048)}
ROW_ELEMENT_BYTES, CHOICE_BYTES = 2, 8  # bf16 rows; the choices travel as int64 local expert ids


def routed(tokens, experts, top_k, groups, top_groups, generator):
    """[tokens, top_k] expert ids: the family's routing of random scores."""
    from models.sigmoid_router import group_limited_top_k
    scores = torch.rand(tokens, experts, generator=generator)
    if groups is None:
        return scores.topk(top_k, dim=-1)[1]
    return group_limited_top_k(scores, top_k, groups, top_groups)


def counted_rows(expert_ids, rank, ranks, experts):
    """{leg: (rows sent, of them off the rank)} of one rank's tokens: the choices (before: both legs; now: the way
    back) and the (token, destination) pairs (now: the way there)."""
    from models.expert_parallel import token_destinations
    local = experts // ranks
    off = (expert_ids // local) != rank
    present = token_destinations(expert_ids, local, ranks)
    return {"choices": (expert_ids.numel(), int(off.sum())),
            "pairs": (int(present.sum()), int(present.sum() - present[:, rank].sum()))}


def main():
    from models.expert_parallel import token_destinations
    parser = bench_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a rank routes in a micro-batch")
    parser.add_argument("--ranks", type=int, default=8, help="the expert-parallel size")
    args = parse_args(parser, tokens=64)
    generator = torch.Generator().manual_seed(0)
    for name, routing in ROUTINGS.items():
        hidden, experts, top_k = routing["hidden"], routing["experts"], routing["top_k"]
        totals = {"choices": [0, 0], "pairs": [0, 0]}
        destinations = []
        for rank in range(args.ranks):
            ids = routed(args.tokens, experts, top_k, routing["groups"], routing["top_groups"], generator)
            for leg, (rows, off) in counted_rows(ids, rank, args.ranks, experts).items():
                totals[leg][0] += rows / args.ranks
                totals[leg][1] += off / args.ranks
            destinations.append(token_destinations(ids, experts // args.ranks, args.ranks).sum(dim=1))
        per_token = torch.cat(destinations).float()
        row = hidden * ROW_ELEMENT_BYTES
        there_before = [totals["choices"][i] * row for i in range(2)]  # [all, off the rank]
        there_now = [totals["pairs"][i] * (row + top_k * CHOICE_BYTES) for i in range(2)]
        back = there_before  # one row per choice, before and now
        groups = "" if routing["groups"] is None else f" of {routing['top_groups']} of {routing['groups']} groups"
        print(f"{name}: {experts} experts, top-{top_k}{groups}, expert parallel {args.ranks}, hidden {hidden} bf16, "
              f"{args.tokens} tokens a rank")
        print(f"  ranks a token goes to: mean {per_token.mean():.2f}, max {int(per_token.max())} (choices {top_k})")
        for label, there in (("before", there_before), ("now", there_now)):
            print(f"  {label}: there {there[0] / 2**20:.1f} MiB + back {back[0] / 2**20:.1f} MiB a rank a layer "
                  f"forward, off the rank {(there[1] + back[1]) / 2**20:.1f} MiB (backward the same)")
        print(f"  now / before: the way there {there_now[0] / there_before[0]:.3f}, a layer's forward and backward "
              f"{(there_now[0] + back[0]) / (there_before[0] + back[0]):.3f}, off the rank "
              f"{(there_now[1] + back[1]) / (there_before[1] + back[1]):.3f}")

if __name__ == "__main__":
    main()
