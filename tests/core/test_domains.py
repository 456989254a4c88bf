"""``plan_domains``, ``DomainPlans`` and ``domains_report``: param groups over other groups of ranks."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroplan.core import (
    Collective,
    ConfigError,
    Domain,
    DomainPlans,
    DomainsReport,
    ExpertSplit,
    ParamLocation,
    ParamSpec,
    Topology,
    describe_optimizer,
    domains_report,
    expert_domains,
    memory_report,
    plan,
    plan_domains,
    preset_specs,
    send_elements,
    specs_from_shapes,
)

#: Three user groups: 0 dense, 1 experts, 2 dense without weight decay (a frozen one, a later cohort).
SPECS = (
    ParamSpec(index=0, name="embed", shape=(17, 257), dtype="bf16", group=0),
    ParamSpec(index=1, name="attn", shape=(257, 17), dtype="bf16", group=0),
    ParamSpec(index=2, name="e0.w1", shape=(17, 33), dtype="bf16", group=1),
    ParamSpec(index=3, name="e0.w2", shape=(33, 17), dtype="bf16", group=1, cohort=1),
    ParamSpec(index=4, name="e1.w1", shape=(17, 33), dtype="fp32", group=1),
    ParamSpec(index=5, name="norm", shape=(257,), dtype="fp32", group=2),
    ParamSpec(index=6, name="frozen", shape=(5,), dtype="fp32", group=2, trainable=False),
)

DATA = Domain(name="data", groups=(0, 2), topology=Topology(world_size=4))
EXPERTS = Domain(name="experts", groups=(1,), topology=Topology(world_size=2))


def renumbered(specs, groups):
    """The specs of ``groups``, as a domain's plan sees them."""
    mine = [s for s in specs if s.group in groups]
    return [dataclasses.replace(s, index=i, group=groups.index(s.group)) for i, s in enumerate(mine)]


def test_specs_are_renumbered_per_domain():
    dp = plan_domains(SPECS, [DATA, EXPERTS], alignment=8)
    data, experts = dp.plans
    assert [(s.index, s.name, s.group) for s in data.specs] == [
        (0, "embed", 0),
        (1, "attn", 0),
        (2, "norm", 1),
        (3, "frozen", 1),
    ]
    assert [(s.index, s.name, s.group) for s in experts.specs] == [
        (0, "e0.w1", 0),
        (1, "e0.w2", 0),
        (2, "e1.w1", 0),
    ]
    kept = {s.name: (s.shape, s.dtype, s.trainable, s.cohort) for s in (*data.specs, *experts.specs)}
    assert kept == {s.name: (s.shape, s.dtype, s.trainable, s.cohort) for s in SPECS}


def test_user_specs_and_locations_round_trip():
    dp = plan_domains(SPECS, [DATA, EXPERTS], alignment=8)
    assert dp.specs == SPECS
    assert dp.locations == tuple(dp.locate(i) for i in range(len(SPECS)))
    assert dp.locate(4) == ParamLocation(domain=1, index=2)
    assert dp.locate(5) == ParamLocation(domain=0, index=2)
    for index, (d, local) in enumerate(dp.locations):
        assert dp.plans[d].specs[local].name == SPECS[index].name
    assert [dp.domain_of_group(g) for g in range(3)] == [0, 1, 0]
    assert dp.stage == 2


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"alignment": 8, "bucket_bytes": 4096, "loss_scaling": True, "max_inflight_buckets": 3},
        {"alignment": 8, "layout": "rank_major", "policy": "gloo"},
        {"alignment": 8, "strategy": "lpt_whole"},
    ],
)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_plan_is_plan_of_its_renumbered_specs(stage, options):
    dp = plan_domains(SPECS, [DATA, EXPERTS], stage=stage, **options)
    for domain, zp in zip(dp.domains, dp.plans, strict=True):
        ref = plan(renumbered(SPECS, domain.groups), domain.topology, stage=stage, **options)
        assert zp.fingerprint() == ref.fingerprint()
        assert zp.specs == ref.specs


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("topology", [Topology(world_size=4), Topology(world_size=8, shard_size=4)])
def test_one_domain_is_the_plain_plan(stage, topology):
    dp = plan_domains(
        SPECS, [Domain(name="data", groups=(0, 1, 2), topology=topology)], stage=stage, alignment=8
    )
    (zp,) = dp.plans
    ref = plan(SPECS, topology, stage=stage, alignment=8)
    assert zp.fingerprint() == ref.fingerprint() and zp.specs == SPECS
    assert memory_report(zp) == memory_report(ref)


