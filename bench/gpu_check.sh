#!/usr/bin/env bash
# The GPU check of docs/transformers.md, in one command on a CUDA machine (a fresh clone):
#   bash bench/gpu_check.sh            # writes bench/results/gpu_check_*.json
# minillama's own engine (--device cuda, the reference backend: the kernels are CPU-only) and the
# transformers engine run the cached-path ruler on the default model, hamlet, 4 windows, for the
# schemes a foreign model takes; then the transformers engine's decode speed and the GPU's peak
# memory per cache at 512 and 8192 tokens. Compare with the CPU rows of docs/transformers.md.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup >/dev/null
.venv/bin/pip install -q -c constraints.txt -e ".[hf]" optimum-quanto
.venv/bin/minillama fetch >/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
common=(--dataset hamlet --windows 4 --kv fp16 --kv kivi4 --kv hadv2 --kv k4v3lmc --json)
.venv/bin/minillama ppl --device cuda --backend reference "${common[@]}" > bench/results/gpu_check_own.json
.venv/bin/minillama ppl --engine transformers --device cuda "${common[@]}" > bench/results/gpu_check_hf.json
.venv/bin/minillama bench --engine transformers --device cuda --dtype bfloat16 --context 512 --context 8192 \
  --kv hf-dynamic --kv fp16 --kv kivi4 --kv hadv2 --kv k4v3lmc --kv hf-quanto4 > bench/results/gpu_check_bench.txt
cat bench/results/gpu_check_bench.txt
.venv/bin/python - <<'PY'
import json
own = json.load(open("bench/results/gpu_check_own.json"))
hf = json.load(open("bench/results/gpu_check_hf.json"))
for a, b in zip(own, hf):
    print(f"{a['kv']:<10} own ppl {a['ppl']:.4f} KLD {a['kld_mean']:.5f} | transformers ppl {b['ppl']:.4f} "
          f"KLD {b['kld_mean']:.5f} | cache MB {a['cache_bytes'] / 1e6:.2f} / {b['cache_bytes'] / 1e6:.2f}")
PY
