"""POST /v1/responses (OpenAI's Responses API) on the chat completions' engine path: input
items and instructions through the chat template; output as a message and function calls
(function tools with tool_choice as in chat: auto by --tool-call-parser, required and a named
function by the grammar); usage; the streaming events with sequence numbers (a call's
arguments as they are written); and stored responses (in memory, least recently used dropped
past a bound) that `previous_response_id` continues and GET /v1/responses/{id} returns."""
from __future__ import annotations

import functools
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tllm.serve.openai.chat import encode_messages, image_chat_prompt
from tllm.serve.openai.choice_stream import ChoiceStream, OutputFormat, StreamUpdate
from tllm.serve.context import ServingContext, check_text, event_stream
from tllm.serve.http.errors import APIError, bad_request, error_responses
from tllm.serve.openai.generation import Choice, Generation, PromptInput, abort_on_disconnect
from tllm.serve.openai.params import (ModelLimits, guided_decoding, guided_request, max_new_tokens,
                               sampling_params)
from tllm.serve.openai.protocol import FunctionDefinition
from tllm.serve.openai.reasoning import after_reasoning, reasoning_parser
from tllm.serve.openai.request_fields import check_fields, mark_ignored
from tllm.serve.openai.responses_protocol import (FunctionCallItem, FunctionCallOutputItem,
                                           FunctionToolChoice, IncompleteDetails, MessageItem,
                                           OutputFunctionCall, OutputItem, OutputMessage,
                                           OutputText, ResponseObject, ResponsesRequest,
                                           ResponseUsage, TextFormat)
from tllm.serve.openai.tool_calls import JSON_ERRORS, ToolRequest, forced_schema, new_call_id
from tllm.serve.openai.tool_parsers import tool_parser

MAX_STORED_RESPONSES = 1000


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    messages: list[dict]    # the conversation up to and with its output, less instructions


