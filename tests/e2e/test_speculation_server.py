"""Speculation through the server: the per-request switches, reference documents, and
what /metrics shows per source."""

from __future__ import annotations

import httpx
import pytest
from e2e_server import KEY_A
from test_server import assert_error, sdk, user

pytestmark = pytest.mark.slow

PARAGRAPH = ("The harbour wall is repaired each spring, the lighthouse is repainted, and "
             "the buoys in the channel are checked before the ferries start running.")


def _verified(server) -> tuple[float, float]:
    """Draft tokens verified so far (every source), and the steps that verified."""
    m = server.metrics()
    drafted = sum(v for k, v in m.items() if k.startswith("ember_spec_drafted_tokens_total"))
    return drafted, m.get('ember_spec_steps_total{kind="verify"}', 0)


def test_speculation_on_or_off_gives_the_same_reply(smol_server):
    """The same reply, and the switch is real: with speculation on, drafts of the
    copied sentence were verified; with it off, none were."""
    client = sdk(smol_server)
    msgs = user(f"Copy this sentence exactly: {PARAGRAPH}")
    before = _verified(smol_server)
    on = client.chat.completions.create(model=smol_server.model_id, messages=msgs,
                                        max_tokens=40, temperature=0)
    between = _verified(smol_server)
    off = client.chat.completions.create(model=smol_server.model_id, messages=msgs,
                                         max_tokens=40, temperature=0,
                                         extra_body={"speculation": False})
    after = _verified(smol_server)
    assert on.choices[0].message.content == off.choices[0].message.content
    assert between[0] > before[0] and between[1] > before[1], (before, between)
    assert after == between
    # the reply's usage says what its drafts did, as the metrics counted them
    details = on.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens + details.rejected_prediction_tokens
            == between[0] - before[0])
    assert 0 < details.accepted_prediction_tokens < on.usage.completion_tokens
    assert off.usage.completion_tokens_details is None


def test_references_feed_the_reference_source(smol_server):
    client = sdk(smol_server)
    before = smol_server.metrics()
    key = 'ember_spec_drafted_tokens_total{source="reference"}'
    # a raw prompt that ends inside the reference: the reference index matches at once
    client.completions.create(model=smol_server.model_id, max_tokens=24, temperature=0,
                              prompt=PARAGRAPH[:70], extra_body={"references": [PARAGRAPH]})
    after = smol_server.metrics()
    assert after.get(key, 0) > before.get(key, 0), {k: v for k, v in after.items()
                                                    if "spec" in k}
    assert after['ember_spec_steps_total{kind="verify"}'] > 0


@pytest.mark.parametrize("field,value,param", [
    ("references", "not a list", "references"),
    ("references", [1, 2], "references[0]"),
    ("speculation", "sometimes", "speculation"),
])
def test_bad_speculation_fields_are_400_naming_them(smol_server, field, value, param):
    r = httpx.post(smol_server.url + "/v1/chat/completions", timeout=30,
                   headers={"Authorization": f"Bearer {KEY_A}"},
                   json={"model": smol_server.model_id, "messages": user("hi"),
                         "max_tokens": 2, field: value})
    assert_error(r, 400, param)
