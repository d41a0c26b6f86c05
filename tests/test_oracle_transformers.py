"""Independent logits oracle: HF transformers loading the same GGUF file.

transformers dequantizes the GGUF with gguf-py's reference kernels, un-permutes
Q/K back to HF's split-half RoPE layout and runs its own Llama implementation, so
nothing on its side of the comparison was written here. Both sides run float32
on the same dequantized weights, so they may differ only by float32 rounding
(matmul blocking, softmax and RoPE evaluation order): observed max |Δlogit| is
7.6e-5 (mean 6.5e-6) over 288 positions, with |logits| up to ~40. The bound below
(1e-3, i.e. 2.5e-5 of the logit range) leaves >10x headroom for other BLAS builds
and thread counts while staying four orders of magnitude below what a real bug
produces (adjacent-pair vs split-half RoPE moves logits by up to ~40). The smallest
top-2 logit gap on this text is ~3e-3 > 2 * ATOL, so the argmax checks cannot flip
on rounding alone.

Token ids come from ember's tokenizer: transformers' GGUF tokenizer converter gets
SmolLM2's pre-tokenizer wrong, so it is no oracle for tokenization.
"""

from __future__ import annotations

import os

import pytest

# huggingface_hub reads this once, at import: set it before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

pytest.importorskip(
    "transformers", reason="transformers is not installed (the independent logits oracle)"
)
pytest.importorskip(
    "accelerate", reason="accelerate is not installed (transformers needs it to load a GGUF)"
)

pytestmark = pytest.mark.slow

ATOL = 1e-3  # see module docstring
GREEDY_TOKENS = 24

# Real text: English prose, then a little Python. ~300 tokens with SmolLM2's tokenizer.
TEXT = """\
The lighthouse stood at the edge of the cliff for more than a century, and in all \
that time its keepers kept a careful log of every ship that passed. Most entries were \
brief: a name, a heading, the state of the sea. But on a winter night in 1893 the \
keeper wrote three full pages about a storm that came in from the north without \
warning. The wind tore slates from the roof, the lamp flickered twice, and a fishing \
boat with four men aboard was driven toward the rocks below. He lit a second lamp, \
climbed down the iron stairs with a coil of rope, and waited in the spray until the \
boat struck the shallows. All four men survived.

Years later, when the light was automated and the last keeper moved inland, the log \
books were sent to a small museum in the harbour town. Visitors still stop at the \
glass case where the winter entry lies open, the ink faded to brown, and read how \
ordinary courage looks when it is written down by the person who showed it.

def fibonacci(n: int) -> int:
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


print([fibonacci(i) for i in range(10)])
"""

# Greedy prompt: a sentence cut off mid-way, so the continuation is real text.
GREEDY_PROMPT = "The old lighthouse keeper climbed the stairs every evening to"


@pytest.fixture(scope="module")
def hf_model(smollm2_hf):
    """transformers' own LlamaForCausalLM, dequantized from the same GGUF (float32), by
    ``hf_gguf.transformers_from_gguf`` from a copy without the vocabulary; loaded once
    per session (conftest), shared with the LoRA adapters' oracle."""
    return smollm2_hf


@pytest.fixture(scope="module")
def ember_tokenizer(smollm2_file):
    from ember.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_file)


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def test_logits_match_transformers(hf_model, smollm2_llm, ember_tokenizer):
    ids = ember_tokenizer.encode(TEXT, add_bos=ember_tokenizer.add_bos)
    assert 250 <= len(ids) <= 400, len(ids)

    ours = smollm2_llm.engine.loaded.model.score(ids)
    ref = _hf_logits(hf_model, ids)
    assert ours.shape == ref.shape == (len(ids), smollm2_llm.engine.loaded.config.vocab_size)
    assert ours.dtype == torch.float32

    diff = (ours - ref).abs()
    per_pos = diff.max(dim=-1).values
    worst = int(per_pos.argmax())
    scale = float(ref.abs().max())
    assert float(per_pos.max()) <= ATOL, (
        f"max |Δlogit| {float(per_pos.max()):.3g} at position {worst} of {len(ids)} "
        f"(logit scale {scale:.1f}; mean |Δ| {float(diff.mean()):.3g})"
    )

    mismatched = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    assert not mismatched, f"argmax differs at positions {mismatched}"


def test_greedy_continuation_matches_transformers(hf_model, smollm2_llm, ember_tokenizer):
    from ember import SamplingParams

    prompt = ember_tokenizer.encode(GREEDY_PROMPT, add_bos=ember_tokenizer.add_bos)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    ours = list(smollm2_llm.generate([prompt], params)[0].token_ids)

    assert len(ours) == GREEDY_TOKENS

    # transformers' greedy choice after every prefix of prompt + ours, in one teacher-forced
    # forward pass. By induction this equals transformers' own greedy continuation exactly
    # when it equals ours, without 24 memory-bound decode steps through its Python loop.
    ref = _hf_logits(hf_model, prompt + ours)[len(prompt) - 1 : -1]
    theirs = ref.argmax(-1).tolist()
    diverge = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    if diverge:
        i = diverge[0]
        top2 = ref[i].topk(2)
        pytest.fail(
            f"greedy continuation diverges at generated token {i}: ember chose {ours[i]} "
            f"({ember_tokenizer.decode([ours[i]])!r}), transformers {theirs[i]} "
            f"({ember_tokenizer.decode([theirs[i]])!r}); transformers' top-2 logits there "
            f"{top2.values.tolist()}\n"
            f"  ember: {ember_tokenizer.decode(ours)!r}"
        )
