//! The always-on agent's figures (`memtrace serve`, sampled as it runs by default): its
//! added cost on the malloc loop, on the kernel-allocation-heavy loop and on a real
//! program (python3) under `serve -a`, and a soak — several minutes of a steady allocating
//! service plus short-lived processes, scraped every second — whose resident-memory slope
//! after warm-up says whether memory stays flat. `cargo xtask bench` includes this section;
//! `cargo xtask bench serve` measures it alone and replaces it in BENCHMARKS.md.
use std::{
    fmt::Write as _,
    fs,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::Path,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{
    bench::{BARE_PAIRS, PYTHON_SCRIPT, RUNS, TRACED_PAIRS, measure, min_median, run_for_figure},
    build_release, target_dir,
};

/// This part's section of BENCHMARKS.md.
pub const SECTION: crate::Marked = crate::Marked {
    heading: "## Always-on agent (`memtrace serve`)",
    begin: "<!-- serve:begin -->",
    end: "<!-- serve:end -->",
};

/// A running `memtrace serve`.
struct Agent {
    child: Child,
    addr: SocketAddr,
}

impl Agent {
    fn start(memtrace: &Path, args: &[&str]) -> Result<Self> {
        let mut child = Command::new(memtrace)
            .args(["serve", "--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()?;
        let mut lines = BufReader::new(child.stderr.take().context("stderr")?).lines();
        let mut addr = None;
        for line in lines.by_ref() {
            let line = line?;
            if let Some(rest) = line.strip_prefix("memtrace: serving on http://") {
                addr = rest.split(": ").next().and_then(|a| a.parse().ok());
            }
            if line.contains("memtrace: tracing") {
                std::thread::spawn(move || lines.for_each(drop));
                let addr = addr.context("memtrace serve did not say where it listens")?;
                return Ok(Self { child, addr });
            }
        }
        bail!("memtrace serve did not start")
    }

    fn get(&self, path: &str) -> Result<(u16, Vec<u8>)> {
        let mut s = TcpStream::connect(self.addr)?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr)?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let split = raw.windows(4).position(|w| w == b"\r\n\r\n").context("no response head")?;
        let code = String::from_utf8_lossy(&raw[..split]).split(' ').nth(1).unwrap_or("0").parse()?;
        Ok((code, raw[split + 4..].to_vec()))
    }

    fn rss_bytes(&self) -> u64 {
        fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|s| {
                s.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix(" kB")?.trim().parse::<u64>().ok())
            })
            .map_or(0, |kb| kb * 1024)
    }

    fn stop(mut self) -> Result<()> {
        // SAFETY: signals our own child.
        unsafe { libc_kill(self.child.id() as i32, 15) };
        self.child.wait()?;
        Ok(())
    }
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// The value of an unlabelled sample in an exposition.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Least-squares slope of (seconds, bytes) points, in bytes per second.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if n < 2.0 {
        return 0.0;
    }
    let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
    if sxx == 0.0 { 0.0 } else { sxy / sxx }
}

/// Median wall time of `make()`, `runs` times, in seconds.
fn wall(runs: usize, mut make: impl FnMut() -> Command) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..runs {
        let started = Instant::now();
        let status = make().stdout(Stdio::null()).stderr(Stdio::null()).status()?;
        if !status.success() {
            bail!("a benchmark command failed ({status})");
        }
        v.push(started.elapsed().as_secs_f64());
    }
    Ok(min_median(v).1)
}

