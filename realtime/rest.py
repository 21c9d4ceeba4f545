"""The REST routes: OpenAI's speech API and vllm-omni's extras, thin wrappers over the shared pipeline.

- `POST /v1/audio/speech`: one text, delivered as a chunked body (`stream`), `speech.audio.*` server-sent
  events (`sse`) or one body with usage headers (`whole`); see `realtime.speech.plan_speech`.
- `POST /v1/audio/speech/batch`: vllm-omni's batch, whole files as base64, errors per item.
- `GET|POST /v1/audio/voices`, `DELETE /v1/audio/voices/{name}`: the `VoiceStore`.
- `GET /v1/models`, `GET /v1/models/{model}`: the served engine, its model's ids, its OpenAI aliases.
- `GET /metrics`: Prometheus text of the server's registry.

Every error is OpenAI's `{"error": {...}}` (`realtime.openai_errors`). Bounds: at most
`max_rest_requests` speech/batch requests synthesize at once (503 past it); a speech body is capped by the
app's `client_max_size`, an upload's sample by `max_voice_upload_bytes` and its other parts by
`MAX_FORM_FIELD_BYTES` and `MAX_FORM_PARTS` (413), a batch by `batch_max_items`.
A client that disconnects cancels its request (the server runs with aiohttp handler cancellation), which
cancels the request's unit tasks and so the engine's work, for streamed and whole-body responses alike.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import BodyPartReader, hdrs, web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST
from voicewire.protocol.encoders import REST_CONTENT_TYPES
from voicewire.protocol.engine import VoiceSample, failure_of
from voicewire.protocol.messages import echo
from voicewire.protocol.session import ServerFacts
from voicewire.realtime.context import Server, ServerContext
from voicewire.realtime.openai_errors import OpenAIError, bad_request, openai_error_middleware
from voicewire.realtime.speech import (
    AudioBudget,
    SpeechPlan,
    SpeechSynthesis,
    audio_too_long,
    convert_speech_request,
    decode_json,
    decode_speech_request,
    plan_speech,
    with_reference,
)
from voicewire.realtime.voices import VoiceStoreError

log = logging.getLogger("voicewire.rest")

MAX_FORM_FIELD_BYTES: Final = 16 * 1024
MAX_FORM_PARTS: Final = 16
WORD_TIMESTAMPS_HEADER_LIMIT: Final = 4096
"""Past this many bytes the words are left out and `X-Word-Timestamps-Omitted` says why (vllm-omni)."""
_VOICE_TEXT_FIELDS: Final = ("name", "consent", "ref_text", "speaker_description")
_BATCH_STREAM_FIELDS: Final = ("stream", "stream_format")


@dataclass(slots=True)
class RestState:
    """What the REST routes keep beside the server context."""

    server: Server
    created: int
    """Unix time the routes were set up: `created` of `/v1/models` entries."""
    in_flight: int = 0


REST: Final = web.AppKey("voicewire_rest", RestState)


def add_rest_routes(app: web.Application, server: Server) -> None:
    """Register the REST routes and the OpenAI error middleware on `app`, and restore the server's voice
    store from disk at app startup (after the engine starts loading: `cleanup_ctx` was registered first)."""
    app[REST] = RestState(server, int(time.time()))
    app.middlewares.append(_count_requests)
    app.middlewares.append(openai_error_middleware(_count_error))
    app.on_startup.append(_restore_voices)
    app.router.add_post("/v1/audio/speech", create_speech)
    app.router.add_post("/v1/audio/speech/batch", create_speech_batch)
    app.router.add_get("/v1/audio/voices", list_voices)
    app.router.add_post("/v1/audio/voices", upload_voice)
    app.router.add_delete("/v1/audio/voices/{name}", delete_voice)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)  # HF-style ids hold a slash
    app.router.add_get("/metrics", metrics)


async def _restore_voices(app: web.Application) -> None:
    await app[REST].server.voices.restore()


@web.middleware
async def _count_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """`voicewire_http_requests{route,status}` for every HTTP request."""
    route = request.match_info.route.resource
    label = route.canonical if route is not None else "unmatched"
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        request.app[REST].server.metrics.requests.labels(label, str(status)).inc()


def _count_error(request: web.Request, status: int, code: str) -> None:
    request.app[REST].server.metrics.errors.labels(code).inc()


def _serving(state: RestState) -> ServerContext:
    """The server's context, or a 503 while the engine is not ready or the server is shutting down."""
    ctx = state.server.serving()
    if ctx is None:
        raise OpenAIError(503, "The engine is not ready; retry shortly", code="not_ready")
    return ctx


