"""``ember bench switch``: what a several-model server costs, against llama.cpp's router
mode on the same files, in one run.

Two models of the same shape (random weights, different seeds: two files) in one
directory, served by ``ember serve --models-dir`` and by ``llama-server --models-dir
--models-max 2`` (llama.cpp's router, one child process per model), one after the
other, never both at once. For each server: a streamed chat request to model A, which is
not loaded, timed from sending it to its first token (the load included: the figure a
user waits on when switching); the same for B while A stays loaded; then the memory the
server holds with both loaded (the resident set of its process, and of its children for
llama.cpp's router). The page cache is dropped before each server where this process
may (``/proc/sys/vm/drop_caches``, as root), so both read the files from disk; where it
may not, both files are read once first and both servers find them cached (the run
says which).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from ember.bench.server_process import ServerProcess, free_port

ASK = [{"role": "user", "content": "Say hello."}]


def _drop_page_cache(files: list[Path]) -> str:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "dropped before each server"
    except OSError:
        for f in files:
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
        return "warm (could not drop it: both files read first)"


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _first_token_seconds(url: str, model: str) -> float:
    body = {"model": model, "messages": ASK, "max_tokens": 4, "stream": True,
            "temperature": 0}
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.perf_counter() - start
    raise RuntimeError(f"{model}: no token came back")


def _measure(url: str, proc: subprocess.Popen, names: list[str]) -> dict[str, Any]:
    first = _first_token_seconds(url, names[0])
    second = _first_token_seconds(url, names[1])
    time.sleep(1)  # let a child's memory settle
    return {"first_token_cold_a_s": first, "first_token_cold_b_s": second,
            "rss_both_loaded_bytes": _tree_rss(proc.pid)}


def _llama_cpp(binary: str, directory: Path, names: list[str], threads: int,
               files: list[Path]) -> tuple[dict[str, Any], list[str]]:
    """llama.cpp's router on the directory: with its default weight repacking first; where
    a child dies on it (on an AMX machine its repacked buffers crash: a 500), again with
    ``--no-repack``, which the router hands its children. Returns the flags used."""
    from ember.bench.llamacpp_native import binary_env

    for extra in ([], ["--no-repack"]):
        _drop_page_cache(files)
        flags = ["--models-max", "2", "-t", str(threads), "-c", "4096", *extra]
        port = free_port()
        cmd = [binary, "--models-dir", str(directory), "--host", "127.0.0.1", "--port",
               str(port), *flags]
        server = ServerProcess(cmd, port, binary_env(Path(binary)), wait_seconds=120,
                               group=True)
        with server as url:
            listed = httpx.get(f"{url}/models", timeout=30).json()
            ids = [m.get("id") or m.get("name") for m in listed.get("data", [])]
            theirs = [next(i for i in ids if n in str(i)) for n in names]
            try:
                return _measure(url, server.proc, theirs), flags
            except httpx.HTTPStatusError as e:
                if extra:
                    raise
                print(f"llama-server's router failed with its default repacking ({e}); "
                      "again with --no-repack")
    raise AssertionError("unreachable")


def main(files: list[Path], threads: int, llama_server: str | None, out: Path
         ) -> dict[str, Any]:
    directory = files[0].parent
    names = [f.stem for f in files]
    result: dict[str, Any] = {"files": [str(f) for f in files], "threads": threads}
    result["page_cache"] = _drop_page_cache(files)
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from ember.cli import main; sys.exit(main())",
           "serve", "--models-dir", str(directory), "--port", str(port), "--threads",
           str(threads), "--no-ui"]
    server = ServerProcess(cmd, port, wait_seconds=120, group=True)
    with server as url:
        result["ember"] = _measure(url, server.proc, names)
    print(f"ember: {result['ember']}", flush=True)
    if llama_server:
        result["llama.cpp"], result["llama.cpp flags"] = _llama_cpp(
            llama_server, directory, names, threads, files)
    print(f"two models ({', '.join(names)}), {threads} threads, page cache "
          f"{result['page_cache']}")
    print(f"{'':>10} {'A cold (s)':>11} {'B cold (s)':>11} {'RSS both (MB)':>14}")
    for who in ("ember", "llama.cpp"):
        if who in result:
            r = result[who]
            print(f"{who:>10} {r['first_token_cold_a_s']:>11.2f} "
                  f"{r['first_token_cold_b_s']:>11.2f} {r['rss_both_loaded_bytes'] / 1e6:>14.0f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result
