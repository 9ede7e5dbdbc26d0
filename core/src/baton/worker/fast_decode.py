"""Decode-only steps of Llama-block models in one native call (``torch.ops.baton.decode_layers``).

A batch-1 decode step through transformers' modules dispatches ~15 torch ops per
layer from Python: ~13 ms per token on a 30-layer model, more than its matmuls.
For a step whose every token is a decode token (one query per request, no
prefill chunk) the runner instead embeds the tokens in Python, takes cos/sin from
the model's own rotary module (so any rope_scaling transformers implements
applies), runs every layer, the final norm and (when its module would run one of baton's
kernels at that row count) the LM head in ``decode_layers`` (kernels/decode_stack.cpp:
up to the kernels' row limits in one parallel region), else the head with its module. A step
whose sampler reads only argmaxes (``StepInputs.argmax_only``) runs an exact packed head
screened instead (``linear_qp_argmax``: -inf where a logit cannot be its row's largest).

It applies to models whose layers are exactly the Llama block: LlamaForCausalLM,
Qwen2ForCausalLM (q/k/v biases) and MistralForCausalLM, without sliding windows,
float32 or bfloat16 on CPU with baton's kernels, linears that are nn.Linear /
SmallBatchLinear / QuantLinear, and no hooks on any module (other wrappers change
the modules and are refused). baton's own LoRA layers (``lora/model.py``) wrap the
linears after this path is built from their weights; the runner sends a step with
any adapter through transformers' modules instead. ``build_fast_decode`` (``fast_decode_build``) returns None,
with a debug log of the reason, for anything else; transformers' code then runs
every step, as it always does for prefill and mixed steps.

A bfloat16 model's stack keeps its residual stream, norms, rotary and attention in float32 (its
KV cache stays bfloat16) and runs each bfloat16 linear as a bf16 GEMM on its input rounded to
bfloat16: where AMX is granted on weights packed at load (``bf16_tiles``: oneDNN's brgemm, the
whole stack in the one parallel region at any row count), else ``at::linear`` op by op. It rounds less than transformers' bfloat16 modules (which round
the residual stream after every layer), so its tokens are not theirs bit for bit; they are the
same from run to run.

Batch-invariant mode (``executor.batch_invariant``): every step, prefill chunks and mixed
steps included, runs here (``invariant_logits``): each token is one row of ``decode_layers``
attending over its own context in the paged cache (keys of its chunk written first), in the
one parallel region at any row count, its linears summed in one order whatever the rows
beside it (``invariant=True``), and the LM head on the rows that need logits through the
same kernels. ``build_fast_decode(..., invariant=True)`` raises an ExecutorError naming
why instead of returning None.

A tensor-parallel rank's model (``baton.parallel.sharding``: column-parallel q/k/v/gate/up,
``RowParallelLinear`` o/down, vocabulary-parallel embedding and head) runs here in
batch-invariant mode only, one half layer per ``decode_layers`` call (``part``): the rank's
o_proj / down_proj partial sums are added across ranks in rank order
(``ParallelContext.sum_in_rank_order``), the head's vocabulary slices gathered on the driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from baton.errors import ExecutorError
from baton.kernels.attention import key_cache_view
from baton.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from baton.parallel.context import ParallelContext


#: Prefill and mixed steps of up to this many tokens run the native stack too (``step_logits``),
#: every token a row attending over its own context, when their prompt rows attend over at most
#: STACK_MAX_PROMPT_KEYS keys each on average: the per-op Python of transformers' modules and
#: their linears cost more than the row-by-row attention there. The latency-aware budget's small
#: chunks live here (on the 16-request grounded workload a 30-token mixed step took ~105 ms
#: through the modules and ~60 ms through the stack), and so does a whole 2048-token step of
#: short prompts: AMD Zen 4, 2 threads, exact Q4_1, prefill of 8 prompts of 256 tokens 3.00 /
#: 3.18 s through the modules, 2.65 / 2.45 s here; 4 of 512 3.30 -> 2.89 s.
STACK_MAX_TOKENS = 2048
#: The most keys a step's prompt rows may attend over on average for the stack to run it: each
#: row reads its keys on its own, where the modules' flash attention reuses a block of keys
#: across a chunk's rows. Same host: one 1536-token prompt (768 keys a row) 2.89-2.94 s here
#: against 2.92-3.08 through the modules, 2 of 1024 (512) 3.38 against 3.82; a 3000-token prompt
#: (its second chunk 2524 keys a row) 7.82 against 7.24 s, 6000 tokens in chunks of 512 25.4
#: against 22.1 s.
STACK_MAX_PROMPT_KEYS = 768


@dataclass
class FastDecode:
    """The weights of a model's layer stack as decode_layers takes them; runs decode-only steps
    (``logits``), short prefill and mixed steps (``step_logits``) and batch-invariant ones."""

    embed: torch.nn.Module
    rotary: torch.nn.Module
    head: torch.nn.Module
    norms: list[torch.Tensor]
    weights: list[torch.Tensor]
    biases: list[torch.Tensor]
    qtypes: list[int]
    q8a: list[int]
    #: per linear, its rows repacked (QuantLinear.packed: linear_q8p with q8a, else linear_qp), or
    #: its bfloat16 tiles, or an empty tensor
    packed: list[torch.Tensor]
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float
    quant_max_rows: int
    float_max_rows: int
    #: rows up to which packed linears run their decode-sized kernel (QuantLinear.max_kernel_rows)
    packed_max_rows: int
    #: The LM head as decode_layers takes it (weight, qtype: -1 float32, -2 bfloat16, int8-activation flag,
    #: bias or None, the most rows its module sends to the kernel), or None: the module runs it.
    head_args: tuple[torch.Tensor, int, int, torch.Tensor | None, int] | None = None
    #: the head's rows repacked (QuantLinear.packed) or bfloat16 tiles, or None
    head_packed: torch.Tensor | None = None
    #: packed_row_bounds of an exact packed head: steps that need only each row's argmax run it
    #: screened (``linear_qp_argmax``); None where the head is not one
    head_bounds: torch.Tensor | None = None
    #: cos/sin [max positions, head_dim] computed once by ``rotary`` when its rope type does not
    #: depend on the sequence length; None: ``rotary`` runs every step.
    cos_table: torch.Tensor | None = None
    sin_table: torch.Tensor | None = None
    #: a tensor-parallel rank's group (its model is sharded: ``sharded_hidden``), else None
    tp: ParallelContext | None = None
    #: per half layer (attention, MLP), the o_proj / down_proj bias a sharded model adds once,
    #: after the ranks' sum (None: no bias)
    after_sum: list[torch.Tensor | None] = field(default_factory=list)
    #: the vocabulary (a sharded head's last slice is padded)
    vocab_size: int = 0
    #: the model's compute dtype: its embedding's output and its head's input (the stack itself
    #: runs in float32)
    dtype: torch.dtype = torch.float32
    #: Sampling rows from which a greedy step's head runs screened (``head_bounds``). Below, the
    #: head inside decode_layers' one parallel region costs less than the screening saves: AMD
    #: Zen 4, 2 threads, SmolLM2's Q8_0 head alone, linear_qp / screened: 1.04 / 0.88 ms at 1
    #: row (but streamed from memory in a decode step), 2.40 / 2.03 at 8, 4.37 / 3.59 at 16;
    #: batch-1 exact decode 182 / 179 tok/s fused, 175 / 174 screened.
    SCREEN_MIN_ROWS: ClassVar[int] = 8
    #: decode-only steps run so far (tests and benchmarks check that the path is taken)
    steps: int = field(default=0, init=False)
    #: the K / V views of the step's caches, made once for the list the runner passes every step
    _caches: list[torch.Tensor | None] | None = field(default=None, init=False, repr=False)
    _k: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)
    _v: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)

    def forget_caches(self) -> None:
        """Drop the views of the KV caches (they are being freed: the runner sleeps)."""
        self._caches, self._k, self._v = None, [], []

    @staticmethod
    def applies(inputs: StepInputs) -> bool:
        """Whether ``inputs`` is a decode-only step in one decode group through the kernels."""
        a = inputs.attn
        return (
            a.kernels
            and not a.prefills
            and len(a.decode_groups) == 1
            and a.decode_groups[0].n == a.num_tokens
            and a.kv_caches is not None
        )

    @staticmethod
    def takes_rows(inputs: StepInputs) -> bool:
        """Whether ``step_logits`` can run ``inputs``: the builder gave each token its block table
        (a prefill or mixed step short enough, or any step in batch-invariant mode) and the
        attention runs through the kernels."""
        a = inputs.attn
        return inputs.token_blocks is not None and a.kernels and a.kv_caches is not None

    def logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [sampling requests, vocab] of a decode-only step (``applies(inputs)``)."""
        g = inputs.attn.decode_groups[0]
        screen = self._screens(inputs)
        fused_head = (
            not screen
            and self.head_args is not None
            and (inputs.logits_indices.numel() == g.n and g.n <= self.head_args[4])
        )
        hidden = self._stack(
            inputs, g.blocks.view(g.n, -1), g.ctx_lens, fused_head, inputs.rows_share_context
        )
        if fused_head:
            return hidden  # the logits: decode_layers ran the head too
        if inputs.logits_indices.numel() != g.n:
            hidden = hidden.index_select(0, inputs.logits_indices)
        return self._head(hidden, screen)

    def step_logits(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [logits_indices, vocab] of a prefill or mixed step (``takes_rows(inputs)``):
        each token one row of decode_layers attending over its own context, keys of its
        chunk written first, the linears as their modules run them at the step's row count."""
        blocks = inputs.token_blocks
        assert blocks is not None and self.tp is None
        n = int(inputs.input_ids.shape[0])
        screen = self._screens(inputs)
        fused = (
            not screen
            and self.head_args is not None
            and inputs.logits_indices.numel() == n  # every row samples, in order
            and n <= self.head_args[4]
        )
        out = self._stack(inputs, blocks, inputs.positions + 1, fused, True)
        if fused:
            return out
        return self._head(out.index_select(0, inputs.logits_indices), screen)

    def _screens(self, inputs: StepInputs) -> bool:
        """Whether the step's head runs screened: its sampler reads only argmaxes, and the head
        would run linear_qp at its row count (so the argmaxes are linear_qp's), from
        SCREEN_MIN_ROWS rows."""
        return (
            inputs.argmax_only
            and self.head_bounds is not None
            and self.head_args is not None
            and self.SCREEN_MIN_ROWS <= inputs.logits_indices.numel() <= self.head_args[4]
        )

    def _head(self, hidden: torch.Tensor, screen: bool) -> torch.Tensor:
        """The LM head on the sampling rows' hidden states: its module, or screened (exact logits
        where one can be its row's largest, -inf elsewhere)."""
        if not screen:
            return self.head(hidden.to(self.dtype))
        assert self.head_args is not None and self.head_bounds is not None
        _, qtype, _, bias, _ = self.head_args
        return torch.ops.baton.linear_qp_argmax(
            hidden.float().contiguous(), self.head_packed, qtype, bias, self.head_bounds
        )

    def invariant_logits(
        self, inputs: StepInputs, want_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [logits_indices, vocab] of any step, batch-invariant (executor.batch_invariant);
        with ``want_hidden`` also every token's final normed hidden state [tokens, hidden]
        (pooling). Needs ``inputs.token_blocks``."""
        blocks = inputs.token_blocks
        if blocks is None:
            raise ExecutorError(
                "batch-invariant step without per-token block tables: build the step inputs "
                "with a StepInputBuilder whose token_tables covers every step"
            )
        n = int(inputs.input_ids.shape[0])
        if self.tp is not None:
            out = self.sharded_hidden(inputs, blocks)
            rows = out.index_select(0, inputs.logits_indices)
            return self.invariant_head(rows), out if want_hidden else None
        fused = (
            self.head_args is not None
            and not want_hidden
            and inputs.prompt_rows is None
            and inputs.logits_indices.numel() == n  # every row samples, in order
        )
        out = self._stack(inputs, blocks, inputs.positions + 1, fused, True, invariant=True)
        if fused:
            return out, None
        rows = out.index_select(0, inputs.logits_indices)
        return self.invariant_head(rows), out if want_hidden else None

    def invariant_head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head on rows ``x`` through the kernel decode_layers runs it with (the same
        sums for a row whatever the other rows)."""
        if self.head_args is None:
            raise ExecutorError("batch-invariant head: the LM head is not one of baton's kernels")
        w, qtype, q8a, bias, _ = self.head_args
        x = x.contiguous()
        if qtype < 0:
            y = x.new_empty(x.shape[0], w.shape[0])
            if x.shape[0]:
                torch.ops.baton.linear_small(x, w, y)
            y = y.add_(bias) if bias is not None else y
            if self.tp is None:
                return y
            full = self.tp.gather_last_dim(y)  # concatenation: each logit is one rank's sum
            return full[:, : self.vocab_size] if full is not None else y
        if self.head_packed is not None:  # as decode_layers runs it, at any row count
            op = torch.ops.baton.linear_q8p if q8a else torch.ops.baton.linear_qp
            return op(x, self.head_packed, qtype, bias)
        if q8a:
            return torch.ops.baton.linear_q8a(x, w, qtype, bias)
        return torch.ops.baton.linear_q(x, w, qtype, bias, True)

    def _stack(
        self,
        inputs: StepInputs,
        blocks: torch.Tensor,
        ctx_lens: torch.Tensor,
        fused_head: bool,
        shared_context: bool,
        invariant: bool = False,
    ) -> torch.Tensor:
        """decode_layers over the step's tokens, one row each (``blocks`` [tokens, blocks] and
        ``ctx_lens`` [tokens]): the final normed hidden states, or the logits when ``fused_head``."""
        self._cache_views(inputs)
        h = self.embed(inputs.input_ids).float()  # no copy in a float32 model
        cos, sin = self._rotary(h, inputs.positions)
        head = (
            self.head_args[:4] if fused_head and self.head_args is not None else (None, -1, 0, None)
        )
        self.steps += 1
        return self._layers(
            h, cos, sin, inputs, blocks, ctx_lens, head, shared_context, invariant, -1
        )

    def sharded_hidden(self, inputs: StepInputs, blocks: torch.Tensor) -> torch.Tensor:
        """A tensor-parallel rank's invariant step: the final normed hidden states [tokens,
        hidden], every half layer's partial sums added across the ranks in rank order."""
        assert self.tp is not None
        self._cache_views(inputs)
        h = self.embed(inputs.input_ids)  # one rank's row, zeros from the others: exact
        cos, sin = self._rotary(h, inputs.positions)
        ctx_lens = inputs.positions + 1
        args = (cos, sin, inputs, blocks, ctx_lens, (None, -1, 0, None), True, True)
        for part, bias in enumerate(self.after_sum):
            y = self.tp.sum_in_rank_order(self._layers(h, *args, part))
            h = h + (y + bias if bias is not None else y)
        self.steps += 1
        return self._layers(h, *args, len(self.after_sum))  # the final norm

    def _rotary(
        self, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [tokens, head_dim] of the step's positions."""
        if self.cos_table is not None and self.sin_table is not None:
            return self.cos_table.index_select(0, positions), self.sin_table.index_select(
                0, positions
            )
        cos, sin = (t[0].float().contiguous() for t in self.rotary(h[None], positions[None]))
        return cos, sin

    def _cache_views(self, inputs: StepInputs) -> None:
        a = inputs.attn
        if a.kv_caches is not self._caches:
            self._k = [key_cache_view(c) for c in a.kv_caches]
            self._v = [c[1] for c in a.kv_caches]
            self._caches = a.kv_caches

    def _layers(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        inputs: StepInputs,
        blocks: torch.Tensor,
        ctx_lens: torch.Tensor,
        head: tuple[torch.Tensor | None, int, int, torch.Tensor | None],
        shared_context: bool,
        invariant: bool,
        part: int,
    ) -> torch.Tensor:
        """One decode_layers call (``part``: -1 the whole stack, else one half layer or the
        final norm)."""
        return torch.ops.baton.decode_layers(
            h,
            cos,
            sin,
            self.norms,
            self.weights,
            self.biases,
            self.qtypes,
            self.q8a,
            self._k,
            self._v,
            inputs.attn.slot_mapping,
            blocks,
            ctx_lens,
            self.num_heads,
            self.num_kv_heads,
            self.eps,
            self.scale,
            self.quant_max_rows,
            self.float_max_rows,
            *head,
            shared_context,
            invariant,
            part,
            self.packed,
            self.head_packed if head[0] is not None else None,
            self.packed_max_rows,
        )
