#!/bin/bash
# The GPU checks, in one call of a lent GPU machine (about 11 minutes; the machine has torch, Lightning and
# transformers but no datasets or TRL, and no network). Here, first: `make gpu-wheels` (fills .whl/, ignored by
# git); then run this script there from the repository root with `.whl` carried. What it does:
#   1. installs the carried wheels (datasets, TRL 1.16 and their missing dependencies) into /tmp/site;
#   2. tests/gpu (FSDP2 + transformers rollouts in bfloat16, GRPO and PPO);
#   3. PPO on the demo model with the third step profiled (profile_rank0.txt: ops by host, then by GPU time);
#   4. episodes of the tool task (issue 33): 4 GRPO steps, transformers engine on the GPU, bf16;
#   5. bench.py --accelerator gpu: ours (one process, transformers rollouts) against TRL on the small model
#      (bf16, fp32) and the 100M model (bf16);
#   6. LoRA (issue 34) against full fine-tuning on the 100M model, bf16, a KL term (the reference: its own copy, or
#      the base with adapters off): peak GPU memory and step time of each.
#   7. handoff (issue 44): every weight hand-off on CUDA fingerprinted (FSDP2 -> transformers engine, bf16), a lost
#      tensor failing its step; the check's share of the step;
#   8. learn (issue 44): the demo with transformers' generate in bf16, 100 steps, gain >= 0.3.
#   9. size (issue 45): a GRPO-style actor step (forward + backward) of Qwen2.5-0.5B's shape at its full 24 layers
#      (random weights, built here), bf16, one row of 66 prompt + 512 / 2048 / 8192 response tokens, activation
#      checkpointing off/on x the blocked token head off/on: peak max_memory_allocated and step time of each (OOM
#      reported, not fatal; benchmarks/bench_token_head.py), size.txt; with 2+ GPUs also SP 1 against SP 2 at 8192
#      tokens (benchmarks/bench_sequence_parallel.py, size_sp1.txt / size_sp2.txt), else says why not (size_sp.txt).
#  10. partial (issue 46): partial rollouts on CUDA: the transformers engine's generate interrupted by a pause, the
#      requests going on after it from their tokens (tests/gpu/test_gpu_partial.py): partial.txt.
#  11. distill (issue 47): on-policy distillation on CUDA, bf16: the demo's warm start taught by a random model of the
#      same vocabulary (tests/scripts/train.py --algo distill), 4 steps: distill_metrics.csv, the reverse KL per step.
#  12. vision (issue 47): a tiny Qwen2-VL on CUDA, bf16, transformers' engine: 4 GRPO steps of the visual task with
#      images (tests/scripts/train.py --task vision): vision_metrics.csv. Needs torchvision on the machine.
# PARTS="handoff learn" (names: tests profile tools bench lora handoff learn size partial distill vision) runs only those; all by
# default.
# Every part has its own time limit; logs and tables go to $OUT (the device tool's folder), or ./gpu_out.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PARTS=${PARTS:-tests profile tools bench lora handoff learn size partial distill vision}
want() { [[ " $PARTS " == *" $1 "* ]]; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
if ! python3 -c "import matplotlib" 2>/dev/null; then  # the demo's plots
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/plots/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 WANDB_MODE=offline PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, lightning, datasets, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'lightning', lightning.__version__, 'trl', trl.__version__)"
step() {  # step NAME SECONDS COMMAND...: run, print the exit code and the time, keep the log
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - t0 )) s"
}
if want tests; then
  step gpu_tests 170 python3 -m pytest -q tests/gpu -p no:cacheprovider --deselect tests/gpu/test_gpu_learns.py
  tail -3 "$OUT/gpu_tests.txt"
fi
if want handoff; then
  step gpu_handoff 120 python3 -m pytest -q tests/gpu/test_gpu_handoff.py -p no:cacheprovider --basetemp=/tmp/pt_handoff
  tail -3 "$OUT/gpu_handoff.txt"
  python3 benchmarks/verify_share.py /tmp/pt_handoff/*0/metrics.csv | tee "$OUT/handoff_verify_share.txt"
  python3 -c "import sys; sys.path.insert(0, 'benchmarks/vs_trl'); import bench; bench.build_models('/tmp/vs_trl', ['m100'])"
  step handoff_m100 120 python3 tests/scripts/train.py --model /tmp/vs_trl/m100 --out /tmp/handoff_m100 --accelerator gpu \
    --devices 1 --bf16 --rollout hf --steps 6 --prompts 16 --n 4 --micro-batch-size 16
  python3 benchmarks/verify_share.py /tmp/handoff_m100/metrics.csv | tee -a "$OUT/handoff_verify_share.txt"
fi
if want learn; then
  step gpu_learn 260 python3 -m pytest -q tests/gpu/test_gpu_learns.py -p no:cacheprovider --basetemp=/tmp/pt_learn
  tail -3 "$OUT/gpu_learn.txt"
  for f in /tmp/pt_learn/*/runs/*/*/metrics.csv; do cp "$f" "$OUT/learn_metrics.csv"; done
  python3 benchmarks/verify_share.py "$OUT/learn_metrics.csv" | tee "$OUT/learn_verify_share.txt"
