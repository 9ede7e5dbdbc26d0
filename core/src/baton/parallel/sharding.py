"""Tensor-parallel sharding of a loaded Hugging Face causal LM, driven by its own tp plan (public).

transformers describes how each model splits (``config.base_model_tp_plan``,
e.g. ``{"layers.*.self_attn.q_proj": "colwise", ...}``). We apply that plan
ourselves to the plain modules (no DTensor): a "colwise" linear keeps this
rank's rows of the weight (its heads, its slice of the MLP), a "rowwise" one its
columns, followed by an all-reduce over the stage's tensor-parallel group. The
vocabulary is split too: the embedding looks up only this rank's rows (an
all-reduce assembles the vectors) and the LM head computes this rank's slice
of the logits, gathered on tp rank 0 (the driver samples).

Attention needs no change: each rank's q/k/v projections produce its own heads,
and baton's paged attention takes the head counts from the tensors. The KV
cache of a rank holds only its KV heads (``shard_kv_shape``). Used by the cuda-tp
executor and by every stage of the pipeline executor when tensor_parallel_size > 1.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch
import torch.nn.functional as F

from baton.errors import ConfigError, ExecutorError
from baton.parallel.context import ParallelContext
from baton.worker.runner_hooks import KVShape

#: Plan styles applied as-is; "replicated_with_grad_allreduce" (q/k norms) needs nothing at inference.
COLWISE, ROWWISE, REPLICATED = "colwise", "rowwise", "replicated_with_grad_allreduce"


def text_config(hf_config: Any) -> Any:
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def tp_plan(hf_config: Any) -> dict[str, str]:
    """The model's base-model tp plan; ConfigError when it has none or uses a style we do not apply."""
    from baton.parallel.expert import num_experts

    text = text_config(hf_config)
    experts = num_experts(text)
    if experts:
        raise ConfigError(
            f"executor.tensor_parallel_size > 1: {getattr(text, 'model_type', '?')!r} is a "
            f"mixture-of-experts model ({experts} experts per layer), whose experts baton's tensor "
            "parallel does not shard; run it with tensor_parallel_size = 1, or over "
            "data_parallel_size engines with executor.expert_parallel = true (each holds its share "
            "of the experts)"
        )
    plan = getattr(text, "base_model_tp_plan", None) or {}
    if not plan:
        raise ConfigError(
            f"executor.tensor_parallel_size > 1: model type {getattr(text, 'model_type', '?')!r} has no "
            "tensor-parallel plan in transformers (config.base_model_tp_plan); run it with tensor_parallel_size = 1"
        )
    bad = {k: v for k, v in plan.items() if v not in (COLWISE, ROWWISE, REPLICATED)}
    if bad:
        raise ConfigError(
            f"executor.tensor_parallel_size > 1: the tp plan of {getattr(text, 'model_type', '?')!r} uses "
            f"{sorted(set(bad.values()))} (for {sorted(bad)}); baton shards colwise/rowwise linears only"
        )
    return plan


