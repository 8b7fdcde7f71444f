//! The tracing core, for real: the three record modes trace the bundled workload and the
//! figures must equal what the workload itself counted (allocations, frees, bytes requested,
//! bytes allocated as malloc_usable_size measured, live blocks), with no event lost.
mod common;

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use common::*;
use serde_json::Value;

const ARGS: [&str; 6] = ["--threads", "4", "--iterations", "150", "--leaks", "3"];

fn assert_clean(report: &Value) {
    assert_eq!(report["lost_events"], 0, "lost events");
    assert_eq!(report["lost_stacks"], 0, "lost stacks");
    assert_eq!(report["finalized"], true);
}

fn assert_kernel_side(report: &Value) {
    let kernel = &report["totals"]["kernel"];
    assert!(kernel["allocs"].as_u64().unwrap() > 0, "no kernel allocation traced");
    let sites = report["sites"].as_array().unwrap();
    let kernel_sites: Vec<&Value> = sites.iter().filter(|s| s["domain"] == "kernel").collect();
    assert!(!kernel_sites.is_empty());
    for s in &kernel_sites {
        assert!(s["bytes_alloc"].as_u64() >= s["bytes_req"].as_u64(), "{s:#}");
        assert!(!s["frames"].as_array().unwrap().is_empty(), "kernel site without frames: {s:#}");
    }
    // The pipes the workload creates: allocated in the kernel on behalf of its main().
    let pipe = kernel_sites
        .iter()
        .find(|s| {
            let frames = s["frames"].as_array().unwrap();
            frames[0]["function"] == "alloc_pipe_info"
                && frames.iter().any(|f| f["function"] == "main" && f["kernel"] == false)
        })
        .unwrap_or_else(|| panic!("no kernel site for pipe creation from main"));
    // alloc_pipe_info allocates the same number of blocks for each of the 20 pipes.
    let allocs = pipe["allocs"].as_u64().unwrap();
    assert!(allocs > 0 && allocs % 20 == 0, "{pipe:#}");
    assert_eq!(pipe["frees"], pipe["allocs"], "closed pipes are freed: {pipe:#}");
}

#[test]
fn record_command_counts_every_allocation_exactly() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("command");
    let data = dir.join("cmd.data");
    let manifest_path = dir.join("manifest.json");
    let out = run(memtrace()
        .args(["record", "-q", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(ARGS)
        .arg("--manifest")
        .arg(&manifest_path));
    // The command's output is the user's; memtrace's own messages are on stderr (-q: none).
    assert!(String::from_utf8_lossy(&out.stdout).contains("alloc_workload: 4 threads x 150 iterations"));
    let manifest = manifest(&manifest_path);
    let report = report_json(&data, &["--by", "function"]);
    assert_clean(&report);
    assert_matches_manifest(&report, &manifest);
    assert_eq!(report["exit_code"], 0);
    // Traced from its first allocation: every free matches an allocation.
    assert_eq!(report["totals"]["user"]["unmatched_frees"], 0, "{:#}", report["totals"]);
    let leaked = manifest["sites"].as_array().unwrap().iter().find(|s| s["function"] == "wl_leak").unwrap();
    assert_eq!(leaked["live_allocs"], 12);
    // The user row is the allocator's line and the program's own mmap calls, said apart.
    let mmaps = &manifest["sites"].as_array().unwrap().iter().find(|s| s["function"] == "wl_mmap").unwrap();
    assert_eq!(report["user_mmaps"]["calls"], mmaps["allocs"], "{:#}", report["user_mmaps"]);
    let heap = report["allocators"].as_array().unwrap().iter().map(|a| a["allocs"].as_u64().unwrap()).sum::<u64>();
    assert_eq!(
        heap + report["user_mmaps"]["calls"].as_u64().unwrap(),
        report["totals"]["user"]["allocs"].as_u64().unwrap(),
        "{:#}",
        report["allocators"]
    );
    assert_kernel_side(&report);
}

/// A command that is a script (a shell wrapper, a pyenv shim) runs as the kernel runs it:
/// its `#!` interpreter is probed, and the program it execs is followed, counted exactly.
#[test]
fn a_script_as_the_command_is_traced_through_what_it_execs() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("script");
    let data = dir.join("script.data");
    let manifest_path = dir.join("manifest.json");
    let script = dir.join("wrap.sh");
    let args = ARGS.join(" ");
    std::fs::write(
        &script,
        format!("#!/bin/sh\nexec {} {args} --manifest {}\n", workload().display(), manifest_path.display()),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    run(memtrace().args(["record", "-q", "-o"]).arg(&data).arg("--").arg(&script));
    let report = report_json(&data, &["--by", "function"]);
    assert_clean(&report);
    assert_matches_manifest(&report, &manifest(&manifest_path));
    assert_eq!(report["exit_code"], 0);
}

/// A command killed by a signal: `record` exits as a shell would (128 + the signal), and the
/// report says it was killed, not that it chose status 139.
#[test]
fn a_command_killed_by_a_signal_is_reported_so() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("killed");
    let data = dir.join("killed.data");
    let out =
        memtrace().args(["record", "-q", "-o"]).arg(&data).args(["--", "sh", "-c", "kill -SEGV $$"]).output().unwrap();
    assert_eq!(out.status.code(), Some(139), "{}", String::from_utf8_lossy(&out.stderr));
    let report = report_json(&data, &[]);
    assert_eq!(report["exit_code"], 139);
    // ", core dumped" where the limits let a core be written.
    let reason = report["end_reason"].as_str().unwrap();
    assert!(reason.starts_with("the command was killed by signal 11 (Segmentation fault"), "{reason}");
    let text = run(memtrace().args(["report", "-i"]).arg(&data));
    let text = String::from_utf8_lossy(&text.stdout);
    let how = reason.strip_prefix("the command ").unwrap();
    assert!(text.contains(&format!("\ncommand {how} (exit status 139, as a shell tells it)\n")), "{text}");
}

