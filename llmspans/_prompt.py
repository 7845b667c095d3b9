"""Prompt caps: a capped client's prompts sized before they are sent, and refused over the cap if asked.

`instrument(client, max_prompt_tokens=N, on_exceed=..., prompt_tokenizer=...)` gives the client's settings
a `PromptCap`; each request's JSON body goes through `PromptCap.apply` as its call opens. The estimate
counts the text the prompt carries (`prompt_pieces`) with a tokenizer when one is installed and named,
else characters/4, and the span says which. Over the cap, `"record"` sends the call and marks it;
`"error"` ends the call and raises `PromptTooLarge` before a byte is sent. After the answer the estimate
is compared with the server's own count (`PromptEstimate.finished`). What each figure means:
docs/telemetry.md; the choices: docs/prompt-caps.md.

Tokenizers are never downloaded. A named one (`hf:...`, `tiktoken:...`) is loaded once per process when
a client is instrumented with it; the default picks tiktoken's encoding for each model name tiktoken
knows, loaded by a daemon thread (`llmspans-tokenizer`) the first time a capped call names that model,
characters/4 until it is ready. Whatever is not on this machine falls back to characters/4 with one
warning. At fork the child forgets loads its parent had under way and starts its own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from llmspans import _metrics as metric
from llmspans import _names as names
from llmspans import _sites as sites
from llmspans import _telemetry
from llmspans._call import CallRecord, CallShape
from llmspans._guard import Deliberate, guarded, report

logger = logging.getLogger("llmspans")

ON_EXCEED_RECORD = "record"
ON_EXCEED_ERROR = "error"
ON_EXCEED_CHOICES = (ON_EXCEED_RECORD, ON_EXCEED_ERROR)
# What a chat message costs beyond its text, and the reply's priming: OpenAI's own count for its chat models.
PER_MESSAGE = 3
PER_REPLY = 3
# The keys of a message, a content part, a tool call or a Responses input item that hold text the model
# reads; an image's URL (a data URL may be megabytes of base64) or an id is no prompt text.
_TEXT_KEYS = (
    "role", "name", "content", "text", "tool_calls", "function_call", "function", "arguments", "output",
)  # fmt: skip
_KEPT = 256  # models, and shape variants, remembered at once


class PromptTooLarge(Deliberate, ValueError):
    """A client instrumented with `max_prompt_tokens=N, on_exceed="error"` was asked to send a prompt whose
    estimated size is over N. Nothing was sent; the call's span ends with this as its `error.type`."""

    def __init__(
        self, estimated_tokens: int, max_prompt_tokens: int, estimator: str, model: str | None
    ) -> None:
        for_model = f" for model {model!r}" if model else ""
        super().__init__(
            f"prompt of about {estimated_tokens} tokens (estimated by {estimator}) is over max_prompt_tokens="
            f"{max_prompt_tokens}{for_model}: nothing was sent; shorten the prompt, raise the cap, or instrument "
            f"with on_exceed='record' to send it anyway"
        )
        self.estimated_tokens, self.max_prompt_tokens = estimated_tokens, max_prompt_tokens
        self.estimator, self.model = estimator, model


# --- what a prompt says ----------------------------------------------------------------------------------


def _gather(value: Any, texts: list[str], depth: int = 0) -> int:
    """Append the texts under `value`; returns the tokens it holds as ids (a tokenized prompt)."""
    if isinstance(value, str):
        if value:
            texts.append(value)
        return 0
    if depth > 8:
        return 0
    if isinstance(value, list):
        if value and all(type(item) is int for item in value):
            return len(value)  # a prompt given as token ids: its size is exact
        return sum(_gather(item, texts, depth + 1) for item in value)
    if isinstance(value, Mapping):
        return sum(_gather(value[key], texts, depth + 1) for key in _TEXT_KEYS if key in value)
    return 0


def _messages(items: list[Any], texts: list[str]) -> int:
    tokens = PER_REPLY
    for item in items:
        tokens += PER_MESSAGE + _gather(item, texts) if isinstance(item, Mapping) else _gather(item, texts)
    return tokens


def prompt_pieces(body: Mapping[str, Any]) -> tuple[list[str], int]:
    """The texts a request's prompt carries, and the tokens known without a tokenizer: chat messages (role,
    name, content, tool calls) with their per-message overhead, a completion's prompt, an embedding's input,
    the Responses API's instructions and input, and tool definitions as their JSON; a prompt of token ids
    counts them."""
    texts: list[str] = []
    tokens = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        tokens += _messages(messages, texts)
    for key in ("prompt", "input"):
        value = body.get(key)
        if isinstance(value, list) and any(isinstance(item, Mapping) for item in value):
            tokens += _messages(value, texts)  # the Responses API's input items: messages and tool results
        else:
            tokens += _gather(value, texts)
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        texts.append(instructions)
    for key in ("tools", "functions"):
        value = body.get(key)
        if value:
            texts.append(json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str))
    return texts, tokens


