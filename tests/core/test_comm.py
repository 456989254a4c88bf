"""The cost model: bytes one rank sends in one collective call."""

from __future__ import annotations

import pytest

from zeroplan.core import Collective, ConfigError, send_elements
from zeroplan.core.comm import all_reduce_send, even_split


@pytest.mark.parametrize(
    ("total", "parts", "expected"),
    [(10, 4, (3, 3, 2, 2)), (8, 4, (2, 2, 2, 2)), (3, 5, (1, 1, 1, 0, 0)), (0, 2, (0, 0))],
)
def test_even_split(total, parts, expected):
    assert even_split(total, parts) == expected


def test_reducing_collectives_send_everything_but_the_own_piece():
    pieces = [3, 0, 5, 2]
    for collective in (Collective.REDUCE_SCATTER, Collective.REDUCE_SCATTER_V, Collective.REDUCE):
        assert [send_elements(collective, pieces, r) for r in range(4)] == [7, 10, 5, 8]
    # Equal pieces: the ring's (N-1)/N * M.
    assert send_elements(Collective.REDUCE_SCATTER, [4369] * 4, 2) == 3 * 4369


def test_gathering_collectives_send_everything_but_the_successors_piece():
    pieces = [3, 0, 5, 2]
    for collective in (Collective.ALL_GATHER, Collective.BROADCAST):
        # rank r skips pieces[(r + 1) % 4]
        assert [send_elements(collective, pieces, r) for r in range(4)] == [10, 5, 8, 7]


def test_all_reduce_is_a_ring_reduce_scatter_then_all_gather():
    # 10 over 4 ranks: chunks (3, 3, 2, 2); rank r sends 2*10 - chunk[r] - chunk[r+1].
    assert [send_elements(Collective.ALL_REDUCE, [10] * 4, r) for r in range(4)] == [14, 15, 16, 15]
    assert [all_reduce_send(10, 4, r) for r in range(4)] == [14, 15, 16, 15]
    assert all_reduce_send(12, 4, 0) == 2 * 12 * 3 // 4  # even: 2 (N-1)/N M
    assert all_reduce_send(1, 2, 0) == 1 and all_reduce_send(1, 2, 1) == 1


@pytest.mark.parametrize("collective", list(Collective))
def test_groups_of_one_send_nothing(collective):
    assert send_elements(collective, [4369], 0) == 0
    assert all_reduce_send(4369, 1, 0) == 0


@pytest.mark.parametrize(("pieces", "rank"), [([1, 2], 2), ([1, 2], -1), ([], 0)])
def test_rank_outside_the_group_is_a_config_error_naming_it(pieces, rank):
    with pytest.raises(ConfigError, match=f"rank {rank} is outside a group of {len(pieces)} ranks"):
        send_elements(Collective.REDUCE, pieces, rank)


def test_collectives_print_as_their_names():
    assert str(Collective.REDUCE_SCATTER_V) == "reduce_scatter_v"
    assert Collective("all_gather") is Collective.ALL_GATHER


def test_an_unknown_collective_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="unknown collective 'scatter_gather'"):
        send_elements("scatter_gather", [1, 2], 0)  # type: ignore[arg-type]
