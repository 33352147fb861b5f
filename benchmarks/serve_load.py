"""`tuneforge serve` under load (issue 14): throughput and p50/p99 latency of (a) a classifier and (b) SmolLM2-135M
generation, each against batching off (`--max-batch-size 1`) in the same run and against a plain `transformers`
pipeline inside FastAPI (benchmarks/serve_pipeline_peer.py), with malformed requests sent while the load runs;
generation also against `transformers serve --continuous-batching` (transformers' own OpenAI server, paged
attention) at each of --peer-dtypes, and tuneforge with every request asking for `logprobs` (what they cost).

    python benchmarks/serve_load.py --clients 32 --requests 256 --max-tokens 64

Each variant is a server process on a free port of 127.0.0.1. The load generator (asyncio + httpx) sends a fixed
list of --requests requests with --clients concurrent clients and stops by itself; each request times out after
--timeout seconds (an error). Generation is greedy (temperature 0) with `max_tokens` --max-tokens, prompts from
a fixed list; tokens/s counts the completion tokens the server reports. One more client sends malformed
requests (bad JSON, wrong types, empty prompt, max_tokens above the context, ...) every --bad-every-ms while
the load runs and counts the 4xx answers. Two warm-up requests go first, untimed. Correctness: every greedy
answer of the batched tuneforge server is compared with the unbatched one's for the same prompt (a
classifier's scores: within 1e-3).

Models: --model (default: the bundled SmolLM2-135M, converted once under ~/.cache/tuneforge/models) and
--classifier (default: the bundled all-MiniLM-L6-v2 with a fresh 5-label classification head, exported into a
temporary folder: its speed is a trained classifier's). Writes benchmarks/results/serve_load.json and prints a
markdown table. --only classify|generate runs one half.
--only embed (issue 27; only when named): POST /v1/embeddings of one text per request to --embedder (a sentence
encoder folder that `tuneforge train --task embedding` wrote), batching against `--max-batch-size 1`, no peer; the
batched vectors compared with the unbatched ones (within 1e-3), malformed embedding requests beside the load, and
the batching server once more with `--max-wait-ms 10`. `--texts squad` (classify, embed): SQuAD dev's questions
and paragraphs alternating instead of eight short sentences. Each tuneforge row holds its mean rows per forward
(`mean_batch`, from the server's /metrics).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _machine import machine_meta

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROMPTS = [
    "The history of the city begins",
    "In the morning the market",
    "Scientists have found that",
    "The recipe calls for",
    "Once upon a time, in a small village,",
    "The best way to learn a language is",
    "The train left the station and",
    "Our team spent the weekend",
]
TEXTS = [
    "Shares in the company rose after strong quarterly profits.",
    "The striker scored twice in the second half to win the cup.",
    "The new phone has a faster chip and a brighter screen.",
    "Parliament voted on the budget late on Tuesday night.",
    "The film won three awards at the festival this year.",
    "Oil prices fell as supply rose faster than expected.",
    "The coach praised the young players after the match.",
    "Researchers released software that translates speech in real time.",
]


def squad_texts(pairs: int = 512) -> list[str]:
    """SQuAD dev-v1.1's first `pairs` questions, each followed by its paragraph (../shared/data/squad)."""
    data = json.loads((REPO.parent / "shared/data/squad/dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    texts = [
        t
        for article in data
        for para in article["paragraphs"]
        for qa in para["qas"]
        for t in (qa["question"], para["context"])
    ]
    return texts[: 2 * pairs]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log: Path, timeout: float = 600) -> subprocess.Popen:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TUNEFORGE_API_KEY", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"server did not come up in {timeout:.0f} s; see {log}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def malformed(kind: str, model: str) -> list[tuple[str, bytes]]:
    """(path, body) of requests every server must answer 4xx."""
    if kind == "predict":
        bodies = [b'{"texts": [', b'{"texts": "x"}', b'{"texts": []}', b"[1, 2]", b'{"texts": [1, 2]}']
        return [("/predict", b) for b in bodies]
    if kind == "embed":
        changes = [{"input": ""}, {"input": []}, {"input": 5}, {"model": "no-such-model"}, {"dimensions": 10**7}]
        bodies = [json.dumps({"model": model, "input": "Hello", **c}).encode() for c in changes] + [b'{"input": ']
        return [("/v1/embeddings", b) for b in bodies]
    good = {"model": model, "prompt": "Hello", "max_tokens": 4}
    changes = [{"max_tokens": "4"}, {"prompt": ""}, {"max_tokens": 10**7}, {"temperature": -1}, {"prompt": 5}]
    bodies = [json.dumps({**good, **c}).encode() for c in changes] + [b'{"model": ', b"[]"]
    return [("/v1/completions", b) for b in bodies]


