"""One large POST /v1/embeddings answer (issue 27): how long it takes, how many bytes it is, and how long the server's
event loop stops answering others while it writes it (the slowest GET /health of a probe polling every 5 ms while
the request runs).

    python benchmarks/serve_large_embedding.py --embedder MODEL_DIR [--texts 1024] [--rounds 2] [--src DIR]

The server is `tuneforge serve MODEL_DIR` on a free port of 127.0.0.1, asked for --texts distinct news sentences at
once (the server's default limit per request is 1024), as floats (`encoding_format: "float"`) and as base64, each
--rounds times after one untimed 64-text request. --src: the `src` folder of another checkout to serve from (to
measure an older commit with the same script). Prints one JSON line per request and writes
benchmarks/results/serve_large_embedding.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _machine import machine_meta
from serve_load import TEXTS, free_port, start, stop

HERE = Path(__file__).resolve().parent


async def one_request(url: str, texts: list[str], encoding: str) -> dict:
    """The request's time and size, and the slowest /health answer while it ran."""
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "input": texts, "encoding_format": encoding}
        await client.post(f"{url}/v1/embeddings", json={**body, "input": texts[:64]})  # warm-up
        slowest, done = 0.0, False

        async def probe() -> None:
            nonlocal slowest
            while not done:
                began = time.perf_counter()
                await client.get(f"{url}/health")
                slowest = max(slowest, time.perf_counter() - began)
                await asyncio.sleep(0.005)

        prober = asyncio.create_task(probe())
        began = time.perf_counter()
        answer = await client.post(f"{url}/v1/embeddings", json=body)
        took = time.perf_counter() - began
        done = True
        await prober
    assert answer.status_code == 200, answer.text[:200]
    return {
        "encoding": encoding,
        "request_s": round(took, 3),
        "bytes": len(answer.content),
        "slowest_health_s": round(slowest, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--embedder", required=True, help="a sentence encoder folder")
    ap.add_argument("--texts", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--src", default=None, help="serve from this checkout's src folder (default: this one's)")
    ap.add_argument("--out", default=str(HERE / "results" / "serve_large_embedding.json"))
    args = ap.parse_args()
    if args.src:
        os.environ["PYTHONPATH"] = str(Path(args.src).resolve())  # the server process imports tuneforge from there
    texts = [f"{TEXTS[i % len(TEXTS)]} ({i})" for i in range(args.texts)]
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="serve-large-")) / "server.log"
    proc = start([sys.executable, "-m", "tuneforge.cli", "serve", args.embedder, "--port", str(port)], port, log)
    rows = []
    try:
        for _ in range(args.rounds):
            for encoding in ("float", "base64"):
                rows.append(asyncio.run(one_request(f"http://127.0.0.1:{port}", texts, encoding)))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop(proc)
    command = "python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    Path(args.out).write_text(json.dumps({**machine_meta(command=command), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