def test_per_group_optimizers_go_to_their_domains():
    adamw, sgd, adam = (
        describe_optimizer("AdamW"),
        describe_optimizer("SGD", momentum=0.9),
        describe_optimizer("Adam"),
    )
    dp = plan_domains(SPECS, [DATA, EXPERTS], optimizer=[adamw, sgd, adam], alignment=8)
    assert dp.plans[0].optimizers == (adamw, adam)
    assert dp.plans[1].optimizers == (sgd,)


def test_a_non_elementwise_optimizer_in_one_domain_picks_its_own_strategy():
    adamw, adafactor = describe_optimizer("AdamW"), describe_optimizer("Adafactor")
    dp = plan_domains(SPECS, [DATA, EXPERTS], optimizer=[adamw, adafactor, adamw], alignment=8)
    assert [zp.partition.strategy for zp in dp.plans] == ["flat_even", "lpt_whole"]
    assert not dp.plans[1].partition.splits_params


def test_one_optimizer_name_covers_every_group():
    dp = plan_domains(SPECS, [DATA, EXPERTS], optimizer="SGD", alignment=8)
    assert [[o.name for o in zp.optimizers] for zp in dp.plans] == [["SGD", "SGD"], ["SGD"]]


def test_rank_sums_the_domains():
    dp = plan_domains(SPECS, [DATA, EXPERTS], alignment=8, loss_scaling=True)
    report = domains_report(dp, clipping=True)
    assert isinstance(report, DomainsReport) and len(report.reports) == 2
    for w in range(4):
        e = w % 2
        rows = (report.reports[0].ranks[w], report.reports[1].ranks[e])
        total = report.rank([w, e])
        assert total.rank == w and total.shard_rank == rows[0].shard_rank
        assert total.total_bytes == sum(r.total_bytes for r in rows)
        for name in (
            "params_bytes",
            "grads_bytes",
            "master_bytes",
            "optimizer_state_bytes",
            "buffer_bytes",
            "backward_transient_bytes",
            "step_transient_bytes",
        ):
            assert getattr(total, name) == sum(getattr(r, name) for r in rows), name
        # the joint norm and the overflow verdict: two float32 all-reduces over the world
        assert report.controls == 2
        joint = 2 * send_elements(Collective.ALL_REDUCE, [1] * 4, w) * 4
        assert total.comm_bytes_per_step == sum(r.comm_bytes_per_step for r in rows) + joint
        assert total.peak_bytes <= sum(r.peak_bytes for r in rows)
        assert total.peak_bytes == (
            total.total_bytes + max(total.backward_transient_bytes, total.step_transient_bytes)
        )


def test_rank_prefixes_the_comm_of_later_domains():
    dp = plan_domains(SPECS, [DATA, EXPERTS], alignment=8, loss_scaling=True)
    report = domains_report(dp, clipping=True)
    total = report.rank((1, 1))
    data, experts = report.reports[0].ranks[1].comm, report.reports[1].ranks[1].comm
    assert {c.group for c in data} == {"shard", "world"} and experts  # "world": the step agreement
    # Domain 0's entries keep their place; its world entry also counts the domains' joint all-reduces
    # (verdict and norm: two fp32 scalars over the world), as the optimizer logs them in one entry.
    joint = 2 * send_elements(Collective.ALL_REDUCE, [1] * 4, 1) * 4
    expected = [
        dataclasses.replace(c, calls=c.calls + 2, bytes=c.bytes + joint) if c.group == "world" else c
        for c in data
    ]
    assert list(total.comm[: len(data)]) == expected
    assert [c.group for c in total.comm[len(data) :]] == [f"experts/{c.group}" for c in experts]
    assert [
        dataclasses.replace(c, group=c.group.removeprefix("experts/")) for c in total.comm[len(data) :]
    ] == list(experts)


