"""docs/contract.md stays true: checked against the code itself, in every clone.

Routes against the application's own routes and OpenAPI document, response fields
against live answers, metric names, types and labels against the metrics the service
registers, rejection reasons against the validator, settings and defaults against
``Settings``, the command line against the parser.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import Counter, Gauge, Histogram

from streamtrain.cli import build_parser
from streamtrain.config import Settings, load_settings
from streamtrain.events import REASONS, EventLimits, SensorEvent, decode_event
from streamtrain.metrics import Metrics
from streamtrain.serve.schemas import ModelReport, Quantiles, WindowReport

REPO = Path(__file__).resolve().parents[2]
CONTRACT = (REPO / "docs" / "contract.md").read_text(encoding="utf-8")
ROUTE = re.compile(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`\s]*)`")
TICKED = re.compile(r"`([^`]+)`")


def section(number: int) -> str:
    return CONTRACT.split(f"\n## {number}. ", 1)[1].split("\n## ", 1)[0]


def table_rows(text: str) -> list[list[str]]:
    """The cells of every body row of the markdown tables in ``text``."""
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|[-| ]+\|", line.strip()):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [row for row in rows if row[0] not in ("name", "reason", "field", "method, path")]


def paragraph(text: str, start: str) -> str:
    return text.split(start, 1)[1].split("\n\n", 1)[0]


def settings_default(name: str) -> str:
    """A setting's default as the tables write it."""
    value = Settings.model_fields[name.lower()].default
    return "unset" if value is None else str(value)


# --------------------------------------------------------------------------- 1. events


def test_rejection_reasons_are_the_validators_in_its_order() -> None:
    reasons_table = section(1).split("| reason |", 1)[1]
    reasons = [TICKED.fullmatch(row[0]).group(1) for row in table_rows(reasons_table)]
    assert reasons == list(REASONS)


def test_the_example_event_is_valid_and_the_fields_are_those_of_the_format() -> None:
    example = re.search(r"```json\n(.*?)\n```", section(1), re.S).group(1).encode()
    decoded = decode_event(example, EventLimits(n_classes=3), now=1764412345.125)
    assert isinstance(decoded, SensorEvent) and decoded.sensor_id == "pump-17" and decoded.label == 1
    fields = [TICKED.match(row[0]).group(1) for row in table_rows(section(1).split("| reason |")[0])]
    assert fields == ["sensor_id", "ts", "values", "label"]
    for header in ("reason", "source_topic", "source_partition", "source_offset"):
        assert f"`{header}`" in section(1)
    from streamtrain.ingest.dead_letters import CONTRACT_HEADERS

    assert CONTRACT_HEADERS == ("reason", "source_topic", "source_partition", "source_offset")


# --------------------------------------------------------------------------- 2. HTTP API


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from streamtrain.runtime.service import Service

    settings = load_settings(
        checkpoint_dir=tmp_path_factory.mktemp("ckpt"),
        admin_token="t0ken",
        d_model=16,
        n_heads=2,
        n_layers=1,
        max_len=32,
    )
    return Service(settings)


@pytest.fixture(scope="module")
def app(service: Any) -> Any:
    from streamtrain.serve.app import create_app

    return create_app(service)


def app_routes(app: Any) -> set[tuple[str, str]]:
    routes = {(m, path) for path, item in app.openapi()["paths"].items() for m in (k.upper() for k in item)}
    own = {
        (m, route.path)
        for route in app.routes
        if getattr(route, "path", None) in ("/docs", "/openapi.json")
        for m in route.methods
        if m != "HEAD"
    }
    return routes | own


def test_every_route_of_section_2_is_served_and_every_served_route_is_documented(app: Any) -> None:
    documented = set(ROUTE.findall(" ".join(row[0] for row in table_rows(section(2)))))
    served = app_routes(app)
    assert documented <= served, f"documented but not served: {documented - served}"
    # other parts of the contract (docs/*.md) may document routes they add
    everywhere = set()
    for doc in sorted((REPO / "docs").glob("*.md")):
        everywhere |= set(ROUTE.findall(doc.read_text(encoding="utf-8")))
    undocumented = {route for route in served if not any(_same_route(route, doc) for doc in everywhere)}
    assert not undocumented, f"served but documented nowhere under docs/: {undocumented}"


def _same_route(served: tuple[str, str], documented: tuple[str, str]) -> bool:
    """A served path parameter (``{model_name}``) matches any one documented segment
    (``streamtrain`` or ``{v}``); every other segment must be equal."""
    (method, path), (doc_method, doc_path) = served, documented
    parts, doc_parts = path.split("/"), doc_path.split("/")
    return (
        method == doc_method
        and len(parts) == len(doc_parts)
        and all(a == b or (a.startswith("{") and a.endswith("}")) for a, b in zip(parts, doc_parts))
    )


def test_without_an_admin_token_there_are_no_admin_routes(tmp_path: Path) -> None:
    from streamtrain.runtime.service import Service
    from streamtrain.serve.app import create_app

    app = create_app(Service(load_settings(checkpoint_dir=tmp_path, d_model=16, n_heads=2, n_layers=1, max_len=32)))
    assert not [path for _, path in app_routes(app) if path.startswith("/v1/admin")]
    assert TestClient(app).post("/v1/admin/checkpoint").status_code == 404


def test_window_and_model_answers_have_exactly_the_documented_fields(app: Any) -> None:
    client = TestClient(app)
    window_doc = paragraph(section(2), "**`GET /v1/window`** returns")
    window = client.get("/v1/window").json()
    assert set(window) == set(WindowReport.model_fields)
    for name in window:
        assert f"`{name}`" in window_doc, name
    assert set(Quantiles.model_fields) == set(
        re.search(r'\{("min".*?)\}', window_doc).group(1).replace('"', "").replace(" ", "").split(",")
    )
    model_doc = paragraph(section(2), "**`GET /v1/model`** returns")
    model = client.get("/v1/model").json()
    assert set(model) == set(ModelReport.model_fields)
    for name in list(model) + list(model["training"]):
        assert f"`{name}`" in model_doc, name