/// A user walk whose CPU scratch another program took meanwhile (on a preemptible kernel a
/// uprobe program can be preempted and another thread's run on the CPU; here forced, one
/// claim in 7, by `MEMTRACE_TEST_INTERLEAVE`, which also writes over the walk's frames as
/// that program would) sends its allocation whole, with its call site alone, cut short,
/// and counted: every site's figures stay exact, and no walk sends another's frames.
#[test]
fn a_walk_another_program_interleaved_with_keeps_its_record_and_its_call_site() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("interleaved");
    let data = dir.join("interleaved.data");
    let manifest_path = dir.join("manifest.json");
    run(memtrace()
        .env("MEMTRACE_TEST_INTERLEAVE", "7")
        .args(["record", "-q", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(ARGS)
        .arg("--manifest")
        .arg(&manifest_path));
    let manifest = manifest(&manifest_path);
    let report = report_json(&data, &["--by", "function"]);
    assert_clean(&report);
    // The records are the threads' own: exact, each under its call site's function.
    assert_matches_manifest(&report, &manifest);
    assert_eq!(report["totals"]["user"]["unmatched_frees"], 0, "{:#}", report["totals"]);
    let interleaved = report["recorder"]["user_walks_interleaved"].as_u64().unwrap();
    // The walks: the allocations recorded (malloc family and mmap), each walked once.
    let walks = ["user", "reserved"].map(|d| report["totals"][d]["allocs"].as_u64().unwrap_or(0)).iter().sum::<u64>();
    // One claim in 7 on each CPU, the kernel allocations' claims among them.
    assert!(interleaved * 14 >= walks && interleaved * 4 <= walks, "{interleaved} of {walks}");
    // Counted cut short (the malloc family's and the address space's reserved by mmap).
    let cut = ["user", "reserved"].map(|d| report["stacks"][d]["allocs_truncated"].as_u64().unwrap_or(0));
    assert!(
        cut.iter().sum::<u64>() >= interleaved,
        "{cut:?} cut short, {interleaved} interleaved: {:#}",
        report["stacks"]
    );
    let warnings = report["warnings"].as_array().unwrap();
    assert!(
        warnings
            .iter()
            .any(|w| w.as_str().unwrap().starts_with(&format!("{interleaved} user stacks keep their call site"))),
        "{warnings:#?}"
    );
    // The walks left alone are whole, down to the thread's start.
    let busiest = manifest["sites"].as_array().unwrap().iter().max_by_key(|s| s["allocs"].as_u64()).unwrap();
    let name = busiest["function"].as_str().unwrap();
    let stacks = report_json(&data, &["--by", "stack"]);
    let whole = stacks["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["frames"][0]["function"] == name && s["truncated"] == false)
        .filter(|s| s["frames"].as_array().unwrap().iter().any(|f| f["function"] == "start_thread"))
        .map(|s| s["allocs"].as_u64().unwrap())
        .sum::<u64>();
    let all = busiest["allocs"].as_u64().unwrap();
    assert!(whole > all / 2 && whole < all, "{whole} of {all} {name} allocations whole");
}

/// A kernel allocation made inside an allocator call (the heap's first growth: `brk` and
/// page faults under the first `calloc`) has the allocator's caller above it: the return
/// probe's trampoline stands in that frame's return slot until the call returns, and the
/// walk puts back the address the uprobe machinery keeps for it.
#[test]
fn a_kernel_allocation_inside_an_allocator_call_has_the_callers_above_the_call() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("inside-allocator");
    let data = dir.join("inside.data");
    run(memtrace().args(["record", "-q", "-o"]).arg(&data).arg("--").arg(workload()).args([
        "--threads",
        "1",
        "--iterations",
        "10",
    ]));
    let report = report_json(&data, &["--by", "stack", "--domain", "kernel"]);
    assert_clean(&report);
    let allocator = ["__libc_calloc", "__libc_malloc", "calloc", "malloc"];
    let whole = report["sites"].as_array().unwrap().iter().any(|row| {
        let frames = row["frames"].as_array().unwrap();
        frames.windows(2).any(|w| {
            w[0]["kernel"] == false
                && allocator.iter().any(|a| w[0]["function"] == *a)
                && w[1]["module"] == "alloc_workload"
                && frames.last().is_some_and(|f| f["function"] == "_start" || f["function"] == "clone3")
        })
    });
    assert!(whole, "no kernel allocation inside an allocator call reaches its caller: {:#}", report["sites"]);
}

/// The kmem programs walk a task's user stack once per syscall and reuse it for the
/// syscall's other allocations: pipes made alternately from two callers, with the same
/// registers at each syscall, must each keep their own caller, every one of them.
#[test]
fn kernel_allocations_in_one_syscall_share_its_walk_and_never_another_syscalls() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("syscall-walks");
    let data = dir.join("sites.data");
    run(memtrace().args(["record", "-q", "-o"]).arg(&data).arg("--").arg(workload()).args(["--kernel-sites", "40"]));
    let report = report_json(&data, &["--by", "stack", "--domain", "kernel"]);
    assert_clean(&report);
    let mut per_site = [0u64; 2];
    for row in report["sites"].as_array().unwrap() {
        let frames = row["frames"].as_array().unwrap();
        if frames.first().map(|f| &f["function"]) != Some(&Value::from("alloc_pipe_info")) {
            continue;
        }
        let has = |name: &str| frames.iter().any(|f| f["function"] == name && f["kernel"] == false);
        let (a, b) = (has("pipe_site_a"), has("pipe_site_b"));
        assert!(a != b, "a pipe's stack names one of its two callers: {row:#}");
        per_site[usize::from(b)] += row["allocs"].as_u64().unwrap();
    }
    // alloc_pipe_info makes the same allocations for each of the 20 pipes of each site.
    assert!(per_site[0] > 0 && per_site[0] % 20 == 0, "{per_site:?}");
    assert_eq!(per_site[0], per_site[1]);
    let reused = report["recorder"]["unwind_walks_reused"].as_u64().unwrap();
    assert!(reused > 0, "no walk was reused: {:#}", report["recorder"]);
}

