"""The native kernels in tests: they must build where the suite runs.

CI builds them (its machines have a C++ compiler), so a kernel that does not build
fails the tests that need it instead of skipping them. A developer on a machine
without a compiler sets ``EMBER_TESTS_WITHOUT_KERNELS=1`` to skip them, knowingly.
Builds for another instruction set (the AVX2 variant) are skipped only where the
machine is not x86; the AVX-VNNI variant also where the CPU lacks AVX-VNNI (it could
not run it).
"""

from __future__ import annotations

import os
import platform
from typing import Any

import pytest

from ember import kernels

X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def require_kernels() -> Any:
    """The native extension; fails (or, when told, skips) where it does not build."""
    mod = kernels.quant_matmul()
    if mod is not None:
        return mod
    why = f"native kernels did not build: {kernels.unavailable_reason()}"
    if os.environ.get("EMBER_TESTS_WITHOUT_KERNELS") == "1":
        pytest.skip(why)
    pytest.fail(why + " (set EMBER_TESTS_WITHOUT_KERNELS=1 to skip these tests)")


# the builds the tests compile beside the native one (those of EMBER_KERNEL_ISA)
SIMD_VARIANTS: dict[str, list[str]] = {
    isa: flags for isa, (_, flags) in kernels._ISA_VARIANTS.items()}


def build_variant(variant: str) -> Any:
    """Another SIMD build of the same source (cached beside the real one)."""
    require_kernels()
    flags = SIMD_VARIANTS[variant]
    if flags and not X86:
        pytest.skip(f"the {variant} variant is an x86 build; this is {platform.machine()}")
    missing = kernels.missing_cpu_flags(variant)
    if missing:
        pytest.skip(f"the {variant} variant needs {', '.join(missing)}, which this CPU lacks")
    name = f"ember_qmm_test_{variant}"
    return kernels.compile_quant_matmul(name, flags, kernels._build_root() / name)


def score_with_stack(model: Any, stack: Any, ids: list[int]) -> Any:
    """The model's teacher-forced logits of ``ids`` with ``stack`` in place of its
    native stack (None: the op-by-op PyTorch path); its own is put back afterwards."""
    saved, model.native = model.native, stack
    try:
        return model.score(ids)
    finally:
        model.native = saved


def fused_vs_op_by_op(model: Any, ids: list[int]) -> tuple[Any, float]:
    """A q4 model's teacher-forced logits through its fused native stack, and their
    relative distance from the op-by-op PyTorch path on the same packed weights. The
    stack must be the model's: asserted here."""
    assert model.native is not None and model.batch_invariant
    fused = model.score(ids)
    op_by_op = score_with_stack(model, None, ids)
    return fused, ((fused - op_by_op).norm() / op_by_op.norm()).item()
