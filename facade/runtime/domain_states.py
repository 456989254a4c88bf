"""State dicts of an optimizer's domains: one domain's sharded dict, or one per domain with expert groups.

A single domain keeps the sharded form of [Note: state dict forms] (``state.dicts``), plain
``torch.optim`` dicts included; several domains ([Note: expert domains] in
``zeroplan.core.domains``) save one sharded dict per domain under ``"domains"``, and load only
such a dict, at the same world and groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch.distributed as dist

from zeroplan.core import ConfigError
from zeroplan.facade.mechanisms.agreement import verdicts, verdicts_across
from zeroplan.facade.runtime.domain import DomainRuntime
from zeroplan.facade.runtime.joint import JointStep
from zeroplan.facade.state import restore as state_restore
from zeroplan.facade.state.dicts import Shards, named_scalars, sharded_state_dict, with_scalars
from zeroplan.facade.state.restore import LoadedState

__all__ = ["DOMAINS_FORMAT", "load_state_dict", "state_dict"]

#: ``format`` of a multi-domain ``state_dict()`` (see [Note: expert domains]).
DOMAINS_FORMAT = "zeroplan.domains/1"

_NOT_OURS = (
    "this optimizer has expert groups and loads only its own state_dict() (one sharded dict per "
    f"domain, format {DOMAINS_FORMAT!r}); plain torch.optim dicts, single-domain sharded dicts "
    "and consolidated dicts do not say which expert group their state belongs to"
)


def state_dict(joint: JointStep) -> dict[str, Any]:
    """This rank's sharded state of every domain (one domain: its sharded dict as it is)."""
    if not joint.joint:
        return sharded_state_dict(joint.data.shards(joint.scaler))
    return {
        "format": DOMAINS_FORMAT,
        "domains": {d.name: sharded_state_dict(d.shards(joint.scaler)) for d in joint.domains},
    }


def load_state_dict(
    joint: JointStep, state: dict[str, Any], across: Sequence[dist.ProcessGroup] = ()
) -> None:
    """Validate ``state`` on every rank, agree, then install it (or raise on every rank, changing nothing).

    ``across``: the groups joining this rank to the other tensor slices and pipeline stages; each
    data-parallel group agrees on its own load, then their verdicts cross those groups ([Note:
    agreement over a grid] in ``mechanisms.agreement``), so no slice installs what another refused.
    """
    problem: Exception | None = None
    loaded: list[LoadedState] = []
    try:
        loaded = _read_domains(joint, state) if joint.joint else [_read_data(joint, state)]
    except Exception as exc:  # raised on every rank of this data-parallel group already
        problem = exc
    verdicts_across(problem, across, failed="rejected the state dict (its tensor slice or pipeline stage)")
    joint.restore(loaded)


def _read_data(joint: JointStep, state: dict[str, Any]) -> LoadedState:
    """The data domain's validated state (the only domain); raises on every rank of its group if any fails."""
    data = joint.data
    sh = data.shards(joint.scaler)
    state = _agreed_scalars(state, sh)
    with joint.gathered_params(writeback=False):  # a plain dict without masters reads the parameters
        return state_restore.agreed_state(
            lambda: state_restore.read_state_dict(state, sh, data.plan_with_cohorts), sh, what="state dict"
        )


def _read_domains(joint: JointStep, state: dict[str, Any]) -> list[LoadedState]:
    """Every domain's validated state from a multi-domain dict; raises on every rank if any rank fails.

    Every rank enters every domain's agreement (a dict this rank rejects
    outright fails inside it), then one verdict over the world carries an
    expert group's failure to the ranks outside it.
    """
    names = [d.name for d in joint.domains]
    held = sorted(state.get("domains", {})) if isinstance(state, dict) else None
    rejected: ConfigError | None = None
    if not (isinstance(state, dict) and state.get("format") == DOMAINS_FORMAT):
        rejected = ConfigError(_NOT_OURS)
    elif held != sorted(names):
        rejected = ConfigError(f"the state dict holds domains {held}, the optimizer {names}")

    def read(domain: DomainRuntime, sh: Shards, part: Any) -> LoadedState:
        if rejected is not None:
            raise rejected
        return state_restore.read_state_dict(part, sh, domain.plan_with_cohorts)

    loaded: list[LoadedState] = []
    problem: Exception | None = None
    for domain in joint.domains:
        sh = domain.shards(joint.scaler)
        try:
            part = _agreed_scalars(None if rejected else state["domains"][domain.name], sh)
            what = f"state dict of domain {domain.name!r}"
            loaded.append(state_restore.agreed_state(partial(read, domain, sh, part), sh, what=what))
        except Exception as exc:  # raised on every rank of that domain; the others go on agreeing
            problem = problem or exc
    verdicts(problem, joint.world, failed="rejected the state dict", error=ConfigError)
    return loaded


def _agreed_scalars(part: Any, sh: Shards) -> Any:
    """A domain's dict with the scalars its ranks named (a piece dict names them only where a rank
    holds some of the parameter); collective over the domain's ranks, raising on all of them if one
    cannot read its dict."""
    problem, named = None, {}
    try:
        named = named_scalars(part) if part is not None else {}
    except Exception as exc:  # a malformed dict raises on every rank of the domain
        problem = exc
    rows = verdicts(
        problem, sh.groups.world, failed="could not read its state dict", facts=named, error=ConfigError
    )
    return with_scalars(part, rows) if part is not None else part
