"""The front door: a generation request in kiln's own terms, and the one function that turns it into a
`Sequence` the scheduler runs.

Every caller says what it wants in a `GenerationRequest`: both server APIs (openai.py, responses.py,
ollama.py), `kiln run`, the benchmarks and the tracer. `prepare` renders the chat template, encodes,
plans the budget, merges the sampling defaults, builds the grammar and the speculation, and checks
everything before anything is queued. Its errors name the request's fields by the names below
(`RequestError.param`); an API whose fields are named otherwise renames them at its edge
(kiln.errors.fields_named).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln import harmony, thinking
from kiln import tools as toolcalls
from kiln.engine import fim
from kiln.engine.sequence import Sequence, plan_budget
from kiln.engine.speculative import SpecOptions, speculation
from kiln.errors import ContextLengthError, Field, RequestError
from kiln.sampling import SamplingParams
from kiln.tools import OutputParser, ToolCallParser

if TYPE_CHECKING:
    from kiln.engine.model import Model
    from kiln.engine.speculative import ModelDrafter

ANY_JSON = "json"  # `format` asking for any JSON object
SPECULATIVE = ("speculative.mode", "speculative.max", "speculative.ngram")  # the fields SpecOptions checks


@dataclass
class GenerationRequest:
    messages: list[dict] | None = None  # a chat; otherwise `prompt`
    prompt: str | list[int] | None = None  # text, or token ids already
    system: str | None = None  # with a text prompt and raw False: the system message around it
    raw: bool = True  # send a text `prompt` as is, without the chat template
    context: list[int] | None = None  # token ids of an earlier exchange that the prompt continues
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"
    sampling: dict = field(default_factory=dict)  # SamplingParams overrides (None: keep the model's default)
    max_tokens: int | None = None  # None: until the context is full
    stop: list[str] = field(default_factory=list)  # empty: the model's own stop strings
    ignore_eos: bool = False  # no stop tokens or strings: generate exactly max_tokens (benchmarks)
    logprobs: int | None = None  # alternatives per token to report; None: no logprobs
    format: str | dict | None = None  # ANY_JSON, or a JSON schema the output must match
    speculative: dict = field(default_factory=dict)  # SpecOptions overrides: mode, max, ngram
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit before sampling
    embed: bool = False  # the prompt's final hidden state is wanted, not tokens
    think: bool | str | None = None  # thinking on or off, or an effort (low/medium/high); None: the template's default
    template_variables: dict = field(default_factory=dict)  # more variables for the chat template
    infill: fim.Infill | None = None  # fill in the middle between a prefix and a suffix; `prompt` unused


def sampling_params(model: Model, overrides: dict) -> SamplingParams:
    """kiln's defaults, then the model's (the catalog's, then a created model's), then the request's."""
    return SamplingParams().replace(**model.defaults).replace(**overrides)


