"""Will a run fit, and how fast will it go: the memory and step-time planner (python -m k3train.plan).

    plan = plan_run(load_spec("k3_full", world_size=2048), gpu_spec("h100_80g"), gpus_per_node=8)
    print(format_plan(plan))

Modules: gpus (the GPU table), efficiency (the rate each op class of the executed work runs at, per GPU, with its
source), state_memory (parameters, gradients, master weights, optimizer states: exact),
activations (saved activations per module and policy), comm_bytes (the bytes a step communicates), schedule_sim
(the pipeline schedule in time and memory), planner (the plan, its table, JSON and figure), meter and measure (the
check against real runs on CPU).
"""

from __future__ import annotations

from k3train.plan.gpus import GPU, GPUS, detect_gpu, gpu_spec


def startup_check(spec, gpu: GPU, *, gpus_per_node: int) -> None:
    """ConfigError naming the pipeline rank and its biggest term when the resolved run (k3train.config.RunSpec) is
    predicted not to fit `gpu`."""
    from k3train.errors import ConfigError
    from k3train.plan.planner import plan_run, refusal

    plan = plan_run(spec, gpu, gpus_per_node=max(1, gpus_per_node))
    if not plan.fits:
        raise ConfigError(f"plan: {refusal(plan)}")


__all__ = ["GPU", "GPUS", "detect_gpu", "gpu_spec", "startup_check"]
