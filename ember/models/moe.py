"""Mixture-of-experts FFN layers (Qwen3-MoE style) and the stores their experts live in.

A layer routes each token to ``k`` of its ``E`` experts: softmax over the router's
logits, the top ``k`` kept and renormalised to sum to one (llama.cpp's and Qwen3's
``norm_topk_prob``); the output is the weighted sum of those experts' SwiGLU FFNs.
Tokens are grouped by expert, so a step computes (and reads) each expert it needs
once, on every token routed to it. GGUF stores a layer's experts as three 3-D
tensors ``ffn_{gate,up,down}_exps`` ([E, out, in]); expert ``e`` is one contiguous
slice of each.

Two ways to run a layer: :class:`MoEFeedForward` here, op by op in PyTorch (the f32
oracle), and, where every expert is packed (``--weights q4``), the fused native stack's
routed experts (``ember/kernels/routed_experts.h``): routing, grouping and all active
experts' products in native code, one parallel pass per projection. A store fills the
native layer's slots (:meth:`ExpertStore.attach`) and drains its usage counts after
each step (:meth:`ExpertStore.end_step`).

``--moe-expert-top-p F`` (< 1) keeps each token's highest-weighted experts only up to
cumulative weight F and renormalises them: fewer experts read per token, and a
*different* answer. It is the one knowingly lossy knob here; F = 1 is exact.

Where experts come from is a store's business, and the arithmetic does not depend on
it (streamed == resident, bitwise):

- :class:`ResidentExperts`: every expert built at load, like any weight.
- :class:`StreamedExperts` (``--moe-stream``): dense weights stay resident; experts
  are read with ``pread`` into store-owned buffers (not the file mapping, so RSS is
  dense weights + cache and eviction is ours; their file pages are dropped from the
  page cache once read) and kept in a cache of ``--moe-cache-bytes``: a
  least-recently-used cache per layer, started with the experts earlier runs used most
  (the usage histogram), and, with ``--moe-pinned-share``, a pinned set of the hottest
  that is never evicted. A layer's misses are read together by a pool of I/O threads.
  (Hinting the kernel at each step's start about the experts the previous step used and
  the cache lacks, ``posix_fadvise(WILLNEED)``, was measured and dropped: under an 8 GiB
  cgroup the 30B-A3B shape decoded 5.2 tok/s with the hints and 5.6 without, the mean
  of 8 runs each (two alternating rounds of cold and warm runs on two prompts): their
  pages crowd a small page cache.) Every
  expert's CRC32 is
  recorded on its first read and checked on every later one, and a short read is an
  error: a changed, truncated or corrupt file fails the step with an error naming
  the expert, never a wrong answer.
- The pilot (``--moe-pilot``, with ``--moe-stream`` in the native stack; off by
  default, see ``PILOT``): twice per layer (after its attention, and after its experts)
  the next layer's router is applied to the stream, and the experts it picks are read
  by the pilot's own I/O thread while this layer and the next one's attention compute.
  A guess only decides what is read early, never what is computed; its recall (the
  share of the experts a layer needed that were guessed) is counted.

The usage histogram (tokens routed to each expert) and the checksums are saved
beside the model (``MODEL.gguf.experts.json``, written to a temporary file, fsynced
and renamed, so a crash leaves the old file or the new one).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from ember.errors import EmberError, UnsupportedModelError
from ember.models.gguf import GGUFFile, TensorInfo, file_identity
from ember.models.layers.mlp import GLU
from ember.models.linear import Linear, QuantLinear, linear_nbytes

log = logging.getLogger(__name__)

HISTOGRAM_SUFFIX = ".experts.json"
# The share of the cache budget pinned to the hottest experts of earlier runs (never
# evicted); the rest is each layer's LRU, started with its hottest experts. Measured on
# ember's trained MoE (its routing follows its text; `ember bench moe --model trained`),
# a second run's hit rate: pinning half the budget 88.9% / 69.8% at budgets of 50% / 25%
# of the experts (a cold LRU: 92.3% / 76.7%), pinning a quarter 90.7% / 74.7%, a warm
# LRU alone 93.6% / 77.2%: an LRU follows a text's locality, a pinned set cannot.
PINNED_SHARE = 0.0
IO_THREADS = 2
READ_AHEAD = IO_THREADS + 1  # misses read (and built) ahead of the one being computed
PILOT_READS = 16  # at most this many guessed experts read ahead per layer
# Why the pilot is off unless asked for: its guesses recall 88.9% of what a layer needs on
# ember's trained MoE, but reading them costs the same CPU as a miss (pread, CRC, packing)
# and every guess takes the GIL; on 2 cores that CPU is the decode's own. Measured with
# the Qwen3-30B-A3B shape under an 8 GiB cgroup (32 tokens from a cold cache, the Zen 4
# VM): 4.1-4.5 tok/s with the pilot, 5.3-6.0 without. Where cores are idle while a
# layer waits on the disk, it can pay.
PILOT = False
SAVE_EVERY = 256  # steps between histogram saves (and at close)

BuildExpert = Callable[[list[tuple[np.ndarray, int, tuple[int, ...]]], list[str]], Linear]


@dataclass(frozen=True)
class MoEOptions:
    """How a mixture-of-experts model keeps and routes its experts."""

    stream: bool = False  # page experts from the file instead of loading them all
    cache_bytes: int = 1024**3  # the streamed store's budget (LRU + any pinned share)
    pilot: bool = PILOT  # streamed: read the next layer's guessed experts ahead
    top_p: float = 1.0  # < 1: each token's experts up to this cumulative weight (lossy)
    pinned_share: float = PINNED_SHARE  # of cache_bytes, never evicted (see PINNED_SHARE)

    def __post_init__(self) -> None:
        if not 0 < self.top_p <= 1:
            raise ValueError(f"moe top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.pinned_share <= 1:
            raise ValueError(f"moe pinned_share must be in [0, 1], got {self.pinned_share}")


class ExpertReadError(EmberError):
    """An expert could not be read back intact from the model file."""


@dataclass(frozen=True)
class ExpertSlices:
    """Where one layer's experts lie in the file: three [E, out, in] tensors."""

    gate: TensorInfo
    up: TensorInfo
    down: TensorInfo

    @property
    def count(self) -> int:
        return self.gate.shape[0]

    def spans(self, e: int) -> list[tuple[TensorInfo, int, int]]:
        """(tensor, offset in its part's file, bytes) of expert ``e`` in gate, up and
        down."""
        if not 0 <= e < self.count:
            raise ValueError(f"no expert {e} in {self.gate.name} ({self.count} experts)")
        out = []
        for info in (self.gate, self.up, self.down):
            size = info.nbytes // info.shape[0]
            out.append((info, info.offset + e * size, size))
        return out

    @property
    def expert_bytes(self) -> int:
        return sum(size for _, _, size in self.spans(0))


