"""LoRA adapters in the model runner: several adapters in one batch, one forward.

``LoRAModel.wrap`` puts a ``LoRALinear`` around every linear layer an adapter may target
(``baton.lora.adapter.TARGET_MODULES``, inside the decoder layers). Each holds ``max_loras``
slots of stacked factors: ``A`` [slots x max_lora_rank, in] and ``B^T`` [slots x max_lora_rank,
out] (the scaling multiplied into ``B``; ranks below the maximum padded with zeros). Adapters
are read once into host memory (``add``), and copied into a free (or the least recently used)
slot when a step needs them (``prepare``).

A step's tokens each carry an adapter id (0: none), from their request. ``prepare`` turns them
into one mask over the slots the step uses: token i keeps only its own slot's block of rank
columns. Every adapted layer then computes, besides its own output ``y = base(x)``,

    y[rows] += ((x[rows] @ A[span]^T) * mask) @ B^T[span]

where ``rows`` are the tokens that have an adapter (all of them: no gather) and ``span`` the
slots between the lowest and the highest the step uses: two small matmuls for any number of
adapters, tokens without one untouched. A step without adapters skips it all (one flag).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from baton.errors import ExecutorError, InvalidRequestError
from baton.lora.adapter import TARGET_MODULES, AdapterWeights, load_adapter
from baton.lora.request import LoRARequest

log = logging.getLogger(__name__)


class LoRALinear(torch.nn.Module):
    """A linear layer plus the step's adapters (module docstring); ``base`` is the layer."""

    def __init__(self, base: torch.nn.Module, owner: LoRAModel, name: str) -> None:
        super().__init__()
        self.base = base
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        self.name = name
        self._owner = [owner]  # a list: not a submodule, no reference cycle through _modules
        #: [slots * rank, in] and [slots * rank, out]; allocated by LoRAModel.allocate
        self.lora_a: torch.Tensor | None = None
        self.lora_bt: torch.Tensor | None = None
        #: adapter ids whose factors for this layer sit in a slot (others: zeros)
        self.ids: set[int] = set()

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight  # type: ignore[return-value]

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        lora = self._owner[0]
        if not lora.active or not (self.ids & lora.step_ids):
            return y
        return lora.apply(self, x, y)


