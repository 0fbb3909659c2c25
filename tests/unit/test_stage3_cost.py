"""The stage-3 cost model and ``plan --stage 3``: the coordinator's batches, the gather routes, the default's
communication against stock ZeRO-3's, and what the fullest rank keeps."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from ds_tensorshard.commands.cli import main
from ds_tensorshard.commands.models import preset_shapes
from ds_tensorshard.commands.plan_stage3 import _reduction, stage3_plan_report
from ds_tensorshard.config.schema import TensorShardConfig
from ds_tensorshard.datapath.cost_model import (
    DEFAULT_NETWORK,
    STOCK_REDUCE_BUCKET,
    parse_network,
    stock_zero3_reduction,
)
from ds_tensorshard.datapath.defaults import ACCELERATOR, choose_layout
from ds_tensorshard.datapath.plan import Block, even_row_blocks, plan_ownership
from ds_tensorshard.datapath.stage3_cost import Stage3Bounds, cut_wanted, fetch_batches, gather_route, module_trace
from ds_tensorshard.parameters.gather import GatherLayout, start_gather
from ds_tensorshard.parameters.owned import OwnedParameters
from ds_tensorshard.transports.protocol import Pending

NETWORKS = {"default": DEFAULT_NETWORK, "5,25": parse_network("5,25")}


def test_batches_follow_the_coordinator():
    # modules a (p0, p1), b (p2), c (p3); forward a b c, backward c b a; prefetch 10 elements, reuse 12
    names = ["a.w", "a.b", "b.w", "c.w"]
    numels = [8, 1, 8, 8]
    trace = module_trace(names)
    assert trace == [[0, 1], [2], [3], [3], [2], [0, 1]]
    # no prefetch: each module fetches its own; with no reuse distance each is released after use
    assert fetch_batches(numels, trace, Stage3Bounds(0, 100, 0, 1)) == [[0], [2], [3], [3], [2], [0]]
    # every reuse within the distance: nothing is released, so backward fetches nothing (p1 persists)
    assert fetch_batches(numels, trace, Stage3Bounds(0, 100, 10**9, 1)) == [[0], [2], [3]]
    # a prefetch of 10 elements takes b and c after a (it stops once past 10); a, released (its reuse is 24
    # elements away, beyond 12), is prefetched again at b's fetch, the queue's next one not available
    assert fetch_batches(numels, trace, Stage3Bounds(10, 100, 12, 1)) == [[0], [2, 3], [0]]


def test_each_batch_takes_the_route_furthest_below_stocks_on_its_worst_fabric():
    # 16 owners at 1,024 ranks: 16 chains of 1,023 hops against one tree
    assert gather_route([1_000_000] * 16, 16_000_000, 1024) == "all_reduce"
    # every rank a like share: one all-gather, stock's own collective, not twice the bytes of an all-reduce
    assert gather_route([12_500_000] * 8, 100_000_000, 8) == "all_gather"
    # one owner of 100 MB at 8 ranks: its broadcast, S / B; padded to n x S, the all-gather would move 7 S
    assert gather_route([100_000_000], 100_000_000, 8) == "broadcasts"


def test_large_tensors_are_cut_where_their_gathers_are_bandwidth_bound():
    """Llama-3-8B's matrices: one owner's broadcast moves S where stock's all-gather moves (n - 1) / n x S, and the
    all-reduce 2 S on a slow fabric, so from 2 to 256 ranks they are cut; at 1,024 ranks a tensor's chain of 1,023
    hops dominates and the tree's all-reduce of a whole tensor wins on both fabrics."""
    matrices = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
    assert all(cut_wanted(matrices, n, 2) for n in (2, 8, 64, 256))
    assert not cut_wanted(matrices, 1024, 2)
    assert not cut_wanted(matrices, 1, 2) and not cut_wanted([], 8, 2)


def test_a_cut_tensor_has_a_block_of_rows_on_every_rank_and_the_rest_balance_around_it():
    assert even_row_blocks((10, 3), 4) == (Block(0, 0, 6), Block(1, 6, 15), Block(2, 15, 21), Block(3, 21, 30))
    plan = plan_ownership([("big", (8, 4)), ("a", (8,)), ("b", (8,))], 2, split="never", cut={"big"})
    assert plan.blocks["big"] == (Block(0, 0, 16), Block(1, 16, 32))
    assert plan.numel_per_rank == (24, 24) and {plan.owners["a"], plan.owners["b"]} == {0, 1}


