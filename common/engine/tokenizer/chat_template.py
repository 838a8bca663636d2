"""A model's jinja chat template, rendered the way transformers' apply_chat_template(tokenize=False) renders it.

Templates are written against transformers' renderer, so everything that renderer gives them is given here
too, and nothing more: the same environment (trim_blocks, lstrip_blocks, loop controls, a sandbox), the same
helpers (raise_exception, strftime_now, a tojson that leaves <, > and & alone) and the same variables
(messages with None-valued keys dropped, add_generation_prompt, tools=None, documents=None, and the named
special tokens as text: bos_token, eos_token, unk_token, pad_token). date_string is not passed, as transformers
does not pass it: Llama 3.1 then writes its own default date, and Llama 3.2 asks strftime_now for today's.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.engine.tokenizer.errors import TokenizerError

# HF's old default: the template for a model that ships none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplate:
    """One compiled template and the special tokens it is rendered with."""

    def __init__(self, source: str | None, special_tokens: Mapping[str, str], origin: Path) -> None:
        self.source = source or CHATML_TEMPLATE
        self.special_tokens = dict(special_tokens)  # "bos_token" -> "<s>", ...
        try:
            self._template = _ENV.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"{origin}: the chat template does not compile ({e})") from e

    @property
    def takes_tools(self) -> bool:
        """Whether the template renders a `tools` list (one that never names it would drop them silently)."""
        return "tools" in self.source

    def render(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, object]] | None = None) -> str:
        """The prompt text; TokenizerError carrying the template's own message when it rejects the messages
        (Gemma's "System role not supported", a Llama template's "Conversation roles must alternate")."""
        try:
            return self._template.render(
                # transformers drops None-valued keys: templates test for a key, not for a None in it.
                messages=[{k: v for k, v in m.items() if v is not None} for m in messages],
                tools=list(tools) if tools else None, documents=None, add_generation_prompt=add_generation_prompt,
                **self.special_tokens)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            # TypeError / ValueError: a template that adds a string to a missing value, or calls a filter badly.
            raise TokenizerError(f"the chat template rejected the messages: {e}") from e


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


# The sandbox because chat templates come with downloaded models. Immutable, so one environment serves every
# template; rendering keeps no state in it.
_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
_ENV.filters["tojson"] = _tojson
