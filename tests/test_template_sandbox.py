"""Chat templates from model files are untrusted: each of these renders within bounds
or is refused with ChatTemplateError — never a stuck worker or an exhausted memory
(each case runs under a 10 s alarm: without the bounds they would run for minutes or
allocate gigabytes)."""

from __future__ import annotations

import pytest
from fuzz_targets import deadline

from ember.chat_template import ChatTemplate
from ember.errors import ChatTemplateError

USER = [{"role": "user", "content": "hi"}]
BOMBS = {  # the template, and the bound that must stop it
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                     "{% endfor %}", "ran for more than"),
    "repeat": ("{{ 'x' * 10000000000 }}", "repeats a value"),
    "format width": ("{{ '%*s' % (1000000000, '') }}", "width"),
    "format literal": ("{{ '%999999999s' % '' }}", "width"),
    "namespace doubling": ("{% set ns = namespace(x='ab') %}{% for i in range(64) %}"
                           "{% set ns.x = ns.x ~ ns.x %}{% endfor %}{{ ns.x|length }}",
                           "namespace value"),
    "list doubling": ("{% set l = [1] %}{% for i in range(64) %}{% set _ = l.extend(l) %}"
                      "{% endfor %}{{ l|length }}", "extend changed"),
    "center": ("{{ 'x'|center(1000000000) }}", "width"),
    "indent": ("{{ 'x\nx'|indent(1000000000) }}", "width"),
    "tojson indent": ("{{ messages|tojson(indent=1000000000) }}", "width"),
    "power": ("{{ 10 ** 100000000 }}", "power"),
    "output": ("{% for i in range(100000) %}{% for j in range(1000) %}"
               "{{ 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' }}{% endfor %}{% endfor %}",
               "wrote more than"),
    "str method": ("{{ 'x'.ljust(1000000000) }}", "width"),
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_a_hostile_template_is_refused_by_name(name):
    source, bound = BOMBS[name]
    template = ChatTemplate(source, bos_token="", eos_token="")
    with deadline(10), pytest.raises(ChatTemplateError, match=bound):
        template.render(USER)


def test_a_template_that_cannot_render_its_probe_is_refused_at_load():
    """The probe that runs at load hits the bound: the model loads without chat."""
    with deadline(10), pytest.raises(ChatTemplateError, match="more than"):
        ChatTemplate(BOMBS["nested loops"][0], bos_token="", eos_token="").caps  # noqa: B018


def test_real_templates_keep_what_they_may_do():
    """Within the bounds: widths, repeats and namespaces of sizes real templates use,
    and appending to a list (Kimi's templates do)."""
    source = ("{% set ns = namespace(s='') %}{% set l = [] %}{% for m in messages %}"
              "{% set ns.s = ns.s ~ m['content'] %}{% set _ = l.append(m) %}{% endfor %}"
              "{{ ns.s|center(20) }}|{{ '-' * 10 }}|{{ '%5s' % 'a' }}|{{ l|length }}|"
              "{{ messages|tojson(indent=2)|length > 0 }}")
    out = ChatTemplate(source, bos_token="", eos_token="").render(USER)
    assert out == "         hi         |----------|    a|1|True"
