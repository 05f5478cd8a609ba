"""OpenTelemetry over a real broker: producers put W3C trace context into message properties,
consumers continue the trace (push: a child span; pull and simple: receive spans linked to the
producer's), attributes per the messaging semantic conventions; without OpenTelemetry nothing
is added."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from ferrymq import (
    AdminClient,
    AsyncHalfMessageProducer,
    AsyncProducer,
    Broker,
    HalfMessageProducer,
    HalfState,
    LeasedMessage,
    Message,
    Producer,
    PullConsumer,
    PushConsumer,
    SimpleConsumer,
    tracing,
)
from tests.helpers import read_topic, wait_for

pytestmark = pytest.mark.integration

@pytest.fixture
def provider() -> Iterator[TracerProvider]:
    """An SDK provider for FerryMQ's spans during one test (not the process's global provider:
    the other tests of this process must not see trace properties in their messages)."""
    provider = TracerProvider()
    tracing.use_tracer_provider(provider)
    try:
        yield provider
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()


@pytest.fixture
def spans(provider: TracerProvider) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def _one(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = [s for s in exporter.get_finished_spans() if s.name == name]
    assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
    return found[0]


def _traceparent(span: ReadableSpan) -> str:
    ctx = span.get_span_context()
    assert ctx is not None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def test_send_span_is_a_child_of_the_callers_span_and_its_context_travels(
        broker: Broker, provider: TracerProvider, spans: InMemorySpanExporter) -> None:
    tracer = provider.get_tracer("app")
    with tracer.start_as_current_span("checkout") as app, Producer(broker.address) as p:
        msg = Message("orders", b"o-1", properties={"k": "v"})
        result = p.send(msg)
    send = _one(spans, "send orders")
    assert send.kind is SpanKind.PRODUCER
    assert send.parent is not None and send.parent.span_id == app.get_span_context().span_id
    attrs = dict(send.attributes or {})
    assert attrs["messaging.system"] == "ferrymq"
    assert attrs["messaging.destination.name"] == "orders"
    assert attrs["messaging.operation.type"] == "send"
    assert attrs["messaging.operation.name"] == "send"
    assert attrs["messaging.destination.partition.id"] == str(result.queue)
    assert attrs["messaging.message.id"] == result.msg_id
    assert attrs["messaging.message.body.size"] == 3
    with PullConsumer(broker.address, "billing", auto_offset_reset="earliest") as c:
        c.subscribe("orders")
        got: list = []
        wait_for(lambda: bool(got.extend(c.poll(timeout=0.2)) or got))
    (stored,) = got
    assert stored.properties["traceparent"] == _traceparent(send)
    assert stored.properties["k"] == "v"  # the user's properties are kept


def test_push_handler_runs_in_a_process_span_child_of_the_send_span(
        broker: Broker, spans: InMemorySpanExporter) -> None:
    with Producer(broker.address) as p:
        p.send(Message("jobs", b"j-1"))
    seen = threading.Event()
    inside: list[trace.Span] = []
    with PushConsumer(broker.address, "workers") as c:
        @c.subscribe("jobs")
        def handle(msg: LeasedMessage) -> None:
            inside.append(trace.get_current_span())
            seen.set()

        c.start()
        assert seen.wait(10)
    send = _one(spans, "send jobs")
    wait_for(lambda: any(s.name == "process jobs" for s in spans.get_finished_spans()))
    process = _one(spans, "process jobs")
    assert process.kind is SpanKind.CONSUMER
    assert process.parent is not None
    assert process.parent.span_id == send.get_span_context().span_id
    assert process.get_span_context().trace_id == send.get_span_context().trace_id
    assert inside[0].get_span_context().span_id == process.get_span_context().span_id
    attrs = dict(process.attributes or {})
    assert attrs["messaging.consumer.group.name"] == "workers"
    assert attrs["messaging.operation.type"] == "process"
    assert attrs["messaging.destination.name"] == "jobs"


def test_pull_and_simple_receive_spans_link_to_the_send_span(
        broker: Broker, spans: InMemorySpanExporter) -> None:
    with Producer(broker.address) as p:
        p.send(Message("events", b"e-1"))
    send_ctx = _one(spans, "send events").get_span_context()
    with PullConsumer(broker.address, "analytics", auto_offset_reset="earliest") as c:
        c.subscribe("events")
        got: list = []
        wait_for(lambda: bool(got.extend(c.poll(timeout=0.2)) or got))
        with tracing.process_span(got[0], group="analytics"):
            pass
    receive = _one(spans, "receive events")
    assert receive.kind is SpanKind.CONSUMER
    assert [link.context.span_id for link in receive.links] == [send_ctx.span_id]
    assert dict(receive.attributes or {})["messaging.consumer.group.name"] == "analytics"
    processed = _one(spans, "process events")
    assert processed.parent is not None and processed.parent.span_id == send_ctx.span_id
    spans.clear()
    with SimpleConsumer(broker.address, "audit") as sc:
        sc.subscribe("events")
        leased: list[LeasedMessage] = []
        wait_for(lambda: bool(leased.extend(sc.receive(wait=0.2)) or leased))
        sc.ack(leased[0])
    receive = _one(spans, "receive events")
    assert [link.context.span_id for link in receive.links] == [send_ctx.span_id]
    assert dict(receive.attributes or {})["messaging.consumer.group.name"] == "audit"


def test_async_batch_is_one_send_span_every_message_carries(
        broker: Broker, spans: InMemorySpanExporter) -> None:
    async def main() -> None:
        async with AsyncProducer(broker.address) as p:
            await p.send_batch([Message("bulk", f"b{i}".encode()) for i in range(5)])
            fut = p.send_nowait(Message("bulk", b"later"))
            assert fut is not None
            await fut

    asyncio.run(main())
    batch = [s for s in spans.get_finished_spans() if s.name == "send bulk"]
    assert len(batch) == 2
    (many,) = [s for s in batch if "messaging.batch.message_count" in (s.attributes or {})]
    assert dict(many.attributes or {})["messaging.batch.message_count"] == 5
    with PullConsumer(broker.address, "b", auto_offset_reset="earliest") as c:
        c.subscribe("bulk")
        got: list = []
        wait_for(lambda: bool(got.extend(c.poll(timeout=0.2))) or len(got) >= 6)
    parents = [m.properties["traceparent"] for m in got]
    assert parents.count(_traceparent(many)) == 5
    assert len(set(parents)) == 2


def test_without_opentelemetry_nothing_is_added(tmp_path: Path) -> None:
    code = f"""