def test_a_batch_gathered_by_all_reduce_keeps_every_bit():
    a = torch.tensor([-0.0, 1.5, float("nan"), 0.0])
    b = torch.tensor([0.0, -0.0, 3.0, -1e-30])
    params = [SimpleNamespace(ds_tensor=t, dtype=t.dtype, ds_shape=(4,)) for t in (a, b)]
    blocks = [(Block(1, 0, 4),), (Block(0, 0, 4),)]
    sent = []

    class Rank:
        device = torch.device("cpu")

        def start_all_reduce(self, flat):
            sent.append(flat)
            return Pending(lambda: None)

    for rank in (0, 1):
        start_gather(params, GatherLayout.of(blocks, rank, "all_reduce"), Rank())
    summed = sent[0] + sent[1]
    assert torch.equal(summed.view(torch.int32), torch.cat([b, a]).view(torch.int32))


def test_a_batch_gathered_by_all_gather_puts_each_ranks_span_in_its_slot():
    # x: 6 elements cut 3 + 3 over ranks 0 and 1; y: 2 elements owned by rank 1. Slots of 5 (rank 1's span)
    x, y = torch.arange(6.0), torch.tensor([10.0, 11.0])
    blocks = [(Block(0, 0, 3), Block(1, 3, 6)), (Block(1, 0, 2),)]
    layouts = [GatherLayout.of(blocks, rank, "all_gather", 2) for rank in (0, 1)]
    assert [(lay.numel, lay.slot) for lay in layouts] == [(10, 5), (10, 5)]
    assert layouts[0].pieces == [[(0, 3), (5, 3)], [(8, 2)]] and layouts[1].mine == [(0, 5), (1, 8)]
    held = [[x[:3], torch.empty(0)], [x[3:], y]]  # each rank's ds_tensor of x and of y
    flats = []

    class Rank:
        device = torch.device("cpu")

        def start_all_gather(self, flat, slot):
            flats.append(flat)
            return Pending(lambda: None)

    gathers = []
    for rank in (0, 1):
        params = [
            SimpleNamespace(ds_tensor=t, dtype=t.dtype, ds_shape=shape) for t, shape in zip(held[rank], [(6,), (2,)])
        ]
        gathers.append(start_gather(params, layouts[rank], Rank()))
    for flat in flats:  # the all-gather: every rank's slot from its owner
        for other in (0, 1):
            flat[other * 5 : other * 5 + 5] = flats[other][other * 5 : other * 5 + 5].clone()
    for gathered in gathers:
        whole = gathered.wait()
        assert torch.equal(whole[0], x) and torch.equal(whole[1], y)