def check_shardable(hf_config: Any, tp_size: int) -> None:
    """ConfigError naming the count when heads, KV heads or the MLP do not split into ``tp_size`` parts."""
    if tp_size == 1:
        return
    tp_plan(hf_config)
    text = text_config(hf_config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    counts = {"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    if getattr(text, "intermediate_size", None):
        counts["intermediate_size"] = text.intermediate_size
    for field, n in counts.items():
        if n % tp_size:
            divisors = [
                d
                for d in range(1, min(heads, kv_heads) + 1)
                if heads % d == 0 and kv_heads % d == 0
            ]
            raise ConfigError(
                f"executor.tensor_parallel_size={tp_size}: the model's {field}={n} is not divisible by it "
                f"({heads} query / {kv_heads} KV heads); use a tensor_parallel_size in {divisors}"
            )


def _generic(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def _split(n: int, ctx: ParallelContext, what: str) -> slice:
    if n % ctx.tp_size:
        raise ExecutorError(f"{what}: {n} is not divisible by tensor_parallel_size={ctx.tp_size}")
    per = n // ctx.tp_size
    return slice(ctx.tp_rank * per, (ctx.tp_rank + 1) * per)


class RowParallelLinear(torch.nn.Module):
    """``x[..., my columns] @ W[:, my columns]^T``, summed over the ranks (all-reduce), plus the bias once."""

    def __init__(self, linear: torch.nn.Linear, ctx: ParallelContext) -> None:
        super().__init__()
        cols = _split(linear.in_features, ctx, "rowwise input features")
        self.weight = torch.nn.Parameter(
            linear.weight.detach()[:, cols].clone(), requires_grad=False
        )
        self.bias = linear.bias
        self.in_features = linear.in_features // ctx.tp_size
        self.out_features = linear.out_features
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ctx.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


def column_parallel(linear: torch.nn.Linear, ctx: ParallelContext) -> torch.nn.Linear:
    """A Linear holding this rank's output rows (no communication)."""
    rows = _split(linear.out_features, ctx, "colwise output features")
    out = torch.nn.Linear(
        linear.in_features,
        rows.stop - rows.start,
        bias=linear.bias is not None,
        dtype=linear.weight.dtype,
        device="meta",
    )
    out.weight = torch.nn.Parameter(linear.weight.detach()[rows].clone(), requires_grad=False)
    if linear.bias is not None:
        out.bias = torch.nn.Parameter(linear.bias.detach()[rows].clone(), requires_grad=False)
    return out


def _vocab_rows(vocab: int, ctx: ParallelContext) -> tuple[int, int, int]:
    """(first row, rows held, rows per rank): the last rank's shard is padded when vocab % tp != 0."""
    per = -(-vocab // ctx.tp_size)
    start = ctx.tp_rank * per
    return start, max(0, min(vocab, start + per) - start), per


def _vocab_shard(weight: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    start, n, per = _vocab_rows(weight.shape[0], ctx)
    shard = weight.new_zeros(per, weight.shape[1])
    shard[:n] = weight.detach()[start : start + n]
    return shard


class VocabParallelEmbedding(torch.nn.Module):
    """Looks up this rank's rows of the vocabulary; the all-reduce fills in the others' rows."""

    def __init__(self, emb: torch.nn.Embedding, ctx: ParallelContext) -> None:
        super().__init__()
        self.vocab_size, self.embedding_dim = emb.weight.shape
        self.start, _, self.rows = _vocab_rows(self.vocab_size, ctx)
        self.weight = torch.nn.Parameter(_vocab_shard(emb.weight, ctx), requires_grad=False)
        scale = getattr(emb, "embed_scale", None)  # e.g. Gemma3's scaled word embedding
        self.embed_scale = float(scale) if scale is not None else None
        self.ctx = ctx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        self.ctx.all_reduce(out)
        return out * self.embed_scale if self.embed_scale is not None else out


class VocabParallelLMHead(torch.nn.Module):
    """This rank's slice of the logits, gathered on tp rank 0 (others return their slice, unused).

    The shard is kept transposed and contiguous (``x @ W^T``): on CPU twice as fast as F.linear
    for the few rows that sample. ``weight`` is a meta tensor of the full shape [vocab, hidden]:
    the runner reads the vocabulary size from it.
    """

    def __init__(self, head: torch.nn.Linear, ctx: ParallelContext) -> None:
        super().__init__()
        self.vocab_size = head.weight.shape[0]
        self.register_buffer(
            "weight_t", _vocab_shard(head.weight, ctx).t().contiguous(), persistent=False
        )
        self.bias = None
        if head.bias is not None:
            start, n, per = _vocab_rows(self.vocab_size, ctx)
            bias = head.bias.detach().new_zeros(per)
            bias[:n] = head.bias.detach()[start : start + n]
            self.bias = torch.nn.Parameter(bias, requires_grad=False)
        self.weight = torch.empty(head.weight.shape, dtype=head.weight.dtype, device="meta")
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.matmul(x, self.weight_t)
        if self.bias is not None:
            y = y + self.bias
        full = self.ctx.gather_last_dim(y)
        return full[..., : self.vocab_size] if full is not None else y


def _set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def shard_model(model: torch.nn.Module, ctx: ParallelContext) -> int:
    """Shard ``model`` in place for ``ctx``'s tensor-parallel rank; returns the number of linears split.

    Modules a pipeline stage pruned (not Linear / not Embedding) are left alone.
    """
    if ctx.tp_size == 1:
        return 0
    check_shardable(model.config, ctx.tp_size)
    plan = {k: v for k, v in tp_plan(model.config).items() if v != REPLICATED}
    base = model.base_model
    done = 0
    for name, module in list(base.named_modules()):
        style = plan.get(_generic(name))
        if style is None:
            continue
        if type(module) is not torch.nn.Linear:
            raise ExecutorError(
                f"tp plan entry {name!r} ({style}) is a {type(module).__name__}, not a Linear"
            )
        _set_module(
            base,
            name,
            column_parallel(module, ctx) if style == COLWISE else RowParallelLinear(module, ctx),
        )
        done += 1
    emb = model.get_input_embeddings()
    if isinstance(emb, torch.nn.Embedding):  # a later pipeline stage has none
        model.set_input_embeddings(VocabParallelEmbedding(emb, ctx))
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear:  # an earlier pipeline stage has none
        model.set_output_embeddings(VocabParallelLMHead(head, ctx))
    return done


def shard_kv_shape(shape: KVShape, ctx: ParallelContext) -> KVShape:
    """The heads one tensor-parallel rank holds (its KV cache holds its KV heads only)."""
    if ctx.tp_size == 1:
        return shape
    return msgspec.structs.replace(
        shape,
        num_heads=shape.num_heads // ctx.tp_size,
        num_kv_heads=shape.num_kv_heads // ctx.tp_size,
    )
