//! The rough edges a new user meets (issue #18), for real: files never destroyed and handed
//! to the user who ran sudo, errors said once with what to do, `record ./prog` without
//! `--`, signals like perf, the status line apart from the command's output (through a
//! pseudo-terminal), `dump -g`, reserved memory apart from the program's, kernel sites that
//! name where they are, and warnings when figures under-count.
mod common;

use std::{
    fs,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::unix::fs::{MetadataExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    thread,
    time::{Duration, Instant},
};

use common::*;
use serde_json::Value;

fn workload_dir() -> PathBuf {
    workload().parent().unwrap().to_path_buf()
}

/// Runs memtrace and expects it to fail with `code` and one line on stderr containing
/// every piece of `needles`.
fn fails(cmd: &mut Command, code: i32, needles: &[&str]) -> String {
    let out: Output = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "{cmd:?}\nstderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line expected, got: {stderr}");
    for needle in needles {
        assert!(lines[0].contains(needle), "{needle:?} not in {:?}", lines[0]);
    }
    lines[0].to_string()
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let exists = unsafe { libc::kill(pid as i32, 0) } == 0;
    exists && fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

/// Builds a small C program for one test.
fn compile(dir: &Path, name: &str, source: &str) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    fs::write(&src, source).unwrap();
    let out = dir.join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(cc).args(["-O1", "-g", "-fno-builtin", "-o"]).arg(&out).arg(&src).status().unwrap();
    assert!(status.success(), "compiling {name}");
    out
}

/// A quick recording of the bundled workload, user space only, as root (not handed to a
/// sudo user).
fn quick_recording(data: &Path) {
    run(memtrace()
        .env_remove("SUDO_UID")
        .env_remove("SUDO_GID")
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(data)
        .arg("--")
        .arg(workload())
        .args(["--threads", "1", "--iterations", "20"])
        .stdout(Stdio::null()));
}

/// Runs `command` under `script` (a pseudo-terminal, as a user at a terminal would), with
/// `input` typed once the output contains `after`; returns everything the terminal showed
/// and the exit code. The command is exec'd by script's shell, so the terminal's Ctrl-C
/// reaches memtrace as it does under an interactive shell: a non-interactive dash (script's
/// shell when `SHELL` is unset, as on CI) waiting for its child would take the SIGINT itself
/// and exit 130 whatever the child's status.
fn at_a_terminal(command: &str, after: &str, input: &[u8]) -> (String, Option<i32>) {
    let mut child: Child = Command::new("script")
        .args(["-qefc", &format!("exec {command}"), "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("script(1) from util-linux");
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let mut typed = input.is_empty();
    let mut stdin = child.stdin.take();
    loop {
        let n = stdout.read(&mut buf).unwrap_or(0);
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        if !typed && String::from_utf8_lossy(&seen).contains(after) {
            thread::sleep(Duration::from_millis(300));
            stdin.as_mut().unwrap().write_all(input).unwrap();
            stdin.as_mut().unwrap().flush().unwrap();
            typed = true;
        }
    }
    drop(stdin);
    let status = child.wait().unwrap();
    (String::from_utf8_lossy(&seen).into_owned(), status.code())
}

// ---------------------------------------------------------------------------------------
// Files.
// ---------------------------------------------------------------------------------------

#[test]
fn export_never_replaces_its_recording_or_a_file_of_another_kind() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("export-safety");
    let data = dir.join("w.data");
    quick_recording(&data);
    let recording = fs::read(&data).unwrap();
    let export = |format: &str, output: &Path| {
        let mut cmd = memtrace();
        cmd.args(["export", "--format", format, "-i"]).arg(&data).arg("-o").arg(output);
        cmd
    };
    // Its own input: never, not even with --force.
    fails(&mut export("svg", &data), 1, &["is the recording being exported"]);
    fails(export("svg", &data).arg("--force"), 1, &["is the recording being exported"]);
    assert_eq!(fs::read(&data).unwrap(), recording);
    assert_eq!(report_json(&data, &[])["finalized"], true);
    // A source file: only with --force.
    let source = dir.join("prog.c");
    fs::write(&source, "int main(void) { return 0; }\n").unwrap();
    fails(&mut export("folded", &source), 1, &["prog.c exists and is not a folded-stacks export", "--force"]);
    assert_eq!(fs::read_to_string(&source).unwrap(), "int main(void) { return 0; }\n");
    // An earlier export of the same format is replaced; one of another format is not.
    let svg = dir.join("flame.svg");
    run(&mut export("svg", &svg));
    run(&mut export("svg", &svg));
    fails(&mut export("pprof", &svg), 1, &["flame.svg exists and is not a pprof profile"]);
    run(export("folded", &source).arg("--force"));
    assert!(fs::read_to_string(&source).unwrap().contains("alloc_workload;"));
}

#[test]
fn under_sudo_files_belong_to_the_user_who_ran_it() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("sudo");
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
    let data = dir.join("s.data");
    let folded = dir.join("s.folded");
    let as_sudo = |cmd: &mut Command| {
        cmd.env("SUDO_UID", "65534").env("SUDO_GID", "65534");
    };
    let mut record = memtrace();
    as_sudo(&mut record);
    run(record
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(["--threads", "1", "--iterations", "20"])
        .stdout(Stdio::null()));
    let mut export = memtrace();
    as_sudo(&mut export);
    run(export.args(["export", "-i"]).arg(&data).arg("-o").arg(&folded));
    for file in [&data, &folded] {
        let meta = fs::metadata(file).unwrap();
        assert_eq!((meta.uid(), meta.gid(), meta.mode() & 0o777), (65534, 65534, 0o600), "{}", file.display());
    }
    // The README's next command, as that user, without sudo.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", env!("CARGO_BIN_EXE_memtrace"), "report", "-i"])
        .arg(&data)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

// ---------------------------------------------------------------------------------------
// Errors and habits.
// ---------------------------------------------------------------------------------------

#[test]
fn errors_say_the_thing_once_and_what_to_do() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("errors");
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o777)).unwrap();
    for sub in [&["report"][..], &["dump"], &["export"]] {
        let line = fails(memtrace().args(sub).current_dir(&dir), 1, &[]);
        assert_eq!(line, "memtrace: no memtrace.data here; record one with `sudo memtrace record -- CMD`");
    }
    // A recording root made (before files were handed to the sudo user), read by a user.
    let data = dir.join("root.data");
    quick_recording(&data);
    let line = fails(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", env!("CARGO_BIN_EXE_memtrace"), "report", "-i"])
            .arg(&data),
        1,
        &["permission denied", "belongs to root", "sudo chown"],
    );
    assert!(!line.contains("os error"), "{line}");
    // A pid the recording does not have: said, with the ones it has, and a failure.
    let line = fails(memtrace().args(["report", "--pid", "1", "-i"]).arg(&data), 1, &["pid 1 is not in"]);
    assert!(line.contains("alloc_workload [") && line.contains(" allocations)"), "{line}");
    assert!(!line.contains("memtrace ["), "the recorder, parent of the command, allocated nothing: {line}");
    // As a name or an allocator it does not have, in report, export and diff alike.
    for sub in [&["report"][..], &["export", "--format", "folded"]] {
        let line =
            fails(memtrace().args(sub).args(["--comm", "nosuch", "-i"]).arg(&data), 1, &["no process named nosuch"]);
        assert!(line.contains("alloc_workload ["), "{line}");
        let line =
            fails(memtrace().args(sub).args(["--allocator", "nosuch", "-i"]).arg(&data), 1, &["no allocator nosuch"]);
        assert!(line.contains("glibc (") && line.ends_with(", unknown"), "{line}");
        // jemalloc, installed and probed ahead of time, but not the workload's.
        fails(memtrace().args(sub).args(["--allocator", "jemalloc", "-i"]).arg(&data), 1, &["no allocator jemalloc"]);
    }
    fails(memtrace().args(["diff", "--comm", "nosuch"]).arg(&data).arg(&data), 1, &["no process named nosuch"]);
    // There, but nothing kept: an empty report, not an error.
    let text = String::from_utf8(
        run(memtrace().args(["report", "--comm", "alloc_workload", "--min-size", "1G", "-i"]).arg(&data)).stdout,
    )
    .unwrap();
    assert!(text.contains("no allocation matches the filters"), "{text}");
    let html = data.with_extension("pid.html");
    fails(
        memtrace().args(["report", "--format", "html", "--pid", "1", "-o"]).arg(&html).arg("-i").arg(&data),
        1,
        &["pid 1 is not in"],
    );
    assert!(!html.exists(), "no page of nothing");
    // --top 0: the totals alone, no empty table under a header of "0 call sites".
    let text = String::from_utf8(run(memtrace().args(["report", "--top", "0", "-i"]).arg(&data)).stdout).unwrap();
    assert!(text.contains("lost events") && !text.contains("0 call sites"), "{text}");
    // An HTML report is not poured into a terminal.
    let (shown, code) = at_a_terminal(
        &format!("{} report --format html -i {}", env!("CARGO_BIN_EXE_memtrace"), data.display()),
        "",
        b"",
    );
    assert_eq!(code, Some(1), "{shown}");
    assert!(shown.contains("-o FILE.html") && !shown.contains("<html"), "{shown}");
}