/// Each kmem_cache_alloc names its slab cache, as the kernel names it (`/proc/slabinfo`):
/// a pipe's dentry, inode and two files, per call site in the report's JSON and per event
/// in `dump`; kmalloc's rows name none.
#[test]
fn kernel_cache_allocations_name_their_slab_cache() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("slab-caches");
    let data = dir.join("caches.data");
    run(memtrace().args(["record", "-q", "-o"]).arg(&data).arg("--").arg(workload()).args(["--kernel-sites", "40"]));
    let report = report_json(&data, &["--by", "function", "--domain", "kernel"]);
    assert_clean(&report);
    let row = |function: &str| {
        report["sites"].as_array().unwrap().iter().find(|s| s["function"] == function).cloned().unwrap_or(Value::Null)
    };
    // Each of the 40 pipes has a dentry and an inode of its own; its two ends, a file each.
    assert_eq!(
        (&row("__d_alloc")["allocs"], &row("__d_alloc")["caches"]),
        (&Value::from(40), &serde_json::json!(["dentry"]))
    );
    assert_eq!(row("alloc_inode")["caches"], serde_json::json!(["inode_cache"]), "{:#}", row("alloc_inode"));
    assert_eq!(row("alloc_empty_file")["caches"], serde_json::json!(["filp"]), "{:#}", row("alloc_empty_file"));
    assert!(row("alloc_empty_file")["allocs"].as_u64().unwrap() >= 80);
    for site in report["sites"].as_array().unwrap() {
        let caches = site["caches"].as_array().map_or(0, Vec::len);
        let from_caches = site["kinds"].as_array().unwrap().iter().any(|k| k == "cache");
        assert_eq!(caches > 0, from_caches, "only kmem_cache_alloc rows name caches: {site:#}");
        assert!(!site["caches"].to_string().contains("0x"), "every cache by name: {site:#}");
    }
    let dump = String::from_utf8(run(memtrace().args(["dump", "-i"]).arg(&data)).stdout).unwrap();
    let dentries = dump.lines().filter(|l| l.contains(" cache ") && l.ends_with(" cache=dentry")).count();
    assert!(dentries >= 40, "{dentries} dentries in dump");
    assert!(!dump.contains("cache=0x"), "dump names every cache");
}