@dataclass
class Expert:
    gate_up: Linear  # fused gate | up
    down: Linear
    nbytes: int  # resident bytes of its built weights


def build_expert(build: BuildExpert, slices: ExpertSlices, e: int,
                 raws: Sequence[np.ndarray]) -> Expert:
    """An expert's layers from its three raw slices (gate, up, down)."""
    (gate, up, down), (g_raw, u_raw, d_raw) = (slices.gate, slices.up, slices.down), raws
    names = [f"{t.name}[{e}]" for t in (gate, up, down)]
    gate_up = build([(g_raw, gate.ggml_type, tuple(gate.shape[1:])),
                     (u_raw, up.ggml_type, tuple(up.shape[1:]))], names[:2])
    down_l = build([(d_raw, down.ggml_type, tuple(down.shape[1:]))], names[2:])
    return Expert(gate_up, down_l, linear_nbytes(gate_up) + linear_nbytes(down_l))


@dataclass
class MoEStats:
    pinned_hits: int = 0
    lru_hits: int = 0
    misses: int = 0  # read from the file (by the pilot ahead of time, or when needed)
    bytes_read: int = 0
    read_seconds: float = 0.0
    tokens_routed: int = 0
    pilot_needed: int = 0  # experts needed by layers the pilot had guessed for
    pilot_guessed: int = 0  # of those, guessed
    pilot_reads: int = 0  # experts the pilot read ahead
    pilot_used: int = 0  # of those, needed when their layer came

    @property
    def hit_rate(self) -> float:
        looked_up = self.pinned_hits + self.lru_hits + self.misses
        return (self.pinned_hits + self.lru_hits) / looked_up if looked_up else 1.0

    @property
    def pilot_recall(self) -> float | None:
        """Share of the experts layers needed that the pilot had guessed (None: no guess)."""
        return self.pilot_guessed / self.pilot_needed if self.pilot_needed else None

    def as_dict(self) -> dict[str, float | None]:
        return {"pinned_hits": self.pinned_hits, "lru_hits": self.lru_hits,
                "misses": self.misses, "bytes_read": self.bytes_read,
                "read_seconds": round(self.read_seconds, 6), "hit_rate": self.hit_rate,
                "tokens_routed": self.tokens_routed, "pilot_recall": self.pilot_recall,
                "pilot_reads": self.pilot_reads, "pilot_used": self.pilot_used}


# The native kernels' handle on a layer's experts (ember/kernels/routed_experts.h's
# RoutedExperts), and how a QuantLinear becomes the PackedLinear of that build.
NativeExperts = Any
Wrap = Callable[[Linear], Any]