@contextlib.contextmanager
def _admitted(state: RestState) -> Iterator[None]:
    """Hold one of the `max_rest_requests` synthesis places, or raise 503."""
    limit = state.server.settings.max_rest_requests
    if state.in_flight >= limit:
        raise OpenAIError(503, f"The server is full ({limit} speech requests in progress); retry shortly",
                          code="server_full")
    state.in_flight += 1
    state.server.metrics.rest_in_flight.inc()
    try:
        yield
    finally:
        state.in_flight -= 1
        state.server.metrics.rest_in_flight.dec()


# ---------------------------------------------------------------------------------------------------
# Speech


async def create_speech(request: web.Request) -> web.StreamResponse:
    """`POST /v1/audio/speech`."""
    state = request.app[REST]
    ctx = _serving(state)
    facts = ctx.facts
    started = time.monotonic()
    plan = plan_speech(decode_speech_request(await request.read()), facts,
                       max_input_chars=ctx.settings.max_input_chars)
    with _admitted(state):
        plan = await with_reference(ctx, plan)
        budget = AudioBudget(ctx.settings.max_response_audio_s) if plan.delivery == "whole" else None
        synthesis = SpeechSynthesis(ctx, plan, ctx.next_id("speech"), started, budget)
        if plan.delivery == "whole":
            return await _whole_response(synthesis)
        return await _streamed_response(request, synthesis)


async def _whole_response(synthesis: SpeechSynthesis) -> web.Response:
    body = await _whole_body(synthesis)
    plan = synthesis.plan
    usage = synthesis.usage
    headers = {
        "x-vllm-omni-input-tokens": str(usage.input_tokens), "x-vllm-omni-output-tokens": str(usage.output_tokens),
        "x-vllm-omni-total-tokens": str(usage.total_tokens),
        "x-vllm-omni-input-text-tokens": str(usage.text_tokens),
        "x-vllm-omni-input-audio-tokens": str(usage.audio_tokens),
        "x-voicewire-audio-ms": f"{synthesis.audio_seconds * 1000:.1f}",
        "x-voicewire-sample-rate": str(synthesis.sample_rate)}
    if plan.config.word_timestamps:
        words = json.dumps([{"word": w.word, "start_ms": w.start_ms, "end_ms": w.end_ms,
                             "char_start": w.char_start, "char_end": w.char_end} for w in synthesis.words])
        if len(words) <= WORD_TIMESTAMPS_HEADER_LIMIT:
            headers["X-Word-Timestamps"] = words
        else:
            headers["X-Word-Timestamps-Omitted"] = f"{len(words)} bytes exceed {WORD_TIMESTAMPS_HEADER_LIMIT}"
    return web.Response(body=body, content_type=REST_CONTENT_TYPES[plan.response_format], headers=headers)


async def _whole_body(synthesis: SpeechSynthesis) -> bytes:
    """All of the audio, or an `OpenAIError`: 400 past the audio budget, 500 when the engine fails."""
    parts: list[bytes] = []
    try:
        async with aclosing(synthesis.chunks()) as chunks:
            async for chunk in chunks:
                parts.append(chunk)
    except OpenAIError:
        raise
    except Exception as exc:
        raise _generation_failed(synthesis, exc) from exc
    _observe_ttfa(synthesis)
    return b"".join(parts)