/// The kernel allocations of `--kernel-sites 400` (200 pipes from each of two callers), per
/// whole stack: kernel and user frames by name, with their allocation counts.
fn pipe_stacks(data: &std::path::Path) -> (std::collections::BTreeMap<Vec<(String, bool)>, u64>, Value) {
    let report = report_json(data, &["--by", "stack", "--domain", "kernel"]);
    assert_clean(&report);
    let mut stacks = std::collections::BTreeMap::new();
    for row in report["sites"].as_array().unwrap() {
        let frames = row["frames"].as_array().unwrap();
        // The pipes' own allocations (not the page faults of the workload's first touches,
        // which come when they come).
        let has = |name: &str| frames.iter().any(|f| f["function"].as_str().is_some_and(|g| g.starts_with(name)));
        if !(has("pipe_site_a") || has("pipe_site_b")) || !has("do_pipe2") {
            continue;
        }
        // Nor a slab cache's growth inside one (a new slab and its bookkeeping come when the
        // cache runs out, whatever the pipe: seen once in a CI run, 1 allocation through
        // `allocate_slab` → `alloc_slab_obj_exts` in one of the two runs).
        if has("allocate_slab") || has("___slab_alloc") {
            continue;
        }
        let key: Vec<(String, bool)> =
            frames.iter().map(|f| (f["function"].as_str().unwrap_or("").to_string(), f["kernel"] == true)).collect();
        *stacks.entry(key).or_insert(0) += row["allocs"].as_u64().unwrap();
    }
    (stacks, report)
}

/// A repeat kernel stack is taken from its path's first unwind when every frame's return
/// address is in its slot on the stack (`kstack`), not unwound again: the same stacks with
/// the same counts as when every one is unwound, most of them taken so, none found
/// different when checked.
#[test]
fn repeat_kernel_stacks_are_taken_from_their_first_unwind_exactly() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("kernel-stack-reuse");
    let mut runs = Vec::new();
    for reuse in ["on", "off"] {
        let data = dir.join(format!("{reuse}.data"));
        run(memtrace()
            .env("MEMTRACE_KERNEL_STACK_REUSE", reuse)
            .args(["record", "-q", "-o"])
            .arg(&data)
            .arg("--")
            .arg(workload())
            .args(["--kernel-sites", "400"]));
        runs.push(pipe_stacks(&data));
    }
    let ((taken, report), (unwound, unwound_report)) = (&runs[0], &runs[1]);
    // Each pipe makes the same allocations from the same path: some 16 stacks, 200 or 400
    // allocations each (the two callers of pipe() in user space tell them apart).
    let big: Vec<u64> = unwound.values().copied().filter(|&n| n >= 200).collect();
    assert!(big.len() >= 8 && big.iter().all(|n| n % 200 == 0), "{unwound:#?}");
    let differ: Vec<_> = taken
        .iter()
        .filter(|(k, n)| unwound.get(*k) != Some(n))
        .chain(unwound.iter().filter(|(k, n)| taken.get(*k) != Some(n)))
        .collect();
    assert!(differ.is_empty(), "stacks taken from their first unwind differ from unwound ones: {differ:#?}");
    let recorder = &report["recorder"];
    let kernel_allocs = report["totals"]["kernel"]["allocs"].as_u64().unwrap();
    let reused = recorder["kernel_stacks_reused"].as_u64().unwrap();
    assert!(reused * 2 > kernel_allocs, "{reused} of {kernel_allocs} kernel stacks taken: {recorder:#}");
    assert!(recorder["kernel_stacks_checked"].as_u64().unwrap() > 0, "{recorder:#}");
    assert_eq!(recorder["kernel_stacks_differed"], 0, "{recorder:#}");
    assert_eq!(unwound_report["recorder"]["kernel_stacks_reused"], 0);
}

