"""`kiln run`: one-shot generation or an interactive chat, streamed as tokens arrive."""

from __future__ import annotations

import argparse
import sys

from kiln.errors import KilnError

HELP = """Commands:
  /set temperature|top_p|top_k|min_p|seed|num_predict|system|format VALUE
  /set noformat   answer in free text again
  /set think [low|medium|high]   think before answering (thinking models)
  /set nothink    answer without thinking
  /show      model details        /verbose   toggle timing stats
  /save NAME keep this model with the chat's system message and sampling as a new model
  /load NAME continue the chat with another model
  /clear     forget the chat      /bye       exit
  /?         this help
Start a message with \"\"\" to write several lines; end it with \"\"\"."""
QUOTE = '"""'


def register(sub) -> None:
    p = sub.add_parser("run", help="chat with a model, or answer one prompt",
                       description="Run a model: one-shot with PROMPT (or piped stdin), otherwise an interactive chat.")
    p.add_argument("model", nargs="?", default=None, help="tag (e.g. smollm2:135m) or path to a .gguf")
    p.add_argument("prompt", nargs="*", help="prompt for a one-shot answer")
    add_generation_args(p)
    add_draft_args(p)
    p.add_argument("--system", help="system message")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--format", metavar="json|SCHEMA",
                   help="answer in JSON: 'json' for any object, or a JSON schema the answer must match "
                        "(inline, or a file holding it)")
    p.add_argument("--think", nargs="?", const="true", metavar="true|false|low|medium|high",
                   help="thinking models: think before answering (default: the model's own default), or not")
    p.add_argument("--hidethinking", action="store_true", help="do not show the model's thinking, only its answer")
    p.add_argument("--verbose", action="store_true", help="print timing stats after each answer")
    p.set_defaults(func=cmd_run)


def add_generation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--temperature", type=float, help="0 for greedy (default 0.8)")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--min-p", type=float)
    g.add_argument("--repeat-penalty", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("-n", "--num-predict", type=int,
                   help="most tokens to generate (default, or negative: until the context is full)")
    g.add_argument("-c", "--ctx-len", type=int, help="context length (default min(model's, 4096))")
    g.add_argument("--kv-cache", help="KV cache type: f16, q8_0 or q4_0 (env KILN_KV_CACHE_TYPE; default f16)")
    g.add_argument("-t", "--threads", type=int, help="native threads (default: physical cores)")
    g.add_argument("--backend", default="auto", choices=["auto", "native", "oracle"], help="compute backend")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    # Ranges are checked by SpecOptions, so registering the command does not import the engine.
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--draft", metavar="MODE",
                   help="none, lookup (draft tokens by prompt lookup) or model (with --draft-model): drafts the "
                        "model checks in one pass (default: model with --draft-model, else none)")
    g.add_argument("--draft-model", metavar="TAG", help="a smaller model with the same vocabulary that drafts tokens")
    g.add_argument("--draft-max", type=int, metavar="K", help="most draft tokens per pass (default 8)")
    g.add_argument("--ngram", type=int, metavar="N", help="longest n-gram prompt lookup matches (default 4)")


def spec_from_args(args):
    """The speculative decoding options the flags ask for; errors name the flag."""
    from kiln.engine.speculative import SpecOptions

    mode = args.draft or ("model" if args.draft_model else "none")
    if mode == "model" and not args.draft_model:
        raise KilnError("--draft model needs --draft-model TAG")
    return SpecOptions().replace(("--draft", "--draft-max", "--ngram"), mode=mode, max=args.draft_max,
                                 ngram=args.ngram)


def sampling_from_args(args) -> dict:
    """The sampling values the command line sets, over the model's defaults (None: not set)."""
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "repeat_penalty": args.repeat_penalty, "seed": args.seed}


ANY_JSON = "json"  # as kiln.engine.request.ANY_JSON, which registering the command does not import
# kiln's request fields, as this command's flags name them
FLAGS = {"format": "--format", "max_tokens": "--num-predict", "think": "--think", "speculative.mode": "--draft",
         "speculative.max": "--draft-max", "speculative.ngram": "--ngram"}


