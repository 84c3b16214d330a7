"""A dry run's finished ranks kept on disk, so that a stopped run goes on from where it stopped.

A k3_long_context rank takes 6 to 13 minutes on one core and its 17 default ranks about 1.5 hours on two.
`python -m k3train.dryrun` writes each rank's result (k3train.dryrun.run.RankResult, pickled) to
runs/dryrun/<recipe>.ranks/<key>/ as the rank finishes and, run again after a stop, reads back the ranks found there
instead of stepping them. The key digests everything a result depends on: the resolved config, the world size, and
the source files of k3train and k3kernels (a code change steps every rank again). The command removes its folder
once it has printed the tables; folders of runs that never finished stay until removed by hand.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from pathlib import Path

import k3kernels

import k3train
from k3train.digest import values_sha256


def source_digest() -> str:
    """SHA-256 digest over the path and bytes of every .py file of k3train and k3kernels."""
    parts = []
    for root in (Path(k3train.__file__).parent, Path(k3kernels.__file__).parent):
        for f in sorted(root.rglob("*.py")):
            parts += [f.relative_to(root.parent).as_posix(), f.read_bytes()]
    return values_sha256(*parts)


class RankStore:
    """The finished ranks of one dry run (one resolved config and world, this source) under `root`."""

    def __init__(self, root: str | os.PathLike, spec):
        key = values_sha256(dataclasses.asdict(spec.config), spec.world, source_digest(), length=16)
        self.dir = Path(root) / key

    def _path(self, rank: int, loads: str, microbatches: int) -> Path:
        return self.dir / f"rank{rank}-{loads}-m{microbatches}.pkl"

    def load(self, rank: int, loads: str, microbatches: int):
        """The rank's RankResult if this run finished it before, else None."""
        path = self._path(rank, loads, microbatches)
        if not path.exists():
            return None
        with open(path, "rb") as f:
            return pickle.load(f)

    def save(self, result, loads: str, microbatches: int) -> None:
        """Write one finished rank (whole or not at all: written aside, then renamed)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self._path(result.rank, loads, microbatches)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        os.replace(tmp, path)

    def clear(self) -> None:
        """Remove this run's folder, and the recipe's folder when no other run's is left in it."""
        shutil.rmtree(self.dir, ignore_errors=True)
        try:
            self.dir.parent.rmdir()
        except OSError:  # another run's folder is there (or it is gone already)
            pass
