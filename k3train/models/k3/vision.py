"""MoonViT-V2: a native-resolution vision tower with factorised space-time attention, and its projector.

Data path, for each item (an image is a clip of one frame):
  pixels [T, 3, H, W] -> 14x14 patches -> bias-free Linear(588 -> 1024)
  + learned 2-D position table (pos_grid x pos_grid x width), bicubically resized to the item's h x w patch grid
  + learned temporal row t for frame t (clips longer than max_frames are rejected; cut them before the tower)
  -> `layers` pre-norm layers, each:  x += SpatialAttn(norm(x))   among the patches of one frame
                                      x += TemporalAttn(norm(x))  among one patch position across the frames
                                      x += SwiGLU(norm(x))
  -> final RMSNorm without a learned scale (the projector's LayerNorm right after carries the affine part)
  -> 2x2 pixel shuffle: merge x merge neighbouring patches of a frame -> one token of width * merge^2 = 4096
  -> projector LayerNorm(4096) + Linear(4096, 4096) + GELU + Linear(4096, out_dim), with biases.

Parameter count of the released shape (K3 report: tower 401,202,176; tower + projector 447,358,976):
  patch embedding   588 x 1024                                      =     602,112
  position table    64 x 64 x 1024                                  =   4,194,304
  temporal rows     16 x 1024                                       =      16,384
  per layer         3 RMSNorm weights                 3 x 1024      =       3,072
                    spatial attention  q,k,v,o   4 x 1024 x (12 x 64) =   3,145,728
                    temporal attention q,k,v,o   4 x 1024 x (12 x 64) =   3,145,728
                    SwiGLU gate, up, down        3 x 1024 x 2730    =   8,386,560
                    layer total                                     =  14,681,088  (x 27 = 396,389,376)
  tower                                                             = 401,202,176
  projector  LayerNorm 2 x 4096 + 4096 x 4096 + 4096 + 4096 x 7168 + 7168 = 46,156,800
Every weight is bias-free except the projector. The MLP hidden width 2730 = floor(2/3 x 4096) is the usual
SwiGLU width that spends the parameters of a 4096-wide plain GELU MLP. The two attentions have their own
projections (spatial and temporal mixing learn different things and cost the same).

Layout. All items' patches live in one packed tensor [L, width], item by item, frame by frame, and inside a frame
in merge-block order (merge-row, merge-column, then the merge x merge patches of that block row-major). Attention
is order-free inside a sequence (positions are added, not rotated), so this order costs nothing and makes the
pixel shuffle a reshape. Attention gathers the packed rows into padded sequences (frames for spatial, patch
positions for temporal) and runs one scaled_dot_product_attention per kind, with a key-padding mask only when
the lengths differ. `moonvit_reference` recomputes everything item by item with explicit loops, as a check.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k3train.ops.dtypes import wide
from k3train.models.k3.args import VisionArgs
from k3train.models.structure import MatrixStructure


def seeded_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (seed, a parameter's name): initial values independent of device and layout (the
    init of the decoder, k3train.models.k3.model, and of this tower)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


# ---- inputs ---------------------------------------------------------------------------------------------------
def check_grid(args: VisionArgs, grid_thw) -> list[tuple[int, int, int]]:
    """grid_thw [N, 3] (frames, patch rows, patch columns) as a list of int triples; ValueError if unsupported."""
    g = torch.as_tensor(grid_thw)
    if g.dim() != 2 or g.shape[1] != 3 or g.shape[0] == 0:
        raise ValueError(f"grid_thw must have shape [N, 3] with N >= 1, got {tuple(g.shape)}")
    if g.is_floating_point():
        raise ValueError("grid_thw must hold integers")
    out = [tuple(int(v) for v in row) for row in g.tolist()]
    max_side = args.max_image_side // args.patch_size
    for i, (t, h, w) in enumerate(out):
        if t < 1 or t > args.max_frames:
            raise ValueError(f"item {i}: {t} frames; MoonViT takes 1..max_frames={args.max_frames} frames per item")
        for name, n in (("height", h), ("width", w)):
            if n < 1 or n % args.merge:
                raise ValueError(f"item {i}: patch-grid {name} {n} must be a positive multiple of merge={args.merge}")
            if n > max_side:
                raise ValueError(
                    f"item {i}: image {name} {n * args.patch_size} px exceeds max_image_side={args.max_image_side}"
                )
    return out


def patchify(args: VisionArgs, pixels: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [C, H, W] / [1, C, H, W] and clips [T, C, H, W] -> (packed patches [L, C*p*p], grid_thw [N, 3]).

    Patches are flattened (channel, row, column) and packed in merge-block order (see the module docstring).
    """
    p, m, C = args.patch_size, args.merge, args.in_channels
    if isinstance(pixels, torch.Tensor) or len(pixels) == 0:
        raise ValueError("pixels must be a non-empty list of [T, C, H, W] tensors (or a packed [L, C*p*p] tensor)")
    rows, grids = [], []
    for i, x in enumerate(pixels):
        if x.dim() == 3:
            x = x.unsqueeze(0)
        if x.dim() != 4:
            raise ValueError(f"item {i}: expected [T, C, H, W] (or [C, H, W]), got shape {tuple(x.shape)}")
        T, c, H, W = x.shape
        if c != C:
            raise ValueError(f"item {i}: {c} channels, expected in_channels={C} (shape {tuple(x.shape)})")
        for name, side in (("height", H), ("width", W)):
            if side % (p * m):
                raise ValueError(f"item {i}: image {name} {side} px is not a multiple of patch_size*merge={p * m}")
            if side > args.max_image_side:
                raise ValueError(f"item {i}: image {name} {side} px exceeds max_image_side={args.max_image_side}")
        hb, wb = H // (p * m), W // (p * m)
        x = x.reshape(T, C, hb, m, p, wb, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)  # T, hb, wb, mh, mw, C, p, p
        rows.append(x.reshape(-1, C * p * p))
        grids.append((T, H // p, W // p))
    return torch.cat(rows), torch.tensor(grids, dtype=torch.long)


# ---- attention plan ------------------------------------------------------------------------------------------
@dataclass
class AttnGroups:
    """Packed rows arranged as padded sequences for one attention kind."""

    index: torch.Tensor
    """[B, Lmax] packed row held by each slot (0 at padding)."""
    mask: torch.Tensor | None
    """[B, 1, 1, Lmax] key-padding mask for SDPA; None when every sequence has length Lmax."""
    unpad: torch.Tensor
    """[L] flat slot (in B*Lmax) holding each packed row, in packed order: scatters results back."""


def _groups(starts: torch.Tensor, lengths: torch.Tensor, stride: torch.Tensor, total: int) -> AttnGroups:
    lmax = int(lengths.max())
    ar = torch.arange(lmax, device=starts.device)
    valid = ar[None, :] < lengths[:, None]
    index = torch.where(valid, starts[:, None] + ar[None, :] * stride[:, None], 0)
    unpad = torch.empty(total, dtype=torch.long, device=starts.device)
    unpad[index[valid]] = valid.flatten().nonzero().squeeze(1)
    mask = None if bool(valid.all()) else valid[:, None, None, :]
    return AttnGroups(index, mask, unpad)


def attention_plan(grid: list[tuple[int, int, int]], device) -> tuple[AttnGroups, AttnGroups | None]:
    """(spatial groups: one sequence per frame, temporal groups: one per item and patch position).

    Temporal is None when every item has one frame: attention over one key returns its value, so no SDPA is run.
    """
    g = torch.tensor(grid, dtype=torch.long, device=device)
    T, S = g[:, 0], g[:, 1] * g[:, 2]
    sizes = T * S
    offset = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    items = torch.arange(len(grid), device=device)
    # spatial: frame f of item i starts at offset_i + t * S_i, S_i contiguous rows
    item_f = torch.repeat_interleave(items, T)
    t_f = torch.arange(int(T.sum()), device=device) - torch.repeat_interleave(torch.cumsum(T, 0) - T, T)
    spatial = _groups(offset[item_f] + t_f * S[item_f], S[item_f], torch.ones_like(item_f), total)
    if int(T.max()) == 1:
        return spatial, None
    # temporal: position s of item i is at offset_i + s + t * S_i for t < T_i
    item_p = torch.repeat_interleave(items, S)
    s_p = torch.arange(int(S.sum()), device=device) - torch.repeat_interleave(torch.cumsum(S, 0) - S, S)
    temporal = _groups(offset[item_p] + s_p, T[item_p], S[item_p], total)
    return spatial, temporal


# ---- modules -------------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Bias-free multi-head softmax attention over padded groups of packed rows."""

    def __init__(self, width: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.wqkv = nn.Linear(width, 3 * heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, width, bias=False)

    def forward(self, x: torch.Tensor, groups: AttnGroups | None) -> torch.Tensor:
        inner = self.heads * self.head_dim
        if groups is None:  # every sequence has one element: softmax over one key is 1, so the output is v
            return self.wo(F.linear(x, self.wqkv.weight[2 * inner :]))
        B, Lmax = groups.index.shape
        qkv = self.wqkv(x)[groups.index].view(B, Lmax, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=groups.mask)
        o = o.transpose(1, 2).reshape(B * Lmax, inner)[groups.unpad]
        return self.wo(o)

    def muon_structure(self) -> dict[str, MatrixStructure]:
        return {
            "wqkv.weight": MatrixStructure("rows", 3 * self.heads),
            "wo.weight": MatrixStructure("cols", self.heads),
        }


class SwiGLU(nn.Module):
    """out = W_out (silu(gate) * up), with [gate; up] = W_in x stacked in one matmul."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.w_in = nn.Linear(width, 2 * hidden, bias=False)
        self.w_out = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(F.silu(gate) * up)

    def muon_structure(self) -> dict[str, MatrixStructure]:
        return {"w_in.weight": MatrixStructure("rows", 2), "w_out.weight": MatrixStructure()}


class VisionLayer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        w = args.width
        self.spatial_norm = nn.RMSNorm(w, eps=args.norm_eps)
        self.spatial_attn = Attention(w, args.heads, args.head_dim)
        self.temporal_norm = nn.RMSNorm(w, eps=args.norm_eps)
        self.temporal_attn = Attention(w, args.heads, args.head_dim)
        self.mlp_norm = nn.RMSNorm(w, eps=args.norm_eps)
        self.mlp = SwiGLU(w, args.mlp_hidden)

    def forward(self, x: torch.Tensor, spatial: AttnGroups, temporal: AttnGroups | None) -> torch.Tensor:
        x = x + self.spatial_attn(self.spatial_norm(x), spatial)
        x = x + self.temporal_attn(self.temporal_norm(x), temporal)
        return x + self.mlp(self.mlp_norm(x))


class Projector(nn.Module):
    """LayerNorm + Linear + GELU + Linear (with biases) from merged patches into the decoder stream."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(in_dim, eps=eps)
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))

    def muon_structure(self) -> dict[str, MatrixStructure]:
        return {"fc1.weight": MatrixStructure(), "fc2.weight": MatrixStructure()}


class MoonViT(nn.Module):
    """Vision tower + projector. forward(pixels, grid_thw) -> (tokens [sum of counts, out_dim], counts [N])."""

    def __init__(self, args: VisionArgs, out_dim: int):
        super().__init__()
        for f in dataclasses.fields(args):  # every integer field is a size or a count
            v = getattr(args, f.name)
            if f.type == "int" and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"vision.{f.name} must be a positive integer, got {v!r}")
        if out_dim <= 0:
            raise ValueError(f"out_dim must be positive, got {out_dim}")
        self.args, self.out_dim = args, out_dim
        w, p = args.width, args.patch_size
        self.patch_embed = nn.Linear(args.in_channels * p * p, w, bias=False)
        self.pos_embed = nn.Parameter(torch.empty(args.pos_grid, args.pos_grid, w))
        self.temporal_embed = nn.Parameter(torch.empty(args.max_frames, w))
        self.layers = nn.ModuleList(VisionLayer(args) for _ in range(args.layers))
        self.final_norm = nn.RMSNorm(w, eps=args.norm_eps, elementwise_affine=False)
        self.projector = Projector(w * args.merge**2, args.projector_hidden, out_dim, args.norm_eps)
        if not self.pos_embed.is_meta:
            self.init_weights(0)

    # -- positions
    def grid_positions(self, h: int, w: int) -> torch.Tensor:
        """The position table resized to an h x w patch grid, rows in merge-block order: [h*w, width]."""
        m, P = self.args.merge, self.args.pos_grid
        table = self.pos_embed.permute(2, 0, 1).unsqueeze(0)  # [1, width, P, P]
        if (h, w) != (P, P):  # bicubic in fp32 (low-precision CPU kernels are missing or coarse)
            table = F.interpolate(table.to(wide(table.dtype)), size=(h, w), mode="bicubic", align_corners=False)
        table = table[0].to(self.pos_embed.dtype)
        return table.reshape(-1, h // m, m, w // m, m).permute(1, 3, 2, 4, 0).reshape(h * w, -1)

    def positions(self, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        """Spatial + temporal position rows for the whole packed batch: [L, width]."""
        cache: dict[tuple[int, int], torch.Tensor] = {}
        out = []
        for t, h, w in grid:  # a loop over items; resizing is per grid shape
            if (h, w) not in cache:
                cache[(h, w)] = self.grid_positions(h, w)
            out.append((cache[(h, w)][None] + self.temporal_embed[:t, None]).reshape(t * h * w, -1))
        return torch.cat(out)

    # -- forward
    def forward(self, pixels, grid_thw=None) -> tuple[torch.Tensor, torch.Tensor]:
        """pixels: a list of [T, C, H, W] tensors (an image may be [C, H, W]); grid_thw optional, checked if given.
        Or pixels: packed patches [L, C*p*p] in the order `patchify` makes, with grid_thw [N, 3] required.
        Returns visual tokens [sum(counts), out_dim] in item, frame, merge-row, merge-column order and
        counts [N] (tokens per item, = T * h * w / merge^2)."""
        a = self.args
        if isinstance(pixels, torch.Tensor):
            if grid_thw is None:
                raise ValueError("packed patch input needs grid_thw [N, 3]")
            patches, grid = pixels, check_grid(a, grid_thw)
            need = a.in_channels * a.patch_size**2
            if patches.dim() != 2 or patches.shape[1] != need:
                raise ValueError(
                    f"packed patches must be [L, in_channels*patch_size^2 = {need}], got shape {tuple(patches.shape)}"
                )
            if patches.shape[0] != sum(t * h * w for t, h, w in grid):
                raise ValueError(
                    f"packed patches have {patches.shape[0]} rows but grid_thw describes "
                    f"{sum(t * h * w for t, h, w in grid)}"
                )
        else:
            patches, g = patchify(a, pixels)
            grid = check_grid(a, g)
            if grid_thw is not None and check_grid(a, grid_thw) != grid:
                raise ValueError(f"grid_thw {check_grid(a, grid_thw)} does not match the pixels' grid {grid}")
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype)) + self.positions(grid)
        spatial, temporal = attention_plan(grid, x.device)
        for layer in self.layers:
            x = layer(x, spatial, temporal)
        x = self.final_norm(x)
        tokens = self.projector(x.reshape(-1, a.width * a.merge**2))  # merge-block order: shuffle is a reshape
        counts = torch.tensor([t * h * w // a.merge**2 for t, h, w in grid], dtype=torch.long, device=x.device)
        return tokens, counts

    # -- init and optimizer facts
    def init_weights(self, seed: int = 0, *, prefix: str = "vision.") -> None:
        """Every parameter from a CPU generator seeded by (seed, prefix + its name), so values do not depend on the
        device or the parallel layout. Norm scales 1, biases 0, residual-writing projections N(0, 0.02/sqrt(2L)),
        the rest (tables included) N(0, 0.02). The module has no buffers."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.args.layers)
        for name, p in self.named_parameters():
            gen = seeded_generator(seed, prefix + name)
            if name.endswith("norm.weight"):
                val = torch.ones(p.shape)
            elif name.endswith(".bias"):
                val = torch.zeros(p.shape)
            else:
                s = out_std if name.endswith(("wo.weight", "w_out.weight")) else std
                val = torch.empty(p.shape).normal_(0.0, s, generator=gen)
            with torch.no_grad():
                p.copy_(val.to(p.dtype))

    def muon_structure(self) -> dict[str, MatrixStructure]:
        return {"patch_embed.weight": MatrixStructure()}


# ---- slow reference --------------------------------------------------------------------------------------------
def moonvit_reference(model: MoonViT, pixels: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same function as MoonViT.forward, item by item and frame by frame with explicit loops and softmax:
    patches cut one by one in row-major grid order, attention as softmax(q k^T / sqrt(d)) v per sequence and head,
    the 2x2 merge by indexing. Slow; for tests on tiny shapes."""
    a = model.args
    p, m, H, d = a.patch_size, a.merge, a.heads, a.head_dim

    def attend(attn: Attention, x: torch.Tensor) -> torch.Tensor:  # x [n, width], one sequence
        q, k, v = attn.wqkv(x).split(H * d, dim=-1)
        heads = []
        for h in range(H):
            sl = slice(h * d, (h + 1) * d)
            w = torch.softmax(q[:, sl] @ k[:, sl].T / math.sqrt(d), dim=-1)
            heads.append(w @ v[:, sl])
        return attn.wo(torch.cat(heads, dim=-1))

    outs, counts = [], []
    for clip in pixels:
        clip = clip.unsqueeze(0) if clip.dim() == 3 else clip
        T, C, Hpx, Wpx = clip.shape
        gh, gw = Hpx // p, Wpx // p
        cut = [
            clip[t, :, i * p : (i + 1) * p, j * p : (j + 1) * p].flatten()
            for t in range(T)
            for i in range(gh)
            for j in range(gw)
        ]
        x = model.patch_embed(torch.stack(cut).view(T, gh, gw, -1))  # [T, gh, gw, width]
        table = model.pos_embed.permute(2, 0, 1)[None].to(wide(model.pos_embed.dtype))
        if (gh, gw) != (a.pos_grid, a.pos_grid):
            table = F.interpolate(table, size=(gh, gw), mode="bicubic", align_corners=False)
        x = x + table[0].permute(1, 2, 0) + model.temporal_embed[:T, None, None, :]
        for layer in model.layers:
            y = layer.spatial_norm(x)
            x = x + torch.stack(
                [attend(layer.spatial_attn, y[t].reshape(gh * gw, -1)).reshape(gh, gw, -1) for t in range(T)]
            )
            y = layer.temporal_norm(x)
            upd = torch.zeros_like(x)
            for i in range(gh):
                for j in range(gw):
                    upd[:, i, j] = attend(layer.temporal_attn, y[:, i, j])
            x = x + upd
            x = x + layer.mlp(layer.mlp_norm(x))
        x = model.final_norm(x)
        merged = [
            torch.cat([x[t, bi * m + di, bj * m + dj] for di in range(m) for dj in range(m)])
            for t in range(T)
            for bi in range(gh // m)
            for bj in range(gw // m)
        ]
        outs.append(model.projector(torch.stack(merged)))
        counts.append(len(merged))
    return torch.cat(outs), torch.tensor(counts, dtype=torch.long)
