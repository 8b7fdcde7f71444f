//! Analysis of a real recording of the bundled workload: per-site figures found through the
//! symbolized frames, folded totals for every weight, the SVG and pprof exports, leaks,
//! filters — all exact against what the workload counted.
mod common;

use std::{
    collections::BTreeMap,
    io::Read as _,
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

use common::*;
use serde_json::Value;

/// One recording shared by the tests of this file.
fn recording() -> &'static (PathBuf, Value) {
    static RECORDING: OnceLock<(PathBuf, Value)> = OnceLock::new();
    RECORDING.get_or_init(|| {
        require_root();
        let dir = scratch("analysis").until_exit();
        let data = dir.join("analysis.data");
        let manifest_path = dir.join("manifest.json");
        // `--sample-bytes 0` is every allocation, as serve's is (the figures below are exact).
        run(memtrace()
            .args(["record", "-q", "--sample-bytes", "0", "-o"])
            .arg(&data)
            .arg("--")
            .arg(workload())
            .args(["--threads", "3", "--iterations", "120", "--leaks", "4", "--manifest"])
            .arg(&manifest_path));
        (data, manifest(&manifest_path))
    })
}

#[test]
fn per_site_figures_are_exact_through_symbolized_frames() {
    let (data, manifest) = recording();
    let report = report_json(data, &["--by", "site"]);
    for function in [
        "wl_malloc",
        "wl_malloc_large",
        "wl_calloc",
        "wl_posix_memalign",
        "wl_aligned_alloc",
        "wl_memalign",
        "wl_valloc",
        "wl_pvalloc",
        "wl_mmap",
        "wl_leak",
    ] {
        let want = expected(manifest, function);
        let got = site(&report, function).unwrap_or_else(|| panic!("no site {function}"));
        for figure in FIGURES {
            assert_eq!(got[figure], want[figure], "{function} {figure}");
        }
        // The site frame carries its source location; its caller follows.
        assert_eq!(got["frames"][0]["file"].as_str().map(|f| f.ends_with("alloc_workload.c")), Some(true), "{got:#}");
        assert_eq!(got["frames"][1]["function"], "exercise", "{function}");
        let frag = got["frag_pct"].as_f64().unwrap();
        let (req, alloc) = (want["bytes_req"].as_f64().unwrap(), want["bytes_alloc"].as_f64().unwrap());
        assert!((frag - (100.0 - 100.0 * req / alloc)).abs() < 0.01, "{function}: {frag}");
    }
    // realloc and reallocarray are called from two places each: their sites add up.
    for function in ["wl_realloc", "wl_reallocarray"] {
        let sites: Vec<&Value> =
            report["sites"].as_array().unwrap().iter().filter(|s| s["frames"][0]["function"] == function).collect();
        assert_eq!(sites.len(), 2, "{function}");
        let want = expected(manifest, function);
        for figure in FIGURES {
            let sum: u64 = sites.iter().map(|s| s[figure].as_u64().unwrap()).sum();
            assert_eq!(Some(sum), want[figure].as_u64(), "{function} {figure}");
        }
    }
    // Kernel sites are named after kernel functions.
    let kernel: Vec<&Value> = report["sites"].as_array().unwrap().iter().filter(|s| s["domain"] == "kernel").collect();
    assert!(!kernel.is_empty());
    for s in kernel {
        let name = s["frames"][0]["function"].as_str().unwrap();
        assert!(!name.starts_with("0x") && s["frames"][0]["kernel"] == true, "{s:#}");
    }
}

fn folded(data: &Path, weight: &str, extra: &[&str]) -> BTreeMap<String, u64> {
    let out = run(memtrace().args(["export", "--format", "folded", "--weight", weight, "-i"]).arg(data).args(extra));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (stack, value) = l.rsplit_once(' ').expect("stack value");
            (stack.to_string(), value.parse().expect("a count"))
        })
        .collect()
}