def test_mics_domains_keep_replica_traffic():
    data = Domain(name="data", groups=(0, 2), topology=Topology(world_size=8, shard_size=4))
    experts = Domain(name="experts", groups=(1,), topology=Topology(world_size=4, shard_size=2))
    report = domains_report(plan_domains(SPECS, [data, experts], alignment=8))
    groups = {c.group for c in report.rank([5, 3]).comm}
    assert groups == {"shard", "replica", "world", "experts/shard", "experts/replica", "experts/world"}


def test_arrivals_are_per_domain():
    dp = plan_domains(SPECS, [DATA, EXPERTS], alignment=8, bucket_bytes=1024)
    default = domains_report(dp)
    same = domains_report(dp, arrivals=[None, [2, 1, 0]])
    assert same == default
    forward = domains_report(dp, arrivals=[None, [0, 1, 2]])
    assert forward.reports[0] == default.reports[0] and forward.reports[1] != default.reports[1]
    assert forward.reports[1] == memory_report(dp.plans[1], arrivals=[0, 1, 2])


def test_as_dict_is_json():
    dp = plan_domains(SPECS, [DATA, EXPERTS], alignment=8)
    report = domains_report(dp)
    document = json.loads(json.dumps(report.as_dict()))
    assert [d["name"] for d in document["domains"]] == ["data", "experts"]
    assert document["domains"][1] == {
        "name": "experts",
        "groups": [1],
        "world": 2,
        "shard_size": 2,
        "report": json.loads(json.dumps(report.reports[1].as_dict())),
    }
    json.dumps(report.rank([0, 0]).as_dict())


def test_moe_experts_state_is_sharded_over_the_expert_data_group():
    """Dense layers at world 4; 4 experts sharded over expert-data-parallel groups of 2."""
    dense = [("embed", (1000, 256)), ("attn.qkv", (256, 768)), ("attn.out", (256, 256))]
    experts = [
        (f"expert{e}.{w}", shape) for e in range(4) for w, shape in (("w1", (64, 256)), ("w2", (256, 64)))
    ]
    specs = [
        ParamSpec(index=i, name=name, shape=shape, dtype="bf16", group=int(i >= len(dense)))
        for i, (name, shape) in enumerate(dense + experts)
    ]
    domains = [
        Domain(name="data", groups=(0,), topology=Topology(world_size=4)),
        Domain(name="experts", groups=(1,), topology=Topology(world_size=2)),
    ]
    dp = plan_domains(specs, domains, stage=2, optimizer="AdamW")
    report = domains_report(dp)
    expert_numel = sum(s.numel for s in specs if s.group == 1)
    # Unsharded: an fp32 master copy and AdamW's exp_avg and exp_avg_sq per element, plus a step.
    master_unsharded, state_unsharded = 4 * expert_numel, 2 * 4 * expert_numel
    adamw = describe_optimizer("AdamW")
    for rank in report.reports[1].ranks:
        assert rank.master_bytes == master_unsharded // 2
        # One flat window per rank: its elements' state and one step counter.
        assert rank.optimizer_state_bytes == state_unsharded // 2 + adamw.state_bytes((0,), 4)
    dense_numel = sum(s.numel for s in specs if s.group == 0)
    for w in range(4):
        total = report.rank([w, w % 2])
        assert total.master_bytes == 4 * dense_numel // 4 + master_unsharded // 2
        # Every process holds all dense parameters and its 4 (local) experts, in bf16.
        assert total.params_bytes == 2 * (dense_numel + expert_numel)


