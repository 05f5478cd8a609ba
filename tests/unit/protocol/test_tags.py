"""Tag expressions (RocketMQ-style ``A || B``)."""

from __future__ import annotations

import pytest

from ferrymq.errors import InvalidRequestError
from ferrymq.protocol.tags import MAX_TAG_EXPRESSION_CHARS, parse_tag_expression


@pytest.mark.parametrize("expr", ["", "*", "  ", " * ", "a || *", "* || b"])
def test_match_everything(expr: str) -> None:
    assert parse_tag_expression(expr) is None


@pytest.mark.parametrize(
    ("expr", "tags"),
    [
        ("a", {"a"}),
        ("a||b", {"a", "b"}),
        ("  a  ||  b || c ", {"a", "b", "c"}),
        ("a || a", {"a"}),
        ("A || a", {"A", "a"}),  # case-sensitive
        ("t\u00e4g || \u2603", {"t\u00e4g", "\u2603"}),
        ("a b", {"a b"}),  # inner whitespace is part of the tag
        ("a|b", {"a|b"}),  # a single pipe is not a separator
    ],
)
def test_tag_sets(expr: str, tags: set[str]) -> None:
    assert parse_tag_expression(expr) == frozenset(tags)


@pytest.mark.parametrize("expr", ["a || || b", "||", "a ||", "|| a", "a ||   "])
def test_empty_alternative(expr: str) -> None:
    with pytest.raises(InvalidRequestError, match="empty alternative"):
        parse_tag_expression(expr)


def test_length_limit() -> None:
    assert parse_tag_expression("a" * MAX_TAG_EXPRESSION_CHARS) == frozenset(
        {"a" * MAX_TAG_EXPRESSION_CHARS}
    )
    with pytest.raises(InvalidRequestError):
        parse_tag_expression("a" * (MAX_TAG_EXPRESSION_CHARS + 1))
    with pytest.raises(InvalidRequestError):
        parse_tag_expression(" " * (MAX_TAG_EXPRESSION_CHARS + 1))


def test_error_message_is_bounded() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_tag_expression("x" * 1000 + " || ||")
    assert len(str(info.value)) < 200
