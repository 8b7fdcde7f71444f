//! `cargo xtask bench system` (and part of `cargo xtask bench`): what system-wide tracing
//! costs a kernel-allocation-heavy program — the bundled workload's pipe()+close() loop,
//! bare, under `memtrace record -a` with its defaults and without each kind of stack, and
//! under the peers a user would reach for instead: bpftrace counting `@[kstack, ustack]` on
//! the kmem tracepoints (the allocation ones, and all those memtrace attaches) and `perf
//! record -a -g` on the allocation ones. Runs alternate between configurations so a
//! machine's drift spreads over all of them. Figures from one session on one machine;
//! nothing here passes or fails.
use std::{
    fmt::Write as _,
    fs,
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

use crate::{
    bench::{min_median, run_for_figure, start_system_recording},
    build_release, target_dir,
};

/// This part's section of BENCHMARKS.md.
pub const SECTION: crate::Marked = crate::Marked {
    heading: "## System-wide kernel allocations (`record -a`)",
    begin: "<!-- system:begin -->",
    end: "<!-- system:end -->",
};

const RUNS: usize = 3;
const PIPES: &str = "100000";
/// The allocation tracepoints, and every kmem tracepoint `memtrace record -a` attaches.
const ALLOC_TRACEPOINTS: &str = "tracepoint:kmem:kmalloc,tracepoint:kmem:kmem_cache_alloc";
const ALL_TRACEPOINTS: &str = "tracepoint:kmem:kmalloc,tracepoint:kmem:kmem_cache_alloc,tracepoint:kmem:kfree,\
     tracepoint:kmem:kmem_cache_free,tracepoint:kmem:mm_page_alloc,tracepoint:kmem:mm_page_free,\
     tracepoint:kmem:mm_page_free_batched";

/// A tracer running around the loop.
enum Tracer {
    None,
    Memtrace(&'static [&'static str]),
    Bpftrace(String),
    Perf,
}

struct Config {
    name: &'static str,
    tracer: Tracer,
    values: Vec<f64>,
}

/// Starts bpftrace with `program` and returns once its probes are attached.
fn start_bpftrace(program: &str) -> Result<Child> {
    let mut child = Command::new("bpftrace")
        .args(["-e", program])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting bpftrace")?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    for line in lines.by_ref() {
        if line?.starts_with("Attaching") {
            // Its maps, printed at exit, are drained and dropped.
            std::thread::spawn(move || lines.for_each(drop));
            // "Attaching" comes before the attach itself, which takes a while for seven
            // tracepoints (bpftrace 0.17 misses a Ctrl-C that arrives meanwhile).
            std::thread::sleep(Duration::from_secs(2));
            return Ok(child);
        }
    }
    bail!("bpftrace did not attach")
}

fn start_perf(data: &Path) -> Result<Child> {
    let child = Command::new("perf")
        .args(["record", "-a", "-g", "-B", "-q", "-e", "kmem:kmalloc", "-e", "kmem:kmem_cache_alloc", "-o"])
        .arg(data)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting perf")?;
    // perf says nothing once its events are open.
    std::thread::sleep(Duration::from_secs(2));
    Ok(child)
}

