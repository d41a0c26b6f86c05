"""llama.cpp's own benchmark binaries as the anchor of ``ember bench compare``.

``--llama-bench PATH`` (the ``llama-bench`` binary, or the directory holding it and
``llama-batched-bench``) makes llama.cpp's native tools one side of the comparison,
fed the same sizes as the others and run once per repetition, in turn with them:

- ``llama-bench -m FILE -t T -p P1,P2 -n N-1 -r 1 -o json``: ``pp<P>`` is a P-token
  prompt decoded as one batch on an empty cache, ``tg<N-1>`` is N-1 single-token
  decodes from an empty cache; each test gets its own context of P (or N-1) tokens
  (llama.cpp rounds it up to 256), and llama-bench runs each test once untimed
  first. Mapped to ``prefill_P`` and ``decode_1``: ember's single-stream decode
  counts the N-1 steps after its first token (which came from prefill), so both
  time the same number of steps (ember's start 32 positions further in).
- ``llama-batched-bench -m FILE -t T -c C -npp P -ntg G-1 -npl S1,S2
  --output-format jsonl``: S streams of P random tokens prefilled, then G-1 steps
  of one S-token batch; ``speed_tg`` (its S_TG column) = S*(G-1) / the time of those
  steps, mapped to ``decode_S`` (ember times the same G-1 steps after every stream
  has its first token). It silently skips a stream count whose S*(P+G-1) tokens do
  not fit its context, so C is S_max*(P+G-1) and a missing row is an error here.
  Its context is split into S_max sequences of ``pad256(C/S_max)`` cells each
  (``llama_ctx``): that is the KV size ember's pool is given, so both hold the same
  number of token slots.

Neither binary samples (they feed random token ids), and batch/ubatch are their
defaults (2048/512) unless a prompt is longer than a ubatch, in which case both
are raised to it so the prompt is one batch, as it is for ember.

Peak RSS: ``/proc/PID/status`` ``VmHWM`` (the kernel's high-water mark of the
process's resident set) is read every 10 ms while the binary runs; it only
rises, so the last value read is the peak except for growth in the final 10 ms
before exit (a binary frees, not allocates, at its end). ``wait4``'s
``ru_maxrss`` is recorded beside it but is not the figure: Linux carries the
launcher's high-water mark into the child across fork/vfork + exec, so it reads
max(launcher's peak, child's peak), and this launcher held a 1 GiB tensor to
measure bandwidth.

Standard library only; nothing here imports ember.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = "llama-bench"
BATCHED = "llama-batched-bench"
POLL_S = 0.01
UBATCH_DEFAULT = 512
BATCH_DEFAULT = 2048


class NativeError(RuntimeError):
    """A llama.cpp binary is missing, failed, or printed something other than expected."""


# ---------------------------------------------------------------- processes
def vm_hwm_bytes(pid: int | str = "self") -> int | None:
    """``VmHWM`` of ``pid`` in bytes; None once it has exited (or where /proc lacks it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class ProcessRun:
    """One finished child process: exit status, output, and what it used."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    cpu_s: float
    peak_rss_bytes: int | None  # VmHWM polled while it ran
    ru_maxrss_bytes: int  # wait4's: max(launcher's peak at spawn, the child's)
    launcher_hwm_bytes: int | None  # this process's VmHWM at spawn

    def record(self) -> dict:
        return {"command": shlex.join(self.argv), "returncode": self.returncode,
                "wall_s": self.wall_s, "cpu_s": self.cpu_s,
                "peak_rss_bytes": self.peak_rss_bytes, "ru_maxrss_bytes": self.ru_maxrss_bytes,
                "launcher_hwm_bytes": self.launcher_hwm_bytes}


def run_with_peak_rss(argv: list[str], env: dict[str, str] | None = None,
                      timeout: float = 1800, poll_s: float = POLL_S,
                      preexec_fn: Callable[[], None] | None = None) -> ProcessRun:
    """Run ``argv`` to completion, polling its VmHWM every ``poll_s`` (module docstring).

    One thread does both the polling and the reaping (``wait4`` with WNOHANG), so the
    child cannot be reaped between a poll and the next check. stdout and stderr go to
    temporary files (no pipe can fill up and stall the child).
    """
    launcher = vm_hwm_bytes()
    with tempfile.TemporaryFile("w+b") as out, tempfile.TemporaryFile("w+b") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env=env, preexec_fn=preexec_fn)
        peak: int | None = None
        deadline = start + timeout
        pid = 0
        try:
            while True:
                hwm = vm_hwm_bytes(proc.pid)
                if hwm is not None:
                    peak = hwm if peak is None else max(peak, hwm)
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.perf_counter() > deadline:
                    raise NativeError(f"{shlex.join(argv)} ran past {timeout:.0f} s; killed")
                time.sleep(poll_s)
        finally:
            if not pid:  # timed out or interrupted: the child does not outlive us
                proc.kill()
                _, status, _ = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        return ProcessRun(argv, proc.returncode, out.read().decode(errors="replace"),
                          err.read().decode(errors="replace"), wall,
                          usage.ru_utime + usage.ru_stime, peak, usage.ru_maxrss * 1024,
                          launcher)


# ---------------------------------------------------------------- binaries
@dataclass
class Binaries:
    """Where llama-bench and llama-batched-bench are, and the environment to run them."""

    bench: Path
    batched: Path | None  # None: not found beside llama-bench (no decode_S figures)
    env: dict[str, str] = field(repr=False, default_factory=dict)
    version: str = ""
    ik: bool = False  # ik_llama.cpp's fork: its own flags (-rtr, -fa 0|1), tables not JSONL


def binary_env(binary: Path) -> dict[str, str]:
    """The environment to run a llama.cpp ``binary`` in: a shared-library build's
    libraries (beside it) first on LD_LIBRARY_PATH."""
    env = dict(os.environ)
    if any(binary.parent.glob("libllama*.so*")):
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            x for x in (str(binary.parent.resolve()), env.get("LD_LIBRARY_PATH", "")) if x)
    return env


def locate(path: str) -> Binaries:
    """``path``: llama-bench itself, the directory holding it, or a name on PATH.

    Shared libraries next to the binaries are found by putting their directory first
    on LD_LIBRARY_PATH. Raises NativeError naming what is missing.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        bench = p / BENCH
    elif p.exists():
        bench = p
    else:
        found = shutil.which(path)
        if not found:
            raise NativeError(f"no llama-bench at {path} (a binary, its directory, or a "
                              "name on PATH)")
        bench = Path(found)
    if not (bench.is_file() and os.access(bench, os.X_OK)):
        raise NativeError(f"{bench} is not an executable llama-bench")
    batched = bench.with_name(BATCHED)
    if not (batched.is_file() and os.access(batched, os.X_OK)):
        batched = None
    env = binary_env(bench)
    bins = Binaries(bench.resolve(), batched.resolve() if batched else None, env)
    text, rc = _ask(bins, "--version")
    if rc != 0:
        # ik_llama.cpp's llama-bench has no --version; its --help names its own flags
        help_text, help_rc = _ask(bins, "--help")
        if help_rc != 0 or "--run-time-repack" not in help_text:
            raise NativeError(f"{bins.bench} --version exited with {rc}: "
                              f"{' | '.join(text.splitlines()[-3:])}")
        bins.ik, text = True, "ik_llama.cpp (its build commit: in the runs' meta)"
    bins.version = text.splitlines()[0] if text else "?"
    return bins


def _ask(bins: Binaries, flag: str) -> tuple[str, int]:
    try:
        proc = subprocess.run([str(bins.bench), flag], capture_output=True, text=True,
                              timeout=60, env=bins.env, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeError(f"{bins.bench} {flag} failed: {e}") from None
    return (proc.stdout + proc.stderr).strip(), proc.returncode


# ---------------------------------------------------------------- command lines
def pad256(n: int) -> int:
    return -(-n // 256) * 256


def llama_ctx(requested: int, n_seq: int = 1) -> int:
    """The KV cells llama.cpp allocates for ``-c requested`` with ``n_seq`` sequences
    (non-unified KV, the batched-bench default): n_ctx rounded up to 256, split into
    n_seq per-sequence parts each rounded up to 256 (llama_context's constructor)."""
    return pad256(pad256(requested) // n_seq) * n_seq


@dataclass(frozen=True)
class Sizes:
    """What one repetition asks for, read off a ``run`` spec (ember's token ids)."""

    prefill: tuple[int, ...]
    decode_steps: int  # single-token decode steps after the first token (0: none)
    streams: tuple[int, ...]
    stream_prompt: int
    stream_steps: int  # S-token steps after every stream's first token

    @classmethod
    def of(cls, spec: dict) -> Sizes:
        batched = spec.get("batched", [])
        shapes = {(len(b["prompts"][0]), int(b["gen"])) for b in batched}
        if any(len({len(p) for p in b["prompts"]}) != 1 for b in batched) or len(shapes) > 1:
            raise NativeError("llama-batched-bench runs one prompt length and one generation "
                              f"length for all stream counts; got {sorted(shapes)}")
        prompt, gen = shapes.pop() if shapes else (0, 1)
        d = spec.get("decode") or {}
        return cls(tuple(len(p) for p in spec.get("prefill", [])),
                   max(0, int(d.get("n", 1)) - 1),
                   tuple(len(b["prompts"]) for b in batched), prompt, gen - 1)

    def batched_ctx(self) -> int:
        """``-c`` for llama-batched-bench: the largest stream count's S*(P+G-1), rounded
        up to 256 as llama.cpp rounds it anyway (its batch is capped at the ``-c`` given,
        and its 16-token warm-up aborts in a batch smaller than that)."""
        return pad256(max(self.streams) * (self.stream_prompt + self.stream_steps))

    def contexts(self) -> dict[str, int]:
        """KV cells llama.cpp allocates per test (llama-bench: one context per test)."""
        out = {f"pp{p}": llama_ctx(p) for p in self.prefill}
        if self.decode_steps:
            out[f"tg{self.decode_steps}"] = llama_ctx(self.decode_steps)
        if self.streams:
            out[BATCHED] = llama_ctx(self.batched_ctx(), max(self.streams))
        return out


def bench_argv(bins: Binaries, model: str, threads: int, sizes: Sizes, flash_attn: str = "auto",
               repack: bool = True) -> list[str] | None:
    """llama-bench's command line for ``sizes``; None when it has nothing to time."""
    if not sizes.prefill and not sizes.decode_steps:
        return None
    argv = [str(bins.bench), "-m", model, "-t", str(threads),
            "-p", ",".join(map(str, sizes.prefill or [0])), "-n", str(sizes.decode_steps),
            "-r", "1", "-o", "json", "-fa", _ik_flash_attn(flash_attn) if bins.ik else flash_attn]
    longest = max(sizes.prefill, default=0)
    if longest > UBATCH_DEFAULT:
        argv += ["-ub", str(longest), "-b", str(max(longest, BATCH_DEFAULT))]
    if bins.ik:  # ik repacks only when asked (-rtr); mainline by default (--repack)
        argv += ["-rtr", "1" if repack else "0"]
    elif not repack:
        argv += ["--repack", "0"]
    return argv


def _ik_flash_attn(value: str) -> str:
    """ik_llama.cpp's llama-bench takes -fa 0|1 (on by default, as mainline's auto is on CPU)."""
    return "0" if value == "off" else "1"


def batched_argv(bins: Binaries, model: str, threads: int, sizes: Sizes,
                 flash_attn: str = "auto", repack: bool = True) -> list[str] | None:
    """llama-batched-bench's command line for ``sizes``; None without streams or binary."""
    if not sizes.streams or bins.batched is None:
        return None
    argv = [str(bins.batched), "-m", model, "-t", str(threads), "-c", str(sizes.batched_ctx()),
            "-npp", str(sizes.stream_prompt), "-ntg", str(sizes.stream_steps),
            "-npl", ",".join(map(str, sizes.streams)), "--output-format", "jsonl",
            "-fa", flash_attn]
    if bins.ik:
        argv += ["-rtr"] if repack else []
    elif not repack:
        argv.append("--no-repack")
    return argv


# ---------------------------------------------------------------- output
def parse_bench_json(text: str) -> dict:
    """llama-bench ``-o json`` → ``{"prefill": [{tokens, seconds}], "decode": {...}}``
    in the run-reply format of the compare workers, plus ``"meta"`` (its build and
    settings). ``seconds`` is the mean over its repetitions (``avg_ns``)."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as e:
        raise NativeError(f"llama-bench printed no JSON ({e}): {text[:200]!r}") from None
    if not isinstance(tests, list):
        raise NativeError(f"llama-bench JSON is not a list of tests: {text[:200]!r}")
    out: dict[str, Any] = {"prefill": []}
    for t in tests:
        if t.get("n_depth", 0):
            raise NativeError(f"llama-bench test at depth {t['n_depth']}: not one this runs")
        seconds = t["avg_ns"] / 1e9
        if t["n_prompt"] and not t["n_gen"]:
            out["prefill"].append({"tokens": t["n_prompt"], "seconds": seconds})
        elif t["n_gen"] and not t["n_prompt"]:
            out["decode"] = {"tokens": t["n_gen"], "seconds": seconds}
        else:
            raise NativeError(f"llama-bench test pp{t['n_prompt']}+tg{t['n_gen']}: a combined "
                              "test, not one this runs")
    if tests:
        t = tests[0]
        out["meta"] = {k: t.get(k) for k in (
            "build_commit", "build_number", "cpu_info", "backends", "model_type", "model_size",
            "n_batch", "n_ubatch", "n_threads", "type_k", "type_v", "flash_attn", "repack")}
    return out


def parse_batched_jsonl(text: str) -> dict:
    """llama-batched-bench ``--output-format jsonl`` → ``{"batched": [{streams, tokens,
    seconds}], "n_kv_max": ...}``: tokens = pl*tg, seconds = t_tg (its S_TG window).
    ik_llama.cpp's llama-batched-bench prints only its markdown table and a ``main:``
    line of settings: read from those where no JSON line is."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise NativeError(f"llama-batched-bench printed {line[:200]!r}, not JSON") from None
    rows = rows or _batched_table(text)
    out: dict[str, Any] = {"batched": [{"streams": r["pl"], "tokens": r["pl"] * r["tg"],
                                        "seconds": r["t_tg"], "speed_tg": r["speed_tg"],
                                        "prompt": r["pp"]} for r in rows]}
    if rows:
        out["n_kv_max"] = rows[0]["n_kv_max"]
        out["meta"] = {k: rows[0].get(k) for k in (
            "n_kv_max", "n_batch", "n_ubatch", "flash_attn", "n_threads", "n_threads_batch")}
    return out


_TABLE_COLUMNS = {"PP": "pp", "TG": "tg", "B": "pl", "T_TG s": "t_tg", "S_TG t/s": "speed_tg"}


def _batched_table(text: str) -> list[dict]:
    """The rows of llama-batched-bench's markdown table, with its ``main:`` settings, in
    the JSONL rows' keys (empty when there is no table)."""
    settings: dict[str, Any] = {}
    header: list[str] | None = None
    rows = []
    for line in text.splitlines():
        if line.startswith("main: n_kv_max"):
            for pair in line.removeprefix("main:").split(","):
                key, _, value = pair.partition("=")
                try:
                    settings[key.strip()] = int(value)
                except ValueError:
                    pass
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or set("".join(cells)) <= set("-:"):
            continue
        if header is None:
            header = cells
            continue
        values = dict(zip(header, cells, strict=False))
        try:
            row = {key: float(values[column]) for column, key in _TABLE_COLUMNS.items()}
        except (KeyError, ValueError):
            raise NativeError(f"llama-batched-bench's table row {line.strip()[:200]!r} "
                              f"lacks {sorted(_TABLE_COLUMNS)}") from None
        rows.append({**settings, **row, **{k: int(row[k]) for k in ("pp", "tg", "pl")}})
    if rows and "n_kv_max" not in settings:
        raise NativeError("llama-batched-bench printed a table without its main: settings")
    return rows


def to_reply(outputs: dict[str, str], sizes: Sizes) -> dict:
    """The binaries' stdout (by binary name) → one run reply in the workers' format:
    ``prefill`` (llama-bench pp tests), ``decode`` (its tg test), ``batched`` (the
    llama-batched-bench rows of the stream counts ``sizes`` asked for), ``n_kv_max``,
    and ``meta`` by binary. Raises NativeError when a figure asked for is missing."""
    reply: dict[str, Any] = {"prefill": [], "batched": [], "meta": {}}
    if BENCH in outputs:
        parsed = parse_bench_json(outputs[BENCH])
        reply["meta"][BENCH] = parsed.pop("meta", None)
        reply.update(parsed)
    if BATCHED in outputs:
        parsed = parse_batched_jsonl(outputs[BATCHED])
        reply["meta"][BATCHED] = parsed.pop("meta", None)
        reply["batched"] = [b for b in parsed["batched"] if b["streams"] in sizes.streams]
        if "n_kv_max" in parsed:
            reply["n_kv_max"] = parsed["n_kv_max"]
    check_complete(reply, sizes)
    return reply


def stderr_summary(text: str, lines: int = 3) -> str:
    """The last error lines of a binary's stderr (not the backtrace an abort prints
    after them), else its last lines."""
    all_lines = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [x for x in all_lines if not x.startswith("#")
              and any(w in x.lower() for w in ("error", "failed", "abort", "assert"))]
    return " | ".join((errors or all_lines)[-lines:])


def check_complete(reply: dict, sizes: Sizes) -> None:
    """Raise NativeError when a figure ``sizes`` asked for is missing from ``reply``."""
    missing = [f"pp{p}" for p in sizes.prefill
               if p not in {x["tokens"] for x in reply.get("prefill", [])}]
    if sizes.decode_steps and "decode" not in reply:
        missing.append(f"tg{sizes.decode_steps}")
    have = {b["streams"] for b in reply.get("batched", [])}
    missing += [f"npl {s}" for s in sizes.streams if s not in have]
    if missing:
        raise NativeError(f"llama.cpp gave no figure for {', '.join(missing)} (a batched "
                          "row is skipped when S*(prompt+gen) exceeds its context)")


# ---------------------------------------------------------------- the side
class NativeSide:
    """llama.cpp's binaries as one side of ``ember bench compare``: ``run(spec)`` is
    one llama-bench process and one llama-batched-bench process, and answers in the
    workers' run-reply format (no token ids: the binaries do not sample)."""

    def __init__(self, bins: Binaries, model: str, threads: int, flash_attn: str = "auto",
                 repack: bool = True) -> None:
        self.bins, self.model, self.threads = bins, model, threads
        self.flash_attn, self.repack = flash_attn, repack
        self.peaks: dict[str, int] = {}

    def argvs(self, spec: dict) -> dict[str, list[str]]:
        sizes = Sizes.of(spec)
        out = {}
        for name, make in ((BENCH, bench_argv), (BATCHED, batched_argv)):
            argv = make(self.bins, self.model, self.threads, sizes, self.flash_attn,
                        self.repack)
            if argv:
                out[name] = argv
        return out

    def info(self) -> dict:
        return {"binaries": {BENCH: str(self.bins.bench),
                             BATCHED: str(self.bins.batched) if self.bins.batched else None},
                "version": self.bins.version, "threads": self.threads,
                "flash_attn": self.flash_attn, "repack": self.repack}

    def run(self, spec: dict) -> dict:
        sizes = Sizes.of(spec)
        if self.bins.batched is None:
            sizes = Sizes(sizes.prefill, sizes.decode_steps, (), 0, 0)  # reported as absent
        outputs, processes = {}, {}
        for name, argv in self.argvs(spec).items():
            proc = run_with_peak_rss(argv, env=self.bins.env)
            processes[name] = proc.record()
            if proc.returncode != 0:
                raise NativeError(f"{shlex.join(argv)} exited with {proc.returncode}: "
                                  f"{stderr_summary(proc.stderr)}")
            # ik_llama.cpp's llama-batched-bench prints its table to stderr
            outputs[name] = proc.stdout + (proc.stderr if self.bins.ik else "")
            if proc.peak_rss_bytes:
                self.peaks[name] = max(self.peaks.get(name, 0), proc.peak_rss_bytes)
        reply = to_reply(outputs, sizes)
        for name, meta in reply.pop("meta").items():
            processes[name]["meta"] = meta
        reply["processes"] = processes
        reply["wall_s"] = sum(p["wall_s"] for p in processes.values())
        reply["cpu_s"] = sum(p["cpu_s"] for p in processes.values())
        return reply

    def close(self) -> dict:
        return {"peak_rss_bytes": max(self.peaks.values(), default=None),
                "peak_rss_by_binary": dict(self.peaks)}

    def kill(self) -> None:
        pass  # nothing outlives run()
