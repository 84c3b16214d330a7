"""The training configuration: one keyword-only dataclass per section, composed by Hydra from recipes and groups.

Every field carries a docstring; these classes are registered in Hydra's ConfigStore (see `k3train.config.store`),
so a recipe or command-line override naming a key that does not exist, or giving a value of the wrong type, fails
at composition time with the full key in the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3train.activation.config import ActivationConfig
from k3train.data.config import DataConfig
from k3train.optim.config import OptimConfig


@dataclass(kw_only=True)
class ModelConfig:
    preset: str = "tiny"
    """Model preset from k3train.models.k3.args.PRESETS: tiny, tiny_vision (tiny with a small vision tower), small
    or k3_full."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """K3ModelArgs fields replaced on top of the preset, e.g. `+model.overrides.n_layers=4` (`+` adds a key)."""
    kernels: str = "auto"
    """Implementation of the fused ops (chunked KDA, SiTU-GLU, MoE permutation): auto (the Triton kernels on CUDA
    when Triton imports, PyTorch otherwise), torch (the PyTorch references), triton (refused where Triton cannot
    run: no CUDA and TRITON_INTERPRET unset) or fla (flash-linear-attention's chunked KDA, the rest as triton; CUDA
    only). Cases the kernels do not cover run PyTorch (k3train.ops.backend)."""
    compile: bool = False
    """Compile each transformer layer with torch.compile (one compiled region per layer, as TorchTitan compiles each
    block; the embedding, head and loss stay eager). The same math; on in the GPU recipes."""
    compile_backend: str = "inductor"
    """torch.compile backend of model.compile: inductor (generated kernels: the GPU choice), aot_eager (the traced
    forward and backward run as eager ops: what CPU tests use) or eager (graph capture only)."""
    mtp_layers: int = 0
    """0 or 1: add the multi-token-prediction module (k3train.models.k3.mtp; its loss weight is
    optim.mtp_loss_weight). The same field as model.overrides.mtp_layers."""


@dataclass(kw_only=True)
class ParallelConfig:
    pp: int = 1
    """Pipeline-parallel stages."""
    vpp: int = 1
    """Virtual pipeline stages per pipeline rank (interleaved schedules); 1 without pipelining."""
    ep: int = 1
    """Expert-parallel degree; experts are sharded over ranks borrowed from dp x cp, so ep must divide dp * cp."""
    cp: int = 1
    """Context-parallel degree (the sequence is split over cp ranks)."""
    dp: int = -1
    """Data-parallel degree; -1 fills in WORLD_SIZE // (pp * cp). The layout must satisfy pp * cp * dp == WORLD_SIZE."""
    zero: int = 0
    """0: replicated optimizer state; 1: ZeRO-1 (optimizer state sharded over dp); 2: Pipeline ZeRO-2."""
    microbatches: int = 1
    """Micro-batches per optimizer step on each data-parallel rank (gradient accumulation; the pipeline's
    micro-batches when pp > 1)."""
    schedule: str = "auto"
    """Pipeline schedule: auto (interleaved_1f1b when vpp > 1, else 1f1b), gpipe, 1f1b, interleaved_1f1b,
    looped_bfs, interleaved_zb, zbv or dualpipev (k3train.parallel.mesh.SCHEDULES)."""
    ep_dispatcher: str = "alltoall"
    """Token dispatcher under expert parallelism (ep > 1): alltoall (experts run at home) or moonep (per-step
    balanced redundant experts)."""
    ep_overlap: str = "layer"
    """What an expert all-to-all overlaps under ep > 1: layer (the shared experts of its own MoE layer) or
    microbatch (also, inside DualPipeV's overlapped forward-backward actions, the compute of the other micro-batch;
    needs pp > 1 and parallel.schedule=dualpipev)."""
    cp_layout: str = "zigzag"
    """How each row is split over the cp ranks: zigzag (2*cp pieces, rank r holds pieces r and 2*cp-1-r, so causal
    attention work is even) or contiguous (cp pieces). seq_len must be a multiple of pieces x KDA chunk."""
    vision_placement: str = "stage"
    """Where the vision tower's work runs under pp > 1: stage (inside the first stage's forward and backward of each
    micro-batch) or bubbles (its forward and backward of each micro-batch as actions of their own, placed into the
    first pipeline rank's idle time; schedules gpipe, 1f1b, interleaved_1f1b, looped_bfs)."""


