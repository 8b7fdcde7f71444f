//! Allocators other than glibc's, for real: the bundled workload under each Debian allocator
//! preloaded (jemalloc, mimalloc, tcmalloc) must be counted exactly, with each allocator's
//! own usable sizes; C++ new/delete once each; a prefixed jemalloc found without flags;
//! a mimalloc linked into a Rust program (memtrace's own) found by its own names; an
//! allocator preloaded by a wrapper found at the exec; and the size models equal to the
//! real libraries' usable sizes for every size to 4 MiB.
mod common;

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use common::*;
use memtrace::sizes::{Family, usable::Model};
use memtrace_common::Kind;
use serde_json::Value;

const ARGS: [&str; 6] = ["--threads", "2", "--iterations", "100", "--leaks", "3"];
const LIBS: &str = "/usr/lib/x86_64-linux-gnu";

/// The Debian allocators: (file, family, library to link a test program with, its define).
const ALLOCATORS: [(&str, &str, &str, &str); 3] = [
    ("libjemalloc.so.2", "jemalloc", "-ljemalloc", "JE"),
    ("libmimalloc.so.2", "mimalloc", "-lmimalloc", "MI"),
    ("libtcmalloc_minimal.so.4", "tcmalloc", "-ltcmalloc_minimal", "TC"),
];

fn library(file: &str) -> PathBuf {
    let path = Path::new(LIBS).join(file);
    assert!(path.exists(), "{} missing: cargo xtask setup installs it", path.display());
    path
}

#[test]
fn each_preloaded_allocator_is_counted_exactly_with_its_own_usable_sizes() {
    require_root();
    let _sharing = sharing_the_machine();
    for (file, family, _, _) in ALLOCATORS {
        let lib = library(file);
        let dir = scratch(&format!("preload-{family}"));
        let data = dir.join("rec.data");
        let manifest_path = dir.join("manifest.json");
        run(memtrace()
            .args(["record", "-q", "--no-kernel", "-o"])
            .arg(&data)
            .env("LD_PRELOAD", &lib)
            .arg("--")
            .arg(workload())
            .args(ARGS)
            .arg("--manifest")
            .arg(&manifest_path));
        let manifest = manifest(&manifest_path);
        let report = report_json(&data, &["--by", "function"]);
        assert_eq!(report["lost_events"], 0, "{family}");
        let allocators = report["allocators"].as_array().unwrap();
        let first = &allocators[0];
        assert_eq!(first["family"], family, "{family}: {allocators:#?}");
        assert!(first["module"].as_str().unwrap().contains(file.split('.').next().unwrap()), "{first:#}");
        for expected in manifest["sites"].as_array().unwrap() {
            let name = expected["function"].as_str().unwrap();
            if expected["allocs"] == 0 {
                // an entry point this allocator lacks (jemalloc: pvalloc, reallocarray)
                assert!(site(&report, name).is_none_or(|s| s["allocs"] == 0), "{family} {name}");
                continue;
            }
            let got = site(&report, name).unwrap_or_else(|| panic!("{family}: no site {name}: {report:#}"));
            assert_eq!(got["allocator"], family, "{family} {name}");
            for figure in ["allocs", "frees", "bytes_req", "live_allocs", "live_bytes_req"] {
                assert_eq!(got[figure], expected[figure], "{family} {name}: {figure}");
            }
            if name != "wl_mmap" {
                assert_eq!(got["bytes_alloc"], expected["bytes_alloc"], "{family} {name}: bytes_alloc");
            }
        }
        // The allocator's own figures in the list: the workload's calls and its start-up.
        let wl_allocs: u64 = manifest["sites"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["function"] != "wl_mmap")
            .map(|s| s["allocs"].as_u64().unwrap())
            .sum();
        let listed = first["allocs"].as_u64().unwrap();
        assert!(listed >= wl_allocs && listed < wl_allocs + 200, "{family}: {listed} vs {wl_allocs}");
        // --allocator keeps only its allocations
        let only = report_json(&data, &["--by", "function", "--allocator", family]);
        assert_eq!(only["totals"]["user"]["allocs"].as_u64().unwrap(), listed, "{family}");
        let none = report_json(&data, &["--by", "function", "--allocator", "glibc"]);
        assert_eq!(none["totals"]["user"]["allocs"].as_u64().unwrap_or(0), 0, "{family}");
        // glibc's, probed but never the program's malloc, is in the JSON and not in the text
        // ("0 allocs, 0 frees; probed 20ms after … mapped it" read as calls missed).
        let idle: Vec<&Value> = allocators.iter().filter(|a| a["allocs"] == 0 && a["frees"] == 0).collect();
        let text = String::from_utf8(run(memtrace().args(["report", "-i"]).arg(&data)).stdout).unwrap();
        let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("allocator: ")).collect();
        assert_eq!(lines.len(), allocators.len() - idle.len(), "{family}: {lines:#?}");
        assert!(lines[0].contains(family) && !text.contains(": 0 allocs, 0 frees"), "{family}: {lines:#?}");
    }
}