async def load(url: str, kind: str, model: str, args, extra: dict | None = None) -> dict:
    """Run the fixed request list with `args.clients` clients; malformed requests beside it. `extra`: fields added
    to every generation request (logprobs)."""
    requests = []
    for i in range(args.requests):
        if kind == "predict":
            requests.append(("/predict", {"texts": [args.load_texts[i % len(args.load_texts)]]}))
        elif kind == "embed":
            texts = args.load_texts
            requests.append(("/v1/embeddings", {"model": model, "input": texts[i % len(texts)]}))
        else:
            body = {
                "model": model,
                "prompt": PROMPTS[i % len(PROMPTS)],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                **(extra or {}),
            }
            requests.append(("/v1/completions", body))
    latencies, answers, errors, tokens = [], {}, [], 0
    queue: asyncio.Queue = asyncio.Queue()
    for item in enumerate(requests):
        queue.put_nowait(item)
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    bad_sent, bad_4xx, bad_other = 0, 0, []
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as http:

        async def client() -> None:
            nonlocal tokens
            while not queue.empty():
                i, (path, body) = queue.get_nowait()
                t0 = time.perf_counter()
                try:
                    r = await http.post(path, json=body)
                except httpx.HTTPError as err:
                    errors.append(f"{i}: {type(err).__name__}")
                    continue
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors.append(f"{i}: HTTP {r.status_code} {r.text[:200]}")
                    continue
                out = r.json()
                if kind == "predict":
                    answers[i] = out["predictions"][0].get("scores")
                elif kind == "embed":
                    answers[i] = out["data"][0]["embedding"]
                else:
                    answers[i] = out["choices"][0]["text"]
                    tokens += out["usage"]["completion_tokens"]

        async def misbehave() -> None:
            nonlocal bad_sent, bad_4xx
            bad = malformed(kind, model)
            while not done.is_set():
                path, body = bad[bad_sent % len(bad)]
                try:
                    r = await http.post(path, content=body, headers={"Content-Type": "application/json"})
                    bad_4xx += 400 <= r.status_code < 500
                    if not 400 <= r.status_code < 500:
                        bad_other.append(f"{path} {body[:40]!r}: HTTP {r.status_code}")
                except httpx.HTTPError as err:
                    bad_other.append(f"{path} {body[:40]!r}: {type(err).__name__}")
                bad_sent += 1
                await asyncio.sleep(args.bad_every_ms / 1000)

        for path, body in requests[: min(2, len(requests))]:  # warm-up, not timed: first-call kernel set-up
            await http.post(path, json=body)
        t0 = time.perf_counter()
        bad_task = asyncio.create_task(misbehave())
        await asyncio.gather(*(client() for _ in range(args.clients)))
        wall = time.perf_counter() - t0
        done.set()
        await bad_task
    lat = sorted(latencies)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(round(p / 100 * (len(lat) - 1))))] if lat else float("nan")

    return {
        "requests": args.requests,
        "ok": len(answers),
        "errors": len(errors),
        "error_samples": errors[:5],
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(answers) / wall, 3),
        "tokens_per_s": round(tokens / wall, 2) if kind == "generate" else None,
        "completion_tokens": tokens if kind == "generate" else None,
        "p50_s": round(pct(50), 4),
        "p99_s": round(pct(99), 4),
        "mean_s": round(statistics.fmean(lat), 4) if lat else None,
        "malformed_sent": bad_sent,
        "malformed_4xx": bad_4xx,
        "malformed_not_4xx": bad_other[:5],
        "answers": answers,
    }


