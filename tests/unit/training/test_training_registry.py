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


def test_by_default_two_versions_are_kept_and_one_is_enough() -> None:
    registry: ModelRegistry[_Model] = ModelRegistry()
    for version in (1, 2, 3):
        registry.add(_Model(version))
    assert registry.versions() == [2, 3]
    single: ModelRegistry[_Model] = ModelRegistry(keep=1)
    single.add(_Model(1))
    single.add(_Model(2))
    assert single.versions() == [2] and single.serving == _Model(2)
    with pytest.raises(ValueError, match=r"^ModelRegistry: keep must be >= 1, got 0$"):
        ModelRegistry(keep=0)


def test_held_back_candidates_before_anything_serves_are_kept_newest_last() -> None:
    registry: ModelRegistry[_Model] = ModelRegistry(keep=2)
    for version in (1, 2, 3):
        registry.add(_Model(version), serve=False)
    assert registry.serving is None and registry.versions() == [2, 3]


def test_an_unknown_version_names_itself() -> None:
    registry: ModelRegistry[_Model] = ModelRegistry()
    with pytest.raises(UnknownVersion) as unknown:
        registry.get(7)
    assert unknown.value.args == (7,)
