"""Expert parallelism: a mixture-of-experts model's experts sharded over the data-parallel engines.

With ``executor.expert_parallel`` and ``data_parallel_size = N``, engine core
``r`` (its ``data_parallel_rank``) keeps experts ``r*E/N .. (r+1)*E/N - 1`` of
every MoE layer and the rest of the model whole (attention, router, shared
experts). Each layer's experts module (transformers 5 keeps a layer's experts
in one module: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], called
with the router's top-k ids and weights) becomes an ``ExpertParallelExperts``:

1. dispatch: all-gather every engine's token count, then its hidden states and
   top-k ids/weights, padded to the largest count;
2. compute: this engine's experts on every gathered token routed to them, into
   a per-(token, top-k slot) buffer (zero where another engine's expert is);
3. combine: reduce-scatter the buffers (each slot is non-zero on one engine
   only, so the sum is exact) and keep this engine's rows; the slots are added
   in ascending expert order, as transformers' eager loop adds them.

Every engine must run the same number of forwards, so an engine with nothing
to run steps a dummy batch while another has work (engine/dp_core_proc.py).
The group is a ProcessGroupGloo (NCCL on CUDA) built over a PrefixStore of the
TCPStore the frontend serves on 127.0.0.1 (``data_parallel_master_port``); it
never touches torch's default process group, which tensor-parallel workers use.
"""

from __future__ import annotations

import datetime
import functools
import logging
import time
from typing import Any

import torch
import torch.nn.functional as F

from baton.config import BatonConfig, ExecutorSection, ModelSection
from baton.errors import ConfigError
from baton.model.loader import load_hf_config
from baton.runner import StockRunner
from baton.worker.runner_hooks import ModelRunnerHooks

log = logging.getLogger(__name__)

#: How long joining the group waits for the other engines (they load the model meanwhile).
CONNECT_TIMEOUT_S = 900.0