/// Perl under a preloaded jemalloc (memtrace preloaded too, as `LD_PRELOAD=… memtrace
/// record` does): glibc's malloc, probed when perl maps the C library, is never called.
/// The JSON lists it, with its late probe; the text leaves it out (helper-50: "glibc: 0
/// allocs, 0 frees; … probed 20.0ms after perl mapped it" read as calls missed).
#[test]
fn an_allocator_no_call_reached_is_left_out_of_the_text() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("idle-allocator");
    let data = dir.join("rec.data");
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .env("LD_PRELOAD", library("libjemalloc.so.2"))
        .args(["--", "perl", "-e", "my %h; $h{$_} = $_ x 3 for 1..2000;"]));
    let report = report_json(&data, &[]);
    let allocators = report["allocators"].as_array().unwrap();
    let family = |f: &str| allocators.iter().find(|a| a["family"] == f);
    assert!(family("jemalloc").is_some_and(|a| a["allocs"].as_u64().unwrap() > 2000), "{allocators:#?}");
    let text = String::from_utf8(run(memtrace().args(["report", "-i"]).arg(&data)).stdout).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("allocator: ")).collect();
    assert!(lines.len() == 1 && lines[0].contains("(jemalloc)"), "{lines:#?}");
    if let Some(glibc) = family("glibc") {
        assert_eq!((&glibc["allocs"], &glibc["frees"]), (&Value::from(0), &Value::from(0)), "{glibc:#}");
    }
}

/// libstdc++'s emergency exception pool, allocated while the library loads and kept for the
/// process's life (heaptrack and valgrind have it freed at exit), is left out of `--leaks`,
/// which says so (helper-50: every C++ program's leaks read 71 KiB above heaptrack's).
#[test]
fn the_cxx_runtimes_own_pool_is_not_a_leak() {
    require_root();
    let dir = scratch("cxx-pool");
    let data = dir.join("rec.data");
    let program = workload().with_file_name("new_workload");
    run(memtrace().args(["record", "-q", "--no-kernel", "-o"]).arg(&data).arg("--").arg(&program).arg("100"));
    let all = report_json(&data, &["--domain", "user", "--by", "stack"]);
    // The pool: the one block allocated from libstdc++ under the dynamic loader, live.
    let module = |f: &Value| f["module"].as_str().unwrap_or("").to_string();
    let pool: Vec<&Value> = all["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            let user: Vec<&Value> = s["frames"].as_array().unwrap().iter().filter(|f| f["kernel"] == false).collect();
            let ours = user.iter().take_while(|f| module(f).starts_with("libstdc++")).count();
            ours > 0 && user.get(ours).is_some_and(|f| module(f).starts_with("ld-linux"))
        })
        .collect();
    assert_eq!(pool.len(), 1, "{all:#}");
    assert_eq!((&pool[0]["allocs"], &pool[0]["live_allocs"]), (&1.into(), &1.into()), "{:#}", pool[0]);
    let leaks = report_json(&data, &["--domain", "user", "--leaks"]);
    let kept = &leaks["leaks_kept_by_runtime"];
    assert_eq!(kept["blocks"], 1, "{kept:#}");
    assert_eq!(kept["bytes_req"], pool[0]["bytes_req"], "{kept:#}");
    let stacks: Vec<u64> = leaks["leaks"].as_array().unwrap().iter().map(|l| l["blocks"].as_u64().unwrap()).collect();
    let live = all["totals"]["user"]["live_allocs"].as_u64().unwrap();
    assert_eq!(stacks.iter().sum::<u64>() + 1, live, "every other live block is listed: {:#}", leaks["leaks"]);
    let text =
        String::from_utf8(run(memtrace().args(["report", "--leaks", "--domain", "user", "-i"]).arg(&data)).stdout)
            .unwrap();
    assert!(text.contains("(not counted: 1 block ("), "{text}");
}