#[test]
fn record_runs_a_command_given_without_dashes() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("nodash");
    let data = dir.join("n.data");
    // Like `perf record ./prog args`: the command's own options are its own.
    let out = run(memtrace().args(["record", "-q", "--no-kernel", "-o"]).arg(&data).arg(workload()).args([
        "--threads",
        "1",
        "--iterations",
        "7",
    ]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 threads x 7 iterations"));
    let report = report_json(&data, &[]);
    assert_eq!(report["exit_code"], 0);
    assert_eq!(report["recording"]["target_command"][2], "1");
}

#[test]
fn a_program_without_malloc_is_told_about_no_user() {
    require_root();
    let dir = scratch("nomalloc");
    let data = dir.join("x.data");
    fails(
        memtrace().args(["record", "-o"]).arg(&data).arg("--").arg(workload_dir().join("no_malloc")),
        1,
        &["no_malloc", "no malloc", "Go program", "--no-user"],
    );
    assert!(!data.exists());
}

// ---------------------------------------------------------------------------------------
// Signals and the terminal.
// ---------------------------------------------------------------------------------------

#[test]
fn ctrl_c_is_passed_on_and_tracing_goes_on_until_the_command_exits() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("sigint-ignored");
    let data = dir.join("i.data");
    let mut rec = memtrace()
        .args(["record", "--no-kernel", "-o"])
        .arg(&data)
        .args(["--", "sh", "-c", "trap '' INT; sleep 3; exit 7"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = wait_until_tracing(&mut rec);
    thread::sleep(Duration::from_millis(300));
    let sent = Instant::now();
    signal(rec.id(), libc::SIGINT);
    let status = rec.wait().unwrap();
    let stderr = stderr.join().unwrap();
    assert_eq!(status.code(), Some(7), "the command's status, once it exited: {stderr}");
    assert!(sent.elapsed() > Duration::from_secs(2), "traced until the command exited");
    assert!(stderr.contains("SIGINT passed to the command; tracing until it exits"), "{stderr}");
    let report = report_json(&data, &[]);
    assert_eq!((report["exit_code"].as_i64(), report["finalized"].as_bool()), (Some(7), Some(true)));
}

/// `timeout -s INT` signals memtrace and then its whole process group (the command too),
/// microseconds apart: one interrupt, not a second Ctrl-C that leaves the command running
/// untraced and loses its exit status. Sent here as `timeout` sends them, once tracing runs.
#[test]
fn an_interrupt_sent_to_memtrace_and_its_group_at_once_is_one() {
    use std::os::unix::process::CommandExt as _;
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("sigint-group");
    let data = dir.join("t.data");
    let mut rec = memtrace()
        .args(["record", "--no-kernel", "-o"])
        .arg(&data)
        .args(["--", "sh", "-c", "trap 'sleep 0.3; exit 3' INT; sleep 5"])
        .process_group(0)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(rec.stderr.take().unwrap()).lines();
    let tracing = lines.next().unwrap().unwrap();
    assert!(tracing.contains("tracing sh"), "{tracing}");
    // Time for the shell to set its trap.
    thread::sleep(Duration::from_millis(300));
    let group = rec.id() as i32;
    // SAFETY: signals our own child, then its process group. (Apart by a few ms, not the
    // microseconds of `timeout`, so that the two are not one pending signal: memtrace
    // reads the twin while or after it reads its rings.)
    unsafe { libc::kill(group, libc::SIGINT) };
    thread::sleep(Duration::from_millis(20));
    // SAFETY: as above.
    unsafe { libc::kill(-group, libc::SIGINT) };
    let status = rec.wait().unwrap();
    let rest: String = lines.map_while(Result::ok).collect::<Vec<_>>().join("\n");
    assert!(!rest.contains("left running"), "{rest}");
    assert!(rest.contains("the command exited with status 3"), "{rest}");
    assert_eq!(status.code(), Some(3), "{rest}");
    let report = report_json(&data, &[]);
    assert_eq!((report["exit_code"].as_i64(), report["finalized"].as_bool()), (Some(3), Some(true)));
}

#[test]
fn a_second_ctrl_c_stops_tracing_and_leaves_the_command_running() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("sigint-twice");
    let data = dir.join("t.data");
    let mut rec = memtrace()
        .args(["record", "--no-kernel", "-o"])
        .arg(&data)
        .args(["--", "sh", "-c", "trap '' INT; exec sleep 30"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(rec.stderr.take().unwrap()).lines();
    let tracing = lines.next().unwrap().unwrap();
    let pid: u32 =
        tracing.split("(pid ").nth(1).unwrap().trim_end_matches(|c: char| !c.is_ascii_digit()).parse().unwrap();
    thread::sleep(Duration::from_millis(300));
    signal(rec.id(), libc::SIGINT);
    thread::sleep(Duration::from_millis(300));
    signal(rec.id(), libc::SIGINT);
    let started = Instant::now();
    let status = rec.wait().unwrap();
    let still_running = alive(pid);
    // The command holds memtrace's stderr too: end it before reading to the end.
    signal(pid, libc::SIGKILL);
    let rest: String = lines.map_while(Result::ok).collect::<Vec<_>>().join("\n");
    assert_eq!(status.code(), Some(130), "{rest}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(rest.contains(&format!("the command (pid {pid}) was left running")), "{rest}");
    assert!(still_running, "the command was left running");
    assert_eq!(report_json(&data, &[])["finalized"], true);
}

const COUNT_SIGINT: &str = r#"
#include <signal.h>
#include <stdio.h>
#include <time.h>
static volatile sig_atomic_t count;
static void on_int(int sig) { (void)sig; count++; }
int main(void) {
    struct sigaction sa = {0};
    sa.sa_handler = on_int;
    sigaction(SIGINT, &sa, 0);
    struct timespec left = {2, 0};
    while (nanosleep(&left, &left) != 0) {}
    printf("sigint:%d\n", (int)count);
    return 0;
}
"#;

#[test]
fn ctrl_c_at_a_terminal_reaches_the_command_once() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("tty-sigint");
    let program = compile(&dir, "count_sigint", COUNT_SIGINT);
    let data = dir.join("c.data");
    let command =
        format!("{} record --no-kernel -o {} -- {}", env!("CARGO_BIN_EXE_memtrace"), data.display(), program.display());
    let (screen, code) = at_a_terminal(&command, "memtrace: tracing", b"\x03");
    assert!(screen.contains("sigint:1"), "the command saw Ctrl-C once:\n{screen}");
    assert!(screen.contains("SIGINT passed to the command"), "{screen}");
    assert_eq!(code, Some(0), "{screen}");
}

#[test]
fn the_status_line_never_glues_onto_the_commands_output() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("tty-status");
    let bin = env!("CARGO_BIN_EXE_memtrace");
    // A command writing to the terminal: no status line at all.
    let data = dir.join("s.data");
    let command = format!("{bin} record --no-kernel -o {} -- sh -c 'sleep 1.6; printf bye'", data.display());
    let (screen, code) = at_a_terminal(&command, "", b"");
    assert_eq!(code, Some(0), "{screen}");
    assert!(screen.contains("bye") && !screen.contains("events/s"), "{screen:?}");
    // A process elsewhere: the status line, cleared before the summary.
    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    let data = dir.join("p.data");
    let command = format!("{bin} record --no-kernel --pid {} -d 1.7s -o {}", sleeper.id(), data.display());
    let (screen, code) = at_a_terminal(&command, "", b"");
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    assert_eq!(code, Some(0), "{screen}");
    let status = screen.rfind("events/s").unwrap_or_else(|| panic!("no status line: {screen:?}"));
    let summary = screen.find("memtrace: the duration elapsed").unwrap();
    assert!(screen[status..summary].contains("\r\x1b[K"), "cleared before the summary: {screen:?}");
}

// ---------------------------------------------------------------------------------------
// What reports and dumps show.
// ---------------------------------------------------------------------------------------

#[test]
fn dump_prints_stacks_old_pointers_and_parents() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("dump");
    let data = dir.join("d.data");
    let script = format!("{} --threads 1 --iterations 20; true", workload().display());
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::null()));
    let dump =
        |extra: &[&str]| String::from_utf8(run(memtrace().args(["dump", "-i"]).arg(&data).args(extra)).stdout).unwrap();
    let plain = dump(&[]);
    let report = report_json(&data, &[]);
    let shell = report["recording"]["target_pids"][0].as_u64().unwrap();
    // The workload, forked by the traced shell: its exec names the shell.
    let exec = plain.lines().find(|l| l.contains(" Exec ") && l.contains("alloc_workload")).unwrap();
    assert!(exec.contains(&format!(" ppid={shell} ")), "{exec}");
    let realloc = plain.lines().find(|l| l.contains(" realloc ") && !l.contains(" old=0x0 ")).unwrap();
    assert!(realloc.contains(" old=0x"), "{realloc}");
    // Every stack an event refers to is defined by `dump --stacks`.
    let stacks = dump(&["--stacks"]);
    let defined: std::collections::HashSet<&str> =
        stacks.lines().filter(|l| l.starts_with("stack=")).filter_map(|l| l.split_whitespace().next()).collect();
    for reference in plain.split_whitespace().filter(|w| w.starts_with("stack=")) {
        assert!(defined.contains(reference), "{reference} is not in dump --stacks");
    }
    // -g: each allocation's stack under it, innermost first, like perf script.
    let with_stacks = dump(&["-g"]);
    let lines: Vec<&str> = with_stacks.lines().collect();
    let stacks_of_mallocs: Vec<Vec<&str>> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.contains(" malloc ") && l.contains(" stack="))
        .map(|(i, _)| lines[i + 1..].iter().take_while(|l| l.starts_with('\t')).copied().collect())
        .collect();
    assert!(stacks_of_mallocs.iter().all(|frames| !frames.is_empty()), "every stack=N is printed");
    assert!(
        stacks_of_mallocs.iter().any(|frames| frames[0].contains(" wl_malloc (alloc_workload.c:")
            && frames.iter().any(|f| f.contains(" exercise (alloc_workload.c:"))),
        "{with_stacks}"
    );
}

