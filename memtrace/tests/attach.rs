//! How the probes are attached and detached (issue #13): uprobe session links, plain
//! multi-uprobe links and the one-perf-event-per-probe fallback give the same exact counts, forked children are traced
//! from their first instruction, and no probe is left in a process once `record` returns.
mod common;

use std::{
    fs,
    io::{Read as _, Seek as _},
    path::Path,
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use common::*;

/// Env var that forces an older attach path (`multi`: no sessions; `perf`: per probe).
const ATTACH_ENV: &str = "MEMTRACE_UPROBE_ATTACH";

/// Records the workload and returns memtrace's debug log.
fn record_workload(data: &Path, manifest: &Path, env: Option<&str>) -> String {
    let mut cmd = memtrace();
    if let Some(path) = env {
        cmd.env(ATTACH_ENV, path);
    }
    let out = run(cmd
        .env("MEMTRACE_LOG", "debug")
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(data)
        .arg("--")
        .arg(workload())
        .args(["--threads", "2", "--iterations", "100", "--leaks", "2", "--pipes", "0", "--manifest"])
        .arg(manifest)
        .stdout(Stdio::null()));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn both_attach_paths_count_every_allocation_exactly() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("attach-paths");
    // This kernel (6.18) has uprobe sessions (6.13): the default path uses them.
    let paths = [
        ("session", None, "uprobes attach through uprobe_multi links, one uprobe session link per file"),
        ("multi", Some("multi"), "uprobes attach through uprobe_multi links\n"),
        ("perf", Some("perf"), "uprobes attach through one perf event per probe"),
    ];
    for (name, env, said) in paths {
        let data = dir.join(format!("{name}.data"));
        let manifest_path = dir.join(format!("{name}.json"));
        let log = record_workload(&data, &manifest_path, env);
        assert!(log.contains(said), "{name}: the debug log does not say {said:?}:\n{log}");
        let report = report_json(&data, &["--by", "function", "--domain", "user"]);
        assert_matches_manifest(&report, &manifest(&manifest_path));
        assert_eq!(report["lost_events"], 0, "{name}");
    }
}

#[test]
fn forked_children_are_traced_from_their_first_instruction() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("fork-children");
    let data = dir.join("children.data");
    // Each child allocates the moment it exists and exits: nothing is left to attach to
    // after userspace reads the fork. The kernel adds it to the traced set at its fork.
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(["--fork-children", "40"])
        .stdout(Stdio::null()));
    let report = report_json(&data, &["--by", "function", "--domain", "user"]);
    let child = site(&report, "wl_child_alloc").unwrap_or_else(|| panic!("no wl_child_alloc site in {report:#}"));
    assert_eq!(child["allocs"], 400);
    assert_eq!(child["frees"], 280);
    assert_eq!(child["bytes_req"], 400 * 77);
    assert_eq!(child["live_allocs"], 120);
    assert_eq!(report["totals"]["user"]["unmatched_frees"].as_u64().unwrap_or(0), 0, "{:#}", report["totals"]);
}

/// The byte at `addr` in a process's memory.
fn byte_at(pid: u32, addr: u64) -> u8 {
    let mut mem = fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    mem.seek(std::io::SeekFrom::Start(addr)).unwrap();
    let mut b = [0u8];
    mem.read_exact(&mut b).unwrap();
    b[0]
}

/// The address of libc's `malloc` in a process (where its entry probe sits, or a few
/// bytes before).
fn malloc_range(pid: u32) -> (u64, u64) {
    let maps = fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let line = maps.lines().find(|l| l.contains("libc.so") && l.contains("r-xp")).unwrap();
    let mut parts = line.split_whitespace();
    let start = u64::from_str_radix(parts.next().unwrap().split('-').next().unwrap(), 16).unwrap();
    let _perms = parts.next();
    let offset = u64::from_str_radix(parts.next().unwrap(), 16).unwrap();
    let path = line.split_whitespace().last().unwrap();
    let nm = Command::new("nm").args(["-D", "-S", path]).output().unwrap();
    let (addr, size) = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .find_map(|l| {
            let p: Vec<&str> = l.split_whitespace().collect();
            (p.len() == 4 && p[3] == "malloc@@GLIBC_2.2.5")
                .then(|| (u64::from_str_radix(p[0], 16).unwrap(), u64::from_str_radix(p[1], 16).unwrap()))
        })
        .unwrap();
    (start + addr - offset, size.min(64))
}

fn breakpoints_in(pid: u32, (addr, len): (u64, u64)) -> usize {
    (0..len).filter(|i| byte_at(pid, addr + i) == 0xcc).count()
}

#[test]
fn no_probe_is_left_once_record_returns_on_either_path() {
    require_root();
    // Its target keeps a core busy: the exact-count tests wait.
    let _alone = alone_on_the_machine();
    let dir = scratch("detach");
    for env in [None, Some("multi"), Some("perf")] {
        let mut target = Command::new(workload()).args(["--loop-seconds", "15"]).stdout(Stdio::null()).spawn().unwrap();
        thread::sleep(Duration::from_millis(200));
        let pid = target.id();
        let malloc = malloc_range(pid);
        assert_eq!(breakpoints_in(pid, malloc), 0, "no breakpoint before tracing");
        let mut cmd = memtrace();
        if let Some(path) = env {
            cmd.env(ATTACH_ENV, path);
        }
        let mut rec = cmd
            .args(["record", "-q", "--no-kernel", "-d", "1500ms", "--pid", &pid.to_string(), "-o"])
            .arg(dir.join("d.data"))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // While tracing, malloc carries a breakpoint.
        let deadline = Instant::now() + Duration::from_secs(5);
        while breakpoints_in(pid, malloc) == 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(breakpoints_in(pid, malloc), 1, "{env:?}: one breakpoint while tracing");
        assert!(rec.wait().unwrap().success());
        // The moment record returns, every probe is gone.
        assert_eq!(breakpoints_in(pid, malloc), 0, "{env:?}: a breakpoint outlived record");
        target.kill().unwrap();
        target.wait().unwrap();
    }
}

/// With uprobe sessions an unsampled call costs its entry probe only: the entry program
/// tells the kernel to skip the return. The probes count the returns they run for.
#[test]
fn a_uprobe_session_skips_the_return_of_calls_it_does_not_record() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("session-returns");
    let returns = |env: Option<&str>| -> u64 {
        let data = dir.join("r.data");
        let mut cmd = memtrace();
        if let Some(path) = env {
            cmd.env(ATTACH_ENV, path);
        }
        // 20,000 malloc(32)+free pairs sampled at a mean of 1 GiB: almost none is sampled.
        run(cmd
            .args(["record", "-q", "--force", "--no-kernel", "--sample-bytes", "1g", "-o"])
            .arg(&data)
            .arg("--")
            .arg(workload())
            .args(["--loop", "20000"])
            .stdout(Stdio::null()));
        let report = report_json(&data, &[]);
        report["recorder"]["user_returns"].as_u64().unwrap_or_else(|| panic!("{:#}", report["recorder"]))
    };
    let session = returns(None);
    let multi = returns(Some("multi"));
    // Without sessions every call's return runs; with them only those of the few calls
    // recorded (sampled ones, and reallocs, which keep their state whatever the draw).
    assert!(multi >= 20_000, "multi links: {multi} returns for 20,000 calls");
    assert!(session < 1_000, "uprobe session: {session} returns for 20,000 unsampled calls");
}