# --- estimators ------------------------------------------------------------------------------------------


class Estimator(Protocol):
    name: str

    def count(self, texts: list[str]) -> int: ...


class Characters:
    """Characters over four, rounded up: about right for English with OpenAI's tokenizers, low for code
    and far too low for Chinese or Japanese text; never a cost worth measuring."""

    name = names.ESTIMATOR_CHARS

    def count(self, texts: list[str]) -> int:
        return -(-sum(map(len, texts)) // 4)


CHARACTERS = Characters()


class Tiktoken:
    def __init__(self, encoding: Any) -> None:
        self.name = f"tiktoken:{encoding.name}"
        self._encode = encoding.encode_ordinary  # special-token text is counted as text, never refused

    def count(self, texts: list[str]) -> int:
        encode = self._encode
        return sum(len(encode(text)) for text in texts)


class HuggingFace:
    def __init__(self, tokenizer: Any, name: str) -> None:
        self.name = f"hf:{name}"
        tokenizer.no_truncation()  # a tokenizer.json may truncate at the model's length: count all of it
        tokenizer.no_padding()
        self._encode = tokenizer.encode

    def count(self, texts: list[str]) -> int:
        encode = self._encode
        return sum(len(encode(text, add_special_tokens=False).ids) for text in texts)


# Named tokenizers, loaded once per process: "hf:<name>" or "tiktoken:<encoding>" -> what counts with it.
_named: dict[str, Estimator] = {}
_named_lock = threading.Lock()


def _named_estimator(spec: str) -> Estimator:
    found = _named.get(spec)
    if found is not None:
        return found
    with _named_lock:  # two clients instrumented at once load it once
        found = _named.get(spec)
        if found is None:
            found = _named[spec] = _load(spec)
    return found


def _unavailable(spec: str, why: str, fix: str) -> Estimator:
    logger.warning(
        "llmspans: tokenizer %r is not available here (%s); prompt sizes are estimated as characters/4 "
        "instead (%s)", spec, why, fix,
    )  # fmt: skip
    return CHARACTERS


def _load(spec: str) -> Estimator:
    kind, _, name = spec.partition(":")
    try:
        if kind == "hf":
            return _load_hugging_face(spec, name)
        return _load_tiktoken(spec, name)
    except Exception as failure:  # a broken install or file: the call must still go
        return _unavailable(spec, f"{type(failure).__name__}: {failure}", "check the tokenizer's files")


def _load_hugging_face(spec: str, name: str) -> Estimator:
    if importlib.util.find_spec("tokenizers") is None:
        return _unavailable(spec, "the tokenizers package is not installed", "pip install tokenizers")
    from tokenizers import Tokenizer

    path = Path(name).expanduser()
    file: Path | None = path / "tokenizer.json" if path.is_dir() else path if path.is_file() else None
    if file is None and importlib.util.find_spec("huggingface_hub") is not None:
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(name, "tokenizer.json")  # looks, never fetches
        except Exception:  # not a repository name either
            cached = None
        file = Path(cached) if isinstance(cached, str) else None
    if file is None or not file.is_file():
        return _unavailable(
            spec, "no tokenizer.json at that path or in the Hugging Face cache",
            "pass the local directory of the model, or fetch it once outside the app",
        )  # fmt: skip
    return HuggingFace(Tokenizer.from_file(str(file)), name)


def _load_tiktoken(spec: str, encoding_name: str) -> Estimator:
    if importlib.util.find_spec("tiktoken") is None:
        return _unavailable(spec, "the tiktoken package is not installed", "pip install tiktoken")
    import tiktoken

    if encoding_name not in tiktoken.list_encoding_names():
        return _unavailable(
            spec, "tiktoken has no encoding of that name", "name one tiktoken.list_encoding_names() has"
        )
    missing = _tiktoken_downloads(encoding_name)
    if missing:
        return _unavailable(
            spec, f"its files are not in tiktoken's cache ({_tiktoken_cache_dir() or 'caching off'}) and "
            "llmspans never downloads", "load the encoding once with network access, or set TIKTOKEN_CACHE_DIR",
        )  # fmt: skip
    return Tiktoken(tiktoken.get_encoding(encoding_name))


def _tiktoken_cache_dir() -> str:
    """Where tiktoken keeps what it downloaded, as it decides (`tiktoken.load.read_file_cached`)."""
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if variable in os.environ:
            return os.environ[variable]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _urls(code: Any) -> Iterator[str]:
    for constant in code.co_consts:
        if isinstance(constant, str) and constant.startswith(("http://", "https://")):
            yield constant
        elif hasattr(constant, "co_consts"):  # a function or comprehension inside
            yield from _urls(constant)


def _tiktoken_downloads(encoding_name: str) -> list[str]:
    """The files loading the encoding would download: its constructor's URLs (OpenAI's encodings name
    them as constants) that are not in tiktoken's cache. An encoding already loaded, or one a plugin
    builds from local data, has none."""
    from tiktoken import registry

    if encoding_name in registry.ENCODINGS:
        return []
    constructor = (registry.ENCODING_CONSTRUCTORS or {}).get(encoding_name)
    code = getattr(constructor, "__code__", None)
    if code is None:
        return []
    cache_dir = _tiktoken_cache_dir()
    return [
        url
        for url in _urls(code)
        if not cache_dir
        or not os.path.exists(os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()))
    ]


