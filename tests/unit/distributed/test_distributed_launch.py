"""The launch context: torchrun's ``env://`` variables, launch errors of one line, and
what follows for each rank from its place (HTTP port, GPU, share of the window)."""

from __future__ import annotations

import socket

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from streamtrain.distributed.collectives import Collectives
from streamtrain.distributed.launch import (
    DistConfigError,
    DistContext,
    capacity_share,
    free_port,
    http_port,
    rank_device,
)


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


MASTER = {"MASTER_ADDR": "trainer-0", "MASTER_PORT": "29500"}


def test_a_world_of_one_may_be_set_explicitly_without_rank_or_master() -> None:
    assert DistContext.from_env({"WORLD_SIZE": "1"}) == DistContext()
    assert DistContext.from_env({"WORLD_SIZE": "1"}).master_port is None


def test_the_process_environment_is_read_when_none_is_given(monkeypatch) -> None:
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", **MASTER}.items():
        monkeypatch.setenv(name, value)
    assert DistContext.from_env() == DistContext(1, 2, 0, 1, "trainer-0", 29500)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, (0, 0, 1)),  # every smallest value taken
        ({"RANK": "1"}, (1, 0, 1)),  # LOCAL_RANK unset: 0, one rank on this host
        ({"RANK": "1", "LOCAL_RANK": "2"}, (1, 2, 3)),  # LOCAL_WORLD_SIZE unset: at least LOCAL_RANK + 1
        ({"RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, (1, 1, 4)),  # as set
        ({"RANK": " 1 ", "LOCAL_RANK": ""}, (1, 0, 1)),  # spaces around a number; empty is unset
    ],
)
def test_ranks_on_this_host_and_their_defaults(env: dict[str, str], expected: tuple[int, int, int]) -> None:
    ctx = DistContext.from_env({"WORLD_SIZE": "4", **MASTER, **env})
    assert (ctx.rank, ctx.local_rank, ctx.local_world_size) == expected


def test_master_port_and_the_elastic_variables_at_their_limits() -> None:
    base = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h"}
    assert DistContext.from_env({**base, "MASTER_PORT": "65535"}).master_port == 65535
    with pytest.raises(DistConfigError) as err:
        DistContext.from_env({**base, "MASTER_PORT": "65536"})
    assert str(err.value) == "MASTER_PORT=65536 is not a TCP port (1..65535)"
    ctx = DistContext.from_env({**base, "MASTER_PORT": "1", "TORCHELASTIC_RESTART_COUNT": "0"})
    assert (ctx.restart_count, ctx.agent_store) == (0, False)
    assert DistContext.from_env({**base, "MASTER_PORT": "1"}).restart_count == 0
    assert DistContext.from_env({**base, "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": " 1 "}).agent_store


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"WORLD_SIZE": "2", "RANK": " ", **MASTER},
            "RANK is not set; torchrun sets it, or export it for each process",
        ),
        ({"WORLD_SIZE": "2", "RANK": "one", **MASTER}, "RANK='one' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "-1", **MASTER}, "RANK=-1 must be >= 0"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
        ({"WORLD_SIZE": "2", "RANK": "0", **MASTER, "MASTER_PORT": "0"}, "MASTER_PORT=0 must be >= 1"),
        ({"WORLD_SIZE": "2", "RANK": "0", **MASTER, "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0 must be >= 1"),
        ({"WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "-1"}, "TORCHELASTIC_RESTART_COUNT=-1 must be >= 0"),
    ],
)
def test_a_bad_variable_is_named_in_full(env: dict[str, str], message: str) -> None:
    with pytest.raises(DistConfigError) as err:
        DistContext.from_env(env)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"world_size": 0}, "WORLD_SIZE=0: a world has at least 1 rank"),
        (
            {"rank": 2, "world_size": 2, "master_addr": "h", "master_port": 1},
            "RANK=2 is outside [0, WORLD_SIZE=2); give each process its own rank",
        ),
        ({"local_rank": 1, "local_world_size": 1}, "LOCAL_RANK=1 is outside [0, LOCAL_WORLD_SIZE=1)"),
        ({"local_rank": 2, "local_world_size": 2}, "LOCAL_RANK=2 is outside [0, LOCAL_WORLD_SIZE=2)"),
        (
            {"rank": 1, "world_size": 2, "master_addr": "h"},
            "WORLD_SIZE=2 needs MASTER_ADDR and MASTER_PORT (rank 0's address and a free port); torchrun sets "
            "them, on Kubernetes point MASTER_ADDR at pod 0's headless-service name",
        ),
        ({"rank": 1, "world_size": 2, "master_port": 1}, "WORLD_SIZE=2 needs MASTER_ADDR and MASTER_PORT"),
    ],
)
def test_an_inconsistent_context_is_refused_in_one_line(fields: dict, message: str) -> None:
    with pytest.raises(DistConfigError) as err:
        DistContext(**fields)
    assert str(err.value).startswith(message)
    assert DistContext(local_rank=0, local_world_size=0).local_rank == 0  # no LOCAL_WORLD_SIZE: rank 0 alone


def test_a_context_answers_for_its_own_rank() -> None:
    ctx = DistContext(rank=2, world_size=3, local_rank=1, local_world_size=2, master_addr="h", master_port=1)
    assert ctx.capacity_share(10) == capacity_share(10, 2, 3) == 3  # 4, 3, 3
    assert ctx.http_port(8000, explicit=False) == 8001
    with pytest.raises(DistConfigError, match="share this host"):
        ctx.http_port(8000, explicit=True)


def test_the_http_port_limits_and_messages() -> None:
    second = DistContext(rank=1, world_size=2, local_rank=1, local_world_size=2, master_addr="h", master_port=1)
    assert http_port(65534, second, explicit=False) == 65535
    with pytest.raises(DistConfigError) as err:
        http_port(65535, second, explicit=False)
    assert str(err.value) == "HTTP_PORT 65535 + LOCAL_RANK 1 = 65536 is past 65535; lower HTTP_PORT"
    with pytest.raises(DistConfigError) as err:
        http_port(9000, second, explicit=True)
    assert str(err.value) == (
        "the HTTP port 9000 was set for the process (STREAMTRAIN_HTTP_PORT or --port), but 2 ranks share this "
        "host and would all bind it; set HTTP_PORT in the config file instead (each rank binds HTTP_PORT + "
        "LOCAL_RANK), or start the ranks one by one"
    )


@pytest.mark.parametrize(("capacity", "rank", "world_size"), [(0, 0, 1), (5, 2, 2), (5, -1, 2)])
def test_a_share_of_nothing_or_of_another_world_is_refused(capacity: int, rank: int, world_size: int) -> None:
    with pytest.raises(ValueError) as err:
        capacity_share(capacity, rank, world_size)
    assert str(err.value) == (
        f"capacity_share needs capacity >= 1 and 0 <= rank < world_size, got {capacity}, {rank}, {world_size}"
    )


def test_a_free_port_is_a_tcp_port_this_host_can_bind_now() -> None:
    port = free_port()
    assert 1024 < port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("0.0.0.0", free_port("0.0.0.0")))  # noqa: S104 - any address, as a pod binds
