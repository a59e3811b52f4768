"""Chat templates: Jinja2 in a sandbox, set up the way transformers renders them.

A chat template comes inside a model file, so it is untrusted code: it runs in jinja2's
`ImmutableSandboxedEnvironment`, sees only plain JSON-like data, and any way it fails (bad syntax,
a sandbox violation, `raise_exception`, a runtime error) surfaces as `ChatTemplateError`.

The sandbox bounds neither work nor memory (two nested `range(100000)` loops never end), so templates
render in worker processes (`python -m kiln.chat`, at most _WORKERS) under a budget: RENDER_SECONDS of
time (past it the worker is killed and replaced), RENDER_MEMORY of address space, and an output length
the caller gives (what its context can hold). A template that never finishes costs its request the
budget and holds up nothing else for longer.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiln.errors import ContextLengthError, KilnError, RequestError

RENDER_SECONDS = 2.0  # a render's time budget; templates take about a millisecond (docs/PERF.md)
RENDER_MEMORY = 1 << 30  # the render worker's address space
_STARTUP_SECONDS = 60.0  # a worker's start (an interpreter and jinja2) on a busy machine
_WORKERS = 4  # renders at once; more wait their turn (each takes at most RENDER_SECONDS)


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
                max_chars: int | None = None, **extra: Any) -> str:
    """Render `messages` with `template`; `extra` becomes template variables (e.g. `enable_thinking`).
    Output longer than `max_chars` is a ContextLengthError: no prompt that long fits the context."""
    chat = []
    for i, message in enumerate(_plain(messages)):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] is {message!r}, not an object with a role and content", "messages")
        # Absent and None mean the same to a caller (OpenAI clients send `content: null`), not to templates.
        chat.append({k: v for k, v in message.items() if v is not None})
    if max_chars is not None and _text_length(chat) > max_chars:  # templates render every message in full
        raise ContextLengthError(f"the messages are {_text_length(chat)} characters, more than the context can "
                                 f"hold (at most {max_chars}); kiln does not truncate prompts")
    variables = dict(messages=chat, tools=_plain(tools), add_generation_prompt=add_generation_prompt,
                     bos_token=bos_token, eos_token=eos_token, **_plain(extra))
    answer = _render_in_worker({"template": template, "variables": variables, "max_chars": max_chars})
    if "text" in answer:
        return answer["text"]
    if "too_long" in answer:
        raise ContextLengthError(f"the prompt the chat template renders is over {max_chars} characters, "
                                 "more than the context can hold; kiln does not truncate prompts")
    raise ChatTemplateError(answer["error"])


def _text_length(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(map(_text_length, value.values()))
    if isinstance(value, list):
        return sum(map(_text_length, value))
    return 0


def _render(template: str, variables: dict, max_chars: int | None) -> dict:
    """One render, in the worker: {"text"}, {"too_long"} or {"error"}."""
    try:
        compiled = _compile(template)
        if max_chars is None:
            return {"text": compiled.render(**variables)}
        parts, length = [], 0
        for part in compiled.generate(**variables):
            length += len(part)
            if length > max_chars:
                return {"too_long": True}
            parts.append(part)
        return {"text": "".join(parts)}
    except ChatTemplateError as e:
        return {"error": str(e)}
    except jinja2.TemplateError as e:
        return {"error": f"chat template failed: {type(e).__name__}: {e}"}
    except MemoryError:
        return {"error": f"chat template needed more than its {RENDER_MEMORY >> 20} MiB of memory"}
    except RecursionError:
        return {"error": "chat template nests or recurses too deeply"}
    except Exception as e:  # the template is untrusted code; whatever it trips over is its failure, not ours
        return {"error": f"chat template failed while rendering: {type(e).__name__}: {e}"}


class _Worker:
    """A `python -m kiln.chat` process: a request as a line of JSON on its stdin, the answer on its stdout."""

    def __init__(self):
        root = str(Path(__file__).resolve().parent.parent)  # this kiln, however the parent found it
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen([sys.executable, "-m", "kiln.chat"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        env={**os.environ, "PYTHONPATH": path})
        if self._read(_STARTUP_SECONDS) != {"ready": True}:
            self.close()
            raise KilnError("the chat template renderer did not start (python -m kiln.chat)")

    def ask(self, request: bytes, seconds: float) -> dict | None:
        """The answer, or None when the worker died or ran out of time (it is killed then)."""
        try:
            self.process.stdin.write(request)
            self.process.stdin.flush()
        except OSError:
            self.close()
            return None
        answer = self._read(seconds)
        if answer is None:
            self.close()
        return answer

    def _read(self, seconds: float) -> dict | None:
        if not select.select([self.process.stdout], [], [], seconds)[0]:
            return None
        line = self.process.stdout.readline()
        try:
            return json.loads(line) if line else None
        except ValueError:  # not what the worker writes: something the template reached did
            return None

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:  # a broken pipe to a dead worker
                pass


_idle: list[_Worker] = []
_idle_lock = threading.Lock()
_turns = threading.BoundedSemaphore(_WORKERS)  # a burst of requests starts no more workers than this


def warm() -> None:
    """Start a worker now, so that the first render does not wait for one (if none starts, that render
    says so)."""
    with _turns:
        try:
            _give_back(_take())
        except KilnError:
            pass


def _take() -> _Worker:
    with _idle_lock:
        worker = _idle.pop() if _idle else None
    return worker if worker is not None and worker.process.poll() is None else _Worker()


def _give_back(worker: _Worker) -> None:
    with _idle_lock:
        _idle.append(worker)


def _render_in_worker(request: dict) -> dict:
    line = (json.dumps(request) + "\n").encode()
    with _turns:
        worker = _take()
        answer = worker.ask(line, RENDER_SECONDS)
        if answer is not None:
            _give_back(worker)
            return answer
    code = worker.process.returncode
    if code is not None and code < 0 and code != -9:  # a signal of its own: a crash, not our kill
        return {"error": f"chat template crashed the renderer (signal {-code})"}
    return {"error": f"chat template did not finish rendering within its {RENDER_SECONDS:g} s budget"}


@atexit.register
def _stop_workers() -> None:
    with _idle_lock:
        while _idle:
            _idle.pop().close()


def _serve() -> None:
    """The worker's loop. It limits its own memory, and leaves when its parent does (a parent killed
    mid-render cannot close the pipe the loop would notice)."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (RENDER_MEMORY, RENDER_MEMORY))
    parent = os.getppid()

    def orphaned():
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        answer = _render(request["template"], request["variables"], request["max_chars"])
        try:
            text = json.dumps(answer)
        except MemoryError:
            text = json.dumps({"error": f"chat template needed more than its {RENDER_MEMORY >> 20} MiB of memory"})
        out.write(text + "\n")
        out.flush()


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
    except RecursionError:  # `{% if %}` nested thousands deep
        raise ChatTemplateError("chat template nests too deeply to compile") from None


if __name__ == "__main__":
    _serve()