def classifier_folder(out: Path) -> str:
    """The bundled MiniLM with a fresh 5-label head (seed 0), saved as an HF folder with its tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tuneforge.tasks.base import bundled_minilm

    base = bundled_minilm()
    torch.manual_seed(0)
    labels = {i: name for i, name in enumerate(["business", "entertainment", "politics", "sport", "tech"])}
    model = AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=5, id2label=labels, label2id={v: k for k, v in labels.items()}
    )
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return str(out)


def variants(kind: str, model_dir: str, args) -> dict[str, tuple[list[str], dict]]:
    """name -> (the server's command, fields added to each generation request)."""
    serve = [sys.executable, "-m", "tuneforge.cli", "serve", model_dir, "--max-queue", str(max(256, args.requests))]
    peer = [sys.executable, str(HERE / "serve_pipeline_peer.py"), model_dir, "--kind", kind]
    batching = serve + ["--max-batch-size", str(args.max_batch_size)]
    out = {
        "tuneforge serve (batching)": (batching, {}),
        "tuneforge serve --max-batch-size 1 (batching off)": (serve + ["--max-batch-size", "1"], {}),
    }
    if kind != "embed":
        out["transformers pipeline in FastAPI (peer)"] = (peer, {})
    if kind != "generate":  # the default before 2026-11-28 (0 since): a lone request waits up to 10 ms for company
        out["tuneforge serve (batching) --max-wait-ms 10"] = (batching + ["--max-wait-ms", "10"], {})
    else:
        # transformers' own OpenAI server with its paged-attention continuous batching, at each dtype (its best is
        # the peer)
        hf = [str(Path(sys.executable).with_name("transformers")), "serve", model_dir, "--continuous-batching"]
        hf += ["--host", "127.0.0.1"]
        for dtype in args.peer_dtypes.split(","):
            out[f"transformers serve --continuous-batching --dtype {dtype} (peer)"] = (hf + ["--dtype", dtype], {})
        out["tuneforge serve (batching) --precision fp32"] = (batching + ["--precision", "fp32"], {})
        # generation keeps every core by default; the encoders' default leaves the event loop one (--threads)
        out["tuneforge serve (batching) --threads 1"] = (batching + ["--threads", "1"], {})
        out["tuneforge serve (batching) --no-pack-weights"] = (batching + ["--no-pack-weights"], {})
        if args.logprobs is not None:
            out[f"tuneforge serve (batching), logprobs {args.logprobs}"] = (batching, {"logprobs": args.logprobs})
    return out


def mean_batch(metrics: str) -> float | None:
    """Rows per forward pass over the run (tuneforge's /metrics batch-size histogram; warm-up included)."""
    found = dict(
        line.split(" ", 1)
        for line in metrics.splitlines()
        if line.startswith(("tuneforge_batch_size_sum ", "tuneforge_batch_size_count "))
    )
    sum_, count = (float(found.get(f"tuneforge_batch_size_{k}", 0)) for k in ("sum", "count"))
    return round(sum_ / count, 2) if count else None


def compare(kind: str, batched: dict, single: dict) -> dict:
    """How many answers of the batched server differ from the unbatched server's for the same request."""
    same = [i for i in batched if i in single]
    if kind == "predict":
        differ = [i for i in same if any(abs(batched[i][k] - single[i][k]) > 1e-3 for k in single[i])]
    elif kind == "embed":
        differ = [i for i in same if max(abs(a - b) for a, b in zip(batched[i], single[i])) > 1e-3]
    else:
        differ = [i for i in same if batched[i] != single[i]]
    return {"compared": len(same), "differ": len(differ)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a causal LM folder (default: the bundled SmolLM2-135M)")
    ap.add_argument("--classifier", default=None, help="a classifier folder (default: MiniLM with a fresh head)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256, help="requests per variant")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch-size", type=int, default=32, help="tuneforge's batch in the batching variant")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (then an error)")
    ap.add_argument("--bad-every-ms", type=float, default=200.0, help="pause between malformed requests")
    ap.add_argument("--only", choices=["classify", "generate", "embed"], default=None)
    ap.add_argument("--embedder", default=None, help="a sentence encoder folder of tuneforge's (for --only embed)")
    ap.add_argument(
        "--texts",
        choices=["short", "squad"],
        default="short",
        help="classify and embed: the eight short sentences (12-15 tokens), or SQuAD dev's questions and paragraphs "
        "alternating "
        "(12 to 256 tokens: a retrieval index being built while it is queried)",
    )
    ap.add_argument("--peer-dtypes", default="float32,bfloat16", help="transformers serve's dtypes, each a variant")
    ap.add_argument("--skip", default=None, help="leave out variants whose names hold these texts (comma-separated)")
    ap.add_argument("--logprobs", type=int, default=5, help="a variant asking each request for logprobs (the cost)")
    ap.add_argument("--out", default=str(HERE / "results" / "serve_load.json"))
    args = ap.parse_args()
    args.load_texts = squad_texts() if args.texts == "squad" else TEXTS

    tmp = Path(tempfile.mkdtemp(prefix="serve-load-"))
    kinds = {"classify": "predict", "generate": "generate", "embed": "embed"}
    results: dict = {}
    for half, kind in kinds.items():
        if (args.only and args.only != half) or (half == "embed" and args.only != "embed"):
            continue
        if kind == "embed":
            model_dir = args.embedder or sys.exit("--only embed needs --embedder")
        elif kind == "predict":
            model_dir = args.classifier or classifier_folder(tmp / "classifier")
        else:
            from tuneforge.tasks.clm import bundled_smollm2

            model_dir = args.model or bundled_smollm2()
        rows = {}
        skip = [part for part in (args.skip or "").split(",") if part]
        chosen = {k: v for k, v in variants(kind, model_dir, args).items() if not any(part in k for part in skip)}
        for name, (cmd, extra) in chosen.items():
            port = free_port()
            log = tmp / f"{half}-{len(rows)}.log"
            proc = start(cmd + ["--port", str(port)], port, log)
            try:
                served = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)
                model_name = served.json()["data"][0]["id"] if served.status_code == 200 else model_dir
                print(f"{half}: {name} ...", file=sys.stderr, flush=True)
                rows[name] = asyncio.run(load(f"http://127.0.0.1:{port}", kind, model_name, args, extra))
                if name.startswith("tuneforge"):
                    rows[name]["mean_batch"] = mean_batch(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
            finally:
                stop(proc)
            partial = {n: {k: v for k, v in r.items() if k != "answers"} for n, r in rows.items()}
            Path(args.out).with_suffix(".partial.json").write_text(json.dumps({half: partial}, indent=2) + "\n")
            print(f"{half}: {name}: {json.dumps(partial[name])}", file=sys.stderr, flush=True)
        batched, single = "tuneforge serve (batching)", "tuneforge serve --max-batch-size 1 (batching off)"
        check = compare(kind, rows[batched]["answers"], rows[single]["answers"]) if single in rows else None
        for row in rows.values():
            row.pop("answers")
        results[half] = {"model": model_dir, "variants": rows, "batched_vs_unbatched_answers": check}

    meta = machine_meta(
        command="python benchmarks/" + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        clients=args.clients,
        requests=args.requests,
        max_tokens=args.max_tokens,
    )
    report = {"meta": meta, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)  # (the progress of a run that ended whole)
    print(json.dumps(meta))
    print("| load | server | req/s | tokens/s | p50 s | p99 s | errors | malformed: 4xx / sent |")
    print("|---|---|---|---|---|---|---|---|")
    for half, res in results.items():
        for name, row in res["variants"].items():
            tps = "" if row["tokens_per_s"] is None else row["tokens_per_s"]
            print(
                f"| {half} | {name} | {row['requests_per_s']} | {tps} | {row['p50_s']} | {row['p99_s']} | "
                f"{row['errors']} | {row['malformed_4xx']} / {row['malformed_sent']} |"
            )
        check = res["batched_vs_unbatched_answers"]
        if check is not None:
            print(f"| {half} | batched answers that differ from unbatched | {check['differ']} of {check['compared']} |")


if __name__ == "__main__":
    main()
