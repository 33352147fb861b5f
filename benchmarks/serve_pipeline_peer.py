"""The peer of benchmarks/serve_load.py: a plain `transformers.pipeline` inside FastAPI, answering the same
request shapes as `tuneforge serve` (POST /predict {"texts"} for a classifier, POST /v1/completions {"prompt",
"max_tokens"} for a causal LM, GET /health), one pipeline call per request, one call at a time (a lock: the
model is not shared between threads), no batching across requests. Its only checks: the fields' types, and
max_tokens at most 4096 (so that a malformed request of the load cannot hold it for hours).

    python benchmarks/serve_pipeline_peer.py MODEL_DIR --kind generate --port 8100
"""

from __future__ import annotations

import argparse
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def build(model_dir: str, kind: str) -> FastAPI:
    import torch
    from transformers import pipeline

    task = "text-generation" if kind == "generate" else "text-classification"
    pipe = pipeline(task, model=model_dir, device=0 if torch.cuda.is_available() else -1)
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.post("/predict")
    async def predict(request: Request):
        try:
            body = await request.json()
            texts = body["texts"]
            assert isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts)
        except Exception:
            return JSONResponse({"error": {"message": "bad request"}}, status_code=400)
        with lock:
            out = pipe(texts, top_k=None)
        return {"predictions": [{"scores": {d["label"]: d["score"] for d in row}} for row in out]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
            prompt, max_tokens = body["prompt"], body.get("max_tokens", 16)
            assert isinstance(prompt, str) and prompt and isinstance(max_tokens, int) and 0 < max_tokens <= 4096
        except Exception:
            return JSONResponse({"error": {"message": "bad request"}}, status_code=400)
        with lock:
            [out] = pipe(prompt, max_new_tokens=max_tokens, do_sample=False, return_full_text=False)
        text = out["generated_text"]
        tokens = len(pipe.tokenizer(text, add_special_tokens=False)["input_ids"])
        return {"choices": [{"index": 0, "text": text}], "usage": {"completion_tokens": tokens}}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--kind", choices=["generate", "predict"], required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(build(args.model_dir, args.kind), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
