set -e
cd /tmp && rm -rf uidemo && mkdir uidemo && cd uidemo && . /work/main/.venv/bin/activate && export OMP_NUM_THREADS=1 && E=/work/main/examples
replay train train.steps=200 --json 2>/dev/null > ok.json
replay train --config-dir $E/nan_forward --json 2>/dev/null > nf.json || true
replay train --config-dir $E/ablate_lr_explosion --json 2>/dev/null > lr.json || true
NF=$(python -c "import json;print(json.load(open('nf.json'))['run_id'])"); LR=$(python -c "import json;print(json.load(open('lr.json'))['run_id'])"); OK=$(python -c "import json;print(json.load(open('ok.json'))['run_id'])")
echo $NF $LR $OK > ids
replay nan --run-id $NF --code-dir $E/nan_forward > /dev/null 2>&1
replay ablate lr,clip --run-id $NF --code-dir $E/nan_forward --horizon 20 >/dev/null 2>&1
replay nan --run-id $LR --code-dir $E/ablate_lr_explosion > /dev/null 2>&1
replay ablate lr,warmup --run-id $LR --code-dir $E/ablate_lr_explosion --horizon 40 >/dev/null 2>&1
replay ablate lr,clip,precision --run-id $LR --code-dir $E/ablate_lr_explosion --horizon 40 >/dev/null 2>&1
replay diagnose --run-id $OK > /dev/null 2>&1
replay diagnose --run-id $LR > /dev/null 2>&1