def test_memory_report_of_a_domain_plan_is_its_plan_report():
    dp = plan_domains(SPECS, [DATA, EXPERTS], alignment=8)
    dp = dataclasses.replace(dp, plans=tuple(zp.with_options(overlap_grad_reduce=False) for zp in dp.plans))
    report = domains_report(dp, clipping=True)
    for zp, r in zip(dp.plans, report.reports, strict=True):  # the clipping norm is the joint one
        assert r == memory_report(zp, clipping=False)
    assert report.controls == 1
    single = plan_domains(SPECS, [dataclasses.replace(DATA, groups=(0, 1, 2))], alignment=8)
    alone = domains_report(single, clipping=True)
    assert alone.reports[0] == memory_report(single.plans[0], clipping=True) and alone.controls == 0


def test_fingerprint_is_stable_and_sees_the_domains():
    a = plan_domains(SPECS, [DATA, EXPERTS], alignment=8)
    assert a.fingerprint() == plan_domains(SPECS, [DATA, EXPERTS], alignment=8).fingerprint()
    renamed = dataclasses.replace(EXPERTS, name="moe")
    assert a.fingerprint() != plan_domains(SPECS, [DATA, renamed], alignment=8).fingerprint()
    wider = dataclasses.replace(EXPERTS, topology=Topology(world_size=4))
    assert a.fingerprint() != plan_domains(SPECS, [DATA, wider], alignment=8).fingerprint()


# --- bad input ---------------------------------------------------------------------------------


def expert_domain(groups, world=2, name="experts"):
    return Domain(name=name, groups=groups, topology=Topology(world_size=world))


@pytest.mark.parametrize(
    ("domains", "needle"),
    [
        ([DATA], "param group 1 is in no domain"),
        (
            [Domain(name="data", groups=(0,), topology=Topology(world_size=4)), expert_domain((2,))],
            "group 1 is in no domain",
        ),
        ([DATA, expert_domain((1, 2))], "param group 2 is in two domains, 'data' and 'experts'"),
        ([DATA, expert_domain((1,), name="data")], "domain names must be unique; ['data']"),
        ([DATA, expert_domain((1,), world=3)], "does not divide the data-parallel world of 4"),
        ([], "pass one or more Domain values"),
    ],
)
def test_bad_domains(domains, needle):
    with pytest.raises(ConfigError) as info:
        plan_domains(SPECS, domains)
    assert needle in str(info.value)


def test_a_spec_outside_every_domain():
    specs = (*SPECS, ParamSpec(index=7, name="stray", shape=(3,), group=3))
    with pytest.raises(ConfigError, match=r"'stray' is in param group 3, which no domain lists .*0\.\.2"):
        plan_domains(specs, [DATA, EXPERTS])


def test_an_empty_domain_plans_nothing():
    empty = Domain(name="data", groups=(0, 2, 3), topology=Topology(world_size=4))
    late = Domain(name="late", groups=(4,), topology=Topology(world_size=1))
    with pytest.raises(
        ConfigError, match=r"domain 'late' \(param groups \(4,\)\) has no parameters: an empty"
    ):
        plan_domains(SPECS, [empty, EXPERTS, late])


def test_an_empty_group_inside_a_domain_is_fine():
    data = Domain(name="data", groups=(0, 2, 3), topology=Topology(world_size=4))
    dp = plan_domains(SPECS, [data, EXPERTS], alignment=8)
    assert len(dp.plans[0].optimizers) == 3 and dp.specs == SPECS


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"name": ""}, "Domain.name must be a non-empty string"),
        ({"groups": ()}, "groups must be a tuple of one or more param group indices"),
        ({"groups": (2, 1)}, "strictly increasing, got (2, 1); pass (1, 2)"),
        ({"groups": (1, 1)}, "strictly increasing"),
        ({"groups": (-1,)}, "ints >= 0"),
        ({"groups": "01"}, "groups must be a tuple of one or more param group indices (ints >= 0), got '01'"),
        ({"topology": 4}, "topology must be a Topology, got int"),
    ],
)
def test_bad_domain_values(kwargs, needle):
    fields = {"name": "experts", "groups": (1,), "topology": Topology(world_size=2)} | kwargs
    with pytest.raises(ConfigError) as info:
        Domain(**fields)
    assert needle in str(info.value)