/// `--time-resolution 1ms`: every count is the same, the times are kept to the
/// millisecond (a chunk's events share their sub-millisecond part, the chunk's base) and
/// the recording is smaller; `--exact-times` with it is refused.
#[test]
fn a_coarser_time_resolution_keeps_counts_and_shrinks_the_recording() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("resolution");
    let record = |name: &str, extra: &[&str]| {
        let data = dir.join(name);
        run(memtrace()
            .args(["record", "-q", "--no-kernel", "-o"])
            .arg(&data)
            .args(extra)
            .arg("--")
            .arg(workload())
            .args(["--loop", "100000"])
            .stdout(Stdio::null()));
        data
    };
    let fine = record("us.data", &[]);
    let coarse = record("ms.data", &["--time-resolution", "1ms"]);
    let (a, b) = (report_json(&fine, &[]), report_json(&coarse, &[]));
    for figure in ["allocs", "frees", "bytes_req", "live_allocs"] {
        assert_eq!(a["totals"]["user"][figure], b["totals"]["user"][figure], "{figure}: {:#}", b["totals"]);
    }
    assert!(a["totals"]["user"]["allocs"].as_u64().unwrap() >= 100_000, "{:#}", a["totals"]);
    // Lifetimes are known to the millisecond: the loop's blocks, freed microseconds after
    // their allocation, mostly live 0 ms.
    assert_eq!(b["totals"]["user"]["lifetime_p50_ns"], 0, "{:#}", b["totals"]);
    // The sub-millisecond parts of the times printed: none at 1 ms (`dump` prints the
    // digits the resolution holds: three), nearly all of the thousand possible at the
    // default microsecond.
    let parts = |data: &Path| {
        let dump = String::from_utf8(run(memtrace().args(["dump", "-i"]).arg(data)).stdout).unwrap();
        let ns: std::collections::HashSet<u64> = dump
            .lines()
            .filter_map(|l| format!("{:0<9}", l.split_whitespace().next()?.split_once('.')?.1).parse::<u64>().ok())
            .map(|frac| frac % 1_000_000)
            .collect();
        ns.len()
    };
    let (fine_parts, coarse_parts) = (parts(&fine), parts(&coarse));
    assert!(
        coarse_parts <= 20 && fine_parts > 500,
        "{coarse_parts} sub-millisecond parts at 1 ms, {fine_parts} at 1 µs"
    );
    let size = |p: &Path| std::fs::metadata(p).unwrap().len();
    assert!(size(&coarse) < size(&fine), "{} bytes at 1 ms, {} at 1 µs", size(&coarse), size(&fine));
    let refused = memtrace()
        .args(["record", "--exact-times", "--time-resolution", "1ms", "-o"])
        .arg(dir.join("no.data"))
        .args(["--", "true"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "{}", String::from_utf8_lossy(&refused.stderr));
}

