#!/bin/bash
# How these reports were made: /tmp/wt-old is a git worktree of eeb2b6f (runs timed one after the other),
# /tmp/wt-new one of 69e055d or later (lockstep); the reports were then copied here.
export TIKTOKEN_CACHE_DIR=/tmp/tk
while pgrep -f "benchmarks.tree_speed" > /dev/null; do sleep 5; done
for v in old new; do
  cd /tmp/wt-$v
  python -m benchmarks.decode_speed --models gpt2-large --busy 1 --ks 5 --long 0 --repeats 8 --warmup 1 --gen 100 --no-transformers --out /tmp/busy-cmp/$v > /tmp/busy-cmp-$v.log 2>&1
  echo "$v $(date +%T)"
done