fi
if want size; then  # about 1-2 minutes: the model is built and loaded once, 12 measurements of 3 passes
  step size 150 python3 benchmarks/bench_token_head.py --device cuda --dtype bf16 --layers 24 --rows 1 \
    --resp-len 512,2048,8192 --activation-checkpointing both --passes train --repeats 2 --threads 8
  grep -v "Loading weights" "$OUT/size.txt" | tail -16
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "${NGPU:-0}" -ge 2 ]; then
    for sp in 1 2; do
      step "size_sp$sp" 120 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_sequence_parallel.py \
        --device cuda --bf16 --family qwen2.5-0.5b --layers 24 --sp "$sp" --tokens 8192 --checkpointing
      grep '^{' "$OUT/size_sp$sp.txt"
    done
  else
    echo "size: SP 2 needs two GPUs; this machine has ${NGPU:-0}, so SP 1 vs SP 2 is skipped" | tee "$OUT/size_sp.txt"
  fi
fi
if want partial; then  # under a minute
  step partial 60 python3 -m pytest -q tests/gpu/test_gpu_partial.py -p no:cacheprovider
  tail -3 "$OUT/partial.txt"
fi
if want distill; then  # under a minute
  STUDENT=$(python3 -c "from lightning_rlhf.demo import prepare_demo_model; print(prepare_demo_model('/tmp/cache'))" 2>/dev/null | tail -1)
  TEACHER=$(python3 -c "from lightning_rlhf.demo import save_tiny; print(save_tiny('/tmp/teacher', seed=1))" 2>/dev/null | tail -1)
  step distill 90 python3 tests/scripts/train.py --model "$STUDENT" --teacher "$TEACHER" --algo distill --out /tmp/distill \
    --accelerator gpu --devices 1 --bf16 --steps 4
  cp /tmp/distill/metrics.csv "$OUT/distill_metrics.csv" 2>/dev/null
  python3 -c "import csv; print([(r['step'], r.get('distill/reverse_kl'), r.get('timing_s/step')) for r in csv.DictReader(open('/tmp/distill/metrics.csv'))])" 2>/dev/null
fi
if want vision; then  # under a minute
  VLM=$(python3 -c "from lightning_rlhf.demo.tiny_vlm import save_tiny_vlm; print(save_tiny_vlm('/tmp/vlm'))" 2>/dev/null | tail -1)
  step vision 90 python3 tests/scripts/train.py --model "$VLM" --task vision --out /tmp/vision --accelerator gpu \
    --devices 1 --bf16 --steps 4
  cp /tmp/vision/metrics.csv "$OUT/vision_metrics.csv" 2>/dev/null
fi
want profile || want tools || want bench || want lora || exit 0
MODEL=$(python3 -c "from lightning_rlhf.demo import prepare_demo_model; print(prepare_demo_model('/tmp/cache'))" 2>/dev/null | tail -1)
want profile && step ppo_profile 90 python3 tests/scripts/train.py --model "$MODEL" --out /tmp/ppo --accelerator gpu --devices 1 \
  --bf16 --algo ppo --n 1 --steps 4 --kl-coef 0.01 --profile-step 2
cp /tmp/ppo/profile_rank0.txt /tmp/ppo/metrics.csv "$OUT/" 2>/dev/null
head -20 "$OUT/profile_rank0.txt" 2>/dev/null
TOOLS=$(python3 -c "from lightning_rlhf.demo.warmstart import prepare_tool_model; print(prepare_tool_model('/tmp/cache'))" 2>/dev/null | tail -1)
want tools && step tool_episodes 120 python3 tests/scripts/train.py --model "$TOOLS" --out /tmp/tools --accelerator gpu --devices 1 \
  --bf16 --task tools --rollout hf --prompts 16 --n 8 --micro-batch-size 32 --steps 4
cp /tmp/tools/metrics.csv "$OUT/tool_episodes_metrics.csv" 2>/dev/null
python3 -c "import csv; r=list(csv.DictReader(open('/tmp/tools/metrics.csv')))[-1]; print({k: r[k] for k in r if k.startswith(('timing_s/step', 'timing_s/gen', 'rollout/turns', 'rollout/tool_calls', 'critic/score'))})" 2>/dev/null
BENCH=(python3 benchmarks/vs_trl/bench.py --accelerator gpu --trl-python "$(command -v python3)" --configs hf1
  --ref no --repeats 1 --steps 8 --quiet-wait 3 --timeout 80)
want bench && step bench_small 200 "${BENCH[@]}" --models small --precisions bf16,fp32 --out-dir /tmp/b1
want bench && step bench_m100 130 "${BENCH[@]}" --models m100 --precisions bf16 --out-dir /tmp/b2
tail -c 1500 "$OUT/bench_small.txt"; tail -c 800 "$OUT/bench_m100.txt"
want lora && for run in full lora; do
  extra=(); [ "$run" = lora ] && extra=(--lora-rank 16)
  step "lora_$run" 60 python3 tests/scripts/train.py --model "$HOME/.cache/lightning_rlhf/vs_trl/m100" --out "/tmp/lora_$run" --accelerator gpu \
    --devices 1 --bf16 --kl-coef 0.05 --steps 6 --prompts 16 --n 4 --micro-batch-size 16 "${extra[@]}"
  python3 -c "import csv; r=list(csv.DictReader(open('/tmp/lora_$run/metrics.csv'))); print('$run', max(float(x['perf/max_memory_allocated_gb']) for x in r if x.get('perf/max_memory_allocated_gb')), r[-1].get('timing_s/step'), r[-1].get('timing_s/update_actor'), r[-1].get('timing_s/update_weights'))" 2>/dev/null
done