# The default choice: tiktoken's encoding for each model name it knows, loaded off the request path.
_by_model: dict[str, Estimator] = {}
_loading: set[str] = set()
_by_model_lock = threading.Lock()
_tiktoken_installed: bool | None = None


def _by_model_name(model: str | None) -> Estimator:
    """tiktoken's encoding for `model` once loaded; characters/4 until then, and for models it does not know."""
    global _tiktoken_installed
    if model is None:
        return CHARACTERS
    found = _by_model.get(model)
    if found is not None:
        return found
    if _tiktoken_installed is None:
        _tiktoken_installed = importlib.util.find_spec("tiktoken") is not None
    if _tiktoken_installed:
        with _by_model_lock:
            if model not in _loading and model not in _by_model:
                if len(_by_model) >= _KEPT:
                    _by_model.clear()
                _loading.add(model)
                threading.Thread(
                    target=_load_for_model, args=(model,), name="llmspans-tokenizer", daemon=True
                ).start()
    return CHARACTERS


def _load_for_model(model: str) -> None:
    estimator: Estimator = CHARACTERS
    try:
        from tiktoken.model import encoding_name_for_model

        try:
            encoding_name = encoding_name_for_model(model)
        except KeyError:  # not a model tiktoken knows: characters/4, quietly (the span says so)
            pass
        else:
            estimator = _named_estimator(f"tiktoken:{encoding_name}")
    except Exception as failure:
        report(sites.PROMPT_TOKENIZER, failure)
    finally:
        with _by_model_lock:
            _by_model[model] = estimator
            _loading.discard(model)


def loaded(model: str, timeout: float) -> bool:
    """Wait until the default choice has decided for `model` (tests; an app never needs to)."""
    deadline = time.monotonic() + timeout
    while model not in _by_model and time.monotonic() < deadline:
        time.sleep(0.005)
    return model in _by_model


def _forget_loads() -> None:
    global _by_model_lock, _named_lock
    _by_model_lock = threading.Lock()
    _named_lock = threading.Lock()
    _loading.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_loads)


def forget() -> None:
    """Forget every tokenizer loaded and every choice made (`llmspans.testing.reset`)."""
    global _tiktoken_installed
    with _by_model_lock:
        _by_model.clear()
    with _named_lock:
        _named.clear()
    _tiktoken_installed = None


# --- the cap ---------------------------------------------------------------------------------------------


def check(max_prompt_tokens: object, on_exceed: object, tokenizer: object) -> None:
    """`instrument()`'s prompt-cap arguments, or an error that says what to pass."""
    if max_prompt_tokens is None:
        for name, value in (("on_exceed", on_exceed), ("prompt_tokenizer", tokenizer)):
            if value is not None:
                raise ValueError(
                    f"{name} applies to a prompt cap: pass max_prompt_tokens=N too (e.g. "
                    f"max_prompt_tokens=8000, {name}={value!r}), or leave {name} out"
                )
        return
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int):
        raise TypeError(
            f"max_prompt_tokens must be a whole number of tokens, e.g. max_prompt_tokens=8000; got {max_prompt_tokens!r}"
        )
    if max_prompt_tokens <= 0:
        raise ValueError(
            f"max_prompt_tokens must be a positive number of tokens, e.g. max_prompt_tokens=8000; got {max_prompt_tokens!r}"
        )
    if on_exceed is not None and on_exceed not in ON_EXCEED_CHOICES:
        raise ValueError(
            "on_exceed must be 'record' (send the call and mark its span) or 'error' (raise "
            f"llmspans.PromptTooLarge before anything is sent); got {on_exceed!r}"
        )
    if tokenizer is None or tokenizer in ("chars", "tiktoken"):
        return
    if isinstance(tokenizer, str):
        kind, colon, name = tokenizer.partition(":")
        if colon and kind in ("hf", "tiktoken") and name.strip():
            return
    raise ValueError(
        "prompt_tokenizer must be None or 'tiktoken' (tiktoken's encoding for the OpenAI models it knows, else "
        "characters/4), 'chars', 'tiktoken:<encoding>' (e.g. 'tiktoken:o200k_base') or 'hf:<name or local "
        f"path>' (a Hugging Face tokenizer.json); got {tokenizer!r}"
    )


