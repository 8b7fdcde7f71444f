//! Whole user stacks without frame pointers: the bundled workload built with
//! `-fomit-frame-pointer` must give the figures of the frame-pointer build, with every frame
//! up to the thread start; and stacks through a signal handler, through libc calling back
//! into the program, and deeper than the limit come out whole, or marked truncated.
mod common;

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
};

use common::*;
use serde_json::Value;

fn nofp_workload() -> PathBuf {
    Path::new(env!("MEMTRACE_WORKLOAD_DIR")).join("alloc_workload_nofp")
}

/// Records `program` running the default exercise; returns the recording and its manifest.
fn record_exercise(name: &str, program: &Path, call_graph: &str) -> (PathBuf, Value) {
    let dir = scratch(name).until_exit();
    let data = dir.join("rec.data");
    let manifest_path = dir.join("manifest.json");
    run(memtrace()
        // Room for the stack copies sent while the rules of a fresh process are learned.
        .args(["record", "-q", "--ring-size", "32M", "--call-graph", call_graph, "-o"])
        .arg(&data)
        .arg("--")
        .arg(program)
        .args(["--threads", "3", "--iterations", "120", "--leaks", "4", "--manifest"])
        .arg(&manifest_path));
    (data, manifest(&manifest_path))
}

fn function_names(site: &Value) -> Vec<String> {
    site["frames"].as_array().unwrap().iter().map(|f| f["function"].as_str().unwrap().to_string()).collect()
}

/// Sums the per-site figures of the sites whose first frame is `function`.
fn site_figures(report: &Value, function: &str) -> Vec<u64> {
    let sites: Vec<&Value> =
        report["sites"].as_array().unwrap().iter().filter(|s| s["frames"][0]["function"] == function).collect();
    assert!(!sites.is_empty(), "no site {function}");
    FIGURES.iter().map(|f| sites.iter().map(|s| s[*f].as_u64().unwrap()).sum()).collect()
}

#[test]
fn without_frame_pointers_the_figures_and_whole_stacks_match_the_frame_pointer_build() {
    require_root();
    let (fp_data, fp_manifest) = record_exercise("unwind-fp", &workload(), "fp");
    let (data, manifest) = record_exercise("unwind-nofp", &nofp_workload(), "dwarf");

    // The same figures per site: against the workload's own counts, and between the builds.
    let fp_report = report_json(&fp_data, &["--by", "site", "--domain", "user"]);
    let report = report_json(&data, &["--by", "site", "--domain", "user"]);
    let sites = manifest_functions(&manifest);
    assert_eq!(sites.len(), 12);
    for function in &sites {
        let function = function.as_str();
        let want: Vec<u64> = FIGURES.iter().map(|f| expected(&manifest, function)[*f].as_u64().unwrap()).collect();
        let fp_want: Vec<u64> =
            FIGURES.iter().map(|f| expected(&fp_manifest, function)[*f].as_u64().unwrap()).collect();
        // Both exact against what each build counted; the builds do the same work (glibc's
        // usable sizes may differ between any two runs: its mmap threshold moves with timing).
        assert_eq!(site_figures(&report, function), want, "{function} without frame pointers");
        assert_eq!(site_figures(&fp_report, function), fp_want, "{function} with frame pointers");
        let same_work = |v: &[u64]| [v[0], v[1], v[2], v[4], v[5]];
        assert_eq!(same_work(&want), same_work(&fp_want), "{function}: the two builds do the same work");
    }

    // Every stack of every site, whole: the site, its caller, the thread start.
    let stacks = report_json(&data, &["--by", "stack", "--domain", "user"]);
    assert_eq!(stacks["stacks"]["user"]["allocs_truncated"], 0, "{:#}", stacks["stacks"]);
    let mut seen = 0;
    for s in stacks["sites"].as_array().unwrap() {
        let names = function_names(s);
        if !sites.contains(&names[0]) {
            continue;
        }
        seen += 1;
        assert_eq!(names[1..], ["exercise", "start_thread", "clone3"], "{names:?}");
        assert_eq!(s["truncated"], false, "{names:?}");
    }
    assert!(seen >= sites.len(), "{seen} stacks");

    // The frame-pointer walk of the same code, for contrast, stops after the first frame or
    // two (what users of frame-pointer tracers see).
    let (fp_walk_of_nofp, _fp_dir) = {
        let dir = scratch("unwind-fp-walk");
        let data = dir.join("rec.data");
        run(memtrace()
            .args(["record", "-q", "--call-graph", "fp", "-o"])
            .arg(&data)
            .arg("--")
            .arg(nofp_workload())
            .args(["--threads", "1", "--iterations", "20"]));
        // The directory goes with its guard: it is kept until the report below is read.
        (data, dir)
    };
    let fp_stacks = report_json(&fp_walk_of_nofp, &["--by", "stack", "--domain", "user"]);
    let whole = fp_stacks["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| sites.iter().any(|f| s["frames"][0]["function"] == f.as_str()))
        .filter(|s| function_names(s).ends_with(&["exercise".into(), "start_thread".into(), "clone3".into()]))
        .count();
    assert_eq!(whole, 0, "frame pointers cannot walk code built without them");
    // And every such stack says it was cut short (before, the kernel's walk ended at the
    // allocator's caller, a register that was no frame pointer holding a small number, and
    // 97 % of them read as whole), so the warning to record with DWARF comes.
    let user = &fp_stacks["stacks"]["user"];
    assert_eq!(user["allocs_truncated"], user["allocs_with_stack"], "{:#}", fp_stacks["stacks"]);
    let warned = fp_stacks["warnings"].as_array().unwrap().iter().any(|w| {
        w.as_str().unwrap().contains("100.0% of its allocations") && w.as_str().unwrap().contains("--call-graph dwarf")
    });
    assert!(warned, "{:#}", fp_stacks["warnings"]);
}

/// One recording of `--stacks` without frame pointers, shared by the tests below.
fn stacks_recording() -> &'static Value {
    static REPORT: OnceLock<Value> = OnceLock::new();
    REPORT.get_or_init(|| {
        require_root();
        let dir = scratch("unwind-stacks");
        let data = dir.join("rec.data");
        run(memtrace().args(["record", "-q", "-o"]).arg(&data).arg("--").arg(nofp_workload()).arg("--stacks"));
        report_json(&data, &["--by", "stack", "--domain", "user"])
    })
}

