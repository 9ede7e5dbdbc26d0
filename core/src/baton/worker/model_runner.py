"""The model runner: holds the model, the paged KV cache and the persistent batch; runs steps.

One step: apply the SchedulerOutput to the persistent batch -> build the
flattened inputs -> forward (logits only where a request samples) -> sample.
Tensor- and pipeline-parallel workers run this same runner with hooks
(``baton.runner.ModelRunnerHooks``: change the model before it moves to the
device, the KV shape it holds, wrap the forward, sample or not). Everything
runs under ``torch.inference_mode``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from baton.config import BatonConfig
from baton.errors import ExecutorError, InvalidRequestError
from baton.lora.request import LoRARequest
from baton.pooling_params import default_pooling_type
from baton.protocol import (
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    ModelCapabilities,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from baton.runner import KVShape, LoadedModel, ModelRunnerHooks
from baton.worker.attention import META_KWARG, AttentionMetadata, DecodeGroup, PrefillSeq
from baton.worker.cpu_features import native_compute
from baton.worker.cpu_linear import CpuLMHead, use_small_batch_linears
from baton.worker.fast_decode import FastDecode, build_fast_decode
from baton.worker.headless import head_kwargs, is_bidirectional
from baton.worker.input_batch import BatchContractError, InputBatch
from baton.worker.kv_cache_dtype import kv_cache_dtype
from baton.worker.lora import LoRAModel
from baton.worker.memory import release_device_memory, release_host_memory
from baton.worker.pooler import Pooler
from baton.worker.sampler import Sampler, apply_bitmask
from baton.worker.step_inputs import StepInputBuilder, StepInputs, sampling_metadata

log = logging.getLogger(__name__)

GiB = 1 << 30
#: KV cache on CPU when nothing is configured: enough for every sequence at full length, at most this.
CPU_DEFAULT_KV_BYTES = 1 * GiB
#: Fraction of device memory on CUDA when neither kv_cache_memory nor memory_utilization is set.
CUDA_DEFAULT_UTILIZATION = 0.9
#: Prompt positions scored per log_softmax (prompt_logprobs): bounds the extra memory a long
#: prompt chunk takes (rows x vocab floats) beside its logits.
PROMPT_SCORE_ROWS = 256


def describe(error: BaseException) -> str:
    """How a request's failure is reported: ``"ExceptionType: message"``."""
    return f"{type(error).__name__}: {error}"


def log_contained(req_id: str, what: str, error: BaseException) -> None:
    """Log a failure attributed to one request (once, where it was caught)."""
    log.warning("request %s failed %s: %s", req_id, what, describe(error))
    log.debug("request %s: traceback", req_id, exc_info=error)


@dataclass
class PendingStep:
    """A step between its forward and its sampling (sampling waits for a grammar bitmask)."""

    logits: torch.Tensor | None  # None: nothing ran (every scheduled request failed to prepare)
    inputs: StepInputs | None
    #: requests that failed to prepare this step -> "ExceptionType: message"
    failed: dict[str, str]
    #: pooling requests whose prompt ended this step -> their vector (worker/pooler.py)
    pooled: dict[str, torch.Tensor] | None = None


