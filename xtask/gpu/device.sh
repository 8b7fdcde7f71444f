#!/bin/bash
# One device run (a lent machine with many CPUs and a GPU, as root): what memtrace does
# there, written down in BENCHMARKS.md with the machine named. Nothing in CI runs it.
# Needs, carried in .device/ (ignored): memtrace (stripped release build), alloc_workload,
# heavy.py (the heavy bench's script) and heaptrack/ (Debian's heaptrack with its libraries:
# bin/, lib/heaptrack/, deps/). Every step has its own time limit; the summary grows line by
# line in $OUT/summary.txt and the logs are packed into $OUT/logs.tgz after every step.
#   OUT=/some/dir xtask/gpu/device.sh [parts...]   (parts: info start gpu heavy torch loop rerun round3 round4 round5 floor writer torchab report overload cold warm ab)
cd "$(dirname "$0")/../.."
D=$PWD/.device
M=$D/memtrace
PY=${PY:-$(command -v python3)}
L=/tmp/mt-logs; mkdir -p $L
T=/tmp/mt-data; mkdir -p $T
export MEMTRACE_CACHE_DIR=/tmp/mt-cache
S=$OUT/summary.txt
say() { echo "$*" | tee -a $S; }
pack() { tar czf $OUT/logs.tgz -C $L . 2>/dev/null; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.2f", b-a}'; }
# The head of a recording's JSON report, one line.
summ() {
  $M report --format json --top 1 -i "$1" > $L/$2.json 2>$L/$2.json.err
  $PY - $L/$2.json <<'PYEOF'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except Exception as e:
    print("  report:", e); sys.exit()
u = j.get("stacks", {}).get("user", {}); k = j.get("stacks", {}).get("kernel", {}); r = j.get("recorder", {})
w = u.get("allocs_with_stack") or 0; c = u.get("allocs_truncated") or 0
kw = k.get("allocs_with_stack") or 0; kc = k.get("allocs_truncated") or 0
t = j.get("totals", {})
dom = " ".join(f"{d}:{v.get('allocs')}/{v.get('frees')}" for d, v in t.items() if isinstance(v, dict))
print(f"  allocs(domain:allocs/frees) {dom}; user cut short {c}/{w} ({100*c/max(w,1):.2f} %); kernel cut short {kc}/{kw};"
      f" python {u.get('allocs_with_python')}; lost {j.get('lost_events')}; copies {r.get('unwind_copies')};"
      f" cpu {(r.get('cpu_ns') or 0)/1e9:.1f} s; peak RSS {(r.get('peak_rss_bytes') or 0)/1e6:.0f} MB;"
      f" maps {(r.get('bpf_map_bytes') or 0)/1e6:.0f} MB; warnings {len(j.get('warnings', []))}")
for wn in j.get("warnings", [])[:6]:
    print("   warn:", str(wn)[:300])
PYEOF
}
# rec NAME LIMIT [record args...] -- CMD: timed memtrace record, then its summary.
rec() {
  local name=$1 lim=$2; shift 2
  local s=$(now)
  MEMTRACE_LOG=debug timeout -s INT $lim $M record -q --force -o $T/$name.data "$@" > $L/$name.out 2> $L/$name.err
  local rc=$?
  say "$name: $(since $s) s rc=$rc $(ls -l $T/$name.data 2>/dev/null | awk '{printf "%.2f MB", $5/1e6}')"
  summ $T/$name.data $name | tee -a $S
  grep -h "TORCH_\|ns/pair" $L/$name.out | head -3 | sed 's/^/  out: /' | tee -a $S
}
bare() {
  local name=$1 lim=$2; shift 2
  local s=$(now)
  timeout $lim "$@" > $L/$name.out 2> $L/$name.err
  local rc=$?
  say "$name: $(since $s) s rc=$rc $(grep -h 'TORCH_\|ns/pair' $L/$name.out | head -2 | tr '\n' ' ')"
}
# rec with the previous build ($D/memtrace-old) and a table cache of its own.
oldrec() { local M0=$M; M=$D/memtrace-old; MEMTRACE_CACHE_DIR=/tmp/mt-cache-old rec "$@"; M=$M0; }
heaptrack_run() {
  local name=$1 lim=$2; shift 2
  local s=$(now)
  LD_LIBRARY_PATH=$D/heaptrack/deps timeout $lim $D/heaptrack/bin/heaptrack -o $T/$name "$@" > $L/$name.out 2> $L/$name.err
  local rc=$?
  say "$name: $(since $s) s rc=$rc $(grep -h 'TORCH_\|ns/pair' $L/$name.out | head -1)"
  local f=$(ls $T/$name.* 2>/dev/null | head -1)
  LD_LIBRARY_PATH=$D/heaptrack/deps $D/heaptrack/bin/heaptrack_print -f "$f" --print-peaks=0 --print-allocators=0 --print-temporary=0 2>&1 | grep "calls to allocation\|peak heap" | sed 's/^/  /' | tee -a $S
}
parts=${*:-info start gpu torch heavy loop}
for part in $parts; do
  say "== $part $(date +%T)"
  case $part in
  info)
    { uname -a; nproc; free -g | head -2; $PY --version; $PY -c 'import torch,numpy,pandas,pyarrow;print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), "numpy", numpy.__version__, "pandas", pandas.__version__, "pyarrow", pyarrow.__version__)';
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; ls -la /sys/kernel/btf/vmlinux; mount | grep -E 'tracefs|debugfs|bpf'; ulimit -l; ls /usr/lib/x86_64-linux-gnu/libcuda.so* 2>&1 | head -3; cat /proc/sys/kernel/perf_event_paranoid; } 2>&1 | tee -a $S ;;
  start)
    for i in 1 2 3; do rec true$i 30 -- /bin/true; done ;;
  gpu)
    for mode in default expandable; do
      if [ $mode = expandable ]; then export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; fi
      bare gpu-bare-$mode 60 $PY xtask/gpu/torch_gpu.py
      grep -h TORCH_STATS $L/gpu-bare-$mode.out | tee -a $S
      rec gpu-$mode 100 -- $PY xtask/gpu/torch_gpu.py
      grep -h TORCH_STATS $L/gpu-$mode.out | tee -a $S
      $M report -i $T/gpu-$mode.data --domain gpu --by function --top 12 > $L/gpu-$mode-fn.txt 2>&1
      $M report -i $T/gpu-$mode.data --domain gpu --by stack --top 6 > $L/gpu-$mode-stacks.txt 2>&1
      head -40 $L/gpu-$mode-fn.txt >> $S
      grep -h "uprobes attach\|CUDA\|cuda" $L/gpu-$mode.err | head -8 | sed 's/^/  log: /' | tee -a $S
    done
    unset PYTORCH_CUDA_ALLOC_CONF ;;
  heavy)
    for i in 1 2; do bare heavy-bare$i 60 $PY $D/heavy.py; done
    heaptrack_run heavy-heaptrack 120 $PY $D/heavy.py
    rec heavy-cold 120 -- $PY $D/heavy.py
    rec heavy-warm1 120 -- $PY $D/heavy.py
    rec heavy-warm2 120 -- $PY $D/heavy.py
    rec heavy-fp 120 --call-graph fp -- $PY $D/heavy.py
    grep -h "table\|unwind" $L/heavy-cold.err | tail -6 | sed 's/^/  log: /' | tee -a $S ;;
  torch)
    bare torch-bare 60 $PY xtask/gpu/torch_cpu.py
    rec torch-cold 90 -- $PY xtask/gpu/torch_cpu.py
    rec torch-warm 90 -- $PY xtask/gpu/torch_cpu.py
    rec torch-ring64 90 --ring-size 64M -- $PY xtask/gpu/torch_cpu.py
    heaptrack_run torch-heaptrack 100 $PY xtask/gpu/torch_cpu.py
    grep -h "table\|unwind" $L/torch-cold.err | tail -6 | sed 's/^/  log: /' | tee -a $S ;;
  rerun)
    # After the overload switch's second phase: the PyTorch CPU script twice (cold, warm
    # cache), 16 threads of malloc/free, the GPU script's functions, then the PyTorch
    # script with 64 MiB rings and where its memory goes.
    rec torch-1 90 -- $PY xtask/gpu/torch_cpu.py
    rec torch-2 90 -- $PY xtask/gpu/torch_cpu.py
    grep -h "overload\|memory at the end\|probe counters" $L/torch-2.err | cut -c1-400 | sed 's/^/  log: /' | tee -a $S
    pack
    bare loop-bare 60 $D/alloc_workload --loop 300000 --loop-threads 16
    rec loop-dwarf 60 -- $D/alloc_workload --loop 300000 --loop-threads 16
    grep -h "overload\|memory at the end" $L/loop-dwarf.err | sed 's/^/  log: /' | tee -a $S
    rec gpu-default 100 -- $PY xtask/gpu/torch_gpu.py
    $M report -i $T/gpu-default.data --domain gpu --by function --top 12 > $L/gpu-default-fn.txt 2>&1
    $M report -i $T/gpu-default.data --domain gpu --by stack --top 6 > $L/gpu-default-stacks.txt 2>&1
    head -30 $L/gpu-default-fn.txt >> $S
    pack
    rec torch-ring64 90 --ring-size 64M -- $PY xtask/gpu/torch_cpu.py
    grep -h "memory at the end" $L/torch-ring64.err | sed 's/^/  log: /' | tee -a $S
    timeout 40 $M dump -i $T/torch-ring64.data --stacks 2>/dev/null | grep -c '^stack=' | sed 's/^/  distinct stacks: /' | tee -a $S
    timeout 40 $M report -i $T/torch-ring64.data --domain user --by stack --top 3 > $L/torch-ring64-stacks.txt 2>&1 ;;
  round3)
    # After the frame reuse and the report fix: the heavy script (warm cache) beside
    # heaptrack, one record as users run it (not -q), the PyTorch CPU script with the
    # default rings (overload switch, reserved domain), with 64 MiB rings (memory with
    # ~1 M distinct stacks) and the time and memory of a report of that recording.
    for i in 1 2; do bare heavy-bare$i 60 $PY $D/heavy.py; done
    heaptrack_run heavy-heaptrack 120 $PY $D/heavy.py
    for i in 0 1 2; do rec heavy-warm$i 120 -- $PY $D/heavy.py; done
    rec heavy-fp 120 --call-graph fp -- $PY $D/heavy.py
    grep -h "probe counters" $L/heavy-warm2.err | grep -o "unwind_frames: [0-9]*\|unwind_frames_reused: [0-9]*" | tr '\n' ' ' | sed 's/^/  log: /' | tee -a $S; echo | tee -a $S
    s=$(now); $M record --force -o $T/heavy-loud.data -- $PY $D/heavy.py > $L/heavy-loud.out 2> $L/heavy-loud.err
    say "heavy-loud (not -q): $(since $s) s"; grep -h "exited" $L/heavy-loud.err | tee -a $S
    pack
    rec torch-1 90 -- $PY xtask/gpu/torch_cpu.py
    grep -h "overload\|memory at the end" $L/torch-1.err | cut -c1-300 | sed 's/^/  log: /' | tee -a $S
    timeout 60 $M report -i $T/torch-1.data --top 4 2>&1 | head -24 | tee -a $S
    pack
    rec torch-ring64 90 --ring-size 64M -- $PY xtask/gpu/torch_cpu.py
    grep -h "memory at the end" $L/torch-ring64.err | sed 's/^/  log: /' | tee -a $S
    $PY -c "import resource,subprocess,sys,time; t=time.time(); r=subprocess.run(sys.argv[1:],stdout=subprocess.DEVNULL,timeout=150); print(f'  report of torch-ring64: {time.time()-t:.2f} s rc={r.returncode} maxrss {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1024:.0f} MB')" $M report -i $T/torch-ring64.data --top 10 2>&1 | tee -a $S
    pack
    bare loop-bare 60 $D/alloc_workload --loop 300000 --loop-threads 16
    rec loop-dwarf 60 -- $D/alloc_workload --loop 300000 --loop-threads 16
    grep -h "overload" $L/loop-dwarf.err | sed 's/^/  log: /' | tee -a $S ;;
  round4)
    # After the probe-cost work of issue #13 (repeat stacks checked, not walked; caches
    # behind generation words; the sampling draw first): the very first run on the machine
    # (cold cache) and a second cold one, then warm runs of this build and the previous
    # device build ($D/memtrace-old) alternating beside bare and heaptrack, the malloc+free
    # loop on 1 and 16 threads, the PyTorch CPU script and /bin/true.
    rec cold1 120 -- $PY $D/heavy.py
    rm -rf $MEMTRACE_CACHE_DIR; rec cold2 120 -- $PY $D/heavy.py
    pack
    for i in 1 2 3; do
      bare heavy-bare$i 60 $PY $D/heavy.py
      rec heavy-new$i 120 -- $PY $D/heavy.py
      M0=$M; M=$D/memtrace-old; rec heavy-old$i 120 -- $PY $D/heavy.py; M=$M0
    done
    for i in 1 2; do heaptrack_run heavy-heaptrack$i 120 $PY $D/heavy.py; done
    rec heavy-fp 120 --call-graph fp -- $PY $D/heavy.py
    grep -h "probe counters" $L/heavy-new3.err | grep -o "unwind_frames: [0-9]*\|unwind_frames_reused: [0-9]*\|unwind_reused: [0-9]*" | tr '\n' ' ' | sed 's/^/  log: /' | tee -a $S; echo | tee -a $S
    pack
    for th in 1 16; do
      bare loop$th-bare 60 $D/alloc_workload --loop 300000 --loop-threads $th
      rec loop$th-new 60 -- $D/alloc_workload --loop 300000 --loop-threads $th
      M0=$M; M=$D/memtrace-old; rec loop$th-old 60 -- $D/alloc_workload --loop 300000 --loop-threads $th; M=$M0
      rec loop$th-sampled 60 --sample-bytes 512k -- $D/alloc_workload --loop 300000 --loop-threads $th
    done
    grep -h "overload" $L/loop16-new.err | cut -c1-200 | sed 's/^/  log: /' | tee -a $S
    pack
    for i in 1 2 3; do rec true$i 30 -- /bin/true; done
    bare torch-bare 60 $PY xtask/gpu/torch_cpu.py
    rec torch-new 90 -- $PY xtask/gpu/torch_cpu.py
    grep -h "overload\|memory at the end" $L/torch-new.err | cut -c1-300 | sed 's/^/  log: /' | tee -a $S
    pack
    M0=$M; M=$D/memtrace-old; rec torch-old 90 -- $PY xtask/gpu/torch_cpu.py; M=$M0 ;;
  round5)
    # Stop 41: this build (stops 34-40: recording format 7, code without CFI walked by its
    # frame pointer, 64 KiB anchored copies, perf maps) beside dd57348 (run 4's last build,
    # $D/memtrace-old, with a table cache of its own): the very first runs on the machine,
    # warm runs of both alternating beside bare and heaptrack, frame pointers, the PyTorch
    # CPU script with both builds, the GPU script, 16 threads of malloc+free and /bin/true.
    bare heavy-bare0 60 $PY $D/heavy.py
    rec cold-new 120 -- $PY $D/heavy.py
    oldrec cold-old 120 -- $PY $D/heavy.py
    pack
    for i in 1 2 3; do
      bare heavy-bare$i 60 $PY $D/heavy.py
      rec heavy-new$i 120 -- $PY $D/heavy.py
      oldrec heavy-old$i 120 -- $PY $D/heavy.py
    done
    for i in 1 2; do heaptrack_run heavy-heaptrack$i 120 $PY $D/heavy.py; done
    rec heavy-fp 120 --call-graph fp -- $PY $D/heavy.py
    grep -h "probe counters" $L/heavy-new3.err | grep -o "unwind_frames: [0-9]*\|unwind_frames_reused: [0-9]*\|unwind_reused: [0-9]*" | tr '\n' ' ' | sed 's/^/  log: /' | tee -a $S; echo | tee -a $S
    pack
    bare torch-bare 60 $PY xtask/gpu/torch_cpu.py
    rec torch-new 90 -- $PY xtask/gpu/torch_cpu.py
    grep -h "overload\|memory at the end" $L/torch-new.err | cut -c1-300 | sed 's/^/  log: /' | tee -a $S
    pack
    oldrec torch-old 90 -- $PY xtask/gpu/torch_cpu.py
    pack
    rec gpu-new 100 -- $PY xtask/gpu/torch_gpu.py
    grep -h TORCH_STATS $L/gpu-new.out | tee -a $S
    $M report -i $T/gpu-new.data --domain gpu --by function --top 8 2>&1 | head -24 >> $S
    for i in 1 2; do
      rec loop16-new$i 60 -- $D/alloc_workload --loop 300000 --loop-threads 16
      oldrec loop16-old$i 60 -- $D/alloc_workload --loop 300000 --loop-threads 16
    done
    for i in 1 2 3; do rec true$i 30 -- /bin/true; done ;;
  floor)
    # What the probes' traps cost without any stack work, against the default record and
    # heaptrack on the heavy script (warm cache), and the malloc+free loop on one thread.
    rec fill 120 -- $PY $D/heavy.py
    for i in 1 2; do
      bare heavy-bare$i 60 $PY $D/heavy.py
      rec heavy-dwarf$i 120 -- $PY $D/heavy.py
      rec heavy-nostacks$i 120 --no-user-stacks --no-kernel-stacks --python-frames off -- $PY $D/heavy.py
      rec heavy-nokernel$i 120 --no-kernel --python-frames off -- $PY $D/heavy.py
      rec heavy-nopython$i 120 --python-frames off -- $PY $D/heavy.py
      heaptrack_run heavy-heaptrack$i 120 $PY $D/heavy.py
    done
    bare heavy-bare3 60 $PY $D/heavy.py
    for a in "" "--no-user-stacks --no-kernel-stacks" "--no-kernel --no-user-stacks"; do
      rec "loop1${a// /}" 60 $a -- $D/alloc_workload --loop 300000 --loop-threads 1
    done ;;
  writer)
    # The recording's encoder and deflater on a thread of their own ($D/memtrace) against
    # the build before it ($D/memtrace-old), alternating: 16 threads of malloc+free, the
    # heavy script (warm cache) beside bare and heaptrack, the PyTorch CPU script.
    rec fill 120 -- $PY $D/heavy.py
    oldrec fill-old 120 -- $PY $D/heavy.py
    for i in 1 2; do
      rec loop16-new$i 60 -- $D/alloc_workload --loop 300000 --loop-threads 16
      oldrec loop16-old$i 60 -- $D/alloc_workload --loop 300000 --loop-threads 16
    done
    pack
    for i in 1 2; do
      bare heavy-bare$i 60 $PY $D/heavy.py
      rec heavy-new$i 120 -- $PY $D/heavy.py
      oldrec heavy-old$i 120 -- $PY $D/heavy.py
    done
    heaptrack_run heavy-heaptrack 120 $PY $D/heavy.py
    pack
    rec torch-new 90 -- $PY xtask/gpu/torch_cpu.py
    oldrec torch-old 90 -- $PY xtask/gpu/torch_cpu.py
    grep -h "overload:" $L/torch-new.err $L/torch-old.err | cut -c1-120 | sed 's/^/  log: /' | tee -a $S ;;
  torchab)
    # The PyTorch CPU script after a bare run (its libraries in the page cache), this build
    # and the previous ($D/memtrace-old) alternating, twice.
    bare torch-bare 60 $PY xtask/gpu/torch_cpu.py
    for i in 1 2; do
      rec torch-new$i 90 -- $PY xtask/gpu/torch_cpu.py
      oldrec torch-old$i 90 -- $PY xtask/gpu/torch_cpu.py
      pack
    done
    grep -h "overload:\|memory at the end" $L/torch-new*.err $L/torch-old*.err | cut -c1-150 | sed 's/^/  log: /' | tee -a $S ;;
  report)
    # A report of a recording with about a million distinct stacks (the PyTorch CPU script
    # with 64 MiB rings): time and peak memory, this build and the previous ($D/memtrace-old),
    # by call site and by stack.
    rec torch-ring64 120 --ring-size 64M -- $PY xtask/gpu/torch_cpu.py
    pack
    for by in site stack; do for b in memtrace memtrace-old; do
      $PY -c "import resource,subprocess,sys,time; t=time.time(); r=subprocess.run(sys.argv[1:],stdout=subprocess.DEVNULL,timeout=200); print(f'  report --by $by ($b): {time.time()-t:.2f} s rc={r.returncode} maxrss {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss/1024:.0f} MB')" $D/$b report -i $T/torch-ring64.data --by $by --top 10 2>&1 | tee -a $S
    done; done ;;
  overload)
    # 16 threads of malloc+free outrun the reader: how much is lost before the overload
    # switch's second phase, this build and the previous ($D/memtrace-old).
    bare loop16-bare 60 $D/alloc_workload --loop 300000 --loop-threads 16
    for i in 1 2; do
      rec loop16-new$i 60 -- $D/alloc_workload --loop 300000 --loop-threads 16
      grep -h "overload:" $L/loop16-new$i.err | cut -c1-120 | sed 's/^/  log: /' | tee -a $S
      M0=$M; M=$D/memtrace-old; rec loop16-old$i 60 -- $D/alloc_workload --loop 300000 --loop-threads 16; M=$M0
      grep -h "overload:" $L/loop16-old$i.err | cut -c1-120 | sed 's/^/  log: /' | tee -a $S
    done ;;
  cold)
    # The first run on the machine (no cached tables) with the default rings (4 MiB on 16
    # CPUs) and with 8 MiB: does a burst of stack copies overflow the Python thread's ring?
    for i in 1 2; do bare heavy-bare$i 60 $PY $D/heavy.py; done
    for r in 4M 8M; do for i in 1 2; do
      rm -rf $MEMTRACE_CACHE_DIR; rec cold$r-$i 120 --ring-size $r -- $PY $D/heavy.py
      grep -h "overload" $L/cold$r-$i.err | cut -c1-200 | sed 's/^/  log: /' | tee -a $S
    done; done
    rec warm4M 120 -- $PY $D/heavy.py
    for i in 1 2 3; do rec true$i 30 -- /bin/true; done
    for f in $L/cold4M-*.err; do
      grep -h "in the probes" $f | grep -o "[0-9]* ms after" | sort -n | awk '{a[NR]=$1} END {printf "  %s: tables in the probes after (ms): n=%d min=%d p50=%d p90=%d max=%d; ", FILENAME, NR, a[1], a[int(NR/2)], a[int(NR*0.9)], a[NR]}' FILENAME=$(basename $f) | tee -a $S
      echo "placed ahead: $(grep -c 'installed ahead' $f)" | tee -a $S
    done ;;
  warm)
    # The heavy script with a warm cache, three times, beside bare and heaptrack runs.
    rec fill 120 -- $PY $D/heavy.py
    for i in 1 2 3; do bare heavy-bare$i 60 $PY $D/heavy.py; rec heavy-warm$i 120 -- $PY $D/heavy.py; done
    for i in 1 2; do heaptrack_run heavy-heaptrack$i 120 $PY $D/heavy.py; done ;;
  ab)
    # The heavy script, warm cache, alternating this build and an older one ($D/memtrace-old).
    rec fill 120 -- $PY $D/heavy.py
    for i in 1 2 3; do
      bare bare$i 60 $PY $D/heavy.py
      rec new$i 120 -- $PY $D/heavy.py
      M0=$M; M=$D/memtrace-old; rec old$i 120 -- $PY $D/heavy.py; M=$M0
      grep -h "tables ready" $L/new$i.err $L/old$i.err | cut -c1-60 | sed 's/^/  log: /' | tee -a $S
    done ;;
  loop)
    bare loop-bare 60 $D/alloc_workload --loop 300000 --loop-threads 16
    rec loop-dwarf 120 -- $D/alloc_workload --loop 300000 --loop-threads 16
    rec loop-sampled 120 --sample-bytes 512k -- $D/alloc_workload --loop 300000 --loop-threads 16
    rec loop-fp 120 --call-graph fp -- $D/alloc_workload --loop 300000 --loop-threads 16 ;;
  esac
  rm -f $T/*
  pack
done
say "== done $(date +%T)"
pack
