"""The α-β cost model against hand-computed cases: the formulas, stock ZeRO-2's buckets and chunks, both ways."""

import json
import math

import pytest
import torch

from ds_tensorshard.commands.cli import main as cli_main
from ds_tensorshard.commands.plan_report import meta_buckets
from ds_tensorshard.datapath.buckets import build_stripes
from ds_tensorshard.datapath.cost_model import (
    Network,
    all_gather,
    all_reduce,
    all_reduce_below,
    parse_network,
    per_owner_cost,
    rooted,
    stock_buckets,
    stock_zero2_cost,
    stripe_collective,
    stripes_fit,
    stripes_padding,
    tensorshard_grouped_cost,
    tensorshard_stripes_cost,
    tree_all_reduce,
)
from ds_tensorshard.datapath.plan import plan_ownership

NET = Network(alpha_us=10.0, bus_gbps=100.0, intra_node_ranks=4, intra_gbps=200.0)


def test_formulas_by_hand():
    # 8 ranks span two 4-rank nodes: the network's 100 GB/s; 4 ranks fit in one: 200 GB/s
    assert rooted(1e9, 8, NET) == pytest.approx((7 * 10e-6, 1e9 / 100e9))
    assert rooted(1e9, 4, NET) == pytest.approx((3 * 10e-6, 1e9 / 200e9))
    # large: the ring's 2(n-1)/n S/B beats the tree's 2 S/B; small: the tree's 2 log2(n) hops beat 2(n-1)
    assert all_reduce(1e9, 8, NET) == pytest.approx((14 * 10e-6, 2 * 7 / 8 * 1e9 / 100e9))
    assert all_reduce(4, 8, NET) == pytest.approx((6 * 10e-6, 2 * 4 / 100e9))
    assert all_gather(8e9, 8, NET) == pytest.approx((7 * 10e-6, 7 / 8 * 8e9 / 100e9))
    assert rooted(1e9, 1, NET) == (0.0, 0.0)


def test_network_argument():
    assert parse_network("5,50") == Network(5.0, 50.0, 8, 450.0)
    assert parse_network("5,50,4,300") == Network(5.0, 50.0, 4, 300.0)
    for bad in ("5", "5,x", "5,0", "5,50,0,300"):
        with pytest.raises(ValueError, match="--network"):
            parse_network(bad)


def test_stock_buckets_and_chunks_follow_stage_1_and_2():
    # backward order is reverse registration; a bucket closes when the next parameter would pass the size,
    # and a parameter larger than the size is a bucket of its own
    assert stock_buckets([3, 5, 10, 2], 6) == [[3], [2], [1], [0]]
    assert stock_buckets([1, 2, 3], 6) == [[2, 1, 0]]


def test_stock_zero2_by_hand():
    # two tensors of 4 elements, 2 ranks, buckets of 4: one bucket each, one all-reduce each (16 bytes in fp32),
    # then one all-gather of the flat group (8 elements, already a multiple of 2 x 2) and the norm's all-reduce
    cost = stock_zero2_cost([4, 4], 2, 4, NET, element_bytes=4)
    reduce_, gather, norm = all_reduce(16, 2, NET), all_gather(32, 2, NET), all_reduce(4, 2, NET)
    assert cost.launches == 4
    assert cost.seconds == pytest.approx(2 * sum(reduce_) + sum(gather) + sum(norm))
    assert cost.latency_s == pytest.approx(2 * reduce_[0] + gather[0] + norm[0])
    # [6, 2] in one bucket of 8 spans both partitions (4 elements each): one all-reduce by default, one reduce
    # per partition with use_multi_rank_bucket_allreduce false
    assert stock_zero2_cost([6, 2], 2, 8, NET, 4).launches == 1 + 1 + 1
    by_partition = stock_zero2_cost([6, 2], 2, 8, NET, 4, multi_rank=False)
    assert by_partition.launches == 2 + 1 + 1
    expected = sum(rooted(16, 2, NET)) * 2 + sum(all_gather(32, 2, NET)) + sum(all_reduce(4, 2, NET))
    assert by_partition.seconds == pytest.approx(expected)


