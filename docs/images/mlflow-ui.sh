#!/usr/bin/env bash
# The MLflow UI screenshot of the experiment trackers page: `mlflow ui` on a copy of a matrix's SQLite store (on the
# loopback address, a free port), the runs listed with their perplexities, photographed by headless Chromium.
#   bash docs/images/mlflow-ui.sh [RESULTS_DIR] [PNG]
# RESULTS_DIR: a store written with --report-to mlflow (default results/smoke, after
# `rcpu-bench run --matrix smoke --report-to mlflow`); PNG: default docs/images/mlflow-ui.png. The copy gets a shared
# view (MLflow's viewStateShareKey: which columns the runs table shows); the store itself is not changed.
# Needs rcpu-bench with the mlflow extra, curl and Chromium (Debian: apt-get install -y chromium).
set -euo pipefail
results=$(realpath "${1:-results/smoke}")
png=$(realpath "${2:-docs/images/mlflow-ui.png}")
python=${PYTHON:-python}
work=$(mktemp -d)
cp "$results/mlflow.db" "$work/mlflow.db"
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url="http://127.0.0.1:$port"
MLFLOW_DISABLE_TELEMETRY=true setsid "$python" -m mlflow ui --backend-store-uri "sqlite:///$work/mlflow.db" \
    --host 127.0.0.1 --port "$port" >"$work/ui.log" 2>&1 &
server=$!
trap 'kill -- -$server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$work"' EXIT
until curl -sf "$url/health" >/dev/null; do
    kill -0 "$server" 2>/dev/null || { cat "$work/ui.log"; exit 1; }
    sleep 1
done
# The matrix's experiment (named by the matrix), and a shared view of it: sorted by the first perplexity, its columns
# the method, the ratio, the perplexities, the calibration perplexity, the fraction removed and the run's seconds.
page=$("$python" - "$results" "$url" <<'PY'
import json, sys, urllib.parse, urllib.request
from rcpu_bench.tracking.content import metric_key
results, url = sys.argv[1:]
with open(f"{results}/records.jsonl", encoding="utf-8") as store:
    entry = json.loads(store.readline())
query = urllib.parse.urlencode({"experiment_name": entry["cell"]["matrix"]})
with urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/get-by-name?{query}") as answer:
    experiment = json.load(answer)["experiment"]["experiment_id"]
metrics = [metric_key("ppl", p) for p in entry["cell"]["ppl_profiles"]]
metrics += ["ppl/calibration", "parameters/removed_fraction", "time/total"]
columns = [f"metrics.`{name}`" for name in metrics]
view = {"selectedColumns": ["attributes.`Run Name`", "params.`method_label`", "params.`prune.ratio`", *columns],
        "orderByKey": columns[0], "orderByAsc": True}
tag = {"experiment_id": experiment, "key": "mlflow.sharedViewState.docs", "value": json.dumps(view)}
request = urllib.request.Request(f"{url}/api/2.0/mlflow/experiments/set-experiment-tag", json.dumps(tag).encode(),
                                 {"Content-Type": "application/json"})
urllib.request.urlopen(request).close()
print(f"{url}/#/experiments/{experiment}/runs?viewStateShareKey=docs")
PY
)
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$work/chromium" --hide-scrollbars \
    --window-size=2400,1450 --virtual-time-budget=30000 --screenshot="$png" "$page" 2>"$work/chromium.log" \
    || { cat "$work/chromium.log"; exit 1; }
echo "$page photographed into $png"
