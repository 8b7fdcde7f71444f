//! `cargo xtask bench start` (and part of `cargo xtask bench`): what a user waits for around
//! the traced work — `memtrace record -- true` end to end with its default probes (user and
//! kernel), attaching to a running process and stopping again — beside heaptrack, perf and
//! bpftrace wrapped around the same command, and where memtrace's start goes (the kernel's
//! verification of each program, from its debug log). Figures from one session on one
//! machine; nothing here passes or fails.
use std::{
    fmt::Write as _,
    fs,
    io::{BufRead as _, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result, bail};

use crate::{bench::min_median, build_release, succeeds, target_dir};

/// This part's section of BENCHMARKS.md.
pub const SECTION: crate::Marked =
    crate::Marked { heading: "## Start and stop", begin: "<!-- start:begin -->", end: "<!-- start:end -->" };

const RUNS: usize = 5;

/// Seconds `make()` takes to run to its end, `RUNS` times: (min, median).
fn wall(mut make: impl FnMut() -> Command) -> Result<(f64, f64)> {
    let mut times = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let mut cmd = make();
        let started = Instant::now();
        let status = cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().with_context(|| format!("{cmd:?}"))?;
        if !status.success() {
            bail!("{cmd:?} failed: {status}");
        }
        times.push(started.elapsed().as_secs_f64());
    }
    Ok(min_median(times))
}

/// `memtrace record --pid` on a running process: seconds until it says it traces, and from
/// Ctrl-C until it has exited (recording finalized, probes gone), `RUNS` times: medians.
fn attach_and_stop(memtrace: &Path, data: &Path) -> Result<(f64, f64)> {
    let (mut attach, mut stop) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let mut target = Command::new("sleep").arg("60").spawn()?;
        let started = Instant::now();
        let mut rec = Command::new(memtrace)
            .args(["record", "--force", "-o"])
            .arg(data)
            .args(["--pid", &target.id().to_string()])
            .stderr(Stdio::piped())
            .spawn()?;
        let mut lines = BufReader::new(rec.stderr.take().context("stderr")?).lines();
        let traced = lines.by_ref().map_while(Result::ok).any(|l| l.contains("memtrace: tracing"));
        attach.push(started.elapsed().as_secs_f64());
        std::thread::spawn(move || lines.for_each(drop));
        let stopping = Instant::now();
        // SAFETY: signals our own child.
        unsafe { kill(rec.id() as i32, 2) };
        rec.wait()?;
        stop.push(stopping.elapsed().as_secs_f64());
        let _ = target.kill();
        let _ = target.wait();
        if !traced {
            bail!("memtrace record --pid did not start");
        }
    }
    Ok((min_median(attach).1, min_median(stop).1))
}

unsafe extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
}

/// One program's verification: name, instructions processed, milliseconds.
type Verified = (String, u64, u64);

/// Per program, and the whole parallel verification's ms, from
/// `MEMTRACE_LOG=debug memtrace record -- true`.
fn verification(memtrace: &Path, data: &Path) -> Result<(Vec<Verified>, Option<u64>)> {
    let out = Command::new(memtrace)
        .env("MEMTRACE_LOG", "debug")
        .args(["record", "--force", "-o"])
        .arg(data)
        .args(["--", "true"])
        .output()?;
    let log = String::from_utf8_lossy(&out.stderr);
    let mut programs = Vec::new();
    let mut total = None;
    for line in log.lines() {
        let Some(rest) = line.strip_prefix("memtrace: debug: ") else { continue };
        // After the line's timestamp (`+12.3ms: `).
        let rest = rest.split_once("ms: ").map_or(rest, |(_, r)| r);
        let number = |s: &str| s.trim().parse::<u64>().ok();
        if let Some((name, rest)) = rest.split_once(": ")
            && let Some((n, ms)) = rest.split_once(" instructions verified in ")
            && let (Some(n), Some(ms)) = (number(n), number(ms.trim_end_matches(" ms")))
        {
            programs.push((name.to_string(), n, ms));
        } else if let Some((_, rest)) = rest.split_once(" programs verified in ") {
            total = number(rest.split(" ms").next().unwrap_or(""));
        }
    }
    Ok((programs, total))
}