class ExpertStore(Protocol):
    stats: MoEStats
    layers: list[ExpertSlices]  # where each layer's experts lie in the file
    streamed: bool
    packed: bool  # every expert is packed for the native kernels (q4): attach works
    cached_bytes: int  # resident bytes of built experts

    def experts_for(self, layer: int, ids: list[int]) -> Iterator[tuple[int, Expert]]: ...

    def record(self, layer: int, counts: dict[int, int]) -> None: ...

    def expert_nbytes(self, layer: int) -> int:
        """Bytes one built expert of ``layer`` holds (and a step reads)."""
        ...

    def attach(self, layer: int, native: NativeExperts, wrap: Wrap) -> None:
        """Let a native stack's layer compute with this store's experts: fill its slots
        (resident), or fill what is cached and provide the rest on demand (streamed)."""
        ...

    def end_step(self, ok: bool = True) -> None:
        """After a step: the native layers' usage counts into the histogram and stats
        (``ok`` False: the step failed, its counts are dropped)."""
        ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class _Attached:
    """The native layers computing with a store's experts (several stacks may, e.g. two
    builds of the kernels in the tests), per model layer."""

    def __init__(self, n_layers: int) -> None:
        self.layers: list[list[tuple[NativeExperts, Wrap]]] = [[] for _ in range(n_layers)]

    def add(self, layer: int, native: NativeExperts, wrap: Wrap) -> None:
        self.layers[layer].append((native, wrap))

    def set(self, layer: int, e: int, expert: Expert) -> None:
        for native, wrap in self.layers[layer]:
            native.set_expert(e, wrap(expert.gate_up), wrap(expert.down))

    def drop(self, layer: int, e: int) -> None:
        for native, _ in self.layers[layer]:
            native.drop_expert(e)

    def drain(self, record: Callable[[int, dict[int, int]], None]) -> int:
        """Each layer's routed-token counts since the last drain, to ``record`` (in layer
        order); returns the expert lookups counted."""
        lookups = 0
        for layer, natives in enumerate(self.layers):
            counts: dict[int, int] = {}
            for native, _ in natives:
                usage = native.take_usage()
                for e in usage[0].nonzero().flatten().tolist():
                    counts[e] = counts.get(e, 0) + int(usage[0, e])
                lookups += int(usage[1].sum())
            if natives:
                record(layer, counts)
        return lookups

    def clear(self) -> None:
        for natives in self.layers:
            for native, _ in natives:
                native.set_provider(None)
                native.set_pilot(None)


class ResidentExperts:
    """Every expert built at load, from the file mapping."""

    streamed = False

    def __init__(self, gguf: GGUFFile, layers: Sequence[ExpertSlices], build: BuildExpert
                 ) -> None:
        _return_large_frees_to_the_os()  # building leaves large transient copies behind
        self.layers = list(layers)
        self.experts: list[list[Expert]] = []
        for slices in layers:
            built = []
            for e in range(slices.count):
                raws = [gguf.span(off, size, info.part) for info, off, size in slices.spans(e)]
                built.append(build_expert(build, slices, e, raws))
            self.experts.append(built)
            gguf.release_pages()
        self.stats = MoEStats()
        self.cached_bytes = sum(x.nbytes for layer in self.experts for x in layer)
        self.packed = all(isinstance(x.gate_up, QuantLinear) and isinstance(x.down, QuantLinear)
                          for layer in self.experts for x in layer)
        self._attached = _Attached(len(self.experts))

    def experts_for(self, layer: int, ids: list[int]) -> Iterator[tuple[int, Expert]]:
        self.stats.pinned_hits += len(ids)
        return ((e, self.experts[layer][e]) for e in ids)

    def record(self, layer: int, counts: dict[int, int]) -> None:
        self.stats.tokens_routed += sum(counts.values())

    def expert_nbytes(self, layer: int) -> int:
        return self.experts[layer][0].nbytes

    def attach(self, layer: int, native: NativeExperts, wrap: Wrap) -> None:
        self._attached.add(layer, native, wrap)
        for e, expert in enumerate(self.experts[layer]):
            self._attached.set(layer, e, expert)

    def end_step(self, ok: bool = True) -> None:
        lookups = self._attached.drain(self.record if ok else lambda layer, counts: None)
        if ok:
            self.stats.pinned_hits += lookups

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class _LayerCache:
    lru: OrderedDict[int, Expert] = field(default_factory=OrderedDict)
    nbytes: int = 0