/// The section, as markdown.
pub fn section(memtrace: &Path, workloads: &Path) -> Result<String> {
    let workload = workloads.join("alloc_workload");
    let mut out = String::new();

    eprintln!("xtask bench: serve, on the malloc loop");
    let bare = measure("bare", "no tracing", || {
        let mut c = Command::new(&workload);
        c.args(["--loop", BARE_PAIRS]);
        c
    })?;
    let under = |extra: &'static [&'static str]| {
        let memtrace = memtrace.to_path_buf();
        let workload = workload.clone();
        move || {
            let mut c = Command::new(&memtrace);
            c.args(["serve", "--listen", "127.0.0.1:0"])
                .args(extra)
                .arg("--")
                .arg(&workload)
                .args(["--loop", TRACED_PAIRS]);
            c
        }
    };
    let sampled = measure("memtrace serve (default: sampled, 512 KiB)", "", under(&[]))?;
    let full = measure("memtrace serve --sample-bytes 0", "", under(&["--sample-bytes", "0"]))?;
    let _ = writeln!(
        out,
        "| malloc+free loop | min ns/pair | median ns/pair | added, median |\n| --- | ---: | ---: | ---: |"
    );
    let _ = writeln!(out, "| {} | {:.1} | {:.1} | — |", bare.name, bare.min, bare.median);
    for c in [&sampled, &full] {
        let _ = writeln!(out, "| {} | {:.1} | {:.1} | {:.0} ns |", c.name, c.min, c.median, c.median - bare.median);
    }
    let _ = writeln!(
        out,
        "\n`alloc_workload --loop N` under `memtrace serve -- …` ({TRACED_PAIRS} pairs traced, {BARE_PAIRS} bare), {RUNS} runs each.\n"
    );

    eprintln!("xtask bench: serve -a, on the kernel-heavy loop and on python3");
    let kernel = || {
        let mut c = Command::new(&workload);
        c.args(["--kernel-loop", "100000"]);
        c
    };
    let python = fs::canonicalize("/usr/bin/python3").context("python3 is needed for this figure")?;
    let py = || {
        let mut c = Command::new(&python);
        c.args(["-c", PYTHON_SCRIPT]);
        c
    };
    let mut rows = Vec::new();
    let mut kernel_bare = Vec::new();
    for _ in 0..3 {
        kernel_bare.push(run_for_figure(&mut kernel())?);
    }
    let kb = min_median(kernel_bare).1;
    let py_bare = wall(3, py)?;
    for (name, args) in [
        ("memtrace serve -a", &["-a"][..]),
        ("memtrace serve -a --no-kernel-stacks (deploy/ default)", &["-a", "--no-kernel-stacks"][..]),
    ] {
        let agent = Agent::start(memtrace, args)?;
        let mut k = Vec::new();
        for _ in 0..3 {
            k.push(run_for_figure(&mut kernel())?);
        }
        let kt = min_median(k).1;
        let pt = wall(3, py)?;
        agent.stop()?;
        rows.push((name, kt, pt));
    }
    let _ = writeln!(
        out,
        "| under | pipe()+close(), median ns | slowdown | python3 script, median s | slowdown |\n| --- | ---: | ---: | ---: | ---: |\n| bare | {kb:.0} | — | {py_bare:.2} | — |"
    );
    for (name, kt, pt) in rows {
        let _ = writeln!(
            out,
            "| {name} | {kt:.0} | {:.0} % | {pt:.2} | {:.0} % |",
            (kt / kb - 1.0) * 100.0,
            (pt / py_bare - 1.0) * 100.0
        );
    }
    let _ = writeln!(
        out,
        "\nThe kernel-heavy loop is `alloc_workload --kernel-loop 100000`; python3 runs the JSON/regex script of the \
         stacks figure above; 3 runs each, the agent tracing the whole machine meanwhile.\n"
    );

    let seconds: u64 = std::env::var("MEMTRACE_SOAK_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(600);
    eprintln!("xtask bench: serve soak, {seconds} s");
    out.push_str(&soak(memtrace, &workload, seconds)?);
    Ok(out)
}

