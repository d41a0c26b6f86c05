"""Coverage-guided fuzzing of ember's file readers under atheris (libFuzzer).

    python scripts/fuzz.py TARGET [--seconds N] [--corpus DIR] [libFuzzer flags...]

TARGET is one of tests/fuzz_targets.py's (gguf_model, lora_gguf, lora_peft, kv_block,
chat_template). The corpus starts from the target's seed files; every input must load
or be refused with one of ember's named errors (an EmberError): any other exception,
or a hang past the deadline, stops the run and leaves the input as ``crash-*`` in the
working directory. ``make fuzz`` runs each target for a bounded time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

with atheris.instrument_imports(include=["ember"]):
    # the readers themselves (the targets import them lazily): instrumented for coverage
    import fuzz_targets

    import ember.chat_template  # noqa: F401
    import ember.kv.disk  # noqa: F401
    import ember.models.gguf  # noqa: F401
    import ember.models.loader  # noqa: F401
    import ember.models.lora  # noqa: F401
    import ember.tokenizer  # noqa: F401


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target")
    p.add_argument("--seconds", type=int, default=60)
    p.add_argument("--corpus", type=Path, default=None)
    args, libfuzzer = p.parse_known_args()
    targets = fuzz_targets.scratch_targets()
    target = targets.all()[args.target]
    corpus = args.corpus or targets.scratch / f"corpus-{args.target}"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(targets.seeds()[args.target]):
        (corpus / f"seed-{i}").write_bytes(seed)

    def one_input(data: bytes) -> None:
        fuzz_targets.outcome(target, data)

    atheris.Setup([sys.argv[0], f"-max_total_time={args.seconds}", "-rss_limit_mb=4096",
                   "-timeout=30", *libfuzzer, str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