/// Allocations and frees of the sites whose stack passes through `function`.
fn through(report: &Value, function: &str) -> (u64, u64) {
    report["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            s["frames"].as_array().unwrap().iter().any(|f| f["function"].as_str().is_some_and(|n| n.contains(function)))
        })
        .fold((0, 0), |(a, f), s| (a + s["allocs"].as_u64().unwrap(), f + s["frees"].as_u64().unwrap()))
}

#[test]
fn cxx_new_and_delete_are_counted_once_under_every_allocator() {
    require_root();
    let _sharing = sharing_the_machine();
    let program = workload().with_file_name("new_workload");
    for (file, family) in [(None, "glibc")].into_iter().chain(ALLOCATORS.iter().map(|a| (Some(a.0), a.1))) {
        let dir = scratch(&format!("new-{family}"));
        let data = dir.join("rec.data");
        let mut cmd = memtrace();
        cmd.args(["record", "-q", "--no-kernel", "-o"]).arg(&data);
        if let Some(file) = file {
            cmd.env("LD_PRELOAD", library(file));
        }
        run(cmd.arg("--").arg(&program).arg("5000"));
        let report = report_json(&data, &["--by", "stack"]);
        assert_eq!(report["lost_events"], 0);
        assert_eq!(through(&report, "wl_new_node"), (5000, 5000), "{family}: new Node / delete");
        assert_eq!(through(&report, "wl_new_array"), (1000, 1000), "{family}: new[] / delete[]");
        assert_eq!(through(&report, "wl_new_aligned"), (500, 500), "{family}: aligned new / delete");
        assert_eq!(report["allocators"][0]["family"], family);
    }
}

/// The label of the site row whose label starts with `function`, with its counts.
fn row_named<'a>(report: &'a Value, function: &str) -> Vec<&'a Value> {
    report["sites"].as_array().unwrap().iter().filter(|s| s["site"].as_str().unwrap().starts_with(function)).collect()
}

/// C++ allocations reach malloc through `operator new` and, for a container, the standard
/// library's growth code: each row is named after the program's function that allocated,
/// not one `operator new ← [3 callers]` row for all of them.
#[test]
fn cxx_sites_are_named_past_operator_new_and_the_standard_library() {
    require_root();
    let dir = scratch("cxx-sites");
    let data = dir.join("rec.data");
    let program = workload().with_file_name("new_workload");
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .arg("--")
        .arg(&program)
        .args(["100", "vector"]));
    let report = report_json(&data, &["--domain", "user"]);
    // A vector of 1000 ints grows 11 times: capacities 1, 2, 4, ... 1024.
    let vector = row_named(&report, "wl_fill_vector (new_workload.cpp:");
    assert_eq!(vector.len(), 1, "{report:#}");
    assert_eq!((vector[0]["allocs"].as_u64(), vector[0]["bytes_req"].as_u64()), (Some(11), Some(4 * 2047)));
    // Its stack still holds what it went through, marked.
    let frames = vector[0]["frames"].as_array().unwrap();
    let first = frames.iter().position(|f| f["function"].as_str().unwrap().starts_with("wl_fill_vector")).unwrap();
    assert!(first > 0 && frames[..first].iter().all(|f| f["wrapper"] == true), "{frames:#?}");
    assert!(frames[0]["function"].as_str().unwrap().starts_with("operator new"), "{frames:#?}");
    for (function, allocs) in [("wl_new_node", 100), ("wl_new_array", 20), ("wl_new_aligned", 10)] {
        let rows = row_named(&report, &format!("{function} (new_workload.cpp:"));
        assert_eq!(rows.len(), 1, "{function}: {report:#}");
        assert_eq!(rows[0]["allocs"], allocs, "{function}");
    }

    // By stack, each row is its whole stack from the innermost frame: the wrappers, then
    // the site once.
    let out = run(memtrace().args(["report", "--by", "stack", "--domain", "user", "--wide", "-i"]).arg(&data));
    let text = String::from_utf8(out.stdout).unwrap();
    let row = text.split("\nU ").find(|r| r.contains("wl_fill_vector")).unwrap_or_else(|| panic!("{text}"));
    assert!(row.lines().next().unwrap().ends_with("operator new(unsigned long)"), "{row}");
    assert_eq!(row.matches("wl_fill_vector (new_workload.cpp:").count(), 1, "{row}");

    // `--alloc-fn none`: the allocator's direct caller, as before.
    let direct = report_json(&data, &["--domain", "user", "--alloc-fn", "none"]);
    assert!(row_named(&direct, "wl_fill_vector").is_empty(), "{direct:#}");
    let new_rows = row_named(&direct, "operator new(unsigned long) ");
    assert_eq!(new_rows.iter().map(|r| r["allocs"].as_u64().unwrap()).sum::<u64>(), 11 + 100 + 20, "{direct:#}");
}

