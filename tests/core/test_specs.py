"""``ParamSpec``, ``check_specs`` and the spec builders."""

from __future__ import annotations

import dataclasses

import pytest

from zeroplan.core import (
    ConfigError,
    IncompatiblePlanError,
    ParamSpec,
    Replicate,
    Shard,
    Topology,
    check_specs,
    compare_specs,
    plan,
    specs_fingerprint,
    specs_from_module,
    specs_from_shapes,
)
from zeroplan.core.fingerprint import digest


def test_param_spec_derives_numel_and_canonical_dtype():
    spec = ParamSpec(index=0, name="w", shape=(17, 257), dtype="bf16")
    assert spec.numel == 17 * 257 == 4369
    assert spec.dtype == "bfloat16"
    assert spec.itemsize == 2 and spec.nbytes == 8738
    assert spec.group == 0 and spec.trainable is True


@pytest.mark.parametrize(
    ("shape", "numel"), [((), 1), ((0,), 0), ((17, 0, 3), 0), ((1,), 1), ((3, 5, 7), 105)]
)
def test_scalar_and_zero_size_shapes(shape, numel):
    assert ParamSpec(index=0, name="p", shape=shape).numel == numel


def test_key_identifies_the_spec():
    a = ParamSpec(index=0, name="w", shape=(3,))
    assert a.key() == ParamSpec(index=0, name="w", shape=(3,), dtype="fp32").key()
    for change in (
        {"name": "v"},
        {"shape": (4,)},
        {"dtype": "bf16"},
        {"group": 1},
        {"trainable": False},
        {"index": 1},
    ):
        fields = {"index": 0, "name": "w", "shape": (3,), **change}
        assert ParamSpec(**fields).key() != a.key(), change


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"index": -1}, ["index", "-1"]),
        ({"index": 1.0}, ["index", "1.0"]),
        ({"index": True}, ["index", "True"]),
        ({"shape": [3, 4]}, ["shape", "[3, 4]", "tuple"]),
        ({"shape": (3, -4)}, ["shape", "(3, -4)"]),
        ({"shape": (3.0,)}, ["shape", "(3.0,)"]),
        ({"group": -2}, ["group", "-2"]),
        ({"group": "0"}, ["group", "'0'"]),
        ({"dtype": "int8"}, ["dtype", "'int8'"]),
    ],
)
def test_bad_fields_are_config_errors_naming_the_value(kwargs, needles):
    fields = {"index": 0, "name": "weird.weight", "shape": (17, 257), **kwargs}
    with pytest.raises(ConfigError) as info:
        ParamSpec(**fields)
    for needle in needles:
        assert needle in str(info.value)


