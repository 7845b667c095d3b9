"""Hedged requests: a second copy of a call that is slow to start, the first to answer wins, the other is closed.

The rooms, from the top: `openai_glue` binds a `Hedge` to one openai client (`Hedging`, the sender the adapter
calls, what an SDK item says); `race` is one hedged call (`Race`: its copies, who won, what it cost, the sync
and the async runs); `copies` is one copy as the transport sees it; `replay` hands the winner's stream to the
app; `alarms` sends a sync call's backup when it comes due; `policy` is the public `Hedge` (when, to whom,
which calls). This package sits above the adapters: it imports `_adapters.openai_sdk`'s public names, and
the adapter knows a hedge only as `_settings.Sending`. What each figure means: docs/telemetry.md; the
choices: README "Levers".
"""
