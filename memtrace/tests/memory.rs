//! Memory over time, the peak, the size histograms and `diff`, on real recordings of the
//! bundled workload, against what the workload itself counted: the timeline peaks when its
//! manifest says, each site's bytes live at the peak are its known figures, the histogram
//! buckets hold the known sizes, and two runs that leak differently differ by exactly that.
mod common;
#[path = "common/pprof.rs"]
mod pprof;

use std::{collections::BTreeMap, path::PathBuf, sync::OnceLock};

use common::*;
use serde_json::Value;

/// `alloc_workload --peak`, recorded once for the tests of this file.
fn peak_recording() -> &'static (PathBuf, Value) {
    static RECORDING: OnceLock<(PathBuf, Value)> = OnceLock::new();
    RECORDING.get_or_init(|| {
        require_root();
        let _sharing = sharing_the_machine();
        let dir = scratch("peak").until_exit();
        let data = dir.join("peak.data");
        let manifest_path = dir.join("manifest.json");
        run(memtrace()
            .args(["record", "-q", "-o"])
            .arg(&data)
            .arg("--")
            .arg(workload())
            .args(["--peak", "--manifest"])
            .arg(&manifest_path));
        (data, manifest(&manifest_path))
    })
}

const PEAK_SITES: [&str; 4] = ["wl_peak_early", "wl_peak_base", "wl_peak_top", "wl_peak_late"];

#[test]
fn the_timeline_peaks_when_the_workload_says() {
    let (data, manifest) = peak_recording();
    let report = report_json(data, &["--domain", "user", "--timeline"]);
    let start = report["recording"]["start_monotonic_ns"].as_u64().unwrap();
    let reached = manifest["peak_reached_ns"].as_u64().unwrap() - start;
    let left = manifest["peak_left_ns"].as_u64().unwrap() - start;
    let interval = report["timeline_interval_ns"].as_u64().unwrap();
    let peak = &report["peak"]["user"];
    let at = peak["t_ns"].as_u64().unwrap();
    // The peak is the workload's: its last allocation of the peak returned just before the
    // workload read the clock, and nothing changed until it freed.
    assert!(
        at <= reached + interval && reached <= at + interval,
        "peak at {at} ns, workload: {reached} ns (±{interval})"
    );
    assert!(at < left, "the peak comes before the first free after it");
    let workload_peak = manifest["peak_live_bytes_req"].as_u64().unwrap();
    assert_eq!(workload_peak, 1_184_000);
    // Only the workload's sites were live at the peak (the C library's stdio buffers come
    // later): the peak is the workload's, to the byte.
    assert_eq!(peak["live_bytes_req"].as_u64(), Some(workload_peak), "{peak:#}");

    // The timeline: its highest interval is the peak's, within one of the workload's clock.
    let timeline = report["timeline"].as_array().unwrap();
    assert!(timeline.len() >= 100, "a resolution that fits the run: {} intervals", timeline.len());
    let user: Vec<u64> = timeline.iter().map(|t| t["user_live_bytes"].as_u64().unwrap()).collect();
    let highest = *user.iter().max().unwrap();
    assert_eq!(highest, workload_peak);
    let first = user.iter().position(|&v| v == highest).unwrap() as u64;
    assert_eq!(Some(first), peak["interval"].as_u64());
    assert!(first.abs_diff(reached / interval) <= 1, "interval {first}, the workload's {}", reached / interval);
    assert_eq!(timeline[first as usize]["t_ns"].as_u64(), Some(first * interval));
    // Before the peak, the early site's 800,000 bytes; after it, base and late: 984,000.
    assert!(
        user[..first as usize].iter().any(|&v| v >= 800_000) && user[..first as usize].iter().all(|&v| v < highest)
    );
    let pid = manifest["pid"].to_string();
    assert_eq!(timeline[first as usize]["processes"][&pid].as_u64(), Some(highest));
    // The site with the peak's largest share has its own series, flat at the peak.
    let top = site(&report, "wl_peak_top").unwrap();
    let series: Vec<u64> = top["timeline"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!((series.len(), series[first as usize]), (timeline.len(), 800_000));

    let out = run(memtrace().args(["report", "--timeline", "--domain", "user", "-i"]).arg(data));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("memory over time: ") && text.contains("user: peak 1.1 MiB at "), "{text}");
}

