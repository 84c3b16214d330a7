"""The dry run: each chosen rank's real training step at full size on fake tensors and a fake process group
(python -m k3train.dryrun --config-name RECIPE [overrides] dryrun.ranks=[...]). See k3train.dryrun.run."""
