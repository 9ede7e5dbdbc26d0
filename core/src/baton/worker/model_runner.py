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
from collections.abc import Collection
from dataclasses import dataclass

import msgspec
import torch

from baton.config import (
    CacheSection,
    ExecutorSection,
    LoRASection,
    ModelSection,
    SchedulerSection,
)
from baton.errors import ExecutorError, InvalidRequestError
from baton.kernels import loader
from baton.kernels.attention import META_KWARG, model_capabilities
from baton.kernels.cpu_features import native_compute
from baton.kernels.cpu_linear import CpuLMHead, use_small_batch_linears
from baton.lora.model import LoRAModel
from baton.lora.request import LoRARequest
from baton.model.loader import model_folder
from baton.model.no_lm_head import head_kwargs, is_bidirectional
from baton.model.weights import load_model
from baton.model_info import read_model_info
from baton.pooling_params import default_pooling_type
from baton.protocol import (
    GrammarOutput,
    ModelCapabilities,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from baton.worker.containment import describe, log_contained
from baton.worker.decode_steps import decode_ahead
from baton.worker.fast_decode import STACK_MAX_PROMPT_KEYS, STACK_MAX_TOKENS, FastDecode
from baton.worker.fast_decode_build import build_fast_decode
from baton.worker.input_batch import BatchContractError, InputBatch
from baton.worker.kv_cache import KVCacheMixin
from baton.worker.kv_cache_dtype import kv_cache_dtype
from baton.worker.pooler import Pooler
from baton.worker.runner_hooks import KVShape, LoadedModel, ModelRunnerHooks
from baton.worker.sampler import Sampler
from baton.worker.step_inputs import StepInputBuilder, StepInputs
from baton.worker.step_sampling import SamplingMixin

log = logging.getLogger(__name__)


@dataclass
class PendingStep:
    """A step between its forward and its sampling (sampling waits for a grammar bitmask)."""

    logits: torch.Tensor | None  # None: nothing ran (every scheduled request failed to prepare)
    inputs: StepInputs | None
    #: requests that failed to prepare this step -> "ExceptionType: message"
    failed: dict[str, str]
    #: pooling requests whose prompt ended this step -> their vector (worker/pooler.py)
    pooled: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class RunnerSettings:
    """The config sections the stock runner reads (``baton.worker.worker.runner_settings`` takes
    them from the config a Worker receives)."""

    model: ModelSection
    cache: CacheSection
    scheduler: SchedulerSection
    executor: ExecutorSection
    lora: LoRASection


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


class ModelRunner(KVCacheMixin, SamplingMixin):
    """Runs one model on one device for the engine core (through a Worker).

    Implements ``baton.interfaces.ModelRunner``; ``hooks`` change what a parallel
    rank holds and does (``baton.runner``).
    """

    def __init__(
        self, settings: RunnerSettings, device: torch.device, hooks: ModelRunnerHooks | None = None
    ) -> None:
        self.settings = settings
        #: What the KV cache half reads (its size: ``kv_cache_memory``, ``memory_utilization``).
        self.cache = settings.cache
        self.device = device
        self.hooks = hooks if hooks is not None else ModelRunnerHooks()
        self.block_size = settings.cache.block_size
        self.max_num_reqs = settings.scheduler.max_num_seqs
        self.max_num_tokens = settings.scheduler.max_num_batched_tokens
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor | None] = []
        self.num_blocks = 0
        self._pending: PendingStep | None = None
        self.fast_decode: FastDecode | None = None
        #: executor.batch_invariant: every step runs fast_decode's invariant path
        self.invariant = settings.executor.batch_invariant
        #: The adapted layers and the adapters read (lora.enable_lora); None: LoRA off.
        self.lora: LoRAModel | None = None
        # the model's own pooling type: load_model
        self.pooler = Pooler(
            "last", settings.model.pooling_normalize, invariant=settings.executor.batch_invariant
        )
        #: prompt logprobs of requests whose prompt is still being computed (chunked prefill)
        self._prompt_lps: dict[str, list[TokenLogprobs]] = {}

    # ------------------------------------------------------------------ model

    def load_model(self) -> None:
        model, executor = self.settings.model, self.settings.executor
        self.model_info = read_model_info(model_folder(model), model.max_model_len)
        self.pooler.pooling_type = default_pooling_type(model.pooling_type, self.model_info)
        self.model = load_model(model, executor, self.device, prepare=self.prepare_model)
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
        self.kv_dtype = kv_cache_dtype(self.cache.dtype, self.dtype, self.device)
        head = self.model.get_output_embeddings()
        #: a base model without an LM head (BertModel, ...): it only pools (baton.model.no_lm_head)
        self.no_lm_head = head is None
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
        #: paged attention through the C++ kernels: float32, and 16-bit activations converted
        self.attention_kernels = self._use_attention_kernels()
        if self.device.type == "cpu":
            self._cpu_linears()
        self.fast_decode = self._fast_decode()
        self.lora = self._lora()  # after fast_decode: it took the layers' weights as they are
        tables, table_keys = self._token_tables()
        self.inputs = StepInputBuilder(
            self.input_batch,
            self.max_num_tokens,
            self.device,
            kernels=self.attention_kernels,
            token_tables=tables,
            token_table_keys=table_keys,
        )
        self.sampler = Sampler(self.device, self.settings.model.seed)

    def _token_tables(self) -> tuple[int, int | None]:
        """The steps the native stack runs as rows (StepInputBuilder's token_tables and
        token_table_keys): any in batch-invariant mode, else a prefill or mixed step of up to
        STACK_MAX_TOKENS whose prompt rows attend over STACK_MAX_PROMPT_KEYS keys on average at
        most, where fast decode runs a float32 model alone (no tensor parallelism). A 16-bit
        model keeps its modules there: the stack rounds less than they do, so its tokens would
        move, and that trade is not measured yet."""
        fast = self.fast_decode
        if fast is None:
            return 0, None
        if self.invariant:
            return 1 << 62, None
        if fast.tp is None and fast.dtype is torch.float32:
            return STACK_MAX_TOKENS, STACK_MAX_PROMPT_KEYS
        return 0, None

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
        chunked, prefix, reason = model_capabilities(self.hf_config)
        if is_bidirectional(self.model):
            chunked, prefix = False, False
            reason = f"{type(self.model).__name__} attends both ways (an encoder)"
        return ModelCapabilities(
            supports_chunked_prefill=chunked,
            supports_prefix_caching=prefix,
            supports_decode_steps=self.hooks.runs_alone(),
            reason=reason,
        )

    def _use_kernels(self) -> bool:
        """Whether decode attention and linears run through baton's C++ kernels: float32 on CPU, when they build."""
        if not self.settings.executor.cpu_kernels:
            return False
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return False
        return loader.load()

    def _use_attention_kernels(self) -> bool:
        """Whether cache writes and decode attention run through baton's C++ kernels: on CPU in
        float32, bfloat16 or float16 (16-bit queries, keys and values are widened to float32
        there, exactly), when they build."""
        if self.kernels:
            return True
        if not self.settings.executor.cpu_kernels or self.device.type != "cpu":
            return False
        return self.dtype in (torch.bfloat16, torch.float16) and loader.load()

    def _fast_decode(self) -> FastDecode | None:
        """The native layer stack for decode-only steps, when executor.fast_decode is on and it applies.

        Only this class's own forward without hooks: a parallel runner (hooks or a subclass)
        holds a cut or sharded model. In batch-invariant mode hooks may change the model: a
        tensor-parallel rank's shards run the stack half a layer at a time (fast_decode.py), any
        other change is refused by build_fast_decode.
        """
        if not self.settings.executor.fast_decode:
            return None
        cls = type(self)
        why = None
        if (cls.forward, cls.prepare_model) != (ModelRunner.forward, ModelRunner.prepare_model):
            why = f"{cls.__name__} runs a cut or sharded model"
        elif type(self.hooks) is not ModelRunnerHooks and not self.invariant:
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
        # a bfloat16 model's stack needs the attention kernels only (oneDNN runs its linears)
        fast = build_fast_decode(
            self.model,
            self.device,
            self.attention_kernels,
            self.max_model_len,
            invariant=self.invariant,
        )
        if fast is not None and self.invariant:
            log.info("batch-invariant: every step runs the native layer stack (batch_invariant)")
        elif fast is not None:
            log.info("decode-only steps run the layer stack in one native call (fast_decode)")
        return fast

    def _lora(self) -> LoRAModel | None:
        """The adaptable layers wrapped (lora.enable_lora), the adapters read before kept (a
        reload after sleep level 2)."""
        lora_cfg = self.settings.lora
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

    # ------------------------------------------------------------------ sleep

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
        out = self._sample_step(step, None)
        if scheduler_output.decode_steps > 1 and step.inputs is not None:
            out = decode_ahead(self, scheduler_output, step.inputs, out)
        return out

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
        ):
            if fast.applies(inputs):
                return fast.logits(inputs)
            if fast.takes_rows(inputs):
                return fast.step_logits(inputs)
        out = self.model(
            input_ids=inputs.input_ids[None],
            position_ids=inputs.positions[None],
            **head_kwargs(
                self.model, inputs.logits_indices, int(inputs.input_ids.shape[0]), self.no_lm_head
            ),
            use_cache=False,
            **{META_KWARG: inputs.attn},
        )
        if self.no_lm_head:  # it pools only: no request samples
            return out.last_hidden_state.new_empty(0, self.vocab_size)
        return out.logits[0]

    def remove_requests(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.input_batch.remove_request(rid)
            self._prompt_lps.pop(rid, None)
