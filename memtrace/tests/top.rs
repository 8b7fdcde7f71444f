//! `memtrace top -b` against the live bundled workload: its sites and exact counts appear
//! in the snapshots, and the live-block bound is shown when it is reached.
mod common;

use common::*;

fn column(line: &str, index: usize) -> Option<&str> {
    line.split_whitespace().nth(index)
}

#[test]
fn batch_mode_shows_the_workloads_sites_and_figures() {
    require_root();
    let dir = scratch("top");
    let manifest_path = dir.join("manifest.json");
    let out = run(memtrace()
        .args(["top", "-b", "-n", "50", "-d", "0.3", "--rows", "40", "--by", "function", "--sort", "allocs", "--wide"])
        .arg("--")
        .arg(workload())
        .args(["--threads", "2", "--iterations", "400", "--leaks", "2", "--manifest"])
        .arg(&manifest_path));
    let text = String::from_utf8(out.stdout).unwrap();
    let manifest = manifest(&manifest_path);
    // The last snapshot is taken once the command exited and everything was drained.
    let last = text.rsplit("memtrace top — ").next().unwrap();
    assert!(last.contains("lost 0"), "{last}");
    // The probes' own kernel allocations are no row of the program's.
    for machinery in ["alloc_utask", "__create_xol_area", "handler_chain", "alloc_bulk", "uprobe_"] {
        assert!(!last.contains(machinery), "{machinery}: {last}");
    }
    for want in manifest["sites"].as_array().unwrap() {
        let function = want["function"].as_str().unwrap();
        let line = last
            .lines()
            .find(|l| l.ends_with(&format!(" {function}")))
            .unwrap_or_else(|| panic!("no row for {function} in\n{last}"));
        // Columns: domain, allocs/s, bytes/s (two words), live, live bytes (two words),
        // frag, growth (two words), allocs, site (one word when grouped by function).
        let words: Vec<&str> = line.split_whitespace().collect();
        let allocs = words[words.len() - 2].replace(',', "");
        assert_eq!(allocs, want["allocs"].to_string(), "{line}");
        let live = column(line, 4).unwrap().replace(',', "");
        assert_eq!(live, want["live_allocs"].to_string(), "{line}");
    }
}

#[test]
fn the_live_block_bound_is_shown_when_reached() {
    require_root();
    let out = run(memtrace()
        .args(["top", "-b", "-n", "50", "-d", "0.3", "--max-live-blocks", "50", "--domain", "user", "--"])
        .arg(workload())
        .args(["--threads", "1", "--iterations", "50", "--leaks", "200"]));
    let text = String::from_utf8(out.stdout).unwrap();
    let last = text.rsplit("memtrace top — ").next().unwrap();
    assert!(last.contains("live-block table full (50 blocks)"), "{last}");
}

/// Without -b, into a pipe: text snapshots as -b prints them (not the full-screen view's
/// escape codes, nor "No such device or address"), and why it stopped, on stderr.
#[test]
fn into_a_pipe_it_prints_snapshots_and_says_why_it_stopped() {
    require_root();
    let out = run(memtrace()
        .args(["top", "-d", "0.3", "--"])
        .arg(workload())
        .args(["--threads", "1", "--iterations", "20"])
        .stdin(std::process::Stdio::null()));
    let text = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(text.contains("— snapshot 1") && !text.contains('\x1b'), "{text}");
    assert!(stderr.contains("top's output is not a terminal"), "{stderr}");
    assert!(stderr.lines().any(|l| l == "memtrace: the command exited with status 0"), "{stderr}");
}

/// `-n`'s last snapshot with the command still running: the command is ended with top,
/// and top says how (it had exited 0 before, silently).
#[test]
fn a_command_still_running_at_the_last_snapshot_is_ended_and_said_so() {
    require_root();
    let started = std::time::Instant::now();
    let out = run(memtrace().args(["top", "-b", "-n", "1", "-d", "0.2", "--", "sleep", "30"]));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.lines().any(|l| l
            == "memtrace: the command was still running when top stopped: SIGTERM sent; it was killed by signal 15 (Terminated)"),
        "{stderr}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(20), "sleep 30 was ended, not waited for");
}
