"""The generator's default client: a plain `httpx2.AsyncClient` on `LeanTransport` (`_http.py`), which llmspans
instruments exactly as it would an app's (`llmspans.instrument(client)`).

Its streamed bodies are read by the plain adapter's own reader, which reads a mid-stream chunk by its bytes
and tells the request's record (a `ChunkListener`) each content chunk at the stamp the call span takes, for
the load tool's inter-token figures (docs/load.md, "What the generator costs"). Which events carry tokens is
the wire format's one rule (`_openai_wire`): `content_of` reads an event's data as compact JSON, in str or
bytes (None where only decoding can tell), and `carries_tokens_in` decodes what that cannot tell.
"""

from __future__ import annotations

from llmspans._openai_wire import compact_carries_tokens, event_carries_tokens

content_of = content_of_bytes = compact_carries_tokens
carries_tokens_in = event_carries_tokens

__all__ = ["carries_tokens_in", "content_of", "content_of_bytes"]
