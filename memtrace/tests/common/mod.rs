//! Helpers shared by the integration tests: they run the real `memtrace` binary as root
//! against the bundled workload, so the kernel path is exercised for real.
#![allow(dead_code)]

use std::{
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    thread::JoinHandle,
};

use serde_json::Value;

pub fn memtrace() -> Command {
    Command::new(env!("CARGO_BIN_EXE_memtrace"))
}

pub fn workload() -> PathBuf {
    Path::new(env!("MEMTRACE_WORKLOAD_DIR")).join("alloc_workload")
}

static MACHINE: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Held by a test that traces one process: such tests may run side by side.
pub fn sharing_the_machine() -> std::sync::RwLockReadGuard<'static, ()> {
    MACHINE.read().unwrap_or_else(|e| e.into_inner())
}

/// Held by a test that traces the whole machine (`record -a`) and counts exactly: the
/// other tests' tracers and workloads would be traced too, and a traced tracer falls behind.
pub fn alone_on_the_machine() -> std::sync::RwLockWriteGuard<'static, ()> {
    MACHINE.write().unwrap_or_else(|e| e.into_inner())
}

/// Fails the test with a clear message unless we may load BPF programs.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "the integration tests load eBPF programs: run them as root (cargo xtask test)"
    );
}

/// A fresh directory for one test's files, removed when the test is done with it; a
/// failing test's is kept (and named on stderr) to be looked at. (Shared ones:
/// [`Scratch::until_exit`].)
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("memtrace-it-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(Some(dir))
}

/// A test's directory (see [`scratch`]): a `Path` that goes when it is dropped.
pub struct Scratch(Option<PathBuf>);

impl Scratch {
    /// Keeps the directory for the tests of this binary that share what is in it (a
    /// recording made once): it is removed when the binary exits, whether its tests
    /// passed or not (a rerun of one of them makes the recording again; the HTML tests
    /// panic on purpose, so a panic says nothing of a failure here).
    pub fn until_exit(mut self) -> PathBuf {
        let dir = self.0.take().expect("a scratch directory");
        let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if shared.is_empty() {
            // SAFETY: atexit takes a plain function with no arguments, which it calls once
            // as the process exits; it only reads the list under its lock.
            unsafe { libc::atexit(remove_shared) };
        }
        shared.push(dir.clone());
        dir
    }
}

/// The directories [`Scratch::until_exit`] keeps.
static SHARED: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

extern "C" fn remove_shared() {
    // A test that panicked while holding the lock poisons it: the list is still whole.
    let shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
    for dir in shared.iter() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.as_deref().expect("a scratch directory")
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        self
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let Some(dir) = self.0.take() else { return };
        if std::thread::panicking() {
            eprintln!("kept {} for a look at the failure", dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("spawning memtrace");
    if !out.status.success() {
        panic!(
            "{cmd:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

pub fn report_json(data: &Path, extra: &[&str]) -> Value {
    let out = run(memtrace().args(["report", "--format", "json", "-i"]).arg(data).args(extra));
    serde_json::from_slice(&out.stdout).expect("report JSON")
}

/// What the workload says it did, per allocating function.
pub fn manifest(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("workload manifest")).expect("manifest JSON")
}

/// What the workload's manifest says of one allocating function.
pub fn expected(manifest: &Value, function: &str) -> Value {
    manifest["sites"].as_array().unwrap().iter().find(|s| s["function"] == function).unwrap().clone()
}

/// The allocating functions the workload's manifest lists.
pub fn manifest_functions(manifest: &Value) -> Vec<String> {
    manifest["sites"].as_array().unwrap().iter().map(|s| s["function"].as_str().unwrap().to_string()).collect()
}

/// The site whose innermost frame is the function `name`.
pub fn site<'a>(report: &'a Value, name: &str) -> Option<&'a Value> {
    report["sites"].as_array()?.iter().find(|s| s["frames"][0]["function"] == name)
}

pub const FIGURES: [&str; 6] = ["allocs", "frees", "bytes_req", "bytes_alloc", "live_allocs", "live_bytes_req"];

/// Asserts that, for every function of the manifest, the report (grouped by function)
/// shows exactly the same figures, and that the function is the first user frame.
pub fn assert_matches_manifest(report: &Value, manifest: &Value) {
    for expected in manifest["sites"].as_array().unwrap() {
        let name = expected["function"].as_str().unwrap();
        let got = site(report, name).unwrap_or_else(|| panic!("no site with {name} as first frame in {report:#}"));
        assert_eq!(got["domain"], "user", "{name}");
        for figure in FIGURES {
            assert_eq!(got[figure], expected[figure], "{name}: {figure} (report {got:#})");
        }
    }
}

/// Reads a recorder's stderr until it says it is tracing; the rest of stderr is collected
/// by the returned thread.
pub fn wait_until_tracing(recorder: &mut Child) -> JoinHandle<String> {
    let mut lines = BufReader::new(recorder.stderr.take().expect("stderr piped")).lines();
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.contains("memtrace: tracing") {
            return std::thread::spawn(move || {
                for line in lines.map_while(Result::ok) {
                    seen.push_str(&line);
                    seen.push('\n');
                }
                seen
            });
        }
    }
    panic!("memtrace never started tracing:\n{seen}");
}

/// Starts `record -a ARGS -o DATA` (stdout to null) and waits until it is tracing; the
/// recorder, and the thread collecting the rest of its stderr.
pub fn start_record_all(data: &Path, args: &[&str]) -> (Child, JoinHandle<String>) {
    let mut recorder = memtrace()
        .args(["record", "-a"])
        .args(args)
        .arg("-o")
        .arg(data)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = wait_until_tracing(&mut recorder);
    (recorder, stderr)
}

/// Sends `sig` to process `pid` (SIGSTOP a reader to hold it behind the probes).
pub fn signal(pid: u32, sig: i32) {
    // SAFETY: plain kill(2).
    unsafe { libc::kill(pid as i32, sig) };
}
