"""hypothesis strategies for the agent contract: JSON values of every kind
(huge integers, NaN and infinities, long strings, NUL, nesting), and
well-formed messages of agent.protocol with parts of them replaced, removed
or added."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**31 - 1, 2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 2**64, 10**30, -1, 0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["\x00", "a\x00b", "x" * 5000, "ready", "running", "exited", "mlx5_0", "ib-a", "GPU-x", "m1"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
# Deeper than any message, not so deep that building it here fails.
deep = st.integers(min_value=50, max_value=600).map(lambda n: _nest(n))


any_value = st.one_of(scalars, json_values, deep)


def _nest(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = {"gpus": value}
    return value


def replaced(message: dict[str, Any], path: tuple, value: Any) -> dict[str, Any]:
    """``message`` with the value at ``path`` replaced."""
    message = copy.deepcopy(message)
    parent = message
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return message


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """The places in a JSON value (dict keys and list indices), down to the
    depth of agent.protocol's messages."""
    found = [prefix] if prefix else []
    if len(prefix) >= 6:
        return found
    if isinstance(value, dict):
        for key, child in value.items():
            found += paths(child, prefix + (key,))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            found += paths(child, prefix + (i,))
    return found


@st.composite
def mutated(draw, base: dict[str, Any]) -> dict[str, Any]:
    """``base`` with one to three of its parts replaced, removed, or given a neighbour."""
    message = copy.deepcopy(base)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        places = paths(message)
        if not places:
            break
        path = draw(st.sampled_from(places))
        parent = message
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "remove", "add"]))
        if action == "replace":
            parent[path[-1]] = draw(any_value)
        elif action == "remove":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
        else:
            parent.append(draw(json_values))
    return message