class StreamedExperts:
    """Experts paged from the file through pinned → per-layer LRU → ``pread``."""

    streamed = True

    def __init__(self, parts: Sequence[tuple[Path, tuple[int, ...] | None]],
                 layers: Sequence[ExpertSlices], build: BuildExpert, cache_bytes: int,
                 packed: bool = False, pilot: bool = PILOT,
                 pinned_share: float = PINNED_SHARE) -> None:
        """``parts``: the model's files (a split model's in part order; GGUFFile.parts),
        each with the identity it was parsed with (:func:`~ember.models.gguf.
        file_identity`; None: not checked): the slices' offsets are those files', so
        reading another is refused. ``packed``: ``build`` makes packed experts (q4), so
        native stacks may ``attach``; ``pilot``: read the experts a native stack guesses
        for the next layer ahead; ``pinned_share``: of ``cache_bytes``, for the hottest
        experts of earlier runs, never evicted."""
        self.path, self.layers, self.build = Path(parts[0][0]), list(layers), build
        self.cache_bytes, self.packed, self.pilot = cache_bytes, packed, pilot
        self.pinned_share = pinned_share
        self.stats = MoEStats()
        self._paths: list[Path] = []
        self._fds: list[int] = []
        self._identities: list[tuple[int, ...]] = []
        try:
            self._start(parts)
        except BaseException:
            self._shut_down()  # no file descriptor or thread outlives a failed start
            raise

    def _start(self, parts: Sequence[tuple[Path, tuple[int, ...] | None]]) -> None:
        """Open the files, start the threads, read the sidecar and warm the cache."""
        for path, identity in parts:
            fd = os.open(path, os.O_RDONLY)
            self._fds.append(fd)
            self._paths.append(Path(path))
            self._identities.append(file_identity(os.fstat(fd)))
            if identity is not None and tuple(identity) != self._identities[-1]:
                raise ExpertReadError(f"{path} was replaced or changed after it was parsed")
        # the sidecar's record of which files it counts: one file as before, or every part
        self._file_key = (list(self._identities[0]) if len(parts) == 1
                          else [list(i) for i in self._identities])
        self._io = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="ember-moe-io")
        self._buffers = threading.local()  # each I/O thread's read buffers, reused
        _return_large_frees_to_the_os()
        # the pilot's reads have a thread of their own: a wrong guess never delays a miss
        self._pilot_io = ThreadPoolExecutor(1, thread_name_prefix="ember-moe-pilot")
        self._lock = threading.Lock()
        self._sidecar = Path(str(self.path) + HISTOGRAM_SUFFIX)
        self.histogram, self._crc = self._load_sidecar()
        self._steps = 0
        self.pinned: dict[tuple[int, int], Expert] = {}
        self._caches = [_LayerCache() for _ in self.layers]
        # the native stacks' side (attach): reads in flight (by the pilot?), the pilot's
        # guesses by layer, experts in slots only for the chunk being computed
        self._attached = _Attached(len(self.layers))
        self._reads: dict[tuple[int, int], tuple[Future[Expert], bool]] = {}
        self._guesses: dict[int, set[int]] = {}
        self._transient: list[tuple[int, int]] = []
        try:  # what earlier runs used, read now: a bad read here only leaves the cache cold
            self._pin_hottest()
            self._layer_budget = max(0, self.cache_bytes - sum(
                x.nbytes for x in self.pinned.values())) // max(1, len(self.layers))
            self._warm_caches()
        except ExpertReadError as e:
            log.warning("%s: not warming the expert cache from its history: %s",
                        self.path.name, e)
            self.pinned.clear()
            self._caches = [_LayerCache() for _ in self.layers]
            self._layer_budget = self.cache_bytes // max(1, len(self.layers))
        self.stats = MoEStats()  # warming is not serving: count from here

    # ------------------------------------------------------------ sidecar file
    def _load_sidecar(self) -> tuple[list[list[int]], dict[tuple[int, int], int]]:
        empty = [[0] * s.count for s in self.layers]
        try:
            data = json.loads(self._sidecar.read_text())
        except (OSError, ValueError):
            return empty, {}
        if not isinstance(data, dict) or not isinstance(data.get("histogram"), list):
            return empty, {}
        if data.get("file") != self._file_key or [
                len(h) if isinstance(h, list) else -1 for h in data["histogram"]
        ] != [s.count for s in self.layers]:
            log.info("%s: for another version of the model; starting afresh", self._sidecar)
            return empty, {}
        try:
            crc = {(int(k.split(":")[0]), int(k.split(":")[1])): int(v)
                   for k, v in data.get("crc32", {}).items()}
            return [list(map(int, h)) for h in data["histogram"]], crc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            log.info("%s: malformed; starting afresh", self._sidecar)
            return empty, {}

    def save(self) -> None:
        """Write the histogram and checksums: temp file, fsync, rename."""
        with self._lock:
            data = {"file": self._file_key, "histogram": self.histogram,
                    "crc32": {f"{layer}:{e}": v for (layer, e), v in self._crc.items()}}
        tmp = None
        try:  # a unique temp name: two processes sharing the model never write one file
            fd, tmp = tempfile.mkstemp(dir=self._sidecar.parent,
                                       prefix=self._sidecar.name + ".", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._sidecar)
        except OSError as e:
            log.warning("could not save the expert histogram to %s: %s", self._sidecar, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def _pin_hottest(self) -> None:
        """Fill the pinned share of the budget with the most used experts so far."""
        ranked = sorted(((count, layer, e) for layer, h in enumerate(self.histogram)
                         for e, count in enumerate(h) if count), reverse=True)
        budget, used, size = self.pinned_share * self.cache_bytes, 0, {}
        for _, layer, e in ranked:
            if used >= budget:
                break
            if used + size.get(layer, 0) > budget:  # experts of a layer are one size
                continue
            expert = self._read(layer, e)
            size[layer] = expert.nbytes
            if used + expert.nbytes <= budget:
                self.pinned[(layer, e)] = expert
                used += expert.nbytes

    def _warm_caches(self) -> None:
        """Start each layer's LRU with its most used experts so far (after the pinned
        ones) up to its share: a restart begins where the last runs' routing was, and the
        LRU still follows what this run routes to. Every layer's reads go to the I/O
        threads at once (how many fit is estimated from the file bytes, which packing
        grows by at most 63 per 16 rows)."""
        reads = []
        for layer, h in enumerate(self.histogram):
            hottest = sorted((e for e, count in enumerate(h)
                              if count and (layer, e) not in self.pinned),
                             key=lambda e: h[e], reverse=True)
            fit = self._layer_budget // max(1, self.layers[layer].expert_bytes)
            reads.append([(e, self._io.submit(self._read, layer, e)) for e in hottest[:fit]])
        for layer, built in enumerate(reads):
            cache, kept = self._caches[layer], []
            for e, future in built:
                expert = future.result()
                if cache.nbytes + expert.nbytes <= self._layer_budget:
                    kept.append((e, expert))
                    cache.nbytes += expert.nbytes
            cache.lru = OrderedDict(reversed(kept))  # the hottest evicted last

    # ------------------------------------------------------------ reading
    def _read(self, layer: int, e: int) -> Expert:
        slices = self.layers[layer]
        self._check_unchanged(layer, e)
        start = time.perf_counter()
        raws, crc = [], 0
        for i, (info, offset, size) in enumerate(slices.spans(e)):
            buf = self._buffer(i, size)  # store-owned and reused: the built expert copies
            got = os.preadv(self._fds[info.part], [memoryview(buf)], offset)
            if got != size:
                raise ExpertReadError(f"{self._paths[info.part]}: short read of expert {e} "
                                      f"of layer {layer} ({info.name}: {got} of {size} bytes)")
            crc = zlib.crc32(buf, crc)
            raws.append(buf)
        self._check_unchanged(layer, e)  # not written to while we read it
        self._forget(slices.spans(e))
        with self._lock:
            known = self._crc.setdefault((layer, e), crc)
            self.stats.bytes_read += sum(r.nbytes for r in raws)
            self.stats.read_seconds += time.perf_counter() - start
        if known != crc:
            part = self._paths[slices.gate.part]
            raise ExpertReadError(f"{part}: expert {e} of layer {layer} reads back with "
                                  f"CRC32 {crc:08x}, recorded {known:08x}: the file is corrupt "
                                  "or was replaced")
        return build_expert(self.build, slices, e, raws)

    def _forget(self, spans: list[tuple[TensorInfo, int, int]]) -> None:
        """Drop an expert's file pages from the page cache once its bytes are ours: what
        stays in memory is the store's to choose, and under a memory limit those pages
        would crowd the cache (measured in alternating runs, the 30B-A3B shape in an
        8 GiB cgroup decoded 5.5-5.9 tok/s from a cold cache keeping them and 6.7-6.8
        dropping them, and the cgroup's peak fell from the limit to 5.8 GB)."""
        if not hasattr(os, "posix_fadvise"):
            return
        for info, offset, size in spans:
            try:  # advice: a failure costs nothing but the advice
                os.posix_fadvise(self._fds[info.part], offset, size, os.POSIX_FADV_DONTNEED)
            except OSError:
                return

    def _check_unchanged(self, layer: int, e: int) -> None:
        """The files the expert lies in are still the ones loaded: same device, inode,
        size and mtime. (GGUF has no checksums: an expert's first read can only be
        trusted this way; later reads are also checked against the CRC32 of the first.)"""
        for part in {info.part for info, _, _ in self.layers[layer].spans(e)}:
            if file_identity(os.fstat(self._fds[part])) != self._identities[part]:
                raise ExpertReadError(f"{self._paths[part]}: the file changed since it was "
                                      f"loaded (reading expert {e} of layer {layer})")

    def _buffer(self, i: int, size: int) -> np.ndarray:
        """This thread's ``i``-th read buffer, at least ``size`` bytes (a view of it)."""
        buffers = getattr(self._buffers, "arrays", None)
        if buffers is None:
            buffers = self._buffers.arrays = {}
        if i not in buffers or buffers[i].nbytes < size:
            buffers[i] = np.empty(size, np.uint8)
        return buffers[i][:size]

    def experts_for(self, layer: int, ids: list[int]) -> Iterator[tuple[int, Expert]]:
        """``(id, expert)`` in the order of ``ids``. Misses are read ahead by the I/O
        threads, at most ``READ_AHEAD`` at a time: an expert that does not fit the cache
        lives only while the caller computes with it, so a prefill that routes to every
        expert of a layer never holds the whole layer (memory stays budget + window)."""
        cache = self._caches[layer]
        hits, missing = {}, []
        for e in ids:
            if (layer, e) in self.pinned:
                hits[e] = self.pinned[(layer, e)]
                self.stats.pinned_hits += 1
            elif e in cache.lru:
                cache.lru.move_to_end(e)
                hits[e] = cache.lru[e]
                self.stats.lru_hits += 1
            else:
                missing.append(e)
        self.stats.misses += len(missing)
        pending: dict[int, Future[Expert]] = {}
        queued = iter(missing)

        def read_ahead() -> None:
            while len(pending) < READ_AHEAD:
                e = next(queued, None)
                if e is None:
                    return
                pending[e] = self._io.submit(self._read, layer, e)

        read_ahead()
        keep = set(ids)
        for e in ids:
            if e in hits:
                yield e, hits.pop(e)
                continue
            expert = pending.pop(e).result()
            read_ahead()
            self._admit(layer, e, expert, keep)
            yield e, expert

    def _admit(self, layer: int, e: int, expert: Expert, keep: set[int]) -> bool:
        """Cache ``expert`` if the layer's share allows, evicting least recently used
        experts this step does not need (and emptying their native slots); else it
        serves this step only (False)."""
        cache = self._caches[layer]
        while cache.nbytes + expert.nbytes > self._layer_budget:
            victim = next((v for v in cache.lru if v not in keep), None)
            if victim is None:
                return False
            cache.nbytes -= cache.lru.pop(victim).nbytes
            self._attached.drop(layer, victim)
        cache.lru[e] = expert
        cache.nbytes += expert.nbytes
        self._attached.set(layer, e, expert)
        return True

    def expert_nbytes(self, layer: int) -> int:
        """A built expert's bytes where one of the layer is built, else its file bytes
        (what a packed expert holds, to 63 bytes per 16 rows)."""
        built = next(iter(self._caches[layer].lru.values()), None) or next(
            (x for (at, _), x in self.pinned.items() if at == layer), None)
        return built.nbytes if built is not None else self.layers[layer].expert_bytes

    # ------------------------------------------------------------ native stacks
    def attach(self, layer: int, native: NativeExperts, wrap: Wrap) -> None:
        self._attached.add(layer, native, wrap)
        held = [(e, x) for (at, e), x in self.pinned.items() if at == layer]
        for e, expert in [*held, *self._caches[layer].lru.items()]:
            native.set_expert(e, wrap(expert.gate_up), wrap(expert.down))
        native.set_provider(lambda needed, layer=layer: self._provide(layer, needed))
        if self.pilot:
            native.set_pilot(lambda ids, layer=layer: self._guess(layer, ids))

    def _provide(self, layer: int, needed: list[int]) -> int:
        """A native layer needs experts ``needed`` (ascending): put a prefix of them in
        its slots and say how many. Cached ones cost nothing; misses are read by the I/O
        threads, ``READ_AHEAD`` at a time (or were read by the pilot); those the layer's
        cache cannot keep fill the slots only until the next call, at most ``READ_AHEAD``
        of them at once, so a prefill routing to every expert never holds the whole
        layer."""
        self._drop_transient()
        self._score_guess(layer, needed)  # once per guess: the first chunk takes it
        cache, keep = self._caches[layer], set(needed)
        misses = [e for e in needed if (layer, e) not in self.pinned and e not in cache.lru]
        for e in misses[:READ_AHEAD]:
            self._read_async(layer, e)
        ahead, done, held = READ_AHEAD, 0, 0
        for e in needed:
            done += 1
            if (layer, e) in self.pinned:
                self.stats.pinned_hits += 1
                continue
            if e in cache.lru:
                cache.lru.move_to_end(e)
                self.stats.lru_hits += 1
                continue
            self.stats.misses += 1
            future, by_pilot = self._reads.pop((layer, e))
            self.stats.pilot_used += by_pilot
            expert = future.result()
            if ahead < len(misses):
                self._read_async(layer, misses[ahead])
                ahead += 1
            if not self._admit(layer, e, expert, keep):
                self._attached.set(layer, e, expert)
                self._transient.append((layer, e))
                held += 1
                if held >= READ_AHEAD:
                    break
        return done

    def _read_async(self, layer: int, e: int) -> None:
        if (layer, e) not in self._reads:
            self._reads[(layer, e)] = (self._io.submit(self._read, layer, e), False)

    def _guess(self, layer: int, ids: list[int]) -> None:
        """A guess of the pilot for ``layer`` (most likely first; a layer gets several,
        counted together): read what is not cached or being read, at most as many as the
        layer's cache could keep (``READ_AHEAD`` where it keeps fewer, ``PILOT_READS`` at
        most), so what the pilot holds stays a window beside the budget."""
        self._guesses.setdefault(layer, set()).update(ids[:PILOT_READS])
        cache = self._caches[layer]
        room = min(PILOT_READS, max(READ_AHEAD, self._layer_budget
                                    // max(1, self.layers[layer].expert_bytes)))
        held = sum(1 for (at, _), (_, by_pilot) in self._reads.items()
                   if at == layer and by_pilot)
        for e in ids[:PILOT_READS]:
            if held >= room:
                return
            if (layer, e) in self.pinned or e in cache.lru or (layer, e) in self._reads:
                continue
            self._reads[(layer, e)] = (self._pilot_io.submit(self._read, layer, e), True)
            self.stats.pilot_reads += 1
            held += 1

    def _score_guess(self, layer: int, needed: list[int]) -> None:
        """Count the guesses for ``layer`` against what it needs; drop wrong guesses'
        reads."""
        guess = self._guesses.pop(layer, None)
        if guess is None:
            return
        want = set(needed)
        self.stats.pilot_needed += len(want)
        self.stats.pilot_guessed += len(want & guess)
        for e in guess - want:
            read = self._reads.pop((layer, e), None)
            if read is not None:
                read[0].cancel()

    def _drop_transient(self) -> None:
        for layer, e in self._transient:
            if e not in self._caches[layer].lru:
                self._attached.drop(layer, e)
        self._transient.clear()

    def end_step(self, ok: bool = True) -> None:
        if ok:
            self._attached.drain(self.record)
        else:  # a failed step's routing is not history
            self._attached.drain(lambda layer, counts: None)
        self._drop_transient()
        for future, _ in self._reads.values():  # guesses for layers never reached
            future.cancel()
        self._reads.clear()
        self._guesses.clear()

    def record(self, layer: int, counts: dict[int, int]) -> None:
        with self._lock:
            h = self.histogram[layer]
            for e, n in counts.items():
                h[e] += n
        self.stats.tokens_routed += sum(counts.values())
        if layer == len(self.layers) - 1:
            self._steps += 1
            if self._steps % SAVE_EVERY == 0:
                self.save()

    @property
    def cached_bytes(self) -> int:
        return (sum(x.nbytes for x in self.pinned.values())
                + sum(c.nbytes for c in self._caches))

    def flush(self) -> None:
        """Save the histogram now (the store stays usable)."""
        self.save()

    def close(self) -> None:
        """Save, stop the threads, close the file (the store is unusable after)."""
        if not self._fds:
            return
        self._attached.clear()  # the providers and pilots hold this store
        self.save()
        self._shut_down()

    def _shut_down(self) -> None:
        """Stop whatever threads were started, then close every file opened (after the
        threads: an fd number must not be reused under a read in flight)."""
        for name in ("_io", "_pilot_io"):
            pool = getattr(self, name, None)
            if pool is not None:
                pool.shutdown(wait=True)
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _return_large_frees_to_the_os() -> None:
    """Keep glibc's mmap threshold fixed (at its 128 KiB default).

    Experts are built and dropped all the time; glibc raises the threshold to the size
    of any large block freed, after which such blocks come from its heaps and stay
    in the process when freed. Measured: a streamed run's peak RSS stayed ~500 MB above
    dense weights + cache without this. Only glibc has ``mallopt``; elsewhere a no-op.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD: setting it disables the dynamic one
    except (OSError, AttributeError):
        pass


@dataclass
class ExpertBiases:
    """One layer's router and expert biases (gpt-oss), float32: router [E], gate|up
    [E, 2 ffn] (each expert's gate then up, as its fused gate_up), down [E, hidden]."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class SharedExpert:
    """An expert every token goes through beside the routed ones (Qwen 3.5 MoE), its
    output scaled per token by sigmoid(gate · h)."""

    gate_up: Linear
    down: Linear
    gate: torch.Tensor  # [hidden]


class MoEFeedForward:
    """One layer's router and experts: tokens grouped by expert, weighted sum (plus a
    shared expert's gated output, where the family has one)."""

    def __init__(self, router: torch.Tensor, store: ExpertStore, layer: int, top_k: int,
                 glu: GLU, biases: ExpertBiases | None = None,
                 shared: SharedExpert | None = None, top_p: float = 1.0) -> None:
        self.router = router  # [E, hidden] float32: routing stays exact in every format
        self.store, self.layer, self.top_k, self.glu = store, layer, top_k, glu
        self.biases, self.shared, self.top_p = biases, shared, top_p

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] (by weight, descending; -1: cut by top_p) and
        their weights [T, k] (summing to one)."""
        b = self.biases
        probs = torch.softmax(F.linear(h, self.router, None if b is None else b.router), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.top_p < 1:  # lossy: each token's experts up to cumulative weight top_p
            keep = weights.cumsum(dim=-1) - weights < self.top_p
            weights = weights * keep
            weights = weights / weights.sum(dim=-1, keepdim=True)
            chosen = chosen.masked_fill(~keep, -1)
        return chosen, weights

    @property
    def native_ready(self) -> bool:
        """Whether the native stack can run this layer (:func:`native_experts`): every
        expert packed, and the shared expert too where there is one."""
        s = self.shared
        return self.store.packed and (s is None or (
            isinstance(s.gate_up, QuantLinear) and isinstance(s.down, QuantLinear)))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        b = self.biases
        chosen, weights = self.route(h)
        used, counts = chosen.unique(return_counts=True)
        counts = counts[used >= 0]
        ids = used[used >= 0].tolist()
        self.store.record(self.layer, dict(zip(ids, counts.tolist(), strict=True)))
        out = torch.zeros_like(h)
        # ascending expert id (unique() sorts): a token's sum has a fixed order
        for e, expert in self.store.experts_for(self.layer, ids):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            gate_up = expert.gate_up(h[rows])
            if b is not None:
                gate_up = gate_up + b.gate_up[e]
            y = expert.down(self.glu(*gate_up.chunk(2, dim=-1)))
            if b is not None:
                y = y + b.down[e]
            out.index_add_(0, rows, y * weights[rows, slot, None])
        if self.shared is not None:
            s = self.shared
            y = s.down(self.glu(*s.gate_up(h).chunk(2, dim=-1)))
            out = out + torch.sigmoid(h @ s.gate)[:, None] * y
        return out


def native_experts(ext: Any, moe: MoEFeedForward, ffn: int, activation: str
                   ) -> NativeExperts:
    """``moe`` (``native_ready``) as the native stack's routed-experts layer of build
    ``ext``, computing with its store's experts."""
    def wrap(linear: Linear) -> Any:
        return ext.PackedLinear(linear.in_features, linear.packed.segments)  # shares bytes

    if not moe.native_ready:
        raise ValueError(f"layer {moe.layer}'s experts are not all packed for the kernels")
    shared = moe.shared
    native = ext.RoutedExperts(moe.router.contiguous(), moe.top_k, ffn, activation)
    if moe.biases is not None:
        b = moe.biases
        native.set_biases(b.router.contiguous(), b.gate_up.contiguous(), b.down.contiguous())
    if shared is not None:  # Qwen 3.5 MoE's; its recurrent layers keep it off the stack
        native.set_shared(wrap(shared.gate_up), wrap(shared.down), shared.gate.contiguous())
    if moe.top_p < 1:
        native.set_top_p(moe.top_p)
    moe.store.attach(moe.layer, native, wrap)
    return native


def expert_slices(gguf: GGUFFile, layer: int, n_experts: int | None = None,
                  hidden: int | None = None, ffn: int | None = None) -> ExpertSlices:
    """Layer ``layer``'s expert stacks, checked to be ``[E, ffn, hidden]`` (gate, up) and
    ``[E, hidden, ffn]`` (down) for the configuration's sizes where given, and to agree
    with the router (``ffn_gate_inp``: E rows): a stack of another shape would have an
    expert's bytes read from the wrong place."""
    p = f"blk.{layer}."
    gate, up, down = (gguf.tensor(p + f"ffn_{x}_exps.weight") for x in ("gate", "up", "down"))
    router = gguf.tensors.get(p + "ffn_gate_inp.weight")
    e = n_experts if n_experts is not None else gate.shape[0]
    h = hidden if hidden is not None else gate.shape[-1]
    f = ffn if ffn is not None else gate.shape[1]
    for info, want in ((gate, (e, f, h)), (up, (e, f, h)), (down, (e, h, f)),
                       (router, (e, h))):
        if info is not None and tuple(info.shape) != want:
            raise UnsupportedModelError(
                f"{gguf.path.name}: {info.name} is {list(info.shape)}; the layer's "
                f"{e} experts of {f} over {h} need {list(want)}")
    return ExpertSlices(gate, up, down)
