"""model.kernels (k3train.ops.backend): what each choice resolves to, `triton` refused where Triton cannot run (before
any process group), and a tiny model whose forward and backward call the Triton kernels under `triton` (counted by
wrappers) with the outputs and gradients of `torch` (run on CPU under TRITON_INTERPRET=1, or on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from k3train.config import ConfigError
from k3train.models.k3.args import get_preset
from k3train.models.k3.context import BatchContext
from k3train.models.k3.model import K3Model
from k3train.ops.backend import AUTO, KERNELS, Kernels, resolve_kernels, set_kernels

CAN_RUN_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_choices_resolve_by_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_kernels("torch", "cpu") == "torch" and resolve_kernels("torch", "cuda") == "torch"
    assert resolve_kernels("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="unknown kernels 'cuda'"):
        resolve_kernels("cuda", "cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_kernels("triton", "cpu")
    pytest.importorskip("triton")
    assert resolve_kernels("auto", "cuda") == "triton"  # auto: Triton on CUDA when it imports
    assert resolve_kernels("triton", "cuda") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_kernels("triton", "cpu") == "triton"
    assert resolve_kernels("auto", "cpu") == "torch"  # the interpreter is opt-in only


def test_triton_refused_without_cuda_or_interpreter(monkeypatch, one_process):
    """`model.kernels=triton` on a CPU run with TRITON_INTERPRET unset is a ConfigError naming the key, raised by
    validation: the trainer stops before any process group (here: a 2-rank world whose group must never start)."""
    from k3train.config import load_config
    from k3train.config import resolve_run
    from k3train.train.trainer import Trainer

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    over = ["model.kernels=triton", "train.device=cpu"]
    with pytest.raises(ConfigError, match=r"model\.kernels: 'triton' cannot run here: .*TRITON_INTERPRET"):
        load_config("tiny_cpu", over)
    with pytest.raises(ConfigError, match=r"model\.kernels: unknown kernels 'fast'"):
        load_config("tiny_cpu", ["model.kernels=fast"])

    cfg = load_config("tiny_cpu", ["train.device=cpu"])
    cfg.model.kernels = "triton"
    monkeypatch.setenv("WORLD_SIZE", "2")

    def no_group(*a, **k):
        raise AssertionError("a process group was started before the configuration was refused")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_group)
    with pytest.raises(ConfigError, match=r"model\.kernels"):
        Trainer(resolve_run(cfg))


def test_kernels_is_per_module_state():
    """The choice lives on the modules of one model: another model (and the class default) keeps AUTO."""
    a, b = _model(), _model()
    n = set_kernels(a, "torch")
    assert (
        n
        == sum(
            1
            for m in a.modules()
            for o in (m, getattr(m, "dispatcher", None))
            if isinstance(getattr(o, "kernels", None), Kernels)
        )
        > 0
    )
    assert all(o.kernels == Kernels("torch") for o in _holders(a))
    assert all(o.kernels is AUTO for o in _holders(b))
    with pytest.raises(ValueError):
        Kernels("fast")
    assert set(KERNELS) == {"auto", "torch", "triton", "fla"}


def _holders(model):
    return [
        o
        for m in model.modules()
        for o in (m, getattr(m, "dispatcher", None))
        if isinstance(getattr(o, "kernels", None), Kernels)
    ]


def _model(seed: int = 0, **over) -> K3Model:
    # 4 layers: KDA + dense FFN, KDA + MoE, KDA + MoE, MLA + MoE; the Triton KDA's chunk of 64.
    args = get_preset("tiny", **{"n_layers": 4, "kda_chunk": 64, **over})
    with torch.device("meta"):
        m = K3Model(args)
    m.to_empty(device=DEV)
    m.init_weights(seed)
    return m


COUNTED = {
    ("kda", "chunk_kda"),
    ("situ", "situ_triton"),
    ("moe_permute", "permute_triton"),
    ("moe_permute", "unpermute_triton"),
}


@pytest.fixture
def kernel_calls(monkeypatch):
    """{function name: calls} of the k3kernels entry points, counted by wrappers."""
    import importlib

    calls = {name: 0 for _, name in COUNTED}
    for mod, name in COUNTED:
        module = importlib.import_module(f"k3kernels.{mod}")
        fn = getattr(module, name)

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(module, name, counted)
    return calls


def _step(model, tokens, ctx=None):
    for p in model.parameters():
        p.grad = None
    logits = model(tokens, ctx)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.skipif(not CAN_RUN_TRITON, reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("documents", [False, True], ids=["rows", "documents"])
@pytest.mark.slow
def test_triton_choice_runs_the_kernels_with_torch_results(kernel_calls, documents):
    pytest.importorskip("triton")
    model = _model(1)
    tokens = torch.randint(0, model.args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(DEV)
    ctx = (
        (lambda: BatchContext(cu_seqlens=torch.tensor([0, 40, 64, 100, 128], dtype=torch.int32, device=DEV)))
        if documents
        else (lambda: None)
    )

    set_kernels(model, "torch")
    ref_logits, ref_grads = _step(model, tokens, ctx())
    assert not any(kernel_calls.values()), kernel_calls

    set_kernels(model, "triton")
    logits, grads = _step(model, tokens, ctx())
    kinds = [layer.kind for layer in model.layers.values()]
    n_kda, n_moe = kinds.count("kda"), sum(hasattr(layer.ffn, "experts") for layer in model.layers.values())
    n_dense = len(kinds) - n_moe
    assert (n_kda, n_moe, n_dense) == (3, 3, 1)
    # One call per layer and forward; SiTU-GLU: the dense FFN, and each MoE layer's routed and shared experts.
    assert kernel_calls == {
        "chunk_kda": n_kda,
        "situ_triton": n_dense + 2 * n_moe,
        "permute_triton": n_moe,
        "unpermute_triton": n_moe,
    }, kernel_calls

    scale = ref_logits.abs().max()
    assert (logits - ref_logits).abs().max() <= 1e-4 * scale
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        r = ref_grads[name]
        assert (g - r).norm() <= 1e-3 * r.norm() + 1e-7, name


@pytest.mark.skipif(not CAN_RUN_TRITON, reason="needs a GPU or TRITON_INTERPRET=1")
def test_triton_choice_keeps_torch_where_the_kernels_do_not_reach(kernel_calls):
    """Chunk 16 (the Triton KDA takes 64 only) and fp64 run the PyTorch ops under `triton`."""
    pytest.importorskip("triton")
    model = _model(2, kda_chunk=16)
    set_kernels(model, "triton")
    tokens = torch.randint(0, model.args.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1)).to(DEV)
    model(tokens)
    assert kernel_calls["chunk_kda"] == 0 and kernel_calls["permute_triton"] == 3, kernel_calls
    for k in kernel_calls:
        kernel_calls[k] = 0
    model.double()(tokens)
    assert not any(kernel_calls.values()), kernel_calls