def think_value(value: str | None, name: str = "--think") -> bool | str | None:
    """--think's value: None (the template's default), True, False or an effort."""
    if value is None:
        return None
    word = value.lower()
    if word in ("true", "false"):
        return word == "true"
    if word in ("low", "medium", "high"):
        return word
    raise KilnError(f"{name}: expected true, false, low, medium or high, got {value!r}")


def output_format(value: str | None):
    """--format's value: None (free text), ANY_JSON, or a JSON schema (a dict), given inline or as a file."""
    import json
    from pathlib import Path

    from kiln.engine.grammar import json_grammar

    if value is None or value == ANY_JSON:
        return value
    try:
        schema = json.loads(value)
    except ValueError as e:
        if value.lstrip()[:1] in ("{", "["):
            raise KilnError(f"--format: {value!r} is not valid JSON ({e})") from None
        try:  # a file holding the schema
            schema = json.loads(Path(value).read_text())
        except OSError as e:
            raise KilnError(f"--format: expected json, a JSON schema or a file holding one; cannot read {value!r} "
                            f"({e.strerror})") from None
        except ValueError as e:
            raise KilnError(f"--format: {value} does not hold valid JSON ({e})") from None
    json_grammar(schema, "--format")  # an unusable schema fails here, before the model loads
    return schema


class Chat:
    """A conversation through a scheduler of one KV slot, whose prompt cache reuses the KV of the prefix
    each turn shares with the last."""

    def __init__(self, model, sampling, num_predict, system, raw, spec=None, drafter=None):
        from kiln.engine.speculative import SpecOptions

        self.model, self.num_predict, self.system, self.raw = model, num_predict, system, raw
        self.sampling: dict = dict(sampling or {})  # the command line's and /set's values over the model's
        self.spec, self.drafter = spec or SpecOptions(), drafter  # speculative decoding, and the draft model
        self.messages: list[dict] = []
        self.verbose = False
        self.format = None  # None, ANY_JSON or a JSON schema: what the answer must be
        self.think: bool | str | None = None  # thinking on, off or an effort; None: the template's default
        self.hide_thinking = False  # thinking models: show only the answer
        self.load_options: dict = {}  # how /load loads another model: backend, context, threads
        self._scheduler = None
        self.last = None  # the last answer's Sequence: its tokens, text and timings

    @property
    def params(self):
        """The sampling parameters an answer gets."""
        from kiln.engine.request import sampling_params

        return sampling_params(self.model, self.sampling)

    @property
    def scheduler(self):
        """The model's scheduler, made at the first answer (and again after /load)."""
        from kiln.engine.scheduler import Scheduler

        if self._scheduler is None or self._scheduler.engine is not self.model.engine:
            self._scheduler = Scheduler(self.model.engine, n_slots=1, max_queue=0)
        return self._scheduler

    def clear(self) -> None:
        self.messages = []

    def request(self, text: str):
        from kiln.engine.request import GenerationRequest

        turn = {"max_tokens": self.num_predict, "sampling": self.sampling, "format": self.format, "think": self.think}
        if self.raw:
            return GenerationRequest(prompt=text, raw=True, **turn)
        system = [{"role": "system", "content": self.system}] if self.system else []
        return GenerationRequest(messages=system + self.messages + [{"role": "user", "content": text}], **turn)

    def ask(self, text: str, out=None) -> None:
        from rich.console import Console

        from kiln.engine.generate import generate
        from kiln.engine.request import prepare
        from kiln.errors import fields_named
        from kiln.tools import Reasoning

        out = out or sys.stdout  # looked up per call: sys.stdout may be replaced after import
        dim = Console(file=out, highlight=False, soft_wrap=True)  # plain text where out is no terminal
        with fields_named(FLAGS):
            seq, parser = prepare(self.model, self.request(text), self.drafter, self.spec)
        self.last = seq
        answer, reasoning = [], []
        for item in parsed(generate(self.scheduler, seq), parser):
            if isinstance(item, Reasoning):
                if not reasoning and not self.hide_thinking:
                    dim.print("Thinking...", style="dim", markup=False)
                reasoning.append(item.text)
                if not self.hide_thinking:
                    dim.print(item.text, style="dim", markup=False, end="")
                continue
            if reasoning and not answer and not self.hide_thinking:
                out.write("\n\n")
            answer.append(item)  # text: kiln run offers no tools, so the parser yields no calls
            out.write(item)
            out.flush()
        out.write("\n")
        out.flush()
        self.messages += [{"role": "user", "content": text},
                          {"role": "assistant", "content": "".join(answer), "thinking": "".join(reasoning)}]
        if self.verbose:
            print_stats(seq, self.model, file=sys.stderr)


