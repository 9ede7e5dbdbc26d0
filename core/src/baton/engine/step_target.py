"""Whether ``scheduler.target_step_ms`` can steer this engine's steps; off where it cannot.

The latency-aware budget (``baton.sched.step_budget``) sizes prompt chunks from measured step
times. It is turned off, with a log line saying why, where that cannot work or would cost
what users rely on:

- under a batch queue (pipeline parallel): batches overlap, so no step time is measured;
- ``"auto"`` (the default) where the model computes in a 16-bit dtype on CPU: those results
  depend on each step's shapes (which rows ride together, where a prompt is cut), and a budget
  that follows the clock would give the same requests different tokens from run to run. The
  float32 kernels' rows do not depend on their neighbours, so ``auto`` stays on there. A
  number set explicitly is kept (the user chose bounded steps over run-to-run equality).
"""

from __future__ import annotations

import logging

import torch

from baton.config import SchedulerSection
from baton.model_info import ModelInfo

log = logging.getLogger(__name__)

#: Compute dtypes whose results on CPU depend on the step's shapes (oneDNN's kernels, 16-bit sums).
SHAPE_DEPENDENT_DTYPES = frozenset({"bfloat16", "float16"})


def effective_step_target(
    scheduler: SchedulerSection, device: str, info: ModelInfo, batch_queue_size: int
) -> SchedulerSection:
    """``scheduler`` with ``target_step_ms`` off where it cannot steer (module doc); ``device``
    is ``executor.device``."""
    target = scheduler.target_step_ms
    if target == "off":
        return scheduler
    if batch_queue_size > 1:
        # an explicit number the user asked for warns; the default "auto" only informs
        log.log(
            logging.INFO if target == "auto" else logging.WARNING,
            "scheduler.target_step_ms=%s is ignored with a batch queue of %d "
            "(pipeline parallel): batches overlap, so no step time is measured",
            target,
            batch_queue_size,
        )
    elif target == "auto" and info.dtype in SHAPE_DEPENDENT_DTYPES and _on_cpu(device):
        log.info(
            "scheduler.target_step_ms=auto is off: the model computes in %s on CPU, whose "
            "results depend on each step's shapes, and a budget that follows the clock would "
            "give the same requests different tokens from run to run. Set a number of "
            'milliseconds to bound step times anyway, or model.dtype = "float32"',
            info.dtype,
        )
    else:
        return scheduler
    return scheduler.model_copy(update={"target_step_ms": "off"})


def _on_cpu(device: str) -> bool:
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())