class LoRAModel:
    """A model's adapted layers, its adapters in host memory, and the slots of one step."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        max_loras: int,
        max_rank: int,
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layers: dict[str, LoRALinear] = {}
        #: adapter id -> its factors in host memory, and the request that named it
        self.adapters: dict[int, AdapterWeights] = {}
        self.requests: dict[int, LoRARequest] = {}
        #: adapter id per slot (0: empty), and when each slot was last used (a step counter)
        self.slots = [0] * max_loras
        self.last_used = [0] * max_loras
        self._clock = 0
        self.allocated = False
        # the step's state (prepare)
        self.active = False
        self.step_ids: set[int] = set()
        self.rows: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None
        self.span = (0, 0)
        self.wrap(model)

    # ------------------------------------------------------------------ layers

    def wrap(self, model: torch.nn.Module) -> None:
        """Wrap every targetable linear layer of ``model``'s decoder layers, in place."""
        targets = []
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if (
                leaf in TARGET_MODULES
                and ".layers." in f".{name}"
                and isinstance(getattr(module, "in_features", None), int)
                and isinstance(getattr(module, "out_features", None), int)
                and not isinstance(module, LoRALinear)
            ):
                targets.append(name)
        if not targets:
            raise ExecutorError(
                f"{type(model).__name__} has no linear layer LoRA adapters target "
                f"({', '.join(sorted(TARGET_MODULES))}): set lora.enable_lora = false"
            )
        for name in targets:
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            layer = LoRALinear(getattr(parent, leaf), self, name)
            setattr(parent, leaf, layer)
            self.layers[name] = layer
        self.allocated = False
        self.slots = [0] * self.max_loras
        log.info(
            "LoRA: %d layers adaptable, %d slots of rank %d",
            len(targets),
            self.max_loras,
            self.max_rank,
        )

    def allocate(self) -> None:
        """The slots' stacked factors, zero (once; again after ``release``)."""
        rows = self.max_loras * self.max_rank
        for layer in self.layers.values():
            layer.lora_a = torch.zeros(
                rows, layer.in_features, dtype=self.dtype, device=self.device
            )
            layer.lora_bt = torch.zeros(
                rows, layer.out_features, dtype=self.dtype, device=self.device
            )
            layer.ids = set()
        self.slots = [0] * self.max_loras
        self.allocated = True

    def release(self) -> None:
        """Free the slots (the runner sleeps); adapters stay in host memory, slots come back on use."""
        for layer in self.layers.values():
            layer.lora_a = layer.lora_bt = None
            layer.ids = set()
        self.slots = [0] * self.max_loras
        self.allocated = False
        self.active = False

    # ------------------------------------------------------------------ adapters

    def add(self, request: LoRARequest) -> bool:
        """Read an adapter into host memory, checked against the model; False if it was there."""
        lid = request.lora_int_id
        known = self.requests.get(lid)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise InvalidRequestError(
                    f"LoRA id {lid} is adapter {known.lora_name!r} ({known.lora_path}); "
                    f"{request.lora_name!r} needs an id of its own",
                    param="lora_request",
                )
            return False
        weights = load_adapter(request.lora_path, self.max_rank)
        for module, (a, b) in weights.modules.items():
            layer = self.layers.get(module)
            if layer is None:
                raise InvalidRequestError(
                    f"LoRA adapter {request.lora_name!r} adapts {module!r}, which this model "
                    "does not have (an adapter for another architecture?)",
                    param="lora_request",
                )
            if a.shape[1] != layer.in_features or b.shape[0] != layer.out_features:
                raise InvalidRequestError(
                    f"LoRA adapter {request.lora_name!r}: module {module!r} maps "
                    f"{a.shape[1]} -> {b.shape[0]} features, the model's "
                    f"{layer.in_features} -> {layer.out_features} (an adapter for another model?)",
                    param="lora_request",
                )
        self.adapters[lid] = weights
        self.requests[lid] = request
        log.info(
            "LoRA adapter %r (id %d, rank %d, %d modules) loaded from %s",
            request.lora_name,
            lid,
            weights.rank,
            len(weights.modules),
            request.lora_path,
        )
        return True

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (host memory and slot); False if it was not loaded."""
        if self.adapters.pop(lora_id, None) is None:
            return False
        self.requests.pop(lora_id, None)
        if lora_id in self.slots:
            s = self.slots.index(lora_id)
            self.slots[s] = 0
            for layer in self.layers.values():
                layer.ids.discard(lora_id)
        return True

    def list(self) -> list[int]:
        return sorted(self.adapters)

    def _slot_for(self, lora_id: int, needed: set[int]) -> int:
        """The slot holding ``lora_id``, loading it into a free or the least recently used slot
        that no adapter of this step needs."""
        if lora_id in self.slots:
            return self.slots.index(lora_id)
        free = [s for s, i in enumerate(self.slots) if i == 0]
        if not free:
            free = sorted(
                (s for s, i in enumerate(self.slots) if i not in needed),
                key=lambda s: self.last_used[s],
            )
        if not free:
            raise ExecutorError(
                f"a step uses {len(needed)} LoRA adapters but lora.max_loras={self.max_loras}: "
                "the scheduler should have kept it within the slots"
            )
        slot = free[0]
        weights = self.adapters.get(lora_id)
        if weights is None:
            raise ExecutorError(f"LoRA adapter id {lora_id} is not loaded in the model runner")
        old = self.slots[slot]
        lo, r = slot * self.max_rank, self.max_rank
        self.slots[slot] = 0
        for name, layer in self.layers.items():
            assert layer.lora_a is not None and layer.lora_bt is not None
            layer.ids.discard(old)
            pair = weights.modules.get(name)
            if pair is None:  # whatever the slot held before (a removed adapter's) goes
                layer.lora_a[lo : lo + r].zero_()
                layer.lora_bt[lo : lo + r].zero_()
                continue
            a, b = pair
            k = a.shape[0]
            layer.lora_a[lo : lo + k].copy_(a)
            layer.lora_bt[lo : lo + k].copy_(b.t())
            if k < r:
                layer.lora_a[lo + k : lo + r].zero_()
                layer.lora_bt[lo + k : lo + r].zero_()
            layer.ids.add(lora_id)
        self.slots[slot] = lora_id
        return slot

    # ------------------------------------------------------------------ steps

    def prepare(self, token_ids: np.ndarray | None) -> None:
        """The step's state from each token's adapter id (``token_ids``; None: no adapter)."""
        if token_ids is None:
            self.active = False
            return
        has = token_ids > 0
        ids = np.unique(token_ids[has]).tolist()
        if not ids:
            self.active = False
            return
        if len(ids) > self.max_loras:
            raise ExecutorError(
                f"a step uses {len(ids)} LoRA adapters but lora.max_loras={self.max_loras}"
            )
        if not self.allocated:
            self.allocate()
        self._clock += 1
        needed = set(ids)
        slot_of = {}
        for lid in ids:
            s = self._slot_for(lid, needed)
            slot_of[lid] = s
            self.last_used[s] = self._clock
        lo = min(slot_of.values())
        hi = max(slot_of.values()) + 1
        r = self.max_rank
        all_rows = bool(has.all())
        sel = token_ids if all_rows else token_ids[has]
        mask = np.zeros((len(sel), (hi - lo) * r), dtype=np.float32)
        for lid, s in slot_of.items():
            mask[sel == lid, (s - lo) * r : (s - lo + 1) * r] = 1.0
        self.mask = torch.from_numpy(mask).to(self.device, self.dtype)
        self.rows = None if all_rows else torch.from_numpy(np.nonzero(has)[0]).to(self.device)
        self.span = (lo * r, hi * r)
        self.step_ids = needed
        self.active = True

    def apply(self, layer: LoRALinear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus the step's adapters' update of ``layer`` for input ``x``."""
        assert layer.lora_a is not None and layer.lora_bt is not None and self.mask is not None
        lo, hi = self.span
        a = layer.lora_a[lo:hi]
        bt = layer.lora_bt[lo:hi]
        x2 = x.reshape(-1, layer.in_features)
        out = y if y.is_contiguous() else y.contiguous()
        y2 = out.view(-1, layer.out_features)
        if self.rows is None:
            xa = F.linear(x2, a).mul_(self.mask)
            y2.addmm_(xa, bt)
        else:
            xa = F.linear(x2.index_select(0, self.rows), a).mul_(self.mask)
            y2.index_add_(0, self.rows, xa @ bt)
        return out

    def end_step(self) -> None:
        self.active = False
        self.mask = self.rows = None
