"""Tag expressions: which messages a subscription wants (RocketMQ's tag filter).

``*`` (or an empty expression) matches every message; ``A || B || C`` matches messages whose tag
is one of the listed tags. A message without a tag matches only ``*``. Tags are compared exactly
(case-sensitive); whitespace around ``||`` is ignored.
"""

from __future__ import annotations

from ferrymq.errors import InvalidRequestError

MAX_TAG_EXPRESSION_CHARS = 4096


def parse_tag_expression(expr: str) -> frozenset[str] | None:
    """Parse an expression; None means "everything".

    Raises:
        InvalidRequestError: empty alternatives (``A || || B``) or an over-long expression.
    """
    if len(expr) > MAX_TAG_EXPRESSION_CHARS:
        raise InvalidRequestError(f"tag expression longer than {MAX_TAG_EXPRESSION_CHARS}")
    expr = expr.strip()
    if expr in ("", "*"):
        return None
    tags = [t.strip() for t in expr.split("||")]
    if any(not t for t in tags):
        raise InvalidRequestError(f"bad tag expression {expr[:64]!r}: empty alternative")
    if "*" in tags:
        return None
    return frozenset(tags)