#[test]
fn each_sites_share_of_the_peak_is_known() {
    let (data, manifest) = peak_recording();
    let report = report_json(data, &["--domain", "user", "--sort", "peak"]);
    for name in PEAK_SITES {
        let want = expected(manifest, name);
        let got = site(&report, name).unwrap_or_else(|| panic!("no site {name}"));
        for figure in FIGURES.into_iter().chain(["live_bytes_req_at_peak", "live_allocs_at_peak"]) {
            assert_eq!(got[figure], want[figure], "{name}: {figure}");
        }
    }
    // The early site's own high is larger than its share of the peak, which is none.
    let early = site(&report, "wl_peak_early").unwrap();
    assert_eq!(
        (early["peak_live_bytes_req"].as_u64(), early["live_bytes_req_at_peak"].as_u64()),
        (Some(800_000), Some(0))
    );
    assert_eq!(report["sites"][0]["frames"][0]["function"], "wl_peak_top", "--sort peak: largest share first");

    // The same shares as a flame graph weight.
    let out =
        run(memtrace().args(["export", "--format", "folded", "--weight", "peak", "--domain", "user", "-i"]).arg(data));
    let folded = String::from_utf8(out.stdout).unwrap();
    let weight = |f: &str| -> u64 {
        folded
            .lines()
            .filter(|l| l.rsplit_once(' ').unwrap().0.ends_with(&format!(";{f}")))
            .map(|l| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap())
            .sum()
    };
    assert_eq!([weight("wl_peak_top"), weight("wl_peak_base"), weight("wl_peak_early")], [800_000, 384_000, 0]);
    let text = String::from_utf8(
        run(memtrace().args(["report", "--sort", "peak", "--domain", "user", "-i"]).arg(data)).stdout,
    )
    .unwrap();
    let header = text.lines().find(|l| l.ends_with("SITE")).unwrap();
    assert!(header.contains("PEAK"), "the column sorted by is shown: {header}");
}

/// The (largest size, allocations, bytes requested) of each bucket of a histogram.
fn buckets(h: &Value) -> Vec<(u64, u64, u64)> {
    h.as_array()
        .unwrap()
        .iter()
        .map(|b| (b["max_size"].as_u64().unwrap(), b["allocs"].as_u64().unwrap(), b["bytes_req"].as_u64().unwrap()))
        .collect()
}

/// The default mode, recorded with these leaks per thread (2 threads, 40 iterations).
fn default_recording(leaks: u32) -> PathBuf {
    let dir = scratch(&format!("leaks-{leaks}")).until_exit();
    let data = dir.join("run.data");
    run(memtrace().args(["record", "-q", "--no-kernel", "-o"]).arg(&data).arg("--").arg(workload()).args([
        "--threads",
        "2",
        "--iterations",
        "40",
        "--leaks",
        &leaks.to_string(),
    ]));
    data
}

/// Two runs of the default mode, 2 and 7 leaks per thread.
fn two_runs() -> &'static (PathBuf, PathBuf) {
    static RUNS: OnceLock<(PathBuf, PathBuf)> = OnceLock::new();
    RUNS.get_or_init(|| {
        require_root();
        let _sharing = sharing_the_machine();
        (default_recording(2), default_recording(7))
    })
}

