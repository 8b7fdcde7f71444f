//! `cargo xtask bench`: every overhead figure in one session on one machine — per
//! malloc+free pair for the peers and memtrace's modes, a kernel-allocation-heavy workload
//! under `record -a`, the userspace pipeline alone (criterion), a sustained run on all
//! cores, bytes per event, and report speed — printed as a table and written to
//! BENCHMARKS.md. Figures are ratios measured in the same run; nothing here passes or fails.
//!
//! Over 500 lines: one session measures every peer side by side and writes one document; the serve and heavy-program sections are their own files.
use std::{
    fmt::Write as _,
    fs,
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

use crate::{build_release, cargo, output, target_dir, workspace_root};

pub(crate) const RUNS: usize = 5;
pub(crate) const TRACED_PAIRS: &str = "300000";
pub(crate) const BARE_PAIRS: &str = "3000000";
const LIBC: &str = "/lib/x86_64-linux-gnu/libc.so.6";

/// The "X ns/pair" (or ns/pipe) figure a workload printed.
fn per_op(stdout: &str) -> Option<f64> {
    stdout.lines().find_map(|l| {
        let (n, rest) = l.split_once(' ')?;
        rest.starts_with("ns/").then(|| n.parse().ok()).flatten()
    })
}

pub(crate) fn run_for_figure(cmd: &mut Command) -> Result<f64> {
    let out = cmd.stderr(Stdio::null()).output().with_context(|| format!("running {cmd:?}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    per_op(&stdout).with_context(|| format!("{cmd:?} printed no ns/op figure:\n{stdout}"))
}

pub(crate) fn min_median(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2])
}

pub(crate) struct Config {
    pub(crate) name: &'static str,
    note: &'static str,
    pub(crate) min: f64,
    pub(crate) median: f64,
}

pub(crate) fn measure(name: &'static str, note: &'static str, mut make: impl FnMut() -> Command) -> Result<Config> {
    let mut values = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        values.push(run_for_figure(&mut make())?);
    }
    let (min, median) = min_median(values);
    eprintln!("xtask bench: {name:<40} min {min:>9.1}  median {median:>9.1} ns/pair");
    Ok(Config { name, note, min, median })
}

/// Rounds of the per-pair table: each runs every configuration once.
const PAIR_RUNS: usize = 7;

/// A configuration to measure: its name, what it is, and how to start a run of it.
pub(crate) struct Candidate<'a> {
    name: &'static str,
    note: &'static str,
    make: Box<dyn FnMut() -> Command + 'a>,
}

impl<'a> Candidate<'a> {
    pub(crate) fn new(name: &'static str, note: &'static str, make: impl FnMut() -> Command + 'a) -> Self {
        Self { name, note, make: Box::new(make) }
    }
}

/// Measures the candidates in `runs` rounds, each running every one of them once in turn:
/// a slow spell of the machine (a shared VM's neighbours, frequency changes) then falls on
/// every configuration alike rather than on whichever ran during it, and the ratios of
/// their medians hold across runs of the bench.
pub(crate) fn measure_interleaved(mut candidates: Vec<Candidate<'_>>, runs: usize) -> Result<Vec<Config>> {
    let n = candidates.len();
    let mut values = vec![Vec::with_capacity(runs); n];
    for round in 0..runs {
        // Each round starts one configuration later: none always runs first or after
        // the same neighbour.
        for k in 0..n {
            let i = (round + k) % n;
            values[i].push(run_for_figure(&mut (candidates[i].make)())?);
        }
        eprintln!("xtask bench: round {}/{runs} done", round + 1);
    }
    Ok(candidates
        .into_iter()
        .zip(values)
        .map(|(c, v)| {
            let (min, median) = min_median(v);
            eprintln!("xtask bench: {:<40} min {min:>9.1}  median {median:>9.1} ns/pair", c.name);
            Config { name: c.name, note: c.note, min, median }
        })
        .collect())
}

