#!/bin/bash
# How these reports were made: /tmp/wt-old is a git worktree of eeb2b6f (runs timed one after the other),
# /tmp/wt-new one of 69e055d or later (lockstep); the reports were then copied here.
export TIKTOKEN_CACHE_DIR=/tmp/tk
for i in 1 2; do
  for v in old new; do
    cd /tmp/wt-$v
    python -m benchmarks.batch_speed --new-tokens 48 --prompt-len 16 --gammas 1 2 4 --batch-sizes 1 2 4 8 --step-batches 1 2 8 --repeats 3 --out /tmp/batch-cmp/$v-$i > /tmp/batch-cmp-$v-$i.log 2>&1
    echo "$v $i $(date +%T)"
  done
done
