"""The version registry: which version serves, which are kept, rollback."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from streamtrain.training.registry import ModelRegistry, UnknownVersion


@dataclass(frozen=True)
class _Model:
    version: int


def test_keeps_the_last_versions_and_serves_the_newest() -> None:
    registry: ModelRegistry[_Model] = ModelRegistry(keep=3)
    assert registry.serving is None
    for v in range(1, 6):
        registry.add(_Model(v))
    assert registry.versions() == [3, 4, 5]
    assert registry.serving == _Model(5)
    with pytest.raises(UnknownVersion):
        registry.get(2)


def test_rollback_serves_an_earlier_version_and_keeps_it_while_newer_arrive() -> None:
    registry: ModelRegistry[_Model] = ModelRegistry(keep=2)
    registry.add(_Model(1))
    registry.add(_Model(2))
    assert registry.rollback(1) == _Model(1)
    assert registry.serving == _Model(1)
    registry.add(_Model(3), serve=False)  # a held-back candidate: kept, not serving
    assert registry.serving == _Model(1)
    assert registry.versions() == [1, 3]  # the serving version is never dropped
    with pytest.raises(UnknownVersion):
        registry.rollback(2)


def test_keep_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep"):
        ModelRegistry(keep=0)
