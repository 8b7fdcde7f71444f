#!/bin/bash
# Runs on the GPU machine: records the PyTorch script in both allocator modes.
# Usage (as root, on a machine with a GPU and PyTorch; memtrace copied to .device/memtrace):
#   OUT=/some/dir xtask/gpu/run.sh
cd "$(dirname "$0")/../.."
PY=$(command -v python3 || command -v python)
M=.device/memtrace
{ uname -r; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; $PY -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda)'; ls -la /sys/kernel/btf/vmlinux; } > $OUT/machine.txt 2>&1
for mode in default expandable; do
  if [ $mode = expandable ]; then export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; fi
  s=$(date +%s.%N); $PY xtask/gpu/torch_gpu.py > $OUT/plain-$mode.txt 2>&1; e=$(date +%s.%N)
  echo "plain $mode $(echo "$e - $s" | bc)" >> $OUT/times.txt
  s=$(date +%s.%N); MEMTRACE_LOG=debug $M record -o $OUT/$mode.data -- $PY xtask/gpu/torch_gpu.py > $OUT/rec-$mode.txt 2> $OUT/rec-$mode.err; e=$(date +%s.%N)
  echo "record $mode $(echo "$e - $s" | bc) rc=$?" >> $OUT/times.txt
  $M report -i $OUT/$mode.data --format json > $OUT/$mode.json 2>$OUT/$mode.json.err
  $M report -i $OUT/$mode.data --domain gpu --by function > $OUT/$mode.txt 2>&1
  $M report -i $OUT/$mode.data --domain gpu --by stack --top 8 > $OUT/$mode-stacks.txt 2>&1
  rm -f $OUT/$mode.data
done
grep -h "uprobes attach\|CUDA driver" $OUT/rec-*.err | sort | uniq -c > $OUT/attach.txt
cat $OUT/machine.txt $OUT/times.txt $OUT/attach.txt; grep -h TORCH_STATS $OUT/*.txt
