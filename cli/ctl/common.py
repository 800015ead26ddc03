"""What every ``llmgw ctl`` area shares: its error, the operator REST API,
and output as a table or as JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable

import httpx

from ..env import api_token, control_plane_url, local_data_dir


class CtlError(Exception):
    """A command that cannot be done as asked; the message says why, and ctl exits 1."""


def api_call(method: str, path: str, **kwargs):
    """One request to the operator API at ``LLMGW_URL``; its JSON, or a CtlError a person can act on."""
    token = api_token()
    if not token:
        raise CtlError(
            "no API token: set LLMGW_TOKEN, or LLMGW_DATA_DIR to the data directory of 'llmgw up' "
            f"(it writes ctl-token there; looked in {local_data_dir()})"
        )
    base_url = control_plane_url()
    try:
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Token {token}"}, timeout=30) as client:
            response = client.request(method, path, **kwargs)
    except httpx.TransportError as exc:
        raise CtlError(
            f"cannot reach the control plane at {base_url}: {exc or type(exc).__name__}. "
            "Is it running ('llmgw up')? Set LLMGW_URL if it is elsewhere"
        ) from exc
    try:
        data = response.json()
    except ValueError:
        data = None
    if response.status_code >= 400:
        detail = error_sentence(data) if data is not None else response.text.strip()[:500]
        detail = detail or response.reason_phrase
        hint = ""
        if response.status_code in (401, 403):
            hint = " (check LLMGW_TOKEN: it must be an operator token of a user whose role allows this)"
        dependency = data.get("dependency") if isinstance(data, dict) else None
        if response.status_code == 503 and dependency:
            retry = response.headers.get("Retry-After")
            raise CtlError(
                f"503: the control plane is up, but its {dependency} is down: {detail}"
                + (f" (it suggests retrying in {retry}s)" if retry else "")
            )
        raise CtlError(f"{response.status_code}: {detail}{hint}")
    if data is None:
        raise CtlError(
            f"{base_url}{path} did not answer with JSON (status {response.status_code}); "
            "is LLMGW_URL the llmgw web address?"
        )
    return data


def error_sentence(data) -> str:
    """An API error body as a person reads it: ``replicas: must be 0 or more``,
    never a Python dict. Field errors are named by their field (nested ones by
    their path); a message for the whole request stands alone."""
    if isinstance(data, str):
        return data
    if isinstance(data, list):
        return "; ".join(filter(None, (error_sentence(item) for item in data)))
    if isinstance(data, dict):
        parts = []
        for key, value in data.items():
            text = error_sentence(value)
            if not text:
                continue
            whole = key in ("detail", "non_field_errors", "__all__")
            parts.append(text if whole else f"{key}: {text}")
        return "; ".join(parts)
    return json.dumps(data)


# --- output -------------------------------------------------------------------


def output_flag(parser) -> None:
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table")


def print_json(value) -> None:
    json.dump(value, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def print_table(headers: list[str], rows: list[list[object]]) -> None:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def print_listing(args, items: list, headers: list[str], row: Callable[[dict], Iterable[object]]) -> int:
    """``items`` as JSON with ``-o json``, else as a table of one ``row(item)`` each."""
    if args.output == "json":
        print_json(items)
    else:
        print_table(headers, [list(row(item)) for item in items])
    return 0


def age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"