#[test]
fn folded_totals_are_exact_for_every_weight() {
    let (data, manifest) = recording();
    let report = report_json(data, &[]);
    let totals = &report["totals"];
    // Every row is in one of the domains: the user's, the allocator's reserved memory, the
    // kernel's.
    let both = |f: &str| ["user", "reserved", "kernel"].iter().map(|d| totals[d][f].as_u64().unwrap()).sum::<u64>();
    for (weight, figure) in [
        ("allocs", "allocs"),
        ("bytes", "bytes_req"),
        ("bytes-alloc", "bytes_alloc"),
        ("wasted", "wasted"),
        ("live", "live_bytes_req"),
    ] {
        let lines = folded(data, weight, &[]);
        assert_eq!(lines.values().sum::<u64>(), both(figure), "total of --weight {weight}");
        // Root first: the process, then the thread start, down to the allocating function.
        for function in ["wl_malloc", "wl_calloc", "wl_leak"] {
            let want = expected(manifest, function);
            let want = match figure {
                "wasted" => want["bytes_alloc"].as_u64().unwrap() - want["bytes_req"].as_u64().unwrap(),
                f => want[f].as_u64().unwrap(),
            };
            let got: u64 = lines
                .iter()
                .filter(|(stack, _)| {
                    stack.starts_with("alloc_workload;") && stack.ends_with(&format!(";exercise;{function}"))
                })
                .map(|(_, v)| v)
                .sum();
            assert_eq!(got, want, "{function} --weight {weight}");
        }
    }
    // Kernel frames follow the user frames that caused them, marked as perf does.
    let lines = folded(data, "allocs", &["--domain", "kernel"]);
    assert!(lines.keys().any(|s| s.contains(";main;") && s.contains("alloc_pipe_info_[k]")), "{lines:#?}");
}

#[test]
fn svg_flame_graph_renders() {
    let (data, _) = recording();
    let out = run(memtrace().args(["export", "--format", "svg", "--weight", "bytes-alloc", "-i"]).arg(data));
    let svg = String::from_utf8(out.stdout).unwrap();
    assert!(svg.starts_with("<?xml") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("wl_malloc_large") && svg.contains("memtrace: bytes allocated"));
}

/// profile.proto, as far as the test reads it, decoded by prost (an independent decoder).
mod pprof {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "14")]
        pub default_sample_type: i64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
        #[prost(int64, tag = "2")]
        pub line: i64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
    }
}

