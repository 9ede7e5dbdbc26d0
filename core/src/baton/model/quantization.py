"""Quantized weights for a loaded model (``model.quantization``), applied after a parallel
runner's ``prepare`` and before the model moves to its device.

- ``auto`` on a model converted from a GGUF: every linear layer, the LM head and
  the embedding whose GGUF tensor is quantized (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
  Q6_K) becomes a ``QuantLinear`` / ``QuantEmbedding`` over the file's own
  blocks, and its float32 copy is freed. A few rows of every tensor are checked
  against the converted float32 weights before they replace them, so a wrong
  name mapping or row order keeps the float32 layer (with a warning) instead of
  running wrong. On CPU, in float32, and without tensor parallelism (a pipeline
  stage keeps its own layers' types); otherwise the weights stay dequantized
  (info log).
- ``int8`` / ``int4``: every plain ``nn.Linear`` (a pipeline stage's own), the
  LM head and the embedding are quantized in groups of 32 (Q8_0 / Q4_1 blocks).
  The config refuses them with tensor parallelism.
- ``none``, and ``auto`` on any other checkpoint: nothing changes.

Layers that stay float are logged with the reason; ``QuantizationReport``
says what was done.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from baton.errors import ModelLoadError
from baton.model.gguf_tensors import (
    TOKEN_EMBD,
    GGUFTensors,
    gguf_source,
    gguf_tensor_name,
    qk_row_order,
    tensor_name_map,
)
from baton.quant import QType, QuantEmbedding, QuantLinear, dequantize, quantize

if TYPE_CHECKING:
    from baton.config import ExecutorSection, ModelSection

log = logging.getLogger(__name__)

#: Group size of the int8 / int4 modes (Q8_0 and Q4_1 blocks): in_features must be a multiple.
GROUP = 32
#: Rows of each GGUF tensor compared with the converted float32 weights before they are replaced
#: (row 1 moves under the q/k permutation). Few: each read faults in pages of the checkpoint.
CHECK_ROWS = 3


@dataclass
class QuantizationReport:
    """What ``quantize_model`` did: quantized modules (-> type), those kept float (-> why), bytes."""

    mode: str
    source: str = ""
    quantized: dict[str, str] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    weight_bytes: int = 0

    def summary(self) -> str:
        types: dict[str, int] = defaultdict(int)
        for t in self.quantized.values():
            types[t] += 1
        shown = ", ".join(f"{n} {t}" for t, n in sorted(types.items())) or "nothing"
        return (
            f"quantization={self.mode}{f' ({self.source})' if self.source else ''}: {shown} "
            f"quantized, {self.weight_bytes / 2**20:.1f} MiB; {len(self.kept)} kept float"
        )


def kernels_arg(executor: ExecutorSection) -> bool | None:
    """QuantLinear's ``kernels``: None (use them when they build) unless ``executor.cpu_kernels`` is off."""
    return None if executor.cpu_kernels else False


def quantize_model(
    model: torch.nn.Module,
    settings: ModelSection,
    executor: ExecutorSection,
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
) -> QuantizationReport:
    """Apply ``settings.quantization`` and ``activation_quantization`` to ``model`` (loaded
    from ``folder``, still on the CPU); ``executor``: its kernels and tensor-parallel size."""
    report = _quantize_weights(model, settings, executor, folder, device, dtype)
    act = settings.activation_quantization
    if report.quantized:
        set_activation_quantization(model, act)
    elif act != "none":
        log.warning(
            "model.activation_quantization=%s has no quantized layer to apply to "
            "(model.quantization=%s left every weight in float)",
            act,
            report.mode,
        )
    return report


def _quantize_weights(
    model: torch.nn.Module,
    settings: ModelSection,
    executor: ExecutorSection,
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
) -> QuantizationReport:
    mode = settings.quantization
    report = QuantizationReport(mode)
    if mode == "none":
        return report
    if mode == "auto":
        source = gguf_source(folder)
        if source is None:
            return report  # a checkpoint runs as stored
        why = _why_dequantized(executor, device, dtype)
        if why:
            log.info("%s: its quantized weights are dequantized to float: %s", source.name, why)
            return report
        report.source = source.name
        keep_gguf_types(model, source, kernels_arg(executor), report)
    else:
        if dtype != torch.float32:
            raise ModelLoadError(
                f"model.quantization={mode!r} computes in float32 but the model loads as "
                f"{str(dtype).removeprefix('torch.')} (model.dtype={settings.dtype!r}): "
                "set model.dtype = 'float32'"
            )
        quantize_linears(model, mode, kernels_arg(executor), report)
    if report.quantized:
        own_float_tensors(model)
    _log_kept(report)
    log.info("%s", report.summary())
    return report


