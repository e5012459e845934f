"""A scripted agent session: what an agent framework re-sends, turn after turn, to a chat API.

Pure data and arithmetic (no server, no engine): `tokios bench agent` replays it against servers,
tests/model replays it against the engine. A system prompt and tool schemas, a task, then
assistant turns (tool calls and text) each followed by a tool result or a user message; every
request re-sends the whole conversation so far. The assistant turns are scripted, not the
model's own answers, so that every server is sent the same conversation; what a server generates
at each turn is measured and dropped. Two turns are what agents do to a prefix cache:

- "regenerated": the previous turn's conversation sent again (the user asked for another answer);
- "interrupted": a streamed turn the client drops after a few tokens; the conversation goes on
  without the model's answer (the scripted one, cut short, then the user's next message).

`recompute_bound` is the target a server's prefix cache is held to: a turn recomputes at most the
prompt tokens after the longest common prefix with tokens it has already computed, rounded up to
a whole block, plus one block.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Sequence

TURN = "turn"
REGENERATED = "regenerated"
INTERRUPTED = "interrupted"

SYSTEM_PROMPT = ("You are a careful software engineering agent working in a Python repository. Use the tools to "
                 "read files, search the code and run the tests; make the smallest change that fixes the "
                 "problem; explain what you changed and why in one short paragraph.")

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "path relative to the repository root"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "glob": {"type": "string", "description": "files to search"}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite or one test file; returns pytest's summary.",
        "parameters": {"type": "object", "properties": {"target": {"type": "string"}}, "required": []}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace a file's content.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}}},
]

TASK = ("The command `inventory report --since 2024-01-01` crashes with a TypeError when an item has no "
        "price. Find the cause and fix it, then make sure the tests pass.")

_CONFIG_PY = '''import datetime as dt
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    quantity: int
    price: float | None
    added: dt.date


def parse_since(text: str) -> dt.date:
    return dt.date.fromisoformat(text)
'''

_REPORT_PY = '''from inventory.config import Item, parse_since


def total_value(items: list[Item]) -> float:
    return sum(item.quantity * item.price for item in items)


def report(items: list[Item], since: str) -> str:
    start = parse_since(since)
    recent = [item for item in items if item.added >= start]
    lines = [f"{item.name}: {item.quantity} x {item.price:.2f}" for item in recent]
    lines.append(f"total: {total_value(recent):.2f}")
    return "\\n".join(lines)
'''

_TEST_OUTPUT_FAIL = '''============================= test session starts ==============================
collected 14 items

tests/test_config.py .... [ 28%]
tests/test_report.py ...F.. [ 71%]
tests/test_cli.py ...F [100%]

=================================== FAILURES ===================================
__________________________ test_report_item_without_price ______________________
    def test_report_item_without_price():
>       text = report([Item("bolt", 3, None, dt.date(2024, 2, 1))], "2024-01-01")
inventory/report.py:5: in total_value
    return sum(item.quantity * item.price for item in items)
E   TypeError: unsupported operand type(s) for *: 'int' and 'NoneType'
__________________________ test_cli_report_since _______________________________
E   TypeError: unsupported operand type(s) for *: 'int' and 'NoneType'
=========================== 2 failed, 12 passed in 0.41s =======================
'''

_REPORT_FIXED = _REPORT_PY.replace(
    "return sum(item.quantity * item.price for item in items)",
    "return sum(item.quantity * item.price for item in items if item.price is not None)").replace(
    'f"{item.name}: {item.quantity} x {item.price:.2f}"',
    'f"{item.name}: {item.quantity} x " + ("no price" if item.price is None else f"{item.price:.2f}")')

_TEST_OUTPUT_PASS = '''============================= test session starts ==============================
collected 15 items

tests/test_config.py .... [ 26%]
tests/test_report.py ....... [ 73%]
tests/test_cli.py .... [100%]

============================== 15 passed in 0.38s ==============================
'''


def _call(call_id: str, name: str, **arguments: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def _result(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


# What follows each turn's request: the scripted assistant answer and the message(s) after it.
# A REGENERATED turn re-sends the previous turn's conversation (its own entry adds nothing). After
# an INTERRUPTED turn the client keeps what it showed of the answer before the user stopped it
# (scripted text, as every answer is) and the user's next message; some templates (Gemma's) refuse
# a user turn straight after another, so the assistant turn stays.
_SCRIPT: list[tuple[str, list[dict[str, Any]]]] = [
    (TURN, [_call("call_1", "run_tests"), _result("call_1", _TEST_OUTPUT_FAIL)]),
    (TURN, [_call("call_2", "read_file", path="inventory/report.py"), _result("call_2", _REPORT_PY)]),
    (TURN, [_say("The crash comes from inventory/report.py: `total_value` multiplies the quantity by a "
                 "price that may be None, and `report` formats that price with `:.2f`. Items without a "
                 "price should be left out of the total and shown as 'no price'."),
            _user("Before you change anything: are there other callers of total_value?")]),
    (REGENERATED, []),
    (TURN, [_call("call_3", "search_code", pattern="total_value", glob="**/*.py"),
            _result("call_3", "inventory/report.py:4:def total_value(items: list[Item]) -> float:\n"
                              "inventory/report.py:12:    lines.append(f\"total: {total_value(recent):.2f}\")\n"
                              "tests/test_report.py:9:    assert total_value(ITEMS) == 42.5\n")]),
    (INTERRUPTED, [_say("Only `report` and one test call it, so"),
                   _user("Stop there. Read inventory/config.py first: is a missing price allowed on purpose?")]),
    (TURN, [_call("call_4", "read_file", path="inventory/config.py"), _result("call_4", _CONFIG_PY)]),
    (TURN, [_say("Yes: `Item.price` is declared `float | None`, so a missing price is allowed and the report "
                 "must handle it."),
            _user("Go ahead and fix it.")]),
    (TURN, [_call("call_5", "write_file", path="inventory/report.py", content=_REPORT_FIXED),
            _result("call_5", "wrote inventory/report.py (14 lines)")]),
    (TURN, [_call("call_6", "run_tests", target="tests/test_report.py"),
            _result("call_6", _TEST_OUTPUT_PASS.replace("15 passed", "7 passed"))]),
    (TURN, [_say("The report tests pass."), _user("Run the whole suite too.")]),
    (TURN, [_call("call_7", "run_tests"), _result("call_7", _TEST_OUTPUT_PASS)]),
    (TURN, [_say("All 15 tests pass. `total_value` now skips items without a price and `report` prints "
                 "'no price' for them."),
            _user("Add a test for an item whose price is zero, so we do not confuse 0 with None.")]),
    (TURN, [_call("call_8", "read_file", path="tests/test_report.py"),
            _result("call_8", "import datetime as dt\n\nfrom inventory.config import Item\nfrom "
                              "inventory.report import report, total_value\n\nITEMS = [Item(\"nut\", 10, 1.25, "
                              "dt.date(2024, 3, 1)), Item(\"gear\", 2, 15.0, dt.date(2023, 12, 1))]\n")]),
    (TURN, [_call("call_9", "write_file", path="tests/test_report.py",
                  content="def test_zero_price_counts_as_a_price():\n    item = Item(\"washer\", 5, 0.0, "
                          "dt.date(2024, 5, 1))\n    assert \"5 x 0.00\" in report([item], \"2024-01-01\")\n"),
            _result("call_9", "wrote tests/test_report.py (23 lines)")]),
    (TURN, [_call("call_10", "run_tests"), _result("call_10", _TEST_OUTPUT_PASS.replace("15", "16"))]),
    (TURN, [_say("16 tests pass, including the new zero-price test."),
            _user("Summarize the change for the commit message.")]),
    (TURN, [_say("report: skip items without a price in the total and print 'no price' for them, instead "
                  "of crashing with a TypeError; a zero price still counts."),
            _user("Thanks. One more thing: does the CLI accept --since without a value?")]),
    (TURN, [_call("call_11", "search_code", pattern="--since", glob="inventory/cli.py"),
            _result("call_11", "inventory/cli.py:9:    parser.add_argument(\"--since\", required=True)\n")]),
    (TURN, []),
]
MAX_TURNS = len(_SCRIPT)


@dataclass(frozen=True)
class AgentTurn:
    index: int  # from 1
    kind: str  # TURN, REGENERATED or INTERRUPTED
    messages: list[dict[str, Any]]  # the whole conversation the client sends this turn


def agent_session(num_turns: int = MAX_TURNS) -> list[AgentTurn]:
    """The first num_turns turns of the scripted session, each with the conversation it sends
    (the tools, TOOLS, go with every turn)."""
    if not 1 <= num_turns <= MAX_TURNS:
        raise ValueError(f"num_turns must be in 1..{MAX_TURNS}, got {num_turns}")
    history: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT}, _user(TASK)]
    turns: list[AgentTurn] = []
    previous: list[dict[str, Any]] = history
    for index, (kind, following) in enumerate(_SCRIPT[:num_turns], start=1):
        sent = previous if kind == REGENERATED else history
        turns.append(AgentTurn(index, kind, copy.deepcopy(sent)))
        previous = list(history)
        history = history + following
    return turns


def plain_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as system/user/assistant text only, the tools written into the system
    prompt, calls and results as Hermes-style <tool_call> / <tool_response> text: what any chat
    template renders the same way in any server, so that two servers are sent the same tokens
    (each server's own tool prompt and call rendering would differ)."""
    tool_lines = "\n".join(json.dumps(tool["function"]) for tool in TOOLS)
    plain = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "system":
            content += ("\n\nYou may call these tools; to call one, answer with <tool_call>{\"name\": ..., "
                        "\"arguments\": {...}}</tool_call>:\n" + tool_lines)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        elif message.get("tool_calls"):
            for call in message["tool_calls"]:
                function = call["function"]
                call_json = json.dumps({"name": function["name"], "arguments": json.loads(function["arguments"])})
                content += f"<tool_call>\n{call_json}\n</tool_call>"
        plain.append({"role": role, "content": content})
    return plain


def common_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length


def recompute_bound(prompt_ids: Sequence[int], computed: Sequence[Sequence[int]], block_size: int) -> int:
    """The most prompt tokens a turn may recompute: the tokens after the longest common prefix
    with any token sequence the server has already computed (computed: each earlier request's
    prompt plus the answer tokens whose K/V it wrote), rounded up to a whole block, plus a block."""
    longest = max((common_prefix_length(prompt_ids, ids) for ids in computed), default=0)
    num_after = len(prompt_ids) - longest
    return -(-num_after // block_size) * block_size + block_size
