"""`python -m k3train.train --config-name RECIPE [hydra overrides]`."""

import os

# Idle OpenMP threads sleep instead of spinning. On a CPU shared with other processes, spinning threads of a
# 2-thread run make every small op wait for a descheduled peer (steps of the tiny model went from ~0.8 s to 7-28 s
# on a loaded 2-core machine); sleeping costs little when the machine is idle. Read when torch loads OpenMP, so it
# is set before any import; an explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from k3train.train.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
