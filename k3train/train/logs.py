"""Logging of training processes: the "k3train" logger, configured by Hydra's job_logging
(configs/hydra/job_logging/k3train.yaml) when training runs from the command line."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("k3train")


class BelowWarning(logging.Filter):
    """Passes records below WARNING: information goes to stdout, warnings and errors to stderr only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


class ConsoleHandler(logging.StreamHandler):
    """A stream handler whose lines leave tqdm's progress bar intact (written with tqdm.write, which clears the bar
    and draws it again below the line)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


def ensure_console() -> None:
    """Where nothing configured logging (k3train.train.run called from a script), the run's lines still reach the
    console: the "k3train" logger gets a handler of its own. Hydra's job_logging, or any handler an application
    set up, is left alone."""
    if log.hasHandlers():
        return
    handler = ConsoleHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