#[test]
fn pprof_profile_decodes_with_heap_sample_types() {
    use prost::Message as _;
    let (data, manifest) = recording();
    let out = run(memtrace().args(["export", "--format", "pprof", "-i"]).arg(data));
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&out.stdout[..]).read_to_end(&mut raw).expect("gzip");
    let profile = pprof::Profile::decode(&raw[..]).expect("a profile.proto message");
    let name = |i: i64| profile.string_table[i as usize].as_str();
    let types: Vec<&str> = profile.sample_type.iter().map(|t| name(t.r#type)).collect();
    assert_eq!(&types[..4], ["alloc_objects", "alloc_space", "inuse_objects", "inuse_space"]);
    assert_eq!(name(profile.default_sample_type), "alloc_space");
    let report = report_json(data, &[]);
    let total_allocs: i64 = profile.sample.iter().map(|s| s.value[0]).sum();
    let want =
        ["user", "reserved", "kernel"].iter().map(|d| report["totals"][d]["allocs"].as_i64().unwrap()).sum::<i64>();
    assert_eq!(total_allocs, want);
    // The samples whose leaf is wl_leak hold exactly the leaked blocks, still in use.
    let function_name = |id: u64| name(profile.function.iter().find(|f| f.id == id).unwrap().name).to_string();
    let leaf = |s: &pprof::Sample| {
        let loc = profile.location.iter().find(|l| l.id == s.location_id[0]).unwrap();
        function_name(loc.line[0].function_id)
    };
    let leaked: i64 = profile.sample.iter().filter(|s| leaf(s) == "wl_leak").map(|s| s.value[2]).sum();
    assert_eq!(Some(leaked), expected(manifest, "wl_leak")["live_allocs"].as_i64());
}

#[test]
fn leaks_are_listed_by_stack_with_their_age() {
    let (data, manifest) = recording();
    let report = report_json(data, &["--leaks"]);
    let leaks = report["leaks"].as_array().unwrap();
    let ours: Vec<&Value> = leaks.iter().filter(|l| l["frames"][0]["function"] == "wl_leak").collect();
    let blocks: u64 = ours.iter().map(|l| l["blocks"].as_u64().unwrap()).sum();
    assert_eq!(Some(blocks), expected(manifest, "wl_leak")["live_allocs"].as_u64());
    let bytes: Vec<u64> = leaks.iter().map(|l| l["bytes_alloc"].as_u64().unwrap()).collect();
    assert!(bytes.windows(2).all(|w| w[0] >= w[1]), "largest first: {bytes:?}");
    let by_age = report_json(data, &["--leaks", "--sort", "age"]);
    let ages: Vec<u64> =
        by_age["leaks"].as_array().unwrap().iter().map(|l| l["oldest_age_ns"].as_u64().unwrap()).collect();
    assert!(ages.windows(2).all(|w| w[0] >= w[1]), "oldest first: {ages:?}");
    // Nothing the workload leaked is a minute old.
    let old = report_json(data, &["--leaks", "--older-than", "60s"]);
    assert!(old["leaks"].as_array().unwrap().is_empty());
}

/// A command's session ends with its last event (its exit, and its memory freed), not when
/// memtrace had drained and detached: leaks' ages and the duration count to there.
#[test]
fn a_commands_session_lasts_from_its_first_event_to_its_last() {
    let (data, _) = recording();
    let dump = run(memtrace().args(["dump", "-i"]).arg(data));
    let times: Vec<f64> = String::from_utf8_lossy(&dump.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    let first = times.iter().copied().fold(f64::MAX, f64::min);
    let last = times.iter().copied().fold(0.0, f64::max);
    let span_ns = ((last - first) * 1e9).round() as u64;
    let report = report_json(data, &["--leaks", "--sort", "age"]);
    // `dump` prints microseconds, the recording's resolution.
    let duration = report["duration_ns"].as_u64().unwrap();
    assert!(duration.abs_diff(span_ns) <= 1_000, "{duration} ns of events, {span_ns} ns between the first and last");
    let oldest = report["leaks"][0]["oldest_age_ns"].as_u64().unwrap();
    assert!(oldest <= duration, "{oldest} {duration}");
}

#[test]
fn filters_and_sorting_select_what_they_say() {
    let (data, manifest) = recording();
    let calloc = report_json(data, &["--kind", "calloc"]);
    let sites = calloc["sites"].as_array().unwrap();
    assert!(!sites.is_empty() && sites.iter().all(|s| s["kinds"] == serde_json::json!(["calloc"])));
    assert_eq!(site(&calloc, "wl_calloc").unwrap()["allocs"], expected(manifest, "wl_calloc")["allocs"]);
    assert!(site(&calloc, "wl_malloc").is_none());

    let big = report_json(data, &["--min-size", "100000", "--domain", "user"]);
    for s in big["sites"].as_array().unwrap() {
        assert!(s["req_per_call"].as_f64().unwrap() >= 100000.0, "{s:#}");
    }
    let large = site(&big, "wl_malloc_large").unwrap();
    assert_eq!(large["allocs"], expected(manifest, "wl_malloc_large")["allocs"]);

    let top = report_json(data, &["--top", "3", "--sort", "allocs"]);
    let allocs: Vec<u64> = top["sites"].as_array().unwrap().iter().map(|s| s["allocs"].as_u64().unwrap()).collect();
    assert_eq!(allocs.len(), 3);
    assert!(allocs.windows(2).all(|w| w[0] >= w[1]));

    let by_process = report_json(data, &["--by", "process", "--domain", "user"]);
    let process = &by_process["sites"][0];
    assert_eq!(process["process"].as_str().map(|p| p.starts_with("alloc_workload [")), Some(true), "{process:#}");
}

#[test]
fn text_report_names_sites_and_units() {
    let (data, _) = recording();
    let out = run(memtrace().args(["report", "--top", "40", "-i"]).arg(data));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("wl_pvalloc (alloc_workload.c:"), "{text}");
    assert!(text.contains("MiB") && text.contains("lost events: 0"), "{text}");
}

#[test]
fn a_real_python_program_renders_as_a_flame_graph() {
    require_root();
    let dir = scratch("python");
    let data = dir.join("python.data");
    let python =
        ["/usr/bin/python3", "/usr/local/bin/python3"].into_iter().find(|p| Path::new(p).exists()).expect("python3");
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .arg(python)
        .args(["-c", "d = {i: str(i) * 10 for i in range(100000)}; print(len(d))"]));
    let lines = folded(&data, "bytes", &[]);
    assert!(lines.len() > 10, "{lines:#?}");
    assert!(lines.keys().all(|s| s.starts_with("python3")), "process name at the root");
    let out = Command::new(env!("CARGO_BIN_EXE_memtrace"))
        .args(["export", "--format", "svg", "-i"])
        .arg(&data)
        .output()
        .unwrap();
    assert!(out.status.success());
    let svg = String::from_utf8(out.stdout).unwrap();
    assert!(svg.contains("<svg") && svg.contains("python3"));
}