def test_predict_statuses_are_the_documented_ones(app: Any) -> None:
    client = TestClient(app)
    predict_doc = paragraph(section(2), "**`POST /v1/predict`** takes")
    too_long = client.post("/v1/predict", json={"instances": [{"values": [1.0]}, {"values": [0.0] * 33}]})
    assert too_long.status_code == 422 and too_long.json()["detail"].startswith("instances[1].values: too_long: ")
    assert client.post("/v1/predict", json={"instances": [{"values": [1.0]}]}).status_code == 503  # no model yet
    assert (
        client.post("/v1/predict", content=b"x" * (9 << 20), headers={"content-type": "application/json"}).status_code
        == 413
    )
    for code in ("422", "413", "503"):
        assert code in predict_doc


# --------------------------------------------------------------------------- 3. metrics


def registered_metrics() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Exposed name -> (type, label names) of every metric the service registers."""
    metrics = Metrics()
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for metric in vars(metrics).values():
        if isinstance(metric, (Counter, Gauge, Histogram)):
            suffix = "_total" if metric._type == "counter" else ""
            out[metric._name + suffix] = (metric._type, tuple(metric._labelnames))
    metrics.watch_window_age(lambda: (0.0, 0.0))
    metrics.watch_models(lambda: ([1], 1, 0.0))
    for family in metrics.registry.collect():  # collectors computed at scrape time
        name = family.name + ("_total" if family.type == "counter" else "")
        if name not in out:
            out[name] = (family.type, tuple(dict.fromkeys(k for sample in family.samples for k in sample.labels)))
    return out


def documented_metrics(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    out = {}
    for row in table_rows(text):
        for match in re.finditer(r"`(streamtrain_[a-z0-9_]+)(?:\{([a-z_,]+)\})?`", row[0]):
            out[match.group(1)] = (row[1], tuple(match.group(2).split(",")) if match.group(2) else ())
    return out


def test_every_metric_of_section_3_is_registered_with_its_type_and_labels() -> None:
    documented, registered = documented_metrics(section(3)), registered_metrics()
    assert documented, "no metric table in section 3"
    for name, (kind, labels) in documented.items():
        assert name in registered, f"{name} is in the contract but the service does not register it"
        assert registered[name] == (kind, labels), name
    assert set(registered) <= set(documented), (
        f"registered but not in the contract: {set(registered) - set(documented)}"
    )


def test_prometheus_counters_start_at_zero_with_the_process(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from streamtrain.runtime.service import Service

    fresh = Service(load_settings(checkpoint_dir=tmp_path, d_model=16, n_heads=2, n_layers=1, max_len=32))
    for family in text_string_to_metric_families(fresh.metrics.exposition().decode()):
        if family.type == "counter":
            assert all(sample.value == 0 for sample in family.samples), family.name


# --------------------------------------------------------------------------- 4. command line and settings


def test_settings_of_section_4_exist_with_their_defaults() -> None:
    rows = [row for row in table_rows(section(4)) if TICKED.fullmatch(row[0])]
    assert len(rows) >= 20
    for row in rows:
        name = TICKED.fullmatch(row[0]).group(1)
        assert name.lower() in Settings.model_fields, f"{name} is not a setting"
        assert row[1].strip("`") == settings_default(name), (
            f"{name}: contract says {row[1]}, Settings says {settings_default(name)}"
        )


def test_every_setting_named_anywhere_in_the_contract_exists() -> None:
    named = set(re.findall(r"`([A-Z][A-Z0-9_]{2,})`", CONTRACT)) | set(
        re.findall(r"STREAMTRAIN_([A-Z][A-Z0-9_]+)", CONTRACT)
    )
    for name in {n.removeprefix("STREAMTRAIN_") for n in named}:
        assert name.lower() in Settings.model_fields, name


def test_the_command_line_is_the_parsers() -> None:
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse keeps them here only
    assert set(commands) == set(re.findall(r"`streamtrain ([a-z]+) ", section(4)))
    serve_options = {o for action in commands["serve"]._actions for o in action.option_strings} - {"-h", "--help"}
    synopsis = re.search(r"`streamtrain serve ([^`]*)`", section(4)).group(1)
    assert set(re.findall(r"--[a-z-]+", synopsis)) == serve_options
    assert "--version" in {o for action in parser._actions for o in action.option_strings}
    assert "--config" in {o for action in commands["simulate"]._actions for o in action.option_strings}


def test_a_bad_setting_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMTRAIN_")} | {
        "STREAMTRAIN_WINDOW_CAPACITY": "0"
    }
    done = subprocess.run(
        [sys.executable, "-m", "streamtrain.cli", "serve"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    example = re.search(r"\(`(streamtrain: invalid setting [^`]*): \.\.\.`\)", section(4)).group(1)
    assert len(lines) == 1 and lines[0].startswith(example + ": "), (lines, example)


# --------------------------------------------------------------------------- the contract is the project's


def test_nothing_points_outside_the_repository_for_the_contract() -> None:
    """README, docs, code, tests and deployment files cite docs/contract.md, not a file users do not have."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=False).stdout.split()
    files = tracked or [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts]
    outside = re.compile(r"\bSPEC\b|SPEC\.md")
    here = Path(__file__).resolve()
    offenders = []
    for name in files:
        path = REPO / name
        if path.resolve() == here or path.suffix not in {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".json", ""}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        offenders += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1) if outside.search(line)]
    assert not offenders, offenders