/// The kernel allocates on the probes' behalf in the traced process (the copies of the
/// pages breakpoints are written into, return probes' instances): those allocations are
/// not the program's. A program that only mallocs and frees shows none of them, and the
/// report counts them apart.
#[test]
fn the_uprobe_machinerys_kernel_allocations_are_not_charged_to_the_program() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("probe-overhead");
    let data = dir.join("loop.data");
    run(memtrace().args(["record", "-q", "-o"]).arg(&data).arg("--").arg(workload()).args(["--loop", "2000"]));
    let report = report_json(&data, &["--by", "stack", "--domain", "kernel"]);
    assert_clean(&report);
    for row in report["sites"].as_array().unwrap() {
        let frames = row["frames"].as_array().unwrap();
        let machinery = frames.iter().find(|f| {
            f["kernel"] == true
                && ["handle_swbp", "uprobe_notify_resume", "install_breakpoint", "uprobe_mmap", "prepare_uretprobe"]
                    .iter()
                    .any(|name| f["function"].as_str().is_some_and(|g| g.split('.').next() == Some(*name)))
        });
        assert!(machinery.is_none(), "an allocation of the uprobe machinery charged to the program: {row:#}");
    }
    let overhead = &report["probe_overhead"];
    assert!(overhead["allocs"].as_u64().unwrap() > 0, "{overhead:#}");
    assert!(overhead["bytes_alloc"].as_u64().unwrap() >= 4096, "{overhead:#}");
    let text = String::from_utf8_lossy(&run(memtrace().args(["report", "-i"]).arg(&data)).stdout).into_owned();
    assert!(text.contains("the kernel's uprobe machinery made for the probes"), "{text}");
}

