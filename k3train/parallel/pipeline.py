"""Pipeline parallelism for K3: cost-balanced stage split, stage modules, and torch.distributed.pipelining schedules.

Split. The layer stack is cut into pp * vpp contiguous stages. Every layer weighs its training FLOPs per token
(k3train.models.k3.counts.layer_costs: 6 x parameters touched per token, so a MoE layer counts its shared experts,
router, W_down/W_up and top_k / E of its routed bank, plus 3 x its attention-core forward FLOPs at the training
sequence length). The input embedding is charged to the first stage and the LM head to the last, each as a matmul
of its table, the usual convention that an embedding or a head costs about a layer. The split minimises the most
expensive stage (a linear-partition dynamic programme); `split_reference` enumerates every cut for tests.

Stages. A stage is the K3Model with the other layers deleted and the modules it does not own set to None, built on
the meta device and initialised with `init_weights(seed)`, which seeds every parameter from its fully-qualified name:
a stage's parameters equal the same names of a whole model. What crosses a stage boundary is the AttnRes state,
stacked [S, B, T, D] (S = 1 + the blocks begun so far, so it changes from boundary to boundary).

Documents. cu_seqlens cannot cross a boundary as a keyword (its length varies by micro-batch and the schedule chunks
keywords along dim 0), so every stage receives a bool `doc_start` [B, T] marking the first token of each document,
chunked along the batch like the tokens, and rebuilds cu_seqlens from it. Row starts are always document starts.

Schedules (torch 2.13, checked on gloo by tests/distributed/test_parallel_parity.py): gpipe, 1f1b (one stage per
rank), interleaved_1f1b, looped_bfs, interleaved_zb (loop placement: stage s on rank s % pp), zbv and dualpipev
(V placement: rank r holds stages r and 2 pp - 1 - r). Stage shapes are given statically, so no metadata-inference
forward runs (it would run the routers on uninitialised inputs and count them).

Receive buffers. torch's PipelineStage makes every micro-batch's receive buffers (a stage's input and its output's
gradient) at set-up and keeps them for the whole step; K3PipelineStage makes a micro-batch's buffers when its
receives are posted and lets them go once its backward has consumed them. A rank then holds boundary tensors for the
micro-batches in flight (about pp x vpp under 1F1B, interleaved 1F1B and DualPipeV), not for the step's m.

Data-parallel gradient reduction starts in a stage's last backward of the step (the schedule's last_backward flag:
buckets are launched as their gradients complete) and ends at `perform_reduce_grad`, which the schedules call right
after that backward: the rest is launched and everything waited for there. Pipeline ZeRO-2 reduce-scatters each
bucket once per stage per step.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from k3train.ops.dtypes import wide
from k3train.models.k3.args import K3ModelArgs
from k3train.models.k3.context import BatchContext
from k3train.models.k3.counts import layer_costs
from k3train.models.k3.documents import Documents
from k3train.models.k3.loss import linear_cross_entropy
from k3train.models.k3.model import K3Model, sources_after
from k3train.distributed import comm
from k3train.parallel.mesh import SCHEDULES, ParallelDims
from k3train.parallel.pipeline_order import Act, sent_output_release


# ---------------------------------------------------------------------------------------------------------------------
# Split
# ---------------------------------------------------------------------------------------------------------------------
def stage_cost_of(costs: dict, stage_layers: list[list[int]]) -> list[float]:
    """Cost of each stage (1-based layer ids): its layers, plus the embedding on the first and the head on the last."""
    n = len(stage_layers)
    return [
        sum(costs["layers"][i - 1] for i in s)
        + (costs["embed"] if k == 0 else 0.0)
        + (costs["head"] if k == n - 1 else 0.0)
        for k, s in enumerate(stage_layers)
    ]


def split_layers(
    args: K3ModelArgs, n_stages: int, *, seq_len: int = 4096, costs: dict | None = None
) -> list[list[int]]:
    """Contiguous 1-based layer ids of each of n_stages stages, every stage non-empty, minimising the most expensive
    stage (embedding on the first, head on the last). Ties go to the split that puts more layers early."""
    n = args.n_layers
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} non-empty stages")
    costs = costs or layer_costs(args, seq_len)
    prefix = list(itertools.accumulate(costs["layers"], initial=0.0))

    def seg(i: int, j: int, k: int) -> float:  # layers [i, j) as stage k
        return (
            prefix[j] - prefix[i] + (costs["embed"] if k == 0 else 0.0) + (costs["head"] if k == n_stages - 1 else 0.0)
        )

    # best[k][j]: minimal max cost of stages 0..k covering layers [0, j); choice[k][j]: start of stage k.
    best = [[float("inf")] * (n + 1) for _ in range(n_stages)]
    choice = [[0] * (n + 1) for _ in range(n_stages)]
    for j in range(1, n + 1):
        best[0][j] = seg(0, j, 0)
    for k in range(1, n_stages):
        for j in range(k + 1, n + 1):
            for i in range(j - 1, k - 1, -1):  # larger i first: ties keep more layers in earlier stages
                v = max(best[k - 1][i], seg(i, j, k))
                if v < best[k][j] * (1 - 1e-12):
                    best[k][j], choice[k][j] = v, i
    stages, j = [], n
    for k in range(n_stages - 1, -1, -1):
        i = choice[k][j] if k > 0 else 0
        stages.insert(0, list(range(i + 1, j + 1)))
        j = i
    return stages


def split_reference(args: K3ModelArgs, n_stages: int, *, costs: dict) -> float:
    """The optimal max stage cost by enumerating every split (exponential; for tests)."""
    n = args.n_layers
    best = float("inf")
    for cut in itertools.combinations(range(1, n), n_stages - 1):
        edges = (0, *cut, n)
        best = min(best, max(stage_cost_of(costs, [list(range(a + 1, b + 1)) for a, b in zip(edges, edges[1:])])))
    return best


# ---------------------------------------------------------------------------------------------------------------------
# Stage modules
# ---------------------------------------------------------------------------------------------------------------------
def stage_part_on_meta(args: K3ModelArgs, layer_ids: list[int], *, first: bool, last: bool) -> nn.Module:
    """The K3Model holding only `layer_ids` (plus the embedding/vision when first, final mix/norm/head when last), on
    the meta device: nothing is allocated until k3train.parallel.parallelize materialises it."""
    with torch.device("meta"):
        model = K3Model(args, layer_ids)
    if not first:
        model.tok_embeddings = None
        model.vision = None
    if not last:
        model.final_res = None
        model.norm = None
        model.output = None
        model.mtp = None
    return model


def build_stage_part(
    args: K3ModelArgs, layer_ids: list[int], *, first: bool, last: bool, device: torch.device | str, seed: int
) -> nn.Module:
    """A stage part materialised on `device` and initialised by name (the values the full model gives them)."""
    model = stage_part_on_meta(args, layer_ids, first=first, last=last)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model


class StageModule(nn.Module):
    """What a PipelineStage runs: one K3Model part, fed (tokens or stacked sources, doc_start). The part is a child
    named `part`; parameters keep their full-model names inside it (engine.model_parts hands out the parts)."""

    def __init__(
        self,
        part: nn.Module,
        *,
        first: bool,
        last: bool,
        autocast_dtype: torch.dtype | None = None,
        boundary_dtype: torch.dtype = torch.float32,
        cp: tuple | None = None,
        fused_backward: bool = False,
    ):
        """cp: (group, layout) under context parallelism: rows are this rank's sequence pieces and doc_start
        (always given then) marks the documents that begin inside them. fused_backward: the part holds recomputed
        regions, so a split-backward schedule's input pass computes the weight gradients too (K3PipelineStage)."""
        super().__init__()
        self.part = part
        self.first, self.last = first, last
        self.autocast_dtype = autocast_dtype
        self.boundary_dtype = boundary_dtype
        self.cp = cp
        self.fused_backward = fused_backward
        self.vision_feed = None
        """The first stage's k3train.parallel.vision_schedule.VisionFeed (set by Pipeline when the part has a vision
        tower): the images of the micro-batch being run."""
        self.chunk = 0
        """The micro-batch being run (set by the pipeline stage before each forward)."""
        self.contexts: list[BatchContext] | None = None
        """The step's micro-batch contexts, prepared by the engine (tables already on the device); None: each
        forward rebuilds its context from doc_start."""

    def forward(self, x: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
        if self.contexts is not None:
            ctx = self.contexts[self.chunk]
        elif self.cp is not None:
            from k3train.parallel.context_parallel import ContextParallel

            group, layout = self.cp
            ctx = BatchContext(cp=ContextParallel.from_local_doc_start(doc_start, group, layout=layout))
        elif doc_start is not None:
            ctx = BatchContext.of(Documents(doc_start))
        else:
            ctx = BatchContext()
        return self.run(x, ctx, self.vision_feed.stage_inputs(self.chunk) if self.vision_feed is not None else {})

    def run(self, x: torch.Tensor, ctx: BatchContext, vision: dict) -> torch.Tensor:
        """The part on (tokens or stacked sources, its BatchContext, image inputs): what forward returns. One process
        calls it directly with the micro-batch's own context; a pipeline stage through forward."""
        mtp = self.last and self.part.mtp is not None
        with torch.autocast(x.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = self.part(x, ctx, return_hidden=self.last, mtp=mtp, **vision)
        if mtp:  # one output tensor for the schedule: [final hidden ; MTP hidden] along the width
            out = torch.cat(out, dim=-1)
        # Fixed dtypes across boundaries so stage shapes can be declared statically.
        return out.to(wide(self.boundary_dtype)) if self.last else out.to(self.boundary_dtype)

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(summed next-token loss, summed MTP loss or None) of the last stage's output [mb, T, D] (with MTP
        [mb, T, 2D] and labels [mb, T, 2]: next-token and MTP targets): its head weight applied chunk by chunk,
        under the stage's autocast as in forward."""
        w = self.part.output.weight
        with torch.autocast(hidden.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            if self.part.mtp is None:
                return linear_cross_entropy(hidden, w, labels)[0], None
            h, u = hidden.chunk(2, dim=-1)
            return linear_cross_entropy(h, w, labels[..., 0])[0], linear_cross_entropy(u, w, labels[..., 1])[0]


class GlobalTokenLoss:
    """loss_fn for the last stage (the only stage in one process): summed token loss of a micro-batch / the step's global target-token count, so
    summing micro-batches and data-parallel ranks gives the one-process mean exactly. With MTP, plus mtp_weight x
    the summed MTP loss / the step's global MTP target count; `sums` keeps each micro-batch's two normalised terms.

    The last stage outputs the final hidden and this applies the stage's head weight (StageModule.head_loss), so no
    [mb, T, V] logits cross into the schedule. The head weight stays a parameter of the stage module and the loss
    is in the stage's autograd graph, so split backward (interleaved_zb, zbv, dualpipev) finds its gradient in the
    weight pass like any other parameter's."""

    def __init__(self, stage: StageModule | None = None, mtp_weight: float = 0.0):
        self.stage = stage
        self.mtp_weight = mtp_weight
        self.denominator = self.mtp_denominator = 1.0
        self.sums: list[torch.Tensor] = []

    def start(self, denominator: float, mtp_denominator: float) -> None:
        """A new step with these global target counts."""
        self.denominator, self.mtp_denominator = float(denominator), float(mtp_denominator)
        self.sums = []

    def __call__(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        main, mtp = self.stage.head_loss(hidden, labels)
        loss, has_mtp = main / self.denominator, mtp is not None
        mtp = mtp / self.mtp_denominator if has_mtp else torch.zeros_like(loss)
        self.sums.append(torch.stack([loss.detach(), mtp.detach()]))
        return loss + self.mtp_weight * mtp if has_mtp else loss


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline stage: reduce hook, p2p accounting, busy time
# ---------------------------------------------------------------------------------------------------------------------
class BusyClock:
    """Seconds a stage spends computing. On CPU, host time around each chunk. On CUDA kernels run asynchronously, so
    host time would measure the launches: a pair of CUDA events brackets each chunk on the current stream, and the
    events are read when `seconds` is asked for (one synchronisation, after the step)."""

    def __init__(self, device: torch.device | None = None):
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.off = False
        """Set while an enclosing span times the work (k3train.parallel.microbatch_overlap: two micro-batches
        taking turns are one span, not two overlapping ones)."""
        self.reset()

    def reset(self) -> None:
        self._host, self._events = 0.0, []

    @contextlib.contextmanager
    def span(self):
        if self.off:
            yield
        elif self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((start, end))
        else:
            t = time.perf_counter()
            try:
                yield
            finally:
                self._host += time.perf_counter() - t

    @property
    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self._host += sum(a.elapsed_time(b) for a, b in self._events) / 1e3
            self._events = []
        return self._host


class SentOutputs:
    """A rank's stage outputs sent to other ranks under a multi-stage schedule, and where it lets them go.

    An output stays in torch's forward cache from its forward to its backward, which needs only its autograd graph
    and shape, not its values (the output is a fresh stack of the AttnRes sources, saved by no backward), and the
    runtime keeps the send works to the step's end. Here each such output is let go right before the first action
    of its rank that consumes a message the receiving rank sent after it began that micro-batch's forward
    (k3train.parallel.pipeline_order.sent_output_release): the send is complete there, so its wait returns at once,
    and the output's data becomes one element broadcast to its shape. A rank so holds the outputs of the
    micro-batches still on their way, not of every micro-batch in flight. Outputs handed to a stage on the same rank
    are that stage's input and stay."""

    observers: list = []
    """Called with the storages each let-go leaves (a memory tracker that follows tensors, such as the dry run's,
    sees the tensor live on and would count its old storage)."""

    def __init__(self, release: dict):
        self.release = release
        self.pending: dict[tuple[int, int], tuple[list, list]] = {}
        self.lock = threading.Lock()  # an overlapped pair's two sides run on two threads
        self.let_go = 0  # outputs let go (for tests)

    def add(self, key: tuple[int, int], works: list, tensors: list) -> None:
        with self.lock:
            self.pending[key] = (works, tensors)

    def before(self, act: Act) -> None:
        with self.lock:
            for key in self.release.get(act, ()):
                if key not in self.pending:
                    continue
                works, tensors = self.pending.pop(key)
                for w in works:
                    w.wait()
                old = [t.untyped_storage() for t in tensors]
                for t in tensors:
                    t.data = torch.empty(1, dtype=t.dtype, device=t.device).expand(t.shape)
                for observe in self.observers:
                    observe(old)
                self.let_go += 1

    def finish(self) -> None:
        """The step's end: the sends still pending are waited for (their outputs leave with the forward cache)."""
        with self.lock:
            for works, _ in self.pending.values():
                for w in works:
                    w.wait()
            self.pending = {}


class _K3Stage:
    """What K3PipelineStage adds to torch's PipelineStage (self.submod, self.is_first, self.stage_index; see its
    docstring): the gradient reduction, busy time, point-to-point byte counts and vision work of a stage."""

    grad_reducer = None
    vision_feed = None

    def _init_k3(self, grad_reducer, vision_feed=None):
        self.grad_reducer = grad_reducer
        self.vision_feed = vision_feed
        self.reduced = False
        self.clock = BusyClock(self.device)
        self.early_sends: list = []
        self.fused_chunks: set[int] = set()
        self.sent: SentOutputs | None = None  # set by build_schedule for multi-stage schedules

    @property
    def busy_s(self) -> float:
        return self.clock.seconds

    def new_step(self):
        self.reduced = False
        self.clock.reset()

    def wait_early_sends(self):
        for w in self.early_sends:
            w.wait()
        self.early_sends = []
        if self.sent is not None:
            self.sent.finish()

    def _send_outputs(self, ops: list, chunk: int) -> list:
        """Under a multi-stage schedule the stage posts its output's sends itself (torch's runtime would post the
        same sends at the same point) and hands them to the rank's SentOutputs, which lets the output go later."""
        if self.sent is None or not ops:
            return ops
        works = [op.op(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer) for op in ops]
        # what was sent is a detached alias of the cached output: both let their storage go
        held = [op.tensor for op in ops] + [t for t in self.fwd_cache[chunk][0] if isinstance(t, torch.Tensor)]
        self.sent.add((self.stage_index, chunk), works, held)
        return []

    def reduce_once(self):
        if not self.reduced:
            self.reduced = True
            if self.vision_feed is not None and self.is_first:  # the tower's last gradients before the reduction
                with self.clock.span():
                    self.vision_feed.finish()
            if self.grad_reducer is not None:
                self.grad_reducer.reduce_part(self.submod.part)

    def perform_reduce_grad(self, grad_scale_factor: int):
        self.reduce_once()
        super().perform_reduce_grad(grad_scale_factor)

    def arm(self):
        """The stage's last backward of the step is about to run: its buckets are reduced as their gradients
        complete (then waited for at reduce_once)."""
        if not self.reduced and self.grad_reducer is not None:
            self.grad_reducer.arm_part(self.submod.part)

    # The forward and backward chunks: timed, the last backward arming the reduction, and the vision work a
    # VisionFeed's plan places before or after each action run around them.
    def forward_one_chunk(self, fwd_chunk_id, *a, **k):
        feed = self.vision_feed
        if self.sent is not None:
            self.sent.before(Act("F", self.stage_index, fwd_chunk_id))
        with self.clock.span():
            if feed is not None:
                act = Act("F", self.stage_index, fwd_chunk_id)
                feed.run_before(act)
                feed.note(act.kind, act.stage, act.mb)
            self.submod.chunk = fwd_chunk_id
            out = super().forward_one_chunk(fwd_chunk_id, *a, **k)
        if not self.has_backward:
            self._release_chunk(fwd_chunk_id)
        return out

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        feed, act = self.vision_feed, Act("B", self.stage_index, bwd_chunk_id)
        if self.sent is not None:
            self.sent.before(Act("B" if full_backward else "I", self.stage_index, bwd_chunk_id))
        if feed is not None:
            with self.clock.span():
                feed.run_before(act)
            feed.note(act.kind, act.stage, act.mb)
        if not full_backward and self.submod.fused_backward:
            # Split backward runs one autograd call for the input gradients and one per parameter group for the
            # weights, and a recomputed region reruns its forward in each: here both passes run as one.
            full_backward = True
            self.fused_chunks.add(bwd_chunk_id)
        if last_backward and full_backward:  # an input-only pass (split backward) leaves weight gradients open
            self.arm()
        with self.clock.span():
            out = super().backward_one_chunk(
                bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward
            )
            self._release_chunk(bwd_chunk_id)
            if full_backward and loss is not None and not loss._is_view():
                # The schedule keeps each micro-batch's loss to the step's end; its spent graph would keep the
                # received input alive (the input's AccumulateGrad node holds it).
                loss.detach_()
            if feed is not None and self.is_first:  # the first stage sends nothing backward
                feed.run_after(act)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        if last_backward:
            self.arm()
        if bwd_chunk_id in self.fused_chunks:  # its weight gradients came with its input pass
            self.fused_chunks.discard(bwd_chunk_id)
            return None
        with self.clock.span():
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    # The point-to-point sends: their bytes counted, and vision work placed in the idle time after an action run
    # once its sends are posted.
    def _send_then_vision(self, ops: list, act: Act) -> list:
        """Vision work placed in the idle time after `act`: post act's sends first (so the next stage is not
        kept waiting), run the work, and hand the schedule nothing left to send."""
        feed = self.vision_feed
        if feed is None or not feed.has_after(act):
            return ops
        self.early_sends += [op.op(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer) for op in ops]
        with self.clock.span():
            feed.run_after(act)
        return []

    # Receive buffers. torch's PipelineStage makes, at set-up, a buffer for every micro-batch of the step (its input
    # and its output's gradient) and keeps them all: O(micro-batches) boundary tensors. Here a micro-batch's buffers
    # are made when its receives are posted and let go once its backward has consumed them, so a stage holds them
    # only for the micro-batches in flight. A buffer not yet made is a _RecvInfo with tensor_meta but no buffer.
    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        if self.is_first:  # root arguments: nothing is received
            return super()._setup_forward_recv_info(num_microbatches, has_backward)
        from torch.distributed.pipelining.stage import _RecvInfo

        src, metas = self.stage_index - 1, self._stage_meta.inputs
        name = f"recv_for_{self.stage_index}_from_{src}"
        self.args_recv_info = {
            mb: tuple(_RecvInfo(name, src, None, m) for m in metas) for mb in range(num_microbatches)
        }

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
        from torch.distributed.pipelining.stage import _RecvInfo

        if self.is_last:
            return ()
        metas = self._stage_meta.output_grads
        return tuple(
            _RecvInfo(f"recv_grad_for_{self.stage_index}_from_{dst[0]}", dst[0], None, metas[i])
            for i, dst in act_send_info.items()
        )

    def _make_buffers(self, infos: tuple) -> None:
        from torch.distributed.pipelining import stage as torch_stage

        for info in infos:
            if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                info.buffer = torch_stage._make_tensor_from_meta(info.tensor_meta, self.device)

    @staticmethod
    def _let_go(infos: tuple) -> None:
        for info in infos:
            if not info.is_root_arg:
                info.buffer = None

    def get_fwd_recv_ops(self, fwd_chunk_id):
        self._make_buffers(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id):
        if self.has_backward and not self.is_last:
            self._make_buffers(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
        """V placement: the next stage's input gradients are handed over; a None one still needs a (zeroed) buffer."""
        for info, grad in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs):
            if grad is None:
                self._make_buffers((info,))
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    def _release_chunk(self, chunk_id: int) -> None:
        """The chunk's backward (or its forward, without backward) has run: what a split backward still needs, its
        weight pass keeps by itself (torch's backward_state)."""
        self._let_go(self.args_recv_info.get(chunk_id, ()))
        self._let_go(self.grad_recv_info.get(chunk_id, ()))

    @staticmethod
    def _counted(ops: list, what: str) -> list:
        for op in ops:
            comm.record("pp", what, op.tensor.numel() * op.tensor.element_size())
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id):
        ops = self._counted(super().get_fwd_send_ops(fwd_chunk_id), "send_fwd")
        ops = self._send_outputs(ops, fwd_chunk_id)
        return self._send_then_vision(ops, Act("F", self.stage_index, fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id):
        ops = self._counted(super().get_bwd_send_ops(bwd_chunk_id), "send_bwd")
        return ops if self.is_first else self._send_then_vision(ops, Act("B", self.stage_index, bwd_chunk_id))


def _pipeline_stage_cls():
    from torch.distributed.pipelining import PipelineStage

    class K3PipelineStage(_K3Stage, PipelineStage):
        """PipelineStage that (1) has `grad_reducer.arm_part(its model part)` run as its last backward of the step
        begins (buckets are then reduced as their gradients complete) and `grad_reducer.reduce_part(its model
        part)` once per step right after that backward (the schedule's REDUCE_GRAD point: what is still missing is
        launched and everything is waited for), (2) counts its point-to-point bytes, (3) measures its busy time,
        (4) on the first pipeline rank, runs the vision work a VisionFeed's plan places around its actions (after
        an action's sends are posted when the work fills the idle time that follows it), (5) makes a micro-batch's
        receive buffers (its input, its output's gradient) when their receives are posted and lets them go after its
        backward, so it holds them for the micro-batches in flight, not for every micro-batch of the step."""

    return K3PipelineStage


class Pipeline:
    """The stages of this pipeline rank and a schedule, built for one micro-batch shape (rebuilt when it changes)."""

    def __init__(
        self,
        *,
        args: K3ModelArgs,
        dims: ParallelDims,
        stage_layers: list[list[int]],
        modules: dict[int, StageModule],
        pp_group,
        device: torch.device,
        grad_reducer=None,
        loss_fn: GlobalTokenLoss | None = None,
    ):
        """grad_reducer: an object with reduce_part(part) (k3train.parallel.zero.ShardedOptimizer), called for each
        stage's model part right after its last backward of the step. loss_fn: the last stage's GlobalTokenLoss
        (default: one without MTP weight). What crosses a stage boundary has the modules' boundary_dtype."""
        self.args, self.dims, self.stage_layers = args, dims, stage_layers
        self.modules = modules  # stage index -> StageModule held by this rank
        self.pp_group, self.device = pp_group, device
        self.grad_reducer = grad_reducer
        self.boundary_dtype = next(iter(modules.values())).boundary_dtype
        self.loss_fn = loss_fn or GlobalTokenLoss(modules.get(dims.n_stages - 1))
        self.vision_feed = None
        first = modules.get(0)
        if first is not None and getattr(first.part, "vision", None) is not None:
            from k3train.parallel.vision_schedule import VisionFeed, plan_vision

            plan = plan_vision(dims) if dims.vision_placement == "bubbles" else None
            self.vision_feed = VisionFeed(
                first.part.vision,
                placement=dims.vision_placement,
                plan=plan,
                autocast_dtype=first.autocast_dtype,
                cp=first.cp,
            )
            first.vision_feed = self.vision_feed
        self._key = None
        self.stages: list = []
        self.schedule = None
        self.overlap = None
        """parallel.ep_overlap=microbatch: the k3train.parallel.microbatch_overlap.MicrobatchOverlap that runs the
        schedule's OVERLAP_F_B actions (its `trace`, when set, records them)."""
        if dims.ep_overlap == "microbatch":
            from k3train.parallel.microbatch_overlap import MicrobatchOverlap

            self.overlap = MicrobatchOverlap()
        self.has_first_stage, self.has_last_stage = 0 in modules, dims.n_stages - 1 in modules

    def _example(self, stage: int, mb: int, T: int, *, output: bool):
        D, n = self.args.dim, self.dims.n_stages
        meta = torch.device("meta")
        if not output and stage == 0:
            return torch.empty(mb, T, dtype=torch.long, device=meta)
        if output and stage == n - 1:  # final hidden (and the MTP hidden beside it)
            width = 2 * D if self.args.mtp_layers else D
            return torch.empty(mb, T, width, dtype=wide(self.boundary_dtype), device=meta, requires_grad=True)
        last_layer = self.stage_layers[stage][-1] if output else self.stage_layers[stage][0] - 1
        S = sources_after(self.args, last_layer)
        return torch.empty(S, mb, T, D, dtype=self.boundary_dtype, device=meta, requires_grad=True)

    def ensure(self, mb: int, T: int) -> None:
        """(Re)build stages and the schedule for micro-batches of shape [mb, T]."""
        key = (mb, T)
        if key == self._key:
            return
        Stage = _pipeline_stage_cls()
        self.stages = []
        for s in sorted(self.modules):
            st = Stage(
                self.modules[s],
                s,
                self.dims.n_stages,
                self.device,
                input_args=self._example(s, mb, T, output=False),
                output_args=self._example(s, mb, T, output=True),
                group=self.pp_group,
            )
            st._init_k3(self.grad_reducer, self.vision_feed)
            self.stages.append(st)
        self.schedule = build_schedule(self.dims, self.stages, self.loss_fn)
        if self.overlap is not None:
            self.overlap.install(self.schedule)
        self._key = key

    def step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        doc_start: torch.Tensor | None,
        denominator: float,
        mtp_labels: torch.Tensor | None = None,
        mtp_denominator: float = 1.0,
        vision: list[dict | None] | None = None,
        contexts: list[BatchContext] | None = None,
    ) -> torch.Tensor:
        """Run the schedule over the whole local batch [microbatches * mb, T]; returns [next-token, MTP] summed
        normalised losses of this rank's micro-batches on the last stage (0 elsewhere; MTP 0 without it).
        vision: per micro-batch, its image inputs (vision_pixels, vision_grid, vision_mask) or None; the first stage
        runs them through its tower. contexts: per micro-batch, its prepared BatchContext (the stages then read it
        instead of rebuilding one from doc_start)."""
        m = self.dims.microbatches
        if input_ids.shape[0] % m:
            raise ValueError(f"local batch of {input_ids.shape[0]} rows does not split into {m} micro-batches")
        self.ensure(input_ids.shape[0] // m, input_ids.shape[1])
        self.loss_fn.start(denominator, mtp_denominator)
        for st in self.stages:
            st.new_step()
        for mod in self.modules.values():
            mod.contexts = list(contexts) if contexts is not None else None
        if self.vision_feed is not None:
            self.vision_feed.start_step(vision or [None] * m)
        elif vision and any(vision) and self.has_first_stage:
            raise ValueError("image input needs a model with a vision tower (model.overrides.vision)")
        kwargs = {} if doc_start is None else {"doc_start": doc_start}
        losses: list[torch.Tensor] = []
        args = (input_ids,) if self.has_first_stage else ()
        target = None
        if self.has_last_stage:
            target = labels if mtp_labels is None else torch.stack([labels, mtp_labels], dim=-1)
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        for st in self.stages:  # schedules that never issue REDUCE_GRAD still get their reduction
            st.reduce_once()
            st.wait_early_sends()
        return torch.stack(self.loss_fn.sums).sum(0) if self.has_last_stage else torch.zeros(2, device=self.device)

    @property
    def busy_s(self) -> float:
        return sum(st.busy_s for st in self.stages)


def build_schedule(dims: ParallelDims, stages: list, loss_fn: Callable):
    """The torch schedule named by dims.schedule (one stage object for single-stage schedules)."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULES[dims.schedule][0])
    sent = SentOutputs(sent_output_release(dims)) if dims.placement != "single" else None
    for st in stages:  # the rank's stages let their sent outputs go (SentOutputs)
        st.sent = sent
    # The loss is already divided by the global token count: no further scaling by the micro-batch count.
    stages = stages[0] if dims.placement == "single" else stages
    return cls(stages, n_microbatches=dims.microbatches, loss_fn=loss_fn, scale_grads=False)
