"""Hardening, on the ``guarded`` application: API keys (plain and hashed), per-key rate limits,
CORS, limits that know the model, and schemathesis against the OpenAPI schema."""

from __future__ import annotations

import collections
import time

import pytest
import requests
from hypothesis import given

from .helpers import GUARDED_ARGS, KEY_A, KEY_B, ORIGIN, SIZE, auth

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


def test_api_keys(guarded):
    r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x", "seed": 1}, timeout=60)
    assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
    assert err["request_id"] == r.headers["X-Request-Id"]
    r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x"}, headers=auth("wrong-key-000"))
    assert r.status_code == 401 and r.json()["error"]["message"] == "incorrect API key"
    assert requests.get(f"{guarded}/v1/models", headers={"Authorization": KEY_A}).status_code == 401
    for key in (KEY_A, KEY_B):  # the plain and the hashed entry
        r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x", "seed": 1},
                          headers=auth(key), timeout=120)
        assert r.status_code == 200, r.text
    assert requests.get(f"{guarded}/healthz").status_code == 200  # open, for load balancers
    assert requests.get(f"{guarded}/openapi.json").status_code == 200
    r = requests.get(f"{guarded}/v1/stats", headers={"X-Request-Id": "trace-me-42"})
    assert r.status_code == 401 and r.headers["X-Request-Id"] == "trace-me-42"


def test_api_keys_through_the_openai_client(guarded):
    import openai

    client = openai.OpenAI(base_url=f"{guarded}/v1", api_key=KEY_A, max_retries=0)
    assert len(client.images.generate(prompt="a red circle", size="32x32").data) == 1
    bad = openai.OpenAI(base_url=f"{guarded}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        bad.images.generate(prompt="a red circle")


def test_rate_limit_per_key(guarded):
    """KEY_B's bucket (400 a minute) runs out; KEY_A's is its own; 429 says when to retry."""
    session = requests.Session()
    limit, codes = GUARDED_ARGS["rate_limit_per_minute"], []
    t0 = time.monotonic()
    while 429 not in codes and len(codes) < 3 * limit:
        r = session.get(f"{guarded}/v1/models", headers=auth(KEY_B))
        codes.append(r.status_code)
    refilled = (time.monotonic() - t0) * limit / 60
    assert codes[-1] == 429 and set(codes[:-1]) == {200}, codes
    assert limit <= len(codes) - 1 <= limit + refilled + 1, (len(codes), refilled)
    # the 429 itself (a request after it may already find a token: one refills every 0.15 s)
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert session.get(f"{guarded}/v1/models", headers=auth(KEY_A)).status_code == 200


def test_cors_only_for_configured_origins(guarded, main_app):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = requests.options(f"{guarded}/v1/generate", headers=pre)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    r = requests.options(f"{guarded}/v1/generate", headers={**pre, "Origin": "http://evil.test"})
    assert "Access-Control-Allow-Origin" not in r.headers
    r = requests.get(f"{main_app.url}/v1/models", headers={"Origin": ORIGIN})
    assert "Access-Control-Allow-Origin" not in r.headers  # off by default


def test_limits_that_know_the_model(guarded, pipe):
    """max_steps=5000 is allowed by the serve args, but the scheduler allows 1000: 422 naming
    steps and the range; the cost budget names the field to lower."""
    r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x", "steps": 1001},
                      headers=auth(KEY_A))
    assert r.status_code == 422, r.text
    assert "must be an integer in 1..1000 (what this model's EulerDiscreteScheduler allows)" in \
        r.json()["error"]["message"] and r.json()["error"]["param"] == "steps"
    r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x", "steps": 3},
                      headers=auth(KEY_A))
    assert r.status_code == 422 and "at most 2 step(s) for one image" in r.text
    r = requests.post(f"{guarded}/v1/generate", json={"prompt": "x" * 5000}, headers=auth(KEY_A))
    assert r.status_code == 413 and "larger than 4096 bytes" in r.text  # the serve arg applies
    with pytest.raises(ValueError, match=r"num_inference_steps=1001: must be an integer in "
                                         r"1\.\.1000 \(what EulerDiscreteScheduler allows\)"):
        pipe("x", num_inference_steps=1001, height=SIZE, width=SIZE)


def test_fuzz_against_the_openapi_schema(guarded):
    """schemathesis: generated requests for every operation (valid and invalid bodies): no 5xx,
    every status code documented, every response matching its schema."""
    import schemathesis
    from hypothesis import HealthCheck
    from hypothesis import settings as hsettings
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(f"{guarded}/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]
    seen = collections.Counter()
    session = requests.Session()
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST":  # a GET without parameters has nothing to get wrong
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            @hsettings(max_examples=12, deadline=None, database=None,
                       suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(mode))
            def fuzz(case):
                response = case.call(base_url=guarded, session=session, headers=auth(KEY_A),
                                     timeout=120)
                seen[(op.label, response.status_code)] += 1  # noqa: B023 (called here)
                case.validate_response(response, checks=checks)

            fuzz()
    assert not [k for k in seen if k[1] >= 500], seen
    assert any(code == 200 for (label, code) in seen if "generate" in label), seen
    assert any(code == 422 for (label, code) in seen if "generate" in label), seen