/// Several minutes of `serve -a` (as deploy/ runs it) on a steady service and a stream of
/// short-lived processes, scraped like Prometheus and Parca would.
fn soak(memtrace: &Path, workload: &Path, seconds: u64) -> Result<String> {
    let agent = Agent::start(memtrace, &["-a", "--no-kernel-stacks"])?;
    let mut steady = Command::new(workload)
        .args(["--loop-seconds", &seconds.to_string(), "--loop-threads", "1"])
        .stdout(Stdio::null())
        .spawn()?;
    let churn_script = format!(
        "end=$(($(date +%s)+{seconds})); while [ $(date +%s) -lt $end ]; do {} --threads 2 --iterations 200 --leaks 5 >/dev/null; sleep 0.2; done",
        workload.display()
    );
    let mut churn = Command::new("sh").args(["-c", &churn_script]).spawn()?;
    let started = Instant::now();
    let mut samples: Vec<(f64, f64)> = Vec::new();
    let mut failed_scrapes = 0u64;
    let mut scrapes = 0u64;
    let mut tick = 0u64;
    while started.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_secs(1));
        tick += 1;
        let mut paths = vec!["/metrics"];
        if tick.is_multiple_of(10) {
            paths.extend(["/debug/pprof/heap", "/debug/pprof/allocs"]);
        }
        for p in paths {
            scrapes += 1;
            if !matches!(agent.get(p), Ok((200, _))) {
                failed_scrapes += 1;
            }
        }
        if tick.is_multiple_of(5) {
            samples.push((started.elapsed().as_secs_f64(), agent.rss_bytes() as f64));
        }
    }
    let (_, body) = agent.get("/metrics")?;
    let text = String::from_utf8_lossy(&body).into_owned();
    let _ = steady.wait();
    let _ = churn.wait();
    agent.stop()?;
    // The bounded tables (the unwinder's rules and process maps, above all) fill during
    // the first minutes of process churn: the slope is taken over the second half.
    let warmup = seconds as f64 / 2.0;
    let after: Vec<(f64, f64)> = samples.iter().copied().filter(|p| p.0 >= warmup).collect();
    let per_min = slope(&after) * 60.0;
    let mb = |b: f64| b / (1 << 20) as f64;
    let first = after.first().map_or(0.0, |p| p.1);
    let last = after.last().map_or(0.0, |p| p.1);
    let peak = samples.iter().map(|p| p.1).fold(0.0, f64::max);
    let low = after.iter().map(|p| p.1).fold(f64::MAX, f64::min);
    let high = after.iter().map(|p| p.1).fold(0.0, f64::max);
    // The whole trajectory, for a closer look.
    let csv: String = samples.iter().map(|(t, b)| format!("{t:.0},{}\n", *b as u64)).collect();
    let _ = fs::write(target_dir().join("bench").join("serve-soak-rss.csv"), format!("seconds,rss_bytes\n{csv}"));
    let mut out = String::new();
    let _ = writeln!(out, "| soak figure | value |\n| --- | ---: |");
    let _ = writeln!(out, "| duration | {seconds} s ({} RSS samples, warm-up {warmup:.0} s) |", samples.len());
    let _ = writeln!(out, "| **RSS slope after warm-up** | **{:+.1} KiB/min** |", per_min / 1024.0);
    let start = samples.first().map_or(0.0, |p| p.1);
    let _ = writeln!(
        out,
        "| RSS 5 s in → after warm-up → at the end | {:.1} MiB → {:.1} MiB → {:.1} MiB |",
        mb(start),
        mb(first),
        mb(last)
    );
    let _ = writeln!(out, "| RSS range over the second half | {:.1} – {:.1} MiB |", mb(low), mb(high));
    let _ = writeln!(out, "| peak RSS | {:.1} MiB |", mb(peak));
    let _ = writeln!(out, "| scrapes (failed) | {scrapes} ({failed_scrapes}) |");
    for (name, what) in [
        ("memtrace_processes_dropped_total", "exited processes dropped"),
        ("memtrace_events_total", "events received"),
        ("memtrace_events_lost_total", "events lost"),
        ("memtrace_stacks", "stacks kept at the end"),
        ("memtrace_tracked_blocks", "live blocks followed at the end"),
        ("process_cpu_seconds_total", "agent CPU, s"),
    ] {
        if let Some(v) = metric(&text, name) {
            let _ = writeln!(out, "| {what} | {v:.0} |");
        }
    }
    let _ = writeln!(
        out,
        "\n`memtrace serve -a --no-kernel-stacks` (as `deploy/` runs it) while `alloc_workload --loop-seconds {seconds}` \
         allocates steadily and a shell starts a short-lived `alloc_workload --threads 2 --iterations 200` every \
         0.2 s (tens of new processes a second, counting the shell's); /metrics scraped every second, both \
         profiles every 10 s. The slope is a least-squares fit of the agent's VmRSS, sampled every 5 s, over the \
         second half (warm-up: the first half, while the bounded tables fill); every sample is in \
         `target/bench/serve-soak-rss.csv`."
    );
    Ok(out)
}

/// `cargo xtask bench serve`: this section alone, replaced in BENCHMARKS.md.
pub fn run_alone() -> Result<()> {
    crate::require_root("bench")?;
    crate::setup()?;
    let (memtrace, workloads) = build_release()?;
    fs::create_dir_all(target_dir().join("bench"))?;
    crate::update_benchmarks("serve", &SECTION, &section(&memtrace, &workloads)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_section_is_replaced_in_place_or_appended() {
        let doc = "# b\n\n## Other\n\nx\n";
        let once = SECTION.replace(doc, "first");
        assert!(once.starts_with("# b\n\n## Other\n\nx\n\n## Always-on agent"));
        assert!(once.contains("first"));
        let mut twice = SECTION.replace(&once, "second");
        assert!(!twice.contains("first") && twice.contains("second"));
        twice.push_str("\n## Later\n");
        let thrice = SECTION.replace(&twice, "third");
        assert!(thrice.contains("third\n<!-- serve:end -->\n## Later"), "{thrice}");
    }

    #[test]
    fn slopes_fit_a_line() {
        assert_eq!(slope(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]), 2.0);
        assert_eq!(slope(&[(0.0, 1.0)]), 0.0);
        assert_eq!(metric("a_total 3\nb 4.5\n", "b"), Some(4.5));
    }
}
