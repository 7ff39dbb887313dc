"""The Grafana dashboard (``docker/grafana/``) cannot drift from the code: every metric its PromQL
queries name is a series a live server exports (read from ``/metrics`` of a real server on the real
engine, after a completion and a chat so labelled series and histograms have samples), every label
they group or match by is one those series carry, it covers every topic the deployment needs, and
its provisioning (data source, dashboard provider, compose mounts) is wired together."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from scripts.render_dashboard import panels_of as all_panels  # every panel, rows' nested ones included
from tests.fakes import make_tokenizer
from tests.server.test_real_server import MODEL, client, tiny_server

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docker" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "mcsd.json"
DATASOURCE = GRAFANA / "provisioning" / "datasources" / "prometheus.yaml"
PROVIDER = GRAFANA / "provisioning" / "dashboards" / "dashboards.yaml"

# Labels Prometheus adds at scrape time (or histogram_quantile reads), not the server.
SCRAPE_LABELS = {"instance", "job", "le", "__name__"}
METRIC = re.compile(r"(?<![\w:])mcsd:[A-Za-z0-9_:]+")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
MATCHER = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)\s*\"")
LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
EQUALS = re.compile(r"([A-Za-z_]\w*)\s*=\s*\"([^\"$]*)\"")


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())




def queries(dash: dict) -> list[tuple[str, str]]:
    """``(where, PromQL)`` of every panel target and every query variable."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in all_panels(dash) for t in p.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]
            out.append((f"variable ${var['name']}", q["query"] if isinstance(q, dict) else q))
    return out


def _code(expr: str) -> str:
    """``expr`` with its string literals emptied (label values are neither metrics nor labels)."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)


def metric_names(expr: str) -> set[str]:
    """The ``mcsd:`` series an expression selects, as written (``_bucket``/``_total``... included: that
    is the name Prometheus stores, so that is what has to exist)."""
    return set(METRIC.findall(_code(expr)))


def label_names(expr: str) -> set[str]:
    """Labels an expression groups, joins or matches by."""
    code = _code(expr)
    names = {n.strip() for group in GROUPING.findall(code) for n in group.split(",") if n.strip()}
    return names | set(MATCHER.findall(code))


def label_values(expr: str) -> set[tuple[str, str]]:
    """``(label, value)`` of the exact-match selectors (``state="used"``): values the series must carry
    (regex matchers may name values a healthy server has not produced yet, like ``error``)."""
    return set(EQUALS.findall(expr))


def missing(names: set[str], exported: set[str]) -> set[str]:
    return names - exported


def exposition(text: str) -> tuple[set[str], set[str], set[tuple[str, str]]]:
    """(sample names, label names, (label, value) pairs) of a Prometheus text exposition. Sample names,
    not family names: PromQL selects ``mcsd:request_success_total`` and ``..._bucket``, never the bare
    family."""
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    return {s.name for s in samples}, {k for s in samples for k in s.labels}, \
        {kv for s in samples for kv in s.labels.items()}


def test_metric_and_label_extraction_catches_a_bogus_name():
    expr = ('histogram_quantile(0.9, sum by (le, method) (rate(mcsd:ttft_seconds_bucket{instance=~"$instance",'
            'finished_reason="mcsd:x"}[$__rate_interval]))) / ignoring(position) mcsd:a:b_total')
    assert metric_names(expr) == {"mcsd:ttft_seconds_bucket", "mcsd:a:b_total"}
    assert label_names(expr) == {"le", "method", "instance", "finished_reason", "position"}
    assert label_values(expr) == {("finished_reason", "mcsd:x")}  # not $instance, not a regex
    exported = {"mcsd:ttft_seconds_bucket", "mcsd:request_success_total"}
    assert missing(metric_names("rate(mcsd:bogus_total[1m])"), exported) == {"mcsd:bogus_total"}
    # a counter's family name is not a series: the query must say _total
    assert missing(metric_names("rate(mcsd:request_success[1m])"), exported) == {"mcsd:request_success"}
    assert not missing(metric_names("rate(mcsd:request_success_total[1m])"), exported)


@pytest.fixture(scope="module")
def live() -> tuple[set[str], set[str], set[tuple[str, str]]]:
    """(sample names, label names, label pairs) a real server exports after one completion and one streamed chat."""
    with tiny_server(make_tokenizer()) as srv:
        oai = client(srv)
        oai.completions.create(model=MODEL, prompt="hello world", max_tokens=8, temperature=0,
                               extra_body={"ignore_eos": True})
        chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=8, stream=True, extra_body={"ignore_eos": True}))
        assert chunks
        text = httpx.get(srv.url + "/metrics").text
    return exposition(text)


def test_every_metric_the_dashboard_queries_is_exported(live):
    exported, _, _ = live
    qs = queries(load_dashboard())
    assert len(qs) > 20
    for where, expr in qs:
        names = metric_names(expr)
        assert names, f"{where}: {expr!r} names no mcsd: metric"
        assert not missing(names, exported), f"{where}: {sorted(missing(names, exported))} not in /metrics"


def test_every_label_the_dashboard_uses_is_exported(live):
    _, labels, pairs = live
    known = labels | SCRAPE_LABELS
    dash = load_dashboard()
    for where, expr in queries(dash):
        assert label_names(expr) <= known, f"{where}: labels {sorted(label_names(expr) - known)} not exported"
        assert label_values(expr) <= pairs, f"{where}: label values {sorted(label_values(expr) - pairs)} not exported"
    for panel in all_panels(dash):
        for t in panel.get("targets", []):
            used = set(LEGEND.findall(t.get("legendFormat", "")))
            assert used <= known, f"panel {panel['title']!r}: legend labels {sorted(used - known)}"


def _panels_with(*metrics: str, title: str = "", fn: str = "") -> list[str]:
    """Titles of panels with a query naming all of ``metrics`` (and ``fn``), whose title has ``title``."""
    found = []
    for panel in all_panels(load_dashboard()):
        for t in panel.get("targets", []):
            if metric_names(t["expr"]) >= set(metrics) and fn in t["expr"] and title.lower() in panel["title"].lower():
                found.append(panel["title"])
    return found


P = "mcsd:"
TOPICS = {
    "request rate": dict(metrics=[P + "request_success_total"], title="request"),
    "errors": dict(metrics=[P + "request_success_total"], title="error"),
    "TTFT percentiles": dict(metrics=[P + "time_to_first_token_seconds_bucket"], fn="histogram_quantile"),
    "inter-token percentiles": dict(metrics=[P + "inter_token_latency_seconds_bucket"], fn="histogram_quantile"),
    "end-to-end percentiles": dict(metrics=[P + "e2e_request_latency_seconds_bucket"], fn="histogram_quantile"),
    "tokens/s": dict(metrics=[P + "generation_tokens_total"], title="tok", fn="rate("),
    "queue depth": dict(metrics=[P + "num_requests_waiting"], title="queue"),
    "KV pool": dict(metrics=[P + "kv_cache_usage_perc"], title="KV"),
    "prefix-cache hit rate": dict(metrics=[P + "prefix_cache_hits_total", P + "prefix_cache_queries_total"]),
    "acceptance overall": dict(metrics=[P + "spec_decode_num_accepted_tokens_total",
                                        P + "spec_decode_num_draft_tokens_total"], title="acceptance"),
    "acceptance by position": dict(metrics=[P + "spec_decode_num_accepted_tokens_per_pos_total"], fn="position"),
    "acceptance by drafter": dict(metrics=[P + "spec_decode_accepted_tokens_by_method_total",
                                           P + "spec_decode_draft_tokens_by_method_total"], fn="method"),
    "speculation budget": dict(metrics=[P + "spec_decode_budget"], title="budget"),
}


@pytest.mark.parametrize("topic", TOPICS)
def test_the_dashboard_covers(topic):
    assert _panels_with(*TOPICS[topic]["metrics"], title=TOPICS[topic].get("title", ""),
                        fn=TOPICS[topic].get("fn", "")), f"no panel for {topic}"


def test_latency_panels_show_percentiles():
    for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        exprs = [t["expr"] for p in all_panels(load_dashboard()) for t in p.get("targets", [])
                 if P + metric + "_bucket" in metric_names(t["expr"])]
        quantiles = {float(q) for e in exprs for q in re.findall(r"histogram_quantile\(\s*([0-9.]+)", e)}
        assert {0.5, 0.99} <= quantiles, f"{metric}: quantiles {sorted(quantiles)}"


def test_dashboard_is_well_formed():
    dash = load_dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in all_panels(dash)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for p in all_panels(dash):
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"panel {p['title']!r} is off the 24-column grid"
        if p["type"] != "row":
            assert p.get("targets"), f"panel {p['title']!r} has no query"
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs)), f"panel {p['title']!r}: refIds repeat"


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


def _mounts(service: dict) -> dict[str, tuple[Path, str]]:
    """container path -> (host path, mode) of a compose service's bind mounts."""
    out = {}
    for vol in service.get("volumes", []):
        src, dst, *mode = vol.split(":")
        out[dst] = ((ROOT / "docker" / src).resolve(), mode[0] if mode else "rw")
    return out


