"""MoonViT-V2: shapes, fast path vs the loop reference, factorised attention, exact parameter count, errors."""

from __future__ import annotations

import pytest
import torch

from k3train.models.k3.args import VisionArgs, tiny_vision_args
from k3train.models.k3.vision import MoonViT, moonvit_reference, patchify

OUT = 24


def _model(seed: int = 0) -> MoonViT:
    """A tiny tower with weights large enough that attention is far from uniform."""
    torch.manual_seed(seed)
    m = MoonViT(tiny_vision_args(), OUT)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name in ("pos_embed", "temporal_embed"):
                p.normal_(0.0, 0.5)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif name.endswith("weight"):  # norm scales
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    return m


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(1, 3, 16, 24, generator=g)  # 4 x 6 patches -> 2 x 3 tokens
    vid = torch.randn(2, 3, 8, 16, generator=g)  # 2 frames of 2 x 4 patches -> 2 x (1 x 2) tokens
    return img, vid


def test_shapes_and_counts():
    m = _model()
    img, vid = _inputs()
    tokens, counts = m([img, vid])
    assert tokens.shape == (6 + 4, OUT)
    assert counts.tolist() == [6, 4]
    assert torch.isfinite(tokens).all()
    tokens, counts = m([vid[0]])  # a bare [C, H, W] image
    assert tokens.shape == (2, OUT) and counts.tolist() == [2]


def test_fast_path_matches_reference_values_and_grads():
    m = _model()
    img, vid = _inputs()
    big = torch.randn(1, 3, 32, 32)  # exactly the 8 x 8 position table, no resize
    items = [img, vid, big]
    fast, c_fast = m(items)
    ref, c_ref = moonvit_reference(m, items)
    assert c_fast.tolist() == c_ref.tolist() == [6, 4, 16]
    assert fast.abs().max() > 0.1  # the comparison below is not between near-zero tensors
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)

    w = torch.randn_like(fast)
    g_fast = torch.autograd.grad((fast * w).sum(), list(m.parameters()))
    g_ref = torch.autograd.grad((ref * w).sum(), list(m.parameters()))
    for (name, _), a, b in zip(m.named_parameters(), g_fast, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda s: f"{name}: {s}")
    # the temporal path's q/k only matter for clips; here the video makes them receive gradient
    assert g_fast[[n for n, _ in m.named_parameters()].index("layers.0.temporal_attn.wqkv.weight")].abs().max() > 0


def test_images_only_batch_matches_reference():
    m = _model()
    img, _ = _inputs()
    other = torch.randn(1, 3, 8, 40)  # 2 x 10 patches, a wide aspect ratio
    fast, _ = m([img, other])
    ref, _ = moonvit_reference(m, [img, other])
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_packed_patch_input_matches_list_input():
    m = _model()
    img, vid = _inputs()
    patches, grid = patchify(m.args, [img, vid])
    assert grid.tolist() == [[1, 4, 6], [2, 2, 4]]
    assert patches.shape == (24 + 16, 3 * 4 * 4)
    a, ca = m([img, vid])
    b, cb = m(patches, grid)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ca.tolist() == cb.tolist()


def test_temporal_attention_is_the_only_path_between_frames():
    m = _model()
    _, vid = _inputs()
    vid2 = vid.clone()
    vid2[1] = torch.randn_like(vid2[1])  # change frame 2 only
    first = slice(0, 2)  # frame 1's tokens (1 x 2 per frame)
    a, _ = m([vid])
    b, _ = m([vid2])
    assert (a[first] - b[first]).abs().max() > 1e-3  # frame 2 reaches frame 1
    with torch.no_grad():
        for layer in m.layers:
            layer.temporal_attn.wo.weight.zero_()
    a, _ = m([vid])
    b, _ = m([vid2])
    torch.testing.assert_close(a[first], b[first], rtol=0, atol=1e-6)  # ... only through temporal attention
    assert (a[2:] - b[2:]).abs().max() > 1e-3