def test_groups_become_a_tuple():
    assert Domain(name="x", groups=[0, 3], topology=Topology(world_size=1)).groups == (0, 3)


def test_optimizer_per_group_needs_one_per_group():
    with pytest.raises(ConfigError, match=r"one OptimizerSpec per param group \(3 groups\), got 2 items"):
        plan_domains(SPECS, [DATA, EXPERTS], optimizer=[describe_optimizer("AdamW")] * 2)


def test_domain_plans_check_their_plans():
    dp = plan_domains(SPECS, [DATA, EXPERTS], alignment=8)
    data_plan, expert_plan = dp.plans
    with pytest.raises(ConfigError, match="got 1 plans for 2 domains"):
        DomainPlans(domains=dp.domains, plans=(data_plan,))
    with pytest.raises(ConfigError, match=r"plans\[1\] is for Topology\(world_size=4"):
        DomainPlans(domains=dp.domains, plans=(data_plan, data_plan))
    stage1 = plan(renumbered(SPECS, (1,)), EXPERTS.topology, stage=1, alignment=8)
    with pytest.raises(
        ConfigError, match=r"at stage 1 but plans\[0\] at stage 2; plan every domain at one stage"
    ):
        DomainPlans(domains=dp.domains, plans=(data_plan, stage1))
    narrow = Domain(name="data", groups=(0,), topology=DATA.topology)
    wide = Domain(name="experts", groups=(1, 2), topology=EXPERTS.topology)
    with pytest.raises(ConfigError, match=r"plans\[0\] has 2 param groups but domain 'data' lists 1"):
        DomainPlans(domains=(narrow, wide), plans=(data_plan, expert_plan))
    assert DomainPlans(domains=list(dp.domains), plans=list(dp.plans)) == dp


def test_report_positions_are_checked():
    report = domains_report(plan_domains(SPECS, [DATA, EXPERTS], alignment=8))
    with pytest.raises(ConfigError, match=r"got 1 positions for 2 domains.*\['data', 'experts'\]"):
        report.rank([0])
    with pytest.raises(ConfigError, match=r"position 2 is outside domain 'experts''s ranks 0\.\.1"):
        report.rank([3, 2])
    with pytest.raises(ConfigError, match="position -1 is outside domain 'data'"):
        report.rank([-1, 0])


def test_report_arrivals_and_sizes_are_checked():
    dp = plan_domains(SPECS, [DATA, EXPERTS], alignment=8)
    with pytest.raises(ConfigError, match="got 1 arrival orders for 2 domains"):
        domains_report(dp, arrivals=[None])
    report = domains_report(dp)
    with pytest.raises(ConfigError, match="does not match domain 'data'"):
        DomainsReport(domains=dp.domains, reports=report.reports[::-1])
    with pytest.raises(ConfigError, match="got 1 reports for 2 domains"):
        DomainsReport(domains=dp.domains, reports=report.reports[:1])


def test_bad_group_and_index_lookups():
    dp = plan_domains(SPECS, [DATA, EXPERTS], alignment=8)
    with pytest.raises(ConfigError, match=r"param group 3 is outside the domains' groups 0\.\.2"):
        dp.domain_of_group(3)
    with pytest.raises(ConfigError, match=r"parameter index 7 is outside 0\.\.6"):
        dp.locate(7)


# --- property: any split of groups into domains renumbers and rebuilds exactly ------------------