#[test]
fn a_prefixed_jemalloc_in_a_library_is_found_without_flags() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("prefixed");
    let data = dir.join("rec.data");
    let shim = workload().with_file_name("libxyz_je.so");
    // Preloaded (libjemalloc's initial-exec TLS cannot be dlopen'd): its dependency
    // libjemalloc comes after libc, whose malloc stays the program's; the workload then
    // finds xyz_je_malloc and xyz_je_free with dlopen + dlsym.
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&data)
        .env("LD_PRELOAD", &shim)
        .arg("--")
        .arg(workload())
        .arg("--dlopen")
        .arg(&shim)
        .arg("700")
        .args(["--dlopen-prefix", "xyz_je_"]));
    let report = report_json(&data, &["--by", "function"]);
    let s = site(&report, "wl_dlopen_alloc").unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!(s["allocs"], 700, "{s:#}");
    assert_eq!(s["frees"], 700, "{s:#}");
    assert_eq!(s["bytes_req"], 700 * 48);
    assert_eq!(s["bytes_alloc"], 700 * 48, "jemalloc's class of 48 bytes");
    assert_eq!(s["allocator"], "jemalloc");
    let allocators = report["allocators"].as_array().unwrap();
    let shim_row = allocators.iter().find(|a| a["prefix"] == "xyz_je_").unwrap_or_else(|| panic!("{allocators:#?}"));
    assert_eq!(shim_row["family"], "jemalloc");
    assert_eq!(shim_row["allocs"], 700);
    assert_eq!(shim_row["frees"], 700);
    // xyz_je_free calls dallocx, probed in libjemalloc too: one free each, reported once
    // (not 700 second reports; a stray free of the start-up may remain)
    let allocator_frees = report["totals"]["user"]["allocator_frees"].as_u64().unwrap();
    assert!(allocator_frees < 10, "{:#}", report["totals"]);
}