pub fn section(memtrace: &Path) -> Result<String> {
    let data = target_dir().join("bench").join("start.data");
    let memtrace_true = |extra: &'static [&'static str]| {
        let data = data.clone();
        move || {
            let mut c = Command::new(memtrace);
            c.args(["record", "--force", "-o"]).arg(&data).args(extra).args(["--", "true"]);
            c
        }
    };
    // One run first, so every table is in the unwind cache as for any later run.
    let _ = memtrace_true(&[])().stderr(Stdio::null()).status();
    eprintln!("xtask bench: start and stop, {RUNS} runs each");
    let mut rows: Vec<(&str, (f64, f64), &str)> = vec![
        ("true, bare", wall(|| Command::new("true"))?, "—"),
        ("memtrace record -- true", wall(memtrace_true(&[]))?, "malloc family, kmem tracepoints, stacks (defaults)"),
        ("memtrace record --no-kernel -- true", wall(memtrace_true(&["--no-kernel"]))?, "malloc family only"),
        ("memtrace record --no-user -- true", wall(memtrace_true(&["--no-user"]))?, "kmem tracepoints only"),
        (
            "heaptrack /usr/bin/true",
            wall(|| {
                let mut c = Command::new("heaptrack");
                c.arg("-o").arg(target_dir().join("bench").join("start-heaptrack")).arg("/usr/bin/true");
                c
            })?,
            "LD_PRELOAD, then its own interpreter",
        ),
        (
            "perf record -g -e kmem:kmalloc,kmem:kfree -- true",
            wall(|| {
                let mut c = Command::new("perf");
                c.args(["record", "-q", "-g", "-e", "kmem:kmalloc,kmem:kfree", "-o"])
                    .arg(target_dir().join("bench").join("start-perf.data"))
                    .args(["--", "true"]);
                c
            })?,
            "kernel side, frame-pointer stacks",
        ),
    ];
    if succeeds(Command::new("bpftrace").arg("--version")) {
        rows.push((
            "bpftrace (malloc entry/return, kmalloc, stacks) -c true",
            wall(|| {
                let mut c = Command::new("bpftrace");
                c.args([
                    "-e",
                    "uprobe:libc:malloc { @[ustack] = count(); } uretprobe:libc:malloc {} \
                     tracepoint:kmem:kmalloc { @k[kstack, ustack] = count(); }",
                    "-c",
                    "/usr/bin/true",
                ]);
                c
            })?,
            "the same probes in bpftrace 0.17",
        ));
    }
    let (attach, stop) = attach_and_stop(memtrace, &data)?;
    let (programs, parallel) = verification(memtrace, &data)?;
    let mut out = String::from("| command | min s | median s | what is traced |\n| --- | ---: | ---: | --- |\n");
    for (name, (min, median), what) in &rows {
        let _ = writeln!(out, "| {name} | {min:.3} | {median:.3} | {what} |");
        eprintln!("xtask bench: {name:<55} min {min:.3}  median {median:.3} s");
    }
    let _ = writeln!(
        out,
        "\n`memtrace record --pid` on a running `sleep`: {attach:.3} s until it traces, {stop:.3} s from Ctrl-C to its exit (medians of {RUNS})."
    );
    let mut programs = programs;
    programs.sort_by(|a, b| b.2.cmp(&a.2).then(b.1.cmp(&a.1)));
    let listed: Vec<String> = programs
        .iter()
        .filter(|p| p.1 >= 1000)
        .map(|(name, n, ms)| format!("{name} {}k instructions {ms} ms", n / 1000))
        .collect();
    let _ = writeln!(
        out,
        "\nThe kernel's verification of the probes is most of the start: {} verified {}on parallel threads ({}); the rest below 1k instructions each.",
        programs.len(),
        parallel.map_or_else(String::new, |ms| format!("in {ms} ms ")),
        listed.join(", ")
    );
    let _ = writeln!(
        out,
        "Every command: {RUNS} runs, warm unwind cache, wall time from start to exit (record: load, attach, the command, detach, finalize)."
    );
    Ok(out)
}

/// `cargo xtask bench start`: this section alone, replaced in BENCHMARKS.md.
pub fn run_alone() -> Result<()> {
    crate::require_root("bench")?;
    crate::setup()?;
    crate::ensure_tools(&[("bpftrace", "bpftrace"), ("heaptrack", "heaptrack"), ("perf", "linux-perf")])?;
    let (memtrace, _) = build_release()?;
    fs::create_dir_all(target_dir().join("bench"))?;
    crate::update_benchmarks("start-and-stop", &SECTION, &section(&memtrace)?)
}
