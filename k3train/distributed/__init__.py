"""The bottom of the package: every collective the step runs (comm), labelled by mesh dimension and counted,
and every host read of device values it allows (host_sync).

Nothing here imports another k3train package, so every layer above (ops' context parallelism, the optimizers,
parallel's engine) may use it."""
