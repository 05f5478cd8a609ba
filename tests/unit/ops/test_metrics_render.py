"""The fast text renderer of /metrics writes exactly what prometheus_client writes for the same
snapshot, and the histograms count as Prometheus' do."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ferrymq.broker.stats import LATENCY_BUCKETS_S, FlushStats, Histogram, RequestStats
from ferrymq.ops.metrics import METRICS, Snapshot, render, render_with_client


def full_snapshot() -> Snapshot:
    """A sample of every metric, with label values that need escaping and numbers of every
    kind (small and large integers, fractions, negative)."""
    s = Snapshot()
    odd = ['plain', 'quo"te', 'back\\slash', 'new\nline', '%RETRY%g', 'ünï']
    h = Histogram(LATENCY_BUCKETS_S)
    for v in (0.0001, 0.003, 0.5, 100.0):
        h.observe(v)
    for i, spec in enumerate(METRICS):
        for j, value in enumerate((0, 7, -1, 1_234_567, 2**40, 0.25, 1e-9)):
            labels = tuple(odd[(i + j + k) % len(odd)] + str(j) for k in range(len(spec.labels)))
            if spec.kind == "histogram":
                s.add_histogram(spec.name, labels, h)
            else:
                s.add(spec.name, labels, value)
    return s


def test_render_equals_prometheus_client_byte_for_byte() -> None:
    snap = full_snapshot()
    assert render(snap) == render_with_client(snap)
    assert render(Snapshot()) == render_with_client(Snapshot()) == b""


def test_rendered_text_parses_back_to_every_metric() -> None:
    families = {f.name: f for f in text_string_to_metric_families(render(full_snapshot()).decode())}
    for spec in METRICS:
        name = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
        assert families[name].type == spec.kind
        assert families[name].documentation == spec.help
    quoted = families["ferrymq_queue_end_offset"].samples
    assert {s.labels["topic"][:-1] for s in quoted} >= {'quo"te', 'new\nline', 'back\\slash'}


def test_histogram_counts_like_prometheus() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]  # le: bound included
    assert (h.count, h.sum) == (4, 3.65)


def test_request_and_flush_stats_record_once_per_call() -> None:
    r = RequestStats()
    r.record(0.002, 100, 20)
    r.record(0.2, 50, 0)
    assert (r.count, r.bytes_in, r.bytes_out, r.latency.count) == (2, 150, 20, 2)
    f = FlushStats()
    f.record(0.004, 3)
    assert f.round_size.cumulative()[:3] == [("1.0", 0), ("2.0", 0), ("4.0", 1)]
    assert f.round_seconds.count == 1
