"""The conversation of the agent loop, in the model's own chat template, token-in/token-out.

``Chat`` renders system, user, assistant and tool messages with the tokenizer's chat template
(transformers' renderer, as ``apply_chat_template`` does, with the tokenizer's special tokens;
the task's tools as JSON schemas where the template renders them) and reads generated turns
with a named tool-call format (``rollcall.workers.episode.toolcalls``). A trajectory is built from
segments, each encoded once and appended:

    render([system, user], generation prompt)                     (prompt, mask 0)
    {generated turn, ending with the end-of-turn token}           (mask 1, kept as generated)
    {rest of the assistant message's closing}{tool message}{next assistant header}   (mask 0)
    {generated turn} ...

Only the observation segment is newly encoded each turn; it is the text that rendering one
more (tool) message adds, found by rendering the conversation with a probe assistant message
with and without it. That is sound only for a template that is *prefix-stable* for this use:
the generation prompt is exactly what precedes an assistant message, an assistant message ends
with the end-of-turn token the engine stops at, and rendering one more message extends the
earlier rendering, in text and in tokens. ``Chat`` checks this when it is made and refuses a
template that is not (one sentence): for example one that rewrites earlier assistant turns.

The tiny local model has no template of its own from its builder's older versions: its format
is ``ROLLCALL_TEMPLATE`` (used for a tokenizer with its markers and no template), with the
``rollcall`` tool-call format. ``prompt_text`` and ``observation_text`` render that template's
segments as text, for the warm start's transcripts and the tokenizer's training corpus.
"""

from __future__ import annotations

import itertools
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from rollcall.tasks.base import Tool
from rollcall.workers.episode.toolcalls import (
    Action,
    Answer,
    Malformed,
    ParsedCall,
    ToolFormat,
    default_format,
    get_format,
)

__all__ = [
    "ROLLCALL_TEMPLATE",
    "Answer",
    "Chat",
    "ChatTemplateError",
    "Malformed",
    "ParsedCall",
    "observation_text",
    "parse_turn",
    "prompt_text",
]

SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL = "<|tool|>"
END = "<|end|>"
SPECIAL_TOKENS = (SYSTEM, USER, ASSISTANT, TOOL, END)

