"""llmspans' offline tools: the simulated OpenAI-compatible server and the demo built on it.

Nothing here is loaded by `import llmspans`: the instrumentation runtime never imports a tool
(tests/test_public_api.py checks it). `llmspans demo` and the test suite use them.
"""
