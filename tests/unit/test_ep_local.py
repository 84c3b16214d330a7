"""Expert parallelism pieces that run in one process: home ranges, layouts and permutations (one process standing in
for R ranks, the exchange done by slicing), home-expert shards and their full-tensor round trip, and the refusals."""

from __future__ import annotations

import pytest
import torch
from layer_init import expert_bank

from k3train.models.k3.args import get_preset
from k3train.models.k3.moe import GroupedExperts, LatentMoE, LocalDispatcher
from k3train.parallel.ep_dispatch import (
    CommStats,
    EPGroupedExperts,
    alltoall_send_layout,
    home_range,
    send_positions,
    shard_experts,
    source_to_expert_major,
    source_to_expert_major_reference,
)
from k3train.ops.moe_permute import permute_rows, unpermute
from k3train.parallel.expert_parallel import apply_expert_parallel, expert_parameters
from k3train.parallel.moonep import make_plan
from k3train.parallel.moonep_dispatch import MoonEPDispatcher, hosted_weight_routes, moonep_send_layout

L, H = 8, 16  # latent and expert hidden widths of the toy bank


def _exchange(bufs: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """all_to_all by slicing: source s sends splits[s][d] rows of bufs[s] to d; d receives source-major."""
    R = len(bufs)
    parts = [list(b.split(splits[s])) for s, b in enumerate(bufs)]
    return [torch.cat([parts[s][d] for s in range(R)]) for d in range(R)]


def _local_reference(ex: GroupedExperts, z: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    disp = LocalDispatcher()
    rows, counts, order = disp.dispatch(z, idx, ex.n_experts)
    return disp.combine(ex(rows, counts), w, order)


def _routing(R: int, Ns: list[int], E: int, K: int, skew: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    zs, idxs, ws = [], [], []
    bias = skew * torch.linspace(1, 0, E)  # favours low expert ids, so rank 0's home is overloaded
    for n in Ns:
        zs.append(torch.randn(n, L, generator=g))
        idxs.append(torch.topk(torch.rand(n, E, generator=g) + bias, K, dim=1).indices)
        w = torch.rand(n, K, generator=g)
        ws.append(w / w.sum(1, keepdim=True))
    return zs, idxs, ws


def test_home_range_and_refusal():
    assert home_range(0, 4, 16) == (0, 4)
    assert home_range(3, 4, 16) == (12, 16)
    full = torch.arange(16 * 3).view(16, 3)
    assert torch.equal(torch.cat([shard_experts(full, r, 4) for r in range(4)]), full)
    with pytest.raises(ValueError, match=r"EP degree 3 does not divide n_experts=16 \(n_experts % ep = 1\)"):
        home_range(0, 3, 16)
    with pytest.raises(ValueError, match="ep_rank=4"):
        home_range(4, 4, 16)


@pytest.mark.parametrize("R,G", [(1, 1), (2, 3), (4, 2), (3, 5)])
def test_source_to_expert_major_matches_loop(R, G):
    g = torch.Generator().manual_seed(R * 10 + G)
    counts = torch.randint(0, 4, (R, G), generator=g)
    counts[0, 0] = 0  # empty blocks must be skipped
    ix = source_to_expert_major(counts)
    assert torch.equal(ix, source_to_expert_major_reference(counts))
    assert torch.equal(torch.sort(ix).values, torch.arange(int(counts.sum())))  # a permutation


def test_alltoall_layout_end_to_end_in_one_process():
    """R simulated ranks (one with no tokens): sort, count exchange, token exchange, expert-major grouping, grouped
    compute on home shards, return trip and mix equal each rank's local MoE output."""
    R, E, K = 4, 8, 2
    Ns = [5, 0, 7, 3]
    zs, idxs, ws = _routing(R, Ns, E, K, skew=0.0, seed=1)
    full = expert_bank(E, L, H)
    homes = [EPGroupedExperts(full, None, r, R) for r in range(R)]
    lay = [alltoall_send_layout(idx, E, R) for idx in idxs]  # (order, counts [R_dst, G], send [R_dst])
    assert [int(c.sum()) for _, c, _ in lay] == [n * K for n in Ns]
    recv_counts = [torch.stack([lay[s][1][d] for s in range(R)]) for d in range(R)]  # the counts all_to_all
    send_splits = [lay[s][2].tolist() for s in range(R)]
    arrived = _exchange([permute_rows(zs[s], send_positions(lay[s][0], idxs[s].shape)) for s in range(R)], send_splits)
    outs = []
    for d in range(R):
        em = source_to_expert_major(recv_counts[d])
        grouped = arrived[d][em]
        # Each row of the grouped buffer is the latent of a token routed to the expert of its group.
        src_tok = torch.cat(
            [torch.cat([zs[s][(idxs[s] == e).any(1)] for s in range(R)]) for e in range(*home_range(d, R, E))]
        )
        assert torch.equal(grouped, src_tok)
        y = homes[d](grouped, recv_counts[d].sum(0))
        inv = torch.empty_like(em)
        inv[em] = torch.arange(em.numel())
        outs.append(y[inv])
    recv_splits = [recv_counts[d].sum(1).tolist() for d in range(R)]
    back = _exchange(outs, recv_splits)
    for s in range(R):
        u = unpermute(back[s], ws[s], send_positions(lay[s][0], ws[s].shape))
        if Ns[s] == 0:
            assert u.shape == (0, L)
            continue
        torch.testing.assert_close(u, _local_reference(full, zs[s], idxs[s], ws[s]), rtol=1e-5, atol=1e-6)


def test_moonep_layout_end_to_end_in_one_process():
    """MoonEP by hand on a skewed batch: every simulated rank receives exactly S·K rows, grouped by expert; hosted
    weights routed from their home equal the full bank's rows; the mixed outputs equal the local MoE."""
    R, E, K, S = 4, 16, 4, 6
    zs, idxs, ws = _routing(R, [S] * R, E, K, skew=2.0, seed=3)
    full = expert_bank(E, L, H, seed=5)
    G = E // R
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in idxs])
    plan = make_plan(counts, S * K)
    assert plan.replicas.shape[0] > 0, "the skewed batch should need redundant experts"
    assert int(counts.sum(0).view(R, G).sum(1).max()) > S * K  # without replication some rank would overflow

    # Weights: home rank h sends packed rows of its experts; receiver d gets its hosted experts in ascending order.
    packed = torch.cat([full.w1.flatten(1), full.w3.flatten(1), full.w2.flatten(1)], 1).detach()
    routes = [hosted_weight_routes(plan, r) for r in range(R)]
    got = _exchange([packed[h * G : (h + 1) * G][routes[h][0]] for h in range(R)], [rt[1].tolist() for rt in routes])
    for d in range(R):
        hosted = routes[d][2]
        assert torch.equal(got[d], packed[hosted])
        assert torch.equal(routes[d][3], torch.bincount(hosted // G, minlength=R))
        assert hosted.numel() <= G

    lay = [moonep_send_layout(plan, s, idxs[s]) for s in range(R)]
    for s in range(R):  # destination counts agree with the plan's send matrix
        assert torch.equal(torch.bincount(lay[s][1], minlength=R), plan.send_matrix(s).sum(1))
    arrived = _exchange(
        [permute_rows(zs[s], send_positions(lay[s][0], idxs[s].shape)) for s in range(R)],
        [lay[s][2].tolist() for s in range(R)],
    )
    outs = []
    for d in range(R):
        assert arrived[d].shape[0] == S * K  # the static receive buffer
        em = plan.expert_major_index(d)
        grouped = arrived[d][em]
        present = torch.nonzero(plan.alloc[:, d]).squeeze(1)
        home = torch.arange(d * G, (d + 1) * G)
        assert set(present.tolist()) <= set(home.tolist()) | set(routes[d][2].tolist())
        # Hosted experts come from one group, so the home rows are one contiguous range of the buffer.
        hosted = routes[d][2]
        assert bool((hosted < d * G).all()) or bool((hosted >= (d + 1) * G).all())
        ex = GroupedExperts(present.numel(), L, H, 4.0, 25.0)
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                getattr(ex, name).copy_(getattr(full, name)[present])
        y = ex(grouped, plan.alloc[present, d])
        inv = torch.empty_like(em)
        inv[em] = torch.arange(em.numel())
        outs.append(y[inv])
    back = _exchange(outs, [plan.recv_splits(d) for d in range(R)])
    for s in range(R):
        u = unpermute(back[s], ws[s], send_positions(lay[s][0], ws[s].shape))
        torch.testing.assert_close(u, _local_reference(full, zs[s], idxs[s], ws[s]), rtol=1e-5, atol=1e-6)


def test_home_shards_load_full_and_local_tensors():
    E, R = 8, 4
    full = expert_bank(E, L, H, seed=1)
    other = expert_bank(E, L, H, seed=2)
    sd = {k: v.detach().clone() for k, v in full.state_dict().items()}
    shards = []
    for r in range(R):
        ep = EPGroupedExperts(other, None, r, R)
        assert ep.w1.shape == (E // R, L, H) and ep.w2.shape == (E // R, H, L)
        ep.load_state_dict(sd)  # a full [E, ...] tensor: the home rows are kept
        shards.append(ep)
        lo, hi = home_range(r, R, E)
        for name in ("w1", "w3", "w2"):
            assert torch.equal(getattr(ep, name), sd[name][lo:hi])
            assert expert_parameters(ep)[name] == (lo, E)
    for name in ("w1", "w3", "w2"):  # unsharding: the shards concatenate to the full tensor
        assert torch.equal(torch.cat([getattr(s, name) for s in shards]), sd[name])
    # A local shard loads as is; a tensor of another expert count is refused by load_state_dict.
    ep = EPGroupedExperts(other, None, 1, R)
    ep.load_state_dict({k: v[2:4] for k, v in sd.items()})
    assert torch.equal(ep.w3, sd["w3"][2:4])
    with pytest.raises(RuntimeError, match="size mismatch"):
        ep.load_state_dict({k: v[:3] for k, v in sd.items()})
    # The home shard computes what the full bank computes for rows of those experts.
    x = torch.randn(6, L)
    counts = torch.tensor([2, 0, 4, 0, 0, 0, 0, 0])
    torch.testing.assert_close(shards[0](x[:2], counts[:2]), full(x, counts)[:2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(shards[1](x[2:], counts[2:4]), full(x, counts)[2:], rtol=1e-6, atol=1e-6)


def test_home_experts_compute_with_given_weights():
    """`compute` with hosted weight stacks is what the full bank computes for those experts' rows."""
    full = expert_bank(4, L, H, seed=3)
    ep = EPGroupedExperts(full, None, 0, 2)  # home experts 0, 1
    x = torch.randn(5, L)
    hosted = [getattr(full, n)[2:4] for n in ("w1", "w3", "w2")]
    torch.testing.assert_close(
        ep.compute(x, torch.tensor([3, 2]), *hosted), full(x, torch.tensor([0, 0, 3, 2])), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(ep(x, torch.tensor([1, 4])), full(x, torch.tensor([1, 4, 0, 0])), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="counts"):
        ep(x, torch.tensor([1, 2, 2]))


def test_moonep_refuses_budget_it_cannot_meet():
    full = expert_bank(8, L, H)
    ep = EPGroupedExperts(full, None, 0, 2)
    d = MoonEPDispatcher(None, 0, 2, ep)
    z, idx = torch.randn(3, L), torch.tensor([[0, 1], [2, 3], [4, 5]])
    d._gather_counts = lambda c: torch.stack([c, torch.bincount(torch.tensor([0, 1, 6, 7]), minlength=8)])
    with pytest.raises(ValueError, match=r"route \[6, 4\] rows \(K=2\)"):
        d.dispatch(z, idx, 8)
    d.tokens_per_rank = 4
    with pytest.raises(ValueError, match=r"tokens_per_rank=4 \(S·K = 8 rows.*\[6, 4\]"):
        d.dispatch(z, idx, 8)
    with pytest.raises(ValueError, match="EPGroupedExperts"):
        MoonEPDispatcher(None, 0, 2, full)
    with pytest.raises(ValueError, match="tokens_per_rank"):
        MoonEPDispatcher(None, 0, 2, ep, tokens_per_rank=0)


def test_apply_refusals_without_a_process_group():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="ep_dispatcher must be one of"):
        apply_expert_parallel(model, None, "ring")
    with pytest.raises(ValueError, match="moonep"):
        apply_expert_parallel(model, None, "alltoall", tokens_per_rank=4)
    if not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="process group"):
            apply_expert_parallel(model, None, "alltoall")


def test_comm_stats_bytes_per_route():
    a = CommStats(routes=10, dispatch_bytes=10 * 3584 * 2)
    b = CommStats(routes=6, dispatch_bytes=6 * 3584 * 2, weight_bytes=5)
    a.add(b)
    assert a.bytes_per_route == 3584 * 2  # bf16 latent: half of a 7168-wide payload
    assert a.weight_bytes == 5 and a.routes == 16
    a = CommStats()  # a dispatcher's view starts empty
    assert a.routes == 0 and a.bytes_per_route == 0


def test_home_experts_built_on_meta_equal_the_full_models_rows():
    # The engine applies EP before materialising a stage: only the home rows exist, and init_weights (one seed per
    # expert) gives them the full model's values; every other parameter is unchanged.
    from k3train.models.k3.model import K3Model

    args = get_preset("tiny")
    full = K3Model(args)
    full.init_weights(3)
    with torch.device("meta"):
        m = K3Model(args)
    for moe in [x for x in m.modules() if isinstance(x, LatentMoE)]:
        moe.experts = EPGroupedExperts(moe.experts, None, 1, 4)  # rank 1 of 4: experts [2, 4) of 8
    m.to_empty(device="cpu")
    m.init_weights(3)
    blocks = expert_parameters(m)
    n_expert = 0
    for name, p in m.named_parameters():
        ref = full.get_parameter(name)
        if ".experts." in name:
            n_expert += 1
            assert blocks[name] == (2, 8) and p.shape[0] == 2
            assert torch.equal(p, ref[2:4]), name
        else:
            assert torch.equal(p, ref), name
    assert n_expert == 3 * sum(isinstance(x, LatentMoE) for x in m.modules())