class ResponseStore:
    """Stored responses by id, in memory; past max_size the least recently used goes."""

    def __init__(self, max_size: int = MAX_STORED_RESPONSES) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be at least 1, got {max_size}")
        self.max_size = max_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.response.id] = stored
        self._items.move_to_end(stored.response.id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; 404 in OpenAI's shape for an unknown (or dropped) id."""
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(404, f"no response with id {response_id!r} is stored (responses "
                           f"are kept in memory, the last {self.max_size})", param=param,
                           code="response_not_found")
        self._items.move_to_end(response_id)
        return stored


# Streamed 200: named events (`event: <type>` + `data: <event JSON>`), then `data: [DONE]`
_EVENTS_CONTENT = {"text/event-stream": {"schema": {
    "description": "Server-Sent Events: `event: response.<...>` with `data: <event JSON>`, "
                   "..., then `data: [DONE]`",
    "anyOf": [{"type": "string"},
              {"type": "object", "required": ["data"],
               "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}]}}}


def responses_routes(ctx: ServingContext, limits: ModelLimits, dependencies: list,
                     store: ResponseStore | None = None) -> APIRouter:
    """The /responses routes (for the /v1 router, which checks the API key); `dependencies`
    are those of a route with a JSON body."""
    store = store if store is not None else ResponseStore()
    router = APIRouter()

    @router.post("/responses", dependencies=dependencies, summary="Create a response",
                 responses={200: {"model": ResponseObject, "content": _EVENTS_CONTENT,
                                  "description": "The response; with `stream`, its events"},
                            **error_responses(400, 404, 408, 413, 415, 429, 503)})
    async def create(request: Request, body: ResponsesRequest) -> Response:
        ignored = check_fields(body, ctx.config.strict_request_fields)
        limits.check(body)
        return mark_ignored(await create_response(ctx, store, request, body), ignored)

    @router.get("/responses/{response_id}", summary="Retrieve a stored response",
                responses={200: {"model": ResponseObject}, **error_responses(404)})
    async def retrieve(response_id: str) -> Response:
        return JSONResponse(store.get(response_id).response.model_dump())

    return router


async def create_response(ctx: ServingContext, store: ResponseStore, request: Request,
                          body: ResponsesRequest) -> Response:
    arrival = time.monotonic()
    lora = ctx.check_model(body.model)
    history = (store.get(body.previous_response_id, "previous_response_id").messages
               if body.previous_response_id is not None else [])
    messages = history + input_messages(body)
    tools = _tool_request(body)
    prompt = await _encode(ctx, _with_instructions(body.instructions, messages), tools)
    max_tokens = max_new_tokens(len(prompt.token_ids), body.max_output_tokens,
                                ctx.llm.max_seq_len, "input")
    guided = after_reasoning(guided_request(body, _guided_by_fields(body, tools)),
                             reasoning_parser(ctx.config.reasoning_parser))
    if guided is not None:  # compiling a grammar takes a while: off the event loop
        guided = await ctx.run_in_tokenizer(guided_decoding, guided, ctx.tokenizer)
    params = sampling_params(body, max_tokens, guided_decoding=guided,
                             defaults=ctx.sampling_defaults)
    generation = await ctx.engine.start([prompt], [params], arrival, prompt_param="input",
                                        lora_request=lora)
    response = _echo(ctx, body)
    output = OutputFormat.of(None, tool_parser(ctx.config.tool_call_parser), tools)
    on_done = functools.partial(_finish, store, body, messages, len(prompt.token_ids))
    if body.stream:
        return event_stream(request, generation,
                            _events(generation, response, output, on_done))
    async with generation, abort_on_disconnect(request, generation):
        choices = await generation.wait()
    return JSONResponse(on_done(response, choices[0], _output_items(output, choices[0]))
                        .model_dump())


def _tool_request(body: ResponsesRequest) -> ToolRequest:
    named = body.tool_choice if isinstance(body.tool_choice, FunctionToolChoice) else None
    functions = tuple(FunctionDefinition(name=t.name, description=t.description,
                                         parameters=t.parameters, strict=t.strict)
                      for t in body.tools or ())
    return ToolRequest(functions, None if named else body.tool_choice,
                       named.name if named else None, body.parallel_tool_calls)


def _guided_by_fields(body: ResponsesRequest, tools: ToolRequest) -> dict[str, dict]:
    """GuidedDecodingParams keywords asked by text.format or a forced tool_choice."""
    asked = {}
    text_format = _format_request(body.text and body.text.format)
    if text_format is not None:
        asked[text_format[0]] = text_format[1]
    if tools.is_forced:
        asked["tool_choice"] = {"json": forced_schema(tools)}
    return asked


def _output_items(output: OutputFormat, choice: Choice) -> list[OutputItem]:
    """A whole choice as output items: its text as a message (when it has text or nothing
    else), then its calls."""
    _, content, calls = output.split(choice.text)
    items: list[OutputItem] = []
    if content or not calls:
        items.append(OutputMessage(content=[OutputText(text=content or "")]))
    items += [OutputFunctionCall(call_id=new_call_id(), name=call.name,
                                 arguments=call.arguments) for call in calls]
    return items


def input_messages(body: ResponsesRequest) -> list[dict]:
    """The request's input as chat-template messages (function calls in the shape HF
    templates take: assistant tool_calls, then role "tool" results)."""
    if isinstance(body.input, str):
        check_text(body.input, "input")
        return [{"role": "user", "content": body.input}]
    messages = []
    for item in body.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            check_text(item.text(), "input")
            messages.append({"role": role, "content": item.template_content()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": _arguments(item.arguments)}}
            if messages and messages[-1]["role"] == "assistant":  # its text, or parallel
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
    for message in messages:
        if isinstance(message["content"], str):
            check_text(message["content"], "input")
    return messages


def _arguments(arguments: str) -> dict:
    try:
        parsed = json.loads(arguments)
    except JSON_ERRORS as exc:
        raise bad_request(f"input: a function_call's arguments are not JSON: {exc}",
                          param="input") from exc
    if not isinstance(parsed, dict):
        raise bad_request("input: a function_call's arguments must be a JSON object",
                          param="input")
    return parsed


def _with_instructions(instructions: str | None, messages: list[dict]) -> list[dict]:
    """Instructions as the first system message (they are not carried to the next turn)."""
    if instructions is None:
        return messages
    check_text(instructions, "instructions")
    return [{"role": "system", "content": instructions}, *messages]


async def _encode(ctx: ServingContext, messages: list[dict],
                  tools: ToolRequest) -> PromptInput:
    kwargs = {}
    if tools.functions and tools.choice != "none":
        kwargs["tools"] = [{"type": "function", "function": function.model_dump(
            exclude_none=True)} for function in tools.functions]
    if any(isinstance(m["content"], list) for m in messages):   # images
        return await image_chat_prompt(ctx, messages, "input", add_generation_prompt=True,
                                       **kwargs)
    return await encode_messages(ctx, messages, "input", add_generation_prompt=True,
                                 **kwargs)


def _format_request(text_format: TextFormat | None) -> tuple[str, dict] | None:
    """`text.format` as params.guided_decoding's request (plain text: none)."""
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return "text.format", {"json_object": True}
    return "text.format", {"json": text_format.json_schema}


def _echo(ctx: ServingContext, body: ResponsesRequest) -> ResponseObject:
    """The response in progress, with the request's settings as OpenAI echoes them."""
    text = {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                       if body.text and body.text.format else {"type": "text"})}
    return ResponseObject(model=body.model or ctx.config.model_name,  # as asked (checked)
                          instructions=body.instructions,
                          max_output_tokens=body.max_output_tokens,
                          temperature=body.temperature, top_p=body.top_p,
                          previous_response_id=body.previous_response_id, store=body.store,
                          text=text, metadata=body.metadata,
                          tools=[tool.model_dump(exclude_none=True) for tool in body.tools or ()],
                          tool_choice=(body.tool_choice.model_dump()
                                       if isinstance(body.tool_choice, FunctionToolChoice)
                                       else body.tool_choice or "auto"),
                          parallel_tool_calls=body.parallel_tool_calls is not False)


def _finish(store: ResponseStore, body: ResponsesRequest, messages: list[dict],
            num_prompt_tokens: int, response: ResponseObject, choice: Choice,
            items: list[OutputItem]) -> ResponseObject:
    """The completed response (incomplete when it stopped by length), stored if asked."""
    is_incomplete = choice.finish_reason == "length"
    for item in items:
        item.status = "incomplete" if is_incomplete else "completed"
    done = response.model_copy(update={
        "status": "incomplete" if is_incomplete else "completed",
        "incomplete_details": (IncompleteDetails(reason="max_output_tokens")
                               if is_incomplete else None),
        "output": items,
        "usage": ResponseUsage(input_tokens=num_prompt_tokens,
                               output_tokens=len(choice.token_ids))})
    if body.store:
        store.put(StoredResponse(done, [*messages, _assistant_message(items)]))
    return done


def _assistant_message(items: list[OutputItem]) -> dict:
    """The output as the next turn's history has it (calls as chat templates take them)."""
    text = "".join(part.text for item in items if isinstance(item, OutputMessage)
                   for part in item.content)
    message = {"role": "assistant", "content": text}
    calls = [{"id": item.call_id, "type": "function", "function": {
        "name": item.name, "arguments": _loaded(item.arguments)}}
        for item in items if isinstance(item, OutputFunctionCall)]
    if calls:
        message["tool_calls"] = calls
    return message


def _loaded(arguments: str) -> dict | str:
    """Arguments as a template takes them (text when cut short by length)."""
    try:
        return json.loads(arguments)
    except JSON_ERRORS:
        return arguments


class _Events:
    """Responses streaming events, numbered in the order they are sent."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, event_type: str, **fields) -> str:
        data = {"type": event_type, "sequence_number": self.sequence_number}
        data.update({k: v.model_dump() if isinstance(v, BaseModel) else v
                     for k, v in fields.items()})
        self.sequence_number += 1
        return f"event: {event_type}\ndata: {json.dumps(data)}\n\n"


class _StreamedOutput:
    """The output items of a streamed response as its events: a message opened at its first
    text (at once when the request has no tools) and closed when a call begins; each call
    an item whose arguments come as deltas."""

    def __init__(self, event: _Events) -> None:
        self.event = event
        self.items: list[OutputItem] = []
        self.message: OutputMessage | None = None   # open, taking text
        self.text = ""
        self.calls: dict[int, OutputFunctionCall] = {}  # by the stream's call index

    def open_message(self) -> Iterator[str]:
        self.message = OutputMessage(status="in_progress")
        self.items.append(self.message)
        yield self.event("response.output_item.added", output_index=len(self.items) - 1,
                         item=self.message)
        yield self.event("response.content_part.added", part=OutputText(text=""),
                         **self._where(self.message))

    def add(self, update: StreamUpdate) -> Iterator[str]:
        if update.content:
            if self.message is None:
                yield from self.open_message()
            self.text += update.content
            yield self.event("response.output_text.delta", delta=update.content, logprobs=[],
                             **self._where(self.message))
        for delta in update.calls:
            if delta.id is not None:
                yield from self.close_message()
                call = OutputFunctionCall(call_id=delta.id, name=delta.name, arguments="",
                                          status="in_progress")
                self.calls[delta.index] = call
                self.items.append(call)
                yield self.event("response.output_item.added",
                                 output_index=len(self.items) - 1, item=call)
            call = self.calls[delta.index]
            if delta.arguments:
                call.arguments += delta.arguments
                yield self.event("response.function_call_arguments.delta",
                                 item_id=call.id, output_index=self.items.index(call),
                                 delta=delta.arguments)

    def close_message(self) -> Iterator[str]:
        message, self.message = self.message, None
        if message is None:
            return
        part = OutputText(text=self.text)
        where = self._where(message)
        yield self.event("response.output_text.done", text=self.text, logprobs=[], **where)
        yield self.event("response.content_part.done", part=part, **where)
        message.content, message.status = [part], "completed"
        yield self.event("response.output_item.done", output_index=where["output_index"],
                         item=message)

    def close_calls(self) -> Iterator[str]:
        for call in self.calls.values():
            index = self.items.index(call)
            call.status = "completed"
            yield self.event("response.function_call_arguments.done", item_id=call.id,
                             output_index=index, name=call.name, arguments=call.arguments)
            yield self.event("response.output_item.done", output_index=index, item=call)

    def _where(self, message: OutputMessage) -> dict:
        return {"item_id": message.id, "output_index": self.items.index(message),
                "content_index": 0}


async def _events(generation: Generation, response: ResponseObject, output: OutputFormat,
                  on_done) -> AsyncIterator[str]:
    event = _Events()
    streamed, stream = _StreamedOutput(event), ChoiceStream(output)
    yield event("response.created", response=response)
    yield event("response.in_progress", response=response)
    if not output.takes_calls:
        for line in streamed.open_message():
            yield line
    choice = Choice(0, 0)
    async for delta in generation.deltas():
        choice.add(delta.engine)
        for line in streamed.add(stream.add(delta.text, delta.finish_reason)):
            yield line
    if not streamed.items:  # no text and no call: an empty message
        for line in streamed.open_message():
            yield line
    for line in [*streamed.close_message(), *streamed.close_calls()]:
        yield line
    done = on_done(response, choice, streamed.items)
    yield event("response.incomplete" if done.status == "incomplete" else "response.completed",
                response=done)
