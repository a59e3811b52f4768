"""Ollama's API (/api): chat, generate and model management, translated to and from `generation.Job`.

Streaming is newline-delimited JSON, on by default as in Ollama. Final objects carry Ollama's durations
in nanoseconds plus kiln's `timings` (queue wait, TTFT, cached prompt tokens, prefill and decode tok/s,
draft tokens proposed and accepted).

Speculative decoding per request, in `options` (kiln's own): `draft` none, lookup (prompt lookup) or
model (the server's --draft-model), `draft_max` (most draft tokens per pass), `draft_ngram` (longest
n-gram prompt lookup matches); unset ones take the server's defaults. Requests under a grammar (`format`,
a forced tool call) never speculate.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from kiln import __version__
from kiln.engine.fim import Infill
from kiln.engine.speculative import MAX_DRAFT, MAX_NGRAM
from kiln.engine.request import ANY_JSON, GenerationRequest
from kiln.errors import KilnError, ModelFileError, RequestError, StoreError, describe_os_error, fields_named, without_paths
from kiln.server.openai import Tool
from kiln.server.embeddings import embed_inputs, unit_vectors
from kiln.server.generation import Delta, Final, Job, start
from kiln.server.runtime import DEFAULT, Runtime, parse_keep_alive

router = APIRouter(prefix="/api", tags=["Ollama"])
log = logging.getLogger("kiln.server")

_ERRORS = {400: {"description": "Invalid request: {\"error\": message}"}, 401: {"description": "Missing or wrong API key"},
           404: {"description": "Unknown model"}, 503: {"description": "Queue full, or the model is being unloaded"}}
# Hardware knobs Ollama clients send that do not apply to kiln; other unknown options are logged.
_HARDWARE_OPTIONS = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "numa", "low_vram", "use_mmap",
                     "use_mlock", "num_keep", "f16_kv", "vocab_only", "logits_all", "embedding_only"}
_FOREVER = "2318-01-01T00:00:00Z"  # expires_at of a model kept loaded forever
# kiln's request fields, as Ollama names them
FIELDS = {"max_tokens": "options.num_predict", "num_ctx": "options.num_ctx", "speculative.mode": "options.draft",
          "speculative.max": "options.draft_max", "speculative.ngram": "options.draft_ngram"}


# --- request models --------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # "NaN" in a string reads as a float too


class Options(BaseModel):
    # Ollama accepts options kiln does not use; they are logged
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    temperature: float | None = Field(None, ge=0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: int | None = Field(None, ge=-1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, description="negative: random")
    num_predict: int | None = Field(None, description="most tokens to generate; negative: until the context is full")
    stop: list[str] | str | None = None
    num_ctx: int | None = Field(None, ge=1, description="the context length to run at: the model is reloaded at it "
                                                       "when loaded at another (up to --ctx-len, else the model's own)")
    draft: Literal["none", "lookup", "model"] | None = Field(
        None, description="kiln: speculative decoding by prompt lookup or the server's --draft-model")
    draft_max: int | None = Field(None, ge=1, le=MAX_DRAFT, description="kiln: most draft tokens per pass")
    draft_ngram: int | None = Field(None, ge=1, le=MAX_NGRAM, description="kiln: longest n-gram prompt lookup matches")


class ToolCallFunction(_Model):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolCall(_Model):
    function: ToolCallFunction


class Message(_Model):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = Field(None, description="not supported: kiln runs text models")
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = Field(None, description="an assistant turn's reasoning; the template decides "
                                                   "whether it is rendered")


class _Generation(_Model):
    model: str = Field(description="an installed model tag, e.g. smollm2:135m")
    format: Literal["", "json"] | dict[str, Any] | None = Field(None, description='"json", or a JSON schema')
    options: Options | None = None
    stream: bool = True
    keep_alive: float | str | None = Field(None, description='how long the model stays loaded: "5m", seconds, '
                                                             '0 unloads, negative keeps it forever')
    think: bool | Literal["low", "medium", "high"] | None = Field(
        None, description="thinking on or off (or an effort, where the template takes one); the reasoning comes "
                          "back as `thinking`")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def num_ctx(self) -> int | None:
        return self.options.num_ctx if self.options else None

    def request_fields(self) -> dict:
        """The kiln request fields both generating endpoints share."""
        o = self.options or Options()
        unknown = sorted(set(o.model_extra or {}) - _HARDWARE_OPTIONS)
        if unknown:
            log.warning("ignoring options kiln does not support: %s", ", ".join(unknown))
        sampling = {k: getattr(o, k) for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                               "repeat_last_n", "presence_penalty", "frequency_penalty")}
        sampling["seed"] = o.seed if o.seed is not None and o.seed >= 0 else None
        return {"sampling": sampling,
                "max_tokens": o.num_predict if o.num_predict is not None and o.num_predict >= 0 else None,
                "stop": [o.stop] if isinstance(o.stop, str) else list(o.stop or []),
                "format": (self.format if isinstance(self.format, dict) else ANY_JSON) if self.format else None,
                "logprobs": (self.top_logprobs or 0) if self.logprobs else None, "think": self.think,
                "speculative": {k: v for k, v in (("mode", o.draft), ("max", o.draft_max), ("ngram", o.draft_ngram))
                                if v is not None}}


class ChatRequest(_Generation):
    messages: list[Message] = Field(default_factory=list, description="empty: just load (or unload) the model")
    tools: list[Tool] | None = None


class GenerateRequest(_Generation):
    prompt: str = Field("", description="empty: just load (or unload) the model")
    system: str | None = None
    raw: bool = Field(False, description="send the prompt as is, without the chat template")
    context: list[int] | None = Field(None, description="the `context` of an earlier response, to continue it")
    suffix: str | None = Field(None, description="text after the cursor: fill in the middle between the prompt and this "
                                                 "(models with fill-in-the-middle tokens)")
    template: str | None = Field(None, description="not supported: the model's own chat template is used")
    images: list[str] | None = Field(None, description="not supported: kiln runs text models")


class ModelRequest(_Model):
    model: str | None = None
    name: str | None = Field(None, description="older clients' spelling of `model`")

    def tag(self) -> str:
        if not (self.model or self.name):
            raise RequestError("model is required", "model")
        return self.model or self.name


class EmbedRequest(_Model):
    model: str = Field(description="an installed model tag, e.g. smollm2:135m")
    input: str | list[str] = Field(description="a text, or a list of texts")
    truncate: bool = Field(True, description="cut an input longer than the context to its first tokens (prompt_eval_count "
                                             "counts those); false: such an input is an error")
    options: Options | None = Field(None, description="only num_ctx is used for embeddings")
    keep_alive: float | str | None = None
    dimensions: int | None = Field(None, ge=1, description="keep the first N dimensions (then normalized again)")


class LegacyEmbeddingsRequest(_Model):
    model: str
    prompt: str = Field("", description="empty: just load the model")
    options: Options | None = Field(None, description="not used for embeddings")
    keep_alive: float | str | None = None


class CreateRequest(_Model):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)

    model: str | None = Field(None, description="the new model's name")
    name: str | None = Field(None, description="older clients' spelling of `model`")
    from_: str | None = Field(None, alias="from", description="the installed model (a tag) to build on")
    modelfile: str | None = Field(None, description="older clients: a Modelfile's text, instead of the fields")
    system: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="sampling defaults and stop strings")
    license: str | list[str] | None = None
    template: str | None = Field(None, description="not supported: the model's own chat template is used")
    adapters: dict[str, str] | None = Field(None, description="not supported: kiln does not apply LoRA adapters")
    files: dict[str, str] | None = Field(None, description="one GGUF file, {name.gguf: digest}, uploaded with "
                                                                "POST /api/blobs/{digest}: the model's weights")
    messages: list[dict[str, Any]] | None = Field(None, description="not supported: kiln does not store messages")
    quantize: str | None = Field(None, description="not supported: kiln runs the file's own quantization")
    stream: bool = True


class CopyRequest(_Model):
    source: str
    destination: str


class PullRequest(ModelRequest):
    insecure: bool = False
    stream: bool = True


# --- endpoints -----------------------------------------------------------------------------------------
@router.post("/chat", responses=_ERRORS, summary="Chat (NDJSON stream unless stream is false)")
async def chat(body: ChatRequest, request: Request):
    fields, keep_alive = body.request_fields(), _keep_alive(body.keep_alive)
    if not body.messages:
        return await _load_or_unload(_runtime(request), body.model, keep_alive,
                                     {"message": {"role": "assistant", "content": ""}}, body.num_ctx())
    messages = [_message(i, m) for i, m in enumerate(body.messages)]
    job = Job("ollama", body.model, GenerationRequest(
        **fields, messages=messages, tools=[t.model_dump() for t in body.tools] if body.tools else None), keep_alive,
        body.num_ctx())
    with fields_named(FIELDS):
        generation = await start(_runtime(request), job)
    tag = generation.loaded.tag
    if body.stream:
        return _ndjson(_chat_lines(generation.events(request), tag))
    logprobs, final = await generation.collect(request)
    if final.error:
        raise KilnError(final.error)
    message: dict = {"role": "assistant", "content": final.text, **_thinking(final.thinking)}
    if final.tool_calls:
        message["tool_calls"] = [_tool_call(c) for c in final.tool_calls]
    return {**_head(tag), "message": message, **_done(final), **_logprobs(logprobs)}


@router.post("/generate", responses=_ERRORS, summary="Complete a prompt (NDJSON stream unless stream is false)")
async def generate(body: GenerateRequest, request: Request):
    for name in ("images", "template"):
        if getattr(body, name):
            raise RequestError(f"{name} is not supported by kiln's /api/generate", name)
    if body.suffix and body.context:
        raise RequestError("suffix: a fill-in-the-middle request cannot continue a context", "suffix")
    fields, keep_alive = body.request_fields(), _keep_alive(body.keep_alive)
    if not body.prompt and not body.context and not body.suffix:
        return await _load_or_unload(_runtime(request), body.model, keep_alive, {"response": ""}, body.num_ctx())
    infill = Infill(body.prompt, body.suffix) if body.suffix else None
    job = Job("ollama", body.model, GenerationRequest(**fields, prompt=body.prompt, system=body.system, raw=body.raw,
                                                      context=body.context, infill=infill), keep_alive, body.num_ctx())
    with fields_named(FIELDS):
        generation = await start(_runtime(request), job)
    tag = generation.loaded.tag
    if body.stream:
        return _ndjson(_generate_lines(generation.events(request), tag))
    logprobs, final = await generation.collect(request)
    if final.error:
        raise KilnError(final.error)
    return {**_head(tag), "response": final.text, **_thinking(final.thinking), **_done(final),
            "context": final.seq.all_ids, **_logprobs(logprobs)}


@router.post("/embed", responses=_ERRORS, summary="Embeddings: each input's last final hidden state, normalized")
async def embed(body: EmbedRequest, request: Request):
    inputs = [body.input] if isinstance(body.input, str) else body.input
    if not inputs:
        raise RequestError("input is empty", "input")
    keep_alive = _keep_alive(body.keep_alive)
    with fields_named(FIELDS):
        result = await embed_inputs(_runtime(request), "ollama", body.model, inputs, keep_alive, "input", request,
                                    body.truncate, body.options.num_ctx if body.options else None)
    vectors = unit_vectors(result.vectors, body.dimensions)
    return {"model": result.tag, "embeddings": [v.tolist() for v in vectors],
            "total_duration": int(result.total_ms * 1e6), "load_duration": int(result.load_ms * 1e6),
            "prompt_eval_count": result.prompt_tokens}


@router.post("/embeddings", responses=_ERRORS, summary="Embedding of one prompt, not normalized (older API)")
async def embeddings(body: LegacyEmbeddingsRequest, request: Request):
    runtime = _runtime(request)
    keep_alive = _keep_alive(body.keep_alive)
    if not body.prompt:
        await runtime.preload(body.model, keep_alive)
        return {"embedding": []}
    result = await embed_inputs(runtime, "ollama", body.model, [body.prompt], keep_alive, "prompt", http_request=request)
    return {"embedding": result.vectors[0].astype(float).tolist()}


@router.api_route("/tags", methods=["GET", "HEAD"], responses={401: _ERRORS[401]}, summary="Installed models")
async def tags(request: Request):
    return {"models": [_listing(r) for r in await _runtime(request).installed()]}


@router.post("/create", responses=_ERRORS, summary="Create a model from another, with its own system message and defaults")
async def create(body: CreateRequest, request: Request):
    from kiln.modelfile import Recipe, check_parameters, parse
    from kiln.store import looks_like_path

    runtime = _runtime(request)
    tag = body.model or body.name
    if not tag:
        raise RequestError("model is required: the new model's name", "model")
    for field in ("template", "adapters", "messages", "quantize"):
        if getattr(body, field):
            raise RequestError(f"{field}: {CreateRequest.model_fields[field].description}", field)
    try:
        if body.modelfile is not None and body.files is None:
            recipe = parse(body.modelfile, "modelfile")
        else:
            base = body.from_
            if body.files is not None:
                ggufs = [digest for name, digest in body.files.items() if name.endswith(".gguf")]
                if len(ggufs) != 1 or len(body.files) != 1 or not ggufs[0].startswith("sha256:"):
                    raise RequestError("files: give exactly one .gguf file, by the digest it was uploaded under "
                                       "(POST /api/blobs/sha256:...)", "files")
                base = ggufs[0]
                await asyncio.to_thread(_check_upload, runtime.store, base)
            if not base:
                raise RequestError("from is required: the installed model to build on", "from")
            parameters, _ = check_parameters(body.parameters or {}, "parameters")
            license_ = "\n".join(body.license) if isinstance(body.license, list) else body.license
            recipe = Recipe(base, body.system, parameters, license_)
        if looks_like_path(recipe.base):  # clients may not open files on the server's disk
            raise RequestError(f"{recipe.base!r}: build on an installed model's tag, not a file path", "from")
        async with runtime.pull_lock:  # creating may pull the base
            record = await asyncio.to_thread(runtime.store.create, tag, recipe, False)
    except StoreError as e:
        field = "files" if body.files is not None else "modelfile" if body.modelfile is not None else "model"
        raise RequestError(str(e), field) from None
    runtime.refresh(record)
    lines = [{"status": f"using existing layer sha256:{record.sha256}"}, {"status": "writing manifest"},
             {"status": "success"}]
    if not body.stream:
        return lines[-1]

    async def stream():
        for line in lines:
            yield line

    return _ndjson(stream())


def _check_upload(store, digest: str) -> None:
    """An uploaded file becomes a model only once it passes the checks every model load makes (the
    upload itself checked only that it is a GGUF file), so a bad one is refused here, not by a later chat."""
    from kiln.models import check_model_file

    path = store.blob_path(digest)
    if not path.is_file():
        return  # the store names the missing upload
    try:
        check_model_file(path)
    except ModelFileError as e:
        raise RequestError(f"files: the uploaded {digest[:19]}... is not a model kiln can load: {e}", "files") from None


@router.head("/blobs/{digest}", responses={404: {"description": "No such blob"}}, summary="Whether a blob is stored")
async def blob_exists(digest: str, request: Request):
    try:
        found = _runtime(request).store.has_blob(digest)
    except StoreError as e:
        raise RequestError(str(e), "digest") from None
    return Response(status_code=200 if found else 404)


@router.post("/blobs/{digest}", status_code=201, responses=_ERRORS, summary="Upload a GGUF file for /api/create",
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def upload_blob(digest: str, request: Request):
    store = _runtime(request).store
    try:
        with store.upload(digest) as upload:
            async for chunk in request.stream():
                upload.write(chunk)
            await asyncio.to_thread(upload.finish)
    except (StoreError, ModelFileError) as e:
        raise RequestError(str(e), "digest" if isinstance(e, StoreError) else "body") from None
    return Response(status_code=201)


@router.post("/copy", responses=_ERRORS, summary="Copy a model to another name (the weights are shared)")
async def copy(body: CopyRequest, request: Request):
    runtime = _runtime(request)
    try:
        await asyncio.to_thread(runtime.store.copy, body.source, body.destination)
    except StoreError as e:
        raise RequestError(str(e), "destination") from None
    return Response(status_code=200)


@router.post("/show", responses=_ERRORS, summary="A model's details, template, parameters and metadata")
async def show(body: ModelRequest, request: Request):
    from kiln.modelinfo import describe, modelfile_of
    from kiln.modelfile import parameter_items
    from kiln.thinking import template_supports_thinking

    record = await _runtime(request).resolve(body.tag())
    info = await asyncio.to_thread(describe, record)
    arch = info["family"]
    parameters = "\n".join(f"{name} {value}" for name, value in parameter_items(record.effective_parameters()))
    template = info["chat_template"] or ""
    model_info = {"general.architecture": arch, "general.name": info["name"], "general.parameter_count": info["parameters"],
                  "general.quantization": info["quantization"], f"{arch}.context_length": info["context_length"],
                  f"{arch}.embedding_length": info["embedding_length"], f"{arch}.block_count": info["layers"],
                  f"{arch}.attention.head_count": info["heads"], f"{arch}.attention.head_count_kv": info["kv_heads"],
                  f"{arch}.attention.key_length": info["head_dim"]}
    shown = {"modelfile": modelfile_of(record), "parameters": parameters, "template": template,
             "details": _details(record), "model_info": model_info,
             "capabilities": [*CAPABILITIES, *(["insert"] if info["insert"] else []),
                              *(["thinking"] if template_supports_thinking(template) else [])],
             "license": record.license or "", "modified_at": _modified(record)}
    return {**shown, "system": record.system} if record.system is not None else shown


@router.get("/ps", responses={401: _ERRORS[401]}, summary="The loaded models, the most recently used first")
async def ps(request: Request):
    runtime = _runtime(request)
    keep = runtime.settings.keep_alive
    models = []
    for loaded in sorted(runtime.models.values(), key=lambda m: m.last_used, reverse=True):
        if loaded.expires_at is not None:
            expires = _iso(loaded.expires_at)
        elif loaded.active and keep is not None:  # busy: its keep-alive starts when it is idle again
            expires = _iso(datetime.now(timezone.utc).timestamp() + keep)
        else:
            expires = _FOREVER
        r = loaded.record
        requests = loaded.scheduler.stats()  # beyond Ollama's fields: what `kiln ps` shows of the slots' use
        models.append({"name": r.tag, "model": r.tag, "size": r.size, "digest": r.sha256 or "",
                       "details": _details(r), "expires_at": expires, "size_vram": 0,
                       "context_length": loaded.model.n_ctx, "processor": loaded.model.engine.processor,
                       "slots": runtime.settings.parallel, "running": requests["running"],
                       "waiting": requests["waiting"]})
    return {"models": models}


@router.post("/pull", responses=_ERRORS, summary="Pull a catalog model (NDJSON progress unless stream is false)")
async def pull(body: PullRequest, request: Request):
    from kiln.store import looks_like_path

    runtime, tag = _runtime(request), body.tag()
    if looks_like_path(tag):
        raise RequestError(f"model {tag!r}: /api/pull takes a catalog tag, not a file path", "model")
    if not body.stream:
        async with runtime.pull_lock:
            await asyncio.to_thread(runtime.store.pull, tag, False)
        return {"status": "success"}
    return _ndjson(_pull_lines(runtime, tag))


@router.delete("/delete", responses=_ERRORS, summary="Remove an installed model (unloading it first)")
async def delete(body: ModelRequest, request: Request):
    runtime, name = _runtime(request), body.tag()
    try:
        record = await runtime.resolve(name)
    except StoreError:  # damaged (a missing blob, a bad manifest): remove it all the same
        record = None
    if record is not None:
        await runtime.unload(record.tag)
    await asyncio.to_thread(runtime.store.remove, name)
    return Response(status_code=200)


@router.api_route("/version", methods=["GET", "HEAD"], summary="kiln's version")
async def version():
    return {"version": __version__}


# What every model can do here: complete; call tools (a template that does not render them gets them as a
# system message, and a forced call is held to a grammar); embed (/api/embed takes any model's last
# hidden state). Models with fill-in-the-middle tokens also insert, and those whose template takes a
# thinking switch think.
CAPABILITIES = ["completion", "tools", "embedding"]


# --- translation ---------------------------------------------------------------------------------------
def _runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat().replace("+00:00", "Z")


def _head(tag: str) -> dict:
    return {"model": tag, "created_at": _iso(datetime.now(timezone.utc).timestamp())}


def _done(final: Final) -> dict:
    """Ollama's final fields (durations in ns); a call counts as a normal stop, as in Ollama."""
    t = final.timings
    ns = lambda ms: int(ms * 1e6)  # noqa: E731
    out = {"done": True, "done_reason": "stop" if final.finish_reason == "tool_calls" else final.finish_reason,
           "total_duration": ns(t.load_ms + t.queue_ms + t.total_ms), "load_duration": ns(t.load_ms),
           "prompt_eval_count": t.prompt_tokens, "prompt_eval_duration": ns(t.prefill_ms),
           "eval_count": t.completion_tokens, "eval_duration": ns(t.decode_ms), "timings": t.as_dict()}
    if final.tool_error:
        out["tool_call_error"] = final.tool_error
    return out