@dataclass(kw_only=True)
class LoggingConfig:
    console: bool = True
    """Print a metrics line every console_interval steps (rank 0)."""
    console_interval: int = 10
    """Steps between console lines."""
    progress_bar: bool = True
    """Show a tqdm progress bar with loss and tokens/s (rank 0)."""
    log_interval: int = 1
    """Steps between records in metrics.jsonl, TensorBoard and W&B."""
    tensorboard: bool = True
    """Write TensorBoard event files under <run_dir>/tb."""
    wandb: bool = False
    """Log to Weights & Biases."""
    wandb_project: str = ""
    """W&B project; when empty the run is logged offline under <run_dir>/wandb (no network needed)."""
    wandb_mode: str = "auto"
    """auto (online only when wandb_project is set and an API key is available, else offline), offline, online or
    disabled. The WANDB_MODE environment variable, when set, wins."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU; 0 takes the GPU table's dense peak for the GPU found
    (k3train.plan.gpus), or where the table has no entry (CPU) the peak an earlier start of the run recorded, else
    measures it once with a dense matmul and records it here in the run's config.yaml."""


@dataclass(kw_only=True)
class TrainConfig:
    steps: int = 300
    """Optimizer steps of the whole run (the learning-rate schedule spans them)."""
    seed: int = 0
    """Seed of weights, data order and every random number generator."""
    deterministic: bool = False
    """Deterministic kernels so that a GPU run repeats exactly where the hardware allows:
    torch.use_deterministic_algorithms (an op without a deterministic version raises, naming itself; uninitialised
    memory is filled), CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set, cuDNN autotuning off. What remains
    nondeterministic is listed in docs/convergence.md (NCCL's reduction order across runs of other layouts, atomics
    in kernels that have no deterministic version). CPU runs are deterministic without it."""
    eval_interval: int = 100
    """Steps between eval-loss measurements; 0 disables eval."""
    eval_steps: int = 8
    """Eval micro-batches per measurement (fewer when the eval split runs out)."""
    checkpoint_interval: int = 100
    """Steps between checkpoints; 0 saves only at the end of the run."""
    checkpoint_at_end: bool = True
    """Save a checkpoint after the last step."""
    keep_last_k: int = 3
    """Checkpoints kept in <run_dir>/checkpoints; older ones are deleted."""
    async_checkpoint: bool = True
    """Write checkpoints in the background (torch.distributed.checkpoint.async_save): the loop waits only for a
    host copy of each rank's state, and a checkpoint is published once every rank has written it. false: the loop
    waits until the checkpoint is written and published."""
    run_dir: str = ""
    """Run directory; empty means runs/<recipe>/<timestamp> under the current directory, or a name that survives
    restarts: runs/<recipe>/slurm-<SLURM_JOB_ID> under Slurm (the same after a requeue), and under torchrun the
    directory the launch's first round chose (restarted workers find it in torchrun's store)."""
    resume: str = "auto"
    """auto: continue from the newest valid checkpoint in run_dir if there is one; never: start fresh;
    or a path to a checkpoint (step-N) or to a run directory."""
    init_from: str = ""
    """Start a new run from the weights of another run's checkpoint (a step-N folder, a checkpoints folder or a run
    directory; any layout, any step): parameters and balancing biases only, with a fresh step counter, schedule,
    optimizer and data position (context extension: 8k -> 128k -> 1M). Used only while the run directory holds no
    checkpoint of its own; after that the run resumes itself."""
    device: str = "auto"
    """auto (cuda when present, else cpu), cpu or cuda."""
    precision: str = "fp32"
    """fp32: parameters, gradients and compute in float32. bf16 (mixed precision): parameters stored and computed
    in bfloat16 under autocast (the fp32 islands stay fp32), gradients accumulated and reduced in fp32, and fp32
    master weights and optimizer states kept only on their ZeRO owners (k3train.parallel.zero). fp64: everything in
    float64, meant for checks (a parallel layout then equals one process to rounding, 1e-10); the PyTorch ops run
    (model.kernels=triton is refused), and the router scores in fp64 whatever model.router_score_dtype says."""
    float8: str = "none"
    """FP8 GEMMs for the dense linears through torchao's float8 training: none, tensorwise (one scale per tensor)
    or rowwise (one scale per row). Converted: the attention projections, the dense FFN, the MoE's latent
    projections and shared experts, each with both widths multiples of 16 (the others stay in the parameter dtype,
    named in a warning); never the router, the routed experts, the embeddings or the LM head. Emulated on CPU, on
    the tensor cores on CUDA. Refused with train.precision=fp64 (FP8 rounding breaks the 1e-10 parity checks)."""
    qat: str = "none"
    """Quantisation-aware training. none, or mxfp4_experts: the routed experts' grouped matmuls run on their weights
    rounded to MXFP4 (E2M1 in blocks of 32 along the contraction dimension, one E8M0 scale each) and their input
    rows rounded to MXFP8 (E4M3), through torchao's MXTensor; gradients pass straight through to the full-precision
    weights. The experts' widths (moe_latent_dim, expert_hidden) must be multiples of 32. mxfp4_all: the same, and
    the dense linears train.float8 would convert (input width a multiple of 32) rounded alike through a torchao MX QAT
    linear (k3train.parallel.mx_linear); refused together with train.float8."""
    balancing: str = "quantile"
    """MoE router balancing when the model has routers: quantile (Quantile Balancing), sign (DeepSeek-V3's
    sign-step bias) or none. The bias is updated after every optimizer step."""
    threads: int = 0
    """CPU threads per process; 0 divides the machine's cores among the local processes."""
    timeout_s: float = 300.0
    """Seconds a rank waits for the others in process-group creation and in any collective before it gives up:
    it prints its rank, the operation and the step, and exits with code 3 (torchrun then restarts or stops the
    job)."""
    host_work_timeout_s: float = 21600.0
    """Seconds ranks wait while a peer does long host work: rank 0 tokenizing the corpus into the token cache,
    checksumming, verifying and pruning checkpoints. These waits use this bound instead of timeout_s."""


