"""A training run resolved once: the config, checked, with everything derived from it that more than one part needs.

    spec = resolve_run(cfg, world_size=4, recipe="tiny_cpu")      # or load_spec("tiny_cpu", overrides)
    spec.model, spec.layout, spec.stages, spec.kernels             # model args, ParallelDims, layers per stage, backend

The command line resolves the Hydra config into a RunSpec; the trainer, the engine's builder, the planner and the
convergence harness read it instead of re-deriving the model args, the layout or the stage split from the config.
Resolution is where validation runs (k3train.config.validate's checks, each naming its key), once per start, before
any process group, model or run directory exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from k3train.activation import rules_from_config
from k3train.data.config import VISION_SOURCES
from k3train.models.k3.args import K3ModelArgs
from k3train.parallel.mesh import ParallelDims
from k3train.parallel.pipeline import split_layers

from . import validate as checks
from .schema import K3TrainConfig


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved. `config` is the validated config itself (its train, data, optim, activation and logging
    settings are read from it); the other fields are what resolution derived from it."""

    config: K3TrainConfig
    model: K3ModelArgs
    """The model args of model.preset with model.overrides applied."""
    layout: ParallelDims
    """The parallel layout (parallel.dp = -1 filled from the world size), validated against the world and model."""
    kernels: str
    """The kernel backend model.kernels resolves to on this machine: torch or triton."""
    device_type: str
    """What train.device resolves to here: cpu or cuda."""
    world: int
    activation_rules: tuple = ()
    """The activation storage rules of the activation settings (k3train.activation.rules_from_config); empty when
    every activation is kept."""
    recipe: str = "custom"
    tokenizer: object | None = field(default=None, compare=False, repr=False)
    """The tokenizer, built once while checking its special tokens (None where its file is not on this machine)."""

    @cached_property
    def stages(self) -> tuple[tuple[int, ...], ...]:
        """The 1-based layer ids of each of the layout's pp x vpp pipeline stages (k3train.parallel.pipeline's
        split, which weighs layers on a meta-device model: computed on first use, so checking a config builds
        nothing)."""
        split = split_layers(self.model, self.layout.n_stages, seq_len=self.config.data.seq_len)
        return tuple(tuple(s) for s in split)

    @property
    def precision(self) -> str:
        return self.config.train.precision

    @property
    def trains_vision(self) -> bool:
        """Whether the data feeds images (the vision tower then trains; else it stays frozen)."""
        return self.config.data.source in VISION_SOURCES

    @property
    def tokens_per_step(self) -> int:
        c = self.config
        return self.layout.dp * self.layout.microbatches * c.data.micro_batch * c.data.seq_len


def resolve_run(
    cfg: K3TrainConfig, *, world_size: int | None = None, recipe: str = "custom", here: bool = True
) -> RunSpec:
    """Check cfg (ConfigError naming the first bad key) and resolve it; world_size defaults to $WORLD_SIZE.
    here=False resolves a run planned for another machine (the planner): its data sources, tokenizer file and
    kernel backend are that machine's, so they are neither checked nor resolved here (kernels stays as
    model.kernels names it)."""
    world = checks.world_size_from_env() if world_size is None else world_size
    args = checks.model_args(cfg)
    kernels = checks.check_kernels(cfg) if here else cfg.model.kernels
    # parallel: one parser and one set of rules for every layout (k3train.parallel.mesh)
    dims = ParallelDims.from_config(cfg.parallel, world).validate(world_size=world, model_args=args)
    checks.check_data(cfg, args, dims, sources=here)
    tok = checks.check_tokenizer(cfg, args) if here else None
    checks.check_optim(cfg)
    checks.check_compile(cfg)
    checks.check_activation(cfg)
    checks.check_logging(cfg)
    checks.check_train(cfg, args)
    checks.check_dryrun(cfg, dims)
    a = cfg.activation
    rules = tuple(rules_from_config(a)) if a.policy != "keep" or a.rules else ()
    return RunSpec(
        config=cfg,
        model=args,
        layout=dims,
        kernels=kernels,
        device_type=checks.train_device_type(cfg.train.device),
        world=world,
        activation_rules=rules,
        recipe=recipe,
        tokenizer=tok,
    )


def validate_config(cfg: K3TrainConfig, world_size: int | None = None) -> K3ModelArgs:
    """resolve_run's checks alone: ConfigError naming the first bad key, else the model args."""
    return resolve_run(cfg, world_size=world_size).model
