#!/bin/bash
# How these reports were made: /tmp/wt-old is a git worktree of eeb2b6f (runs timed one after the other),
# /tmp/wt-new one of 69e055d or later (lockstep); the reports were then copied here.
export TIKTOKEN_CACHE_DIR=/tmp/tk
mkdir -p /tmp/gs-cmp
for i in 1 2 3; do
  for v in old new; do
    cd /tmp/wt-$v
    python -m benchmarks.gamma_sweep --random-weights --simulate-acceptance 0.8 --gamma 4 --max-gen 200 --prompts 2 --repeats 3 --component-calls 5 --no-progress --out /tmp/gs-cmp/$v-$i > /tmp/gs-cmp/$v-$i.log 2>&1
    echo "$v $i $(date +%T) $(grep '^| 200' /tmp/gs-cmp/$v-$i/sweep.md | cut -d'|' -f5)"
  done
done