def test_tensorshard_by_hand():
    # the planning docstring's example: a: 6, b: 4, c: 3, d: 3 elements whole on 2 ranks (a, d on 0; b, c on 1);
    # backward order d, c, b, a in buckets of 8: [d c | b(2)] owners {0, 1}, [b(2) a] owners {0, 1}
    shapes = [("a", (6,)), ("b", (4,)), ("c", (3,)), ("d", (3,))]
    plan = plan_ownership(shapes, 2, split="never")
    buckets = meta_buckets(shapes, plan, 8)
    assert [[s.owner for s in b.segments] for b in buckets] == [[0, 1], [0, 1]]
    sizes = [s.numel * 2 for b in buckets for s in b.segments]
    today = per_owner_cost(buckets, 2, NET, element_bytes=2)
    assert today.launches == 2 * 4 + 1
    assert today.seconds == pytest.approx(
        2 * sum(sum(rooted(size, 2, NET)) for size in sizes) + sum(all_reduce(4, 2, NET))
    )
    grouped = tensorshard_grouped_cost(buckets, 2, NET, element_bytes=2)
    assert grouped.launches == 2 * 2 + 1
    assert grouped.latency_s == pytest.approx(4 * 10e-6 + all_reduce(4, 2, NET)[0])


def test_stripes_by_hand():
    # the same plan (rank 0: a d, 9 elements; rank 1: b c, 7) in stripes of 8: slot 4, then the rest, 1 wide:
    # three buckets of 8, 8 and 2 elements, each one reduce-scatter and one all-gather over both ranks
    shapes = [("a", (6,)), ("b", (4,)), ("c", (3,)), ("d", (3,))]
    plan = plan_ownership(shapes, 2, split="never")
    params = {name: torch.nn.Parameter(torch.empty(shape, device="meta")) for name, shape in shapes}
    blocks_of = lambda p: next(plan.blocks[n] for n, q in params.items() if q is p)  # noqa: E731
    stripes = build_stripes([params[n] for n in "dcba"], blocks_of, 8, 2)
    assert [(b.slot, b.numel) for b in stripes] == [(4, 8), (4, 8), (1, 2)]
    cost = tensorshard_stripes_cost(9, 2, 8, NET, element_bytes=2)  # rank 0, the fullest, owns 9
    assert cost.launches == 2 * 3 + 1
    per_stripe = [sum(all_gather(numel * 2, 2, NET)) for numel in (8, 8, 2)]
    assert cost.seconds == pytest.approx(2 * sum(per_stripe) + sum(all_reduce(4, 2, NET)))


