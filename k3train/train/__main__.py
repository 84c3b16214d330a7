"""`python -m k3train.train --config-name RECIPE [hydra overrides]`."""

from k3train.train.cli import main

if __name__ == "__main__":
    main()
