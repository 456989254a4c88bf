"""The cost of planning grows with world + buckets, never world x buckets (counted, not timed).

llama-70b at world 4,096 has 5,263 buckets: a plan that builds an object (or a per-rank number)
per rank per bucket or gather chunk builds tens of millions, and took minutes. Rank-major
spaces are gathered in chunks described by rule ([Note: gather blocks] in ``core.planner``,
``core/chunks.py``); interleaved ``flat_even`` spaces hold runs ([Note: compact plans] in
``core.runs``). These tests count what planning and its memory report build: blocks, the
per-rank numbers of the blocks' pieces (tuple entries, or entries read from a rule), fragments,
and the inner optimizer's tensors (an offloaded stage 3 steps a window per bucket on every rank:
ranks whose pieces are alike share them, ``ZeroPlan.pieces_alike``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from zeroplan.core import InnerTensor, Topology, memory_report, plan, specs_from_shapes
from zeroplan.core.chunks import ChunkStarts, OwnerOffsets, OwnerPieces, owner_chunks
from zeroplan.core.computed import Repeated
from zeroplan.core.space import Block, Fragment

SPECS = specs_from_shapes([(1024, 1024)] * 32, dtype="bf16")  # 32 Mi elements
BUCKET_BYTES = 2**20  # 64 buckets


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Count blocks built, the per-rank numbers their tuples hold or their rules give, and fragments."""
    counts: Counter[str] = Counter()
    block_post_init = Block.__post_init__
    fragment_init = Fragment.__init__
    tensor_init = InnerTensor.__init__

    held: dict[int, tuple[int, ...]] = {}  # tuples counted, by id (kept alive: ids stay unique)

    def post_init(self: Block) -> None:
        counts["blocks"] += 1
        for numbers in (self.pieces, self.shard_starts):  # a tuple shared by blocks counts once
            if type(numbers) is tuple and id(numbers) not in held:
                held[id(numbers)] = numbers
                counts["rank numbers"] += len(numbers)
        block_post_init(self)

    def init(self: Fragment, *args: object, **kwargs: object) -> None:
        counts["fragments"] += 1
        fragment_init(self, *args, **kwargs)

    def init_tensor(self: InnerTensor, *args: object, **kwargs: object) -> None:
        counts["inner tensors"] += 1
        tensor_init(self, *args, **kwargs)

    monkeypatch.setattr(Block, "__post_init__", post_init)
    monkeypatch.setattr(Fragment, "__init__", init)
    monkeypatch.setattr(InnerTensor, "__init__", init_tensor)
    for rule in (OwnerPieces, OwnerOffsets, ChunkStarts, Repeated):
        item = rule._item

        def counted(self: object, i: int, item: object = item) -> int:
            counts["rank numbers"] += 1
            return item(self, i)  # type: ignore[operator]

        monkeypatch.setattr(rule, "_item", counted)
        if "__iter__" in rule.__dict__:  # iterated in C: every item counts
            iterate = rule.__iter__

            def iterated(self: object, iterate: object = iterate) -> object:
                counts["rank numbers"] += len(self)  # type: ignore[arg-type]
                return iterate(self)  # type: ignore[operator]

            monkeypatch.setattr(rule, "__iter__", iterated)
    yield counts


def _plan_and_report(
    world: int, stage: int, layout: str, counts: Counter[str], **settings: object
) -> tuple[Counter[str], int, int]:
    owner_chunks.cache_clear()  # (chunks are cached by block: count them for each plan)
    counts.clear()
    zp = plan(
        SPECS, Topology(world_size=world), stage=stage, layout=layout, bucket_bytes=BUCKET_BYTES, **settings
    )
    memory_report(zp, clipping=True)
    chunks = sum(len(zp.gather_blocks(space)) for space in zp.partition.spaces)
    return Counter(counts), len(zp.buckets.buckets), chunks


OFFLOADED = {"offload": "optimizer"}
CASES = [
    (1, "rank_major", {}),
    (2, "rank_major", {}),
    (1, "interleaved", {}),
    (2, "interleaved", {}),
    (3, "auto", {}),
    (3, "auto", OFFLOADED),
    (3, "auto", {**OFFLOADED, "offload_fraction": 0.5}),
]


@pytest.mark.parametrize(("stage", "layout", "settings"), CASES)
def test_planning_builds_objects_by_world_plus_buckets_not_their_product(
    monkeypatch, stage, layout, settings
):
    with counting(monkeypatch) as counts:
        small, small_buckets, _ = _plan_and_report(64, stage, layout, counts, **settings)
        large, buckets, chunks = _plan_and_report(4096, stage, layout, counts, **settings)
    assert small_buckets == buckets == (32 if stage == 3 else 64)  # stage 3: a block per parameter
    if layout == "rank_major":
        assert chunks >= 4096  # a chunk per rank at least: each rank broadcasts its region
    assert large["fragments"] <= 2 * 4096 and large["blocks"] <= 2 * (buckets + chunks)
    # A few per rank and per bucket or chunk; one per rank per bucket (or chunk) would be
    # 4,096 x buckets (262,144) or more (the gather chunks as tuples held 16.7 million).
    bound = 5 * 4096 + 2 * (buckets + chunks)
    assert bound < 4096 * buckets // 4
    for what in ("blocks", "rank numbers", "fragments", "inner tensors"):
        assert large[what] <= bound, (what, large[what], bound)
        # From world 64 to 4,096 (64x) at the same buckets: what grows, grows with the world only.
        assert large[what] - small[what] <= 5 * (4096 - 64) + 2 * chunks, (what, small[what], large[what])