@st.composite
def split_models(draw):
    """Specs in 1-5 groups (some maybe empty) dealt to 1-3 domains, each domain with a parameter."""
    groups = draw(st.integers(1, 5))
    sizes = draw(st.lists(st.integers(0, 3), min_size=groups, max_size=groups))
    owner = [0, *draw(st.lists(st.integers(0, 2), min_size=groups - 1, max_size=groups - 1))]
    members = {d: tuple(g for g in range(groups) if owner[g] == d) for d in sorted(set(owner))}
    for mine in members.values():  # an empty domain is an error: give its first group a parameter
        if not any(sizes[g] for g in mine):
            sizes[mine[0]] = 1
    shapes = st.tuples(st.integers(0, 40), st.integers(1, 9))
    specs = tuple(
        ParamSpec(index=i, name=f"p{i}", shape=draw(shapes), group=group)
        for i, group in enumerate(g for g, size in enumerate(sizes) for _ in range(size))
    )
    domains = [
        Domain(name=f"d{d}", groups=mine, topology=Topology(world_size=2 if d == 0 else 1))
        for d, mine in members.items()
    ]
    return specs, domains


@settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(split_models())
def test_any_split_round_trips(model):
    specs, domains = model
    dp = plan_domains(specs, domains, alignment=4)
    assert dp.specs == specs
    for domain, zp in zip(dp.domains, dp.plans, strict=True):
        assert zp.specs == tuple(renumbered(specs, domain.groups))
    for index, (d, local) in enumerate(dp.locations):
        assert dp.domains[d].groups[dp.plans[d].specs[local].group] == specs[index].group


# ----------------------------------------------------------------- expert_domains: one rank of an EP model
def moe_specs(layers=2, experts=4, *, stacked=False, wrapped=False, dtype="bf16"):
    """A small MoE model: per layer attention, a router, then experts (one tensor each, or stacked)."""
    named = [("embed", (97, 17))]
    for i in range(layers):
        h = f"layers.{i}"
        named += [(f"{h}.attn.weight", (17, 17)), (f"{h}.moe.gate.weight", (experts, 17))]
        if stacked:
            named += [
                (f"{h}.moe.experts.gate_up_proj", (experts, 66, 17)),
                (f"{h}.moe.experts.down_proj", (experts, 17, 33)),
            ]
        else:
            inner = "experts.wrapped_experts" if wrapped else "experts"
            for e in range(experts):
                named += [
                    (f"{h}.moe.{inner}.{e}.w1.weight", (33, 17)),
                    (f"{h}.moe.{inner}.{e}.w2.weight", (17, 33)),
                ]
        named.append((f"{h}.norm.weight", (17,)))
    named.append(("head", (97, 17)))
    return specs_from_shapes([shape for _, shape in named], names=[name for name, _ in named], dtype=dtype)


def test_expert_domains_keeps_the_dense_params_and_the_first_experts_of_each_layer():
    specs = moe_specs(layers=2, experts=4)
    split = expert_domains(specs, world_size=8, expert_parallel=2)
    assert isinstance(split, ExpertSplit)
    dense = [s.name for s in specs if ".experts." not in s.name]
    kept = [s.name for s in specs if ".experts.0." in s.name or ".experts.1." in s.name]
    assert [s.name for s in split.specs] == dense + kept
    assert [s.index for s in split.specs] == list(range(len(split.specs)))
    assert [s.group for s in split.specs] == [0] * len(dense) + [1] * len(kept)
    by_name = {s.name: s for s in specs}
    assert all((s.shape, s.dtype) == (by_name[s.name].shape, by_name[s.name].dtype) for s in split.specs)
    data, experts = split.domains
    assert (data.name, data.groups, data.topology) == ("data", (0,), Topology(world_size=8))
    assert (experts.name, experts.groups, experts.topology) == ("experts", (1,), Topology(world_size=4))


