//! Project chores: `setup` (installs what building the eBPF programs needs, idempotently),
//! `test` (formatting, lints, every test), `demo` (traces the bundled workload and prints
//! the report) and `bench` (the overhead benchmarks). Run as root: the probes need it.
use std::{
    env,
    ffi::OsStr,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, Result, bail};

mod bench;
mod heavy_bench;
mod serve_bench;
mod start_bench;
mod system_bench;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_path_buf()
}

/// `doc` with the section that starts at `heading` and ends at `end` replaced by `section`
/// (appended when the document has none).
fn replace_marked(doc: &str, heading: &str, end: &str, section: &str) -> String {
    match (doc.find(heading), doc.find(end)) {
        (Some(start), Some(stop)) if stop > start => {
            format!("{}{section}{}", &doc[..start], doc[stop + end.len()..].trim_start_matches('\n'))
        }
        _ => format!("{}\n\n{section}", doc.trim_end()),
    }
}

/// Installs each (command, Debian package) whose command does not run yet.
fn ensure_tools(tools: &[(&str, &str)]) -> Result<()> {
    for &(tool, package) in tools {
        if !succeeds(Command::new(tool).arg("--version")) {
            apt_install(&[package])?;
        }
    }
    Ok(())
}

/// A section of BENCHMARKS.md that one bench part writes: its heading, then its text between
/// two markers, so a part run alone can replace it in place.
struct Marked {
    heading: &'static str,
    begin: &'static str,
    end: &'static str,
}

impl Marked {
    /// The section's text with its heading and markers.
    fn wrapped(&self, section: &str) -> String {
        format!("{}\n\n{}\n{}\n{}\n", self.heading, self.begin, section.trim_end(), self.end)
    }

    /// `doc` with this section replaced (or appended).
    fn replace(&self, doc: &str, section: &str) -> String {
        replace_marked(doc, self.heading, self.end, &self.wrapped(section))
    }
}

/// Prints `section` and puts it in place in BENCHMARKS.md, for a `cargo xtask bench <part>`
/// run alone.
fn update_benchmarks(what: &str, marked: &Marked, section: &str) -> Result<()> {
    // The machine section above is the last full run's: say where this part ran.
    let commit = output(Command::new("git").args(["-C"]).arg(workspace_root()).args(["rev-parse", "--short", "HEAD"]))
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let kernel = output(Command::new("uname").arg("-r")).map(|s| s.trim().to_string()).unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let section = format!(
        "{section}\nThis part was measured alone (`cargo xtask bench`'s part) at {commit}, kernel {kernel}, {cores} cores.\n"
    );
    println!("\n{section}");
    let path = workspace_root().join("BENCHMARKS.md");
    let doc = fs::read_to_string(&path).unwrap_or_default();
    fs::write(&path, marked.replace(&doc, &section))?;
    eprintln!("xtask bench: updated the {what} section of BENCHMARKS.md");
    Ok(())
}

fn target_dir() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("target"))
}

fn cargo_home() -> PathBuf {
    env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env::var_os("HOME").unwrap_or_else(|| "/root".into())).join(".cargo"))
}

/// Runs a command, echoing it, failing on a non-zero exit.
fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {}", describe(cmd));
    let status = cmd.status().with_context(|| format!("running {}", describe(cmd)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(cmd));
    }
    Ok(())
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.stderr(Stdio::inherit()).output().with_context(|| format!("running {}", describe(cmd)))?;
    if !out.status.success() {
        bail!("{} failed ({})", describe(cmd), out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program()).chain(cmd.get_args()).map(OsStr::to_string_lossy).collect::<Vec<_>>().join(" ")
}

fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Uid:").map(|v| v.split_whitespace().nth(1) == Some("0"))))
        .unwrap_or(false)
}

