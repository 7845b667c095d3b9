"""The worked example of docs/load.md: `llmspans load` against the tests' vLLM simulator, and the HTML's picture.

    python docs/load_example.py      # prints the run's output; writes docs/load-example.png (needs chromium)

The simulator (tests/support/vllm_sim.py) has 4 batch slots, 1 ms of prefill per prompt word and 12 ms
per decoded token; the run is the command a user would type, in a child process, with its spans in a
temporary traces file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.vllm_sim import EngineConfig, VLLMSimulator  # noqa: E402


def main() -> int:
    config = EngineConfig(max_num_seqs=4, prefill_per_token=0.001, decode_per_token=0.012)
    with tempfile.TemporaryDirectory() as workdir, VLLMSimulator(config) as sim:
        html = Path(workdir) / "load.html"
        env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "LLMSPANS_"))}
        env["LLMSPANS_TRACES_FILE"] = str(Path(workdir) / "traces.jsonl")
        command = [
            "llmspans", "load", sim.base_url, "--model", config.model, "--concurrency", "1,2,4,8",
            "--max-tokens", "10", "--prompt-tokens", "80", "--provider", "vllm", "--slo", "ttft=200ms,e2e=400ms",
            "--html", str(html),
        ]  # fmt: skip
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
