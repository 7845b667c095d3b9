"""Every reach into another library's private names is where it was checked (`llmspans/_internals.py`).

When an upgrade moves one, the test of that reach fails and says which, in which installed version, and what
llmspans does without it; the fallbacks themselves are tested here on objects that lack the private parts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmspans import _internals


@pytest.mark.parametrize("reach", _internals.REACHES, ids=lambda reach: reach.name)
def test_each_reach_is_where_it_was_checked(reach: _internals.Reach) -> None:
    assert reach.present(), (
        f"{reach.name} is not where llmspans/_internals.py reaches for it in {reach.installed()} "
        f"(checked on {reach.checked}). Until that module follows it: {reach.fallback}."
    )


def test_the_reaches_are_listed_once_each() -> None:
    names = [reach.name for reach in _internals.REACHES]
    assert len(names) == len(set(names))
    assert all(reach.checked and reach.fallback for reach in _internals.REACHES)


def test_without_the_sdks_private_mapping_a_span_says_its_attributes_publicly() -> None:
    public = SimpleNamespace(attributes={"a": 1})
    assert _internals.span_attributes(public) == {"a": 1}
    assert _internals.span_attributes(SimpleNamespace(attributes=None)) == {}


def test_without_a_known_pool_or_an_http11_connection_no_connection_is_found() -> None:
    extensions: dict[str, object] = {}
    assert _internals.http11_network_stream(object(), extensions) is None
    pending = SimpleNamespace(request=SimpleNamespace(extensions=extensions), connection=None)
    transport = SimpleNamespace(_pool=SimpleNamespace(_requests=[pending]))
    assert _internals.http11_network_stream(transport, extensions) is None  # placed on no HTTP/1.1 connection


def test_without_the_private_parts_the_fallbacks_say_none() -> None:
    assert _internals.composite_members(object()) is None
    assert _internals.client_transport(object()) is None
    assert _internals.client_mounts(object()) is None
    assert _internals.meter_provider_resource(object()) is None
    assert _internals.reset_reader_storage(object(), object()) is False
    assert _internals.openai_http_client(object()) is None


def test_without_rays_private_parts_the_load_tool_takes_an_address_as_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from llmspans.load import _ray

    monkeypatch.setattr(_internals, "_module", lambda name: None)  # a Ray that keeps neither name
    assert _internals.ray_bootstrap_address("auto") is None
    assert _internals.quiet_ray_worker_logs() is False
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _ray._bootstrap("10.0.0.5:6379") == "10.0.0.5:6379"
    with pytest.raises(_ray.RayUnavailable, match="pass the cluster's host:port"):
        _ray._bootstrap("auto")
