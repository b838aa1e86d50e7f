"""Every diagnostic threshold in one place, each with the public source it comes from (or "our choice").

Each source is public (papers, tools' docs and code). A name says what is compared with what: the same number
with two meanings (e.g. "70x" as a first/last-layer ratio and as growth over time) gets two names.
Pure constants: no imports, so any module (core, recorder, verbs) can use them.
"""

# ---- replay tolerance ------------------------------------------------------------------------------
# Megatron-Core's rerun machine: loss must match exactly; gradient norms within 1e-3 relative where
# kernels are nondeterministic.
REPLAY_RELATIVE_TOLERANCE = 1e-3

# ---- spikes and exploding growth over time ---------------------------------------------------------
SPIKE_FACTOR = 10.0  # Megatron-Core rerun machine: a spike is >= 10x the max |value| of the first 100 samples
SPIKE_BASELINE_SAMPLES = 100  # Megatron-Core: the first 100 samples
GRAD_NORM_TREND_EXPLODING_FACTOR = 10.0  # `replay nan`: fitted grad-norm growth over the window that counts as
#                                          exploding (Megatron-Core rerun state machine's spike factor)
GRAD_NORM_TREND_P = 0.01  # the rising trend must be significant (Chromium Pinpoint: p <= 0.01 is different)
LAYER_GRAD_GROWTH_EXPLODING = 70.0  # `replay diagnose`: a layer's grad norm grew > 70x its early level
#                                     (AUTOTRAINER's exploding ratio > 70, applied over time)
LAYER_GRAD_NORM_EXPLODING_MIN = 1.0  # `replay diagnose`: ... and ended >= 1.0, the clip_grad_norm default of
#                                      nanoGPT and Megatron-LM: growth from a tiny start to a small value
#                                      (0.000562 -> 0.058 under clip 0.25) is not an explosion. Calibrated on the
#                                      healthy test zoo (benchmarks/zoo_calibration.py)
DIVERGENCE_RISE = 1.5  # our choice: the loss ends >= 1.5x its untrained level: it diverged (no healthy zoo run
#                        rises at all); an exponential climb to a NaN is one divergence, not a run of spikes
SLOW_FALL_MAX = 0.10  # calibrated on the test zoo: "loss falls very slowly" = under 10% below its untrained level
#                       over the run (softmax-into-CE: 6%; the slowest healthy zoo run, the LSTM: >= 13%) ...
SLOW_GRAD_NORM_MAX = 0.1  # ... with small gradients: median grad norm < 0.1 (healthy transformers: 0.1-5) that
#                           do not grow (softmax's Jacobian shrinks them as the outputs saturate)

# ---- vanishing / exploding gradients across layers ---------------------------------------------------
GRAD_MEAN_ABS_VANISHING = 1e-7  # SageMaker Debugger, DeepDiagnosis: mean |g| < 1e-7 is a vanishing gradient
LAYER_GRAD_NORM_VANISHING = 1e-7  # `replay diagnose`: any layer whose grad *norm* < 1e-7 (mean |g| <= ||g||_2,
#                                   so a norm below the SageMaker/DeepDiagnosis bound is vanishing by their rule too)
FIRST_LAST_GRAD_RATIO_VANISHING = 1e-3  # AUTOTRAINER: first/last-layer grad-norm ratio < 1e-3 ...
FIRST_LAYER_GRAD_NORM_VANISHING = 1e-4  # ... with the first-layer norm < 1e-4 (AUTOTRAINER)
LAYER_TO_LARGEST_GRAD_RATIO_VANISHING = 1e-3  # `replay diagnose`: layer / largest-layer grad norm < 1e-3 ...
#                                               (AUTOTRAINER's first/last ratio, per layer over the run)
LAYER_GRAD_NORM_VANISHING_WITH_RATIO = 1e-4  # ... with the layer's norm < 1e-4 (AUTOTRAINER's first-layer norm)
FIRST_LAST_GRAD_RATIO_EXPLODING = 70.0  # AUTOTRAINER: first/last-layer grad-norm ratio > 70 is exploding
GRAD_NORM_SPAN_WARN_DECADES = 5.0  # our choice: per-layer grad norms spanning > 5 orders of magnitude
#                                    (healthy built-ins span < 3)

# ---- dead and saturated units --------------------------------------------------------------------------
DEAD_UNIT_ACTIVE = 0.01  # SageMaker Debugger dead_relu: a unit active (> 0) less than 1% of the time is dead
DEAD_LAYER_FAIL = 0.5  # SageMaker Debugger: a layer is flagged when > 50% of its units are dead
DEAD_LAYER_WARN = 0.3  # our choice: the healthy built-ins show 0-25% never-active units at PyTorch's default init
DEAD_LAYER_ZERO_FRACTION = 0.99  # `replay diagnose`: ReLU output zero >= 99% of the time (SageMaker: a unit active
#                                  < 1% of the time is dead; we log one zero fraction per layer, so >= 99% zeros
#                                  means the layer as a whole is dead)
RELU_ZERO_WARN = 0.7  # AUTOTRAINER: dying ReLU at >= 70% zeros (it counts zero gradients; a zero output has one)
RELU_ZERO_FAIL = 0.95  # our choice: 95% of a ReLU's outputs zero leaves too few units to learn through
SATURATION_PREACT = 5.0  # DeepDiagnosis: a tanh/sigmoid |pre-activation| beyond 5 is saturated (recorder and check)
SATURATION_FAIL = 0.5  # DeepDiagnosis: flagged when > 50% of the values are beyond +-5
SATURATION_WARN = 0.1  # our choice: a tenth of a layer saturated already slows learning
TANH_EXTREME = 9.5  # SageMaker Debugger: tanh saturated beyond +-9.5 ...
SIGMOID_EXTREME = (-23.0, 17.0)  # ... sigmoid below -23 or above 17 (SageMaker Debugger)

