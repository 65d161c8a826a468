#!/usr/bin/env bash
# The LLM engine on a CUDA machine, in one prepared run of about 12 minutes at most (STEPS="tests spec" and
# then STEPS=batch split it in two where one command may run 10 minutes at most):
#   1. the engine's tests with the bundled target on the GPU (SPECVOX_LLM__DEVICE=cuda), the
#      CUDA graphs' first;
#   2. `specvox bench spec` in float32 and in bfloat16 on the GPU;
#   3. `specvox bench batch` with 1, 8, 32 and 64 replies at once (BATCH_SESSIONS), float32: many avatars on
#      one GPU, each drafter's batched throughput against one reply (goal: 32 at once ≥ 10× one);
#   4. the figures into docs/benchmarks/history.md, a dated subsection under "Losslessness and the guard".
# It stops at once, with a message and exit status 2, where torch sees no CUDA device.
#
#   bench/gpu_check.sh                      # the whole check
#   bench/gpu_check.sh --write A.json B.json [batch_X.json] [TESTS_LOG]   # only step 4, from the JSON files
#
# Environment: PYTHON (default .venv/bin/python), DOCS (default docs/benchmarks/history.md), LIMIT and
# TOKENS (bench spec's --limit and --max-new-tokens: 4 and 64), OUT (where JSON and logs go),
# TESTS (the test files, in order), DTYPES (default "float32 bfloat16"), BATCH_SESSIONS (default "1,8,32,64"),
# TESTS_TIMEOUT, BENCH_TIMEOUT and BATCH_TIMEOUT (seconds: 270 for the tests, 130 for each bench spec,
# 180 for bench batch), STEPS (default "tests spec batch").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
DOCS=${DOCS:-docs/benchmarks/history.md}
LIMIT=${LIMIT:-4}
TOKENS=${TOKENS:-64}
TESTS=${TESTS:-tests/e2e/test_cuda_graph_step.py tests/e2e/test_eagle_graph.py tests/e2e/test_engine.py tests/e2e/test_speculative.py tests/e2e/test_lossless.py tests/e2e/test_batch.py}
DTYPES=${DTYPES:-float32 bfloat16}
BATCH_SESSIONS=${BATCH_SESSIONS:-1,8,32,64}
BATCH_TIMEOUT=${BATCH_TIMEOUT:-180}
STEPS=${STEPS:-tests spec batch}
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
jsons = [a for a in rest if a.endswith(".json") and not Path(a).name.startswith("batch")]
batches = [a for a in rest if a.endswith(".json") and Path(a).name.startswith("batch")]
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
for path in batches:  # bench batch: replies decoded at once, each drafter against one reply alone
    rows = json.loads(Path(path).read_text())
    lines += ["", "| drafter | verify cap | replies at once | batched tok/s | × one reply batched | "
              "one at a time tok/s | rows a step | = one at a time |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    single = {(r["drafter"], r["max_verify_tokens"]): r["batched_tokens_per_s"] for r in rows if r["sessions"] == 1}
    for r in rows:
        one = single.get((r["drafter"], r["max_verify_tokens"]))
        ratio = f"{r['batched_tokens_per_s'] / one:.2f}×" if one else ""
        cap = r["max_verify_tokens"] or "none"
        lines.append(f"| {r['drafter']} | {cap} | {r['sessions']} | {r['batched_tokens_per_s']:.1f} | {ratio} | "
                     f"{r['one_at_a_time_tokens_per_s']:.1f} | {r['mean_rows_per_step']:.2f} | {yes_no(r['identical'])} |")
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
if [[ " $STEPS " == *" tests "* ]]; then
  timeout "$TESTS_TIMEOUT" "$PYTHON" -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/tests.log" || status=$?
fi

# 2. bench spec in each of DTYPES, BENCH_TIMEOUT each (130 s by default: bfloat16 ran past 100 s on an H200).
for dtype in $DTYPES; do
  [[ " $STEPS " == *" spec "* ]] || break
  SPECVOX_LLM__DTYPE=$dtype timeout "$BENCH_TIMEOUT" "$PYTHON" -m services.cli bench spec --limit "$LIMIT" \
    --max-new-tokens "$TOKENS" --json "$OUT/spec_$dtype.json" 2>&1 | tee "$OUT/spec_$dtype.log" || status=$?
done

# 3. Many replies at once on the GPU (float32), BATCH_TIMEOUT.
if [[ " $STEPS " == *" batch "* ]]; then
  SPECVOX_LLM__DTYPE=float32 timeout "$BATCH_TIMEOUT" "$PYTHON" -m services.cli bench batch \
    --sessions "$BATCH_SESSIONS" --max-new-tokens "$TOKENS" --json "$OUT/batch_float32.json" 2>&1 \
    | tee "$OUT/batch_float32.log" || status=$?
fi

# 4. The figures, from whatever finished (bench spec writes its JSON after each prompt set).
jsons=()
for dtype in $DTYPES; do
  [[ -s "$OUT/spec_$dtype.json" ]] && jsons+=("$OUT/spec_$dtype.json")
done
[[ -s "$OUT/batch_float32.json" ]] && jsons+=("$OUT/batch_float32.json")
logs=()
[[ -s "$OUT/tests.log" ]] && logs+=("$OUT/tests.log")
write_figures "$DOCS" ${jsons[@]+"${jsons[@]}"} ${logs[@]+"${logs[@]}"}
echo "gpu_check: logs and JSON in $OUT; exit status $status"
exit "$status"