#[test]
fn histogram_buckets_hold_the_known_sizes() {
    let (data, manifest) = peak_recording();
    let report = report_json(data, &["--domain", "user"]);
    let top = &expected(manifest, "wl_peak_top");
    let got = &site(&report, "wl_peak_top").unwrap()["size_histogram"];
    assert_eq!(buckets(got), [(16384, 50, 800_000)], "16,000 bytes: above 8 KiB, up to 16 KiB");
    assert_eq!((got[0]["min_size"].as_u64(), &got[0]["bytes_alloc"]), (Some(8193), &top["bytes_alloc"]));
    assert_eq!(buckets(&site(&report, "wl_peak_base").unwrap()["size_histogram"]), [(32768, 16, 384_000)]);
    let totals = buckets(&report["totals"]["user"]["size_histogram"]);
    let of = |max: u64| totals.iter().find(|b| b.0 == max).copied();
    assert_eq!(of(16384), Some((16384, 50, 800_000)));
    assert_eq!(of(32768), Some((32768, 86, 800_000 + 384_000 + 600_000)), "early, base and late");

    // The default mode: wl_malloc asks for 8 + (i % 13) * 7 bytes at iteration i, wl_leak 77.
    let (_, seven) = two_runs();
    let report = report_json(seven, &["--domain", "user"]);
    let mut want: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for i in 0..40u64 {
        let size = 8 + (i % 13) * 7;
        let bucket = want.entry(size.next_power_of_two()).or_default();
        bucket.0 += 2; // threads
        bucket.1 += 2 * size;
    }
    let want: Vec<(u64, u64, u64)> = want.into_iter().map(|(max, (n, bytes))| (max, n, bytes)).collect();
    assert_eq!(buckets(&site(&report, "wl_malloc").unwrap()["size_histogram"]), want);
    assert_eq!(buckets(&site(&report, "wl_leak").unwrap()["size_histogram"]), [(128, 14, 14 * 77)]);

    let text = String::from_utf8(run(memtrace().args(["report", "--histogram", "-i"]).arg(seven)).stdout).unwrap();
    assert!(text.contains("requested sizes, user:") && text.contains("≤ 128 B"), "{text}");
}

fn diff_json(old: &PathBuf, new: &PathBuf, extra: &[&str]) -> Value {
    let out = run(memtrace().args(["diff", "--format", "json"]).arg(old).arg(new).args(extra));
    serde_json::from_slice(&out.stdout).expect("diff JSON")
}

#[test]
fn diff_reports_exactly_the_extra_leaks() {
    let (two, seven) = two_runs();
    let d = diff_json(two, seven, &["--domain", "user"]);
    let sites = d["sites"].as_array().unwrap();
    let by_function =
        |name: &str| -> Vec<&Value> { sites.iter().filter(|s| s["frames"][0]["function"] == name).collect() };
    let leak = by_function("wl_leak");
    assert_eq!(leak.len(), 1, "one site, matched across the runs: {leak:#?}");
    let leak = leak[0];
    // 2 threads × 5 more leaks of 77 bytes.
    for (figure, want) in [
        ("allocs_delta", 10),
        ("bytes_req_delta", 770),
        ("live_allocs_delta", 10),
        ("live_bytes_req_delta", 770),
        ("frees_delta", 0),
    ] {
        assert_eq!(leak[figure].as_i64(), Some(want), "{figure}: {leak:#}");
    }
    assert_eq!((leak["old"]["live_allocs"].as_u64(), leak["new"]["live_allocs"].as_u64()), (Some(4), Some(14)));
    assert_eq!(leak["status"], "changed");
    assert_eq!(leak["frames"][1]["function"], "exercise", "frames as in report");
    // What the other sites did is the same in both runs (when their peak came is not).
    for name in ["wl_malloc", "wl_calloc", "wl_malloc_large", "wl_mmap", "wl_memalign"] {
        let s = by_function(name);
        assert_eq!(s.len(), 1, "{name}");
        for figure in FIGURES {
            // glibc serves a large block from the heap or by mmap depending on its dynamic
            // mmap threshold, which two threads move in no fixed order: the workload's own
            // malloc_usable_size total for wl_malloc_large differs between runs (by 3,080
            // bytes in 2 of 6 runs), so that one figure is not the same in both.
            if name == "wl_malloc_large" && figure == "bytes_alloc" {
                continue;
            }
            assert_eq!(s[0][&format!("{figure}_delta")], 0, "{name}: {figure}");
        }
    }
    // Largest growth first.
    let growth: Vec<i64> = sites.iter().map(|s| s["live_bytes_req_delta"].as_i64().unwrap()).collect();
    assert!(growth.windows(2).all(|w| w[0] >= w[1]), "{growth:?}");
    assert_eq!(d["totals"]["user"]["live_bytes_req_delta"].as_i64(), Some(770));

    let text =
        String::from_utf8(run(memtrace().args(["diff", "--domain", "user", "--wide"]).arg(two).arg(seven)).stdout)
            .unwrap();
    let line = text.lines().find(|l| l.contains("wl_leak (alloc_workload.c:")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.starts_with("U") && line.contains("+10") && line.contains("+770 B"), "{line}");
    // With the runs swapped, the leaks shrink.
    let back = diff_json(seven, two, &["--domain", "user", "--by", "function"]);
    let leak = back["sites"].as_array().unwrap().iter().find(|s| s["label"] == "wl_leak").unwrap();
    assert_eq!(leak["live_allocs_delta"].as_i64(), Some(-10));
}

