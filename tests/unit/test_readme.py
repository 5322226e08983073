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


def readme_table(heading: str) -> list[list[str]]:
    """Body rows of the first table under ``## heading``."""
    section = README.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[2:]]


def documented_default(field: str) -> str:
    """A setting's default as the table writes it."""
    value = Settings.model_fields[field].default
    return "unset" if value is None else str(value)


def test_the_settings_table_is_every_setting_with_its_default() -> None:
    rows = {row[0].strip("`"): row for row in readme_table("Settings")}
    assert set(rows) == {name.upper() for name in Settings.model_fields}, set(rows) ^ {
        n.upper() for n in Settings.model_fields
    }
    for name, field in Settings.model_fields.items():
        default, meaning = rows[name.upper()][1].strip("`"), rows[name.upper()][2]
        assert default == documented_default(name), (
            f"{name.upper()}: README says {default}, Settings says {documented_default(name)}"
        )
        assert meaning == field.description, (
            f"{name.upper()}: the README's meaning differs from the setting's description"
        )


def exported_metrics() -> dict[str, str]:
    """Exposed metric name -> type, for every metric the service registers."""
    metrics = Metrics()
    metrics.watch_window_age(lambda: (0.0, 0.0))
    metrics.watch_models(lambda: ([1], 1, 0.0))
    return {
        family.name + ("_total" if family.type == "counter" else ""): family.type
        for family in metrics.registry.collect()
    }


def test_the_metrics_table_is_every_exported_metric_with_its_type() -> None:
    documented: dict[str, str] = {}
    for row in readme_table("Metrics"):
        for name in re.findall(r"`(streamtrain_[a-z0-9_]+)(?:\{[a-z_,]+\})?`", row[0]):
            assert name not in documented, f"{name} is documented twice"
            documented[name] = row[1]
    exported = exported_metrics()
    assert set(documented) == set(exported), set(documented) ^ set(exported)
    for name, kind in exported.items():
        assert documented[name] == kind, f"{name}: README says {documented[name]}, the registry says {kind}"
