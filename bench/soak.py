"""Bounded soak run: thousands of mixed requests, a share cancelled; resources before and after.

``python -m bench.soak --url http://127.0.0.1:1025 --requests 3000 --pids <adapter> <triton> <stub>``
(or ``--launch`` to start and stop a stack of its own). It prints RSS, open file
descriptors and /dev/shm usage per process before and after, and exits non-zero
if descriptors or shared memory did not return to baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

log = logging.getLogger("bench.soak")
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Snapshot:
    rss_mib: dict[int, float]
    fds: dict[int, int]
    shm_bytes: int


def snapshot(pids: list[int]) -> Snapshot:
    rss, fds = {}, {}
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss[pid] = int(line.split()[1]) / 1024
            fds[pid] = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            rss[pid], fds[pid] = -1, -1
    shm = sum(f.stat().st_size for f in Path("/dev/shm").iterdir() if f.is_file())
    return Snapshot(rss, fds, shm)


async def one(client: httpx.AsyncClient, i: int, rng: random.Random, stats: dict) -> None:
    kind = rng.choice(["stream", "plain", "infer", "cancel_stream", "cancel_plain", "bad"])
    body = {"model": MODEL, "prompt": f"Soak request {i}: tell me about {rng.choice(['cats', 'rain', 'maps'])}",
            "max_tokens": rng.randint(1, 8), "temperature": rng.choice([0, 0.7])}
    try:
        if kind == "stream" or kind == "cancel_stream":
            async with client.stream("POST", "/v1/completions", json=dict(body, stream=True,
                                     max_tokens=40 if kind == "cancel_stream" else body["max_tokens"])) as r:
                async for line in r.aiter_lines():
                    if kind == "cancel_stream" and line.startswith("data: "):
                        break
        elif kind == "plain":
            (await client.post("/v1/completions", json=body)).raise_for_status()
        elif kind == "infer":
            (await client.post("/infer", json={"inputs": body["prompt"], "parameters": {"max_new_tokens": 4}})
             ).raise_for_status()
        elif kind == "cancel_plain":
            try:
                await client.post("/v1/completions", json=dict(body, max_tokens=60, ignore_eos=True), timeout=0.2)
            except httpx.TimeoutException:
                pass
        else:
            r = await client.post("/v1/completions", json=dict(body, temperature=-1))
            assert r.status_code == 422
        stats[kind] = stats.get(kind, 0) + 1
    except Exception as exc:  # counted, the run goes on
        stats["errors"] = stats.get("errors", 0) + 1
        log.warning("request %d (%s) failed: %r", i, kind, exc)


async def drive(url: str, total: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    stats: dict = {}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def guarded(i):
            async with sem:
                await one(client, i, rng, stats)

        await asyncio.gather(*(guarded(i) for i in range(total)))
    return stats


def run(url: str, pids: list[int], total: int, concurrency: int, seed: int = 0) -> tuple[Snapshot, Snapshot, dict]:
    # warm up allocators and caches so the baseline is a steady state
    asyncio.run(drive(url, min(50, total), concurrency, seed + 1))
    time.sleep(1.0)
    before = snapshot(pids)
    t0 = time.monotonic()
    stats = asyncio.run(drive(url, total, concurrency, seed))
    stats["seconds"] = round(time.monotonic() - t0, 1)
    time.sleep(2.0)  # let cancelled sequences drain
    return before, snapshot(pids), stats


def report(before: Snapshot, after: Snapshot, stats: dict) -> bool:
    print(f"requests: {stats}")
    print(f"{'pid':>8} {'RSS MiB before':>15} {'after':>8} {'fds before':>11} {'after':>6}")
    for pid in before.rss_mib:
        print(f"{pid:>8} {before.rss_mib[pid]:>15.1f} {after.rss_mib[pid]:>8.1f} {before.fds[pid]:>11} "
              f"{after.fds[pid]:>6}")
    print(f"/dev/shm bytes: before {before.shm_bytes} after {after.shm_bytes}")
    return after.fds == before.fds and after.shm_bytes <= before.shm_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:1025")
    parser.add_argument("--pids", type=int, nargs="*", default=[])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    before, after, stats = run(args.url, args.pids, args.requests, args.concurrency)
    return 0 if report(before, after, stats) else 1


if __name__ == "__main__":
    raise SystemExit(main())
