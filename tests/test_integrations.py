"""docker-compose.yml and integrations/: parsed, and cross-checked against each other and the SDK.

No Docker engine, Jaeger, Tempo, Prometheus, Grafana or Collector binary runs here, so the stack
is proven by reading it: every image pinned; every host:port a config names is a compose service
listening on that port (and exposing it); every data source a dashboard uses is provisioned; and
every metric and label a dashboard, recording rule or alert queries is one the SDK really emits,
translated by the OTLP-to-Prometheus rules of the pinned Prometheus. The SDK's metrics are not
listed by hand: the `sdk` fixture takes the run of tests/support/workload.py (stages, retried, laned
and failed openai calls against the simulated server, a sampled vLLM simulator) and reads what came
out (names, units, instrument kinds, attribute keys and values) in the OTLP encoding Prometheus
receives.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmspans import _names as names
from tests.support.workload import exercise

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
INTEGRATIONS = ROOT / "integrations"
DOCS = ROOT / "docs"

# ----------------------------------------------------------------------------------------------
# OTLP -> Prometheus names, encoded once: Prometheus 3.x `otlp.translation_strategy:
# UnderscoreEscapingWithSuffixes` (its default; github.com/prometheus/otlptranslator v1.0.0, which
# Prometheus 3.14 uses). Characters outside [a-zA-Z0-9:] split the name into tokens joined by "_";
# the unit adds a word unless the name already has it (`s` -> `seconds`, `By` -> `bytes`, `1` and
# any `{...}` annotation -> nothing, `x/s` -> `x_per_second`); monotonic sums (counters) end in
# `_total`; gauges with unit `1` end in `_ratio`; a histogram is `_bucket`, `_sum` and `_count`
# series; attribute keys become labels with every other character replaced by "_" (runs of "_"
# kept, a leading digit or single "_" prefixed with "key"); `service.name` becomes `job` (after
# `service.namespace/`), `service.instance.id` becomes `instance`.

TRANSLATION_STRATEGY = "UnderscoreEscapingWithSuffixes"
_UNIT_WORDS = {
    "d": "days", "h": "hours", "min": "minutes", "s": "seconds", "ms": "milliseconds", "us": "microseconds",
    "ns": "nanoseconds", "By": "bytes", "KiBy": "kibibytes", "MiBy": "mebibytes", "GiBy": "gibibytes",
    "TiBy": "tibibytes", "KBy": "kilobytes", "MBy": "megabytes", "GBy": "gigabytes", "TBy": "terabytes",
    "m": "meters", "V": "volts", "A": "amperes", "J": "joules", "W": "watts", "g": "grams", "Cel": "celsius",
    "Hz": "hertz", "1": "", "%": "percent",
}  # fmt: skip
_PER_UNIT_WORDS = {
    "s": "second",
    "m": "minute",
    "h": "hour",
    "d": "day",
    "w": "week",
    "mo": "month",
    "y": "year",
}
RESOURCE_LABELS = frozenset({"job", "instance"})


def _unit_word(unit: str, words: dict[str, str]) -> str:
    unit = unit.strip()
    if not unit or "{" in unit or "}" in unit:
        return ""
    word = words.get(unit, unit)
    return re.sub(r"_+", "_", re.sub(r"[^a-zA-Z0-9:]", "_", word)).lstrip("_")


def prometheus_name(name: str, unit: str, kind: str) -> str:
    """The Prometheus metric name of an OTLP metric; `kind` is counter, updowncounter, gauge or histogram."""
    tokens = [token for token in re.split(r"[^a-zA-Z0-9:]", name) if token]
    main, _, per = unit.partition("/")
    main_word = _unit_word(main, _UNIT_WORDS)
    per_word = _unit_word(per, _PER_UNIT_WORDS)
    per_word = f"per_{per_word}" if per_word else ""
    if main_word and main_word not in tokens:
        tokens.append(main_word)
    if per_word and per_word not in tokens:
        tokens.append(per_word)
    if kind == "counter":
        tokens = [token for token in tokens if token != "total"] + ["total"]
    if unit == "1" and kind == "gauge":
        tokens = [token for token in tokens if token != "ratio"] + ["ratio"]
    joined = "_".join(tokens)
    return f"_{joined}" if joined[:1].isdigit() else joined


def prometheus_series(name: str, unit: str, kind: str) -> list[str]:
    base = prometheus_name(name, unit, kind)
    return [f"{base}_bucket", f"{base}_sum", f"{base}_count"] if kind == "histogram" else [base]


def prometheus_label(key: str) -> str:
    label = re.sub(r"[^a-zA-Z0-9_]", "_", key)
    if label[:1].isdigit():
        return f"key_{label}"
    if label.startswith("_") and not label.startswith("__"):
        return f"key{label}"
    return label


@pytest.mark.parametrize(
    ("name", "unit", "kind", "expected"),
    [  # the examples in otlptranslator's own documentation, and the cases the SDK's names hit
        ("http.server.duration", "s", "histogram", "http_server_duration_seconds"),
        ("requests.count", "1", "counter", "requests_count_total"),
        ("memory.usage", "By", "gauge", "memory_usage_bytes"),
        ("gen_ai.client.token.usage", "{token}", "histogram", "gen_ai_client_token_usage"),
        ("llmspans.connect.new", "{connection}", "counter", "llmspans_connect_new_total"),
        ("foo.duration.seconds", "s", "histogram", "foo_duration_seconds"),
        ("queue.total", "{item}", "counter", "queue_total"),
        ("cpu.utilization", "1", "gauge", "cpu_utilization_ratio"),
        ("net.io", "By/s", "gauge", "net_io_bytes_per_second"),
        ("in.flight", "{request}", "updowncounter", "in_flight"),
    ],
)
def test_the_translation_rules(name: str, unit: str, kind: str, expected: str) -> None:
    assert prometheus_name(name, unit, kind) == expected


def test_prometheus_uses_the_encoded_translation_strategy() -> None:
    config = load(INTEGRATIONS / "prometheus" / "prometheus.yml")
    assert config.get("otlp", {}).get("translation_strategy", TRANSLATION_STRATEGY) == TRANSLATION_STRATEGY


# ----------------------------------------------------------------------------------------------
# What the SDK emits, by running it


@dataclass
class Emitted:
    """Series name -> the labels the SDK puts on it, and the values seen per label."""

    labels: dict[str, set[str]] = field(default_factory=dict)
    values: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    kinds: dict[str, tuple[str, str, str]] = field(
        default_factory=dict
    )  # otel name -> (unit, kind, prom base)
    span_attributes: dict[str, set[str]] = field(default_factory=dict)
    resource_attributes: set[str] = field(default_factory=set)


def _kind(metric: Any) -> str:
    data = metric.WhichOneof("data")
    if data == "sum":
        return "counter" if metric.sum.is_monotonic else "updowncounter"
    return {"gauge": "gauge", "histogram": "histogram"}.get(data, data)


def _value(any_value: Any) -> str:
    """An attribute's value as a Prometheus label's: a boolean is `true` or `false`."""
    kind = any_value.WhichOneof("value") or "string_value"
    value = getattr(any_value, kind)
    return ("true" if value else "false") if kind == "bool_value" else str(value)


@pytest.fixture(scope="module")
def sdk() -> Emitted:
    """What tests/support/workload.py's run emitted (every span, attribute and metric the package has)."""
    run = exercise()
    request, spans = run.metrics, run.spans
    emitted = Emitted()
    for resource_metrics in request.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                kind = _kind(metric)
                emitted.kinds[metric.name] = (
                    metric.unit,
                    kind,
                    prometheus_name(metric.name, metric.unit, kind),
                )
                points = getattr(metric, metric.WhichOneof("data")).data_points
                for series in prometheus_series(metric.name, metric.unit, kind):
                    labels = emitted.labels.setdefault(series, set(RESOURCE_LABELS))
                    if series.endswith("_bucket"):
                        labels.add("le")
                    for point in points:
                        for attribute in point.attributes:
                            label = prometheus_label(attribute.key)
                            labels.add(label)
                            emitted.values.setdefault((series, label), set()).add(_value(attribute.value))
    for span in spans:
        for key, value in (span.attributes or {}).items():
            emitted.span_attributes.setdefault(key, set()).add(str(value))
        emitted.resource_attributes.update(span.resource.attributes)
    return emitted


