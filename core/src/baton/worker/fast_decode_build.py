"""Building a FastDecode from a model: check that its layers are the Llama block, and take their
weights as ``decode_layers`` takes them (``build_fast_decode``; the steps run in ``fast_decode``).

A model qualifies when its architecture is one of ARCHITECTURES, every layer has exactly the
Llama block's children, no module has hooks, and its linears, norms, embedding and head are ones
the stack runs (float32 / bfloat16 / GGUF blocks on CPU with baton's kernels). Anything else is
``Unsupported``: ``build_fast_decode`` returns None with a debug log of the reason (or, for
batch-invariant mode, raises an ExecutorError naming it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from baton.errors import ExecutorError
from baton.kernels.cpu_linear import (
    HEAD_KERNEL_MAX_ROWS,
    KERNEL_MAX_ROWS,
    CpuLMHead,
    SmallBatchLinear,
)
from baton.quant.linear import QuantLinear
from baton.worker.fast_decode import FastDecode

if TYPE_CHECKING:
    from baton.parallel.context import ParallelContext

log = logging.getLogger(__name__)

#: transformers classes whose decoder layers are the Llama block (checked module by module too).
ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"})
#: The linears of one layer, in the order decode_layers takes them.
LINEARS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP_CHILDREN = {"gate_proj", "up_proj", "down_proj", "act_fn"}
#: decode_layers' "none" in a list of tensors: no bias, no packed rows
_NO_BIAS = _NOT_PACKED = torch.empty(0)
#: baton.parallel.sharding's modules (by name: that package imports the runner, which imports this)
ROW_PARALLEL, VOCAB_EMBEDDING, VOCAB_HEAD = (
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
)
#: decode_layers' qtype of a plain linear, by its weights' dtype (the model's compute dtype)
FLOAT32_WEIGHTS, BF16_WEIGHTS = -1, -2
WEIGHT_QTYPES = {torch.float32: FLOAT32_WEIGHTS, torch.bfloat16: BF16_WEIGHTS}
#: A bfloat16 head's row limit: decode_layers runs it at any row count.
ANY_ROWS = 1 << 30
#: rope types whose cos/sin depend on the position alone (not on the sequence length, as
#: "dynamic" and "longrope" do): tabulated once at load.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class Unsupported(Exception):
    """Why the fast path does not apply to a model (caught by build_fast_decode)."""


def build_fast_decode(
    model: torch.nn.Module,
    device: torch.device,
    kernels: bool,
    max_positions: int,
    invariant: bool = False,
) -> FastDecode | None:
    """The fast decode path for ``model`` (positions below ``max_positions``), or None (debug
    log: why) when it does not apply. ``invariant`` (executor.batch_invariant): it must apply
    to every step, else an ExecutorError naming why."""
    try:
        fast = _build(model, device, kernels)
        if fast.tp is not None and not invariant:
            raise Unsupported("a tensor-parallel shard runs it in batch-invariant mode only")
        static = getattr(fast.rotary, "rope_type", None) in STATIC_ROPE_TYPES
        if invariant:
            _check_invariant(fast, static)
    except Unsupported as e:
        if invariant:
            raise ExecutorError(
                f"executor.batch_invariant = true: this model cannot run batch-invariant: {e}. "
                "Use a model the native layer stack runs (Llama, Qwen2, Mistral without sliding "
                "window; float32 or GGUF blocks on CPU) or set batch_invariant = false"
            ) from None
        log.debug("fast decode off, transformers' modules run every step: %s", e)
        return None
    if static:
        fast.cos_table, fast.sin_table = _rotary_tables(fast.rotary, fast.embed, max_positions)
    return fast


def _check_invariant(fast: FastDecode, static_rope: bool) -> None:
    """Raise Unsupported where batch-invariant steps cannot run on ``fast``."""
    if not static_rope:
        raise Unsupported(
            f"rope_type {getattr(fast.rotary, 'rope_type', None)!r} depends on the sequence "
            f"length (only {', '.join(sorted(STATIC_ROPE_TYPES))} are tabulated per position)"
        )
    if BF16_WEIGHTS in fast.qtypes or (
        fast.head_args is not None and fast.head_args[1] == BF16_WEIGHTS
    ):
        raise Unsupported("bfloat16 weights (the row kernels sum float32 or GGUF-block weights)")
    if fast.head_args is None:
        raise Unsupported(f"the LM head {type(fast.head).__name__} is not one of baton's kernels")
    if not hasattr(torch.ops.baton, "linear_small"):
        raise Unsupported("baton's C++ kernels are not built")


def _rotary_tables(
    rotary: torch.nn.Module, embed: torch.nn.Module, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n, head_dim] of positions 0..n-1 from the model's rotary module (elementwise in
    the position: each row is what a step at that position computes)."""
    with torch.inference_mode():
        x = embed(torch.zeros(1, 1, dtype=torch.long))
        cos, sin = rotary(x, torch.arange(n)[None])
    # in a bfloat16 model: the bfloat16 values its modules use, widened exactly
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def _build(model: torch.nn.Module, device: torch.device, kernels: bool) -> FastDecode:
    arch = type(model).__name__
    if arch not in ARCHITECTURES:
        raise Unsupported(f"{arch} is not one of {', '.join(sorted(ARCHITECTURES))}")
    if device.type != "cpu":
        raise Unsupported(f"device {device} (the native layer stack is CPU-only)")
    if not kernels or not hasattr(torch.ops.baton, "decode_layers"):
        raise Unsupported("baton's C++ kernels are off or not built")
    cfg = model.config.get_text_config()
    if getattr(cfg, "hidden_act", None) != "silu":
        raise Unsupported(f"hidden_act={getattr(cfg, 'hidden_act', None)!r}, not silu")
    if arch == "MistralForCausalLM" and getattr(cfg, "sliding_window", None) is not None:
        raise Unsupported(f"sliding_window={cfg.sliding_window}")
    inner = model.model
    layers = list(inner.layers)
    if len(layers) != cfg.num_hidden_layers:
        raise Unsupported(f"{len(layers)} layers, config says {cfg.num_hidden_layers}")
    _check_no_hooks(model)
    embed, head = inner.embed_tokens, model.get_output_embeddings()
    if type(embed).__name__ not in ("Embedding", "QuantEmbedding", VOCAB_EMBEDDING):
        raise Unsupported(f"embedding {type(embed).__name__}")

    dtype = inner.norm.weight.dtype
    if dtype not in WEIGHT_QTYPES:
        raise Unsupported(f"dtype {dtype} (float32 or bfloat16)")

    num_heads = cfg.num_attention_heads
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    norms, weights, biases, qtypes, q8a, packed = [], [], [], [], [], []
    after_sum: list[torch.Tensor | None] = []
    tps: list[ParallelContext] = []
    eps: float | None = None
    scale: float | None = None
    for i, layer in enumerate(layers):
        if not type(layer).__name__.endswith("DecoderLayer"):
            raise Unsupported(f"layer {i} is a {type(layer).__name__}")
        _children(layer, _LAYER_CHILDREN, f"layer {i}")
        attn, mlp = layer.self_attn, layer.mlp
        _children(attn, _ATTN_CHILDREN, f"layer {i} attention")
        _children(mlp, _MLP_CHILDREN, f"layer {i} MLP")
        if getattr(attn, "sliding_window", None) is not None:
            raise Unsupported(f"layer {i} has sliding_window={attn.sliding_window}")
        if type(mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
            raise Unsupported(f"layer {i} activation {type(mlp.act_fn).__name__}")
        if scale is None:
            scale = float(attn.scaling)
        elif float(attn.scaling) != scale:
            raise Unsupported(f"layer {i} attention scaling {attn.scaling} != {scale}")
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            eps = _norm(norm, eps, norms, f"layer {i}")
        for parent, name in LINEARS:
            m = getattr(getattr(layer, parent), name)
            if type(m).__name__ == ROW_PARALLEL:  # its bias is added after the ranks' sum
                tps += [m.ctx] if all(m.ctx is not t for t in tps) else []
                after_sum.append(m.bias.detach() if m.bias is not None else None)
            _linear(m, f"layer {i} {name}", weights, biases, qtypes, q8a, packed)
    eps = _norm(inner.norm, eps, norms, "final norm")
    assert eps is not None and scale is not None  # at least one layer
    tp = _one_group(tps, len(after_sum), 2 * len(layers), embed, head)
    head_args = _head_args(head)
    shards = tp.tp_size if tp is not None else 1
    packed_rows = {
        m.max_kernel_rows
        for m in model.modules()
        if type(m) is QuantLinear and m.packed is not None and m.kernels
    }
    if len(packed_rows) > 1:  # one limit for every packed linear, as the stack takes it
        raise Unsupported(f"packed linears with different row limits {sorted(packed_rows)}")
    return FastDecode(
        tp=tp,
        after_sum=after_sum if tp is not None else [],
        vocab_size=getattr(head, "vocab_size", 0),
        dtype=dtype,
        head_args=head_args,
        head_packed=_head_packed(head, head_args),
        head_bounds=_head_bounds(head) if tp is None else None,
        embed=embed,
        rotary=inner.rotary_emb,
        head=head,
        norms=norms,
        weights=weights,
        biases=biases,
        qtypes=qtypes,
        q8a=q8a,
        packed=packed,
        num_heads=num_heads // shards,
        num_kv_heads=num_kv_heads // shards,
        eps=eps,
        scale=scale,
        quant_max_rows=QuantLinear.KERNEL_MAX_ROWS,
        float_max_rows=KERNEL_MAX_ROWS,
        packed_max_rows=packed_rows.pop() if packed_rows else QuantLinear.KERNEL_MAX_ROWS,
    )


def _head_args(
    head: torch.nn.Module,
) -> tuple[torch.Tensor, int, int, torch.Tensor | None, int] | None:
    """The LM head for decode_layers when its module would run one of baton's kernels at a few
    rows (the same kernel, so the same logits), else None."""
    bias = head.bias.detach() if getattr(head, "bias", None) is not None else None
    if bias is not None and (bias.dtype not in WEIGHT_QTYPES or not bias.is_contiguous()):
        return None
    bias = bias.float() if bias is not None else None
    if type(head) is QuantLinear and head.kernels:
        q8a = int(bool(head.int8_activations) and hasattr(torch.ops.baton, "linear_q8a"))
        return head.stored_rows, int(head.qtype), q8a, bias, head.max_kernel_rows
    if type(head).__name__ == VOCAB_HEAD:  # this rank's rows of the vocabulary, kept transposed
        w = head.weight_t.t().contiguous()
        head.weight_t = w.t()  # the module's view of the one copy
        return w, -1, 0, bias, HEAD_KERNEL_MAX_ROWS
    if type(head) in (CpuLMHead, SmallBatchLinear):
        w = head.weight.detach()
        if not w.is_contiguous():
            return None
        if w.dtype == torch.bfloat16:  # at::linear, as the stack's other bfloat16 linears
            return w, BF16_WEIGHTS, 0, bias, ANY_ROWS
        if (type(head) is CpuLMHead and not head.kernels) or w.dtype != torch.float32:
            return None
        rows = HEAD_KERNEL_MAX_ROWS if type(head) is CpuLMHead else KERNEL_MAX_ROWS
        return w, -1, 0, bias, rows
    return None


def bf16_tiles(w: torch.Tensor) -> torch.Tensor:
    """``w`` packed for AMX tiles (``pack_bf16_tiles``: decode_layers then runs the whole stack in
    one parallel region at any row count), or an empty tensor where this CPU or build has none
    (the linear runs through at::linear, op by op)."""
    if not hasattr(torch.ops.baton, "bf16_tiles") or not torch.ops.baton.bf16_tiles():
        return _NOT_PACKED
    if w.shape[1] % 2:
        return _NOT_PACKED
    return torch.ops.baton.pack_bf16_tiles(w)


def _head_packed(
    head: torch.nn.Module, head_args: tuple[torch.Tensor, int, int, torch.Tensor | None, int] | None
) -> torch.Tensor | None:
    """The LM head's packed rows as decode_layers takes them (``head_args``: as _head_args gave
    them), or None."""
    if type(head) is QuantLinear:
        return head.packed
    if head_args is not None and head_args[1] == BF16_WEIGHTS:
        tiles = bf16_tiles(head_args[0])
        return tiles if tiles.numel() else None
    return None


def _head_bounds(head: torch.nn.Module) -> torch.Tensor | None:
    """packed_row_bounds of a head that runs linear_qp (exact, on packed rows), or None."""
    if (
        type(head) is not QuantLinear
        or head.packed is None
        or head.int8_activations
        or not head.kernels
        or not hasattr(torch.ops.baton, "linear_qp_argmax")
    ):
        return None
    return torch.ops.baton.packed_row_bounds(head.packed, int(head.qtype))


def _one_group(
    tps: list[ParallelContext],
    row_parallel: int,
    halves: int,
    embed: torch.nn.Module,
    head: torch.nn.Module,
) -> ParallelContext | None:
    """The tensor-parallel group of a sharded model (None: not sharded); Unsupported unless
    every o_proj / down_proj, the embedding and the head are sharded over that one group."""
    if not tps:
        return None
    parts = [type(embed).__name__, type(head).__name__]
    if len(tps) != 1 or row_parallel != halves or parts != [VOCAB_EMBEDDING, VOCAB_HEAD]:
        raise Unsupported(
            f"a partly sharded model ({row_parallel} of {halves} o/down projections row-parallel "
            f"over {len(tps)} group(s), embedding {parts[0]}, head {parts[1]})"
        )
    return tps[0]


def _check_no_hooks(model: torch.nn.Module) -> None:
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            raise Unsupported(f"module {name or type(m).__name__} has forward hooks")


def _children(module: torch.nn.Module, expected: set[str], what: str) -> None:
    names = {n for n, _ in module.named_children()}
    if names != expected:
        raise Unsupported(f"{what} has modules {sorted(names)}, expected {sorted(expected)}")


def _norm(norm: torch.nn.Module, eps: float | None, out: list[torch.Tensor], what: str) -> float:
    """Check an RMSNorm (Llama's form: weight * normed), append its weight, return its eps."""
    name = type(norm).__name__
    if name not in ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"):
        raise Unsupported(f"{what} norm {name}")
    w = norm.weight.detach()
    if w.dtype not in WEIGHT_QTYPES or w.device.type != "cpu" or not w.is_contiguous():
        raise Unsupported(f"{what} norm weight {w.dtype} on {w.device}")
    w = w.float()  # the stack norms in float32 (a bfloat16 weight widened exactly)
    e = float(norm.variance_epsilon)
    if eps is not None and e != eps:
        raise Unsupported(f"{what} norm eps {e} != {eps}")
    out.append(w)
    return e


def _linear(
    m: torch.nn.Module,
    what: str,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor],
    qtypes: list[int],
    q8a: list[int],
    packed: list[torch.Tensor],
) -> None:
    """Append one linear's weight, bias (empty: none; a RowParallelLinear's is added after the
    ranks' sum), qtype (-1: float32, -2: bfloat16), int8-activation flag and packed rows
    (empty: none)."""
    row_parallel = type(m).__name__ == ROW_PARALLEL
    bias = m.bias.detach() if m.bias is not None and not row_parallel else None
    if type(m) in (torch.nn.Linear, SmallBatchLinear) or row_parallel:
        w = m.weight.detach()
        if w.dtype not in WEIGHT_QTYPES or not w.is_contiguous():
            raise Unsupported(f"{what} weight {w.dtype}, contiguous={w.is_contiguous()}")
        weights.append(w)
        qtypes.append(WEIGHT_QTYPES[w.dtype])
        q8a.append(0)
        packed.append(bf16_tiles(w) if w.dtype == torch.bfloat16 else _NOT_PACKED)
    elif type(m) is QuantLinear:
        if not m.kernels:
            raise Unsupported(f"{what} is a QuantLinear without kernels")
        weights.append(m.stored_rows)
        qtypes.append(int(m.qtype))
        q8a.append(
            int(
                bool(getattr(m, "int8_activations", False))
                and hasattr(torch.ops.baton, "linear_q8a")
            )
        )
        packed.append(m.packed if m.packed is not None else _NOT_PACKED)
    else:
        raise Unsupported(f"{what} is a {type(m).__name__}")
    if bias is not None and (bias.dtype not in WEIGHT_QTYPES or not bias.is_contiguous()):
        raise Unsupported(f"{what} bias {bias.dtype}")
    biases.append(bias.float() if bias is not None else _NO_BIAS)
