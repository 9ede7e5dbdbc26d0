"""The Worker: one device, one model runner. Executors call its methods (maybe in a child process).

The runner comes from a runner factory (``baton.interfaces.RunnerFactory``):
baton's stock runner by default, ``baton.runner.StockRunner(hooks)`` for a
parallel rank, or any class implementing ``baton.interfaces.ModelRunner``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from baton.config import BatonConfig
from baton.errors import ExecutorError, InvalidRequestError
from baton.model.sharded_state import save_sharded_state
from baton.plugins.registry import get_registry
from baton.protocol import (
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    ModelCapabilities,
    ModelInfo,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerMemory,
)
from baton.worker.kv_connector import WorkerKVConnector
from baton.worker.memory import measure
from baton.worker.model_runner import ModelRunner as StockModelRunner
from baton.worker.model_runner import RunnerSettings
from baton.worker.profiler import WorkerProfiler, profile_dir

if TYPE_CHECKING:
    from baton.interfaces import ModelRunner, RunnerFactory
    from baton.kv_transfer.connector import KVWorkerContext

log = logging.getLogger(__name__)


def select_device(name: str) -> torch.device:
    """``executor.device`` -> a torch device: "auto" is CUDA when available, else CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ExecutorError(
                f"executor.device={name!r} but torch sees no CUDA device; use 'cpu' or 'auto'"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ExecutorError(
                f"executor.device={name!r} but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        if device.index is None:
            # torch.cuda.set_device and the caching allocator's accounting need an index
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def tune_malloc() -> bool:
    """Keep freed multi-MB blocks in the heap (glibc): no page faults on every large activation.

    glibc gives large freed blocks back to the OS (munmap / heap trim), so each
    fresh prefill-sized activation faults its pages in again; raising the mmap
    and trim thresholds keeps them. Process-wide: the heap then keeps up to
    1 GiB of freed memory instead of returning it. Returns False where this is
    not glibc.
    """
    import ctypes
    import ctypes.util
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
    ok &= libc.mallopt(m_trim_threshold, 1 << 30)
    ok &= libc.mallopt(m_top_pad, 64 << 20)
    return bool(ok)


def runner_settings(cfg: BatonConfig) -> RunnerSettings:
    """The sections of ``cfg`` the stock model runner reads."""
    return RunnerSettings(
        model=cfg.model,
        cache=cfg.cache,
        scheduler=cfg.scheduler,
        executor=cfg.executor,
        lora=cfg.lora,
    )


def stock_runner(cfg: BatonConfig, device: torch.device) -> StockModelRunner:
    """The default runner factory (``baton.interfaces.RunnerFactory``): baton's stock runner
    with ``cfg``'s sections."""
    return StockModelRunner(runner_settings(cfg), device)


class Worker:
    """Owns the device choice and a model runner; every public method is an RPC target.

    Implements ``baton.interfaces.Worker`` (with its optional methods); ``runner`` is the
    runner factory (default: baton's stock runner).

    ``model_runner`` is the runner (``baton.interfaces.ModelRunner``): what a
    ``collective_rpc`` callable, called as ``method(worker, ...)``, reaches.
    """

    #: The runner factory init_device calls as ``runner_cls(config, device)`` (a class is one).
    runner_cls: RunnerFactory = staticmethod(stock_runner)

    def __init__(
        self, cfg: BatonConfig, rank: int = 0, runner: RunnerFactory | None = None
    ) -> None:
        self.cfg = cfg
        self.rank = rank
        if runner is not None:
            self.runner_cls = runner
        self.device: torch.device | None = None
        self.model_runner: ModelRunner | None = None
        self._profiler: WorkerProfiler | None = None
        #: This worker's half of the KV connector (``start_kv_connector``); None: none.
        self.kv_connector: WorkerKVConnector | None = None

    def init_device(self) -> None:
        self.device = select_device(self.cfg.executor.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.cfg.executor.num_threads is not None:
            torch.set_num_threads(self.cfg.executor.num_threads)
        if self.device.type == "cpu":
            # ~15% faster prefill on the 2-core reference machine (plugins/bench/scripts/profile_runner.py --malloc-tune)
            log.debug("glibc malloc tuned for large activations: %s", tune_malloc())
        torch.manual_seed(self.cfg.model.seed)
        log.info(
            "worker %d on %s (%d torch threads)", self.rank, self.device, torch.get_num_threads()
        )
        self.model_runner = self.runner_cls(self.cfg, self.device)

    def load_model(self) -> None:
        self._runner().load_model()

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise ExecutorError("worker used before init_device()")
        return self.model_runner

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self._runner().get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        return self._runner().determine_available_memory()

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        self._runner().initialize_kv_cache(config)

    def start_kv_connector(self, context: KVWorkerContext) -> None:
        """Build this worker's half of the configured KV connector (``kv_transfer.connector``)
        and hand it the runner's KV cache; called by the engine once the cache exists."""
        name = self.cfg.kv_transfer.connector
        entry = get_registry().get("kv_connector", name)
        connector = entry.create(self.cfg, entry.settings(self.cfg))
        half = WorkerKVConnector(connector.worker_side(context), name)
        half.register(self._runner())
        self.kv_connector = half

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        kv = self.kv_connector
        if kv is None:
            return self._runner().execute_model(scheduler_output)
        kv.start(scheduler_output)  # synchronous loads are in the cache when it returns
        out = self._runner().execute_model(scheduler_output)
        kv.finish()  # the forward wrote this step's KV: saves copy it out now
        return kv.attach(out)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        out = self._runner().sample_tokens(grammar_output)
        return out if self.kv_connector is None else self.kv_connector.attach(out)  # type: ignore[return-value]

    def get_model_info(self) -> ModelInfo:
        """The loaded model's limits (effective max_model_len, vocab, EOS ids)."""
        return self._runner().model_info

    def get_model_capabilities(self) -> ModelCapabilities:
        """What the loaded model allows (chunked prefill, prefix caching)."""
        return self._runner().get_model_capabilities()

    def sleep(self, level: int) -> None:
        """Free the runner's KV cache (level 1) and its weights too (level 2); see ``wake_up``."""
        self._sleepable("sleep").sleep(level)

    def wake_up(self) -> None:
        """Load the weights and allocate the KV cache again after ``sleep`` (handed to the KV
        connector's half again: the tensors are new)."""
        runner = self._sleepable("wake_up")
        runner.wake_up()
        if self.kv_connector is not None:
            self.kv_connector.register(runner)

    def can_sleep(self) -> bool:
        """Whether the runner implements ``sleep`` and ``wake_up`` (``baton.interfaces.Sleepable``)."""
        runner = self._runner()
        return callable(getattr(runner, "sleep", None)) and callable(
            getattr(runner, "wake_up", None)
        )

    def _sleepable(self, method: str) -> Any:
        runner = self._runner()
        if not self.can_sleep():
            raise ExecutorError(
                f"runner {type(runner).__name__} has no {method}() (baton.interfaces.Sleepable): "
                "it cannot free its memory; use baton.runner.StockRunner or implement sleep/wake_up"
            )
        return runner

    def start_profile(self) -> None:
        """Start the torch profiler in this worker (``observability.profile_dir`` must be set)."""
        if self._profiler is None:
            folder = profile_dir(self.cfg.observability.profile_dir)
            self._profiler = WorkerProfiler(folder, self.rank, self.device)
        self._profiler.start()

    def stop_profile(self) -> str:
        """Stop the profiler and write its chrome trace; the file's path."""
        if self._profiler is None or not self._profiler.running:
            raise InvalidRequestError(
                f"worker {self.rank} is not profiling: call start_profile() first"
            )
        return self._profiler.stop()

    def save_sharded_state(
        self, path: str, pattern: str | None = None, max_size: int | None = None
    ) -> list[str]:
        """Write this rank's model, as sharded, into ``path`` (``baton.model.sharded_state``);
        the file names written. Refused for quantized layers and LoRA wrappers."""
        runner = self._runner()
        model = getattr(runner, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise ExecutorError(
                f"runner {type(runner).__name__} holds no model (asleep at level 2, or not a "
                "torch runner): wake it up, or use baton's stock runner"
            )
        for name, module in model.named_modules():
            kind = type(module).__module__
            if kind.startswith(("baton.quant", "baton.lora")):
                raise InvalidRequestError(
                    f"cannot save a sharded state with {type(module).__name__} at {name!r}: "
                    "quantized layers and LoRA wrappers do not load back as plain weights; "
                    "start the engine with model.quantization='none' and lora.enable_lora=false"
                )
        return save_sharded_state(model, path, self.rank, pattern, max_size)

    def add_lora(self, lora_request: Any) -> bool:
        """Read a LoRA adapter into the runner's host memory; False if it was there already."""
        return bool(self._lora_runner("add_lora").add_lora(lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        """Forget a LoRA adapter in the runner; False if it was not loaded."""
        return bool(self._lora_runner("remove_lora").remove_lora(lora_id))

    def list_loras(self) -> list[int]:
        """The ids of the LoRA adapters the runner holds."""
        return list(self._lora_runner("list_loras").list_loras())

    def _lora_runner(self, method: str) -> Any:
        runner = self._runner()
        if not callable(getattr(runner, method, None)):
            raise ExecutorError(
                f"runner {type(runner).__name__} has no {method}(): it cannot serve LoRA "
                "adapters; use baton's stock runner or set lora.enable_lora = false"
            )
        return runner

    def memory_usage(self) -> WorkerMemory:
        """This worker's memory: its process's RSS, the KV cache's and the weights' storages."""
        return measure(self.rank, self.device, self.model_runner)

    def check_health(self) -> None:
        """Nothing to probe in-process; a dead device raises on the next step."""

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
            self.kv_connector = None
        self.model_runner = None