fn stack_of_size(bytes: u64) -> (Vec<String>, bool) {
    let report = stacks_recording();
    let s = report["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["bytes_req"] == bytes)
        .unwrap_or_else(|| panic!("no {bytes}-byte allocation in {report:#}"));
    (function_names(s), s["truncated"].as_bool().unwrap())
}

/// The program's entry, innermost last.
const FROM_MAIN: [&str; 4] = ["main", "__libc_start_call_main", "__libc_start_main_impl", "_start"];

#[test]
fn a_stack_through_a_signal_handler_continues_in_the_interrupted_code() {
    let (names, truncated) = stack_of_size(111);
    assert!(!truncated, "{names:?}");
    assert_eq!(names[..2], ["wl_signal_alloc", "on_signal"], "{names:?}");
    // Past the kernel's signal frame: the code raise() was running, then its callers.
    let raise = names.iter().position(|n| n == "wl_raise_site").unwrap_or_else(|| panic!("{names:?}"));
    assert!(raise > 3, "{names:?}");
    assert_eq!(names[raise + 1..raise + 2], ["wl_stack_tests"], "{names:?}");
    assert!(names.ends_with(&FROM_MAIN.map(String::from)), "{names:?}");
}

#[test]
fn a_stack_through_libc_calling_back_into_the_program_is_whole() {
    // The comparator (frame pointers or not) called from qsort's merge sort (libc, no frame
    // pointers), called from the program: a mixed stack.
    let (names, truncated) = stack_of_size(222);
    assert!(!truncated, "{names:?}");
    assert_eq!(names[0], "wl_sort_compare");
    assert!(names.iter().any(|n| n.contains("qsort")), "{names:?}");
    let site = names.iter().position(|n| n == "wl_sort_site").unwrap_or_else(|| panic!("{names:?}"));
    assert_eq!(names[site + 1], "wl_stack_tests", "{names:?}");
    assert!(names.ends_with(&FROM_MAIN.map(String::from)), "{names:?}");
}

#[test]
fn a_stack_that_parts_from_the_previous_one_above_a_shared_frame_is_its_own() {
    // Twin callers of one path: the path's frames are where the previous allocation's
    // were, the twin's return address is not (`reuse` checks it on the stack).
    for (bytes, twin) in [(555, "wl_twin_a"), (666, "wl_twin_b")] {
        let (names, truncated) = stack_of_size(bytes);
        assert!(!truncated, "{names:?}");
        assert_eq!(names[..4], ["wl_twin_inner", "wl_twin_mid", twin, "wl_stack_tests"], "{names:?}");
        assert!(names.ends_with(&FROM_MAIN.map(String::from)), "{names:?}");
    }
}

#[test]
fn deep_stacks_are_whole_up_to_the_limit_and_marked_truncated_beyond() {
    // 400 recursive calls: 1 + 401 + 1 + 4 = 407 frames, all there (deeper than a
    // kernel walk's 255, as a chain of nested Python imports is).
    let (names, truncated) = stack_of_size(333);
    assert!(!truncated, "{names:?}");
    assert_eq!(names[0], "wl_deep_alloc");
    assert_eq!(names.iter().filter(|n| *n == "wl_recurse").count(), 401);
    assert!(
        names.ends_with(
            &["wl_stack_tests".to_string()].into_iter().chain(FROM_MAIN.map(String::from)).collect::<Vec<_>>()
        )
    );
    // 600: cut at MAX_USER_DEPTH (511) frames, and said so.
    let (names, truncated) = stack_of_size(444);
    assert!(truncated, "{names:?}");
    assert_eq!(names.len(), memtrace_common::MAX_USER_DEPTH);
    assert!(names[1..].iter().all(|n| n == "wl_recurse"), "{names:?}");
    let report = stacks_recording();
    assert_eq!(report["stacks"]["user"]["allocs_truncated"], 1, "{:#}", report["stacks"]);
}

#[test]
fn a_walk_takes_the_frames_it_shares_with_the_previous_one_from_it() {
    require_root();
    let dir = scratch("unwind-reuse");
    let data = dir.join("rec.data");
    let pairs = 3000;
    // The frame-pointer build, walked by table (the default): %rbp is the same at each
    // frame from one allocation to the next, so the walks meet at the second frame.
    let program = Path::new(env!("MEMTRACE_WORKLOAD_DIR")).join("alloc_workload");
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .arg(program)
        .args(["--loop", &pairs.to_string()]));
    let report = report_json(&data, &["--by", "stack", "--domain", "user"]);
    let rows: Vec<&Value> =
        report["sites"].as_array().unwrap().iter().filter(|s| s["frames"][0]["function"] == "loop_pair").collect();
    // Every pair's stack whole and the same: one row.
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!((rows[0]["allocs"].as_u64(), rows[0]["truncated"].as_bool()), (Some(pairs), Some(false)));
    let names = function_names(rows[0]);
    assert_eq!(names, ["loop_pair", "loop_thread", "start_thread", "clone3"]);
    // Above the innermost two frames, the loop's walks took their frames from the walk
    // before (a thread moved to another CPU walks once in full there).
    let recorder = &report["recorder"];
    let reused = recorder["unwind_frames_reused"].as_u64().unwrap();
    let shared = 2 * pairs;
    assert!(reused >= shared * 9 / 10, "{reused} of {shared} frames reused: {recorder:#}");
}