/// memtrace drains its rings and builds tables ahead of the load (niceness −10 by default
/// when started at 0, or `--nice`); the command it runs keeps the niceness memtrace was
/// started with. `serve`, an agent, keeps its own unless told.
#[test]
fn memtrace_runs_ahead_of_the_load_and_its_command_at_the_callers_niceness() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("nice");
    // SAFETY: a plain syscall (a niceness of -1 is told from an error by errno, which
    // cannot be set here: the test runs as root, for which getpriority does not fail).
    let ours = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    let data = dir.join("nice.data");
    let record = ["record", "-q", "--no-kernel", "-o", data.to_str().unwrap()];
    let niceness = |args: &[&str]| -> (i32, i32) {
        let out =
            run(memtrace().args(args).args(["--", "sh", "-c", r#"cut -d" " -f19 /proc/self/stat /proc/$PPID/stat"#]));
        let lines: Vec<i32> = String::from_utf8(out.stdout).unwrap().lines().map(|l| l.parse().unwrap()).collect();
        (lines[0], lines[1])
    };
    let default = if ours == 0 { -10 } else { ours };
    assert_eq!(niceness(&record), (ours, default), "(command, memtrace) by default, started at {ours}");
    let asked = if ours == 7 { 6 } else { 7 };
    let asked_arg = asked.to_string();
    assert_eq!(niceness(&[&record[..], &["--nice", &asked_arg]].concat()), (ours, asked), "with --nice {asked}");
    let serve = ["serve", "--listen", "127.0.0.1:0", "--no-kernel"];
    assert_eq!(niceness(&serve), (ours, ours), "serve keeps its niceness");
    assert_eq!(niceness(&[&serve[..], &["--nice", &asked_arg]].concat()), (ours, asked), "serve --nice {asked}");
    let out = memtrace().args(["record", "--nice", "-21", "--", "true"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("-21") && stderr.contains("--nice"), "{stderr}");
}

#[test]
fn record_pid_traces_a_running_process() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("pid");
    let data = dir.join("pid.data");
    let manifest_path = dir.join("manifest.json");
    // The workload waits for a line on stdin before allocating, so memtrace can attach.
    let mut target = Command::new(workload())
        .args(ARGS)
        .args(["--wait-stdin", "--manifest"])
        .arg(&manifest_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Once it says so, it has started (its libraries are mapped) and waits.
    let mut target_out = BufReader::new(target.stdout.take().unwrap());
    let mut ready = String::new();
    target_out.read_line(&mut ready).unwrap();
    assert_eq!(ready, "waiting\n");
    let mut recorder = memtrace()
        .args(["record", "--pid", &target.id().to_string(), "-o"])
        .arg(&data)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = wait_until_tracing(&mut recorder);
    target.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let mut rest = String::new();
    target_out.read_to_string(&mut rest).unwrap();
    assert!(target.wait().unwrap().success());
    let status = recorder.wait().unwrap();
    assert!(status.success(), "{}", stderr.join().unwrap());
    let report = report_json(&data, &["--by", "function"]);
    assert_clean(&report);
    assert_matches_manifest(&report, &manifest(&manifest_path));
    assert_kernel_side(&report);
}

#[test]
fn record_all_traces_processes_started_later() {
    require_root();
    let _alone = alone_on_the_machine();
    let dir = scratch("all");
    let data = dir.join("all.data");
    let manifest_path = dir.join("manifest.json");
    let mut recorder = memtrace().args(["record", "-q", "-a", "--duration", "6s", "-o"]).arg(&data).spawn().unwrap();
    // Started after the recording: -a must pick it up.
    thread::sleep(Duration::from_millis(2500));
    let target = Command::new(workload())
        .args(ARGS)
        .arg("--manifest")
        .arg(&manifest_path)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(target.success());
    // Another memtrace run meanwhile: its program, the recorder's own, is found like any.
    run(memtrace().arg("--version"));
    assert!(recorder.wait().unwrap().success());
    let pid = manifest(&manifest_path)["pid"].as_u64().unwrap().to_string();
    let report = report_json(&data, &["--by", "function", "--pid", &pid]);
    assert_eq!(report["lost_events"], 0);
    assert_matches_manifest(&report, &manifest(&manifest_path));
    // The mimalloc linked into memtrace is not probed system-wide, not even once another
    // memtrace ran: every allocation of the recorder itself would trap.
    let allocators = report["allocators"].as_array().unwrap();
    assert!(allocators.iter().all(|a| a["prefix"] != "mi_"), "{allocators:#?}");
}

/// A program run in a chroot that holds its own copy of the C library (as a container's
/// file system does) under `record -a`: that copy is another file, which the probes of
/// the machine's library do not see, and the program's libraries were looked for in ours:
/// none of its allocations was recorded ("no allocation matches", helper-44). They are now
/// looked for in its root, and its copy is probed. The same in a mount namespace of its
/// own (`unshare -m --root`, as a container runtime starts one), where the process's root
/// has no name from here, and where a program of the same name is the machine's, which
/// shared the answer (helper-46).
#[test]
fn record_all_probes_the_c_library_a_chrooted_program_brings() {
    require_root();
    let _alone = alone_on_the_machine();
    let dir = scratch("chroot");
    // The workload and, where it names them, its C library and dynamic linker: copies.
    let ldd = run(Command::new("ldd").arg(workload()));
    let libs: Vec<String> = String::from_utf8_lossy(&ldd.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
        .map(str::to_string)
        .collect();
    let libc = libs.iter().find(|l| l.contains("libc.so")).unwrap_or_else(|| panic!("{libs:?}")).clone();
    let roots = [dir.join("chroot"), dir.join("namespace")];
    for root in &roots {
        for lib in &libs {
            let to = root.join(lib.trim_start_matches('/'));
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(lib, &to).unwrap();
        }
    }
    // The chroot's at its root; the namespace's where the machine's is, a program of the
    // same name (run first, below).
    let in_namespace = workload().strip_prefix("/").unwrap().to_path_buf();
    std::fs::copy(workload(), roots[0].join("alloc_workload")).unwrap();
    std::fs::create_dir_all(roots[1].join(&in_namespace).parent().unwrap()).unwrap();
    std::fs::copy(workload(), roots[1].join(&in_namespace)).unwrap();
    let data = dir.join("all.data");
    let (mut recorder, stderr) = start_record_all(&data, &["--no-kernel", "--duration", "5s"]);
    // Each sleeps first: its C library is probed once its exec is read, a few ms after it.
    let mut machines = Command::new(workload());
    machines.args(["--threads", "1", "--iterations", "10", "--leaks", "0"]);
    let mut chroot = Command::new("chroot");
    chroot.arg(&roots[0]).arg("/alloc_workload");
    let mut namespace = Command::new("unshare");
    namespace.arg("-m").arg(format!("--root={}", roots[1].display())).arg(workload());
    for c in [&mut chroot, &mut namespace] {
        c.args(ARGS).args(["--sleep-ms", "500", "--manifest", "/manifest.json"]);
    }
    for c in [&mut machines, &mut chroot, &mut namespace] {
        assert!(c.stdout(Stdio::null()).status().unwrap().success(), "{c:?}");
    }
    assert!(recorder.wait().unwrap().success(), "{}", stderr.join().unwrap());
    for (root, own_namespace) in [(&roots[0], false), (&roots[1], true)] {
        let manifest = manifest(&root.join("manifest.json"));
        let pid = manifest["pid"].as_u64().unwrap().to_string();
        let report = report_json(&data, &["--by", "function", "--pid", &pid]);
        assert_eq!(report["lost_events"], 0);
        assert_matches_manifest(&report, &manifest);
        // A chroot's copy by its path from here; a namespace's through the process's root.
        let copy = if own_namespace {
            format!("/proc/{pid}/root{libc}")
        } else {
            std::fs::canonicalize(root.join(libc.trim_start_matches('/'))).unwrap().display().to_string()
        };
        let allocators = report["allocators"].as_array().unwrap();
        assert!(
            allocators.iter().any(|a| a["module"] == copy.as_str() && a["allocs"].as_u64() > Some(0)),
            "{}: its own C library ({copy}): {allocators:#?}",
            root.display()
        );
    }
}

#[test]
fn a_statically_linked_malloc_is_found_in_the_executable() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("static");
    let data = dir.join("static.data");
    let manifest_path = dir.join("manifest.json");
    let static_workload = workload().with_file_name("alloc_workload_static");
    run(memtrace()
        .args(["record", "-q", "-o"])
        .arg(&data)
        .arg("--")
        .arg(&static_workload)
        .args(ARGS)
        .arg("--manifest")
        .arg(&manifest_path));
    let report = report_json(&data, &["--by", "function"]);
    assert_clean(&report);
    let allocator = report["recording"]["allocator"].as_str().unwrap();
    assert!(allocator.ends_with("alloc_workload_static"), "{allocator}");
    assert_eq!(report["recording"]["allocator_is_glibc"], true);
    assert_matches_manifest(&report, &manifest(&manifest_path));
}

#[test]
fn a_custom_allocator_is_traced_through_its_prefix() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("custom");
    let data = dir.join("custom.data");
    let manifest_path = dir.join("manifest.json");
    run(memtrace()
        .args(["record", "-q", "--symbol-prefix", "mt_", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(["--custom", "1000", "--manifest"])
        .arg(&manifest_path));
    let report = report_json(&data, &["--by", "function", "--domain", "user"]);
    assert_clean(&report);
    // Its metadata is unknown to memtrace: allocated = requested.
    assert_eq!(report["recording"]["allocator_is_glibc"], false);
    assert_matches_manifest(&report, &manifest(&manifest_path));
    assert_eq!(report["totals"]["user"]["allocs"], 1000, "only the mt_ allocator is traced");
}

#[test]
fn sampled_recording_estimates_the_true_figures() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("sampled");
    let data = dir.join("sampled.data");
    let manifest_path = dir.join("manifest.json");
    // Enough allocations, sampled finely enough, that the estimate of the count of small
    // blocks (the noisiest) is within a few percent: with 4 KiB and a quarter of these
    // iterations its standard error was ~8 %, and 25 % off came up in a full CI run.
    run(memtrace()
        .args(["record", "-q", "--sample-bytes", "1024", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(["--threads", "4", "--iterations", "600", "--leaks", "3"])
        .arg("--manifest")
        .arg(&manifest_path));
    let manifest = manifest(&manifest_path);
    let report = report_json(&data, &["--by", "function", "--domain", "user"]);
    assert_eq!(report["recording"]["sample_bytes"], 1024);
    assert_eq!(report["lost_events"], 0);
    // Blocks far larger than the sampling period are always sampled, standing for one.
    let large = manifest["sites"].as_array().unwrap().iter().find(|s| s["function"] == "wl_malloc_large").unwrap();
    let large_site = site(&report, "wl_malloc_large").unwrap();
    assert_eq!(large_site["allocs"], large["allocs"]);
    // ... and so are their frees: every sampled block's free is sent, none of the others'.
    assert!(large["frees"].as_u64().unwrap() > 0);
    assert_eq!(large_site["frees"], large["frees"], "{large_site:#}");
    assert_eq!(large_site["live_allocs"], large["live_allocs"], "{large_site:#}");
    // The rest are estimates: unbiased, within a few standard errors.
    let sum = |v: &Value, f: &str| -> f64 {
        v["sites"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| {
                let name = s.get("function").or_else(|| s["frames"].get(0).map(|f| &f["function"]));
                name.and_then(Value::as_str).is_some_and(|n| n.starts_with("wl_"))
            })
            .map(|s| s[f].as_f64().unwrap())
            .sum()
    };
    // (the count of small blocks is the noisiest estimate: a standard error of ~2 % here)
    for (figure, tolerance) in [("bytes_req", 0.02), ("allocs", 0.15)] {
        let (got, want) = (sum(&report, figure), sum(&manifest, figure));
        assert!((got - want).abs() / want < tolerance, "{figure}: estimated {got}, true {want}");
        eprintln!("{figure}: estimated {got}, true {want}");
    }
}

/// The end of `record` with its debug log on: the warnings pass, on a thread of its own
/// while the frames are named, logs as it ends; `record` held stderr while it waited for it
/// and never ended. 180,000 events: the pass outlasts the naming of the frames by ~25 ms.
#[test]
fn record_ends_when_it_logs_as_its_warnings_are_read() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("end-with-debug-log");
    let data = dir.join("rec.data");
    let out = Command::new("timeout")
        .arg("120")
        .arg(env!("CARGO_BIN_EXE_memtrace"))
        .env("MEMTRACE_LOG", "debug")
        .args(["record", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(["--threads", "4", "--iterations", "2000", "--leaks", "3"])
        .stdout(Stdio::null())
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {log}", out.status);
    assert!(log.contains("the recording's warnings read in"), "{log}");
    assert!(log.contains("memtrace: the command exited with status 0"), "{log}");
}

/// CPUs the kernel may bring up (`/sys/devices/system/cpu/possible`: "0-3,8"): one ring each.
fn possible_cpus() -> u64 {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
    text.trim()
        .split(',')
        .map(|r| match r.split_once('-') {
            Some((a, b)) => b.parse::<u64>().unwrap() - a.parse::<u64>().unwrap() + 1,
            None => 1,
        })
        .sum()
}

/// The summary and the report say how much of memtrace's peak resident memory is the
/// rings' pages: the kernel maps all of a ring at `mmap`, so with 1 MiB rings each CPU's
/// ring is 1 MiB of the resident set and its two position pages, its data mapped once
/// (the kernel's own readers map it twice, which made 2 MiB).
#[test]
fn the_rings_share_of_the_peak_resident_memory_is_reported() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("rings-rss");
    let data = dir.join("rings.data");
    let out = run(memtrace().args(["record", "--ring-size", "1M", "-o"]).arg(&data).arg("--").arg(workload()).args([
        "--threads",
        "2",
        "--iterations",
        "50",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report = report_json(&data, &[]);
    let mapped = report["recorder"]["bpf_mapped_rss_bytes"].as_u64().unwrap();
    let rings = possible_cpus() * (1 << 20);
    assert!(mapped >= rings && mapped <= rings + possible_cpus() * 2 * 4096, "{mapped} for {rings}");
    assert!(mapped < report["recorder"]["peak_rss_bytes"].as_u64().unwrap());
    let said = format!("({:.0} MB of it the rings' pages)", mapped as f64 / 1e6);
    assert!(stderr.contains(&said), "{said} not in {stderr}");
}
