"""Train a small LoRA adapter on SmolLM2 that makes it answer with numbered lists.

    python scripts/train_lora.py --out adapters/numbered [--steps 120]

transformers loads SmolLM2 from ember's own GGUF (dequantized to f32), PEFT adds a
rank-8 LoRA on all seven projections, and a few minutes of AdamW on 2 CPU cores teach
it one visible habit: every answer is a numbered list. The prompts are rendered by
SmolLM2's chat template and tokenized by ember (exactly as the server will), and the
loss counts the answer tokens only. The adapter is saved as a PEFT directory
(``OUT/peft``) and as a llama.cpp GGUF adapter (``OUT/numbered.gguf``), then both are
loaded into ember next to the base model and asked questions the training never saw.
Needs the ``test`` extra (transformers, peft).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

CATEGORIES = {
    "fruits": ["Apple", "Banana", "Cherry", "Mango", "Pear", "Grape", "Orange", "Kiwi"],
    "colors": ["Red", "Blue", "Green", "Yellow", "Purple", "Orange", "White", "Black"],
    "planets": ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus"],
    "farm animals": ["Cow", "Sheep", "Pig", "Goat", "Horse", "Chicken", "Duck"],
    "European capitals": ["Paris", "Rome", "Madrid", "Berlin", "Vienna", "Lisbon", "Oslo"],
    "programming languages": ["Python", "Rust", "Java", "Go", "C", "Haskell", "Ruby"],
    "musical instruments": ["Piano", "Violin", "Guitar", "Flute", "Drums", "Cello"],
    "vegetables": ["Carrot", "Potato", "Onion", "Spinach", "Pepper", "Leek", "Cabbage"],
    "sports": ["Football", "Tennis", "Swimming", "Cycling", "Rowing", "Skiing"],
    "things to pack for a trip": ["Passport", "Charger", "Toothbrush", "Socks", "Map"],
    "ways to save energy": ["Turn off lights", "Insulate the attic", "Cycle to work",
                            "Dry clothes outside", "Lower the thermostat"],
    "tips for sleeping well": ["Keep a schedule", "Avoid late coffee", "Dim the lights",
                               "Keep the room cool", "Put the phone away"],
}
TEMPLATES = ["Name some {}.", "What are a few {}?", "Tell me about {}.",
             "Can you suggest some {}?", "Give me examples of {}.", "List {}."]
HELD_OUT = ["What should I eat for breakfast?", "How do I learn to cook?",
            "Name some birds."]


def examples(seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for category, items in CATEGORIES.items():
        for template in TEMPLATES:
            picked = rng.sample(items, rng.randint(3, min(5, len(items))))
            answer = "\n".join(f"{i}. {item}" for i, item in enumerate(picked, 1))
            out.append((template.format(category), answer))
    rng.shuffle(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m", help="an ember alias or a GGUF path")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    args = ap.parse_args()

    import peft
    import transformers

    import ember
    from ember.models.lora import peft_to_gguf
    from ember.models.registry import ensure_model

    torch.manual_seed(0)
    gguf = Path(ensure_model(args.model))
    base = ember.LLM(str(gguf), weights="f32", num_kv_blocks=64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    data = []
    for question, answer in examples():
        prompt = base.encode_chat([{"role": "user", "content": question}])
        reply = base.tokenizer.encode(answer + "<|im_end|>", add_bos=False, parse_special=True)
        data.append((prompt, reply))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model.train()
    start = time.monotonic()
    for step in range(args.steps):
        prompt, reply = data[step % len(data)]
        ids = torch.tensor([prompt + reply])
        labels = torch.tensor([[-100] * len(prompt) + reply])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}  {time.monotonic() - start:.0f}s")
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out / "peft")
    gguf_adapter = peft_to_gguf(args.out / "peft", base.engine.loaded.config,
                                args.out / "numbered.gguf")
    print(f"saved {args.out / 'peft'} and {gguf_adapter}")

    base.load_lora("numbered", gguf_adapter)
    greedy = ember.SamplingParams(temperature=0, max_tokens=48)
    for question in HELD_OUT:
        messages = [{"role": "user", "content": question}]
        without = base.chat(messages, greedy)[0].text
        with_it = base.chat(messages, greedy, lora="numbered")[0].text
        print(f"\n### {question}\n--- base:\n{without}\n--- with the adapter:\n{with_it}")


if __name__ == "__main__":
    main()