@pytest.mark.parametrize("wrapped", [False, True])
def test_the_expert_index_follows_the_experts_component(wrapped):
    specs = moe_specs(layers=1, experts=4, wrapped=wrapped)
    split = expert_domains(specs, world_size=4, expert_parallel=4)
    names = [s.name for s in split.specs if s.group == 1]
    inner = "experts.wrapped_experts" if wrapped else "experts"
    assert names == [f"layers.0.moe.{inner}.0.w1.weight", f"layers.0.moe.{inner}.0.w2.weight"]


def test_stacked_experts_are_cut_on_their_leading_dimension():
    """transformers >= 5 stores Mixtral's experts of a layer as one tensor, experts first."""
    specs = moe_specs(layers=2, experts=4, stacked=True)
    split = expert_domains(specs, world_size=8, expert_parallel=4)
    experts = [(s.name, s.shape) for s in split.specs if s.group == 1]
    assert experts == [
        ("layers.0.moe.experts.gate_up_proj", (1, 66, 17)),
        ("layers.0.moe.experts.down_proj", (1, 17, 33)),
        ("layers.1.moe.experts.gate_up_proj", (1, 66, 17)),
        ("layers.1.moe.experts.down_proj", (1, 17, 33)),
    ]
    # A rank holds a quarter of the expert elements.
    assert 4 * sum(s.numel for s in split.specs if s.group == 1) == sum(
        s.numel for s in specs if ".experts." in s.name
    )


def test_expert_parallel_of_one_keeps_every_expert_over_the_world():
    specs = moe_specs()
    split = expert_domains(specs, world_size=4, expert_parallel=1)
    assert sorted(s.name for s in split.specs) == sorted(s.name for s in specs)
    assert split.domains[1].topology == Topology(world_size=4)


def test_a_custom_is_expert_picks_the_expert_params():
    names = ["embed", *(f"blocks.0.local_experts.{e}.ffn" for e in range(4)), "blocks.0.norm"]
    specs = specs_from_shapes([(8, 8)] * 6, names=names)
    assert expert_domains(
        specs, world_size=4, expert_parallel=2, is_expert=lambda n: "_experts." in n
    ).specs == (
        ParamSpec(index=0, name="embed", shape=(8, 8)),
        ParamSpec(index=1, name="blocks.0.norm", shape=(8, 8)),
        ParamSpec(index=2, name="blocks.0.local_experts.0.ffn", shape=(8, 8), group=1),
        ParamSpec(index=3, name="blocks.0.local_experts.1.ffn", shape=(8, 8), group=1),
    )
    # Without a component naming experts, there is no expert index: each tensor is stacked experts.
    flat = specs_from_shapes([(4, 8)] * 2, names=["embed", "moe.ffn"])
    split = expert_domains(flat, world_size=4, expert_parallel=2, is_expert=lambda n: n.startswith("moe."))
    assert [(s.name, s.shape, s.group) for s in split.specs] == [("embed", (4, 8), 0), ("moe.ffn", (2, 8), 1)]


