"""The public seam for running the model: baton's stock model runner, changed by hooks.

An executor hands its workers a *runner factory* (``baton.interfaces.RunnerFactory``:
``factory(config, device) -> ModelRunner``). Most executors want baton's own
runner (persistent batch, paged KV cache, sampler, structured output, per-request
fault containment) on a changed model: a shard of every layer, a stage of the
layer stack. They pass ``StockRunner(MyHooks)``; ``MyHooks`` subclasses
``ModelRunnerHooks`` and overrides only what it changes:

- ``prepare_model(model)``: change the loaded model while it is still on the CPU
  (shard it, cut it), before quantization and the move to the device;
- ``loaded(model)``: once loaded, the layers and heads this runner's KV cache holds;
- ``forward(run, num_tokens)``: wrap each step's forward (receive hidden states
  before it, send them after it);
- ``samples()``: whether this runner samples (one rank of a parallel group does).

A runner that is not baton's implements ``baton.interfaces.ModelRunner`` and is
passed as its own factory (a class taking ``(config, device)`` is one).

An executor that runs its own worker loop (on ``baton.executor.group.WorkerGroup``)
builds each worker with ``load_worker(config, runner)``: baton's worker
(``baton.interfaces.Worker``) around the runner, what every call of the engine's
``collective_rpc`` is handed.
Factories and hooks travel to spawned worker processes by pickle: define them at
module level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from baton.errors import PluginError
from baton.model.loader import load_hf_config
from baton.worker.model_runner import ModelRunner as Stock
from baton.worker.runner_hooks import HooksFactory, KVShape, LoadedModel, ModelRunnerHooks
from baton.worker.worker import Worker, runner_settings

if TYPE_CHECKING:
    import torch

    from baton.config import BatonConfig
    from baton.interfaces import ModelRunner, RunnerFactory

__all__ = [
    "KVShape",
    "LoadedModel",
    "ModelRunnerHooks",
    "StockRunner",
    "load_worker",
    "model_config",
]


class StockRunner:
    """A runner factory: baton's stock runner, with ``hooks()`` (made in the worker) if given.

    Picklable when ``hooks`` is a module-level class or function.
    """

    def __init__(self, hooks: HooksFactory | None = None) -> None:
        if hooks is not None and not callable(hooks):
            raise PluginError(
                f"StockRunner(hooks=...) takes a ModelRunnerHooks class or a function that "
                f"returns one, got {hooks!r}"
            )
        self.hooks = hooks

    def __call__(self, config: BatonConfig, device: torch.device) -> ModelRunner:
        hooks = self.hooks() if self.hooks is not None else None
        if hooks is not None and not isinstance(hooks, ModelRunnerHooks):
            raise PluginError(
                f"StockRunner: hooks factory {self.hooks!r} returned {type(hooks).__name__}, "
                "not a baton.runner.ModelRunnerHooks"
            )
        return Stock(runner_settings(config), device, hooks=hooks)

    def __repr__(self) -> str:
        return f"StockRunner({getattr(self.hooks, '__qualname__', self.hooks)!r})"


def load_worker(
    config: BatonConfig, runner: RunnerFactory | None = None, *, rank: int = 0
) -> Worker:
    """baton's worker for ``config``, loaded: its device chosen (``executor.device``, torch
    threads ``executor.num_threads``), its runner made by ``runner`` (default
    ``StockRunner()``) and the runner's ``load_model()`` done. Call it in the process (and
    thread) that runs the steps.

    It implements ``baton.interfaces.Worker`` with its optional methods (hand it to every
    ``collective_rpc`` call) and passes the runner's own on: ``determine_available_memory()``,
    ``initialize_kv_cache(config)``, ``execute_model(scheduler_output)``,
    ``sample_tokens(grammar_output)``; ``rank`` is what ``memory_usage`` reports."""
    worker = Worker(config, rank=rank, runner=runner)
    worker.init_device()
    worker.load_model()
    return worker


def model_config(config: BatonConfig) -> Any:
    """The transformers config of ``config.model.name`` (read from its folder, no weights):
    an executor's checks before any worker starts (head counts, layers)."""
    return load_hf_config(config.model)[1]