/// A thread calling a few allocation sites in turn (a B-tree insert's buffers): each
/// site's stack repeats every fourth walk, not at the next one. The walks take them whole
/// from the CPU's last walks, checked on the stack: exact counts, whole stacks, one row a
/// site, and almost no frame stepped through by its rule.
#[test]
fn a_stack_repeated_from_one_of_the_last_walks_is_taken_whole() {
    require_root();
    let dir = scratch("unwind-cycle");
    let data = dir.join("rec.data");
    let rounds = 2000u64;
    // Without frame pointers: every stepped frame is a table walk's step.
    let program = Path::new(env!("MEMTRACE_WORKLOAD_DIR")).join("alloc_workload_nofp");
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .arg(program)
        .args(["--cycle", &rounds.to_string()]));
    let report = report_json(&data, &["--by", "stack", "--domain", "user"]);
    let sites = report["sites"].as_array().unwrap();
    for (site, bytes) in [("cycle_site_a", 24), ("cycle_site_b", 40), ("cycle_site_c", 56), ("cycle_site_d", 72)] {
        let rows: Vec<&Value> = sites.iter().filter(|s| s["frames"][0]["function"] == site).collect();
        assert_eq!(rows.len(), 1, "{site}: {rows:#?}");
        let row = rows[0];
        assert_eq!(
            (row["allocs"].as_u64(), row["bytes_req"].as_u64(), row["truncated"].as_bool()),
            (Some(rounds), Some(rounds * bytes), Some(false)),
            "{site}: {row:#}"
        );
        let names = function_names(row);
        assert_eq!(names[..3], [site, "wl_cycle", "main"], "{site}: {names:?}");
    }
    // Each walk after a site's first took the whole stack from one of the last four: of
    // the frames below `main`'s caller and above the first, none stepped.
    let recorder = &report["recorder"];
    let (frames, reused) =
        (recorder["unwind_frames"].as_u64().unwrap(), recorder["unwind_frames_reused"].as_u64().unwrap());
    assert!(frames >= 4 * rounds * 4, "{recorder:#}");
    assert!(frames - reused <= 4 * rounds * 11 / 10, "{reused} of {frames} frames reused: {recorder:#}");
}
