"""The README stays true: its two commands exist, every setting and metric is documented."""

from __future__ import annotations

import os
import re
from pathlib import Path

from streamtrain.config import Settings
from streamtrain.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def test_first_block_has_the_run_and_test_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["scripts/run-local.sh", "scripts/test.sh"]
    for command in commands:
        path = REPO / command
        assert path.is_file() and os.access(path, os.X_OK), command
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_every_setting_is_in_the_settings_table() -> None:
    for name in Settings.model_fields:
        assert f"| `{name.upper()}` |" in README, name


def test_every_exported_metric_is_documented() -> None:
    metrics = Metrics()
    metrics.watch_window_age(lambda: (0.0, 0.0))
    names = {family.name for family in metrics.registry.collect()}
    for name in names:
        assert name in README, name