def _logprobs(records: list[dict]) -> dict:
    if not records:
        return {}
    return {"logprobs": [{"token": r["token"], "logprob": r["logprob"],
                          "top_logprobs": [{"token": a["token"], "logprob": a["logprob"]} for a in r["top"]]}
                         for r in records]}


def _thinking(text: str) -> dict:
    return {"thinking": text} if text else {}


def _tool_call(call) -> dict:
    return {"function": {"name": call.name, "arguments": call.arguments}}


def _message(index: int, m: Message) -> dict:
    if m.images:
        raise RequestError(f"messages[{index}].images: kiln runs text models", f"messages[{index}].images")
    out: dict = {"role": m.role, "content": m.content}
    if m.thinking:
        out["thinking"] = m.thinking
    if m.tool_calls:
        out["tool_calls"] = [{"type": "function", "function": c.function.model_dump()} for c in m.tool_calls]
    if m.tool_name:
        out["name"] = m.tool_name
    return out


def _details(record) -> dict:
    d = record.details
    family = d.get("family", "")
    return {"parent_model": "", "format": "gguf", "family": family, "families": [family] if family else [],
            "parameter_size": d.get("parameters", ""), "quantization_level": d.get("quantization", "")}


def _modified(record) -> str:
    if record.pulled_at:
        return record.pulled_at
    return _iso(record.path.stat().st_mtime)