# The tiny model's format as a chat template: "<|role|>\n{content}\n", an assistant message
# ending with <|end|> (its end-of-turn token), and "<|assistant|>\n" as the generation prompt.
ROLLCALL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{ '<|end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_PROBE = "Probe reply 1."
_PROBE_2 = "Probe reply 2."
_PROBE_USER = "Probe question?"
_PROBE_TOOL = Tool(
    "probe", "A probe tool.", {"type": "object", "properties": {"x": {"type": "string"}}}
)
_TOOLS_RE = re.compile(r"\btools\b")


class ChatTemplateError(ValueError):
    """A chat template (or tokenizer) the agent loop cannot use token-in/token-out."""


def render(template: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """``template`` rendered as ``apply_chat_template(..., tokenize=False)`` renders it."""
    from transformers.utils.chat_template_utils import render_jinja_template

    out: Any = render_jinja_template([messages], chat_template=template, **kwargs)
    return str(out[0][0])


def plain_backend(tokenizer: Any) -> Any | None:
    """The Rust backend of a fast tokenizer whose ``encode`` and ``decode`` are transformers'
    own, or None. For one text without special tokens added, transformers' ``encode`` is the
    backend's ``encode`` (no truncation, no padding) and ``decode`` the backend's ``decode``
    (when it cleans up no spaces), behind a per-call Python layer that costs about twice the
    work for the few tokens of a turn's segment; ``Chat`` calls the backend directly."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if not isinstance(tokenizer, TokenizersBackend):
        return None
    kind = type(tokenizer)
    own = (
        kind.encode is PreTrainedTokenizerBase.encode
        and kind._encode_plus is TokenizersBackend._encode_plus
        and kind.decode is PreTrainedTokenizerBase.decode
        and kind._decode is TokenizersBackend._decode
    )
    return tokenizer._tokenizer if own else None


def _head(system: str, user: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def _tool(text: str) -> dict[str, Any]:
    return {"role": "tool", "content": text}


def prompt_text(tools: list[Tool], instructions: str) -> str:
    """The tiny model's prompt (system with its tools, user, assistant header) as text."""
    system = get_format("rollcall").system_text(tools, False)
    return render(ROLLCALL_TEMPLATE, _head(system, instructions), add_generation_prompt=True)


def observation_text(observation: str) -> str:
    """The tiny model's observation segment: what follows a generated turn's ``<|end|>``."""
    before = render(ROLLCALL_TEMPLATE, [_assistant(_PROBE)])
    after = render(
        ROLLCALL_TEMPLATE, [_assistant(_PROBE), _tool(observation)], add_generation_prompt=True
    )
    return before[before.index(_PROBE) + len(_PROBE) + len(END) :] + after[len(before) :]


def parse_turn(text: str) -> Action:
    """A turn of the tiny model's format (``rollcall``), its ``<|end|>`` ignored."""
    return get_format("rollcall").parse(text.replace(END, ""))


def _model_type(tokenizer: Any) -> str | None:
    where = getattr(tokenizer, "name_or_path", None)
    if not where:
        return None
    config = Path(str(where)) / "config.json"
    try:
        value = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, str) else None


def has_rollcall_markers(tokenizer: Any) -> bool:
    """Whether every chat marker of the tiny model's format is one token of ``tokenizer``."""
    for marker in SPECIAL_TOKENS:
        ids = list(tokenizer.encode(marker, add_special_tokens=False))
        if len(ids) != 1:
            return False
    return True


class Chat:
    """A tokenizer's chat template and a tool-call format, checked for token-in/token-out use.

    ``tool_format``: a name from ``toolcalls.FORMATS`` or ``auto`` (``rollcall`` for the tiny
    model's tokenizer, else by the model family in its ``config.json``). ``template``: a chat
    template's source to use instead of the tokenizer's own."""

    def __init__(
        self, tokenizer: Any, *, tool_format: str = "auto", template: str | None = None
    ) -> None:
        self.tokenizer = tokenizer
        markers = has_rollcall_markers(tokenizer)
        name = (
            default_format(_model_type(tokenizer), rollcall_markers=markers)
            if tool_format == "auto"
            else tool_format
        )
        self.format: ToolFormat = get_format(name)
        source = template or getattr(tokenizer, "chat_template", None)
        if not source and markers:
            source = ROLLCALL_TEMPLATE
        if not isinstance(source, str) or not source:
            raise ChatTemplateError(
                "the tokenizer has no chat template; give one with model.chat_template"
            )
        self.template: str = source
        self.renders_tools = bool(_TOOLS_RE.search(source))
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ChatTemplateError("the tokenizer has no end-of-turn (eos) token")
        self.eos_id = int(eos)
        self.eos_text = str(tokenizer.decode([self.eos_id]))
        special = getattr(tokenizer, "special_tokens_map", None)
        self._special: dict[str, Any] = dict(special) if isinstance(special, dict) else {}
        self._special.setdefault("eos_token", self.eos_text)
        self._backend = plain_backend(tokenizer)
        self._split_special = bool(getattr(tokenizer, "split_special_tokens", False))
        self._clean_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._closing = self._check()

    # -- rendering ------------------------------------------------------------------------

    def _render(
        self, messages: list[dict[str, Any]], tools: list[Tool], *, generation: bool = False
    ) -> str:
        schemas = (
            [{"type": "function", "function": t.to_json()} for t in tools]
            if tools and self.renders_tools
            else None
        )
        try:
            return render(
                self.template,
                messages,
                tools=schemas,
                add_generation_prompt=generation,
                **self._special,
            )
        except Exception as e:  # the template raised (e.g. an unsupported role)
            raise ChatTemplateError(f"the chat template cannot render the conversation: {e}") from e

    def head(self, tools: list[Tool], instructions: str) -> list[dict[str, Any]]:
        """The system message (how to use the tools, per the format) and the user's task."""
        return _head(self.format.system_text(tools, self.renders_tools), instructions)

    def _encode(self, text: str) -> list[int]:
        backend = self._backend
        if (  # the backend as transformers' encode sets it: nothing left on by another caller
            backend is not None
            and backend.truncation is None
            and backend.padding is None
            and backend.encode_special_tokens == self._split_special
        ):
            return list(backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def messages_ids(self, messages: list[dict[str, Any]], tools: list[Tool]) -> list[int]:
        """A conversation's first segment: ``messages`` rendered with the generation prompt."""
        return self._encode(self._render(messages, tools, generation=True))

    def extension_base(
        self, before: list[dict[str, Any]], tools: list[Tool]
    ) -> tuple[list[dict[str, Any]], str]:
        """What ``extension_ids`` renders new messages after, for a conversation ``before``
        (its messages before the first assistant message, then one probe assistant message)
        and that rendered: the same for every extension of one conversation, so a caller that
        extends it turn after turn renders it once."""
        first = next((i for i, m in enumerate(before) if m["role"] == "assistant"), len(before))
        base = [*before[:first], _assistant(_PROBE)]
        return base, self._render(base, tools)

    def extension_ids(
        self,
        before: list[dict[str, Any]],
        new: list[dict[str, Any]],
        tools: list[Tool],
        *,
        ended: bool,
        base: tuple[list[dict[str, Any]], str] | None = None,
    ) -> list[int]:
        """The segment after a generated turn that ends ``before``: the rest of the assistant
        message's closing, the ``new`` (user or tool) messages and the next assistant header,
        found as what rendering ``new`` adds after the conversation's
        head (its messages before the first assistant message) and one probe assistant
        message (``extension_base``; ``base``: its value for ``before``, already rendered).
        The cost is the head's and ``new``'s, not the conversation's: a template is
        prefix-stable (``_check``) and renders a message by what precedes it at most one
        message back, as the templates of the families in ``toolcalls`` do."""
        probe, text_before = base if base is not None else self.extension_base(before, tools)
        after = self._render([*probe, *new], tools, generation=True)
        if not after.startswith(text_before):
            raise ChatTemplateError(
                "the chat template is not prefix-stable for this conversation: rendering the "
                "new messages changes the earlier ones"
            )
        closing = self._closing if ended else self.eos_text + self._closing
        return self._encode(closing + after[len(text_before) :])

    def turn_text(self, token_ids: list[int]) -> str:
        """A generated turn's text, its end-of-turn token removed: the reply's content and what
        the tool-call format reads (``reply_of`` decodes a turn once, here)."""
        body = list(token_ids)
        if body and body[-1] == self.eos_id:
            body.pop()
        if self._backend is not None and not self._clean_up:
            return str(self._backend.decode(body, skip_special_tokens=False))
        return str(self.tokenizer.decode(body, skip_special_tokens=False))

    def parse(self, token_ids: list[int]) -> Action:
        """A generated turn, read by the tool-call format (its end-of-turn token removed)."""
        return self.format.parse(self.turn_text(token_ids))

    # -- the start-up check ---------------------------------------------------------------

    def _check(self) -> str:
        """Check prefix stability (module docstring) on a probe conversation; return what the
        template writes after an assistant message's end-of-turn token."""
        tools = [_PROBE_TOOL]
        head = self.head(tools, _PROBE_USER)
        prompt = self._render(head, tools, generation=True)
        one = self._render([*head, _assistant(_PROBE)], tools)
        if not one.startswith(prompt + _PROBE):
            raise ChatTemplateError(
                "the chat template's generation prompt is not what precedes an assistant "
                "message, so generated turns cannot be kept as generated"
            )
        tail = one[len(prompt) + len(_PROBE) :]
        if not tail.startswith(self.eos_text):
            raise ChatTemplateError(
                f"the chat template does not end an assistant message with the end-of-turn "
                f"token {self.eos_text!r} that generation stops at"
            )
        with_tool = self._render([*head, _assistant(_PROBE), _tool("42")], tools, generation=True)
        more = [*head, _assistant(_PROBE), _tool("42"), _assistant(_PROBE_2)]
        two = self._render(more, tools)
        if not with_tool.startswith(one) or not two.startswith(with_tool + _PROBE_2):
            raise ChatTemplateError(
                "the chat template is not prefix-stable: rendering one more message changes "
                "the earlier messages' text (for example it rewrites earlier assistant turns)"
            )
        ids = [self._encode(s) for s in (prompt, one, with_tool, two)]
        for shorter, longer in itertools.pairwise(ids):
            if longer[: len(shorter)] != shorter:
                raise ChatTemplateError(
                    "the chat template is not prefix-stable in tokens: a message boundary "
                    "merges into one token with the text around it"
                )
        return tail[len(self.eos_text) :]


@lru_cache(maxsize=32)
def _cached(tokenizer: Any, tool_format: str, template: str | None) -> Chat:
    return Chat(tokenizer, tool_format=tool_format, template=template)


def chat_for(tokenizer: Any, tool_format: str = "auto", template: str | None = None) -> Chat:
    """The ``Chat`` of a tokenizer, made (and checked) once per tokenizer object."""
    return _cached(tokenizer, tool_format, template)
