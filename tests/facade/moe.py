"""A small mixture-of-experts language model with expert parallelism, and its single-process reference.

Top-1 routing over ``EXPERTS`` experts; expert-parallel groups of ``EP`` consecutive
ranks each hold every expert once (rank ``r`` holds experts ``[k * (r % EP), k * (r % EP + 1))``
with ``k = EXPERTS // EP``) and exchange tokens with two ``all_to_all`` calls, as GShard
and InternLM do (no capacity limit: nothing is dropped). The ranks holding the same
experts (``r % EP`` equal) form the expert-data-parallel group, the one expert
gradients are averaged over.

The reference holds all experts and computes one rank's loss alone: routing and the
experts' arithmetic do not depend on where an expert lives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

VOCAB, WIDTH, HIDDEN, EXPERTS, EP = 37, 16, 24, 4, 2


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with equal splits, differentiable: its gradient is the same exchange."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group  # type: ignore[attr-defined]
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)  # type: ignore[attr-defined]
        return out, None


class Expert(nn.Module):
    """A two-layer MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    #: Compute with detached weights (they get no gradient; tokens still flow): an idle expert.
    idle = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.idle:
            return self.down(nn.functional.gelu(self.up(x)))
        linear = nn.functional.linear
        hidden = nn.functional.gelu(linear(x, self.up.weight.detach(), self.up.bias.detach()))
        return linear(hidden, self.down.weight.detach(), self.down.bias.detach())


class MoELM(nn.Module):
    """Embedding, one top-1 MoE layer (residual), head.

    Args:
        experts: which global experts this module holds (all of them for the reference).
        ep_group: the expert-parallel group to exchange tokens in; ``None``: every expert is local.
    """

    def __init__(self, experts: range, ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.gate = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in experts)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.held = experts
        self.ep_group = ep_group

    def dense_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.named_parameters() if not n.startswith("experts.")]

    def expert_parameters(self) -> list[nn.Parameter]:
        return list(self.experts.parameters())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).reshape(-1, WIDTH)
        probs = self.gate(x).float().softmax(-1)
        weight, choice = probs.max(-1)
        if self.ep_group is None:
            mixed = torch.zeros_like(x)
            for e, expert in zip(self.held, self.experts, strict=True):
                rows = choice == e
                mixed[rows] = expert(x[rows])
        else:
            mixed = self._exchange(x, choice)
        out = x + weight.unsqueeze(-1).to(x.dtype) * mixed
        return self.head(out).reshape(*tokens.shape, VOCAB)

    def _exchange(self, x: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        """Send each token to its expert's rank and back: ``[EXPERTS, n, WIDTH]`` slots, unused ones zero."""
        n = x.shape[0]
        slots = torch.zeros(EXPERTS, n, WIDTH, dtype=x.dtype)
        rows = torch.arange(n)
        slots = slots.index_put((choice, rows), x)  # token i of expert e sits in slot (e, i)
        received = _AllToAll.apply(slots, self.ep_group)
        # received: [EP source ranks * local experts, n, WIDTH], source-major
        local = len(self.held)
        parts = received.reshape(EP, local, n, WIDTH)
        done = torch.stack([expert(parts[:, i]) for i, expert in enumerate(self.experts)], dim=1)
        back = _AllToAll.apply(done.reshape(EXPERTS, n, WIDTH), self.ep_group)
        return back[choice, rows]


def held_experts(rank: int) -> range:
    """The global experts rank ``rank`` holds."""
    k = EXPERTS // EP
    return range(k * (rank % EP), k * (rank % EP + 1))


def full_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> MoELM:
    """The reference: every expert, deterministic values."""
    torch.manual_seed(seed)
    model = MoELM(range(EXPERTS), None)
    return model.to(dtype)


def rank_model(full: MoELM, rank: int, ep_group: dist.ProcessGroup) -> MoELM:
    """Rank ``rank``'s part of ``full``: its dense parameters and its experts, same values."""
    held = held_experts(rank)
    model = MoELM(held, ep_group).to(full.head.weight.dtype)
    with torch.no_grad():
        for mine, theirs in zip(model.dense_parameters(), full.dense_parameters(), strict=True):
            mine.copy_(theirs)
        for i, e in enumerate(held):
            for mine, theirs in zip(model.experts[i].parameters(), full.experts[e].parameters(), strict=True):
                mine.copy_(theirs)
    return model


def expert_groups(world: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's expert-parallel and expert-data-parallel groups (every rank creates every group)."""
    rank = dist.get_rank()
    ep = ep_dp = None
    for start in range(0, world, EP):
        group = dist.new_group(list(range(start, start + EP)))
        if rank in range(start, start + EP):
            ep = group
    for position in range(EP):
        group = dist.new_group(list(range(position, world, EP)))
        if rank % EP == position:
            ep_dp = group
    assert ep is not None and ep_dp is not None
    return ep, ep_dp