def _listing(record) -> dict:
    return {"name": record.tag, "model": record.tag, "modified_at": _modified(record), "size": record.size,
            "digest": record.sha256 or "", "details": _details(record)}


async def _load_or_unload(runtime: Runtime, model: str, keep_alive, body: dict, n_ctx: int | None) -> dict:
    """Ollama's empty request: load the model (at the context `n_ctx`, when given), or with keep_alive 0 unload it."""
    if keep_alive == 0:
        record = await runtime.resolve(model)
        await runtime.unload(record.tag)
        return {**_head(record.tag), **body, "done": True, "done_reason": "unload"}
    with fields_named(FIELDS):
        loaded = await runtime.preload(model, keep_alive, n_ctx=n_ctx)
    return {**_head(loaded.tag), **body, "done": True, "done_reason": "load"}


def _keep_alive(value) -> float | None | str:
    """A request's keep_alive in seconds (None: forever), or DEFAULT when it gives none."""
    return DEFAULT if value is None else parse_keep_alive(value)


def _ndjson(lines) -> StreamingResponse:
    async def encoded():
        async for line in lines:
            yield json.dumps(line) + "\n"

    return StreamingResponse(encoded(), media_type="application/x-ndjson")


async def _chat_lines(events, tag: str):
    async for event in events:
        if isinstance(event, Delta):
            message: dict = {"role": "assistant", "content": event.text, **_thinking(event.thinking)}
            if event.tool_calls:
                message["tool_calls"] = [_tool_call(c) for c in event.tool_calls]
            yield {**_head(tag), "message": message, "done": False, **_logprobs(event.logprobs)}
        elif event.error:
            yield {"error": event.error}
        else:
            yield {**_head(tag), "message": {"role": "assistant", "content": ""}, **_done(event)}