/// Debian packages `setup` installs (once; it checks with dpkg first), and what for. One
/// line each, so a feature that needs a real component adds it here.
const DEBIAN_PACKAGES: &[(&str, &str)] = &[
    ("gcc", "the bundled C workloads"),
    ("g++", "the bundled C++ workload (operator new/delete)"),
    ("libc6-dev", "the bundled C workloads"),
    ("libjemalloc2", "allocator tests: jemalloc preloaded"),
    ("libjemalloc-dev", "allocator tests: a prefixed jemalloc shim, nallocx"),
    ("libmimalloc2.0", "allocator tests: mimalloc preloaded"),
    ("libmimalloc-dev", "allocator tests: mi_usable_size"),
    ("libtcmalloc-minimal4", "allocator tests: tcmalloc preloaded"),
    ("libgoogle-perftools-dev", "allocator tests: tc_malloc_size"),
    ("musl-tools", "allocator tests: a static musl program"),
    ("python3", "Python frames tests: Debian's CPython traced from outside"),
    ("libpython3-dev", "Python frames tests: a program embedding CPython through its shared library"),
    ("chromium", "the HTML report's test loads it in a real (headless) browser"),
    ("prometheus", "serve's tests: promtool checks /metrics, a real Prometheus scrapes it"),
];

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

fn apt_install(packages: &[&str]) -> Result<()> {
    run(Command::new("apt-get").arg("update").arg("-qq"))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

/// The libLLVM of the nightly toolchain, which bpf-linker must be built against.
fn nightly_llvm() -> Result<(PathBuf, String)> {
    let sysroot = output(Command::new("rustc").args(["+nightly", "--print", "sysroot"]))?;
    let lib = Path::new(sysroot.trim()).join("lib");
    let name = fs::read_dir(&lib)?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .find(|n| n.starts_with("libLLVM.so."))
        .with_context(|| format!("no libLLVM.so.* in {}", lib.display()))?;
    let major = name
        .trim_start_matches("libLLVM.so.")
        .split(['.', '-'])
        .next()
        .context("cannot read the LLVM version")?
        .to_string();
    Ok((lib.join(&name), major))
}

fn setup() -> Result<()> {
    // The nightly toolchain and its sources (the eBPF crate builds core with -Z build-std).
    if !succeeds(Command::new("rustc").args(["+nightly", "--version"])) {
        run(Command::new("rustup").args(["toolchain", "install", "nightly", "--profile", "minimal"]))?;
    }
    let installed =
        output(Command::new("rustup").args(["component", "list", "--toolchain", "nightly", "--installed"]))?;
    if !installed.lines().any(|l| l.starts_with("rust-src")) {
        run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))?;
    }

    // bpf-linker, linked against the nightly's own LLVM (Debian's LLVM is too old). A stamp
    // records which libLLVM it was built for, so a new nightly triggers a rebuild.
    let (llvm, major) = nightly_llvm()?;
    let llvm_name = llvm.file_name().unwrap().to_string_lossy().into_owned();
    let prefix = cargo_home().join("memtrace-llvm");
    let stamp = prefix.join("bpf-linker.stamp");
    let current = fs::read_to_string(&stamp).unwrap_or_default();
    if current.trim() != llvm_name || !succeeds(Command::new("bpf-linker").arg("--version")) {
        let lib = prefix.join("lib");
        fs::create_dir_all(&lib)?;
        for link in [lib.join("libLLVM.so"), lib.join(&llvm_name)] {
            let _ = fs::remove_file(&link);
            std::os::unix::fs::symlink(&llvm, &link)?;
        }
        run(Command::new("cargo")
            .args(["install", "bpf-linker", "--locked", "--force", "--no-default-features", "--features"])
            .arg(format!("llvm-{major}"))
            .env("LLVM_PREFIX", &prefix))?;
        fs::write(&stamp, &llvm_name)?;
    }

    // Debian packages the build, the tests and the benchmarks use.
    let missing: Vec<&str> =
        DEBIAN_PACKAGES.iter().map(|(package, _why)| *package).filter(|package| !dpkg_installed(package)).collect();
    if !missing.is_empty() {
        apt_install(&missing)?;
    }

    // tracefs, where the tracepoints are described.
    if !Path::new("/sys/kernel/tracing/events").is_dir() && !Path::new("/sys/kernel/debug/tracing/events").is_dir() {
        run(Command::new("mount").args(["-t", "tracefs", "nodev", "/sys/kernel/tracing"]))?;
    }
    eprintln!("xtask: setup complete");
    Ok(())
}

