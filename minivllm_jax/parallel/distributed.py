"""Several processes (hosts) as one engine, on JAX's own multi-controller runtime.

`initialize()` joins the processes into one JAX runtime (`jax.distributed.initialize`; on
CPU with gloo collectives), after which `jax.devices()` lists every process's devices and a
tensor-parallel mesh may span hosts. Every process loads the same model the same way (`LLM(...,
tensor_parallel_size=N)`, N = all devices): each holds only its shards. Process 0, the
leader, runs the scheduler, the API and everything else on the host; the others only follow
(`LLM.follow()`): each device program the leader runs, they run too, in the same order, with
the same host inputs (SPMD: the collectives inside a step need every process in it).

`StepChannel` carries those inputs: before each program call the leader broadcasts a small
header (what to run, its bucket) and then the call's host arrays, whose shapes the followers
know from the header; both are `multihost_utils.broadcast_one_to_all`, itself a collective
over the same devices. Warm-up needs no messages: it is deterministic, so every process runs
the same programs in the same order by itself.

Settings, from arguments or the environment: coordinator address (`MINIVLLM_COORDINATOR`,
host:port of process 0), number of processes (`MINIVLLM_NUM_PROCESSES`), this process's id
(`MINIVLLM_PROCESS_ID`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

ENV_COORDINATOR = "MINIVLLM_COORDINATOR"
ENV_NUM_PROCESSES = "MINIVLLM_NUM_PROCESSES"
ENV_PROCESS_ID = "MINIVLLM_PROCESS_ID"

# Header ops: what the leader runs next.
STOP, STEP, LOAD_PENALTY_ROW, MULTI_STEP, VERIFY = 0, 1, 2, 3, 4
STEP_OPS = {
    "step": STEP,
    "multi_step": MULTI_STEP,
    "verify": VERIFY,
}  # the runner's kinds of step program


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Join the multi-process runtime (call before anything else uses JAX). Unset values come
    from the environment; with one process (or none given) this does nothing and returns False."""
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = int(os.environ[ENV_NUM_PROCESSES])
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = int(os.environ[ENV_PROCESS_ID])
    if num_processes is None or num_processes == 1:
        return False
    if not coordinator_address or process_id is None:
        raise ValueError(
            f"a run of {num_processes} processes needs the coordinator address (host:port of process 0) "
            f"and this process's id ({ENV_COORDINATOR}, {ENV_PROCESS_ID})"
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    # CPU devices of several processes talk through gloo (GPUs and TPUs bring their own).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address, num_processes=num_processes, process_id=process_id
    )
    return True


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    return jax.process_index() == 0


class StepChannel:
    """The leader's program calls, announced to the followers (see the module docstring)."""

    def announce(self, op: int, a: int = 0, b: int = 0, payload: Any = None) -> None:
        """Leader: broadcast what runs next, then its host inputs (if any)."""
        multihost_utils.broadcast_one_to_all(np.array([op, a, b], np.int32))
        if payload is not None:
            multihost_utils.broadcast_one_to_all(payload)

    def next_op(self) -> tuple[int, int, int]:
        """Follower: wait for the leader's next announcement."""
        op, a, b = (int(x) for x in multihost_utils.broadcast_one_to_all(np.zeros(3, np.int32)))
        return op, a, b

    def payload(self, template: Any) -> Any:
        """Follower: the announced call's host inputs, shaped like `template`."""
        return multihost_utils.broadcast_one_to_all(template)
