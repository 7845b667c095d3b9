"""The public surface: what `llmspans` exports is exactly `__all__`, so it cannot drift silently."""

import gc

import llmspans
import llmspans.testing


def test_all_lists_exactly_the_public_names() -> None:
    # "@py_..." names are pytest's assertion rewriting (llmspans.testing is a pytest plugin).
    public = {name for name in dir(llmspans) if not name.startswith(("_", "@"))} - {
        "testing",
        "vllm",
        "report",
        "load",
        "tools",
    }
    assert set(llmspans.__all__) - {"__version__"} == public
    assert llmspans.__all__ == sorted(llmspans.__all__)


def test_importing_llmspans_does_not_import_openai() -> None:
    import subprocess
    import sys

    code = "import sys, llmspans; print('openai' in sys.modules, 'httpx2' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_runtime_loads_no_offline_tool() -> None:
    """The report and the tools (simulator, demo) are offline: instrumenting, calling and a turn load none."""
    import subprocess
    import sys

    code = (
        "import sys, httpx, llmspans\n"
        "llmspans.instrument(httpx.Client())\n"
        "with llmspans.turn('chat'):\n"
        "    pass\n"
        "print(sorted(n for n in sys.modules if n.startswith(('llmspans.report', 'llmspans.tools'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"


def test_testing_module_exports() -> None:
    assert set(llmspans.testing.__all__) == {
        "Captured",
        "MetricPoint",
        "capture",
        "llmspans_capture",
        "reset",
        "settle",
    }


def test_capture_fixture_is_registered_as_a_plugin(llmspans_capture: llmspans.testing.Captured) -> None:
    @llmspans.stage("unit")
    def unit() -> int:
        return 1

    unit()
    assert [span.name for span in llmspans_capture.spans] == ["unit"]
    assert llmspans_capture.metric_points("llmspans.stage.duration")[0].count == 1


def test_capture_clear_forgets_spans_and_metric_points(llmspans_capture: llmspans.testing.Captured) -> None:
    # A limiter another test dropped still reports its gauges until the collector frees it (an instrumented
    # client and its instrumentation hold each other): what clear() leaves must not depend on test order.
    gc.collect()

    @llmspans.stage("unit")
    def unit() -> None:
        pass

    unit()
    llmspans_capture.clear()
    assert llmspans_capture.spans == []
    assert llmspans_capture.metric_points() == []
    unit()
    assert llmspans_capture.metric_points("llmspans.stage.duration")[0].count == 1


def test_metric_points_carry_unit_and_kind(llmspans_capture: llmspans.testing.Captured) -> None:
    llmspans.stage("unit", budget=1)(lambda: None)()
    (duration,) = llmspans_capture.metric_points("llmspans.stage.duration")
    assert (duration.unit, duration.kind) == ("s", "histogram")
    (budget,) = llmspans_capture.metric_points("llmspans.stage.budget")
    assert (budget.unit, budget.kind, budget.value) == ("s", "gauge", 1.0)
