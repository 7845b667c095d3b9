"""Remake docs/phoenix-slow-prefill.png: a slow-prefill turn exported to a local Arize Phoenix (the one the
tests install, `.ci/install-real-servers.sh`), its trace page shot by headless Chromium.

    python docs/phoenix_screenshot.py   (from the repository root)
"""

import json
import os
import subprocess
import sys
import textwrap
import urllib.request

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
os.environ.setdefault(
    "LLMSPANS_REAL_SERVERS_DIR", str(__import__("pathlib").Path.home() / ".cache/llmspans-real-servers")
)
from tests.support.realservers import phoenix_server

CHILD = """
import llmspans, openai
from llmspans.tools.simulator import Behavior, SimulatedServer
llmspans.configure(service_name="slow-prefill", endpoint={endpoint!r}, openinference=True, slow_after=0.5)
@llmspans.retrieval(data_source="docs")
def search(q): return ["doc"]
@llmspans.stage("prompt")
def build_prompt(docs): return [{{"role": "user", "content": "hi"}}]
with SimulatedServer(Behavior(header_delay=0.02, first_chunk_delay=2.9, chunk_gap=0.02, chunks=20, usage="finish")) as server:
    client = llmspans.instrument(openai.OpenAI(base_url=server.base_url, api_key="x"), request_usage=True)
    with llmspans.turn("chat"):
        messages = build_prompt(search("q"))
        list(client.chat.completions.create(model="llama-3-8b", messages=messages, stream=True))
"""
with phoenix_server() as phoenix:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "LLMSPANS_"))}
    subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD).format(endpoint=phoenix.http_endpoint)],
        env=env,
        check=True,
        cwd=sys.path[0],
    )
    spans = phoenix.wait_for_spans("slow-prefill", lambda f: len(f) >= 8, timeout=30)
    trace_id = spans[0]["context"]["trace_id"]
    projects = json.loads(urllib.request.urlopen(f"{phoenix.http_endpoint}/v1/projects").read())["data"]
    pid = next(p["id"] for p in projects if p["name"] == "slow-prefill")
    url = f"{phoenix.http_endpoint}/projects/{pid}/traces/{trace_id}"
    print(url, flush=True)
    r = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--user-data-dir=/tmp/llmspans-shot-profile",
            "--window-size=1500,900",
            "--virtual-time-budget=15000",
            "--screenshot=docs/phoenix-slow-prefill.png",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(r.returncode, r.stderr[-500:])