def test_accelerators_take_the_route_the_model_prices_best():
    comm = SimpleNamespace(rank=0, world_size=1024, device=torch.device("meta"))
    owned = OwnedParameters(comm, torch.device("meta"), lambda p: ())
    batch = [
        SimpleNamespace(ds_id=i, ds_numel=1_000_000, ts_blocks=(Block(i, 0, 1_000_000),), element_size=lambda: 2)
        for i in range(16)
    ]
    assert owned.layout_of(batch).route == "all_reduce"
    owned.comm = SimpleNamespace(rank=0, world_size=1024, device=torch.device("cpu"))
    owned._layouts.clear()
    assert owned.layout_of(batch).route == "broadcasts"  # CPU ranks keep the broadcasts
    # one accelerator (offload_param copies its tensors in through a gather): nothing to price, no division by zero
    owned.comm = SimpleNamespace(rank=0, world_size=1, device=torch.device("meta"))
    owned._layouts.clear()
    assert owned.layout_of(batch).route == "broadcasts"


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("n", [8, 64, 256, 1024])
def test_gpt2_small_default_within_stock_zero3(n, network):
    comm = stage3_plan_report(preset_shapes("gpt2-small"), n, network=NETWORKS[network])["communication"]
    assert comm["default"]["time_ratio"] <= 1.0


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("n", [8, 64, 256, 1024])
def test_llama3_8b_default_within_stock_zero3(n, network):
    report = stage3_plan_report(preset_shapes("llama3-8b"), n, network=NETWORKS[network])
    comm = report["communication"]
    assert comm["default"]["time_ratio"] <= 1.0
    # whole tensors, a broadcast per owner: latency-bound from 64 ranks, bandwidth-bound at 8 (S / B against
    # stock's (n - 1) / n x S / B): the model says so, and cuts the matrices up to 256 ranks
    assert comm["per_owner_time_ratio"] > 1.0
    assert (report["cut"] > 0) == (n < 1024)
    if n == 8:
        assert comm["whole_time_ratio"] > 1.0 and set(comm["default"]["routes"]) == {"all_gather"}


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("n", [8, 1024])
def test_stage3_stripes_are_sized_against_stock_zero3s_reduction(n, network):
    """At stage 3 the stripes only reduce: sized against stock ZeRO-3's reduce-scatters (not stock ZeRO-2's
    reduction and gather), their time is within 2% of stock's reduction on both fabrics (Llama-3-8B)."""
    shapes = preset_shapes("llama3-8b")
    numels = [math.prod(shape) for _, shape in shapes]
    owned = plan_ownership(shapes, n).numel_per_rank
    net = NETWORKS[network]
    ours = _reduction(numels, owned, net, 2).seconds
    assert ours <= 1.02 * stock_zero3_reduction(numels, n, STOCK_REDUCE_BUCKET, net, 2).seconds
    choice = choose_layout(TensorShardConfig(), {"zero_optimization": {"stage": 3}}, ACCELERATOR, numels, owned, 2)
    assert "stock ZeRO-3's reduction" in choice.why
    assert "stock ZeRO-2" in choose_layout(TensorShardConfig(), {}, ACCELERATOR, numels, owned, 2).why


@pytest.mark.parametrize("preset", ["llama3-8b", "mixtral-8x7b"])
@pytest.mark.parametrize("n", [64, 256, 1024])
def test_the_fullest_rank_keeps_model_over_n(preset, n):
    memory = stage3_plan_report(preset_shapes(preset), n)["memory"]
    assert memory["parameters_fullest_over_ideal"] <= 1.02
    assert memory["optimizer_state_fullest_over_ideal"] <= 1.05


def test_plan_stage3_json(capsys):
    assert main(["plan", "--preset", "llama3-8b", "--world-size", "64", "1024", "--stage", "3", "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert [r["world_size"] for r in reports] == [64, 1024]
    assert all(r["stage"] == 3 and r["memory"]["parameters_fullest_over_ideal"] <= 1.02 for r in reports)
    assert reports[1]["communication"]["default"]["time_ratio"] <= 1.0


def test_a_stage3_plan_on_accelerators_cuts_large_tensors_but_not_whole_matrices_nor_on_the_cpu():
    """2 ranks: the two 131,072-element matrices (one frozen) are cut into a block of rows on each rank on
    accelerators, with an element-wise optimizer; with one that updates whole matrices the trained one stays
    whole; CPU ranks keep stage 2's plan."""
    from ds_tensorshard.datapath.placement import plan_for
    from ds_tensorshard.parameters.ownership import plan_parameters

    module = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    module[1].weight.requires_grad_(False)
    trained = [p for p in module.parameters() if p.requires_grad]

    class WholeMatrices(torch.optim.Optimizer):  # not known to be element-wise: needs each matrix whole
        def __init__(self, params):
            super().__init__(params, {})

    elementwise = torch.optim.AdamW(trained)
    plan = plan_parameters(module, elementwise, trained, 2, "auto", on_accelerator=True).kept
    assert plan.blocks["0.weight"] == (Block(0, 0, 65_536), Block(1, 65_536, 131_072))
    assert plan.blocks["1.weight"] == (Block(0, 0, 65_536), Block(1, 65_536, 131_072))  # frozen, cut too
    assert all(len(plan.blocks[name]) == 1 for name in ("0.bias", "1.bias"))
    whole = plan_parameters(module, WholeMatrices(trained), trained, 2, "auto", on_accelerator=True).kept
    assert len(whole.blocks["0.weight"]) == 1 and len(whole.blocks["1.weight"]) == 2  # the frozen one is cut
    on_cpu = plan_parameters(module, elementwise, trained, 2, "auto", on_accelerator=False)
    names = {p: n for n, p in module.named_parameters() if p.requires_grad}
    assert on_cpu.trained.blocks == plan_for(elementwise, names, 2, "auto", None).blocks  # stage 2's plan