/// Interrupts a tracer as Ctrl-C would and waits for it, again every 10 s while it has not
/// exited (a peer that missed the first), and kills it after a minute.
fn stop(mut child: Child) -> Result<()> {
    let pid = child.id().to_string();
    for _ in 0..6 {
        let _ = Command::new("kill").args(["-INT", &pid]).status();
        for _ in 0..100 {
            if child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    child.kill()?;
    child.wait()?;
    Ok(())
}

/// The section's text, and memtrace's added cost with its defaults ÷ bpftrace's
/// `@[kstack, ustack] = count()` on the allocation tracepoints (issue #13's target).
pub fn section(memtrace: &Path, workloads: &Path) -> Result<(String, Option<f64>)> {
    let workload = workloads.join("alloc_workload");
    let dir = target_dir().join("bench");
    let data = dir.join("system.data");
    let perf_data = dir.join("system-perf.data");
    let have = |tool: &str| crate::succeeds(Command::new(tool).arg("--version"));
    let mut configs = vec![
        Config { name: "bare", tracer: Tracer::None, values: Vec::new() },
        Config {
            name: "memtrace record -a (defaults: kernel and user stacks)",
            tracer: Tracer::Memtrace(&[]),
            values: Vec::new(),
        },
        Config {
            name: "memtrace record -a --no-user-stacks",
            tracer: Tracer::Memtrace(&["--no-user-stacks"]),
            values: Vec::new(),
        },
        Config {
            name: "memtrace record -a --no-kernel-stacks (no stacks for kernel events)",
            tracer: Tracer::Memtrace(&["--no-kernel-stacks"]),
            values: Vec::new(),
        },
    ];
    if have("bpftrace") {
        configs.push(Config {
            name: "bpftrace `@[kstack, ustack] = count()` on kmalloc, kmem_cache_alloc",
            tracer: Tracer::Bpftrace(format!("{ALLOC_TRACEPOINTS} {{ @[kstack, ustack] = count(); }}")),
            values: Vec::new(),
        });
        configs.push(Config {
            name: "bpftrace `@[kstack, ustack] = count()` on memtrace's 7 kmem tracepoints",
            tracer: Tracer::Bpftrace(format!("{ALL_TRACEPOINTS} {{ @[kstack, ustack] = count(); }}")),
            values: Vec::new(),
        });
        configs.push(Config {
            name: "bpftrace `@[kstack] = count()` on kmalloc, kmem_cache_alloc",
            tracer: Tracer::Bpftrace(format!("{ALLOC_TRACEPOINTS} {{ @[kstack] = count(); }}")),
            values: Vec::new(),
        });
    }
    if have("perf") {
        configs.push(Config {
            name: "perf record -a -g -e kmem:kmalloc -e kmem:kmem_cache_alloc",
            tracer: Tracer::Perf,
            values: Vec::new(),
        });
    }
    let run_loop = || run_for_figure(Command::new(&workload).args(["--kernel-loop", PIPES]));
    for round in 0..RUNS {
        for c in &mut configs {
            eprintln!("xtask bench: system-wide, round {} of {RUNS}: {}", round + 1, c.name);
            let tracer = match &c.tracer {
                Tracer::None => None,
                Tracer::Memtrace(extra) => Some(start_system_recording(memtrace, &data, extra)?),
                Tracer::Bpftrace(program) => Some(start_bpftrace(program)?),
                Tracer::Perf => Some(start_perf(&perf_data)?),
            };
            let value = run_loop();
            if let Some(tracer) = tracer {
                stop(tracer)?;
            }
            c.values.push(value?);
        }
    }
    let _ = fs::remove_file(&data);
    let _ = fs::remove_file(&perf_data);
    let medians: Vec<(f64, f64)> = configs.iter().map(|c| min_median(c.values.clone())).collect();
    let bare = medians[0].1;
    let added = |i: usize| medians[i].1 - bare;
    let reference = configs.iter().position(|c| c.name.contains("kstack, ustack] = count()` on kmalloc"));
    let mut out = String::from(
        "| tracer | ns per pipe()+close(), min | median | added, median | added ÷ bpftrace's (alloc tracepoints) |\n\
         | --- | ---: | ---: | ---: | ---: |\n",
    );
    for (i, c) in configs.iter().enumerate() {
        let (min, median) = medians[i];
        let ratio = match reference {
            Some(r) if i > 0 && added(r) > 0.0 => format!("{:.2}", added(i) / added(r)),
            _ => "—".into(),
        };
        let added_s = if i == 0 { "—".into() } else { format!("{:.0}", added(i)) };
        let _ = writeln!(out, "| {} | {min:.0} | {median:.0} | {added_s} | {ratio} |", c.name);
        eprintln!("xtask bench: {:<75} min {min:>8.0}  median {median:>8.0} ns", c.name);
    }
    let _ = writeln!(
        out,
        "\n`alloc_workload --kernel-loop {PIPES}` ({PIPES} pipe()+close() pairs: file, inode, dentry and pipe \
         buffer allocations in the kernel on the task's behalf), {RUNS} runs of each, alternating. memtrace \
         also attaches the free tracepoints, its task and mapping tracepoints and sends every event to \
         userspace; bpftrace only counts in a map. Kernel stacks are the kernel's own unwinder (ORC) for \
         both: `bpf_get_stack` for memtrace, `bpf_get_stackid` for bpftrace."
    );
    let defaults = configs.iter().position(|c| c.name.starts_with("memtrace record -a (defaults"));
    let ratio = match (defaults, reference) {
        (Some(d), Some(r)) if added(r) > 0.0 => Some(added(d) / added(r)),
        _ => None,
    };
    Ok((out, ratio))
}

/// `cargo xtask bench system`: this section alone, replaced in BENCHMARKS.md.
pub fn run_alone() -> Result<()> {
    crate::require_root("bench")?;
    crate::setup()?;
    crate::ensure_tools(&[("bpftrace", "bpftrace"), ("perf", "linux-perf")])?;
    let (memtrace, workloads) = build_release()?;
    fs::create_dir_all(target_dir().join("bench"))?;
    crate::update_benchmarks("system-wide", &SECTION, &section(&memtrace, &workloads)?.0)
}