def num_experts(hf_config: Any) -> int:
    """The routed experts per MoE layer of a transformers config; 0 for a dense model."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    for field in ("num_local_experts", "num_experts", "n_routed_experts"):
        n = getattr(text, field, None)
        if isinstance(n, int) and n > 0:
            return n
    return 0


def expert_parallel_size(
    ex: ExecutorSection, model: ModelSection, hf_config: Any | None = None
) -> int:
    """Engines the experts are sharded over: ``data_parallel_size`` with expert parallel on an
    MoE model, else 1 (a dense model, or expert_parallel off: independent engines).
    ``hf_config``: the model's transformers config when the caller has it (else read).

    Refuses (ConfigError) what cannot shard: E not divisible by N, tensor or pipeline parallel.
    """
    if not ex.expert_parallel or ex.data_parallel_size == 1:
        return 1
    if hf_config is None:
        hf_config = load_hf_config(model)[1]
    experts = num_experts(hf_config)
    if experts == 0:
        log.warning(
            "executor.expert_parallel is set but %s is not a mixture-of-experts model: its %d "
            "data-parallel engines run independently",
            type(hf_config).__name__,
            ex.data_parallel_size,
        )
        return 1
    n = ex.data_parallel_size
    if experts % n:
        fits = [d for d in range(2, experts + 1) if experts % d == 0]
        raise ConfigError(
            f"executor.expert_parallel with data_parallel_size={n}: the model's {experts} experts "
            f"per layer do not split evenly over {n} engines; use a data_parallel_size in {fits}"
        )
    if ex.tensor_parallel_size != 1 or ex.pipeline_parallel_size != 1:
        raise ConfigError(
            "executor.expert_parallel shards the experts over the data-parallel engines, each a "
            "single worker: set tensor_parallel_size and pipeline_parallel_size to 1 (got "
            f"{ex.tensor_parallel_size} and {ex.pipeline_parallel_size})"
        )
    return n


def connect_group(ex: ExecutorSection, name: str, device: torch.device) -> ExpertGroup:
    """Join the data-parallel engines' process group ``name`` (every engine calls this)."""
    import torch.distributed as dist

    if not ex.data_parallel_master_port:
        raise ConfigError(
            "executor.data_parallel_master_port is 0 in an engine core: the data-parallel "
            "frontend (AsyncLLM with data_parallel_size > 1) sets it; an engine started by "
            "hand needs the port of the frontend's store"
        )
    t0 = time.monotonic()
    store = dist.TCPStore(
        "127.0.0.1",
        ex.data_parallel_master_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S),
    )
    prefixed = dist.PrefixStore(f"baton-{name}/", store)
    rank, size = ex.data_parallel_rank, ex.data_parallel_size
    timeout = datetime.timedelta(seconds=ex.collective_timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg: Any = dist.ProcessGroupNCCL(prefixed, rank, size, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # loopback: the engines share this machine (no name lookup of the host)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(prefixed, rank, size, options)
    log.info(
        "joined process group %r as rank %d of %d (%s) in %.2f s",
        name,
        rank,
        size,
        device.type,
        time.monotonic() - t0,
    )
    return ExpertGroup(pg, rank, size, device, store)


class ExpertGroup:
    """The engines' process group and the collectives an MoE layer needs (each waits)."""

    def __init__(
        self, pg: Any, rank: int, size: int, device: torch.device, store: Any = None
    ) -> None:
        self.pg, self.rank, self.size, self.device = pg, rank, size, device
        self._store = store  # kept alive with the group

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` (same shape on each) stacked: [size, *t.shape]."""
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([out], [t]).wait()
        return torch.stack(out)

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` ([size, ...]) over the ranks and keep this rank's slice ``[rank]``."""
        out = torch.empty_like(t[0])
        self.pg.reduce_scatter([out], [list(t.contiguous().unbind(0))]).wait()
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` in place over the ranks."""
        self.pg.allreduce([t]).wait()
        return t


def _experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules holding a layer's experts as 3-D tensors (transformers 5's experts modules)."""
    found = []
    for name, module in model.named_modules():
        gate_up = getattr(module, "gate_up_proj", None)
        down = getattr(module, "down_proj", None)
        if (
            isinstance(gate_up, torch.Tensor)
            and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3
            and down.dim() == 3
        ):
            found.append((name, module))
    return found


class ExpertParallelExperts(torch.nn.Module):
    """A layer's experts module holding only this engine's experts; forward dispatches the
    tokens of every engine to them and combines the results (see the module docstring)."""

    def __init__(self, experts: torch.nn.Module, group: ExpertGroup) -> None:
        super().__init__()
        layout = {
            "has_gate": True,
            "has_bias": False,
            "is_transposed": False,
            "is_concatenated": True,
            "has_post_expert_norm": False,
        }
        odd = {k: getattr(experts, k) for k, v in layout.items() if getattr(experts, k, v) != v}
        if odd:
            raise ConfigError(
                f"executor.expert_parallel: {type(experts).__name__} stores its experts as {odd}; "
                "baton shards concatenated [gate; up] and down projections without biases only"
            )
        total = experts.gate_up_proj.shape[0]
        if total % group.size:
            raise ConfigError(
                f"executor.expert_parallel: {total} experts do not split over {group.size} engines"
            )
        per = total // group.size
        self.first = group.rank * per
        self.num_local = per
        self.num_experts = total
        mine = slice(self.first, self.first + per)
        self.gate_up_proj = torch.nn.Parameter(
            experts.gate_up_proj.detach()[mine].clone(), requires_grad=False
        )
        self.down_proj = torch.nn.Parameter(
            experts.down_proj.detach()[mine].clone(), requires_grad=False
        )
        self.act_fn = experts.act_fn
        self.group = group

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        g = self.group
        n, hidden = hidden_states.shape
        k = top_k_index.shape[1]
        counts = g.all_gather(torch.tensor([n], device=hidden_states.device))
        m = int(counts.max())
        # routing as float32: exact for expert ids, the weights' own dtype (a float32 softmax)
        routing = torch.cat([top_k_index.to(torch.float32), top_k_weights.to(torch.float32)], 1)
        if m > n:
            hidden_states = F.pad(hidden_states, (0, 0, 0, m - n))
            routing = F.pad(routing, (0, 0, 0, m - n), value=-1.0)  # id -1: no expert
        xs = g.all_gather(hidden_states).view(g.size * m, hidden)
        routes = g.all_gather(routing).view(g.size * m, 2 * k)
        ids = routes[:, :k].to(torch.long)
        weights = routes[:, k:]
        slots = hidden_states.new_zeros(g.size * m, k, hidden)
        for j in range(self.num_local):
            tok, pos = torch.where(ids == self.first + j)
            if tok.numel() == 0:
                continue
            gate, up = F.linear(xs[tok], self.gate_up_proj[j]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[j])
            slots[tok, pos] = (y * weights[tok, pos, None]).to(slots.dtype)
        mine = g.reduce_scatter(slots.view(g.size, m, k, hidden))[:n]
        # add the slots in ascending expert order, as transformers' loop over experts does
        order = top_k_index.argsort(dim=1, stable=True)
        mine = mine.gather(1, order[:, :, None].expand(n, k, hidden))
        out = mine[:, 0]
        for i in range(1, k):
            out = out + mine[:, i]
        return out


def shard_experts(model: torch.nn.Module, group: ExpertGroup) -> int:
    """Replace every experts module of ``model`` by this engine's share; how many were replaced."""
    found = _experts_modules(model)
    if not found:
        raise ConfigError(
            f"executor.expert_parallel: {type(model).__name__} has no experts module (a "
            "transformers 5 mixture-of-experts layer with 3-D gate_up_proj / down_proj)"
        )
    for name, module in found:
        parent, _, leaf = name.rpartition(".")
        setattr(
            model.get_submodule(parent) if parent else model,
            leaf,
            ExpertParallelExperts(module, group),
        )
    return len(found)


class ExpertParallelHooks(ModelRunnerHooks):
    """The stock runner with this engine's experts only, in the engines' expert group."""

    def __init__(self, executor: ExecutorSection, device: torch.device) -> None:
        self.executor = executor
        self.device = device
        self.group: ExpertGroup | None = None

    def prepare_model(self, model: torch.nn.Module) -> None:
        if self.group is None:  # a level-2 wake_up loads the model again: the group stays
            self.group = connect_group(self.executor, "ep", self.device)
        n = shard_experts(model, self.group)
        log.info(
            "expert parallel: rank %d of %d holds %d of %d experts in each of %d MoE layers",
            self.group.rank,
            self.group.size,
            num_experts(model.config) // self.group.size,
            num_experts(model.config),
            n,
        )

    def runs_alone(self) -> bool:
        return False  # the engines of the expert group run their forwards together


def expert_parallel_runner(config: BatonConfig, device: torch.device) -> Any:
    """A runner factory (``baton.interfaces.RunnerFactory``: it takes the whole config): the
    stock runner holding this engine's experts only."""
    hooks = functools.partial(ExpertParallelHooks, config.executor, device)
    return StockRunner(hooks)(config, device)