def test_stripes_fit_takes_the_most_stripes_within_the_limit():
    # 8 ranks over the network (10 us per hop, 100 GB/s), 1,000 elements of 1 byte on the fullest rank. Stripes this
    # small go as all-reduces (the tree's 2 x 3 hops against the ring's 7), so K stripes cost
    # 2 K (6 x 10 us + 2 x 8 x ceil(1000 / K) bytes / B) + the norm; 1 ms allows K = 7 (0.90 ms), not 8
    norm = sum(all_reduce(4, 8, NET))
    seconds = lambda k: 2 * k * sum(tree_all_reduce(8 * -(-1000 // k), 8, NET)) + norm  # noqa: E731
    for size in (8 * 1000, 8 * 143):  # one stripe, seven
        assert stripe_collective(size, 8, NET) == tree_all_reduce(size, 8, NET)
    assert seconds(7) <= 1e-3 < seconds(8)
    assert stripes_fit(1000, 8, NET, 1, 1e-3, 10**9) == 8 * 143  # slot ceil(1000 / 7)
    assert stripes_fit(1000, 8, NET, 1, 0.0, 10**9) == 8 * 1000  # nothing fits: one stripe
    # buffers of at most 800 elements (slots of 100): at least 10 stripes; 2 ms allows 16 (1.98 ms), 1 ms none of
    # them, so the fewest the cap allows, 10
    assert seconds(16) <= 2e-3 < seconds(17)
    assert stripes_fit(1000, 8, NET, 1, 2e-3, 800) == 8 * 63  # slot ceil(1000 / 16)
    assert stripes_fit(1000, 8, NET, 1, 1e-3, 800) == 8 * 100
    # a bucket smaller than the world: one element per slot, 1,000 stripes, counted without building them
    assert tensorshard_stripes_cost(1000, 8, 4, NET, 1).launches == 2 * 1000 + 1


@pytest.mark.parametrize("n", [2, 4, 7, 8, 9, 64, 256, 1024])
def test_a_stripe_goes_by_all_reduce_exactly_below_the_size_where_the_tree_is_faster(n):
    below = all_reduce_below(n, NET)
    if n <= 7:  # 2 ceil(log2 n) >= n - 1 hops and twice the bytes: the ring is never slower
        assert below == 0.0
        assert all(stripe_collective(s, n, NET) == all_gather(s, n, NET) for s in (1, 1e6, 1e9))
        return
    # hand: 8 ranks span two 4-rank nodes (100 GB/s): 10 us x 100 GB/s x (7 - 6) x 8 / 9 = 888,889 bytes
    assert below == pytest.approx({8: 888_888.9}.get(n, below))
    assert stripe_collective(below * 0.999, n, NET) == tree_all_reduce(below * 0.999, n, NET)
    assert stripe_collective(below * 1.001, n, NET) == all_gather(below * 1.001, n, NET)
    # a run that chose on another network is priced with its own thresholds, each way its own
    assert tensorshard_stripes_cost(1000, n, n * 1000, NET, 1, all_reduce_under=(0.0, 0.0)).seconds == pytest.approx(
        2 * sum(all_gather(n * 1000, n, NET)) + sum(all_reduce(4, n, NET))
    )
    mixed = tensorshard_stripes_cost(1000, n, n * 1000, NET, 1, all_reduce_under=(math.inf, 0.0))
    assert mixed.seconds == pytest.approx(
        sum(all_reduce(n * 1000, n, NET)) + sum(all_gather(n * 1000, n, NET)) + sum(all_reduce(4, n, NET))
    )


def test_stripes_padding_by_hand_and_as_built():
    # ranks owning 9 and 7 elements in stripes of 8 (slots of 4): [4 | 4], [4 | 3], then the rest, 1 wide: [1 | 0];
    # zeros 0, 1 and 1: at most 1 in one buffer, 2 in all (2 x 9 - 16)
    assert stripes_padding([9, 7], 8) == (1, 2)
    assert stripes_padding([5, 5], 4) == (0, 0)  # equal ranks, slots dividing them: no padding
    # slots of 3: [3|2|0] 4 zeros, [3|0|0] 6, [3|0|0] 6, the rest [1|0|0] 2: at most 6, 18 in all (3 x 10 - 12)
    assert stripes_padding([10, 2, 0], 9) == (6, 18)
    # against build_stripes: the planning docstring's tensors (rank 0: a d, 9 elements; rank 1: b c, 7)
    shapes = [("a", (6,)), ("b", (4,)), ("c", (3,)), ("d", (3,))]
    plan = plan_ownership(shapes, 2, split="never")
    params = {name: torch.nn.Parameter(torch.empty(shape, device="meta")) for name, shape in shapes}
    blocks_of = lambda p: next(plan.blocks[n] for n, q in params.items() if q is p)  # noqa: E731
    stripes = build_stripes([params[n] for n in "dcba"], blocks_of, 8, 2)
    zeros = [b.numel - sum(s.numel for s in b.segments) for b in stripes]
    assert stripes_padding(plan.numel_per_rank, 8) == (max(zeros), sum(zeros)) == (1, 2)


def test_plan_reports_the_communication_both_ways(capsys):
    assert cli_main(["plan", "--world-size", "8", "--network", "9.6,400", "--json"]) == 0
    comm = json.loads(capsys.readouterr().out)[0]["communication"]
    assert comm["network"] == {"alpha_us": 9.6, "bus_gbps": 400.0, "intra_node_ranks": 8, "intra_gbps": 450.0}
    assert comm["tensorshard_grouped"]["launches"] == 2 * 32 + 1  # GPT-2 small: 32 buckets
    assert comm["tensorshard_per_owner"]["launches"] > comm["tensorshard_grouped"]["launches"]
    assert comm["tensorshard_stripes"]["launches"] == 2 * 32 + 1  # stripes of 4M: as many as windows here
    chosen, stock = comm["default"], comm["stock_zero2_defaults"]
    # flat parameters: a stripe's reduction per bucket, one gather of the storage, the norm
    assert chosen["layout"] == "flat" and chosen["launches"] == chosen["buckets"] + 2
    assert chosen["time_ratio"] == pytest.approx(chosen["seconds"] / stock["seconds"]) and chosen["time_ratio"] <= 1
    assert chosen["largest_buffer"] == chosen["bucket_numel"] <= 500_000_000
    assert 0 <= chosen["padding_bytes"] <= chosen["padding_bytes_per_step"] and chosen["why"].startswith("flat")
    assert 0 <= chosen["flat_padding_bytes"] < 2 * 2 * 8  # the storage's tail: under 2 x world-size elements
    assert comm["default_on_cpu"]["bucket_numel"] == 4_000_000 and comm["default_on_cpu"]["one_host"] == "flat"
    per_owner = comm["tensorshard_per_owner"]["seconds"]
    assert comm["per_owner_time_ratio"] == pytest.approx(per_owner / comm["stock_zero2"]["seconds"])
    assert cli_main(["plan", "--world-size", "8", "--network", "fast"]) == 2
    assert "--network takes" in capsys.readouterr().err