#[test]
fn differential_exports_hold_the_change() {
    let (two, seven) = two_runs();
    let out = run(memtrace()
        .args(["export", "--format", "folded", "--weight", "live", "--diff-base"])
        .arg(two)
        .arg("-i")
        .arg(seven));
    let folded = String::from_utf8(out.stdout).unwrap();
    let leak: Vec<&str> = folded.lines().filter(|l| l.contains(";exercise;wl_leak ")).collect();
    assert_eq!(leak.len(), 1, "{folded}");
    assert!(leak[0].ends_with(&format!(" {} {}", 4 * 77, 14 * 77)), "stack old new: {}", leak[0]);

    // pprof: the base's samples negated; what is left at wl_leak is the extra leaks.
    let out = run(memtrace().args(["export", "--format", "pprof", "--diff-base"]).arg(two).arg("-i").arg(seven));
    let p = pprof::decode_gzipped(&out.stdout);
    let at_leak: Vec<&pprof::Sample> =
        p.sample.iter().filter(|s| p.functions(s).first().is_some_and(|f| f == "wl_leak")).collect();
    let base = at_leak.iter().filter(|s| s.label.iter().any(|l| p.string(l.key) == "pprof::base")).count();
    assert_eq!((at_leak.len(), base), (2, 1), "one sample from each run");
    let inuse: i64 = at_leak.iter().map(|s| s.value[2]).sum();
    assert_eq!(inuse, 10, "inuse_objects: the extra leaks");
    let svg = run(memtrace()
        .args(["export", "--format", "svg", "--weight", "allocs", "--diff-base"])
        .arg(two)
        .arg("-i")
        .arg(seven));
    let svg = String::from_utf8(svg.stdout).unwrap();
    assert!(svg.contains("memtrace: change in allocations") && svg.contains("wl_leak"));
}

