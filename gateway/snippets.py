"""The two snippets a person runs against the gateway (``make demo`` prints
them; ``tests/gateway/test_snippets.py`` runs them)."""

from __future__ import annotations


def key_command(name: str = "demo") -> str:
    return f"export LLMGW_KEY=$(llmgw ctl keys create {name} -q)"


def curl(*, base_url: str, model: str) -> str:
    return (
        f"curl -sN {base_url}/v1/chat/completions \\\n"
        '  -H "Authorization: Bearer $LLMGW_KEY" -H "Content-Type: application/json" \\\n'
        f"  -d '{{\"model\": \"{model}\", \"stream\": true, "
        "\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'"
    )


def openai_python(*, base_url: str, model: str) -> str:
    return f"""\
import os
from openai import OpenAI

client = OpenAI(base_url="{base_url}/v1", api_key=os.environ["LLMGW_KEY"])
stream = client.chat.completions.create(
    model="{model}", messages=[{{"role": "user", "content": "Hello!"}}], stream=True,
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
"""