def zeros_lazy(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU from calloc, so its pages cost memory only once written.

    Attention reads whole blocks, including slots no request wrote yet: zeros
    keep them finite. torch.zeros would touch (and make resident) every page.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    np_dtype = {
        torch.float32: np.float32,
        torch.float16: np.float16,
        torch.float64: np.float64,
    }.get(dtype)
    if np_dtype is None:  # bfloat16: same size as int16, zero bits are 0.0
        return torch.from_numpy(np.zeros(shape, dtype=np.int16)).view(dtype)
    return torch.from_numpy(np.zeros(shape, dtype=np_dtype))


def activation_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes in: its first floating-point parameter's (quantized blocks are uint8)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    raise ExecutorError(f"{type(model).__name__} has no floating-point parameter")


def head_vocab_size(head: torch.nn.Module) -> int:
    """Rows of the LM head: ``out_features`` (nn.Linear, QuantLinear), else its weight's first dim."""
    n = getattr(head, "out_features", None)
    return int(n) if isinstance(n, int) else int(head.weight.shape[0])


class ModelRunner:
    """Runs one model on one device for the engine core (through a Worker).

    Implements ``baton.interfaces.ModelRunner``; ``hooks`` change what a parallel
    rank holds and does (``baton.runner``).
    """

    def __init__(
        self, cfg: BatonConfig, device: torch.device, hooks: ModelRunnerHooks | None = None
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.hooks = hooks if hooks is not None else ModelRunnerHooks()
        self.block_size = cfg.cache.block_size
        self.max_num_reqs = cfg.scheduler.max_num_seqs
        self.max_num_tokens = cfg.scheduler.max_num_batched_tokens
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor | None] = []
        self.num_blocks = 0
        self._pending: PendingStep | None = None
        self.fast_decode: FastDecode | None = None
        #: executor.batch_invariant: every step runs fast_decode's invariant path
        self.invariant = cfg.executor.batch_invariant
        #: The adapted layers and the adapters read (lora.enable_lora); None: LoRA off.
        self.lora: LoRAModel | None = None
        # the model's own pooling type: load_model
        self.pooler = Pooler(
            "last", cfg.model.pooling_normalize, invariant=cfg.executor.batch_invariant
        )
        #: prompt logprobs of requests whose prompt is still being computed (chunked prefill)
        self._prompt_lps: dict[str, list[TokenLogprobs]] = {}

    # ------------------------------------------------------------------ model

    def load_model(self) -> None:
        from baton.model_info import read_model_info
        from baton.worker.model_loader import load_model, model_folder

        folder = model_folder(self.cfg)
        self.model_info = read_model_info(folder, self.cfg.model.max_model_len)
        self.pooler.pooling_type = default_pooling_type(
            self.cfg.model.pooling_type, self.model_info
        )
        self.model = load_model(self.cfg, self.device, prepare=self.prepare_model)
        self.hf_config = self.model.config
        text = self.hf_config.get_text_config()
        self.num_layers = text.num_hidden_layers
        self.num_heads = text.num_attention_heads
        self.num_kv_heads = getattr(text, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.num_heads
        self.dtype = activation_dtype(self.model)
        self._apply_kv_shape()
        self.model_info = msgspec.structs.replace(
            self.model_info,
            dtype=str(self.dtype).removeprefix("torch."),
            dtype_native=native_compute(self.dtype, self.device),
        )
        self.kv_dtype = kv_cache_dtype(self.cfg.cache.dtype, self.dtype, self.device)
        head = self.model.get_output_embeddings()
        #: a base model without an LM head (BertModel, ...): it only pools (worker/headless.py)
        self.headless = head is None
        self.vocab_size = head_vocab_size(head) if head is not None else self.model_info.vocab_size
        self.max_model_len = self.model_info.max_model_len
        self.eos_token_ids = list(self.model_info.eos_token_ids)
        self.input_batch = InputBatch(
            self.max_num_reqs,
            self.max_model_len,
            self.block_size,
            vocab_size=self.model_info.vocab_size,
        )
        self.kernels = self._use_kernels()
        if self.device.type == "cpu":
            self._cpu_linears()
        self.fast_decode = self._fast_decode()
        self.lora = self._lora()  # after fast_decode: it took the layers' weights as they are
        self.inputs = StepInputBuilder(
            self.input_batch,
            self.max_num_tokens,
            self.device,
            kernels=self.kernels,
            token_tables=self.invariant,
        )
        self.sampler = Sampler(self.device, self.cfg.model.seed)

    def _apply_kv_shape(self) -> None:
        """The layers and heads this runner holds: the model's, or what its hooks say."""
        own = KVShape(
            num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads
        )
        shape = self.hooks.loaded(
            LoadedModel(
                model=self.model,
                device=self.device,
                dtype=self.dtype,
                max_num_tokens=self.max_num_tokens,
                shape=own,
            )
        )
        if not isinstance(shape, KVShape):
            raise ExecutorError(
                f"{type(self.hooks).__name__}.loaded returned {type(shape).__name__}, "
                "not a baton.runner.KVShape"
            )
        self.num_layers, self.num_heads = shape.num_layers, shape.num_heads
        self.num_kv_heads = shape.num_kv_heads

    def get_model_capabilities(self) -> ModelCapabilities:
        """What the loaded model allows: chunked prefill and prefix caching need causal layers."""
        from baton.worker.attention import model_capabilities

        chunked, prefix, reason = model_capabilities(self.hf_config)
        if is_bidirectional(self.model):
            chunked, prefix = False, False
            reason = f"{type(self.model).__name__} attends both ways (an encoder)"
        return ModelCapabilities(
            supports_chunked_prefill=chunked, supports_prefix_caching=prefix, reason=reason
        )

    def _use_kernels(self) -> bool:
        """Whether decode attention and linears run through baton's C++ kernels: float32 on CPU, when they build."""
        if not self.cfg.executor.cpu_kernels:
            return False
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return False
        from baton.kernels import loader

        return loader.load()

    def _fast_decode(self) -> FastDecode | None:
        """The native layer stack for decode-only steps, when executor.fast_decode is on and it applies.

        Only this class's own forward without hooks: a parallel runner (hooks or a subclass)
        holds a cut or sharded model.
        """
        if not self.cfg.executor.fast_decode:
            return None
        cls = type(self)
        why = None
        if (cls.forward, cls.prepare_model) != (ModelRunner.forward, ModelRunner.prepare_model):
            why = f"{cls.__name__} runs a cut or sharded model"
        elif type(self.hooks) is not ModelRunnerHooks:
            why = f"hooks {type(self.hooks).__name__} change the model"
        elif self.invariant and not self.kernels:
            why = f"baton's C++ kernels are off on {self.device} in {self.dtype}"
        if why is not None:
            if self.invariant:
                raise ExecutorError(
                    f"executor.batch_invariant = true cannot hold: {why} (the invariant path is "
                    "the native layer stack of a whole model on one CPU rank, float32); set "
                    "batch_invariant = false"
                )
            log.debug("fast decode off: %s", why)
            return None
        fast = build_fast_decode(
            self.model, self.device, self.kernels, self.max_model_len, invariant=self.invariant
        )
        if fast is not None and self.invariant:
            log.info("batch-invariant: every step runs the native layer stack (batch_invariant)")
        elif fast is not None:
            log.info("decode-only steps run the layer stack in one native call (fast_decode)")
        return fast

    def _lora(self) -> LoRAModel | None:
        """The adaptable layers wrapped (lora.enable_lora), the adapters read before kept (a
        reload after sleep level 2)."""
        lora_cfg = self.cfg.lora
        if not lora_cfg.enable_lora:
            return None
        lora = LoRAModel(
            self.model, self.device, self.dtype, lora_cfg.max_loras, lora_cfg.max_lora_rank
        )
        if self.lora is not None:
            lora.adapters, lora.requests = self.lora.adapters, self.lora.requests
        return lora

    # ------------------------------------------------------------------ LoRA adapters

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into host memory (checked against the model); False if it was there."""
        return self._lora_model().add(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; False if it was not loaded."""
        return self._lora_model().remove(lora_id)

    def list_loras(self) -> list[int]:
        """The ids of the adapters in host memory."""
        return self._lora_model().list() if self.lora is not None else []

    def _lora_model(self) -> LoRAModel:
        if self.lora is None:
            raise InvalidRequestError(
                "LoRA adapters are off: start the engine with lora.enable_lora = true "
                "(--enable-lora, LLM(enable_lora=True))",
                param="lora_request",
            )
        return self.lora

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Change the loaded model (still on CPU) before it moves to the device: the hooks'
        ``prepare_model`` (parallel runners shard or cut it there)."""
        self.hooks.prepare_model(model)

    def _cpu_linears(self) -> None:
        """Decode-shaped linears on CPU: the LM head by row count; with the kernels, every layer's too.

        Only plain nn.Linear layers change: quantized ones (QuantLinear, model.quantization)
        run their own kernels, the LM head included.
        """
        head = self.model.get_output_embeddings()
        if self.kernels:
            use_small_batch_linears(self.model, skip=head)
        if type(head) is torch.nn.Linear:  # exactly nn.Linear: we know what its forward does
            self.model.set_output_embeddings(CpuLMHead(head, kernels=self.kernels))

    # ------------------------------------------------------------------ KV cache

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(
            block_size=self.block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=str(self.kv_dtype).removeprefix("torch."),
        )

    def determine_available_memory(self) -> int:
        """Bytes for the KV cache: kv_cache_memory if set; else a share of the device's memory."""
        cache = self.cfg.cache
        if cache.kv_cache_memory is not None:
            return int(cache.kv_cache_memory)
        if self.device.type == "cuda":
            return self._cuda_available_memory(cache.memory_utilization or CUDA_DEFAULT_UTILIZATION)
        if cache.memory_utilization is not None:
            import psutil

            return int(psutil.virtual_memory().available * cache.memory_utilization)
        spec = self.get_kv_cache_spec()
        per_token = spec.page_size_bytes // spec.block_size
        # a cache narrower than the activations (cache.dtype) keeps the default's tokens in less
        # memory: on CPU it is there to save memory (kv_cache_memory buys more blocks instead)
        cap = CPU_DEFAULT_KV_BYTES * min(1.0, self.kv_dtype.itemsize / self.dtype.itemsize)
        return min(int(cap), self.max_num_reqs * self.max_model_len * per_token)

    @torch.inference_mode()
    def _cuda_available_memory(self, utilization: float) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - before
        free, total = torch.cuda.mem_get_info(self.device)
        available = int(utilization * total - (total - free) - activations)
        if available <= 0:
            raise ExecutorError(
                f"no GPU memory left for the KV cache at memory_utilization={utilization} "
                f"(total {total / GiB:.1f} GiB, in use {(total - free) / GiB:.1f} GiB); raise it or set kv_cache_memory"
            )
        return available

    def _profile_run(self) -> None:
        """A forward over max_num_batched_tokens tokens without a cache, to measure activation memory."""
        n = min(self.max_num_tokens, self.max_model_len)
        ids = torch.zeros(1, n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)[None]
        meta = AttentionMetadata(None, None, self.block_size, [], [], n)
        keep = torch.tensor([n - 1], device=self.device)
        self.model(
            input_ids=ids,
            position_ids=pos,
            **head_kwargs(self.model, keep, int(ids.shape[1]), self.headless),
            use_cache=False,
            **{META_KWARG: meta},
        )

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        """Allocate ``config.num_blocks`` blocks for every layer, then warm up."""
        if config.block_size != self.block_size:
            raise ExecutorError(
                f"KV cache block_size {config.block_size} != cache.block_size {self.block_size}"
            )
        if config.num_blocks <= 0:
            raise ExecutorError(
                f"KV cache needs at least one block, got num_blocks={config.num_blocks}"
            )
        # [layers, K/V, blocks, kv_heads, block_size, head_dim]: a block is one contiguous gather
        cache = zeros_lazy(
            (
                self.num_layers,
                2,
                config.num_blocks,
                self.num_kv_heads,
                self.block_size,
                self.head_dim,
            ),
            self.kv_dtype,
            self.device,
        )
        self.kv_caches = list(cache.unbind(0))
        self.num_blocks = config.num_blocks
        attn_out = torch.empty(
            self.max_num_tokens * self.num_heads * self.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.inputs.set_kv_caches(self.kv_caches, attn_out)
        log.info(
            "KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%d layers, %d KV heads, head dim %d, %s)",
            config.num_blocks,
            self.block_size,
            config.num_blocks * self.block_size,
            cache.numel() * cache.element_size() / 2**20,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            str(self.kv_dtype).removeprefix("torch."),
        )
        self._warmup()

    @torch.inference_mode()
    def _warmup(self) -> None:
        """One prefill and one decode through the paged path (slots of block 0; nothing is cached yet)."""
        t0 = time.monotonic()
        n = min(self.block_size * self.num_blocks, 8, self.max_num_tokens)
        slots = torch.arange(n, device=self.device)
        nb = -(-n // self.block_size)
        blocks = torch.arange(nb, device=self.device)
        ctx = torch.tensor([n], device=self.device)
        for meta, ids, pos in (
            (
                AttentionMetadata(
                    self.kv_caches,
                    slots,
                    self.block_size,
                    [],
                    [PrefillSeq(0, n, 0, None)],
                    n,
                    kernels=self.kernels,
                ),
                torch.zeros(1, n, dtype=torch.long, device=self.device),
                slots[None],
            ),
            (
                AttentionMetadata(
                    self.kv_caches,
                    slots[n - 1 :],
                    self.block_size,
                    [DecodeGroup(0, 1, nb * self.block_size, blocks, ctx)],
                    [],
                    1,
                    kernels=self.kernels,  # warm the path the steps take
                ),
                torch.zeros(1, 1, dtype=torch.long, device=self.device),
                slots[None, n - 1 :],
            ),
        ):
            keep = torch.tensor([ids.shape[1] - 1], device=self.device)
            self.model(
                input_ids=ids,
                position_ids=pos,
                **head_kwargs(self.model, keep, int(ids.shape[1]), self.headless),
                use_cache=False,
                **{META_KWARG: meta},
            )
        log.debug("warm-up took %.2f s", time.monotonic() - t0)

    @torch.inference_mode()
    def execute_dummy_batch(self) -> None:
        """A forward of one token no request owns, written to slot 0 of the null block (never a
        request's): an expert-parallel engine with nothing to run takes part in the MoE layers'
        collectives of the others' step (engine/dp_core_proc.py). The persistent batch is untouched."""
        if not self.kv_caches:
            raise ExecutorError("execute_dummy_batch before initialize_kv_cache")
        slot = torch.zeros(1, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            self.kv_caches, slot, self.block_size, [], [PrefillSeq(0, 1, 0, None)], 1
        )
        self.model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device),
            position_ids=slot[None],
            **head_kwargs(self.model, slot, 1, self.headless),
            use_cache=False,
            **{META_KWARG: meta},
        )

    # ------------------------------------------------------------------ sleep

    def sleep(self, level: int) -> None:
        """Free the KV cache's storage; level 1 keeps the weights in host memory (moved off a
        GPU), level 2 drops them too (``wake_up`` loads them from the model folder again).

        The engine calls it only with no request in flight; what the cache held is gone.
        """
        if level not in (1, 2):
            raise ExecutorError(f"sleep level {level!r}: must be 1 or 2")
        if not self.kv_caches:
            raise ExecutorError("sleep before initialize_kv_cache, or while already asleep")
        self._pending = None
        self._kv_config = KVCacheConfig(num_blocks=self.num_blocks, block_size=self.block_size)
        self.kv_caches = []
        self.inputs.set_kv_caches([], None)
        if self.fast_decode is not None:
            self.fast_decode.forget_caches()
        if self.lora is not None:
            self.lora.release()  # the slots; adapters stay in host memory
        if level == 2:
            self.model = self.fast_decode = None
        elif self.device.type != "cpu":
            self.model.to("cpu")
        release_host_memory()
        release_device_memory(self.device)
        self._sleep_level = level
        log.info("asleep (level %d): KV cache%s freed", level, " and weights" if level == 2 else "")

    def wake_up(self) -> None:
        """Undo ``sleep``: load or move the weights back, allocate the KV cache again, warm up."""
        level = getattr(self, "_sleep_level", 0)
        if not level:
            return
        if level == 2:
            self.load_model()  # the weights as the model folder has them, prepared as at start
        elif self.device.type != "cpu":
            self.model.to(self.device)
        self.initialize_kv_cache(self._kv_config)
        self._sleep_level = 0
        log.info("awake (was asleep at level %d)", level)

    # ------------------------------------------------------------------ steps

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; None when sampling waits for a grammar bitmask (then call sample_tokens).

        A request whose preparation fails is left out of the step and reported in
        ``ModelRunnerOutput.failed``; the forward pass runs for the others.
        """
        if scheduler_output.kv_block_copies:
            self.copy_blocks(scheduler_output.kv_block_copies)
        failed = self.update_states(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            self._pending = None
            return ModelRunnerOutput(failed=failed or None)
        if not self.kv_caches:
            raise ExecutorError("execute_model before initialize_kv_cache")
        step = PendingStep(None, None, failed)
        if not failed or any(r not in failed for r in scheduler_output.num_scheduled_tokens):
            inputs = self.prepare_inputs(scheduler_output, skip=failed)
            # pooling requests leave the sampling rows; their hidden states are pooled instead
            step.inputs, spans = self.pooler.plan(inputs, self.input_batch)
            spans = spans if self.hooks.samples() else []
            with self.pooler.capture(self.model, spans):
                step.logits = self.forward(step.inputs)
            step.pooled, pool_failed = self.pooler.pool(spans)
            failed.update(pool_failed)
        if scheduler_output.structured_output_req_ids:
            self._pending = step
            return None
        return self._sample_step(step, None)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source id, destination id) in every layer: forks' copy-on-write."""
        if not self.kv_caches:
            raise ExecutorError("copy_blocks before initialize_kv_cache")
        src = torch.tensor([c[0] for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            if cache is not None:  # [K/V, blocks, ...]
                cache.index_copy_(1, dst, cache.index_select(1, src))

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        """Sample the step whose execute_model returned None, with the grammar bitmask applied."""
        if self._pending is None:
            raise ExecutorError(
                "sample_tokens called without a pending step (execute_model did not return None)"
            )
        step, self._pending = self._pending, None
        return self._sample_step(step, grammar_output)

    def _sample_step(self, step: PendingStep, grammar: GrammarOutput | None) -> ModelRunnerOutput:
        if step.inputs is None or step.logits is None:
            out = ModelRunnerOutput()
        else:
            n = step.inputs.num_sample_rows
            out = self.sample(step.logits[:n], step.inputs, grammar)
            if step.inputs.prompt_rows is not None and self.hooks.samples():
                self._score_prompts(step.logits[n:], step.inputs, out)
        if step.pooled:
            out.pooler_output = step.pooled
        if step.failed:
            out.failed = {**step.failed, **(out.failed or {})}
        return out

    def _score_prompts(
        self, logits: torch.Tensor, inputs: StepInputs, out: ModelRunnerOutput
    ) -> None:
        """Log-probabilities of the prompt tokens this step computed (prompt_logprobs), kept
        until the request's prompt is done; then in ``out.prompt_logprobs``."""
        rows = inputs.prompt_rows
        assert rows is not None
        failed = out.failed or {}
        try:
            targets = torch.from_numpy(rows.targets).to(logits.device)
            ks = [k for k, c in zip(rows.num_logprobs, rows.counts, strict=True) for _ in range(c)]
            scored: list[TokenLogprobs | None] = []
            for a in range(0, len(ks), PROMPT_SCORE_ROWS):  # a long chunk's float32 copy in parts
                b = a + PROMPT_SCORE_ROWS
                raw = torch.log_softmax(logits[a:b].float(), dim=-1)
                scored += Sampler.logprobs(raw, targets[a:b], ks[a:b])
        except Exception as e:  # those requests fail; the others' tokens stand
            for rid in rows.req_ids:
                failed[rid] = describe(e)
                self._prompt_lps.pop(rid, None)
                log_contained(rid, "to score its prompt", e)
            out.failed = failed
            keep = [i for i, rid in enumerate(out.req_ids) if rid not in failed]  # not in req_ids
            out.req_ids = [out.req_ids[i] for i in keep]
            out.sampled_token_ids = [out.sampled_token_ids[i] for i in keep]
            if out.logprobs:
                out.logprobs = {r: lp for r, lp in out.logprobs.items() if r not in failed}
            return
        at = 0
        for rid, count in zip(rows.req_ids, rows.counts, strict=True):
            self._prompt_lps.setdefault(rid, []).extend(
                lp for lp in scored[at : at + count] if lp is not None
            )
            at += count
        done = {rid for rid in rows.req_ids if rid not in failed} & set(out.req_ids)
        for rid, sampled in zip(out.req_ids, out.sampled_token_ids, strict=True):
            if rid in done and sampled:  # its last prompt chunk: the first token was sampled
                if out.prompt_logprobs is None:
                    out.prompt_logprobs = {}
                out.prompt_logprobs[rid] = self._prompt_lps.pop(rid)

    def update_states(self, so: SchedulerOutput) -> dict[str, str]:
        """Apply the step's changes to the persistent batch; return the requests that failed.

        A request whose change raises (a value that does not fit the batch's arrays,
        a token id outside the vocabulary) leaves the batch: it never comes back, since
        the scheduler finishes it with an error. The same SchedulerOutput fails the same
        requests on every rank, so parallel ranks leave the same ones out. A
        BatchContractError (scheduler and runner disagree) still fails the step.
        """
        batch = self.input_batch
        self.pooler.update(so)
        for rid in so.finished_req_ids:
            batch.remove_request(rid)
            self._prompt_lps.pop(rid, None)
        for rid in so.preempted_req_ids:
            batch.remove_request(rid)
            self._prompt_lps.pop(rid, None)  # recomputed from the start when it resumes
        failed: dict[str, str] = {}
        c = so.scheduled_cached_reqs
        for i, rid in enumerate(c.req_ids):
            try:
                batch.update_cached(
                    rid,
                    c.new_token_ids[i] if i < len(c.new_token_ids) else (),
                    c.new_block_ids[i] if i < len(c.new_block_ids) else (),
                    c.num_computed_tokens[i],
                )
            except BatchContractError:
                raise
            except Exception as e:  # this request fails alone; the step goes on
                self._drop(rid, e, failed)
        for req in so.scheduled_new_reqs:
            batch.remove_request(req.req_id)  # a resumed request replaces any stale row
            try:
                if req.lora_request is not None and (
                    self.lora is None or req.lora_request.lora_int_id not in self.lora.adapters
                ):
                    self.add_lora(req.lora_request)  # not read yet here (or dropped since)
                batch.add_request(req, self.eos_token_ids)
            except BatchContractError:
                raise
            except Exception as e:
                self._drop(req.req_id, e, failed)
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            if rid in failed:
                continue
            try:
                batch.write_drafts(rid, drafts)
            except BatchContractError:
                raise
            except Exception as e:
                self._drop(rid, e, failed)
        return failed

    def _drop(self, req_id: str, error: Exception, failed: dict[str, str]) -> None:
        """Take a request whose update raised out of the batch (no half-written row stays)."""
        self.input_batch.remove_request(req_id)
        self._prompt_lps.pop(req_id, None)
        failed[req_id] = describe(error)
        log_contained(req_id, "to enter the model runner's batch", error)

    def prepare_inputs(self, so: SchedulerOutput, skip: Collection[str] = ()) -> StepInputs:
        """The step's inputs for the scheduled requests, less ``skip`` (those that failed to prepare)."""
        return self.inputs.build(so, skip)

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [sampling rows + prompt rows, vocab] for the positions that sample, then
        those that score prompt tokens (``inputs.prompt_rows``), through the hooks' ``forward``."""
        return self.hooks.forward(lambda: self._forward(inputs), int(inputs.input_ids.shape[0]))

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        lora = self.lora
        if lora is not None:
            lora.prepare(inputs.lora_ids)
            try:
                return self._forward_model(inputs, lora.active)
            finally:
                lora.end_step()
        return self._forward_model(inputs, False)

    def _forward_model(self, inputs: StepInputs, adapters: bool) -> torch.Tensor:
        fast = self.fast_decode
        if self.invariant and fast is not None:  # every step (adapters: refused by the config)
            logits, hidden = fast.invariant_logits(inputs, want_hidden=self.pooler.capturing)
            if hidden is not None:
                self.pooler.captured(hidden)
            return logits
        if (
            fast is not None
            and not adapters  # its native stack has no LoRA: steps with adapters run the modules
            and inputs.prompt_rows is None
            and not self.pooler.capturing  # its native stack skips the hook that pools
            and fast.applies(inputs)
        ):
            return fast.logits(inputs)
        out = self.model(
            input_ids=inputs.input_ids[None],
            position_ids=inputs.positions[None],
            **head_kwargs(
                self.model, inputs.logits_indices, int(inputs.input_ids.shape[0]), self.headless
            ),
            use_cache=False,
            **{META_KWARG: inputs.attn},
        )
        if self.headless:  # it pools only: no request samples
            return out.last_hidden_state.new_empty(0, self.vocab_size)
        return out.logits[0]

    def sample(
        self, logits: torch.Tensor, inputs: StepInputs, grammar: GrammarOutput | None
    ) -> ModelRunnerOutput:
        """One token per sampling request; a request verifying drafts gets the drafts the
        model accepts and one token of its own (``_verify``). When the batch fails to sample,
        each request is sampled alone, and only those that fail alone are reported failed. A
        runner whose hooks do not sample (a rank with partial or no logits) returns an empty
        output."""
        if not self.hooks.samples():
            return ModelRunnerOutput()
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] | None = None
        failed: dict[str, str] = {}
        rids = inputs.sample_req_ids
        if rids:
            try:
                tokens, lps = self._sample_rows(
                    logits, rids, inputs.sample_rows, grammar, inputs.sample_offsets
                )
            except Exception as e:  # rare: pay for row-by-row sampling only now
                tokens, lps = self._sample_each(logits, inputs, grammar, failed)
                if not failed:  # no request to blame (each row that failed logged itself)
                    log.warning(
                        "sampling %d requests together failed (%s); each alone succeeded",
                        len(rids),
                        describe(e),
                    )
            if inputs.drafts:
                sampled, logprobs = _verify(inputs, tokens, lps, failed)
            else:
                sampled = {
                    rid: [tok] for rid, tok in zip(rids, tokens, strict=True) if tok is not None
                }
                if lps is not None:
                    logprobs = {
                        rid: [lp] for rid, lp in zip(rids, lps, strict=True) if lp is not None
                    }
        req_ids = [rid for rid in inputs.req_ids if rid not in failed] if failed else inputs.req_ids
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled.get(rid, []) for rid in req_ids],
            logprobs=logprobs,
            failed=failed or None,
        )

    def _sample_rows(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        rows: np.ndarray,
        grammar: GrammarOutput | None,
        offsets: np.ndarray | None = None,
    ) -> tuple[list[int | None], list[TokenLogprobs | None] | None]:
        """Sample ``logits`` (aligned with ``req_ids`` and their batch ``rows``, ``offsets``
        past their tokens): tokens, logprobs."""
        if grammar is not None and grammar.req_ids:
            self._apply_grammar(logits, req_ids, grammar, offsets)
        md = sampling_metadata(self.input_batch, rows, self.vocab_size, self.device, offsets)
        out = self.sampler(logits, md)
        return out.token_ids.tolist(), out.logprobs

    def _sample_each(
        self,
        logits: torch.Tensor,
        inputs: StepInputs,
        grammar: GrammarOutput | None,
        failed: dict[str, str],
    ) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """Sample every request alone (after the batch failed); a request that fails goes to ``failed``.

        Greedy and seeded rows get the tokens the batch would have given them
        (a seeded draw depends only on its seed and position); unseeded ones draw afresh.
        """
        tokens: list[int | None] = []
        lps: list[TokenLogprobs | None] = []
        for i, rid in enumerate(inputs.sample_req_ids):
            try:
                offsets = inputs.sample_offsets
                [tok], row_lps = self._sample_rows(
                    logits[i : i + 1],
                    [rid],
                    inputs.sample_rows[i : i + 1],
                    grammar,
                    offsets[i : i + 1] if offsets is not None else None,
                )
            except Exception as e:
                failed[rid] = describe(e)
                log_contained(rid, "to sample", e)
                tok, row_lps = None, None
            tokens.append(tok)
            lps.append(row_lps[0] if row_lps else None)
        return tokens, lps

    def _apply_grammar(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        grammar: GrammarOutput,
        offsets: np.ndarray | None = None,
    ) -> None:
        """Mask the rows of ``logits`` (aligned with ``req_ids`` and their ``offsets`` past the
        request's tokens) that have a bitmask row: a request's j-th row in the bitmask masks
        its logits row at offset j (a request verifying drafts has one per position)."""
        pos = offsets.tolist() if offsets is not None else [0] * len(req_ids)
        where = {(rid, int(off)): i for i, (rid, off) in enumerate(zip(req_ids, pos, strict=True))}
        seen: dict[str, int] = {}
        mask_rows, logit_rows = [], []
        for j, rid in enumerate(grammar.req_ids):
            off = seen[rid] = seen.get(rid, -1) + 1
            i = where.get((rid, off))
            if i is not None:  # a request in a mid-prompt chunk samples nothing this step
                mask_rows.append(j)
                logit_rows.append(i)
        if not logit_rows:
            return
        bitmask = torch.as_tensor(grammar.bitmask)
        if len(mask_rows) != bitmask.shape[0]:
            bitmask = bitmask[torch.tensor(mask_rows)]
        apply_bitmask(logits, bitmask, torch.tensor(logit_rows, device=logits.device))

    def remove_requests(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.input_batch.remove_request(rid)
            self._prompt_lps.pop(rid, None)


def _verify(
    inputs: StepInputs,
    tokens: list[int | None],
    lps: list[TokenLogprobs | None] | None,
    failed: dict[str, str],
) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]] | None]:
    """Tokens (and logprobs) per request of a step that verified drafts.

    Row j of a verifying request drew the token that follows its first j drafts, as
    decoding would have drawn it (greedy: the argmax; sampling: the same seeded or
    fresh draw). Draft j is accepted when it equals that token, and the request gets
    its accepted drafts followed by the first token that differs (or, all accepted, the
    token after the last draft). A draft is a point guess, so this is speculative
    sampling's accept test (keep x with probability p(x) / q(x) = p(x), else draw from
    p without x): every token returned has the distribution decoding would give it.
    """
    assert inputs.drafts is not None and inputs.sample_offsets is not None
    rows: dict[str, dict[int, int]] = {}  # req id -> offset -> index into tokens
    for i, (rid, off) in enumerate(
        zip(inputs.sample_req_ids, inputs.sample_offsets.tolist(), strict=True)
    ):
        if rid not in failed and tokens[i] is not None:
            rows.setdefault(rid, {})[off] = i
    sampled: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] | None = {} if lps is not None else None
    for rid, at in rows.items():
        drafts = inputs.drafts.get(rid, ())
        out: list[int] = []
        out_lps: list[TokenLogprobs] = []
        for j in range(len(drafts) + 1):
            i = at[j]
            tok = tokens[i]
            assert tok is not None
            out.append(tok)
            if lps is not None and lps[i] is not None:
                out_lps.append(lps[i])  # type: ignore[arg-type]
            if j == len(drafts) or tok != drafts[j]:
                break
        sampled[rid] = out
        if logprobs is not None and out_lps:
            logprobs[rid] = out_lps
    return sampled, logprobs