def test_items_do_not_interact():
    m = _model()
    img, vid = _inputs()
    alone, _ = m([img])
    together, counts = m([vid, img, torch.randn(1, 3, 24, 8)])
    start = int(counts[0])
    torch.testing.assert_close(together[start : start + 6], alone, rtol=1e-5, atol=1e-6)
    vid_alone, _ = m([vid])
    torch.testing.assert_close(together[:start], vid_alone, rtol=1e-5, atol=1e-6)


def test_meta_build_then_init_matches_cpu_init():
    a = tiny_vision_args()
    with torch.device("meta"):
        meta = MoonViT(a, OUT)
    assert all(p.is_meta for p in meta.parameters()) and not list(meta.buffers())
    meta.to_empty(device="cpu")
    meta.init_weights(7)
    cpu = MoonViT(a, OUT)
    cpu.init_weights(7)
    for (n, p), (_, q) in zip(meta.named_parameters(), cpu.named_parameters()):
        assert torch.equal(p, q), n
    other = MoonViT(a, OUT)
    other.init_weights(8)
    assert not torch.equal(other.pos_embed, cpu.pos_embed)
    assert torch.equal(cpu.layers[0].mlp_norm.weight, torch.ones(a.width))
    assert torch.equal(cpu.projector.fc1.bias, torch.zeros(a.projector_hidden))


SPEC_VISION = dict(
    patch_size=14,
    in_channels=3,
    width=1024,
    layers=27,
    heads=12,
    head_dim=64,
    mlp_hidden=2730,
    pos_grid=64,
    max_frames=16,
    merge=2,
    projector_hidden=4096,
    max_image_side=3584,
)


def _full_counts(args: VisionArgs) -> tuple[int, int]:
    with torch.device("meta"):
        m = MoonViT(args, 7168)
    total = sum(p.numel() for p in m.parameters())
    return total, sum(p.numel() for p in m.projector.parameters())


def test_full_size_parameter_count():
    total, projector = _full_counts(VisionArgs(**SPEC_VISION))
    assert projector == 46_156_800
    assert total - projector == 401_202_176
    assert total == 447_358_976


def test_default_vision_args_are_the_spec_shape():
    d = VisionArgs()
    assert {k: getattr(d, k) for k in SPEC_VISION} == SPEC_VISION
    assert _full_counts(d)[0] == 447_358_976


@pytest.mark.parametrize(
    "shape, match",
    [
        ((1, 3, 12, 16), "multiple of patch_size\\*merge"),  # 12 px is not a multiple of 4 * 2
        ((1, 3, 16, 20), "multiple of patch_size\\*merge"),
        ((1, 3, 72, 16), "max_image_side"),
        ((1, 4, 16, 16), "channels"),
        ((5, 3, 16, 16), "frames"),
        ((3, 16, 16, 16, 1), "expected \\[T, C, H, W\\]"),
    ],
)
def test_bad_images_raise(shape, match):
    m = MoonViT(tiny_vision_args(), OUT)
    with pytest.raises(ValueError, match=match):
        m([torch.zeros(shape)])


def test_bad_packed_inputs_raise():
    m = MoonViT(tiny_vision_args(), OUT)
    img, vid = _inputs()
    patches, grid = patchify(m.args, [img, vid])
    with pytest.raises(ValueError, match="grid_thw"):
        m(patches)
    with pytest.raises(ValueError, match="in_channels"):
        m(patches[:, :40], grid)
    with pytest.raises(ValueError, match="rows"):
        m(patches[:-1], grid)
    with pytest.raises(ValueError, match="multiple of merge"):
        m(patches, torch.tensor([[1, 4, 6], [2, 2, 3]]))
    with pytest.raises(ValueError, match="does not match"):
        m([img, vid], torch.tensor([[1, 6, 4], [2, 2, 4]]))
    with pytest.raises(ValueError, match="non-empty"):
        m([])
