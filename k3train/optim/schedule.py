"""The warmup-stable-decay learning-rate schedule, for a torch without a working torchtitan.

The trainer builds its schedule with torchtitan's LRSchedulersContainer (torchtitan 0.3.0). Its import pulls in much
of torchtitan (configuration, distributed checkpointing, spmd_types), which newer torch releases carry and older ones
may not; where that import fails, the trainer builds this schedule instead: the same factors step by step, the same
state ({"last_epoch": n}, so checkpoints move between the two), and the same interface (`schedulers`, `step`,
`state_dict`, `load_state_dict`). tests/unit/test_schedule.py compares the two.

With T steps, W = min(warmup, T) warmup steps and D = round(T * decay_ratio) decay steps (at most T - W), the factor
of the base learning rate at 0-based step s is
    (s + 1) / W                                 s < W                 linear warmup
    1                                           s < T + 1 - D         stable (one step past T keeps the end > 0)
    m + (1 - m) (1 - (s + 1 - (T + 1 - D)) / D)  otherwise            linear decay towards m = min_lr_ratio
"""

from __future__ import annotations

from torch.optim.lr_scheduler import LambdaLR


class WarmupStableDecay:
    """One LambdaLR per optimizer, all following the factor above."""

    def __init__(self, optimizers, *, steps: int, warmup_steps: int, decay_ratio: float, min_lr_ratio: float):
        self.warmup = min(int(warmup_steps), steps)
        self.decay = min(round(steps * decay_ratio), steps - self.warmup)
        self.decay_start = steps + 1 - self.decay  # warmup + stable steps
        self.min_lr_ratio = float(min_lr_ratio)
        self.schedulers = [LambdaLR(opt, self.factor) for opt in optimizers]

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return float((step + 1) / self.warmup)
        if step < self.decay_start:
            return 1.0
        left = 1 - float(step + 1 - self.decay_start) / self.decay
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * left

    def __iter__(self):
        return iter(self.schedulers)

    def __len__(self) -> int:
        return len(self.schedulers)

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict:
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict: dict) -> None:
        last = state_dict["last_epoch"]
        for s in self.schedulers:
            s.last_epoch = last
            s._step_count = last + 1
            s._last_lr = s.get_lr()
