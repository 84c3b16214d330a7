"""Dynamic vision context parallelism: each CP rank encodes whole images, and every visual token goes to the rank
that holds its position.

Under CP every rank of the group holds the same global rows and runs its own pieces of them. Encoding every image on
every rank would repeat the tower's work cp times; encoding the images that fall in one's own pieces would leave the
rank holding a large image (or many) with most of the work, and an image can straddle pieces. Instead:

1. Assign. Each item (an image, or a clip: its frames attend to each other, so a clip stays whole on one rank) gets
   an estimated cost (`item_costs`), and the items go largest first to the least-loaded rank (ties: the lower rank).
   The assignment reads only the grid, so every rank computes the same one without communication; `assign_items`
   also returns the ranks' loads (their max / mean is the balance the run reports).
2. Encode. A rank runs the tower on the patches of its own items only.
3. Scatter. The visual tokens are the rows of the items in item order, and visual token j sits at the j-th marked
   position of vision_mask (row-major over the global [B, T]). Each rank sends each of its tokens to the rank whose
   pieces hold that position: one uneven all-to-all (comm.all_to_all_rows, counted as cp/vision_tokens); its
   backward returns each token's gradient to the rank that encoded it. The received rows are put in the order of
   the rank's own marked positions, which is what K3Model.embed scatters them into.
4. The tower is replicated over cp like every dense parameter, so the usual gradient reduction over dp x cp sums
   the gradients of all items.

Cost of an item of t frames of h x w patches (multiply-adds, per tower layer): the projections and the MLP,
t*h*w*(8*width*heads*head_dim + 3*width*mlp_hidden); spatial attention t*(h*w)^2*2*heads*head_dim; temporal
attention h*w*t^2*2*heads*head_dim. Memory: each rank holds the pixels of the micro-batch's items (all ranks read the
same rows) but the tower activations of its own items only, and [tokens at its positions, D] after the scatter.
"""

from __future__ import annotations

import torch

from k3train.models.k3.args import VisionArgs
from k3train.distributed import comm


def item_costs(args: VisionArgs, grid: list[tuple[int, int, int]]) -> list[float]:
    """Estimated tower multiply-adds of each (frames, patch rows, patch columns) item (see the module docstring)."""
    hd = args.heads * args.head_dim
    linear = 8 * args.width * hd + 3 * args.width * args.mlp_hidden
    return [
        float(args.layers * (t * h * w * linear + t * (h * w) ** 2 * 2 * hd + h * w * t * t * 2 * hd))
        for t, h, w in grid
    ]


def assign_items(costs: list[float], world: int) -> tuple[list[int], list[float]]:
    """(owner rank of each item, each rank's summed cost): largest first onto the least-loaded rank."""
    owners, loads = [0] * len(costs), [0.0] * world
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):  # a loop over images, not tokens
        r = min(range(world), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += costs[i]
    return owners, loads


def balance(loads: list[float]) -> float:
    """max / mean of the ranks' loads (1.0 is even)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def position_owners(seq, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For every position of the global [batch, T] (flattened): the CP rank whose pieces hold it, and its index in
    that rank's local rows flattened ([batch * pieces_per_rank, piece_len] row-major)."""
    T = seq.seq_len
    flat = torch.arange(batch * T).view(batch, T)
    rank_of, local = torch.empty(batch * T, dtype=torch.long), torch.empty(batch * T, dtype=torch.long)
    for r in range(seq.world):  # a loop over CP ranks
        idx = seq.rows(seq.shard(flat, r, 1)).reshape(-1)
        rank_of[idx] = r
        local[idx] = torch.arange(idx.numel())
    return rank_of, local


def encode_images(
    cp, tower: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(visual tokens at this rank's positions [n_local, D] in local row-major order, this rank's vision mask in the
    model's local layout, the assignment's max/mean load) for one micro-batch's items. cp: the batch's
    ContextParallel handle; pixels, grid: every item of the global rows (patchify's packing); mask [B, T]: the
    global rows' visual positions."""
    args: VisionArgs = tower.args
    B, T = mask.shape
    dev = pixels.device
    items = [tuple(int(v) for v in row) for row in grid.tolist()]
    owners, loads = assign_items(item_costs(args, items), cp.world)
    owner_t = torch.tensor(owners, dtype=torch.long, device=dev)
    patches = grid.prod(1).to(dev)
    tokens_per_item = patches // args.merge**2
    mine = owner_t == cp.rank
    if bool(mine.any()):
        own_rows = mine.repeat_interleave(patches)
        tokens, _ = tower(pixels[own_rows], grid[mine.to(grid.device)])
    else:  # still part of the autograd graph, so this rank joins the backward all-to-all
        tokens = pixels.new_zeros(0, tower.out_dim, requires_grad=True)

    pos = mask.reshape(-1).nonzero().squeeze(1).cpu()
    if pos.numel() != int(tokens_per_item.sum()):
        raise ValueError(f"vision_mask marks {pos.numel()} positions for {int(tokens_per_item.sum())} visual tokens")
    rank_of, local = position_owners(cp.seq, B)
    token_owner = owner_t.cpu().repeat_interleave(tokens_per_item.cpu())  # who encodes visual token j
    dest = rank_of[pos]  # who holds its position
    mine_j = (token_owner == cp.rank).nonzero().squeeze(1)
    send_order = torch.sort(dest[mine_j], stable=True).indices
    in_splits = torch.bincount(dest[mine_j], minlength=cp.world).tolist()
    recv_j = (dest == cp.rank).nonzero().squeeze(1)
    recv_j = recv_j[torch.sort(token_owner[recv_j], stable=True).indices]  # arrive source-major, then by j
    out_splits = torch.bincount(token_owner[recv_j], minlength=cp.world).tolist()
    send = tokens[send_order.to(dev)]
    if cp.world > 1:
        recv = comm.all_to_all_rows(
            send, out_splits, in_splits, cp.group, "cp", what="vision_tokens", grad_what="vision_token_grads"
        )
    else:
        recv = send
    local_order = torch.argsort(local[pos[recv_j]])
    return recv[local_order.to(dev)], cp.shard_rows(mask), balance(loads)
