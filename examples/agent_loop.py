"""An agent loop with tools on the official OpenAI SDK, against kvtier's gateway.

Start a stack first (`kvtier up` prints the gateway's URL and an API key), then:

    python examples/agent_loop.py                      # http://127.0.0.1:8000/v1, key from .kvtier
    python examples/agent_loop.py --base-url URL --api-key KEY --question "What is 17 * 23?"

The loop is the one every agent framework runs: send the conversation with the tools, run
each tool call the model makes, append the results, repeat until the model answers in text.
The first step names the tool in `tool_choice` (a 135M model does not reliably decide to call
one); later steps leave the choice to the model, up to --max-steps. Nothing here knows about
kvtier: the gateway infers the session from the conversation, pauses it while the tool runs
and serves the next turn from the cached pages, which `usage` shows.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
from pathlib import Path

import openai

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as 17 * 23.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only numbers and + - * /")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def run_agent(client: openai.OpenAI, model: str, question: str, max_steps: int = 3) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": "You are a careful assistant. Use the calculator."},
                            {"role": "user", "content": question}]
    for step in range(max_steps):
        tool_choice = {"type": "function", "function": {"name": "calculator"}} if step == 0 else "auto"
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                               tool_choice=tool_choice, max_tokens=48, temperature=0)
        message = reply.choices[0].message
        usage = reply.usage
        print(f"[step {step}] prompt {usage.prompt_tokens} tokens, "
              f"{usage.prompt_tokens_details.cached_tokens} cached")
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(f"assistant: {message.content}")
            return messages
        for call in message.tool_calls:
            args = json.loads(call.function.arguments)
            result = calculator(str(args.get("expression", "")))
            print(f"tool call: {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="default: $OPENAI_API_KEY, else .kvtier/auth/frontend.token")
    parser.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    parser.add_argument("--question", default="What is 17 * 23? Use the calculator.")
    parser.add_argument("--max-steps", type=int, default=3)
    args = parser.parse_args()
    key = args.api_key or Path(".kvtier/auth/frontend.token").read_text().strip()
    client = openai.OpenAI(base_url=args.base_url, api_key=key, max_retries=1, timeout=300)
    model = args.model or client.models.list().data[0].id
    run_agent(client, model, args.question, args.max_steps)


if __name__ == "__main__":
    main()
