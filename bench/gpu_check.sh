#!/usr/bin/env bash
# The LLM engine on a CUDA machine, in one prepared run of about 9 minutes at most:
#   1. the engine's tests with the bundled target on the GPU (SPECVOX_LLM__DEVICE=cuda), the
#      CUDA graphs' first;
#   2. `specvox bench spec` in float32 and in bfloat16 on the GPU;
#   3. the figures into docs/benchmarks/history.md, a dated subsection under "Losslessness and the guard".
# It stops at once, with a message and exit status 2, where torch sees no CUDA device.
#
#   bench/gpu_check.sh                      # the whole check
#   bench/gpu_check.sh --write A.json B.json [TESTS_LOG]   # only step 3, from bench spec JSON files
#
# Environment: PYTHON (default .venv/bin/python), DOCS (default docs/benchmarks/history.md), LIMIT and
# TOKENS (bench spec's --limit and --max-new-tokens: 4 and 64), OUT (where JSON and logs go),
# TESTS (the test files, in order), DTYPES (default "float32 bfloat16"), TESTS_TIMEOUT and
# BENCH_TIMEOUT (seconds: 270 for the tests, 130 for each bench spec).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
DOCS=${DOCS:-docs/benchmarks/history.md}
LIMIT=${LIMIT:-4}
TOKENS=${TOKENS:-64}
TESTS=${TESTS:-tests/e2e/test_cuda_graph_step.py tests/e2e/test_engine.py tests/e2e/test_speculative.py tests/e2e/test_lossless.py tests/e2e/test_batch.py}
DTYPES=${DTYPES:-float32 bfloat16}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-270}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-130}
OUT=${OUT:-$(mktemp -d -t specvox-gpu-check.XXXXXX)}

write_figures() {  # DOCS, then bench spec JSON files, then optionally the tests' log
  "$PYTHON" - "$@" <<'PY'
import datetime
import json
import subprocess
import sys
from pathlib import Path

MARKER = "<!-- gpu_check.sh writes its dated figures below this line -->"
docs, *rest = sys.argv[1:]
jsons = [a for a in rest if a.endswith(".json")]
logs = [a for a in rest if not a.endswith(".json")]
yes_no = {True: "yes", False: "no", None: ""}.get
stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
try:
    device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                            text=True, timeout=20).stdout.strip().splitlines()[0]
except Exception:  # noqa: BLE001 - the figures still go in, without the device's name
    device = "device name unknown (nvidia-smi did not answer)"
lines = [f"#### GPU check, {stamp}: {device}", "",
         "```sh", "bench/gpu_check.sh", "```", ""]
if logs:
    summary = [line for line in Path(logs[0]).read_text().splitlines() if " passed" in line or " failed" in line]
    lines += [f"Engine tests on the GPU: {summary[-1].strip('= ') if summary else 'no summary line (see the log)'}", ""]
lines += ["| dtype | workload | method | tok/s | vs HF greedy | tokens per pass | = HF greedy | = plain |",
          "|---|---|---|---:|---:|---:|---|---|"]
for path in jsons:
    for r in json.loads(Path(path).read_text()):
        if r.get("missing"):  # a row bench spec could not run (llama.cpp's), with the reason
            lines.append(f"| | {r['workload']} | {r['method']} | missing: {r['missing']} | | | | |")
            continue
        accepted = "" if r.get("mean_accepted_len") is None else f"{r['mean_accepted_len']:.2f}"
        lines.append(f"| {r['dtype']} | {r['workload']} | {r['method']} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup_vs_hf_greedy']:.2f}× | {accepted} | {yes_no(r['identical_to_greedy'])} | "
                     f"{yes_no(r['identical_to_plain'])} |")
block = "\n".join(lines) + "\n"
text = Path(docs).read_text()
if MARKER in text:
    text = text.replace(MARKER, MARKER + "\n\n" + block, 1)
else:
    print(f"gpu_check: no marker in {docs}; the figures go at its end", file=sys.stderr)
    text = text.rstrip("\n") + "\n\n" + block
Path(docs).write_text(text)
print(f"gpu_check: figures written to {docs}")
PY
}

if [[ "${1:-}" == "--write" ]]; then
  shift
  write_figures "$DOCS" "$@"
  exit 0
fi

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device: torch.cuda.is_available() is false (torch $("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo '?'))." >&2
  echo "gpu_check: run it on a machine with an NVIDIA GPU and a CUDA build of torch; nothing was run or written." >&2
  exit 2
fi
"$PYTHON" -c 'import torch; print("gpu_check: CUDA", torch.version.cuda, "on", torch.cuda.get_device_name(0))'
mkdir -p "$OUT"
export SPECVOX_LLM__DEVICE=cuda

# 1. The engine's tests on the GPU (they take the device from SPECVOX_LLM__DEVICE; CPU-only
# weight forms and drafters skip there). TESTS_TIMEOUT, 270 s by default (all five files: 238 s on an H200).
status=0
# shellcheck disable=SC2086 # TESTS is a list of paths
timeout "$TESTS_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/tests.log" || status=$?

# 2. bench spec in each of DTYPES, BENCH_TIMEOUT each (130 s by default: bfloat16 ran past 100 s on an H200).
for dtype in $DTYPES; do
  SPECVOX_LLM__DTYPE=$dtype timeout "$BENCH_TIMEOUT" "$PYTHON" -m services.cli bench spec --limit "$LIMIT" \
    --max-new-tokens "$TOKENS" --json "$OUT/spec_$dtype.json" 2>&1 | tee "$OUT/spec_$dtype.log" || status=$?
done

# 3. The figures, from whatever finished (bench spec writes its JSON after each prompt set).
jsons=()
for dtype in $DTYPES; do
  [[ -s "$OUT/spec_$dtype.json" ]] && jsons+=("$OUT/spec_$dtype.json")
done
write_figures "$DOCS" ${jsons[@]+"${jsons[@]}"} "$OUT/tests.log"
echo "gpu_check: logs and JSON in $OUT; exit status $status"
exit "$status"
