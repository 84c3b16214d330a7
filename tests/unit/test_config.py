"""Recipes compose into typed configs; overrides apply; bad keys, types and values fail with the key named,
before any model is built."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3train.parallel.mesh import ParallelDims
from k3train.config import ConfigError, K3TrainConfig, available_recipes, load_config, model_args, validate_config
from k3train.config import schema as schema_mod
from k3train.models.k3 import model as model_mod

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_model_builds(monkeypatch):
    """Config handling must never build a model: make any attempt fail loudly."""

    def boom(*a, **k):
        raise AssertionError("a model was built during config handling")

    monkeypatch.setattr(model_mod.K3Model, "__init__", boom)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_recipes_are_listed_and_load():
    assert {"tiny_cpu", "small_8gpu", "k3_full"} <= set(available_recipes())
    tiny = load_config("tiny_cpu")
    assert isinstance(tiny, K3TrainConfig)
    assert tiny.model.preset == "tiny" and tiny.data.source == "builtin" and tiny.train.device == "auto"
    assert tiny.optim.betas == (0.9, 0.95)
    assert ParallelDims.from_config(tiny.parallel, 1).dp == 1

    small = load_config("small_8gpu", world_size=8)
    assert small.model.preset == "small" and small.parallel.ep == 8 and small.parallel.dp == 8
    assert small.data.seq_len % model_args(small).kda_chunk == 0

    full = load_config("k3_full", ["data.paths=[corpus/*.jsonl]", "data.tokenizer_path=tok.tiktoken"], world_size=2048)
    p = full.parallel
    assert (p.pp, p.vpp, p.ep, p.cp, p.dp, p.zero, p.schedule) == (16, 2, 128, 4, 32, 2, "dualpipev")
    assert p.pp * p.cp * p.dp == 2048
    args = model_args(full)
    assert args.n_experts % p.ep == 0 and args.n_layers >= p.pp * p.vpp

    paths = ["data.paths=[corpus/*.jsonl]", "data.tokenizer_path=tok.tiktoken"]
    long = load_config("k3_long_context", paths, world_size=2048)
    p = long.parallel
    assert (p.pp, p.cp, p.dp, p.ep, p.cp_layout) == (16, 128, 1, 128, "zigzag") and long.data.seq_len == 1 << 20
    # 256 zigzag pieces x the 64-token KDA chunk: 1M - 1024 is refused, naming the multiple.
    msg = _error(paths + [f"data.seq_len={(1 << 20) - 1024}"], world_size=2048, recipe="k3_long_context")
    assert msg.startswith("data.seq_len:") and "multiple of 16384" in msg, msg


def test_overrides_apply():
    cfg = load_config(
        "tiny_cpu",
        [
            "train.steps=7",
            "optim=muon",
            "optim.lr=1e-3",
            "data.seq_len=64",
            "+model.overrides.n_layers=4",
            "parallel.microbatches=3",
        ],
    )
    assert cfg.train.steps == 7 and cfg.optim.name == "muon" and cfg.optim.lr == 1e-3
    assert cfg.data.seq_len == 64 and cfg.parallel.microbatches == 3
    assert model_args(cfg).n_layers == 4
    assert load_config("tiny_cpu", ["model=small"]).model.preset == "small"
    # choosing a group option takes that option's values (the recipe does not pin them)
    recall = load_config("tiny_cpu", ["data=recall"]).data
    assert (recall.source, recall.seq_len, recall.micro_batch, recall.recall_pairs) == ("recall", 32, 64, 6)


def test_world_size_fills_dp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config("tiny_cpu")
    assert ParallelDims.from_config(cfg.parallel, 2).dp == 2


def _error(overrides, recipe="tiny_cpu", **kw) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(recipe, overrides, **kw)
    return str(ei.value)


def test_unknown_keys_are_named():
    assert "train.stepz" in _error(["train.stepz=3"])
    assert "train.stepz" in _error(["+train.stepz=3"])  # `+` adds keys in Hydra; the schema still refuses it
    assert "optim.lrr" in _error(["+optim.lrr=3"])
    assert "dimm" in _error(["+model.overrides.dimm=32"])


def test_wrong_types_are_named():
    msg = _error(["train.steps=abc"])
    assert "train.steps" in msg and "abc" in msg
    assert "optim.lr" in _error(["optim.lr=fast"])
    assert "logging.tensorboard" in _error(["logging.tensorboard=maybe"])


@pytest.mark.parametrize(
    "override, key, detail",
    [
        ("optim.lr=0", "optim.lr", "> 0"),
        ("optim.lr=-1e-3", "optim.lr", "> 0"),
        ("data.seq_len=100", "data.seq_len", "multiple of 16"),
        ("data.micro_batch=0", "data.micro_batch", ">= 1"),
        ("parallel.dp=2", "parallel", "WORLD_SIZE=1"),
        ("parallel.zero=3", "parallel.zero", "0, 1 or 2"),
        ("train.steps=0", "train.steps", ">= 1"),
        ("train.device=tpu", "train.device", "tpu"),
        ("train.resume=/no/such/run", "train.resume", "does not exist"),
        ("optim.name=sgd", "optim.name", "sgd"),
        ("activation.policy=magic", "activation.policy", "magic"),
        ("model.preset=huge", "model.preset", "huge"),
        ("optim.decay_ratio=1.5", "optim.decay_ratio", "[0, 1]"),
    ],
)
def test_bad_values_are_named(override, key, detail):
    msg = _error([override])
    assert msg.startswith(key + ":") or f"{key}:" in msg, msg
    assert detail in msg, msg


def test_parallel_layout_against_world_size():
    msg = _error(["parallel.pp=2", "parallel.dp=2"], world_size=2)
    assert "pp=2" in msg and "WORLD_SIZE=2" in msg
    cfg = load_config("tiny_cpu", ["parallel.pp=2", "parallel.microbatches=2"], world_size=2)
    assert ParallelDims.from_config(cfg.parallel, 2).dp == 1
    assert "parallel.ep" in _error(["parallel.ep=3"], world_size=3)  # 3 does not divide 8 experts
    # seq_len must hold whole KDA chunks in every context-parallel piece: zigzag cuts a row into 2*cp pieces,
    # contiguous into cp, each a multiple of the tiny model's 16-token chunk.
    msg = _error(["parallel.cp=2", "data.seq_len=96"], world_size=2)
    assert msg.startswith("data.seq_len:") and "multiple of 64" in msg and "4 zigzag pieces" in msg, msg
    assert "multiple of 32" in _error(
        ["parallel.cp=2", "parallel.cp_layout=contiguous", "data.seq_len=48"], world_size=2
    )
    load_config("tiny_cpu", ["parallel.cp=2", "parallel.cp_layout=contiguous", "data.seq_len=96"], world_size=2)
    assert "parallel.cp_layout" in _error(["parallel.cp=2", "parallel.cp_layout=ring"], world_size=2)


def test_unknown_recipe_lists_the_available_ones():
    msg = _error([], recipe="no_such_recipe")
    assert "no_such_recipe" in msg
    for name in ("tiny_cpu", "small_8gpu", "k3_full"):
        assert name in msg


def test_unknown_group_option():
    msg = _error(["model=huge"])
    assert "model/huge" in msg and "tiny" in msg


def test_every_schema_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(schema_mod))
    documented: dict[str, set[str]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names, body = set(), cls.body
        for a, b in zip(body, body[1:]):
            if (
                isinstance(a, ast.AnnAssign)
                and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant)
                and isinstance(b.value.value, str)
            ):
                names.add(a.target.id)
        documented[cls.name] = names
    for cls in (getattr(schema_mod, n) for n in documented):
        if dataclasses.is_dataclass(cls) and cls.__module__ == schema_mod.__name__:
            missing = {f.name for f in dataclasses.fields(cls)} - documented[cls.__name__]
            assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_validate_builds_nothing_and_returns_model_args():
    cfg = load_config("tiny_cpu")
    args = validate_config(cfg, world_size=1)
    assert args.name == "tiny" and args.vocab_size >= 259  # the byte tokenizer's ids fit


def _cli(*argv: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "k3train.train", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_cli_config_errors_are_clean(tmp_path):
    """Through the command line: exit code != 0, the key in the message, no traceback, no run directory."""
    run_dir = tmp_path / "run"
    cases = [
        (["optim.lr=-1", f"train.run_dir={run_dir}"], "optim.lr", 2),  # a bad value (k3train's check)
        (["train.stepz=3", f"train.run_dir={run_dir}"], "train.stepz", 1),  # an unknown key (Hydra's schema)
        (["--config-name", "nope"], "tiny_cpu", 2),  # a missing recipe: the available ones are listed
    ]
    for argv, needle, code in cases:
        r = _cli(*argv)
        assert r.returncode == code, (argv, r.returncode, r.stdout, r.stderr)
        assert needle in r.stderr, (argv, r.stderr)
        assert "Traceback" not in r.stderr, (argv, r.stderr)
    assert not run_dir.exists()


def test_installed_recipes_found_under_the_prefix(tmp_path, monkeypatch):
    # Without the repository folders (a wheel install), recipes and config groups come from
    # <prefix>/share/k3train, where pyproject's data-files put them.
    import sys

    import hydra_plugins.k3train_searchpath as searchpath

    from k3train.config import store

    for sub in ("recipes", "configs"):
        (tmp_path / "share" / "k3train" / sub).mkdir(parents=True)
    (tmp_path / "share" / "k3train" / "recipes" / "mine.yaml").write_text("{}\n")
    monkeypatch.setattr(searchpath, "_REPO", tmp_path / "no_checkout")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.delenv("K3TRAIN_RECIPES", raising=False)
    monkeypatch.delenv("K3TRAIN_CONFIGS", raising=False)
    assert store.recipes_dir() == tmp_path / "share" / "k3train" / "recipes"
    assert store.configs_dir() == tmp_path / "share" / "k3train" / "configs"
    assert store.available_recipes() == ["mine"]


def test_model_overrides_reach_every_field_and_balancing_needs_a_free_expert():
    cfg = load_config("tiny_cpu", ["+model.overrides.name=mine"])
    assert model_args(cfg).name == "mine"  # the label is an override like any other
    with pytest.raises(ConfigError, match="train.balancing: quantile balancing needs top_k < n_experts"):
        load_config("tiny_cpu", ["+model.overrides.top_k=8"])
    assert model_args(load_config("tiny_cpu", ["+model.overrides.top_k=8", "train.balancing=none"])).top_k == 8