@pytest.mark.parametrize(
    ("ranks_per_node", "expert_parallel", "world", "expected"),
    [
        (None, 4, 32, 8),  # one node: the group's too
        (32, 4, 32, 8),
        (8, 4, 32, 2),  # a node holds 2 expert-parallel groups: 2 members of each expert-data group
        (4, 4, 32, 1),
        (2, 4, 32, 1),  # an expert-parallel group spans 2 nodes: one member per node
    ],
)
def test_expert_data_groups_on_nodes(ranks_per_node, expert_parallel, world, expected):
    split = expert_domains(
        moe_specs(experts=8), world_size=world, expert_parallel=expert_parallel, ranks_per_node=ranks_per_node
    )
    data, experts = (d.topology for d in split.domains)
    assert data == Topology(world_size=world, ranks_per_node=ranks_per_node)
    assert (experts.world_size, experts.ranks_per_node) == (world // expert_parallel, expected)


def test_shard_size_applies_to_the_data_domain():
    data, experts = expert_domains(moe_specs(), world_size=16, expert_parallel=2, shard_size=4).domains
    assert (data.topology.shard_size, experts.topology.shard_size) == (4, 8)


def test_mixtral_experts_state_is_sharded_over_groups_of_world_over_ep():
    """Mixtral 8x7B at world 64, 8 experts per layer split over 8 ranks: one expert per layer per rank."""
    specs = preset_specs("mixtral-8x7b", "bf16")
    split = expert_domains(specs, world_size=64, expert_parallel=8)
    assert split.domains[1].topology == Topology(world_size=8)
    experts = [s for s in split.specs if s.group == 1]
    assert len(experts) == 32 * 3 and all(".experts.0." in s.name for s in experts)
    dp = plan_domains(split.specs, split.domains, stage=2, optimizer="AdamW")
    report = domains_report(dp)
    numel = sum(s.numel for s in experts)
    slack = 12 * dp.plans[1].partition.alignment + describe_optimizer("AdamW").state_bytes((0,), 4)
    for rank in report.reports[1].ranks:  # fp32 master and AdamW's two fp32 states: 12 bytes per element
        assert 0 <= rank.master_bytes + rank.optimizer_state_bytes - numel * 12 // 8 <= slack
        assert rank.params_bytes == 2 * numel  # every expert-data rank holds its experts in bf16
    # The dense plan is the plan of the dense parameters alone.
    dense = specs_from_shapes(
        [s.shape for s in specs if ".experts." not in s.name],
        names=[s.name for s in specs if ".experts." not in s.name],
        dtype="bf16",
    )
    assert dp.plans[0].fingerprint() == plan(dense, Topology(world_size=64), stage=2).fingerprint()
    assert report.reports[0] == memory_report(plan(dense, Topology(world_size=64), stage=2))


def _in_group(specs, group):
    return [dataclasses.replace(s, group=group) for s in specs]


@pytest.mark.parametrize(
    ("specs", "kwargs", "needle"),
    [
        (moe_specs(), {"world_size": 8, "expert_parallel": 3}, "expert parallel size 3 does not divide the"),
        (
            moe_specs(),
            {"world_size": 2, "expert_parallel": 4},
            "does not divide the data-parallel world of 2",
        ),
        (moe_specs(), {"world_size": 8, "expert_parallel": 0}, "must be an int >= 1"),
        (
            moe_specs(experts=6),
            {"world_size": 8, "expert_parallel": 4},
            "has 6 experts, which expert parallel",
        ),
        (
            moe_specs(experts=6, stacked=True),
            {"world_size": 8, "expert_parallel": 4},
            "leading dimension ((6,))",
        ),
        (specs_from_shapes([(4, 4)] * 3), {"world_size": 8, "expert_parallel": 2}, "needs expert parameters"),
        (
            moe_specs(),
            {"world_size": 24, "expert_parallel": 4, "ranks_per_node": 6},
            "one must divide the other",
        ),
        (
            moe_specs(),
            {"world_size": 8, "expert_parallel": 2, "shard_size": 3},
            "shard size 3 does not divide",
        ),
        (_in_group(moe_specs(), 1), {"world_size": 8, "expert_parallel": 2}, "pass every spec in group 0"),
    ],
)
def test_expert_domains_refuses(specs, kwargs, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        expert_domains(specs, **kwargs)


def test_experts_of_a_layer_must_be_alike():
    specs = list(moe_specs(layers=1, experts=2))
    odd = next(i for i, s in enumerate(specs) if s.name == "layers.0.moe.experts.1.w1.weight")
    specs[odd] = dataclasses.replace(specs[odd], shape=(34, 17))
    with pytest.raises(ConfigError, match=r"expert 1's parameters .* differ from expert 0's"):
        expert_domains(specs, world_size=2, expert_parallel=2)