class PromptCap:
    """One client's cap: its size in tokens, what to do over it, and the estimator it names (None: by model)."""

    __slots__ = ("max_tokens", "named", "on_exceed", "tokenizer")

    def __init__(self, max_tokens: int, on_exceed: str | None = None, tokenizer: str | None = None) -> None:
        check(max_tokens, on_exceed, tokenizer)
        self.max_tokens = max_tokens
        self.on_exceed = on_exceed or ON_EXCEED_RECORD
        self.tokenizer = tokenizer
        self.named: Estimator | None = None
        if tokenizer == "chars":
            self.named = CHARACTERS
        elif tokenizer is not None and tokenizer != "tiktoken":
            self.named = _named_estimator(tokenizer)  # loaded now, when the client is instrumented

    def estimator_for(self, model: str | None) -> Estimator:
        return self.named if self.named is not None else _by_model_name(model)

    def apply(self, record: CallRecord, body: Mapping[str, Any]) -> None:
        """Size the prompt of the call `record` opened; raise `PromptTooLarge` (the call ended) when it is
        over the cap and the cap says `"error"`."""
        refusal = self._measure(record, body)
        if refusal is not None:
            record.finish(names.OUTCOME_ERROR, error=refusal)
            raise refusal

    @guarded(sites.PROMPT_ESTIMATE, None)
    def _measure(self, record: CallRecord, body: Mapping[str, Any]) -> PromptTooLarge | None:
        model = body.get("model")
        model = model if isinstance(model, str) else None
        estimator = self.estimator_for(model)
        texts, tokens = prompt_pieces(body)
        estimated = estimator.count(texts) + tokens
        over = estimated > self.max_tokens
        record.shape = capped_shape(record.shape, over)
        record.estimated_input_tokens = estimated
        record.levers += (PromptEstimate(estimated, estimator.name),)
        if record.recording:
            record.span.set_attributes(
                {
                    names.PROMPT_ESTIMATED_TOKENS: estimated,
                    names.PROMPT_ESTIMATOR: estimator.name,
                    names.PROMPT_CAP: self.max_tokens,
                    names.PROMPT_OVER_CAP: over,
                }
            )
        if over and self.on_exceed == ON_EXCEED_ERROR:
            return PromptTooLarge(estimated, self.max_tokens, estimator.name, model)
        return None


_variants: dict[tuple[CallShape, bool], CallShape] = {}


def capped_shape(shape: CallShape, over: bool) -> CallShape:
    """The call's shape with `llmspans.prompt.over_cap` among its metric attributes, built once per shape."""
    key = (shape, over)
    found = _variants.get(key)
    if found is None:
        attributes = {**shape.metric_labels.attributes, names.PROMPT_OVER_CAP: over}
        found = CallShape(shape.span_name, shape.span_attributes, attributes)
        if len(_variants) >= _KEPT:
            _variants.clear()
        _variants[key] = found
    return found


_ratio_labels: dict[tuple[str, str], metric.Labels] = {}
_RATIO_KEYS = (names.GEN_AI_OPERATION_NAME, names.GEN_AI_PROVIDER_NAME, names.GEN_AI_REQUEST_MODEL)


def _ratio_labels_of(shape: CallShape, estimator: str) -> metric.Labels:
    key = (shape.metric_labels.key, estimator)
    found = _ratio_labels.get(key)
    if found is None:
        attributes = shape.metric_labels.attributes
        found = metric.Labels(
            {**{k: attributes[k] for k in _RATIO_KEYS if k in attributes}, names.PROMPT_ESTIMATOR: estimator}
        )
        if len(_ratio_labels) >= _KEPT:
            _ratio_labels.clear()
        _ratio_labels[key] = found
    return found


class PromptEstimate:
    """A capped call's estimate, compared with the server's count once the call is over (a `_call.Lever`)."""

    __slots__ = ("estimated", "estimator")

    def __init__(self, estimated: int, estimator: str) -> None:
        self.estimated = estimated
        self.estimator = estimator

    @guarded(sites.PROMPT_COMPARE, None)
    def finished(self, record: CallRecord, outcome: str, duration_ns: int) -> None:
        reported = record.input_tokens
        if not reported:
            return
        ratio = self.estimated / reported
        if record.recording:
            record.span.set_attribute(names.PROMPT_ESTIMATE_RATIO, ratio)
        recorder = _telemetry.recorder()
        recorder.add(
            [(metric.PROMPT_ESTIMATE_RATIO, ratio, _ratio_labels_of(record.shape, self.estimator))],
            recorder.sample(record.span, record.wall_ns(record.released_ns or record.queued_ns)),
        )