#[test]
fn reserved_memory_is_counted_apart_from_the_programs() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("reserved");
    let data = dir.join("r.data");
    let manifest_path = dir.join("manifest.json");
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(["--threads", "4", "--iterations", "50", "--manifest"])
        .arg(&manifest_path)
        .stdout(Stdio::null()));
    let report = report_json(&data, &[]);
    let reserved = &report["totals"]["reserved"];
    // The four thread stacks glibc maps for pthread_create: 8 MiB each, or what the
    // limit says, never the program's request.
    assert_eq!(reserved["allocs"], 4, "{:#}", report["totals"]);
    assert!(reserved["bytes_req"].as_u64().unwrap() >= 4 * 64 * 1024, "{reserved:#}");
    // The summary's stack lines count them where the totals do (they were user's).
    let stacks = &report["stacks"];
    assert_eq!(stacks["reserved"]["allocs_with_stack"], 4, "{stacks:#}");
    let user_allocs = report["totals"]["user"]["allocs"].as_u64().unwrap();
    assert!(stacks["user"]["allocs_with_stack"].as_u64().unwrap() <= user_allocs, "{stacks:#}");
    let only = report_json(&data, &["--kind", "reserved"]);
    assert_eq!(only["stacks"]["reserved"]["allocs_with_stack"], 4, "{:#}", only["stacks"]);
    let sites = only["sites"].as_array().unwrap();
    assert!(!sites.is_empty());
    for s in sites {
        assert_eq!(s["domain"], "reserved");
        assert!(s["frames"].as_array().unwrap().iter().any(|f| f["function"] == "allocate_stack"), "{s:#}");
    }
    // The user figures are the program's: its own sites add up to them.
    let user = report_json(&data, &["--kind", "user", "--domain", "user"]);
    assert!(user["stacks"]["reserved"].is_null(), "{:#}", user["stacks"]);
    let sum: u64 = user["sites"].as_array().unwrap().iter().map(|s| s["bytes_req"].as_u64().unwrap()).sum();
    assert_eq!(sum, report["totals"]["user"]["bytes_req"].as_u64().unwrap());
    assert_matches_manifest(&report_json(&data, &["--by", "function"]), &manifest(&manifest_path));
    let text = String::from_utf8(run(memtrace().args(["report", "-i"]).arg(&data)).stdout).unwrap();
    assert!(text.lines().any(|l| l.trim_start().starts_with("reserved ")), "{text}");
}

/// Unmapping a mapping's head, its tail or a hole in it frees those bytes, and the rest
/// stays live (glibc trims every new thread arena so); the mapping is freed once, when its
/// last piece goes.
#[test]
fn a_partial_munmap_frees_what_it_covers_and_the_mapping_once() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("partial-munmap");
    let prog = compile(
        &dir,
        "trim",
        r#"
#include <sys/mman.h>
#define MIB (1L << 20)
static char *map(long len) {
    return mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
}
int main(void) {
    char *x = map(8 * MIB), *y = map(8 * MIB), *z = map(8 * MIB);
    munmap(x, 2 * MIB);           /* the head */
    munmap(y + 6 * MIB, 2 * MIB); /* the tail */
    munmap(z + 3 * MIB, 2 * MIB); /* a hole */
    char *w = map(2 * MIB);
    munmap(z, 8 * MIB);           /* both sides of the hole: z is freed */
    munmap(x + 2 * MIB, 6 * MIB); /* the rest of x (w may be where x's head was) */
    return w == MAP_FAILED;
}
"#,
    );
    let data = dir.join("t.data");
    run(memtrace().args(["record", "-q", "--no-kernel", "-o"]).arg(&data).arg("--").arg(&prog));
    let report = report_json(&data, &["--by", "function"]);
    let main = site(&report, "map").unwrap_or_else(|| panic!("{report:#}"));
    const MIB: u64 = 1 << 20;
    assert_eq!((&main["allocs"], &main["frees"], &main["live_allocs"]), (&4.into(), &2.into(), &2.into()), "{main:#}");
    assert_eq!(main["live_bytes_req"], 8 * MIB, "y's 6 MiB and w's 2: {main:#}");
    assert_eq!(main["peak_live_bytes_req"], 24 * MIB, "{main:#}");
    assert_eq!(report["totals"]["user"]["unmatched_frees"], 0, "{:#}", report["totals"]);
}