/// A call site reached from two places (an allocation wrapper, as GCC's `xmalloc`): its row
/// is named after what its stacks share and says how many callers they part into, not
/// after one caller's stack; by stack, each caller is a row of its own.
#[test]
fn a_wrapper_called_from_two_places_names_neither_caller_for_both() {
    require_root();
    let dir = scratch("wrapped");
    let data = dir.join("wrapped.data");
    let rounds = 300u64;
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .arg(workload())
        .args(["--wrapped", &rounds.to_string()]));
    let by_site = report_json(&data, &["--domain", "user"]);
    let rows: Vec<&Value> =
        by_site["sites"].as_array().unwrap().iter().filter(|s| s["frames"][0]["function"] == "wl_xmalloc").collect();
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!((rows[0]["allocs"].as_u64(), rows[0]["bytes_req"].as_u64()), (Some(2 * rounds), Some(2 * rounds * 48)));
    let label = rows[0]["site"].as_str().unwrap();
    assert!(label.starts_with("wl_xmalloc (alloc_workload.c:") && label.ends_with(") ← [2 callers]"), "{label}");

    let by_stack = report_json(&data, &["--by", "stack", "--domain", "user"]);
    let mut callers: Vec<(String, u64)> = by_stack["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["frames"][0]["function"] == "wl_xmalloc")
        .map(|s| (s["frames"][1]["function"].as_str().unwrap().to_string(), s["allocs"].as_u64().unwrap()))
        .collect();
    callers.sort();
    assert_eq!(callers, [("wl_wrapped_a".to_string(), rounds), ("wl_wrapped_b".to_string(), rounds)]);

    // `report`'s text shows the same name.
    let out = run(memtrace().args(["report", "--domain", "user", "--wide", "-i"]).arg(&data));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains(") ← [2 callers]\n"), "{text}");
    // Told that wl_xmalloc is an allocation wrapper (as valgrind's --alloc-fn), `report`
    // names a row per caller; the stack keeps the wrapper's frame, marked.
    let told = report_json(&data, &["--domain", "user", "--alloc-fn", "wl_xmalloc"]);
    let mut rows: Vec<(String, u64, bool)> = told["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["frames"][0]["function"] == "wl_xmalloc")
        .map(|s| {
            let label = s["site"].as_str().unwrap();
            (
                label.split(' ').next().unwrap().to_string(),
                s["allocs"].as_u64().unwrap(),
                s["frames"][0]["wrapper"] == true,
            )
        })
        .collect();
    rows.sort();
    assert_eq!(rows, [("wl_wrapped_a".to_string(), rounds, true), ("wl_wrapped_b".to_string(), rounds, true)]);
}

/// A report read by `head` (its pipe closed early) ends quietly, text or JSON (both written
/// as they are made, a row at a time).
#[test]
fn a_report_into_a_closed_pipe_ends_quietly() {
    let (data, _) = recording();
    for args in [
        &["report", "--by", "stack", "--wide"][..],
        &["report", "--by", "stack", "--format", "json"],
        &["report", "--leaks", "--format", "json"],
    ] {
        let whole = run(memtrace().args(args).arg("-i").arg(data)).stdout.len();
        // More than a pipe holds (64 KiB): the writer meets the closed end.
        assert!(whole > 96 << 10, "{args:?}: {whole} bytes");
        let mut child = memtrace()
            .args(args)
            .arg("-i")
            .arg(data)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = [0u8; 16];
        child.stdout.take().unwrap().read_exact(&mut first).unwrap();
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && stderr.is_empty(), "{args:?}: {} {stderr}", out.status);
    }
}
