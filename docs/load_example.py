"""The worked example of docs/load.md: `llmspans load` against the shipped simulator, and the HTML's picture.

    python docs/load_example.py      # prints the run's output; writes docs/load-example.png (needs chromium)

The simulator is the one users install (`python -m llmspans.tools.simulator --slots 4
--prefill-per-token 0.002 --decode-per-token 0.02`): 4 batch slots, 2 ms of prefill per prompt word and
20 ms per decoded token, vLLM's /metrics names, as `llmspans demo --load` runs it; the run is the command a user would type, in a child
process, with its spans in a temporary traces file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from llmspans.tools.load_demo import LoadDemo
from llmspans.tools.simulator import Capacity, SimulatedServer

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    demo = LoadDemo()
    capacity = Capacity(
        slots=demo.slots,
        prefill_per_token=demo.prefill_per_token,
        decode_per_token=demo.decode_per_token,
        model=demo.model,
    )
    with tempfile.TemporaryDirectory() as workdir, SimulatedServer(capacity=capacity, record=False) as sim:
        html = Path(workdir) / "load.html"
        env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "LLMSPANS_"))}
        env["LLMSPANS_TRACES_FILE"] = str(Path(workdir) / "traces.jsonl")
        command = ["llmspans", *demo.load_arguments(sim.base_url), "--html", str(html)]
        print("$ " + " ".join(command).replace(sim.base_url, "http://127.0.0.1:8000/v1"))
        done = subprocess.run(
            [sys.executable, "-m", "llmspans", *command[1:]],
            env=env,
            text=True,
            capture_output=True,
            check=False,
        )
        print(done.stdout.replace(sim.base_url, "http://127.0.0.1:8000/v1"), end="")
        print(done.stderr.replace(sim.base_url, "http://127.0.0.1:8000/v1"), end="", file=sys.stderr)
        page = html.read_text().replace(sim.base_url, "http://127.0.0.1:8000/v1")
        html.write_text(page)
        subprocess.run(
            ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--screenshot={ROOT / 'docs' / 'load-example.png'}", "--window-size=1000,1250", f"file://{html}"],
            capture_output=True, check=False, timeout=120,
        )  # fmt: skip
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