async def _generate_lines(events, tag: str):
    async for event in events:
        if isinstance(event, Delta):
            yield {**_head(tag), "response": event.text, **_thinking(event.thinking), "done": False,
                   **_logprobs(event.logprobs)}
        elif event.error:
            yield {"error": event.error}
        else:
            yield {**_head(tag), "response": "", **_done(event), "context": event.seq.all_ids}


class _PullWatch:
    """The pull's progress as the store reports it (on the pull's thread), read by the stream every half
    second: the bytes of the stage in progress (the download, then the extraction)."""

    def __init__(self):
        self.completed = 0

    def update(self, stage: str, completed: int, total: int | None) -> None:
        self.completed = completed

    def note(self, message: str) -> None:
        log.warning("%s", message)


async def _pull_lines(runtime: Runtime, tag: str):
    """Ollama's progress lines."""
    yield {"status": "pulling manifest"}
    try:
        async with runtime.pull_lock:
            entry = next((e for e in runtime.store.available() if e.tag == tag), None)
            watch = _PullWatch()
            task = asyncio.ensure_future(asyncio.to_thread(runtime.store.pull, tag, False, report=watch))
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                completed = watch.completed
                if completed and entry is not None and entry.sha256 and entry.size:
                    yield {"status": f"pulling {entry.sha256[:12]}", "digest": f"sha256:{entry.sha256}",
                           "total": entry.size, "completed": min(completed, entry.size)}
                elif completed:  # an alias such as name:latest, or an entry whose digest only the hub knows
                    yield {"status": f"pulling {tag}", "completed": completed}
            record = task.result()
    except (KilnError, OSError) as e:
        yield {"error": without_paths(str(e) if isinstance(e, KilnError) else describe_os_error(e, "pull failed"))}
        return
    yield {"status": f"pulled {record.tag}", "digest": f"sha256:{record.sha256}", "total": record.size,
           "completed": record.size}
    yield {"status": "success"}
