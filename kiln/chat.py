"""Chat templates: Jinja2 in a sandbox, set up the way transformers renders them.

A chat template comes inside a model file, so it is untrusted code: it runs in jinja2's
`ImmutableSandboxedEnvironment`, sees only plain JSON-like data, and any way it fails (bad syntax,
a sandbox violation, `raise_exception`, a runtime error) surfaces as `ChatTemplateError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import KilnError, RequestError


class ChatTemplateError(KilnError):
    """A chat template that does not compile, or fails while rendering."""


# Used by templates that take a message's content either as a string or as OpenAI-style parts.
_TEXT_MACRO = (
    "{% macro text(content) %}{% if content is string %}{{ content }}{% else %}"
    "{% for part in content if part.type == 'text' %}{{ part.text }}{% endfor %}{% endif %}{% endmacro %}"
)
CHATML_TEMPLATE = _TEXT_MACRO + (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ text(m.content) }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma has no system role: the system prompt opens the first user turn, as in Gemma's own template.
GEMMA_TEMPLATE = _TEXT_MACRO + (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% set ns.system = ns.system + text(m.content) + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% if m.role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ text(m.content) | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA3_TEMPLATE = _TEXT_MACRO + (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{{ text(m.content) | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
PLAIN_TEMPLATE = _TEXT_MACRO + (
    "{% for m in messages %}{% if m.role == 'system' %}{{ text(m.content) }}\n\n"
    "{% elif m.role == 'user' %}User: {{ text(m.content) }}\n"
    "{% else %}Assistant: {{ text(m.content) }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def fallback_template(token_to_id: Callable[[str], int | None]) -> str:
    """A template for a file that has none, chosen by the turn markers its vocabulary has."""

    def has(*names: str) -> bool:
        return all(token_to_id(name) is not None for name in names)

    if has("<|im_start|>", "<|im_end|>"):
        return CHATML_TEMPLATE
    if has("<start_of_turn>", "<end_of_turn>"):
        return GEMMA_TEMPLATE
    if has("<|start_header_id|>", "<|eot_id|>"):
        return LLAMA3_TEMPLATE
    return PLAIN_TEMPLATE


def render_chat(template: str, messages: list[Mapping[str, Any]], *, tools: list[dict] | None = None,
                add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "",
                **extra: Any) -> str:
    """Render `messages` with `template`; `extra` becomes template variables (e.g. `enable_thinking`)."""
    compiled = _compile(template)
    chat = []
    for i, message in enumerate(_plain(messages)):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] is {message!r}, not an object with a role and content", "messages")
        # Absent and None mean the same to a caller (OpenAI clients send `content: null`), not to templates.
        chat.append({k: v for k, v in message.items() if v is not None})
    try:
        return compiled.render(messages=chat, tools=_plain(tools), add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **_plain(extra))
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    except Exception as e:  # the template is untrusted code; whatever it trips over is its failure, not ours
        raise ChatTemplateError(f"chat template failed while rendering: {type(e).__name__}: {e}") from None


def _plain(value: Any) -> Any:
    """Rebuild data out of plain JSON types, so the template reaches no methods of caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):  # pydantic models, as API request bodies arrive
        return _plain(value.model_dump())
    for base in (bool, int, float, str):  # subclasses such as enums carry extra methods
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; it renders as is."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja2's own `tojson` escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, which could reach interpreter internals."""

    def __init__(*args, **kwargs):  # noqa: N805 - same signature trick as jinja2's Namespace
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        super().__setitem__(name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj, attribute):
        # jinja2 hands back an Undefined, which prints as ""; a template probing internals should fail loudly.
        raise jinja2.exceptions.SecurityError(f"access to {type(obj).__name__}.{attribute} is not allowed")


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace,
                       dict=lambda *args, **kwargs: dict(*args, **kwargs))
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error on line {e.lineno}: {e.message}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None
