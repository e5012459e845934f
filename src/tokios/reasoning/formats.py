"""Which reasoning format a model writes, read from its chat template and vocabulary.

- `think`: the reasoning between `<think>` and `</think>`, then the answer (Qwen3, QwQ, the
  DeepSeek-R1 distills, SmolLM3, ...). Some templates open `<think>` in the generation prompt,
  so the output starts inside the reasoning; others let the model open it.
- `harmony`: gpt-oss's channels. `<|channel|>analysis<|message|>...<|end|>` is the reasoning,
  `<|start|>assistant<|channel|>final<|message|>...` the answer, and a `commentary` message to
  `functions.NAME` a tool call.
- none: the model does not reason in a format we know; its whole output is the answer.

The format is chosen from the model's files (DESIGN rule 12: never from its name), and
`tokios serve --reasoning-format` overrides it. `ReasoningFormat` holds the format's text
markers; the server turns them into token ids for the thinking budget (reasoning/budget.py) and
keeps the markers that are special tokens visible in the output text, so the parser
(reasoning/parser.py) sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokios.errors import InvalidRequestError


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str  # opens the reasoning in the output
    end: str  # closes it
    # What the sampler writes when the thinking budget is spent: the close, and whatever leads
    # from there to the answer.
    forced_end: str
    # Every marker of the format (the tool-call ones too): those that are special tokens must
    # stay in the output text for the parser to see them.
    markers: tuple[str, ...]
    # The forced end when the answer must be a call (tool_choice required or named), if it
    # differs: only as far as the tool-call grammar admits, which writes the call from there.
    forced_end_before_call: str | None = None

    def prompt_opens_reasoning(self, prompt: str) -> bool:
        """Whether the prompt ends inside an open reasoning block (a template that writes
        `<think>` into the generation prompt): then the output starts in the reasoning."""
        tail = prompt.rstrip()
        return tail.endswith(self.start) if self.name == "think" else False


THINK = ReasoningFormat("think", "<think>", "</think>", "\n</think>\n\n",
                        ("<think>", "</think>", "<tool_call>", "</tool_call>"))
HARMONY = ReasoningFormat(
    "harmony", "<|channel|>analysis<|message|>", "<|end|>",
    "<|end|><|start|>assistant<|channel|>final<|message|>",
    ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>", "<|return|>"),
    "<|end|><|start|>assistant")
REASONING_FORMATS = {format_.name: format_ for format_ in (THINK, HARMONY)}
FORMAT_CHOICES = ("auto", "none", *REASONING_FORMATS)


def detect_reasoning_format(chat_template: str | None, vocabulary: set[str] | frozenset[str]) -> ReasoningFormat | None:
    """The format a model's template (or, without a template that says, its vocabulary) implies."""
    template = chat_template or ""
    if "<|channel|>" in template and "<|message|>" in template:
        return HARMONY
    if "<think>" in template and "</think>" in template:
        return THINK
    if not template and {"<think>", "</think>"} <= vocabulary:
        return THINK
    return None


def resolve_reasoning_format(choice: str, chat_template: str | None,
                             vocabulary: set[str] | frozenset[str]) -> ReasoningFormat | None:
    """--reasoning-format: auto (from the files), none, or a format's name."""
    if choice == "auto":
        return detect_reasoning_format(chat_template, vocabulary)
    if choice == "none":
        return None
    if choice not in REASONING_FORMATS:
        raise InvalidRequestError(f"reasoning_format must be one of {list(FORMAT_CHOICES)}, got {choice!r}",
                                  param="reasoning_format")
    return REASONING_FORMATS[choice]