/// memtrace itself is a Rust program whose global allocator is the `mimalloc` crate:
/// mimalloc linked in under its own names, reached through `mi_malloc_aligned` & co., while
/// `malloc` stays glibc's.
#[test]
fn a_mimalloc_linked_into_a_rust_program_is_found_and_counted() {
    require_root();
    let _sharing = sharing_the_machine();
    let bin = Path::new(env!("CARGO_BIN_EXE_memtrace"));
    let found = memtrace::probes::allocator::prefixed(&[bin.to_path_buf()]);
    let mi = found.iter().find(|a| a.prefix == "mi_").unwrap_or_else(|| panic!("{found:#?}"));
    assert_eq!(mi.family, Family::Mimalloc);
    let names: Vec<&str> = mi.points.iter().flat_map(|p| p.symbols.iter().map(String::as_str)).collect();
    for f in ["mi_malloc_aligned", "mi_realloc_aligned", "mi_free"] {
        assert!(names.contains(&f), "{names:?}");
    }
    // A shared mimalloc that is the program's malloc is found as such, not twice.
    let shared = memtrace::probes::allocator::prefixed(&[library("libmimalloc.so.2")]);
    assert!(shared.iter().all(|a| a.prefix != "mi_"), "{shared:#?}");

    // memtrace recording memtrace reading a recording.
    let dir = scratch("rust-mimalloc");
    let (inner, outer) = (dir.join("inner.data"), dir.join("outer.data"));
    run(memtrace().args(["record", "-q", "--no-kernel", "-o"]).arg(&inner).arg("--").arg(workload()).args(ARGS));
    run(memtrace()
        .args(["record", "-q", "--no-kernel", "-o"])
        .arg(&outer)
        .arg("--")
        .arg(bin)
        .arg("report")
        .arg("-i")
        .arg(&inner));
    let report = report_json(&outer, &["--by", "function"]);
    let allocators = report["allocators"].as_array().unwrap();
    let row = allocators.iter().find(|a| a["prefix"] == "mi_").unwrap_or_else(|| panic!("{allocators:#?}"));
    assert_eq!(row["family"], "mimalloc");
    let (allocs, frees) = (row["allocs"].as_u64().unwrap(), row["frees"].as_u64().unwrap());
    assert!(allocs > 1000, "{row:#}");
    // Reading a recording frees nearly all it allocated before it exits.
    assert!(frees * 10 > allocs * 9, "{row:#}");
    let user = &report["totals"]["user"];
    assert!(user["unmatched_frees"].as_u64().unwrap() < 10, "{user:#}");
    // Its allocations are named after memtrace's own functions.
    let sites = report["sites"].as_array().unwrap();
    let functions: Vec<&str> = sites
        .iter()
        .flat_map(|s| s["frames"].as_array().into_iter().flatten())
        .filter_map(|f| f["function"].as_str())
        .collect();
    assert!(functions.iter().any(|f| f.starts_with("memtrace::report")), "{functions:#?}");

    // By call site, its rows are named after memtrace's code, past the Rust standard
    // library's allocation plumbing (`alloc::alloc::alloc`, `RawVec::grow_one`, ...).
    let by_site = report_json(&outer, &["--domain", "user"]);
    let labels: Vec<&str> = by_site["sites"].as_array().unwrap().iter().map(|s| s["site"].as_str().unwrap()).collect();
    let plumbing = |l: &&str| ["alloc::", "<alloc::", "hashbrown::", "__rust_"].iter().any(|p| l.starts_with(p));
    assert!(!labels.iter().any(plumbing), "{labels:#?}");
    assert!(labels.iter().any(|l| l.starts_with("memtrace::report")), "{labels:#?}");
    let direct = report_json(&outer, &["--domain", "user", "--alloc-fn", "none"]);
    let labels: Vec<&str> = direct["sites"].as_array().unwrap().iter().map(|s| s["site"].as_str().unwrap()).collect();
    assert!(labels.iter().any(plumbing), "{labels:#?}");
}

#[test]
fn an_allocator_preloaded_by_a_wrapper_is_traced_from_its_first_call() {
    require_root();
    let _sharing = sharing_the_machine();
    for (file, family, _, _) in ALLOCATORS {
        let dir = scratch(&format!("wrapper-{family}"));
        let data = dir.join("rec.data");
        let manifest_path = dir.join("manifest.json");
        let lib = library(file);
        // `env` runs on glibc; the program it execs preloads the allocator. The installed
        // allocator libraries are probed from the start, so no call is missed at the exec.
        run(memtrace()
            .args(["record", "-q", "--no-kernel", "-o"])
            .arg(&data)
            .arg("--")
            .arg("env")
            .arg(format!("LD_PRELOAD={}", lib.display()))
            .arg(workload())
            .args(ARGS)
            .arg("--manifest")
            .arg(&manifest_path));
        let manifest = manifest(&manifest_path);
        let report = report_json(&data, &["--by", "function"]);
        let families: Vec<&str> =
            report["allocators"].as_array().unwrap().iter().map(|a| a["family"].as_str().unwrap()).collect();
        assert!(families.contains(&family), "{families:?}");
        for expected in manifest["sites"].as_array().unwrap() {
            let name = expected["function"].as_str().unwrap();
            if expected["allocs"] == 0 || name == "wl_mmap" {
                continue;
            }
            let got = site(&report, name).unwrap_or_else(|| panic!("{family}: no site {name}: {report:#}"));
            assert_eq!(got["allocator"], family, "{name}");
            for figure in ["allocs", "frees", "bytes_req", "bytes_alloc", "live_allocs"] {
                assert_eq!(got[figure], expected[figure], "{family} {name}: {figure}");
            }
        }
    }
}