/// A file mapped read-only is a view of the file, not memory allocated: neither its mmap
/// nor its munmap is counted; anonymous mappings and writable shared memory are.
#[test]
fn file_mappings_are_not_allocations() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("file-mmap");
    let prog = compile(
        &dir,
        "views",
        r#"
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
static char *map_file(int fd, int flags) { return mmap(0, 103, PROT_READ, flags, fd, 0); }
static char *map_anon(long len) {
    return mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
}
static char *map_shared(int fd) { return mmap(0, 8192, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0); }
int main(int argc, char **argv) {
    int fd = open(argv[0], O_RDONLY);
    char *a = map_file(fd, MAP_PRIVATE), *b = map_file(fd, MAP_SHARED), *c = map_file(fd, MAP_PRIVATE);
    char *d = map_anon(1 << 16);
    int shm = memfd_create("buffer", 0);
    ftruncate(shm, 8192);
    char *e = map_shared(shm);
    e[0] = 1;
    munmap(a, 103);
    munmap(b, 103);
    munmap(d, 1 << 16);
    munmap(e, 8192);
    close(fd);
    return c == MAP_FAILED;
}
"#,
    );
    let data = dir.join("v.data");
    run(memtrace().args(["record", "-q", "--no-kernel", "-o"]).arg(&data).arg("--").arg(&prog));
    let report = report_json(&data, &["--by", "function", "--kind", "mmap"]);
    assert!(site(&report, "map_file").is_none(), "{report:#}");
    let anon = site(&report, "map_anon").unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!((&anon["allocs"], &anon["frees"], &anon["bytes_req"]), (&1.into(), &1.into(), &65536.into()));
    let shared = site(&report, "map_shared").unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!((&shared["allocs"], &shared["frees"], &shared["bytes_req"]), (&1.into(), &1.into(), &8192.into()));
    let all = report_json(&data, &[]);
    assert_eq!(all["totals"]["user"]["unmatched_frees"], 0, "{:#}", all["totals"]);
}

/// A grandchild freeing its copies of its grandparent's blocks frees the grandparent's
/// blocks, not ones never seen allocated, though the child between them allocated nothing.
#[test]
fn a_grandchild_freeing_inherited_blocks_is_not_told_as_unmatched() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("grandchild");
    let prog = compile(
        &dir,
        "generations",
        r#"
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
int main(void) {
    void *blocks[100];
    for (int i = 0; i < 100; i++)
        blocks[i] = malloc(64);
    pid_t child = fork();
    if (child == 0) {
        pid_t grandchild = fork();
        if (grandchild == 0) {
            /* Where probes are attached per process (kernels before 6.6), they reach a
               new process when its fork is read: not at once. */
            usleep(200 * 1000);
            for (int i = 0; i < 100; i++)
                free(blocks[i]);
            _exit(0);
        }
        waitpid(grandchild, 0, 0);
        _exit(0);
    }
    waitpid(child, 0, 0);
    return 0;
}
"#,
    );
    let data = dir.join("g.data");
    let out = run(memtrace().args(["record", "--no-kernel", "-o"]).arg(&data).arg("--").arg(&prog));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("without"), "no warning of unmatched frees: {stderr}");
    let report = report_json(&data, &["--by", "function"]);
    let user = &report["totals"]["user"];
    assert_eq!((&user["inherited_frees"], &user["unmatched_frees"]), (&100.into(), &0.into()), "{user:#}");
    let main = site(&report, "main").unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!((&main["allocs"], &main["frees"], &main["live_allocs"]), (&100.into(), &0.into(), &100.into()));
}

#[test]
fn kernel_sites_start_at_the_caller_and_never_print_the_same_name() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("ksites");
    let data = dir.join("k.data");
    run(memtrace()
        .args(["record", "-q", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(["--threads", "2", "--iterations", "50", "--pipes", "50"])
        .stdout(Stdio::null()));
    let report = report_json(&data, &["--domain", "kernel"]);
    let sites = report["sites"].as_array().unwrap();
    let pages: Vec<&Value> = sites.iter().filter(|s| s["kinds"] == serde_json::json!(["page"])).collect();
    assert!(!pages.is_empty(), "the workload's page faults allocate pages");
    for s in pages {
        let first = s["frames"][0]["function"].as_str().unwrap_or("");
        for inside in ["__alloc_pages", "__alloc_frozen_pages", "alloc_pages", "folio_alloc", "get_page_from_freelist"]
        {
            assert!(!first.starts_with(inside), "a page site starts inside the page allocator: {s:#}");
        }
    }
    let out = run(memtrace().args(["report", "--wide", "--domain", "kernel", "-i"]).arg(&data));
    let text = String::from_utf8(out.stdout).unwrap();
    let header = text.lines().position(|l| l.ends_with("  SITE")).unwrap();
    let site_at = text.lines().nth(header).unwrap().rfind("SITE").unwrap();
    let names: Vec<&str> = text.lines().skip(header + 1).map(|l| &l[site_at..]).collect();
    let mut seen = std::collections::HashSet::new();
    for name in &names {
        assert!(seen.insert(*name), "two rows named {name:?}:\n{text}");
    }
}

const STRIPPED: &str = r#"
#include <stdlib.h>
#define NOIPA __attribute__((noipa))
volatile unsigned long sink;
static NOIPA void two_sites(int n) {
    for (int i = 0; i < n; i++) {
        void *a = malloc(48);
        void *b = malloc(96);
        sink += (unsigned long)a ^ (unsigned long)b;
        free(a);
        free(b);
    }
}
static NOIPA void one_site(int n) {
    for (int i = 0; i < n; i++) {
        void *c = malloc(200);
        sink += (unsigned long)c;
        free(c);
    }
}
int main(void) {
    two_sites(300);
    one_site(200);
    return 0;
}
"#;

/// Where the symbol `name` of the (not yet stripped) program at `exe` starts, as a file
/// offset: its address less its executable segment's distance from the file's start.
fn function_offset(exe: &Path, name: &str) -> u64 {
    let nm = String::from_utf8(run(Command::new("nm").arg(exe)).stdout).unwrap();
    let address = nm
        .lines()
        .find_map(|l| {
            let mut parts = l.split_whitespace();
            let address = u64::from_str_radix(parts.next()?, 16).ok()?;
            (parts.nth(1)? == name).then_some(address)
        })
        .unwrap_or_else(|| panic!("{name} in nm's output:\n{nm}"));
    let segments = String::from_utf8(run(Command::new("readelf").args(["-lW"]).arg(exe)).stdout).unwrap();
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap();
    segments
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|f| f.first() == Some(&"LOAD") && f.contains(&"E"))
        .map(|f| (hex(f[1]), hex(f[2]), hex(f[4])))
        .find(|&(_, vaddr, size)| (vaddr..vaddr + size).contains(&address))
        .map(|(offset, vaddr, _)| address - vaddr + offset)
        .unwrap_or_else(|| panic!("{name} in an executable segment:\n{segments}"))
}