fn version(cmd: &str, arg: &str) -> String {
    Command::new(cmd)
        .arg(arg)
        .output()
        .ok()
        .map(|o| {
            String::from_utf8_lossy(if o.stdout.is_empty() { &o.stderr } else { &o.stdout })
                .lines()
                .next()
                .unwrap_or("")
                .to_string()
        })
        .unwrap_or_else(|| "not found".into())
}

/// Starts `memtrace record -a` and returns once it traces.
pub(crate) fn start_system_recording(memtrace: &Path, data: &Path, extra: &[&str]) -> Result<std::process::Child> {
    let mut child = Command::new(memtrace)
        .args(["record", "-a", "--force"])
        .args(extra)
        .arg("-o")
        .arg(data)
        .stderr(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    for line in lines.by_ref() {
        if line?.contains("memtrace: tracing") {
            std::thread::spawn(move || lines.for_each(drop));
            return Ok(child);
        }
    }
    bail!("memtrace record -a did not start")
}

fn interrupt_and_wait(mut child: std::process::Child) -> Result<()> {
    // SAFETY: signals our own child.
    unsafe { libc_kill(child.id() as i32, 2) };
    child.wait()?;
    Ok(())
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

fn json(memtrace: &Path, data: &Path) -> Result<serde_json::Value> {
    let out = output(Command::new(memtrace).args(["report", "--format", "json", "--top", "1", "-i"]).arg(data))?;
    Ok(serde_json::from_str(&out)?)
}

/// The criterion throughputs, in events per second.
fn pipeline_throughput() -> Result<Vec<(String, f64)>> {
    let out = output(cargo().args(["bench", "-p", "memtrace", "--bench", "pipeline"]))?;
    let mut figures = Vec::new();
    let mut current = None;
    for line in out.lines() {
        if let Some(name) = line.strip_prefix("pipeline/") {
            current = Some(name.split_whitespace().next().unwrap_or(name).to_string());
        }
        if let (Some(name), Some(rest)) = (&current, line.trim().strip_prefix("thrpt:")) {
            // thrpt:  [6.3373 Melem/s 6.3653 Melem/s 6.3823 Melem/s]: the middle one.
            let parts: Vec<&str> = rest.trim_matches(|c| c == ' ' || c == '[' || c == ']').split_whitespace().collect();
            if parts.len() >= 4 {
                let scale = match parts[3] {
                    "Gelem/s" => 1e9,
                    "Melem/s" => 1e6,
                    "Kelem/s" => 1e3,
                    _ => 1.0,
                };
                figures.push((name.clone(), parts[2].parse::<f64>().unwrap_or(0.0) * scale));
            }
            current = None;
        }
    }
    Ok(figures)
}

/// The share of user allocations (and of distinct stacks) whose stack reaches the program's
/// entry (`__libc_start_main` for the main thread, the thread start for others) unbroken.
fn stack_reach(memtrace: &Path, data: &Path) -> Result<(f64, f64, u64)> {
    let out = output(
        Command::new(memtrace)
            .args(["report", "--format", "json", "--by", "stack", "--domain", "user", "-i"])
            .arg(data),
    )?;
    let report: serde_json::Value = serde_json::from_str(&out)?;
    let (mut allocs, mut reaching, mut stacks, mut stacks_reaching) = (0u64, 0u64, 0u64, 0u64);
    for site in report["sites"].as_array().into_iter().flatten() {
        let frames = site["frames"].as_array().cloned().unwrap_or_default();
        if frames.is_empty() {
            continue;
        }
        let n = site["allocs"].as_u64().unwrap_or(0);
        let reaches = site["truncated"] != true
            && frames.iter().any(|f| {
                let name = f["function"].as_str().unwrap_or("");
                name.starts_with("__libc_start_main") || name == "start_thread" || name.starts_with("clone")
            });
        allocs += n;
        stacks += 1;
        if reaches {
            reaching += n;
            stacks_reaching += 1;
        }
    }
    Ok((reaching as f64 / allocs.max(1) as f64, stacks_reaching as f64 / stacks.max(1) as f64, allocs))
}

pub(crate) const PYTHON_SCRIPT: &str = "import json, re, collections\n\
data = [{'k': i, 'v': str(i) * 10, 'l': list(range(i % 50))} for i in range(20000)]\n\
s = json.dumps(data)\n\
back = json.loads(s)\n\
c = collections.Counter(re.findall(r'[0-9]+', s[:200000]))\n\
print(len(back), len(c))\n";

/// python3 running a small script, recorded with each call graph: how many stacks are whole.
fn python_stacks(memtrace: &Path, dir: &Path) -> Result<String> {
    let python = fs::canonicalize("/usr/bin/python3").context("python3 is needed for this figure")?;
    let mut out = String::from(
        "| `--call-graph` | allocations | reaching the entry | distinct stacks reaching it |\n| --- | ---: | ---: | ---: |\n",
    );
    for graph in ["fp", "dwarf"] {
        let data = dir.join(format!("python-{graph}.data"));
        let status = Command::new(memtrace)
            .args(["record", "-q", "--force", "--call-graph", graph, "-o"])
            .arg(&data)
            .arg("--")
            .arg(&python)
            .args(["-c", PYTHON_SCRIPT])
            .stdout(Stdio::null())
            .status()?;
        if !status.success() {
            bail!("recording python3 failed");
        }
        let (share, stacks, allocs) = stack_reach(memtrace, &data)?;
        let _ = writeln!(out, "| {graph} | {allocs} | {:.1} % | {:.1} % |", share * 100.0, stacks * 100.0);
    }
    let _ = writeln!(
        out,
        "\n{} ({}), no frame pointers, running a small JSON/regex script (in `xtask/src/bench.rs`). A stack \
         reaches the entry when it is not truncated and passes `__libc_start_main` (or a thread start).",
        python.display(),
        version(&python.to_string_lossy(), "--version")
    );
    Ok(out)
}

/// The learned-rule walk against a copy of every stack unwound in userspace (`perf
/// --call-graph dwarf`'s design), on a short loop (every copy must fit in the rings).
fn unwinding_designs(memtrace: &Path, nofp_workload: &Path, dir: &Path) -> Result<String> {
    const PAIRS: &str = "5000";
    let data = dir.join("designs.data");
    let mut out = String::from(
        "| design | min ns/pair | median ns/pair | stacks whole | stack bytes sent per allocation | lost events |\n| --- | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for (graph, name) in [
        ("dwarf", "rules learned from .eh_frame, walked in the probe (memtrace)"),
        ("copy", "8 KiB stack copy per allocation, unwound in userspace (perf --call-graph dwarf)"),
    ] {
        let mut values = Vec::new();
        let mut last = serde_json::Value::Null;
        for _ in 0..RUNS {
            let mut cmd = Command::new(memtrace);
            cmd.args(["record", "-q", "--force", "--ring-size", "64M", "--call-graph", graph, "-o"])
                .arg(&data)
                .arg("--")
                .arg(nofp_workload)
                .args(["--loop", PAIRS]);
            values.push(run_for_figure(&mut cmd)?);
            last = serde_json::from_str(&output(
                Command::new(memtrace).args(["report", "--format", "json", "--domain", "user", "-i"]).arg(&data),
            )?)?;
        }
        let (min, median) = min_median(values);
        let (share, _, allocs) = stack_reach(memtrace, &data)?;
        let copies = last["recorder"]["unwind_copies"].as_u64().unwrap_or(0);
        let copy_bytes = copies as f64 * 8192.0 / allocs.max(1) as f64;
        let _ = writeln!(
            out,
            "| {name} | {min:.0} | {median:.0} | {:.1} % | ≤ {copy_bytes:.0} | {} |",
            share * 100.0,
            last["lost_events"]
        );
    }
    let _ =
        writeln!(out, "\n`--loop {PAIRS}` malloc+free pairs of `alloc_workload_nofp`, {RUNS} runs each, 64 MiB rings.");
    Ok(out)
}

pub fn bench() -> Result<()> {
    crate::require_root("bench")?;
    crate::setup()?;
    crate::ensure_tools(&[
        ("bpftrace", "bpftrace"),
        ("heaptrack", "heaptrack"),
        ("sqlite3", "sqlite3"),
        ("gcc", "gcc"),
        ("perf", "linux-perf"),
    ])?;
    let (memtrace, workloads) = build_release()?;
    let workload = workloads.join("alloc_workload");
    let nofp_workload = workloads.join("alloc_workload_nofp");
    let dir = target_dir().join("bench");
    fs::create_dir_all(&dir)?;
    let scratch = dir.join("scratch.data");
    let traced = |args: &[&str]| {
        let mut c = Command::new(&memtrace);
        c.args(args).arg("--").arg(&workload).args(["--loop", TRACED_PAIRS]);
        c
    };
    let scratch_str = scratch.to_string_lossy().into_owned();
    let bpftrace_script = format!("uprobe:{LIBC}:malloc {{}} uretprobe:{LIBC}:malloc {{}} uprobe:{LIBC}:free {{}}");
    let workload_cmd = format!("{} --loop {TRACED_PAIRS}", workload.display());

    eprintln!("xtask bench: per malloc+free pair, {PAIR_RUNS} rounds, every configuration once per round");
    let bare_cmd = || {
        let mut c = Command::new(&workload);
        c.args(["--loop", BARE_PAIRS]);
        c
    };
    let bpftrace_cmd = || {
        let mut c = Command::new("bpftrace");
        c.args(["-e", &bpftrace_script, "-c", &workload_cmd]);
        c
    };
    let heaptrack_cmd = || {
        let mut c = Command::new("heaptrack");
        c.arg("-o").arg(dir.join("heaptrack")).arg(&workload).args(["--loop", TRACED_PAIRS]);
        c
    };
    let nofp_cmd = || {
        let mut c = Command::new(&memtrace);
        c.args(["record", "-q", "--force", "-o", &scratch_str])
            .arg("--")
            .arg(&nofp_workload)
            .args(["--loop", TRACED_PAIRS]);
        c
    };
    let mut measured = measure_interleaved(
        vec![
            Candidate::new("bare", "no tracing", bare_cmd),
            Candidate::new(
                "empty probes, naive (entry+return, free entry)",
                "the floor of any uprobe tracer probing function entries",
                || traced(&["bench-baseline"]),
            ),
            Candidate::new("empty probes, placed", "same three empty probes where memtrace puts its own", || {
                traced(&["bench-baseline", "--placed"])
            }),
            Candidate::new(
                "empty entry probes only, placed",
                "no return probe: an unsampled call at best (uprobe sessions skip it)",
                || traced(&["bench-baseline", "--placed", "--no-return"]),
            ),
            Candidate::new("bpftrace, same three probes", "bpftrace 0.17, empty actions", bpftrace_cmd),
            Candidate::new("heaptrack (LD_PRELOAD)", "in-process, libunwind stacks", heaptrack_cmd),
            Candidate::new(
                "memtrace record --call-graph fp",
                "full capture, user stacks by frame pointers (the fast path; this loop has them)",
                || traced(&["record", "-q", "--force", "--call-graph", "fp", "-o", &scratch_str]),
            ),
            Candidate::new(
                "memtrace record (full capture)",
                "every allocation and free, stacks (call-frame information), sizes, kernel too",
                || traced(&["record", "-q", "--force", "-o", &scratch_str]),
            ),
            Candidate::new(
                "memtrace record, loop built without frame pointers",
                "same, on alloc_workload_nofp (-fomit-frame-pointer)",
                nofp_cmd,
            ),
            Candidate::new("memtrace record --sample-bytes 512k", "size-weighted sampling", || {
                traced(&["record", "-q", "--force", "--sample-bytes", "512k", "-o", &scratch_str])
            }),
        ],
        PAIR_RUNS,
    )?;
    let configs = measured.split_off(2);
    let naive = measured.pop().context("the naive probes' figures")?;
    let bare = measured.pop().context("the bare figures")?;

    // Kernel allocations: pipe()+close() pairs, bare and under record -a (with and without
    // kernel stacks, the costly part).
    eprintln!("xtask bench: kernel-allocation-heavy workload (pipe+close), bare and under record -a");
    let kernel_cmd = || {
        let mut c = Command::new(&workload);
        c.args(["--kernel-loop", "100000"]);
        c
    };
    let mut kernel_bare = Vec::new();
    let mut kernel_traced = Vec::new();
    let mut kernel_traced_no_stacks = Vec::new();
    for _ in 0..3 {
        kernel_bare.push(run_for_figure(&mut kernel_cmd())?);
        let rec = start_system_recording(&memtrace, &dir.join("system.data"), &[])?;
        kernel_traced.push(run_for_figure(&mut kernel_cmd())?);
        interrupt_and_wait(rec)?;
        let rec = start_system_recording(&memtrace, &dir.join("system.data"), &["--no-kernel-stacks"])?;
        kernel_traced_no_stacks.push(run_for_figure(&mut kernel_cmd())?);
        interrupt_and_wait(rec)?;
    }
    let (kb_min, kb_med) = min_median(kernel_bare);
    let (kt_min, kt_med) = min_median(kernel_traced);
    let (kn_min, kn_med) = min_median(kernel_traced_no_stacks);

    eprintln!("xtask bench: two unwinding designs on the loop built without frame pointers");
    let designs = unwinding_designs(&memtrace, &nofp_workload, &dir)?;
    eprintln!("xtask bench: stacks of python3 (a distribution binary without frame pointers)");
    let python = python_stacks(&memtrace, &dir)?;

    eprintln!("xtask bench: userspace pipeline (criterion)");
    let pipeline = pipeline_throughput()?;

    eprintln!("xtask bench: a heavy program (Python with numpy, pandas, pyarrow)");
    let heavy = crate::heavy_bench::section(&memtrace)?;

    eprintln!("xtask bench: start and stop");
    let start = crate::start_bench::section(&memtrace)?;

    eprintln!("xtask bench: system-wide kernel allocations beside bpftrace and perf");
    let (system, system_ratio) = crate::system_bench::section(&memtrace, &workloads)?;

    eprintln!("xtask bench: the always-on agent (memtrace serve)");
    let serve = crate::serve_bench::section(&memtrace, &workloads)?;

    let seconds: u64 = std::env::var("MEMTRACE_BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
    eprintln!("xtask bench: sustained load, {seconds} s, one allocating thread per core");
    let sustained = dir.join("sustained.data");
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).to_string();
    let started = Instant::now();
    let out = Command::new(&memtrace)
        .args(["record", "-q", "--force", "-o"])
        .arg(&sustained)
        .arg("--")
        .arg(&workload)
        .args(["--loop-seconds", &seconds.to_string(), "--loop-threads", &cores])
        .output()?;
    let record_wall = started.elapsed();
    let sustained_stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let started = Instant::now();
    let report = json(&memtrace, &sustained)?;
    let report_wall = started.elapsed();
    let events = report["events"].as_u64().unwrap_or(0);
    let duration_s = report["duration_ns"].as_u64().unwrap_or(1) as f64 / 1e9;
    let lost = report["lost_events"].as_u64().unwrap_or(0);
    let cpu = report["recorder"]["cpu_ns"].as_u64().unwrap_or(0) as f64 / 1e9;
    let rss = report["recorder"]["peak_rss_bytes"].as_u64().unwrap_or(0) as f64 / 1e6;
    let file_bytes = fs::metadata(&sustained).map(|m| m.len()).unwrap_or(0);
    let bytes_per_event = file_bytes as f64 / events.max(1) as f64;

    // The table.
    let added = |c: &Config| c.median - bare.median;
    let naive_added = added(&naive);
    let mut table = String::new();
    let _ = writeln!(
        table,
        "| configuration | min ns/pair | median ns/pair | added cost / empty naive probes | what it is |"
    );
    let _ = writeln!(table, "| --- | ---: | ---: | ---: | --- |");
    let _ = writeln!(table, "| {} | {:.1} | {:.1} | — | {} |", bare.name, bare.min, bare.median, bare.note);
    for c in std::iter::once(&naive).chain(&configs) {
        let _ = writeln!(
            table,
            "| {} | {:.1} | {:.1} | {:.2} | {} |",
            c.name,
            c.min,
            c.median,
            added(c) / naive_added,
            c.note
        );
    }
    let full = configs.iter().find(|c| c.name.starts_with("memtrace record (full")).unwrap();
    let fp = configs.iter().find(|c| c.name.contains("--call-graph fp")).unwrap();
    let nofp = configs.iter().find(|c| c.name.contains("without frame pointers")).unwrap();
    let delta = full.median - fp.median;
    let _ = writeln!(
        table,
        "\nThe call-frame walk {} {:.0} ns per traced allocation {} the frame-pointer walk on the same \
         code ({:.0} vs {:.0} ns/pair, medians); on the build without frame pointers, {:.0} ns/pair.",
        if delta >= 0.0 { "costs" } else { "saves" },
        delta.abs(),
        if delta >= 0.0 { "over" } else { "against" },
        full.median,
        fp.median,
        nofp.median
    );
    let sampled = configs.iter().find(|c| c.name.contains("sample")).unwrap();
    let entry_only = configs.iter().find(|c| c.name.starts_with("empty entry")).unwrap();
    let mut other = String::new();
    let _ = writeln!(other, "| figure | value |");
    let _ = writeln!(other, "| --- | ---: |");
    let _ = writeln!(
        other,
        "| pipe()+close() bare, ns (min / median) | {kb_min:.0} / {kb_med:.0} |\n| same under `record -a`, ns (min / median) | {kt_min:.0} / {kt_med:.0} |\n| kernel-heavy slowdown under `record -a` (medians) | {:.0} % |\n| same under `record -a --no-kernel-stacks`, ns (min / median) | {kn_min:.0} / {kn_med:.0} |\n| kernel-heavy slowdown without kernel stacks (medians) | {:.0} % |",
        (kt_med / kb_med - 1.0) * 100.0,
        (kn_med / kb_med - 1.0) * 100.0
    );
    for (name, eps) in &pipeline {
        let _ = writeln!(other, "| pipeline {name}, events/s on one core | {:.2} M |", eps / 1e6);
    }
    let _ = writeln!(
        other,
        "| sustained: workload | `{sustained_stdout}` |\n| sustained: events recorded | {events} in {duration_s:.1} s = {:.0} k events/s |\n| sustained: lost events | {lost} |\n| sustained: memtrace CPU | {cpu:.1} s ({:.0} % of one core) |\n| sustained: memtrace peak RSS | {rss:.0} MB |\n| recording file | {:.1} MB, {bytes_per_event:.1} bytes per event |\n| record wall time / report wall time | {:.1} s / {:.1} s ({:.0}× faster) |",
        events as f64 / duration_s / 1e3,
        cpu / duration_s * 100.0,
        file_bytes as f64 / 1e6,
        record_wall.as_secs_f64(),
        report_wall.as_secs_f64(),
        record_wall.as_secs_f64() / report_wall.as_secs_f64().max(1e-3)
    );
    let ok = |b: bool| if b { "met" } else { "not met" };
    let pipeline_best = pipeline.iter().find(|(n, _)| n.starts_with("decode+pair")).map_or(0.0, |(_, e)| *e);
    let targets = format!(
        "| target | result | status |\n| --- | --- | --- |\n\
         | full capture added cost ≤ 1.0 × empty naive probe set | {:.2} × | {} |\n\
         | sampled: unsampled call approaches a single entry probe | sampled {:.0} ns vs entry probes only {:.0} ns vs placed entry+return {:.0} ns | {} |\n\
         | full capture added cost ≤ 0.25 × empty naive probe set (issue #13) | {:.2} × | {} |\n\
         | sampled ≤ empty entry probes only + 10 % (issue #13) | {:+.0} % | {} |\n\
         | `record -a` pipe()+close() added cost ≤ 0.7 × bpftrace `@[kstack, ustack]` (issue #13) | {} | {} |\n\
         | pipeline ≥ 5 M events/s per core | {:.2} M/s | {} |\n\
         | 0 lost events in the sustained run | {lost} | {} |\n\
         | ≤ 16 bytes per event on disk | {bytes_per_event:.1} | {} |\n\
         | report well under record time | {:.1} s vs {:.1} s | {} |\n",
        added(full) / naive_added,
        ok(added(full) <= naive_added),
        sampled.median,
        entry_only.median,
        configs[0].median,
        ok(sampled.median <= configs[0].median * 1.25),
        added(full) / naive_added,
        ok(added(full) <= naive_added * 0.25),
        (sampled.median / entry_only.median - 1.0) * 100.0,
        ok(sampled.median <= entry_only.median * 1.10),
        system_ratio.map_or("—".to_string(), |r| format!("{r:.2} ×")),
        ok(system_ratio.is_some_and(|r| r <= 0.7)),
        pipeline_best / 1e6,
        ok(pipeline_best >= 5e6),
        ok(lost == 0),
        ok(bytes_per_event <= 16.0),
        report_wall.as_secs_f64(),
        record_wall.as_secs_f64(),
        ok(report_wall.as_secs_f64() * 3.0 < record_wall.as_secs_f64()),
    );
    println!("\n{table}\n{designs}\n{python}\n{other}\n{serve}\n{targets}");

    let machine = format!(
        "- kernel: {}\n- CPU: {} ({} cores)\n- glibc: {}\n- rustc: {}\n- bpftrace: {}\n- heaptrack: {}\n- memtrace: {}",
        version("uname", "-r"),
        fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| c.lines().find(|l| l.starts_with("model name")).map(|l| l
                .split(':')
                .nth(1)
                .unwrap_or("")
                .trim()
                .to_string()))
            .unwrap_or_default(),
        cores,
        version("ldd", "--version"),
        version("rustc", "--version"),
        version("bpftrace", "--version"),
        version("heaptrack", "--version"),
        output(Command::new("git").args(["-C"]).arg(workspace_root()).args(["rev-parse", "--short", "HEAD"]))
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
    );
    let notes = fs::read_to_string(workspace_root().join("xtask/bench-notes.md")).unwrap_or_default();
    // Figures from a lent machine (many CPUs, a GPU), which no bench run here can redo.
    let device = fs::read_to_string(workspace_root().join("xtask/bench-device.md")).unwrap_or_default();
    // Figures measured by hand on this kind of machine, which follow the heavy section.
    let by_hand = fs::read_to_string(workspace_root().join("xtask/bench-by-hand.md")).unwrap_or_default();
    let by_hand = by_hand.lines().filter(|l| !l.starts_with("<!--")).collect::<Vec<_>>().join("\n");
    let doc = format!(
        "# memtrace benchmarks\n\nWritten by `cargo xtask bench` (as root), which builds what it needs and measures \
         everything below in one session; rerun it to reproduce. Ratios compare figures of the same run.\n\n\
         ## Machine\n\n{machine}\n\n## Per malloc+free pair\n\nThe bundled workload's loop (`alloc_workload --loop N`: \
         malloc(32) then free, {TRACED_PAIRS} pairs traced, {BARE_PAIRS} bare); {PAIR_RUNS} rounds, each running \
         every configuration once in turn; the added cost is the median minus the bare median.\n\n{table}\n## Two designs for whole stacks without frame pointers\n\n\
         {designs}\n## Stacks of a distribution binary\n\n{python}\n{}{by_hand}\n\n{}\n{}\n## Other figures\n\n{other}\n{}\n{device}\n## Targets\n\n\
         {targets}\n{notes}",
        crate::heavy_bench::SECTION.wrapped(&heavy),
        crate::start_bench::SECTION.wrapped(&start),
        crate::system_bench::SECTION.wrapped(&system),
        crate::serve_bench::SECTION.wrapped(&serve)
    );
    fs::write(workspace_root().join("BENCHMARKS.md"), doc)?;
    eprintln!("xtask bench: wrote BENCHMARKS.md");
    let _ = fs::remove_file(&scratch);
    Ok(())
}