#[test]
fn a_running_process_with_a_preloaded_allocator_is_traced_by_pid() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("pid-tcmalloc");
    let data = dir.join("rec.data");
    let manifest_path = dir.join("manifest.json");
    let mut target = Command::new(workload())
        .env("LD_PRELOAD", library("libtcmalloc_minimal.so.4"))
        .args(ARGS)
        .args(["--wait-stdin", "--manifest"])
        .arg(&manifest_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut target_out = BufReader::new(target.stdout.take().unwrap());
    let mut ready = String::new();
    target_out.read_line(&mut ready).unwrap();
    assert_eq!(ready, "waiting\n");
    // memtrace itself runs without the preload: the allocator comes from the target's maps.
    let mut recorder = memtrace()
        .args(["record", "--no-kernel", "--pid", &target.id().to_string(), "-o"])
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
    assert_eq!(report["allocators"][0]["family"], "tcmalloc", "{:#}", report["allocators"]);
    let manifest = manifest(&manifest_path);
    for name in ["wl_malloc", "wl_calloc", "wl_realloc", "wl_posix_memalign", "wl_memalign", "wl_valloc"] {
        let expected = expected(&manifest, name);
        let got = site(&report, name).unwrap_or_else(|| panic!("no site {name}: {report:#}"));
        for figure in ["allocs", "frees", "bytes_req", "bytes_alloc"] {
            assert_eq!(got[figure], expected[figure], "{name}: {figure}");
        }
    }
}

/// `tests/programs/musl_alloc.c`, linked statically with musl, in `dir`.
fn musl_alloc(dir: &Path) -> PathBuf {
    let exe = dir.join("musl_alloc");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/musl_alloc.c");
    let status = Command::new("musl-gcc")
        .args(["-static", "-O2", "-g", "-o"])
        .arg(&exe)
        .arg(&source)
        .status()
        .expect("musl-gcc (cargo xtask setup installs musl-tools)");
    assert!(status.success());
    exe
}

#[test]
fn a_static_musl_malloc_is_recognised_and_keeps_the_request() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("musl");
    let exe = musl_alloc(&dir);
    let data = dir.join("rec.data");
    run(memtrace().args(["record", "-q", "--no-kernel", "-o"]).arg(&data).arg("--").arg(&exe));
    let report = report_json(&data, &["--by", "function"]);
    assert_eq!(report["allocators"][0]["family"], "musl", "{:#}", report["allocators"]);
    let s = site(&report, "wl_musl_malloc").unwrap_or_else(|| panic!("{report:#}"));
    assert_eq!(s["allocs"], 300);
    assert_eq!(s["frees"], 300);
    let req: u64 = (0..300).map(|i| 10 + i).sum();
    assert_eq!(s["bytes_req"], req);
    assert_eq!(s["bytes_alloc"], req, "musl's usable size is the request");
    // musl's start code has no call-frame information: its start functions end the stack,
    // which is whole, not cut short.
    assert_eq!(report["stacks"]["user"]["allocs_truncated"], 0, "{:#}", report["stacks"]);
    let by_stack = report_json(&data, &["--by", "stack"]);
    let frames: Vec<&str> =
        by_stack["sites"][0]["frames"].as_array().unwrap().iter().map(|f| f["function"].as_str().unwrap()).collect();
    assert_eq!(frames, ["wl_musl_malloc", "main", "libc_start_main_stage2"]);
}