fn require_root(what: &str) -> Result<()> {
    if !is_root() {
        bail!("{what} loads eBPF programs and must run as root (sudo -E env PATH=\"$PATH\" cargo xtask {what})");
    }
    Ok(())
}

fn cargo() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.current_dir(workspace_root());
    cmd
}

fn test() -> Result<()> {
    require_root("test")?;
    setup()?;
    run(cargo().args(["fmt", "--all", "--check"]))?;
    let lints = ["--", "-D", "warnings"];
    run(cargo().args(["clippy", "--workspace", "--exclude", "memtrace-ebpf", "--all-targets"]).args(lints))?;
    run(cargo()
        .args([
            "+nightly",
            "clippy",
            "-p",
            "memtrace-ebpf",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
            "--",
        ])
        .args(["-D", "warnings"])
        .env("CARGO_ENCODED_RUSTFLAGS", "--cfg=bpf_target_arch=\"x86_64\""))?;
    // default members: everything but the eBPF crate; every test binary runs, so that one
    // failure does not hide the others
    run(cargo().args(["test", "--no-fail-fast"]))?;
    eprintln!("xtask: all tests passed");
    Ok(())
}

/// Builds memtrace in release mode and returns (binary, directory of the bundled workloads).
fn build_release() -> Result<(PathBuf, PathBuf)> {
    let json =
        output(cargo().args(["build", "--release", "-p", "memtrace", "--message-format=json-render-diagnostics"]))?;
    let mut workloads = None;
    for line in json.lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        // package ids look like "path+file:///…/memtrace#0.1.0".
        if msg["reason"] == "build-script-executed"
            && msg["package_id"].as_str().is_some_and(|p| p.contains("/memtrace#"))
        {
            workloads = msg["out_dir"].as_str().map(PathBuf::from);
        }
    }
    let workloads = workloads.context("could not find memtrace's build output (bundled workloads)")?;
    Ok((target_dir().join("release").join("memtrace"), workloads))
}

fn demo() -> Result<()> {
    require_root("demo")?;
    setup()?;
    let (memtrace, workloads) = build_release()?;
    let dir = target_dir().join("demo");
    fs::create_dir_all(&dir)?;
    let data = dir.join("demo.data");
    run(Command::new(&memtrace)
        .args(["record", "--force", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workloads.join("alloc_workload"))
        .args(["--threads", "4", "--iterations", "500", "--leaks", "3"]))?;
    run(Command::new(&memtrace).args(["report", "--top", "15", "-i"]).arg(&data))?;
    eprintln!(
        "\nxtask: the recording is {}; try `{} report -i {} --by stack` or `--leaks`",
        data.display(),
        memtrace.display(),
        data.display()
    );
    Ok(())
}

fn main() -> Result<()> {
    let task = env::args().nth(1).unwrap_or_default();
    match task.as_str() {
        "setup" => setup(),
        "test" => test(),
        "demo" => demo(),
        "bench" if env::args().nth(2).as_deref() == Some("serve") => serve_bench::run_alone(),
        "bench" if env::args().nth(2).as_deref() == Some("heavy") => heavy_bench::run_alone(),
        "bench" if env::args().nth(2).as_deref() == Some("start") => start_bench::run_alone(),
        "bench" if env::args().nth(2).as_deref() == Some("system") => system_bench::run_alone(),
        "bench" => bench::bench(),
        _ => {
            eprintln!("usage: cargo xtask <setup|test|demo|bench>");
            eprintln!(
                "  setup  install rust-src, bpf-linker (for the nightly's LLVM), the Debian packages tests use; mount tracefs"
            );
            eprintln!("  test   formatting, clippy on both crates, unit and integration tests (root)");
            eprintln!("  demo   trace the bundled workload and print the report (root)");
            eprintln!("  bench  overhead against the peers, pipeline speed, sustained load -> BENCHMARKS.md (root)");
            eprintln!("  bench serve  only the always-on agent's figures and soak (its BENCHMARKS.md section)");
            eprintln!("  bench heavy  only the heavy Python program against heaptrack and memray (its section)");
            eprintln!("  bench start  only the start-and-stop figures (record -- true, attach, stop; its section)");
            eprintln!("  bench system only record -a on kernel allocations beside bpftrace and perf (its section)");
            std::process::exit(2);
        }
    }
}