import json, sys
sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
from ferrymq import Broker, Message, Producer, PullConsumer, tracing
assert not tracing.ENABLED
with Broker({str(tmp_path / "data")!r}) as b:
    with Producer(b.address) as p:
        p.send(Message("t", b"x", properties={{"k": "v"}}))
        p.send(Message("t", b"y"))
    got = []
    with PullConsumer(b.address, "g", auto_offset_reset="earliest") as c:
        c.subscribe("t")
        while len(got) < 2:
            got += c.poll(timeout=1)
print(json.dumps([m.properties for m in got]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [{"k": "v"}, {}]


def test_without_an_sdk_only_an_upstream_context_is_passed_on(tmp_path: Path) -> None:
    # a fresh interpreter: this one has a tracer provider installed
    code = f"""
import json
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from ferrymq import Broker, Message, Producer, PullConsumer
upstream = NonRecordingSpan(SpanContext(0x1234, 0x5678, is_remote=True,
                                        trace_flags=TraceFlags(TraceFlags.SAMPLED)))
with Broker({str(tmp_path / "data")!r}) as b:
    with Producer(b.address) as p:
        p.send(Message("t", b"plain"))
        with trace.use_span(upstream):
            p.send(Message("t", b"from-upstream"))
    got = []
    with PullConsumer(b.address, "g", auto_offset_reset="earliest") as c:
        c.subscribe("t")
        while len(got) < 2:
            got += c.poll(timeout=1)
print(json.dumps({{m.body.decode(): m.properties for m in got}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "plain": {},
        "from-upstream": {"traceparent": f"00-{0x1234:032x}-{0x5678:016x}-01"}}


def _sent_and_stored(spans: InMemorySpanExporter, address: str, topic: str,
                     n: int) -> tuple[ReadableSpan, list[Any]]:
    """The one ``send <topic>`` span and the ``n`` messages a read_committed reader gets."""
    got = read_topic(address, topic, n)
    assert len(got) == n
    return _one(spans, f"send {topic}"), got


def test_half_message_carries_the_prepare_span_context_sync_and_async(
        broker: Broker, provider: TracerProvider, spans: InMemorySpanExporter) -> None:
    tracer = provider.get_tracer("app")
    with HalfMessageProducer(broker.address, "hp", lambda msg: HalfState.COMMIT) as hp, \
            tracer.start_as_current_span("order") as app:
        hp.send_in_transaction(Message("half-t", b"h-1", properties={"k": "v"}),
                               lambda msg: HalfState.COMMIT)
    send, (stored,) = _sent_and_stored(spans, broker.address, "half-t", 1)
    assert send.kind is SpanKind.PRODUCER
    assert send.parent is not None and send.parent.span_id == app.get_span_context().span_id
    assert stored.properties["traceparent"] == _traceparent(send)  # what consumers extract
    assert stored.properties["k"] == "v"
    assert tracing.context_of(stored.properties) is not None

    async def prepare_async() -> None:
        async with AsyncHalfMessageProducer(broker.address, "hp-async",
                                            lambda msg: HalfState.COMMIT) as ahp:
            with tracer.start_as_current_span("order-async"):
                async with ahp.half_message(Message("half-async", b"h-2")):
                    pass  # committed on exit

    asyncio.run(prepare_async())
    send, (stored,) = _sent_and_stored(spans, broker.address, "half-async", 1)
    assert stored.properties["traceparent"] == _traceparent(send)


def test_transactional_and_staged_sends_carry_the_send_span_context(
        broker: Broker, provider: TracerProvider, spans: InMemorySpanExporter) -> None:
    tracer = provider.get_tracer("app")
    with Producer(broker.address, transactional_id="traced") as p, \
            tracer.start_as_current_span("batch"):
        p.begin()
        p.send(Message("txn-t", b"t-1"))
        p.commit()
    send, (stored,) = _sent_and_stored(spans, broker.address, "txn-t", 1)
    assert stored.properties["traceparent"] == _traceparent(send)

    with Producer(broker.address, transactional_id="traced-staged") as p, \
            tracer.start_as_current_span("staged"):
        p.begin()
        p.send(Message("txn-staged", b"s-1"))
        staged = p.stage("sink-1", 7)
    with AdminClient(broker.address) as admin:
        admin.commit_staged("sink-1", 7, [staged])
    send, (stored,) = _sent_and_stored(spans, broker.address, "txn-staged", 1)
    assert stored.properties["traceparent"] == _traceparent(send)