/// A stripped program's functions have no names, but each its call-frame information: a
/// row per function (`--by function`) holds all its call sites, named after where the
/// function starts; a row per site stays one per call.
#[test]
fn a_stripped_programs_functions_are_one_row_each_named_where_they_start() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("stripped");
    let exe = compile(&dir, "stripped", STRIPPED);
    let two = function_offset(&exe, "two_sites");
    let one = function_offset(&exe, "one_site");
    run(Command::new("strip").arg(&exe));
    let nm = run(Command::new("nm").arg(&exe));
    assert!(!String::from_utf8_lossy(&nm.stdout).contains("two_sites"), "strip left the symbols");
    let data = dir.join("s.data");
    run(memtrace().args(["record", "-q", "--no-kernel", "-o"]).arg(&data).arg("--").arg(&exe));
    let report = report_json(&data, &["--by", "function", "--domain", "user"]);
    let rows = report["sites"].as_array().unwrap();
    let row = |name: &str| -> &Value {
        rows.iter().find(|r| r["function"] == name).unwrap_or_else(|| panic!("no row {name}: {report:#}"))
    };
    let two_sites = row(&format!("stripped+0x{two:x}"));
    assert_eq!(two_sites["allocs"], 600, "{two_sites:#}");
    assert_eq!(two_sites["bytes_req"], 300 * (48 + 96), "{two_sites:#}");
    let one_site = row(&format!("stripped+0x{one:x}"));
    assert_eq!(one_site["allocs"], 200, "{one_site:#}");
    assert_eq!(one_site["bytes_req"], 200 * 200, "{one_site:#}");
    // Its frames say they have no symbol, and keep where each call is.
    let first = &two_sites["frames"][0];
    assert_eq!(first["unknown"], true, "{first:#}");
    let at = u64::from_str_radix(first["address"].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    assert!(at > two, "{first:#}");
    // By site, the two calls of `two_sites` are two rows, each told apart by where it is.
    let sites = report_json(&data, &["--domain", "user"]);
    let in_two: Vec<&Value> = sites["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["frames"][0]["function"] == format!("stripped+0x{two:x}"))
        .collect();
    assert_eq!(in_two.iter().map(|r| r["allocs"].as_u64().unwrap()).collect::<Vec<_>>(), [300, 300]);
    let text =
        String::from_utf8(run(memtrace().args(["report", "--wide", "--domain", "user", "-i"]).arg(&data)).stdout)
            .unwrap();
    let labels: Vec<&str> = text.lines().filter(|l| l.contains(&format!("stripped+0x{two:x}"))).collect();
    assert_eq!(labels.len(), 2, "{text}");
    assert!(labels.iter().all(|l| l.contains(" @stripped+0x")), "{text}");
}

const RING: &str = r#"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int main(void) {
    enum { N = 4096 };
    static void *ring[N];
    for (int i = 0; i < N; i++)
        ring[i] = malloc(64);
    printf("ready\n");
    fflush(stdout);
    struct timespec pause = {0, 1000000};
    for (long i = 0;; i++) {
        free(ring[i % N]);
        ring[i % N] = malloc(64);
        if (i % 16 == 0)
            nanosleep(&pause, 0);
    }
}
"#;

#[test]
fn attaching_mid_run_is_said_out_loud() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("midrun");
    let ring = compile(&dir, "ring", RING);
    let mut target = Command::new(&ring).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(target.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let pid = target.id();
    let data = dir.join("m.data");
    let out = memtrace()
        .args(["record", "--no-kernel", "-d", "1.5s", "--pid", &pid.to_string(), "-o"])
        .arg(&data)
        .output()
        .unwrap();
    target.kill().unwrap();
    target.wait().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let warning = stderr
        .lines()
        .find(|l| l.starts_with(&format!("memtrace: warning: process ring [{pid}]: ")))
        .unwrap_or_else(|| panic!("no warning at the end of record:\n{stderr}"));
    assert!(warning.contains("of its frees") && warning.contains("attached mid-run"), "{warning}");
    let report = report_json(&data, &[]);
    let warnings: Vec<&str> = report["warnings"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(warnings.iter().any(|w| warning.ends_with(w)), "{warnings:#?}");
}

/// A kernel allocation made inside a call that an allocator call makes (the `mmap` with
/// which a thread's first `malloc` makes its arena) meets two return-probe trampolines on
/// its user stack, `mmap`'s and `malloc`'s: each is put back as its own return address.
/// Before, `malloc`'s stood in for both: the walk skipped from `mmap` to `malloc`'s caller
/// and read the rest from the wrong place (`[unknown] 0x21000`). And the page tables the
/// kernel makes for the uprobes' own page are the probes' cost, not the program's.
#[test]
fn kernel_stacks_inside_nested_probed_calls_are_whole() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("nested-trampolines");
    let prog = compile(
        &dir,
        "arena",
        r#"
#include <pthread.h>
#include <stdlib.h>
__attribute__((noinline)) void *wl_thread_alloc(size_t n) {
    void *p = malloc(n);
    __asm__ volatile("" ::: "memory");
    return p;
}
static void *body(void *arg) {
    (void)arg;
    free(wl_thread_alloc(100)); /* the thread's first malloc maps its arena */
    return 0;
}
int main(void) {
    for (int i = 0; i < 2; i++) {
        pthread_t t;
        pthread_create(&t, 0, body, 0);
        pthread_join(t, 0);
    }
    return 0;
}
"#,
    );
    let data = dir.join("t.data");
    run(memtrace().args(["record", "-q", "-o"]).arg(&data).arg("--").arg(&prog));
    let out = run(memtrace().args(["export", "--format", "folded", "-i"]).arg(&data));
    let folded = String::from_utf8(out.stdout).unwrap();
    let nested: Vec<&str> =
        folded.lines().filter(|l| l.contains("_[k]") && l.contains("mmap") && l.contains("wl_thread_alloc")).collect();
    assert!(!nested.is_empty(), "no kernel allocation in the arena's mmap:\n{folded}");
    for line in &nested {
        assert!(
            line.contains(";start_thread;") && line.contains("malloc") && !line.contains("[unknown]"),
            "{line}\n{folded}"
        );
    }
    assert!(!folded.contains("0x7fffffffe000"), "{folded}");
    // `dump -g` marks the allocations the report leaves out as the probes'.
    let overhead = report_json(&data, &[])["probe_overhead"]["allocs"].as_u64().unwrap();
    assert!(overhead > 0);
    let dump = String::from_utf8(run(memtrace().args(["dump", "-g", "-i"]).arg(&data)).stdout).unwrap();
    assert_eq!(dump.lines().filter(|l| l.ends_with(" (probes)")).count() as u64, overhead);
}