def prepare(model: Model, request: GenerationRequest, drafter: ModelDrafter | None = None,
            speculative: SpecOptions = SpecOptions()) -> tuple[Sequence, OutputParser | None]:
    """The request's sequence (prompt ids, sampling, budget, stops, grammar, speculation), and the parser
    of its output when it offers tools or the template thinks. `speculative` is the caller's default,
    which the request's own options override; `drafter` the loaded draft model, if any."""
    from kiln.engine.grammar import Constraint, json_grammar

    tok = model.tokenizer
    use_tools = _uses_tools(request)
    toolcalls.check_tool_choice(request.tools, request.tool_choice)
    prompt_field = "messages" if request.messages is not None else "prompt"
    try:
        ids, reasoning = _prompt_ids(model, request, use_tools)
    except ContextLengthError as e:  # refused on its length, before all of it was encoded
        raise ContextLengthError((Field(prompt_field), ": ", *e.parts), prompt_field) from None
    if not ids:
        raise RequestError((Field(prompt_field), " is empty"), prompt_field)
    framed = isinstance(reasoning, harmony.HarmonyParser)  # gpt-oss's messages frame its calls
    if request.embed:
        budget = 1
    else:
        try:
            budget = plan_budget(len(ids), request.max_tokens, model.n_ctx)
        except ContextLengthError as e:
            raise ContextLengthError((Field(prompt_field), ": ", *e.parts), prompt_field) from None
    params = sampling_params(model, request.sampling)
    constraint = None
    if use_tools and request.tool_choice != "auto":
        forced = harmony.forced_call_grammar if framed else toolcalls.forced_call_grammar
        constraint = Constraint(tok, forced(request.tools, request.tool_choice), "tool_choice")
    elif request.format is not None:
        schema = None if request.format == ANY_JSON else request.format
        constraint = Constraint(tok, json_grammar(schema, "format"), "format")
    options = speculative.replace(SPECULATIVE, **request.speculative)
    bad = next((t for t in request.logit_bias or {} if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise RequestError(f"logit_bias names token id {bad}, outside the vocabulary (0..{tok.vocab_size - 1})",
                           "logit_bias")
    if request.ignore_eos:
        stop, stop_ids = [], frozenset()
    else:
        stop, stop_ids = [s for s in request.stop if s] or list(model.stop), tok.stop_ids
        if request.infill is not None:
            stop_ids |= fill_tokens(model).ends
    seq = Sequence(ids, params, tok, budget, stop=stop, stop_ids=stop_ids,
                   logprobs=request.logprobs, constraint=constraint, logit_bias=request.logit_bias,
                   speculation=speculation(options, drafter, SPECULATIVE[0]))
    if framed:  # its messages frame reasoning, answer and calls alike: one parser reads all three
        return seq, reasoning.with_tools(toolcalls.tool_names(request.tools) if use_tools else None)
    calls = ToolCallParser(toolcalls.tool_names(request.tools)) if use_tools else None
    if reasoning is not None and calls is not None:
        reasoning.ends_at = toolcalls.OPEN
    return seq, OutputParser(reasoning, calls) if reasoning or calls else None


def prompt_ids(model: Model, request: GenerationRequest) -> list[int]:
    """The prompt `prepare` would run, as token ids (the servers count and tokenize with this)."""
    toolcalls.check_tool_choice(request.tools, request.tool_choice)
    return _prompt_ids(model, request, _uses_tools(request))[0]


def chat_prompt(model: Model, request: GenerationRequest) -> str:
    """A chat request's `messages` (and tools) rendered by the model's chat template: the text `prepare` encodes."""
    toolcalls.check_tool_choice(request.tools, request.tool_choice)
    return _chat_text(model, request, _uses_tools(request))[0]


def _uses_tools(request: GenerationRequest) -> bool:
    return bool(request.tools) and request.tool_choice != "none"


def _chat_text(model: Model, request: GenerationRequest,
               use_tools: bool) -> tuple[str, thinking.ReasoningParser | harmony.HarmonyParser | None]:
    """A chat request's prompt text, and the parser of the reasoning its reply holds."""
    tok = model.tokenizer
    chat = request.messages or []
    if model.system is not None and not any(m.get("role") in ("system", "developer") for m in chat):
        chat = [{"role": "system", "content": model.system}, *chat]  # a created model's own system message
    chat = thinking.history_messages(chat, thinking.thinking_style(tok.chat_template))
    messages, template_tools = toolcalls.render_messages(chat, request.tools if use_tools else None,
                                                         tok.chat_template, request.tool_choice)
    return _render(model, request, messages, template_tools)


def fill_tokens(model: Model) -> fim.FimTokens:
    """The model's fill-in-the-middle tokens; a model without them cannot take a `suffix`."""
    tokens = fim.model_tokens(model)
    if tokens is None:
        raise RequestError((Field("suffix"), f": {model.tag} has no fill-in-the-middle tokens (prefix, suffix and "
                            "middle) in its vocabulary, so it cannot fill in the middle"), "suffix")
    return tokens


# Variables kiln itself gives every chat template; a request's own variables may not replace them.
_TEMPLATE_OWN = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _template_variables(model: Model, request: GenerationRequest,
                        style: thinking.ThinkingStyle | None) -> tuple[dict, bool]:
    """The variables the chat template gets for thinking, and whether the reasoning is wanted."""
    taken = next((k for k in request.template_variables if k in _TEMPLATE_OWN), None)
    if taken is not None:
        raise RequestError((Field("template_variables"), f" may not set {taken!r}, which kiln gives the template"),
                           "template_variables")
    variables = {**thinking.template_variables(style, request.think, model.tag), **request.template_variables}
    switch = variables.get(style.switch) if style is not None and style.switch else request.think
    return variables, switch is not False


def _render(model: Model, request: GenerationRequest, messages: list[dict],
            tools: list[dict] | None = None) -> tuple[str, thinking.ReasoningParser | harmony.HarmonyParser | None]:
    """The chat template's prompt, with the request's thinking switch, and the parser of the reasoning
    the reply holds when the template thinks (inside the block from the start when the prompt opens it)."""
    style = thinking.thinking_style(model.tokenizer.chat_template)
    variables, keep = _template_variables(model, request, style)
    text = model.tokenizer.apply_chat_template(messages, tools=tools, max_tokens=model.n_ctx, **variables)
    if style is None:
        return text, None
    if style.harmony:
        return text, harmony.HarmonyParser(keep)
    return text, thinking.ReasoningParser(style, text.rstrip().endswith(style.open), keep)


def _prompt_ids(model: Model, request: GenerationRequest,
                use_tools: bool) -> tuple[list[int], thinking.ReasoningParser | harmony.HarmonyParser | None]:
    """The prompt's token ids, and the parser of the reasoning the reply holds when the template thinks."""
    tok = model.tokenizer
    reasoning = None
    chat_template = request.infill is None and (request.messages is not None or
                                                (not request.raw and isinstance(request.prompt, str)))
    if not chat_template and (request.think is not None or request.template_variables):
        param = "think" if request.think is not None else "template_variables"
        raise RequestError((Field(param), " needs the chat template: the prompt is sent raw"), param)
    if request.infill is not None:
        ids = fim.prompt_ids(model, fill_tokens(model), request.infill)
    elif request.messages is not None:
        text, reasoning = _chat_text(model, request, use_tools)
        # a prompt longer than the context is refused before its tokens are counted out
        ids = tok.encode(text, max_tokens=model.n_ctx)
    elif isinstance(request.prompt, list):
        ids = token_ids(request.prompt, tok.vocab_size, "prompt")
    elif request.raw:
        ids = tok.encode(request.prompt, add_bos=None if not request.context else False, max_tokens=model.n_ctx)
    else:
        system = request.system or model.system
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": request.prompt}]
        text, reasoning = _render(model, request, messages)
        ids = tok.encode(text, add_bos=None if not request.context else False, max_tokens=model.n_ctx)
    if request.context:
        ids = token_ids(request.context, tok.vocab_size, "context") + ids
    return ids, reasoning


def token_ids(ids: list[int], vocab_size: int, param: str) -> list[int]:
    """`ids` checked against the vocabulary; errors name the field `param`."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError((Field(param), f" has token id {bad}, outside the vocabulary (0..{vocab_size - 1})"),
                           param)
    return list(ids)