@dataclass(kw_only=True)
class PlanConfig:
    gpu: str = "h100_80g"
    """GPU the planner sizes for (k3train.plan.gpus.GPUS: h100_80g, h200_141g, b200_192g). At training start-up the
    GPU found on the machine is used instead."""
    gpus_per_node: int = 8
    """GPUs per node: groups that fit in a node communicate over NVLink, the others over the network."""
    world: int = 0
    """Ranks to plan for when parallel.dp is -1 (fill from the world); 0 takes pp x dp x cp."""
    headroom: float = 0.10
    """Share of GPU memory left free (allocator fragmentation, CUDA context, communication libraries)."""
    efficiency: float = 0.0
    """0: each op class of the executed work at its own rate (k3train.plan.efficiency); in (0, 1]: every FLOP at
    that one fraction of the dense peak FLOP/s and no memory-bound time (the single-efficiency model)."""
    check: bool = True
    """Refuse to start training on a GPU when the layout is predicted not to fit (before any process group)."""
    measure: bool = False
    """`python -m k3train.plan plan.measure=true`: run the tiny reference layouts on CPU and print predicted vs
    measured bytes for each kind."""
    png: str = ""
    """Where the planner writes its figure (memory bars per stage, schedule timeline); empty:
    runs/plan/<recipe>_plan.png under the current directory; 'none' writes no figure."""


@dataclass(kw_only=True)
class DryRunConfig:
    ranks: list[int] = field(default_factory=list)
    """`python -m k3train.dryrun`: the global ranks to simulate (dryrun.jobs at once); empty: one rank per pipeline
    stage plus a second member of each of the first stage's dp, cp, ep and edp groups (k3train.dryrun.run)."""
    loads: str = "balanced"
    """Stand-in expert loads of the dry run: balanced (every expert the same rows) or zipf (skewed, per call)."""
    microbatches: int = 0
    """Micro-batches of the dry run's one step; 0 takes pp x vpp, the pipeline's stages (the schedule's saved
    activations stop growing once each stage holds a micro-batch; the pipeline's receive buffers, one per
    micro-batch, grow with m, and the planner counts them at the run's m)."""
    jobs: int = 0
    """Ranks stepped at once, each in a process of its own (a rank's fake step runs on one core); 0: one per CPU
    core, at most one per rank."""
    check: str = "warn"
    """At training start on CUDA without a passing dry-run verdict for the run's model, layout, activation and
    kernels: warn (print a warning) or strict (refuse to start)."""


@dataclass(kw_only=True)
class K3TrainConfig:
    """A whole run: what every recipe composes to."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Which model to train."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer, sequence length and micro-batch size (k3train.data.config)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and warmup-stable-decay schedule (k3train.optim.config)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout and gradient accumulation."""
    activation: ActivationConfig = field(default_factory=ActivationConfig)
    """Activation storage policies."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Console, metrics.jsonl, TensorBoard and W&B."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, seed, eval, checkpoints, device."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """The memory and step-time planner (python -m k3train.plan) and the start-up fit check."""
    dryrun: DryRunConfig = field(default_factory=DryRunConfig)
    """The dry run (python -m k3train.dryrun): one rank's full-size step on fake tensors and a fake process group."""