def test_provisioning_wires_the_data_source_and_dashboard_into_compose():
    services = _compose()["services"]
    grafana = services["grafana"]
    image, _, tag = grafana["image"].partition(":")
    assert image.startswith("grafana/") and re.fullmatch(r"\d+\.\d+\.\d+", tag), "pin a Grafana version"
    assert "prometheus" in grafana["depends_on"]
    assert any(str(p).split(":")[-1] == "3000" for p in grafana["ports"])
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "true"

    # data source: the uid every panel uses, pointing at the compose Prometheus
    (ds,) = yaml.safe_load(DATASOURCE.read_text())["datasources"]
    assert ds["type"] == "prometheus"
    uids = {p["datasource"]["uid"] for p in all_panels(load_dashboard()) if "datasource" in p}
    uids |= {t["datasource"]["uid"] for p in all_panels(load_dashboard()) for t in p.get("targets", [])}
    assert uids == {ds["uid"]}
    url = httpx.URL(ds["url"])
    assert url.host in services and any(str(p).split(":")[-1] == str(url.port) for p in services[url.host]["ports"])

    # the provisioning folder and the dashboards folder the provider reads are mounted, read-only
    mounts = _mounts(grafana)
    assert mounts["/etc/grafana/provisioning"] == (GRAFANA / "provisioning", "ro")
    (provider,) = yaml.safe_load(PROVIDER.read_text())["providers"]
    assert provider["type"] == "file"
    assert mounts[provider["options"]["path"]] == (DASHBOARD.parent, "ro")
    home = grafana["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert home == provider["options"]["path"] + "/" + DASHBOARD.name