def parsed(pieces, parser):
    """The reply's pieces as the output parser splits them (reasoning, text, tool calls), as they arrive."""
    if parser is None:
        yield from pieces
        return
    for piece in pieces:
        yield from parser.feed(piece)
    yield from parser.close()


def print_stats(seq, model, file) -> None:
    t = seq.timings
    used = len(seq.all_ids)
    print(
        f"prompt tokens:   {t.prompt_tokens} ({t.cached_tokens} cached)\n"
        f"context used:    {used} / {model.n_ctx} ({100.0 * used / model.n_ctx:.1f}%)\n"
        f"load time:       {model.load_ms:.0f} ms\n"
        f"TTFT:            {t.ttft_ms:.1f} ms\n"
        f"prefill:         {t.prefill_tps:.1f} tok/s\n"
        f"decode:          {t.decode_tps:.1f} tok/s ({t.completion_tokens} tokens)\n"
        f"finish reason:   {seq.finish_reason}",
        file=file,
    )
    if t.draft_tokens:
        print(f"draft:           {t.draft_accepted} of {t.draft_tokens} tokens accepted "
              f"({100.0 * t.draft_accepted / t.draft_tokens:.1f}%), "
              f"{(t.completion_tokens - 1) / max(t.decode_passes, 1):.2f} tokens per pass", file=file)


def cmd_run(args) -> int:
    from kiln.engine.model import load
    from kiln.store.catalog import DEFAULT_MODEL

    prompt = " ".join(args.prompt)
    if not prompt and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    spec = spec_from_args(args)
    answer_format = output_format(args.format)
    model = load(args.model or DEFAULT_MODEL, backend=args.backend, n_ctx=args.ctx_len, threads=args.threads,
                 kv_cache=args.kv_cache)
    drafter = None
    if spec.mode == "model":
        from kiln.engine.speculative import ModelDrafter

        draft = load(args.draft_model, backend=args.backend, n_ctx=model.n_ctx, threads=args.threads)
        drafter = ModelDrafter(draft, model)
    system = args.system if args.system is not None else model.system
    num_predict = None if args.num_predict is not None and args.num_predict < 0 else args.num_predict  # as Ollama's -1
    chat = Chat(model, sampling_from_args(args), num_predict, system, args.raw, spec, drafter)
    chat.verbose = args.verbose
    chat.format = answer_format
    chat.think, chat.hide_thinking = think_value(args.think), args.hidethinking
    chat.load_options = {"backend": args.backend, "n_ctx": args.ctx_len, "threads": args.threads,
                         "kv_cache": args.kv_cache}
    if prompt:
        chat.ask(prompt)
        return 0
    return interactive(chat)


def interactive(chat: Chat) -> int:
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    print(f"kiln: chatting with {chat.model.tag}. /? for help, /bye to exit.", file=sys.stderr)
    while True:
        try:
            line = read_message()
        except EOFError:
            print()
            return 0
        if not line:
            continue
        if line.startswith("/"):
            if slash_command(chat, line):
                return 0
            continue
        try:
            chat.ask(line)
        except KeyboardInterrupt:
            print()
        except KilnError as e:
            print(f"kiln: error: {e}", file=sys.stderr)


def read_message() -> str:
    """One line, or the lines between a triple quote that starts the message and one that ends it."""
    line = input(">>> ").strip()
    if not line.startswith(QUOTE):
        return line
    text = line[len(QUOTE):]
    while not text.endswith(QUOTE):
        text += "\n" + input("... ")
    return text[: -len(QUOTE)].strip()


def save_model(chat: Chat, name: str) -> None:
    """/save: a created model with the chat's system message and the sampling values that differ from
    the defaults (what `kiln create` makes from a Modelfile)."""
    from dataclasses import asdict

    from kiln.sampling import SamplingParams
    from kiln.modelfile import Recipe
    from kiln.store import Store

    default = asdict(SamplingParams())
    parameters = {k: v for k, v in asdict(chat.params).items() if v != default[k] and v is not None}
    if chat.model.stop:
        parameters["stop"] = list(chat.model.stop)
    base = chat.model.tag if chat.model.sha256 else str(chat.model.path)
    record = Store().create(name, Recipe(base, chat.system, parameters), progress=False)
    print(f"Created new model {record.tag!r}.", file=sys.stderr)