def set_activation_quantization(model: torch.nn.Module, mode: str) -> None:
    """Set every QuantLinear's ``int8_activations`` from ``model.activation_quantization``."""

    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.int8_activations = mode == "int8"


def own_float_tensors(model: torch.nn.Module) -> None:
    """Copy the float parameters and buffers left (norms, biases, layers kept float) out of the
    checkpoint: transformers maps the safetensors file, and while one tensor views it, every
    page the load and the checks touched stays resident."""
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point() and t.device.type == "cpu":
                t.data = t.data.clone()


def _why_dequantized(executor: ExecutorSection, device: torch.device, dtype: torch.dtype) -> str:
    """Why ``auto`` cannot keep a GGUF's types here; "" when it can."""
    if device.type != "cpu":
        return f"quantized layers run on the CPU only (device {device})"
    if dtype != torch.float32:
        return (
            f"quantized layers compute in float32, not {str(dtype).removeprefix('torch.')}, "
            "so every weight is dequantized to it (model.dtype = 'float32' or 'auto' keeps "
            "the file's blocks)"
        )
    if executor.tensor_parallel_size > 1:
        return "tensor parallel shards keep float weights in this version"
    return ""


def _log_kept(report: QuantizationReport) -> None:
    by_reason: dict[str, list[str]] = defaultdict(list)
    for name, why in report.kept.items():
        by_reason[why].append(name)
    for why, names in by_reason.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        log.info("quantization=%s keeps float weights in %s: %s", report.mode, shown, why)