async def _streamed_response(request: web.Request, synthesis: SpeechSynthesis) -> web.StreamResponse:
    """A chunked audio body, or SSE events. Headers go out with the first audio, so a failure before
    any audio is still a clean 500; one after it ends the stream early (audio: the connection is closed
    before the final chunk, so the client sees a truncated body; SSE: a `speech.audio.error` event)."""
    sse = synthesis.plan.delivery == "sse"
    content_type = "text/event-stream" if sse else REST_CONTENT_TYPES[synthesis.plan.response_format]
    response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: content_type, hdrs.CACHE_CONTROL: "no-cache",
                                           "x-voicewire-sample-rate": str(synthesis.sample_rate)})
    response.enable_chunked_encoding()
    try:
        async with aclosing(_body(synthesis, sse)) as body:
            async for data in body:
                if not response.prepared:
                    _observe_ttfa(synthesis)
                    await response.prepare(request)
                await response.write(data)
    except ConnectionResetError:
        raise
    except Exception as exc:
        error = exc if isinstance(exc, OpenAIError) else _generation_failed(synthesis, exc)
        if not response.prepared:
            raise error from exc
        if not sse:
            raise
        await response.write(_sse_event("speech.audio.error", {"error": error.body()["error"]}))
        await response.write_eof()
        return response
    if not response.prepared:
        await response.prepare(request)
    if sse:
        await response.write(_sse_event("speech.audio.done", {"usage": synthesis.usage.as_dict()}))
    await response.write_eof()
    return response


async def _body(synthesis: SpeechSynthesis, sse: bool) -> AsyncGenerator[bytes]:
    """The chunks, or their SSE events (base64 and JSON made off the event loop)."""
    async with aclosing(synthesis.chunks()) as chunks:
        async for chunk in chunks:
            if sse:
                yield await synthesis.ctx.audio.run(_sse_audio, chunk, synthesis.plan.response_format)
            else:
                yield chunk


def _sse_audio(chunk: bytes, response_format: str) -> bytes:
    """A `speech.audio.delta` event: the chunk in base64 and its `response_format` (vllm-omni's fields)."""
    return _sse_event("speech.audio.delta", {"audio": base64.b64encode(chunk).decode(),
                                             "response_format": response_format})


