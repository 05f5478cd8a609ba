"""OpenTelemetry tracing: trace context carried in message properties, and messaging spans.

With ``pip install "ferrymq[otel]"`` (opentelemetry-api and -sdk), FerryMQ's clients take part
in the application's traces, following OpenTelemetry's messaging semantic conventions:

* **Producers** start a ``send <topic>`` span (kind PRODUCER) around each send and write its
  context into the message's properties as W3C ``traceparent`` (and ``tracestate`` when there is
  one), through OpenTelemetry's configured propagator. A batch (``send_batch``) is one span whose
  context every message of the batch carries. A half message's prepare
  (:mod:`ferrymq.client.half_messages`) is its send span (the committed message keeps the
  properties); a transaction's sends, staged or committed, are sends like any other.
* **Push consumers** run each handler call in a ``process <topic>`` span (kind CONSUMER), a
  child of the context the message carries (so the producer's trace continues); a handler of
  several messages (``batch_size > 1``) gets one span linked to each message's context.
* **Pull and simple consumers** record a ``receive <topic>`` span (kind CONSUMER) per
  ``poll()``/``receive()`` that returned messages, linked to each message's context; the
  application's processing of one message goes in :func:`process_span` (a child, as above).
* **The Spark source** passes the properties through (``includeProperties``): the
  ``traceparent`` of each row is there for :func:`context_of`.

Span attributes: ``messaging.system = "ferrymq"``, ``messaging.destination.name`` (the topic),
``messaging.operation.name`` / ``messaging.operation.type`` (``send``, ``receive``,
``process``), ``messaging.destination.partition.id`` (the queue), ``messaging.message.id``,
``messaging.consumer.group.name``, ``messaging.message.body.size``,
``messaging.batch.message_count`` for batches.

Spans go to OpenTelemetry's global tracer provider, or to the one given to
:func:`use_tracer_provider`. Without OpenTelemetry installed nothing of it runs: the import is
tried once, here, and :data:`ENABLED` is False; the clients test that one flag and add nothing
to a message. With the API installed but no tracer provider set by the application, producers
make no spans (they would be no-ops) and pass on only a context that some other instrumentation
started (a few microseconds per send).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import context as _otel_context
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace

    ENABLED = True
    """True when OpenTelemetry (``ferrymq[otel]``) is installed: the clients trace."""
except ImportError:  # pragma: no cover - the CI installs the extra; a subprocess test runs without
    ENABLED = False

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, Span, TracerProvider

    from ferrymq.client.message import Message, ReceivedMessage, SendResult

__all__ = ["ENABLED", "MESSAGING_SYSTEM", "context_of", "process_span", "use_tracer_provider"]

MESSAGING_SYSTEM = "ferrymq"
TRACE_PROPERTIES = ("traceparent", "tracestate")
"""The W3C trace-context properties a traced message carries."""

_SCOPE = "ferrymq"


_provider: list[TracerProvider] = []  # use_tracer_provider's, if any


def use_tracer_provider(provider: TracerProvider | None) -> None:
    """Send FerryMQ's spans to ``provider`` instead of OpenTelemetry's global one (None: back to
    the global one), like the ``tracer_provider=`` of OpenTelemetry's instrumentations."""
    _provider[:] = [provider] if provider is not None else []
    _tracer.cache_clear()


@functools.cache
def _tracer() -> _trace.Tracer:
    """FerryMQ's tracer (from the global provider: a proxy that follows a provider the
    application installs later)."""
    from ferrymq._version import __version__

    if _provider:
        return _provider[0].get_tracer(_SCOPE, __version__)
    return _trace.get_tracer(_SCOPE, __version__)


def _attributes(operation: str, topic: str) -> dict[str, Any]:
    return {"messaging.system": MESSAGING_SYSTEM, "messaging.destination.name": topic,
            "messaging.operation.name": operation, "messaging.operation.type": operation}


def _recording() -> bool:
    """Whether the application installed a tracer provider (an SDK). Without one, spans would be
    no-ops: the clients skip them and only pass on a context some other instrumentation made."""
    provider = _provider[0] if _provider else _trace.get_tracer_provider()
    return not isinstance(provider, (_trace.ProxyTracerProvider, _trace.NoOpTracerProvider))


def context_of(properties: Mapping[str, str]) -> Context:
    """The trace context a message carries in its properties (``msg.properties``, or a Spark
    row's ``properties`` column): use it as the parent of spans about that message."""
    return _propagate.extract(dict(properties))


def _inject(msg: Message) -> None:
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    if carrier:
        props = dict(msg.properties or {})
        for key in TRACE_PROPERTIES:
            props.pop(key, None)  # a message sent again carries its latest send's context
        props.update(carrier)
        msg.properties = props


@contextlib.contextmanager
def send_span(msgs: Sequence[Message]) -> Iterator[Span]:
    """A ``send <topic>`` PRODUCER span, current while it lasts; its context goes into every
    message of ``msgs`` (their properties). The caller records the results with
    :func:`record_result`."""
    if not _recording():
        if _trace.get_current_span().get_span_context().is_valid:
            for msg in msgs:
                _inject(msg)
        yield _trace.INVALID_SPAN
        return
    topics = {msg.topic for msg in msgs}
    topic = next(iter(topics)) if len(topics) == 1 else ""
    attributes: dict[str, Any] = _attributes("send", topic) if topic else {
        "messaging.system": MESSAGING_SYSTEM, "messaging.operation.name": "send",
        "messaging.operation.type": "send"}
    if len(msgs) == 1:
        attributes["messaging.message.body.size"] = len(msgs[0].body)
    else:
        attributes["messaging.batch.message_count"] = len(msgs)
    with _tracer().start_as_current_span(f"send {topic}" if topic else "send",
                                         kind=_trace.SpanKind.PRODUCER,
                                         attributes=attributes) as span:
        for msg in msgs:
            _inject(msg)
        yield span