#[test]
fn address_space_reserved_with_prot_none_is_not_user_memory() {
    require_root();
    let dir = scratch("reserve");
    let data = dir.join("reserve.data");
    // 16 GiB of address space (as cuInit reserves), 1 MiB of memory.
    run(memtrace()
        .args(["record", "-q", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(["--reserve", "17179869184"]));
    let report = report_json(&data, &["--by", "function"]);
    let reserve = site(&report, "wl_reserve").expect("the reservation's site");
    assert_eq!(reserve["domain"], "reserved", "{reserve:#}");
    assert_eq!(reserve["live_bytes_req"], 17_179_869_184u64);
    let rw = site(&report, "wl_map_rw").expect("the read-write mapping's site");
    assert_eq!(rw["domain"], "user", "{rw:#}");
    assert_eq!(rw["live_bytes_req"], 1u64 << 20);
    let user = &report["totals"]["user"];
    assert!(user["live_bytes_req"].as_u64().unwrap() < 1 << 30, "the reservation counted as user memory: {user:#}");
    assert!(report["totals"]["reserved"]["live_bytes_req"].as_u64().unwrap() >= 17_179_869_184);
}

/// mremap moves, resizes and copies mappings: each call is recorded as what it does, the
/// old mapping unmapped (all of it, or the part it moved) and the new one mapped at the
/// caller's site, so a mapping moved then unmapped is not left live at its old address;
/// as its mmap was: a file's read-only view not at all, a reservation as reserved.
#[test]
fn mappings_moved_resized_and_copied_by_mremap_are_followed() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("remap");
    let data = dir.join("remap.data");
    let rounds = 20u64;
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(["--remap", &rounds.to_string()]));
    let report = report_json(&data, &["--by", "function"]);
    for (function, bytes) in
        [("wl_remap_map", 8192u64), ("wl_remap_grow", 65536), ("wl_remap_shrink", 8192), ("wl_remap_copy", 8192)]
    {
        let s = site(&report, function).unwrap_or_else(|| panic!("{function}: {report:#}"));
        let figures: Vec<u64> =
            ["allocs", "frees", "bytes_req", "live_allocs", "live_bytes_req"].map(|f| s[f].as_u64().unwrap()).into();
        assert_eq!(figures, [rounds, rounds, rounds * bytes, 0, 0], "{function}: {s:#}");
        assert_eq!(s["kinds"], serde_json::json!(["mmap"]), "{function}");
    }
    // A read-only view of a file is no memory, moved or not (mremap has no protection
    // argument: the probe looks the mapping up); a reservation stays reserved.
    // (The lookup only tries the memory map's lock: a single-threaded program mremapping
    // finds it free, and the calls it could not look up are counted.)
    assert_eq!(report["recorder"]["mremaps_unlooked"], 0, "{:#}", report["recorder"]);
    assert!(site(&report, "wl_remap_view").is_none(), "a file's view recorded: {report:#}");
    let reserve = site(&report, "wl_remap_reserve").unwrap_or_else(|| panic!("wl_remap_reserve: {report:#}"));
    let figures: Vec<u64> =
        ["allocs", "frees", "bytes_req", "live_bytes_req"].map(|f| reserve[f].as_u64().unwrap()).into();
    assert_eq!(figures, [2 * rounds, 2 * rounds, rounds * 18 * 4096, 0], "{reserve:#}");
    assert_eq!(reserve["domain"], "reserved", "{reserve:#}");
    let user = &report["totals"]["user"];
    assert_eq!(user["unmatched_frees"], 0, "a copy's original (MREMAP_DONTUNMAP) is unmapped once: {user:#}");
    assert_eq!(user["live_bytes_req"], 0, "{user:#}");
    // At most: the mapped page left of the first mapping and the 16 pages it grew to.
    assert_eq!(user["peak_live_bytes_req"], 4096 + 65536, "{user:#}");
    let mmaps = &report["user_mmaps"];
    assert_eq!((mmaps["calls"].as_u64(), mmaps["remaps"].as_u64()), (Some(rounds), Some(3 * rounds)), "{mmaps:#}");
    // dump: each mremap with the mapping it came from (but the copy's, which stays).
    let dump = String::from_utf8(run(memtrace().args(["dump", "-i"]).arg(&data)).stdout).unwrap();
    let remaps: Vec<&str> = dump.lines().filter(|l| l.contains(" mremap 0x")).collect();
    assert_eq!(remaps.len() as u64, 3 * rounds, "{dump}");
    assert_eq!(remaps.iter().filter(|l| l.contains(" old=0x")).count() as u64, 2 * rounds, "{dump}");
    let reserved: Vec<&str> = dump.lines().filter(|l| l.contains(" mremap_reserve 0x")).collect();
    assert_eq!(reserved.iter().filter(|l| l.contains(" old=0x")).count() as u64, rounds, "{dump}");
    // The moves', the reservations' and the views' (not the copy's): a view's unmapping
    // frees nothing recorded, quietly.
    assert_eq!(dump.lines().filter(|l| l.contains(" munmap 0x") && l.contains("(mremap)")).count() as u64, 4 * rounds);
}