/// Kernel allocations in `vfork` and `execve` keep their user stacks: glibc's `vfork` pops
/// its return address into %rdi for the syscall (its unwind rule says so, and the probes
/// take %rdi from the syscall's saved registers), and past `execve`'s point of no return
/// the old program's memory is gone: the walk made earlier in the call is taken, or the
/// stack goes without a user part. Both read "cut short in user space" before (13 % of a
/// shell loop's kernel stacks).
#[test]
fn kernel_stacks_in_vfork_and_execve_are_not_cut_short() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("vfork-exec");
    let prog = compile(
        &dir,
        "spawner",
        r#"
#include <sys/wait.h>
#include <unistd.h>
__attribute__((noinline)) void spawn_true(void) {
    pid_t pid = vfork();
    if (pid == 0) {
        execl("/bin/true", "true", (char *)0);
        _exit(127);
    }
    waitpid(pid, 0, 0);
}
int main(void) {
    for (int i = 0; i < 10; i++)
        spawn_true();
    return 0;
}
"#,
    );
    let data = dir.join("t.data");
    run(memtrace().args(["record", "-q", "-o"]).arg(&data).arg("--").arg(&prog));
    let rows = report_json(&data, &["--by", "stack", "--domain", "kernel"]);
    let functions = |row: &Value| -> Vec<String> {
        row["frames"].as_array().unwrap().iter().map(|f| f["function"].as_str().unwrap_or("").to_string()).collect()
    };
    let (mut vforks, mut execs) = (0, 0);
    for row in rows["sites"].as_array().unwrap() {
        let names = functions(row);
        let has = |name: &str| names.iter().any(|n| n.split('.').next() == Some(name));
        if has("__do_sys_vfork") {
            vforks += row["allocs"].as_u64().unwrap();
            assert!(has("spawn_true") && has("main") && row["truncated"] == false, "{names:?}");
        }
        if has("load_elf_binary") {
            execs += row["allocs"].as_u64().unwrap();
            assert!(row["truncated"] == false, "{names:?}");
        }
    }
    assert!(vforks >= 10 && execs >= 10, "{vforks} in vfork, {execs} in execve");
    // Debian's dash runs commands in vfork children, which allocate in the shell's heap
    // before they exec; the shell frees those blocks after: paired, not frees without
    // allocation (10 of the shell's 31 frees were, with a warning).
    let data = dir.join("sh.data");
    let loop_ten = "for i in 1 2 3 4 5 6 7 8 9 10; do /bin/true; done";
    run(memtrace().args(["record", "-q", "-o"]).arg(&data).args(["--", "/bin/sh", "-c", loop_ten]));
    let report = report_json(&data, &[]);
    let user = &report["totals"]["user"];
    assert!(user["frees"].as_u64().unwrap() >= 10, "{user:#}");
    assert_eq!(user["unmatched_frees"], 0, "{user:#}");
    assert_eq!(report["warnings"], serde_json::json!([]), "{:#}", report["warnings"]);
    // The C library's line counts them too.
    let libc = &report["allocators"][0];
    assert_eq!((&libc["allocs"], &libc["frees"]), (&user["allocs"], &user["frees"]), "{:#}", report["allocators"]);
}

/// The kernel's allocations as a process exits (page-table batches while `exit_mmap`
/// frees its memory) are the process's: they come after `sched_process_exit` since Linux
/// 6.16, and were lost when the process left the traced set there. They carry no user
/// stack (the memory is gone), and are not "cut short in user space".
#[test]
fn the_kernel_allocations_of_a_process_exiting_are_counted() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("exit-pages");
    let prog = compile(
        &dir,
        "exit_pages",
        r#"
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>
int main(void) {
    unsigned long n = 64ul << 20;
    char *p = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise(p, n, MADV_NOHUGEPAGE); /* page by page, whatever the machine's THP setting */
    for (unsigned long i = 0; i < n; i += 4096)
        p[i] = 1;
    usleep(300000); /* time for any probe to be attached */
    for (int i = 0; i < 100; i++)
        free(malloc(1000));
    return 0; /* left to the exit to free */
}
"#,
    );
    let data = dir.join("t.data");
    run(memtrace().args(["record", "-q", "--no-user", "-o"]).arg(&data).arg("--").arg(&prog));
    let out = run(memtrace().args(["export", "--format", "folded", "-i"]).arg(&data));
    let folded = String::from_utf8(out.stdout).unwrap();
    let exiting: Vec<&str> = folded.lines().filter(|l| l.contains(";exit_mmap_[k];")).collect();
    assert!(!exiting.is_empty(), "no allocation as the process exited:\n{folded}");
    for line in &exiting {
        assert!(line.starts_with("exit_pages;entry_SYSCALL_64"), "{line}");
    }
    // The faults' user part is whole with --no-user too: the tables are built for the
    // user stacks of kernel allocations (each walk stopped at `main` and sent a 16 KiB copy
    // no one read: 136 MB of ring for this program, whose stacks then waited for room).
    let in_main = ";__libc_start_call_main;main;asm_exc_page_fault_[k];";
    let faults: u64 = folded
        .lines()
        .filter(|l| l.contains(in_main) && l.starts_with("exit_pages;_start;__libc_start_main"))
        .filter(|l| l.contains(";do_anonymous_page_[k] "))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(faults, 64 << 20, "{folded}");
    let report = report_json(&data, &[]);
    assert_eq!(report["stacks"]["kernel"]["allocs_truncated"], 0, "{:#}", report["stacks"]);
    let copies = report["recorder"]["ring_bytes"]["stack_copies"].as_u64().unwrap();
    assert!(copies < 1 << 20, "{copies} bytes of stack copies: {:#}", report["recorder"]);
    // The mappings the tables follow do not get the C library's malloc probed.
    let user = report["totals"]["user"]["allocs"].as_u64().unwrap_or(0);
    assert_eq!(user, 0, "user allocations under --no-user: {:#}", report["totals"]);
}