/// A command that execs a program with an allocator of its own (rustup's `rustc` proxy
/// execs the toolchain's rustc and its jemalloc; here a script execs a static musl
/// program): found at the exec, its probes come too late for a short program's first
/// allocations; the next `record` of the command probes it from the start, and counts every
/// one.
#[test]
fn a_program_a_command_execd_with_its_own_allocator_is_probed_from_the_next_start() {
    require_root();
    let _sharing = sharing_the_machine();
    let dir = scratch("exec-own-allocator");
    let exe = musl_alloc(&dir);
    let script = dir.join("launch.sh");
    std::fs::write(&script, format!("#!/bin/sh\nexec {}\n", exe.display())).unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cache = dir.join("cache");
    let record = |name: &str| {
        let data = dir.join(name);
        let out = run(memtrace()
            .env("MEMTRACE_CACHE_DIR", &cache)
            .env("MEMTRACE_LOG", "debug")
            .args(["record", "-q", "--no-kernel", "-o"])
            .arg(&data)
            .arg("--")
            .arg(&script));
        (report_json(&data, &["--by", "function"]), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (first, _) = record("first.data");
    let seen_first = site(&first, "wl_musl_malloc").map_or(0, |s| s["allocs"].as_u64().unwrap());
    assert!(seen_first <= 300, "{seen_first}");
    // The first record says so: the program's allocator came after its exec.
    let late_warnings = |report: &Value| -> Vec<String> {
        let warnings = report["warnings"].as_array().unwrap().iter().map(|w| w.as_str().unwrap().to_string());
        warnings.filter(|w| w.contains("was probed")).collect()
    };
    let warned = late_warnings(&first);
    assert_eq!(warned.len(), 1, "{:#}", first["warnings"]);
    let expected = format!("exec'd {}, whose allocator (musl) was probed ", exe.display());
    assert!(warned[0].contains(&expected) && warned[0].contains("the next `record` of this command"), "{warned:?}");
    let musl = first["allocators"].as_array().unwrap().iter().find(|a| a["family"] == "musl");
    let late = &musl.unwrap_or_else(|| panic!("{:#}", first["allocators"]))["probed_late"];
    assert!(late["exec"] == true && late["after_ns"].as_u64().unwrap() > 0, "{late:#}");
    for run_name in ["second.data", "third.data"] {
        let (report, log) = record(run_name);
        assert!(log.contains("probing ahead the allocators of 1 programs"), "{log}");
        assert!(late_warnings(&report).is_empty(), "{run_name}: {:#}", report["warnings"]);
        let s = site(&report, "wl_musl_malloc").unwrap_or_else(|| panic!("{report:#}"));
        assert_eq!((&s["allocs"], &s["frees"]), (&300.into(), &300.into()), "{run_name}: {s:#}");
        let musl = report["allocators"].as_array().unwrap().iter().find(|a| a["family"] == "musl");
        assert!(musl.is_some_and(|a| a["allocs"] == 300), "{:#}", report["allocators"]);
    }
    // Without the cache, nothing is remembered or probed ahead.
    let data = dir.join("uncached.data");
    let out = run(memtrace()
        .env("MEMTRACE_CACHE_DIR", &cache)
        .env("MEMTRACE_LOG", "debug")
        .args(["record", "-q", "--no-kernel", "--no-unwind-cache", "-o"])
        .arg(&data)
        .arg("--")
        .arg(&script));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("probing ahead"));
}

/// Compiles the usable-size program against an allocator and returns its step function.
fn real_steps(link: &str, define: &str, api: &str, align: u64, dir: &Path) -> Vec<(u64, u64)> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/programs/usable_sizes.c");
    let exe = dir.join(format!("usable_{define}"));
    if !exe.exists() {
        let status = Command::new("cc")
            .args(["-O2", &format!("-D{define}"), "-o"])
            .arg(&exe)
            .arg(&source)
            .arg(link)
            .status()
            .unwrap();
        assert!(status.success(), "building {}", source.display());
    }
    let out = Command::new(&exe).args([api, &align.to_string(), "0", &(4u64 << 20).to_string()]).output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<u64> = l.split_whitespace().skip(2).map(|v| v.parse().unwrap()).collect();
            (f[0], f[1])
        })
        .collect()
}

#[test]
fn usable_sizes_equal_the_installed_libraries_for_every_size_to_4_mib() {
    let dir = scratch("usable");
    for (_, family, link, define) in ALLOCATORS {
        let model = Model::for_family(Family::from_name(family).unwrap(), None);
        let mut apis = vec![("malloc", Kind::Malloc, 0)];
        if family != "mimalloc" {
            apis.extend([("posix_memalign", Kind::PosixMemalign, 64), ("memalign", Kind::Memalign, 4096)]);
        }
        for (api, kind, align) in apis {
            let steps = real_steps(link, define, api, align, &dir);
            for (i, &(from, want)) in steps.iter().enumerate() {
                let to = steps.get(i + 1).map_or((4 << 20) + 1, |s| s.0);
                for size in from..to {
                    assert_eq!(model.usable(kind, size, align, None), Some(want), "{family} {api}({size}, {align})");
                }
            }
        }
    }
}