def test_the_sdk_run_covers_every_metric_of_the_design(sdk: Emitted) -> None:
    """Guard for the fixture: a metric the package defines that the run does not produce would hollow the
    checks (the run samples a vLLM simulator, so the `vllm.*` gauges are among them)."""
    expected = {
        value
        for key, value in vars(names).items()
        if key.startswith("METRIC_")
        and not key.startswith("METRIC_ATTR")
        and value.startswith(("gen_ai.", "llmspans.", "vllm."))
    }
    assert len(expected) >= 16
    assert expected <= set(sdk.kinds), sorted(expected - set(sdk.kinds))


# ----------------------------------------------------------------------------------------------
# Reading the files


def load(path: Path) -> Any:
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)


def config_files() -> list[Path]:
    return sorted(
        p for p in INTEGRATIONS.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml", ".json")
    )


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE_FILE)


def dashboards() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, load(p)) for p in sorted((INTEGRATIONS / "grafana" / "dashboards").glob("*.json"))]


def walk(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every (path, value) in a parsed YAML/JSON document, leaves and containers alike."""
    yield path, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from walk(value, (*path, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from walk(value, (*path, index))


def test_every_file_under_integrations_parses() -> None:
    files = config_files()
    assert len(files) >= 8, files
    for path in files:
        assert load(path) is not None, path
    others = [p for p in INTEGRATIONS.rglob("*") if p.is_file() and p not in files and p.suffix != ".md"]
    assert not others, f"unexpected files (only YAML, JSON and Markdown live here): {others}"


# ----------------------------------------------------------------------------------------------
# Images


IMAGE = re.compile(
    r"^(?P<repository>[a-z0-9][a-z0-9./_-]*):(?P<tag>v?(?P<major>\d+)\.\d+\.\d+)(@sha256:[0-9a-f]{64})?$"
)
EXPECTED_IMAGES = {
    "otel-collector": "otel/opentelemetry-collector-contrib",
    "jaeger": "jaegertracing/jaeger",
    "tempo": "grafana/tempo",
    "prometheus": "prom/prometheus",
    "grafana": "grafana/grafana",
}


def image_of(compose: dict[str, Any], service: str) -> re.Match[str]:
    image = compose["services"][service]["image"]
    match = IMAGE.match(image)
    assert match, f"{service}: image {image!r} is not pinned to a version (no `latest`, no bare name)"
    return match


def test_every_image_is_pinned(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == set(EXPECTED_IMAGES)
    for service, repository in EXPECTED_IMAGES.items():
        match = image_of(compose, service)
        assert match["repository"] == repository, service
        assert "latest" not in compose["services"][service]["image"]
    assert image_of(compose, "jaeger")["major"] == "2", "Jaeger v2 (the OTLP-native one) is expected"


def test_tempo_config_matches_the_pinned_major_version(compose: dict[str, Any]) -> None:
    tempo = load(INTEGRATIONS / "tempo" / "tempo.yaml")
    major = int(image_of(compose, "tempo")["major"])
    if major >= 3:  # Tempo 3.0 removed these blocks and refuses a config that has them
        assert not {"ingester", "compactor", "ingester_client", "metrics_generator_client"} & set(tempo)
    else:
        assert {"ingester", "compactor"} <= set(tempo)
    assert "span-metrics" in tempo["overrides"]["defaults"]["metrics_generator"]["processors"]


# ----------------------------------------------------------------------------------------------
# Mounts, networks, ports


def mounts(compose: dict[str, Any], service: str) -> list[tuple[Path, str]]:
    """(host path, container path) of the bind mounts of one service."""
    found = []
    for volume in compose["services"][service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            found.append(((ROOT / source).resolve(), target))
    return found


def files_of(compose: dict[str, Any], service: str) -> list[Path]:
    paths: list[Path] = []
    for source, _ in mounts(compose, service):
        paths += [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    return [p for p in paths if p.suffix in (".yaml", ".yml", ".json")]


def test_every_config_is_mounted_into_a_service(compose: dict[str, Any]) -> None:
    for service in compose["services"]:
        for source, _ in mounts(compose, service):
            assert source.exists(), f"{service} mounts {source}, which does not exist"
    mounted = {path for service in compose["services"] for path in files_of(compose, service)}
    assert set(config_files()) == mounted, sorted(set(config_files()) ^ mounted)


def test_every_service_is_on_the_compose_network(compose: dict[str, Any]) -> None:
    (network,) = compose["networks"]
    for service, spec in compose["services"].items():
        assert "network_mode" not in spec, service
        assert spec.get("networks") == [network], service
        for dependency in spec.get("depends_on", []):
            assert dependency in compose["services"], (service, dependency)


PUBLISHED = {  # only the UIs, the query APIs the report reads and OTLP leave the compose network
    "otel-collector": {4317, 4318},
    "jaeger": {16686},
    "tempo": {3200},
    "grafana": {3000},
    "prometheus": {9090},
}


def published(compose: dict[str, Any], service: str) -> dict[int, int]:
    """Host port -> container port; every one bound to 127.0.0.1."""
    found = {}
    for entry in compose["services"][service].get("ports", []):
        host_ip, host_port, container_port = str(entry).split(":")
        assert host_ip == "127.0.0.1", f"{service} publishes {entry} beyond this machine"
        found[int(host_port)] = int(container_port)
    return found


def exposed(compose: dict[str, Any], service: str) -> set[int]:
    return {int(port) for port in compose["services"][service].get("expose", [])} | set(
        published(compose, service).values()
    )


_HOST_PORT = re.compile(
    r"(?:(?P<scheme>[a-z][a-z0-9+.-]*)://)?(?P<host>\[[0-9a-f:]*\]|[A-Za-z0-9_.-]*):(?P<port>\d{2,5})\b"
)
_BIND_HOSTS = {"0.0.0.0", "", "[::]"}
_LOCAL_HOSTS = {"localhost", "127.0.0.1"}
_LISTENING_SECTIONS = {"receivers", "extensions"}  # Collector-style configs (the collector, Jaeger v2, Tempo)


@dataclass
class Network:
    listens: dict[str, dict[int, str]] = field(default_factory=dict)  # service -> port -> bind host
    references: list[tuple[str, Path, str, int]] = field(default_factory=list)  # from, file, host, port
    browser_references: list[tuple[Path, int]] = field(default_factory=list)


def read_network(compose: dict[str, Any]) -> Network:
    network = Network()
    dashboard_dir = (INTEGRATIONS / "grafana" / "dashboards").resolve()
    for service, spec in compose["services"].items():
        listens = network.listens.setdefault(service, {})
        for argument in spec.get("command", []) if isinstance(spec.get("command"), list) else []:
            if argument.startswith("--web.listen-address="):
                host, _, port = argument.split("=", 1)[1].rpartition(":")
                listens[int(port)] = host
        if "GF_SERVER_HTTP_PORT" in spec.get("environment", {}):
            listens[int(spec["environment"]["GF_SERVER_HTTP_PORT"])] = ""
        for path in files_of(compose, service):
            document = load(path)
            for key_path, value in walk(document):
                key = key_path[-1] if key_path else None
                if isinstance(key, str) and key.endswith("listen_port"):
                    listens[int(value)] = ""
                elif isinstance(value, dict) and {"host", "port"} <= set(value) and "prometheus" in key_path:
                    listens[int(value["port"])] = str(value["host"])  # a Collector telemetry pull reader
                elif isinstance(value, str):
                    in_listener = bool(key_path) and (
                        key_path[0] in _LISTENING_SECTIONS or key_path[:2] == ("distributor", "receivers")
                    )
                    for match in _HOST_PORT.finditer(value):
                        host, port = match["host"], int(match["port"])
                        if in_listener and key == "endpoint":
                            listens[port] = host
                        elif path.resolve().parent == dashboard_dir and host in _LOCAL_HOSTS:
                            network.browser_references.append((path, port))
                        else:
                            network.references.append((service, path, host, port))
    return network


def test_every_host_and_port_a_config_names_is_a_listening_compose_service(compose: dict[str, Any]) -> None:
    network = read_network(compose)
    assert network.references, "no cross-service reference found: the scan is broken"
    for source, path, host, port in network.references:
        where = f"{path.relative_to(ROOT)} (mounted into {source}) names {host}:{port}"
        target = source if host in _LOCAL_HOSTS else host
        assert target in compose["services"], f"{where}: {host} is not a compose service"
        assert port in network.listens[target], (
            f"{where}: {target} listens on {sorted(network.listens[target])}"
        )
        if target != source:
            assert port in exposed(compose, target), f"{where}: {target} does not expose {port}"
            bind = network.listens[target][port]
            assert bind in _BIND_HOSTS, f"{where}: {target} binds {bind}:{port}, unreachable from {source}"
    for path, port in network.browser_references:
        assert port in {p for s in compose["services"] for p in published(compose, s)}, (path, port)


def test_only_the_uis_and_otlp_are_published_and_everything_exposed_is_listened_on(
    compose: dict[str, Any],
) -> None:
    network = read_network(compose)
    for service in compose["services"]:
        ports = published(compose, service)
        assert set(ports) == PUBLISHED.get(service, set()), service
        assert all(host == container for host, container in ports.items()), service
        for port in exposed(compose, service):
            assert port in network.listens[service], (
                f"{service} exposes {port} but listens on {network.listens[service]}"
            )
    assert network.listens["otel-collector"][4317] in _BIND_HOSTS
    assert network.listens["otel-collector"][4318] in _BIND_HOSTS


def doc_section(page: str, title: str) -> str:
    """One `## title` section of a documentation page (docs/PAGE), up to the next `## `."""
    text = (DOCS / page).read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_the_docs_name_only_published_ports(compose: dict[str, Any]) -> None:
    text = doc_section("backends.md", "The local stack") + doc_section(
        "backends.md", "The per-stage budget dashboard"
    )
    ports = {int(port) for port in re.findall(r"localhost:(\d+)", text)}
    assert {4318, 16686, 3000} <= ports
    all_published = {p for s in compose["services"] for p in published(compose, s)}
    assert ports <= all_published, sorted(ports - all_published)
    assert "docker compose up" in text
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://localhost:4318" in text
    assert "anonymous" in text
    assert "read-only" in text


# ----------------------------------------------------------------------------------------------
# The pipelines


def check_collector_pipelines(config: dict[str, Any]) -> None:
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for pipeline in config["service"]["pipelines"].values():
        for section in used:
            used[section].update(pipeline.get(section, []))
    for section, components in used.items():
        assert components == set(config.get(section) or {}), (
            section,
            components,
            set(config.get(section) or {}),
        )
    assert set(config["service"].get("extensions", [])) == set(config.get("extensions") or {})


def test_the_collector_fans_traces_to_jaeger_and_tempo_and_metrics_to_prometheus(
    compose: dict[str, Any],
) -> None:
    collector = load(INTEGRATIONS / "otel-collector" / "config.yaml")
    check_collector_pipelines(collector)
    exporters = collector["exporters"]

    def host(exporter: dict[str, Any]) -> str:
        found = _HOST_PORT.search(exporter.get("endpoint") or exporter["metrics_endpoint"])
        assert found
        return found["host"]

    destinations = {
        signal: {host(exporters[name]) for name in pipeline["exporters"]}
        for signal, pipeline in collector["service"]["pipelines"].items()
    }
    assert destinations == {"traces": {"jaeger", "tempo"}, "metrics": {"prometheus"}}
    assert collector["service"]["pipelines"]["traces"]["processors"][0] == "memory_limiter"
    assert collector["service"]["pipelines"]["metrics"]["processors"][0] == "memory_limiter"
    assert not [name for name in exporters if name.split("/")[0] in ("otlp", "otlphttp")], (
        "deprecated aliases"
    )
    prometheus_exporter = exporters["otlp_http/prometheus"]["metrics_endpoint"]
    assert prometheus_exporter.endswith("/api/v1/otlp/v1/metrics")
    assert "--web.enable-otlp-receiver" in compose["services"]["prometheus"]["command"]


def test_the_collector_drops_the_server_spans_of_a_trace_llmspans_dropped() -> None:
    """vLLM's llm_request spans of a trace llmspans' tail sampling dropped: only a trace with an exported
    llmspans span (it carries the weight) or with something besides vLLM's span is kept."""
    collector = load(INTEGRATIONS / "otel-collector" / "config.yaml")
    processors = collector["service"]["pipelines"]["traces"]["processors"]
    assert processors == ["memory_limiter", "tail_sampling/llmspans", "batch"]
    rule = collector["processors"]["tail_sampling/llmspans"]
    conditions = {
        policy["name"]: policy["ottl_condition"]["span"]
        for policy in rule["policies"]
        if policy["type"] == "ottl_condition"
    }
    assert len(conditions) == len(rule["policies"]) == 2  # either keeps the trace: OR
    assert conditions["kept-by-llmspans"] == [f'attributes["{names.SAMPLE_WEIGHT}"] != nil']
    assert conditions["not-only-vllm-server-spans"] == [f'name != "{names.VLLM_SERVER_SPAN}"']
    assert rule["decision_wait"] == "30s"
    assert "tail_sampling" not in collector["service"]["pipelines"]["metrics"]["processors"]


def test_jaeger_stores_what_it_receives() -> None:
    jaeger = load(INTEGRATIONS / "jaeger" / "config.yaml")
    check_collector_pipelines(jaeger)
    storage = jaeger["exporters"]["jaeger_storage_exporter"]["trace_storage"]
    assert storage in jaeger["extensions"]["jaeger_storage"]["backends"]
    assert jaeger["extensions"]["jaeger_query"]["storage"]["traces"] == storage


def test_tempo_remote_writes_span_metrics_to_prometheus(compose: dict[str, Any], sdk: Emitted) -> None:
    tempo = load(INTEGRATIONS / "tempo" / "tempo.yaml")
    (remote_write,) = tempo["metrics_generator"]["storage"]["remote_write"]
    assert remote_write["url"] == "http://prometheus:9090/api/v1/write"
    assert remote_write.get("send_exemplars") is True
    command = compose["services"]["prometheus"]["command"]
    assert "--web.enable-remote-write-receiver" in command
    assert "--enable-feature=exemplar-storage" in command
    for dimension in tempo["metrics_generator"]["processor"]["span_metrics"]["dimensions"]:
        assert dimension in sdk.span_attributes, (
            f"Tempo dimension {dimension!r} is not a span attribute the SDK sets"
        )


def test_prometheus_loads_the_mounted_rules(compose: dict[str, Any]) -> None:
    prometheus = load(INTEGRATIONS / "prometheus" / "prometheus.yml")
    targets = {target: source for source, target in mounts(compose, "prometheus")}
    rule_files = []
    for pattern in prometheus["rule_files"]:
        directory, _, glob = pattern.rpartition("/")
        assert directory in targets, pattern
        rule_files += sorted(targets[directory].glob(glob))
    assert rule_files == sorted((INTEGRATIONS / "prometheus" / "rules").glob("*.yml"))


# ----------------------------------------------------------------------------------------------
# Grafana: provisioning and data sources


def provisioned_datasources() -> dict[str, dict[str, Any]]:
    documents = [
        load(p) for p in sorted((INTEGRATIONS / "grafana" / "provisioning" / "datasources").glob("*.yaml"))
    ]
    return {source["uid"]: source for document in documents for source in document["datasources"]}


def test_grafana_is_provisioned_and_anonymous_read_only(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    environment = grafana["environment"]
    assert environment["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert environment["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    targets = {target: source for source, target in mounts(compose, "grafana")}
    assert (
        targets["/etc/grafana/provisioning/datasources"]
        == INTEGRATIONS / "grafana" / "provisioning" / "datasources"
    )
    assert (
        targets["/etc/grafana/provisioning/dashboards"]
        == INTEGRATIONS / "grafana" / "provisioning" / "dashboards"
    )
    (provider,) = load(INTEGRATIONS / "grafana" / "provisioning" / "dashboards" / "llmspans.yaml")[
        "providers"
    ]
    assert provider["type"] == "file"
    assert provider["allowUiUpdates"] is False
    assert targets[provider["options"]["path"]] == INTEGRATIONS / "grafana" / "dashboards"
    home = environment["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (targets[home.rpartition("/")[0]] / home.rpartition("/")[2]).is_file()
    sources = provisioned_datasources()
    assert {source["type"] for source in sources.values()} == {"prometheus", "tempo", "jaeger"}
    assert all(source["editable"] is False for source in sources.values())


def used_datasources() -> Iterator[tuple[str, str | None, str]]:
    """(uid, type or None, where) of every data source the dashboards and provisioning refer to."""
    for path, dashboard in dashboards():
        for key_path, value in walk(dashboard):
            builtin = isinstance(value, dict) and value.get("uid") == "-- Grafana --"
            if key_path and key_path[-1] == "datasource" and isinstance(value, dict) and not builtin:
                yield value["uid"], value.get("type"), f"{path.name} {key_path}"
            if key_path and key_path[-1] == "internal" and isinstance(value, dict):
                yield value["datasourceUid"], None, f"{path.name} {key_path}"
    for uid, source in provisioned_datasources().items():
        for key_path, value in walk(source.get("jsonData", {})):
            if key_path and key_path[-1] == "datasourceUid":
                yield value, None, f"data source {uid} {key_path}"


def test_every_data_source_used_is_provisioned() -> None:
    sources = provisioned_datasources()
    used = list(used_datasources())
    assert {"prometheus", "tempo"} <= {uid for uid, _, _ in used}
    for uid, kind, where in used:
        assert uid in sources, f"{where}: data source {uid!r} is not provisioned"
        assert kind in (None, sources[uid]["type"]), (
            f"{where}: {uid!r} is a {sources[uid]['type']}, not {kind}"
        )


def test_exemplars_link_to_the_traces() -> None:
    prometheus = provisioned_datasources()["prometheus"]["jsonData"]
    destinations = {d["name"]: d["datasourceUid"] for d in prometheus["exemplarTraceIdDestinations"]}
    tempo = load(INTEGRATIONS / "tempo" / "tempo.yaml")
    tempo_label = (
        tempo["overrides"]["defaults"]["metrics_generator"].get("trace_id_label_name") or "traceID"
    )  # Tempo's default
    # Prometheus' OTLP receiver calls the exemplar label `trace_id`; Tempo's span metrics use `traceID`.
    assert destinations == {"trace_id": "tempo", tempo_label: "tempo"}
    for _, dashboard in dashboards():
        histogram_targets = [
            target
            for _, target in walk(dashboard)
            if isinstance(target, dict) and re.search(r"\w_bucket[{\[]", target.get("expr", ""))
        ]
        range_targets = [t for t in histogram_targets if not t.get("instant")]
        assert range_targets
        assert all(t["exemplar"] is True for t in range_targets)


# ----------------------------------------------------------------------------------------------
# PromQL: which metrics and labels each query uses


_PROMQL_TOKEN = re.compile(
    r"""(?P<ws>\s+)|(?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)|(?P<range>\[[^\]]*\])"""
    r"""|(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)"""
    r"""|(?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}])"""
)
_AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
}  # fmt: skip
_GROUPING = {"by", "without"}
_MATCHING = {"on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _GROUPING | _MATCHING | {"bool", "offset", "and", "or", "unless", "atan2", "inf", "nan"}


@dataclass
class Selector:
    metric: str
    matchers: list[tuple[str, str, str]]  # label, operator, value (unquoted)
    position: int


@dataclass
class PromQuery:
    text: str
    where: str
    selectors: list[Selector] = field(default_factory=list)
    grouped: list[tuple[set[str], list[Selector]]] = field(
        default_factory=list
    )  # labels, selectors they apply to


def _closing(tokens: list[tuple[str, str]], start: int) -> int:
    depth = 0
    for index in range(start, len(tokens)):
        depth += {"(": 1, ")": -1}.get(tokens[index][1], 0)
        if depth == 0:
            return index
    raise AssertionError("unbalanced parentheses")


def _label_list(tokens: list[tuple[str, str]], start: int) -> tuple[set[str], int]:
    end = _closing(tokens, start)
    return {text for kind, text in tokens[start + 1 : end] if kind == "ident"}, end


def parse_promql(text: str, where: str) -> PromQuery:
    tokens = [(m.lastgroup or "", m.group()) for m in _PROMQL_TOKEN.finditer(text) if m.lastgroup != "ws"]
    assert "".join(t for _, t in tokens) == re.sub(r"\s+", "", text), (
        f"{where}: PromQL not understood: {text}"
    )
    query = PromQuery(text, where)
    aggregations: list[tuple[set[str], int, int]] = []  # labels, argument start, argument end
    matching: set[str] = set()
    index = 0
    while index < len(tokens):
        kind, token = tokens[index]
        following = tokens[index + 1][1] if index + 1 < len(tokens) else ""
        if kind == "ident" and token in _AGGREGATIONS and following in ("(", *_GROUPING):
            labels: set[str] = set()
            cursor = index + 1
            if tokens[cursor][1] in _GROUPING:
                labels, cursor = _label_list(tokens, cursor + 1)
                cursor += 1
            end = _closing(tokens, cursor)
            if end + 1 < len(tokens) and tokens[end + 1][1] in _GROUPING:
                more, _ = _label_list(tokens, end + 2)
                labels |= more
            aggregations.append((labels, cursor, end))
        elif kind == "ident" and token in _GROUPING | _MATCHING and following == "(":
            found, end = _label_list(tokens, index + 1)
            if token in _MATCHING:
                matching |= found
            index = end
        elif kind == "ident" and token not in _KEYWORDS and following != "(":
            selector = Selector(token, [], index)
            if following == "{":
                end = tokens.index((("op", "}")), index + 1)
                inner = tokens[index + 2 : end]
                for cursor in range(0, len(inner), 4):
                    label, operator, value = inner[cursor][1], inner[cursor + 1][1], inner[cursor + 2][1]
                    selector.matchers.append((label, operator, value[1:-1]))
                index = end
            query.selectors.append(selector)
        elif token == "{":
            raise AssertionError(f"{where}: a selector without a metric name is not supported here: {text}")
        index += 1
    for labels, start, end in aggregations:
        query.grouped.append((labels, [s for s in query.selectors if start < s.position < end]))
    if matching:
        query.grouped.append((matching, list(query.selectors)))
    return query


_GRAFANA_RANGES = re.compile(
    r"\$(?:__rate_interval|__interval|__range)\b|\$\{(?:__rate_interval|__interval|__range)\}"
)


def grafana_promql(text: str, tags: dict[str, str] | None = None) -> str:
    """A Grafana query as Prometheus would receive it (variables filled in with harmless values)."""
    text = text.replace("$$", "$")  # provisioning files escape `$`
    if tags is not None:
        text = text.replace("$__tags", ", ".join(f'{label}="x"' for label in tags.values()))
    return _GRAFANA_RANGES.sub("5m", text)


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>[a-zA-Z_][a-zA-Z0-9_]*)\)$")


def dashboard_queries() -> list[PromQuery]:
    queries = []
    for path, dashboard in dashboards():
        for key_path, value in walk(dashboard):
            if isinstance(value, dict) and "expr" in value:
                queries.append(parse_promql(grafana_promql(value["expr"]), f"{path.name} {key_path}"))
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query" or variable["datasource"]["type"] != "prometheus":
                continue
            text = variable["query"] if isinstance(variable["query"], str) else variable["query"]["query"]
            assert text == variable["definition"]
            found = _LABEL_VALUES.match(text)
            assert found, f"{path.name} variable {variable['name']}: {text}"
            query = parse_promql(
                grafana_promql(found["selector"]), f"{path.name} variable {variable['name']}"
            )
            query.grouped.append(({found["label"]}, list(query.selectors)))
            queries.append(query)
    return queries


def provisioning_queries() -> list[PromQuery]:
    queries = []
    for uid, source in provisioned_datasources().items():
        traces_to_metrics = source.get("jsonData", {}).get("tracesToMetrics")
        if traces_to_metrics:
            tags = {tag["key"]: tag.get("value", tag["key"]) for tag in traces_to_metrics["tags"]}
            for entry in traces_to_metrics["queries"]:
                queries.append(
                    parse_promql(grafana_promql(entry["query"], tags), f"data source {uid} tracesToMetrics")
                )
    return queries


def rule_queries() -> tuple[list[PromQuery], dict[str, set[str]]]:
    """The rules' queries, and the series the recording rules define with the labels they keep."""
    queries, recorded = [], {}
    for path in sorted((INTEGRATIONS / "prometheus" / "rules").glob("*.yml")):
        for group in load(path)["groups"]:
            for rule in group["rules"]:
                query = parse_promql(rule["expr"], f"{path.name} {rule.get('record') or rule.get('alert')}")
                queries.append(query)
                if "record" in rule:
                    kept = set().union(*(labels for labels, _ in query.grouped)) - {"le"}
                    recorded[rule["record"]] = kept
    return queries, recorded


def tempo_span_metrics(sdk: Emitted) -> Emitted:
    """The series Tempo's span-metrics processor remote-writes, from tempo.yaml and the SDK's span attributes."""
    tempo = load(INTEGRATIONS / "tempo" / "tempo.yaml")
    generated = Emitted()
    if "span-metrics" not in tempo["overrides"]["defaults"]["metrics_generator"]["processors"]:
        return generated
    dimensions = tempo["metrics_generator"]["processor"]["span_metrics"].get("dimensions", [])
    external = tempo["metrics_generator"].get("registry", {}).get("external_labels", {})
    labels = {"service", "span_name", "span_kind", "status_code", *external}
    labels |= {re.sub(r"[^a-zA-Z0-9_]", "_", dimension) for dimension in dimensions}
    histogram = [
        "traces_spanmetrics_latency_bucket",
        "traces_spanmetrics_latency_sum",
        "traces_spanmetrics_latency_count",
    ]
    for series in [*histogram, "traces_spanmetrics_calls_total", "traces_spanmetrics_size_total"]:
        generated.labels[series] = labels | ({"le"} if series.endswith("_bucket") else set())
        for dimension in dimensions:
            label = re.sub(r"[^a-zA-Z0-9_]", "_", dimension)
            generated.values[(series, label)] = sdk.span_attributes.get(dimension, set())
    return generated


def check_queries(queries: list[PromQuery], known: Emitted, recorded: dict[str, set[str]]) -> list[str]:
    problems = []
    for query in queries:
        for selector in query.selectors:
            labels = known.labels.get(selector.metric, recorded.get(selector.metric))
            if labels is None:
                problems.append(
                    f"{query.where}: {selector.metric} is not a series the SDK (or Tempo) produces"
                )
                continue
            for label, operator, value in selector.matchers:
                if label not in labels:
                    problems.append(
                        f"{query.where}: {selector.metric} has no label {label} (it has {sorted(labels)})"
                    )
                seen = known.values.get((selector.metric, label))
                if operator == "=" and "$" not in value and seen is not None and value not in seen:
                    problems.append(
                        f"{query.where}: {selector.metric}{{{label}={value!r}}} never happens ({seen})"
                    )
        for grouping, selectors in query.grouped:
            for selector in selectors:
                labels = known.labels.get(selector.metric, recorded.get(selector.metric, set()))
                for label in sorted(grouping - labels):
                    problems.append(
                        f"{query.where}: groups {selector.metric} by {label}, which it does not have"
                    )
    return problems


def known_series(sdk: Emitted) -> Emitted:
    known = Emitted()
    sources = [sdk, tempo_span_metrics(sdk)]
    for source in sources:
        known.labels.update(source.labels)
        known.values.update(source.values)
    return known


def test_every_metric_and_label_queried_is_one_the_sdk_emits(sdk: Emitted) -> None:
    rules, recorded = rule_queries()
    queries = dashboard_queries() + provisioning_queries() + rules
    problems = check_queries(queries, known_series(sdk), recorded)
    assert not problems, "\n".join(problems)
    queried = {s.metric for q in queries for s in q.selectors}
    assert len(queried) >= 12, queried


def test_the_check_catches_a_wrong_name_label_or_value(sdk: Emitted) -> None:
    known = known_series(sdk)
    bad = [
        parse_promql('rate(llmspans_stage_duration_bucket{job="a"}[5m])', "no unit suffix"),
        parse_promql("sum by (model) (rate(llmspans_bucket_duration_seconds_count[5m]))", "wrong label"),
        parse_promql('llmspans_bucket_duration_seconds_count{llmspans_bucket="decode"}', "wrong value"),
        parse_promql("llmspans_retry_attempts[5m]", "counter without _total"),
        parse_promql("gen_ai_client_token_usage_tokens_bucket", "curly unit made a suffix"),
        parse_promql(
            'llmspans_cache_lookups_total{llmspans_cache_hit="True"}', "a boolean as Python spells it"
        ),
    ]
    problems = check_queries(bad, known, {})
    assert len(problems) == 6, problems


def test_limiter_panels_match_the_sdk(sdk: Emitted) -> None:
    queried = {
        s.metric for q in dashboard_queries() for s in q.selectors if s.metric.startswith("llmspans_limiter_")
    }
    assert queried
    assert queried <= set(sdk.labels)


# ----------------------------------------------------------------------------------------------
# The dashboard: what it must show


def all_queries_text(dashboard: dict[str, Any]) -> str:
    return "\n".join(v["expr"] for _, v in walk(dashboard) if isinstance(v, dict) and "expr" in v)


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found += panel.get("panels", [])
    return found


def test_the_dashboard_shows_what_the_issue_asks_for(sdk: Emitted) -> None:
    (_path, dashboard), *_ = dashboards()
    assert dashboard["uid"]
    assert dashboard["editable"] is False
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"service", "model", "lane"} <= set(variables)
    queries = all_queries_text(dashboard)
    stage = sdk.kinds[names.METRIC_STAGE_DURATION][2]
    budget = sdk.kinds[names.METRIC_STAGE_BUDGET][2]
    bucket = sdk.kinds[names.METRIC_BUCKET_DURATION][2]

    # per stage p50/p95/p99 against the budget gauge, in one panel repeated per stage
    def quantiles(panel: dict[str, Any]) -> set[str]:
        exprs = [t["expr"] for t in panel.get("targets", []) if f"{stage}_bucket" in t.get("expr", "")]
        return {q for e in exprs for q in re.findall(r"histogram_quantile\((0\.\d+)", e)}

    assert any(
        {"0.5", "0.95", "0.99"} <= quantiles(p)
        and any(t["expr"].startswith("max by (job) (" + budget) for t in p["targets"])
        and p.get("repeat") == "stage"
        for p in panels(dashboard)
    ), "no panel with p50/p95/p99 of a stage against its budget gauge"
    assert not re.search(rf"{stage}_bucket[^\n]*[<>]=?\s*\d", queries), "budgets are not hard-coded"
    # buckets stacked at p95 per model
    stacked = [
        p for p in panels(dashboard)
        if any(f"{bucket}_bucket" in t.get("expr", "") and "llmspans_bucket" in t["expr"] for t in p.get("targets", []))
        and p["fieldConfig"]["defaults"].get("custom", {}).get("stacking", {}).get("mode") == "normal"
    ]  # fmt: skip
    assert stacked
    assert stacked[0].get("repeat") == "model"
    for name in (
        names.METRIC_TIME_TO_FIRST_CHUNK, names.METRIC_TIME_PER_OUTPUT_CHUNK, names.METRIC_TOKEN_USAGE,
        names.METRIC_RETRY_ATTEMPTS, names.METRIC_BUDGET_EXCEEDED, names.METRIC_CONNECT_NEW,
    ):  # fmt: skip
        assert sdk.kinds[name][2] in queries, name
    assert "by (llmspans_retry_cause)" in queries
    assert "by (llmspans_stage) (increase(llmspans_budget_exceeded_total" in queries
    for name in (names.METRIC_LIMITER_IN_FLIGHT, names.METRIC_LIMITER_QUEUE_DEPTH, names.METRIC_LIMITER_CAP):
        assert f"by (llmspans_limiter_name) ({prometheus_name(name, '{request}', 'gauge')}{{" in queries
    # the levers (issue 26): each cache's hit rate and time saved, the first_token over the prompt cap and under
    lookups = sdk.kinds[names.METRIC_CACHE_LOOKUPS][2]
    assert (
        f'sum by (llmspans_cache_name) (rate({lookups}{{job=~"$service", llmspans_cache_hit="true"}}'
        in queries
    )
    assert sdk.kinds[names.METRIC_CACHE_SAVED_ESTIMATE][2] + "_sum" in queries
    assert f"sum by (le, llmspans_prompt_over_cap) (rate({bucket}_bucket" in queries
    # hedged requests: fired and won per model, and the wasted input tokens against all input tokens
    for name in (names.METRIC_HEDGE_FIRED, names.METRIC_HEDGE_BACKUP_WON):
        assert f"sum by (gen_ai_request_model) (rate({sdk.kinds[name][2]}{{" in queries, name
    wasted = sdk.kinds[names.METRIC_HEDGE_WASTED_TOKENS][2]
    usage = sdk.kinds[names.METRIC_TOKEN_USAGE][2]
    assert re.search(
        rf"rate\({wasted}\{{[^}}]*gen_ai_token_type=\"input\"\}}[^\n]*/ sum by \(gen_ai_request_model\) "
        rf"\(rate\({usage}_sum\{{[^}}]*gen_ai_token_type=\"input\"",
        queries,
    )
    links = [
        link
        for _, link in walk(dashboard)
        if isinstance(link, dict) and ("internal" in link or "16686" in link.get("url", ""))
    ]
    assert any("internal" in link for link in links)
    assert any("16686" in link.get("url", "") for link in links)


_TRACEQL_ATTRIBUTE = re.compile(r"\b(span|resource)\.([a-zA-Z_][a-zA-Z0-9_.]*)")


def test_trace_links_and_trace_queries_name_real_attributes(sdk: Emitted) -> None:
    texts = []
    for _, dashboard in dashboards():
        for _, value in walk(dashboard):
            if isinstance(value, dict) and value.get("queryType") == "traceql":
                texts.append(value["query"])
            if isinstance(value, dict) and "16686/search" in value.get("url", ""):
                tags = re.search(r"tags=(\{.*\})", value["url"])
                for key in json.loads(tags[1]) if tags else {}:
                    assert key in sdk.span_attributes, f"Jaeger link filters on {key!r}, not a span attribute"
    assert texts
    for text in texts:
        for scope, key in _TRACEQL_ATTRIBUTE.findall(text):
            known = sdk.span_attributes if scope == "span" else sdk.resource_attributes
            assert key in known, f"TraceQL {text!r}: {scope}.{key} is never set by the SDK"


def test_every_dashboard_variable_is_defined_and_used() -> None:
    builtins = {"__rate_interval", "__interval", "__range", "__value", "__field", "__all"}
    for path, dashboard in dashboards():
        defined = {v["name"] for v in dashboard["templating"]["list"]}
        text = json.dumps(dashboard["panels"]) + json.dumps(dashboard["links"])
        text += json.dumps([v["query"] for v in dashboard["templating"]["list"]])
        used = set(re.findall(r"\$\{?([a-zA-Z_][a-zA-Z0-9_]*)", text))
        assert used - builtins <= defined, (path.name, used - builtins - defined)
        assert defined <= used, (path.name, defined - used)


# --- a panel's query against a live Prometheus ---------------------------------------------------------


def _panel_query(title: str, legend: str) -> str:
    dashboard = json.loads((INTEGRATIONS / "grafana" / "dashboards" / "llmspans-budgets.json").read_text())
    (panel,) = [p for p in dashboard["panels"] if p.get("title") == title]
    (target,) = [t for t in panel["targets"] if t.get("legendFormat") == legend]
    return str(target["expr"])


def test_output_tokens_per_second_counts_only_streamed_calls_on_a_live_prometheus() -> None:
    """The panel's query as Grafana sends it, on a real Prometheus scraping an app: a model called only
    without streaming shows no line (it used to be +Inf: tokens over no stream time), and a model called
    both ways shows the streamed calls' own decode rate (it used to be overstated by the non-streamed
    calls' tokens)."""
    import time

    from tests.support.prometheus import SCRAPE_INTERVAL_S, cued_app, prometheus_server
    from tests.support.realservers import free_ports

    (port,) = free_ports(1)
    with (
        prometheus_server({"throughput": port}) as prometheus,
        cued_app("tests.support.throughput_app", str(port)) as app,
    ):
        streamed = 'sum(llmspans_stream_output_speed_per_second_count{job="throughput"})'
        prometheus.wait_for(streamed, 3)
        # The window opens now: its first sample is a later scrape, taken before the measured round,
        # so rate() sees that round alone (a first scrape taken mid-warm-up would leak into it).
        opened = time.time()
        time.sleep(2 * SCRAPE_INTERVAL_S)
        app.stdin.write("go\n")
        app.stdin.flush()
        done, _, payload = app.stdout.readline().partition(" ")
        assert done == "done"
        speeds = json.loads(payload)
        prometheus.wait_for(streamed, 6)
        query = _panel_query("Output tokens per second", "{{gen_ai_request_model}} while streaming")
        window = f"{int((time.time() - opened) * 1000)}ms"
        shown = {
            labels["gen_ai_request_model"]: value
            for labels, value in prometheus.query(
                query.replace("$service", "throughput")
                .replace("$model", ".*")
                .replace("$__rate_interval", window)
            )
        }
    assert len(speeds) == 3
    assert set(shown) == {"both"}
    assert shown["both"] == pytest.approx(sum(speeds) / len(speeds), rel=1e-6)


def test_the_dashboard_and_the_docs_name_tempo_as_a_report_source_too(compose: dict[str, Any]) -> None:
    """`llmspans report --tempo` reads Tempo's published query API: the dashboard's trace links and the docs
    say so beside Jaeger, and the dashboard's Tempo link asks exactly the search the report makes."""
    from urllib.parse import parse_qs, unquote, urlsplit

    from llmspans.report._sources.tempo import SEARCH_PATH, traceql_service

    (tempo_port,) = published(compose, "tempo")
    (jaeger_port,) = published(compose, "jaeger")
    dashboard = json.loads((INTEGRATIONS / "grafana" / "dashboards" / "llmspans-budgets.json").read_text())
    for text in (dashboard["description"], doc_section("find-the-bottleneck.md", "From Jaeger and Tempo")):
        assert f"llmspans report --tempo http://localhost:{tempo_port}" in " ".join(text.split()), text
        assert f"--jaeger http://localhost:{jaeger_port}" in " ".join(text.split()), text
    (link,) = [link for link in dashboard["links"] if f"localhost:{tempo_port}" in link["url"]]
    url = urlsplit(link["url"])
    assert (url.port, url.path) == (tempo_port, SEARCH_PATH)
    assert parse_qs(url.query)["q"] == [unquote(traceql_service("${service:text}"))]
    assert "llmspans report --tempo" in link["title"]