def _sse_event(kind: str, fields: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()


def _observe_ttfa(synthesis: SpeechSynthesis) -> None:
    synthesis.ctx.metrics.ttfa.labels("rest").observe(time.monotonic() - synthesis.started)


def _generation_failed(synthesis: SpeechSynthesis, exc: BaseException) -> OpenAIError:
    log.error("speech request %s failed: %s", synthesis.request_id, exc, exc_info=exc)
    code, reason = failure_of(exc)
    return OpenAIError(500, f"Speech generation failed: {reason}", code=code)


# ---------------------------------------------------------------------------------------------------
# Batch


async def create_speech_batch(request: web.Request) -> web.Response:
    """`POST /v1/audio/speech/batch`: vllm-omni's shape. Batch-level fields are defaults that items
    override; a bad batch is a 4xx, a bad or failed item is an `error` result beside the others."""
    state = request.app[REST]
    ctx = _serving(state)
    facts = ctx.facts
    started = time.monotonic()
    raw = decode_json(await request.read())
    if not isinstance(raw, dict):
        raise bad_request("The batch must be a JSON object with `items`", None)
    items = raw.pop("items", None)
    limit = ctx.settings.batch_max_items
    if not isinstance(items, list) or not items:
        raise bad_request("items must be a non-empty array of {input, ...} objects", "items")
    if len(items) > limit:
        raise bad_request(f"items has {len(items)} entries; the limit is {limit}", "items")
    defaults: dict[str, Any] = {"response_format": "wav", **raw}
    _refuse_stream_fields(defaults, None)
    references: dict[str, VoiceSample] = {}
    await with_reference(ctx, _plan_item({**defaults, "input": "Check."}, facts, ctx), references)
    plans: list[SpeechPlan | str] = []
    for index, item in enumerate(items):
        try:
            if not isinstance(item, dict):
                raise bad_request("each item must be an object", "items")
            _refuse_stream_fields(item, index)
            overrides = {k: v for k, v in item.items() if v is not None}
            plans.append(await with_reference(ctx, _plan_item({**defaults, **overrides}, facts, ctx), references))
        except OpenAIError as exc:
            plans.append(exc.message)
    estimate = sum(plan.audio_estimate_s for plan in plans if isinstance(plan, SpeechPlan))
    budget = AudioBudget(ctx.settings.max_response_audio_s)
    if estimate > budget.limit:
        raise audio_too_long(f"This batch is about {estimate:.0f} s of audio", budget.limit)
    with _admitted(state):
        batch_id = ctx.next_id("speech-batch")
        results = await asyncio.gather(*(
            _batch_item(ctx, index, plan, f"{batch_id}-{index}", started, budget)
            for index, plan in enumerate(plans)))
    succeeded = sum(1 for r in results if r["status"] == "success")
    body = await ctx.audio.run(json.dumps, {"id": batch_id, "results": results, "total": len(results),
                                            "succeeded": succeeded, "failed": len(results) - succeeded})
    return web.Response(text=body, content_type="application/json")


def _refuse_stream_fields(fields: dict[str, Any], index: int | None) -> None:
    for name in _BATCH_STREAM_FIELDS:
        if fields.get(name) not in (None, False):
            where = "" if index is None else f" (item {index})"
            raise bad_request(f"{name} is not available in a batch{where}: items are whole files", name)


def _plan_item(fields: dict[str, Any], facts: ServerFacts, ctx: ServerContext) -> SpeechPlan:
    return plan_speech(convert_speech_request(fields), facts, max_input_chars=ctx.settings.max_input_chars,
                       delivery="whole")


async def _batch_item(ctx: ServerContext, index: int, plan: SpeechPlan | str, request_id: str,
                      started: float, budget: AudioBudget) -> dict[str, Any]:
    if isinstance(plan, str):
        return {"index": index, "status": "error", "error": plan}
    synthesis = SpeechSynthesis(ctx, plan, request_id, started, budget)
    try:
        body = await _whole_body(synthesis)
    except OpenAIError as exc:
        return {"index": index, "status": "error", "error": exc.message}
    audio_data = await ctx.audio.run(_base64, body)
    return {"index": index, "status": "success", "audio_data": audio_data,
            "media_type": REST_CONTENT_TYPES[plan.response_format], "sample_rate": synthesis.sample_rate,
            "usage": synthesis.usage.as_dict()}


def _base64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# ---------------------------------------------------------------------------------------------------
# Voices


async def list_voices(request: web.Request) -> web.Response:
    """`GET /v1/audio/voices`: every name `voice` accepts, and the uploaded voices' details."""
    ctx = _serving(request.app[REST])
    facts = ctx.facts
    store = ctx.voices
    records = store.records()
    names = sorted({*facts.engine.voices, *facts.voice_aliases, *(r.name for r in records)})
    return web.json_response({
        "voices": names, "default_voice": facts.engine.default_voice, "aliases": facts.voice_aliases,
        "voice_cloning": facts.engine.voice_cloning, "uploaded_voices": [r.public() for r in records]})


async def upload_voice(request: web.Request) -> web.Response:
    """`POST /v1/audio/voices` (multipart: `audio_sample`, `consent`, `name`, optional `ref_text`,
    `speaker_description`). Nothing is stored unless every check passes; the voice's `mime_type` is the
    type detected from the sample's bytes (a part's own Content-Type is ignored)."""
    ctx = _serving(request.app[REST])
    facts = ctx.facts
    store = ctx.voices
    fields, sample = await _read_voice_form(request, store.max_upload_bytes)
    for required in ("name", "consent"):
        if not fields.get(required, "").strip():
            raise bad_request(f"{required} is required", required, "missing_field")
    if sample is None:
        raise bad_request("audio_sample (a file part) is required", "audio_sample", "missing_field")
    try:
        record = await store.add(
            name=fields["name"], sample=sample, consent=fields["consent"],
            ref_text=fields.get("ref_text"), speaker_description=fields.get("speaker_description"),
            reserved=(*facts.engine.voices, *facts.voice_aliases))
    except VoiceStoreError as exc:
        raise OpenAIError(exc.status, exc.message, code=exc.code, param=exc.param) from None
    return web.json_response({"success": True, "voice": record.public()})


async def _read_voice_form(request: web.Request, max_sample_bytes: int) -> tuple[dict[str, str], bytes | None]:
    """The text fields and the sample of an upload form. Every part is read under a cap (the sample under
    `max_sample_bytes`, any other part, known or not, under `MAX_FORM_FIELD_BYTES`; 413 past it), and a
    form has at most `MAX_FORM_PARTS` parts (413), so the whole body read is bounded."""
    if not request.content_type.startswith("multipart/"):
        raise bad_request("Upload voices as multipart/form-data", None, "invalid_content_type")
    reader = await request.multipart()
    fields: dict[str, str] = {}
    sample: bytes | None = None
    parts = 0
    while (part := await reader.next()) is not None:
        parts += 1
        if parts > MAX_FORM_PARTS:
            raise OpenAIError(413, f"An upload form has at most {MAX_FORM_PARTS} parts", code="upload_too_large")
        if not isinstance(part, BodyPartReader):
            raise bad_request("Nested multipart bodies are not accepted", None, "invalid_content_type")
        if part.name == "audio_sample":
            sample = await _read_part(part, max_sample_bytes, "audio_sample")
        elif part.name in _VOICE_TEXT_FIELDS:
            raw = await _read_part(part, MAX_FORM_FIELD_BYTES, part.name)
            try:
                fields[part.name] = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise bad_request(f"{part.name} must be UTF-8 text", part.name) from None
        else:
            await _read_part(part, MAX_FORM_FIELD_BYTES, None)
    return fields, sample


async def _read_part(part: BodyPartReader, limit: int, param: str | None) -> bytes:
    """A part's bytes, or 413 as soon as it passes `limit` (an unknown part has no `param`)."""
    data = bytearray()
    while chunk := await part.read_chunk(64 * 1024):
        data += chunk
        if len(data) > limit:
            what = param or "a form part"
            raise OpenAIError(413, f"{what} is larger than {limit} bytes", code="upload_too_large", param=param)
    return bytes(data)


async def delete_voice(request: web.Request) -> web.Response:
    """`DELETE /v1/audio/voices/{name}`: 404 when there is no uploaded voice of that name."""
    store = request.app[REST].server.voices
    name = request.match_info["name"]
    try:
        await store.remove(name)
    except VoiceStoreError as exc:
        raise OpenAIError(exc.status, exc.message, code=exc.code, param=exc.param) from None
    return web.json_response({"success": True, "message": f"Voice {name!r} deleted successfully"})


# ---------------------------------------------------------------------------------------------------
# Models and metrics


def _model_entries(state: RestState, facts: ServerFacts) -> dict[str, dict[str, object]]:
    engine = facts.engine.name
    return {name: {"id": name, "object": "model", "created": state.created, "owned_by": "voicewire",
                   "root": engine} for name in facts.engine.models}


async def list_models(request: web.Request) -> web.Response:
    """`GET /v1/models`: every name accepted as `model` (`session.updated`'s `engine.models`): the served
    engine first, then its model's ids as vllm-omni's server reports them, then the aliases."""
    state = request.app[REST]
    entries = _model_entries(state, _serving(state).facts)
    return web.json_response({"object": "list", "data": list(entries.values())})


async def retrieve_model(request: web.Request) -> web.Response:
    """`GET /v1/models/{model}`: one entry, or 404."""
    state = request.app[REST]
    model = request.match_info["model"]
    entry = _model_entries(state, _serving(state).facts).get(model)
    if entry is None:
        raise OpenAIError(404, f"The model {echo(model)} does not exist", code="model_not_found", param="model")
    return web.json_response(entry)


async def metrics(request: web.Request) -> web.Response:
    """`GET /metrics`: Prometheus text; the engine gauges are read from the scheduler now, the event loop's
    task count (a leak detector for soak runs) from asyncio now."""
    server = request.app[REST].server
    if server.context is not None:
        server.metrics.engine_queue.set(server.context.scheduler.queue_depth)
        server.metrics.engine_in_use.set(server.context.scheduler.in_use)
    server.metrics.event_loop_tasks.set(len(asyncio.all_tasks()))
    return web.Response(body=server.metrics.render(), headers={hdrs.CONTENT_TYPE: CONTENT_TYPE_LATEST})
