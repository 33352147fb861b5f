#!/bin/bash
# `tuneforge prepare` of data_at_scale.py's 3 M-row corpus (1.43 GB of jsonl) inside a memory cgroup limited to 1 GiB
# (cgroup v1, page cache included): the code before (a clone at 35e5311 in /work/old) and after (/work/main). Needs
# root, the corpus and config from data_at_scale.py (generate(..., 3000000), config_file(...) into /tmp/capped):
#   mkdir /sys/fs/cgroup/memory/tfcap && echo 1073741824 > /sys/fs/cgroup/memory/tfcap/memory.limit_in_bytes
CG=/sys/fs/cgroup/memory/tfcap
for which in before after; do
  src=/work/main/src; [ $which = before ] && src=/work/old/src
  rm -rf /tmp/capped/cache
  echo 0 > $CG/memory.max_usage_in_bytes 2>/dev/null
  oom0=$(grep oom_kill $CG/memory.oom_control | awk '$1=="oom_kill"{print $2}')
  start=$(date +%s)
  sh -c "echo \$\$ > $CG/cgroup.procs; PYTHONPATH=$src exec /work/main/.venv/bin/python -m tuneforge.cli prepare /tmp/capped/config-3000000.yaml --num-workers 2 --json" > /tmp/capped/$which.out 2> /tmp/capped/$which.err
  rc=$?
  oom1=$(grep oom_kill $CG/memory.oom_control | awk '$1=="oom_kill"{print $2}')
  echo "$which rc=$rc wall=$(( $(date +%s)-start ))s max_usage=$(( $(cat $CG/memory.max_usage_in_bytes) >> 20 ))MiB limit=$(( $(cat $CG/memory.limit_in_bytes) >> 20 ))MiB oom_kills=$((oom1-oom0))" | tee -a /tmp/capped/summary.txt
done
