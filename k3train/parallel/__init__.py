"""Parallelism for K3: device mesh and layout checks (mesh), pipeline stages and schedules (pipeline), ZeRO-1 and
Pipeline ZeRO-2 (zero), expert parallelism (expert_parallel, ep_dispatch, moonep, moonep_dispatch), context
parallelism (context_parallel), and the training engine that composes them (engine). Collectives and their ledger
are k3train.distributed.comm.

The package imports none of its submodules, so importing a light one (the MoonEP planner, say) does not import
torch.distributed.pipelining.
"""