def test_param_spec_is_frozen():
    spec = ParamSpec(index=0, name="w", shape=(3,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.shape = (4,)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.numel = 4  # type: ignore[misc]


def test_specs_from_shapes():
    specs = specs_from_shapes([(17, 257), [3], ()], dtype="fp16", names=["a", "b", "c"], trainable=[1, 0, 1])
    assert [s.index for s in specs] == [0, 1, 2]
    assert [s.name for s in specs] == ["a", "b", "c"]
    assert [s.shape for s in specs] == [(17, 257), (3,), ()]
    assert [s.trainable for s in specs] == [True, False, True]
    assert {s.dtype for s in specs} == {"float16"}
    assert [s.name for s in specs_from_shapes([(1,), (2,)])] == ["p0", "p1"]


def test_specs_from_shapes_length_mismatches():
    with pytest.raises(ConfigError, match="got 1 names for 2 shapes"):
        specs_from_shapes([(1,), (2,)], names=["a"])
    with pytest.raises(ConfigError, match="got 3 trainable flags for 2 shapes"):
        specs_from_shapes([(1,), (2,)], trainable=[True, True, False])
    with pytest.raises(ConfigError, match=r"\(3, -1\)"):
        specs_from_shapes([(3, -1)])


def test_check_specs_accepts_a_valid_list_and_returns_a_tuple():
    specs = [
        ParamSpec(index=0, name="a", shape=(2,), group=0),
        ParamSpec(index=1, name="b", shape=(2,), group=1),
        ParamSpec(index=2, name="c", shape=(2,), group=1),
    ]
    assert check_specs(specs) == tuple(specs)
    assert check_specs(()) == ()


def test_check_specs_rejects_wrong_indices_naming_them():
    specs = [ParamSpec(index=0, name="a", shape=(2,)), ParamSpec(index=2, name="b", shape=(2,))]
    with pytest.raises(ConfigError, match=r"specs\[1\] has index 2"):
        check_specs(specs)


def test_check_specs_rejects_non_specs():
    with pytest.raises(ConfigError, match=r"specs\[0\] is tuple, expected ParamSpec"):
        check_specs([(17, 257)])
    with pytest.raises(ConfigError, match=r"specs\[1\] is dict, expected ParamSpec"):
        check_specs([ParamSpec(index=0, name="a", shape=(2,)), {"shape": (3,)}])


def test_check_specs_rejects_groups_out_of_order_naming_the_spec():
    specs = [
        ParamSpec(index=0, name="a", shape=(2,), group=1),
        ParamSpec(index=1, name="late", shape=(2,), group=0),
    ]
    with pytest.raises(ConfigError, match=r"'late' \(group 0\) follows group 1"):
        check_specs(specs)


def test_specs_from_module_reads_metadata_only_and_deduplicates_tied_weights():
    torch = pytest.importorskip("torch")

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(17, 257)
            self.norm = torch.nn.LayerNorm(257)
            self.head = torch.nn.Linear(257, 17, bias=False)
            self.head.weight = self.embed.weight  # tied
            self.norm.bias.requires_grad_(False)

    with torch.device("meta"):
        module = Tied().to(torch.bfloat16)
    specs = specs_from_module(module)
    assert [(s.name, s.shape, s.dtype, s.trainable) for s in specs] == [
        ("embed.weight", (17, 257), "bfloat16", True),
        ("norm.weight", (257,), "bfloat16", True),
        ("norm.bias", (257,), "bfloat16", False),
    ]
    assert check_specs(specs) == specs


ODD = specs_from_shapes([(17, 257), (3,), ()], dtype="bf16", trainable=[True, False, True])


def test_specs_fingerprint_is_the_digest_ranks_have_always_exchanged():
    # The value ranks of earlier versions computed as digest("specs", keys): pinned.
    assert specs_fingerprint(ODD) == digest("specs", [s.key() for s in ODD]) == "9375970e614aaca3"
    assert specs_fingerprint(list(ODD)) == specs_fingerprint(iter(ODD))  # any iterable of specs


@pytest.mark.parametrize(
    "change",
    [
        {"name": "other"},
        {"shape": (257, 17)},
        {"dtype": "fp16"},
        {"trainable": False},
        {"cohort": 1},
    ],
)
def test_specs_fingerprint_sees_every_field_of_the_key(change):
    changed = (dataclasses.replace(ODD[0], **change), *ODD[1:])
    assert specs_fingerprint(changed) != specs_fingerprint(ODD)


def test_zero_plan_specs_fingerprint_ignores_every_planning_setting():
    a = plan(ODD, Topology(world_size=2), stage=1, alignment=8)
    b = plan(ODD, Topology(world_size=4, shard_size=2), stage=2, strategy="lpt_whole", bucket_bytes=64)
    assert a.specs_fingerprint() == b.specs_fingerprint() == specs_fingerprint(ODD)
    assert a.fingerprint() != b.fingerprint()


# ----------------------------------------------------------------- placements ([Note: placements])
TP = (("tp", Shard(0)), ("dp", Replicate()))


def test_a_plain_spec_is_its_own_global_shape_replicated_and_keyed_as_before():
    spec = ParamSpec(index=0, name="w", shape=(17, 257))
    assert spec.global_shape == (17, 257) and spec.placement == ()
    assert spec.key() == (0, "w", (17, 257), "float32", 0, True, 0)
    assert all(s.global_shape == s.shape and s.placement == () for s in ODD)
    # replace describes the new shape whole (a plain spec has no other global shape)
    assert dataclasses.replace(spec, shape=(3,)).global_shape == (3,)


def test_a_placed_spec_computes_from_its_local_shape_and_keys_its_placement():
    spec = ParamSpec(index=0, name="w", shape=(9, 257), global_shape=(17, 257), placement=TP, dtype="bf16")
    assert spec.numel == 9 * 257 and spec.nbytes == 2 * 9 * 257
    assert spec.key()[-2:] == ((17, 257), (("tp", "shard", 0), ("dp", "replicate", -1)))
    replicated = ParamSpec(index=0, name="w", shape=(9, 257), placement=(("tp", Replicate()),))
    assert replicated.global_shape == (9, 257)
    zp = plan((spec,), Topology(world_size=2), stage=2, alignment=1)
    assert sum(f.param_span.numel for f in zp.partition.fragments[0]) == 9 * 257


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"global_shape": (17, 257), "placement": (("dp", Replicate()),)}, ["dimension 0", "Shard(0)"]),
        ({"global_shape": (5, 257), "placement": TP}, ["larger than global shape", "dimension 0"]),
        ({"global_shape": (17,), "placement": TP}, ["numbers of dimensions"]),
        ({"global_shape": [17, 257], "placement": TP}, ["global_shape", "[17, 257]"]),
        ({"placement": (("tp", Shard(2)),)}, ["dimension 2", "0 <= d < 2"]),
        ({"placement": [("tp", Shard(0))]}, ["tuple", "placement=(('tp', Shard(0)),)"]),
        ({"placement": (("tp", "shard"),)}, ["('tp', 'shard')", "pair"]),
        ({"placement": (("tp", Shard(0)), ("tp", Replicate()))}, ["'tp'", "twice"]),
    ],
)
def test_placements_that_do_not_fit_the_shapes_are_config_errors(kwargs, needles):
    with pytest.raises(ConfigError) as info:
        ParamSpec(index=0, name="weird.weight", shape=(9, 257), **kwargs)
    assert "weird.weight" in str(info.value)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_specs_fingerprint_sees_the_placement():
    placed = dataclasses.replace(ODD[0], shape=(9, 257), global_shape=(17, 257), placement=TP)
    other = dataclasses.replace(placed, placement=(("tp", Shard(0)),))
    prints = {specs_fingerprint((s, *ODD[1:])) for s in (ODD[0], placed, other)}
    assert len(prints) == 3


def test_plans_of_other_placements_do_not_reshard_into_each_other():
    a = ParamSpec(index=0, name="w", shape=(9, 4), global_shape=(17, 4), placement=TP)
    b = dataclasses.replace(a, global_shape=(18, 4))
    source, target = (plan((s,), Topology(world_size=2), stage=1).partition for s in (a, b))
    with pytest.raises(IncompatiblePlanError, match="global shape"):
        compare_specs(source, target, allow_trainable_change=False)
