"""Hedged requests: a second copy of a call that is slow to start, the first to answer wins, the other is closed.

The rooms, from the top: `openai_glue` binds a `Hedge` to one openai client (`Hedging`, the sender the adapter
calls); `runs` drives one hedged call in the app's thread or task (its I/O); `race` decides it (`Race`: its
copies, when the backup is due, who won, what the caller gets); `telemetry` says what it did; `copies` is one
copy as the transport sees it (an `AttemptWatcher` composing the call) and what it reads ahead; `replay` hands
the winner's stream to the app; `alarms` sends a sync call's backup when it comes due; `policy` is the public
`Hedge` (when, to whom, which calls). This package sits above the adapters: it imports `_adapters.openai_sdk`'s
public names, learns of attempts only as the transport's `AttemptWatcher`, and the adapter knows a hedge only as
`_settings.Sending`. What each figure means: docs/telemetry.md; the choices: docs/levers.md.
"""
