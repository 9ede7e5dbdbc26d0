"""A deterministic executor with no model, for tests and ``baton bench scheduler``.

The next token of a request is a pure function of its tokens so far (by
default ``1 + (31 * last + position) % (vocab_size - 1)``, never the EOS id 0),
so a run's output does not depend on batching, chunking or preemption, and two
runs can be compared token for token.

It keeps its own view of every request exactly as a real model runner would,
built only from SchedulerOutputs (new / cached / finished / preempted), and
asserts the contract as it goes (``check=True``): a cached request must be
known, a new one unknown; the tokens fed equal the tokens it sampled; no block
is written while another live request holds it; a prefix-cache hit's blocks
really hold the prompt's tokens (a token-per-slot shadow KV cache). A broken
scheduler fails loudly here, as ``AssertionError``.

Never selectable by name unless asked for: ``register_fake_executor(plugins)``
adds executor ``fake`` to a plugin manager (tests, the scheduler bench).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

from pydantic import BaseModel, Field

from baton import __version__
from baton.errors import ExecutorError, worker_error
from baton.executor.latch import FailureLatch
from baton.plugins.hookspecs import hookimpl
from baton.plugins.registry import get_plugins
from baton.protocol import (
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    ModelCapabilities,
    ModelInfo,
    ModelRunnerOutput,
    SchedulerOutput,
)

NextTokenFn = Callable[[Sequence[int], int], int]
PLUGIN_NAME = "baton-testing-fake-executor"


class FakeExecutorSettings(BaseModel):
    """``[executor.fake]`` settings."""

    vocab_size: int = Field(32000, gt=2)
    eos_token_id: int = 0
    eos_after: int | None = Field(None, ge=0)
    """Emit ``eos_token_id`` as output number ``eos_after`` (0-based) of every request."""
    token_ids: list[int] | None = None
    """A fixed output sequence: output i is ``token_ids[i % len]``."""
    latency_s: float = Field(0.0, ge=0)
    prefill_s_per_token: float = Field(0.0, ge=0)
    decode_s_per_token: float = Field(0.0, ge=0)
    simulate_time: bool = False
    """Add step costs to ``simulated_time`` instead of sleeping."""
    fail_at_step: int | None = Field(None, ge=0)
    """The execute_model call (0-based) that fails."""
    fail_mode: Literal["raise", "die"] = "raise"
    """raise: that step raises ExecutorError; die: also the failure callbacks run and every later call fails."""
    num_blocks: int = Field(1024, ge=2)
    max_concurrent_batches: int = Field(1, ge=1)
    check: bool = True
    deep_check: bool = False
    """Also verify every scheduled request's whole context against the shadow KV cache each step."""


class _ReqState:
    __slots__ = ("block_ids", "num_computed", "num_prompt", "sampled", "tokens")

    def __init__(
        self, tokens: list[int], num_prompt: int, block_ids: list[int], num_computed: int
    ) -> None:
        self.tokens = tokens
        self.num_prompt = num_prompt
        self.block_ids = block_ids
        self.num_computed = num_computed
        self.sampled: list[int] = []  # returned, not yet fed back by the scheduler