def _set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _module_name(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    if module is None:
        return None
    return next((n for n, m in model.named_modules() if m is module), None)


def _head_and_embedding(
    model: torch.nn.Module,
) -> tuple[torch.nn.Linear | None, torch.nn.Embedding | None, bool]:
    """The LM head and embedding when they are plain nn.Linear / nn.Embedding, and whether they are tied."""
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    head = head if type(head) is torch.nn.Linear else None
    emb = emb if type(emb) is torch.nn.Embedding and emb.max_norm is None else None
    tied = head is not None and emb is not None and head.weight is emb.weight
    return head, emb, tied


# --------------------------------------------------------------------------- int8 / int4


def quantize_linears(
    model: torch.nn.Module, mode: str, kernels: bool | None, report: QuantizationReport
) -> None:
    """Quantize every plain nn.Linear, the LM head and the embedding of ``model`` in place."""

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
        raw, qtype = quantize(weight.detach().float(), mode)
        n, k = weight.shape
        return QuantLinear(raw, qtype, k, n, bias=bias, kernels=kernels)

    head, emb, tied = _head_and_embedding(model)
    head_name, emb_name = _module_name(model, head), _module_name(model, emb)
    for name, module in list(model.named_modules()):
        if type(module) is not torch.nn.Linear or module is head:
            continue
        if module.in_features % GROUP:
            report.kept[name] = f"in_features {module.in_features} is not a multiple of {GROUP}"
            continue
        q = make(module.weight, module.bias)
        _set_module(model, name, q)
        _record(report, name, q)
    head_q = None
    if head is not None and head_name is not None:
        if head.in_features % GROUP:
            report.kept[head_name] = f"in_features {head.in_features} is not a multiple of {GROUP}"
        else:
            head_q = make(head.weight, head.bias)
            model.set_output_embeddings(head_q)
            _record(report, head_name, head_q)
    if emb is not None and emb_name is not None:
        if tied and head_q is not None and head_q.bias is None:
            model.set_input_embeddings(QuantEmbedding(head_q))  # the tied weight, quantized once
            report.quantized[emb_name] = report.quantized[head_name or ""]
        elif emb.embedding_dim % GROUP:
            report.kept[emb_name] = (
                f"embedding dim {emb.embedding_dim} is not a multiple of {GROUP}"
            )
        else:
            src = make(emb.weight, None)
            model.set_input_embeddings(QuantEmbedding(src))
            _record(report, emb_name, src)
    _kept_modules(model, report)


def _record(report: QuantizationReport, name: str, q: QuantLinear) -> None:
    report.quantized[name] = q.qtype.name
    report.weight_bytes += int(q.weight_bytes)


# --------------------------------------------------------------------------- GGUF auto


def keep_gguf_types(
    model: torch.nn.Module, source: Path, kernels: bool | None, report: QuantizationReport
) -> None:
    """Replace ``model``'s layers by the GGUF ``source``'s quantized tensors, where it has them."""

    text = model.config.get_text_config()
    tensors = GGUFTensors(source)
    try:
        name_map = tensor_name_map(tensors.architecture, text.num_hidden_layers)
        if name_map is None:
            report.kept["*"] = (
                f"gguf-py has no tensor names for architecture {tensors.architecture!r}"
            )
            return

        def convert(name: str, tname: str | None, w: torch.Tensor, b: torch.Tensor | None) -> Any:
            q = _from_gguf(tensors, tname, name, w, b, model.config, kernels)
            if isinstance(q, str):
                report.kept[name] = q
                return None
            _record(report, name, q)
            return q

        head, emb, tied = _head_and_embedding(model)
        head_name, emb_name = _module_name(model, head), _module_name(model, emb)
        for name, module in list(model.named_modules()):
            if type(module) is torch.nn.Linear and module is not head:
                tname = gguf_tensor_name(name_map, name)
                q = convert(name, tname, module.weight, module.bias)
                if q is not None:
                    _set_module(model, name, q)
        emb_q = None
        if emb is not None and emb_name is not None:
            emb_q = convert(emb_name, TOKEN_EMBD, emb.weight, None)
            if emb_q is not None:
                model.set_input_embeddings(QuantEmbedding(emb_q))
        if head is not None and head_name is not None:
            if tied and emb_q is not None and head.bias is None:
                model.set_output_embeddings(emb_q)  # the same blocks serve both
                report.quantized[head_name] = emb_q.qtype.name
            else:
                tname = gguf_tensor_name(name_map, head_name)
                if tname not in tensors:  # llama.cpp's rule: no output tensor, the embedding's
                    tname = TOKEN_EMBD
                q = convert(head_name, tname, head.weight, head.bias)
                if q is not None:
                    model.set_output_embeddings(q)
    finally:
        tensors.close()
    _kept_modules(model, report)


def _kept_modules(model: torch.nn.Module, report: QuantizationReport) -> None:
    """Record the other modules holding a float weight matrix (a sharded or custom layer)."""

    for name, module in model.named_modules():
        if name in report.quantized or name in report.kept:
            continue
        if isinstance(module, QuantLinear | QuantEmbedding):
            continue
        w = module._parameters.get("weight")
        if w is not None and w.dim() == 2 and w.device.type != "meta":
            report.kept[name] = f"a {type(module).__name__}, not a plain nn.Linear / nn.Embedding"


def _from_gguf(
    tensors: GGUFTensors,
    tname: str | None,
    module_name: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    hf_config: Any,
    kernels: bool | None,
) -> QuantLinear | str:
    """A QuantLinear over GGUF tensor ``tname`` for the layer ``module_name``, or why it stays float."""
    from gguf import GGMLQuantizationType

    if tname is None:
        return "no GGUF tensor name for it"
    if tname not in tensors:
        return f"{tname} is not in the file"
    type_id = tensors.type_id(tname)
    if type_id not in QType._value2member_map_:
        return f"stored as {GGMLQuantizationType(type_id).name}, not a quantized type baton keeps"
    rows, cols = weight.shape
    order = qk_row_order(tname, rows, tensors.architecture, hf_config)
    rt = tensors.read(tname, order)
    if rt.shape != (rows, cols):
        return f"{tname} has shape {rt.shape}, the layer {(rows, cols)}"
    qtype = QType(type_id)
    check = torch.tensor([min(1, rows - 1), rows // 2, rows - 1][:CHECK_ROWS]).unique()
    got = dequantize(rt.raw[check], qtype, (len(check), cols))
    want = weight.detach()[check].float()
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        log.warning(
            "%s (%s): the GGUF blocks differ from the converted weights (max abs diff %.3g), so "
            "the layer stays float32; this is a bug in baton's GGUF mapping, please report it",
            module_name,
            tname,
            float((got - want).abs().max()),
        )
        return f"{tname} does not match the converted weights"
    return QuantLinear(rt.raw, qtype, cols, rows, bias=bias, kernels=kernels)
