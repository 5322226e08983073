"""The launch context: torchrun's ``env://`` variables, launch errors of one line, and
what follows for each rank from its place (HTTP port, GPU, share of the window)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import DistConfigError, DistContext, capacity_share, http_port, rank_device


def test_no_world_size_means_one_process() -> None:
    ctx = DistContext.from_env({})
    assert (ctx.rank, ctx.world_size, ctx.distributed) == (0, 1, False)
    assert Collectives(ctx).start().active is False


def test_context_reads_torchrun_variables() -> None:
    env = {
        "WORLD_SIZE": "4",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "trainer-0.trainer",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    ctx = DistContext.from_env(env)
    assert ctx == DistContext(3, 4, 1, 2, "trainer-0.trainer", 29500, 2)
    assert ctx.owned_partitions(10) == [3, 7]
    assert ctx.is_primary is False
    assert ctx.agent_store is False  # a StatefulSet: rank 0 hosts the store
    assert (
        DistContext.from_env({**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}).agent_store is True
    )  # torchrun's agent does


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK"),
        ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR"),
        ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT"),
    ],
)
def test_bad_launch_environment_is_one_line(env: dict[str, str], names: str) -> None:
    with pytest.raises(DistConfigError) as err:
        DistContext.from_env(env)
    assert names in str(err.value) and "\n" not in str(err.value)


def test_http_port_rule() -> None:
    two_local = DistContext(rank=3, world_size=4, local_rank=1, local_world_size=2, master_addr="h", master_port=1)
    pod = DistContext(rank=3, world_size=4, local_rank=0, local_world_size=1, master_addr="h", master_port=1)
    assert http_port(8000, two_local, explicit=False) == 8001  # configured + LOCAL_RANK
    assert http_port(0, two_local, explicit=False) == 0  # ephemeral stays ephemeral
    assert http_port(9000, pod, explicit=True) == 9000  # set for this process alone
    with pytest.raises(DistConfigError, match="share this host"):
        http_port(9000, two_local, explicit=True)
    with pytest.raises(DistConfigError, match="65535"):
        http_port(65535, two_local, explicit=False)


def test_rank_device_gives_each_local_rank_its_own_gpu() -> None:
    two_local = [DistContext(r, 4, r % 2, 2, "h", 1) for r in range(4)]
    assert [rank_device("cuda:0", ctx, cuda_count=lambda: 2) for ctx in two_local] == [
        (torch.device("cuda", 0), False), (torch.device("cuda", 1), False),
    ] * 2  # fmt: skip
    assert rank_device("cuda:0", two_local[1], cuda_count=lambda: 1) == (torch.device("cuda", 0), True)
    assert rank_device("cuda:1", DistContext(1, 2, 0, 1, "h", 1), cuda_count=lambda: 2) == (
        torch.device("cuda", 1),
        False,
    )
    assert rank_device("cpu", two_local[1], cuda_count=lambda: 2) == (torch.device("cpu"), False)


@given(st.integers(1, 10**7), st.integers(1, 64))
def test_capacity_shares_add_up(capacity: int, world_size: int) -> None:
    shares = [capacity_share(capacity, rank, world_size) for rank in range(world_size)]
    if capacity >= world_size:
        assert sum(shares) == capacity
    assert max(shares) - min(shares) <= 1 and min(shares) >= 1
