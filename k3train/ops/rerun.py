"""Results an op hands from a layer's forward to that layer's recomputation in backward.

Under whole-layer recompute a layer's forward runs twice: in the forward pass (what it saves is dropped) and again in
backward, to rebuild those saves. An op whose backward needs only its inputs and a few of its outputs (the chunked
attention: q, the latent, its output and log-sum-exp) can keep those outputs from the first run; in the rerun it
saves them beside the rerun's inputs instead of computing them again. Whoever runs the recomputation
(k3train.activation) opens a `RerunMemo` around both runs; an op asks `active()` for it (None outside one, and
inside a module that runs once).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator


class RerunMemo:
    """What the ops of one recomputed call kept in its first run, handed back in call order in its reruns."""

    def __init__(self, on_keep: Callable[[Any], None] | None = None):
        self.kept: list[Any] = []
        self.replaying = False
        self.next = 0
        self.on_keep = on_keep
        """Called with each kept value (the activation handle's accounting of what the memo holds)."""

    def rewind(self) -> None:
        """The call runs again (a recomputation): hand back what the first run kept, from the first op on."""
        self.replaying, self.next = True, 0

    def keep(self, value: Any) -> None:
        self.kept.append(value)
        if self.on_keep is not None:
            self.on_keep(value)

    def take(self, op: str) -> Any:
        if self.next >= len(self.kept):
            raise RuntimeError(f"recomputation ran {op!r} more often than the forward did")
        value, self.next = self.kept[self.next], self.next + 1
        return value


class _Stack(threading.local):
    def __init__(self):
        self.items: list[RerunMemo | None] = []


_STACK = _Stack()


def active() -> RerunMemo | None:
    """The memo of the recomputed call running now on this thread, or None."""
    return _STACK.items[-1] if _STACK.items else None


@contextmanager
def scope(memo: RerunMemo | None) -> Iterator[None]:
    """Run the block with `memo` active (None: no memo, e.g. a module taken out of the recomputation)."""
    _STACK.items.append(memo)
    try:
        yield
    finally:
        _STACK.items.pop()