def load_model(chat: Chat, name: str) -> None:
    """/load: another model continues the conversation, with its own defaults and system message."""
    from kiln.engine.model import load

    if chat.drafter is not None:
        raise KilnError("/load cannot swap the model a --draft-model drafts for; start kiln run again")
    model = load(name, **chat.load_options)
    chat.model.close()
    chat.model, chat.sampling = model, {}
    chat.system = model.system
    print(f"Loaded {model.tag}; the chat goes on.", file=sys.stderr)


def slash_command(chat: Chat, line: str) -> bool:
    """Run a /command; True means exit."""
    words = line.split(maxsplit=2)
    cmd = words[0]
    if cmd in ("/bye", "/exit", "/quit"):
        return True
    if cmd == "/clear":
        chat.clear()
        print("Cleared the chat and its context.", file=sys.stderr)
    elif cmd == "/verbose":
        chat.verbose = not chat.verbose
        print(f"Verbose stats {'on' if chat.verbose else 'off'}.", file=sys.stderr)
    elif cmd == "/show":
        show_model(chat)
    elif cmd in ("/save", "/load") and len(words) == 2:
        try:
            (save_model if cmd == "/save" else load_model)(chat, words[1])
        except KilnError as e:
            print(f"kiln: error: {e}", file=sys.stderr)
    elif cmd == "/set" and len(words) == 3:
        set_option(chat, words[1], words[2])
    elif cmd == "/set" and words[1:] == ["noformat"]:
        chat.format = None
        print("Answers are free text again.", file=sys.stderr)
    elif cmd == "/set" and words[1:] == ["think"]:
        chat.think = True
        print("Thinking on.", file=sys.stderr)
    elif cmd == "/set" and words[1:] == ["nothink"]:
        chat.think = False
        print("Thinking off.", file=sys.stderr)
    elif cmd in ("/?", "/help"):
        print(HELP, file=sys.stderr)
    else:
        print(f"Unknown command {line!r}. /? for help.", file=sys.stderr)
    return False


def set_option(chat: Chat, name: str, value: str) -> None:
    try:
        if name == "system":
            chat.system = value
        elif name == "num_predict":
            chat.num_predict = int(value) if int(value) >= 0 else None
        elif name in ("temperature", "top_p", "min_p", "repeat_penalty", "top_k", "seed"):
            from kiln.sampling import SamplingParams

            number = int(value) if name in ("top_k", "seed") else float(value)
            SamplingParams().replace(**{name: number})  # its range, checked as a request's is
            chat.sampling = {**chat.sampling, name: number}
        elif name == "format":
            chat.format = output_format(value)
        elif name == "think":
            chat.think = think_value(value, "think")
        else:
            print(f"Unknown option {name!r}. /? for help.", file=sys.stderr)
            return
    except (ValueError, KilnError) as e:
        print(f"Invalid value for {name}: {e}", file=sys.stderr)
        return
    print(f"Set {name} to {value}.", file=sys.stderr)


def show_model(chat: Chat) -> None:
    m, c, p = chat.model, chat.model.config, chat.params
    print(
        f"model:        {m.tag} ({c.name})\narchitecture: {c.architecture}, {c.n_layers} layers, dim {c.dim}, "
        f"{c.n_heads} heads ({c.n_kv_heads} kv), vocab {c.vocab_size}\n"
        f"context:      {m.n_ctx} of {c.context_length}\nbackend:      {m.engine.name}\n"
        f"sampling:     temperature {p.temperature}, top_k {p.top_k}, top_p {p.top_p}, min_p {p.min_p}, "
        f"repeat_penalty {p.repeat_penalty}, seed {p.seed}\nnum_predict:  {chat.num_predict}\n"
        f"format:       {'free text' if chat.format is None else 'JSON' if chat.format == ANY_JSON else 'JSON schema'}\n"
        f"think:        {'default' if chat.think is None else chat.think}",
        file=sys.stderr,
    )
