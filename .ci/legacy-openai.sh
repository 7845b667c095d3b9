#!/usr/bin/env bash
# The openai 1.x/2.x leg: those SDKs send through httpx (3.x sends through httpx2), so the
# openai adapter's tests run once more against the newest 2.x (the newest 1.x if no 2.x is
# published) in a virtual environment of their own. Usage: .ci/legacy-openai.sh VENV_DIR [install|test]
# (both by default; .ci/run installs in the background at its start and tests at its end).
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ] || [ -z "$1" ]; then
  echo "usage: $0 VENV_DIR [install|test]  (the virtual environment to create or reuse for the legacy openai SDK)" >&2
  exit 2
fi
part=${2:-all}
mkdir -p "$1"
venv=$(cd "$1" && pwd)  # absolute, before leaving the caller's directory
cd "$(dirname "$0")/.."

if [ "$part" != test ]; then
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -e . pytest pytest-asyncio pytest-timeout pytest-xdist hypothesis opentelemetry-propagator-b3
if ! "$venv/bin/python" -m pip install -q 'openai>=2,<3'; then
  echo "no openai 2.x available: using the newest 1.x" >&2
  "$venv/bin/python" -m pip install -q 'openai>=1.40,<2'
fi
"$venv/bin/python" - <<'PY'
import openai

major = int(openai.__version__.split(".")[0])
assert major < 3, f"the legacy leg needs an httpx-based openai (1.x/2.x), got {openai.__version__}"
print(f"openai {openai.__version__} (sends through httpx)")
PY
fi
[ "$part" = install ] && exit 0
# On two workers, as the main suite runs (tests/conftest.py keeps each module on one).
"$venv/bin/python" -m pytest -n 2 tests/test_openai_sdk.py tests/test_stream.py tests/test_transport.py tests/test_transport_kinds.py tests/test_instrument.py -q
# The recorded conversations through the httpx-based SDK (the plain-client cases need httpx2: not here).
"$venv/bin/python" -m pytest -n 2 tests/test_conversation.py -q -k "OpenAI"
