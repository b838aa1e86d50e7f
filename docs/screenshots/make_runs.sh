set -e
# The runs behind docs/screenshots: a healthy run, two failed ones triaged by `replay watch --once` (nan, then
# ablate, as the service does), a diagnosis and a check. Then: mlflow server on /tmp/uidemo/mlflow.db, take_screenshots.py.
cd /tmp && rm -rf uidemo && mkdir uidemo && cd uidemo && . /work/main/.venv/bin/activate && export OMP_NUM_THREADS=1 && E=/work/main/examples
ROOT=$([ "$(id -u)" = 0 ] && echo --allow-root || true)
replay train train.steps=200 --json 2>/dev/null > ok.json
replay train --config-dir $E/nan_forward --json 2>/dev/null > nf.json || true
replay train --config-dir $E/ablate_lr_explosion --json 2>/dev/null > lr.json || true
NF=$(python -c "import json;print(json.load(open('nf.json'))['run_id'])"); LR=$(python -c "import json;print(json.load(open('lr.json'))['run_id'])"); OK=$(python -c "import json;print(json.load(open('ok.json'))['run_id'])")
echo $NF $LR $OK > ids
replay watch --once $ROOT --settle 0.2 --horizon 40 --code-dir $E/nan_forward --code-dir $E/ablate_lr_explosion > watch.log 2>&1
replay diagnose --run-id $OK > /dev/null 2>&1
replay check --run-id $LR --code-dir $E/ablate_lr_explosion > /dev/null 2>&1 || true
