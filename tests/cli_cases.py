"""Bad command lines both front doors refuse in the same words: e2e/test_cli_errors.py runs each through the installed
`replay` (one line, exit 2, nothing created), unit/test_requests.py through `replaybisect.cli` and the Python
function in this process."""

LONG_KEY = "k" * 300  # Hydra looks a `+key=` up as a file name: "File name too long"
LONG_VALUE = "x" * 10_000
BROKEN_YAML = "defaults: [{model: mlp}, {data: digits}, {optim: adamw}]\nseed: [1\n"

# (id, arguments, fragments the error line must contain)
USAGE = [
    ("unknown-verb", ["nann"], ["No such command 'nann'", "Did you mean 'nan'", "replay --help"]),
    ("unknown-root-option", ["--bogus"], ["No such option: --bogus", "replay --help"]),
    ("train-option-needs-value", ["train", "--run-name"], ["--run-name", "requires an argument", "replay train --help"]),
    ("runs-limit-not-int", ["runs", "--limit", "abc"], ["--limit", "valid integer", "replay runs --help"]),
    ("runs-limit-zero", ["runs", "--limit", "0"], ["--limit", "1 to 50000"]),
    ("runs-limit-over-mlflow-cap", ["runs", "--limit", "50001"], ["--limit", "1 to 50000"]),
    ("runs-status-unknown", ["runs", "--status", "bogus"], ["--status 'bogus'", "ok, nonfinite, crashed"]),
    ("runs-kind-unknown", ["runs", "--kind", "bogus"], ["--kind 'bogus'", "train, replay, ablation-arm", "all"]),
    ("runs-unknown-option", ["runs", "--bogus"], ["No such option: --bogus", "replay runs --help"]),
    ("nan-missing-run-id", ["nan"], ["Missing option '--run-id'", "replay nan --help"]),
    ("nan-run-id-without-value", ["nan", "--run-id"], ["--run-id", "requires an argument", "replay nan --help"]),
    ("nan-negative-step", ["nan", "--run-id", "x", "--step", "-1"], ["--step", "greater than or equal to 0"]),
    ("nan-step-not-int", ["nan", "--run-id", "x", "--step", "one"], ["--step", "valid integer"]),
    ("diagnose-missing-run-id", ["diagnose"], ["Missing option '--run-id'", "replay diagnose --help"]),
    ("diagnose-extra-argument", ["diagnose", "--run-id", "x", "extra"], ["extra", "replay diagnose --help"]),
    ("ablate-horizon-without-value", ["ablate", "lr", "--run-id", "x", "--horizon"], ["--horizon", "requires an argument", "replay ablate --help"]),
    ("ablate-horizon-huge", ["ablate", "lr", "--run-id", "x", "--horizon", "10000001"], ["--horizon", "less than or equal to 1000000"]),
    ("ablate-workers-huge", ["ablate", "lr", "--run-id", "x", "--workers", "100000"], ["--workers", "less than or equal to 256"]),
    ("ablate-gpus-negative", ["ablate", "lr", "--run-id", "x", "--gpus", "-1"], ["--gpus", "greater than or equal to 0"]),
    ("ablate-mem-not-number", ["ablate", "lr", "--run-id", "x", "--mem-gb", "lots"], ["--mem-gb"]),
    ("bisect-missing-good", ["bisect"], ["Missing argument 'good'", "replay bisect --help"]),
    ("bisect-missing-bad", ["bisect", "v1"], ["Missing argument 'bad'", "replay bisect --help"]),
    ("bisect-steps-zero", ["bisect", "a", "b", "--steps", "0"], ["--steps", "1 to 1000000"]),
    ("bisect-steps-huge", ["bisect", "a", "b", "--steps", "100000000000000000000"], ["--steps", "1 to 1000000"]),
    ("bisect-seeds-zero", ["bisect", "a", "b", "--seeds", "0"], ["--seeds", "1 to 100"]),
    ("bisect-seeds-huge", ["bisect", "a", "b", "--seeds", "1000"], ["--seeds", "1 to 100"]),
    ("bisect-max-seeds-zero", ["bisect", "a", "b", "--max-seeds", "0"], ["--max-seeds", "1 to 300"]),
    ("bisect-workers-zero", ["bisect", "a", "b", "--workers", "0"], ["--workers", "1 to 256"]),
    ("bisect-workers-huge", ["bisect", "a", "b", "-w", "100000"], ["--workers", "1 to 256"]),
    ("bisect-threshold-nan", ["bisect", "a", "b", "--threshold", "nan"], ["--threshold nan must be a finite number"]),
    ("check-overfit-steps-zero", ["check", "--overfit-steps", "0"], ["--overfit-steps", "1 to 1000000", "replay check --help"]),
    ("check-overfit-steps-huge", ["check", "--overfit-steps", "1000000000"], ["--overfit-steps", "1 to 1000000"]),
    ("check-overfit-samples-one", ["check", "--overfit-samples", "1"], ["--overfit-samples", "2 to 32"]),
    ("check-lr-steps-float", ["check", "--lr-steps", "1e20"], ["--lr-steps", "valid integer"]),
    ("check-lr-steps-huge", ["check", "--lr-steps", "100000000000000000000"], ["--lr-steps", "2 to 1000000"]),
    ("check-only-unknown", ["check", "--only", "bogus"], ["unknown check bogus", "choose from"]),
    ("nan-device-unknown", ["nan", "--run-id", "x", "--device", "bogus"], ["'bogus' is not a device"]),
    ("check-lr-min-nan", ["check", "--lr-min", "nan"], ["--lr-min nan", "finite"]),
    ("check-lr-max-inf", ["check", "--lr-max", "inf"], ["--lr-max inf", "finite"]),
]

# Config values, through both verbs that compose a config.
CONFIG = [
    ("lr-not-number", ["optim.lr=abc"], ["optim.lr='abc' is not a number"]),
    ("lr-negative", ["optim.lr=-1"], ["cannot build `optim`", "Invalid learning rate: -1"]),
    ("closure-optimizer-fp16", ["optim._target_=torch.optim.LBFGS", "~optim.weight_decay", "train.precision=fp16"], ["LBFGS", "re-evaluates the loss", "bf16"]),
    ("accumulate-uneven", ["train.batch_size=10", "train.accumulate=4"], ["train.batch_size=10", "train.accumulate=4", "multiple"]),
    ("yaml-syntax", ["--config-dir", "conf", "--config-name", "broken"], ["YAML syntax error", "broken.yaml line 3"]),
    ("long-override-key", [f"+{LONG_KEY}=1"], ["File name too long", "chars); check the overrides"]),
    ("long-override-value", [f"train.steps={LONG_VALUE}"], ["train.steps=xxx", "(10012 chars)"]),
    ("threads-absurd", ["train.num_threads=100000"], ["train.num_threads=100000", "between 1 and 1024"]),
    ("val-batches-negative", ["train.val_batches=-1"], ["train.val_batches=-1 must be positive"]),
    ("clip-nan", ["train.clip_grad_norm=nan"], ["train.clip_grad_norm=nan"]),
    ("seed-out-of-range", [f"seed={2**70}"], [f"seed={2**70}", "seed range"]),
    ("config-dir-a-file", ["--config-dir", "conf/broken.yaml"], ["conf/broken.yaml is a file, not a folder", "--config-dir"]),
]

