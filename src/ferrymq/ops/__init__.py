"""The broker's HTTP surface for operators: the listener (:mod:`ferrymq.ops.http`), health and
readiness (:mod:`ferrymq.ops.health`) and Prometheus metrics (:mod:`ferrymq.ops.metrics`).

Nothing in the broker's request path imports this package: the server starts the listener
when ``http_port`` is set, and the listener reads the broker's state when asked.
"""
