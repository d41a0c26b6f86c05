"""EngineConfig: every engine option in one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.models.registry import DEFAULT_MODEL

# The tenant_limits entry that applies to every tenant not named there.
EVERY_TENANT = "*"


class InvalidConfig(ValueError):
    """An engine option is out of range; the message names the option and its value."""


@dataclass(frozen=True)
class TenantLimits:
    """What one tenant may hold at once (None: no limit of its own; the shared pools are
    still divided fairly: a tenant holding the most is evicted or preempted first)."""

    max_running: int | None = None  # its requests running at once; more wait their turn
    max_queued: int | None = None  # its requests waiting beyond those; more are refused
    # the most of the KV pool its running requests hold (more wait; a request that could
    # never fit is refused) and, separately, the most its cached prefixes keep
    kv_share: float | None = None
    disk_share: float | None = None  # the most of the disk tier's bytes its prefixes keep
    max_adapters: int | None = None  # LoRA adapters its requests keep resident

    COUNTS = ("max_running", "max_queued", "max_adapters")
    SHARES = ("kv_share", "disk_share")

    def __post_init__(self) -> None:
        for name in self.COUNTS:
            value = getattr(self, name)
            least = 0 if name == "max_queued" else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < least):
                raise InvalidConfig(f"tenant limit {name} must be a "
                                    f"{'non-negative' if least == 0 else 'positive'}"
                                    f" integer, got {value!r}")
        for name in self.SHARES:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))
                                      or not 0 < value <= 1):
                raise InvalidConfig(f"tenant limit {name} must be a fraction in (0, 1], "
                                    f"got {value!r}")

    def share(self, name: str, total: int) -> int | None:
        """The share ``name`` of ``total`` units (at least one), None without a limit."""
        value = getattr(self, name)
        return None if value is None else max(1, int(value * total))


@dataclass
class EngineConfig:
    """Options of an :class:`~ember.LLM` engine (and of ``ember serve``).

    ``kv_cache_bytes`` sizes the paged KV pool unless ``num_kv_blocks`` is given.
    ``max_model_len`` (prompt + output) defaults to the model's context length.
    ``weights`` defaults to ``auto``: ``q4`` (native int4/int8 kernels, ~5x faster
    decode) where its kernel builds, else ``f32``; ``f32`` with ``kv_dtype="f32"`` is the
    exact oracle (the default KV dtype, ``f16``, rounds each cached K/V to 11 bits).
    ``max_prefill_chunk`` caps one request's prefill tokens in a step while others
    are waiting or running (default: a quarter of ``max_num_batched_tokens``), so a
    long prompt cannot hold up admissions; leftover budget still goes to it.
    """

    model: str = DEFAULT_MODEL
    weights: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_chunk: int | None = None
    # a step carrying prompt tokens is sized (by the step cost model) to take at most
    # this long, so a request arriving while a long prompt prefills waits short steps
    max_prefill_step_seconds: float = 0.5
    block_size: int = 16
    kv_cache_bytes: int = 2 * 1024**3
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    max_queue: int = 1024
    enable_prefix_caching: bool = True
    threads: int | None = None
    speculation: str = "auto"  # "auto": requests may speculate (gated); "off": never
    spec_max_draft: int = 16  # most draft tokens one request verifies in a step
    max_lora_rank: int = 64  # LoRA adapters of a higher rank are refused at load
    max_loras: int = 8  # LoRA adapters kept resident (least recently used evicted)
    # how resident adapters are held: f32, bf16 (half the bytes each step reads), or auto:
    # bf16 where the base runs the fused native stack, f32 (the exact oracle) elsewhere
    lora_dtype: str = "auto"
    spec_references: tuple[str, ...] = ()  # texts every request may draft from
    chat_template: str | None = None  # a Jinja chat template replacing the GGUF's
    calibrate_costs: bool = False  # measure step costs at startup (~2 s) instead of the table
    # KV pool storage: f16, f32 (exact), bf16, q8_0 (0.53x of f16). Measured reason for f16:
    # its drift from f32 KV is KL < 1e-5, within q4's noise, at half the bytes (`ember eval`)
    kv_dtype: str = "f16"
    kv_cache_dir: str | None = None  # a disk tier for the prefix cache (docs/kv-cache.md)
    # publish KV-cache events in vLLM's wire format (ZMQ PUB; docs/scaling.md)
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    # per tenant name (EVERY_TENANT: the rest): running and queued requests at once
    tenant_limits: dict[str, TenantLimits] = field(default_factory=dict)
    kv_disk_bytes: int = 16 * 1024**3  # the disk tier's budget (LRU beyond it)
    kv_fsync: str = "batch"  # disk tier durability: always | batch | never
    kv_restore: str = "auto"  # auto: restore from disk where faster than recomputing; always
    allow_drift: bool = False  # use weights/KV whose `ember eval` drift crosses the limits
    moe_stream: bool = False  # MoE models: page experts from the file (docs/models.md)
    moe_cache_bytes: int = 1024**3  # the streamed experts' cache (per-layer LRU + pinned)
    moe_pilot: bool = False  # streamed: read the experts guessed for the next layer ahead
    moe_expert_top_p: float = 1.0  # < 1: each token's experts up to this weight (LOSSY)
    moe_pinned_share: float = 0.0  # of moe_cache_bytes, the hottest experts, never evicted
    # hybrid models (Qwen 3.5): snapshots of recurrent state at block boundaries, so the
    # prefix cache can serve them (0: no prefix reuse for them); least recently used out
    state_snapshot_bytes: int = 256 * 1024**2

    def limits_for(self, tenant: str | None) -> TenantLimits:
        """The limits of ``tenant``: its own entry, else the one for every tenant."""
        own = self.tenant_limits.get(tenant or "")
        return own or self.tenant_limits.get(EVERY_TENANT) or TenantLimits()

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidConfig(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_bytes",
                     "max_queue", "kv_disk_bytes", "moe_cache_bytes"):
            positive(name)
        if not isinstance(self.state_snapshot_bytes, int) or self.state_snapshot_bytes < 0:
            raise InvalidConfig(f"state_snapshot_bytes must be a non-negative integer, got "
                                f"{self.state_snapshot_bytes!r}")
        if not isinstance(self.moe_expert_top_p, int | float) or not (
                0 < self.moe_expert_top_p <= 1):
            raise InvalidConfig(f"moe_expert_top_p must be in (0, 1], got "
                                f"{self.moe_expert_top_p!r}")
        if not isinstance(self.moe_pinned_share, int | float) or not (
                0 <= self.moe_pinned_share <= 1):
            raise InvalidConfig(f"moe_pinned_share must be in [0, 1], got "
                                f"{self.moe_pinned_share!r}")
        for tenant, limits in self.tenant_limits.items():
            if not isinstance(limits, TenantLimits):
                raise InvalidConfig(f"tenant_limits[{tenant!r}] must be a TenantLimits, "
                                    f"got {limits!r}")
        from ember.kv.blocks import KV_DTYPES
        from ember.kv.disk import FSYNC_POLICIES

        if self.kv_dtype not in KV_DTYPES:
            raise InvalidConfig(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, "
                                f"got {self.kv_dtype!r}")
        if self.kv_fsync not in FSYNC_POLICIES:
            raise InvalidConfig(f"kv_fsync must be one of {', '.join(FSYNC_POLICIES)}, "
                                f"got {self.kv_fsync!r}")
        if self.kv_cache_dir is not None and not self.enable_prefix_caching:
            raise InvalidConfig("kv_cache_dir needs the prefix cache (enable_prefix_caching)")
        if self.kv_events_endpoint is not None and not self.enable_prefix_caching:
            raise InvalidConfig("kv_events_endpoint needs the prefix cache "
                                "(enable_prefix_caching): its events are the cache's")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise InvalidConfig("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.kv_restore not in ("auto", "always"):
            raise InvalidConfig(f"kv_restore must be 'auto' or 'always', got {self.kv_restore!r}")
        if self.speculation not in ("auto", "off"):
            raise InvalidConfig(f"speculation must be 'auto' or 'off', got {self.speculation!r}")
        positive("spec_max_draft")
        positive("max_lora_rank")
        positive("max_loras")
        if self.lora_dtype not in ("auto", "f32", "bf16"):
            raise InvalidConfig(f"lora_dtype must be auto, f32 or bf16, got {self.lora_dtype!r}")
        if not (isinstance(self.max_prefill_step_seconds, int | float)
                and self.max_prefill_step_seconds > 0):
            raise InvalidConfig("max_prefill_step_seconds must be a positive number of "
                                f"seconds, got {self.max_prefill_step_seconds!r}")
        for name in ("num_kv_blocks", "max_model_len", "threads", "max_prefill_chunk"):
            positive(name, allow_none=True)
        if self.block_size & (self.block_size - 1):
            raise InvalidConfig(f"block_size must be a power of two, got {self.block_size}")
        from ember.models.linear import WEIGHT_CHOICES

        if self.weights not in WEIGHT_CHOICES:
            raise InvalidConfig(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, "
                                f"got {self.weights!r}")
        if not isinstance(self.model, str) or not self.model:
            raise InvalidConfig(f"model must be an alias or a .gguf path, got {self.model!r}")
