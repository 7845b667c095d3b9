import re

import pytest

from llmspans import _budget


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(0.3, 0.3), (2, 2.0), ("300ms", 0.3), ("1.6s", 1.6), ("2", 2.0), (" 250 ms ", 0.25), ("1m", 60.0)],
)
def test_parse_seconds_accepts_numbers_and_units(value: object, seconds: float) -> None:
    assert _budget.parse_seconds(value, what="x") == pytest.approx(seconds)


@pytest.mark.parametrize("value", [0, -3, "-3", "fast", True, None, float("nan"), float("inf"), "3h"])
def test_parse_seconds_rejects_what_is_not_a_positive_duration(value: object) -> None:
    with pytest.raises(ValueError, match="positive number of seconds") as info:
        _budget.parse_seconds(value, what="budget for 'retrieval'")
    assert "budget for 'retrieval'" in str(info.value)
    assert repr(value) in str(info.value)


def test_parse_budgets_from_string_and_mapping() -> None:
    assert _budget.parse_budgets("retrieval=300ms, llm=1.6s,turn=2.5s") == pytest.approx(
        {"retrieval": 0.3, "llm": 1.6, "turn": 2.5}
    )
    assert _budget.parse_budgets({"tool": "50ms"}) == {"tool": pytest.approx(0.05)}


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("retrieval", "'retrieval'"),
        ("retrieval=soon", "'retrieval'"),
        ("=1s", "'=1s'"),
        ({"": 1}, "non-empty"),
    ],
)
def test_malformed_budget_names_the_bad_entry(spec: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        _budget.parse_budgets(spec)  # type: ignore[arg-type]


def test_parse_budgets_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="mapping"):
        _budget.parse_budgets(3)  # type: ignore[arg-type]


def test_environment_budgets_apply_below_configured_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSPANS_BUDGETS", "retrieval=300ms,llm=2s")
    _budget.registry.configure({"llm": 1.0})
    assert _budget.registry.resolve("retrieval", None) == pytest.approx(0.3)
    assert _budget.registry.resolve("llm", None) == 1.0
    assert _budget.registry.resolve("llm", 0.5) == 0.5
    assert _budget.registry.resolve("other", None) is None


def test_malformed_environment_budget_raises_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSPANS_BUDGETS", "retrieval=later")
    with pytest.raises(ValueError, match="LLMSPANS_BUDGETS"):
        _budget.registry.resolve("retrieval", None)