/// The pages the slab allocators take (a new slab of a cache) hold objects counted at their
/// own kmem_cache_alloc: left out of the kernel figures where those count, on a line of
/// their own, and counted where pages alone are asked for. (The kernel row counted both.)
#[test]
fn slab_pages_are_not_counted_twice() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("slab-pages");
    let prog = compile(
        &dir,
        "sockets",
        r#"
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>
static int fds[3000][2];
int main(void) {
    struct rlimit r = {8192, 8192};
    setrlimit(RLIMIT_NOFILE, &r);
    for (int i = 0; i < 3000; i++)
        socketpair(AF_UNIX, SOCK_STREAM, 0, fds[i]); /* ~6,000 sock inodes: new slabs */
    for (int i = 0; i < 3000; i++) {
        close(fds[i][0]);
        close(fds[i][1]);
    }
    return 0;
}
"#,
    );
    let data = dir.join("t.data");
    run(memtrace().args(["record", "-q", "--no-user", "-o"]).arg(&data).arg("--").arg(&prog));
    let kernel_allocs = |kinds: &str| {
        let r = report_json(&data, &["--kind", kinds]);
        (r["totals"]["kernel"]["allocs"].as_u64().unwrap(), r["slab_pages"]["allocs"].as_u64().unwrap())
    };
    let (all, slab) = kernel_allocs("page,cache,kmalloc");
    assert!(slab > 0, "no new slab in 6,000 sockets");
    let (pages, none) = kernel_allocs("page");
    assert_eq!(none, 0);
    let (objects, none) = kernel_allocs("cache,kmalloc");
    assert_eq!(none, 0);
    // Pages alone count the slabs' pages; beside the objects, they are left out.
    assert_eq!(all + slab, pages + objects);
    let by_stack = report_json(&data, &["--by", "stack"]);
    for row in by_stack["sites"].as_array().unwrap().iter().filter(|r| r["kinds"][0] == "page") {
        let slab_frame = row["frames"].as_array().unwrap().iter().any(|f| f["function"] == "allocate_slab");
        assert!(!slab_frame, "a slab's pages counted beside its objects: {row:#}");
    }
    let text = String::from_utf8_lossy(&run(memtrace().args(["report", "-i"]).arg(&data)).stdout).into_owned();
    assert!(
        text.contains("slab pages: ") && text.contains("page allocations") && text.contains("holding slab objects"),
        "{text}"
    );
    let dump = String::from_utf8(run(memtrace().args(["dump", "-g", "-i"]).arg(&data)).stdout).unwrap();
    assert_eq!(dump.lines().filter(|l| l.ends_with(" (slab pages)")).count() as u64, slab);
}

/// A process attached with `--pid` that frees, as it shuts down, the blocks it allocated
/// before: frees without allocation, said out loud, as when it lives on. (They were taken
/// for glibc releasing its per-thread cache at the main thread's exit, which it does not,
/// and the report said nothing.)
#[test]
fn frees_of_blocks_from_before_the_attach_count_when_the_process_exits() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("attach-exit");
    let prog = compile(
        &dir,
        "shutdown",
        r#"
#include <stdio.h>
#include <stdlib.h>
int main(void) {
    static void *blocks[100];
    for (int i = 0; i < 100; i++)
        blocks[i] = malloc(64 + i);
    printf("ready\n");
    fflush(stdout);
    char line[8];
    if (!fgets(line, sizeof line, stdin))
        return 1;
    for (int i = 0; i < 100; i++)
        free(blocks[i]);
    return 0;
}
"#,
    );
    let mut target = Command::new(&prog).stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(target.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let pid = target.id();
    let data = dir.join("a.data");
    let mut tracer = memtrace()
        .args(["record", "--no-kernel", "--pid", &pid.to_string(), "-o"])
        .arg(&data)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(tracer.stderr.take().unwrap());
    let mut said = String::new();
    while stderr.read_line(&mut said).unwrap() > 0 && !said.contains("Ctrl-C to stop") {}
    assert!(said.contains("Ctrl-C to stop"), "{said}");
    target.stdin.take().unwrap().write_all(b"go\n").unwrap();
    assert!(target.wait().unwrap().success());
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    assert!(tracer.wait().unwrap().success(), "{said}{rest}");
    let report = report_json(&data, &[]);
    let user = &report["totals"]["user"];
    assert_eq!((&user["unmatched_frees"], &user["allocator_frees"]), (&100.into(), &0.into()), "{user:#}");
    let warning = format!(
        "process shutdown [{pid}]: 100.0% of its frees (100 of 100; the report's FREES column counts the other 0) had \
         no allocation"
    );
    assert!(rest.contains(&warning) && rest.contains("attached mid-run"), "{rest}");
}

/// Binary or page-sized output is not written to a terminal (as gzip refuses to): a pprof
/// export or an HTML report without -o, on a terminal, is a one-line error.
#[test]
fn binary_exports_are_not_written_to_a_terminal() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("terminal-output");
    let data = dir.join("q.data");
    quick_recording(&data);
    let bin = env!("CARGO_BIN_EXE_memtrace");
    for (args, needle) in [
        ("export --format pprof", "a pprof profile is binary"),
        ("report --format html", "an HTML report is a file for a browser"),
    ] {
        // `script` gives the command a terminal (util-linux, in every Debian).
        let line = format!("{bin} {args} -i {}; echo rc=$?", data.display());
        let out = Command::new("script").args(["-qec", &line, "/dev/null"]).stdin(Stdio::null()).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(needle) && text.contains("rc=1"), "{args}: {text}");
        assert!(!text.contains('\u{1f}'), "{args}: gzip bytes on the terminal");
    }
}
