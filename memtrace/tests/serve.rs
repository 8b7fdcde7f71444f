//! `memtrace serve` with real probes, serving the bundled workload's leaking service
//! (`--steady-leak`): a real Prometheus (Debian's) stores a growing live-bytes series for
//! the leaking function; the heap profile decodes to Go's four sample types with in-use
//! bytes within 30 % of the truth when sampled and exact in full capture; a delta profile
//! holds only its window; `go tool pprof` reads the endpoints over HTTP (where Go is
//! installed); new processes are picked up under -a and dropped after their last scrape;
//! a taken port, a traced pid that exits and SIGTERM during a scrape end with a clear
//! message and no probe left behind.
mod common;
#[path = "common/pprof.rs"]
mod pprof;

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use common::*;
use serde_json::Value;

/// A running agent: its address and what it said on stderr.
struct Agent {
    child: Child,
    addr: SocketAddr,
    stderr: Arc<Mutex<String>>,
}

/// Starts `memtrace serve --listen 127.0.0.1:0 ARGS` and waits until it traces.
fn start(args: &[&str], stdin: Stdio, stdout: Stdio) -> Agent {
    let mut child = memtrace()
        .args(["serve", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdin(stdin)
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = String::new();
    let mut addr = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if let Some(rest) = line.strip_prefix("memtrace: serving on http://") {
            addr = Some(rest.split(':').take(2).collect::<Vec<_>>().join(":").parse().unwrap());
        }
        if line.contains("memtrace: tracing") {
            break;
        }
    }
    let Some(addr) = addr else { panic!("memtrace serve did not start:\n{seen}") };
    let stderr = Arc::new(Mutex::new(seen));
    let collected = Arc::clone(&stderr);
    thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            let mut s = collected.lock().unwrap();
            s.push_str(&line);
            s.push('\n');
        }
    });
    Agent { child, addr, stderr }
}

impl Agent {
    fn get(&self, path: &str) -> (u16, Vec<u8>) {
        http_get(self.addr, path, "")
    }

    fn metrics(&self) -> String {
        let (code, body) = self.get("/metrics");
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
        String::from_utf8(body).unwrap()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Signals the agent and waits for it (at most 15 s): its exit code and stderr.
    fn stop(mut self, sig: i32) -> (Option<i32>, String) {
        signal(self.child.id(), sig);
        let status = wait_at_most(&mut self.child, Duration::from_secs(15));
        thread::sleep(Duration::from_millis(100));
        (status, self.stderr())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_at_most(child: &mut Child, limit: Duration) -> Option<i32> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status.code().unwrap_or(-1));
        }
        assert!(Instant::now() < deadline, "pid {} did not exit within {limit:?}", child.id());
        thread::sleep(Duration::from_millis(50));
    }
}

/// An HTTP/1.0 GET (no chunked replies to decode): (status, body).
fn http_get(addr: SocketAddr, path: &str, headers: &str) -> (u16, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{headers}\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    (head.split(' ').nth(1).unwrap().parse().unwrap(), raw[split + 4..].to_vec())
}

/// The leaking service: started (waiting for a line on stdin first when `wait`), its
/// stdin and its JSON lines.
struct Service {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: std::io::Lines<BufReader<ChildStdout>>,
}

fn service(args: &[&str], wait: bool) -> Service {
    let mut cmd = Command::new(workload());
    cmd.arg("--steady-leak").args(args);
    if wait {
        cmd.arg("--wait-stdin");
    }
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let stdin = child.stdin.take();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    if wait {
        assert_eq!(lines.next().unwrap().unwrap(), "waiting");
    }
    Service { child, stdin, lines }
}

impl Service {
    fn go(&mut self) {
        writeln!(self.stdin.as_mut().unwrap(), "go").unwrap();
    }

