"""What a PromQL expression asks of the series it reads: metric names and label names.

Enough of PromQL's lexical grammar to read the dashboard's and the alert
rules' queries without a PromQL engine:

* string literals (label values, which may hold ``$variables``) and range
  selectors (``[5m]``, ``[$__rate_interval]``) are removed first;
* ``$variable`` / ``${variable}`` outside strings are Grafana's and are skipped;
* an identifier followed by ``(`` is a function or an aggregation
  (``rate``, ``sum``, ``histogram_quantile``, ``label_values``);
* ``by``/``without``/``on``/``ignoring``/``group_left``/``group_right``
  followed by ``( ... )`` list label names;
* inside ``{ ... }`` the identifiers before ``=``, ``!=``, ``=~``, ``!~``
  are label names (of the metric right before the brace);
* operators' keywords (``and``, ``or``, ``unless``, ``bool``, ``offset``,
  ``group_left`` without labels), aggregation operators (``sum by (le) (...)``
  puts the clause between the name and its parenthesis) and numbers are
  skipped; every other identifier is a metric name (``_bucket``, ``_sum``,
  ``_count`` and ``_total`` kept, as Prometheus stores them).

Grafana's ``label_values(metric, label)`` variable query reads as the
metric ``metric`` grouped by ``label``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_RANGE = re.compile(r"\[[^\]]*\]")
_TOKEN = re.compile(
    r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*"  # Grafana variables
    r"|[A-Za-z_:][A-Za-z0-9_:]*"  # identifiers
    r"|\d+(?:\.\d+)?(?:e[+-]?\d+)?"  # numbers
    r"|=~|!~|!=|==|>=|<=|[(){},=<>+\-*/%^]"
)
_GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}
)
# Aggregations may take their clause first: ``sum by (le) (...)``.
_AGGREGATIONS = frozenset(
    {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values"}
    | {"bottomk", "topk", "quantile", "limitk", "limit_ratio"}
)


@dataclass
class Query:
    """What one expression reads.

    Attributes:
        metrics: Metric names (sample names) the expression selects.
        matchers: Per metric, the label names its selectors match on.
        grouping: Label names of ``by``/``without``/``on``/``ignoring`` clauses
            (and of ``label_values``).
    """

    metrics: set[str] = field(default_factory=set)
    matchers: dict[str, set[str]] = field(default_factory=dict)
    grouping: set[str] = field(default_factory=set)


def parse(expr: str) -> Query:
    """The metric and label names ``expr`` reads (see the module docstring)."""
    text = _RANGE.sub(" ", _STRING.sub('""', expr))
    tokens = [t for t in _TOKEN.findall(text) if t]
    q = Query()
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok.startswith("$") or tok[0].isdigit() or tok in _KEYWORDS | _AGGREGATIONS:
            i += 1
        elif tok in _GROUPING and nxt == "(":
            i = _labels(tokens, i + 2, q.grouping)
        elif tok == "label_values" and nxt == "(":
            # label_values(metric, label) or label_values(label)
            args: list[str] = []
            j = i + 2
            while j < len(tokens) and tokens[j] != ")":
                if tokens[j] == "{":
                    j = _matchers(tokens, j + 1, q.matchers.setdefault(args[-1], set()))
                    continue
                if tokens[j] != ",":
                    args.append(tokens[j])
                j += 1
            if len(args) == 2:
                q.metrics.add(args[0])
            q.grouping.add(args[-1])
            i = j + 1
        elif re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", tok):
            if nxt == "(":  # a function or an aggregation
                i += 1
                continue
            q.metrics.add(tok)
            if nxt == "{":
                i = _matchers(tokens, i + 2, q.matchers.setdefault(tok, set()))
            else:
                i += 1
        elif tok == "{":  # a selector without a metric name
            i = _matchers(tokens, i + 1, q.matchers.setdefault("", set()))
        else:
            i += 1
    return q


def _labels(tokens: list[str], i: int, out: set[str]) -> int:
    while i < len(tokens) and tokens[i] != ")":
        if tokens[i] != ",":
            out.add(tokens[i])
        i += 1
    return i + 1


def _matchers(tokens: list[str], i: int, out: set[str]) -> int:
    expect_name = True
    while i < len(tokens) and tokens[i] != "}":
        tok = tokens[i]
        if expect_name and tok not in {",", '""'}:
            out.add(tok)
            expect_name = False
        elif tok == ",":
            expect_name = True
        i += 1
    return i + 1