# ---- updates ---------------------------------------------------------------------------------------
UPDATE_RATIO_FAIL = (1e-8, 10.0)  # SageMaker Debugger: update/weight ratio ||dθ||/||θ|| outside [1e-8, 10] is pathological
UPDATE_RATIO_WARN = (1e-6, 1e-1)  # our choice: ~1e-3 is healthy (Karpathy, CS231n notes); Adam's first steps sit near 1e-2
LR_SUGGESTION_BAND = (30.0, 10.0)  # ours: an lr from 30x below to 10x above the LR range test's steepest-descent point is
#   fine (that point is an aggressive pick; fastai's own advice is often a tenth of the lowest-loss lr)
LR_DIVERGENCE_MARGIN = 3.0  # ours: an lr within 3x of where the range test's loss blew up is too high to train at

# ---- overfitting and plateaus ------------------------------------------------------------------------
OVERFIT_GAP = 0.1  # SageMaker Debugger overfit rule: (val - train) / train > 0.1 ...
OVERFIT_PATIENCE = 3  # ... for this many evaluations in a row (SageMaker: "with patience")
OVERFIT_RISE = 0.1  # validation 10% above its best: train down, val up after K (SageMaker Debugger overfit rule)
OVERFIT_TREND_P = 0.1  # ... rising as a trend since its best (Mann-Kendall p < 0.1), not noise around a floor
OVERFIT_ONE_BATCH_PASS = 0.05  # Karpathy, "A Recipe for Training Neural Networks": overfit one batch to the lowest
OVERFIT_ONE_BATCH_WARN = 0.5  # achievable loss. Ours: pass within 5% of the initial gap to the floor, warn within 50%
OVERFIT_ONE_BATCH_LEARNS = 0.2  # ours: 80% of the way down already shows the model and loss learn (a pass, still falling)
PLATEAU_MIN_LEVEL = 0.5  # calibrated: a plateau sits at >= half the untrained loss (healthy built-in runs end <= 0.34x)
PLATEAU_MIN_SHARE = 0.4  # calibrated: ... and has lasted >= 40% of the run (healthy runs flatten only near their end)
PLATEAU_TREND_SE = 1.0  # calibrated: no decrease across it beyond 1 standard error (noisy synthetic curves)
PLATEAU_TREND_P = 0.2  # calibrated: no downward Mann-Kendall trend at p < 0.2 (0/200 false plateaus)

# ---- inputs and data -----------------------------------------------------------------------------------
INPUT_BOUND_SHARE = 0.5  # TensorFlow Profiler guide ("input-bound"): data_time >= step_time means the step waits on input ...
INPUT_BOUND_MIN_SECONDS = 1e-3  # ... and at least 1 ms a batch: below that input time is noise (our choice)
INPUT_STD_WARN = (1e-3, 10.0)  # LeCun et al., "Efficient BackProp": normalise inputs to ~unit variance; the band is ours
INPUT_ABS_WARN = 1e3  # our choice: raw values in the thousands swamp the initialization scale
IMBALANCE_WARN = 10.0  # our choice: the most common class 10x the rarest (a common "imbalanced" cut-off)
CLASS_BALANCE_MAX_CLASSES = 100  # ours: balance is judged on a few classes; more is a vocabulary or a fine label set
CLASS_BALANCE_MIN_EXPECTED = 5.0  # Cochran's rule for chi-square tests: at least 5 expected samples per class
CLASS_BALANCE_P = 1e-3  # ours: ... and the imbalance is no sampling noise (chi-square goodness of fit to uniform)
DIVERSITY_FAIL = 0.5  # our choice: batches hold under half the classes a shuffled batch would
DIVERSITY_WARN = 0.8  # our choice: under 80%; shuffled batches of the built-ins sit at 0.95-1.0
INIT_LOSS_WARN = 1.5  # Karpathy's recipe: expect ln(C) at init; 1.5x is ours (healthy built-ins sit within 5% of it)
PROB_ROW_TOL = 1e-3  # our choice: loss-input rows summing to 1 within this count as probabilities
#                      (softmax fed into cross-entropy: PyTorch CrossEntropyLoss expects unnormalized logits)

# ---- LR range test (Smith 2017, "Cyclical Learning Rates"; Lightning, fastai, torch-lr-finder) --------------
LR_FINDER_MIN = 1e-7  # start at 1e-7..1e-8 (Lightning min_lr=1e-8, fastai start_lr=1e-7)
LR_FINDER_MAX = 10.0  # end at 1..10 (fastai end_lr=10, Lightning max_lr=1)
LR_FINDER_STEPS = 100  # ~100 steps (Lightning num_training=100, fastai num_it=100)
LR_FINDER_SMOOTHING = 0.05  # new = 0.05*loss + 0.95*previous (torch-lr-finder smooth_f=0.05)
LR_FINDER_DIVERGE_FACTOR = 4.0  # stop when the smoothed loss > 4x the best (Lightning early_stop_threshold=4)
LR_FINDER_SKIP_BEGIN = 10  # the suggestion skips the first 10 points (Lightning skip_begin=10)
LR_FINDER_SKIP_END = 5  # ... and the last 5 (torch-lr-finder skip_end=5)