def record_result(span: Span, result: SendResult) -> None:
    """Add what the broker answered (queue, message id) to a one-message send span."""
    span.set_attribute("messaging.destination.partition.id", str(result.queue))
    span.set_attribute("messaging.message.id", result.msg_id)


def start_send(msg: Message) -> Span:
    """A send span for a message sent without waiting (``send_async``, ``send_oneway``): the
    context goes into the message now; end the span with :func:`end_send`."""
    if not _recording():
        if _trace.get_current_span().get_span_context().is_valid:
            _inject(msg)
        return _trace.INVALID_SPAN
    attributes = _attributes("send", msg.topic)
    attributes["messaging.message.body.size"] = len(msg.body)
    span = _tracer().start_span(f"send {msg.topic}", kind=_trace.SpanKind.PRODUCER,
                                attributes=attributes)
    token = _otel_context.attach(_trace.set_span_in_context(span))
    try:
        _inject(msg)
    finally:
        _otel_context.detach(token)
    return span


def end_send(span: Span, result: SendResult | None, exc: BaseException | None) -> None:
    """End a :func:`start_send` span with the result or the failure."""
    if exc is not None:
        span.record_exception(exc)
        span.set_status(_trace.Status(_trace.StatusCode.ERROR, str(exc)))
    elif result is not None:
        record_result(span, result)
    span.end()


def end_when_done(span: Span, fut: asyncio.Future[SendResult] | concurrent.futures.Future[SendResult],
                  ) -> None:
    """End a :func:`start_send` span when the send's future is done."""
    def done(f: Any) -> None:
        exc = None if f.cancelled() else f.exception()
        end_send(span, None if f.cancelled() or exc is not None else f.result(), exc)

    fut.add_done_callback(done)


def _consumer_attributes(operation: str, msgs: Sequence[ReceivedMessage],
                         group: str | None) -> dict[str, Any]:
    attributes = _attributes(operation, msgs[0].topic)
    if group:
        attributes["messaging.consumer.group.name"] = group
    if len(msgs) == 1:
        attributes["messaging.destination.partition.id"] = str(msgs[0].queue)
        attributes["messaging.message.id"] = msgs[0].msg_id
        attributes["messaging.message.body.size"] = len(msgs[0].body)
    else:
        attributes["messaging.batch.message_count"] = len(msgs)
    return attributes


def _links(msgs: Sequence[ReceivedMessage]) -> list[Link]:
    links = []
    for msg in msgs:
        ctx = _trace.get_current_span(context_of(msg.properties)).get_span_context()
        if ctx.is_valid:
            links.append(_trace.Link(ctx))
    return links


def record_receive(msgs: Sequence[ReceivedMessage], group: str | None) -> None:
    """A ``receive <topic>`` CONSUMER span for messages a poll/receive returned, linked to the
    context each carries (one span per topic among them)."""
    if not _recording():
        return
    by_topic: dict[str, list[ReceivedMessage]] = {}
    for msg in msgs:
        by_topic.setdefault(msg.topic, []).append(msg)
    tracer = _tracer()
    for topic, some in by_topic.items():
        tracer.start_span(f"receive {topic}", kind=_trace.SpanKind.CONSUMER,
                          attributes=_consumer_attributes("receive", some, group),
                          links=_links(some)).end()


@contextlib.contextmanager
def process_span(msg: ReceivedMessage | Sequence[ReceivedMessage],
                 group: str | None = None) -> Iterator[Span]:
    """A ``process <topic>`` CONSUMER span for handling ``msg``: a child of the producer's
    context the message carries (for a list of messages: linked to each one's context).

    Example::

        for msg in consumer.poll():
            with ferrymq.tracing.process_span(msg, group="billing"):
                handle(msg)
    """
    msgs: Sequence[ReceivedMessage] = msg if isinstance(msg, Sequence) else [msg]
    if len(msgs) == 1:
        parent, links = context_of(msgs[0].properties), None
    else:
        parent, links = None, _links(msgs)
    with _tracer().start_as_current_span(f"process {msgs[0].topic}", context=parent,
                                         kind=_trace.SpanKind.CONSUMER, links=links,
                                         attributes=_consumer_attributes("process", msgs,
                                                                         group)) as span:
        yield span


def traced_handler(handler: Callable[[Any], Any], group: str) -> Callable[[Any], Any]:
    """``handler`` (a push consumer's, ``async def`` or plain) run in :func:`process_span`."""
    if inspect.iscoroutinefunction(handler):
        @functools.wraps(handler)
        async def traced_async(arg: Any) -> Any:
            with process_span(arg, group):
                return await handler(arg)
        return traced_async

    @functools.wraps(handler)
    def traced(arg: Any) -> Any:
        with process_span(arg, group):
            return handler(arg)
    return traced