class FakeExecutor:
    """Implements ``baton.interfaces.Executor`` without a model. See the module docstring."""

    #: No model is loaded: the core reads the model folder and restricts nothing.
    model_info: ModelInfo | None = None
    model_capabilities: ModelCapabilities | None = None

    def __init__(
        self,
        settings: FakeExecutorSettings | None = None,
        *,
        block_size: int = 16,
        next_token: NextTokenFn | None = None,
        **overrides: Any,
    ) -> None:
        s = (settings or FakeExecutorSettings()).model_copy(update=overrides)
        self.settings = FakeExecutorSettings.model_validate(s.model_dump())
        self.block_size = block_size
        self.max_concurrent_batches = self.settings.max_concurrent_batches
        self._next_token = next_token
        self.simulated_time = 0.0
        self.num_steps = 0
        self._latch = FailureLatch("fake")
        self._worker: ThreadPoolExecutor | None = None
        self._pending: tuple[SchedulerOutput, list[str]] | None = None
        self.reqs: dict[str, _ReqState] = {}
        self.initialize_kv_cache(
            KVCacheConfig(num_blocks=self.settings.num_blocks, block_size=block_size)
        )

    # ------------------------------------------------------------- set-up

    def get_kv_cache_specs(self) -> list[KVCacheSpec]:
        return [
            KVCacheSpec(
                block_size=self.block_size,
                num_layers=1,
                num_kv_heads=1,
                head_size=1,
                dtype="float32",
            )
        ]

    def determine_available_memory(self) -> list[int]:
        return [self.settings.num_blocks * self.get_kv_cache_specs()[0].page_size_bytes]

    def initialize_kv_cache(self, config: KVCacheConfig) -> None:
        self.num_blocks = config.num_blocks
        self.block_size = config.block_size
        self._kv: list[int | None] = [None] * (config.num_blocks * config.block_size)
        self._owners: dict[int, int] = {}
        self.reqs.clear()

    # ------------------------------------------------------------- running

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput | None] | None:
        if non_block:
            return self._submit(self._execute, scheduler_output)
        return self._execute(scheduler_output)

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        if non_block:
            return self._submit(self._sample_pending, grammar_output)
        return self._sample_pending(grammar_output)

    def _submit(self, fn: Callable[..., Any], arg: Any) -> Future[Any]:
        # one worker thread: steps run in submission order, like a pipeline's stages
        if self._worker is None:
            self._worker = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="baton-fake-executor"
            )
        return self._worker.submit(fn, arg)

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        step = self.num_steps
        self.num_steps += 1
        self._latch.check()
        if self.settings.fail_at_step == step:
            self._fail(step)
        if self._pending is not None:
            raise AssertionError(
                "execute_model called while the previous step still waits for sample_tokens"
            )
        self._apply(so)
        samplers = self._run(so)
        if so.structured_output_req_ids:
            self._pending = (so, samplers)
            return None
        return self._sample(so, samplers, None)

    def _sample_pending(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        if self._pending is None:
            raise AssertionError("sample_tokens called without a pending execute_model")
        (so, samplers), self._pending = self._pending, None
        return self._sample(so, samplers, grammar_output)

    def _fail(self, step: int) -> None:
        err = ExecutorError(f"injected failure at fake executor step {step}")
        if self.settings.fail_mode == "die":
            callbacks = self._latch.trip(err)  # latched now: every later call fails
            if callbacks is not None:  # told off the step thread, as an executor's watcher does
                threading.Thread(
                    target=self._latch.notify,
                    args=(err, callbacks),
                    name="baton-fake-failure",
                    daemon=True,
                ).start()
        raise err

    def _apply(self, so: SchedulerOutput) -> None:
        """Update the runner's view of requests from the SchedulerOutput, checking the contract."""
        check = self.settings.check
        reqs = self.reqs
        for rid in so.finished_req_ids:
            st = reqs.pop(rid, None)
            assert st is not None or not check, f"finished request {rid!r} is unknown to the runner"
            if st is not None:
                self._drop_blocks(st.block_ids)
        for rid in so.preempted_req_ids:
            st = reqs.pop(rid, None)
            assert st is not None or not check, (
                f"preempted request {rid!r} is unknown to the runner"
            )
            if st is not None:
                self._drop_blocks(st.block_ids)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in reqs or not check, (
                f"new request {new.req_id!r} is already known"
            )
            tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
            st = _ReqState(
                tokens, len(new.prompt_token_ids), list(new.block_ids), new.num_computed_tokens
            )
            reqs[new.req_id] = st
            for b in st.block_ids:
                assert 0 < b < self.num_blocks, f"request {new.req_id!r}: block id {b} out of range"
                self._owners[b] = self._owners.get(b, 0) + 1
            if check:  # prefix-cache hits must hold exactly these tokens
                self._verify_context(new.req_id, st, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = reqs.get(rid)
            assert st is not None, f"cached request {rid!r} is unknown to the runner"
            new_tokens = cached.new_token_ids[i]
            if check:
                assert list(new_tokens) == st.sampled, (
                    f"request {rid!r}: scheduler fed {list(new_tokens)}, runner sampled {st.sampled}"
                )
                assert cached.num_computed_tokens[i] == st.num_computed, (
                    f"request {rid!r}: scheduler says {cached.num_computed_tokens[i]} computed, "
                    f"runner computed {st.num_computed}"
                )
            st.sampled = []
            st.tokens.extend(new_tokens)
            st.num_computed = cached.num_computed_tokens[i]
            for b in cached.new_block_ids[i]:
                assert 0 < b < self.num_blocks, f"request {rid!r}: block id {b} out of range"
                self._owners[b] = self._owners.get(b, 0) + 1
                st.block_ids.append(b)
        if check:
            n_new, n_cached = len(so.scheduled_new_reqs), len(cached.req_ids)
            assert len(so.num_scheduled_tokens) == n_new + n_cached, (
                "num_scheduled_tokens != new + cached"
            )
            assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens

    def _drop_blocks(self, block_ids: list[int]) -> None:
        owners = self._owners
        for b in block_ids:
            left = owners[b] - 1
            if left:
                owners[b] = left
            else:
                del owners[b]

    def _verify_context(self, rid: str, st: _ReqState, upto: int) -> None:
        bs, kv, tokens, blocks = self.block_size, self._kv, st.tokens, st.block_ids
        for pos in range(upto):
            got = kv[blocks[pos // bs] * bs + pos % bs]
            assert got == tokens[pos], (
                f"request {rid!r}: KV at position {pos} holds {got}, expected {tokens[pos]}"
            )

    def _run(self, so: SchedulerOutput) -> list[str]:
        """'Compute' the scheduled tokens (write the shadow KV); return who samples."""
        check, deep = self.settings.check, self.settings.deep_check
        bs, kv, owners = self.block_size, self._kv, self._owners
        samplers: list[str] = []
        prefill = decode = 0
        spec = so.scheduled_spec_decode_tokens
        for rid, n in so.num_scheduled_tokens.items():
            st = self.reqs[rid]
            start, end = st.num_computed, st.num_computed + n
            tokens, blocks = st.tokens, st.block_ids
            drafts = spec.get(rid) if spec else None
            if drafts:  # its last token and the drafts: computed like tokens, then verified
                assert start == len(tokens) - 1 and n == 1 + len(drafts), (
                    f"request {rid!r}: {n} tokens from {start} with {len(drafts)} drafts, "
                    f"has {len(tokens)}"
                )
                tokens = tokens + drafts
            assert n > 0 and end <= len(tokens), (
                f"request {rid!r}: {n} tokens from {start}, has {len(tokens)}"
            )
            assert len(blocks) * bs >= end, (
                f"request {rid!r}: {len(blocks)} blocks for {end} tokens"
            )
            if deep:
                self._verify_context(rid, st, start)
            if check:
                for b in blocks[start // bs : (end - 1) // bs + 1]:
                    assert owners.get(b) == 1, (
                        f"request {rid!r} writes block {b}, held by {owners.get(b)} requests"
                    )
            for pos in range(start, end):
                kv[blocks[pos // bs] * bs + pos % bs] = tokens[pos]
            st.num_computed = end
            if end == len(tokens):
                samplers.append(rid)
            if drafts or (n == 1 and end > st.num_prompt and start == len(tokens) - 1):
                decode += 1
            else:
                prefill += n
        s = self.settings
        cost = s.latency_s + s.prefill_s_per_token * prefill + s.decode_s_per_token * decode
        if cost > 0:
            if s.simulate_time:
                self.simulated_time += cost
            else:
                time.sleep(cost)
        return samplers

    def next_token(self, tokens: Sequence[int], num_prompt: int) -> int:
        """The deterministic next token after ``tokens`` (of which ``num_prompt`` are the prompt)."""
        s = self.settings
        num_out = len(tokens) - num_prompt
        if s.eos_after is not None and num_out == s.eos_after:
            return s.eos_token_id
        if self._next_token is not None:
            return self._next_token(tokens, num_prompt)
        if s.token_ids:
            return s.token_ids[num_out % len(s.token_ids)]
        return 1 + (31 * tokens[-1] + len(tokens)) % (s.vocab_size - 1)

    def _sample(
        self, so: SchedulerOutput, samplers: list[str], grammar: GrammarOutput | None
    ) -> ModelRunnerOutput:
        rows: dict[str, list[int]] = {}  # req id -> its bitmask rows, one per position
        for i, rid in enumerate(grammar.req_ids if grammar is not None else ()):
            rows.setdefault(rid, []).append(i)
        sampling = set(samplers)
        req_ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            req_ids.append(rid)
            if rid not in sampling:
                sampled.append([])
                continue
            st = self.reqs[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid)
            masks = [grammar.bitmask[i] for i in rows[rid]] if rid in rows else None  # type: ignore[union-attr]
            if drafts:
                st.sampled = self._verify(st, drafts, masks, rid)
                sampled.append(st.sampled)
                continue
            tok = self.next_token(st.tokens, st.num_prompt)
            if masks:
                tok = _allowed_token(masks[0], tok, rid)
            st.sampled = [tok]
            sampled.append([tok])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _verify(
        self, st: _ReqState, drafts: list[int], masks: list[Any] | None = None, rid: str = ""
    ) -> list[int]:
        """The drafts that equal the fake model's next tokens (each position through its own
        bitmask row, if any), then its own next token; the rejected drafts' positions no
        longer count as computed."""
        out: list[int] = []
        for j in range(len(drafts) + 1):
            tok = self.next_token(st.tokens + drafts[:j], st.num_prompt)
            if masks:
                tok = _allowed_token(masks[j], tok, rid)
            out.append(tok)
            if j == len(drafts) or tok != drafts[j]:
                break
        st.num_computed = len(st.tokens) + len(out) - 1
        return out

    # ---------------------------------------------------------- lifecycle

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        fn = (
            getattr(self, method)
            if isinstance(method, str)
            else (lambda *a, **k: method(self, *a, **k))
        )
        try:
            return [fn(*args, **(kwargs or {}))]
        except Exception as e:  # that call fails, the executor goes on (as the real ones)
            raise worker_error(0, f"{type(e).__name__}: {e}") from e

    def register_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        self._latch.register(callback)

    def check_health(self) -> None:
        self._latch.check()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


def _allowed_token(row: Any, tok: int, rid: str) -> int:
    """The first token id >= ``tok`` (wrapping) whose bit is set in a bitmask row."""
    words = row.tolist()
    vocab = len(words) * 32
    for k in range(vocab):
        t = (tok + k) % vocab
        if (words[t >> 5] >> (t & 31)) & 1:
            return t
    raise ExecutorError(f"request {rid!r}: the grammar bitmask allows no token")


def create_fake_executor(config: Any, settings: FakeExecutorSettings | None) -> FakeExecutor:
    """The registry factory: ``factory(config, settings)``."""
    return FakeExecutor(settings, block_size=config.cache.block_size)


class _FakeExecutorPlugin:
    BATON_PLUGIN_API = 1

    @hookimpl
    def register_executors(self, register: Any) -> None:
        register("fake", create_fake_executor, FakeExecutorSettings)


def register_fake_executor(plugins: Any = None) -> None:
    """Make executor ``fake`` selectable in ``plugins`` (default: the process-wide one). Idempotent."""
    if plugins is None:
        plugins = get_plugins()
    if plugins.pm.has_plugin(PLUGIN_NAME):
        return
    plugins.register(_FakeExecutorPlugin(), PLUGIN_NAME, "baton-core", __version__)
