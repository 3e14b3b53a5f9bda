"""/v1 bodies fuzzed: whatever a client sends, the answer is never a 5xx of ours and every
refusal is OpenAI's `{"error": {...}}` (a 503 for capacity is the one server answer allowed)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import MODEL

pytestmark = pytest.mark.slow

# Values of every JSON shape, the awkward ones included: past-64-bit integers, NUL and
# lone surrogate-free unicode, deep nesting, empty containers.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.sampled_from(["", "\x00", "user", "system", "assistant", "tool", MODEL, "auto"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bogus"]) | json_values},
    optional={
        "content": st.text(max_size=60)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url", "x"]) | json_values},
                optional={"text": json_values, "image_url": json_values},
            ),
            max_size=3,
        )
        | json_values,
        "name": json_values,
        "tool_calls": json_values,
        "tool_call_id": json_values,
    },
)
FIELDS = {
    "model": st.just(MODEL) | json_values,
    "messages": st.lists(message, max_size=3) | json_values,
    "prompt": st.text(max_size=60) | json_values,
    "max_tokens": st.integers(min_value=-5, max_value=8) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": json_values,
    "n": st.integers(-1, 3) | json_values,
    "stop": json_values,
    "stream": st.booleans() | json_values,
    "stream_options": json_values,
    "logprobs": json_values,
    "tools": json_values,
    "tool_choice": json_values,
    "response_format": json_values,
    "seed": json_values,
    "user": json_values,
}
VALID = {
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    },
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
}


@st.composite
def bodies(draw: st.DrawFn, path: str) -> dict[str, Any]:
    """A valid body with one to three fields replaced, added or removed: most of it valid, so
    the odd field reaches the code that handles it rather than the first check."""
    body: dict[str, Any] = dict(VALID[path])
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=3)):
        # max_tokens stays: a valid body without it runs to the key's cap (its own tests).
        if draw(st.booleans()) and name in body and name != "max_tokens":
            del body[name]
        else:
            body[name] = draw(FIELDS[name])
    return body


def _check(reply: httpx.Response) -> None:
    assert reply.status_code < 500 or reply.status_code == 503, reply.text[:300]
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)


@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), path=st.sampled_from(sorted(VALID)))
def test_no_body_makes_the_gateway_fail(ready: Any, data: st.DataObject, path: str) -> None:
    _, _, http = ready
    body = data.draw(bodies(path))
    # The stdlib writes integers of any size as numbers, as a client's JSON library may.
    raw = json.dumps(body).encode()
    with http.stream(
        "POST", path, content=raw, headers={"content-type": "application/json"}
    ) as reply:
        reply.read()
    _check(reply)