    /// The next JSON line it prints.
    fn next(&mut self) -> Value {
        let line = self.lines.next().expect("a line from the workload").unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` every 200 ms until it returns Some, for at most `limit`.
fn eventually<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(200));
    }
}

/// The value of the first sample line of `metric` whose labels contain every needle.
fn sample(text: &str, metric: &str, needles: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .find(|l| needles.iter().all(|n| l.contains(n)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[test]
fn prometheus_stores_a_growing_live_bytes_series_for_the_leak() {
    require_root();
    let _machine = alone_on_the_machine();
    let prometheus = std::env::var_os("PROMETHEUS").unwrap_or_else(|| "prometheus".into());
    let dir = scratch("serve-prometheus");
    let agent =
        start(&["--", workload().to_str().unwrap(), "--steady-leak", "--step-ms", "50"], Stdio::null(), Stdio::null());
    let text = eventually(Duration::from_secs(20), "the leak in /metrics", || {
        let text = agent.metrics();
        sample(&text, "memtrace_live_bytes", &["site=\"wl_steady_leak ("]).map(|_| text)
    });
    // The probes' own kernel allocations (the uprobe machinery's state for each traced
    // thread, the BPF programs' task storage) are counted apart, in no site.
    let probes = text.lines().find_map(|l| l.strip_prefix("memtrace_probe_allocations_total "));
    assert!(probes.is_some_and(|n| n.parse::<u64>().unwrap() > 0), "{text}");
    for machinery in ["alloc_utask", "__create_xol_area", "handler_chain", "alloc_bulk", "uprobe_"] {
        assert!(!text.lines().any(|l| l.contains("site=") && l.contains(machinery)), "{machinery}: {text}");
    }
    // So are a new slab's pages (its objects count in their own sites).
    assert!(text.lines().any(|l| l.starts_with("memtrace_slab_page_allocations_total ")), "{text}");
    assert!(!text.contains("site=\"allocate_slab"), "{text}");
    // promtool reads the classic text format memtrace serves to clients that do not ask
    // for OpenMetrics.
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package: cargo xtask setup installs it)");
    promtool.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let checked = promtool.wait_with_output().unwrap();
    assert!(
        checked.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&checked.stdout),
        String::from_utf8_lossy(&checked.stderr)
    );

    // A real Prometheus scraping every second (it asks for OpenMetrics).
    let port = free_port();
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: memtrace\n    scrape_interval: 1s\n    scrape_timeout: 1s\n    params:\n      module: [memtrace]\n    static_configs:\n      - targets: ['{}']\n",
            agent.addr
        ),
    )
    .unwrap();
    let mut server = Command::new(&prometheus)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .arg("--log.level=warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("prometheus (Debian's prometheus package: cargo xtask setup installs it)");
    let api: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let query = |q: &str| -> Value {
        let (code, body) = http_get(api, &format!("/api/v1/query?query={}", percent_encode(q)), "");
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).unwrap()
    };
    eventually(Duration::from_secs(30), "Prometheus to start", || {
        TcpStream::connect(api).ok().and_then(|_| (http_get(api, "/-/ready", "").0 == 200).then_some(()))
    });
    let mut seen: Vec<f64> = Vec::new();
    let series = eventually(Duration::from_secs(40), "a growing series in Prometheus", || {
        let r = query(r#"memtrace_live_bytes{job="memtrace",site=~"wl_steady_leak .*"}"#);
        let result = r["data"]["result"].as_array()?.first()?.clone();
        let value: f64 = result["value"][1].as_str()?.parse().ok()?;
        if seen.last() != Some(&value) {
            seen.push(value);
        }
        (seen.len() >= 3 && seen.windows(2).all(|w| w[1] > w[0])).then_some(result)
    });
    assert_eq!(series["metric"]["domain"], "user");
    assert_eq!(series["metric"]["comm"], "alloc_workload");
    assert!(series["metric"]["cgroup"].as_str().is_some_and(|c| c.starts_with('/')), "{series}");
    // Scraped cleanly, counters included.
    let up = query(r#"up{job="memtrace"}"#);
    assert_eq!(up["data"]["result"][0]["value"][1], "1", "{up}");
    let allocs = query(r#"rate(memtrace_allocations_total{site=~"wl_steady_leak .*"}[5s])"#);
    let rate: f64 = allocs["data"]["result"][0]["value"][1].as_str().unwrap_or("0").parse().unwrap();
    assert!(rate > 0.0, "{allocs}");
    // How full the rings were, a histogram Prometheus reads (one observation per drain).
    let drains = query(r#"memtrace_ring_fill_ratio_count{job="memtrace"}"#);
    let drains: f64 = drains["data"]["result"][0]["value"][1].as_str().unwrap_or("0").parse().unwrap();
    assert!(drains > 0.0, "{drains}");
    let quantile = query(r#"histogram_quantile(0.99, memtrace_ring_fill_ratio_bucket{job="memtrace"})"#);
    let quantile: f64 = quantile["data"]["result"][0]["value"][1].as_str().unwrap_or("NaN").parse().unwrap();
    assert!((0.0..=1.0).contains(&quantile), "{quantile}");
    signal(server.id(), libc::SIGTERM);
    wait_at_most(&mut server, Duration::from_secs(20));
    let (status, stderr) = agent.stop(libc::SIGTERM);
    // SIGTERM goes to the command first; memtrace exits with its status.
    assert_eq!(status, Some(128 + libc::SIGTERM), "{stderr}");
    assert!(stderr.contains("every probe removed"), "{stderr}");
}

/// The heap profile after `steps` steps of the service under `serve --pid`, and what the
/// service says it leaked.
fn heap_after_the_leak(extra: &[&str]) -> (pprof::Profile, Value, String) {
    heap_after(&["--leak-steps", "100", "--leak-per-step", "16", "--step-ms", "5"], extra)
}

/// The heap profile after the service run with `service_args` under `serve --pid`
/// (`extra` added), and what the service says it allocated.
fn heap_after(service_args: &[&str], extra: &[&str]) -> (pprof::Profile, Value, String) {
    let mut svc = service(service_args, true);
    let pid = svc.pid().to_string();
    let mut args = vec!["--pid", &pid, "--no-kernel"];
    args.extend_from_slice(extra);
    let agent = start(&args, Stdio::null(), Stdio::null());
    svc.go();
    assert_eq!(svc.next()["event"], "started");
    let done = svc.next();
    assert_eq!(done["event"], "done");
    // What the probes sent is in the model within the drain interval and reorder lag.
    thread::sleep(Duration::from_millis(500));
    let (code, body) = agent.get("/debug/pprof/heap");
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let profile = pprof::decode_gzipped(&body);
    let (status, stderr) = agent.stop(libc::SIGTERM);
    assert_eq!(status, Some(0), "{stderr}");
    (profile, done, stderr)
}

/// A sampling countdown not drawn yet must not sample the first call on each CPU. Under
/// `--pid` only the service's calls draw (its links are its own), and each CPU's first one
/// was always sampled: a phantom block at the first site each CPU met, standing for
/// mean/size allocations. A service allocating ~300 KiB under 1 GiB sampling samples
/// nothing but with odds of about 3 in 10,000.
#[test]
fn pid_sampling_starts_with_a_drawn_countdown_on_every_cpu() {
    require_root();
    let _machine = alone_on_the_machine();
    let (p, _, _) = heap_after(
        &["--leak-steps", "3", "--leak-per-step", "1", "--leak-block", "16", "--step-ms", "5"],
        &["--sample-bytes", "1G"],
    );
    for site in ["wl_startup", "wl_steady_leak", "wl_churn"] {
        assert_eq!(p.sum_for(site, 0), 0, "{site}: no allocation sampled");
    }
}

const INUSE_OBJECTS: usize = 2;
const INUSE_SPACE: usize = 3;

#[test]
fn the_heap_profile_is_within_30_percent_sampled_and_exact_in_full_capture() {
    require_root();
    let _machine = alone_on_the_machine();
    // Sampled (the default: one sample per 512 KiB, like Go).
    let (p, truth, _) = heap_after_the_leak(&[]);
    let types: Vec<String> = p.sample_types().into_iter().map(|(t, _)| t).collect();
    assert_eq!(types, ["alloc_objects", "alloc_space", "inuse_objects", "inuse_space"]);
    assert_eq!(p.default_sample_type, 0, "unset for heap, as Go leaves it (readers show inuse_space)");
    assert_eq!(p.period, 512 << 10);
    let got = p.sum_for("wl_steady_leak", INUSE_SPACE) as f64;
    let want = truth["leak_bytes_alloc"].as_f64().unwrap();
    // On a miss, what tells chance from a fault: the blocks estimated beside the bytes (a
    // sample given another call's size shows as bytes per block far from the leak's own),
    // and the stacks they are in.
    let objects = p.sum_for("wl_steady_leak", INUSE_OBJECTS);
    let stacks = p.sample.iter().filter(|s| p.functions(s).iter().any(|f| f == "wl_steady_leak")).count();
    let detail = format!(
        "{got} estimated, {want} true ({:+.1} %); {objects} blocks estimated ({} true), {:.0} bytes per block \
         ({:.0} true), in {stacks} stacks",
        (got / want - 1.0) * 100.0,
        truth["leak_blocks"],
        got / objects.max(1) as f64,
        want / truth["leak_blocks"].as_f64().unwrap()
    );
    eprintln!("sampled in-use bytes of wl_steady_leak: {detail}");
    assert!((got - want).abs() / want <= 0.30, "in-use bytes of wl_steady_leak: {detail}");
    // Full capture: exact.
    let (p, truth, _) = heap_after_the_leak(&["--sample-bytes", "0"]);
    assert_eq!(p.period, 1);
    assert_eq!(p.sum_for("wl_steady_leak", INUSE_SPACE), truth["leak_bytes_alloc"].as_i64().unwrap());
    assert_eq!(p.sum_for("wl_steady_leak", INUSE_OBJECTS), truth["leak_blocks"].as_i64().unwrap());
    assert_eq!(p.sum_for("wl_startup", INUSE_SPACE), truth["startup_bytes_alloc"].as_i64().unwrap());
    assert_eq!(p.sum_for("wl_churn", INUSE_OBJECTS), 0, "churn is freed");
    assert!(p.sum_for("wl_churn", 0) >= 100 * 32, "and counted in alloc_objects");
    let s = p.sample.iter().find(|s| p.functions(s).iter().any(|f| f == "wl_steady_leak")).unwrap();
    assert_eq!(p.label(s, "process").as_deref(), Some("alloc_workload"));
}

#[test]
fn a_delta_profile_holds_only_its_window() {
    require_root();
    let _machine = alone_on_the_machine();
    let mut svc = service(&["--step-ms", "50"], true);
    let pid = svc.pid().to_string();
    let agent = start(&["--pid", &pid, "--sample-bytes", "0", "--no-kernel"], Stdio::null(), Stdio::null());
    svc.go();
    assert_eq!(svc.next()["event"], "started");
    thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let (code, body) = agent.get("/debug/pprof/allocs?seconds=2");
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    assert!(started.elapsed() >= Duration::from_secs(2));
    let delta = pprof::decode_gzipped(&body);
    assert!((delta.duration_nanos - 2_000_000_000).abs() < 500_000_000, "{}", delta.duration_nanos);
    assert_eq!(delta.string(delta.default_sample_type), "alloc_space", "allocs: alloc_space first, as Go");
    // The startup burst happened before the window: not in it. The leak in the window:
    // 8 blocks per 50 ms step, about 40 steps.
    assert_eq!(delta.sum_for("wl_startup", 0), 0);
    let leaked = delta.sum_for("wl_steady_leak", 0);
    assert!((200..=400).contains(&leaked), "{leaked} blocks leaked in the window");
    assert_eq!(delta.sum_for("wl_steady_leak", INUSE_OBJECTS), leaked, "none freed");
    // Churn is freed at once, but the window can close inside a churn step (32 blocks
    // allocated, then freed): at most those are still in use at its end (seen once in a
    // full `cargo xtask test` run on a busy 2-core machine: 18).
    let churn_live = delta.sum_for("wl_churn", INUSE_OBJECTS);
    assert!((0..=32).contains(&churn_live), "{churn_live} churn blocks in use at the window's end");
    // The whole profile has both.
    let (_, body) = agent.get("/debug/pprof/allocs");
    let all = pprof::decode_gzipped(&body);
    assert_eq!(all.sum_for("wl_startup", 0), 8);
    assert!(all.sum_for("wl_steady_leak", 0) > leaked);
    // Filters: this pid, the user domain; another pid is a bad request.
    let (code, _) = agent.get(&format!("/debug/pprof/heap?pid={pid}&domain=user"));
    assert_eq!(code, 200);
    let (code, body) = agent.get("/debug/pprof/heap?pid=1");
    assert_eq!((code, String::from_utf8_lossy(&body).trim()), (400, "pid 1 is not traced (or exited and was dropped)"));
    let (code, body) = agent.get("/debug/pprof/heap?seconds=x");
    assert_eq!(code, 400, "{}", String::from_utf8_lossy(&body));
    let (code, body) = agent.get("/debug/pprof/profile");
    assert_eq!(code, 404, "{}", String::from_utf8_lossy(&body));
    let (code, _) = agent.get("/no/such/path");
    assert_eq!(code, 404);
    let (status, stderr) = agent.stop(libc::SIGINT);
    assert_eq!(status, Some(0), "{stderr}");
    assert!(stderr.contains("SIGINT: stopping"), "{stderr}");
}

#[test]
fn go_tool_pprof_reads_the_profiles_over_http() {
    require_root();
    let _machine = sharing_the_machine();
    if Command::new("go").arg("version").output().is_err() {
        eprintln!("go is not installed (Debian: golang-go): skipping the go tool pprof check");
        return;
    }
    let dir = scratch("serve-go");
    let mut svc = service(&["--step-ms", "20"], true);
    let pid = svc.pid().to_string();
    let agent = start(&["--pid", &pid, "--no-kernel"], Stdio::null(), Stdio::null());
    svc.go();
    svc.next();
    thread::sleep(Duration::from_secs(1));
    for (path, want_type) in [("heap", "inuse_space"), ("allocs", "alloc_space")] {
        let out = Command::new("go")
            .args(["tool", "pprof", "-top"])
            .arg(format!("http://{}/debug/pprof/{path}", agent.addr))
            .env("PPROF_TMPDIR", &dir)
            .env("HOME", &dir)
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{text}");
        assert!(text.contains(&format!("Type: {want_type}")), "the default sample type of {path}: {text}");
        assert!(text.contains("wl_steady_leak"), "{text}");
        assert!(text.contains("File: alloc_workload"), "named after the program: {text}");
    }
    drop(agent);
}

#[test]
fn new_processes_are_picked_up_under_all_and_dropped_after_their_last_scrape() {
    require_root();
    let _machine = sharing_the_machine();
    let agent = start(&["-a", "--no-kernel", "--pid-label"], Stdio::null(), Stdio::null());
    // Started after the agent.
    let mut svc = service(&["--leak-steps", "20", "--step-ms", "10"], false);
    let pid = svc.pid();
    assert_eq!(svc.next()["event"], "started");
    assert_eq!(svc.next()["event"], "done");
    let label = format!("pid=\"{pid}\"");
    eventually(Duration::from_secs(10), "its series", || {
        sample(&agent.metrics(), "memtrace_live_bytes", &["site=\"wl_steady_leak (", &label])
    });
    // It exits: the next scrape still shows it (its last figures), the one after does not.
    drop(svc.stdin.take());
    wait_at_most(&mut svc.child, Duration::from_secs(10));
    thread::sleep(Duration::from_millis(500));
    let last = agent.metrics();
    assert!(sample(&last, "memtrace_live_bytes", &["site=\"wl_steady_leak (", &label]).is_some(), "{last}");
    let gone = eventually(Duration::from_secs(5), "it to be dropped", || {
        let text = agent.metrics();
        (!text.contains(&label)).then_some(text)
    });
    let dropped: f64 = gone
        .lines()
        .find_map(|l| l.strip_prefix("memtrace_processes_dropped_total "))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(dropped >= 1.0);
    let (status, stderr) = agent.stop(libc::SIGTERM);
    assert_eq!(status, Some(0), "{stderr}");
}

#[test]
fn a_taken_port_is_refused_before_any_probe_loads() {
    require_root();
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let started = Instant::now();
    let out = memtrace().args(["serve", "-a", "--listen", &addr]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].contains(&format!("cannot listen on {addr}")) && lines[0].contains("already in use"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(taken);
    // Other bad command lines.
    for (args, needle) in [
        (&["serve"][..], "say what to trace"),
        (&["serve", "-a", "--listen", "nowhere"], "expected HOST:PORT"),
        (&["serve", "--pid", "4194300"], "no process with pid 4194300"),
        (&["serve", "-a", "--auth-token-file", "/nonexistent/token"], "--auth-token-file"),
    ] {
        let out = memtrace().args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
}

/// Where the free probe of a process sits, as an address in it (see robustness.rs).
fn free_probe_address(pid: u32) -> u64 {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let libc_line = maps.lines().find(|l| l.contains("libc.so") && l.contains("r-xp")).unwrap();
    let mut parts = libc_line.split_whitespace();
    let start = u64::from_str_radix(parts.next().unwrap().split('-').next().unwrap(), 16).unwrap();
    let _perms = parts.next();
    let offset = u64::from_str_radix(parts.next().unwrap(), 16).unwrap();
    let path = libc_line.split_whitespace().last().unwrap();
    let nm = Command::new("nm").args(["-D", path]).output().unwrap();
    let free = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .find_map(|l| {
            let mut p = l.split_whitespace();
            let addr = p.next()?;
            let _kind = p.next()?;
            (p.next()? == "free@@GLIBC_2.2.5").then(|| u64::from_str_radix(addr, 16).unwrap())
        })
        .unwrap();
    start + free - offset + 3
}

fn byte_at(pid: u32, addr: u64) -> u8 {
    use std::io::Seek as _;
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    mem.seek(std::io::SeekFrom::Start(addr)).unwrap();
    let mut b = [0u8];
    mem.read_exact(&mut b).unwrap();
    b[0]
}

#[test]
fn sigterm_during_a_scrape_stops_cleanly_and_leaves_no_probe() {
    require_root();
    let _machine = sharing_the_machine();
    let mut svc = service(&["--step-ms", "20"], false);
    assert_eq!(svc.next()["event"], "started");
    let pid = svc.pid();
    let probe = free_probe_address(pid);
    let agent = start(&["--pid", &pid.to_string(), "--no-kernel"], Stdio::null(), Stdio::null());
    thread::sleep(Duration::from_millis(300));
    assert_eq!(byte_at(pid, probe), 0xcc, "the probe is a breakpoint while tracing");
    // A delta profile in flight, and a plain scrape.
    let addr = agent.addr;
    let scrape = thread::spawn(move || http_get(addr, "/debug/pprof/heap?seconds=20", ""));
    let metrics = thread::spawn(move || http_get(addr, "/metrics", ""));
    thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    let (status, stderr) = agent.stop(libc::SIGTERM);
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(status, Some(0), "{stderr}");
    assert!(stderr.contains("SIGTERM: stopping") && stderr.contains("every probe removed"), "{stderr}");
    let (code, body) = scrape.join().unwrap();
    assert_eq!(
        (code, String::from_utf8_lossy(&body).trim()),
        (503, "memtrace is stopping: the delta profile was cut short")
    );
    assert_eq!(metrics.join().unwrap().0, 200);
    assert_ne!(byte_at(pid, probe), 0xcc, "the breakpoint is gone");
    assert!(svc.child.try_wait().unwrap().is_none(), "the service runs on");
}

/// `--max-series`: six traced processes, each a group of its own (`--pid-label`), cost
/// more series than the cap allows; the groups with the fewest live bytes are summed into
/// `comm="[other]"`, no family holds more series than the cap, and the gauge says so.
#[test]
fn the_series_cap_sums_the_smallest_groups_into_one_series() {
    require_root();
    let _machine = sharing_the_machine();
    let mut services: Vec<Service> = (0..6).map(|_| service(&["--step-ms", "20"], false)).collect();
    for s in &mut services {
        s.next();
    }
    let mut args: Vec<String> = services.iter().flat_map(|s| ["--pid".to_string(), s.pid().to_string()]).collect();
    args.extend(["--no-kernel", "--pid-label", "--max-series", "10"].map(String::from));
    let agent = start(&args.iter().map(String::as_str).collect::<Vec<_>>(), Stdio::null(), Stdio::null());
    let text = eventually(Duration::from_secs(10), "groups folded", || {
        let text = agent.metrics();
        let folded: f64 = text.lines().find_map(|l| l.strip_prefix("memtrace_groups_folded "))?.trim().parse().ok()?;
        (folded >= 1.0).then_some(text)
    });
    let live = text.lines().filter(|l| l.starts_with("memtrace_live_bytes{")).count();
    assert!((2..=10).contains(&live), "{text}");
    assert!(text.contains("comm=\"[other]\""), "{text}");
    let shown = services.iter().filter(|s| text.contains(&format!("pid=\"{}\"", s.pid()))).count();
    assert!((1..6).contains(&shown), "{text}");
    drop(services);
    let (status, stderr) = agent.stop(libc::SIGTERM);
    assert_eq!(status, Some(0), "{stderr}");
}

#[test]
fn a_traced_pid_that_exits_is_reported_and_the_last_one_stops_the_agent() {
    require_root();
    let _machine = sharing_the_machine();
    let mut a = service(&["--step-ms", "20"], false);
    let mut b = service(&["--step-ms", "20"], false);
    a.next();
    b.next();
    let agent = start(
        &["--pid", &a.pid().to_string(), "--pid", &b.pid().to_string(), "--no-kernel", "--pid-label"],
        Stdio::null(),
        Stdio::null(),
    );
    let (a_pid, b_pid) = (a.pid(), b.pid());
    eventually(Duration::from_secs(10), "both in /metrics", || {
        let text = agent.metrics();
        (text.contains(&format!("pid=\"{a_pid}\"")) && text.contains(&format!("pid=\"{b_pid}\""))).then_some(())
    });
    drop(a);
    eventually(Duration::from_secs(5), "the exit reported", || {
        agent.stderr().contains(&format!("memtrace: pid {a_pid} exited")).then_some(())
    });
    assert_eq!(agent.get("/metrics").0, 200, "serving goes on for the other");
    drop(b);
    let mut agent = agent;
    let status = wait_at_most(&mut agent.child, Duration::from_secs(10));
    thread::sleep(Duration::from_millis(100));
    let stderr = agent.stderr();
    assert_eq!(status, Some(0), "{stderr}");
    assert!(stderr.contains(&format!("memtrace: pid {b_pid} exited")), "{stderr}");
    assert!(stderr.contains("every traced process exited: stopping"), "{stderr}");
    assert!(stderr.contains("every probe removed"), "{stderr}");
}
